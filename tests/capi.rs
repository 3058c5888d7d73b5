//! The C ABI as a C caller sees it: status codes, the thread-local last error,
//! outputs untouched on error, NULL handling, unknown dtypes.

use std::ffi::{c_void, CStr};
use std::ptr;

use gradpack::capi::*;

fn last_error() -> String {
    // SAFETY: gp_error_last never returns NULL and the string lives until the next failing call.
    unsafe { CStr::from_ptr(gp_error_last()) }.to_string_lossy().into_owned()
}

#[test]
fn golden_example_through_the_abi() {
    let grad = [0.0f32, 2.5, 1.0, -3.0, 2.0, 0.5, -1.0, -2.0];
    let mut residual = [0f32; 8];
    let mut compr = vec![0f32; gp_2bit_compressed_len(8) as usize];
    let status = unsafe { gp_2bit_quantize(grad.as_ptr().cast(), 0, 8, residual.as_mut_ptr(), 8, compr.as_mut_ptr(), 4, -2.0, 2.0) };
    assert_eq!(status, 0);
    assert_eq!(compr[3].to_bits(), 0x1242_0000);
    assert_eq!(residual, [0.0, 0.5, 1.0, -1.0, 0.0, 0.5, -1.0, 0.0]);
    let mut out = [0f32; 8];
    assert_eq!(unsafe { gp_2bit_dequantize(compr.as_ptr(), 4, out.as_mut_ptr(), 8) }, 0);
    assert_eq!(out, [0.0, 2.0, 0.0, -2.0, 2.0, 0.0, 0.0, -2.0]);
    assert_eq!(unsafe { gp_2bit_dequantize_add(compr.as_ptr(), 4, out.as_mut_ptr(), 8) }, 0);
    assert_eq!(out, [0.0, 4.0, 0.0, -4.0, 4.0, 0.0, 0.0, -4.0]);
}

#[test]
fn half_precision_dtypes() {
    let grad16: Vec<u16> = [0.0f32, 2.5, 1.0, -3.0].iter().map(|&x| half::f16::from_f32(x).to_bits()).collect();
    let gradbf: Vec<u16> = [0.0f32, 2.5, 1.0, -3.0].iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
    for (dtype, g) in [(1, &grad16), (2, &gradbf)] {
        let mut residual = [0f32; 4];
        let mut compr = [0f32; 4];
        let status = unsafe { gp_2bit_quantize(g.as_ptr().cast(), dtype, 4, residual.as_mut_ptr(), 4, compr.as_mut_ptr(), 4, -2.0, 2.0) };
        assert_eq!(status, 0, "{}", last_error());
        assert_eq!(compr[3].to_bits(), 0x1200_0000);
        assert_eq!(residual, [0.0, 0.5, 1.0, -1.0]);
    }
}

