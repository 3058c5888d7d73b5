//! GPU kernels (feature `cuda`): the 2-bit codec, QSGD-MN, 1-bit and
//! random-K's gather and scatter, each the CPU reference written one element
//! per thread (`kernels.cu`), compiled at run time by NVRTC and launched
//! through cudarc with the driver loaded dynamically: building needs no CUDA
//! toolkit, and running needs a driver only when a GPU is used.
//!
//! `device` is the implementation; `standin` has the same API for builds
//! without the feature, where every call returns "CUDA not available" (as
//! does the implementation on a machine without a driver or NVRTC).
//! Results are bit-identical to the CPU's (tests.rs runs every kernel
//! against the CPU code on boundary sizes, on a machine with a GPU; on
//! every machine it compiles the source for sm_70 and sm_90 with NVRTC).

/// A CUDA stream handle from outside (`CUstream`; null is the legacy default stream).
pub type RawStream = *mut std::ffi::c_void;

/// A device buffer as raw parts: `len` elements of `elem` bytes at `ptr`
/// (`what` names it in errors).
#[derive(Clone, Copy, Debug)]
pub struct Buf {
    pub what: &'static str,
    pub ptr: u64,
    pub len: usize,
    pub elem: usize,
}

#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
pub use device::*;

#[cfg(not(feature = "cuda"))]
mod standin;
#[cfg(not(feature = "cuda"))]
pub use standin::*;

#[cfg(test)]
mod tests;
