//! Fixed-width lanes in 64-bit words: the wire form of codes and masks.
//!
//! Value `i` sits in lane `i % per_word` of word `i / per_word`, where
//! `per_word = 64 / width`; a lane never straddles two words. Because of that,
//! adding two packed arrays word by word adds every lane on its own as long
//! as no lane sum exceeds `2^width - 1`: an MPI SUM of packed words sums the
//! codes of every worker exactly, with codes sent as `code - lo` in lanes
//! wide enough for `workers * (hi - lo)`.

use crate::error::{Error, Result};
use crate::isa::Isa;

/// Words per parallel piece (`par::chunks_of`).
const TASK_WORDS: usize = 1 << 13;

/// Bits that hold every value in `0..=max` (at least 1).
pub fn width_for(max: u64) -> u32 {
    (64 - max.leading_zeros()).max(1)
}

/// Words that `n` values of `width` bits take.
pub fn words_for(n: usize, width: u32) -> usize {
    n.div_ceil((64 / width) as usize)
}

/// Packs `value(i)` for `i` in `0..n` (each `< 2^width`) into `out`, one
/// slot per word, words in parallel; `put` stores a finished word.
fn pack_core<W: Send>(n: usize, width: u32, value: impl Fn(usize) -> u64 + Sync, out: &mut [W], put: impl Fn(&mut W, u64) + Sync) {
    let per = (64 / width) as usize;
    debug_assert_eq!(out.len(), words_for(n, width));
    let fill = |first_word: usize, slots: &mut [W]| {
        for (j, slot) in slots.iter_mut().enumerate() {
            let base = (first_word + j) * per;
            let mut acc = 0u64;
            for (lane, i) in (base..(base + per).min(n)).enumerate() {
                let v = value(i);
                debug_assert!(width == 64 || v >> width == 0, "value {v} does not fit {width} bits");
                acc |= v << (lane as u32 * width);
            }
            put(slot, acc);
        }
    };
    crate::par::chunks_of(out, TASK_WORDS, fill);
}

/// Packs `value(i)` for `i` in `0..n` (each `< 2^width`) into words.
pub fn pack_with(n: usize, width: u32, value: impl Fn(usize) -> u64 + Sync) -> Vec<u64> {
    let mut words = vec![0u64; words_for(n, width)];
    pack_core(n, width, value, &mut words, |w, v| *w = v);
    words
}

/// As `pack_with`, writing the words' little-endian bytes straight into
/// `out` (`8 * words_for(n, width)` bytes): the wire form without a copy.
pub fn pack_into_bytes(n: usize, width: u32, value: impl Fn(usize) -> u64 + Sync, out: &mut [u8]) {
    assert_eq!(out.len(), 8 * words_for(n, width), "packed lanes need whole words");
    // SAFETY: [u8; 8] has alignment 1 and the length is a multiple of 8.
    let words = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<[u8; 8]>(), out.len() / 8) };
    pack_core(n, width, value, words, |w, v| *w = v.to_le_bytes());
}

/// Packs `f(vals[i])` (each `< 2^width`) into `out`, one slot per word,
/// words in parallel; `put` stores a finished word. The fast path for
/// values in a slice: widths 1 to 32 are compiled each with its shifts
/// fixed (`pack_kernel`), for every instruction set.
fn pack_slice_core<T: Copy + Sync, O: Send>(vals: &[T], width: u32, f: impl Fn(T) -> u64 + Sync + Copy, out: &mut [O], put: impl Fn(&mut O, u64) + Sync + Copy) {
    assert!((1..=64).contains(&width) && out.len() == words_for(vals.len(), width), "{} values of {width} bits into {} words", vals.len(), out.len());
    let per = (64 / width) as usize;
    let isa = Isa::detect();
    crate::par::chunks_of(out, TASK_WORDS, |first_word, slots| {
        let vals = &vals[first_word * per..((first_word + slots.len()) * per).min(vals.len())];
        macro_rules! fixed {
            ($($w:literal)*) => {
                match width {
                    $($w => pack_kernel::<$w, T, O, _, _>(isa, vals, f, slots, put),)*
                    _ => pack_words(width, vals, f, slots, put),
                }
            };
        }
        fixed!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32)
    });
}

