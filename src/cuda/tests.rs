//! Without the feature: the stand-in's error. With it: the source compiles
//! with NVRTC for sm_70 and sm_90 on every machine; without a driver the
//! API says so; on a GPU (tests marked `ignore`, run with `--ignored` on a
//! GPU machine), every kernel is bit-identical to the CPU on boundary sizes.

#[cfg(not(feature = "cuda"))]
#[test]
fn without_the_feature_every_entry_says_not_available() {
    let e = super::Gpu::new(0).err().expect("no GPU without the feature").to_string();
    assert_eq!(e, "CUDA not available: gradpack was built without its `cuda` feature");
    assert_eq!(super::device_count().unwrap_err().to_string(), e);
    assert_eq!(super::driver_available().unwrap_err().to_string(), e);
}

#[cfg(feature = "cuda")]
mod with_feature {
    use super::super::*;

    #[test]
    fn kernels_compile_with_nvrtc_for_sm_70_and_sm_90() {
        nvrtc_available().expect("the test command puts the PyPI NVRTC on LD_LIBRARY_PATH");
        for arch in ["sm_70", "sm_90"] {
            let ptx = compile_ptx(arch).unwrap().to_src();
            assert!(ptx.contains(&format!(".target {arch}")), "{arch}: {}", &ptx[..ptx.len().min(400)]);
            for k in KERNELS {
                assert!(ptx.contains(&format!(".entry {k}(")), "{arch}: kernel {k} missing from the PTX");
            }
            // --fmad=false: no fused multiply-add anywhere (results must round as the CPU's).
            assert!(!ptx.contains("fma.rn.f32"), "{arch}: contracted float ops in the PTX");
        }
    }

    #[test]
    fn without_a_driver_or_gpu_the_api_says_not_available() {
        match driver_available() {
            Err(e) => {
                assert!(e.to_string().starts_with("CUDA not available: no CUDA driver library"), "{e}");
                assert_eq!(Gpu::new(0).err().unwrap().to_string(), e.to_string());
                assert_eq!(device_count().unwrap_err().to_string(), e.to_string());
            }
            Ok(()) => {
                let n = device_count().unwrap();
                let e = Gpu::new(n).err().expect("one past the last GPU").to_string();
                assert_eq!(e, format!("CUDA not available: GPU {n} was asked for; this machine has {n}"));
            }
        }
    }

    mod gpu {
        //! On a GPU: `cargo test --features cuda --lib cuda -- --ignored`.
        use super::super::super::*;
        use crate::codec::{self, Grad, Thresholds};
        use crate::hash::SplitMix;
        use crate::quant::{noise, onebit, qsgd, scheme};

        const SIZES: [usize; 14] = [0, 1, 15, 16, 17, 31, 32, 33, 255, 256, 257, 4097, (1 << 20) + 3, 3_000_001];

        fn gpu() -> Gpu {
            Gpu::new(0).expect("these tests run on a machine with a GPU (--ignored)")
        }

