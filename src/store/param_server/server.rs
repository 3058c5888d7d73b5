//! The parameter server: holds its slices of every key and runs one round
//! machine per slice (`Round`, in `round`). A round gathers every worker's turn: a plain
//! push (2-bit codes counted, `counts`, or float32 summed) or one exchange of
//! a scheme's round (`quant::scheme`); sync rounds are answered once every
//! worker took its turn, async pushes one by one. At a round's end the
//! optimizer runs, or the sum becomes the value. A bad request gets an error
//! response and changes nothing.

use std::collections::{BTreeMap, HashMap};

use super::config::Config;
use super::message::{bytes_to_f32s, decode_pairs, f32_view, f32s_to_bytes, Command, Exchange, Flag, Message, Meta, Payload};
use super::postoffice::Postoffice;
use super::counts;
use super::round::{mismatch, response, Gathered, Gathering, PlainSum, Round, SchemeSteps};
use crate::codec::{self, Thresholds};
use crate::error::{Error, Result};
use crate::store::sum::{add_into, settle};
use crate::store::Key;
use crate::optimizer::Optimizer;
use crate::quant::compression::Compression;
use crate::quant::scheme;

struct Slot {
    offset: u64,
    /// The whole key's shape (from init), for schemes that need it.
    shape: Vec<usize>,
    scheme: SchemeSteps,
    round: Round,
    value: Vec<f32>,
    /// A float16 key: sums and updates rounded to float16 (`store::sum::settle`).
    half: bool,
    merge: Vec<f32>,
    round_pos: Vec<u8>,
    round_neg: Vec<u8>,
    /// When the value is exactly a sum of 2-bit pushes: its counts, thresholds
    /// and the number of pushes, for lossless code-count pulls.
    value_pos: Vec<u8>,
    value_neg: Vec<u8>,
    value_counts: Option<(Thresholds, usize)>,
    /// The encoded pull payload of the current value, made on the first pull.
    pull_cache: Option<(Payload, u16)>,
}

pub struct Server {
    num_workers: usize,
    my_id: i32,
    /// Every slice this server holds, by key and the slice's first element
    /// (a worker may deal one key's slices to a server several times);
    /// ordered, so a key's slices are one range (`slices_of`).
    slots: BTreeMap<(Key, u64), Slot>,
    optimizer: Option<Optimizer>,
    compression: Compression,
    /// dist_sync (true) or dist_async, as the first init said; a push of the
    /// other kind is refused (a replayed or a foreign worker's).
    sync: Option<bool>,
    /// The barrier (counted from 1) each worker that told this server it
    /// entered one is in, or last was in.
    in_barrier: HashMap<i32, u64>,
    /// Set when a handler panicked (a bug): the state is unknown from then
    /// on, so every later request is refused with this reason.
    broken: Option<String>,
    /// `broken` is new: the postoffice tells the scheduler, which ends the job.
    report_broken: bool,
    /// Workers (node ids) that closed their store: no sync round can
    /// complete after the first, so such rounds fail instead of waiting.
    closed: Vec<i32>,
}

fn barrier_error(node: i32, number: u64, key: &Key) -> Error {
    Error::Key {
        key: key.to_string(),
        problem: format!("worker node {node} is waiting in barrier {number} without pushing this key in this round: the workers pushed it unequal numbers of times, so the round cannot complete"),
    }
}

fn mode_name(sync: bool) -> &'static str {
    if sync {
        "dist_sync"
    } else {
        "dist_async"
    }
}

fn closed_error(node: i32, key: &Key) -> Error {
    Error::JobFailed(format!(
        "worker node {node} closed its store, so the sync round of key {key} can never complete (every worker must push each key as often as the others)"
    ))
}

impl Server {
    pub fn new(num_workers: usize, my_id: i32) -> Server {
        Server { num_workers, my_id, slots: BTreeMap::new(), optimizer: None, compression: Compression::None, sync: None, in_barrier: HashMap::new(), broken: None, report_broken: false, closed: Vec::new() }
    }

    /// Handles one request; returns the responses to send (a sync push is
    /// answered only when the round completes).
    pub fn handle(&mut self, msg: Message) -> Vec<(i32, Message)> {
        let meta = msg.meta.clone();
        if let Some(why) = &self.broken {
            return vec![response(&meta, self.my_id, Err(Error::JobFailed(why.clone())))];
        }
        // A panic (a bug) never takes the serving thread down with it: the
        // request that caused it gets the error, and so does every later one.
        match crate::error::catch_panic(|| Ok(self.handle_checked(msg))) {
            Ok(replies) => replies,
            Err(panic) => {
                let what = match panic {
                    Error::Internal(what) => what,
                    other => other.to_string(),
                };
                let why = format!("server node {} stopped serving after an internal error (a bug in gradpack) on a {:?} of key {}: {what}", self.my_id, meta.command, meta.key.as_ref().map_or("(none)".to_string(), |k| k.to_string()));
                eprintln!("[gradpack server] {why}");
                self.broken = Some(why.clone());
                self.report_broken = true;
                vec![response(&meta, self.my_id, Err(Error::JobFailed(why)))]
            }
        }
    }

