//! All-reduce-compatible compression (issue 6): the quantizers, the
//! reductions they need, and the schemes built from both.
//!
//! `qsgd`: max-norm QSGD codes (one or several scales) that workers sum as
//! integers. `onebit`: MXNet 2.0's 1-bit scheme. `twobit`: the codec's
//! 2-bit rule straight into summable lanes. `powersgd`: low-rank
//! factors. `lanes`: the packed wire form of codes and masks; `digits`: the
//! denser base-k form of a pulled sum. `noise`: the
//! counter-based generator behind rounding and random selection. `collective`:
//! the one implementation of each reduction (MAX, MIN, SUM of floats and
//! of codes) and the interface a scheme reduces over its job through.
//! `scheme`: every scheme as encode -> sum -> decode, shared by the device
//! store (every device a member, folded in one thread), the all-reduce
//! store (MPI) and the parameter-server store (the key's server). `compression`: the parsed and
//! validated `compress_params` every store takes, below `scheme` and above the quantizers it checks
//! parameters with: `quant` imports nothing above it, from the store down; only the
//! codec, error and byte helpers. See docs/research/issue6-schemes.md.

pub mod collective;
pub mod compression;
pub mod digits;
pub mod engine;
pub mod lanes;
pub mod noise;
pub mod onebit;
pub mod powersgd;
pub mod qsgd;
pub mod scheme;
pub mod twobit;
