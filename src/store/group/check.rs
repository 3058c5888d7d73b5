//! What every rank of a group must agree on before a bucket's result is
//! used, and the one text of each disagreement. The fields travel two
//! ways: a blocking MAX round (`agree`, where no rank can know the sizes
//! of the bucket's collectives yet), or a tail of the bucket's final sum of
//! 64-bit words (`Tail`), which costs no round of its own. Every rank
//! derives the same verdict from the same reduced values.

use crate::error::{Error, Result};
use crate::quant::collective::{self, Collective};

/// The fields, in the order they are compared and named.
pub const NAMES: [&str; 4] = [
    "bucket layout (the tensors' keys and shapes)",
    "push counts (a checkpoint loaded on some ranks only?)",
    "compression parameters",
    "world size, start_iter, min_compression_rate or the bucket's tag (FSDP2's reduce op and divide factor)",
];

/// What a rank found wrong with its own bucket before any exchange.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Own {
    /// A key twice in one bucket, or pushed while its bucket is in flight.
    Twice = 1,
    /// A key pushed before with another shape.
    Reshaped = 2,
    /// A key loaded from a checkpoint with another shape.
    Resaved = 3,
    /// The front refused the rank's input before any exchange (`Group::refuse`):
    /// a dtype gradpack does not compress,
    Dtype = 4,
    /// a tensor on another device than this build compresses on,
    Device = 5,
    /// a tensor whose elements share memory (it cannot hold a result),
    Overlap = 6,
    /// a key that is not one (empty, not a str, holding a NUL),
    KeyText = 7,
    /// a buffer that does not hold the tensors it names,
    Sizes = 8,
    /// ranks of its node that disagree on the bucket or the settings
    /// (the hierarchical exchange's node, before its reduce-scatter).
    Node = 9,
}

impl Own {
    fn from_code(code: u64) -> Option<Own> {
        Own::ALL.into_iter().find(|o| *o as u64 == code)
    }

    const ALL: [Own; 9] = [Own::Twice, Own::Reshaped, Own::Resaved, Own::Dtype, Own::Device, Own::Overlap, Own::KeyText, Own::Sizes, Own::Node];

    /// A front's refusal by its number in the C ABI (`gp_group_refuse`: 1
    /// dtype, 2 device, 3 overlapping memory, 4 key, 5 sizes, 6 a node
    /// that disagrees).
    pub fn refusal(code: u32) -> Option<Own> {
        match code {
            1 => Some(Own::Dtype),
            2 => Some(Own::Device),
            3 => Some(Own::Overlap),
            4 => Some(Own::KeyText),
            5 => Some(Own::Sizes),
            6 => Some(Own::Node),
            _ => None,
        }
    }

    fn text(self) -> &'static str {
        match self {
            Own::Twice => "pushed twice at once (twice in one bucket, or while its bucket is in flight)",
            Own::Reshaped => "pushed before with another shape",
            Own::Resaved => "loaded from a checkpoint with another shape",
            Own::Dtype => "refused there: its dtype is not one gradpack compresses (float32, float16 or bfloat16)",
            Own::Device => "refused there: not on a device this build compresses on (CPU tensors only)",
            Own::Overlap => "refused there: its elements share memory (an expanded view), so it cannot hold the result",
            Own::KeyText => "refused there: not a key gradpack takes (a non-empty str without NUL)",
            Own::Sizes => "refused there: its buffer does not hold the tensors it names (their sizes, order or dimensions)",
            Own::Node => "refused there: the ranks of its node disagree on this bucket (its keys, their order or shapes, a rank's refusal) or on the State's settings (compress_params, start_iter, min_compression_rate, exchange)",
        }
    }
}

/// One rank's side of a bucket's agreement.
#[derive(Clone, Copy, Debug, Default)]
pub struct Mine {
    pub fields: [u64; 4],
    /// This rank sent stand-in values (its bucket is not the one every rank expected).
    pub flagged: bool,
    /// This rank's own failure: the kind and the tensor's index.
    pub own: Option<(Own, usize)>,
    /// The index of the first tensor whose gradient is not finite.
    pub fault: Option<usize>,
}

/// The verdict every rank reaches alike.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    /// Indices (in `NAMES`) of the fields that differ between ranks.
    pub differs: Vec<usize>,
    /// How many ranks sent stand-in values.
    pub flagged: u64,
    /// (ranks, the rank and own-failure code when one rank failed).
    pub own: (u64, Option<(u64, u64)>),
    /// (ranks, the rank and tensor when one rank's gradient is not finite).
    pub fault: (u64, Option<(u64, u64)>),
}

impl Verdict {
    pub fn clean(&self) -> bool {
        self.differs.is_empty() && self.flagged == 0 && self.own.0 == 0 && self.fault.0 == 0
    }

