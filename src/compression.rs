//! `compress_params` (SPEC §2): one dictionary configures compression
//! everywhere. Values arrive as strings (as MXNet passes them) or numbers; this
//! module validates them once and names the offending key.

use crate::codec::Thresholds;
use crate::error::{Error, Result};

/// A validated compression configuration.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum Compression {
    #[default]
    None,
    TwoBit(Thresholds),
    /// Max-norm QSGD (`quant::qsgd`): `bits` per magnitude, rounding noise from `seed`.
    Qsgd { bits: u32, seed: u64 },
    /// MXNet 2.0's 1-bit scheme (`quant::onebit`).
    OneBit { threshold: f32 },
}

impl Compression {
    /// Parses `compress_params` given as (key, value) string pairs.
    ///
    /// Accepted: `{'compress': 'none'}`, `{'compress': '2bit', 'pos_threshold': p,
    /// 'neg_threshold': n}`, and MXNet 1.x's `{'type': '2bit', 'threshold': t}`.
    pub fn from_params<'a>(params: impl IntoIterator<Item = (&'a str, &'a str)>) -> Result<Compression> {
        let params: Vec<(&str, &str)> = params.into_iter().collect();
        let get = |k: &str| params.iter().find(|(key, _)| *key == k).map(|(_, v)| *v);
        for (i, (k, _)) in params.iter().enumerate() {
            if params[..i].iter().any(|(prev, _)| prev == k) {
                return Err(param_error(k, "given twice"));
            }
        }
        let kind = match (get("compress"), get("type")) {
            (Some(_), Some(_)) => return Err(param_error("type", "give either 'compress' or MXNet's alias 'type', not both")),
            (Some(k), None) => ("compress", k),
            (None, Some(k)) => ("type", k),
            (None, None) => return Err(param_error("compress", "missing (e.g. {'compress': '2bit', 'pos_threshold': 0.5, 'neg_threshold': -0.5})")),
        };
        let name = kind.1.trim().to_ascii_lowercase();
        let allowed: &[&str] = match name.as_str() {
            "none" => &[],
            "2bit" => &["pos_threshold", "neg_threshold", "threshold"],
            "qsgd_mn" => &["bits", "seed"],
            "1bit" => &["threshold"],
            other => {
                return Err(param_error(kind.0, &format!("unknown compression type '{other}' (known: 'none', '2bit', 'qsgd_mn', '1bit')")));
            }
        };
        for (k, _) in &params {
            if *k != kind.0 && !allowed.contains(k) {
                return Err(param_error(k, &format!("unknown key for compression '{}'", kind.1)));
            }
        }
        match name.as_str() {
            "none" => return Ok(Compression::None),
            "1bit" => {
                let threshold = match get("threshold") {
                    Some(t) => crate::quant::onebit::check_threshold(parse_f32("threshold", t)?)?,
                    None => 0.0, // MXNet 2.0's default
                };
                return Ok(Compression::OneBit { threshold });
            }
            "qsgd_mn" => {
                let bits_text = get("bits").ok_or_else(|| param_error("bits", "missing for 'qsgd_mn'"))?;
                let bits = bits_text.trim().parse::<u32>().map_err(|_| param_error("bits", &format!("must be a whole number, got '{bits_text}'")))?;
                crate::quant::qsgd::levels(bits)?;
                let seed = match get("seed") {
                    Some(t) => t.trim().parse::<u64>().map_err(|_| param_error("seed", &format!("must be a whole number >= 0, got '{t}'")))?,
                    None => 0,
                };
                return Ok(Compression::Qsgd { bits, seed });
            }
            _ => {} // 2bit, below
        }
        let th = match (get("threshold"), get("pos_threshold"), get("neg_threshold")) {
            (Some(t), None, None) => {
                let t = parse_f32("threshold", t)?;
                if !(t > 0.0) || !t.is_finite() {
                    return Err(param_error("threshold", &format!("must be finite and > 0, got {t}")));
                }
                Thresholds::symmetric(t)?
            }
            (Some(_), _, _) => return Err(param_error("threshold", "give either 'threshold' or 'pos_threshold'/'neg_threshold', not both")),
            (None, Some(p), Some(n)) => {
                let (pos, neg) = (parse_f32("pos_threshold", p)?, parse_f32("neg_threshold", n)?);
                if !(pos > 0.0) || !pos.is_finite() {
                    return Err(param_error("pos_threshold", &format!("must be finite and > 0, got {pos}")));
                }
                if !(neg < 0.0) || !neg.is_finite() {
                    return Err(param_error("neg_threshold", &format!("must be finite and < 0, got {neg}")));
                }
                Thresholds::new(neg, pos)?
            }
            (None, None, _) => return Err(param_error("pos_threshold", "missing for '2bit'")),
            (None, Some(_), None) => return Err(param_error("neg_threshold", "missing for '2bit'")),
        };
        Ok(Compression::TwoBit(th))
    }

    pub fn is_none(&self) -> bool {
        matches!(self, Compression::None)
    }

    /// Bytes on the wire for `n` float32 elements.
    pub fn wire_bytes(&self, n: usize) -> usize {
        match self {
            Compression::None => 4 * n,
            Compression::TwoBit(_) => 4 * crate::codec::compressed_len(n),
            // the scale, then bits + 1 bits a code
            Compression::Qsgd { bits, .. } => 4 + (n * (*bits as usize + 1)).div_ceil(8),
            Compression::OneBit { .. } => 4 + n.div_ceil(8),
        }
    }
}

