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

use std::borrow::Cow;

use rayon::prelude::*;

use super::collective::Collective;
use super::{lanes, onebit, powersgd, qsgd};
use super::compression::{Compression, Qsgd};
use crate::bytes::Reader;
use crate::codec;
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
}

/// One worker's state for one key: error-feedback residual, PowerSGD's
/// warm-started `Q`, the push count.
#[derive(Debug, Default)]
pub struct State {
    pub residual: Vec<f32>,
    pub q: Vec<f32>,
    pub step: u64,
    /// The last push's code buffer, reused by the next (never cloned).
    spare_codes: Vec<i32>,
}

impl Clone for State {
    fn clone(&self) -> State {
        State { residual: self.residual.clone(), q: self.q.clone(), step: self.step, spare_codes: Vec::new() }
    }
}

fn bad(key: &str, problem: String) -> Error {
    Error::InvalidParam { key: key.to_string(), problem }
}

/// The `k` coordinates of a random-K push: sorted, distinct, chosen from
/// (seed, step, key) alone, so every worker and server picks the same ones
/// without sending them. `None` when every coordinate is sent.
pub fn selection(q: &Qsgd, n: usize, step: u64, key_hash: u64) -> Option<Vec<usize>> {
    let k = q.selected(n);
    if k >= n {
        return None;
    }
    // Floyd's sampling: k distinct indices, marked in a bitset, read in order.
    let seed = qsgd::stream_seed(q.seed, step, key_hash, u64::MAX);
    let mut chosen = vec![0u64; n.div_ceil(64)];
    let mut mark = |i: usize| {
        let (w, b) = (i / 64, 1u64 << (i % 64));
        let fresh = chosen[w] & b == 0;
        chosen[w] |= b;
        fresh
    };
    for (draw, j) in (n - k..n).enumerate() {
        let t = ((qsgd::uniform(seed, draw as u64) as f64 * (j + 1) as f64) as usize).min(j);
        if !mark(t) {
            mark(j);
        }
    }
    let mut idx = Vec::with_capacity(k);
    for (w, &bits) in chosen.iter().enumerate() {
        let mut b = bits;
        while b != 0 {
            idx.push(w * 64 + b.trailing_zeros() as usize);
            b &= b - 1;
        }
    }
    Some(idx)
}

