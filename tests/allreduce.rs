//! The MPI all-reduce store (`dist_sync_allreduce`) in real processes: the
//! test re-runs itself under `mpirun -n 3`, and each rank checks its results
//! against a `device` store with one device per worker, which runs the same
//! schemes in one process.
#![cfg(feature = "mpi")]

use std::process::Command;

use gradpack::quant::compression::Compression;
use gradpack::store::{MpiStore, Array, ArrayMut, Grad, KVStore, Key, Store};

const WORKERS: usize = 3;

/// Whether this process is a rank of `mpirun`. There a failed assertion
/// aborts the rank once reported, so that mpirun ends every rank at once: a
/// rank that returned would wait in `MPI_Finalize` for ranks that wait in a
/// collective for it, and the test would hang instead of failing.
fn under_mpi() -> bool {
    let under = std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some();
    if under {
        static HOOK: std::sync::Once = std::sync::Once::new();
        HOOK.call_once(|| {
            let report = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                report(info);
                std::process::abort();
            }));
        });
    }
    under
}

/// Runs test `name` of this binary on `WORKERS` ranks; panics with their
/// output on failure, or when they run past `--timeout` (a hang).
fn mpirun(name: &str) {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "--timeout", "300", "-n", &WORKERS.to_string()])
        .arg(exe)
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .output()
        .expect("mpirun (Debian: openmpi-bin) must be on PATH");
    let text = format!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "mpirun failed:\n{text}");
    assert_eq!(text.matches("rank done").count(), WORKERS, "{text}");
    text.lines().filter(|l| l.contains("bytes sent")).for_each(|l| println!("{l}"));
}

fn params(p: &[(&str, &str)]) -> Compression {
    Compression::from_params(p.iter().copied()).unwrap()
}

fn grad(rank: usize, step: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| (((i * 31 + rank * 17 + step * 7) % 23) as f32 - 11.0) * 0.05 * (1.0 + rank as f32)).collect()
}

fn f32s<'a>(shape: &'a [usize], v: &'a [f32]) -> Array<'a> {
    Array { shape, data: Grad::F32(v) }
}

fn pull(kv: &dyn Store, key: &Key, shape: &[usize]) -> Vec<f32> {
    let mut out = vec![0f32; shape.iter().product()];
    kv.pull(key, &mut [ArrayMut { shape, data: &mut out }]).unwrap();
    out
}

