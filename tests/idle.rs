//! Outsiders that complete ZeroMQ's handshake with the scheduler and then
//! stay silent (issue 44): 1,000 such connection attempts from the job's own
//! address (127.0.0.1) and 1,000 from others (127.0.0.2-5), made before the
//! job's nodes start. The scheduler's gate admits as many as its caps hold
//! (2n+16 per address, 4n+64 in all) and these once held them for good: the
//! job's server and worker were refused, failed in 3 s, and the scheduler
//! waited forever. Now each is closed after GRADPACK_CONNECTION_GRACE, the
//! refused nodes connect again, and the job runs with exact values. One test
//! in this binary: the attack's connections are its own. The attempts are
//! made one at a time, so this process holds few descriptors at once (the
//! admitted ones and one more), far below `ulimit -n`.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::os::fd::FromRawFd;
use std::thread;
use std::time::{Duration, Instant};

use gradpack::store::param_server::auth::Secret;
use gradpack::store::param_server::config::DEFAULT_CONNECTION_GRACE;
use gradpack::store::param_server::gate::Caps;
use gradpack::store::param_server::{serve, Config, DistWorker, Role};
use gradpack::store::{Array, ArrayMut, Grad, Key};

/// The bound of the job's start under the attack (issue 44's goal).
const START_WITHIN: Duration = Duration::from_secs(20);

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
        register_timeout: START_WITHIN,
        connection_grace: DEFAULT_CONNECTION_GRACE,
        verbose: 0,
        bigarray_bound: 1_000_000,
        partition_bytes: 4 << 20,
        max_message_bytes: gradpack::store::param_server::config::DEFAULT_MAX_MESSAGE_BYTES,
        secret: Some(Secret::new(b"idle").unwrap()),
    }
}

fn sockaddr(ip: Ipv4Addr, port: u16) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from(ip).to_be() },
        sin_zero: [0; 8],
    }
}

/// A TCP connection to 127.0.0.1:`port` from `source` (Linux routes all of
/// 127.0.0.0/8 to loopback, so any of it can be bound).
fn connect_from(source: Ipv4Addr, port: u16) -> std::io::Result<TcpStream> {
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain socket calls on a descriptor this function owns; the
    // addresses outlive the calls that read them.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let stream = TcpStream::from_raw_fd(fd); // closes the descriptor on every error below
        let from = sockaddr(source, 0);
        if libc::bind(fd, (&from as *const libc::sockaddr_in).cast(), len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let to = sockaddr(Ipv4Addr::LOCALHOST, port);
        if libc::connect(fd, (&to as *const libc::sockaddr_in).cast(), len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(stream)
    }
}

/// ZMTP 3.0 as a DEALER: greeting, READY, and the node's answer. The
/// connection when the node answered READY (its gate admitted it), None when
/// it answered ERROR or closed (refused).
fn handshake(mut s: TcpStream) -> Option<TcpStream> {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut greeting = vec![0xFF, 0, 0, 0, 0, 0, 0, 0, 0, 0x7F, 3, 0];
    greeting.extend(b"NULL");
    greeting.resize(64, 0);
    s.write_all(&greeting).ok()?;
    let mut theirs = [0u8; 64];
    s.read_exact(&mut theirs).ok()?;
    let mut ready = vec![5];
    ready.extend(b"READY");
    ready.push(11);
    ready.extend(b"Socket-Type");
    ready.extend(6u32.to_be_bytes());
    ready.extend(b"DEALER");
    s.write_all(&[0x04, ready.len() as u8]).ok()?;
    s.write_all(&ready).ok()?;
    let mut head = [0u8; 2];
    s.read_exact(&mut head).ok()?;
    let mut body = vec![0u8; head[1] as usize];
    s.read_exact(&mut body).ok()?;
    body.starts_with(b"\x05READY").then_some(s)
}

/// Whether the node closed `s` (a read sees the end, or a reset) within `within`.
fn closed_by_peer(s: &mut TcpStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).unwrap();
    match s.read(&mut [0u8; 1]) {
        Ok(n) => n == 0,
        Err(e) => !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
    }
}