/// Checks a state loaded from a checkpoint against the key it is for:
/// residual empty or of `n` elements, PowerSGD's Q empty or `cols x rank`
/// (any other Q would be silently re-drawn, restarting error feedback).
pub fn check_state(c: &Compression, shape: &[usize], state: &State) -> std::result::Result<(), String> {
    let n: usize = shape.iter().product();
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

/// Runs the exchanges and returns (exchanged values, final contribution).
/// `grad` is this worker's (device-merged) gradient; `state` its state for the key.
pub fn encode(c: &Compression, state: &mut State, grad: &[f32], ctx: &Ctx, coll: &mut dyn Collective) -> Result<(Vec<Part>, Part)> {
    match c {
        Compression::Qsgd(q) => encode_qsgd(q, std::mem::take(&mut state.spare_codes), grad, ctx, coll),
        Compression::PowerSgd { rank, seed } => {
            let Some((rows, cols, r)) = powersgd::factors(ctx.shape, *rank as usize) else {
                return Ok((Vec::new(), Part::F32(grad.to_vec())));
            };
            if state.q.len() != cols * r {
                state.q = powersgd::initial_q(cols, r, qsgd::stream_seed(*seed, 0, ctx.key_hash, u64::MAX));
            }
            // Error feedback: compress g + e; e keeps what the approximation missed.
            state.residual.resize(grad.len(), 0.0);
            let m = &mut state.residual;
            m.par_iter_mut().zip(grad).for_each(|(e, g)| *e += g);
            let mut p = vec![0f32; rows * r];
            powersgd::m_times_q(m, &state.q, rows, cols, r, &mut p);
            coll.sum_f32(&mut p)?;
            let mut p_hat = p.clone();
            powersgd::orthogonalize(&mut p_hat, rows, r);
            let mut q_local = vec![0f32; cols * r];
            powersgd::mt_times_p(m, &p_hat, rows, cols, r, &mut q_local);
            powersgd::p_times_qt(&p_hat, &q_local, rows, cols, r, m, true);
            Ok((vec![Part::F32(p)], Part::F32(q_local)))
        }
        Compression::OneBit { threshold } => {
            state.residual.resize(grad.len(), 0.0);
            let mut codes = vec![0i32; grad.len()];
            onebit::quantize(grad, &mut state.residual, *threshold, &mut codes);
            Ok((Vec::new(), Part::Codes { codes, lo: 0, hi: 1 }))
        }
        Compression::TwoBit(th) => {
            // Codes counted, not decoded: n indicators of +pos, then n of neg.
            // The codec's fast kernels quantize; the store has checked that
            // every residual + gradient is finite before any worker agreed.
            state.residual.resize(grad.len(), 0.0);
            let n = grad.len();
            let mut compr = codec::create_2bit(n);
            codec::quantize_2bit_finite(grad, &mut state.residual, &mut compr, *th)?;
            let blocks = codec::blocks(&compr);
            let mut codes = vec![0i32; 2 * n];
            let (pos, neg) = codes.split_at_mut(n);
            for (i, (p, q)) in pos.iter_mut().zip(neg.iter_mut()).enumerate() {
                let code = (blocks[i / 16] >> (30 - 2 * (i % 16))) & 0b11;
                (*p, *q) = ((code == 0b01) as i32, (code == 0b10) as i32);
            }
            Ok((Vec::new(), Part::Codes { codes, lo: 0, hi: 1 }))
        }
        Compression::None => Ok((Vec::new(), Part::F32(grad.to_vec()))),
    }
}

fn encode_qsgd(q: &Qsgd, mut codes: Vec<i32>, grad: &[f32], ctx: &Ctx, coll: &mut dyn Collective) -> Result<(Vec<Part>, Part)> {
    let levels = q.levels();
    let s0 = levels[0];
    if ctx.workers as u64 > qsgd::max_workers(q.bits()[0])? {
        return Err(bad("bits", format!("{} workers could overflow the code sum at {} bits", ctx.workers, q.bits()[0])));
    }
    let idx = selection(q, grad.len(), ctx.step, ctx.key_hash);
    let x: Cow<[f32]> = match &idx {
        Some(idx) => Cow::Owned(idx.iter().map(|&i| grad[i]).collect()),
        None => Cow::Borrowed(grad),
    };
    // A non-finite gradient anywhere poisons the shared scale, so every
    // worker fails this push together instead of waiting on the others.
    let mut scale = [qsgd::max_abs(&x).unwrap_or(f32::INFINITY)];
    coll.max_f32(&mut scale)?;
    if !scale[0].is_finite() {
        return Err(bad("gradient", "a worker pushed a non-finite value (inf or NaN); nothing was applied".into()));
    }
    let mut exchanged = vec![Part::F32(scale.to_vec())];
    let level_of = (levels.len() > 1)
        .then(|| {
            let mut l = vec![0u8; x.len()];
            qsgd::fit_levels(&x, scale[0], &levels, &mut l);
            coll.min_u8(&mut l, levels.len() as u8).map(|_| l)
        })
        .transpose()?;
    codes.resize(x.len(), 0);
    let seed = qsgd::stream_seed(q.seed, ctx.step, ctx.key_hash, ctx.member);
    // The scale is a MAX that includes this worker's finite max|x|: no need to check x again.
    qsgd::quantize_levels(&x, scale[0], &levels, level_of.as_deref(), seed, &mut codes);
    if let Some(l) = level_of {
        exchanged.push(Part::Levels { levels: l, count: levels.len() as u8 });
    }
    Ok((exchanged, Part::Codes { codes, lo: -(s0 as i32), hi: s0 as i32 }))
}

/// The aggregate (a sum over workers) from the exchanged values and the
/// summed final contribution. Checks every length: a server calls this on
/// what it received.
pub fn decode(c: &Compression, exchanged: &[Part], sum: &Part, ctx: &Ctx, out: &mut [f32]) -> Result<()> {
    let n = out.len();
    let malformed = |what: &str| Error::Transport(format!("malformed {} exchange: {what}", c.name()));
    match (c, sum) {
        (Compression::Qsgd(q), Part::Codes { codes, .. }) => {
            let levels = q.levels();
            let scale = match exchanged.first() {
                Some(Part::F32(s)) if s.len() == 1 => s[0],
                _ => return Err(malformed("no scale")),
            };
            let level_of = match (levels.len(), exchanged.get(1)) {
                (1, None) => None,
                (_, Some(Part::Levels { levels: l, .. })) if l.len() == codes.len() => Some(l.as_slice()),
                _ => return Err(malformed("scale indices missing or of the wrong length")),
            };
            match selection(q, n, ctx.step, ctx.key_hash) {
                None => qsgd::decode_at(codes, scale, &levels, level_of, out),
                Some(idx) => {
                    let mut vals = vec![0f32; idx.len()];
                    qsgd::decode_at(codes, scale, &levels, level_of, &mut vals)?;
                    out.fill(0.0);
                    idx.iter().zip(vals).for_each(|(&i, v)| out[i] = v);
                    Ok(())
                }
            }
        }
        (Compression::PowerSgd { rank, .. }, Part::F32(q_sum)) => match powersgd::factors(ctx.shape, *rank as usize) {
            None if q_sum.len() == n => {
                out.copy_from_slice(q_sum);
                Ok(())
            }
            Some((rows, cols, r)) if q_sum.len() == cols * r && rows * cols == n => {
                let mut p_hat = match exchanged.first() {
                    Some(Part::F32(p)) if p.len() == rows * r => p.clone(),
                    _ => return Err(malformed("P missing or of the wrong length")),
                };
                powersgd::orthogonalize(&mut p_hat, rows, r);
                powersgd::p_times_qt(&p_hat, q_sum, rows, cols, r, out, false);
                Ok(())
            }
            _ => Err(malformed(&format!("Q of {} values for shape {:?}", q_sum.len(), ctx.shape))),
        },
        (Compression::OneBit { .. }, Part::Codes { codes, .. }) if codes.len() == n => {
            let w = ctx.workers as i32;
            out.iter_mut().zip(codes).for_each(|(o, &c)| *o = (2 * c - w) as f32);
            Ok(())
        }
        (Compression::TwoBit(th), Part::Codes { codes, .. }) if codes.len() == 2 * n => {
            // p pos + q neg, as the parameter server's code counts.
            let (p, q) = codes.split_at(n);
            out.iter_mut().zip(p.iter().zip(q)).for_each(|(o, (&p, &q))| *o = p as f32 * th.pos() + q as f32 * th.neg());
            Ok(())
        }
        (Compression::None, Part::F32(s)) if s.len() == n => {
            out.copy_from_slice(s);
            Ok(())
        }
        _ => Err(malformed("final sum of the wrong kind or length")),
    }
}

/// After a push: PowerSGD warm-starts from the summed `Q` (the same on every
/// worker); code buffers are kept for the next push; every scheme counts the step.
pub fn finish(c: &Compression, state: &mut State, sum: Part) {
    match (c, sum) {
        (Compression::PowerSgd { .. }, Part::F32(q)) if q.len() == state.q.len() => state.q.copy_from_slice(&q),
        (_, Part::Codes { codes, .. }) => state.spare_codes = codes,
        _ => {}
    }
    state.step += 1;
}

/// Sums the final contribution through `coll`.
pub fn sum_final(part: &mut Part, coll: &mut dyn Collective) -> Result<()> {
    match part {
        Part::F32(x) => coll.sum_f32(x),
        Part::Codes { codes, lo, hi } => coll.sum_codes(codes, *lo, *hi),
        Part::Levels { .. } => Err(Error::Internal("scale indices are never a final contribution".into())),
    }
}

/// A whole push on a store whose members all decode: encode, sum, decode,
/// finish. With `keep_local` random-K, unselected coordinates take `grad`.
pub fn allreduce(c: &Compression, state: &mut State, grad: &[f32], ctx: &Ctx, coll: &mut dyn Collective, out: &mut [f32]) -> Result<()> {
    let (exchanged, mut part) = encode(c, state, grad, ctx, coll)?;
    sum_final(&mut part, coll)?;
    decode(c, &exchanged, &part, ctx, out)?;
    if let Compression::Qsgd(q) = c {
        if q.keep_local {
            if let Some(idx) = selection(q, grad.len(), ctx.step, ctx.key_hash) {
                let mut selected = vec![false; grad.len()];
                idx.iter().for_each(|&i| selected[i] = true);
                out.iter_mut().zip(grad).zip(selected).filter(|(_, s)| !s).for_each(|((o, &g), _)| *o = g);
            }
        }
    }
    finish(c, state, part);
    Ok(())
}

/// Wire form of a part (a header, then payload): float32 bytes, or lanes of
/// the narrowest width that holds `hi - lo` (codes) or `count - 1` (scale
/// indices).
pub fn to_wire(part: &Part) -> Vec<u8> {
    let mut out = Vec::new();
    write_part(&mut out, part, 1);
    out
}

/// Wire form of a sum over `workers` workers' parts: codes keep each
/// worker's range in `Part::Codes`, so their lanes are widened for the sum.
pub fn sum_to_wire(sum: &Part, workers: usize) -> Vec<u8> {
    let mut out = Vec::new();
    write_part(&mut out, sum, workers as i32);
    out
}

/// Appends `part`'s wire form, code ranges multiplied by `workers`.
fn write_part(out: &mut Vec<u8>, part: &Part, workers: i32) {
    match part {
        Part::F32(x) => {
            out.push(0);
            out.extend((x.len() as u64).to_le_bytes());
            x.iter().for_each(|v| out.extend(v.to_le_bytes()));
        }
        Part::Levels { levels, count } => {
            out.push(1);
            out.extend((levels.len() as u64).to_le_bytes());
            out.push(*count);
            let width = lanes::width_for(*count as u64 - 1);
            let start = out.len();
            out.resize(start + 8 * lanes::words_for(levels.len(), width), 0);
            lanes::pack_into_bytes(levels.len(), width, |i| levels[i] as u64, &mut out[start..]);
        }
        Part::Codes { codes, lo, hi } => {
            let (lo, hi) = (&(lo * workers), &(hi * workers));
            out.push(2);
            out.extend((codes.len() as u64).to_le_bytes());
            out.extend(lo.to_le_bytes());
            out.extend(hi.to_le_bytes());
            let width = lanes::width_for((*hi as i64 - *lo as i64) as u64);
            let lo = *lo as i64;
            let start = out.len();
            out.resize(start + 8 * lanes::words_for(codes.len(), width), 0);
            lanes::pack_into_bytes(codes.len(), width, |i| (codes[i] as i64 - lo) as u64, &mut out[start..]);
        }
    }
}

/// A decoded sum sent losslessly: its step, the round's exchanged values and
/// the summed final contribution (codes in lanes wide enough for `workers`
/// workers' sum), from which `decode` rebuilds the same float32 bits.
pub fn value_to_wire(step: u64, exchanged: &[Part], sum: &Part, workers: usize) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend(step.to_le_bytes());
    out.extend((exchanged.len() as u32 + 1).to_le_bytes());
    let parts = exchanged.iter().map(|p| (p, 1)).chain([(sum, workers as i32)]);
    for (part, workers) in parts {
        let len_at = out.len();
        out.extend(0u64.to_le_bytes()); // the part's length, filled in below
        write_part(&mut out, part, workers);
        let len = (out.len() - len_at - 8) as u64;
        out[len_at..len_at + 8].copy_from_slice(&len.to_le_bytes());
    }
    out
}

