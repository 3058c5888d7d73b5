//! Parameters given as strings, the way MXNet passes `compress_params` and
//! optimizer arguments (`'0.5'`): the parsing and the error that names the
//! key, shared by `quant::compression` and `optimizer`.

use crate::error::{Error, Result};

pub(crate) fn param_error(key: &str, problem: &str) -> Error {
    Error::InvalidParam { key: key.to_string(), problem: problem.to_string() }
}

/// Parses a float given as a string, the way MXNet accepts `'0.5'`.
pub(crate) fn parse_f32(key: &str, value: &str) -> Result<f32> {
    value.trim().parse::<f32>().map_err(|_| param_error(key, &format!("must be a number, got '{value}'")))
}

/// As `parse_f32`, keeping a Python float's full precision.
pub(crate) fn parse_f64(key: &str, value: &str) -> Result<f64> {
    value.trim().parse::<f64>().map_err(|_| param_error(key, &format!("must be a number, got '{value}'")))
}
