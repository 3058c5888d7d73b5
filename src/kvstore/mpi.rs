//! The MPI all-reduce store (`dist_sync_allreduce`): a `KVStore` for its
//! keys, values, residuals and optimizer, beside the MPI job (`World`)
//! that every init and push goes through. Each init and push is first
//! agreed by every worker (operation, key, size, step, compression,
//! optimizer, and whether each worker's own checks passed), so that a
//! worker's bad input fails the call on every worker before anything is
//! reduced or changed; then the values are broadcast (init) or the
//! devices' sum is reduced (push) through the scheme's one path.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use super::{apply_update, key_error, lock, sum_into, Array, ArrayMut, Entry, KVStore, Key, StoreType, Updater};
use crate::allreduce::{self, World};
use crate::codec::{self, Grad};
use crate::compression::Compression;
use crate::error::{Error, Result};
use crate::quant::{collective, scheme};

pub struct AllreduceStore {
    local: KVStore,
    world: World,
    /// Held for a whole init or push: one process issues its collectives
    /// one key at a time.
    order: Mutex<()>,
    /// Closed (`close`, or another worker's): no more collectives.
    closed: AtomicBool,
}

impl AllreduceStore {
    /// Joins the MPI job this process was started in (mpirun).
    pub fn join() -> Result<AllreduceStore> {
        let world = World::join()?;
        let local = KVStore::with_member(StoreType::Allreduce, world.rank(), world.size());
        Ok(AllreduceStore { local, world, order: Mutex::new(()), closed: AtomicBool::new(false) })
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
        let mine = self.agreement(allreduce::Op::Init, key, value.data.len() as u64, 0, checked.is_ok());
        let agreed = self.agree(&format!("the init of key {key}"), &mine);
        let mut data = checked?; // a worker's own error first, then the others'
        agreed?;
        self.world.broadcast_f32(&mut data)?;
        self.local.insert(key, value, data)
    }

    /// Sums this worker's devices, agrees, all-reduces the sum (compressed
    /// by the scheme), and applies the updater on every worker alike.
    pub fn push(&self, key: &Key, values: &[Array]) -> Result<()> {
        let _order = self.ordered();
        let entry = match self.local.entry(key) {
            Ok(e) => e,
            Err(err) => {
                // Every worker takes part in the agreement, even one that failed here.
                self.check_open()?;
                let _ = self.agree(&format!("the push of key {key}"), &self.agreement(allreduce::Op::Push, key, 0, 0, false));
                return Err(err);
            }
        };
        let (compression, updater) = (self.local.compression(), self.local.updater.read().unwrap().clone());
        let mut guard = lock(key, &entry)?;
        let e = &mut *guard;
        let checked = self.local.check_push(key, e, values, compression, updater.as_deref());
        self.local.undoable(e, updater.as_deref(), |e| {
            // The merge and its finiteness check come before the agreement,
            // so that a worker's non-finite gradient fails every worker's push.
            let checked = checked.and_then(|()| merge(key, e, values, compression));
            self.check_open()?;
            let mine = self.agreement(allreduce::Op::Push, key, e.value.len() as u64, e.pushes, checked.is_ok());
            let agreed = self.agree(&format!("the push of key {key}"), &mine);
            checked?; // a worker's own error first, then the others'
            agreed?;
            self.reduce(key, e, compression, updater.as_deref())
        })
    }

    /// The all-reduce of the local sum that `merge` left in `e.merge_buf`
    /// (checks done, agreed by every worker), then the update.
    fn reduce(&self, key: &Key, e: &mut Entry, compression: Compression, updater: Option<&Updater>) -> Result<()> {
        let n = e.value.len();
        let sent = self.world.bytes_sent();
        let mut member = &self.world;
        if compression.is_none() {
            collective::Collective::sum_f32(&mut member, &mut e.merge_buf)?;
        } else {
            if e.states.is_empty() {
                e.states.push(scheme::State::default());
            }
            let ctx = scheme::Ctx { shape: &e.shape, step: e.pushes, key_hash: key.stable_hash(), member: self.world.rank() as u64, workers: self.world.size() };
            // The decoded sum goes to a second buffer, kept between pushes.
            let mut out = std::mem::take(&mut e.scheme_out);
            out.resize(n, 0.0);
            let result = scheme::allreduce(&compression, &mut e.states[..1], &[&e.merge_buf], &ctx, &mut member, &mut out);
            e.scheme_out = std::mem::replace(&mut e.merge_buf, out);
            result?;
        }
        e.pushes += 1;
        self.local.raw_bytes.fetch_add(4 * n as u64, Ordering::Relaxed);
        self.local.wire_bytes.fetch_add(self.world.bytes_sent() - sent, Ordering::Relaxed);
        apply_update(key, e, updater)
    }

