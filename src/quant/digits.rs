//! Values in `0..radix` as base-`radix` digits of 16-bit words: a denser
//! wire form than `lanes` for a summed pull whose range is not a power of
//! two. Two workers' 1-bit sums take 3 values: 2-bit lanes hold 32 to a
//! word (2 bits each), while 3^10 = 59049 < 2^16 puts ten in 16 bits (1.6
//! bits each, 20% fewer bytes); sums of codes in -1..=1 (qsgd_mn_ms with a
//! 1-bit scale) over 2 workers take 5 values, 2.67 bits against 3. Digits
//! cannot be added word by word as lanes can, so only a final sum travels
//! this way (server to worker).
//!
//! A word holds `per = per_word(radix)` digits, the largest count with
//! `radix^per <= 2^16`; digit `d` of a word is worth `radix^d`. Values go in
//! groups of `GROUP * per`, as `lanes` places them: a full group takes
//! `GROUP` = 8 consecutive words, its value `j` in word `j % 8`, digit
//! `j / 8`; the last group, of `c` values, takes `m = ceil(c / per)` words,
//! value `j` in word `j % m`, digit `j / m`. Eight consecutive values share
//! a digit of eight consecutive words, so the loops below vectorize, and in
//! full groups value `i` sits in row `i / 8` of both layouts: `from_lanes`
//! and `to_lanes` convert row by row, with no array of values between.
//!
//! Unpacking divides in float32, where it is exact: for `x < 2^16`,
//! `floor((x + 1/2) * fl(1 / radix))` is `floor(x / radix)`. The relative
//! error of that product is below 2^-23, so its absolute error is below
//! `2^-7 / radix`, while `(x + 1/2) / radix` is at least `1 / (2 radix)`
//! from every whole number. (Integer division by a run-time radix does not
//! vectorize.)

use crate::error::{Error, Result};

/// Words of a full group (as in `lanes`).
pub const GROUP: usize = super::lanes::GROUP;

/// Words per parallel piece: whole groups.
const TASK_WORDS: usize = 1 << 14;
const _: () = assert!(TASK_WORDS.is_multiple_of(GROUP));

/// Digits a 16-bit word holds in base `radix` (2 to 2^16): the largest
/// `per` with `radix^per <= 2^16`.
pub fn per_word(radix: u32) -> u32 {
    assert!((2..=1 << 16).contains(&radix), "digits of radix {radix}");
    let (mut per, mut power) = (0, 1u64);
    while power * radix as u64 <= 1 << 16 {
        power *= radix as u64;
        per += 1;
    }
    per
}

/// Words that `n` values in base `radix` take.
pub fn words_for(n: usize, radix: u32) -> usize {
    n.div_ceil(per_word(radix) as usize)
}

/// Whether values in base `radix` take fewer bits as digits (`16 / per`)
/// than in `lanes` of the width that holds `radix - 1` (`64 / lanes per word`).
pub fn denser(radix: u32) -> bool {
    (2..=1 << 16).contains(&radix) && 16 * (64 / super::lanes::width_for(radix as u64 - 1)) < 64 * per_word(radix)
}

/// The word and digit of value `i` of `n` in base `radix`: the layout's
/// definition (the kernels follow it group by group).
pub fn place(i: usize, n: usize, radix: u32) -> (usize, u32) {
    let per = per_word(radix) as usize;
    let (g, j) = (i / (GROUP * per), i % (GROUP * per));
    let m = (n - g * GROUP * per).min(GROUP * per).div_ceil(per);
    (g * GROUP + j % m, (j / m) as u32)
}

/// Packs `vals` (each below `radix`; the caller's to keep) into `out`
/// (`words_for(vals.len(), radix)` words), whole groups in parallel.
pub fn pack(vals: &[u32], radix: u32, out: &mut [u16]) {
    let per = per_word(radix) as usize;
    assert_eq!(out.len(), words_for(vals.len(), radix), "{} values in base {radix}", vals.len());
    debug_assert!(vals.iter().all(|&v| v < radix));
    let isa = crate::isa::Isa::detect();
    crate::par::chunks_of(out, TASK_WORDS, |first, words| {
        let vals = &vals[first * per..((first + words.len()) * per).min(vals.len())];
        pack_kernel(isa, vals, radix, per, words)
    });
}

