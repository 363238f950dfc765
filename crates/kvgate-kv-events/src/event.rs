//! One event, in either form: a positional array led by its tag, or a map with a `type` key.
//!
//! An event whose values are wrong (a field of the wrong kind, a missing or duplicate field)
//! decodes as [`KvEvent::Invalid`]; the event is still read to its end, so the batch's next event
//! decodes as usual.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::error::{Path, Tag};
use crate::extra::EXTRA_KEYS;
use crate::leaf::{
    self, drain_seq, Checked, Field, Problem, Scalar, BLOCK_SIZE, HASH_LIST, LOOKAHEAD, OPT_HASH, OPT_I64,
    OPT_STRING, OPT_U32,
};
use crate::tokens::TokenIdsSeed;
use crate::{BlockRemoved, BlockStored, ExtraKey, InvalidEvent, KvEvent, TokenIds};

/// Seed for event `index` of its batch; records its tag and fields in `path` as it goes (for
/// the location of a msgpack-level error).
pub(crate) struct EventSeed<'p> {
    pub(crate) path: &'p Path,
    pub(crate) index: usize,
}

impl<'de> DeserializeSeed<'de> for EventSeed<'_> {
    type Value = KvEvent;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<KvEvent, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for EventSeed<'_> {
    type Value = KvEvent;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an event (an array or a map)")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<KvEvent, A::Error> {
        let path = self.path;
        path.field.set(Some("type"));
        let name = seq.next_element_seed(NAME)?;
        path.field.set(None);
        let mut draft = Draft::default();
        let name = match name {
            None => {
                draft.problem(Key::Type, Problem::new("missing field"));
                return Ok(draft.into_event(None, self.index));
            }
            Some(Err(problem)) => {
                drain_seq(&mut seq)?;
                draft.problem(Key::Type, problem);
                return Ok(draft.into_event(None, self.index));
            }
            Some(Ok(name)) => name,
        };
        path.tag.set(Some(name.tag()));
        let order: &[Key] = match name.tag() {
            Tag::BlockStored => &STORED_ORDER,
            Tag::BlockRemoved => &REMOVED_ORDER,
            Tag::AllBlocksCleared | Tag::Unknown => &[],
        };
        for &key in order {
            path.field.set(Some(key.name()));
            if !draft.read(key, &mut FromSeq(&mut seq))? {
                break;
            }
        }
        path.field.set(None);
        // Fields added by newer engines (and all of an unknown event's) are skipped.
        drain_seq(&mut seq)?;
        Ok(draft.into_event(Some(name), self.index))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<KvEvent, A::Error> {
        let path = self.path;
        let mut name: Option<Name> = None;
        let mut draft = Draft::default();
        while let Some(key) = map.next_key_seed(KEY)? {
            let key = match key {
                Ok(key) => key,
                Err(problem) => {
                    map.next_value::<IgnoredAny>()?;
                    draft.problem(Key::Other, problem);
                    continue;
                }
            };
            path.field.set(Some(key.name()));
            if key == Key::Type {
                match map.next_value_seed(NAME)? {
                    Ok(_) if name.is_some() => draft.problem(Key::Type, Problem::new("duplicate field")),
                    Ok(value) => {
                        path.tag.set(Some(value.tag()));
                        name = Some(value);
                    }
                    Err(problem) => draft.problem(Key::Type, problem),
                }
                continue;
            }
            // Before the tag is known (it is not always first), every field any event has is
            // decoded; after, only the tag's own. The rest is skipped unread.
            let wanted = match name.as_ref().map(Name::tag) {
                None => key != Key::Other,
                Some(tag) => tag_has(tag, key),
            };
            if wanted {
                draft.read(key, &mut FromMap(&mut map))?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        path.field.set(None);
        if name.is_none() && !draft.problems.iter().any(|(key, _)| *key == Key::Type) {
            draft.problem(Key::Type, Problem::new("missing field"));
        }
        Ok(draft.into_event(name, self.index))
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<KvEvent, E> {
        Ok(self.not_an_event("a boolean"))
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<KvEvent, E> {
        Ok(self.not_an_event("an integer"))
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<KvEvent, E> {
        Ok(self.not_an_event("an integer"))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<KvEvent, E> {
        Ok(self.not_an_event("a float"))
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<KvEvent, E> {
        Ok(self.not_an_event("a string"))
    }
    fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<KvEvent, E> {
        Ok(self.not_an_event("bytes"))
    }
    fn visit_unit<E: de::Error>(self) -> Result<KvEvent, E> {
        Ok(self.not_an_event("nil"))
    }
    fn visit_none<E: de::Error>(self) -> Result<KvEvent, E> {
        Ok(self.not_an_event("nil"))
    }
    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<KvEvent, D::Error> {
        <IgnoredAny as serde::Deserialize>::deserialize(d)?;
        Ok(self.not_an_event("a msgpack extension"))
    }
}

impl EventSeed<'_> {
    fn not_an_event(&self, got: &str) -> KvEvent {
        KvEvent::Invalid(InvalidEvent {
            location: format!("event {}", self.index),
            reason: format!("expected an event (an array or a map), got {got}"),
        })
    }
}

const KEY: Field<Key> = Field { expected: leaf::text::FIELD_NAME, convert: key };
const NAME: Field<Name> = Field { expected: leaf::text::TAG, convert: name };

/// An event's tag; only an unknown one is kept as a string (for [`KvEvent::Unknown`]).
enum Name {
    Known(Tag),
    Unknown(String),
}

impl Name {
    fn tag(&self) -> Tag {
        match self {
            Name::Known(tag) => *tag,
            Name::Unknown(_) => Tag::Unknown,
        }
    }
}

fn name(value: Scalar<'_>) -> Result<Name, leaf::Mismatch> {
    match value {
        Scalar::Str(name) => Ok(match Tag::of(&name) {
            Tag::Unknown => Name::Unknown(name.into_owned()),
            tag => Name::Known(tag),
        }),
        other => Err(leaf::Mismatch::new(leaf::text::TAG, &other)),
    }
}

/// The fields any event has, by name; everything else is `Other`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Key {
    Type,
    BlockHashes,
    ParentBlockHash,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    KvCacheSpecKind,
    KvCacheSpecSlidingWindow,
    Locality,
    Ownership,
    SessionId,
    LookaheadTokenIds,
    CacheSalt,
    Other,
}

/// vLLM's `BlockStored` field order (the positional form); SGLang's `cache_salt` is map-only.
const STORED_ORDER: [Key; 15] = [
    Key::BlockHashes,
    Key::ParentBlockHash,
    Key::TokenIds,
    Key::BlockSize,
    Key::LoraId,
    Key::Medium,
    Key::LoraName,
    Key::ExtraKeys,
    Key::GroupIdx,
    Key::KvCacheSpecKind,
    Key::KvCacheSpecSlidingWindow,
    Key::Locality,
    Key::Ownership,
    Key::SessionId,
    Key::LookaheadTokenIds,
];

const REMOVED_ORDER: [Key; 5] = [Key::BlockHashes, Key::Medium, Key::GroupIdx, Key::Locality, Key::Ownership];

const NAMES: [(Key, &str); 17] = [
    (Key::Type, "type"),
    (Key::BlockHashes, "block_hashes"),
    (Key::ParentBlockHash, "parent_block_hash"),
    (Key::TokenIds, "token_ids"),
    (Key::BlockSize, "block_size"),
    (Key::LoraId, "lora_id"),
    (Key::Medium, "medium"),
    (Key::LoraName, "lora_name"),
    (Key::ExtraKeys, "extra_keys"),
    (Key::GroupIdx, "group_idx"),
    (Key::KvCacheSpecKind, "kv_cache_spec_kind"),
    (Key::KvCacheSpecSlidingWindow, "kv_cache_spec_sliding_window"),
    (Key::Locality, "locality"),
    (Key::Ownership, "ownership"),
    (Key::SessionId, "session_id"),
    (Key::LookaheadTokenIds, "lookahead_token_ids"),
    (Key::CacheSalt, "cache_salt"),
];

impl Key {
    fn name(self) -> &'static str {
        NAMES.iter().find(|(key, _)| *key == self).map_or("(key)", |(_, name)| name)
    }
}

fn key(value: Scalar<'_>) -> Result<Key, leaf::Mismatch> {
    let Scalar::Str(text) = value else {
        return Err(leaf::Mismatch::new(leaf::text::FIELD_NAME, &value));
    };
    Ok(NAMES.iter().find(|(_, name)| *name == text).map_or(Key::Other, |(key, _)| *key))
}

fn tag_has(tag: Tag, key: Key) -> bool {
    match tag {
        Tag::BlockStored => key != Key::Other,
        Tag::BlockRemoved => REMOVED_ORDER.contains(&key),
        Tag::AllBlocksCleared | Tag::Unknown => false,
    }
}

/// Where the next field value comes from: an array element or a map value.
trait Values<'de> {
    type Error: de::Error;
    /// The next value; `None` when an array has ended.
    fn next<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<Option<S::Value>, Self::Error>;
}

struct FromSeq<'a, A>(&'a mut A);

impl<'de, A: SeqAccess<'de>> Values<'de> for FromSeq<'_, A> {
    type Error = A::Error;
    fn next<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<Option<S::Value>, A::Error> {
        self.0.next_element_seed(seed)
    }
}

struct FromMap<'a, A>(&'a mut A);

