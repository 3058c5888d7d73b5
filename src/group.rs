//! Compression for a process group whose all-reduces the caller performs
//! (`torch.distributed` under `gradpack.torch`'s DDP communication hook):
//! each rank holds its own tensors' states, keyed by name; a bucket of
//! tensors is encoded here, its exchanges are handed to the caller's
//! `Engine` one all-reduce at a time (SUM, MAX or MIN on float32, uint8 or
//! 64-bit words), its final contributions come back as two buffers for the
//! caller to SUM, and `decode` turns the sums into every rank's identical
//! result: the sum over ranks divided by the world size.
//!
//! The scheme path is the stores' (`quant::scheme`): the same gradients,
//! seed, key and step give the bits the device store gives with one device
//! per rank. Before any exchange, every bucket is agreed by every rank in
//! one MAX (`collective::compare_fields`): the keys and shapes, the push
//! counts, the compression, and whether each rank's gradients are finite;
//! a difference or a non-finite gradient is the same error on every rank,
//! raised before anything changed. Owns: keyed states, the agreement, byte
//! counts, checkpoints. Knows nothing of Python or torch.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::codec;
use crate::compression::Compression;
use crate::error::{Error, Result};
use crate::key::Key;
use crate::kvstore::checkpoint::{self, KeyState, Saved};
use crate::quant::collective::{self, Collective};
use crate::quant::{lanes, powersgd, qsgd, scheme};

/// An all-reduce the caller's engine performs, in place, on every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum = 0,
    Max = 1,
    Min = 2,
}

/// A buffer handed to the engine: float32 values, uint8 scale indices, or
/// 64-bit words of packed lanes (summed as integers: lanes never carry
/// into each other, so a wrapping 64-bit sum is exact).
pub enum Buffer<'a> {
    F32(&'a mut [f32]),
    U8(&'a mut [u8]),
    U64(&'a mut [u64]),
}

impl Buffer<'_> {
    pub fn bytes(&self) -> u64 {
        match self {
            Buffer::F32(x) => 4 * x.len() as u64,
            Buffer::U8(x) => x.len() as u64,
            Buffer::U64(x) => 8 * x.len() as u64,
        }
    }
}

/// The caller's collective engine: each call is one blocking all-reduce
/// issued by every rank in the same order.
pub trait Engine {
    fn all_reduce(&mut self, op: ReduceOp, buf: Buffer<'_>) -> Result<()>;
}

/// `Collective` over an `Engine`, counting the bytes handed to it.
struct Through<'a> {
    engine: &'a mut dyn Engine,
    workers: usize,
    sent: u64,
}

impl Through<'_> {
    fn reduce(&mut self, op: ReduceOp, buf: Buffer<'_>) -> Result<()> {
        self.sent += buf.bytes();
        self.engine.all_reduce(op, buf)
    }
}

impl Collective for Through<'_> {
    fn workers(&self) -> usize {
        self.workers
    }
    fn max_f32(&mut self, x: &mut [f32]) -> Result<()> {
        self.reduce(ReduceOp::Max, Buffer::F32(x))
    }
    fn sum_f32(&mut self, x: &mut [f32]) -> Result<()> {
        self.reduce(ReduceOp::Sum, Buffer::F32(x))
    }
    fn min_u8(&mut self, x: &mut [u8], count: u8) -> Result<()> {
        self.reduce(ReduceOp::Min, Buffer::U8(x))?;
        match x.iter().position(|&l| l >= count) {
            Some(i) => Err(Error::Transport(format!("the engine's MIN gave scale index {} at element {i}, of {count} scales", x[i]))),
            None => Ok(()),
        }
    }
    fn sum_codes(&mut self, x: &mut [i32], lo: i32, hi: i32) -> Result<()> {
        let width = collective::sum_width(lo, hi, self.workers).ok_or_else(|| Error::InvalidParam { key: "workers".into(), problem: format!("{} ranks overflow a sum of codes in {lo}..={hi}", self.workers) })?;
        let mut words = lanes::pack_slice(x, width, |v| (v as i64 - lo as i64) as u64);
        self.reduce(ReduceOp::Sum, Buffer::U64(&mut words))?;
        lanes::unpack_codes(&words, width, lo as i64 * self.workers as i64, x)
    }
    fn sum_packed(&mut self, words: &mut [u64], n: usize, lo: i32, hi: i32, _: u32, width: u32) -> Result<()> {
        if collective::sum_width(lo, hi, self.workers) != Some(width) || words.len() != lanes::words_for(n, width) {
            return Err(Error::Internal(format!("{n} codes in {} words of {width}-bit lanes cannot hold {} ranks' sum of {lo}..={hi}", words.len(), self.workers)));
        }
        self.reduce(ReduceOp::Sum, Buffer::U64(words))
    }
}