#[test]
fn errors_set_the_message_and_touch_nothing() {
    let grad = [1f32; 20];
    let mut residual = [0.5f32; 20];
    let mut compr = [9f32; 5];
    let g = grad.as_ptr().cast::<c_void>();
    let cases: Vec<(Box<dyn Fn(*mut f32, *mut f32) -> i32>, &str)> = vec![
        (Box::new(|r, c| unsafe { gp_2bit_quantize(g, 0, 20, r, 20, c, 5, 0.5, 0.5) }), "neg_threshold must be < 0"),
        (Box::new(|r, c| unsafe { gp_2bit_quantize(g, 0, 20, r, 19, c, 5, -0.5, 0.5) }), "residual has 19 elements, expected 20"),
        (Box::new(|r, c| unsafe { gp_2bit_quantize(g, 0, 20, r, 20, c, 4, -0.5, 0.5) }), "compressed array has 4 elements, expected 5"),
        (Box::new(|r, c| unsafe { gp_2bit_quantize(g, 7, 20, r, 20, c, 5, -0.5, 0.5) }), "unknown dtype code 7"),
        (Box::new(|_, c| unsafe { gp_2bit_quantize(g, 0, 20, ptr::null_mut(), 20, c, 5, -0.5, 0.5) }), "residual must not be a null pointer"),
        (Box::new(|r, c| unsafe { gp_2bit_quantize(ptr::null(), 0, 20, r, 20, c, 5, -0.5, 0.5) }), "grad must not be a null pointer"),
        (Box::new(|r, _| unsafe { gp_2bit_quantize(g, 0, 20, r, 20, r.add(10), 5, -0.5, 0.5) }), "residual and compr overlap"),
        // n times the element size wraps u64: refused, never a slice of 2^63 halves.
        (Box::new(|r, c| unsafe { gp_2bit_quantize(g, 1, 1 << 63, r, 20, c, 5, -0.5, 0.5) }), "invalid parameter 'grad': 9223372036854775808 elements do not fit in memory"),
        (Box::new(|r, c| unsafe { gp_2bit_dequantize(c, 5, r, 20) }), "header says size 9 but the output has 20"),
        (Box::new(|r, c| unsafe { gp_2bit_dequantize_add(c, 5, r, 21) }), "header says size 9 but the output has 21"),
    ];
    for (call, msg) in cases.iter() {
        assert_eq!(call(residual.as_mut_ptr(), compr.as_mut_ptr()), -1, "{msg}");
        let err = last_error();
        assert!(err.contains(msg), "wanted {msg:?}, got {err:?}");
        assert!(residual.iter().all(|&r| r == 0.5) && compr.iter().all(|&c| c == 9.0), "{msg}: output touched");
    }
}

#[test]
fn empty_gradients_accept_null() {
    let mut compr = [0f32; 3];
    let status = unsafe { gp_2bit_quantize(ptr::null(), 0, 0, ptr::null_mut(), 0, compr.as_mut_ptr(), 3, -1.0, 1.0) };
    assert_eq!(status, 0);
    assert_eq!(compr, [-1.0, 1.0, 0.0]);
    assert_eq!(unsafe { gp_2bit_dequantize(compr.as_ptr(), 3, ptr::null_mut(), 0) }, 0);
}

#[test]
fn last_error_is_per_thread() {
    let mut compr = [0f32; 3];
    assert_eq!(unsafe { gp_2bit_dequantize(compr.as_mut_ptr(), 2, ptr::null_mut(), 0) }, -1);
    let here = last_error();
    let there = std::thread::spawn(last_error).join().unwrap();
    assert!(here.contains("compressed array has 2 elements"));
    assert_eq!(there, "");
}

#[test]
fn version_and_kernel_are_static_strings() {
    let v = unsafe { CStr::from_ptr(gp_version()) }.to_str().unwrap();
    assert_eq!(v, env!("CARGO_PKG_VERSION"));
    let k = unsafe { CStr::from_ptr(gp_kernel_name()) }.to_str().unwrap();
    assert!(k == "avx2" || k == "portable");
    let s = unsafe { CStr::from_ptr(gp_scheme_kernel_name()) }.to_str().unwrap();
    assert_eq!(s, gradpack::isa::Isa::detect().name());
}

/// One table of store types: every local name creates a store that reports
/// the table's own string; every dist name is in it; nothing else creates.
#[test]
fn store_types_come_from_one_table() {
    let table = unsafe { CStr::from_ptr(gp_kvstore_types()) }.to_str().unwrap();
    let entries: Vec<(&str, &str)> = table.split(',').map(|e| e.split_once(':').unwrap()).collect();
    let names: Vec<&str> = entries.iter().map(|e| e.0).collect();
    assert_eq!(names, ["local", "device", "dist_sync_allreduce", "dist_sync", "dist_async", "dist_sync_device", "dist_device_sync"]);
    assert_eq!(entries.iter().filter(|e| e.1 == "dist").count(), 4);
    for (name, kind) in entries.iter().filter(|e| e.1 == "local") {
        let c = std::ffi::CString::new(*name).unwrap();
        let mut kv = ptr::null_mut();
        unsafe {
            assert_eq!(gp_kvstore_new(c.as_ptr(), &mut kv), 0, "{name} ({kind}): {}", last_error());
            assert_eq!(CStr::from_ptr(gp_kvstore_type(kv)).to_str().unwrap(), *name);
            gp_kvstore_free(kv);
        }
    }
    let mut kv = ptr::null_mut();
    assert_eq!(unsafe { gp_kvstore_new(c"nccl".as_ptr(), &mut kv) }, -1);
    assert!(last_error().contains("unknown KVStore type 'nccl'"), "{}", last_error());
}

