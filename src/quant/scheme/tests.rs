use super::randomk::{count_ones, draw_selection, draw_selection_on, gather, positions, scatter, strata_counts, SPREAD_PIECE, STRATA_SALT, STRATUM};
use super::*;
use std::sync::Arc;
use crate::codec;
use crate::quant::compression::Compression;
use crate::quant::noise;
use super::threads::run_group;
use crate::quant::collective::InProcess;

fn params(p: &[(&str, &str)]) -> Compression {
    Compression::from_params(p.iter().copied()).unwrap()
}

fn grad(n: usize, seed: u64, amp: f32) -> Vec<f32> {
    (0..n).map(|i| (noise::uniform(seed, i as u64) - 0.5) * 2.0 * amp).collect()
}

/// Every member's aggregate of one push per step, with fresh states, each
/// member a worker on a thread of its own; and checks that the same members
/// folded in one thread (as a device store holds its devices) give the
/// same bits, except where unselected='local' keeps each worker's own.
fn run(c: &Compression, shape: &[usize], grads: &[Vec<f32>], steps: u64) -> Vec<Vec<Vec<f32>>> {
    let n: usize = shape.iter().product();
    let w = grads.len();
    let threaded = run_group(w, |m, coll| {
        let mut state = [State::default()];
        (0..steps)
            .map(|step| {
                let ctx = Ctx { shape, step, key_hash: 42, member: m as u64, workers: w };
                let mut out = vec![0f32; n];
                push_round(c, &mut state, &[&grads[m]], &ctx, coll, &mut out)?;
                Ok(out)
            })
            .collect::<Result<Vec<_>>>()
    })
    .unwrap();
    if !matches!(c, Compression::Qsgd(q) if q.keep_local) {
        assert_eq!(in_process(c, shape, grads, steps), threaded[0], "{}: one thread and {w} differ", c.name());
    }
    threaded
}

/// The aggregates of the same pushes with every member in one process.
fn in_process(c: &Compression, shape: &[usize], grads: &[Vec<f32>], steps: u64) -> Vec<Vec<f32>> {
    let n: usize = shape.iter().product();
    let w = grads.len();
    let mut states: Vec<State> = (0..w).map(|_| State::default()).collect();
    let views: Vec<&[f32]> = grads.iter().map(|g| &g[..]).collect();
    (0..steps)
        .map(|step| {
            let ctx = Ctx { shape, step, key_hash: 42, member: 0, workers: w };
            let mut out = vec![0f32; n];
            let mut group = InProcess::new(w);
            check_input(c, &states, &views, w).unwrap();
            push_round(c, &mut states, &views, &ctx, &mut group, &mut out).unwrap();
            out
        })
        .collect()
}

#[test]
fn qsgd_mn_is_exact_integer_sums_decoded_once_and_alike_everywhere() {
    let c = params(&[("compress", "qsgd_mn"), ("bits", "3"), ("seed", "9")]);
    let grads: Vec<Vec<f32>> = (0..3).map(|w| grad(101, w, 1.0 + w as f32)).collect();
    let out = run(&c, &[101], &grads, 2);
    let scale = grads.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
    for step in 0..2u64 {
        let mut acc = vec![0i32; 101];
        for (w, g) in grads.iter().enumerate() {
            let mut codes = vec![0i32; 101];
            qsgd::quantize(g, scale, 3, noise::stream_seed(9, step, 42, w as u64), &mut codes).unwrap();
            crate::quant::collective::add_codes(&mut acc, &codes).unwrap();
        }
        let mut want = vec![0f32; 101];
        qsgd::decode(&acc, scale, 3, &mut want).unwrap();
        for member in &out {
            assert_eq!(member[step as usize], want, "step {step}");
        }
    }
}

/// The mean aggregate over many steps (fresh noise each) against the true sum.
fn assert_unbiased(c: &Compression, grads: &[Vec<f32>], steps: u64, tol: f32) {
    let n = grads[0].len();
    let out = run(c, &[n], grads, steps);
    let truth: Vec<f32> = (0..n).map(|i| grads.iter().map(|g| g[i]).sum()).collect();
    for i in 0..n {
        let mean = out[0].iter().map(|o| o[i] as f64).sum::<f64>() / steps as f64;
        assert!((mean as f32 - truth[i]).abs() < tol, "{}: element {i}: mean {mean} vs {}", c.name(), truth[i]);
    }
}

#[test]
fn multi_scale_schemes_are_unbiased_and_use_fine_scales_for_small_values() {
    // One large element forces a coarse scale there; small ones fit the fine one.
    let mut grads: Vec<Vec<f32>> = (0..2).map(|w| grad(64, 7 + w, 0.05)).collect();
    grads[0][3] = 1.0;
    let ts = params(&[("compress", "qsgd_mn_ts"), ("bits", "[2, 6]"), ("seed", "1")]);
    let ms = params(&[("compress", "qsgd_mn_ms"), ("bits", "[2, 4, 6]"), ("seed", "1")]);
    let mn = params(&[("compress", "qsgd_mn"), ("bits", "2"), ("seed", "1")]);
    for c in [&ts, &ms] {
        assert_unbiased(c, &grads, 3000, 0.01);
    }
    // The same wire width as qsgd_mn at 2 bits, far less error.
    let err = |c: &Compression| -> f64 {
        let out = run(c, &[64], &grads, 50);
        let truth: Vec<f32> = (0..64).map(|i| grads[0][i] + grads[1][i]).collect();
        out[0].iter().flat_map(|o| o.iter().zip(&truth).map(|(a, b)| ((a - b) as f64).powi(2))).sum()
    };
    assert!(err(&ts) * 5.0 < err(&mn), "ts {} vs mn {}", err(&ts), err(&mn));
}

#[test]
fn variance_stays_within_the_coarsest_scale_bound() {
    // E||Q - sum g||^2 <= workers * n * (M / s_0)^2 / 4.
    let grads: Vec<Vec<f32>> = (0..2).map(|w| grad(500, 30 + w, 1.0)).collect();
    let c = params(&[("compress", "qsgd_mn_ts"), ("bits", "[2, 8]")]);
    let out = run(&c, &[500], &grads, 100);
    let scale = grads.iter().flatten().fold(0f32, |m, x| m.max(x.abs())) as f64;
    let truth: Vec<f32> = (0..500).map(|i| grads[0][i] + grads[1][i]).collect();
    let mse = out[0].iter().map(|o| o.iter().zip(&truth).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>()).sum::<f64>() / 100.0;
    let bound = 2.0 * 500.0 * (scale / 3.0).powi(2) / 4.0;
    assert!(mse <= bound, "{mse} > {bound}");
}

