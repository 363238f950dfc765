//! A test-only msgpack writer that picks a random valid width for every header and integer, and
//! writes a model batch in either encoding (for the round-trip property).

use crate::{block_hash_from_bytes, BlockRemoved, BlockStored, EventBatch, KvEvent, TokenIds};

/// Deterministic choices (splitmix64) from one proptest-drawn seed.
pub(super) struct Style(pub(super) u64);

impl Style {
    pub(super) fn pick(&mut self, n: usize) -> usize {
        let z = kvgate_words::splitmix64(self.0);
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        (z % n as u64) as usize
    }

    pub(super) fn coin(&mut self) -> bool {
        self.pick(2) == 1
    }
}

/// Any msgpack integer encoding that holds `v` (`v` within i64::MIN..=u64::MAX).
pub(super) fn int(out: &mut Vec<u8>, v: i128, style: &mut Style) {
    let mut options: Vec<Vec<u8>> = Vec::new();
    if (0..=127).contains(&v) {
        options.push(vec![v as u8]);
    }
    if (-32..0).contains(&v) {
        options.push(vec![v as i8 as u8]);
    }
    if v >= 0 {
        let v = v as u64;
        if v <= u8::MAX as u64 {
            options.push([&[0xcc][..], &(v as u8).to_be_bytes()].concat());
        }
        if v <= u16::MAX as u64 {
            options.push([&[0xcd][..], &(v as u16).to_be_bytes()].concat());
        }
        if v <= u32::MAX as u64 {
            options.push([&[0xce][..], &(v as u32).to_be_bytes()].concat());
        }
        options.push([&[0xcf][..], &v.to_be_bytes()].concat());
    }
    if v <= i64::MAX as i128 {
        let v = v as i64;
        if i8::try_from(v).is_ok() {
            options.push([&[0xd0][..], &(v as i8).to_be_bytes()].concat());
        }
        if i16::try_from(v).is_ok() {
            options.push([&[0xd1][..], &(v as i16).to_be_bytes()].concat());
        }
        if i32::try_from(v).is_ok() {
            options.push([&[0xd2][..], &(v as i32).to_be_bytes()].concat());
        }
        options.push([&[0xd3][..], &v.to_be_bytes()].concat());
    }
    let choice = style.pick(options.len());
    out.extend_from_slice(&options[choice]);
}

/// A length header: the fix form (when it fits) or one of the explicit widths.
fn header(out: &mut Vec<u8>, len: usize, fix: Option<(u8, usize)>, wide: [u8; 3], style: &mut Style) {
    let mut options: Vec<Vec<u8>> = Vec::new();
    if let Some((base, _)) = fix.filter(|&(_, limit)| len < limit) {
        options.push(vec![base | len as u8]);
    }
    if wide[0] != 0 && len <= u8::MAX as usize {
        options.push(vec![wide[0], len as u8]);
    }
    options.push([&[wide[1]][..], &(len as u16).to_be_bytes()].concat());
    options.push([&[wide[2]][..], &(len as u32).to_be_bytes()].concat());
    let choice = style.pick(options.len());
    out.extend_from_slice(&options[choice]);
}

pub(super) fn array(out: &mut Vec<u8>, len: usize, style: &mut Style) {
    header(out, len, Some((0x90, 16)), [0, 0xdc, 0xdd], style);
}

pub(super) fn map(out: &mut Vec<u8>, len: usize, style: &mut Style) {
    header(out, len, Some((0x80, 16)), [0, 0xde, 0xdf], style);
}

pub(super) fn str(out: &mut Vec<u8>, s: &str, style: &mut Style) {
    header(out, s.len(), Some((0xa0, 32)), [0xd9, 0xda, 0xdb], style);
    out.extend_from_slice(s.as_bytes());
}

pub(super) fn bin(out: &mut Vec<u8>, bytes: &[u8], style: &mut Style) {
    header(out, bytes.len(), None, [0xc4, 0xc5, 0xc6], style);
    out.extend_from_slice(bytes);
}

/// A block hash as the engine sends it: an integer (signed or not) or bytes.
#[derive(Clone, Debug)]
pub(super) enum HashIn {
    Int(i128),
    Bytes(Vec<u8>),
}

