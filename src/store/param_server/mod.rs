//! MXNet's parameter server (`dist_sync`, `dist_async`; docs/contract.md §3, §4), in ps-lite's layers, one
//! file each, each knowing only the one below: `van` (ZeroMQ transport, with
//! `auth` for MACs and `gate` for admitting connections) ->
//! `postoffice` (membership: ranks, barrier, heartbeats; `scheduler`, its other side) and
//! `customer` (request tracking) -> `worker` and `server`, which speak the
//! vocabulary of `message` (commands, flags, exchanges). `config` reads every setting
//! from MXNet's `DMLC_*` variables in one place.

pub mod auth;
pub mod config;
pub mod counts;
pub mod customer;
pub mod gate;
pub mod message;
pub mod postoffice;
pub mod round;
pub mod scheduler;
pub mod scheme_client;
pub mod server;
pub mod slices;
pub mod van;
pub mod worker;

pub use config::{Config, Role};
pub use worker::DistWorker;

use crate::error::{Error, Result};

/// Runs this process's scheduler or server role until the job ends (Ok) or
/// fails (Err). Workers create a `DistWorker` instead.
pub fn serve(config: Config) -> Result<()> {
    match config.role {
        Role::Scheduler => scheduler::run_scheduler(config),
        Role::Server => server::run_server(config),
        Role::Worker => Err(Error::Store("DMLC_ROLE=worker: a worker creates a dist store instead of serving".into())),
    }
}