#[test]
fn every_scheme_matches_the_device_store_bit_for_bit() {
    if !under_mpi() {
        return mpirun("every_scheme_matches_the_device_store_bit_for_bit");
    }
    let kv = MpiStore::join().unwrap();
    let (rank, workers) = (kv.rank(), kv.num_workers());
    assert_eq!(workers, WORKERS);
    let shape = [6usize, 10];
    let n = 60;
    // init: every worker takes rank 0's value
    let mine = vec![rank as f32; n];
    kv.init(&Key::Int(0), f32s(&shape, &mine)).unwrap();
    assert_eq!(pull(&kv, &Key::Int(0), &shape), vec![0.0; n]);

    // uncompressed: the exact sum over workers and their two devices
    let a = vec![rank as f32 + 1.0; n];
    kv.push(&Key::Int(0), &[f32s(&shape, &a), f32s(&shape, &a)]).unwrap();
    assert_eq!(pull(&kv, &Key::Int(0), &shape), vec![12.0; n]); // 2 * (1 + 2 + 3)

    let schemes = [
        params(&[("compress", "2bit"), ("threshold", "0.3")]),
        params(&[("compress", "qsgd_mn"), ("bits", "2"), ("seed", "4")]),
        params(&[("compress", "qsgd_mn_ts"), ("bits", "[2, 6]")]),
        params(&[("compress", "qsgd_mn_ms"), ("bits", "[1, 3, 8]")]),
        params(&[("compress", "grandk_mn"), ("bits", "4"), ("k", "17")]),
        params(&[("compress", "grandk_mn_ts"), ("bits", "[2, 4]"), ("k", "30")]),
        params(&[("compress", "powersgd"), ("rank", "2")]),
        params(&[("compress", "1bit"), ("threshold", "0.1")]),
    ];
    for (s, c) in schemes.iter().enumerate() {
        let key = Key::Int(10 + s as i64);
        // Compression comes before init: a store per scheme (one MPI world).
        let kv = MpiStore::join().unwrap();
        kv.local().set_compress(*c).unwrap();
        kv.init(&key, f32s(&shape, &vec![0.0; n])).unwrap();
        let device = KVStore::new("device").unwrap();
        device.set_compress(*c).unwrap();
        device.init(&key, f32s(&shape, &vec![0.0; n])).unwrap();
        let raw = kv.local().stats();
        for step in 0..4 {
            let g = grad(rank, step, n);
            kv.push(&key, &[f32s(&shape, &g)]).unwrap();
            let all: Vec<Vec<f32>> = (0..workers).map(|w| grad(w, step, n)).collect();
            let arrays: Vec<Array> = all.iter().map(|g| f32s(&shape, g)).collect();
            device.push(&key, &arrays).unwrap();
            let (got, want) = (pull(&kv, &key, &shape), pull(&device, &key, &shape));
            if let Compression::PowerSgd { .. } = c {
                // float32 sums in MPI's order: equal to rounding
                for (x, y) in got.iter().zip(&want) {
                    assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{} step {step}: {x} vs {y}", c.name());
                }
            } else {
                assert_eq!(got, want, "{} step {step}", c.name());
            }
        }
        let stats = kv.local().stats();
        let (raw_b, wire_b) = (stats.raw_bytes - raw.raw_bytes, stats.wire_bytes - raw.wire_bytes);
        // Counted alike: through a scheme, the device store's devices hand
        // their group what each rank hands MPI. (2-bit differs by design: the
        // device store moves packed blocks, MPI sums code counts in lanes.)
        if c.is_scheme() {
            assert_eq!(device.stats().wire_bytes, WORKERS as u64 * wire_b, "{}: device store vs MPI bytes", c.name());
        }
        if rank == 0 {
            println!("{:>13}: {wire_b} bytes sent for {raw_b} float32 bytes ({:.1}x)", c.name(), raw_b as f64 / wire_b as f64);
        }
        if !matches!(c, Compression::PowerSgd { .. }) {
            assert!(wire_b * 3 < raw_b, "{}: {wire_b} of {raw_b}", c.name());
        }
    }
    println!("rank done");
}