/// The remote ends (address:port, as the kernel writes them) of the
/// established connections to local `port` (the kernel's IPv4 table).
fn connections_to(port: u16) -> std::collections::BTreeSet<String> {
    let text = std::fs::read_to_string("/proc/net/tcp").unwrap();
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let local_port = f.get(1)?.rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok());
            (f.get(3) == Some(&"01") && local_port == Some(port)).then(|| f[2].to_string())
        })
        .collect()
}

#[test]
fn idle_handshaked_connections_do_not_lock_a_job_out() {
    let port = 20000 + (std::process::id() % 9000) as u16;
    let sched = thread::spawn(move || serve(config(Role::Scheduler, port)));
    // The scheduler's port answers before the attack begins.
    let t = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(t.elapsed() < Duration::from_secs(30), "the scheduler did not bind port {port}");
        thread::sleep(Duration::from_millis(20));
    }

    let attack = Instant::now();
    let mut idle: Vec<TcpStream> = Vec::new();
    let (mut from_job_address, mut from_others) = (0, 0);
    for i in 0..2000u32 {
        let source = if i < 1000 { Ipv4Addr::new(127, 0, 0, 1) } else { Ipv4Addr::new(127, 0, 0, 2 + (i % 4) as u8) };
        if let Some(s) = connect_from(source, port).ok().and_then(handshake) {
            idle.push(s);
            if i < 1000 {
                from_job_address += 1;
            } else {
                from_others += 1;
            }
        }
    }
    let caps = Caps::for_job(3);
    eprintln!(
        "2,000 handshakes in {:.2} s: the gate admitted {from_job_address} from 127.0.0.1 and {from_others} from 127.0.0.2-5 (caps {} per address, {} in all); they stay silent",
        attack.elapsed().as_secs_f64(),
        caps.per_address,
        caps.total
    );
    // The attack filled the caps: without the grace, the job's nodes could not get in.
    assert!(from_job_address >= caps.per_address && from_job_address + from_others >= caps.total, "{from_job_address} + {from_others} admitted");

    let start = Instant::now();
    let server = thread::spawn(move || serve(config(Role::Server, port)));
    let w = DistWorker::start("dist_sync", config(Role::Worker, port)).unwrap_or_else(|e| panic!("the worker could not join after {:.1} s: {e}", start.elapsed().as_secs_f64()));
    eprintln!("the job started {:.1} s after its nodes did (GRADPACK_CONNECTION_GRACE={} s)", start.elapsed().as_secs_f64(), DEFAULT_CONNECTION_GRACE.as_secs_f64());

    // Every silent connection the gate admitted has been closed by the scheduler.
    let still_open = idle.iter_mut().map(|s| closed_by_peer(s, Duration::from_secs(10))).filter(|closed| !closed).count();
    assert_eq!(still_open, 0, "{still_open} of {} silent connections are still open", idle.len());

    // The job's own connections proved themselves (registration, node table,
    // Hello; the init's round trip makes sure every one is up): past another
    // grace, every one is still the one it was.
    let k = Key::Int(3);
    w.init(&k, Array { shape: &[4], data: Grad::F32(&[1.0, 2.0, 3.0, 4.0]) }).unwrap();
    let (server_host, server_port) = w.server_addresses()[0].clone();
    assert_eq!(server_host, "127.0.0.1");
    let ports = [port, server_port, w.address().1];
    let before: Vec<_> = ports.iter().map(|&p| connections_to(p)).collect();
    thread::sleep(DEFAULT_CONNECTION_GRACE + Duration::from_millis(1500));
    let after: Vec<_> = ports.iter().map(|&p| connections_to(p)).collect();
    eprintln!("the job's connections to the scheduler, the server and the worker: {before:?}");
    assert!(before.iter().all(|c| !c.is_empty()) && before == after, "{before:?} became {after:?}");

    w.push(&k, &[Array { shape: &[4], data: Grad::F32(&[0.5, -1.5, 2.25, 8.0]) }]).unwrap();
    let mut out = vec![0f32; 4];
    w.pull(&k, &mut [ArrayMut { shape: &[4], data: &mut out }]).unwrap();
    assert_eq!(out, vec![0.5, -1.5, 2.25, 8.0]);
    w.close();
    sched.join().unwrap().unwrap();
    server.join().unwrap().unwrap();
}
