//! Applying a publisher's events to its cache's writer in the block index: what each engine's
//! fields mean for the index (groups, tiers, LoRA adapters, cache salts, extra keys, EAGLE
//! lookahead and bigrams, offload placeholders), and which events are refused, one at a time.

use kvgate_index::{Adapter, ApplyError, CacheBlocks, Namespace, Residency, StoredBlocks};

use crate::{BlockRemoved, BlockStored, EventBatch, ExtraKey, KvEvent, TokenIds};

/// Why one event of a batch was not applied (the `reason` label of the refusal metric). The
/// batch's other events are applied all the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// The decoder could not read the event ([`KvEvent::Invalid`]).
    Malformed,
    /// The parent block is unknown (its store was missed, or it was removed since).
    UnknownParent,
    /// The event's shape is inconsistent: token count against block size and hashes, per-block
    /// lists of another length, bigrams that do not chain.
    Inconsistent,
    /// A block size the index cannot walk in addition to the ones it knows.
    TooManyLayouts,
    /// An event type this gateway does not know.
    UnknownEvent,
    /// Its blocks would take the cache past what its engine can hold.
    OverCapacity,
}

impl Refusal {
    pub const ALL: [Refusal; 6] = [
        Refusal::Malformed,
        Refusal::UnknownParent,
        Refusal::Inconsistent,
        Refusal::TooManyLayouts,
        Refusal::UnknownEvent,
        Refusal::OverCapacity,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Malformed => "malformed",
            Refusal::UnknownParent => "unknown_parent",
            Refusal::Inconsistent => "inconsistent",
            Refusal::TooManyLayouts => "too_many_layouts",
            Refusal::UnknownEvent => "unknown_event",
            Refusal::OverCapacity => "over_capacity",
        }
    }
}

/// Applies every event of `batch` in order; calls `refused` for each event not applied.
pub fn apply_batch(cache: &mut CacheBlocks, batch: &EventBatch, refused: &mut dyn FnMut(Refusal)) {
    for event in &batch.events {
        if let Err(refusal) = apply_event(cache, event) {
            refused(refusal);
        }
    }
}

/// Applies one event to its cache's writer.
pub fn apply_event(cache: &mut CacheBlocks, event: &KvEvent) -> Result<(), Refusal> {
    match event {
        KvEvent::BlockStored(stored) => apply_stored(cache, stored),
        KvEvent::BlockRemoved(removed) => {
            apply_removed(cache, removed);
            Ok(())
        }
        KvEvent::AllBlocksCleared => {
            cache.clear();
            Ok(())
        }
        KvEvent::Unknown(_) => Err(Refusal::UnknownEvent),
        KvEvent::Invalid(_) => Err(Refusal::Malformed),
    }
}

fn apply_removed(cache: &mut CacheBlocks, removed: &BlockRemoved) {
    let residency =
        Residency::of(removed.medium.as_deref(), removed.locality.as_deref(), removed.ownership.as_deref());
    // Hashes the index never held (missed stores, refused events) are nothing to remove.
    cache.apply_removed(removed.group_idx.unwrap_or(0), &removed.block_hashes, &residency);
}

