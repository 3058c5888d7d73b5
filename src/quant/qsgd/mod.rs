//! Max-norm QSGD: with a scale `M` shared by every worker (at least `max|g|`
//! over all of them) and `s = 2^bits - 1` levels, element `g` becomes the
//! integer code `sign(g) * (floor(l) + Bernoulli(l - floor(l)))`, `l = |g| s / M`,
//! in `[-s, s]`: unbiased, `E[code] * M / s = g`. Codes of several workers are
//! summed as integers (in an `i32` accumulator, wide enough for
//! `max_workers(bits)` workers) and decoded once: `sum * M / s`.
//!
//! On the wire each code takes `bits + 1` bits (`code + s` in `quant::lanes`),
//! not the int8/int32 of the paper's code. Rounding noise comes from a counter-based
//! generator keyed by the caller's seed, so a worker's codes are reproducible
//! and different workers (different seeds) round independently.
//!
//! This file owns the parameter checks, the public API (which spreads work
//! over threads, `par`) and the one dispatch between the hand-written and
//! the portable decodes. `portable` holds the kernels that each compile for
//! every instruction set, `avx2` and `avx512` the hand-written ones,
//! `reference` the scalar oracle, `tests` every kernel held to it. The
//! noise streams and their seeds are `noise`'s; lanes are `lanes`'.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod portable;
#[cfg(test)]
mod reference;
#[cfg(test)]
mod tests;

use super::lanes;
use crate::isa::Isa;
use crate::par;

use crate::error::{Error, Result};

/// The largest `bits` accepted: codes stay far inside an `i32` accumulator.
pub const MAX_BITS: u32 = 15;

fn bad(key: &str, problem: String) -> Error {
    Error::InvalidParam { key: key.to_string(), problem }
}

/// A shared scale must be finite and >= 0.
pub(crate) fn check_scale(scale: f32) -> Result<()> {
    if !scale.is_finite() || scale < 0.0 {
        return Err(bad("scale", format!("must be finite and >= 0, got {scale}")));
    }
    Ok(())
}

/// Levels for `bits`: `2^bits - 1`.
pub fn levels(bits: u32) -> Result<u32> {
    if !(1..=MAX_BITS).contains(&bits) {
        return Err(bad("bits", format!("must be between 1 and {MAX_BITS}, got {bits}")));
    }
    Ok((1u32 << bits) - 1)
}

/// How many workers' codes an `i32` accumulator can sum without overflow.
pub fn max_workers(bits: u32) -> Result<u64> {
    Ok(i32::MAX as u64 / levels(bits)? as u64)
}

/// The noise seed of one quantization (`noise::stream_seed`, where every
/// user of the counter-based noise finds it).
pub use super::noise::stream_seed;

/// Quantizes `grad` against the shared `scale` into `codes`. Errors (before
/// writing) for a bad `bits`, a scale that is not finite and >= 0, a scale
/// below `max|g|` (codes would leave `[-s, s]`), or mismatched lengths.
pub fn quantize(grad: &[f32], scale: f32, bits: u32, seed: u64, codes: &mut [i32]) -> Result<()> {
    quantize_at(grad, scale, &[levels(bits)?], None, seed, codes)
}

/// The per-element factor `s_j / M` of level `j`: 0 for an all-zero scale,
/// and 0 for a scale so small that `s_j / M` overflows float32 (every
/// `|g|` below `s_j / f32::MAX`, about 3e-39 `s_j`): those gradients get
/// code 0, as float32 cannot scale them. (An infinite factor gave every
/// element, zeros included, the code `+-s_j`: a zero decoded to `M`.)
#[inline(always)]
pub(crate) fn factor(s: u32, scale: f32) -> f32 {
    let f = s as f32 / scale;
    if f.is_finite() {
        f
    } else {
        0.0
    }
}

