//! An attacker without the job's secret, on the same network, against a
//! running job: one frame that claims 3 GiB, and a flood of tiny garbage
//! messages on two connections. Neither is authenticated, so both must be
//! bounded before any MAC is checked. The job runs in this process (one
//! test in this binary, so the process's memory is the job's): its resident
//! memory is measured before and during each attack, and its step time is
//! printed beside an unflooded run (printed, not asserted).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::thread;
use std::time::{Duration, Instant};

use gradpack::store::param_server::auth::Secret;
use gradpack::store::param_server::{serve, Config, DistWorker, Role};
use gradpack::store::{Array, ArrayMut, Grad, Key};

fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: f64 = status.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)).unwrap().parse().unwrap();
    kb / 1024.0
}

fn config(role: Role, port: u16) -> Config {
    Config {
        role,
        root_uri: "127.0.0.1".into(),
        root_port: port,
        num_workers: 1,
        num_servers: 1,
        node_host: Some("127.0.0.1".into()),
        heartbeat_interval: Duration::from_millis(200),
        heartbeat_timeout: Duration::from_secs(5),
        register_timeout: gradpack::store::param_server::config::DEFAULT_REGISTER_TIMEOUT,
        connection_grace: gradpack::store::param_server::config::DEFAULT_CONNECTION_GRACE,
        verbose: 0,
        bigarray_bound: 1_000_000,
        partition_bytes: 4 << 20,
        max_message_bytes: gradpack::store::param_server::config::DEFAULT_MAX_MESSAGE_BYTES,
        secret: Some(Secret::new(b"flood").unwrap()),
    }
}

/// A ZeroMQ (ZMTP 3.0) connection made by hand: greeting and READY as a
/// DEALER, the node's READY read, then whatever frames the caller writes.
fn zmtp(host: &str, port: u16) -> TcpStream {
    let mut s = TcpStream::connect((host, port)).unwrap();
    let mut greeting = vec![0xFF, 0, 0, 0, 0, 0, 0, 0, 0, 0x7F, 3, 0];
    greeting.extend(b"NULL");
    greeting.resize(64, 0);
    s.write_all(&greeting).unwrap();
    let mut theirs = [0u8; 64];
    s.read_exact(&mut theirs).unwrap();
    let mut ready = vec![5];
    ready.extend(b"READY");
    ready.push(11);
    ready.extend(b"Socket-Type");
    ready.extend(6u32.to_be_bytes());
    ready.extend(b"DEALER");
    s.write_all(&[0x04, ready.len() as u8]).unwrap();
    s.write_all(&ready).unwrap();
    // The node's READY (a short command) once its gate admitted the connection.
    let mut head = [0u8; 2];
    s.read_exact(&mut head).unwrap();
    let mut body = vec![0u8; head[1] as usize];
    s.read_exact(&mut body).unwrap();
    assert!(body.starts_with(b"\x05READY"), "{body:?}");
    s
}

/// `steps` push+pull rounds of a 1M-element key; ms per step.
fn steps(w: &DistWorker, key: &Key, steps: usize) -> f64 {
    let g = vec![0.5f32; 1 << 20];
    let mut out = vec![0f32; 1 << 20];
    let t = Instant::now();
    for _ in 0..steps {
        w.push(key, &[Array { shape: &[1 << 20], data: Grad::F32(&g) }]).unwrap();
        w.pull(key, &mut [ArrayMut { shape: &[1 << 20], data: &mut out }]).unwrap();
    }
    assert_eq!(out[7], 0.5);
    t.elapsed().as_secs_f64() * 1e3 / steps as f64
}

#[test]
fn an_outsiders_huge_frame_and_flood_are_bounded_before_authentication() {
    let port = 20000 + (std::process::id() % 9000) as u16;
    let sched = thread::spawn(move || serve(config(Role::Scheduler, port)));
    let server = thread::spawn(move || serve(config(Role::Server, port)));
    let w = DistWorker::start("dist_sync", config(Role::Worker, port)).unwrap();
    let key = Key::Int(1);
    w.init(&key, Array { shape: &[1 << 20], data: Grad::F32(&vec![0f32; 1 << 20]) }).unwrap();
    steps(&w, &key, 5);
    let (host, server_port) = w.server_addresses()[0].clone();
    let quiet = steps(&w, &key, 30);
    let before = rss_mib();

    // One frame that claims 3 GiB: refused at its header, the connection closed.
    let mut s = zmtp(&host, server_port);
    let mut sent = 0u64;
    let closed = (|| -> std::io::Result<()> {
        s.write_all(&[0x02])?;
        s.write_all(&(3u64 << 30).to_be_bytes())?;
        let chunk = vec![0u8; 1 << 20];
        while sent < 3 << 30 {
            s.write_all(&chunk)?;
            sent += chunk.len() as u64;
        }
        Ok(())
    })()
    .is_err();
    let after_frame = rss_mib();
    eprintln!("3 GiB frame: the server closed the connection after {} MiB were written (kernel buffers included); RSS {before:.0} -> {after_frame:.0} MiB", sent >> 20);
    assert!(closed && sent < 64 << 20, "{} MiB of a 3 GiB frame went in before the server refused it", sent >> 20);
    assert!(after_frame - before < 64.0, "RSS {before:.0} -> {after_frame:.0} MiB");

    // Tiny garbage on two connections, as fast as they go, while the job trains.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flooders: Vec<_> = [(host.clone(), server_port), w.address()]
        .into_iter()
        .map(|(h, p)| {
            let stop = stop.clone();
            thread::spawn(move || {
                let ctx = zmq::Context::new();
                let s = ctx.socket(zmq::DEALER).unwrap();
                s.set_linger(0).unwrap();
                s.connect(&format!("tcp://{h}:{p}")).unwrap();
                let mut n = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if s.send_multipart([&b"x"[..], b"y", b"z"], zmq::DONTWAIT).is_ok() {
                        n += 1;
                    }
                }
                n
            })
        })
        .collect();
    thread::sleep(Duration::from_millis(500));
    let mut peak = rss_mib();
    let t = Instant::now();
    let mut flooded = Vec::new();
    while t.elapsed() < Duration::from_secs(10) {
        flooded.push(steps(&w, &key, 5));
        peak = peak.max(rss_mib());
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent: u64 = flooders.into_iter().map(|f| f.join().unwrap()).sum();
    flooded.sort_by(f64::total_cmp);
    let median = flooded[flooded.len() / 2];
    let dropped = w.dropped();
    eprintln!(
        "tiny-message flood, 10 s on 2 connections: {sent} messages sent, {dropped} dropped by the worker; RSS {before:.0} -> peak {peak:.0} MiB; \
         step {quiet:.2} ms unflooded, {median:.2} ms flooded (median), {:.2}x",
        median / quiet
    );
    assert!(peak - before < 256.0, "RSS {before:.0} -> {peak:.0} MiB under a flood");
    assert!(dropped > 0, "the worker saw none of the flood");
    assert_eq!(steps(&w, &key, 3).is_finite(), true);
    w.close();
    sched.join().unwrap().unwrap();
    server.join().unwrap().unwrap();
}
