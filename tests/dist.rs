//! The distributed store over real ZeroMQ sockets on loopback: a scheduler,
//! servers and workers as threads of this test, each with its own
//! configuration (the multi-process tests live in python/tests/test_dist.py).

use std::sync::atomic::{AtomicU16, Ordering};
use std::thread;
use std::time::Duration;

use gradpack::quant::compression::Compression;
use gradpack::store::param_server::auth::Secret;
use gradpack::store::param_server::{serve, Config, DistWorker, Role};
use gradpack::store::{Array, ArrayMut, Grad, Key};
use gradpack::Thresholds;

static PORT: AtomicU16 = AtomicU16::new(0);

fn config(role: Role, port: u16, workers: usize, servers: usize) -> Config {
    Config {
        role,
        root_uri: "127.0.0.1".into(),
        root_port: port,
        num_workers: workers,
        num_servers: servers,
        node_host: Some("127.0.0.1".into()),
        heartbeat_interval: Duration::from_millis(200),
        heartbeat_timeout: Duration::from_secs(3),
        register_timeout: gradpack::store::param_server::config::DEFAULT_REGISTER_TIMEOUT,
        connection_grace: gradpack::store::param_server::config::DEFAULT_CONNECTION_GRACE,
        verbose: 0,
        bigarray_bound: 1000,
        // Scheme keys of 1500 elements and more take several slices per server.
        partition_bytes: 6000,
        max_message_bytes: gradpack::store::param_server::config::DEFAULT_MAX_MESSAGE_BYTES,
        secret: None,
    }
}

/// A port below Linux's ephemeral range (32768 up), which every node's own
/// sockets draw from: none of them can take it before the scheduler binds it.
fn free_port() -> u16 {
    let base = 20000 + (std::process::id() % 12000) as u16;
    let n = PORT.fetch_add(1, Ordering::SeqCst);
    let port = base.wrapping_add(n * 7);
    std::net::TcpListener::bind(("127.0.0.1", port)).map(|_| port).unwrap_or_else(|_| free_port())
}

/// Starts the scheduler and servers; runs `work(rank, worker)` on each worker
/// thread; returns what each worker returned, after the job ended cleanly.
fn job<T: Send + 'static>(workers: usize, servers: usize, store: &'static str, work: fn(usize, &DistWorker) -> T) -> Vec<T> {
    job_with(workers, servers, store, work)
}

fn job_with<T: Send + 'static, F: Fn(usize, &DistWorker) -> T + Send + Clone + 'static>(workers: usize, servers: usize, store: &'static str, work: F) -> Vec<T> {
    let port = free_port();
    let mut nodes = vec![thread::spawn(move || serve(config(Role::Scheduler, port, workers, servers)))];
    for _ in 0..servers {
        nodes.push(thread::spawn(move || serve(config(Role::Server, port, workers, servers))));
    }
    let handles: Vec<_> = (0..workers)
        .map(|_| {
            let work = work.clone();
            thread::spawn(move || {
                let w = DistWorker::start(store, config(Role::Worker, port, workers, servers)).unwrap();
                let out = work(w.rank(), &w);
                w.close();
                out
            })
        })
        .collect();
    let mut results: Vec<T> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for n in nodes {
        n.join().unwrap().unwrap();
    }
    results.shrink_to_fit();
    results
}

fn two_bit() -> (Compression, Vec<(String, String)>) {
    (
        Compression::TwoBit(Thresholds::new(-0.5, 0.5).unwrap()),
        vec![("compress".into(), "2bit".into()), ("pos_threshold".into(), "0.5".into()), ("neg_threshold".into(), "-0.5".into())],
    )
}

fn pull(w: &DistWorker, key: &Key, shape: &[usize]) -> Vec<f32> {
    let mut out = vec![f32::NAN; shape.iter().product()];
    w.pull(key, &mut [ArrayMut { shape, data: &mut out }]).unwrap();
    out
}

/// A sync push and its round's outcome: the push's own error (its checks),
/// or, as the push returns before the other workers join its round, the
/// round's, which the key's next pull raises.
fn pushed(w: &DistWorker, key: &Key, v: &[f32], shape: &[usize]) -> Result<(), String> {
    w.push(key, &[Array { shape, data: Grad::F32(v) }]).map_err(|e| e.to_string())?;
    let shape = w.shape(key).unwrap();
    let mut out = vec![0f32; shape.iter().product()];
    w.pull(key, &mut [ArrayMut { shape: &shape, data: &mut out }]).map_err(|e| e.to_string())
}

fn compressed_rounds(rank: usize, w: &DistWorker) -> Vec<Vec<f32>> {
    let (c, params) = two_bit();
    w.set_compress(c, &params).unwrap();
    let mut seen = Vec::new();
    for (k, n) in [(Key::Int(3), 20usize), (Key::Int(4), 2500)] {
        let shape = [n];
        let init: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
        w.init(&k, Array { shape: &shape, data: Grad::F32(&init) }).unwrap();
        seen.push(pull(w, &k, &shape)); // init is lossless
        for g in [0.4f32, 0.1, 0.2, 0.3] {
            let v = vec![g; n];
            w.push(&k, &[Array { shape: &shape, data: Grad::F32(&v) }]).unwrap();
            seen.push(pull(w, &k, &shape));
        }
    }
    let _ = rank;
    seen
}

#[test]
fn compressed_sync_pushes_follow_the_residual_model() {
    for (workers, servers) in [(1, 1), (2, 2), (3, 2)] {
        let results = job(workers, servers, "dist_sync", compressed_rounds);
        let w = workers as f32;
        for seen in &results {
            for (ki, n) in [20usize, 2500].iter().enumerate() {
                let rounds = &seen[ki * 5..ki * 5 + 5];
                let init: Vec<f32> = (0..*n).map(|i| i as f32 * 0.5).collect();
                assert_eq!(rounds[0], init, "init is exact");
                // 0.4 -> 0; 0.1 -> 0.5 per worker; 0.2 -> 0; 0.3 -> 0.5 per worker
                for (r, want) in rounds[1..].iter().zip([0.0, 0.5 * w, 0.0, 0.5 * w]) {
                    assert!(r.iter().all(|&x| x == want), "{workers}x{servers}: wanted {want}, got {:?}", &r[..4]);
                }
            }
        }
    }
}

#[test]
fn async_pushes_apply_on_arrival_with_an_optimizer() {
    let results = job(2, 1, "dist_async", |rank, w| {
        w.set_optimizer("sgd", &[("learning_rate".into(), "1".into())]).unwrap();
        let shape = [4];
        w.init(&Key::Str("w".into()), Array { shape: &shape, data: Grad::F32(&[10.0; 4]) }).unwrap();
        for _ in 0..5 {
            w.push(&Key::Str("w".into()), &[Array { shape: &shape, data: Grad::F32(&[1.0; 4]) }]).unwrap();
        }
        w.barrier().unwrap();
        let v = pull(w, &Key::Str("w".into()), &shape);
        let _ = rank;
        v
    });
    for v in results {
        assert_eq!(v, vec![0.0; 4], "10 - 2 workers x 5 pushes x lr 1");
    }
}

#[test]
fn bad_requests_get_errors_and_change_nothing() {
    job(1, 1, "dist_sync", |_, w| {
        let shape = [4];
        let k = Key::Int(1);
        assert!(w.push(&k, &[Array { shape: &shape, data: Grad::F32(&[1.0; 4]) }]).unwrap_err().to_string().contains("not initialized"));
        w.init(&k, Array { shape: &shape, data: Grad::F32(&[1.0; 4]) }).unwrap();
        let err = w.push(&k, &[Array { shape: &[2], data: Grad::F32(&[1.0; 2]) }]).unwrap_err().to_string();
        assert!(err.contains("expected [4]"), "{err}");
        let (c, p) = two_bit();
        assert!(w.set_compress(c, &p).unwrap_err().to_string().contains("before initializing"));
        assert!(w.set_optimizer("rmsprop", &[]).unwrap_err().to_string().contains("unknown optimizer"));
        let local = Compression::Qsgd(gradpack::quant::compression::Qsgd::new("grandk_mn", &[4], 0, Some(2), true).unwrap());
        assert!(w.set_compress(local, &[]).unwrap_err().to_string().contains("unselected='local'"));
        assert_eq!(pull(w, &k, &shape), vec![1.0; 4]);
    });
}