#[test]
fn random_k_picks_the_same_coordinates_everywhere_without_sending_them() {
    let c = params(&[("compress", "grandk_mn"), ("bits", "4"), ("k", "10"), ("seed", "3")]);
    let Compression::Qsgd(q) = c else { unreachable!() };
    let a = selection(&q, 100, 5, 42).unwrap();
    assert_eq!(a.len(), 10);
    assert!(a.windows(2).all(|w| w[0] < w[1]) && a.iter().all(|&i| i < 100));
    assert_eq!(a, selection(&q, 100, 5, 42).unwrap());
    assert_ne!(a, selection(&q, 100, 6, 42).unwrap());
    assert_eq!(selection(&q, 10, 5, 42), None); // k >= n: every coordinate
    let grads: Vec<Vec<f32>> = (0..2).map(|w| grad(100, w, 1.0)).collect();
    let out = run(&c, &[100], &grads, 3);
    for step in 0..3 {
        let idx = selection(&q, 100, step, 42).unwrap();
        let o = &out[0][step as usize];
        assert_eq!(out[1][step as usize], *o);
        for i in 0..100 {
            if !idx.contains(&i) {
                assert_eq!(o[i], 0.0);
            } else {
                assert!((o[i] - grads[0][i] - grads[1][i]).abs() <= 2.0 * 1.0 / 15.0 + 1e-6);
            }
        }
    }
    // The paper's behaviour, on request: each worker keeps its own gradient elsewhere.
    let local = params(&[("compress", "grandk_mn_ts"), ("bits", "[2, 4]"), ("k", "10"), ("seed", "3"), ("unselected", "local")]);
    let out = run(&local, &[100], &grads, 1);
    let idx = selection(&q, 100, 0, 42).unwrap();
    for m in 0..2 {
        for i in (0..100).filter(|i| !idx.contains(i)) {
            assert_eq!(out[m][0][i], grads[m][i]);
        }
    }
    // Members in one process are one worker: its own gradient is their sum.
    let one = in_process(&local, &[100], &grads, 1);
    for i in (0..100).filter(|i| !idx.contains(i)) {
        assert_eq!(one[0][i], grads[0][i] + grads[1][i]);
    }
    assert!(idx.iter().all(|&i| one[0][i] == out[0][0][i]));
}

#[test]
fn powersgd_keeps_what_it_missed_and_recovers_low_rank_sums() {
    let c = params(&[("compress", "powersgd"), ("rank", "1"), ("seed", "2")]);
    let (rows, cols) = (8, 6);
    let grads: Vec<Vec<f32>> = (0..2).map(|w| grad(rows * cols, 50 + w, 1.0)).collect();
    run_group(2, |m, coll| {
        let mut state = [State::default()];
        let mut sent = vec![0f64; rows * cols];
        for step in 0..6 {
            let ctx = Ctx { shape: &[rows, cols], step, key_hash: 42, member: m as u64, workers: 2 };
            let mut out = vec![0f32; rows * cols];
            // error feedback on this member: what it put in = what it sent locally + residual
            let before = state[0].residual.clone();
            let (ex, mut part) = encode(&c, &mut state, &[&grads[m]], &ctx, coll)?;
            let Part::F32(q_local) = &part else { unreachable!() };
            let mut p_hat = match &ex[0] {
                Part::F32(p) => p.clone(),
                _ => unreachable!(),
            };
            powersgd::orthogonalize(&mut p_hat, rows, 1);
            let mut local_approx = vec![0f32; rows * cols];
            powersgd::p_times_qt(&p_hat, q_local, rows, cols, 1, &mut local_approx, false);
            // nothing committed before `finish`
            assert_eq!(state[0].residual, before);
            sum_final(&mut part, coll)?;
            decode(&c, &ex, &part, &ctx, &mut out)?;
            finish(&c, &mut state, part);
            for i in 0..rows * cols {
                let input = grads[m][i] + before.get(i).copied().unwrap_or(0.0);
                assert!((input - local_approx[i] - state[0].residual[i]).abs() < 1e-5);
            }
            sent.iter_mut().zip(&out).for_each(|(s, o)| *s += *o as f64);
        }
        Ok(())
    })
    .unwrap();
    // A sum of rank-1 gradients with the same left factor is rank 1: recovered.
    let u: Vec<f32> = (0..rows).map(|i| i as f32 - 3.0).collect();
    let grads: Vec<Vec<f32>> = (0..2).map(|w| (0..rows * cols).map(|i| u[i / cols] * (((i % cols) + w) as f32 * 0.3).cos()).collect()).collect();
    let out = run(&c, &[rows, cols], &grads, 2);
    for i in 0..rows * cols {
        assert!((out[0][1][i] - grads[0][i] - grads[1][i]).abs() < 1e-4, "{i}");
    }
    // Vectors go uncompressed: the exact sum.
    let v: Vec<Vec<f32>> = (0..2).map(|w| grad(7, w, 1.0)).collect();
    let out = run(&c, &[7], &v, 1);
    assert_eq!(out[1][0], (0..7).map(|i| v[0][i] + v[1][i]).collect::<Vec<_>>());
}

/// PowerSGD's pushes of `grads[step][member]` on two members (threads),
/// each step's aggregate or error, and every member's state after each step.
fn powersgd_steps(c: &Compression, shape: &[usize], grads: &[Vec<Vec<f32>>]) -> Vec<Vec<(std::result::Result<Vec<f32>, String>, State)>> {
    let n: usize = shape.iter().product();
    run_group(2, |m, coll| {
        let mut state = [State::default()];
        Ok((0..grads.len())
            .map(|step| {
                let ctx = Ctx { shape, step: state[0].step, key_hash: 42, member: m as u64, workers: 2 };
                let mut out = vec![0f32; n];
                let g = &grads[step][m];
                let result = check_input(c, &state, &[g], 2).and_then(|()| push_round(c, &mut state, &[g], &ctx, coll, &mut out)).map(|()| out).map_err(|e| e.to_string());
                (result, state[0].clone())
            })
            .collect())
    })
    .unwrap()
}

/// Both members saw the same aggregates or errors, and hold the same Q.
fn same_on_both(got: &[Vec<(std::result::Result<Vec<f32>, String>, State)>]) {
    for (a, b) in got[0].iter().zip(&got[1]) {
        assert_eq!((&a.0, &a.1.q, a.1.step), (&b.0, &b.1.q, b.1.step), "members differ");
    }
}

#[test]
fn powersgd_draws_a_collapsed_q_anew_after_a_zero_push_and_a_spike() {
    let c = params(&[("compress", "powersgd"), ("rank", "1"), ("seed", "1")]);
    let (rows, cols) = (64, 32);
    let n = rows * cols;
    let random = |step: u64| (0..2).map(|m| grad(n, 100 * step + m, 1.0)).collect::<Vec<_>>();
    // A zero first push (LoRA's zero-initialised B gives A a zero gradient), then random ones.
    let grads: Vec<Vec<Vec<f32>>> = std::iter::once(vec![vec![0f32; n]; 2]).chain((1..4).map(random)).collect();
    let got = powersgd_steps(&c, &[rows, cols], &grads);
    same_on_both(&got);
    assert_eq!(got[0][0].0.as_ref().unwrap(), &vec![0f32; n]);
    // Step 1 starts from Q drawn from (seed, step 1, key): its aggregate, by hand.
    let q = powersgd::initial_q(cols, 1, noise::stream_seed(1, 1, 42, u64::MAX));
    let mut p = vec![0f32; rows];
    let mut mine = vec![0f32; rows];
    for g in &grads[1] {
        powersgd::m_times_q(g, &q, rows, cols, 1, &mut mine);
        p.iter_mut().zip(&mine).for_each(|(a, b)| *a += b);
    }
    powersgd::orthogonalize(&mut p, rows, 1);
    let (mut q_sum, mut q_one) = (vec![0f32; cols], vec![0f32; cols]);
    for g in &grads[1] {
        powersgd::mt_times_p(g, &p, rows, cols, 1, &mut q_one);
        q_sum.iter_mut().zip(&q_one).for_each(|(a, b)| *a += b);
    }
    let mut want = vec![0f32; n];
    powersgd::p_times_qt(&p, &q_sum, rows, cols, 1, &mut want, false);
    assert_eq!(got[0][1].0.as_ref().unwrap(), &want);
    assert!(want.iter().any(|v| v.abs() > 0.1));
    for step in 2..4 {
        let out = got[0][step].0.as_ref().unwrap();
        assert!(out.iter().all(|v| v.is_finite()) && out.iter().any(|v| v.abs() > 0.1), "step {step}");
    }
    // A 1e10 spike on one member: every later aggregate finite and alive.
    let mut grads: Vec<Vec<Vec<f32>>> = (0..6).map(random).collect();
    grads[1][1].iter_mut().for_each(|v| *v *= 1e10);
    let got = powersgd_steps(&c, &[rows, cols], &grads);
    same_on_both(&got);
    for (step, (out, state)) in got[0].iter().enumerate() {
        let out = out.as_ref().unwrap();
        assert!(out.iter().all(|v| v.is_finite()) && out.iter().any(|v| v.abs() > 0.01), "step {step}: {:?}", &out[..4]);
        assert!(powersgd::column_alive(&state.q, cols, 1, 0), "step {step}");
    }
}

