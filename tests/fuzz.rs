//! A structure-aware fuzz test on stable Rust: real frames of every kind
//! (headers of each command, 2-bit, float32, scheme and count payloads) are
//! mutated where it hurts (bit flips, the length, count and offset fields set
//! to 0, 2^31, 2^40, 2^62 or 2^64-1, truncation, extension, splices) and fed
//! to the frame decoders, to the server's request handler, and over a socket
//! to a live server. Nothing may panic, and no decode may allocate more than
//! a small multiple of the frame it was given (a counting allocator checks).

use std::alloc::{GlobalAlloc, Layout, System};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::cell::Cell;
use std::thread;
use std::time::Duration;

use gradpack::codec::{self, Thresholds};
use gradpack::store::param_server::counts;
use gradpack::store::param_server::message::{decode_pairs, encode_pairs, f32_view, f32s_to_bytes, Command, Flag, Message, Meta};
use gradpack::store::param_server::server::Server;
use gradpack::store::param_server::{serve, Config, DistWorker, Role};
use gradpack::store::{Array, ArrayMut, Grad, Key};
use gradpack::quant::scheme::{from_wire, to_wire, value_from_wire, value_to_wire, LaneSum, Part};

/// Counts, per thread, the bytes allocated and not freed and their peak since
/// the last `reset_peak` (tests run on several threads at once; each checks
/// only its own allocations).
struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded to the system allocator with the caller's layout.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            // try_with: a thread's locals may be gone while it exits.
            let _ = LIVE.try_with(|l| {
                l.set(l.get() + layout.size() as isize);
                let _ = PEAK.try_with(|m| m.set(m.get().max(l.get())));
            });
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let _ = LIVE.try_with(|l| l.set(l.get() - layout.size() as isize));
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn reset_peak() -> isize {
    let now = LIVE.with(|l| l.get());
    PEAK.with(|m| m.set(now));
    now
}

