//! The `local` and `device` KVStores (docs/contract.md §3): init / push /
//! pull with MXNet's semantics, compression on `device`, and an updater (a
//! Rust optimizer or a caller's function). Below them, the replica API
//! (`KVStore::replica`, `Replica`, `Round`): how the MPI store keeps one
//! worker's keys in a `KVStore` and runs each push through its job, without
//! touching an entry.
//!
//! Thread safety: a `KVStore` is `Send + Sync`. Each key has its own lock, held
//! for the whole of a push (reduce, then update) or pull of that key, so pushes
//! of different keys run at the same time and a slow key never blocks the
//! others; within one push, large arrays are reduced and quantized in parallel
//! chunks. The key map is locked only to look a key up or insert it. An updater
//! callback runs with its key's lock held and must not push or pull that key.
//! Changing compression or the updater waits for no push: pushes already
//! running finish with the setting they started with.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use super::checks::{check_compress_before_init, check_outputs, check_push, check_shape, key_error, lock};
use super::sum::{round_to_f16, settle, sum_into};
use super::{checkpoint, Array, ArrayMut, Grad, Key, Kind, Store, Updater};
use crate::codec;
use crate::error::{Dtype, Error, Result};
use crate::optimizer::Optimizer;
use crate::par;
use crate::quant::collective::{self, Collective};
use crate::quant::compression::Compression;
use crate::quant::scheme;

/// Invariant: `value.len() == shape.iter().product()`; every non-empty residual
/// has that length too; each compressed buffer is `compressed_len(value.len())`.
struct Entry {
    shape: Vec<usize>,
    /// float32, or float16 values held in float32 (`settle`).
    value: Vec<f32>,
    half: bool,
    /// One per device index, allocated on the device's first compressed push.
    residuals: Vec<Vec<f32>>,
    /// The 2-bit push's second residual buffer per device: the next residual
    /// is written here and swapped in once the whole push was valid.
    spares: Vec<Vec<f32>>,
    merge_buf: Vec<f32>,
    /// What each device sent on the last compressed push (one per device).
    compr_bufs: Vec<Vec<f32>>,
    /// Scheme state per device (`quant::scheme`), allocated on first use.
    states: Vec<scheme::State>,
    /// The all-reduce store's second merge buffer (decoded sums land here).
    scheme_out: Vec<f32>,
    /// Compressed pushes so far (seeds the schemes' random choices).
    pushes: u64,
}

/// What a push changes, the value included, kept while a caller's updater runs.
struct Undo {
    value: Vec<f32>,
    residuals: Vec<Vec<f32>>,
    states: Vec<scheme::State>,
    pushes: u64,
}

impl Undo {
    fn save(e: &Entry) -> Undo {
        Undo { value: e.value.clone(), residuals: e.residuals.clone(), states: e.states.clone(), pushes: e.pushes }
    }

    fn restore(self, e: &mut Entry) {
        (e.value, e.residuals, e.states, e.pushes) = (self.value, self.residuals, self.states, self.pushes);
    }
}

#[derive(Default)]
struct Keys {
    map: HashMap<Key, Arc<Mutex<Entry>>>,
    /// Fixed by the first key: ints or strings, never both.
    str_keys: Option<bool>,
}

/// Bytes that pushes moved between devices: as float32, and as sent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub raw_bytes: u64,
    pub wire_bytes: u64,
}

pub struct KVStore {
    /// `Kind::Local` or `Kind::Device`; `Kind::AllReduce` for a replica.
    kind: Kind,
    keys: RwLock<Keys>,
    compression: RwLock<Compression>,
    updater: RwLock<Option<Arc<Updater>>>,
    raw_bytes: AtomicU64,
    wire_bytes: AtomicU64,
    /// This process's rank and the number of workers: (0, 1), or the MPI
    /// job's for a replica (`KVStore::replica`).
    member: (usize, usize),
}