/// One tensor of a bucket: its key, shape and float32 gradient.
pub struct Tensor<'a> {
    pub key: Key,
    pub shape: Vec<usize>,
    pub grad: &'a [f32],
}

/// What the group has sent and done (`State.stats()`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Bytes this rank handed the engine (agreements included).
    pub bytes_sent: u64,
    /// Bytes a float32 all-reduce of the same tensors would have handed it.
    pub bytes_uncompressed: u64,
    /// Buckets marked last (a training step's), or standalone pushes.
    pub steps: u64,
    /// Of those steps, the ones in which any tensor was compressed.
    pub compressed_steps: u64,
}

/// A key's state: its shape and the scheme's state (its push count included).
#[derive(Clone, Debug)]
struct Entry {
    shape: Vec<usize>,
    state: scheme::State,
}

/// The keyed states. A key whose bucket is in flight is taken out of
/// `idle` and listed in `in_flight` until its `Pending` is decoded or dropped.
#[derive(Default)]
struct Keys {
    idle: HashMap<Key, Entry>,
    in_flight: Vec<Key>,
    /// States loaded from a checkpoint for keys not pushed yet here:
    /// checked against each key's shape at its first push.
    loaded: HashMap<Key, Entry>,
    stats: Stats,
}

/// A process group's compression on one rank.
pub struct Group {
    compression: Compression,
    /// `fingerprint` of the compression, agreed by every rank.
    fingerprint: u64,
    rank: usize,
    world: usize,
    /// Pushes of a key before it is compressed (plain sums until then).
    start_iter: u64,
    /// A tensor is compressed only when its bytes would be at least this
    /// many times fewer.
    min_rate: f64,
    keys: Arc<Mutex<Keys>>,
}

/// How one tensor of a pending bucket travels.
enum Route {
    /// Summed as float32 values: `floats[range]`, or the caller's bucket
    /// itself when the whole bucket is plain.
    Plain(Range<usize>),
    /// Compressed: the exchanged values, and where its final contribution
    /// lies (packed words or float32 values).
    Compressed { exchanged: Vec<scheme::Part>, last: Final },
}

enum Final {
    Packed { words: Range<usize>, n: usize, lo: i32, hi: i32, width: u32 },
    F32(Range<usize>),
}

struct PendingKey {
    key: Key,
    entry: Entry,
    /// The tensor's elements in the bucket.
    at: Range<usize>,
    route: Route,
}

/// A bucket between `encode` and `decode`: the caller SUMs `words` and
/// `floats` (or, when `plain`, the bucket itself) on every rank, then hands
/// the sums back to `decode`. Dropped without `decode`, it returns its
/// keys' states unchanged by the sum (a failed all-reduce ends the job:
/// schemes with error feedback have already updated their residuals).
pub struct Pending {
    keys: Arc<Mutex<Keys>>,
    tensors: Vec<PendingKey>,
    /// Final packed contributions, every compressed tensor's words in turn.
    pub words: Vec<u64>,
    /// Final float32 contributions (uncompressed tensors of a mixed bucket,
    /// PowerSGD's Q).
    pub floats: Vec<f32>,
    /// Nothing compressed: the caller sums its bucket in place instead.
    pub plain: bool,
    len: usize,
    last: bool,
}

fn lock(keys: &Mutex<Keys>) -> MutexGuard<'_, Keys> {
    keys.lock().unwrap_or_else(|p| p.into_inner())
}

fn mismatch(what: String) -> Error {
    Error::Store(format!("gradpack: the ranks disagree on {what}"))
}

