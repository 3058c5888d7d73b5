//! Which kernel runs: detected once, cached in one enum.

use std::sync::OnceLock;

use super::gradient::Gradient;
#[cfg(target_arch = "x86_64")]
use super::avx2;
use super::{check_len, portable, Thresholds};
use crate::error::Result;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Platform {
    /// Runs everywhere.
    Portable,
    /// x86-64 with AVX2 and F16C.
    Avx2,
}

impl Platform {
    /// The fastest kernel this CPU supports; detected on first use, then cached.
    /// `GRADPACK_KERNEL=portable` forces the portable kernel (`isa::kernel_cap`).
    pub fn detect() -> Platform {
        static CHOICE: OnceLock<Platform> = OnceLock::new();
        *CHOICE.get_or_init(|| {
            let forced_portable = crate::isa::kernel_cap() == crate::isa::Isa::Baseline;
            if !forced_portable && Self::Avx2.is_supported() {
                Platform::Avx2
            } else {
                Platform::Portable
            }
        })
    }

    /// Every kernel that can run on this CPU (tests compare them all).
    pub fn available() -> Vec<Platform> {
        [Platform::Portable, Platform::Avx2].into_iter().filter(|p| p.is_supported()).collect()
    }

    pub fn is_supported(self) -> bool {
        match self {
            Platform::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Platform::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c"),
            #[cfg(not(target_arch = "x86_64"))]
            Platform::Avx2 => false,
        }
    }

    /// Quantizes one chunk in place. `residual` must be as long as `grad` and
    /// `blocks` hold `ceil(len / 16)` words; otherwise an error, and nothing is
    /// written. Every `residual + grad` must be finite (`first_non_finite`
    /// first): what a non-finite sum leaves behind is unspecified.
    pub fn quantize<G: Gradient>(self, grad: &[G], residual: &mut [f32], blocks: &mut [u32], th: Thresholds) -> Result<()> {
        // The AVX2 kernels index without bounds checks: these lengths first.
        check_len("residual", grad.len(), residual.len())?;
        check_len("block slice", grad.len().div_ceil(16), blocks.len())?;
        match self {
            Platform::Portable => portable::quantize(grad, residual, blocks, th),
            #[cfg(target_arch = "x86_64")]
            Platform::Avx2 => {
                assert!(self.is_supported(), "AVX2 kernel requested on a CPU without AVX2/F16C");
                let r = residual.as_mut_ptr();
                // SAFETY: the assert above checked AVX2 and F16C at run time, and
                // check_len the lengths the kernel indexes by; in place, both
                // pointers come from the one exclusive borrow `residual`.
                unsafe { avx2::quantize::<G, false>(grad, r, r, blocks, th) };
            }
            #[cfg(not(target_arch = "x86_64"))]
            Platform::Avx2 => unreachable!("AVX2 kernel requested on a non-x86-64 CPU"),
        }
        Ok(())
    }

    /// Quantizes one chunk out of place: reads `residual`, writes the next
    /// residual to `next`, and checks finiteness in the same pass. `Ok(false)`
    /// when some `residual + grad` is not finite: `residual` is untouched and
    /// `next` and `blocks` hold garbage. Wrong lengths are an error, and
    /// nothing is written. `stream` asks for non-temporal stores of `next`
    /// (for arrays far larger than the cache; a hint, results are the same).
    pub fn quantize_to<G: Gradient>(self, grad: &[G], residual: &[f32], next: &mut [f32], blocks: &mut [u32], th: Thresholds, stream: bool) -> Result<bool> {
        check_len("residual", grad.len(), residual.len())?;
        check_len("next residual", grad.len(), next.len())?;
        check_len("block slice", grad.len().div_ceil(16), blocks.len())?;
        Ok(match self {
            Platform::Portable => portable::quantize_to(grad, residual, next, blocks, th),
            #[cfg(target_arch = "x86_64")]
            Platform::Avx2 => {
                assert!(self.is_supported(), "AVX2 kernel requested on a CPU without AVX2/F16C");
                // SAFETY: the assert above checked AVX2 and F16C at run time, and
                // check_len the lengths the kernel indexes by; a shared and an
                // exclusive borrow never overlap.
                // Streaming also needs `next` 16-byte aligned, checked here.
                let (from, to) = (residual.as_ptr(), next.as_mut_ptr());
                unsafe {
                    if stream && (to as usize) % 16 == 0 {
                        avx2::quantize::<G, true>(grad, from, to, blocks, th)
                    } else {
                        avx2::quantize::<G, false>(grad, from, to, blocks, th)
                    }
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            Platform::Avx2 => unreachable!("AVX2 kernel requested on a non-x86-64 CPU"),
        })
    }

    /// The first element of one chunk whose `residual + grad` is not finite,
    /// and that sum. `residual` must be as long as `grad`.
    pub fn first_non_finite<G: Gradient>(self, grad: &[G], residual: &[f32]) -> Result<Option<(usize, f32)>> {
        check_len("residual", grad.len(), residual.len())?;
        Ok(match self {
            Platform::Portable => portable::first_non_finite(grad, residual),
            #[cfg(target_arch = "x86_64")]
            Platform::Avx2 => {
                assert!(self.is_supported(), "AVX2 kernel requested on a CPU without AVX2/F16C");
                // SAFETY: the assert above checked AVX2 and F16C at run time, and
                // check_len that both slices have the length the kernel reads.
                unsafe { avx2::first_non_finite(grad, residual) }
            }
            #[cfg(not(target_arch = "x86_64"))]
            Platform::Avx2 => unreachable!("AVX2 kernel requested on a non-x86-64 CPU"),
        })
    }

    /// Dequantizes one chunk of validated blocks, overwriting or adding into
    /// `out`. `blocks` must hold `ceil(out.len() / 16)` words; otherwise an
    /// error, and nothing is written.
    pub fn dequantize<const ADD: bool>(self, blocks: &[u32], th: Thresholds, out: &mut [f32]) -> Result<()> {
        check_len("block slice", out.len().div_ceil(16), blocks.len())?;
        match self {
            Platform::Portable => portable::dequantize::<ADD>(blocks, th, out),
            #[cfg(target_arch = "x86_64")]
            Platform::Avx2 => {
                assert!(self.is_supported(), "AVX2 kernel requested on a CPU without AVX2/F16C");
                // SAFETY: the assert above checked AVX2 and F16C at run time, and
                // check_len the block count the kernel indexes by.
                unsafe { avx2::dequantize::<ADD>(blocks, th, out) }
            }
            #[cfg(not(target_arch = "x86_64"))]
            Platform::Avx2 => unreachable!("AVX2 kernel requested on a non-x86-64 CPU"),
        }
        Ok(())
    }
}
