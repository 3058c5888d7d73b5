//! PowerSGD's linear algebra: one power-iteration step per push on the
//! `rows x cols` view of a parameter (rows = first dimension), row-major f32.
//! Every function is sequential per output element, so the same inputs give
//! the same bits on every worker and on the server.

use rayon::prelude::*;

use crate::isa::Isa;

/// `(rows, cols, r)` when a rank-`rank` approximation of `shape` saves bytes
/// (`r (rows + cols) < rows cols`, r = rank capped at min(rows, cols)); `None`
/// for vectors and for matrices too small to gain, which go uncompressed.
pub fn factors(shape: &[usize], rank: usize) -> Option<(usize, usize, usize)> {
    if shape.len() < 2 || shape.iter().any(|&d| d == 0) {
        return None;
    }
    let rows = shape[0];
    let cols = shape[1..].iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
    let r = rank.min(rows).min(cols);
    let sent = rows.checked_add(cols).and_then(|s| s.checked_mul(r))?;
    (sent < rows.checked_mul(cols)?).then_some((rows, cols, r))
}

/// Work below this many matrix elements stays on one thread.
const PARALLEL: usize = 1 << 16;

/// `p = m q`: (rows x cols) times (cols x r); rows in parallel. Each dot
/// product sums in `LANES` running sums (column `c` into sum `c % LANES`),
/// combined in a fixed order: an order the compiler vectorizes, the same
/// on every kernel and machine.
pub fn m_times_q(m: &[f32], q: &[f32], rows: usize, cols: usize, r: usize, p: &mut [f32]) {
    let qt = transposed(q, cols, r);
    let isa = Isa::detect();
    let row = |i: usize, p_row: &mut [f32]| {
        let m_row = &m[i * cols..(i + 1) * cols];
        for (j, pj) in p_row.iter_mut().enumerate() {
            *pj = dot(isa, m_row, &qt[j * cols..(j + 1) * cols]);
        }
    };
    if rows * cols > PARALLEL {
        p.par_chunks_mut(r).enumerate().for_each(|(i, p_row)| row(i, p_row));
    } else {
        p.chunks_mut(r).enumerate().for_each(|(i, p_row)| row(i, p_row));
    }
}

/// `next = m + g`, then `p = next q` (`m_times_q`), in one pass over `m`:
/// each row is added while it is in cache for its dot products, and `m`
/// is left as it was (a push that fails later changes no residual). The
/// same bits as the two steps.
#[allow(clippy::too_many_arguments)]
pub fn add_then_m_times_q(m: &[f32], g: &[f32], next: &mut [f32], q: &[f32], rows: usize, cols: usize, r: usize, p: &mut [f32]) {
    assert!(m.len() == rows * cols && g.len() == m.len() && next.len() == m.len() && p.len() == rows * r && q.len() == cols * r, "PowerSGD: {} + {} values into {} for {rows} x {cols}", m.len(), g.len(), next.len());
    add_then_m_times_q_on(Isa::detect(), m, g, next, q, rows, cols, r, p)
}

#[allow(clippy::too_many_arguments)]
fn add_then_m_times_q_on(isa: Isa, m: &[f32], g: &[f32], next: &mut [f32], q: &[f32], rows: usize, cols: usize, r: usize, p: &mut [f32]) {
    let qt = transposed(q, cols, r);
    let row = |((m_row, g_row), next_row): ((&[f32], &[f32]), &mut [f32]), p_row: &mut [f32]| {
        if (1..=MAX_FUSED).contains(&r) {
            add_dots(isa, m_row, g_row, next_row, &qt, p_row);
            return;
        }
        add_kernel(isa, m_row, g_row, next_row);
        for (j, pj) in p_row.iter_mut().enumerate() {
            *pj = dot(isa, next_row, &qt[j * cols..(j + 1) * cols]);
        }
    };
    if rows * cols > PARALLEL {
        m.par_chunks(cols).zip(g.par_chunks(cols)).zip(next.par_chunks_mut(cols)).zip(p.par_chunks_mut(r)).for_each(|(mg, p_row)| row(mg, p_row));
    } else {
        m.chunks(cols).zip(g.chunks(cols)).zip(next.chunks_mut(cols)).zip(p.chunks_mut(r)).for_each(|(mg, p_row)| row(mg, p_row));
    }
}

#[inline(always)]
fn add_body(a: &[f32], b: &[f32], out: &mut [f32]) {
    out.iter_mut().zip(a.iter().zip(b)).for_each(|(o, (&a, &b))| *o = a + b);
}

crate::isa::multiversion! {
    /// `out = a + b`, element by element.
    fn add_kernel[][](a: &[f32], b: &[f32], out: &mut [f32]) -> () = add_body;
}

/// `q` (cols x r) transposed (r x cols): each dot product reads two contiguous rows.
fn transposed(q: &[f32], cols: usize, r: usize) -> Vec<f32> {
    let mut qt = vec![0f32; r * cols];
    for (c, q_row) in q.chunks_exact(r).take(cols).enumerate() {
        for (j, &v) in q_row.iter().enumerate() {
            qt[j * cols + c] = v;
        }
    }
    qt
}

