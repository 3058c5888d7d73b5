//! QSGD's tests of the public API's promises: unbiased, within the max-norm
//! variance bound, exact sums, errors that write nothing. Must not touch:
//! production code paths' state.

use super::*;
use crate::quant::noise;
use crate::quant::scheme::{from_wire, to_wire, Part};

fn grad(n: usize, seed: u64) -> Vec<f32> {
    (0..n).map(|i| (noise::uniform(seed, i as u64) - 0.5) * 2.0).collect()
}

#[test]
fn unbiased_mean_approaches_the_input() {
    let g = grad(200, 1);
    let scale = g.iter().fold(0f32, |m, x| m.max(x.abs()));
    for bits in [1, 2, 4] {
        let s = levels(bits).unwrap() as f64;
        let trials = 4000;
        let mut mean = vec![0f64; g.len()];
        let mut codes = vec![0i32; g.len()];
        for t in 0..trials {
            quantize(&g, scale, bits, 1000 + t, &mut codes).unwrap();
            mean.iter_mut().zip(&codes).for_each(|(m, &c)| *m += c as f64 * scale as f64 / s / trials as f64);
        }
        // per element the standard error is at most (M/s)/2/sqrt(trials)
        let tol = 5.0 * (scale as f64 / s) / 2.0 / (trials as f64).sqrt();
        for (m, &x) in mean.iter().zip(&g) {
            assert!((m - x as f64).abs() < tol, "bits={bits}: mean {m} vs {x} (tol {tol})");
        }
    }
}

#[test]
fn variance_within_the_max_norm_bound() {
    // E||Q(g) - g||^2 = sum (M/s)^2 p(1-p) <= n (M/s)^2 / 4.
    let g = grad(1000, 2);
    let scale = 1.0;
    for bits in [1, 3, 8] {
        let step = scale / levels(bits).unwrap() as f32;
        let mut codes = vec![0i32; g.len()];
        let mut total = 0f64;
        let trials = 200;
        for t in 0..trials {
            quantize(&g, scale, bits, t, &mut codes).unwrap();
            total += g.iter().zip(&codes).map(|(&x, &c)| ((c as f32 * step - x) as f64).powi(2)).sum::<f64>();
        }
        let bound = g.len() as f64 * (step as f64).powi(2) / 4.0;
        assert!(total / trials as f64 <= bound * 1.05, "bits={bits}: {} > {bound}", total / trials as f64);
    }
}

#[test]
fn codes_sum_exactly_and_every_worker_decodes_alike() {
    let bits = 4;
    let workers: Vec<Vec<f32>> = (0..5).map(|w| grad(333, 10 + w)).collect();
    let scale = workers.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
    let mut acc = vec![0i32; 333];
    let mut direct = vec![0i32; 333];
    for (w, g) in workers.iter().enumerate() {
        let mut codes = vec![0i32; 333];
        quantize(g, scale, bits, 77 + w as u64, &mut codes).unwrap();
        assert!(codes.iter().all(|c| c.abs() <= 15));
        // On the wire: lanes of 5 bits (2s + 1 = 31 values), 12 to a word, after a 17-byte header.
        let wire = to_wire(&Part::Codes { codes: codes.clone(), lo: -15, hi: 15 });
        assert_eq!(wire.len(), 17 + 8 * 333usize.div_ceil(12));
        let Part::Codes { codes: received, .. } = from_wire(&wire).unwrap().unpacked().unwrap().into_owned() else { unreachable!() };
        crate::quant::collective::add_codes(&mut acc, &received).unwrap();
        direct.iter_mut().zip(&codes).for_each(|(d, c)| *d += c);
    }
    assert_eq!(acc, direct);
    let (mut a, mut b) = (vec![0f32; 333], vec![0f32; 333]);
    decode(&acc, scale, bits, &mut a).unwrap();
    decode(&direct, scale, bits, &mut b).unwrap();
    assert_eq!(a, b);
}

