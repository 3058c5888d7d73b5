//! Compression for a process group whose all-reduces the caller performs
//! (`torch.distributed` under `gradpack.torch`'s DDP communication hook):
//! each rank holds its own tensors' states, keyed by name; a bucket of
//! tensors is encoded here, its exchanges are handed to the caller's
//! `Engine` one blocking all-reduce at a time (batched over the bucket's
//! tensors), its final contributions come back as buffers for the caller to
//! SUM asynchronously, and `decode` turns the sums into every rank's
//! identical result: the sum over ranks divided by the world size.
//!
//! The scheme path is the stores' (`quant::scheme`): the same gradients,
//! seed, key and step give the bits the device store gives with one device
//! per rank. Every rank must hold the same bucket layout, push counts and
//! settings, and finite gradients; the check costs no round of its own once
//! a group knows which bucket comes next (`check`):
//!
//! - The group remembers, for each bucket, the one that followed it (its
//!   layout and push counts): the `Plan` every rank expects next, which
//!   fixes the sizes of the bucket's collectives. With no plan (the first
//!   call, or a bucket never seen after the previous one) every rank agrees
//!   first in one blocking round (`check::agree`).
//! - With a plan, the check rides at the end of the bucket's final sum of
//!   64-bit words (`check::tail`), and `decode` reads it before it changes
//!   anything: a difference or a non-finite gradient is the same error on
//!   every rank, and every state stays as it was (schemes commit on
//!   `scheme::finish`).
//! - A rank whose bucket is not the one planned (another layout, a
//!   checkpoint loaded with other push counts, a key refused) sends stand-in
//!   zeros of the planned sizes instead, so no collective ever mismatches,
//!   and reads the tail at once: when every rank did so for the same new
//!   bucket, every rank runs it for real; otherwise each raises the error.
//!
//! Owns: keyed states, the plans, byte counts, checkpoints. Knows nothing
//! of Python or torch.

mod batch;
mod check;
mod owners;
mod scatter;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::key::Key;
use crate::quant::collective;
use crate::quant::compression::Compression;
use crate::quant::{qsgd, scheme};
use crate::store::checkpoint::{self, KeyState, Saved};
use crate::store::checks::elements;

use check::{Mine, Verdict, TAIL_WORDS};
pub use check::Own;
pub use crate::quant::engine::{Buffer, Engine, Lanes, ReduceOp};
pub use owners::Exchange;

/// The most values of a plain bucket of several tensors summed as a copy
/// with its check at the end (`Group::tail_in_floats`): 1 MiB, DDP's first
/// bucket; a larger one is summed in place.
const PLAIN_COPY_MAX: usize = 1 << 18;

/// One tensor of a bucket: its key, shape and float32 gradient.
pub struct Tensor<'a> {
    pub key: Key,
    pub shape: Vec<usize>,
    pub grad: &'a [f32],
}

/// What the group has sent and done (`State.stats()`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Bytes this rank handed the engine (agreements and tails included).
    pub bytes_sent: u64,
    /// Bytes a float32 all-reduce of the same tensors would have handed it.
    pub bytes_uncompressed: u64,
    /// Buckets marked last (a training step's), or standalone pushes.
    pub steps: u64,
    /// Of those steps, the ones in which any tensor was compressed.
    pub compressed_steps: u64,
    /// Blocking agreement rounds run (the first call, new buckets, failures).
    pub agreements: u64,
    /// Compressed buckets go through the owners exchange (`owners`), not lanes.
    pub owners: bool,
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

/// The bucket every rank expects after another: its layout's hash, its
/// tensors' shapes and push counts.
#[derive(Clone, Debug)]
struct Plan {
    layout: u64,
    shapes: Vec<Vec<usize>>,
    steps: Vec<u64>,
    /// The keys' stable hashes (a random-K selection's pieces under the
    /// reduce-scatter follow them).
    keys: Vec<u64>,
}

/// What every rank knows alike: the last bucket run and the plan after each.
#[derive(Default)]
struct Plans {
    prev: u64,
    next: HashMap<u64, Plan>,
}

impl Plans {
    /// Records that the bucket `plan` followed the previous one and will
    /// follow it again with every count one higher.
    fn record(&mut self, plan: &Plan) {
        let next = Plan { steps: plan.steps.iter().map(|s| s.wrapping_add(1)).collect(), ..plan.clone() };
        self.next.insert(self.prev, next);
        self.prev = plan.layout;
    }
}

/// A process group's compression on one rank.
pub struct Group {
    compression: Compression,
    /// `fingerprint` of the compression and of the other settings, agreed by every rank.
    fingerprint: u64,
    settings: u64,
    rank: usize,
    world: usize,
    /// Pushes of a key before it is compressed (plain sums until then).
    start_iter: u64,
    /// A tensor is compressed only when its bytes would be at least this
    /// many times fewer.
    min_rate: f64,
    keys: Arc<Mutex<Keys>>,
    plans: Mutex<Plans>,
    /// `compressed_bytes` by shape.
    wire: Mutex<HashMap<Vec<usize>, u64>>,
    /// Compressed buckets take the owners exchange (`with_exchange`).
    owners: bool,
    /// Each rank decodes only its rows of each tensor (`Exchange::Scatter`).
    scatter: bool,
}

/// How one tensor of a pending bucket travels.
enum Route {
    /// Summed as float32 values: `floats[range]`, or the caller's bucket
    /// itself when the whole bucket is plain.
    Plain(Range<usize>),
    /// Compressed: the exchanged values, where its final contribution lies
    /// (packed words or float32 values), and (the reduce-scatter) the
    /// elements this rank decodes, its rows (`scatter::rows`).
    Compressed { exchanged: Vec<scheme::Part>, last: Final, rows: Option<Range<usize>> },
}

