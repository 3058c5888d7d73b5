//! The code-count encoding of a value that is a sum of 2-bit pushes.
//!
//! When a server's value is the sum of pushed 2-bit arrays (no optimizer), it
//! keeps, per element, how many workers sent `pos_threshold` (p) and how many
//! sent `neg_threshold` (q); the value is then exactly `p·pos + q·neg` in
//! float32, whatever order the pushes arrived in. A pull of such a value
//! sends (p, q) in `bits` bits each instead of 32-bit floats, and the worker
//! rebuilds the same float32 values bit for bit: pulls stay lossless.
//!
//! Payload: `pos` (f32), `neg` (f32), `bits` (u32), then the counts in
//! `lanes` of `2·bits` bits, one element's pair per lane (p in the low
//! `bits`), little-endian 64-bit words: the one packed form of the crate.

use crate::codec::{self, Thresholds};
use crate::par;
use crate::quant::lanes;
use crate::error::{Error, Result};


/// The float32 value of `p` positive and `q` negative codes.
#[inline(always)]
pub fn value_of(p: u8, q: u8, th: Thresholds) -> f32 {
    p as f32 * th.pos() + q as f32 * th.neg()
}

/// Adds the codes of a validated 2-bit array into the counts (or sets them
/// when `first`). The caller checked the array with `codec::check_compressed`.
pub fn add_codes(compr: &[f32], pos: &mut [u8], neg: &mut [u8], first: bool) {
    let blocks = codec::blocks(compr);
    // Code 0b11 never occurs in a checked array, so p = code & 1 and q = code >> 1.
    let work = |blocks: &[u32], p: &mut [u8], q: &mut [u8]| {
        for ((&w, p16), q16) in blocks.iter().zip(p.chunks_mut(16)).zip(q.chunks_mut(16)) {
            for (j, (pj, qj)) in p16.iter_mut().zip(q16.iter_mut()).enumerate() {
                let code = (w >> (30 - 2 * j as u32)) & 0b11;
                if first {
                    *pj = (code & 1) as u8;
                    *qj = (code >> 1) as u8;
                } else {
                    *pj += (code & 1) as u8;
                    *qj += (code >> 1) as u8;
                }
            }
        }
    };
    // Pieces start at multiples of 16: whole blocks.
    par::chunks2(pos, neg, |start, p, q| work(&blocks[start / 16..], p, q));
}

/// Writes `value[i] = p[i]·pos + q[i]·neg`.
pub fn values(pos: &[u8], neg: &[u8], th: Thresholds, value: &mut [f32]) {
    let work = |p: &[u8], q: &[u8], v: &mut [f32]| v.iter_mut().zip(p.iter().zip(q)).for_each(|(v, (&p, &q))| *v = value_of(p, q, th));
    par::chunks(value, |start, v| work(&pos[start..start + v.len()], &neg[start..start + v.len()], v));
}

/// Bits per count for up to `max` workers.
pub fn bits_for(max: usize) -> u32 {
    (usize::BITS - max.leading_zeros()).max(1)
}

const HEADER: usize = 12;

/// Packs the counts (each at most `2^bits - 1`) into a pull payload: each
/// element's pair in one lane of `2 * bits` bits (`lanes`).
pub fn encode(pos: &[u8], neg: &[u8], th: Thresholds, bits: u32) -> Vec<u8> {
    let n = pos.len();
    let width = 2 * bits;
    let mut out = Vec::with_capacity(HEADER + 8 * lanes::words_for(n, width));
    out.extend(th.pos().to_bits().to_le_bytes());
    out.extend(th.neg().to_bits().to_le_bytes());
    out.extend(bits.to_le_bytes());
    out.resize(HEADER + 8 * lanes::words_for(n, width), 0);
    lanes::pack_into_bytes(n, width, |i| pos[i] as u64 | (neg[i] as u64) << bits, &mut out[HEADER..]);
    out
}

/// Checks a code-count payload for `n` elements; returns its thresholds and bits.
pub fn validate(payload: &[u8], n: usize) -> Result<(Thresholds, u32)> {
    let bad = |what: String| Error::Transport(format!("malformed message: code-count payload: {what}"));
    if payload.len() < HEADER {
        return Err(bad(format!("{} bytes", payload.len())));
    }
    let word = |i: usize| u32::from_le_bytes(payload[i..i + 4].try_into().unwrap());
    let th = Thresholds::new(f32::from_bits(word(4)), f32::from_bits(word(0)))?;
    let bits = word(8);
    if !(1..=8).contains(&bits) {
        return Err(bad(format!("{bits} bits per count")));
    }
    let words = lanes::words_for(n, 2 * bits);
    if (payload.len() - HEADER) as u128 != 8 * words as u128 {
        return Err(bad(format!("{} bytes of counts for {n} elements", payload.len() - HEADER)));
    }
    Ok((th, bits))
}

/// Rebuilds the float32 values of a code-count payload into `value`.
/// Checks the header and length before writing anything.
pub fn decode(payload: &[u8], value: &mut [f32]) -> Result<()> {
    let (th, bits) = validate(payload, value.len())?;
    let mask = (1u64 << bits) - 1;
    lanes::unpack_bytes_into(&payload[HEADER..], 2 * bits, value, |pair| value_of((pair & mask) as u8, ((pair >> bits) & mask) as u8, th))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_round_trip_bit_for_bit() {
        let th = Thresholds::new(-0.3, 0.7).unwrap();
        for (n, workers) in [(1usize, 1usize), (17, 2), (1000, 3), (par::CHUNK * 3 + 5, 2), (100_003, 15)] {
            let pos: Vec<u8> = (0..n).map(|i| ((i * 7) % (workers + 1)) as u8).collect();
            let neg: Vec<u8> = (0..n).map(|i| ((i * 3) % (workers + 1 - pos[i] as usize)) as u8).collect();
            let mut want = vec![0f32; n];
            values(&pos, &neg, th, &mut want);
            let payload = encode(&pos, &neg, th, bits_for(workers));
            let mut got = vec![f32::NAN; n];
            decode(&payload, &mut got).unwrap();
            assert_eq!(got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), "n={n}");
            assert!(payload.len() < 4 * n / 2 || n < 100, "{} bytes for {n}", payload.len());
            let mut short = vec![0f32; n + 64];
            assert!(decode(&payload, &mut short).is_err());
        }
    }

    #[test]
    fn add_codes_counts_each_code() {
        let th = Thresholds::new(-0.5, 0.5).unwrap();
        let n = 40;
        let mut c1 = codec::create_2bit(n);
        let mut c2 = codec::create_2bit(n);
        let g1: Vec<f32> = (0..n).map(|i| [0.6f32, -0.6, 0.0][i % 3]).collect();
        let g2: Vec<f32> = (0..n).map(|i| [0.6f32, 0.6, -0.6, 0.1][i % 4]).collect();
        codec::quantize_2bit(&g1, &mut vec![0.0; n], &mut c1, th).unwrap();
        codec::quantize_2bit(&g2, &mut vec![0.0; n], &mut c2, th).unwrap();
        let (mut p, mut q) = (vec![9u8; n], vec![9u8; n]);
        add_codes(&c1, &mut p, &mut q, true);
        add_codes(&c2, &mut p, &mut q, false);
        let mut v = vec![0f32; n];
        values(&p, &q, th, &mut v);
        let mut want = vec![0f32; n];
        codec::dequantize_2bit(&c1, &mut want).unwrap();
        codec::dequantize_2bit_add(&c2, &mut want).unwrap();
        assert_eq!(v, want);
    }
}
