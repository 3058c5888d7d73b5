//! KVStore semantics with exact values: MXNet's own compression test cases at
//! the proposal's thresholds, updaters, bad input leaving state untouched.

use super::*;
use half::{bf16, f16};
use crate::codec::Thresholds;
use crate::store::elements;

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
    assert!(err.contains("float16; without compression values must have the key's dtype, float32"), "{err}");
    let kv = KVStore::new("device").unwrap();
    kv.set_compress(two_bit(-0.5, 0.5)).unwrap();
    kv.init(&k, f32s(&[0.0; N])).unwrap();
    let gbf = vec![bf16::from_f32(0.75); N];
    kv.push(&k, &[Array { shape: SHAPE, data: Grad::F16(&g16) }, Array { shape: SHAPE, data: Grad::Bf16(&gbf) }]).unwrap();
    assert_eq!(pulled(&kv, &k), vec![1.0; N]);
}

/// float16 values, as MXNet keeps them: sums round after each add, an update
/// rounds the value, and multi_precision keeps a float32 master copy that
/// pulls see rounded.
#[test]
fn float16_keys_keep_mxnets_float16_semantics() {
    let h = |x: f32| vec![f16::from_f32(x); N];
    fn f16s(v: &[f16]) -> Array<'_> {
        Array { shape: SHAPE, data: Grad::F16(v) }
    }
    let kv = KVStore::new("device").unwrap();
    let k = Key::Int(0);
    kv.init(&k, f16s(&h(1.0))).unwrap();
    // 2048 + 1 + 1: a device store rounds each partial sum to float16
    // (2049 -> 2048), so 2048; a local store sums in float32 and rounds once,
    // so 2050. Both as MXNet 1.9.1's stores of those names.
    let (a, b) = (h(2048.0), h(1.0));
    kv.push(&k, &[f16s(&a), f16s(&b), f16s(&b)]).unwrap();
    assert_eq!(pulled(&kv, &k), vec![2048.0; N]);
    let local = KVStore::new("local").unwrap();
    local.init(&k, f16s(&h(1.0))).unwrap();
    local.push(&k, &[f16s(&a), f16s(&b), f16s(&b)]).unwrap();
    assert_eq!(pulled(&local, &k), vec![2050.0; N]);
    // A float32 push to a float16 key is refused, as is bfloat16.
    let err = kv.push(&k, &[f32s(&[1.0; N])]).unwrap_err().to_string();
    assert!(err.contains("has dtype float32; without compression values must have the key's dtype, float16"), "{err}");

    // SGD, lr 1, gradient 1e-4 ten times from 1.0: in float16 each step rounds
    // back to 1.0; with multi_precision the float32 master moves and pulls round it.
    for (mp, want) in [("false", 1.0f32), ("true", f16::from_f32(1.0 - 10.0 * 1e-4f32).to_f32())] {
        let kv = KVStore::new("device").unwrap();
        kv.set_updater(Updater::Optimizer(Optimizer::from_params("sgd", [("learning_rate", "1"), ("multi_precision", mp)]).unwrap()));
        kv.init(&k, f16s(&h(1.0))).unwrap();
        let g = h(1e-4);
        for _ in 0..10 {
            kv.push(&k, &[f16s(&g)]).unwrap();
        }
        let got = pulled(&kv, &k);
        assert!((got[0] - want).abs() < 1e-3 && f16::from_f32(got[0]).to_f32() == got[0], "multi_precision={mp}: {got:?}");
        assert_eq!(got[0], want, "multi_precision={mp}");
        let master = kv.value(&k).unwrap()[0];
        assert_eq!(master == got[0], mp == "false", "multi_precision={mp}: master {master}");
    }
    // bfloat16 values are refused (MXNet has no bfloat16 stores).
    let bf = vec![bf16::from_f32(1.0); N];
    let err = kv.init(&Key::Int(9), Array { shape: SHAPE, data: Grad::Bf16(&bf) }).unwrap_err().to_string();
    assert!(err.contains("init value has dtype bfloat16, expected float32 or float16"), "{err}");
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
    let n = 3 * crate::par::CHUNK + 7;
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
    Compression::Qsgd(crate::quant::compression::Qsgd::new("qsgd_mn", &[bits], seed, None, false).unwrap())
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
            crate::quant::collective::add_codes(&mut acc, &codes).unwrap();
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

