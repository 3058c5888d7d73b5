//! The wire form of a scheme's parts: a part as bytes and back (float32s,
//! scale indices and codes in the narrowest lanes, a pulled sum in base-k
//! digits), a round's decoded value sent losslessly, and `LaneSum`, the
//! server's sum of workers' codes kept in packed lanes. Every length and
//! range is checked before anything of that size is allocated. Must not
//! touch: the schemes' algebra (`mod.rs`) or the selection (`randomk`).

use super::Part;
use crate::bytes::Reader;
use crate::error::{Error, Result};
use crate::quant::{digits, lanes};

/// Wire form of a part (a header, then payload): float32 bytes, or lanes of
/// the narrowest width that holds `hi - lo` (codes) or `count - 1` (scale
/// indices).
pub fn to_wire(part: &Part) -> Vec<u8> {
    let mut out = Vec::new();
    write_part(&mut out, part, 1);
    out
}

/// Wire form of a sum over `workers` workers' parts: codes keep each
/// worker's range in `Part::Codes`, so their lanes are widened for the sum.
pub fn sum_to_wire(sum: &Part, workers: usize) -> Vec<u8> {
    let mut out = Vec::new();
    write_part(&mut out, sum, workers as i32);
    out
}

/// Appends `part`'s wire form, code ranges multiplied by `workers`.
fn write_part(out: &mut Vec<u8>, part: &Part, workers: i32) {
    match part {
        Part::F32(x) => {
            out.push(0);
            out.extend((x.len() as u64).to_le_bytes());
            out.reserve(4 * x.len()); // one allocation, as the lanes' resize and extend below make
            x.iter().for_each(|v| out.extend(v.to_le_bytes()));
        }
        Part::Levels { levels, count } => {
            out.push(1);
            out.extend((levels.len() as u64).to_le_bytes());
            out.push(*count);
            let width = lanes::width_for(*count as u64 - 1);
            let start = out.len();
            out.resize(start + 8 * lanes::words_for(levels.len(), width), 0);
            lanes::pack_bytes_into_bytes(levels, width, &mut out[start..]);
        }
        Part::Packed { words, n, lo, hi, count, width } if *count as i32 == workers && *width == lanes::width_for(((*hi as i64 - *lo as i64) * workers as i64) as u64) => {
            // Already the wire's lanes (`code sum - lo * workers`): the words as they are.
            out.push(2);
            out.extend((*n as u64).to_le_bytes());
            out.extend((lo * workers).to_le_bytes());
            out.extend((hi * workers).to_le_bytes());
            #[cfg(target_endian = "little")]
            out.extend_from_slice(lanes::words_as_bytes(words));
            #[cfg(not(target_endian = "little"))]
            words.iter().for_each(|w| out.extend_from_slice(&w.to_le_bytes()));
        }
        Part::Packed { .. } => write_part(out, &part.unpacked().expect("a packed part's own words"), workers),
        Part::Codes { codes, lo, hi } => {
            let (lo, hi) = (&(lo * workers), &(hi * workers));
            out.push(2);
            out.extend((codes.len() as u64).to_le_bytes());
            out.extend(lo.to_le_bytes());
            out.extend(hi.to_le_bytes());
            let width = lanes::width_for((*hi as i64 - *lo as i64) as u64);
            let lo = *lo as i64;
            let start = out.len();
            out.resize(start + 8 * lanes::words_for(codes.len(), width), 0);
            lanes::pack_slice_into_bytes(codes, width, |c| (c as i64 - lo) as u64, &mut out[start..]);
        }
    }
}

/// Appends a summed final contribution: as base-k digits (kind 3) when its
/// range, `workers` times a worker's, takes fewer bits so than in lanes
/// (`digits::denser`: 1-bit over 2 or 4 workers, qsgd_mn_ms's 1-bit scale
/// over 2), else
/// as `write_part` does. Only a pulled sum goes this way: digits cannot be
/// added word by word, so what servers sum stays in lanes.
fn write_sum(out: &mut Vec<u8>, part: &Part, workers: i32) {
    let (n, lo, hi) = match part {
        Part::Packed { n, lo, hi, count, .. } if *count as i32 == workers => (*n, *lo, *hi),
        Part::Codes { codes, lo, hi } => (codes.len(), *lo, *hi),
        _ => return write_part(out, part, workers),
    };
    let (lo, hi) = (lo as i64 * workers as i64, hi as i64 * workers as i64);
    let radix = hi - lo + 1;
    if !(lo >= i32::MIN as i64 && hi <= i32::MAX as i64 && radix <= 1 << 16 && digits::denser(radix as u32)) {
        return write_part(out, part, workers);
    }
    let mut words = vec![0u16; digits::words_for(n, radix as u32)];
    match part {
        // the lanes of a sum over `workers` hold `sum - lo`, below the radix
        Part::Packed { words: lanes, width, .. } => digits::from_lanes(lanes, *width, n, radix as u32, &mut words),
        Part::Codes { codes, .. } => {
            let vals: Vec<u32> = codes.iter().map(|&c| (c as i64 - lo) as u32).collect();
            digits::pack(&vals, radix as u32, &mut words)
        }
        _ => unreachable!("matched above"),
    }
    out.push(3);
    out.extend((n as u64).to_le_bytes());
    out.extend((lo as i32).to_le_bytes());
    out.extend((hi as i32).to_le_bytes());
    out.extend(words.iter().flat_map(|w| w.to_le_bytes()));
}