#[test]
fn powersgd_refuses_a_non_finite_factor_sum_on_every_member_and_changes_no_state() {
    let c = params(&[("compress", "powersgd"), ("rank", "2"), ("seed", "3")]);
    let (rows, cols) = (16, 12);
    let n = rows * cols;
    // Finite gradients whose P = M Q passes float32's range.
    let grads = vec![vec![grad(n, 1, 1.0), grad(n, 2, 1.0)], vec![vec![3e38f32; n], vec![3e38f32; n]], vec![grad(n, 3, 1.0), grad(n, 4, 1.0)]];
    let got = powersgd_steps(&c, &[rows, cols], &grads);
    same_on_both(&got);
    for m in 0..2 {
        let err = got[m][1].0.as_ref().unwrap_err();
        assert!(err.contains("PowerSGD: the workers' sum of P holds") && err.contains("non-finite"), "{err}");
        let (before, after) = (&got[m][0].1, &got[m][1].1);
        assert_eq!((&after.residual, &after.q, after.step), (&before.residual, &before.q, before.step), "member {m}'s state changed");
        assert!(got[m][2].0.is_ok());
    }
    // A Q sum that is not finite (a faulty worker's part): the same error at decode, for everyone.
    let ctx = Ctx { shape: &[rows, cols], step: 0, key_hash: 42, member: 0, workers: 2 };
    let mut q = vec![0.5f32; cols * 2];
    q[5] = f32::NAN;
    let err = decode(&c, &[Part::F32(vec![1.0; rows * 2])], &Part::F32(q), &ctx, &mut vec![0f32; n]).unwrap_err().to_string();
    assert!(err.contains("sum of Q holds NaN at element 5"), "{err}");
    let err = decode(&c, &[Part::F32(vec![f32::INFINITY; rows * 2])], &Part::F32(vec![0.5; cols * 2]), &ctx, &mut vec![0f32; n]).unwrap_err().to_string();
    assert!(err.contains("sum of P holds inf at element 0"), "{err}");
}

#[test]
fn two_bit_through_the_scheme_path_counts_indicators_alike_in_one_thread_and_many() {
    let c = params(&[("compress", "2bit"), ("threshold", "0.5")]);
    // One piece, and several parallel pieces with a partial last block.
    for n in [70, 2 * crate::par::CHUNK + 70] {
        let grads: Vec<Vec<f32>> = (0..3).map(|w| grad(n, 20 + w, 0.9)).collect();
        let out = run(&c, &[n], &grads, 3); // `run` also checks one thread against three
        let Compression::TwoBit(th) = c else { unreachable!() };
        let mut residuals = vec![vec![0f32; n]; 3];
        for step in 0..3 {
            let mut want = vec![0f32; n];
            for (g, r) in grads.iter().zip(residuals.iter_mut()) {
                let mut compr = codec::create_2bit(n);
                codec::quantize_2bit(g, r, &mut compr, th).unwrap();
                codec::dequantize_2bit_add(&compr, &mut want).unwrap();
            }
            assert_eq!(out[0][step], want, "n={n} step {step}");
        }
    }
}

/// 1-bit's and 2-bit's rule for one element, written out: (code, next
/// residual), 2-bit's from the codec's reference with its lane codes (1 at
/// +pos, `b` at neg).
fn error_feedback(c: &Compression, g: f32, r: f32, b: i32) -> (i32, f32) {
    match c {
        Compression::TwoBit(th) => {
            let (code, next) = codec::reference::quantize_one(r, g, *th);
            ([0, 1, b][code as usize], next)
        }
        Compression::OneBit { threshold } => {
            let x = r + g;
            if x > *threshold { (1, x - 1.0) } else { (0, x + 1.0) }
        }
        _ => unreachable!("no other scheme keeps a residual by this rule"),
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|x| x.to_bits()).collect()
}

/// Every member's (residual, Q, step), bit for bit.
fn snapshot(states: &[State]) -> Vec<(Vec<u32>, Vec<u32>, u64)> {
    states.iter().map(|s| (bits(&s.residual), bits(&s.q), s.step)).collect()
}

#[test]
fn one_and_two_bit_commit_the_codecs_residuals_in_finish_and_an_unfinished_push_changes_nothing() {
    let n = 1037; // whole lane groups and a tail
    let two_bit = Compression::TwoBit(codec::Thresholds::new(-0.3, 0.45).unwrap());
    for c in [two_bit, params(&[("compress", "1bit"), ("threshold", "0.1")])] {
        let mut states = [State::default(), State::default()];
        // The committed residuals by the rule (none before a push is finished).
        let mut want: Vec<Vec<f32>> = vec![Vec::new(); 2];
        // Pushes 0 and 3 end after encode (another rank's gradient was not
        // finite): the first of all, and one after finished pushes.
        for push in 0..6u64 {
            let grads: Vec<Vec<f32>> = (0..2).map(|m| grad(n, 10 * push + m, 0.8)).collect();
            let views: Vec<&[f32]> = grads.iter().map(|g| &g[..]).collect();
            let ctx = Ctx { shape: &[n], step: states[0].step, key_hash: 7, member: 0, workers: 2 };
            let mut group = InProcess::new(2);
            let before = snapshot(&states);
            check_input(&c, &states, &views, 2).unwrap();
            let (exchanged, mut part) = encode(&c, &mut states, &views, &ctx, &mut group).unwrap();
            assert!(snapshot(&states) == before, "{} push {push}: encode changed a state", c.name());
            // The codes: the rule on each member from its committed residual.
            let &Part::Packed { hi: b, .. } = &part else { panic!("{}: a final part that is not packed", c.name()) };
            let (mut codes, mut next) = (vec![0i32; n], want.clone());
            for (g, r) in grads.iter().zip(next.iter_mut()) {
                r.resize(n, 0.0); // a first push starts from zeros
                for (i, (code, r)) in codes.iter_mut().zip(r.iter_mut()).enumerate() {
                    let (one, x) = error_feedback(&c, g[i], *r, b);
                    (*code, *r) = (*code + one, x);
                }
            }
            assert!(part.unpacked().unwrap().into_owned() == Part::Codes { codes, lo: 0, hi: b }, "{} push {push}: codes other than the rule's", c.name());
            if push % 3 == 0 {
                continue; // dropped unfinished
            }
            sum_final(&mut part, &mut group).unwrap();
            finish(&c, &mut states, part);
            recycle(&mut states, exchanged);
            want = next;
            let step = before[0].2 + 1;
            assert!(snapshot(&states) == want.iter().map(|r| (bits(r), Vec::new(), step)).collect::<Vec<_>>(), "{} push {push}: finish committed other residuals", c.name());
        }
        // An unfinished push's next residual is never committed by a later
        // push that keeps none (here QSGD's).
        let (g, before) = (grad(n, 99, 0.8), snapshot(&states));
        let ctx = Ctx { shape: &[n], step: states[0].step, key_hash: 7, member: 0, workers: 2 };
        drop(encode(&c, &mut states, &[&g, &g], &ctx, &mut InProcess::new(2)).unwrap());
        let qsgd = params(&[("compress", "qsgd_mn"), ("bits", "4")]);
        push_round(&qsgd, &mut states, &[&g, &g], &ctx, &mut InProcess::new(2), &mut vec![0f32; n]).unwrap();
        assert!(snapshot(&states) == before.into_iter().map(|(r, q, step)| (r, q, step + 1)).collect::<Vec<_>>(), "{}: a stale next residual was committed", c.name());
    }
}