    /// The error every rank raises (None when the only finding is that
    /// every rank sent stand-ins for the same new bucket). `key(i)` names
    /// tensor `i` of the bucket and `step(i)` its push count; `what` is
    /// what the fault check read ("gradient", "residual + gradient").
    /// A rank's own failure comes first: the fields of a rank that refused
    /// its bucket (push counts of zero, a stand-in key) differ from the
    /// others' because of it.
    pub fn error(&self, key: impl Fn(usize) -> Option<String>, step: impl Fn(usize) -> u64, what: &str) -> Option<Error> {
        if !self.differs.is_empty() && self.own.0 == 0 {
            let named: Vec<&str> = self.differs.iter().filter_map(|&f| NAMES.get(f).copied()).collect();
            return Some(Error::Store(format!("gradpack: the ranks disagree on {}; every rank must run the same model with the same gradpack State settings, and load checkpoints on every rank alike", named.join(", "))));
        }
        if self.own.0 > 0 {
            return Some(Error::Store(match self.own.1 {
                Some((rank, code)) => {
                    let (kind, i) = (Own::from_code(code >> 32), (code & 0xFFFF_FFFF) as usize);
                    // (a key refused as a key, or pushed twice in one bucket, is
                    // named by its place: at that place each rank holds its own key)
                    let key = match kind {
                        Some(Own::KeyText | Own::Twice) => format!("at tensor {} of its bucket", i.saturating_sub(1)),
                        _ => i.checked_sub(1).and_then(&key).unwrap_or_else(|| "?".into()),
                    };
                    format!("gradpack: rank {rank}'s key {key} was {}; nothing was applied on any rank", kind.map_or("refused", Own::text))
                }
                None => format!("gradpack: {} ranks refused their own buckets (a key pushed twice at once or with another shape than before, or an input their front refused: each such rank says why); nothing was applied on any rank", self.own.0),
            }));
        }
        if self.fault.0 > 0 {
            return Some(Error::Store(match self.fault.1 {
                Some((rank, i)) => {
                    let i = (i as usize).saturating_sub(1);
                    format!("gradpack: rank {rank}'s {what} of key {} holds a non-finite value (inf or NaN) at push {}; nothing was applied on any rank", key(i).unwrap_or_else(|| "?".into()), step(i))
                }
                None => format!("gradpack: the {what}s of {} ranks hold non-finite values (inf or NaN); nothing was applied on any rank", self.fault.0),
            }));
        }
        None
    }
}

/// 16-bit pieces of each field: summed with their squares, they show
/// exactly whether every rank held the same value.
fn pieces(fields: &[u64; 4]) -> impl Iterator<Item = u64> + '_ {
    fields.iter().flat_map(|&v| (0..4).map(move |i| (v >> (16 * i)) & 0xFFFF))
}

/// The words a rank appends to its final sum of 64-bit words.
pub const TAIL_WORDS: usize = 2 * 16 + 1 + 3 + 3;

/// This rank's tail: per piece its value and square, then the flag, the
/// own failure and the fault as counts and sums (one failing rank is named
/// exactly; sums stay exact below 2^32 ranks).
pub fn tail(mine: &Mine, rank: usize) -> [u64; TAIL_WORDS] {
    let mut t = [0u64; TAIL_WORDS];
    for (i, p) in pieces(&mine.fields).enumerate() {
        t[2 * i] = p;
        t[2 * i + 1] = p * p;
    }
    let r = rank as u64 + 1;
    t[32] = mine.flagged as u64;
    if let Some((own, i)) = mine.own {
        t[33..36].copy_from_slice(&[1, r, (own as u64) << 32 | (i as u64 + 1)]);
    }
    if let Some(i) = mine.fault {
        t[36..39].copy_from_slice(&[1, r, i as u64 + 1]);
    }
    t
}

fn named(count: u64, rank_sum: u64, code: u64) -> (u64, Option<(u64, u64)>) {
    (count, (count == 1).then(|| (rank_sum - 1, code)))
}

/// The verdict from the tails summed over `world` ranks: a field differs
/// unless, for each piece, `world * sum(p^2) == sum(p)^2` (Cauchy-Schwarz:
/// equal only when every rank's piece is the same; exact in 128 bits).
pub fn read_tail(sum: &[u64], world: usize) -> Result<Verdict> {
    if sum.len() != TAIL_WORDS {
        return Err(Error::Internal(format!("a bucket's tail of {} words (expected {TAIL_WORDS})", sum.len())));
    }
    let w = world as u128;
    let differs = (0..4).filter(|f| (0..4).any(|i| {
        let (s, q) = (sum[2 * (4 * f + i)] as u128, sum[2 * (4 * f + i) + 1] as u128);
        w * q != s * s
    }));
    let v = Verdict { differs: differs.collect(), flagged: sum[32], own: named(sum[33], sum[34], sum[35]), fault: named(sum[36], sum[37], sum[38]) };
    if v.flagged > world as u64 || v.own.0 > world as u64 || v.fault.0 > world as u64 {
        return Err(Error::Internal(format!("a bucket's tail counts more ranks than the {world} there are")));
    }
    Ok(v)
}

