//! The scheduler (ps-lite's scheduler role of the Postoffice): admits the
//! job's registrations, hands out ranks and the node table, releases
//! barriers once the workers agree, watches heartbeats, and ends the job
//! when every worker is done, a node fails, or the job does not form
//! within `GRADPACK_REGISTER_TIMEOUT`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::auth::job_to_hex;
use super::config::{Config, Role};
use super::message::{decode_pairs, encode_pairs, Command, Message, Meta};
use super::postoffice::{log, message, server_id, worker_id, NodeInfo, SCHEDULER_ID};
use super::van::{Receiver, Van};
use crate::error::{Error, Result};

/// Runs the scheduler until every worker is done (Ok) or a node fails (Err).
pub fn run_scheduler(config: Config) -> Result<()> {
    Scheduler::bind(config)?.run()
}

/// A scheduler that holds its port and its job id, before it runs.
pub struct Scheduler {
    config: Config,
    /// Its transport (tests sign with it as the scheduler does).
    pub van: Arc<Van>,
    receiver: Receiver,
}

impl Scheduler {
    /// Binds the scheduler's port and, with a secret, makes the job's id.
    pub fn bind(config: Config) -> Result<Scheduler> {
        let van = Arc::new(Van::new(config.secret.clone()));
        let control = super::config::CONTROL_MESSAGE_BYTES;
        let caps = super::gate::Caps::for_job(config.num_workers + config.num_servers + 1);
        let grace = config.connection_grace;
        let (receiver, _) = van.bind(&config.root_uri, config.root_port, control, caps, grace).or_else(|_| van.bind("0.0.0.0", config.root_port, control, caps, grace))?;
        if let Some(auth) = van.auth() {
            auth.start_job();
        }
        Ok(Scheduler { config, van, receiver })
    }

    /// Runs until every worker is done (Ok) or a node fails (Err).
    pub fn run(self) -> Result<()> {
        let Scheduler { config, van, receiver } = self;
        schedule(config, &van, receiver)
    }
}