#[test]
fn a_compression_built_directly_is_checked_as_its_parameters_are() {
    // Public fields bypass from_params: PowerSGD's rank 0 panicked in its
    // round ("chunk size must be non-zero"); k = 0 and a NaN threshold were taken.
    let g = [1.0f32, 2.0, 3.0, 4.0];
    let mut grandk = match params(&[("compress", "grandk_mn"), ("bits", "4"), ("k", "2")]) {
        Compression::Qsgd(q) => q,
        _ => unreachable!(),
    };
    grandk.k = Some(0);
    assert!(crate::quant::compression::Qsgd::new("grandk_mn", &[4], 0, Some(0), false).unwrap_err().to_string().contains("'k'"));
    for (c, want) in [
        (Compression::PowerSgd { rank: 0, seed: 0 }, "'rank'"),
        (Compression::PowerSgd { rank: 1025, seed: 0 }, "'rank'"),
        (Compression::OneBit { threshold: f32::NAN }, "'threshold'"),
        (Compression::Qsgd(grandk), "'k'"),
    ] {
        let err = check_input(&c, &[], &[&g], 1).unwrap_err().to_string();
        assert!(err.contains(want), "{c:?}: {err}");
    }
}

#[test]
fn a_final_sum_whose_codes_no_members_could_send_is_malformed() {
    // from_wire checks codes only against the frame's own range: codes of
    // +-100 at 2 bits (s = 3) decoded to 33 times the scale, and 1-bit
    // lanes from -1000 to 3998.
    let shape = [2usize];
    let ctx = |workers| Ctx { shape: &shape, step: 0, key_hash: 1, member: 0, workers };
    let q = params(&[("compress", "qsgd_mn"), ("bits", "2")]);
    let hostile = from_wire(&to_wire(&Part::Codes { codes: vec![100, -100], lo: -100, hi: 100 })).unwrap();
    let mut out = [7f32; 2];
    let err = decode(&q, &[Part::F32(vec![1.0])], &hostile, &ctx(1), &mut out).unwrap_err().to_string();
    assert!(err.contains("malformed") && err.contains("codes -100..=100"), "{err}");
    let one = params(&[("compress", "1bit")]);
    let hostile = from_wire(&to_wire(&Part::Codes { codes: vec![1000, -1000], lo: -1000, hi: 1000 })).unwrap();
    assert!(decode(&one, &[], &hostile, &ctx(2), &mut out).unwrap_err().to_string().contains("malformed"));
    assert_eq!(out, [7.0; 2]);
    // The sums of 2 members' codes, sent as one frame (a server's pull), decode.
    let sum = from_wire(&to_wire(&Part::Codes { codes: vec![6, -6], lo: -6, hi: 6 })).unwrap();
    decode(&q, &[Part::F32(vec![1.0])], &sum, &ctx(2), &mut out).unwrap();
    assert_eq!(out, [2.0, -2.0]);
    assert!(decode(&q, &[Part::F32(vec![1.0])], &sum, &ctx(1), &mut out).is_err());
    // A shape whose product overflows is malformed, not a wrapped count.
    let huge = [1usize << 40, 1 << 40, 0];
    let ctx = Ctx { shape: &huge, step: 0, key_hash: 1, member: 0, workers: 1 };
    assert!(decode(&Compression::None, &[], &Part::F32(vec![]), &ctx, &mut []).unwrap_err().to_string().contains("more elements"));
}

#[test]
fn one_bit_sums_plus_minus_one() {
    let c = params(&[("compress", "1bit"), ("threshold", "0")]);
    let grads = vec![vec![0.5f32, -0.5, 0.1], vec![0.5, 0.5, -0.1], vec![-0.5, -0.5, 0.2]];
    let out = run(&c, &[3], &grads, 1);
    assert_eq!(out[2][0], vec![1.0, -1.0, 1.0]);
}

#[test]
fn check_input_names_the_member_and_element_of_a_non_finite_value() {
    let g0 = [1.0f32, 2.0, 3.0];
    let g1 = [1.0f32, f32::NEG_INFINITY, 3.0];
    // (2-bit through push_round took the -inf into its residual: the
    // stores' codec checks it, push_round did not.)
    for c in [params(&[("compress", "1bit")]), params(&[("compress", "powersgd"), ("rank", "1")]), params(&[("compress", "2bit"), ("threshold", "0.5")])] {
        let err = check_input(&c, &[], &[&g0, &g1], 2).unwrap_err().to_string();
        assert!(err.contains("pushed value 1 holds -inf at element 1"), "{}: {err}", c.name());
        check_input(&c, &[], &[&g0, &g0], 2).unwrap();
    }
    // QSGD: its shared scale catches it before any state changes, naming the member here.
    let q = params(&[("compress", "qsgd_mn"), ("bits", "2")]);
    check_input(&q, &[], &[&g0, &g1], 2).unwrap();
    let mut states = [State::default(), State::default()];
    let ctx = Ctx { shape: &[3], step: 0, key_hash: 1, member: 0, workers: 2 };
    let err = push_round(&q, &mut states, &[&g0, &g1], &ctx, &mut InProcess::new(2), &mut [0.0; 3]).unwrap_err().to_string();
    assert!(err.contains("pushed value 1 holds -inf at element 1"), "{err}");
    // 2-bit and 1-bit read residual + gradient.
    let mut s = State::default();
    s.residual = vec![0.0, f32::MAX, 0.0];
    let err = check_input(&params(&[("compress", "2bit"), ("threshold", "0.5")]), &[s], &[&[1.0, f32::MAX, 1.0]], 1).unwrap_err().to_string();
    assert!(err.contains("element 1"), "{err}");
    // Lengths and counts are checked for all.
    assert!(check_input(&params(&[("compress", "1bit")]), &[State::default(), State::default()], &[&g0], 2).is_err());
    assert!(check_input(&params(&[("compress", "1bit")]), &[], &[&g0, &g0[..2]], 2).is_err());
    let err = check_input(&params(&[("compress", "qsgd_mn"), ("bits", "8")]), &[], &[&g0], 1 << 30).unwrap_err().to_string();
    assert!(err.contains("could overflow the code sum"), "{err}");
}

