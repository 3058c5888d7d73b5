//! The C ABI (`include/gradpack/c_api.h`): `gp_<noun>_<verb>` functions that
//! return an `int` status (0 ok, -1 error) and leave the message in a
//! thread-local slot read by `gp_error_last()`. No panic crosses this boundary:
//! every export runs inside `guard`. Callers keep ownership of every buffer.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use half::{bf16, f16};

use crate::codec::{self, Platform, Thresholds};
use crate::error::{Error, Result};

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: String) {
    let c = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|slot| *slot.borrow_mut() = c);
}

/// Runs `f`, converting an error or a panic into status -1 and the last-error message.
pub(crate) fn guard(f: impl FnOnce() -> Result<()>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            set_last_error(e.to_string());
            -1
        }
        Err(panic) => {
            let what = panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned());
            set_last_error(Error::Internal(what.unwrap_or_else(|| "panic".into())).to_string());
            -1
        }
    }
}

/// The message of the last failed call on this thread. Owned by gradpack, valid
/// until the next failing call on the same thread; never NULL.
#[no_mangle]
pub extern "C" fn gp_error_last() -> *const c_char {
    LAST_ERROR.with(|slot| slot.borrow().as_ptr())
}

/// gradpack's version, a static string.
#[no_mangle]
pub extern "C" fn gp_version() -> *const c_char {
    static VERSION: &CStr = match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
        Ok(v) => v,
        Err(_) => panic!("version has a NUL"),
    };
    VERSION.as_ptr()
}

/// Name of the codec kernel chosen for this CPU ("avx2" or "portable"), static.
#[no_mangle]
pub extern "C" fn gp_kernel_name() -> *const c_char {
    match Platform::detect() {
        Platform::Avx2 => c"avx2".as_ptr(),
        Platform::Portable => c"portable".as_ptr(),
    }
}

/// Length of the compressed array for `n` elements: `3 + ceil(n / 16)`.
#[no_mangle]
pub extern "C" fn gp_2bit_compressed_len(n: u64) -> u64 {
    codec::compressed_len(n as usize) as u64
}

/// A raw buffer described by the caller, checked before it becomes a slice.
struct Raw {
    what: &'static str,
    addr: usize,
    bytes: usize,
}

impl Raw {
    fn new<T>(what: &'static str, ptr: *const T, len: u64) -> Result<Raw> {
        if ptr.is_null() && len > 0 {
            return Err(Error::NullPointer { what });
        }
        Ok(Raw { what, addr: ptr as usize, bytes: len as usize * std::mem::size_of::<T>() })
    }

    fn check_disjoint(&self, other: &Raw) -> Result<()> {
        let overlap = self.bytes > 0 && other.bytes > 0 && self.addr < other.addr + other.bytes && other.addr < self.addr + self.bytes;
        if overlap {
            Err(Error::OverlappingBuffers { a: self.what, b: other.what })
        } else {
            Ok(())
        }
    }
}

/// # Safety
/// `ptr` must be valid for `len` reads of T (checked non-null when len > 0).
unsafe fn slice<'a, T>(ptr: *const T, len: u64) -> &'a [T] {
    if len == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(ptr, len as usize)
    }
}

/// # Safety
/// `ptr` must be valid for `len` reads and writes of T and not aliased.
unsafe fn slice_mut<'a, T>(ptr: *mut T, len: u64) -> &'a mut [T] {
    if len == 0 {
        &mut []
    } else {
        std::slice::from_raw_parts_mut(ptr, len as usize)
    }
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
        let elem = match dtype {
            0 => 4,
            1 | 2 => 2,
            other => return Err(Error::UnknownDtype(other)),
        };
        let g = Raw::new("grad", grad.cast::<u8>(), n * elem)?;
        let r = Raw::new("residual", residual, residual_len)?;
        let c = Raw::new("compr", compr, compr_len)?;
        g.check_disjoint(&r)?;
        g.check_disjoint(&c)?;
        r.check_disjoint(&c)?;
        let residual = slice_mut(residual, residual_len);
        let compr = slice_mut(compr, compr_len);
        match dtype {
            0 => codec::quantize_2bit(slice(grad.cast::<f32>(), n), residual, compr, th),
            1 => codec::quantize_2bit(slice(grad.cast::<f16>(), n), residual, compr, th),
            _ => codec::quantize_2bit(slice(grad.cast::<bf16>(), n), residual, compr, th),
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