fn schedule(config: Config, van: &Van, receiver: Receiver) -> Result<()> {
    let who = "scheduler".to_string();
    // The job's id: nodes learn it from the challenge to their first registration.
    let job = van.auth().map(|a| a.job());
    log(&config, &who, 1, &format!("waiting for {} workers and {} servers on port {}", config.num_workers, config.num_servers, config.root_port));
    let expected = config.num_workers + config.num_servers;
    let mut registered: Vec<NodeInfo> = Vec::new();
    let mut table: Option<Vec<NodeInfo>> = None;
    let mut last_seen: HashMap<i32, Instant> = HashMap::new();
    // Workers in the barrier, with the state each reported; the barriers
    // completed, and how the last one ended (for a worker that asks again).
    let mut at_barrier: Vec<(i32, String)> = Vec::new();
    let mut released: u64 = 0;
    let mut last_release: Option<String> = None;
    let mut done: Vec<i32> = Vec::new();
    let forming_since = Instant::now();
    loop {
        van.traffic.flush_log("scheduler");
        if table.is_none() && forming_since.elapsed() >= config.register_timeout {
            return Err(never_formed(&config, van, &registered));
        }
        let polled = receiver.recv(Duration::from_millis(50), van)?;
        if let Some(nodes) = &table {
            // Failure detection: every node must be heard from within the timeout.
            for n in nodes.iter().filter(|n| n.role != Role::Scheduler) {
                let silent = last_seen.get(&n.id).map(|t| t.elapsed()).unwrap_or_default();
                if silent > config.heartbeat_timeout && !done.contains(&n.id) {
                    let reason = format!(
                        "{} sent no heartbeat for {:.1} s (PS_HEARTBEAT_TIMEOUT={} s); the job stops",
                        n.describe(),
                        silent.as_secs_f64(),
                        config.heartbeat_timeout.as_secs_f64()
                    );
                    eprintln!("[gradpack scheduler] {reason}");
                    for other in nodes.iter().filter(|o| o.id != n.id && o.role != Role::Scheduler) {
                        let mut m = Meta::new(Command::NodeFailed, SCHEDULER_ID);
                        m.body = reason.clone();
                        let _ = van.send(other.id, message(m));
                    }
                    return Err(Error::JobFailed(reason));
                }
            }
        }
        let msg = match polled {
            None => continue,
            Some(Err(e)) => {
                van.traffic.drop_message("scheduler", format_args!("a message: {e}"));
                continue;
            }
            Some(Ok(m)) => m,
        };
        let (msg, origin) = msg;
        log(&config, &who, 2, &format!("received {:?} from node {}", msg.meta.command, msg.meta.sender));
        // Only registrations come from no node; everything else from a node
        // of the table, signed by the process that registered as it.
        let sender = table.as_ref().and_then(|t| t.iter().find(|n| n.id == msg.meta.sender && n.role != Role::Scheduler)).map(|n| n.role);
        if msg.meta.command != Command::Register {
            let allowed = match msg.meta.command {
                Command::Heartbeat | Command::NodeFailed => sender.is_some(),
                Command::Barrier | Command::WorkerDone => sender == Some(Role::Worker),
                _ => false,
            };
            if let Err(why) = van.check_sender(msg.meta.sender, &origin).map_err(|e| e.to_string()).and(if allowed {
                Ok(())
            } else {
                Err(format!("a {:?} from node {}, which {}", msg.meta.command, msg.meta.sender, if sender.is_some() { "does not send it" } else { "is not in this job" }))
            }) {
                van.traffic.drop_message("scheduler", format_args!("{why}"));
                continue;
            }
            last_seen.insert(msg.meta.sender, Instant::now());
        }
        match msg.meta.command {
            Command::Register if msg.meta.sender != 0 => van.traffic.drop_message("scheduler", format_args!("a registration that claims to come from node {}", msg.meta.sender)),
            Command::Register if !origin.in_job => {
                // The first registration of a node, signed under no job: the
                // challenge tells it the job, under which it registers again.
                let mut m = Meta::new(Command::Challenge, SCHEDULER_ID);
                m.body = encode_pairs([("job", job_to_hex(&job.unwrap_or_default()).as_str())]);
                if let Err(e) = receiver.reply_last(van, message(m)) {
                    van.traffic.drop_message("scheduler", format_args!("a registration: cannot answer it: {e}"));
                }
            }
            Command::Register if registered.iter().any(|n| n.nonce == origin.nonce && origin.nonce != 0) => {
                van.traffic.drop_message("scheduler", format_args!("a second registration of one process"));
            }
            Command::Register => {
                let pairs: HashMap<String, String> = match decode_pairs(&msg.meta.body) {
                    Ok(p) => p.into_iter().collect(),
                    Err(e) => {
                        van.traffic.drop_message("scheduler", format_args!("a registration: {e}"));
                        continue;
                    }
                };
                let (Some(role), Some(host), Some(port)) = (pairs.get("role"), pairs.get("host"), pairs.get("port").and_then(|p| p.parse::<u16>().ok())) else {
                    van.traffic.drop_message("scheduler", format_args!("a registration without role, host or port"));
                    continue;
                };
                // A refusal goes back on the connection the registration came
                // from: the scheduler opens no socket for it, so neither a bad
                // address nor a flood of refusals can end it or pile up.
                let refuse = |reason: String| -> Result<()> {
                    van.traffic.drop_message("scheduler", format_args!("a registration of {role} at {:?}:{port}: {reason}", host.escape_debug().to_string()));
                    receiver.refuse_last(&format!("the scheduler refused this {role}: {reason}"));
                    Ok(())
                };
                if !valid_host(host) || port == 0 {
                    refuse(format!("its address {:?} port {port} is not a host name or address to reach it at", host.escape_debug().to_string()))?;
                    continue;
                }
                let job = pairs.get("job").cloned().unwrap_or_default();
                if job != config.job_fingerprint() {
                    refuse(format!("its job configuration ({job}) differs from the scheduler's ({})", config.job_fingerprint()))?;
                    continue;
                }
                let role = match Role::parse(role) {
                    Ok(r) if r != Role::Scheduler => r,
                    _ => {
                        refuse(format!("role '{role}' cannot join"))?;
                        continue;
                    }
                };
                let limit = if role == Role::Worker { config.num_workers } else { config.num_servers };
                if table.is_some() || registered.iter().filter(|n| n.role == role).count() >= limit {
                    refuse(format!("the job already has its {limit} {}s", role.name()))?;
                    continue;
                }
                let rank = registered.iter().filter(|n| n.role == role).count();
                let id = if role == Role::Worker { worker_id(rank) } else { server_id(rank) };
                registered.push(NodeInfo { id, role, rank, host: host.clone(), port, nonce: origin.nonce });
                if let Some(auth) = van.auth() {
                    auth.bind(id, origin.nonce);
                }
                log(&config, &who, 1, &format!("{} registered ({}/{expected})", registered.last().unwrap().describe(), registered.len()));
                if registered.len() == expected {
                    let mut nodes = registered.clone();
                    let nonce = van.auth().map_or(0, |a| a.nonce());
                    nodes.push(NodeInfo { id: SCHEDULER_ID, role: Role::Scheduler, rank: 0, host: config.root_uri.clone(), port: config.root_port, nonce });
                    let lines: String = nodes.iter().map(|n| format!("node={} {} {} {} {} {:x}\n", n.id, n.role.name(), n.rank, n.host, n.port, n.nonce)).collect();
                    for n in &registered {
                        van.connect(n.id, &n.host, n.port)?;
                        let mut m = Meta::new(Command::AddNodes, SCHEDULER_ID);
                        m.body = format!("me={}\n{lines}", n.id);
                        van.send(n.id, message(m))?;
                        last_seen.insert(n.id, Instant::now());
                    }
                    log(&config, &who, 1, "all nodes registered; the job starts");
                    table = Some(nodes);
                }
            }
            Command::Heartbeat => {
                if table.is_some() {
                    let _ = van.send(msg.meta.sender, message(Meta::new(Command::HeartbeatAck, SCHEDULER_ID)));
                }
            }
            Command::Barrier => {
                let passed = msg.meta.status.max(0) as u64;
                if passed + 1 == released {
                    // It asks again after the release: that release was lost.
                    let _ = van.send(msg.meta.sender, barrier_done(released, last_release.as_deref()));
                    continue;
                }
                if passed != released {
                    van.traffic.drop_message("scheduler", format_args!("a Barrier from node {} that has passed {passed} barriers, of {released}", msg.meta.sender));
                    continue;
                }
                if !at_barrier.iter().any(|(id, _)| *id == msg.meta.sender) {
                    at_barrier.push((msg.meta.sender, msg.meta.body.clone()));
                }
                let nodes = table.as_deref().unwrap_or_default();
                let failure = if let Some(gone) = done.iter().find(|d| !at_barrier.iter().any(|(id, _)| id == *d)) {
                    Some(closed_in_barrier(nodes, *gone))
                } else if at_barrier.len() == config.num_workers {
                    disagreement(nodes, &at_barrier)
                } else {
                    continue;
                };
                released += 1;
                last_release = failure;
                release_barrier(van, &mut at_barrier, released, last_release.as_deref());
            }
            Command::NodeFailed => {
                // A node reports that it can no longer serve: the job ends, everywhere, with its reason.
                let nodes = table.as_ref().unwrap();
                let who = nodes.iter().find(|n| n.id == msg.meta.sender).map(|n| n.describe()).unwrap_or_default();
                let reason = format!("{who} stopped: {}", msg.meta.body.chars().take(1000).collect::<String>());
                eprintln!("[gradpack scheduler] {reason}; the job stops");
                for other in nodes.iter().filter(|o| o.role != Role::Scheduler) {
                    let mut m = Meta::new(Command::NodeFailed, SCHEDULER_ID);
                    m.body = reason.clone();
                    let _ = van.send(other.id, message(m));
                }
                return Err(Error::JobFailed(reason));
            }
            Command::WorkerDone => {
                if !done.contains(&msg.meta.sender) {
                    done.push(msg.meta.sender);
                }
                // Workers waiting in a barrier this one never reached: it will not come.
                if !at_barrier.is_empty() && !at_barrier.iter().any(|(id, _)| *id == msg.meta.sender) {
                    released += 1;
                    last_release = Some(closed_in_barrier(table.as_deref().unwrap_or_default(), msg.meta.sender));
                    release_barrier(van, &mut at_barrier, released, last_release.as_deref());
                }
                if done.len() == config.num_workers {
                    if let Some(nodes) = &table {
                        for n in nodes.iter().filter(|n| n.role != Role::Scheduler) {
                            let _ = van.send(n.id, message(Meta::new(Command::Terminate, SCHEDULER_ID)));
                        }
                    }
                    log(&config, &who, 1, "every worker is done; the job ends");
                    return Ok(());
                }
            }
            other => van.traffic.drop_message("scheduler", format_args!("an unexpected {other:?} message from node {}", msg.meta.sender)),
        }
    }
}

