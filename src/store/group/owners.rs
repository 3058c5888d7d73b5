//! The owners exchange: a bucket's final codes in bytes that do not grow
//! with the rank count (the lanes of an all-reduce must hold every rank's
//! sum, so they widen with it).
//!
//! Every rank packs its own codes in lanes for one member (the narrowest),
//! each tensor's words starting at a whole lane group, and the bucket's
//! words are cut into `world` equal runs. Then:
//!
//! 1. `all_to_all`: rank `r` receives run `r` of every rank's codes;
//! 2. rank `r`, the run's owner, sums them exactly in integers and writes
//!    the mean as the codes of `D = min(world, RESOLUTION)` members (lanes
//!    for `D` members' sums): `D / world` times the sum, exact when `D` is
//!    the world, else rounded to one of its two nearest integers at random,
//!    up with probability its fraction (unbiased, never outside the sums
//!    `D` members may send). The noise is keyed by the tensor's push count,
//!    key and code index, not by the owner, so the result does not depend
//!    on how the runs fall;
//! 3. `all_gather`: every rank receives every run, and every rank's check
//!    tail, summed here as an all-reduce would have summed it; every rank
//!    decodes the same sums of `D` members, divided by `D`, so replicas
//!    stay identical, and up to `RESOLUTION` ranks the result is the lanes'
//!    bits.
//!
//! A rank hands the transport its codes once, a `1/world` share of them
//! again in lanes for `D` members, and a check tail: bounded at any world
//! size. The owner keeps no state: a checkpoint is the lanes' one, whatever
//! the world. Owns: the layout of the runs, the owner's sum and rounding.
//! Knows nothing of torch, nor of a scheme's algebra beyond the form of its
//! codes' lanes.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::quant::compression::Compression;
use crate::quant::engine::{Engine, Lanes};
use crate::quant::{collective, lanes, noise, scheme};


/// How a group's compressed buckets reach every rank (`State(exchange=)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exchange {
    /// One all-reduce of lanes wide enough for every rank's sum: exact, the
    /// device store's bits; its bytes grow with the rank count.
    Lanes,
    /// `all_to_all`, the owners' rounding, `all_gather`: bytes bounded.
    Owners,
    /// `Owners` where the lanes would carry at least 1.5 times one rank's
    /// bits a value and the world has 4 ranks or more (`choose`), else
    /// `Lanes`: below that the lanes' exact sum in one all-reduce costs less
    /// than a second collective and the owners' rounding.
    Auto,
    /// Each rank ends with its own rows of every tensor only (FSDP2's
    /// reduce-scatter, `scatter.rs`): `all_to_all` of the codes, summed
    /// exactly by the rows' owner. Not for a hook, whose ranks need every row.
    Scatter,
}

impl Exchange {
    pub fn parse(name: &str) -> Result<Exchange> {
        match name {
            "lanes" => Ok(Exchange::Lanes),
            "owners" => Ok(Exchange::Owners),
            "auto" => Ok(Exchange::Auto),
            "scatter" => Ok(Exchange::Scatter),
            other => Err(Error::InvalidParam { key: "exchange".into(), problem: format!("{other:?}: must be 'lanes', 'owners' or 'auto' ('scatter': FSDP2's reduce-scatter)") }),
        }
    }

    /// Whether buckets of `c` over `world` ranks take the owners exchange;
    /// asking for it with a scheme whose final part is float32 (PowerSGD,
    /// `none`) is an error naming why.
    pub fn choose(self, c: &Compression, world: usize) -> Result<bool> {
        let codes = scheme::final_codes(c, 1);
        match (self, codes) {
            (Exchange::Lanes | Exchange::Scatter, _) => Ok(false),
            (Exchange::Owners, Some(_)) => Ok(true),
            (Exchange::Owners, None) => Err(Error::InvalidParam {
                key: "exchange".into(),
                problem: format!("'owners' sums integer codes; {} sends float32, whose all-reduce does not grow with the ranks: use 'lanes' or 'auto'", c.name()),
            }),
            (Exchange::Auto, None) => Ok(false),
            (Exchange::Auto, Some(_)) => Ok(world >= 4 && lane_bits(c, world) >= 1.5 * lane_bits(c, 1)),
        }
    }
}

