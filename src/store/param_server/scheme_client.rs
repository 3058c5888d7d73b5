//! A worker's side of a scheme round (MXNet's KVStoreDist, scheme part):
//! the scheme's exchanges through the servers of the key's slices, as its
//! `Collective` (`ServerExchange`), then the final contribution, which each
//! server sums, decodes and applies for its slice. A round runs on a thread
//! of its own (`SchemeRound::run`), owning what it needs, so that a push
//! returns before the other workers join its round (as MXNet's push does).

use std::ops::Range;
use std::sync::Arc;

use super::message::{encode_pairs, Exchange, Flag, Message, Meta};
use super::postoffice::Postoffice;
use super::slices::{reply_check, Slice};
use crate::error::{Error, Result};
use crate::quant::collective::Collective;
use crate::quant::compression::Compression;
use crate::quant::scheme::{self, Part};
use crate::store::Key;

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
    /// Told once this worker's first message of the round is on its way:
    /// the push that started the round returns then, so that what the
    /// worker sends next (a barrier) reaches each server after its turn.
    started: Option<std::sync::mpsc::Sender<()>>,
}

impl ServerExchange<'_> {
    /// Sends `parts[i]` to slice `i`'s server under `meta`'s header and
    /// returns the replies' payloads in slice order; any server's error is
    /// the error (and marks that server refused).
    fn send(&mut self, meta: impl Fn(&Slice) -> Meta, parts: Vec<Vec<u8>>) -> Result<Vec<Message>> {
        let requests = self.slices.iter().zip(parts).map(|(s, p)| (s.server, meta(s), p)).collect();
        let sent = self.post.request_later(requests, reply_check(self.slices));
        if let Some(started) = self.started.take() {
            let _ = started.send(());
        }
        let replies = sent.and_then(|id| self.post.wait_all(id)).inspect_err(|_| self.refused.iter_mut().for_each(|r| *r = true))?;
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
    /// (The same bits from every server: a sum that is NaN is still the
    /// same sum, for the scheme to refuse by name.)
    fn exchange_f32(&mut self, op: Exchange, x: &mut [f32]) -> Result<()> {
        let replies = self.exchange(op, vec![Part::F32(x.to_vec()); self.slices.len()])?;
        let bits = |r: &Part| match r {
            Part::F32(v) => Some(v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()),
            _ => None,
        };
        match &replies[0] {
            Part::F32(v) if v.len() == x.len() && replies.iter().all(|r| bits(r) == bits(&replies[0])) => Ok(x.copy_from_slice(v)),
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

/// Tells the key's servers (but those in `refused`, where the round already
/// failed) that this worker's part of a scheme round failed here (before
/// exchange `phase`): the round fails for every worker, with `err` as the
/// cause. Returns the request whose replies come when the round ends
/// (`Postoffice::wait`), or None when no server is left to tell.
pub fn abort_round(post: &Postoffice, key: &Key, slices: &[Slice], refused: &[bool], step: u64, phase: usize, err: &Error) -> Option<Result<u64>> {
    let cause = err.to_string().replace('\n', " ");
    let body = encode_pairs([("op", "abort"), ("step", step.to_string().as_str()), ("phase", phase.to_string().as_str()), ("cause", cause.as_str())]);
    let parts: Vec<_> = slices
        .iter()
        .enumerate()
        .filter(|(i, _)| !refused.get(*i).copied().unwrap_or(false))
        .map(|(_, s)| (s.server, s.round_meta(key, &[Flag::Exchange, Flag::Abort], &body), Vec::new()))
        .collect();
    (!parts.is_empty()).then(|| post.request_later(parts, reply_check(slices)))
}

/// One scheme push of a key, owning all it needs: checked by the worker
/// (`scheme::check_input`, finite values) before it starts.
pub struct SchemeRound {
    pub post: Arc<Postoffice>,
    pub key: Key,
    pub shape: Vec<usize>,
    pub slices: Vec<Slice>,
    pub compression: Compression,
    pub rank: usize,
    pub workers: usize,
    /// The key's scheme state, and the state of the round (`next`, its buffers reused).
    pub state: scheme::State,
    pub next: scheme::State,
    /// This worker's merged gradient.
    pub merged: Vec<f32>,
    /// Told when the round's first message is sent, or when it ends first.
    pub started: Option<std::sync::mpsc::Sender<()>>,
}

/// What a round hands back to the key: its states (`state` changed only when
/// every server accepted the round), the gradient buffer, the values the
/// servers answered with (what a pull would fetch), and the outcome.
pub struct RoundEnd {
    pub state: scheme::State,
    pub next: scheme::State,
    pub merged: Vec<f32>,
    pub pulled: Option<Vec<Message>>,
    pub result: Result<()>,
}

impl SchemeRound {
    pub fn run(mut self) -> RoundEnd {
        let mut pulled = None;
        let result = self.round(&mut pulled);
        RoundEnd { state: self.state, next: self.next, merged: self.merged, pulled, result }
    }

    fn round(&mut self, pulled: &mut Option<Vec<Message>>) -> Result<()> {
        let started = self.started.take();
        let (key, slices, compression, state, next, merged) = (&self.key, &self.slices[..], self.compression, &mut self.state, &mut self.next, &self.merged[..]);
        next.clone_from(state);
        let workers = self.workers;
        let ctx = scheme::Ctx { shape: &self.shape, step: state.step, key_hash: key.stable_hash(), member: self.rank as u64, workers };
        let ranges: Vec<Range<usize>> = slices.iter().map(|s| s.offset..s.offset + s.len).collect();
        let pieces = scheme::pieces(&compression, state.step, ctx.key_hash, &ranges);
        let mut exchange = ServerExchange { post: &self.post, key, slices, pieces, step: state.step, phase: 0, workers, refused: vec![false; slices.len()], started };
        let encoded = scheme::encode(&compression, std::slice::from_mut(next), &[merged], &ctx, &mut exchange);
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
                let abort = abort_round(&self.post, key, slices, &exchange.refused, state.step, exchange.phase, &err);
                drop(exchange.started.take()); // (the abort is this worker's turn)
                if let Some(Ok(id)) = abort {
                    let _ = self.post.wait(id); // the round ends for every worker
                }
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
}
