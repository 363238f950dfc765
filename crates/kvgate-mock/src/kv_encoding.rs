//! Encodes an engine's KV event batch as vLLM's msgpack `KVEventBatch`, in either form vLLM has shipped (positional arrays or maps).
//!
//! Array form (msgspec `array_like=True`, events `tag=True`): `[ts, [event, ...], dp_rank]` with
//! each event one of `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
//! lora_id, medium]`, `["BlockRemoved", block_hashes, medium]` or `["AllBlocksCleared"]`.
//!
//! Map form (current vLLM): `{"ts", "events", "data_parallel_rank"}` with each event a map tagged
//! by `"type"`: `{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
//! "block_size", "lora_id", "medium", "lora_name"}`, `{"type": "BlockRemoved", "block_hashes",
//! "medium"}` or `{"type": "AllBlocksCleared"}` (fields with defaults are omitted, as msgspec's
//! `omit_defaults=True` does).
//!
//! `lora_id`, `medium` and `lora_name` are always nil.

use kvgate_engine::{KvEvent, KvEventBatch};
use rmp::encode::{write_array_len, write_f64, write_map_len, write_nil, write_str, write_uint};

use crate::args::KvEventEncoding;

type Written = std::io::Result<()>;

/// Encodes one batch in `encoding`, stamped `timestamp_secs` (Unix seconds).
pub(crate) fn encode_batch(
    batch: &KvEventBatch,
    timestamp_secs: f64,
    dp_rank: u32,
    encoding: KvEventEncoding,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    let written = match encoding {
        KvEventEncoding::Array => write_array_batch(&mut out, batch, timestamp_secs, dp_rank),
        KvEventEncoding::Map => write_map_batch(&mut out, batch, timestamp_secs, dp_rank),
    };
    // Writing to a Vec cannot fail (it grows), and no length reaches 2^32.
    debug_assert!(written.is_ok());
    out
}

/// A msgpack length; collections here are far below 2^32 items.
fn len(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn write_array_batch(out: &mut Vec<u8>, batch: &KvEventBatch, timestamp_secs: f64, dp_rank: u32) -> Written {
    write_array_len(out, 3)?;
    write_f64(out, timestamp_secs)?;
    write_array_len(out, len(batch.events.len()))?;
    for event in &batch.events {
        write_array_event(out, event)?;
    }
    write_uint(out, u64::from(dp_rank))?;
    Ok(())
}

fn write_array_event(out: &mut Vec<u8>, event: &KvEvent) -> Written {
    match event {
        KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size } => {
            write_array_len(out, 7)?;
            write_str(out, "BlockStored")?;
            write_hashes(out, block_hashes)?;
            write_parent(out, *parent_block_hash)?;
            write_tokens(out, token_ids)?;
            write_uint(out, u64::from(*block_size))?;
            write_nil(out)?; // lora_id
            write_nil(out)?; // medium
        }
        KvEvent::BlockRemoved { block_hashes } => {
            write_array_len(out, 3)?;
            write_str(out, "BlockRemoved")?;
            write_hashes(out, block_hashes)?;
            write_nil(out)?; // medium
        }
        KvEvent::AllBlocksCleared => {
            write_array_len(out, 1)?;
            write_str(out, "AllBlocksCleared")?;
        }
    }
    Ok(())
}

fn write_map_batch(out: &mut Vec<u8>, batch: &KvEventBatch, timestamp_secs: f64, dp_rank: u32) -> Written {
    write_map_len(out, 3)?;
    write_str(out, "ts")?;
    write_f64(out, timestamp_secs)?;
    write_str(out, "events")?;
    write_array_len(out, len(batch.events.len()))?;
    for event in &batch.events {
        write_map_event(out, event)?;
    }
    write_str(out, "data_parallel_rank")?;
    write_uint(out, u64::from(dp_rank))?;
    Ok(())
}

fn write_map_event(out: &mut Vec<u8>, event: &KvEvent) -> Written {
    match event {
        KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size } => {
            write_map_len(out, 8)?;
            write_tag(out, "BlockStored")?;
            write_str(out, "block_hashes")?;
            write_hashes(out, block_hashes)?;
            write_str(out, "parent_block_hash")?;
            write_parent(out, *parent_block_hash)?;
            write_str(out, "token_ids")?;
            write_tokens(out, token_ids)?;
            write_str(out, "block_size")?;
            write_uint(out, u64::from(*block_size))?;
            for field in ["lora_id", "medium", "lora_name"] {
                write_str(out, field)?;
                write_nil(out)?;
            }
        }
        KvEvent::BlockRemoved { block_hashes } => {
            write_map_len(out, 3)?;
            write_tag(out, "BlockRemoved")?;
            write_str(out, "block_hashes")?;
            write_hashes(out, block_hashes)?;
            write_str(out, "medium")?;
            write_nil(out)?;
        }
        KvEvent::AllBlocksCleared => {
            write_map_len(out, 1)?;
            write_tag(out, "AllBlocksCleared")?;
        }
    }
    Ok(())
}

