//! Transport: framed messages over ZeroMQ. Each node binds one ROUTER socket
//! that receives from everyone, and keeps one DEALER socket per peer it sends
//! to. Knows nothing of roles, ranks or keys.

use std::collections::HashMap;
use std::net::{IpAddr, UdpSocket};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use super::message::{Message, Meta};
use crate::error::{Error, Result};

fn zmq_error(what: &str, e: zmq::Error) -> Error {
    Error::Transport(format!("{what}: {e}"))
}

/// Payload bytes this node sent and received (headers included), and the
/// messages it received but could not use: malformed frames, requests it
/// could not answer, responses nobody waited for.
#[derive(Default)]
pub struct Traffic {
    pub sent: AtomicU64,
    pub received: AtomicU64,
    pub dropped: AtomicU64,
    /// Lines written about dropped messages (at most `DROP_LOG_PER_SECOND`
    /// a second, plus one line per second that counts the rest).
    pub logged: AtomicU64,
    window: Mutex<LogWindow>,
}

/// Dropped messages said on stderr per second; a flood is summarised.
pub const DROP_LOG_PER_SECOND: u32 = 10;

#[derive(Default)]
struct LogWindow {
    start: Option<std::time::Instant>,
    printed: u32,
    suppressed: u64,
}

impl Traffic {
    /// Counts a dropped message and says why on stderr, rate-limited so that
    /// a flood of bad frames cannot grow a node's log without bound.
    pub fn drop_message(&self, who: &str, why: std::fmt::Arguments) {
        self.dropped.fetch_add(1, Ordering::Relaxed);
        let mut w = self.window.lock().unwrap_or_else(|p| p.into_inner());
        let now = std::time::Instant::now();
        if w.start.is_none_or(|s| now.duration_since(s) >= Duration::from_secs(1)) {
            if w.suppressed > 0 {
                eprintln!("[gradpack {who}] dropped {} more messages in the last second without saying why (at most {DROP_LOG_PER_SECOND} a second are logged)", w.suppressed);
                self.logged.fetch_add(1, Ordering::Relaxed);
            }
            *w = LogWindow { start: Some(now), printed: 0, suppressed: 0 };
        }
        if w.printed < DROP_LOG_PER_SECOND {
            w.printed += 1;
            self.logged.fetch_add(1, Ordering::Relaxed);
            eprintln!("[gradpack {who}] dropped {why}");
        } else {
            w.suppressed += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_of_drops_is_counted_in_full_and_logged_in_few_lines() {
        let t = Traffic::default();
        for i in 0..5000 {
            t.drop_message("test", format_args!("frame {i}"));
        }
        assert_eq!(t.dropped.load(Ordering::Relaxed), 5000);
        // Ten lines, plus a summary line for each second boundary the loop crossed (normally none).
        let logged = t.logged.load(Ordering::Relaxed);
        assert!((10..=20).contains(&logged), "{logged} lines for 5000 drops");
    }
}

pub struct Van {
    ctx: zmq::Context,
    /// DEALER sockets by peer node id; zmq sockets are not Sync, hence the lock.
    senders: Mutex<HashMap<i32, zmq::Socket>>,
    pub traffic: Traffic,
}

/// The receiving end, owned by one thread.
pub struct Receiver {
    socket: zmq::Socket,
}

/// The address of this host as seen from `peer` (the interface that routes there).
pub fn local_address_towards(peer: &str, port: u16) -> String {
    let probe = UdpSocket::bind("0.0.0.0:0").and_then(|s| {
        s.connect((peer, port))?;
        s.local_addr()
    });
    match probe.map(|a| a.ip()) {
        Ok(IpAddr::V4(ip)) if !ip.is_unspecified() => ip.to_string(),
        _ => "127.0.0.1".to_string(),
    }
}

impl Van {
    pub fn new() -> Van {
        let ctx = zmq::Context::new();
        // Two I/O threads: sends to and receives from several peers overlap.
        let _ = ctx.set_io_threads(2);
        Van { ctx, senders: Mutex::default(), traffic: Traffic::default() }
    }

    /// Binds the receiving socket on `host:port` (port 0: any free port) and
    /// returns it with the port actually bound.
    pub fn bind(&self, host: &str, port: u16) -> Result<(Receiver, u16)> {
        let socket = self.ctx.socket(zmq::ROUTER).map_err(|e| zmq_error("creating a socket", e))?;
        socket.set_linger(0).map_err(|e| zmq_error("setting linger", e))?;
        socket.set_rcvhwm(0).map_err(|e| zmq_error("setting the receive high-water mark", e))?;
        let endpoint = if port == 0 { format!("tcp://{host}:*") } else { format!("tcp://{host}:{port}") };
        socket.bind(&endpoint).map_err(|e| zmq_error(&format!("binding {endpoint}"), e))?;
        let bound = socket
            .get_last_endpoint()
            .map_err(|e| zmq_error("reading the bound endpoint", e))?
            .map_err(|_| Error::Transport("bound endpoint is not UTF-8".into()))?;
        let port = bound.rsplit(':').next().and_then(|p| p.parse::<u16>().ok()).ok_or_else(|| Error::Transport(format!("cannot read the port of {bound}")))?;
        Ok((Receiver { socket }, port))
    }

    /// Opens (or replaces) the sending socket to node `id` at `host:port`.
    pub fn connect(&self, id: i32, host: &str, port: u16) -> Result<()> {
        let socket = self.ctx.socket(zmq::DEALER).map_err(|e| zmq_error("creating a socket", e))?;
        // Closing waits up to 2 s for queued messages (a worker's "done", the
        // scheduler's "terminate") to leave, instead of dropping them.
        socket.set_linger(2000).map_err(|e| zmq_error("setting linger", e))?;
        socket.set_sndhwm(0).map_err(|e| zmq_error("setting the send high-water mark", e))?;
        let endpoint = format!("tcp://{host}:{port}");
        socket.connect(&endpoint).map_err(|e| zmq_error(&format!("connecting to {endpoint}"), e))?;
        self.senders.lock().unwrap().insert(id, socket);
        Ok(())
    }

    /// Closes the sending socket to node `id` (what it queued still leaves
    /// within the linger).
    pub fn disconnect(&self, id: i32) {
        self.senders.lock().unwrap().remove(&id);
    }

    /// Sends a message to node `to`; the payload buffer is handed to ZeroMQ without a copy.
    pub fn send(&self, to: i32, msg: Message) -> Result<()> {
        let meta = msg.meta.encode();
        let bytes = (meta.len() + msg.data.len()) as u64;
        let senders = self.senders.lock().unwrap();
        let socket = senders.get(&to).ok_or_else(|| Error::Transport(format!("no connection to node {to}")))?;
        socket.send(meta, zmq::SNDMORE).map_err(|e| zmq_error(&format!("sending to node {to}"), e))?;
        socket.send(zmq::Message::from(msg.data), 0).map_err(|e| zmq_error(&format!("sending to node {to}"), e))?;
        self.traffic.sent.fetch_add(bytes, Ordering::Relaxed);
        Ok(())
    }
}

impl Default for Van {
    fn default() -> Self {
        Van::new()
    }
}

impl Receiver {
    /// Waits up to `timeout` for a message. `Ok(None)`: nothing arrived.
    /// `Ok(Some(Err(_)))`: something arrived that is not a valid message (the
    /// caller logs it and goes on). `Err(_)`: the socket itself failed.
    pub fn recv(&self, timeout: Duration, traffic: &Traffic) -> Result<Option<Result<Message>>> {
        let ready = self.socket.poll(zmq::POLLIN, timeout.as_millis().min(i64::MAX as u128) as i64).map_err(|e| zmq_error("polling", e))?;
        if ready == 0 {
            return Ok(None);
        }
        // Frames stay in ZeroMQ's buffers: no copy of the payload.
        let mut frames = Vec::with_capacity(3);
        loop {
            let frame = self.socket.recv_msg(0).map_err(|e| zmq_error("receiving", e))?;
            let more = frame.get_more();
            frames.push(frame);
            if !more {
                break;
            }
        }
        traffic.received.fetch_add(frames.iter().skip(1).map(|f| f.len() as u64).sum(), Ordering::Relaxed);
        // ROUTER prepends the peer's identity frame.
        if frames.len() != 3 {
            return Ok(Some(Err(Error::Transport(format!("malformed message: {} frames, expected identity, header and payload", frames.len())))));
        }
        let data = frames.pop().unwrap();
        let meta = match Meta::decode(&frames[1]) {
            Ok(m) => m,
            Err(e) => return Ok(Some(Err(e))),
        };
        Ok(Some(Ok(Message { meta, data: data.into() })))
    }
}
