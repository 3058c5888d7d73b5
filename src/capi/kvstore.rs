//! C ABI of every KVStore: an opaque `gp_kvstore_t` handle (a `Box<dyn
//! Store>` from `store::open`, so each call is one trait call) with
//! `_new`/`_free`, keys as `gp_key_t`, arrays as `gp_array_t` descriptors.
//! The caller owns every array; the store copies what it keeps.
#![allow(non_camel_case_types)] // the C names, as c_api.h spells them

use std::ffi::{c_char, c_int, c_void};


use super::{count, cstr, dtype_of, guard, params};
use crate::boundary::{slice, slice_mut, Inputs, Outputs, Raw, RawGrad};
use crate::quant::compression::Compression;
use crate::store::param_server::{self, Config};
use crate::error::{Dtype, Error, Result};
use crate::store::{elements, Key, Store, Updater};

/// Opaque store handle: any store, behind the one `Store` trait.
pub struct gp_kvstore_t(Box<dyn Store>);

/// A key: `str_key` (UTF-8, NUL-terminated) when not NULL, else `int_key`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gp_key_t {
    pub int_key: i64,
    pub str_key: *const c_char,
}

/// A read-only array: `data` of `dtype` (gp_dtype_t) with `ndim` dims in `shape`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gp_array_t {
    pub data: *const c_void,
    pub dtype: c_int,
    pub ndim: c_int,
    pub shape: *const u64,
}

/// A writable float32 array.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gp_array_mut_t {
    pub data: *mut f32,
    pub ndim: c_int,
    pub shape: *const u64,
}

/// Updater callback: `stored` (n floats) is updated in place from `merged`.
/// Returns 0 on success; anything else fails the push.
pub type gp_updater_fn = Option<unsafe extern "C" fn(key: gp_key_t, merged: *const f32, stored: *mut f32, n: u64, user: *mut c_void) -> c_int>;

unsafe fn key_of(k: gp_key_t) -> Result<Key> {
    if k.str_key.is_null() {
        Ok(Key::Int(k.int_key))
    } else {
        Ok(Key::Str(cstr(k.str_key, "key")?.to_string()))
    }
}

unsafe fn shape_of(ndim: c_int, shape: *const u64) -> Result<Vec<usize>> {
    if ndim < 0 {
        return Err(Error::InvalidParam { key: "ndim".into(), problem: format!("must be >= 0, got {ndim}") });
    }
    Raw::new("shape", shape, ndim as u64)?;
    slice(shape, ndim as u64)
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| Error::InvalidParam { key: "shape".into(), problem: format!("dimension {d} does not fit in memory") }))
        .collect()
}

/// A call's input arrays, checked through the one boundary.
///
/// # Safety
/// `arrays` points to `num` arrays whose data are valid for their shapes for
/// `'a`. `outputs` are the outputs of the same call (none exists as a slice yet).
unsafe fn arrays_in<'a>(arrays: *const gp_array_t, num: c_int, outputs: &[Raw]) -> Result<Inputs<'a>> {
    let num = count(num, "num")?;
    Raw::new("values", arrays, num)?;
    let mut inputs = Inputs::new();
    // SAFETY: Raw::new checked the descriptors' span; the caller's contract covers the rest.
    for a in unsafe { slice(arrays, num) } {
        let shape = unsafe { shape_of(a.ndim, a.shape)? };
        let n = elements(&shape)? as u64;
        let data = match dtype_of(a.dtype)? {
            Dtype::F32 => RawGrad::F32(a.data.cast()),
            Dtype::F16 => RawGrad::F16(a.data.cast()),
            Dtype::Bf16 => RawGrad::Bf16(a.data.cast()),
        };
        // SAFETY: the caller's contract: `data` holds `n` elements of its dtype.
        unsafe { inputs.push(shape, data, n, outputs)? };
    }
    Ok(inputs)
}

