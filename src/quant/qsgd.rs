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

use crate::par;

use crate::error::{Error, Result};
use crate::hash;

/// The largest `bits` accepted: codes stay far inside an `i32` accumulator.
pub const MAX_BITS: u32 = 15;

fn bad(key: &str, problem: String) -> Error {
    Error::InvalidParam { key: key.to_string(), problem }
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

/// splitmix64 of (seed, i).
#[inline(always)]
fn mix(seed: u64, i: u64) -> u64 {
    hash::finalize(seed ^ i.wrapping_mul(hash::GAMMA))
}

const TWO_POW_MINUS_24: f32 = 1.0 / (1u32 << 24) as f32;

/// A uniform float in [0, 1) for element `i` under `seed`.
#[inline(always)]
pub(crate) fn uniform(seed: u64, i: u64) -> f32 {
    (mix(seed, i) >> 40) as f32 * TWO_POW_MINUS_24
}

/// The rounding noise of elements `2p` and `2p + 1`: two 24-bit uniforms from
/// one 64-bit hash (the hash is most of a code's cost).
#[inline(always)]
fn noise_pair(seed: u64, p: u64) -> [f32; 2] {
    let h = mix(seed, p);
    [(h >> 40) as f32 * TWO_POW_MINUS_24, ((h >> 8) & 0xFF_FFFF) as f32 * TWO_POW_MINUS_24]
}

/// The noise seed of one quantization: the configured `seed`, the key's push
/// count, the key and the device (or worker), mixed so that every
/// (step, key, device) gets its own independent stream.
pub fn stream_seed(seed: u64, step: u64, key_hash: u64, device: u64) -> u64 {
    [step, key_hash, device].iter().fold(seed, |h, &x| hash::finalize((h ^ x).wrapping_add(hash::GAMMA)))
}

/// Quantizes `grad` against the shared `scale` into `codes`. Errors (before
/// writing) for a bad `bits`, a scale that is not finite and >= 0, a scale
/// below `max|g|` (codes would leave `[-s, s]`), or mismatched lengths.
pub fn quantize(grad: &[f32], scale: f32, bits: u32, seed: u64, codes: &mut [i32]) -> Result<()> {
    quantize_at(grad, scale, &[levels(bits)?], None, seed, codes)
}

/// The per-element factor `s_j / M` of level `j` (0 for an all-zero scale).
#[inline(always)]
fn factor(s: u32, scale: f32) -> f32 {
    if scale == 0.0 {
        0.0
    } else {
        s as f32 / scale
    }
}

/// `max |x|`, or `None` when an element is not finite (f32::max would skip NaN).
pub fn max_abs(x: &[f32]) -> Option<f32> {
    let avx2 = simd::avx2();
    let (m, finite) = par::map_reduce(x, |_, c| simd::max_abs(avx2, c), |a, b| (a.0.max(b.0), a.1 && b.1));
    finite.then_some(m)
}

/// Runs `work(offset, piece of a, piece of b)` over aligned pieces (`par`;
/// noise is indexed by the global element, so results do not depend on the split).
fn chunked<A: Sync, B: Send>(a: &[A], b: &mut [B], work: impl Fn(usize, &[A], &mut [B]) + Sync) {
    par::chunks(b, |start, b| work(start, &a[start..start + b.len()], b));
}

/// `ceil(x)` for `0 <= x < 2^31` by truncation (ceilf is a call without SSE4.1).
#[inline(always)]
fn ceil_nonneg(x: f32) -> f32 {
    let t = x as u32;
    (t + ((t as f32) < x) as u32) as f32
}

/// Multi-scale QSGD: for every element, the index of the finest level `j`
/// (`levels` ascending) whose largest possible code `ceil(|g| s_j / M)` still
/// fits the coarsest range `s_0`. The choice depends on `g` only, never on
/// rounding noise, so each element's estimate stays unbiased.
pub fn fit_levels(grad: &[f32], scale: f32, levels: &[u32], out: &mut [u8]) {
    let s0 = levels[0] as f32;
    let factors: Vec<f32> = levels.iter().map(|&s| factor(s, scale)).collect();
    chunked(grad, out, |_, g, o| {
        for (o, &g) in o.iter_mut().zip(g) {
            let a = g.abs();
            // finest first: most elements fit there at once
            let mut j = factors.len() - 1;
            while j > 0 && ceil_nonneg(a * factors[j]) > s0 {
                j -= 1;
            }
            *o = j as u8;
        }
    });
}

/// Quantizes every element at its level (`level_of[i]`, or level 0 for all
/// when `None`): codes in `[-s_j, s_j]`, and within `[-s_0, s_0]` whenever the
/// levels came from `fit_levels` (or a MIN of several workers' choices).
pub fn quantize_at(grad: &[f32], scale: f32, levels: &[u32], level_of: Option<&[u8]>, seed: u64, codes: &mut [i32]) -> Result<()> {
    if codes.len() != grad.len() {
        return Err(Error::SizeMismatch { what: "codes", expected: grad.len(), got: codes.len() });
    }
    if !scale.is_finite() || scale < 0.0 {
        return Err(bad("scale", format!("must be finite and >= 0, got {scale}")));
    }
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
        if let Some(i) = l.iter().position(|&j| j as usize >= levels.len()) {
            return Err(bad("levels", format!("element {i} names level {} of {}", l[i], levels.len())));
        }
    }
    quantize_levels::<false>(grad, scale, levels, level_of, seed, codes);
    Ok(())
}

