//! C ABI of `group`: compression for a process group whose all-reduces the
//! caller performs (gradpack.torch over torch.distributed).

use std::ffi::{c_char, c_int, c_void};
use std::sync::{Mutex, MutexGuard};

use super::{cstr, guard, params};
use crate::boundary::{slice, slice_mut, Raw};
use crate::quant::compression::Compression;
use crate::error::{Error, Result};
use crate::store::checks::elements;
use crate::store::group::{Buffer, Engine, Exchange, Group, Own, Pending, ReduceOp, Tensor};
use crate::key::Key;

/// A process group's compression on one rank (`group::Group`).
#[allow(non_camel_case_types)]
pub struct gp_group_t(Group);

/// A bucket between `gp_group_encode` and `gp_group_decode`: one call at
/// a time reads or changes it (calls from several threads wait in turn:
/// gp_group_check beside gp_group_decode_held reads what the decode frees).
#[allow(non_camel_case_types)]
pub struct gp_pending_t(Mutex<Pending>);

/// The pending bucket behind `p`, locked for this call.
///
/// # Safety
/// `p` is NULL or a live pending bucket (gp_group_encode's, not freed).
unsafe fn pending<'a>(p: *const gp_pending_t) -> Result<MutexGuard<'a, Pending>> {
    // SAFETY: the caller's precondition: `p` is NULL (refused here) or live.
    let p = unsafe { p.as_ref() }.ok_or(Error::NullPointer { what: "pending" })?;
    Ok(p.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
}

/// The pending bucket behind `p`, taken back from the caller.
///
/// # Safety
/// `p` is NULL or a live pending bucket, which the caller no longer uses.
unsafe fn take_pending(p: *mut gp_pending_t) -> Result<Pending> {
    if p.is_null() {
        return Err(Error::NullPointer { what: "pending" });
    }
    // SAFETY: the caller's precondition: `p` came from Box::into_raw in
    // gp_group_encode and is handed back once.
    let b = unsafe { Box::from_raw(p) };
    Ok(b.0.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner))
}

/// The caller's blocking collective over the group: `op` 0 SUM, 1 MAX, 2
/// bitwise OR, all-reduced in place; `dtype` 0 float32, 1 64-bit words
/// (summed as int64: a wrapping sum is exact); `data` holds `len`
/// elements, valid only during the call. Ops on words only (the owners
/// exchange): 3, all-to-all: `data` holds `len` words to send, cut in
/// `world` equal chunks (chunk r to rank r), followed by `len` words that
/// receive (chunk j from rank j); 4, all-gather: `data` holds `world`
/// chunks of `len / world` words, this rank's filled at its rank, the others
/// filled by the call. Returns 0, or nonzero when the collective failed
/// (the caller keeps its own error).
#[allow(non_camel_case_types)]
pub type gp_reduce_fn = Option<unsafe extern "C" fn(user: *mut c_void, op: c_int, dtype: c_int, data: *mut c_void, len: u64) -> c_int>;

struct Callback {
    f: unsafe extern "C" fn(*mut c_void, c_int, c_int, *mut c_void, u64) -> c_int,
    user: *mut c_void,
    /// This rank in the group (where its all-gather chunk lies).
    rank: usize,
}

impl Engine for Callback {
    fn all_reduce(&mut self, op: ReduceOp, buf: Buffer<'_>) -> Result<()> {
        let op: c_int = match op {
            ReduceOp::Sum => 0,
            ReduceOp::Max => 1,
            ReduceOp::Or => 2,
            ReduceOp::LaneMin(_) => return Err(Error::Internal("the caller's engine has no lane-wise MIN".into())),
        };
        let (dtype, data, len) = match buf {
            Buffer::F32(x) => (0, x.as_mut_ptr().cast::<c_void>(), x.len()),
            Buffer::U64(x) => (1, x.as_mut_ptr().cast::<c_void>(), x.len()),
        };
        // SAFETY: `data` is valid for `len` elements of `dtype` for the whole
        // call (a live mutable slice); the callback is the caller's, as
        // gp_group_encode's contract describes.
        let status = unsafe { (self.f)(self.user, op, dtype, data, len as u64) };
        if status != 0 {
            return Err(Error::Transport(format!("the caller's all-reduce failed (status {status})")));
        }
        Ok(())
    }