#[test]
fn compression_is_set_before_init_on_every_store() {
    for kind in ["local", "device"] {
        let kv = KVStore::new(kind).unwrap();
        kv.init(&Key::Int(0), f32s(&[0.0; N])).unwrap();
        let c = if kind == "local" { Compression::None } else { two_bit(-0.5, 0.5) };
        let err = kv.set_compress(c).unwrap_err().to_string();
        assert_eq!(err, "set the gradient compression before initializing any key (1 already initialized)");
        assert_eq!(kv.compression(), Compression::None);
    }
}

#[test]
fn residual_of_a_device_that_never_pushed_is_an_error() {
    let kv = KVStore::new("device").unwrap();
    kv.set_compress(two_bit(-0.5, 0.5)).unwrap();
    let k = Key::from("w");
    kv.init(&k, f32s(&[0.0; N])).unwrap();
    let err = kv.residual(&k, 0).unwrap_err().to_string();
    assert_eq!(err, "key 'w': has no residual on device 0: it has not been pushed with compression");
    push_all(&kv, &k, 0.3, 1);
    assert_eq!(kv.residual(&k, 0).unwrap(), vec![0.3; N]);
    let err = kv.residual(&k, 5).unwrap_err().to_string();
    assert_eq!(err, "key 'w': has no residual on device 5: 1 device(s) pushed it with compression (devices 0 to 0)");
    assert!(kv.residual(&Key::from("v"), 0).unwrap_err().to_string().contains("not initialized"));
}

/// A store with an updater that fails on its `fail_on`-th call (counting from
/// 1), and the same store that never saw that push: after the failure both
/// must hold the same value and residuals, and go on identically.
#[test]
fn a_failing_updater_leaves_value_and_residuals_as_they_were() {
    use std::sync::atomic::AtomicUsize;
    for compression in [two_bit(-0.5, 0.5), Compression::from_params([("compress", "1bit")]).unwrap()] {
        for panics in [false, true] {
            let kv = KVStore::new("device").unwrap();
            kv.set_compress(compression).unwrap();
            let k = Key::Int(7);
            kv.init(&k, f32s(&[0.0; N])).unwrap();
            let calls = Arc::new(AtomicUsize::new(0));
            let seen = calls.clone();
            kv.set_updater(Updater::Custom(Box::new(move |_, merged, stored| {
                stored[0] = 99.0; // half-way through the update ...
                if seen.fetch_add(1, Ordering::SeqCst) == 1 {
                    if panics {
                        panic!("updater bug");
                    }
                    return Err(Error::Store("no".into())); // ... it fails
                }
                stored.iter_mut().zip(merged).for_each(|(s, m)| *s += m);
                stored[0] = 99.0;
                Ok(())
            })));
            let grads: Vec<Vec<f32>> = (0..3).map(|d| (0..N).map(|i| 0.1 * (i as f32 - 7.0) + 0.05 * d as f32).collect()).collect();
            let push = |kv: &KVStore| kv.push(&k, &grads.iter().map(|g| f32s(g)).collect::<Vec<_>>());
            push(&kv).unwrap();
            let state = |kv: &KVStore| (kv.value(&k).unwrap(), (0..3).map(|d| kv.residual(&k, d).unwrap()).collect::<Vec<_>>());
            let before = state(&kv);
            let err = push(&kv).unwrap_err().to_string();
            let want = if panics { "updater failed for key 7: internal error (a bug in gradpack): updater bug" } else { "updater failed for key 7: no" };
            assert_eq!(err, want);
            assert_eq!(state(&kv), before, "{}", compression.name());
            push(&kv).unwrap(); // the third call: as the second push of a store that never failed
            let twin = KVStore::new("device").unwrap();
            twin.set_compress(compression).unwrap();
            twin.init(&k, f32s(&[0.0; N])).unwrap();
            twin.set_updater(Updater::Custom(Box::new(|_, merged, stored| {
                stored.iter_mut().zip(merged).for_each(|(s, m)| *s += m);
                stored[0] = 99.0;
                Ok(())
            })));
            push(&twin).unwrap();
            push(&twin).unwrap();
            assert_eq!(state(&kv), state(&twin), "{}", compression.name());
        }
    }
}