impl Group {
    /// A group of `world` ranks, this one `rank`. Refuses random-K with
    /// `unselected='local'`: each rank would keep its own gradient outside
    /// the selection, so replicas would differ.
    pub fn new(compression: Compression, rank: usize, world: usize, start_iter: u64, min_rate: f64) -> Result<Group> {
        if world == 0 || rank >= world {
            return Err(Error::InvalidParam { key: "process_group".into(), problem: format!("rank {rank} of a world of {world}") });
        }
        if !(min_rate.is_finite() && min_rate >= 0.0) {
            return Err(Error::InvalidParam { key: "min_compression_rate".into(), problem: format!("must be a finite number >= 0, got {min_rate}") });
        }
        if let Compression::Qsgd(q) = &compression {
            if q.keep_local {
                return Err(Error::InvalidParam {
                    key: "unselected".into(),
                    problem: "'local' keeps each rank's own gradient outside the selection, so DDP's replicas would differ; use 'zero' (the default)".into(),
                });
            }
            if world as u64 > qsgd::max_workers(q.bits()[0])? {
                return Err(Error::InvalidParam { key: "bits".into(), problem: format!("{world} ranks could overflow the code sum at {} bits", q.bits()[0]) });
            }
        }
        let fingerprint = crate::allreduce::fingerprint(&format!("{compression:?}"));
        Ok(Group { compression, fingerprint, rank, world, start_iter, min_rate, keys: Arc::default() })
    }

    pub fn compression(&self) -> &Compression {
        &self.compression
    }

    pub fn stats(&self) -> Stats {
        lock(&self.keys).stats
    }

    /// The bytes one rank hands the engine for a compressed push of
    /// `shape` (its exchanges and final contribution), as `Through` counts them.
    fn compressed_bytes(&self, shape: &[usize]) -> u64 {
        let n: usize = shape.iter().product();
        match &self.compression {
            Compression::None => collective::f32_bytes(n),
            Compression::TwoBit(_) => collective::codes_bytes(n, 0, self.world as i32 + 1, self.world),
            Compression::OneBit { .. } => collective::codes_bytes(n, 0, 1, self.world),
            Compression::Qsgd(q) => {
                let (k, levels) = (q.selected(n), q.levels());
                let s0 = levels[0] as i32;
                4 + if levels.len() > 1 { k as u64 } else { 0 } + collective::codes_bytes(k, -s0, s0, self.world)
            }
            Compression::PowerSgd { rank, .. } => match powersgd::factors(shape, *rank as usize) {
                Some((rows, cols, r)) => 4 * ((rows + cols) * r) as u64,
                None => collective::f32_bytes(n),
            },
        }
    }

    /// Whether a push of a key with `pushes` pushes so far is compressed.
    fn compresses(&self, shape: &[usize], pushes: u64) -> bool {
        let n: usize = shape.iter().product();
        if self.compression.is_none() || pushes < self.start_iter || n == 0 {
            return false;
        }
        if let Compression::PowerSgd { rank, .. } = self.compression {
            if powersgd::factors(shape, rank as usize).is_none() {
                return false; // a vector: PowerSGD sums it as it is
            }
        }
        self.compressed_bytes(shape) as f64 * self.min_rate <= collective::f32_bytes(n) as f64
    }

    /// Takes the bucket's keys out of the idle map (new keys start fresh, or
    /// from a loaded checkpoint), checking shapes.
    fn take(&self, tensors: &[Tensor]) -> Result<Vec<Entry>> {
        let mut keys = lock(&self.keys);
        for (i, t) in tensors.iter().enumerate() {
            if tensors[..i].iter().any(|u| u.key == t.key) || keys.in_flight.contains(&t.key) {
                return Err(Error::Key { key: t.key.to_string(), problem: "pushed twice at once (twice in one bucket, or while its bucket is in flight)".into() });
            }
            let known = keys.idle.get(&t.key).or_else(|| keys.loaded.get(&t.key)).map(|e| &e.shape);
            if let Some(shape) = known.filter(|s| **s != t.shape) {
                let whence = if keys.idle.contains_key(&t.key) { "pushed before" } else { "loaded from a checkpoint" };
                return Err(Error::Key { key: t.key.to_string(), problem: format!("{whence} with shape {shape:?}, pushed now with {:?}", t.shape) });
            }
        }
        let taken = tensors
            .iter()
            .map(|t| {
                keys.in_flight.push(t.key.clone());
                keys.idle.remove(&t.key).or_else(|| keys.loaded.remove(&t.key)).unwrap_or_else(|| Entry { shape: t.shape.clone(), state: scheme::State::default() })
            })
            .collect();
        Ok(taken)
    }