#[test]
fn bad_input_is_refused_before_anything_changes() {
    use gradpack::store::Store;
    // 2 workers, 2 servers, a key split over both (bigarray_bound 1000):
    // a non-finite sum in the second slice must leave the first slice's
    // residual and every stored value as they were, on every worker. Each
    // such push fails its round for both workers (rank 0's pushes in those
    // rounds get rank 1's error, and their residuals are put back).
    let results = job(2, 2, "dist_sync", |rank, w| {
        let (c, p) = two_bit();
        w.set_compress(c, &p).unwrap();
        let shape = [1600];
        let k = Key::Int(7);
        w.init(&k, Array { shape: &shape, data: Grad::F32(&[0.0; 1600]) }).unwrap();
        let mut g = vec![0.3f32; 1600];
        w.push(&k, &[Array { shape: &shape, data: Grad::F32(&g) }]).unwrap(); // residual 0.3 everywhere
        assert_eq!(pull(w, &k, &shape), vec![0.0; 1600]);
        w.barrier().unwrap();
        for (at, bad) in [(1500, f32::NAN), (1599, f32::INFINITY), (3, f32::NEG_INFINITY)] {
            let mut poisoned = g.clone();
            if rank == 1 {
                poisoned[at] = bad;
            }
            let err = pushed(w, &k, &poisoned, &shape).unwrap_err();
            assert!(err.contains("key 7") && err.contains(&format!("at element {at}")) && err.contains("nothing was changed"), "{err}");
            if rank == 0 {
                assert!(err.contains("worker node 11 failed its push of key 7"), "{err}");
            }
        }
        if rank == 1 {
            // Validate, then mutate: an output of the wrong shape fails before the push.
            let mut wrong = vec![5f32; 8];
            let err = w.pushpull(&k, &[Array { shape: &shape, data: Grad::F32(&g) }], &mut [ArrayMut { shape: &[8], data: &mut wrong }]).unwrap_err().to_string();
            assert!(err.contains("pushpull output 0"), "{err}");
            let err = w.broadcast(&Key::Int(8), Array { shape: &[4], data: Grad::F32(&[1.0; 4]) }, &mut [ArrayMut { shape: &[8], data: &mut wrong }]).unwrap_err().to_string();
            assert!(err.contains("broadcast output 0"), "{err}");
            assert!(w.pull(&Key::Int(8), &mut [ArrayMut { shape: &[4], data: &mut wrong[..4] }]).unwrap_err().to_string().contains("not initialized"));
            assert!(wrong.iter().all(|&x| x == 5.0));
            let err = w.init(&Key::Str("w\0evil".into()), Array { shape: &[4], data: Grad::F32(&[1.0; 4]) }).unwrap_err().to_string();
            assert!(err.contains("cannot contain NUL"), "{err}");
        }
        // Both workers' second push: 0.3 + 0.3 = 0.6 -> 0.5 each, summed to 1.0,
        // exactly as if the refused pushes never happened.
        g.iter_mut().for_each(|x| *x = 0.3);
        w.push(&k, &[Array { shape: &shape, data: Grad::F32(&g) }]).unwrap();
        pull(w, &k, &shape)
    });
    for got in results {
        assert_eq!(got, vec![1.0; 1600]);
    }
}

/// Frames an outsider might send to a server: each must be dropped or refused
/// (with the refusal undeliverable to the unknown sender, node 9999), and
/// counted, while the server keeps serving exact values.
fn rogue_frames(key: &Key) -> Vec<Vec<Vec<u8>>> {
    use gradpack::store::param_server::message::{f32s_to_bytes, Command, Flag, Meta};
    let meta = |command, k: &Key, len: u64, flags: u16| {
        let mut m = Meta::new(command, 9999);
        m.key = Some(k.clone());
        m.len = len;
        m.flags = flags;
        m
    };
    let header = |th: f32, n: f32, blocks: usize| {
        let mut compr = vec![0.0f32; 3 + blocks];
        (compr[0], compr[1], compr[2]) = (-th, th, n);
        compr
    };
    let mut code_11 = header(0.5, 32.0, 2);
    code_11[3] = f32::from_bits(u32::MAX);
    let truncated = meta(Command::Push, key, 32, 0).encode();
    vec![
        // Not a message: one frame, then a header that does not decode.
        vec![b"just one frame".to_vec()],
        vec![b"bad magic header".to_vec(), Vec::new()],
        // A header cut short: its fields claim more bytes than the frame carries.
        vec![truncated[..truncated.len() - 3].to_vec(), f32s_to_bytes(&[1.0; 32])],
        // A well-formed 2-bit push holding code 0b11.
        vec![meta(Command::Push, key, 32, Flag::Compressed.bit()).encode(), f32s_to_bytes(&code_11)],
        // A 2-bit push whose header claims 64 elements for the slice of 32.
        vec![meta(Command::Push, key, 32, Flag::Compressed.bit()).encode(), f32s_to_bytes(&header(0.5, 64.0, 4))],
        // A float32 push claiming 32 elements that carries 16, and one of 7 bytes.
        vec![meta(Command::Push, key, 32, 0).encode(), f32s_to_bytes(&[9.0; 16])],
        vec![meta(Command::Push, key, 32, 0).encode(), vec![0u8; 7]],
        // Lengths and offsets far past the slice.
        vec![meta(Command::Push, key, 1 << 40, 0).encode(), f32s_to_bytes(&[9.0; 32])],
        vec![{ let mut m = meta(Command::Pull, key, 8, 0); m.offset = u64::MAX - 4; m.encode() }, Vec::new()],
        // An init of a new key claiming 64 elements that carries 32.
        vec![meta(Command::Init, &Key::Int(77), 64, 0).encode(), f32s_to_bytes(&[9.0; 32])],
    ]
}

type Node = thread::JoinHandle<gradpack::error::Result<()>>;

/// A job of one worker and one server whose postoffice (and so its traffic
/// counters) the test can read: the scheduler's and server's threads, the
/// server's postoffice, and the worker.
fn one_server_job() -> (Node, Node, std::sync::Arc<gradpack::store::param_server::postoffice::Postoffice>, DistWorker) {
    one_server_job_with(None)
}

fn one_server_job_with(secret: Option<Secret>) -> (Node, Node, std::sync::Arc<gradpack::store::param_server::postoffice::Postoffice>, DistWorker) {
    let port = free_port();
    let node = move |role| Config { secret: secret.clone(), ..config(role, port, 1, 1) };
    let sched = { let c = node(Role::Scheduler); thread::spawn(move || serve(c)) };
    let (post_tx, post_rx) = std::sync::mpsc::channel();
    let server = {
        let c = node(Role::Server);
        thread::spawn(move || {
            let post = gradpack::store::param_server::server::start_server(c)?;
            post_tx.send(post.clone()).unwrap();
            let result = post.customer.wait_until_over();
            post.stop();
            result
        })
    };
    let w = DistWorker::start("dist_sync", node(Role::Worker)).unwrap();
    let post = post_rx.recv_timeout(Duration::from_secs(60)).expect("the server registered");
    (sched, server, post, w)
}

#[test]
fn malformed_frames_do_not_hurt_a_server() {
    let (sched, server, post, w) = one_server_job();
    let shape = [32];
    let k = Key::Int(5);
    let (c, p) = two_bit();
    w.set_compress(c, &p).unwrap();
    w.init(&k, Array { shape: &shape, data: Grad::F32(&[1.0; 32]) }).unwrap();
    let dropped = |post: &gradpack::store::param_server::postoffice::Postoffice| post.van.traffic.dropped.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(dropped(&post), 0);

    let (host, server_port) = w.server_addresses()[0].clone();
    let rogue = outsider(&host, server_port, 0);
    let frames = rogue_frames(&k);
    for f in &frames {
        rogue.send_multipart(f, 0).unwrap();
    }
    // Evidence that every frame was handled: the server counted each one as
    // dropped (undecodable, or refused with nobody to answer). The deadline
    // only turns a hang into a failure.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while dropped(&post) < frames.len() as u64 {
        assert!(std::time::Instant::now() < deadline, "the server handled {} of {} rogue frames", dropped(&post), frames.len());
        thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(dropped(&post), frames.len() as u64);
    // The server still answers, the value is untouched, and the bad init created nothing.
    assert_eq!(pull(&w, &k, &shape), vec![1.0; 32]);
    w.push(&k, &[Array { shape: &shape, data: Grad::F32(&[0.6; 32]) }]).unwrap();
    assert_eq!(pull(&w, &k, &shape), vec![0.5; 32]);
    w.init(&Key::Int(77), Array { shape: &[64], data: Grad::F32(&[2.0; 64]) }).unwrap();
    assert_eq!(pull(&w, &Key::Int(77), &[64]), vec![2.0; 64]);
    w.close();
    sched.join().unwrap().unwrap();
    server.join().unwrap().unwrap();
}

#[test]
fn a_node_with_another_job_configuration_is_refused() {
    let port = free_port();
    let sched = thread::spawn(move || serve(config(Role::Scheduler, port, 1, 1)));
    let server = thread::spawn(move || serve(config(Role::Server, port, 1, 1)));
    let err = DistWorker::start("dist_sync", config(Role::Worker, port, 1, 2)).err().expect("refused");
    let text = err.to_string();
    assert!(text.contains("refused") && text.contains("servers=2") && text.contains("servers=1"), "{text}");
    the_job_still_runs_and_ends(config(Role::Worker, port, 1, 1), sched, server);
}

/// A job of one worker and two servers where only server 0 ever comes: the
/// scheduler once waited for the others forever. Now it exits at its
/// registration deadline (GRADPACK_REGISTER_TIMEOUT, 2 s here) with an error
/// naming the nodes that never registered, and tells server 0, which stops
/// waiting for the node table with the same reason.
#[test]
fn a_scheduler_whose_nodes_never_come_exits_at_the_registration_deadline() {
    let port = free_port();
    let node = move |role, deadline| Config { register_timeout: deadline, ..config(role, port, 1, 2) };
    let (tx, rx) = std::sync::mpsc::channel();
    for role in [Role::Scheduler, Role::Server] {
        let (tx, c) = (tx.clone(), node(role, if role == Role::Scheduler { Duration::from_secs(2) } else { Duration::from_secs(120) }));
        thread::spawn(move || tx.send((role, serve(c))).unwrap());
    }
    let mut ended = std::collections::HashMap::new();
    for _ in 0..2 {
        let (role, result) = rx.recv_timeout(Duration::from_secs(60)).expect("the scheduler and the server end within 60 s");
        ended.insert(role.name(), result.expect_err("the job never formed").to_string());
    }
    let said = &ended["scheduler"];
    eprintln!("scheduler: {said}\nserver: {}", ended["server"]);
    assert!(said.contains("GRADPACK_REGISTER_TIMEOUT=2 s") && said.contains("server 1, worker 0") && said.contains("registered: server 0"), "{said}");
    assert!(ended["server"].contains("server 1, worker 0"), "{}", ended["server"]);
}

