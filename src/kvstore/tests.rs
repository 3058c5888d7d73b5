//! KVStore semantics with exact values: MXNet's own compression test cases at
//! the proposal's thresholds, updaters, bad input leaving state untouched.

use super::*;
use half::{bf16, f16};
use crate::codec::Thresholds;

const SHAPE: &[usize] = &[4, 4];
const N: usize = 16;

fn f32s<'a>(v: &'a [f32]) -> Array<'a> {
    Array { shape: SHAPE, data: Grad::F32(v) }
}

fn two_bit(neg: f32, pos: f32) -> Compression {
    Compression::TwoBit(Thresholds::new(neg, pos).unwrap())
}

fn push_all(kv: &KVStore, key: &Key, value: f32, devices: usize) {
    let v = vec![value; N];
    let arrays: Vec<Array> = (0..devices).map(|_| f32s(&v)).collect();
    kv.push(key, &arrays).unwrap();
}

fn pulled(kv: &KVStore, key: &Key) -> Vec<f32> {
    let mut out = vec![f32::NAN; N];
    kv.pull(key, &mut [ArrayMut { shape: SHAPE, data: &mut out }]).unwrap();
    out
}

#[test]
fn push_sums_devices_and_pull_copies_to_every_output() {
    let kv = KVStore::new("local").unwrap();
    let k = Key::Int(3);
    kv.init(&k, f32s(&[1.0; N])).unwrap();
    let vals: Vec<Vec<f32>> = (0..4).map(|d| (0..N).map(|i| (d * 100 + i) as f32).collect()).collect();
    kv.push(&k, &vals.iter().map(|v| f32s(v)).collect::<Vec<_>>()).unwrap();
    let (mut a, mut b) = (vec![0f32; N], vec![0f32; N]);
    kv.pull(&k, &mut [ArrayMut { shape: SHAPE, data: &mut a }, ArrayMut { shape: SHAPE, data: &mut b }]).unwrap();
    let want: Vec<f32> = (0..N).map(|i| (600 + 4 * i) as f32).collect();
    assert_eq!(a, want);
    assert_eq!(b, want);
}

#[test]
fn custom_updater_runs_once_per_push() {
    let kv = KVStore::new("device").unwrap();
    let k = Key::from("w");
    kv.init(&k, f32s(&[0.0; N])).unwrap();
    kv.set_updater(Updater::Custom(Box::new(|_, merged, stored| {
        for (s, m) in stored.iter_mut().zip(merged) {
            *s += 2.0 * m;
        }
        Ok(())
    })));
    for _ in 0..4 {
        push_all(&kv, &k, 1.0, 4);
    }
    assert_eq!(pulled(&kv, &k), vec![32.0; N]);
}

#[test]
fn two_bit_device_store_follows_mxnet_test_cases() {
    // MXNet's test_kvstore compression cases with the proposal's thresholds.
    let kv = KVStore::new("device").unwrap();
    kv.set_compress(two_bit(-0.5, 0.5)).unwrap();
    let k = Key::Int(9);
    kv.init(&k, f32s(&[0.7; N])).unwrap();
    assert_eq!(pulled(&kv, &k), vec![0.7; N], "init is lossless");
    let d = 4;
    push_all(&kv, &k, 0.0, d);
    assert_eq!(pulled(&kv, &k), vec![0.0; N]);
    push_all(&kv, &k, 0.4, d);
    assert_eq!(pulled(&kv, &k), vec![0.0; N]);
    push_all(&kv, &k, 0.2, d); // residual 0.6 -> sends 0.5, keeps 0.1
    assert_eq!(pulled(&kv, &k), vec![0.5 * d as f32; N]);
    assert!(kv.residual(&k, 3).unwrap().iter().all(|&r| (r - 0.1).abs() < 1e-6));
    push_all(&kv, &k, 0.2, d); // 0.3
    assert_eq!(pulled(&kv, &k), vec![0.0; N]);
    push_all(&kv, &k, 0.2, d); // 0.5 -> sends 0.5
    assert_eq!(pulled(&kv, &k), vec![0.5 * d as f32; N]);
}