/// A call's outputs, checked (non-null, in memory, pairwise disjoint) but
/// not yet slices.
///
/// # Safety
/// `arrays` points to `num` arrays (their data are checked when sliced).
unsafe fn arrays_out<'a>(arrays: *const gp_array_mut_t, num: c_int) -> Result<Outputs<'a>> {
    let num = count(num, "num")?;
    Raw::new("outputs", arrays, num)?;
    let mut outputs = Outputs::new();
    // SAFETY: Raw::new checked the descriptors' span; the caller's contract covers the rest.
    for a in unsafe { slice(arrays, num) } {
        let shape = unsafe { shape_of(a.ndim, a.shape)? };
        let n = elements(&shape)? as u64;
        outputs.push(shape, a.data, n)?;
    }
    Ok(outputs)
}

unsafe fn store<'a>(s: *const gp_kvstore_t) -> Result<&'a gp_kvstore_t> {
    s.as_ref().ok_or(Error::NullPointer { what: "store" })
}

fn owned(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// Creates a store of `type`: "local", "device", "dist_sync_allreduce"
/// (joining the MPI job the process was started in, with mpirun), or a worker
/// of "dist_sync", "dist_async", "dist_sync_device", "dist_device_sync"
/// (joining the job that the DMLC_* variables describe; blocks until every
/// node registered): any name of `gp_kvstore_types()`. On
/// success `*out` owns a new handle, released with `gp_kvstore_free` (a
/// worker then leaves the job).
///
/// # Safety
/// `type` is a NUL-terminated string; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn gp_kvstore_new(type_name: *const c_char, out: *mut *mut gp_kvstore_t) -> c_int {
    guard(|| {
        if out.is_null() {
            return Err(Error::NullPointer { what: "out" });
        }
        let store = crate::store::open(cstr(type_name, "type")?)?;
        *out = Box::into_raw(Box::new(gp_kvstore_t(store)));
        Ok(())
    })
}

/// Releases a store (NULL is ignored).
///
/// # Safety
/// `store` came from `gp_kvstore_new` and is not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn gp_kvstore_free(store: *mut gp_kvstore_t) {
    if !store.is_null() {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(Box::from_raw(store))));
    }
}

/// Closes the store without releasing the handle: an all-reduce store
/// closes together with every other worker (one still waiting in an init or
/// push of its own then gets an error instead of waiting forever); a
/// distributed worker leaves its job. Later calls on the store fail;
/// `gp_kvstore_free` still releases it. A second close does nothing.
///
/// # Safety
/// `store` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn gp_kvstore_close(store: *mut gp_kvstore_t) -> c_int {
    guard(|| self::store(store)?.0.close())
}

/// `*out = count(store)`: a counter of the store's (the exports below).
///
/// # Safety
/// `store` is live or NULL (an error); `out` is writable or NULL (an error).
unsafe fn write_count(store: *const gp_kvstore_t, out: *mut u64, count: impl Fn(&dyn Store) -> u64) -> c_int {
    guard(|| {
        if out.is_null() {
            return Err(Error::NullPointer { what: "out" });
        }
        *out = count(&*self::store(store)?.0);
        Ok(())
    })
}

/// Messages a distributed worker received and dropped (unauthenticated,
/// replayed, malformed or unexpected) into `*out`; 0 for other stores.
///
/// # Safety
/// `store` is live; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn gp_kvstore_dropped(store: *const gp_kvstore_t, out: *mut u64) -> c_int {
    write_count(store, out, |s| s.dropped())
}

/// Pulls a distributed worker answered from the values its last scheme
/// rounds brought back, without asking the servers, into `*out`; 0 for
/// other stores.
///
/// # Safety
/// `store` is live; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn gp_kvstore_local_pulls(store: *const gp_kvstore_t, out: *mut u64) -> c_int {
    write_count(store, out, |s| s.local_pulls())
}

