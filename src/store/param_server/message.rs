//! Messages between nodes: their wire format and their one vocabulary, the
//! commands (`Command`), the bits of a message's `flags` (`Flag`) and the
//! exchanges a scheme's round runs on the servers (`Exchange`); the worker
//! writes these and the server reads them, neither defines its own. A
//! message travels as two ZeroMQ frames: a small binary header (`Meta`) and
//! the payload bytes, which are float32 values or packed 2-bit blocks moved
//! as bytes only. Decoding checks every length and tag: a malformed frame is
//! an error, never a panic.

use crate::bytes::Reader;
use crate::error::{Error, Result};
use crate::key::Key;

const MAGIC: u32 = 0x4750_4b31; // "GPK1"

/// What a message asks for or answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Command {
    // membership (node <-> scheduler)
    Register = 1,
    AddNodes = 2,
    Refused = 3,
    Barrier = 4,
    BarrierDone = 5,
    Heartbeat = 6,
    HeartbeatAck = 7,
    NodeFailed = 8,
    WorkerDone = 9,
    Terminate = 10,
    /// The scheduler's answer to a registration signed outside the job: the
    /// job id (`job=`), under which the node registers again.
    Challenge = 11,
    /// A node's first message on each connection it opens to a peer of the
    /// job (worker <-> server), so that the peer's gate counts the
    /// connection as proven at once, however long it then stays idle.
    Hello = 12,
    // data (worker <-> server)
    SetCompress = 20,
    SetOptimizer = 21,
    SetScaling = 22,
    Init = 23,
    Push = 24,
    Pull = 25,
    /// Answers a data request: `status` 0 and a payload, or an error message.
    Response = 26,
}

impl Command {
    fn from_u8(v: u8) -> Result<Command> {
        use Command::*;
        Ok(match v {
            1 => Register,
            2 => AddNodes,
            3 => Refused,
            4 => Barrier,
            5 => BarrierDone,
            6 => Heartbeat,
            7 => HeartbeatAck,
            8 => NodeFailed,
            9 => WorkerDone,
            10 => Terminate,
            11 => Challenge,
            12 => Hello,
            20 => SetCompress,
            21 => SetOptimizer,
            22 => SetScaling,
            23 => Init,
            24 => Push,
            25 => Pull,
            26 => Response,
            other => return Err(malformed(&format!("unknown command {other}"))),
        })
    }
}

/// One bit of `Meta::flags`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Flag {
    /// Push payload: a 2-bit compressed array (header and blocks).
    Compressed = 1,
    /// Push: apply this push at once (dist_async).
    Async = 2,
    /// Pull response: the payload is in the code-count encoding (`counts`).
    CodeCounts = 4,
    /// Push: one exchange of a scheme, reduced over every worker and answered
    /// to each with the result. Body: `op` (an `Exchange`), `step`, `phase`.
    Exchange = 8,
    /// Push: a scheme's final contribution: summed, decoded once with the
    /// round's exchanges, then applied like any push. Body: `step`.
    Scheme = 16,
    /// Pull response: the value is a scheme's decoded sum, sent as its
    /// exchanges and summed codes (`scheme::value_to_wire`); lossless.
    SchemeValue = 32,
    /// A sync push that failed on its worker (a wrong shape, a NaN): it takes
    /// the worker's turn in the round and fails the round for every worker;
    /// the body says why.
    Abort = 64,
}

impl Flag {
    pub const fn bit(self) -> u16 {
        self as u16
    }
}

/// The reduction of one exchange of a scheme's round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exchange {
    /// Elementwise maximum of float32 parts (shared scales).
    Max,
    /// Elementwise sum of float32 parts or of codes.
    Sum,
    /// Elementwise minimum of level indices (multi-scale masks).
    Min,
    /// The round's final contribution, summed as `Sum`.
    Final,
}

impl Exchange {
    /// The name on the wire (the `op` of an exchange's body).
    pub fn name(self) -> &'static str {
        match self {
            Exchange::Max => "max",
            Exchange::Sum => "sum",
            Exchange::Min => "min",
            Exchange::Final => "final",
        }
    }

    pub fn parse(name: &str) -> Option<Exchange> {
        [Exchange::Max, Exchange::Sum, Exchange::Min, Exchange::Final].into_iter().find(|e| e.name() == name)
    }
}