#[test]
fn a_dead_server_fails_pending_requests_within_the_timeout() {
    let port = free_port();
    let sched = thread::spawn(move || serve(config(Role::Scheduler, port, 1, 1)));
    // A "server" that registers, then goes silent: its postoffice stops heartbeating.
    let server = thread::spawn(move || {
        let post = gradpack::store::param_server::postoffice::Postoffice::start(config(Role::Server, port, 1, 1), Some(Box::new(|_: &gradpack::store::param_server::postoffice::NodeInfo| -> gradpack::store::param_server::postoffice::RequestHandler { Box::new(|_| Vec::new()) }))).unwrap();
        post.stop();
        std::thread::sleep(Duration::from_secs(5));
    });
    // The pending init fails with an error naming the dead server, and the
    // scheduler ends the job naming it too. The 60 s bounds only turn a hang
    // into a failure; the events are what is checked.
    let (done, outcome) = std::sync::mpsc::channel();
    let worker = thread::spawn(move || {
        let w = DistWorker::start("dist_sync", config(Role::Worker, port, 1, 1)).unwrap();
        let _ = done.send(w.init(&Key::Int(0), Array { shape: &[2], data: Grad::F32(&[3.0, 4.0]) }).map_err(|e| e.to_string()));
    });
    let err = outcome.recv_timeout(Duration::from_secs(60)).expect("the pending init never ended").unwrap_err();
    assert!(err.contains("sent no heartbeat") && err.contains("server 0"), "{err}");
    let sched_err = sched.join().unwrap().unwrap_err().to_string();
    assert!(sched_err.contains("server 0"), "{sched_err}");
    worker.join().unwrap();
    server.join().unwrap();
}

#[test]
fn dist_sync_device_merges_local_devices_before_one_push() {
    let results = job(2, 2, "dist_sync_device", |_, w| {
        let (c, p) = two_bit();
        w.set_compress(c, &p).unwrap();
        let shape = [1500];
        w.init(&Key::Int(0), Array { shape: &shape, data: Grad::F32(&[0.0; 1500]) }).unwrap();
        // Two local devices of 0.2 each: merged 0.4 -> nothing; then 0.8 -> 0.5 per worker.
        let dev = vec![0.2f32; 1500];
        let mut seen = Vec::new();
        for _ in 0..2 {
            w.push(&Key::Int(0), &[Array { shape: &shape, data: Grad::F32(&dev) }, Array { shape: &shape, data: Grad::F32(&dev) }]).unwrap();
            seen.push(pull(w, &Key::Int(0), &shape));
        }
        seen
    });
    for seen in results {
        assert!(seen[0].iter().all(|&x| x == 0.0));
        assert!(seen[1].iter().all(|&x| x == 1.0), "2 workers x 0.5");
    }
}

fn scheme_params(i: usize) -> Vec<(String, String)> {
    let all: [&[(&str, &str)]; 7] = [
        &[("compress", "qsgd_mn"), ("bits", "2"), ("seed", "4")],
        &[("compress", "qsgd_mn_ts"), ("bits", "[2, 6]")],
        &[("compress", "qsgd_mn_ms"), ("bits", "[1, 3, 8]")],
        &[("compress", "grandk_mn"), ("bits", "4"), ("k", "17")],
        &[("compress", "grandk_mn_ts"), ("bits", "[2, 4]"), ("k", "30")],
        &[("compress", "powersgd"), ("rank", "2")],
        &[("compress", "1bit"), ("threshold", "0.1")],
    ];
    all[i].iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn scheme_grad(rank: usize, step: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| (((i * 31 + rank * 17 + step * 7) % 23) as f32 - 11.0) * 0.05 * (1.0 + rank as f32)).collect()
}

/// Every scheme on dist_sync (3 workers, 2 servers) gives the device
/// store's bits, on a key one server holds, on one cut over both servers
/// (2000 elements, above the big-array bound) and on one cut into slices
/// dealt twice round them (6000 elements, 4 partitions; PowerSGD keeps
/// one slice per server): each server decodes
/// its slice, random-K's few coordinates fall unevenly on the two, and
/// PowerSGD's float32 sums are added in rank order on every server. With
/// 2 workers, qsgd_mn_ms's sums (codes in -1..=1 from 1-bit scales, 5
/// values) and 1-bit's (3 values) are pulled as base-k digits
/// (`quant::digits`), and give the same bits.
#[test]
fn every_scheme_on_the_servers_matches_the_device_store() {
    let runs = (0..7).map(|i| (3, i)).chain([(2, 2), (2, 6)]);
    for (workers, i) in runs {
        for shape in [[6usize, 10], [40, 50], [60, 100]] {
            let n: usize = shape.iter().product();
            let results = job_with(workers, 2, "dist_sync", move |rank, w| {
                let params = scheme_params(i);
                let c = Compression::from_params(params.iter().map(|(k, v)| (k.as_str(), v.as_str()))).unwrap();
                w.set_compress(c, &params).unwrap();
                let key = Key::Str("w".into());
                let zeros = vec![0.0; n];
                w.init(&key, Array { shape: &shape, data: Grad::F32(&zeros) }).unwrap();
                w.barrier().unwrap(); // rank 0's init is sent before the count starts
                let sent_before = w.stats().0;
                let device = gradpack::store::KVStore::new("device").unwrap();
                device.set_compress(c).unwrap();
                device.init(&key, Array { shape: &shape, data: Grad::F32(&zeros) }).unwrap();
                for step in 0..4 {
                    let g = scheme_grad(rank, step, n);
                    w.push(&key, &[Array { shape: &shape, data: Grad::F32(&g) }]).unwrap();
                    let all: Vec<Vec<f32>> = (0..workers).map(|r| scheme_grad(r, step, n)).collect();
                    let arrays: Vec<Array> = all.iter().map(|g| Array { shape: &shape, data: Grad::F32(g) }).collect();
                    device.push(&key, &arrays).unwrap();
                    w.barrier().unwrap(); // every worker's push is in before anyone pulls
                    let local = w.local_pulls();
                    let (got, want) = (pull(w, &key, &shape), device.value(&key).unwrap());
                    // The servers sent the value with their answer to the round (PowerSGD's: its Q).
                    assert_eq!(w.local_pulls() - local, !matches!(c, Compression::PowerSgd { .. }) as u64, "{} {shape:?}", c.name());
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{} {shape:?} step {step}", c.name());
                    assert!(got.iter().any(|&x| x != 0.0), "{} {shape:?}: nothing arrived", c.name());
                    w.barrier().unwrap();
                }
                w.stats().0 - sent_before
            });
            // Every worker runs the same exchanges and pushes over the rounds, so
            // each hands the transport the same number of bytes.
            assert!(results[0] > 0 && results.iter().all(|&sent| sent == results[0]), "scheme {i}, {workers} workers, {shape:?}: bytes sent by each worker {results:?}");
        }
    }
}

#[test]
fn a_failed_scheme_round_fails_every_worker_and_the_next_one_works() {
    job(2, 1, "dist_sync", |rank, w| {
        let params = scheme_params(0);
        let c = Compression::from_params(params.iter().map(|(k, v)| (k.as_str(), v.as_str()))).unwrap();
        w.set_compress(c, &params).unwrap();
        let shape = [8usize];
        let k = Key::Int(3);
        w.init(&k, Array { shape: &shape, data: Grad::F32(&[1.0; 8]) }).unwrap();
        let g = if rank == 0 { [f32::INFINITY; 8] } else { [0.5; 8] };
        let err = pushed(w, &k, &g, &shape).unwrap_err();
        assert!(err.contains("non-finite"), "{err}");
        w.barrier().unwrap();
        assert_eq!(pull(w, &k, &shape), vec![1.0; 8]);
        // 2 workers * 0.5 at 2 bits with scale 0.5: codes 3 each, exactly 1.0
        w.push(&k, &[Array { shape: &shape, data: Grad::F32(&[0.5; 8]) }]).unwrap();
        w.barrier().unwrap();
        assert_eq!(pull(w, &k, &shape), vec![1.0; 8]);
    });
    job(1, 1, "dist_async", |_, w| {
        let params = scheme_params(0);
        let c = Compression::from_params(params.iter().map(|(k, v)| (k.as_str(), v.as_str()))).unwrap();
        assert!(w.set_compress(c, &params).unwrap_err().to_string().contains("use 'dist_sync'"));
    });
}

/// A DEALER socket of a process outside the job, connected to `host:port`
/// (it keeps its ZeroMQ context alive); unsent frames wait `linger_ms` at close.
fn outsider(host: &str, port: u16, linger_ms: i32) -> zmq::Socket {
    let s = zmq::Context::new().socket(zmq::DEALER).unwrap();
    s.set_linger(linger_ms).unwrap();
    s.connect(&format!("tcp://{host}:{port}")).unwrap();
    s
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// Registrations an outsider might send the scheduler: a host that is no
/// address (once: the scheduler exited), port 0, and 400 refused ones (once:
/// two file descriptors left open by each). The scheduler survives, closes
/// what it opened, and the job then runs with exact values.
#[test]
fn rogue_registrations_do_not_hurt_the_scheduler() {
    use gradpack::store::param_server::message::{encode_pairs, Command, Meta};
    let port = free_port();
    let sched = thread::spawn(move || serve(config(Role::Scheduler, port, 1, 1)));
    let rogue = outsider("127.0.0.1", port, 0);
    let register = |host: &str, port: &str, job: &str| {
        let mut m = Meta::new(Command::Register, 0);
        m.body = encode_pairs([("role", "worker"), ("host", host), ("port", port), ("job", job)]);
        vec![m.encode(), Vec::new()]
    };
    // The job forms first; then the outsider registers.
    let server = thread::spawn(move || serve(config(Role::Server, port, 1, 1)));
    let w = DistWorker::start("dist_sync", config(Role::Worker, port, 1, 1)).unwrap();
    w.init(&Key::Int(0), Array { shape: &[2], data: Grad::F32(&[3.0, 4.0]) }).unwrap();
    let before = open_fds();
    for f in [register("no host", "1", "x"), register("", "1", "x"), register("127.0.0.1", "0", "x"), register("-rm", "1", "x")] {
        rogue.send_multipart(f, 0).unwrap();
    }
    // Refused (the job is full, and of another configuration), each refusal
    // sent to a port where nobody listens.
    let closed = free_port();
    for _ in 0..400 {
        rogue.send_multipart(register("127.0.0.1", &closed.to_string(), "another job"), 0).unwrap();
    }
    // The job still runs, with exact values.
    w.push(&Key::Int(0), &[Array { shape: &[2], data: Grad::F32(&[1.0, 2.0]) }]).unwrap();
    assert_eq!(pull(&w, &Key::Int(0), &[2]), vec![1.0, 2.0]);
    // The refusals' sockets close within their 2 s linger: none of the 400
    // leaves a descriptor behind (each once left two).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while open_fds() > before + 8 {
        assert!(std::time::Instant::now() < deadline, "{} descriptors open, {before} before 400 refusals", open_fds());
        thread::sleep(Duration::from_millis(100));
    }
    w.close();
    sched.join().unwrap().unwrap();
    server.join().unwrap().unwrap();
}

