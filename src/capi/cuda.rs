//! C ABI of the CUDA kernels: device pointers and a stream (`CUstream`,
//! NULL for the legacy default stream) of GPU `device`'s primary context,
//! the context CuPy, PyTorch and MXNet use. Each call enqueues on that
//! stream and synchronizes it before returning its status, so an error
//! comes back from the call that caused it. Every pointer is checked to
//! lie, with its stated length, inside one allocation of `device`
//! (cuMemGetAddressRange), and no output may overlap another buffer.
//! Without the `cuda` feature, a driver or such a GPU, every call fails
//! with "CUDA not available: ...".

use std::ffi::{c_int, c_void};

use super::{dtype_of, guard};
use crate::codec::{self, Thresholds};
use crate::cuda::{self, Buf, Ops, RawStream};
use crate::error::{Dtype, Error, Result};

fn buf<T>(what: &'static str, ptr: *const T, len: u64) -> Result<Buf> {
    let len = usize::try_from(len).map_err(|_| Error::InvalidParam { key: what.into(), problem: format!("{len} elements do not fit in memory") })?;
    Ok(Buf { what, ptr: ptr as u64, len, elem: std::mem::size_of::<T>() })
}

/// A gradient of `n` elements of `dtype` (0 f32, 1 f16, 2 bf16, as `gp_2bit_quantize`).
fn grad_buf(grad: *const c_void, dtype: c_int, n: u64) -> Result<(Buf, Dtype)> {
    let d = dtype_of(dtype)?;
    let mut b = buf("grad", grad.cast::<u8>(), n)?;
    b.elem = d.size();
    Ok((b, d))
}

fn ordinal(device: c_int) -> Result<usize> {
    usize::try_from(device).map_err(|_| Error::InvalidParam { key: "device".into(), problem: format!("must be >= 0, got {device}") })
}

/// Runs `f` on GPU `device` with the caller's stream.
///
/// # Safety
/// `stream` is null or a live stream of `device`'s primary context.
unsafe fn on(device: c_int, stream: RawStream, f: impl FnOnce(&Ops) -> Result<()>) -> c_int {
    guard(|| {
        let d = ordinal(device)?;
        // SAFETY: the caller's precondition.
        unsafe { cuda::with_borrowed_stream(d, stream, f) }
    })
}

/// 0 when a CUDA driver and NVRTC can be loaded and GPU `device` exists;
/// -1 otherwise, with the reason in `gp_error_last()`.
#[no_mangle]
pub extern "C" fn gp_cuda_available(device: c_int) -> c_int {
    guard(|| {
        let d = ordinal(device)?;
        cuda::nvrtc_available()?;
        let count = cuda::device_count()?;
        if d >= count {
            return Err(Error::CudaUnavailable(format!("GPU {d} was asked for; this machine has {count}")));
        }
        Ok(())
    })
}

/// The GPU that device pointer `ptr` belongs to, into `*device`.
///
/// # Safety
/// `device` is a host pointer to an int.
#[no_mangle]
pub unsafe extern "C" fn gp_cuda_pointer_device(ptr: *const c_void, device: *mut c_int) -> c_int {
    guard(|| {
        if device.is_null() {
            return Err(Error::NullPointer { what: "device" });
        }
        let d = cuda::pointer_device(ptr as u64)?;
        // SAFETY: checked non-null; the caller's precondition.
        unsafe { *device = d as c_int };
        Ok(())
    })
}

