//! All-reduce-compatible compression (issue 6): the quantizers, the
//! reductions they need, and the schemes built from both.
//!
//! `qsgd`: max-norm QSGD codes (one or several scales) that workers sum as
//! integers. `onebit`: MXNet 2.0's 1-bit scheme. `powersgd`: low-rank
//! factors. `lanes`: the packed wire form of codes and masks. `collective`:
//! the reductions (MAX, MIN, SUM) a scheme asks of its job, and the
//! in-process group of a `device` store. `scheme`: every scheme as
//! encode -> sum -> decode over a `Collective`, shared by the device,
//! all-reduce and parameter-server stores. `compression`: the parsed and
//! validated `compress_params` every store takes (re-exported as
//! `crate::compression`), below `scheme` and above the quantizers it checks
//! parameters with: `quant` imports nothing above it, from the store down; only the
//! codec, error and byte helpers. See docs/research/issue6-schemes.md.

pub mod collective;
pub mod compression;
pub mod lanes;
pub mod onebit;
pub mod powersgd;
pub mod qsgd;
pub mod scheme;
