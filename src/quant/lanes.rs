//! Fixed-width lanes in 64-bit words: the wire form of codes and masks.
//!
//! A word holds `per = 64 / width` lanes of `width` bits; a lane never
//! straddles two words. Because of that, adding two packed arrays word by
//! word adds every lane on its own as long as no lane sum exceeds
//! `2^width - 1`: an MPI SUM of packed words sums the codes of every worker
//! exactly, with codes sent as `code - lo` in lanes wide enough for
//! `workers * (hi - lo)`.
//!
//! Values go in groups of `GROUP * per` (`place` is the definition): a full
//! group takes `GROUP` = 8 consecutive words, its value `j` in word `j % 8`,
//! lane `j / 8`; the last group, of `c < 8 per` values, takes
//! `m = ceil(c / per)` words, value `j` in word `j % m`, lane `j / m`. So `n`
//! values take `ceil(n / per)` words, and eight consecutive values share a
//! lane of eight consecutive words: a vector kernel packs or unpacks them
//! with one shift, whatever the width.

use crate::error::{Error, Result};
use crate::isa::Isa;

/// Words of a full group.
pub const GROUP: usize = 8;

/// Words per parallel piece (`par::chunks_of`): whole groups.
const TASK_WORDS: usize = 1 << 13;
const _: () = assert!(TASK_WORDS.is_multiple_of(GROUP));

/// Bits that hold every value in `0..=max` (at least 1).
pub fn width_for(max: u64) -> u32 {
    (64 - max.leading_zeros()).max(1)
}

/// Words that `n` values of `width` bits take.
pub fn words_for(n: usize, width: u32) -> usize {
    n.div_ceil((64 / width) as usize)
}

/// The word and lane of value `i` of `n` values of `width` bits: the
/// layout's definition (the kernels below follow it group by group).
pub fn place(i: usize, n: usize, width: u32) -> (usize, u32) {
    let per = (64 / width) as usize;
    let (g, j) = (i / (GROUP * per), i % (GROUP * per));
    let m = (n - g * GROUP * per).min(GROUP * per).div_ceil(per);
    (g * GROUP + j % m, (j / m) as u32)
}

/// Packs `value(j)` for the `count` values of one group into its words
/// (`out`, `ceil(count / per)` of them); `put` stores a finished word.
#[inline(always)]
fn pack_group<W>(width: u32, count: usize, value: impl Fn(usize) -> u64, out: &mut [W], put: impl Fn(&mut W, u64)) {
    let per = (64 / width) as usize;
    let m = out.len();
    debug_assert_eq!(m, count.div_ceil(per));
    for (w, slot) in out.iter_mut().enumerate() {
        let mut acc = 0u64;
        for lane in 0..per {
            let j = lane * m + w;
            if j >= count {
                break;
            }
            let v = value(j);
            debug_assert!(width == 64 || v >> width == 0, "value {v} does not fit {width} bits");
            acc |= v << (lane as u32 * width);
        }
        put(slot, acc);
    }
}

/// Packs `value(i)` for `i` in `0..n` (each `< 2^width`) into `out`, whole
/// groups in parallel; `put` stores a finished word.
fn pack_core<W: Send>(n: usize, width: u32, value: impl Fn(usize) -> u64 + Sync, out: &mut [W], put: impl Fn(&mut W, u64) + Sync + Copy) {
    let per = (64 / width) as usize;
    debug_assert_eq!(out.len(), words_for(n, width));
    crate::par::chunks_of(out, TASK_WORDS, |first_word, slots| {
        for (k, group) in slots.chunks_mut(GROUP).enumerate() {
            let base = (first_word + k * GROUP) * per;
            pack_group(width, (n - base).min(GROUP * per), |j| value(base + j), group, put);
        }
    });
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
    pack_core(n, width, value, as_words(out), |w, v| *w = v.to_le_bytes());
}

/// `bytes` (a multiple of 8 long) as 8-byte words.
fn as_words(bytes: &mut [u8]) -> &mut [[u8; 8]] {
    assert_eq!(bytes.len() % 8, 0, "packed lanes need whole words");
    // SAFETY: [u8; 8] has alignment 1 and the length is a multiple of 8,
    // so the words cover exactly the bytes, borrowed mutably once.
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<[u8; 8]>(), bytes.len() / 8) }
}

/// The bytes of `words` in memory order: on a little-endian machine, the
/// wire's little-endian words as they are (one copy, no zero fill first).
#[cfg(target_endian = "little")]
pub fn words_as_bytes(words: &[u64]) -> &[u8] {
    // SAFETY: u8 has alignment 1 and every bit pattern is a valid u8; the
    // bytes cover exactly the words' memory, borrowed shared as `words` is.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), std::mem::size_of_val(words)) }
}