/// The device store's compressed Reduce across GPUs: member `i` (gradient
/// `grads[i]` and residual `residuals[i]`, `n` floats each, on GPU
/// `devices[i]`, stream `streams[i]`) quantizes with error feedback; GPU
/// `merge_device` decodes and sums the compressed arrays, in member order,
/// into `sum` on `merge_stream`. Bit-identical to the CPU device store. On
/// error (a non-finite residual + gradient of any member included) nothing
/// is written.
///
/// # Safety
/// The arrays hold `num` entries; each stream is null or a live stream of
/// its device's primary context; every buffer is device memory that stays
/// allocated until the call returns.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
// Without the feature `Ops` has no values, so the code after `ops()` is dead.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables, unreachable_code))]
pub unsafe extern "C" fn gp_cuda_2bit_reduce(
    num: u32,
    devices: *const c_int,
    streams: *const RawStream,
    grads: *const *const c_void,
    dtype: c_int,
    residuals: *const *mut f32,
    n: u64,
    merge_device: c_int,
    merge_stream: RawStream,
    sum: *mut f32,
    neg_threshold: f32,
    pos_threshold: f32,
) -> c_int {
    guard(|| {
        let th = Thresholds::new(neg_threshold, pos_threshold)?;
        for (p, what) in [(devices as *const c_void, "devices"), (streams.cast(), "streams"), (grads.cast(), "grads"), (residuals.cast(), "residuals")] {
            if p.is_null() && num > 0 {
                return Err(Error::NullPointer { what });
            }
        }
        let num = num as usize;
        // SAFETY: non-null (checked) arrays of num entries (the caller's precondition).
        let (devices, streams, grads, residuals) = unsafe {
            (
                std::slice::from_raw_parts(devices, num),
                std::slice::from_raw_parts(streams, num),
                std::slice::from_raw_parts(grads, num),
                std::slice::from_raw_parts(residuals, num),
            )
        };
        let mut borrowed = Vec::with_capacity(num);
        for (&d, &s) in devices.iter().zip(streams) {
            // SAFETY: the caller's precondition on each stream.
            borrowed.push(unsafe { cuda::Borrowed::new(ordinal(d)?, s)? });
        }
        // SAFETY: as above.
        let merge = unsafe { cuda::Borrowed::new(ordinal(merge_device)?, merge_stream)? };
        let mut members = Vec::with_capacity(num);
        let d = dtype_of(dtype)?;
        for (b, (&g, &r)) in borrowed.iter().zip(grads.iter().zip(residuals)) {
            members.push((b.ops(), grad_buf(g, dtype, n)?.0, buf("residual", r, n)?));
        }
        // SAFETY: the caller's precondition; the core checks every buffer.
        unsafe { cuda::reduce_2bit_raw(&members, d, &merge.ops(), buf("sum", sum, n)?, th) }
    })
}

/// `gp_2bit_quantize` on the GPU (gradients of `dtype`: 0 float32, 1
/// float16, 2 bfloat16; residual and compr float32): validates that
/// residual + gradient is finite first, so on error (-1) nothing is written.
///
/// # Safety
/// `stream` as in `gp_cuda_available`'s notes; every pointer is device
/// memory that stays allocated until the call returns.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn gp_cuda_2bit_quantize(device: c_int, stream: RawStream, grad: *const c_void, dtype: c_int, n: u64, residual: *mut f32, compr: *mut f32, compr_len: u64, neg_threshold: f32, pos_threshold: f32) -> c_int {
    // SAFETY: the caller's precondition; Ops checks each pointer's allocation.
    unsafe {
        on(device, stream, |o| {
            let th = Thresholds::new(neg_threshold, pos_threshold)?;
            let (g, d) = grad_buf(grad, dtype, n)?;
            o.quantize_2bit(g, d, buf("residual", residual, n)?, buf("compr", compr, compr_len)?, th)
        })
    }
}

/// One-pass 2-bit quantize: reads `residual`, writes the next residual to
/// `next` and the compressed array to `compr`. On error (-1) `residual` is
/// untouched and `next`/`compr` hold garbage (swap `next` in on success).
///
/// # Safety
/// As `gp_cuda_2bit_quantize`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn gp_cuda_2bit_quantize_to(device: c_int, stream: RawStream, grad: *const c_void, dtype: c_int, n: u64, residual: *const f32, next: *mut f32, compr: *mut f32, compr_len: u64, neg_threshold: f32, pos_threshold: f32) -> c_int {
    // SAFETY: as above.
    unsafe {
        on(device, stream, |o| {
            let th = Thresholds::new(neg_threshold, pos_threshold)?;
            let (g, d) = grad_buf(grad, dtype, n)?;
            o.quantize_2bit_to(g, d, buf("residual", residual, n)?, buf("next", next, n)?, buf("compr", compr, compr_len)?, th)
        })
    }
}

/// `out = decode(compr)` (`add` = 0) or `out += decode(compr)` (`add` != 0),
/// after checking the header and every code; on error nothing is written.
///
/// # Safety
/// As `gp_cuda_2bit_quantize`.
#[no_mangle]
pub unsafe extern "C" fn gp_cuda_2bit_dequantize(device: c_int, stream: RawStream, compr: *const f32, compr_len: u64, out: *mut f32, n: u64, add: c_int) -> c_int {
    // SAFETY: as above.
    unsafe { on(device, stream, |o| o.dequantize_2bit(buf("compr", compr, compr_len)?, buf("out", out, n)?, add != 0)) }
}

/// Length of the compressed array for `n` elements (as `gp_2bit_compressed_len`).
#[no_mangle]
pub extern "C" fn gp_cuda_2bit_compressed_len(n: u64) -> u64 {
    codec::compressed_len(n as usize) as u64
}