/// Whether `bytes` is a part of codes (kind 2): what a server sums packed (`LaneSum`).
pub fn is_codes_wire(bytes: &[u8]) -> bool {
    bytes.first() == Some(&2)
}

/// Workers' codes summed in packed lanes wide enough for the sum, never
/// unpacked until the round is complete. Each worker's codes arrive in
/// lanes just wide enough for its own range (kind 2, the fewest bytes);
/// each value is checked against the range and moved into its wide lane
/// (`lanes::add_widened`) before anything is added.
#[derive(Debug)]
pub struct LaneSum {
    n: usize,
    lo: i32,
    hi: i32,
    workers: u32,
    /// The sum's lane width: `workers * (hi - lo)` fits.
    width: u32,
    /// Contributions added so far (at most `workers`).
    count: u32,
    words: Vec<u64>,
}

/// A codes part's header `(n, lo, hi)` and its payload.
fn codes_header(bytes: &[u8]) -> Result<((usize, i32, i32), &[u8])> {
    let mut r = Reader::new(bytes, |p| Error::Transport(format!("malformed message: codes: {p}")));
    let kind = r.u8()?;
    if kind != 2 {
        return Err(r.error(&format!("kind {kind} is not codes")));
    }
    let n = r.u64()? as usize;
    let (lo, hi) = (r.u32()? as i32, r.u32()? as i32);
    if hi < lo {
        return Err(r.error(&format!("code range {lo}..={hi}")));
    }
    let payload = r.take(r.left())?;
    Ok(((n, lo, hi), payload))
}

impl LaneSum {
    /// The first worker's part of a round of `workers` workers.
    pub fn first(bytes: &[u8], workers: usize) -> Result<LaneSum> {
        let ((n, lo, hi), payload) = codes_header(bytes)?;
        let bad = |what: String| Error::Transport(format!("malformed message: codes: {what}"));
        let span = (hi as i64 - lo as i64) as u64;
        let total = span.checked_mul(workers as u64).filter(|&t| t <= i32::MAX as u64).ok_or_else(|| bad(format!("{workers} workers of codes in {lo}..={hi} overflow a sum")))?;
        // The payload must be what n values take, before n's words are allocated.
        if (payload.len() as u128) < 8 * lanes::words_for(n, lanes::width_for(span)) as u128 {
            return Err(bad(format!("{n} values in {} bytes", payload.len())));
        }
        let width = lanes::width_for(total);
        let mut sum = LaneSum { n, lo, hi, workers: workers as u32, width, count: 0, words: vec![0u64; lanes::words_for(n, width)] };
        sum.add(bytes)?;
        Ok(sum)
    }

    /// Adds another worker's part; it must match the first one's values and range.
    pub fn add(&mut self, bytes: &[u8]) -> Result<()> {
        let ((n, lo, hi), payload) = codes_header(bytes)?;
        if (n, lo, hi) != (self.n, self.lo, self.hi) {
            return Err(Error::Transport("malformed exchange: workers sent different kinds or lengths for 'final'".into()));
        }
        if self.count == self.workers {
            return Err(Error::Transport(format!("malformed exchange: more than {} workers' codes", self.workers)));
        }
        let span = (hi as i64 - lo as i64) as u64;
        lanes::add_widened(&mut self.words, self.width, payload, lanes::width_for(span), n, span)?;
        self.count += 1;
        Ok(())
    }

    /// The sum as `Part::Packed`, in the lanes it was summed in.
    pub fn into_part(self) -> Part {
        Part::Packed { words: self.words, n: self.n, lo: self.lo, hi: self.hi, count: self.count, width: self.width }
    }
}

/// A decoded sum sent losslessly: its step, the round's exchanged values and
/// the summed final contribution (codes in lanes wide enough for `workers`
/// workers' sum), from which `decode` rebuilds the same float32 bits.
pub fn value_to_wire(step: u64, exchanged: &[Part], sum: &Part, workers: usize) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend(step.to_le_bytes());
    out.extend((exchanged.len() as u32 + 1).to_le_bytes());
    let parts = exchanged.iter().map(|p| (p, 1)).chain([(sum, workers as i32)]);
    let last = exchanged.len();
    for (i, (part, workers)) in parts.enumerate() {
        let len_at = out.len();
        out.extend(0u64.to_le_bytes()); // the part's length, filled in below
        if i == last {
            write_sum(&mut out, part, workers);
        } else {
            write_part(&mut out, part, workers);
        }
        let len = (out.len() - len_at - 8) as u64;
        out[len_at..len_at + 8].copy_from_slice(&len.to_le_bytes());
    }
    out
}