/// Running sums of a dot product (`m_times_q`).
const LANES: usize = 16;

#[inline(always)]
fn dot_body(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..LANES {
            acc[k] += x[k] * y[k];
        }
    }
    for (k, (x, y)) in ra.iter().zip(rb).enumerate() {
        acc[k] += x * y;
    }
    combine(&mut acc)
}

/// The running sums of a dot product added pairwise, in a fixed order.
#[inline(always)]
fn combine(acc: &mut [f32; LANES]) -> f32 {
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for k in 0..width {
            acc[k] += acc[k + width];
        }
    }
    acc[0]
}

crate::isa::multiversion! {
    /// `sum a[c] b[c]` in `LANES` running sums (see `m_times_q`); `a` and
    /// `b` of one length (the caller's assert).
    fn dot_kernel[][](a: &[f32], b: &[f32]) -> f32 = dot_body;
}

fn dot(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot product of different lengths");
    dot_kernel(isa, a, b)
}

/// Ranks whose kernels keep every column's running sums in registers
/// (`add_dots`, `mt_block`, `pqt_row`); larger ranks take the general loops.
const MAX_FUSED: usize = 4;

/// `next_row = m_row + g_row`, then `p_row[j] = dot(next_row, qt_j)` for
/// each of the `R` rows of `qt` (R x cols), in one pass over the row: each
/// piece of `LANES` columns is added, stored and multiplied into `R` sets
/// of running sums at once. The sums and their order are `dot_body`'s, so
/// the bits are.
#[inline(always)]
fn add_dots_body<const R: usize>(m_row: &[f32], g_row: &[f32], next_row: &mut [f32], qt: &[f32], p_row: &mut [f32]) {
    let cols = m_row.len();
    let q: [&[f32]; R] = std::array::from_fn(|j| &qt[j * cols..(j + 1) * cols]);
    let mut acc = [[0f32; LANES]; R];
    let full = cols / LANES * LANES;
    let (m_full, m_rest) = m_row.split_at(full);
    let (g_full, g_rest) = g_row.split_at(full);
    let (n_full, n_rest) = next_row.split_at_mut(full);
    for (c, ((m, g), nx)) in m_full.chunks_exact(LANES).zip(g_full.chunks_exact(LANES)).zip(n_full.chunks_exact_mut(LANES)).enumerate() {
        let mut x = [0f32; LANES];
        for k in 0..LANES {
            x[k] = m[k] + g[k];
            nx[k] = x[k];
        }
        for (a, q) in acc.iter_mut().zip(&q) {
            let y: &[f32; LANES] = q[c * LANES..(c + 1) * LANES].try_into().unwrap();
            for k in 0..LANES {
                a[k] += x[k] * y[k];
            }
        }
    }
    for (k, ((&m, &g), nx)) in m_rest.iter().zip(g_rest).zip(n_rest.iter_mut()).enumerate() {
        *nx = m + g;
        for (a, q) in acc.iter_mut().zip(&q) {
            a[k] += *nx * q[full + k];
        }
    }
    for (pj, a) in p_row.iter_mut().zip(acc.iter_mut()) {
        *pj = combine(a);
    }
}

#[inline(always)]
fn add_dots_any(m_row: &[f32], g_row: &[f32], next_row: &mut [f32], qt: &[f32], p_row: &mut [f32]) {
    match p_row.len() {
        1 => add_dots_body::<1>(m_row, g_row, next_row, qt, p_row),
        2 => add_dots_body::<2>(m_row, g_row, next_row, qt, p_row),
        3 => add_dots_body::<3>(m_row, g_row, next_row, qt, p_row),
        4 => add_dots_body::<4>(m_row, g_row, next_row, qt, p_row),
        r => unreachable!("rank {r} above MAX_FUSED"),
    }
}

crate::isa::multiversion! {
    /// `add_dots_body` for `p_row.len()` in `1..=MAX_FUSED`.
    fn add_dots[][](m_row: &[f32], g_row: &[f32], next_row: &mut [f32], qt: &[f32], p_row: &mut [f32]) -> () = add_dots_any;
}

/// `q = m^T p`: (cols x rows) times (rows x r); blocks of columns in
/// parallel, each element summed over rows in order (`reference::mt_times_p`,
/// bit for bit). Within a block the sums are kept transposed (r x width),
/// so that each row of `m` is one `axpy` per column of `p`, which vectorizes.
pub fn mt_times_p(m: &[f32], p: &[f32], rows: usize, cols: usize, r: usize, q: &mut [f32]) {
    mt_times_p_on(Isa::detect(), m, p, rows, cols, r, q)
}

