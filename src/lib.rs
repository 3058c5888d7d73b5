//! gradpack: gradient compression for distributed training: MXNet's 2-bit
//! format with error feedback, the all-reduce-compatible schemes of
//! "Quantization for Distributed Optimization" (QSGD max-norm, random-K),
//! PowerSGD and 1-bit, and the stores that carry them (local and device,
//! MXNet's parameter server, MPI all-reduce).
//!
//! The codec: 2-bit quantization into MXNet's packed format (a header
//! `[neg_threshold, pos_threshold, size]`, then 16 two-bit codes per float),
//! with what is not sent kept in a residual for the next step:
//!
//! ```
//! use gradpack::{create_2bit, dequantize_2bit, quantize_2bit, Thresholds};
//!
//! let grad = [0.0f32, 2.5, 1.0, -3.0, 2.0, 0.5, -1.0, -2.0];
//! let mut residual = [0.0f32; 8];
//! let mut compr = create_2bit(grad.len()); // 3 + ceil(8 / 16) floats
//! quantize_2bit(&grad[..], &mut residual, &mut compr, Thresholds::new(-2.0, 2.0)?)?;
//! assert_eq!(compr[3].to_bits(), 0x1242_0000);
//! assert_eq!(residual, [0.0, 0.5, 1.0, -1.0, 0.0, 0.5, -1.0, 0.0]);
//!
//! let mut out = [0.0f32; 8];
//! dequantize_2bit(&compr, &mut out)?;
//! assert_eq!(out, [0.0, 2.0, 0.0, -2.0, 2.0, 0.0, 0.0, -2.0]);
//! # Ok::<(), gradpack::Error>(())
//! ```
//!
//! A store with MXNet's KVStore semantics: each device's gradient is
//! quantized with its own residual, then the devices are summed.
//!
//! ```
//! use gradpack::codec::Grad;
//! use gradpack::quant::compression::Compression;
//! use gradpack::key::Key;
//! use gradpack::store::{Array, ArrayMut, KVStore};
//!
//! let kv = KVStore::new("device")?;
//! kv.set_compress(Compression::from_params([
//!     ("compress", "2bit"), ("pos_threshold", "0.5"), ("neg_threshold", "-0.5"),
//! ])?)?;
//! let (key, shape) = (Key::Int(3), [4]);
//! kv.init(&key, Array { shape: &shape, data: Grad::F32(&[1.0; 4]) })?;
//! kv.push(&key, &[
//!     Array { shape: &shape, data: Grad::F32(&[0.6; 4]) },  // sends +0.5, keeps 0.1
//!     Array { shape: &shape, data: Grad::F32(&[-0.2; 4]) }, // sends 0, keeps -0.2
//! ])?;
//! let mut weight = [0.0f32; 4];
//! kv.pull(&key, &mut [ArrayMut { shape: &shape, data: &mut weight }])?;
//! assert_eq!(weight, [0.5; 4]); // no optimizer: the store holds the sum
//! # Ok::<(), gradpack::Error>(())
//! ```
//!
//! # Features
//!
//! None is on by default; the crate then builds with a C++ compiler alone.
//! - `cuda`: the CUDA kernels ([`cuda`]) through cudarc, which loads the
//!   driver and NVRTC at run time: the build needs no CUDA toolkit, and
//!   without a driver the same API returns "CUDA not available".
//! - `mpi`: the all-reduce store `dist_sync_allreduce` ([`store::mpi`]) over
//!   Open MPI, loaded at run time (the one the `mpirun` on `PATH` belongs
//!   to, or `$GRADPACK_MPI_LIBRARY`): the build needs no MPI. Jobs run under
//!   `mpirun`. Without the feature, joining says how to get it.
//! - `mxnet`: the MXNet 1.9.1 extension-operator library (MXNet's own
//!   `lib_api.cc`, taken from the installed mxnet wheel at build time) in the
//!   cdylib, for `mx.library.load`.
//!
//! # Layers
//!
//! The Rust core does all the work; [`capi`] (the C ABI of
//! `include/gradpack/c_api.h`, which Python loads with ctypes) and `bridge`
//! (cxx, the C++ front of `include/gradpack/kvstore.h`) are thin edges that
//! convert errors once.

mod boundary;
mod bridge;
pub mod bytes;
pub mod capi;
pub mod codec;
pub mod cuda;
pub mod error;
pub mod hash;
pub mod isa;
pub mod key;
pub mod optimizer;
pub mod par;
mod params;
pub mod quant;
pub mod store;

pub use codec::{compressed_len, create_2bit, dequantize_2bit, dequantize_2bit_add, quantize_2bit, quantize_2bit_to, Thresholds};
pub use error::{Dtype, Error, Result};
