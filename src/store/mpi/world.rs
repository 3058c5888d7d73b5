//! The MPI store's transport (`dist_sync_allreduce`, MXNet's name for
//! its MPI store): no servers; every worker reduces through MPI collectives
//! and updates its own replica. Open MPI, loaded when the first store opens
//! (`openmpi`: the one the `mpirun` on PATH belongs to), behind the Cargo
//! feature `mpi`, which needs nothing at build time; without it
//! `World::join` says how to get it.
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
use crate::key::Key;
use crate::quant::collective::Collective;
use crate::quant::engine::Lanes;

#[cfg(feature = "mpi")]
mod imp {
    use std::ffi::{c_int, c_void};
    use std::ptr::null_mut;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Mutex, PoisonError};

    use super::super::openmpi::{check, Handle, Mpi, UserFunction, IN_PLACE, THREAD_MULTIPLE};
    use crate::error::{Error, Result};
    use crate::quant::engine::{Buffer, Engine, ReduceOp};
    use crate::quant::lanes;

    /// Open MPI once loaded and initialised by this process (by the first
    /// join), and then either the lane-MIN operations by lane width (index
    /// 1..=8) or why this MPI cannot serve (every later join gets the same
    /// error). It stays for the life of the process: the exit hook
    /// finalises MPI.
    struct Session {
        mpi: &'static Mpi,
        lane_min: std::result::Result<[Handle; 9], String>,
    }

    // SAFETY: the handles are Open MPI objects valid until MPI_Finalize (at
    // exit), used under MPI_THREAD_MULTIPLE (checked when initialising).
    unsafe impl Send for Session {}

    static SESSION: Mutex<Option<Session>> = Mutex::new(None);

    extern "C" {
        fn atexit(cb: extern "C" fn()) -> c_int;
    }

    extern "C" fn finalize_at_exit() {
        let session = SESSION.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(s) = session.as_ref() {
            let mut done: c_int = 0;
            // SAFETY: this hook is registered only after MPI_Init_thread
            // succeeded; MPI_Finalized may be called at any time.
            unsafe {
                if (s.mpi.finalized)(&mut done) == 0 && done == 0 {
                    (s.mpi.finalize)();
                }
            }
        }
    }

    /// MPI's callback for a lane-wise MIN of `*len` words of `W`-bit lanes.
    ///
    /// # Safety
    /// MPI calls it with `*len` u64 words at `invec` and at `inout`, distinct
    /// buffers: the operation is only used on MPI_UINT64_T data (`min_u8`).
    unsafe extern "C" fn lane_min<const W: u32>(invec: *mut c_void, inout: *mut c_void, len: *mut c_int, _: *mut Handle) {
        // SAFETY: the function's contract.
        let (a, b) = unsafe {
            let n = usize::try_from(*len).unwrap_or(0);
            (std::slice::from_raw_parts(invec as *const u64, n), std::slice::from_raw_parts_mut(inout as *mut u64, n))
        };
        lanes::min_lanes(b, a, W);
    }

    const LANE_MIN: [UserFunction; 8] = [lane_min::<1>, lane_min::<2>, lane_min::<3>, lane_min::<4>, lane_min::<5>, lane_min::<6>, lane_min::<7>, lane_min::<8>];

    fn session() -> Result<(&'static Mpi, [Handle; 9])> {
        let mut slot = SESSION.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(s) = slot.as_ref() {
            return s.lane_min.clone().map(|ops| (s.mpi, ops)).map_err(Error::Store);
        }
        let mpi: &'static Mpi = Box::leak(Box::new(Mpi::load()?));
        let (mut initialized, mut finalized) = (0, 0);
        // SAFETY: both may be called before MPI_Init, with a pointer to one int.
        unsafe {
            check("MPI_Initialized", (mpi.initialized)(&mut initialized))?;
            check("MPI_Finalized", (mpi.finalized)(&mut finalized))?;
        }
        if initialized != 0 || finalized != 0 {
            return Err(Error::Store(format!("MPI ({}) was already initialised (or finalised) by someone else in this process", mpi.library)));
        }
        let mut level: c_int = 0;
        // SAFETY: MPI-2 allows null argc and argv; `level` is one int.
        check("MPI_Init_thread", unsafe { (mpi.init_thread)(null_mut(), null_mut(), THREAD_MULTIPLE, &mut level) })
            .map_err(|e| Error::Store(format!("{e} ({}, {})", mpi.library, mpi.version)))?;
        // SAFETY: registering a plain extern "C" function with libc's atexit.
        unsafe { atexit(finalize_at_exit) };
        let lane_min = if level < THREAD_MULTIPLE {
            Err(format!("{} ({}) grants thread level {level}; gradpack needs MPI_THREAD_MULTIPLE ({THREAD_MULTIPLE})", mpi.library, mpi.version))
        } else {
            let mut ops = [null_mut(); 9];
            LANE_MIN
                .iter()
                .enumerate()
                // SAFETY: each function has MPI_User_function's signature; commute = 1.
                .try_for_each(|(i, f)| check("MPI_Op_create", unsafe { (mpi.op_create)(*f, 1, &mut ops[i + 1]) }))
                .map(|()| ops)
                .map_err(|e| e.to_string())
        };
        let session = slot.insert(Session { mpi, lane_min });
        session.lane_min.clone().map(|ops| (mpi, ops)).map_err(Error::Store)
    }

    /// A communicator of this store's own (MPI_Comm_dup), used under a lock.
    struct Comm(Handle);
    // SAFETY: an Open MPI communicator may be used from any thread under
    // MPI_THREAD_MULTIPLE; the World's mutex orders the uses.
    unsafe impl Send for Comm {}

    /// This process's place in the MPI job.
    pub struct World {
        mpi: &'static Mpi,
        lane_min: [Handle; 9],
        comm: Mutex<Comm>,
        rank: usize,
        size: usize,
        sent: AtomicU64,
    }

    // SAFETY: see Session and Comm: every use of the communicator goes
    // through the mutex, and the operations are immutable MPI objects.
    unsafe impl Send for World {}
    unsafe impl Sync for World {}

    impl World {
        pub fn join() -> Result<World> {
            let (mpi, lane_min) = session()?;
            let mut comm: Handle = null_mut();
            let (mut rank, mut size): (c_int, c_int) = (0, 0);
            // SAFETY: MPI is initialised; each pointer is to one handle or int.
            // The duplicate keeps the store's collectives from ever matching
            // anyone else's on COMM_WORLD.
            unsafe {
                check("MPI_Comm_dup", (mpi.comm_dup)(mpi.comm_world, &mut comm))?;
                check("MPI_Comm_rank", (mpi.comm_rank)(comm, &mut rank))?;
                check("MPI_Comm_size", (mpi.comm_size)(comm, &mut size))?;
            }
            let (rank, size) = (usize::try_from(rank), usize::try_from(size));
            let (Ok(rank), Ok(size)) = (rank, size) else {
                return Err(Error::Store("MPI gave a negative rank or size".into()));
            };
            Ok(World { mpi, lane_min, comm: Mutex::new(Comm(comm)), rank, size, sent: AtomicU64::new(0) })
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

        /// Rank 0's `x` everywhere.
        pub fn broadcast_f32(&self, x: &mut [f32]) -> Result<()> {
            let count = count(x.len())?;
            if self.rank == 0 {
                self.sent.fetch_add(4 * x.len() as u64, Ordering::Relaxed);
            }
            let comm = self.comm.lock().unwrap_or_else(PoisonError::into_inner);
            // SAFETY: `x` holds `count` floats (MPI_FLOAT), written in place.
            check("MPI_Bcast", unsafe { (self.mpi.bcast)(x.as_mut_ptr().cast(), count, self.mpi.float, 0, comm.0) })
        }

        /// MPI_Allreduce in place of `count` elements of `datatype` at `x`.
        /// `bytes`: what this rank hands MPI.
        ///
        /// # Safety
        /// `x` points to `count` writable elements of `datatype`, and `op`
        /// applies to that datatype.
        unsafe fn reduce(&self, x: *mut c_void, count: c_int, datatype: Handle, op: Handle, bytes: u64) -> Result<()> {
            self.sent.fetch_add(bytes, Ordering::Relaxed);
            let comm = self.comm.lock().unwrap_or_else(PoisonError::into_inner);
            // SAFETY: the caller's.
            check("MPI_Allreduce", unsafe { (self.mpi.allreduce)(IN_PLACE, x, count, datatype, op, comm.0) })
        }

        fn reduce_f32(&self, x: &mut [f32], op: Handle) -> Result<()> {
            // SAFETY: `x` holds that many floats; SUM and MAX apply to MPI_FLOAT.
            unsafe { self.reduce(x.as_mut_ptr().cast(), count(x.len())?, self.mpi.float, op, std::mem::size_of_val(x) as u64) }
        }

        fn reduce_u64(&self, x: &mut [u64], op: Handle) -> Result<()> {
            // SAFETY: `x` holds that many words; SUM and the lane MINs apply to MPI_UINT64_T.
            unsafe { self.reduce(x.as_mut_ptr().cast(), count(x.len())?, self.mpi.uint64, op, std::mem::size_of_val(x) as u64) }
        }
    }

    /// An element count as MPI takes it (an int).
    fn count(n: usize) -> Result<c_int> {
        c_int::try_from(n).map_err(|_| Error::Store(format!("{n} elements in one MPI call: MPI counts are ints (at most {})", c_int::MAX)))
    }

    impl Engine for &World {
        fn all_reduce(&mut self, op: ReduceOp, buf: Buffer<'_>) -> Result<()> {
            match (op, buf) {
                (ReduceOp::Sum, Buffer::F32(x)) => self.reduce_f32(x, self.mpi.sum),
                (ReduceOp::Max, Buffer::F32(x)) => self.reduce_f32(x, self.mpi.max),
                (ReduceOp::Sum, Buffer::U64(x)) => self.reduce_u64(x, self.mpi.sum),
                (ReduceOp::LaneMin(width), Buffer::U64(x)) if (1..=8).contains(&width) => self.reduce_u64(x, self.lane_min[width as usize]),
                (op, _) => Err(Error::Internal(format!("the MPI store has no all-reduce {op:?} of this buffer"))),
            }
        }

        fn lane_min(&self) -> bool {
            true
        }
    }
}

