//! The one place that decides how chunks spread over threads. Kernels process
//! one chunk each and know nothing of threads.

use rayon::prelude::*;

use super::gradient::Gradient;
use super::platform::Platform;
use super::Thresholds;

/// Elements per parallel task: a multiple of 16 so chunks never split a block,
/// large enough (768 KiB of traffic for quantize) to amortise a task.
pub const CHUNK: usize = 1 << 16;
const CHUNK_BLOCKS: usize = CHUNK / 16;

fn parallel(n: usize) -> bool {
    n > CHUNK && rayon::current_num_threads() > 1
}

pub(crate) fn quantize<G: Gradient>(p: Platform, grad: &[G], residual: &mut [f32], blocks: &mut [u32], th: Thresholds) {
    if !parallel(grad.len()) {
        return p.quantize(grad, residual, blocks, th);
    }
    grad.par_chunks(CHUNK)
        .zip(residual.par_chunks_mut(CHUNK))
        .zip(blocks.par_chunks_mut(CHUNK_BLOCKS))
        .for_each(|((g, r), b)| p.quantize(g, r, b, th));
}

pub(crate) fn dequantize<const ADD: bool>(p: Platform, blocks: &[u32], th: Thresholds, out: &mut [f32]) {
    if !parallel(out.len()) {
        return p.dequantize::<ADD>(blocks, th, out);
    }
    out.par_chunks_mut(CHUNK)
        .zip(blocks.par_chunks(CHUNK_BLOCKS))
        .for_each(|(o, b)| p.dequantize::<ADD>(b, th, o));
}

/// True when any block holds code 0b11 (a fast OR-reduction; the caller finds the
/// exact position only on failure).
pub(crate) fn any_code_11(blocks: &[u32]) -> bool {
    let scan = |c: &[u32]| c.iter().fold(0u32, |acc, w| acc | (w & (w >> 1))) & 0x5555_5555 != 0;
    if blocks.len() * 16 > CHUNK && rayon::current_num_threads() > 1 {
        blocks.par_chunks(CHUNK_BLOCKS).any(scan)
    } else {
        scan(blocks)
    }
}