impl Store for KVStore {
    fn type_name(&self) -> &'static str {
        self.kind.name()
    }
    fn rank(&self) -> usize {
        KVStore::rank(self)
    }
    fn num_workers(&self) -> usize {
        KVStore::num_workers(self)
    }
    fn barrier(&self) -> Result<()> {
        Ok(()) // one process
    }
    fn stats(&self) -> (u64, u64) {
        let s = KVStore::stats(self);
        (s.raw_bytes, s.wire_bytes)
    }
    fn close(&self) -> Result<()> {
        Ok(()) // nothing to leave
    }
    fn set_compress(&self, compression: Compression, _params: &[(String, String)]) -> Result<()> {
        KVStore::set_compress(self, compression)
    }
    fn set_optimizer(&self, name: &str, params: &[(String, String)]) -> Result<()> {
        KVStore::set_optimizer(self, Optimizer::from_params(name, params.iter().map(|(k, v)| (k.as_str(), v.as_str())))?);
        Ok(())
    }
    fn init(&self, key: &Key, value: Array) -> Result<()> {
        KVStore::init(self, key, value)
    }
    fn push(&self, key: &Key, values: &[Array]) -> Result<()> {
        KVStore::push(self, key, values)
    }
    fn pull(&self, key: &Key, outs: &mut [ArrayMut]) -> Result<()> {
        KVStore::pull(self, key, outs)
    }
    fn shape(&self, key: &Key) -> Result<Vec<usize>> {
        KVStore::shape(self, key)
    }
    fn save_compression_states(&self) -> Result<Vec<u8>> {
        KVStore::save_compression_states(self)
    }
    fn load_compression_states(&self, blob: &[u8]) -> Result<()> {
        KVStore::load_compression_states(self, blob)
    }
    fn set_rates(&self, key: &Key, learning_rate: f64, wd: f64) -> Result<()> {
        KVStore::set_rates(self, key, learning_rate, wd)
    }
    fn set_grad_scaling(&self, rescale_grad: f32, clip_gradient: f32) -> Result<()> {
        KVStore::set_grad_scaling(self, rescale_grad, clip_gradient)
    }
    fn set_updater(&self, updater: Updater) -> Result<()> {
        KVStore::set_updater(self, updater);
        Ok(())
    }
    fn save_optimizer_states(&self) -> Result<Vec<u8>> {
        KVStore::save_optimizer_states(self)
    }
    fn load_optimizer_states(&self, blob: &[u8]) -> Result<()> {
        KVStore::load_optimizer_states(self, blob)
    }
    fn residual(&self, key: &Key, device: usize) -> Result<Vec<f32>> {
        KVStore::residual(self, key, device)
    }
}

/// Applies the updater to the merged gradient, or makes it the value.
fn apply_update(key: &Key, e: &mut Entry, updater: Option<&Updater>) -> Result<()> {
    let optimizer = match updater {
        Some(Updater::Optimizer(o)) => Some(o),
        _ => None,
    };
    match updater {
        // The merged sum becomes the value; the old value's buffer is reused next push.
        None => std::mem::swap(&mut e.value, &mut e.merge_buf),
        Some(Updater::Optimizer(o)) => o.update(key, &e.merge_buf, &mut e.value)?,
        // In place: a push under a caller's function runs `undoable`, which
        // puts the value back when the function fails (half-way, or after
        // it succeeded on this worker and failed on another).
        Some(Updater::Custom(f)) => crate::error::catch_panic(|| f(key, &e.merge_buf, &mut e.value)).map_err(|err| match err {
            Error::Updater { .. } => err,
            other => Error::Updater { key: key.to_string(), message: other.to_string() },
        })?,
    }
    settle(&mut e.value, e.half, optimizer);
    Ok(())
}

/// `dst = src`, in parallel chunks for large arrays.
fn copy_into(dst: &mut [f32], src: &[f32]) {
    par::chunks(dst, |start, d| d.copy_from_slice(&src[start..start + d.len()]));
}

