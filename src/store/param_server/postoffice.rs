//! Membership, a worker's or server's side (ps-lite's Postoffice): its
//! registration with the scheduler (`scheduler`), node ids and ranks, the
//! barrier, heartbeats and failure detection, and the end of the job. Sits
//! on the transport (`van`) and wakes request waiters through the `customer`.
//!
//! Node ids follow ps-lite: the scheduler is 1, server rank r is 8 + 2r,
//! worker rank r is 9 + 2r.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::config::{Config, Role};
use super::customer::{Check, Customer};
use super::auth::{job_from_hex, Origin};
use super::message::{decode_pairs, encode_pairs, Command, Message, Meta, Payload};
use super::van::{local_address_towards, Answer, Receiver, Van};
use crate::error::{Error, Result};

pub const SCHEDULER_ID: i32 = 1;

pub fn server_id(rank: usize) -> i32 {
    8 + 2 * rank as i32
}

pub fn worker_id(rank: usize) -> i32 {
    9 + 2 * rank as i32
}

/// One node of the job as the scheduler announced it.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeInfo {
    pub id: i32,
    pub role: Role,
    pub rank: usize,
    pub host: String,
    pub port: u16,
    /// The nonce its authenticated registration was signed with (0 without a secret).
    pub nonce: u64,
}

impl NodeInfo {
    pub fn describe(&self) -> String {
        format!("{} {} (node {} at {}:{})", self.role.name(), self.rank, self.id, self.host, self.port)
    }
}

/// Handles a data request on a server; returns the messages to send back.
pub type RequestHandler = Box<dyn FnMut(Message) -> Vec<(i32, Message)> + Send>;

/// Makes a server's handler once the node knows who it is, before anything is
/// served: no request is ever answered under an id the node does not have yet.
pub type MakeHandler = Box<dyn FnOnce(&NodeInfo) -> RequestHandler + Send>;

/// Messages that may arrive before this node has the node table, kept for
/// after it; more are dropped (only a flood has more).
const EARLY_LIMIT: usize = 4096;

/// Prints `text` when `PS_VERBOSE` is at least `level`.
pub fn log(config: &Config, who: &str, level: u32, text: &str) {
    if config.verbose >= level {
        eprintln!("[gradpack {who}] {text}");
    }
}

/// A message of `meta` alone (control messages carry no payload).
pub fn message(meta: Meta) -> Message {
    Message { meta, data: Payload::empty() }
}