    /// Puts entries back (after a decode, or a failed or dropped bucket).
    fn give_back(keys: &Mutex<Keys>, entries: impl IntoIterator<Item = (Key, Entry)>) {
        let mut keys = lock(keys);
        for (key, entry) in entries {
            keys.in_flight.retain(|k| *k != key);
            keys.idle.insert(key, entry);
        }
    }

    /// The first non-finite gradient of the bucket (2-bit: residual +
    /// gradient), as (tensor index, element).
    fn first_non_finite(&self, tensors: &[Tensor], entries: &[Entry]) -> Option<(usize, usize)> {
        tensors.iter().zip(entries).enumerate().find_map(|(i, (t, e))| {
            let finite = match &self.compression {
                Compression::TwoBit(_) if e.state.residual.len() == t.grad.len() => codec::check_finite("gradient", t.grad, &e.state.residual).is_ok(),
                _ => qsgd::max_abs(t.grad).is_some(),
            };
            (!finite).then(|| (i, t.grad.iter().position(|x| !x.is_finite()).unwrap_or(0)))
        })
    }

    /// Agrees the bucket with every rank, then runs its exchanges through
    /// `engine`; the caller sums what `Pending` holds and calls `decode`.
    /// `bucket_len` must be the tensors' elements together (they lie in
    /// the bucket one after another). `last`: the bucket ends a step.
    pub fn encode(&self, tensors: &[Tensor], bucket_len: usize, last: bool, engine: &mut dyn Engine) -> Result<Pending> {
        let total = tensors.iter().try_fold(0usize, |acc, t| {
            let n = t.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            match n {
                Some(n) if n == t.grad.len() => acc.checked_add(n),
                _ => None,
            }
        });
        if total != Some(bucket_len) {
            let shapes: Vec<_> = tensors.iter().map(|t| (t.key.to_string(), t.shape.clone(), t.grad.len())).collect();
            return Err(Error::Internal(format!("a bucket of {bucket_len} elements holds tensors (key, shape, elements) {shapes:?}")));
        }
        let mut entries = self.take(tensors)?;
        let mut coll = Through { engine, workers: self.world, sent: 0 };
        match self.agree_and_exchange(tensors, &mut entries, &mut coll) {
            Ok((routes, words, floats, plain)) => {
                let mut pending = Pending { keys: self.keys.clone(), tensors: Vec::new(), words, floats, plain, len: bucket_len, last };
                let mut at = 0;
                for ((t, entry), route) in tensors.iter().zip(entries).zip(routes) {
                    let n = t.grad.len();
                    pending.tensors.push(PendingKey { key: t.key.clone(), entry, at: at..at + n, route });
                    at += n;
                }
                let final_bytes = if plain { collective::f32_bytes(bucket_len) } else { 8 * pending.words.len() as u64 + 4 * pending.floats.len() as u64 };
                let mut keys = lock(&self.keys);
                keys.stats.bytes_sent += coll.sent + final_bytes;
                keys.stats.bytes_uncompressed += collective::f32_bytes(bucket_len);
                Ok(pending)
            }
            Err(err) => {
                lock(&self.keys).stats.bytes_sent += coll.sent;
                Group::give_back(&self.keys, tensors.iter().map(|t| t.key.clone()).zip(entries));
                Err(err)
            }
        }
    }