#[test]
fn mismatched_pushes_fail_on_every_worker_and_the_store_recovers() {
    if !under_mpi() {
        return mpirun("mismatched_pushes_fail_on_every_worker_and_the_store_recovers");
    }
    let kv = MpiStore::join().unwrap();
    let rank = kv.rank();
    let shape = [8usize];
    kv.local().set_compress(params(&[("compress", "qsgd_mn"), ("bits", "4")])).unwrap();
    for k in 0..2 {
        kv.init(&Key::Int(k), f32s(&shape, &[1.0; 8])).unwrap();
    }
    let err = kv.local().set_compress(params(&[("compress", "2bit"), ("threshold", "0.5")])).unwrap_err().to_string();
    assert_eq!(err, "set the gradient compression before initializing any key (2 already initialized)");
    // rank 1 pushes another key: nobody hangs, everyone gets the error
    let key = Key::Int(if rank == 1 { 1 } else { 0 });
    let err = kv.push(&key, &[f32s(&shape, &[0.5; 8])]).unwrap_err().to_string();
    assert!(err.contains("workers disagree on the push of key"), "{err}");
    // a bad shape on one worker: that worker says why, the others that it disagreed, and why
    let bad = [if rank == 2 { 4usize } else { 8 }];
    let err = kv.push(&Key::Int(0), &[f32s(&bad, &vec![0.5; bad[0]])]).unwrap_err().to_string();
    if rank == 2 {
        assert!(err.contains("has shape [4]"), "{err}");
    } else {
        assert!(err.contains("workers disagree") && err.contains("worker rank 2: ") && err.contains("has shape [4]"), "{err}");
    }
    // a non-finite gradient on one worker fails the push everywhere, values untouched
    let g = if rank == 0 { [f32::NAN; 8] } else { [0.5; 8] };
    let err = kv.push(&Key::Int(0), &[f32s(&shape, &g)]).unwrap_err().to_string();
    assert!(err.contains("key 0: pushed value 0 holds NaN at element 0, a non-finite value"), "{err}");
    // (QSGD's scale found it only inside the round, naming no worker.)
    assert!(rank == 0 || err.contains("workers disagree on the push of key 0") && err.contains("worker rank 0: "), "{err}");
    assert_eq!(pull(&kv, &Key::Int(0), &shape), vec![1.0; 8]);
    // then a matched push works: 3 workers * 0.5, exact at 4 bits (scale 0.5: codes 15)
    kv.push(&Key::Int(0), &[f32s(&shape, &[0.5; 8])]).unwrap();
    assert_eq!(pull(&kv, &Key::Int(0), &shape), vec![1.5; 8]);

    // 2-bit: rank 1's inf at element 3 fails every worker's push (rank 1 names
    // the element), before any residual or value changes; the next push is exact.
    let two = MpiStore::join().unwrap();
    two.local().set_compress(params(&[("compress", "2bit"), ("threshold", "0.5")])).unwrap();
    two.init(&Key::from("w"), f32s(&shape, &[0.0; 8])).unwrap();
    two.push(&Key::from("w"), &[f32s(&shape, &[0.25; 8])]).unwrap(); // below the threshold: residual 0.25
    assert_eq!(pull(&two, &Key::from("w"), &shape), vec![0.0; 8]);
    let residual = two.residual(&Key::from("w"), 0).unwrap();
    assert_eq!(residual, vec![0.25; 8]);
    let mut g = [0.25f32; 8];
    if rank == 1 {
        g[3] = f32::INFINITY;
    }
    let err = two.push(&Key::from("w"), &[f32s(&shape, &g)]).unwrap_err().to_string();
    if rank == 1 {
        assert!(err.contains("key 'w'") && err.contains("inf at element 3"), "{err}");
    } else {
        assert!(err.contains("workers disagree on the push of key 'w'") && err.contains("worker rank 1: ") && err.contains("inf at element 3"), "{err}");
    }
    assert_eq!(two.residual(&Key::from("w"), 0).unwrap(), residual);
    assert_eq!(pull(&two, &Key::from("w"), &shape), vec![0.0; 8]);
    two.push(&Key::from("w"), &[f32s(&shape, &[0.25; 8])]).unwrap(); // 0.5 per worker: 3 * 0.5
    assert_eq!(pull(&two, &Key::from("w"), &shape), vec![1.5; 8]);
    kv.barrier().unwrap();
    println!("rank done");
}

