//! Admission of connections to a node's receiving socket. ZeroMQ asks the
//! gate (its authentication protocol, ZAP) before it completes each
//! connection's handshake, with the peer's address; the gate refuses the
//! connection when that address already holds `per_address` established
//! connections to the node's port, or the port holds `total`. The counts are
//! the kernel's (`/proc/net/tcp` and `tcp6`), so no event lost under a flood
//! can make them drift. A connection that never finishes its handshake is
//! closed by ZeroMQ after `van::HANDSHAKE_TIMEOUT`, whatever the gate says.
//!
//! A handshaked connection must then prove itself: the receiver records each
//! connection (by its socket's inode) that delivered a valid message
//! (`Proofs`), and the gate's thread shuts down every connection to its port
//! that has had none for the grace (`GRADPACK_CONNECTION_GRACE`), so idle
//! connections cannot hold the caps and lock the job's own nodes out. It
//! finds them in the kernel's table and this process's descriptors, and
//! leaves closing them to ZeroMQ (which owns them): a shutdown makes its
//! engine see the end of the connection. Without `/proc` (not Linux), every
//! connection is admitted and none is swept.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Where ZeroMQ sends its requests (RFC 27), in the node's context.
const ZAP_ENDPOINT: &str = "inproc://zeromq.zap.01";

/// The ZAP domain set on the receiving socket: with the NULL mechanism,
/// ZeroMQ asks the gate only when a domain is set.
pub const DOMAIN: &str = "gradpack";

/// How long counts read from the kernel are reused (a burst of handshakes reads them once).
const FRESH: Duration = Duration::from_millis(50);

/// The least time between two reads of the kernel's table for the sweep.
const SWEEP_EVERY: Duration = Duration::from_millis(250);

/// How long after an admission the sweep first looks at the new connection
/// (a job's own has proven itself by then; a read sooner would only delay
/// the admissions of the job's start).
const FIRST_LOOK: Duration = Duration::from_secs(1);

/// How long a proof is kept for a connection not yet seen in the kernel's
/// table (a table read just before it was established).
const PROOF_UNSEEN: Duration = Duration::from_secs(2);

/// The caps of one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    pub per_address: usize,
    pub total: usize,
}

impl Caps {
    /// For a job of `nodes` nodes: each peer holds one connection to a node
    /// (and briefly a second while ZeroMQ reconnects), and several nodes may
    /// share a host.
    pub fn for_job(nodes: usize) -> Caps {
        Caps { per_address: 2 * nodes + 16, total: 4 * nodes + 64 }
    }
}

/// Connections to one node's port that delivered a valid message, by their
/// socket's inode (unlike a descriptor, not reused while the process lives
/// on): written by the receiving thread, read by the gate's.
#[derive(Default)]
pub struct Proofs {
    inodes: Mutex<HashMap<u64, Instant>>,
}

impl Proofs {
    /// Records that the connection on descriptor `fd` (ZeroMQ's `__fd`
    /// property of a message it delivered) sent a valid message.
    pub fn record_fd(&self, fd: i32) {
        if let Some(inode) = socket_inode(fd) {
            self.inodes.lock().unwrap().insert(inode, Instant::now());
        }
    }

    /// Which of `live` have proven themselves; forgets the proofs of
    /// connections that ended.
    fn proven_among(&self, live: &HashSet<u64>) -> HashSet<u64> {
        let mut inodes = self.inodes.lock().unwrap();
        inodes.retain(|inode, at| live.contains(inode) || at.elapsed() < PROOF_UNSEEN);
        live.iter().filter(|i| inodes.contains_key(i)).copied().collect()
    }
}