impl KVStore {
    /// A `local` or `device` store (`dist_sync_allreduce` is an MPI job's:
    /// `MpiStore::join`, or `store::open` for any name).
    pub fn new(type_name: &str) -> Result<KVStore> {
        match super::store_type(type_name) {
            Some((_, kind @ (Kind::Local | Kind::Device))) => Ok(KVStore::with_member(kind, 0, 1)),
            Some((_, Kind::AllReduce)) => Err(Error::Store(format!("'{type_name}' joins an MPI job: open it with gradpack::store::open or MpiStore::join"))),
            _ => Err(Error::Store(format!("unknown KVStore type '{type_name}' (this store supports 'local', 'device' and '{}')", Kind::AllReduce.name()))),
        }
    }

    fn with_member(kind: Kind, rank: usize, workers: usize) -> KVStore {
        KVStore {
            kind,
            keys: RwLock::default(),
            compression: RwLock::default(),
            updater: RwLock::default(),
            raw_bytes: AtomicU64::new(0),
            wire_bytes: AtomicU64::new(0),
            member: (rank, workers),
        }
    }

    pub fn rank(&self) -> usize {
        self.member.0
    }

    pub fn num_workers(&self) -> usize {
        self.member.1
    }

    pub fn stats(&self) -> Stats {
        Stats { raw_bytes: self.raw_bytes.load(Ordering::Relaxed), wire_bytes: self.wire_bytes.load(Ordering::Relaxed) }
    }

    pub fn compression(&self) -> Compression {
        *self.compression.read().unwrap()
    }

    /// Sets compression (docs/contract.md §2). A `local` store refuses anything but `None`;
    /// every store refuses it once a key exists (`check_compress_before_init`).
    pub fn set_compress(&self, compression: Compression) -> Result<()> {
        if self.kind == Kind::Local && !compression.is_none() {
            return Err(Error::Store(
                "gradient compression is not supported on a 'local' KVStore (it reduces on the CPU without a transfer to save); \
                 create a 'device' store, e.g. kv.create('device'), to compress gradients"
                    .into(),
            ));
        }
        let mut current = self.compression.write().unwrap();
        check_compress_before_init(self.keys.read().unwrap().map.len())?;
        *current = compression;
        Ok(())
    }

    /// One key's learning rate and weight decay for the store's optimizer;
    /// the key must exist.
    pub fn set_rates(&self, key: &Key, learning_rate: f64, wd: f64) -> Result<()> {
        self.entry(key)?;
        self.with_optimizer(|o| o.set_rates(key, learning_rate, wd))
    }

    /// The optimizer's rescale_grad and clip_gradient (negative: off).
    pub fn set_grad_scaling(&self, rescale_grad: f32, clip_gradient: f32) -> Result<()> {
        self.with_optimizer(|o| o.set_grad_scaling(rescale_grad, clip_gradient))
    }

    pub fn set_updater(&self, updater: Updater) {
        *self.updater.write().unwrap() = Some(Arc::new(updater));
    }

    pub fn set_optimizer(&self, optimizer: Optimizer) {
        self.set_updater(Updater::Optimizer(optimizer));
    }

    /// Runs `f` on the store's gradpack optimizer; an error if it has none.
    pub fn with_optimizer<T>(&self, f: impl FnOnce(&Optimizer) -> Result<T>) -> Result<T> {
        match self.updater.read().unwrap().as_deref() {
            Some(Updater::Optimizer(o)) => f(o),
            _ => Err(Error::Store("this store has no gradpack optimizer (set one with set_optimizer)".into())),
        }
    }

    /// The store's state for a checkpoint (`checkpoint`'s container): its
    /// gradpack optimizer's states, if it runs one, and the compression
    /// states. An error when there is neither.
    pub fn save_optimizer_states(&self) -> Result<Vec<u8>> {
        let optimizer = match self.updater.read().unwrap().as_deref() {
            Some(Updater::Optimizer(o)) => Some(o.save_states()),
            _ => None,
        };
        if optimizer.is_none() && self.compression().is_none() {
            return Err(Error::Store("this store has no gradpack optimizer (set one with set_optimizer) and no compression: there are no states to save".into()));
        }
        Ok(checkpoint::encode_container(optimizer.as_deref(), &self.save_compression_states()?))
    }

