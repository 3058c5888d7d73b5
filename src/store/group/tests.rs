//! The group on ranks held by threads of this process.

use super::*;
use crate::quant::compression::Compression;
use crate::quant::lanes;
use std::sync::{Barrier, Condvar};

/// Ranks on threads of this process, reducing through shared memory in
/// rank order (float32 sums in rank order, as a device store folds;
/// words as wrapping 64-bit sums). Values travel as bit patterns.
struct Threads {
    posted: Mutex<(u64, Vec<Option<Vec<u64>>>, Option<Vec<Vec<u64>>>)>,
    ready: Condvar,
    done: Barrier,
}

struct Rank<'a> {
    threads: &'a Threads,
    rank: usize,
}

impl Threads {
    fn new(world: usize) -> Threads {
        Threads { posted: Mutex::new((0, vec![None; world], None)), ready: Condvar::new(), done: Barrier::new(world) }
    }
}

fn fold(op: ReduceOp, float: bool, a: u64, b: u64) -> u64 {
    if float {
        let (x, y) = (f32::from_bits(a as u32), f32::from_bits(b as u32));
        let r = match op {
            ReduceOp::Sum => x + y,
            ReduceOp::Max => x.max(y),
            ReduceOp::Or | ReduceOp::LaneMin(_) => panic!("{op:?} of float32"),
        };
        return r.to_bits() as u64;
    }
    match op {
        ReduceOp::Sum => a.wrapping_add(b),
        ReduceOp::Max => a.max(b),
        ReduceOp::Or => a | b,
        ReduceOp::LaneMin(_) => panic!("the group's engine has no lane-wise MIN"),
    }
}

impl Rank<'_> {
    /// Every rank's `mine`, in rank order, on every rank.
    fn everyone(&self, mine: Vec<u64>) -> Vec<Vec<u64>> {
        let t = self.threads;
        let mut g = t.posted.lock().unwrap();
        g.1[self.rank] = Some(mine);
        if g.1.iter().all(Option::is_some) {
            g.2 = Some(g.1.iter_mut().map(|x| x.take().unwrap()).collect());
            g.0 += 1;
            t.ready.notify_all();
        } else {
            let round = g.0;
            g = t.ready.wait_while(g, |g| g.0 == round).unwrap();
        }
        let all = g.2.clone().unwrap();
        drop(g);
        t.done.wait(); // every rank has read the result before the next round
        all
    }
}

impl Engine for Rank<'_> {
    fn all_to_all(&mut self, send: &[u64], recv: &mut [u64]) -> Result<()> {
        let all = self.everyone(send.to_vec());
        let c = send.len() / all.len();
        for (j, theirs) in all.iter().enumerate() {
            recv[j * c..(j + 1) * c].copy_from_slice(&theirs[self.rank * c..(self.rank + 1) * c]);
        }
        Ok(())
    }

    fn all_gather(&mut self, mine: &[u64], out: &mut [u64]) -> Result<()> {
        let all = self.everyone(mine.to_vec());
        out.copy_from_slice(&all.concat());
        Ok(())
    }

    fn all_reduce(&mut self, op: ReduceOp, buf: Buffer<'_>) -> Result<()> {
        let (mine, float): (Vec<u64>, bool) = match &buf {
            Buffer::F32(x) => (x.iter().map(|v| v.to_bits() as u64).collect(), true),
            Buffer::U64(x) => (x.to_vec(), false),
        };
        let all = self.everyone(mine);
        let result: Vec<u64> = all[1..].iter().fold(all[0].clone(), |acc, x| acc.iter().zip(x).map(|(&a, &b)| fold(op, float, a, b)).collect());
        match buf {
            Buffer::F32(x) => x.iter_mut().zip(&result).for_each(|(x, &r)| *x = f32::from_bits(r as u32)),
            Buffer::U64(x) => x.copy_from_slice(&result),
        }
        Ok(())
    }
}

fn params(p: &[(&str, &str)]) -> Compression {
    Compression::from_params(p.iter().copied()).unwrap()
}

/// Each rank pushes `grads[rank]` as one bucket of the given keys and
/// shapes; the results (or errors) of every rank.
fn push_all(groups: &[Group], keys: &[(&str, Vec<usize>)], grads: &[Vec<f32>]) -> Vec<Result<Vec<f32>>> {
    push_all_seen(groups, keys, grads).into_iter().map(|r| r.map(|(out, _)| out)).collect()
}