/// Packs `f(vals[i])` (each `< 2^width`) into `out`, whole groups in
/// parallel; `put` stores a finished word. Widths 1 to 32 are compiled each
/// with its shifts fixed (`pack_kernel`), for every instruction set.
fn pack_slice_core<T: Copy + Sync, O: Send>(vals: &[T], width: u32, f: impl Fn(T) -> u64 + Sync + Copy, out: &mut [O], put: impl Fn(&mut O, u64) + Sync + Copy) {
    assert!((1..=64).contains(&width) && out.len() == words_for(vals.len(), width), "{} values of {width} bits into {} words", vals.len(), out.len());
    let per = (64 / width) as usize;
    // Not the AVX-512 build: for some widths LLVM packs with gathers there,
    // 7x slower than the AVX2 build at width 9 (16 Mi values: 17 ms, 2.3 ms).
    let isa = Isa::detect().min(Isa::Avx2);
    crate::par::chunks_of(out, TASK_WORDS, |first_word, slots| {
        let vals = &vals[first_word * per..((first_word + slots.len()) * per).min(vals.len())];
        macro_rules! fixed {
            ($($w:literal)*) => {
                match width {
                    $($w => pack_kernel::<$w, T, O, _, _>(isa, vals, f, slots, put),)*
                    _ => pack_groups(width, vals, f, slots, put),
                }
            };
        }
        fixed!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32)
    });
}

/// `vals` (whole groups, then perhaps the last one) into `out`: a full
/// group is `per` rounds of eight values shifted into eight words, which
/// vectorizes; the last group goes value by value (`pack_group`).
#[inline(always)]
fn pack_groups<T: Copy, O>(width: u32, vals: &[T], f: impl Fn(T) -> u64 + Copy, out: &mut [O], put: impl Fn(&mut O, u64) + Copy) {
    let per = (64 / width) as usize;
    for (group, v) in out.chunks_mut(GROUP).zip(vals.chunks(GROUP * per)) {
        if v.len() < GROUP * per || group.len() < GROUP {
            pack_group(width, v.len(), |j| f(v[j]), group, put);
            continue;
        }
        let mut acc = [0u64; GROUP];
        for (lane, row) in v.chunks_exact(GROUP).enumerate() {
            let shift = lane as u32 * width;
            for (a, &x) in acc.iter_mut().zip(row) {
                *a |= f(x) << shift;
            }
        }
        group.iter_mut().zip(acc).for_each(|(o, a)| put(o, a));
    }
}

/// `pack_groups` with the width a constant: its shifts fixed at compile time.
#[inline(always)]
fn pack_fixed<const WIDTH: u32, T: Copy, O, F: Fn(T) -> u64 + Copy, P: Fn(&mut O, u64) + Copy>(vals: &[T], f: F, out: &mut [O], put: P) {
    pack_groups(WIDTH, vals, f, out, put)
}

crate::isa::multiversion! {
    fn pack_kernel[const WIDTH: u32, T: Copy, O, F: Fn(T) -> u64 + Copy, P: Fn(&mut O, u64) + Copy][WIDTH, T, O, F, P](vals: &[T], f: F, out: &mut [O], put: P) -> () = pack_fixed;
}

/// Packs `f(vals[i])` (each `< 2^width`) into words.
pub fn pack_slice<T: Copy + Sync>(vals: &[T], width: u32, f: impl Fn(T) -> u64 + Sync + Copy) -> Vec<u64> {
    let mut words = vec![0u64; words_for(vals.len(), width)];
    pack_slice_core(vals, width, f, &mut words, |w, v| *w = v);
    words
}

/// As `pack_slice`, into `out` (`words_for(vals.len(), width)` words).
pub fn pack_slice_into_words<T: Copy + Sync>(vals: &[T], width: u32, f: impl Fn(T) -> u64 + Sync + Copy, out: &mut [u64]) {
    pack_slice_core(vals, width, f, out, |w, v| *w = v);
}

/// As `pack_slice`, writing the words' little-endian bytes straight into
/// `out` (`8 * words_for(vals.len(), width)` bytes): the wire form without a copy.
pub fn pack_slice_into_bytes<T: Copy + Sync>(vals: &[T], width: u32, f: impl Fn(T) -> u64 + Sync + Copy, out: &mut [u8]) {
    assert_eq!(out.len(), 8 * words_for(vals.len(), width), "packed lanes need whole words");
    pack_slice_core(vals, width, f, as_words(out), |w, v| *w = v.to_le_bytes());
}

/// As `pack_slice_into_bytes` for bytes (each `< 2^width`, as there), the
/// same bits, built a byte of every word at a time at widths 1, 2, 4 and 8
/// (other widths go to `pack_slice_into_bytes`). A group's round of eight
/// values, read as one little-endian u64, holds a value for each of the
/// eight words in its bytes: shifted by the lane's offset within a byte it
/// stays in its byte, so ORing the rounds that share a byte gives that byte
/// of all eight words, and an 8 x 8 byte transpose of those makes the words.
/// Three scalar operations per eight values, where the general kernel
/// widens each value to 64 bits: 16 Mi scale indices at width 1 took
/// 0.47 ms against its 1.26, at width 2 0.70 against 1.36.
pub fn pack_bytes_into_bytes(vals: &[u8], width: u32, out: &mut [u8]) {
    assert_eq!(out.len(), 8 * words_for(vals.len(), width), "packed lanes need whole words");
    pack_bytes_core(vals, width, as_words(out), |w, v| *w = v.to_le_bytes());
}