/// A device store through the C ABI with careless calls: each fails with its
/// reason, and the residuals and value stay as the next push proves.
#[test]
fn careless_store_calls_fail_and_change_nothing() {
    use std::ffi::c_int;
    const N: u64 = 8;
    let shape = [N];
    let key = gp_key_t { int_key: 3, str_key: ptr::null() };
    let arr = |v: &[f32]| gp_array_t { data: v.as_ptr().cast(), dtype: 0, ndim: 1, shape: shape.as_ptr() };
    let out = |v: &mut [f32]| gp_array_mut_t { data: v.as_mut_ptr(), ndim: 1, shape: shape.as_ptr() };
    let mut kv = ptr::null_mut();
    unsafe {
        assert_eq!(gp_kvstore_new(c"device".as_ptr(), &mut kv), 0);
        let (k, v) = ([c"compress".as_ptr(), c"threshold".as_ptr()], [c"2bit".as_ptr(), c"0.5".as_ptr()]);
        assert_eq!(gp_kvstore_set_compress(kv, k.as_ptr(), v.as_ptr(), 2), 0);
        let zeros = [0f32; N as usize];
        assert_eq!(gp_kvstore_init(kv, key, arr(&zeros)), 0);
        assert_eq!(gp_kvstore_set_compress(kv, k.as_ptr(), v.as_ptr(), 2), -1);
        assert_eq!(last_error(), "set the gradient compression before initializing any key (1 already initialized)");

        // pushpull with each input as its own output: inputs are read first.
        let (mut a, mut b) = ([0.3f32; N as usize], [0.3f32; N as usize]);
        let outs = [out(&mut a), out(&mut b)]; // one pointer per array, read and written
        let ins = outs.each_ref().map(|o| gp_array_t { data: o.data.cast_const().cast(), dtype: 0, ndim: 1, shape: shape.as_ptr() });
        assert_eq!(gp_kvstore_pushpull(kv, key, ins.as_ptr(), 2, outs.as_ptr(), 2), 0, "{}", last_error());
        assert_eq!((a, b), ([0.0; N as usize], [0.0; N as usize])); // 0.3 < 0.5: residuals 0.3
        // A local store pulls from itself: no pull is answered from a round's values.
        let mut local = 7u64;
        assert_eq!(gp_kvstore_local_pulls(kv, &mut local), 0);
        assert_eq!(local, 0);
        assert_eq!(gp_kvstore_local_pulls(kv, ptr::null_mut()), -1);
        assert!(last_error().contains("out"), "{}", last_error());
        let mut r = [9f32; N as usize];
        assert_eq!(gp_kvstore_residual(kv, key, 5, r.as_mut_ptr(), N), -1);
        assert_eq!(last_error(), "key 3: has no residual on device 5: 2 device(s) pushed it with compression (devices 0 to 1)");

        // An updater that writes half-way and then fails.
        unsafe extern "C" fn failing(_: gp_key_t, _: *const f32, stored: *mut f32, _: u64, _: *mut c_void) -> c_int {
            *stored = 42.0;
            -1
        }
        unsafe extern "C" fn add(_: gp_key_t, merged: *const f32, stored: *mut f32, n: u64, _: *mut c_void) -> c_int {
            for i in 0..n as usize {
                *stored.add(i) += *merged.add(i);
            }
            0
        }
        assert_eq!(gp_kvstore_set_updater(kv, Some(failing), ptr::null_mut()), 0);
        let g = [0.3f32; N as usize];
        let ins = [arr(&g), arr(&g)];
        assert_eq!(gp_kvstore_push(kv, key, ins.as_ptr(), 2), -1);
        assert!(last_error().starts_with("updater failed for key 3"), "{}", last_error());
        let mut nan = [0.3f32; N as usize];
        nan[6] = f32::NAN;
        let bad = [arr(&g), arr(&nan)];
        assert_eq!(gp_kvstore_push(kv, key, bad.as_ptr(), 2), -1);
        assert!(last_error().contains("key 3: pushed value 1") && last_error().contains("NaN at element 6"), "{}", last_error());
        assert_eq!(gp_kvstore_residual(kv, key, 1, r.as_mut_ptr(), N), 0);
        assert_eq!(r, [0.3; N as usize]);

        // The next push goes on from residuals 0.3: 0.6 sends 0.5 per device.
        assert_eq!(gp_kvstore_set_updater(kv, Some(add), ptr::null_mut()), 0);
        assert_eq!(gp_kvstore_push(kv, key, ins.as_ptr(), 2), 0, "{}", last_error());
        let mut got = [9f32; N as usize];
        let outs = [out(&mut got)];
        assert_eq!(gp_kvstore_pull(kv, key, outs.as_ptr(), 1), 0);
        assert_eq!(got, [1.0; N as usize]);
        gp_kvstore_free(kv);
    }
}