/// The header of a message.
#[derive(Clone, Debug, PartialEq)]
pub struct Meta {
    pub command: Command,
    pub flags: u16,
    /// Sender's node id (0 until the scheduler assigned one).
    pub sender: i32,
    /// Matches a response to its request.
    pub request_id: u64,
    pub key: Option<Key>,
    /// First element of the slice this message carries, and its length.
    pub offset: u64,
    pub len: u64,
    /// In a response: 0 ok; non-zero: `body` holds the error message. In a
    /// request: the barriers its worker has passed (servers fail a sync push
    /// that another worker's barrier blocks).
    pub status: i32,
    /// Text: registration data, node tables, parameters, error messages.
    pub body: String,
}

impl Meta {
    /// Whether `flag` is set in `flags`.
    pub fn has(&self, flag: Flag) -> bool {
        self.flags & flag.bit() != 0
    }

    pub fn set(&mut self, flag: Flag) {
        self.flags |= flag.bit();
    }

    pub fn new(command: Command, sender: i32) -> Meta {
        Meta { command, flags: 0, sender, request_id: 0, key: None, offset: 0, len: 0, status: 0, body: String::new() }
    }
}

/// A payload: bytes owned by ZeroMQ, moved without copies from the socket to
/// the reader and from a `Vec` to the socket. Its clones (the same bytes,
/// copied) share one digest cell: a payload sent to several nodes is hashed
/// for their MACs once (`auth`).
pub struct Payload {
    bytes: zmq::Message,
    digest: std::sync::Arc<std::sync::OnceLock<[u8; 32]>>,
}

impl Payload {
    pub fn empty() -> Payload {
        Payload::from(zmq::Message::new())
    }

    /// The BLAKE3 hash of the bytes, computed once for this payload and its clones.
    pub fn digest(&self) -> &[u8; 32] {
        self.digest.get_or_init(|| *blake3::hash(&self.bytes).as_bytes())
    }
}

impl std::ops::Deref for Payload {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

impl From<Vec<u8>> for Payload {
    fn from(v: Vec<u8>) -> Payload {
        Payload::from(zmq::Message::from(v))
    }
}

impl From<zmq::Message> for Payload {
    fn from(m: zmq::Message) -> Payload {
        Payload { bytes: m, digest: Default::default() }
    }
}

impl From<Payload> for zmq::Message {
    fn from(p: Payload) -> zmq::Message {
        p.bytes
    }
}

impl Clone for Payload {
    fn clone(&self) -> Payload {
        Payload { bytes: zmq::Message::from(&self[..]), digest: self.digest.clone() }
    }
}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Payload({} bytes)", self.len())
    }
}

impl PartialEq for Payload {
    fn eq(&self, other: &Payload) -> bool {
        self[..] == other[..]
    }
}

/// A whole message: header and payload.
#[derive(Clone, Debug, PartialEq)]
pub struct Message {
    pub meta: Meta,
    pub data: Payload,
}

fn malformed(problem: &str) -> Error {
    Error::Transport(format!("malformed message: {problem}"))
}

impl Meta {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.body.len());
        out.extend(MAGIC.to_le_bytes());
        out.push(self.command as u8);
        out.extend(self.flags.to_le_bytes());
        out.extend(self.sender.to_le_bytes());
        out.extend(self.request_id.to_le_bytes());
        match &self.key {
            None => out.push(0),
            Some(Key::Int(k)) => {
                out.push(1);
                out.extend(k.to_le_bytes());
            }
            Some(Key::Str(s)) => {
                out.push(2);
                out.extend((s.len() as u32).to_le_bytes());
                out.extend(s.as_bytes());
            }
        }
        out.extend(self.offset.to_le_bytes());
        out.extend(self.len.to_le_bytes());
        out.extend(self.status.to_le_bytes());
        out.extend((self.body.len() as u32).to_le_bytes());
        out.extend(self.body.as_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Meta> {
        let mut r = Reader::new(bytes, |p| malformed(&format!("header: {p}")));
        if r.u32()? != MAGIC {
            return Err(malformed("bad magic (not a gradpack message)"));
        }
        let command = Command::from_u8(r.u8()?)?;
        let flags = r.u16()?;
        let sender = r.u32()? as i32;
        let request_id = r.u64()?;
        let key = match r.u8()? {
            0 => None,
            1 => Some(Key::Int(r.u64()? as i64)),
            2 => {
                let n = r.u32()? as usize;
                let s = std::str::from_utf8(r.take(n)?).map_err(|_| malformed("key is not UTF-8"))?;
                Some(Key::Str(s.to_string()))
            }
            t => return Err(malformed(&format!("bad key tag {t}"))),
        };
        let offset = r.u64()?;
        let len = r.u64()?;
        let status = r.u32()? as i32;
        let n = r.u32()? as usize;
        let body = std::str::from_utf8(r.take(n)?).map_err(|_| malformed("body is not UTF-8"))?.to_string();
        r.finish()?;
        Ok(Meta { command, flags, sender, request_id, key, offset, len, status, body })
    }
}

