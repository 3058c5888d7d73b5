//! The 2-bit codec of docs/contract.md §1: header `[neg_threshold, pos_threshold, n]`, then
//! 16 two-bit codes per float, with error feedback into an f32 residual.
//!
//! This module owns validation and the public API; `reference` is the oracle,
//! `portable` and `avx2` the fast kernels, `platform` picks one, `join` spreads
//! chunks over threads. Compressed blocks are only ever touched as `u32` bits.

#[cfg(target_arch = "x86_64")]
mod avx2;
mod gradient;
mod join;
mod platform;
mod portable;
pub mod reference;
#[cfg(test)]
mod test;

pub use gradient::{Grad, Gradient};
pub use join::CHUNK;
pub use platform::Platform;

use crate::error::{Error, Result};

/// Number of header floats before the blocks.
pub const HEADER_LEN: usize = 3;

/// A validated pair of thresholds: both finite, `neg < 0 < pos`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Thresholds {
    pub(crate) neg: f32,
    pub(crate) pos: f32,
}

impl Thresholds {
    pub fn new(neg: f32, pos: f32) -> Result<Thresholds> {
        let reason = if !neg.is_finite() || !pos.is_finite() {
            "both must be finite"
        } else if !(neg < 0.0) {
            "neg_threshold must be < 0"
        } else if !(pos > 0.0) {
            "pos_threshold must be > 0"
        } else {
            return Ok(Thresholds { neg, pos });
        };
        Err(Error::InvalidThreshold { neg, pos, reason })
    }

    /// MXNet 1.x's single `threshold`: `pos = t`, `neg = -t`.
    pub fn symmetric(threshold: f32) -> Result<Thresholds> {
        Thresholds::new(-threshold, threshold)
    }

    pub fn neg(self) -> f32 {
        self.neg
    }

    pub fn pos(self) -> f32 {
        self.pos
    }
}

/// Length of the compressed array for `n` gradient elements: `3 + ceil(n / 16)`.
pub fn compressed_len(n: usize) -> usize {
    HEADER_LEN + n.div_ceil(16)
}

/// A zero-filled compressed array for a gradient of `n` elements.
pub fn create_2bit(n: usize) -> Vec<f32> {
    vec![0.0; compressed_len(n)]
}

pub(crate) fn check_len(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(Error::SizeMismatch { what, expected, got })
    }
}

/// The blocks of a compressed array as raw bits.
pub fn blocks(compr: &[f32]) -> &[u32] {
    // SAFETY: f32 and u32 have the same size and alignment; every bit pattern is valid for both.
    unsafe { std::slice::from_raw_parts(compr.as_ptr().cast::<u32>(), compr.len()) }.get(HEADER_LEN..).unwrap_or(&[])
}

fn blocks_mut(compr: &mut [f32]) -> &mut [u32] {
    // SAFETY: as in `blocks`; the mutable borrow of `compr` is moved into the result.
    let all = unsafe { std::slice::from_raw_parts_mut(compr.as_mut_ptr().cast::<u32>(), compr.len()) };
    &mut all[HEADER_LEN..]
}

/// Checks that `residual + grad` is finite for every element (docs/contract.md §1): an
/// error naming `what` and the first element where it is not. A read-only
/// pass, so that a failing quantize changes nothing.
pub fn check_finite<G: Gradient>(what: &str, grad: &[G], residual: &[f32]) -> Result<()> {
    check_len("residual", grad.len(), residual.len())?;
    match join::first_non_finite(Platform::detect(), grad, residual)? {
        Some((index, value)) => Err(Error::NonFinite { what: what.into(), index, value }),
        None => Ok(()),
    }
}

/// Quantizes `grad` with error feedback: updates `residual` and writes `compr`
/// (header and blocks). On error, a non-finite `residual + grad` included,
/// nothing is written.
pub fn quantize_2bit<G: Gradient>(grad: &[G], residual: &mut [f32], compr: &mut [f32], th: Thresholds) -> Result<()> {
    // Sizes before the scan (check_finite checks the residual's).
    check_len("compressed array", compressed_len(grad.len()), compr.len())?;
    check_finite("gradient", grad, residual)?;
    quantize_2bit_finite(grad, residual, compr, th)
}

/// `quantize_2bit` for inputs that `check_finite` has accepted (callers that
/// check several slices before quantizing any).
pub(crate) fn quantize_2bit_finite<G: Gradient>(grad: &[G], residual: &mut [f32], compr: &mut [f32], th: Thresholds) -> Result<()> {
    let n = grad.len();
    check_len("residual", n, residual.len())?;
    check_len("compressed array", compressed_len(n), compr.len())?;
    write_header(compr, n, th);
    join::quantize(Platform::detect(), grad, residual, blocks_mut(compr), th)
}

fn write_header(compr: &mut [f32], n: usize, th: Thresholds) {
    compr[0] = th.neg;
    compr[1] = th.pos;
    compr[2] = n as f32; // round to nearest, as docs/contract.md §1 says
}