#[test]
fn optimizer_parameters_out_of_range_are_errors() {
    let kv = KVStore::new("device").unwrap();
    let k = Key::Int(0);
    kv.init(&k, f32s(&[1.0; N])).unwrap();
    let bad = |name: &str, p: &[(&str, &str)]| Optimizer::from_params(name, p.iter().copied()).unwrap_err().to_string();
    assert_eq!(bad("sgd", &[("momentum", "-1")]), "invalid parameter 'momentum': must be 0 or more, got -1");
    assert_eq!(bad("sgd", &[("learning_rate", "-0.1")]), "invalid parameter 'learning_rate': must be a finite number, 0 or more, got -0.1");
    assert_eq!(bad("adam", &[("beta1", "1")]), "invalid parameter 'beta1': must be in [0, 1), got 1");
    assert_eq!(bad("sgd", &[("rescale_grad", "nan")]), "invalid parameter 'rescale_grad': must be finite");
    kv.set_optimizer(Optimizer::from_params("sgd", [("learning_rate", "1")]).unwrap());
    let err = kv.set_grad_scaling(f32::NAN, -1.0).unwrap_err().to_string();
    assert_eq!(err, "invalid parameter 'rescale_grad': must be a finite number, 0 or more, got NaN");
    let err = kv.set_grad_scaling(1.0, f32::NAN).unwrap_err().to_string();
    assert_eq!(err, "invalid parameter 'clip_gradient': must be finite (negative or None turns clipping off), got NaN");
    let err = kv.set_rates(&Key::Int(5), 0.1, 0.0).unwrap_err().to_string();
    assert_eq!(err, "key 5: not initialized (call init first)");
    assert!(kv.set_rates(&k, f64::INFINITY, 0.0).unwrap_err().to_string().contains("'learning_rate'"));
    // Nothing above changed the optimizer: lr 1, rescale 1, no clipping.
    push_all(&kv, &k, 0.25, 2);
    assert_eq!(pulled(&kv, &k), vec![0.5; N]);
}

