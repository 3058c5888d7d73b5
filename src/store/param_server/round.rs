//! A server's round machine for one slice of a key (MXNet's server logic
//! over ps-lite's KVServer): the workers' turns in the current round (a
//! plain push, 2-bit or float32, or one exchange of a scheme's round), what
//! they have gathered, who waits for the answer, and an abort's cause; and
//! the responses that end a round. `server` drives it; it knows no socket.

use super::message::{Command, Exchange, Message, Meta, Payload};
use crate::codec::Thresholds;
use crate::error::{Error, Result};
use crate::store::Key;
use crate::quant::{collective, scheme, scheme::Part};

/// A scheme's progress on one slice from round to round.
#[derive(Default)]
pub struct SchemeSteps {
    /// Completed rounds: the step every worker's push must carry.
    pub step: u64,
    /// This round's completed reductions, in order.
    pub exchanged: Vec<Part>,
    /// Some worker contributed to a round of this key. Until then the first
    /// push sets `step`: workers resumed from a checkpoint go on from theirs.
    pub started: bool,
}

/// The one round machine of a slice, whatever the compression: the workers'
/// contributions to the current round (a plain push, 2-bit or float32, or
/// one exchange of a scheme's round), who waits for the answer, and whether
/// a worker aborted it. A sync round is answered once every worker took its
/// turn; an async push is a round of its own.
#[derive(Default)]
pub struct Round {
    pub gathering: Gathering,
    /// Workers that took their turn: (node id, request id).
    pub waiting: Vec<(i32, u64)>,
    /// A worker's push failed on the worker (`Flag::Abort`): its turn
    /// counts, and once every worker took its turn all get this error and
    /// the value stays as it was.
    pub aborted: Option<String>,
}

/// What a round has gathered so far.
#[derive(Default)]
pub enum Gathering {
    /// No part yet (or only aborts).
    #[default]
    Nothing,
    /// Plain pushes, summed as `PlainSum` says.
    Plain(PlainSum),
    /// A scheme's exchange `op` (or its final contribution).
    Exchange(Exchange, Gathered),
}

/// How a round's plain pushes are summed.
#[derive(Clone, Copy, PartialEq)]
pub enum PlainSum {
    /// Every push so far was 2-bit with these thresholds: codes are counted
    /// in the slot's `round_pos` and `round_neg`.
    Counts(Thresholds),
    /// float32 sum in the slot's `merge` (float32 pushes, or 2-bit ones with
    /// mixed thresholds).
    Float,
}

impl Round {
    /// Refuses a second turn of `sender` in this round.
    pub fn check_turn(&self, sender: i32, key: &Key) -> Result<()> {
        if self.waiting.iter().any(|(s, _)| *s == sender) {
            return Err(Error::Key { key: key.to_string(), problem: format!("node {sender} pushed twice in one round") });
        }
        Ok(())
    }

    /// Worker `sender` failed its push on the worker: the round's cause of
    /// failure, unless an earlier abort gave one. (Its turn still counts.)
    pub fn abort(&mut self, sender: i32, key: &Key, cause: &str) {
        let cause: String = cause.chars().take(1000).collect();
        self.aborted.get_or_insert(format!("worker node {sender} failed its push of key {key}: {cause}"));
    }

    /// Whether `node` took its turn in a round others wait in.
    pub fn waits_without(&self, node: i32) -> bool {
        !self.waiting.is_empty() && !self.waiting.iter().any(|(s, _)| *s == node)
    }

    /// Ends the round: every waiting worker gets `result`; the next starts empty.
    pub fn answer(&mut self, meta: &Meta, me: i32, result: Result<Payload>) -> Vec<(i32, Message)> {
        let waiting: Vec<(i32, u64)> = self.waiting.drain(..).collect();
        self.gathering = Gathering::Nothing;
        self.aborted = None;
        answer_all(meta, me, waiting, result)
    }