#[allow(clippy::too_many_arguments)]
fn mt_times_p_on(isa: Isa, m: &[f32], p: &[f32], rows: usize, cols: usize, r: usize, q: &mut [f32]) {
    // Columns per block: long stretches of each row (fewer pages per
    // block), but two blocks per thread. Blocks never change a sum's order.
    let block = cols.div_ceil(2 * rayon::current_num_threads()).next_multiple_of(64).clamp(256, 1024);
    if rows * cols > PARALLEL {
        q.par_chunks_mut(block * r).enumerate().for_each(|(b, qb)| mt_block(isa, m, p, rows, cols, r, b * block, qb));
    } else {
        q.chunks_mut(block * r).enumerate().for_each(|(b, qb)| mt_block(isa, m, p, rows, cols, r, b * block, qb));
    }
}

/// Columns `c0..` of `m^T p` into `q_block` (`mt_times_p`).
#[inline(always)]
fn mt_block_body(m: &[f32], p: &[f32], rows: usize, cols: usize, r: usize, c0: usize, q_block: &mut [f32]) {
    match r {
        1 => return mt_block_few::<1, 64>(m, p, rows, cols, c0, q_block),
        2 => return mt_block_few::<2, 32>(m, p, rows, cols, c0, q_block),
        3 => return mt_block_few::<3, 16>(m, p, rows, cols, c0, q_block),
        4 => return mt_block_few::<4, 16>(m, p, rows, cols, c0, q_block),
        _ => {}
    }
    let width = q_block.len() / r.max(1);
    let mut acc = vec![0f32; r * width]; // acc[j * width + c]
    for i in 0..rows {
        let m_part = &m[i * cols + c0..i * cols + c0 + width];
        for (j, &pj) in p[i * r..(i + 1) * r].iter().enumerate() {
            acc[j * width..(j + 1) * width].iter_mut().zip(m_part).for_each(|(a, &x)| *a += x * pj);
        }
    }
    for (c, q_row) in q_block.chunks_exact_mut(r).enumerate() {
        q_row.iter_mut().enumerate().for_each(|(j, v)| *v = acc[j * width + c]);
    }
}

/// `mt_block_body` for rank `R`: the running sums of `CHUNK` columns stay
/// in registers over a tile of `TILE` rows, then go back to the block's
/// sums. Every sum still adds its rows in order: the same bits.
#[inline(always)]
fn mt_block_few<const R: usize, const CHUNK: usize>(m: &[f32], p: &[f32], rows: usize, cols: usize, c0: usize, q_block: &mut [f32]) {
    const TILE: usize = 16;
    let width = q_block.len() / R;
    let mut acc = vec![0f32; R * width]; // acc[j * width + c]
    for t0 in (0..rows).step_by(TILE) {
        let tile = t0..(t0 + TILE).min(rows);
        let mut c = 0;
        while c + CHUNK <= width {
            let mut a = [[0f32; CHUNK]; R];
            for (j, a) in a.iter_mut().enumerate() {
                a.copy_from_slice(&acc[j * width + c..j * width + c + CHUNK]);
            }
            for i in tile.clone() {
                let x: &[f32; CHUNK] = m[i * cols + c0 + c..i * cols + c0 + c + CHUNK].try_into().unwrap();
                let pi: &[f32; R] = p[i * R..(i + 1) * R].try_into().unwrap();
                for (a, &pj) in a.iter_mut().zip(pi) {
                    for k in 0..CHUNK {
                        a[k] += x[k] * pj;
                    }
                }
            }
            for (j, a) in a.iter().enumerate() {
                acc[j * width + c..j * width + c + CHUNK].copy_from_slice(a);
            }
            c += CHUNK;
        }
        for i in tile {
            let x = &m[i * cols + c0 + c..i * cols + c0 + width];
            for (j, &pj) in p[i * R..(i + 1) * R].iter().enumerate() {
                acc[j * width + c..(j + 1) * width].iter_mut().zip(x).for_each(|(a, &x)| *a += x * pj);
            }
        }
    }
    for (c, q_row) in q_block.chunks_exact_mut(R).enumerate() {
        q_row.iter_mut().enumerate().for_each(|(j, v)| *v = acc[j * width + c]);
    }
}

crate::isa::multiversion! {
    /// One block of `mt_times_p`, compiled for every instruction set: the
    /// same multiplies and adds in the same order (no fused multiply-add),
    /// so the same bits on every kernel.
    fn mt_block[][](m: &[f32], p: &[f32], rows: usize, cols: usize, r: usize, c0: usize, q_block: &mut [f32]) -> () = mt_block_body;
}

/// `out = p q^T` (rows x cols), or `out -= p q^T` when `subtract`; rows in
/// parallel. Each element is `sum_j p[i][j] q[c][j]`, added in `j` order
/// from `f32`'s `Sum` start (`reference::p_times_qt`, bit for bit); with
/// `q` transposed (r x cols), a row is `r` passes of multiply-adds over
/// contiguous columns, which vectorize.
pub fn p_times_qt(p: &[f32], q: &[f32], rows: usize, cols: usize, r: usize, out: &mut [f32], subtract: bool) {
    p_times_qt_on(Isa::detect(), p, q, rows, cols, r, out, subtract)
}