/// `push_all`, with what each rank's pending bucket handed the engine.
fn push_all_seen(groups: &[Group], keys: &[(&str, Vec<usize>)], grads: &[Vec<f32>]) -> Vec<Result<(Vec<f32>, Buffers)>> {
    let threads = Threads::new(groups.len());
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .iter()
            .enumerate()
            .map(|(rank, g)| {
                let (threads, grad) = (&threads, &grads[rank]);
                s.spawn(move || one_seen(threads, g, rank, keys, grad))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn grads(world: usize, n: usize, step: u64) -> Vec<Vec<f32>> {
    (0..world).map(|r| (0..n).map(|i| (((i * 7 + r * 13 + step as usize * 5) % 17) as f32 - 8.0) / 16.0).collect()).collect()
}

#[test]
fn a_bucket_decodes_to_the_device_stores_sum_over_the_world_on_every_rank() {
    let shapes = [("a", vec![6, 8]), ("b", vec![5])];
    for c in [
        params(&[("compress", "qsgd_mn"), ("bits", "2"), ("seed", "3")]),
        params(&[("compress", "qsgd_mn"), ("bits", "8"), ("seed", "3")]),
        params(&[("compress", "2bit"), ("threshold", "0.25")]),
        params(&[("compress", "grandk_mn_ts"), ("bits", "[2,4]"), ("k", "9")]),
        params(&[("compress", "qsgd_mn_ts"), ("bits", "[2,6]"), ("seed", "1")]),
        params(&[("compress", "qsgd_mn_ms"), ("bits", "[1,3,5,8]")]),
        params(&[("compress", "1bit")]),
        params(&[("compress", "powersgd"), ("rank", "2")]),
    ] {
        // Worlds on both sides of the powers of two, where the lanes widen
        // by a bit for the larger sums.
        for world in [2, 3, 8, 16, 17, 33] {
            let groups: Vec<Group> = (0..world).map(|r| Group::new(c, r, world, 0, 0.0).unwrap()).collect();
            // The same pushes through the scheme path of an in-process store of `world` members.
            let mut states: Vec<Vec<scheme::State>> = vec![vec![scheme::State::default(); world]; 2];
            for step in 0..3 {
                let g = grads(world, 53, step);
                let got = push_all(&groups, &shapes, &g);
                let mut at = 0;
                for (t, (key, shape)) in shapes.iter().enumerate() {
                    let n: usize = shape.iter().product();
                    let mine: Vec<&[f32]> = g.iter().map(|g| &g[at..at + n]).collect();
                    let ctx = scheme::Ctx { shape, step, key_hash: Key::Str(key.to_string()).stable_hash(), member: 0, workers: world };
                    let mut want = vec![0f32; n];
                    scheme::push_round(&c, &mut states[t], &mine, &ctx, &mut collective::InProcess::new(world), &mut want).unwrap();
                    want.iter_mut().for_each(|x| *x /= world as f32);
                    for r in &got {
                        assert_eq!(&r.as_ref().unwrap()[at..at + n], &want[..], "{c:?} world {world} step {step} key {key}");
                    }
                    at += n;
                }
            }
            let s = groups[0].stats();
            assert_eq!((s.steps, s.compressed_steps, s.bytes_uncompressed), (3, 3, 3 * 4 * 53));
        }
    }
}

#[test]
fn a_non_finite_gradient_or_a_mismatch_fails_every_rank_alike_and_changes_nothing() {
    let c = params(&[("compress", "2bit"), ("threshold", "0.25")]);
    let groups: Vec<Group> = (0..2).map(|r| Group::new(c, r, 2, 0, 0.0).unwrap()).collect();
    let shapes = [("w", vec![20])];
    push_all(&groups, &shapes, &grads(2, 20, 0));
    let saved: Vec<Vec<u8>> = groups.iter().map(|g| g.save().unwrap()).collect();
    let mut bad = grads(2, 20, 1);
    bad[1][7] = f32::NAN;
    let errors: Vec<String> = push_all(&groups, &shapes, &bad).into_iter().map(|r| r.unwrap_err().to_string()).collect();
    assert_eq!(errors[0], errors[1]);
    assert!(errors[0].contains("rank 1's residual + gradient of key 'w'") && errors[0].contains("nothing was applied"), "{}", errors[0]);
    assert_eq!(groups.iter().map(|g| g.save().unwrap()).collect::<Vec<_>>(), saved);
    // QSGD finds it through its shared scale, after the agreement: the same error.
    let q = params(&[("compress", "qsgd_mn_ts"), ("bits", "[2,4]")]);
    let groups: Vec<Group> = (0..2).map(|r| Group::new(q, r, 2, 0, 0.0).unwrap()).collect();
    let two = [("u", vec![20]), ("v", vec![4, 5])];
    push_all(&groups, &two, &grads(2, 40, 0));
    let saved: Vec<Vec<u8>> = groups.iter().map(|g| g.save().unwrap()).collect();
    let mut bad = grads(2, 40, 1);
    bad[0][33] = f32::INFINITY;
    let errors: Vec<String> = push_all(&groups, &two, &bad).into_iter().map(|r| r.unwrap_err().to_string()).collect();
    assert_eq!(errors[0], errors[1]);
    assert!(errors[0].contains("rank 0's gradient of key 'v'") && errors[0].contains("at push 1"), "{}", errors[0]);
    assert_eq!(groups.iter().map(|g| g.save().unwrap()).collect::<Vec<_>>(), saved);
    let again = push_all(&groups, &two, &grads(2, 40, 1)); // the job goes on
    assert!(again.iter().all(|r| r.is_ok()));
    // Another compression on rank 1.
    let other = [Group::new(c, 0, 2, 0, 0.0).unwrap(), Group::new(params(&[("compress", "2bit"), ("threshold", "0.5")]), 1, 2, 0, 0.0).unwrap()];
    let errors: Vec<String> = push_all(&other, &shapes, &grads(2, 20, 0)).into_iter().map(|r| r.unwrap_err().to_string()).collect();
    assert_eq!(errors[0], errors[1]);
    assert!(errors[0].contains("disagree on compression parameters"), "{}", errors[0]);
}

#[test]
fn start_iter_and_min_rate_send_float32_sums_and_count_bytes() {
    let c = params(&[("compress", "qsgd_mn"), ("bits", "2")]);
    let groups: Vec<Group> = (0..2).map(|r| Group::new(c, r, 2, 1, 2.0).unwrap()).collect();
    // "tiny": 3 values cost more packed (a scale and a word) than half their floats.
    let shapes = [("big", vec![64]), ("tiny", vec![3])];
    let g = grads(2, 67, 0);
    let first = push_all(&groups, &shapes, &g);
    let plain: Vec<f32> = (0..67).map(|i| (g[0][i] + g[1][i]) / 2.0).collect();
    assert_eq!(first[0].as_ref().unwrap(), &plain); // push 0 < start_iter: plain
    let second = push_all(&groups, &shapes, &grads(2, 67, 1));
    let tiny: Vec<f32> = (64..67).map(|i| (grads(2, 67, 1)[0][i] + grads(2, 67, 1)[1][i]) / 2.0).collect();
    assert_eq!(&second[1].as_ref().unwrap()[64..], &tiny[..]);
    let s = groups[1].stats();
    assert_eq!((s.steps, s.compressed_steps, s.bytes_uncompressed), (2, 1, 2 * 4 * 67));
    // The first two pushes have no plan yet: a 9-field agreement each (72
    // floats). Then 67 floats and their tail (72 floats), or a scale, 64
    // codes in lanes and the tail (39 words), and 3 floats.
    let (agreement, tail, compressed) = (4 * 72, 8 * 39, 4 + collective::codes_bytes(64, -3, 3, 2) + 4 * 3);
    assert_eq!((s.agreements, s.bytes_sent), (2, 2 * agreement + 4 * (67 + 72) + tail + compressed));
    // The third follows the second as the second followed the first: no agreement.
    push_all(&groups, &shapes, &grads(2, 67, 2));
    let third = groups[1].stats();
    assert_eq!((third.agreements, third.bytes_sent - s.bytes_sent), (2, tail + compressed));
}

#[test]
fn a_refused_first_push_registers_no_key() {
    let c = params(&[("compress", "2bit"), ("threshold", "0.25")]);
    let groups: Vec<Group> = (0..2).map(|r| Group::new(c, r, 2, 0, 0.0).unwrap()).collect();
    let fresh: Vec<Vec<u8>> = groups.iter().map(|g| g.save().unwrap()).collect();
    let mut bad = grads(2, 20, 0);
    bad[0][3] = f32::NAN;
    assert!(push_all(&groups, &[("w", vec![20])], &bad).iter().all(|r| r.is_err()));
    assert_eq!(groups.iter().map(|g| g.save().unwrap()).collect::<Vec<_>>(), fresh, "no key 'w' after the refused push");
    // Still fresh: a checkpoint of other keys loads (a registered 'w' would be "pushed here but not in the compression states").
    let other: Vec<Group> = (0..2).map(|r| Group::new(c, r, 2, 0, 0.0).unwrap()).collect();
    push_all(&other, &[("v", vec![8])], &grads(2, 8, 0));
    for (g, o) in groups.iter().zip(&other) {
        g.load(&o.save().unwrap()).unwrap();
    }
}

#[test]
fn a_checkpoint_with_a_non_finite_state_or_an_overflowing_shape_is_refused_whole() {
    for (c, what) in [(params(&[("compress", "powersgd"), ("rank", "1")]), "PowerSGD Q"), (params(&[("compress", "1bit")]), "residual")] {
        let group = Group::new(c, 0, 1, 0, 0.0).unwrap();
        push_all(std::slice::from_ref(&group), &[("m", vec![4, 5])], &grads(1, 20, 0));
        let blob = group.save().unwrap();
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut saved = checkpoint::decode(&blob).unwrap();
            let state = &mut saved.keys[0].states[0];
            let values = if what == "PowerSGD Q" { &mut state.q } else { &mut state.residual };
            values[1] = bad;
            let err = group.load(&checkpoint::encode(&saved)).unwrap_err().to_string();
            assert_eq!(err, format!("compression states: key 'm': its saved {what} holds {bad} at element 1, a non-finite value"));
            assert_eq!(group.save().unwrap(), blob, "unchanged");
            // A fresh group refuses it too.
            assert!(Group::new(c, 0, 1, 0, 0.0).unwrap().load(&checkpoint::encode(&saved)).is_err());
        }
    }
    // A shape whose product overflows (2^62 x 8 wraps to 0, fitting empty states).
    let c = params(&[("compress", "1bit")]);
    let fresh = Group::new(c, 0, 1, 0, 0.0).unwrap();
    let mut saved = checkpoint::decode(&fresh.save().unwrap()).unwrap();
    saved.keys.push(KeyState { key: Key::Str("huge".into()), shape: vec![1 << 62, 8], pushes: 3, residuals: Vec::new(), states: vec![scheme::State::default()] });
    let err = fresh.load(&checkpoint::encode(&saved)).unwrap_err().to_string();
    assert!(err.contains("key 'huge': saved with shape [4611686018427387904, 8], more elements than any array can hold"), "{err}");
    assert_eq!(fresh.save().unwrap(), Group::new(c, 0, 1, 0, 0.0).unwrap().save().unwrap());
}

#[test]
fn a_world_too_large_for_the_code_sum_is_named() {
    let two = params(&[("compress", "2bit"), ("threshold", "0.5")]);
    assert!(Group::new(two, 0, 46340, 0, 0.0).is_ok());
    for world in [46341, 1 << 31, 1 << 40, usize::MAX] {
        let err = Group::new(two, 0, world, 0, 0.0).err().unwrap().to_string();
        assert_eq!(err, format!("invalid parameter 'process_group': a world of {world} ranks: 2bit sums every rank's codes in 32-bit lanes, which hold the sum of at most 46340 ranks"));
    }
    let one = params(&[("compress", "1bit")]);
    assert!(Group::new(one, 0, i32::MAX as usize, 0, 0.0).is_ok());
    assert!(Group::new(one, 0, 1 << 31, 0, 0.0).err().unwrap().to_string().contains("at most 2147483647 ranks"));
}

#[test]
fn saved_states_resume_and_a_blob_of_another_setting_is_refused_whole() {
    let c = params(&[("compress", "powersgd"), ("rank", "1")]);
    let group = Group::new(c, 0, 1, 0, 0.0).unwrap();
    push_all(std::slice::from_ref(&group), &[("m", vec![4, 5])], &grads(1, 20, 0));
    let blob = group.save().unwrap();
    let resumed = Group::new(c, 0, 1, 0, 0.0).unwrap();
    resumed.load(&blob).unwrap();
    let a = push_all(std::slice::from_ref(&group), &[("m", vec![4, 5])], &grads(1, 20, 1));
    let b = push_all(std::slice::from_ref(&resumed), &[("m", vec![4, 5])], &grads(1, 20, 1));
    assert_eq!(a[0].as_ref().unwrap(), b[0].as_ref().unwrap());
    let wrong_shape = Group::new(c, 0, 1, 0, 0.0).unwrap();
    wrong_shape.load(&blob).unwrap(); // fresh: checked at the first push
    let err = push_all(std::slice::from_ref(&wrong_shape), &[("m", vec![5, 4])], &grads(1, 20, 1)).remove(0).unwrap_err().to_string();
    assert_eq!(err, "gradpack: rank 0's key 'm' was loaded from a checkpoint with another shape; nothing was applied on any rank");
    let other = Group::new(params(&[("compress", "powersgd"), ("rank", "2")]), 0, 1, 0, 0.0).unwrap();
    assert!(other.load(&blob).unwrap_err().to_string().contains("saved with PowerSgd"));
    let two = Group::new(c, 0, 2, 0, 0.0).unwrap();
    assert!(two.load(&blob).unwrap_err().to_string().contains("worker 0 of 1, this is worker 0 of 2"));
    assert!(Group::new(params(&[("compress", "grandk_mn"), ("bits", "2"), ("k", "3"), ("unselected", "local")]), 0, 2, 0, 0.0).is_err());
    assert!(Group::new(c, 2, 2, 0, 0.0).is_err() && Group::new(c, 0, 1, 0, f64::NAN).is_err());
}

/// Pushes `steps` steps of two buckets on every rank (keys a, b; then c).
fn two_buckets(groups: &[Group], from: u64, steps: u64) -> Vec<Vec<f32>> {
    let mut last = Vec::new();
    for step in from..from + steps {
        let g = grads(groups.len(), 44, step);
        push_all(groups, &[("a", vec![4, 5]), ("b", vec![4])], &g.iter().map(|x| x[..24].to_vec()).collect::<Vec<_>>()).into_iter().for_each(|r| drop(r.unwrap()));
        last = push_all(groups, &[("c", vec![20])], &g.iter().map(|x| x[24..].to_vec()).collect::<Vec<_>>()).into_iter().map(|r| r.unwrap()).collect();
    }
    last
}

#[test]
fn a_settled_job_agrees_no_more_and_a_rank_that_departs_from_the_plan_fails_every_rank_alike() {
    for c in [
        params(&[("compress", "none")]),
        params(&[("compress", "2bit"), ("threshold", "0.25")]),
        params(&[("compress", "qsgd_mn_ts"), ("bits", "[2,4]")]),
        params(&[("compress", "powersgd"), ("rank", "1")]),
        params(&[("compress", "1bit")]),
    ] {
        let groups: Vec<Group> = (0..3).map(|r| Group::new(c, r, 3, 0, 0.0).unwrap()).collect();
        two_buckets(&groups, 0, 2);
        let settled = groups[0].stats().agreements;
        assert_eq!(settled, 3, "{c:?}: the first bucket, the second, the first after the second");
        two_buckets(&groups, 2, 3);
        assert_eq!(groups[2].stats().agreements, settled, "{c:?}");
        let saved: Vec<Vec<u8>> = groups.iter().map(|g| g.save().unwrap()).collect();
        // Rank 1 pushes another bucket where the plan has (a, b), its key a
        // reshaped: every rank fails alike, naming that (its own failure
        // comes before the fields that differ because of it).
        let errors = rank_one_departs(&groups);
        assert!(errors.iter().all(|e| *e == errors[0]), "{c:?}: {errors:?}");
        assert!(errors[0].contains("rank 1's key 'a' was pushed before with another shape"), "{c:?}: {}", errors[0]);
        assert_eq!(groups.iter().map(|g| g.save().unwrap()).collect::<Vec<_>>(), saved, "{c:?}: unchanged");
        // The job goes on: the next steps stand in once and settle again.
        two_buckets(&groups, 10, 3);
    }
}

/// Three ranks push bucket (a, b), rank 1 with another shape of `a`
/// where every rank's plan has (a, b): each rank's error.
fn rank_one_departs(groups: &[Group]) -> Vec<String> {
    let (g, threads) = (grads(3, 24, 9), Threads::new(3));
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|r| {
                let (g, threads) = (&g, &threads);
                s.spawn(move || {
                    let layout: &[(&str, Vec<usize>)] = if r == 1 { &[("a", vec![5, 4]), ("b", vec![4])] } else { &[("a", vec![4, 5]), ("b", vec![4])] };
                    one(threads, &groups[r], r, layout, &g[r])
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap().unwrap_err().to_string()).collect()
    })
}

/// One rank's push of one bucket, reducing through `threads`.
fn one(threads: &Threads, group: &Group, rank: usize, layout: &[(&str, Vec<usize>)], grad: &[f32]) -> Result<Vec<f32>> {
    one_seen(threads, group, rank, layout, grad).map(|(out, _)| out)
}

/// What a pending bucket handed the engine: (the bucket summed in place,
/// words, floats).
type Buffers = (bool, usize, usize);

/// `one`, with the pending bucket's buffers.
fn one_seen(threads: &Threads, group: &Group, rank: usize, layout: &[(&str, Vec<usize>)], grad: &[f32]) -> Result<(Vec<f32>, Buffers)> {
    let mut at = 0;
    let tensors: Vec<Tensor> = layout
        .iter()
        .map(|(k, shape)| {
            let n: usize = shape.iter().product();
            at += n;
            Tensor { key: Key::Str(k.to_string()), shape: shape.clone(), grad: &grad[at - n..at] }
        })
        .collect();
    let mut engine = Rank { threads, rank };
    let mut pending = group.encode(&tensors, grad.len(), true, 0, &mut engine)?;
    let seen = (pending.plain, pending.words.len(), pending.floats.len());
    let mut out = grad.to_vec();
    // As gradpack.torch: empty buffers are not reduced (a rank that sent
    // stand-ins has nothing left to sum).
    if !pending.words_to_sum().is_empty() {
        engine.all_reduce(ReduceOp::Sum, Buffer::U64(pending.words_to_sum()))?;
    }
    if pending.plain {
        engine.all_reduce(ReduceOp::Sum, Buffer::F32(&mut out))?;
    } else if !pending.floats.is_empty() {
        engine.all_reduce(ReduceOp::Sum, Buffer::F32(&mut pending.floats))?;
    }
    // The check alone (the hierarchical exchange reads it first) says what decode will.
    let checked = group.check(&pending).map_err(|e| e.to_string());
    let decoded = group.decode(pending, &mut out);
    assert_eq!(checked, decoded.as_ref().map(|_| ()).map_err(|e| e.to_string()), "check and decode disagree");
    decoded?;
    Ok((out, seen))
}

#[test]
fn large_tensors_with_exchanges_encode_side_by_side_without_waiting_on_each_other() {
    // Tensors past par::CHUNK run parallel kernels while their siblings wait
    // on a batch: encodes on rayon's workers deadlocked here (a worker
    // waiting inside a kernel ran another encode under it).
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let c = params(&[("compress", "qsgd_mn_ts"), ("bits", "[2,4]")]);
        let groups: Vec<Group> = (0..2).map(|r| Group::new(c, r, 2, 0, 0.0).unwrap()).collect();
        let n = 3 * crate::par::CHUNK + 7;
        let shapes: Vec<(&str, Vec<usize>)> = ["a", "b", "c", "d", "e", "f"].into_iter().map(|k| (k, vec![n])).collect();
        for step in 0..3 {
            let g = grads(2, 6 * n, step);
            assert!(push_all(&groups, &shapes, &g).iter().all(|r| r.is_ok()));
        }
        tx.send(()).unwrap();
    });
    rx.recv_timeout(std::time::Duration::from_secs(300)).expect("the encodes of a bucket waited on each other for 5 minutes");
}