/// The job did not form within `GRADPACK_REGISTER_TIMEOUT`: the error that
/// names the nodes that never registered, also sent to those that did (as
/// a refusal, which ends their wait for the node table).
fn never_formed(config: &Config, van: &Van, registered: &[NodeInfo]) -> Error {
    let mut missing = Vec::new();
    for (role, count) in [(Role::Server, config.num_servers), (Role::Worker, config.num_workers)] {
        let came = registered.iter().filter(|n| n.role == role).count();
        missing.extend((came..count).map(|rank| format!("{} {rank}", role.name())));
    }
    let came: Vec<String> = registered.iter().map(NodeInfo::describe).collect();
    let reason = format!(
        "the job did not start: {} of its {} workers and servers never registered with the scheduler within GRADPACK_REGISTER_TIMEOUT={} s ({}); registered: {}",
        missing.len(),
        config.num_workers + config.num_servers,
        config.register_timeout.as_secs_f64(),
        missing.join(", "),
        if came.is_empty() { "none".to_string() } else { came.join(", ") }
    );
    eprintln!("[gradpack scheduler] {reason}; the scheduler exits");
    for n in registered {
        let mut m = Meta::new(Command::Refused, SCHEDULER_ID);
        m.body = reason.clone();
        if let Err(e) = van.connect(n.id, &n.host, n.port).and_then(|()| van.send(n.id, message(m))) {
            van.traffic.drop_message("scheduler", format_args!("cannot tell {} that the job did not start: {e}", n.describe()));
        }
    }
    Error::JobFailed(reason)
}