#[test]
fn one_bit_refuses_a_residual_plus_gradient_that_overflows_and_changes_nothing() {
    // 1-bit quantizes r + g and keeps r + g -/+ 1: a finite gradient whose
    // sum with the residual overflows would make the residual infinite and
    // every later bit 1 (a silent wrong sum), so it is refused first.
    let c = params(&[("compress", "1bit")]);
    let big = [3e38f32, 1.0];
    let mut states = [State::default(), State::default()];
    let ctx = |step| Ctx { shape: &[2], step, key_hash: 5, member: 0, workers: 2 };
    check_input(&c, &states, &[&big, &big], 2).unwrap();
    let mut out = [0f32; 2];
    push_round(&c, &mut states, &[&big, &big], &ctx(0), &mut InProcess::new(2), &mut out).unwrap();
    assert_eq!(out, [2.0, 2.0]); // the sum over both members: +1 each
    let before = snapshot(&states);
    assert!(before.iter().all(|(r, _, _)| r.iter().all(|&x| f32::from_bits(x).is_finite())), "{before:?}");
    let err = check_input(&c, &states, &[&[1.0, 1.0], &big], 2).unwrap_err().to_string();
    assert!(err.contains("pushed value 1: residual + gradient is inf at element 0"), "{err}");
    assert!(snapshot(&states) == before);
    // A member without a state yet (a new device) is checked on its gradient alone.
    check_input(&c, &states[..1], &[&[1.0, 1.0], &big], 2).unwrap();
    // The stores' one-gradient rule (`check_pushed`) reads the same sum.
    let err = check_pushed(&c, &big, Some(&states[0]), "merged gradient").unwrap_err().to_string();
    assert!(err.contains("merged gradient: residual + gradient is inf at element 0"), "{err}");
    check_pushed(&c, &[-3e38, 1.0], Some(&states[0]), "merged gradient").unwrap();
}

#[test]
fn a_non_finite_gradient_fails_every_member_together() {
    let c = params(&[("compress", "qsgd_mn"), ("bits", "4")]);
    let grads = vec![vec![1.0f32, 2.0], vec![f32::NAN, 0.0]];
    let err = run_group(2, |m, coll| {
        let ctx = Ctx { shape: &[2], step: 0, key_hash: 1, member: m as u64, workers: 2 };
        push_round(&c, &mut [State::default()], &[&grads[m]], &ctx, coll, &mut [0.0; 2])
    })
    .unwrap_err();
    assert!(err.to_string().contains("non-finite"), "{err}");
}

#[test]
fn wire_parts_round_trip_packed_and_reject_corruption() {
    let parts = [
        Part::F32(vec![1.5, -0.0, 3.0]),
        Part::Levels { levels: vec![0, 2, 1, 2, 0], count: 3 },
        Part::Codes { codes: vec![-7, 7, 0, 3, -1], lo: -7, hi: 7 },
        Part::Codes { codes: vec![1, 0, 1], lo: 0, hi: 1 },
    ];
    for p in &parts {
        assert_eq!(&*from_wire(&to_wire(p)).unwrap().unpacked().unwrap(), p);
    }
    // 1000 codes of 4 bits (b = 3: 2s + 1 = 15 values) take 500 bytes, not 4000.
    let big = Part::Codes { codes: vec![-7; 1000], lo: -7, hi: 7 };
    assert_eq!(to_wire(&big).len(), 17 + 8 * 1000usize.div_ceil(16));
    let mut w = to_wire(&parts[1]);
    w[10] = 0xFF; // lane values 3 >= count
    assert!(from_wire(&w).unwrap_err().to_string().contains("not below 3"));
    assert!(from_wire(&to_wire(&parts[2])[..20]).is_err());
    assert!(from_wire(&[9; 12]).unwrap_err().to_string().contains("unknown exchange kind"));
    let mut bad_range = to_wire(&parts[2]);
    bad_range[9..13].copy_from_slice(&9i32.to_le_bytes()); // lo 9 > hi 7
    assert!(from_wire(&bad_range).is_err());
    // Claims of 2^40, 2^62 and 2^64-1 values in a short frame: errors before
    // any allocation of that size (once an abort, then a capacity panic).
    for n in [1u64 << 40, 1 << 62, u64::MAX] {
        for p in &parts[1..] {
            let mut w = to_wire(p);
            w[1..9].copy_from_slice(&n.to_le_bytes());
            let err = from_wire(&w).unwrap_err().to_string();
            assert!(err.starts_with("transport: malformed message: ") && err.contains("the frame carries"), "{err}");
        }
    }
    // The same inside a pull reply's scheme value.
    let mut w = to_wire(&parts[2]);
    w[1..9].copy_from_slice(&(1u64 << 62).to_le_bytes());
    let mut value = 0u64.to_le_bytes().to_vec();
    value.extend(1u32.to_le_bytes());
    value.extend((w.len() as u64).to_le_bytes());
    value.extend(&w);
    assert!(value_from_wire(&value).unwrap_err().to_string().contains("the frame carries"));
}

#[test]
fn the_seed_fixes_every_random_choice() {
    let grads: Vec<Vec<f32>> = (0..2).map(|w| grad(300, 60 + w, 1.0)).collect();
    for p in [
        vec![("compress", "qsgd_mn"), ("bits", "3")],
        vec![("compress", "qsgd_mn_ts"), ("bits", "[2, 5]")],
        vec![("compress", "grandk_mn"), ("bits", "4"), ("k", "50")],
        vec![("compress", "powersgd"), ("rank", "2")],
    ] {
        let with_seed = |seed: &'static str| {
            let mut q = p.clone();
            q.push(("seed", seed));
            run(&params(&q), &[20, 15], &grads, 2)
        };
        let (a, b, c) = (with_seed("1"), with_seed("1"), with_seed("2"));
        assert_eq!(a, b, "{p:?}");
        assert_ne!(a, c, "{p:?}");
    }
}

#[test]
fn scheme_values_travel_losslessly_with_their_sums_widened() {
    let exchanged = vec![Part::F32(vec![0.5]), Part::Levels { levels: vec![1, 0, 1], count: 2 }];
    let sum = Part::Codes { codes: vec![6, -6, 0], lo: -3, hi: 3 }; // two workers' codes in [-3, 3]
    let wire = value_to_wire(7, &exchanged, &sum, 2);
    let (step, ex, s) = value_from_wire(&wire).unwrap();
    assert_eq!((step, ex), (7, exchanged));
    assert_eq!(*s.unpacked().unwrap(), Part::Codes { codes: vec![6, -6, 0], lo: -6, hi: 6 });
    assert!(value_from_wire(&wire[..wire.len() - 1]).is_err());
    let mut extra = wire.clone();
    extra.push(0);
    assert!(value_from_wire(&extra).unwrap_err().to_string().contains("trailing"));
}