#[test]
fn no_overflow_at_the_largest_worker_count() {
    let bits = MAX_BITS;
    let s = levels(bits).unwrap() as i32;
    let workers = max_workers(bits).unwrap();
    let mut acc = vec![0i32; 2];
    for _ in 0..workers {
        crate::quant::collective::add_codes(&mut acc, &[s, -s]).unwrap();
    }
    assert_eq!(acc, vec![s * workers as i32, -s * workers as i32]);
    assert!(crate::quant::collective::add_codes(&mut acc, &[s, 0]).unwrap_err().to_string().contains("too many workers"));
}

#[test]
fn deterministic_given_the_seed() {
    let g = grad(500, 3);
    let (mut a, mut b, mut c) = (vec![0i32; 500], vec![0i32; 500], vec![0i32; 500]);
    quantize(&g, 1.0, 2, 9, &mut a).unwrap();
    quantize(&g, 1.0, 2, 9, &mut b).unwrap();
    quantize(&g, 1.0, 2, 10, &mut c).unwrap();
    assert_eq!(a, b);
    assert_ne!(a, c);
}

#[test]
fn bad_parameters_are_errors_and_touch_nothing() {
    let g = vec![0.5f32, -2.0];
    let mut codes = vec![7i32; 2];
    for (bits, scale, want) in [(0, 2.0, "'bits'"), (16, 2.0, "'bits'"), (2, 1.0, "below the gradient's max"), (2, f32::NAN, "'scale'"), (2, -1.0, "'scale'")] {
        let err = quantize(&g, scale, bits, 0, &mut codes).unwrap_err().to_string();
        assert!(err.contains(want), "{err}");
        assert_eq!(codes, vec![7, 7]);
    }
    assert!(quantize(&[f32::NAN], 1.0, 2, 0, &mut [0]).is_err());
    // 8 codes at 2 bits (in [-3, 3]: 3-bit lanes) take one word; the wire checks length and range.
    let wire = to_wire(&Part::Codes { codes: vec![0; 8], lo: -3, hi: 3 });
    assert_eq!(*from_wire(&wire).unwrap().unpacked().unwrap(), Part::Codes { codes: vec![0; 8], lo: -3, hi: 3 });
    assert!(from_wire(&wire[..wire.len() - 1]).is_err());
    let mut out_of_range = wire.clone();
    out_of_range[17] = 0b111; // lane 0 holds 7: code 4, outside [-3, 3]
    assert!(from_wire(&out_of_range).unwrap_err().to_string().contains("outside"));
    let mut zeros = vec![5i32; 3];
    quantize(&[0.0; 3], 0.0, 4, 0, &mut zeros).unwrap();
    assert_eq!(zeros, vec![0; 3]);
}

#[test]
fn a_scale_index_out_of_range_is_named_and_nothing_is_written() {
    let n = 3 * crate::par::CHUNK + 5; // several parallel pieces
    let g: Vec<f32> = (0..n).map(|i| noise::uniform(3, i as u64) - 0.5).collect();
    let mut l = vec![1u8; n];
    l[n - 2] = 2; // of two levels
    let mut codes = vec![7i32; n];
    let e = quantize_at(&g, 1.0, &[3, 15], Some(&l), 1, &mut codes).unwrap_err().to_string();
    assert_eq!(e, format!("invalid parameter 'levels': element {} names level 2 of 2", n - 2));
    assert!(codes.iter().all(|&c| c == 7));
    let mut out = vec![9f32; n];
    let e = decode_at(&codes, 1.0, &[3, 15], Some(&l), &mut out).unwrap_err().to_string();
    assert_eq!(e, "invalid parameter 'levels': level 2 of 2");
    assert!(out.iter().all(|&v| v == 9.0));
    l[n - 2] = 0;
    quantize_at(&g, 1.0, &[3, 15], Some(&l), 1, &mut codes).unwrap();
    decode_at(&codes, 1.0, &[3, 15], Some(&l), &mut out).unwrap();
}
