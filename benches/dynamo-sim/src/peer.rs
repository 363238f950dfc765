//! Dynamo's selection core (`dynamo_kv_router::services::selection`, crates.io 1.6.1) as a `kvgate sim` outside policy: the simulated engines' KV events feed its indexer, its `select_and_reserve` routes every request (booking its prefill tokens and decode blocks), and the engines' first tokens and finishes release the bookings, as Dynamo's frontend reports them.
//!
//! The service is Dynamo's own (`SelectionServiceBuilder` with its reference worker-selection
//! policy and `KvRouterConfig::default()` unless the entry overrides a weight), hosted in a
//! single-threaded tokio runtime of our own: the embedding-host path Dynamo documents for hosts
//! that carry the KV events themselves (`KvIndexSource::Owned` with a `KvEventIngress` that only
//! opens the partition's index; the host applies the events). Before every selection the index
//! is flushed, so Dynamo routes on every event the engines emitted up to that instant, as
//! kvgate's exact index does in the simulator.
//!
//! Time: with Dynamo's default prefill-load model (`none`) its selection reads no clock (a
//! booking's prefill tokens count until `prefill_complete`, its blocks until
//! `free_reservation`); its wall-clock leak guard (active-request expiry, minutes) never fires
//! because every request is released. Randomness (temperature sampling, ties) is `fastrand`'s
//! thread-local generator, seeded from `--seed` before each run, on this one thread.

use std::sync::Arc;

use anyhow::{anyhow, bail, Context};
use async_trait::async_trait;
use dynamo_kv_router::config::{apply_deprecated_overlap_score_weight_override, KvRouterConfig};
use dynamo_kv_router::plugins::RouterPluginRegistry;
use dynamo_kv_router::protocols::{
    compute_block_hash_for_seq, BlockHashOptions, ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData,
    KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData, RouterEvent, RoutingConstraints,
    StorageTier,
};
use dynamo_kv_router::services::indexer::backend::Indexer;
use dynamo_kv_router::services::indexer::registry::WorkerRegistry;
use dynamo_kv_router::services::selection::{
    KvEventIngress, KvIndexSource, PromptRequest, SelectAndReserveRequest, SelectionService,
    SelectionServiceBuilder, WorkerRequest,
};
use dynamo_kv_router::{RoutingPartitionId, WorkerSelectionPolicy, WorkerType};
use kvgate_sim::outside::{KvEvent, KvEventBatch, Tier};
use kvgate_sim::{OutsideCandidate, OutsidePolicy, OutsideRequest};

const MODEL: &str = "model";
const GROUP: &str = "default";

/// A `dynamo[:name=value...]` entry's settings: Dynamo's router configuration.
#[derive(Clone, Debug)]
pub struct DynamoSettings {
    pub config: KvRouterConfig,
}

/// A weight's setter on Dynamo's router configuration.
type Knob = fn(&mut KvRouterConfig, f64);

/// The weights a `dynamo` entry may set, by Dynamo's `KvRouterConfig` names (and the older
/// `overlap_score_weight`, which Dynamo maps to `prefill_load_scale`, and `temperature`).
pub const DYNAMO_KNOBS: &[(&str, Knob)] = &[
    ("overlap_score_weight", |config, weight| {
        apply_deprecated_overlap_score_weight_override(
            weight,
            &mut config.overlap_score_credit,
            &mut config.prefill_load_scale,
        )
    }),
    ("prefill_load_scale", |config, value| config.prefill_load_scale = value),
    ("overlap_score_credit", |config, value| config.overlap_score_credit = value),
    ("overlap_score_credit_decay", |config, value| config.overlap_score_credit_decay = value),
    ("temperature", |config, value| config.router_temperature = value),
    ("router_temperature", |config, value| config.router_temperature = value),
    ("decode_active_request_weight", |config, value| config.decode_active_request_weight = value),
];

impl DynamoSettings {
    /// Dynamo's defaults with `overrides` applied, in order; an unknown name or a value that is
    /// not a number is an error naming it.
    pub fn new(overrides: &[(String, String)]) -> anyhow::Result<DynamoSettings> {
        let mut config = KvRouterConfig::default();
        for (name, value) in overrides {
            let Some((_, set)) = DYNAMO_KNOBS.iter().find(|(known, _)| known == name) else {
                let known: Vec<&str> = DYNAMO_KNOBS.iter().map(|(known, _)| *known).collect();
                bail!("dynamo: unknown weight {name} (known: {})", known.join(", "));
            };
            let number: f64 =
                value.parse().with_context(|| format!("dynamo {name}={value}: not a number"))?;
            set(&mut config, number);
        }
        config.validate_config().map_err(|e| anyhow!("dynamo: {e}"))?;
        Ok(DynamoSettings { config })
    }
}