    /// Loads what `save_optimizer_states` wrote (or a bare optimizer blob of
    /// earlier versions). Everything is checked before anything changes.
    pub fn load_optimizer_states(&self, blob: &[u8]) -> Result<()> {
        let (optimizer, compression) = checkpoint::decode_container(blob)?;
        let saved = compression.map(checkpoint::decode).transpose()?;
        if let Some(saved) = &saved {
            self.check_compression_states(saved)?;
        }
        let runs_optimizer = matches!(self.updater.read().unwrap().as_deref(), Some(Updater::Optimizer(_)));
        match optimizer {
            Some(o) => self.with_optimizer(|opt| opt.load_states(o))?,
            None if runs_optimizer => return Err(Error::OptimizerStates("the blob holds no optimizer states, but this store runs gradpack's optimizer".into())),
            None => {}
        }
        match saved {
            Some(saved) => self.apply_compression_states(saved),
            None => Ok(()),
        }
    }

    fn rank_and_workers(&self) -> (u64, u64) {
        (self.rank() as u64, self.num_workers() as u64)
    }

    /// Every key's residuals and scheme state ("GPCS" v1), for a checkpoint;
    /// no keys when the store does not compress.
    pub fn save_compression_states(&self) -> Result<Vec<u8>> {
        let compression = self.compression();
        let keys = self.keys.read().unwrap();
        let mut sorted: Vec<(&Key, &Arc<Mutex<Entry>>)> = if compression.is_none() { Vec::new() } else { keys.map.iter().collect() };
        sorted.sort_by(|a, b| a.0.cmp(b.0));
        let mut saved = Vec::with_capacity(sorted.len());
        for (key, entry) in sorted {
            let e = lock(key, entry)?;
            saved.push(checkpoint::KeyState { key: key.clone(), shape: e.shape.clone(), pushes: e.pushes, residuals: e.residuals.clone(), states: e.states.clone() });
        }
        let (rank, workers) = self.rank_and_workers();
        Ok(checkpoint::encode(&checkpoint::Saved { compression: format!("{compression:?}"), rank, workers, keys: saved }))
    }

    /// Replaces every key's compression state with what
    /// `save_compression_states` wrote; keys it does not list start afresh.
    /// Refused, changing nothing, when the blob's compression, worker or any
    /// key's shape differs from this store's.
    pub fn load_compression_states(&self, blob: &[u8]) -> Result<()> {
        let saved = checkpoint::decode(blob)?;
        self.check_compression_states(&saved)?;
        self.apply_compression_states(saved)
    }

    fn check_compression_states(&self, saved: &checkpoint::Saved) -> Result<()> {
        let (rank, workers) = self.rank_and_workers();
        checkpoint::check(saved, &self.compression(), (rank, workers), |k| self.shape(k), |_| None)
    }

    fn apply_compression_states(&self, saved: checkpoint::Saved) -> Result<()> {
        let keys = self.keys.read().unwrap();
        let mut by_key = saved.by_key();
        // Every lock first: a poisoned one fails before anything changed.
        let mut guards = keys.map.iter().map(|(k, e)| lock(k, e).map(|g| (k, g))).collect::<Result<Vec<_>>>()?;
        for (key, e) in guards.iter_mut() {
            match by_key.remove(*key) {
                Some(s) => (e.residuals, e.states, e.pushes) = (s.residuals, s.states, s.pushes),
                None => (e.residuals, e.states, e.pushes) = (Vec::new(), Vec::new(), 0),
            }
        }
        Ok(())
    }

    fn entry(&self, key: &Key) -> Result<Arc<Mutex<Entry>>> {
        let keys = self.keys.read().unwrap();
        if let Some(e) = keys.map.get(key) {
            return Ok(e.clone());
        }
        Err(match keys.str_keys {
            Some(s) if s != key.is_str() => key_error(key, format!("this store uses {} keys", if s { "string" } else { "int" })),
            _ => key_error(key, "not initialized (call init first)"),
        })
    }

