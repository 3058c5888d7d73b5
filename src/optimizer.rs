//! Optimizers run by the stores (and later by the parameter servers): SGD
//! (with momentum), NAG and Adam, element for element as MXNet 1.x's
//! `sgd_update`, `sgd_mom_update`, `nag_mom_update` and `adam_update` compute
//! them in float32, with per-key state that can be saved and loaded.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::params::parse_f64;
use crate::bytes::Reader;
use crate::error::{Error, Result};
use crate::key::Key;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Rule {
    Sgd { momentum: f32 },
    Nag { momentum: f32 },
    /// beta1/beta2 stay f64: MXNet's Python side computes bias correction in double.
    Adam { beta1: f64, beta2: f64, epsilon: f32 },
}

impl Rule {
    fn name(&self) -> &'static str {
        match self {
            Rule::Sgd { .. } => "sgd",
            Rule::Nag { .. } => "nag",
            Rule::Adam { .. } => "adam",
        }
    }

    /// Number of state arrays per key.
    fn state_arrays(&self) -> usize {
        match self {
            Rule::Sgd { momentum } | Rule::Nag { momentum } => usize::from(*momentum != 0.0),
            Rule::Adam { .. } => 2,
        }
    }
}

/// Hyper-parameters shared by every rule, with MXNet's names. learning_rate
/// and wd are f64 because MXNet multiplies them by lr_mult / wd_mult (and
/// Adam's bias correction) in Python doubles before the kernel sees float32.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hyper {
    pub learning_rate: f64,
    pub wd: f64,
    pub rescale_grad: f32,
    /// Negative: no clipping (MXNet's -1 default).
    pub clip_gradient: f32,
}

/// Per-key optimizer state: momentum / mean and variance, and the update count.
#[derive(Clone, Debug, Default, PartialEq)]
struct State {
    arrays: Vec<Vec<f32>>,
    step: u64,
}

/// An optimizer with its per-key states. Thread-safe: updates of different keys
/// run concurrently; the map lock is held only to find a key's state.
#[derive(Debug)]
pub struct Optimizer {
    rule: Rule,
    hyper: Mutex<Hyper>,
    states: Mutex<HashMap<Key, Arc<Mutex<State>>>>,
    /// Per-key (learning rate, weight decay) as MXNet's `_get_lr` / `_get_wd`
    /// return them (schedules and lr_mult / wd_mult applied); default: `hyper`'s.
    rates: Mutex<HashMap<Key, (f64, f64)>>,
    /// MXNet's `multi_precision`: float16 values keep a float32 master copy,
    /// updated in float32 (pulls see it rounded to float16). No effect on
    /// float32 values, as in MXNet.
    multi_precision: bool,
}

fn wrong_state(key: &Key, n: usize) -> Error {
    Error::OptimizerStates(format!("state of key {key} has the wrong size for a weight of {n}"))
}

/// A learning rate or weight decay: finite and not negative.
fn check_rate(name: &str, x: f64) -> Result<()> {
    if x.is_finite() && x >= 0.0 {
        Ok(())
    } else {
        Err(Error::InvalidParam { key: name.into(), problem: format!("must be a finite number, 0 or more, got {x}") })
    }
}

/// Every hyper-parameter in range: rates as `check_rate`, rescale_grad finite
/// and not negative, clip_gradient finite (negative turns clipping off).
fn check_hyper(h: &Hyper) -> Result<()> {
    check_rate("learning_rate", h.learning_rate)?;
    check_rate("wd", h.wd)?;
    check_rate("rescale_grad", h.rescale_grad as f64)?;
    if !h.clip_gradient.is_finite() {
        return Err(Error::InvalidParam { key: "clip_gradient".into(), problem: format!("must be finite (negative or None turns clipping off), got {}", h.clip_gradient) });
    }
    Ok(())
}

#[inline(always)]
fn clip(x: f32, bound: f32) -> f32 {
    if x > bound {
        bound
    } else if x < -bound {
        -bound
    } else {
        x
    }
}

impl Optimizer {
    pub fn new(rule: Rule, hyper: Hyper) -> Optimizer {
        Optimizer { rule, hyper: Mutex::new(hyper), states: Mutex::default(), rates: Mutex::default(), multi_precision: false }
    }