/// The gate's thread; it stops when this is dropped.
pub struct Gate {
    stop: Arc<AtomicBool>,
    /// The port it guards (0 until the socket is bound: then it admits all).
    port: Arc<AtomicU16>,
    proofs: Arc<Proofs>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Gate {
    /// Starts the gate of a socket of `ctx`, before it binds (with `DOMAIN`
    /// as its ZAP domain); `guard` then names the port it bound. Connections
    /// without a proof (`proofs`) for `grace` are shut down.
    pub fn start(ctx: &zmq::Context, caps: Caps, grace: Duration) -> Result<Gate> {
        let zmq_err = |what: &str, e: zmq::Error| Error::Transport(format!("{what}: {e}"));
        let rep = ctx.socket(zmq::REP).map_err(|e| zmq_err("creating the connection gate", e))?;
        rep.set_linger(0).map_err(|e| zmq_err("creating the connection gate", e))?;
        rep.bind(ZAP_ENDPOINT).map_err(|e| zmq_err("binding the connection gate", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let port = Arc::new(AtomicU16::new(0));
        let proofs = Arc::new(Proofs::default());
        let (s, p, pr) = (stop.clone(), port.clone(), proofs.clone());
        let thread = std::thread::Builder::new()
            .name("gradpack-gate".into())
            .spawn(move || serve(rep, &p, caps, &s, Sweeper::new(grace), &pr))
            .map_err(|e| Error::Transport(format!("starting the connection gate: {e}")))?;
        Ok(Gate { stop, port, proofs, thread: Some(thread) })
    }

    /// Where the receiving socket records its connections' proofs.
    pub fn proofs(&self) -> Arc<Proofs> {
        self.proofs.clone()
    }

    /// The port the socket bound.
    pub fn guard(&self, port: u16) {
        self.port.store(port, Ordering::Relaxed);
    }
}

fn serve(rep: zmq::Socket, port: &AtomicU16, caps: Caps, stop: &AtomicBool, mut sweeper: Sweeper, proofs: &Proofs) {
    let mut held = Held::default();
    let mut read_at: Option<Instant> = None;
    while !stop.load(Ordering::Relaxed) {
        sweeper.tick(port.load(Ordering::Relaxed), proofs);
        if !matches!(rep.poll(zmq::POLLIN, 100), Ok(n) if n > 0) {
            continue;
        }
        let Ok(request) = rep.recv_multipart(0) else { continue };
        // version, request id, domain, address, identity, mechanism, ...
        let (id, address) = match &request[..] {
            [_, id, _, address, ..] => (id.clone(), String::from_utf8_lossy(address).into_owned()),
            _ => (Vec::new(), String::new()),
        };
        let port = port.load(Ordering::Relaxed);
        if port != 0 && read_at.is_none_or(|at| at.elapsed() > FRESH) {
            if let Some(kernel) = Connections::read(port) {
                held.clamp(&kernel);
            }
            read_at = Some(Instant::now());
        }
        let verdict = match address.parse::<IpAddr>() {
            Ok(ip) => held.admit(ip, caps),
            Err(_) => Ok(()),
        };
        let (code, text) = match &verdict {
            Ok(()) => {
                sweeper.admitted(Instant::now());
                ("200", String::new())
            }
            Err(why) => ("400", why.clone()),
        };
        let _ = rep.send_multipart([b"1.0".to_vec(), id, code.as_bytes().to_vec(), text.into_bytes(), Vec::new(), Vec::new()], 0);
    }
}

/// Established TCP connections to one local port, by remote address, as
/// the kernel lists them (with those that never finished a handshake).
#[derive(Debug, Default, PartialEq)]
struct Connections {
    by_address: HashMap<IpAddr, usize>,
    /// The sockets' inodes (0 for a connection no process holds any more).
    inodes: HashSet<u64>,
}

impl Connections {
    /// From the kernel's tables; None when they cannot be read.
    fn read(port: u16) -> Option<Connections> {
        let mut c = Connections::default();
        let mut any = false;
        for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
            if let Ok(text) = std::fs::read_to_string(table) {
                any = true;
                c.add_table(&text, port);
            }
        }
        any.then_some(c)
    }

    /// Adds the established connections of one table whose local port is `port`.
    fn add_table(&mut self, text: &str, port: u16) {
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx:rx tr:when retransmits uid timeout inode ...; 01: ESTABLISHED
            let (Some(local), Some(remote), Some(&"01")) = (f.get(1), f.get(2), f.get(3)) else { continue };
            let local_port = local.rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok());
            if local_port != Some(port) {
                continue;
            }
            if let Some(ip) = remote.split(':').next().and_then(parse_proc_ip) {
                *self.by_address.entry(unmapped(ip)).or_default() += 1;
            }
            if let Some(inode) = f.get(9).and_then(|i| i.parse::<u64>().ok()).filter(|&i| i != 0) {
                self.inodes.insert(inode);
            }
        }
    }

