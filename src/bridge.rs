//! The one `cxx` bridge: what C++ (the MXNet operator library and the
//! `gradpack::KVStore` class in `cpp/`) may call in the Rust core, and the C++
//! updater the store may call back. Errors cross as `rust::Error` exceptions
//! carrying the core's message; C++ exceptions from an updater come back as
//! `Err` values.

use half::{bf16, f16};

use crate::codec::{self, Thresholds};
use crate::quant::compression::Compression;
use crate::error::{catch_panic as guarded, Error, Result};
use crate::boundary::{Inputs, Outputs, RawGrad};
use crate::store::{elements, Array, Grad, Key, Updater};

#[cxx::bridge(namespace = "gradpack")]
mod ffi {
    // --- Shared types -------------------------------------------------------
    /// A KVStore key: `str_key` when `is_str`, else `int_key`.
    struct KeyArg {
        is_str: bool,
        int_key: i64,
        str_key: String,
    }

    // --- Rust types and functions visible to C++ ----------------------------
    extern "Rust" {
        /// `3 + ceil(n / 16)`.
        fn compressed_len(n: usize) -> usize;
        fn quantize_2bit_f32(grad: &[f32], residual: &mut [f32], compr: &mut [f32], neg_threshold: f32, pos_threshold: f32) -> Result<()>;
        /// `grad` holds IEEE half-precision bit patterns.
        fn quantize_2bit_f16(grad: &[u16], residual: &mut [f32], compr: &mut [f32], neg_threshold: f32, pos_threshold: f32) -> Result<()>;
        /// `grad` holds bfloat16 bit patterns.
        fn quantize_2bit_bf16(grad: &[u16], residual: &mut [f32], compr: &mut [f32], neg_threshold: f32, pos_threshold: f32) -> Result<()>;
        fn dequantize_2bit(compr: &[f32], out: &mut [f32]) -> Result<()>;
        fn dequantize_2bit_add(compr: &[f32], sum: &mut [f32]) -> Result<()>;
        /// Validates thresholds given as attribute values; Err names the problem.
        fn check_thresholds(neg_threshold: f32, pos_threshold: f32) -> Result<()>;

        /// Any store (`crate::store::Store`), opened by `crate::store::open`.
        type Store;
        fn store_new(type_name: &str) -> Result<Box<Store>>;
        fn store_type(store: &Store) -> &'static str;
        fn store_rank(store: &Store) -> usize;
        fn store_num_workers(store: &Store) -> usize;
        fn store_barrier(store: &Store) -> Result<()>;
        fn store_init(store: &Store, key: &KeyArg, shape: &[usize], value: &[f32]) -> Result<()>;
        /// `values` holds the addresses of float32 arrays of `shape`, one per device.
        unsafe fn store_push(store: &Store, key: &KeyArg, shape: &[usize], values: &[usize]) -> Result<()>;
        /// `outs` holds the addresses of writable, disjoint float32 arrays of `shape`.
        unsafe fn store_pull(store: &Store, key: &KeyArg, shape: &[usize], outs: &[usize]) -> Result<()>;
        /// Inputs may be the outputs themselves (MXNet's Trainer does so): such
        /// an input is copied before any output is written.
        unsafe fn store_pushpull(store: &Store, key: &KeyArg, shape: &[usize], values: &[usize], outs: &[usize]) -> Result<()>;
        /// `value` is the address of a float32 array of `shape`; it may be one of `outs`.
        unsafe fn store_broadcast(store: &Store, key: &KeyArg, shape: &[usize], value: usize, outs: &[usize]) -> Result<()>;
        fn store_set_compress(store: &Store, keys: &CxxVector<CxxString>, values: &CxxVector<CxxString>) -> Result<()>;
        fn store_set_optimizer(store: &Store, name: &str, keys: &CxxVector<CxxString>, values: &CxxVector<CxxString>) -> Result<()>;
        fn store_set_updater(store: &Store, updater: UniquePtr<Updater>) -> Result<()>;
        /// The state blob of `KVStore::save_optimizer_states` (optimizer and compression states).
        fn store_save_states(store: &Store) -> Result<Vec<u8>>;
        fn store_load_states(store: &Store, blob: &[u8]) -> Result<()>;
    }