/// A world of one: every collective leaves its buffer as it is.
unsafe extern "C" fn alone(_: *mut c_void, _: std::ffi::c_int, _: std::ffi::c_int, _: *mut c_void, _: u64) -> std::ffi::c_int {
    0
}

#[test]
fn a_pending_bucket_checked_on_one_thread_while_another_decodes_it_is_read_in_turn() {
    let (k, v) = ([c"compress".as_ptr(), c"threshold".as_ptr()], [c"2bit".as_ptr(), c"0.5".as_ptr()]);
    let mut g = ptr::null_mut();
    assert_eq!(unsafe { gp_group_new(k.as_ptr(), v.as_ptr(), 2, 0, 1, 0, 0.0, ptr::null(), &mut g) }, 0, "{}", last_error());
    let n = 1usize << 16;
    let mut bucket: Vec<f32> = (0..n).map(|i| ((i * 37) % 11) as f32 / 7.0 - 0.7).collect();
    let (key, ndims, dims) = (c"a".as_ptr(), [1u64], [n as u64]);
    struct Shared(*mut gp_group_t, *mut gp_pending_t);
    // SAFETY (for the test): the handles are used only while both live, as the C ABI allows from any thread.
    unsafe impl Send for Shared {}
    unsafe impl Sync for Shared {}
    for _ in 0..50 {
        let (mut p, mut w, mut nw, mut f, mut nf, mut plain) = (ptr::null_mut(), ptr::null_mut(), 0, ptr::null_mut(), 0, 0);
        let status = unsafe { gp_group_encode(g, 1, &key, ndims.as_ptr(), dims.as_ptr(), bucket.as_ptr(), n as u64, 1, 0, Some(alone), ptr::null_mut(), &mut p, &mut w, &mut nw, &mut f, &mut nf, &mut plain) };
        assert_eq!(status, 0, "{}", last_error());
        let shared = Shared(g, p);
        let stop = std::sync::atomic::AtomicBool::new(false);
        let checks = std::thread::scope(|s| {
            let reader = s.spawn(|| {
                let (shared, mut seen) = (&shared, Vec::new());
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    // Before the decode: the check passes; after it: refused as checked too late. Never a read of freed memory.
                    let status = unsafe { gp_group_check(shared.0, shared.1) };
                    seen.push(if status == 0 { String::new() } else { last_error() });
                }
                seen
            });
            std::thread::sleep(std::time::Duration::from_micros(200));
            assert_eq!(unsafe { gp_group_decode_held(shared.0, shared.1, bucket.as_mut_ptr(), n as u64) }, 0, "{}", last_error());
            std::thread::sleep(std::time::Duration::from_micros(200));
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            reader.join().unwrap()
        });
        assert!(checks.iter().all(|e| e.is_empty() || e.contains("a bucket already decoded")), "{:?}", checks.iter().find(|e| !e.is_empty()));
        assert_eq!(unsafe { gp_group_commit(g, p) }, 0, "{}", last_error());
    }
    unsafe { gp_group_free(g) };
}
