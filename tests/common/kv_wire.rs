//! A KV event publisher the test drives by hand (an engine that says what the test wants), and
//! vLLM's positional msgpack encoding of the events it sends, written with `rmp`.

use bytes::Bytes;

/// `[ts, [events], 0]` (positional encoding) with the given encoded events.
pub fn batch(events: &[Vec<u8>]) -> Vec<u8> {
    use rmp::encode::{write_array_len, write_f64, write_uint};
    let mut payload = Vec::new();
    write_array_len(&mut payload, 3).unwrap();
    write_f64(&mut payload, 1.0).unwrap();
    write_array_len(&mut payload, events.len() as u32).unwrap();
    for event in events {
        payload.extend_from_slice(event);
    }
    write_uint(&mut payload, 0).unwrap();
    payload
}

/// `["BlockStored", hashes, parent, token_ids, block_size, nil, nil]`.
pub fn block_stored(hashes: &[u64], parent: Option<u64>, token_ids: &[u32], block_size: u32) -> Vec<u8> {
    use rmp::encode::{write_array_len, write_nil, write_str, write_uint};
    let mut event = Vec::new();
    write_array_len(&mut event, 7).unwrap();
    write_str(&mut event, "BlockStored").unwrap();
    write_array_len(&mut event, hashes.len() as u32).unwrap();
    for &hash in hashes {
        write_uint(&mut event, hash).unwrap();
    }
    match parent {
        Some(hash) => drop(write_uint(&mut event, hash).unwrap()),
        None => write_nil(&mut event).unwrap(),
    }
    write_array_len(&mut event, token_ids.len() as u32).unwrap();
    for &token in token_ids {
        write_uint(&mut event, u64::from(token)).unwrap();
    }
    write_uint(&mut event, u64::from(block_size)).unwrap();
    write_nil(&mut event).unwrap();
    write_nil(&mut event).unwrap();
    event
}

/// `["AllBlocksCleared"]`.
pub fn all_blocks_cleared() -> Vec<u8> {
    let mut event = vec![0x91, 0xb0];
    event.extend_from_slice(b"AllBlocksCleared");
    event
}

/// A ZMQ PUB socket on a free loopback port, numbering its batches.
pub struct Publisher {
    socket: zeromq::PubSocket,
    pub endpoint: String,
    pub seq: u64,
}

impl Publisher {
    pub async fn bind() -> Publisher {
        use zeromq::Socket;
        let mut socket = zeromq::PubSocket::new();
        let endpoint = socket.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        Publisher { socket, endpoint, seq: 0 }
    }

    pub async fn send(&mut self, frames: Vec<Vec<u8>>) {
        use zeromq::SocketSend;
        let frames: Vec<Bytes> = frames.into_iter().map(Bytes::from).collect();
        self.socket.send(zeromq::ZmqMessage::try_from(frames).unwrap()).await.unwrap();
    }

    /// Publishes `payload` as the next batch.
    pub async fn publish(&mut self, payload: Vec<u8>) {
        let seq = self.seq;
        self.seq += 1;
        self.send(vec![Vec::new(), seq.to_be_bytes().to_vec(), payload]).await;
    }

    /// Publishes empty batches until `reached` says the subscriber got one (ZMQ's slow joiner),
    /// for up to 5 s.
    pub async fn wait_subscribed(&mut self, mut reached: impl AsyncFnMut() -> bool) {
        for _ in 0..100 {
            self.publish(batch(&[all_blocks_cleared()])).await;
            if reached().await {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        panic!("the gateway's subscription never reached the publisher");
    }
}