    /// Why this server stopped serving, once, for the scheduler.
    pub fn take_broken(&mut self) -> Option<String> {
        std::mem::take(&mut self.report_broken).then(|| self.broken.clone()).flatten()
    }

    fn handle_checked(&mut self, msg: Message) -> Vec<(i32, Message)> {
        let meta = msg.meta.clone();
        #[cfg(test)]
        if meta.key == Some(Key::from("panic in the handler")) {
            panic!("a bug injected by a test");
        }
        match meta.command {
            Command::WorkerDone => self.worker_closed(meta.sender),
            Command::Heartbeat => {
                // A worker asks whether a request of its still waits here (in a sync round).
                let rid = decode_pairs(&meta.body).ok().and_then(|p| p.into_iter().find(|(k, _)| k == "request")).and_then(|(_, v)| v.parse::<u64>().ok());
                let held = |w: &[(i32, u64)]| w.iter().any(|&(s, r)| s == meta.sender && Some(r) == rid);
                let result = if self.slots.values().any(|slot| held(&slot.round.waiting)) {
                    Ok(Vec::new())
                } else {
                    Err(Error::JobFailed(format!("server node {} holds no request {} of worker node {}: it was lost on the way", self.my_id, rid.map_or("(none)".to_string(), |r| r.to_string()), meta.sender)))
                };
                vec![response(&meta, self.my_id, result.map(Payload::from))]
            }
            Command::Barrier => {
                let mut replies = self.worker_in_barrier(meta.sender, meta.status as u64 + 1);
                replies.push(response(&meta, self.my_id, Ok(Payload::empty())));
                replies
            }
            Command::Push => match self.push(msg) {
                Ok(replies) => replies,
                Err(e) => vec![response(&meta, self.my_id, Err(e))],
            },
            Command::Pull => {
                let (result, flags) = match self.pull(&meta) {
                    Ok((bytes, flags)) => (Ok(bytes), flags),
                    Err(e) => (Err(e), 0),
                };
                let (to, mut reply) = response(&meta, self.my_id, result);
                reply.meta.flags = flags;
                vec![(to, reply)]
            }
            _ => {
                let result = self.other(msg);
                vec![response(&meta, self.my_id, result.map(Payload::from))]
            }
        }
    }

    fn key_of(meta: &Meta) -> Result<Key> {
        meta.key.clone().ok_or_else(|| Error::Transport(format!("malformed message: {:?} without a key", meta.command)))
    }