/// A registered worker or server.
pub struct Postoffice {
    pub config: Config,
    pub van: Arc<Van>,
    pub customer: Arc<Customer>,
    pub me: NodeInfo,
    pub nodes: Vec<NodeInfo>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Postoffice {
    /// Registers this worker or server with the scheduler, waits for the node
    /// table, connects to its peers and starts the receive and heartbeat
    /// threads. Servers pass the handler for data requests.
    pub fn start(config: Config, handler: Option<MakeHandler>) -> Result<Arc<Postoffice>> {
        debug_assert!(config.role != Role::Scheduler);
        let van = Arc::new(Van::new(config.secret.clone()));
        let host = config.node_host.clone().unwrap_or_else(|| local_address_towards(&config.root_uri, config.root_port));
        let caps = super::gate::Caps::for_job(config.num_workers + config.num_servers + 1);
        let (receiver, port) = van.bind(&host, 0, config.max_message_bytes, caps, config.connection_grace)?;
        let mut scheduler_link = van.connect_watched(SCHEDULER_ID, &config.root_uri, config.root_port)?;
        let register = |van: &Van| {
            let mut reg = Meta::new(Command::Register, 0);
            reg.body = encode_pairs([
                ("role", config.role.name()),
                ("host", host.as_str()),
                ("port", port.to_string().as_str()),
                ("job", config.job_fingerprint().as_str()),
            ]);
            van.send(SCHEDULER_ID, message(reg))
        };
        // With a secret, this first registration is signed under no job; the
        // scheduler's challenge names the job, and the node registers again in it.
        register(&van)?;
        let mut joined = van.auth().is_none();
        let who = format!("{} {}:{}", config.role.name(), host, port);
        log(&config, &who, 1, &format!("registering with the scheduler at {}:{}", config.root_uri, config.root_port));

        // A scheduler that never accepts the connection in this long is not
        // running (or died before this node started): see the error below.
        let started = Instant::now();
        let unreachable_after = config.heartbeat_timeout.max(Duration::from_secs(10));
        // Every node must register before the table comes: the job's deadline.
        let deadline = started + config.register_timeout;
        // Handshakes the scheduler's gate refused (its connections were full,
        // maybe of idle outsiders that it closes after their grace), and when
        // this node connects again: ZeroMQ gives a refused connection up.
        let mut refusals: u32 = 0;
        let mut reconnect_at: Option<Instant> = None;
        let mut ever_accepted = false;
        // Peers that got the table first may already send requests: keep them for later.
        let mut early: Vec<(Message, Origin)> = Vec::new();
        let (me, nodes) = loop {
            van.traffic.flush_log(&who);
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                let refused = if refusals > 0 { format!("; the scheduler's connection gate refused this node {refusals} time(s) (it holds too many connections)") } else { String::new() };
                return Err(Error::JobFailed(format!(
                    "the job did not start: no node table from the scheduler at {}:{} within GRADPACK_REGISTER_TIMEOUT={} s (is it running, and did all {} workers and {} servers start?){refused}",
                    config.root_uri,
                    config.root_port,
                    config.register_timeout.as_secs_f64(),
                    config.num_workers,
                    config.num_servers
                )));
            }
            if scheduler_link.refused() && reconnect_at.is_none() {
                // Backoff: 0.2, 0.4, ... up to 3.2 s between attempts.
                refusals += 1;
                let backoff = Duration::from_millis(100) * (1 << refusals.min(5));
                log(&config, &who, 1, &format!("the scheduler's gate refused the connection (attempt {refusals}); connecting again in {backoff:?}"));
                reconnect_at = Some(Instant::now() + backoff);
            }
            if reconnect_at.is_some_and(|at| Instant::now() >= at) {
                reconnect_at = None;
                ever_accepted = true;
                scheduler_link = van.connect_watched(SCHEDULER_ID, &config.root_uri, config.root_port)?;
                register(&van)?;
                continue;
            }
            ever_accepted |= scheduler_link.ever_up();
            if !ever_accepted && started.elapsed() > unreachable_after {
                return Err(Error::JobFailed(format!(
                    "nothing accepted a connection at the scheduler's address {}:{} for {:?}: the scheduler is not \
                     running, or it died. Under MXNet's tools/launch.py, a script that imports mxnet before \
                     gradpack.mxnet gives the scheduler role to MXNet's own ps-lite, which aborts when a gradpack \
                     worker registers: set GRADPACK_SERVE_ROLES=1 in the launcher's environment, or import gradpack.mxnet \
                     before mxnet (either way gradpack serves the scheduler and server roles), or start the job with \
                     python -m gradpack.launch",
                    config.root_uri, config.root_port, unreachable_after
                )));
            }
            if reconnect_at.is_none() && scheduler_link.down_for().is_some_and(|d| d > Duration::from_secs(3)) {
                return Err(Error::JobFailed(format!(
                    "the scheduler at {}:{} closed the connection when this {} registered, without answering, and stays \
                     unreachable. A gradpack scheduler answers or refuses with a reason, so either it died, or it is MXNet's own ps-lite, which \
                     aborts on gradpack's messages (\"failed to parse string into protobuf\"). Every process of the job must \
                     run gradpack: under MXNet's tools/launch.py, set GRADPACK_SERVE_ROLES=1 in the launcher's environment, or \
                     import gradpack.mxnet before mxnet (either way gradpack serves the scheduler and server roles), or start \
                     the job with python -m gradpack.launch",
                    config.root_uri,
                    config.root_port,
                    config.role.name()
                )));
            }
            match van.answer_from(SCHEDULER_ID) {
                Some(Answer::Notice(why)) => {
                    return Err(Error::JobFailed(if why.starts_with("the scheduler refused") {
                        format!("{why} (the scheduler at {}:{})", config.root_uri, config.root_port)
                    } else {
                        format!(
                            "the scheduler at {}:{} refused this {}'s messages: {why}. Every node of a job needs the same GRADPACK_SECRET (or GRADPACK_SECRET_FILE)",
                            config.root_uri, config.root_port, config.role.name()
                        )
                    }));
                }
                Some(Answer::Message(msg, origin)) if msg.meta.command == Command::Challenge && msg.meta.sender == SCHEDULER_ID && !joined => {
                    let job = decode_pairs(&msg.meta.body).ok().and_then(|p| p.into_iter().find(|(k, _)| k == "job")).and_then(|(_, v)| job_from_hex(&v));
                    match (job, van.auth()) {
                        (Some(job), Some(auth)) => {
                            auth.join(job, SCHEDULER_ID, origin.nonce);
                            joined = true;
                            register(&van)?;
                        }
                        _ => van.traffic.drop_message(&who, format_args!("a challenge without a job id")),
                    }
                }
                Some(Answer::Message(msg, _)) => van.traffic.drop_message(&who, format_args!("an unexpected {:?} on the connection to the scheduler", msg.meta.command)),
                Some(Answer::Bad(e)) => van.traffic.drop_message(&who, format_args!("a message on the connection to the scheduler: {e}")),
                None => {}
            }
            match receiver.recv(remaining.min(Duration::from_millis(50)), &van)? {
                Some(Ok((msg, origin))) if matches!(msg.meta.command, Command::AddNodes | Command::Refused) => {
                    if let Err(e) = van.check_sender(SCHEDULER_ID, &origin).and(if msg.meta.sender == SCHEDULER_ID { Ok(()) } else { Err(Error::Transport(format!("sent by node {}", msg.meta.sender))) }) {
                        van.traffic.drop_message(&who, format_args!("a {:?} not from the scheduler: {e}", msg.meta.command));
                        continue;
                    }
                    if msg.meta.command == Command::Refused {
                        return Err(Error::JobFailed(format!("the scheduler refused this {}: {}", config.role.name(), msg.meta.body)));
                    }
                    let (me, nodes) = parse_table(&msg.meta.body)?;
                    if van.auth().is_some_and(|a| a.nonce() != me.nonce) {
                        return Err(Error::JobFailed(format!("the scheduler's node table names another process as this {} (node {})", config.role.name(), me.id)));
                    }
                    break (me, nodes);
                }
                Some(Ok(early_msg)) if early.len() < EARLY_LIMIT => early.push(early_msg),
                Some(Ok((msg, _))) => van.traffic.drop_message(&who, format_args!("a {:?} from node {} before this node joined ({EARLY_LIMIT} are kept)", msg.meta.command, msg.meta.sender)),
                Some(Err(e)) => van.traffic.drop_message(&who, format_args!("a message: {e}")),
                None => {}
            }
        };
        if let Some(auth) = van.auth() {
            for n in &nodes {
                auth.bind(n.id, n.nonce);
            }
        }
        for n in &nodes {
            if n.id != me.id && n.role != Role::Scheduler && n.role != me.role {
                van.connect(n.id, &n.host, n.port)?;
                // The first message on the connection, so that the peer's gate
                // counts it as proven however long it then stays idle.
                van.send(n.id, message(Meta::new(Command::Hello, me.id)))?;
            }
        }
        let who = format!("{} {}", me.role.name(), me.rank);
        log(&config, &who, 1, &format!("joined as node {} of {} nodes", me.id, nodes.len()));

        let post = Arc::new(Postoffice { config, van, customer: Arc::new(Customer::default()), me, nodes, threads: Mutex::default() });
        let last_contact = Arc::new(Mutex::new(Instant::now()));

        // Data requests are served on a thread of their own (ps-lite's
        // Customer thread), so that control messages (heartbeat acks,
        // failure notices, terminate) are never queued behind data work.
        let mut threads = Vec::new();
        let data = match handler {
            None => None,
            Some(make) => {
                let mut h = make(&post.me);
                let (tx, rx) = std::sync::mpsc::channel::<Message>();
                let p = post.clone();
                threads.push(
                    std::thread::Builder::new()
                        .name("gradpack-serve".into())
                        .spawn(move || {
                            for msg in rx {
                                p.serve(&mut h, msg);
                            }
                        })
                        .map_err(|e| Error::Transport(format!("starting the serving thread: {e}")))?,
                );
                Some(tx)
            }
        };
        let p = post.clone();
        let contact = last_contact.clone();
        let receive = std::thread::Builder::new()
            .name("gradpack-receive".into())
            .spawn(move || p.receive_loop(receiver, early, data, &contact))
            .map_err(|e| Error::Transport(format!("starting the receive thread: {e}")))?;
        let p = post.clone();
        let heartbeat = std::thread::Builder::new()
            .name("gradpack-heartbeat".into())
            .spawn(move || p.heartbeat_loop(&last_contact))
            .map_err(|e| Error::Transport(format!("starting the heartbeat thread: {e}")))?;
        threads.extend([receive, heartbeat]);
        post.threads.lock().unwrap().extend(threads);
        Ok(post)
    }

