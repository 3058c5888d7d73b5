//! `compress_params` (docs/contract.md §2): one dictionary configures compression
//! everywhere. Values arrive as strings (as MXNet passes them) or numbers; this
//! module validates them once and names the offending key.

use crate::codec::Thresholds;
use crate::error::Result;
use crate::params::{param_error, parse_f32};

/// A validated compression configuration.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum Compression {
    #[default]
    None,
    TwoBit(Thresholds),
    /// Max-norm QSGD and its multi-scale and random-K forms (`quant::scheme`).
    Qsgd(Qsgd),
    /// PowerSGD: rank-`rank` approximations with error feedback (`quant::powersgd`).
    PowerSgd { rank: u32, seed: u64 },
    /// MXNet 2.0's 1-bit scheme (`quant::onebit`).
    OneBit { threshold: f32 },
}

/// Random-K's coordinates per push: at least one.
fn check_k(k: Option<u64>) -> Result<()> {
    match k {
        Some(0) => Err(param_error("k", "must be a whole number >= 1, got 0")),
        _ => Ok(()),
    }
}

impl Compression {
    /// Refuses the fields `from_params` refuses, for a compression built or
    /// changed directly (the enum's and `Qsgd`'s public fields): PowerSGD's
    /// rank 0 panicked in its round, random-K's k = 0 and a non-finite
    /// 1-bit threshold were taken. Every scheme push checks it
    /// (`scheme::check_input`).
    pub fn check(&self) -> Result<()> {
        match self {
            Compression::PowerSgd { rank, .. } if !(1..=1024).contains(rank) => Err(param_error("rank", &format!("must be a whole number from 1 to 1024, got {rank}"))),
            Compression::OneBit { threshold } => super::onebit::check_threshold(*threshold).map(|_| ()),
            Compression::Qsgd(q) => check_k(q.k),
            _ => Ok(()),
        }
    }
}

/// The most scales a multi-scale QSGD takes.
pub const MAX_SCALES: usize = 8;

/// `qsgd_mn` (one scale), `qsgd_mn_ts` (two), `qsgd_mn_ms` (two or more), and
/// `grandk_mn` / `grandk_mn_ts` (the same on `k` coordinates).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Qsgd {
    /// The name it was configured by, for messages.
    pub name: &'static str,
    /// Bits per magnitude of each scale, ascending; `count` of them used.
    bits: [u8; MAX_SCALES],
    count: u8,
    pub seed: u64,
    /// Random-K: coordinates quantized per push (all of them when `None`).
    pub k: Option<u64>,
    /// Random-K: unselected coordinates keep each worker's own gradient (the
    /// paper's code) instead of zero.
    pub keep_local: bool,
}

impl Qsgd {
    pub fn new(name: &'static str, bits: &[u32], seed: u64, k: Option<u64>, keep_local: bool) -> Result<Qsgd> {
        if bits.is_empty() || bits.len() > MAX_SCALES {
            return Err(param_error("bits", &format!("give 1 to {MAX_SCALES} values, got {}", bits.len())));
        }
        for &b in bits {
            super::qsgd::levels(b)?;
        }
        if bits.windows(2).any(|w| w[0] >= w[1]) {
            return Err(param_error("bits", &format!("scales must be ascending and distinct, got {bits:?}")));
        }
        check_k(k)?;
        let mut arr = [0u8; MAX_SCALES];
        bits.iter().enumerate().for_each(|(i, &b)| arr[i] = b as u8);
        Ok(Qsgd { name, bits: arr, count: bits.len() as u8, seed, k, keep_local })
    }

    /// Bits per magnitude of each scale, ascending.
    pub fn bits(&self) -> Vec<u32> {
        self.bits[..self.count as usize].iter().map(|&b| b as u32).collect()
    }

    /// Levels `2^bits - 1` of each scale, ascending.
    pub fn levels(&self) -> Vec<u32> {
        self.bits().iter().map(|&b| (1u32 << b) - 1).collect()
    }

