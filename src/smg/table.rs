//! What kvgate does with each option of SMG 1.13's `smg launch` (the names and arities are in
//! `tests/data/smg-1.13-options.txt`): *same* (kvgate takes the flag with the same meaning),
//! *mapped* (kvgate takes it and translates it) or *refused* (the feature kvgate lacks and what to
//! use instead). docs/SMG.md is generated from this table; `tests/commands/smg.rs` fails when an SMG option
//! is missing here or a same/mapped one does not parse.

/// One SMG option's fate in kvgate.
pub struct Entry {
    /// SMG's (first) name of the option.
    pub smg: &'static str,
    pub class: Class,
}

/// How kvgate takes an SMG option.
pub enum Class {
    /// kvgate implements it under the same name (or as an alias) with the same meaning.
    /// `example`: a value that parses (empty for a flag); `note`: a difference worth knowing
    /// (usually the default).
    Same { example: &'static str, note: &'static str },
    /// kvgate takes it and translates it (`map`); `example` as for `Same`.
    Mapped { map: Map, example: &'static str, note: &'static str },
    /// kvgate lacks the feature: the error names it and what to use instead.
    Refused { feature: &'static str, instead: &'static str },
}

/// SMG's values of an option (and the whole command line, for context) to kvgate's arguments, or
/// why not.
pub type Translate = fn(&[String], &[String]) -> Result<Vec<String>, String>;

