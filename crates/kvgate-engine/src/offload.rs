//! The host-memory (CPU) tier of an engine with KV offloading, as vLLM's offloading connector
//! runs it: every block entering the GPU prefix cache is also copied to host memory (store on
//! write), the host tier evicts least recently used blocks when full, and a prompt whose prefix
//! continues in host memory past its GPU hit loads those blocks back instead of recomputing them.

use lru::LruCache;

/// Blocks held in host memory, by chained block hash, least recently used first out.
#[derive(Debug)]
pub(crate) struct HostTier {
    blocks: LruCache<u64, ()>,
    capacity_blocks: usize,
}

impl HostTier {
    /// A tier of `capacity_blocks` blocks (at least one).
    pub(crate) fn new(capacity_blocks: usize) -> Self {
        HostTier { blocks: LruCache::unbounded(), capacity_blocks: capacity_blocks.max(1) }
    }

    /// How many leading hashes of `hashes` the tier holds, without touching them.
    pub(crate) fn peek_prefix(&self, hashes: &[u64]) -> usize {
        hashes.iter().take_while(|hash| self.blocks.contains(hash)).count()
    }

    /// How many leading hashes of `hashes` the tier holds; those become the most recently used.
    pub(crate) fn match_prefix(&mut self, hashes: &[u64]) -> usize {
        hashes.iter().take_while(|hash| self.blocks.get(hash).is_some()).count()
    }

    /// Copies `hashes` in (a block held already only becomes the most recently used). Hashes
    /// newly held are appended to `stored`, those evicted to make room to `evicted`.
    pub(crate) fn offload(&mut self, hashes: &[u64], stored: &mut Vec<u64>, evicted: &mut Vec<u64>) {
        for &hash in hashes {
            if self.blocks.get(&hash).is_some() {
                continue;
            }
            if self.blocks.len() == self.capacity_blocks {
                if let Some((old, ())) = self.blocks.pop_lru() {
                    evicted.push(old);
                }
            }
            self.blocks.put(hash, ());
            stored.push(hash);
        }
    }

    pub(crate) fn clear(&mut self) {
        self.blocks.clear();
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.blocks.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_on_write_and_evicts_the_least_recently_used() {
        let mut tier = HostTier::new(3);
        let (mut stored, mut evicted) = (Vec::new(), Vec::new());
        tier.offload(&[1, 2, 3], &mut stored, &mut evicted);
        assert_eq!((stored.as_slice(), evicted.as_slice()), (&[1, 2, 3][..], &[][..]));
        assert_eq!(tier.match_prefix(&[1, 2, 9]), 2, "1 and 2 are now the most recent");
        stored.clear();
        tier.offload(&[2, 4], &mut stored, &mut evicted);
        assert_eq!((stored.as_slice(), evicted.as_slice()), (&[4][..], &[3][..]));
        assert_eq!((tier.peek_prefix(&[1, 2, 4]), tier.len()), (3, 3));
        tier.clear();
        assert_eq!(tier.peek_prefix(&[1]), 0);
    }
}
