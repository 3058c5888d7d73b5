//! The all-reduce-compatible schemes, written once over `Collective`.
//!
//! A push is `encode` (local work plus the exchanges a scheme needs: the
//! shared scale, the scale masks, PowerSGD's `P`), a SUM of the final
//! contribution (integer codes or float32), then `decode`, which needs only
//! the exchanged values and the sum, never a worker's own data: a parameter
//! server holding those runs the same `decode` and gets the same bits.
//!
//! | scheme | exchanges | final contribution | decode |
//! |---|---|---|---|
//! | qsgd_mn | MAX scale | codes in [-s, s] | sum M/s |
//! | qsgd_mn_ts / _ms | MAX scale, MIN scale index | codes in [-s_0, s_0] | sum M/s_j |
//! | grandk_mn / _ts | as above, on k coordinates from (seed, step, key) | codes | scattered, zeros elsewhere |
//! | powersgd | SUM of P = M Q | Q = M^T orth(P) | orth(P) Q^T |
//! | 1bit | none | bits | 2 sum - workers |
//! | 2bit | none | +pos and neg indicators | p pos + q neg |
//!
//! All aggregates are sums over workers, as every KVStore push is.
//!
//! This file owns the algebra: `Ctx`, `Part`, `State`, the checks, and
//! encode -> sum -> decode -> finish with the all-reduce path that runs
//! them in turn. `randomk` chooses random-K's coordinates; `wire` turns
//! parts into bytes and back. The quantizers themselves are `qsgd`,
//! `onebit`, `twobit` and `powersgd`'s; this module only calls them.

mod randomk;
mod steps;
mod wire;

use std::borrow::Cow;
use std::ops::Range;

use rayon::prelude::*;

pub use randomk::selection;
pub use steps::{Ask, Encoder, Step};
pub use wire::{from_wire, is_codes_wire, sum_to_wire, to_wire, value_from_wire, value_to_wire, LaneSum};
use randomk::{scatter, selected_in};
use super::collective::{self, Collective};
use super::{lanes, powersgd, qsgd, twobit};
use super::compression::{Compression, Qsgd};
use crate::error::{Error, Result};

/// Where and when a push happens.
#[derive(Clone, Copy, Debug)]
pub struct Ctx<'a> {
    pub shape: &'a [usize],
    /// The key's push count (the same on every worker).
    pub step: u64,
    pub key_hash: u64,
    /// This worker's (or device's) index: its own rounding noise.
    pub member: u64,
    pub workers: usize,
}

/// A buffer exchanged or summed.
#[derive(Clone, Debug, PartialEq)]
pub enum Part {
    F32(Vec<f32>),
    /// Scale indices below `count`.
    Levels { levels: Vec<u8>, count: u8 },
    /// Integer codes, each worker's in `lo..=hi` (sums: `workers` times that).
    Codes { codes: Vec<i32>, lo: i32, hi: i32 },
    /// `n` codes summed in packed lanes (`lanes`' layout) of `width` bits:
    /// lane `i` holds `code_i - lo` summed over `count` members, each
    /// member's codes in `lo..=hi`. What QSGD's quantizer writes, with
    /// lanes wide enough for the sum, so an MPI SUM adds the words.
    Packed { words: Vec<u64>, n: usize, lo: i32, hi: i32, count: u32, width: u32 },
}

