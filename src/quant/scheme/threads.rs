//! A test harness: members of one job on threads of their own, each with
//! one member's state, reducing through an in-memory group, as separate
//! workers of an all-reduce job would. The device store folds all members
//! in one thread instead; the scheme tests run both and compare bits.

use std::sync::{Condvar, Mutex};

use crate::quant::collective::{self, Collective};
use crate::error::{Error, Result};

const ABORTED: &str = "another device failed";

#[derive(Clone)]
enum Buf {
    F32(Vec<f32>),
    U8(Vec<u8>),
    I32(Vec<i32>),
}

struct GroupState {
    /// Double-buffered by round parity: a round's buffers are overwritten two
    /// rounds later, when every member has finished reading them.
    slots: [Vec<Option<Buf>>; 2],
    arrived: [usize; 2],
    round_of: [u64; 2],
    aborted: Option<String>,
}

/// The devices of one store push, each on its own thread.
struct LocalGroup {
    size: usize,
    state: Mutex<GroupState>,
    ready: Condvar,
}

impl LocalGroup {
    fn new(size: usize) -> LocalGroup {
        LocalGroup {
            size,
            state: Mutex::new(GroupState { slots: [vec![None; size], vec![None; size]], arrived: [0; 2], round_of: [u64::MAX; 2], aborted: None }),
            ready: Condvar::new(),
        }
    }

    /// The handle member `rank` reduces through.
    fn member(&self, rank: usize) -> LocalMember<'_> {
        LocalMember { group: self, rank, round: 0 }
    }

    /// Wakes every waiting member with an error (a member failed).
    fn abort(&self, why: &str) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.aborted.get_or_insert_with(|| why.to_string());
        self.ready.notify_all();
    }

    fn exchange(&self, rank: usize, round: u64, buf: Buf) -> Result<Vec<Buf>> {
        let p = (round % 2) as usize;
        let mut s = self.state.lock().unwrap();
        if s.round_of[p] != round {
            s.round_of[p] = round;
            s.arrived[p] = 0;
        }
        s.slots[p][rank] = Some(buf);
        s.arrived[p] += 1;
        self.ready.notify_all();
        while s.arrived[p] < self.size || s.round_of[p] != round {
            if let Some(why) = &s.aborted {
                return Err(Error::Store(format!("{ABORTED}: {why}")));
            }
            s = self.ready.wait(s).unwrap();
        }
        Ok(s.slots[p].iter().map(|b| b.clone().expect("every member deposited")).collect())
    }
}

pub struct LocalMember<'g> {
    group: &'g LocalGroup,
    rank: usize,
    round: u64,
}

impl LocalMember<'_> {
    fn all(&mut self, buf: Buf) -> Result<Vec<Buf>> {
        let r = self.round;
        self.round += 1;
        self.group.exchange(self.rank, r, buf)
    }
}

/// Every member's buffer folded in member order with `collective`'s reductions.
fn fold<T: Copy>(x: &mut [T], bufs: Vec<Buf>, get: impl Fn(Buf) -> Vec<T>, f: impl Fn(&mut [T], &[T]) -> Result<()>) -> Result<()> {
    let mut bufs = bufs.into_iter().map(get);
    x.copy_from_slice(&bufs.next().unwrap());
    bufs.try_for_each(|b| f(x, &b))
}

impl Collective for LocalMember<'_> {
    fn workers(&self) -> usize {
        self.group.size
    }

    fn max_f32(&mut self, x: &mut [f32]) -> Result<()> {
        let all = self.all(Buf::F32(x.to_vec()))?;
        fold(x, all, |b| if let Buf::F32(v) = b { v } else { unreachable!() }, collective::max_into)
    }

    fn sum_f32(&mut self, x: &mut [f32]) -> Result<()> {
        let all = self.all(Buf::F32(x.to_vec()))?;
        fold(x, all, |b| if let Buf::F32(v) = b { v } else { unreachable!() }, collective::sum_into)
    }

    fn min_u8(&mut self, x: &mut [u8], _count: u8) -> Result<()> {
        let all = self.all(Buf::U8(x.to_vec()))?;
        fold(x, all, |b| if let Buf::U8(v) = b { v } else { unreachable!() }, collective::min_into)
    }

    fn sum_codes(&mut self, x: &mut [i32], _lo: i32, _hi: i32) -> Result<()> {
        let all = self.all(Buf::I32(x.to_vec()))?;
        fold(x, all, |b| if let Buf::I32(v) = b { v } else { unreachable!() }, collective::add_codes)
    }
}

/// Runs `work(rank, member)` for every member of a new group, each on its own
/// thread; the first error aborts the others and is returned.
pub fn run_group<T: Send>(size: usize, work: impl Fn(usize, &mut LocalMember) -> Result<T> + Sync) -> Result<Vec<T>> {
    let group = LocalGroup::new(size);
    let results: Vec<Result<T>> = std::thread::scope(|s| {
        let run = |rank: usize| {
            let mut m = group.member(rank);
            // A panicking member fails the push like an error, and wakes the others.
            let r = crate::error::catch_panic(|| work(rank, &mut m)).map_err(|e| match e {
                Error::Internal(why) => Error::Internal(format!("device {rank} panicked: {why}")),
                other => other,
            });
            if let Err(e) = &r {
                group.abort(&e.to_string());
            }
            r
        };
        let handles: Vec<_> = (1..size).map(|rank| s.spawn(move || run(rank))).collect();
        let mut out = vec![run(0)];
        out.extend(handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(Error::Internal("a device thread panicked".into())))));
        out
    });
    // Report the member that failed first, not the ones it aborted.
    if let Some(i) = results.iter().position(|r| matches!(r, Err(e) if !e.to_string().starts_with(ABORTED))) {
        return Err(results.into_iter().nth(i).unwrap().err().unwrap());
    }
    results.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_agree_over_many_rounds() {
        let out = run_group(3, |rank, m| {
            let mut seen = Vec::new();
            for round in 0..20 {
                let mut x = vec![rank as f32 + round as f32, -(rank as f32)];
                m.max_f32(&mut x)?;
                let mut c = vec![rank as i32 - 1; 3];
                m.sum_codes(&mut c, -1, 1)?;
                let mut l = vec![rank as u8 + 1, 2];
                m.min_u8(&mut l, 4)?;
                seen.push((x, c, l));
            }
            Ok(seen)
        })
        .unwrap();
        for (round, (x, c, l)) in out[0].iter().enumerate() {
            assert_eq!(x, &vec![2.0 + round as f32, 0.0]);
            assert_eq!(c, &vec![0; 3]);
            assert_eq!(l, &vec![1, 2]);
        }
        assert!(out.iter().all(|o| o == &out[0]));
    }

    #[test]
    fn a_failing_member_ends_the_others() {
        let err = run_group(3, |rank, m| {
            if rank == 1 {
                return Err(Error::Store("device 1 broke".into()));
            }
            m.sum_f32(&mut [1.0])
        })
        .unwrap_err();
        assert!(err.to_string().contains("device 1 broke"), "{err}");
    }

    #[test]
    fn a_panicking_member_fails_the_group_without_a_deadlock() {
        let err = run_group(3, |rank, m| {
            m.sum_f32(&mut [1.0])?;
            if rank == 2 {
                panic!("device 2 blew up");
            }
            m.sum_f32(&mut [1.0]) // the others wait here for device 2
        })
        .unwrap_err();
        assert_eq!(err, Error::Internal("device 2 panicked: device 2 blew up".into()));
    }
}
