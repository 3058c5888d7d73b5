//! A push's encode as steps: the local work between the exchanges a scheme
//! makes before its final part (QSGD's scale and scale indices, PowerSGD's
//! `P`). `Encoder::resume` runs until the next exchange and hands it out as
//! an `Ask`; whoever holds the encoder runs it (through a `Collective`, or
//! batched with other tensors' asks) and resumes with the answer. No
//! thread waits on an exchange: `scheme::encode` drives one encoder, the
//! torch group drives a bucket's encoders side by side on one thread.

use std::borrow::Cow;

use super::{bad, non_finite_factor, previous, qsgd_codes, selection, sum_of, sum_packed, Ctx, Part, State, ONE_BIT_CODES};
use super::randomk::gather;
use crate::error::{Error, Result};
use crate::quant::collective::{self, Collective};
use crate::quant::compression::{Compression, Qsgd};
use crate::quant::{noise, onebit, powersgd, qsgd, twobit};

/// An exchange an encode needs answered before it goes on: the buffer is
/// this process's contribution, and comes back reduced over every member.
#[derive(Debug)]
pub enum Ask {
    /// MAX over members (QSGD's shared scale).
    Max(Vec<f32>),
    /// SUM over members, in member order (PowerSGD's `P`).
    Sum(Vec<f32>),
    /// MIN over members of scale indices below `count`.
    Min { levels: Vec<u8>, count: u8 },
}

impl Ask {
    /// Runs the exchange through `coll`.
    pub fn run(&mut self, coll: &mut dyn Collective) -> Result<()> {
        match self {
            Ask::Max(x) => coll.max_f32(x),
            Ask::Sum(x) => coll.sum_f32(x),
            Ask::Min { levels, count } => coll.min_u8(levels, *count),
        }
    }

    /// Asks that one reduction can serve together: the same operation (and,
    /// for scale indices, the same count).
    pub fn joins(&self, other: &Ask) -> bool {
        match (self, other) {
            (Ask::Max(_), Ask::Max(_)) | (Ask::Sum(_), Ask::Sum(_)) => true,
            (Ask::Min { count: a, .. }, Ask::Min { count: b, .. }) => a == b,
            _ => false,
        }
    }

    /// Serves `asks` (every one `joins` the first) with one reduction of
    /// their buffers concatenated in order; the bits are those of one
    /// reduction each, as every reduction here is element-wise.
    pub fn run_joined(asks: &mut [&mut Ask], coll: &mut dyn Collective) -> Result<()> {
        let Some(first) = asks.first() else { return Ok(()) };
        if asks.iter().any(|a| !first.joins(a)) {
            return Err(Error::Internal("exchanges of different kinds joined in one reduction".into()));
        }
        macro_rules! joined {
            ($get:expr, $t:ty, $run:expr) => {{
                let mut all: Vec<$t> = Vec::with_capacity(asks.iter_mut().map(|a| $get(&mut **a).len()).sum());
                asks.iter_mut().for_each(|a| all.extend_from_slice($get(&mut **a)));
                $run(&mut all)?;
                let mut at = 0;
                for a in asks.iter_mut() {
                    let mine: &mut Vec<$t> = $get(&mut **a);
                    let len = mine.len();
                    mine.copy_from_slice(&all[at..at + len]);
                    at += len;
                }
                Ok(())
            }};
        }
        fn floats(a: &mut Ask) -> &mut Vec<f32> {
            match a {
                Ask::Max(x) | Ask::Sum(x) => x,
                Ask::Min { .. } => unreachable!("joined asks share their kind"),
            }
        }
        fn levels(a: &mut Ask) -> &mut Vec<u8> {
            match a {
                Ask::Min { levels, .. } => levels,
                _ => unreachable!("joined asks share their kind"),
            }
        }
        match &**first {
            Ask::Max(_) => joined!(floats, f32, |x: &mut Vec<f32>| coll.max_f32(x)),
            Ask::Sum(_) => joined!(floats, f32, |x: &mut Vec<f32>| coll.sum_f32(x)),
            Ask::Min { count, .. } => {
                let count = *count;
                joined!(levels, u8, |x: &mut Vec<u8>| coll.min_u8(x, count))
            }
        }
    }
}