    /// A round some worker aborted (None when none did): no answer until
    /// every worker took its turn, then the abort's error to all of them.
    pub fn end_aborted(&mut self, meta: &Meta, me: i32, num_workers: usize) -> Option<Vec<(i32, Message)>> {
        let why = self.aborted.clone()?;
        Some(if self.waiting.len() < num_workers { Vec::new() } else { self.answer(meta, me, Err(Error::JobFailed(why))) })
    }
}

/// A reduction being gathered: parts reduced as they come, float32 sums
/// kept until every worker's is in and then added in rank order (as the
/// device store adds its devices; every server of a key gets the same
/// bits), or final codes summed in the packed lanes they arrive in
/// (`scheme::LaneSum`).
pub enum Gathered {
    Part(Part),
    Ordered(Vec<(i32, Vec<f32>)>),
    Lanes(scheme::LaneSum),
}

impl Gathered {
    /// The first worker's part (from node `sender`) of a reduction `op`.
    pub fn first(op: Exchange, sender: i32, part: Part) -> Gathered {
        match (op, part) {
            (Exchange::Sum | Exchange::Final, Part::F32(x)) => Gathered::Ordered(vec![(sender, x)]),
            (_, part) => Gathered::Part(part),
        }
    }

    /// Adds another worker's part.
    pub fn add(&mut self, op: Exchange, sender: i32, part: Part) -> Result<()> {
        match (self, part) {
            (Gathered::Ordered(parts), Part::F32(x)) if parts[0].1.len() == x.len() => {
                parts.push((sender, x));
                Ok(())
            }
            (Gathered::Part(acc), part) => combine(op, acc, part),
            _ => Err(mismatch(op)),
        }
    }

    /// The reduction of every worker's part. Worker node ids grow with rank.
    pub fn reduced(self) -> Result<Part> {
        match self {
            Gathered::Part(p) => Ok(p),
            Gathered::Ordered(mut parts) => {
                parts.sort_by_key(|(sender, _)| *sender);
                let mut parts = parts.into_iter().map(|(_, x)| x);
                let mut sum = parts.next().unwrap_or_default();
                for x in parts {
                    collective::sum_into(&mut sum, &x)?;
                }
                Ok(Part::F32(sum))
            }
            Gathered::Lanes(sum) => Ok(sum.into_part()),
        }
    }
}

/// Workers' parts of one exchange that cannot be reduced together.
pub fn mismatch(op: Exchange) -> Error {
    Error::Transport(format!("malformed exchange: workers sent different kinds or lengths for '{}'", op.name()))
}

/// `acc = op(acc, part)` elementwise (MAX, MIN); both from workers of one
/// round. (float32 sums are added in rank order by `Gathered::reduced`;
/// codes come only as a final contribution, summed packed by `LaneSum`.)
fn combine(op: Exchange, acc: &mut Part, part: Part) -> Result<()> {
    match (op, acc, part) {
        (Exchange::Max, Part::F32(a), Part::F32(b)) if a.len() == b.len() => collective::max_into(a, &b),
        (Exchange::Min, Part::Levels { levels: a, count }, Part::Levels { levels: b, count: c }) if a.len() == b.len() && *count == c => collective::min_into(a, &b),
        _ => Err(mismatch(op)),
    }
}

pub fn response(to: &Meta, me: i32, result: Result<Payload>) -> (i32, Message) {
    let mut meta = Meta::new(Command::Response, me);
    meta.request_id = to.request_id;
    meta.key = to.key.clone();
    meta.offset = to.offset;
    meta.len = to.len;
    let data = match result {
        Ok(d) => d,
        Err(e) => {
            meta.status = -1;
            meta.body = e.to_string();
            Payload::empty()
        }
    };
    (to.sender, Message { meta, data })
}

/// The same answer to every worker that waited on a round: (node id, request
/// id); one payload, copied, whose digest is computed once.
pub fn answer_all(meta: &Meta, me: i32, waiting: Vec<(i32, u64)>, result: Result<Payload>) -> Vec<(i32, Message)> {
    waiting
        .into_iter()
        .map(|(sender, request_id)| {
            let mut m = meta.clone();
            m.sender = sender;
            m.request_id = request_id;
            response(&m, me, result.clone())
        })
        .collect()
}

