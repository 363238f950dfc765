//! The gateway's own endpoints: liveness, readiness, models, metrics, and worker management
//! (list, add, remove: the HTTP side of `registration.rs`) behind the optional admin key.

use std::time::Instant;

use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::json;

use kvgate_fleet::registry::NewWorker;
use kvgate_fleet::worker::{CircuitState, Worker};
use kvgate_gateway_core::auth::check_admin_key;
use kvgate_gateway_core::config::KvEventsSource;
use kvgate_gateway_core::error::ApiError;
use kvgate_protocol::role::WorkerRole;
use kvgate_proxy::state::SharedState;

pub async fn health() -> impl IntoResponse {
    Json(json!({"status": "ok"}))
}

pub async fn readiness(State(state): State<SharedState>) -> Response {
    let now = Instant::now();
    let snapshot = state.registry.snapshot();
    let ready = snapshot.workers.iter().filter(|w| w.is_routable(now)).count();
    if ready > 0 {
        Json(json!({"status": "ready", "healthy_workers": ready, "total_workers": snapshot.workers.len()}))
            .into_response()
    } else {
        ApiError::NoHealthyWorker(String::new()).into_response()
    }
}

/// `GET /v1/models`: the union of the models served by healthy workers.
pub async fn models(State(state): State<SharedState>) -> impl IntoResponse {
    let now = Instant::now();
    let snapshot = state.registry.snapshot();
    let data: Vec<_> = snapshot
        .models
        .values()
        .filter(|pools| pools.all().any(|pool| pool.workers.iter().any(|w| w.is_routable(now))))
        .map(|pools| json!({"id": pools.model(), "object": "model", "created": 0, "owned_by": "kvgate"}))
        .collect();
    Json(json!({"object": "list", "data": data}))
}

pub async fn metrics(State(state): State<SharedState>) -> impl IntoResponse {
    kvgate_fleet::monitor::update_age_gauges(
        &state.registry,
        &state.loads,
        state.clock,
        &state.metrics.loads,
    );
    for pools in state.registry.snapshot().models.values() {
        let with_events: Vec<_> = pools.all().filter(|pool| pool.has_kv_events).collect();
        if !with_events.is_empty() {
            let blocks: usize = with_events.iter().map(|pool| pool.prefix.exact.len()).sum();
            state.metrics.kv_events.index_blocks.with_label_values(&[pools.model()]).set(blocks as i64);
        }
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.metrics.render())
}

/// `GET /get_loads`: the load monitor's snapshot, with each entry's age.
pub async fn get_loads(State(state): State<SharedState>) -> impl IntoResponse {
    Json(kvgate_fleet::monitor::snapshot_json(&state.registry, &state.loads, state.clock))
}

#[derive(Serialize)]
pub struct WorkerInfo {
    pub id: u32,
    pub url: String,
    pub model_id: Option<String>,
    pub healthy: bool,
    pub in_flight: u64,
    pub circuit_state: CircuitState,
    /// regular, prefill or decode.
    pub worker_type: WorkerRole,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
    /// `--dp-aware`: its data-parallel rank inside the engine at `address`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dp_rank: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// The worker's KV event publishers, and how many of its ranks' events flow into the index.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<KvEventsInfo>,
    /// The closed loop: does the index agree with what the engine reports cached? (Present once
    /// an answer was compared.)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index_accuracy: Option<IndexAccuracyInfo>,
    /// The alignment probe's last report and the worker's quarantine (present once it was
    /// probed or quarantined).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alignment: Option<AlignmentInfo>,
}

#[derive(Serialize)]
pub struct IndexAccuracyInfo {
    /// Answered requests in the window (the last 100).
    pub requests: usize,
    /// Sum of |predicted - engine-reported cached tokens| over the window's prompt tokens.
    pub error_share: f64,
    /// The share of the window's engine-reported cached tokens the index did not predict (the
    /// engine's hits beyond each prediction; the index misses what follows a shared start).
    pub missed_share: f64,
    /// A persistent disagreement (more than 10% over a full window), with its likely cause.
    pub disagreement: Option<DisagreementInfo>,
}

