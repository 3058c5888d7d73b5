//! gradpack: gradient compression for distributed training.
//!
//! The Rust core does all the work; `capi` (C ABI) and `bridge` (cxx, for the
//! MXNet operator library) are thin edges that convert errors once.

mod bridge;
pub mod allreduce;
pub mod bytes;
pub mod capi;
pub mod codec;
pub mod cuda;
/// `compress_params` parsing and validation (SPEC §2); it lives in `quant`.
pub mod compression {
    pub use crate::quant::compression::*;
}
pub mod dist;
pub mod error;
pub mod group;
pub mod hash;
pub mod isa;
pub mod key;
pub mod kvstore;
pub mod optimizer;
pub mod par;
pub mod quant;
pub mod stores;

pub use codec::{compressed_len, create_2bit, dequantize_2bit, dequantize_2bit_add, quantize_2bit, quantize_2bit_to, Thresholds};
pub use error::{Dtype, Error, Result};
