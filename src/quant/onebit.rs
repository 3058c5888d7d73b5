//! MXNet 2.0's 1-bit compression with error feedback: `r += g`; if
//! `r > threshold` the bit is 1, the element decodes to +1 and `r -= 1`; else
//! the bit is 0, it decodes to -1 and `r += 1`. One bit per element on the wire.

use rayon::prelude::*;

use super::lanes;
use crate::error::{Error, Result};
use crate::isa::Isa;

/// One element's rule: `x = r + g`; above `threshold` the bit is 1 and
/// `x - 1` stays, else the bit is 0 and `x + 1` stays. Returns (bit, next
/// residual).
#[inline(always)]
fn bit(g: f32, r: f32, threshold: f32) -> (bool, f32) {
    let x = r + g;
    let bit = x > threshold;
    (bit, if bit { x - 1.0 } else { x + 1.0 })
}

/// Quantizes one worker's gradient into bits (0 or 1, decoding to -1 or +1),
/// updating its residual in place. Lengths must be equal (the scheme's
/// rounds check them; a caller's mistake panics, naming them).
/// With `ADD`, each bit is added to `bits` (a count over members) instead
/// of written.
pub fn quantize<const ADD: bool>(grad: &[f32], residual: &mut [f32], threshold: f32, bits: &mut [i32]) {
    assert!(grad.len() == residual.len() && bits.len() == residual.len(), "1-bit quantize of {} values with {} residuals and {} bits", grad.len(), residual.len(), bits.len());
    crate::par::chunks2(residual, bits, |start, r, b| {
        for ((g, r), b) in grad[start..start + r.len()].iter().zip(r.iter_mut()).zip(b.iter_mut()) {
            let (set, next) = bit(*g, *r, threshold);
            (*b, *r) = (if ADD { *b + set as i32 } else { set as i32 }, next);
        }
    });
}

/// `bit` over a piece, out of place: `residual` is read, `next` and
/// `bits` written.
#[inline(always)]
fn quantize_piece(grad: &[f32], residual: &[f32], next: &mut [f32], threshold: f32, bits: &mut [i32]) {
    for (((g, r), x), b) in grad.iter().zip(residual).zip(next.iter_mut()).zip(bits.iter_mut()) {
        let (set, r) = bit(*g, *r, threshold);
        (*b, *x) = (set as i32, r);
    }
}

/// Words of packed lanes per parallel piece (`quantize_packed`).
const TASK_WORDS: usize = 1 << 12;

/// `quantize` straight into packed lanes (`lanes`' layout) of `width` bits
/// (1 to 32, wide enough for every sum the caller will add): lane `i` gets
/// the bit, written or (with `ADD`) added. One pass, no bit array. Out of
/// place: `residual` is the previous residual, read only, and `next`
/// receives the new one (the caller commits it once the push succeeded;
/// past the caches when `isa::residual_streams`).
pub fn quantize_packed<const ADD: bool>(grad: &[f32], residual: &[f32], next: &mut [f32], threshold: f32, words: &mut [u64], width: u32) {
    assert!((1..=32).contains(&width) && grad.len() == residual.len() && grad.len() == next.len() && words.len() == lanes::words_for(grad.len(), width), "1-bit: {} values, {} residuals, {} next residuals, {} words of {width} bits", grad.len(), residual.len(), next.len(), words.len());
    let (isa, per, stream) = (Isa::detect(), (64 / width) as usize, crate::isa::residual_streams(grad.len()));
    next.par_chunks_mut(TASK_WORDS * per).zip(words.par_chunks_mut(TASK_WORDS)).enumerate().for_each(|(i, (x, w))| {
        let piece = i * TASK_WORDS * per..i * TASK_WORDS * per + x.len();
        let (g, r) = (&grad[piece.clone()], &residual[piece]);
        if stream {
            packed_kernel::<ADD, true>(isa, g, r, x, threshold, w, width)
        } else {
            packed_kernel::<ADD, false>(isa, g, r, x, threshold, w, width)
        }
    });
}

#[inline(always)]
fn packed_body<const ADD: bool, const STREAM: bool>(grad: &[f32], residual: &[f32], next: &mut [f32], threshold: f32, words: &mut [u64], width: u32) {
    let n = grad.len().min(residual.len()).min(next.len());
    // Whole groups straight from the bits' vectors (`lanes::pack_direct!`).
    let start = lanes::pack_direct!(ADD, n, words, width, |at| bits_of::<16, STREAM>(grad[at..at + 16].try_into().unwrap(), residual[at..at + 16].try_into().unwrap(), (&mut next[at..at + 16]).try_into().unwrap(), threshold), {
        bits_of::<8, STREAM>(grad[at..at + 8].try_into().unwrap(), residual[at..at + 8].try_into().unwrap(), (&mut next[at..at + 8]).try_into().unwrap(), threshold)
    });
    crate::isa::fence::<STREAM>();
    let (grad, residual, next, words) = (&grad[start..n], &residual[start..n], &mut next[start..n], &mut words[lanes::words_for(start, width)..]);
    lanes::blocks!(ADD, lanes::BLOCK, grad.len(), words, width, 0, |span, c| quantize_piece(&grad[span.clone()], &residual[span.clone()], &mut next[span], threshold, c));
}

