//! Every kernel against the reference, bit for bit, on boundary sizes and over
//! several residual steps; the golden example; every error rule.

use half::{bf16, f16};

use super::join::CHUNK;
use super::*;

/// splitmix64: deterministic test data without a dependency.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(crate::hash::GAMMA);
        crate::hash::finalize(self.0)
    }
    /// Uniform in [-scale, scale).
    pub(crate) fn uniform(&mut self, scale: f32) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
    }
}

const SIZES: &[usize] = &[0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 17, 1_000_003];

fn th() -> Thresholds {
    Thresholds::new(-0.5, 0.5).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Runs `steps` quantize calls with every kernel (single chunk and threaded) and
/// the reference, comparing residual and blocks bit for bit after each step.
fn check_all_kernels<G: Gradient>(conv: fn(f32) -> G) {
    let mut rng = Rng(42);
    for &n in SIZES {
        let steps = 3;
        let grads: Vec<Vec<G>> = (0..steps).map(|_| (0..n).map(|_| conv(rng.uniform(0.7))).collect()).collect();
        let mut ref_res = vec![0f32; n];
        let mut ref_blocks = vec![0u32; n.div_ceil(16)];
        let mut runs: Vec<(String, Vec<f32>, Vec<f32>)> = Vec::new();
        let modes = ["in place", "in place+threads", "out of place", "out of place+threads"];
        for p in Platform::available() {
            for mode in modes {
                runs.push((format!("{p:?} {mode}"), vec![0f32; n], vec![0f32; compressed_len(n)]));
            }
        }
        let mut next = vec![0f32; n];
        for (step, g) in grads.iter().enumerate() {
            reference::quantize(g, &mut ref_res, &mut ref_blocks, th());
            for (k, (name, res, compr)) in runs.iter_mut().enumerate() {
                let p = Platform::available()[k / modes.len()];
                match k % modes.len() {
                    0 => p.quantize(g, res, blocks_mut(compr), th()).unwrap(),
                    1 => join::quantize(p, g, res, blocks_mut(compr), th()).unwrap(),
                    m => {
                        next.fill(-1.0);
                        let before = res.clone();
                        let finite = if m == 2 { p.quantize_to(g, res, &mut next, blocks_mut(compr), th(), n % 2 == 0) } else { join::quantize_to(p, g, res, &mut next, blocks_mut(compr), th()) };
                        assert!(finite.unwrap(), "{name} n={n}");
                        assert_eq!(bits(res), bits(&before), "{name}: the residual is only read");
                        std::mem::swap(res, &mut next);
                    }
                }
                assert_eq!(bits(res), bits(&ref_res), "{name} residual, n={n} step={step} {:?}", G::DTYPE);
                assert_eq!(blocks(compr), &ref_blocks[..], "{name} blocks, n={n} step={step} {:?}", G::DTYPE);
                // Decoding, overwrite and add, also bit for bit.
                let mut want = vec![0f32; n];
                reference::dequantize::<false>(&ref_blocks, th(), &mut want);
                let mut got = vec![1f32; n];
                join::dequantize::<false>(p, &ref_blocks, th(), &mut got).unwrap();
                assert_eq!(bits(&got), bits(&want), "{name} dequantize n={n}");
                let mut want_sum: Vec<f32> = ref_res.clone();
                reference::dequantize::<true>(&ref_blocks, th(), &mut want_sum);
                let mut got_sum = ref_res.clone();
                p.dequantize::<true>(&ref_blocks, th(), &mut got_sum).unwrap();
                assert_eq!(bits(&got_sum), bits(&want_sum), "{name} dequantize_add n={n}");
            }
        }
    }
}

#[test]
fn kernels_match_reference_f32() {
    check_all_kernels::<f32>(|x| x);
}

#[test]
fn kernels_match_reference_f16() {
    check_all_kernels::<f16>(f16::from_f32);
}

#[test]
fn kernels_match_reference_bf16() {
    check_all_kernels::<bf16>(bf16::from_f32);
}

#[test]
fn kernels_agree_on_special_values() {
    // Values exactly at the thresholds, signed zeros, denormals, infinities, NaN.
    let specials = [0.5, -0.5, 0.0, -0.0, 1e-45, -1e-45, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 0.25, 0.2500001, -0.75, 1e30, -1e30, 0.4999999, -0.4999999, 3.0];
    let n = specials.len() * 3;
    let grad: Vec<f32> = (0..n).map(|i| specials[i % specials.len()]).collect();
    let mut ref_res: Vec<f32> = (0..n).map(|i| specials[(i / 3 + i) % specials.len()]).collect();
    let start = ref_res.clone();
    let mut ref_blocks = vec![0u32; n.div_ceil(16)];
    reference::quantize(&grad, &mut ref_res, &mut ref_blocks, th());
    for p in Platform::available() {
        let mut res = start.clone();
        let mut bl = vec![0u32; n.div_ceil(16)];
        p.quantize(&grad, &mut res, &mut bl, th()).unwrap();
        assert_eq!(bits(&res), bits(&ref_res), "{p:?}");
        assert_eq!(bl, ref_blocks, "{p:?}");
        // Out of place: the same bits, and the sums that are not finite reported.
        let mut next = vec![0f32; n];
        let mut bl = vec![0u32; n.div_ceil(16)];
        assert!(!p.quantize_to(&grad, &start, &mut next, &mut bl, th(), true).unwrap(), "{p:?}");
        assert_eq!((bits(&next), &bl), (bits(&ref_res), &ref_blocks), "{p:?} out of place");
    }
}

#[test]
fn golden_example() {
    let grad = [0.0f32, 2.5, 1.0, -3.0, 2.0, 0.5, -1.0, -2.0];
    let mut residual = [0f32; 8];
    let mut compr = create_2bit(8);
    assert_eq!(compr.len(), 4);
    quantize_2bit(&grad, &mut residual, &mut compr, Thresholds::new(-2.0, 2.0).unwrap()).unwrap();
    assert_eq!(bits(&compr), vec![(-2.0f32).to_bits(), 2.0f32.to_bits(), 8.0f32.to_bits(), 0x1242_0000]);
    assert_eq!(compr[3], 6.1215606e-28);
    assert_eq!(residual, [0.0, 0.5, 1.0, -1.0, 0.0, 0.5, -1.0, 0.0]);
    let mut out = [9f32; 8];
    dequantize_2bit(&compr, &mut out).unwrap();
    assert_eq!(out, [0.0, 2.0, 0.0, -2.0, 2.0, 0.0, 0.0, -2.0]);
    let mut sum = [1f32; 8];
    dequantize_2bit_add(&compr, &mut sum).unwrap();
    assert_eq!(sum, [1.0, 3.0, 1.0, -1.0, 3.0, 1.0, 1.0, -1.0]);
}

#[test]
fn rejects_bad_thresholds() {
    for (neg, pos) in [(0.0, 0.5), (-0.5, 0.0), (0.5, -0.5), (f32::NAN, 0.5), (-0.5, f32::INFINITY), (f32::NEG_INFINITY, 1.0), (-0.0, 0.5)] {
        let err = Thresholds::new(neg, pos).unwrap_err();
        assert!(matches!(err, Error::InvalidThreshold { .. }), "{neg} {pos}: {err}");
    }
    assert!(Thresholds::symmetric(-1.0).is_err());
    assert_eq!(Thresholds::symmetric(0.5).unwrap(), th());
}

#[test]
fn quantize_size_errors_touch_nothing() {
    let grad = vec![1f32; 33];
    for (res_len, compr_len) in [(32, 6), (34, 6), (33, 5), (33, 7), (0, 6)] {
        let mut residual = vec![0.25f32; res_len];
        let mut compr = vec![7f32; compr_len];
        let err = quantize_2bit(&grad, &mut residual, &mut compr, th()).unwrap_err();
        assert!(matches!(err, Error::SizeMismatch { .. }), "{err}");
        assert!(residual.iter().all(|&r| r == 0.25) && compr.iter().all(|&c| c == 7.0));
    }
}

fn valid_compressed(n: usize) -> Vec<f32> {
    let grad: Vec<f32> = (0..n).map(|i| if i % 3 == 0 { 1.0 } else { -1.0 }).collect();
    let mut compr = create_2bit(n);
    quantize_2bit(&grad, &mut vec![0f32; n], &mut compr, th()).unwrap();
    compr
}

fn assert_dequantize_fails(compr: &[f32], n: usize, expect: impl Fn(&Error) -> bool) {
    let mut out = vec![3f32; n];
    let err = dequantize_2bit(compr, &mut out).unwrap_err();
    assert!(expect(&err), "unexpected error: {err}");
    let err2 = dequantize_2bit_add(compr, &mut out).unwrap_err();
    assert_eq!(err.to_string(), err2.to_string());
    assert!(out.iter().all(|&x| x == 3.0), "output touched on error");
}

#[test]
fn dequantize_rejects_corrupt_input() {
    let n = 37;
    let good = valid_compressed(n);
    // wrong length
    assert_dequantize_fails(&good[..good.len() - 1], n, |e| matches!(e, Error::SizeMismatch { .. }));
    assert_dequantize_fails(&good, n - 16, |e| matches!(e, Error::SizeMismatch { .. }));
    // header size disagrees with the output (same number of blocks)
    assert_dequantize_fails(&good, n - 1, |e| matches!(e, Error::HeaderSizeMismatch { .. }));
    // thresholds
    for (i, v) in [(0, 0.5), (0, f32::NAN), (1, -0.5), (1, f32::INFINITY), (0, 0.0)] {
        let mut c = good.clone();
        c[i] = v;
        assert_dequantize_fails(&c, n, |e| matches!(e, Error::InvalidThreshold { .. }));
    }
    // code 0b11 in block 1, element 16 + 5
    let mut c = good.clone();
    c[3 + 1] = f32::from_bits(blocks(&c)[1] | (0b11 << (30 - 2 * 5)));
    assert_dequantize_fails(&c, n, |e| *e == Error::CorruptCode { block: 1, element: 21 });
    // non-zero padding past n in the last block (element 37 = block 2, j = 5)
    let mut c = good.clone();
    c[3 + 2] = f32::from_bits(blocks(&c)[2] | (0b01 << (30 - 2 * 5)));
    assert_dequantize_fails(&c, n, |e| matches!(e, Error::CorruptPadding { block: 2, .. }));
}

#[test]
fn code_11_found_in_large_threaded_input() {
    let n = 3 * CHUNK + 5;
    let mut c = valid_compressed(n);
    let last = c.len() - 2;
    c[last] = f32::from_bits(0b11 << 30 | blocks(&c)[last - 3]);
    let block = last - 3;
    assert_dequantize_fails(&c, n, |e| *e == Error::CorruptCode { block, element: block * 16 });
}

#[test]
fn large_n_header_rounds_to_nearest() {
    // 2^24 + 1 is not representable in f32: the header holds float32(n) = 2^24,
    // and dequantize accepts it because it compares against float32(n) too.
    let n = (1usize << 24) + 1;
    let grad = vec![bf16::from_f32(0.75); n];
    let mut residual = vec![0f32; n];
    let mut compr = create_2bit(n);
    quantize_2bit(&grad, &mut residual, &mut compr, th()).unwrap();
    assert_eq!(compr[2], 16_777_216.0);
    let mut out = vec![0f32; n];
    dequantize_2bit(&compr, &mut out).unwrap();
    assert!(out.iter().all(|&x| x == 0.5));
    assert!(residual.iter().all(|&x| x == 0.25));
    // float32(2^24) == float32(2^24 + 1): the length check is what tells them apart.
    let mut short = vec![0f32; n - 1];
    assert!(matches!(dequantize_2bit(&compr, &mut short), Err(Error::SizeMismatch { .. })));
}

#[test]
fn denormal_and_negative_zero_blocks_survive() {
    // Block words that are denormal floats or -0.0 must come through untouched.
    let mut compr = vec![-0.5f32, 0.5, 16.0, 0.0];
    for word in [0x0000_0001u32, 0x8000_0000, 0x0012_4200, 0x5555_5555] {
        compr[3] = f32::from_bits(word);
        assert_eq!(blocks(&compr)[0], word);
        if word & (word >> 1) & 0x5555_5555 == 0 {
            let mut out = [0f32; 16];
            dequantize_2bit(&compr, &mut out).unwrap();
            let mut want = [0f32; 16];
            reference::dequantize::<false>(&[word], th(), &mut want);
            assert_eq!(out, want);
        }
    }
}

#[test]
fn fused_reduce_matches_separate_calls() {
    let mut rng = Rng(9);
    for &n in &[0usize, 1, 17, CHUNK + 3, 2 * CHUNK + 16, 300_001] {
        for devices in 1..=3 {
            let g32: Vec<f32> = (0..n).map(|_| rng.uniform(0.7)).collect();
            let g16: Vec<f16> = (0..n).map(|_| f16::from_f32(rng.uniform(0.7))).collect();
            let gbf: Vec<bf16> = (0..n).map(|_| bf16::from_f32(rng.uniform(0.7))).collect();
            let all = [Grad::F32(&g32), Grad::F16(&g16), Grad::Bf16(&gbf)];
            let grads = &all[..devices];
            let start: Vec<Vec<f32>> = (0..devices).map(|_| (0..n).map(|_| rng.uniform(0.3)).collect()).collect();
            // separate calls
            let mut want_res = start.clone();
            let mut want_sum = vec![0f32; n];
            let mut want_comprs = vec![create_2bit(n); devices];
            for (i, g) in grads.iter().enumerate() {
                match *g {
                    Grad::F32(g) => quantize_2bit(g, &mut want_res[i], &mut want_comprs[i], th()).unwrap(),
                    Grad::F16(g) => quantize_2bit(g, &mut want_res[i], &mut want_comprs[i], th()).unwrap(),
                    Grad::Bf16(g) => quantize_2bit(g, &mut want_res[i], &mut want_comprs[i], th()).unwrap(),
                }
                if i == 0 {
                    dequantize_2bit(&want_comprs[i], &mut want_sum).unwrap();
                } else {
                    dequantize_2bit_add(&want_comprs[i], &mut want_sum).unwrap();
                }
            }
            // fused
            let mut res = vec![vec![-1f32; n]; devices];
            let mut comprs = vec![create_2bit(n); devices];
            let mut sum = vec![7f32; n];
            {
                let r: Vec<&[f32]> = start.iter().map(|v| &v[..]).collect();
                let mut x: Vec<&mut [f32]> = res.iter_mut().map(|v| &mut v[..]).collect();
                let mut c: Vec<&mut [f32]> = comprs.iter_mut().map(|v| &mut v[..]).collect();
                quantize_2bit_reduce(grads, &r, &mut x, &mut c, &mut sum, th()).unwrap();
            }
            assert_eq!(bits(&sum), bits(&want_sum), "n={n} devices={devices}");
            for i in 0..devices {
                assert_eq!(bits(&res[i]), bits(&want_res[i]));
                assert_eq!(bits(&comprs[i]), bits(&want_comprs[i]));
            }
        }
    }
}

#[test]
fn fused_reduce_rejects_mismatches_untouched() {
    let g = vec![1f32; 20];
    let (r0, r1) = (vec![0.5f32; 20], vec![0.5f32; 19]);
    let (mut x0, mut x1) = (vec![2f32; 20], vec![2f32; 20]);
    let mut c0 = vec![9f32; 5];
    let mut c1 = vec![9f32; 5];
    let mut sum = vec![3f32; 20];
    let err = quantize_2bit_reduce(&[Grad::F32(&g), Grad::F32(&g)], &[&r0, &r1], &mut [&mut x0, &mut x1], &mut [&mut c0, &mut c1], &mut sum, th()).unwrap_err();
    assert_eq!(err.to_string(), "residual has 19 elements, expected 20");
    assert!(x0.iter().all(|&x| x == 2.0) && c0.iter().all(|&x| x == 9.0) && sum.iter().all(|&x| x == 3.0));
    let (r1, mut x1) = (vec![0.5f32; 20], vec![2f32; 21]);
    let err = quantize_2bit_reduce(&[Grad::F32(&g), Grad::F32(&g)], &[&r0, &r1], &mut [&mut x0, &mut x1], &mut [&mut c0, &mut c1], &mut sum, th()).unwrap_err();
    assert_eq!(err.to_string(), "next residual has 21 elements, expected 20");
    assert!(x0.iter().all(|&x| x == 2.0) && c0.iter().all(|&x| x == 9.0) && sum.iter().all(|&x| x == 3.0));
}

#[test]
fn safe_kernel_entry_points_refuse_wrong_lengths() {
    // Every kernel reachable from safe code, with each slice one too short or
    // too long: an error, and nothing written (the AVX2 loops index unchecked).
    let n = 40; // two full blocks and a tail
    let grad = vec![0.9f32; n];
    for p in Platform::available() {
        for (res_len, blk_len) in [(n - 1, 3), (n + 1, 3), (n, 2), (n, 4), (n, 0)] {
            let mut res = vec![7f32; res_len];
            let mut bl = vec![5u32; blk_len];
            let err = p.quantize(&grad, &mut res, &mut bl, th()).unwrap_err().to_string();
            assert!(err.contains("residual") || err.contains("block slice"), "{p:?}: {err}");
            assert!(res.iter().all(|&x| x == 7.0) && bl.iter().all(|&b| b == 5), "{p:?} wrote on error");
            let err = join::quantize(p, &grad, &mut res, &mut bl, th()).unwrap_err().to_string();
            assert!(err.contains("residual") || err.contains("block slice"), "{p:?}: {err}");
            // Out of place, with the wrong length on either residual.
            for (src_len, next_len) in [(res_len, n), (n, res_len)] {
                let src = vec![7f32; src_len];
                let mut next = vec![7f32; next_len];
                let err = p.quantize_to(&grad, &src, &mut next, &mut bl, th(), true).unwrap_err().to_string();
                assert!(err.contains("residual") || err.contains("block slice"), "{p:?}: {err}");
                assert!(next.iter().all(|&x| x == 7.0) && bl.iter().all(|&b| b == 5), "{p:?} wrote on error");
                assert!(join::quantize_to(p, &grad, &src, &mut next, &mut bl, th()).is_err());
            }
        }
        for blk_len in [0, 2, 4, 100] {
            let bl = vec![0x4000_0000u32; blk_len];
            let mut out = vec![3f32; n];
            assert!(p.dequantize::<false>(&bl, th(), &mut out).unwrap_err().to_string().contains("block slice"));
            assert!(p.dequantize::<true>(&bl, th(), &mut out).is_err());
            assert!(join::dequantize::<true>(p, &bl, th(), &mut out).is_err());
            assert!(out.iter().all(|&x| x == 3.0), "{p:?} wrote on error");
        }
    }
}

/// Plants `bad` at `at` in the gradient (or, when `in_residual`, the residual)
/// of an otherwise finite input of `n` elements.
fn with_bad<G: Gradient>(conv: fn(f32) -> G, n: usize, at: usize, bad: f32, in_residual: bool) -> (Vec<G>, Vec<f32>) {
    let mut rng = Rng(n as u64 * 31 + at as u64);
    let mut grad: Vec<G> = (0..n).map(|_| conv(rng.uniform(0.7))).collect();
    let mut residual: Vec<f32> = (0..n).map(|_| rng.uniform(0.4)).collect();
    if in_residual {
        residual[at] = bad;
    } else {
        grad[at] = conv(bad);
    }
    (grad, residual)
}

fn check_non_finite_detection<G: Gradient>(conv: fn(f32) -> G) {
    let sizes = [1, 15, 16, 17, 63, 64, 65, 200, CHUNK - 1, CHUNK + 1, 3 * CHUNK + 5];
    for &n in &sizes {
        for at in [0, n / 2, n - 1] {
            for (bad, in_residual) in [(f32::NAN, false), (f32::INFINITY, false), (f32::NEG_INFINITY, true), (f32::NAN, true)] {
                let (grad, residual) = with_bad(conv, n, at, bad, in_residual);
                let want = reference::first_non_finite(&grad, &residual);
                assert_eq!(want.map(|w| w.0), Some(at));
                for p in Platform::available() {
                    let got = p.first_non_finite(&grad, &residual).unwrap();
                    assert_eq!(got.map(|g| (g.0, g.1.to_bits())), want.map(|w| (w.0, w.1.to_bits())), "{p:?} n={n} at={at} {:?}", G::DTYPE);
                    let got = join::first_non_finite(p, &grad, &residual).unwrap();
                    assert_eq!(got.map(|g| g.0), Some(at), "{p:?}+threads n={n} at={at}");
                }
                // The API refuses it, names the element, and writes nothing.
                let mut res = residual.clone();
                let mut compr = vec![7f32; compressed_len(n)];
                let err = quantize_2bit(&grad, &mut res, &mut compr, th()).unwrap_err();
                assert!(matches!(err, Error::NonFinite { index, .. } if index == at), "{err}");
                assert_eq!(bits(&res), bits(&residual));
                assert!(compr.iter().all(|&c| c == 7.0));
                // Out of place: the same error from the fused pass, the residual only read.
                let mut next = vec![0f32; n];
                let err = quantize_2bit_to(&grad, &residual, &mut next, &mut compr, th()).unwrap_err();
                assert!(matches!(err, Error::NonFinite { index, .. } if index == at), "{err}");
                for p in Platform::available() {
                    assert!(!join::quantize_to(p, &grad, &residual, &mut next, &mut vec![0; n.div_ceil(16)], th()).unwrap(), "{p:?} n={n} at={at}");
                }
            }
        }
        // A second bad element later never hides the first.
        let (mut grad, residual) = with_bad(conv, n, n - 1, f32::NAN, false);
        grad[n / 3] = conv(f32::INFINITY);
        for p in Platform::available() {
            assert_eq!(join::first_non_finite(p, &grad, &residual).unwrap().map(|g| g.0), Some(n / 3), "{p:?} n={n}");
        }
    }
}

#[test]
fn non_finite_sums_are_found_at_their_first_index_f32() {
    check_non_finite_detection::<f32>(|x| x);
}

#[test]
fn non_finite_sums_are_found_at_their_first_index_f16() {
    check_non_finite_detection::<f16>(f16::from_f32);
}

#[test]
fn non_finite_sums_are_found_at_their_first_index_bf16() {
    check_non_finite_detection::<bf16>(bf16::from_f32);
}

#[test]
fn residual_overflow_is_refused_before_it_poisons() {
    // 3e38 twice: the first push leaves a residual near 3e38, the second sum
    // overflows to inf. It is refused and the residual keeps its finite value.
    let n = 33;
    let grad = vec![3e38f32; n];
    let mut residual = vec![0f32; n];
    let mut compr = create_2bit(n);
    quantize_2bit(&grad, &mut residual, &mut compr, th()).unwrap();
    let (res_before, compr_before) = (bits(&residual), bits(&compr));
    let err = quantize_2bit(&grad, &mut residual, &mut compr, th()).unwrap_err();
    assert!(err.to_string().contains("at element 0") && err.to_string().contains("inf"), "{err}");
    assert_eq!((bits(&residual), bits(&compr)), (res_before, compr_before));
    // A finite push afterwards goes on from the kept residual.
    quantize_2bit(&vec![-3e38f32; n], &mut residual, &mut compr, th()).unwrap();
    assert!(residual.iter().all(|r| r.is_finite()));
}

#[test]
fn fused_reduce_refuses_a_non_finite_device_untouched() {
    let n = 40;
    let good = vec![0.3f32; n];
    let mut bad = vec![0.3f32; n];
    bad[21] = f32::NAN;
    let grads = [Grad::F32(&good), Grad::F32(&bad)];
    let (r0, r1) = (vec![0.1f32; n], vec![0.2f32; n]);
    let (mut x0, mut x1) = (vec![0f32; n], vec![0f32; n]);
    let (mut c0, mut c1) = (vec![5f32; compressed_len(n)], vec![6f32; compressed_len(n)]);
    let mut sum = vec![9f32; n];
    // The residuals are only read: the caller swaps the next ones in on success.
    let err = quantize_2bit_reduce(&grads, &[&r0, &r1], &mut [&mut x0, &mut x1], &mut [&mut c0, &mut c1], &mut sum, th()).unwrap_err();
    assert!(matches!(&err, Error::NonFinite { what, index: 21, .. } if what == "pushed value 1"), "{err}");
    assert!(r0.iter().all(|&x| x == 0.1) && r1.iter().all(|&x| x == 0.2));
}
