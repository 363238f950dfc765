//! Leaf values (hashes, ints, strings, floats) and the lists of them: one scalar visitor, then
//! plain conversions that are liberal in integer and float widths and strict in kinds.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, Expected, SeqAccess, Visitor};

use crate::error::Path;

/// Largest capacity reserved from a length prefix: a hostile prefix must not allocate gigabytes
/// before the (short) payload runs out. Longer lists still decode, by growing.
pub(crate) const MAX_PREALLOC: usize = 4096;

/// Rejects every non-container kind (and maps, with `map`) with "expected X, got Y". For the
/// container visitors; `Y` never quotes the value, so a huge string stays out of the message.
macro_rules! reject_scalars {
    () => {
        fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Err($crate::leaf::wrong_kind(&self, "a boolean"))
        }
        fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Err($crate::leaf::wrong_kind(&self, "an integer"))
        }
        fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Err($crate::leaf::wrong_kind(&self, "an integer"))
        }
        fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Err($crate::leaf::wrong_kind(&self, "a float"))
        }
        fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<Self::Value, E> {
            Err($crate::leaf::wrong_kind(&self, "a string"))
        }
        fn visit_bytes<E: serde::de::Error>(self, _: &[u8]) -> Result<Self::Value, E> {
            Err($crate::leaf::wrong_kind(&self, "bytes"))
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Err($crate::leaf::wrong_kind(&self, "nil"))
        }
        fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Err($crate::leaf::wrong_kind(&self, "nil"))
        }
        fn visit_newtype_struct<D: serde::Deserializer<'de>>(self, _: D) -> Result<Self::Value, D::Error> {
            Err($crate::leaf::wrong_kind(&self, "a msgpack extension"))
        }
    };
    (map) => {
        $crate::leaf::reject_scalars!();
        fn visit_map<A: serde::de::MapAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
            Err($crate::leaf::wrong_kind(&self, "a map"))
        }
    };
}
pub(crate) use reject_scalars;

/// "expected {what the visitor wants}, got {kind}".
pub(crate) fn wrong_kind<E: de::Error>(expected: &dyn Expected, got: &str) -> E {
    E::custom(format_args!("expected {expected}, got {got}"))
}