/// The floats a rank appends to a bucket summed wholly as float32 (no
/// words to carry the tail), with 8-bit pieces so that every sum is an
/// exact integer in float32 for up to `FLOAT_TAIL_RANKS` ranks.
pub const TAIL_FLOATS: usize = 2 * 32 + 1 + 4 + 3;

/// The most ranks whose float tails sum exactly (`255^2 * 258 < 2^24`).
pub const FLOAT_TAIL_RANKS: usize = 256;

/// `tail` as float32, for a bucket summed wholly as float32.
pub fn tail_f32(mine: &Mine, rank: usize) -> [f32; TAIL_FLOATS] {
    let mut t = [0f32; TAIL_FLOATS];
    let bytes = mine.fields.iter().flat_map(|v| v.to_le_bytes());
    for (i, b) in bytes.enumerate() {
        t[2 * i] = b as f32;
        t[2 * i + 1] = (b as u32 * b as u32) as f32;
    }
    let r = rank as f32 + 1.0;
    t[64] = mine.flagged as u8 as f32;
    if let Some((own, i)) = mine.own {
        t[65..69].copy_from_slice(&[1.0, r, own as u64 as f32, i as f32 + 1.0]);
    }
    if let Some(i) = mine.fault {
        t[69..72].copy_from_slice(&[1.0, r, i as f32 + 1.0]);
    }
    t
}

/// `read_tail` of float tails summed over `world` ranks (at most
/// `FLOAT_TAIL_RANKS`; every value an exact integer).
pub fn read_tail_f32(sum: &[f32], world: usize) -> Result<Verdict> {
    if sum.len() != TAIL_FLOATS || world > FLOAT_TAIL_RANKS || sum.iter().any(|v| !(v.is_finite() && *v >= 0.0 && v.fract() == 0.0)) {
        return Err(Error::Internal(format!("a bucket's float tail of {} values over {world} ranks is not one gradpack made", sum.len())));
    }
    let v: Vec<u64> = sum.iter().map(|&x| x as u64).collect();
    let w = world as u64;
    let differs = (0..4).filter(|f| (0..8).any(|i| w * v[2 * (8 * f + i) + 1] != v[2 * (8 * f + i)] * v[2 * (8 * f + i)]));
    let own = (v[65], (v[65] == 1).then(|| (v[66] - 1, v[67] << 32 | v[68])));
    let verdict = Verdict { differs: differs.collect(), flagged: v[64], own, fault: named(v[69], v[70], v[71]) };
    if verdict.flagged > w || verdict.own.0 > w || verdict.fault.0 > w {
        return Err(Error::Internal(format!("a bucket's tail counts more ranks than the {world} there are")));
    }
    Ok(verdict)
}

/// The blocking form, for when no rank knows the sizes of the bucket's
/// collectives yet or an exchange failed on every rank: one MAX round
/// (`collective::compare_fields`) of the fields, the flag, the own
/// failure's and the fault's codes. A failing rank is named exactly when
/// it is the only one.
pub fn agree(coll: &mut dyn Collective, mine: &Mine, rank: usize) -> Result<Verdict> {
    let r = rank as u64 + 1;
    let own = mine.own.map_or(0, |(o, i)| r << 40 | (o as u64) << 32 | (i as u64 + 1));
    let fault = mine.fault.map_or(0, |i| r << 32 | (i as u64 + 1));
    let ones = [mine.flagged as u64, mine.own.is_some() as u64, mine.fault.is_some() as u64];
    let values = [mine.fields[0], mine.fields[1], mine.fields[2], mine.fields[3], own, fault];
    let (max, differs) = collective::compare_fields(coll, &[&values[..], &ones[..]].concat())?;
    // A flag, own failure or fault on some ranks differs from the others'
    // zero: only the first four fields name a disagreement.
    let differs: Vec<usize> = differs.into_iter().filter(|&f| f < 4).collect();
    // compare_fields' maximum is exact when one rank failed (the others send 0).
    let one = |code: u64, shift: u32| if code == 0 { (0, None) } else { (1, Some(((code >> shift) - 1, code & ((1 << shift) - 1)))) };
    Ok(Verdict { differs, flagged: max[6], own: one(max[4], 40), fault: one(max[5], 32) })
}
