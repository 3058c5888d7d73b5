//! The reduce-scatter (FSDP2's): every rank ends with its own rows of each
//! tensor, summed exactly over the ranks, and hands the transport each of
//! its codes about once, whatever the world.
//!
//! A tensor's rows are dealt as FSDP2 deals them (`rows`: dim 0 in blocks
//! of `ceil(rows / world)`), and its codes follow (`scheme::pieces`: a
//! random-K selection's codes go to the rank owning their coordinates).
//! Every rank packs its codes in lanes for one member, as the owners
//! exchange does, and then:
//!
//! 1. `all_to_all`: rank `r` receives, from every rank, the words holding
//!    its piece of every tensor's codes (cut at whole lane groups, so a
//!    piece is a copy of words and a group straddling two pieces goes to
//!    both), and every rank's check tail;
//! 2. rank `r` sums its pieces exactly (each member's components, as
//!    `owners::Form` reads them) into lanes for `world` members, the lanes
//!    an all-reduce would have summed, and the tails as it would have.
//!
//! The caller decodes only its piece (`scheme::decode_slice`), so each
//! rank's rows are bit for bit the rows of the lanes' result. Owns: the
//! rows' rule, the cut and the sum. Knows nothing of torch.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::quant::compression::Compression;
use crate::quant::engine::{Engine, Lanes};
use crate::quant::{collective, lanes, scheme};

use super::owners::{sum_tails, Form};

/// Rank `rank`'s elements of a tensor of `shape` over `world` ranks: its
/// block of `ceil(shape[0] / world)` rows (FSDP2's `Shard(0)`; empty past
/// the last row; a 0-d tensor is rank 0's).
pub fn rows(shape: &[usize], world: usize, rank: usize) -> Range<usize> {
    let Some((&first, rest)) = shape.split_first() else {
        return if rank == 0 { 0..1 } else { 0..0 };
    };
    let per_row: usize = rest.iter().product();
    let block = first.div_ceil(world.max(1));
    let (a, b) = ((rank * block).min(first), ((rank + 1) * block).min(first));
    a * per_row..b * per_row
}

/// One tensor's final codes in a rank's words: `words` (lanes for one
/// member, `width` bits), `n` codes, and each rank's codes (`pieces`, one
/// range a rank, in rank order).
#[derive(Clone, Debug)]
pub struct Span {
    pub words: Range<usize>,
    pub n: usize,
    pub width: u32,
    pub pieces: Vec<Range<usize>>,
}

/// What this rank received: each tensor's piece summed over the ranks
/// (lanes for `world` members of `width` bits, one span after another in
/// `words`), then the ranks' check tails summed.
pub struct Scattered {
    pub words: Vec<u64>,
    pub spans: Vec<(Range<usize>, u32, i32)>,
}

/// The words of a span's codes `piece` cut at whole lane groups: the
/// codes those words hold (`codes`, from the piece's start when it is
/// empty) and where the words lie in the span.
fn cut(span: &Span, piece: &Range<usize>) -> (Range<usize>, Range<usize>) {
    if piece.is_empty() {
        return (piece.clone(), 0..0);
    }
    let per = (64 / span.width) as usize;
    let group = lanes::GROUP * per;
    let (a, b) = ((piece.start / group) * group, (piece.end.div_ceil(group) * group).min(span.n));
    // `a` is a whole number of groups into the span, and `b` a group's end
    // or the span's: words from `a / per` hold codes a..b as a packing of
    // those codes alone would.
    (a..b, a / per..a / per + lanes::words_for(b - a, span.width))
}

/// Runs the reduce-scatter of the codes `words` (laid out as `spans` say)
/// and this rank's check `tail`, of compression `c`.
pub fn exchange(coll: &mut Lanes<&mut dyn Engine>, c: &Compression, spans: &[Span], words: &[u64], tail: &[u64], rank: usize) -> Result<Scattered> {
    let world = coll.workers;
    let form = Form::of(c).ok_or_else(|| Error::Internal(format!("the reduce-scatter of {}'s codes, which are float32", c.name())))?;
    if let Some(s) = spans.iter().find(|s| s.words.end > words.len() || s.words.len() != lanes::words_for(s.n, s.width) || s.pieces.len() != world || s.pieces.iter().any(|p| p.start > p.end || p.end > s.n)) {
        return Err(Error::Internal(format!("a span {s:?} of {} words over {world} ranks", words.len())));
    }
    let (lo, hi) = scheme::final_codes(c, world).ok_or_else(|| Error::Internal("no codes".into()))?;
    let wide = collective::sum_width(lo, hi, world).ok_or_else(|| Error::Internal(format!("{world} members' sums of {lo}..={hi}")))?;
    // Every destination's words: the same sizes on every rank (the spans
    // follow the bucket's plan), padded to the largest.
    let sizes: Vec<usize> = (0..world).map(|r| spans.iter().map(|s| cut(s, &s.pieces[r]).1.len()).sum()).collect();
    let chunk = sizes.iter().copied().max().unwrap_or(0) + tail.len();
    let mut send = vec![0u64; world * chunk];
    for (r, out) in send.chunks_exact_mut(chunk).enumerate() {
        let mut at = 0;
        for s in spans {
            let (_, w) = cut(s, &s.pieces[r]);
            out[at..at + w.len()].copy_from_slice(&words[s.words.start + w.start..s.words.start + w.end]);
            at += w.len();
        }
        out[chunk - tail.len()..].copy_from_slice(tail);
    }
    let mut recv = vec![0u64; world * chunk];
    coll.all_to_all(&send, &mut recv)?;
    drop(send);
    let mut out = Scattered { words: Vec::new(), spans: Vec::with_capacity(spans.len()) };
    let mut at = 0;
    let (mut total, mut one) = (Vec::new(), Vec::new());
    for s in spans {
        let piece = &s.pieces[rank];
        let (codes, w) = cut(s, piece);
        let skip = piece.start - codes.start;
        // Each code's components over the ranks, in one u32 (`counts`).
        total.clear();
        total.resize(piece.len(), 0u32);
        one.resize(codes.len(), 0u32);
        for j in 0..world {
            let theirs = &recv[j * chunk + at..j * chunk + at + w.len()];
            lanes::unpack_into(theirs, s.width, &mut one, |v| form.counts(v))?;
            total.iter_mut().zip(&one[skip..skip + piece.len()]).for_each(|(t, &o)| *t += o);
        }
        let start = out.words.len();
        out.words.resize(start + lanes::words_for(total.len(), wide), 0);
        lanes::pack_slice_into_words(&total, wide, |t| form.lane_of_counts(t, world), &mut out.words[start..]);
        out.spans.push((start..out.words.len(), wide, hi));
        at += w.len();
    }
    out.words.extend(sum_tails(&recv, chunk, tail.len()));
    Ok(out)
}