/// `quantize_at` for arguments the caller has checked: lengths equal, scale
/// finite and at least `max|g|`, every level index in range.
/// With `ADD`, each code is added to `codes` (a sum over members that the
/// caller bounds) instead of written.
pub(crate) fn quantize_levels<const ADD: bool>(grad: &[f32], scale: f32, levels: &[u32], level_of: Option<&[u8]>, seed: u64, codes: &mut [i32]) {
    let factors: Vec<f32> = levels.iter().map(|&s| factor(s, scale)).collect();
    let (f0, s0) = (factors[0], levels[0] as f32);
    let avx2 = simd::avx2();
    match level_of {
        None => return chunked(grad, codes, |offset, g, c| simd::single::<ADD>(avx2, g, c, offset, seed, f0, s0)),
        Some(l) if levels.len() <= simd::TABLE => {
            let (mut ft, mut st) = ([0f32; simd::TABLE], [0f32; simd::TABLE]);
            ft[..levels.len()].copy_from_slice(&factors);
            levels.iter().zip(st.iter_mut()).for_each(|(&s, t)| *t = s as f32);
            return chunked(grad, codes, |offset, g, c| simd::levels::<ADD>(avx2, g, &l[offset..offset + g.len()], c, offset, seed, &ft, &st));
        }
        Some(_) => {}
    }
    // Chunks start at even offsets, so pairs of elements share one hash.
    chunked(grad, codes, |offset, g, c| {
        for (p, (cp, gp)) in c.chunks_mut(2).zip(g.chunks(2)).enumerate() {
            let i = offset + 2 * p;
            let u = noise_pair(seed, (i / 2) as u64);
            for (t, (c, &g)) in cp.iter_mut().zip(gp).enumerate() {
                let (f, s) = match level_of {
                    None => (f0, s0),
                    Some(l) => {
                        let lv = l[i + t] as usize;
                        (factors[lv], levels[lv] as f32)
                    }
                };
                let l = (g.abs() * f).min(s);
                // l >= 0: truncation is floor (a call to floorf without SSE4.1)
                let floor = l as i32;
                let level = floor + (u[t] < l - floor as f32) as i32;
                let code = if g < 0.0 { -level } else { level };
                if ADD {
                    *c += code;
                } else {
                    *c = code;
                }
            }
        }
    });
}

/// Whether this CPU has AVX2 (checked once), for the kernels compiled twice.
pub(crate) fn avx2() -> bool {
    simd::avx2()
}

/// The single-scale quantizer written so that the compiler vectorizes it,
/// compiled twice: for the baseline target and with AVX2 (chosen at run
/// time). The same IEEE operations in the same order: identical codes on
/// every machine and kernel.
mod simd {
    use super::{mix, TWO_POW_MINUS_24};

