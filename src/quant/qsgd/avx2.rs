//! QSGD's hand-written AVX2 decodes of packed lanes (x86-64 only): where
//! what the compiler made of the portable loop shuffled and spilled. Every
//! kernel is `unsafe` and `#[target_feature(enable = "avx2")]`; each says
//! in its `# Safety` what the caller (`mod.rs`'s dispatch, which checked
//! the CPU once and bounds every loop by the slices' real lengths) must
//! hold. Held bit for bit to the portable kernels' expressions by `tests`.
//! Must not touch: the choice of kernel, the quantizers, threads.

use super::TABLE;
use crate::quant::lanes::{self, TWO_52};
use std::arch::x86_64::*;

/// 8 codes of `lane` from a group's words (`lo`: words 0-3, `hi`:
/// 4-7) as doubles, `lanes::exact_plus`'s way: shifted, masked and
/// ORed into 2^52's bits, less `2^52 - base` (`less`).
#[inline]
#[target_feature(enable = "avx2")]
fn codes<const TWICE: bool>(lo: __m256i, hi: __m256i, shift: __m128i, mask: __m256i, two_52: __m256i, less: __m256d) -> (__m256d, __m256d) {
    let at = |w: __m256i| {
        let v = _mm256_and_si256(_mm256_srl_epi64(w, shift), mask);
        let v = if TWICE { _mm256_add_epi64(v, v) } else { v };
        _mm256_sub_pd(_mm256_castsi256_pd(_mm256_or_si256(v, two_52)), less)
    };
    (at(lo), at(hi))
}

/// Products rounded once to f32, stored as 8 values at `o` (`put8`).
///
/// # Safety
/// `o` has room for 8 floats and, with `stream`, is 16-byte aligned.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn store(o: *mut f32, lo: __m256d, hi: __m256d, stream: bool) {
    let f = _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo));
    // SAFETY: the caller's.
    unsafe { super::put8(o, f, stream) };
}

/// The lane `shift` bits up in a group's words (`lo`: words 0-3,
/// `hi`: 4-7) as 8 ints in word order, with the lanes above it still
/// in their high bits: the table kernels' index.
#[inline]
#[target_feature(enable = "avx2")]
fn lane_ints(lo: __m256i, hi: __m256i, shift: __m256i) -> __m256i {
    let (a, b) = (_mm256_srlv_epi64(lo, shift), _mm256_srlv_epi64(hi, shift));
    // low halves of words 0 1 4 5 | 2 3 6 7, then in order
    let v = _mm256_castps_si256(_mm256_shuffle_ps::<0b10_00_10_00>(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b)));
    _mm256_permute4x64_epi64::<0b11_01_10_00>(v)
}

/// `decode_single_packed`'s first `groups` whole groups of lanes of
/// at most 4 bits (with `WIDE`; else 3): each value looked up in a
/// table of 16 floats (one permute of 8, or with `WIDE` two and a
/// blend) that the lane decode's own expression filled, repeating
/// every `2^width` entries, so the bits of the lanes above are never
/// masked off.
///
/// # Safety
/// The CPU has AVX2; `width` is in 1..=4 (1..=3 without `WIDE`);
/// `words` holds at least `8 * groups` words and `o` at least
/// `8 * groups * (64 / width)`; with `stream`, `o` is 16-byte aligned.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn decode_single_table<const TWICE: bool, const WIDE: bool>(words: &[u64], width: u32, base: f64, step: f64, o: &mut [f32], groups: usize, stream: bool) {
    let (per, g) = ((64 / width) as usize, lanes::GROUP);
    debug_assert!((1..=if WIDE { 4 } else { 3 }).contains(&width) && words.len() >= g * groups && o.len() >= g * per * groups);
    let table = super::single_table::<TWICE, 16>(width, base, step);
    // SAFETY: `table` holds 16 floats.
    let (t0, t1) = unsafe { (_mm256_loadu_ps(table.as_ptr()), _mm256_loadu_ps(table.as_ptr().add(8))) };
    each_lane(words, width, groups, |at, v| {
        let f = _mm256_permutevar8x32_ps(t0, v);
        // entries 8..16 where bit 3 of the lane is set
        let f = if WIDE { _mm256_blendv_ps(f, _mm256_permutevar8x32_ps(t1, v), _mm256_castsi256_ps(_mm256_slli_epi32::<28>(v))) } else { f };
        // SAFETY: elements at..at+8 of o exist (the caller's bound,
        // alignment when streamed included).
        unsafe { super::put8(o.as_mut_ptr().add(at), f, stream) };
    });
}