        fn data(n: usize, seed: u64, scale: f32) -> Vec<f32> {
            let mut r = SplitMix(seed);
            (0..n).map(|_| ((r.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale).collect()
        }

        fn bits(x: &[f32]) -> Vec<u32> {
            x.iter().map(|v| v.to_bits()).collect()
        }

        #[test]
        #[ignore = "needs a GPU"]
        fn two_bit_matches_the_cpu_bit_for_bit() {
            let d = gpu();
            let th = Thresholds::new(-0.3, 0.25).unwrap();
            for n in SIZES {
                let (g, r0) = (data(n, 1, 2.0), data(n, 2, 0.5));
                // in place
                let (mut r, mut c) = (r0.clone(), codec::create_2bit(n));
                codec::quantize_2bit(&g, &mut r, &mut c, th).unwrap();
                let (gd, mut rd, mut cd) = (d.upload(&g).unwrap(), d.upload(&r0).unwrap(), d.upload(&vec![7f32; c.len()]).unwrap());
                d.quantize_2bit(&gd, &mut rd, &mut cd, th).unwrap();
                assert_eq!(bits(&d.download(&cd).unwrap()), bits(&c), "compressed n={n}");
                assert_eq!(bits(&d.download(&rd).unwrap()), bits(&r), "residual n={n}");
                // one pass, out of place
                let (r0d, mut xd, mut c2) = (d.upload(&r0).unwrap(), d.zeros::<f32>(n).unwrap(), d.zeros::<f32>(c.len()).unwrap());
                d.quantize_2bit_to(&gd, &r0d, &mut xd, &mut c2, th).unwrap();
                assert_eq!(bits(&d.download(&c2).unwrap()), bits(&c), "quantize_to n={n}");
                assert_eq!(bits(&d.download(&xd).unwrap()), bits(&r), "quantize_to residual n={n}");
                // decode and decode-add
                let base = data(n, 3, 1.0);
                let (mut o, mut s) = (vec![0f32; n], base.clone());
                codec::dequantize_2bit(&c, &mut o).unwrap();
                codec::dequantize_2bit_add(&c, &mut s).unwrap();
                let (mut od, mut sd) = (d.zeros::<f32>(n).unwrap(), d.upload(&base).unwrap());
                d.dequantize_2bit(&cd, &mut od).unwrap();
                d.dequantize_2bit_add(&cd, &mut sd).unwrap();
                assert_eq!(bits(&d.download(&od).unwrap()), bits(&o), "dequantize n={n}");
                assert_eq!(bits(&d.download(&sd).unwrap()), bits(&s), "dequantize_add n={n}");
            }
        }

        #[test]
        #[ignore = "needs a GPU"]
        fn two_bit_takes_float16_and_bfloat16_gradients_as_the_cpu_does() {
            use half::{bf16, f16};
            let d = gpu();
            let th = Thresholds::new(-0.3, 0.25).unwrap();
            for n in SIZES {
                let (g, r0) = (data(n, 40, 2.0), data(n, 41, 0.5));
                let (h, b): (Vec<f16>, Vec<bf16>) = (g.iter().map(|&x| f16::from_f32(x)).collect(), g.iter().map(|&x| bf16::from_f32(x)).collect());
                let (mut rh, mut ch, mut rb, mut cb) = (r0.clone(), codec::create_2bit(n), r0.clone(), codec::create_2bit(n));
                codec::quantize_2bit(&h, &mut rh, &mut ch, th).unwrap();
                codec::quantize_2bit(&b, &mut rb, &mut cb, th).unwrap();
                let (mut rd, mut cd) = (d.upload(&r0).unwrap(), d.zeros::<f32>(ch.len()).unwrap());
                d.quantize_2bit(&d.upload(&h).unwrap(), &mut rd, &mut cd, th).unwrap();
                assert_eq!((bits(&d.download(&cd).unwrap()), bits(&d.download(&rd).unwrap())), (bits(&ch), bits(&rh)), "f16 n={n}");
                let (r0d, mut xd, mut cd) = (d.upload(&r0).unwrap(), d.zeros::<f32>(n).unwrap(), d.zeros::<f32>(cb.len()).unwrap());
                d.quantize_2bit_to(&d.upload(&b).unwrap(), &r0d, &mut xd, &mut cd, th).unwrap();
                assert_eq!((bits(&d.download(&cd).unwrap()), bits(&d.download(&xd).unwrap())), (bits(&cb), bits(&rb)), "bf16 n={n}");
            }
            // A float16 infinity is named as the CPU names it; nothing changes.
            let mut h: Vec<f16> = data(300, 42, 1.0).iter().map(|&x| f16::from_f32(x)).collect();
            h[123] = f16::INFINITY;
            let r0 = data(300, 43, 0.5);
            let cpu = codec::quantize_2bit(&h, &mut r0.clone(), &mut codec::create_2bit(300), th).unwrap_err().to_string();
            let (mut rd, mut cd) = (d.upload(&r0).unwrap(), d.zeros::<f32>(codec::compressed_len(300)).unwrap());
            assert_eq!(d.quantize_2bit(&d.upload(&h).unwrap(), &mut rd, &mut cd, th).unwrap_err().to_string(), cpu);
            assert_eq!(bits(&d.download(&rd).unwrap()), bits(&r0));
        }

        #[test]
        #[ignore = "needs a GPU"]
        fn two_bit_bad_input_gives_the_cpus_error_and_changes_nothing() {
            let d = gpu();
            let th = Thresholds::symmetric(0.5).unwrap();
            let n = 1000;
            let (mut g, r0) = (data(n, 4, 1.0), data(n, 5, 1.0));
            g[777] = f32::NAN;
            g[900] = f32::INFINITY;
            let cpu = codec::quantize_2bit(&g, &mut r0.clone(), &mut codec::create_2bit(n), th).unwrap_err().to_string();
            let (gd, mut rd, mut cd) = (d.upload(&g).unwrap(), d.upload(&r0).unwrap(), d.upload(&vec![9f32; codec::compressed_len(n)]).unwrap());
            assert_eq!(d.quantize_2bit(&gd, &mut rd, &mut cd, th).unwrap_err().to_string(), cpu);
            assert!(cpu.contains("element 777"), "{cpu}");
            assert_eq!(bits(&d.download(&rd).unwrap()), bits(&r0), "residual changed");
            assert!(d.download(&cd).unwrap().iter().all(|&v| v == 9.0), "compressed array changed");
            let (mut xd, mut c2) = (d.zeros::<f32>(n).unwrap(), d.zeros::<f32>(codec::compressed_len(n)).unwrap());
            assert_eq!(d.quantize_2bit_to(&gd, &rd, &mut xd, &mut c2, th).unwrap_err().to_string(), cpu);
            // corrupt codes, padding, header, lengths: the CPU's errors, output untouched
            let g = data(n, 6, 1.0);
            let mut c = codec::create_2bit(n);
            codec::quantize_2bit(&g, &mut vec![0.0; n], &mut c, th).unwrap();
            let mut cases = Vec::new();
            let mut code11 = c.clone();
            code11[3 + 20] = f32::from_bits(code11[3 + 20].to_bits() | (0b11 << 20));
            cases.push(code11);
            let mut pad = c.clone();
            let last = pad.len() - 1;
            pad[last] = f32::from_bits(pad[last].to_bits() | 1);
            cases.push(pad);
            let mut header = c.clone();
            header[2] = 999.0;
            cases.push(header);
            let mut thr = c.clone();
            thr[0] = 0.5;
            cases.push(thr);
            cases.push(c[..c.len() - 1].to_vec());
            for bad in cases {
                let cpu = codec::dequantize_2bit(&bad, &mut vec![0.0; n]).unwrap_err().to_string();
                let (bd, mut od) = (d.upload(&bad).unwrap(), d.upload(&vec![5f32; n]).unwrap());
                assert_eq!(d.dequantize_2bit_add(&bd, &mut od).unwrap_err().to_string(), cpu);
                assert!(d.download(&od).unwrap().iter().all(|&v| v == 5.0), "{cpu}: output changed");
            }
            let (gd, mut rd, mut cd) = (d.upload(&g).unwrap(), d.zeros::<f32>(n + 1).unwrap(), d.zeros::<f32>(codec::compressed_len(n)).unwrap());
            assert_eq!(d.quantize_2bit(&gd, &mut rd, &mut cd, th).unwrap_err().to_string(), "residual has 1001 elements, expected 1000");
        }

        #[test]
        #[ignore = "needs a GPU"]
        fn c_abi_checks_device_pointers_and_takes_unaligned_buffers() {
            use crate::capi::*;
            use cudarc::driver::DevicePtr;
            let d = gpu();
            let th = Thresholds::new(-0.4, 0.3).unwrap();
            for n in [1usize, 5, 1001, 4099] {
                // Buffers offset by one float: not 16-byte aligned, the kernels' scalar path.
                let (g, r0) = (data(n + 1, 30, 2.0), data(n + 1, 31, 0.5));
                let (mut r, mut c) = (r0[1..].to_vec(), codec::create_2bit(n));
                codec::quantize_2bit(&g[1..], &mut r, &mut c, th).unwrap();
                let (gd, rd, xd, cd, od) = (d.upload(&g).unwrap(), d.upload(&r0).unwrap(), d.zeros::<f32>(n + 1).unwrap(), d.zeros::<f32>(c.len() + 1).unwrap(), d.zeros::<f32>(n + 1).unwrap());
                d.synchronize().unwrap();
                let p = |s: &cudarc::driver::CudaSlice<f32>| (s.device_ptr(d.stream()).0 + 4) as *mut f32;
                let cl = c.len() as u64;
                // SAFETY: live allocations of n + 1 (or cl + 1) floats, used from element 1.
                unsafe {
                    assert_eq!(gp_cuda_2bit_quantize_to(0, std::ptr::null_mut(), p(&gd).cast(), 0, n as u64, p(&rd), p(&xd), p(&cd), cl, -0.4, 0.3), 0);
                    assert_eq!(gp_cuda_2bit_dequantize(0, std::ptr::null_mut(), p(&cd), cl, p(&od), n as u64, 0), 0);
                }
                assert_eq!(bits(&d.download(&cd).unwrap()[1..]), bits(&c), "unaligned quantize n={n}");
                assert_eq!(bits(&d.download(&xd).unwrap()[1..]), bits(&r), "unaligned residual n={n}");
                let mut o = vec![0f32; n];
                codec::dequantize_2bit(&c, &mut o).unwrap();
                assert_eq!(bits(&d.download(&od).unwrap()[1..]), bits(&o), "unaligned dequantize n={n}");
                // QSGD, max |g| and 1-bit on the same unaligned buffers.
                let scale = qsgd::max_abs(&g[1..]).unwrap();
                let mut want = vec![0i32; n];
                qsgd::quantize(&g[1..], scale, 3, 77, &mut want).unwrap();
                let (mut m, mut finite) = (0f32, 0);
                let codes = d.zeros::<i32>(n + 1).unwrap();
                let cp = (codes.device_ptr(d.stream()).0 + 4) as *mut i32;
                let (mut r1, mut b1) = (r0[1..].to_vec(), vec![0i32; n]);
                onebit::quantize::<false>(&g[1..], &mut r1, 0.05, &mut b1);
                let rd1 = d.upload(&r0).unwrap();
                d.synchronize().unwrap();
                // SAFETY: as above.
                unsafe {
                    assert_eq!(gp_cuda_max_abs(0, std::ptr::null_mut(), p(&gd), n as u64, &mut m, &mut finite), 0);
                    assert_eq!(gp_cuda_qsgd_quantize(0, std::ptr::null_mut(), p(&gd), n as u64, scale, 3, 77, 0, cp, 0), 0);
                }
                assert_eq!((m.to_bits(), finite), (scale.to_bits(), 1), "unaligned max n={n}");
                assert_eq!(&d.download(&codes).unwrap()[1..], want, "unaligned qsgd n={n}");
                // SAFETY: as above.
                unsafe { assert_eq!(gp_cuda_1bit_quantize(0, std::ptr::null_mut(), p(&gd), n as u64, p(&rd1), 0.05, cp, 0), 0) };
                assert_eq!(&d.download(&codes).unwrap()[1..], b1, "unaligned 1bit n={n}");
                assert_eq!(bits(&d.download(&rd1).unwrap()[1..]), bits(&r1), "unaligned 1bit residual n={n}");
                // SAFETY: as above; the calls must refuse before touching memory.
                unsafe {
                    // one element past the allocation
                    assert_eq!(gp_cuda_2bit_quantize(0, std::ptr::null_mut(), p(&gd).cast(), 0, n as u64 + 1, p(&rd), p(&cd), codec::compressed_len(n + 1) as u64, -0.4, 0.3), -1);
                    let e = std::ffi::CStr::from_ptr(gp_error_last()).to_str().unwrap().to_string();
                    assert!(e.contains("'grad'") && e.contains("run past the end of its allocation"), "{e}");
                    // a host pointer
                    let host = vec![0f32; n];
                    assert_eq!(gp_cuda_2bit_quantize(0, std::ptr::null_mut(), host.as_ptr().cast(), 0, n as u64, p(&rd), p(&cd), cl, -0.4, 0.3), -1);
                    let e = std::ffi::CStr::from_ptr(gp_error_last()).to_str().unwrap().to_string();
                    assert!(e.contains("'grad'") && e.contains("is not device memory"), "{e}");
                    // overlapping output and input
                    assert_eq!(gp_cuda_2bit_quantize_to(0, std::ptr::null_mut(), p(&gd).cast(), 0, n as u64, p(&rd), p(&rd), p(&cd), cl, -0.4, 0.3), -1);
                    let e = std::ffi::CStr::from_ptr(gp_error_last()).to_str().unwrap().to_string();
                    assert_eq!(e, "residual and next overlap in memory; they must be distinct buffers");
                    // a GPU that does not exist
                    assert_eq!(gp_cuda_available(99), -1);
                    let e = std::ffi::CStr::from_ptr(gp_error_last()).to_str().unwrap().to_string();
                    assert!(e.starts_with("CUDA not available: GPU 99 was asked for"), "{e}");
                    assert_eq!(gp_cuda_available(0), 0);
                }
                assert_eq!(bits(&d.download(&rd).unwrap()), bits(&r0), "refused calls changed the residual");
            }
        }

        #[test]
        #[ignore = "needs a GPU"]
        fn noise_matches_the_cpu_across_the_2_pow_32_boundary() {
            let d = gpu();
            for (offset, n) in [(0usize, 100_003usize), ((1usize << 32) - 37, 100)] {
                let mut out = d.zeros::<f32>(n).unwrap();
                d.noise(0xfeed, offset, &mut out).unwrap();
                let want: Vec<f32> = (0..n).map(|j| noise::uniform(0xfeed, (offset + j) as u64)).collect();
                assert_eq!(bits(&d.download(&out).unwrap()), bits(&want), "offset {offset}");
            }
        }

        #[test]
        #[ignore = "needs a GPU"]
        fn qsgd_max_norm_matches_the_cpu_bit_for_bit() {
            let d = gpu();
            for n in SIZES {
                let g = data(n, 7, 3.0);
                let gd = d.upload(&g).unwrap();
                let max = qsgd::max_abs(&g).unwrap();
                assert_eq!(d.max_abs(&gd).unwrap().map(f32::to_bits), Some(max.to_bits()), "max n={n}");
                for bits_ in [2u32, 8] {
                    let scale = max * 1.25;
                    let mut c = vec![0i32; n];
                    qsgd::quantize(&g, scale, bits_, 42, &mut c).unwrap();
                    let mut cd = d.upload(&vec![3i32; n]).unwrap();
                    d.qsgd_quantize(&gd, scale, bits_, 42, 0, &mut cd, false).unwrap();
                    assert_eq!(d.download(&cd).unwrap(), c, "codes n={n} bits={bits_}");
                    d.qsgd_quantize(&gd, scale, bits_, 42, 0, &mut cd, true).unwrap();
                    assert_eq!(d.download(&cd).unwrap(), c.iter().map(|x| 2 * x).collect::<Vec<_>>(), "added codes n={n}");
                    if n > 10 {
                        // a piece from element 10 on draws the same noise as the whole
                        let mut part = d.zeros::<i32>(n - 10).unwrap();
                        d.qsgd_quantize(&d.upload(&g[10..]).unwrap(), scale, bits_, 42, 10, &mut part, false).unwrap();
                        assert_eq!(d.download(&part).unwrap(), c[10..], "offset n={n}");
                    }
                    let s = qsgd::levels(bits_).unwrap();
                    let mut o = vec![0f32; n];
                    qsgd::decode_at(&c, scale, &[s], None, &mut o).unwrap();
                    let (cd, mut od) = (d.upload(&c).unwrap(), d.zeros::<f32>(n).unwrap());
                    d.qsgd_decode(&cd, scale, bits_, &mut od).unwrap();
                    assert_eq!(bits(&d.download(&od).unwrap()), bits(&o), "decode n={n}");
                }
            }
            let mut g = data(100, 8, 1.0);
            g[37] = f32::NEG_INFINITY;
            let cpu = qsgd::quantize(&g, 5.0, 2, 1, &mut [0; 100]).unwrap_err().to_string();
            let mut cd = d.zeros::<i32>(100).unwrap();
            assert_eq!(d.qsgd_quantize(&d.upload(&g).unwrap(), 5.0, 2, 1, 0, &mut cd, false).unwrap_err().to_string(), cpu);
            assert_eq!(d.max_abs(&d.upload(&g).unwrap()).unwrap(), None);
            let g = data(100, 9, 1.0);
            let cpu = qsgd::quantize(&g, 0.1, 2, 1, &mut [0; 100]).unwrap_err().to_string();
            assert_eq!(d.qsgd_quantize(&d.upload(&g).unwrap(), 0.1, 2, 1, 0, &mut cd, false).unwrap_err().to_string(), cpu);
        }

        #[test]
        #[ignore = "needs a GPU"]
        fn one_bit_matches_the_cpu_bit_for_bit() {
            let d = gpu();
            for n in SIZES {
                let (g, r0) = (data(n, 10, 2.0), data(n, 11, 1.0));
                let (mut r, mut b) = (r0.clone(), vec![0i32; n]);
                onebit::quantize::<false>(&g, &mut r, 0.1, &mut b);
                let (gd, mut rd, mut bd) = (d.upload(&g).unwrap(), d.upload(&r0).unwrap(), d.zeros::<i32>(n).unwrap());
                d.onebit_quantize(&gd, &mut rd, 0.1, &mut bd, false).unwrap();
                assert_eq!(d.download(&bd).unwrap(), b, "bits n={n}");
                assert_eq!(bits(&d.download(&rd).unwrap()), bits(&r), "residual n={n}");
                let mut od = d.zeros::<f32>(n).unwrap();
                d.onebit_decode(&bd, 3, &mut od).unwrap();
                assert_eq!(d.download(&od).unwrap(), b.iter().map(|&c| (2 * c - 3) as f32).collect::<Vec<_>>(), "decode n={n}");
            }
            let (mut g, r0) = (data(50, 12, 1.0), data(50, 13, 1.0));
            g[3] = f32::NAN;
            let (gd, mut rd, mut bd) = (d.upload(&g).unwrap(), d.upload(&r0).unwrap(), d.zeros::<i32>(50).unwrap());
            let e = d.onebit_quantize(&gd, &mut rd, 0.0, &mut bd, false).unwrap_err().to_string();
            assert!(e.contains("element 3"), "{e}");
            assert_eq!(bits(&d.download(&rd).unwrap()), bits(&r0), "residual changed");
        }

        #[test]
        #[ignore = "needs a GPU"]
        fn random_k_gather_and_scatter_use_the_cpus_selection() {
            let d = gpu();
            for n in [33usize, 4097, (1 << 20) + 3] {
                let k = (n / 16).to_string();
                let q = match crate::quant::compression::Compression::from_params([("compress", "grandk_mn"), ("bits", "2"), ("seed", "5"), ("k", k.as_str())]).unwrap() {
                    crate::quant::compression::Compression::Qsgd(q) => q,
                    other => panic!("{other:?}"),
                };
                let idx: Vec<u64> = scheme::selection(&q, n, 3, 99).expect("k < n").iter().map(|&i| i as u64).collect();
                let x = data(n, 14, 1.0);
                let (xd, id, mut gd) = (d.upload(&x).unwrap(), d.upload(&idx).unwrap(), d.zeros::<f32>(idx.len()).unwrap());
                d.gather(&xd, &id, &mut gd).unwrap();
                let want: Vec<f32> = idx.iter().map(|&i| x[i as usize]).collect();
                assert_eq!(bits(&d.download(&gd).unwrap()), bits(&want), "gather n={n}");
                let mut od = d.upload(&vec![1f32; n]).unwrap();
                d.scatter(&gd, &id, &mut od).unwrap();
                let mut back = vec![0f32; n];
                idx.iter().zip(&want).for_each(|(&i, &v)| back[i as usize] = v);
                assert_eq!(bits(&d.download(&od).unwrap()), bits(&back), "scatter n={n}");
            }
            let (xd, id, mut gd) = (d.upload(&[1f32; 10]).unwrap(), d.upload(&[3u64, 10]).unwrap(), d.upload(&[7f32; 2]).unwrap());
            assert_eq!(d.gather(&xd, &id, &mut gd).unwrap_err().to_string(), "invalid parameter 'indices': index 1 is out of range for 10 elements");
            assert_eq!(d.download(&gd).unwrap(), [7.0, 7.0]);
        }

        #[test]
        #[ignore = "needs a GPU"]
        fn compressed_reduce_over_two_streams_matches_the_cpu_store() {
            let d0 = gpu();
            let d1 = d0.fork().unwrap();
            let th = Thresholds::new(-0.2, 0.3).unwrap();
            for n in [1usize, 17, 4097, (1 << 20) + 3] {
                let (g0, g1, r0, r1) = (data(n, 20, 2.0), data(n, 21, 2.0), data(n, 22, 0.5), data(n, 23, 0.5));
                let (mut x0, mut x1, mut c0, mut c1, mut sum) = (vec![0f32; n], vec![0f32; n], codec::create_2bit(n), codec::create_2bit(n), vec![0f32; n]);
                codec::quantize_2bit_reduce(&[Grad::F32(&g0), Grad::F32(&g1)], &[&r0, &r1], &mut [&mut x0, &mut x1], &mut [&mut c0, &mut c1], &mut sum, th).unwrap();
                let (gd0, gd1) = (d0.upload(&g0).unwrap(), d1.upload(&g1).unwrap());
                let (mut rd0, mut rd1, mut sd) = (d0.upload(&r0).unwrap(), d1.upload(&r1).unwrap(), d0.zeros::<f32>(n).unwrap());
                reduce_2bit(&mut [Member { gpu: &d0, grad: &gd0, residual: &mut rd0 }, Member { gpu: &d1, grad: &gd1, residual: &mut rd1 }], &d0, &mut sd, th).unwrap();
                assert_eq!(bits(&d0.download(&sd).unwrap()), bits(&sum), "sum n={n}");
                assert_eq!(bits(&d0.download(&rd0).unwrap()), bits(&x0), "residual 0 n={n}");
                assert_eq!(bits(&d1.download(&rd1).unwrap()), bits(&x1), "residual 1 n={n}");
            }
            // A bad member fails the whole reduce with the CPU's error; no residual moves.
            let n = 100;
            let (g0, mut g1, r0, r1) = (data(n, 24, 1.0), data(n, 25, 1.0), data(n, 26, 1.0), data(n, 27, 1.0));
            g1[61] = f32::INFINITY;
            let (mut x0, mut x1, mut c0, mut c1, mut sum) = (vec![0f32; n], vec![0f32; n], codec::create_2bit(n), codec::create_2bit(n), vec![0f32; n]);
            let cpu = codec::quantize_2bit_reduce(&[Grad::F32(&g0), Grad::F32(&g1)], &[&r0, &r1], &mut [&mut x0, &mut x1], &mut [&mut c0, &mut c1], &mut sum, th).unwrap_err().to_string();
            let (gd0, gd1) = (d0.upload(&g0).unwrap(), d1.upload(&g1).unwrap());
            let (mut rd0, mut rd1, mut sd) = (d0.upload(&r0).unwrap(), d1.upload(&r1).unwrap(), d0.zeros::<f32>(n).unwrap());
            let e = reduce_2bit(&mut [Member { gpu: &d0, grad: &gd0, residual: &mut rd0 }, Member { gpu: &d1, grad: &gd1, residual: &mut rd1 }], &d0, &mut sd, th).unwrap_err().to_string();
            assert_eq!(e, cpu);
            assert!(e.contains("pushed value 1") && e.contains("element 61"), "{e}");
            assert_eq!((bits(&d0.download(&rd0).unwrap()), bits(&d1.download(&rd1).unwrap())), (bits(&r0), bits(&r1)));
        }
    }
}