/// The mismatches that used to hang, truncate or silently diverge: each is an
/// error on every rank, naming what differs, and no rank waits forever.
#[test]
fn every_mismatch_between_ranks_is_an_error_on_every_rank() {
    if !under_mpi() {
        return mpirun("every_mismatch_between_ranks_is_an_error_on_every_rank");
    }
    use gradpack::optimizer::Optimizer;
    let shape = [8usize];
    let store = |compress: Compression| {
        let kv = MpiStore::join().unwrap();
        kv.local().set_compress(compress).unwrap();
        kv.init(&Key::Int(0), f32s(&shape, &[1.0; 8])).unwrap();
        kv
    };
    let kv = store(Compression::None);
    let rank = kv.rank();
    let g = [0.5f32; 8];

    // A push of a key that rank 1 never initialised: rank 1 still takes part.
    let key = Key::Int(if rank == 1 { 99 } else { 0 });
    let err = kv.push(&key, &[f32s(&shape, &g)]).unwrap_err().to_string();
    if rank == 1 {
        assert!(err.contains("key 99: not initialized"), "{err}");
    } else {
        assert!(err.contains("workers disagree on the push of key 0") && err.contains("key, shape differ") && err.contains("worker rank 1: key 99: not initialized"), "{err}");
    }
    // An init on rank 0 only, while the others push: the operations differ.
    let err = if rank == 0 { kv.init(&Key::Int(50), f32s(&shape, &g)) } else { kv.push(&Key::Int(0), &[f32s(&shape, &g)]) }.unwrap_err().to_string();
    assert!(err.contains("another worker is in another operation"), "rank {rank}: {err}");
    // An optimizer on rank 2 only.
    if rank == 2 {
        kv.local().set_optimizer(Optimizer::from_params("sgd", [("learning_rate", "0.1")]).unwrap());
    }
    let err = kv.push(&Key::Int(0), &[f32s(&shape, &g)]).unwrap_err().to_string();
    assert!(err.contains("the workers' optimizer differ"), "rank {rank}: {err}");
    assert_eq!(pull(&kv, &Key::Int(0), &shape), vec![1.0; 8]); // nothing changed anywhere

    // A barrier on rank 0 while the others push (rank 0 pushed fewer times):
    // both used to hang; now an error on every rank, nothing applied.
    let err = if rank == 0 { kv.barrier() } else { kv.push(&Key::Int(0), &[f32s(&shape, &g)]) }.unwrap_err().to_string();
    assert!(err.contains("another worker is in another operation") && err.contains("a barrier"), "rank {rank}: {err}");
    assert_eq!(pull(&kv, &Key::Int(0), &shape), vec![1.0; 8]);
    kv.barrier().unwrap(); // and a barrier of every rank still passes

    // Different compression (2-bit thresholds on rank 0, or another scheme): refused at init.
    for other in [Compression::from_params([("compress", "2bit"), ("threshold", "0.25")]).unwrap(), Compression::from_params([("compress", "qsgd_mn"), ("bits", "4")]).unwrap()] {
        let mine = if rank == 0 { other } else { Compression::from_params([("compress", "2bit"), ("threshold", "0.5")]).unwrap() };
        let s = MpiStore::join().unwrap();
        s.local().set_compress(mine).unwrap();
        let err = s.init(&Key::Int(0), f32s(&shape, &g)).unwrap_err().to_string();
        assert!(err.contains("the workers' compression differ"), "rank {rank}: {err}");
        s.close().unwrap();
    }

    // One push more on rank 0 while the others close: an error, not a hang.
    let s = store(Compression::None);
    s.push(&Key::Int(0), &[f32s(&shape, &g)]).unwrap();
    if rank == 0 {
        let err = s.push(&Key::Int(0), &[f32s(&shape, &g)]).unwrap_err().to_string();
        assert!(err.contains("another worker closed its store"), "{err}");
        assert!(s.push(&Key::Int(0), &[f32s(&shape, &g)]).unwrap_err().to_string().contains("is closed"));
        s.close().unwrap(); // closed already: no collective, no wait
    } else {
        assert!(s.close().is_err()); // rank 0 was pushing
    }
    assert_eq!(pull(&s, &Key::Int(0), &shape), vec![1.5; 8]); // the one complete push: 3 x 0.5
    kv.close().unwrap();
    println!("rank done");
}

/// Every scheme's compression state survives a checkpoint on the MPI store:
/// each rank saves its own after 3 of 6 pushes, and a fresh store that loads
/// it continues bit for bit as the uninterrupted one.
#[test]
fn a_checkpoint_resumes_every_scheme_bit_for_bit() {
    if !under_mpi() {
        return mpirun("a_checkpoint_resumes_every_scheme_bit_for_bit");
    }
    let shape = [6usize, 10];
    let n = 60;
    let schemes = [
        params(&[("compress", "2bit"), ("threshold", "0.3")]),
        params(&[("compress", "qsgd_mn"), ("bits", "2"), ("seed", "4")]),
        params(&[("compress", "qsgd_mn_ms"), ("bits", "[1, 3, 8]")]),
        params(&[("compress", "grandk_mn"), ("bits", "4"), ("k", "17")]),
        params(&[("compress", "powersgd"), ("rank", "2")]),
        params(&[("compress", "1bit"), ("threshold", "0.1")]),
    ];
    let key = Key::Int(1);
    for c in schemes {
        let make = |value: &[f32]| {
            let kv = MpiStore::join().unwrap();
            kv.local().set_compress(c).unwrap();
            kv.init(&key, f32s(&shape, value)).unwrap();
            kv
        };
        let (straight, first) = (make(&vec![0.5; n]), make(&vec![0.5; n]));
        let rank = straight.rank();
        for step in 0..3 {
            straight.push(&key, &[f32s(&shape, &grad(rank, step, n))]).unwrap();
            first.push(&key, &[f32s(&shape, &grad(rank, step, n))]).unwrap();
        }
        let blob = first.save_compression_states().unwrap();
        let resumed = make(&pull(&first, &key, &shape));
        resumed.load_compression_states(&blob).unwrap();
        for step in 3..6 {
            straight.push(&key, &[f32s(&shape, &grad(rank, step, n))]).unwrap();
            resumed.push(&key, &[f32s(&shape, &grad(rank, step, n))]).unwrap();
        }
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        assert_eq!(bits(pull(&resumed, &key, &shape)), bits(pull(&straight, &key, &shape)), "{} rank {rank}", c.name());
        for kv in [straight, first, resumed] {
            kv.close().unwrap();
        }
    }
    println!("rank done");
}

