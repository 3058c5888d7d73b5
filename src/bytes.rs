//! Little-endian binary formats: the one cursor every format here reads with
//! (message headers, optimizer and compression state blobs, scheme values),
//! and the writers that make them. A cursor never reads past its slice; what
//! a short or malformed input becomes is the caller's error (`fail`).

use crate::error::{Error, Result};

pub struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    fail: fn(&str) -> Error,
}

impl<'a> Reader<'a> {
    /// A cursor over `bytes`; `fail` turns a problem ("truncated", "3
    /// trailing bytes", a caller's own) into the format's error.
    pub fn new(bytes: &'a [u8], fail: fn(&str) -> Error) -> Reader<'a> {
        Reader { bytes, pos: 0, fail }
    }

    pub fn error(&self, problem: &str) -> Error {
        (self.fail)(problem)
    }

    pub fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len()).ok_or_else(|| self.error("truncated"))?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    pub fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap()))
    }

    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }

    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }

    /// A length written as u64, checked to fit in memory before anything is
    /// allocated for it: at most the bytes left, `unit` bytes per item.
    pub fn len(&mut self, unit: usize) -> Result<usize> {
        let n = self.u64()?;
        let left = (self.bytes.len() - self.pos) as u64;
        if n.checked_mul(unit as u64).is_none_or(|b| b > left) {
            return Err(self.error(&format!("truncated: a length of {n} exceeds the {left} bytes left")));
        }
        Ok(n as usize)
    }

    /// `put_f32s`'s form: a u64 count, then the values' bits.
    pub fn f32s(&mut self) -> Result<Vec<f32>> {
        let n = self.len(4)?;
        Ok(self.take(4 * n)?.chunks_exact(4).map(|c| f32::from_bits(u32::from_le_bytes(c.try_into().unwrap()))).collect())
    }

    /// `put_str`'s form: a u32 length, then UTF-8.
    pub fn str(&mut self) -> Result<&'a str> {
        let n = self.u32()? as usize;
        let raw = self.take(n)?;
        std::str::from_utf8(raw).map_err(|_| self.error("a string that is not UTF-8"))
    }

    /// Bytes not read yet.
    pub fn left(&self) -> usize {
        self.bytes.len() - self.pos
    }

    /// The end: an error when bytes are left over.
    pub fn finish(&self) -> Result<()> {
        match self.left() {
            0 => Ok(()),
            n => Err(self.error(&format!("{n} trailing bytes"))),
        }
    }
}

pub fn put_u32(out: &mut Vec<u8>, x: u32) {
    out.extend(x.to_le_bytes());
}

pub fn put_u64(out: &mut Vec<u8>, x: u64) {
    out.extend(x.to_le_bytes());
}

pub fn put_f32s(out: &mut Vec<u8>, v: &[f32]) {
    put_u64(out, v.len() as u64);
    out.reserve(4 * v.len());
    v.iter().for_each(|x| out.extend(x.to_bits().to_le_bytes()));
}

pub fn put_str(out: &mut Vec<u8>, s: &str) {
    put_u32(out, s.len() as u32);
    out.extend(s.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fail(p: &str) -> Error {
        Error::Store(format!("test blob: {p}"))
    }

    #[test]
    fn round_trips_and_refuses_short_or_oversized_input() {
        let mut out = Vec::new();
        put_u32(&mut out, 7);
        put_f32s(&mut out, &[1.5, -0.0, f32::MAX]);
        put_str(&mut out, "w");
        let mut r = Reader::new(&out, fail);
        assert_eq!(r.u32().unwrap(), 7);
        assert_eq!(r.f32s().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>(), [1.5f32, -0.0, f32::MAX].map(f32::to_bits));
        assert_eq!(r.str().unwrap(), "w");
        r.finish().unwrap();
        // Truncated anywhere: an error, never a panic.
        for cut in 0..out.len() {
            let mut r = Reader::new(&out[..cut], fail);
            let parsed = r.u32().and_then(|_| r.f32s()).and_then(|_| r.str().map(|_| ()));
            assert!(parsed.is_err(), "cut at {cut}");
        }
        // A count of 2^61 floats in a short blob is refused before allocating.
        let mut huge = Vec::new();
        put_u64(&mut huge, 1 << 61);
        let err = Reader::new(&huge, fail).f32s().unwrap_err().to_string();
        assert!(err.contains("exceeds the 0 bytes left"), "{err}");
        let mut r = Reader::new(&out, fail);
        r.u32().unwrap();
        assert_eq!(r.finish().unwrap_err().to_string(), "test blob: 25 trailing bytes");
    }
}
