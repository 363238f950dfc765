//! The fleet's KV, mapped off the request path: what the engines hold (a census of each pool's
//! exact index), the hottest prefixes, each tenant's part of it, and the plots' history.
//!
//! The request path only hands over a small record per request routed on the exact index
//! ([`KvMap::record`]: the served prefix's block hashes at O(log n) depths, the prompt's block
//! hashes in the census's sample; one short lock, a bounded ring that drops the oldest). A
//! background task ([`KvMapTask`], built from the registry, the metrics, the tenants'
//! configuration and the clock) drains them every second into bounded tables (`hot.rs`,
//! `tenants.rs`), and every [`CENSUS_MS`] takes the census, a point of the plots
//! (`history.rs`), and publishes the view (`view.rs`) `GET /v1/fleet` reads, and each tenant's
//! KV share, which the admission queue reads for `max_kv_share`.
//!
//! The alignment probe's own blocks are left out of every count ([`KvMap::exclude`]).

mod history;
mod hot;
mod tenants;
mod view;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use kvgate_index::CensusOptions;
use kvgate_policy::TenantsConfig;
use tokio::sync::watch;

use history::{History, Totals};
use hot::HotTable;
use kvgate_fleet::registry::{ModelPool, Registry};
use kvgate_gateway_core::clock::Clock;
use kvgate_gateway_core::metrics::Metrics;
use tenants::TenantPrompts;
pub use view::{EngineKv, HolderView, HotPrefix, KvMapView, PoolKv, TenantKv};

/// Between two censuses (and two points of the plots).
pub const CENSUS_MS: u64 = history::STEP_MS;
/// Records kept between two drains (a second's worth at 4,000 requests/s).
const MAX_RECORDS: usize = 4_096;
/// Distinct blocks counted exactly up to this many per pool, on a sample past it.
const MAX_SAMPLED: usize = 65_536;
/// Hot prefixes listed per pool and order.
const TOP_PREFIXES: usize = 10;
/// The alignment probe's blocks remembered to be left out.
const MAX_PROBE_BLOCKS: usize = 8_192;

/// One request routed on the exact index.
struct KvRecord {
    pool: (String, &'static str),
    tenant: String,
    at_ms: u64,
    /// The served prefix's (depth in blocks, content hash) at the sampled depths.
    chain: Vec<(u32, u64)>,
    /// The prompt's block hashes in the census's sample.
    sampled: Vec<u64>,
}

/// The map's state shared by the request path, the task and the readers.
pub struct KvMap {
    records: Mutex<VecDeque<KvRecord>>,
    /// The last census's sample modulus (the request path keeps the prompt hashes in it).
    sample_modulus: AtomicU64,
    view: ArcSwap<KvMapView>,
    /// Each tenant's share of the fleet's KV, and whether it is over its `max_kv_share`.
    shares: ArcSwap<HashMap<String, (f64, bool)>>,
    probe_blocks: Mutex<(VecDeque<u64>, HashSet<u64>)>,
}

impl Default for KvMap {
    fn default() -> Self {
        Self {
            records: Mutex::new(VecDeque::with_capacity(MAX_RECORDS)),
            sample_modulus: AtomicU64::new(1),
            view: ArcSwap::from_pointee(KvMapView::default()),
            shares: ArcSwap::from_pointee(HashMap::new()),
            probe_blocks: Mutex::default(),
        }
    }
}

impl KvMap {
    /// A request of `tenant` routed on `pool`'s exact index: `hashes` its prompt's block hashes
    /// (the first layout's, of `block_size` tokens), of which `served_tokens` are predicted
    /// served from cache on the chosen engine.
    pub fn record(
        &self,
        pool: (&str, &'static str),
        tenant: &str,
        hashes: &[u64],
        block_size: usize,
        served_tokens: u64,
        at_ms: u64,
    ) {
        let served = u32::try_from(served_tokens / block_size.max(1) as u64).unwrap_or(u32::MAX);
        let chain = hot::sampled_depths(served.min(hashes.len() as u32))
            .map(|depth| (depth, hashes[depth as usize - 1]))
            .collect();
        let modulus = self.sample_modulus.load(Ordering::Relaxed).max(1);
        let sampled = hashes.iter().copied().filter(|hash| hash.is_multiple_of(modulus)).collect();
        let record = KvRecord {
            pool: (pool.0.to_string(), pool.1),
            tenant: tenant.to_string(),
            at_ms,
            chain,
            sampled,
        };
        let mut records = self.records.lock().unwrap_or_else(|p| p.into_inner());
        if records.len() == MAX_RECORDS {
            records.pop_front();
        }
        records.push_back(record);
    }

    /// Blocks of the alignment probe's prompts, left out of the map.
    pub fn exclude(&self, hashes: impl IntoIterator<Item = u64>) {
        let mut blocks = self.probe_blocks.lock().unwrap_or_else(|p| p.into_inner());
        let (order, set) = &mut *blocks;
        for hash in hashes {
            if set.insert(hash) {
                order.push_back(hash);
            }
            while order.len() > MAX_PROBE_BLOCKS {
                if let Some(old) = order.pop_front() {
                    set.remove(&old);
                }
            }
        }
    }

    /// The map as last computed.
    pub fn view(&self) -> Arc<KvMapView> {
        self.view.load_full()
    }

    /// Sets the tenants' shares: (tenant, share, over its `max_kv_share`). The task sets them
    /// every census; admission's tests set them directly.
    pub fn set_shares(&self, shares: impl IntoIterator<Item = (String, f64, bool)>) {
        let shares = shares.into_iter().map(|(tenant, share, over)| (tenant, (share, over))).collect();
        self.shares.store(Arc::new(shares));
    }

    /// Whether `tenant`'s recent requests occupy more of the fleet's KV than its `max_kv_share`.
    pub fn over_share(&self, tenant: &str) -> bool {
        self.shares.load().get(tenant).is_some_and(|&(_, over)| over)
    }
}

/// The background task's parts.
pub struct KvMapTask {
    pub map: Arc<KvMap>,
    pub registry: Arc<Registry>,
    pub metrics: Arc<Metrics>,
    /// The tenants' `max_kv_share`.
    pub tenants: TenantsConfig,
    pub clock: Clock,
}

/// What the task keeps between rounds.
#[derive(Default)]
struct Tables {
    hot: HashMap<(String, &'static str), HotTable>,
    prompts: TenantPrompts,
    history: History,
    /// Per tenant label: the cached-tokens counter last read, and its decayed recent sum.
    cached: HashMap<String, (u64, f64)>,
}

impl KvMapTask {
    pub async fn run(self, mut shutdown: watch::Receiver<bool>) {
        let mut tables = Tables::default();
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut next_census = 0u64;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = shutdown.changed() => return,
            }
            let now_ms = self.clock.now_ms();
            self.drain(&mut tables);
            if now_ms >= next_census {
                next_census = now_ms + CENSUS_MS;
                self.survey(&mut tables, now_ms);
            }
        }
    }

