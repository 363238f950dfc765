//! A census of what the index says the engines hold: per engine cache its blocks by tier, the
//! fleet's distinct blocks (how many copies of each), and who holds a few watched blocks (the
//! hottest prefixes). One pass over the shards, each under its read lock in turn, for a host's
//! background task or an admin request: never the request path.
//!
//! Memory stays bounded whatever the index's size: distinct blocks are counted on a sample of
//! the content hashes (those whose value is a multiple of a power of two chosen so that at most
//! `max_sampled` are kept; content hashes are xxh3, so every block is as likely to be sampled),
//! and scaled back.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::{credit_units, BlockIndex, CacheId, IN_FLIGHT_RANK};

/// What a census looks at.
#[derive(Clone, Copy, Debug)]
pub struct CensusOptions<'a> {
    /// Most distinct blocks kept to count them (the sample's size).
    pub max_sampled: usize,
    /// Blocks whose holders are listed (by content hash).
    pub watched: &'a HashSet<u64>,
    /// Blocks left out of every count (the alignment probe's own).
    pub excluded: &'a HashSet<u64>,
}

/// One engine cache's holdings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheCensus {
    pub blocks: usize,
    /// Blocks by the medium of their best tier (`GPU`, `CPU`, ...).
    pub by_tier: BTreeMap<String, usize>,
    /// Sampled blocks it holds, and of those the ones no other cache holds.
    pub sampled: usize,
    pub sampled_alone: usize,
}

/// A holder of a watched block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    pub cache: CacheId,
    pub tier: String,
}

/// The census.
#[derive(Clone, Debug, Default)]
pub struct Census {
    /// Tokens per block (the first layout's; 0 before any store).
    pub block_size: usize,
    /// Engine caches (in-flight prompts are not holdings).
    pub caches: BTreeMap<CacheId, CacheCensus>,
    /// Blocks held, summed over the caches (a block held twice counts twice).
    pub held_blocks: usize,
    /// Distinct blocks are counted on content hashes that are multiples of this.
    pub sample_modulus: u64,
    /// The sampled distinct blocks and how many caches hold each.
    pub sampled: HashMap<u64, u32>,
    /// The holders of each watched block found.
    pub watched: HashMap<u64, Vec<Holder>>,
}

impl Census {
    /// The fleet's distinct blocks (estimated from the sample, exact when the modulus is 1).
    pub fn distinct_blocks(&self) -> f64 {
        self.sampled.len() as f64 * self.sample_modulus as f64
    }

    /// Blocks held per distinct block: 1.0 when no block is held twice.
    pub fn copies_per_block(&self) -> f64 {
        let sampled_held: u64 = self.sampled.values().map(|&n| u64::from(n)).sum();
        match self.sampled.len() {
            0 => 0.0,
            distinct => sampled_held as f64 / distinct as f64,
        }
    }

    /// Whether a content hash falls in the sample.
    pub fn in_sample(&self, hash: u64) -> bool {
        hash.is_multiple_of(self.sample_modulus.max(1))
    }
}

impl BlockIndex {
    /// Counts what the engine caches hold (see the module's comment).
    pub fn census(&self, options: CensusOptions<'_>) -> Census {
        let sizes: Vec<(u64, usize)> = {
            let sizes = self.sizes.lock().unwrap_or_else(|p| p.into_inner());
            sizes.iter().map(|(&key, &n)| (key, n)).filter(|&(key, _)| key as u32 != IN_FLIGHT_RANK).collect()
        };
        let held: usize = sizes.iter().map(|&(_, n)| n).sum();
        let mut modulus = 1u64;
        while held as u64 / modulus > options.max_sampled.max(1) as u64 {
            modulus *= 2;
        }
        let tier_names = self.tier_names();
        let mut census = Census {
            block_size: self.block_size(),
            held_blocks: 0,
            sample_modulus: modulus,
            ..Census::default()
        };
        // Per sampled block: how many caches hold it, and the first one (for "alone").
        let mut first_holder: HashMap<u64, u64> = HashMap::new();
        for shard in self.shards.iter() {
            let shard = shard.read().unwrap_or_else(|p| p.into_inner());
            for segment in shard.values().flatten() {
                let cache = CacheId { worker: CacheId::worker_of(segment.cache), rank: segment.cache as u32 };
                if cache.rank == IN_FLIGHT_RANK {
                    continue;
                }
                let tier = tier_names.get(&segment.credit).map_or("mixed", String::as_str);
                let entry = census.caches.entry(cache).or_default();
                for &hash in &segment.hashes {
                    if options.excluded.contains(&hash) {
                        continue;
                    }
                    entry.blocks += 1;
                    *entry.by_tier.entry(tier.to_string()).or_default() += 1;
                    census.held_blocks += 1;
                    if hash.is_multiple_of(modulus) {
                        entry.sampled += 1;
                        *census.sampled.entry(hash).or_default() += 1;
                        first_holder.entry(hash).or_insert(segment.cache);
                    }
                    if options.watched.contains(&hash) {
                        census
                            .watched
                            .entry(hash)
                            .or_default()
                            .push(Holder { cache, tier: tier.to_string() });
                    }
                }
            }
        }
        for (hash, &holders) in &census.sampled {
            if holders == 1 {
                let key = first_holder[hash];
                let cache = CacheId { worker: CacheId::worker_of(key), rank: key as u32 };
                if let Some(entry) = census.caches.get_mut(&cache) {
                    entry.sampled_alone += 1;
                }
            }
        }
        census.caches.retain(|_, entry| entry.blocks > 0);
        for holders in census.watched.values_mut() {
            holders.sort_by_key(|holder| holder.cache);
            holders.dedup_by_key(|holder| holder.cache);
        }
        census
    }

    /// The medium named by each credit a segment can carry (the first medium of that weight).
    fn tier_names(&self) -> HashMap<u32, String> {
        let table = self.tiers.read().unwrap_or_else(|p| p.into_inner());
        let mut names = HashMap::new();
        for (residency, &weight) in table.residencies.iter().zip(&table.weights) {
            let credit = u32::try_from(credit_units(weight)).unwrap_or(u32::MAX);
            names.entry(credit).or_insert_with(|| residency.medium.clone());
        }
        names
    }
}