fn apply_stored(cache: &mut CacheBlocks, stored: &BlockStored) -> Result<(), Refusal> {
    let blocks = stored.block_hashes.len();
    let (tokens, lookahead) = tokens_and_lookahead(stored, blocks)?;
    let adapter = match (&stored.lora_name, stored.lora_id) {
        (Some(name), _) => Some(Adapter::Name(name)),
        (None, Some(id)) => Some(Adapter::Id(id)),
        (None, None) => None,
    };
    let keys = BlockKeys::read(stored, blocks)?;
    let residency =
        Residency::of(stored.medium.as_deref(), stored.locality.as_deref(), stored.ownership.as_deref());
    let event = StoredBlocks {
        group: stored.group_idx.unwrap_or(0),
        block_hashes: &stored.block_hashes,
        parent_block_hash: stored.parent_block_hash,
        token_ids: &tokens,
        block_size: stored.block_size,
        lookahead: &lookahead,
        opaque: &keys.opaque,
        namespace: Namespace { adapter, cache_salt: stored.cache_salt.as_deref().or(keys.salt.as_deref()) },
        residency: &residency,
    };
    cache.apply_stored(event).map_err(|error| match error {
        ApplyError::UnknownParent(_) => Refusal::UnknownParent,
        ApplyError::TooManyLayouts { .. } => Refusal::TooManyLayouts,
        ApplyError::OverCapacity { .. } => Refusal::OverCapacity,
        ApplyError::ZeroBlockSize | ApplyError::TokenCount { .. } | ApplyError::PerBlockCount { .. } => {
            Refusal::Inconsistent
        }
    })
}

/// The block tokens, and per block the tokens after it its hash covers: vLLM's
/// `lookahead_token_ids` as sent; for SGLang's bigram pages (a page of `block_size` pairs covers
/// tokens `i..i+block_size` and, through its last pair, token `i+block_size`) the pairs' first
/// elements and each page's last second element. Either way a prompt matches a block only when
/// it also has that next token, as the engine's own hash requires.
fn tokens_and_lookahead(stored: &BlockStored, blocks: usize) -> Result<(Vec<u32>, Vec<u32>), Refusal> {
    let block_size = stored.block_size as usize;
    match (&stored.token_ids, &stored.lookahead_token_ids) {
        (TokenIds::Plain(ids), None) => Ok((ids.clone(), Vec::new())),
        (TokenIds::Plain(ids), Some(per_block)) => {
            let width = per_block.first().map_or(0, Vec::len);
            if per_block.len() != blocks || per_block.iter().any(|after| after.len() != width) {
                return Err(Refusal::Inconsistent);
            }
            Ok((ids.clone(), per_block.concat()))
        }
        (TokenIds::Bigrams(pairs), None) => {
            let chained = pairs.windows(2).all(|w| w[0][1] == w[1][0]);
            if !chained || block_size == 0 || pairs.len() != blocks * block_size {
                return Err(Refusal::Inconsistent);
            }
            let next = (1..=blocks).map(|page| pairs[page * block_size - 1][1]).collect();
            Ok((pairs.iter().map(|pair| pair[0]).collect(), next))
        }
        (TokenIds::Bigrams(_), Some(_)) => Err(Refusal::Inconsistent),
    }
}

/// What vLLM's per-block `extra_keys` mean for the index: the LoRA name (the adapter, known from
/// `lora_name` already), the cache salt (a bare string on the chain's first block) and the rest
/// (multimodal items, prompt-embedding hashes), which no request can reproduce at the gateway.
struct BlockKeys {
    salt: Option<String>,
    /// Per block, a digest of the keys kvgate cannot reproduce (0: none); empty when none.
    opaque: Vec<u64>,
}

impl BlockKeys {
    fn read(stored: &BlockStored, blocks: usize) -> Result<BlockKeys, Refusal> {
        let mut keys = BlockKeys { salt: None, opaque: Vec::new() };
        let Some(per_block) = &stored.extra_keys else { return Ok(keys) };
        // An offload placeholder names blocks without them; it has nothing to hash.
        if stored.block_size == 0 {
            return Ok(keys);
        }
        if per_block.len() != blocks {
            return Err(Refusal::Inconsistent);
        }
        let lora = stored.lora_name.as_deref();
        let mut opaque = vec![0u64; blocks];
        for (i, block) in per_block.iter().enumerate() {
            let mut rest: Vec<&ExtraKey> = block.iter().flatten().collect();
            // The hasher writes the LoRA name first.
            if let (Some(name), Some(first)) = (lora, rest.first()) {
                if first.as_str() == Some(name) {
                    rest.remove(0);
                }
            }
            if i == 0 && stored.parent_block_hash.is_none() {
                // The salt is the chain's first block's bare string (after any multimodal items).
                if let Some(at) = rest.iter().rposition(|key| key.as_str().is_some()) {
                    keys.salt = rest.remove(at).as_str().map(str::to_owned);
                }
            }
            if !rest.is_empty() {
                opaque[i] = digest(&rest).max(1);
            }
        }
        if opaque.iter().any(|&digest| digest != 0) {
            keys.opaque = opaque;
        }
        Ok(keys)
    }
}