    fn all_to_all(&mut self, send: &[u64], recv: &mut [u64]) -> Result<()> {
        // The callback takes one buffer: what is sent, then what arrives.
        let mut both = Vec::with_capacity(2 * send.len());
        both.extend_from_slice(send);
        both.resize(2 * send.len(), 0);
        self.words(3, &mut both, send.len(), "all-to-all")?;
        recv.copy_from_slice(&both[send.len()..]);
        Ok(())
    }

    fn all_gather(&mut self, mine: &[u64], out: &mut [u64]) -> Result<()> {
        if mine.is_empty() || !out.len().is_multiple_of(mine.len()) {
            return Err(Error::Internal(format!("an all-gather of {} words into {}", mine.len(), out.len())));
        }
        let (rank, len) = (self.rank, out.len());
        out.iter_mut().for_each(|w| *w = 0);
        out.get_mut(rank * mine.len()..(rank + 1) * mine.len()).ok_or_else(|| Error::Internal(format!("rank {rank} of an all-gather into {len} words")))?.copy_from_slice(mine);
        self.words(4, out, len, "all-gather")
    }
}

impl Callback {
    /// Hands the caller an op on words: `len` as the op's contract says.
    fn words(&mut self, op: c_int, data: &mut [u64], len: usize, what: &str) -> Result<()> {
        // SAFETY: `data` is a live mutable slice for the whole call, as long
        // as op `op` reads and writes (`gp_reduce_fn`'s contract).
        let status = unsafe { (self.f)(self.user, op, 1, data.as_mut_ptr().cast::<c_void>(), len as u64) };
        if status != 0 {
            return Err(Error::Transport(format!("the caller's {what} failed (status {status})")));
        }
        Ok(())
    }
}

/// The group behind `g`.
///
/// # Safety
/// `g` is NULL or from gp_group_new and not freed, for `'a`.
unsafe fn group<'a>(g: *const gp_group_t) -> Result<&'a Group> {
    // SAFETY: the caller's precondition: `g` is NULL (refused here) or live.
    unsafe { g.as_ref() }.map(|g| &g.0).ok_or(Error::NullPointer { what: "group" })
}

/// Creates the compression of rank `rank` of `world` from `compress_params`
/// (`num` key/value strings, as gp_kvstore_set_compress takes them):
/// tensors are summed plainly for their first `start_iter` pushes, and a
/// tensor is compressed only when its bytes shrink at least
/// `min_compression_rate` times. `exchange` ("lanes", "owners" or "auto";
/// NULL: "lanes") says how compressed buckets travel (`group::Exchange`).
/// `*out` owns the handle (gp_group_free).
///
/// # Safety
/// `keys`/`vals` point to `num` NUL-terminated strings each; `exchange` is
/// NULL or NUL-terminated; `out` is writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn gp_group_new(keys: *const *const c_char, vals: *const *const c_char, num: c_int, rank: u64, world: u64, start_iter: u64, min_compression_rate: f64, exchange: *const c_char, out: *mut *mut gp_group_t) -> c_int {
    guard(|| {
        if out.is_null() {
            return Err(Error::NullPointer { what: "out" });
        }
        let compression = Compression::from_params(params(keys, vals, num)?.iter().copied())?;
        let exchange = if exchange.is_null() { Exchange::Lanes } else { Exchange::parse(cstr(exchange, "exchange")?)? };
        let (rank, world) = (usize::try_from(rank).unwrap_or(usize::MAX), usize::try_from(world).unwrap_or(usize::MAX));
        let g = Group::new(compression, rank, world, start_iter, min_compression_rate)?.with_exchange(exchange)?;
        *out = Box::into_raw(Box::new(gp_group_t(g)));
        Ok(())
    })
}

/// Releases a group (no call may use it afterwards; pending buckets keep
/// what they need and may still be freed).
///
/// # Safety
/// `g` is NULL or from gp_group_new, not freed before.
#[no_mangle]
pub unsafe extern "C" fn gp_group_free(g: *mut gp_group_t) {
    if !g.is_null() {
        drop(Box::from_raw(g));
    }
}

