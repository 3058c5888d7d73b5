//! Transport: framed messages over ZeroMQ. Each node binds one ROUTER socket
//! that receives from everyone, and keeps one DEALER socket per peer it sends
//! to. Knows nothing of roles, ranks or keys.

use std::collections::HashMap;
use std::net::{IpAddr, UdpSocket};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use super::auth::{Auth, Origin, Secret};
use super::gate::{self, Caps, Gate, Proofs};
use super::message::{Message, Meta};
use crate::error::{Error, Result};

/// The first bytes of a notice a node sends back on the connection of a
/// message it could not authenticate; the registering node reads it and
/// fails with the reason (the notice itself is not authenticated).
pub const NOTICE: &[u8] = b"gradpack-refused: ";

fn zmq_error(what: &str, e: zmq::Error) -> Error {
    Error::Transport(format!("{what}: {e}"))
}

/// A connection being watched (`Van::connect_watched`).
pub struct Watch {
    events: zmq::Socket,
    link: LinkState,
}

/// What a connection's monitor events say. Each accepted connection brings
/// one CONNECTED and, when it ends, one DISCONNECTED, but libzmq (4.3.4) does
/// not keep them in order: its connecter emits CONNECTED after handing the
/// new connection to the session, whose engine may already have failed the
/// handshake and emitted DISCONNECTED (seen when MXNet's ps-lite scheduler
/// aborted at once on a registration). So the events are counted, not
/// taken as transitions.
#[derive(Default, Debug, Clone, Copy, PartialEq)]
struct LinkState {
    connected: u64,
    disconnected: u64,
    /// When every accepted connection had ended, unless one came up since.
    down_since: Option<std::time::Instant>,
    /// Handshakes the peer refused (its gate): ZeroMQ then ends the
    /// connection for good, without reconnecting.
    refused: u64,
}

impl LinkState {
    fn connected(&mut self) {
        self.connected += 1;
        if self.connected > self.disconnected {
            self.down_since = None;
        }
    }

    fn disconnected(&mut self, now: std::time::Instant) {
        self.disconnected += 1;
        if self.disconnected >= self.connected {
            self.down_since.get_or_insert(now);
        }
    }

    /// A DISCONNECTED proves a connection was accepted, even before its CONNECTED arrives.
    fn ever_up(&self) -> bool {
        self.connected + self.disconnected > 0
    }
}

impl Watch {
    /// Reads the monitor's events so far, without waiting. Each event is two
    /// frames: 2 bytes of event number (little-endian) and 4 of value, then
    /// the endpoint.
    fn update(&mut self) {
        while let Ok(frames) = self.events.recv_multipart(zmq::DONTWAIT) {
            let Some(head) = frames.first().filter(|f| f.len() >= 2) else { continue };
            let event = u16::from_le_bytes([head[0], head[1]]);
            if event == zmq::SocketEvent::CONNECTED.to_raw() {
                self.link.connected();
            } else if event == zmq::SocketEvent::DISCONNECTED.to_raw() {
                self.link.disconnected(std::time::Instant::now());
            } else if event == zmq::SocketEvent::HANDSHAKE_FAILED_AUTH.to_raw() {
                self.link.refused += 1;
            }
        }
    }

    /// True once the peer has accepted the connection.
    pub fn ever_up(&mut self) -> bool {
        self.update();
        self.link.ever_up()
    }

    /// True once the peer refused the connection's handshake (its gate was
    /// full): ZeroMQ gives the connection up, so the caller connects again.
    pub fn refused(&mut self) -> bool {
        self.update();
        self.link.refused > 0
    }

    /// How long an accepted connection has been down without coming back
    /// (ZeroMQ reconnects within a fraction of a second to a live peer; a
    /// peer that closed it and stays unreachable has died).
    pub fn down_for(&mut self) -> Option<Duration> {
        self.update();
        self.link.down_since.map(|t| t.elapsed())
    }
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

/// Messages that may wait per connection before ZeroMQ stops reading it.
pub const RECEIVE_QUEUE: i32 = 64;

/// How long a new connection has to finish ZeroMQ's handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

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
            self.summarise(who, &mut w);
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

impl Traffic {
    fn summarise(&self, who: &str, w: &mut LogWindow) {
        if w.suppressed > 0 {
            eprintln!("[gradpack {who}] dropped {} more messages in the last second without saying why (at most {DROP_LOG_PER_SECOND} a second are logged)", w.suppressed);
            self.logged.fetch_add(1, Ordering::Relaxed);
            w.suppressed = 0;
        }
    }