/// `quantize_piece` of `N` values, the bits returned as lanes, the next
/// residuals stored (`isa::store`).
#[inline(always)]
fn bits_of<const N: usize, const STREAM: bool>(grad: &[f32; N], residual: &[f32; N], next: &mut [f32; N], threshold: f32) -> [u32; N] {
    let (mut bits, mut x) = ([0i32; N], [0f32; N]);
    quantize_piece(grad, residual, &mut x, threshold, &mut bits);
    crate::isa::store::<STREAM, N>(next, &x);
    bits.map(|b| b as u32)
}

crate::isa::multiversion! {
    fn packed_kernel[const ADD: bool, const STREAM: bool][ADD, STREAM](grad: &[f32], residual: &[f32], next: &mut [f32], threshold: f32, words: &mut [u64], width: u32) -> () = packed_body;
}

/// A threshold must be finite.
pub fn check_threshold(threshold: f32) -> Result<f32> {
    if threshold.is_finite() {
        Ok(threshold)
    } else {
        Err(Error::InvalidParam { key: "threshold".into(), problem: format!("must be finite, got {threshold}") })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_feedback_keeps_the_running_sum() {
        let grads = [0.3f32, -0.7, 0.2, 0.9, -0.1];
        let mut r = [0f32];
        let (mut sent, mut total) = (0f32, 0f32);
        let mut b = [0i32];
        for g in grads.iter().cycle().take(50) {
            quantize::<false>(&[*g], &mut r, 0.0, &mut b);
            sent += (2 * b[0] - 1) as f32;
            total += g;
            // what was not sent stays in the residual
            assert!((total - sent - r[0]).abs() < 1e-4);
            assert!(r[0].abs() <= 2.0);
        }
    }

    #[test]
    fn packed_bits_are_the_bits_in_the_lane_layout_on_every_kernel() {
        for n in [0usize, 1, 63, 512, 513, 5000, 40_000, 64 * TASK_WORDS + 7] {
            let g: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0).collect();
            let r0: Vec<f32> = (0..n).map(|i| ((i * 11 % 7) as f32 - 3.0) / 4.0).collect();
            let (mut want_r, mut bits) = (r0.clone(), vec![0i32; n]);
            quantize::<false>(&g, &mut want_r, 0.1, &mut bits);
            for width in [1u32, 2, 5] {
                for isa in crate::isa::Isa::available() {
                    let per = (64 / width) as usize;
                    for (add, stream) in [(false, false), (true, false), (false, true), (true, true)].into_iter().filter(|&(a, _)| !a || width > 1) {
                        let mut next = vec![f32::NAN; n];
                        let mut words = lanes::pack_slice(&bits, width, |b| b as u64);
                        for (i, (x, w)) in next.chunks_mut(TASK_WORDS * per).zip(words.chunks_mut(TASK_WORDS)).enumerate() {
                            let piece = i * TASK_WORDS * per..i * TASK_WORDS * per + x.len();
                            let (g, r) = (&g[piece.clone()], &r0[piece]);
                            match (add, stream) {
                                (false, false) => packed_kernel::<false, false>(isa, g, r, x, 0.1, w, width),
                                (true, false) => packed_kernel::<true, false>(isa, g, r, x, 0.1, w, width),
                                (false, true) => packed_kernel::<false, true>(isa, g, r, x, 0.1, w, width),
                                (true, true) => packed_kernel::<true, true>(isa, g, r, x, 0.1, w, width),
                            }
                        }
                        let want = lanes::pack_slice(&bits, width, |b| b as u64 * if add { 2 } else { 1 });
                        assert_eq!((&words, &next), (&want, &want_r), "{isa:?} n={n} width={width} add={add} stream={stream}");
                    }
                }
                // the whole call, its parallel pieces included
                let (mut next, mut words) = (vec![f32::NAN; n], vec![0u64; lanes::words_for(n, width)]);
                quantize_packed::<false>(&g, &r0, &mut next, 0.1, &mut words, width);
                assert_eq!((&words, &next), (&lanes::pack_slice(&bits, width, |b| b as u64), &want_r), "n={n} width={width}");
            }
        }
    }

    #[test]
    fn steps_by_hand() {
        let mut r = [0f32, 0.0];
        let mut b = [0i32; 2];
        quantize::<false>(&[0.5, -0.5], &mut r, 0.0, &mut b);
        assert_eq!((b, r), ([1, 0], [-0.5, 0.5]));
        quantize::<false>(&[0.25, 0.25], &mut r, 0.0, &mut b);
        // r: -0.25 -> bit 0 (-1), r = 0.75; 0.75 -> bit 1 (+1), r = -0.25
        assert_eq!((b, r), ([0, 1], [0.75, -0.25]));
        // Adding: the bits are counted into what is there (a sum over members).
        let (mut r, mut count) = ([0f32, 0.0], [5i32, 5]);
        quantize::<true>(&[0.5, -0.5], &mut r, 0.0, &mut count);
        assert_eq!((count, r), ([6, 5], [-0.5, 0.5]));
        assert!(check_threshold(f32::NAN).is_err());
    }
}