/// float32 values as little-endian bytes (one memcpy: the wire owns its buffer).
pub fn f32s_to_bytes(v: &[f32]) -> Vec<u8> {
    if cfg!(target_endian = "little") {
        // SAFETY: any f32 slice is readable as bytes; on little-endian they are the wire's order.
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }.to_vec()
    } else {
        v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()
    }
}

fn check_f32_len(b: &[u8]) -> Result<usize> {
    if b.len() % 4 != 0 {
        return Err(malformed(&format!("payload of {} bytes is not a whole number of float32", b.len())));
    }
    Ok(b.len() / 4)
}

/// Bytes back into float32 values, bit for bit: borrowed when the buffer is
/// aligned (the usual case), copied otherwise. The length must be a multiple of 4.
pub fn f32_view(b: &[u8]) -> Result<std::borrow::Cow<'_, [f32]>> {
    let n = check_f32_len(b)?;
    if cfg!(target_endian = "little") {
        // SAFETY: every bit pattern is a valid f32; align_to only yields the aligned middle.
        let (head, mid, _) = unsafe { b.align_to::<f32>() };
        if head.is_empty() && mid.len() == n {
            return Ok(std::borrow::Cow::Borrowed(mid));
        }
    }
    Ok(std::borrow::Cow::Owned(b.chunks_exact(4).map(|c| f32::from_bits(u32::from_le_bytes(c.try_into().unwrap()))).collect()))
}

/// Bytes back into an owned float32 vector, bit for bit.
pub fn bytes_to_f32s(b: &[u8]) -> Result<Vec<f32>> {
    Ok(f32_view(b)?.into_owned())
}

/// `key=value` lines, the text bodies of control messages.
pub fn encode_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    pairs.into_iter().map(|(k, v)| format!("{k}={v}\n")).collect()
}

pub fn decode_pairs(body: &str) -> Result<Vec<(String, String)>> {
    body.lines()
        .filter(|l| !l.is_empty())
        .map(|l| l.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())).ok_or_else(|| malformed(&format!("bad parameter line '{l}'"))))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meta_round_trips() {
        for key in [None, Some(Key::Int(-7)), Some(Key::Str("fc1_weight".into()))] {
            let mut m = Meta::new(Command::Push, 9);
            m.flags = Flag::Compressed.bit();
            m.request_id = 1 << 40;
            m.key = key;
            m.offset = 16;
            m.len = 33;
            m.status = -1;
            m.body = "a=1\nb=x\n".into();
            assert_eq!(Meta::decode(&m.encode()).unwrap(), m);
        }
    }

    #[test]
    fn malformed_headers_are_errors() {
        let good = Meta::new(Command::Pull, 3).encode();
        for bad in [&b""[..], &good[..good.len() - 1], &[0u8; 40][..]] {
            assert!(Meta::decode(bad).unwrap_err().to_string().contains("malformed"));
        }
        let mut extra = good.clone();
        extra.push(0);
        assert!(Meta::decode(&extra).unwrap_err().to_string().contains("trailing"));
        let mut cmd = good.clone();
        cmd[4] = 99;
        assert!(Meta::decode(&cmd).unwrap_err().to_string().contains("unknown command 99"));
    }

    #[test]
    fn payload_bits_survive() {
        let v = [f32::from_bits(1), -0.0, f32::from_bits(0x1242_0000), f32::NAN];
        let back = bytes_to_f32s(&f32s_to_bytes(&v)).unwrap();
        assert_eq!(back.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), v.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        assert!(bytes_to_f32s(&[0; 5]).is_err());
        assert_eq!(decode_pairs(&encode_pairs([("a", "1"), ("b", "x=y")])).unwrap(), vec![("a".into(), "1".into()), ("b".into(), "x=y".into())]);
    }

    #[test]
    fn names_round_trip_and_bits_are_distinct() {
        for e in [Exchange::Max, Exchange::Sum, Exchange::Min, Exchange::Final] {
            assert_eq!(Exchange::parse(e.name()), Some(e));
        }
        assert_eq!(Exchange::parse("avg"), None);
        let flags = [Flag::Compressed, Flag::Async, Flag::CodeCounts, Flag::Exchange, Flag::Scheme, Flag::SchemeValue, Flag::Abort];
        assert_eq!(flags.iter().fold(0u16, |acc, f| acc | f.bit()).count_ones() as usize, flags.len());
    }
}