/// Checks a bucket with every rank and runs its exchanges through
/// `reduce` (called on this thread, every rank in the same order). The
/// bucket holds `num` tensors one after another: tensor `i` has key
/// `keys[i]` and `ndims[i]` dimensions, taken in turn from `dims`;
/// `bucket_len` float32 elements in all. `last`: the bucket ends a step
/// (counted in the stats). `tag`: what else every rank must hold alike for
/// this bucket (0: nothing; FSDP2's reduce op and divide factor), compared
/// as the settings are. On success `*out` owns the pending bucket and
/// `*words`.. `*plain` show its buffers, as gp_pending_buffers does: SUM them
/// on every rank (words first), then gp_group_decode. (After the owners
/// exchange, which ran here, no words are left to sum.) On error no state
/// changed.
///
/// # Safety
/// Every pointer is valid for its stated length; `reduce` is callable with
/// `user` during the call.
#[no_mangle]
pub unsafe extern "C" fn gp_group_encode(
    g: *const gp_group_t,
    num: u64,
    keys: *const *const c_char,
    ndims: *const u64,
    dims: *const u64,
    bucket: *const f32,
    bucket_len: u64,
    last: c_int,
    tag: u64,
    reduce: gp_reduce_fn,
    user: *mut c_void,
    out: *mut *mut gp_pending_t,
    words: *mut *mut u64,
    num_words: *mut u64,
    floats: *mut *mut f32,
    num_floats: *mut u64,
    plain: *mut c_int,
) -> c_int {
    guard(|| {
        let group = group(g)?;
        let f = reduce.ok_or(Error::NullPointer { what: "reduce" })?;
        if out.is_null() || words.is_null() || num_words.is_null() || floats.is_null() || num_floats.is_null() || plain.is_null() {
            return Err(Error::NullPointer { what: "an output" });
        }
        Raw::new("bucket", bucket, bucket_len)?;
        let tensors = read_tensors(num, keys, ndims, dims, Some(slice(bucket, bucket_len)))?;
        let rank = group.rank();
        let mut p = group.encode(&tensors, bucket_len as usize, last != 0, tag, &mut Callback { f, user, rank })?;
        (*words, *num_words) = (p.words.as_mut_ptr(), p.words_to_sum().len() as u64);
        (*floats, *num_floats) = (p.floats.as_mut_ptr(), p.floats.len() as u64);
        *plain = p.plain as c_int;
        // (The buffers are the Vecs' own heap memory: moving `p` keeps them where they are.)
        *out = Box::into_raw(Box::new(gp_pending_t(Mutex::new(p))));
        Ok(())
    })
}

/// The tensors `num`, `keys`, `ndims` and `dims` name (gp_group_encode's
/// arguments), their gradients cut from `bucket` one after another, or
/// empty without one (gp_group_refuse).
///
/// # Safety
/// As gp_group_encode's.
unsafe fn read_tensors<'a>(num: u64, keys: *const *const c_char, ndims: *const u64, dims: *const u64, bucket: Option<&'a [f32]>) -> Result<Vec<Tensor<'a>>> {
    Raw::new("keys", keys, num)?;
    Raw::new("ndims", ndims, num)?;
    let ndims = slice(ndims, num);
    if let Some(d) = ndims.iter().find(|&&d| d > 32) {
        return Err(Error::InvalidParam { key: "ndims".into(), problem: format!("{d} dimensions (at most 32)") });
    }
    let total_dims: u64 = ndims.iter().sum();
    Raw::new("dims", dims, total_dims)?;
    let dims = slice(dims, total_dims);
    let (mut tensors, mut d, mut at) = (Vec::with_capacity(num as usize), 0usize, 0usize);
    for (i, &nd) in ndims.iter().enumerate() {
        let key = cstr(*keys.add(i), "key")?;
        if key.is_empty() {
            return Err(Error::InvalidParam { key: "keys".into(), problem: format!("tensor {i}'s key is empty (a key names a tensor's state)") });
        }
        let key = Key::Str(key.to_string());
        key.check()?;
        let shape: Vec<usize> = dims[d..d + nd as usize].iter().map(|&x| usize::try_from(x).unwrap_or(usize::MAX)).collect();
        d += nd as usize;
        let grad = match bucket {
            Some(bucket) => {
                let n = elements(&shape).ok().filter(|&n| at.checked_add(n).is_some_and(|end| end <= bucket.len()));
                let n = n.ok_or_else(|| Error::InvalidParam { key: "dims".into(), problem: format!("tensor {i} of shape {shape:?} does not fit a bucket of {} elements after {at}", bucket.len()) })?;
                at += n;
                &bucket[at - n..at]
            }
            None => &[],
        };
        tensors.push(Tensor { key, shape, grad });
    }
    Ok(tensors)
}

