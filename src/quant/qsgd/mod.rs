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

use super::noise;
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

/// The per-element factor `s_j / M` of level `j` (0 for an all-zero scale).
#[inline(always)]
pub(crate) fn factor(s: u32, scale: f32) -> f32 {
    if scale == 0.0 {
        0.0
    } else {
        s as f32 / scale
    }
}

/// The kernels' tables of `levels` (at most `kernels::TABLE`) at `scale`:
/// each level's factor `s_j / M` and count `s_j`; entries past the last
/// level are 0.
fn tables(levels: &[u32], scale: f32) -> ([f32; kernels::TABLE], [f32; kernels::TABLE]) {
    let (mut ft, mut st) = ([0f32; kernels::TABLE], [0f32; kernels::TABLE]);
    for ((f, t), &s) in ft.iter_mut().zip(st.iter_mut()).zip(levels) {
        (*f, *t) = (factor(s, scale), s as f32);
    }
    (ft, st)
}

/// Each level's decode step `M / s_j`, in double, so that e.g. 45 codes of
/// 0.5 / 15 decode to exactly 1.5; entries past the last level are 0.
fn steps(levels: &[u32], scale: f32) -> [f64; kernels::TABLE] {
    let mut steps = [0f64; kernels::TABLE];
    levels.iter().zip(steps.iter_mut()).for_each(|(&s, t)| *t = scale as f64 / s as f64);
    steps
}

/// `max |x|`, or `None` when an element is not finite (f32::max would skip NaN).
pub fn max_abs(x: &[f32]) -> Option<f32> {
    let isa = Isa::detect();
    let (m, finite) = par::map_reduce(x, |_, c| kernels::max_abs(isa, c), |a, b| (a.0.max(b.0), a.1 && b.1));
    finite.then_some(m)
}

/// Runs `work(offset, piece of a, piece of b)` over aligned pieces (`par`;
/// noise is indexed by the global element, so results do not depend on the split).
fn chunked<A: Sync, B: Send>(a: &[A], b: &mut [B], work: impl Fn(usize, &[A], &mut [B]) + Sync) {
    par::chunks(b, |start, b| work(start, &a[start..start + b.len()], b));
}

/// The most scales one quantization takes (a compression has at most
/// `compression::MAX_SCALES`): the kernels look them up in a table this long.
pub const MAX_LEVELS: usize = kernels::TABLE;

/// Multi-scale QSGD: for every element, the index of the finest level `j`
/// (`levels` ascending, at most `MAX_LEVELS`) whose largest possible code
/// `ceil(|g| s_j / M)` still fits the coarsest range `s_0`. The choice
/// depends on `g` only, never on rounding noise, so each element's estimate
/// stays unbiased.
pub fn fit_levels(grad: &[f32], scale: f32, levels: &[u32], out: &mut [u8]) {
    assert!(!levels.is_empty() && levels.len() <= MAX_LEVELS, "{} scales (1 to {MAX_LEVELS})", levels.len());
    let (ft, _) = tables(levels, scale);
    let (isa, s0, count) = (Isa::detect(), levels[0] as f32, levels.len());
    chunked(grad, out, |_, g, o| kernels::fit(isa, g, o, &ft, count, s0));
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
        None => chunked(grad, codes, |offset, g, c| kernels::single::<ADD>(isa, g, c, offset, seed, ft[0], st[0])),
        Some(l) => chunked(grad, codes, |offset, g, c| kernels::levels::<ADD>(isa, g, &l[offset..offset + g.len()], c, offset, seed, &ft, &st)),
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
            None => kernels::single_packed::<ADD>(isa, g, w, start, seed, ft[0], st[0], width),
            Some(l) => kernels::levels_packed::<ADD>(isa, g, &l[start..start + g.len()], w, start, seed, &ft, &st, width),
        }
    });
}

#[cfg(test)]
mod reference;

/// QSGD's kernels, each one body compiled for every instruction set
/// (`isa::multiversion`) and tested against `reference`. Noise is drawn per
/// element from `noise`, inline, so whole vectors of codes come at once.
mod kernels {
    use super::noise::{self, Keys};
    use crate::quant::lanes::{self, blocks, pack_codes, pack_direct};
    use crate::isa::{multiversion, Isa};

    /// Scales a kernel's table holds.
    pub const TABLE: usize = 16;

    /// The largest level count a kernel takes (`MAX_BITS` needs 2^15 - 1).
    const MAX_S: f32 = (1u32 << 30) as f32;

    /// `(f, s)` made safe for `code`: `f >= 0` and `s` in `[0, MAX_S]`
    /// (anything else, NaN included, becomes 0). Callers pass values that
    /// already are; this makes the kernels sound for any input.
    #[inline(always)]
    fn sane(f: f32, s: f32) -> (f32, f32) {
        (if f >= 0.0 { f } else { 0.0 }, if (0.0..=MAX_S).contains(&s) { s } else { 0.0 })
    }

    /// The code of `g` at factor `f = s / M` and `s` levels (both `sane`),
    /// with noise `u`.
    #[inline(always)]
    pub(super) fn code(g: f32, u: f32, f: f32, s: f32) -> i32 {
        // |g| f is >= 0 or NaN (0 times an infinite factor); a NaN compares
        // false and gives s, as f32::min would: l is in [0, s]. (This form
        // is one vector min; f32::min adds a NaN test and a blend.)
        let p = g.abs() * f;
        let l = if p < s { p } else { s };
        // SAFETY: l is finite and in [0, 2^30] (above), so truncation fits
        // an i32; truncation of l >= 0 is floor. (A plain `as` saturates,
        // which the compiler cannot vectorize.)
        let floor: i32 = unsafe { l.to_int_unchecked() };
        let level = if u < l - floor as f32 { floor + 1 } else { floor };
        if g < 0.0 {
            -level
        } else {
            level
        }
    }

    #[inline(always)]
    fn put<const ADD: bool>(c: &mut i32, v: i32) {
        if ADD {
            *c += v
        } else {
            *c = v
        }
    }

    #[inline(always)]
    fn single_body<const ADD: bool>(g: &[f32], c: &mut [i32], k: Keys, first: u32, f0: f32, s0: f32) {
        let (f0, s0) = sane(f0, s0);
        for (j, (c, &g)) in c.iter_mut().zip(g).enumerate() {
            put::<ADD>(c, code(g, noise::unit(k, first.wrapping_add(j as u32)), f0, s0));
        }
    }

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn levels_body<const ADD: bool>(g: &[f32], l: &[u8], c: &mut [i32], k: Keys, first: u32, ft: &[f32; TABLE], st: &[f32; TABLE]) {
        let (mut ft, mut st) = (*ft, *st);
        for (f, s) in ft.iter_mut().zip(st.iter_mut()) {
            (*f, *s) = sane(*f, *s);
        }
        // in range by the caller's check; the mask keeps the lookups branch-free
        // (gathers: cheaper here than a select per scale, measured)
        for (j, ((c, &g), &lv)) in c.iter_mut().zip(g).zip(l).enumerate() {
            let lv = lv as usize % TABLE;
            put::<ADD>(c, code(g, noise::unit(k, first.wrapping_add(j as u32)), ft[lv], st[lv]));
        }
    }

    multiversion! {
        fn single_kernel[const ADD: bool][ADD](g: &[f32], c: &mut [i32], k: Keys, first: u32, f0: f32, s0: f32) -> () = single_body;
    }
    multiversion! {
        fn levels_kernel[const ADD: bool][ADD](g: &[f32], l: &[u8], c: &mut [i32], k: Keys, first: u32, ft: &[f32; TABLE], st: &[f32; TABLE]) -> () = levels_body;
    }

    /// Codes of `g` (elements `offset..` of the stream `seed`) into `c`.
    pub fn single<const ADD: bool>(isa: Isa, g: &[f32], c: &mut [i32], offset: usize, seed: u64, f0: f32, s0: f32) {
        assert!(g.len() == c.len(), "qsgd kernel: {} values, {} codes", g.len(), c.len());
        noise::spans(seed, offset, g.len(), |k, first, r| single_kernel::<ADD>(isa, &g[r.clone()], &mut c[r], k, first, f0, s0));
    }

    /// Codes of `g` at the scales `l` names (table entries) into `c`.
    #[allow(clippy::too_many_arguments)]
    pub fn levels<const ADD: bool>(isa: Isa, g: &[f32], l: &[u8], c: &mut [i32], offset: usize, seed: u64, ft: &[f32; TABLE], st: &[f32; TABLE]) {
        assert!(g.len() == c.len() && g.len() == l.len(), "qsgd kernel: {} values, {} scales, {} codes", g.len(), l.len(), c.len());
        noise::spans(seed, offset, g.len(), |k, first, r| levels_kernel::<ADD>(isa, &g[r.clone()], &l[r.clone()], &mut c[r], k, first, ft, st));
    }

    /// Codes per block of a packed kernel: made in one vectorized pass into
    /// a buffer that stays in L1, then packed from it (`lanes::blocks!`).
    pub const BLOCK: usize = lanes::BLOCK;

    /// Words of a group of lanes (eight values share a lane of them).
    const G: usize = lanes::GROUP;

