//! The all-reduce store's transport (`dist_sync_allreduce`, MXNet's name for
//! its MPI store): no servers; every worker reduces through MPI collectives
//! and updates its own replica. Open MPI through the `mpi` crate, behind the
//! Cargo feature `mpi`; without it `World::join` says how to get it.
//!
//! Packed codes are summed by MPI itself: each worker sends `code - lo` in
//! lanes wide enough for the sum over every worker (`quant::lanes`), and an
//! MPI SUM of 64-bit words adds every lane exactly. Scale indices are packed
//! the same way and reduced with a lane-wise MIN (an MPI user operation).
//!
//! Launch with `mpirun -n <workers> python train.py` (as root, Open MPI also
//! needs `--allow-run-as-root`, and `--oversubscribe` for more processes than
//! cores). MPI is initialised on the first join and finalised at exit.

use crate::error::{Error, Result};

#[cfg(feature = "mpi")]
mod imp {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Mutex;

    use mpi::collective::{SystemOperation, UserOperation};
    use mpi::environment::Universe;
    use mpi::topology::SimpleCommunicator;
    use mpi::traits::*;

    use crate::error::{Error, Result};
    use crate::quant::collective::{self, Collective};
    use crate::quant::lanes;

    /// Statics never drop: MPI is finalised by the exit hook, once.
    static UNIVERSE: Mutex<Option<Universe>> = Mutex::new(None);

    extern "C" {
        fn atexit(cb: extern "C" fn()) -> std::ffi::c_int;
    }

    extern "C" fn finalize_at_exit() {
        if let Ok(mut u) = UNIVERSE.lock() {
            drop(u.take()); // Universe's drop calls MPI_Finalize
        }
    }

    /// This process's place in the MPI job.
    pub struct World {
        comm: Mutex<SimpleCommunicator>,
        rank: usize,
        size: usize,
        sent: AtomicU64,
    }

    // SAFETY: MPI is initialised with MPI_THREAD_MULTIPLE (checked in join),
    // and every use of the communicator goes through the mutex.
    unsafe impl Send for World {}
    unsafe impl Sync for World {}

    impl World {
        pub fn join() -> Result<World> {
            let mut u = UNIVERSE.lock().unwrap();
            if u.is_none() {
                let (universe, level) = mpi::initialize_with_threading(mpi::Threading::Multiple)
                    .ok_or_else(|| Error::Store("MPI was already initialised (or finalised) by someone else in this process".into()))?;
                if level != mpi::Threading::Multiple {
                    return Err(Error::Store(format!("this MPI grants thread level {level:?}; gradpack needs Multiple")));
                }
                *u = Some(universe);
                // SAFETY: registering a plain extern "C" function with libc's atexit.
                unsafe { atexit(finalize_at_exit) };
            }
            // A communicator of its own (MPI_Comm_dup): the store's
            // collectives never match anyone else's on COMM_WORLD.
            let comm = u.as_ref().unwrap().world().duplicate();
            let (rank, size) = (comm.rank() as usize, comm.size() as usize);
            Ok(World { comm: Mutex::new(comm), rank, size, sent: AtomicU64::new(0) })
        }

        pub fn rank(&self) -> usize {
            self.rank
        }

        pub fn size(&self) -> usize {
            self.size
        }

        /// Bytes this worker handed to MPI reductions and broadcasts.
        pub fn bytes_sent(&self) -> u64 {
            self.sent.load(Ordering::Relaxed)
        }

        pub fn barrier(&self) {
            self.comm.lock().unwrap().barrier();
        }

        /// Rank 0's `x` everywhere.
        pub fn broadcast_f32(&self, x: &mut [f32]) {
            if self.rank == 0 {
                self.sent.fetch_add(4 * x.len() as u64, Ordering::Relaxed);
            }
            self.comm.lock().unwrap().process_at_rank(0).broadcast_into(x);
        }

        /// Rank 0's `x` everywhere (small metadata: shapes, checks).
        pub fn broadcast_u64(&self, x: &mut [u64]) {
            self.comm.lock().unwrap().process_at_rank(0).broadcast_into(x);
        }