/// Every store type gradpack serves, as a static string of `name:kind`
/// entries joined by commas; kind `local`, `allreduce` (MPI) or `dist`
/// (parameter server).
#[no_mangle]
pub extern "C" fn gp_kvstore_types() -> *const c_char {
    static TABLE: std::sync::OnceLock<std::ffi::CString> = std::sync::OnceLock::new();
    TABLE
        .get_or_init(|| {
            let entries: Vec<String> = crate::store::STORE_TYPES
                .iter()
                .map(|(n, k)| {
                    let kind = match k {
                        crate::store::Kind::ParamServer { .. } => "dist",
                        crate::store::Kind::AllReduce => "allreduce",
                        crate::store::Kind::Local | crate::store::Kind::Device => "local",
                    };
                    format!("{}:{kind}", n.to_string_lossy())
                })
                .collect();
            std::ffi::CString::new(entries.join(",")).expect("names have no NUL")
        })
        .as_ptr()
}

/// The store's type name (static string), or NULL for a NULL store.
///
/// # Safety
/// `store` is a live handle or NULL.
#[no_mangle]
pub unsafe extern "C" fn gp_kvstore_type(store: *const gp_kvstore_t) -> *const c_char {
    let Some(store) = store.as_ref() else { return std::ptr::null() };
    let name = store.0.type_name();
    // Every store was made from a name of the table.
    crate::store::store_type(name).map_or(std::ptr::null(), |(c, _)| c.as_ptr())
}

/// This worker's rank and the number of workers (0 and 1 for local stores).
///
/// # Safety
/// `store` is live; `rank` and `num_workers` are writable.
#[no_mangle]
pub unsafe extern "C" fn gp_kvstore_rank(store: *const gp_kvstore_t, rank: *mut u64, num_workers: *mut u64) -> c_int {
    guard(|| {
        if rank.is_null() || num_workers.is_null() {
            return Err(Error::NullPointer { what: "rank/num_workers" });
        }
        let s = &self::store(store)?.0;
        let (r, n) = (s.rank(), s.num_workers());
        *rank = r as u64;
        *num_workers = n as u64;
        Ok(())
    })
}

/// Waits until every worker reached the barrier (a no-op for local stores).
///
/// # Safety
/// `store` is live.
#[no_mangle]
pub unsafe extern "C" fn gp_kvstore_barrier(store: *const gp_kvstore_t) -> c_int {
    guard(|| self::store(store)?.0.barrier())
}

/// Copies the error-feedback residual of `key` on `device` (2-bit's, or a
/// scheme's) into `out`: `len` floats, the key's size. An error for a device
/// that has not pushed the key with compression. Local and device stores only.
///
/// # Safety
/// `store` is live; `out` holds `len` floats.
#[no_mangle]
pub unsafe extern "C" fn gp_kvstore_residual(store: *const gp_kvstore_t, key: gp_key_t, device: u64, out: *mut f32, len: u64) -> c_int {
    guard(|| {
        let kv = &self::store(store)?.0;
        Raw::new("out", out, len)?;
        let r = kv.residual(&key_of(key)?, device as usize)?;
        let want = r.len();
        if len as usize != want {
            return Err(Error::SizeMismatch { what: "residual output", expected: want, got: len as usize });
        }
        slice_mut(out, len).copy_from_slice(&r);
        Ok(())
    })
}

/// Runs this process's scheduler or server role (DMLC_ROLE) until the job
/// ends: 0 when it ended normally, -1 (with the message) when it failed.
#[no_mangle]
pub extern "C" fn gp_dist_serve() -> c_int {
    guard(|| param_server::serve(Config::from_env()?))
}

/// Initialises `key` with a float32 `value` (copied).
///
/// # Safety
/// `store` is live; the array descriptor and its data are valid.
#[no_mangle]
pub unsafe extern "C" fn gp_kvstore_init(store: *mut gp_kvstore_t, key: gp_key_t, value: gp_array_t) -> c_int {
    guard(|| {
        let kv = self::store(store)?;
        let (key, inputs) = read(kv, true, key_of(key), || arrays_in(&value, 1, &[]))?;
        kv.0.init(&key, inputs.views()[0])
    })
}

/// A call's key, then its arguments (`args`), read; a failure is also the
/// store's refusal of the call (`Store::refuse`: the other workers of an
/// all-reduce store fail their call alike instead of pairing with this
/// worker's next one).
fn read<T>(kv: &gp_kvstore_t, init: bool, key: Result<Key>, args: impl FnOnce() -> Result<T>) -> Result<(Key, T)> {
    let key = key.map_err(|err| kv.0.refuse(None, init, None, err))?;
    let args = args().map_err(|err| kv.0.refuse(Some(&key), init, None, err))?;
    Ok((key, args))
}