#[derive(Serialize)]
pub struct DisagreementInfo {
    pub cause: &'static str,
    pub error_share: f64,
    /// The share of the window's requests claiming cached tokens (either side) that were wrong.
    pub wrong_share: f64,
    /// The share of the engine-reported cached tokens the index did not predict.
    pub missed_share: f64,
    pub advice: &'static str,
}

/// A worker's alignment: the last probe's report (`outcome`, `cause`, each form's observations
/// and verdict, the sentinel, `at_ms` on the gateway's clock), what to check, the quarantine.
#[derive(Serialize)]
pub struct AlignmentInfo {
    #[serde(flatten)]
    pub report: Option<kvgate_fleet::index_health::ProbeReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub advice: Option<&'static str>,
    pub quarantined: bool,
}

impl AlignmentInfo {
    pub fn of(worker: &Worker) -> Option<Self> {
        let report = worker.index_health.report();
        let quarantined = worker.index_health.quarantined();
        (report.is_some() || quarantined).then(|| AlignmentInfo {
            advice: report.as_ref().and_then(|report| report.cause()).map(|cause| cause.advice()),
            report,
            quarantined,
        })
    }
}

#[derive(Serialize)]
pub struct KvEventsInfo {
    #[serde(flatten)]
    pub source: KvEventsSource,
    pub live_ranks: usize,
    /// Every rank's events flow: the exact index is current for this worker.
    pub flowing: bool,
}

impl WorkerInfo {
    fn of(worker: &Worker, now: Instant) -> Self {
        Self {
            id: worker.id,
            url: worker.url.clone(),
            model_id: worker.model().map(str::to_string),
            healthy: worker.is_healthy(),
            in_flight: worker.in_flight(),
            circuit_state: worker.circuit.state(now),
            worker_type: worker.role,
            bootstrap_port: worker.bootstrap_port,
            dp_rank: worker.dp_rank,
            address: worker.dp_rank.map(|_| worker.address.clone()),
            kv_events: worker.kv_events.clone().map(|source| KvEventsInfo {
                source,
                live_ranks: worker.kv_live_ranks(),
                flowing: worker.kv_events_flowing(),
            }),
            index_accuracy: index_accuracy(worker),
            alignment: AlignmentInfo::of(worker),
        }
    }
}

fn index_accuracy(worker: &Worker) -> Option<IndexAccuracyInfo> {
    accuracy_info(worker.index_accuracy())
}

fn accuracy_info(
    (requests, error_share, missed_share, disagreement): (
        usize,
        f64,
        f64,
        Option<kvgate_index::Disagreement>,
    ),
) -> Option<IndexAccuracyInfo> {
    (requests > 0).then(|| IndexAccuracyInfo {
        requests,
        error_share,
        missed_share,
        disagreement: disagreement.map(|d| DisagreementInfo {
            cause: d.cause.as_str(),
            error_share: d.error_share,
            wrong_share: d.wrong_share,
            missed_share: d.missed_share,
            advice: d.cause.advice(),
        }),
    })
}

