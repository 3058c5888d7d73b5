//! The checks every store runs before it changes anything: shapes (with
//! checked arithmetic), dtypes, outputs, the rule that compression comes
//! before the first init, and a key's lock, which turns a poisoned key into
//! an error. Validate, then mutate: no function here changes a store.

use std::sync::Mutex;

use super::{Array, ArrayMut, Key};
use crate::quant::compression::Compression;
use crate::error::{Dtype, Error, Result};

/// The rule of every store, as MXNet's: compression is chosen before the
/// first init, so no residual is ever dropped or reinterpreted.
pub(crate) fn check_compress_before_init(keys: usize) -> Result<()> {
    if keys > 0 {
        return Err(Error::Store(format!("set the gradient compression before initializing any key ({keys} already initialized)")));
    }
    Ok(())
}

/// A key's lock. A panic while it was held (a bug; caller's updaters are
/// caught before that) leaves the key unusable with this error, never a panic.
pub(crate) fn lock<'a, T>(key: &Key, entry: &'a Mutex<T>) -> Result<std::sync::MutexGuard<'a, T>> {
    entry.lock().map_err(|_| key_error(key, "an earlier call panicked while changing this key; its state is unknown, so it refuses every call"))
}

pub(crate) fn key_error(key: &Key, problem: impl Into<String>) -> Error {
    Error::Key { key: key.to_string(), problem: problem.into() }
}

/// The element count of a shape from outside, with checked arithmetic: a
/// product that overflows, or more float32 bytes than a slice may span, is an
/// error (never a wrapped count such as [2^32, 2^32] -> 0).
pub fn elements(shape: &[usize]) -> Result<usize> {
    // The other dimensions must fit beside a zero too, whatever their order:
    // code that walks a shape multiplies its dimensions in any order.
    shape
        .iter()
        .filter(|&&d| d != 0)
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .filter(|&n| n.checked_mul(std::mem::size_of::<f32>()).is_some_and(|b| b <= isize::MAX as usize))
        .map(|n| if shape.contains(&0) { 0 } else { n })
        .ok_or_else(|| Error::InvalidParam { key: "shape".into(), problem: format!("{shape:?} has more elements than memory can hold") })
}

pub(crate) fn check_shape(key: &Key, what: &str, shape: &[usize], len: usize, want: &[usize]) -> Result<()> {
    if elements(shape).map_err(|e| key_error(key, format!("{what}: {e}")))? != len {
        return Err(key_error(key, format!("{what} has shape {shape:?} but {len} elements")));
    }
    if shape != want {
        return Err(key_error(key, format!("{what} has shape {shape:?}, expected {want:?}")));
    }
    Ok(())
}

/// The checks of a push, shared by every store: values present, each of the
/// key's shape, and without compression of the key's dtype (`half`: float16).
pub(crate) fn check_push(key: &Key, values: &[Array], shape: &[usize], compression: Compression, half: bool) -> Result<()> {
    if values.is_empty() {
        return Err(key_error(key, "push of an empty list of values"));
    }
    let want = if half { Dtype::F16 } else { Dtype::F32 };
    for (i, v) in values.iter().enumerate() {
        check_shape(key, &format!("pushed value {i}"), v.shape, v.data.len(), shape)?;
        if compression.is_none() && v.data.dtype() != want {
            return Err(key_error(key, format!("pushed value {i} has dtype {}; without compression values must have the key's dtype, {want}", v.data.dtype())));
        }
    }
    Ok(())
}

/// The checks of a pull: outputs present, each of the key's shape.
pub(crate) fn check_outputs(key: &Key, what: &str, outs: &[ArrayMut], shape: &[usize]) -> Result<()> {
    if outs.is_empty() {
        return Err(key_error(key, format!("{what} into an empty list of outputs")));
    }
    for (i, o) in outs.iter().enumerate() {
        check_shape(key, &format!("{what} output {i}"), o.shape, o.data.len(), shape)?;
    }
    Ok(())
}