    fn drain(&self, tables: &mut Tables) {
        let records: Vec<KvRecord> = {
            let mut records = self.map.records.lock().unwrap_or_else(|p| p.into_inner());
            records.drain(..).collect()
        };
        for record in records {
            if !record.chain.is_empty() {
                tables.hot.entry(record.pool).or_default().hit(&record.chain, record.at_ms);
            }
            tables.prompts.add(&record.tenant, record.at_ms, record.sampled);
        }
    }

    /// The census of every pool, the plots' point, and the view published.
    fn survey(&self, tables: &mut Tables, now_ms: u64) {
        let metrics = &self.metrics;
        tables.history.step(
            now_ms,
            Totals::read(&metrics.prefix_engine_cached_tokens, &metrics.prefix_prompt_tokens, &metrics.ttfb),
        );
        tables.prompts.expire(now_ms);
        let excluded = self.map.probe_blocks.lock().unwrap_or_else(|p| p.into_inner()).1.clone();
        let snapshot = self.registry.snapshot();
        let mut pools = Vec::new();
        let mut occupied: BTreeMap<String, f64> = BTreeMap::new();
        let mut distinct_total = 0.0;
        let mut modulus = 1;
        for pool in snapshot.pools().filter(|pool| pool.has_kv_events) {
            let key = (pool.model.clone(), pool.role.as_str());
            let hot = tables.hot.entry(key).or_default();
            let by_hits = hot.top(TOP_PREFIXES, now_ms, |hits, _| hits);
            let by_saved = hot.top(TOP_PREFIXES, now_ms, |hits, blocks| hits * f64::from(blocks));
            let watched: HashSet<u64> = by_hits.iter().chain(&by_saved).map(|(hash, _, _)| *hash).collect();
            let census = pool.prefix.exact.census(CensusOptions {
                max_sampled: MAX_SAMPLED,
                watched: &watched,
                excluded: &excluded,
            });
            modulus = modulus.max(census.sample_modulus);
            for (tenant, occupancy) in tables.prompts.occupancy(&census) {
                *occupied.entry(tenant).or_default() += occupancy.tokens;
            }
            distinct_total += census.distinct_blocks() * census.block_size as f64;
            pools.push(pool_kv(pool, &census, (&by_hits, &by_saved)));
        }
        self.map.sample_modulus.store(modulus, Ordering::Relaxed);
        let tenants = self.tenants_kv(tables, &occupied, distinct_total);
        self.map.set_shares(tenants.iter().map(|t| (t.tenant.clone(), t.kv_share, t.over_share)));
        let history =
            view::HistoryView { step_secs: CENSUS_MS as f64 / 1e3, points: tables.history.points() };
        self.map.view.store(Arc::new(KvMapView { at_ms: now_ms, pools, tenants, history }));
    }