/// As `pack_bytes_into_bytes`, into words (`pack_slice`'s).
pub fn pack_bytes(vals: &[u8], width: u32) -> Vec<u64> {
    let mut words = vec![0u64; words_for(vals.len(), width)];
    pack_bytes_core(vals, width, &mut words, |w, v| *w = v);
    words
}

fn pack_bytes_core<O: Send>(vals: &[u8], width: u32, out: &mut [O], put: impl Fn(&mut O, u64) + Sync + Copy) {
    if !matches!(width, 1 | 2 | 4 | 8) {
        return pack_slice_core(vals, width, |v| v as u64, out, put);
    }
    assert_eq!(out.len(), words_for(vals.len(), width), "{} values of {width} bits into {} words", vals.len(), out.len());
    let per = (64 / width) as usize;
    let group = GROUP * per;
    crate::par::chunks_of(out, TASK_WORDS, |first_word, slots| {
        let vals = &vals[first_word * per..((first_word + slots.len()) * per).min(vals.len())];
        for (words, v) in slots.chunks_mut(GROUP).zip(vals.chunks(group)) {
            if v.len() < group || words.len() < GROUP {
                pack_group(width, v.len(), |j| v[j] as u64, words, put);
                continue;
            }
            match width {
                1 => bytes_group::<1, O>(v, words, put),
                2 => bytes_group::<2, O>(v, words, put),
                4 => bytes_group::<4, O>(v, words, put),
                _ => bytes_group::<8, O>(v, words, put),
            }
        }
    });
}

/// One whole group of `pack_bytes_core` (`v`: its `8 * 64 / WIDTH` values,
/// `words`: its 8 words), the width a constant so that the rounds of a byte
/// unroll with their shifts fixed.
#[inline(always)]
fn bytes_group<const WIDTH: u32, O>(v: &[u8], words: &mut [O], put: impl Fn(&mut O, u64)) {
    let in_byte = (8 / WIDTH) as usize;
    let rounds: &[[u8; 8]] = v.as_chunks::<8>().0;
    let mut rows = [0u64; 8];
    for (row, r) in rows.iter_mut().zip(rounds.chunks_exact(in_byte)) {
        *row = r.iter().enumerate().fold(0, |b, (i, x)| b | u64::from_le_bytes(*x) << (i as u32 * WIDTH));
    }
    for (w, t) in words.iter_mut().zip(transpose_bytes(rows)) {
        put(w, t);
    }
}

/// The 8 x 8 byte matrix `rows` (row m's byte w) transposed: row w's byte m
/// is `rows[m]`'s byte w. Three rounds of block swaps: 4 x 4, 2 x 2, 1 x 1.
#[inline(always)]
fn transpose_bytes(mut r: [u64; 8]) -> [u64; 8] {
    for (step, lo) in [(4usize, 0x0000_0000_FFFF_FFFFu64), (2, 0x0000_FFFF_0000_FFFF), (1, 0x00FF_00FF_00FF_00FF)] {
        let bits = 8 * step as u32;
        for m in (0..8).filter(|m| m & step == 0) {
            let (a, b) = (r[m], r[m + step]);
            r[m] = (a & lo) | ((b & lo) << bits);
            r[m + step] = ((a >> bits) & lo) | (b & !lo);
        }
    }
    r
}

/// Unpacks the values of whole groups (then perhaps the last one) from
/// `words` (`word_at(k)`, `k` from 0) into `out`.
#[inline(always)]
fn unpack_body<T, A: Fn(usize) -> u64, F: Fn(u64) -> T>(word_at: &A, width: u32, out: &mut [T], f: &F) {
    let per = (64 / width) as usize;
    let mask = if width == 64 { u64::MAX } else { (1u64 << width) - 1 };
    for (g, vals) in out.chunks_mut(GROUP * per).enumerate() {
        let first = g * GROUP;
        if vals.len() == GROUP * per {
            let mut ws = [0u64; GROUP];
            ws.iter_mut().enumerate().for_each(|(w, x)| *x = word_at(first + w));
            for (lane, v) in vals.chunks_exact_mut(GROUP).enumerate() {
                for (o, &x) in v.iter_mut().zip(&ws) {
                    *o = f((x >> (lane as u32 * width)) & mask);
                }
            }
        } else {
            let m = vals.len().div_ceil(per);
            for (j, o) in vals.iter_mut().enumerate() {
                *o = f((word_at(first + j % m) >> ((j / m) as u32 * width)) & mask);
            }
        }
    }
}

crate::isa::multiversion! {
    fn unpack_kernel[T, A: Fn(usize) -> u64, F: Fn(u64) -> T][T, A, F](word_at: &A, width: u32, out: &mut [T], f: &F) -> () = unpack_body;
}