/// Random calls against a model of the local/device store: random keys (NUL
/// and mixed kinds among them), shapes (with wrong lengths), dtypes,
/// thresholds (invalid among them) and NaN / inf / overflow patterns. Every
/// call must either fail, leaving every value, residual and output exactly as
/// it was, or succeed with the model's result, bit for bit.
#[test]
fn random_calls_match_the_model_or_fail_changing_nothing() {
    use std::collections::HashMap;
    use crate::codec::reference;

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        fn chance(&mut self, percent: usize) -> bool {
            self.below(100) < percent
        }
    }

    #[derive(Clone)]
    struct Kept {
        shape: Vec<usize>,
        value: Vec<f32>,
        residuals: Vec<Vec<f32>>,
        /// A float16 key: uncompressed pushes are float16, sums round to float16.
        half: bool,
    }
    /// A gradient as generated: its values (exact in its dtype) and dtype.
    struct Input {
        shape: Vec<usize>,
        values: Vec<f32>,
        dtype: Dtype,
    }
    impl Input {
        fn bits16(&self) -> (Vec<f16>, Vec<bf16>) {
            (self.values.iter().map(|&x| f16::from_f32(x)).collect(), self.values.iter().map(|&x| bf16::from_f32(x)).collect())
        }
    }

    // Mostly one kind of key per trial, with the other kind and NUL now and then.
    let int_keys = [Key::Int(0), Key::Int(1), Key::Int(-7), Key::Int(1 << 40), Key::Int(0), Key::Int(1), Key::Int(-7), Key::Int(1 << 40), Key::from("w"), Key::from("w\0evil")];
    let str_keys_ = [Key::from("w"), Key::from("é"), Key::from("b"), Key::from(""), Key::from("w"), Key::from("é"), Key::from("b"), Key::from(""), Key::Int(0), Key::from("w\0evil")];
    let shapes: [&[usize]; 6] = [&[4], &[2, 3], &[0], &[1, 17], &[33], &[3, 0, 2]];
    let negs = ["-0.5", "-0.25", "-1", "-2.5", "-1e-30", "0", "nan", "0.5"];
    let poss = ["0.5", "0.25", "1", "1e-30", "2.5", "inf", "-1", "0"];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (mut ok, mut failed, mut two_bit_pushes) = (0usize, 0usize, 0usize);
    let mut reasons = std::collections::BTreeMap::new();
    let mut non_finite = 0usize;
    for trial in 0..400 {
        let kind = if trial % 4 == 0 { "local" } else { "device" };
        let kv = KVStore::new(kind).unwrap();
        let mut th: Option<Thresholds> = None;
        let mut model: HashMap<Key, Kept> = HashMap::new();
        let mut str_keys: Option<bool> = None;
        for step in 0..40 {
            // 0 set_compress, 1 init, 2 push, 3 pushpull, 4 pull, 5 residual
            let op = if step == 0 { 0 } else { [0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 4, 4, 5, 5, 5, 5][rng.below(20)] };
            let keys = if trial % 2 == 0 { &int_keys } else { &str_keys_ };
            let mut known: Vec<&Key> = model.keys().collect();
            known.sort();
            let key = if op >= 2 && !known.is_empty() && rng.chance(85) { known[rng.below(known.len())].clone() } else { keys[rng.below(keys.len())].clone() };
            let key_shape = model.get(&key).map(|k| k.shape.clone()).unwrap_or_else(|| shapes[rng.below(shapes.len())].to_vec());
            let input = |rng: &mut Rng| {
                let shape = if rng.chance(4) { shapes[rng.below(shapes.len())].to_vec() } else { key_shape.clone() };
                let n: usize = shape.iter().product::<usize>() + usize::from(rng.chance(3)); // a wrong length now and then
                let dtype = [Dtype::F32, Dtype::F32, Dtype::F32, Dtype::F32, Dtype::F16, Dtype::Bf16][rng.below(6)];
                let mut values: Vec<f32> = (0..n).map(|_| (rng.below(41) as f32 - 20.0) / 16.0).collect();
                if n > 0 && rng.chance(10) {
                    values[rng.below(n)] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 3e38, -3e38][rng.below(5)];
                }
                let values = match dtype {
                    Dtype::F32 => values,
                    Dtype::F16 => values.iter().map(|&x| f16::from_f32(x).to_f32()).collect(),
                    Dtype::Bf16 => values.iter().map(|&x| bf16::from_f32(x).to_f32()).collect(),
                };
                Input { shape, values, dtype }
            };
            let mut outs_kept: Option<(Vec<Vec<f32>>, bool)> = None; // outputs, and whether they must be untouched
            // The model's verdict: Err(()) when the call must fail.
            let expected: std::result::Result<(), ()>;
            let got: Result<()>;
            match op {
                0 => {
                    // set_compress, sometimes with invalid thresholds, sometimes after init
                    // The first five of each list are valid: mostly those on a trial's first call.
                    let valid_only = step == 0 && rng.chance(75);
                    let (neg, pos) = if valid_only { (negs[rng.below(5)], poss[rng.below(5)]) } else { (negs[rng.below(negs.len())], poss[rng.below(poss.len())]) };
                    let parse = |s: &str| s.parse::<f32>().unwrap();
                    let valid = parse(neg).is_finite() && parse(neg) < 0.0 && parse(pos).is_finite() && parse(pos) > 0.0;
                    let none = !valid_only && rng.chance(20);
                    expected = if !none && (!valid || kind == "local") || !model.is_empty() { Err(()) } else { Ok(()) };
                    got = if none {
                        Compression::from_params([("compress", "none")])
                    } else {
                        Compression::from_params([("compress", "2bit"), ("neg_threshold", neg), ("pos_threshold", pos)])
                    }
                    .and_then(|c| kv.set_compress(c));
                    if expected.is_ok() {
                        th = if none { None } else { Some(Thresholds::new(parse(neg), parse(pos)).unwrap()) };
                    }
                }
                1 => {
                    let x = input(&mut rng);
                    let mixed = str_keys.is_some_and(|s| s != key.is_str());
                    let bad = key.check().is_err() || mixed || model.contains_key(&key) || x.dtype == Dtype::Bf16 || x.values.len() != x.shape.iter().product::<usize>();
                    expected = if bad { Err(()) } else { Ok(()) };
                    let (h, b) = x.bits16();
                    let data = match x.dtype {
                        Dtype::F32 => Grad::F32(&x.values),
                        Dtype::F16 => Grad::F16(&h),
                        Dtype::Bf16 => Grad::Bf16(&b),
                    };
                    got = kv.init(&key, Array { shape: &x.shape, data });
                    if !bad {
                        model.insert(key.clone(), Kept { shape: x.shape.clone(), value: x.values.clone(), residuals: Vec::new(), half: x.dtype == Dtype::F16 });
                        str_keys = Some(key.is_str());
                    }
                }
                2 | 3 | 4 => {
                    // push (2), pushpull (3), pull (4)
                    let devices = if op == 4 { 0 } else { [0, 1, 1, 2, 2, 3][rng.below(6)] };
                    let inputs: Vec<Input> = (0..devices).map(|_| input(&mut rng)).collect();
                    let halves: Vec<(Vec<f16>, Vec<bf16>)> = inputs.iter().map(|x| x.bits16()).collect();
                    let arrays: Vec<Array> = inputs
                        .iter()
                        .zip(&halves)
                        .map(|(x, (h, b))| Array {
                            shape: &x.shape,
                            data: match x.dtype {
                                Dtype::F32 => Grad::F32(&x.values),
                                Dtype::F16 => Grad::F16(h),
                                Dtype::Bf16 => Grad::Bf16(b),
                            },
                        })
                        .collect();
                    let out_shapes: Vec<Vec<usize>> = (0..1 + rng.below(2)).map(|_| if rng.chance(10) { shapes[rng.below(shapes.len())].to_vec() } else { key_shape.clone() }).collect();
                    let mut outs: Vec<Vec<f32>> = out_shapes.iter().map(|s| vec![7.0; s.iter().product()]).collect();
                    let kept = model.get(&key).cloned();
                    let outs_ok = kept.as_ref().is_some_and(|k| out_shapes.iter().all(|s| *s == k.shape));
                    // The push's verdict and the new state.
                    let pushed: std::result::Result<Option<Kept>, ()> = match &kept {
                        _ if op == 4 => Ok(None),
                        None => Err(()),
                        Some(k) => {
                            let n = k.value.len();
                            let want = if k.half { Dtype::F16 } else { Dtype::F32 };
                            if inputs.is_empty() || inputs.iter().any(|x| x.shape != k.shape || x.values.len() != n) || (th.is_none() && inputs.iter().any(|x| x.dtype != want)) {
                                Err(())
                            } else if let Some(t) = th {
                                let mut next = k.clone();
                                next.residuals.resize(next.residuals.len().max(devices), vec![0.0; n]);
                                let finite = inputs.iter().zip(&next.residuals).all(|(x, r)| reference::first_non_finite(&x.values, r).is_none());
                                if !finite {
                                    Err(())
                                } else {
                                    let mut merged = vec![0f32; n];
                                    for (x, r) in inputs.iter().zip(next.residuals.iter_mut()) {
                                        for i in 0..n {
                                            let (code, rest) = reference::quantize_one(r[i], x.values[i], t);
                                            r[i] = rest;
                                            merged[i] += reference::value_of(code, t);
                                        }
                                    }
                                    if next.half {
                                        merged.iter_mut().for_each(|v| *v = f16::from_f32(*v).to_f32());
                                    }
                                    next.value = merged;
                                    Ok(Some(next))
                                }
                            } else {
                                let mut next = k.clone();
                                next.value = inputs[0].values.clone();
                                // float16 keys: 'device' rounds each partial sum, 'local' the total.
                                let each = next.half && kind == "device";
                                let round = |x: f32| if each { f16::from_f32(x).to_f32() } else { x };
                                for x in &inputs[1..] {
                                    next.value.iter_mut().zip(&x.values).for_each(|(v, g)| *v = round(*v + g));
                                }
                                if next.half {
                                    next.value.iter_mut().for_each(|v| *v = f16::from_f32(*v).to_f32());
                                }
                                Ok(Some(next))
                            }
                        }
                    };
                    let mut views: Vec<ArrayMut> = out_shapes.iter().zip(outs.iter_mut()).map(|(s, o)| ArrayMut { shape: s, data: o }).collect();
                    got = match op {
                        2 => kv.push(&key, &arrays),
                        3 => Store::pushpull(&kv, &key, &arrays, &mut views),
                        _ => kv.pull(&key, &mut views),
                    };
                    expected = match op {
                        2 => pushed.clone().map(|_| ()),
                        _ if !outs_ok => Err(()),
                        _ => pushed.clone().map(|_| ()),
                    };
                    if expected.is_ok() && op != 4 && th.is_some() {
                        two_bit_pushes += 1;
                    }
                    if expected.is_ok() {
                        if let Ok(Some(next)) = pushed {
                            model.insert(key.clone(), next);
                        }
                    }
                    if op != 2 {
                        outs_kept = Some((outs, expected.is_err()));
                    }
                }
                _ => {
                    let device = rng.below(4);
                    let kept = model.get(&key);
                    expected = match kept {
                        Some(k) if device < k.residuals.len() => Ok(()),
                        _ => Err(()),
                    };
                    let r = kv.residual(&key, device);
                    if let (Ok(r), Some(k)) = (&r, kept) {
                        assert!(r.iter().map(|x| x.to_bits()).eq(k.residuals[device].iter().map(|x| x.to_bits())), "trial {trial} step {step}: residual of {key} on {device}");
                    }
                    got = r.map(|_| ());
                }
            }
            let what = format!("trial {trial} ({kind}) step {step} op {op} key {key}");
            match (&expected, &got) {
                (Ok(()), Err(e)) => panic!("{what}: the model accepts, the store says: {e}"),
                (Err(()), Ok(())) => panic!("{what}: the store accepted what the model refuses"),
                (Err(()), Err(e)) => {
                    assert!(!e.to_string().is_empty());
                    non_finite += usize::from(e.to_string().contains("(NaN, infinity or float32 overflow)"));
                    *reasons.entry(format!("{op}: {}", e.to_string().chars().take(50).collect::<String>())).or_insert(0usize) += 1;
                    failed += 1;
                }
                (Ok(()), Ok(())) => ok += 1,
            }
            if let Some((outs, untouched)) = outs_kept {
                let value = model.get(&key).map(|k| k.value.clone());
                for o in &outs {
                    if untouched {
                        assert!(o.iter().all(|&x| x == 7.0), "{what}: an output was written by a failed call");
                    } else {
                        assert!(value.as_ref().is_some_and(|v| v.iter().map(|x| x.to_bits()).eq(o.iter().map(|x| x.to_bits()))), "{what}: output");
                    }
                }
            }
            // The whole store against the model, bit for bit.
            for (k, m) in &model {
                let v = kv.value(k).unwrap();
                assert!(v.iter().map(|x| x.to_bits()).eq(m.value.iter().map(|x| x.to_bits())), "{what}: value of {k}: {v:?} vs {:?}", m.value);
                assert_eq!(kv.shape(k).unwrap(), m.shape, "{what}");
                for (d, r) in m.residuals.iter().enumerate() {
                    assert!(kv.residual(k, d).unwrap().iter().map(|x| x.to_bits()).eq(r.iter().map(|x| x.to_bits())), "{what}: residual of {k} on device {d}");
                }
                assert!(kv.residual(k, m.residuals.len()).is_err(), "{what}");
            }
        }
    }
    // The generator reaches both outcomes often (else the test proves little).
    let mut top: Vec<_> = reasons.iter().collect();
    top.sort_by_key(|x| std::cmp::Reverse(*x.1));
    eprintln!("{ok} calls succeeded ({two_bit_pushes} 2-bit pushes), {failed} failed ({non_finite} non-finite); most common errors: {:#?}", &top[..top.len().min(8)]);
    assert!(ok > 3000 && failed > 3000 && two_bit_pushes > 1000 && non_finite > 100, "{ok} calls succeeded ({two_bit_pushes} 2-bit pushes), {failed} failed ({non_finite} non-finite)");
}