    /// Coordinates sent for an array of `n` elements.
    pub fn selected(&self, n: usize) -> usize {
        self.k.map_or(n, |k| (k as usize).min(n))
    }
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
            "qsgd_mn" | "qsgd_mn_ts" | "qsgd_mn_ms" => &["bits", "seed"],
            "grandk_mn" | "grandk_mn_ts" => &["bits", "seed", "k", "unselected"],
            "powersgd" => &["rank", "seed"],
            "1bit" => &["threshold"],
            other => {
                return Err(param_error(
                    kind.0,
                    &format!("unknown compression type '{other}' (known: 'none', '2bit', 'qsgd_mn', 'qsgd_mn_ts', 'qsgd_mn_ms', 'grandk_mn', 'grandk_mn_ts', 'powersgd', '1bit')"),
                ));
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
                    Some(t) => super::onebit::check_threshold(parse_f32("threshold", t)?)?,
                    None => 0.0, // MXNet 2.0's default
                };
                return Ok(Compression::OneBit { threshold });
            }
            "qsgd_mn" | "qsgd_mn_ts" | "qsgd_mn_ms" | "grandk_mn" | "grandk_mn_ts" => {
                let name: &'static str = ["qsgd_mn", "qsgd_mn_ts", "qsgd_mn_ms", "grandk_mn", "grandk_mn_ts"].into_iter().find(|n| *n == name).unwrap();
                let bits_text = get("bits").ok_or_else(|| param_error("bits", &format!("missing for '{name}'")))?;
                let bits = parse_bits(bits_text)?;
                let want = match name {
                    "qsgd_mn" | "grandk_mn" => "one value",
                    "qsgd_mn_ts" | "grandk_mn_ts" => "two values [lo, hi]",
                    _ => "two or more values",
                };
                let fits = match name {
                    "qsgd_mn" | "grandk_mn" => bits.len() == 1,
                    "qsgd_mn_ts" | "grandk_mn_ts" => bits.len() == 2,
                    _ => bits.len() >= 2,
                };
                if !fits {
                    return Err(param_error("bits", &format!("'{name}' takes {want}, got '{bits_text}'")));
                }
                let seed = parse_seed(get("seed"))?;
                let (k, keep_local) = if name.starts_with("grandk") {
                    let k_text = get("k").ok_or_else(|| param_error("k", &format!("missing for '{name}' (coordinates per push)")))?;
                    let k = k_text.trim().parse::<u64>().ok().filter(|&k| k >= 1).ok_or_else(|| param_error("k", &format!("must be a whole number >= 1, got '{k_text}'")))?;
                    let keep_local = match get("unselected").map(|v| v.trim().to_ascii_lowercase()) {
                        None => false,
                        Some(v) if v == "zero" => false,
                        Some(v) if v == "local" => true,
                        Some(v) => return Err(param_error("unselected", &format!("must be 'zero' (default) or 'local', got '{v}'"))),
                    };
                    (Some(k), keep_local)
                } else {
                    (None, false)
                };
                return Ok(Compression::Qsgd(Qsgd::new(name, &bits, seed, k, keep_local)?));
            }
            "powersgd" => {
                let rank = match get("rank") {
                    None => 1,
                    Some(t) => t.trim().parse::<u32>().ok().filter(|&r| (1..=1024).contains(&r)).ok_or_else(|| param_error("rank", &format!("must be a whole number from 1 to 1024, got '{t}'")))?,
                };
                return Ok(Compression::PowerSgd { rank, seed: parse_seed(get("seed"))? });
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

    /// The name `compress_params` gave it.
    pub fn name(&self) -> &'static str {
        match self {
            Compression::None => "none",
            Compression::TwoBit(_) => "2bit",
            Compression::Qsgd(q) => q.name,
            Compression::PowerSgd { .. } => "powersgd",
            Compression::OneBit { .. } => "1bit",
        }
    }

    /// Whether its rounds on the device store and the parameter server are
    /// a scheme's exchanges (`quant::scheme`): everything but none and 2bit.
    /// 2-bit keeps MXNet's own paths there (dequantized device sums in order,
    /// code counts on a server); only the all-reduce store reduces its codes
    /// through `quant::scheme`, with the bits of the server's counts.
    pub fn is_scheme(&self) -> bool {
        matches!(self, Compression::Qsgd(_) | Compression::PowerSgd { .. } | Compression::OneBit { .. })
    }
}