#[test]
fn a_small_plain_bucket_is_summed_as_a_copy_with_its_check_and_a_large_one_in_place() {
    let groups: Vec<Group> = (0..2).map(|r| Group::new(params(&[("compress", "none")]), r, 2, 0, 0.0).unwrap()).collect();
    for (n, in_place, names) in [(PLAIN_COPY_MAX / 2, false, ["w", "v"]), (PLAIN_COPY_MAX / 2 + 1, true, ["wide", "vast"])] {
        let layout = [(names[0], vec![n]), (names[1], vec![n])];
        for step in 0..3 {
            let g = grads(2, 2 * n, step);
            let want: Vec<f32> = (0..2 * n).map(|i| (g[0][i] + g[1][i]) / 2.0).collect();
            for seen in push_all_seen(&groups, &layout, &g) {
                let (out, buffers) = seen.unwrap();
                assert_eq!(out, want, "{n} values a tensor, step {step}");
                if in_place {
                    assert_eq!(buffers, (true, TAIL_WORDS, 0), "{n} values a tensor: the bucket in place, its check in words");
                } else {
                    assert_eq!(buffers, (false, 0, 2 * n + check::TAIL_FLOATS), "{n} values a tensor: a copy ending with the check");
                }
            }
        }
    }
}

/// Groups of `world` ranks taking `exchange`.
fn groups_of(c: Compression, world: usize, exchange: Exchange) -> Vec<Group> {
    (0..world).map(|r| Group::new(c, r, world, 0, 0.0).unwrap().with_exchange(exchange).unwrap()).collect()
}

