//! `Store`: what every store does, whatever carries its traffic. The
//! local/device and MPI stores (`KVStore`) and the parameter-server worker
//! (`dist::DistWorker`) implement it; the C ABI, the C++ bridge (and through
//! the C ABI, Python) hold a `Box<dyn Store>` from `stores::open` and call
//! nothing else, so each call is dispatched once, here.
//!
//! The calls that combine others (pushpull, broadcast) are written once
//! below and check every output before the push or init changes anything:
//! validate, then mutate, on every store alike.

use super::{check_outputs, Array, ArrayMut, Key, Updater};
use crate::compression::Compression;
use crate::error::{Error, Result};

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