/// The partition's index is opened by the registry, as Dynamo's own ZMQ ingress opens it; the
/// simulator host applies the events itself.
struct HostFedIngress;

#[async_trait]
impl KvEventIngress for HostFedIngress {
    fn open(&self, registry: &WorkerRegistry, key: &RoutingPartitionId, block_size: u32) -> Indexer {
        registry.get_or_create_indexer(key.clone(), block_size)
    }
}

/// One engine as Dynamo's catalog knows it.
#[derive(Clone, Copy, Debug)]
pub struct DynamoWorker {
    pub block_size: u32,
    /// The engine's prefill chunk (`max_num_batched_tokens`).
    pub max_num_batched_tokens: u64,
    pub total_kv_blocks: u64,
}

/// Dynamo's selection service routing a simulated fleet.
pub struct DynamoPolicy {
    runtime: tokio::runtime::Runtime,
    service: SelectionService,
    indexer: Indexer,
    /// Next event id per engine.
    event_ids: Vec<u64>,
    /// Events applied since the last flush.
    unflushed: bool,
    /// What Dynamo answered, for the report: selections, prompt tokens it saw cached on the
    /// chosen engine (device tier), and selections it refused.
    pub selections: u64,
    pub overlap_tokens: u64,
    pub prompt_tokens: u64,
    pub refused: u64,
    pub first_error: Option<String>,
}

impl DynamoPolicy {
    /// A fresh service with `settings` and the fleet's `workers` (Dynamo worker ids 0..n).
    pub fn new(
        settings: &DynamoSettings,
        workers: &[DynamoWorker],
        seed: u64,
    ) -> anyhow::Result<DynamoPolicy> {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        fastrand::seed(seed);
        let service = runtime.block_on(async {
            let registry =
                RouterPluginRegistry::default().with_default_factory(Arc::new(|config, role, _| {
                    WorkerSelectionPolicy::reference(config.clone(), role.default_selector_label())
                }));
            let service =
                SelectionServiceBuilder::new(settings.config.clone(), WorkerType::Aggregated, registry)
                    .kv_index(KvIndexSource::Owned(Arc::new(HostFedIngress)))
                    .indexer_threads(1)
                    .build()
                    .await?;
            for (id, worker) in workers.iter().enumerate() {
                service.upsert_worker(worker_request(id as u64, worker)).await.map_err(|e| anyhow!("{e}"))?;
            }
            anyhow::Ok(service)
        })?;
        let key = RoutingPartitionId::new(MODEL, GROUP);
        let partition = service.core().partition(&key).ok_or_else(|| anyhow!("dynamo: no partition"))?;
        let indexer = partition.indexer().clone();
        Ok(DynamoPolicy {
            runtime,
            service,
            indexer,
            event_ids: vec![0; workers.len()],
            unflushed: false,
            selections: 0,
            overlap_tokens: 0,
            prompt_tokens: 0,
            refused: 0,
            first_error: None,
        })
    }

    fn note_error(&mut self, error: String) {
        self.first_error.get_or_insert(error);
    }
}

fn worker_request(id: u64, worker: &DynamoWorker) -> WorkerRequest {
    WorkerRequest {
        worker_id: id,
        model_name: MODEL.to_string(),
        routing_group: GROUP.to_string(),
        endpoint: Some(format!("http://127.0.0.1:{}", 20_000 + id)),
        kv_events_endpoint: None,
        kv_events_endpoints: Default::default(),
        replay_endpoint: None,
        block_size: Some(worker.block_size),
        data_parallel_start_rank: None,
        data_parallel_size: None,
        max_num_batched_tokens: Some(worker.max_num_batched_tokens),
        total_kv_blocks: Some(worker.total_kv_blocks),
        stable_routing_id: None,
        is_eagle: None,
        taints: Default::default(),
        topology_domains: Default::default(),
        kv_transfer_domain: None,
        kv_transfer_enforcement: None,
        kv_transfer_preferred_weight: None,
        router_hint_worker_type: None,
        router_hint_source_control_endpoints: Default::default(),
        kv_event_source_mode: None,
    }
}

fn storage_tier(tier: Tier) -> StorageTier {
    match tier {
        Tier::Gpu => StorageTier::Device,
        Tier::Cpu => StorageTier::HostPinned,
    }
}

