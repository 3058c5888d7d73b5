//! The worker side of the distributed store (MXNet's KVStoreDist over
//! ps-lite's KVWorker): merges its devices, quantizes the merged gradient
//! with one residual per key and server slice, and sends only packed bytes;
//! pulls float32 slices back. Where a key lives is `slices`'; a scheme's
//! round is `scheme_client`'s.
//!
//! A `dist_sync` push returns once its local checks passed and its data is
//! on its way, as MXNet's push does: it never waits for the other workers'
//! pushes of the key, so workers may push keys in different orders. The
//! push stays in flight (`InFlight`) until the key's next push, pull or
//! checkpoint, or the next barrier, which wait for its round; a round that
//! failed after its push returned is raised by the key's next pull (or the
//! barrier), every worker alike.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use super::config::{Config, Role};
use super::message::{encode_pairs, f32_view, f32s_to_bytes, Command, Flag, Message, Meta};
use super::postoffice::Postoffice;
use super::scheme_client::{abort_round, RoundEnd, SchemeRound};
use super::slices::{reply_check, slices_for, slices_per_server, Slice};
use super::counts;
use crate::codec::{self, Grad};
use crate::error::{Error, Result};
use crate::store::checkpoint;
use crate::store::checks::{check_compress_before_init, check_outputs, check_push, check_shape, key_error, lock};
use crate::store::sum::{round_to_f16, sum_into};
use crate::store::{store_type, Array, ArrayMut, Key, Kind, Store};
use crate::quant::compression::Compression;
use crate::quant::scheme::{self, Part};

struct WorkerKey {
    shape: Vec<usize>,
    /// A float16 key: its sums and pulls are rounded to float16.
    half: bool,
    slices: Vec<Slice>,
    /// One residual per slice, allocated on the first compressed push.
    residuals: Vec<Vec<f32>>,
    /// The residuals before the push in flight: put back when its round
    /// fails (on the servers or another worker), as if it never happened.
    saved: Vec<Vec<f32>>,
    merge: Vec<f32>,
    /// A scheme's state (residual, PowerSGD's Q, push count), for the whole key whatever its slices.
    state: scheme::State,
    /// The state of the round in flight, swapped in when the servers accept
    /// it (its buffers are reused push after push).
    next: scheme::State,
    /// The value each slice's server sent with its answer to this worker's
    /// last scheme round (slice order): what a pull would fetch, until this
    /// worker pushes again (no round can end without it). None: pull asks.
    pulled: Option<Vec<Message>>,
    /// This key's push whose round has not ended yet.
    in_flight: Option<InFlight>,
    /// The error of a round that failed after its push returned: raised by
    /// the key's next pull, or by the next barrier.
    failed: Option<Error>,
}

/// A push still in flight (`DistWorker::settle` waits for it).
enum InFlight {
    /// A float32 or 2-bit push: its request, answered when the round ends;
    /// `undo`: 2-bit residuals to put back (`saved`) if the round fails.
    Push { id: u64, undo: bool },
    /// An abort this worker sent for its failed push (nothing to raise:
    /// the push already returned its error).
    Abort { id: u64 },
    /// A scheme round on its thread, which hands the key's state back.
    Scheme(std::thread::JoinHandle<RoundEnd>),
}