/// `max |x|` into `*max_abs` and whether every element is finite into `*finite`.
///
/// # Safety
/// As `gp_cuda_2bit_quantize`; `max_abs` and `finite` are host pointers.
#[no_mangle]
pub unsafe extern "C" fn gp_cuda_max_abs(device: c_int, stream: RawStream, x: *const f32, n: u64, max_abs: *mut f32, finite: *mut c_int) -> c_int {
    if max_abs.is_null() || finite.is_null() {
        return guard(|| Err(Error::NullPointer { what: "max_abs/finite" }));
    }
    // SAFETY: as above; the host pointers were checked non-null.
    unsafe {
        on(device, stream, |o| {
            let m = o.max_abs(buf("x", x, n)?)?;
            *max_abs = m.unwrap_or(f32::NAN);
            *finite = m.is_some() as c_int;
            Ok(())
        })
    }
}

/// QSGD codes of `grad` at scale `scale` (>= max |grad|) with `bits` bits,
/// noise stream `seed` from element `offset` on; added into `codes` when
/// `add` != 0. Bit-identical to the CPU's.
///
/// # Safety
/// As `gp_cuda_2bit_quantize`.
#[no_mangle]
pub unsafe extern "C" fn gp_cuda_qsgd_quantize(device: c_int, stream: RawStream, grad: *const f32, n: u64, scale: f32, bits: u32, seed: u64, offset: u64, codes: *mut i32, add: c_int) -> c_int {
    // SAFETY: as above.
    unsafe {
        on(device, stream, |o| {
            let offset = usize::try_from(offset).map_err(|_| Error::InvalidParam { key: "offset".into(), problem: format!("{offset} does not fit") })?;
            o.qsgd_quantize(buf("grad", grad, n)?, scale, bits, seed, offset, buf("codes", codes, n)?, add != 0)
        })
    }
}

/// `out = codes * scale / (2^bits - 1)`.
///
/// # Safety
/// As `gp_cuda_2bit_quantize`.
#[no_mangle]
pub unsafe extern "C" fn gp_cuda_qsgd_decode(device: c_int, stream: RawStream, codes: *const i32, n: u64, scale: f32, bits: u32, out: *mut f32) -> c_int {
    // SAFETY: as above.
    unsafe { on(device, stream, |o| o.qsgd_decode(buf("codes", codes, n)?, scale, bits, buf("out", out, n)?)) }
}

/// 1-bit quantize with error feedback into `residual`; bits (0/1) written,
/// or added when `add` != 0. A non-finite residual + gradient fails first.
///
/// # Safety
/// As `gp_cuda_2bit_quantize`.
#[no_mangle]
pub unsafe extern "C" fn gp_cuda_1bit_quantize(device: c_int, stream: RawStream, grad: *const f32, n: u64, residual: *mut f32, threshold: f32, bits: *mut i32, add: c_int) -> c_int {
    // SAFETY: as above.
    unsafe { on(device, stream, |o| o.onebit_quantize(buf("grad", grad, n)?, buf("residual", residual, n)?, threshold, buf("bits", bits, n)?, add != 0)) }
}

/// `out = 2 counts - workers`.
///
/// # Safety
/// As `gp_cuda_2bit_quantize`.
#[no_mangle]
pub unsafe extern "C" fn gp_cuda_1bit_decode(device: c_int, stream: RawStream, counts: *const i32, n: u64, workers: u32, out: *mut f32) -> c_int {
    // SAFETY: as above.
    unsafe { on(device, stream, |o| o.onebit_decode(buf("counts", counts, n)?, workers, buf("out", out, n)?)) }
}

/// Random-K's gather, `out[j] = x[idx[j]]`, every index checked below `n`.
///
/// # Safety
/// As `gp_cuda_2bit_quantize`.
#[no_mangle]
pub unsafe extern "C" fn gp_cuda_gather(device: c_int, stream: RawStream, x: *const f32, n: u64, idx: *const u64, k: u64, out: *mut f32) -> c_int {
    // SAFETY: as above.
    unsafe { on(device, stream, |o| o.gather(buf("x", x, n)?, buf("idx", idx, k)?, buf("out", out, k)?)) }
}

/// Random-K's decode, `out = 0; out[idx[j]] = v[j]`, every index checked below `n`.
///
/// # Safety
/// As `gp_cuda_2bit_quantize`.
#[no_mangle]
pub unsafe extern "C" fn gp_cuda_scatter(device: c_int, stream: RawStream, v: *const f32, idx: *const u64, k: u64, out: *mut f32, n: u64) -> c_int {
    // SAFETY: as above.
    unsafe { on(device, stream, |o| o.scatter(buf("v", v, k)?, buf("idx", idx, k)?, buf("out", out, n)?)) }
}
