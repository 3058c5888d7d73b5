//! The MPI all-reduce store (`dist_sync_allreduce`): a replica `KVStore`
//! (`local`'s replica API) for its keys, values, residuals and optimizer,
//! beside the MPI job (`world::World`, over `openmpi`) that every init and
//! push goes through. Each init and push is first
//! agreed by every worker (operation, key, size, step, compression,
//! optimizer, and whether each worker's own checks passed), so that a
//! worker's bad input fails the call on every worker before anything is
//! reduced or changed; then the values are broadcast (init) or the
//! devices' sum is reduced (push) through the scheme's one path.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

#[cfg(feature = "mpi")]
mod openmpi;
pub mod world;

use self::world::World;
use super::local::Round;
use super::{Array, ArrayMut, KVStore, Key, Kind, Store, Updater};
use crate::quant::compression::Compression;
use crate::error::{Error, Result};

pub struct MpiStore {
    local: KVStore,
    world: World,
    /// Held for a whole init or push: one process issues its collectives
    /// one key at a time.
    order: Mutex<()>,
    /// Closed (`close`, or another worker's): no more collectives.
    closed: AtomicBool,
}

impl MpiStore {
    /// Joins the MPI job this process was started in (mpirun).
    pub fn join() -> Result<MpiStore> {
        let world = World::join()?;
        let local = KVStore::replica(world.rank(), world.size());
        Ok(MpiStore { local, world, order: Mutex::new(()), closed: AtomicBool::new(false) })
    }

    /// The store holding this worker's keys, values and states.
    pub fn local(&self) -> &KVStore {
        &self.local
    }

    fn ordered(&self) -> std::sync::MutexGuard<'_, ()> {
        self.order.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stores `value` under a new key on every worker: each takes rank 0's
    /// value (as a dist store does); init is never lossy.
    pub fn init(&self, key: &Key, value: Array) -> Result<()> {
        let _order = self.ordered();
        let checked = self.local.check_init(key, value);
        self.check_open()?;
        let mine = self.agreement(world::Op::Init, key, value.shape, 0, checked.is_ok());
        let agreed = self.agree(&format!("the init of key {key}"), &mine, checked.as_ref().err());
        let mut data = checked?; // a worker's own error first, then the others'
        agreed?;
        self.world.broadcast_f32(&mut data)?;
        self.local.insert(key, value, data)
    }

    /// Sums this worker's devices, agrees, all-reduces the sum (compressed
    /// by the scheme), and applies the updater on every worker alike.
    pub fn push(&self, key: &Key, values: &[Array]) -> Result<()> {
        let _order = self.ordered();
        let replica = match self.local.replica_of(key) {
            Ok(r) => r,
            // Every worker takes part in the agreement, even one that failed here.
            Err(err) => return Err(self.refusal(world::Op::Push, Some(key), None, err)),
        };
        replica.push(values, |mut round, checked| {
            // The merge and its finiteness check come before the agreement,
            // so that a worker's non-finite gradient fails every worker's push.
            let checked = checked.and_then(|()| round.merge(values));
            self.check_open()?;
            let mine = self.agreement(world::Op::Push, key, round.shape(), round.step(), checked.is_ok());
            let agreed = self.agree(&format!("the push of key {key}"), &mine, checked.as_ref().err());
            checked?; // a worker's own error first, then the others'
            agreed?;
            self.reduce(key, round, mine)
        })
    }

    /// The all-reduce of the local sum that the round merged (checks done,
    /// agreed by every worker as `agreed`), then the update. A caller's
    /// updater may fail on one worker alone: its result is agreed too, and
    /// on a failure anywhere every worker's push fails, and is put back
    /// (`Replica::push`), so that the replicas stay alike.
    fn reduce(&self, key: &Key, mut round: Round<'_>, agreed: world::Agreement) -> Result<()> {
        let sent = self.world.bytes_sent();
        round.reduce(&mut self.world.lanes(), self.world.rank() as u64, self.world.size())?;
        let custom = round.custom_update();
        let updated = round.update(self.world.bytes_sent() - sent);
        if !custom {
            return updated;
        }
        let mine = world::Agreement { op: world::Op::Update, ok: updated.is_ok(), ..agreed };
        let agreed = self.agree(&format!("the update of key {key}"), &mine, updated.as_ref().err());
        updated?;
        agreed
    }

    /// This worker's side of an agreement: the operation, key and shape,
    /// and fingerprints of its compression and its updater for the key.
    fn agreement(&self, op: world::Op, key: &Key, shape: &[usize], step: u64, ok: bool) -> world::Agreement {
        let compression = crate::hash::fingerprint(&format!("{:?}", self.local.compression()));
        let (key_hash, shape) = (world::key_hash(key), world::shape_hash(shape));
        world::Agreement { op, key_hash, shape, step, ok, compression, optimizer: self.local.updater_fingerprint(key) }
    }

    /// A call this worker refused before its agreement (`err`: a bad
    /// argument, an output of another shape, a key it does not hold, or a
    /// front's own check): it still takes part, as a worker whose checks
    /// failed, so that the other workers' call fails too, with `err` as its
    /// cause, instead of pairing with this worker's next call. `key` and
    /// `shape` are what the caller knows of the call (else the key's own).
    /// Returns `err`.
    pub fn refused(&self, op: world::Op, key: Option<&Key>, shape: Option<&[usize]>, err: Error) -> Error {
        let _order = self.ordered();
        self.refusal(op, key, shape, err)
    }

