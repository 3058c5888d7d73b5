//! What the benchmark programs share: the timer and the memory-bound
//! baseline every kernel is measured beside.

use std::time::Instant;

use rayon::prelude::*;

const CHUNK: usize = gradpack::codec::CHUNK;

/// `time` of `base`, then of `f`, right after it: a ratio of the two then
/// compares moments seconds apart, not minutes (the bench machines share
/// their last-level cache with neighbours, and a baseline timed once at the
/// start has been seen off by 1.5x by the end). Each is timed back to back,
/// with its own data in cache, as `time` does.
#[allow(dead_code)] // not every benchmark times against a baseline
pub fn time_beside(reps: usize, base: impl FnMut(), f: impl FnMut()) -> (f64, f64) {
    let base = time(reps, base);
    (base, time(reps, f))
}

/// Median seconds of `reps` runs after one warm-up.
pub fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    t[reps / 2]
}

/// The in-place `r += g` loop (12 B/element, the floor of any residual
/// update), in the current rayon pool's threads.
pub fn residual_add(residual: &mut [f32], grad: &[f32]) {
    residual.par_chunks_mut(CHUNK).zip(grad.par_chunks(CHUNK)).for_each(|(r, g)| {
        for (r, g) in r.iter_mut().zip(g) {
            *r += *g;
        }
    })
}

/// Whether any `r + g` is not finite: a read-only pass over both arrays
/// (8 B/element), the floor of a check that must finish before anything is
/// written (the 2-bit operator's validate-first scan).
#[allow(dead_code)] // not every benchmark checks
pub fn any_non_finite(residual: &[f32], grad: &[f32]) -> bool {
    residual.par_chunks(CHUNK).zip(grad.par_chunks(CHUNK)).any(|(r, g)| r.iter().zip(g).fold(false, |bad, (r, g)| bad | !(r + g).is_finite()))
}

/// `next = r + g` into a third array: the floor of a residual update that
/// keeps the old residual (12 B/element, and the new array's lines are
/// read for ownership before they are written).
#[allow(dead_code)] // not every benchmark keeps two residuals
pub fn add_into(next: &mut [f32], residual: &[f32], grad: &[f32]) {
    next.par_chunks_mut(CHUNK).zip(residual.par_chunks(CHUNK)).zip(grad.par_chunks(CHUNK)).for_each(|((o, r), g)| {
        for ((o, r), g) in o.iter_mut().zip(r).zip(g) {
            *o = *r + *g;
        }
    })
}

/// `out = src`, pieces in parallel: the floor of a decode (every value written).
#[allow(dead_code)] // not every benchmark decodes
pub fn copy(out: &mut [f32], src: &[f32]) {
    out.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(o, s)| o.copy_from_slice(s))
}

/// Every scheme the benchmarks measure: a name, and its compress_params
/// (random-K's "k" is filled in by `compression`).
#[allow(dead_code)] // not every benchmark measures schemes
pub const SCHEMES: &[(&str, &[(&str, &str)])] = &[
    ("qsgd_mn 2", &[("compress", "qsgd_mn"), ("bits", "2")]),
    ("qsgd_mn 8", &[("compress", "qsgd_mn"), ("bits", "8")]),
    ("qsgd_mn_ts [2,6]", &[("compress", "qsgd_mn_ts"), ("bits", "[2, 6]")]),
    ("qsgd_mn_ms [2,4,8]", &[("compress", "qsgd_mn_ms"), ("bits", "[2, 4, 8]")]),
    ("grandk_mn k=n/16 b=8", &[("compress", "grandk_mn"), ("bits", "8"), ("k", "")]),
    ("powersgd r=1", &[("compress", "powersgd"), ("rank", "1")]),
    ("powersgd r=4", &[("compress", "powersgd"), ("rank", "4")]),
    ("1bit", &[("compress", "1bit")]),
];

/// `params` for arrays of `n` elements (random-K sends k = n / 16); no
/// params: no compression.
#[allow(dead_code)]
pub fn compression(params: &[(&str, &str)], n: usize) -> gradpack::quant::compression::Compression {
    if params.is_empty() {
        return gradpack::quant::compression::Compression::None;
    }
    let k = (n / 16).to_string();
    let params = params.iter().map(|&(a, b)| (a, if a == "k" { k.as_str() } else { b }));
    gradpack::quant::compression::Compression::from_params(params).unwrap()
}