/// `quantize_2bit` out of place, at the memory floor: reads `residual`,
/// writes the next residual to `next` and `compr`, and checks finiteness in
/// the same pass. On error `residual` is untouched, while `next` and `compr`
/// hold garbage: callers that own the residual keep two buffers and swap them
/// on success (the stores do), which is how validate-first costs no second
/// pass over memory.
pub fn quantize_2bit_to<G: Gradient>(grad: &[G], residual: &[f32], next: &mut [f32], compr: &mut [f32], th: Thresholds) -> Result<()> {
    let n = grad.len();
    check_len("residual", n, residual.len())?;
    check_len("next residual", n, next.len())?;
    check_len("compressed array", compressed_len(n), compr.len())?;
    write_header(compr, n, th);
    if join::quantize_to(Platform::detect(), grad, residual, next, blocks_mut(compr), th)? {
        return Ok(());
    }
    check_finite("gradient", grad, residual)?; // names the first bad element
    Err(Error::Internal("the fused pass found a non-finite sum that the scan did not".into()))
}

/// The reduce step of a compressed push, fused: for every device `i`,
/// quantize `grads[i]` with `residuals[i]` into `nexts[i]` and `comprs[i]`
/// (header and blocks, exactly as `quantize_2bit_to`), and set `sum` to the
/// sum, in device order, of the decoded arrays: bit-identical to
/// `quantize_2bit` then `dequantize_2bit` for the first device and
/// `dequantize_2bit_add` for the others, in one pass. On error, a non-finite
/// `residual + grad` of any device included, `residuals` are untouched;
/// `nexts`, `comprs` and `sum` hold garbage (swap `nexts` in on success).
pub fn quantize_2bit_reduce(grads: &[Grad], residuals: &[&[f32]], nexts: &mut [&mut [f32]], comprs: &mut [&mut [f32]], sum: &mut [f32], th: Thresholds) -> Result<()> {
    let n = sum.len();
    if grads.is_empty() {
        return Err(Error::SizeMismatch { what: "list of device gradients", expected: 1, got: 0 });
    }
    check_len("list of residuals", grads.len(), residuals.len())?;
    check_len("list of next residuals", grads.len(), nexts.len())?;
    check_len("list of compressed arrays", grads.len(), comprs.len())?;
    for (((g, r), x), c) in grads.iter().zip(residuals.iter()).zip(nexts.iter()).zip(comprs.iter()) {
        check_len("gradient", n, g.len())?;
        check_len("residual", n, r.len())?;
        check_len("next residual", n, x.len())?;
        check_len("compressed array", compressed_len(n), c.len())?;
    }
    let mut blocks: Vec<&mut [u32]> = Vec::with_capacity(comprs.len());
    for c in comprs.iter_mut() {
        write_header(c, n, th);
        blocks.push(blocks_mut(c));
    }
    let p = Platform::detect();
    if join::quantize_reduce(p, grads, residuals, nexts, &mut blocks, th, sum)? {
        return Ok(());
    }
    // Off the hot path: name the first device and element that failed.
    for (d, (g, r)) in grads.iter().zip(residuals.iter()).enumerate() {
        let bad = match g {
            Grad::F32(g) => join::first_non_finite(p, g, r)?,
            Grad::F16(g) => join::first_non_finite(p, g, r)?,
            Grad::Bf16(g) => join::first_non_finite(p, g, r)?,
        };
        if let Some((index, value)) = bad {
            return Err(Error::NonFinite { what: format!("pushed value {d}"), index, value });
        }
    }
    Err(Error::Internal("the fused pass found a non-finite sum that the scan did not".into()))
}

/// Checks a compressed array against an output of `n` elements: length, header
/// size, thresholds, and that no block holds code 0b11 or non-zero padding.
/// Returns the thresholds it carries.
pub fn check_compressed(compr: &[f32], n: usize) -> Result<Thresholds> {
    check_len("compressed array", compressed_len(n), compr.len())?;
    let th = check_header(&compr[..HEADER_LEN], n)?;
    let bl = blocks(compr);
    if join::any_code_11(bl) {
        let (block, &w) = bl.iter().enumerate().find(|(_, w)| *w & (*w >> 1) & 0x5555_5555 != 0).expect("scan found one");
        return Err(corrupt_code(block, w));
    }
    let rem = n % 16;
    if rem != 0 {
        let padding_mask = (1u32 << (2 * (16 - rem))) - 1;
        if bl[bl.len() - 1] & padding_mask != 0 {
            return Err(Error::CorruptPadding { block: bl.len() - 1, n });
        }
    }
    Ok(th)
}

/// Checks a compressed array's header against an output of `n` elements:
/// the size it names, then its thresholds.
pub fn check_header(header: &[f32], n: usize) -> Result<Thresholds> {
    check_len("compressed header", HEADER_LEN, header.len())?;
    if header[2] != n as f32 {
        return Err(Error::HeaderSizeMismatch { header: header[2], expected: n });
    }
    Thresholds::new(header[0], header[1])
}

/// The error for block `block`, word `w`, which holds code 0b11: it names
/// the first such element.
pub fn corrupt_code(block: usize, w: u32) -> Error {
    let first = 31 - (w & (w >> 1) & 0x5555_5555).leading_zeros() as usize; // bit 30-2j
    Error::CorruptCode { block, element: block * 16 + (30 - first) / 2 }
}

/// Decodes `compr` into `out` (its size gives `n`). On error nothing is written.
pub fn dequantize_2bit(compr: &[f32], out: &mut [f32]) -> Result<()> {
    let th = check_compressed(compr, out.len())?;
    join::dequantize::<false>(Platform::detect(), blocks(compr), th, out)
}

/// Decodes `compr` and adds it into `sum` (the reduce step). On error nothing is written.
pub fn dequantize_2bit_add(compr: &[f32], sum: &mut [f32]) -> Result<()> {
    let th = check_compressed(compr, sum.len())?;
    join::dequantize::<true>(Platform::detect(), blocks(compr), th, sum)
}