#[test]
fn two_bit_with_updater_accumulates_and_negative_pushes_lower() {
    let kv = KVStore::new("device").unwrap();
    kv.set_compress(two_bit(-0.5, 0.5)).unwrap();
    kv.set_updater(Updater::Custom(Box::new(|_, merged, stored| {
        stored.iter_mut().zip(merged).for_each(|(s, m)| *s += 2.0 * m);
        Ok(())
    })));
    let k = Key::Int(0);
    kv.init(&k, f32s(&[1.0; N])).unwrap();
    push_all(&kv, &k, 0.4, 4);
    assert_eq!(pulled(&kv, &k), vec![1.0; N]);
    push_all(&kv, &k, 0.2, 4);
    assert_eq!(pulled(&kv, &k), vec![1.0 + 2.0 * 2.0; N]);
    // A fresh key (zero residuals): each device sends -0.5 every time, merged
    // is -2, and the updater lowers the stored value by 4 per push.
    let k = Key::Int(1);
    kv.init(&k, f32s(&[10.0; N])).unwrap();
    for i in 1..=3 {
        push_all(&kv, &k, -0.5, 4);
        assert_eq!(pulled(&kv, &k), vec![10.0 - 4.0 * i as f32; N]);
    }
}

#[test]
fn asymmetric_thresholds() {
    let kv = KVStore::new("device").unwrap();
    kv.set_compress(two_bit(-0.25, 1.0)).unwrap();
    let k = Key::Int(1);
    kv.init(&k, f32s(&[0.0; N])).unwrap();
    push_all(&kv, &k, -0.3, 2);
    assert_eq!(pulled(&kv, &k), vec![-0.5; N]);
    push_all(&kv, &k, 0.9, 2); // residual -0.05 + 0.9 = 0.85 < 1
    assert_eq!(pulled(&kv, &k), vec![0.0; N]);
    push_all(&kv, &k, 0.2, 2); // 1.05 -> 1.0 each
    assert_eq!(pulled(&kv, &k), vec![2.0; N]);
}

#[test]
fn local_store_refuses_compression_pointing_to_device() {
    let kv = KVStore::new("local").unwrap();
    let err = kv.set_compress(two_bit(-0.5, 0.5)).unwrap_err().to_string();
    assert!(err.contains("'device'"), "{err}");
    assert_eq!(kv.compression(), Compression::None);
    kv.set_compress(Compression::None).unwrap();
}

#[test]
fn bad_input_names_key_and_leaves_state() {
    let kv = KVStore::new("device").unwrap();
    kv.set_compress(two_bit(-0.5, 0.5)).unwrap();
    let k = Key::Int(5);
    let mut out = vec![0f32; N];
    let err = kv.push(&k, &[f32s(&[1.0; N])]).unwrap_err().to_string();
    assert_eq!(err, "key 5: not initialized (call init first)");
    assert!(kv.pull(&k, &mut [ArrayMut { shape: SHAPE, data: &mut out }]).is_err());
    kv.init(&k, f32s(&[1.0; N])).unwrap();
    push_all(&kv, &k, 0.3, 2);
    let (value, residual) = (kv.value(&k).unwrap(), kv.residual(&k, 0).unwrap());
    let cases: Vec<(Vec<Array>, &str)> = vec![
        (vec![f32s(&[1.0; N]), Array { shape: &[16], data: Grad::F32(&[1.0; N]) }], "pushed value 1 has shape [16], expected [4, 4]"),
        (vec![Array { shape: SHAPE, data: Grad::F32(&[1.0; 15]) }], "pushed value 0 has shape [4, 4] but 15 elements"),
        (vec![], "empty list"),
    ];
    for (values, want) in cases {
        let err = kv.push(&k, &values).unwrap_err().to_string();
        assert!(err.starts_with("key 5: ") && err.contains(want), "{err}");
    }
    assert!(kv.init(&k, f32s(&[0.0; N])).unwrap_err().to_string().contains("already initialized"));
    assert!(kv.init(&Key::from("x"), f32s(&[0.0; N])).unwrap_err().to_string().contains("cannot be mixed"));
    let mut short = vec![0f32; 8];
    let err = kv.pull(&k, &mut [ArrayMut { shape: SHAPE, data: &mut out }, ArrayMut { shape: &[8], data: &mut short }]).unwrap_err().to_string();
    assert!(err.contains("pull output 1 has shape [8], expected [4, 4]"), "{err}");
    assert_eq!(out, vec![0.0; N], "no output written when one is wrong");
    assert_eq!(kv.value(&k).unwrap(), value);
    assert_eq!(kv.residual(&k, 0).unwrap(), residual);
}

