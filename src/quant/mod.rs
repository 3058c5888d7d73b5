//! Quantizers for all-reduce-compatible compression (issue 6, in progress).
//!
//! `qsgd`: max-norm QSGD codes that workers can sum as integers without
//! decoding. Not yet reachable from `compress_params`: the stores' integration
//! (scale exchange, server accumulators, the MPI store) is the next step; see
//! docs/research/issue6-schemes.md.

pub mod qsgd;
