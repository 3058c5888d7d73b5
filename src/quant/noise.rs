//! Counter-based noise for stochastic rounding and random selection: the
//! value for element `i` of a stream is a keyed hash of `i`, so any element
//! can be drawn on its own, in any order, on any thread, and vector kernels
//! draw 8 or 16 at once.
//!
//! A stream's 64-bit seed (`stream_seed` of the configured seed, the
//! step, the key and the worker) and the high half of `i` give two 32-bit
//! keys (splitmix64); the low half of `i` goes through a two-round
//! multiply-xorshift hash (constants from Wellons' hash prospector, one of
//! its lowest-bias 32-bit functions) with the keys mixed in before each
//! round. Only 32-bit integer operations: the scalar reference below and
//! every vector kernel give the same bits on every machine.

use crate::hash;

/// The noise seed of one stream: the configured `seed`, the key's push
/// count, the key and the device (or worker), mixed so that every
/// (step, key, device) gets its own independent stream. QSGD's rounding
/// seeds each member's stream so; random-K's selection and PowerSGD's first
/// `Q` take `device = u64::MAX`, the same on every worker.
pub fn stream_seed(seed: u64, step: u64, key_hash: u64, device: u64) -> u64 {
    [step, key_hash, device].iter().fold(seed, |h, &x| hash::finalize((h ^ x).wrapping_add(hash::GAMMA)))
}

/// The keys of one stream over elements `block * 2^32 ..= block * 2^32 + (2^32 - 1)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Keys {
    k0: u32,
    k1: u32,
}

impl Keys {
    pub fn new(seed: u64, block: u64) -> Keys {
        let h = hash::finalize(seed ^ block.wrapping_add(1).wrapping_mul(hash::GAMMA));
        Keys { k0: h as u32, k1: (h >> 32) as u32 }
    }

    /// The two 32-bit keys (for kernels outside Rust: the CUDA ones).
    pub fn parts(self) -> (u32, u32) {
        (self.k0, self.k1)
    }
}

/// 32 random bits for the element whose index has low half `i`: for fixed
/// keys a bijection of `i`, so no two elements of a block share a draw.
#[inline(always)]
pub fn bits(k: Keys, i: u32) -> u32 {
    let mut x = i ^ k.k0;
    x ^= x >> 16;
    x = x.wrapping_mul(0x21f0_aaad);
    x ^= (x >> 15) ^ k.k1;
    x = x.wrapping_mul(0x735a_2d97);
    x ^ (x >> 15)
}

const TWO_POW_MINUS_24: f32 = 1.0 / (1u32 << 24) as f32;

/// A uniform float in [0, 1) on a grid of 2^-24 (every value exact).
#[inline(always)]
pub fn unit(k: Keys, i: u32) -> f32 {
    // via i32: a signed conversion is one vector instruction on x86
    ((bits(k, i) >> 8) as i32) as f32 * TWO_POW_MINUS_24
}

/// `unit` for element `i` of the stream `seed`: the scalar reference that
/// every kernel matches, and the draw of code that takes one at a time.
pub fn uniform(seed: u64, i: u64) -> f32 {
    unit(Keys::new(seed, i >> 32), i as u32)
}

/// Splits elements `offset..offset + len` where the keys change (at
/// multiples of 2^32): `f(keys, low half of the first index, positions
/// within 0..len)`. Kernels then count a `u32` index up without overflow.
pub fn spans(seed: u64, offset: usize, len: usize, mut f: impl FnMut(Keys, u32, std::ops::Range<usize>)) {
    let mut at = 0;
    while at < len {
        let i = (offset + at) as u64;
        let end = ((((i >> 32) + 1) << 32).min((offset + len) as u64) - offset as u64) as usize;
        f(Keys::new(seed, i >> 32), i as u32, at..end);
        at = end;
    }
}

#[inline(always)]
fn fill_body(k: Keys, first: u32, out: &mut [f32]) {
    for (j, o) in out.iter_mut().enumerate() {
        *o = unit(k, first.wrapping_add(j as u32));
    }
}

crate::isa::multiversion! {
    /// `unit` of elements `first..` into `out` (a test of the vector
    /// kernels: the quantizers inline `unit` into their own loops).
    fn fill_kernel[][](k: Keys, first: u32, out: &mut [f32]) -> () = fill_body;
}

/// Uniforms of elements `offset..offset + out.len()` of stream `seed`.
pub fn fill(isa: crate::isa::Isa, seed: u64, offset: usize, out: &mut [f32]) {
    spans(seed, offset, out.len(), |k, first, range| fill_kernel(isa, k, first, &mut out[range]));
}

/// Below this bound, `floor(u (j + 1))` is an exact integer product: `u`
/// is `b / 2^24` with `b < 2^24`, so `b (j + 1) < 2^53` and the f64
/// product of the definition is exact too.
pub const BELOW_EXACT: usize = 1 << 29;

#[inline(always)]
fn below_body(k: Keys, first: u32, j0: u32, out: &mut [u32]) {
    for (d, o) in out.iter_mut().enumerate() {
        let b = (bits(k, first.wrapping_add(d as u32)) >> 8) as u64;
        // j0 + d + 1 <= BELOW_EXACT (the caller's bound): no overflow, and
        // the product of two 32-bit values is one vector multiply.
        let range = j0.wrapping_add(d as u32).wrapping_add(1) as u64;
        *o = ((b * range) >> 24) as u32;
    }
}

