//! Request tracking: requests waiting for their responses, and the job-wide
//! events (failure, termination, barrier release) that wake every waiter.
//! Knows messages and request ids, nothing of keys or roles.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use super::message::Message;
use crate::error::{Error, Result};

/// Asks the nodes that have not answered request `id` whether they hold it.
pub type Probe<'a> = &'a dyn Fn(u64, &[i32]) -> Result<()>;

/// Checks a response's form before it is filed (its slice, its payload's
/// lengths): one that fails is dropped, and the node's real one still counts.
pub type Check = std::sync::Arc<dyn Fn(&Message) -> Result<()> + Send + Sync>;

/// A request waiting for its responses.
struct Pending {
    /// Nodes yet to answer.
    from: Vec<i32>,
    got: Vec<Message>,
    check: Option<Check>,
}

#[derive(Default)]
struct State {
    pending: HashMap<u64, Pending>,
    failure: Option<String>,
    terminated: bool,
    barriers_done: u64,
    /// Why the last barrier failed (the workers disagree, or one ended).
    barrier_failure: Option<String>,
}

#[derive(Default)]
pub struct Customer {
    next_id: AtomicU64,
    state: Mutex<State>,
    cond: Condvar,
}

impl Customer {
    /// A new request id expecting one response from each node of `from`.
    pub fn start(&self, from: Vec<i32>) -> u64 {
        self.start_checked(from, None)
    }