    fn from(&self, ip: IpAddr) -> usize {
        self.by_address.get(&unmapped(ip)).copied().unwrap_or(0)
    }
}

/// Connections that finished a handshake here, by address: each admission
/// counts one, and a count never stays above the kernel's for its address
/// (a connection that ended leaves the kernel's table). Connections that
/// never handshake are in the kernel's count but not in this one, so they
/// cannot crowd out the job's own (`van::HANDSHAKE_TIMEOUT` ends them).
#[derive(Debug, Default)]
struct Held {
    by_address: HashMap<IpAddr, usize>,
}

impl Held {
    fn clamp(&mut self, kernel: &Connections) {
        for (ip, n) in self.by_address.iter_mut() {
            *n = (*n).min(kernel.from(*ip));
        }
        self.by_address.retain(|_, n| *n > 0);
    }

    /// Admits one more handshake from `ip`, or says why not.
    fn admit(&mut self, ip: IpAddr, caps: Caps) -> std::result::Result<(), String> {
        let ip = unmapped(ip);
        let from = self.by_address.get(&ip).copied().unwrap_or(0);
        let total: usize = self.by_address.values().sum();
        if from >= caps.per_address {
            return Err(format!("{from} connections from {ip} already, at most {}", caps.per_address));
        }
        if total >= caps.total {
            return Err(format!("{total} connections already, at most {}", caps.total));
        }
        *self.by_address.entry(ip).or_default() += 1;
        Ok(())
    }
}

/// Finds the connections to the gate's port that have had no proof for the
/// grace, and shuts them down. It reads the kernel's table only when that
/// can find something: `FIRST_LOOK` after an admission (to see the new
/// connection), and when an unproven one's grace ends; a job whose
/// connections all proved themselves costs nothing, and no read delays the
/// admissions of a job's start.
struct Sweeper {
    grace: Duration,
    /// The first admission since the table was last read.
    admitted_since: Option<Instant>,
    last_read: Option<Instant>,
    /// When each unproven connection was first seen.
    first_seen: HashMap<u64, Instant>,
}

impl Sweeper {
    fn new(grace: Duration) -> Sweeper {
        Sweeper { grace, admitted_since: None, last_read: None, first_seen: HashMap::new() }
    }

    fn admitted(&mut self, now: Instant) {
        self.admitted_since.get_or_insert(now);
    }

    /// When the kernel's table is next read.
    fn due(&self) -> Option<Instant> {
        let look = self.admitted_since.map(|t| t + FIRST_LOOK.min(self.grace));
        let grace_ends = self.first_seen.values().min().map(|&t| t + self.grace);
        look.into_iter().chain(grace_ends).min()
    }

    fn tick(&mut self, port: u16, proofs: &Proofs) {
        let now = Instant::now();
        if port == 0 || self.due().is_none_or(|due| now < due) || self.last_read.is_some_and(|t| now.duration_since(t) < SWEEP_EVERY) {
            return;
        }
        self.last_read = Some(now);
        self.admitted_since = None;
        let Some(kernel) = Connections::read(port) else {
            self.first_seen.clear();
            return;
        };
        let proven = proofs.proven_among(&kernel.inodes);
        let overdue = self.overdue(&kernel.inodes, &proven, now);
        if !overdue.is_empty() {
            let closed = shut_down(&overdue);
            eprintln!(
                "[gradpack] closed {closed} connection(s) to port {port} that sent no valid message within GRADPACK_CONNECTION_GRACE={} s",
                self.grace.as_secs_f64()
            );
        }
    }