impl Part {
    /// A `Packed` part as `Codes` (sums of codes); any other as it is.
    pub fn unpacked(&self) -> Result<Cow<'_, Part>> {
        match self {
            Part::Packed { words, n, lo, hi, count, width } => {
                let mut codes = vec![0i32; *n];
                let base = *lo as i64 * *count as i64;
                lanes::unpack_codes(words, *width, base, &mut codes)?;
                Ok(Cow::Owned(Part::Codes { codes, lo: *lo, hi: *hi }))
            }
            part => Ok(Cow::Borrowed(part)),
        }
    }

    /// Values held: float32s, scale indices or codes.
    pub fn len(&self) -> usize {
        match self {
            Part::F32(x) => x.len(),
            Part::Levels { levels, .. } => levels.len(),
            Part::Codes { codes, .. } => codes.len(),
            Part::Packed { n, .. } => *n,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values in each of `ranges`, as parts of the same kind: a
    /// parameter-server worker's pieces of a part for the servers of a key's
    /// slices (`pieces`). Packed lanes are cut between whole lane groups
    /// (`lanes::place`) as words; elsewhere they are unpacked first.
    pub fn split(&self, ranges: &[Range<usize>]) -> Result<Vec<Part>> {
        let len = self.len();
        if let Some(r) = ranges.iter().find(|r| r.start > r.end || r.end > len) {
            return Err(Error::Internal(format!("a piece {r:?} of a part of {len} values")));
        }
        Ok(match self {
            Part::F32(x) => ranges.iter().map(|r| Part::F32(x[r.clone()].to_vec())).collect(),
            Part::Levels { levels, count } => ranges.iter().map(|r| Part::Levels { levels: levels[r.clone()].to_vec(), count: *count }).collect(),
            Part::Codes { codes, lo, hi } => ranges.iter().map(|r| Part::Codes { codes: codes[r.clone()].to_vec(), lo: *lo, hi: *hi }).collect(),
            Part::Packed { words, n, lo, hi, count, width } => {
                let per = (64 / *width) as usize;
                let group = lanes::GROUP * per;
                if !ranges.iter().all(|r| r.start % group == 0 && (r.end % group == 0 || r.end == *n)) {
                    return self.unpacked()?.split(ranges);
                }
                ranges
                    .iter()
                    .map(|r| {
                        let first = r.start / per;
                        let words = words[first..first + lanes::words_for(r.len(), *width)].to_vec();
                        Part::Packed { words, n: r.len(), lo: *lo, hi: *hi, count: *count, width: *width }
                    })
                    .collect()
            }
        })
    }
}

/// How a push's parts divide over a key's slices (`slices`: element ranges
/// in order, covering the key): per slice, the range of the codes and scale
/// indices that belong to it, its own elements' or, under a random-K
/// selection, the selected coordinates that fall in it. (Float32 parts go
/// whole to every slice: the scale, PowerSGD's P and Q; only a float32
/// final contribution of the whole key, uncompressed PowerSGD, is cut as
/// the elements are.)
pub fn pieces(c: &Compression, step: u64, key_hash: u64, slices: &[Range<usize>]) -> Vec<Range<usize>> {
    let total = slices.last().map_or(0, |r| r.end);
    match c {
        Compression::Qsgd(q) => match selection(q, total, step, key_hash) {
            Some(idx) => slices.iter().map(|r| selected_in(&idx, r.clone())).collect(),
            None => slices.to_vec(),
        },
        _ => slices.to_vec(),
    }
}

/// A worker's final contribution cut for the servers of a key's `slices`
/// (`decode_slice` reads each piece): codes by `pieces`, a float32 sum of
/// the whole key (uncompressed PowerSGD) by the slices, and any other
/// float32 part (PowerSGD's Q) whole to every server.
pub fn split_final(part: &Part, slices: &[Range<usize>], pieces: &[Range<usize>]) -> Result<Vec<Part>> {
    let total = slices.last().map_or(0, |r| r.end);
    match part {
        Part::F32(x) if x.len() != total => Ok(vec![part.clone(); slices.len()]),
        Part::F32(_) => part.split(slices),
        _ => part.split(pieces),
    }
}

/// The element multiple at which a key's slices should start so that one
/// worker's final codes cut between whole lane groups (`Part::split` then
/// copies words): 1 when there is nothing to align.
pub fn slice_align(c: &Compression) -> usize {
    let (lo, hi) = match c {
        Compression::Qsgd(q) => qsgd_codes(q),
        Compression::OneBit { .. } => ONE_BIT_CODES,
        _ => return 1,
    };
    lanes::GROUP * (64 / lanes::width_for((hi - lo) as u64)) as usize
}

/// The range of one member's final codes, for the schemes whose final
/// contribution is integer codes (`None`: PowerSGD and `none`, float32),
/// as a final part whose lanes hold `members` members' sums writes them:
/// 2-bit's neg code `b` is one above the members.
pub fn final_codes(c: &Compression, members: usize) -> Option<(i32, i32)> {
    match c {
        Compression::Qsgd(q) => Some(qsgd_codes(q)),
        Compression::OneBit { .. } => Some(ONE_BIT_CODES),
        Compression::TwoBit(_) => Some((0, i32::try_from(members).ok()?.checked_add(1)?)),
        _ => None,
    }
}

/// The range of each member's final QSGD codes: `[-s_0, s_0]`.
pub(in crate::quant::scheme) fn qsgd_codes(q: &Qsgd) -> (i32, i32) {
    let s0 = q.levels()[0] as i32;
    (-s0, s0)
}

/// The range of each member's 1-bit codes: the bits.
pub(in crate::quant::scheme) const ONE_BIT_CODES: (i32, i32) = (0, 1);

/// One worker's state for one key: error-feedback residual, PowerSGD's
/// warm-started `Q`, the push count.
#[derive(Debug, Default)]
pub struct State {
    pub residual: Vec<f32>,
    pub q: Vec<f32>,
    pub step: u64,
    /// The next residual (1-bit, 2-bit, PowerSGD), written by `encode`
    /// beside the residual and swapped in by `finish` (`pending`): a push
    /// that fails after `encode`, or is never finished, leaves the residual
    /// as it was.
    pub(in crate::quant::scheme) spare_residual: Vec<f32>,
    /// `encode` left the next residual in `spare_residual` for `finish`.
    pub(in crate::quant::scheme) pending: bool,
    /// The last push's packed codes, reused by the next (never cloned).
    spare_words: Vec<u64>,
    /// The last push's scale indices (`recycle`).
    pub(in crate::quant::scheme) spare_levels: Vec<u8>,
    /// The last push's random-K values (its gradient at the selection).
    pub(in crate::quant::scheme) spare_gathered: Vec<f32>,
}

impl Clone for State {
    fn clone(&self) -> State {
        State { residual: self.residual.clone(), q: self.q.clone(), step: self.step, ..State::default() }
    }

    /// Copies into the buffers `self` already has, and keeps its spares:
    /// a worker's state for the round in flight, every push.
    fn clone_from(&mut self, source: &State) {
        self.residual.clone_from(&source.residual);
        self.q.clone_from(&source.q);
        self.step = source.step;
        self.pending = false;
    }
}

pub(in crate::quant::scheme) fn bad(key: &str, problem: String) -> Error {
    Error::InvalidParam { key: key.to_string(), problem }
}

/// Checks a state loaded from a checkpoint against the key it is for:
/// residual empty or of `n` elements, PowerSGD's Q empty or `cols x rank`
/// (any other Q would be silently re-drawn, restarting error feedback).
pub fn check_state(c: &Compression, shape: &[usize], state: &State) -> std::result::Result<(), String> {
    let Some(n) = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) else {
        return Err(format!("a shape {shape:?} whose size overflows"));
    };
    if !state.residual.is_empty() && state.residual.len() != n {
        return Err(format!("a residual of {} elements for a value of {n}", state.residual.len()));
    }
    let q_len = match c {
        Compression::PowerSgd { rank, .. } => powersgd::factors(shape, *rank as usize).map_or(0, |(_, cols, r)| cols * r),
        _ => 0,
    };
    if !state.q.is_empty() && state.q.len() != q_len {
        return Err(format!("a PowerSGD Q of {} elements where this compression keeps {q_len}", state.q.len()));
    }
    Ok(())
}