    // --- C++ types and functions visible to Rust ----------------------------
    unsafe extern "C++" {
        include!("gradpack/updater.h");
        /// A C++ updater (`std::function`), called as `stored = f(merged)` on push.
        type Updater;
        fn call(self: &Updater, key: &KeyArg, merged: &[f32], stored: &mut [f32]) -> Result<()>;
    }
}

// SAFETY: gradpack::Updater is documented (include/gradpack/updater.h) to be
// callable from any pushing thread; the store serialises calls per key.
unsafe impl Send for ffi::Updater {}
unsafe impl Sync for ffi::Updater {}

/// The store behind `gradpack::KVStore`: any store, behind the one trait.
pub struct Store(Box<dyn crate::store::Store>);

fn key_of(k: &ffi::KeyArg) -> Key {
    if k.is_str {
        Key::Str(k.str_key.clone())
    } else {
        Key::Int(k.int_key)
    }
}

fn store_new(type_name: &str) -> Result<Box<Store>> {
    guarded(|| {
        Ok(Box::new(Store(crate::store::open(type_name)?)))
    })
}

fn store_type(store: &Store) -> &'static str {
    store.0.type_name()
}

fn store_rank(store: &Store) -> usize {
    store.0.rank()
}

fn store_num_workers(store: &Store) -> usize {
    store.0.num_workers()
}

fn store_barrier(store: &Store) -> Result<()> {
    guarded(|| store.0.barrier())
}

fn store_init(store: &Store, key: &ffi::KeyArg, shape: &[usize], value: &[f32]) -> Result<()> {
    guarded(|| {
        store.0.init(&key_of(key), Array { shape, data: Grad::F32(value) })
    })
}

/// A call's float32 inputs at `addrs`, each of `shape`, through the one
/// checked boundary; those that overlap one of `outs` are copied.
///
/// # Safety
/// Each address points to `shape`'s element count of readable floats that
/// stay valid for the lifetime the caller picks.
unsafe fn inputs<'a>(shape: &[usize], addrs: &[usize], outs: &Outputs) -> Result<Inputs<'a>> {
    let n = elements(shape)? as u64;
    let outs = outs.raws();
    let mut inputs = Inputs::new();
    for &a in addrs {
        // SAFETY: the function's contract.
        unsafe { inputs.push(shape.to_vec(), RawGrad::F32(a as *const f32), n, &outs)? };
    }
    Ok(inputs)
}

/// A call's float32 outputs at `addrs`, each of `shape`: checked, pairwise
/// disjoint, not yet slices.
fn outputs<'a>(shape: &[usize], addrs: &[usize]) -> Result<Outputs<'a>> {
    let n = elements(shape)? as u64;
    let mut outputs = Outputs::new();
    for &a in addrs {
        outputs.push(shape.to_vec(), a as *mut f32, n)?;
    }
    Ok(outputs)
}

// SAFETY (the four calls below): the C++ class `gradpack::KVStore`
// (cpp/kvstore.cc) passes the addresses of float32 arrays of `shape` that
// its caller keeps valid, and otherwise unused, until the call returns.

unsafe fn store_push(store: &Store, key: &ffi::KeyArg, shape: &[usize], values: &[usize]) -> Result<()> {
    guarded(|| {
        let vals = unsafe { inputs(shape, values, &Outputs::new())? };
        store.0.push(&key_of(key), &vals.views())
    })
}

unsafe fn store_pull(store: &Store, key: &ffi::KeyArg, shape: &[usize], outs: &[usize]) -> Result<()> {
    guarded(|| {
        let mut outs = outputs(shape, outs)?;
        store.0.pull(&key_of(key), &mut unsafe { outs.slices() })
    })
}

unsafe fn store_pushpull(store: &Store, key: &ffi::KeyArg, shape: &[usize], values: &[usize], outs: &[usize]) -> Result<()> {
    guarded(|| {
        let mut outs = outputs(shape, outs)?;
        let vals = unsafe { inputs(shape, values, &outs)? };
        store.0.pushpull(&key_of(key), &vals.views(), &mut unsafe { outs.slices() })
    })
}

unsafe fn store_broadcast(store: &Store, key: &ffi::KeyArg, shape: &[usize], value: usize, outs: &[usize]) -> Result<()> {
    guarded(|| {
        let mut outs = outputs(shape, outs)?;
        let vals = unsafe { inputs(shape, &[value], &outs)? };
        store.0.broadcast(&key_of(key), vals.views()[0], &mut unsafe { outs.slices() })
    })
}

