//! QSGD's hand-written AVX-512 decodes of packed lanes (x86-64 only; F, BW,
//! VL and DQ). Every kernel is `unsafe` and
//! `#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512dq")]`;
//! each says in its `# Safety` what the caller (`mod.rs`'s dispatch, which
//! checked the CPU once and bounds every loop by the slices' real lengths)
//! must hold. Held bit for bit to the portable kernels' expressions by
//! `tests`. Must not touch: the choice of kernel, the quantizers, threads.

use super::TABLE;
use crate::quant::lanes::{self, TWO_52};
use std::arch::x86_64::*;

/// `decode_packed_few` for one count of steps.
pub(super) type Whole = unsafe fn(&[u64], u32, f64, &[u8], &mut [f32], &[f64; TABLE], usize, bool);

/// `decode_single`, once or twice each lane.
pub(super) type Single = unsafe fn(&[u64], u32, f64, f64, &mut [f32], usize, bool);

/// `decode_packed_few::<COUNT>` for the first `groups` whole groups
/// (8 words each): per lane, 8 codes as doubles (`lanes::exact_plus`:
/// the shifted, masked word ORed into 2^52's bits, less `2^52 - base`),
/// times the step their scale indices pick, rounded once to f32.
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL/DQ; `width` is in 1..=32; `words` holds
/// at least `8 * groups` words and `l` and `o` at least
/// `8 * groups * (64 / width)` elements; with `stream`, `o` is 16-byte aligned.
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512dq")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn decode_packed_few<const COUNT: usize>(words: &[u64], width: u32, base: f64, l: &[u8], o: &mut [f32], steps: &[f64; TABLE], groups: usize, stream: bool) {
    let per = (64 / width) as usize;
    let g = lanes::GROUP;
    debug_assert!(words.len() >= g * groups && l.len() >= g * per * groups && o.len() >= g * per * groups);
    let mask = _mm512_set1_epi64(((1u64 << width) - 1) as i64);
    let two_52 = _mm512_set1_epi64(TWO_52.to_bits() as i64);
    let less = _mm512_set1_pd(TWO_52 - base);
    let st: [__m512d; COUNT] = std::array::from_fn(|j| _mm512_set1_pd(steps[j]));
    let index: [__m128i; COUNT] = std::array::from_fn(|j| _mm_set1_epi8(j as i8));
    for gi in 0..groups {
        // SAFETY: words gi*8..gi*8+8 exist (the caller's bound).
        let ws = unsafe { _mm512_loadu_si512(words.as_ptr().add(gi * g).cast()) };
        for lane in 0..per {
            let v = _mm512_srl_epi64(ws, _mm_cvtsi32_si128((lane as u32 * width) as i32));
            // (v & mask) | 2^52's bits, as a double: 2^52 + the lane's value
            let d = _mm512_sub_pd(_mm512_castsi512_pd(_mm512_ternarylogic_epi64::<0xEA>(v, mask, two_52)), less);
            let at = (gi * per + lane) * g;
            // SAFETY: elements at..at+8 of l and o exist (the caller's bound).
            let lv = unsafe { _mm_loadl_epi64(l.as_ptr().add(at).cast()) };
            // `pick`: the step of index j for j in 1..COUNT, else the first
            let mut s = st[0];
            for j in 1..COUNT {
                s = _mm512_mask_blend_pd(_mm_cmpeq_epi8_mask(lv, index[j]) as u8, s, st[j]);
            }
            let f = _mm512_cvtpd_ps(_mm512_mul_pd(d, s));
            // SAFETY: as for `lv` (`at` is a multiple of 8: aligned when streamed).
            unsafe { super::put8(o.as_mut_ptr().add(at), f, stream) };
        }
    }
}

/// Whether `decode_packed_table::<count, WIDE>` takes lanes of
/// `width` bits: every (scale index, lane value) fits its table of
/// 32 floats (64 with `WIDE`).
pub(super) fn table_fits<const WIDE: bool>(count: usize, width: u32) -> bool {
    (1..=6).contains(&width) && count << width <= if WIDE { 64 } else { 32 }
}

