//! Message authentication for the distributed store: with a shared secret
//! (`GRADPACK_SECRET`, or `GRADPACK_SECRET_FILE` naming a file), every frame
//! carries a keyed BLAKE3 MAC, the sender process's random nonce and a
//! per-process sequence number. The MAC covers, besides the header and
//! payload, the job (a random id the scheduler makes when it starts) and the
//! receiver (its nonce), and the header names the sender: a frame is good
//! for one direction between two processes of one job, and a replay to
//! another node, another job or a restarted node fails the MAC. Once the
//! node table is known, a sender id must come with the nonce that
//! registered under it (`Origin::node`). A receiver refuses a sequence
//! number it has already seen from a sender. Without a secret, frames carry
//! no MAC and any process that reaches a port can take part.
//!
//! Before a node knows its job it can only register: its `Register` and the
//! scheduler's `Challenge` (which hands it the job id) are signed under the
//! empty job (`NO_JOB`); the registration that counts is the one it sends
//! again under the job id, which a recording of another job's cannot be.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, RwLock};

use crate::error::{Error, Result};

/// Bytes of the authentication frame: nonce, sequence number, MAC.
pub const TAG_LEN: usize = 8 + 8 + 32;

/// A job's id: random, made by the scheduler when it starts.
pub type JobId = [u8; 16];

/// The job of a node that does not know its job yet (registration only).
pub const NO_JOB: JobId = [0; 16];

/// Sequence numbers may run ahead of the highest one seen by at most this
/// much: a frame far ahead (an insider's 2^64-1) cannot close a sender's window.
const MAX_SEQ_JUMP: u64 = 1 << 32;

/// What the nodes of one job share: a key derived from the secret.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret([u8; 32]);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)") // never printed
    }
}

impl Secret {
    /// The key for `secret` (any bytes, at least one).
    pub fn new(secret: &[u8]) -> Result<Secret> {
        if secret.is_empty() {
            return Err(Error::InvalidParam { key: "GRADPACK_SECRET".into(), problem: "is empty".into() });
        }
        Ok(Secret(blake3::derive_key("gradpack 2026 distributed store message authentication", secret)))
    }

    /// `GRADPACK_SECRET`, or the contents of the file `GRADPACK_SECRET_FILE`
    /// names (a trailing newline removed); None when neither is set.
    pub fn from_env() -> Result<Option<Secret>> {
        let bad = |key: &str, problem: String| Error::InvalidParam { key: key.into(), problem };
        match (std::env::var_os("GRADPACK_SECRET"), std::env::var_os("GRADPACK_SECRET_FILE")) {
            (Some(_), Some(_)) => Err(bad("GRADPACK_SECRET", "and GRADPACK_SECRET_FILE are both set; set one".into())),
            (Some(s), None) => Secret::new(s.as_encoded_bytes()).map(Some),
            (None, Some(path)) => {
                let bytes = std::fs::read(&path).map_err(|e| bad("GRADPACK_SECRET_FILE", format!("cannot read {}: {e}", path.to_string_lossy())))?;
                let trimmed = bytes.strip_suffix(b"\n").unwrap_or(&bytes);
                let trimmed = trimmed.strip_suffix(b"\r").unwrap_or(trimmed);
                Secret::new(trimmed).map_err(|_| bad("GRADPACK_SECRET_FILE", format!("{} is empty", path.to_string_lossy()))).map(Some)
            }
            (None, None) => Ok(None),
        }
    }
}

/// Per-sender replay window: the highest sequence number seen and a bitmap
/// of the 64 below it (messages of one sender may arrive out of order over
/// different sockets).
#[derive(Default, Clone, Copy)]
struct Window {
    max: u64,
    seen: u64,
}

impl Window {
    /// Accepts `seq` once; false for a repeat, one too old to tell, or one
    /// more than `MAX_SEQ_JUMP` ahead.
    fn accept(&mut self, seq: u64) -> bool {
        if seq > self.max {
            let shift = seq - self.max;
            if shift > MAX_SEQ_JUMP {
                return false;
            }
            self.seen = if shift >= 64 { 0 } else { self.seen << shift };
            self.seen |= 1;
            self.max = seq;
            true
        } else {
            let back = self.max - seq;
            if back >= 64 || self.seen & (1 << back) != 0 {
                return false;
            }
            self.seen |= 1 << back;
            true
        }
    }
}

/// Who signed a frame that verified.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Origin {
    /// The signer's process nonce (0 without authentication).
    pub nonce: u64,
    /// Signed under this node's job (false: under `NO_JOB`, registration only).
    pub in_job: bool,
}

impl Origin {
    /// What an unauthenticated transport says of every frame.
    pub const UNAUTHENTICATED: Origin = Origin { nonce: 0, in_job: true };
}