#[test]
fn the_owners_exchange_gives_the_lanes_bits_up_to_its_resolution_and_an_unbiased_neighbour_beyond() {
    // Tensors of several lane groups, so that their codes fall to several owners.
    let shapes = [("a", vec![40, 75]), ("b", vec![7]), ("c", vec![2100])];
    let n: usize = shapes.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
    for (c, step) in [
        // (a step of the sums of 8 members, divided by 8: 2-bit rounds +pos and neg apart)
        (params(&[("compress", "2bit"), ("threshold", "0.25")]), Some(2.0 * 0.25 / 8.0)),
        (params(&[("compress", "qsgd_mn"), ("bits", "2"), ("seed", "3")]), None),
        (params(&[("compress", "grandk_mn_ts"), ("bits", "[2,4]"), ("k", "900")]), None),
        (params(&[("compress", "qsgd_mn_ms"), ("bits", "[1,3,5,8]")]), None),
        (params(&[("compress", "1bit")]), Some(2.0 / 8.0)),
    ] {
        for world in [2, 3, 5, owners::RESOLUTION, 9, 12] {
            let (lanes, owners) = (groups_of(c, world, Exchange::Lanes), groups_of(c, world, Exchange::Owners));
            assert!(owners[0].stats().owners && !lanes[0].stats().owners);
            for push in 0..3 {
                let own = grads(world, n, push + 10);
                let (l, o) = (push_all(&lanes, &shapes, &own), push_all(&owners, &shapes, &own));
                let (exact, got) = (l[0].as_ref().unwrap(), o[0].as_ref().unwrap());
                assert!(o.iter().all(|r| r.as_ref().unwrap() == got), "{c:?} world {world}: replicas differ");
                if world <= owners::RESOLUTION {
                    assert!(got == exact, "{c:?} world {world} push {push}: not the lanes' bits");
                    continue;
                }
                // Beyond: each value a neighbour of the exact mean on a grid of
                // 1/8 code step, unbiased over the values moved.
                let diff: Vec<f64> = exact.iter().zip(got).map(|(&e, &g)| (g - e) as f64).collect();
                let moved = diff.iter().filter(|d| **d != 0.0).count();
                assert!(moved > 0, "{c:?} world {world}: some mean falls between two steps");
                if let Some(step) = step {
                    assert!(diff.iter().all(|d| d.abs() <= step * (1.0 + 1e-5)), "{c:?} world {world}: a value moved past a neighbouring step");
                }
                let bias = diff.iter().sum::<f64>() / moved as f64;
                let spread = (diff.iter().map(|d| d * d).sum::<f64>() / moved as f64).sqrt();
                assert!(bias.abs() < 4.0 * spread / (moved as f64).sqrt() + 1e-9, "{c:?} world {world}: mean shift {bias} over {moved} rounded values (spread {spread})");
            }
            // Residuals are each rank's own quantization error: the same under both.
            for (a, b) in lanes.iter().zip(&owners) {
                assert_eq!(a.save().unwrap(), b.save().unwrap(), "{c:?} world {world}");
            }
            // The same gradient (and residual) on every rank: each mean is a
            // code, kept as it is (QSGD's rounding noise is each rank's own).
            if world > owners::RESOLUTION && !matches!(c, Compression::Qsgd(_)) {
                let (lanes, owners) = (groups_of(c, world, Exchange::Lanes), groups_of(c, world, Exchange::Owners));
                let same = vec![grads(1, n, 3).remove(0); world];
                let (l, o) = (push_all(&lanes, &shapes, &same), push_all(&owners, &shapes, &same));
                assert!(o.iter().all(|r| r.as_ref().unwrap() == l[0].as_ref().unwrap()), "{c:?} world {world}");
            }
        }
    }
}

