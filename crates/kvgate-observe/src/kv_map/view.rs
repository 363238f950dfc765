//! The fleet's KV as `GET /v1/fleet` shows it (its `kv` object): per pool whose engines publish
//! KV events, each engine's cached tokens and share of the fleet's distinct ones, the copies per
//! block, the tiers, and the hottest prefixes with the engines holding them; per tenant the
//! cached tokens its requests used and the share of the fleet's KV its recent requests occupy;
//! and the plots' points.

use std::collections::BTreeMap;

use serde::Serialize;

use super::history::HistoryPoint;

/// The whole map, as the background task last computed it.
#[derive(Clone, Debug, Default, Serialize)]
pub struct KvMapView {
    /// When it was computed, on the gateway's clock (0: not yet).
    pub at_ms: u64,
    pub pools: Vec<PoolKv>,
    pub tenants: Vec<TenantKv>,
    pub history: HistoryView,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct HistoryView {
    pub step_secs: f64,
    pub points: Vec<HistoryPoint>,
}

/// One pool's KV (a model, or one side of a disaggregated pair).
#[derive(Clone, Debug, Serialize)]
pub struct PoolKv {
    pub model: String,
    pub role: &'static str,
    pub block_size: usize,
    /// Tokens cached, summed over the engines (a block held twice counts twice).
    pub held_tokens: f64,
    /// The fleet's distinct cached tokens (estimated on a sample past 65,536 blocks).
    pub distinct_tokens: f64,
    /// Engines holding each distinct block, on average: 1.0 is no duplication.
    pub copies_per_block: f64,
    /// Distinct blocks were counted on one content hash in this many.
    pub sampled_one_in: u64,
    /// Cached tokens by the tier holding them (`GPU`, `CPU`, ...), summed over the engines.
    pub tiers: BTreeMap<String, f64>,
    pub engines: Vec<EngineKv>,
    /// The prefixes most hit recently (hits halve every 5 minutes).
    pub hot_by_hits: Vec<HotPrefix>,
    /// The prefixes whose hits saved the most prefill tokens recently (hits x length).
    pub hot_by_saved_tokens: Vec<HotPrefix>,
}

/// One engine's holdings.
#[derive(Clone, Debug, Serialize)]
pub struct EngineKv {
    pub worker: String,
    pub cached_tokens: f64,
    /// Its cached tokens over the fleet's distinct ones.
    pub share_of_distinct: f64,
    /// The share of the fleet's distinct tokens held by it alone.
    pub unique_share: f64,
    pub tiers: BTreeMap<String, f64>,
}

/// One hot prefix.
#[derive(Clone, Debug, Serialize)]
pub struct HotPrefix {
    /// The content hash of its last block (kvgate's, hex).
    pub prefix: String,
    pub tokens: u64,
    /// Recent hits (decayed).
    pub hits: f64,
    /// Prefill tokens those hits saved: hits x tokens.
    pub saved_tokens: f64,
    /// How many engines hold it now, and which on which tier.
    pub copies: usize,
    pub engines: Vec<HolderView>,
}

#[derive(Clone, Debug, Serialize)]
pub struct HolderView {
    pub worker: String,
    pub tier: String,
}

/// One tenant's use of the fleet's KV.
#[derive(Clone, Debug, Serialize)]
pub struct TenantKv {
    pub tenant: String,
    /// Engine-reported cached tokens of its requests since the start
    /// (`kvgate_tenant_cached_tokens_total`).
    pub cached_tokens_total: u64,
    /// Its share of every tenant's cached tokens, recently (halving every 5 minutes).
    pub cached_share: f64,
    /// Tokens of the fleet's distinct cached ones its requests of the last 5 minutes occupy.
    pub occupied_tokens: f64,
    pub kv_share: f64,
    /// Its `max_kv_share`, and whether it is over it (it then loses locality priority).
    pub max_kv_share: Option<f64>,
    pub over_share: bool,
}
