//! Portable chunked kernels: whole 16-element blocks in straight-line code the
//! compiler can vectorise on any target. Runs everywhere; the fallback.

use super::gradient::Gradient;
use super::reference;
use super::Thresholds;

/// Quantizes one whole block in place: its word, and whether every
/// `residual + grad` was finite (a branch-free flag the caller may ignore).
#[inline(always)]
fn quantize16<G: Gradient>(g: &[G], r: &mut [f32], th: Thresholds) -> (u32, bool) {
    let mut word = 0u32;
    let mut bad = false;
    for j in 0..16 {
        let x = r[j] + g[j].to_f32();
        bad |= !x.is_finite();
        let ge = x >= th.pos;
        let le = x <= th.neg;
        r[j] = if ge {
            x - th.pos
        } else if le {
            x - th.neg
        } else {
            x
        };
        word |= ((ge as u32) << (30 - 2 * j)) | ((le as u32) << (31 - 2 * j));
    }
    (word, !bad)
}

/// In place: `residual` becomes the next residual. The caller has checked
/// that every sum is finite.
pub fn quantize<G: Gradient>(grad: &[G], residual: &mut [f32], blocks: &mut [u32], th: Thresholds) {
    let full = grad.len() / 16;
    let (g_full, g_tail) = grad.split_at(full * 16);
    let (r_full, r_tail) = residual.split_at_mut(full * 16);
    for ((g, r), w) in g_full.chunks_exact(16).zip(r_full.chunks_exact_mut(16)).zip(blocks.iter_mut()) {
        *w = quantize16(g, r, th).0;
    }
    if !g_tail.is_empty() {
        blocks[full] = reference::quantize_block(g_tail, r_tail, th);
    }
}

/// Out of place: the next residual goes to `next`, and `residual` is only
/// read. Returns false when some `residual + grad` was not finite (then
/// `next` and `blocks` hold garbage).
pub fn quantize_to<G: Gradient>(grad: &[G], residual: &[f32], next: &mut [f32], blocks: &mut [u32], th: Thresholds) -> bool {
    let full = grad.len() / 16;
    let (g_full, g_tail) = grad.split_at(full * 16);
    let (r_full, r_tail) = residual.split_at(full * 16);
    let (n_full, n_tail) = next.split_at_mut(full * 16);
    let mut finite = true;
    for (((g, r), n), w) in g_full.chunks_exact(16).zip(r_full.chunks_exact(16)).zip(n_full.chunks_exact_mut(16)).zip(blocks.iter_mut()) {
        n.copy_from_slice(r); // one block, in L1: the in-place body then runs on it
        let (word, ok) = quantize16(g, n, th);
        *w = word;
        finite &= ok;
    }
    if !g_tail.is_empty() {
        finite &= reference::first_non_finite(g_tail, r_tail).is_none();
        n_tail.copy_from_slice(r_tail);
        blocks[full] = reference::quantize_block(g_tail, n_tail, th);
    }
    finite
}

pub fn dequantize<const ADD: bool>(blocks: &[u32], th: Thresholds, out: &mut [f32]) {
    let full = out.len() / 16;
    let (o_full, o_tail) = out.split_at_mut(full * 16);
    for (o, &word) in o_full.chunks_exact_mut(16).zip(blocks.iter()) {
        for j in 0..16 {
            let code = (word >> (30 - 2 * j)) & 0b11;
            let v = if code == 0b01 {
                th.pos
            } else if code == 0b10 {
                th.neg
            } else {
                0.0
            };
            if ADD {
                o[j] += v;
            } else {
                o[j] = v;
            }
        }
    }
    if !o_tail.is_empty() {
        reference::dequantize_block::<ADD>(blocks[full], th, o_tail);
    }
}

/// `reference::first_non_finite`, scanning 64 elements at a time with a
/// branch-free OR the compiler vectorises, then locating inside the block.
pub fn first_non_finite<G: Gradient>(grad: &[G], residual: &[f32]) -> Option<(usize, f32)> {
    const SCAN: usize = 64;
    for (b, (g, r)) in grad.chunks(SCAN).zip(residual.chunks(SCAN)).enumerate() {
        let bad = g.iter().zip(r).fold(false, |acc, (g, r)| acc | !(r + g.to_f32()).is_finite());
        if bad {
            return reference::first_non_finite(g, r).map(|(i, x)| (b * SCAN + i, x));
        }
    }
    None
}