/// The kernels' tables of `levels` (at most `TABLE`) at `scale`:
/// each level's factor `s_j / M` and count `s_j`; entries past the last
/// level are 0.
fn tables(levels: &[u32], scale: f32) -> ([f32; TABLE], [f32; TABLE]) {
    let (mut ft, mut st) = ([0f32; TABLE], [0f32; TABLE]);
    for ((f, t), &s) in ft.iter_mut().zip(st.iter_mut()).zip(levels) {
        (*f, *t) = (factor(s, scale), s as f32);
    }
    (ft, st)
}

/// Each level's decode step `M / s_j`, in double, so that e.g. 45 codes of
/// 0.5 / 15 decode to exactly 1.5; entries past the last level are 0.
fn steps(levels: &[u32], scale: f32) -> [f64; TABLE] {
    let mut steps = [0f64; TABLE];
    levels.iter().zip(steps.iter_mut()).for_each(|(&s, t)| *t = scale as f64 / s as f64);
    steps
}

/// `max |x|`, or `None` when an element is not finite (f32::max would skip NaN).
pub fn max_abs(x: &[f32]) -> Option<f32> {
    let isa = Isa::detect();
    let (m, finite) = par::map_reduce(x, |_, c| portable::max_abs(isa, c), |a, b| (a.0.max(b.0), a.1 && b.1));
    finite.then_some(m)
}

/// Runs `work(offset, piece of a, piece of b)` over aligned pieces (`par`;
/// noise is indexed by the global element, so results do not depend on the split).
fn chunked<A: Sync, B: Send>(a: &[A], b: &mut [B], work: impl Fn(usize, &[A], &mut [B]) + Sync) {
    par::chunks(b, |start, b| work(start, &a[start..start + b.len()], b));
}

/// The most scales one quantization takes (a compression has at most
/// `compression::MAX_SCALES`): the kernels look them up in a table this long.
pub const MAX_LEVELS: usize = TABLE;

/// Scales a kernel's table holds.
const TABLE: usize = 16;

/// Multi-scale QSGD: for every element, the index of the finest level `j`
/// (`levels` ascending, at most `MAX_LEVELS`) whose largest possible code
/// `ceil(|g| s_j / M)` still fits the coarsest range `s_0`. The choice
/// depends on `g` only, never on rounding noise, so each element's estimate
/// stays unbiased.
pub fn fit_levels(grad: &[f32], scale: f32, levels: &[u32], out: &mut [u8]) {
    assert!(!levels.is_empty() && levels.len() <= MAX_LEVELS, "{} scales (1 to {MAX_LEVELS})", levels.len());
    let (ft, _) = tables(levels, scale);
    let (isa, s0, count) = (Isa::detect(), levels[0] as f32, levels.len());
    chunked(grad, out, |_, g, o| portable::fit(isa, g, o, &ft, count, s0));
}

/// Quantizes every element at its level (`level_of[i]`, or level 0 for all
/// when `None`): codes in `[-s_j, s_j]`, and within `[-s_0, s_0]` whenever the
/// levels came from `fit_levels` (or a MIN of several workers' choices).
/// At most `MAX_LEVELS` scales.
pub fn quantize_at(grad: &[f32], scale: f32, levels: &[u32], level_of: Option<&[u8]>, seed: u64, codes: &mut [i32]) -> Result<()> {
    if codes.len() != grad.len() {
        return Err(Error::SizeMismatch { what: "codes", expected: grad.len(), got: codes.len() });
    }
    if levels.is_empty() || levels.len() > MAX_LEVELS {
        return Err(bad("levels", format!("give 1 to {MAX_LEVELS} scales, got {}", levels.len())));
    }
    check_scale(scale)?;
    let Some(max) = max_abs(grad) else {
        let i = grad.iter().position(|g| !g.is_finite()).unwrap();
        return Err(bad("gradient", format!("element {i} is {}", grad[i])));
    };
    if max > scale {
        return Err(bad("scale", format!("{scale} is below the gradient's max |g| = {max}")));
    }
    if let Some(l) = level_of {
        if l.len() != grad.len() {
            return Err(Error::SizeMismatch { what: "levels", expected: grad.len(), got: l.len() });
        }
        if par::map_reduce(l, |_, p| p.iter().fold(0u8, |m, &j| m.max(j)), u8::max) as usize >= levels.len() {
            let i = l.iter().position(|&j| j as usize >= levels.len()).expect("the max found one");
            return Err(bad("levels", format!("element {i} names level {} of {}", l[i], levels.len())));
        }
    }
    quantize_levels::<false>(grad, scale, levels, level_of, seed, codes);
    Ok(())
}

