//! The one chunking helper: how element-wise work over large arrays is
//! split across rayon's threads. Arrays longer than `CHUNK` are cut into
//! `CHUNK`-element pieces (a multiple of 64, so pieces never split a 2-bit
//! block or a 64-bit word of bits); shorter ones run in the caller's
//! thread. Work receives each piece's first index, so anything indexed by
//! element (rounding noise, other arrays) does not depend on the split.
//! The codec's kernels split the same way (`codec::join`, which adds their
//! error and streaming rules).

use rayon::prelude::*;

/// Elements per parallel piece.
pub const CHUNK: usize = 1 << 16;

/// `work(start, piece)` over `out` in pieces.
pub fn chunks<T: Send>(out: &mut [T], work: impl Fn(usize, &mut [T]) + Sync) {
    chunks_of(out, CHUNK, work)
}

/// `chunks` with pieces of `piece` elements, for work whose pieces must
/// align to something else (whole 64-bit words of packed lanes).
pub fn chunks_of<T: Send>(out: &mut [T], piece: usize, work: impl Fn(usize, &mut [T]) + Sync) {
    let piece = piece.max(1);
    if out.len() > piece {
        out.par_chunks_mut(piece).enumerate().for_each(|(i, p)| work(i * piece, p));
    } else {
        work(0, out);
    }
}

/// `work(start, piece of a, piece of b)` over two outputs of one length.
pub fn chunks2<A: Send, B: Send>(a: &mut [A], b: &mut [B], work: impl Fn(usize, &mut [A], &mut [B]) + Sync) {
    assert_eq!(a.len(), b.len(), "par::chunks2 over arrays of different lengths");
    if a.len() > CHUNK {
        a.par_chunks_mut(CHUNK).zip(b.par_chunks_mut(CHUNK)).enumerate().for_each(|(i, (a, b))| work(i * CHUNK, a, b));
    } else {
        work(0, a, b);
    }
}

/// `map(start, piece)` over `x` in pieces, the results combined with
/// `combine` (associative; pieces are combined in no fixed order).
pub fn map_reduce<T: Sync, R: Send>(x: &[T], map: impl Fn(usize, &[T]) -> R + Sync, combine: impl Fn(R, R) -> R + Sync) -> R {
    if x.len() > CHUNK {
        x.par_chunks(CHUNK).enumerate().map(|(i, piece)| map(i * CHUNK, piece)).reduce_with(&combine).expect("at least one piece")
    } else {
        map(0, x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_every_element_once_with_their_start() {
        for n in [0, 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7] {
            let mut out = vec![0usize; n];
            chunks(&mut out, |start, piece| piece.iter_mut().enumerate().for_each(|(j, x)| *x += start + j + 1));
            assert!(out.iter().enumerate().all(|(i, &x)| x == i + 1), "n = {n}");
            let mut b = vec![0u8; n];
            chunks2(&mut out, &mut b, |start, a, b| a.iter_mut().zip(b).enumerate().for_each(|(j, (x, y))| {
                *x -= start + j;
                *y = 1;
            }));
            assert!(out.iter().all(|&x| x == 1) && b.iter().all(|&y| y == 1));
            assert_eq!(map_reduce(&out, |_, p| p.len(), |a, b| a + b), n);
            let starts = std::sync::Mutex::new(Vec::new());
            chunks_of(&mut b, 21 * 1000, |start, p| starts.lock().unwrap().push((start, p.len())));
            let mut starts = starts.into_inner().unwrap();
            starts.sort();
            assert!(starts.iter().all(|&(s, _)| s % 21_000 == 0) && starts.iter().map(|&(_, l)| l).sum::<usize>() == n);
        }
    }
}