#[allow(clippy::too_many_arguments)]
fn p_times_qt_on(isa: Isa, p: &[f32], q: &[f32], rows: usize, cols: usize, r: usize, out: &mut [f32], subtract: bool) {
    assert!(out.len() == rows * cols && p.len() == rows * r, "PowerSGD: p q^T of {} values into {} for {rows} x {cols}", p.len(), out.len());
    let qt = transposed(q, cols, r);
    pqt_rows(isa, p, &qt, cols, r, 0, out, subtract);
}

/// Whole rows `first..` of `p q^T` written (or, with `subtract`, taken)
/// into `out`. Taken, pairs of rows share each load of `qt` (`pqt_two`),
/// which halves what a row pass reads from the second-level cache. Written,
/// rows go one at a time: pairs writing two rows' lines they had not read
/// measured 1.5x slower than rows (2.66 ms against 1.75 at rank 4, 4096 x
/// 4096, where taking them in pairs is 1.39 against 1.80). Rank 1 (a
/// single row of `qt`, where pairs measured no faster), ranks above
/// `MAX_FUSED` and a last odd row go a row at a time. In parallel pairs
/// when large.
#[allow(clippy::too_many_arguments)]
fn pqt_rows(isa: Isa, p: &[f32], qt: &[f32], cols: usize, r: usize, first: usize, out: &mut [f32], subtract: bool) {
    let pair = |k: usize, o: &mut [f32]| {
        let i = first + 2 * k;
        if subtract && o.len() == 2 * cols && (2..=MAX_FUSED).contains(&r) {
            pqt_two(isa, &p[i * r..(i + 2) * r], qt, cols, o);
        } else {
            for (d, o) in o.chunks_mut(cols).enumerate() {
                pqt_row(isa, &p[(i + d) * r..(i + d + 1) * r], qt, cols, o, subtract);
            }
        }
    };
    if out.len() > PARALLEL {
        out.par_chunks_mut(2 * cols).enumerate().for_each(|(k, o)| pair(k, o));
    } else {
        out.chunks_mut(2 * cols).enumerate().for_each(|(k, o)| pair(k, o));
    }
}

/// Elements `offset..offset + out.len()` of `p q^T` (row-major, rows x
/// cols), bit for bit those of `p_times_qt`: a server's slice of a key.
/// Rows it covers whole are written in place, in parallel; a partly
/// covered first or last row is made whole and copied from.
#[allow(clippy::too_many_arguments)]
pub fn p_times_qt_range(p: &[f32], q: &[f32], rows: usize, cols: usize, r: usize, offset: usize, out: &mut [f32]) {
    assert!(cols > 0 && offset + out.len() <= rows * cols, "elements {offset}..+{} of a {rows} x {cols} product", out.len());
    let isa = Isa::detect();
    let qt = transposed(q, cols, r);
    let row = |i: usize, o: &mut [f32]| pqt_row(isa, &p[i * r..(i + 1) * r], &qt, cols, o, false);
    let part_of_row = |i: usize, from: usize, o: &mut [f32]| {
        let mut whole = vec![0f32; cols];
        row(i, &mut whole);
        o.copy_from_slice(&whole[from..from + o.len()]);
    };
    let head = ((cols - offset % cols) % cols).min(out.len());
    let (head_out, rest) = out.split_at_mut(head);
    if head > 0 {
        part_of_row(offset / cols, offset % cols, head_out);
    }
    let first = (offset + head) / cols;
    let whole_rows = rest.len() / cols;
    let (body, tail) = rest.split_at_mut(whole_rows * cols);
    pqt_rows(isa, p, &qt, cols, r, first, body, false);
    if !tail.is_empty() {
        part_of_row(first + whole_rows, 0, tail);
    }
}

/// What `Iterator::sum` starts from (0.0 or -0.0, by Rust version): every
/// element of `p q^T` starts there, as `reference::p_times_qt` does.
#[inline(always)]
fn sum_start() -> f32 {
    std::iter::empty::<f32>().sum()
}

/// One row of `p_times_qt`: `o_row (-)= p_row qt`.
#[inline(always)]
fn pqt_row_body(p_row: &[f32], qt: &[f32], cols: usize, o_row: &mut [f32], subtract: bool) {
    match p_row.len() {
        1 => return pqt_row_few::<1>(p_row, qt, cols, o_row, subtract),
        2 => return pqt_row_few::<2>(p_row, qt, cols, o_row, subtract),
        3 => return pqt_row_few::<3>(p_row, qt, cols, o_row, subtract),
        4 => return pqt_row_few::<4>(p_row, qt, cols, o_row, subtract),
        _ => {}
    }
    let start = sum_start();
    // In pieces that stay in the first-level cache.
    const PIECE: usize = 1024;
    let mut v = [0f32; PIECE];
    for (k, o) in o_row.chunks_mut(PIECE).enumerate() {
        let v = &mut v[..o.len()];
        v.fill(start);
        for (j, &pj) in p_row.iter().enumerate() {
            let q_j = &qt[j * cols + k * PIECE..j * cols + k * PIECE + o.len()];
            v.iter_mut().zip(q_j).for_each(|(v, &qv)| *v += pj * qv);
        }
        if subtract {
            o.iter_mut().zip(v.iter()).for_each(|(o, &v)| *o -= v);
        } else {
            o.copy_from_slice(v);
        }
    }
}