/// Pushes `num` arrays (one per device) to `key`: they are summed (compressed
/// on a `device` store with compression set) and the updater is applied.
///
/// # Safety
/// `store` is live; `values` points to `num` valid descriptors.
#[no_mangle]
pub unsafe extern "C" fn gp_kvstore_push(store: *mut gp_kvstore_t, key: gp_key_t, values: *const gp_array_t, num: c_int) -> c_int {
    guard(|| {
        let kv = self::store(store)?;
        let (key, inputs) = read(kv, false, key_of(key), || arrays_in(values, num, &[]))?;
        kv.0.push(&key, &inputs.views())
    })
}

/// Copies the stored value of `key` into `num` float32 outputs.
///
/// # Safety
/// `store` is live; `outs` points to `num` valid, writable, disjoint descriptors.
#[no_mangle]
pub unsafe extern "C" fn gp_kvstore_pull(store: *mut gp_kvstore_t, key: gp_key_t, outs: *const gp_array_mut_t, num: c_int) -> c_int {
    guard(|| {
        let kv = self::store(store)?;
        let mut outputs = arrays_out(outs, num)?;
        kv.0.pull(&key_of(key)?, &mut outputs.slices())
    })
}

/// Push, then pull into `outs`.
///
/// # Safety
/// As for `gp_kvstore_push` and `gp_kvstore_pull`.
#[no_mangle]
pub unsafe extern "C" fn gp_kvstore_pushpull(
    store: *mut gp_kvstore_t,
    key: gp_key_t,
    values: *const gp_array_t,
    num_values: c_int,
    outs: *const gp_array_mut_t,
    num_outs: c_int,
) -> c_int {
    guard(|| {
        let kv = self::store(store)?;
        let (key, (inputs, mut outputs)) = read(kv, false, key_of(key), || {
            let outputs = arrays_out(outs, num_outs)?;
            Ok((arrays_in(values, num_values, &outputs.raws())?, outputs))
        })?;
        kv.0.pushpull(&key, &inputs.views(), &mut outputs.slices())
    })
}

/// Init with `value`, then pull into `outs`.
///
/// # Safety
/// As for `gp_kvstore_init` and `gp_kvstore_pull`.
#[no_mangle]
pub unsafe extern "C" fn gp_kvstore_broadcast(store: *mut gp_kvstore_t, key: gp_key_t, value: gp_array_t, outs: *const gp_array_mut_t, num_outs: c_int) -> c_int {
    guard(|| {
        let kv = self::store(store)?;
        let (key, (inputs, mut outputs)) = read(kv, true, key_of(key), || {
            let outputs = arrays_out(outs, num_outs)?;
            Ok((arrays_in(&value, 1, &outputs.raws())?, outputs))
        })?;
        kv.0.broadcast(&key, inputs.views()[0], &mut outputs.slices())
    })
}

/// A front (gradpack.kv, the MXNet plugin) refused an init (`init` != 0)
/// or a push of `key` (NULL: no key it could read) with `message` before
/// calling the store. On a "dist_sync_allreduce" store this worker still
/// takes part in that call's agreement, so that every other worker's call
/// fails too, naming `message` as the cause, instead of pairing with this
/// worker's next call; other stores do nothing. `shape` (`ndim` values,
/// NULL when unknown) is the value's. Returns -1 with `message` as the
/// last error, or the error reading the arguments.
///
/// # Safety
/// `store` is live; `key` is NULL or a valid key; `shape` is NULL or holds
/// `ndim` values; `message` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn gp_kvstore_refuse(store: *mut gp_kvstore_t, key: *const gp_key_t, init: c_int, shape: *const u64, ndim: c_int, message: *const c_char) -> c_int {
    guard(|| {
        let kv = self::store(store)?;
        let message = cstr(message, "message")?.to_string();
        let key = match key.as_ref() {
            Some(k) => Some(key_of(*k)?),
            None => None,
        };
        let shape = if shape.is_null() { None } else { Some(shape_of(ndim, shape)?) };
        Err(kv.0.refuse(key.as_ref(), init != 0, shape.as_deref(), Error::Store(message)))
    })
}

