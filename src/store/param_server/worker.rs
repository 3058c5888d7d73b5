//! The worker side of the distributed store: merges its devices, quantizes the
//! merged gradient with one residual per key and server slice, and sends only
//! packed bytes; pulls float32 slices back. Keys of at least
//! `bigarray_bound` elements are split over every server in slices whose
//! boundaries are multiples of 16 (and, under a scheme, of its lane groups);
//! smaller keys live on one server chosen by a hash of the key that every
//! worker computes alike. A scheme's round runs on every server of the key
//! at once (`ServerExchange`), each decoding its own slice. A split scheme
//! key (but PowerSGD's) is cut into slices of at most `partition_bytes`,
//! dealt round the servers, and each server answers a slice's round with
//! its new value: one slice's value comes back while the next is pushed,
//! and the pull that follows asks no server.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use super::config::{Config, Role};
use super::message::{encode_pairs, f32_view, f32s_to_bytes, Command, Exchange, Flag, Message, Meta};
use super::postoffice::Postoffice;
use super::counts;
use crate::codec::{self, Grad};
use crate::compression::Compression;
use crate::error::{Error, Result};
use crate::store::checkpoint;
use crate::store::checks::{check_compress_before_init, check_outputs, check_push, check_shape, key_error, lock};
use crate::store::sum::{round_to_f16, sum_into};
use crate::store::{store_type, Array, ArrayMut, Key, Kind, Store};
use crate::quant::collective::Collective;
use crate::quant::scheme::{self, Part};

/// The check of a reply about `slices` as it arrives (`customer::Check`):
/// from a slice's server about that slice, with a payload in the form its
/// flags say (a pull's float32, code counts or scheme value; an exchange's
/// part). One that fails is dropped and counted; the real one still comes.
fn reply_check(slices: &[Slice]) -> super::customer::Check {
    let slices: Vec<(i32, u64, u64)> = slices.iter().map(|s| (s.server, s.offset as u64, s.len as u64)).collect();
    Arc::new(move |r: &Message| {
        let (m, data) = (&r.meta, &r.data[..]);
        if !slices.contains(&(m.sender, m.offset, m.len)) {
            return Err(Error::Transport(format!("malformed message: a reply about elements {}..+{}, which node {} holds no slice of", m.offset, m.len, m.sender)));
        }
        if m.has(Flag::SchemeValue) {
            scheme::value_from_wire(data).map(drop)
        } else if m.has(Flag::CodeCounts) {
            counts::validate(data, m.len as usize).map(drop)
        } else if data.is_empty() || data.len() as u64 == m.len.saturating_mul(4) {
            Ok(())
        } else {
            scheme::from_wire(data).map(drop)
        }
    })
}

/// One server's part of a key.
#[derive(Clone, Debug, PartialEq)]
pub struct Slice {
    pub server: i32,
    pub offset: usize,
    pub len: usize,
}

impl Slice {
    /// The header of a request about this slice of `key`.
    fn meta(&self, command: Command, key: &Key) -> Meta {
        let mut m = Meta::new(command, 0);
        m.key = Some(key.clone());
        m.offset = self.offset as u64;
        m.len = self.len as u64;
        m
    }

    /// The header of a scheme round's push about this slice of `key`:
    /// `flags` (the kind of push) and `body` (the round's step and phase).
    fn round_meta(&self, key: &Key, flags: &[Flag], body: &str) -> Meta {
        let mut m = self.meta(Command::Push, key);
        flags.iter().for_each(|&f| m.set(f));
        m.body = body.to_string();
        m
    }
}