    /// Whether float16 values keep a float32 master copy (MXNet's `multi_precision`).
    pub fn multi_precision(&self) -> bool {
        self.multi_precision
    }

    /// Builds an optimizer from MXNet's name (`sgd`, `nag`, `adam`) and
    /// parameters given as strings (`learning_rate`, `momentum`, `wd`,
    /// `rescale_grad`, `clip_gradient`, `beta1`, `beta2`, `epsilon`,
    /// `multi_precision` as `true`/`false`/`1`/`0`).
    pub fn from_params<'a>(name: &str, params: impl IntoIterator<Item = (&'a str, &'a str)>) -> Result<Optimizer> {
        let mut hyper = Hyper { learning_rate: 0.01, wd: 0.0, rescale_grad: 1.0, clip_gradient: -1.0 };
        let (mut momentum, mut beta1, mut beta2, mut epsilon) = (0.0f32, 0.9f64, 0.999f64, 1e-8f32);
        let name = name.to_ascii_lowercase();
        let allowed: &[&str] = match name.as_str() {
            "sgd" | "nag" => &["momentum"],
            "adam" => &["beta1", "beta2", "epsilon"],
            other => {
                return Err(Error::InvalidParam { key: "optimizer".into(), problem: format!("unknown optimizer '{other}' (gradpack runs 'sgd', 'nag', 'adam')") });
            }
        };
        let mut multi_precision = false;
        for (k, v) in params {
            let bad = |problem: &str| Error::InvalidParam { key: k.to_string(), problem: problem.to_string() };
            if k == "multi_precision" {
                multi_precision = match v.trim().to_ascii_lowercase().as_str() {
                    "true" | "1" => true,
                    "false" | "0" => false,
                    _ => return Err(bad(&format!("must be true or false, got '{v}'"))),
                };
                continue;
            }
            let wide = if v.trim().eq_ignore_ascii_case("none") && k == "clip_gradient" { -1.0 } else { parse_f64(k, v)? };
            let x = wide as f32;
            if !wide.is_finite() || !x.is_finite() {
                return Err(bad("must be finite"));
            }
            match k {
                "learning_rate" | "lr" => hyper.learning_rate = wide,
                "wd" => hyper.wd = wide,
                "rescale_grad" => hyper.rescale_grad = x,
                "clip_gradient" => hyper.clip_gradient = x,
                "momentum" if allowed.contains(&k) => momentum = x,
                "beta1" if allowed.contains(&k) => beta1 = wide,
                "beta2" if allowed.contains(&k) => beta2 = wide,
                "epsilon" if allowed.contains(&k) => epsilon = x,
                _ => return Err(bad(&format!("unknown parameter for optimizer '{name}'"))),
            }
        }
        check_hyper(&hyper)?;
        let range = |key: &str, x: f64, ok: bool, want: &str| if ok { Ok(()) } else { Err(Error::InvalidParam { key: key.into(), problem: format!("must be {want}, got {x}") }) };
        range("momentum", momentum as f64, momentum >= 0.0, "0 or more")?;
        range("beta1", beta1, (0.0..1.0).contains(&beta1), "in [0, 1)")?;
        range("beta2", beta2, (0.0..1.0).contains(&beta2), "in [0, 1)")?;
        range("epsilon", epsilon as f64, epsilon >= 0.0, "0 or more")?;
        let rule = match name.as_str() {
            "sgd" => Rule::Sgd { momentum },
            "nag" => Rule::Nag { momentum },
            _ => Rule::Adam { beta1, beta2, epsilon },
        };
        Ok(Optimizer { multi_precision, ..Optimizer::new(rule, hyper) })
    }

    pub fn rule(&self) -> Rule {
        self.rule
    }

    /// What every worker of an all-reduce job must hold alike for `key`'s
    /// next update (the MPI store agrees on its fingerprint before each
    /// push): the rule, the hyper-parameters, the key's rates and
    /// multi_precision. (The rule alone let replicas with another learning
    /// rate, wd, scaling or per-key rate drift apart silently.)
    pub fn settings(&self, key: &Key) -> String {
        let rates = self.rates.lock().unwrap().get(key).copied();
        format!("{:?} {:?} {:?} {}", self.rule, *self.hyper.lock().unwrap(), rates, self.multi_precision)
    }

    /// The learning rate and weight decay of one key's next updates, as MXNet's
    /// optimizer computes them per parameter (in Python doubles). Both must be
    /// finite and not negative; the store checks that the key exists.
    pub fn set_rates(&self, key: &Key, learning_rate: f64, wd: f64) -> Result<()> {
        check_rate("learning_rate", learning_rate)?;
        check_rate("wd", wd)?;
        self.rates.lock().unwrap().insert(key.clone(), (learning_rate, wd));
        Ok(())
    }

    /// MXNet's `rescale_grad` and `clip_gradient` (negative: off), which Trainer
    /// and Module change as the batch size is known. NaN or infinity in either
    /// is refused and the current scaling kept.
    pub fn set_grad_scaling(&self, rescale_grad: f32, clip_gradient: f32) -> Result<()> {
        let mut h = self.hyper.lock().unwrap();
        let next = Hyper { rescale_grad, clip_gradient, ..*h };
        check_hyper(&next)?;
        *h = next;
        Ok(())
    }

    /// Fails, changing nothing, when `update` of `key` with `n` elements would
    /// fail: the push calls it before it changes any residual.
    pub fn check(&self, key: &Key, n: usize) -> Result<()> {
        let state = self.states.lock().unwrap().get(key).cloned();
        match state {
            Some(s) if s.lock().unwrap().arrays.iter().any(|a| a.len() != n) => Err(wrong_state(key, n)),
            _ => Ok(()),
        }
    }

    fn state_for(&self, key: &Key, n: usize) -> Arc<Mutex<State>> {
        let mut states = self.states.lock().unwrap();
        states
            .entry(key.clone())
            .or_insert_with(|| Arc::new(Mutex::new(State { arrays: vec![vec![0.0; n]; self.rule.state_arrays()], step: 0 })))
            .clone()
    }

    /// Applies one update of `weight` with `grad` for `key`.
    pub fn update(&self, key: &Key, grad: &[f32], weight: &mut [f32]) -> Result<()> {
        if grad.len() != weight.len() {
            return Err(Error::Key { key: key.to_string(), problem: format!("gradient has {} elements, weight {}", grad.len(), weight.len()) });
        }
        let state = self.state_for(key, weight.len());
        let mut state = state.lock().unwrap();
        if state.arrays.iter().any(|a| a.len() != weight.len()) {
            return Err(wrong_state(key, weight.len()));
        }
        state.step += 1;
        let hyper = *self.hyper.lock().unwrap();
        let (lr_wide, wd) = self.rates.lock().unwrap().get(key).copied().unwrap_or((hyper.learning_rate, hyper.wd));
        let lr = lr_wide as f32;
        let wd = wd as f32;
        let (rescale, bound) = (hyper.rescale_grad, hyper.clip_gradient);
        let clipping = bound >= 0.0;
        let step = state.step;
        match (self.rule, &mut state.arrays[..]) {
            (Rule::Sgd { .. } | Rule::Nag { .. }, []) => {
                // sgd_update
                let decay = 1.0 - lr * wd;
                for (w, &g) in weight.iter_mut().zip(grad) {
                    *w = if clipping { decay * *w - lr * clip(rescale * g, bound) } else { decay * *w - (lr * rescale) * g };
                }
            }
            (Rule::Sgd { momentum }, [mom]) => {
                // sgd_mom_update
                for ((w, &g), m) in weight.iter_mut().zip(grad).zip(mom.iter_mut()) {
                    *m = if clipping {
                        momentum * *m - lr * wd * *w - lr * clip(rescale * g, bound)
                    } else {
                        momentum * *m - lr * wd * *w - lr * rescale * g
                    };
                    *w += *m;
                }
            }
            (Rule::Nag { momentum }, [mom]) => {
                // nag_mom_update
                for ((w, &g), m) in weight.iter_mut().zip(grad).zip(mom.iter_mut()) {
                    let g = if clipping { clip(rescale * g, bound) } else { rescale * g };
                    *m *= momentum;
                    *w = *w - *m + (momentum + 1.0) * (*m - lr * (g + wd * *w));
                    // MXNet updates with out=weight, so its kernel reads the new weight here.
                    *m -= lr * (g + wd * *w);
                }
            }
            (Rule::Adam { beta1, beta2, epsilon }, [mean, var]) => {
                // The Python side of MXNet's Adam folds bias correction into lr, in double.
                let t = step as i32;
                let coef1 = 1.0 - beta1.powi(t);
                let coef2 = 1.0 - beta2.powi(t);
                let lr = (lr_wide * (coef2.sqrt() / coef1)) as f32;
                let (beta1, beta2) = (beta1 as f32, beta2 as f32);
                for (((w, &g), m), v) in weight.iter_mut().zip(grad).zip(mean.iter_mut()).zip(var.iter_mut()) {
                    let mut g = g * rescale + *w * wd;
                    if clipping {
                        g = clip(g, bound);
                    }
                    *m = beta1 * *m + (1.0 - beta1) * g;
                    *v = beta2 * *v + (1.0 - beta2) * g * g;
                    *w -= lr * *m / (v.sqrt() + epsilon);
                }
            }
            _ => unreachable!("state arrays always match the rule"),
        }
        Ok(())
    }

    /// Serialises every key's state (format "GPOS" v1, little-endian).
    pub fn save_states(&self) -> Vec<u8> {
        let states = self.states.lock().unwrap();
        let mut keys: Vec<&Key> = states.keys().collect();
        keys.sort();
        let mut out = b"GPOS".to_vec();
        out.extend(1u32.to_le_bytes());
        out.push(self.rule.name().len() as u8);
        out.extend(self.rule.name().as_bytes());
        out.extend((keys.len() as u32).to_le_bytes());
        for key in keys {
            match key {
                Key::Int(k) => {
                    out.push(0);
                    out.extend(k.to_le_bytes());
                }
                Key::Str(s) => {
                    out.push(1);
                    out.extend((s.len() as u32).to_le_bytes());
                    out.extend(s.as_bytes());
                }
            }
            let state = states[key].lock().unwrap();
            out.extend(state.step.to_le_bytes());
            out.extend((state.arrays.len() as u32).to_le_bytes());
            for a in &state.arrays {
                out.extend((a.len() as u64).to_le_bytes());
                for x in a {
                    out.extend(x.to_bits().to_le_bytes());
                }
            }
        }
        out
    }

    /// Replaces every key's state with what `save_states` wrote. On error the
    /// current states are kept.
    pub fn load_states(&self, bytes: &[u8]) -> Result<()> {
        let parsed = parse_states(bytes, self.rule)?;
        *self.states.lock().unwrap() = parsed.into_iter().map(|(k, s)| (k, Arc::new(Mutex::new(s)))).collect();
        Ok(())
    }
}