/// The nodes this process knows: node id <-> nonce, both ways.
#[derive(Default)]
struct Peers {
    nonce_of: HashMap<i32, u64>,
    node_of: HashMap<u64, i32>,
}

/// One process's signer and verifier.
pub struct Auth {
    key: Secret,
    nonce: u64,
    seq: AtomicU64,
    job: RwLock<JobId>,
    peers: RwLock<Peers>,
    /// Replay windows by sender nonce; only authentic messages add one.
    windows: Mutex<HashMap<u64, Window>>,
}

/// The MAC of a frame: keyed BLAKE3 over the job, the receiver, the sender's
/// nonce and sequence number, the header, and the payload's BLAKE3 hash (a
/// payload sent to several nodes is hashed once, `Payload::digest`; one pass,
/// on one thread: on a busy node, threads only contend).
fn mac(key: &Secret, job: &JobId, to: u64, nonce: u64, seq: u64, header: &[u8], payload: &[u8; 32]) -> blake3::Hash {
    let mut h = blake3::Hasher::new_keyed(&key.0);
    h.update(job);
    h.update(&to.to_le_bytes());
    h.update(&nonce.to_le_bytes());
    h.update(&seq.to_le_bytes());
    h.update(&(header.len() as u64).to_le_bytes());
    h.update(header);
    h.update(payload);
    h.finalize()
}

/// The hash a MAC covers for `payload`.
pub fn digest(payload: &[u8]) -> [u8; 32] {
    *blake3::hash(payload).as_bytes()
}

/// 32 bytes no other process will make: the kernel's random bytes, with the
/// process id, the time and an address mixed in (none of it is secret).
fn unique_bytes() -> [u8; 32] {
    let mut random = [0u8; 32];
    let _ = std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut random));
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let here = &t as *const u128 as usize;
    let mut h = blake3::Hasher::new();
    h.update(&random);
    h.update(&std::process::id().to_le_bytes());
    h.update(&t.to_le_bytes());
    h.update(&here.to_le_bytes());
    *h.finalize().as_bytes()
}