/// Scheme frames that claim 2^40 or 2^62 values in a few bytes: once an
/// abort on allocation, then a panic of the receive thread. Now each is
/// refused and counted, and the server goes on serving exact values.
#[test]
fn scheme_frames_claiming_huge_sizes_are_refused() {
    use gradpack::store::param_server::message::{encode_pairs, Command, Flag, Meta};
    let (sched, server, post, w) = one_server_job();
    let params: Vec<(String, String)> = [("compress", "qsgd_mn"), ("bits", "2")].iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    w.set_compress(Compression::from_params(params.iter().map(|(k, v)| (k.as_str(), v.as_str()))).unwrap(), &params).unwrap();
    let k = Key::Int(3);
    w.init(&k, Array { shape: &[16], data: Grad::F32(&[1.0; 16]) }).unwrap();
    let (host, server_port) = w.server_addresses()[0].clone();
    let rogue = outsider(&host, server_port, 0);
    let mut frames = Vec::new();
    for n in [1u64 << 40, 1 << 62] {
        for (flags, body) in [(Flag::Scheme.bit(), encode_pairs([("step", "0")])), (Flag::Exchange.bit(), encode_pairs([("op", "max"), ("step", "0"), ("phase", "0")]))] {
            // kind 2 (codes) in -1..=1, and kind 1 (scale indices) of 2 scales
            let mut codes = vec![2u8];
            codes.extend(n.to_le_bytes());
            codes.extend((-1i32).to_le_bytes());
            codes.extend(1i32.to_le_bytes());
            codes.extend([0u8; 8]);
            let mut levels = vec![1u8];
            levels.extend(n.to_le_bytes());
            levels.extend([2u8; 9]);
            for payload in [codes, levels] {
                let mut m = Meta::new(Command::Push, 9999);
                m.key = Some(k.clone());
                m.len = 16;
                m.flags = flags;
                m.body = body.clone();
                frames.push(vec![m.encode(), payload]);
            }
        }
    }
    let dropped = || post.van.traffic.dropped.load(std::sync::atomic::Ordering::Relaxed);
    for f in &frames {
        rogue.send_multipart(f, 0).unwrap();
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while dropped() < frames.len() as u64 {
        assert!(std::time::Instant::now() < deadline, "the server handled {} of {} frames", dropped(), frames.len());
        thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(dropped(), frames.len() as u64);
    // qsgd_mn at 2 bits: a constant gradient is exact (every element at the scale).
    w.push(&k, &[Array { shape: &[16], data: Grad::F32(&[0.5; 16]) }]).unwrap();
    assert_eq!(pull(&w, &k, &[16]), vec![0.5; 16]);
    w.close();
    sched.join().unwrap().unwrap();
    server.join().unwrap().unwrap();
}

/// What an outsider without the job's secret could do before: overwrite a
/// value, set the optimizer, end the job with WorkerDone, stop a node with
/// Terminate or NodeFailed, keep a node alive with heartbeats, register. With
/// GRADPACK_SECRET every such frame is dropped before it is parsed (also
/// when signed with another secret), values stay exact and the job ends 0.
#[test]
fn a_job_with_a_secret_drops_every_forged_message() {
    use gradpack::store::param_server::auth::Auth;
    use gradpack::store::param_server::message::{encode_pairs, f32s_to_bytes, Command, Meta};
    let secret = Secret::new(b"the job's secret").unwrap();
    let (sched, server, post, w) = one_server_job_with(Some(secret));
    let k = Key::Int(5);
    w.init(&k, Array { shape: &[4], data: Grad::F32(&[1.0; 4]) }).unwrap();
    let frame = |command, sender: i32, body: &str, data: Vec<u8>| {
        let mut m = Meta::new(command, sender);
        m.key = Some(k.clone());
        m.len = 4;
        m.body = body.to_string();
        vec![m.encode(), data]
    };
    let forged = vec![
        frame(Command::Push, 9, "", f32s_to_bytes(&[1000.0; 4])), // as the worker (node 9)
        frame(Command::SetOptimizer, 9, &encode_pairs([("name", "sgd"), ("learning_rate", "1000")]), Vec::new()),
        frame(Command::Terminate, 1, "", Vec::new()),
        frame(Command::NodeFailed, 1, "the attacker's words", Vec::new()),
        frame(Command::WorkerDone, 9, "", Vec::new()),
        frame(Command::Heartbeat, 8, "", Vec::new()),
        frame(Command::Register, 0, &encode_pairs([("role", "worker"), ("host", "127.0.0.1"), ("port", "1"), ("job", "workers=1 servers=1 bigarray_bound=1000")]), Vec::new()),
    ];
    // The same frames signed with another secret.
    let other = Auth::new(Secret::new(b"a guess").unwrap());
    let signed: Vec<Vec<Vec<u8>>> = forged.iter().map(|f| { let tag = other.sign(1, &f[0], &f[1]).unwrap(); vec![f[0].clone(), f[1].clone(), tag] }).collect();
    let send_all = |host: &str, port: u16| {
        let s = outsider(host, port, 1000);
        for f in forged.iter().chain(&signed) {
            s.send_multipart(f, 0).unwrap();
        }
        s
    };
    let (host, server_port) = w.server_addresses()[0].clone();
    let (worker_host, worker_port) = w.address();
    let _to_server = send_all(&host, server_port);
    let _to_worker = send_all(&worker_host, worker_port);
    let _to_scheduler = send_all("127.0.0.1", post.config.root_port);
    let dropped = || post.van.traffic.dropped.load(std::sync::atomic::Ordering::Relaxed);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while dropped() < 2 * forged.len() as u64 {
        assert!(std::time::Instant::now() < deadline, "the server dropped {} of {} forged frames", dropped(), 2 * forged.len());
        thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(dropped(), 2 * forged.len() as u64);
    while w.dropped() < 2 * forged.len() as u64 {
        assert!(std::time::Instant::now() < deadline, "the worker dropped {} of {} forged frames", w.dropped(), 2 * forged.len());
        thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(w.dropped(), 2 * forged.len() as u64);
    // The job goes on: no optimizer was set, the value was not overwritten,
    // the worker and server were not stopped, the scheduler did not end the job.
    assert_eq!(pull(&w, &k, &[4]), vec![1.0; 4]);
    w.push(&k, &[Array { shape: &[4], data: Grad::F32(&[0.25; 4]) }]).unwrap();
    assert_eq!(pull(&w, &k, &[4]), vec![0.25; 4]);
    w.close();
    sched.join().unwrap().unwrap();
    server.join().unwrap().unwrap();
}

/// A node whose secret differs from the scheduler's is refused at once with a
/// reason that names the variable, and the job it tried to join is unaffected.
#[test]
fn a_node_with_another_secret_is_refused_with_a_clear_error() {
    let port = free_port();
    let secret = Secret::new(b"right").unwrap();
    let node = move |role, s: &Secret| Config { secret: Some(s.clone()), ..config(role, port, 1, 1) };
    let sched = { let c = node(Role::Scheduler, &secret); thread::spawn(move || serve(c)) };
    let server = { let c = node(Role::Server, &secret); thread::spawn(move || serve(c)) };
    for wrong in [Some(Secret::new(b"wrong").unwrap()), None] {
        let c = Config { secret: wrong, ..config(Role::Worker, port, 1, 1) };
        let err = DistWorker::start("dist_sync", c).err().expect("refused").to_string();
        assert!(err.contains("refused this worker's messages") && err.contains("GRADPACK_SECRET"), "{err}");
    }
    the_job_still_runs_and_ends(node(Role::Worker, &secret), sched, server);
}

/// After refused nodes: the job's own worker joins, gets exact values and
/// closes, and the scheduler and server end cleanly.
fn the_job_still_runs_and_ends(worker: Config, sched: Node, server: Node) {
    let w = DistWorker::start("dist_sync", worker).unwrap();
    w.init(&Key::Int(0), Array { shape: &[2], data: Grad::F32(&[3.0, 4.0]) }).unwrap();
    assert_eq!(pull(&w, &Key::Int(0), &[2]), vec![3.0, 4.0]);
    w.close();
    sched.join().unwrap().unwrap();
    server.join().unwrap().unwrap();
}

/// One worker pushes once more than the other, which then closes normally:
/// the extra push fails with an error naming the closed worker (it used to
/// wait forever), the value is the last complete round's, and the job ends.
#[test]
fn unequal_push_counts_give_an_error_not_a_hang() {
    let results = job_with(2, 1, "dist_sync", |rank, w: &DistWorker| {
        let k = Key::Int(1);
        w.init(&k, Array { shape: &[4], data: Grad::F32(&[0.0; 4]) }).unwrap();
        w.push(&k, &[Array { shape: &[4], data: Grad::F32(&[1.0; 4]) }]).unwrap();
        w.barrier().unwrap();
        if rank == 1 {
            return Ok(pull(w, &k, &[4])); // closes after one push
        }
        let err = pushed(w, &k, &[5.0; 4], &[4]).unwrap_err();
        Err((err, pull(w, &k, &[4])))
    });
    assert!(results.contains(&Ok(vec![2.0; 4])), "{results:?}");
    let (err, value) = results.iter().find_map(|r| r.clone().err()).expect("rank 0's extra push failed");
    assert!(err.contains("worker node 11 closed its store") && err.contains("key 1"), "{err}");
    assert_eq!(value, vec![2.0; 4]);
}

/// A worker whose push fails on the worker (a wrong shape, a NaN under
/// 2-bit) tells the servers: the round fails for every worker with an error
/// naming it and the cause (the others used to wait until the job was
/// stopped). The value and every worker's residuals are as before the round,
/// and the next rounds are exact.
#[test]
fn a_push_that_fails_on_one_worker_fails_the_round_for_all() {
    let results = job_with(2, 2, "dist_sync", |rank, w: &DistWorker| {
        let k = Key::Int(3);
        let (c, p) = two_bit();
        w.set_compress(c, &p).unwrap();
        w.init(&k, Array { shape: &[2000], data: Grad::F32(&[0.0; 2000]) }).unwrap(); // split over both servers
        let g = [0.3f32; 2000];
        let push = |v: &[f32], shape: &[usize]| w.push(&k, &[Array { shape, data: Grad::F32(v) }]);
        // Round 1: rank 1's push has the wrong shape; rank 0's 0.3 must not stay in its residual.
        let err = if rank == 1 { pushed(w, &k, &g[..4], &[4]) } else { pushed(w, &k, &g, &[2000]) }.unwrap_err();
        // Round 2: rank 0 has a NaN; rank 1's 0.3 must not stay in its residual.
        let mut nan = g.to_vec();
        nan[1500] = f32::NAN;
        let err2 = pushed(w, &k, if rank == 0 { &nan } else { &g }, &[2000]).unwrap_err();
        let untouched = pull(w, &k, &[2000]);
        // Residuals 0 + 0.3 on both: below the threshold, nothing is sent.
        push(&g, &[2000]).unwrap();
        let quiet = pull(w, &k, &[2000]);
        // 0.3 + 0.3 = 0.6 on both: 0.5 each.
        push(&g, &[2000]).unwrap();
        (rank, err, err2, untouched, quiet, pull(w, &k, &[2000]))
    });
    for (rank, err, err2, untouched, quiet, after) in results {
        if rank == 1 {
            assert!(err.contains("has shape [4]"), "{err}");
        } else {
            assert!(err.contains("worker node 11 failed its push of key 3") && err.contains("has shape [4]"), "{err}");
        }
        if rank == 0 {
            assert!(err2.contains("at element 1500"), "{err2}");
        } else {
            assert!(err2.contains("worker node 9 failed its push of key 3") && err2.contains("at element 1500"), "{err2}");
        }
        assert_eq!(untouched, vec![0.0; 2000]);
        assert_eq!(quiet, vec![0.0; 2000]);
        assert_eq!(after, vec![1.0; 2000]);
    }
}

/// The same for a scheme (qsgd_mn): a worker whose push fails before its
/// first exchange (a wrong shape) fails the round for every worker (they
/// used to wait forever); a NaN fails it through the scheme's own exchange;
/// the next round is exact.
#[test]
fn a_scheme_push_that_fails_on_one_worker_fails_the_round_for_all() {
    // A key on one server, one cut over two (its round aborted on both), and
    // one cut into 4 slices dealt round them (aborted in every slice).
    for (servers, n) in [(1usize, 64usize), (2, 2048), (2, 4096)] {
        let results = job_with(2, servers, "dist_sync", move |rank, w: &DistWorker| {
            let params: Vec<(String, String)> = [("compress", "qsgd_mn"), ("bits", "2")].iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            w.set_compress(Compression::from_params(params.iter().map(|(k, v)| (k.as_str(), v.as_str()))).unwrap(), &params).unwrap();
            let k = Key::Int(4);
            w.init(&k, Array { shape: &[n], data: Grad::F32(&vec![0.0; n]) }).unwrap();
            let g = vec![0.5f32; n];
            let push = |v: &[f32], shape: &[usize]| w.push(&k, &[Array { shape, data: Grad::F32(v) }]);
            let err = if rank == 1 { pushed(w, &k, &g[..4], &[4]) } else { pushed(w, &k, &g, &[n]) }.unwrap_err();
            let mut nan = g.to_vec();
            nan[n - 7] = f32::NAN;
            let err2 = pushed(w, &k, if rank == 0 { &nan } else { &g }, &[n]).unwrap_err();
            let untouched = pull(w, &k, &[n]);
            push(&g, &[n]).unwrap();
            (rank, err, err2, untouched, pull(w, &k, &[n]))
        });
        for (rank, err, err2, untouched, after) in results {
            if rank == 0 {
                assert!(err.contains("worker node 11 failed its push of key 4") && err.contains("has shape [4]"), "{err}");
            }
            // A NaN reaches every worker through the scheme's own first exchange.
            assert!(err2.contains("non-finite"), "{err2}");
            assert_eq!(untouched, vec![0.0; n]);
            assert_eq!(after, vec![1.0; n]); // qsgd_mn at 2 bits: a constant gradient is exact
        }
    }
}

/// A server that can no longer serve (its handler panicked: a bug) tells the
/// scheduler, which ends the job on every node with the server's reason. The
/// report is played here by a message signed with the job's secret, as the
/// server sends it (no input reaches a panic to test it end to end).
#[test]
fn a_server_that_stops_serving_ends_the_job_with_its_reason() {
    use gradpack::store::param_server::message::{Command, Message, Meta, Payload};
    let secret = Secret::new(b"job").unwrap();
    let (sched, server, post, w) = one_server_job_with(Some(secret.clone()));
    w.init(&Key::Int(1), Array { shape: &[2], data: Grad::F32(&[1.0, 2.0]) }).unwrap();
    let mut m = Meta::new(Command::NodeFailed, post.me.id);
    m.body = "server node 8 stopped serving after an internal error (a bug in gradpack)".into();
    post.van.send(1, Message { meta: m, data: Payload::empty() }).unwrap();
    let err = sched.join().unwrap().unwrap_err().to_string();
    assert!(err.contains("server 0") && err.contains("stopped serving after an internal error"), "{err}");
    let err = server.join().unwrap().unwrap_err().to_string();
    assert!(err.contains("stopped serving"), "{err}");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let err = loop {
        match w.push(&Key::Int(1), &[Array { shape: &[2], data: Grad::F32(&[1.0, 1.0]) }]) {
            Err(e) => break e.to_string(),
            Ok(()) => assert!(std::time::Instant::now() < deadline, "the worker never learned that the job failed"),
        }
    };
    assert!(err.contains("stopped serving"), "{err}");
    w.close();
}

/// Every compression's worker state survives a checkpoint on dist_sync: a
/// job stopped after 3 of 6 pushes, each worker saving its own compression
/// states and the value, and a new job that loads them, ends where an
/// uninterrupted job ends. 2-bit uses a key of 2 slices (2 servers).
#[test]
fn a_checkpoint_resumes_every_scheme_on_dist_sync() {
    for i in 0..8 {
        // (params, shape): 2-bit on a key above the big-array bound, split over both servers.
        let (params, shape): (Vec<(String, String)>, Vec<usize>) = if i == 7 { (two_bit().1, vec![1200]) } else { (scheme_params(i), vec![6, 10]) };
        let n: usize = shape.iter().product();
        let run = move |rank: usize, w: &DistWorker, value: Vec<f32>, steps: std::ops::Range<usize>, blob: Option<Vec<u8>>| {
            let c = Compression::from_params(params.iter().map(|(k, v)| (k.as_str(), v.as_str()))).unwrap();
            w.set_compress(c, &params).unwrap();
            let key = Key::Str("w".into());
            w.init(&key, Array { shape: &shape, data: Grad::F32(&value) }).unwrap();
            if let Some(b) = blob {
                w.load_compression_states(&b).unwrap();
            }
            for step in steps {
                let g = scheme_grad(rank, step, n);
                w.push(&key, &[Array { shape: &shape, data: Grad::F32(&g) }]).unwrap();
            }
            w.barrier().unwrap();
            let out = (rank, pull(w, &key, &shape), w.save_compression_states().unwrap());
            w.barrier().unwrap();
            out
        };
        // Results come in thread order; ranks are the scheduler's.
        let by_rank = |mut v: Vec<(usize, Vec<f32>, Vec<u8>)>| {
            v.sort_by_key(|r| r.0);
            v
        };
        let start = vec![0.5f32; n];
        let straight = by_rank(job_with(2, 2, "dist_sync", {
            let (run, start) = (run.clone(), start.clone());
            move |rank, w| run(rank, w, start.clone(), 0..6, None)
        }));
        let first = by_rank(job_with(2, 2, "dist_sync", {
            let (run, start) = (run.clone(), start.clone());
            move |rank, w| run(rank, w, start.clone(), 0..3, None)
        }));
        let (value, blobs) = (first[0].1.clone(), first.iter().map(|r| r.2.clone()).collect::<Vec<_>>());
        let resumed = by_rank(job_with(2, 2, "dist_sync", move |rank, w| run(rank, w, value.clone(), 3..6, Some(blobs[rank].clone()))));
        for rank in 0..2 {
            let (got, want) = (&resumed[rank].1, &straight[rank].1);
            assert_eq!(got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), "scheme {i} rank {rank}");
        }
    }
}

/// A job of `workers` workers and `servers` servers with a secret, every
/// node of which the test can reach: the scheduler's transport, each
/// server's postoffice, the workers (by rank).
struct Secured {
    port: u16,
    scheduler: std::sync::Arc<gradpack::store::param_server::van::Van>,
    sched: Node,
    servers: Vec<(std::sync::Arc<gradpack::store::param_server::postoffice::Postoffice>, Node)>,
    workers: Vec<DistWorker>,
}

fn secured_job(secret: &Secret, workers: usize, servers: usize) -> Secured {
    let port = free_port();
    let node = |role| Config { secret: Some(secret.clone()), ..config(role, port, workers, servers) };
    let scheduler = gradpack::store::param_server::scheduler::Scheduler::bind(node(Role::Scheduler)).unwrap();
    let van = scheduler.van.clone();
    let sched = thread::spawn(move || scheduler.run());
    let server_threads: Vec<_> = (0..servers)
        .map(|_| {
            let c = node(Role::Server);
            let (tx, rx) = std::sync::mpsc::channel();
            let t = thread::spawn(move || {
                let post = gradpack::store::param_server::server::start_server(c)?;
                tx.send(post.clone()).unwrap();
                let result = post.customer.wait_until_over();
                post.stop();
                result
            });
            (rx, t)
        })
        .collect();
    let worker_threads: Vec<_> = (0..workers).map(|_| { let c = node(Role::Worker); thread::spawn(move || DistWorker::start("dist_sync", c).unwrap()) }).collect();
    let mut ws: Vec<DistWorker> = worker_threads.into_iter().map(|t| t.join().unwrap()).collect();
    ws.sort_by_key(|w| w.rank());
    let mut srv: Vec<_> = server_threads.into_iter().map(|(rx, t)| (rx.recv_timeout(Duration::from_secs(60)).unwrap(), t)).collect();
    srv.sort_by_key(|(p, _)| p.me.rank);
    Secured { port, scheduler: van, sched, servers: srv, workers: ws }
}

impl Secured {
    /// Every worker pushes its gradient of `key` once, then all pull.
    fn round(&self, key: &Key, grads: &[Vec<f32>]) -> Vec<Vec<f32>> {
        thread::scope(|s| {
            let hs: Vec<_> = self.workers.iter().zip(grads).map(|(w, g)| s.spawn(move || {
                w.push(key, &[Array { shape: &[g.len()], data: Grad::F32(g) }]).unwrap();
                pull(w, key, &[g.len()])
            })).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn init(&self, key: &Key, value: &[f32]) {
        thread::scope(|s| {
            for w in &self.workers {
                s.spawn(move || w.init(key, Array { shape: &[value.len()], data: Grad::F32(value) }).unwrap());
            }
        });
    }

    fn end(self) {
        for w in &self.workers {
            w.close();
        }
        self.sched.join().unwrap().unwrap();
        for (_, t) in self.servers {
            t.join().unwrap().unwrap();
        }
    }
}

/// The frames `van` would send node `to`: header, payload and its genuine
/// authentication frame (signed as the node signs, with its own key state).
fn genuine(van: &gradpack::store::param_server::van::Van, to: i32, meta: gradpack::store::param_server::message::Meta, payload: Vec<u8>) -> Vec<Vec<u8>> {
    let header = meta.encode();
    let tag = van.auth().unwrap().sign(to, &header, &payload).unwrap();
    vec![header, payload, tag]
}

/// Waits until `count` reaches `want` (60 s at most), then checks it stays there.
fn reaches(what: &str, count: impl Fn() -> u64, want: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while count() < want {
        assert!(std::time::Instant::now() < deadline, "{what}: {} of {want}", count());
        thread::sleep(Duration::from_millis(10));
    }
    thread::sleep(Duration::from_millis(200));
    assert_eq!(count(), want, "{what}");
}

/// Frames each node genuinely signed for one node, replayed to another of
/// the same job: the scheduler's BarrierDone for worker 0 sent to worker 1
/// (it used to release worker 1 early, which then hung in its next barrier),
/// a worker's push for one server sent to the other (it used to end the job:
/// "not initialized on this server"). An insider's frame that names another
/// sender, a command from a role that never sends it, and an async push to
/// a dist_sync job are refused too. Each is counted where it arrived; the
/// job's values stay exact and its barriers hold.
#[test]
fn genuine_frames_replayed_to_another_node_are_refused() {
    use gradpack::store::param_server::message::{Command, Flag, Meta};
    let secret = Secret::new(b"one job").unwrap();
    let job = secured_job(&secret, 2, 2);
    let k = Key::Int(3);
    job.init(&k, &[1.0; 4]);
    let (w0, w1) = (&job.workers[0], &job.workers[1]);
    let (p0, p1) = (w0.postoffice(), w1.postoffice());
    let (s8, s10) = (&job.servers[0].0, &job.servers[1].0);
    let push = |sender: i32, flags: u16| {
        let mut m = Meta::new(Command::Push, sender);
        (m.key, m.len, m.flags, m.request_id) = (Some(k.clone()), 4, flags, 1 << 40);
        m
    };
    let values = gradpack::store::param_server::message::f32s_to_bytes(&[1000.0; 4]);
    let send = |host: &str, port: u16, frames: Vec<Vec<u8>>| outsider(host, port, 1000).send_multipart(frames, 0).unwrap();
    let at = |p: &gradpack::store::param_server::postoffice::Postoffice| (p.me.host.clone(), p.me.port);
    let dropped = |p: &gradpack::store::param_server::postoffice::Postoffice| p.van.traffic.dropped.load(Ordering::Relaxed);

    // To worker 1: the scheduler's BarrierDone and worker 0's Terminate (a worker never sends one).
    let (h, port) = at(p1);
    send(&h, port, genuine(&job.scheduler, p0.me.id, Meta::new(Command::BarrierDone, 1), Vec::new()));
    send(&h, port, genuine(&p0.van, p1.me.id, Meta::new(Command::Terminate, p0.me.id), Vec::new()));
    reaches("worker 1's drops", || dropped(p1), 2);
    // To each server: worker 0's push for the other; one that names worker 1
    // as its sender; an async push (dist_sync job), answered with an error that
    // worker 0 drops (no request of its waits for it); a server's push.
    for (to, other) in [(s8, s10), (s10, s8)] {
        let (h, port) = at(to);
        send(&h, port, genuine(&p0.van, other.me.id, push(p0.me.id, 0), values.clone()));
        send(&h, port, genuine(&p0.van, to.me.id, push(p1.me.id, 0), values.clone()));
        send(&h, port, genuine(&other.van, to.me.id, push(other.me.id, 0), values.clone()));
    }
    reaches("server 0's drops", || dropped(s8), 3);
    reaches("server 1's drops", || dropped(s10), 3);
    let before = dropped(p0);
    for to in [s8, s10] {
        let (h, port) = at(to);
        send(&h, port, genuine(&p0.van, to.me.id, push(p0.me.id, Flag::Async.bit()), values.clone()));
    }
    reaches("worker 0's drops of the refusals of its async pushes", || dropped(p0), before + 2);
    // The value was not touched, and worker 1's barrier was not released early.
    assert_eq!(pull(w0, &k, &[4]), vec![1.0; 4]);
    let early = thread::scope(|s| {
        let h = s.spawn(|| w1.barrier().map(|_| std::time::Instant::now()));
        thread::sleep(Duration::from_millis(500));
        let released_after = std::time::Instant::now();
        w0.barrier().unwrap();
        h.join().unwrap().unwrap() < released_after
    });
    assert!(!early, "worker 1 left its barrier before worker 0 reached it");
    assert_eq!(job.round(&k, &[vec![0.5; 4], vec![0.25; 4]]), vec![vec![0.75; 4]; 2]);
    job.end();
}

/// Two jobs that share one secret (or one job run again with the same secret
/// file): job A's genuine frames replayed into job B — a push to B's server
/// of the same node id, the scheduler's Terminate to B's worker, a worker's
/// WorkerDone and Barrier to B's scheduler — are refused and counted (they
/// used to give B wrong values silently, end its worker, end the job). A job
/// started again on A's port refuses A's frames the same way.
#[test]
fn frames_of_another_job_with_the_same_secret_are_refused() {
    use gradpack::store::param_server::message::{f32s_to_bytes, Command, Meta};
    let secret = Secret::new(b"a secret file used twice").unwrap();
    let a = secured_job(&secret, 1, 1);
    let b = secured_job(&secret, 1, 1);
    let k = Key::Int(7);
    a.init(&k, &[1.0; 4]);
    b.init(&k, &[1.0; 4]);
    let (aw, bw) = (a.workers[0].postoffice().clone(), b.workers[0].postoffice().clone());
    let (a_srv, b_srv) = (a.servers[0].0.clone(), b.servers[0].0.clone());
    assert_eq!((aw.me.id, a_srv.me.id), (bw.me.id, b_srv.me.id), "the same node ids in both jobs");
    let mut push = Meta::new(Command::Push, aw.me.id);
    (push.key, push.len, push.request_id) = (Some(k.clone()), 4, 1 << 40);
    let send = |host: &str, port: u16, frames: Vec<Vec<u8>>| outsider(host, port, 1000).send_multipart(frames, 0).unwrap();
    send(&b_srv.me.host, b_srv.me.port, genuine(&aw.van, a_srv.me.id, push.clone(), f32s_to_bytes(&[1000.0; 4])));
    send(&bw.me.host, bw.me.port, genuine(&a.scheduler, aw.me.id, Meta::new(Command::Terminate, 1), Vec::new()));
    let to_scheduler = vec![
        genuine(&aw.van, 1, Meta::new(Command::Barrier, aw.me.id), Vec::new()),
        genuine(&aw.van, 1, Meta::new(Command::WorkerDone, aw.me.id), Vec::new()),
    ];
    for f in &to_scheduler {
        send("127.0.0.1", b.port, f.clone());
    }
    let dropped = |v: &gradpack::store::param_server::van::Van| v.traffic.dropped.load(Ordering::Relaxed);
    reaches("job B's server drops", || dropped(&b_srv.van), 1);
    reaches("job B's worker drops", || dropped(&bw.van), 1);
    reaches("job B's scheduler drops", || dropped(&b.scheduler), 2);
    // Job B goes on with exact values; its worker was not ended.
    assert_eq!(b.round(&k, &[vec![0.5; 4]]), vec![vec![0.5; 4]]);
    assert_eq!(a.round(&k, &[vec![0.25; 4]]), vec![vec![0.25; 4]]);
    let a_port = a.port;
    a.end();
    b.end();
    // A job run again on A's port with the same secret refuses A's frames to A's scheduler.
    let port = a_port;
    let c_sched = gradpack::store::param_server::scheduler::Scheduler::bind(Config { secret: Some(secret.clone()), ..config(Role::Scheduler, port, 1, 1) }).unwrap();
    let c_van = c_sched.van.clone();
    let c = thread::spawn(move || c_sched.run());
    let more = vec![
        genuine(&aw.van, 1, Meta::new(Command::Barrier, aw.me.id), Vec::new()),
        genuine(&aw.van, 1, Meta::new(Command::WorkerDone, aw.me.id), Vec::new()),
    ];
    for f in to_scheduler.into_iter().chain(more) {
        send("127.0.0.1", port, f);
    }
    reaches("the new scheduler's drops", || dropped(&c_van), 4);
    let node = |role| Config { secret: Some(secret.clone()), ..config(role, port, 1, 1) };
    let (sc, wc) = (node(Role::Server), node(Role::Worker));
    let server = thread::spawn(move || serve(sc));
    let w = DistWorker::start("dist_sync", wc).unwrap();
    w.init(&k, Array { shape: &[4], data: Grad::F32(&[2.0; 4]) }).unwrap();
    assert_eq!(pull(&w, &k, &[4]), vec![2.0; 4]);
    w.close();
    c.join().unwrap().unwrap();
    server.join().unwrap().unwrap();
}

/// Runs `work` on each worker of a 2-worker, 1-server dist_sync job at once;
/// what each returned, by rank. The job then ends (its nodes may have failed).
fn two_workers<T: Send>(work: impl Fn(usize, &DistWorker) -> T + Sync) -> Vec<T> {
    let port = free_port();
    let sched = thread::spawn(move || serve(config(Role::Scheduler, port, 2, 1)));
    let server = thread::spawn(move || serve(config(Role::Server, port, 2, 1)));
    let out = thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|_| {
                let work = &work;
                s.spawn(move || {
                    let w = DistWorker::start("dist_sync", config(Role::Worker, port, 2, 1)).unwrap();
                    let out = (w.rank(), work(w.rank(), &w));
                    w.close();
                    out
                })
            })
            .collect();
        let mut out: Vec<(usize, T)> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        out.sort_by_key(|o| o.0);
        out.into_iter().map(|o| o.1).collect()
    });
    let _ = sched.join().unwrap();
    let _ = server.join().unwrap();
    out
}

/// Worker 0 pushes a key twice, worker 1 once, then both call barrier(): it
/// used to deadlock (worker 0 in its push, worker 1 in the barrier). Now
/// worker 1's barrier tells the server, which fails worker 0's second round
/// naming the barrier (raised by worker 0's next pull); the barrier fails
/// on both, naming the push counts.
#[test]
fn a_barrier_after_unequal_pushes_is_an_error_on_every_worker() {
    let errors = two_workers(|rank, w| {
        let k = Key::Int(2);
        w.init(&k, Array { shape: &[4], data: Grad::F32(&[0.0; 4]) }).unwrap();
        let g = [1.0f32; 4];
        let mut errs = Vec::new();
        for _ in 0..2 - rank {
            if let Err(e) = w.push(&k, &[Array { shape: &[4], data: Grad::F32(&g) }]) {
                errs.push(e.to_string());
            }
        }
        errs.push(w.barrier().unwrap_err().to_string());
        if rank == 0 {
            errs.push(w.pull(&k, &mut [ArrayMut { shape: &[4], data: &mut [0.0; 4] }]).unwrap_err().to_string());
        }
        errs
    });
    assert_eq!(errors[0].len(), 2, "{errors:?}");
    assert!(errors[0][1].contains("waiting in barrier") && errors[0][1].contains("unequal numbers of times"), "{}", errors[0][1]);
    for e in [&errors[0][0], &errors[1][0]] {
        assert!(e.contains("different sync pushes") && e.contains("worker 0") && e.contains("): 2;") && e.contains("): 1)"), "{e}");
    }
}

/// Equal rounds, then worker 0 closes its store and worker 1 calls
/// barrier(): it used to wait for ever. Now it fails at once, naming worker 0.
#[test]
fn a_barrier_that_a_closed_worker_will_never_reach_fails() {
    let results = two_workers(|rank, w| {
        let k = Key::Int(2);
        w.init(&k, Array { shape: &[4], data: Grad::F32(&[0.0; 4]) }).unwrap();
        w.push(&k, &[Array { shape: &[4], data: Grad::F32(&[1.0; 4]) }]).unwrap();
        if rank == 0 {
            w.close();
            return None;
        }
        thread::sleep(Duration::from_millis(300));
        let t = std::time::Instant::now();
        let e = w.barrier().unwrap_err().to_string();
        Some((e, t.elapsed()))
    });
    let (e, took) = results[1].clone().unwrap();
    assert!(e.contains("worker 0") && e.contains("closed its store"), "{e}");
    assert!(took < Duration::from_secs(30), "{took:?}");
}

/// Workers of one job that differ in what they must share are told at the
/// init's barrier, each with the same error naming what differs: another
/// threshold, 2-bit against float32, the same size in another shape (each
/// used to run on silently).
#[test]
fn workers_that_disagree_on_compression_or_shape_all_get_an_error() {
    let cases: [(&str, fn(usize) -> (Option<f32>, Vec<usize>)); 3] = [
        ("compression", |rank| (Some(if rank == 0 { 0.5 } else { 1.0 }), vec![4, 6])),
        ("compression", |rank| ((rank == 0).then_some(0.5), vec![4, 6])),
        ("init", |rank| (None, if rank == 0 { vec![4, 6] } else { vec![6, 4] })),
    ];
    for (what, case) in cases {
        let errors = two_workers(|rank, w| {
            let (threshold, shape) = case(rank);
            if let Some(t) = threshold {
                let params = vec![("compress".to_string(), "2bit".to_string()), ("threshold".to_string(), t.to_string())];
                let c = Compression::from_params(params.iter().map(|(k, v)| (k.as_str(), v.as_str()))).unwrap();
                w.set_compress(c, &params).unwrap();
            }
            w.init(&Key::Int(1), Array { shape: &shape, data: Grad::F32(&[0.0; 24]) }).unwrap_err().to_string()
        });
        assert_eq!(errors[0], errors[1], "{what}");
        assert!(errors[0].contains(&format!("different {what}")) && errors[0].contains("worker 0") && errors[0].contains("worker 1"), "{what}: {}", errors[0]);
    }
}

/// A request lost on the wire (here: one the worker never sent) used to be
/// waited for as long as heartbeats flowed. After a heartbeat timeout the
/// worker asks the server, which holds no such request: an error naming it.
/// A sync push that waits longer than that for a slow worker is not one: it
/// completes with exact values.
#[test]
fn a_lost_request_is_an_error_and_a_long_round_is_not() {
    let results = two_workers(|rank, w| {
        let k = Key::Int(2);
        w.init(&k, Array { shape: &[4], data: Grad::F32(&[0.0; 4]) }).unwrap();
        let lost = (rank == 0).then(|| {
            let post = w.postoffice();
            let server = post.servers()[0].id;
            let id = post.customer.start(vec![server]);
            let t = std::time::Instant::now();
            let e = post.wait(id).unwrap_err().to_string();
            (e, t.elapsed())
        });
        w.barrier().unwrap();
        if rank == 1 {
            thread::sleep(Duration::from_secs(7)); // over two heartbeat timeouts (3 s)
        }
        w.push(&k, &[Array { shape: &[4], data: Grad::F32(&[1.0 + rank as f32; 4]) }]).unwrap();
        (lost, pull(w, &k, &[4]))
    });
    let (e, took) = results[0].0.clone().unwrap();
    assert!(e.contains("holds no request") && e.contains("lost"), "{e}");
    assert!(took >= Duration::from_secs(3) && took < Duration::from_secs(20), "{took:?}");
    assert_eq!(results[0].1, vec![3.0; 4]);
    assert_eq!(results[1].1, vec![3.0; 4]);
}

/// Without a secret, one malformed Response frame that names a waiting
/// request (a part claiming 2^40 values; an offset of 2^64-5) used to end
/// the worker's push with an error. Now each is dropped and counted like any
/// malformed frame, and the real reply completes the push with exact values.
#[test]
fn a_forged_malformed_response_is_dropped_and_the_real_one_counts() {
    use gradpack::store::param_server::message::{Command, Meta};
    let results = two_workers(|rank, w| {
        let k = Key::Int(2);
        w.init(&k, Array { shape: &[4], data: Grad::F32(&[0.0; 4]) }).unwrap();
        let g = [1.0f32 + rank as f32; 4];
        let post = w.postoffice().clone();
        if rank == 1 {
            thread::sleep(Duration::from_millis(1500)); // worker 0's push waits meanwhile
        } else {
            let (host, port) = w.address();
            let server = post.servers()[0].id;
            thread::spawn(move || {
                let deadline = std::time::Instant::now() + Duration::from_secs(30);
                let id = loop {
                    if let Some(&id) = post.customer.pending().first() {
                        break id;
                    }
                    assert!(std::time::Instant::now() < deadline);
                    thread::sleep(Duration::from_millis(5));
                };
                let s = outsider(&host, port, 1000);
                let mut huge = vec![2u8];
                huge.extend((1u64 << 40).to_le_bytes());
                huge.extend([0u8; 16]);
                for (offset, payload) in [(0, huge), (u64::MAX - 4, Vec::new())] {
                    let mut m = Meta::new(Command::Response, server);
                    (m.request_id, m.key, m.offset, m.len) = (id, Some(Key::Int(2)), offset, 4);
                    s.send_multipart([m.encode(), payload], 0).unwrap();
                }
                thread::sleep(Duration::from_millis(300));
            });
        }
        if let Err(e) = w.push(&k, &[Array { shape: &[4], data: Grad::F32(&g) }]) {
            panic!("worker {rank}: {e}");
        }
        (pull(w, &k, &[4]), w.dropped())
    });
    assert_eq!(results[0].0, vec![3.0; 4]);
    assert_eq!(results[1].0, vec![3.0; 4]);
    assert_eq!(results[0].1, 2, "worker 0 dropped both forged responses");
}

/// A server held between its registration and serving (its thread made to
/// wait where the race was: it used to serve before its id was set, and
/// replies claimed to come from "node 0"): the worker's first requests wait
/// for it and get exact values, all answered under the server's own id.
#[test]
fn a_server_held_after_registration_serves_under_its_own_id() {
    use gradpack::store::param_server::postoffice::{MakeHandler, NodeInfo, Postoffice, RequestHandler};
    let port = free_port();
    let sched = thread::spawn(move || serve(config(Role::Scheduler, port, 1, 1)));
    let server = thread::spawn(move || {
        let make: MakeHandler = Box::new(|me: &NodeInfo| -> RequestHandler {
            thread::sleep(Duration::from_millis(1500));
            let mut srv = gradpack::store::param_server::server::Server::new(1, me.id);
            Box::new(move |msg| srv.handle(msg))
        });
        let post = Postoffice::start(config(Role::Server, port, 1, 1), Some(make))?;
        let r = post.customer.wait_until_over();
        post.stop();
        r
    });
    let w = DistWorker::start("dist_sync", config(Role::Worker, port, 1, 1)).unwrap();
    let k = Key::Int(4);
    w.init(&k, Array { shape: &[3], data: Grad::F32(&[1.0, 2.0, 3.0]) }).unwrap();
    w.push(&k, &[Array { shape: &[3], data: Grad::F32(&[0.5; 3]) }]).unwrap();
    assert_eq!(pull(&w, &k, &[3]), vec![0.5; 3]);
    assert_eq!(w.dropped(), 0, "no reply came from another id");
    w.close();
    sched.join().unwrap().unwrap();
    server.join().unwrap().unwrap();
}

/// A barrier message lost on the wire (here: worker 1's never sent) used to
/// be waited for as long as heartbeats flowed. A worker says again that it is
/// in the barrier after each heartbeat timeout, and the barrier passes; a
/// release sent again (for a repeat of an old barrier message) is dropped,
/// not taken for the next barrier's.
#[test]
fn a_lost_barrier_message_is_asked_again_and_a_repeated_release_is_ignored() {
    use gradpack::store::param_server::message::{Command, Message, Meta, Payload};
    let results = two_workers(|rank, w| {
        let post = w.postoffice();
        let seen = post.customer.barriers_done();
        let mut m = Meta::new(Command::Barrier, post.me.id);
        m.status = seen as i32;
        m.body = "state=same\n".into();
        let send = || post.van.send(1, Message { meta: m.clone(), data: Payload::empty() }).unwrap();
        let t = std::time::Instant::now();
        if rank == 1 {
            // The first message is lost: only the asks after each timeout (3 s) go out.
            post.customer.wait_barrier(seen, Duration::from_secs(3), &send).unwrap();
        } else {
            post.barrier("state=same\n").unwrap();
        }
        let took = t.elapsed();
        let before = w.dropped();
        if rank == 1 {
            send(); // a repeat of barrier 1's message: the scheduler sends its release again
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while w.dropped() == before {
                assert!(std::time::Instant::now() < deadline, "the repeated release never came");
                thread::sleep(Duration::from_millis(10));
            }
        }
        // The next barrier is not released early by that repeat: both pass it together.
        post.barrier("state=same\n").unwrap();
        (took, w.dropped() - before, post.customer.barriers_done() - seen)
    });
    assert!(results[1].0 >= Duration::from_secs(3), "{:?}", results[1].0);
    assert_eq!(results[1].1, 1, "worker 1 dropped the repeated release");
    assert_eq!((results[0].2, results[1].2), (2, 2));
}

/// Established TCP connections to local `port` (the kernel's IPv4 table).
fn established_to(port: u16) -> usize {
    let text = std::fs::read_to_string("/proc/net/tcp").unwrap();
    text.lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 3 && f[3] == "01" && f[1].rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok()) == Some(port)
        })
        .count()
}

