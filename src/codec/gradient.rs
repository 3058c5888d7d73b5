//! Element types a gradient may have. The trait is sealed: kernels rely on
//! `DTYPE` telling the true memory layout of `Self`.

use crate::error::Dtype;
use half::{bf16, f16};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// A gradient element: f32, f16 or bf16. Widening to f32 is exact for all three.
pub trait Gradient: sealed::Sealed + Copy + Send + Sync + 'static {
    /// The layout of `Self`; kernels reinterpret pointers according to it.
    const DTYPE: Dtype;
    fn to_f32(self) -> f32;
}

impl Gradient for f32 {
    const DTYPE: Dtype = Dtype::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Gradient for f16 {
    const DTYPE: Dtype = Dtype::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

impl Gradient for bf16 {
    const DTYPE: Dtype = Dtype::Bf16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        // bf16 is the upper half of an f32: widening is a shift, exact for every
        // bit pattern (NaN payloads included), which the AVX2 path reproduces.
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

/// A gradient slice of any supported element type (one device's push).
#[derive(Clone, Copy, Debug)]
pub enum Grad<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    Bf16(&'a [bf16]),
}

impl Grad<'_> {
    pub fn len(&self) -> usize {
        match self {
            Grad::F32(g) => g.len(),
            Grad::F16(g) => g.len(),
            Grad::Bf16(g) => g.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn dtype(&self) -> Dtype {
        match self {
            Grad::F32(_) => Dtype::F32,
            Grad::F16(_) => Dtype::F16,
            Grad::Bf16(_) => Dtype::Bf16,
        }
    }
}


impl<'a> Grad<'a> {
    /// The gradient as float32: borrowed when it is float32, widened (exactly,
    /// as the kernels widen) otherwise.
    pub fn to_f32(&self) -> std::borrow::Cow<'a, [f32]> {
        fn widen<G: Gradient>(g: &[G]) -> Vec<f32> {
            g.iter().map(|x| x.to_f32()).collect()
        }
        match *self {
            Grad::F32(g) => std::borrow::Cow::Borrowed(g),
            Grad::F16(g) => std::borrow::Cow::Owned(widen(g)),
            Grad::Bf16(g) => std::borrow::Cow::Owned(widen(g)),
        }
    }

    /// The elements in `range`.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Grad<'a> {
        match *self {
            Grad::F32(g) => Grad::F32(&g[range]),
            Grad::F16(g) => Grad::F16(&g[range]),
            Grad::Bf16(g) => Grad::Bf16(&g[range]),
        }
    }
}