/// Checks what `encode` will be given, before anything changes: at most
/// one state per gradient (a member past `states` starts from a fresh
/// one), equal lengths, QSGD's worker bound, and finite values for the
/// schemes with a residual (PowerSGD the gradient; 1-bit and 2-bit the
/// gradient, then residual + gradient, whose sum is what they quantize and
/// keep), so that no NaN or inf enters a residual. The error names the
/// member and element. The compression's own fields are checked first
/// (`Compression::check`).
pub fn check_input(c: &Compression, states: &[State], grads: &[&[f32]], workers: usize) -> Result<()> {
    let n = grads.first().map_or(0, |g| g.len());
    if grads.is_empty() || states.len() > grads.len() || grads.iter().any(|g| g.len() != n) {
        return Err(Error::Internal(format!("a scheme push of {} gradients of lengths {:?} with {} states", grads.len(), grads.iter().map(|g| g.len()).collect::<Vec<_>>(), states.len())));
    }
    c.check()?;
    if let Compression::Qsgd(q) = c {
        if workers as u64 > qsgd::max_workers(q.bits()[0])? {
            return Err(bad("bits", format!("{workers} workers could overflow the code sum at {} bits", q.bits()[0])));
        }
    }
    // QSGD changes no state before its shared scale, which is not finite
    // when any member's value is not (`encode_qsgd` names it): no scan here.
    if matches!(c, Compression::None | Compression::Qsgd(_)) {
        return Ok(());
    }
    check_finite(grads)?;
    // (The stores' 2-bit runs the codec, which checks this itself; a
    // 2-bit push through `push_round` took a NaN into its residual.)
    if let Compression::OneBit { .. } | Compression::TwoBit(_) = c {
        for (m, (g, s)) in grads.iter().zip(states).enumerate() {
            if s.residual.len() == g.len() {
                crate::codec::check_finite(&format!("pushed value {m}"), g, &s.residual)?;
            }
        }
    }
    Ok(())
}