/// Bits a value takes in the lanes of a final part for `members` members'
/// sums (whole lanes a word: 64 / floor(64 / width)).
pub fn lane_bits(c: &Compression, members: usize) -> f64 {
    let width = scheme::final_codes(c, members).and_then(|(lo, hi)| collective::sum_width(lo, hi, members)).unwrap_or(64);
    64.0 / (64 / width) as f64
}

/// Up to this many ranks the owners send their exact sums; beyond, sums
/// scaled to this many members' (the mean to an eighth of a code step).
pub const RESOLUTION: usize = 8;

/// The form of a scheme's codes in lanes: what a member sends, summed per
/// component (`components`), and a sum of `D` members' components as the
/// scheme's lanes for `D` members.
#[derive(Clone, Copy, Debug)]
pub(super) enum Form {
    /// Lanes hold `code - lo` (QSGD, 1-bit), at most `top`.
    Linear { top: u32 },
    /// 2-bit: lanes hold `pos + b neg` with `b` one above the members (for
    /// one member: 0 zero, 1 +pos, 2 neg); the +pos and neg counts are its
    /// two components, rounded each on its own (unequal thresholds keep
    /// their own weights).
    TwoBit,
}

impl Form {
    pub(super) fn of(c: &Compression) -> Option<Form> {
        match c {
            Compression::TwoBit(_) => Some(Form::TwoBit),
            _ => scheme::final_codes(c, 1).map(|(lo, hi)| Form::Linear { top: (hi - lo) as u32 }),
        }
    }

    fn components(self) -> usize {
        match self {
            Form::Linear { .. } => 1,
            Form::TwoBit => 2,
        }
    }

    /// Component `j` of one member's lane; a lane no member sends (a faulty
    /// peer's) counts as the nearest one that a member does, so every rank
    /// still decodes the same codes.
    fn component(self, lane: u64, j: usize) -> u32 {
        match self {
            Form::Linear { top } => lane.min(top as u64) as u32,
            Form::TwoBit => (lane == 1 + j as u64) as u32,
        }
    }

    /// One member's lane as its components in one `u32`, 16 bits each, so
    /// that adding them sums each apart (a sum of up to 65,535 members, a
    /// bound `Group::new` keeps far inside).
    pub(super) fn counts(self, lane: u64) -> u32 {
        match self {
            Form::Linear { .. } => self.component(lane, 0),
            Form::TwoBit => self.component(lane, 0) | self.component(lane, 1) << 16,
        }
    }

    /// The lane of members whose `counts` add up to `t`.
    pub(super) fn lane_of_counts(self, t: u32, members: usize) -> u64 {
        match self {
            Form::Linear { .. } => t as u64,
            Form::TwoBit => self.lane([(t & 0xffff) as u64, (t >> 16) as u64], members),
        }
    }

    /// The lane of `D` members whose components sum to `sums`.
    fn lane(self, sums: [u64; 2], members: usize) -> u64 {
        match self {
            Form::Linear { .. } => sums[0],
            Form::TwoBit => sums[0] + (members as u64 + 1) * sums[1],
        }
    }
}

/// One tensor's final codes in a rank's words: `words` (lanes for one
/// member, `width` bits), `n` codes, and what keys its rounding noise.
#[derive(Clone, Debug)]
pub struct Span {
    pub words: Range<usize>,
    pub n: usize,
    pub width: u32,
    pub step: u64,
    pub key_hash: u64,
}

/// What came back: every tensor's codes as sums of `members` members (its
/// `words` in `words`, lanes of `width` bits holding `code sum - lo *
/// members`, codes up to `hi`), then the ranks' check tails summed.
pub struct Owned {
    pub words: Vec<u64>,
    pub spans: Vec<(Range<usize>, u32, i32)>,
    pub members: usize,
}