/// Parses `value_to_wire`'s form: (step, exchanged values, sum).
pub fn value_from_wire(bytes: &[u8]) -> Result<(u64, Vec<Part>, Part)> {
    let mut r = Reader::new(bytes, |p| Error::Transport(format!("malformed message: scheme value: {p}")));
    let step = r.u64()?;
    let count = r.u32()? as usize;
    if count == 0 || count > 8 {
        return Err(r.error(&format!("{count} parts")));
    }
    let mut parts = Vec::with_capacity(count);
    for _ in 0..count {
        let len = r.len(1)?;
        parts.push(from_wire(r.take(len)?)?);
    }
    r.finish()?;
    let sum = parts.pop().unwrap();
    Ok((step, parts, sum))
}

/// A part claims `n` values of `width` bits: the frame must carry exactly the
/// words they take, checked before anything of size `n` is allocated (so a
/// claim of 2^40 or 2^62 values in a short frame is an error, not an abort).
fn check_lanes(n: usize, width: u32, bytes: usize) -> Result<()> {
    let want = lanes::words_for(n, width).checked_mul(8);
    if want != Some(bytes) {
        return Err(Error::Transport(format!("malformed message: {n} values of {width} bits need {} bytes, the frame carries {bytes}", want.map_or("more than 2^64".to_string(), |w| w.to_string()))));
    }
    Ok(())
}