/// Unpacks `out.len()` values from `words` words (`word_at(i)`) into `out`
/// with `f(value)`, whole groups in parallel.
fn unpack_core<T: Send>(words: usize, word_at: impl Fn(usize) -> u64 + Sync, width: u32, out: &mut [T], f: impl Fn(u64) -> T + Sync) -> Result<()> {
    let n = out.len();
    if !(1..=64).contains(&width) || words != words_for(n, width) {
        return Err(Error::SizeMismatch { what: "packed lanes (words)", expected: words_for(n, width.clamp(1, 64)), got: words });
    }
    let per = (64 / width) as usize;
    let isa = Isa::detect();
    // Pieces of whole groups: the first value of each starts a group.
    crate::par::chunks_of(out, TASK_WORDS * per, |start, o| {
        let w0 = start / per;
        unpack_kernel(isa, &|k| word_at(w0 + k), width, o, &f)
    });
    Ok(())
}

/// `unpack_into` on the calling thread only (for work already split in
/// pieces that start a group).
pub fn unpack_serial<T>(words: &[u64], width: u32, out: &mut [T], f: impl Fn(u64) -> T) -> Result<()> {
    if !(1..=64).contains(&width) || words.len() != words_for(out.len(), width) {
        return Err(Error::SizeMismatch { what: "packed lanes (words)", expected: words_for(out.len(), width.clamp(1, 64)), got: words.len() });
    }
    unpack_kernel(Isa::detect(), &|k| words[k], width, out, &f);
    Ok(())
}

/// The largest of the `n` values packed in `words` (`width` bits; 0 for
/// none): a check of lanes that came from the network, without unpacking
/// them to an array. Errors on a wrong word count.
pub fn max_value(words: &[u64], width: u32, n: usize) -> Result<u64> {
    if !(1..=64).contains(&width) || words.len() != words_for(n, width) {
        return Err(Error::SizeMismatch { what: "packed lanes (words)", expected: words_for(n, width.clamp(1, 64)), got: words.len() });
    }
    let (isa, per) = (Isa::detect(), (64 / width) as usize);
    let values = (BLOCK / (GROUP * per)).max(1) * GROUP * per;
    use rayon::prelude::*;
    Ok(words
        .par_chunks(TASK_WORDS)
        .enumerate()
        .map(|(i, w)| {
            let mut buf = [0u64; BLOCK];
            let (start, mut max) = (i * TASK_WORDS * per, 0);
            for (b, w) in w.chunks(values / per).enumerate() {
                let count = (n - start - b * values).min(w.len() * per);
                let vals = &mut buf[..count];
                unpack_kernel(isa, &|k| w[k], width, vals, &|v| v);
                max = vals.iter().fold(max, |m, &v| m.max(v));
            }
            max
        })
        .max()
        .unwrap_or(0))
}

/// Unpacks `out.len()` values of `width` bits into `out` with `f(value)`;
/// errors on a wrong word count.
pub fn unpack_into<T: Send>(words: &[u64], width: u32, out: &mut [T], f: impl Fn(u64) -> T + Sync) -> Result<()> {
    unpack_core(words.len(), |i| words[i], width, out, f)
}

/// 2^52: the double whose mantissa holds a lane's value in `exact_plus`
/// (and in the decode kernels that do the same in vectors).
pub(crate) const TWO_52: f64 = (1u64 << 52) as f64;

/// `v + base` as a double, exactly, for `v < 2^52` and `base` a whole number
/// with `|base| < 2^52` (the caller's to keep): the double whose bits are
/// `2^52`'s with `v` in the mantissa is `2^52 + v`, less `2^52 - base`.
/// The conversion of a decoded lane without one: AVX2 has no 64-bit integer
/// to float instruction, and `(v as i64 + base) as f64` compiled to a scalar
/// `vcvtsi2sd` per value there (decodes at twice the copy's time).
#[inline(always)]
pub fn exact_plus(v: u64, base: f64) -> f64 {
    debug_assert!(v < 1 << 52 && base.abs() < TWO_52 && base.fract() == 0.0);
    f64::from_bits(TWO_52.to_bits() | v) - (TWO_52 - base)
}

/// Code sums from lanes that hold `sum - base` (`base`: the lowest code
/// times the members summed): `out.len()` of them. Errors on a wrong word
/// count, and (`check_sums`) on a lane whose sum is not an `i32`.
pub fn unpack_codes(words: &[u64], width: u32, base: i64, out: &mut [i32]) -> Result<()> {
    check_sums(words, width, base, out.len())?;
    unpack_into(words, width, out, |v| (v as i64 + base) as i32)
}