/// A stable digest of extra keys (tagged and length-prefixed, so distinct keys differ).
fn digest(keys: &[&ExtraKey]) -> u64 {
    fn write(key: &ExtraKey, out: &mut Vec<u8>) {
        let mut bytes = |tag: u8, value: &[u8]| {
            out.push(tag);
            out.extend_from_slice(&(value.len() as u64).to_le_bytes());
            out.extend_from_slice(value);
        };
        match key {
            ExtraKey::Nil => bytes(b'0', &[]),
            ExtraKey::Bool(v) => bytes(b'b', &[u8::from(*v)]),
            ExtraKey::Int(v) => bytes(b'i', &v.to_le_bytes()),
            ExtraKey::Float(bits) => bytes(b'f', &bits.to_le_bytes()),
            ExtraKey::Str(text) => bytes(b's', text.as_bytes()),
            ExtraKey::Bytes(data) => bytes(b'y', data),
            ExtraKey::Array(items) => {
                bytes(b'a', &(items.len() as u64).to_le_bytes());
                items.iter().for_each(|item| write(item, out));
            }
        }
    }
    let mut out = Vec::new();
    keys.iter().for_each(|key| write(key, &mut out));
    xxhash_rust::xxh3::xxh3_64(&out)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kvgate_index::{BlockIndex, CacheId, PrefixMatch};

    use super::*;

    fn stored(hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32>) -> KvEvent {
        KvEvent::BlockStored(BlockStored {
            block_hashes: hashes,
            parent_block_hash: parent,
            token_ids: tokens.into(),
            block_size: 2,
            ..BlockStored::default()
        })
    }

    fn matched(index: &BlockIndex, tokens: &[u32], namespace: Namespace<'_>) -> usize {
        let mut out = PrefixMatch::default();
        index.overlap(tokens, namespace, &mut out);
        out.matched(4)
    }

    #[test]
    fn one_bad_event_is_refused_alone() {
        let index = Arc::new(BlockIndex::new());
        let mut cache = CacheBlocks::new(index.clone(), CacheId { worker: 4, rank: 0 });
        let KvEvent::BlockStored(mut lora) = stored(vec![9], None, vec![1, 2]) else { unreachable!() };
        lora.lora_name = Some("adapter".into());
        let batch = EventBatch {
            ts: 0.0,
            events: vec![
                stored(vec![1, 2], None, vec![1, 2, 3, 4]),
                stored(vec![3], Some(2), vec![5, 6]),
                stored(vec![8], Some(77), vec![5, 6]),
                stored(vec![4], None, vec![1]),
                KvEvent::Invalid(crate::InvalidEvent { location: "event 4".into(), reason: "bad".into() }),
                KvEvent::BlockStored(lora),
                KvEvent::BlockRemoved(BlockRemoved { block_hashes: vec![3, 55], ..BlockRemoved::default() }),
                KvEvent::Unknown("Future".into()),
            ],
            data_parallel_rank: None,
        };
        let mut refusals = Vec::new();
        apply_batch(&mut cache, &batch, &mut |refusal| refusals.push(refusal));
        assert_eq!(
            refusals,
            [Refusal::UnknownParent, Refusal::Inconsistent, Refusal::Malformed, Refusal::UnknownEvent]
        );
        assert_eq!(matched(&index, &[1, 2, 3, 4, 5, 6], Namespace::BASE), 4, "block 3 stored, then removed");
        assert_eq!(matched(&index, &[1, 2], Namespace::adapter("adapter")), 2, "the adapter's own block");
        let clear = EventBatch { ts: 0.0, events: vec![KvEvent::AllBlocksCleared], data_parallel_rank: None };
        apply_batch(&mut cache, &clear, &mut |_| {});
        assert!(index.is_empty());
    }

    #[test]
    fn bigrams_become_tokens_with_a_lookahead() {
        let index = Arc::new(BlockIndex::new());
        let mut cache = CacheBlocks::new(index.clone(), CacheId { worker: 4, rank: 0 });
        let pairs = |tokens: &[u32]| TokenIds::Bigrams(tokens.windows(2).map(|w| [w[0], w[1]]).collect());
        let event = BlockStored {
            block_hashes: vec![1, 2],
            token_ids: pairs(&[1, 2, 3, 4, 5]),
            block_size: 2,
            ..BlockStored::default()
        };
        apply_event(&mut cache, &KvEvent::BlockStored(event)).unwrap();
        assert_eq!(matched(&index, &[1, 2, 3, 4, 5], Namespace::BASE), 4);
        assert_eq!(matched(&index, &[1, 2, 3, 4], Namespace::BASE), 2, "page 2 needs token 5 after it");
        let broken = BlockStored {
            block_hashes: vec![7],
            token_ids: TokenIds::Bigrams(vec![[1, 2], [3, 4]]),
            block_size: 2,
            ..BlockStored::default()
        };
        assert_eq!(apply_event(&mut cache, &KvEvent::BlockStored(broken)), Err(Refusal::Inconsistent));
    }

    #[test]
    fn extra_keys_name_the_adapter_the_salt_and_what_no_request_has() {
        let index = Arc::new(BlockIndex::new());
        let mut cache = CacheBlocks::new(index.clone(), CacheId { worker: 4, rank: 0 });
        let str_key = |text: &str| ExtraKey::Str(text.into());
        let image = ExtraKey::Array(vec![str_key("img"), ExtraKey::Int(-3)]);
        let event =
            |hashes: Vec<u64>, tokens: Vec<u32>, keys: Vec<Option<Vec<ExtraKey>>>, lora: Option<&str>| {
                KvEvent::BlockStored(BlockStored {
                    block_hashes: hashes,
                    token_ids: tokens.into(),
                    block_size: 2,
                    lora_name: lora.map(str::to_owned),
                    lora_id: lora.map(|_| 7),
                    extra_keys: Some(keys),
                    ..BlockStored::default()
                })
            };
        let salted = event(vec![1, 2], vec![1, 2, 3, 4], vec![Some(vec![str_key("tenant-a")]), None], None);
        apply_event(&mut cache, &salted).unwrap();
        let lora =
            event(vec![3], vec![1, 2], vec![Some(vec![str_key("sql"), str_key("tenant-a")])], Some("sql"));
        apply_event(&mut cache, &lora).unwrap();
        let with_image = event(vec![5, 6], vec![7, 7, 8, 8], vec![None, Some(vec![image])], None);
        apply_event(&mut cache, &with_image).unwrap();
        let salt = |name| Namespace::BASE.with_salt(Some(name));
        assert_eq!(matched(&index, &[1, 2, 3, 4], salt("tenant-a")), 4);
        assert_eq!(
            matched(&index, &[1, 2, 3, 4], Namespace::BASE),
            0,
            "never a salted block for an unsalted prompt"
        );
        assert_eq!(matched(&index, &[1, 2], Namespace::adapter("sql").with_salt(Some("tenant-a"))), 2);
        assert_eq!(matched(&index, &[1, 2], Namespace::adapter("sql")), 0);
        assert_eq!(matched(&index, &[7, 7, 8, 8], Namespace::BASE), 2, "the image's block matches nothing");
        let wrong_count = event(vec![9], vec![1, 2], vec![None, None], None);
        assert_eq!(apply_event(&mut cache, &wrong_count), Err(Refusal::Inconsistent));
    }
}