/// The one non-finite rule of a pushed gradient, checked before anything
/// changes: 2-bit and 1-bit read residual + gradient (zeros before a first
/// push: the sum they quantize and keep), PowerSGD the gradient; `none`
/// sums what it is given, as a plain all-reduce would, and QSGD's shared
/// scale fails every worker together by itself (`encode_qsgd`), so neither
/// reads anything here. `what` names the gradient in the error.
pub fn check_pushed(c: &Compression, grad: &[f32], state: Option<&State>, what: &str) -> Result<()> {
    match c {
        Compression::TwoBit(_) | Compression::OneBit { .. } => match state.filter(|s| s.residual.len() == grad.len()) {
            Some(s) => crate::codec::check_finite(what, grad, &s.residual),
            None => crate::codec::check_finite(what, grad, &vec![0f32; grad.len()]),
        },
        Compression::None | Compression::Qsgd(_) => Ok(()),
        Compression::PowerSgd { .. } => check_finite(&[grad]),
    }
}

/// Every member's gradient is finite; the error names the member and element.
pub fn check_finite(grads: &[&[f32]]) -> Result<()> {
    for (m, g) in grads.iter().enumerate() {
        if qsgd::max_abs(g).is_none() { // vectorized, at memory speed
            let i = g.iter().position(|x| !x.is_finite()).unwrap_or(0);
            return Err(Error::Store(format!("pushed value {m} holds {} at element {i}, a non-finite value; nothing was applied", g[i])));
        }
    }
    Ok(())
}

/// Runs the exchanges of one push and returns (exchanged values, the sum of
/// the final contributions of the members held here).
///
/// `states[i]` and `grads[i]` belong to member `ctx.member + i`: the device
/// store passes every device (with `collective::InProcess`), the all-reduce
/// and parameter-server stores their one merged gradient (with a collective
/// that reaches the other workers). Every exchange folds the members here
/// first, in member order, with `collective`'s reductions, then reduces
/// the fold through `coll`: the bits do not depend on where members live.
/// Call `check_input` first; then only `coll` can fail.
///
/// Changes no state but buffers kept for `finish` (the next residual, the
/// codes): the residual, Q and step change only in `finish`, so a push that
/// fails after `encode` (or is dropped) leaves every member as it was.
pub fn encode(c: &Compression, states: &mut [State], grads: &[&[f32]], ctx: &Ctx, coll: &mut dyn Collective) -> Result<(Vec<Part>, Part)> {
    let mut encoder = Encoder::new(c, states, grads, *ctx, coll.lanes_for());
    let mut step = encoder.resume(None)?;
    loop {
        match step {
            Step::Done(exchanged, part) => return Ok((exchanged, part)),
            Step::Ask(mut ask) => {
                ask.run(coll)?;
                step = encoder.resume(Some(ask))?;
            }
        }
    }
}