/// `pqt_row_body` for rank `R`: each chunk of `CHUNK` columns is summed
/// in registers (the same terms in the same order: the same bits) and
/// written once.
#[inline(always)]
fn pqt_row_few<const R: usize>(p_row: &[f32], qt: &[f32], cols: usize, o_row: &mut [f32], subtract: bool) {
    const CHUNK: usize = 64;
    let start = sum_start();
    let pj: &[f32; R] = p_row.try_into().unwrap();
    let q: [&[f32]; R] = std::array::from_fn(|j| &qt[j * cols..(j + 1) * cols]);
    let full = o_row.len() / CHUNK * CHUNK;
    let (o_full, o_rest) = o_row.split_at_mut(full);
    for (c, o) in o_full.chunks_exact_mut(CHUNK).enumerate() {
        let mut v = [start; CHUNK];
        for (&pj, q) in pj.iter().zip(&q) {
            let y: &[f32; CHUNK] = q[c * CHUNK..(c + 1) * CHUNK].try_into().unwrap();
            for k in 0..CHUNK {
                v[k] += pj * y[k];
            }
        }
        for (o, &v) in o.iter_mut().zip(&v) {
            *o = if subtract { *o - v } else { v };
        }
    }
    pqt_rest(pj, &q, full, o_rest, subtract);
}

/// The columns `full..` of one row of `p q^T` (past the last whole chunk),
/// one element at a time in the chunks' order of terms.
#[inline(always)]
fn pqt_rest<const R: usize>(p_row: &[f32; R], q: &[&[f32]; R], full: usize, o_rest: &mut [f32], subtract: bool) {
    let start = sum_start();
    for (k, o) in o_rest.iter_mut().enumerate() {
        let mut v = start;
        for (&pj, q) in p_row.iter().zip(q) {
            v += pj * q[full + k];
        }
        *o = if subtract { *o - v } else { v };
    }
}

/// `pqt_row_few`, subtracting, for two rows at once (`o` holds both, `p2`
/// both rows of `p`): each chunk of `qt` is loaded once for both. The same
/// terms in the same order per row: the same bits.
#[inline(always)]
fn pqt_two_few<const R: usize>(p2: &[f32], qt: &[f32], cols: usize, o: &mut [f32]) {
    const CHUNK: usize = 32;
    let start = sum_start();
    let pa: &[f32; R] = p2[..R].try_into().unwrap();
    let pb: &[f32; R] = p2[R..2 * R].try_into().unwrap();
    let q: [&[f32]; R] = std::array::from_fn(|j| &qt[j * cols..(j + 1) * cols]);
    let (oa, ob) = o.split_at_mut(cols);
    let full = cols / CHUNK * CHUNK;
    for c in (0..full).step_by(CHUNK) {
        let (mut va, mut vb) = ([start; CHUNK], [start; CHUNK]);
        for j in 0..R {
            let y: &[f32; CHUNK] = q[j][c..c + CHUNK].try_into().unwrap();
            for k in 0..CHUNK {
                va[k] += pa[j] * y[k];
                vb[k] += pb[j] * y[k];
            }
        }
        let xa: &mut [f32; CHUNK] = (&mut oa[c..c + CHUNK]).try_into().unwrap();
        for k in 0..CHUNK {
            xa[k] -= va[k];
        }
        let xb: &mut [f32; CHUNK] = (&mut ob[c..c + CHUNK]).try_into().unwrap();
        for k in 0..CHUNK {
            xb[k] -= vb[k];
        }
    }
    pqt_rest(pa, &q, full, &mut oa[full..], true);
    pqt_rest(pb, &q, full, &mut ob[full..], true);
}

#[inline(always)]
fn pqt_two_body(p2: &[f32], qt: &[f32], cols: usize, o: &mut [f32]) {
    match p2.len() / 2 {
        2 => pqt_two_few::<2>(p2, qt, cols, o),
        3 => pqt_two_few::<3>(p2, qt, cols, o),
        4 => pqt_two_few::<4>(p2, qt, cols, o),
        r => unreachable!("rank {r} outside 2..=MAX_FUSED"),
    }
}

crate::isa::multiversion! {
    /// Two rows of `p_times_qt`, subtracted, for ranks 2 to `MAX_FUSED`.
    fn pqt_two[][](p2: &[f32], qt: &[f32], cols: usize, o: &mut [f32]) -> () = pqt_two_body;
}

crate::isa::multiversion! {
    /// One row of `p_times_qt` for every instruction set (as `mt_block`).
    fn pqt_row[][](p_row: &[f32], qt: &[f32], cols: usize, o_row: &mut [f32], subtract: bool) -> () = pqt_row_body;
}