fn peak() -> isize {
    PEAK.with(|m| m.get())
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(gradpack::hash::GAMMA);
        gradpack::hash::finalize(self.0)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

const BIG: [u64; 8] = [0, 1, 1 << 31, 1 << 32, 1 << 40, 1 << 62, u64::MAX, u64::MAX - 4];

/// One mutation of `frame`: the kinds a hostile peer would try first.
fn mutate(rng: &mut Rng, frame: &[u8]) -> Vec<u8> {
    let mut f = frame.to_vec();
    for _ in 0..1 + rng.below(3) {
        match rng.below(7) {
            0 if !f.is_empty() => {
                let i = rng.below(f.len());
                f[i] ^= 1 << rng.below(8);
            }
            1 if !f.is_empty() => {
                let i = rng.below(f.len());
                f[i] = [0, 0xFF, 0x7F, 0x80, 1][rng.below(5)];
            }
            // A length, count or offset field (any 8 or 4 aligned bytes) set to a huge value.
            2 if f.len() >= 8 => {
                let i = rng.below(f.len() - 7);
                f[i..i + 8].copy_from_slice(&BIG[rng.below(BIG.len())].to_le_bytes());
            }
            3 if f.len() >= 4 => {
                let i = rng.below(f.len() - 3);
                f[i..i + 4].copy_from_slice(&(BIG[rng.below(BIG.len())] as u32).to_le_bytes());
            }
            4 => f.truncate(rng.below(f.len() + 1)),
            5 => {
                let extra = rng.below(64);
                f.extend((0..extra).map(|_| rng.next() as u8));
            }
            _ if f.len() >= 2 => {
                // Splice: a slice of the frame copied over another place.
                let (a, b) = (rng.below(f.len()), rng.below(f.len()));
                let n = rng.below(f.len() - a.max(b)).min(16);
                let piece = f[a..a + n].to_vec();
                f[b..b + n].copy_from_slice(&piece);
            }
            _ => {}
        }
    }
    f
}

fn meta(command: Command, key: Option<Key>, len: u64, flags: u16, body: &str) -> Meta {
    let mut m = Meta::new(command, 9);
    m.key = key;
    m.len = len;
    m.flags = flags;
    m.request_id = 7;
    m.body = body.to_string();
    m
}

/// Real frames (header, payload) of every kind the transport carries.
fn seeds() -> Vec<(Vec<u8>, Vec<u8>)> {
    let th = Thresholds::new(-0.5, 0.5).unwrap();
    let g: Vec<f32> = (0..40).map(|i| (i as f32 - 20.0) / 16.0).collect();
    let mut compr = codec::create_2bit(40);
    codec::quantize_2bit(&g, &mut vec![0.0; 40], &mut compr, th).unwrap();
    let parts = [
        Part::F32(vec![1.5, -0.0, 3.0]),
        Part::Levels { levels: vec![0, 2, 1, 2, 0], count: 3 },
        Part::Codes { codes: vec![-7, 7, 0, 3, -1], lo: -7, hi: 7 },
    ];
    let (pos, neg) = (vec![1u8; 40], vec![0u8; 40]);
    let k = Some(Key::Int(5));
    let s = Some(Key::from("w"));
    vec![
        (meta(Command::Register, None, 0, 0, &encode_pairs([("role", "worker"), ("host", "127.0.0.1"), ("port", "9"), ("job", "workers=1")])).encode(), Vec::new()),
        (meta(Command::SetCompress, None, 0, 0, &encode_pairs([("compress", "2bit"), ("threshold", "0.5")])).encode(), Vec::new()),
        (meta(Command::SetOptimizer, None, 0, 0, &encode_pairs([("name", "sgd"), ("learning_rate", "0.1")])).encode(), Vec::new()),
        (meta(Command::Init, k.clone(), 40, 0, &encode_pairs([("shape", "4,10"), ("sync", "1")])).encode(), f32s_to_bytes(&g)),
        (meta(Command::Init, s.clone(), 40, 0, &encode_pairs([("sync", "1")])).encode(), f32s_to_bytes(&g)),
        (meta(Command::Push, k.clone(), 40, 0, "").encode(), f32s_to_bytes(&g)),
        (meta(Command::Push, k.clone(), 40, Flag::Compressed.bit(), "").encode(), f32s_to_bytes(&compr)),
        (meta(Command::Push, k.clone(), 40, Flag::Async.bit(), "").encode(), f32s_to_bytes(&g)),
        (meta(Command::Push, k.clone(), 40, Flag::Scheme.bit(), &encode_pairs([("step", "0")])).encode(), to_wire(&parts[2])),
        (meta(Command::Push, k.clone(), 40, Flag::Exchange.bit(), &encode_pairs([("op", "max"), ("step", "0"), ("phase", "0")])).encode(), to_wire(&parts[0])),
        (meta(Command::Push, s.clone(), 40, Flag::Exchange.bit(), &encode_pairs([("op", "sum"), ("step", "0"), ("phase", "0")])).encode(), to_wire(&parts[1])),
        (meta(Command::Pull, k.clone(), 40, 0, "").encode(), Vec::new()),
        (meta(Command::Response, k.clone(), 40, 0, "").encode(), value_to_wire(3, &parts[..2], &parts[2], 2)),
        (meta(Command::Response, k, 40, 0, "").encode(), counts::encode(&pos, &neg, th, counts::bits_for(2))),
        (meta(Command::NodeFailed, None, 0, 0, "server 8 failed").encode(), Vec::new()),
    ]
}

/// Every decoder a received frame can reach, on one (header, payload).
fn decode_everything(header: &[u8], payload: &[u8]) {
    if let Ok(m) = Meta::decode(header) {
        let _ = decode_pairs(&m.body);
    }
    let _ = from_wire(payload);
    let _ = value_from_wire(payload);
    let _ = f32_view(payload);
    let _ = counts::validate(payload, 40);
    if let Ok(mut sum) = LaneSum::first(payload, 2) {
        let _ = sum.add(payload);
        let _ = sum.into_part();
    }
    if let Ok(th) = codec::check_compressed(&f32_view(payload).map(|c| c.into_owned()).unwrap_or_default(), 40) {
        let _ = th;
    }
}

/// Each decode allocates at most a small multiple of what it was given.
fn bounded(what: &str, input: usize, f: impl FnOnce()) {
    let base = reset_peak();
    let outcome = catch_unwind(AssertUnwindSafe(f));
    assert!(outcome.is_ok(), "{what}: a {input}-byte frame made the decoder panic");
    let grew = (peak() - base).max(0) as usize;
    assert!(grew <= 64 * input + (1 << 16), "{what}: a {input}-byte frame made it allocate {grew} bytes");
}

#[test]
fn mutated_frames_never_panic_or_allocate_without_bound() {
    let seeds = seeds();
    let mut rng = Rng(0x5EED);
    let mut decoded = 0usize;
    let iterations = 120_000;
    for i in 0..iterations {
        let (h, p) = &seeds[i % seeds.len()];
        let (h, p) = match rng.below(3) {
            0 => (mutate(&mut rng, h), p.clone()),
            1 => (h.clone(), mutate(&mut rng, p)),
            _ => (mutate(&mut rng, h), mutate(&mut rng, p)),
        };
        decoded += usize::from(Meta::decode(&h).is_ok());
        bounded("decoders", h.len() + p.len(), || decode_everything(&h, &p));
    }
    // The mutations keep many headers valid, so the payload decoders behind them run too.
    assert!(decoded > iterations / 5, "only {decoded} of {iterations} mutated headers decoded");
}

/// The server's handler behind a valid header: 2-bit, scheme and plain
/// servers get 100k mutated requests; none panics (the handler would then
/// refuse all later requests with "internal error", which is checked) and
/// none allocates beyond its frame, and each still serves exact values.
#[test]
fn a_server_survives_100k_mutated_requests() {
    let seeds = seeds();
    let mut rng = Rng(0xFEED);
    let configs: [&[(&str, &str)]; 3] = [&[("compress", "2bit"), ("threshold", "0.5")], &[("compress", "qsgd_mn"), ("bits", "2")], &[]];
    let mut handled = 0usize;
    for params in configs {
        let mut server = Server::new(1, 8);
        let setup = |server: &mut Server, command, key: Key, body: String, data: Vec<u8>| {
            let m = Message { meta: meta(command, Some(key), 40, 0, &body), data: data.into() };
            let replies = server.handle(m);
            assert!(replies.iter().all(|(_, r)| r.meta.status == 0), "{:?}", replies.iter().map(|(_, r)| r.meta.body.clone()).collect::<Vec<_>>());
        };
        if !params.is_empty() {
            setup(&mut server, Command::SetCompress, Key::Int(0), encode_pairs(params.iter().copied()), Vec::new());
        }
        setup(&mut server, Command::Init, Key::Int(5), encode_pairs([("sync", "1")]), f32s_to_bytes(&[1.0; 40]));
        setup(&mut server, Command::Init, Key::from("w"), encode_pairs([("sync", "1")]), f32s_to_bytes(&[1.0; 40]));
        for i in 0..56_000 {
            let (h, p) = &seeds[3 + i % (seeds.len() - 3)];
            let (h, p) = if rng.below(2) == 0 { (mutate(&mut rng, h), p.clone()) } else { (h.clone(), mutate(&mut rng, p)) };
            let Ok(m) = Meta::decode(&h) else { continue };
            let len = h.len() + p.len();
            bounded("server", len, || {
                for (_, reply) in server.handle(Message { meta: m, data: p.into() }) {
                    assert!(!reply.meta.body.contains("internal error"), "the handler panicked: {}", reply.meta.body);
                }
            });
            handled += 1;
        }
        // Still serving: a new key inits, and pulls back exactly.
        setup(&mut server, Command::Init, Key::Int(12345), encode_pairs([("sync", "1")]), f32s_to_bytes(&[2.5; 40]));
        let replies = server.handle(Message { meta: meta(Command::Pull, Some(Key::Int(12345)), 40, 0, ""), data: Vec::new().into() });
        assert_eq!(replies.len(), 1);
        assert_eq!(f32_view(&replies[0].1.data).unwrap().into_owned(), vec![2.5; 40], "{}", replies[0].1.meta.body);
    }
    assert!(handled >= 100_000, "{handled} requests reached the handler");
}

/// A port free on loopback now.
fn loopback_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// A node of a one-worker, one-server job on loopback at `port`.
fn live_config(role: Role, port: u16, secret: Option<gradpack::store::param_server::auth::Secret>) -> Config {
    Config {
        role,
        root_uri: "127.0.0.1".into(),
        root_port: port,
        num_workers: 1,
        num_servers: 1,
        node_host: Some("127.0.0.1".into()),
        heartbeat_interval: Duration::from_millis(200),
        heartbeat_timeout: Duration::from_secs(10),
        register_timeout: gradpack::store::param_server::config::DEFAULT_REGISTER_TIMEOUT,
        connection_grace: gradpack::store::param_server::config::DEFAULT_CONNECTION_GRACE,
        verbose: 0,
        bigarray_bound: 1000,
        partition_bytes: 4 << 20,
        max_message_bytes: gradpack::store::param_server::config::DEFAULT_MAX_MESSAGE_BYTES,
        secret,
    }
}

/// The same over real sockets: 10k mutated frames to a live server of a job
/// without a secret (with one, each would be dropped at its MAC), after which
/// the job's own worker gets exact values and the job ends 0.
#[test]
fn a_live_server_survives_mutated_frames() {
    let port = loopback_port();
    let config = |role| live_config(role, port, None);
    let sched = { let c = config(Role::Scheduler); thread::spawn(move || serve(c)) };
    let server = { let c = config(Role::Server); thread::spawn(move || serve(c)) };
    let w = DistWorker::start("dist_sync", config(Role::Worker)).unwrap();
    let k = Key::Int(5);
    w.init(&k, Array { shape: &[40], data: Grad::F32(&[1.0; 40]) }).unwrap();
    let (host, server_port) = w.server_addresses()[0].clone();
    let ctx = zmq::Context::new();
    let rogue = ctx.socket(zmq::DEALER).unwrap();
    rogue.set_linger(0).unwrap();
    rogue.connect(&format!("tcp://{host}:{server_port}")).unwrap();
    let seeds = seeds();
    let mut rng = Rng(0xBEEF);
    let mut sent = 0usize;
    for i in 0..12_000 {
        let (h, p) = &seeds[3 + i % (seeds.len() - 3)];
        // Without a secret the job cannot tell a forged request from a real
        // one: a frame that still decodes is kept off the checked key and
        // off the commands that legitimately change the job (optimizer,
        // compression, stop). What remains is every malformed frame and
        // every well-formed data request an outsider could make.
        let mut h = mutate(&mut rng, h);
        if let Ok(mut m) = Meta::decode(&h) {
            if !matches!(m.command, Command::Init | Command::Push | Command::Pull | Command::Response) {
                continue;
            }
            if m.key == Some(k.clone()) {
                m.key = Some(Key::Int(6));
            }
            m.sender = w.postoffice().me.id; // a job member's id: an outsider's would be dropped before the handler
            h = m.encode();
        }
        sent += 1;
        rogue.send_multipart([h, mutate(&mut rng, p)], 0).unwrap();
    }
    assert!(sent >= 10_000, "{sent} frames sent");
    // A round trip after the flood: the server handled everything before it.
    w.push(&k, &[Array { shape: &[40], data: Grad::F32(&[0.25; 40]) }]).unwrap();
    let mut out = vec![0f32; 40];
    w.pull(&k, &mut [ArrayMut { shape: &[40], data: &mut out }]).unwrap();
    assert_eq!(out, vec![0.25; 40]);
    w.close();
    sched.join().unwrap().unwrap();
    server.join().unwrap().unwrap();
}

/// With a secret: genuine frames, signed by the job's worker for its server,
/// then sent with another destination (signed for the scheduler), from
/// another job that shares the secret (same node ids), or altered in one
/// byte of header, payload or tag after signing: every one is dropped and
/// counted, and the key keeps exact values.
#[test]
fn genuine_frames_with_another_destination_or_job_are_dropped() {
    use gradpack::store::param_server::auth::{Auth, Secret};
    let port = loopback_port();
    let secret = Secret::new(b"fuzz").unwrap();
    let config = |role| live_config(role, port, Some(secret.clone()));
    let sched = { let c = config(Role::Scheduler); thread::spawn(move || serve(c)) };
    let (tx, rx) = std::sync::mpsc::channel();
    let server = {
        let c = config(Role::Server);
        thread::spawn(move || {
            let post = gradpack::store::param_server::server::start_server(c)?;
            tx.send(post.clone()).unwrap();
            let r = post.customer.wait_until_over();
            post.stop();
            r
        })
    };
    let w = DistWorker::start("dist_sync", config(Role::Worker)).unwrap();
    let srv = rx.recv_timeout(Duration::from_secs(60)).unwrap();
    let k = Key::Int(5);
    w.init(&k, Array { shape: &[40], data: Grad::F32(&[1.0; 40]) }).unwrap();
    let me = w.postoffice();
    let signer = me.van.auth().unwrap();
    // Another job with the same secret, the same node ids and nonces known.
    let twin = Auth::new(secret.clone());
    twin.join([7; 16], 1, 77);
    twin.bind(srv.me.id, srv.van.auth().unwrap().nonce());
    let ctx = zmq::Context::new();
    let rogue = ctx.socket(zmq::DEALER).unwrap();
    rogue.set_linger(1000).unwrap();
    rogue.connect(&format!("tcp://{}:{}", srv.me.host, srv.me.port)).unwrap();
    let seeds = seeds();
    let mut rng = Rng(0xACE);
    let mut sent = 0u64;
    for i in 0..3000 {
        let (h, p) = &seeds[3 + i % (seeds.len() - 3)];
        let Ok(mut m) = Meta::decode(h) else { continue };
        m.sender = me.me.id;
        if m.key.is_some() {
            m.key = Some(k.clone());
        }
        let h = m.encode();
        let frames = match i % 3 {
            0 => vec![h.clone(), p.clone(), signer.sign(1, &h, p).unwrap()],
            1 => vec![h.clone(), p.clone(), twin.sign(srv.me.id, &h, p).unwrap()],
            _ => {
                let mut f = vec![h.clone(), p.clone(), signer.sign(srv.me.id, &h, p).unwrap()];
                let which = rng.below(3);
                if f[which].is_empty() {
                    f[2][0] ^= 1;
                } else {
                    let at = rng.below(f[which].len());
                    f[which][at] ^= 1 << rng.below(8);
                }
                f
            }
        };
        rogue.send_multipart(frames, 0).unwrap();
        sent += 1;
    }
    let dropped = || srv.van.traffic.dropped.load(std::sync::atomic::Ordering::Relaxed);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while dropped() < sent {
        assert!(std::time::Instant::now() < deadline, "{} of {sent} dropped", dropped());
        thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(dropped(), sent);
    let mut out = vec![0f32; 40];
    w.pull(&k, &mut [ArrayMut { shape: &[40], data: &mut out }]).unwrap();
    assert_eq!(out, vec![1.0; 40]);
    w.push(&k, &[Array { shape: &[40], data: Grad::F32(&[0.25; 40]) }]).unwrap();
    w.pull(&k, &mut [ArrayMut { shape: &[40], data: &mut out }]).unwrap();
    assert_eq!(out, vec![0.25; 40]);
    w.close();
    sched.join().unwrap().unwrap();
    server.join().unwrap().unwrap();
}