/// Where each part of a key of `n` elements lives: a key of at least
/// `bigarray_bound` elements in `per_server` slices per server (dealt round
/// the servers in order), each starting at a multiple of 16 and of `align`.
pub fn slices_for(key: &Key, n: usize, servers: &[i32], bigarray_bound: usize, align: usize, per_server: usize) -> Vec<Slice> {
    if n >= bigarray_bound && servers.len() > 1 {
        let step = lcm(16, align.max(1));
        let parts = servers.len() * per_server.max(1);
        let per = n.div_ceil(parts).div_ceil(step) * step;
        (0..parts)
            .map(|i| (servers[i % servers.len()], (i * per).min(n), ((i + 1) * per).min(n)))
            .filter(|(_, lo, hi)| hi > lo)
            .map(|(server, lo, hi)| Slice { server, offset: lo, len: hi - lo })
            .collect()
    } else {
        vec![Slice { server: servers[(key.stable_hash() % servers.len() as u64) as usize], offset: 0, len: n }]
    }
}

/// Slices per server of a split key of `n` elements: several for a scheme
/// whose final codes dominate its traffic (every one but PowerSGD), so that
/// the servers answer one slice's round while the next slice is pushed;
/// slices of at most `partition_bytes` of float32. One otherwise.
pub fn slices_per_server(compression: &Compression, n: usize, servers: usize, partition_bytes: usize) -> usize {
    if !compression.is_scheme() || matches!(compression, Compression::PowerSgd { .. }) || servers == 0 {
        return 1;
    }
    let parts = (n as u128 * 4).div_ceil(partition_bytes.max(4) as u128);
    (parts.div_ceil(servers as u128) as usize).clamp(1, 1 << 10)
}

fn lcm(a: usize, b: usize) -> usize {
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    a / gcd(a, b) * b
}

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
}

/// One server's answer to a pull, checked before any output is written.
enum PullReply<'a> {
    Float(std::borrow::Cow<'a, [f32]>),
    /// 2-bit code counts (`counts`).
    Counts(&'a [u8]),
    /// A scheme's decoded sum, as what it was decoded from.
    Scheme { step: u64, exchanged: Vec<Part>, sum: Part },
}

/// A scheme's exchanges for one key, reduced by the servers of its slices:
/// each gets its piece of the scale indices and codes (`scheme::pieces`)
/// and the whole of every float32 exchange (the scale, PowerSGD's P), which
/// every server reduces to the same bits (rank order).
struct ServerExchange<'a> {
    post: &'a Postoffice,
    key: &'a Key,
    slices: &'a [Slice],
    /// The range of the codes and scale indices each slice's server gets.
    pieces: Vec<Range<usize>>,
    step: u64,
    phase: usize,
    workers: usize,
    /// Per slice: its server answered with an error, so the round already
    /// failed there (no abort is sent to it).
    refused: Vec<bool>,
}