/// msgspec's tag field of a map-encoded event.
fn write_tag(out: &mut Vec<u8>, tag: &str) -> Written {
    write_str(out, "type")?;
    write_str(out, tag)?;
    Ok(())
}

fn write_hashes(out: &mut Vec<u8>, hashes: &[u64]) -> Written {
    write_array_len(out, len(hashes.len()))?;
    for &hash in hashes {
        write_uint(out, hash)?;
    }
    Ok(())
}

fn write_parent(out: &mut Vec<u8>, parent: Option<u64>) -> Written {
    match parent {
        Some(hash) => write_uint(out, hash).map(|_| ())?,
        None => write_nil(out)?,
    }
    Ok(())
}

fn write_tokens(out: &mut Vec<u8>, tokens: &[u32]) -> Written {
    write_array_len(out, len(tokens.len()))?;
    for &token in tokens {
        write_uint(out, u64::from(token))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> KvEventBatch {
        KvEventBatch {
            seq: 3,
            timestamp_us: 0,
            events: vec![
                KvEvent::BlockStored {
                    block_hashes: vec![1, u64::MAX],
                    parent_block_hash: None,
                    token_ids: vec![7, 8],
                    block_size: 1,
                },
                KvEvent::BlockRemoved { block_hashes: vec![1] },
                KvEvent::AllBlocksCleared,
            ],
        }
    }

    /// Appends a msgpack fixstr.
    fn fixstr(out: &mut Vec<u8>, text: &str) {
        assert!(text.len() < 32);
        out.push(0xa0 | text.len() as u8);
        out.extend_from_slice(text.as_bytes());
    }

    #[test]
    fn encodes_like_msgspec_array_like_tagged_structs() {
        let bytes = encode_batch(&sample(), 1.5, 0, KvEventEncoding::Array);
        let mut expected = vec![0x93, 0xcb];
        expected.extend_from_slice(&1.5f64.to_be_bytes());
        expected.push(0x93); // three events
        expected.push(0x97);
        fixstr(&mut expected, "BlockStored");
        expected.extend_from_slice(&[0x92, 0x01, 0xcf]);
        expected.extend_from_slice(&u64::MAX.to_be_bytes());
        expected.extend_from_slice(&[0xc0, 0x92, 0x07, 0x08, 0x01, 0xc0, 0xc0]);
        expected.push(0x93);
        fixstr(&mut expected, "BlockRemoved");
        expected.extend_from_slice(&[0x91, 0x01, 0xc0]);
        expected.push(0x91);
        fixstr(&mut expected, "AllBlocksCleared");
        expected.push(0x00); // dp rank
        assert_eq!(bytes, expected);
    }

    #[test]
    fn encodes_like_msgspec_tagged_structs_as_maps() {
        let bytes = encode_batch(&sample(), 1.5, 0, KvEventEncoding::Map);
        let mut expected = vec![0x83];
        fixstr(&mut expected, "ts");
        expected.push(0xcb);
        expected.extend_from_slice(&1.5f64.to_be_bytes());
        fixstr(&mut expected, "events");
        expected.push(0x93); // three events
        expected.push(0x88);
        fixstr(&mut expected, "type");
        fixstr(&mut expected, "BlockStored");
        fixstr(&mut expected, "block_hashes");
        expected.extend_from_slice(&[0x92, 0x01, 0xcf]);
        expected.extend_from_slice(&u64::MAX.to_be_bytes());
        fixstr(&mut expected, "parent_block_hash");
        expected.push(0xc0);
        fixstr(&mut expected, "token_ids");
        expected.extend_from_slice(&[0x92, 0x07, 0x08]);
        fixstr(&mut expected, "block_size");
        expected.push(0x01);
        for field in ["lora_id", "medium", "lora_name"] {
            fixstr(&mut expected, field);
            expected.push(0xc0);
        }
        expected.push(0x83);
        fixstr(&mut expected, "type");
        fixstr(&mut expected, "BlockRemoved");
        fixstr(&mut expected, "block_hashes");
        expected.extend_from_slice(&[0x91, 0x01]);
        fixstr(&mut expected, "medium");
        expected.push(0xc0);
        expected.push(0x81);
        fixstr(&mut expected, "type");
        fixstr(&mut expected, "AllBlocksCleared");
        fixstr(&mut expected, "data_parallel_rank");
        expected.push(0x00);
        assert_eq!(bytes, expected);
    }

    #[test]
    fn a_parent_hash_is_an_unsigned_integer() {
        let batch = KvEventBatch {
            seq: 0,
            timestamp_us: 0,
            events: vec![KvEvent::BlockStored {
                block_hashes: vec![2],
                parent_block_hash: Some(300),
                token_ids: vec![],
                block_size: 16,
            }],
        };
        let bytes = encode_batch(&batch, 0.0, 0, KvEventEncoding::Array);
        // [ts, [["BlockStored", [2], 300, [], 16, nil, nil]], 0]
        let event = &bytes[11..];
        assert_eq!(&event[..13], b"\x97\xabBlockStored");
        assert_eq!(&event[13..], [0x91, 0x02, 0xcd, 0x01, 0x2c, 0x90, 0x10, 0xc0, 0xc0, 0x00]);
    }
}
