//! The C ABI (`include/gradpack/c_api.h`): `gp_<noun>_<verb>` functions that
//! return an `int` status (0 ok, -1 error) and leave the message in a
//! thread-local slot read by `gp_error_last()`. No panic crosses this boundary:
//! every export runs inside `guard`. Each function's doc says who owns what.

mod codec;
mod cuda;
mod group;
mod kvstore;
/// The MXNet operator library's entry points (feature `mxnet`), exported under
/// the names MXNet looks up; build.rs writes one jump per name in lib_api.h.
#[cfg(feature = "mxnet")]
#[allow(non_snake_case)]
mod mxnet_exports {
    #[cfg(not(target_arch = "x86_64"))]
    compile_error!("feature `mxnet`: the entry-point jumps are written for x86_64, the only arch of MXNet 1.9.1's wheels");
    include!(concat!(env!("OUT_DIR"), "/mxnet_exports.rs"));
}

pub use codec::*;
pub use cuda::*;
pub use group::*;
pub use kvstore::*;

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CStr, CString};

use crate::boundary::{slice, Raw};
use crate::codec::Platform;
use crate::error::{Error, Result};

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: String) {
    let c = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|slot| *slot.borrow_mut() = c);
}

/// Runs `f`, converting an error or a panic into status -1 and the last-error message.
pub(crate) fn guard(f: impl FnOnce() -> Result<()>) -> i32 {
    match crate::error::catch_panic(f) {
        Ok(()) => 0,
        Err(e) => {
            set_last_error(e.to_string());
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

/// Name of the instruction set the scheme kernels run on this CPU
/// ("portable", "avx2" or "avx512", capped by `GRADPACK_KERNEL`), static.
#[no_mangle]
pub extern "C" fn gp_scheme_kernel_name() -> *const c_char {
    crate::isa::Isa::detect().c_name().as_ptr()
}

/// The element type a caller's dtype code names (0 f32, 1 f16, 2 bf16).
pub(crate) fn dtype_of(code: std::ffi::c_int) -> Result<crate::error::Dtype> {
    use crate::error::Dtype;
    match code {
        0 => Ok(Dtype::F32),
        1 => Ok(Dtype::F16),
        2 => Ok(Dtype::Bf16),
        other => Err(Error::UnknownDtype(other)),
    }
}

/// # Safety
/// `p` is NULL or a NUL-terminated string.
pub(crate) unsafe fn cstr<'a>(p: *const c_char, what: &'static str) -> Result<&'a str> {
    if p.is_null() {
        return Err(Error::NullPointer { what });
    }
    CStr::from_ptr(p).to_str().map_err(|_| Error::InvalidParam { key: what.into(), problem: "is not UTF-8".into() })
}

/// # Safety
/// `keys` and `vals` are NULL (with `num` 0) or point to `num` NUL-terminated strings each.
/// A count the caller gives as a C int: negative is refused, naming it.
pub(crate) fn count(num: c_int, what: &str) -> Result<u64> {
    u64::try_from(num).map_err(|_| Error::InvalidParam { key: what.into(), problem: format!("a count of {num} (it must be 0 or more)") })
}

pub(crate) unsafe fn params<'a>(keys: *const *const c_char, vals: *const *const c_char, num: c_int) -> Result<Vec<(&'a str, &'a str)>> {
    let n = count(num, "num")?;
    Raw::new("param keys", keys, n)?;
    Raw::new("param values", vals, n)?;
    slice(keys, n).iter().zip(slice(vals, n)).map(|(&k, &v)| Ok((cstr(k, "param key")?, cstr(v, "param value")?))).collect()
}
