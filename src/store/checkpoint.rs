//! Compression state in checkpoints: every key's residuals and scheme state
//! (PowerSGD's Q and error, the push count that seeds random choices), per
//! device or server slice, in a versioned blob ("GPCS" v1); and the state
//! container ("GPST" v1) that `save_optimizer_states` writes: the optimizer's
//! states beside the compression states, so one checkpoint resumes both.
//!
//! Loading validates the whole blob against the store first (its
//! compression, each key's size and state shapes) and only then replaces
//! anything, so a refused blob leaves the store as it was.

use crate::bytes::{put_f32s, put_str, put_u32, put_u64, Reader};
use crate::error::{Error, Result};
use crate::store::checks::elements;
use crate::store::Key;
use crate::quant::scheme;

const STATES_MAGIC: &[u8; 4] = b"GPCS";
const CONTAINER_MAGIC: &[u8; 4] = b"GPST";
const OPTIMIZER_MAGIC: &[u8; 4] = b"GPOS";

/// One key's saved compression state.
#[derive(Clone, Debug)]
pub(crate) struct KeyState {
    pub key: Key,
    pub shape: Vec<usize>,
    pub pushes: u64,
    /// 2-bit residuals: one per device (local stores) or server slice (dist).
    pub residuals: Vec<Vec<f32>>,
    /// Scheme states, one per device (one on dist workers).
    pub states: Vec<scheme::State>,
}

/// A store's compression state: what it compressed with, who saved it, and
/// every key's state, keys sorted.
#[derive(Debug)]
pub(crate) struct Saved {
    pub compression: String,
    pub rank: u64,
    pub workers: u64,
    pub keys: Vec<KeyState>,
}

impl Saved {
    /// Each key's state, by key (every store's load replaces its keys from this).
    pub(crate) fn by_key(self) -> std::collections::HashMap<Key, KeyState> {
        self.keys.into_iter().map(|k| (k.key.clone(), k)).collect()
    }
}

fn fail(problem: &str) -> Error {
    Error::CompressionStates(format!("malformed blob: {problem}"))
}

fn put_key(out: &mut Vec<u8>, key: &Key) {
    match key {
        Key::Int(k) => {
            out.push(0);
            put_u64(out, *k as u64);
        }
        Key::Str(s) => {
            out.push(1);
            put_str(out, s);
        }
    }
}

pub(crate) fn encode(saved: &Saved) -> Vec<u8> {
    let mut out = STATES_MAGIC.to_vec();
    put_u32(&mut out, 1);
    put_str(&mut out, &saved.compression);
    put_u64(&mut out, saved.rank);
    put_u64(&mut out, saved.workers);
    put_u64(&mut out, saved.keys.len() as u64);
    for k in &saved.keys {
        put_key(&mut out, &k.key);
        put_u32(&mut out, k.shape.len() as u32);
        k.shape.iter().for_each(|&d| put_u64(&mut out, d as u64));
        put_u64(&mut out, k.pushes);
        put_u32(&mut out, k.residuals.len() as u32);
        k.residuals.iter().for_each(|r| put_f32s(&mut out, r));
        put_u32(&mut out, k.states.len() as u32);
        for s in &k.states {
            put_f32s(&mut out, &s.residual);
            put_f32s(&mut out, &s.q);
            put_u64(&mut out, s.step);
        }
    }
    out
}

pub(crate) fn decode(blob: &[u8]) -> Result<Saved> {
    let mut r = Reader::new(blob, fail);
    if r.take(4)? != STATES_MAGIC {
        return Err(fail("bad magic (not gradpack compression states)"));
    }
    match r.u32()? {
        1 => {}
        v => return Err(fail(&format!("unsupported version {v}"))),
    }
    let compression = r.str()?.to_string();
    let (rank, workers) = (r.u64()?, r.u64()?);
    let count = r.len(1)?;
    let mut keys = Vec::with_capacity(count.min(1 << 16));
    for _ in 0..count {
        let key = match r.u8()? {
            0 => Key::Int(r.u64()? as i64),
            1 => Key::Str(r.str()?.to_string()),
            t => return Err(fail(&format!("bad key tag {t}"))),
        };
        let dims = r.u32()? as usize;
        if dims > 32 {
            return Err(fail(&format!("key {key}: {dims} dimensions")));
        }
        let shape = (0..dims).map(|_| r.u64().map(|d| d as usize)).collect::<Result<Vec<_>>>()?;
        let pushes = r.u64()?;
        let residuals = (0..r.u32()?).map(|_| r.f32s()).collect::<Result<Vec<_>>>()?;
        let states = (0..r.u32()?)
            .map(|_| {
                let mut s = scheme::State::default();
                s.residual = r.f32s()?;
                s.q = r.f32s()?;
                s.step = r.u64()?;
                Ok(s)
            })
            .collect::<Result<Vec<_>>>()?;
        keys.push(KeyState { key, shape, pushes, residuals, states });
    }
    r.finish()?;
    // A key saved twice would load one of its states and drop the other.
    let mut seen = std::collections::HashSet::with_capacity(keys.len());
    if let Some(k) = keys.iter().find(|k| !seen.insert(&k.key)) {
        return Err(fail(&format!("key {} is saved twice", k.key)));
    }
    Ok(Saved { compression, rank, workers, keys })
}

