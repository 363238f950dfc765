//! Which part of the fleet's KV each tenant's recent requests occupy: per tenant, the distinct
//! sampled blocks its prompts used in the last [`RECENT_MS`] (bounded: [`MAX_HASHES_PER_TENANT`]
//! per tenant, [`MAX_TENANTS`] tenants), met with the census's sample of the blocks the engines
//! hold. A block two tenants' prompts
//! share (a common system prompt) counts for both, so the shares can add up past 1.

use std::collections::HashMap;

use kvgate_index::Census;

/// Blocks not used for this long no longer count as the tenant's.
pub const RECENT_MS: u64 = 300_000;
/// Most distinct sampled blocks kept per tenant (the least recently used go first).
const MAX_HASHES_PER_TENANT: usize = 32_768;
/// Most tenants tracked (the least recently seen goes first).
const MAX_TENANTS: usize = 64;

#[derive(Debug, Default)]
struct Recent {
    /// Each distinct sampled block of its prompts, and when a prompt last used it.
    used: HashMap<u64, u64>,
    last_ms: u64,
}

impl Recent {
    /// Keeps the most recently used three quarters when over the bound.
    fn trim(&mut self) {
        if self.used.len() <= MAX_HASHES_PER_TENANT {
            return;
        }
        let mut times: Vec<u64> = self.used.values().copied().collect();
        times.sort_unstable_by(|a, b| b.cmp(a));
        let keep_after = times[MAX_HASHES_PER_TENANT * 3 / 4];
        self.used.retain(|_, at| *at > keep_after);
    }
}

/// Every tracked tenant's recently used blocks.
#[derive(Debug, Default)]
pub struct TenantPrompts {
    tenants: HashMap<String, Recent>,
}

/// One tenant's part of the fleet's KV.
#[derive(Clone, Debug, PartialEq)]
pub struct Occupancy {
    /// Tokens of its recent prompts the engines hold (each distinct block once).
    pub tokens: f64,
    /// Of the fleet's distinct cached tokens.
    pub share: f64,
}

impl TenantPrompts {
    /// A request of `tenant` at `now_ms` whose prompt's sampled block hashes are `hashes`.
    pub fn add(&mut self, tenant: &str, now_ms: u64, hashes: Vec<u64>) {
        if !self.tenants.contains_key(tenant) && self.tenants.len() >= MAX_TENANTS {
            if let Some(oldest) =
                self.tenants.iter().min_by_key(|(_, recent)| recent.last_ms).map(|(t, _)| t.clone())
            {
                self.tenants.remove(&oldest);
            }
        }
        let recent = self.tenants.entry(tenant.to_string()).or_default();
        for hash in hashes {
            recent.used.insert(hash, now_ms);
        }
        recent.last_ms = now_ms;
        recent.trim();
    }

    /// Forgets blocks unused for [`RECENT_MS`] and tenants left with none.
    pub fn expire(&mut self, now_ms: u64) {
        for recent in self.tenants.values_mut() {
            recent.used.retain(|_, at| now_ms.saturating_sub(*at) <= RECENT_MS);
        }
        self.tenants.retain(|_, recent| !recent.used.is_empty());
    }

    /// Each tenant's occupancy against `census` (its distinct sampled blocks the engines hold,
    /// scaled by the sample).
    pub fn occupancy(&self, census: &Census) -> Vec<(String, Occupancy)> {
        let distinct = census.distinct_blocks();
        let mut all: Vec<(String, Occupancy)> = self
            .tenants
            .iter()
            .map(|(tenant, recent)| {
                let held = recent
                    .used
                    .keys()
                    .filter(|hash| census.in_sample(**hash) && census.sampled.contains_key(hash))
                    .count() as f64
                    * census.sample_modulus as f64;
                let share = if distinct > 0.0 { held / distinct } else { 0.0 };
                (tenant.clone(), Occupancy { tokens: held * census.block_size as f64, share })
            })
            .collect();
        all.sort_by(|a, b| b.1.share.total_cmp(&a.1.share).then(a.0.cmp(&b.0)));
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn census(held: &[u64]) -> Census {
        Census {
            block_size: 16,
            sample_modulus: 1,
            sampled: held.iter().map(|&hash| (hash, 1)).collect(),
            ..Census::default()
        }
    }

    #[test]
    fn a_tenants_share_is_what_its_recent_prompts_hold_of_the_fleet() {
        let mut prompts = TenantPrompts::default();
        prompts.add("chat", 0, vec![1, 2, 3]);
        prompts.add("chat", 10, vec![1, 2, 4]);
        prompts.add("batch", 10, vec![1, 9]);
        let shares = prompts.occupancy(&census(&[1, 2, 3, 5]));
        assert_eq!(shares[0], ("chat".to_string(), Occupancy { tokens: 48.0, share: 0.75 }));
        assert_eq!(
            shares[1],
            ("batch".to_string(), Occupancy { tokens: 16.0, share: 0.25 }),
            "the shared block counts for both"
        );
        prompts.expire(RECENT_MS + 5);
        let shares = prompts.occupancy(&census(&[1, 2, 3, 5]));
        assert_eq!(shares.len(), 2);
        assert_eq!(
            shares[0].1.tokens, 32.0,
            "block 3, used by chat's first request only, expired: {shares:?}"
        );
        prompts.expire(2 * RECENT_MS);
        assert!(prompts.occupancy(&census(&[1])).is_empty());
    }

    #[test]
    fn memory_is_bounded_per_tenant_and_in_tenants() {
        let mut prompts = TenantPrompts::default();
        for i in 0..100u64 {
            prompts.add("flood", i, (0..1_000).map(|h| i * 1_000 + h).collect());
        }
        assert!(prompts.tenants["flood"].used.len() <= MAX_HASHES_PER_TENANT);
        assert!(prompts.tenants["flood"].used.contains_key(&99_999), "the newest stay");
        for t in 0..(2 * MAX_TENANTS) {
            prompts.add(&format!("t{t}"), 1_000 + t as u64, vec![1]);
        }
        assert_eq!(prompts.tenants.len(), MAX_TENANTS);
    }
}
