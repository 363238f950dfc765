//! One event, in either encoding: a positional array led by its tag, or a map with a `type` key.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, Error as _, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::error::{Path, Tag};
use crate::leaf::{self, reject_scalars, Field, Scalar};
use crate::{BlockRemoved, BlockStored, KvEvent};

/// Seed for one event; records its tag and fields in `path` as it goes.
pub(crate) struct EventSeed<'p> {
    pub(crate) path: &'p Path,
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
        let name = required_field(&mut seq, path, "type", NAME)?;
        path.tag.set(Some(name.tag()));
        let event = match name.tag() {
            Tag::BlockStored => KvEvent::BlockStored(positional_stored(&mut seq, path)?),
            Tag::BlockRemoved => KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: required_field(&mut seq, path, "block_hashes", leaf::hash_list(path))?,
                medium: optional(&mut seq, path, "medium", leaf::OPT_STRING)?.flatten(),
                group_idx: optional(&mut seq, path, "group_idx", leaf::OPT_U32)?.flatten(),
            }),
            Tag::AllBlocksCleared => KvEvent::AllBlocksCleared,
            Tag::Unknown => KvEvent::Unknown(name.into_unknown()),
        };
        // Fields added by newer engines (and all of an unknown event's) are skipped.
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(event)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<KvEvent, A::Error> {
        let path = self.path;
        let mut name: Option<Name> = None;
        let mut fields = Fields::default();
        while let Some(key) = map.next_key_seed(KEY)? {
            if key == Key::Type {
                path.field.set(Some("type"));
                let value = map.next_value_seed(NAME)?;
                if name.is_some() {
                    return Err(A::Error::custom("duplicate field"));
                }
                path.tag.set(Some(value.tag()));
                name = Some(value);
                path.field.set(None);
                continue;
            }
            // Before the tag is known (it is not always first), every field any event has is
            // decoded; after, only the tag's own. The rest is skipped unread.
            let wanted = match name.as_ref().map(Name::tag) {
                None => key != Key::Other,
                Some(tag) => tag_has(tag, key),
            };
            if !wanted {
                map.next_value::<IgnoredAny>()?;
                continue;
            }
            path.field.set(Some(key.name()));
            fields.read(key, &mut map, path)?;
            path.field.set(None);
        }
        let Some(name) = name else {
            path.field.set(Some("type"));
            return Err(A::Error::custom("missing field"));
        };
        fields.into_event(name, path)
    }

    reject_scalars!();
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

    fn into_unknown(self) -> String {
        match self {
            Name::Known(tag) => tag.name().to_owned(),
            Name::Unknown(name) => name,
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

/// The positional `BlockStored` fields after the tag, in vLLM's order.
fn positional_stored<'de, A: SeqAccess<'de>>(seq: &mut A, path: &Path) -> Result<BlockStored, A::Error> {
    let block_hashes = required_field(seq, path, "block_hashes", leaf::hash_list(path))?;
    let parent_block_hash = required_field(seq, path, "parent_block_hash", leaf::OPT_HASH)?;
    let token_ids = required_field(seq, path, "token_ids", leaf::token_list(path))?;
    let block_size = required_field(seq, path, "block_size", leaf::BLOCK_SIZE)?;
    let lora_id = optional(seq, path, "lora_id", leaf::OPT_I64)?.flatten();
    let medium = optional(seq, path, "medium", leaf::OPT_STRING)?.flatten();
    let lora_name = optional(seq, path, "lora_name", leaf::OPT_STRING)?.flatten();
    optional(seq, path, "extra_keys", PhantomIgnored)?;
    let group_idx = optional(seq, path, "group_idx", leaf::OPT_U32)?.flatten();
    Ok(BlockStored {
        block_hashes,
        parent_block_hash,
        token_ids,
        block_size,
        lora_id,
        lora_name,
        medium,
        group_idx,
    })
}

/// The next element, `None` when the array has ended; `name` is in the path while it decodes.
fn optional<'de, A, S>(
    seq: &mut A,
    path: &Path,
    name: &'static str,
    seed: S,
) -> Result<Option<S::Value>, A::Error>
where
    A: SeqAccess<'de>,
    S: DeserializeSeed<'de>,
{
    path.field.set(Some(name));
    let value = seq.next_element_seed(seed)?;
    if value.is_some() {
        path.field.set(None);
    }
    Ok(value)
}

/// The next element; the end of the array is a "missing field" error at `name`.
fn required_field<'de, A, S>(
    seq: &mut A,
    path: &Path,
    name: &'static str,
    seed: S,
) -> Result<S::Value, A::Error>
where
    A: SeqAccess<'de>,
    S: DeserializeSeed<'de>,
{
    optional(seq, path, name, seed)?.ok_or_else(|| A::Error::custom("missing field"))
}

/// `IgnoredAny` as a seed (for `extra_keys`, which this crate does not report).
struct PhantomIgnored;