/// One server's answer to a pull, checked before any output is written.
enum PullReply<'a> {
    Float(std::borrow::Cow<'a, [f32]>),
    /// 2-bit code counts (`counts`).
    Counts(&'a [u8]),
    /// A scheme's decoded sum, as what it was decoded from.
    Scheme { step: u64, exchanged: Vec<Part>, sum: Part },
}
pub struct DistWorker {
    type_name: String,
    asynchronous: bool,
    post: Arc<Postoffice>,
    compression: RwLock<Compression>,
    keys: RwLock<HashMap<Key, Arc<Mutex<WorkerKey>>>>,
    str_keys: Mutex<Option<bool>>,
    closed: AtomicBool,
    /// Sync pushes this worker made (tried), for the barrier's agreement.
    pushes: AtomicU64,
    /// Pulls answered from the values a round brought back (`WorkerKey::pulled`).
    local_pulls: AtomicU64,
}

impl DistWorker {
    /// Joins the job described by `config` (a worker's) as a store of
    /// `type_name`, a parameter-server type of `store::STORE_TYPES`.
    pub fn start(type_name: &str, config: Config) -> Result<DistWorker> {
        let Some((_, Kind::ParamServer { asynchronous })) = store_type(type_name) else {
            return Err(Error::Store(format!("unknown distributed KVStore type '{type_name}'")));
        };
        if config.role != Role::Worker {
            return Err(Error::Store(format!("a {} process serves; only workers create a '{type_name}' store", config.role.name())));
        }
        let post = Postoffice::start(config, None)?;
        Ok(DistWorker {
            type_name: type_name.to_string(),
            asynchronous,
            post,
            compression: RwLock::default(),
            keys: RwLock::default(),
            str_keys: Mutex::default(),
            closed: AtomicBool::new(false),
            pushes: AtomicU64::new(0),
            local_pulls: AtomicU64::new(0),
        })
    }

    pub fn type_name(&self) -> &str {
        &self.type_name
    }

    pub fn rank(&self) -> usize {
        self.post.me.rank
    }

    pub fn num_workers(&self) -> usize {
        self.post.config.num_workers
    }

    pub fn barrier(&self) -> Result<()> {
        self.barrier_with(None)
    }

    /// The barrier, saying what every worker must agree on: the store type,
    /// the compression, the sync pushes so far (a worker that pushed more is
    /// stuck in a round the others will not join) and the key just
    /// initialized with its shape and dtype. This worker first waits for
    /// its pushes in flight (a scheme round sends its later exchanges only
    /// as the earlier ones end: the servers must not take this worker for
    /// absent meanwhile); then servers fail the rounds that wait for this
    /// worker, which is now in the barrier. Once every worker passed, the
    /// first kept failure of a round (by key) is this barrier's error.
    fn barrier_with(&self, init: Option<String>) -> Result<()> {
        self.settle_all()?;
        let mut state = format!("store type={}\ncompression={:?}\n", self.type_name, *self.compression.read().unwrap());
        if !self.asynchronous {
            state += &format!("sync pushes={}\n", self.pushes.load(Ordering::SeqCst));
            self.to_all_servers(Command::Barrier, String::new())?;
        }
        if let Some(init) = init {
            state += &format!("init={init}\n");
        }
        self.post.barrier(&state)?;
        for (key, entry) in self.entries() {
            if let Some(err) = lock(&key, &entry)?.failed.take() {
                return Err(err);
            }
        }
        Ok(())
    }

    /// (bytes sent, bytes received) by this node's transport.
    pub fn stats(&self) -> (u64, u64) {
        (self.post.bytes_sent(), self.post.bytes_received())
    }

    /// Pulls answered without asking the servers: a scheme round's servers
    /// send each slice's new value with their answer (when they keep the
    /// decoded sum, with no optimizer), and pulls until the next push use it.
    pub fn local_pulls(&self) -> u64 {
        self.local_pulls.load(Ordering::Relaxed)
    }

    /// Messages this worker received and dropped: unauthenticated, replayed,
    /// malformed or unexpected (each also logged, at most 10 a second).
    pub fn dropped(&self) -> u64 {
        self.post.dropped()
    }

    /// This worker's membership and transport (tests sign with it as the worker does).
    #[doc(hidden)]
    pub fn postoffice(&self) -> &Arc<Postoffice> {
        &self.post
    }

    /// Where this worker listens (host, port).
    pub fn address(&self) -> (String, u16) {
        (self.post.me.host.clone(), self.post.me.port)
    }

    /// Where the servers listen (host, port), by rank.
    pub fn server_addresses(&self) -> Vec<(String, u16)> {
        self.post.servers().iter().map(|n| (n.host.clone(), n.port)).collect()
    }

    fn servers(&self) -> Vec<i32> {
        self.post.servers().iter().map(|n| n.id).collect()
    }

    fn to_all_servers(&self, command: Command, body: String) -> Result<()> {
        let parts = self
            .servers()
            .into_iter()
            .map(|s| {
                let mut m = Meta::new(command, 0);
                m.body = body.clone();
                (s, m, Vec::new())
            })
            .collect();
        self.post.request(parts).map(|_| ())
    }

    /// Sets compression on every worker; rank 0 also tells the servers. Must
    /// come before the first init, as in MXNet.
    pub fn set_compress(&self, compression: Compression, params: &[(String, String)]) -> Result<()> {
        if compression.is_scheme() && self.asynchronous {
            return Err(Error::Store(format!(
                "'{}' compression needs every worker in each round (a shared scale or factor); use 'dist_sync' rather than '{}'",
                compression.name(),
                self.type_name
            )));
        }
        if let Compression::Qsgd(q) = compression {
            if q.keep_local {
                return Err(Error::Store(format!(
                    "'{}' with unselected='local' keeps each worker's own gradient, which a parameter server never sees; use it on 'device' or 'dist_sync_allreduce'",
                    q.name
                )));
            }
        }
        check_compress_before_init(self.keys.read().unwrap().len())?;
        if self.rank() == 0 {
            self.to_all_servers(Command::SetCompress, encode_pairs(params.iter().map(|(k, v)| (k.as_str(), v.as_str()))))?;
        }
        *self.compression.write().unwrap() = compression;
        Ok(())
    }

    /// Rank 0 sends the optimizer (gradpack's name and MXNet's parameters) to
    /// every server; servers then update on each aggregated push.
    pub fn set_optimizer(&self, name: &str, params: &[(String, String)]) -> Result<()> {
        // Validate here so every worker reports a bad optimizer, not just rank 0.
        crate::optimizer::Optimizer::from_params(name, params.iter().map(|(k, v)| (k.as_str(), v.as_str())))?;
        if self.rank() == 0 {
            let mut pairs = vec![("name".to_string(), name.to_string())];
            pairs.extend(params.iter().cloned());
            self.to_all_servers(Command::SetOptimizer, encode_pairs(pairs.iter().map(|(k, v)| (k.as_str(), v.as_str()))))?;
        }
        Ok(())
    }

    fn entry(&self, key: &Key) -> Result<Arc<Mutex<WorkerKey>>> {
        self.keys.read().unwrap().get(key).cloned().ok_or_else(|| key_error(key, "not initialized (call init first)"))
    }

    /// Initialises a key: rank 0 sends the value (lossless) to its servers,
    /// then every worker waits at a barrier.
    pub fn init(&self, key: &Key, value: Array) -> Result<()> {
        key.check()?;
        // A float16 value makes a float16 key: sent widened (exactly), and
        // the servers keep it as MXNet keeps float16 values.
        let (data, half) = match value.data {
            Grad::F32(d) => (std::borrow::Cow::Borrowed(d), false),
            Grad::F16(d) => (std::borrow::Cow::Owned(d.iter().map(|x| x.to_f32()).collect::<Vec<f32>>()), true),
            other => return Err(key_error(key, format!("init value has dtype {}, expected float32 or float16", other.dtype()))),
        };
        check_shape(key, "init value", value.shape, data.len(), value.shape)?;
        {
            let mut str_keys = self.str_keys.lock().unwrap();
            if let Some(s) = *str_keys {
                if s != key.is_str() {
                    return Err(key_error(key, format!("this store uses {} keys; int and string keys cannot be mixed", if s { "string" } else { "int" })));
                }
            }
            if self.keys.read().unwrap().contains_key(key) {
                return Err(key_error(key, "already initialized"));
            }
            *str_keys = Some(key.is_str());
        }
        // A scheme's key is cut where one worker's final codes fill whole lane groups.
        let compression = *self.compression.read().unwrap();
        let align = scheme::slice_align(&compression);
        let servers = self.servers();
        let per_server = slices_per_server(&compression, data.len(), servers.len(), self.post.config.partition_bytes);
        let slices = slices_for(key, data.len(), &servers, self.post.config.bigarray_bound, align, per_server);
        let widest = slices.iter().map(|s| s.len).max().unwrap_or(0);
        let frame = (widest as u64).saturating_mul(4).saturating_add(super::config::HEADER_BYTES as u64 + key.to_string().len() as u64);
        if frame > self.post.config.max_message_bytes as u64 {
            return Err(key_error(
                key,
                format!(
                    "a slice of {widest} float32 values ({frame} bytes with its header) exceeds GRADPACK_MAX_MESSAGE_BYTES={} on every node of this job: raise it, or add servers (MXNET_KVSTORE_BIGARRAY_BOUND splits keys over them)",
                    self.post.config.max_message_bytes
                ),
            ));
        }
        if self.rank() == 0 {
            let shape = value.shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(",");
            let parts = slices
                .iter()
                .map(|s| {
                    let mut m = s.meta(Command::Init, key);
                    m.body = encode_pairs([("shape", shape.as_str()), ("dtype", if half { "float16" } else { "float32" }), ("sync", if self.asynchronous { "0" } else { "1" })]);
                    (s.server, m, f32s_to_bytes(&data[s.offset..s.offset + s.len]))
                })
                .collect();
            self.post.request_checked(parts, reply_check(&slices))?;
        }
        let entry = WorkerKey { shape: value.shape.to_vec(), half, residuals: vec![Vec::new(); slices.len()], saved: Vec::new(), slices, merge: Vec::new(), state: scheme::State::default(), next: scheme::State::default(), pulled: None, in_flight: None, failed: None };
        self.keys.write().unwrap().insert(key.clone(), Arc::new(Mutex::new(entry)));
        self.barrier_with(Some(format!("key {key} of shape {:?} and dtype {}", value.shape, if half { "float16" } else { "float32" })))
    }

    /// Merges `values` (one per local device), then one push per server slice:
    /// packed 2-bit blocks when compression is set, else float32; under a
    /// scheme, its round on a thread of its own. Returns once the checks
    /// passed and the data is on its way (the module doc): the key's
    /// previous push is waited for first.
    pub fn push(&self, key: &Key, values: &[Array]) -> Result<()> {
        let entry = self.entry(key)?;
        if !self.asynchronous {
            self.pushes.fetch_add(1, Ordering::SeqCst);
        }
        let compression = *self.compression.read().unwrap();
        let mut guard = lock(key, &entry)?;
        let e = &mut *guard;
        self.settle(e); // its failure, if any, stays for the next pull
        e.pulled = None; // the value this push's round makes is not the last one's
        let mut checked = false;
        let pushed = self.push_checked(key, e, values, compression, &mut checked);
        if let Err(err) = &pushed {
            if !checked && !self.asynchronous {
                // The others wait for this worker in the round: its turn
                // fails the round for all of them, with this error's cause.
                let abort = if compression.is_scheme() {
                    abort_round(&self.post, key, &e.slices, &[], e.state.step, 0, err)
                } else {
                    let parts = e
                        .slices
                        .iter()
                        .map(|s| {
                            let mut m = s.meta(Command::Push, key);
                            m.set(Flag::Abort);
                            m.body = err.to_string();
                            (s.server, m, Vec::new())
                        })
                        .collect();
                    Some(self.post.request_later(parts, reply_check(&e.slices)))
                };
                if let Some(Ok(id)) = abort {
                    e.in_flight = Some(InFlight::Abort { id });
                }
            }
        }
        pushed
    }

    /// Waits for the key's push in flight, if any: a float32 or 2-bit round
    /// that failed puts the 2-bit residuals back; a scheme round hands the
    /// key's state back. A failure is kept for the next pull (`failed`; the
    /// first one, if several). Bounded as every wait of the postoffice is:
    /// a dead node or a lost request ends it within the heartbeat timeout.
    fn settle(&self, e: &mut WorkerKey) {
        let failure = match e.in_flight.take() {
            None => None,
            Some(InFlight::Abort { id }) => {
                let _ = self.post.wait(id);
                None
            }
            Some(InFlight::Push { id, undo }) => match self.post.wait(id) {
                Ok(_) => None,
                Err(err) => {
                    if undo {
                        std::mem::swap(&mut e.residuals, &mut e.saved);
                    }
                    Some(err)
                }
            },
            Some(InFlight::Scheme(round)) => match round.join() {
                Ok(end) => {
                    (e.state, e.next, e.merge, e.pulled) = (end.state, end.next, end.merged, end.pulled);
                    end.result.err()
                }
                // (the key's state went with the thread: the key starts afresh)
                Err(_) => Some(Error::Internal("a scheme round's thread panicked".into())),
            },
        };
        if let Some(err) = failure {
            e.failed.get_or_insert(err);
        }
    }

    /// Every key's entry, in key order (taken out of the map's lock).
    fn entries(&self) -> Vec<(Key, Arc<Mutex<WorkerKey>>)> {
        let mut entries: Vec<_> = self.keys.read().unwrap().iter().map(|(k, e)| (k.clone(), e.clone())).collect();
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        entries
    }

    /// `settle` on every key (a barrier, a checkpoint, the end).
    fn settle_all(&self) -> Result<()> {
        for (key, entry) in self.entries() {
            self.settle(&mut *lock(&key, &entry)?);
        }
        Ok(())
    }

    /// The push once the key is known: every check, then (`checked` set) the round.
    fn push_checked(&self, key: &Key, e: &mut WorkerKey, values: &[Array], compression: Compression, checked: &mut bool) -> Result<()> {
        check_push(key, values, &e.shape, compression, e.half)?;
        let n: usize = e.shape.iter().product();
        // One float32 device: push straight from its array, no merge copy
        // (a scheme's round, on its thread, takes a copy).
        let single = match values {
            [Array { data: Grad::F32(g), .. }] if !compression.is_scheme() => Some(*g),
            _ => None,
        };
        if single.is_none() {
            e.merge.resize(n, 0.0);
            let grads: Vec<Grad> = values.iter().map(|v| v.data).collect();
            sum_into(&mut e.merge, &grads, e.half);
        }
        if compression.is_scheme() {
            let workers = self.num_workers();
            scheme::check_input(&compression, std::slice::from_ref(&e.state), &[&e.merge], workers)?;
            // (QSGD's shared scale would fail every worker together, but only
            // inside the round: this worker says which element, now.)
            if let Compression::Qsgd(_) = compression {
                scheme::check_finite(&[&e.merge])?;
            }
            *checked = true;
            let (started, is_started) = std::sync::mpsc::channel();
            let round = SchemeRound {
                post: self.post.clone(),
                key: key.clone(),
                shape: e.shape.clone(),
                slices: e.slices.clone(),
                compression,
                rank: self.rank(),
                workers,
                state: std::mem::take(&mut e.state),
                next: std::mem::take(&mut e.next),
                merged: std::mem::take(&mut e.merge),
                started: Some(started),
            };
            match std::thread::Builder::new().name("gradpack-round".into()).spawn(move || round.run()) {
                Ok(handle) => e.in_flight = Some(InFlight::Scheme(handle)),
                Err(err) => return Err(Error::Store(format!("key {key}: cannot start its scheme round's thread: {err}"))),
            }
            // Until the round's first message is sent (or the round ended):
            // whatever this worker sends next reaches the servers after it.
            let _ = is_started.recv();
            return Ok(());
        }
        let part_of = |s: &Slice| match single {
            Some(g) => &g[s.offset..s.offset + s.len],
            None => &e.merge[s.offset..s.offset + s.len],
        };
        let mut payloads = Vec::with_capacity(e.slices.len());
        let two_bit = matches!(compression, Compression::TwoBit(_));
        if let Compression::TwoBit(th) = compression {
            // Out of place, every slice before any residual changes: the next
            // residuals land in `saved`, which is swapped in once all are finite
            // (and swapped back if the round fails).
            e.saved.resize_with(e.slices.len(), Vec::new);
            for ((s, residual), next) in e.slices.iter().zip(e.residuals.iter_mut()).zip(e.saved.iter_mut()) {
                residual.resize(s.len, 0.0); // a slice's first push starts from a zero residual
                next.resize(s.len, 0.0);
                let mut compr = codec::create_2bit(s.len);
                codec::quantize_2bit_to(part_of(s), residual, next, &mut compr, th).map_err(|err| match err {
                    Error::NonFinite { what, index, value } => key_error(key, Error::NonFinite { what: format!("merged {what}"), index: s.offset + index, value }.to_string()),
                    other => other,
                })?;
                payloads.push(f32s_to_bytes(&compr));
            }
            std::mem::swap(&mut e.residuals, &mut e.saved);
        }
        let mut parts = Vec::with_capacity(e.slices.len());
        for (i, s) in e.slices.iter().enumerate() {
            let mut m = s.meta(Command::Push, key);
            if self.asynchronous {
                m.set(Flag::Async);
            }
            let payload = match compression {
                Compression::None => f32s_to_bytes(part_of(s)),
                Compression::TwoBit(_) => {
                    m.set(Flag::Compressed);
                    std::mem::take(&mut payloads[i])
                }
                _ => unreachable!("refused by set_compress"),
            };
            parts.push((s.server, m, payload));
        }
        *checked = true;
        match self.post.request_later(parts, reply_check(&e.slices)) {
            Ok(id) => {
                e.in_flight = Some(InFlight::Push { id, undo: two_bit });
                Ok(())
            }
            Err(err) => {
                if two_bit {
                    std::mem::swap(&mut e.residuals, &mut e.saved);
                }
                Err(err)
            }
        }
    }

    /// Copies the servers' float32 value of `key` into every output.
    pub fn pull(&self, key: &Key, outs: &mut [ArrayMut]) -> Result<()> {
        let entry = self.entry(key)?;
        let mut e = lock(key, &entry)?;
        check_outputs(key, "pull", outs, &e.shape)?;
        self.settle(&mut e);
        if let Some(err) = e.failed.take() {
            return Err(err); // the round of an earlier push of this key
        }
        // The values this worker's last round brought back, else ask.
        let fetched;
        let replies = match &e.pulled {
            Some(values) => {
                self.local_pulls.fetch_add(1, Ordering::Relaxed);
                values
            }
            None => {
                let parts = e.slices.iter().map(|s| (s.server, s.meta(Command::Pull, key), Vec::new())).collect();
                fetched = self.post.request_checked(parts, reply_check(&e.slices))?;
                &fetched
            }
        };
        let n: usize = e.shape.iter().product();
        // Check every reply before writing any output.
        let mut views = Vec::with_capacity(replies.len());
        let mut covered = 0;
        let mut seen = vec![false; e.slices.len()];
        for r in replies {
            // Each reply is one slice's, from its server, once: together they cover the key.
            let (lo, len) = (r.meta.offset as usize, r.meta.len as usize);
            match e.slices.iter().position(|s| s.server == r.meta.sender && s.offset as u64 == r.meta.offset && s.len as u64 == r.meta.len) {
                Some(i) if !seen[i] => seen[i] = true,
                _ => return Err(Error::Transport(format!("malformed message: pull reply for key {key} from node {} about elements {}..+{} of {n}, which is no slice of it or was answered twice", r.meta.sender, r.meta.offset, r.meta.len))),
            }
            let reply = if r.meta.has(Flag::SchemeValue) {
                let (step, exchanged, sum) = scheme::value_from_wire(&r.data)?;
                PullReply::Scheme { step, exchanged, sum }
            } else if r.meta.has(Flag::CodeCounts) {
                counts::validate(&r.data, len)?;
                PullReply::Counts(&r.data)
            } else {
                let v = f32_view(&r.data)?;
                if v.len() != len {
                    return Err(Error::Transport(format!("malformed message: pull reply for key {key} has {} values for {len}", v.len())));
                }
                PullReply::Float(v)
            };
            covered += len;
            views.push((lo, len, reply));
        }
        if covered != n {
            return Err(Error::Transport(format!("pull of key {key} covered {covered} of {n} elements")));
        }
        let (first, rest) = outs.split_first_mut().unwrap();
        for (lo, len, reply) in &views {
            let dst = &mut first.data[*lo..*lo + *len];
            match reply {
                PullReply::Float(v) => dst.copy_from_slice(v),
                PullReply::Counts(data) => counts::decode(data, dst)?, // validated above
                PullReply::Scheme { step, exchanged, sum } => {
                    // decode checks every length before it writes
                    let compression = *self.compression.read().unwrap();
                    let ctx = scheme::Ctx { shape: &e.shape, step: *step, key_hash: key.stable_hash(), member: 0, workers: self.num_workers() };
                    scheme::decode_slice(&compression, exchanged, sum, &ctx, *lo, dst)?;
                }
            }
        }
        if e.half {
            round_to_f16(first.data); // the servers' float32 master copy (multi_precision), as float16
        }
        for o in rest {
            o.data.copy_from_slice(first.data);
        }
        Ok(())
    }

    /// This worker's compression state for a checkpoint ("GPCS" v1): each
    /// key's residual per server slice and scheme state. The optimizer's
    /// states live on the servers and are not part of it (as in MXNet).
    pub fn save_compression_states(&self) -> Result<Vec<u8>> {
        self.settle_all()?;
        let compression = *self.compression.read().unwrap();
        let keys = self.keys.read().unwrap();
        let mut sorted: Vec<(&Key, &Arc<Mutex<WorkerKey>>)> = if compression.is_none() { Vec::new() } else { keys.iter().collect() };
        sorted.sort_by(|a, b| a.0.cmp(b.0));
        let saved = sorted
            .into_iter()
            .map(|(key, entry)| {
                let e = lock(key, entry)?;
                Ok(checkpoint::KeyState { key: key.clone(), shape: e.shape.clone(), pushes: 0, residuals: e.residuals.clone(), states: vec![e.state.clone()] })
            })
            .collect::<Result<_>>()?;
        let (rank, workers) = (self.rank() as u64, self.num_workers() as u64);
        Ok(checkpoint::encode(&checkpoint::Saved { compression: format!("{compression:?}"), rank, workers, keys: saved }))
    }

    /// Loads what `save_compression_states` wrote on this worker; checked
    /// whole (compression, worker, every key's shape and slices) before any
    /// key changes. Keys it does not list start afresh.
    pub fn load_compression_states(&self, blob: &[u8]) -> Result<()> {
        let saved = checkpoint::decode(blob)?;
        self.settle_all()?; // a round in flight would hand its state back over the loaded one
        let compression = *self.compression.read().unwrap();
        let keys = self.keys.read().unwrap();
        // Every key's lock first: a poisoned one fails before anything changed.
        // Shapes come from these guards (a second read lock could wait on a writer).
        let mut guards = keys.iter().map(|(k, e)| lock(k, e).map(|g| (k, g))).collect::<Result<HashMap<_, _>>>()?;
        let slices_of = |k: &Key| guards.get(k).map(|e| e.slices.iter().map(|s| s.len).collect());
        let shape_of = |k: &Key| guards.get(k).map(|e| e.shape.clone()).ok_or_else(|| key_error(k, "not initialized"));
        checkpoint::check(&saved, &compression, (self.rank() as u64, self.num_workers() as u64), shape_of, slices_of)?;
        if let Some(k) = saved.keys.iter().find(|k| k.states.len() > 1) {
            return Err(Error::CompressionStates(format!("key {}: {} scheme states, a worker keeps one", k.key, k.states.len())));
        }
        let mut by_key = saved.by_key();
        for (key, e) in guards.iter_mut() {
            let slices = e.slices.len();
            match by_key.remove(key) {
                Some(mut s) => {
                    e.residuals = if s.residuals.iter().all(Vec::is_empty) { vec![Vec::new(); slices] } else { s.residuals };
                    e.state = s.states.pop().unwrap_or_default();
                }
                None => {
                    e.residuals = vec![Vec::new(); slices];
                    e.state = scheme::State::default();
                }
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

    /// Leaves the job: the scheduler ends it once every worker has left.
    pub fn close(&self) {
        if !self.closed.swap(true, Ordering::SeqCst) {
            self.post.worker_done(); // delivered even as the sockets close (linger)
            self.post.stop(); // ends every wait, so the rounds in flight end too
            let _ = self.settle_all();
        }
    }
}

impl Store for DistWorker {
    fn type_name(&self) -> &'static str {
        // Every worker was started from a name of the table.
        crate::store::store_type(&self.type_name).and_then(|(c, _)| c.to_str().ok()).unwrap_or("dist")
    }
    fn rank(&self) -> usize {
        DistWorker::rank(self)
    }
    fn num_workers(&self) -> usize {
        DistWorker::num_workers(self)
    }
    fn barrier(&self) -> Result<()> {
        DistWorker::barrier(self)
    }
    fn stats(&self) -> (u64, u64) {
        DistWorker::stats(self)
    }
    fn dropped(&self) -> u64 {
        DistWorker::dropped(self)
    }
    fn local_pulls(&self) -> u64 {
        DistWorker::local_pulls(self)
    }
    fn close(&self) -> Result<()> {
        DistWorker::close(self);
        Ok(())
    }
    fn set_compress(&self, compression: Compression, params: &[(String, String)]) -> Result<()> {
        DistWorker::set_compress(self, compression, params)
    }
    fn set_optimizer(&self, name: &str, params: &[(String, String)]) -> Result<()> {
        DistWorker::set_optimizer(self, name, params)
    }
    fn init(&self, key: &Key, value: Array) -> Result<()> {
        DistWorker::init(self, key, value)
    }
    fn push(&self, key: &Key, values: &[Array]) -> Result<()> {
        DistWorker::push(self, key, values)
    }
    fn pull(&self, key: &Key, outs: &mut [ArrayMut]) -> Result<()> {
        DistWorker::pull(self, key, outs)
    }
    fn shape(&self, key: &Key) -> Result<Vec<usize>> {
        DistWorker::shape(self, key)
    }
    fn save_compression_states(&self) -> Result<Vec<u8>> {
        DistWorker::save_compression_states(self)
    }
    fn load_compression_states(&self, blob: &[u8]) -> Result<()> {
        DistWorker::load_compression_states(self, blob)
    }
}

impl Drop for DistWorker {
    fn drop(&mut self) {
        self.close();
    }
}