    /// `refused`, for a caller that holds `order`.
    fn refusal(&self, op: world::Op, key: Option<&Key>, shape: Option<&[usize]>, err: Error) -> Error {
        if self.check_open().is_err() || !matches!(op, world::Op::Init | world::Op::Push) {
            return err;
        }
        let known = key.and_then(|k| self.local.shape(k).ok());
        let shape = shape.or(known.as_deref()).unwrap_or(&[]);
        let step = key.and_then(|k| self.local.pushes(k).ok()).unwrap_or(0);
        let mine = match key {
            Some(k) => self.agreement(op, k, shape, step, false),
            None => world::Agreement { ok: false, ..world::Agreement::plain(op) },
        };
        let what = match (op, key) {
            (world::Op::Init, Some(k)) => format!("the init of key {k}"),
            (_, Some(k)) => format!("the push of key {k}"),
            (world::Op::Init, None) => "an init".to_string(),
            _ => "a push".to_string(),
        };
        let _ = self.agree(&what, &mine, Some(&err));
        err
    }

    /// An agreement, with this worker's own error when its checks failed
    /// (the others' error names it); when another worker was closing, this
    /// store is closed too (it could only wait for workers that will not come).
    fn agree(&self, what: &str, mine: &world::Agreement, failed: Option<&Error>) -> Result<()> {
        let failed = failed.map(|e| e.to_string());
        world::check_agree_or_closed(&self.world, what, mine, failed.as_deref()).map_err(|(err, closed)| {
            if closed {
                self.closed.store(true, Ordering::SeqCst);
            }
            err
        })
    }

    fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(Error::Store(format!("this '{}' store is closed (by close(), or because another worker closed its store)", Kind::AllReduce.name())));
        }
        Ok(())
    }

    /// Waits for every worker, through an agreement (itself a collective of
    /// every worker): a worker still in an init or a push instead gets an
    /// error, as this one does, rather than both waiting for ever.
    pub fn barrier(&self) -> Result<()> {
        let _order = self.ordered();
        self.check_open()?;
        self.agree("a barrier", &world::Agreement::plain(world::Op::Barrier), None)
    }

    /// Closes the store together with every other worker: a worker still
    /// waiting in an init or push of its own gets an error saying that
    /// another worker closed (instead of waiting forever). A no-op after
    /// the first call.
    pub fn close(&self) -> Result<()> {
        let _order = self.ordered();
        if self.closed.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        world::check_agree(&self.world, "closing the store", &world::Agreement::plain(world::Op::Close), None)
    }
}

impl Store for MpiStore {
    fn type_name(&self) -> &'static str {
        Kind::AllReduce.name()
    }
    fn rank(&self) -> usize {
        self.world.rank()
    }
    fn num_workers(&self) -> usize {
        self.world.size()
    }
    fn barrier(&self) -> Result<()> {
        MpiStore::barrier(self)
    }
    fn stats(&self) -> (u64, u64) {
        Store::stats(&self.local)
    }
    fn close(&self) -> Result<()> {
        MpiStore::close(self)
    }
    fn set_compress(&self, compression: Compression, params: &[(String, String)]) -> Result<()> {
        Store::set_compress(&self.local, compression, params)
    }
    fn set_optimizer(&self, name: &str, params: &[(String, String)]) -> Result<()> {
        Store::set_optimizer(&self.local, name, params)
    }
    fn init(&self, key: &Key, value: Array) -> Result<()> {
        MpiStore::init(self, key, value)
    }
    fn push(&self, key: &Key, values: &[Array]) -> Result<()> {
        MpiStore::push(self, key, values)
    }
    fn pushpull(&self, key: &Key, values: &[Array], outs: &mut [ArrayMut]) -> Result<()> {
        let shape = self.local.shape(key).map_err(|err| self.refused(world::Op::Push, Some(key), None, err))?;
        super::check_outputs(key, "pushpull", outs, &shape).map_err(|err| self.refused(world::Op::Push, Some(key), None, err))?;
        self.push(key, values)?;
        self.pull(key, outs)
    }
    fn broadcast(&self, key: &Key, value: Array, outs: &mut [ArrayMut]) -> Result<()> {
        super::check_outputs(key, "broadcast", outs, value.shape).map_err(|err| self.refused(world::Op::Init, Some(key), Some(value.shape), err))?;
        self.init(key, value)?;
        self.pull(key, outs)
    }
    fn refuse(&self, key: Option<&Key>, init: bool, shape: Option<&[usize]>, err: Error) -> Error {
        self.refused(if init { world::Op::Init } else { world::Op::Push }, key, shape, err)
    }
    fn pull(&self, key: &Key, outs: &mut [ArrayMut]) -> Result<()> {
        self.local.pull(key, outs)
    }
    fn shape(&self, key: &Key) -> Result<Vec<usize>> {
        self.local.shape(key)
    }
    fn save_compression_states(&self) -> Result<Vec<u8>> {
        self.local.save_compression_states()
    }
    fn load_compression_states(&self, blob: &[u8]) -> Result<()> {
        self.local.load_compression_states(blob)
    }
    fn set_rates(&self, key: &Key, learning_rate: f64, wd: f64) -> Result<()> {
        self.local.set_rates(key, learning_rate, wd)
    }
    fn set_grad_scaling(&self, rescale_grad: f32, clip_gradient: f32) -> Result<()> {
        self.local.set_grad_scaling(rescale_grad, clip_gradient)
    }
    fn set_updater(&self, updater: Updater) -> Result<()> {
        self.local.set_updater(updater);
        Ok(())
    }
    fn save_optimizer_states(&self) -> Result<Vec<u8>> {
        self.local.save_optimizer_states()
    }
    fn load_optimizer_states(&self, blob: &[u8]) -> Result<()> {
        self.local.load_optimizer_states(blob)
    }
    fn residual(&self, key: &Key, device: usize) -> Result<Vec<f32>> {
        self.local.residual(key, device)
    }
}