/// `quantize_at` for arguments the caller has checked: lengths equal, 1 to
/// `MAX_LEVELS` scales, scale finite and at least `max|g|`, every level
/// index in range (the kernels stay memory-safe without these; the codes
/// would be wrong).
/// With `ADD`, each code is added to `codes` (a sum over members that the
/// caller bounds) instead of written.
pub(crate) fn quantize_levels<const ADD: bool>(grad: &[f32], scale: f32, levels: &[u32], level_of: Option<&[u8]>, seed: u64, codes: &mut [i32]) {
    assert!(!levels.is_empty() && levels.len() <= MAX_LEVELS, "{} scales (1 to {MAX_LEVELS})", levels.len());
    let ((ft, st), isa) = (tables(levels, scale), Isa::detect());
    match level_of {
        None => chunked(grad, codes, |offset, g, c| portable::single::<ADD>(isa, g, c, offset, seed, ft[0], st[0])),
        Some(l) => chunked(grad, codes, |offset, g, c| portable::levels::<ADD>(isa, g, &l[offset..offset + g.len()], c, offset, seed, &ft, &st)),
    }
}

/// Values per parallel piece of a packed quantization: whole groups of lanes.
const PACKED_TASK_WORDS: usize = 1 << 12;

/// `quantize_levels` straight into packed lanes (`lanes`' layout) of
/// `width` bits (1 to 32): lane `i` gets `code + s_0`, in `0..=2 s_0`,
/// written or (with `ADD`) added. No code array is made: each group of
/// eight words is filled from the gradient in one pass. The caller checks
/// what `quantize_levels` needs and picks a width that holds every sum it
/// will add (`lanes::width_for(members * 2 s_0)`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn quantize_levels_packed<const ADD: bool>(grad: &[f32], scale: f32, levels: &[u32], level_of: Option<&[u8]>, seed: u64, words: &mut [u64], width: u32) {
    assert!(!levels.is_empty() && levels.len() <= MAX_LEVELS, "{} scales (1 to {MAX_LEVELS})", levels.len());
    assert!((1..=32).contains(&width) && words.len() == super::lanes::words_for(grad.len(), width), "{} codes in {} words of {width}-bit lanes", grad.len(), words.len());
    let (isa, per) = (Isa::detect(), (64 / width) as usize);
    let (ft, st) = tables(levels, scale);
    par::chunks_of(words, PACKED_TASK_WORDS, |first_word, w| {
        let start = first_word * per;
        let g = &grad[start..(start + w.len() * per).min(grad.len())];
        match level_of {
            None => portable::single_packed::<ADD>(isa, g, w, start, seed, ft[0], st[0], width),
            Some(l) => portable::levels_packed::<ADD>(isa, g, &l[start..start + g.len()], w, start, seed, &ft, &st, width),
        }
    });
}

/// Decodes summed codes at their levels: `out[i] = sum[i] * M / s_j`.
pub fn decode_at(sum: &[i32], scale: f32, levels: &[u32], level_of: Option<&[u8]>, out: &mut [f32]) -> Result<()> {
    if sum.len() != out.len() {
        return Err(Error::SizeMismatch { what: "output", expected: sum.len(), got: out.len() });
    }
    if levels.is_empty() || levels.len() > MAX_LEVELS {
        return Err(bad("levels", format!("give 1 to {MAX_LEVELS} scales, got {}", levels.len())));
    }
    check_scale(scale)?;
    if let Some(l) = level_of {
        check_levels(l, sum.len(), levels)?;
    }
    let (steps, isa) = (steps(levels, scale), Isa::detect());
    chunked(sum, out, |offset, c, o| match level_of {
        None => portable::decode(isa, c, o, steps[0]),
        Some(l) => portable::decode_levels(isa, c, &l[offset..offset + c.len()], o, &steps),
    });
    Ok(())
}

