//! A transport's plain all-reduces (`Engine`: torch.distributed under
//! `gradpack.torch`, MPI under the all-reduce store) and the one layer of
//! lane collectives over them (`Lanes`): every reduction a scheme asks for
//! becomes one all-reduce of float32 values or of 64-bit words of packed
//! lanes, counted in bytes.

use crate::error::{Error, Result};
use crate::quant::collective::{self, Collective};
use crate::quant::lanes;

/// An all-reduce an engine performs, in place, on every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Max,
    /// Bitwise OR of 64-bit words.
    Or,
    /// The minimum of each lane of the given width (1 to 8 bits) of 64-bit
    /// words, where the engine has it (`Engine::lane_min`).
    LaneMin(u32),
}

/// A buffer handed to the engine: float32 values, or 64-bit words of
/// packed lanes (summed as integers: lanes never carry into each other, so
/// a wrapping 64-bit sum is exact).
pub enum Buffer<'a> {
    F32(&'a mut [f32]),
    U64(&'a mut [u64]),
}

impl Buffer<'_> {
    pub fn bytes(&self) -> u64 {
        match self {
            Buffer::F32(x) => 4 * x.len() as u64,
            Buffer::U64(x) => 8 * x.len() as u64,
        }
    }
}

/// A transport's collective engine: each call is one blocking collective
/// issued by every rank in the same order.
pub trait Engine {
    fn all_reduce(&mut self, op: ReduceOp, buf: Buffer<'_>) -> Result<()>;
    /// Every rank's `send`, cut in `world` equal chunks, chunk `r` to rank
    /// `r`: `recv`'s chunk `j` is rank `j`'s chunk for this rank (the
    /// owners exchange, `store::group::owners`). An engine without it says so.
    fn all_to_all(&mut self, send: &[u64], recv: &mut [u64]) -> Result<()> {
        let _ = (send, recv);
        Err(Error::Internal("this transport has no all_to_all".into()))
    }
    /// Every rank's `mine` into `out` (`world` chunks of `mine.len()`
    /// words), rank `j`'s at chunk `j`.
    fn all_gather(&mut self, mine: &[u64], out: &mut [u64]) -> Result<()> {
        let _ = (mine, out);
        Err(Error::Internal("this transport has no all_gather".into()))
    }
    /// Whether the engine reduces `ReduceOp::LaneMin` (MPI, through user
    /// operations); without it scale indices travel as thermometer codes
    /// under a bitwise OR.
    fn lane_min(&self) -> bool {
        false
    }
}

impl<E: Engine + ?Sized> Engine for &mut E {
    fn all_reduce(&mut self, op: ReduceOp, buf: Buffer<'_>) -> Result<()> {
        (**self).all_reduce(op, buf)
    }
    fn all_to_all(&mut self, send: &[u64], recv: &mut [u64]) -> Result<()> {
        (**self).all_to_all(send, recv)
    }
    fn all_gather(&mut self, mine: &[u64], out: &mut [u64]) -> Result<()> {
        (**self).all_gather(mine, out)
    }
    fn lane_min(&self) -> bool {
        (**self).lane_min()
    }
}

/// `Collective` over an `Engine` of `workers` ranks, counting the bytes
/// handed to it.
pub struct Lanes<E> {
    pub engine: E,
    pub workers: usize,
    pub sent: u64,
    /// Members whose codes a final contribution's lanes hold: `workers`,
    /// or 1 when the final codes are summed apart (the owners exchange).
    pub lanes_for: usize,
}

impl<E: Engine> Lanes<E> {
    pub fn new(engine: E, workers: usize) -> Lanes<E> {
        Lanes { engine, workers, sent: 0, lanes_for: workers }
    }

    pub fn reduce(&mut self, op: ReduceOp, buf: Buffer<'_>) -> Result<()> {
        self.sent += buf.bytes();
        self.engine.all_reduce(op, buf)
    }

    pub fn all_to_all(&mut self, send: &[u64], recv: &mut [u64]) -> Result<()> {
        self.sent += 8 * send.len() as u64;
        self.engine.all_to_all(send, recv)
    }

    pub fn all_gather(&mut self, mine: &[u64], out: &mut [u64]) -> Result<()> {
        self.sent += 8 * mine.len() as u64;
        self.engine.all_gather(mine, out)
    }
}

impl<E: Engine> Collective for Lanes<E> {
    fn workers(&self) -> usize {
        self.workers
    }
    fn lanes_for(&self) -> usize {
        self.lanes_for
    }
    fn max_f32(&mut self, x: &mut [f32]) -> Result<()> {
        self.reduce(ReduceOp::Max, Buffer::F32(x))
    }
    fn sum_f32(&mut self, x: &mut [f32]) -> Result<()> {
        self.reduce(ReduceOp::Sum, Buffer::F32(x))
    }
    /// Scale indices travel in lanes just wide enough under a lane-wise
    /// MIN where the engine has one; otherwise as thermometer codes: `count
    /// - 1` bits an index, bit `j` set when the index is at most `j`, so
    /// that a bitwise OR over ranks is the code of their minimum (a byte an
    /// index would cost 8 bits instead of 1 to 7).
    fn min_u8(&mut self, x: &mut [u8], count: u8) -> Result<()> {
        if let Some(i) = x.iter().position(|&l| l >= count) {
            return Err(Error::Internal(format!("scale index {} at element {i}, of {count} scales", x[i])));
        }
        if self.engine.lane_min() {
            let width = lanes::width_for(count.saturating_sub(1) as u64);
            let mut words = lanes::pack_bytes(x, width);
            self.reduce(ReduceOp::LaneMin(width), Buffer::U64(&mut words))?;
            return lanes::unpack_into(&words, width, x, |v| v as u8);
        }
        let width = count.saturating_sub(1) as u32;
        if width == 0 {
            return Ok(()); // one scale: every index is 0
        }
        let mask = (1u64 << width) - 1;
        let mut words = lanes::pack_slice(x, width, |l| (mask << l) & mask);
        self.reduce(ReduceOp::Or, Buffer::U64(&mut words))?;
        lanes::unpack_into(&words, width, x, |t| t.trailing_zeros().min(width) as u8)
    }
    fn sum_codes(&mut self, x: &mut [i32], lo: i32, hi: i32) -> Result<()> {
        let width = collective::sum_width(lo, hi, self.workers).ok_or_else(|| Error::InvalidParam { key: "workers".into(), problem: format!("{} ranks overflow a sum of codes in {lo}..={hi}", self.workers) })?;
        let mut words = lanes::pack_slice(x, width, |v| (v as i64 - lo as i64) as u64);
        self.reduce(ReduceOp::Sum, Buffer::U64(&mut words))?;
        lanes::unpack_codes(&words, width, lo as i64 * self.workers as i64, x)
    }
    fn sum_packed(&mut self, words: &mut [u64], n: usize, lo: i32, hi: i32, _: u32, width: u32) -> Result<()> {
        if collective::sum_width(lo, hi, self.workers) != Some(width) || words.len() != lanes::words_for(n, width) {
            return Err(Error::Internal(format!("{n} codes in {} words of {width}-bit lanes cannot hold {} ranks' sum of {lo}..={hi}", words.len(), self.workers)));
        }
        self.reduce(ReduceOp::Sum, Buffer::U64(words))
    }
}
