//! KVStore keys: ints or strings, never mixed in one store.

use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Key {
    Int(i64),
    Str(String),
}

impl Key {
    pub fn is_str(&self) -> bool {
        matches!(self, Key::Str(_))
    }

    /// Refuses a key no store may create: a str holding NUL, which C strings
    /// would cut onto another key ('w\0evil' -> 'w'). Checked by every init.
    pub fn check(&self) -> crate::error::Result<()> {
        match self {
            Key::Str(s) if s.contains('\0') => Err(crate::error::Error::Key {
                key: self.to_string(),
                problem: format!("string keys cannot contain NUL (found at byte {})", s.find('\0').unwrap_or(0)),
            }),
            _ => Ok(()),
        }
    }

    /// FNV-1a of the key: the same on every worker and process (std's hasher
    /// is seeded per process), for placing keys on servers and seeding noise.
    pub fn stable_hash(&self) -> u64 {
        let bytes: Vec<u8> = match self {
            Key::Int(k) => k.to_le_bytes().to_vec(),
            Key::Str(s) => s.as_bytes().to_vec(),
        };
        bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ *b as u64).wrapping_mul(0x0000_0100_0000_01b3))
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Key::Int(k) => write!(f, "{k}"),
            // Escaped, so a NUL or control character never cuts or garbles a message.
            Key::Str(k) => write!(f, "'{}'", k.escape_debug()),
        }
    }
}

impl From<i64> for Key {
    fn from(k: i64) -> Key {
        Key::Int(k)
    }
}

impl From<&str> for Key {
    fn from(k: &str) -> Key {
        Key::Str(k.to_string())
    }
}