/// Errors unless each of the `n` lanes (`width` bits) plus `base` is an
/// `i32`, as every code sum is: `base` itself, then the lanes' largest
/// value, read only when the width could hold one too large (at most 31
/// bits and a negative base, the usual case, cannot). Errors on a wrong
/// word count.
pub fn check_sums(words: &[u64], width: u32, base: i64, n: usize) -> Result<()> {
    let (lo, hi) = (i32::MIN as i128, i32::MAX as i128);
    if !(lo..=hi).contains(&(base as i128)) {
        return Err(Error::InvalidParam { key: "base".into(), problem: format!("{base} is outside the code sums' range (an i32)") });
    }
    let widest = if width >= 64 { u64::MAX } else { (1u64 << width.max(1)) - 1 };
    if base as i128 + widest as i128 > hi {
        let max = max_value(words, width, n)?;
        if base as i128 + max as i128 > hi {
            return Err(Error::InvalidParam { key: "lanes".into(), problem: format!("a lane holds {max}, whose sum with the base {base} is outside an i32") });
        }
    }
    Ok(())
}

/// As `unpack_into`, reading the words' little-endian bytes (the wire form).
pub fn unpack_bytes_into<T: Send>(bytes: &[u8], width: u32, out: &mut [T], f: impl Fn(u64) -> T + Sync) -> Result<()> {
    if bytes.len() % 8 != 0 {
        return Err(Error::Transport(format!("malformed message: {} bytes is not a whole number of 64-bit words", bytes.len())));
    }
    unpack_core(bytes.len() / 8, |i| u64::from_le_bytes(bytes[8 * i..8 * i + 8].try_into().unwrap()), width, out, f)
}

/// Codes per block of a packed kernel (`blocks!`): made in one vectorized
/// pass into a buffer that stays in L1, then packed from it in another.
pub(crate) const BLOCK: usize = 2048;

/// Packs the whole groups of `$n` values (lanes of `$width` bits, 1 to 32)
/// straight from a kernel's vectors into the words `$w`, written or (with
/// `$add`) added, and evaluates to the number of values packed (the caller
/// packs the rest, the last short group, another way). `$pair` gives the
/// lanes (`[u32; 16]`) of values `$at..$at + 16`: a lane of the group's
/// eight words and the lane above it; `$one` those (`[u32; 8]`) of
/// `$at..$at + 8`; each `< 2^width`. A macro, as `blocks!`: a closure that
/// is not inlined would run without the kernel's instruction set.
///
/// A group's lanes go in top first, Horner's way: its eight words shift
/// up two lanes and take the next pair. The shifts are the same for every
/// pair, so a vector kernel holds them in registers, and a pair costs a
/// shift, two widenings and one three-way OR (each lane at its own offset
/// cost a shift count, a widening and a shift).
macro_rules! pack_direct {
    ($add:ident, $n:expr, $w:expr, $width:expr, |$at:ident| $pair:expr, $one:expr) => {{
        const G: usize = $crate::quant::lanes::GROUP;
        let (n, w): (usize, &mut [u64]) = ($n, $w);
        let width: u32 = ($width).clamp(1, 32);
        let per = (64 / width) as usize;
        let group = G * per;
        let whole = (n / group).min(w.len() / G);
        // Pairs go in at the top pair's offset and every pair before moves
        // down two lanes; at width 32 there is one pair (`wrapping_shr`
        // shifts the words, still 0, by 0 instead of 64).
        let (pairs, down) = (per / 2, 2 * width);
        let top = (pairs as u32 - 1) * down;
        for (gi, words) in w.chunks_exact_mut(G).take(whole).enumerate() {
            let base = gi * group;
            let mut acc = [0u64; G];
            for p in 0..pairs {
                let $at = base + 2 * p * G;
                let c: [u32; 2 * G] = $pair;
                for t in 0..G {
                    acc[t] = acc[t].wrapping_shr(down) | (c[t] as u64) << top | (c[G + t] as u64) << (top + width);
                }
            }
            if per % 2 == 1 {
                let $at = base + (per - 1) * G;
                let c: [u32; G] = $one;
                for (a, c) in acc.iter_mut().zip(c) {
                    *a |= (c as u64) << ((per as u32 - 1) * width);
                }
            }
            words.iter_mut().zip(acc).for_each(|(w, a)| $crate::quant::lanes::store::<$add>(w, a));
        }
        whole * group
    }};
}
pub(crate) use pack_direct;

/// Puts a finished word: written, or (with `ADD`) added lane by lane.
#[inline(always)]
pub(crate) fn store<const ADD: bool>(w: &mut u64, v: u64) {
    if ADD {
        *w = w.wrapping_add(v)
    } else {
        *w = v
    }
}

/// Packs lanes `c[j] + off` (each in `0..2^width`; `width` 1 to 32) of a
/// piece that starts a group into its words `w`, written or (with `ADD`)
/// added (`pack_groups`). For kernels: inlined into the caller's
/// instruction set.
#[inline(always)]
pub(crate) fn pack_codes<const ADD: bool>(c: &[i32], off: i32, w: &mut [u64], width: u32) {
    pack_groups(width.clamp(1, 64), c, |x: i32| x.wrapping_add(off) as u32 as u64, w, store::<ADD>);
}