fn parse_states(bytes: &[u8], rule: Rule) -> Result<HashMap<Key, State>> {
    let mut r = Reader::new(bytes, |p| Error::OptimizerStates(format!("optimizer-state blob: {p}")));
    if r.take(4)? != b"GPOS" {
        return Err(Error::OptimizerStates("not a gradpack optimizer-state blob (bad magic)".into()));
    }
    let version = r.u32()?;
    if version != 1 {
        return Err(Error::OptimizerStates(format!("unsupported version {version}")));
    }
    let name_len = r.u8()? as usize;
    let name = String::from_utf8_lossy(r.take(name_len)?).into_owned();
    if name != rule.name() {
        return Err(Error::OptimizerStates(format!("states were saved by optimizer '{name}', this store runs '{}'", rule.name())));
    }
    let count = r.u32()?;
    let mut states = HashMap::new();
    for _ in 0..count {
        let key = match r.u8()? {
            0 => Key::Int(r.u64()? as i64),
            1 => Key::Str(r.str()?.to_string()),
            t => return Err(Error::OptimizerStates(format!("bad key tag {t}"))),
        };
        let step = r.u64()?;
        let arrays = r.u32()? as usize;
        if arrays != rule.state_arrays() {
            return Err(Error::OptimizerStates(format!("key {key} has {arrays} state arrays, '{}' keeps {}", rule.name(), rule.state_arrays())));
        }
        let mut state = State { arrays: Vec::with_capacity(arrays), step };
        for _ in 0..arrays {
            state.arrays.push(r.f32s()?);
        }
        states.insert(key, state);
    }
    r.finish()?;
    Ok(states)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opt(name: &str, p: &[(&str, &str)]) -> Optimizer {
        Optimizer::from_params(name, p.iter().copied()).unwrap()
    }

    #[test]
    fn sgd_plain_and_momentum() {
        let o = opt("sgd", &[("learning_rate", "0.5"), ("wd", "0.1")]);
        let mut w = [1.0f32, -2.0];
        o.update(&Key::Int(0), &[1.0, 1.0], &mut w).unwrap();
        assert_eq!(w, [(1.0 - 0.5 * 0.1) * 1.0 - 0.5, (1.0 - 0.5f32 * 0.1) * -2.0 - 0.5]);
        let o = opt("sgd", &[("learning_rate", "1"), ("momentum", "0.5")]);
        let mut w = [0.0f32];
        o.update(&Key::Int(0), &[1.0], &mut w).unwrap(); // m = -1, w = -1
        o.update(&Key::Int(0), &[1.0], &mut w).unwrap(); // m = -1.5, w = -2.5
        assert_eq!(w, [-2.5]);
    }

    #[test]
    fn clipping_and_rescale() {
        let o = opt("sgd", &[("learning_rate", "1"), ("rescale_grad", "0.5"), ("clip_gradient", "0.25")]);
        let mut w = [0.0f32, 0.0, 0.0];
        o.update(&Key::Int(0), &[2.0, -2.0, 0.2], &mut w).unwrap();
        assert_eq!(w, [-0.25, 0.25, -0.1]);
    }

    #[test]
    fn adam_first_step_moves_by_lr() {
        let o = opt("adam", &[("learning_rate", "0.1")]);
        let mut w = [1.0f32, 1.0];
        o.update(&Key::Int(3), &[0.5, -2.0], &mut w).unwrap();
        // Bias-corrected first step: m/sqrt(v) = sign(g).
        assert!((w[0] - 0.9).abs() < 1e-6 && (w[1] - 1.1).abs() < 1e-6, "{w:?}");
    }

    #[test]
    fn states_round_trip_and_reject_garbage() {
        let o = opt("nag", &[("learning_rate", "0.1"), ("momentum", "0.9")]);
        let mut w = [1.0f32; 5];
        o.update(&Key::Str("w".into()), &[0.3; 5], &mut w).unwrap();
        o.update(&Key::Int(7), &[0.3; 5], &mut w).unwrap();
        let blob = o.save_states();
        let o2 = opt("nag", &[("learning_rate", "0.1"), ("momentum", "0.9")]);
        o2.load_states(&blob).unwrap();
        assert_eq!(o2.save_states(), blob);
        let mut a = w;
        let mut b = w;
        o.update(&Key::Int(7), &[0.1; 5], &mut a).unwrap();
        o2.update(&Key::Int(7), &[0.1; 5], &mut b).unwrap();
        assert_eq!(a, b);
        let blob = o2.save_states();
        let sgd = opt("sgd", &[("momentum", "0.9")]);
        assert!(sgd.load_states(&blob).unwrap_err().to_string().contains("saved by optimizer 'nag'"));
        assert!(o2.load_states(&blob[..blob.len() - 1]).unwrap_err().to_string().contains("truncated"));
        assert!(o2.load_states(b"nope").unwrap_err().to_string().contains("magic"));
        assert_eq!(o2.save_states(), blob, "a failed load keeps the states");
    }

    #[test]
    fn bad_params_name_the_key() {
        for (name, p, want) in [
            ("rmsprop", vec![], "unknown optimizer 'rmsprop'"),
            ("sgd", vec![("beta1", "0.9")], "'beta1': unknown parameter"),
            ("adam", vec![("learning_rate", "fast")], "'learning_rate': must be a number"),
            ("sgd", vec![("wd", "nan")], "'wd': must be finite"),
        ] {
            let err = Optimizer::from_params(name, p.into_iter()).unwrap_err().to_string();
            assert!(err.contains(want), "{err}");
        }
    }
}
