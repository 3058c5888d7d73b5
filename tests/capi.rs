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
}
