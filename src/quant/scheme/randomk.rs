//! Random-K's selection: which `k` of a key's `n` coordinates a push
//! sends, drawn from (seed, step, key) alone so that every worker and
//! server picks the same ones without sending them (stratified Floyd
//! sampling over `noise`'s counter-based stream, cached for the last few
//! keys), and the gather and scatter between a key and its selection.
//! Must not touch: the schemes' algebra (`mod.rs`) or the wire (`wire`).

use std::ops::Range;
use std::sync::{Arc, Mutex};

use rayon::prelude::*;

use crate::hash;
use crate::quant::compression::Qsgd;
use crate::quant::noise;

/// The `k` coordinates of a random-K push: sorted, distinct, chosen from
/// (seed, step, key) alone, so every worker and server picks the same ones
/// without sending them. `None` when every coordinate is sent. The last few
/// selections are kept (`SelectionCache`): a push's decode, and the other
/// keys' pushes of a step, find theirs drawn already.
pub fn selection(q: &Qsgd, n: usize, step: u64, key_hash: u64) -> Option<Arc<Vec<usize>>> {
    let k = q.selected(n);
    if k >= n {
        return None;
    }
    let id = (q.seed, step, key_hash, n, k);
    static CACHE: Mutex<SelectionCache> = Mutex::new(SelectionCache(Vec::new()));
    let lock = || CACHE.lock().unwrap_or_else(|p| p.into_inner());
    let mut idx = {
        let mut cache = lock();
        if let Some(hit) = cache.get(id) {
            return Some(hit);
        }
        cache.recycle()
    };
    draw_selection(noise::stream_seed(q.seed, step, key_hash, u64::MAX), n, k, &mut idx);
    let idx = Arc::new(idx);
    lock().put(id, idx.clone());
    Some(idx)
}

/// The most recent selections, by (seed, step, key, n, k): a pure function
/// of those, so a hit is exactly what drawing again would give. An evicted
/// selection nobody holds any more lends its memory to the next draw:
/// fresh pages cost more than drawing (page faults, measured).
struct SelectionCache(Vec<(SelectionId, Arc<Vec<usize>>)>);

/// What a selection is a function of: (seed, step, key, n, k).
type SelectionId = (u64, u64, u64, usize, usize);

impl SelectionCache {
    /// Entries kept: a few keys' selections (each k words).
    const KEEP: usize = 4;

    fn get(&self, id: SelectionId) -> Option<Arc<Vec<usize>>> {
        self.0.iter().find(|(i, _)| *i == id).map(|(_, v)| v.clone())
    }

    /// Makes room for one more entry; the evicted one's vector when it is no
    /// longer shared, else a new one.
    fn recycle(&mut self) -> Vec<usize> {
        if self.0.len() < Self::KEEP {
            return Vec::new();
        }
        let (_, oldest) = self.0.remove(0);
        Arc::try_unwrap(oldest).unwrap_or_default()
    }

    fn put(&mut self, id: SelectionId, v: Arc<Vec<usize>>) {
        if self.get(id).is_none() {
            if self.0.len() >= Self::KEEP {
                self.0.remove(0);
            }
            self.0.push((id, v));
        }
    }
}

/// Coordinates per stratum of a random-K selection: a stratum's bitset
/// (8 KiB) stays in L1 while its draws mark it.
pub(super) const STRATUM: usize = 1 << 16;

/// `k <= n` distinct indices from the noise stream `seed`, stratified: the
/// key's coordinates fall in strata of `STRATUM` (the last one shorter),
/// each stratum gets its share of `k` (`strata_counts`), and picks that many
/// of its own coordinates by Floyd's sampling: with the stratum's first
/// draw at stream position `first` (the counts before it), draw `d` (for
/// `j = m - c + d`, `c` of its `m` coordinates) picks `t = floor(u (j + 1))`,
/// or `j` when `t` was picked already. Every coordinate is picked with
/// chance `k / n`; within a stratum every set of `c` is equally likely.
/// Strata are drawn in parallel, each marking a bitset in L1 and reading it
/// out to its own place in `idx` (ascending).
pub(super) fn draw_selection(seed: u64, n: usize, k: usize, idx: &mut Vec<usize>) {
    draw_selection_on(crate::isa::Isa::detect(), seed, n, k, idx)
}