    /// Each tenant's cached tokens (recent share, from its counter) and KV occupancy.
    fn tenants_kv(
        &self,
        tables: &mut Tables,
        occupied: &BTreeMap<String, f64>,
        distinct: f64,
    ) -> Vec<TenantKv> {
        let decay = (-(CENSUS_MS as f64) / hot::HALF_LIFE_MS * std::f64::consts::LN_2).exp();
        for (tenant, total) in kvgate_gateway_core::metrics::counter_by_label(
            &self.metrics.admission.tenant_cached_tokens,
            "tenant",
        ) {
            let (last, recent) = tables.cached.entry(tenant).or_default();
            *recent = *recent * decay + total.saturating_sub(*last) as f64;
            *last = total;
        }
        let recent_total: f64 = tables.cached.values().map(|(_, recent)| recent).sum();
        let mut names: Vec<&String> = tables.cached.keys().chain(occupied.keys()).collect();
        names.sort();
        names.dedup();
        names
            .into_iter()
            .map(|tenant| {
                let (total, recent) = tables.cached.get(tenant).copied().unwrap_or_default();
                let occupied_tokens = occupied.get(tenant).copied().unwrap_or(0.0);
                let kv_share = if distinct > 0.0 { occupied_tokens / distinct } else { 0.0 };
                let max_kv_share = self.tenants.limits(tenant).max_kv_share;
                TenantKv {
                    tenant: tenant.clone(),
                    cached_tokens_total: total,
                    cached_share: if recent_total > 0.0 { recent / recent_total } else { 0.0 },
                    occupied_tokens,
                    kv_share,
                    max_kv_share,
                    over_share: max_kv_share.is_some_and(|max| kv_share > max),
                }
            })
            .collect()
    }
}

/// One pool's view from its census and hot prefixes.
fn pool_kv(
    pool: &ModelPool,
    census: &kvgate_index::Census,
    (by_hits, by_saved): (&[hot::Ranked], &[hot::Ranked]),
) -> PoolKv {
    let size = census.block_size as f64;
    let name = |worker: u32| {
        pool.workers
            .iter()
            .find(|w| w.id == worker)
            .map_or_else(|| format!("(removed #{worker})"), |w| w.url.clone())
    };
    let distinct = census.distinct_blocks();
    let sampled = census.sampled.len().max(1) as f64;
    let mut tiers: BTreeMap<String, f64> = BTreeMap::new();
    let engines = census
        .caches
        .iter()
        .map(|(cache, counts)| {
            let engine_tiers: BTreeMap<String, f64> =
                counts.by_tier.iter().map(|(tier, &blocks)| (tier.clone(), blocks as f64 * size)).collect();
            for (tier, tokens) in &engine_tiers {
                *tiers.entry(tier.clone()).or_default() += tokens;
            }
            EngineKv {
                worker: name(cache.worker),
                cached_tokens: counts.blocks as f64 * size,
                share_of_distinct: if distinct > 0.0 { counts.blocks as f64 / distinct } else { 0.0 },
                unique_share: counts.sampled_alone as f64 / sampled,
                tiers: engine_tiers,
            }
        })
        .collect();
    let hot = |list: &[hot::Ranked]| {
        list.iter()
            .map(|&(hash, entry, hits)| {
                let holders = census.watched.get(&hash).map(Vec::as_slice).unwrap_or_default();
                let tokens = u64::from(entry.blocks) * census.block_size as u64;
                HotPrefix {
                    prefix: format!("{hash:016x}"),
                    tokens,
                    hits,
                    saved_tokens: hits * tokens as f64,
                    copies: holders.len(),
                    engines: holders
                        .iter()
                        .map(|holder| HolderView {
                            worker: name(holder.cache.worker),
                            tier: holder.tier.clone(),
                        })
                        .collect(),
                }
            })
            .collect()
    };
    PoolKv {
        model: pool.model.clone(),
        role: pool.role.as_str(),
        block_size: census.block_size,
        held_tokens: census.held_blocks as f64 * size,
        distinct_tokens: distinct * size,
        copies_per_block: census.copies_per_block(),
        sampled_one_in: census.sample_modulus,
        tiers,
        engines,
        hot_by_hits: hot(by_hits),
        hot_by_saved_tokens: hot(by_saved),
    }
}