    #[allow(clippy::type_complexity)]
    fn agree_and_exchange(&self, tensors: &[Tensor], entries: &mut [Entry], coll: &mut Through) -> Result<(Vec<Route>, Vec<u64>, Vec<f32>, bool)> {
        // Every rank must hold the same keys, shapes, push counts and
        // compression; a rank with a non-finite gradient raises its flag.
        let layout = crate::hash::finalize(tensors.iter().fold(0x6770_6275_636b_6574, |h: u64, t| {
            let h = crate::hash::finalize(h ^ t.key.stable_hash());
            t.shape.iter().fold(crate::hash::finalize(h ^ t.shape.len() as u64), |h, &d| crate::hash::finalize(h ^ d as u64))
        }));
        let pushes = entries.iter().fold(0u64, |h, e| crate::hash::finalize(h ^ e.state.step));
        let fault = self.first_non_finite(tensors, entries).map_or(0, |(i, _)| ((self.rank as u64 + 1) << 32) | (i as u64 + 1));
        let settings = crate::allreduce::fingerprint(&format!("{} {} {}", self.world, self.start_iter, self.min_rate));
        let fields = [layout, pushes, self.fingerprint, settings, fault];
        const NAMES: [&str; 4] = ["bucket layout (the tensors' keys and shapes)", "push counts (a checkpoint loaded on some ranks only?)", "compression parameters", "world size, start_iter or min_compression_rate"];
        let (max, differs) = collective::compare_fields(coll, &fields)?;
        let named: Vec<&str> = differs.iter().filter_map(|&f| NAMES.get(f).copied()).collect();
        if !named.is_empty() {
            return Err(mismatch(format!("{} of a bucket of {} tensors (first key {}); every rank must run the same model with the same gradpack State settings", named.join(", "), tensors.len(), tensors[0].key)));
        }
        if max[4] != 0 {
            let (rank, i) = ((max[4] >> 32) - 1, (max[4] & 0xFFFF_FFFF) as usize - 1);
            let key = tensors.get(i).map_or_else(|| "?".to_string(), |t| t.key.to_string());
            let what = if matches!(self.compression, Compression::TwoBit(_)) { "residual + gradient" } else { "gradient" };
            return Err(Error::Store(format!("gradpack: rank {rank}'s {what} of key {key} holds a non-finite value (inf or NaN) at push {}; nothing was applied on any rank", entries[i].state.step)));
        }
        let compresses: Vec<bool> = tensors.iter().zip(entries.iter()).map(|(t, e)| self.compresses(&t.shape, e.state.step)).collect();
        let plain = !compresses.iter().any(|&c| c);
        let (mut words, mut floats, mut routes) = (Vec::new(), Vec::new(), Vec::with_capacity(tensors.len()));
        // Agreed: from here on only the engine can fail (a dead rank, which
        // ends the job), so the states change in place.
        for ((t, e), &compress) in tensors.iter().zip(entries.iter_mut()).zip(&compresses) {
            if !compress {
                let at = floats.len();
                if !plain {
                    floats.extend_from_slice(t.grad);
                }
                routes.push(Route::Plain(at..at + t.grad.len()));
                continue;
            }
            let ctx = self.ctx(&t.key, &t.shape, e.state.step);
            let (exchanged, part) = scheme::encode(&self.compression, std::slice::from_mut(&mut e.state), &[t.grad], &ctx, coll)?;
            let last = match part {
                scheme::Part::Packed { words: w, n, lo, hi, width, .. } => {
                    let at = words.len();
                    words.extend_from_slice(&w);
                    Final::Packed { words: at..words.len(), n, lo, hi, width }
                }
                scheme::Part::F32(x) => {
                    let at = floats.len();
                    floats.extend_from_slice(&x);
                    Final::F32(at..floats.len())
                }
                _ => return Err(Error::Internal("a scheme's final contribution is neither packed codes nor float32".into())),
            };
            routes.push(Route::Compressed { exchanged, last });
        }
        Ok((routes, words, floats, plain))
    }