    pub fn avx2() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            static AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
            *AVX2.get_or_init(|| is_x86_feature_detected!("avx2"))
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    #[inline(always)]
    fn body<const ADD: bool>(g: &[f32], c: &mut [i32], offset: usize, seed: u64, f0: f32, s0: f32) {
        let code = |g: f32, u: f32| {
            let l = (g.abs() * f0).min(s0);
            let floor = l as i32; // l >= 0: truncation is floor
            let level = floor + (u < l - floor as f32) as i32;
            if g < 0.0 { -level } else { level }
        };
        let put = |c: &mut i32, v: i32| if ADD { *c += v } else { *c = v };
        let pairs = g.len() / 2;
        let first = (offset / 2) as u64;
        for p in 0..pairs {
            let h = mix(seed, first + p as u64);
            let u0 = ((h >> 40) as i32) as f32 * TWO_POW_MINUS_24;
            let u1 = (((h >> 8) & 0xFF_FFFF) as i32) as f32 * TWO_POW_MINUS_24;
            put(&mut c[2 * p], code(g[2 * p], u0));
            put(&mut c[2 * p + 1], code(g[2 * p + 1], u1));
        }
        if g.len() % 2 == 1 {
            let h = mix(seed, first + pairs as u64);
            let last = g.len() - 1;
            put(&mut c[last], code(g[last], ((h >> 40) as i32) as f32 * TWO_POW_MINUS_24));
        }
    }

    /// (max |x|, every element finite), in 8 independent lanes the compiler
    /// vectorizes. Max is exact whatever the order, so every kernel agrees.
    #[inline(always)]
    fn max_abs_body(x: &[f32]) -> (f32, bool) {
        let (mut m, mut bad) = ([0f32; 8], [0u32; 8]);
        let mut chunks = x.chunks_exact(8);
        for c in &mut chunks {
            for k in 0..8 {
                let a = c[k].abs();
                m[k] = if a > m[k] { a } else { m[k] };
                bad[k] |= ((c[k].to_bits() & 0x7f80_0000) == 0x7f80_0000) as u32;
            }
        }
        for &v in chunks.remainder() {
            m[0] = if v.abs() > m[0] { v.abs() } else { m[0] };
            bad[0] |= ((v.to_bits() & 0x7f80_0000) == 0x7f80_0000) as u32;
        }
        (m.iter().fold(0f32, |a, &b| a.max(b)), bad.iter().all(|&b| b == 0))
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn max_abs_avx2(x: &[f32]) -> (f32, bool) {
        max_abs_body(x)
    }

    pub fn max_abs(avx2: bool, x: &[f32]) -> (f32, bool) {
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: AVX2 was detected on this CPU (`avx2()`); the body is safe Rust.
            return unsafe { max_abs_avx2(x) };
        }
        let _ = avx2;
        max_abs_body(x)
    }

    /// Scales a table holds; callers with more take the general loop.
    pub const TABLE: usize = 16;