/// `f(at, v)` for each lane of the first `groups` whole groups (8
/// words each) of `words`, lanes of `width` bits (1..=32), in
/// order: `v` the lane's 8 values (`lane_ints`, the lanes above
/// still in the high bits), `at` the element of its first value.
#[inline]
#[target_feature(enable = "avx2")]
fn each_lane(words: &[u64], width: u32, groups: usize, mut f: impl FnMut(usize, __m256i)) {
    let (per, g) = ((64 / width) as usize, lanes::GROUP);
    assert!(words.len() >= g * groups, "{groups} groups of lanes in {} words", words.len());
    let lane_bits = _mm256_set1_epi64x(width as i64);
    for gi in 0..groups {
        // SAFETY: words gi*8..gi*8+8 exist (the assert above).
        let (lo, hi) = unsafe { (_mm256_loadu_si256(words.as_ptr().add(gi * g).cast()), _mm256_loadu_si256(words.as_ptr().add(gi * g + 4).cast())) };
        let mut shift = _mm256_setzero_si256();
        for lane in 0..per {
            f((gi * per + lane) * g, lane_ints(lo, hi, shift));
            shift = _mm256_add_epi64(shift, lane_bits);
        }
    }
}

/// `decode_single_packed`'s first `groups` whole groups.
///
/// # Safety
/// The CPU has AVX2; `width` is in 1..=32; `words` holds at least
/// `8 * groups` words and `o` at least `8 * groups * (64 / width)`;
/// with `stream`, `o` is 16-byte aligned.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn decode_single<const TWICE: bool>(words: &[u64], width: u32, base: f64, step: f64, o: &mut [f32], groups: usize, stream: bool) {
    let (per, g) = ((64 / width) as usize, lanes::GROUP);
    debug_assert!(words.len() >= g * groups && o.len() >= g * per * groups);
    let mask = _mm256_set1_epi64x(((1u64 << width) - 1) as i64);
    let two_52 = _mm256_set1_epi64x(TWO_52.to_bits() as i64);
    let (less, st) = (_mm256_set1_pd(TWO_52 - base), _mm256_set1_pd(step));
    for gi in 0..groups {
        // SAFETY: words gi*8..gi*8+8 exist (the caller's bound).
        let (lo, hi) = unsafe { (_mm256_loadu_si256(words.as_ptr().add(gi * g).cast()), _mm256_loadu_si256(words.as_ptr().add(gi * g + 4).cast())) };
        for lane in 0..per {
            let (a, b) = codes::<TWICE>(lo, hi, _mm_cvtsi32_si128((lane as u32 * width) as i32), mask, two_52, less);
            // SAFETY: elements (gi * per + lane) * 8 .. +8 of o exist (the
            // caller's bound, alignment when streamed included).
            unsafe { store(o.as_mut_ptr().add((gi * per + lane) * g), _mm256_mul_pd(a, st), _mm256_mul_pd(b, st), stream) };
        }
    }
}

/// Whether `decode_packed_table::<count>` takes lanes of `width`
/// bits: every (scale index, lane value) fits its 16 floats.
pub(super) fn table_fits(count: usize, width: u32) -> bool {
    (1..=4).contains(&width) && count << width <= 16
}

/// `decode_packed_few::<COUNT>` for narrow lanes (`table_fits`), as
/// `avx512::decode_packed_table`: each value looked up in a table of
/// 16 floats (two permutes of 8 and a blend) that `decode_packed_few`'s
/// own expression filled. An index past the steps reads row 0 (`pick`:
/// the first step).
///
/// # Safety
/// As `decode_packed_few`, and `table_fits(COUNT, width)`.
#[target_feature(enable = "avx2")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn decode_packed_table<const COUNT: usize>(words: &[u64], width: u32, base: f64, l: &[u8], o: &mut [f32], steps: &[f64; TABLE], groups: usize, stream: bool) {
    let (per, g) = ((64 / width) as usize, lanes::GROUP);
    debug_assert!(table_fits(COUNT, width) && words.len() >= g * groups && l.len() >= g * per * groups && o.len() >= g * per * groups);
    let table = super::levels_table::<COUNT, 16>(width, base, steps);
    // SAFETY: `table` holds 16 floats.
    let (t0, t1) = unsafe { (_mm256_loadu_ps(table.as_ptr()), _mm256_loadu_ps(table.as_ptr().add(8))) };
    let mask = _mm256_set1_epi32(((1u32 << width) - 1) as i32);
    let (count, row) = (_mm256_set1_epi32(COUNT as i32), _mm256_set1_epi32(width as i32));
    each_lane(words, width, groups, |at, v| {
        let v = _mm256_and_si256(v, mask);
        // SAFETY: elements at..at+8 of l and o exist (the caller's bound).
        let lv = _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(l.as_ptr().add(at).cast()) });
        let r = _mm256_and_si256(_mm256_cmpgt_epi32(count, lv), lv); // past the steps: row 0
        let i = _mm256_or_si256(v, _mm256_sllv_epi32(r, row));
        // entries 8..16 where bit 3 of the index is set
        let f = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, i), _mm256_permutevar8x32_ps(t1, i), _mm256_castsi256_ps(_mm256_slli_epi32::<28>(i)));
        // SAFETY: as for `lv` (`at` is a multiple of 8: aligned when streamed).
        unsafe { super::put8(o.as_mut_ptr().add(at), f, stream) };
    });
}