    /// The lanes (`code + off`) of the `N` values `x`, elements `index..` of
    /// the noise stream `k`, each at the scale of the `COUNT` in use that its
    /// `lv` names (`pick`; with one scale `lv` is not read): one vector's
    /// worth for `pack_direct!`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn lanes_of<const N: usize, const COUNT: usize>(x: &[f32; N], lv: &[u8; N], k: Keys, index: u32, f: &[f32; COUNT], s: &[f32; COUNT], off: i32) -> [u32; N] {
        let mut c = [0u32; N];
        for t in 0..N {
            c[t] = code(x[t], noise::unit(k, index.wrapping_add(t as u32)), pick(f, lv[t]), pick(s, lv[t])).wrapping_add(off) as u32;
        }
        c
    }

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn single_packed_body<const ADD: bool>(g: &[f32], w: &mut [u64], k: Keys, first: u32, f0: f32, s0: f32, width: u32) {
        let (f, s) = sane(f0, s0);
        let off = s as i32;
        // Whole groups straight from the codes' vectors (`lanes::pack_direct!`).
        let (fs, ss, none) = ([f], [s], [0u8; 2 * G]);
        let start = pack_direct!(
            ADD,
            g.len(),
            w,
            width,
            |at| lanes_of::<{ 2 * G }, 1>(g[at..at + 2 * G].try_into().unwrap(), &none, k, first.wrapping_add(at as u32), &fs, &ss, off),
            lanes_of::<G, 1>(g[at..at + G].try_into().unwrap(), none[..G].try_into().unwrap(), k, first.wrapping_add(at as u32), &fs, &ss, off)
        );
        let (g, w) = (&g[start..], &mut w[lanes::words_for(start, width)..]);
        let first = first.wrapping_add(start as u32);
        blocks!(ADD, BLOCK, g.len(), w, width, off, |r, c| single_body::<false>(&g[r.clone()], c, k, first.wrapping_add(r.start as u32), f0, s0));
    }

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn levels_packed_body<const ADD: bool>(g: &[f32], l: &[u8], w: &mut [u64], k: Keys, first: u32, ft: &[f32; TABLE], st: &[f32; TABLE], width: u32) {
        let (mut ft, mut st) = (*ft, *st);
        for (f, s) in ft.iter_mut().zip(st.iter_mut()) {
            (*f, *s) = sane(*f, *s);
        }
        // Scales past the last one in use are (0, 0): no pass for them.
        let count = TABLE - st.iter().rev().take_while(|&&s| s == 0.0).count();
        // A few scales (qsgd_mn_ts, _ms): each element picks its (f, s) in
        // registers, in the pass that makes its code.
        match count {
            2 => return levels_packed_few::<ADD, 2>(g, l, w, k, first, &ft, &st, width),
            3 => return levels_packed_few::<ADD, 3>(g, l, w, k, first, &ft, &st, width),
            4 => return levels_packed_few::<ADD, 4>(g, l, w, k, first, &ft, &st, width),
            _ => {}
        }
        let (mut fb, mut sb) = ([0f32; BLOCK], [0f32; BLOCK]);
        blocks!(ADD, BLOCK, g.len().min(l.len()), w, width, st[0] as i32, |r, c| {
            // Each element's (f, s), one select pass per scale over the block
            // (no per-element table lookup: that compiles to gathers).
            let (g, l) = (&g[r.clone()], &l[r.clone()]);
            let (fb, sb) = (&mut fb[..g.len()], &mut sb[..g.len()]);
            fb.fill(ft[0]);
            sb.fill(st[0]);
            for j in 1..count {
                // values, not places: a select of addresses compiles to gathers
                let (fj, sj, j) = (ft[j], st[j], j as u8);
                for ((f, s), &lv) in fb.iter_mut().zip(sb.iter_mut()).zip(l) {
                    let hit = lv == j;
                    *f = if hit { fj } else { *f };
                    *s = if hit { sj } else { *s };
                }
            }
            let at = first.wrapping_add(r.start as u32);
            for (j, (((c, &g), &f), &s)) in c.iter_mut().zip(g).zip(fb.iter()).zip(sb.iter()).enumerate() {
                *c = code(g, noise::unit(k, at.wrapping_add(j as u32)), f, s);
            }
        });
    }

    /// `levels_packed_body` for `COUNT` scales in use (`ft`, `st` already
    /// `sane`): each element's `(f, s)` by `COUNT - 1` selects of values
    /// held in registers, so no buffer pass; the same bits (an index that
    /// names no scale in use keeps scale 0's, as the select passes do).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn levels_packed_few<const ADD: bool, const COUNT: usize>(g: &[f32], l: &[u8], w: &mut [u64], k: Keys, first: u32, ft: &[f32; TABLE], st: &[f32; TABLE], width: u32) {
        let (mut f, mut s) = ([0f32; COUNT], [0f32; COUNT]);
        f.copy_from_slice(&ft[..COUNT]);
        s.copy_from_slice(&st[..COUNT]);
        let off = s[0] as i32;
        let n = g.len().min(l.len());
        // Whole groups straight from the codes' vectors (`lanes::pack_direct!`).
        let start = pack_direct!(
            ADD,
            n,
            w,
            width,
            |at| lanes_of::<{ 2 * G }, COUNT>(g[at..at + 2 * G].try_into().unwrap(), l[at..at + 2 * G].try_into().unwrap(), k, first.wrapping_add(at as u32), &f, &s, off),
            lanes_of::<G, COUNT>(g[at..at + G].try_into().unwrap(), l[at..at + G].try_into().unwrap(), k, first.wrapping_add(at as u32), &f, &s, off)
        );
        let (g, l, w) = (&g[start..n], &l[start..n], &mut w[lanes::words_for(start, width)..]);
        let first = first.wrapping_add(start as u32);
        blocks!(ADD, BLOCK, g.len(), w, width, off, |r, c| {
            let (g, l) = (&g[r.clone()], &l[r.clone()]);
            let at = first.wrapping_add(r.start as u32);
            for (j, ((c, &g), &lv)) in c.iter_mut().zip(g).zip(l).enumerate() {
                *c = code(g, noise::unit(k, at.wrapping_add(j as u32)), pick(&f, lv), pick(&s, lv));
            }
        });
    }

    multiversion! {
        fn single_packed_kernel[const ADD: bool][ADD](g: &[f32], w: &mut [u64], k: Keys, first: u32, f0: f32, s0: f32, width: u32) -> () = single_packed_body;
    }
    multiversion! {
        fn levels_packed_kernel[const ADD: bool][ADD](g: &[f32], l: &[u8], w: &mut [u64], k: Keys, first: u32, ft: &[f32; TABLE], st: &[f32; TABLE], width: u32) -> () = levels_packed_body;
    }

    /// Whether elements `offset..offset + len` share one noise block (the
    /// packed kernels count a `u32` index; a piece across a 2^32 boundary
    /// is split by `noise::spans` into per-block code arrays instead).
    fn one_block(offset: usize, len: usize) -> bool {
        len == 0 || (offset as u64 >> 32) == ((offset + len - 1) as u64 >> 32)
    }

    /// Codes of `g` (elements `offset..` of the stream `seed`, a piece that
    /// starts a group of lanes) packed into `w`.
    #[allow(clippy::too_many_arguments)]
    pub fn single_packed<const ADD: bool>(isa: Isa, g: &[f32], w: &mut [u64], offset: usize, seed: u64, f0: f32, s0: f32, width: u32) {
        if one_block(offset, g.len()) {
            single_packed_kernel::<ADD>(isa, g, w, Keys::new(seed, offset as u64 >> 32), offset as u32, f0, s0, width);
        } else {
            let mut c = vec![0i32; g.len()];
            single::<false>(isa, g, &mut c, offset, seed, f0, s0);
            pack_codes::<ADD>(&c, sane(f0, s0).1 as i32, w, width);
        }
    }

    /// Codes of `g` at the scales `l` names packed into `w` (as `single_packed`).
    #[allow(clippy::too_many_arguments)]
    pub fn levels_packed<const ADD: bool>(isa: Isa, g: &[f32], l: &[u8], w: &mut [u64], offset: usize, seed: u64, ft: &[f32; TABLE], st: &[f32; TABLE], width: u32) {
        assert!(g.len() == l.len(), "qsgd kernel: {} values, {} scales", g.len(), l.len());
        if one_block(offset, g.len()) {
            levels_packed_kernel::<ADD>(isa, g, l, w, Keys::new(seed, offset as u64 >> 32), offset as u32, ft, st, width);
        } else {
            let mut c = vec![0i32; g.len()];
            levels::<false>(isa, g, l, &mut c, offset, seed, ft, st);
            pack_codes::<ADD>(&c, sane(ft[0], st[0]).1 as i32, w, width);
        }
    }

    /// (max |x|, every element finite), as the largest of the values' bit
    /// patterns with the sign cleared: for non-negative floats the integer
    /// order is the float order, and every inf or NaN pattern is at least
    /// inf's, so one integer max per vector does both jobs. Exact whatever
    /// the order, so every kernel agrees. (The float max and an is-finite
    /// test per element compiled to shuffles and scalar compares; they kept
    /// up with memory on this 2-core machine, but with no margin.)
    #[inline(always)]
    fn max_abs_body(x: &[f32]) -> (f32, bool) {
        // An integer max reduction: vectorized without reassociating
        // floats. (Sixteen accumulators in an array were vectorized across
        // chunks instead, with gathers.)
        let top = x.iter().fold(0u32, |m, &v| m.max(v.to_bits() & ABS));
        (f32::from_bits(top), top < INF)
    }

    /// All bits but the sign; the pattern of +inf.
    const ABS: u32 = 0x7fff_ffff;
    const INF: u32 = 0x7f80_0000;

    multiversion! {
        pub fn max_abs[][](x: &[f32]) -> (f32, bool) = max_abs_body;
    }

    /// Fit in blocks this long: each scale's pass over a block stays in L1.
    const FIT_BLOCK: usize = 512;

    /// `o[i]`: how many of scales `1..count` give `|g| f_k <= s0`. Factors
    /// ascend with the scales, so that count is the finest scale that fits
    /// (`ceil(x) <= s0` exactly when `x <= s0`, `s0` a whole number). A NaN
    /// product (0 times an infinite factor) fits, as the code it makes does.
    #[inline(always)]
    fn fit_body(g: &[f32], o: &mut [u8], ft: &[f32; TABLE], count: usize, s0: f32) {
        for (g, o) in g.chunks(FIT_BLOCK).zip(o.chunks_mut(FIT_BLOCK)) {
            o.fill(0);
            for &f in &ft[1..count.clamp(1, TABLE)] {
                for (o, &g) in o.iter_mut().zip(g) {
                    *o += !(g.abs() * f > s0) as u8;
                }
            }
        }
    }

    multiversion! {
        pub fn fit[][](g: &[f32], o: &mut [u8], ft: &[f32; TABLE], count: usize, s0: f32) -> () = fit_body;
    }

    #[inline(always)]
    fn decode_body(c: &[i32], o: &mut [f32], step: f64) {
        o.iter_mut().zip(c).for_each(|(o, &c)| *o = (c as f64 * step) as f32);
    }

    /// The steps a decode uses: those before the trailing zeros (past the
    /// last scale; all of them when the scale is 0), at least one.
    #[inline(always)]
    fn steps_in_use(steps: &[f64; TABLE]) -> usize {
        (TABLE - steps.iter().rev().take_while(|&&s| s == 0.0).count()).max(1)
    }

    #[inline(always)]
    fn decode_levels_body(c: &[i32], l: &[u8], o: &mut [f32], steps: &[f64; TABLE]) {
        // Each element's step by one select pass per scale over a block (a
        // table lookup per element compiles to gathers). Steps past the
        // last scale are 0 (all of them are when the scale is 0).
        let count = steps_in_use(steps);
        match count {
            2 => return decode_levels_few::<2>(c, l, o, steps),
            3 => return decode_levels_few::<3>(c, l, o, steps),
            4 => return decode_levels_few::<4>(c, l, o, steps),
            _ => {}
        }
        const B: usize = 512;
        let mut sb = [0f64; B];
        for ((c, l), o) in c.chunks(B).zip(l.chunks(B)).zip(o.chunks_mut(B)) {
            let sb = &mut sb[..c.len()];
            sb.fill(steps[0]);
            for (j, &step) in steps.iter().enumerate().take(count).skip(1) {
                let j = j as u8;
                for (s, &lv) in sb.iter_mut().zip(l) {
                    *s = if lv == j { step } else { *s };
                }
            }
            for ((o, &c), &s) in o.iter_mut().zip(c).zip(sb.iter()) {
                *o = (c as f64 * s) as f32;
            }
        }
    }

    /// `decode_levels` straight from lanes (`lanes`' layout, a piece that
    /// starts a group) of `width` bits holding `code - base`, with 2 to 4
    /// steps in use (false, nothing written, for any other count): each
    /// code as a double by `lanes::exact_plus`, times its step, in one
    /// pass with no buffer of codes. `|base| < 2^52` is the caller's.
    #[inline(always)]
    fn decode_levels_packed_body(words: &[u64], width: u32, base: f64, l: &[u8], o: &mut [f32], steps: &[f64; TABLE]) -> bool {
        match steps_in_use(steps) {
            2 => decode_packed_few::<2>(words, width, base, l, o, steps),
            3 => decode_packed_few::<3>(words, width, base, l, o, steps),
            4 => decode_packed_few::<4>(words, width, base, l, o, steps),
            _ => return false,
        }
        true
    }

    #[inline(always)]
    fn decode_packed_few<const COUNT: usize>(words: &[u64], width: u32, base: f64, l: &[u8], o: &mut [f32], steps: &[f64; TABLE]) {
        let mut st = [0f64; COUNT];
        st.copy_from_slice(&steps[..COUNT]);
        let (per, mask) = ((64 / width.clamp(1, 32)) as usize, (1u64 << width.clamp(1, 32)) - 1);
        let g = lanes::GROUP;
        for ((w, l), o) in words.chunks(g).zip(l.chunks(g * per)).zip(o.chunks_mut(g * per)) {
            if w.len() == g && o.len() == g * per && l.len() == g * per {
                let mut ws = [0u64; lanes::GROUP];
                ws.copy_from_slice(w);
                for (lane, (l, o)) in l.chunks_exact(g).zip(o.chunks_exact_mut(g)).enumerate() {
                    let shift = lane as u32 * width;
                    for ((o, &lv), &x) in o.iter_mut().zip(l).zip(&ws) {
                        *o = (lanes::exact_plus((x >> shift) & mask, base) * pick(&st, lv)) as f32;
                    }
                }
            } else {
                // the last group: value j in word j % m, lane j / m
                let m = w.len();
                for (j, (o, &lv)) in o.iter_mut().zip(l).enumerate() {
                    let v = (w[j % m] >> ((j / m) as u32 * width)) & mask;
                    *o = (lanes::exact_plus(v, base) * pick(&st, lv)) as f32;
                }
            }
        }
    }

    multiversion! {
        /// `decode_levels_packed_body`.
        fn decode_levels_packed_auto[][](words: &[u64], width: u32, base: f64, l: &[u8], o: &mut [f32], steps: &[f64; TABLE]) -> bool = decode_levels_packed_body;
    }

    /// `decode_levels_packed_body` on `isa`. On AVX-512 and AVX2 the whole
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
    pub fn decode_levels_packed(isa: Isa, words: &[u64], width: u32, base: f64, l: &[u8], o: &mut [f32], steps: &[f64; TABLE], stream: bool) -> bool {
        #[cfg(target_arch = "x86_64")]
        if isa != Isa::Baseline && isa.is_supported() && (1..=32).contains(&width) {
            let count = steps_in_use(steps);
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
            return decode_levels_packed_auto(isa, &words[done_w..], width, base, &l[done..], &mut o[done..], steps);
        }
        decode_levels_packed_auto(isa, words, width, base, l, o, steps)
    }

    /// `o[i] = (exact_plus(lane i, base) * step) as f32` for the values of
    /// `words` (lanes of `width` bits, a piece that starts a group; `o.len()`
    /// of them; with `twice`, of twice each lane): the decode of one scale.
    /// AVX-512 and AVX2 decode the whole groups by hand (`decode_single`;
    /// with `stream`, writing past the caches); the rest, and the baseline,
    /// go through `lanes::unpack_serial`. Errors on a wrong word count.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_single_packed(isa: Isa, words: &[u64], width: u32, base: f64, step: f64, twice: bool, stream: bool, o: &mut [f32]) -> crate::error::Result<()> {
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

    #[cfg(target_arch = "x86_64")]
    mod avx2 {
        use super::{lanes, TABLE};
        use lanes::TWO_52;
        use std::arch::x86_64::*;

        /// 8 codes of `lane` from a group's words (`lo`: words 0-3, `hi`:
        /// 4-7) as doubles, `lanes::exact_plus`'s way: shifted, masked and
        /// ORed into 2^52's bits, less `2^52 - base` (`less`).
        #[inline]
        #[target_feature(enable = "avx2")]
        fn codes<const TWICE: bool>(lo: __m256i, hi: __m256i, shift: __m128i, mask: __m256i, two_52: __m256i, less: __m256d) -> (__m256d, __m256d) {
            let at = |w: __m256i| {
                let v = _mm256_and_si256(_mm256_srl_epi64(w, shift), mask);
                let v = if TWICE { _mm256_add_epi64(v, v) } else { v };
                _mm256_sub_pd(_mm256_castsi256_pd(_mm256_or_si256(v, two_52)), less)
            };
            (at(lo), at(hi))
        }

        /// Products rounded once to f32, stored as 8 values at `o` (`put8`).
        ///
        /// # Safety
        /// `o` has room for 8 floats and, with `stream`, is 16-byte aligned.
        #[inline]
        #[target_feature(enable = "avx2")]
        unsafe fn store(o: *mut f32, lo: __m256d, hi: __m256d, stream: bool) {
            let f = _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo));
            // SAFETY: the caller's.
            unsafe { super::put8(o, f, stream) };
        }

        /// The lane `shift` bits up in a group's words (`lo`: words 0-3,
        /// `hi`: 4-7) as 8 ints in word order, with the lanes above it still
        /// in their high bits: the table kernels' index.
        #[inline]
        #[target_feature(enable = "avx2")]
        fn lane_ints(lo: __m256i, hi: __m256i, shift: __m256i) -> __m256i {
            let (a, b) = (_mm256_srlv_epi64(lo, shift), _mm256_srlv_epi64(hi, shift));
            // low halves of words 0 1 4 5 | 2 3 6 7, then in order
            let v = _mm256_castps_si256(_mm256_shuffle_ps::<0b10_00_10_00>(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b)));
            _mm256_permute4x64_epi64::<0b11_01_10_00>(v)
        }

        /// `decode_single_packed`'s first `groups` whole groups of lanes of
        /// at most 4 bits (with `WIDE`; else 3): each value looked up in a
        /// table of 16 floats (one permute of 8, or with `WIDE` two and a
        /// blend) that the lane decode's own expression filled, repeating
        /// every `2^width` entries, so the bits of the lanes above are never
        /// masked off.
        ///
        /// # Safety
        /// The CPU has AVX2; `width` is in 1..=4 (1..=3 without `WIDE`);
        /// `words` holds at least `8 * groups` words and `o` at least
        /// `8 * groups * (64 / width)`; with `stream`, `o` is 16-byte aligned.
        #[target_feature(enable = "avx2")]
        pub(super) unsafe fn decode_single_table<const TWICE: bool, const WIDE: bool>(words: &[u64], width: u32, base: f64, step: f64, o: &mut [f32], groups: usize, stream: bool) {
            let (per, g) = ((64 / width) as usize, lanes::GROUP);
            debug_assert!((1..=if WIDE { 4 } else { 3 }).contains(&width) && words.len() >= g * groups && o.len() >= g * per * groups);
            let table = super::single_table::<TWICE, 16>(width, base, step);
            // SAFETY: `table` holds 16 floats.
            let (t0, t1) = unsafe { (_mm256_loadu_ps(table.as_ptr()), _mm256_loadu_ps(table.as_ptr().add(8))) };
            each_lane(words, width, groups, |at, v| {
                let f = _mm256_permutevar8x32_ps(t0, v);
                // entries 8..16 where bit 3 of the lane is set
                let f = if WIDE { _mm256_blendv_ps(f, _mm256_permutevar8x32_ps(t1, v), _mm256_castsi256_ps(_mm256_slli_epi32::<28>(v))) } else { f };
                // SAFETY: elements at..at+8 of o exist (the caller's bound,
                // alignment when streamed included).
                unsafe { super::put8(o.as_mut_ptr().add(at), f, stream) };
            });
        }

        /// `f(at, v)` for each lane of the first `groups` whole groups (8
        /// words each) of `words`, lanes of `width` bits (1..=32), in
        /// order: `v` the lane's 8 values (`lane_ints`, the lanes above
        /// still in the high bits), `at` the element of its first value.
        #[inline]
        #[target_feature(enable = "avx2")]
        fn each_lane(words: &[u64], width: u32, groups: usize, mut f: impl FnMut(usize, __m256i)) {
            let (per, g) = ((64 / width) as usize, lanes::GROUP);
            assert!(words.len() >= g * groups, "{groups} groups of lanes in {} words", words.len());
            let lane_bits = _mm256_set1_epi64x(width as i64);
            for gi in 0..groups {
                // SAFETY: words gi*8..gi*8+8 exist (the assert above).
                let (lo, hi) = unsafe { (_mm256_loadu_si256(words.as_ptr().add(gi * g).cast()), _mm256_loadu_si256(words.as_ptr().add(gi * g + 4).cast())) };
                let mut shift = _mm256_setzero_si256();
                for lane in 0..per {
                    f((gi * per + lane) * g, lane_ints(lo, hi, shift));
                    shift = _mm256_add_epi64(shift, lane_bits);
                }
            }
        }

        /// `decode_single_packed`'s first `groups` whole groups.
        ///
        /// # Safety
        /// The CPU has AVX2; `width` is in 1..=32; `words` holds at least
        /// `8 * groups` words and `o` at least `8 * groups * (64 / width)`;
        /// with `stream`, `o` is 16-byte aligned.
        #[target_feature(enable = "avx2")]
        pub(super) unsafe fn decode_single<const TWICE: bool>(words: &[u64], width: u32, base: f64, step: f64, o: &mut [f32], groups: usize, stream: bool) {
            let (per, g) = ((64 / width) as usize, lanes::GROUP);
            debug_assert!(words.len() >= g * groups && o.len() >= g * per * groups);
            let mask = _mm256_set1_epi64x(((1u64 << width) - 1) as i64);
            let two_52 = _mm256_set1_epi64x(TWO_52.to_bits() as i64);
            let (less, st) = (_mm256_set1_pd(TWO_52 - base), _mm256_set1_pd(step));
            for gi in 0..groups {
                // SAFETY: words gi*8..gi*8+8 exist (the caller's bound).
                let (lo, hi) = unsafe { (_mm256_loadu_si256(words.as_ptr().add(gi * g).cast()), _mm256_loadu_si256(words.as_ptr().add(gi * g + 4).cast())) };
                for lane in 0..per {
                    let (a, b) = codes::<TWICE>(lo, hi, _mm_cvtsi32_si128((lane as u32 * width) as i32), mask, two_52, less);
                    // SAFETY: elements (gi * per + lane) * 8 .. +8 of o exist (the
                    // caller's bound, alignment when streamed included).
                    unsafe { store(o.as_mut_ptr().add((gi * per + lane) * g), _mm256_mul_pd(a, st), _mm256_mul_pd(b, st), stream) };
                }
            }
        }

        /// Whether `decode_packed_table::<count>` takes lanes of `width`
        /// bits: every (scale index, lane value) fits its 16 floats.
        pub(super) fn table_fits(count: usize, width: u32) -> bool {
            (1..=4).contains(&width) && count << width <= 16
        }

        /// `decode_packed_few::<COUNT>` for narrow lanes (`table_fits`), as
        /// `avx512::decode_packed_table`: each value looked up in a table of
        /// 16 floats (two permutes of 8 and a blend) that `decode_packed_few`'s
        /// own expression filled. An index past the steps reads row 0 (`pick`:
        /// the first step).
        ///
        /// # Safety
        /// As `decode_packed_few`, and `table_fits(COUNT, width)`.
        #[target_feature(enable = "avx2")]
        #[allow(clippy::too_many_arguments)]
        pub(super) unsafe fn decode_packed_table<const COUNT: usize>(words: &[u64], width: u32, base: f64, l: &[u8], o: &mut [f32], steps: &[f64; TABLE], groups: usize, stream: bool) {
            let (per, g) = ((64 / width) as usize, lanes::GROUP);
            debug_assert!(table_fits(COUNT, width) && words.len() >= g * groups && l.len() >= g * per * groups && o.len() >= g * per * groups);
            let table = super::levels_table::<COUNT, 16>(width, base, steps);
            // SAFETY: `table` holds 16 floats.
            let (t0, t1) = unsafe { (_mm256_loadu_ps(table.as_ptr()), _mm256_loadu_ps(table.as_ptr().add(8))) };
            let mask = _mm256_set1_epi32(((1u32 << width) - 1) as i32);
            let (count, row) = (_mm256_set1_epi32(COUNT as i32), _mm256_set1_epi32(width as i32));
            each_lane(words, width, groups, |at, v| {
                let v = _mm256_and_si256(v, mask);
                // SAFETY: elements at..at+8 of l and o exist (the caller's bound).
                let lv = _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(l.as_ptr().add(at).cast()) });
                let r = _mm256_and_si256(_mm256_cmpgt_epi32(count, lv), lv); // past the steps: row 0
                let i = _mm256_or_si256(v, _mm256_sllv_epi32(r, row));
                // entries 8..16 where bit 3 of the index is set
                let f = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, i), _mm256_permutevar8x32_ps(t1, i), _mm256_castsi256_ps(_mm256_slli_epi32::<28>(i)));
                // SAFETY: as for `lv` (`at` is a multiple of 8: aligned when streamed).
                unsafe { super::put8(o.as_mut_ptr().add(at), f, stream) };
            });
        }

        /// `decode_packed_few::<COUNT>` for the first `groups` whole groups,
        /// as `avx512::decode_packed_few`, each step picked by a permute of
        /// the steps' float halves (one for any COUNT; compares and blends
        /// took 2 to 4 instructions per step).
        ///
        /// # Safety
        /// The CPU has AVX2; `width` is in 1..=32; `words` holds at least
        /// `8 * groups` words and `l` and `o` at least
        /// `8 * groups * (64 / width)` elements; with `stream`, `o` is 16-byte aligned.
        #[target_feature(enable = "avx2")]
        #[allow(clippy::too_many_arguments)]
        pub(super) unsafe fn decode_packed_few<const COUNT: usize>(words: &[u64], width: u32, base: f64, l: &[u8], o: &mut [f32], steps: &[f64; TABLE], groups: usize, stream: bool) {
            let (per, g) = ((64 / width) as usize, lanes::GROUP);
            debug_assert!(words.len() >= g * groups && l.len() >= g * per * groups && o.len() >= g * per * groups);
            let mask = _mm256_set1_epi64x(((1u64 << width) - 1) as i64);
            let two_52 = _mm256_set1_epi64x(TWO_52.to_bits() as i64);
            let less = _mm256_set1_pd(TWO_52 - base);
            // The steps as a table of 8 float halves (a step past COUNT is the
            // first, as `pick` has it); index j picks halves 2j and 2j + 1.
            let table: [f64; 4] = std::array::from_fn(|j| if j < COUNT { steps[j] } else { steps[0] });
            // SAFETY: `table` holds 4 doubles, 32 bytes.
            let table = _mm256_castpd_ps(unsafe { _mm256_loadu_pd(table.as_ptr()) });
            let (four, one) = (_mm_set1_epi8(4), _mm_set1_epi8(1));
            for gi in 0..groups {
                // SAFETY: words gi*8..gi*8+8 exist (the caller's bound).
                let (lo, hi) = unsafe { (_mm256_loadu_si256(words.as_ptr().add(gi * g).cast()), _mm256_loadu_si256(words.as_ptr().add(gi * g + 4).cast())) };
                for lane in 0..per {
                    let (a, b) = codes::<false>(lo, hi, _mm_cvtsi32_si128((lane as u32 * width) as i32), mask, two_52, less);
                    let at = (gi * per + lane) * g;
                    // SAFETY: elements at..at+8 of l and o exist (the caller's bound).
                    let lv = unsafe { _mm_loadl_epi64(l.as_ptr().add(at).cast()) };
                    // `pick`: indices from 4 up become 4, whose halves 8 and 9
                    // the permute reads as 0 and 1 (it keeps 3 bits): the first step.
                    let halves = {
                        let l2 = _mm_min_epu8(lv, four);
                        let l2 = _mm_add_epi8(l2, l2);
                        _mm_unpacklo_epi8(l2, _mm_add_epi8(l2, one))
                    };
                    let sa = _mm256_castps_pd(_mm256_permutevar8x32_ps(table, _mm256_cvtepu8_epi32(halves)));
                    let sb = _mm256_castps_pd(_mm256_permutevar8x32_ps(table, _mm256_cvtepu8_epi32(_mm_srli_si128::<8>(halves))));
                    // SAFETY: as for `lv` (`at` is a multiple of 8: aligned when streamed).
                    unsafe { store(o.as_mut_ptr().add(at), _mm256_mul_pd(a, sa), _mm256_mul_pd(b, sb), stream) };
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    mod avx512 {
        use super::{lanes, TABLE};
        use lanes::TWO_52;
        use std::arch::x86_64::*;

        /// `decode_packed_few` for one count of steps.
        pub(super) type Whole = unsafe fn(&[u64], u32, f64, &[u8], &mut [f32], &[f64; TABLE], usize, bool);

        /// `decode_single`, once or twice each lane.
        pub(super) type Single = unsafe fn(&[u64], u32, f64, f64, &mut [f32], usize, bool);

        /// `decode_packed_few::<COUNT>` for the first `groups` whole groups
        /// (8 words each): per lane, 8 codes as doubles (`lanes::exact_plus`:
        /// the shifted, masked word ORed into 2^52's bits, less `2^52 - base`),
        /// times the step their scale indices pick, rounded once to f32.
        ///
        /// # Safety
        /// The CPU has AVX-512 F/BW/VL/DQ; `width` is in 1..=32; `words` holds
        /// at least `8 * groups` words and `l` and `o` at least
        /// `8 * groups * (64 / width)` elements; with `stream`, `o` is 16-byte aligned.
        #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512dq")]
        #[allow(clippy::too_many_arguments)]
        pub(super) unsafe fn decode_packed_few<const COUNT: usize>(words: &[u64], width: u32, base: f64, l: &[u8], o: &mut [f32], steps: &[f64; TABLE], groups: usize, stream: bool) {
            let per = (64 / width) as usize;
            let g = lanes::GROUP;
            debug_assert!(words.len() >= g * groups && l.len() >= g * per * groups && o.len() >= g * per * groups);
            let mask = _mm512_set1_epi64(((1u64 << width) - 1) as i64);
            let two_52 = _mm512_set1_epi64(TWO_52.to_bits() as i64);
            let less = _mm512_set1_pd(TWO_52 - base);
            let st: [__m512d; COUNT] = std::array::from_fn(|j| _mm512_set1_pd(steps[j]));
            let index: [__m128i; COUNT] = std::array::from_fn(|j| _mm_set1_epi8(j as i8));
            for gi in 0..groups {
                // SAFETY: words gi*8..gi*8+8 exist (the caller's bound).
                let ws = unsafe { _mm512_loadu_si512(words.as_ptr().add(gi * g).cast()) };
                for lane in 0..per {
                    let v = _mm512_srl_epi64(ws, _mm_cvtsi32_si128((lane as u32 * width) as i32));
                    // (v & mask) | 2^52's bits, as a double: 2^52 + the lane's value
                    let d = _mm512_sub_pd(_mm512_castsi512_pd(_mm512_ternarylogic_epi64::<0xEA>(v, mask, two_52)), less);
                    let at = (gi * per + lane) * g;
                    // SAFETY: elements at..at+8 of l and o exist (the caller's bound).
                    let lv = unsafe { _mm_loadl_epi64(l.as_ptr().add(at).cast()) };
                    // `pick`: the step of index j for j in 1..COUNT, else the first
                    let mut s = st[0];
                    for j in 1..COUNT {
                        s = _mm512_mask_blend_pd(_mm_cmpeq_epi8_mask(lv, index[j]) as u8, s, st[j]);
                    }
                    let f = _mm512_cvtpd_ps(_mm512_mul_pd(d, s));
                    // SAFETY: as for `lv` (`at` is a multiple of 8: aligned when streamed).
                    unsafe { super::put8(o.as_mut_ptr().add(at), f, stream) };
                }
            }
        }

        /// Whether `decode_packed_table::<count, WIDE>` takes lanes of
        /// `width` bits: every (scale index, lane value) fits its table of
        /// 32 floats (64 with `WIDE`).
        pub(super) fn table_fits<const WIDE: bool>(count: usize, width: u32) -> bool {
            (1..=6).contains(&width) && count << width <= if WIDE { 64 } else { 32 }
        }

        /// `decode_packed_few::<COUNT>` for narrow lanes (`table_fits`):
        /// every value it can write is in a table of 32 floats (with `WIDE`,
        /// 64), computed once by `decode_packed_few`'s own expression, so 16
        /// values are two shifts, a permute of their lanes into place, the
        /// indices widened and clamped, and one permute of the table (`WIDE`:
        /// two and a blend, `lookup`): no doubles, no products, the same bits.
        ///
        /// # Safety
        /// As `decode_packed_few`, and `table_fits::<WIDE>(COUNT, width)`.
        #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512dq")]
        #[allow(clippy::too_many_arguments)]
        pub(super) unsafe fn decode_packed_table<const COUNT: usize, const WIDE: bool>(words: &[u64], width: u32, base: f64, l: &[u8], o: &mut [f32], steps: &[f64; TABLE], groups: usize, stream: bool) {
            let (per, g) = ((64 / width) as usize, lanes::GROUP);
            debug_assert!(table_fits::<WIDE>(COUNT, width) && words.len() >= g * groups && l.len() >= g * per * groups && o.len() >= g * per * groups);
            let t = tables(&super::levels_table::<COUNT, 64>(width, base, steps));
            let mask = _mm512_set1_epi32(((1u32 << width) - 1) as i32);
            let past = _mm512_set1_epi32(COUNT as i32);
            let row = _mm_cvtsi32_si128(width as i32);
            lane_pairs(words, width, groups, |at, both, v| {
                // SAFETY: elements at..at+16 of l exist when both lanes
                // do, at..at+8 always (the caller's bound).
                let lv = unsafe { if both { _mm_loadu_si128(l.as_ptr().add(at).cast()) } else { _mm_loadl_epi64(l.as_ptr().add(at).cast()) } };
                // An index past the steps, clamped to COUNT, reads row
                // COUNT (the first step), or where COUNT rows fill the
                // table wraps to row 0 (`lookup` reads 5 bits of the
                // index, 6 with `WIDE`): `pick`'s first step either way.
                let r = _mm512_min_epu32(_mm512_cvtepu8_epi32(lv), past);
                // (v & mask) | r << width: the table's index
                let f = lookup::<WIDE>(&t, _mm512_ternarylogic_epi32::<0xEA>(v, mask, _mm512_sll_epi32(r, row)));
                // SAFETY: as for `lv` (`at` is a multiple of 8: aligned when streamed).
                unsafe { put_lanes(o.as_mut_ptr().add(at), f, both, stream) };
            });
        }

        /// `decode_single_packed`'s first `groups` whole groups of lanes of
        /// at most 5 bits (with `WIDE`, 6): each value looked up in a table
        /// of 32 floats (64; `lookup`) that the lane decode's own expression
        /// filled, repeating every `2^width` entries, as
        /// `avx2::decode_single_table`; two lanes, 16 values, at a time, as
        /// `decode_packed_table`.
        ///
        /// # Safety
        /// The CPU has AVX-512 F/BW/VL/DQ; `width` is in 1..=5 (`WIDE`:
        /// 1..=6); `words` holds at least `8 * groups` words and `o` at least
        /// `8 * groups * (64 / width)` elements; with `stream`, `o` is 16-byte aligned.
        #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512dq")]
        pub(super) unsafe fn decode_single_table<const TWICE: bool, const WIDE: bool>(words: &[u64], width: u32, base: f64, step: f64, o: &mut [f32], groups: usize, stream: bool) {
            let (per, g) = ((64 / width) as usize, lanes::GROUP);
            debug_assert!((1..=if WIDE { 6 } else { 5 }).contains(&width) && words.len() >= g * groups && o.len() >= g * per * groups);
            let t = tables(&super::single_table::<TWICE, 64>(width, base, step));
            lane_pairs(words, width, groups, |at, both, v| {
                // SAFETY: elements at..at+8, and at+8..at+16 when `both`, of
                // o exist (the caller's bound; `at` is a multiple of 8:
                // aligned when streamed).
                unsafe { put_lanes(o.as_mut_ptr().add(at), lookup::<WIDE>(&t, v), both, stream) };
            });
        }

        /// `f(at, both, v)` for each pair of lanes of the first `groups`
        /// whole groups (8 words each) of `words`, lanes of `width` bits
        /// (1..=32), in order: `v` the pair's values (`lane_pair_ints`, the
        /// lanes above still in the high bits), `at` the element of the
        /// first lane's first value, `both` whether the second lane is one
        /// (past the last, its ints come from a shift by 64 or less of
        /// words not written: values a kernel does not store).
        #[inline]
        #[target_feature(enable = "avx2,avx512f")]
        fn lane_pairs(words: &[u64], width: u32, groups: usize, mut f: impl FnMut(usize, bool, __m512i)) {
            let (per, g) = ((64 / width) as usize, lanes::GROUP);
            assert!(words.len() >= g * groups, "{groups} groups of lanes in {} words", words.len());
            let (lane_bits, two_lanes) = (_mm512_set1_epi64(width as i64), _mm512_set1_epi64(2 * width as i64));
            for gi in 0..groups {
                // SAFETY: words gi*8..gi*8+8 exist (the assert above).
                let ws = unsafe { _mm512_loadu_si512(words.as_ptr().add(gi * g).cast()) };
                let mut shift = _mm512_setzero_si512();
                for lane in (0..per).step_by(2) {
                    f((gi * per + lane) * g, lane + 1 < per, lane_pair_ints(ws, shift, lane_bits));
                    shift = _mm512_add_epi64(shift, two_lanes);
                }
            }
        }

        /// A table kernel's 64 floats as four vectors.
        #[inline]
        #[target_feature(enable = "avx2,avx512f")]
        fn tables(table: &[f32; 64]) -> [__m512; 4] {
            // SAFETY: entries 16 j .. 16 j + 16 exist for j < 4.
            std::array::from_fn(|j| unsafe { _mm512_loadu_ps(table.as_ptr().add(16 * j)) })
        }

        /// Entry `idx & 31` of the table `t` for each of 16 indices (one
        /// permute of its first 32 floats), or with `WIDE` entry `idx & 63`
        /// (two, and a blend on bit 5).
        #[inline]
        #[target_feature(enable = "avx2,avx512f")]
        fn lookup<const WIDE: bool>(t: &[__m512; 4], idx: __m512i) -> __m512 {
            let low = _mm512_permutex2var_ps(t[0], idx, t[1]);
            if !WIDE {
                return low;
            }
            let high = _mm512_permutex2var_ps(t[2], idx, t[3]);
            _mm512_mask_blend_ps(_mm512_test_epi32_mask(idx, _mm512_set1_epi32(32)), low, high)
        }

        /// The lanes `shift` and `shift + lane_bits` bits up in a group's 8
        /// words `ws` as 16 ints (the first lane's 8 in word order, then the
        /// second's), with the lanes above still in their high bits: the
        /// table kernels' index.
        #[inline]
        #[target_feature(enable = "avx2,avx512f")]
        fn lane_pair_ints(ws: __m512i, shift: __m512i, lane_bits: __m512i) -> __m512i {
            let a = _mm512_srlv_epi64(ws, shift);
            // the low halves of a's 8 words, then of the next lane's
            let pair = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            _mm512_permutex2var_epi32(a, pair, _mm512_srlv_epi64(a, lane_bits))
        }

        /// Stores the 16 values of two lanes at `o`, or with `both` false
        /// the first lane's 8 (`put8`'s halves, streamed or not).
        ///
        /// # Safety
        /// The CPU has AVX-512 F/DQ; `o` has room for 16 floats (8 without
        /// `both`) and, with `stream`, is 16-byte aligned.
        #[inline]
        #[target_feature(enable = "avx2,avx512f,avx512dq")]
        unsafe fn put_lanes(o: *mut f32, f: __m512, both: bool, stream: bool) {
            // SAFETY: the caller's.
            unsafe {
                super::put8(o, _mm512_castps512_ps256(f), stream);
                if both {
                    super::put8(o.add(8), _mm512_extractf32x8_ps::<1>(f), stream);
                }
            }
        }

        /// `decode_single_packed`'s first `groups` whole groups (8 words
        /// each): per lane, 8 codes (with `TWICE`, twice each) as doubles,
        /// as `decode_packed_few`, times `step`, rounded once to f32.
        ///
        /// # Safety
        /// The CPU has AVX-512 F/BW/VL/DQ; `width` is in 1..=32; `words`
        /// holds at least `8 * groups` words and `o` at least
        /// `8 * groups * (64 / width)` elements; with `stream`, `o` is 16-byte aligned.
        #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512dq")]
        pub(super) unsafe fn decode_single<const TWICE: bool>(words: &[u64], width: u32, base: f64, step: f64, o: &mut [f32], groups: usize, stream: bool) {
            let (per, g) = ((64 / width) as usize, lanes::GROUP);
            debug_assert!(words.len() >= g * groups && o.len() >= g * per * groups);
            let mask = _mm512_set1_epi64(((1u64 << width) - 1) as i64);
            let two_52 = _mm512_set1_epi64(TWO_52.to_bits() as i64);
            let (less, st) = (_mm512_set1_pd(TWO_52 - base), _mm512_set1_pd(step));
            for gi in 0..groups {
                // SAFETY: words gi*8..gi*8+8 exist (the caller's bound).
                let ws = unsafe { _mm512_loadu_si512(words.as_ptr().add(gi * g).cast()) };
                for lane in 0..per {
                    let v = _mm512_and_si512(_mm512_srl_epi64(ws, _mm_cvtsi32_si128((lane as u32 * width) as i32)), mask);
                    let v = if TWICE { _mm512_add_epi64(v, v) } else { v };
                    let d = _mm512_sub_pd(_mm512_castsi512_pd(_mm512_or_si512(v, two_52)), less);
                    // SAFETY: elements (gi * per + lane) * 8 .. +8 of o exist (the
                    // caller's bound, alignment when streamed included).
                    unsafe { super::put8(o.as_mut_ptr().add((gi * per + lane) * g), _mm512_cvtpd_ps(_mm512_mul_pd(d, st)), stream) };
                }
            }
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

    /// `vals[lv]`, or `vals[0]` for an index past them, by `COUNT - 1`
    /// selects of values held in registers (a lookup per element compiles
    /// to gathers): the few-scale kernels' choice of scale or step.
    #[inline(always)]
    fn pick<T: Copy, const COUNT: usize>(vals: &[T; COUNT], lv: u8) -> T {
        let mut v = vals[0];
        for (m, &x) in vals.iter().enumerate().skip(1) {
            v = if lv == m as u8 { x } else { v };
        }
        v
    }

    /// `decode_levels_body` for `COUNT` steps in use: each element's step by
    /// `COUNT - 1` selects of values held in registers (the same bits).
    #[inline(always)]
    fn decode_levels_few<const COUNT: usize>(c: &[i32], l: &[u8], o: &mut [f32], steps: &[f64; TABLE]) {
        let mut st = [0f64; COUNT];
        st.copy_from_slice(&steps[..COUNT]);
        for ((o, &c), &lv) in o.iter_mut().zip(c).zip(l) {
            *o = (c as f64 * pick(&st, lv)) as f32;
        }
    }

    multiversion! {
        /// `o[i] = c[i] * step` (in double, rounded once).
        pub fn decode[][](c: &[i32], o: &mut [f32], step: f64) -> () = decode_body;
    }
    multiversion! {
        /// `o[i] = c[i] * steps[l[i]]` (in double, rounded once).
        pub fn decode_levels[][](c: &[i32], l: &[u8], o: &mut [f32], steps: &[f64; TABLE]) -> () = decode_levels_body;
    }

    #[cfg(test)]
    mod tests {
        use super::super::{reference, tables};
        use super::*;

        fn grad(n: usize) -> Vec<f32> {
            (0..n).map(|i| ((i * 7919 % 2001) as f32 - 1000.0) / 997.0).collect()
        }

        const SIZES: [usize; 12] = [0, 1, 7, 8, 9, 15, 16, 17, 33, 511, 513, 1001];

        #[test]
        fn a_decode_streams_only_past_the_last_level_cache() {
            let mib = 1usize << 20;
            // 16 Mi values: streamed past a 32 MiB cache, kept in a 300 MiB one
            assert!(super::super::decode_streams_with(16 * mib, Some(32 * mib)));
            assert!(!super::super::decode_streams_with(16 * mib, Some(300 * mib)));
            assert!(super::super::decode_streams_with(128 * mib, Some(300 * mib)));
            // small decodes never; an unknown cache from 4 Mi values
            assert!(!super::super::decode_streams_with(mib - 1, Some(0)));
            assert!(!super::super::decode_streams_with(4 * mib - 1, None) && super::super::decode_streams_with(4 * mib, None));
        }

        #[test]
        fn every_kernel_matches_the_reference() {
            let scales = [3u32, 15, 255];
            let (ft, st) = tables(&scales, 1.0031);
            for n in SIZES {
                let g = grad(n);
                let mut want_l = vec![0u8; n];
                reference::fit_levels(&g, 1.0031, &scales, &mut want_l);
                assert!(n < 1000 || (want_l.contains(&0) && want_l.contains(&2)));
                let want_single = reference::quantize(&g, 1.0031, &scales[..1], None, 10, 77);
                let want_levels = reference::quantize(&g, 1.0031, &scales, Some(&want_l), 10, 5);
                for isa in Isa::available() {
                    let mut l = vec![9u8; n];
                    fit(isa, &g, &mut l, &ft, scales.len(), 3.0);
                    assert_eq!(l, want_l, "{isa:?} n={n}");
                    for add in [false, true] {
                        let (mut a, mut b) = (vec![2i32; n], vec![2i32; n]);
                        if add {
                            single::<true>(isa, &g, &mut a, 10, 77, ft[0], st[0]);
                            levels::<true>(isa, &g, &l, &mut b, 10, 5, &ft, &st);
                        } else {
                            single::<false>(isa, &g, &mut a, 10, 77, ft[0], st[0]);
                            levels::<false>(isa, &g, &l, &mut b, 10, 5, &ft, &st);
                        }
                        let base = if add { 2 } else { 0 };
                        assert!(a.iter().zip(&want_single).all(|(x, w)| *x == w + base), "{isa:?} single n={n} add={add}");
                        assert!(b.iter().zip(&want_levels).all(|(x, w)| *x == w + base), "{isa:?} levels n={n} add={add}");
                    }
                    let steps: [f64; TABLE] = std::array::from_fn(|j| 1.0031 / (j as f64 + 1.5));
                    let (mut d, mut dl) = (vec![0f32; n], vec![0f32; n]);
                    decode(isa, &want_single, &mut d, steps[0]);
                    decode_levels(isa, &want_levels, &want_l, &mut dl, &steps);
                    assert!(d.iter().zip(&want_single).all(|(d, &c)| *d == (c as f64 * steps[0]) as f32), "{isa:?} decode n={n}");
                    assert!(dl.iter().zip(&want_levels).zip(&want_l).all(|((d, &c), &j)| *d == (c as f64 * steps[j as usize]) as f32), "{isa:?} decode n={n}");
                    // one step straight from lanes, at several widths (the codes spread)
                    for spread in [1i32, 5, 1000] {
                        let codes: Vec<i32> = want_single.iter().map(|&c| c * spread).collect();
                        let lo = codes.iter().copied().min().unwrap_or(0);
                        let width = lanes::width_for(codes.iter().map(|&c| (c - lo) as u64).max().unwrap_or(0));
                        let packed = lanes::pack_slice(&codes, width, |c| (c - lo) as u64);
                        for stream in [false, true] {
                            let mut ds = vec![f32::NAN; n];
                            decode_single_packed(isa, &packed, width, lo as f64, steps[0], false, stream, &mut ds).unwrap();
                            assert!(ds.iter().zip(&codes).all(|(d, &c)| d.to_bits() == ((c as f64 * steps[0]) as f32).to_bits()), "{isa:?} single packed decode n={n} width={width}");
                            assert!(decode_single_packed(isa, &packed[..packed.len().saturating_sub(1)], width, lo as f64, steps[0], false, stream, &mut ds).is_err() || n == 0);
                            // twice each lane, step 1 (1-bit's 2 ones - workers, here with 7 workers)
                            decode_single_packed(isa, &packed, width, -7.0, 1.0, true, stream, &mut ds).unwrap();
                            assert!(ds.iter().zip(&codes).all(|(d, &c)| d.to_bits() == ((2 * (c - lo) as i64 - 7) as f32).to_bits()), "{isa:?} twice packed decode n={n} width={width}");
                        }
                    }
                    // 2 to 4 steps in use (steps in registers) and 5 (select passes)
                    let lo = want_levels.iter().copied().min().unwrap_or(0);
                    let width = lanes::width_for(want_levels.iter().map(|&c| (c - lo) as u64).max().unwrap_or(0));
                    let packed = lanes::pack_slice(&want_levels, width, |c| (c - lo) as u64);
                    for count in 2..=5 {
                        let few: [f64; TABLE] = std::array::from_fn(|j| if j < count { steps[j] } else { 0.0 });
                        let l: Vec<u8> = (0..n).map(|i| ((i * 7 + i / 3) % count) as u8).collect();
                        decode_levels(isa, &want_levels, &l, &mut dl, &few);
                        assert!(dl.iter().zip(&want_levels).zip(&l).all(|((d, &c), &j)| *d == (c as f64 * few[j as usize]) as f32), "{isa:?} decode of {count} steps n={n}");
                        // and straight from lanes, where 2 to 4 are in use
                        let mut dp = vec![f32::NAN; n];
                        assert_eq!(decode_levels_packed(isa, &packed, width, lo as f64, &l, &mut dp, &few, false), count <= 4);
                        if count <= 4 {
                            assert_eq!(dp.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), dl.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), "{isa:?} packed decode of {count} steps n={n}");
                            // an index past the steps takes the first step, as `pick` has it
                            let past: Vec<u8> = l.iter().enumerate().map(|(i, &j)| if i % 3 == 0 { [count as u8, 4, 5, 9, 255][i % 5] } else { j }).collect();
                            decode_levels(isa, &want_levels, &past, &mut dl, &few);
                            assert!(dl.iter().zip(&want_levels).zip(&past).all(|((d, &c), &j)| *d == (c as f64 * few[if (j as usize) < count { j as usize } else { 0 }]) as f32));
                            decode_levels_packed(isa, &packed, width, lo as f64, &past, &mut dp, &few, false);
                            assert_eq!(dp.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), dl.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), "{isa:?} packed decode of {count} steps, indices past them, n={n}");
                            // written past the caches: the same bits
                            dp.fill(f32::NAN);
                            decode_levels_packed(isa, &packed, width, lo as f64, &past, &mut dp, &few, true);
                            assert_eq!(dp.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), dl.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), "{isa:?} packed decode of {count} steps, indices past them, n={n}");
                        }
                    }
                    let mut x = g.clone();
                    let want = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                    assert_eq!(max_abs(isa, &x), (want, true), "{isa:?} n={n}");
                    // The largest magnitude negative, -0.0, subnormals: still exact.
                    if n > 2 {
                        (x[0], x[1], x[n - 1]) = (-0.0, f32::from_bits(1), -2.5);
                        let want = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                        assert_eq!(max_abs(isa, &x), (want, true), "{isa:?} n={n}");
                        assert_eq!(max_abs(isa, &[-0.0, f32::from_bits(0x8000_0001)]), (f32::from_bits(1), true));
                    }
                    // A non-finite value of either sign at any place: a chunk's
                    // first or last lane, or the remainder.
                    for at in [0, n / 2, n.saturating_sub(1)].into_iter().filter(|&at| at < n) {
                        for bad in [f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                            let mut y = g.clone();
                            y[at] = bad;
                            assert!(!max_abs(isa, &y).1, "{isa:?} n={n}: {bad} at {at} missed");
                        }
                    }
                }
            }
        }

        #[test]
        fn packed_kernels_write_the_reference_codes_in_the_lane_layout() {
            use crate::quant::lanes;
            // 2 to 4 scales (kernels with the scales in registers) and 5 (select passes)
            for scales in [&[3u32, 15][..], &[3, 15, 255], &[3, 7, 15, 255], &[3, 5, 7, 15, 255]] {
                let (ft, st) = tables(scales, 1.0031);
                // widths for 1, 2 and 5 members of codes in [-3, 3]; pieces across
                // a block, and a piece across a noise block (offset near 2^32)
                for (n, offset) in [(0usize, 10usize), (1, 10), (167, 10), (168, 10), (169, 0), (5000, 10), (100, (1 << 32) - 37)] {
                    let g = grad(n);
                    let mut l = vec![0u8; n];
                    fit(Isa::detect(), &g, &mut l, &ft, scales.len(), 3.0);
                    let want_single = reference::quantize(&g, 1.0031, &scales[..1], None, offset, 77);
                    let want_levels = reference::quantize(&g, 1.0031, scales, Some(&l), offset, 5);
                    for width in [3u32, 4, 5, 7, 9, 16, 21, 22, 32] {
                        let lanes_of = |c: &[i32], times: u64| lanes::pack_slice(c, width, |c| (c + 3) as u64 * times);
                        for isa in Isa::available() {
                            // adding a second member's codes needs lanes for two (4 bits)
                            for add in [false, true].into_iter().filter(|&add| !add || width > 3) {
                                let (mut a, mut b) = (lanes_of(&want_single, 1), lanes_of(&want_levels, 1));
                                if add {
                                    single_packed::<true>(isa, &g, &mut a, offset, 77, ft[0], st[0], width);
                                    levels_packed::<true>(isa, &g, &l, &mut b, offset, 5, &ft, &st, width);
                                } else {
                                    single_packed::<false>(isa, &g, &mut a, offset, 77, ft[0], st[0], width);
                                    levels_packed::<false>(isa, &g, &l, &mut b, offset, 5, &ft, &st, width);
                                }
                                let times = if add { 2 } else { 1 };
                                assert_eq!(a, lanes_of(&want_single, times), "{isa:?} single n={n} width={width} add={add}");
                                assert_eq!(b, lanes_of(&want_levels, times), "{isa:?} levels {scales:?} n={n} width={width} add={add}");
                            }
                        }
                    }
                }
            }
        }

        #[test]
        fn packed_decodes_of_narrow_lanes_give_the_products_of_the_codes() {
            use crate::quant::lanes;
            // Widths 1 to 7 with one step (tables up to 6 bits, 4 on AVX2;
            // once and twice each lane) and 2 to 4 (tables of 32 and 64
            // where they fit, compares and blends where not); sizes that end on a whole
            // group, on an odd lane (21 lanes of 3 bits: AVX-512's tables
            // pair lanes) and past the groups.
            let mut rng = crate::hash::SplitMix(17);
            for width in 1..=7u32 {
                let per = (64 / width) as usize;
                for n in [0, 1, 8 * per - 1, 8 * per, 8 * per + 8, 24 * per + 5, 40_000] {
                    let lo = -(1i32 << (width - 1));
                    let codes: Vec<i32> = (0..n).map(|_| lo + (rng.next_u64() % (1 << width)) as i32).collect();
                    let packed = lanes::pack_slice(&codes, width, |c| (c - lo) as u64);
                    for (twice, base, step) in [(false, lo as f64, 0.37), (true, -7.0, 1.0)] {
                        let want: Vec<u32> = codes.iter().map(|&c| ((if twice { 2 * (c - lo) as i64 - 7 } else { c as i64 }) as f64 * step) as f32).map(f32::to_bits).collect();
                        for isa in Isa::available() {
                            for stream in [false, true] {
                                let mut got = vec![f32::NAN; n];
                                decode_single_packed(isa, &packed, width, base, step, twice, stream, &mut got).unwrap();
                                assert_eq!(got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want, "{isa:?} one step, width {width}, twice {twice}, n={n}, stream {stream}");
                            }
                        }
                    }
                    for count in 2..=4 {
                        let few: [f64; TABLE] = std::array::from_fn(|j| if j < count { 0.37 / (j as f64 + 1.25) } else { 0.0 });
                        // every index in use, and some past the steps (`pick`: the first step)
                        let l: Vec<u8> = (0..n)
                            .map(|_| {
                                let x = rng.next_u64();
                                if x % 7 == 0 { [count as u8, 4, 5, 9, 255][(x >> 8) as usize % 5] } else { ((x >> 16) as usize % count) as u8 }
                            })
                            .collect();
                        let step = |j: u8| few[if (j as usize) < count { j as usize } else { 0 }];
                        let want: Vec<u32> = codes.iter().zip(&l).map(|(&c, &j)| ((c as f64 * step(j)) as f32).to_bits()).collect();
                        for isa in Isa::available() {
                            for stream in [false, true] {
                                let mut got = vec![f32::NAN; n];
                                assert!(decode_levels_packed(isa, &packed, width, lo as f64, &l, &mut got, &few, stream));
                                assert_eq!(got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want, "{isa:?} width {width}, {count} steps, n={n}, stream {stream}");
                            }
                        }
                    }
                }
            }
        }

        #[test]
        fn packed_decode_matches_the_decode_of_unpacked_codes() {
            use crate::quant::lanes;
            let scales = [3u32, 15, 255];
            for n in [0usize, 1, 168, 169, 3000, 40_000] {
                let codes: Vec<i32> = (0..n as i32).map(|i| (i * 7) % 13 - 6).collect(); // 2 members' sums in [-6, 6]
                let l: Vec<u8> = (0..n).map(|i| (i % 3) as u8).collect();
                let width = lanes::width_for(12);
                let words = lanes::pack_slice(&codes, width, |c| (c + 6) as u64);
                for level_of in [None, Some(&l[..])] {
                    let levels = if level_of.is_some() { &scales[..] } else { &scales[..1] };
                    let (mut want, mut got) = (vec![0f32; n], vec![1f32; n]);
                    super::super::decode_at(&codes, 0.77, levels, level_of, &mut want).unwrap();
                    super::super::decode_packed(&words, width, -6, 0.77, levels, level_of, &mut got).unwrap();
                    assert_eq!(got, want, "n={n} levels={}", levels.len());
                }
                if n > 0 {
                    let mut out = vec![0f32; n];
                    assert!(super::super::decode_packed(&words[1..], width, -6, 0.77, &scales[..1], None, &mut out).is_err());
                    let mut bad = l.clone();
                    bad[n - 1] = 3;
                    assert!(super::super::decode_packed(&words, width, -6, 0.77, &scales, Some(&bad), &mut out).is_err());
                    assert!(super::super::decode_packed(&words, width, -6, 0.77, &scales, None, &mut out).is_err());
                }
            }
        }

        #[test]
        fn an_all_zero_scale_and_infinite_factors_agree_with_the_reference() {
            // scale 0 gives factors 0; a tiny scale gives infinite factors.
            for scale in [0.0f32, 1e-45] {
                let g = vec![0.0f32, -0.0, 1e-45, -1e-45, 0.0];
                let scales = [1u32, 7];
                let (ft, st) = tables(&scales, scale);
                let mut want_l = vec![0u8; 5];
                reference::fit_levels(&g, scale, &scales, &mut want_l);
                let want = reference::quantize(&g, scale, &scales, Some(&want_l), 0, 3);
                for isa in Isa::available() {
                    let (mut l, mut c) = (vec![0u8; 5], vec![0i32; 5]);
                    fit(isa, &g, &mut l, &ft, 2, 1.0);
                    levels::<false>(isa, &g, &l, &mut c, 0, 3, &ft, &st);
                    assert_eq!((&l, &c), (&want_l, &want), "{isa:?} scale={scale}");
                }
            }
        }
    }
}