impl<'de> DeserializeSeed<'de> for PhantomIgnored {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        de::Deserialize::deserialize(deserializer).map(|IgnoredAny| ())
    }
}

/// The map keys any event type has; everything else is `Other`.
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
    GroupIdx,
    Other,
}

impl Key {
    fn name(self) -> &'static str {
        match self {
            Key::Type => "type",
            Key::BlockHashes => "block_hashes",
            Key::ParentBlockHash => "parent_block_hash",
            Key::TokenIds => "token_ids",
            Key::BlockSize => "block_size",
            Key::LoraId => "lora_id",
            Key::Medium => "medium",
            Key::LoraName => "lora_name",
            Key::GroupIdx => "group_idx",
            Key::Other => "(other)",
        }
    }
}

fn key(value: Scalar<'_>) -> Result<Key, leaf::Mismatch> {
    let Scalar::Str(name) = value else {
        return Err(leaf::Mismatch::new(leaf::text::FIELD_NAME, &value));
    };
    Ok(match &*name {
        "type" => Key::Type,
        "block_hashes" => Key::BlockHashes,
        "parent_block_hash" => Key::ParentBlockHash,
        "token_ids" => Key::TokenIds,
        "block_size" => Key::BlockSize,
        "lora_id" => Key::LoraId,
        "medium" => Key::Medium,
        "lora_name" => Key::LoraName,
        "group_idx" => Key::GroupIdx,
        _ => Key::Other,
    })
}

fn tag_has(tag: Tag, key: Key) -> bool {
    match tag {
        Tag::BlockStored => key != Key::Other,
        Tag::BlockRemoved => matches!(key, Key::BlockHashes | Key::Medium | Key::GroupIdx),
        Tag::AllBlocksCleared | Tag::Unknown => false,
    }
}

/// The fields of a map-form event, as read so far (`Some(None)` = present and nil).
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<u64>>,
    parent_block_hash: Option<Option<u64>>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_id: Option<Option<i64>>,
    medium: Option<Option<String>>,
    lora_name: Option<Option<String>>,
    group_idx: Option<Option<u32>>,
}

impl Fields {
    fn read<'de, A: MapAccess<'de>>(&mut self, key: Key, map: &mut A, path: &Path) -> Result<(), A::Error> {
        match key {
            Key::BlockHashes => put(&mut self.block_hashes, map.next_value_seed(leaf::hash_list(path))?),
            Key::ParentBlockHash => put(&mut self.parent_block_hash, map.next_value_seed(leaf::OPT_HASH)?),
            Key::TokenIds => put(&mut self.token_ids, map.next_value_seed(leaf::token_list(path))?),
            Key::BlockSize => put(&mut self.block_size, map.next_value_seed(leaf::BLOCK_SIZE)?),
            Key::LoraId => put(&mut self.lora_id, map.next_value_seed(leaf::OPT_I64)?),
            Key::Medium => put(&mut self.medium, map.next_value_seed(leaf::OPT_STRING)?),
            Key::LoraName => put(&mut self.lora_name, map.next_value_seed(leaf::OPT_STRING)?),
            Key::GroupIdx => put(&mut self.group_idx, map.next_value_seed(leaf::OPT_U32)?),
            Key::Type | Key::Other => map.next_value::<IgnoredAny>().map(|_| ()),
        }
    }

    fn into_event<E: de::Error>(self, name: Name, path: &Path) -> Result<KvEvent, E> {
        let need = |name: &'static str| {
            path.field.set(Some(name));
            E::custom("missing field")
        };
        Ok(match name.tag() {
            Tag::BlockStored => KvEvent::BlockStored(BlockStored {
                block_hashes: self.block_hashes.ok_or_else(|| need("block_hashes"))?,
                // Always sent by msgspec (no default); absent is read as "no parent".
                parent_block_hash: self.parent_block_hash.flatten(),
                token_ids: self.token_ids.ok_or_else(|| need("token_ids"))?,
                block_size: self.block_size.ok_or_else(|| need("block_size"))?,
                lora_id: self.lora_id.flatten(),
                lora_name: self.lora_name.flatten(),
                medium: self.medium.flatten(),
                group_idx: self.group_idx.flatten(),
            }),
            Tag::BlockRemoved => KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: self.block_hashes.ok_or_else(|| need("block_hashes"))?,
                medium: self.medium.flatten(),
                group_idx: self.group_idx.flatten(),
            }),
            Tag::AllBlocksCleared => KvEvent::AllBlocksCleared,
            Tag::Unknown => KvEvent::Unknown(name.into_unknown()),
        })
    }
}

/// Stores a map field, refusing a second value for the same key.
fn put<T, E: de::Error>(slot: &mut Option<T>, value: T) -> Result<(), E> {
    match slot {
        Some(_) => Err(E::custom("duplicate field")),
        None => {
            *slot = Some(value);
            Ok(())
        }
    }
}