#[test]
fn the_owners_exchange_hands_each_rank_its_codes_once_and_a_share_again_at_any_world() {
    let c = params(&[("compress", "2bit"), ("threshold", "0.5")]);
    let shapes = [("w", vec![10_000]), ("v", vec![300])];
    for world in [2, 4, 8, 16] {
        let groups = groups_of(c, world, Exchange::Owners);
        // (The first two pushes agree first: no plan yet.)
        for step in 0..2 {
            push_all(&groups, &shapes, &grads(world, 10_300, step));
        }
        let first = groups[0].stats().bytes_sent;
        push_all(&groups, &shapes, &grads(world, 10_300, 2));
        // 2 bits a value: 313 and 10 words, each tensor from a whole group
        // of 8 words, cut into runs of whole groups; each run's sums back in
        // lanes for min(world, 8) members, each tensor's piece on its own,
        // then the check's 39 words.
        let run = 336usize.div_ceil(world).next_multiple_of(8);
        let d = world.min(owners::RESOLUTION);
        let wide = lanes::width_for((d * (d + 1)) as u64); // pos + (d + 1) neg
        let per = 32; // values a word at 2 bits
        let pieces = |r: usize| -> usize {
            [(0usize, 313usize, 10_000usize), (320, 10, 300)]
                .iter()
                .map(|&(start, words, values)| {
                    let (a, b) = (start.max(r * run), (start + words).min((r + 1) * run));
                    if a >= b { 0 } else { lanes::words_for(((b - start) * per).min(values) - (a - start) * per, wide) }
                })
                .sum()
        };
        let chunk = (0..world).map(pieces).max().unwrap() + 39;
        assert_eq!(groups[0].stats().bytes_sent - first, 8 * (world * run + chunk) as u64, "world {world}");
    }
    // What `auto` chooses: owners from 4 ranks where lanes would take 1.5 times the bits.
    let choose = |p: &[(&str, &str)], world| Exchange::Auto.choose(&params(p), world).unwrap();
    assert!(!choose(&[("compress", "2bit"), ("threshold", "0.5")], 2) && choose(&[("compress", "2bit"), ("threshold", "0.5")], 4));
    assert!(!choose(&[("compress", "1bit")], 2) && choose(&[("compress", "1bit")], 4));
    assert!(!choose(&[("compress", "qsgd_mn"), ("bits", "2")], 3) && choose(&[("compress", "qsgd_mn"), ("bits", "2")], 4));
    assert!(!choose(&[("compress", "qsgd_mn"), ("bits", "8")], 8) && choose(&[("compress", "qsgd_mn"), ("bits", "8")], 16));
    assert!(!choose(&[("compress", "powersgd")], 1024) && !choose(&[("compress", "none")], 1024));
    let err = Exchange::Owners.choose(&params(&[("compress", "powersgd")]), 4).unwrap_err().to_string();
    assert!(err.contains("'owners' sums integer codes; powersgd sends float32"), "{err}");
    assert!(Exchange::parse("ring").unwrap_err().to_string().contains("must be 'lanes', 'owners' or 'auto'"));
}

/// Under `exchange` over 3 ranks: a NaN on rank 2 (in tensor `key`), then
/// rank 1 departing from the plan, fail every rank alike and change no
/// state, and the job goes on and settles again.
fn a_fault_or_a_departure_fails_every_rank_alike(c: Compression, exchange: Exchange, key: (&str, Vec<usize>)) {
    let groups = groups_of(c, 3, exchange);
    two_buckets(&groups, 0, 3);
    let saved: Vec<Vec<u8>> = groups.iter().map(|g| g.save().unwrap()).collect();
    let mut bad = grads(3, 20, 5);
    bad[2][11] = f32::NAN;
    let errors: Vec<String> = push_all(&groups, std::slice::from_ref(&key), &bad).into_iter().map(|r| r.unwrap_err().to_string()).collect();
    assert!(errors.iter().all(|e| *e == errors[0]) && errors[0].contains("rank 2's") && errors[0].contains(&format!("key '{}'", key.0)), "{c:?}: {errors:?}");
    assert_eq!(groups.iter().map(|g| g.save().unwrap()).collect::<Vec<_>>(), saved, "{c:?}: unchanged");
    two_buckets(&groups, 6, 2); // the job goes on
    let saved: Vec<Vec<u8>> = groups.iter().map(|g| g.save().unwrap()).collect();
    let errors = rank_one_departs(&groups);
    assert!(errors.iter().all(|e| *e == errors[0]) && errors[0].contains("rank 1's key 'a' was pushed before with another shape"), "{c:?}: {errors:?}");
    assert_eq!(groups.iter().map(|g| g.save().unwrap()).collect::<Vec<_>>(), saved, "{c:?}: unchanged");
    two_buckets(&groups, 10, 3); // and goes on again
    let settled = groups[0].stats().agreements;
    two_buckets(&groups, 13, 2);
    assert_eq!(groups[0].stats().agreements, settled, "{c:?}: settled again");
}