/// `pack` of one piece (whole groups, then perhaps the last one).
#[inline(always)]
fn pack_body(vals: &[u32], radix: u32, per: usize, words: &mut [u16]) {
    for (group, v) in words.chunks_mut(GROUP).zip(vals.chunks(GROUP * per)) {
        let m = group.len();
        if v.len() == GROUP * per && m == GROUP {
            // Horner, from the top digit: all the group's words at once.
            let mut acc = [0u32; GROUP];
            for digit in v.chunks_exact(GROUP).rev() {
                for (a, &x) in acc.iter_mut().zip(digit) {
                    *a = *a * radix + x;
                }
            }
            group.iter_mut().zip(acc).for_each(|(w, a)| *w = a as u16);
        } else {
            for (w, slot) in group.iter_mut().enumerate() {
                let mut acc = 0u32;
                for d in (0..per).rev().map(|d| d * m + w).filter(|&j| j < v.len()) {
                    acc = acc * radix + v[d];
                }
                *slot = acc as u16;
            }
        }
    }
}

crate::isa::multiversion! {
    fn pack_kernel[][](vals: &[u32], radix: u32, per: usize, words: &mut [u16]) -> () = pack_body;
}

/// `floor(x / radix)` for `x < 2^16`, in float32 (exact: see the module's
/// notes); `inv = 1 / radix` rounded to float32, in `(0, 1/2]`.
#[inline(always)]
#[allow(clippy::manual_clamp)] // clamp keeps a NaN, max(0.0) does not
fn div(x: u32, inv: f32) -> u32 {
    let q = (x as i32 as f32 + 0.5) * inv.max(0.0).min(0.5); // (max: a NaN gives 0)
    // SAFETY: |x as i32| <= 2^31 and inv is in [0, 1/2], so q is finite and
    // |q| < 2^30 fits an i32. (A plain `as` saturates, which compiles to a
    // scalar conversion per value.)
    unsafe { q.to_int_unchecked::<i32>() as u32 }
}