/// What an attacker's audit found the agreement let through, each now an
/// error on every rank with nothing applied anywhere: optimizer settings
/// that differ (learning rate, wd, scaling, a key's rates), shapes of one
/// size, an int key and a str key of the same bytes, a caller's updater
/// that fails on one rank, and calls refused before the agreement
/// (pushpull's and broadcast's outputs, a front's own checks); and a
/// barrier that meets another rank's close (the job hung at exit).
#[test]
fn settings_shapes_updates_and_refusals_that_differ_fail_every_rank_alike() {
    if !under_mpi() {
        return mpirun("settings_shapes_updates_and_refusals_that_differ_fail_every_rank_alike");
    }
    use gradpack::optimizer::Optimizer;
    use gradpack::store::Updater;
    let shape = [8usize];
    let g = [0.5f32; 8];
    let kv = MpiStore::join().unwrap();
    let rank = kv.rank();
    kv.init(&Key::Int(0), f32s(&shape, &[1.0; 8])).unwrap();
    let sgd = |lr: &str, wd: &str| Optimizer::from_params("sgd", [("learning_rate", lr), ("wd", wd)]).unwrap();

    // Another learning rate, wd, gradient scaling or key rate on rank 1.
    for case in ["lr", "wd", "scaling", "rates"] {
        kv.local().set_optimizer(if rank == 1 && case == "lr" { sgd("0.5", "0") } else if rank == 1 && case == "wd" { sgd("0.1", "0.01") } else { sgd("0.1", "0") });
        if case == "scaling" {
            kv.set_grad_scaling(if rank == 1 { 0.5 } else { 1.0 }, -1.0).unwrap();
        }
        if case == "rates" {
            kv.set_rates(&Key::Int(0), if rank == 1 { 0.2 } else { 0.1 }, 0.0).unwrap();
        }
        let err = kv.push(&Key::Int(0), &[f32s(&shape, &g)]).unwrap_err().to_string();
        assert!(err.contains("the workers' optimizer differ"), "{case} rank {rank}: {err}");
        assert_eq!(pull(&kv, &Key::Int(0), &shape), vec![1.0; 8], "{case}");
    }
    kv.local().set_optimizer(sgd("0.1", "0"));
    kv.push(&Key::Int(0), &[f32s(&shape, &g)]).unwrap(); // alike: 1 - 0.1 * 1.5
    assert_eq!(pull(&kv, &Key::Int(0), &shape), vec![1.0 - 0.1 * 1.5; 8]);

    // A caller's updater that fails on rank 2 alone, after the sum: every
    // rank's push fails and is put back; then a push of every rank works.
    let fail = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(rank == 2));
    let failing = fail.clone();
    kv.set_updater(Updater::Custom(Box::new(move |_key, merged, stored| {
        if failing.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(gradpack::error::Error::Store("the caller's updater failed".into()));
        }
        stored.iter_mut().zip(merged).for_each(|(s, m)| *s += m);
        Ok(())
    })))
    .unwrap();
    let before = pull(&kv, &Key::Int(0), &shape);
    let err = kv.push(&Key::Int(0), &[f32s(&shape, &g)]).unwrap_err().to_string();
    if rank == 2 {
        assert!(err.contains("the caller's updater failed"), "{err}");
    } else {
        assert!(err.contains("workers disagree on the update of key 0") && err.contains("worker rank 2: ") && err.contains("the caller's updater failed"), "rank {rank}: {err}");
    }
    assert_eq!(pull(&kv, &Key::Int(0), &shape), before);
    fail.store(false, std::sync::atomic::Ordering::SeqCst);
    kv.push(&Key::Int(0), &[f32s(&shape, &g)]).unwrap();
    assert_eq!(pull(&kv, &Key::Int(0), &shape), before.iter().map(|b| b + 1.5).collect::<Vec<_>>());

    // pushpull into an output of another shape on rank 1: every rank's call
    // fails, and the next pushpull pairs with the next (it took rank 1's next gradient).
    let plain = MpiStore::join().unwrap();
    plain.init(&Key::Int(0), f32s(&shape, &[0.0; 8])).unwrap();
    let (mut out, mut wrong) = (vec![0f32; 8], vec![0f32; 5]);
    let bad = if rank == 1 { ArrayMut { shape: &[5], data: &mut wrong } } else { ArrayMut { shape: &shape, data: &mut out } };
    let err = plain.pushpull(&Key::Int(0), &[f32s(&shape, &[1.0; 8])], &mut [bad]).unwrap_err().to_string();
    if rank != 1 {
        // (The refusal carries the key's own shape and count: nothing else differs.)
        assert!(err.contains("workers disagree on the push of key 0") && err.contains("worker rank 1: ") && !err.contains("differ"), "rank {rank}: {err}");
    }
    plain.pushpull(&Key::Int(0), &[f32s(&shape, &[10.0; 8])], &mut [ArrayMut { shape: &shape, data: &mut out }]).unwrap();
    assert_eq!(out, vec![30.0; 8]);
    // A front's own refusal (Store::refuse), of a push and of an init.
    let err = if rank == 0 {
        plain.refuse(Some(&Key::Int(0)), false, None, gradpack::error::Error::Store("float64 is not a dtype gradpack takes".into())).to_string()
    } else {
        plain.push(&Key::Int(0), &[f32s(&shape, &g)]).unwrap_err().to_string()
    };
    assert!(err.contains("float64 is not a dtype gradpack takes") && (rank == 0 || err.contains("worker rank 0: ")), "rank {rank}: {err}");
    let err = if rank == 0 {
        plain.refuse(Some(&Key::Int(5)), true, Some(&shape), gradpack::error::Error::Store("a list where an array goes".into())).to_string()
    } else {
        plain.init(&Key::Int(5), f32s(&shape, &g)).unwrap_err().to_string()
    };
    assert!(err.contains("a list where an array goes") && (rank == 0 || err.contains("workers disagree on the init of key 5")), "rank {rank}: {err}");
    assert!(plain.shape(&Key::Int(5)).is_err()); // no rank holds it
    // broadcast into an output of another shape on rank 2.
    let (mut out, mut wrong) = (vec![0f32; 8], vec![0f32; 3]);
    let bad = if rank == 2 { ArrayMut { shape: &[3], data: &mut wrong } } else { ArrayMut { shape: &shape, data: &mut out } };
    let err = plain.broadcast(&Key::Int(6), f32s(&shape, &g), &mut [bad]).unwrap_err().to_string();
    assert!(rank == 2 || err.contains("workers disagree on the init of key 6") && err.contains("worker rank 2: "), "rank {rank}: {err}");
    assert!(plain.shape(&Key::Int(6)).is_err());

    // Shapes of one size ((2, 4) on rank 1, (8,) elsewhere), under PowerSGD
    // (whose factors differ: the job aborted) and with no compression.
    for c in [params(&[("compress", "powersgd"), ("rank", "1")]), Compression::None] {
        let s = MpiStore::join().unwrap();
        s.local().set_compress(c).unwrap();
        let mine: &[usize] = if rank == 1 { &[2, 4] } else { &shape };
        let err = s.init(&Key::Int(0), f32s(mine, &g)).unwrap_err().to_string();
        assert!(err.contains("the workers' shape differ"), "rank {rank}: {err}");
        s.close().unwrap();
    }

    // The int key whose 8 bytes spell "weight00", and the str key "weight00".
    let s = MpiStore::join().unwrap();
    let key = if rank == 1 { Key::Int(i64::from_le_bytes(*b"weight00")) } else { Key::from("weight00") };
    assert_eq!(key.stable_hash(), Key::from("weight00").stable_hash());
    let err = s.init(&key, f32s(&shape, &g)).unwrap_err().to_string();
    assert!(err.contains("the workers' key differ"), "rank {rank}: {err}");
    s.close().unwrap();

    // Rank 0 closes while the others wait in a barrier: they learn that it
    // closed (it used to read as "another operation", and their close hung).
    let s = MpiStore::join().unwrap();
    if rank == 0 {
        assert!(s.close().is_err());
    } else {
        let err = s.barrier().unwrap_err().to_string();
        assert!(err.contains("another worker closed its store"), "rank {rank}: {err}");
        s.close().unwrap(); // closed already: no collective, no wait
    }
    for s in [kv, plain] {
        s.close().unwrap();
    }
    println!("rank done");
}