/// `decode_packed_few::<COUNT>` for narrow lanes (`table_fits`):
/// every value it can write is in a table of 32 floats (with `WIDE`,
/// 64), computed once by `decode_packed_few`'s own expression, so 16
/// values are two shifts, a permute of their lanes into place, the
/// indices widened and clamped, and one permute of the table (`WIDE`:
/// two and a blend, `lookup`): no doubles, no products, the same bits.
///
/// # Safety
/// As `decode_packed_few`, and `table_fits::<WIDE>(COUNT, width)`.
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512dq")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn decode_packed_table<const COUNT: usize, const WIDE: bool>(words: &[u64], width: u32, base: f64, l: &[u8], o: &mut [f32], steps: &[f64; TABLE], groups: usize, stream: bool) {
    let (per, g) = ((64 / width) as usize, lanes::GROUP);
    debug_assert!(table_fits::<WIDE>(COUNT, width) && words.len() >= g * groups && l.len() >= g * per * groups && o.len() >= g * per * groups);
    let t = tables(&super::levels_table::<COUNT, 64>(width, base, steps));
    let mask = _mm512_set1_epi32(((1u32 << width) - 1) as i32);
    let past = _mm512_set1_epi32(COUNT as i32);
    let row = _mm_cvtsi32_si128(width as i32);
    lane_pairs(words, width, groups, |at, both, v| {
        // SAFETY: elements at..at+16 of l exist when both lanes
        // do, at..at+8 always (the caller's bound).
        let lv = unsafe { if both { _mm_loadu_si128(l.as_ptr().add(at).cast()) } else { _mm_loadl_epi64(l.as_ptr().add(at).cast()) } };
        // An index past the steps, clamped to COUNT, reads row
        // COUNT (the first step), or where COUNT rows fill the
        // table wraps to row 0 (`lookup` reads 5 bits of the
        // index, 6 with `WIDE`): `pick`'s first step either way.
        let r = _mm512_min_epu32(_mm512_cvtepu8_epi32(lv), past);
        // (v & mask) | r << width: the table's index
        let f = lookup::<WIDE>(&t, _mm512_ternarylogic_epi32::<0xEA>(v, mask, _mm512_sll_epi32(r, row)));
        // SAFETY: as for `lv` (`at` is a multiple of 8: aligned when streamed).
        unsafe { put_lanes(o.as_mut_ptr().add(at), f, both, stream) };
    });
}