/// A member's residual for `encode` to read: its own, or zeros (`zeros`,
/// grown to `n`) on its first push, which leaves the state's empty.
pub(in crate::quant::scheme) fn previous<'a>(residual: &'a [f32], n: usize, zeros: &'a mut Vec<f32>) -> &'a [f32] {
    if residual.len() == n {
        residual
    } else {
        zeros.resize(n, 0.0);
        zeros
    }
}

/// The float32 sum of the members' gradients, in member order.
pub(in crate::quant::scheme) fn sum_of(grads: &[&[f32]]) -> Result<Vec<f32>> {
    let mut sum = grads[0].to_vec();
    for g in &grads[1..] {
        collective::sum_into(&mut sum, g)?;
    }
    Ok(sum)
}

/// PowerSGD's summed `P` or `Q` must be finite: an error naming the first
/// non-finite value otherwise (a sum past float32's range, or a faulty
/// worker's part). Every worker holds the same sum, so every worker fails
/// alike, before any state changes.
/// PowerSGD's summed factor `name` holds only finite values: the check
/// `decode_slice` makes of P and Q, for a caller that must know before it
/// decodes (`store::group`'s `check`).
pub fn check_factor(name: &str, x: &[f32]) -> Result<()> {
    non_finite_factor(name, x)
}

pub(in crate::quant::scheme) fn non_finite_factor(name: &str, x: &[f32]) -> Result<()> {
    match x.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(Error::Store(format!("PowerSGD: the workers' sum of {name} holds {} at element {i}, a non-finite value (a gradient past float32's range, or a faulty worker); nothing was applied", x[i]))),
    }
}

/// The members' codes summed into packed lanes (`Part::Packed`, codes in
/// `lo..=hi`) kept in the first state's spare words (`finish` keeps them
/// for the next push): lanes wide enough for the sums
/// of `lanes_for` members (the collective's) and of the members here, so
/// members add word by word. `quantize(member, state, words, width, add)`.
pub(in crate::quant::scheme) fn sum_packed(states: &mut [State], len: usize, (lo, hi): (i32, i32), lanes_for: usize, mut quantize: impl FnMut(usize, &mut State, &mut [u64], u32, bool)) -> Result<Part> {
    let members = lanes_for.max(states.len());
    let width = collective::sum_width(lo, hi, members).ok_or_else(|| bad("workers", format!("{members} members could overflow a sum of codes in {lo}..={hi}")))?;
    let mut words = std::mem::take(&mut states[0].spare_words);
    words.resize(lanes::words_for(len, width), 0);
    for (i, s) in states.iter_mut().enumerate() {
        quantize(i, s, &mut words, width, i > 0);
    }
    Ok(Part::Packed { words, n: len, lo, hi, count: states.len() as u32, width })
}

/// The aggregate (a sum over workers) from the exchanged values and the
/// summed final contribution. Checks every length: a server calls this on
/// what it received.
pub fn decode(c: &Compression, exchanged: &[Part], sum: &Part, ctx: &Ctx, out: &mut [f32]) -> Result<()> {
    decode_slice(c, exchanged, sum, ctx, 0, out)
}