/// What `resume` reached: an exchange to run, or the encode's result
/// (the exchanged values and the final contribution).
#[derive(Debug)]
pub enum Step {
    Ask(Ask),
    Done(Vec<Part>, Part),
}

/// Where an encode stands between two exchanges.
enum Stage<'a> {
    Start,
    /// QSGD waits for its shared scale.
    QsgdScale { xs: Vec<Cow<'a, [f32]>>, mine_finite: bool },
    /// QSGD (two or more scales) waits for the scale indices.
    QsgdLevels { xs: Vec<Cow<'a, [f32]>>, scale: Vec<f32> },
    /// PowerSGD waits for `P`.
    PowerP { rows: usize, cols: usize, r: usize },
    Over,
}

/// One push's encode (`scheme::encode`'s contract), stopped at each exchange.
pub struct Encoder<'a> {
    c: &'a Compression,
    states: &'a mut [State],
    grads: &'a [&'a [f32]],
    ctx: Ctx<'a>,
    /// The collective's `lanes_for`: how many members' codes a final lane holds.
    lanes_for: usize,
    stage: Stage<'a>,
}

impl<'a> Encoder<'a> {
    pub fn new(c: &'a Compression, states: &'a mut [State], grads: &'a [&'a [f32]], ctx: Ctx<'a>, lanes_for: usize) -> Encoder<'a> {
        Encoder { c, states, grads, ctx, lanes_for, stage: Stage::Start }
    }

    /// Goes on to the next exchange or the end: `answer` is `None` the
    /// first time, then the last `Ask`, reduced. An error ends the encode.
    pub fn resume(&mut self, answer: Option<Ask>) -> Result<Step> {
        let stage = std::mem::replace(&mut self.stage, Stage::Over);
        match (stage, answer) {
            (Stage::Start, None) => self.start(),
            (Stage::QsgdScale { xs, mine_finite }, Some(Ask::Max(scale))) => self.qsgd_scaled(xs, mine_finite, scale),
            (Stage::QsgdLevels { xs, scale }, Some(Ask::Min { levels, .. })) => self.qsgd_final(xs, scale, Some(levels)),
            (Stage::PowerP { rows, cols, r }, Some(Ask::Sum(p))) => self.power_final(p, rows, cols, r),
            _ => Err(Error::Internal("an encode resumed with an answer it did not ask for".into())),
        }
    }

