//! Compression throughput of every scheme beside the codec benchmark's
//! memory-bound loop (`r += g`, same run, same threads): one worker's encode
//! (quantize, pack for the wire) and decode of a summed result, on 16 Mi
//! elements (PowerSGD: a 4096 x 4096 matrix). Exchanges go through a
//! one-member in-process collective, so this measures computation, not a network.
//!
//! Run: `cargo bench --bench schemes` (GRADPACK_BENCH_MI sets the size in
//! Mi-elements, GRADPACK_BENCH_ONLY picks schemes by name,
//! GRADPACK_BENCH_WORKERS decodes the sum of that many workers' codes: the
//! wider lanes a job of several workers decodes).

mod common;

use common::{time, time_beside};
use gradpack::quant::collective::InProcess;
use gradpack::quant::compression::Compression;
use gradpack::quant::scheme::{self, Ctx, State};

fn main() {
    let mi: usize = std::env::var("GRADPACK_BENCH_MI").ok().and_then(|s| s.parse().ok()).unwrap_or(16);
    let n = mi << 20;
    let workers: usize = std::env::var("GRADPACK_BENCH_WORKERS").ok().and_then(|s| s.parse().ok()).unwrap_or(1).max(1);
    // PowerSGD's matrix: the squarest whose sides divide n (4096 x 4096 at 16 Mi)
    let side = (1..=(n as f64).sqrt() as usize).rev().find(|&d| n.is_multiple_of(d)).unwrap_or(1);
    let grad: Vec<f32> = (0..n).map(|i| ((i.wrapping_mul(2654435761) % 1000) as f32 / 1000.0 - 0.5) * 1.4).collect();
    let mut residual = vec![0f32; n];
    let reps = 11; // medians: this machine's runs vary by 20-30%
    let threads = rayon::current_num_threads();
    // The floors, timed again right before each encode (the r += g loop, on
    // arrays of its own) and decode (the copy) they are a floor of.
    let mut loop_r = vec![0f32; n];
    let mut r_plus_g = || common::residual_add(&mut loop_r, &grad);
    let mut copied = vec![1f32; n];
    let mut copy = || common::copy(&mut copied, &grad);
    let stream = time(reps, &mut r_plus_g);
    let copy_alone = time(reps, &mut copy);
    let twobit = Compression::from_params([("compress", "2bit"), ("threshold", "0.5")]).unwrap();
    let mut compr = gradpack::create_2bit(n);
    let Compression::TwoBit(th) = twobit else { unreachable!() };
    let codec = time_beside(reps, &mut r_plus_g, || gradpack::quantize_2bit(&grad, &mut residual, &mut compr, th).unwrap());
    // The stores' path: out of place into a second residual, finiteness
    // checked in the same pass, the buffers swapped on success.
    let mut next = vec![0f32; n];
    // The 2-bit paths' own floors: a read-only pass over r and g (the
    // operator's check, before its r += g-like pass), and r + g into a third
    // array (the stores' pass).
    let read = time_beside(reps, &mut r_plus_g, || assert!(!common::any_non_finite(&residual, &grad)));
    let third = time_beside(reps, &mut r_plus_g, || common::add_into(&mut next, &residual, &grad));
    residual.fill(0.0);
    let codec_to = time_beside(reps, &mut r_plus_g, || {
        gradpack::quantize_2bit_to(&grad, &residual, &mut next, &mut compr, th).unwrap();
        std::mem::swap(&mut residual, &mut next);
    });
    drop(next);
    println!("gradpack scheme throughput: {mi} Mi float32 elements, {threads} threads (PowerSGD: {side} x {})", n / side);
    let summed = if workers == 1 { "one worker's codes".to_string() } else { format!("{workers} workers' codes summed") };
    println!("encode = quantize + pack for the wire; decode = summed result back to float32 ({summed})");
    println!("each ratio against its floor timed right before it (loop ms, copy ms)\n");
    println!("{:<24} {:>10} {:>9} {:>10} {:>10} {:>9} {:>9} {:>12} {:>8} {:>8}", "scheme", "encode ms", "Gelem/s", "vs r+=g", "decode ms", "Gelem/s", "vs copy", "wire B/elem", "loop ms", "copy ms");
    let row = |name: &str, (base, enc): (f64, f64), dec: Option<(f64, f64)>, wire: Option<f64>| {
        let dash = || "-".to_string();
        let (d, dg, dr, c) = dec.map_or((dash(), dash(), dash(), dash()), |(c, d)| (format!("{:.1}", d * 1e3), format!("{:.3}", n as f64 / d / 1e9), format!("{:.2}x", d / c), format!("{:.1}", c * 1e3)));
        let wire = wire.map_or(dash(), |w| format!("{w:.3}"));
        println!("{:<24} {:>10.1} {:>9.3} {:>9.2}x {:>10} {:>9} {:>9} {:>12} {:>8.1} {:>8}", name, enc * 1e3, n as f64 / enc / 1e9, enc / base, d, dg, dr, wire, base * 1e3, c);
    };
    row("r += g loop (floor)", (stream, stream), None, Some(4.0));
    println!("{:<24} {:>10} {:>9} {:>10} {:>10.1} {:>9.3} {:>9} {:>12} {:>8} {:>8.1}", "copy (decode floor)", "-", "-", "-", copy_alone * 1e3, n as f64 / copy_alone / 1e9, "1.00x", "-", "-", copy_alone * 1e3);
    row("read r, g (check floor)", read, None, None);
    row("next = r + g (3 arrays)", third, None, None);
    row("2bit (operator, in place)", codec, None, Some(0.25));
    row("2bit (stores, to next)", codec_to, None, Some(0.25));
    let only = std::env::var("GRADPACK_BENCH_ONLY").unwrap_or_default();
    // 2-bit as the all-reduce stores push it: the scheme's packed lanes.
    let two_bit_lanes: (&str, &[(&str, &str)]) = ("2bit (scheme, lanes)", &[("compress", "2bit"), ("threshold", "0.5")]);
    for (name, params) in common::SCHEMES.iter().copied().chain([two_bit_lanes]).filter(|(name, _)| name.contains(only.as_str())) {
        let c = common::compression(params, n);
        let shape: Vec<usize> = if matches!(c, Compression::PowerSgd { .. }) { vec![side, n / side] } else { vec![n] };
        let mut member = InProcess::new(1);
        let mut states = [State::default()];
        let mut out = vec![0f32; n];
        let mut wire_bytes = 0usize;
        // As a store's push: encode, then finish and recycle (which keep the
        // code and scale-index buffers for the next push). Each push a new
        // step, as in training: random-K draws its selection anew (its
        // decode, below, finds it drawn).
        let mut step = 0;
        let enc = time_beside(reps, &mut r_plus_g, || {
            step += 1;
            let ctx = Ctx { shape: &shape, step, key_hash: 1, member: 0, workers };
            let (ex, part) = scheme::encode(&c, &mut states, &[&grad], &ctx, &mut member).unwrap();
            wire_bytes = scheme::to_wire(&part).len() + ex.iter().map(|p| scheme::to_wire(p).len()).sum::<usize>();
            scheme::finish(&c, &mut states, part);
            scheme::recycle(&mut states, ex);
        });
        let ctx = Ctx { shape: &shape, step: step + 1, key_hash: 1, member: 0, workers };
        let (ex, part) = scheme::encode(&c, &mut states, &[&grad], &ctx, &mut member).unwrap();
        // Several workers: this worker's codes summed as often, in the
        // lanes a server sums them in (PowerSGD's floats: as they are).
        let wire = scheme::to_wire(&part);
        let part = match workers > 1 && scheme::is_codes_wire(&wire) {
            true => {
                let mut sum = scheme::LaneSum::first(&wire, workers).unwrap();
                (1..workers).for_each(|_| sum.add(&wire).unwrap());
                sum.into_part()
            }
            false => part,
        };
        let dec = time_beside(reps, &mut copy, || scheme::decode(&c, &ex, &part, &ctx, &mut out).unwrap());
        row(name, enc, Some(dec), Some(wire_bytes as f64 / n as f64));
    }
    // Two stages of the encodes above, timed alone.
    println!();
    let max = time(reps, || {
        std::hint::black_box(gradpack::quant::qsgd::max_abs(&grad));
    });
    println!("{:<40} {:>6.1} ms", "stage: max |g| (QSGD's first pass)", max * 1e3);
    if let Some((_, params)) = common::SCHEMES.iter().find(|(name, _)| name.starts_with("grandk")) {
        if let Compression::Qsgd(q) = common::compression(params, n) {
            let mut step = 1 << 40; // steps no encode above drew: never a cached selection
            let draw = time(reps, || {
                step += 1;
                std::hint::black_box(scheme::selection(&q, n, step, 1));
            });
            println!("{:<40} {:>6.1} ms", "stage: random-K's selection (k = n/16)", draw * 1e3);
        }
    }
    println!("\nvs r+=g: encode time / the in-place r += g loop's (12 B/element, the memory floor of a residual update).");
    println!("decode ms beside the copy's (8 B/element, every value read and written).");
    println!("2bit in place checks every residual + grad before it writes (a read pass first, 20 B/element in all);");
    println!("the stores quantize into a second residual, checking in the same pass, and swap (12 B/element).");
    // Ratios of ratios: each path and its floor were timed against the loop.
    let (in_place, check, stores, three) = (codec.1 / codec.0, read.1 / read.0, codec_to.1 / codec_to.0, third.1 / third.0);
    println!("2bit against its own floors: in place {:.2}x (read pass + r += g loop), stores {:.2}x (next = r + g).", in_place / (check + 1.0), stores / three);
}