/// A tensor's codes in one run: the span, its codes `first..first +
/// count`, and the run's words that hold them.
struct Piece {
    span: usize,
    first: usize,
    count: usize,
    in_run: Range<usize>,
}

/// Where each span's words start in the runs (whole lane groups), the
/// words of one run, and each run's pieces.
struct Layout {
    starts: Vec<usize>,
    run: usize,
    pieces: Vec<Vec<Piece>>,
}

fn layout(spans: &[Span], world: usize) -> Layout {
    let mut starts = Vec::with_capacity(spans.len());
    let mut at = 0;
    for s in spans {
        starts.push(at);
        at += s.words.len().next_multiple_of(lanes::GROUP);
    }
    let run = at.div_ceil(world).next_multiple_of(lanes::GROUP);
    let pieces = (0..world)
        .map(|r| {
            let (first_word, end_word) = (r * run, (r + 1) * run);
            spans
                .iter()
                .zip(&starts)
                .enumerate()
                .filter_map(|(t, (s, &start))| {
                    let (a, b) = (start.max(first_word), (start + s.words.len()).min(end_word));
                    // `a - start` is a whole number of groups, so words a..b hold
                    // their codes as a packing of those codes alone would.
                    let per = (64 / s.width) as usize;
                    let first = (a - start) * per;
                    (a < b).then(|| Piece { span: t, first, count: ((b - start) * per).min(s.n) - first, in_run: a - first_word..b - first_word })
                })
                .collect()
        })
        .collect();
    Layout { starts, run, pieces }
}

/// The words that `n` codes' sums take in the owners' lanes over `world`
/// ranks (the sums of `min(world, RESOLUTION)` members).
pub fn sums_words(c: &Compression, n: usize, world: usize) -> usize {
    let members = world.min(RESOLUTION);
    let width = scheme::final_codes(c, members).and_then(|(lo, hi)| collective::sum_width(lo, hi, members)).unwrap_or(64);
    lanes::words_for(n, width)
}

/// The noise stream of a tensor's rounding: the same on every rank.
const ROUNDING: u64 = 0x6f77_6e65_7273; // "owners"

/// Runs the exchange for the codes `words` (laid out as `spans` say) and
/// this rank's check `tail`, of compression `c`.
pub fn exchange(coll: &mut Lanes<&mut dyn Engine>, c: &Compression, spans: &[Span], words: &[u64], tail: &[u64], rank: usize) -> Result<Owned> {
    let world = coll.workers;
    let form = Form::of(c).ok_or_else(|| Error::Internal(format!("the owners exchange of {}, which sends float32", c.name())))?;
    if let Some(s) = spans.iter().find(|s| s.words.end > words.len() || s.words.len() != lanes::words_for(s.n, s.width)) {
        return Err(Error::Internal(format!("a span {s:?} of {} words", words.len())));
    }
    let members = world.min(RESOLUTION);
    let (lo, hi) = scheme::final_codes(c, members).ok_or_else(|| Error::Internal("no codes".into()))?;
    let wide = collective::sum_width(lo, hi, members).ok_or_else(|| Error::Internal(format!("{members} members' sums of {lo}..={hi}")))?;
    let Layout { starts, run, pieces } = layout(spans, world);
    let mut send = vec![0u64; world * run];
    for (s, &at) in spans.iter().zip(&starts) {
        send[at..at + s.words.len()].copy_from_slice(&words[s.words.clone()]);
    }
    let mut recv = vec![0u64; world * run];
    coll.all_to_all(&send, &mut recv)?;
    drop(send);
    // Each run's sums, every piece packed on its own; runs padded alike.
    let sizes: Vec<usize> = pieces.iter().map(|p| p.iter().map(|p| lanes::words_for(p.count, wide)).sum()).collect();
    let chunk = sizes.iter().copied().max().unwrap_or(0) + tail.len();
    let mut mine = vec![0u64; chunk];
    own(form, spans, &pieces[rank], &recv, run, world, members, wide, &mut mine);
    mine[chunk - tail.len()..].copy_from_slice(tail);
    drop(recv);
    let mut gathered = vec![0u64; world * chunk];
    coll.all_gather(&mine, &mut gathered)?;
    // Every tensor's sums, from the runs' pieces.
    let mut sums: Vec<Vec<u64>> = spans.iter().map(|s| vec![0u64; s.n]).collect();
    for (r, run_pieces) in pieces.iter().enumerate() {
        let mut at = r * chunk;
        for p in run_pieces {
            let len = lanes::words_for(p.count, wide);
            lanes::unpack_into(&gathered[at..at + len], wide, &mut sums[p.span][p.first..p.first + p.count], |v| v)?;
            at += len;
        }
    }
    let mut out = Owned { words: Vec::new(), spans: Vec::with_capacity(spans.len()), members };
    for s in &sums {
        let at = out.words.len();
        out.words.resize(at + lanes::words_for(s.len(), wide), 0);
        lanes::pack_slice_into_words(s, wide, |v| v, &mut out.words[at..]);
        out.spans.push((at..out.words.len(), wide, hi));
    }
    out.words.extend(sum_tails(&gathered, chunk, tail.len()));
    Ok(out)
}

