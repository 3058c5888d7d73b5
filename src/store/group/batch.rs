//! A bucket's encodes, their exchanges batched: every tensor's encode runs
//! on the caller's thread as steps (`scheme::Encoder`), each to its next
//! exchange (QSGD's scale and scale indices, PowerSGD's P); the asks of a
//! round go to the collective as one reduction per kind, concatenated in
//! tensor order, and every encode resumes with its share. Every rank holds
//! the same tensors and compression, so every rank makes the same batched
//! calls in the same order. No thread is started or waited on: a kernel
//! may still spread one large tensor over the crate's rayon pool.

use crate::error::{Error, Result};
use crate::quant::collective::Collective;
use crate::quant::compression::Compression;
use crate::quant::scheme::{self, Ask, Encoder, Step};

/// One tensor's encode: its context, gradient and state.
pub type Job<'a> = (scheme::Ctx<'a>, &'a [f32], &'a mut scheme::State);

type Encoded = Result<(Vec<scheme::Part>, scheme::Part)>;

/// Encodes every job (`scheme::encode`), the exchanges of each round
/// joined per kind (`Ask::joins`) into one reduction through `coll`, in
/// the order of each kind's first tensor. An exchange that fails ends
/// every encode still waiting, with its error.
pub fn encode(c: &Compression, jobs: Vec<Job>, coll: &mut dyn Collective) -> Vec<Encoded> {
    let lanes_for = coll.lanes_for();
    let (ctxs, rest): (Vec<scheme::Ctx>, Vec<(&[f32], &mut scheme::State)>) = jobs.into_iter().map(|(ctx, g, s)| (ctx, (g, s))).unzip();
    let (grads, states): (Vec<&[f32]>, Vec<&mut scheme::State>) = rest.into_iter().unzip();
    let mut encoders: Vec<Encoder> = ctxs
        .into_iter()
        .zip(grads.iter())
        .zip(states)
        .map(|((ctx, g), s)| Encoder::new(c, std::slice::from_mut(s), std::slice::from_ref(g), ctx, lanes_for))
        .collect();
    let mut results: Vec<Option<Encoded>> = (0..encoders.len()).map(|_| None).collect();
    let mut asks: Vec<(usize, Ask)> = Vec::new();
    for (slot, e) in encoders.iter_mut().enumerate() {
        settle(slot, e.resume(None), &mut asks, &mut results);
    }
    while !asks.is_empty() {
        let mut round = std::mem::take(&mut asks);
        match serve(&mut round, coll) {
            Ok(()) => {
                for (slot, ask) in round {
                    settle(slot, encoders[slot].resume(Some(ask)), &mut asks, &mut results);
                }
            }
            Err(e) => {
                // (already the transport's own error: wrapped once, where it arose)
                round.into_iter().for_each(|(slot, _)| results[slot] = Some(Err(e.clone())));
            }
        }
    }
    results.into_iter().map(|r| r.unwrap_or_else(|| Err(Error::Internal("a tensor's encode ended without a result".into())))).collect()
}

/// Files an encode's step: its next ask, or its result.
fn settle(slot: usize, step: Result<Step>, asks: &mut Vec<(usize, Ask)>, results: &mut [Option<Encoded>]) {
    match step {
        Ok(Step::Ask(ask)) => asks.push((slot, ask)),
        Ok(Step::Done(exchanged, part)) => results[slot] = Some(Ok((exchanged, part))),
        Err(e) => results[slot] = Some(Err(e)),
    }
}

/// Runs a round's asks (in tensor order) as one reduction per kind, kinds
/// in the order of their first ask.
fn serve(round: &mut [(usize, Ask)], coll: &mut dyn Collective) -> Result<()> {
    // Each ask's kind: the index of the first ask it joins.
    let kinds: Vec<usize> = (0..round.len()).map(|i| (0..=i).find(|&j| round[j].1.joins(&round[i].1)).unwrap_or(i)).collect();
    for kind in (0..round.len()).filter(|&i| kinds[i] == i) {
        let mut picked: Vec<&mut Ask> = round.iter_mut().zip(&kinds).filter(|(_, &k)| k == kind).map(|((_, a), _)| a).collect();
        Ask::run_joined(&mut picked, coll)?;
    }
    Ok(())
}