/// Runs `$codes(range of a block, its code buffer)` over blocks of whole
/// groups of `$n` values (at most `$block`) and packs each block's codes
/// (`pack_codes`, lane = code + `$off`) into its words of `$w`. A macro, not
/// a function taking a closure: a closure that is not inlined would run
/// without the kernel's instruction set.
macro_rules! blocks {
    ($add:ident, $block:expr, $n:expr, $w:expr, $width:expr, $off:expr, |$r:ident, $c:ident| $codes:expr) => {{
        let (n, width) = ($n, $width);
        let per = (64 / width.clamp(1, 64)) as usize;
        let group = $crate::quant::lanes::GROUP * per;
        let values = ($block / group).max(1) * group;
        let mut buf = [0i32; $block];
        for (b, words) in $w.chunks_mut(values / per).enumerate() {
            let $r = b * values..((b + 1) * values).min(n);
            let $c = &mut buf[..$r.len()];
            $codes;
            $crate::quant::lanes::pack_codes::<$add>($c, $off, words, width);
        }
    }};
}
pub(crate) use blocks;

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
    // Blocks of one group of both layouts (`block` wide words), so each is
    // laid out as an array of its own: unpacked narrow, checked, and packed
    // wide into `acc` by one kernel; each block is checked whole before it
    // is added, and a refusal takes back the blocks that were added.
    let block = GROUP * per_from;
    let isa = Isa::detect();
    let piece = block * (TASK_WORDS / block).max(1);
    let each_block = |start: usize, a: &mut [u64], work: &mut BlockWork| {
        let mut vals = Vec::new(); // (as long as the first block: a short frame allocates little)
        for (j, wide) in a.chunks_mut(block).enumerate() {
            let s = start + j * block;
            let (first, count) = (s * per, (n - s * per).min(wide.len() * per));
            let narrow = &src[8 * (first / per_from)..8 * (first / per_from + words_for(count, from))];
            vals.resize(count, 0);
            work(s, narrow, &mut vals[..count], wide);
        }
    };
    let refused = std::sync::Mutex::new(Vec::new());
    crate::par::chunks_of(acc, piece, |start, a| {
        each_block(start, a, &mut |s, narrow, vals, wide| {
            if !widen_kernel::<true>(isa, narrow, from, width, max, vals, wide) {
                refused.lock().unwrap().push(s);
            }
        });
    });
    let refused = refused.into_inner().unwrap();
    if refused.is_empty() {
        return Ok(());
    }
    crate::par::chunks_of(acc, piece, |start, a| {
        each_block(start, a, &mut |s, narrow, vals, wide| {
            if !refused.contains(&s) {
                assert!(widen_kernel::<false>(isa, narrow, from, width, max, vals, wide), "a block that was added widens again");
            }
        });
    });
    Err(Error::Transport(format!("malformed message: a packed code is above {max}")))
}

/// What `add_widened` does with a block: `(its first wide word, its narrow
/// bytes, scratch for its values, its wide words)`.
type BlockWork<'a> = dyn FnMut(usize, &[u8], &mut [u64], &mut [u64]) + 'a;

/// `add_widened` of one block: unpacks `vals.len()` narrow values from the
/// bytes `narrow`, and unless one is above `max` (then false, nothing
/// written) adds them (`ADD`) to, or takes them from, the wide lanes `wide`.
#[inline(always)]
fn widen_body<const ADD: bool>(narrow: &[u8], from: u32, width: u32, max: u64, vals: &mut [u64], wide: &mut [u64]) -> bool {
    unpack_body(&|k| u64::from_le_bytes(narrow[8 * k..8 * k + 8].try_into().unwrap()), from, vals, &|v| v);
    if vals.iter().fold(0, |m, &v| m.max(v)) > max {
        return false;
    }
    if ADD {
        pack_groups(width, vals, |v| v, wide, store::<true>);
    } else {
        pack_groups(width, vals, |v| v, wide, |w: &mut u64, v| *w = w.wrapping_sub(v));
    }
    true
}

crate::isa::multiversion! {
    fn widen_kernel[const ADD: bool][ADD](narrow: &[u8], from: u32, width: u32, max: u64, vals: &mut [u64], wide: &mut [u64]) -> bool = widen_body;
}

/// Lane by lane, `acc = min(acc, other)`: two arrays of words packed at
/// `width` bits (1 to 64) whose lanes line up (the same layout and count),
/// with no unpacking. For the scale indices' MIN over MPI, which runs it on
/// every word of a 16 Mi-value array at each step.
pub fn min_lanes(acc: &mut [u64], other: &[u64], width: u32) {
    assert!((1..=64).contains(&width) && acc.len() == other.len(), "lane MIN of {} and {} words of {width} bits", acc.len(), other.len());
    let isa = Isa::detect();
    match width {
        1 => acc.iter_mut().zip(other).for_each(|(a, &b)| *a &= b), // a bit's MIN is AND
        2 => min_kernel::<2>(isa, acc, other),
        3 => min_kernel::<3>(isa, acc, other),
        4 => min_kernel::<4>(isa, acc, other),
        _ => min_body_any(acc, other, width),
    }
}

#[inline(always)]
fn min_body<const W: u32>(acc: &mut [u64], other: &[u64]) {
    min_body_any(acc, other, W)
}

