//! C ABI of the 2-bit codec.

use std::ffi::{c_int, c_void};

use half::{bf16, f16};

use super::{dtype_of, guard};
use crate::boundary::{slice, slice_mut, Raw};
use crate::codec::{self, Thresholds};
use crate::error::{Dtype, Error};

/// Length of the compressed array for `n` elements: `3 + ceil(n / 16)`.
#[no_mangle]
pub extern "C" fn gp_2bit_compressed_len(n: u64) -> u64 {
    codec::compressed_len(n as usize) as u64
}

/// Quantizes `n` gradient elements of type `dtype` (0 f32, 1 f16, 2 bf16) into
/// `compr` (`compr_len` floats) with error feedback in `residual` (`residual_len`
/// floats). All buffers belong to the caller and must not overlap. On error
/// (status -1) neither `residual` nor `compr` is written.
///
/// # Safety
/// Each pointer must be valid for its stated length (or NULL with length 0).
#[no_mangle]
pub unsafe extern "C" fn gp_2bit_quantize(
    grad: *const c_void,
    dtype: c_int,
    n: u64,
    residual: *mut f32,
    residual_len: u64,
    compr: *mut f32,
    compr_len: u64,
    neg_threshold: f32,
    pos_threshold: f32,
) -> c_int {
    guard(|| {
        let th = Thresholds::new(neg_threshold, pos_threshold)?;
        let d = dtype_of(dtype)?;
        // Bytes, not elements, so that one check serves every dtype; the
        // product must not wrap before Raw::new can see it.
        let bytes = n.checked_mul(d.size() as u64).ok_or_else(|| Error::InvalidParam {
            key: "grad".into(),
            problem: format!("{n} elements do not fit in memory"),
        })?;
        let g = Raw::new("grad", grad.cast::<u8>(), bytes)?;
        let r = Raw::new("residual", residual, residual_len)?;
        let c = Raw::new("compr", compr, compr_len)?;
        g.check_disjoint(&r)?;
        g.check_disjoint(&c)?;
        r.check_disjoint(&c)?;
        let residual = slice_mut(residual, residual_len);
        let compr = slice_mut(compr, compr_len);
        match d {
            Dtype::F32 => codec::quantize_2bit(slice(grad.cast::<f32>(), n), residual, compr, th),
            Dtype::F16 => codec::quantize_2bit(slice(grad.cast::<f16>(), n), residual, compr, th),
            Dtype::Bf16 => codec::quantize_2bit(slice(grad.cast::<bf16>(), n), residual, compr, th),
        }
    })
}

unsafe fn dequantize_common(compr: *const f32, compr_len: u64, out: *mut f32, n: u64, out_name: &'static str, add: bool) -> c_int {
    guard(|| {
        let c = Raw::new("compr", compr, compr_len)?;
        let o = Raw::new(out_name, out, n)?;
        c.check_disjoint(&o)?;
        let compr = slice(compr, compr_len);
        let out = slice_mut(out, n);
        if add {
            codec::dequantize_2bit_add(compr, out)
        } else {
            codec::dequantize_2bit(compr, out)
        }
    })
}

/// Decodes `compr` (`compr_len` floats) into `out` (`n` floats, which gives the
/// gradient size). Caller owns both; they must not overlap. On error `out` is
/// not written.
///
/// # Safety
/// Each pointer must be valid for its stated length (or NULL with length 0).
#[no_mangle]
pub unsafe extern "C" fn gp_2bit_dequantize(compr: *const f32, compr_len: u64, out: *mut f32, n: u64) -> c_int {
    dequantize_common(compr, compr_len, out, n, "out", false)
}

/// Like `gp_2bit_dequantize` but adds the decoded values into `sum`.
///
/// # Safety
/// Each pointer must be valid for its stated length (or NULL with length 0).
#[no_mangle]
pub unsafe extern "C" fn gp_2bit_dequantize_add(compr: *const f32, compr_len: u64, sum: *mut f32, n: u64) -> c_int {
    dequantize_common(compr, compr_len, sum, n, "sum", true)
}