        /// `bytes`: what this rank hands MPI, as `collective`'s counts say.
        fn reduce<T: Equivalence + Copy>(&self, x: &mut [T], op: impl mpi::collective::Operation, bytes: u64) {
            debug_assert_eq!(bytes, std::mem::size_of_val(x) as u64, "the shared count is what MPI gets");
            // The mpi crate has no MPI_IN_PLACE: reduce from a copy.
            let send = x.to_vec();
            self.sent.fetch_add(bytes, Ordering::Relaxed);
            self.comm.lock().unwrap().all_reduce_into(&send[..], x, op);
        }
    }

    impl Collective for &World {
        fn workers(&self) -> usize {
            self.size
        }

        fn max_f32(&mut self, x: &mut [f32]) -> Result<()> {
            self.reduce(x, SystemOperation::max(), collective::f32_bytes(x.len()));
            Ok(())
        }

        fn sum_f32(&mut self, x: &mut [f32]) -> Result<()> {
            self.reduce(x, SystemOperation::sum(), collective::f32_bytes(x.len()));
            Ok(())
        }

        fn min_u8(&mut self, x: &mut [u8], count: u8) -> Result<()> {
            let width = lanes::width_for(count.saturating_sub(1) as u64);
            let mut words = lanes::pack_bytes(x, width);
            let lane_min = UserOperation::commutative(move |a, b| {
                let a: &[u64] = a.downcast().expect("u64 words");
                let b: &mut [u64] = b.downcast().expect("u64 words");
                lanes::min_lanes(b, a, width);
            });
            self.reduce(&mut words, &lane_min, collective::levels_bytes(x.len(), count));
            lanes::unpack_into(&words, width, x, |v| v as u8)?;
            Ok(())
        }

        fn sum_codes(&mut self, x: &mut [i32], lo: i32, hi: i32) -> Result<()> {
            let span = (hi as i64 - lo as i64) as u64;
            let total = span.checked_mul(self.size as u64).filter(|&t| t <= i32::MAX as u64).ok_or_else(|| {
                Error::InvalidParam { key: "workers".into(), problem: format!("{} workers overflow a sum of codes in {lo}..={hi}", self.size) }
            })?;
            let width = lanes::width_for(total);
            let mut words = lanes::pack_slice(x, width, |v| (v as i64 - lo as i64) as u64);
            self.reduce(&mut words, SystemOperation::sum(), collective::codes_bytes(x.len(), lo, hi, self.size));
            let base = lo as i64 * self.size as i64;
            lanes::unpack_codes(&words, width, base, x)?;
            Ok(())
        }

        fn sum_packed(&mut self, words: &mut [u64], n: usize, lo: i32, hi: i32, _: u32, width: u32) -> Result<()> {
            // Lanes already wide enough for every rank's sum: MPI adds the words.
            if collective::sum_width(lo, hi, self.size) != Some(width) || words.len() != lanes::words_for(n, width) {
                return Err(Error::Internal(format!("{n} codes in {} words of {width}-bit lanes cannot hold {} ranks' sum of {lo}..={hi}", words.len(), self.size)));
            }
            self.reduce(words, SystemOperation::sum(), collective::codes_bytes(n, lo, hi, self.size));
            Ok(())
        }
    }
}

#[cfg(not(feature = "mpi"))]
mod imp {
    use crate::error::{Error, Result};
    use crate::quant::collective::Collective;

    /// The stand-in of a build without MPI: joining says how to get it.
    pub struct World {
        never: std::convert::Infallible,
    }

    impl World {
        pub fn join() -> Result<World> {
            Err(Error::Store(
                "'dist_sync_allreduce' needs gradpack built with MPI, and this build has none (the wheels carry no MPI): \
                 build gradpack from source against the Open MPI your mpirun belongs to (Debian: apt-get install \
                 libopenmpi-dev openmpi-bin libclang-dev; then GRADPACK_MPI=1 pip install --no-binary gradpack gradpack, \
                 or pip install . in a checkout; in Rust: Cargo feature `mpi`)"
                    .into(),
            ))
        }
        pub fn rank(&self) -> usize {
            match self.never {}
        }
        pub fn size(&self) -> usize {
            match self.never {}
        }
        pub fn bytes_sent(&self) -> u64 {
            match self.never {}
        }
        pub fn barrier(&self) {
            match self.never {}
        }
        pub fn broadcast_f32(&self, _: &mut [f32]) {
            match self.never {}
        }
        pub fn broadcast_u64(&self, _: &mut [u64]) {
            match self.never {}
        }
    }