    fn other(&mut self, msg: Message) -> Result<Vec<u8>> {
        let meta = &msg.meta;
        match meta.command {
            Command::SetCompress => {
                let pairs = decode_pairs(&meta.body)?;
                self.compression = Compression::from_params(pairs.iter().map(|(k, v)| (k.as_str(), v.as_str())))?;
                Ok(Vec::new())
            }
            Command::SetOptimizer => {
                let pairs = decode_pairs(&meta.body)?;
                let name = pairs.iter().find(|(k, _)| k == "name").map(|(_, v)| v.clone()).unwrap_or_default();
                let params = pairs.iter().filter(|(k, _)| k != "name").map(|(k, v)| (k.as_str(), v.as_str()));
                self.optimizer = Some(Optimizer::from_params(&name, params)?);
                Ok(Vec::new())
            }
            Command::Init => {
                let key = Self::key_of(meta)?;
                if self.slots.contains_key(&(key.clone(), meta.offset)) {
                    return Err(Error::Key { key: key.to_string(), problem: "already initialized".into() });
                }
                let value = bytes_to_f32s(&msg.data)?;
                if value.len() as u64 != meta.len {
                    return Err(Error::Key { key: key.to_string(), problem: format!("init carries {} values for a slice of {}", value.len(), meta.len) });
                }
                let n = value.len();
                let pairs = decode_pairs(&meta.body)?;
                let sync = match pairs.iter().find(|(k, _)| k == "sync").map(|(_, v)| v.as_str()) {
                    Some("1") => true,
                    Some("0") => false,
                    _ => return Err(Error::Transport("malformed message: an init that does not say sync=1 or sync=0".into())),
                };
                if self.sync.is_some_and(|s| s != sync) {
                    return Err(Error::Key { key: key.to_string(), problem: format!("init from a {} store, but this server's keys are {}", mode_name(sync), mode_name(!sync)) });
                }
                let half = match pairs.iter().find(|(k, _)| k == "dtype").map(|(_, v)| v.as_str()) {
                    None | Some("float32") => false,
                    Some("float16") => true,
                    Some(other) => return Err(Error::Transport(format!("malformed message: dtype '{}'", other.escape_debug()))),
                };
                let shape = match pairs.iter().find(|(k, _)| k == "shape") {
                    Some((_, v)) => v.split(',').map(|d| d.trim().parse::<usize>().map_err(|_| Error::Transport(format!("malformed message: shape '{v}'")))).collect::<Result<Vec<_>>>()?,
                    None => vec![n],
                };
                // The slice lies in the key's shape, which every slice of the key
                // here shares, and shares no element with another of them.
                let total = shape.iter().try_fold(1u64, |t, &d| t.checked_mul(d as u64));
                let end = meta.offset.checked_add(meta.len).filter(|&end| total.is_some_and(|t| end <= t));
                let Some(end) = end else {
                    return Err(Error::Transport(format!("malformed message: init of elements {}..+{} of key {key} of shape {shape:?}", meta.offset, meta.len)));
                };
                for ((_, at), other) in Self::slices_of(&self.slots, &key) {
                    if other.shape != shape {
                        return Err(Error::Key { key: key.to_string(), problem: format!("init with shape {shape:?}, but this server holds a slice of it with shape {:?}", other.shape) });
                    }
                    if *at < end && meta.offset < *at + other.value.len() as u64 {
                        return Err(Error::Key { key: key.to_string(), problem: format!("init of elements {}..{end}, but this server holds {at}..{} of it", meta.offset, at + other.value.len() as u64) });
                    }
                }
                self.sync = Some(sync);
                self.slots.insert(
                    (key, meta.offset),
                    Slot {
                        offset: meta.offset,
                        shape,
                        scheme: SchemeSteps::default(),
                        round: Round::default(),
                        merge: vec![0.0; n],
                        value,
                        half,
                        // Allocated by the first 2-bit push: a key of another compression never counts codes.
                        round_pos: Vec::new(),
                        round_neg: Vec::new(),
                        value_pos: Vec::new(),
                        value_neg: Vec::new(),
                        value_counts: None,
                        pull_cache: None,
                    },
                );
                Ok(Vec::new())
            }
            Command::Pull => unreachable!("handled by pull()"),
            other => Err(Error::Transport(format!("a server does not answer {other:?}"))),
        }
    }

    /// The value of a slice: lossless code counts when it is a counted sum,
    /// a scheme's summed codes when it is their decoded sum (made at the
    /// round's end), else float32; encoded once per value and copied for each puller.
    fn pull(&mut self, meta: &Meta) -> Result<(Payload, u16)> {
        let key = Self::key_of(meta)?;
        self.slot(&key, meta)?;
        let slot = self.slots.get_mut(&(key.clone(), meta.offset)).unwrap();
        if slot.pull_cache.is_none() {
            slot.pull_cache = Some(match slot.value_counts {
                Some((th, pushes)) if pushes <= 255 => (counts::encode(&slot.value_pos, &slot.value_neg, th, counts::bits_for(pushes)).into(), Flag::CodeCounts.bit()),
                _ => (f32s_to_bytes(&slot.value).into(), 0),
            });
        }
        Ok(slot.pull_cache.clone().unwrap())
    }