/// The straightforward loops, the oracle of the fast ones above.
#[cfg(test)]
mod reference {
    pub fn mt_times_p(m: &[f32], p: &[f32], rows: usize, cols: usize, r: usize, q: &mut [f32]) {
        q.fill(0.0);
        for i in 0..rows {
            for c in 0..cols {
                for j in 0..r {
                    q[c * r + j] += m[i * cols + c] * p[i * r + j];
                }
            }
        }
    }

    pub fn p_times_qt(p: &[f32], q: &[f32], rows: usize, cols: usize, r: usize, out: &mut [f32], subtract: bool) {
        for i in 0..rows {
            for c in 0..cols {
                let v: f32 = p[i * r..(i + 1) * r].iter().zip(&q[c * r..(c + 1) * r]).map(|(a, b)| a * b).sum();
                let o = &mut out[i * cols + c];
                *o = if subtract { *o - v } else { v };
            }
        }
    }
}

/// Gram-Schmidt on the `r` columns of `p` (rows x r), in place; a column
/// with nothing left becomes zero (a collapsed column: `warm_start` draws
/// that column of the next `Q` anew). A column whose squares overflow or
/// underflow float32 (a gradient spike of 1e10 squared, or values near
/// 1e-23) is done again in float64, which holds the square of every
/// float32: it is normalised, never zeroed for its scale. `p` must be
/// finite (the caller's check); the same `p` gives the same bits anywhere.
pub fn orthogonalize(p: &mut [f32], rows: usize, r: usize) {
    assert_eq!(p.len(), rows * r, "PowerSGD: P of {} values for {rows} x {r}", p.len());
    let mut column = vec![0f32; rows];
    for j in 0..r {
        (0..rows).for_each(|i| column[i] = p[i * r + j]);
        for k in 0..j {
            let dot: f32 = (0..rows).map(|i| p[i * r + j] * p[i * r + k]).sum();
            for i in 0..rows {
                p[i * r + j] -= dot * p[i * r + k];
            }
        }
        let norm = (0..rows).map(|i| p[i * r + j] * p[i * r + j]).sum::<f32>().sqrt();
        if norm.is_finite() && norm > 1e-20 {
            let inv = 1.0 / norm;
            for i in 0..rows {
                p[i * r + j] *= inv;
            }
            continue;
        }
        // Out of float32's range for squares (or nothing left): again in float64.
        let mut wide: Vec<f64> = column.iter().map(|&v| v as f64).collect();
        for k in 0..j {
            let dot: f64 = (0..rows).map(|i| wide[i] * p[i * r + k] as f64).sum();
            (0..rows).for_each(|i| wide[i] -= dot * p[i * r + k] as f64);
        }
        let norm = wide.iter().map(|v| v * v).sum::<f64>().sqrt();
        let inv = if norm.is_finite() && norm > 0.0 { 1.0 / norm } else { 0.0 };
        (0..rows).for_each(|i| p[i * r + j] = (wide[i] * inv) as f32);
    }
}

/// The first `q` of a key: the same on every worker (from `seed` and the key).
pub fn initial_q(cols: usize, r: usize, seed: u64) -> Vec<f32> {
    (0..cols * r).map(|i| super::noise::uniform(seed, i as u64) - 0.5).collect()
}

/// Whether column `j` of `q` (cols x r) can start a power step: finite,
/// and not all zero (a collapsed column would stay zero for ever, as
/// `M^T 0 = 0`).
pub fn column_alive(q: &[f32], cols: usize, r: usize, j: usize) -> bool {
    let column = || (0..cols).map(|c| q[c * r + j]);
    column().all(f32::is_finite) && column().any(|v| v != 0.0)
}