/// `decode_single_packed`'s first `groups` whole groups of lanes of
/// at most 5 bits (with `WIDE`, 6): each value looked up in a table
/// of 32 floats (64; `lookup`) that the lane decode's own expression
/// filled, repeating every `2^width` entries, as
/// `avx2::decode_single_table`; two lanes, 16 values, at a time, as
/// `decode_packed_table`.
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL/DQ; `width` is in 1..=5 (`WIDE`:
/// 1..=6); `words` holds at least `8 * groups` words and `o` at least
/// `8 * groups * (64 / width)` elements; with `stream`, `o` is 16-byte aligned.
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512dq")]
pub(super) unsafe fn decode_single_table<const TWICE: bool, const WIDE: bool>(words: &[u64], width: u32, base: f64, step: f64, o: &mut [f32], groups: usize, stream: bool) {
    let (per, g) = ((64 / width) as usize, lanes::GROUP);
    debug_assert!((1..=if WIDE { 6 } else { 5 }).contains(&width) && words.len() >= g * groups && o.len() >= g * per * groups);
    let t = tables(&super::single_table::<TWICE, 64>(width, base, step));
    lane_pairs(words, width, groups, |at, both, v| {
        // SAFETY: elements at..at+8, and at+8..at+16 when `both`, of
        // o exist (the caller's bound; `at` is a multiple of 8:
        // aligned when streamed).
        unsafe { put_lanes(o.as_mut_ptr().add(at), lookup::<WIDE>(&t, v), both, stream) };
    });
}

/// `f(at, both, v)` for each pair of lanes of the first `groups`
/// whole groups (8 words each) of `words`, lanes of `width` bits
/// (1..=32), in order: `v` the pair's values (`lane_pair_ints`, the
/// lanes above still in the high bits), `at` the element of the
/// first lane's first value, `both` whether the second lane is one
/// (past the last, its ints come from a shift by 64 or less of
/// words not written: values a kernel does not store).
#[inline]
#[target_feature(enable = "avx2,avx512f")]
fn lane_pairs(words: &[u64], width: u32, groups: usize, mut f: impl FnMut(usize, bool, __m512i)) {
    let (per, g) = ((64 / width) as usize, lanes::GROUP);
    assert!(words.len() >= g * groups, "{groups} groups of lanes in {} words", words.len());
    let (lane_bits, two_lanes) = (_mm512_set1_epi64(width as i64), _mm512_set1_epi64(2 * width as i64));
    for gi in 0..groups {
        // SAFETY: words gi*8..gi*8+8 exist (the assert above).
        let ws = unsafe { _mm512_loadu_si512(words.as_ptr().add(gi * g).cast()) };
        let mut shift = _mm512_setzero_si512();
        for lane in (0..per).step_by(2) {
            f((gi * per + lane) * g, lane + 1 < per, lane_pair_ints(ws, shift, lane_bits));
            shift = _mm512_add_epi64(shift, two_lanes);
        }
    }
}

/// A table kernel's 64 floats as four vectors.
#[inline]
#[target_feature(enable = "avx2,avx512f")]
fn tables(table: &[f32; 64]) -> [__m512; 4] {
    // SAFETY: entries 16 j .. 16 j + 16 exist for j < 4.
    std::array::from_fn(|j| unsafe { _mm512_loadu_ps(table.as_ptr().add(16 * j)) })
}

/// Entry `idx & 31` of the table `t` for each of 16 indices (one
/// permute of its first 32 floats), or with `WIDE` entry `idx & 63`
/// (two, and a blend on bit 5).
#[inline]
#[target_feature(enable = "avx2,avx512f")]
fn lookup<const WIDE: bool>(t: &[__m512; 4], idx: __m512i) -> __m512 {
    let low = _mm512_permutex2var_ps(t[0], idx, t[1]);
    if !WIDE {
        return low;
    }
    let high = _mm512_permutex2var_ps(t[2], idx, t[3]);
    _mm512_mask_blend_ps(_mm512_test_epi32_mask(idx, _mm512_set1_epi32(32)), low, high)
}

/// The lanes `shift` and `shift + lane_bits` bits up in a group's 8
/// words `ws` as 16 ints (the first lane's 8 in word order, then the
/// second's), with the lanes above still in their high bits: the
/// table kernels' index.
#[inline]
#[target_feature(enable = "avx2,avx512f")]
fn lane_pair_ints(ws: __m512i, shift: __m512i, lane_bits: __m512i) -> __m512i {
    let a = _mm512_srlv_epi64(ws, shift);
    // the low halves of a's 8 words, then of the next lane's
    let pair = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    _mm512_permutex2var_epi32(a, pair, _mm512_srlv_epi64(a, lane_bits))
}

/// Stores the 16 values of two lanes at `o`, or with `both` false
/// the first lane's 8 (`put8`'s halves, streamed or not).
///
/// # Safety
/// The CPU has AVX-512 F/DQ; `o` has room for 16 floats (8 without
/// `both`) and, with `stream`, is 16-byte aligned.
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512dq")]
unsafe fn put_lanes(o: *mut f32, f: __m512, both: bool, stream: bool) {
    // SAFETY: the caller's.
    unsafe {
        super::put8(o, _mm512_castps512_ps256(f), stream);
        if both {
            super::put8(o.add(8), _mm512_extractf32x8_ps::<1>(f), stream);
        }
    }
}

/// `decode_single_packed`'s first `groups` whole groups (8 words
/// each): per lane, 8 codes (with `TWICE`, twice each) as doubles,
/// as `decode_packed_few`, times `step`, rounded once to f32.
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL/DQ; `width` is in 1..=32; `words`
/// holds at least `8 * groups` words and `o` at least
/// `8 * groups * (64 / width)` elements; with `stream`, `o` is 16-byte aligned.
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512dq")]
pub(super) unsafe fn decode_single<const TWICE: bool>(words: &[u64], width: u32, base: f64, step: f64, o: &mut [f32], groups: usize, stream: bool) {
    let (per, g) = ((64 / width) as usize, lanes::GROUP);
    debug_assert!(words.len() >= g * groups && o.len() >= g * per * groups);
    let mask = _mm512_set1_epi64(((1u64 << width) - 1) as i64);
    let two_52 = _mm512_set1_epi64(TWO_52.to_bits() as i64);
    let (less, st) = (_mm512_set1_pd(TWO_52 - base), _mm512_set1_pd(step));
    for gi in 0..groups {
        // SAFETY: words gi*8..gi*8+8 exist (the caller's bound).
        let ws = unsafe { _mm512_loadu_si512(words.as_ptr().add(gi * g).cast()) };
        for lane in 0..per {
            let v = _mm512_and_si512(_mm512_srl_epi64(ws, _mm_cvtsi32_si128((lane as u32 * width) as i32)), mask);
            let v = if TWICE { _mm512_add_epi64(v, v) } else { v };
            let d = _mm512_sub_pd(_mm512_castsi512_pd(_mm512_or_si512(v, two_52)), less);
            // SAFETY: elements (gi * per + lane) * 8 .. +8 of o exist (the
            // caller's bound, alignment when streamed included).
            unsafe { super::put8(o.as_mut_ptr().add((gi * per + lane) * g), _mm512_cvtpd_ps(_mm512_mul_pd(d, st)), stream) };
        }
    }
}