/// The release of barrier `number`: Ok, or failed for `failure`.
fn barrier_done(number: u64, failure: Option<&str>) -> Message {
    let mut m = Meta::new(Command::BarrierDone, SCHEDULER_ID);
    m.request_id = number;
    if let Some(why) = failure {
        (m.status, m.body) = (1, why.to_string());
    }
    message(m)
}

/// Releases every worker in the barrier, each with the same result.
fn release_barrier(van: &Van, at_barrier: &mut Vec<(i32, String)>, number: u64, failure: Option<&str>) {
    if let Some(why) = failure {
        eprintln!("[gradpack scheduler] barrier {number} failed: {why}");
    }
    for (id, _) in at_barrier.drain(..) {
        let _ = van.send(id, barrier_done(number, failure));
    }
}

fn closed_in_barrier(nodes: &[NodeInfo], gone: i32) -> String {
    format!("{} closed its store while other workers wait in a barrier it will never reach", describe(nodes, gone))
}

fn describe(nodes: &[NodeInfo], id: i32) -> String {
    nodes.iter().find(|n| n.id == id).map_or_else(|| format!("node {id}"), |n| n.describe())
}

/// The first line of the workers' barrier states that differs, said with
/// each worker's value; None when they all agree.
fn disagreement(nodes: &[NodeInfo], at_barrier: &[(i32, String)]) -> Option<String> {
    let lines = |s: &str| s.lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>();
    let states: Vec<(i32, Vec<(String, String)>)> = at_barrier.iter().map(|(id, s)| (*id, lines(s))).collect();
    let mut names: Vec<&String> = states.iter().flat_map(|(_, l)| l.iter().map(|(k, _)| k)).collect();
    names.sort();
    names.dedup();
    for name in names {
        let values: Vec<(i32, Option<&String>)> = states.iter().map(|(id, l)| (*id, l.iter().find(|(k, _)| k == name).map(|(_, v)| v))).collect();
        if values.iter().any(|(_, v)| *v != values[0].1) {
            let mut said: Vec<String> = values.iter().map(|(id, v)| format!("{}: {}", describe(nodes, *id), v.map_or("(none)", |v| v.as_str()))).collect();
            said.sort();
            return Some(format!("the workers reached a barrier with different {name} ({})", said.join("; ")));
        }
    }
    None
}

