//! The device store's push with every compression, on 2 and 4 devices, in
//! one run beside the memory-bound `r += g` loop and the uncompressed push:
//! each device's gradient is encoded, the codes summed, the sum decoded and
//! stored. 16 Mi float32 elements per device (PowerSGD: a square matrix).
//!
//! Run: `cargo bench --bench device_store` (GRADPACK_BENCH_MI sets the size
//! in Mi-elements, GRADPACK_BENCH_ONLY picks schemes by name).

mod common;

use common::time;
use gradpack::store::{Array, Grad, KVStore, Key};
use gradpack::quant::collective::InProcess;
use gradpack::quant::compression::Compression;
use gradpack::quant::scheme::{self, Ctx, State};

/// The codec's share of a push on `devices` devices: one device's encode
/// (as `benches/schemes.rs` times it) per device, plus one decode.
fn codec_cost(c: &Compression, shape: &[usize], grad: &[f32], devices: usize, reps: usize) -> f64 {
    let mut states = [State::default()];
    let mut out = vec![0f32; grad.len()];
    let ctx = Ctx { shape, step: 0, key_hash: 1, member: 0, workers: devices };
    let enc = time(reps, || {
        let (_, part) = scheme::encode(c, &mut states, &[grad], &ctx, &mut InProcess::new(1)).unwrap();
        scheme::finish(c, &mut states, part);
    });
    let (ex, part) = scheme::encode(c, &mut states, &[grad], &ctx, &mut InProcess::new(1)).unwrap();
    let dec = time(reps, || scheme::decode(c, &ex, &part, &ctx, &mut out).unwrap());
    devices as f64 * enc + dec
}

fn main() {
    let mi: usize = std::env::var("GRADPACK_BENCH_MI").ok().and_then(|s| s.parse().ok()).unwrap_or(16);
    let n = mi << 20;
    let side = (n as f64).sqrt() as usize;
    let only = std::env::var("GRADPACK_BENCH_ONLY").unwrap_or_default();
    let threads = rayon::current_num_threads();
    let grads: Vec<Vec<f32>> = (0..4u64)
        .map(|d| (0..n as u64).map(|i| ((i.wrapping_mul(2654435761).wrapping_add(d * 977) % 1000) as f32 / 1000.0 - 0.5) * 1.4).collect())
        .collect();
    let mut residual = vec![0f32; n];
    let stream = time(5, || common::residual_add(&mut residual, &grads[0]));
    drop(residual);
    println!("gradpack device store push: {mi} Mi float32 elements per device, {threads} threads (PowerSGD: {side} x {side})");
    println!("{:<22} {:>8} {:>11} {:>9} {:>10} {:>10} {:>10}", "compression", "devices", "push ms", "vs none", "vs r+=g", "codec ms", "vs codec");
    let cases: Vec<(&str, &[(&str, &str)])> = [("none", &[][..]), ("2bit", &[("compress", "2bit"), ("threshold", "0.5")][..])].into_iter().chain(common::SCHEMES.iter().copied()).collect();
    for devices in [2usize, 4] {
        let mut none = 0.0;
        for (name, params) in cases.iter().filter(|(name, _)| *name == "none" || name.contains(only.as_str())) {
            let c = common::compression(params, n);
            let shape: Vec<usize> = if matches!(c, Compression::PowerSgd { .. }) { vec![side, n / side] } else { vec![n] };
            let len: usize = shape.iter().product();
            let kv = KVStore::new("device").unwrap();
            kv.set_compress(c).unwrap();
            let zeros = vec![0f32; len];
            kv.init(&Key::Int(0), Array { shape: &shape, data: Grad::F32(&zeros) }).unwrap();
            let values: Vec<Array> = grads[..devices].iter().map(|g| Array { shape: &shape, data: Grad::F32(&g[..len]) }).collect();
            let reps = if matches!(c, Compression::PowerSgd { .. }) { 3 } else { 5 };
            let t = time(reps, || kv.push(&Key::Int(0), &values).unwrap());
            if c.is_none() {
                none = t;
            }
            let codec = c.is_scheme().then(|| codec_cost(&c, &shape, &grads[0][..len], devices, reps));
            let (cm, cr) = codec.map_or(("-".into(), "-".into()), |x| (format!("{:.1}", x * 1e3), format!("{:.2}x", t / x)));
            println!("{:<22} {:>8} {:>11.1} {:>8.2}x {:>9.2}x {:>10} {:>10}", name, devices, t * 1e3, t / none, t / stream, cm, cr);
        }
    }
    println!("\nvs r+=g: push time / one in-place r += g loop over one device's gradient (12 B/element).");
    println!("codec: one device's scheme encode times the devices, plus one decode (the push's floor without the store).");
}