    /// The slices of `key` this server holds, in order of their first element.
    fn slices_of<'a>(slots: &'a BTreeMap<(Key, u64), Slot>, key: &Key) -> impl Iterator<Item = (&'a (Key, u64), &'a Slot)> {
        slots.range((key.clone(), 0)..=(key.clone(), u64::MAX))
    }

    fn slot(&self, key: &Key, meta: &Meta) -> Result<&Slot> {
        let Some(slot) = self.slots.get(&(key.clone(), meta.offset)) else {
            let held: Vec<String> = Self::slices_of(&self.slots, key).map(|((_, at), s)| format!("{at}..{}", at + s.value.len() as u64)).collect();
            let problem = if held.is_empty() { "not initialized on this server".to_string() } else { format!("request for {} elements at offset {} but this server holds elements {} of it", meta.len, meta.offset, held.join(", ")) };
            return Err(Error::Key { key: key.to_string(), problem });
        };
        // (found by its offset: only the length can differ)
        if slot.value.len() as u64 != meta.len {
            return Err(Error::Key {
                key: key.to_string(),
                problem: format!("request for {} elements at offset {} but this server holds {} at offset {}", meta.len, meta.offset, slot.value.len(), slot.offset),
            });
        }
        Ok(slot)
    }

    /// Worker `node` closed its store: every sync round it has not joined
    /// fails for the workers waiting in it (values stay as they were), and so
    /// does every later sync round.
    fn worker_closed(&mut self, node: i32) -> Vec<(i32, Message)> {
        if !self.closed.contains(&node) {
            self.closed.push(node);
        }
        self.fail_rounds_without(node, |key| closed_error(node, key))
    }

    /// Worker `node` entered barrier `number`: a sync round that waits for it
    /// cannot complete (it pushes again only after the barrier, which waits
    /// for the workers in the round), so each fails with an error to its
    /// workers.
    fn worker_in_barrier(&mut self, node: i32, number: u64) -> Vec<(i32, Message)> {
        self.in_barrier.insert(node, number);
        self.fail_rounds_without(node, |key| barrier_error(node, number, key))
    }

    /// Ends every sync round (plain, 2-bit or a scheme's exchange) that
    /// workers wait in and `node` has not joined, answering them `why(key)`.
    fn fail_rounds_without(&mut self, node: i32, why: impl Fn(&Key) -> Error) -> Vec<(i32, Message)> {
        let mut replies = Vec::new();
        for ((key, _), slot) in self.slots.iter_mut() {
            // A request of this slot, as the waiting pushes were (answer_all sets sender and id).
            let mut meta = Meta::new(Command::Push, 0);
            (meta.key, meta.offset, meta.len) = (Some(key.clone()), slot.offset, slot.value.len() as u64);
            if slot.round.waits_without(node) {
                replies.extend(slot.round.answer(&meta, self.my_id, Err(why(key))));
            }
        }
        replies
    }

    fn push(&mut self, msg: Message) -> Result<Vec<(i32, Message)>> {
        let asynchronous = msg.meta.has(Flag::Async);
        if self.sync == Some(asynchronous) {
            let key = Self::key_of(&msg.meta)?;
            return Err(Error::Key { key: key.to_string(), problem: format!("a {} push to a server of a {} job", mode_name(!asynchronous), mode_name(asynchronous)) });
        }
        // A worker in a barrier this one has not reached will not join this round.
        let passed = msg.meta.status as u64;
        if let (false, Some((&node, &number))) = (asynchronous, self.in_barrier.iter().find(|(&n, &b)| n != msg.meta.sender && b > passed)) {
            return Err(barrier_error(node, number, &Self::key_of(&msg.meta)?));
        }
        if !msg.meta.has(Flag::Async) {
            if let (Some(&node), Ok(key)) = (self.closed.first(), Self::key_of(&msg.meta)) {
                return Err(closed_error(node, &key));
            }
        }
        if msg.meta.has(Flag::Exchange) || msg.meta.has(Flag::Scheme) {
            return self.scheme_push(msg);
        }
        let meta = msg.meta;
        let key = Self::key_of(&meta)?;
        self.slot(&key, &meta)?;
        let num_workers = self.num_workers;
        let asynchronous = meta.has(Flag::Async);
        let slot = self.slots.get_mut(&(key.clone(), meta.offset)).unwrap();
        if asynchronous {
            slot.round = Round::default(); // each async push is a round of its own
        }
        slot.round.check_turn(meta.sender, &key)?;
        let sum = match &slot.round.gathering {
            Gathering::Nothing => None,
            Gathering::Plain(sum) => Some(*sum),
            Gathering::Exchange(op, _) => return Err(Error::Key { key: key.to_string(), problem: format!("a plain push while the workers' scheme exchange '{}' is being gathered", op.name()) }),
        };
        if meta.has(Flag::Abort) && !asynchronous {
            slot.round.abort(meta.sender, &key, &meta.body);
            slot.round.waiting.push((meta.sender, meta.request_id));
            return Ok(slot.round.end_aborted(&meta, self.my_id, num_workers).unwrap_or_default());
        }
        let payload = f32_view(&msg.data)?;
        // Validate first: a bad push changes nothing.
        let compressed = meta.has(Flag::Compressed);
        let th = if compressed {
            Some(codec::check_compressed(&payload, slot.merge.len())?)
        } else {
            if payload.len() != slot.merge.len() {
                return Err(Error::Key { key: key.to_string(), problem: format!("pushed {} values for a slice of {}", payload.len(), slot.merge.len()) });
            }
            None
        };
        let sum = match (sum, th) {
            (None, Some(th)) => {
                let n = slot.merge.len();
                slot.round_pos.resize(n, 0);
                slot.round_neg.resize(n, 0);
                counts::add_codes(&payload, &mut slot.round_pos, &mut slot.round_neg, true);
                PlainSum::Counts(th)
            }
            (Some(PlainSum::Counts(t0)), Some(th)) if t0 == th && slot.round.waiting.len() < 255 => {
                counts::add_codes(&payload, &mut slot.round_pos, &mut slot.round_neg, false);
                PlainSum::Counts(th)
            }
            (sum, th) => {
                // Mixed thresholds or float32 pushes: sum in float32 from here on.
                match sum {
                    Some(PlainSum::Counts(t0)) => counts::values(&slot.round_pos, &slot.round_neg, t0, &mut slot.merge),
                    None => slot.merge.fill(0.0),
                    Some(PlainSum::Float) => {}
                }
                let first = sum.is_none();
                match th {
                    Some(_) if first => codec::dequantize_2bit(&payload, &mut slot.merge)?,
                    Some(_) => codec::dequantize_2bit_add(&payload, &mut slot.merge)?,
                    // A float16 key sums as MXNet adds float16 arrays: each partial sum rounded.
                    None => add_into(&mut slot.merge, &payload, first, slot.half, |p| p),
                }
                PlainSum::Float
            }
        };
        slot.round.gathering = Gathering::Plain(sum);
        slot.round.waiting.push((meta.sender, meta.request_id));
        if let Some(replies) = slot.round.end_aborted(&meta, self.my_id, num_workers) {
            return Ok(replies);
        }
        if !asynchronous && slot.round.waiting.len() < num_workers {
            return Ok(Vec::new()); // answered when the round completes
        }
        let pushes = slot.round.waiting.len();
        slot.pull_cache = None;
        let result = match (&self.optimizer, sum) {
            (None, PlainSum::Counts(th)) => {
                // The value is exactly the counted sum: keep the counts for lossless pulls.
                counts::values(&slot.round_pos, &slot.round_neg, th, &mut slot.value);
                std::mem::swap(&mut slot.round_pos, &mut slot.value_pos);
                std::mem::swap(&mut slot.round_neg, &mut slot.value_neg);
                slot.value_counts = Some((th, pushes));
                Ok(())
            }
            (opt, sum) => {
                if let PlainSum::Counts(th) = sum {
                    counts::values(&slot.round_pos, &slot.round_neg, th, &mut slot.merge);
                }
                slot.value_counts = None;
                let updated = match opt {
                    Some(o) => o.update(&key, &slot.merge, &mut slot.value),
                    None => {
                        slot.value.copy_from_slice(&slot.merge);
                        Ok(())
                    }
                };
                settle(&mut slot.value, slot.half, opt.as_ref());
                updated
            }
        };
        Ok(slot.round.answer(&meta, self.my_id, result.map(|_| Payload::empty())))
    }
}