/// A host a registration may name: an IP address, or a DNS name (letters,
/// digits, '-' and '.', at most 253 bytes). Anything else is no address to
/// connect to, and is refused before the scheduler tries.
fn valid_host(host: &str) -> bool {
    host.parse::<std::net::IpAddr>().is_ok()
        || (!host.is_empty() && host.len() <= 253 && host.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.') && !host.starts_with(['-', '.']))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: i32, role: Role, rank: usize) -> NodeInfo {
        NodeInfo { id, role, rank, host: "10.0.0.1".into(), port: 9000 + id as u16, nonce: 0 }
    }

    #[test]
    fn the_first_line_the_workers_disagree_on_is_named_with_every_value() {
        let nodes = [node(9, Role::Worker, 0), node(11, Role::Worker, 1)];
        let same = [(9, "store type=dist_sync\nsync pushes=3\n".to_string()), (11, "store type=dist_sync\nsync pushes=3\n".to_string())];
        assert_eq!(disagreement(&nodes, &same), None);
        let apart = [(9, "compression=None\nsync pushes=3\n".to_string()), (11, "compression=None\nsync pushes=2\ninit=key 1\n".to_string())];
        assert_eq!(
            disagreement(&nodes, &apart).unwrap(),
            "the workers reached a barrier with different init (worker 0 (node 9 at 10.0.0.1:9009): (none); worker 1 (node 11 at 10.0.0.1:9011): key 1)"
        );
        // a node the table does not hold is named by its id
        assert_eq!(closed_in_barrier(&nodes, 13), "node 13 closed its store while other workers wait in a barrier it will never reach");
    }

    #[test]
    fn a_registration_names_an_ip_address_or_a_dns_name() {
        for good in ["127.0.0.1", "::1", "fe80::1", "node-3.cluster.local", "a"] {
            assert!(valid_host(good), "{good}");
        }
        for bad in ["", "-x", ".x", "a b", "x;rm", "tcp://x", &"a".repeat(254)] {
            assert!(!valid_host(bad), "{bad}");
        }
    }

    #[test]
    fn a_barrier_is_released_with_its_number_and_its_failure() {
        let ok = barrier_done(4, None);
        assert_eq!((ok.meta.command, ok.meta.request_id, ok.meta.status, ok.meta.sender), (Command::BarrierDone, 4, 0, SCHEDULER_ID));
        let failed = barrier_done(5, Some("different sync pushes"));
        assert_eq!((failed.meta.status, failed.meta.body.as_str()), (1, "different sync pushes"));
    }
}
