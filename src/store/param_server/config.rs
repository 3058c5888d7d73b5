//! All configuration of a distributed node, read in one place from MXNet's and
//! ps-lite's environment variables:
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `DMLC_ROLE` | `scheduler`, `server` or `worker` | `worker` |
//! | `DMLC_PS_ROOT_URI` | the scheduler's host | required |
//! | `DMLC_PS_ROOT_PORT` | the scheduler's port | required |
//! | `DMLC_NUM_WORKER` | number of workers | required |
//! | `DMLC_NUM_SERVER` | number of servers | required |
//! | `DMLC_NODE_HOST` | this node's address as others reach it | the interface that reaches the scheduler |
//! | `DMLC_INTERFACE` | accepted for compatibility; `DMLC_NODE_HOST` decides | — |
//! | `PS_HEARTBEAT_INTERVAL` | seconds between heartbeats to the scheduler | 1 |
//! | `PS_HEARTBEAT_TIMEOUT` | seconds of silence after which a node is dead | 10 |
//! | `GRADPACK_REGISTER_TIMEOUT` | seconds the job has to form: the scheduler waits this long for every node to register, then exits naming those that never did; a node waits this long for the node table, retrying when the scheduler's gate refuses its connection | 300 |
//! | `GRADPACK_CONNECTION_GRACE` | seconds a connection that finished ZeroMQ's handshake has to deliver its first valid message (with a secret: authenticated) before the node closes it | 5 |
//! | `PS_VERBOSE` | 1: log membership events, 2: every message | 0 |
//! | `MXNET_KVSTORE_BIGARRAY_BOUND` | keys of at least this many elements are split over all servers | 1000000 |
//! | `GRADPACK_PARTITION_BYTES` | a split scheme key (not PowerSGD) is cut into slices of at most this many float32 bytes, dealt round the servers, so one slice's reply overlaps the next slice's push (BytePS's `BYTEPS_PARTITION_BYTES`) | 4194304 |
//! | `GRADPACK_MAX_MESSAGE_BYTES` | the largest frame a worker or server takes (ZeroMQ refuses a longer one before it is buffered): a key slice's bytes plus its header must fit; a worker refuses to init a key whose slice would not | 536870912 (512 MiB) |
//! | `GRADPACK_SECRET` | the job's shared secret: every message is authenticated (`auth`) | none (a warning) |
//! | `GRADPACK_SECRET_FILE` | a file holding the secret, so it need not appear in the environment | none |

use std::env;
use std::time::Duration;

use super::auth::Secret;
use crate::error::{Error, Result};

/// `GRADPACK_MAX_MESSAGE_BYTES`'s default: a slice of 128M float32.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 512 << 20;

/// The least `GRADPACK_MAX_MESSAGE_BYTES` may be.
pub const MIN_MESSAGE_BYTES: usize = 64 << 10;

/// The largest frame the scheduler takes: it gets only control messages.
pub const CONTROL_MESSAGE_BYTES: usize = 64 << 10;

/// `GRADPACK_REGISTER_TIMEOUT`'s default: generous enough for a slow cluster's start.
pub const DEFAULT_REGISTER_TIMEOUT: Duration = Duration::from_secs(300);

/// `GRADPACK_CONNECTION_GRACE`'s default: a node of the job sends its first
/// message at once on every connection it opens.
pub const DEFAULT_CONNECTION_GRACE: Duration = Duration::from_secs(5);

