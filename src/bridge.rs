//! The one `cxx` bridge: what C++ (the MXNet operator library in `cpp/`) may
//! call in the Rust core. Errors cross as `rust::Error` exceptions carrying the
//! core's message; the C++ side catches them at its own edge.

use half::{bf16, f16};

use crate::codec::{self, Thresholds};
use crate::error::Result;

#[cxx::bridge(namespace = "gradpack")]
mod ffi {
    // --- Shared types -------------------------------------------------------
    // (none yet: slices and scalars are enough for the codec)

    // --- Rust types and functions visible to C++ ----------------------------
    extern "Rust" {
        /// `3 + ceil(n / 16)`.
        fn compressed_len(n: usize) -> usize;
        fn quantize_2bit_f32(grad: &[f32], residual: &mut [f32], compr: &mut [f32], neg_threshold: f32, pos_threshold: f32) -> Result<()>;
        /// `grad` holds IEEE half-precision bit patterns.
        fn quantize_2bit_f16(grad: &[u16], residual: &mut [f32], compr: &mut [f32], neg_threshold: f32, pos_threshold: f32) -> Result<()>;
        /// `grad` holds bfloat16 bit patterns.
        fn quantize_2bit_bf16(grad: &[u16], residual: &mut [f32], compr: &mut [f32], neg_threshold: f32, pos_threshold: f32) -> Result<()>;
        fn dequantize_2bit(compr: &[f32], out: &mut [f32]) -> Result<()>;
        fn dequantize_2bit_add(compr: &[f32], sum: &mut [f32]) -> Result<()>;
        /// Validates thresholds given as attribute values; Err names the problem.
        fn check_thresholds(neg_threshold: f32, pos_threshold: f32) -> Result<()>;
    }

    // --- C++ types and functions visible to Rust ----------------------------
    // (none: the operator library calls Rust, never the reverse)
}

fn compressed_len(n: usize) -> usize {
    codec::compressed_len(n)
}

fn check_thresholds(neg: f32, pos: f32) -> Result<()> {
    Thresholds::new(neg, pos).map(|_| ())
}

fn quantize_2bit_f32(grad: &[f32], residual: &mut [f32], compr: &mut [f32], neg: f32, pos: f32) -> Result<()> {
    codec::quantize_2bit(grad, residual, compr, Thresholds::new(neg, pos)?)
}

fn quantize_2bit_f16(grad: &[u16], residual: &mut [f32], compr: &mut [f32], neg: f32, pos: f32) -> Result<()> {
    // SAFETY: f16 is a transparent wrapper of u16; every bit pattern is valid.
    let grad = unsafe { std::slice::from_raw_parts(grad.as_ptr().cast::<f16>(), grad.len()) };
    codec::quantize_2bit(grad, residual, compr, Thresholds::new(neg, pos)?)
}

fn quantize_2bit_bf16(grad: &[u16], residual: &mut [f32], compr: &mut [f32], neg: f32, pos: f32) -> Result<()> {
    // SAFETY: bf16 is a transparent wrapper of u16; every bit pattern is valid.
    let grad = unsafe { std::slice::from_raw_parts(grad.as_ptr().cast::<bf16>(), grad.len()) };
    codec::quantize_2bit(grad, residual, compr, Thresholds::new(neg, pos)?)
}

fn dequantize_2bit(compr: &[f32], out: &mut [f32]) -> Result<()> {
    codec::dequantize_2bit(compr, out)
}

fn dequantize_2bit_add(compr: &[f32], sum: &mut [f32]) -> Result<()> {
    codec::dequantize_2bit_add(compr, sum)
}
