//! `BlockStored.token_ids`: plain token ids, or SGLang's EAGLE bigrams (`[[t0, t1], [t1, t2],
//! ...]`, the radix key of a speculative-decoding server).

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, SeqAccess, Visitor};

use crate::leaf::{drain_seq, not_this_kind, Checked, Problem, MAX_PREALLOC, TOKEN_ID};

/// The token ids of a `BlockStored` event, in the form the engine sent them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenIds {
    /// One id per token (vLLM; SGLang without speculative decoding).
    Plain(Vec<u32>),
    /// SGLang with EAGLE: its radix tree is keyed by bigrams `(t_i, t_i+1)`, so a page of
    /// `block_size` entries covers tokens `i..i+block_size` and also depends on the token after.
    Bigrams(Vec<[u32; 2]>),
}

impl Default for TokenIds {
    fn default() -> Self {
        TokenIds::Plain(Vec::new())
    }
}

impl TokenIds {
    /// Entries sent (tokens, or bigrams).
    pub fn len(&self) -> usize {
        match self {
            TokenIds::Plain(ids) => ids.len(),
            TokenIds::Bigrams(pairs) => pairs.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The token each entry stands for (a bigram's first element).
    pub fn tokens(&self) -> Vec<u32> {
        match self {
            TokenIds::Plain(ids) => ids.clone(),
            TokenIds::Bigrams(pairs) => pairs.iter().map(|pair| pair[0]).collect(),
        }
    }
}

impl From<Vec<u32>> for TokenIds {
    fn from(ids: Vec<u32>) -> Self {
        TokenIds::Plain(ids)
    }
}

impl PartialEq<[u32]> for TokenIds {
    fn eq(&self, other: &[u32]) -> bool {
        matches!(self, TokenIds::Plain(ids) if ids == other)
    }
}

impl<const N: usize> PartialEq<[u32; N]> for TokenIds {
    fn eq(&self, other: &[u32; N]) -> bool {
        self == &other[..]
    }
}

/// One entry of the list: a token id or a pair of them.
enum Entry {
    Token(u32),
    Pair([u32; 2]),
}

#[derive(Clone, Copy)]
struct EntrySeed;

impl<'de> DeserializeSeed<'de> for EntrySeed {
    type Value = Checked<Entry>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for EntrySeed {
    type Value = Checked<Entry>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a token id (an integer in 0..=4294967295) or a pair of them")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Ok(u32::try_from(v).map(Entry::Token).map_err(|_| self.out_of_range(v.into())))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        Ok(u32::try_from(v).map(Entry::Token).map_err(|_| self.out_of_range(v.into())))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let first = seq.next_element_seed(TOKEN_ID)?;
        let second = seq.next_element_seed(TOKEN_ID)?;
        let more = seq.next_element::<de::IgnoredAny>()?.is_some();
        drain_seq(&mut seq)?;
        Ok(match (first, second, more) {
            (Some(Ok(a)), Some(Ok(b)), false) => Ok(Entry::Pair([a, b])),
            (Some(Err(problem)), ..) | (_, Some(Err(problem)), _) => Err(problem),
            _ => Err(Problem::new("expected a pair of token ids, got an array of another length")),
        })
    }

    not_this_kind!(int);
}

impl EntrySeed {
    fn out_of_range(self, v: i128) -> Problem {
        Problem::new(format!("expected {}, got {v}", crate::leaf::text::TOKEN_ID))
    }
}

/// Seed for `token_ids`: every entry a token id, or every entry a pair.
#[derive(Clone, Copy)]
pub(crate) struct TokenIdsSeed;

impl<'de> DeserializeSeed<'de> for TokenIdsSeed {
    type Value = Checked<TokenIds>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for TokenIdsSeed {
    type Value = Checked<TokenIds>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array of token ids")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let capacity = seq.size_hint().unwrap_or(0).min(MAX_PREALLOC);
        let mut plain: Vec<u32> = Vec::new();
        let mut pairs: Vec<[u32; 2]> = Vec::new();
        let mut index = 0;
        while let Some(entry) = seq.next_element_seed(EntrySeed)? {
            let problem = match entry {
                Ok(Entry::Token(id)) if pairs.is_empty() => {
                    plain.reserve(if index == 0 { capacity } else { 0 });
                    plain.push(id);
                    None
                }
                Ok(Entry::Pair(pair)) if plain.is_empty() => {
                    pairs.reserve(if index == 0 { capacity } else { 0 });
                    pairs.push(pair);
                    None
                }
                Ok(_) => Some(Problem::new("token ids and token id pairs mixed in one list")),
                Err(problem) => Some(problem),
            };
            if let Some(mut problem) = problem {
                problem.element = Some(index);
                drain_seq(&mut seq)?;
                return Ok(Err(problem));
            }
            index += 1;
        }
        Ok(Ok(if pairs.is_empty() { TokenIds::Plain(plain) } else { TokenIds::Bigrams(pairs) }))
    }

    not_this_kind!();
}