fn string_pairs(keys: &cxx::CxxVector<cxx::CxxString>, values: &cxx::CxxVector<cxx::CxxString>) -> Result<Vec<(String, String)>> {
    if keys.len() != values.len() {
        return Err(Error::InvalidParam { key: "params".into(), problem: format!("{} keys but {} values", keys.len(), values.len()) });
    }
    Ok(keys.iter().zip(values.iter()).map(|(k, v)| (k.to_string_lossy().into_owned(), v.to_string_lossy().into_owned())).collect())
}

fn store_set_compress(store: &Store, keys: &cxx::CxxVector<cxx::CxxString>, values: &cxx::CxxVector<cxx::CxxString>) -> Result<()> {
    guarded(|| {
        let pairs = string_pairs(keys, values)?;
        store.0.set_compress(Compression::from_params(pairs.iter().map(|(k, v)| (k.as_str(), v.as_str())))?, &pairs)
    })
}

fn store_set_optimizer(store: &Store, name: &str, keys: &cxx::CxxVector<cxx::CxxString>, values: &cxx::CxxVector<cxx::CxxString>) -> Result<()> {
    guarded(|| {
        let pairs = string_pairs(keys, values)?;
        store.0.set_optimizer(name, &pairs)
    })
}

fn store_save_states(store: &Store) -> Result<Vec<u8>> {
    guarded(|| store.0.save_optimizer_states())
}

fn store_load_states(store: &Store, blob: &[u8]) -> Result<()> {
    guarded(|| store.0.load_optimizer_states(blob))
}

fn store_set_updater(store: &Store, updater: cxx::UniquePtr<ffi::Updater>) -> Result<()> {
    guarded(|| {
        if updater.is_null() {
            return Err(Error::NullPointer { what: "updater" });
        }
        store.0.set_updater(Updater::Custom(Box::new(move |key, merged, stored| {
            let arg = match key {
                Key::Int(k) => ffi::KeyArg { is_str: false, int_key: *k, str_key: String::new() },
                Key::Str(s) => ffi::KeyArg { is_str: true, int_key: 0, str_key: s.clone() },
            };
            updater.call(&arg, merged, stored).map_err(|e| Error::Updater { key: key.to_string(), message: e.what().to_string() })
        })))
    })
}

fn compressed_len(n: usize) -> usize {
    codec::compressed_len(n)
}

fn check_thresholds(neg: f32, pos: f32) -> Result<()> {
    guarded(|| {
        Thresholds::new(neg, pos).map(|_| ())
    })
}

fn quantize_2bit_f32(grad: &[f32], residual: &mut [f32], compr: &mut [f32], neg: f32, pos: f32) -> Result<()> {
    guarded(|| {
        codec::quantize_2bit(grad, residual, compr, Thresholds::new(neg, pos)?)
    })
}

fn quantize_2bit_f16(grad: &[u16], residual: &mut [f32], compr: &mut [f32], neg: f32, pos: f32) -> Result<()> {
    guarded(|| {
        // SAFETY: f16 is a transparent wrapper of u16; every bit pattern is valid.
        let grad = unsafe { std::slice::from_raw_parts(grad.as_ptr().cast::<f16>(), grad.len()) };
        codec::quantize_2bit(grad, residual, compr, Thresholds::new(neg, pos)?)
    })
}

fn quantize_2bit_bf16(grad: &[u16], residual: &mut [f32], compr: &mut [f32], neg: f32, pos: f32) -> Result<()> {
    guarded(|| {
        // SAFETY: bf16 is a transparent wrapper of u16; every bit pattern is valid.
        let grad = unsafe { std::slice::from_raw_parts(grad.as_ptr().cast::<bf16>(), grad.len()) };
        codec::quantize_2bit(grad, residual, compr, Thresholds::new(neg, pos)?)
    })
}

fn dequantize_2bit(compr: &[f32], out: &mut [f32]) -> Result<()> {
    guarded(|| {
        codec::dequantize_2bit(compr, out)
    })
}

fn dequantize_2bit_add(compr: &[f32], sum: &mut [f32]) -> Result<()> {
    guarded(|| {
        codec::dequantize_2bit_add(compr, sum)
    })
}