    /// Stores `value` under a new key; init is never lossy.
    pub fn init(&self, key: &Key, value: Array) -> Result<()> {
        let data = self.check_init(key, value)?;
        self.insert(key, value, data)
    }

    /// Adds a checked key with `data` as its value (float32, of `value`'s shape).
    pub(in crate::store) fn insert(&self, key: &Key, value: Array, mut data: Vec<f32>) -> Result<()> {
        let mut keys = self.keys.write().unwrap();
        // Checked again under the write lock: another thread may have inserted meanwhile.
        if keys.map.contains_key(key) {
            return Err(key_error(key, "already initialized"));
        }
        if keys.str_keys.is_some_and(|s| s != key.is_str()) {
            return Err(key_error(key, "int and string keys cannot be mixed"));
        }
        let entry = Entry { shape: value.shape.to_vec(), value: std::mem::take(&mut data), half: value.data.dtype() == Dtype::F16, residuals: Vec::new(), spares: Vec::new(), merge_buf: Vec::new(), compr_bufs: Vec::new(), states: Vec::new(), scheme_out: Vec::new(), pushes: 0 };
        keys.map.insert(key.clone(), Arc::new(Mutex::new(entry)));
        keys.str_keys = Some(key.is_str());
        Ok(())
    }

    /// The checks of an init; the value as float32. A float16 value makes a
    /// float16 key (not on the all-reduce store).
    pub(in crate::store) fn check_init(&self, key: &Key, value: Array) -> Result<Vec<f32>> {
        key.check()?;
        let data = match value.data {
            Grad::F32(d) => d.to_vec(),
            Grad::F16(d) if self.kind != Kind::AllReduce => d.iter().map(|x| x.to_f32()).collect(),
            other => {
                let want = if self.kind != Kind::AllReduce { "float32 or float16" } else { "float32 (the all-reduce store holds float32 values)" };
                return Err(key_error(key, format!("init value has dtype {}, expected {want}", other.dtype())));
            }
        };
        check_shape(key, "init value", value.shape, data.len(), value.shape)?;
        let keys = self.keys.read().unwrap();
        if let Some(s) = keys.str_keys {
            if s != key.is_str() {
                return Err(key_error(key, format!("this store uses {} keys; int and string keys cannot be mixed", if s { "string" } else { "int" })));
            }
        }
        if keys.map.contains_key(key) {
            return Err(key_error(key, "already initialized"));
        }
        Ok(data)
    }

    /// Sums `values` (one per device) and applies the updater, or stores the sum.
    pub fn push(&self, key: &Key, values: &[Array]) -> Result<()> {
        // The same locked, checked, undoable round the MPI store drives (`Replica::push`).
        self.replica_of(key)?.push(values, |Round { key, e, compression, updater, .. }, checked| {
            checked?; // every check before anything is written
            self.push_local(key, e, values, compression, updater)
        })
    }

    /// Every check of a push against the key's entry and the store's updater.
    fn check_push(&self, key: &Key, e: &Entry, values: &[Array], compression: Compression, updater: Option<&Updater>) -> Result<()> {
        check_push(key, values, &e.shape, compression, e.half).and_then(|()| match updater {
            Some(Updater::Optimizer(o)) => o.check(key, e.value.len()),
            _ => Ok(()),
        })
    }

    /// Runs a push: a caller's updater may fail after the residuals moved
    /// on (or, in an MPI job, on another worker after this one's update), so
    /// what it could undo is kept, the value included, and put back if the
    /// push fails.
    fn undoable(&self, e: &mut Entry, updater: Option<&Updater>, push: impl FnOnce(&mut Entry) -> Result<()>) -> Result<()> {
        let undo = matches!(updater, Some(Updater::Custom(_))).then(|| Undo::save(e));
        let pushed = push(e);
        if let (Err(_), Some(undo)) = (&pushed, undo) {
            undo.restore(e);
        }
        pushed
    }

