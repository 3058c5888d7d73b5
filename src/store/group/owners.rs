//! The owners exchange: a bucket's final codes in bytes that do not grow
//! with the rank count (the lanes of an all-reduce must hold every rank's
//! sum, so they widen with it).
//!
//! Every rank packs its own codes in lanes for one member (the narrowest),
//! each tensor's words starting at a whole lane group, and the bucket's
//! words are cut into `world` equal runs. Then:
//!
//! 1. `all_to_all`: rank `r` receives run `r` of every rank's codes;
//! 2. rank `r`, the run's owner, sums them exactly in integers and rounds
//!    the mean code to one of its two nearest codes at random, up with
//!    probability the mean's fraction: unbiased, and never outside the
//!    codes a member may send. The noise is keyed by the tensor's push
//!    count, key and code index, not by the owner, so the result does not
//!    depend on how the runs fall;
//! 3. `all_gather`: every rank receives every run, and every rank's check
//!    tail, summed here as an all-reduce would have summed it; every rank
//!    decodes the same codes as one member's, so replicas stay identical.
//!
//! A rank hands the transport its codes once, a `1/world` share of them
//! again and a check tail, at any world size. The owner keeps no state: a
//! checkpoint is the flat exchange's, whatever the world. Owns: the
//! layout of the runs, the owner's sum and rounding. Knows nothing of
//! torch, nor of a scheme's algebra beyond the order of its codes.

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
}

impl Exchange {
    pub fn parse(name: &str) -> Result<Exchange> {
        match name {
            "lanes" => Ok(Exchange::Lanes),
            "owners" => Ok(Exchange::Owners),
            "auto" => Ok(Exchange::Auto),
            other => Err(Error::InvalidParam { key: "exchange".into(), problem: format!("{other:?}: must be 'lanes', 'owners' or 'auto'") }),
        }
    }