/// This rank's part in a bucket its caller refused before encoding it
/// (`refusal`: 1 its dtype, 2 its device, 3 memory its elements share, 4
/// a key, 5 sizes that do not hold the tensors named, 6 ranks of its node
/// that disagree (gradpack.torch's hierarchical exchange); `index`: the
/// tensor), so that no other rank waits: runs the bucket's agreement, or
/// stand-ins of the bucket every rank expects, through `reduce` as
/// gp_group_encode would, and always returns -1 with the error every
/// rank of the bucket gets (the others from their gp_group_encode or
/// gp_group_decode). `num`, `keys`, `ndims` and `dims` name the bucket as
/// far as the caller could read it. Nothing changes.
///
/// # Safety
/// As gp_group_encode's.
#[no_mangle]
pub unsafe extern "C" fn gp_group_refuse(g: *const gp_group_t, num: u64, keys: *const *const c_char, ndims: *const u64, dims: *const u64, refusal: c_int, index: u64, reduce: gp_reduce_fn, user: *mut c_void) -> c_int {
    guard(|| {
        let group = group(g)?;
        let f = reduce.ok_or(Error::NullPointer { what: "reduce" })?;
        let own = u32::try_from(refusal).ok().and_then(Own::refusal).ok_or_else(|| Error::InvalidParam { key: "refusal".into(), problem: format!("{refusal} (1 to 6)") })?;
        let tensors = read_tensors(num, keys, ndims, dims, None)?;
        // (Group::refuse refuses an index past the bucket's tensors.)
        let index = usize::try_from(index).unwrap_or(usize::MAX);
        let rank = group.rank();
        Err(group.refuse(&tensors, own, index, &mut Callback { f, user, rank }))
    })
}

/// What the caller SUMs on every rank: `*words` (`*num_words` 64-bit words,
/// as int64) and `*floats` (`*num_floats` float32), both owned by the
/// pending bucket and valid until it is decoded or freed; `*plain` 1 when
/// nothing was compressed and the caller sums its bucket itself instead.
///
/// # Safety
/// `p` is a live pending bucket; every output pointer is writable.
#[no_mangle]
pub unsafe extern "C" fn gp_pending_buffers(p: *mut gp_pending_t, words: *mut *mut u64, num_words: *mut u64, floats: *mut *mut f32, num_floats: *mut u64, plain: *mut c_int) -> c_int {
    guard(|| {
        let mut p = pending(p)?;
        if words.is_null() || num_words.is_null() || floats.is_null() || num_floats.is_null() || plain.is_null() {
            return Err(Error::NullPointer { what: "an output" });
        }
        (*words, *num_words) = (p.words.as_mut_ptr(), p.words_to_sum().len() as u64);
        (*floats, *num_floats) = (p.floats.as_mut_ptr(), p.floats.len() as u64);
        *plain = p.plain as c_int;
        Ok(())
    })
}

/// `Group::decode_held` of `pending` into the caller's `bucket`, checked.
///
/// # Safety
/// `bucket` is valid for `bucket_len` writes.
unsafe fn decode_into(g: *const gp_group_t, pending: &mut Pending, bucket: *mut f32, bucket_len: u64) -> Result<()> {
    let group = group(g)?;
    let b = Raw::new("bucket", bucket, bucket_len)?;
    let w = Raw::new("pending words", pending.words.as_ptr(), pending.words.len() as u64)?;
    let f = Raw::new("pending floats", pending.floats.as_ptr(), pending.floats.len() as u64)?;
    b.check_disjoint(&w)?;
    b.check_disjoint(&f)?;
    group.decode_held(pending, slice_mut(bucket, bucket_len))
}

