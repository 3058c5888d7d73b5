//! The one `cxx` bridge: what C++ (the MXNet operator library and the
//! `gradpack::KVStore` class in `cpp/`) may call in the Rust core, and the C++
//! updater the store may call back. Errors cross as `rust::Error` exceptions
//! carrying the core's message; C++ exceptions from an updater come back as
//! `Err` values.

use half::{bf16, f16};

use crate::codec::{self, Thresholds};
use crate::compression::Compression;
use crate::error::{Error, Result};
use crate::kvstore::{Array, ArrayMut, Grad, KVStore, Key, Updater};
use crate::optimizer::Optimizer;

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

        /// A local/device KVStore (see `crate::kvstore`).
        type Store;
        fn store_new(type_name: &str) -> Result<Box<Store>>;
        fn store_type(store: &Store) -> &'static str;
        fn store_init(store: &Store, key: &KeyArg, shape: &[usize], value: &[f32]) -> Result<()>;
        /// `values` holds the addresses of float32 arrays of `shape`, one per device.
        unsafe fn store_push(store: &Store, key: &KeyArg, shape: &[usize], values: &[usize]) -> Result<()>;
        /// `outs` holds the addresses of writable, disjoint float32 arrays of `shape`.
        unsafe fn store_pull(store: &Store, key: &KeyArg, shape: &[usize], outs: &[usize]) -> Result<()>;
        unsafe fn store_pushpull(store: &Store, key: &KeyArg, shape: &[usize], values: &[usize], outs: &[usize]) -> Result<()>;
        unsafe fn store_broadcast(store: &Store, key: &KeyArg, shape: &[usize], value: &[f32], outs: &[usize]) -> Result<()>;
        fn store_set_compress(store: &Store, keys: &CxxVector<CxxString>, values: &CxxVector<CxxString>) -> Result<()>;
        fn store_set_optimizer(store: &Store, name: &str, keys: &CxxVector<CxxString>, values: &CxxVector<CxxString>) -> Result<()>;
        fn store_set_updater(store: &Store, updater: UniquePtr<Updater>) -> Result<()>;
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

/// The store behind `gradpack::KVStore`.
pub struct Store(KVStore);

fn key_of(k: &ffi::KeyArg) -> Key {
    if k.is_str {
        Key::Str(k.str_key.clone())
    } else {
        Key::Int(k.int_key)
    }
}

fn store_new(type_name: &str) -> Result<Box<Store>> {
    Ok(Box::new(Store(KVStore::new(type_name)?)))
}

fn store_type(store: &Store) -> &'static str {
    store.0.store_type().name()
}

fn store_init(store: &Store, key: &ffi::KeyArg, shape: &[usize], value: &[f32]) -> Result<()> {
    store.0.init(&key_of(key), Array { shape, data: Grad::F32(value) })
}

/// # Safety
/// Each address points to `shape.iter().product()` readable floats.
unsafe fn inputs<'a>(shape: &[usize], addrs: &[usize]) -> Result<Vec<&'a [f32]>> {
    let n: usize = shape.iter().product();
    addrs
        .iter()
        .map(|&a| if a == 0 && n > 0 { Err(Error::NullPointer { what: "value data" }) } else if n == 0 { Ok(&[][..]) } else { Ok(std::slice::from_raw_parts(a as *const f32, n)) })
        .collect()
}

/// # Safety
/// Each address points to `shape.iter().product()` writable floats, disjoint.
unsafe fn outputs<'a>(shape: &[usize], addrs: &[usize]) -> Result<Vec<&'a mut [f32]>> {
    let n: usize = shape.iter().product();
    let mut seen: Vec<usize> = addrs.to_vec();
    seen.sort_unstable();
    if n > 0 && seen.windows(2).any(|w| w[1] < w[0] + 4 * n) {
        return Err(Error::OverlappingBuffers { a: "output", b: "output" });
    }
    addrs
        .iter()
        .map(|&a| if a == 0 && n > 0 { Err(Error::NullPointer { what: "output data" }) } else if n == 0 { Ok(&mut [][..]) } else { Ok(std::slice::from_raw_parts_mut(a as *mut f32, n)) })
        .collect()
}

unsafe fn store_push(store: &Store, key: &ffi::KeyArg, shape: &[usize], values: &[usize]) -> Result<()> {
    let vals = inputs(shape, values)?;
    let arrays: Vec<Array> = vals.iter().map(|v| Array { shape, data: Grad::F32(v) }).collect();
    store.0.push(&key_of(key), &arrays)
}

unsafe fn store_pull(store: &Store, key: &ffi::KeyArg, shape: &[usize], outs: &[usize]) -> Result<()> {
    let mut outs: Vec<ArrayMut> = outputs(shape, outs)?.into_iter().map(|data| ArrayMut { shape, data }).collect();
    store.0.pull(&key_of(key), &mut outs)
}

