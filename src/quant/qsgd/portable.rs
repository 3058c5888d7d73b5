//! QSGD's portable kernels: each body is safe Rust, compiled for every
//! instruction set by `isa::multiversion` (baseline, AVX2, AVX-512) and
//! held to `reference` by `tests`. Noise is drawn per element from `noise`,
//! inline, so whole vectors of codes come at once. A kernel processes one
//! piece; `mod.rs` checks the arguments and spreads pieces over threads.
//! Must not touch: intrinsics (`avx2`, `avx512`) or the choice between
//! them and these (`mod.rs`'s dispatch).

use super::TABLE;
use crate::isa::{multiversion, Isa};
use crate::quant::lanes::{self, blocks, pack_codes, pack_direct};
use crate::quant::noise::{self, Keys};

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
pub(super) fn steps_in_use(steps: &[f64; TABLE]) -> usize {
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
    pub(super) fn decode_levels_packed_auto[][](words: &[u64], width: u32, base: f64, l: &[u8], o: &mut [f32], steps: &[f64; TABLE]) -> bool = decode_levels_packed_body;
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