/// `decode_at` of codes summed in packed lanes (`lanes`' layout, `width`
/// bits, lane = code sum - `base`), without unpacking them to an array:
/// blocks of lanes are unpacked into a buffer in L1 and decoded from there.
#[allow(clippy::too_many_arguments)]
pub fn decode_packed(words: &[u64], width: u32, base: i64, scale: f32, levels: &[u32], level_of: Option<&[u8]>, out: &mut [f32]) -> Result<()> {
    let n = out.len();
    if !(1..=32).contains(&width) || words.len() != super::lanes::words_for(n, width) {
        return Err(Error::SizeMismatch { what: "packed codes (words)", expected: super::lanes::words_for(n, width.clamp(1, 32)), got: words.len() });
    }
    check_scale(scale)?;
    // Every lane + base an i32 (a code sum): |base| < 2^52 for the exact
    // conversions below, and `as i32` exact.
    super::lanes::check_sums(words, width, base, n)?;
    let Some(l) = level_of else {
        if levels.len() != 1 {
            return Err(bad("levels", format!("{} scales without scale indices", levels.len())));
        }
        return decode_lanes(words, width, base as f64, steps(levels, scale)[0], false, out);
    };
    check_levels(l, n, levels)?;
    let steps = steps(levels, scale);
    let (isa, per, stream) = (Isa::detect(), (64 / width) as usize, decode_streams(n));
    let values = (portable::BLOCK / (super::lanes::GROUP * per)).max(1) * super::lanes::GROUP * per;
    let failed = std::sync::atomic::AtomicBool::new(false);
    par::chunks_of(out, PACKED_TASK_WORDS * per, |start, o| {
        let (pw, pl) = (&words[start / per..start / per + super::lanes::words_for(o.len(), width)], &l[start..start + o.len()]);
        if decode_levels_packed(isa, pw, width, base as f64, pl, o, &steps, stream) {
            return; // 2 to 4 scales: one pass from the lanes
        }
        let mut buf = [0i32; portable::BLOCK];
        for (b, o) in o.chunks_mut(values).enumerate() {
            let first = start + b * values;
            let w = &words[first / per..first / per + super::lanes::words_for(o.len(), width)];
            let c = &mut buf[..o.len()];
            if super::lanes::unpack_serial(w, width, c, |v| (v as i64 + base) as i32).is_err() {
                failed.store(true, std::sync::atomic::Ordering::Relaxed);
                return;
            }
            portable::decode_levels(isa, c, &l[first..first + o.len()], o, &steps);
        }
    });
    if failed.into_inner() {
        return Err(Error::Internal("packed codes split off a group".into()));
    }
    Ok(())
}

/// Whether a decode of `n` values writes them past the caches: when its
/// traffic (4 B written, about 1.5 B of codes and indices read an element)
/// exceeds the last-level cache, where the written lines would otherwise
/// be read first (for ownership) and then pushed out anyway; from 4 Mi
/// elements where the cache is unknown, as the 2-bit codec does.
fn decode_streams(n: usize) -> bool {
    decode_streams_with(n, crate::isa::last_level_cache())
}

fn decode_streams_with(n: usize, last_level_cache: Option<usize>) -> bool {
    n >= 1 << 20 && last_level_cache.map_or(n >= 1 << 22, |llc| n as u128 * 6 > llc as u128)
}