impl<'de, A: MapAccess<'de>> Values<'de> for FromMap<'_, A> {
    type Error = A::Error;
    fn next<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<Option<S::Value>, A::Error> {
        self.0.next_value_seed(seed).map(Some)
    }
}

/// The fields of an event as read so far (`Some(None)`: present and nil), and the problems.
#[derive(Default)]
struct Draft {
    block_hashes: Option<Vec<u64>>,
    parent_block_hash: Option<Option<u64>>,
    token_ids: Option<TokenIds>,
    block_size: Option<u32>,
    lora_id: Option<Option<i64>>,
    medium: Option<Option<String>>,
    lora_name: Option<Option<String>>,
    extra_keys: Option<Option<Vec<Option<Vec<ExtraKey>>>>>,
    group_idx: Option<Option<u32>>,
    kv_cache_spec_kind: Option<Option<String>>,
    kv_cache_spec_sliding_window: Option<Option<u32>>,
    locality: Option<Option<String>>,
    ownership: Option<Option<String>>,
    session_id: Option<Option<String>>,
    lookahead_token_ids: Option<Option<Vec<Option<Vec<u32>>>>>,
    cache_salt: Option<Option<String>>,
    /// Problems by field, in the order found (usually none).
    problems: Vec<(Key, Problem)>,
}

