//! The scalar oracle the kernels are tested against (STYLE: never called
//! in production): one element at a time, as the module docs define it.
//! Must not touch: anything fast; it stays obviously correct.

use super::factor;
use crate::quant::noise;

pub fn fit_levels(grad: &[f32], scale: f32, levels: &[u32], out: &mut [u8]) {
    let s0 = levels[0] as f32;
    for (o, &g) in out.iter_mut().zip(grad) {
        // finest first; `ceil` of a NaN (0 times an infinite factor) is NaN, which fits
        let mut j = levels.len() - 1;
        while j > 0 && (g.abs() * factor(levels[j], scale)).ceil() > s0 {
            j -= 1;
        }
        *o = j as u8;
    }
}

pub fn quantize(grad: &[f32], scale: f32, levels: &[u32], level_of: Option<&[u8]>, offset: usize, seed: u64) -> Vec<i32> {
    grad.iter()
        .enumerate()
        .map(|(i, &g)| {
            let j = level_of.map_or(0, |l| l[i] as usize);
            let (f, s) = (factor(levels[j], scale), levels[j] as f32);
            let l = (g.abs() * f).min(s);
            let level = l.floor() as i32 + (noise::uniform(seed, (offset + i) as u64) < l - l.floor()) as i32;
            if g < 0.0 {
                -level
            } else {
                level
            }
        })
        .collect()
}