/// Parses `value_to_wire`'s form: (step, exchanged values, sum).
pub fn value_from_wire(bytes: &[u8]) -> Result<(u64, Vec<Part>, Part)> {
    let mut r = Reader::new(bytes, |p| Error::Transport(format!("malformed message: scheme value: {p}")));
    let step = r.u64()?;
    let count = r.u32()? as usize;
    if count == 0 || count > 8 {
        return Err(r.error(&format!("{count} parts")));
    }
    let mut parts = Vec::with_capacity(count);
    for _ in 0..count {
        let len = r.len(1)?;
        parts.push(from_wire(r.take(len)?)?);
    }
    r.finish()?;
    let sum = parts.pop().unwrap();
    Ok((step, parts, sum))
}

/// A part claims `n` values of `width` bits: the frame must carry exactly the
/// words they take, checked before anything of size `n` is allocated (so a
/// claim of 2^40 or 2^62 values in a short frame is an error, not an abort).
fn check_lanes(n: usize, width: u32, bytes: usize) -> Result<()> {
    let want = lanes::words_for(n, width).checked_mul(8);
    if want != Some(bytes) {
        return Err(Error::Transport(format!("malformed message: {n} values of {width} bits need {} bytes, the frame carries {bytes}", want.map_or("more than 2^64".to_string(), |w| w.to_string()))));
    }
    Ok(())
}

/// Parses a wire part, checking every length and range.
pub fn from_wire(bytes: &[u8]) -> Result<Part> {
    let malformed = |what: &str| Error::Transport(format!("malformed message: {what}"));
    if bytes.len() < 9 {
        return Err(malformed("truncated exchange header"));
    }
    let n = u64::from_le_bytes(bytes[1..9].try_into().unwrap()) as usize;
    let rest = &bytes[9..];
    match bytes[0] {
        0 => {
            if rest.len() != n.checked_mul(4).ok_or_else(|| malformed("length overflows"))? {
                return Err(malformed(&format!("{} bytes for {n} float32", rest.len())));
            }
            Ok(Part::F32(rest.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()))
        }
        1 => {
            let (&count, words) = rest.split_first().ok_or_else(|| malformed("truncated scale indices"))?;
            if count == 0 {
                return Err(malformed("zero scales"));
            }
            let width = lanes::width_for(count as u64 - 1);
            check_lanes(n, width, words.len())?;
            let mut levels = vec![0u8; n];
            lanes::unpack_bytes_into(words, width, &mut levels, |v| v.min(255) as u8)?;
            // (every lane is below 2^width: only a count short of it needs a
            // look, a max that vectorizes where a search for the first does not)
            if (count as u32) < 1 << width && levels.iter().fold(0, |m, &l| m.max(l)) >= count {
                return Err(malformed(&format!("a scale index is not below {count}")));
            }
            Ok(Part::Levels { levels, count })
        }
        2 => {
            if rest.len() < 8 {
                return Err(malformed("truncated code range"));
            }
            let lo = i32::from_le_bytes(rest[0..4].try_into().unwrap());
            let hi = i32::from_le_bytes(rest[4..8].try_into().unwrap());
            if hi < lo {
                return Err(malformed(&format!("code range {lo}..={hi}")));
            }
            let span = (hi as i64 - lo as i64) as u64;
            let width = lanes::width_for(span);
            check_lanes(n, width, rest.len() - 8)?;
            // Kept packed (lanes = code - lo, one member: the range is the
            // sum's), after one check of every lane against the range.
            let words: Vec<u64> = rest[8..].chunks_exact(8).map(|b| u64::from_le_bytes(b.try_into().unwrap())).collect();
            if lanes::max_value(&words, width, n)? > span {
                return Err(malformed(&format!("a code is outside {lo}..={hi}")));
            }
            Ok(Part::Packed { words, n, lo, hi, count: 1, width })
        }
        3 => {
            // A pulled sum in base-k digits (`write_sum`), brought back to
            // lanes: every digit is below the radix by construction.
            if rest.len() < 8 {
                return Err(malformed("truncated code range"));
            }
            let lo = i32::from_le_bytes(rest[0..4].try_into().unwrap());
            let hi = i32::from_le_bytes(rest[4..8].try_into().unwrap());
            let span = hi as i64 - lo as i64;
            if !(1..1 << 16).contains(&span) {
                return Err(malformed(&format!("digits of the code range {lo}..={hi}")));
            }
            let radix = span as u32 + 1;
            let want = digits::words_for(n, radix).checked_mul(2);
            if want != Some(rest.len() - 8) {
                return Err(malformed(&format!("{n} values in base {radix} need {} bytes, the frame carries {}", want.map_or("more than 2^64".to_string(), |w| w.to_string()), rest.len() - 8)));
            }
            let words: Vec<u16> = rest[8..].chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
            let width = lanes::width_for(span as u64);
            Ok(Part::Packed { words: digits::to_lanes(&words, radix, n, width)?, n, lo, hi, count: 1, width })
        }
        t => Err(malformed(&format!("unknown exchange kind {t}"))),
    }
}