/// `decode_packed_few::<COUNT>` for the first `groups` whole groups,
/// as `avx512::decode_packed_few`, each step picked by a permute of
/// the steps' float halves (one for any COUNT; compares and blends
/// took 2 to 4 instructions per step).
///
/// # Safety
/// The CPU has AVX2; `width` is in 1..=32; `words` holds at least
/// `8 * groups` words and `l` and `o` at least
/// `8 * groups * (64 / width)` elements; with `stream`, `o` is 16-byte aligned.
#[target_feature(enable = "avx2")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn decode_packed_few<const COUNT: usize>(words: &[u64], width: u32, base: f64, l: &[u8], o: &mut [f32], steps: &[f64; TABLE], groups: usize, stream: bool) {
    let (per, g) = ((64 / width) as usize, lanes::GROUP);
    debug_assert!(words.len() >= g * groups && l.len() >= g * per * groups && o.len() >= g * per * groups);
    let mask = _mm256_set1_epi64x(((1u64 << width) - 1) as i64);
    let two_52 = _mm256_set1_epi64x(TWO_52.to_bits() as i64);
    let less = _mm256_set1_pd(TWO_52 - base);
    // The steps as a table of 8 float halves (a step past COUNT is the
    // first, as `pick` has it); index j picks halves 2j and 2j + 1.
    let table: [f64; 4] = std::array::from_fn(|j| if j < COUNT { steps[j] } else { steps[0] });
    // SAFETY: `table` holds 4 doubles, 32 bytes.
    let table = _mm256_castpd_ps(unsafe { _mm256_loadu_pd(table.as_ptr()) });
    let (four, one) = (_mm_set1_epi8(4), _mm_set1_epi8(1));
    for gi in 0..groups {
        // SAFETY: words gi*8..gi*8+8 exist (the caller's bound).
        let (lo, hi) = unsafe { (_mm256_loadu_si256(words.as_ptr().add(gi * g).cast()), _mm256_loadu_si256(words.as_ptr().add(gi * g + 4).cast())) };
        for lane in 0..per {
            let (a, b) = codes::<false>(lo, hi, _mm_cvtsi32_si128((lane as u32 * width) as i32), mask, two_52, less);
            let at = (gi * per + lane) * g;
            // SAFETY: elements at..at+8 of l and o exist (the caller's bound).
            let lv = unsafe { _mm_loadl_epi64(l.as_ptr().add(at).cast()) };
            // `pick`: indices from 4 up become 4, whose halves 8 and 9
            // the permute reads as 0 and 1 (it keeps 3 bits): the first step.
            let halves = {
                let l2 = _mm_min_epu8(lv, four);
                let l2 = _mm_add_epi8(l2, l2);
                _mm_unpacklo_epi8(l2, _mm_add_epi8(l2, one))
            };
            let sa = _mm256_castps_pd(_mm256_permutevar8x32_ps(table, _mm256_cvtepu8_epi32(halves)));
            let sb = _mm256_castps_pd(_mm256_permutevar8x32_ps(table, _mm256_cvtepu8_epi32(_mm_srli_si128::<8>(halves))));
            // SAFETY: as for `lv` (`at` is a multiple of 8: aligned when streamed).
            unsafe { store(o.as_mut_ptr().add(at), _mm256_mul_pd(a, sa), _mm256_mul_pd(b, sb), stream) };
        }
    }
}