/// Stores a field's value: a problem, or a second value for the same field, is recorded.
fn put<T>(problems: &mut Vec<(Key, Problem)>, key: Key, slot: &mut Option<T>, value: Checked<T>) {
    match value {
        Ok(value) if slot.is_some() => {
            drop(value);
            problems.push((key, Problem::new("duplicate field")));
        }
        Ok(value) => *slot = Some(value),
        Err(problem) => problems.push((key, problem)),
    }
}

impl Draft {
    fn problem(&mut self, key: Key, problem: Problem) {
        self.problems.push((key, problem));
    }

    /// Reads field `key`'s value from `values`; false when an array has ended.
    fn read<'de, V: Values<'de>>(&mut self, key: Key, values: &mut V) -> Result<bool, V::Error> {
        macro_rules! field {
            ($slot:ident, $seed:expr) => {{
                let Some(value) = values.next($seed)? else { return Ok(false) };
                put(&mut self.problems, key, &mut self.$slot, value);
            }};
            ($slot:ident, $seed:expr, $map:expr) => {{
                let Some(value) = values.next($seed)? else { return Ok(false) };
                put(&mut self.problems, key, &mut self.$slot, value.map($map));
            }};
        }
        match key {
            Key::BlockHashes => field!(block_hashes, HASH_LIST, Option::unwrap_or_default),
            Key::ParentBlockHash => field!(parent_block_hash, OPT_HASH),
            Key::TokenIds => field!(token_ids, TokenIdsSeed),
            Key::BlockSize => field!(block_size, BLOCK_SIZE),
            Key::LoraId => field!(lora_id, OPT_I64),
            Key::Medium => field!(medium, OPT_STRING),
            Key::LoraName => field!(lora_name, OPT_STRING),
            Key::ExtraKeys => field!(extra_keys, EXTRA_KEYS),
            Key::GroupIdx => field!(group_idx, OPT_U32),
            Key::KvCacheSpecKind => field!(kv_cache_spec_kind, OPT_STRING),
            Key::KvCacheSpecSlidingWindow => field!(kv_cache_spec_sliding_window, OPT_U32),
            Key::Locality => field!(locality, OPT_STRING),
            Key::Ownership => field!(ownership, OPT_STRING),
            Key::SessionId => field!(session_id, OPT_STRING),
            Key::LookaheadTokenIds => field!(lookahead_token_ids, LOOKAHEAD),
            Key::CacheSalt => field!(cache_salt, OPT_STRING),
            Key::Type | Key::Other => {
                if values.next(std::marker::PhantomData::<IgnoredAny>)?.is_none() {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    fn into_event(mut self, name: Option<Name>, index: usize) -> KvEvent {
        let tag = name.as_ref().map_or(Tag::Unknown, Name::tag);
        let required: &[(Key, bool)] = match tag {
            Tag::BlockStored => &[
                (Key::BlockHashes, self.block_hashes.is_some()),
                (Key::TokenIds, self.token_ids.is_some()),
                (Key::BlockSize, self.block_size.is_some()),
            ],
            Tag::BlockRemoved => &[(Key::BlockHashes, self.block_hashes.is_some())],
            Tag::AllBlocksCleared | Tag::Unknown => &[],
        };
        for &(key, present) in required {
            if !present {
                self.problems.push((key, Problem::new("missing field")));
            }
        }
        // Problems in fields the tag does not have (read before the tag was known) do not count.
        let relevant =
            |key: Key| matches!(key, Key::Type | Key::Other) || (name.is_some() && tag_has(tag, key));
        if let Some((key, problem)) = self.problems.iter().find(|(key, _)| relevant(*key)) {
            let mut location = format!("event {index}");
            if name.is_some() {
                location.push_str(&format!(" ({})", tag.name()));
            }
            location.push_str(&format!(": {}", key.name()));
            if let Some(element) = problem.element {
                location.push_str(&format!("[{element}]"));
            }
            return KvEvent::Invalid(InvalidEvent { location, reason: problem.message.clone() });
        }
        let Some(name) = name else {
            unreachable!("a missing tag is a problem");
        };
        match name {
            Name::Unknown(tag) => KvEvent::Unknown(tag),
            Name::Known(Tag::AllBlocksCleared) => KvEvent::AllBlocksCleared,
            Name::Known(Tag::BlockRemoved) => KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: self.block_hashes.unwrap_or_default(),
                medium: self.medium.flatten(),
                group_idx: self.group_idx.flatten(),
                locality: self.locality.flatten(),
                ownership: self.ownership.flatten(),
            }),
            Name::Known(Tag::BlockStored | Tag::Unknown) => KvEvent::BlockStored(BlockStored {
                block_hashes: self.block_hashes.unwrap_or_default(),
                // Always sent by msgspec (no default); absent is read as "no parent".
                parent_block_hash: self.parent_block_hash.flatten(),
                token_ids: self.token_ids.unwrap_or_default(),
                block_size: self.block_size.unwrap_or_default(),
                lora_id: self.lora_id.flatten(),
                medium: self.medium.flatten(),
                lora_name: self.lora_name.flatten(),
                extra_keys: self.extra_keys.flatten(),
                group_idx: self.group_idx.flatten(),
                kv_cache_spec_kind: self.kv_cache_spec_kind.flatten(),
                kv_cache_spec_sliding_window: self.kv_cache_spec_sliding_window.flatten(),
                locality: self.locality.flatten(),
                ownership: self.ownership.flatten(),
                session_id: self.session_id.flatten(),
                lookahead_token_ids: self
                    .lookahead_token_ids
                    .flatten()
                    .map(|blocks| blocks.into_iter().map(Option::unwrap_or_default).collect()),
                cache_salt: self.cache_salt.flatten(),
            }),
        }
    }
}