    /// The unproven connections of `live` first seen at least the grace
    /// before `now`; forgets those that ended or proved themselves.
    fn overdue(&mut self, live: &HashSet<u64>, proven: &HashSet<u64>, now: Instant) -> HashSet<u64> {
        self.first_seen.retain(|inode, _| live.contains(inode) && !proven.contains(inode));
        for inode in live.difference(proven) {
            self.first_seen.entry(*inode).or_insert(now);
        }
        let overdue: HashSet<u64> = self.first_seen.iter().filter(|(_, seen)| now.duration_since(**seen) >= self.grace).map(|(inode, _)| *inode).collect();
        self.first_seen.retain(|inode, _| !overdue.contains(inode));
        overdue
    }
}

/// The inode of the socket on this process's descriptor `fd`.
fn socket_inode(fd: i32) -> Option<u64> {
    let link = std::fs::read_link(format!("/proc/self/fd/{fd}")).ok()?;
    link.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
}

/// Shuts down (without closing) this process's sockets whose inodes are in
/// `inodes`; how many.
fn shut_down(inodes: &HashSet<u64>) -> usize {
    use std::os::fd::FromRawFd;
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else { return 0 };
    let mut closed = 0;
    for entry in dir.flatten() {
        let Some(fd) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        if socket_inode(fd).is_some_and(|i| inodes.contains(&i)) {
            // SAFETY: `fd` is open (its link was just read) and is a TCP socket
            // (its inode is in the TCP table); ManuallyDrop never closes it, ZeroMQ does.
            let socket = std::mem::ManuallyDrop::new(unsafe { std::net::TcpStream::from_raw_fd(fd) });
            if socket.shutdown(std::net::Shutdown::Both).is_ok() {
                closed += 1;
            }
        }
    }
    closed
}

