//! AVX2 kernels (x86-64 only). Every function here is `unsafe` and
//! `#[target_feature(enable = "avx2,f16c")]`: the caller must have checked both
//! features at run time, which `platform::Platform::detect` does once.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::gradient::Gradient;
use super::reference;
use super::Thresholds;
use crate::error::Dtype;

/// `SPREAD[m]` places bit k of an 8-element comparison mask at bit `30 - 2k`,
/// the low bit of element k's code in its block word.
const SPREAD: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut m = 0;
    while m < 256 {
        let mut k = 0;
        while k < 8 {
            if m & (1 << k) != 0 {
                table[m] |= 1 << (30 - 2 * k);
            }
            k += 1;
        }
        m += 1;
    }
    table
};

/// Loads 8 gradient elements widened to f32.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn load8<G: Gradient>(p: *const G) -> __m256 {
    // G::DTYPE is the true layout of G (the trait is sealed), so the casts are sound.
    match G::DTYPE {
        Dtype::F32 => _mm256_loadu_ps(p as *const f32),
        Dtype::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
        Dtype::Bf16 => {
            let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
        }
    }
}

/// Quantizes 8 elements from `r_in` into `r_out` (the same pointer in place);
/// returns the (ge, le) comparison masks and a mask of lanes whose sum is NaN
/// or infinite (`x - x` is NaN exactly then).
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn quantize8<G: Gradient, const STREAM: bool>(g: *const G, r_in: *const f32, r_out: *mut f32, pos: __m256, neg: __m256) -> (u32, u32, __m256) {
    let x = _mm256_add_ps(_mm256_loadu_ps(r_in), load8(g));
    let ge = _mm256_cmp_ps::<_CMP_GE_OQ>(x, pos);
    let le = _mm256_cmp_ps::<_CMP_LE_OQ>(x, neg);
    // Blends, not `x - (mask & t)`, so untouched lanes keep x's exact bits.
    let next = _mm256_blendv_ps(x, _mm256_sub_ps(x, neg), le);
    let next = _mm256_blendv_ps(next, _mm256_sub_ps(x, pos), ge);
    if STREAM {
        // Non-temporal: no read for ownership of a line only ever written.
        _mm_stream_ps(r_out, _mm256_castps256_ps128(next));
        _mm_stream_ps(r_out.add(4), _mm256_extractf128_ps::<1>(next));
    } else {
        _mm256_storeu_ps(r_out, next);
    }
    let d = _mm256_sub_ps(x, x);
    (_mm256_movemask_ps(ge) as u32, _mm256_movemask_ps(le) as u32, _mm256_cmp_ps::<_CMP_UNORD_Q>(d, d))
}

/// Quantizes `grad` with the residual read from `r_in` and the next residual
/// written to `r_out`; returns false when some `residual + grad` was not
/// finite (every element is still processed: the caller discards the output).
///
/// # Safety
/// The CPU must support AVX2 and F16C. `r_in` must be valid for reads and
/// `r_out` for writes of `grad.len()` floats; they are either the same pointer
/// (in place) or ranges that do not overlap. `blocks.len() ==
/// ceil(grad.len() / 16)` (the loop indexes without checks). `Platform::quantize`
/// and `Platform::quantize_to` derive the pointers from slices of checked lengths.
/// With `STREAM`, `r_out` must be 16-byte aligned and must not be `r_in`
/// (non-temporal stores; the kernel fences them before it returns).
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn quantize<G: Gradient, const STREAM: bool>(grad: &[G], r_in: *const f32, r_out: *mut f32, blocks: &mut [u32], th: Thresholds) -> bool {
    let n = grad.len();
    let full = n / 16;
    debug_assert!(blocks.len() == n.div_ceil(16));
    let pos = _mm256_set1_ps(th.pos);
    let neg = _mm256_set1_ps(th.neg);
    let g = grad.as_ptr();
    let mut bad = _mm256_setzero_ps();
    for b in 0..full {
        // b < full, so elements 16b..16b+16 lie inside all three ranges.
        let (at0, at1) = (16 * b, 16 * b + 8);
        let (ge0, le0, bad0) = quantize8::<G, STREAM>(g.add(at0), r_in.add(at0), r_out.add(at0), pos, neg);
        let (ge1, le1, bad1) = quantize8::<G, STREAM>(g.add(at1), r_in.add(at1), r_out.add(at1), pos, neg);
        bad = _mm256_or_ps(bad, _mm256_or_ps(bad0, bad1));
        let low = SPREAD[ge0 as usize] | (SPREAD[ge1 as usize] >> 16);
        let high = SPREAD[le0 as usize] | (SPREAD[le1 as usize] >> 16);
        *blocks.get_unchecked_mut(b) = low | (high << 1);
    }
    if STREAM {
        _mm_sfence(); // the streamed residual is visible before anyone reads it
    }
    let mut finite = _mm256_movemask_ps(bad) == 0;
    if n > full * 16 {
        let lo = full * 16;
        // The tail lies inside both ranges; `copy` allows them to be the same.
        std::ptr::copy(r_in.add(lo), r_out.add(lo), n - lo);
        let tail = std::slice::from_raw_parts_mut(r_out.add(lo), n - lo);
        finite &= reference::first_non_finite(&grad[lo..], tail).is_none();
        blocks[full] = reference::quantize_block(&grad[lo..], tail, th);
    }
    finite
}