/// `decode`'s elements `offset..offset + out.len()` of the key (`ctx.shape`),
/// bit for bit, from one server's slice of the round (`Part::split` by
/// `pieces`): its piece of the codes and scale indices, and the whole of
/// the scale and of PowerSGD's float32 parts.
pub fn decode_slice(c: &Compression, exchanged: &[Part], sum: &Part, ctx: &Ctx, offset: usize, out: &mut [f32]) -> Result<()> {
    let n = out.len();
    let malformed = |what: &str| Error::Transport(format!("malformed {} exchange: {what}", c.name()));
    let total = ctx.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| malformed(&format!("shape {:?} holds more elements than memory", ctx.shape)))?;
    if offset.checked_add(n).is_none_or(|end| end > total) {
        return Err(malformed(&format!("elements {offset}..+{n} of a key of {total}")));
    }
    // The codes a sum declares must be sums of `workers` members' final
    // codes: a frame that declared codes of +-100 at 2 bits decoded to 33
    // times the scale.
    if let (Compression::Qsgd(_) | Compression::OneBit { .. }, Part::Codes { lo, hi, .. } | Part::Packed { lo, hi, .. }) = (c, sum) {
        let (f_lo, f_hi) = final_codes(c, ctx.workers).expect("QSGD and 1-bit have final codes");
        let times = match sum {
            Part::Packed { count, .. } => *count as i64,
            _ => ctx.workers as i64, // each member's range, summed over the workers
        };
        let w = ctx.workers as i64;
        if (*lo as i64) * times < f_lo as i64 * w || (*hi as i64) * times > f_hi as i64 * w {
            return Err(malformed(&format!("codes {lo}..={hi} summed over {times} are not sums of {w} members' codes in {f_lo}..={f_hi}")));
        }
    }
    match (c, sum) {
        (Compression::Qsgd(q), Part::Codes { .. } | Part::Packed { .. }) => {
            let levels = q.levels();
            let scale = match exchanged.first() {
                Some(Part::F32(s)) if s.len() == 1 => s[0],
                _ => return Err(malformed("no scale")),
            };
            let len = match sum {
                Part::Codes { codes, .. } => codes.len(),
                Part::Packed { n, .. } => *n,
                _ => unreachable!("matched above"),
            };
            let level_of = match (levels.len(), exchanged.get(1)) {
                (1, None) => None,
                (_, Some(Part::Levels { levels: l, .. })) if l.len() == len => Some(l.as_slice()),
                _ => return Err(malformed("scale indices missing or of the wrong length")),
            };
            // Packed codes are decoded straight from their lanes.
            let decode_into = |out: &mut [f32]| match sum {
                Part::Packed { words, lo, count, width, .. } => qsgd::decode_packed(words, *width, *lo as i64 * *count as i64, scale, &levels, level_of, out),
                Part::Codes { codes, .. } => qsgd::decode_at(codes, scale, &levels, level_of, out),
                _ => unreachable!("matched above"),
            };
            match selection(q, total, ctx.step, ctx.key_hash) {
                None => decode_into(out),
                Some(idx) => {
                    let sel = selected_in(&idx, offset..offset + n);
                    let mut vals = vec![0f32; sel.len()];
                    decode_into(&mut vals)?;
                    scatter(&idx[sel], offset, &vals, out);
                    Ok(())
                }
            }
        }
        (Compression::PowerSgd { rank, .. }, Part::F32(q_sum)) => match powersgd::factors(ctx.shape, *rank as usize) {
            None if q_sum.len() == n => {
                out.copy_from_slice(q_sum);
                Ok(())
            }
            Some((rows, cols, r)) if q_sum.len() == cols * r && rows * cols == total => {
                let mut p_hat = match exchanged.first() {
                    Some(Part::F32(p)) if p.len() == rows * r => p.clone(),
                    _ => return Err(malformed("P missing or of the wrong length")),
                };
                non_finite_factor("P", &p_hat)?;
                non_finite_factor("Q", q_sum)?;
                powersgd::orthogonalize(&mut p_hat, rows, r);
                powersgd::p_times_qt_range(&p_hat, q_sum, rows, cols, r, offset, out);
                Ok(())
            }
            _ => Err(malformed(&format!("Q of {} values for shape {:?}", q_sum.len(), ctx.shape))),
        },
        (Compression::OneBit { .. }, Part::Packed { words, n: len, width, .. }) if *len == n => {
            // lanes count the 1 bits (lo = 0): 2 ones - workers
            // (exact in a double, then rounded once, as the integer would be)
            qsgd::decode_lanes(words, *width, -(ctx.workers as f64), 1.0, true, out)
        }
        (Compression::OneBit { .. }, Part::Codes { codes, .. }) if codes.len() == n => {
            let w = ctx.workers as i64;
            out.par_chunks_mut(1 << 16).zip(codes.par_chunks(1 << 16)).for_each(|(o, c)| o.iter_mut().zip(c).for_each(|(o, &c)| *o = (2 * c as i64 - w) as f32));
            Ok(())
        }
        (Compression::TwoBit(th), Part::Packed { words, n: len, lo: 0, hi, width, .. }) if *len == n => twobit::decode_packed(words, *width, *hi, *th, out),
        (Compression::None, Part::F32(s)) if s.len() == n => {
            out.copy_from_slice(s);
            Ok(())
        }
        (_, Part::Packed { .. }) if !matches!(c, Compression::Qsgd(_) | Compression::OneBit { .. }) => decode_slice(c, exchanged, &*sum.unpacked()?, ctx, offset, out),
        _ => Err(malformed("final sum of the wrong kind or length")),
    }
}

