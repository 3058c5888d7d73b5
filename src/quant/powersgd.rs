//! PowerSGD's linear algebra: one power-iteration step per push on the
//! `rows x cols` view of a parameter (rows = first dimension), row-major f32.
//! Every function is sequential per output element, so the same inputs give
//! the same bits on every worker and on the server.

/// `(rows, cols, r)` when a rank-`rank` approximation of `shape` saves bytes
/// (`r (rows + cols) < rows cols`, r = rank capped at min(rows, cols)); `None`
/// for vectors and for matrices too small to gain, which go uncompressed.
pub fn factors(shape: &[usize], rank: usize) -> Option<(usize, usize, usize)> {
    if shape.len() < 2 || shape.iter().any(|&d| d == 0) {
        return None;
    }
    let rows = shape[0];
    let cols: usize = shape[1..].iter().product();
    let r = rank.min(rows).min(cols);
    (r * (rows + cols) < rows * cols).then_some((rows, cols, r))
}

/// `p = m q`: (rows x cols) times (cols x r).
pub fn m_times_q(m: &[f32], q: &[f32], rows: usize, cols: usize, r: usize, p: &mut [f32]) {
    for i in 0..rows {
        let row = &m[i * cols..(i + 1) * cols];
        for j in 0..r {
            p[i * r + j] = row.iter().enumerate().map(|(c, &x)| x * q[c * r + j]).sum();
        }
    }
}

/// `q = m^T p`: (cols x rows) times (rows x r).
pub fn mt_times_p(m: &[f32], p: &[f32], rows: usize, cols: usize, r: usize, q: &mut [f32]) {
    q.fill(0.0);
    for i in 0..rows {
        let row = &m[i * cols..(i + 1) * cols];
        for (c, &x) in row.iter().enumerate() {
            for j in 0..r {
                q[c * r + j] += x * p[i * r + j];
            }
        }
    }
}

/// `out = p q^T` (rows x cols), or `out -= p q^T` when `subtract`.
pub fn p_times_qt(p: &[f32], q: &[f32], rows: usize, cols: usize, r: usize, out: &mut [f32], subtract: bool) {
    for i in 0..rows {
        for c in 0..cols {
            let v: f32 = (0..r).map(|j| p[i * r + j] * q[c * r + j]).sum();
            let o = &mut out[i * cols + c];
            *o = if subtract { *o - v } else { v };
        }
    }
}

/// Gram-Schmidt on the `r` columns of `p` (rows x r), in place; a column
/// with (numerically) nothing left becomes zero.
pub fn orthogonalize(p: &mut [f32], rows: usize, r: usize) {
    for j in 0..r {
        for k in 0..j {
            let dot: f32 = (0..rows).map(|i| p[i * r + j] * p[i * r + k]).sum();
            for i in 0..rows {
                p[i * r + j] -= dot * p[i * r + k];
            }
        }
        let norm = (0..rows).map(|i| p[i * r + j] * p[i * r + j]).sum::<f32>().sqrt();
        let inv = if norm > 1e-20 { 1.0 / norm } else { 0.0 };
        for i in 0..rows {
            p[i * r + j] *= inv;
        }
    }
}

/// The first `q` of a key: the same on every worker (from `seed` and the key).
pub fn initial_q(cols: usize, r: usize, seed: u64) -> Vec<f32> {
    (0..cols * r).map(|i| super::qsgd::uniform(seed, i as u64) - 0.5).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_that_gain_are_compressed() {
        assert_eq!(factors(&[10], 1), None);
        assert_eq!(factors(&[2, 2], 1), None); // 1 * 4 == 4: no gain
        assert_eq!(factors(&[3, 3], 1), Some((3, 3, 1)));
        assert_eq!(factors(&[64, 3, 3], 2), Some((64, 9, 2)));
        assert_eq!(factors(&[4, 100], 8), None); // rank capped at 4: 4 * 104 > 400
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