fn param_error(key: &str, problem: &str) -> Error {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(p: &[(&str, &str)]) -> Result<Compression> {
        Compression::from_params(p.iter().copied())
    }

    #[test]
    fn accepts_spec_forms_and_aliases() {
        let th = Thresholds::new(-0.5, 0.5).unwrap();
        assert_eq!(parse(&[("compress", "none")]).unwrap(), Compression::None);
        assert_eq!(parse(&[("compress", "2bit"), ("pos_threshold", "0.5"), ("neg_threshold", "-0.5")]).unwrap(), Compression::TwoBit(th));
        assert_eq!(parse(&[("type", "2bit"), ("threshold", "0.5")]).unwrap(), Compression::TwoBit(th));
        assert_eq!(parse(&[("compress", "2bit"), ("pos_threshold", " 1 "), ("neg_threshold", "-0.25")]).unwrap(), Compression::TwoBit(Thresholds::new(-0.25, 1.0).unwrap()));
        assert_eq!(parse(&[("compress", "qsgd_mn"), ("bits", "4")]).unwrap(), Compression::Qsgd { bits: 4, seed: 0 });
        assert_eq!(parse(&[("compress", "qsgd_mn"), ("bits", "8"), ("seed", "7")]).unwrap(), Compression::Qsgd { bits: 8, seed: 7 });
        assert_eq!(parse(&[("compress", "1bit")]).unwrap(), Compression::OneBit { threshold: 0.0 });
        assert_eq!(parse(&[("compress", "1bit"), ("threshold", "0.5")]).unwrap(), Compression::OneBit { threshold: 0.5 });
    }

    #[test]
    fn errors_name_the_key() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[], "'compress'"),
            (&[("compress", "3bit")], "unknown compression type '3bit'"),
            (&[("compress", "2bit"), ("pos_threshold", "0.5")], "'neg_threshold': missing"),
            (&[("compress", "2bit"), ("neg_threshold", "-0.5")], "'pos_threshold': missing"),
            (&[("compress", "2bit"), ("pos_threshold", "x"), ("neg_threshold", "-0.5")], "'pos_threshold': must be a number, got 'x'"),
            (&[("compress", "2bit"), ("pos_threshold", "-1"), ("neg_threshold", "-0.5")], "'pos_threshold': must be finite and > 0"),
            (&[("compress", "2bit"), ("pos_threshold", "1"), ("neg_threshold", "0.5")], "'neg_threshold': must be finite and < 0"),
            (&[("compress", "2bit"), ("pos_threshold", "inf"), ("neg_threshold", "-0.5")], "'pos_threshold'"),
            (&[("type", "2bit"), ("threshold", "0")], "'threshold': must be finite and > 0"),
            (&[("compress", "2bit"), ("threshold", "0.5"), ("pos_threshold", "0.5")], "'threshold'"),
            (&[("compress", "none"), ("pos_threshold", "0.5")], "'pos_threshold': unknown key"),
            (&[("compress", "2bit"), ("threshold", "0.5"), ("bits", "2")], "'bits': unknown key"),
            (&[("compress", "2bit"), ("type", "2bit"), ("threshold", "1")], "'type'"),
            (&[("compress", "qsgd_mn")], "'bits': missing"),
            (&[("compress", "1bit"), ("threshold", "inf")], "'threshold': must be finite"),
            (&[("compress", "1bit"), ("bits", "1")], "'bits': unknown key for compression '1bit'"),
            (&[("compress", "qsgd_mn"), ("bits", "0")], "'bits': must be between 1 and 15"),
            (&[("compress", "qsgd_mn"), ("bits", "2.5")], "'bits': must be a whole number"),
            (&[("compress", "qsgd_mn"), ("bits", "4"), ("seed", "-1")], "'seed'"),
            (&[("compress", "qsgd_mn"), ("bits", "4"), ("threshold", "1")], "'threshold': unknown key"),
        ];
        for (params, want) in cases {
            let err = parse(params).unwrap_err().to_string();
            assert!(err.contains(want), "{params:?}: wanted {want:?} in {err:?}");
        }
    }
}