impl Server {
    /// One exchange or final contribution of a scheme's round (module docs
    /// of `quant::scheme`): gathered from every worker, then answered.
    fn scheme_push(&mut self, msg: Message) -> Result<Vec<(i32, Message)>> {
        let meta = msg.meta;
        let key = Self::key_of(&meta)?;
        self.slot(&key, &meta)?;
        let compression = self.compression;
        if !compression.is_scheme() {
            return Err(Error::Key { key: key.to_string(), problem: format!("a scheme push, but this server's compression is '{}'", compression.name()) });
        }
        let pairs = decode_pairs(&meta.body)?;
        let get = |k: &str| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        let number = |k: &str| get(k).and_then(|v| v.parse::<u64>().ok()).ok_or_else(|| Error::Transport(format!("malformed message: scheme push without '{k}'")));
        let is_final = meta.has(Flag::Scheme);
        let abort = meta.has(Flag::Abort);
        let step = number("step")?;
        let (name, phase) = if is_final { (Exchange::Final.name(), None) } else { (get("op").unwrap_or(""), Some(number("phase")? as usize)) };
        let op = match Exchange::parse(name) {
            Some(op) => op,
            None if abort => Exchange::Sum, // an abort carries no part to reduce
            None => return Err(Error::Transport(format!("malformed message: unknown exchange '{}'", name.escape_debug()))),
        };
        // Final codes are summed in packed lanes as they come (`LaneSum`);
        // everything else is parsed (and checked) whole.
        let part = match (abort, is_final && scheme::is_codes_wire(&msg.data)) {
            (true, _) => None,
            (false, true) => Some(Err(&msg.data[..])),
            (false, false) => Some(Ok(scheme::from_wire(&msg.data)?)),
        };
        let num_workers = self.num_workers;
        let slot = self.slots.get_mut(&(key.clone(), meta.offset)).unwrap();
        let steps = &mut slot.scheme;
        if !steps.started {
            steps.step = step; // a fresh key: the workers' step (0, or where a checkpoint left them)
        }
        steps.started = true;
        if step != steps.step {
            return Err(Error::Key { key: key.to_string(), problem: format!("scheme push for step {step}, but this server is at step {}", steps.step) });
        }
        let round = &mut slot.round;
        // Every worker gave up the last round after an exchange (e.g. a
        // non-finite scale): a new first exchange starts the round over.
        if phase == Some(0) && matches!(round.gathering, Gathering::Nothing) && !steps.exchanged.is_empty() {
            steps.exchanged.clear();
        }
        if let Some(p) = phase {
            if p != steps.exchanged.len() {
                return Err(Error::Key { key: key.to_string(), problem: format!("exchange {p} of the round, but the server expects {}", steps.exchanged.len()) });
            }
        }
        round.check_turn(meta.sender, &key)?;
        match (&mut round.gathering, part) {
            (Gathering::Plain(_), _) => return Err(Error::Key { key: key.to_string(), problem: format!("'{}' of a scheme while the workers' plain pushes are being gathered", op.name()) }),
            (_, None) => round.abort(meta.sender, &key, get("cause").unwrap_or("")),
            (Gathering::Nothing, Some(Ok(part))) => round.gathering = Gathering::Exchange(op, Gathered::first(op, meta.sender, part)),
            (Gathering::Nothing, Some(Err(lanes))) => round.gathering = Gathering::Exchange(op, Gathered::Lanes(scheme::LaneSum::first(lanes, num_workers)?)),
            (Gathering::Exchange(o, acc @ (Gathered::Part(_) | Gathered::Ordered(_))), Some(Ok(part))) if *o == op => acc.add(op, meta.sender, part)?,
            (Gathering::Exchange(o, Gathered::Lanes(sum)), Some(Err(lanes))) if *o == op => sum.add(lanes)?,
            (Gathering::Exchange(o, _), Some(_)) if *o == op => return Err(mismatch(op)),
            (Gathering::Exchange(o, _), Some(_)) => return Err(Error::Key { key: key.to_string(), problem: format!("'{}' while the workers' '{}' is being gathered", op.name(), o.name()) }),
        }
        round.waiting.push((meta.sender, meta.request_id));
        if let Some(replies) = round.end_aborted(&meta, self.my_id, num_workers) {
            return Ok(replies); // every worker gives up this round; the next first exchange starts over
        }
        if round.waiting.len() < num_workers {
            return Ok(Vec::new()); // answered when every worker contributed
        }
        let reduced = match std::mem::take(&mut round.gathering) {
            Gathering::Exchange(_, gathered) => gathered.reduced()?,
            _ => return Err(Error::Internal("a completed round without a reduction".into())),
        };
        let (result, payload, flags) = if !is_final {
            let reply = scheme::sum_to_wire(&reduced, num_workers);
            steps.exchanged.push(reduced);
            (Ok(()), Payload::from(reply), 0)
        } else {
            let ctx = scheme::Ctx { shape: &slot.shape, step, key_hash: key.stable_hash(), member: 0, workers: num_workers };
            let decoded = scheme::decode_slice(&compression, &steps.exchanged, &reduced, &ctx, slot.offset as usize, &mut slot.merge);
            slot.pull_cache = None;
            slot.value_counts = None;
            let result = decoded.and_then(|_| match &self.optimizer {
                Some(o) => o.update(&key, &slot.merge, &mut slot.value).map(|()| settle(&mut slot.value, slot.half, Some(o))),
                None => {
                    // The value is exactly this decoded sum (merge is scratch,
                    // rewritten whole by the next decode): pulls send what it
                    // was decoded from.
                    std::mem::swap(&mut slot.value, &mut slot.merge);
                    slot.pull_cache = Some((scheme::value_to_wire(step, &steps.exchanged, &reduced, num_workers).into(), Flag::SchemeValue.bit()));
                    Ok(())
                }
            });
            steps.exchanged.clear();
            steps.step += 1;
            // PowerSGD's workers warm-start from the summed Q. Other
            // schemes' workers get the slice's new value as a pull would
            // (when it is the decoded sum, with no optimizer), so the reply
            // to one slice's round travels while the next slice is pushed.
            let (payload, flags) = match (&compression, &slot.pull_cache) {
                (Compression::PowerSgd { .. }, _) => (scheme::to_wire(&reduced).into(), 0),
                (_, Some((value, flags))) if result.is_ok() && *flags == Flag::SchemeValue.bit() => (value.clone(), *flags),
                _ => (Payload::empty(), 0),
            };
            (result, payload, flags)
        };
        let mut replies = round.answer(&meta, self.my_id, result.map(|_| payload));
        replies.iter_mut().filter(|(_, r)| r.meta.status == 0).for_each(|(_, r)| r.meta.flags = flags);
        Ok(replies)
    }
}