    fn start(&mut self) -> Result<Step> {
        let (states, grads, ctx) = (&mut *self.states, self.grads, &self.ctx);
        if states.len() != grads.len() || grads.is_empty() {
            return Err(Error::Internal(format!("{} states for {} gradients", states.len(), grads.len())));
        }
        let n = grads[0].len();
        // A next residual left by an encode that was never finished is stale.
        states.iter_mut().for_each(|s| s.pending = false);
        match self.c {
            Compression::Qsgd(q) => self.qsgd_start(q),
            Compression::PowerSgd { rank, seed } => {
                let Some((rows, cols, r)) = powersgd::factors(ctx.shape, *rank as usize) else {
                    return Ok(Step::Done(Vec::new(), Part::F32(sum_of(grads)?)));
                };
                // Each member's warm start, with a missing or collapsed column
                // drawn from (seed, step, key): the same on every worker, whose
                // Qs are the same sum. (Q is not written here: `finish` does.)
                let draw = || noise::stream_seed(*seed, ctx.step, ctx.key_hash, u64::MAX);
                // Error feedback: compress g + e into the spare residual, which
                // keeps what the approximation missed; `finish` swaps it in.
                let mut p = vec![0f32; rows * r];
                let mut mine = Vec::new();
                let mut zeros = Vec::new();
                for (i, (s, g)) in states.iter_mut().zip(grads).enumerate() {
                    let mut next = std::mem::take(&mut s.spare_residual);
                    next.resize(n, 0.0);
                    let residual = previous(&s.residual, n, &mut zeros);
                    let q = powersgd::warm_start(&s.q, cols, r, draw);
                    let dst = if i == 0 { &mut p } else { mine.resize(rows * r, 0.0); &mut mine };
                    powersgd::add_then_m_times_q(residual, g, &mut next, &q, rows, cols, r, dst);
                    s.spare_residual = next;
                    if i > 0 {
                        collective::sum_into(&mut p, &mine)?;
                    }
                }
                self.stage = Stage::PowerP { rows, cols, r };
                Ok(Step::Ask(Ask::Sum(p)))
            }
            Compression::OneBit { threshold } => {
                // Out of place, as PowerSGD: `finish` swaps the next residual in.
                let mut zeros = Vec::new();
                let bits = sum_packed(states, n, ONE_BIT_CODES, self.lanes_for, |i, s, words, width, add| {
                    s.spare_residual.resize(n, 0.0);
                    let residual = previous(&s.residual, n, &mut zeros);
                    if add {
                        onebit::quantize_packed::<true>(grads[i], residual, &mut s.spare_residual, *threshold, words, width);
                    } else {
                        onebit::quantize_packed::<false>(grads[i], residual, &mut s.spare_residual, *threshold, words, width);
                    }
                    s.pending = true;
                })?;
                Ok(Step::Done(Vec::new(), bits))
            }
            Compression::TwoBit(th) => {
                // One lane per element, 1 at +pos and b at neg (`twobit`), with
                // b above every member count, so a sum holds both counts. The
                // store has checked that every residual + gradient is finite
                // before any worker agreed.
                let b = self.lanes_for.max(states.len()) as i32 + 1;
                let mut zeros = Vec::new();
                let codes = sum_packed(states, n, (0, b), self.lanes_for, |i, s, words, width, add| {
                    s.spare_residual.resize(n, 0.0);
                    let residual = previous(&s.residual, n, &mut zeros);
                    if add {
                        twobit::quantize_packed::<true>(grads[i], residual, &mut s.spare_residual, *th, b, words, width);
                    } else {
                        twobit::quantize_packed::<false>(grads[i], residual, &mut s.spare_residual, *th, b, words, width);
                    }
                    s.pending = true;
                })?;
                Ok(Step::Done(Vec::new(), codes))
            }
            Compression::None => Ok(Step::Done(Vec::new(), Part::F32(sum_of(grads)?))),
        }
    }

    fn power_final(&mut self, p: Vec<f32>, rows: usize, cols: usize, r: usize) -> Result<Step> {
        if p.len() != rows * r {
            return Err(Error::Internal(format!("PowerSGD's P came back with {} values, not {}", p.len(), rows * r)));
        }
        // The same P on every worker: the same error on every worker.
        non_finite_factor("P", &p)?;
        let mut p_hat = p.clone();
        powersgd::orthogonalize(&mut p_hat, rows, r);
        let (mut q_sum, mut q_local) = (vec![0f32; cols * r], vec![0f32; cols * r]);
        for (i, s) in self.states.iter_mut().enumerate() {
            powersgd::mt_times_p(&s.spare_residual, &p_hat, rows, cols, r, &mut q_local);
            powersgd::p_times_qt(&p_hat, &q_local, rows, cols, r, &mut s.spare_residual, true);
            s.pending = true;
            if i == 0 {
                q_sum.copy_from_slice(&q_local);
            } else {
                collective::sum_into(&mut q_sum, &q_local)?;
            }
        }
        Ok(Step::Done(vec![Part::F32(p)], Part::F32(q_sum)))
    }