/// Parses a wire part, checking every length and range.
pub fn from_wire(bytes: &[u8]) -> Result<Part> {
    let malformed = |what: &str| Error::Transport(format!("malformed message: {what}"));
    if bytes.len() < 9 {
        return Err(malformed("truncated exchange header"));
    }
    let n = u64::from_le_bytes(bytes[1..9].try_into().unwrap()) as usize;
    let rest = &bytes[9..];
    match bytes[0] {
        0 => {
            if rest.len() != n.checked_mul(4).ok_or_else(|| malformed("length overflows"))? {
                return Err(malformed(&format!("{} bytes for {n} float32", rest.len())));
            }
            Ok(Part::F32(rest.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()))
        }
        1 => {
            let (&count, words) = rest.split_first().ok_or_else(|| malformed("truncated scale indices"))?;
            if count == 0 {
                return Err(malformed("zero scales"));
            }
            let width = lanes::width_for(count as u64 - 1);
            check_lanes(n, width, words.len())?;
            let mut levels = vec![0u8; n];
            lanes::unpack_bytes_into(words, width, &mut levels, |v| v.min(255) as u8)?;
            if levels.iter().any(|&l| l >= count) {
                return Err(malformed(&format!("a scale index is not below {count}")));
            }
            Ok(Part::Levels { levels, count })
        }
        2 => {
            if rest.len() < 8 {
                return Err(malformed("truncated code range"));
            }
            let lo = i32::from_le_bytes(rest[0..4].try_into().unwrap());
            let hi = i32::from_le_bytes(rest[4..8].try_into().unwrap());
            if hi < lo {
                return Err(malformed(&format!("code range {lo}..={hi}")));
            }
            let span = (hi as i64 - lo as i64) as u64;
            // Out-of-range lanes become a sentinel outside lo..=hi, then one check.
            let width = lanes::width_for(span);
            check_lanes(n, width, rest.len() - 8)?;
            let mut codes = vec![0i32; n];
            let bad = if hi < i32::MAX { hi as i64 + 1 } else { lo as i64 - 1 };
            lanes::unpack_bytes_into(&rest[8..], width, &mut codes, |v| {
                (if v > span { bad } else { v as i64 + lo as i64 }) as i32
            })?;
            if codes.iter().any(|&c| c < lo || c > hi) {
                return Err(malformed(&format!("a code is outside {lo}..={hi}")));
            }
            Ok(Part::Codes { codes, lo, hi })
        }
        t => Err(malformed(&format!("unknown exchange kind {t}"))),
    }
}

#[cfg(test)]
mod tests;