/// Unpacks `out.len()` values in base `radix` from `words`, checking that
/// every word holds no more than its digits (a value past `radix^digits`
/// would decode to a digit `>= radix`): a part from the network.
pub fn unpack(words: &[u16], radix: u32, out: &mut [u32]) -> Result<()> {
    let n = out.len();
    if !(2..=1 << 16).contains(&radix) || words.len() != words_for(n, radix) {
        return Err(Error::Transport(format!("malformed message: {n} values in base {radix} in {} digit words", words.len())));
    }
    let per = per_word(radix) as usize;
    check_words(words, radix, per)?;
    let isa = crate::isa::Isa::detect();
    let bad = std::sync::atomic::AtomicBool::new(false);
    crate::par::chunks_of(out, TASK_WORDS * per, |start, vals| {
        let words = &words[start / per..start / per + vals.len().div_ceil(per)];
        if !unpack_kernel(isa, words, radix, per, vals) {
            bad.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    });
    if bad.into_inner() {
        return Err(Error::Transport(format!("malformed message: the last digit word of {n} values holds more digits than values")));
    }
    Ok(())
}

/// Every word holds no more than its `per` digits: a value past
/// `radix^per` would decode to a digit `>= radix`. (A max, which
/// vectorizes, where a search for the first does not.)
fn check_words(words: &[u16], radix: u32, per: usize) -> Result<()> {
    let top = (radix as u64).pow(per as u32);
    if top < 1 << 16 && words.iter().fold(0, |m, &w| m.max(w)) as u64 >= top {
        return Err(Error::Transport(format!("malformed message: a digit word holds a value past {radix}^{per}")));
    }
    Ok(())
}

/// `unpack` of one piece (whole groups, then perhaps the last one); false
/// when a word of the last group holds more than its values.
#[inline(always)]
fn unpack_body(words: &[u16], radix: u32, per: usize, vals: &mut [u32]) -> bool {
    let (inv, mut fits) = (1.0 / radix as f32, true);
    for (group, v) in words.chunks(GROUP).zip(vals.chunks_mut(GROUP * per)) {
        let m = group.len();
        if v.len() == GROUP * per && m == GROUP {
            let mut x = [0u32; GROUP];
            x.iter_mut().zip(group).for_each(|(x, &w)| *x = w as u32);
            for digit in v.chunks_exact_mut(GROUP) {
                for (o, x) in digit.iter_mut().zip(x.iter_mut()) {
                    let q = div(*x, inv);
                    *o = *x - q * radix;
                    *x = q;
                }
            }
        } else {
            // The last group: word w holds values w, w + m, ... below
            // v.len(); whatever is left above them must be zero.
            for (w, &word) in group.iter().enumerate() {
                let (mut x, len) = (word as u32, v.len());
                for j in (0..per).map(|d| d * m + w).filter(|&j| j < len) {
                    let q = div(x, inv);
                    v[j] = x - q * radix;
                    x = q;
                }
                fits &= x == 0;
            }
        }
    }
    fits
}

crate::isa::multiversion! {
    fn unpack_kernel[][](words: &[u16], radix: u32, per: usize, vals: &mut [u32]) -> bool = unpack_body;
}

/// Rows (of `GROUP` values) in a group of both layouts: the least common
/// multiple of their rows per group.
fn rows_of_both(lanes_per: usize, per: usize) -> usize {
    let (mut a, mut b) = (lanes_per, per);
    while b != 0 {
        (a, b) = (b, a % b);
    }
    lanes_per / a * per
}

/// Rows per parallel piece of a conversion: whole groups of both layouts,
/// so that every piece starts a group of each, of about `TASK_WORDS * 4`
/// values.
fn rows_per_piece(lanes_per: usize, per: usize) -> usize {
    let both = rows_of_both(lanes_per, per);
    both * (TASK_WORDS * 4 / GROUP / both).max(1)
}

/// Values that the conversions take row by row: whole groups of both
/// layouts, all in full groups of each. The rest (the tail) goes through
/// `pack` or `unpack`.
fn converted(n: usize, lanes_per: usize, per: usize) -> usize {
    let full = (n / (GROUP * lanes_per) * lanes_per).min(n / (GROUP * per) * per); // rows in full groups of both
    let both = rows_of_both(lanes_per, per);
    full / both * both * GROUP
}

/// Packs `n` values held in `lanes` of `width` bits (`lanes::place`'s
/// layout; each value below `radix`, the caller's to keep) into `out`
/// (`words_for(n, radix)` words), straight from lane to digit.
pub fn from_lanes(lanes: &[u64], width: u32, n: usize, radix: u32, out: &mut [u16]) {
    let (per, lanes_per) = (per_word(radix) as usize, (64 / width) as usize);
    assert!(radix as u64 - 1 < 1 << width && lanes.len() == super::lanes::words_for(n, width), "{n} values below {radix} in lanes of {width} bits");
    assert_eq!(out.len(), words_for(n, radix), "{n} values in base {radix}");
    let done = converted(n, lanes_per, per);
    let (body, tail) = out.split_at_mut(done / per);
    let isa = crate::isa::Isa::detect();
    crate::par::chunks_of(body, rows_per_piece(lanes_per, per) / per * GROUP, |first, words| {
        let rows = first / GROUP * per;
        let lanes = &lanes[rows / lanes_per * GROUP..(rows + words.len() / GROUP * per).div_ceil(lanes_per) * GROUP];
        from_lanes_kernel(isa, lanes, width, radix, per, words)
    });
    let mut vals = vec![0u32; n - done];
    super::lanes::unpack_serial(&lanes[done / lanes_per..], width, &mut vals, |v| v as u32).expect("the caller's lanes");
    pack(&vals, radix, tail);
}

/// `from_lanes` of one piece: `lanes` from the piece's first row (a group
/// of both layouts starts there), `words` whole groups of digits.
#[inline(always)]
fn from_lanes_body(lanes: &[u64], width: u32, radix: u32, per: usize, words: &mut [u16]) {
    let (lanes_per, mask) = ((64 / width) as usize, (1u64 << width) - 1);
    for (g, group) in words.chunks_exact_mut(GROUP).enumerate() {
        // Horner, from the top digit: row g * per + d of the piece.
        let mut acc = [0u32; GROUP];
        for d in (0..per).rev() {
            let row = g * per + d;
            let (src, shift) = (&lanes[row / lanes_per * GROUP..][..GROUP], width * (row % lanes_per) as u32);
            for (a, &w) in acc.iter_mut().zip(src) {
                *a = *a * radix + ((w >> shift) & mask) as u32;
            }
        }
        group.iter_mut().zip(acc).for_each(|(w, a)| *w = a as u16);
    }
}

crate::isa::multiversion! {
    fn from_lanes_kernel[][](lanes: &[u64], width: u32, radix: u32, per: usize, words: &mut [u16]) -> () = from_lanes_body;
}

/// Unpacks `n` values in base `radix` from `words` straight into lanes of
/// `width` bits (`lanes::place`'s layout), checking what `unpack` checks: a
/// part from the network.
pub fn to_lanes(words: &[u16], radix: u32, n: usize, width: u32) -> Result<Vec<u64>> {
    if !(2..=1 << 16).contains(&radix) || words.len() != words_for(n, radix) || !(1..=32).contains(&width) || radix as u64 > 1 << width {
        return Err(Error::Transport(format!("malformed message: {n} values in base {radix} in {} digit words, for lanes of {width} bits", words.len())));
    }
    let (per, lanes_per) = (per_word(radix) as usize, (64 / width) as usize);
    check_words(words, radix, per)?;
    let done = converted(n, lanes_per, per);
    let mut out = vec![0u64; super::lanes::words_for(n, width)];
    let (body, tail) = out.split_at_mut(done / lanes_per);
    let isa = crate::isa::Isa::detect();
    crate::par::chunks_of(body, rows_per_piece(lanes_per, per) / lanes_per * GROUP, |first, lanes| {
        let rows = first / GROUP * lanes_per;
        let words = &words[rows / per * GROUP..(rows + lanes.len() / GROUP * lanes_per) / per * GROUP];
        to_lanes_kernel(isa, words, radix, per, width, lanes)
    });
    let mut vals = vec![0u32; n - done];
    unpack(&words[done / per..], radix, &mut vals)?;
    super::lanes::pack_slice_into_words(&vals, width, |v| v as u64, tail);
    Ok(out)
}

/// `to_lanes` of one piece: `words` whole groups of digits from the piece's
/// first row, `lanes` (zeroed) whole groups of lanes from the same row.
#[inline(always)]
fn to_lanes_body(words: &[u16], radix: u32, per: usize, width: u32, lanes: &mut [u64]) {
    let (inv, lanes_per) = (1.0 / radix as f32, (64 / width) as usize);
    for (g, group) in words.chunks_exact(GROUP).enumerate() {
        let mut x = [0u32; GROUP];
        x.iter_mut().zip(group).for_each(|(x, &w)| *x = w as u32);
        for d in 0..per {
            let row = g * per + d;
            let (dst, shift) = (&mut lanes[row / lanes_per * GROUP..][..GROUP], width * (row % lanes_per) as u32);
            for (o, x) in dst.iter_mut().zip(x.iter_mut()) {
                let q = div(*x, inv);
                *o |= ((*x - q * radix) as u64) << shift;
                *x = q;
            }
        }
    }
}

crate::isa::multiversion! {
    fn to_lanes_kernel[][](words: &[u16], radix: u32, per: usize, width: u32, lanes: &mut [u64]) -> () = to_lanes_body;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_division_is_exact_for_every_16_bit_word() {
        let radices: Vec<u32> = if cfg!(debug_assertions) { (2..=40).chain([255, 256, 257, 1000, 65535, 65536]).collect() } else { (2..=300).chain([1000, 4097, 65535, 65536]).collect() };
        for radix in radices {
            let inv = 1.0 / radix as f32;
            for x in 0..1u32 << 16 {
                assert_eq!(div(x, inv), x / radix, "{x} / {radix}");
            }
        }
    }

    #[test]
    fn words_hold_what_fits_and_only_small_odd_ranges_are_denser() {
        assert_eq!([2, 3, 5, 9, 16, 17, 40, 41, 256, 257].map(per_word), [16, 10, 6, 5, 4, 3, 3, 2, 2, 1]);
        let dense: Vec<u32> = (2..=300).filter(|&r| denser(r)).collect();
        assert_eq!(dense, [3, 5, 6, 9, 33, 34, 35, 36, 37, 38, 39, 40]);
        // 1-bit summed over 2 workers: 3 values, 1.6 bits against 2
        assert_eq!((2 * words_for(1 << 24, 3), 8 * super::super::lanes::words_for(1 << 24, 2)), (3_355_444, 4_194_304));
    }

    /// The layout by its definition (`place`), one value at a time.
    fn reference(vals: &[u32], radix: u32) -> Vec<u16> {
        let mut words = vec![0u32; words_for(vals.len(), radix)];
        for (i, &v) in vals.iter().enumerate() {
            let (w, d) = place(i, vals.len(), radix);
            words[w] += v * radix.pow(d);
        }
        words.into_iter().map(|w| u16::try_from(w).unwrap()).collect()
    }

    #[test]
    fn packs_as_the_definition_places_and_unpacks_back() {
        for radix in [3u32, 5, 6, 9, 17, 40, 300, 65536] {
            let per = per_word(radix) as usize;
            let group = GROUP * per;
            for n in [0, 1, 2, per, per + 1, group - 1, group, group + 1, 3 * group + 7, TASK_WORDS * per + group + 3, 2 * TASK_WORDS * per] {
                let vals: Vec<u32> = (0..n).map(|i| ((i as u64 * 2_654_435_761) % radix as u64) as u32).collect();
                let want = reference(&vals, radix);
                let mut words = vec![0u16; words_for(n, radix)];
                pack(&vals, radix, &mut words);
                assert_eq!(words, want, "radix {radix} n {n}");
                let mut back = vec![u32::MAX; n];
                unpack(&words, radix, &mut back).unwrap();
                assert_eq!(back, vals, "radix {radix} n {n}");
                // the top value in every place
                let top = vec![radix - 1; n];
                pack(&top, radix, &mut words);
                unpack(&words, radix, &mut back).unwrap();
                assert_eq!(back, top, "radix {radix} n {n}");
            }
        }
    }

    #[test]
    fn every_kernel_packs_and_unpacks_the_same_words() {
        for radix in [3u32, 5, 9, 40, 65536] {
            let per = per_word(radix) as usize;
            for n in [1, GROUP * per - 1, GROUP * per, 5 * GROUP * per + per + 1] {
                let vals: Vec<u32> = (0..n).map(|i| ((i as u64 * 40_503) % radix as u64) as u32).collect();
                let want = reference(&vals, radix);
                for isa in crate::isa::Isa::available() {
                    let mut words = vec![0u16; want.len()];
                    pack_kernel(isa, &vals, radix, per, &mut words);
                    assert_eq!(words, want, "{isa:?} radix {radix} n {n}");
                    let mut back = vec![u32::MAX; n];
                    assert!(unpack_kernel(isa, &words, radix, per, &mut back));
                    assert_eq!(back, vals, "{isa:?} radix {radix} n {n}");
                }
            }
        }
    }

    #[test]
    fn lanes_convert_to_digits_and_back_as_the_values_would() {
        use super::super::lanes;
        for (radix, width) in [(3u32, 2u32), (3, 4), (5, 3), (6, 3), (9, 4), (13, 4), (40, 6), (300, 9), (65536, 17)] {
            let (per, lanes_per) = (per_word(radix) as usize, (64 / width) as usize);
            let both = GROUP * rows_of_both(lanes_per, per);
            let piece = GROUP * rows_per_piece(lanes_per, per);
            for n in [0, 1, GROUP * per, GROUP * lanes_per + 1, both - 1, both, both + 1, 3 * both + GROUP * per + 2, 2 * piece + both + 5] {
                let vals: Vec<u32> = (0..n).map(|i| (((i as u64 * 2_654_435_761) >> 7) % radix as u64) as u32).collect();
                let packed = lanes::pack_slice(&vals, width, |v| v as u64);
                let mut want = vec![0u16; words_for(n, radix)];
                pack(&vals, radix, &mut want);
                let mut words = vec![1u16; want.len()];
                from_lanes(&packed, width, n, radix, &mut words);
                assert_eq!(words, want, "radix {radix} width {width} n {n}");
                assert_eq!(to_lanes(&words, radix, n, width).unwrap(), packed, "radix {radix} width {width} n {n}");
            }
            // every kernel on the first pieces
            let n = piece + both;
            let vals: Vec<u32> = (0..n).map(|i| (i as u32 * 7 + i as u32 / 3) % radix).collect();
            let packed = lanes::pack_slice(&vals, width, |v| v as u64);
            let mut want = vec![0u16; words_for(n, radix)];
            pack(&vals, radix, &mut want);
            let rows = n / GROUP;
            for isa in crate::isa::Isa::available() {
                let mut words = vec![0u16; rows / per * GROUP];
                from_lanes_kernel(isa, &packed[..rows / lanes_per * GROUP], width, radix, per, &mut words);
                assert_eq!(words, want[..words.len()], "{isa:?} radix {radix}");
                let mut back = vec![0u64; rows / lanes_per * GROUP];
                to_lanes_kernel(isa, &want[..words.len()], radix, per, width, &mut back);
                assert_eq!(back, packed[..back.len()], "{isa:?} radix {radix}");
            }
        }
    }

    #[test]
    fn lanes_from_bad_digits_are_refused() {
        let n = 3 * GROUP * 5 * 16 + 7; // full groups of both, and a tail
        let mut words = vec![0u16; words_for(n, 9)];
        pack(&vec![8; n], 9, &mut words);
        assert!(to_lanes(&words, 9, n, 4).is_ok());
        let mut bad = words.clone();
        bad[3] = 59_049; // in the converted rows
        assert!(to_lanes(&bad, 9, n, 4).unwrap_err().to_string().contains("past 9^5"));
        let mut bad = words.clone();
        let last = bad.len() - 1; // the tail's last word holds fewer than 5 values
        bad[last] += 9u16.pow(4);
        assert!(to_lanes(&bad, 9, n, 4).unwrap_err().to_string().contains("more digits than values"));
        // wrong counts, and lanes too narrow for the radix
        assert!(to_lanes(&words[1..], 9, n, 4).is_err());
        assert!(to_lanes(&words, 9, n + 5, 4).is_err());
        assert!(to_lanes(&words, 9, n, 3).is_err());
        assert!(to_lanes(&words, 9, n, 0).is_err());
    }

    #[test]
    fn words_that_hold_more_than_their_digits_are_refused() {
        let mut back = vec![0u32; 40];
        let mut words = vec![0u16; words_for(40, 9)];
        pack(&[8; 40], 9, &mut words);
        // a full word past 9^5
        let mut bad = words.clone();
        bad[0] = 59_049;
        assert!(unpack(&bad, 9, &mut back).unwrap_err().to_string().contains("past 9^5"));
        // the last group (40 values: 8 words of 5 digits, all full) is fine;
        // 38 values leave two words with 4 digits, whose fifth must be zero
        let mut words = vec![0u16; words_for(38, 9)];
        pack(&[8; 38], 9, &mut words);
        let (_, d) = place(37, 38, 9);
        assert_eq!(d, 4);
        let short = (0..words.len()).find(|&w| (w..38).step_by(words.len()).count() == 4).unwrap();
        words[short] += 9u16.pow(4);
        let mut back = vec![0u32; 38];
        assert!(unpack(&words, 9, &mut back).unwrap_err().to_string().contains("more digits than values"));
        // wrong word count, radix out of range
        assert!(unpack(&[0; 3], 9, &mut [0; 40]).is_err());
        assert!(unpack(&[0; 40], 1, &mut [0; 40]).is_err());
    }
}