crate::isa::multiversion! {
    fn below_kernel[][](k: Keys, first: u32, j0: u32, out: &mut [u32]) -> () = below_body;
}

/// `out[d] = floor(uniform(seed, offset + d) * (j0 + d + 1))`, a uniform
/// integer in `0..=j0 + d`, exactly as the f64 product computes it:
/// Floyd's draws for random-K. Needs `j0 + out.len() <= BELOW_EXACT`.
pub fn below(isa: crate::isa::Isa, seed: u64, offset: usize, j0: usize, out: &mut [u32]) {
    assert!(j0 + out.len() <= BELOW_EXACT, "noise::below: {} draws from {j0} pass 2^29", out.len());
    spans(seed, offset, out.len(), |k, first, range| {
        let j = (j0 + range.start) as u32;
        below_kernel(isa, k, first, j, &mut out[range])
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa::Isa;

    #[test]
    fn every_kernel_draws_what_the_scalar_reference_draws() {
        for (n, offset) in [(0usize, 0usize), (1, 0), (7, 3), (8, 0), (9, 1), (15, 0), (16, 0), (17, 5), (1000, 77), (70_000, 1 << 20)] {
            let want: Vec<f32> = (0..n).map(|j| uniform(42, (offset + j) as u64)).collect();
            for isa in Isa::available() {
                let mut got = vec![-1f32; n];
                fill(isa, 42, offset, &mut got);
                assert_eq!(got, want, "{isa:?} n={n} offset={offset}");
            }
        }
        // Across the 2^32 boundary the keys change; spans splits there.
        let offset = (1usize << 32) - 5;
        let want: Vec<f32> = (0..11).map(|j| uniform(9, (offset + j) as u64)).collect();
        let mut got = vec![0f32; 11];
        fill(Isa::detect(), 9, offset, &mut got);
        assert_eq!(got, want);
        assert_ne!(uniform(9, 5), uniform(9, 5 + (1 << 32)));
    }

    #[test]
    fn integer_draws_are_the_f64_products_of_the_definition() {
        let reference = |seed: u64, offset: usize, j0: usize, d: usize| ((uniform(seed, (offset + d) as u64) as f64 * (j0 + d + 1) as f64) as usize).min(j0 + d);
        // Small ranges, ranges where the product needs all 53 bits, and the
        // 2^32 boundary of the stream (keys change there).
        for (n, offset, j0) in [(0usize, 0usize, 0usize), (1, 0, 0), (17, 3, 5), (1000, 77, 1 << 20), (70_000, 1 << 20, BELOW_EXACT - 70_000), (40, (1 << 32) - 20, 123_456)] {
            let want: Vec<u32> = (0..n).map(|d| reference(31, offset, j0, d) as u32).collect();
            for isa in Isa::available() {
                let mut got = vec![u32::MAX; n];
                below(isa, 31, offset, j0, &mut got);
                assert_eq!(got, want, "{isa:?} n={n} offset={offset} j0={j0}");
            }
        }
    }

    #[test]
    fn the_stream_is_pinned() {
        // Changing these changes every seeded result on every machine: a
        // worker with an older build would round differently.
        let k = Keys::new(0, 0);
        let first: Vec<u32> = (0..4).map(|i| bits(k, i)).collect();
        assert_eq!(first, PINNED, "got {first:#010x?}");
        assert_eq!(uniform(1, 0), (bits(Keys::new(1, 0), 0) >> 8) as f32 / 16_777_216.0);
    }
    // Computed independently (Python, from the definition in the module docs).
    const PINNED: [u32; 4] = [0x962d_238a, 0xcd85_fb68, 0x7b7e_4838, 0x9bda_b16e];

    #[test]
    fn draws_look_uniform_and_independent() {
        let n = 1 << 20;
        let u: Vec<f32> = (0..n).map(|i| uniform(7, i as u64)).collect();
        assert!(u.iter().all(|&x| (0.0..1.0).contains(&x)));
        // mean 1/2 (sd of the mean 0.29 / 1024), 64 equal bins (chi-square, 63 dof)
        let mean = u.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 5.0 * 0.2887 / 1024.0, "mean {mean}");
        let mut bins = [0f64; 64];
        u.iter().for_each(|&x| bins[(x * 64.0) as usize] += 1.0);
        let e = n as f64 / 64.0;
        let chi2: f64 = bins.iter().map(|b| (b - e) * (b - e) / e).sum();
        assert!(chi2 < 120.0, "chi-square {chi2} over 63 degrees of freedom");
        // neighbours, and the same element in neighbouring streams, uncorrelated
        let corr = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(&x, &y)| (x as f64 - 0.5) * (y as f64 - 0.5)).sum::<f64>() / a.len() as f64 * 12.0;
        let next: Vec<f32> = (0..n).map(|i| uniform(8, i as u64)).collect();
        for (what, c) in [("lag 1", corr(&u[..n - 1], &u[1..])), ("lag 2", corr(&u[..n - 2], &u[2..])), ("seed + 1", corr(&u, &next))] {
            assert!(c.abs() < 5.0 / 1024.0, "{what}: correlation {c}");
        }
    }
}
