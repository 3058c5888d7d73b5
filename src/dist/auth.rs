//! Message authentication for the distributed store: with a shared secret
//! (`GRADPACK_SECRET`, or `GRADPACK_SECRET_FILE` naming a file), every frame
//! carries a keyed BLAKE3 MAC over its header and payload, with the sender
//! process's random nonce and a per-process sequence number. A receiver
//! checks the MAC before it parses anything, and refuses a sequence number
//! it has already seen from that sender (a replay). Without a secret,
//! frames carry no MAC and any process that reaches a port can take part.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::error::{Error, Result};

/// Bytes of the authentication frame: nonce, sequence number, MAC.
pub const TAG_LEN: usize = 8 + 8 + 32;

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
    /// Accepts `seq` once; false for a repeat or one too old to tell.
    fn accept(&mut self, seq: u64) -> bool {
        if seq > self.max {
            let shift = seq - self.max;
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

/// One process's signer and verifier.
pub struct Auth {
    key: Secret,
    nonce: u64,
    seq: AtomicU64,
    /// Replay windows by sender nonce; only authentic messages add one.
    windows: Mutex<HashMap<u64, Window>>,
}

fn mac(key: &Secret, nonce: u64, seq: u64, header: &[u8], payload: &[u8]) -> blake3::Hash {
    let mut h = blake3::Hasher::new_keyed(&key.0);
    h.update(&nonce.to_le_bytes());
    h.update(&seq.to_le_bytes());
    h.update(&(header.len() as u64).to_le_bytes());
    h.update(header);
    if payload.len() >= 1 << 17 {
        h.update_rayon(payload);
    } else {
        h.update(payload);
    }
    h.finalize()
}

/// A nonce unique to this process (not secret): the process id, the time and
/// an address, hashed.
fn process_nonce() -> u64 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let here = &t as *const u128 as usize;
    let mut h = blake3::Hasher::new();
    h.update(&std::process::id().to_le_bytes());
    h.update(&t.to_le_bytes());
    h.update(&here.to_le_bytes());
    u64::from_le_bytes(h.finalize().as_bytes()[..8].try_into().unwrap())
}

impl Auth {
    pub fn new(key: Secret) -> Auth {
        Auth { key, nonce: process_nonce(), seq: AtomicU64::new(0), windows: Mutex::default() }
    }

    /// The authentication frame for a message (the next sequence number).
    pub fn sign(&self, header: &[u8], payload: &[u8]) -> Vec<u8> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let tag = mac(&self.key, self.nonce, seq, header, payload);
        let mut out = Vec::with_capacity(TAG_LEN);
        out.extend(self.nonce.to_le_bytes());
        out.extend(seq.to_le_bytes());
        out.extend(tag.as_bytes());
        out
    }

    /// Checks a message's authentication frame: the MAC first (in constant
    /// time), then that its sequence number is new for its sender.
    pub fn verify(&self, header: &[u8], payload: &[u8], tag: &[u8]) -> Result<()> {
        let fail = |why: &str| Error::Transport(format!("unauthenticated message: {why}"));
        if tag.len() != TAG_LEN {
            return Err(fail(&format!("an authentication frame of {} bytes, expected {TAG_LEN}", tag.len())));
        }
        let nonce = u64::from_le_bytes(tag[..8].try_into().unwrap());
        let seq = u64::from_le_bytes(tag[8..16].try_into().unwrap());
        let want = mac(&self.key, nonce, seq, header, payload);
        let got: [u8; 32] = tag[16..].try_into().unwrap();
        if want != blake3::Hash::from(got) {
            return Err(fail("the MAC does not match (another GRADPACK_SECRET, or a forged or corrupted frame)"));
        }
        if !self.windows.lock().unwrap_or_else(|p| p.into_inner()).entry(nonce).or_default().accept(seq) {
            return Err(fail(&format!("sequence number {seq} was already used (a replay)")));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signed_messages_verify_once_and_forgeries_do_not() {
        let a = Auth::new(Secret::new(b"s3cret").unwrap());
        let b = Auth::new(Secret::new(b"s3cret").unwrap());
        let other = Auth::new(Secret::new(b"another").unwrap());
        let tag = a.sign(b"header", b"payload");
        assert_eq!(tag.len(), TAG_LEN);
        b.verify(b"header", b"payload", &tag).unwrap();
        assert!(b.verify(b"header", b"payload", &tag).unwrap_err().to_string().contains("a replay"));
        let tag2 = a.sign(b"header", b"payload");
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
    }

    #[test]
    fn the_replay_window_takes_reordering_but_not_repeats() {
        let mut w = Window::default();
        assert!(w.accept(5) && w.accept(3) && w.accept(4) && w.accept(100));
        assert!(!w.accept(5) && !w.accept(100) && !w.accept(36));
        assert!(w.accept(37) && !w.accept(37));
        assert!(w.accept(1000) && !w.accept(900));
    }
}