/// A translation of an SMG option into kvgate's command line.
pub enum Map {
    /// kvgate's flag of another name, same values and meaning.
    Rename(&'static str),
    /// The option asks for what kvgate does anyway; it is accepted and has no effect.
    Nothing,
    /// Translated: SMG's values (and the whole command line, for context) to kvgate's
    /// arguments, or why not.
    With(Translate),
}

const fn same(smg: &'static str, example: &'static str, note: &'static str) -> Entry {
    Entry { smg, class: Class::Same { example, note } }
}

const fn mapped(smg: &'static str, map: Map, example: &'static str, note: &'static str) -> Entry {
    Entry { smg, class: Class::Mapped { map, example, note } }
}

const fn refused(smg: &'static str, feature: &'static str, instead: &'static str) -> Entry {
    Entry { smg, class: Class::Refused { feature, instead } }
}

pub(super) const GRPC: &str =
    "gRPC engines (SMG's gRPC router and its tokenizer, parsers and multimodal pipeline)";
pub(super) const GRPC_INSTEAD: &str =
    "run the engines' OpenAI-compatible HTTP servers and give their URLs to --worker-urls";
const HISTORY: &str = "conversation history storage (the Responses API's stored responses)";
const HISTORY_INSTEAD: &str =
    "keep history in the client or the application; kvgate proxies stateless requests";
const MESH: &str = "SMG's mesh of gateway replicas";
const MESH_INSTEAD: &str = "--replica-sync-redis-url (replicas share routing through Redis)";
const WARMUP_NOTE: &str = "accepted, no effect: kvgate needs no warm-up slice, as cache_aware sends every cache miss to the least busy worker (--cache-miss-strategy least_load, the default), so a new or emptied worker takes misses at once";
const WARMUP_DIVERT_NOTE: &str = "accepted, no effect: kvgate never diverts a cache hit; a thin worker fills from the misses it takes first (as --worker-warmup-secs)";
const SELECTION: &str = "SMG's selection-policy framework";
const SELECTION_INSTEAD: &str = "--policy (kv_aware predicts each engine's time to first token)";
const MULTIMODAL: &str = "multimodal processing in the gateway";
const MULTIMODAL_INSTEAD: &str =
    "send multimodal requests to the engines through kvgate's HTTP proxy; the engine processes media";
const TENANT: &str = "SMG's tenant options (a trusted tenant header, the tenant rate-limit config file)";
const TENANT_INSTEAD: &str = "kvgate's tenants: --client-api-keys KEY=TENANT (or --client-api-keys-file) name the tenant, and the YAML `tenants:` section sets per-tenant requests_per_minute, tokens_per_minute, max_concurrent, weight and class";
const JWT: &str = "JWT authentication";
const JWT_INSTEAD: &str = "--client-api-keys (bearer keys), or a JWT-validating proxy in front of kvgate";
const PARSERS: &str = "reasoning and tool-call parsing in the gateway";
const PARSERS_INSTEAD: &str = "the engine's own parsers (SGLang --reasoning-parser/--tool-call-parser, vLLM --reasoning-parser/--tool-call-parser)";
const TOKENIZER_CACHE: &str = "SMG's tokenizer caches";
const TOKENIZER_CACHE_INSTEAD: &str = "not needed: kvgate caches token ids per chat segment by itself (--tokenizer-threads, --tokenizer-queue-size tune it)";

/// Every SMG 1.13 `smg launch` option, in SMG's order.
pub const TABLE: &[Entry] = &[
    same("--host", "127.0.0.1", "kvgate's default is 127.0.0.1 (SMG: 0.0.0.0)"),
    same("--port", "30000", ""),
    same("--worker-urls", "http://127.0.0.1:8000", ""),
    refused("--upstream-http2", "HTTP/2 to workers", "kvgate speaks HTTP/1.1 with keep-alive to workers (engines serve HTTP/1.1)"),
    refused("--upstream-pool-idle-timeout-secs", "a tunable idle timeout of upstream connections", "not needed: kvgate closes idle upstream connections itself"),
    refused("--health-check-port", "a separate health-check listener", "GET /health on --port (and on the admin listener)"),
    same("--policy", "cache_aware", "kvgate has no passthrough; it adds kv_aware and bucket"),
    refused("--encode-policy", "encode/prefill/decode (EPD) disaggregation", "--pd-disaggregation with --prefill and --decode"),
    same("--prefill-policy", "cache_aware", ""),
    same("--decode-policy", "power_of_two", ""),
    same("--cache-threshold", "0.3", ""),
    same("--prefix-token-count", "256", ""),
    same("--prefix-hash-load-factor", "1.25", ""),
    refused("--prefix-hash-balance-abs-threshold", "prefix_hash's absolute load bound", "--prefix-hash-load-factor (relative to the mean)"),
    same("--least-load-kv-pressure-weight", "0.15", ""),
    same("--least-load-default-throughput", "2000", ""),
    same("--least-load-mean-prefill-tokens", "1024", ""),
    refused("--least-load-max-waiting-requests", "least_load's cap on an engine's waiting requests", "--overload-token-usage-threshold with cache_aware, or kv_aware"),
    refused("--power-of-two-load-metric", "a choice of power_of_two's load metric", "power_of_two compares in-flight requests; least_load and kv_aware use the engines' loads"),
    same("--balance-abs-threshold", "64", ""),
    same("--balance-rel-threshold", "1.5", ""),
    same("--balance-token-usage-threshold", "0.9", ""),
    same("--overload-token-usage-threshold", "0.9", ""),
    same("--worker-overload-waiting-requests", "8", "off unless given (SMG: 8); every policy, fresh load samples only"),
    same("--worker-overload-token-usage", "0.8", "off unless given (SMG: 0.8)"),
    mapped("--worker-overload-protection", Map::With(overload_protection), "", "SMG's default bounds (8 waiting requests, 0.8 KV usage) where the command line gives none"),
    mapped("--disable-worker-overload-protection", Map::Nothing, "", "kvgate's default: off unless --worker-overload-waiting-requests or --worker-overload-token-usage is given"),
    same("--worker-overload-shed", "", "503 with code worker_overload_protection_shed and Retry-After, as SMG"),
    refused("--kv-index", "SMG's KV index modes", "--prefix-index (auto, exact from the engines' KV events, approximate)"),
    refused("--worker-stall-secs", "stall and wedge detection of workers", "--ttfb-timeout-secs (retry elsewhere when a worker's answer is late), --body-stall-timeout-secs (an answer that stalls mid-body is cut) and the circuit breaker"),
    refused("--worker-wedge-secs", "stall and wedge detection of workers", "--ttfb-timeout-secs and the circuit breaker (--cb-failure-threshold)"),
    refused("--worker-stale-secs", "a tunable load-sample staleness bound", "not needed: a load sample older than three --load-monitor-interval periods never drives the KV terms"),
    mapped("--worker-warmup-secs", Map::Nothing, "60", WARMUP_NOTE),
    mapped("--worker-warmup-share", Map::Nothing, "0.25", WARMUP_NOTE),
    mapped("--worker-warmup-blocks", Map::Nothing, "1024", WARMUP_NOTE),
    mapped("--worker-warmup-thin-ratio", Map::Nothing, "0.5", WARMUP_NOTE),
    mapped("--worker-warmup-divert-every", Map::Nothing, "8", WARMUP_DIVERT_NOTE),
    refused("--selection-policy", SELECTION, SELECTION_INSTEAD),
    refused("--selection-accounting-ttl-ms", SELECTION, SELECTION_INSTEAD),
    refused("--overlap-decay", SELECTION, SELECTION_INSTEAD),
    refused("--selection-temperature", SELECTION, "--policy kv_aware with --router-temperature"),
    same("--bucket-adjust-interval-secs", "5", ""),
    mapped("--eviction-interval-secs", Map::Rename("--eviction-interval"), "60", "kvgate's --eviction-interval (seconds; default 120, SMG: 60)"),
    same("--max-tree-size", "67108864", ""),
    same("--block-size", "16", ""),
    refused("--cache-boundaries", "fixed bucket boundaries", "--policy bucket adjusts its boundaries (--bucket-adjust-interval-secs)"),
    refused("--cache-index", "a hash-based cache index for cache_aware", "--prefix-index (the tree, or the exact index from the engines' KV events)"),
    refused("--cache-ttl-secs", "a TTL of prefix-tree entries", "--max-tree-size (least recently used prefixes go first) and --eviction-interval-secs"),
    same("--max-idle-secs", "14400", ""),
    same("--assignment-mode", "min_load", ""),
    same("--max-payload-size", "536870912", ""),
    refused("--max-buffered-request-bytes", "a separate bound on buffered request bodies", "--max-payload-size"),
    refused("--pd-admission-wait-secs", "PD admission waiting", "--queue-size with --queue-timeout-secs"),
    mapped("--stream-body-stall-timeout-secs", Map::Rename("--body-stall-timeout-secs"), "300", "kvgate's --body-stall-timeout-secs (default 300, 0: off, as SMG's): a client's request body stalling this long gets 408, as in SMG; kvgate also cuts a worker's answer that stalls this long (moved to another engine with --migrate-streams)"),
    refused("--sse-keepalive-secs", "SSE keep-alive comments", "not needed: kvgate streams the engine's events as they come"),
    same("--dp-aware", "", "SGLang engines: dp_size from GET /server_info, one worker per rank (`URL@RANK`), the rank sent as data_parallel_rank"),
    same("--routing-key-override", "", "kvgate's target header is x-kvgate-target-worker"),
    mapped("--routing-key-headers", Map::With(routing_key_headers), "x-session-id", "one header, to kvgate's --routing-key-header"),
    refused("--dp-minimum-tokens-scheduler", "data-parallel rank scheduling", "the engine's own data-parallel balancer"),
    refused("--enable-igw", "the inference gateway mode (several models behind gRPC workers)", "kvgate routes several models at once: each worker's model is read from its /v1/models"),
    refused("--enable-rl", "the reinforcement-learning control API", "drive the engines' own weight-update endpoints directly"),
    refused("--rl-control-timeout-secs", "the reinforcement-learning control API", "drive the engines' own weight-update endpoints directly"),
    refused("--rl-fanout-concurrency", "the reinforcement-learning control API", "drive the engines' own weight-update endpoints directly"),
    same("--pd-disaggregation", "", ""),
    refused("--epd-disaggregation", "encode/prefill/decode (EPD) disaggregation", "--pd-disaggregation with --prefill and --decode"),
    refused("--encode", "encode/prefill/decode (EPD) disaggregation", "--pd-disaggregation with --prefill and --decode"),
    same("--prefill", "http://127.0.0.1:8100 9000", ""),
    same("--decode", "http://127.0.0.1:8200", ""),
    mapped("--prefill-max-inflight-requests-per-worker", Map::With(prefill_max_inflight), "-1", "-1 (SMG's default: no cap) only; kvgate has no per-worker cap on prefill requests: --max-concurrent-requests with --queue-size bound the gateway"),
    refused("--prefill-queue-size", "a separate prefill queue", "--queue-size"),
    refused("--prefill-queue-timeout-secs", "a separate prefill queue", "--queue-timeout-secs"),
    mapped("--worker-startup-timeout-secs", Map::Nothing, "1800", "accepted, no effect: kvgate does not wait for workers at start; a worker takes traffic once its health check passes"),
    mapped("--worker-startup-delay", Map::Nothing, "0", "accepted, no effect (as --worker-startup-timeout-secs)"),
    mapped("--worker-startup-check-interval", Map::Nothing, "30", "accepted, no effect (as --worker-startup-timeout-secs)"),
    refused("--job-queue-capacity", "SMG's worker-management job queue", "not needed: kvgate registers workers at once (POST /workers)"),
    refused("--job-queue-concurrency", "SMG's worker-management job queue", "not needed: kvgate registers workers at once (POST /workers)"),
    same("--load-monitor-interval", "10", "seconds, as SMG (kvgate's own flag: --load-monitor-interval-ms, default 1000)"),
    refused("--disable-load-monitoring", "turning the load monitor off", "not needed: kvgate polls loads only while a policy uses them (round_robin, random, power_of_two poll nothing)"),
    refused("--multimodal-tensor-transport", MULTIMODAL, MULTIMODAL_INSTEAD),
    refused("--multimodal-shm-min-bytes", MULTIMODAL, MULTIMODAL_INSTEAD),
    refused("--multimodal-max-inflight-bytes", MULTIMODAL, MULTIMODAL_INSTEAD),
    refused("--mm-per-request-image-limit", MULTIMODAL, MULTIMODAL_INSTEAD),
    refused("--mm-processing", MULTIMODAL, MULTIMODAL_INSTEAD),
    refused("--mm-pixel-cache-mb", MULTIMODAL, MULTIMODAL_INSTEAD),
    refused("--mm-pixel-rdma", MULTIMODAL, MULTIMODAL_INSTEAD),
    refused("--mm-allowed-media-domains", MULTIMODAL, MULTIMODAL_INSTEAD),
    refused("--mm-allow-private-media-hosts", MULTIMODAL, MULTIMODAL_INSTEAD),
    refused("--rdma-listen-ip", MULTIMODAL, MULTIMODAL_INSTEAD),
    refused("--rdma-slot-ttl-s", MULTIMODAL, MULTIMODAL_INSTEAD),
    refused("--log-mm-timing", MULTIMODAL, MULTIMODAL_INSTEAD),
    same("--log-dir", "/tmp/kvgate-logs", "the log file is DIR/kvgate.log (appended), beside stderr"),
    same("--log-level", "info", "also a tracing filter directive"),
    same("--log-json", "", "also spelled --json-log"),
    same("--service-discovery", "", "Kubernetes pods"),
    mapped("--discovery-provider", Map::With(discovery_provider), "kubernetes", "kubernetes only (kvgate's discovery watches pods)"),
    refused("--discovery-file", "file-based service discovery", "--worker-urls, or POST /workers on the admin listener"),
    refused("--discovery-check-interval-secs", "polled service discovery", "not needed: kvgate watches pods (no polling interval)"),
    same("--selector", "app=engine", ""),
    same("--service-discovery-port", "8000", "kvgate's default is 8000 (SMG: 80)"),
    same("--service-discovery-namespace", "default", ""),
    refused("--kv-connector-annotation", "KV connector annotations on pods", "--pd-protocol for the KV hand-off of a disaggregated fleet"),
    refused("--kv-engine-id-annotation", "KV engine id annotations on pods", "--kv-events-endpoints"),
    refused("--encode-selector", "encode/prefill/decode (EPD) disaggregation", "--prefill-selector and --decode-selector"),
    same("--prefill-selector", "role=prefill", ""),
    same("--decode-selector", "role=decode", ""),
    refused("--router-selector", "discovery of gateway replicas as pods", "--replica-sync-redis-url"),
    refused("--model-id-from", "choosing where a worker's model id comes from", "not needed: kvgate reads each worker's model from its /v1/models (or POST /workers with model_id)"),
    refused("--model-alias", "model aliases", "name the model in the engine (SGLang --served-model-name, vLLM --served-model-name)"),
    same("--prometheus-port", "29000", "a separate listener serving /metrics (and /health); /metrics stays on --port too; unset: no separate listener (SMG: 29000)"),
    same("--prometheus-host", "127.0.0.1", "default 127.0.0.1 (SMG: 0.0.0.0)"),
    refused("--prometheus-duration-buckets", "configurable histogram buckets", "not needed: kvgate's latency histograms have fixed buckets"),
    refused("--jemalloc-prof-dir", "jemalloc heap profiling", "not needed: kvgate uses mimalloc"),
    same("--request-id-headers", "x-request-id x-correlation-id", "the id is the first of these headers given, else a new one (sent to the worker as x-request-id); the response carries x-request-id. Unset: off"),
    refused("--storage-context-headers", HISTORY, HISTORY_INSTEAD),
    same("--request-timeout-secs", "1800", ""),
    same("--shutdown-grace-period-secs", "180", "kvgate's default is 30 (SMG: 180)"),
    same("--header-read-timeout-secs", "30", "kvgate's default is 10 (SMG: 30)"),
    mapped("--idle-connection-timeout-secs", Map::Rename("--keep-alive-timeout-secs"), "90", "kvgate's --keep-alive-timeout-secs (default 60)"),
    refused("--trust-tenant-header", TENANT, TENANT_INSTEAD),
    mapped("--tenant-header-name", Map::Rename("--tenant-header"), "x-smg-tenant-id", "kvgate's --tenant-header (default x-kvgate-tenant), read whenever no client keys are configured"),
    same("--cors-allowed-origins", "https://app.example", "the proxied endpoints' responses and their preflight OPTIONS; `*` for any origin"),
    mapped("--max-concurrent-requests", Map::With(max_concurrent_requests), "-1", "-1 (SMG: no limit) leaves it unset"),
    same("--queue-size", "100", "kvgate's default is 0 (SMG: 100)"),
    same("--queue-timeout-secs", "60", ""),
    same("--rate-limit-tokens-per-second", "100", ""),
    refused("--max-background-responses", HISTORY, HISTORY_INSTEAD),
    refused("--priority-scheduler-enabled", "SMG's priority scheduler configuration", "kvgate's priority classes: --priority-header (high, normal, low) or the tenant's `class` in `tenants:`, served by --max-concurrent-requests with --queue-size (a class's `reserved_concurrency` keeps slots from lower classes; --forward-priority tells the engines)"),
    refused("--priority-scheduler-default-max-class", "SMG's priority scheduler configuration", "kvgate's priority classes: --priority-header (high, normal, low) or the tenant's `class` in `tenants:`, served by --max-concurrent-requests with --queue-size (a class's `reserved_concurrency` keeps slots from lower classes; --forward-priority tells the engines)"),
    refused("--priority-scheduler-config", "SMG's priority scheduler configuration", "kvgate's priority classes: --priority-header (high, normal, low) or the tenant's `class` in `tenants:`, served by --max-concurrent-requests with --queue-size (a class's `reserved_concurrency` keeps slots from lower classes; --forward-priority tells the engines)"),
    refused("--priority-scheduler-tenant-metric-top-n", "SMG's priority scheduler configuration", "kvgate's priority classes: --priority-header (high, normal, low) or the tenant's `class` in `tenants:`, served by --max-concurrent-requests with --queue-size (a class's `reserved_concurrency` keeps slots from lower classes; --forward-priority tells the engines)"),
    refused("--tenant-rate-limit-enabled", TENANT, TENANT_INSTEAD),
    refused("--tenant-rate-limit-config", TENANT, TENANT_INSTEAD),
    same("--retry-max-retries", "5", "kvgate's default is 3 (SMG: 5)"),
    same("--retry-initial-backoff-ms", "50", ""),
    same("--retry-max-backoff-ms", "30000", "kvgate's default is 1000 (SMG: 30000)"),
    refused("--retry-backoff-multiplier", "a tunable backoff multiplier", "not needed: kvgate doubles each backoff (bounded by --retry-max-backoff-ms)"),
    refused("--retry-jitter-factor", "a tunable retry jitter", "not needed: kvgate jitters each backoff by itself"),
    same("--disable-retries", "", ""),
    same("--cb-failure-threshold", "10", "kvgate's default is 5 (SMG: 10)"),
    refused("--cb-success-threshold", "a success count to close a circuit", "not needed: one successful half-open probe closes kvgate's circuit"),
    same("--cb-timeout-duration-secs", "60", "kvgate's default is 30 (SMG: 60)"),
    refused("--cb-window-duration-secs", "a failure window of the circuit breaker", "--cb-failure-threshold (consecutive failures)"),
    same("--disable-circuit-breaker", "", ""),
    same("--health-failure-threshold", "3", ""),
    same("--health-success-threshold", "2", ""),
    same("--health-check-timeout-secs", "5", ""),
    same("--health-check-interval-secs", "60", "kvgate's default is 10 (SMG: 60)"),
    same("--health-check-endpoint", "/health", ""),
    same("--disable-health-check", "", ""),
    mapped("--remove-unhealthy-workers", Map::Nothing, "", "accepted, no effect: SMG removes unhealthy workers so they can recover; kvgate keeps them registered, re-probes them and routes to them again once their health check passes (its --no- form is kvgate's behaviour); DELETE /workers/URL removes one"),
    mapped("--model-path", Map::With(model_path), "/models/llama", "a local directory or tokenizer.json, as --tokenizer-path (kvgate never downloads: a Hugging Face model id is refused); --tokenizer-path wins when both are given"),
    same("--tokenizer-path", "/models/llama/tokenizer.json", "never downloaded: a local tokenizer.json or a directory holding it"),
    same("--chat-template", "/models/llama/template.jinja", ""),
    mapped("--disable-tokenizer-autoload", Map::Nothing, "", "kvgate never downloads a tokenizer"),
    refused("--parser", PARSERS, PARSERS_INSTEAD),
    refused("--tokenizer-cache-enable-l0", TOKENIZER_CACHE, TOKENIZER_CACHE_INSTEAD),
    refused("--tokenizer-cache-l0-max-entries", TOKENIZER_CACHE, TOKENIZER_CACHE_INSTEAD),
    refused("--tokenizer-cache-enable-l1", TOKENIZER_CACHE, TOKENIZER_CACHE_INSTEAD),
    refused("--tokenizer-cache-l0-max-memory", TOKENIZER_CACHE, TOKENIZER_CACHE_INSTEAD),
    refused("--tokenizer-cache-l1-max-memory", TOKENIZER_CACHE, TOKENIZER_CACHE_INSTEAD),
    refused("--reasoning-parser", PARSERS, PARSERS_INSTEAD),
    refused("--tool-call-parser", PARSERS, PARSERS_INSTEAD),
    refused("--mcp-config-path", "MCP tool servers", "run MCP tools in the application (the engine and kvgate see ordinary chat requests)"),
    mapped("--backend", Map::With(backend), "sglang", "sglang and vllm (kvgate's engines, over HTTP) are accepted; others refused"),
    refused("--zmq-engine-count", GRPC, GRPC_INSTEAD),
    refused("--enable-wasm", "WASM plugins", "a proxy in front of kvgate for request rewriting"),
    refused("--storage-hook-wasm-path", "WASM plugins", "a proxy in front of kvgate for request rewriting"),
    mapped("--history-backend", Map::With(history_backend), "none", "`none` (kvgate stores nothing) is accepted; others refused"),
    refused("--history-memory-max-responses", HISTORY, HISTORY_INSTEAD),
    refused("--history-memory-max-items", HISTORY, HISTORY_INSTEAD),
    refused("--history-memory-retention-secs", HISTORY, HISTORY_INSTEAD),
    refused("--oracle-wallet-path", HISTORY, HISTORY_INSTEAD),
    refused("--oracle-tns-alias", HISTORY, HISTORY_INSTEAD),
    refused("--oracle-connect-descriptor", HISTORY, HISTORY_INSTEAD),
    refused("--oracle-username", HISTORY, HISTORY_INSTEAD),
    refused("--oracle-password", HISTORY, HISTORY_INSTEAD),
    refused("--oracle-external-auth", HISTORY, HISTORY_INSTEAD),
    refused("--oracle-pool-min", HISTORY, HISTORY_INSTEAD),
    refused("--oracle-pool-max", HISTORY, HISTORY_INSTEAD),
    refused("--oracle-pool-timeout-secs", HISTORY, HISTORY_INSTEAD),
    refused("--postgres-db-url", HISTORY, HISTORY_INSTEAD),
    refused("--postgres-pool-max", HISTORY, HISTORY_INSTEAD),
    refused("--postgres-op-timeout-secs", HISTORY, HISTORY_INSTEAD),
    refused("--redis-url", HISTORY, "kvgate's Redis is for replica sync (--replica-sync-redis-url); keep history in the application"),
    refused("--redis-pool-max", HISTORY, HISTORY_INSTEAD),
    refused("--redis-retention-days", HISTORY, HISTORY_INSTEAD),
    refused("--redis-op-timeout-secs", HISTORY, HISTORY_INSTEAD),
    refused("--schema-config", HISTORY, HISTORY_INSTEAD),
    same("--client-cert-path", "/etc/kvgate/client.pem", ""),
    same("--client-key-path", "/etc/kvgate/client.key", ""),
    same("--ca-cert-paths", "/etc/kvgate/ca.pem", ""),
    same("--tls-cert-path", "/etc/kvgate/server.pem", ""),
    same("--tls-key-path", "/etc/kvgate/server.key", ""),
    mapped("--enable-trace", Map::Nothing, "", "accepted, no effect of its own: kvgate traces whenever --otlp-traces-endpoint is given"),
    same("--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces", "OTLP over HTTP/protobuf: the collector's traces URL (SMG's default, gRPC on localhost:4317, is refused with that message); giving it turns tracing on"),
    same("--api-key", "secret-key", "the bearer token sent to workers"),
    mapped("--tenant-api-key", Map::With(tenant_api_key), "team-a:sk-1", "each TENANT:KEY to --client-api-keys KEY=TENANT; a key with a comma (or a tenant with a comma or `=`) is refused, never split: give it in --client-api-keys-file"),
    mapped("--control-plane-api-keys", Map::With(control_plane_api_keys), "admin-key", "one key, to --admin-api-key"),
    refused("--control-plane-audit-enabled", "an audit log of the control plane", "kvgate logs every worker added or removed at INFO"),
    refused("--jwt-issuer", JWT, JWT_INSTEAD),
    refused("--jwt-audience", JWT, JWT_INSTEAD),
    refused("--jwt-jwks-uri", JWT, JWT_INSTEAD),
    refused("--jwt-role-mapping", JWT, JWT_INSTEAD),
    refused("--enable-mesh", MESH, MESH_INSTEAD),
    refused("--mesh-server-name", MESH, MESH_INSTEAD),
    refused("--mesh-host", MESH, MESH_INSTEAD),
    refused("--mesh-advertise-host", MESH, MESH_INSTEAD),
    refused("--mesh-port", MESH, MESH_INSTEAD),
    refused("--mesh-peer-urls", MESH, MESH_INSTEAD),
    refused("--mesh-tls-ca-cert", MESH, MESH_INSTEAD),
    refused("--mesh-tls-cert", MESH, MESH_INSTEAD),
    refused("--mesh-tls-key", MESH, MESH_INSTEAD),
];

fn routing_key_headers(values: &[String], _command_line: &[String]) -> Result<Vec<String>, String> {
    match values {
        [header] => Ok(vec!["--routing-key-header".into(), header.clone()]),
        [] => Ok(Vec::new()),
        _ => Err("kvgate reads the session key from one header (--routing-key-header); give one".into()),
    }
}

fn max_concurrent_requests(values: &[String], _command_line: &[String]) -> Result<Vec<String>, String> {
    match values {
        [value] if value.trim().starts_with('-') => Ok(Vec::new()),
        [value] => Ok(vec!["--max-concurrent-requests".into(), value.clone()]),
        _ => Ok(Vec::new()),
    }
}

fn model_path(values: &[String], command_line: &[String]) -> Result<Vec<String>, String> {
    let tokenizer_given =
        command_line.iter().any(|arg| arg == "--tokenizer-path" || arg.starts_with("--tokenizer-path="));
    if tokenizer_given {
        return Ok(Vec::new());
    }
    if let Some(id) = values.iter().find(|value| looks_like_a_hub_id(value)) {
        return Err(format!(
            "{id:?} is a Hugging Face model id, not a local path, and kvgate never downloads a tokenizer: \
             give the local directory holding its tokenizer.json, or leave --model-path out (routing on \
             the prompt's text needs no tokenizer)"
        ));
    }
    Ok(values.iter().flat_map(|path| ["--tokenizer-path".to_string(), path.clone()]).collect())
}

/// `org/name` that is not a path on this machine.
fn looks_like_a_hub_id(value: &str) -> bool {
    let relative = !value.starts_with(['/', '.', '~']);
    relative && value.matches('/').count() == 1 && !std::path::Path::new(value).exists()
}

fn discovery_provider(values: &[String], _command_line: &[String]) -> Result<Vec<String>, String> {
    match values {
        [provider] if provider == "kubernetes" => Ok(Vec::new()),
        _ => Err("kvgate discovers workers as Kubernetes pods only (--service-discovery with --selector); file discovery is not supported: give --worker-urls".into()),
    }
}

fn backend(values: &[String], _command_line: &[String]) -> Result<Vec<String>, String> {
    match values {
        [name] if name == "sglang" || name == "vllm" => Ok(Vec::new()),
        _ => Err("kvgate routes to SGLang and vLLM engines over HTTP (sglang, vllm); other backends (openai, anthropic, tokenspeed) are not supported".into()),
    }
}

fn history_backend(values: &[String], _command_line: &[String]) -> Result<Vec<String>, String> {
    match values {
        [name] if name == "none" => Ok(Vec::new()),
        _ => Err(format!("kvgate lacks {HISTORY}: only `none` is accepted; {HISTORY_INSTEAD}")),
    }
}

fn control_plane_api_keys(values: &[String], _command_line: &[String]) -> Result<Vec<String>, String> {
    match values {
        [key] => Ok(vec!["--admin-api-key".into(), key.clone()]),
        [] => Ok(Vec::new()),
        _ => Err("kvgate's admin API takes one key (--admin-api-key); give one".into()),
    }
}

/// `TENANT:KEY` (split at the first `:`, as SMG does) to `--client-api-keys KEY=TENANT`. That
/// list splits at commas and takes the tenant after the last `=`, so a key with a comma, or a
/// tenant with a comma or an `=`, would become other keys or another tenant: refused, pointing to
/// `--client-api-keys-file`, whose lines take a key whole.
fn tenant_api_key(values: &[String], _command_line: &[String]) -> Result<Vec<String>, String> {
    let mut keys = Vec::new();
    for value in values {
        let Some((tenant, key)) = value.split_once(':').filter(|(t, k)| !t.is_empty() && !k.is_empty())
        else {
            return Err(format!("--tenant-api-key takes TENANT_ID:KEY, got {value:?}"));
        };
        if key.contains(',') || tenant.contains([',', '=']) {
            return Err(format!(
                "--tenant-api-key {tenant}:<key>: a key with a comma, or a tenant with a comma or `=`, cannot be \
                 given on kvgate's command line (--client-api-keys splits at commas and takes the tenant after \
                 the last `=`): list it in --client-api-keys-file (one `KEY TENANT` per line)"
            ));
        }
        keys.push(format!("{key}={tenant}"));
    }
    Ok(if keys.is_empty() { keys } else { vec!["--client-api-keys".into(), keys.join(",")] })
}

fn prefill_max_inflight(values: &[String], _command_line: &[String]) -> Result<Vec<String>, String> {
    match values {
        [value] if value.trim() == "-1" => Ok(Vec::new()),
        _ => Err("kvgate has no per-worker cap on prefill requests (only -1, no cap, is accepted); instead: --max-concurrent-requests with --queue-size and --queue-timeout-secs bound the whole gateway".into()),
    }
}

/// `--worker-overload-protection`: SMG's default bounds, where the command line gives none.
fn overload_protection(_values: &[String], command_line: &[String]) -> Result<Vec<String>, String> {
    let given =
        |flag: &str| command_line.iter().any(|arg| arg == flag || arg.starts_with(&format!("{flag}=")));
    let mut out = Vec::new();
    if !given("--worker-overload-waiting-requests") {
        out.extend(["--worker-overload-waiting-requests".to_string(), "8".to_string()]);
    }
    if !given("--worker-overload-token-usage") {
        out.extend(["--worker-overload-token-usage".to_string(), "0.8".to_string()]);
    }
    Ok(out)
}
