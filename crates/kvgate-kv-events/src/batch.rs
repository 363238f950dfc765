//! The `KVEventBatch` envelope (`[ts, events, dp_rank]` or `{"ts", "events", ...}`) and the
//! entry point that runs the decoders over a payload.

use std::fmt;
use std::io;

use serde::de::{self, DeserializeSeed, Deserializer, Error as _, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::error::{reason, DecodeError, Path, MAX_DEPTH};
use crate::event::EventSeed;
use crate::leaf::{self, Checked, Field, Scalar, MAX_PREALLOC};
use crate::{EventBatch, KvEvent};

/// Rejects every kind a container visitor does not want with "expected X, got Y" (the batch
/// envelope is strict: nothing of it can be used when it is of the wrong kind).
macro_rules! reject_scalars {
    () => {
        fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Err(wrong_kind(&self, "a boolean"))
        }
        fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Err(wrong_kind(&self, "an integer"))
        }
        fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Err(wrong_kind(&self, "an integer"))
        }
        fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Err(wrong_kind(&self, "a float"))
        }
        fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<Self::Value, E> {
            Err(wrong_kind(&self, "a string"))
        }
        fn visit_bytes<E: serde::de::Error>(self, _: &[u8]) -> Result<Self::Value, E> {
            Err(wrong_kind(&self, "bytes"))
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Err(wrong_kind(&self, "nil"))
        }
        fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Err(wrong_kind(&self, "nil"))
        }
        fn visit_newtype_struct<D: serde::Deserializer<'de>>(self, _: D) -> Result<Self::Value, D::Error> {
            Err(wrong_kind(&self, "a msgpack extension"))
        }
    };
    (map) => {
        reject_scalars!();
        fn visit_map<A: serde::de::MapAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
            Err(wrong_kind(&self, "a map"))
        }
    };
}

/// "expected {what the visitor wants}, got {kind}".
fn wrong_kind<E: de::Error>(expected: &dyn de::Expected, got: &str) -> E {
    E::custom(format_args!("expected {expected}, got {got}"))
}

pub(crate) fn decode(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let path = Path::default();
    let mut deserializer = rmp_serde::Deserializer::from_read_ref(payload);
    deserializer.set_max_depth(MAX_DEPTH);
    let batch = BatchSeed { path: &path }
        .deserialize(&mut deserializer)
        .map_err(|err| DecodeError::Payload { location: path.render(), reason: reason(err) })?;
    // Only the end of the input may follow the batch: reading one more marker must hit it.
    match (&mut deserializer).deserialize_u8(IgnoredAny) {
        Err(rmp_serde::decode::Error::InvalidMarkerRead(err))
            if err.kind() == io::ErrorKind::UnexpectedEof =>
        {
            Ok(batch)
        }
        _ => Err(DecodeError::Payload {
            location: String::new(),
            reason: "bytes after the end of the batch".to_owned(),
        }),
    }
}

/// Seed for the batch; sets `path.batch_field` while a field decodes.
struct BatchSeed<'p> {
    path: &'p Path,
}

impl<'de> DeserializeSeed<'de> for BatchSeed<'_> {
    type Value = EventBatch;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<EventBatch, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for BatchSeed<'_> {
    type Value = EventBatch;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an event batch (an array or a map)")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<EventBatch, A::Error> {
        let path = self.path;
        path.batch_field.set(Some("ts"));
        let ts = seq.next_element_seed(leaf::TS)?.ok_or_else(|| A::Error::custom("missing field"))?;
        let ts = strict(ts)?;
        path.batch_field.set(Some("events"));
        let events = seq.next_element_seed(EventsSeed { path })?;
        let events = events.ok_or_else(|| A::Error::custom("missing field"))?;
        path.batch_field.set(Some("data_parallel_rank"));
        let data_parallel_rank = seq.next_element_seed(leaf::OPT_U32)?.map(strict).transpose()?.flatten();
        path.batch_field.set(None);
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(EventBatch { ts, events, data_parallel_rank })
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<EventBatch, A::Error> {
        let path = self.path;
        let (mut ts, mut events, mut data_parallel_rank) = (None, None, None);
        while let Some(key) = map.next_key_seed(KEY)? {
            let key = strict(key)?;
            path.batch_field.set(key.name());
            let duplicate = match key {
                Key::Ts => ts.replace(strict(map.next_value_seed(leaf::TS)?)?).is_some(),
                Key::Events => events.replace(map.next_value_seed(EventsSeed { path })?).is_some(),
                Key::DataParallelRank => {
                    data_parallel_rank.replace(strict(map.next_value_seed(leaf::OPT_U32)?)?).is_some()
                }
                Key::Other => map.next_value::<IgnoredAny>().map(|_| false)?,
            };
            if duplicate {
                return Err(A::Error::custom("duplicate field"));
            }
            path.batch_field.set(None);
        }
        let missing = |name| {
            path.batch_field.set(Some(name));
            A::Error::custom("missing field")
        };
        Ok(EventBatch {
            ts: ts.ok_or_else(|| missing("ts"))?,
            events: events.ok_or_else(|| missing("events"))?,
            data_parallel_rank: data_parallel_rank.flatten(),
        })
    }

    reject_scalars!();
}

/// A batch-level field must be right: the batch is refused otherwise.
fn strict<T, E: de::Error>(value: Checked<T>) -> Result<T, E> {
    value.map_err(|problem| E::custom(problem.message))
}

const KEY: Field<Key> = Field { expected: leaf::text::FIELD_NAME, convert: key };

/// The batch map keys; unknown ones are skipped.
#[derive(Clone, Copy)]
enum Key {
    Ts,
    Events,
    DataParallelRank,
    Other,
}

impl Key {
    fn name(self) -> Option<&'static str> {
        match self {
            Key::Ts => Some("ts"),
            Key::Events => Some("events"),
            Key::DataParallelRank => Some("data_parallel_rank"),
            Key::Other => None,
        }
    }
}

fn key(value: Scalar<'_>) -> Result<Key, leaf::Mismatch> {
    match value {
        Scalar::Str(name) => Ok(match &*name {
            "ts" => Key::Ts,
            "events" => Key::Events,
            "data_parallel_rank" => Key::DataParallelRank,
            _ => Key::Other,
        }),
        other => Err(leaf::Mismatch::new(leaf::text::FIELD_NAME, &other)),
    }
}

/// The events array; the event index goes into the path.
struct EventsSeed<'p> {
    path: &'p Path,
}

impl<'de> DeserializeSeed<'de> for EventsSeed<'_> {
    type Value = Vec<KvEvent>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Vec<KvEvent>, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for EventsSeed<'_> {
    type Value = Vec<KvEvent>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array of events")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<KvEvent>, A::Error> {
        let mut events = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(MAX_PREALLOC / 8));
        loop {
            self.path.enter_event(events.len());
            match seq.next_element_seed(EventSeed { path: self.path, index: events.len() })? {
                Some(event) => events.push(event),
                None => break,
            }
        }
        self.path.event.set(None);
        Ok(events)
    }

    reject_scalars!(map);
}

/// Decodes a batch from any serde deserializer (errors then carry no location; prefer
/// [`crate::decode_batch`] for msgpack payloads).
impl<'de> de::Deserialize<'de> for EventBatch {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<EventBatch, D::Error> {
        BatchSeed { path: &Path::default() }.deserialize(deserializer)
    }
}

/// Decodes one event (either encoding) from any serde deserializer.
impl<'de> de::Deserialize<'de> for KvEvent {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<KvEvent, D::Error> {
        EventSeed { path: &Path::default(), index: 0 }.deserialize(deserializer)
    }
}