    /// Says how many drops went unlogged once their second is over, whether
    /// or not another drop comes (the receive loops call it as they poll).
    pub fn flush_log(&self, who: &str) {
        let mut w = self.window.lock().unwrap_or_else(|p| p.into_inner());
        if w.suppressed > 0 && w.start.is_some_and(|s| s.elapsed() >= Duration::from_secs(1)) {
            self.summarise(who, &mut w);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_is_down_once_every_accepted_connection_ended_whatever_the_order_of_the_events() {
        let t0 = std::time::Instant::now();
        let later = t0 + Duration::from_secs(1);
        // In order: up, down (at t0), back up, down again (from `later`).
        let mut l = LinkState::default();
        assert!(!l.ever_up());
        l.connected();
        assert!(l.ever_up() && l.down_since.is_none());
        l.disconnected(t0);
        assert_eq!(l.down_since, Some(t0));
        l.connected();
        assert_eq!(l.down_since, None);
        l.disconnected(later);
        assert_eq!(l.down_since, Some(later));
        // libzmq's order when the peer fails the handshake at once: DISCONNECTED, then CONNECTED.
        let mut l = LinkState::default();
        l.disconnected(t0);
        assert!(l.ever_up());
        l.connected();
        assert_eq!(l.down_since, Some(t0), "the connection that ended is not up again");
        // A second connection up before the first one's CONNECTED arrives, then that CONNECTED.
        let mut l = LinkState::default();
        l.disconnected(t0);
        l.connected();
        l.connected();
        assert_eq!(l.down_since, None);
        l.disconnected(later);
        assert_eq!(l.down_since, Some(later));
    }

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
        // The summary of the last second comes without another drop.
        t.flush_log("test");
        assert_eq!(t.logged.load(Ordering::Relaxed), logged, "not before its second is over");
        std::thread::sleep(Duration::from_millis(1100));
        t.flush_log("test");
        assert_eq!(t.logged.load(Ordering::Relaxed), logged + 1);
        t.flush_log("test");
        assert_eq!(t.logged.load(Ordering::Relaxed), logged + 1, "said once");
    }
}

pub struct Van {
    ctx: zmq::Context,
    /// DEALER sockets by peer node id; zmq sockets are not Sync, hence the lock.
    senders: Mutex<HashMap<i32, zmq::Socket>>,
    pub traffic: Traffic,
    /// With a job secret: signs what this node sends, checks what it receives.
    auth: Option<Auth>,
    /// The gate of the receiving socket (`gate`).
    gates: Mutex<Vec<Gate>>,
}

/// What came back on a connection this node opened (`Van::answer_from`).
pub enum Answer {
    Notice(String),
    Message(Message, Origin),
    Bad(Error),
}

/// The receiving end, owned by one thread.
pub struct Receiver {
    socket: zmq::Socket,
    /// Where the connections that delivered a valid message are recorded (`gate`).
    proofs: std::sync::Arc<Proofs>,
    /// Routing ids (one per connection, never reused) already recorded there.
    proven: std::cell::RefCell<std::collections::HashSet<Vec<u8>>>,
    /// The connection the last message came from, for `refuse_last`.
    last_peer: std::cell::RefCell<zmq::Message>,
    /// The nonce that signed it, for `reply_last`.
    last_nonce: std::cell::Cell<u64>,
    /// Refusal notices sent this second: (when the second began, how many).
    notices: std::cell::Cell<(std::time::Instant, u32)>,
}

/// Refusal notices a node sends per second.
pub const NOTICES_PER_SECOND: u32 = 10;

/// Routing ids a receiver remembers as proven before it starts over (each
/// forgotten one costs one more record on its next message).
const PROVEN_REMEMBERED: usize = 4096;

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
    /// A transport; with `secret`, every message is authenticated (`auth`).
    /// Without one, the process says once on stderr that anyone who reaches
    /// its ports can join the job.
    pub fn new(secret: Option<Secret>) -> Van {
        let ctx = zmq::Context::new();
        // Two I/O threads: sends to and receives from several peers overlap.
        let _ = ctx.set_io_threads(2);
        if secret.is_none() {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                eprintln!(
                    "[gradpack] warning: GRADPACK_SECRET is not set, so this job's messages are not authenticated: any process that \
                     reaches its ports can join it or change its values. Set GRADPACK_SECRET (or GRADPACK_SECRET_FILE) to the same \
                     value on every node; python -m gradpack.launch makes one per job."
                )
            });
        }
        Van { ctx, senders: Mutex::default(), traffic: Traffic::default(), auth: secret.map(Auth::new), gates: Mutex::default() }
    }

    /// What the node `id` sent back on this node's connection to it, if
    /// anything arrived: a notice (see `NOTICE`), or a message (the
    /// scheduler's challenge to a registering node), verified like any other.
    pub fn answer_from(&self, id: i32) -> Option<Answer> {
        let senders = self.senders.lock().unwrap();
        let frames = senders.get(&id)?.recv_multipart(zmq::DONTWAIT).ok()?;
        drop(senders);
        match &frames[..] {
            [one] => one.strip_prefix(NOTICE).map(|r| Answer::Notice(String::from_utf8_lossy(r).into_owned())),
            [header, payload, rest @ ..] if rest.len() == usize::from(self.auth.is_some()) => {
                let origin = match (&self.auth, rest) {
                    (Some(auth), [tag]) => match auth.verify(header, payload, tag) {
                        Ok(o) => o,
                        Err(e) => return Some(Answer::Bad(e)),
                    },
                    _ => Origin::UNAUTHENTICATED,
                };
                match Meta::decode(header) {
                    Ok(meta) => Some(Answer::Message(Message { meta, data: zmq::Message::from(&payload[..]).into() }, origin)),
                    Err(e) => Some(Answer::Bad(e)),
                }
            }
            _ => Some(Answer::Bad(Error::Transport(format!("malformed message: {} frames on a connection to node {id}", frames.len())))),
        }
    }

    /// The job's authentication, when it has a secret.
    pub fn auth(&self) -> Option<&Auth> {
        self.auth.as_ref()
    }

    /// Whether a message naming `sender` may be believed (always, without a
    /// secret: then anyone can claim anything).
    pub fn check_sender(&self, sender: i32, origin: &Origin) -> Result<()> {
        match &self.auth {
            Some(auth) => auth.check_sender(sender, origin),
            None => Ok(()),
        }
    }

    /// Binds the receiving socket on `host:port` (port 0: any free port) and
    /// returns it with the port actually bound.
    /// ZeroMQ refuses (and disconnects) a frame longer than `max_frame`
    /// before buffering it; at most `RECEIVE_QUEUE` messages wait per
    /// connection (then ZeroMQ stops reading it: the sender waits); a
    /// connection that does not finish ZeroMQ's handshake in
    /// `HANDSHAKE_TIMEOUT` is closed; the gate refuses connections past `caps`,
    /// and shuts down one that delivered no valid message (with a secret:
    /// authenticated) within `grace`.
    pub fn bind(&self, host: &str, port: u16, max_frame: usize, caps: Caps, grace: Duration) -> Result<(Receiver, u16)> {
        let mut gates = self.gates.lock().unwrap();
        if gates.is_empty() {
            gates.push(Gate::start(&self.ctx, caps, grace)?);
        }
        let socket = self.ctx.socket(zmq::ROUTER).map_err(|e| zmq_error("creating a socket", e))?;
        socket.set_zap_domain(gate::DOMAIN).map_err(|e| zmq_error("setting the ZAP domain", e))?;
        socket.set_linger(0).map_err(|e| zmq_error("setting linger", e))?;
        socket.set_rcvhwm(RECEIVE_QUEUE).map_err(|e| zmq_error("setting the receive high-water mark", e))?;
        socket.set_maxmsgsize(max_frame.min(i64::MAX as usize) as i64).map_err(|e| zmq_error("setting the largest message", e))?;
        socket.set_handshake_ivl(HANDSHAKE_TIMEOUT.as_millis() as i32).map_err(|e| zmq_error("setting the handshake timeout", e))?;
        let endpoint = if port == 0 { format!("tcp://{host}:*") } else { format!("tcp://{host}:{port}") };
        socket.bind(&endpoint).map_err(|e| zmq_error(&format!("binding {endpoint}"), e))?;
        let bound = socket
            .get_last_endpoint()
            .map_err(|e| zmq_error("reading the bound endpoint", e))?
            .map_err(|_| Error::Transport("bound endpoint is not UTF-8".into()))?;
        let port = bound.rsplit(':').next().and_then(|p| p.parse::<u16>().ok()).ok_or_else(|| Error::Transport(format!("cannot read the port of {bound}")))?;
        gates[0].guard(port);
        let proofs = gates[0].proofs();
        Ok((Receiver { socket, proofs, proven: Default::default(), last_peer: std::cell::RefCell::new(zmq::Message::new()), last_nonce: Default::default(), notices: std::cell::Cell::new((std::time::Instant::now(), 0)) }, port))
    }

    /// Opens (or replaces) the sending socket to node `id` at `host:port`.
    pub fn connect(&self, id: i32, host: &str, port: u16) -> Result<()> {
        let socket = self.ctx.socket(zmq::DEALER).map_err(|e| zmq_error("creating a socket", e))?;
        self.connect_socket(id, socket, host, port)
    }

    fn connect_socket(&self, id: i32, socket: zmq::Socket, host: &str, port: u16) -> Result<()> {
        // Closing waits up to 2 s for queued messages (a worker's "done", the
        // scheduler's "terminate") to leave, instead of dropping them.
        socket.set_linger(2000).map_err(|e| zmq_error("setting linger", e))?;
        socket.set_sndhwm(0).map_err(|e| zmq_error("setting the send high-water mark", e))?;
        let endpoint = format!("tcp://{host}:{port}");
        socket.connect(&endpoint).map_err(|e| zmq_error(&format!("connecting to {endpoint}"), e))?;
        self.senders.lock().unwrap().insert(id, socket);
        Ok(())
    }

    /// `connect`, watching the connection (a ZeroMQ socket monitor set up
    /// before connecting, so no event is missed): `Watch` then says whether
    /// the peer ever accepted it, refused its handshake, or closed it.
    pub fn connect_watched(&self, id: i32, host: &str, port: u16) -> Result<Watch> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let endpoint = format!("inproc://gradpack-watch-{id}-{}", NEXT.fetch_add(1, Ordering::Relaxed));
        let socket = self.ctx.socket(zmq::DEALER).map_err(|e| zmq_error("creating a socket", e))?;
        let events = (zmq::SocketEvent::CONNECTED as i32) | (zmq::SocketEvent::DISCONNECTED as i32) | (zmq::SocketEvent::HANDSHAKE_FAILED_AUTH as i32);
        socket.monitor(&endpoint, events).map_err(|e| zmq_error("monitoring a connection", e))?;
        let watch = self.ctx.socket(zmq::PAIR).map_err(|e| zmq_error("creating a socket", e))?;
        watch.connect(&endpoint).map_err(|e| zmq_error("monitoring a connection", e))?;
        self.connect_socket(id, socket, host, port)?;
        Ok(Watch { events: watch, link: LinkState::default() })
    }

    /// Sends a message to node `to`; the payload buffer is handed to ZeroMQ without a copy.
    pub fn send(&self, to: i32, msg: Message) -> Result<()> {
        let meta = msg.meta.encode();
        let bytes = (meta.len() + msg.data.len()) as u64;
        let senders = self.senders.lock().unwrap();
        let socket = senders.get(&to).ok_or_else(|| Error::Transport(format!("no connection to node {to}")))?;
        // Signed under the lock, so one peer sees this node's sequence numbers in order.
        let tag = self.auth.as_ref().map(|a| a.sign_digest(to, &meta, msg.data.digest())).transpose()?;
        socket.send(meta, zmq::SNDMORE).map_err(|e| zmq_error(&format!("sending to node {to}"), e))?;
        let last = if tag.is_some() { zmq::SNDMORE } else { 0 };
        socket.send(zmq::Message::from(msg.data), last).map_err(|e| zmq_error(&format!("sending to node {to}"), e))?;
        if let Some(tag) = tag {
            socket.send(tag, 0).map_err(|e| zmq_error(&format!("sending to node {to}"), e))?;
        }
        self.traffic.sent.fetch_add(bytes, Ordering::Relaxed);
        Ok(())
    }
}