    /// Whether buckets of `c` over `world` ranks take the owners exchange;
    /// asking for it with a scheme whose final part is float32 (PowerSGD,
    /// `none`) is an error naming why.
    pub fn choose(self, c: &Compression, world: usize) -> Result<bool> {
        let codes = scheme::final_codes(c, 1);
        match (self, codes) {
            (Exchange::Lanes, _) => Ok(false),
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

/// The order of one member's codes in its lanes: lane value to rank `k`
/// among the codes by value (`0..=top`), and back.
#[derive(Clone, Copy, Debug)]
pub enum Order {
    /// Lanes hold `code - lo`, in order already (QSGD, 1-bit).
    Linear { top: u32 },
    /// 2-bit's lanes for one member: 0 zero, 1 +pos, 2 neg.
    TwoBit,
}

const TWO_BIT_RANK: [u32; 3] = [1, 2, 0];
const TWO_BIT_LANE: [u64; 3] = [2, 0, 1];

impl Order {
    pub fn of(c: &Compression) -> Option<Order> {
        match c {
            Compression::TwoBit(_) => Some(Order::TwoBit),
            _ => scheme::final_codes(c, 1).map(|(lo, hi)| Order::Linear { top: (hi - lo) as u32 }),
        }
    }

    fn top(self) -> u32 {
        match self {
            Order::Linear { top } => top,
            Order::TwoBit => 2,
        }
    }

    /// A lane's rank; a lane no member sends (a faulty peer's) counts as
    /// the top code, so every rank still decodes the same codes.
    fn rank(self, lane: u64) -> u32 {
        match self {
            Order::Linear { top } => lane.min(top as u64) as u32,
            Order::TwoBit => TWO_BIT_RANK.get(lane as usize).copied().unwrap_or(0),
        }
    }

    fn lane(self, rank: u32) -> u64 {
        match self {
            Order::Linear { .. } => rank as u64,
            Order::TwoBit => TWO_BIT_LANE[rank as usize],
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

/// Where each span's words start in the runs (whole lane groups), and the
/// words of one run.
struct Layout {
    starts: Vec<usize>,
    run: usize,
}

fn layout(spans: &[Span], world: usize) -> Layout {
    let mut starts = Vec::with_capacity(spans.len());
    let mut at = 0;
    for s in spans {
        starts.push(at);
        at += s.words.len().next_multiple_of(lanes::GROUP);
    }
    Layout { starts, run: at.div_ceil(world).next_multiple_of(lanes::GROUP) }
}

/// The noise stream of a tensor's rounding: the same on every rank.
const ROUNDING: u64 = 0x6f77_6e65_7273; // "owners"

/// Runs the exchange for the codes `words` (laid out as `spans` say) and
/// this rank's check `tail`: returns every rank's codes as the owners
/// rounded them, in `words`' layout, followed by the tails' wrapping sum.
pub fn exchange(coll: &mut Lanes<&mut dyn Engine>, order: Order, spans: &[Span], words: &[u64], tail: &[u64], rank: usize) -> Result<Vec<u64>> {
    let world = coll.workers;
    if let Some(s) = spans.iter().find(|s| s.words.end > words.len() || s.words.len() != lanes::words_for(s.n, s.width)) {
        return Err(Error::Internal(format!("a span {s:?} of {} words", words.len())));
    }
    let Layout { starts, run } = layout(spans, world);
    let mut send = vec![0u64; world * run];
    for (s, &at) in spans.iter().zip(&starts) {
        send[at..at + s.words.len()].copy_from_slice(&words[s.words.clone()]);
    }
    let mut recv = vec![0u64; world * run];
    coll.all_to_all(&send, &mut recv)?;
    let mut mine = vec![0u64; run + tail.len()];
    own(order, spans, &starts, run, &recv, rank, world, &mut mine[..run])?;
    mine[run..].copy_from_slice(tail);
    let mut gathered = send; // the same length plus the tails
    gathered.resize(world * (run + tail.len()), 0);
    coll.all_gather(&mine, &mut gathered)?;
    let chunk = run + tail.len();
    let global = |i: usize| gathered[(i / run) * chunk + i % run];
    let mut out = vec![0u64; words.len() + tail.len()];
    for (s, &at) in spans.iter().zip(&starts) {
        out[s.words.clone()].iter_mut().enumerate().for_each(|(i, w)| *w = global(at + i));
    }
    for j in 0..world {
        let theirs = &gathered[j * chunk + run..(j + 1) * chunk];
        out[words.len()..].iter_mut().zip(theirs).for_each(|(o, &t)| *o = o.wrapping_add(t));
    }
    Ok(out)
}

/// The owner's work on run `rank` (`recv`: every rank's run, one after
/// another): each code the rounded mean of the ranks' codes, into `out`.
#[allow(clippy::too_many_arguments)]
fn own(order: Order, spans: &[Span], starts: &[usize], run: usize, recv: &[u64], rank: usize, world: usize, out: &mut [u64]) -> Result<()> {
    let (first_word, end_word) = (rank * run, (rank + 1) * run);
    let (mut sum, mut one) = (Vec::new(), Vec::new());
    for (s, &start) in spans.iter().zip(starts) {
        let (a, b) = (start.max(first_word), (start + s.words.len()).min(end_word));
        if a >= b {
            continue;
        }
        // `a - start` is a whole number of groups, so these words hold codes
        // `first..last` as a packing of those codes alone would.
        let per = (64 / s.width) as usize;
        let first = (a - start) * per;
        let count = ((b - start) * per).min(s.n) - first;
        sum.clear();
        sum.resize(count, 0u32);
        one.resize(count, 0u32);
        for j in 0..world {
            let at = j * run + (a - first_word);
            lanes::unpack_into(&recv[at..at + (b - a)], s.width, &mut one, |v| order.rank(v))?;
            sum.iter_mut().zip(&one).for_each(|(t, &k)| *t += k);
        }
        let seed = noise::stream_seed(ROUNDING, s.step, s.key_hash, u64::MAX - 1);
        let w = world as u64;
        let rounded: Vec<u64> = sum
            .iter()
            .enumerate()
            .map(|(i, &total)| {
                let i = (first + i) as u64;
                // a uniform draw in 0..world (bias below world / 2^32)
                let x = (noise::bits(noise::Keys::new(seed, i >> 32), i as u32) as u64 * w) >> 32;
                let (q, r) = (total as u64 / w, total as u64 % w);
                order.lane((q + (x < r) as u64).min(order.top() as u64) as u32)
            })
            .collect();
        lanes::pack_slice_into_words(&rounded, s.width, |v| v, &mut out[a - first_word..b - first_word]);
    }
    Ok(())
}