/// 60 ZeroMQ connections from one address to a server, each finishing its
/// handshake and then idle: each used to hold a connection (and a file) for
/// good. The server's gate refuses those past its cap for the address (22 in
/// a job of 3 nodes), the kernel's count of connections to its port stays
/// there, and the job's own connections keep working with exact values.
#[test]
fn a_node_caps_the_connections_one_address_holds() {
    let (sched, server, post, w) = one_server_job_with(Some(Secret::new(b"capped").unwrap()));
    let k = Key::Int(8);
    w.init(&k, Array { shape: &[4], data: Grad::F32(&[1.0; 4]) }).unwrap();
    let port = post.me.port;
    let before = established_to(port);
    let ctx = zmq::Context::new();
    let idle: Vec<zmq::Socket> = (0..60)
        .map(|_| {
            let s = ctx.socket(zmq::DEALER).unwrap();
            s.set_linger(0).unwrap();
            s.connect(&format!("tcp://127.0.0.1:{port}")).unwrap();
            s
        })
        .collect();
    let cap = gradpack::store::param_server::gate::Caps::for_job(3).per_address;
    let mut most = 0;
    let t = std::time::Instant::now();
    while t.elapsed() < Duration::from_secs(3) {
        most = most.max(established_to(port));
        thread::sleep(Duration::from_millis(50));
    }
    let settled = established_to(port);
    eprintln!("connections to the server: {before} before, {settled} with 60 more asked for (at most {most} seen); cap {cap}");
    assert!(settled <= cap + 4, "{settled} connections to the server's port, cap {cap}");
    w.push(&k, &[Array { shape: &[4], data: Grad::F32(&[0.5; 4]) }]).unwrap();
    assert_eq!(pull(&w, &k, &[4]), vec![0.5; 4]);
    drop(idle);
    w.close();
    sched.join().unwrap().unwrap();
    server.join().unwrap().unwrap();
}

