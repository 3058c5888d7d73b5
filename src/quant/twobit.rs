//! 2-bit compression (the codec's rule, `crate::codec`) straight into
//! packed lanes, for the stores that sum over a collective: element `i`'s
//! code is 1 when it sends `+pos`, `b` when it sends `neg`, 0 otherwise.
//! Summed over fewer than `b` members, a lane holds `P + Q b` with `P`
//! members at `+pos` and `Q` at `neg`, which decodes to `P pos + Q neg`, as
//! the codec's counts do (`scheme::decode_slice`). One lane per element:
//! 3 bits for 2 members (`b` = 3) where a positive and a negative count
//! took 2 bits each, and no array of codes in between.

use rayon::prelude::*;

use super::lanes;
use crate::codec::Thresholds;
use crate::error::{Error, Result};
use crate::isa::Isa;

/// Words of packed lanes per parallel piece.
const TASK_WORDS: usize = 1 << 12;

/// The codec's step for one element, in its arithmetic: `x = r + g`; at or
/// above `pos` the code is 1 and `x - pos` stays, at or below `neg` the
/// code is `b` and `x - neg` stays. Returns (code, next residual).
#[inline(always)]
fn step(g: f32, r: f32, th: (f32, f32), b: i32) -> (i32, f32) {
    let x = r + g;
    let (ge, le) = (x >= th.1, x <= th.0);
    let next = if ge {
        x - th.1
    } else if le {
        x - th.0
    } else {
        x
    };
    (ge as i32 + le as i32 * b, next)
}

/// Quantizes `grad` with error feedback into `words`: lanes of `width`
/// bits (1 to 32, wide enough for every sum the caller will add; `b` at
/// least 2), written or (with `ADD`) added. Out of place: `residual` is the
/// previous residual, read only, and `next` receives the new one (the
/// caller commits it once the push succeeded; past the caches when
/// `isa::residual_streams`). The caller has checked that every
/// `residual + grad` is finite (`codec::check_finite`).
pub fn quantize_packed<const ADD: bool>(grad: &[f32], residual: &[f32], next: &mut [f32], th: Thresholds, b: i32, words: &mut [u64], width: u32) {
    assert!((1..=32).contains(&width) && b >= 2 && (b as u64) < 1 << width, "2-bit: code {b} in lanes of {width} bits");
    assert!(grad.len() == residual.len() && grad.len() == next.len() && words.len() == lanes::words_for(grad.len(), width), "2-bit: {} values, {} residuals, {} next residuals, {} words of {width} bits", grad.len(), residual.len(), next.len(), words.len());
    let (isa, per, th, stream) = (Isa::detect(), (64 / width) as usize, (th.neg, th.pos), crate::isa::residual_streams(grad.len()));
    next.par_chunks_mut(TASK_WORDS * per).zip(words.par_chunks_mut(TASK_WORDS)).enumerate().for_each(|(i, (x, w))| {
        let piece = i * TASK_WORDS * per..i * TASK_WORDS * per + x.len();
        let (g, r) = (&grad[piece.clone()], &residual[piece]);
        if stream {
            packed_kernel::<ADD, true>(isa, g, r, x, th, b, w, width)
        } else {
            packed_kernel::<ADD, false>(isa, g, r, x, th, b, w, width)
        }
    });
}

#[inline(always)]
fn packed_body<const ADD: bool, const STREAM: bool>(grad: &[f32], residual: &[f32], next: &mut [f32], th: (f32, f32), b: i32, words: &mut [u64], width: u32) {
    let n = grad.len().min(residual.len()).min(next.len());
    // Whole groups straight from the codes' vectors (`lanes::pack_direct!`).
    let start = lanes::pack_direct!(ADD, n, words, width, |at| codes_of::<16, STREAM>(grad[at..at + 16].try_into().unwrap(), residual[at..at + 16].try_into().unwrap(), (&mut next[at..at + 16]).try_into().unwrap(), th, b), {
        codes_of::<8, STREAM>(grad[at..at + 8].try_into().unwrap(), residual[at..at + 8].try_into().unwrap(), (&mut next[at..at + 8]).try_into().unwrap(), th, b)
    });
    crate::isa::fence::<STREAM>();
    let (grad, residual, next, words) = (&grad[start..n], &residual[start..n], &mut next[start..n], &mut words[lanes::words_for(start, width)..]);
    lanes::blocks!(ADD, lanes::BLOCK, grad.len(), words, width, 0, |span, c| {
        for (((g, r), x), c) in grad[span.clone()].iter().zip(&residual[span.clone()]).zip(&mut next[span]).zip(c.iter_mut()) {
            (*c, *x) = step(*g, *r, th, b);
        }
    });
}

/// `step` of `N` values, the codes returned as lanes, the next residuals
/// stored (`isa::store`).
#[inline(always)]
fn codes_of<const N: usize, const STREAM: bool>(grad: &[f32; N], residual: &[f32; N], next: &mut [f32; N], th: (f32, f32), b: i32) -> [u32; N] {
    let (mut c, mut x) = ([0u32; N], [0f32; N]);
    for (((g, r), x), c) in grad.iter().zip(residual).zip(x.iter_mut()).zip(c.iter_mut()) {
        let (code, r) = step(*g, *r, th, b);
        (*c, *x) = (code as u32, r);
    }
    crate::isa::store::<STREAM, N>(next, &x);
    c
}

crate::isa::multiversion! {
    fn packed_kernel[const ADD: bool, const STREAM: bool][ADD, STREAM](grad: &[f32], residual: &[f32], next: &mut [f32], th: (f32, f32), b: i32, words: &mut [u64], width: u32) -> () = packed_body;
}