/// Decodes a pending bucket whose buffers were summed on every rank into
/// `bucket` (`bucket_len` float32: the bucket given to gp_group_encode,
/// holding its float32 sum when the bucket was plain): the sum over ranks
/// divided by the world size, the same on every rank, and advances its
/// states (gp_group_decode_held, then gp_group_commit). Consumes `p`
/// whether or not it succeeds.
///
/// # Safety
/// `p` is a live pending bucket of `g` (not used afterwards); `bucket` is
/// valid for `bucket_len` writes and disjoint from the pending buffers.
#[no_mangle]
pub unsafe extern "C" fn gp_group_decode(g: *const gp_group_t, p: *mut gp_pending_t, bucket: *mut f32, bucket_len: u64) -> c_int {
    guard(|| {
        let mut pending = take_pending(p)?;
        decode_into(g, &mut pending, bucket, bucket_len)?;
        group(g)?.commit(pending)
    })
}

/// gp_group_decode's first half: writes the result and changes no state;
/// `p` stays live (its keys in flight) for gp_group_commit, which advances
/// its states, or gp_pending_free, which leaves them as they were (a
/// caller commits a step's buckets once every one decoded). On error `p`
/// stays live too: free it.
///
/// # Safety
/// As gp_group_decode's, except that `p` stays the caller's.
#[no_mangle]
pub unsafe extern "C" fn gp_group_decode_held(g: *const gp_group_t, p: *mut gp_pending_t, bucket: *mut f32, bucket_len: u64) -> c_int {
    guard(|| decode_into(g, &mut *pending(p)?, bucket, bucket_len))
}

/// Advances the states of a bucket gp_group_decode_held wrote (its
/// residuals, Q and push counts) and returns its keys to the group.
/// Consumes `p` whether or not it succeeds.
///
/// # Safety
/// `p` is a live pending bucket of `g`, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn gp_group_commit(g: *const gp_group_t, p: *mut gp_pending_t) -> c_int {
    guard(|| group(g)?.commit(take_pending(p)?))
}

/// Drops a pending bucket without decoding it (its keys' states return to
/// the group).
///
/// # Safety
/// `p` is NULL or a live pending bucket, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn gp_pending_free(p: *mut gp_pending_t) {
    if !p.is_null() {
        drop(Box::from_raw(p));
    }
}

/// `out[0..6]`: bytes sent, bytes a float32 all-reduce would have sent,
/// steps, compressed steps, blocking agreement rounds, and 1 when
/// compressed buckets take the owners exchange (0: lanes).
///
/// # Safety
/// `out` is writable for 6 values.
#[no_mangle]
pub unsafe extern "C" fn gp_group_stats(g: *const gp_group_t, out: *mut u64) -> c_int {
    guard(|| {
        let s = group(g)?.stats();
        Raw::new("out", out, 6)?;
        slice_mut(out, 6).copy_from_slice(&[s.bytes_sent, s.bytes_uncompressed, s.steps, s.compressed_steps, s.agreements, s.owners as u64]);
        Ok(())
    })
}

/// Every key's compression state in a new buffer `*data` of `*len` bytes,
/// released with gp_buffer_free.
///
/// # Safety
/// `data` and `len` are writable.
#[no_mangle]
pub unsafe extern "C" fn gp_group_save(g: *const gp_group_t, data: *mut *mut u8, len: *mut u64) -> c_int {
    guard(|| {
        if data.is_null() || len.is_null() {
            return Err(Error::NullPointer { what: "data/len" });
        }
        let blob = group(g)?.save()?.into_boxed_slice();
        *len = blob.len() as u64;
        *data = Box::into_raw(blob).cast::<u8>();
        Ok(())
    })
}

/// Replaces every key's state with a blob from gp_group_save; checked
/// whole first, so a refused blob changes nothing.
///
/// # Safety
/// `data` is readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn gp_group_load(g: *const gp_group_t, data: *const u8, len: u64) -> c_int {
    guard(|| {
        Raw::new("data", data, len)?;
        group(g)?.load(slice(data, len))
    })
}

/// Reads the check of a pending bucket whose buffers were summed on every
/// rank, changing nothing: 0, or the error gp_group_decode would return
/// before it writes (the same on every rank). `p` stays live: decode or
/// free it next.
///
/// # Safety
/// `p` is a live pending bucket of `g`.
#[no_mangle]
pub unsafe extern "C" fn gp_group_check(g: *const gp_group_t, p: *const gp_pending_t) -> c_int {
    guard(|| group(g)?.check(&*pending(p)?))
}
