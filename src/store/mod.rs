//! The stores: what every store shares, in this wing, and each store in a
//! folder of its own beside the others.
//!
//! - this file: the `Store` trait every store implements (the C ABI, the
//!   C++ bridge and, through the C ABI, Python hold a `Box<dyn Store>` from
//!   `open` and call nothing else), the arrays handed to a store, the
//!   updater, and the one table of store types;
//! - `checks`: the checks every store runs before it changes anything
//!   (shapes, dtypes, outputs, the key lock);
//! - `sum`: summing devices' gradients and settling float16 keys;
//! - `checkpoint`: the compression states' format ("GPCS", "GPST");
//! - `local`: the `local` and `device` stores (`KVStore`), and the replica
//!   API through which the MPI store keeps its keys in one;
//! - `mpi`: the all-reduce store `dist_sync_allreduce` over Open MPI;
//! - `param_server`: MXNet's parameter server (`dist_sync`, `dist_async`):
//!   its worker, server and transport.
//!
//! The stores use one another only through this file, `local`'s replica API
//! and the shared modules; none reads another's private state.
//!
//! The calls that combine others (pushpull, broadcast) are written once
//! below and check every output before the push or init changes anything:
//! validate, then mutate, on every store alike.

pub(crate) mod checkpoint;
pub(crate) mod checks;
pub mod group;
pub mod local;
pub mod mpi;
pub mod param_server;
pub(crate) mod sum;

pub use checks::elements;
pub use local::{KVStore, Stats};
pub use mpi::MpiStore;
pub use param_server::DistWorker;

pub use crate::codec::Grad;
pub use crate::key::Key;

use checks::check_outputs;
use crate::quant::compression::Compression;
use crate::error::{Error, Result};
use crate::optimizer::Optimizer;

/// What a store type name makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A `KVStore` that reduces on the CPU; compression is refused (as in MXNet).
    Local,
    /// A `KVStore` that reduces on a merge device; with compression every
    /// pushed array is quantized with its own residual, then summed.
    Device,
    /// `dist_sync_allreduce`: one worker of an MPI job (`MpiStore`); its
    /// devices are merged, then reduced with every other worker's by MPI, and
    /// each worker updates its own replica.
    AllReduce,
    /// A worker of MXNet's parameter server (`DistWorker`), asynchronous or not.
    ParamServer { asynchronous: bool },
}

/// Every store type gradpack serves, in one table: the C ABI's names, the
/// Python package's lists and the MXNet front all come from here.
pub const STORE_TYPES: [(&std::ffi::CStr, Kind); 7] = [
    (c"local", Kind::Local),
    (c"device", Kind::Device),
    (c"dist_sync_allreduce", Kind::AllReduce),
    (c"dist_sync", Kind::ParamServer { asynchronous: false }),
    (c"dist_async", Kind::ParamServer { asynchronous: true }),
    (c"dist_sync_device", Kind::ParamServer { asynchronous: false }),
    (c"dist_device_sync", Kind::ParamServer { asynchronous: false }),
];

/// The table's entry for `name`: its static C string and kind.
pub fn store_type(name: &str) -> Option<(&'static std::ffi::CStr, Kind)> {
    STORE_TYPES.iter().find(|(n, _)| n.to_bytes() == name.as_bytes()).copied()
}

impl Kind {
    /// The kind's first name in the table (a parameter-server kind has
    /// several: this is `dist_sync` or `dist_async`).
    pub fn name(self) -> &'static str {
        let entry = STORE_TYPES.iter().find(|(_, k)| *k == self).expect("every Kind is in the table");
        entry.0.to_str().expect("ASCII names")
    }
}

/// A new store of `type_name`: a local or device store, a member of the MPI
/// job this process was started in, or a worker of a parameter-server job
/// that the DMLC_* variables describe (this blocks until every node
/// registered). Each distributed store holds its transport below it
/// (`mpi::world::World`, `param_server::postoffice::Postoffice`).
pub fn open(type_name: &str) -> Result<Box<dyn Store>> {
    Ok(match store_type(type_name) {
        Some((_, Kind::ParamServer { .. })) => Box::new(DistWorker::start(type_name, param_server::Config::from_env()?)?),
        Some((_, Kind::AllReduce)) => Box::new(MpiStore::join()?),
        _ => Box::new(KVStore::new(type_name)?), // an unknown name: KVStore::new says which exist
    })
}

/// One array handed to the store, with its shape.
#[derive(Clone, Copy, Debug)]
pub struct Array<'a> {
    pub shape: &'a [usize],
    pub data: Grad<'a>,
}

/// One output array the store writes into.
#[derive(Debug)]
pub struct ArrayMut<'a> {
    pub shape: &'a [usize],
    pub data: &'a mut [f32],
}

/// What a push does with the merged gradient.
pub enum Updater {
    /// gradpack's own optimizer.
    Optimizer(Optimizer),
    /// A caller's function `(key, merged, stored)`, `stored` updated in place.
    Custom(Box<dyn Fn(&Key, &[f32], &mut [f32]) -> Result<()> + Send + Sync>),
}