/// Decodes summed lanes (`P + Q b`, `b` at least 2) into `out`:
/// `P pos + Q neg` in float32, as the codec's counts decode.
pub fn decode_packed(words: &[u64], width: u32, b: i32, th: Thresholds, out: &mut [f32]) -> Result<()> {
    if !(1..=32).contains(&width) || b < 2 || words.len() != lanes::words_for(out.len(), width) {
        return Err(Error::Transport(format!("malformed 2-bit sum: {} values in {} words of {width} bits, code {b}", out.len(), words.len())));
    }
    let value = |v: u64| (v % b as u64) as f32 * th.pos + (v / b as u64) as f32 * th.neg;
    if width <= 12 {
        // every lane's value from a table (a division per element does not vectorize)
        let table: Vec<f32> = (0..1u64 << width).map(value).collect();
        let mask = (1u64 << width) - 1;
        lanes::unpack_into(words, width, out, |v| table[(v & mask) as usize])
    } else {
        lanes::unpack_into(words, width, out, value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec;

    fn grad(n: usize, salt: usize) -> Vec<f32> {
        (0..n).map(|i| (((i * 7919 + salt * 31) % 2001) as f32 - 1000.0) / 1400.0).collect()
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|x| x.to_bits()).collect()
    }

    /// The codec's blocks for element `i`: (+pos, neg) indicators.
    fn codec_code(compr: &[f32], i: usize) -> (i32, i32) {
        let w = codec::blocks(compr)[i / 16] >> (30 - 2 * (i % 16));
        ((w & 3 == 1) as i32, (w & 3 == 2) as i32)
    }

    #[test]
    fn lanes_hold_the_codecs_codes_and_residuals_on_every_kernel() {
        let th = Thresholds::new(-0.3, 0.45).unwrap();
        for n in [0, 1, 15, 16, 17, 8 * 21 - 1, 8 * 21 + 1, lanes::BLOCK + 5, 3 * TASK_WORDS * 21 + 100] {
            let (g0, g1) = (grad(n, 1), grad(n, 2));
            let (r0, r1) = (grad(n, 3).iter().map(|x| x * 0.2).collect::<Vec<_>>(), vec![0.1f32; n]);
            // the codec, member by member
            let (mut c0, mut c1) = (codec::create_2bit(n), codec::create_2bit(n));
            let (mut w0, mut w1) = (r0.clone(), r1.clone());
            codec::quantize_2bit(&g0, &mut w0, &mut c0, th).unwrap();
            codec::quantize_2bit(&g1, &mut w1, &mut c1, th).unwrap();
            let want: Vec<u64> = (0..n).map(|i| {
                let ((p0, q0), (p1, q1)) = (codec_code(&c0, i), codec_code(&c1, i));
                (p0 + p1 + 3 * (q0 + q1)) as u64
            }).collect();
            let width = lanes::width_for(6);
            let mut words = vec![0u64; lanes::words_for(n, width)];
            let (mut x0, mut x1) = (vec![f32::NAN; n], vec![f32::NAN; n]);
            quantize_packed::<false>(&g0, &r0, &mut x0, th, 3, &mut words, width);
            quantize_packed::<true>(&g1, &r1, &mut x1, th, 3, &mut words, width);
            assert_eq!(words, lanes::pack_slice(&want, width, |v| v), "n {n}");
            assert_eq!((bits(&x0), bits(&x1)), (bits(&w0), bits(&w1)), "n {n}");
            // every instruction set, on a piece, the next residual streamed or not
            let alone: Vec<u64> = (0..n).map(|i| { let (p, q) = codec_code(&c0, i); (p + 3 * q) as u64 }).collect();
            for (isa, stream) in Isa::available().into_iter().flat_map(|isa| [(isa, false), (isa, true)]) {
                let (mut x, mut w) = (vec![f32::NAN; n], vec![0u64; lanes::words_for(n, width)]);
                let th = (th.neg, th.pos);
                if stream { packed_kernel::<false, true>(isa, &g0, &r0, &mut x, th, 3, &mut w, width) } else { packed_kernel::<false, false>(isa, &g0, &r0, &mut x, th, 3, &mut w, width) }
                assert_eq!((w, bits(&x)), (lanes::pack_slice(&alone, width, |v| v), bits(&w0)), "{isa:?} stream {stream} n {n}");
            }
            // decoded: P pos + Q neg, as the codec's counts
            let mut out = vec![f32::NAN; n];
            decode_packed(&words, width, 3, th, &mut out).unwrap();
            let counts: Vec<f32> = (0..n).map(|i| {
                let ((p0, q0), (p1, q1)) = (codec_code(&c0, i), codec_code(&c1, i));
                (p0 + p1) as f32 * th.pos + (q0 + q1) as f32 * th.neg
            }).collect();
            assert_eq!(bits(&out), bits(&counts), "n {n}");
        }
    }

    #[test]
    fn wide_lanes_decode_without_the_table_and_bad_sums_are_refused() {
        let th = Thresholds::new(-0.5, 0.25).unwrap();
        // 300 members: b = 301, sums up to 300 * 301 in 17 bits
        let vals = [0u64, 1, 301, 299 + 301, 300 * 301, 17 * 301 + 5];
        let words = lanes::pack_slice(&vals, 17, |v| v);
        let mut out = vec![0f32; vals.len()];
        decode_packed(&words, 17, 301, th, &mut out).unwrap();
        assert_eq!(out, [0.0, 0.25, -0.5, 299.0 * 0.25 - 0.5, -150.0, 5.0 * 0.25 - 8.5]);
        assert!(decode_packed(&words[1..], 17, 301, th, &mut out).is_err());
        assert!(decode_packed(&words, 17, 1, th, &mut out).is_err());
        assert!(decode_packed(&words, 0, 301, th, &mut out).is_err());
    }
}