/// `vals` into words of `per` lanes of `width` bits (`out` holds exactly
/// the words they take).
#[inline(always)]
fn pack_words<T: Copy, O>(width: u32, vals: &[T], f: impl Fn(T) -> u64, out: &mut [O], put: impl Fn(&mut O, u64)) {
    let per = (64 / width) as usize;
    for (o, c) in out.iter_mut().zip(vals.chunks(per)) {
        let mut acc = 0u64;
        for (k, &v) in c.iter().enumerate() {
            let v = f(v);
            debug_assert!(width == 64 || v >> width == 0, "value {v} does not fit {width} bits");
            acc |= v << (k as u32 * width);
        }
        put(o, acc);
    }
}

#[inline(always)]
fn pack_fixed<const WIDTH: u32, T: Copy, O, F: Fn(T) -> u64, P: Fn(&mut O, u64)>(vals: &[T], f: F, out: &mut [O], put: P) {
    pack_words(WIDTH, vals, f, out, put)
}

crate::isa::multiversion! {
    fn pack_kernel[const WIDTH: u32, T: Copy, O, F: Fn(T) -> u64, P: Fn(&mut O, u64)][WIDTH, T, O, F, P](vals: &[T], f: F, out: &mut [O], put: P) -> () = pack_fixed;
}

/// Packs `f(vals[i])` (each `< 2^width`) into words.
pub fn pack_slice<T: Copy + Sync>(vals: &[T], width: u32, f: impl Fn(T) -> u64 + Sync + Copy) -> Vec<u64> {
    let mut words = vec![0u64; words_for(vals.len(), width)];
    pack_slice_core(vals, width, f, &mut words, |w, v| *w = v);
    words
}

/// As `pack_slice`, writing the words' little-endian bytes straight into
/// `out` (`8 * words_for(vals.len(), width)` bytes): the wire form without a copy.
pub fn pack_slice_into_bytes<T: Copy + Sync>(vals: &[T], width: u32, f: impl Fn(T) -> u64 + Sync + Copy, out: &mut [u8]) {
    assert_eq!(out.len(), 8 * words_for(vals.len(), width), "packed lanes need whole words");
    // SAFETY: [u8; 8] has alignment 1 and the length is a multiple of 8.
    let words = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<[u8; 8]>(), out.len() / 8) };
    pack_slice_core(vals, width, f, words, |w, v| *w = v.to_le_bytes());
}

/// Unpacks `out.len()` values from `words` words (`word_at(i)`) into `out`
/// with `f(value)`, words in parallel.
fn unpack_core<T: Send>(words: usize, word_at: impl Fn(usize) -> u64 + Sync, width: u32, out: &mut [T], f: impl Fn(u64) -> T + Sync) -> Result<()> {
    let n = out.len();
    if !(1..=64).contains(&width) || words != words_for(n, width) {
        return Err(Error::SizeMismatch { what: "packed lanes (words)", expected: words_for(n, width.clamp(1, 64)), got: words });
    }
    let per = (64 / width) as usize;
    let mask = if width == 64 { u64::MAX } else { (1u64 << width) - 1 };
    let work = |w0: usize, out: &mut [T]| {
        for (j, vals) in out.chunks_mut(per).enumerate() {
            let w = word_at(w0 + j);
            for (lane, o) in vals.iter_mut().enumerate() {
                *o = f((w >> (lane as u32 * width)) & mask);
            }
        }
    };
    // Pieces of whole words: the first value of each starts a word.
    crate::par::chunks_of(out, TASK_WORDS * per, |start, o| work(start / per, o));
    Ok(())
}