impl Receiver {
    /// Waits up to `timeout` for a message. `Ok(None)`: nothing arrived.
    /// `Ok(Some(Err(_)))`: something arrived that is not a valid message (the
    /// caller logs it and goes on). `Err(_)`: the socket itself failed.
    pub fn recv(&self, timeout: Duration, van: &Van) -> Result<Option<Result<(Message, Origin)>>> {
        // A message already queued is taken without a poll (one system call
        // fewer a message, which a flood of garbage would multiply).
        let first = match self.socket.recv_msg(zmq::DONTWAIT) {
            Ok(frame) => Some(frame),
            Err(zmq::Error::EAGAIN) => None,
            Err(e) => return Err(zmq_error("receiving", e)),
        };
        let mut first = match first {
            Some(frame) => Some(frame),
            None => {
                let ready = self.socket.poll(zmq::POLLIN, timeout.as_millis().min(i64::MAX as u128) as i64).map_err(|e| zmq_error("polling", e))?;
                if ready == 0 {
                    return Ok(None);
                }
                None
            }
        };
        // Frames stay in ZeroMQ's buffers: no copy of the payload.
        let mut frames = Vec::with_capacity(4);
        loop {
            let frame = match first.take() {
                Some(frame) => frame,
                None => self.socket.recv_msg(0).map_err(|e| zmq_error("receiving", e))?,
            };
            let more = frame.get_more();
            // A message of more frames than any valid one is read to its end, keeping few.
            if frames.len() < 5 {
                frames.push(frame);
            }
            if !more {
                break;
            }
        }
        van.traffic.received.fetch_add(frames.iter().skip(1).map(|f| f.len() as u64).sum(), Ordering::Relaxed);
        // ROUTER prepends the peer's identity frame; then header, payload and,
        // with a secret, the authentication frame.
        let want = if van.auth.is_some() { 4 } else { 3 };
        if frames.len() != want {
            let why = match (van.auth.is_some(), frames.len()) {
                (false, 4) => "the sender authenticates its messages, but this node has no GRADPACK_SECRET".to_string(),
                (true, 3) => "this job requires authenticated messages (GRADPACK_SECRET), and the sender sent none".to_string(),
                (_, n) => format!("{n} frames, expected {want}"),
            };
            self.notify(&frames[0], &why);
            return Ok(Some(Err(Error::Transport(format!("malformed message: {why}")))));
        }
        let mut origin = Origin::UNAUTHENTICATED;
        if let Some(auth) = &van.auth {
            // Checked before anything of the message is parsed.
            match auth.verify(&frames[1], &frames[2], &frames[3]) {
                Ok(o) => origin = o,
                Err(e) => {
                    self.notify(&frames[0], &e.to_string());
                    return Ok(Some(Err(e)));
                }
            }
            frames.pop();
        }
        let data = frames.pop().unwrap();
        let meta = match Meta::decode(&frames[1]) {
            Ok(m) => m,
            Err(e) => return Ok(Some(Err(e))),
        };
        let (identity, header) = frames.split_at_mut(1);
        self.prove(&identity[0], &mut header[0]);
        self.last_nonce.set(origin.nonce);
        *self.last_peer.borrow_mut() = std::mem::replace(&mut frames[0], zmq::Message::new());
        Ok(Some(Ok((Message { meta, data: data.into() }, origin))))
    }