    /// Messages this node received and dropped (each also logged, at most
    /// 10 a second).
    pub fn dropped(&self) -> u64 {
        self.van.traffic.dropped.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn who(&self) -> String {
        format!("{} {}", self.me.role.name(), self.me.rank)
    }

    /// Runs the handler on one data request and sends its replies.
    fn serve(&self, handler: &mut RequestHandler, msg: Message) {
        for (to, reply) in handler(msg) {
            let refusal = (reply.meta.status != 0).then(|| reply.meta.body.clone()).unwrap_or_default();
            if let Err(e) = self.van.send(to, reply) {
                self.van.traffic.drop_message(&self.who(), format_args!("a request: cannot answer node {to} ({refusal}): {e}"));
            }
        }
    }

    /// Whether `msg` may come from its sender: signed by the process that
    /// registered under its id, which has the role that sends such a command.
    fn admit(&self, msg: &Message, origin: &Origin) -> std::result::Result<(), String> {
        let sender = msg.meta.sender;
        self.van.check_sender(sender, origin).map_err(|e| e.to_string())?;
        let role = self.nodes.iter().find(|n| n.id == sender).map(|n| n.role);
        let may = match msg.meta.command {
            Command::HeartbeatAck | Command::BarrierDone | Command::NodeFailed | Command::Terminate => role == Some(Role::Scheduler),
            Command::Hello => matches!((role, self.me.role), (Some(Role::Worker), Role::Server) | (Some(Role::Server), Role::Worker)),
            Command::Response => role == Some(Role::Server) && self.me.role == Role::Worker,
            Command::SetCompress | Command::SetOptimizer | Command::SetScaling | Command::Init | Command::Push | Command::Pull | Command::WorkerDone | Command::Barrier | Command::Heartbeat => {
                role == Some(Role::Worker) && self.me.role == Role::Server
            }
            _ => false,
        };
        match (may, role) {
            (true, _) => Ok(()),
            (false, Some(role)) => Err(format!("a {:?} from node {sender}, a {}: a {} does not take it from one", msg.meta.command, role.name(), self.me.role.name())),
            (false, None) => Err(format!("a {:?} from node {sender}, which is not in this job", msg.meta.command)),
        }
    }

    fn receive_loop(&self, receiver: Receiver, early: Vec<(Message, Origin)>, data: Option<std::sync::mpsc::Sender<Message>>, last_contact: &Mutex<Instant>) {
        let mut early = early.into_iter();
        while !self.customer.is_over() {
            self.van.traffic.flush_log(&self.who());
            let next = match early.next() {
                Some(msg) => Ok(Some(Ok(msg))),
                None => receiver.recv(Duration::from_millis(100), &self.van),
            };
            let msg = match next {
                Ok(None) => continue,
                Ok(Some(Ok((msg, origin)))) => {
                    if let Err(why) = self.admit(&msg, &origin) {
                        self.van.traffic.drop_message(&self.who(), format_args!("{why}"));
                        continue;
                    }
                    msg
                }
                Ok(Some(Err(e))) => {
                    self.van.traffic.drop_message(&self.who(), format_args!("a message: {e}"));
                    continue;
                }
                Err(e) => {
                    self.customer.fail(format!("{} cannot receive: {e}", self.who()));
                    return;
                }
            };
            log(&self.config, &self.who(), 2, &format!("received {:?} from node {}", msg.meta.command, msg.meta.sender));
            if msg.meta.sender == SCHEDULER_ID {
                *last_contact.lock().unwrap() = Instant::now();
            }
            match msg.meta.command {
                Command::HeartbeatAck | Command::Hello => {}
                Command::BarrierDone => {
                    // `request_id`: the barrier's number; `status`: non-zero when it failed.
                    if !self.customer.release_barrier(msg.meta.request_id, (msg.meta.status != 0).then(|| msg.meta.body.clone())) {
                        self.van.traffic.drop_message(&self.who(), format_args!("the release of barrier {}, which this worker is not in", msg.meta.request_id));
                    }
                }
                Command::NodeFailed => self.customer.fail(msg.meta.body.clone()),
                Command::Terminate => self.customer.terminate(),
                Command::Response => {
                    if let Err(why) = self.customer.deliver(msg) {
                        self.van.traffic.drop_message(&self.who(), format_args!("{why}"));
                    }
                }
                Command::SetCompress | Command::SetOptimizer | Command::Init | Command::Push | Command::Pull | Command::WorkerDone | Command::Barrier | Command::Heartbeat => match &data {
                    Some(tx) => {
                        if tx.send(msg).is_err() {
                            self.customer.fail(format!("{} can no longer serve requests (its serving thread ended)", self.who()));
                            return;
                        }
                    }
                    None => self.van.traffic.drop_message(&self.who(), format_args!("a {:?} request: only servers answer it", msg.meta.command)),
                },
                other => self.van.traffic.drop_message(&self.who(), format_args!("an unexpected {other:?} message from node {}", msg.meta.sender)),
            }
        }
    }

    fn heartbeat_loop(&self, last_contact: &Mutex<Instant>) {
        let step = Duration::from_millis(50).min(self.config.heartbeat_interval);
        let mut next = Instant::now();
        while !self.customer.is_over() {
            if Instant::now() >= next {
                let _ = self.van.send(SCHEDULER_ID, message(Meta::new(Command::Heartbeat, self.me.id)));
                next = Instant::now() + self.config.heartbeat_interval;
            }
            let silent = last_contact.lock().unwrap().elapsed();
            if silent > self.config.heartbeat_timeout {
                self.customer.fail(format!(
                    "the scheduler at {}:{} has been silent for {:.1} s (PS_HEARTBEAT_TIMEOUT={} s)",
                    self.config.root_uri,
                    self.config.root_port,
                    silent.as_secs_f64(),
                    self.config.heartbeat_timeout.as_secs_f64()
                ));
                return;
            }
            std::thread::sleep(step);
        }
    }

    pub fn servers(&self) -> Vec<&NodeInfo> {
        let mut s: Vec<&NodeInfo> = self.nodes.iter().filter(|n| n.role == Role::Server).collect();
        s.sort_by_key(|n| n.rank);
        s
    }

    /// Sends one request per `(node, meta, payload)` under one request id and
    /// waits for every response.
    pub fn request(&self, parts: Vec<(i32, Meta, Vec<u8>)>) -> Result<Vec<Message>> {
        let id = self.send_request(parts, None)?;
        self.wait(id)
    }

    /// As `request`, each response checked by `check` as it arrives (`Check`).
    pub fn request_checked(&self, parts: Vec<(i32, Meta, Vec<u8>)>, check: Check) -> Result<Vec<Message>> {
        let id = self.send_request(parts, Some(check))?;
        self.wait(id)
    }

    /// As `request_checked`, without waiting: the request's id, for `wait`
    /// (a push whose round ends when the other workers join it).
    pub fn request_later(&self, parts: Vec<(i32, Meta, Vec<u8>)>, check: Check) -> Result<u64> {
        self.send_request(parts, Some(check))
    }

    /// Waits for the responses of request `id` (started with `customer.start`),
    /// probing the nodes that have not answered after each heartbeat timeout.
    pub fn wait(&self, id: u64) -> Result<Vec<Message>> {
        self.customer.wait(id, self.config.heartbeat_timeout, &|id, nodes| self.probe(id, nodes))
    }

    /// Asks each of `nodes` whether it still holds request `id` (a
    /// `Heartbeat` that names it). An error when one does not, or does not
    /// answer within the heartbeat timeout: the request was lost.
    fn probe(&self, id: u64, nodes: &[i32]) -> Result<()> {
        let parts = nodes
            .iter()
            .map(|&n| {
                let mut m = Meta::new(Command::Heartbeat, 0);
                m.body = encode_pairs([("request", id.to_string().as_str())]);
                (n, m, Vec::new())
            })
            .collect();
        let probe_id = self.send_request(parts, None)?;
        let timeout = self.config.heartbeat_timeout;
        let silent = |_: u64, nodes: &[i32]| -> Result<()> {
            Err(Error::JobFailed(format!("node(s) {nodes:?} did not answer whether they hold request {id} within PS_HEARTBEAT_TIMEOUT={} s", timeout.as_secs_f64())))
        };
        self.customer.wait(probe_id, timeout, &silent).map(|_| ())
    }

    /// As `wait`, but error responses come back with the others: the
    /// caller learns which nodes refused (a scheme round over several servers).
    pub fn wait_all(&self, id: u64) -> Result<Vec<Message>> {
        self.customer.wait_all(id, self.config.heartbeat_timeout, &|id, nodes| self.probe(id, nodes))
    }

    /// Sends the parts of one request; its id.
    fn send_request(&self, parts: Vec<(i32, Meta, Vec<u8>)>, check: Option<Check>) -> Result<u64> {
        if let Some(reason) = self.customer.failure() {
            return Err(Error::JobFailed(reason));
        }
        let id = self.customer.start_checked(parts.iter().map(|p| p.0).collect(), check);
        for (to, mut meta, data) in parts {
            meta.sender = self.me.id;
            meta.request_id = id;
            // In a request, `status` says how many barriers the sender has passed.
            meta.status = self.customer.barriers_done().min(i32::MAX as u64) as i32;
            if let Err(e) = self.van.send(to, Message { meta, data: data.into() }) {
                self.customer.cancel(id);
                return Err(e);
            }
        }
        Ok(id)
    }

    /// Waits until every worker reached the barrier. `state` says what this
    /// worker has done (`name=value` lines: its store, compression, pushes,
    /// the key it just initialized): the scheduler fails the barrier on every
    /// worker, naming the line, when the workers' states differ, and when a
    /// worker ends while others wait.
    pub fn barrier(&self, state: &str) -> Result<()> {
        if let Some(reason) = self.customer.failure() {
            return Err(Error::JobFailed(reason));
        }
        let seen = self.customer.barriers_done();
        let mut m = Meta::new(Command::Barrier, self.me.id);
        // As in a request, `status` counts the barriers passed: the scheduler
        // knows which barrier this is, and a repeat of it.
        m.status = seen.min(i32::MAX as u64) as i32;
        m.body = state.chars().take(4000).collect();
        self.van.send(SCHEDULER_ID, message(m.clone()))?;
        let again = || {
            let _ = self.van.send(SCHEDULER_ID, message(m.clone()));
        };
        self.customer.wait_barrier(seen, self.config.heartbeat_timeout, &again)
    }

    /// Tells every server, then the scheduler, that this worker is finished:
    /// servers fail the sync rounds it will never join instead of waiting.
    pub fn worker_done(&self) {
        for s in self.servers() {
            let _ = self.van.send(s.id, message(Meta::new(Command::WorkerDone, self.me.id)));
        }
        let _ = self.van.send(SCHEDULER_ID, message(Meta::new(Command::WorkerDone, self.me.id)));
    }

    pub fn bytes_sent(&self) -> u64 {
        self.van.traffic.sent.load(Ordering::Relaxed)
    }

    pub fn bytes_received(&self) -> u64 {
        self.van.traffic.received.load(Ordering::Relaxed)
    }

    /// Stops the threads (after the job ended or failed).
    pub fn stop(&self) {
        self.customer.terminate();
        for t in self.threads.lock().unwrap().drain(..) {
            let _ = t.join();
        }
    }
}

fn parse_table(body: &str) -> Result<(NodeInfo, Vec<NodeInfo>)> {
    let bad = |what: &str| Error::Transport(format!("malformed node table: {what}"));
    let mut me = None;
    let mut nodes = Vec::new();
    for (k, v) in decode_pairs(body)? {
        match k.as_str() {
            "me" => me = Some(v.parse::<i32>().map_err(|_| bad("me"))?),
            "node" => {
                let f: Vec<&str> = v.split_whitespace().collect();
                if f.len() != 6 {
                    return Err(bad(&v));
                }
                nodes.push(NodeInfo {
                    id: f[0].parse().map_err(|_| bad("id"))?,
                    role: Role::parse(f[1])?,
                    rank: f[2].parse().map_err(|_| bad("rank"))?,
                    host: f[3].to_string(),
                    port: f[4].parse().map_err(|_| bad("port"))?,
                    nonce: u64::from_str_radix(f[5], 16).map_err(|_| bad("nonce"))?,
                });
            }
            _ => return Err(bad(&k)),
        }
    }
    let me = me.ok_or_else(|| bad("no 'me' line"))?;
    let info = nodes.iter().find(|n| n.id == me).cloned().ok_or_else(|| bad("'me' is not in the table"))?;
    Ok((info, nodes))
}
