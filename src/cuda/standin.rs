//! The CUDA API without the `cuda` feature: the same entry points, each
//! returning "CUDA not available" (`Ops` has no values, so its methods
//! never run).

use super::{Buf, RawStream};
use crate::codec::Thresholds;
use crate::error::{Dtype, Error, Result};

fn unavailable() -> Error {
    Error::CudaUnavailable("gradpack was built without its `cuda` feature".into())
}

pub fn driver_available() -> Result<()> {
    Err(unavailable())
}

pub fn nvrtc_available() -> Result<()> {
    Err(unavailable())
}

pub fn device_count() -> Result<usize> {
    Err(unavailable())
}

/// A GPU: never made in this build.
pub struct Gpu {
    _none: (),
}

impl Gpu {
    pub fn new(_ordinal: usize) -> Result<Gpu> {
        Err(unavailable())
    }
}

pub fn pointer_device(_ptr: u64) -> Result<usize> {
    Err(unavailable())
}

/// A borrowed stream: never made in this build.
pub struct Borrowed {
    _none: (),
}

impl Borrowed {
    /// # Safety
    /// None needed: nothing runs.
    pub unsafe fn new(_ordinal: usize, _stream: RawStream) -> Result<Borrowed> {
        Err(unavailable())
    }

    pub fn ops(&self) -> Ops {
        unreachable!("no Borrowed exists without the cuda feature")
    }
}

/// # Safety
/// None needed: nothing runs.
pub unsafe fn reduce_2bit_raw(_members: &[(Ops, Buf, Buf)], _dtype: Dtype, merge: &Ops, _sum: Buf, _th: Thresholds) -> Result<()> {
    match *merge {}
}

/// Kernel launches on one stream: no value exists in this build.
pub enum Ops {}

/// # Safety
/// None needed: nothing runs.
pub unsafe fn with_borrowed_stream<T>(_ordinal: usize, _stream: RawStream, _f: impl FnOnce(&Ops) -> Result<T>) -> Result<T> {
    Err(unavailable())
}

#[allow(clippy::missing_safety_doc, clippy::too_many_arguments)]
impl Ops {
    pub fn check(&self, _: &[Buf]) -> Result<()> {
        match *self {}
    }
    pub unsafe fn quantize_2bit(&self, _: Buf, _: Dtype, _: Buf, _: Buf, _: Thresholds) -> Result<()> {
        match *self {}
    }
    pub unsafe fn quantize_2bit_to(&self, _: Buf, _: Dtype, _: Buf, _: Buf, _: Buf, _: Thresholds) -> Result<()> {
        match *self {}
    }
    pub unsafe fn dequantize_2bit(&self, _: Buf, _: Buf, _: bool) -> Result<()> {
        match *self {}
    }
    pub unsafe fn max_abs(&self, _: Buf) -> Result<Option<f32>> {
        match *self {}
    }
    pub unsafe fn qsgd_quantize(&self, _: Buf, _: f32, _: u32, _: u64, _: usize, _: Buf, _: bool) -> Result<()> {
        match *self {}
    }
    pub unsafe fn qsgd_decode(&self, _: Buf, _: f32, _: u32, _: Buf) -> Result<()> {
        match *self {}
    }
    pub unsafe fn onebit_quantize(&self, _: Buf, _: Buf, _: f32, _: Buf, _: bool) -> Result<()> {
        match *self {}
    }
    pub unsafe fn onebit_decode(&self, _: Buf, _: u32, _: Buf) -> Result<()> {
        match *self {}
    }
    pub unsafe fn gather(&self, _: Buf, _: Buf, _: Buf) -> Result<()> {
        match *self {}
    }
    pub unsafe fn scatter(&self, _: Buf, _: Buf, _: Buf) -> Result<()> {
        match *self {}
    }
}