pub trait Store: Send + Sync {
    /// The name it was created with, from `STORE_TYPES`.
    fn type_name(&self) -> &'static str;
    /// This worker's rank (0 on a local store).
    fn rank(&self) -> usize;
    /// The number of workers (1 on a local store).
    fn num_workers(&self) -> usize;
    /// Waits for every worker (returns at once on a local store).
    fn barrier(&self) -> Result<()>;
    /// Traffic counters: on local and MPI stores, the bytes pushes moved as
    /// float32 and as sent; on a distributed worker, its transport's bytes
    /// sent and received.
    fn stats(&self) -> (u64, u64);
    /// Messages received and dropped (unauthenticated, replayed, malformed);
    /// 0 where nothing arrives over a network of its own.
    fn dropped(&self) -> u64 {
        0
    }
    /// Pulls answered without asking the servers, from the values a scheme
    /// round's servers sent back with their answers; 0 on other stores.
    fn local_pulls(&self) -> u64 {
        0
    }
    /// Leaves the job (distributed stores, with every other worker); later
    /// calls fail. A no-op on a local store and after the first call.
    fn close(&self) -> Result<()>;

    /// Compression for every later key; `params` as the user gave them (a
    /// distributed store forwards them to its servers). Before any init.
    fn set_compress(&self, compression: Compression, params: &[(String, String)]) -> Result<()>;
    /// gradpack's optimizer `name` with MXNet's parameters, run on every push
    /// (by the servers of a distributed store).
    fn set_optimizer(&self, name: &str, params: &[(String, String)]) -> Result<()>;

    fn init(&self, key: &Key, value: Array) -> Result<()>;
    fn push(&self, key: &Key, values: &[Array]) -> Result<()>;
    fn pull(&self, key: &Key, outs: &mut [ArrayMut]) -> Result<()>;
    /// The shape `key` was initialised with.
    fn shape(&self, key: &Key) -> Result<Vec<usize>>;

    /// push, then pull into `outs`; outputs of the wrong shape fail before the push.
    fn pushpull(&self, key: &Key, values: &[Array], outs: &mut [ArrayMut]) -> Result<()> {
        check_outputs(key, "pushpull", outs, &self.shape(key)?)?;
        self.push(key, values)?;
        self.pull(key, outs)
    }

    /// A front refused an init (`init`) or a push of `key` (None: no key it
    /// could read; `shape`: the value's, when known) before calling the
    /// store, with `err`. An all-reduce store still takes part in that
    /// call's agreement, so that the other workers' call fails alike
    /// instead of pairing with this worker's next one; other stores have
    /// nothing to do. Returns `err`.
    fn refuse(&self, _key: Option<&Key>, _init: bool, _shape: Option<&[usize]>, err: Error) -> Error {
        err
    }

    /// init, then pull into `outs`; outputs of the wrong shape fail before the init.
    fn broadcast(&self, key: &Key, value: Array, outs: &mut [ArrayMut]) -> Result<()> {
        check_outputs(key, "broadcast", outs, value.shape)?;
        self.init(key, value)?;
        self.pull(key, outs)
    }

    /// Every key's residuals and scheme state (this worker's on a distributed
    /// store), in the versioned "GPCS" format (`checkpoint`).
    fn save_compression_states(&self) -> Result<Vec<u8>>;
    /// Replaces them from `save_compression_states`'s blob, checked whole first.
    fn load_compression_states(&self, blob: &[u8]) -> Result<()>;

    // --- where the optimizer runs in this process (local and MPI stores);
    // a distributed store's runs on its servers, so these are errors there.

    /// One key's learning rate and weight decay for the optimizer.
    fn set_rates(&self, _key: &Key, _learning_rate: f64, _wd: f64) -> Result<()> {
        Err(unavailable(self.type_name(), "per-key rates"))
    }
    /// The optimizer's rescale_grad and clip_gradient (negative: off).
    fn set_grad_scaling(&self, _rescale_grad: f32, _clip_gradient: f32) -> Result<()> {
        Err(unavailable(self.type_name(), "gradient scaling"))
    }
    /// A caller's function instead of gradpack's optimizer.
    fn set_updater(&self, _updater: Updater) -> Result<()> {
        Err(unavailable(self.type_name(), "set_updater"))
    }
    /// The optimizer's states and the compression states, in one blob.
    fn save_optimizer_states(&self) -> Result<Vec<u8>> {
        Err(unavailable(self.type_name(), "saving optimizer states"))
    }
    /// Replaces both from `save_optimizer_states`'s blob (or an older
    /// optimizer-only one), checked whole first.
    fn load_optimizer_states(&self, _blob: &[u8]) -> Result<()> {
        Err(unavailable(self.type_name(), "loading optimizer states"))
    }
    /// `key`'s error-feedback residual on `device`.
    fn residual(&self, _key: &Key, _device: usize) -> Result<Vec<f32>> {
        Err(unavailable(self.type_name(), "residual"))
    }
}

fn unavailable(type_name: &str, what: &str) -> Error {
    Error::Store(format!("{what} is not available on a '{type_name}' store: its optimizer runs on the servers"))
}
