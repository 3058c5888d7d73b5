//! The scalar oracle: docs/contract.md §1 written out element by element. It is not the
//! product; every fast kernel is tested bit-for-bit against it.

use super::gradient::Gradient;
use super::Thresholds;

/// Code of an element in its block word: element `j` of the block sits at bits
/// `31-2j` and `30-2j`.
#[inline(always)]
pub(crate) fn shift_of(j: usize) -> u32 {
    30 - 2 * j as u32
}

/// One element of quantize: returns the 2-bit code and the new residual.
#[inline(always)]
pub(crate) fn quantize_one(residual: f32, grad: f32, th: Thresholds) -> (u32, f32) {
    let r = residual + grad;
    if r >= th.pos {
        (0b01, r - th.pos)
    } else if r <= th.neg {
        (0b10, r - th.neg)
    } else {
        (0b00, r)
    }
}

/// Value of a code that has already been checked (never 0b11).
#[inline(always)]
pub(crate) fn value_of(code: u32, th: Thresholds) -> f32 {
    match code {
        0b01 => th.pos,
        0b10 => th.neg,
        _ => 0.0,
    }
}

/// Quantizes `grad.len()` elements (at most 16) into one block word.
/// Fast kernels use this for the partial last block, so tails are exact by construction.
#[inline]
pub(crate) fn quantize_block<G: Gradient>(grad: &[G], residual: &mut [f32], th: Thresholds) -> u32 {
    debug_assert!(grad.len() <= 16 && grad.len() == residual.len());
    let mut word = 0u32;
    for (j, (g, r)) in grad.iter().zip(residual.iter_mut()).enumerate() {
        let (code, next) = quantize_one(*r, g.to_f32(), th);
        *r = next;
        word |= code << shift_of(j);
    }
    word
}

/// Decodes the first `out.len()` (at most 16) elements of one block word.
#[inline]
pub(crate) fn dequantize_block<const ADD: bool>(word: u32, th: Thresholds, out: &mut [f32]) {
    debug_assert!(out.len() <= 16);
    for (j, o) in out.iter_mut().enumerate() {
        let v = value_of((word >> shift_of(j)) & 0b11, th);
        if ADD {
            *o += v;
        } else {
            *o = v;
        }
    }
}

/// Reference quantize. Preconditions (checked by the caller): `residual.len() ==
/// grad.len()`, `blocks.len() == ceil(grad.len() / 16)`.
pub fn quantize<G: Gradient>(grad: &[G], residual: &mut [f32], blocks: &mut [u32], th: Thresholds) {
    blocks.fill(0);
    for i in 0..grad.len() {
        let (code, next) = quantize_one(residual[i], grad[i].to_f32(), th);
        residual[i] = next;
        blocks[i / 16] |= code << shift_of(i % 16);
    }
}

/// Reference dequantize: `out = decode(blocks)`, or `out += decode(blocks)` when `ADD`.
/// Blocks must already be validated (no code 0b11).
pub fn dequantize<const ADD: bool>(blocks: &[u32], th: Thresholds, out: &mut [f32]) {
    for (i, o) in out.iter_mut().enumerate() {
        let v = value_of((blocks[i / 16] >> shift_of(i % 16)) & 0b11, th);
        if ADD {
            *o += v;
        } else {
            *o = v;
        }
    }
}

/// The first element whose `residual + grad` (in float32, as quantize adds
/// them) is NaN or infinite, and that sum.
pub fn first_non_finite<G: Gradient>(grad: &[G], residual: &[f32]) -> Option<(usize, f32)> {
    grad.iter().zip(residual).map(|(g, r)| r + g.to_f32()).enumerate().find(|(_, x)| !x.is_finite())
}
