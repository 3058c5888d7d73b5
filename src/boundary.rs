//! The one checked boundary: where a caller's raw memory (a C pointer and a
//! length, or a C++ address) becomes a Rust slice. Both fronts pass through
//! here, the C ABI (`capi`) and the cxx bridge (`bridge`): a buffer is
//! checked (NULL only when empty, a byte length that neither overflows nor
//! passes `isize::MAX` or the end of the address space) before any slice
//! exists; a store call's outputs are checked pairwise disjoint, and an input
//! that shares memory with an output is copied first, so a `&[T]` and a
//! `&mut [f32]` over one byte never live at once (MXNet's Trainer pushpulls a
//! gradient into itself).
//!
//! Lifetimes: a slice made here lives for a lifetime the caller picks, which
//! is the one call of a front function that received the pointer (a front's
//! contract says the memory stays valid and unshared until the call
//! returns); nothing here is widened to `'static`.

use std::marker::PhantomData;

use crate::codec::Grad;
use crate::error::{Error, Result};
use crate::store::{Array, ArrayMut};

/// A raw buffer described by a caller, checked before it becomes a slice.
#[derive(Clone, Debug)]
pub(crate) struct Raw {
    what: &'static str,
    addr: usize,
    bytes: usize,
}

impl Raw {
    /// `len` elements of `T` at `ptr`: NULL only when empty, and a span that
    /// fits a slice (at most `isize::MAX` bytes, not wrapping the address space).
    pub(crate) fn new<T>(what: &'static str, ptr: *const T, len: u64) -> Result<Raw> {
        if ptr.is_null() && len > 0 {
            return Err(Error::NullPointer { what });
        }
        let bytes = usize::try_from(len)
            .ok()
            .and_then(|n| n.checked_mul(std::mem::size_of::<T>()))
            .filter(|&b| b <= isize::MAX as usize && (ptr as usize).checked_add(b).is_some())
            .ok_or_else(|| Error::InvalidParam { key: what.into(), problem: format!("{len} elements do not fit in memory") })?;
        Ok(Raw { what, addr: ptr as usize, bytes })
    }

    /// Elements of `T` the buffer spans.
    pub(crate) fn len<T>(&self) -> u64 {
        (self.bytes / std::mem::size_of::<T>()) as u64
    }

    /// True when the two buffers share a byte (`new` checked that neither
    /// wraps the address space).
    pub(crate) fn overlaps(&self, other: &Raw) -> bool {
        self.bytes > 0 && other.bytes > 0 && self.addr < other.addr + other.bytes && other.addr < self.addr + self.bytes
    }

    pub(crate) fn check_disjoint(&self, other: &Raw) -> Result<()> {
        if self.overlaps(other) {
            Err(Error::OverlappingBuffers { a: self.what, b: other.what })
        } else {
            Ok(())
        }
    }
}

/// # Safety
/// `ptr` is valid for `len` reads of `T` for `'a`, and nothing writes that
/// memory meanwhile; `Raw::new` accepted `(ptr, len)` (so NULL only when empty).
pub(crate) unsafe fn slice<'a, T>(ptr: *const T, len: u64) -> &'a [T] {
    if len == 0 {
        &[]
    } else {
        // SAFETY: the function's contract; Raw::new bounded len * size_of::<T>().
        unsafe { std::slice::from_raw_parts(ptr, len as usize) }
    }
}

/// # Safety
/// `ptr` is valid for `len` reads and writes of `T` for `'a`, and no other
/// reference to that memory is alive; `Raw::new` accepted `(ptr, len)`.
pub(crate) unsafe fn slice_mut<'a, T>(ptr: *mut T, len: u64) -> &'a mut [T] {
    if len == 0 {
        &mut []
    } else {
        // SAFETY: the function's contract; Raw::new bounded len * size_of::<T>().
        unsafe { std::slice::from_raw_parts_mut(ptr, len as usize) }
    }
}

/// One input array of a store call: borrowed, or copied (widened to float32,
/// which every store computes with) when it overlaps an output.
enum Input<'a> {
    Borrowed(Grad<'a>),
    Copied(Vec<f32>),
}

/// A store call's input arrays, each with its shape.
pub(crate) struct Inputs<'a>(Vec<(Vec<usize>, Input<'a>)>);

impl<'a> Inputs<'a> {
    /// Checks and takes one input of `shape` (`n` elements, counted with
    /// `store::elements`) whose data starts at `data`, a `dtype` array.
    ///
    /// # Safety
    /// `data` is valid for `n` reads of its dtype for `'a`, and nothing
    /// writes it meanwhile except, possibly, the memory of `outputs` (the
    /// call's outputs, none of which exists as a slice yet).
    pub(crate) unsafe fn push(&mut self, shape: Vec<usize>, data: RawGrad, n: u64, outputs: &[Raw]) -> Result<()> {
        // SAFETY (each arm): the function's contract, and Raw::new checked the span first.
        let (raw, grad) = match data {
            RawGrad::F32(p) => (Raw::new("value data", p, n)?, Grad::F32(unsafe { slice(p, n) })),
            RawGrad::F16(p) => (Raw::new("value data", p, n)?, Grad::F16(unsafe { slice(p, n) })),
            RawGrad::Bf16(p) => (Raw::new("value data", p, n)?, Grad::Bf16(unsafe { slice(p, n) })),
        };
        let input = if outputs.iter().any(|o| o.overlaps(&raw)) { Input::Copied(grad.to_f32().into_owned()) } else { Input::Borrowed(grad) };
        self.0.push((shape, input));
        Ok(())
    }