/// `draw_selection` on the kernels of `isa` (the tests run every one).
pub(super) fn draw_selection_on(isa: crate::isa::Isa, seed: u64, n: usize, k: usize, idx: &mut Vec<usize>) {
    assert!(k <= n, "draw_selection: k = {k} of n = {n}");
    let counts = strata_counts(seed, n, k);
    idx.resize(k, 0); // every slot is written below; a recycled vector of k is not touched
    let mut strata = Vec::with_capacity(counts.len());
    let (mut rest, mut first) = (&mut idx[..], 0);
    for (s, &c) in counts.iter().enumerate() {
        let (out, tail) = std::mem::take(&mut rest).split_at_mut(c);
        strata.push((s * STRATUM, first, out));
        (rest, first) = (tail, first + c);
    }
    strata.into_par_iter().for_each(|(base, first, out)| draw_stratum(isa, seed, base, STRATUM.min(n - base), first, out));
}

/// Floyd's sampling of `out.len()` of coordinates `base..base + m` (`m` at
/// most `STRATUM`, at least `out.len()`), with draws from stream position
/// `first` on, ascending into `out`.
fn draw_stratum(isa: crate::isa::Isa, seed: u64, base: usize, m: usize, first: usize, out: &mut [usize]) {
    const DRAWS: usize = 2048;
    let c = out.len();
    if c == 0 {
        return;
    }
    let mut chosen = [0u64; STRATUM / 64];
    let words = &mut chosen[..m.div_ceil(64)];
    let mut t = [0u32; DRAWS];
    let mut done = 0;
    while done < c {
        let (len, j0) = (DRAWS.min(c - done), m - c + done);
        // j0 + len <= m <= STRATUM: the integer draws are the definition's
        noise::below(isa, seed, first + done, j0, &mut t[..len]);
        for (d, &t) in t[..len].iter().enumerate() {
            let (w, b) = (t as usize / 64, 1u64 << (t % 64));
            if words[w] & b == 0 {
                words[w] |= b;
            } else {
                let j = j0 + d; // never picked before: j exceeds every earlier draw's range
                words[j / 64] |= 1u64 << (j % 64);
            }
        }
        done += len;
    }
    assert_eq!(count_ones(isa, words), c, "Floyd's draws mark c distinct coordinates");
    positions(isa, words, base, out);
}

/// How many of `k <= n` coordinates each stratum gets: its share
/// `k m / n` (`m` its coordinates) rounded down, plus one for each point of
/// a systematic draw in its stretch: the shares' remainders `k m mod n` are
/// laid end to end, and the points are `u + i n` for one offset `u`
/// uniform in `0..n` (from `seed`; the points then number exactly the
/// remainders' sum over `n`). A stratum's extra one comes with chance
/// `(k m mod n) / n`, so its expected count is exactly its share: every
/// coordinate's chance is `k / n` (up to the 2^-64 grid of `u`). Integers
/// only: the same counts on every machine.
pub(super) fn strata_counts(seed: u64, n: usize, k: usize) -> Vec<usize> {
    let (n128, k128) = (n as u128, k as u128);
    let u = (hash::finalize(seed ^ STRATA_SALT) as u128 * n128) >> 64;
    // points below x: u + i n < x for i >= 0
    let points_below = |x: u128| if x <= u { 0 } else { (x - u).div_ceil(n128) };
    let mut laid = 0u128;
    (0..n.div_ceil(STRATUM))
        .map(|s| {
            let m = STRATUM.min(n - s * STRATUM) as u128;
            let share = k128 * m;
            let extra = points_below(laid + share % n128) - points_below(laid);
            laid += share % n128;
            (share / n128 + extra) as usize
        })
        .collect()
}

/// Mixed into a selection's seed for its strata's offset (any constant
/// apart from the noise stream's own use of the seed).
pub(super) const STRATA_SALT: u64 = 0x5354_5241_5441_0001;

#[inline(always)]
fn count_ones_body(words: &[u64]) -> usize {
    words.iter().map(|w| w.count_ones() as usize).sum()
}

