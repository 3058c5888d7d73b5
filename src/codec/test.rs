//! Every kernel against the reference, bit for bit, on boundary sizes and over
//! several residual steps; the golden example; every error rule.

use half::{bf16, f16};

use super::join::CHUNK;
use super::*;

/// splitmix64: deterministic test data without a dependency.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
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
        for p in Platform::available() {
            runs.push((format!("{p:?}"), vec![0f32; n], vec![0f32; compressed_len(n)]));
            runs.push((format!("{p:?}+threads"), vec![0f32; n], vec![0f32; compressed_len(n)]));
        }
        for (step, g) in grads.iter().enumerate() {
            reference::quantize(g, &mut ref_res, &mut ref_blocks, th());
            for (k, (name, res, compr)) in runs.iter_mut().enumerate() {
                let p = Platform::available()[k / 2];
                if k % 2 == 0 {
                    p.quantize(g, res, blocks_mut(compr), th());
                } else {
                    join::quantize(p, g, res, blocks_mut(compr), th());
                }
                assert_eq!(bits(res), bits(&ref_res), "{name} residual, n={n} step={step} {:?}", G::DTYPE);
                assert_eq!(blocks(compr), &ref_blocks[..], "{name} blocks, n={n} step={step} {:?}", G::DTYPE);
                // Decoding, overwrite and add, also bit for bit.
                let mut want = vec![0f32; n];
                reference::dequantize::<false>(&ref_blocks, th(), &mut want);
                let mut got = vec![1f32; n];
                join::dequantize::<false>(p, &ref_blocks, th(), &mut got);
                assert_eq!(bits(&got), bits(&want), "{name} dequantize n={n}");
                let mut want_sum: Vec<f32> = ref_res.clone();
                reference::dequantize::<true>(&ref_blocks, th(), &mut want_sum);
                let mut got_sum = ref_res.clone();
                p.dequantize::<true>(&ref_blocks, th(), &mut got_sum);
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
        p.quantize(&grad, &mut res, &mut bl, th());
        assert_eq!(bits(&res), bits(&ref_res), "{p:?}");
        assert_eq!(bl, ref_blocks, "{p:?}");
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
            let mut res = start.clone();
            let mut comprs = vec![create_2bit(n); devices];
            let mut sum = vec![7f32; n];
            {
                let mut r: Vec<&mut [f32]> = res.iter_mut().map(|v| &mut v[..]).collect();
                let mut c: Vec<&mut [f32]> = comprs.iter_mut().map(|v| &mut v[..]).collect();
                quantize_2bit_reduce(grads, &mut r, &mut c, &mut sum, th()).unwrap();
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
    let mut r0 = vec![0.5f32; 20];
    let mut r1 = vec![0.5f32; 19];
    let mut c0 = vec![9f32; 5];
    let mut c1 = vec![9f32; 5];
    let mut sum = vec![3f32; 20];
    let err = quantize_2bit_reduce(&[Grad::F32(&g), Grad::F32(&g)], &mut [&mut r0, &mut r1], &mut [&mut c0, &mut c1], &mut sum, th()).unwrap_err();
    assert_eq!(err.to_string(), "residual has 19 elements, expected 20");
    assert!(r0.iter().all(|&x| x == 0.5) && c0.iter().all(|&x| x == 9.0) && sum.iter().all(|&x| x == 3.0));
}