#[test]
fn a_server_sums_codes_in_packed_lanes_from_the_narrow_wire() {
    let (n, workers) = (1001usize, 3usize);
    let parts: Vec<Part> = (0..workers as i32).map(|w| Part::Codes { codes: (0..n as i32).map(|i| (i * 5 + w) % 15 - 7).collect(), lo: -7, hi: 7 }).collect();
    let wires: Vec<Vec<u8>> = parts.iter().map(to_wire).collect();
    assert!(wires.iter().all(|w| is_codes_wire(w)) && !is_codes_wire(&to_wire(&Part::F32(vec![1.0]))));
    let mut sum = LaneSum::first(&wires[0], workers).unwrap();
    for w in &wires[1..] {
        sum.add(w).unwrap();
    }
    let want: Vec<i32> = (0..n).map(|i| parts.iter().map(|p| if let Part::Codes { codes, .. } = p { codes[i] } else { 0 }).sum()).collect();
    let got = sum.into_part().unpacked().unwrap().into_owned();
    assert_eq!(got, Part::Codes { codes: want, lo: -7, hi: 7 });
    // The reply is the sum's usual wire form (lanes widened for 3 workers).
    assert_eq!(*from_wire(&sum_to_wire(&got, workers)).unwrap().unpacked().unwrap(), Part::Codes { codes: if let Part::Codes { codes, .. } = &got { codes.clone() } else { vec![] }, lo: -21, hi: 21 });
    // Refused, each leaving the sum as it was: a part with another range or
    // length, a code out of range, a truncated part, a fourth worker.
    let mut sum = LaneSum::first(&wires[0], workers).unwrap();
    assert!(sum.add(&to_wire(&Part::Codes { codes: vec![0; n], lo: -3, hi: 3 })).is_err());
    assert!(sum.add(&to_wire(&Part::Codes { codes: vec![0; n - 1], lo: -7, hi: 7 })).is_err());
    let mut high = parts[1].clone();
    if let Part::Codes { codes, .. } = &mut high {
        codes[1000] = 8; // packed as 15 in 4 bits, above the span 14
    }
    assert!(sum.add(&to_wire(&high)).unwrap_err().to_string().contains("above 14"));
    assert!(LaneSum::first(&to_wire(&high), workers).unwrap_err().to_string().contains("above 14"));
    assert!(sum.add(&wires[1][..40]).is_err());
    assert!(sum.add(&to_wire(&Part::F32(vec![1.0]))).is_err());
    sum.add(&wires[1]).unwrap();
    sum.add(&wires[2]).unwrap();
    assert!(sum.add(&wires[2]).unwrap_err().to_string().contains("more than 3 workers"));
    // A claim of 2^62 values in a short frame: an error before any allocation.
    let mut huge = wires[0].clone();
    huge[1..9].copy_from_slice(&(1u64 << 62).to_le_bytes());
    assert!(LaneSum::first(&huge, workers).is_err());
}

/// The definition of a selection, one draw at a time: each stratum's count
/// from the systematic points laid over the shares' remainders, then
/// Floyd's sampling in the stratum, draw `d` (for `j = m - c + d`) picking
/// `t = floor(u_d (j + 1))`, or `j` when `t` was picked already.
fn stratified(seed: u64, n: usize, k: usize) -> Vec<usize> {
    let u = (crate::hash::finalize(seed ^ STRATA_SALT) as u128 * n as u128) >> 64;
    let points: Vec<u128> = (0..k as u128).map(|i| u + i * n as u128).collect();
    let (mut picked, mut first, mut laid) = (Vec::new(), 0, 0u128);
    for base in (0..n).step_by(STRATUM) {
        let m = STRATUM.min(n - base);
        let rem = (k * m) as u128 % n as u128;
        let extra = points.iter().filter(|&&p| laid <= p && p < laid + rem).count();
        laid += rem;
        let c = k * m / n + extra;
        let mut mine = std::collections::BTreeSet::new();
        for (d, j) in (m - c..m).enumerate() {
            let t = ((noise::uniform(seed, (first + d) as u64) as f64 * (j + 1) as f64) as usize).min(j);
            if !mine.insert(t) {
                mine.insert(j);
            }
        }
        picked.extend(mine.into_iter().map(|i| base + i));
        first += c;
    }
    picked
}

#[test]
fn selection_draws_each_stratum_by_floyds_algorithm_one_at_a_time() {
    // One stratum, a whole one, one coordinate past it, a short last one,
    // strata of more than one block of draws (2048), most coordinates.
    let s = STRATUM;
    for (n, k) in [(10, 3), (100, 99), (5000, 2049), (s, 1), (s, s - 1), (s + 1, 1), (s + 1, s), (3 * s + 5, 2049), (3 * s + 5, 3 * s), (1 << 20, 1 << 16), (5 * s + 777, 5 * s + 776)] {
        let want = stratified(77, n, k);
        assert_eq!(want.len(), k);
        assert!(want.windows(2).all(|w| w[0] < w[1]) && want.iter().all(|&i| i < n));
        for isa in crate::isa::Isa::available() {
            let mut idx = vec![1, 2, 3]; // a recycled vector: resized first
            draw_selection_on(isa, 77, n, k, &mut idx);
            assert_eq!(idx, want, "{isa:?} n={n} k={k}");
        }
    }
    // Strata drawn on one thread or several: the same selection.
    let (n, k) = (5 * s + 777, 3 * s);
    for threads in [1, 3] {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        let mut idx = Vec::new();
        pool.install(|| draw_selection(79, n, k, &mut idx));
        assert_eq!(idx, stratified(79, n, k), "{threads} threads");
    }
}

#[test]
fn every_coordinate_is_selected_with_chance_k_over_n() {
    // Three whole strata and a short one of 1000, whose share 25.3 of the
    // 5000 rounds up with chance 0.3: counts are their shares rounded one
    // way or the other, summing to k; over 400 seeds each stretch of 1024
    // coordinates is picked k/n of the time, and the short stratum's count
    // rounds up about 0.3 of the time.
    let (n, k, seeds) = (3 * STRATUM + 1000, 5000, 400);
    let mut hits = vec![0usize; n.div_ceil(1024)];
    let mut ups = 0;
    for seed in 0..seeds {
        let counts = strata_counts(seed, n, k);
        assert_eq!(counts.iter().sum::<usize>(), k);
        for (s, &c) in counts.iter().enumerate() {
            let m = STRATUM.min(n - s * STRATUM);
            assert!(c == k * m / n || c == k * m / n + 1, "seed {seed} stratum {s}: {c}");
        }
        ups += usize::from(counts[3] == 26);
        let mut idx = Vec::new();
        draw_selection(seed, n, k, &mut idx);
        idx.iter().for_each(|&i| hits[i / 1024] += 1);
    }
    let up = ups as f64 / seeds as f64;
    assert!((up - 0.3).abs() < 0.1, "the short stratum rounded up {up} of the time");
    for (b, &h) in hits.iter().enumerate() {
        let width = 1024.min(n - b * 1024) as f64;
        let want = seeds as f64 * k as f64 / n as f64 * width;
        assert!((h as f64 - want).abs() < 0.01 * want + 5.0 * want.sqrt(), "stretch {b}: {h} hits, {want} expected");
    }
}

