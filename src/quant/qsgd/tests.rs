//! QSGD's tests: the public API's promises (unbiased, within the max-norm
//! variance bound, exact sums, errors that write nothing), then `kernels`:
//! every kernel (portable on each instruction set, and the hand-written
//! AVX2 and AVX-512 decodes) against the scalar `reference`, bit for bit,
//! on boundary sizes. Must not touch: production code paths' state.

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
fn a_scale_whose_factor_overflows_float32_quantizes_zeros_to_zero() {
    // 15 / 2e-38 (4 bits) overflows float32: the factor was infinite, and
    // every element, zeros included, took the code +-15 (a zero decoded to M).
    let scale = 2e-38f32;
    let g = [scale, 0.0, -0.0, 1e-41, -1e-41];
    let mut codes = [9i32; 5];
    quantize(&g, scale, 4, 7, &mut codes).unwrap();
    assert_eq!(codes, [0; 5]);
    let mut out = [1f32; 5];
    decode(&codes, scale, 4, &mut out).unwrap();
    assert_eq!(out, [0.0; 5]);
    // At 2 bits 3 / 2e-38 fits: the same scale still codes.
    quantize(&g[..2], scale, 2, 7, &mut codes[..2]).unwrap();
    assert_eq!(codes[..2], [3, 0]);
}