/// An IPv4 address, whichever way it is written (`::ffff:a.b.c.d` in the IPv6 tables).
fn unmapped(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// An address of `/proc/net/tcp{,6}`: 8 or 32 hex digits, each 32-bit word
/// in the machine's byte order.
fn parse_proc_ip(hex: &str) -> Option<IpAddr> {
    let words: Vec<u32> = (0..hex.len() / 8).map(|i| u32::from_str_radix(hex.get(8 * i..8 * i + 8)?, 16).ok()).collect::<Option<_>>()?;
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
    match (hex.len(), bytes.len()) {
        (8, 4) => Some(IpAddr::from(<[u8; 4]>::try_from(&bytes[..]).ok()?)),
        (32, 16) => Some(IpAddr::from(<[u8; 16]>::try_from(&bytes[..]).ok()?)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_tables_are_read_by_port_and_address() {
        let v4 = "  sl  local_address rem_address   st tx_queue rx_queue\n\
                  0: 0100007F:1F90 0100007F:D431 01 00000000:00000000\n\
                  1: 0100007F:1F90 0100007F:D432 01 00000000:00000000\n\
                  2: 0100007F:1F90 0200000A:D433 01 00000000:00000000\n\
                  3: 0100007F:1F90 0100007F:D434 06 00000000:00000000\n\
                  4: 0100007F:1F91 0100007F:D435 01 00000000:00000000\n";
        let v6 = "  sl  local_address rem_address st\n\
                  0: 0000000000000000FFFF00000100007F:1F90 0000000000000000FFFF00000100007F:D436 01 0\n";
        let mut c = Connections::default();
        c.add_table(v4, 0x1F90);
        c.add_table(v6, 0x1F90);
        let local: IpAddr = "127.0.0.1".parse().unwrap();
        // Not the TIME_WAIT one (06), not another port; the mapped IPv6 one is 127.0.0.1's.
        assert_eq!(c.from(local), 3, "{c:?}");
        assert_eq!(c.from("10.0.0.2".parse().unwrap()), 1);
    }

    #[test]
    fn admissions_are_capped_and_follow_the_kernel_down() {
        let local: IpAddr = "127.0.0.1".parse().unwrap();
        let other: IpAddr = "10.0.0.2".parse().unwrap();
        let caps = Caps { per_address: 2, total: 3 };
        let mut held = Held::default();
        assert!(held.admit(local, caps).is_ok() && held.admit(local, caps).is_ok());
        assert!(held.admit(local, caps).unwrap_err().contains("2 connections from 127.0.0.1"));
        assert!(held.admit(other, caps).is_ok());
        assert!(held.admit("10.0.0.3".parse().unwrap(), caps).unwrap_err().contains("3 connections already"));
        // One of 127.0.0.1's ended: the kernel lists one; many never-handshaked ones do not count.
        let mut kernel = Connections::default();
        kernel.by_address.insert(local, 1);
        kernel.by_address.insert(other, 1000);
        held.clamp(&kernel);
        assert!(held.admit(local, caps).is_ok());
        assert!(held.admit(local, caps).is_err());
    }

    #[test]
    fn inodes_of_established_connections_are_read() {
        let v4 = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
                  0: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 4711 1 0\n\
                  1: 0100007F:1F90 0100007F:D432 06 00000000:00000000 03:00000000 00000000     0        0 0 3 0\n\
                  2: 0100007F:1F91 0100007F:D433 01 00000000:00000000 00:00000000 00000000     0        0 4712 1 0\n\
                  3: 0100007F:1F90 0200007F:D434 01 00000000:00000000 00:00000000 00000000     0        0 0 1 0\n";
        let mut c = Connections::default();
        c.add_table(v4, 0x1F90);
        // Another port's and a TIME_WAIT one are not the port's; an orphan (inode 0) is counted but has no socket here.
        assert_eq!(c.inodes, HashSet::from([4711]));
        assert_eq!(c.from("127.0.0.2".parse().unwrap()), 1);
    }

    #[test]
    fn connections_without_a_proof_are_overdue_after_the_grace() {
        let grace = Duration::from_secs(5);
        let mut sweeper = Sweeper::new(grace);
        let t0 = Instant::now();
        assert_eq!(sweeper.due(), None);
        sweeper.admitted(t0);
        sweeper.admitted(t0 + Duration::from_millis(300));
        assert_eq!(sweeper.due(), Some(t0 + FIRST_LOOK));
        sweeper.admitted_since = None;
        let live = HashSet::from([1, 2, 3]);
        assert!(sweeper.overdue(&live, &HashSet::new(), t0 + FIRST_LOOK).is_empty());
        assert_eq!(sweeper.due(), Some(t0 + FIRST_LOOK + grace));
        // 2 proved itself; 3 ended; 4 came later.
        let live = HashSet::from([1, 2, 4]);
        let t1 = t0 + Duration::from_secs(3);
        assert!(sweeper.overdue(&live, &HashSet::from([2]), t1).is_empty());
        assert_eq!(sweeper.overdue(&live, &HashSet::from([2]), t0 + FIRST_LOOK + grace), HashSet::from([1]));
        assert_eq!(sweeper.due(), Some(t1 + grace));
        assert_eq!(sweeper.overdue(&HashSet::from([2, 4]), &HashSet::from([2]), t1 + grace), HashSet::from([4]));
        // Every live connection proved itself or was closed: nothing is due until the next admission.
        assert_eq!(sweeper.due(), None);
    }

    #[test]
    fn a_proof_is_kept_while_its_connection_lives() {
        let proofs = Proofs::default();
        let now = Instant::now();
        proofs.inodes.lock().unwrap().extend([(7, now), (8, now - Duration::from_secs(3)), (9, now)]);
        // 8 ended long ago; 9 is not in the table yet (read before it came).
        assert_eq!(proofs.proven_among(&HashSet::from([7, 10])), HashSet::from([7]));
        assert_eq!(proofs.inodes.lock().unwrap().keys().copied().collect::<HashSet<_>>(), HashSet::from([7, 9]));
    }
}