/// grandk_mn with unselected='local' on a device store: the store is one
/// worker, so the coordinates nothing was sent for keep the sum of its
/// devices' gradients (device 0's alone was kept, dropping the others').
#[test]
fn random_k_keeps_every_devices_gradient_where_nothing_was_sent() {
    let kv = KVStore::new("device").unwrap();
    kv.set_compress(Compression::from_params([("compress", "grandk_mn"), ("k", "1"), ("bits", "2"), ("seed", "0"), ("unselected", "local")]).unwrap()).unwrap();
    let k = Key::Int(0);
    let shape = [4usize];
    kv.init(&k, Array { shape: &shape, data: Grad::F32(&[0.0; 4]) }).unwrap();
    let (ones, fives) = ([1.0f32; 4], [5.0f32; 4]);
    kv.push(&k, &[Array { shape: &shape, data: Grad::F32(&ones) }, Array { shape: &shape, data: Grad::F32(&fives) }]).unwrap();
    let v = kv.value(&k).unwrap();
    let unselected: Vec<f32> = v.iter().copied().filter(|&x| x == 6.0).collect();
    assert_eq!(unselected.len(), 3, "{v:?}"); // k = 1: three coordinates were not sent
    let sent = v.iter().copied().find(|&x| x != 6.0).unwrap();
    assert!((sent - 6.0).abs() < 2.0, "{v:?}"); // the quantized sum of 1 and 5 at the selected one
}