#[test]
fn half_precision_gradients_need_compression() {
    let kv = KVStore::new("device").unwrap();
    let k = Key::Int(0);
    kv.init(&k, f32s(&[0.0; N])).unwrap();
    let g16 = vec![f16::from_f32(0.75); N];
    let err = kv.push(&k, &[Array { shape: SHAPE, data: Grad::F16(&g16) }]).unwrap_err().to_string();
    assert!(err.contains("float16; without compression values must be float32"), "{err}");
    kv.set_compress(two_bit(-0.5, 0.5)).unwrap();
    let gbf = vec![bf16::from_f32(0.75); N];
    kv.push(&k, &[Array { shape: SHAPE, data: Grad::F16(&g16) }, Array { shape: SHAPE, data: Grad::Bf16(&gbf) }]).unwrap();
    assert_eq!(pulled(&kv, &k), vec![1.0; N]);
}

#[test]
fn pushes_of_different_keys_run_concurrently() {
    // A slow updater on one key must not block pushes of another.
    use std::sync::mpsc;
    let kv = Arc::new(KVStore::new("device").unwrap());
    let (slow, fast) = (Key::Int(1), Key::Int(2));
    kv.init(&slow, f32s(&[0.0; N])).unwrap();
    kv.init(&fast, f32s(&[0.0; N])).unwrap();
    let (entered_tx, entered_rx) = mpsc::channel::<()>();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let release_rx = Mutex::new(release_rx);
    let entered_tx = Mutex::new(entered_tx);
    kv.set_updater(Updater::Custom(Box::new(move |key, merged, stored| {
        if *key == Key::Int(1) {
            entered_tx.lock().unwrap().send(()).unwrap();
            release_rx.lock().unwrap().recv().unwrap();
        }
        stored.copy_from_slice(merged);
        Ok(())
    })));
    let kv2 = kv.clone();
    let t = std::thread::spawn(move || push_all(&kv2, &Key::Int(1), 1.0, 1));
    entered_rx.recv().unwrap(); // the slow push holds key 1 now
    push_all(&kv, &fast, 2.0, 2); // would deadlock if keys were serialized
    assert_eq!(pulled(&kv, &fast), vec![4.0; N]);
    release_tx.send(()).unwrap();
    t.join().unwrap();
    assert_eq!(pulled(&kv, &slow), vec![1.0; N]);
}

#[test]
fn large_keys_reduce_exactly() {
    let n = 3 * CHUNK + 7;
    let shape = [n];
    let kv = KVStore::new("device").unwrap();
    let k = Key::Int(0);
    kv.init(&k, Array { shape: &shape, data: Grad::F32(&vec![0.0; n]) }).unwrap();
    let vals: Vec<Vec<f32>> = (0..3).map(|d| (0..n).map(|i| ((i * 7 + d * 13) % 101) as f32 * 0.01).collect()).collect();
    kv.push(&k, &vals.iter().map(|v| Array { shape: &shape, data: Grad::F32(v) }).collect::<Vec<_>>()).unwrap();
    let got = kv.value(&k).unwrap();
    for i in (0..n).step_by(997) {
        assert_eq!(got[i], vals[0][i] + vals[1][i] + vals[2][i]);
    }
}