    impl Collective for &World {
        fn workers(&self) -> usize {
            match self.never {}
        }
        fn max_f32(&mut self, _: &mut [f32]) -> Result<()> {
            match self.never {}
        }
        fn sum_f32(&mut self, _: &mut [f32]) -> Result<()> {
            match self.never {}
        }
        fn min_u8(&mut self, _: &mut [u8], _: u8) -> Result<()> {
            match self.never {}
        }
        fn sum_codes(&mut self, _: &mut [i32], _: i32, _: i32) -> Result<()> {
            match self.never {}
        }
    }
}

pub use imp::World;

/// Whether this build can join an MPI job.
pub const AVAILABLE: bool = cfg!(feature = "mpi");

/// The name MXNet gives its MPI store.
/// `kvstore::STORE_TYPES`'s name for this store (MXNet's).
pub const TYPE_NAME: &str = "dist_sync_allreduce";

/// The operations whose agreement `check_agree` checks; each has its own
/// tag, so that one worker's init can never pair with another's push.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Init = 1,
    Push = 2,
    Close = 3,
    Barrier = 4,
}

/// What every worker must agree on before a collective: one record of fixed
/// width, whatever the operation.
#[derive(Clone, Copy, Debug)]
pub struct Agreement {
    pub op: Op,
    pub key_hash: u64,
    pub size: u64,
    /// Pushes of the key so far.
    pub step: u64,
    /// This worker's own checks passed.
    pub ok: bool,
    /// `fingerprint` of the compression parameters.
    pub compression: u64,
    /// `fingerprint` of the optimizer configuration (0: none).
    pub optimizer: u64,
}

/// A stable 64-bit fingerprint of a configuration's text.
pub fn fingerprint(text: &str) -> u64 {
    u64::from_le_bytes(blake3::hash(text.as_bytes()).as_bytes()[..8].try_into().unwrap())
}

impl Agreement {
    const FIELDS: [&'static str; 7] = ["operation", "key", "size", "push count", "", "compression", "optimizer"];

    fn values(&self) -> [u64; 7] {
        [self.op as u64, self.key_hash, self.size, self.step, self.ok as u64, self.compression, self.optimizer]
    }
}

/// Checks that every worker holds the same `Agreement` before the
/// collectives that depend on it, in one MAX reduction of its fields and
/// their negations (16-bit pieces, exact in float32; always the same width,
/// so mismatched operations never pair up or truncate). A mismatch, or a
/// worker whose own checks failed, is an error on every worker that names
/// what differs, never a hang or garbage. A worker must call it even when
/// its own checks failed.
pub fn check_agree(world: &World, what: &str, mine: &Agreement) -> Result<()> {
    check_agree_or_closed(world, what, mine).map_err(|(e, _)| e)
}

/// As `check_agree`; the error also says whether another worker was closing
/// its store (so this one takes part in no more collectives either).
pub fn check_agree_or_closed(world: &World, what: &str, mine: &Agreement) -> std::result::Result<(), (Error, bool)> {
    let values = mine.values();
    let (max, differs) = crate::quant::collective::compare_fields(&mut &*world, &values).map_err(|e| (e, false))?;
    let differs: Vec<&str> = differs.into_iter().map(|f| Agreement::FIELDS[f]).collect();
    if differs.is_empty() {
        return Ok(());
    }
    let named: Vec<&str> = differs.iter().copied().filter(|f| !f.is_empty()).collect();
    // The operation tag is field 0.
    let closing = max[0] == Op::Close as u64 && mine.op != Op::Close;
    let why = if closing {
        "another worker closed its store, so this operation can never complete; every worker must init and push the same keys as often as the others".to_string()
    } else if named.contains(&"operation") {
        "another worker is in another operation (an init, a push, a barrier, or closing its store); every worker must init and push the same keys in the same order, and close together".to_string()
    } else if !named.is_empty() {
        format!("the workers' {} differ; every worker must init and push the same keys, with the same shapes, compression and optimizer, in the same order", named.join(", "))
    } else {
        "another worker's own checks failed (its error says why)".to_string()
    };
    Err((Error::Store(format!("workers disagree on {what} (rank {}): {why}", world.rank())), closing || mine.op == Op::Close))
}
