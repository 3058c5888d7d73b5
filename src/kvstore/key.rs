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
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Key::Int(k) => write!(f, "{k}"),
            Key::Str(k) => write!(f, "'{k}'"),
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
