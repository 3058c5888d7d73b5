//! What the benchmark programs share: the timer and the memory-bound
//! baseline every kernel is measured beside.

use std::time::Instant;

use rayon::prelude::*;

const CHUNK: usize = gradpack::codec::CHUNK;

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