    /// A push of this process's devices, checked: sum or compress, then update.
    fn push_local(&self, key: &Key, e: &mut Entry, values: &[Array], compression: Compression, updater: Option<&Updater>) -> Result<()> {
        let n = e.value.len();
        e.merge_buf.resize(n, 0.0);
        // Bytes the devices hand over for the merge: their arrays, their
        // compressed buffers, or what each gave the scheme's group.
        let sent: u64;
        match compression {
            Compression::None => {
                sent = values.len() as u64 * 4 * n as u64;
                let grads: Vec<Grad> = values.iter().map(|v| v.data).collect();
                // float16 keys sum as MXNet's stores do: 'device' rounds each
                // partial sum to float16, 'local' accumulates in float32 and
                // rounds the total once.
                sum_into(&mut e.merge_buf, &grads, e.half && self.kind == Kind::Device);
                if e.half && self.kind == Kind::Local {
                    round_to_f16(&mut e.merge_buf);
                }
            }
            Compression::TwoBit(th) => {
                let devices = values.len();
                let known = e.residuals.len();
                if e.residuals.len() < devices {
                    e.residuals.resize_with(devices, Vec::new);
                }
                for bufs in [&mut e.spares, &mut e.compr_bufs] {
                    if bufs.len() < devices {
                        bufs.resize_with(devices, Vec::new);
                    }
                }
                for ((residual, spare), compr) in e.residuals.iter_mut().zip(e.spares.iter_mut()).zip(e.compr_bufs.iter_mut()).take(devices) {
                    residual.resize(n, 0.0); // a device's first push starts from a zero residual
                    spare.resize(n, 0.0);
                    compr.resize(codec::compressed_len(n), 0.0);
                }
                let grads: Vec<Grad> = values.iter().map(|v| v.data).collect();
                let residuals: Vec<&[f32]> = e.residuals.iter().take(devices).map(|r| &r[..]).collect();
                let mut nexts: Vec<&mut [f32]> = e.spares.iter_mut().take(devices).map(|r| &mut r[..]).collect();
                let mut comprs: Vec<&mut [f32]> = e.compr_bufs.iter_mut().take(devices).map(|c| &mut c[..]).collect();
                // Out of place: the next residuals land in the spares, which
                // become the residuals only once every device's sum was finite.
                if let Err(err) = codec::quantize_2bit_reduce(&grads, &residuals, &mut nexts, &mut comprs, &mut e.merge_buf, th) {
                    e.residuals.truncate(known); // a device's first push that failed leaves no residual behind
                    return Err(key_error(key, err.to_string()));
                }
                for (residual, spare) in e.residuals.iter_mut().zip(e.spares.iter_mut()).take(devices) {
                    std::mem::swap(residual, spare);
                }
                sent = e.compr_bufs.iter().take(devices).map(|c| 4 * c.len() as u64).sum();
            }
            c if c.is_scheme() => {
                // Every device is a member of the scheme's one path (as an
                // all-reduce worker is): each encodes, the codes are summed
                // once and decoded once, here in this thread. Checked first,
                // so the states change in place.
                let widened: Vec<_> = values.iter().map(|v| v.data.to_f32()).collect();
                let grads: Vec<&[f32]> = widened.iter().map(|g| &g[..]).collect();
                let devices = values.len();
                scheme::check_input(&c, &e.states[..e.states.len().min(devices)], &grads, devices).map_err(|err| key_error(key, err.to_string()))?;
                if e.states.len() < devices {
                    e.states.resize_with(devices, Default::default); // a new device starts from a default state
                }
                let ctx = scheme::Ctx { shape: &e.shape, step: e.pushes, key_hash: key.stable_hash(), member: 0, workers: devices };
                let mut group = collective::InProcess::new(devices);
                scheme::push_round(&c, &mut e.states[..devices], &grads, &ctx, &mut group, &mut e.merge_buf)?;
                // Counted, not modelled: what each device handed the reductions.
                sent = group.bytes_sent();
                e.pushes += 1;
            }
            _ => unreachable!("every compression is handled above"),
        }
        self.raw_bytes.fetch_add(values.len() as u64 * 4 * n as u64, Ordering::Relaxed);
        self.wire_bytes.fetch_add(sent, Ordering::Relaxed);
        apply_update(key, e, updater)
    }