#[cfg(not(feature = "mpi"))]
mod imp {
    use crate::error::{Error, Result};
    use crate::quant::engine::{Buffer, Engine, ReduceOp};

    /// The stand-in of a build without MPI: joining says how to get it.
    pub struct World {
        never: std::convert::Infallible,
    }

    impl World {
        pub fn join() -> Result<World> {
            Err(Error::Store(
                "'dist_sync_allreduce' needs gradpack built with the Cargo feature `mpi` (on by default in `pip install .` \
                 and in the wheels; it loads Open MPI at run time)"
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
        pub fn broadcast_f32(&self, _: &mut [f32]) -> Result<()> {
            match self.never {}
        }
    }

    impl Engine for &World {
        fn all_reduce(&mut self, _: ReduceOp, _: Buffer<'_>) -> Result<()> {
            match self.never {}
        }
    }
}

pub use imp::World;

impl World {
    /// The schemes' reductions over this world (`quant::engine`).
    pub fn lanes(&self) -> Lanes<&World> {
        Lanes::new(self, self.size())
    }
}

/// The operations whose agreement `check_agree` checks; each has its own
/// tag, so that one worker's init can never pair with another's push.
/// Close is the largest: the agreement's MAX shows a closing worker to
/// every other, whatever operation they are in (a barrier hid it, and the
/// job hung at exit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Init = 1,
    Push = 2,
    /// The caller's updater, applied after a push's sum: agreed again, as
    /// it may fail on one worker alone.
    Update = 3,
    Barrier = 4,
    Close = 5,
}

/// What every worker must agree on before a collective: one record of fixed
/// width, whatever the operation.
#[derive(Clone, Copy, Debug)]
pub struct Agreement {
    pub op: Op,
    /// `key_hash`: the key, its kind (int or str) included.
    pub key_hash: u64,
    /// `shape_hash` of the key's shape (dimensions, not only their product).
    pub shape: u64,
    /// Pushes of the key so far.
    pub step: u64,
    /// This worker's own checks passed.
    pub ok: bool,
    /// `fingerprint` of the compression parameters.
    pub compression: u64,
    /// `fingerprint` of the optimizer configuration (0: none).
    pub optimizer: u64,
}

impl Agreement {
    const FIELDS: [&'static str; 7] = ["operation", "key", "shape", "push count", "", "compression", "optimizer"];
    /// The index of `ok` in `FIELDS`: a worker's own checks, named by its error.
    const OK: usize = 4;

    fn values(&self) -> [u64; 7] {
        [self.op as u64, self.key_hash, self.shape, self.step, self.ok as u64, self.compression, self.optimizer]
    }

    /// An agreement that names no key (a barrier, a close).
    pub fn plain(op: Op) -> Agreement {
        Agreement { op, key_hash: 0, shape: 0, step: 0, ok: true, compression: 0, optimizer: 0 }
    }
}

/// The key as the agreement compares it: its kind and its bytes (the
/// int key whose 8 bytes spell "weight00" and the str key "weight00" have
/// one `stable_hash`, and were reduced together).
pub fn key_hash(key: &Key) -> u64 {
    crate::hash::fingerprint(&format!("{key:?}"))
}

/// The shape as the agreement compares it: (4, 6) and (24,) hold as many
/// values, but not the same tensor (PowerSGD's factors differ, and the job
/// aborted).
pub fn shape_hash(shape: &[usize]) -> u64 {
    crate::hash::fingerprint(&format!("{shape:?}"))
}

/// Checks that every worker holds the same `Agreement` before the
/// collectives that depend on it, in one MAX reduction of its fields and
/// their negations (16-bit pieces, exact in float32; always the same width,
/// so mismatched operations never pair up or truncate). A mismatch, or a
/// worker whose own checks failed, is an error on every worker that names
/// what differs, never a hang or garbage. A worker must call it even when
/// its own checks failed, with their error (`failed`): the other workers'
/// error then carries the cause (of the lowest such rank), as a parameter
/// server's workers get the cause of another's failed push.
pub fn check_agree(world: &World, what: &str, mine: &Agreement, failed: Option<&str>) -> Result<()> {
    check_agree_or_closed(world, what, mine, failed).map_err(|(e, _)| e)
}

/// As `check_agree`; the error also says whether another worker was closing
/// its store (so this one takes part in no more collectives either).
pub fn check_agree_or_closed(world: &World, what: &str, mine: &Agreement, failed: Option<&str>) -> std::result::Result<(), (Error, bool)> {
    let values = mine.values();
    let (max, differs) = crate::quant::collective::compare_fields(&mut world.lanes(), &values).map_err(|e| (e, false))?;
    // Some worker's own checks failed, and not every worker's: every worker
    // (each sees the same `differs`) takes part in sharing the cause.
    let cause = if differs.contains(&Agreement::OK) { Some(first_failure(world, failed.filter(|_| !mine.ok)).map_err(|e| (e, false))?) } else { None };
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
        "another worker's own checks failed".to_string()
    };
    let why = match cause {
        Some((rank, cause)) => format!("{why}; worker rank {rank}: {cause}"),
        None => why,
    };
    Err((Error::Store(format!("workers disagree on {what} (rank {}): {why}", world.rank())), closing || mine.op == Op::Close))
}

/// The longest cause `first_failure` carries, in bytes.
const CAUSE_BYTES: usize = 1000;

/// The lowest rank among the workers whose own checks failed, and its error
/// (`failed`, cut at `CAUSE_BYTES`), for every worker: two MAX reductions,
/// the rank's, then its error's bytes from that rank alone (each a float32,
/// exact). Every worker calls it; the others pass None.
fn first_failure(world: &World, failed: Option<&str>) -> Result<(usize, String)> {
    let size = world.size();
    let mut first = [failed.map_or(0.0, |_| (size - world.rank()) as f32)];
    world.lanes().max_f32(&mut first)?;
    let rank = size.checked_sub(first[0] as usize).filter(|&r| first[0] >= 1.0 && r < size).ok_or_else(|| Error::Internal(format!("no failed rank in {}", first[0])))?;
    let mut text = vec![0f32; 1 + CAUSE_BYTES];
    if let (Some(cause), true) = (failed, rank == world.rank()) {
        let mut end = cause.len().min(CAUSE_BYTES);
        while !cause.is_char_boundary(end) {
            end -= 1;
        }
        text[0] = end as f32;
        text[1..=end].iter_mut().zip(cause.bytes()).for_each(|(t, b)| *t = b as f32);
    }
    world.lanes().max_f32(&mut text)?;
    let len = (text[0] as usize).min(CAUSE_BYTES);
    let bytes: Vec<u8> = text[1..=len].iter().map(|&b| b as u8).collect();
    Ok((rank, String::from_utf8_lossy(&bytes).into_owned()))
}