crate::isa::multiversion! {
    /// The set bits of `words` (one instruction a word where the ISA has POPCNT).
    pub(super) fn count_ones[][](words: &[u64]) -> usize = count_ones_body;
}

#[inline(always)]
fn positions_body(words: &[u64], base: usize, out: &mut [usize]) {
    // Eight positions a word, without branching on its bits (a selection's
    // words hold a few each: a branch per bit is mostly mispredicted), then
    // any more one at a time. `at` advances by the true count, so the extra
    // writes land where later positions go; the last words, where they could
    // pass the end, go one bit at a time.
    let (mut at, mut w) = (0, 0);
    while w < words.len() && at + 8 <= out.len() {
        let (mut b, base) = (words[w], base + 64 * w);
        let count = b.count_ones() as usize;
        for slot in &mut out[at..at + 8] {
            *slot = base + b.trailing_zeros() as usize; // 64 past the last bit: overwritten or past count
            b &= b.wrapping_sub(1);
        }
        bit_by_bit(b, base, out, at + 8);
        (at, w) = (at + count, w + 1);
    }
    for (w, &bits) in words.iter().enumerate().skip(w) {
        at = bit_by_bit(bits, base + 64 * w, out, at);
    }
}

/// `base +` the position of each set bit of `b`, ascending, into `out` from
/// slot `at`; the slot after the last.
#[inline(always)]
fn bit_by_bit(mut b: u64, base: usize, out: &mut [usize], mut at: usize) -> usize {
    while b != 0 {
        out[at] = base + b.trailing_zeros() as usize;
        at += 1;
        b &= b - 1;
    }
    at
}

crate::isa::multiversion! {
    /// `base +` the position of every set bit of `words`, ascending, into
    /// `out` (exactly as long as their count).
    pub(super) fn positions[][](words: &[u64], base: usize, out: &mut [usize]) -> () = positions_body;
}

/// Selected coordinates per parallel piece of a gather or scatter.
pub(super) const SPREAD_PIECE: usize = 1 << 14;

/// `g` at the coordinates `idx` into `out` (resized: a recycled buffer of
/// the same length is only overwritten), pieces in parallel.
pub(super) fn gather(g: &[f32], idx: &[usize], out: &mut Vec<f32>) {
    out.resize(idx.len(), 0.0);
    out.par_chunks_mut(SPREAD_PIECE).zip(idx.par_chunks(SPREAD_PIECE)).for_each(|(o, ix)| o.iter_mut().zip(ix).for_each(|(o, &i)| *o = g[i]));
}

/// `out` all zero but `out[idx[j] - base] = vals[j]`, for a selection's
/// coordinates in `base..base + out.len()` (`idx` ascending): each piece of
/// `idx` zeroes and fills the stretch of `out` up to the next piece's first
/// coordinate, in parallel.
pub(super) fn scatter(idx: &[usize], base: usize, vals: &[f32], out: &mut [f32]) {
    debug_assert!(idx.windows(2).all(|w| w[0] < w[1]) && idx.first().is_none_or(|&i| i >= base) && idx.last().is_none_or(|&i| i < base + out.len()));
    let n = out.len();
    let mut stretches = Vec::with_capacity(idx.len().div_ceil(SPREAD_PIECE));
    let (mut rest, mut at) = (out, 0);
    for (c, (ix, v)) in idx.chunks(SPREAD_PIECE).zip(vals.chunks(SPREAD_PIECE)).enumerate() {
        let end = idx.get((c + 1) * SPREAD_PIECE).map_or(n, |&i| i - base);
        let (stretch, tail) = std::mem::take(&mut rest).split_at_mut(end - at);
        stretches.push((stretch, base + at, ix, v));
        (rest, at) = (tail, end);
    }
    rest.fill(0.0); // no selection at all: every coordinate
    stretches.into_par_iter().for_each(|(o, first, ix, v)| {
        o.fill(0.0);
        ix.iter().zip(v).for_each(|(&i, &v)| o[i - first] = v);
    });
}

/// The piece of a selection that falls in `range` of the key's coordinates.
pub(super) fn selected_in(idx: &[usize], range: Range<usize>) -> Range<usize> {
    idx.partition_point(|&i| i < range.start)..idx.partition_point(|&i| i < range.end)
}