/// Random-K refuses a non-finite gradient wherever it is, as every scheme
/// does: a NaN or inf in a coordinate this step does not send used to be
/// accepted, put in the value under unselected='local' and dropped silently
/// under 'zero'. The value and the states stay as they were.
#[test]
fn random_k_refuses_a_non_finite_value_in_a_coordinate_it_does_not_send() {
    for unselected in ["local", "zero"] {
        let kv = KVStore::new("device").unwrap();
        kv.set_compress(Compression::from_params([("compress", "grandk_mn"), ("k", "1"), ("bits", "2"), ("seed", "0"), ("unselected", unselected)]).unwrap()).unwrap();
        let k = Key::Int(0);
        let shape = [4usize];
        kv.init(&k, Array { shape: &shape, data: Grad::F32(&[0.0; 4]) }).unwrap();
        let ones = [1.0f32; 4];
        kv.push(&k, &[Array { shape: &shape, data: Grad::F32(&ones) }, Array { shape: &shape, data: Grad::F32(&ones) }]).unwrap();
        let before = (kv.value(&k).unwrap(), kv.save_compression_states().unwrap());
        for bad in [f32::NAN, f32::INFINITY] {
            for at in 0..4 {
                let mut g = [1.0f32; 4];
                g[at] = bad;
                let err = kv.push(&k, &[Array { shape: &shape, data: Grad::F32(&ones) }, Array { shape: &shape, data: Grad::F32(&g) }]).unwrap_err().to_string();
                assert!(err.contains("pushed value 1") && err.contains(&format!("at element {at}")) && err.contains("non-finite"), "{unselected}: {err}");
                assert_eq!((kv.value(&k).unwrap(), kv.save_compression_states().unwrap()), before, "{unselected}");
            }
        }
    }
}

