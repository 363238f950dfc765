//! Leaf values (hashes, ints, strings, floats) and lists of them: one scalar visitor, then plain
//! conversions that are liberal in integer and float widths and strict in kinds.
//!
//! Every seed here reads its whole value, whatever it holds, and reports a value it cannot use
//! as a [`Problem`] inside `Ok`: a bad field spoils its own event, never the position in the
//! stream. Only the msgpack layer's own errors (truncation, invalid markers) are `Err`.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// Largest capacity reserved from a length prefix: a hostile prefix must not allocate gigabytes
/// before the (short) payload runs out. Longer lists still decode, by growing.
pub(crate) const MAX_PREALLOC: usize = 4096;

/// What was wrong with one field's value: "expected X, got Y", and the list element if any.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Problem {
    pub(crate) element: Option<usize>,
    pub(crate) message: String,
}

impl Problem {
    pub(crate) fn new(message: impl Into<String>) -> Self {
        Problem { element: None, message: message.into() }
    }

    /// "expected {expected}, got {got}".
    pub(crate) fn wrong_kind(expected: &dyn fmt::Display, got: &str) -> Self {
        Problem::new(format!("expected {expected}, got {got}"))
    }
}

/// A field's value, or what was wrong with it.
pub(crate) type Checked<T> = Result<T, Problem>;

/// Reads and drops every element of an array (after a problem, or for an unwanted value).
pub(crate) fn drain_seq<'de, A: SeqAccess<'de>>(seq: &mut A) -> Result<(), A::Error> {
    while seq.next_element::<IgnoredAny>()?.is_some() {}
    Ok(())
}

pub(crate) fn drain_map<'de, A: MapAccess<'de>>(map: &mut A) -> Result<(), A::Error> {
    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
    Ok(())
}

/// Implements every `visit_*` a container visitor does not want as "expected X, got Y" (the
/// value read to its end). For the list visitors, whose value is `Checked<_>`; `Y` never quotes
/// the value, so a huge string stays out of the message.
macro_rules! not_this_kind {
    () => {
        $crate::leaf::not_this_kind!(@int);
        $crate::leaf::not_this_kind!(@nil);
        $crate::leaf::not_this_kind!(@rest);
    };
    (nil) => {
        $crate::leaf::not_this_kind!(@int);
        $crate::leaf::not_this_kind!(@rest);
    };
    (int) => {
        $crate::leaf::not_this_kind!(@nil);
        $crate::leaf::not_this_kind!(@rest);
    };
    (@int) => {
        fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Ok(Err($crate::leaf::Problem::wrong_kind(&$crate::leaf::Expecting(&self), "an integer")))
        }
        fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Ok(Err($crate::leaf::Problem::wrong_kind(&$crate::leaf::Expecting(&self), "an integer")))
        }
    };
    (@nil) => {
        fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(Err($crate::leaf::Problem::wrong_kind(&$crate::leaf::Expecting(&self), "nil")))
        }
        fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(Err($crate::leaf::Problem::wrong_kind(&$crate::leaf::Expecting(&self), "nil")))
        }
    };
    (@rest) => {
        fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Ok(Err($crate::leaf::Problem::wrong_kind(&$crate::leaf::Expecting(&self), "a boolean")))
        }
        fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Ok(Err($crate::leaf::Problem::wrong_kind(&$crate::leaf::Expecting(&self), "a float")))
        }
        fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<Self::Value, E> {
            Ok(Err($crate::leaf::Problem::wrong_kind(&$crate::leaf::Expecting(&self), "a string")))
        }
        fn visit_bytes<E: serde::de::Error>(self, _: &[u8]) -> Result<Self::Value, E> {
            Ok(Err($crate::leaf::Problem::wrong_kind(&$crate::leaf::Expecting(&self), "bytes")))
        }
        fn visit_newtype_struct<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            <serde::de::IgnoredAny as serde::Deserialize>::deserialize(d)?;
            Ok(Err($crate::leaf::Problem::wrong_kind(&$crate::leaf::Expecting(&self), "a msgpack extension")))
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            $crate::leaf::drain_map(&mut map)?;
            Ok(Err($crate::leaf::Problem::wrong_kind(&$crate::leaf::Expecting(&self), "a map")))
        }
    };
}
pub(crate) use not_this_kind;

/// A visitor's `expecting` text as a `Display` value (for "expected X" messages).
pub(crate) struct Expecting<'a, V>(pub(crate) &'a V);

impl<'de, V: Visitor<'de>> fmt::Display for Expecting<'_, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.expecting(f)
    }
}

/// One msgpack value as a leaf sees it: scalars, integers widened to `i128` so every width
/// compares the same way; containers only by kind (they were read to their end).
#[derive(Debug)]
pub(crate) enum Scalar<'de> {
    Nil,
    Bool,
    Int(i128),
    Float(f64),
    Str(Cow<'de, str>),
    Bytes(Cow<'de, [u8]>),
    Array,
    Map,
    Ext,
}

impl Scalar<'_> {
    fn kind(&self) -> Got {
        match self {
            Scalar::Nil => Got::Kind("nil"),
            Scalar::Bool => Got::Kind("a boolean"),
            Scalar::Int(v) => Got::Int(*v),
            Scalar::Float(_) => Got::Kind("a float"),
            Scalar::Str(_) => Got::Kind("a string"),
            Scalar::Bytes(_) => Got::Kind("bytes"),
            Scalar::Array => Got::Kind("an array"),
            Scalar::Map => Got::Kind("a map"),
            Scalar::Ext => Got::Kind("a msgpack extension"),
        }
    }
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
        Mismatch { expected, got: got.kind() }
    }
}