impl HashIn {
    pub(super) fn decoded(&self) -> u64 {
        match self {
            HashIn::Int(v) => *v as u64,
            HashIn::Bytes(bytes) => block_hash_from_bytes(bytes),
        }
    }

    fn write(&self, out: &mut Vec<u8>, style: &mut Style) {
        match self {
            HashIn::Int(v) => int(out, *v, style),
            HashIn::Bytes(bytes) => bin(out, bytes, style),
        }
    }
}

#[allow(clippy::large_enum_variant)] // test data
#[derive(Clone, Debug)]
pub(super) enum EventIn {
    Stored { hashes: Vec<HashIn>, parent: Option<HashIn>, stored: BlockStored },
    Removed { hashes: Vec<HashIn>, removed: BlockRemoved },
    Cleared,
    Unknown(String),
}

impl EventIn {
    pub(super) fn decoded(&self) -> KvEvent {
        match self.clone() {
            EventIn::Stored { hashes, parent, stored } => KvEvent::BlockStored(BlockStored {
                block_hashes: hashes.iter().map(HashIn::decoded).collect(),
                parent_block_hash: parent.as_ref().map(HashIn::decoded),
                ..stored
            }),
            EventIn::Removed { hashes, removed } => KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: hashes.iter().map(HashIn::decoded).collect(),
                ..removed
            }),
            EventIn::Cleared => KvEvent::AllBlocksCleared,
            EventIn::Unknown(tag) => KvEvent::Unknown(tag),
        }
    }
}

/// One field's encoded value: `None` is nil.
type Value = Option<Vec<u8>>;

fn encoded(style: &mut Style, write: impl FnOnce(&mut Vec<u8>, &mut Style)) -> Value {
    let mut out = Vec::new();
    write(&mut out, style);
    Some(out)
}

fn opt_int(v: Option<i128>, style: &mut Style) -> Value {
    v.and_then(|v| encoded(style, |out, style| int(out, v, style)))
}

fn opt_str(v: &Option<String>, style: &mut Style) -> Value {
    v.as_ref().and_then(|v| encoded(style, |out, style| str(out, v, style)))
}

fn hashes(list: &[HashIn], style: &mut Style) -> Value {
    encoded(style, |out, style| {
        array(out, list.len(), style);
        list.iter().for_each(|hash| hash.write(out, style));
    })
}

/// The tag and named fields of an event, in vLLM's positional order.
fn fields(event: &EventIn, style: &mut Style) -> (String, Vec<(&'static str, Value)>) {
    match event {
        EventIn::Stored { hashes: list, parent, stored } => {
            let tokens = encoded(style, |out, style| match &stored.token_ids {
                TokenIds::Plain(ids) => {
                    array(out, ids.len(), style);
                    ids.iter().for_each(|&t| int(out, t.into(), style));
                }
                TokenIds::Bigrams(pairs) => {
                    array(out, pairs.len(), style);
                    for pair in pairs {
                        array(out, 2, style);
                        pair.iter().for_each(|&t| int(out, t.into(), style));
                    }
                }
            });
            let fields = vec![
                ("block_hashes", hashes(list, style)),
                (
                    "parent_block_hash",
                    parent.as_ref().and_then(|h| encoded(style, |out, style| h.write(out, style))),
                ),
                ("token_ids", tokens),
                ("block_size", opt_int(Some(stored.block_size.into()), style)),
                ("lora_id", opt_int(stored.lora_id.map(i128::from), style)),
                ("medium", opt_str(&stored.medium, style)),
                ("lora_name", opt_str(&stored.lora_name, style)),
                ("extra_keys", None),
                ("group_idx", opt_int(stored.group_idx.map(i128::from), style)),
                ("kv_cache_spec_kind", opt_str(&stored.kv_cache_spec_kind, style)),
                (
                    "kv_cache_spec_sliding_window",
                    opt_int(stored.kv_cache_spec_sliding_window.map(i128::from), style),
                ),
                ("locality", opt_str(&stored.locality, style)),
                ("ownership", opt_str(&stored.ownership, style)),
                ("session_id", opt_str(&stored.session_id, style)),
                ("lookahead_token_ids", None),
            ];
            ("BlockStored".into(), fields)
        }
        EventIn::Removed { hashes: list, removed } => {
            let fields = vec![
                ("block_hashes", hashes(list, style)),
                ("medium", opt_str(&removed.medium, style)),
                ("group_idx", opt_int(removed.group_idx.map(i128::from), style)),
                ("locality", opt_str(&removed.locality, style)),
                ("ownership", opt_str(&removed.ownership, style)),
            ];
            ("BlockRemoved".into(), fields)
        }
        EventIn::Cleared => ("AllBlocksCleared".into(), Vec::new()),
        EventIn::Unknown(tag) => (tag.clone(), vec![("future", opt_int(Some(1), style))]),
    }
}

/// Fields that may be left out: trailing nils (positional) or any nil with a default (maps).
const OMITTABLE: &[&str] = &[
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
    "future",
];

fn write_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Some(bytes) => out.extend_from_slice(bytes),
        None => out.push(0xc0),
    }
}