impl ServerExchange<'_> {
    /// Sends `parts[i]` to slice `i`'s server under `meta`'s header and
    /// returns the replies' payloads in slice order; any server's error is
    /// the error (and marks that server refused).
    fn send(&mut self, meta: impl Fn(&Slice) -> Meta, parts: Vec<Vec<u8>>) -> Result<Vec<Message>> {
        let requests = self.slices.iter().zip(parts).map(|(s, p)| (s.server, meta(s), p)).collect();
        let replies = self.post.request_all(requests, reply_check(self.slices)).inspect_err(|_| self.refused.iter_mut().for_each(|r| *r = true))?;
        let mut ordered: Vec<Option<Message>> = self.slices.iter().map(|_| None).collect();
        for r in replies {
            // A server may hold several slices: the reply names its slice's offset.
            match self.slices.iter().position(|s| s.server == r.meta.sender && s.offset as u64 == r.meta.offset && s.len as u64 == r.meta.len) {
                Some(i) if ordered[i].is_none() => ordered[i] = Some(r),
                _ => return Err(Error::Transport(format!("malformed message: a reply for key {} from node {} about elements {}..+{}, which it does not hold, or a second answer", self.key, r.meta.sender, r.meta.offset, r.meta.len))),
            }
        }
        let mut first_error = None;
        for (i, r) in ordered.iter().enumerate() {
            match r {
                Some(r) if r.meta.status != 0 => {
                    self.refused[i] = true;
                    first_error.get_or_insert_with(|| Error::Store(r.meta.body.clone()));
                }
                Some(_) => {}
                None => return Err(Error::Transport(format!("no reply for key {} from server node {}", self.key, self.slices[i].server))),
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(ordered.into_iter().map(|r| r.expect("checked above")).collect()),
        }
    }

    /// One exchange of the round: `parts[i]` to slice `i`'s server.
    fn exchange(&mut self, op: Exchange, parts: Vec<Part>) -> Result<Vec<Part>> {
        let body = encode_pairs([("op", op.name()), ("step", self.step.to_string().as_str()), ("phase", self.phase.to_string().as_str())]);
        self.phase += 1;
        let key = self.key;
        let replies = self.send(|s| s.round_meta(key, &[Flag::Exchange], &body), parts.iter().map(scheme::to_wire).collect())?;
        replies.iter().map(|r| scheme::from_wire(&r.data)).collect()
    }

    /// `x = op over workers (x)` for float32 exchanges, sent whole to every
    /// server; every server must answer the same.
    fn exchange_f32(&mut self, op: Exchange, x: &mut [f32]) -> Result<()> {
        let replies = self.exchange(op, vec![Part::F32(x.to_vec()); self.slices.len()])?;
        match &replies[0] {
            Part::F32(v) if v.len() == x.len() && replies.iter().all(|r| r == &replies[0]) => Ok(x.copy_from_slice(v)),
            _ => Err(self.malformed(op)),
        }
    }

    /// The reply of each piece, checked, copied into `x`'s pieces.
    fn gather<T: Copy>(&self, op: Exchange, replies: &[Part], x: &mut [T], of: impl Fn(&Part) -> Option<std::borrow::Cow<'_, [T]>>) -> Result<()> {
        for (r, piece) in replies.iter().zip(&self.pieces) {
            match of(r) {
                Some(v) if v.len() == piece.len() => x[piece.clone()].copy_from_slice(&v),
                _ => return Err(self.malformed(op)),
            }
        }
        Ok(())
    }

    fn malformed(&self, op: Exchange) -> Error {
        Error::Transport(format!("malformed message: the server's '{}' result for key {} has the wrong kind or length", op.name(), self.key))
    }
}