enum Final {
    /// Codes in lanes for every rank's sum, or (owners exchange) for one
    /// member: every rank's codes as the owners rounded them.
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
    /// Where the entry goes back to when the bucket is not decoded (a key
    /// pushed for the first time is then not registered).
    origin: Origin,
    /// The tensor's elements in the bucket.
    at: Range<usize>,
    route: Route,
    /// The summed final part, once `decode_held` wrote the result: what
    /// `commit` hands the scheme (`scheme::finish`).
    summed: Option<scheme::Part>,
}

/// A bucket between `encode` and `decode`: the caller SUMs `words`, then
/// `floats` (or, when `plain`, the bucket itself), on every rank, and hands
/// the sums back to `decode`. `words` ends with the bucket's check (its
/// tail). Dropped without `decode`, it returns its keys' states unchanged.
pub struct Pending {
    keys: Arc<Mutex<Keys>>,
    tensors: Vec<PendingKey>,
    /// Final packed contributions, every compressed tensor's words in turn, then the tail.
    pub words: Vec<u64>,
    /// Final float32 contributions (uncompressed tensors of a mixed bucket,
    /// PowerSGD's Q).
    pub floats: Vec<f32>,
    /// Nothing compressed: the caller sums its bucket in place instead of `floats`.
    pub plain: bool,
    /// `words` arrived whole already (the owners exchange, then the tails'
    /// sum): the caller sums only `floats`.
    pub summed: bool,
    /// Members whose sums the final codes hold once summed: the world, or
    /// (the owners exchange) `owners::RESOLUTION` at most.
    members: usize,
    /// The tail ends `floats` instead (`words` empty): a bucket of plain
    /// tensors, sent whole as float32 in one all-reduce.
    tail_in_floats: bool,
    len: usize,
    last: bool,
    /// The error `decode` returns: this rank sent stand-ins and learnt the
    /// verdict at once, but raises it where every other rank does (a rank
    /// that stopped early would leave the others waiting in later buckets).
    doomed: Option<Error>,
    /// `decode_held` wrote the result; `commit` may change the states.
    decoded: bool,
}

/// What `exchange` built for a bucket.
struct Built {
    routes: Vec<Route>,
    words: Vec<u64>,
    floats: Vec<f32>,
    plain: bool,
    summed: bool,
    /// Members whose sums the final codes hold (`Pending::members`).
    members: usize,
    tail_in_floats: bool,
    doomed: Option<Error>,
}

impl Built {
    /// A bucket whose stand-ins were summed already: nothing left to sum.
    fn doomed(err: Error, tensors: usize) -> Built {
        Built { routes: (0..tensors).map(|_| Route::Plain(0..0)).collect(), words: Vec::new(), floats: Vec::new(), plain: false, summed: false, members: 0, tail_in_floats: false, doomed: Some(err) }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn layout_of<'a>(shapes: impl Iterator<Item = (u64, &'a [usize])>) -> u64 {
    crate::hash::finalize(shapes.fold(0x6770_6275_636b_6574, |h: u64, (key, shape)| {
        let h = crate::hash::finalize(h ^ key);
        shape.iter().fold(crate::hash::finalize(h ^ shape.len() as u64), |h, &d| crate::hash::finalize(h ^ d as u64))
    }))
}

fn counts_of(steps: &[u64]) -> u64 {
    steps.iter().fold(0u64, |h, &s| crate::hash::finalize(h ^ s))
}