fn positional_event(out: &mut Vec<u8>, event: &EventIn, style: &mut Style) {
    let (tag, mut fields) = fields(event, style);
    let all = fields.len();
    while fields.last().is_some_and(|(name, value)| value.is_none() && OMITTABLE.contains(name))
        && style.coin()
    {
        fields.pop();
    }
    // Elements a newer engine adds go after the full field list only.
    let extra = if fields.len() == all { style.pick(3) } else { 0 };
    array(out, 1 + fields.len() + extra, style);
    str(out, &tag, style);
    fields.iter().for_each(|(_, value)| write_value(out, value));
    (0..extra).for_each(|_| int(out, 7, style));
}

fn map_event(out: &mut Vec<u8>, event: &EventIn, style: &mut Style) {
    let (tag, fields) = fields(event, style);
    let mut entries: Vec<(&str, Value)> = vec![("type", encoded(style, |out, style| str(out, &tag, style)))];
    entries.extend(
        fields
            .into_iter()
            .filter(|(name, value)| value.is_some() || !OMITTABLE.contains(name) || style.coin()),
    );
    if style.coin() {
        entries.push(("x_unknown", encoded(style, |out, style| array(out, 0, style))));
    }
    // Any key order, `type` included (msgspec writes it first, other encoders may not).
    for i in (1..entries.len()).rev() {
        entries.swap(i, style.pick(i + 1));
    }
    map(out, entries.len(), style);
    for (name, value) in &entries {
        str(out, name, style);
        write_value(out, value);
    }
}

/// Writes `batch` (whose events are `events`) in the positional or the map encoding.
pub(super) fn batch(batch: &EventBatch, events: &[EventIn], positional: bool, style: &mut Style) -> Vec<u8> {
    let mut out = Vec::new();
    let ts = |out: &mut Vec<u8>, style: &mut Style| {
        if (batch.ts as f32) as f64 == batch.ts && style.coin() {
            out.push(0xca);
            out.extend_from_slice(&(batch.ts as f32).to_be_bytes());
        } else {
            out.push(0xcb);
            out.extend_from_slice(&batch.ts.to_be_bytes());
        }
    };
    let rank = batch.data_parallel_rank.map(i128::from);
    if positional {
        let with_rank = rank.is_some() || style.coin();
        array(&mut out, if with_rank { 3 } else { 2 }, style);
        ts(&mut out, style);
        array(&mut out, events.len(), style);
        events.iter().for_each(|event| positional_event(&mut out, event, style));
        if with_rank {
            write_value(&mut out, &opt_int(rank, style));
        }
    } else {
        let with_rank = rank.is_some() || style.coin();
        map(&mut out, if with_rank { 3 } else { 2 }, style);
        str(&mut out, "ts", style);
        ts(&mut out, style);
        str(&mut out, "events", style);
        array(&mut out, events.len(), style);
        events.iter().for_each(|event| map_event(&mut out, event, style));
        if with_rank {
            str(&mut out, "data_parallel_rank", style);
            write_value(&mut out, &opt_int(rank, style));
        }
    }
    out
}
