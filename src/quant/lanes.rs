//! Fixed-width lanes in 64-bit words: the wire form of codes and masks.
//!
//! Value `i` sits in lane `i % per_word` of word `i / per_word`, where
//! `per_word = 64 / width`; a lane never straddles two words. Because of that,
//! adding two packed arrays word by word adds every lane on its own as long
//! as no lane sum exceeds `2^width - 1`: an MPI SUM of packed words sums the
//! codes of every worker exactly, with codes sent as `code - lo` in lanes
//! wide enough for `workers * (hi - lo)`.

use rayon::prelude::*;

use crate::error::{Error, Result};

/// Words per parallel task.
const TASK_WORDS: usize = 1 << 13;

/// Bits that hold every value in `0..=max` (at least 1).
pub fn width_for(max: u64) -> u32 {
    (64 - max.leading_zeros()).max(1)
}

/// Words that `n` values of `width` bits take.
pub fn words_for(n: usize, width: u32) -> usize {
    n.div_ceil((64 / width) as usize)
}

/// Packs values (each `< 2^width`, the caller's invariant, checked in debug builds).
pub fn pack(values: impl ExactSizeIterator<Item = u64>, width: u32) -> Vec<u64> {
    let per = (64 / width) as usize;
    let mut out = vec![0u64; words_for(values.len(), width)];
    for (i, v) in values.enumerate() {
        debug_assert!(width == 64 || v >> width == 0, "value {v} does not fit {width} bits");
        out[i / per] |= v << ((i % per) as u32 * width);
    }
    out
}

/// Packs `value(i)` for `i` in `0..n` (each `< 2^width`), words in parallel.
pub fn pack_with(n: usize, width: u32, value: impl Fn(usize) -> u64 + Sync) -> Vec<u64> {
    let mut bytes = vec![0u8; 8 * words_for(n, width)];
    pack_into_bytes(n, width, value, &mut bytes);
    from_bytes(&bytes).expect("whole words")
}

/// As `pack_with`, writing the words' little-endian bytes straight into
/// `out` (`8 * words_for(n, width)` bytes): the wire form without a copy.
pub fn pack_into_bytes(n: usize, width: u32, value: impl Fn(usize) -> u64 + Sync, out: &mut [u8]) {
    let per = (64 / width) as usize;
    assert_eq!(out.len(), 8 * words_for(n, width), "packed lanes need whole words");
    let fill = |first_word: usize, bytes: &mut [u8]| {
        for (j, word) in bytes.chunks_exact_mut(8).enumerate() {
            let base = (first_word + j) * per;
            let mut acc = 0u64;
            for (lane, i) in (base..(base + per).min(n)).enumerate() {
                acc |= value(i) << (lane as u32 * width);
            }
            word.copy_from_slice(&acc.to_le_bytes());
        }
    };
    if out.len() > 8 * TASK_WORDS {
        out.par_chunks_mut(8 * TASK_WORDS).enumerate().for_each(|(t, b)| fill(t * TASK_WORDS, b));
    } else {
        fill(0, out);
    }
}

/// Unpacks `n` values of `width` bits; errors on a wrong word count.
pub fn unpack(words: &[u64], n: usize, width: u32) -> Result<impl Iterator<Item = u64> + '_> {
    if !(1..=64).contains(&width) {
        return Err(Error::Transport(format!("malformed message: lane width {width}")));
    }
    if words.len() != words_for(n, width) {
        return Err(Error::SizeMismatch { what: "packed lanes (words)", expected: words_for(n, width), got: words.len() });
    }
    let per = 64 / width;
    let mask = if width == 64 { u64::MAX } else { (1u64 << width) - 1 };
    Ok(words.iter().flat_map(move |&w| (0..per).map(move |lane| (w >> (lane * width)) & mask)).take(n))
}

/// Unpacks `out.len()` values into `out` with `f(value)`, words in parallel.
pub fn unpack_into<T: Send>(words: &[u64], width: u32, out: &mut [T], f: impl Fn(u64) -> T + Sync) -> Result<()> {
    let n = out.len();
    if !(1..=64).contains(&width) || words.len() != words_for(n, width) {
        return Err(Error::SizeMismatch { what: "packed lanes (words)", expected: words_for(n, width.clamp(1, 64)), got: words.len() });
    }
    let per = (64 / width) as usize;
    let mask = if width == 64 { u64::MAX } else { (1u64 << width) - 1 };
    let work = |w0: usize, out: &mut [T]| {
        for (w, vals) in words[w0..].iter().zip(out.chunks_mut(per)) {
            for (lane, o) in vals.iter_mut().enumerate() {
                *o = f((w >> (lane as u32 * width)) & mask);
            }
        }
    };
    if words.len() > TASK_WORDS {
        out.par_chunks_mut(TASK_WORDS * per).enumerate().for_each(|(t, o)| work(t * TASK_WORDS, o));
    } else {
        work(0, out);
    }
    Ok(())
}

/// Words as little-endian bytes, and back (the length must be a multiple of 8).
pub fn to_bytes(words: &[u64]) -> Vec<u8> {
    if cfg!(target_endian = "little") {
        // SAFETY: any u64 slice is readable as bytes; on little-endian they are the wire's order.
        unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), std::mem::size_of_val(words)) }.to_vec()
    } else {
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }
}

pub fn from_bytes(bytes: &[u8]) -> Result<Vec<u64>> {
    if bytes.len() % 8 != 0 {
        return Err(Error::Transport(format!("malformed message: {} bytes is not a whole number of 64-bit words", bytes.len())));
    }
    Ok(bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_at_every_width() {
        for width in [1, 2, 3, 5, 7, 13, 21, 32, 63, 64] {
            let max = if width == 64 { u64::MAX } else { (1u64 << width) - 1 };
            let vals: Vec<u64> = (0..101u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15) & max).collect();
            let words = pack(vals.iter().copied(), width);
            assert_eq!(words.len(), words_for(101, width));
            assert_eq!(unpack(&words, 101, width).unwrap().collect::<Vec<_>>(), vals);
            assert_eq!(pack_with(101, width, |i| vals[i]), words);
            let mut back = vec![0u64; 101];
            unpack_into(&words, width, &mut back, |v| v).unwrap();
            assert_eq!(back, vals);
            assert_eq!(from_bytes(&to_bytes(&words)).unwrap(), words);
        }
        assert!(unpack(&[0, 0], 3, 2).is_err());
        assert!(from_bytes(&[0; 7]).is_err());
        assert_eq!((width_for(0), width_for(1), width_for(2), width_for(6), width_for(7), width_for(8)), (1, 1, 2, 3, 3, 4));
    }

    #[test]
    fn word_sums_are_lane_sums() {
        // 5 workers of codes in [-3, 3]: offsets 0..=6, sums up to 30 need 5 bits.
        let width = width_for(5 * 6);
        let workers: Vec<Vec<i32>> = (0..5).map(|w| (0..77).map(|i| ((i * 7 + w * 3) % 7) - 3).collect()).collect();
        let mut total = vec![0u64; words_for(77, width)];
        for codes in &workers {
            let words = pack(codes.iter().map(|&c| (c + 3) as u64), width);
            total.iter_mut().zip(&words).for_each(|(t, w)| *t += w);
        }
        let sums: Vec<i32> = unpack(&total, 77, width).unwrap().map(|v| v as i32 - 5 * 3).collect();
        let direct: Vec<i32> = (0..77).map(|i| workers.iter().map(|c| c[i]).sum()).collect();
        assert_eq!(sums, direct);
    }
}