/// Every compression's state survives a checkpoint: a device store saved
/// after 3 of 6 pushes and restored into a fresh store (value, optimizer and
/// compression states) continues bit for bit as the uninterrupted one.
#[test]
fn a_checkpoint_resumes_every_scheme_bit_for_bit() {
    let shape: &[usize] = &[6, 10];
    let n = 60;
    let schemes: [&[(&str, &str)]; 9] = [
        &[("compress", "2bit"), ("threshold", "0.3")],
        &[("compress", "qsgd_mn"), ("bits", "2"), ("seed", "4")],
        &[("compress", "qsgd_mn_ts"), ("bits", "[2, 6]")],
        &[("compress", "qsgd_mn_ms"), ("bits", "[1, 3, 8]")],
        &[("compress", "grandk_mn"), ("bits", "4"), ("k", "17")],
        &[("compress", "grandk_mn"), ("bits", "2"), ("k", "7"), ("unselected", "local")],
        &[("compress", "grandk_mn_ts"), ("bits", "[2, 4]"), ("k", "30")],
        &[("compress", "powersgd"), ("rank", "2")],
        &[("compress", "1bit"), ("threshold", "0.1")],
    ];
    let grad = |d: usize, step: usize| -> Vec<f32> { (0..n).map(|i| (((i * 31 + d * 17 + step * 7) % 23) as f32 - 11.0) * 0.05 * (1.0 + d as f32)).collect() };
    let k = Key::Str("w".into());
    let make = |c: &[(&str, &str)], value: &[f32]| {
        let kv = KVStore::new("device").unwrap();
        kv.set_compress(Compression::from_params(c.iter().copied()).unwrap()).unwrap();
        kv.set_optimizer(Optimizer::from_params("sgd", [("learning_rate", "0.1"), ("momentum", "0.9")]).unwrap());
        kv.init(&k, Array { shape, data: Grad::F32(value) }).unwrap();
        kv
    };
    let push = |kv: &KVStore, step: usize| {
        let gs: Vec<Vec<f32>> = (0..3).map(|d| grad(d, step)).collect();
        let arrays: Vec<Array> = gs.iter().map(|g| Array { shape, data: Grad::F32(g) }).collect();
        kv.push(&k, &arrays).unwrap();
    };
    for c in schemes {
        let straight = make(c, &vec![0.5; n]);
        let first = make(c, &vec![0.5; n]);
        for step in 0..3 {
            push(&straight, step);
            push(&first, step);
        }
        let blob = first.save_optimizer_states().unwrap();
        let resumed = make(c, &first.value(&k).unwrap());
        resumed.load_optimizer_states(&blob).unwrap();
        let fresh = make(c, &first.value(&k).unwrap()); // the same value, no states
        for step in 3..6 {
            push(&straight, step);
            push(&resumed, step);
            push(&fresh, step);
        }
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        assert_eq!(bits(resumed.value(&k).unwrap()), bits(straight.value(&k).unwrap()), "{c:?}");
        assert_ne!(bits(fresh.value(&k).unwrap()), bits(straight.value(&k).unwrap()), "{c:?}: without the states the run differs, so the test can fail");
        for d in 0..3 {
            // Schemes without error feedback have no residual; the step still seeds their noise.
            if let Ok(want) = straight.residual(&k, d) {
                assert_eq!(bits(resumed.residual(&k, d).unwrap()), bits(want), "{c:?} device {d}");
            }
        }
    }
}

