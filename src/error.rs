//! The crate's one error type. Variants are grouped by area; each carries what a
//! caller needs to fix the call. Bindings convert it once, at their edge.

use std::fmt;

/// Element types a gradient may have. The residual is always f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F32,
    F16,
    Bf16,
}

impl Dtype {
    /// Bytes of one element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dtype::F32 => "float32",
            Dtype::F16 => "float16",
            Dtype::Bf16 => "bfloat16",
        })
    }
}

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum Error {
    // --- codec: parameters -------------------------------------------------
    #[error("invalid thresholds neg_threshold={neg} pos_threshold={pos}: {reason}")]
    InvalidThreshold { neg: f32, pos: f32, reason: &'static str },

    // --- codec: buffer shapes ----------------------------------------------
    #[error("{what} has {got} elements, expected {expected}")]
    SizeMismatch { what: &'static str, expected: usize, got: usize },

    #[error("compressed header says size {header} but the output has {expected} elements")]
    HeaderSizeMismatch { header: f32, expected: usize },

    // --- codec: values -------------------------------------------------------
    #[error("{what}: residual + gradient is {value} at element {index} (NaN, infinity or float32 overflow); nothing was changed")]
    NonFinite { what: String, index: usize, value: f32 },

    // --- codec: corrupt data -----------------------------------------------
    #[error("corrupt compressed block {block}: element {element} has code 0b11, which quantize never produces")]
    CorruptCode { block: usize, element: usize },

    #[error("corrupt compressed block {block}: padding past size {n} must be code 0b00")]
    CorruptPadding { block: usize, n: usize },

    // --- parameters (compress_params, optimizers) ---------------------------
    #[error("invalid parameter '{key}': {problem}")]
    InvalidParam { key: String, problem: String },

    // --- kvstore -------------------------------------------------------------
    #[error("key {key}: {problem}")]
    Key { key: String, problem: String },

    #[error("{0}")]
    Store(String),

    #[error("updater failed for key {key}: {message}")]
    Updater { key: String, message: String },

    #[error("optimizer states: {0}")]
    OptimizerStates(String),
    /// A compression-state blob that is malformed or does not fit the store.
    #[error("compression states: {0}")]
    CompressionStates(String),

    // --- distributed ---------------------------------------------------------
    #[error("transport: {0}")]
    Transport(String),

    #[error("distributed job failed: {0}")]
    JobFailed(String),

    // --- bindings ------------------------------------------------------------
    #[error("{what} must not be a null pointer")]
    NullPointer { what: &'static str },

    #[error("{a} and {b} overlap in memory; they must be distinct buffers")]
    OverlappingBuffers { a: &'static str, b: &'static str },

    #[error("unknown dtype code {0} (0 = float32, 1 = float16, 2 = bfloat16)")]
    UnknownDtype(i32),

    // --- GPU -------------------------------------------------------------------
    #[error("CUDA not available: {0}")]
    CudaUnavailable(String),

    #[error("CUDA: {0}")]
    Cuda(String),

    #[error("internal error (a bug in gradpack): {0}")]
    Internal(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Runs `f`; a panic becomes `Error::Internal` with its message. The fronts
/// (C ABI, cxx bridge) and the device store's member threads run through it,
/// so no panic unwinds into C or C++ or leaves another thread waiting.
pub fn catch_panic<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let what = panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned());
        Err(Error::Internal(what.unwrap_or_else(|| "panic".into())))
    })
}