/// A rank that chose `exchange` and one that did not meet at the first bucket.
fn a_rank_that_chose_otherwise_is_met_at_the_first_bucket(exchange: Exchange) {
    let c = params(&[("compress", "2bit"), ("threshold", "0.25")]);
    let mixed = [Group::new(c, 0, 2, 0, 0.0).unwrap(), Group::new(c, 1, 2, 0, 0.0).unwrap().with_exchange(exchange).unwrap()];
    let errors: Vec<String> = push_all(&mixed, &[("w", vec![20])], &grads(2, 20, 0)).into_iter().map(|r| r.unwrap_err().to_string()).collect();
    assert!(errors[0] == errors[1] && errors[0].contains("disagree"), "{exchange:?}: {errors:?}");
}

#[test]
fn under_the_owners_exchange_a_fault_or_a_departure_fails_every_rank_alike_and_changes_nothing() {
    for c in [params(&[("compress", "2bit"), ("threshold", "0.25")]), params(&[("compress", "qsgd_mn_ts"), ("bits", "[2,4]")]), params(&[("compress", "1bit")])] {
        a_fault_or_a_departure_fails_every_rank_alike(c, Exchange::Owners, ("c", vec![20]));
    }
    a_rank_that_chose_otherwise_is_met_at_the_first_bucket(Exchange::Owners);
}

/// Tensor `t`'s elements of rank `rank` in a bucket of `shapes`.
fn rows_in_bucket(shapes: &[(&str, Vec<usize>)], t: usize, world: usize, rank: usize) -> Range<usize> {
    let at: usize = shapes[..t].iter().map(|(_, s)| s.iter().product::<usize>()).sum();
    let r = scatter::rows(&shapes[t].1, world, rank);
    at + r.start..at + r.end
}

#[test]
fn the_reduce_scatter_gives_each_rank_its_rows_of_the_lanes_result_bit_for_bit() {
    // Rows that do not divide among the ranks, fewer rows than ranks, a
    // vector, tensors of several lane groups.
    let shapes = [("a", vec![40, 75]), ("b", vec![7]), ("c", vec![2100]), ("d", vec![3, 4]), ("e", vec![301, 9])];
    let n: usize = shapes.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
    for c in [
        params(&[("compress", "2bit"), ("threshold", "0.25")]),
        params(&[("compress", "qsgd_mn"), ("bits", "2"), ("seed", "3")]),
        params(&[("compress", "qsgd_mn_ts"), ("bits", "[2,6]")]),
        params(&[("compress", "qsgd_mn_ms"), ("bits", "[1,3,5,8]")]),
        params(&[("compress", "grandk_mn"), ("bits", "4"), ("k", "500")]),
        params(&[("compress", "grandk_mn_ts"), ("bits", "[2,4]"), ("k", "900")]),
        params(&[("compress", "1bit")]),
        params(&[("compress", "powersgd"), ("rank", "2")]),
        params(&[("compress", "none")]),
    ] {
        for world in [2, 3, 5] {
            let (lanes, scattered) = (groups_of(c, world, Exchange::Lanes), groups_of(c, world, Exchange::Scatter));
            for push in 0..3 {
                let own = grads(world, n, push + 20);
                let (l, s) = (push_all(&lanes, &shapes, &own), push_all(&scattered, &shapes, &own));
                let exact = l[0].as_ref().unwrap();
                for (rank, got) in s.iter().enumerate() {
                    let got = got.as_ref().unwrap();
                    for t in 0..shapes.len() {
                        let r = rows_in_bucket(&shapes, t, world, rank);
                        assert!(got[r.clone()] == exact[r], "{c:?} world {world} push {push} rank {rank}: tensor {t}'s rows");
                    }
                }
            }
            // Residuals and PowerSGD's Q are each rank's own, as under lanes.
            for (a, b) in lanes.iter().zip(&scattered) {
                assert_eq!(a.save().unwrap(), b.save().unwrap(), "{c:?} world {world}");
            }
        }
    }
}

#[test]
fn the_reduce_scatter_hands_each_rank_its_codes_once() {
    let c = params(&[("compress", "2bit"), ("threshold", "0.5")]);
    let shapes = [("w", vec![100_000]), ("v", vec![3_000])];
    let mut codes = Vec::new();
    for world in [2, 4, 8, 16] {
        let groups = groups_of(c, world, Exchange::Scatter);
        for step in 0..2 {
            push_all(&groups, &shapes, &grads(world, 103_000, step));
        }
        let first = groups[0].stats().bytes_sent;
        push_all(&groups, &shapes, &grads(world, 103_000, 2));
        // 2 bits a value (one rank's lanes: 0, +pos, neg), 32 values a word,
        // pieces cut at whole groups of 8 words (256 values); the largest
        // piece to every rank, then the check's 39 words.
        let words = |values: usize, r: usize| {
            let block = values.div_ceil(world);
            let (a, b) = ((r * block).min(values), ((r + 1) * block).min(values));
            if a == b { 0 } else { lanes::words_for((b.div_ceil(256) * 256).min(values) - a / 256 * 256, 2) }
        };
        let piece = (0..world).map(|r| words(100_000, r) + words(3_000, r)).max().unwrap();
        let sent = groups[0].stats().bytes_sent - first;
        assert_eq!(sent, 8 * (world * (piece + 39)) as u64, "world {world}");
        codes.push(8 * world * piece);
    }
    // The codes once (103,000 values at 2 bits: 25,750 bytes) and the cut
    // groups: within 1.25x of the 2-rank bytes at 16 ranks (the checks,
    // 39 words to each rank, are apart).
    assert!(codes.iter().all(|&b| b as f64 <= 1.25 * codes[0] as f64) && codes[0] <= 25_750 + 2 * 128, "{codes:?}");
}

#[test]
fn under_the_reduce_scatter_a_fault_or_a_departure_fails_every_rank_alike_and_changes_nothing() {
    for c in [params(&[("compress", "2bit"), ("threshold", "0.25")]), params(&[("compress", "grandk_mn_ts"), ("bits", "[2,4]"), ("k", "9")]), params(&[("compress", "powersgd"), ("rank", "1")])] {
        // (PowerSGD sums a vector plainly: the NaN comes through as torch's sum carries it.)
        let key = if matches!(c, Compression::PowerSgd { .. }) { ("m", vec![4, 5]) } else { ("c", vec![20]) };
        a_fault_or_a_departure_fails_every_rank_alike(c, Exchange::Scatter, key);
    }
    a_rank_that_chose_otherwise_is_met_at_the_first_bucket(Exchange::Scatter);
}