/// Unpacks `out.len()` values of `width` bits into `out` with `f(value)`;
/// errors on a wrong word count.
pub fn unpack_into<T: Send>(words: &[u64], width: u32, out: &mut [T], f: impl Fn(u64) -> T + Sync) -> Result<()> {
    unpack_core(words.len(), |i| words[i], width, out, f)
}

/// As `unpack_into`, reading the words' little-endian bytes (the wire form).
pub fn unpack_bytes_into<T: Send>(bytes: &[u8], width: u32, out: &mut [T], f: impl Fn(u64) -> T + Sync) -> Result<()> {
    if bytes.len() % 8 != 0 {
        return Err(Error::Transport(format!("malformed message: {} bytes is not a whole number of 64-bit words", bytes.len())));
    }
    unpack_core(bytes.len() / 8, |i| u64::from_le_bytes(bytes[8 * i..8 * i + 8].try_into().unwrap()), width, out, f)
}

/// Adds `n` values sent in lanes of `from` bits (`src`, the wire's bytes)
/// to `acc`, whose lanes are `width` bits wide (wide enough for the sum):
/// each value is moved into its wide lane, so the sum stays packed and the
/// wire keeps the narrow lanes. Every value must be at most `max`; the
/// caller bounds the number of sums. On an error `acc` is as it was (each
/// piece is checked whole before it is added).
pub fn add_widened(acc: &mut [u64], width: u32, src: &[u8], from: u32, n: usize, max: u64) -> Result<()> {
    if !(1..=64).contains(&from) || !(from..=64).contains(&width) {
        return Err(Error::Internal(format!("cannot widen {from}-bit lanes to {width} bits")));
    }
    let (words, narrow) = (words_for(n, width), words_for(n, from));
    if acc.len() != words || src.len() as u128 != 8 * narrow as u128 {
        return Err(Error::Transport(format!("malformed message: {n} values of {from} bits need {} bytes, the frame carries {}", 8 * narrow, src.len())));
    }
    let (per, per_from) = ((64 / width) as usize, (64 / from) as usize);
    let fmask = if from == 64 { u64::MAX } else { (1u64 << from) - 1 };
    let word_at = |i: usize| u64::from_le_bytes(src[8 * i..8 * i + 8].try_into().unwrap());
    // The wide words of `acc[start..start + len]`, or None when a value is above `max`.
    let widen = |start: usize, len: usize| -> Option<Vec<u64>> {
        let first = start * per;
        let (mut f, mut lane) = (first / per_from, first % per_from);
        let mut cur = word_at(f) >> (lane as u32 * from);
        let mut out = Vec::with_capacity(len);
        for i in 0..len {
            let mut wide = 0u64;
            for k in 0..per.min(n - (start + i) * per) {
                let x = cur & fmask;
                if x > max {
                    return None;
                }
                wide |= x << (k as u32 * width);
                lane += 1;
                if lane == per_from {
                    (f, lane) = (f + 1, 0);
                    cur = if f < narrow { word_at(f) } else { 0 };
                } else if from < 64 {
                    cur >>= from;
                }
            }
            out.push(wide);
        }
        Some(out)
    };
    let refused = std::sync::Mutex::new(Vec::new());
    crate::par::chunks(acc, |start, a| match widen(start, a.len()) {
        Some(wide) => a.iter_mut().zip(wide).for_each(|(w, x)| *w = w.wrapping_add(x)),
        None => refused.lock().unwrap().push(start),
    });
    let refused = refused.into_inner().unwrap();
    if refused.is_empty() {
        return Ok(());
    }
    crate::par::chunks(acc, |start, a| {
        if !refused.contains(&start) {
            let wide = widen(start, a.len()).expect("a piece that was added widens again");
            a.iter_mut().zip(wide).for_each(|(w, x)| *w = w.wrapping_sub(x));
        }
    });
    Err(Error::Transport(format!("malformed message: a packed code is above {max}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_at_every_width() {
        for width in [1, 2, 3, 5, 7, 13, 21, 32, 63, 64] {
            let max = if width == 64 { u64::MAX } else { (1u64 << width) - 1 };
            let vals: Vec<u64> = (0..101u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15) & max).collect();
            let words = pack_with(101, width, |i| vals[i]);
            assert_eq!(words.len(), words_for(101, width));
            assert_eq!(pack_slice(&vals, width, |v| v), words, "width {width}");
            let mut back = vec![0u64; 101];
            unpack_into(&words, width, &mut back, |v| v).unwrap();
            assert_eq!(back, vals);
            let mut bytes = vec![0u8; 8 * words.len()];
            pack_into_bytes(101, width, |i| vals[i], &mut bytes);
            assert_eq!(bytes, words.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<u8>>());
            back.fill(0);
            unpack_bytes_into(&bytes, width, &mut back, |v| v).unwrap();
            assert_eq!(back, vals);
        }
        assert!(unpack_into(&[0, 0], 2, &mut [0u64; 3], |v| v).is_err());
        assert!(unpack_bytes_into(&[0; 7], 2, &mut [0u64; 3], |v| v).is_err());
        assert_eq!((width_for(0), width_for(1), width_for(2), width_for(6), width_for(7), width_for(8)), (1, 1, 2, 3, 3, 4));
    }

    #[test]
    fn word_sums_are_lane_sums() {
        // 5 workers of codes in [-3, 3]: offsets 0..=6, sums up to 30 need 5 bits.
        let width = width_for(5 * 6);
        let workers: Vec<Vec<i32>> = (0..5).map(|w| (0..77).map(|i| ((i * 7 + w * 3) % 7) - 3).collect()).collect();
        let mut total = vec![0u64; words_for(77, width)];
        for codes in &workers {
            let words = pack_with(77, width, |i| (codes[i] + 3) as u64);
            total.iter_mut().zip(&words).for_each(|(t, w)| *t += w);
        }
        let mut sums = vec![0i32; 77];
        unpack_into(&total, width, &mut sums, |v| v as i32 - 5 * 3).unwrap();
        let direct: Vec<i32> = (0..77).map(|i| workers.iter().map(|c| c[i]).sum()).collect();
        assert_eq!(sums, direct);
    }

    #[test]
    fn widened_sums_match_unpacked_sums_and_refuse_out_of_range_values() {
        for (n, from, width, max) in [(1000usize, 2u32, 3u32, 2u64), (77, 1, 2, 1), (3 * crate::par::CHUNK * 21 + 5, 2, 3, 2), (500, 4, 6, 14), (64, 8, 9, 254)] {
            let workers: Vec<Vec<u64>> = (0..2u64).map(|w| (0..n as u64).map(|i| (i * 7 + w) % (max + 1)).collect()).collect();
            let mut acc = vec![0u64; words_for(n, width)];
            for vals in &workers {
                let mut b = vec![0u8; 8 * words_for(n, from)];
                pack_into_bytes(n, from, |i| vals[i], &mut b);
                add_widened(&mut acc, width, &b, from, n, max).unwrap();
            }
            let mut sums = vec![0u64; n];
            unpack_into(&acc, width, &mut sums, |v| v).unwrap();
            assert!(sums.iter().enumerate().all(|(i, &s)| s == workers[0][i] + workers[1][i]), "n={n} from={from}");
            if max + 1 < 1 << from {
                let before = acc.clone();
                let mut bad = workers[0].clone();
                bad[n - 1] = max + 1;
                let mut b = vec![0u8; 8 * words_for(n, from)];
                pack_into_bytes(n, from, |i| bad[i], &mut b);
                assert!(add_widened(&mut acc, width, &b, from, n, max).is_err());
                assert_eq!(acc, before, "n={n}");
            }
        }
        assert!(add_widened(&mut [0u64; 2], 3, &[0u8; 16], 2, 40, 2).is_ok()); // 40 values: 2 words either way
        assert!(add_widened(&mut [0u64; 2], 3, &[0u8; 8], 2, 40, 2).is_err());
        assert!(add_widened(&mut [0u64; 1], 3, &[0u8; 16], 2, 40, 2).is_err());
    }
}