/// After a push: each member whose `encode` left a next residual (1-bit,
/// 2-bit, PowerSGD) commits it, PowerSGD's only with the summed `Q` (the
/// same on every worker), from which it warm-starts; the code buffer is
/// kept for the next push; every member counts the step.
pub fn finish(c: &Compression, states: &mut [State], sum: Part) {
    let q_sum = match (c, &sum) {
        (Compression::PowerSgd { .. }, Part::F32(q)) => Some(&q[..]),
        _ => None,
    };
    if q_sum.is_some() || !matches!(c, Compression::PowerSgd { .. }) {
        for s in states.iter_mut().filter(|s| s.pending) {
            std::mem::swap(&mut s.residual, &mut s.spare_residual);
            if let Some(q) = q_sum {
                s.q.clear();
                s.q.extend_from_slice(q);
            }
            s.pending = false;
        }
    }
    if let (Part::Packed { words, .. }, Some(s)) = (sum, states.first_mut()) {
        s.spare_words = words;
    }
    states.iter_mut().for_each(|s| s.step += 1);
}

/// After `decode`: keeps the round's scale indices in the first member's
/// state for the next push to fill (a buffer as long as the key: taken
/// from the allocator each push, its pages would be faulted in anew).
pub fn recycle(states: &mut [State], exchanged: Vec<Part>) {
    for part in exchanged {
        if let (Part::Levels { levels, .. }, Some(s)) = (part, states.first_mut()) {
            s.spare_levels = levels;
        }
    }
}

/// Sums the final contribution through `coll`.
pub fn sum_final(part: &mut Part, coll: &mut dyn Collective) -> Result<()> {
    match part {
        Part::F32(x) => coll.sum_f32(x),
        Part::Codes { codes, lo, hi } => coll.sum_codes(codes, *lo, *hi),
        Part::Packed { words, n, lo, hi, count, width } => {
            let workers = coll.workers();
            if collective::sum_width(*lo, *hi, workers).is_none_or(|w| w > *width) {
                return Err(Error::Internal(format!("{width}-bit lanes cannot hold {workers} members' sum of codes in {lo}..={hi}")));
            }
            coll.sum_packed(words, *n, *lo, *hi, *count, *width)?;
            *count = workers as u32;
            Ok(())
        }
        Part::Levels { .. } => Err(Error::Internal("scale indices are never a final contribution".into())),
    }
}

/// A whole push on a store whose members all decode: encode, sum, decode,
/// finish. With `keep_local` random-K, unselected coordinates take the
/// members' own gradients (their sum: this process is one worker).
pub fn push_round(c: &Compression, states: &mut [State], grads: &[&[f32]], ctx: &Ctx, coll: &mut dyn Collective, out: &mut [f32]) -> Result<()> {
    let (exchanged, mut part) = encode(c, states, grads, ctx, coll)?;
    sum_final(&mut part, coll)?;
    decode(c, &exchanged, &part, ctx, out)?;
    if let Compression::Qsgd(q) = c {
        if q.keep_local {
            if let Some(idx) = selection(q, out.len(), ctx.step, ctx.key_hash) {
                let mut selected = vec![false; out.len()];
                idx.iter().for_each(|&i| selected[i] = true);
                for (i, o) in out.iter_mut().enumerate().filter(|(i, _)| !selected[*i]) {
                    *o = grads[1..].iter().fold(grads[0][i], |acc, g| acc + g[i]);
                }
            }
        }
    }
    finish(c, states, part);
    recycle(states, exchanged);
    Ok(())
}

#[cfg(test)]
mod tests;
/// The scheme tests' harness: members on threads of their own.
#[cfg(test)]
mod threads;