/// Header room a data frame needs beside its payload (the key, the body).
pub const HEADER_BYTES: usize = 16 << 10;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Scheduler,
    Server,
    Worker,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Scheduler => "scheduler",
            Role::Server => "server",
            Role::Worker => "worker",
        }
    }

    pub fn parse(s: &str) -> Result<Role> {
        match s {
            "scheduler" => Ok(Role::Scheduler),
            "server" => Ok(Role::Server),
            "worker" => Ok(Role::Worker),
            other => Err(config_error("DMLC_ROLE", &format!("must be scheduler, server or worker, got '{other}'"))),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub role: Role,
    pub root_uri: String,
    pub root_port: u16,
    pub num_workers: usize,
    pub num_servers: usize,
    pub node_host: Option<String>,
    pub heartbeat_interval: Duration,
    pub heartbeat_timeout: Duration,
    /// How long the job may take to form (every node registered).
    pub register_timeout: Duration,
    /// How long a handshaked connection may stay without a valid message.
    pub connection_grace: Duration,
    pub verbose: u32,
    pub bigarray_bound: usize,
    /// The most float32 bytes in one slice of a split scheme key.
    pub partition_bytes: usize,
    /// The largest frame a worker or server receives (the scheduler: `CONTROL_MESSAGE_BYTES`).
    pub max_message_bytes: usize,
    /// The job's shared secret; None: messages are not authenticated.
    pub secret: Option<Secret>,
}

fn config_error(var: &str, problem: &str) -> Error {
    Error::InvalidParam { key: var.to_string(), problem: problem.to_string() }
}

fn var(name: &str) -> Option<String> {
    env::var(name).ok().map(|v| v.trim().to_string()).filter(|v| !v.is_empty())
}

fn required(name: &str) -> Result<String> {
    var(name).ok_or_else(|| config_error(name, "must be set for a distributed KVStore (see MXNet's launch contract)"))
}

fn number<T: std::str::FromStr>(name: &str, text: &str) -> Result<T> {
    text.parse::<T>().map_err(|_| config_error(name, &format!("must be a number, got '{text}'")))
}

/// The durations a setting may hold, in seconds: at least a millisecond (a
/// shorter heartbeat would spin) and at most a million seconds (about 11.6
/// days), so that every deadline computed from one stays far from overflow
/// (`Duration::from_secs_f64` panics past u64 seconds).
pub const SECONDS_RANGE: (f64, f64) = (0.001, 1e6);

fn seconds(name: &str, default: f64) -> Result<Duration> {
    seconds_of(name, var(name).as_deref(), default)
}

/// A duration setting's value (`text`: the trimmed variable, None when unset).
fn seconds_of(name: &str, text: Option<&str>, default: f64) -> Result<Duration> {
    let s = match text {
        Some(t) => number::<f64>(name, t)?,
        None => default,
    };
    let (least, most) = SECONDS_RANGE;
    if !(least..=most).contains(&s) {
        let got = text.map_or_else(|| s.to_string(), |t| format!("'{t}'"));
        return Err(config_error(name, &format!("must be a number of seconds from {least} to {most}, got {got}")));
    }
    Ok(Duration::from_secs_f64(s))
}

impl Config {
    pub fn from_env() -> Result<Config> {
        let role = Role::parse(&var("DMLC_ROLE").unwrap_or_else(|| "worker".into()))?;
        let root_port = number::<u16>("DMLC_PS_ROOT_PORT", &required("DMLC_PS_ROOT_PORT")?)?;
        let num_workers = number::<usize>("DMLC_NUM_WORKER", &required("DMLC_NUM_WORKER")?)?;
        let num_servers = number::<usize>("DMLC_NUM_SERVER", &required("DMLC_NUM_SERVER")?)?;
        if num_workers == 0 {
            return Err(config_error("DMLC_NUM_WORKER", "must be at least 1"));
        }
        if num_servers == 0 {
            return Err(config_error("DMLC_NUM_SERVER", "must be at least 1"));
        }
        let heartbeat_interval = seconds("PS_HEARTBEAT_INTERVAL", 1.0)?;
        let heartbeat_timeout = seconds("PS_HEARTBEAT_TIMEOUT", 10.0)?;
        if heartbeat_timeout <= heartbeat_interval {
            return Err(config_error("PS_HEARTBEAT_TIMEOUT", "must be longer than PS_HEARTBEAT_INTERVAL"));
        }
        let register_timeout = seconds("GRADPACK_REGISTER_TIMEOUT", DEFAULT_REGISTER_TIMEOUT.as_secs_f64())?;
        let connection_grace = seconds("GRADPACK_CONNECTION_GRACE", DEFAULT_CONNECTION_GRACE.as_secs_f64())?;
        let bigarray_bound = match var("MXNET_KVSTORE_BIGARRAY_BOUND") {
            Some(t) => number::<usize>("MXNET_KVSTORE_BIGARRAY_BOUND", &t)?.max(1),
            None => 1_000_000,
        };
        let partition_bytes = match var("GRADPACK_PARTITION_BYTES") {
            Some(t) => number::<usize>("GRADPACK_PARTITION_BYTES", &t)?,
            None => 4 << 20,
        };
        if partition_bytes < 4 {
            return Err(config_error("GRADPACK_PARTITION_BYTES", &format!("must hold at least one float32 (4 bytes), got {partition_bytes}")));
        }
        let max_message_bytes = match var("GRADPACK_MAX_MESSAGE_BYTES") {
            Some(t) => number::<usize>("GRADPACK_MAX_MESSAGE_BYTES", &t)?,
            None => DEFAULT_MAX_MESSAGE_BYTES,
        };
        if max_message_bytes < MIN_MESSAGE_BYTES {
            return Err(config_error("GRADPACK_MAX_MESSAGE_BYTES", &format!("must be at least {MIN_MESSAGE_BYTES} (a header and a small slice), got {max_message_bytes}")));
        }
        Ok(Config {
            role,
            root_uri: required("DMLC_PS_ROOT_URI")?,
            root_port,
            num_workers,
            num_servers,
            node_host: var("DMLC_NODE_HOST"),
            heartbeat_interval,
            heartbeat_timeout,
            register_timeout,
            connection_grace,
            verbose: var("PS_VERBOSE").map(|v| number::<u32>("PS_VERBOSE", &v)).transpose()?.unwrap_or(0),
            bigarray_bound,
            partition_bytes,
            max_message_bytes,
            secret: Secret::from_env()?,
        })
    }

    /// What every node of one job must agree on; a node whose fingerprint
    /// differs from the scheduler's is refused.
    pub fn job_fingerprint(&self) -> String {
        format!(
            "workers={} servers={} bigarray_bound={} partition_bytes={} max_message_bytes={}",
            self.num_workers, self.num_servers, self.bigarray_bound, self.partition_bytes, self.max_message_bytes
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_duration_out_of_range_is_an_error_naming_the_variable_and_range() {
        for bad in ["1e300", "-1", "0", "nan", "inf", "1e-300", "1000000.5"] {
            let err = seconds_of("PS_HEARTBEAT_INTERVAL", Some(bad), 1.0).unwrap_err().to_string();
            assert_eq!(err, format!("invalid parameter 'PS_HEARTBEAT_INTERVAL': must be a number of seconds from 0.001 to 1000000, got '{bad}'"));
        }
        assert!(seconds_of("PS_HEARTBEAT_TIMEOUT", Some("ten"), 10.0).unwrap_err().to_string().contains("must be a number, got 'ten'"));
        assert_eq!(seconds_of("PS_HEARTBEAT_TIMEOUT", Some("1e6"), 10.0).unwrap(), Duration::from_secs(1_000_000));
        assert_eq!(seconds_of("PS_HEARTBEAT_TIMEOUT", Some("0.001"), 10.0).unwrap(), Duration::from_millis(1));
        assert_eq!(seconds_of("PS_HEARTBEAT_TIMEOUT", None, 10.0).unwrap(), Duration::from_secs(10));
    }
}