/// Checks a decoded blob against the store it is loaded into: the same
/// compression, rank and worker count, and every key known with the same
/// shape and well-formed state. `shape_of` gives a key's shape here;
/// `slices_of` its server slices' lengths on a dist worker (None: residuals
/// cover the whole value, one per device).
pub(crate) fn check(
    saved: &Saved,
    compression: &crate::quant::compression::Compression,
    (rank, workers): (u64, u64),
    shape_of: impl Fn(&Key) -> Result<Vec<usize>>,
    slices_of: impl Fn(&Key) -> Option<Vec<usize>>,
) -> Result<()> {
    let mine = format!("{compression:?}");
    if saved.compression != mine {
        return Err(Error::CompressionStates(format!("saved with {}, this store uses {mine}", saved.compression)));
    }
    if (saved.rank, saved.workers) != (rank, workers) {
        return Err(Error::CompressionStates(format!(
            "saved by worker {} of {}, this is worker {rank} of {workers} (each worker loads its own)",
            saved.rank, saved.workers
        )));
    }
    for k in &saved.keys {
        let shape = shape_of(&k.key).map_err(|_| Error::CompressionStates(format!("key {}: in the compression states but not initialized in this store", k.key)))?;
        if shape != k.shape {
            return Err(Error::CompressionStates(format!("key {}: saved with shape {:?}, initialized here with {shape:?}", k.key, k.shape)));
        }
        if k.pushes == u64::MAX || k.states.iter().any(|s| s.step == u64::MAX) {
            return Err(Error::CompressionStates(format!("key {}: saved after 2^64 - 1 pushes, which no further push can count", k.key)));
        }
        let n = elements(&k.shape).map_err(|_| Error::CompressionStates(format!("key {}: saved with shape {:?}, more elements than any array can hold", k.key, k.shape)))?;
        // 2-bit residuals: one per device of the whole value, or (dist) one per server slice.
        let fits = match &slices_of(&k.key) {
            None => k.residuals.iter().all(|r| r.is_empty() || r.len() == n),
            // (a scheme key's are all empty, one per slice: nothing to fit)
            Some(lens) => k.residuals.iter().all(Vec::is_empty) || (k.residuals.len() == lens.len() && k.residuals.iter().zip(lens).all(|(r, &len)| r.is_empty() || r.len() == len)),
        };
        if !fits {
            let lens: Vec<usize> = k.residuals.iter().map(Vec::len).collect();
            return Err(Error::CompressionStates(format!("key {}: residuals of {lens:?} elements do not fit a value of {n} here (saved with another number of servers?)", k.key)));
        }
        for s in &k.states {
            scheme::check_state(compression, &shape, s).map_err(|why| Error::CompressionStates(format!("key {}: {why}", k.key)))?;
        }
        // A non-finite residual or Q would enter every later push (and, summed, every rank's result).
        let held = k.residuals.iter().map(|r| ("2-bit residual", r)).chain(k.states.iter().flat_map(|s| [("residual", &s.residual), ("PowerSGD Q", &s.q)]));
        for (what, values) in held {
            if let Some(at) = values.iter().position(|x| !x.is_finite()) {
                return Err(Error::CompressionStates(format!("key {}: its saved {what} holds {} at element {at}, a non-finite value", k.key, values[at])));
            }
        }
    }
    Ok(())
}

/// The state container: optimizer states (when the store runs gradpack's
/// optimizer) beside the compression states.
pub(crate) fn encode_container(optimizer: Option<&[u8]>, compression: &[u8]) -> Vec<u8> {
    let mut out = CONTAINER_MAGIC.to_vec();
    put_u32(&mut out, 1);
    out.push(optimizer.is_some() as u8);
    if let Some(o) = optimizer {
        put_u64(&mut out, o.len() as u64);
        out.extend(o);
    }
    put_u64(&mut out, compression.len() as u64);
    out.extend(compression);
    out
}

/// (optimizer states, compression states) from a container, or from a bare
/// optimizer-state blob as earlier versions wrote (no compression states).
pub(crate) fn decode_container(blob: &[u8]) -> Result<(Option<&[u8]>, Option<&[u8]>)> {
    if blob.starts_with(OPTIMIZER_MAGIC) {
        return Ok((Some(blob), None));
    }
    let mut r = Reader::new(blob, |p| Error::OptimizerStates(format!("state blob: {p}")));
    if r.take(4)? != CONTAINER_MAGIC {
        return Err(r.error("bad magic (not a gradpack state blob)"));
    }
    match r.u32()? {
        1 => {}
        v => return Err(r.error(&format!("unsupported version {v}"))),
    }
    let optimizer = match r.u8()? {
        0 => None,
        1 => {
            let n = r.len(1)?;
            Some(r.take(n)?)
        }
        t => return Err(r.error(&format!("bad optimizer flag {t}"))),
    };
    let n = r.len(1)?;
    let compression = r.take(n)?;
    r.finish()?;
    Ok((optimizer, Some(compression)))
}