#[test]
fn selection_is_cached_by_what_it_is_a_function_of() {
    // Kept for the next call with the same (seed, step, key, n, k): the same allocation.
    let Compression::Qsgd(q) = params(&[("compress", "grandk_mn"), ("bits", "4"), ("k", "300")]) else { unreachable!() };
    let (a, b) = (selection(&q, 5000, 9, 1).unwrap(), selection(&q, 5000, 9, 1).unwrap());
    assert!(Arc::ptr_eq(&a, &b));
    let mut want = Vec::new();
    draw_selection(noise::stream_seed(q.seed, 9, 1, u64::MAX), 5000, 300, &mut want);
    assert_eq!(*a, want);
    // Evicted selections lend their memory to new draws, which still draw right.
    for step in 10..20 {
        let got = selection(&q, 5000, step, 1).unwrap();
        draw_selection(noise::stream_seed(q.seed, step, 1, u64::MAX), 5000, 300, &mut want);
        assert_eq!(*got, want, "step {step}");
    }
}

#[test]
fn a_bitset_reads_out_as_its_positions_on_every_isa() {
    // Words of every density: empty, one bit, 8 and 9 bits (the branch-free
    // eight and one more), all 64; in runs that end on each, and pieces too
    // short for the branch-free eight.
    let mut rng = crate::hash::SplitMix(15);
    let mut next = || rng.next_u64();
    let sparse = |r: u64, bits: u32| (0..bits).fold(0u64, |w, i| w | 1 << ((r >> (6 * i)) % 64));
    let mut words: Vec<u64> = vec![0, 1, 0xff, 0x1ff, u64::MAX, 1 << 63, 0xff00_0000_0000_0000, 0x8000_0000_0000_0001];
    words.extend((0..300).map(|i| match i % 5 {
        0 => 0,
        1 => next() & next() & next() & next(), // about 4 bits
        2 => sparse(next(), 9),
        3 => next(),
        _ => 1 << (next() % 64),
    }));
    for len in [0, 1, 2, 5, 8, 9, words.len()] {
        for end in [len, words.len()] {
            let w = &words[end - len..end];
            let want: Vec<usize> = (0..64 * w.len()).filter(|&i| w[i / 64] >> (i % 64) & 1 == 1).map(|i| i + 1000).collect();
            for isa in crate::isa::Isa::available() {
                assert_eq!(count_ones(isa, w), want.len(), "{isa:?}");
                let mut got = vec![usize::MAX; want.len()];
                positions(isa, w, 1000, &mut got);
                assert_eq!(got, want, "{isa:?} len={len} end={end}");
            }
        }
    }
}

#[test]
fn packed_codes_go_on_the_wire_as_their_unpacked_codes_do() {
    // 3 members' codes in [-3, 3] summed in lanes for 3 (the wire's width for
    // 3 workers: copied as they are) or for 5 (repacked).
    let n = 1001;
    let sums: Vec<i32> = (0..n as i32).map(|i| (i * 5) % 19 - 9).collect();
    for members in [3usize, 5] {
        let width = lanes::width_for(6 * members as u64);
        let words = lanes::pack_slice(&sums, width, |c| (c + 9) as u64);
        let packed = Part::Packed { words, n, lo: -3, hi: 3, count: 3, width };
        let codes = Part::Codes { codes: sums.clone(), lo: -3, hi: 3 };
        assert_eq!(*packed.unpacked().unwrap(), codes);
        assert_eq!(sum_to_wire(&packed, 3), sum_to_wire(&codes, 3), "members {members}");
        assert_eq!(*from_wire(&sum_to_wire(&packed, 3)).unwrap().unpacked().unwrap(), Part::Codes { codes: sums.clone(), lo: -9, hi: 9 });
    }
}

#[test]
fn gather_and_scatter_move_the_selected_coordinates_and_zero_the_rest() {
    for (n, k) in [(0usize, 0usize), (10, 0), (10, 10), (100, 7), (5 * SPREAD_PIECE + 3, 3 * SPREAD_PIECE + 1)] {
        let mut idx = Vec::new();
        draw_selection(3, n, k, &mut idx);
        let g: Vec<f32> = (0..n).map(|i| i as f32 + 0.5).collect();
        let mut vals = vec![9f32; 3]; // a recycled buffer: resized, every value written
        gather(&g, &idx, &mut vals);
        assert_eq!(vals, idx.iter().map(|&i| g[i]).collect::<Vec<_>>(), "n={n} k={k}");
        let mut out = vec![7f32; n];
        scatter(&idx, 0, &vals, &mut out);
        let mut want = vec![0f32; n];
        idx.iter().zip(&vals).for_each(|(&i, &v)| want[i] = v);
        assert_eq!(out, want, "n={n} k={k}");
    }
}

/// A key cut over servers: every scheme's round split by `pieces` and
/// decoded slice by slice (`decode_slice`) gives the bits of the whole
/// decode, for slices on and off lane-group boundaries, slices holding no
/// selected coordinate, and PowerSGD slices starting and ending mid-row.
#[test]
fn slices_decode_to_the_bits_of_the_whole() {
    let all: [&[(&str, &str)]; 8] = [
        &[("compress", "qsgd_mn"), ("bits", "2"), ("seed", "4")],
        &[("compress", "qsgd_mn"), ("bits", "8")],
        &[("compress", "qsgd_mn_ts"), ("bits", "[2, 6]")],
        &[("compress", "qsgd_mn_ms"), ("bits", "[1, 3, 8]")],
        &[("compress", "grandk_mn"), ("bits", "4"), ("k", "17")],
        &[("compress", "grandk_mn_ts"), ("bits", "[2, 4]"), ("k", "300")],
        &[("compress", "powersgd"), ("rank", "3")],
        &[("compress", "1bit"), ("threshold", "0.1")],
    ];
    for p in all {
        let c = params(p);
        for shape in [vec![37usize, 91], vec![3000]] {
            let n: usize = shape.iter().product();
            let w = 3;
            let grads: Vec<Vec<f32>> = (0..w).map(|m| grad(n, m as u64 + 5, 1.0 + m as f32)).collect();
            let views: Vec<&[f32]> = grads.iter().map(|g| &g[..]).collect();
            let mut states: Vec<State> = (0..w).map(|_| State::default()).collect();
            let ctx = Ctx { shape: &shape, step: 2, key_hash: 42, member: 0, workers: w };
            let (exchanged, sum) = encode(&c, &mut states, &views, &ctx, &mut InProcess::new(w)).unwrap();
            let mut whole = vec![0f32; n];
            decode(&c, &exchanged, &sum, &ctx, &mut whole).unwrap();
            let align = slice_align(&c);
            for cuts in [vec![0, n / 3, n / 2 + 5, n], vec![0, align.min(n), n], vec![0, 1, 2, n - 1, n]] {
                let slices: Vec<Range<usize>> = cuts.windows(2).map(|w| w[0]..w[1]).collect();
                let ranges = pieces(&c, ctx.step, ctx.key_hash, &slices);
                // Exchanged float32 parts (scale, P) go whole to every slice, scale indices in pieces.
                let sums = split_final(&sum, &slices, &ranges).unwrap();
                let mut exs: Vec<Vec<Part>> = vec![Vec::new(); slices.len()];
                for part in &exchanged {
                    let cut = match part {
                        Part::F32(_) => vec![part.clone(); slices.len()],
                        _ => part.split(&ranges).unwrap(),
                    };
                    cut.into_iter().zip(exs.iter_mut()).for_each(|(p, e)| e.push(p));
                }
                let mut got = vec![f32::NAN; n];
                for ((r, s), e) in slices.iter().zip(&sums).zip(&exs) {
                    decode_slice(&c, e, s, &ctx, r.start, &mut got[r.clone()]).unwrap();
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&whole), "{} {shape:?} cut at {cuts:?}", c.name());
            }
            // A slice that claims to run past the key is refused.
            let mut out = vec![0f32; 2];
            assert!(decode_slice(&c, &exchanged, &sum, &ctx, n - 1, &mut out).is_err());
        }
    }
}