    fn qsgd(&self) -> Result<&'a Qsgd> {
        match self.c {
            Compression::Qsgd(q) => Ok(q),
            _ => Err(Error::Internal("a QSGD step of another scheme".into())),
        }
    }

    fn qsgd_start(&mut self, q: &'a Qsgd) -> Result<Step> {
        let (states, grads, ctx) = (&mut *self.states, self.grads, &self.ctx);
        if ctx.workers as u64 > qsgd::max_workers(q.bits()[0])? {
            return Err(bad("bits", format!("{} workers could overflow the code sum at {} bits", ctx.workers, q.bits()[0])));
        }
        let idx = selection(q, grads[0].len(), ctx.step, ctx.key_hash);
        let xs: Vec<Cow<'a, [f32]>> = grads
            .iter()
            .zip(states.iter_mut())
            .map(|(g, s)| match &idx {
                Some(idx) => {
                    let mut x = std::mem::take(&mut s.spare_gathered);
                    gather(g, idx, &mut x);
                    Cow::Owned(x)
                }
                None => Cow::Borrowed(*g),
            })
            .collect();
        // A non-finite gradient anywhere poisons the shared scale, so every
        // worker fails this push together instead of waiting on the others.
        // Random-K sends k coordinates, but a non-finite value in any of them is
        // refused as every scheme refuses it: 'zero' would drop it silently and
        // 'local' would put it in the value (one more read of the gradient).
        let whole_finite = idx.is_none() || grads.iter().all(|g| qsgd::max_abs(g).is_some());
        let scale = if whole_finite { xs.iter().map(|x| qsgd::max_abs(x).unwrap_or(f32::INFINITY)).fold(0f32, f32::max) } else { f32::INFINITY };
        let mine_finite = scale.is_finite();
        self.stage = Stage::QsgdScale { xs, mine_finite };
        Ok(Step::Ask(Ask::Max(vec![scale])))
    }

    fn qsgd_scaled(&mut self, xs: Vec<Cow<'a, [f32]>>, mine_finite: bool, scale: Vec<f32>) -> Result<Step> {
        let q = self.qsgd()?;
        if scale.len() != 1 {
            return Err(Error::Internal(format!("QSGD's scale came back as {} values", scale.len())));
        }
        if !mine_finite {
            // A member here: say which value and element.
            let grads = self.grads;
            let (m, i) = grads.iter().enumerate().find_map(|(m, g)| g.iter().position(|v| !v.is_finite()).map(|i| (m, i))).unwrap_or((0, 0));
            return Err(Error::Store(format!("pushed value {m} holds {} at element {i}, a non-finite value; nothing was applied", grads[m][i])));
        }
        if !scale[0].is_finite() {
            return Err(bad("gradient", "a worker pushed a non-finite value (inf or NaN); nothing was applied".into()));
        }
        let levels = q.levels();
        if levels.len() == 1 {
            return self.qsgd_final(xs, scale, None);
        }
        let len = xs[0].len();
        let (mut l, mut mine) = (std::mem::take(&mut self.states[0].spare_levels), Vec::new());
        l.resize(len, 0);
        for (i, x) in xs.iter().enumerate() {
            if i == 0 {
                qsgd::fit_levels(x, scale[0], &levels, &mut l);
            } else {
                mine.resize(len, 0);
                qsgd::fit_levels(x, scale[0], &levels, &mut mine);
                collective::min_into(&mut l, &mine)?;
            }
        }
        self.stage = Stage::QsgdLevels { xs, scale };
        Ok(Step::Ask(Ask::Min { levels: l, count: levels.len() as u8 }))
    }

    fn qsgd_final(&mut self, xs: Vec<Cow<'a, [f32]>>, scale: Vec<f32>, level_of: Option<Vec<u8>>) -> Result<Step> {
        let q = self.qsgd()?;
        let levels = q.levels();
        let len = xs[0].len();
        if level_of.as_ref().is_some_and(|l| l.len() != len) {
            return Err(Error::Internal("QSGD's scale indices came back with another length".into()));
        }
        let ctx = &self.ctx;
        // The scale is a MAX that includes every member's finite max|x|: no need to check x again.
        let codes = sum_packed(self.states, len, qsgd_codes(q), self.lanes_for, |i, _, words, width, add| {
            let (x, seed) = (&xs[i], noise::stream_seed(q.seed, ctx.step, ctx.key_hash, ctx.member + i as u64));
            if add {
                qsgd::quantize_levels_packed::<true>(x, scale[0], &levels, level_of.as_deref(), seed, words, width);
            } else {
                qsgd::quantize_levels_packed::<false>(x, scale[0], &levels, level_of.as_deref(), seed, words, width);
            }
        })?;
        let mut exchanged = vec![Part::F32(scale)];
        if let Some(l) = level_of {
            exchanged.push(Part::Levels { levels: l, count: levels.len() as u8 });
        }
        for (s, x) in self.states.iter_mut().zip(xs) {
            if let Cow::Owned(x) = x {
                s.spare_gathered = x; // fresh pages cost more than the gather
            }
        }
        Ok(Step::Done(exchanged, codes))
    }
}