/// The `Q` a push starts from: the warm start `q` when it is whole (cols x
/// r) and every column is alive; else `q` with each dead column (every
/// column, when `q` is missing) taken from `initial_q(cols, r, seed)`. The
/// caller derives `seed` from the scheme's seed, the push's step and the
/// key, so every worker, whose `q` is the same sum, draws the same.
pub fn warm_start(q: &[f32], cols: usize, r: usize, seed: impl FnOnce() -> u64) -> std::borrow::Cow<'_, [f32]> {
    if q.len() != cols * r {
        return std::borrow::Cow::Owned(initial_q(cols, r, seed()));
    }
    let dead: Vec<usize> = (0..r).filter(|&j| !column_alive(q, cols, r, j)).collect();
    if dead.is_empty() {
        return std::borrow::Cow::Borrowed(q);
    }
    let drawn = initial_q(cols, r, seed());
    let mut q = q.to_vec();
    for j in dead {
        (0..cols).for_each(|c| q[c * r + j] = drawn[c * r + j]);
    }
    std::borrow::Cow::Owned(q)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_products_agree_on_every_kernel_and_sum_in_lanes() {
        for n in [0usize, 1, 15, 16, 17, 100, 4096] {
            let a: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 53 % 89) as f32 - 44.0) / 3.0).collect();
            let plain = dot(Isa::Baseline, &a, &b);
            for isa in Isa::available() {
                assert_eq!(plain.to_bits(), dot(isa, &a, &b).to_bits(), "{isa:?} n={n}");
            }
            let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((plain as f64 - exact).abs() <= 1e-4 * (1.0 + exact.abs()), "n={n}: {plain} vs {exact}");
        }
        // r = 2: each column of Q against each row of M.
        let (rows, cols, r) = (3, 20, 2);
        let m: Vec<f32> = (0..rows * cols).map(|i| i as f32 * 0.5).collect();
        let q: Vec<f32> = (0..cols * r).map(|i| if i % 2 == 0 { 1.0 } else { -1.0 }).collect();
        let mut p = vec![0f32; rows * r];
        m_times_q(&m, &q, rows, cols, r, &mut p);
        for i in 0..rows {
            let s: f32 = m[i * cols..(i + 1) * cols].iter().sum();
            assert_eq!((p[i * r], p[i * r + 1]), (s, -s));
        }
    }

    #[test]
    fn the_products_match_the_plain_loops_bit_for_bit() {
        // Shapes around the blocks (256 to 1024 columns), chunks (16 to 64), tiles (16
        // rows) and piece (1024) sizes, two large enough to run in
        // parallel (one with an odd row count: a last row without a pair),
        // ranks with kernels of their own (1 to 4) and without; values with
        // every sign, and -0.0.
        for (rows, cols, r) in [(3, 5, 1), (7, 255, 2), (9, 257, 3), (5, 1025, 4), (300, 300, 4), (301, 257, 2), (130, 97, 3), (17, 2049, 8), (70, 300, 5)] {
            let m: Vec<f32> = (0..rows * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
            let mut p: Vec<f32> = (0..rows * r).map(|i| ((i * 53 % 89) as f32 - 44.0) / 3.0).collect();
            p[0] = -0.0;
            let q: Vec<f32> = (0..cols * r).map(|i| ((i * 29 % 61) as f32 - 30.0) / 5.0).collect();
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            // m += g, then m q: fused as the two steps
            let g: Vec<f32> = (0..rows * cols).map(|i| ((i * 13 % 71) as f32 - 35.0) / 9.0).collect();
            let mut m1 = m.clone();
            m1.iter_mut().zip(&g).for_each(|(a, b)| *a += b);
            let mut p1 = vec![0f32; rows * r];
            m_times_q(&m1, &q, rows, cols, r, &mut p1);
            for isa in Isa::available() {
                let (mut next, mut p2) = (vec![7f32; rows * cols], vec![1f32; rows * r]);
                add_then_m_times_q_on(isa, &m, &g, &mut next, &q, rows, cols, r, &mut p2);
                assert_eq!((bits(&next), bits(&p2)), (bits(&m1), bits(&p1)), "{isa:?} m + g, (m + g) q {rows}x{cols} r={r}");
            }
            let mut slow = vec![0f32; cols * r];
            reference::mt_times_p(&m, &p, rows, cols, r, &mut slow);
            for isa in Isa::available() {
                let mut fast = vec![7f32; cols * r];
                mt_times_p_on(isa, &m, &p, rows, cols, r, &mut fast);
                assert_eq!(bits(&fast), bits(&slow), "{isa:?} m^T p {rows}x{cols} r={r}");
            }
            for subtract in [false, true] {
                let mut slow = m.clone();
                reference::p_times_qt(&p, &q, rows, cols, r, &mut slow, subtract);
                for isa in Isa::available() {
                    let mut fast = m.clone();
                    p_times_qt_on(isa, &p, &q, rows, cols, r, &mut fast, subtract);
                    assert_eq!(bits(&fast), bits(&slow), "{isa:?} p q^T {rows}x{cols} r={r} subtract={subtract}");
                }
            }
        }
        // all-zero products: the sum's start decides the sign of zero
        let (mut fast, mut slow) = ([1f32; 4], [1f32; 4]);
        p_times_qt(&[-0.0, 0.0], &[0.0, -0.0], 2, 2, 1, &mut fast, false);
        reference::p_times_qt(&[-0.0, 0.0], &[0.0, -0.0], 2, 2, 1, &mut slow, false);
        assert_eq!(fast.map(f32::to_bits), slow.map(f32::to_bits));
    }

    #[test]
    fn shapes_that_gain_are_compressed() {
        assert_eq!(factors(&[10], 1), None);
        assert_eq!(factors(&[2, 2], 1), None); // 1 * 4 == 4: no gain
        assert_eq!(factors(&[3, 3], 1), Some((3, 3, 1)));
        assert_eq!(factors(&[64, 3, 3], 2), Some((64, 9, 2)));
        assert_eq!(factors(&[4, 100], 8), None); // rank capped at 4: 4 * 104 > 400
        assert_eq!(factors(&[usize::MAX / 2, 4, 2], 1), None); // sizes past usize: never factored, no overflow
    }

    #[test]
    fn a_rank_one_matrix_is_recovered_exactly_enough() {
        // m = u v^T: one power step from any q not orthogonal to v recovers it.
        let (rows, cols) = (5, 4);
        let u = [1.0f32, -2.0, 0.5, 3.0, 0.0];
        let v = [0.5f32, 1.0, -1.0, 2.0];
        let m: Vec<f32> = (0..rows * cols).map(|i| u[i / cols] * v[i % cols]).collect();
        let q = initial_q(cols, 1, 7);
        let mut p = vec![0f32; rows];
        m_times_q(&m, &q, rows, cols, 1, &mut p);
        orthogonalize(&mut p, rows, 1);
        let mut q2 = vec![0f32; cols];
        mt_times_p(&m, &p, rows, cols, 1, &mut q2);
        let mut approx = vec![0f32; rows * cols];
        p_times_qt(&p, &q2, rows, cols, 1, &mut approx, false);
        for (a, b) in approx.iter().zip(&m) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }

    #[test]
    fn columns_out_of_float32_squares_are_normalised_and_empty_ones_zeroed() {
        // A spike: squares overflow float32 (1e25^2); tiny: they underflow (1e-30^2).
        for scale in [1e25f32, 1e-30, 1e-44] {
            let (rows, r) = (4, 2);
            let mut p: Vec<f32> = [3.0f32, 1.0, 4.0, 0.0, 0.0, 2.0, 0.0, 0.0].iter().map(|v| v * scale).collect();
            orthogonalize(&mut p, rows, r);
            assert!(p.iter().all(|v| v.is_finite()), "{scale}: {p:?}");
            for a in 0..r {
                let dot: f32 = (0..rows).map(|i| p[i * r + a] * p[i * r + a]).sum();
                assert!((dot - 1.0).abs() < 1e-5, "{scale}: column {a} has norm^2 {dot}: {p:?}");
            }
            let cross: f32 = (0..rows).map(|i| p[i * r] * p[i * r + 1]).sum();
            assert!(cross.abs() < 1e-5, "{scale}: {cross}");
        }
        // A zero column stays zero (collapsed; the other is normalised).
        let mut p = vec![0.0f32, 1.0, 0.0, 2.0, 0.0, 2.0];
        orthogonalize(&mut p, 3, 2);
        assert_eq!(p, [0.0, 1.0 / 3.0, 0.0, 2.0 / 3.0, 0.0, 2.0 / 3.0]);
        // Columns in float32's range keep the float32 steps' bits.
        let mut p: Vec<f32> = (0..12).map(|i| ((i * 7 % 5) as f32) - 2.0 + i as f32 * 0.1).collect();
        let mut plain = p.clone();
        orthogonalize(&mut p, 4, 3);
        for j in 0..3 {
            for k in 0..j {
                let dot: f32 = (0..4).map(|i| plain[i * 3 + j] * plain[i * 3 + k]).sum();
                (0..4).for_each(|i| plain[i * 3 + j] -= dot * plain[i * 3 + k]);
            }
            let inv = 1.0 / (0..4).map(|i| plain[i * 3 + j] * plain[i * 3 + j]).sum::<f32>().sqrt();
            (0..4).for_each(|i| plain[i * 3 + j] *= inv);
        }
        assert_eq!(p.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), plain.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    }

    #[test]
    fn a_dead_column_of_the_warm_start_is_drawn_anew_from_the_seed() {
        let (cols, r) = (5, 2);
        let drawn = initial_q(cols, r, 9);
        // whole and alive: the warm start itself
        let q: Vec<f32> = (0..cols * r).map(|i| i as f32 + 1.0).collect();
        assert!(matches!(warm_start(&q, cols, r, || unreachable!()), std::borrow::Cow::Borrowed(_)));
        // missing: the draw
        assert_eq!(&*warm_start(&[], cols, r, || 9), &drawn[..]);
        // column 1 all zero, then column 0 with a NaN: only that column is drawn
        let mut dead = q.clone();
        (0..cols).for_each(|c| dead[c * r + 1] = 0.0);
        let got = warm_start(&dead, cols, r, || 9);
        for c in 0..cols {
            assert_eq!((got[c * r], got[c * r + 1]), (q[c * r], drawn[c * r + 1]));
        }
        let mut nan = q.clone();
        nan[2 * r] = f32::NAN;
        let got = warm_start(&nan, cols, r, || 9);
        for c in 0..cols {
            assert_eq!((got[c * r], got[c * r + 1]), (drawn[c * r], q[c * r + 1]));
        }
    }

    #[test]
    fn columns_come_out_orthonormal() {
        let (rows, r) = (6, 3);
        let mut p: Vec<f32> = (0..rows * r).map(|i| ((i * 7 % 5) as f32) - 2.0 + i as f32 * 0.1).collect();
        orthogonalize(&mut p, rows, r);
        for a in 0..r {
            for b in 0..r {
                let dot: f32 = (0..rows).map(|i| p[i * r + a] * p[i * r + b]).sum();
                assert!((dot - if a == b { 1.0 } else { 0.0 }).abs() < 1e-5, "{a},{b}: {dot}");
            }
        }
    }
}