#[test]
fn a_decode_refuses_a_bad_scale_and_lanes_whose_sums_are_not_an_i32() {
    let mut out = [7f32; 2];
    for scale in [f32::NAN, f32::INFINITY, -1.0] {
        let err = decode(&[1, -1], scale, 2, &mut out).unwrap_err().to_string();
        assert!(err.contains("'scale'"), "{err}");
        let words = crate::quant::lanes::pack_slice(&[1u64, 2], 4, |v| v);
        let err = decode_packed(&words, 4, -3, scale, &[3], None, &mut out).unwrap_err().to_string();
        assert!(err.contains("'scale'"), "{err}");
    }
    // A base past an i32, or lanes whose sum with it leaves an i32: the
    // sums wrapped (base i64::MAX decoded to -6e17).
    let words = crate::quant::lanes::pack_slice(&[1u64, 2], 4, |v| v);
    for base in [i64::MAX, i64::MIN, i32::MAX as i64 + 1] {
        let err = decode_packed(&words, 4, base, 1.0, &[3], None, &mut out).unwrap_err().to_string();
        assert!(err.contains("'base'"), "{err}");
        let err = crate::quant::lanes::unpack_codes(&words, 4, base, &mut [0; 2]).unwrap_err().to_string();
        assert!(err.contains("'base'"), "{err}");
    }
    let wide = crate::quant::lanes::pack_slice(&[5u64, u32::MAX as u64], 32, |v| v);
    let mut sums = [0i32; 2];
    let err = crate::quant::lanes::unpack_codes(&wide, 32, 1, &mut sums).unwrap_err().to_string();
    assert!(err.contains("'lanes'") && err.contains("4294967295"), "{err}");
    assert_eq!(sums, [0, 0]);
    let err = decode_packed(&wide, 32, 1, 1.0, &[3, 7], Some(&[0, 1]), &mut out).unwrap_err().to_string();
    assert!(err.contains("'lanes'"), "{err}");
    assert_eq!(out, [7.0; 2]);
    // The widest lanes whose sums fit are taken.
    crate::quant::lanes::unpack_codes(&wide, 32, i32::MIN as i64, &mut sums).unwrap();
    assert_eq!(sums, [i32::MIN + 5, i32::MAX]);
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

/// Every kernel against the reference (`reference`), bit for bit.
mod kernels {
    use super::super::portable::*;
    use super::super::{decode_levels_packed, decode_single_packed, reference, tables, TABLE};
    use crate::isa::Isa;
    use crate::quant::lanes;

    fn grad(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 7919 % 2001) as f32 - 1000.0) / 997.0).collect()
    }

    const SIZES: [usize; 12] = [0, 1, 7, 8, 9, 15, 16, 17, 33, 511, 513, 1001];

    #[test]
    fn a_decode_streams_only_past_the_last_level_cache() {
        let mib = 1usize << 20;
        // 16 Mi values: streamed past a 32 MiB cache, kept in a 300 MiB one
        assert!(super::super::decode_streams_with(16 * mib, Some(32 * mib)));
        assert!(!super::super::decode_streams_with(16 * mib, Some(300 * mib)));
        assert!(super::super::decode_streams_with(128 * mib, Some(300 * mib)));
        // small decodes never; an unknown cache from 4 Mi values
        assert!(!super::super::decode_streams_with(mib - 1, Some(0)));
        assert!(!super::super::decode_streams_with(4 * mib - 1, None) && super::super::decode_streams_with(4 * mib, None));
    }

    #[test]
    fn every_kernel_matches_the_reference() {
        let scales = [3u32, 15, 255];
        let (ft, st) = tables(&scales, 1.0031);
        for n in SIZES {
            let g = grad(n);
            let mut want_l = vec![0u8; n];
            reference::fit_levels(&g, 1.0031, &scales, &mut want_l);
            assert!(n < 1000 || (want_l.contains(&0) && want_l.contains(&2)));
            let want_single = reference::quantize(&g, 1.0031, &scales[..1], None, 10, 77);
            let want_levels = reference::quantize(&g, 1.0031, &scales, Some(&want_l), 10, 5);
            for isa in Isa::available() {
                let mut l = vec![9u8; n];
                fit(isa, &g, &mut l, &ft, scales.len(), 3.0);
                assert_eq!(l, want_l, "{isa:?} n={n}");
                for add in [false, true] {
                    let (mut a, mut b) = (vec![2i32; n], vec![2i32; n]);
                    if add {
                        single::<true>(isa, &g, &mut a, 10, 77, ft[0], st[0]);
                        levels::<true>(isa, &g, &l, &mut b, 10, 5, &ft, &st);
                    } else {
                        single::<false>(isa, &g, &mut a, 10, 77, ft[0], st[0]);
                        levels::<false>(isa, &g, &l, &mut b, 10, 5, &ft, &st);
                    }
                    let base = if add { 2 } else { 0 };
                    assert!(a.iter().zip(&want_single).all(|(x, w)| *x == w + base), "{isa:?} single n={n} add={add}");
                    assert!(b.iter().zip(&want_levels).all(|(x, w)| *x == w + base), "{isa:?} levels n={n} add={add}");
                }
                let steps: [f64; TABLE] = std::array::from_fn(|j| 1.0031 / (j as f64 + 1.5));
                let (mut d, mut dl) = (vec![0f32; n], vec![0f32; n]);
                decode(isa, &want_single, &mut d, steps[0]);
                decode_levels(isa, &want_levels, &want_l, &mut dl, &steps);
                assert!(d.iter().zip(&want_single).all(|(d, &c)| *d == (c as f64 * steps[0]) as f32), "{isa:?} decode n={n}");
                assert!(dl.iter().zip(&want_levels).zip(&want_l).all(|((d, &c), &j)| *d == (c as f64 * steps[j as usize]) as f32), "{isa:?} decode n={n}");
                // one step straight from lanes, at several widths (the codes spread)
                for spread in [1i32, 5, 1000] {
                    let codes: Vec<i32> = want_single.iter().map(|&c| c * spread).collect();
                    let lo = codes.iter().copied().min().unwrap_or(0);
                    let width = lanes::width_for(codes.iter().map(|&c| (c - lo) as u64).max().unwrap_or(0));
                    let packed = lanes::pack_slice(&codes, width, |c| (c - lo) as u64);
                    for stream in [false, true] {
                        let mut ds = vec![f32::NAN; n];
                        decode_single_packed(isa, &packed, width, lo as f64, steps[0], false, stream, &mut ds).unwrap();
                        assert!(ds.iter().zip(&codes).all(|(d, &c)| d.to_bits() == ((c as f64 * steps[0]) as f32).to_bits()), "{isa:?} single packed decode n={n} width={width}");
                        assert!(decode_single_packed(isa, &packed[..packed.len().saturating_sub(1)], width, lo as f64, steps[0], false, stream, &mut ds).is_err() || n == 0);
                        // twice each lane, step 1 (1-bit's 2 ones - workers, here with 7 workers)
                        decode_single_packed(isa, &packed, width, -7.0, 1.0, true, stream, &mut ds).unwrap();
                        assert!(ds.iter().zip(&codes).all(|(d, &c)| d.to_bits() == ((2 * (c - lo) as i64 - 7) as f32).to_bits()), "{isa:?} twice packed decode n={n} width={width}");
                    }
                }
                // 2 to 4 steps in use (steps in registers) and 5 (select passes)
                let lo = want_levels.iter().copied().min().unwrap_or(0);
                let width = lanes::width_for(want_levels.iter().map(|&c| (c - lo) as u64).max().unwrap_or(0));
                let packed = lanes::pack_slice(&want_levels, width, |c| (c - lo) as u64);
                for count in 2..=5 {
                    let few: [f64; TABLE] = std::array::from_fn(|j| if j < count { steps[j] } else { 0.0 });
                    let l: Vec<u8> = (0..n).map(|i| ((i * 7 + i / 3) % count) as u8).collect();
                    decode_levels(isa, &want_levels, &l, &mut dl, &few);
                    assert!(dl.iter().zip(&want_levels).zip(&l).all(|((d, &c), &j)| *d == (c as f64 * few[j as usize]) as f32), "{isa:?} decode of {count} steps n={n}");
                    // and straight from lanes, where 2 to 4 are in use
                    let mut dp = vec![f32::NAN; n];
                    assert_eq!(decode_levels_packed(isa, &packed, width, lo as f64, &l, &mut dp, &few, false), count <= 4);
                    if count <= 4 {
                        assert_eq!(dp.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), dl.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), "{isa:?} packed decode of {count} steps n={n}");
                        // an index past the steps takes the first step, as `pick` has it
                        let past: Vec<u8> = l.iter().enumerate().map(|(i, &j)| if i % 3 == 0 { [count as u8, 4, 5, 9, 255][i % 5] } else { j }).collect();
                        decode_levels(isa, &want_levels, &past, &mut dl, &few);
                        assert!(dl.iter().zip(&want_levels).zip(&past).all(|((d, &c), &j)| *d == (c as f64 * few[if (j as usize) < count { j as usize } else { 0 }]) as f32));
                        decode_levels_packed(isa, &packed, width, lo as f64, &past, &mut dp, &few, false);
                        assert_eq!(dp.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), dl.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), "{isa:?} packed decode of {count} steps, indices past them, n={n}");
                        // written past the caches: the same bits
                        dp.fill(f32::NAN);
                        decode_levels_packed(isa, &packed, width, lo as f64, &past, &mut dp, &few, true);
                        assert_eq!(dp.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), dl.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), "{isa:?} packed decode of {count} steps, indices past them, n={n}");
                    }
                }
                let mut x = g.clone();
                let want = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                assert_eq!(max_abs(isa, &x), (want, true), "{isa:?} n={n}");
                // The largest magnitude negative, -0.0, subnormals: still exact.
                if n > 2 {
                    (x[0], x[1], x[n - 1]) = (-0.0, f32::from_bits(1), -2.5);
                    let want = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                    assert_eq!(max_abs(isa, &x), (want, true), "{isa:?} n={n}");
                    assert_eq!(max_abs(isa, &[-0.0, f32::from_bits(0x8000_0001)]), (f32::from_bits(1), true));
                }
                // A non-finite value of either sign at any place: a chunk's
                // first or last lane, or the remainder.
                for at in [0, n / 2, n.saturating_sub(1)].into_iter().filter(|&at| at < n) {
                    for bad in [f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                        let mut y = g.clone();
                        y[at] = bad;
                        assert!(!max_abs(isa, &y).1, "{isa:?} n={n}: {bad} at {at} missed");
                    }
                }
            }
        }
    }

    #[test]
    fn packed_kernels_write_the_reference_codes_in_the_lane_layout() {
        use crate::quant::lanes;
        // 2 to 4 scales (kernels with the scales in registers) and 5 (select passes)
        for scales in [&[3u32, 15][..], &[3, 15, 255], &[3, 7, 15, 255], &[3, 5, 7, 15, 255]] {
            let (ft, st) = tables(scales, 1.0031);
            // widths for 1, 2 and 5 members of codes in [-3, 3]; pieces across
            // a block, and a piece across a noise block (offset near 2^32)
            for (n, offset) in [(0usize, 10usize), (1, 10), (167, 10), (168, 10), (169, 0), (5000, 10), (100, (1 << 32) - 37)] {
                let g = grad(n);
                let mut l = vec![0u8; n];
                fit(Isa::detect(), &g, &mut l, &ft, scales.len(), 3.0);
                let want_single = reference::quantize(&g, 1.0031, &scales[..1], None, offset, 77);
                let want_levels = reference::quantize(&g, 1.0031, scales, Some(&l), offset, 5);
                for width in [3u32, 4, 5, 7, 9, 16, 21, 22, 32] {
                    let lanes_of = |c: &[i32], times: u64| lanes::pack_slice(c, width, |c| (c + 3) as u64 * times);
                    for isa in Isa::available() {
                        // adding a second member's codes needs lanes for two (4 bits)
                        for add in [false, true].into_iter().filter(|&add| !add || width > 3) {
                            let (mut a, mut b) = (lanes_of(&want_single, 1), lanes_of(&want_levels, 1));
                            if add {
                                single_packed::<true>(isa, &g, &mut a, offset, 77, ft[0], st[0], width);
                                levels_packed::<true>(isa, &g, &l, &mut b, offset, 5, &ft, &st, width);
                            } else {
                                single_packed::<false>(isa, &g, &mut a, offset, 77, ft[0], st[0], width);
                                levels_packed::<false>(isa, &g, &l, &mut b, offset, 5, &ft, &st, width);
                            }
                            let times = if add { 2 } else { 1 };
                            assert_eq!(a, lanes_of(&want_single, times), "{isa:?} single n={n} width={width} add={add}");
                            assert_eq!(b, lanes_of(&want_levels, times), "{isa:?} levels {scales:?} n={n} width={width} add={add}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn packed_decodes_of_narrow_lanes_give_the_products_of_the_codes() {
        use crate::quant::lanes;
        // Widths 1 to 7 with one step (tables up to 6 bits, 4 on AVX2;
        // once and twice each lane) and 2 to 4 (tables of 32 and 64
        // where they fit, compares and blends where not); sizes that end on a whole
        // group, on an odd lane (21 lanes of 3 bits: AVX-512's tables
        // pair lanes) and past the groups.
        let mut rng = crate::hash::SplitMix(17);
        for width in 1..=7u32 {
            let per = (64 / width) as usize;
            for n in [0, 1, 8 * per - 1, 8 * per, 8 * per + 8, 24 * per + 5, 40_000] {
                let lo = -(1i32 << (width - 1));
                let codes: Vec<i32> = (0..n).map(|_| lo + (rng.next_u64() % (1 << width)) as i32).collect();
                let packed = lanes::pack_slice(&codes, width, |c| (c - lo) as u64);
                for (twice, base, step) in [(false, lo as f64, 0.37), (true, -7.0, 1.0)] {
                    let want: Vec<u32> = codes.iter().map(|&c| ((if twice { 2 * (c - lo) as i64 - 7 } else { c as i64 }) as f64 * step) as f32).map(f32::to_bits).collect();
                    for isa in Isa::available() {
                        for stream in [false, true] {
                            let mut got = vec![f32::NAN; n];
                            decode_single_packed(isa, &packed, width, base, step, twice, stream, &mut got).unwrap();
                            assert_eq!(got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want, "{isa:?} one step, width {width}, twice {twice}, n={n}, stream {stream}");
                        }
                    }
                }
                for count in 2..=4 {
                    let few: [f64; TABLE] = std::array::from_fn(|j| if j < count { 0.37 / (j as f64 + 1.25) } else { 0.0 });
                    // every index in use, and some past the steps (`pick`: the first step)
                    let l: Vec<u8> = (0..n)
                        .map(|_| {
                            let x = rng.next_u64();
                            if x % 7 == 0 { [count as u8, 4, 5, 9, 255][(x >> 8) as usize % 5] } else { ((x >> 16) as usize % count) as u8 }
                        })
                        .collect();
                    let step = |j: u8| few[if (j as usize) < count { j as usize } else { 0 }];
                    let want: Vec<u32> = codes.iter().zip(&l).map(|(&c, &j)| ((c as f64 * step(j)) as f32).to_bits()).collect();
                    for isa in Isa::available() {
                        for stream in [false, true] {
                            let mut got = vec![f32::NAN; n];
                            assert!(decode_levels_packed(isa, &packed, width, lo as f64, &l, &mut got, &few, stream));
                            assert_eq!(got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want, "{isa:?} width {width}, {count} steps, n={n}, stream {stream}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn packed_decode_matches_the_decode_of_unpacked_codes() {
        use crate::quant::lanes;
        let scales = [3u32, 15, 255];
        for n in [0usize, 1, 168, 169, 3000, 40_000] {
            let codes: Vec<i32> = (0..n as i32).map(|i| (i * 7) % 13 - 6).collect(); // 2 members' sums in [-6, 6]
            let l: Vec<u8> = (0..n).map(|i| (i % 3) as u8).collect();
            let width = lanes::width_for(12);
            let words = lanes::pack_slice(&codes, width, |c| (c + 6) as u64);
            for level_of in [None, Some(&l[..])] {
                let levels = if level_of.is_some() { &scales[..] } else { &scales[..1] };
                let (mut want, mut got) = (vec![0f32; n], vec![1f32; n]);
                super::super::decode_at(&codes, 0.77, levels, level_of, &mut want).unwrap();
                super::super::decode_packed(&words, width, -6, 0.77, levels, level_of, &mut got).unwrap();
                assert_eq!(got, want, "n={n} levels={}", levels.len());
            }
            if n > 0 {
                let mut out = vec![0f32; n];
                assert!(super::super::decode_packed(&words[1..], width, -6, 0.77, &scales[..1], None, &mut out).is_err());
                let mut bad = l.clone();
                bad[n - 1] = 3;
                assert!(super::super::decode_packed(&words, width, -6, 0.77, &scales, Some(&bad), &mut out).is_err());
                assert!(super::super::decode_packed(&words, width, -6, 0.77, &scales, None, &mut out).is_err());
            }
        }
    }

    #[test]
    fn an_all_zero_scale_and_a_scale_whose_factors_overflow_give_zero_codes() {
        // scale 0, and scales so tiny that s / scale overflows float32,
        // give factors 0: every code 0 (they gave +-s, zeros included).
        for scale in [0.0f32, 1e-45, 2e-38] {
            let g = vec![0.0f32, -0.0, 1e-45, -1e-45, 0.0];
            let scales = [1u32, 7];
            let (ft, st) = tables(&scales, scale);
            let mut want_l = vec![0u8; 5];
            reference::fit_levels(&g, scale, &scales, &mut want_l);
            let want = reference::quantize(&g, scale, &scales, Some(&want_l), 0, 3);
            for isa in Isa::available() {
                let (mut l, mut c) = (vec![0u8; 5], vec![0i32; 5]);
                fit(isa, &g, &mut l, &ft, 2, 1.0);
                levels::<false>(isa, &g, &l, &mut c, 0, 3, &ft, &st);
                assert_eq!((&l, &c), (&want_l, &want), "{isa:?} scale={scale}");
            }
            assert!(want.iter().all(|&c| c == 0), "scale={scale}: {want:?}");
        }
    }
}
