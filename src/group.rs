//! Compression for a process group whose all-reduces the caller performs
//! (`torch.distributed` under `gradpack.torch`'s DDP communication hook):
//! each rank holds its own tensors' states, keyed by name; a bucket of
//! tensors is encoded here, its exchanges are handed to the caller's
//! `Engine` one all-reduce at a time (SUM or MAX of float32, SUM or OR of
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
use crate::quant::compression::Compression;
use crate::error::{Error, Result};
use crate::key::Key;
use crate::store::checkpoint::{self, KeyState, Saved};
use crate::quant::collective::{self, Collective};
use crate::quant::{lanes, powersgd, qsgd, scheme};

/// An all-reduce the caller's engine performs, in place, on every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum = 0,
    Max = 1,
    /// Bitwise OR of 64-bit words.
    Or = 2,
}

/// A buffer handed to the engine: float32 values, or 64-bit words of
/// packed lanes (summed as integers: lanes never carry into each other, so
/// a wrapping 64-bit sum is exact).
pub enum Buffer<'a> {
    F32(&'a mut [f32]),
    U64(&'a mut [u64]),
}

impl Buffer<'_> {
    pub fn bytes(&self) -> u64 {
        match self {
            Buffer::F32(x) => 4 * x.len() as u64,
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
    /// Scale indices travel as thermometer codes: `count - 1` bits an
    /// index, bit `j` set when the index is at most `j`, so that a bitwise
    /// OR over ranks is the code of their minimum (an engine has no
    /// lane-wise MIN; a byte an index would cost 8 bits instead of 1 to 7).
    fn min_u8(&mut self, x: &mut [u8], count: u8) -> Result<()> {
        if let Some(i) = x.iter().position(|&l| l >= count) {
            return Err(Error::Internal(format!("scale index {} at element {i}, of {count} scales", x[i])));
        }
        let width = count.saturating_sub(1) as u32;
        if width == 0 {
            return Ok(()); // one scale: every index is 0
        }
        let mask = (1u64 << width) - 1;
        let mut words = lanes::pack_slice(x, width, |l| (mask << l) & mask);
        self.reduce(ReduceOp::Or, Buffer::U64(&mut words))?;
        lanes::unpack_into(&words, width, x, |t| t.trailing_zeros().min(width) as u8)
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

/// A buffer owned while it travels between an encode thread and the engine.
enum Data {
    F32(Vec<f32>),
    U64(Vec<u64>),
}

impl Data {
    fn of(buf: &Buffer<'_>) -> Data {
        match buf {
            Buffer::F32(x) => Data::F32(x.to_vec()),
            Buffer::U64(x) => Data::U64(x.to_vec()),
        }
    }

    fn kind(&self) -> u8 {
        match self {
            Data::F32(_) => 0,
            Data::U64(_) => 1,
        }
    }
}

/// One encode thread's exchange, waiting for its batch.
struct Request {
    slot: usize,
    op: ReduceOp,
    data: Data,
    reply: std::sync::mpsc::Sender<Result<Data>>,
}

enum Msg {
    Reduce(Request),
    Done { slot: usize, result: Result<(Vec<scheme::Part>, scheme::Part)> },
}

/// An encode thread's engine: each all-reduce waits for its batch's result.
struct Batched {
    tx: std::sync::mpsc::Sender<Msg>,
    slot: usize,
}

impl Engine for Batched {
    fn all_reduce(&mut self, op: ReduceOp, buf: Buffer<'_>) -> Result<()> {
        let (reply, answer) = std::sync::mpsc::channel();
        let request = Request { slot: self.slot, op, data: Data::of(&buf), reply };
        self.tx.send(Msg::Reduce(request)).map_err(|_| Error::Internal("the batching driver is gone".into()))?;
        let data = answer.recv().map_err(|_| Error::Internal("the batching driver is gone".into()))??;
        match (buf, data) {
            (Buffer::F32(x), Data::F32(d)) if x.len() == d.len() => x.copy_from_slice(&d),
            (Buffer::U64(x), Data::U64(d)) if x.len() == d.len() => x.copy_from_slice(&d),
            _ => return Err(Error::Internal("a batched reduction came back as another buffer".into())),
        }
        Ok(())
    }
}

impl Batched {
    /// Reduces the waiting requests (in tensor order) as one all-reduce per
    /// (operation, element type), in the order of each pair's first request,
    /// and answers each; an engine error answers every request left.
    fn serve(waiting: Vec<Request>, coll: &mut Through) {
        let mut groups: Vec<((ReduceOp, u8), Vec<Request>)> = Vec::new();
        for r in waiting {
            let id = (r.op, r.data.kind());
            match groups.iter_mut().find(|(g, _)| *g == id) {
                Some((_, members)) => members.push(r),
                None => groups.push((id, vec![r])),
            }
        }
        let mut failed: Option<String> = None;
        for ((op, _), members) in groups {
            if let Some(why) = &failed {
                members.into_iter().for_each(|r| drop(r.reply.send(Err(Error::Transport(why.clone())))));
                continue;
            }
            macro_rules! batch {
                ($variant:ident, $t:ty) => {{
                    let mut all: Vec<$t> = Vec::new();
                    let lens: Vec<usize> = members.iter().map(|r| match &r.data { Data::$variant(d) => { all.extend_from_slice(d); d.len() } _ => 0 }).collect();
                    match coll.reduce(op, Buffer::$variant(&mut all)) {
                        Ok(()) => {
                            let mut at = 0;
                            for (r, len) in members.into_iter().zip(lens) {
                                let _ = r.reply.send(Ok(Data::$variant(all[at..at + len].to_vec())));
                                at += len;
                            }
                        }
                        Err(e) => {
                            failed = Some(e.to_string());
                            members.into_iter().for_each(|r| drop(r.reply.send(Err(Error::Transport(e.to_string())))));
                        }
                    }
                }};
            }
            match members[0].data {
                Data::F32(_) => batch!(F32, f32),
                Data::U64(_) => batch!(U64, u64),
            }
        }
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

/// Where `take` found a key's entry.
#[derive(Clone, Copy)]
enum Origin {
    Idle,
    Loaded,
    New,
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
        // 2-bit and 1-bit sum every rank's codes in lanes of at most 31 bits.
        let limit = match compression {
            Compression::TwoBit(_) => Some(max_ranks(|w| i32::try_from(w + 1).ok().and_then(|hi| collective::sum_width(0, hi, w)).is_some())),
            Compression::OneBit { .. } => Some(max_ranks(|w| collective::sum_width(0, 1, w).is_some())),
            _ => None,
        };
        if let Some(limit) = limit.filter(|&l| world > l) {
            return Err(Error::InvalidParam {
                key: "process_group".into(),
                problem: format!("a world of {world} ranks: {} sums every rank's codes in 32-bit lanes, which hold the sum of at most {limit} ranks", compression.name()),
            });
        }
        let fingerprint = crate::hash::fingerprint(&format!("{compression:?}"));
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
                let thermometer = if levels.len() > 1 { 8 * lanes::words_for(k, levels.len() as u32 - 1) as u64 } else { 0 };
                4 + thermometer + collective::codes_bytes(k, -s0, s0, self.world)
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
    /// from a loaded checkpoint), checking shapes; with where each came from.
    fn take(&self, tensors: &[Tensor]) -> Result<(Vec<Entry>, Vec<Origin>)> {
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
                match (keys.idle.remove(&t.key), keys.loaded.remove(&t.key)) {
                    (Some(e), _) => (e, Origin::Idle),
                    (None, Some(e)) => (e, Origin::Loaded),
                    (None, None) => (Entry { shape: t.shape.clone(), state: scheme::State::default() }, Origin::New),
                }
            })
            .unzip();
        Ok(taken)
    }

    /// Puts entries back where `take` found them, after an encode that
    /// failed: a key pushed for the first time is not registered, so the
    /// group is as if the call had never been made.
    fn untake(&self, tensors: &[Tensor], entries: Vec<Entry>, origins: Vec<Origin>) {
        let mut keys = lock(&self.keys);
        for ((t, entry), origin) in tensors.iter().zip(entries).zip(origins) {
            keys.in_flight.retain(|k| *k != t.key);
            match origin {
                Origin::Idle => drop(keys.idle.insert(t.key.clone(), entry)),
                Origin::Loaded => drop(keys.loaded.insert(t.key.clone(), entry)),
                Origin::New => {}
            }
        }
    }

    /// Puts entries back (after a decode, or a failed or dropped bucket).
    fn give_back(keys: &Mutex<Keys>, entries: impl IntoIterator<Item = (Key, Entry)>) {
        let mut keys = lock(keys);
        for (key, entry) in entries {
            keys.in_flight.retain(|k| *k != key);
            keys.idle.insert(key, entry);
        }
    }

    /// This rank's fault code for the bucket's tensors that `compress`:
    /// 0, or (rank + 1) << 32 | (index + 1) of the first whose gradient (2-bit:
    /// residual + gradient) holds a non-finite value. The largest code over
    /// ranks names one rank and tensor on every rank alike. Tensors summed
    /// plainly are not checked: like torch's own all-reduce, they carry a
    /// NaN to every rank (where a loss scaler sees it).
    fn fault_code(&self, tensors: &[Tensor], entries: &[Entry], compress: &[bool]) -> u64 {
        let first = tensors.iter().zip(entries).zip(compress).position(|((t, e), &c)| {
            c && match &self.compression {
                Compression::TwoBit(_) if e.state.residual.len() == t.grad.len() => codec::check_finite("gradient", t.grad, &e.state.residual).is_err(),
                _ => qsgd::max_abs(t.grad).is_none(),
            }
        });
        first.map_or(0, |i| ((self.rank as u64 + 1) << 32) | (i as u64 + 1))
    }

    /// The error every rank raises for the largest fault code over ranks.
    fn non_finite(&self, code: u64, tensors: &[Tensor], entries: &[Entry]) -> Error {
        let (rank, i) = ((code >> 32) - 1, (code & 0xFFFF_FFFF) as usize - 1);
        let key = tensors.get(i).map_or_else(|| "?".to_string(), |t| t.key.to_string());
        let step = entries.get(i).map_or(0, |e| e.state.step);
        let what = if matches!(self.compression, Compression::TwoBit(_)) { "residual + gradient" } else { "gradient" };
        Error::Store(format!("gradpack: rank {rank}'s {what} of key {key} holds a non-finite value (inf or NaN) at push {step}; nothing was applied on any rank"))
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
        let (mut entries, origins) = self.take(tensors)?;
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
                self.untake(tensors, entries, origins);
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
        let compresses: Vec<bool> = tensors.iter().zip(entries.iter()).map(|(t, e)| self.compresses(&t.shape, e.state.step)).collect();
        // QSGD changes no state before its shared scale, which is not finite
        // on every rank when a rank's gradient is not: its check comes after
        // (no second read of the gradients); other schemes check first.
        let qsgd = matches!(self.compression, Compression::Qsgd(_));
        let fault = if qsgd { 0 } else { self.fault_code(tensors, entries, &compresses) };
        let settings = crate::hash::fingerprint(&format!("{} {} {}", self.world, self.start_iter, self.min_rate));
        let fields = [layout, pushes, self.fingerprint, settings, fault];
        const NAMES: [&str; 4] = ["bucket layout (the tensors' keys and shapes)", "push counts (a checkpoint loaded on some ranks only?)", "compression parameters", "world size, start_iter or min_compression_rate"];
        let (max, differs) = collective::compare_fields(coll, &fields)?;
        let named: Vec<&str> = differs.iter().filter_map(|&f| NAMES.get(f).copied()).collect();
        if !named.is_empty() {
            return Err(mismatch(format!("{} of a bucket of {} tensors (first key {}); every rank must run the same model with the same gradpack State settings", named.join(", "), tensors.len(), tensors[0].key)));
        }
        if max[4] != 0 {
            return Err(self.non_finite(max[4], tensors, entries));
        }
        let plain = !compresses.iter().any(|&c| c);
        let (mut words, mut floats, mut routes) = (Vec::new(), Vec::new(), Vec::with_capacity(tensors.len()));
        // Agreed: from here on only the engine can fail (a dead rank, which
        // ends the job), so the states change in place.
        let mut jobs = Vec::new();
        for (i, ((t, e), &compress)) in tensors.iter().zip(entries.iter_mut()).zip(&compresses).enumerate() {
            if compress {
                jobs.push((i, self.ctx(&t.key, &t.shape, e.state.step), t.grad, &mut e.state));
            }
        }
        let encoded = self.encode_batched(jobs, coll);
        if let Some(err) = encoded.iter().find_map(|r| r.as_ref().err()) {
            if !qsgd || matches!(err, Error::Transport(_) | Error::Internal(_)) {
                return Err(encoded.into_iter().find_map(Result::err).unwrap_or_else(|| Error::Internal("lost error".into())));
            }
            // A non-finite scale, the same on every rank: name the rank and tensor alike everywhere.
            let (max, _) = collective::compare_fields(coll, &[self.fault_code(tensors, entries, &compresses)])?;
            return Err(if max[0] != 0 { self.non_finite(max[0], tensors, entries) } else { encoded.into_iter().find_map(Result::err).unwrap_or_else(|| Error::Internal("lost error".into())) });
        }
        let mut encoded = encoded.into_iter().map(|r| r.expect("checked above"));
        for (t, &compress) in tensors.iter().zip(&compresses) {
            if !compress {
                let at = floats.len();
                if !plain {
                    floats.extend_from_slice(t.grad);
                }
                routes.push(Route::Plain(at..at + t.grad.len()));
                continue;
            }
            let (exchanged, part) = encoded.next().ok_or_else(|| Error::Internal("a tensor's encode is missing".into()))?;
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

    /// Encodes each job (tensor index, context, gradient, state) on a thread
    /// of its own, batching their exchanges: once every unfinished encode
    /// waits on one, the waiting requests go to the engine as one
    /// all-reduce per (operation, element type), concatenated in tensor
    /// order. Every rank holds the same tensors and compression (agreed), so
    /// every rank makes the same batched calls in the same order.
    #[allow(clippy::type_complexity)]
    fn encode_batched(&self, jobs: Vec<(usize, scheme::Ctx, &[f32], &mut scheme::State)>, coll: &mut Through) -> Vec<Result<(Vec<scheme::Part>, scheme::Part)>> {
        let count = jobs.len();
        let (tx, rx) = std::sync::mpsc::channel::<Msg>();
        let compression = &self.compression;
        let world = self.world;
        std::thread::scope(|s| {
            for (slot, (_, ctx, grad, state)) in jobs.into_iter().enumerate() {
                let tx = tx.clone();
                s.spawn(move || {
                    let mut engine = Batched { tx: tx.clone(), slot };
                    let mut own = Through { engine: &mut engine, workers: world, sent: 0 };
                    let result = scheme::encode(compression, std::slice::from_mut(state), &[grad], &ctx, &mut own);
                    let _ = tx.send(Msg::Done { slot, result });
                });
            }
            drop(tx);
            let mut results: Vec<Option<Result<(Vec<scheme::Part>, scheme::Part)>>> = (0..count).map(|_| None).collect();
            let (mut live, mut waiting) = (count, Vec::<Request>::new());
            while live > 0 {
                match rx.recv() {
                    Ok(Msg::Done { slot, result }) => {
                        results[slot] = Some(result);
                        live -= 1;
                    }
                    Ok(Msg::Reduce(r)) => waiting.push(r),
                    Err(_) => break, // every encode thread has ended
                }
                if live > 0 && waiting.len() == live {
                    waiting.sort_by_key(|r| r.slot);
                    Batched::serve(std::mem::take(&mut waiting), coll);
                }
            }
            results
                .into_iter()
                .map(|r| r.unwrap_or_else(|| Err(Error::Internal("a tensor's encode ended without a result".into()))))
                .collect()
        })
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
            crate::par::chunks(out, |_, piece| piece.iter_mut().for_each(|x| *x /= world));
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

/// The largest world size for which `fits` holds (it holds for 1 and, once
/// false, stays false).
fn max_ranks(fits: impl Fn(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (1usize, 1usize << 32);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Barrier, Condvar};

    /// Ranks on threads of this process, reducing through shared memory in
    /// rank order (float32 sums in rank order, as a device store folds;
    /// words as wrapping 64-bit sums). Values travel as bit patterns.
    struct Threads {
        posted: Mutex<(u64, Vec<Option<Vec<u64>>>, Option<Vec<u64>>)>,
        ready: Condvar,
        done: Barrier,
    }

    struct Rank<'a> {
        threads: &'a Threads,
        rank: usize,
    }

    impl Threads {
        fn new(world: usize) -> Threads {
            Threads { posted: Mutex::new((0, vec![None; world], None)), ready: Condvar::new(), done: Barrier::new(world) }
        }
    }

    fn fold(op: ReduceOp, float: bool, a: u64, b: u64) -> u64 {
        if float {
            let (x, y) = (f32::from_bits(a as u32), f32::from_bits(b as u32));
            let r = match op {
                ReduceOp::Sum => x + y,
                ReduceOp::Max => x.max(y),
                ReduceOp::Or => panic!("OR of float32"),
            };
            return r.to_bits() as u64;
        }
        match op {
            ReduceOp::Sum => a.wrapping_add(b),
            ReduceOp::Max => a.max(b),
            ReduceOp::Or => a | b,
        }
    }

    impl Engine for Rank<'_> {
        fn all_reduce(&mut self, op: ReduceOp, buf: Buffer<'_>) -> Result<()> {
            let (mine, float): (Vec<u64>, bool) = match &buf {
                Buffer::F32(x) => (x.iter().map(|v| v.to_bits() as u64).collect(), true),
                Buffer::U64(x) => (x.to_vec(), false),
            };
            let t = self.threads;
            let mut g = t.posted.lock().unwrap();
            g.1[self.rank] = Some(mine);
            if g.1.iter().all(Option::is_some) {
                let all: Vec<Vec<u64>> = g.1.iter_mut().map(|x| x.take().unwrap()).collect();
                let folded = all[1..].iter().fold(all[0].clone(), |acc, x| acc.iter().zip(x).map(|(&a, &b)| fold(op, float, a, b)).collect());
                g.2 = Some(folded);
                g.0 += 1;
                t.ready.notify_all();
            } else {
                let round = g.0;
                g = t.ready.wait_while(g, |g| g.0 == round).unwrap();
            }
            let result = g.2.clone().unwrap();
            drop(g);
            match buf {
                Buffer::F32(x) => x.iter_mut().zip(&result).for_each(|(x, &r)| *x = f32::from_bits(r as u32)),
                Buffer::U64(x) => x.copy_from_slice(&result),
            }
            t.done.wait(); // every rank has read the result before the next round
            Ok(())
        }
    }

    fn params(p: &[(&str, &str)]) -> Compression {
        Compression::from_params(p.iter().copied()).unwrap()
    }

    /// Each rank pushes `grads[rank]` as one bucket of the given keys and
    /// shapes; the results (or errors) of every rank.
    fn push_all(groups: &[Group], keys: &[(&str, Vec<usize>)], grads: &[Vec<f32>]) -> Vec<Result<Vec<f32>>> {
        let threads = Threads::new(groups.len());
        std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .iter()
                .enumerate()
                .map(|(rank, g)| {
                    let (threads, grad) = (&threads, &grads[rank]);
                    s.spawn(move || {
                        let mut at = 0;
                        let tensors: Vec<Tensor> = keys
                            .iter()
                            .map(|(k, shape)| {
                                let n: usize = shape.iter().product();
                                at += n;
                                Tensor { key: Key::Str(k.to_string()), shape: shape.clone(), grad: &grad[at - n..at] }
                            })
                            .collect();
                        let mut engine = Rank { threads, rank };
                        let mut pending = g.encode(&tensors, grad.len(), true, &mut engine)?;
                        let mut out = grad.clone();
                        if pending.plain {
                            engine.all_reduce(ReduceOp::Sum, Buffer::F32(&mut out))?;
                        } else {
                            let (mut w, mut f) = (std::mem::take(&mut pending.words), std::mem::take(&mut pending.floats));
                            engine.all_reduce(ReduceOp::Sum, Buffer::U64(&mut w))?;
                            engine.all_reduce(ReduceOp::Sum, Buffer::F32(&mut f))?;
                            (pending.words, pending.floats) = (w, f);
                        }
                        g.decode(pending, &mut out)?;
                        Ok(out)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn grads(world: usize, n: usize, step: u64) -> Vec<Vec<f32>> {
        (0..world).map(|r| (0..n).map(|i| (((i * 7 + r * 13 + step as usize * 5) % 17) as f32 - 8.0) / 16.0).collect()).collect()
    }

    #[test]
    fn a_bucket_decodes_to_the_device_stores_sum_over_the_world_on_every_rank() {
        let shapes = [("a", vec![6, 8]), ("b", vec![5])];
        for c in [
            params(&[("compress", "qsgd_mn"), ("bits", "2"), ("seed", "3")]),
            params(&[("compress", "2bit"), ("threshold", "0.25")]),
            params(&[("compress", "grandk_mn_ts"), ("bits", "[2,4]"), ("k", "9")]),
            params(&[("compress", "qsgd_mn_ms"), ("bits", "[1,3,5,8]")]),
            params(&[("compress", "1bit")]),
        ] {
            let groups: Vec<Group> = (0..2).map(|r| Group::new(c, r, 2, 0, 0.0).unwrap()).collect();
            // The same pushes through the scheme path of an in-process store of two members.
            let mut states: Vec<Vec<scheme::State>> = vec![vec![scheme::State::default(); 2]; 2];
            for step in 0..3 {
                let g = grads(2, 53, step);
                let got = push_all(&groups, &shapes, &g);
                let mut at = 0;
                for (t, (key, shape)) in shapes.iter().enumerate() {
                    let n: usize = shape.iter().product();
                    let mine: Vec<&[f32]> = g.iter().map(|g| &g[at..at + n]).collect();
                    let ctx = scheme::Ctx { shape, step, key_hash: Key::Str(key.to_string()).stable_hash(), member: 0, workers: 2 };
                    let mut want = vec![0f32; n];
                    scheme::push_round(&c, &mut states[t], &mine, &ctx, &mut collective::InProcess::new(2), &mut want).unwrap();
                    want.iter_mut().for_each(|x| *x /= 2.0);
                    for r in &got {
                        assert_eq!(&r.as_ref().unwrap()[at..at + n], &want[..], "{c:?} step {step} key {key}");
                    }
                    at += n;
                }
            }
            let s = groups[0].stats();
            assert_eq!((s.steps, s.compressed_steps, s.bytes_uncompressed), (3, 3, 3 * 4 * 53));
        }
    }

    #[test]
    fn a_non_finite_gradient_or_a_mismatch_fails_every_rank_alike_and_changes_nothing() {
        let c = params(&[("compress", "2bit"), ("threshold", "0.25")]);
        let groups: Vec<Group> = (0..2).map(|r| Group::new(c, r, 2, 0, 0.0).unwrap()).collect();
        let shapes = [("w", vec![20])];
        push_all(&groups, &shapes, &grads(2, 20, 0));
        let saved: Vec<Vec<u8>> = groups.iter().map(|g| g.save().unwrap()).collect();
        let mut bad = grads(2, 20, 1);
        bad[1][7] = f32::NAN;
        let errors: Vec<String> = push_all(&groups, &shapes, &bad).into_iter().map(|r| r.unwrap_err().to_string()).collect();
        assert_eq!(errors[0], errors[1]);
        assert!(errors[0].contains("rank 1's residual + gradient of key 'w'") && errors[0].contains("nothing was applied"), "{}", errors[0]);
        assert_eq!(groups.iter().map(|g| g.save().unwrap()).collect::<Vec<_>>(), saved);
        // QSGD finds it through its shared scale, after the agreement: the same error.
        let q = params(&[("compress", "qsgd_mn_ts"), ("bits", "[2,4]")]);
        let groups: Vec<Group> = (0..2).map(|r| Group::new(q, r, 2, 0, 0.0).unwrap()).collect();
        let two = [("u", vec![20]), ("v", vec![4, 5])];
        push_all(&groups, &two, &grads(2, 40, 0));
        let saved: Vec<Vec<u8>> = groups.iter().map(|g| g.save().unwrap()).collect();
        let mut bad = grads(2, 40, 1);
        bad[0][33] = f32::INFINITY;
        let errors: Vec<String> = push_all(&groups, &two, &bad).into_iter().map(|r| r.unwrap_err().to_string()).collect();
        assert_eq!(errors[0], errors[1]);
        assert!(errors[0].contains("rank 0's gradient of key 'v'") && errors[0].contains("at push 1"), "{}", errors[0]);
        assert_eq!(groups.iter().map(|g| g.save().unwrap()).collect::<Vec<_>>(), saved);
        let again = push_all(&groups, &two, &grads(2, 40, 1)); // the job goes on
        assert!(again.iter().all(|r| r.is_ok()));
        // Another compression on rank 1.
        let other = [Group::new(c, 0, 2, 0, 0.0).unwrap(), Group::new(params(&[("compress", "2bit"), ("threshold", "0.5")]), 1, 2, 0, 0.0).unwrap()];
        let errors: Vec<String> = push_all(&other, &shapes, &grads(2, 20, 0)).into_iter().map(|r| r.unwrap_err().to_string()).collect();
        assert_eq!(errors[0], errors[1]);
        assert!(errors[0].contains("disagree on compression parameters"), "{}", errors[0]);
    }

    #[test]
    fn start_iter_and_min_rate_send_float32_sums_and_count_bytes() {
        let c = params(&[("compress", "qsgd_mn"), ("bits", "2")]);
        let groups: Vec<Group> = (0..2).map(|r| Group::new(c, r, 2, 1, 2.0).unwrap()).collect();
        // "tiny": 3 values cost more packed (a scale and a word) than half their floats.
        let shapes = [("big", vec![64]), ("tiny", vec![3])];
        let g = grads(2, 67, 0);
        let first = push_all(&groups, &shapes, &g);
        let plain: Vec<f32> = (0..67).map(|i| (g[0][i] + g[1][i]) / 2.0).collect();
        assert_eq!(first[0].as_ref().unwrap(), &plain); // push 0 < start_iter: plain
        let second = push_all(&groups, &shapes, &grads(2, 67, 1));
        let tiny: Vec<f32> = (64..67).map(|i| (grads(2, 67, 1)[0][i] + grads(2, 67, 1)[1][i]) / 2.0).collect();
        assert_eq!(&second[1].as_ref().unwrap()[64..], &tiny[..]);
        let s = groups[1].stats();
        assert_eq!((s.steps, s.compressed_steps, s.bytes_uncompressed), (2, 1, 2 * 4 * 67));
        // Each push: a 5-field agreement (40 floats); then 67 floats, or a scale, 64 codes in lanes and 3 floats.
        assert_eq!(s.bytes_sent, 2 * 160 + 4 * 67 + 4 + collective::codes_bytes(64, -3, 3, 2) + 4 * 3);
    }

    #[test]
    fn a_refused_first_push_registers_no_key() {
        let c = params(&[("compress", "2bit"), ("threshold", "0.25")]);
        let groups: Vec<Group> = (0..2).map(|r| Group::new(c, r, 2, 0, 0.0).unwrap()).collect();
        let fresh: Vec<Vec<u8>> = groups.iter().map(|g| g.save().unwrap()).collect();
        let mut bad = grads(2, 20, 0);
        bad[0][3] = f32::NAN;
        assert!(push_all(&groups, &[("w", vec![20])], &bad).iter().all(|r| r.is_err()));
        assert_eq!(groups.iter().map(|g| g.save().unwrap()).collect::<Vec<_>>(), fresh, "no key 'w' after the refused push");
        // Still fresh: a checkpoint of other keys loads (a registered 'w' would be "pushed here but not in the compression states").
        let other: Vec<Group> = (0..2).map(|r| Group::new(c, r, 2, 0, 0.0).unwrap()).collect();
        push_all(&other, &[("v", vec![8])], &grads(2, 8, 0));
        for (g, o) in groups.iter().zip(&other) {
            g.load(&o.save().unwrap()).unwrap();
        }
    }

    #[test]
    fn a_checkpoint_with_a_non_finite_state_or_an_overflowing_shape_is_refused_whole() {
        for (c, what) in [(params(&[("compress", "powersgd"), ("rank", "1")]), "PowerSGD Q"), (params(&[("compress", "1bit")]), "residual")] {
            let group = Group::new(c, 0, 1, 0, 0.0).unwrap();
            push_all(std::slice::from_ref(&group), &[("m", vec![4, 5])], &grads(1, 20, 0));
            let blob = group.save().unwrap();
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut saved = checkpoint::decode(&blob).unwrap();
                let state = &mut saved.keys[0].states[0];
                let values = if what == "PowerSGD Q" { &mut state.q } else { &mut state.residual };
                values[1] = bad;
                let err = group.load(&checkpoint::encode(&saved)).unwrap_err().to_string();
                assert_eq!(err, format!("optimizer states: key 'm': its saved {what} holds {bad} at element 1, a non-finite value"));
                assert_eq!(group.save().unwrap(), blob, "unchanged");
                // A fresh group refuses it too.
                assert!(Group::new(c, 0, 1, 0, 0.0).unwrap().load(&checkpoint::encode(&saved)).is_err());
            }
        }
        // A shape whose product overflows (2^62 x 8 wraps to 0, fitting empty states).
        let c = params(&[("compress", "1bit")]);
        let fresh = Group::new(c, 0, 1, 0, 0.0).unwrap();
        let mut saved = checkpoint::decode(&fresh.save().unwrap()).unwrap();
        saved.keys.push(KeyState { key: Key::Str("huge".into()), shape: vec![1 << 62, 8], pushes: 3, residuals: Vec::new(), states: vec![scheme::State::default()] });
        let err = fresh.load(&checkpoint::encode(&saved)).unwrap_err().to_string();
        assert!(err.contains("key 'huge': saved with shape [4611686018427387904, 8], more elements than any array can hold"), "{err}");
        assert_eq!(fresh.save().unwrap(), Group::new(c, 0, 1, 0, 0.0).unwrap().save().unwrap());
    }

    #[test]
    fn a_world_too_large_for_the_code_sum_is_named() {
        let two = params(&[("compress", "2bit"), ("threshold", "0.5")]);
        assert!(Group::new(two, 0, 46340, 0, 0.0).is_ok());
        for world in [46341, 1 << 31, 1 << 40, usize::MAX] {
            let err = Group::new(two, 0, world, 0, 0.0).err().unwrap().to_string();
            assert_eq!(err, format!("invalid parameter 'process_group': a world of {world} ranks: 2bit sums every rank's codes in 32-bit lanes, which hold the sum of at most 46340 ranks"));
        }
        let one = params(&[("compress", "1bit")]);
        assert!(Group::new(one, 0, i32::MAX as usize, 0, 0.0).is_ok());
        assert!(Group::new(one, 0, 1 << 31, 0, 0.0).err().unwrap().to_string().contains("at most 2147483647 ranks"));
    }

    #[test]
    fn saved_states_resume_and_a_blob_of_another_setting_is_refused_whole() {
        let c = params(&[("compress", "powersgd"), ("rank", "1")]);
        let group = Group::new(c, 0, 1, 0, 0.0).unwrap();
        push_all(std::slice::from_ref(&group), &[("m", vec![4, 5])], &grads(1, 20, 0));
        let blob = group.save().unwrap();
        let resumed = Group::new(c, 0, 1, 0, 0.0).unwrap();
        resumed.load(&blob).unwrap();
        let a = push_all(std::slice::from_ref(&group), &[("m", vec![4, 5])], &grads(1, 20, 1));
        let b = push_all(std::slice::from_ref(&resumed), &[("m", vec![4, 5])], &grads(1, 20, 1));
        assert_eq!(a[0].as_ref().unwrap(), b[0].as_ref().unwrap());
        let wrong_shape = Group::new(c, 0, 1, 0, 0.0).unwrap();
        wrong_shape.load(&blob).unwrap(); // fresh: checked at the first push
        let err = push_all(std::slice::from_ref(&wrong_shape), &[("m", vec![5, 4])], &grads(1, 20, 1)).remove(0).unwrap_err().to_string();
        assert!(err.contains("loaded from a checkpoint with shape [4, 5], pushed now with [5, 4]"), "{err}");
        let other = Group::new(params(&[("compress", "powersgd"), ("rank", "2")]), 0, 1, 0, 0.0).unwrap();
        assert!(other.load(&blob).unwrap_err().to_string().contains("saved with PowerSgd"));
        let two = Group::new(c, 0, 2, 0, 0.0).unwrap();
        assert!(two.load(&blob).unwrap_err().to_string().contains("worker 0 of 1, this is worker 0 of 2"));
        assert!(Group::new(params(&[("compress", "grandk_mn"), ("bits", "2"), ("k", "3"), ("unselected", "local")]), 0, 2, 0, 0.0).is_err());
        assert!(Group::new(c, 2, 2, 0, 0.0).is_err() && Group::new(c, 0, 1, 0, f64::NAN).is_err());
    }
}
