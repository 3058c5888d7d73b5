//! splitmix64, the one mixing function behind every seed, noise stream and
//! test generator here (Steele, Lea and Flood's finalizer). Changing it
//! changes every seeded result, so it lives once. And `fingerprint`, the
//! hash workers compare settings by.

/// The golden-ratio increment of a splitmix64 sequence.
pub const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64's output function: a bijection of `z` with full avalanche.
#[inline(always)]
pub fn finalize(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A splitmix64 sequence: deterministic test data without a dependency.
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GAMMA);
        finalize(self.0)
    }
}

/// A stable 64-bit fingerprint of a configuration's text (BLAKE3's first
/// eight bytes): what workers compare to agree on a setting.
pub fn fingerprint(text: &str) -> u64 {
    u64::from_le_bytes(blake3::hash(text.as_bytes()).as_bytes()[..8].try_into().unwrap())
}

#[cfg(test)]
mod tests {
    #[test]
    fn matches_the_published_splitmix64_sequence() {
        // The first outputs of splitmix64 seeded with 0 (Vigna's reference code).
        let mut s = super::SplitMix(0);
        assert_eq!([s.next_u64(), s.next_u64(), s.next_u64()], [0xE220_A839_7B1D_CDAF, 0x6E78_9E6A_A1B9_65F4, 0x06C4_5D18_8009_454F]);
    }
}
