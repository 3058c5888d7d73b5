//! Quantizers for all-reduce-compatible compression (issue 6, in progress).
//!
//! `onebit`: MXNet 2.0's 1-bit scheme with error feedback.
//! `qsgd`: max-norm QSGD codes that workers can sum as integers without
//! decoding. Both work on `device` stores through `compress_params`; the
//! distributed integration (scale exchange, server accumulators, the MPI
//! store) is the next step; see
//! docs/research/issue6-schemes.md.

pub mod onebit;
pub mod qsgd;