    /// As `start`, with a check of each response's form (`Check`).
    pub fn start_checked(&self, from: Vec<i32>, check: Option<Check>) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let n = from.len();
        self.state.lock().unwrap().pending.insert(id, Pending { from, got: Vec::with_capacity(n), check });
        id
    }

    /// Requests still waiting for a response.
    #[doc(hidden)]
    pub fn pending(&self) -> Vec<u64> {
        self.state.lock().unwrap().pending.keys().copied().collect()
    }

    /// Files a response, or says why not: no request waits for one from its
    /// sender, or it fails the request's check (an error response is filed
    /// as it is).
    pub fn deliver(&self, msg: Message) -> std::result::Result<(), String> {
        let (id, sender) = (msg.meta.request_id, msg.meta.sender);
        let unexpected = || format!("a response from node {sender} to request {id}, which does not wait for one from it");
        let check = match self.state.lock().unwrap().pending.get(&id) {
            Some(p) if p.from.contains(&sender) => p.check.clone(),
            _ => return Err(unexpected()),
        };
        // Checked outside the lock: it may read a whole payload.
        if let (Some(check), 0) = (check, msg.meta.status) {
            check(&msg).map_err(|e| format!("a response from node {sender} to request {id}: {e}"))?;
        }
        let mut s = self.state.lock().unwrap();
        let p = s.pending.get_mut(&id).ok_or_else(unexpected)?;
        let i = p.from.iter().position(|&n| n == sender).ok_or_else(unexpected)?;
        p.from.swap_remove(i);
        p.got.push(msg);
        drop(s);
        self.cond.notify_all();
        Ok(())
    }

    /// Forgets a request whose sends failed.
    pub fn cancel(&self, id: u64) {
        self.state.lock().unwrap().pending.remove(&id);
    }

    /// Waits for every response of request `id`; an error response, a node
    /// failure or the end of the job end the wait with an error, and so does
    /// `probe` (see `wait_all`).
    pub fn wait(&self, id: u64, patience: Duration, probe: Probe) -> Result<Vec<Message>> {
        let got = self.wait_all(id, patience, probe)?;
        if let Some(bad) = got.iter().find(|m| m.meta.status != 0) {
            return Err(Error::Store(bad.meta.body.clone()));
        }
        Ok(got)
    }

    /// As `wait`, but error responses are returned with the others (the
    /// caller tells which node refused); only a node failure, the end of the
    /// job or the probe end the wait with an error. After each `patience`
    /// without the last response, `probe(id, nodes yet to answer)` asks them
    /// whether they still hold the request (a sync push may wait long for
    /// the other workers; a request lost on the wire would wait for ever):
    /// its error ends the wait, unless the responses came meanwhile.
    pub fn wait_all(&self, id: u64, patience: Duration, probe: Probe) -> Result<Vec<Message>> {
        let mut s = self.state.lock().unwrap();
        let mut since = Instant::now();
        loop {
            if let Some(reason) = &s.failure {
                let reason = reason.clone();
                s.pending.remove(&id);
                return Err(Error::JobFailed(reason));
            }
            let from = &s.pending.get(&id).expect("request id was started").from;
            if from.is_empty() {
                return Ok(s.pending.remove(&id).unwrap().got);
            }
            if s.terminated {
                s.pending.remove(&id);
                return Err(Error::JobFailed("the job has ended".into()));
            }
            let left = patience.saturating_sub(since.elapsed());
            if left.is_zero() {
                let nodes = from.clone();
                drop(s);
                let probed = probe(id, &nodes);
                s = self.state.lock().unwrap();
                since = Instant::now();
                if let Err(e) = probed {
                    if s.pending.get(&id).is_some_and(|p| !p.from.is_empty()) {
                        s.pending.remove(&id);
                        return Err(e);
                    }
                }
                continue;
            }
            s = self.cond.wait_timeout(s, left).unwrap().0;
        }
    }

    /// Marks the job failed (first reason wins) and wakes every waiter.
    pub fn fail(&self, reason: String) {
        let mut s = self.state.lock().unwrap();
        if s.failure.is_none() {
            s.failure = Some(reason);
        }
        drop(s);
        self.cond.notify_all();
    }

    pub fn failure(&self) -> Option<String> {
        self.state.lock().unwrap().failure.clone()
    }

    pub fn terminate(&self) {
        self.state.lock().unwrap().terminated = true;
        self.cond.notify_all();
    }

    pub fn is_over(&self) -> bool {
        let s = self.state.lock().unwrap();
        s.terminated || s.failure.is_some()
    }

    /// Blocks until the job terminates (Ok) or fails (Err).
    pub fn wait_until_over(&self) -> Result<()> {
        let mut s = self.state.lock().unwrap();
        loop {
            if let Some(reason) = &s.failure {
                return Err(Error::JobFailed(reason.clone()));
            }
            if s.terminated {
                return Ok(());
            }
            s = self.cond.wait(s).unwrap();
        }
    }

    pub fn barriers_done(&self) -> u64 {
        self.state.lock().unwrap().barriers_done
    }

    /// Ends barrier `number` (counted from 1): Ok, or failed with the
    /// scheduler's reason. False (nothing happens) for another number: a
    /// release sent again, or one for no barrier this worker is in.
    pub fn release_barrier(&self, number: u64, failure: Option<String>) -> bool {
        let mut s = self.state.lock().unwrap();
        if number != s.barriers_done + 1 {
            return false;
        }
        s.barriers_done = number;
        s.barrier_failure = failure;
        drop(s);
        self.cond.notify_all();
        true
    }

    /// Waits until more than `seen` barriers have been released; after each
    /// `patience` without the release, `ask` says again that this worker is
    /// in the barrier (a message lost either way would otherwise be waited
    /// for as long as heartbeats flow).
    pub fn wait_barrier(&self, seen: u64, patience: Duration, ask: &dyn Fn()) -> Result<()> {
        let mut s = self.state.lock().unwrap();
        let mut since = Instant::now();
        loop {
            if let Some(reason) = &s.failure {
                return Err(Error::JobFailed(reason.clone()));
            }
            if s.barriers_done > seen {
                return match s.barrier_failure.take() {
                    None => Ok(()),
                    Some(why) => Err(Error::Store(why)),
                };
            }
            if s.terminated {
                return Err(Error::JobFailed("the job has ended".into()));
            }
            let left = patience.saturating_sub(since.elapsed());
            if left.is_zero() {
                drop(s);
                ask();
                s = self.state.lock().unwrap();
                since = Instant::now();
                continue;
            }
            s = self.cond.wait_timeout(s, left).unwrap().0;
        }
    }
}
