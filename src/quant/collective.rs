//! The reductions a compression scheme needs from its job: the one
//! elementwise implementation of each (`max_into`, `sum_into`, `min_into`,
//! `add_codes`), and the transports' interface to them (`Collective`).
//!
//! A scheme (`scheme`) is written once against `Collective`. It first folds
//! the members held in this process with the functions here (the `device`
//! store holds every device, so its `InProcess` collective has nothing left
//! to do), then reduces the fold over the job: the all-reduce store through
//! MPI, the parameter-server store through the key's server (which folds
//! what workers sent with the same functions). Every process makes the same
//! calls in the same order with the same lengths; results are identical on
//! every member.

use crate::par;

use super::lanes;
use crate::error::{Error, Result};

fn zip_chunks<A: Send, B: Sync>(acc: &mut [A], x: &[B], f: impl Fn(&mut A, &B) + Sync) {
    par::chunks(acc, |start, a| {
        let b = &x[start..start + a.len()];
        a.iter_mut().zip(b).for_each(|(a, b)| f(a, b))
    });
}

fn check(what: &'static str, acc: usize, x: usize) -> Result<()> {
    if acc != x {
        return Err(Error::SizeMismatch { what, expected: acc, got: x });
    }
    Ok(())
}

/// `acc = max(acc, x)` elementwise.
pub fn max_into(acc: &mut [f32], x: &[f32]) -> Result<()> {
    check("max operand", acc.len(), x.len())?;
    zip_chunks(acc, x, |a, b| *a = a.max(*b));
    Ok(())
}

/// `acc += x` elementwise (float32: callers fold members in member order).
pub fn sum_into(acc: &mut [f32], x: &[f32]) -> Result<()> {
    check("sum operand", acc.len(), x.len())?;
    zip_chunks(acc, x, |a, b| *a += *b);
    Ok(())
}

/// `acc = min(acc, x)` elementwise (scale indices).
pub fn min_into(acc: &mut [u8], x: &[u8]) -> Result<()> {
    check("min operand", acc.len(), x.len())?;
    zip_chunks(acc, x, |a, b| *a = (*a).min(*b));
    Ok(())
}

/// `acc += x` for integer codes (the sum servers, all-reduces and devices
/// perform). An `i32` overflow is an error that leaves `acc` as it was. One
/// pass: each chunk is checked while cache-resident and added only if it
/// fits; integer addition is exact, so chunks added before a failing one
/// are subtracted again.
pub fn add_codes(acc: &mut [i32], x: &[i32]) -> Result<()> {
    check("code accumulator", acc.len(), x.len())?;
    // The starts of the pieces that did not fit (and were left alone).
    let refused = std::sync::Mutex::new(Vec::new());
    par::chunks(acc, |start, a| {
        let b = &x[start..start + a.len()];
        if a.iter().zip(b).all(|(a, b)| a.checked_add(*b).is_some()) {
            a.iter_mut().zip(b).for_each(|(a, b)| *a += *b);
        } else {
            refused.lock().unwrap().push(start);
        }
    });
    let refused = refused.into_inner().unwrap();
    if refused.is_empty() {
        return Ok(());
    }
    par::chunks(acc, |start, a| {
        if !refused.contains(&start) {
            let b = &x[start..start + a.len()];
            a.iter_mut().zip(b).for_each(|(a, b)| *a -= *b);
        }
    });
    Err(Error::InvalidParam { key: "workers".into(), problem: "too many workers for the code accumulator".into() })
}