    /// Copies the stored value into every output.
    pub fn pull(&self, key: &Key, outs: &mut [ArrayMut]) -> Result<()> {
        let entry = self.entry(key)?;
        let e = lock(key, &entry)?;
        check_outputs(key, "pull", outs, &e.shape)?;
        for o in outs.iter_mut() {
            copy_into(o.data, &e.value);
            if e.half {
                round_to_f16(o.data); // a float32 master copy (multi_precision) is pulled as float16
            }
        }
        Ok(())
    }

    /// The shape `key` was initialised with.
    pub fn shape(&self, key: &Key) -> Result<Vec<usize>> {
        let entry = self.entry(key)?;
        let shape = lock(key, &entry)?.shape.clone();
        Ok(shape)
    }

    /// The stored value of a key (a copy), for tests and inspection.
    pub fn value(&self, key: &Key) -> Result<Vec<f32>> {
        let entry = self.entry(key)?;
        let value = lock(key, &entry)?.value.clone();
        Ok(value)
    }

    /// The residual of a key on one device (a copy): 2-bit's, or a scheme's
    /// error-feedback residual. An error for a device that has not pushed the
    /// key with compression.
    pub fn residual(&self, key: &Key, device: usize) -> Result<Vec<f32>> {
        let entry = self.entry(key)?;
        let e = lock(key, &entry)?;
        let found = if e.residuals.is_empty() { e.states.get(device).map(|s| &s.residual) } else { e.residuals.get(device) };
        match found {
            Some(r) if r.len() == e.value.len() => Ok(r.clone()),
            _ => {
                let devices = e.residuals.len().max(e.states.len());
                Err(key_error(key, if device < devices {
                    format!("has no residual on device {device}: compression '{}' keeps no error-feedback residual", self.compression().name())
                } else if devices == 0 {
                    format!("has no residual on device {device}: it has not been pushed with compression")
                } else {
                    format!("has no residual on device {device}: {devices} device(s) pushed it with compression (devices 0 to {})", devices - 1)
                }))
            }
        }
    }
}

// --- The replica API: one worker's keys of an all-reduce job (the MPI
// store's). The driving store runs its job's protocol around each push; the
// entry, its buffers, states and counters stay this module's.

impl KVStore {
    /// A store for rank `rank`'s replica of a `workers`-worker all-reduce
    /// job's keys: float32 keys only; its pushes run through `Replica::push`.
    pub(in crate::store) fn replica(rank: usize, workers: usize) -> KVStore {
        KVStore::with_member(Kind::AllReduce, rank, workers)
    }

    /// `key`'s replica, ready for a push, or the error a push of it gives.
    pub(in crate::store) fn replica_of<'a>(&'a self, key: &'a Key) -> Result<Replica<'a>> {
        Ok(Replica { store: self, key, entry: self.entry(key)? })
    }

    /// The updater as every worker must hold it for `key`'s next update:
    /// 0 for none, 1 for a caller's function, else the fingerprint of the
    /// optimizer's settings for the key (`Optimizer::settings`).
    pub(in crate::store) fn updater_fingerprint(&self, key: &Key) -> u64 {
        match self.updater.read().unwrap().as_deref() {
            None => 0,
            Some(Updater::Optimizer(o)) => crate::hash::fingerprint(&o.settings(key)),
            Some(Updater::Custom(_)) => 1,
        }
    }

    /// Pushes of `key` so far.
    pub(in crate::store) fn pushes(&self, key: &Key) -> Result<u64> {
        let entry = self.entry(key)?;
        let pushes = lock(key, &entry)?.pushes;
        Ok(pushes)
    }
}

/// One key of a store, found: its pushes run through `Replica::push`, the
/// store's own (`KVStore::push`) and the MPI store's alike.
pub(in crate::store) struct Replica<'a> {
    store: &'a KVStore,
    key: &'a Key,
    entry: Arc<Mutex<Entry>>,
}

