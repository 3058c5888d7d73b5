//! Codec throughput beside its baselines, from the same run: an in-place
//! memory-bound loop (`r += g`, 12 B/element, the floor for quantize), a plain
//! copy of the output array (the bar for dequantize), and a vectorised numpy
//! implementation (python/tests/numpy_2bit.py, run in a child process).
//!
//! Run: `cargo bench --bench codec` (PYTHON selects the interpreter for numpy;
//! GRADPACK_BENCH_SIZES="1,16,64" sets sizes in Mi-elements).

mod common;

use std::process::Command;

use common::time;

use gradpack::codec::Platform;
use gradpack::{create_2bit, dequantize_2bit, quantize_2bit, quantize_2bit_to, Thresholds};
use rayon::prelude::*;

const CHUNK: usize = gradpack::codec::CHUNK;

fn numpy_seconds(n: usize) -> Option<(f64, f64)> {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let script = format!(
        "import sys, time, numpy as np; sys.path.insert(0, 'python/tests'); import numpy_2bit as m\n\
         n = {n}; g = np.random.default_rng(0).uniform(-0.7, 0.7, n).astype(np.float32); r = np.zeros(n, np.float32)\n\
         def t(f, k=3):\n  f(); ts = []\n  for _ in range(k):\n    s = time.perf_counter(); f(); ts.append(time.perf_counter() - s)\n  return sorted(ts)[k // 2]\n\
         c, _ = m.quantize(g, r, -0.5, 0.5)\n\
         print(t(lambda: m.quantize(g, r, -0.5, 0.5)), t(lambda: m.dequantize(c, n)))"
    );
    let out = Command::new(python).args(["-c", &script]).current_dir(env!("CARGO_MANIFEST_DIR")).output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut it = text.split_whitespace().map(|s| s.parse::<f64>().ok());
    Some((it.next()??, it.next()??))
}

fn main() {
    let sizes: Vec<usize> = std::env::var("GRADPACK_BENCH_SIZES")
        .unwrap_or_else(|_| "1,16,64".into())
        .split(',')
        .map(|s| s.trim().parse::<usize>().expect("GRADPACK_BENCH_SIZES: Mi-elements") << 20)
        .collect();
    let th = Thresholds::new(-0.5, 0.5).unwrap();
    println!("gradpack codec benchmark: kernel {:?}, {} cores", Platform::detect(), std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    println!("GB/s counts bytes moved: quantize 12.25 B/elem, dequantize 4.125, r+=g loop 12, copy 8");
    println!("quantize_2bit works in place, so it scans residual + gradient for NaN/inf before writing (a second read);");
    println!("quantize_2bit_to (the stores' path) checks in its one pass and writes the next residual to a second buffer\n");
    println!("{:>5} {:>3}  {:<22} {:>9} {:>8} {:>10} {:>8}", "Mi", "thr", "operation", "ms", "Gelem/s", "GB/s", "ratio");
    for &n in &sizes {
        let grad: Vec<f32> = (0..n).map(|i| ((i.wrapping_mul(2654435761) % 1000) as f32 / 1000.0 - 0.5) * 1.4).collect();
        let mut residual = vec![0f32; n];
        let mut spare = vec![0f32; n];
        let mut compr = create_2bit(n);
        let mut out = vec![0f32; n];
        let src = vec![1f32; n];
        let reps = if n >= 32 << 20 { 5 } else { 11 };
        let numpy = numpy_seconds(n);
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let stream = time(reps, || common::residual_add(&mut residual, &grad));
                let copy = time(reps, || out.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(o, s)| o.copy_from_slice(s)));
                residual.fill(0.0);
                let q = time(reps, || quantize_2bit(&grad, &mut residual, &mut compr, th).unwrap());
                residual.fill(0.0);
                // The stores' path: out of place into a second buffer, swapped in.
                let q_to = time(reps, || {
                    quantize_2bit_to(&grad, &residual, &mut spare, &mut compr, th).unwrap();
                    std::mem::swap(&mut residual, &mut spare);
                });
                let d = time(reps, || dequantize_2bit(&compr, &mut out).unwrap());
                let row = |name: &str, s: f64, bytes: f64, ratio: String| {
                    println!("{:>5} {:>3}  {:<22} {:>9.2} {:>8.3} {:>10.2} {:>8}", n >> 20, threads, name, s * 1e3, n as f64 / s / 1e9, n as f64 * bytes / s / 1e9, ratio);
                };
                row("r += g (floor)", stream, 12.0, "1.00".into());
                row("quantize_2bit", q, 12.25, format!("{:.2}x", q / stream));
                row("quantize_2bit_to", q_to, 12.25, format!("{:.2}x", q_to / stream));
                // The baseline issue 12 measures against: the in-place kernel
                // alone, without the finiteness scan (unsafe on NaN input).
                let mut bl = vec![0u32; n.div_ceil(16)];
                let unchecked = time(reps, || {
                    let p = Platform::detect();
                    grad.par_chunks(CHUNK).zip(residual.par_chunks_mut(CHUNK)).zip(bl.par_chunks_mut(CHUNK / 16)).for_each(|((g, r), b)| p.quantize(g, r, b, th).unwrap())
                });
                row("  unchecked in place", unchecked, 12.25, format!("{:.2}x", unchecked / stream));
                println!("{:>5} {:>3}  {:<22} quantize_2bit_to / unchecked = {:.2}x, quantize_2bit / unchecked = {:.2}x", "", "", "", q_to / unchecked, q / unchecked);
                row("copy out (bar)", copy, 8.0, "1.00".into());
                row("dequantize_2bit", d, 4.125, format!("{:.2}x", d / copy));
                if let Some((nq, nd)) = numpy {
                    row("numpy quantize", nq, 12.25, format!("{:.1}x", nq / q));
                    row("numpy dequantize", nd, 4.125, format!("{:.1}x", nd / d));
                }
                println!();
            });
        }
    }
    println!("ratio: quantize = its time / the r+=g loop's; dequantize = its time / the copy's;");
    println!("'unchecked in place' is the quantize kernel without the NaN/inf scan: the cost before validate-first;");
    println!("numpy rows = numpy's time / gradpack's (how many times faster gradpack is).");
}