    fn ctx<'a>(&self, key: &Key, shape: &'a [usize], step: u64) -> scheme::Ctx<'a> {
        scheme::Ctx { shape, step, key_hash: key.stable_hash(), member: self.rank as u64, workers: self.world }
    }

    /// Turns the sums of a bucket's final contributions into its result,
    /// written to `bucket` (`plain`: the bucket already holds the float32
    /// sum): the sum over ranks divided by the world size, every rank's
    /// alike. Consumes `pending`; its keys' states are back either way.
    pub fn decode(&self, mut pending: Pending, bucket: &mut [f32]) -> Result<()> {
        if bucket.len() != pending.len {
            return Err(Error::SizeMismatch { what: "bucket", expected: pending.len, got: bucket.len() });
        }
        if !Arc::ptr_eq(&pending.keys, &self.keys) {
            return Err(Error::Internal("a pending bucket decoded by another State".into()));
        }
        let world = self.world as f32;
        let (words, floats) = (std::mem::take(&mut pending.words), std::mem::take(&mut pending.floats));
        let mut compressed = false;
        let mut result = Ok(());
        for t in pending.tensors.iter_mut() {
            let out = &mut bucket[t.at.clone()];
            match &mut t.route {
                Route::Plain(r) => {
                    if !pending.plain {
                        out.copy_from_slice(&floats[r.clone()]);
                    }
                    t.entry.state.step += 1;
                }
                Route::Compressed { exchanged, last } => {
                    compressed = true;
                    let part = match last {
                        Final::Packed { words: w, n, lo, hi, width } => scheme::Part::Packed { words: words[w.clone()].to_vec(), n: *n, lo: *lo, hi: *hi, count: self.world as u32, width: *width },
                        Final::F32(r) => scheme::Part::F32(floats[r.clone()].to_vec()),
                    };
                    let ctx = self.ctx(&t.key, &t.entry.shape, t.entry.state.step);
                    if let Err(err) = scheme::decode(&self.compression, exchanged, &part, &ctx, out) {
                        result = Err(err);
                        break;
                    }
                    let states = std::slice::from_mut(&mut t.entry.state);
                    scheme::finish(&self.compression, states, part);
                    scheme::recycle(states, std::mem::take(exchanged));
                }
            }
            out.iter_mut().for_each(|x| *x /= world);
        }
        if result.is_ok() {
            let mut keys = lock(&self.keys);
            keys.stats.steps += pending.last as u64;
            keys.stats.compressed_steps += (pending.last && compressed) as u64;
        }
        result
    }

    /// Every key's state, in a versioned blob ("GPCS", as the stores save
    /// theirs). Refused while a bucket is in flight.
    pub fn save(&self) -> Result<Vec<u8>> {
        let keys = lock(&self.keys);
        if let Some(k) = keys.in_flight.first() {
            return Err(Error::Key { key: k.to_string(), problem: "its bucket is in flight: save the state between steps".into() });
        }
        let mut saved: Vec<KeyState> = keys
            .idle
            .iter()
            .chain(keys.loaded.iter())
            .map(|(key, e)| KeyState { key: key.clone(), shape: e.shape.clone(), pushes: e.state.step, residuals: Vec::new(), states: vec![e.state.clone()] })
            .collect();
        saved.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(checkpoint::encode(&Saved { compression: format!("{:?}", self.compression), rank: self.rank as u64, workers: self.world as u64, keys: saved }))
    }

    /// Replaces every key's state with a blob's (`save`): checked whole
    /// first (compression, rank and world size, the shapes of keys pushed
    /// here already, each state's shapes), so a refused blob changes nothing.
    pub fn load(&self, blob: &[u8]) -> Result<()> {
        let saved = checkpoint::decode(blob)?;
        let mut keys = lock(&self.keys);
        if let Some(k) = keys.in_flight.first() {
            return Err(Error::Key { key: k.to_string(), problem: "its bucket is in flight: load a state between steps".into() });
        }
        let known = |k: &Key| keys.idle.get(k).map(|e| e.shape.clone()).ok_or_else(|| Error::Internal(String::new()));
        let fresh = keys.idle.is_empty();
        checkpoint::check(&saved, &self.compression, (self.rank as u64, self.world as u64), |k| if fresh { Ok(saved_shape(&saved, k)) } else { known(k) }, |_| None)?;
        if !fresh {
            if let Some(k) = keys.idle.keys().find(|k| !saved.keys.iter().any(|s| s.key == **k)) {
                return Err(Error::OptimizerStates(format!("key {k}: pushed here but not in the compression states")));
            }
        }
        let loaded: HashMap<Key, Entry> = saved
            .keys
            .into_iter()
            .map(|k| {
                let mut state = k.states.into_iter().next().unwrap_or_default();
                state.step = k.pushes;
                (k.key, Entry { shape: k.shape, state })
            })
            .collect();
        keys.idle.clear();
        keys.loaded = loaded;
        Ok(())
    }
}

/// A key's shape as saved (a fresh group checks its keys at their first push).
fn saved_shape(saved: &Saved, key: &Key) -> Vec<usize> {
    saved.keys.iter().find(|k| k.key == *key).map_or_else(Vec::new, |k| k.shape.clone())
}

impl Drop for Pending {
    fn drop(&mut self) {
        Group::give_back(&self.keys, self.tensors.drain(..).map(|t| (t.key, t.entry)));
    }
}