impl Replica<'_> {
    /// One push of the key under its lock: the store's checks, then `drive`
    /// with the round and the checks' result (a job's member takes part in
    /// its collectives even when its own checks failed). What a failed push
    /// changed is put back.
    pub fn push(&self, values: &[Array], drive: impl FnOnce(Round<'_>, Result<()>) -> Result<()>) -> Result<()> {
        let store = self.store;
        let (compression, updater) = (store.compression(), store.updater.read().unwrap().clone());
        let mut guard = lock(self.key, &self.entry)?;
        let e = &mut *guard;
        let checked = store.check_push(self.key, e, values, compression, updater.as_deref());
        store.undoable(e, updater.as_deref(), |e| drive(Round { store, key: self.key, e, compression, updater: updater.as_deref() }, checked))
    }
}

/// One push of one key, under its lock.
pub(in crate::store) struct Round<'a> {
    store: &'a KVStore,
    key: &'a Key,
    e: &'a mut Entry,
    compression: Compression,
    updater: Option<&'a Updater>,
}

impl Round<'_> {
    /// The key's shape.
    pub fn shape(&self) -> &[usize] {
        &self.e.shape
    }

    /// Whether the update is a caller's function (which may fail after the
    /// sum, on one worker alone).
    pub fn custom_update(&self) -> bool {
        matches!(self.updater, Some(Updater::Custom(_)))
    }

    /// Compressed pushes of the key so far.
    pub fn step(&self) -> u64 {
        self.e.pushes
    }

    /// Sums this worker's devices into the merge buffer (scratch, not state)
    /// and checks the sum as the compression will take it (under 2-bit, that
    /// the sum plus the residual is finite): nothing of the key changes.
    pub fn merge(&mut self, values: &[Array]) -> Result<()> {
        let (key, e) = (self.key, &mut *self.e);
        let n = e.value.len();
        let grads: Vec<Grad> = values.iter().map(|v| v.data).collect();
        e.merge_buf.resize(n, 0.0);
        sum_into(&mut e.merge_buf, &grads, false);
        scheme::check_pushed(&self.compression, &e.merge_buf, e.states.first(), "merged gradient").map_err(|err| key_error(key, err.to_string()))?;
        // QSGD's shared scale would fail every worker together, but only
        // inside the round, naming no worker: this one says which element,
        // now, and the agreement names it to the others (as a parameter
        // server's worker does).
        if let Compression::Qsgd(_) = self.compression {
            scheme::check_finite(&[&e.merge_buf]).map_err(|err| key_error(key, err.to_string()))?;
        }
        Ok(())
    }

    /// Reduces the merged sum with the other workers' through `group`
    /// (this worker is `member` of `workers`): a float32 sum, or the
    /// compression's encode, sum and decode. Every worker's checks passed.
    pub fn reduce(&mut self, group: &mut dyn Collective, member: u64, workers: usize) -> Result<()> {
        let e = &mut *self.e;
        if self.compression.is_none() {
            group.sum_f32(&mut e.merge_buf)?;
        } else {
            if e.states.is_empty() {
                e.states.push(scheme::State::default());
            }
            let ctx = scheme::Ctx { shape: &e.shape, step: e.pushes, key_hash: self.key.stable_hash(), member, workers };
            // The decoded sum goes to a second buffer, kept between pushes.
            let mut out = std::mem::take(&mut e.scheme_out);
            out.resize(e.value.len(), 0.0);
            let result = scheme::push_round(&self.compression, &mut e.states[..1], &[&e.merge_buf], &ctx, group, &mut out);
            e.scheme_out = std::mem::replace(&mut e.merge_buf, out);
            result?;
        }
        e.pushes += 1;
        Ok(())
    }

    /// Counts the push (`wire_bytes` handed to the group) and applies the
    /// updater to the reduced sum.
    pub fn update(self, wire_bytes: u64) -> Result<()> {
        self.store.raw_bytes.fetch_add(4 * self.e.value.len() as u64, Ordering::Relaxed);
        self.store.wire_bytes.fetch_add(wire_bytes, Ordering::Relaxed);
        apply_update(self.key, self.e, self.updater)
    }
}

#[cfg(test)]
mod tests;