    pub(crate) fn new() -> Inputs<'a> {
        Inputs(Vec::new())
    }

    /// The inputs as the store takes them.
    pub(crate) fn views(&self) -> Vec<Array<'_>> {
        self.0
            .iter()
            .map(|(shape, input)| Array {
                shape,
                data: match input {
                    Input::Borrowed(g) => *g,
                    Input::Copied(v) => Grad::F32(v),
                },
            })
            .collect()
    }
}

/// An input array's data pointer, by dtype.
#[derive(Clone, Copy)]
pub(crate) enum RawGrad {
    F32(*const f32),
    F16(*const half::f16),
    Bf16(*const half::bf16),
}

/// A store call's outputs, checked (non-null, in memory, pairwise disjoint)
/// but not yet slices: `slices` makes them once the inputs are safe.
pub(crate) struct Outputs<'a> {
    arrays: Vec<(Vec<usize>, Raw, *mut f32)>,
    memory: PhantomData<&'a mut [f32]>,
}

impl<'a> Outputs<'a> {
    pub(crate) fn new() -> Outputs<'a> {
        Outputs { arrays: Vec::new(), memory: PhantomData }
    }

    /// Checks and takes one output of `shape` (`n` float32 elements) at `data`.
    pub(crate) fn push(&mut self, shape: Vec<usize>, data: *mut f32, n: u64) -> Result<()> {
        let raw = Raw::new("output data", data, n)?;
        for (_, r, _) in &self.arrays {
            r.check_disjoint(&raw)?;
        }
        self.arrays.push((shape, raw, data));
        Ok(())
    }

    /// The outputs' spans, for `Inputs::push`.
    pub(crate) fn raws(&self) -> Vec<Raw> {
        self.arrays.iter().map(|(_, r, _)| r.clone()).collect()
    }

    /// # Safety
    /// Each output's memory is valid for reads and writes for `'a` and no
    /// other reference to it is alive (inputs that overlap it were copied by
    /// `Inputs::push`, which was told of it).
    pub(crate) unsafe fn slices(&mut self) -> Vec<ArrayMut<'_>> {
        // SAFETY: the function's contract; `push` checked each span and that
        // the outputs are pairwise disjoint.
        self.arrays.iter().map(|(shape, raw, data)| ArrayMut { shape, data: unsafe { slice_mut(*data, raw.len::<f32>()) } }).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_is_checked_before_it_is_a_slice() {
        assert!(matches!(Raw::new::<f32>("data", std::ptr::null(), 1), Err(Error::NullPointer { what: "data" })));
        assert_eq!(Raw::new::<f32>("data", std::ptr::null(), 0).unwrap().len::<f32>(), 0);
        let err = Raw::new::<f32>("data", 16 as *const f32, u64::MAX / 2).unwrap_err().to_string();
        assert!(err.contains("do not fit in memory"), "{err}");
        // A span that would wrap the address space.
        assert!(Raw::new::<f32>("data", (usize::MAX - 7) as *const f32, 4).is_err());
    }

    #[test]
    fn outputs_are_disjoint_and_an_input_that_shares_memory_with_one_is_copied() {
        let mut memory = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let base = memory.as_mut_ptr();
        let mut outputs = Outputs::new();
        outputs.push(vec![2], base, 2).unwrap();
        // SAFETY (here and below): the pointers lie inside `memory`, which outlives the test's slices.
        let err = outputs.push(vec![2], unsafe { base.add(1) }, 2).unwrap_err();
        assert!(matches!(err, Error::OverlappingBuffers { a: "output data", b: "output data" }), "{err}");
        outputs.push(vec![2], unsafe { base.add(4) }, 2).unwrap();
        let mut inputs = Inputs::new();
        unsafe { inputs.push(vec![2], RawGrad::F32(base), 2, &outputs.raws()).unwrap() };
        unsafe { inputs.push(vec![2], RawGrad::F32(base.add(2)), 2, &outputs.raws()).unwrap() };
        assert!(matches!(inputs.0[0].1, Input::Copied(_)), "overlaps output 0");
        assert!(matches!(inputs.0[1].1, Input::Borrowed(_)), "shares nothing with an output");
        for o in unsafe { outputs.slices() } {
            o.data.fill(0.0);
        }
        let views = inputs.views();
        assert_eq!(views[0].data.to_f32().as_ref(), &[1.0, 2.0], "the copy kept the value the call was given");
        assert_eq!(views[1].data.to_f32().as_ref(), &[3.0, 4.0]);
    }
}
