//! How the codec's chunks spread over threads: `par`'s pieces, with the
//! kernels' errors, the first non-finite element, and streaming stores
//! (`isa::residual_streams`).
//! Kernels process one chunk each and know nothing of threads.

use rayon::prelude::*;

use super::gradient::{Grad, Gradient};
use super::platform::Platform;
use super::Thresholds;
use crate::error::Result;

/// Elements per parallel task: `par`'s pieces, a multiple of 16 so chunks
/// never split a block, large enough (768 KiB of traffic for quantize) to
/// amortise a task.
pub use crate::par::CHUNK;
const CHUNK_BLOCKS: usize = CHUNK / 16;

fn parallel(n: usize) -> bool {
    n > CHUNK && rayon::current_num_threads() > 1
}

/// Lengths are checked by the caller; the kernels check each chunk again
/// (a mismatch there is an error, never an out-of-bounds write). In place:
/// every `residual + grad` must be finite.
pub(crate) fn quantize<G: Gradient>(p: Platform, grad: &[G], residual: &mut [f32], blocks: &mut [u32], th: Thresholds) -> Result<()> {
    if !parallel(grad.len()) {
        return p.quantize(grad, residual, blocks, th);
    }
    grad.par_chunks(CHUNK)
        .zip(residual.par_chunks_mut(CHUNK))
        .zip(blocks.par_chunks_mut(CHUNK_BLOCKS))
        .try_for_each(|((g, r), b)| p.quantize(g, r, b, th))
}

/// Out of place, finiteness checked in the same pass: `Ok(false)` when some
/// `residual + grad` is not finite (`residual` untouched, `next` and `blocks`
/// garbage).
pub(crate) fn quantize_to<G: Gradient>(p: Platform, grad: &[G], residual: &[f32], next: &mut [f32], blocks: &mut [u32], th: Thresholds) -> Result<bool> {
    let stream = crate::isa::residual_streams(grad.len());
    if !parallel(grad.len()) {
        return p.quantize_to(grad, residual, next, blocks, th, stream);
    }
    grad.par_chunks(CHUNK)
        .zip(residual.par_chunks(CHUNK))
        .zip(next.par_chunks_mut(CHUNK))
        .zip(blocks.par_chunks_mut(CHUNK_BLOCKS))
        .map(|(((g, r), x), b)| p.quantize_to(g, r, x, b, th, stream))
        .try_reduce(|| true, |a, b| Ok(a && b))
}

pub(crate) fn dequantize<const ADD: bool>(p: Platform, blocks: &[u32], th: Thresholds, out: &mut [f32]) -> Result<()> {
    if !parallel(out.len()) {
        return p.dequantize::<ADD>(blocks, th, out);
    }
    out.par_chunks_mut(CHUNK)
        .zip(blocks.par_chunks(CHUNK_BLOCKS))
        .try_for_each(|(o, b)| p.dequantize::<ADD>(b, th, o))
}

/// The first element whose `residual + grad` is not finite, and that sum:
/// chunks are scanned in parallel, and the earliest bad chunk wins.
pub(crate) fn first_non_finite<G: Gradient>(p: Platform, grad: &[G], residual: &[f32]) -> Result<Option<(usize, f32)>> {
    if !parallel(grad.len()) {
        return p.first_non_finite(grad, residual);
    }
    let found = grad
        .par_chunks(CHUNK)
        .zip(residual.par_chunks(CHUNK))
        .enumerate()
        .map(|(c, (g, r))| p.first_non_finite(g, r).map(|hit| hit.map(|(i, x)| (c * CHUNK + i, x))))
        .find_map_first(|hit| hit.transpose());
    found.transpose()
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

/// One device's part of one chunk: its residual (read), next residual and blocks (written).
type Part<'a> = (&'a [f32], &'a mut [f32], &'a mut [u32]);

/// One chunk of the fused reduce: every device's gradient quantized into its
/// blocks, then decoded into `sum` (overwrite for the first device, add after).
/// False when some device's `residual + grad` was not finite.
fn quantize_reduce_chunk(p: Platform, grads: &[Grad], range: std::ops::Range<usize>, parts: Vec<Part>, th: Thresholds, sum: &mut [f32], stream: bool) -> Result<bool> {
    let mut finite = true;
    for (i, (residual, next, blocks)) in parts.into_iter().enumerate() {
        finite &= match grads[i].slice(range.clone()) {
            Grad::F32(g) => p.quantize_to(g, residual, next, blocks, th, stream)?,
            Grad::F16(g) => p.quantize_to(g, residual, next, blocks, th, stream)?,
            Grad::Bf16(g) => p.quantize_to(g, residual, next, blocks, th, stream)?,
        };
        if i == 0 {
            p.dequantize::<false>(blocks, th, sum)?;
        } else {
            p.dequantize::<true>(blocks, th, sum)?;
        }
    }
    Ok(finite)
}

/// The fused reduce over whole arrays, chunk by chunk so that each chunk of
/// `sum` stays in cache while every device adds into it. Out of place, as
/// `quantize_to`: `Ok(false)` when some sum was not finite. Lengths are
/// checked by the caller.
pub(crate) fn quantize_reduce(p: Platform, grads: &[Grad], residuals: &[&[f32]], nexts: &mut [&mut [f32]], blocks: &mut [&mut [u32]], th: Thresholds, sum: &mut [f32]) -> Result<bool> {
    let (parallel, stream) = (parallel(sum.len()), crate::isa::residual_streams(sum.len()));
    let mut res_chunks: Vec<_> = residuals.iter().map(|r| r.chunks(CHUNK)).collect();
    let mut next_chunks: Vec<_> = nexts.iter_mut().map(|r| r.chunks_mut(CHUNK)).collect();
    let mut blk_chunks: Vec<_> = blocks.iter_mut().map(|b| b.chunks_mut(CHUNK_BLOCKS)).collect();
    let tasks: Vec<_> = sum
        .chunks_mut(CHUNK)
        .enumerate()
        .map(|(c, s)| {
            let parts: Vec<Part> = res_chunks
                .iter_mut()
                .zip(next_chunks.iter_mut())
                .zip(blk_chunks.iter_mut())
                .map(|((r, x), b)| (r.next().unwrap(), x.next().unwrap(), b.next().unwrap()))
                .collect();
            (c * CHUNK, s, parts)
        })
        .collect();
    let run = |(lo, s, parts): (usize, &mut [f32], Vec<Part>)| {
        let hi = lo + s.len();
        quantize_reduce_chunk(p, grads, lo..hi, parts, th, s, stream)
    };
    if parallel {
        tasks.into_par_iter().map(run).try_reduce(|| true, |a, b| Ok(a && b))
    } else {
        tasks.into_iter().try_fold(true, |acc, t| run(t).map(|ok| acc && ok))
    }
}