unsafe fn store_pushpull(store: &Store, key: &ffi::KeyArg, shape: &[usize], values: &[usize], outs: &[usize]) -> Result<()> {
    let vals = inputs(shape, values)?;
    let arrays: Vec<Array> = vals.iter().map(|v| Array { shape, data: Grad::F32(v) }).collect();
    let mut outs: Vec<ArrayMut> = outputs(shape, outs)?.into_iter().map(|data| ArrayMut { shape, data }).collect();
    store.0.pushpull(&key_of(key), &arrays, &mut outs)
}

unsafe fn store_broadcast(store: &Store, key: &ffi::KeyArg, shape: &[usize], value: &[f32], outs: &[usize]) -> Result<()> {
    let mut outs: Vec<ArrayMut> = outputs(shape, outs)?.into_iter().map(|data| ArrayMut { shape, data }).collect();
    store.0.broadcast(&key_of(key), Array { shape, data: Grad::F32(value) }, &mut outs)
}

fn string_pairs(keys: &cxx::CxxVector<cxx::CxxString>, values: &cxx::CxxVector<cxx::CxxString>) -> Result<Vec<(String, String)>> {
    if keys.len() != values.len() {
        return Err(Error::InvalidParam { key: "params".into(), problem: format!("{} keys but {} values", keys.len(), values.len()) });
    }
    Ok(keys.iter().zip(values.iter()).map(|(k, v)| (k.to_string_lossy().into_owned(), v.to_string_lossy().into_owned())).collect())
}

fn store_set_compress(store: &Store, keys: &cxx::CxxVector<cxx::CxxString>, values: &cxx::CxxVector<cxx::CxxString>) -> Result<()> {
    let pairs = string_pairs(keys, values)?;
    store.0.set_compress(Compression::from_params(pairs.iter().map(|(k, v)| (k.as_str(), v.as_str())))?)
}

fn store_set_optimizer(store: &Store, name: &str, keys: &cxx::CxxVector<cxx::CxxString>, values: &cxx::CxxVector<cxx::CxxString>) -> Result<()> {
    let pairs = string_pairs(keys, values)?;
    store.0.set_optimizer(Optimizer::from_params(name, pairs.iter().map(|(k, v)| (k.as_str(), v.as_str())))?);
    Ok(())
}

fn store_set_updater(store: &Store, updater: cxx::UniquePtr<ffi::Updater>) -> Result<()> {
    if updater.is_null() {
        return Err(Error::NullPointer { what: "updater" });
    }
    store.0.set_updater(Updater::Custom(Box::new(move |key, merged, stored| {
        let arg = match key {
            Key::Int(k) => ffi::KeyArg { is_str: false, int_key: *k, str_key: String::new() },
            Key::Str(s) => ffi::KeyArg { is_str: true, int_key: 0, str_key: s.clone() },
        };
        updater.call(&arg, merged, stored).map_err(|e| Error::Updater { key: key.to_string(), message: e.what().to_string() })
    })));
    Ok(())
}

fn compressed_len(n: usize) -> usize {
    codec::compressed_len(n)
}

fn check_thresholds(neg: f32, pos: f32) -> Result<()> {
    Thresholds::new(neg, pos).map(|_| ())
}

fn quantize_2bit_f32(grad: &[f32], residual: &mut [f32], compr: &mut [f32], neg: f32, pos: f32) -> Result<()> {
    codec::quantize_2bit(grad, residual, compr, Thresholds::new(neg, pos)?)
}

fn quantize_2bit_f16(grad: &[u16], residual: &mut [f32], compr: &mut [f32], neg: f32, pos: f32) -> Result<()> {
    // SAFETY: f16 is a transparent wrapper of u16; every bit pattern is valid.
    let grad = unsafe { std::slice::from_raw_parts(grad.as_ptr().cast::<f16>(), grad.len()) };
    codec::quantize_2bit(grad, residual, compr, Thresholds::new(neg, pos)?)
}

fn quantize_2bit_bf16(grad: &[u16], residual: &mut [f32], compr: &mut [f32], neg: f32, pos: f32) -> Result<()> {
    // SAFETY: bf16 is a transparent wrapper of u16; every bit pattern is valid.
    let grad = unsafe { std::slice::from_raw_parts(grad.as_ptr().cast::<bf16>(), grad.len()) };
    codec::quantize_2bit(grad, residual, compr, Thresholds::new(neg, pos)?)
}

fn dequantize_2bit(compr: &[f32], out: &mut [f32]) -> Result<()> {
    codec::dequantize_2bit(compr, out)
}

fn dequantize_2bit_add(compr: &[f32], sum: &mut [f32]) -> Result<()> {
    codec::dequantize_2bit_add(compr, sum)
}
