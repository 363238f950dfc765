//! Publishes an engine's KV events over ZMQ PUB in vLLM's wire format (topic, 8-byte big-endian sequence number, msgpack `KVEventBatch`).
//!
//! The payload is what vLLM's msgspec structs (`array_like=True`, events `tag=True`) encode to:
//! `[ts, [event, ...], data_parallel_rank]` with each event one of
//! `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`,
//! `["BlockRemoved", block_hashes, medium]` or `["AllBlocksCleared"]` (`lora_id` and `medium`
//! are nil).

use anyhow::Context;
use bytes::Bytes;
use kvgate_engine::{KvEvent, KvEventBatch};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

use crate::driver::EngineClock;

/// A bound PUB socket and the endpoint subscribers connect to.
pub(crate) struct KvPublisher {
    socket: PubSocket,
    endpoint: String,
}

impl KvPublisher {
    /// Binds a PUB socket on `host:port` (port 0 picks a free one).
    pub(crate) async fn bind(host: &str, port: u16) -> anyhow::Result<Self> {
        let mut socket = PubSocket::new();
        let endpoint = socket
            .bind(&format!("tcp://{host}:{port}"))
            .await
            .with_context(|| format!("binding the KV event publisher on {host}:{port}"))?;
        Ok(Self { socket, endpoint: endpoint.to_string() })
    }

    /// `tcp://host:port` of the bound socket.
    pub(crate) fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Publishes every batch received on `batches` until the channel closes.
    pub(crate) fn spawn(
        mut self,
        topic: String,
        clock: EngineClock,
        mut batches: mpsc::UnboundedReceiver<KvEventBatch>,
    ) -> JoinHandle<()> {
        let topic = Bytes::from(topic.into_bytes());
        tokio::spawn(async move {
            while let Some(batch) = batches.recv().await {
                let payload = encode_batch(&batch, clock.unix_secs_at(batch.timestamp_us), 0);
                let frames = vec![
                    topic.clone(),
                    Bytes::copy_from_slice(&batch.seq.to_be_bytes()),
                    Bytes::from(payload),
                ];
                let message = ZmqMessage::try_from(frames).expect("three frames are not empty");
                if let Err(error) = self.socket.send(message).await {
                    tracing::warn!(%error, endpoint = %self.endpoint, "KV event publish failed");
                }
            }
        })
    }
}

/// Encodes one batch as vLLM's msgpack `KVEventBatch`.
pub(crate) fn encode_batch(batch: &KvEventBatch, timestamp_secs: f64, dp_rank: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    encode_into(&mut out, batch, timestamp_secs, dp_rank).expect("writing to a Vec cannot fail");
    out
}

fn encode_into(
    out: &mut Vec<u8>,
    batch: &KvEventBatch,
    timestamp_secs: f64,
    dp_rank: u32,
) -> Result<(), Box<dyn std::error::Error>> {
    use rmp::encode::{write_array_len, write_f64, write_nil, write_str, write_uint};

    let len = |n: usize| u32::try_from(n).expect("fewer than 2^32 items");
    write_array_len(out, 3)?;
    write_f64(out, timestamp_secs)?;
    write_array_len(out, len(batch.events.len()))?;
    for event in &batch.events {
        match event {
            KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size } => {
                write_array_len(out, 7)?;
                write_str(out, "BlockStored")?;
                write_array_len(out, len(block_hashes.len()))?;
                for &hash in block_hashes {
                    write_uint(out, hash)?;
                }
                match parent_block_hash {
                    Some(hash) => {
                        write_uint(out, *hash)?;
                    }
                    None => write_nil(out)?,
                }
                write_array_len(out, len(token_ids.len()))?;
                for &token in token_ids {
                    write_uint(out, u64::from(token))?;
                }
                write_uint(out, u64::from(*block_size))?;
                write_nil(out)?; // lora_id
                write_nil(out)?; // medium
            }
            KvEvent::BlockRemoved { block_hashes } => {
                write_array_len(out, 3)?;
                write_str(out, "BlockRemoved")?;
                write_array_len(out, len(block_hashes.len()))?;
                for &hash in block_hashes {
                    write_uint(out, hash)?;
                }
                write_nil(out)?; // medium
            }
            KvEvent::AllBlocksCleared => {
                write_array_len(out, 1)?;
                write_str(out, "AllBlocksCleared")?;
            }
        }
    }
    write_uint(out, u64::from(dp_rank))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_like_msgspec_array_like_tagged_structs() {
        let batch = KvEventBatch {
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
        };
        let bytes = encode_batch(&batch, 1.5, 0);
        let mut expected = vec![0x93, 0xcb];
        expected.extend_from_slice(&1.5f64.to_be_bytes());
        expected.push(0x93); // three events
        expected.extend_from_slice(&[0x97, 0xab]);
        expected.extend_from_slice(b"BlockStored");
        expected.extend_from_slice(&[0x92, 0x01, 0xcf]);
        expected.extend_from_slice(&u64::MAX.to_be_bytes());
        expected.extend_from_slice(&[0xc0, 0x92, 0x07, 0x08, 0x01, 0xc0, 0xc0]);
        expected.extend_from_slice(&[0x93, 0xac]);
        expected.extend_from_slice(b"BlockRemoved");
        expected.extend_from_slice(&[0x91, 0x01, 0xc0]);
        expected.extend_from_slice(&[0x91, 0xb0]);
        expected.extend_from_slice(b"AllBlocksCleared");
        expected.push(0x00); // dp rank
        assert_eq!(bytes, expected);
    }
}