/// Decodes 8 elements whose codes sit at the given per-lane shifts of `word`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn decode8(word: __m256i, shifts: __m256i, pos: __m256, neg: __m256) -> __m256 {
    let codes = _mm256_and_si256(_mm256_srlv_epi32(word, shifts), _mm256_set1_epi32(0b11));
    let is_pos = _mm256_castsi256_ps(_mm256_cmpeq_epi32(codes, _mm256_set1_epi32(0b01)));
    let is_neg = _mm256_castsi256_ps(_mm256_cmpeq_epi32(codes, _mm256_set1_epi32(0b10)));
    _mm256_or_ps(_mm256_and_ps(is_pos, pos), _mm256_and_ps(is_neg, neg))
}

/// # Safety
/// The CPU must support AVX2 and F16C; `blocks.len() == ceil(out.len() / 16)`
/// (the loop indexes without checks). `Platform::dequantize` checks both.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn dequantize<const ADD: bool>(blocks: &[u32], th: Thresholds, out: &mut [f32]) {
    let full = out.len() / 16;
    debug_assert!(blocks.len() == out.len().div_ceil(16));
    let pos = _mm256_set1_ps(th.pos);
    let neg = _mm256_set1_ps(th.neg);
    let shifts_lo = _mm256_setr_epi32(30, 28, 26, 24, 22, 20, 18, 16);
    let shifts_hi = _mm256_setr_epi32(14, 12, 10, 8, 6, 4, 2, 0);
    let o = out.as_mut_ptr();
    for b in 0..full {
        let word = _mm256_set1_epi32(*blocks.get_unchecked(b) as i32);
        let v0 = decode8(word, shifts_lo, pos, neg);
        let v1 = decode8(word, shifts_hi, pos, neg);
        // b < full, so elements 16b..16b+16 lie inside `out`.
        let (p0, p1) = (o.add(16 * b), o.add(16 * b + 8));
        if ADD {
            _mm256_storeu_ps(p0, _mm256_add_ps(_mm256_loadu_ps(p0), v0));
            _mm256_storeu_ps(p1, _mm256_add_ps(_mm256_loadu_ps(p1), v1));
        } else {
            _mm256_storeu_ps(p0, v0);
            _mm256_storeu_ps(p1, v1);
        }
    }
    if out.len() > full * 16 {
        reference::dequantize_block::<ADD>(blocks[full], th, &mut out[full * 16..]);
    }
}

/// # Safety
/// The CPU must support AVX2 and F16C; `residual.len() == grad.len()` (the
/// loop reads both without checks). `Platform::first_non_finite` checks both.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn first_non_finite<G: Gradient>(grad: &[G], residual: &[f32]) -> Option<(usize, f32)> {
    const SCAN: usize = 64;
    let full = grad.len() / SCAN;
    let (g, r) = (grad.as_ptr(), residual.as_ptr());
    for b in 0..full {
        // x - x is NaN exactly when x is NaN or infinite.
        let mut bad = _mm256_setzero_ps();
        for k in 0..SCAN / 8 {
            // b < full, so elements SCAN*b + 8k .. + 8 lie inside both slices.
            let at = SCAN * b + 8 * k;
            let x = _mm256_add_ps(_mm256_loadu_ps(r.add(at)), load8(g.add(at)));
            let d = _mm256_sub_ps(x, x);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps::<_CMP_UNORD_Q>(d, d));
        }
        if _mm256_movemask_ps(bad) != 0 {
            let lo = SCAN * b;
            return reference::first_non_finite(&grad[lo..lo + SCAN], &residual[lo..lo + SCAN]).map(|(i, x)| (lo + i, x));
        }
    }
    let lo = full * SCAN;
    reference::first_non_finite(&grad[lo..], &residual[lo..]).map(|(i, x)| (lo + i, x))
}