#[inline(always)]
fn min_body_any(acc: &mut [u64], other: &[u64], width: u32) {
    let (per, mask) = (64 / width, if width == 64 { u64::MAX } else { (1u64 << width) - 1 });
    for (a, &b) in acc.iter_mut().zip(other) {
        let mut out = 0u64;
        for lane in 0..per {
            let s = lane * width;
            out |= ((*a >> s) & mask).min((b >> s) & mask) << s;
        }
        *a = out;
    }
}

crate::isa::multiversion! {
    fn min_kernel[const W: u32][W](acc: &mut [u64], other: &[u64]) -> () = min_body;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The layout by its definition (`place`), one value at a time.
    fn reference(vals: &[u64], width: u32) -> Vec<u64> {
        let mut words = vec![0u64; words_for(vals.len(), width)];
        for (i, &v) in vals.iter().enumerate() {
            let (w, lane) = place(i, vals.len(), width);
            assert!(lane < 64 / width && (width == 64 || v >> width == 0));
            assert_eq!(words[w] >> (lane * width) & if width == 64 { u64::MAX } else { (1 << width) - 1 }, 0, "two values in one lane");
            words[w] |= v << (lane * width);
        }
        words
    }

    #[test]
    fn lane_min_is_the_min_of_every_value() {
        for width in [1u32, 2, 3, 4, 5, 8, 64] {
            for n in [0usize, 1, 63, 200, 1000] {
                let top = if width == 64 { u64::MAX } else { (1u64 << width) - 1 };
                let a: Vec<u64> = (0..n as u64).map(|i| ((i * 2_654_435_761) >> 3) & top).collect();
                let b: Vec<u64> = (0..n as u64).map(|i| (i * 40_503 + 7) & top).collect();
                let want = pack_slice(&a.iter().zip(&b).map(|(x, y)| *x.min(y)).collect::<Vec<_>>(), width, |v| v);
                let mut acc = pack_slice(&a, width, |v| v);
                min_lanes(&mut acc, &pack_slice(&b, width, |v| v), width);
                assert_eq!(acc, want, "width {width} n {n}");
            }
        }
        for isa in Isa::available() {
            let (mut acc, other) = (vec![0b10_01_11_00u64 << 40 | 0b0111, 5], vec![0b01_10_01_11u64 << 40 | 0b1001, 3]);
            min_kernel::<2>(isa, &mut acc, &other);
            assert_eq!(acc, [0b01_01_01_00u64 << 40 | 0b0101, 1], "{isa:?}");
        }
    }

    #[test]
    fn bytes_pack_to_the_general_kernels_bits() {
        let mut rng = crate::hash::SplitMix(15);
        let mut next = || rng.next_u64();
        for width in 1..=8u32 {
            let per = (64 / width) as usize;
            let task = TASK_WORDS * per;
            for n in [0, 1, 7, 8, 9, GROUP * per - 1, GROUP * per, GROUP * per + 1, 3 * GROUP * per + 5, task - 1, task, task + 1, 2 * task + GROUP * per + 3] {
                let vals: Vec<u8> = (0..n).map(|_| (next() & ((1 << width) - 1)) as u8).collect();
                let mut want = vec![0xAAu8; 8 * words_for(n, width)];
                pack_slice_into_bytes(&vals, width, |v| v as u64, &mut want);
                let mut got = vec![0x55u8; want.len()];
                pack_bytes_into_bytes(&vals, width, &mut got);
                assert!(got == want, "width {width} n {n}");
                assert_eq!(pack_bytes(&vals, width), pack_slice(&vals, width, |v| v as u64), "width {width} n {n}");
            }
        }
        // the transpose alone, against its definition
        let rows: [u64; 8] = std::array::from_fn(|m| (0..8).fold(0, |r, w| r | ((16 * m + w) as u64) << (8 * w)));
        let t = transpose_bytes(rows);
        for (w, m) in (0..8).flat_map(|w| (0..8).map(move |m| (w, m))) {
            assert_eq!((t[w] >> (8 * m)) & 0xFF, (rows[m] >> (8 * w)) & 0xFF, "byte {m} of row {w}");
        }
    }

    #[test]
    fn exact_plus_is_the_integer_sum_at_its_bounds() {
        let top = (1u64 << 52) - 1;
        for v in [0, 1, 2, 255, u32::MAX as u64 - 1, u32::MAX as u64, 1 << 32, top] {
            for base in [0i64, 1, -1, -7, 1 << 31, -(1 << 31), top as i64, -(top as i64)] {
                let want = v as i128 + base as i128;
                let got = exact_plus(v, base as f64);
                assert_eq!(got as i128, want, "v={v} base={base}");
                assert_eq!(got.to_bits(), (want as f64).to_bits(), "v={v} base={base}");
            }
        }
        // as a decode uses it: one rounding to f32, as from the integer
        assert_eq!(exact_plus(2 * (u32::MAX as u64), -3.0) as f32, (2 * u32::MAX as i64 - 3) as f32);
    }

    #[test]
    fn every_kernel_packs_and_unpacks_the_defined_layout() {
        for width in 1..=64u32 {
            let per = (64 / width) as usize;
            let max = if width == 64 { u64::MAX } else { (1u64 << width) - 1 };
            let big = TASK_WORDS * per + GROUP * per + 3; // two parallel pieces and a last group
            for n in [0, 1, per - 1, per, per + 1, GROUP * per - 1, GROUP * per, GROUP * per + 1, 3 * GROUP * per + per + 1, big] {
                let vals: Vec<u64> = (0..n as u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(7) & max).collect();
                let want = reference(&vals, width);
                assert_eq!(pack_with(n, width, |i| vals[i]), want, "pack_with width {width} n {n}");
                assert_eq!(pack_slice(&vals, width, |v| v), want, "pack_slice width {width} n {n}");
                for isa in Isa::available() {
                    let mut words = vec![0u64; want.len()];
                    match width {
                        3 => pack_kernel::<3, u64, u64, _, _>(isa, &vals, |v| v, &mut words, |w, v| *w = v),
                        9 => pack_kernel::<9, u64, u64, _, _>(isa, &vals, |v| v, &mut words, |w, v| *w = v),
                        32 => pack_kernel::<32, u64, u64, _, _>(isa, &vals, |v| v, &mut words, |w, v| *w = v),
                        _ => pack_groups(width, &vals, |v| v, &mut words, |w, v| *w = v),
                    }
                    assert_eq!(words, want, "{isa:?} width {width} n {n}");
                    let mut back = vec![0u64; n];
                    unpack_kernel(isa, &|k| want[k], width, &mut back, &|v| v);
                    assert_eq!(back, vals, "{isa:?} unpack width {width} n {n}");
                }
            }
        }
        // The layout itself, pinned: 20 values of 3 bits (21 lanes a word) take
        // one word in order; 170 values take 8 full words (168) and a last word of 2.
        assert_eq!((0..20).map(|i| place(i, 20, 3)).collect::<Vec<_>>(), (0..20).map(|i| (0, i as u32)).collect::<Vec<_>>());
        assert_eq!((place(0, 170, 3), place(1, 170, 3), place(8, 170, 3), place(167, 170, 3), place(168, 170, 3), place(169, 170, 3)), ((0, 0), (1, 0), (0, 1), (7, 20), (8, 0), (8, 1)));
    }

    #[test]
    fn the_largest_value_is_found_in_every_piece_and_lane() {
        for width in [1u32, 3, 9, 32, 64] {
            let per = (64 / width) as usize;
            let max = if width == 64 { u64::MAX } else { (1u64 << width) - 1 };
            for n in [0usize, 1, GROUP * per + 1, TASK_WORDS * per + 5] {
                for at in [0, n / 2, n.saturating_sub(1)] {
                    let mut vals = vec![0u64; n];
                    if n > 0 {
                        vals[at] = max;
                    }
                    let words = pack_slice(&vals, width, |v| v);
                    assert_eq!(max_value(&words, width, n).unwrap(), if n > 0 { max } else { 0 }, "width {width} n {n} at {at}");
                }
            }
        }
        assert!(max_value(&[0; 2], 3, 5).is_err());
    }

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
            // a bad value in the first, a middle or the last block: the
            // blocks added around it are taken back
            for at in [0, n / 2, n - 1].into_iter().filter(|_| max + 1 < 1 << from) {
                let before = acc.clone();
                let mut bad = workers[0].clone();
                bad[at] = max + 1;
                let mut b = vec![0u8; 8 * words_for(n, from)];
                pack_into_bytes(n, from, |i| bad[i], &mut b);
                assert!(add_widened(&mut acc, width, &b, from, n, max).is_err());
                assert_eq!(acc, before, "n={n} at {at}");
            }
            // every kernel on the first block (a group of both layouts)
            let count = n.min(GROUP * (64 / from as usize) * (64 / width as usize));
            let mut b = vec![0u8; 8 * words_for(count, from)];
            pack_into_bytes(count, from, |i| workers[1][i], &mut b);
            for isa in Isa::available() {
                let (mut wide, mut vals) = (vec![0u64; words_for(count, width)], vec![0u64; count]);
                assert!(widen_kernel::<true>(isa, &b, from, width, max, &mut vals, &mut wide));
                assert_eq!(wide, pack_slice(&workers[1][..count], width, |v| v), "{isa:?} n={n}");
                assert!(widen_kernel::<false>(isa, &b, from, width, max, &mut vals, &mut wide));
                assert!(wide.iter().all(|&w| w == 0), "{isa:?} n={n}");
            }
        }
        assert!(add_widened(&mut [0u64; 2], 3, &[0u8; 16], 2, 40, 2).is_ok()); // 40 values: 2 words either way
        assert!(add_widened(&mut [0u64; 2], 3, &[0u8; 8], 2, 40, 2).is_err());
        assert!(add_widened(&mut [0u64; 1], 3, &[0u8; 16], 2, 40, 2).is_err());
    }
}