/// Runs a server until the job ends (Ok) or fails (Err).
pub fn run_server(config: Config) -> Result<()> {
    let post = start_server(config)?;
    let result = post.customer.wait_until_over();
    post.stop();
    result
}

/// Registers a server and serves requests on its serving thread (the
/// postoffice's `gradpack-serve`, apart from the receive thread); the caller
/// waits for the job's end (`post.customer.wait_until_over()`), then stops it.
pub fn start_server(config: Config) -> Result<std::sync::Arc<Postoffice>> {
    let num_workers = config.num_workers;
    // The handler is made once the node has its id: every response carries it.
    let make = Box::new(move |me: &crate::store::param_server::postoffice::NodeInfo| -> crate::store::param_server::postoffice::RequestHandler {
        let mut srv = Server::new(num_workers, me.id);
        Box::new(move |msg: Message| {
            let mut replies = srv.handle(msg);
            if let Some(why) = srv.take_broken() {
                // A server that can no longer serve says so; the scheduler ends the job.
                let mut m = Meta::new(Command::NodeFailed, srv.my_id);
                m.body = why;
                replies.push((crate::store::param_server::postoffice::SCHEDULER_ID, Message { meta: m, data: Payload::empty() }));
            }
            replies
        })
    });
    Postoffice::start(config, Some(make))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::scheme::Part;
    use crate::store::param_server::message::encode_pairs;

    #[test]
    fn a_panicking_handler_answers_then_refuses_and_reports_once() {
        let mut server = Server::new(1, 8);
        let request = |key: &str| {
            let mut m = Meta::new(Command::Pull, 9);
            (m.key, m.request_id, m.len) = (Some(Key::from(key)), 5, 2);
            Message { meta: m, data: Payload::empty() }
        };
        let replies = server.handle(request("panic in the handler"));
        assert_eq!(replies.len(), 1);
        let (to, reply) = &replies[0];
        assert_eq!((*to, reply.meta.request_id, reply.meta.status), (9, 5, -1));
        assert!(reply.meta.body.contains("server node 8 stopped serving after an internal error") && reply.meta.body.contains("a bug injected by a test"), "{}", reply.meta.body);
        let why = server.take_broken().expect("reported");
        assert!(why.contains("stopped serving"));
        assert_eq!(server.take_broken(), None); // once
        let later = server.handle(request("w"));
        assert!(later[0].1.meta.body.contains("stopped serving"), "{}", later[0].1.meta.body);
    }

    #[test]
    fn slices_of_one_key_are_held_apart_and_may_not_overlap() {
        let mut server = Server::new(1, 8);
        let send = |server: &mut Server, command: Command, offset: u64, len: u64| {
            let mut m = Meta::new(command, 9);
            (m.key, m.offset, m.len, m.request_id) = (Some(Key::Int(3)), offset, len, 1);
            if command == Command::Init {
                m.body = encode_pairs([("shape", "30"), ("sync", "1")]);
            }
            let data = if command == Command::Init { f32s_to_bytes(&vec![offset as f32; len as usize]) } else { Vec::new() };
            let replies = server.handle(Message { meta: m, data: Payload::from(data) });
            let (_, r) = &replies[0];
            (r.meta.status, r.meta.body.clone(), r.data.to_vec())
        };
        // two slices of key 3 on this server, as a key cut into several per server is dealt
        assert_eq!(send(&mut server, Command::Init, 0, 10).0, 0);
        assert_eq!(send(&mut server, Command::Init, 20, 10).0, 0);
        for (offset, len) in [(5, 10), (15, 10), (1, 28), (29, 1)] {
            let (status, body, _) = send(&mut server, Command::Init, offset, len);
            assert!(status == -1 && body.contains("this server holds"), "{offset}+{len}: {body}");
        }
        // past the key's 30 elements, or past 2^64
        for offset in [30, u64::MAX] {
            let (status, body, _) = send(&mut server, Command::Init, offset, 1);
            assert!(status == -1 && body.contains("malformed message: init of elements"), "{body}");
        }
        // each pull gets its own slice; an offset between them names both
        assert_eq!(send(&mut server, Command::Pull, 0, 10).2, f32s_to_bytes(&[0.0; 10]));
        assert_eq!(send(&mut server, Command::Pull, 20, 10).2, f32s_to_bytes(&[20.0; 10]));
        let (status, body, _) = send(&mut server, Command::Pull, 10, 10);
        assert!(status == -1 && body.contains("holds elements 0..10, 20..30"), "{body}");
    }

    /// One round machine: a plain push and a scheme's exchange cannot share
    /// a round; the refused one changes nothing and the round completes.
    #[test]
    fn plain_pushes_and_scheme_exchanges_share_one_round_machine() {
        let mut server = Server::new(2, 8);
        server.compression = Compression::from_params([("type", "qsgd_mn"), ("bits", "2")]).unwrap();
        let key = Key::Int(4);
        let send = |server: &mut Server, sender: i32, command: Command, flags: &[Flag], body: String, data: Vec<u8>| {
            let mut m = Meta::new(command, sender);
            (m.key, m.offset, m.len, m.request_id) = (Some(key.clone()), 0, 3, 7);
            flags.iter().for_each(|&f| m.set(f));
            m.body = body;
            server.handle(Message { meta: m, data: Payload::from(data) })
        };
        let init = encode_pairs([("shape", "3"), ("sync", "1")]);
        assert_eq!(send(&mut server, 9, Command::Init, &[], init, f32s_to_bytes(&[0.0; 3]))[0].1.meta.status, 0);
        let exchange = |x: &[f32]| (encode_pairs([("step", "0"), ("op", "max"), ("phase", "0")]), scheme::to_wire(&Part::F32(x.to_vec())));
        // A plain round open: worker 11's exchange is refused, then its plain push completes the round.
        assert!(send(&mut server, 9, Command::Push, &[], String::new(), f32s_to_bytes(&[1.0, 2.0, 3.0])).is_empty());
        let (body, data) = exchange(&[5.0; 3]);
        let refused = send(&mut server, 11, Command::Push, &[Flag::Exchange], body, data);
        assert!(refused[0].1.meta.status == -1 && refused[0].1.meta.body.contains("while the workers' plain pushes are being gathered"), "{}", refused[0].1.meta.body);
        let done = send(&mut server, 11, Command::Push, &[], String::new(), f32s_to_bytes(&[0.5; 3]));
        assert_eq!(done.iter().map(|(to, r)| (*to, r.meta.status)).collect::<Vec<_>>(), vec![(9, 0), (11, 0)]);
        assert_eq!(send(&mut server, 9, Command::Pull, &[], String::new(), Vec::new())[0].1.data.to_vec(), f32s_to_bytes(&[1.5, 2.5, 3.5]));
        // An exchange open: worker 11's plain push and its second turn are refused; its exchange completes it.
        let (body, data) = exchange(&[1.0, -4.0, 2.0]);
        assert!(send(&mut server, 9, Command::Push, &[Flag::Exchange], body.clone(), data.clone()).is_empty());
        let refused = send(&mut server, 11, Command::Push, &[], String::new(), f32s_to_bytes(&[0.5; 3]));
        assert!(refused[0].1.meta.status == -1 && refused[0].1.meta.body.contains("a plain push while the workers' scheme exchange 'max' is being gathered"), "{}", refused[0].1.meta.body);
        let twice = send(&mut server, 9, Command::Push, &[Flag::Exchange], body, data);
        assert!(twice[0].1.meta.body.contains("node 9 pushed twice in one round"), "{}", twice[0].1.meta.body);
        let (body, data) = exchange(&[3.0, -5.0, 0.0]);
        let done = send(&mut server, 11, Command::Push, &[Flag::Exchange], body, data);
        assert_eq!(done.iter().map(|(to, r)| (*to, r.meta.status)).collect::<Vec<_>>(), vec![(9, 0), (11, 0)]);
        assert_eq!(scheme::from_wire(&done[0].1.data).unwrap(), Part::F32(vec![3.0, -4.0, 2.0]));
        // The value is untouched by the exchange, and a worker's close fails the next round's waiters.
        assert_eq!(send(&mut server, 9, Command::Pull, &[], String::new(), Vec::new())[0].1.data.to_vec(), f32s_to_bytes(&[1.5, 2.5, 3.5]));
        assert!(send(&mut server, 9, Command::Push, &[], String::new(), f32s_to_bytes(&[1.0; 3])).is_empty());
        let mut bye = Meta::new(Command::WorkerDone, 11);
        bye.request_id = 1;
        let failed = server.handle(Message { meta: bye, data: Payload::empty() });
        assert!(failed.iter().any(|(to, r)| *to == 9 && r.meta.status == -1 && r.meta.body.contains("worker node 11 closed its store")), "{failed:?}");
    }

    /// A float16 key sums float32 pushes as MXNet adds float16 arrays, each
    /// partial sum rounded: 1 + 0.0004 + 0.0004 stays 1, where one rounding
    /// of the whole sum would give 1.000977.
    #[test]
    fn a_float16_key_rounds_each_partial_sum() {
        let mut server = Server::new(3, 8);
        let send = |server: &mut Server, sender: i32, command: Command, body: String, data: Vec<u8>| {
            let mut m = Meta::new(command, sender);
            (m.key, m.len, m.request_id) = (Some(Key::Int(1)), 2, 1);
            m.body = body;
            server.handle(Message { meta: m, data: Payload::from(data) })
        };
        let init = encode_pairs([("shape", "2"), ("sync", "1"), ("dtype", "float16")]);
        assert_eq!(send(&mut server, 9, Command::Init, init, f32s_to_bytes(&[0.0; 2]))[0].1.meta.status, 0);
        for (sender, x) in [(9, [1.0f32, 0.5]), (10, [0.0004, 0.25]), (11, [0.0004, 0.125])] {
            send(&mut server, sender, Command::Push, String::new(), f32s_to_bytes(&x));
        }
        assert_eq!(send(&mut server, 9, Command::Pull, String::new(), Vec::new())[0].1.data.to_vec(), f32s_to_bytes(&[1.0, 0.875]));
    }
}