#[test]
fn packed_parts_split_as_their_codes_do() {
    for (span, members) in [(2i32, 1u32), (6, 1), (1, 1), (4, 3)] {
        let width = collective::sum_width(0, span, members as usize).unwrap();
        let group = lanes::GROUP * (64 / width) as usize;
        let n = 5 * group + 7;
        let codes: Vec<i32> = (0..n).map(|i| ((i * 7919) % (span as usize * members as usize + 1)) as i32).collect();
        let packed = Part::Packed { words: lanes::pack_slice(&codes, width, |c| c as u64), n, lo: 0, hi: span, count: members, width };
        let unpacked = packed.unpacked().unwrap().into_owned();
        for cuts in [vec![0, group, 3 * group, n], vec![0, 5, group + 1, n], vec![0, 0, n, n]] {
            let ranges: Vec<Range<usize>> = cuts.windows(2).map(|w| w[0]..w[1]).collect();
            let split = packed.split(&ranges).unwrap();
            let aligned = ranges.iter().all(|r| r.start % group == 0 && (r.end % group == 0 || r.end == n));
            for ((p, want), r) in split.iter().zip(unpacked.split(&ranges).unwrap()).zip(&ranges) {
                assert_eq!(*p.unpacked().unwrap(), want, "span {span} cut {r:?}");
                assert_eq!(matches!(p, Part::Packed { .. }), aligned, "words are cut only between whole groups");
            }
        }
        assert!(packed.split(&[0..n + 1]).is_err());
    }
}

#[test]
fn pulled_sums_travel_as_digits_where_that_is_denser() {
    // Two workers' codes in [-2, 2] summed: 9 values, as base-9 digits (5
    // to 16 bits) instead of 4-bit lanes. (qsgd_mn 2's codes are in
    // [-3, 3]: 13 values for two workers, where 4-bit lanes are as dense.)
    let n = 5000;
    let codes: Vec<i32> = (0..n).map(|i| (i * 7 % 9) as i32 - 4).collect();
    let words = lanes::pack_slice(&codes, 4, |c| (c + 4) as u64);
    let packed = Part::Packed { words, n, lo: -2, hi: 2, count: 2, width: 4 };
    let want = Part::Codes { codes: codes.clone(), lo: -4, hi: 4 };
    for sum in [&packed, &Part::Codes { codes: codes.clone(), lo: -2, hi: 2 }] {
        let wire = value_to_wire(3, &[Part::F32(vec![1.0])], sum, 2);
        let (_, _, got) = value_from_wire(&wire).unwrap();
        assert_eq!(*got.unpacked().unwrap(), want);
        // step and count (12 bytes), the scale (8 + 13), the sum's header
        // (8 + 17); then 2 bytes per 5 values, where lanes took 8 per 16
        assert_eq!(wire.len(), 12 + 21 + 25 + 2 * n.div_ceil(5));
    }
    // Ranges where lanes are as dense stay lanes: 3 workers (13 values).
    let three = Part::Codes { codes: vec![6, -6, 0], lo: -2, hi: 2 };
    let wire = value_to_wire(3, &[], &three, 3);
    assert_eq!(wire[20], 2, "kind 2, lanes");
    assert_eq!(*value_from_wire(&wire).unwrap().2.unpacked().unwrap(), Part::Codes { codes: vec![6, -6, 0], lo: -6, hi: 6 });
    // 1-bit over 2 workers: counts in 0..=2, base 3.
    let ones = Part::Codes { codes: vec![0, 1, 2, 2, 1], lo: 0, hi: 1 };
    let wire = value_to_wire(1, &[], &ones, 2);
    assert_eq!(wire[20], 3, "kind 3, digits");
    assert_eq!(*value_from_wire(&wire).unwrap().2.unpacked().unwrap(), Part::Codes { codes: vec![0, 1, 2, 2, 1], lo: 0, hi: 2 });
}

#[test]
fn digit_parts_from_the_network_are_checked() {
    let sum = Part::Codes { codes: (0..100).map(|i| i % 9 - 4).collect(), lo: -2, hi: 2 };
    let value = value_to_wire(0, &[], &sum, 2);
    let part = value[20..].to_vec(); // kind 3: n, lo, hi, then 20 digit words
    assert_eq!((part[0], part.len()), (3, 17 + 2 * 20));
    assert!(from_wire(&part).is_ok());
    let err = |bytes: &[u8]| from_wire(bytes).unwrap_err().to_string();
    // a word past 9^5, a short frame, a long one, and claims of 2^40 and 2^64-1 values
    let mut w = part.clone();
    w[17..19].copy_from_slice(&60_000u16.to_le_bytes());
    assert!(err(&w).contains("past 9^5"), "{}", err(&w));
    assert!(err(&part[..part.len() - 2]).contains("the frame carries"));
    let mut long = part.clone();
    long.extend([0, 0]);
    assert!(err(&long).contains("the frame carries"));
    for n in [1u64 << 40, u64::MAX] {
        let mut w = part.clone();
        w[1..9].copy_from_slice(&n.to_le_bytes());
        assert!(err(&w).contains("the frame carries"), "{}", err(&w));
    }
    // ranges with no digits: empty, reversed, wider than 2^16 values
    for (lo, hi) in [(4, 4), (4, -4), (0, 1 << 16), (i32::MIN, i32::MAX)] {
        let mut w = part.clone();
        w[9..13].copy_from_slice(&lo.to_le_bytes());
        w[13..17].copy_from_slice(&hi.to_le_bytes());
        assert!(err(&w).contains("digits of the code range"), "{lo}..={hi}: {}", err(&w));
    }
    // a last word holding more digits than its values: 100 values in 20
    // full words; 98 leave words 18 and 19 (of m = 20) with four digits
    let sum = Part::Codes { codes: vec![0; 98], lo: -2, hi: 2 };
    let mut w = value_to_wire(0, &[], &sum, 2)[20..].to_vec();
    w[17 + 2 * 19..17 + 2 * 20].copy_from_slice(&(4 * 820 + 6561u16).to_le_bytes()); // value 4 in four digits, and a fifth
    assert!(err(&w).contains("more digits than values"), "{}", err(&w));
}

#[test]
fn scale_indices_from_the_network_are_below_their_count() {
    let part = Part::Levels { levels: (0..100).map(|i| (i % 3) as u8).collect(), count: 3 };
    let wire = to_wire(&part);
    assert_eq!(from_wire(&wire).unwrap(), part);
    // 2-bit lanes can hold a 3: refused, whichever lane holds it
    for byte in [10, 10 + 8 * 3] {
        let mut bad = wire.clone();
        bad[byte] |= 0b11 << 4;
        assert!(from_wire(&bad).unwrap_err().to_string().contains("a scale index is not below 3"), "byte {byte}");
    }
    // 1-bit lanes for 2 scales hold nothing else
    let two = Part::Levels { levels: (0..100).map(|i| (i % 2) as u8).collect(), count: 2 };
    let mut wire = to_wire(&two);
    wire[10] = 0xff;
    assert!(matches!(from_wire(&wire).unwrap(), Part::Levels { count: 2, .. }));
}