/// `out[i] = (lanes::exact_plus(v, base) * step) as f32` for the lanes `v`
/// of `words` (`width` bits; with `twice`, of `2 v`), in parallel pieces
/// that start a group (`decode_single_packed`): QSGD's one scale
/// (`2 v` with step 1: 1-bit's `2 ones - workers`). `|base| < 2^52` is the
/// caller's. Errors on a wrong word count.
pub(crate) fn decode_lanes(words: &[u64], width: u32, base: f64, step: f64, twice: bool, out: &mut [f32]) -> Result<()> {
    if !(1..=32).contains(&width) || words.len() != super::lanes::words_for(out.len(), width) {
        return Err(Error::SizeMismatch { what: "packed codes (words)", expected: super::lanes::words_for(out.len(), width.clamp(1, 32)), got: words.len() });
    }
    let (isa, per, stream) = (Isa::detect(), (64 / width) as usize, decode_streams(out.len()));
    let failed = std::sync::atomic::AtomicBool::new(false);
    par::chunks_of(out, PACKED_TASK_WORDS * per, |start, o| {
        let w = &words[start / per..start / per + super::lanes::words_for(o.len(), width)];
        if decode_single_packed(isa, w, width, base, step, twice, stream, o).is_err() {
            failed.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    });
    if failed.into_inner() {
        return Err(Error::Internal("packed codes split off a group".into()));
    }
    Ok(())
}

/// Scale indices for `n` codes, each naming one of `levels`.
fn check_levels(l: &[u8], n: usize, levels: &[u32]) -> Result<()> {
    if levels.is_empty() || levels.len() > MAX_LEVELS {
        return Err(bad("levels", format!("give 1 to {MAX_LEVELS} scales, got {}", levels.len())));
    }
    if l.len() != n {
        return Err(Error::SizeMismatch { what: "levels", expected: n, got: l.len() });
    }
    // max over every index (a loop the compiler vectorizes; a search
    // for the first bad one runs only on error)
    if par::map_reduce(l, |_, p| p.iter().fold(0u8, |m, &j| m.max(j)), u8::max) as usize >= levels.len() {
        let j = l.iter().find(|&&j| j as usize >= levels.len()).expect("the max found one");
        return Err(bad("levels", format!("level {j} of {}", levels.len())));
    }
    Ok(())
}

/// Decodes summed codes: `out = sum * scale / s`.
pub fn decode(sum: &[i32], scale: f32, bits: u32, out: &mut [f32]) -> Result<()> {
    decode_at(sum, scale, &[levels(bits)?], None, out)
}

// The one dispatch: which kernel decodes packed lanes. `Isa::detect` has
// chosen the instruction set once; here each hand-written kernel is picked
// by what it supports, with every loop bounded by the slices' real lengths.

/// `portable::decode_levels_packed_body` on `isa`. On AVX-512 and AVX2 the whole
/// groups go through `avx512::decode_packed_few` or
/// `avx2::decode_packed_few`, written by hand: what the compiler made of
/// the loop shuffled each lane's scale indices and spilled, and decoded
/// 2 scales at 1.3x the copy's time on AVX-512, 2.5-2.8x on AVX2.
/// Narrow lanes (`avx512::table_fits`, `avx2::table_fits`: the sums of
/// one or two workers at 2 or 3 bits; on AVX-512 also 3 and 4 scales of
/// two workers' sums and 2 scales of up to five workers') go through
/// `decode_packed_table`, a lookup of every value they can write.
///
/// With `stream`, the hand-written kernels write past the caches.
#[allow(clippy::too_many_arguments)]
fn decode_levels_packed(isa: Isa, words: &[u64], width: u32, base: f64, l: &[u8], o: &mut [f32], steps: &[f64; TABLE], stream: bool) -> bool {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Baseline && isa.is_supported() && (1..=32).contains(&width) {
        let count = portable::steps_in_use(steps);
        let per = (64 / width) as usize;
        // Whole groups only, bounded by every slice's real length.
        let groups = (words.len() / lanes::GROUP).min(l.len() / (lanes::GROUP * per)).min(o.len() / (lanes::GROUP * per));
        let (done_w, done) = (groups * lanes::GROUP, groups * lanes::GROUP * per);
        let kernel: avx512::Whole = match (isa, count) {
            (Isa::Avx512, 2) if avx512::table_fits::<false>(2, width) => avx512::decode_packed_table::<2, false>,
            (Isa::Avx512, 3) if avx512::table_fits::<false>(3, width) => avx512::decode_packed_table::<3, false>,
            (Isa::Avx512, 4) if avx512::table_fits::<false>(4, width) => avx512::decode_packed_table::<4, false>,
            (Isa::Avx512, 2) if avx512::table_fits::<true>(2, width) => avx512::decode_packed_table::<2, true>,
            (Isa::Avx512, 3) if avx512::table_fits::<true>(3, width) => avx512::decode_packed_table::<3, true>,
            (Isa::Avx512, 4) if avx512::table_fits::<true>(4, width) => avx512::decode_packed_table::<4, true>,
            (Isa::Avx2, 2) if avx2::table_fits(2, width) => avx2::decode_packed_table::<2>,
            (Isa::Avx2, 3) if avx2::table_fits(3, width) => avx2::decode_packed_table::<3>,
            (Isa::Avx2, 4) if avx2::table_fits(4, width) => avx2::decode_packed_table::<4>,
            (Isa::Avx512, 2) => avx512::decode_packed_few::<2>,
            (Isa::Avx512, 3) => avx512::decode_packed_few::<3>,
            (Isa::Avx512, 4) => avx512::decode_packed_few::<4>,
            (_, 2) => avx2::decode_packed_few::<2>,
            (_, 3) => avx2::decode_packed_few::<3>,
            (_, 4) => avx2::decode_packed_few::<4>,
            _ => return false,
        };
        let stream = streams(stream, o);
        // SAFETY: `is_supported` checked the kernel's instruction set
        // (AVX-512 F/BW/VL/DQ, or AVX2) on this CPU, `width` is in
        // 1..=32 (and fits the table where the table kernel was
        // picked), `groups` whole groups lie within `words`, `l` and `o`
        // (above), and `o` streams only 16-byte aligned (`streams`).
        unsafe { kernel(words, width, base, l, o, steps, groups, stream) };
        fence(stream);
        return portable::decode_levels_packed_auto(isa, &words[done_w..], width, base, &l[done..], &mut o[done..], steps);
    }
    portable::decode_levels_packed_auto(isa, words, width, base, l, o, steps)
}

/// `o[i] = (exact_plus(lane i, base) * step) as f32` for the values of
/// `words` (lanes of `width` bits, a piece that starts a group; `o.len()`
/// of them; with `twice`, of twice each lane): the decode of one scale.
/// AVX-512 and AVX2 decode the whole groups by hand (`decode_single`;
/// with `stream`, writing past the caches); the rest, and the baseline,
/// go through `lanes::unpack_serial`. Errors on a wrong word count.
#[allow(clippy::too_many_arguments)]
fn decode_single_packed(isa: Isa, words: &[u64], width: u32, base: f64, step: f64, twice: bool, stream: bool, o: &mut [f32]) -> crate::error::Result<()> {
    let (mut done_w, mut done) = (0, 0);
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Baseline && isa.is_supported() && (1..=32).contains(&width) && words.len() == lanes::words_for(o.len(), width) {
        let per = (64 / width) as usize;
        let groups = (words.len() / lanes::GROUP).min(o.len() / (lanes::GROUP * per));
        (done_w, done) = (groups * lanes::GROUP, groups * lanes::GROUP * per);
        // lanes of at most 6 bits (AVX2: 4): every value in a table
        let kernel: avx512::Single = match (isa, twice, width) {
            (Isa::Avx512, true, ..=5) => avx512::decode_single_table::<true, false>,
            (Isa::Avx512, false, ..=5) => avx512::decode_single_table::<false, false>,
            (Isa::Avx512, true, 6) => avx512::decode_single_table::<true, true>,
            (Isa::Avx512, false, 6) => avx512::decode_single_table::<false, true>,
            (Isa::Avx512, true, _) => avx512::decode_single::<true>,
            (Isa::Avx512, false, _) => avx512::decode_single::<false>,
            (_, true, ..=3) => avx2::decode_single_table::<true, false>,
            (_, false, ..=3) => avx2::decode_single_table::<false, false>,
            (_, true, 4) => avx2::decode_single_table::<true, true>,
            (_, false, 4) => avx2::decode_single_table::<false, true>,
            (_, true, _) => avx2::decode_single::<true>,
            (_, false, _) => avx2::decode_single::<false>,
        };
        let stream = streams(stream, o);
        // SAFETY: `is_supported` checked the kernel's instruction set
        // (AVX-512 F/BW/VL/DQ, or AVX2) on this CPU, `width` is in
        // 1..=32 (for a table kernel at most 5, 6 for AVX-512's wide
        // one, 4 for AVX2's and 3 for AVX2's narrow one), `groups`
        // whole groups lie within `words` and `o`, and `o` streams only
        // 16-byte aligned (`streams`).
        unsafe { kernel(words, width, base, step, o, groups, stream) };
        fence(stream);
    }
    let (w, o) = (&words[done_w..], &mut o[done..]);
    if twice {
        lanes::unpack_serial(w, width, o, |v| (lanes::exact_plus(2 * v, base) * step) as f32)
    } else {
        lanes::unpack_serial(w, width, o, |v| (lanes::exact_plus(v, base) * step) as f32)
    }
}

/// Whether a kernel writing `o` streams it: asked to, and `o` 16-byte
/// aligned (`put8`'s halves; every 8 floats from there stay aligned).
#[cfg(target_arch = "x86_64")]
fn streams(stream: bool, o: &[f32]) -> bool {
    stream && o.as_ptr().cast::<u8>().align_offset(16) == 0
}

/// After a kernel that streamed: its stores are seen before the caller's next step.
#[cfg(target_arch = "x86_64")]
fn fence(streamed: bool) {
    if streamed {
        // SAFETY: SFENCE is SSE, part of every x86-64 CPU.
        unsafe { std::arch::x86_64::_mm_sfence() };
    }
}

/// The decode of lanes of `width` bits at `COUNT` steps as a table of
/// `N` floats: entry `r << width | v` is lane value `v` at scale index
/// `r` by `decode_packed_few`'s expression, rows from `COUNT` on at the
/// first step (`pick`'s rule for an index past the steps).
#[cfg(target_arch = "x86_64")]
fn levels_table<const COUNT: usize, const N: usize>(width: u32, base: f64, steps: &[f64; TABLE]) -> [f32; N] {
    std::array::from_fn(|i| {
        let (r, v) = (i >> width.min(63), (i as u64) & ((1u64 << width.min(63)) - 1));
        (lanes::exact_plus(v, base) * if r < COUNT { steps[r] } else { steps[0] }) as f32
    })
}

/// The decode of one scale's lanes of `width` bits as a table of `N`
/// floats: entry `i` is lane value `i mod 2^width` (with `TWICE`,
/// twice it) by `unpack_serial`'s expression in `decode_single_packed`,
/// so a permute that reads only an index's low bits needs no mask.
#[cfg(target_arch = "x86_64")]
fn single_table<const TWICE: bool, const N: usize>(width: u32, base: f64, step: f64) -> [f32; N] {
    std::array::from_fn(|i| {
        let v = (i as u64) & ((1u64 << width.min(63)) - 1);
        (lanes::exact_plus(if TWICE { 2 * v } else { v }, base) * step) as f32
    })
}

/// Stores 8 floats at `o`; with `stream`, past the caches (two
/// non-temporal 16-byte halves: a decode's output it will not read;
/// the caller fences after, `fence`).
///
/// # Safety
/// The CPU has AVX2; `o` has room for 8 floats and, with `stream`, is
/// 16-byte aligned.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn put8(o: *mut f32, f: std::arch::x86_64::__m256, stream: bool) {
    use std::arch::x86_64::*;
    // SAFETY: the caller's.
    unsafe {
        if stream {
            _mm_stream_ps(o, _mm256_castps256_ps128(f));
            _mm_stream_ps(o.add(4), _mm256_extractf128_ps::<1>(f));
        } else {
            _mm256_storeu_ps(o, f);
        }
    }
}