impl Collective for ServerExchange<'_> {
    fn workers(&self) -> usize {
        self.workers
    }

    fn max_f32(&mut self, x: &mut [f32]) -> Result<()> {
        self.exchange_f32(Exchange::Max, x)
    }

    fn sum_f32(&mut self, x: &mut [f32]) -> Result<()> {
        self.exchange_f32(Exchange::Sum, x)
    }

    fn min_u8(&mut self, x: &mut [u8], count: u8) -> Result<()> {
        let parts = Part::Levels { levels: x.to_vec(), count }.split(&self.pieces)?;
        let replies = self.exchange(Exchange::Min, parts)?;
        self.gather(Exchange::Min, &replies, x, |r| match r {
            Part::Levels { levels, .. } => Some(std::borrow::Cow::Borrowed(&levels[..])),
            _ => None,
        })
    }

    /// The server widens each worker's lanes as it sums them (`LaneSum`).
    fn lanes_for(&self) -> usize {
        1
    }

    fn sum_codes(&mut self, x: &mut [i32], lo: i32, hi: i32) -> Result<()> {
        let parts = Part::Codes { codes: x.to_vec(), lo, hi }.split(&self.pieces)?;
        let replies = self.exchange(Exchange::Sum, parts)?;
        self.gather(Exchange::Sum, &replies, x, |r| match r.unpacked().ok()?.into_owned() {
            Part::Codes { codes, .. } => Some(std::borrow::Cow::Owned(codes)),
            _ => None,
        })
    }
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
    /// initialized with its shape and dtype. Servers first fail the rounds
    /// that wait for this worker, which is now in the barrier.
    fn barrier_with(&self, init: Option<String>) -> Result<()> {
        let mut state = format!("store type={}\ncompression={:?}\n", self.type_name, *self.compression.read().unwrap());
        if !self.asynchronous {
            state += &format!("sync pushes={}\n", self.pushes.load(Ordering::SeqCst));
            self.to_all_servers(Command::Barrier, String::new())?;
        }
        if let Some(init) = init {
            state += &format!("init={init}\n");
        }
        self.post.barrier(&state)
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
        let entry = WorkerKey { shape: value.shape.to_vec(), half, residuals: vec![Vec::new(); slices.len()], saved: Vec::new(), slices, merge: Vec::new(), state: scheme::State::default(), next: scheme::State::default(), pulled: None };
        self.keys.write().unwrap().insert(key.clone(), Arc::new(Mutex::new(entry)));
        self.barrier_with(Some(format!("key {key} of shape {:?} and dtype {}", value.shape, if half { "float16" } else { "float32" })))
    }

    /// Merges `values` (one per local device), then one push per server slice:
    /// packed 2-bit blocks when compression is set, else float32.
    pub fn push(&self, key: &Key, values: &[Array]) -> Result<()> {
        let entry = self.entry(key)?;
        if !self.asynchronous {
            self.pushes.fetch_add(1, Ordering::SeqCst);
        }
        let compression = *self.compression.read().unwrap();
        let mut guard = lock(key, &entry)?;
        let e = &mut *guard;
        e.pulled = None; // the value this push's round makes is not the last one's
        let mut checked = false;
        let pushed = self.push_checked(key, e, values, compression, &mut checked);
        if let Err(err) = &pushed {
            if !checked && compression.is_scheme() && !self.asynchronous {
                self.abort_scheme_round(key, &e.slices, &[], e.state.step, 0, err);
            } else if !checked && !self.asynchronous {
                // The others wait for this worker in the round: its turn
                // fails the round for all of them, with this error's cause.
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
                let _ = self.post.request_checked(parts, reply_check(&e.slices));
            }
        }
        pushed
    }

    /// The push once the key is known: every check, then (`checked` set) the round.
    fn push_checked(&self, key: &Key, e: &mut WorkerKey, values: &[Array], compression: Compression, checked: &mut bool) -> Result<()> {
        check_push(key, values, &e.shape, compression, e.half)?;
        let n: usize = e.shape.iter().product();
        // One float32 device: push straight from its array, no merge copy.
        let single = match values {
            [Array { data: Grad::F32(g), .. }] => Some(*g),
            _ => None,
        };
        if single.is_none() {
            e.merge.resize(n, 0.0);
            let grads: Vec<Grad> = values.iter().map(|v| v.data).collect();
            sum_into(&mut e.merge, &grads, e.half);
        }
        if compression.is_scheme() {
            *checked = true;
            let merged = single.unwrap_or(&e.merge);
            return self.push_scheme(key, &e.shape, &e.slices, &mut e.state, &mut e.next, &mut e.pulled, merged, compression);
        }
        let part_of = |s: &Slice| match single {
            Some(g) => &g[s.offset..s.offset + s.len],
            None => &e.merge[s.offset..s.offset + s.len],
        };
        let mut payloads = Vec::with_capacity(e.slices.len());
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
        let sent = self.post.request_checked(parts, reply_check(&e.slices)).map(|_| ());
        if sent.is_err() && matches!(compression, Compression::TwoBit(_)) {
            std::mem::swap(&mut e.residuals, &mut e.saved);
        }
        sent
    }

    /// Tells the key's servers (but those in `refused`, where the round
    /// already failed) that this worker's part of a scheme round failed here
    /// (before exchange `phase`): the round fails for every worker, with
    /// `err` as the cause. Waits for the round to end.
    fn abort_scheme_round(&self, key: &Key, slices: &[Slice], refused: &[bool], step: u64, phase: usize, err: &Error) {
        let cause = err.to_string().replace('\n', " ");
        let body = encode_pairs([("op", "abort"), ("step", step.to_string().as_str()), ("phase", phase.to_string().as_str()), ("cause", cause.as_str())]);
        let parts: Vec<_> = slices
            .iter()
            .enumerate()
            .filter(|(i, _)| !refused.get(*i).copied().unwrap_or(false))
            .map(|(_, s)| (s.server, s.round_meta(key, &[Flag::Exchange, Flag::Abort], &body), Vec::new()))
            .collect();
        if !parts.is_empty() {
            let _ = self.post.request_checked(parts, reply_check(slices));
        }
    }

    /// A scheme's push: its exchanges through the key's servers, then the
    /// final contribution, which each server sums, decodes and applies for
    /// its slice. The worker's state changes only when every server
    /// accepted the round.
    #[allow(clippy::too_many_arguments)]
    fn push_scheme(&self, key: &Key, shape: &[usize], slices: &[Slice], state: &mut scheme::State, next: &mut scheme::State, pulled: &mut Option<Vec<Message>>, merged: &[f32], compression: Compression) -> Result<()> {
        next.clone_from(state);
        let (rank, workers) = (self.rank(), self.num_workers());
        let ctx = scheme::Ctx { shape, step: state.step, key_hash: key.stable_hash(), member: rank as u64, workers };
        let ranges: Vec<Range<usize>> = slices.iter().map(|s| s.offset..s.offset + s.len).collect();
        let pieces = scheme::pieces(&compression, state.step, ctx.key_hash, &ranges);
        let mut exchange = ServerExchange { post: &self.post, key, slices, pieces, step: state.step, phase: 0, workers, refused: vec![false; slices.len()] };
        let encoded = scheme::check_input(&compression, 1, &[merged], workers).and_then(|()| scheme::encode(&compression, std::slice::from_mut(next), &[merged], &ctx, &mut exchange));
        let finals = encoded.and_then(|(exchanged, part)| {
            let wires: Vec<Vec<u8>> = match slices.len() {
                1 => vec![scheme::to_wire(&part)],
                _ => scheme::split_final(&part, &ranges, &exchange.pieces)?.iter().map(scheme::to_wire).collect(),
            };
            Ok((exchanged, part, wires))
        });
        let (exchanged, part, wires) = match finals {
            Ok(finals) => finals,
            Err(err) => {
                self.abort_scheme_round(key, slices, &exchange.refused, state.step, exchange.phase, &err);
                return Err(err);
            }
        };
        let body = encode_pairs([("step", state.step.to_string().as_str())]);
        let replies = exchange.send(|s| s.round_meta(key, &[Flag::Scheme], &body), wires)?;
        // Each server may answer with its slice's new value (kept for the
        // pull, which checks it as it checks a pull's reply); PowerSGD's
        // answer with the summed Q, the same from each.
        let values = replies.iter().filter(|r| r.meta.has(Flag::SchemeValue)).count();
        if values > 0 && matches!(compression, Compression::PowerSgd { .. }) {
            return Err(Error::Transport(format!("malformed message: a server of key {key} answered a PowerSGD round with a value instead of the summed Q")));
        }
        let summed = match replies.iter().filter(|r| !r.meta.has(Flag::SchemeValue)).map(|r| &r.data[..]).find(|d| !d.is_empty()) {
            None => part,
            Some(data) if replies.iter().all(|r| r.data[..] == *data) => scheme::from_wire(data)?,
            Some(_) => return Err(Error::Transport(format!("malformed message: the servers of key {key} answered its round with different sums"))),
        };
        scheme::finish(&compression, std::slice::from_mut(next), summed);
        scheme::recycle(std::slice::from_mut(next), exchanged);
        std::mem::swap(state, next);
        *pulled = (values == replies.len()).then_some(replies);
        Ok(())
    }

    /// Copies the servers' float32 value of `key` into every output.
    pub fn pull(&self, key: &Key, outs: &mut [ArrayMut]) -> Result<()> {
        let entry = self.entry(key)?;
        let e = lock(key, &entry)?;
        check_outputs(key, "pull", outs, &e.shape)?;
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
        let compression = *self.compression.read().unwrap();
        let keys = self.keys.read().unwrap();
        // Every key's lock first: a poisoned one fails before anything changed.
        // Shapes come from these guards (a second read lock could wait on a writer).
        let mut guards = keys.iter().map(|(k, e)| lock(k, e).map(|g| (k, g))).collect::<Result<HashMap<_, _>>>()?;
        let slices_of = |k: &Key| guards.get(k).map(|e| e.slices.iter().map(|s| s.len).collect());
        let shape_of = |k: &Key| guards.get(k).map(|e| e.shape.clone()).ok_or_else(|| key_error(k, "not initialized"));
        checkpoint::check(&saved, &compression, (self.rank() as u64, self.num_workers() as u64), shape_of, slices_of)?;
        if let Some(k) = saved.keys.iter().find(|k| k.states.len() > 1) {
            return Err(Error::OptimizerStates(format!("key {}: {} scheme states, a worker keeps one", k.key, k.states.len())));
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
            self.post.stop();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn big_keys_split_on_multiples_of_16() {
        let servers = [8, 10, 12];
        let s = slices_for(&Key::Int(0), 1_000_003, &servers, 1_000_000, 1, 1);
        assert_eq!(s.len(), 3);
        assert_eq!(s.iter().map(|x| x.len).sum::<usize>(), 1_000_003);
        for w in s.windows(2) {
            assert_eq!(w[0].offset + w[0].len, w[1].offset);
            assert_eq!(w[1].offset % 16, 0);
        }
        let small = slices_for(&Key::Str("w".into()), 10, &servers, 1_000_000, 1, 1);
        assert_eq!(small.len(), 1);
        assert_eq!(small, slices_for(&Key::Str("w".into()), 10, &servers, 1_000_000, 1, 1));
        // tiny arrays over many servers: no empty slices
        let t = slices_for(&Key::Int(1), 20, &servers, 1, 1, 1);
        assert!(t.iter().all(|x| x.len > 0) && t.iter().map(|x| x.len).sum::<usize>() == 20);
        // A scheme's slices start on its lane groups (168 values at width 3) and on 16.
        let a = slices_for(&Key::Int(2), 100_000, &servers, 1000, 168, 1);
        assert_eq!(a.iter().map(|x| x.len).sum::<usize>(), 100_000);
        assert!(a.len() == 3 && a.iter().all(|x| x.offset % 336 == 0), "{a:?}");
        // Several slices per server, dealt round them in order, still whole and aligned.
        let p = slices_for(&Key::Int(3), 1_000_003, &servers, 1000, 168, 4);
        assert_eq!(p.len(), 12);
        assert_eq!(p.iter().map(|x| x.server).collect::<Vec<_>>(), [8, 10, 12].repeat(4));
        assert_eq!((p[0].offset, p.last().map(|x| x.offset + x.len)), (0, Some(1_000_003)));
        assert!(p.windows(2).all(|w| w[0].offset + w[0].len == w[1].offset && w[1].offset % 336 == 0), "{p:?}");
    }

    #[test]
    fn only_split_scheme_keys_but_powersgd_take_several_slices_per_server() {
        let qsgd = Compression::from_params([("compress", "qsgd_mn"), ("bits", "2")]).unwrap();
        let n = 16 << 20;
        // 64 MiB of float32 in 4 MiB slices over 2 servers; a partial slice counts
        assert_eq!(slices_per_server(&qsgd, n, 2, 4 << 20), 8);
        assert_eq!(slices_per_server(&qsgd, n + 1, 2, 4 << 20), 9);
        assert_eq!(slices_per_server(&qsgd, n, 2, usize::MAX), 1);
        assert_eq!(slices_per_server(&qsgd, n, 2, 0), 1 << 10);
        for other in [Compression::None, Compression::from_params([("compress", "powersgd"), ("rank", "4")]).unwrap(), Compression::from_params([("compress", "2bit"), ("threshold", "0.5")]).unwrap()] {
            assert_eq!(slices_per_server(&other, n, 2, 4 << 20), 1, "{other:?}");
        }
    }
}
