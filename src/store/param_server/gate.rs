//! Admission of connections to a node's receiving socket. ZeroMQ asks the
//! gate (its authentication protocol, ZAP) before it completes each
//! connection's handshake, with the peer's address; the gate refuses the
//! connection when that address already holds `per_address` established
//! connections to the node's port, or the port holds `total`. The counts are
//! the kernel's (`/proc/net/tcp` and `tcp6`), so no event lost under a flood
//! can make them drift. Without `/proc` (not Linux), every connection is
//! admitted. A connection that never finishes its handshake is closed by
//! ZeroMQ after `van::HANDSHAKE_TIMEOUT`, whatever the gate says.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::Arc;
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

/// The gate's thread; it stops when this is dropped.
pub struct Gate {
    stop: Arc<AtomicBool>,
    /// The port it guards (0 until the socket is bound: then it admits all).
    port: Arc<AtomicU16>,
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
    /// as its ZAP domain); `guard` then names the port it bound.
    pub fn start(ctx: &zmq::Context, caps: Caps) -> Result<Gate> {
        let zmq_err = |what: &str, e: zmq::Error| Error::Transport(format!("{what}: {e}"));
        let rep = ctx.socket(zmq::REP).map_err(|e| zmq_err("creating the connection gate", e))?;
        rep.set_linger(0).map_err(|e| zmq_err("creating the connection gate", e))?;
        rep.bind(ZAP_ENDPOINT).map_err(|e| zmq_err("binding the connection gate", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let port = Arc::new(AtomicU16::new(0));
        let (s, p) = (stop.clone(), port.clone());
        let thread = std::thread::Builder::new()
            .name("gradpack-gate".into())
            .spawn(move || serve(rep, &p, caps, &s))
            .map_err(|e| Error::Transport(format!("starting the connection gate: {e}")))?;
        Ok(Gate { stop, port, thread: Some(thread) })
    }

    /// The port the socket bound.
    pub fn guard(&self, port: u16) {
        self.port.store(port, Ordering::Relaxed);
    }
}

fn serve(rep: zmq::Socket, port: &AtomicU16, caps: Caps, stop: &AtomicBool) {
    let mut held = Held::default();
    let mut read_at: Option<Instant> = None;
    while !stop.load(Ordering::Relaxed) {
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
            Ok(()) => ("200", String::new()),
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
            // sl local_address rem_address st ...; 01: ESTABLISHED
            let (Some(local), Some(remote), Some(&"01")) = (f.get(1), f.get(2), f.get(3)) else { continue };
            let local_port = local.rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok());
            if local_port != Some(port) {
                continue;
            }
            if let Some(ip) = remote.split(':').next().and_then(parse_proc_ip) {
                *self.by_address.entry(unmapped(ip)).or_default() += 1;
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
}