pub async fn list_workers(
    State(state): State<SharedState>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    check_admin_key(state.config.admin_api_key.as_deref(), &headers)?;
    let now = Instant::now();
    let snapshot = state.registry.snapshot();
    let workers: Vec<_> = snapshot.workers.iter().map(|w| WorkerInfo::of(w, now)).collect();
    // The closed loop over each model's answers (every worker's), where there were some.
    let models: serde_json::Map<String, serde_json::Value> = snapshot
        .pools()
        .filter_map(|pool| {
            let info = accuracy_info(pool.prefix.accuracy.state())?;
            Some((pool.model.clone(), json!({"index_accuracy": info})))
        })
        .collect();
    Ok(Json(json!({"workers": workers, "models": models})).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddWorker {
    pub url: String,
    #[serde(default)]
    pub model_id: Option<String>,
    /// `tcp://host:port` of the engine's KV event publisher (comma-separated per data-parallel rank).
    #[serde(default)]
    pub kv_events_endpoint: Option<String>,
    /// `tcp://host:port` of its replay socket (same shape).
    #[serde(default)]
    pub kv_events_replay_endpoint: Option<String>,
    /// `regular` (default), `prefill` or `decode`.
    #[serde(default)]
    pub worker_type: WorkerRole,
    /// A prefill worker's SGLang bootstrap port.
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
    /// The policy of the worker's model when it is the model's first worker (needs model_id).
    #[serde(default)]
    pub policy: Option<kvgate_policy::PolicyKind>,
}

pub async fn add_worker(
    State(state): State<SharedState>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    check_admin_key(state.config.admin_api_key.as_deref(), &headers)?;
    let request: AddWorker = serde_json::from_slice(&body).map_err(|e| {
        ApiError::BadRequest(format!(
            "expected {{\"url\": \"http://...\", \"model_id\": \"...\", \"worker_type\": \"regular|prefill|decode\", \"bootstrap_port\": 8998, \"policy\": \"cache_aware\", \"kv_events_endpoint\": \"tcp://...\", \"kv_events_replay_endpoint\": \"tcp://...\"}} (all but url optional): {e}"
        ))
    })?;
    let events = request.kv_events_endpoint.as_deref().unwrap_or("");
    let kv_events = KvEventsSource::parse(events, request.kv_events_replay_endpoint.as_deref())
        .map_err(ApiError::BadRequest)?;
    if request.worker_type != WorkerRole::Regular && !state.config.pd_disaggregation {
        return Err(ApiError::BadRequest(format!(
            "worker_type {:?} needs a gateway started with --pd-disaggregation",
            request.worker_type.as_str()
        )));
    }
    if request.bootstrap_port.is_some() && request.worker_type != WorkerRole::Prefill {
        return Err(ApiError::BadRequest("bootstrap_port is for prefill workers only".into()));
    }
    if request.policy.is_some() && request.model_id.is_none() {
        return Err(ApiError::BadRequest("policy needs model_id (the model it routes)".into()));
    }
    if request.bootstrap_port == Some(0) {
        return Err(ApiError::BadRequest("bootstrap_port must be a port number (1-65535)".into()));
    }
    let new = NewWorker {
        url: request.url,
        model: request.model_id,
        role: request.worker_type,
        bootstrap_port: request.bootstrap_port,
        kv_events,
        policy: request.policy,
        dp_rank: None,
    };
    let workers = state.registration.register(new).await?;
    let now = Instant::now();
    let infos: Vec<WorkerInfo> = workers.iter().map(|worker| WorkerInfo::of(worker, now)).collect();
    // `worker`: the one added (with --dp-aware, rank 0); `workers`: every one (each rank).
    let first = infos.first().map(|info| serde_json::to_value(info).unwrap_or_default());
    Ok((StatusCode::CREATED, Json(json!({"worker": first, "workers": infos}))).into_response())
}

pub async fn remove_worker(
    State(state): State<SharedState>,
    headers: HeaderMap,
    Path(url): Path<String>,
) -> Result<Response, ApiError> {
    check_admin_key(state.config.admin_api_key.as_deref(), &headers)?;
    let removed = state.registration.deregister(&url);
    match removed.first() {
        Some(worker) if removed.len() == 1 => Ok(Json(json!({"removed": worker.url})).into_response()),
        Some(_) => {
            let names: Vec<&str> = removed.iter().map(|worker| worker.url.as_str()).collect();
            Ok(Json(json!({"removed": url, "ranks": names})).into_response())
        }
        None => Err(ApiError::NotFound(format!("no worker {url} is registered"))),
    }
}