/// Sets compression from `compress_params` given as `num` key/value strings.
///
/// # Safety
/// `keys` and `vals` point to `num` NUL-terminated strings each.
#[no_mangle]
pub unsafe extern "C" fn gp_kvstore_set_compress(store: *mut gp_kvstore_t, keys: *const *const c_char, vals: *const *const c_char, num: c_int) -> c_int {
    guard(|| {
        let pairs = params(keys, vals, num)?;
        let compression = Compression::from_params(pairs.iter().copied())?;
        self::store(store)?.0.set_compress(compression, &owned(&pairs))
    })
}

/// Runs gradpack's optimizer `name` ("sgd", "nag", "adam") on every push, with
/// MXNet's parameter names as `num` key/value strings.
///
/// # Safety
/// `name` is NUL-terminated; `keys`/`vals` point to `num` strings each.
#[no_mangle]
pub unsafe extern "C" fn gp_kvstore_set_optimizer(store: *mut gp_kvstore_t, name: *const c_char, keys: *const *const c_char, vals: *const *const c_char, num: c_int) -> c_int {
    guard(|| {
        let name = cstr(name, "optimizer")?;
        let pairs = params(keys, vals, num)?;
        self::store(store)?.0.set_optimizer(name, &owned(&pairs))
    })
}

/// The learning rate and weight decay of one key's next updates (MXNet's
/// per-parameter `_get_lr` / `_get_wd`), for the current optimizer.
///
/// # Safety
/// `store` is live.
#[no_mangle]
pub unsafe extern "C" fn gp_kvstore_set_rates(store: *mut gp_kvstore_t, key: gp_key_t, learning_rate: f64, wd: f64) -> c_int {
    guard(|| {
        self::store(store)?.0.set_rates(&key_of(key)?, learning_rate, wd)
    })
}

/// `rescale_grad` and `clip_gradient` (negative: off) of the current optimizer.
///
/// # Safety
/// `store` is live.
#[no_mangle]
pub unsafe extern "C" fn gp_kvstore_set_grad_scaling(store: *mut gp_kvstore_t, rescale_grad: f32, clip_gradient: f32) -> c_int {
    guard(|| {
        self::store(store)?.0.set_grad_scaling(rescale_grad, clip_gradient)
    })
}

struct CallbackUpdater {
    f: unsafe extern "C" fn(gp_key_t, *const f32, *mut f32, u64, *mut c_void) -> c_int,
    user: *mut c_void,
}

// SAFETY: the C caller promises (c_api.h) that the callback and `user` may be
// used from whichever thread pushes.
unsafe impl Send for CallbackUpdater {}
unsafe impl Sync for CallbackUpdater {}

/// Calls `f(key, merged, stored, n, user)` on every push instead of storing the
/// sum. `user` stays owned by the caller and must outlive the store.
///
/// # Safety
/// `f` is safe to call from any thread that pushes, with `user`.
#[no_mangle]
pub unsafe extern "C" fn gp_kvstore_set_updater(store: *mut gp_kvstore_t, f: gp_updater_fn, user: *mut c_void) -> c_int {
    guard(|| {
        let kv = &self::store(store)?.0;
        let f = f.ok_or(Error::NullPointer { what: "updater" })?;
        let cb = CallbackUpdater { f, user };
        kv.set_updater(Updater::Custom(Box::new(move |key, merged, stored| {
            let cb = &cb;
            let name;
            let k = match key {
                Key::Int(i) => gp_key_t { int_key: *i, str_key: std::ptr::null() },
                Key::Str(s) => {
                    name = std::ffi::CString::new(s.as_str()).map_err(|_| Error::Key { key: key.to_string(), problem: "contains NUL".into() })?;
                    gp_key_t { int_key: 0, str_key: name.as_ptr() }
                }
            };
            // SAFETY: merged and stored are live slices of the same length for the call.
            let status = unsafe { (cb.f)(k, merged.as_ptr(), stored.as_mut_ptr(), stored.len() as u64, cb.user) };
            if status == 0 {
                Ok(())
            } else {
                Err(Error::Updater { key: key.to_string(), message: format!("callback returned {status}") })
            }
        })))
    })
}