/// Every rank pushes `layout`, but `refusing` takes its part as a rank
/// whose front refused the bucket (`own`): every rank's error.
fn one_refuses(groups: &[Group], refusing: usize, own: Own, layout: &[(&str, Vec<usize>)], step: u64) -> Vec<String> {
    let n: usize = layout.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
    let (g, threads) = (grads(groups.len(), n, step), Threads::new(groups.len()));
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..groups.len())
            .map(|r| {
                let (g, threads) = (&g, &threads);
                s.spawn(move || {
                    if r != refusing {
                        return one(threads, &groups[r], r, layout, &g[r]).unwrap_err().to_string();
                    }
                    // (a key refused as a key: the front names it by a stand-in)
                    let name = |k: &str| if own == Own::KeyText { "?".to_string() } else { k.to_string() };
                    let named: Vec<Tensor> = layout.iter().map(|(k, shape)| Tensor { key: Key::Str(name(k)), shape: shape.clone(), grad: &[] }).collect();
                    groups[r].refuse(&named, own, 0, &mut Rank { threads, rank: r }).to_string()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn a_bucket_its_front_refused_on_one_rank_fails_every_rank_alike_with_or_without_a_plan() {
    for c in [params(&[("compress", "2bit"), ("threshold", "0.25")]), params(&[("compress", "qsgd_mn"), ("bits", "2")]), params(&[("compress", "powersgd"), ("rank", "1")])] {
        for exchange in [Exchange::Lanes, Exchange::Owners, Exchange::Scatter] {
            if exchange == Exchange::Owners && matches!(c, Compression::PowerSgd { .. }) {
                continue;
            }
            let groups = groups_of(c, 3, exchange);
            let layout = [("w", vec![6, 7])];
            // The first bucket: no plan, the blocking agreement carries it.
            let errors = one_refuses(&groups, 1, Own::Dtype, &layout, 0);
            assert!(errors.iter().all(|e| *e == errors[0]), "{c:?} {exchange:?}: {errors:?}");
            assert_eq!(errors[0], "gradpack: rank 1's key 'w' was refused there: its dtype is not one gradpack compresses (float32, float16 or bfloat16); nothing was applied on any rank");
            let fresh = groups_of(c, 3, exchange).iter().map(|g| g.save().unwrap()).collect::<Vec<_>>();
            assert_eq!(groups.iter().map(|g| g.save().unwrap()).collect::<Vec<_>>(), fresh, "{c:?}: no key registered");
            // A settled job: the planned bucket's stand-ins carry it, and the job goes on.
            for step in 0..3 {
                assert!(push_all(&groups, &layout, &grads(3, 42, step)).iter().all(|r| r.is_ok()));
            }
            let (saved, agreements) = (groups.iter().map(|g| g.save().unwrap()).collect::<Vec<_>>(), groups[0].stats().agreements);
            let errors = one_refuses(&groups, 2, Own::Overlap, &layout, 3);
            assert!(errors.iter().all(|e| *e == errors[0]) && errors[0].contains("rank 2's key 'w' was refused there: its elements share memory"), "{c:?} {exchange:?}: {errors:?}");
            assert_eq!(groups.iter().map(|g| g.save().unwrap()).collect::<Vec<_>>(), saved, "{c:?}: unchanged");
            assert_eq!(groups[0].stats().agreements, agreements, "{c:?}: no blocking round");
            assert!(push_all(&groups, &layout, &grads(3, 42, 4)).iter().all(|r| r.is_ok()), "{c:?}: the job goes on");
            // A key refused as a key is named by its place (each rank holds its own name for it).
            let errors = one_refuses(&groups, 0, Own::KeyText, &layout, 5);
            assert!(errors.iter().all(|e| *e == errors[0]), "{c:?} {exchange:?}: {errors:?}");
            assert!(errors[0].starts_with("gradpack: rank 0's key at tensor 0 of its bucket was refused there: not a key"), "{}", errors[0]);
        }
    }
    assert_eq!(Own::refusal(1), Some(Own::Dtype));
    assert_eq!(Own::refusal(5), Some(Own::Sizes));
    assert_eq!(Own::refusal(6), Some(Own::Node));
    assert!(Own::refusal(0).is_none() && Own::refusal(7).is_none());
}

#[test]
fn a_bucket_that_fails_at_one_tensor_changes_no_tensors_state() {
    // PowerSGD over two ranks: `a` decodes, `b`'s summed Q passes float32's
    // range at b's first push (each rank's P, its sum and each rank's Q are
    // finite). `check` names it before anything is written (`one` asserts
    // decode agrees), and `a`, pushed before, keeps its state.
    let c = params(&[("compress", "powersgd"), ("rank", "1")]);
    let groups: Vec<Group> = (0..2).map(|r| Group::new(c, r, 2, 0, 0.0).unwrap()).collect();
    assert!(push_all(&groups, &[("a", vec![8, 4])], &grads(2, 32, 0)).iter().all(|r| r.is_ok()));
    let layout = [("a", vec![8, 4]), ("b", vec![20000, 4])];
    let push = |b: f32| {
        let g: Vec<Vec<f32>> = grads(2, 32, 1).into_iter().map(|mut g| {
            g.resize(32 + 80000, b);
            g
        }).collect();
        push_all(&groups, &layout, &g)
    };
    let saved: Vec<Vec<u8>> = groups.iter().map(|g| g.save().unwrap()).collect();
    let errors: Vec<String> = push(2e36).into_iter().map(|r| r.unwrap_err().to_string()).collect();
    assert!(errors[0] == errors[1] && errors[0].starts_with("PowerSGD: the workers' sum of Q holds") && errors[0].contains("inf"), "{errors:?}");
    assert_eq!(groups.iter().map(|g| g.save().unwrap()).collect::<Vec<_>>(), saved, "a's state unchanged");
    assert!(push(0.5).iter().all(|r| r.is_ok()), "the job goes on");
}

#[test]
fn a_state_reloads_after_some_of_its_keys_were_pushed_and_refuses_what_it_cannot_hold() {
    let c = params(&[("compress", "1bit")]);
    let first = Group::new(c, 0, 1, 0, 0.0).unwrap();
    push_all(std::slice::from_ref(&first), &[("x", vec![5]), ("y", vec![3])], &grads(1, 8, 0));
    let blob = first.save().unwrap();
    let second = Group::new(c, 0, 1, 0, 0.0).unwrap();
    second.load(&blob).unwrap();
    push_all(std::slice::from_ref(&second), &[("x", vec![5])], &grads(1, 5, 1)).remove(0).unwrap();
    // y is loaded but not pushed yet: its own state, and the first blob, load again.
    second.load(&second.save().unwrap()).unwrap();
    second.load(&blob).unwrap();
    assert_eq!(second.save().unwrap(), blob);
    // A store's blob with 2-bit residuals per device, or several states a key, is refused.
    let mut saved = checkpoint::decode(&blob).unwrap();
    saved.keys[0].residuals = vec![vec![0.5; 5]];
    let err = second.load(&checkpoint::encode(&saved)).unwrap_err().to_string();
    assert!(err.contains("key 'x': saved with 1 residuals and 1 scheme states"), "{err}");
    let mut saved = checkpoint::decode(&blob).unwrap();
    saved.keys[1].states.push(scheme::State::default());
    assert!(second.load(&checkpoint::encode(&saved)).unwrap_err().to_string().contains("key 'y': saved with 0 residuals and 2 scheme states"));
    // A push count that no further push can count.
    let mut saved = checkpoint::decode(&blob).unwrap();
    saved.keys[0].pushes = u64::MAX;
    assert!(second.load(&checkpoint::encode(&saved)).unwrap_err().to_string().contains("key 'x': saved after 2^64 - 1 pushes"));
    // ... or a scheme state's (its step wrapped to 0 at the next push).
    let mut saved = checkpoint::decode(&blob).unwrap();
    saved.keys[0].states[0].step = u64::MAX;
    assert!(second.load(&checkpoint::encode(&saved)).unwrap_err().to_string().contains("key 'x': saved after 2^64 - 1 pushes"));
    // A key saved twice (one of its states would be dropped).
    let mut saved = checkpoint::decode(&blob).unwrap();
    saved.keys[1] = saved.keys[0].clone();
    let err = second.load(&checkpoint::encode(&saved)).unwrap_err().to_string();
    assert!(err.contains("key 'x' is saved twice"), "{err}");
    assert_eq!(second.save().unwrap(), blob, "refused blobs change nothing");
}

#[test]
fn a_world_whose_qsgd_codes_overflow_the_lanes_is_refused_at_the_start() {
    for (bits, world) in [("15", 65538), ("8", 4210753)] {
        let q = params(&[("compress", "qsgd_mn"), ("bits", bits)]);
        let err = Group::new(q, 0, world, 0, 0.0).err().unwrap().to_string();
        assert!(err.contains("which hold the sum of at most"), "{bits}: {err}");
        // The largest world it takes encodes a push.
        let limit: usize = err.rsplit("at most ").next().unwrap().trim_end_matches(" ranks").parse().unwrap();
        let group = Group::new(q, 0, limit, 0, 0.0).unwrap();
        let mut states = [scheme::State::default()];
        let mut counting = {
            struct Counting;
            impl Engine for Counting {
                fn all_reduce(&mut self, _: ReduceOp, _: Buffer<'_>) -> Result<()> {
                    Ok(())
                }
            }
            Counting
        };
        let mut coll = group.lanes(&mut counting);
        scheme::encode(&q, &mut states, &[&[0.5f32; 64]], &group.ctx(1, &[64], 0), &mut coll).unwrap();
    }
}

#[test]
fn a_key_twice_in_one_ranks_bucket_is_named_by_its_place_on_every_rank() {
    for exchange in [Exchange::Lanes, Exchange::Owners, Exchange::Scatter] {
        let groups = groups_of(params(&[("compress", "2bit"), ("threshold", "0.25")]), 3, exchange);
        let threads = Threads::new(3);
        let g = grads(3, 10, 0);
        let errors: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..3)
                .map(|r| {
                    let (g, threads, groups) = (&g, &threads, &groups);
                    s.spawn(move || {
                        let layout = [("a", vec![5]), (if r == 1 { "a" } else { "b" }, vec![5])];
                        one(threads, &groups[r], r, &layout, &g[r]).unwrap_err().to_string()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let shared = "gradpack: rank 1's key at tensor 1 of its bucket was pushed twice at once";
        assert!(errors[0].starts_with(shared) && errors[0] == errors[2], "{exchange:?}: {errors:?}");
        assert_eq!(errors[1], format!("{} (on this rank: key 'a')", errors[0]), "{exchange:?}");
    }
}

#[test]
fn a_callers_mistakes_are_named_as_its_own_not_as_gradpacks() {
    let c = params(&[("compress", "2bit"), ("threshold", "0.25")]);
    let (group, other) = (Group::new(c, 0, 1, 0, 0.0).unwrap(), Group::new(c, 0, 1, 0, 0.0).unwrap());
    let threads = Threads::new(1);
    let grad = [0.5f32; 4];
    let tensors = [Tensor { key: Key::Str("a".into()), shape: vec![4], grad: &grad }];
    let engine = &mut Rank { threads: &threads, rank: 0 };
    let text = |e: Error| e.to_string();
    // Sizes and counts: a bucket longer than its tensors, none, an index past them.
    assert!(text(group.encode(&tensors, 5, true, 0, engine).err().unwrap()).contains("invalid parameter 'bucket_len'"));
    assert!(text(group.encode(&[], 0, true, 0, engine).err().unwrap()).contains("invalid parameter 'num': a bucket of 0 tensors"));
    assert!(text(group.refuse(&tensors, Own::Dtype, 1, engine)).contains("invalid parameter 'index': tensor 1 of a bucket of 1 tensors"));
    assert!(text(group.refuse(&tensors, Own::Dtype, usize::MAX, engine)).contains("invalid parameter 'index'"));
    // A zero-element tensor: taken, unless its other dimensions overflow, whatever their order.
    for shape in [vec![1 << 32, 1 << 32, 0], vec![0, 1 << 32, 1 << 32]] {
        let empty = [Tensor { key: Key::Str("z".into()), shape, grad: &[] }];
        assert!(text(group.encode(&empty, 0, true, 0, engine).err().unwrap()).contains("invalid parameter 'dims': tensor 0 (key 'z')"));
    }
    let empty = [Tensor { key: Key::Str("z".into()), shape: vec![3, 0, 5], grad: &[] }];
    let mut p = group.encode(&empty, 0, true, 0, engine).unwrap();
    group.decode_held(&mut p, &mut []).unwrap();
    group.commit(p).unwrap();
    // A pending bucket used out of order, or by another group.
    let mut p = group.encode(&tensors, 4, true, 0, engine).unwrap();
    engine.all_reduce(ReduceOp::Sum, Buffer::U64(p.words_to_sum())).unwrap();
    assert!(text(other.check(&p).unwrap_err()).contains("invalid parameter 'pending': a bucket encoded by another State"));
    let mut out = grad;
    group.decode_held(&mut p, &mut out).unwrap();
    assert!(text(group.check(&p).unwrap_err()).contains("invalid parameter 'pending': a bucket already decoded"));
    assert!(text(group.decode_held(&mut p, &mut out).unwrap_err()).contains("invalid parameter 'pending': a bucket decoded twice"));
    group.commit(p).unwrap();
    let p = group.encode(&tensors, 4, true, 0, engine).unwrap();
    assert!(text(group.commit(p).unwrap_err()).contains("invalid parameter 'pending': a bucket committed before it was decoded"));
}

#[test]
fn a_failed_collective_inside_the_batched_encodes_is_named_once() {
    struct Down(bool);
    impl Engine for Down {
        fn all_reduce(&mut self, _: ReduceOp, _: Buffer<'_>) -> Result<()> {
            if self.0 { Err(Error::Transport("the link is down".into())) } else { Ok(()) }
        }
    }
    for c in [params(&[("compress", "qsgd_mn"), ("bits", "2")]), params(&[("compress", "powersgd"), ("rank", "1")])] {
        let group = Group::new(c, 0, 1, 0, 0.0).unwrap();
        let grad = [0.5f32; 64];
        let tensors = [Tensor { key: Key::Str("a".into()), shape: vec![8, 8], grad: &grad }];
        for _ in 0..2 {
            let mut p = group.encode(&tensors, 64, true, 0, &mut Down(false)).unwrap();
            group.decode_held(&mut p, &mut [0.0; 64]).unwrap();
            group.commit(p).unwrap();
        }
        // (planned: the bucket's encodes run batched, their first collective fails)
        let err = group.encode(&tensors, 64, true, 0, &mut Down(true)).err().unwrap().to_string();
        assert_eq!(err.matches("transport:").count(), 1, "{c:?}: {err}");
        assert!(err.contains("the link is down"), "{err}");
    }
}