/// Decodes summed codes at their levels: `out[i] = sum[i] * M / s_j`.
pub fn decode_at(sum: &[i32], scale: f32, levels: &[u32], level_of: Option<&[u8]>, out: &mut [f32]) -> Result<()> {
    if sum.len() != out.len() {
        return Err(Error::SizeMismatch { what: "output", expected: sum.len(), got: out.len() });
    }
    if levels.is_empty() || levels.len() > MAX_LEVELS {
        return Err(bad("levels", format!("give 1 to {MAX_LEVELS} scales, got {}", levels.len())));
    }
    if let Some(l) = level_of {
        check_levels(l, sum.len(), levels)?;
    }
    let (steps, isa) = (steps(levels, scale), Isa::detect());
    chunked(sum, out, |offset, c, o| match level_of {
        None => kernels::decode(isa, c, o, steps[0]),
        Some(l) => kernels::decode_levels(isa, c, &l[offset..offset + c.len()], o, &steps),
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
    let Some(l) = level_of else {
        if levels.len() != 1 {
            return Err(bad("levels", format!("{} scales without scale indices", levels.len())));
        }
        let step = steps(levels, scale)[0];
        if base.unsigned_abs() >= 1 << 52 {
            return super::lanes::unpack_into(words, width, out, |v| ((v as i64 + base) as f64 * step) as f32);
        }
        return decode_lanes(words, width, base as f64, step, false, out);
    };
    check_levels(l, n, levels)?;
    let steps = steps(levels, scale);
    let (isa, per, stream) = (Isa::detect(), (64 / width) as usize, decode_streams(n));
    let values = (kernels::BLOCK / (super::lanes::GROUP * per)).max(1) * super::lanes::GROUP * per;
    let failed = std::sync::atomic::AtomicBool::new(false);
    par::chunks_of(out, PACKED_TASK_WORDS * per, |start, o| {
        let (pw, pl) = (&words[start / per..start / per + super::lanes::words_for(o.len(), width)], &l[start..start + o.len()]);
        if base.unsigned_abs() < 1 << 52 && kernels::decode_levels_packed(isa, pw, width, base as f64, pl, o, &steps, stream) {
            return; // 2 to 4 scales: one pass from the lanes
        }
        let mut buf = [0i32; kernels::BLOCK];
        for (b, o) in o.chunks_mut(values).enumerate() {
            let first = start + b * values;
            let w = &words[first / per..first / per + super::lanes::words_for(o.len(), width)];
            let c = &mut buf[..o.len()];
            if super::lanes::unpack_serial(w, width, c, |v| (v as i64 + base) as i32).is_err() {
                failed.store(true, std::sync::atomic::Ordering::Relaxed);
                return;
            }
            kernels::decode_levels(isa, c, &l[first..first + o.len()], o, &steps);
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
/// that start a group (`kernels::decode_single_packed`): QSGD's one scale
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
        if kernels::decode_single_packed(isa, w, width, base, step, twice, stream, o).is_err() {
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

#[cfg(test)]
mod tests;