/// The job's reductions of one process's fold over every process, in
/// place. `workers` counts members (devices or workers), not processes.
pub trait Collective {
    /// How many members take part.
    fn workers(&self) -> usize;
    /// MAX over members.
    fn max_f32(&mut self, x: &mut [f32]) -> Result<()>;
    /// SUM over members, in member order.
    fn sum_f32(&mut self, x: &mut [f32]) -> Result<()>;
    /// MIN over members of values below `count`.
    fn min_u8(&mut self, x: &mut [u8], count: u8) -> Result<()>;
    /// Exact SUM over members of integer codes, each member's in `lo..=hi`.
    fn sum_codes(&mut self, x: &mut [i32], lo: i32, hi: i32) -> Result<()>;
    /// Exact SUM over members of `n` codes packed in lanes (`lanes`' layout)
    /// of `width` bits, wide enough for `workers() * (hi - lo)`: this
    /// process's lanes hold `code - lo` summed over its `count` members; the
    /// result's, over every member. The default goes through `sum_codes`.
    fn sum_packed(&mut self, words: &mut [u64], n: usize, lo: i32, hi: i32, count: u32, width: u32) -> Result<()> {
        let mut codes = vec![0i32; n];
        let base = lo as i64 * count as i64;
        lanes::unpack_codes(words, width, base, &mut codes)?;
        self.sum_codes(&mut codes, lo, hi)?;
        let base = lo as i64 * self.workers() as i64;
        lanes::pack_slice_into_words(&codes, width, |c| (c as i64 - base) as u64, words);
        Ok(())
    }
    /// How many members' codes the lanes of a final contribution must hold
    /// when it leaves this process: every member's for an all-reduce; a
    /// parameter server widens lanes itself (`scheme::LaneSum`), so its
    /// workers send lanes for their own members only.
    fn lanes_for(&self) -> usize {
        self.workers()
    }
}

/// Compares `fields` across every member in one MAX reduction of their
/// 16-bit pieces and the pieces' negations (exact in float32; always
/// `8 * fields.len()` floats, so callers with different fields never pair
/// up or truncate). Returns each field's maximum over members and the
/// indices of the fields that differ between members.
pub fn compare_fields(coll: &mut dyn Collective, fields: &[u64]) -> Result<(Vec<u64>, Vec<usize>)> {
    let pieces: Vec<f32> = fields.iter().flat_map(|&v| (0..4).map(move |i| ((v >> (16 * i)) & 0xFFFF) as f32)).collect();
    let mut both: Vec<f32> = pieces.iter().copied().chain(pieces.iter().map(|p| -p)).collect();
    coll.max_f32(&mut both)?;
    let (max, neg_min) = both.split_at(pieces.len());
    let field_max = (0..fields.len()).map(|f| (0..4).fold(0u64, |acc, i| acc | (max[4 * f + i] as u64) << (16 * i))).collect();
    let differs = (0..fields.len()).filter(|&f| (0..4).any(|i| max[4 * f + i] != -neg_min[4 * f + i])).collect();
    Ok((field_max, differs))
}

/// The lane width of `members` members' codes summed, each in `lo..=hi`
/// (None when the sum could overflow an `i32`).
pub fn sum_width(lo: i32, hi: i32, members: usize) -> Option<u32> {
    let span = (hi as i64 - lo as i64).max(0) as u64;
    span.checked_mul(members as u64).filter(|&t| t <= i32::MAX as u64).map(lanes::width_for)
}

/// The bytes each collective operation hands its transport for one member,
/// counted alike by every transport: float32 values as they are, levels and
/// codes packed in lanes just wide enough (for codes, for `workers` members'
/// sum). The MPI store sends exactly these; the device store counts them.
pub fn f32_bytes(n: usize) -> u64 {
    4 * n as u64
}

pub fn levels_bytes(n: usize, count: u8) -> u64 {
    8 * lanes::words_for(n, lanes::width_for(count.saturating_sub(1) as u64)) as u64
}

pub fn codes_bytes(n: usize, lo: i32, hi: i32, workers: usize) -> u64 {
    let span = (hi as i64 - lo as i64) as u64;
    8 * lanes::words_for(n, lanes::width_for(span.saturating_mul(workers as u64))) as u64
}

