//! `BlockStored.extra_keys`: per block, the extra keys that entered its hash (vLLM 0.24 on).
//!
//! vLLM writes one entry per block: nil, or a tuple of the block's keys in the order its hasher
//! adds them: the LoRA name, then multimodal items as `(identifier, offset from the block start)`
//! pairs, then the cache salt (first block only), then prompt-embedding hashes. The values are
//! kept as sent so that an encoder can write them back.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, SeqAccess, Visitor};

use crate::leaf::{drain_seq, Checked, ListOf, Problem};

/// One extra key, as msgpack carried it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExtraKey {
    Nil,
    Bool(bool),
    /// Within `i64::MIN..=u64::MAX`.
    Int(i128),
    /// An f64's bits (keys are compared, never computed with).
    Float(u64),
    Str(String),
    Bytes(Vec<u8>),
    /// A tuple, e.g. a multimodal item `(identifier, offset)`.
    Array(Vec<ExtraKey>),
}

impl ExtraKey {
    /// The string, when this key is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            ExtraKey::Str(text) => Some(text),
            _ => None,
        }
    }
}

#[derive(Clone, Copy)]
pub(crate) struct ExtraKeySeed;

impl<'de> DeserializeSeed<'de> for ExtraKeySeed {
    type Value = Checked<ExtraKey>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ExtraKeySeed {
    type Value = Checked<ExtraKey>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an extra key (a scalar or an array)")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
        Ok(Ok(ExtraKey::Bool(v)))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        Ok(Ok(ExtraKey::Int(v.into())))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Ok(Ok(ExtraKey::Int(v.into())))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        Ok(Ok(ExtraKey::Float(v.to_bits())))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Ok(ExtraKey::Str(v.to_owned())))
    }
    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Self::Value, E> {
        Ok(Ok(ExtraKey::Bytes(v.to_owned())))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Ok(ExtraKey::Nil))
    }
    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Ok(ExtraKey::Nil))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(self)? {
            match item {
                Ok(item) => items.push(item),
                Err(problem) => {
                    drain_seq(&mut seq)?;
                    return Ok(Err(problem));
                }
            }
        }
        Ok(Ok(ExtraKey::Array(items)))
    }

    fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        crate::leaf::drain_map(&mut map)?;
        Ok(Err(Problem::new("expected an extra key (a scalar or an array), got a map")))
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        <de::IgnoredAny as serde::Deserialize>::deserialize(d)?;
        Ok(Err(Problem::new("expected an extra key (a scalar or an array), got a msgpack extension")))
    }
}

/// One block's keys: nil or a tuple.
pub(crate) const BLOCK_KEYS: ListOf<ExtraKeySeed> =
    ListOf { expected: "an array of extra keys", element: ExtraKeySeed, nullable: true };

/// `extra_keys`: nil, or one entry per block.
pub(crate) const EXTRA_KEYS: ListOf<ListOf<ExtraKeySeed>> =
    ListOf { expected: "an array of per-block extra keys", element: BLOCK_KEYS, nullable: true };