/// Serialises the store's state into a new buffer `*data` of `*len` bytes,
/// owned by the caller and released with `gp_buffer_free`: its gradpack
/// optimizer's states and its compression states, in one versioned blob.
///
/// # Safety
/// `data` and `len` are writable.
#[no_mangle]
pub unsafe extern "C" fn gp_kvstore_save_optimizer_states(store: *mut gp_kvstore_t, data: *mut *mut u8, len: *mut u64) -> c_int {
    guard(|| {
        let kv = &self::store(store)?.0;
        if data.is_null() || len.is_null() {
            return Err(Error::NullPointer { what: "data/len" });
        }
        let blob = kv.save_optimizer_states()?.into_boxed_slice();
        *len = blob.len() as u64;
        *data = Box::into_raw(blob).cast::<u8>();
        Ok(())
    })
}

/// Serialises the store's compression states (every key's residuals and
/// scheme state, this worker's on a distributed store) into a new buffer
/// `*data` of `*len` bytes, released with `gp_buffer_free`. Local stores also
/// put them in `gp_kvstore_save_optimizer_states`'s blob.
///
/// # Safety
/// `data` and `len` are writable.
#[no_mangle]
pub unsafe extern "C" fn gp_kvstore_save_compression_states(store: *mut gp_kvstore_t, data: *mut *mut u8, len: *mut u64) -> c_int {
    guard(|| {
        let kv = self::store(store)?;
        if data.is_null() || len.is_null() {
            return Err(Error::NullPointer { what: "data/len" });
        }
        let blob = kv.0.save_compression_states()?.into_boxed_slice();
        *len = blob.len() as u64;
        *data = Box::into_raw(blob).cast::<u8>();
        Ok(())
    })
}

/// Replaces the compression states with a blob from
/// `gp_kvstore_save_compression_states`; checked whole first (compression,
/// worker, every key's shape), so a refused blob changes nothing.
///
/// # Safety
/// `data` is readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn gp_kvstore_load_compression_states(store: *mut gp_kvstore_t, data: *const u8, len: u64) -> c_int {
    guard(|| {
        let kv = self::store(store)?;
        Raw::new("data", data, len)?;
        kv.0.load_compression_states(slice(data, len))
    })
}

/// Releases a buffer returned by gradpack.
///
/// # Safety
/// `data`/`len` are exactly what gradpack returned, released once.
#[no_mangle]
pub unsafe extern "C" fn gp_buffer_free(data: *mut u8, len: u64) {
    if !data.is_null() {
        drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(data, len as usize)));
    }
}

/// Replaces the optimizer and compression states with a blob from
/// `gp_kvstore_save_optimizer_states` (or an optimizer-only blob of earlier
/// versions); checked whole first.
///
/// # Safety
/// `data` is readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn gp_kvstore_load_optimizer_states(store: *mut gp_kvstore_t, data: *const u8, len: u64) -> c_int {
    guard(|| {
        let kv = &self::store(store)?.0;
        Raw::new("data", data, len)?;
        kv.load_optimizer_states(slice(data, len))
    })
}

/// Traffic counters. Local stores: bytes pushes moved between devices as
/// float32 (`a`) and as sent (`b`). Distributed workers: this node's transport
/// bytes sent (`a`) and received (`b`).
///
/// # Safety
/// `a` and `b` are writable.
#[no_mangle]
pub unsafe extern "C" fn gp_kvstore_stats(store: *const gp_kvstore_t, a: *mut u64, b: *mut u64) -> c_int {
    guard(|| {
        if a.is_null() || b.is_null() {
            return Err(Error::NullPointer { what: "stats outputs" });
        }
        let (x, y) = self::store(store)?.0.stats();
        *a = x;
        *b = y;
        Ok(())
    })
}