/// A job id as text (the body of a `Challenge`), and back.
pub fn job_to_hex(job: &JobId) -> String {
    job.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn job_from_hex(text: &str) -> Option<JobId> {
    if text.len() != 32 || !text.is_ascii() {
        return None;
    }
    let mut job = NO_JOB;
    for (i, b) in job.iter_mut().enumerate() {
        *b = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    (job != NO_JOB).then_some(job)
}

fn fail(why: &str) -> Error {
    Error::Transport(format!("unauthenticated message: {why}"))
}

impl Auth {
    pub fn new(key: Secret) -> Auth {
        let nonce = u64::from_le_bytes(unique_bytes()[..8].try_into().unwrap()).max(1);
        Auth { key, nonce, seq: AtomicU64::new(0), job: RwLock::new(NO_JOB), peers: RwLock::default(), windows: Mutex::default() }
    }

    /// This process's nonce: the name its signatures go under.
    pub fn nonce(&self) -> u64 {
        self.nonce
    }

    /// The job this process belongs to (`NO_JOB` until it joined one).
    pub fn job(&self) -> JobId {
        *self.job.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes a new job (the scheduler, once, at start); its id.
    pub fn start_job(&self) -> JobId {
        let job: JobId = unique_bytes()[..16].try_into().unwrap();
        let job = if job == NO_JOB { [1; 16] } else { job };
        *self.job.write().unwrap_or_else(|p| p.into_inner()) = job;
        job
    }

    /// Joins `job`, whose scheduler (node `scheduler`) signs as `nonce`.
    pub fn join(&self, job: JobId, scheduler: i32, nonce: u64) {
        *self.job.write().unwrap_or_else(|p| p.into_inner()) = job;
        self.bind(scheduler, nonce);
    }

    /// Node `id` signs as `nonce` (its authenticated registration says so).
    pub fn bind(&self, id: i32, nonce: u64) {
        let mut p = self.peers.write().unwrap_or_else(|p| p.into_inner());
        if let Some(old) = p.nonce_of.insert(id, nonce) {
            p.node_of.remove(&old);
        }
        p.node_of.insert(nonce, id);
    }

    /// The node that registered as `nonce`, if any.
    pub fn node_of(&self, nonce: u64) -> Option<i32> {
        self.peers.read().unwrap_or_else(|p| p.into_inner()).node_of.get(&nonce).copied()
    }

    /// The authentication frame for a message to node `to` (the next
    /// sequence number), under this process's job and `to`'s nonce. Before
    /// the job is known, only the scheduler can be addressed (nonce 0 until
    /// its challenge named it).
    pub fn sign(&self, to: i32, header: &[u8], payload: &[u8]) -> Result<Vec<u8>> {
        self.sign_digest(to, header, &digest(payload))
    }

    /// As `sign`, given the payload's `digest`.
    pub fn sign_digest(&self, to: i32, header: &[u8], payload: &[u8; 32]) -> Result<Vec<u8>> {
        let job = self.job();
        let to_nonce = match self.peers.read().unwrap_or_else(|p| p.into_inner()).nonce_of.get(&to) {
            Some(&n) => n,
            None if job == NO_JOB => 0,
            None => return Err(Error::Transport(format!("no signing key for node {to}: it is not in this node's table"))),
        };
        Ok(self.sign_for(&job, to_nonce, header, payload))
    }

    /// The frame for a reply under `NO_JOB` to the process `to_nonce` (the
    /// scheduler's challenge to a registering node).
    pub fn sign_reply(&self, to_nonce: u64, header: &[u8], payload: &[u8]) -> Vec<u8> {
        self.sign_for(&NO_JOB, to_nonce, header, &digest(payload))
    }

    fn sign_for(&self, job: &JobId, to: u64, header: &[u8], payload: &[u8; 32]) -> Vec<u8> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let tag = mac(&self.key, job, to, self.nonce, seq, header, payload);
        let mut out = Vec::with_capacity(TAG_LEN);
        out.extend(self.nonce.to_le_bytes());
        out.extend(seq.to_le_bytes());
        out.extend(tag.as_bytes());
        out
    }

    /// Checks a message's authentication frame: the MAC first (in constant
    /// time) for this job and this receiver, then that its sequence number
    /// is new for its sender. A frame without payload may instead be signed
    /// under `NO_JOB` (registration); `Origin::in_job` says which.
    pub fn verify(&self, header: &[u8], payload: &[u8], tag: &[u8]) -> Result<Origin> {
        if tag.len() != TAG_LEN {
            return Err(fail(&format!("an authentication frame of {} bytes, expected {TAG_LEN}", tag.len())));
        }
        let nonce = u64::from_le_bytes(tag[..8].try_into().unwrap());
        let seq = u64::from_le_bytes(tag[8..16].try_into().unwrap());
        let got = blake3::Hash::from(<[u8; 32]>::try_from(&tag[16..]).unwrap());
        let job = self.job();
        let payload_digest = digest(payload);
        let in_job = job != NO_JOB && mac(&self.key, &job, self.nonce, nonce, seq, header, &payload_digest) == got;
        let registration = !in_job
            && payload.is_empty()
            && (mac(&self.key, &NO_JOB, self.nonce, nonce, seq, header, &payload_digest) == got || mac(&self.key, &NO_JOB, 0, nonce, seq, header, &payload_digest) == got);
        if !in_job && !registration {
            return Err(fail("the MAC does not match (another GRADPACK_SECRET; a frame for another node, another job or an earlier run of this one; or a forged or corrupted frame)"));
        }
        if !self.windows.lock().unwrap_or_else(|p| p.into_inner()).entry(nonce).or_default().accept(seq) {
            return Err(fail(&format!("sequence number {seq} was already used, or is far ahead of the last one (a replay)")));
        }
        Ok(Origin { nonce, in_job })
    }

    /// Whether a message that names `sender` as its sender may be believed:
    /// signed in this job by the nonce node `sender` registered with.
    pub fn check_sender(&self, sender: i32, origin: &Origin) -> Result<()> {
        if !origin.in_job {
            return Err(fail(&format!("a message from node {sender} signed outside this job (only a registration may be)")));
        }
        match self.node_of(origin.nonce) {
            Some(id) if id == sender => Ok(()),
            Some(id) => Err(fail(&format!("a message that claims to come from node {sender} was signed by node {id}"))),
            None => Err(fail(&format!("a message that claims to come from node {sender} was signed by a process that did not register as it"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two processes of one job: `a` (node 9) and `b` (node 8), each bound to the other.
    fn pair(secret: &[u8]) -> (Auth, Auth) {
        let (a, b) = (Auth::new(Secret::new(secret).unwrap()), Auth::new(Secret::new(secret).unwrap()));
        let job = a.start_job();
        b.join(job, 9, a.nonce());
        a.bind(8, b.nonce());
        (a, b)
    }

    #[test]
    fn signed_messages_verify_once_and_forgeries_do_not() {
        let (a, b) = pair(b"s3cret");
        let tag = a.sign(8, b"header", b"payload").unwrap();
        assert_eq!(tag.len(), TAG_LEN);
        assert_eq!(b.verify(b"header", b"payload", &tag).unwrap(), Origin { nonce: a.nonce(), in_job: true });
        assert!(b.verify(b"header", b"payload", &tag).unwrap_err().to_string().contains("a replay"));
        let tag2 = a.sign(8, b"header", b"payload").unwrap();
        let (_, other) = pair(b"another");
        assert!(other.verify(b"header", b"payload", &tag2).unwrap_err().to_string().contains("MAC does not match"));
        assert!(b.verify(b"header", b"payloaD", &tag2).is_err());
        assert!(b.verify(b"headex", b"payload", &tag2).is_err());
        // The header/payload boundary is bound too.
        assert!(b.verify(b"headerp", b"ayload", &tag2).is_err());
        let mut bumped = tag2.clone();
        bumped[8] ^= 1; // another sequence number under the same MAC
        assert!(b.verify(b"header", b"payload", &bumped).is_err());
        b.verify(b"header", b"payload", &tag2).unwrap();
        assert!(b.verify(b"header", b"payload", &tag2[..20]).is_err());
        b.check_sender(9, &Origin { nonce: a.nonce(), in_job: true }).unwrap();
        assert!(b.check_sender(11, &Origin { nonce: a.nonce(), in_job: true }).unwrap_err().to_string().contains("signed by node 9"));
        assert!(b.check_sender(9, &Origin { nonce: a.nonce(), in_job: false }).is_err());
        assert!(b.check_sender(9, &Origin { nonce: 77, in_job: true }).unwrap_err().to_string().contains("did not register"));
    }

    #[test]
    fn a_frame_is_good_for_one_receiver_in_one_job() {
        let (a, b) = pair(b"s3cret");
        // A third process of the same job: a frame for b replayed to c fails.
        let c = Auth::new(Secret::new(b"s3cret").unwrap());
        c.join(a.job(), 9, a.nonce());
        let tag = a.sign(8, b"h", b"p").unwrap();
        assert!(c.verify(b"h", b"p", &tag).unwrap_err().to_string().contains("MAC does not match"));
        b.verify(b"h", b"p", &tag).unwrap();
        // Another job with the same secret (or a rerun): b's twin there refuses it.
        let (_, b2) = pair(b"s3cret");
        let tag = a.sign(8, b"h", b"p").unwrap();
        assert!(b2.verify(b"h", b"p", &tag).is_err());
        // A node signs only to nodes of its table once it joined.
        assert!(a.sign(12, b"h", b"p").unwrap_err().to_string().contains("node 12"));
    }

    #[test]
    fn registration_frames_verify_outside_the_job_and_only_without_payload() {
        let scheduler = Auth::new(Secret::new(b"k").unwrap());
        let job = scheduler.start_job();
        let node = Auth::new(Secret::new(b"k").unwrap());
        let register = node.sign(1, b"register", b"").unwrap();
        assert_eq!(scheduler.verify(b"register", b"", &register).unwrap(), Origin { nonce: node.nonce(), in_job: false });
        let challenge = scheduler.sign_reply(node.nonce(), b"challenge", b"");
        assert!(!node.verify(b"challenge", b"", &challenge).unwrap().in_job);
        node.join(job, 1, scheduler.nonce());
        let again = node.sign(1, b"register", b"").unwrap();
        assert!(scheduler.verify(b"register", b"", &again).unwrap().in_job);
        // With a payload, a frame outside the job is not even considered.
        let unjoined = Auth::new(Secret::new(b"k").unwrap());
        let tag = unjoined.sign(1, b"push", b"values").unwrap();
        assert!(scheduler.verify(b"push", b"values", &tag).is_err());
    }

    #[test]
    fn the_replay_window_takes_reordering_but_not_repeats_or_leaps() {
        let mut w = Window::default();
        assert!(w.accept(5) && w.accept(3) && w.accept(4) && w.accept(100));
        assert!(!w.accept(5) && !w.accept(100) && !w.accept(36));
        assert!(w.accept(37) && !w.accept(37));
        assert!(w.accept(1000) && !w.accept(900));
        // An insider's u64::MAX does not close the window on the sender's next frames.
        assert!(!w.accept(u64::MAX));
        assert!(w.accept(1001));
    }

    #[test]
    fn job_ids_round_trip_as_text() {
        let a = Auth::new(Secret::new(b"k").unwrap());
        let job = a.start_job();
        assert_ne!(job, NO_JOB);
        assert_eq!(job_from_hex(&job_to_hex(&job)), Some(job));
        assert_eq!(job_from_hex(&job_to_hex(&NO_JOB)), None);
        assert_eq!(job_from_hex("zz"), None);
        assert_ne!(Auth::new(Secret::new(b"k").unwrap()).start_job(), job);
    }
}