impl From<Mismatch> for Problem {
    fn from(mismatch: Mismatch) -> Problem {
        match mismatch.got {
            Got::Kind(kind) => Problem::new(format!("expected {}, got {kind}", mismatch.expected)),
            Got::Int(v) => Problem::new(format!("expected {}, got {v}", mismatch.expected)),
        }
    }
}

/// Seed for one value read as a [`Scalar`]; `expected` names the field's type.
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
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Scalar<'de>, A::Error> {
        drain_seq(&mut seq)?;
        Ok(Scalar::Array)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Scalar<'de>, A::Error> {
        drain_map(&mut map)?;
        Ok(Scalar::Map)
    }
    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Scalar<'de>, D::Error> {
        IgnoredAny::deserialize(d)?;
        Ok(Scalar::Ext)
    }
}

use serde::Deserialize as _;

/// How each kind of field is named in "expected X" messages.
pub(crate) mod text {
    pub(crate) const HASH: &str = "a block hash (an integer or bytes)";
    pub(crate) const OPT_HASH: &str = "a block hash (an integer or bytes) or nil";
    pub(crate) const TOKEN_ID: &str = "a token id (an integer in 0..=4294967295)";
    pub(crate) const BLOCK_SIZE: &str = "a block size (an integer in 0..=4294967295)";
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
        // Negative hashes (SGLang's int64, older vLLM's Python `hash()`) keep their
        // two's-complement bits.
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

pub(crate) fn u32_of(value: Scalar<'_>, expected: &'static str) -> Result<u32, Mismatch> {
    match value {
        Scalar::Int(v) => u32::try_from(v).map_err(|_| Mismatch::new(expected, &value)),
        other => Err(Mismatch::new(expected, &other)),
    }
}

fn token_id(value: Scalar<'_>) -> Result<u32, Mismatch> {
    u32_of(value, text::TOKEN_ID)
}

fn block_size(value: Scalar<'_>) -> Result<u32, Mismatch> {
    u32_of(value, text::BLOCK_SIZE)
}

fn opt_u32(value: Scalar<'_>) -> Result<Option<u32>, Mismatch> {
    match value {
        Scalar::Nil => Ok(None),
        other => u32_of(other, text::OPT_U32).map(Some),
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

/// A scalar field as a seed: `expected` for messages, `convert` for the value.
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
    type Value = Checked<T>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Checked<T>, D::Error> {
        let scalar = Leaf(self.expected).deserialize(deserializer)?;
        Ok((self.convert)(scalar).map_err(Problem::from))
    }
}

/// A msgpack array whose elements `element` reads (each a `Checked` value); nil too when
/// `nullable` (then the value is `None`). The first problem is kept with its element index, the
/// rest of the array is read to its end.
pub(crate) struct ListOf<S> {
    /// The list's description, e.g. "an array of token ids".
    pub(crate) expected: &'static str,
    pub(crate) element: S,
    pub(crate) nullable: bool,
}

impl<S: Clone> Clone for ListOf<S> {
    fn clone(&self) -> Self {
        ListOf { expected: self.expected, element: self.element.clone(), nullable: self.nullable }
    }
}

impl<S: Copy> Copy for ListOf<S> {}

impl<'de, S, T> DeserializeSeed<'de> for ListOf<S>
where
    S: DeserializeSeed<'de, Value = Checked<T>> + Clone,
{
    type Value = Checked<Option<Vec<T>>>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de, S, T> Visitor<'de> for ListOf<S>
where
    S: DeserializeSeed<'de, Value = Checked<T>> + Clone,
{
    type Value = Checked<Option<Vec<T>>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.expected)?;
        if self.nullable {
            f.write_str(" or nil")?;
        }
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(MAX_PREALLOC));
        while let Some(item) = seq.next_element_seed(self.element.clone())? {
            match item {
                Ok(value) => out.push(value),
                Err(mut problem) => {
                    problem.element.get_or_insert(out.len());
                    drain_seq(&mut seq)?;
                    return Ok(Err(problem));
                }
            }
        }
        Ok(Ok(Some(out)))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        match self.nullable {
            true => Ok(Ok(None)),
            false => Ok(Err(Problem::wrong_kind(&Expecting(&self), "nil"))),
        }
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        self.visit_unit()
    }

    not_this_kind!(nil);
}

pub(crate) const HASH_LIST: ListOf<Field<u64>> =
    ListOf { expected: "an array of block hashes", element: HASH, nullable: false };

pub(crate) const TOKEN_LIST: ListOf<Field<u32>> =
    ListOf { expected: "an array of token ids", element: TOKEN_ID, nullable: false };

/// `lookahead_token_ids`: per block, a list of token ids.
pub(crate) const LOOKAHEAD: ListOf<ListOf<Field<u32>>> =
    ListOf { expected: "an array of token id arrays", element: TOKEN_LIST, nullable: true };