/// Worker 0 pushes key 0 then key 1, worker 1 key 1 then key 0, for every
/// kind of push (float32, 2-bit, a scheme of several exchanges): each used to
/// wait in its first push for the other's, for ever. A push returns once
/// its data is on its way, as MXNet's does; the pulls wait for the rounds,
/// whose values are exact.
#[test]
fn workers_that_push_keys_in_opposite_orders_complete() {
    let qsgd: Vec<(String, String)> = [("compress", "qsgd_mn"), ("bits", "2")].iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    for params in [Vec::new(), two_bit().1, qsgd] {
        // A deadlock fails the test instead of hanging it.
        let (done, finished) = std::sync::mpsc::channel();
        let label = format!("{params:?}");
        thread::spawn(move || done.send(job_with(2, 2, "dist_sync", move |rank, w: &DistWorker| {
            if !params.is_empty() {
                let c = Compression::from_params(params.iter().map(|(k, v)| (k.as_str(), v.as_str()))).unwrap();
                w.set_compress(c, &params).unwrap();
            }
            let keys = [Key::Int(0), Key::Int(1)];
            // key 1 is split over both servers
            let shapes = [[64usize], [2048]];
            for (k, shape) in keys.iter().zip(&shapes) {
                w.init(k, Array { shape, data: Grad::F32(&vec![0.0; shape[0]]) }).unwrap();
            }
            let order = if rank == 0 { [0, 1] } else { [1, 0] };
            for step in 0..3 {
                for i in order {
                    let g = vec![0.5f32 * (i + 1) as f32; shapes[i][0]];
                    w.push(&keys[i], &[Array { shape: &shapes[i], data: Grad::F32(&g) }]).unwrap();
                }
                // pulled in this worker's own order too
                for i in order.iter().rev() {
                    let got = pull(w, &keys[*i], &shapes[*i]);
                    // 2-bit at 0.5 sends 0.5 from each worker (key 1's 1.0 keeps the rest);
                    // float32 and QSGD of a constant gradient: the exact sum
                    let two_bit = params.iter().any(|p| p.1 == "2bit");
                    let want = if two_bit { 1.0 } else { 2.0 * 0.5 * (*i + 1) as f32 };
                    assert_eq!(got, vec![want; shapes[*i][0]], "step {step} key {i} {params:?}");
                }
            }
            w.barrier().unwrap();
        })));
        let results = finished.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| panic!("{label}: the workers did not finish within 60 s"));
        assert_eq!(results.len(), 2);
    }
}
