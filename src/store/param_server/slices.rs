//! Where a key lives on the servers (ps-lite's slicer in KVWorker): its
//! slices, each one server's part, and the check of a server's reply about
//! them. Keys of at least `bigarray_bound` elements are split over every
//! server in slices whose boundaries are multiples of 16 (and, under a
//! scheme, of its lane groups); smaller keys live on one server chosen by a
//! hash of the key that every worker computes alike. A split scheme key (but
//! PowerSGD's) is cut into slices of at most `partition_bytes`, dealt round
//! the servers.

use std::sync::Arc;

use super::counts;
use super::message::{Command, Flag, Message, Meta};
use crate::error::Error;
use crate::quant::compression::Compression;
use crate::quant::scheme;
use crate::store::Key;

/// The check of a reply about `slices` as it arrives (`customer::Check`):
/// from a slice's server about that slice, with a payload in the form its
/// flags say (a pull's float32, code counts or scheme value; an exchange's
/// part). One that fails is dropped and counted; the real one still comes.
pub fn reply_check(slices: &[Slice]) -> super::customer::Check {
    let slices: Vec<(i32, u64, u64)> = slices.iter().map(|s| (s.server, s.offset as u64, s.len as u64)).collect();
    Arc::new(move |r: &Message| {
        let (m, data) = (&r.meta, &r.data[..]);
        if !slices.contains(&(m.sender, m.offset, m.len)) {
            return Err(Error::Transport(format!("malformed message: a reply about elements {}..+{}, which node {} holds no slice of", m.offset, m.len, m.sender)));
        }
        if m.has(Flag::SchemeValue) {
            scheme::value_from_wire(data).map(drop)
        } else if m.has(Flag::CodeCounts) {
            counts::validate(data, m.len as usize).map(drop)
        } else if data.is_empty() || data.len() as u64 == m.len.saturating_mul(4) {
            Ok(())
        } else {
            scheme::from_wire(data).map(drop)
        }
    })
}

/// One server's part of a key.
#[derive(Clone, Debug, PartialEq)]
pub struct Slice {
    pub server: i32,
    pub offset: usize,
    pub len: usize,
}

impl Slice {
    /// The header of a request about this slice of `key`.
    pub fn meta(&self, command: Command, key: &Key) -> Meta {
        let mut m = Meta::new(command, 0);
        m.key = Some(key.clone());
        m.offset = self.offset as u64;
        m.len = self.len as u64;
        m
    }

    /// The header of a scheme round's push about this slice of `key`:
    /// `flags` (the kind of push) and `body` (the round's step and phase).
    pub fn round_meta(&self, key: &Key, flags: &[Flag], body: &str) -> Meta {
        let mut m = self.meta(Command::Push, key);
        flags.iter().for_each(|&f| m.set(f));
        m.body = body.to_string();
        m
    }
}

/// Where each part of a key of `n` elements lives: a key of at least
/// `bigarray_bound` elements in `per_server` slices per server (dealt round
/// the servers in order), each starting at a multiple of 16 and of `align`.
pub fn slices_for(key: &Key, n: usize, servers: &[i32], bigarray_bound: usize, align: usize, per_server: usize) -> Vec<Slice> {
    if n >= bigarray_bound && servers.len() > 1 {
        let step = lcm(16, align.max(1));
        let parts = servers.len() * per_server.max(1);
        let per = n.div_ceil(parts).div_ceil(step) * step;
        (0..parts)
            .map(|i| (servers[i % servers.len()], (i * per).min(n), ((i + 1) * per).min(n)))
            .filter(|(_, lo, hi)| hi > lo)
            .map(|(server, lo, hi)| Slice { server, offset: lo, len: hi - lo })
            .collect()
    } else {
        vec![Slice { server: servers[(key.stable_hash() % servers.len() as u64) as usize], offset: 0, len: n }]
    }
}

/// Slices per server of a split key of `n` elements: several for a scheme
/// whose final codes dominate its traffic (every one but PowerSGD), so that
/// the servers answer one slice's round while the next slice is pushed;
/// slices of at most `partition_bytes` of float32. One otherwise.
pub fn slices_per_server(compression: &Compression, n: usize, servers: usize, partition_bytes: usize) -> usize {
    if !compression.is_scheme() || matches!(compression, Compression::PowerSgd { .. }) || servers == 0 {
        return 1;
    }
    let parts = (n as u128 * 4).div_ceil(partition_bytes.max(4) as u128);
    (parts.div_ceil(servers as u128) as usize).clamp(1, 1 << 10)
}

fn lcm(a: usize, b: usize) -> usize {
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    a / gcd(a, b) * b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn big_keys_split_on_multiples_of_16() {
        let servers = [8, 10, 12];
        let s = slices_for(&Key::Int(0), 1_000_003, &servers, 1_000_000, 1, 1);
        assert_eq!(s.len(), 3);
        assert_eq!(s.iter().map(|x| x.len).sum::<usize>(), 1_000_003);
        for w in s.windows(2) {
            assert_eq!(w[0].offset + w[0].len, w[1].offset);
            assert_eq!(w[1].offset % 16, 0);
        }
        let small = slices_for(&Key::Str("w".into()), 10, &servers, 1_000_000, 1, 1);
        assert_eq!(small.len(), 1);
        assert_eq!(small, slices_for(&Key::Str("w".into()), 10, &servers, 1_000_000, 1, 1));
        // tiny arrays over many servers: no empty slices
        let t = slices_for(&Key::Int(1), 20, &servers, 1, 1, 1);
        assert!(t.iter().all(|x| x.len > 0) && t.iter().map(|x| x.len).sum::<usize>() == 20);
        // A scheme's slices start on its lane groups (168 values at width 3) and on 16.
        let a = slices_for(&Key::Int(2), 100_000, &servers, 1000, 168, 1);
        assert_eq!(a.iter().map(|x| x.len).sum::<usize>(), 100_000);
        assert!(a.len() == 3 && a.iter().all(|x| x.offset % 336 == 0), "{a:?}");
        // Several slices per server, dealt round them in order, still whole and aligned.
        let p = slices_for(&Key::Int(3), 1_000_003, &servers, 1000, 168, 4);
        assert_eq!(p.len(), 12);
        assert_eq!(p.iter().map(|x| x.server).collect::<Vec<_>>(), [8, 10, 12].repeat(4));
        assert_eq!((p[0].offset, p.last().map(|x| x.offset + x.len)), (0, Some(1_000_003)));
        assert!(p.windows(2).all(|w| w[0].offset + w[0].len == w[1].offset && w[1].offset % 336 == 0), "{p:?}");
    }

    #[test]
    fn only_split_scheme_keys_but_powersgd_take_several_slices_per_server() {
        let qsgd = Compression::from_params([("compress", "qsgd_mn"), ("bits", "2")]).unwrap();
        let n = 16 << 20;
        // 64 MiB of float32 in 4 MiB slices over 2 servers; a partial slice counts
        assert_eq!(slices_per_server(&qsgd, n, 2, 4 << 20), 8);
        assert_eq!(slices_per_server(&qsgd, n + 1, 2, 4 << 20), 9);
        assert_eq!(slices_per_server(&qsgd, n, 2, usize::MAX), 1);
        assert_eq!(slices_per_server(&qsgd, n, 2, 0), 1 << 10);
        for other in [Compression::None, Compression::from_params([("compress", "powersgd"), ("rank", "4")]).unwrap(), Compression::from_params([("compress", "2bit"), ("threshold", "0.5")]).unwrap()] {
            assert_eq!(slices_per_server(&other, n, 2, 4 << 20), 1, "{other:?}");
        }
    }
}
