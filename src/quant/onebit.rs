//! MXNet 2.0's 1-bit compression with error feedback: `r += g`; if
//! `r > threshold` the bit is 1, the element decodes to +1 and `r -= 1`; else
//! the bit is 0, it decodes to -1 and `r += 1`. One bit per element on the wire.

use crate::error::{Error, Result};

/// Quantizes one worker's gradient into bits (0 or 1, decoding to -1 or +1),
/// updating its residual. Lengths are the caller's to check.
/// With `ADD`, each bit is added to `bits` (a count over members) instead
/// of written.
pub fn quantize<const ADD: bool>(grad: &[f32], residual: &mut [f32], threshold: f32, bits: &mut [i32]) {
    crate::par::chunks2(residual, bits, |start, r, b| quantize_piece::<ADD>(&grad[start..start + r.len()], r, threshold, b));
}

fn quantize_piece<const ADD: bool>(grad: &[f32], residual: &mut [f32], threshold: f32, bits: &mut [i32]) {
    for ((g, r), b) in grad.iter().zip(residual.iter_mut()).zip(bits.iter_mut()) {
        let x = *r + *g;
        let bit = x > threshold;
        *r = if bit { x - 1.0 } else { x + 1.0 };
        if ADD {
            *b += bit as i32;
        } else {
            *b = bit as i32;
        }
    }
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