/// The ranks' check tails summed as an all-reduce sums them: each chunk
/// of `chunk` words in `all` (one a rank) ends with a tail of `len`.
pub(super) fn sum_tails(all: &[u64], chunk: usize, len: usize) -> Vec<u64> {
    let mut sum = vec![0u64; len];
    for theirs in all.chunks_exact(chunk) {
        sum.iter_mut().zip(&theirs[chunk - len..]).for_each(|(o, &t)| *o = o.wrapping_add(t));
    }
    sum
}

/// The owner's work on its run's `pieces` (`recv`: every rank's run, one
/// after another): each piece's sums over the ranks, as `members` members'
/// (`D / world` times the sum, rounded at random where not whole), packed
/// in lanes of `wide` bits one piece after another into `out`.
#[allow(clippy::too_many_arguments)]
fn own(form: Form, spans: &[Span], pieces: &[Piece], recv: &[u64], run: usize, world: usize, members: usize, wide: u32, out: &mut [u64]) {
    let (w, d) = (world as u64, members as u64);
    let mut at = 0;
    let mut one = Vec::new();
    for p in pieces {
        let s = &spans[p.span];
        let mut total = vec![[0u32; 2]; p.count];
        one.resize(p.count, 0u64);
        for j in 0..world {
            // The piece lies at the same place in every rank's run, in whole
            // words for its codes (`layout`): unpacking cannot fail.
            let theirs = &recv[j * run + p.in_run.start..j * run + p.in_run.end];
            let _ = lanes::unpack_into(theirs, s.width, &mut one, |v| v);
            for (t, &lane) in total.iter_mut().zip(&one) {
                for (c, sum) in t.iter_mut().enumerate().take(form.components()) {
                    *sum += form.component(lane, c);
                }
            }
        }
        let seed = noise::stream_seed(ROUNDING, s.step, s.key_hash, u64::MAX - 1);
        let scaled: Vec<u64> = total
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let mut sums = [0u64; 2];
                for (c, sum) in sums.iter_mut().enumerate().take(form.components()) {
                    let i = (form.components() * (p.first + i) + c) as u64;
                    let (q, r) = ((t[c] as u64 * d) / w, (t[c] as u64 * d) % w);
                    // a uniform draw in 0..world (bias below world / 2^32)
                    let x = (noise::bits(noise::Keys::new(seed, i >> 32), i as u32) as u64 * w) >> 32;
                    *sum = q + (x < r) as u64;
                }
                form.lane(sums, members)
            })
            .collect();
        let len = lanes::words_for(p.count, wide);
        lanes::pack_slice_into_words(&scaled, wide, |v| v, &mut out[at..at + len]);
        at += len;
    }
}