fn qsgd(bits: u32, seed: u64) -> Compression {
    Compression::Qsgd(crate::compression::Qsgd::new("qsgd_mn", &[bits], seed, None, false).unwrap())
}

#[test]
fn qsgd_device_store_sums_integer_codes_with_one_scale() {
    let kv = KVStore::new("device").unwrap();
    kv.set_compress(qsgd(3, 5)).unwrap();
    let k = Key::Str("w".into());
    kv.init(&k, f32s(&[0.0; N])).unwrap();
    let a: Vec<f32> = (0..N).map(|i| (i as f32 - 8.0) * 0.1).collect();
    let b: Vec<f32> = (0..N).map(|i| (i as f32 * 0.37).sin()).collect();
    for step in 0..3u64 {
        kv.push(&k, &[f32s(&a), f32s(&b)]).unwrap();
        // the same computation by hand
        let scale = a.iter().chain(&b).fold(0f32, |m, x| m.max(x.abs()));
        let mut acc = vec![0i32; N];
        for (d, g) in [&a, &b].iter().enumerate() {
            let mut codes = vec![0i32; N];
            crate::quant::qsgd::quantize(g, scale, 3, crate::quant::qsgd::stream_seed(5, step, k.stable_hash(), d as u64), &mut codes).unwrap();
            crate::quant::qsgd::accumulate(&codes, &mut acc).unwrap();
        }
        let mut want = vec![0f32; N];
        crate::quant::qsgd::decode(&acc, scale, 3, &mut want).unwrap();
        assert_eq!(pulled(&kv, &k), want, "step {step}");
    }
    let err = kv.push(&k, &[f32s(&[f32::NAN; N])]).unwrap_err().to_string();
    assert!(err.contains("pushed value 0 holds NaN"), "{err}");
    assert!(KVStore::new("local").unwrap().set_compress(qsgd(3, 0)).is_err());
}

#[test]
fn one_bit_device_store_sums_plus_minus_one_with_per_device_residuals() {
    let kv = KVStore::new("device").unwrap();
    kv.set_compress(Compression::OneBit { threshold: 0.0 }).unwrap();
    let k = Key::Int(2);
    kv.init(&k, f32s(&[0.0; N])).unwrap();
    push_all(&kv, &k, 0.5, 3); // r = 0.5 > 0 on each device: +1 each, r = -0.5
    assert_eq!(pulled(&kv, &k), vec![3.0; N]);
    push_all(&kv, &k, 0.25, 3); // r = -0.25: -1 each, r = 0.75
    assert_eq!(pulled(&kv, &k), vec![-3.0; N]);
    assert_eq!(kv.residual(&k, 2).unwrap(), vec![0.75; N]);
}

#[test]
fn shapes_whose_product_overflows_are_errors_not_wrapped() {
    // [2^32, 2^32] wraps to 0 elements in unchecked arithmetic; it must be refused.
    let huge: &[usize] = &[1 << 32, 1 << 32];
    assert!(elements(huge).unwrap_err().to_string().contains("more elements than memory can hold"));
    assert!(elements(&[usize::MAX / 2, 1]).is_err(), "more float32 bytes than a slice may span");
    assert_eq!(elements(&[3, 0, 5]).unwrap(), 0);
    assert_eq!(elements(&[]).unwrap(), 1);
    for store in ["local", "device"] {
        let kv = KVStore::new(store).unwrap();
        let err = kv.init(&Key::Int(0), Array { shape: huge, data: Grad::F32(&[]) }).unwrap_err().to_string();
        assert!(err.contains("more elements than memory can hold"), "{store}: {err}");
        kv.init(&Key::Int(1), f32s(&[1.0; N])).unwrap();
        let err = kv.push(&Key::Int(1), &[Array { shape: huge, data: Grad::F32(&[]) }]).unwrap_err().to_string();
        assert!(err.contains("more elements than memory can hold"), "{store}: {err}");
        assert_eq!(pulled(&kv, &Key::Int(1)), vec![1.0; N]);
        assert!(kv.value(&Key::Int(0)).is_err(), "{store}: the huge init left no key");
    }
}

