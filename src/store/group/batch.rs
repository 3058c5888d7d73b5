//! A bucket's encodes, their exchanges batched: tensors whose scheme
//! exchanges values before its final part (QSGD's scale and scale indices,
//! PowerSGD's P) encode side by side on scoped threads, and once
//! every unfinished encode waits on an exchange, the waiting requests go to
//! the engine as one all-reduce per (operation, element type), concatenated
//! in tensor order. Every rank holds the same tensors and compression, so
//! every rank makes the same batched calls in the same order. Schemes with
//! no exchange before the final part encode on the caller's thread.

use std::sync::mpsc::{channel, Sender};

use crate::quant::engine::{Buffer, Engine, Lanes, ReduceOp};
use crate::error::{Error, Result};
use crate::quant::compression::Compression;
use crate::quant::scheme;

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

/// One encode's exchange, waiting for its batch.
struct Request {
    slot: usize,
    op: ReduceOp,
    data: Data,
    reply: Sender<Result<Data>>,
}

type Encoded = Result<(Vec<scheme::Part>, scheme::Part)>;

enum Msg {
    Reduce(Request),
    Done { slot: usize, result: Encoded },
}

/// An encode thread's engine: each all-reduce waits for its batch's result.
struct Batched {
    tx: Sender<Msg>,
    slot: usize,
}

impl Engine for Batched {
    fn all_reduce(&mut self, op: ReduceOp, buf: Buffer<'_>) -> Result<()> {
        let (reply, answer) = channel();
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

/// Reduces the waiting requests (in tensor order) as one all-reduce per
/// (operation, element type), in the order of each pair's first request,
/// and answers each; an engine error answers every request left.
fn serve(waiting: Vec<Request>, coll: &mut Lanes<&mut dyn Engine>) {
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

/// One tensor's encode: its context, gradient and state.
pub type Job<'a> = (scheme::Ctx<'a>, &'a [f32], &'a mut scheme::State);

/// Whether the scheme exchanges anything before its final part.
fn exchanges(c: &Compression) -> bool {
    matches!(c, Compression::Qsgd(_) | Compression::PowerSgd { .. })
}

/// Encodes every job (`scheme::encode`), each exchange through `coll`:
/// on the caller's thread when the scheme exchanges nothing first or there
/// is one job, else one scoped thread a job. (Not rayon's threads: an
/// encode blocks on its batch, and a rayon worker waiting inside a kernel's
/// parallel loop may pick up another encode and block under it.)
pub fn encode(c: &Compression, jobs: Vec<Job>, coll: &mut Lanes<&mut dyn Engine>) -> Vec<Encoded> {
    if jobs.len() <= 1 || !exchanges(c) {
        return jobs.into_iter().map(|(ctx, grad, state)| scheme::encode(c, std::slice::from_mut(state), &[grad], &ctx, coll)).collect();
    }
    let count = jobs.len();
    let workers = coll.workers;
    let (tx, rx) = channel::<Msg>();
    let mut results: Vec<Option<Encoded>> = (0..count).map(|_| None).collect();
    std::thread::scope(|s| {
        for (slot, (ctx, grad, state)) in jobs.into_iter().enumerate() {
            let tx = tx.clone();
            s.spawn(move || {
                let mut engine = Batched { tx: tx.clone(), slot };
                let mut own = Lanes::new(&mut engine, workers);
                let result = scheme::encode(c, std::slice::from_mut(state), &[grad], &ctx, &mut own);
                let _ = tx.send(Msg::Done { slot, result });
            });
        }
        drop(tx);
        let (mut live, mut waiting) = (count, Vec::<Request>::new());
        while live > 0 {
            match rx.recv() {
                Ok(Msg::Done { slot, result }) => {
                    results[slot] = Some(result);
                    live -= 1;
                }
                Ok(Msg::Reduce(r)) => waiting.push(r),
                Err(_) => break, // every encode has ended
            }
            if live > 0 && waiting.len() == live {
                waiting.sort_by_key(|r| r.slot);
                serve(std::mem::take(&mut waiting), coll);
            }
        }
    });
    results.into_iter().map(|r| r.unwrap_or_else(|| Err(Error::Internal("a tensor's encode ended without a result".into())))).collect()
}