/// An engine's KV event as Dynamo's publisher would send it: engine block hashes as external
/// hashes, each stored block's tokens hashed as Dynamo hashes a prompt's blocks.
fn router_event(worker: u64, event_id: u64, event: &KvEvent) -> RouterEvent {
    let (data, tier) = match event {
        KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, tier, .. } => {
            let local = compute_block_hash_for_seq(token_ids, *block_size, BlockHashOptions::default());
            let blocks = block_hashes
                .iter()
                .zip(local)
                .map(|(&hash, tokens_hash)| KvCacheStoredBlockData {
                    block_hash: ExternalSequenceBlockHash(hash),
                    tokens_hash,
                    mm_extra_info: None,
                })
                .collect();
            let data = KvCacheStoreData {
                parent_hash: parent_block_hash.map(ExternalSequenceBlockHash),
                start_position: None,
                blocks,
            };
            (KvCacheEventData::Stored(data), *tier)
        }
        KvEvent::BlockRemoved { block_hashes, tier } => {
            let block_hashes = block_hashes.iter().map(|&h| ExternalSequenceBlockHash(h)).collect();
            (KvCacheEventData::Removed(KvCacheRemoveData { block_hashes }), *tier)
        }
        KvEvent::AllBlocksCleared => (KvCacheEventData::Cleared, Tier::Gpu),
    };
    RouterEvent::with_storage_tier(worker, KvCacheEvent { event_id, data, dp_rank: 0 }, storage_tier(tier))
}

async fn flush(indexer: &Indexer) -> Result<(), String> {
    match indexer {
        Indexer::Single { primary, .. } => {
            primary.flush_and_wait().await.map(drop).map_err(|e| e.to_string())
        }
        Indexer::Concurrent { primary, .. } => primary.flush_and_wait().await.map_err(|e| e.to_string()),
        Indexer::Remote { .. } | Indexer::None => Ok(()),
    }
}

impl OutsidePolicy for DynamoPolicy {
    fn kv_events(&mut self, worker: usize, batches: &[KvEventBatch], _now_us: u64) {
        let mut failed = None;
        self.runtime.block_on(async {
            for batch in batches {
                for event in &batch.events {
                    let id = self.event_ids[worker];
                    self.event_ids[worker] += 1;
                    if let Err(error) =
                        self.indexer.apply_event_routed(router_event(worker as u64, id, event)).await
                    {
                        failed.get_or_insert(format!("KV event refused: {error}"));
                    }
                }
            }
        });
        self.unflushed = true;
        if let Some(error) = failed {
            self.note_error(error);
        }
    }

    fn select(&mut self, request: &OutsideRequest<'_>, candidates: &[OutsideCandidate]) -> Option<usize> {
        let reserve = SelectAndReserveRequest {
            model_name: MODEL.to_string(),
            routing_group: GROUP.to_string(),
            selection_id: Some(request.id.to_string()),
            prompt: PromptRequest { token_ids: Some(request.prompt.to_vec()), ..PromptRequest::default() },
            router_config_override: None,
            expected_output_tokens: None,
            priority_jump: None,
            strict_priority: None,
            session_id: None,
            session_context: None,
            affinity_target: None,
            pinned_worker: None,
            allowed_worker_ids: None,
            routing_constraints: RoutingConstraints::default(),
        };
        let unflushed = std::mem::take(&mut self.unflushed);
        let answer = self.runtime.block_on(async {
            if unflushed {
                flush(&self.indexer).await?;
            }
            self.service.select_and_reserve(reserve).await.map_err(|e| e.to_string())
        });
        match answer {
            Ok(selected) => {
                self.selections += 1;
                self.overlap_tokens += selected.overlap.gpu as u64;
                self.prompt_tokens += u64::from(request.prompt_tokens);
                let worker = selected.worker_id as usize;
                candidates.iter().any(|c| c.worker == worker).then_some(worker)
            }
            Err(error) => {
                self.refused += 1;
                self.note_error(error);
                None
            }
        }
    }

    fn first_token(&mut self, _worker: usize, id: u64, _now_us: u64) {
        if let Err(error) = self.runtime.block_on(self.service.prefill_complete(&id.to_string())) {
            self.note_error(format!("prefill_complete: {error}"));
        }
    }

    fn finished(&mut self, _worker: usize, id: u64, _now_us: u64) {
        if let Err(error) = self.runtime.block_on(self.service.free_reservation(&id.to_string())) {
            self.note_error(format!("free_reservation: {error}"));
        }
    }
}