#[test]
fn keys_holding_nul_are_refused_not_cut() {
    for store in ["local", "device"] {
        let kv = KVStore::new(store).unwrap();
        let w = Key::Str("w".into());
        kv.init(&w, f32s(&[1.0; N])).unwrap();
        let evil = Key::Str("w\0evil".into());
        let err = kv.init(&evil, f32s(&[9.0; N])).unwrap_err().to_string();
        assert!(err.contains("cannot contain NUL") && err.contains("byte 1"), "{store}: {err}");
        assert!(kv.push(&evil, &[f32s(&[9.0; N])]).unwrap_err().to_string().contains("not initialized"));
        assert_eq!(pulled(&kv, &w), vec![1.0; N]);
    }
}

#[test]
fn non_finite_pushes_under_2bit_change_nothing() {
    // f32, f16 and bf16 gradients; NaN, ±inf, and a residual that would overflow.
    let kv = KVStore::new("device").unwrap();
    kv.set_compress(two_bit(-0.5, 0.5)).unwrap();
    let k = Key::Int(4);
    kv.init(&k, f32s(&[0.0; N])).unwrap();
    push_all(&kv, &k, 0.3, 2); // residual 0.3 on both devices
    let before = (kv.value(&k).unwrap(), kv.residual(&k, 0).unwrap(), kv.residual(&k, 1).unwrap());
    let mut bad = vec![0.3f32; N];
    bad[9] = f32::NAN;
    let good = vec![0.3f32; N];
    let err = kv.push(&k, &[f32s(&good), f32s(&bad)]).unwrap_err().to_string();
    assert!(err.contains("key 4") && err.contains("pushed value 1") && err.contains("at element 9"), "{err}");
    let half: Vec<f16> = bad.iter().map(|&x| f16::from_f32(if x.is_nan() { f32::INFINITY } else { x })).collect();
    let err = kv.push(&k, &[Array { shape: SHAPE, data: Grad::F16(&half) }, f32s(&good)]).unwrap_err().to_string();
    assert!(err.contains("pushed value 0") && err.contains("at element 9") && err.contains("inf"), "{err}");
    let brain: Vec<bf16> = bad.iter().map(|&x| bf16::from_f32(if x.is_nan() { f32::NEG_INFINITY } else { x })).collect();
    assert!(kv.push(&k, &[f32s(&good), Array { shape: SHAPE, data: Grad::Bf16(&brain) }]).unwrap_err().to_string().contains("-inf"));
    assert_eq!((kv.value(&k).unwrap(), kv.residual(&k, 0).unwrap(), kv.residual(&k, 1).unwrap()), before);
    // The next push goes on from the kept residuals: 0.3 + 0.3 -> 0.5 per device.
    push_all(&kv, &k, 0.3, 2);
    assert_eq!(pulled(&kv, &k), vec![1.0; N]);

    // 3e38 twice overflows the residual: refused, and the residual stays finite.
    let big = KVStore::new("device").unwrap();
    big.set_compress(two_bit(-0.5, 0.5)).unwrap();
    big.init(&k, f32s(&[0.0; N])).unwrap();
    push_all(&big, &k, 3e38, 1);
    let residual = big.residual(&k, 0).unwrap();
    assert!(big.push(&k, &[f32s(&[3e38; N])]).unwrap_err().to_string().contains("at element 0"));
    assert_eq!(big.residual(&k, 0).unwrap(), residual);
}