/// One msgpack scalar, integers widened to `i128` so every width compares the same way.
#[derive(Debug)]
pub(crate) enum Scalar<'de> {
    Nil,
    Bool,
    Int(i128),
    Float(f64),
    Str(Cow<'de, str>),
    Bytes(Cow<'de, [u8]>),
}

/// A value that is not what its field holds; becomes "expected X, got Y".
#[derive(Debug)]
pub(crate) struct Mismatch {
    expected: &'static str,
    got: Got,
}

#[derive(Debug)]
enum Got {
    Kind(&'static str),
    Int(i128),
}

impl Mismatch {
    pub(crate) fn new(expected: &'static str, got: &Scalar<'_>) -> Mismatch {
        let got = match got {
            Scalar::Nil => Got::Kind("nil"),
            Scalar::Bool => Got::Kind("a boolean"),
            Scalar::Int(v) => Got::Int(*v),
            Scalar::Float(_) => Got::Kind("a float"),
            Scalar::Str(_) => Got::Kind("a string"),
            Scalar::Bytes(_) => Got::Kind("bytes"),
        };
        Mismatch { expected, got }
    }

    pub(crate) fn into_error<E: de::Error>(self) -> E {
        match self.got {
            Got::Kind(kind) => E::custom(format_args!("expected {}, got {kind}", self.expected)),
            Got::Int(v) => E::custom(format_args!("expected {}, got {v}", self.expected)),
        }
    }
}

/// Seed for one scalar; `expected` names the field's type for kind errors on containers.
pub(crate) struct Leaf(pub(crate) &'static str);

impl<'de> DeserializeSeed<'de> for Leaf {
    type Value = Scalar<'de>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Scalar<'de>, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Leaf {
    type Value = Scalar<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Scalar<'de>, E> {
        Ok(Scalar::Bool)
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Scalar<'de>, E> {
        Ok(Scalar::Int(v.into()))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Scalar<'de>, E> {
        Ok(Scalar::Int(v.into()))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Scalar<'de>, E> {
        Ok(Scalar::Float(v))
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Scalar<'de>, E> {
        Ok(Scalar::Str(Cow::Borrowed(v)))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Scalar<'de>, E> {
        Ok(Scalar::Str(Cow::Owned(v.to_owned())))
    }
    fn visit_borrowed_bytes<E: de::Error>(self, v: &'de [u8]) -> Result<Scalar<'de>, E> {
        Ok(Scalar::Bytes(Cow::Borrowed(v)))
    }
    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Scalar<'de>, E> {
        Ok(Scalar::Bytes(Cow::Owned(v.to_owned())))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Scalar<'de>, E> {
        Ok(Scalar::Nil)
    }
    fn visit_none<E: de::Error>(self) -> Result<Scalar<'de>, E> {
        Ok(Scalar::Nil)
    }
    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Scalar<'de>, D::Error> {
        deserializer.deserialize_any(self)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<Scalar<'de>, A::Error> {
        Err(wrong_kind(&self, "an array"))
    }
    fn visit_map<A: de::MapAccess<'de>>(self, _: A) -> Result<Scalar<'de>, A::Error> {
        Err(wrong_kind(&self, "a map"))
    }
    fn visit_newtype_struct<D: Deserializer<'de>>(self, _: D) -> Result<Scalar<'de>, D::Error> {
        Err(wrong_kind(&self, "a msgpack extension"))
    }
}

/// How each kind of field is named in "expected X" messages.
pub(crate) mod text {
    pub(crate) const HASH: &str = "a block hash (an integer or bytes)";
    pub(crate) const OPT_HASH: &str = "a block hash (an integer or bytes) or nil";
    pub(crate) const TOKEN_ID: &str = "a token id (an integer in 0..=4294967295)";
    pub(crate) const BLOCK_SIZE: &str = "a block size (an integer in 1..=4294967295)";
    pub(crate) const OPT_U32: &str = "an integer in 0..=4294967295 or nil";
    pub(crate) const OPT_I64: &str = "a 64-bit signed integer or nil";
    pub(crate) const OPT_STRING: &str = "a string or nil";
    pub(crate) const TS: &str = "a timestamp (a number)";
    pub(crate) const TAG: &str = "an event type name (a string)";
    pub(crate) const FIELD_NAME: &str = "a field name (a string)";
}

pub(crate) const HASH: Field<u64> = Field { expected: text::HASH, convert: hash };
pub(crate) const OPT_HASH: Field<Option<u64>> = Field { expected: text::OPT_HASH, convert: opt_hash };
pub(crate) const TOKEN_ID: Field<u32> = Field { expected: text::TOKEN_ID, convert: token_id };
pub(crate) const BLOCK_SIZE: Field<u32> = Field { expected: text::BLOCK_SIZE, convert: block_size };
pub(crate) const OPT_U32: Field<Option<u32>> = Field { expected: text::OPT_U32, convert: opt_u32 };
pub(crate) const OPT_I64: Field<Option<i64>> = Field { expected: text::OPT_I64, convert: opt_i64 };
pub(crate) const OPT_STRING: Field<Option<String>> =
    Field { expected: text::OPT_STRING, convert: opt_string };
pub(crate) const TS: Field<f64> = Field { expected: text::TS, convert: ts };

/// An engine block hash: an integer as its 64-bit pattern, bytes folded with xxh3-64.
fn hash(value: Scalar<'_>) -> Result<u64, Mismatch> {
    match value {
        // Negative hashes (older vLLM's Python `hash()`) keep their two's-complement bits.
        Scalar::Int(v) if (i128::from(i64::MIN)..=i128::from(u64::MAX)).contains(&v) => Ok(v as u64),
        Scalar::Bytes(bytes) => Ok(crate::block_hash_from_bytes(&bytes)),
        other => Err(Mismatch::new(text::HASH, &other)),
    }
}

fn opt_hash(value: Scalar<'_>) -> Result<Option<u64>, Mismatch> {
    match value {
        Scalar::Nil => Ok(None),
        Scalar::Int(_) | Scalar::Bytes(_) => hash(value).map(Some),
        other => Err(Mismatch::new(text::OPT_HASH, &other)),
    }
}

fn u32_at_least(value: Scalar<'_>, min: u32, expected: &'static str) -> Result<u32, Mismatch> {
    match value {
        Scalar::Int(v) if v >= i128::from(min) => {
            u32::try_from(v).map_err(|_| Mismatch::new(expected, &value))
        }
        other => Err(Mismatch::new(expected, &other)),
    }
}

fn token_id(value: Scalar<'_>) -> Result<u32, Mismatch> {
    u32_at_least(value, 0, text::TOKEN_ID)
}

fn block_size(value: Scalar<'_>) -> Result<u32, Mismatch> {
    u32_at_least(value, 1, text::BLOCK_SIZE)
}

fn opt_u32(value: Scalar<'_>) -> Result<Option<u32>, Mismatch> {
    match value {
        Scalar::Nil => Ok(None),
        other => u32_at_least(other, 0, text::OPT_U32).map(Some),
    }
}

fn opt_i64(value: Scalar<'_>) -> Result<Option<i64>, Mismatch> {
    match value {
        Scalar::Nil => Ok(None),
        Scalar::Int(v) => i64::try_from(v).map(Some).map_err(|_| Mismatch::new(text::OPT_I64, &value)),
        other => Err(Mismatch::new(text::OPT_I64, &other)),
    }
}

fn opt_string(value: Scalar<'_>) -> Result<Option<String>, Mismatch> {
    match value {
        Scalar::Nil => Ok(None),
        Scalar::Str(s) => Ok(Some(s.into_owned())),
        other => Err(Mismatch::new(text::OPT_STRING, &other)),
    }
}

/// The batch timestamp: a float of either width, or an integer (some encoders drop `.0`).
fn ts(value: Scalar<'_>) -> Result<f64, Mismatch> {
    match value {
        Scalar::Float(v) => Ok(v),
        Scalar::Int(v) => Ok(v as f64),
        other => Err(Mismatch::new(text::TS, &other)),
    }
}

/// A scalar field as a seed: `expected` for kind errors, `convert` for the value.
pub(crate) struct Field<T> {
    pub(crate) expected: &'static str,
    pub(crate) convert: fn(Scalar<'_>) -> Result<T, Mismatch>,
}

impl<T> Clone for Field<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Field<T> {}

impl<'de, T> DeserializeSeed<'de> for Field<T> {
    type Value = T;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<T, D::Error> {
        (self.convert)(Leaf(self.expected).deserialize(deserializer)?).map_err(Mismatch::into_error)
    }
}

/// A msgpack array of scalars; tracks the element index in the path.
pub(crate) struct List<'p, T> {
    pub(crate) path: &'p Path,
    /// The list's description, e.g. "an array of token ids".
    pub(crate) expected: &'static str,
    pub(crate) element: Field<T>,
}

impl<'de, T> DeserializeSeed<'de> for List<'_, T> {
    type Value = Vec<T>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Vec<T>, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de, T> Visitor<'de> for List<'_, T> {
    type Value = Vec<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.expected)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(MAX_PREALLOC));
        loop {
            self.path.element.set(Some(out.len()));
            match seq.next_element_seed(self.element)? {
                Some(value) => out.push(value),
                None => break,
            }
        }
        self.path.element.set(None);
        Ok(out)
    }

    reject_scalars!(map);
}

pub(crate) fn hash_list(path: &Path) -> List<'_, u64> {
    List { path, expected: "an array of block hashes", element: HASH }
}

pub(crate) fn token_list(path: &Path) -> List<'_, u32> {
    List { path, expected: "an array of token ids", element: TOKEN_ID }
}