    /// This worker's side of an agreement: the operation and key, and
    /// fingerprints of its compression and optimizer.
    fn agreement(&self, op: allreduce::Op, key: &Key, size: u64, step: u64, ok: bool) -> allreduce::Agreement {
        let optimizer = match self.local.updater.read().unwrap().as_deref() {
            None => 0,
            Some(Updater::Optimizer(o)) => allreduce::fingerprint(&format!("{:?}", o.rule())),
            Some(Updater::Custom(_)) => 1,
        };
        let compression = allreduce::fingerprint(&format!("{:?}", self.local.compression()));
        allreduce::Agreement { op, key_hash: key.stable_hash(), size, step, ok, compression, optimizer }
    }

    /// An agreement; when another worker was closing, this store is closed
    /// too (it could only wait for workers that will not come).
    fn agree(&self, what: &str, mine: &allreduce::Agreement) -> Result<()> {
        allreduce::check_agree_or_closed(&self.world, what, mine).map_err(|(err, closed)| {
            if closed {
                self.closed.store(true, Ordering::SeqCst);
            }
            err
        })
    }

    fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(Error::Store(format!("this '{}' store is closed (by close(), or because another worker closed its store)", StoreType::Allreduce.name())));
        }
        Ok(())
    }

    /// Waits for every worker, through an agreement (itself a collective of
    /// every worker): a worker still in an init or a push instead gets an
    /// error, as this one does, rather than both waiting for ever.
    pub fn barrier(&self) -> Result<()> {
        let _order = self.ordered();
        self.check_open()?;
        let mine = allreduce::Agreement { op: allreduce::Op::Barrier, key_hash: 0, size: 0, step: 0, ok: true, compression: 0, optimizer: 0 };
        self.agree("a barrier", &mine)
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
        let mine = allreduce::Agreement { op: allreduce::Op::Close, key_hash: 0, size: 0, step: 0, ok: true, compression: 0, optimizer: 0 };
        allreduce::check_agree(&self.world, "closing the store", &mine)
    }
}

/// Sums a worker's devices into `e.merge_buf` (scratch, not state) and checks
/// it (under 2-bit, that the sum plus the residual is finite): all before a
/// push agrees with the other workers or changes anything.
fn merge(key: &Key, e: &mut Entry, values: &[Array], compression: Compression) -> Result<()> {
    let n = e.value.len();
    let grads: Vec<Grad> = values.iter().map(|v| v.data).collect();
    e.merge_buf.resize(n, 0.0);
    sum_into(&mut e.merge_buf, &grads, false);
    if let Compression::TwoBit(_) = compression {
        let zeros;
        let residual = match e.states.first() {
            Some(s) if s.residual.len() == n => &s.residual[..],
            _ => {
                zeros = vec![0f32; n]; // a first push starts from a zero residual
                &zeros[..]
            }
        };
        codec::check_finite("merged gradient", &e.merge_buf, residual).map_err(|err| key_error(key, err.to_string()))?;
    } else if !matches!(compression, Compression::Qsgd(_)) {
        // (QSGD's shared scale fails every worker together by itself.)
        scheme::check_input(&compression, 1, &[&e.merge_buf], 1).map_err(|err| key_error(key, err.to_string()))?;
    }
    Ok(())
}

impl super::Store for AllreduceStore {
    fn type_name(&self) -> &'static str {
        StoreType::Allreduce.name()
    }
    fn rank(&self) -> usize {
        self.world.rank()
    }
    fn num_workers(&self) -> usize {
        self.world.size()
    }
    fn barrier(&self) -> Result<()> {
        AllreduceStore::barrier(self)
    }
    fn stats(&self) -> (u64, u64) {
        super::Store::stats(&self.local)
    }
    fn close(&self) -> Result<()> {
        AllreduceStore::close(self)
    }
    fn set_compress(&self, compression: Compression, params: &[(String, String)]) -> Result<()> {
        super::Store::set_compress(&self.local, compression, params)
    }
    fn set_optimizer(&self, name: &str, params: &[(String, String)]) -> Result<()> {
        super::Store::set_optimizer(&self.local, name, params)
    }
    fn init(&self, key: &Key, value: Array) -> Result<()> {
        AllreduceStore::init(self, key, value)
    }
    fn push(&self, key: &Key, values: &[Array]) -> Result<()> {
        AllreduceStore::push(self, key, values)
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