/// A scheme error every rank meets alike (a non-finite shared scale or
/// factor), after which every rank can take part in one more round.
fn shared(err: &Error) -> bool {
    !matches!(err, Error::Transport(_) | Error::Internal(_))
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
        // Every integer scheme sums every rank's codes in lanes of at most 31
        // bits (its `final_codes` summed over the world must fit, as a push
        // checks): refused here rather than at every push.
        let limit = match &compression {
            Compression::TwoBit(_) | Compression::OneBit { .. } | Compression::Qsgd(_) => {
                Some(max_ranks(|w| scheme::final_codes(&compression, w).and_then(|(lo, hi)| collective::sum_width(lo, hi, w)).is_some()))
            }
            _ => None,
        };
        if let Some(limit) = limit.filter(|&l| world > l) {
            return Err(Error::InvalidParam {
                key: "process_group".into(),
                problem: format!("a world of {world} ranks: {} sums every rank's codes in 32-bit lanes, which hold the sum of at most {limit} ranks", compression.name()),
            });
        }
        let fingerprint = crate::hash::fingerprint(&format!("{compression:?}"));
        let settings = crate::hash::fingerprint(&format!("{world} {start_iter} {min_rate}"));
        Ok(Group { compression, fingerprint, settings, rank, world, start_iter, min_rate, keys: Arc::default(), plans: Mutex::default(), wire: Mutex::default(), owners: false, scatter: false })
    }

    /// The group with its compressed buckets sent as `exchange` says
    /// (`Exchange::choose`); every rank must choose alike (their settings
    /// are compared at the first bucket).
    pub fn with_exchange(mut self, exchange: Exchange) -> Result<Group> {
        self.owners = exchange.choose(&self.compression, self.world)?;
        self.scatter = exchange == Exchange::Scatter;
        self.settings = crate::hash::fingerprint(&format!("{} {} {} {} {}", self.world, self.start_iter, self.min_rate, self.owners, self.scatter));
        self.wire = Mutex::default();
        lock(&self.keys).stats.owners = self.owners;
        Ok(self)
    }

    pub fn stats(&self) -> Stats {
        lock(&self.keys).stats
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// A collective over `engine` whose final lanes hold this group's sums.
    fn lanes<'e>(&self, engine: &'e mut dyn Engine) -> Lanes<&'e mut dyn Engine> {
        let mut coll = Lanes::new(engine, self.world);
        if self.owners || self.scatter {
            coll.lanes_for = 1;
        }
        coll
    }

    /// Whether a push of a key with `pushes` pushes so far is compressed.
    fn compresses(&self, shape: &[usize], pushes: u64) -> bool {
        let n: usize = shape.iter().product();
        if self.compression.is_none() || pushes < self.start_iter || n == 0 {
            return false;
        }
        if let Compression::PowerSgd { rank, .. } = self.compression {
            if crate::quant::powersgd::factors(shape, rank as usize).is_none() {
                return false; // a vector: PowerSGD sums it as it is
            }
        }
        self.compressed_bytes(shape) as f64 * self.min_rate <= collective::f32_bytes(n) as f64
    }

    /// The bytes this rank hands the engine for a compressed push of
    /// `shape` (its exchanges and final part), as the scheme's own encode
    /// sends them: measured once per shape on zeros, through an engine that
    /// only counts. A shape the scheme refuses is never compressed.
    fn compressed_bytes(&self, shape: &[usize]) -> u64 {
        if let Some(&bytes) = lock(&self.wire).get(shape) {
            return bytes;
        }
        struct Counting;
        impl Engine for Counting {
            fn all_reduce(&mut self, _: ReduceOp, _: Buffer<'_>) -> Result<()> {
                Ok(())
            }
        }
        let zeros = vec![0f32; shape.iter().product()];
        let mut state = scheme::State::default();
        let mut counting = Counting;
        let mut coll = self.lanes(&mut counting);
        let bytes = match scheme::encode(&self.compression, std::slice::from_mut(&mut state), &[&zeros], &self.ctx(0, shape, 0), &mut coll) {
            // (the owners exchange: the codes once and a 1/world share of the sums again)
            // (the reduce-scatter: every code once, in lanes for one member)
            Ok((_, scheme::Part::Packed { words, .. })) if self.scatter => coll.sent + 8 * words.len() as u64,
            Ok((_, scheme::Part::Packed { words, n, .. })) if self.owners => coll.sent + 8 * words.len() as u64 + 8 * owners::sums_words(&self.compression, n, self.world).div_ceil(self.world) as u64,
            Ok((_, scheme::Part::Packed { words, .. })) => coll.sent + 8 * words.len() as u64,
            Ok((_, scheme::Part::F32(x))) => coll.sent + collective::f32_bytes(x.len()),
            _ => u64::MAX,
        };
        lock(&self.wire).insert(shape.to_vec(), bytes);
        bytes
    }

    /// Takes the bucket's keys out of the idle map (new keys start fresh, or
    /// from a loaded checkpoint), checking shapes; with where each came
    /// from. A key refused takes nothing and says which and why.
    fn take(&self, tensors: &[Tensor]) -> std::result::Result<(Vec<Entry>, Vec<Origin>), (Own, usize)> {
        let mut keys = lock(&self.keys);
        for (i, t) in tensors.iter().enumerate() {
            if tensors[..i].iter().any(|u| u.key == t.key) || keys.in_flight.contains(&t.key) {
                return Err((Own::Twice, i));
            }
            if keys.idle.get(&t.key).is_some_and(|e| e.shape != t.shape) {
                return Err((Own::Reshaped, i));
            }
            if keys.loaded.get(&t.key).is_some_and(|e| e.shape != t.shape) {
                return Err((Own::Resaved, i));
            }
        }
        Ok(tensors
            .iter()
            .map(|t| {
                keys.in_flight.push(t.key.clone());
                match (keys.idle.remove(&t.key), keys.loaded.remove(&t.key)) {
                    (Some(e), _) => (e, Origin::Idle),
                    (None, Some(e)) => (e, Origin::Loaded),
                    (None, None) => (Entry { shape: t.shape.clone(), state: scheme::State::default() }, Origin::New),
                }
            })
            .unzip())
    }

    /// Puts entries back where `take` found them, after an encode or a
    /// decode that failed (or a bucket dropped): a key pushed for the first
    /// time is not registered, so the group is as if the call had never
    /// been made. `Origin::Idle` also returns a decoded bucket's entries.
    fn give_back(keys: &Mutex<Keys>, entries: impl IntoIterator<Item = (Key, Entry, Origin)>) {
        let mut keys = lock(keys);
        for (key, entry, origin) in entries {
            keys.in_flight.retain(|k| *k != key);
            match origin {
                Origin::Idle => drop(keys.idle.insert(key, entry)),
                Origin::Loaded => drop(keys.loaded.insert(key, entry)),
                Origin::New => {}
            }
        }
    }

    /// What the non-finite check reads for this compression.
    fn fault_what(&self) -> &'static str {
        if matches!(self.compression, Compression::TwoBit(_) | Compression::OneBit { .. }) { "residual + gradient" } else { "gradient" }
    }

    /// The index of the first compressed tensor whose gradient (2-bit:
    /// residual + gradient) holds a non-finite value. Tensors summed
    /// plainly are not checked: like torch's own all-reduce, they carry a
    /// NaN to every rank (where a loss scaler sees it).
    fn fault_index(&self, tensors: &[Tensor], entries: &[Entry], compress: &[bool]) -> Option<usize> {
        tensors.iter().zip(entries).zip(compress).position(|((t, e), &c)| {
            c && match &self.compression {
                // Named after its shared scale failed.
                Compression::Qsgd(_) => scheme::check_finite(&[t.grad]).is_err(),
                other => scheme::check_pushed(other, t.grad, Some(&e.state), "gradient").is_err(),
            }
        })
    }

    fn ctx<'a>(&self, key_hash: u64, shape: &'a [usize], step: u64) -> scheme::Ctx<'a> {
        scheme::Ctx { shape, step, key_hash, member: self.rank as u64, workers: self.world }
    }

    /// The error of a verdict, named with this bucket's keys and counts;
    /// on a rank that failed its own bucket (`own`) with a key named by its
    /// place, that key's own name after it.
    fn verdict_error(&self, v: &Verdict, tensors: &[Tensor], steps: &[u64], own: Option<(Own, usize)>) -> Error {
        let err = v
            .error(|i| tensors.get(i).map(|t| t.key.to_string()), |i| steps.get(i).copied().unwrap_or(0), self.fault_what())
            .unwrap_or_else(|| Error::Store("gradpack: another rank sent stand-ins for this bucket; nothing was applied on any rank".into()));
        match (own, err) {
            (Some((Own::Twice, i)), Error::Store(text)) if v.own.1.is_some_and(|(r, _)| r == self.rank as u64) => {
                let key = tensors.get(i).map_or_else(|| "?".into(), |t| t.key.to_string());
                Error::Store(format!("{text} (on this rank: key {key})"))
            }
            (_, err) => err,
        }
    }

    /// Checks the bucket with every rank and runs its exchanges through
    /// `engine`; the caller sums what `Pending` holds and calls `decode`.
    /// `bucket_len` must be the tensors' elements together (they lie in
    /// the bucket one after another). `last`: the bucket ends a step.
    /// `tag`: what else every rank must hold alike for this bucket (0:
    /// nothing), compared with the settings (FSDP2's reduce op and divide
    /// factor, which scale each rank's own rows).
    pub fn encode(&self, tensors: &[Tensor], bucket_len: usize, last: bool, tag: u64, engine: &mut dyn Engine) -> Result<Pending> {
        check_count(tensors.len())?;
        // (None once a tensor's gradient is not its shape's)
        let mut total = Some(0usize);
        for (i, t) in tensors.iter().enumerate() {
            let n = elements(&t.shape).map_err(|e| Error::InvalidParam { key: "dims".into(), problem: format!("tensor {i} (key {}): {e}", t.key) })?;
            total = total.filter(|_| n == t.grad.len()).and_then(|a| a.checked_add(n));
        }
        if total != Some(bucket_len) {
            let shapes: Vec<_> = tensors.iter().map(|t| (t.key.to_string(), t.shape.clone(), t.grad.len())).collect();
            return Err(Error::InvalidParam { key: "bucket_len".into(), problem: format!("a bucket of {bucket_len} elements does not hold its tensors (key, shape, elements) {shapes:?}") });
        }
        let (mut entries, origins, own) = match self.take(tensors) {
            Ok((e, o)) => (e, o, None),
            Err(own) => (Vec::new(), Vec::new(), Some(own)),
        };
        let steps: Vec<u64> = if own.is_some() { vec![0; tensors.len()] } else { entries.iter().map(|e| e.state.step).collect() };
        let mine = self.mine(tensors, &steps, tag, own);
        let mut coll = self.lanes(engine);
        let built = self.exchange(tensors, &mut entries, &steps, mine, &mut coll);
        let mut keys = lock(&self.keys);
        keys.stats.bytes_sent += coll.sent;
        match built {
            Ok(b) => {
                // (summed words were counted as the exchange handed them over)
                let final_bytes = 8 * b.words.len() as u64 * !b.summed as u64 + if b.plain { collective::f32_bytes(bucket_len) } else { 4 * b.floats.len() as u64 };
                keys.stats.bytes_sent += final_bytes;
                keys.stats.bytes_uncompressed += collective::f32_bytes(bucket_len) * b.doomed.is_none() as u64;
                drop(keys);
                let mut pending = Pending { keys: self.keys.clone(), tensors: Vec::with_capacity(tensors.len()), words: b.words, floats: b.floats, plain: b.plain, summed: b.summed, members: b.members, tail_in_floats: b.tail_in_floats, len: bucket_len, last, doomed: b.doomed, decoded: false };
                let mut at = 0;
                for (((t, entry), route), origin) in tensors.iter().zip(entries).zip(b.routes).zip(origins) {
                    let n = t.grad.len();
                    pending.tensors.push(PendingKey { key: t.key.clone(), entry, origin, at: at..at + n, route, summed: None });
                    at += n;
                }
                Ok(pending)
            }
            Err(err) => {
                drop(keys);
                Group::give_back(&self.keys, tensors.iter().zip(entries).zip(origins).map(|((t, e), o)| (t.key.clone(), e, o)));
                Err(err)
            }
        }
    }

    /// Takes this rank's part in a bucket that its front refused before
    /// encoding it (`own`: a dtype, a device, a key; tensor `index`), so
    /// that no other rank waits for it: the agreement, or stand-ins of the
    /// planned bucket, carry the refusal to every rank, which all fail
    /// with the same error. `tensors` name the bucket as far as the front
    /// could read it (their gradients are not read). Returns that error;
    /// nothing changed.
    pub fn refuse(&self, tensors: &[Tensor], own: Own, index: usize, engine: &mut dyn Engine) -> Error {
        if let Err(e) = check_count(tensors.len()) {
            return e;
        }
        if index >= tensors.len() {
            return Error::InvalidParam { key: "index".into(), problem: format!("tensor {index} of a bucket of {} tensors", tensors.len()) };
        }
        let steps = vec![0; tensors.len()];
        let mine = self.mine(tensors, &steps, 0, Some((own, index)));
        let mut coll = self.lanes(engine);
        // (a rank's own failure is never run: `exchange` reads no entry)
        let built = self.exchange(tensors, &mut [], &steps, mine, &mut coll);
        lock(&self.keys).stats.bytes_sent += coll.sent;
        match built {
            Ok(Built { doomed: Some(err), .. }) | Err(err) => err,
            Ok(_) => Error::Internal("a refused bucket was run".into()),
        }
    }

    /// This rank's side of a bucket's agreement: its layout, push counts,
    /// compression and settings (with the bucket's `tag`), and its own failure.
    fn mine(&self, tensors: &[Tensor], steps: &[u64], tag: u64, own: Option<(Own, usize)>) -> Mine {
        let layout = layout_of(tensors.iter().map(|t| (t.key.stable_hash(), &t.shape[..])));
        let settings = if tag == 0 { self.settings } else { crate::hash::finalize(self.settings ^ tag) };
        Mine { fields: [layout, counts_of(steps), self.fingerprint, settings], flagged: false, own, fault: None }
    }

    /// Chooses how the bucket is checked (module docs) and runs it.
    fn exchange(&self, tensors: &[Tensor], entries: &mut [Entry], steps: &[u64], mine: Mine, coll: &mut Lanes<&mut dyn Engine>) -> Result<Built> {
        let planned = {
            let plans = lock(&self.plans);
            plans.next.get(&plans.prev).cloned()
        };
        let Some(plan) = planned else {
            lock(&self.keys).stats.agreements += 1;
            let v = check::agree(coll, &mine, self.rank)?;
            if !v.clean() {
                return Err(self.verdict_error(&v, tensors, steps, mine.own));
            }
            return self.run(tensors, entries, steps, mine, coll);
        };
        if mine.own.is_none() && plan.layout == mine.fields[0] && plan.steps == steps {
            return self.run(tensors, entries, steps, mine, coll);
        }
        let flagged = Mine { flagged: true, ..mine };
        match self.stand_in(&plan, flagged, coll)? {
            Ok(v) if v.flagged == self.world as u64 && v.differs.is_empty() && v.own.0 == 0 && v.fault.0 == 0 => {
                // Every rank sent stand-ins for the same new bucket: run it.
                self.run(tensors, entries, steps, mine, coll)
            }
            Ok(v) => {
                // The ranks that ran the planned bucket recorded it.
                lock(&self.plans).record(&plan);
                Ok(Built::doomed(self.verdict_error(&v, tensors, steps, mine.own), tensors.len()))
            }
            Err(v) => Err(self.verdict_error(&v, tensors, steps, mine.own)),
        }
    }

    /// Sends zeros of the planned bucket's sizes, summing its final parts
    /// here: the verdict from its tail (Ok), or from the agreement that
    /// follows an exchange failed on every rank (Err).
    fn stand_in(&self, plan: &Plan, mine: Mine, coll: &mut Lanes<&mut dyn Engine>) -> Result<std::result::Result<Verdict, Verdict>> {
        let sizes: Vec<usize> = plan.shapes.iter().map(|s| s.iter().product()).collect();
        let zeros = vec![0f32; sizes.iter().sum()];
        let mut states: Vec<scheme::State> = plan
            .steps
            .iter()
            .map(|&step| {
                let mut s = scheme::State::default();
                s.step = step;
                s
            })
            .collect();
        let compresses: Vec<bool> = plan.shapes.iter().zip(&plan.steps).map(|(s, &p)| self.compresses(s, p)).collect();
        let mut at = 0;
        let mut jobs = Vec::new();
        for ((((shape, &n), state), &c), &key) in plan.shapes.iter().zip(&sizes).zip(states.iter_mut()).zip(&compresses).zip(&plan.keys) {
            if c {
                jobs.push((self.ctx(key, shape, state.step), &zeros[at..at + n], state));
            }
            at += n;
        }
        let encoded = batch::encode(&self.compression, jobs, coll);
        if let Some(err) = encoded.iter().find_map(|r| r.as_ref().err()) {
            if !shared(err) {
                return Err(encoded.into_iter().find_map(Result::err).unwrap_or_else(|| Error::Internal("lost error".into())));
            }
            lock(&self.keys).stats.agreements += 1;
            return Ok(Err(check::agree(coll, &mine, self.rank)?));
        }
        let parts: Vec<scheme::Part> = encoded.into_iter().map(|r| r.map(|(_, part)| part)).collect::<Result<_>>()?;
        let (mut words, mut floats, mut spans, mut scattered) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut parts = parts.into_iter();
        let plain = !compresses.iter().any(|&c| c);
        for ((((&c, &n), &step), shape), &key) in compresses.iter().zip(&sizes).zip(&plan.steps).zip(&plan.shapes).zip(&plan.keys) {
            match (c, if c { parts.next() } else { None }) {
                (false, _) if !plain => floats.extend(std::iter::repeat_n(0f32, n)),
                (false, _) => {}
                (true, Some(scheme::Part::Packed { words: w, n, width, .. })) => {
                    let at = words.len()..words.len() + w.len();
                    if self.scatter {
                        scattered.push(self.scatter_span(at.clone(), n, width, shape, step, key));
                    }
                    spans.push(owners::Span { words: at, n, width, step, key_hash: 0 });
                    words.extend_from_slice(&w);
                }
                (true, Some(scheme::Part::F32(x))) => floats.extend_from_slice(&x),
                _ => return Err(Error::Internal("a scheme's final contribution is neither packed codes nor float32".into())),
            }
        }
        if self.tail_in_floats(plain, plan.shapes.len(), sizes.iter().sum()) {
            let mut bucket = if plain { zeros } else { floats };
            bucket.extend_from_slice(&check::tail_f32(&mine, self.rank));
            coll.reduce(ReduceOp::Sum, Buffer::F32(&mut bucket))?;
            return Ok(Ok(check::read_tail_f32(&bucket[bucket.len() - check::TAIL_FLOATS..], self.world)?));
        }
        let mut codes = words.len();
        words.extend_from_slice(&check::tail(&mine, self.rank));
        if self.owned(plain) {
            words = owners::exchange(coll, &self.compression, &spans, &words[..codes], &words[codes..], self.rank)?.words;
            codes = words.len() - TAIL_WORDS;
        } else if self.scattered(plain) {
            words = scatter::exchange(coll, &self.compression, &scattered, &words[..codes], &words[codes..], self.rank)?.words;
            codes = words.len() - TAIL_WORDS;
        } else {
            coll.reduce(ReduceOp::Sum, Buffer::U64(&mut words))?;
        }
        let mut bucket = if plain { zeros } else { floats };
        if !bucket.is_empty() {
            coll.reduce(ReduceOp::Sum, Buffer::F32(&mut bucket))?;
        }
        Ok(Ok(check::read_tail(&words[codes..], self.world)?))
    }

    /// Whether a bucket's check ends its float32 sum instead of its words,
    /// when there would be no other words: a bucket of several tensors that
    /// all go plainly, up to `PLAIN_COPY_MAX` values (then summed as a
    /// copy, not in place), or a PowerSGD bucket (Q is float32). One
    /// all-reduce fewer; the same on every rank (the planned sizes decide).
    /// A lone plain tensor (`allreduce_`) and a larger plain bucket are
    /// summed in place, as torch sums them, with the check in words: with 3
    /// or more ranks gloo's float32 rounding depends on the buffer's
    /// length, and copying tens of megabytes twice costs more than a
    /// second all-reduce of 39 words.
    /// Whether a bucket takes the owners exchange: something compressed,
    /// and the group chose it.
    fn owned(&self, plain: bool) -> bool {
        self.owners && !plain
    }

    /// Whether a bucket's words take the reduce-scatter: something
    /// compressed to integer codes (PowerSGD's final part is float32,
    /// summed whole, its tail among the floats), and the group chose it.
    fn scattered(&self, plain: bool) -> bool {
        self.scatter && !plain && !matches!(self.compression, Compression::PowerSgd { .. })
    }

    /// A tensor's codes in the reduce-scatter: each rank's piece of them.
    fn scatter_span(&self, words: Range<usize>, n: usize, width: u32, shape: &[usize], step: u64, key_hash: u64) -> scatter::Span {
        let slices: Vec<Range<usize>> = (0..self.world).map(|r| scatter::rows(shape, self.world, r)).collect();
        scatter::Span { words, n, width, pieces: scheme::pieces(&self.compression, step, key_hash, &slices) }
    }

    fn tail_in_floats(&self, plain: bool, tensors: usize, values: usize) -> bool {
        ((plain && tensors > 1 && values <= PLAIN_COPY_MAX) || matches!(self.compression, Compression::PowerSgd { .. })) && self.world <= check::FLOAT_TAIL_RANKS
    }

    /// Runs the bucket's exchanges for real and builds its final parts,
    /// recording it as the plan after the previous bucket.
    fn run(&self, tensors: &[Tensor], entries: &mut [Entry], steps: &[u64], mut mine: Mine, coll: &mut Lanes<&mut dyn Engine>) -> Result<Built> {
        let compresses: Vec<bool> = tensors.iter().zip(steps).map(|(t, &s)| self.compresses(&t.shape, s)).collect();
        // QSGD changes no state before its shared scale, which is not finite
        // on every rank when a rank's gradient is not: it is checked there
        // (no second read of the gradients); other schemes check first.
        let qsgd = matches!(self.compression, Compression::Qsgd(_));
        mine.fault = if qsgd { None } else { self.fault_index(tensors, entries, &compresses) };
        let mut jobs = Vec::new();
        for ((t, e), &compress) in tensors.iter().zip(entries.iter_mut()).zip(&compresses) {
            if compress {
                jobs.push((self.ctx(t.key.stable_hash(), &t.shape, e.state.step), t.grad, &mut e.state));
            }
        }
        let encoded = batch::encode(&self.compression, jobs, coll);
        if let Some(err) = encoded.iter().find_map(|r| r.as_ref().err()) {
            if !shared(err) {
                return Err(encoded.into_iter().find_map(Result::err).unwrap_or_else(|| Error::Internal("lost error".into())));
            }
            // Every rank met it (a non-finite shared scale or factor): name its cause alike everywhere.
            if qsgd {
                mine.fault = self.fault_index(tensors, entries, &compresses);
            }
            lock(&self.keys).stats.agreements += 1;
            let v = check::agree(coll, &mine, self.rank)?;
            return Err(if v.clean() { encoded.into_iter().find_map(Result::err).unwrap_or_else(|| Error::Internal("lost error".into())) } else { self.verdict_error(&v, tensors, steps, mine.own) });
        }
        let plain = !compresses.iter().any(|&c| c);
        let tail_in_floats = self.tail_in_floats(plain, tensors.len(), tensors.iter().map(|t| t.grad.len()).sum());
        let (mut words, mut floats, mut routes, mut spans, mut scattered) = (Vec::new(), Vec::new(), Vec::with_capacity(tensors.len()), Vec::new(), Vec::new());
        let mut encoded = encoded.into_iter().map(|r| r.expect("checked above"));
        for ((t, &compress), &step) in tensors.iter().zip(&compresses).zip(steps) {
            if !compress {
                let at = floats.len();
                if !plain || tail_in_floats {
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
                    spans.push(owners::Span { words: at..words.len(), n, width, step, key_hash: t.key.stable_hash() });
                    if self.scatter {
                        scattered.push(self.scatter_span(at..words.len(), n, width, &t.shape, step, t.key.stable_hash()));
                    }
                    Final::Packed { words: at..words.len(), n, lo, hi, width }
                }
                scheme::Part::F32(x) => {
                    let at = floats.len();
                    floats.extend_from_slice(&x);
                    Final::F32(at..floats.len())
                }
                _ => return Err(Error::Internal("a scheme's final contribution is neither packed codes nor float32".into())),
            };
            let rows = self.scatter.then(|| scatter::rows(&t.shape, self.world, self.rank));
            routes.push(Route::Compressed { exchanged, last, rows });
        }
        let codes = words.len();
        if tail_in_floats {
            floats.extend_from_slice(&check::tail_f32(&mine, self.rank));
        } else {
            words.extend_from_slice(&check::tail(&mine, self.rank));
        }
        lock(&self.plans).record(&Plan { layout: mine.fields[0], shapes: tensors.iter().map(|t| t.shape.clone()).collect(), steps: steps.to_vec(), keys: tensors.iter().map(|t| t.key.stable_hash()).collect() });
        let mut members = self.world;
        if self.owned(plain) {
            let owned = owners::exchange(coll, &self.compression, &spans, &words[..codes], &words[codes..], self.rank)?;
            // The codes now are sums of `members` members', in lanes of their own.
            let mut at = owned.spans.into_iter();
            for route in routes.iter_mut() {
                if let Route::Compressed { last: Final::Packed { words: w, hi, width, .. }, .. } = route {
                    (*w, *width, *hi) = at.next().ok_or_else(|| Error::Internal("a span missing from the owners exchange".into()))?;
                }
            }
            (words, members) = (owned.words, owned.members);
        } else if self.scattered(plain) {
            let got = scatter::exchange(coll, &self.compression, &scattered, &words[..codes], &words[codes..], self.rank)?;
            // The codes now are this rank's pieces, summed, in lanes of their own;
            // a tensor's scale indices are cut to its piece alike.
            let mut at = got.spans.into_iter().zip(&scattered);
            for route in routes.iter_mut() {
                if let Route::Compressed { exchanged, last: Final::Packed { words: w, n, hi, width, .. }, .. } = route {
                    let (sum, span) = at.next().ok_or_else(|| Error::Internal("a span missing from the reduce-scatter".into()))?;
                    let piece = span.pieces[self.rank].clone();
                    (*w, *width, *hi, *n) = (sum.0, sum.1, sum.2, piece.len());
                    for part in exchanged.iter_mut() {
                        if matches!(part, scheme::Part::Levels { .. }) {
                            *part = part.split(std::slice::from_ref(&piece))?.pop().ok_or_else(|| Error::Internal("a piece of scale indices".into()))?;
                        }
                    }
                }
            }
            words = got.words;
        }
        let summed = self.owned(plain) || self.scattered(plain);
        Ok(Built { routes, words, floats, plain: plain && !tail_in_floats, summed, members, tail_in_floats, doomed: None })
    }

    /// Reads a bucket's check once its sums have arrived, changing
    /// nothing: the error `decode` would return before it writes, the same
    /// on every rank. A caller that must agree with others before any state
    /// changes (the hierarchical exchange's node) checks first, then decodes.
    pub fn check(&self, pending: &Pending) -> Result<()> {
        if !Arc::ptr_eq(&pending.keys, &self.keys) {
            return Err(Error::InvalidParam { key: "pending".into(), problem: "a bucket encoded by another State".into() });
        }
        match &pending.doomed {
            Some(err) => Err(err.clone()),
            None => self.read_check(pending),
        }
    }

    fn read_check(&self, pending: &Pending) -> Result<()> {
        if pending.decoded {
            return Err(Error::InvalidParam { key: "pending".into(), problem: "a bucket already decoded (check it before decoding it)".into() });
        }
        let v = if pending.tail_in_floats {
            let Some(at) = pending.floats.len().checked_sub(check::TAIL_FLOATS) else {
                return Err(Error::Internal("a pending bucket without its tail".into()));
            };
            check::read_tail_f32(&pending.floats[at..], self.world)?
        } else {
            let Some(codes) = pending.words.len().checked_sub(TAIL_WORDS) else {
                return Err(Error::Internal("a pending bucket without its tail".into()));
            };
            check::read_tail(&pending.words[codes..], self.world)?
        };
        if !v.clean() {
            let names: Vec<String> = pending.tensors.iter().map(|t| t.key.to_string()).collect();
            let steps: Vec<u64> = pending.tensors.iter().map(|t| t.entry.state.step).collect();
            return Err(v
                .error(|i| names.get(i).cloned(), |i| steps.get(i).copied().unwrap_or(0), self.fault_what())
                .unwrap_or_else(|| Error::Store("gradpack: another rank sent stand-ins for this bucket; nothing was applied on any rank".into())));
        }
        // PowerSGD's summed Q, which `decode` multiplies out: a sum past
        // float32's range is found here, before anything is written, so
        // that `check` names every error `decode` could meet.
        if let Compression::PowerSgd { .. } = self.compression {
            for t in &pending.tensors {
                if let Route::Compressed { last: Final::F32(r), .. } = &t.route {
                    scheme::check_factor("Q", pending.floats.get(r.clone()).ok_or_else(|| Error::Internal("a pending bucket's Q past its floats".into()))?)?;
                }
            }
        }
        Ok(())
    }

    /// Turns the sums of a bucket's final contributions into its result,
    /// written to `bucket` (`plain`: the bucket already holds the float32
    /// sum): the sum over ranks divided by the world size, every rank's
    /// alike. Reads the bucket's check first: on any rank's difference or
    /// non-finite gradient every rank returns the same error and every
    /// state stays as it was. Consumes `pending`; its keys' states are
    /// back either way (`decode_held`, then `commit`).
    pub fn decode(&self, mut pending: Pending, bucket: &mut [f32]) -> Result<()> {
        self.decode_held(&mut pending, bucket)?;
        self.commit(pending)
    }

    /// `decode`'s first half: writes the result to `bucket` and changes no
    /// state; the bucket stays pending, its keys in flight, until `commit`
    /// (its states advance) or a drop (they stay as they were). A caller
    /// that decodes several buckets of one step commits them once every one
    /// decoded, so a failed step leaves every state as it was.
    pub fn decode_held(&self, pending: &mut Pending, bucket: &mut [f32]) -> Result<()> {
        if bucket.len() != pending.len {
            return Err(Error::SizeMismatch { what: "bucket", expected: pending.len, got: bucket.len() });
        }
        if !Arc::ptr_eq(&pending.keys, &self.keys) {
            return Err(Error::InvalidParam { key: "pending".into(), problem: "a bucket encoded by another State".into() });
        }
        if pending.decoded {
            return Err(Error::InvalidParam { key: "pending".into(), problem: "a bucket decoded twice".into() });
        }
        if let Some(err) = &pending.doomed {
            return Err(err.clone());
        }
        self.read_check(pending)?;
        let world = self.world as f32;
        // The owners exchange's codes are sums of `members` members': divided by that.
        let members = pending.members;
        let (words, floats) = (&pending.words, &pending.floats);
        for t in pending.tensors.iter_mut() {
            let mut out = &mut bucket[t.at.clone()];
            let mut mean = false;
            match &t.route {
                Route::Plain(r) => {
                    if !pending.plain {
                        out.copy_from_slice(&floats[r.clone()]);
                    }
                }
                Route::Compressed { exchanged, last, rows } => {
                    let part = match last {
                        Final::Packed { words: w, n, lo, hi, width } => scheme::Part::Packed { words: words[w.clone()].to_vec(), n: *n, lo: *lo, hi: *hi, count: members as u32, width: *width },
                        Final::F32(r) => scheme::Part::F32(floats[r.clone()].to_vec()),
                    };
                    mean = matches!(last, Final::Packed { .. }) && members != self.world;
                    let ctx = scheme::Ctx { workers: if mean { members } else { self.world }, ..self.ctx(t.key.stable_hash(), &t.entry.shape, t.entry.state.step) };
                    // (the reduce-scatter: this rank's rows alone; the others stay as they were)
                    let offset = rows.as_ref().map_or(0, |r| r.start);
                    if let Some(r) = rows {
                        out = &mut out[r.clone()];
                    }
                    // A failure here changes no state: `commit` finishes every tensor or none.
                    scheme::decode_slice(&self.compression, exchanged, &part, &ctx, offset, out)?;
                    t.summed = Some(part);
                }
            }
            let by = if mean { members as f32 } else { world };
            crate::par::chunks(out, |_, piece| piece.iter_mut().for_each(|x| *x /= by));
        }
        pending.decoded = true;
        (pending.words, pending.floats) = (Vec::new(), Vec::new());
        Ok(())
    }

    /// `decode`'s second half: every tensor of a bucket that `decode_held`
    /// wrote advances its state (residuals, Q, push count) and returns
    /// to the group.
    pub fn commit(&self, mut pending: Pending) -> Result<()> {
        if !Arc::ptr_eq(&pending.keys, &self.keys) {
            return Err(Error::InvalidParam { key: "pending".into(), problem: "a bucket encoded by another State".into() });
        }
        if !pending.decoded {
            return Err(Error::InvalidParam { key: "pending".into(), problem: "a bucket committed before it was decoded".into() });
        }
        let mut compressed = false;
        for t in pending.tensors.iter_mut() {
            match &mut t.route {
                Route::Plain(_) => t.entry.state.step += 1,
                Route::Compressed { exchanged, .. } => {
                    compressed = true;
                    let part = t.summed.take().ok_or_else(|| Error::Internal("a decoded tensor without its sum".into()))?;
                    let states = std::slice::from_mut(&mut t.entry.state);
                    scheme::finish(&self.compression, states, part);
                    scheme::recycle(states, std::mem::take(exchanged));
                }
            }
            t.origin = Origin::Idle;
        }
        let mut keys = lock(&self.keys);
        keys.stats.steps += pending.last as u64;
        keys.stats.compressed_steps += (pending.last && compressed) as u64;
        Ok(())
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
    /// here already, each state's shapes), so a refused blob changes
    /// nothing. Push counts that differ from the other ranks' are found at
    /// the next bucket (its check), before anything changes.
    pub fn load(&self, blob: &[u8]) -> Result<()> {
        let saved = checkpoint::decode(blob)?;
        let mut keys = lock(&self.keys);
        if let Some(k) = keys.in_flight.first() {
            return Err(Error::Key { key: k.to_string(), problem: "its bucket is in flight: load a state between steps".into() });
        }
        // A key pushed here keeps its shape; any other (not pushed yet, or
        // only loaded) takes the saved one, checked at its first push.
        let saved_shapes: HashMap<&Key, &Vec<usize>> = saved.keys.iter().map(|k| (&k.key, &k.shape)).collect();
        let shape_here = |k: &Key| Ok(keys.idle.get(k).map_or_else(|| saved_shapes.get(k).map_or_else(Vec::new, |s| (*s).clone()), |e| e.shape.clone()));
        checkpoint::check(&saved, &self.compression, (self.rank as u64, self.world as u64), shape_here, |_| None)?;
        if let Some(k) = keys.idle.keys().find(|k| !saved_shapes.contains_key(k)) {
            return Err(Error::CompressionStates(format!("key {k}: pushed here but not in the compression states")));
        }
        // A rank keeps one scheme state a key: a blob of a store with
        // several devices (or 2-bit's per-device residuals) would lose all
        // but one of them.
        if let Some(k) = saved.keys.iter().find(|k| !k.residuals.is_empty() || k.states.len() > 1) {
            return Err(Error::CompressionStates(format!(
                "key {}: saved with {} residuals and {} scheme states, as a store with several devices keeps them; a gradpack.torch State keeps one state a key",
                k.key,
                k.residuals.len(),
                k.states.len()
            )));
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

/// The most tensors a bucket holds: its check names a tensor by its index
/// plus one, exactly, in float32 too (below 2^24).
pub const MAX_TENSORS: usize = (1 << 24) - 2;

fn check_count(tensors: usize) -> Result<()> {
    if tensors == 0 || tensors > MAX_TENSORS {
        return Err(Error::InvalidParam { key: "num".into(), problem: format!("a bucket of {tensors} tensors (1 to {MAX_TENSORS})") });
    }
    Ok(())
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

impl Pending {
    /// What the caller sums of `words`: all of them, or none when they
    /// arrived whole (`summed`).
    pub fn words_to_sum(&mut self) -> &mut [u64] {
        if self.summed { &mut [] } else { &mut self.words }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        Group::give_back(&self.keys, self.tensors.drain(..).map(|t| (t.key, t.entry, t.origin)));
    }
}