    /// Records the connection of a valid message (authenticated, with a
    /// secret) as proven, once per connection (by its routing id). The
    /// header frame carries the connection's descriptor (ZeroMQ's `__fd`
    /// property); the routing id frame does not when a poll prefetched the
    /// message.
    fn prove(&self, identity: &[u8], header: &mut zmq::Message) {
        let mut proven = self.proven.borrow_mut();
        if proven.contains(identity) {
            return;
        }
        if let Some(fd) = header.gets("__fd").and_then(|fd| fd.parse::<i32>().ok()) {
            self.proofs.record_fd(fd);
        }
        if proven.len() >= PROVEN_REMEMBERED {
            proven.clear();
        }
        proven.insert(identity.to_vec());
    }

    /// Answers the last message received with `msg`, on the connection it
    /// came from, signed under no job for the process that signed it (the
    /// scheduler's challenge to a registering node).
    pub fn reply_last(&self, van: &Van, msg: Message) -> Result<()> {
        let header = msg.meta.encode();
        let mut frames: Vec<Vec<u8>> = vec![self.last_peer.borrow().to_vec(), header, msg.data.to_vec()];
        if let Some(auth) = &van.auth {
            frames.push(auth.sign_reply(self.last_nonce.get(), &frames[1], &frames[2]));
        }
        self.socket.send_multipart(frames, zmq::DONTWAIT).map_err(|e| zmq_error("answering a registration", e))
    }

    /// Sends `NOTICE` and `why` back on the connection a refused message
    /// came from, at most `NOTICES_PER_SECOND` a second: a node that
    /// registers with another secret learns why at once, and a flood of
    /// garbage costs no answer per message.
    fn notify(&self, identity: &[u8], why: &str) {
        let (start, sent) = self.notices.get();
        let now = std::time::Instant::now();
        let (start, sent) = if now.duration_since(start) >= Duration::from_secs(1) { (now, 0) } else { (start, sent) };
        if sent >= NOTICES_PER_SECOND {
            self.notices.set((start, sent));
            return;
        }
        self.notices.set((start, sent + 1));
        let notice = [NOTICE, why.as_bytes()].concat();
        let _ = self.socket.send_multipart([identity, &notice[..]], zmq::DONTWAIT);
    }

    /// Refuses the last message received with `why`, on the connection it
    /// came from: no socket is opened, whatever address the message claims.
    pub fn refuse_last(&self, why: &str) {
        self.notify(&self.last_peer.borrow(), why);
    }
}