    #[inline(always)]
    fn body_levels<const ADD: bool>(g: &[f32], l: &[u8], c: &mut [i32], offset: usize, seed: u64, ft: &[f32; TABLE], st: &[f32; TABLE]) {
        let code = |g: f32, j: u8, u: f32| {
            let j = (j as usize) % TABLE; // in range by the caller's check; the mask keeps the lookup branch-free
            let l = (g.abs() * ft[j]).min(st[j]);
            let floor = l as i32;
            let level = floor + (u < l - floor as f32) as i32;
            if g < 0.0 { -level } else { level }
        };
        let put = |c: &mut i32, v: i32| if ADD { *c += v } else { *c = v };
        let pairs = g.len() / 2;
        let first = (offset / 2) as u64;
        for p in 0..pairs {
            let h = mix(seed, first + p as u64);
            let u0 = ((h >> 40) as i32) as f32 * TWO_POW_MINUS_24;
            let u1 = (((h >> 8) & 0xFF_FFFF) as i32) as f32 * TWO_POW_MINUS_24;
            put(&mut c[2 * p], code(g[2 * p], l[2 * p], u0));
            put(&mut c[2 * p + 1], code(g[2 * p + 1], l[2 * p + 1], u1));
        }
        if g.len() % 2 == 1 {
            let h = mix(seed, first + pairs as u64);
            let last = g.len() - 1;
            put(&mut c[last], code(g[last], l[last], ((h >> 40) as i32) as f32 * TWO_POW_MINUS_24));
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn body_levels_avx2<const ADD: bool>(g: &[f32], l: &[u8], c: &mut [i32], offset: usize, seed: u64, ft: &[f32; TABLE], st: &[f32; TABLE]) {
        body_levels::<ADD>(g, l, c, offset, seed, ft, st)
    }

    /// Codes of `g` at the scales `l` names (each below the table's
    /// used length) into `c`; all of one length, `offset` even.
    #[allow(clippy::too_many_arguments)]
    pub fn levels<const ADD: bool>(avx2: bool, g: &[f32], l: &[u8], c: &mut [i32], offset: usize, seed: u64, ft: &[f32; TABLE], st: &[f32; TABLE]) {
        assert!(g.len() == c.len() && g.len() == l.len() && offset % 2 == 0, "qsgd kernel: {} values, {} scales, {} codes", g.len(), l.len(), c.len());
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: AVX2 was detected on this CPU (`avx2()`); the body is
            // safe Rust, so its only precondition is the instruction set.
            return unsafe { body_levels_avx2::<ADD>(g, l, c, offset, seed, ft, st) };
        }
        let _ = avx2;
        body_levels::<ADD>(g, l, c, offset, seed, ft, st)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn body_avx2<const ADD: bool>(g: &[f32], c: &mut [i32], offset: usize, seed: u64, f0: f32, s0: f32) {
        body::<ADD>(g, c, offset, seed, f0, s0)
    }

    /// Codes of `g` (elements `offset..`, `offset` even) into `c` (same length).
    pub fn single<const ADD: bool>(avx2: bool, g: &[f32], c: &mut [i32], offset: usize, seed: u64, f0: f32, s0: f32) {
        assert!(g.len() == c.len() && offset % 2 == 0, "qsgd kernel: {} values, {} codes, offset {offset}", g.len(), c.len());
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: AVX2 was detected on this CPU (`avx2()`); the body is
            // safe Rust, so its only precondition is the instruction set.
            return unsafe { body_avx2::<ADD>(g, c, offset, seed, f0, s0) };
        }
        let _ = avx2;
        body::<ADD>(g, c, offset, seed, f0, s0)
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn the_single_scale_kernel_matches_the_per_element_path() {
            // level_of = all zeros with one level runs the general loop.
            for n in [1usize, 2, 7, 64, 1001, 3 * crate::par::CHUNK + 3] {
                let g: Vec<f32> = (0..n).map(|i| ((i * 7919 % 2001) as f32 - 1000.0) / 1000.0).collect();
                let (mut fast, mut general) = (vec![0i32; n], vec![0i32; n]);
                super::super::quantize_levels::<false>(&g, 1.0, &[7], None, 99, &mut fast);
                super::super::quantize_levels::<false>(&g, 1.0, &[7], Some(&vec![0u8; n]), 99, &mut general);
                assert_eq!(fast, general, "n={n}");
            }
        }

        #[test]
        fn the_table_kernel_matches_the_per_element_path_at_every_scale() {
            let n = 3 * crate::par::CHUNK + 5;
            let g: Vec<f32> = (0..n).map(|i| ((i * 7919 % 2001) as f32 - 1000.0) / 1000.0).collect();
            let levels = [3u32, 15, 255];
            let mut l = vec![0u8; n];
            super::super::fit_levels(&g, 1.0, &levels, &mut l);
            assert!(l.contains(&0) && l.contains(&2));
            for add in [false, true] {
                let (mut table, mut general) = (vec![2i32; n], vec![2i32; n]);
                // 17 scales (more than the table) takes the general loop; the first three are the same.
                let many: Vec<u32> = levels.iter().copied().chain((0..14).map(|k| 1023 + k)).collect();
                if add {
                    super::super::quantize_levels::<true>(&g, 1.0, &levels, Some(&l), 5, &mut table);
                    super::super::quantize_levels::<true>(&g, 1.0, &many, Some(&l), 5, &mut general);
                } else {
                    super::super::quantize_levels::<false>(&g, 1.0, &levels, Some(&l), 5, &mut table);
                    super::super::quantize_levels::<false>(&g, 1.0, &many, Some(&l), 5, &mut general);
                }
                assert_eq!(table, general);
                let mut plain = vec![2i32; n];
                let (mut ft, mut st) = ([0f32; super::TABLE], [0f32; super::TABLE]);
                for (j, &s) in levels.iter().enumerate() {
                    (ft[j], st[j]) = (super::super::factor(s, 1.0), s as f32);
                }
                if add {
                    super::levels::<true>(false, &g, &l, &mut plain, 0, 5, &ft, &st);
                } else {
                    super::levels::<false>(false, &g, &l, &mut plain, 0, 5, &ft, &st);
                }
                assert_eq!(plain, table);
            }
        }

        #[test]
        fn max_abs_finds_the_largest_magnitude_and_any_non_finite_value() {
            for n in [0usize, 1, 7, 8, 9, 100, 3 * crate::par::CHUNK + 5] {
                let mut x: Vec<f32> = (0..n).map(|i| ((i * 7919 % 2001) as f32 - 1000.0) / 997.0).collect();
                let want = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                assert_eq!(super::super::max_abs(&x), Some(want), "n={n}");
                assert_eq!(super::max_abs(false, &x), super::max_abs(super::avx2(), &x));
                for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                    for at in [0, n / 2, n.saturating_sub(1)] {
                        if n > 0 {
                            let keep = x[at];
                            x[at] = bad;
                            assert_eq!(super::super::max_abs(&x), None, "n={n} at={at}");
                            x[at] = keep;
                        }
                    }
                }
            }
            assert_eq!(super::super::max_abs(&[-0.0, -3.5, 2.0]), Some(3.5));
        }

        #[test]
        fn both_kernels_give_the_same_codes() {
            let n = 1001;
            let g: Vec<f32> = (0..n).map(|i| ((i * 7919 % 2001) as f32 - 1000.0) / 997.0).collect();
            for (f0, s0) in [(3.0f32, 3.0f32), (127.0 / 1.0031, 127.0), (0.0, 1.0)] {
                for add in [false, true] {
                    let (mut a, mut b) = (vec![1i32; n], vec![1i32; n]);
                    if add {
                        super::single::<true>(false, &g, &mut a, 10, 77, f0, s0);
                        super::single::<true>(super::avx2(), &g, &mut b, 10, 77, f0, s0);
                    } else {
                        super::single::<false>(false, &g, &mut a, 10, 77, f0, s0);
                        super::single::<false>(super::avx2(), &g, &mut b, 10, 77, f0, s0);
                    }
                    assert_eq!(a, b);
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
    if let Some(l) = level_of {
        if l.len() != sum.len() {
            return Err(Error::SizeMismatch { what: "levels", expected: sum.len(), got: l.len() });
        }
        if let Some(&j) = l.iter().find(|&&j| j as usize >= levels.len()) {
            return Err(bad("levels", format!("level {j} of {}", levels.len())));
        }
    }
    // Steps in double, so that e.g. 45 codes of 0.5 / 15 decode to exactly 1.5.
    let steps: Vec<f64> = levels.iter().map(|&s| scale as f64 / s as f64).collect();
    chunked(sum, out, |offset, c, o| match level_of {
        None => o.iter_mut().zip(c).for_each(|(o, &c)| *o = (c as f64 * steps[0]) as f32),
        Some(l) => o.iter_mut().zip(c).zip(&l[offset..]).for_each(|((o, &c), &j)| *o = (c as f64 * steps[j as usize]) as f32),
    });
    Ok(())
}

/// Decodes summed codes: `out = sum * scale / s`.
pub fn decode(sum: &[i32], scale: f32, bits: u32, out: &mut [f32]) -> Result<()> {
    decode_at(sum, scale, &[levels(bits)?], None, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::scheme::{from_wire, to_wire, Part};

    fn grad(n: usize, seed: u64) -> Vec<f32> {
        (0..n).map(|i| (uniform(seed, i as u64) - 0.5) * 2.0).collect()
    }

    #[test]
    fn unbiased_mean_approaches_the_input() {
        let g = grad(200, 1);
        let scale = g.iter().fold(0f32, |m, x| m.max(x.abs()));
        for bits in [1, 2, 4] {
            let s = levels(bits).unwrap() as f64;
            let trials = 4000;
            let mut mean = vec![0f64; g.len()];
            let mut codes = vec![0i32; g.len()];
            for t in 0..trials {
                quantize(&g, scale, bits, 1000 + t, &mut codes).unwrap();
                mean.iter_mut().zip(&codes).for_each(|(m, &c)| *m += c as f64 * scale as f64 / s / trials as f64);
            }
            // per element the standard error is at most (M/s)/2/sqrt(trials)
            let tol = 5.0 * (scale as f64 / s) / 2.0 / (trials as f64).sqrt();
            for (m, &x) in mean.iter().zip(&g) {
                assert!((m - x as f64).abs() < tol, "bits={bits}: mean {m} vs {x} (tol {tol})");
            }
        }
    }

    #[test]
    fn variance_within_the_max_norm_bound() {
        // E||Q(g) - g||^2 = sum (M/s)^2 p(1-p) <= n (M/s)^2 / 4.
        let g = grad(1000, 2);
        let scale = 1.0;
        for bits in [1, 3, 8] {
            let step = scale / levels(bits).unwrap() as f32;
            let mut codes = vec![0i32; g.len()];
            let mut total = 0f64;
            let trials = 200;
            for t in 0..trials {
                quantize(&g, scale, bits, t, &mut codes).unwrap();
                total += g.iter().zip(&codes).map(|(&x, &c)| ((c as f32 * step - x) as f64).powi(2)).sum::<f64>();
            }
            let bound = g.len() as f64 * (step as f64).powi(2) / 4.0;
            assert!(total / trials as f64 <= bound * 1.05, "bits={bits}: {} > {bound}", total / trials as f64);
        }
    }

    #[test]
    fn codes_sum_exactly_and_every_worker_decodes_alike() {
        let bits = 4;
        let workers: Vec<Vec<f32>> = (0..5).map(|w| grad(333, 10 + w)).collect();
        let scale = workers.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
        let mut acc = vec![0i32; 333];
        let mut direct = vec![0i32; 333];
        for (w, g) in workers.iter().enumerate() {
            let mut codes = vec![0i32; 333];
            quantize(g, scale, bits, 77 + w as u64, &mut codes).unwrap();
            assert!(codes.iter().all(|c| c.abs() <= 15));
            // On the wire: lanes of 5 bits (2s + 1 = 31 values), 12 to a word, after a 17-byte header.
            let wire = to_wire(&Part::Codes { codes: codes.clone(), lo: -15, hi: 15 });
            assert_eq!(wire.len(), 17 + 8 * 333usize.div_ceil(12));
            let Part::Codes { codes: received, .. } = from_wire(&wire).unwrap() else { unreachable!() };
            crate::quant::collective::add_codes(&mut acc, &received).unwrap();
            direct.iter_mut().zip(&codes).for_each(|(d, c)| *d += c);
        }
        assert_eq!(acc, direct);
        let (mut a, mut b) = (vec![0f32; 333], vec![0f32; 333]);
        decode(&acc, scale, bits, &mut a).unwrap();
        decode(&direct, scale, bits, &mut b).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn no_overflow_at_the_largest_worker_count() {
        let bits = MAX_BITS;
        let s = levels(bits).unwrap() as i32;
        let workers = max_workers(bits).unwrap();
        let mut acc = vec![0i32; 2];
        for _ in 0..workers {
            crate::quant::collective::add_codes(&mut acc, &[s, -s]).unwrap();
        }
        assert_eq!(acc, vec![s * workers as i32, -s * workers as i32]);
        assert!(crate::quant::collective::add_codes(&mut acc, &[s, 0]).unwrap_err().to_string().contains("too many workers"));
    }

    #[test]
    fn deterministic_given_the_seed() {
        let g = grad(500, 3);
        let (mut a, mut b, mut c) = (vec![0i32; 500], vec![0i32; 500], vec![0i32; 500]);
        quantize(&g, 1.0, 2, 9, &mut a).unwrap();
        quantize(&g, 1.0, 2, 9, &mut b).unwrap();
        quantize(&g, 1.0, 2, 10, &mut c).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn bad_parameters_are_errors_and_touch_nothing() {
        let g = vec![0.5f32, -2.0];
        let mut codes = vec![7i32; 2];
        for (bits, scale, want) in [(0, 2.0, "'bits'"), (16, 2.0, "'bits'"), (2, 1.0, "below the gradient's max"), (2, f32::NAN, "'scale'"), (2, -1.0, "'scale'")] {
            let err = quantize(&g, scale, bits, 0, &mut codes).unwrap_err().to_string();
            assert!(err.contains(want), "{err}");
            assert_eq!(codes, vec![7, 7]);
        }
        assert!(quantize(&[f32::NAN], 1.0, 2, 0, &mut [0]).is_err());
        // 8 codes at 2 bits (in [-3, 3]: 3-bit lanes) take one word; the wire checks length and range.
        let wire = to_wire(&Part::Codes { codes: vec![0; 8], lo: -3, hi: 3 });
        assert_eq!(from_wire(&wire).unwrap(), Part::Codes { codes: vec![0; 8], lo: -3, hi: 3 });
        assert!(from_wire(&wire[..wire.len() - 1]).is_err());
        let mut out_of_range = wire.clone();
        out_of_range[17] = 0b111; // lane 0 holds 7: code 4, outside [-3, 3]
        assert!(from_wire(&out_of_range).unwrap_err().to_string().contains("outside"));
        let mut zeros = vec![5i32; 3];
        quantize(&[0.0; 3], 0.0, 4, 0, &mut zeros).unwrap();
        assert_eq!(zeros, vec![0; 3]);
    }
}