/// `bits` as one number or a list: `4`, `[6, 10]`, `(6, 10)` or `6,10`.
fn parse_bits(text: &str) -> Result<Vec<u32>> {
    let inner = text.trim().trim_start_matches(['[', '(']).trim_end_matches([']', ')']);
    inner
        .split(',')
        .map(|t| t.trim().parse::<u32>().map_err(|_| param_error("bits", &format!("must be a whole number or a list of them, got '{text}'"))))
        .collect()
}

fn parse_seed(text: Option<&str>) -> Result<u64> {
    match text {
        Some(t) => t.trim().parse::<u64>().map_err(|_| param_error("seed", &format!("must be a whole number >= 0, got '{t}'"))),
        None => Ok(0),
    }
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
        assert_eq!(parse(&[("compress", "qsgd_mn"), ("bits", "4")]).unwrap(), Compression::Qsgd(Qsgd::new("qsgd_mn", &[4], 0, None, false).unwrap()));
        assert_eq!(parse(&[("compress", "qsgd_mn"), ("bits", "8"), ("seed", "7")]).unwrap(), Compression::Qsgd(Qsgd::new("qsgd_mn", &[8], 7, None, false).unwrap()));
        assert_eq!(parse(&[("compress", "qsgd_mn_ts"), ("bits", "[6, 10]")]).unwrap(), Compression::Qsgd(Qsgd::new("qsgd_mn_ts", &[6, 10], 0, None, false).unwrap()));
        assert_eq!(parse(&[("compress", "qsgd_mn_ms"), ("bits", "(2,4,8)")]).unwrap(), Compression::Qsgd(Qsgd::new("qsgd_mn_ms", &[2, 4, 8], 0, None, false).unwrap()));
        assert_eq!(
            parse(&[("compress", "grandk_mn"), ("bits", "4"), ("k", "100"), ("unselected", "local")]).unwrap(),
            Compression::Qsgd(Qsgd::new("grandk_mn", &[4], 0, Some(100), true).unwrap())
        );
        assert_eq!(parse(&[("compress", "powersgd")]).unwrap(), Compression::PowerSgd { rank: 1, seed: 0 });
        assert_eq!(parse(&[("compress", "powersgd"), ("rank", "2"), ("seed", "3")]).unwrap(), Compression::PowerSgd { rank: 2, seed: 3 });
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
            (&[("compress", "qsgd_mn"), ("bits", "[2, 4]")], "'bits': 'qsgd_mn' takes one value"),
            (&[("compress", "qsgd_mn_ts"), ("bits", "4")], "'bits': 'qsgd_mn_ts' takes two values"),
            (&[("compress", "qsgd_mn_ts"), ("bits", "[8, 4]")], "ascending"),
            (&[("compress", "qsgd_mn_ms"), ("bits", "[2, 2, 4]")], "ascending and distinct"),
            (&[("compress", "qsgd_mn_ms"), ("bits", "[2, x]")], "'bits': must be a whole number or a list"),
            (&[("compress", "qsgd_mn_ms"), ("bits", "[2, 16]")], "'bits': must be between 1 and 15"),
            (&[("compress", "grandk_mn"), ("bits", "4")], "'k': missing"),
            (&[("compress", "grandk_mn"), ("bits", "4"), ("k", "0")], "'k': must be a whole number >= 1"),
            (&[("compress", "grandk_mn"), ("bits", "4"), ("k", "5"), ("unselected", "keep")], "'unselected'"),
            (&[("compress", "qsgd_mn"), ("bits", "4"), ("k", "5")], "'k': unknown key for compression 'qsgd_mn'"),
            (&[("compress", "powersgd"), ("rank", "0")], "'rank': must be a whole number from 1"),
            (&[("compress", "powersgd"), ("bits", "2")], "'bits': unknown key"),
        ];
        for (params, want) in cases {
            let err = parse(params).unwrap_err().to_string();
            assert!(err.contains(want), "{params:?}: wanted {want:?} in {err:?}");
        }
    }
}