/// The collective of a store whose members are all in this process (the
/// `device` store): `scheme` has already folded them, so every reduction is
/// done; it counts the bytes each member handed over, as the MPI store's
/// transport counts what it sends.
pub struct InProcess {
    members: usize,
    sent: u64,
}

impl InProcess {
    pub fn new(members: usize) -> InProcess {
        InProcess { members, sent: 0 }
    }

    /// Bytes every member together handed the reductions so far.
    pub fn bytes_sent(&self) -> u64 {
        self.sent
    }

    fn count(&mut self, per_member: u64) {
        self.sent += self.members as u64 * per_member;
    }
}

impl Collective for InProcess {
    fn workers(&self) -> usize {
        self.members
    }

    fn max_f32(&mut self, x: &mut [f32]) -> Result<()> {
        self.count(f32_bytes(x.len()));
        Ok(())
    }

    fn sum_f32(&mut self, x: &mut [f32]) -> Result<()> {
        self.count(f32_bytes(x.len()));
        Ok(())
    }

    fn min_u8(&mut self, x: &mut [u8], count: u8) -> Result<()> {
        self.count(levels_bytes(x.len(), count));
        Ok(())
    }

    fn sum_codes(&mut self, x: &mut [i32], lo: i32, hi: i32) -> Result<()> {
        self.count(codes_bytes(x.len(), lo, hi, self.members));
        Ok(())
    }

    fn sum_packed(&mut self, _: &mut [u64], n: usize, lo: i32, hi: i32, _: u32, _: u32) -> Result<()> {
        self.count(codes_bytes(n, lo, hi, self.members));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reductions_fold_elementwise_and_check_lengths() {
        let mut a = vec![1.0f32, -2.0, 3.0];
        max_into(&mut a, &[0.0, 5.0, 3.0]).unwrap();
        assert_eq!(a, [1.0, 5.0, 3.0]);
        sum_into(&mut a, &[1.0, 1.0, -3.0]).unwrap();
        assert_eq!(a, [2.0, 6.0, 0.0]);
        let mut l = vec![3u8, 0, 2];
        min_into(&mut l, &[1, 1, 2]).unwrap();
        assert_eq!(l, [1, 0, 2]);
        let mut c = vec![-3i32, 7];
        add_codes(&mut c, &[3, -8]).unwrap();
        assert_eq!(c, [0, -1]);
        assert!(sum_into(&mut a, &[1.0]).is_err());
        let mut full = [1, i32::MAX];
        let err = add_codes(&mut full, &[1, 1]).unwrap_err().to_string();
        assert!(err.contains("too many workers") && full == [1, i32::MAX], "{err}"); // nothing added
        // An overflow in a late chunk takes back the chunks already added.
        let n = 4 * par::CHUNK;
        let mut acc: Vec<i32> = (0..n as i32).collect();
        let mut x = vec![-3i32; n];
        acc[n - 1] = i32::MIN + 1;
        x[n - 1] = -2;
        let before = acc.clone();
        assert!(add_codes(&mut acc, &x).is_err());
        assert_eq!(acc, before);
        // Large inputs take the parallel path with the same results.
        let n = 3 * par::CHUNK + 5;
        let mut big: Vec<i32> = (0..n as i32).collect();
        add_codes(&mut big, &vec![1; n]).unwrap();
        assert!(big.iter().enumerate().all(|(i, &v)| v == i as i32 + 1));
    }

    #[test]
    fn the_in_process_collective_counts_every_members_bytes() {
        let mut c = InProcess::new(3);
        c.sum_f32(&mut [0.0; 10]).unwrap();
        assert_eq!(c.bytes_sent(), 3 * 40);
        c.sum_codes(&mut [0; 64], -1, 1).unwrap();
        assert_eq!(c.bytes_sent(), 120 + 3 * codes_bytes(64, -1, 1, 3));
        assert_eq!(c.workers(), 3);
    }
}