/// A compression-state blob that does not fit the store is refused naming
/// the difference, and the store keeps its state.
#[test]
fn compression_states_that_do_not_fit_are_refused_changing_nothing() {
    let k = Key::Int(3);
    let store = |th: &str, n: usize| {
        let kv = KVStore::new("device").unwrap();
        kv.set_compress(Compression::from_params([("compress", "2bit"), ("threshold", th)]).unwrap()).unwrap();
        kv.init(&k, Array { shape: &[n], data: Grad::F32(&vec![0.0; n]) }).unwrap();
        kv.push(&k, &[Array { shape: &[n], data: Grad::F32(&vec![0.2; n]) }]).unwrap();
        kv
    };
    let blob = store("0.5", 8).save_compression_states().unwrap();
    let other = store("0.7", 8);
    let before = other.save_compression_states().unwrap();
    let err = other.load_compression_states(&blob).unwrap_err().to_string();
    assert!(err.contains("compression states: saved with") && err.contains("0.5") && err.contains("0.7"), "{err}");
    let err = store("0.5", 9).load_compression_states(&blob).unwrap_err().to_string();
    assert!(err.contains("key 3: saved with shape [8], initialized here with [9]"), "{err}");
    let fresh = KVStore::new("device").unwrap();
    fresh.set_compress(Compression::from_params([("compress", "2bit"), ("threshold", "0.5")]).unwrap()).unwrap();
    let err = fresh.load_compression_states(&blob).unwrap_err().to_string();
    assert!(err.contains("key 3: in the compression states but not initialized in this store"), "{err}");
    for cut in [0, 3, 10, blob.len() - 1] {
        assert!(other.load_compression_states(&blob[..cut]).is_err(), "cut {cut}");
    }
    assert_eq!(other.save_compression_states().unwrap(), before, "refused loads changed nothing");
    // A bare optimizer blob of earlier versions still loads.
    let kv = KVStore::new("device").unwrap();
    kv.set_optimizer(Optimizer::from_params("sgd", [("momentum", "0.9")]).unwrap());
    let old = kv.with_optimizer(|o| Ok(o.save_states())).unwrap();
    kv.load_optimizer_states(&old).unwrap();
}
