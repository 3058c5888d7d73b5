//! GPU kernels beside the same GPU's device-to-device copy, from the same
//! run: each row's bytes moved per second against the copy's (issue 16's
//! bar: 2-bit quantize at 256M elements reaches at least 70% of the copy).
//! Every call is timed whole, as a user sees it: launches, the error-flag
//! read-back and the stream synchronization included. Median of 9 after a
//! warm-up.
//!
//! Run on a machine with a GPU: `cargo bench --features cuda --bench cuda`
//! (GRADPACK_BENCH_N sets the element count, default 256 Mi).

use std::time::Instant;

use gradpack::codec::{self, Thresholds};
use gradpack::cuda::{reduce_2bit, Gpu, Member};

fn median(mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..9)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[4]
}

fn main() {
    let n: usize = std::env::var("GRADPACK_BENCH_N").ok().and_then(|s| s.parse().ok()).unwrap_or(256 << 20);
    let d = match Gpu::new(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("cuda bench: {e}");
            std::process::exit(1);
        }
    };
    println!("GPU 0: {}; n = {n} float32 elements ({} MiB per array)", d.name().unwrap_or_default(), (n * 4) >> 20);
    let host: Vec<f32> = (0..n).map(|i| ((i.wrapping_mul(2654435761) % 2001) as f32 - 1000.0) / 1000.0).collect();
    let g = d.upload(&host).unwrap();
    let mut r = d.zeros::<f32>(n).unwrap();
    let mut next = d.zeros::<f32>(n).unwrap();
    let mut out = d.zeros::<f32>(n).unwrap();
    let mut compr = d.zeros::<f32>(codec::compressed_len(n)).unwrap();
    let mut codes = d.zeros::<i32>(n).unwrap();
    let th = Thresholds::symmetric(0.5).unwrap();
    let stream = d.stream().clone();

    let copy = median(|| {
        stream.memcpy_dtod(&g, &mut out).unwrap();
        stream.synchronize().unwrap();
    });
    let (f4, c4) = (4.0 * n as f64, 4.0 * codec::compressed_len(n) as f64);
    let copy_bw = 2.0 * f4 / copy;
    println!("{:<40} {:>9} {:>10} {:>9}", "operation", "ms", "GB/s", "of copy");
    println!("{:<40} {:>9.3} {:>10.1} {:>8.0}%", "device-to-device copy (read + write)", copy * 1e3, copy_bw / 1e9, 100.0);
    let row = |name: &str, bytes: f64, secs: f64| {
        println!("{:<40} {:>9.3} {:>10.1} {:>8.0}%", name, secs * 1e3, bytes / secs / 1e9, 100.0 * bytes / secs / copy_bw);
    };
    let q_to = median(|| d.quantize_2bit_to(&g, &r, &mut next, &mut compr, th).unwrap());
    row("2bit quantize_to (one pass)", 3.0 * f4 + c4, q_to);
    let g16 = d.upload(&host.iter().map(|&x| half::f16::from_f32(x)).collect::<Vec<_>>()).unwrap();
    let q_to16 = median(|| d.quantize_2bit_to(&g16, &r, &mut next, &mut compr, th).unwrap());
    row("2bit quantize_to, float16 gradient", 2.0 * f4 / 2.0 + 2.0 * f4 + c4, q_to16);
    drop(g16);
    let q_in = median(|| d.quantize_2bit(&g, &mut r, &mut compr, th).unwrap());
    row("2bit quantize (check, then in place)", 3.0 * f4 + c4, q_in);
    let deq = median(|| d.dequantize_2bit(&compr, &mut out).unwrap());
    row("2bit dequantize (check, then decode)", f4 + c4, deq);
    let deq_add = median(|| d.dequantize_2bit_add(&compr, &mut out).unwrap());
    row("2bit dequantize_add", 2.0 * f4 + c4, deq_add);
    let max = median(|| {
        d.max_abs(&g).unwrap();
    });
    row("max |g| (QSGD's scale)", f4, max);
    let qs = median(|| d.qsgd_quantize(&g, 1.0, 2, 7, 0, &mut codes, false).unwrap());
    row("qsgd_mn 2 encode (max check + codes)", 3.0 * f4, qs);
    let qd = median(|| d.qsgd_decode(&codes, 1.0, 2, &mut out).unwrap());
    row("qsgd_mn 2 decode", 2.0 * f4, qd);
    let ob = median(|| d.onebit_quantize(&g, &mut r, 0.0, &mut codes, false).unwrap());
    row("1bit encode (check, then quantize)", 4.0 * f4, ob);
    // The device store's Reduce: 2 members on 2 streams of this GPU, each
    // validated then quantized in place, decoded and summed on the first.
    let d1 = d.fork().unwrap();
    let g1 = d1.upload(&host).unwrap();
    let mut r1 = d1.zeros::<f32>(n).unwrap();
    drop(codes);
    let red = median(|| {
        let mut members = [Member { gpu: &d, grad: &g, residual: &mut r }, Member { gpu: &d1, grad: &g1, residual: &mut r1 }];
        reduce_2bit(&mut members, &d, &mut out, th).unwrap()
    });
    // Bytes it must move at least: each member's quantize (12 B/element)
    // and the sum's write and read-modify-write (4 + 8 B/element).
    row("2bit reduce, 2 members (streams)", 2.0 * (3.0 * f4 + c4) + 3.0 * f4, red);
    println!("2bit quantize_to / copy bandwidth: {:.2} (bar: 0.70)", (3.0 * f4 + c4) / q_to / copy_bw);
}
