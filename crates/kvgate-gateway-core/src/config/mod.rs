//! Gateway configuration: the one declaration of every `kvgate launch` option (flag, YAML key,
//! default, help) and its validation.

use clap::Args;
use kvgate_policy::{FieldError, PolicyConfig, ValidationErrors};

use crate::tenant::ForwardPriority;
use kvgate_policy::PolicyKind;
use kvgate_protocol::role::{PdProtocol, WorkerRole};
use kvgate_tokenizer::ContentFormatOption;
use serde::{Deserialize, Serialize};

/// Everything `kvgate launch` can be told. Flags and YAML keys come from these fields.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Args, derive_builder::Builder)]
#[serde(default, deny_unknown_fields)]
#[builder(default, setter(into, strip_option), build_fn(private, name = "assemble"), derive(Debug))]
pub struct GatewayConfig {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free port).
    #[arg(long, default_value_t = 30000)]
    pub port: u16,
    /// Engine URLs to route to (more can be added at runtime with POST /workers).
    #[arg(long = "worker-urls", num_args = 0.., value_name = "URL")]
    pub worker_urls: Vec<String>,
    /// Routing policy and its options.
    #[command(flatten)]
    pub routing: PolicyConfig,

    /// Route a prefill/decode disaggregated fleet: each request goes to a prefill worker and a
    /// decode worker (--prefill, --decode, or POST /workers with a worker_type).
    #[arg(long)]
    pub pd_disaggregation: bool,
    /// A prefill worker and, optionally, its SGLang bootstrap port (`none` for no port); repeat
    /// the flag for each. YAML: a list of URLs or `{url, bootstrap_port}` maps.
    #[arg(long, num_args = 1..=2, value_names = ["URL", "BOOTSTRAP_PORT"], action = clap::ArgAction::Append)]
    #[serde(with = "prefill_entries")]
    pub prefill: Vec<String>,
    /// A decode worker; repeat the flag for each.
    #[arg(long, value_name = "URL", action = clap::ArgAction::Append)]
    pub decode: Vec<String>,
    /// Policy of the prefill side (default: --policy).
    #[arg(long, value_enum)]
    pub prefill_policy: Option<PolicyKind>,
    /// Policy of the decode side (default: --policy).
    #[arg(long, value_enum)]
    pub decode_policy: Option<PolicyKind>,
    /// How prefill workers hand their KV cache to decode workers.
    #[arg(long, value_enum, default_value_t = PdProtocol::Sglang)]
    pub pd_protocol: PdProtocol,
    /// With --pd-conditional: when a pair's decode engine answers a server error other than 503
    /// (its KV transfer failed or timed out), send the request once more, plain, in place on the
    /// decode engine the decode side's policy picks for it (no backoff, not counted against
    /// --retry-max-retries; an SGLang prefill still running is cancelled). The route reason says
    /// `why=transfer_failed`.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub pd_fallback_in_place: bool,

    /// Header carrying a request's session key (consistent_hashing, manual); without it the
    /// body's `user` field is the key.
    #[arg(long, default_value = "x-kvgate-routing-key")]
    pub routing_key_header: String,
    /// Give each proxied request an id: the value of the first of these request headers present
    /// (e.g. `x-request-id x-correlation-id`), else a new one, also sent to the worker as
    /// `x-request-id`; the response carries it as `x-request-id` (errors too). Empty: off.
    #[arg(long = "request-id-headers", num_args = 0.., value_name = "HEADER")]
    pub request_id_headers: Vec<String>,
    /// Origins whose browsers may call the proxied endpoints (CORS): `https://app.example`, or
    /// `*` for any; their responses carry `Access-Control-Allow-Origin` and the preflight
    /// `OPTIONS` is answered. Empty: no CORS.
    #[arg(long = "cors-allowed-origins", num_args = 0.., value_name = "ORIGIN")]
    pub cors_allowed_origins: Vec<String>,
    /// Honour `x-kvgate-target-worker: URL`: the request goes to that worker of its model
    /// (400 when it is not a routable worker of the model).
    #[arg(long)]
    pub routing_key_override: bool,
    /// Per-model routing (YAML only): model name → policy options laid over `routing:`, e.g.
    /// `models: {llama: {policy: cache_aware, cache_threshold: 0.5}, qwen: {policy: manual}}`.
    #[arg(skip)]
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub models: std::collections::BTreeMap<String, serde_norway::Value>,

    /// ZMQ endpoints of the workers' KV event publishers (vLLM/SGLang `--kv-events-config`),
    /// one per worker in the order --worker-urls, --prefill, --decode: `tcp://host:port`, several
    /// comma-separated for data-parallel ranks, `-` for a worker without events.
    #[arg(long = "kv-events-endpoints", num_args = 0.., value_name = "ENDPOINT")]
    pub kv_events_endpoints: Vec<String>,
    /// ZMQ endpoints of the workers' KV event replay sockets, shaped like --kv-events-endpoints
    /// (`-` for none). Replay fills gaps and rebuilds the index after a start or restart.
    #[arg(long = "kv-events-replay-endpoints", num_args = 0.., value_name = "ENDPOINT")]
    pub kv_events_replay_endpoints: Vec<String>,
    /// ZMQ topic the engines publish KV events under.
    #[arg(long, default_value = "")]
    pub kv_events_topic: String,
    /// Largest KV event message (a live batch or a replayed one) applied, in bytes; a larger one
    /// is dropped like a lost batch (the worker's index entries are cleared) and counted. An
    /// engine's step of 128K prompt tokens is about 0.6 MB of events.
    #[arg(long, default_value_t = 4 * 1024 * 1024, value_name = "BYTES")]
    pub kv_events_max_message_bytes: usize,
    /// Most KV blocks the exact index holds for one engine cache (a worker's rank) when its
    /// engine reports no capacity; a stored event past it is refused alone (counted in
    /// `kvgate_kv_events_refused_total{reason="over_capacity"}`).
    #[arg(long, default_value_t = 262144, value_name = "BLOCKS")]
    pub kv_index_max_blocks_per_worker: usize,
    /// When the engine reports its KV capacity (`max_total_num_tokens` in its load report), the
    /// index holds at most that capacity in blocks times this factor for it (room for offload
    /// tiers and for events racing evictions).
    #[arg(long, default_value_t = 2.0, value_name = "FACTOR")]
    pub kv_index_capacity_slack: f64,
    /// Tokenizer for matching requests to KV blocks: a Hugging Face tokenizer.json, or a directory
    /// holding it and tokenizer_config.json (the chat template). Never downloaded.
    #[arg(long, value_name = "DIR_OR_FILE")]
    pub tokenizer_path: Option<std::path::PathBuf>,
    /// Chat template file (Jinja) overriding the tokenizer's (with --mock-tokenizer: rendering
    /// chats instead of the mock engines' own rendering).
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<std::path::PathBuf>,
    /// How chat messages reach the template, as vLLM's flag of the same name says: `auto` detects
    /// it from the template as vLLM does (a template that loops over a message's content parts
    /// gets every content as a list of parts, any other gets one string, text parts joined with
    /// newlines); set it to what the engines were started with when they were given one.
    /// `as_sent` (not vLLM's): the messages as the client sent them.
    #[arg(long, value_enum, default_value_t = ContentFormatOption::Auto)]
    pub chat_template_content_format: ContentFormatOption,
    /// Threads tokenizing requests for the exact index, apart from the I/O threads (default:
    /// half the CPU cores, at least one). Inputs of at most 2 KiB are tokenized inline.
    #[arg(long, value_name = "N")]
    pub tokenizer_threads: Option<usize>,
    /// Inputs waiting for a tokenizer thread beyond the running ones: a burst of requests (an RL
    /// step's samples, hundreds at once) waits here for its tokens and is routed on the exact
    /// index; when it is full a request routes on its text (the approximate tree) at once.
    #[arg(long, default_value_t = 4096)]
    pub tokenizer_queue_size: usize,
    /// Longest a request waits for its tokens (queued, then tokenized), in seconds: past it, it
    /// routes on its text (the approximate tree) and its input is not tokenized when its turn
    /// comes, so a tokenizer that cannot keep up delays no request by more than this.
    #[arg(long, default_value_t = 1.0, value_name = "SECS")]
    pub tokenizer_queue_timeout_secs: f64,
    /// Longest prompt routed on, in characters: a longer prompt (or rendered conversation) is
    /// routed on its first this-many characters (tokenized for the exact index, as text for the
    /// approximate tree), so one request costs the tokenizer and the tree a bounded amount.
    #[arg(long, default_value_t = 262144)]
    pub max_tokenize_chars: usize,
    /// Tokenize as kvgate's simulated engines do (one word = one token); set by
    /// `launch --mock-workers`.
    #[arg(long)]
    pub mock_tokenizer: bool,
    /// The alignment probe: when a worker whose KV events feed the exact index joins, and every
    /// --alignment-probe-interval-secs, a short canary prompt (a random salt, then fixed text;
    /// one output token) is sent to it twice, as a completion and as a chat, and the cached
    /// tokens its engine reports on the second send are compared with the index's prediction;
    /// a disagreement is named by its cause in /workers, /v1/fleet and
    /// kvgate_alignment_failures_total. It probes only regular workers with KV events, and only
    /// with a tokenizer (--tokenizer-path or --mock-tokenizer).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub alignment_probe: bool,
    /// Seconds between two alignment probes of one worker (its first runs when it joins).
    #[arg(long, default_value_t = 300.0, value_name = "SECS")]
    pub alignment_probe_interval_secs: f64,
    /// What the gateway does when the alignment probe or the closed loop finds a worker's index
    /// wrong: `resync` drops the worker's holdings from the exact index and replays them from its
    /// engine's replay endpoint; `quarantine` routes its pool on the approximate tree until a
    /// probe of the worker passes; `warn` only logs it. Every action
    /// is logged with its cause and counted in kvgate_index_repairs_total.
    #[arg(long, value_enum, default_value_t = kvgate_index::IndexRepair::Quarantine)]
    pub index_repair: kvgate_index::IndexRepair,

    /// Milliseconds between engine load polls (used only while a policy consumes loads); the
    /// same flag as `kvgate sim`'s. The gateway polls a worker that is sent requests every
    /// interval, one whose answers repeat while nothing is routed to it up to 16 intervals apart
    /// (its last answer carried forward), and spreads first polls over the interval.
    #[arg(long, default_value_t = 1000)]
    pub load_monitor_interval_ms: u64,
    /// Deprecated spelling of the load poll interval, in seconds; when given it wins over
    /// --load-monitor-interval-ms.
    #[arg(long, hide = true, value_name = "SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub load_monitor_interval: Option<f64>,

    /// Deadline for a worker's response headers, in seconds.
    #[arg(long, default_value_t = 1800.0)]
    pub request_timeout_secs: f64,
    /// Largest accepted request body in bytes; larger bodies get 413.
    #[arg(long, default_value_t = 512 * 1024 * 1024)]
    pub max_payload_size: usize,
    /// Most requests proxied at once; further requests wait in the queue (--queue-size) or get
    /// 429 (unset: no limit).
    #[arg(long)]
    pub max_concurrent_requests: Option<usize>,
    /// Requests that may wait for a concurrency slot or a rate-limit token (0: refuse at once
    /// with 429); a full queue refuses with 429.
    #[arg(long, default_value_t = 0)]
    pub queue_size: usize,
    /// Longest wait in the admission queue, in seconds; then 408.
    #[arg(long, default_value_t = 60.0)]
    pub queue_timeout_secs: f64,
    /// Locality-aware fairness: when a slot frees, the admission queue may serve, instead of the
    /// request fair queuing puts first, one of its class whose fair start is at most this many
    /// tokens of virtual time later, the one with the most prompt tokens the routing policy
    /// predicted cached on the worker it would take (scored as it entered the queue). 0: strict
    /// fair order.
    #[arg(long, value_name = "TOKENS", default_value_t = 0)]
    pub fairness_locality_bound: u64,
    /// Per-worker overload protection (SMG's name): a worker whose engine reports at least this
    /// many waiting requests is left out of routing while another worker is under the bounds
    /// (every policy; unset: off). Needs the engines' loads (the load monitor polls them).
    #[arg(long)]
    pub worker_overload_waiting_requests: Option<u64>,
    /// Per-worker overload protection: a worker whose engine reports at least this KV usage
    /// (0-1] is left out of routing while another worker is under the bounds (unset: off).
    /// Stronger than --overload-token-usage-threshold, which only cache_aware and kv_aware read.
    #[arg(long)]
    pub worker_overload_token_usage: Option<f64>,
    /// When every worker a request could use is over the overload bounds, answer 503 (with
    /// Retry-After) instead of sending it to the least loaded one.
    #[arg(long)]
    pub worker_overload_shed: bool,
    /// Requests admitted per second (token bucket, bursts of up to one second's worth); over it,
    /// requests queue (--queue-size) or get 429 (unset: no limit).
    #[arg(long)]
    pub rate_limit_tokens_per_second: Option<f64>,
    /// Seconds a client has to send its whole request body; then 408.
    #[arg(long, default_value_t = 60.0)]
    pub body_read_timeout_secs: f64,
    /// Seconds a body may go without a byte, both ways (SMG's --stream-body-stall-timeout-secs):
    /// a client's request body that stalls this long gets 408; a worker's answer that stalls
    /// this long mid-body is cut (a stream moves to another engine with --migrate-streams, else
    /// ends with the error event) and its slot is freed. 0: off. Must be >= 0
    #[arg(long, default_value_t = 300.0, value_name = "SECS")]
    pub body_stall_timeout_secs: f64,
    /// Longest a streamed answer may take in all, in seconds from the request's arrival; past it
    /// the stream ends with the error event and its slot is freed (unset: no deadline). Must be
    /// > 0
    #[arg(long, value_name = "SECS")]
    pub stream_deadline_secs: Option<f64>,
    /// A stream whose engine fails after the answer began (its connection breaks, or it stalls
    /// past --body-stall-timeout-secs) goes on on another engine: the request is sent again with
    /// the text already streamed as a continuation (a chat's final assistant message with
    /// `continue_final_message`, a completion's prompt plus the text) and max_tokens less what
    /// was generated, and the client's stream continues with the same id, no repeated text and
    /// one `[DONE]`. Chat and completions streams only (not /generate); see docs/OPERATIONS.md for
    /// what cannot be continued.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub migrate_streams: bool,
    /// Most times one stream moves to another engine (--migrate-streams); past it, the stream
    /// ends with the error event.
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub max_stream_migrations: u32,
    /// Seconds to wait for a worker's response head before giving up on it and trying another
    /// worker (nothing has reached the client yet); unset: wait up to --request-timeout-secs.
    #[arg(long)]
    pub ttfb_timeout_secs: Option<f64>,

    /// Largest answer read from a worker's health endpoint, `GET /v1/models` and load endpoint
    /// (`/v1/loads`, `/metrics`), in bytes; past it the probe or poll fails without reading the
    /// rest (counted in `kvgate_oversized_answers_total`). An engine's `/metrics` is some
    /// hundreds of KiB at most; each probe in flight may hold up to twice this.
    #[arg(long, default_value_t = 2 * 1024 * 1024, value_name = "BYTES")]
    pub max_probe_answer_bytes: usize,
    /// Largest prefill answer of a disaggregated pair read, in bytes (vLLM: parsed for its
    /// kv_transfer_params; SGLang: drained); past it the prefill side failed.
    #[arg(long, default_value_t = 16 * 1024 * 1024, value_name = "BYTES")]
    pub max_prefill_answer_bytes: usize,

    /// Seconds between health checks of each worker. A worker that keeps passing is checked up
    /// to 4 intervals apart, one that answered proxied requests since its last check passes
    /// without one (passive health), and one unhealthy or whose circuit is open or half-open is
    /// checked every interval; checks are spread over the interval.
    #[arg(long, default_value_t = 10.0)]
    pub health_check_interval_secs: f64,
    /// Timeout of one health check, in seconds.
    #[arg(long, default_value_t = 5.0)]
    pub health_check_timeout_secs: f64,
    /// Path probed on each worker.
    #[arg(long, default_value = "/health")]
    pub health_check_endpoint: String,
    /// Consecutive failed checks that mark a healthy worker unhealthy.
    #[arg(long, default_value_t = 3)]
    pub health_failure_threshold: u32,
    /// Consecutive passed checks that mark an unhealthy worker healthy again.
    #[arg(long, default_value_t = 2)]
    pub health_success_threshold: u32,
    /// Do not probe workers: every worker is considered healthy.
    #[arg(long)]
    pub disable_health_check: bool,

    /// Retries of a failed request on other workers (connect errors, 502/503/504 before any byte).
    #[arg(long, default_value_t = 3)]
    pub retry_max_retries: u32,
    /// First retry backoff in milliseconds (doubled per attempt, with jitter).
    #[arg(long, default_value_t = 50)]
    pub retry_initial_backoff_ms: u64,
    /// Largest retry backoff in milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub retry_max_backoff_ms: u64,
    /// Never retry.
    #[arg(long)]
    pub disable_retries: bool,

    /// Consecutive failures that open a worker's circuit.
    #[arg(long, default_value_t = 5)]
    pub cb_failure_threshold: u32,
    /// Seconds an open circuit waits before letting a probe request through (half-open).
    #[arg(long, default_value_t = 30.0)]
    pub cb_timeout_duration_secs: f64,
    /// Never open circuits.
    #[arg(long)]
    pub disable_circuit_breaker: bool,

    /// The admin API's key: `/workers` and `/v1/route` require `Authorization: Bearer KEY` on
    /// every listener, and are served on the main listener too. Without it they are served
    /// only on the admin listener (--admin-host, --admin-port).
    #[arg(long, env = "KVGATE_ADMIN_API_KEY", hide_env_values = true)]
    pub admin_api_key: Option<String>,
    /// Address of the admin listener (`/workers`, `/v1/route`, and the read-only endpoints; no
    /// proxied traffic). A non-loopback address needs --admin-api-key (or --admin-insecure).
    #[arg(long, default_value = "127.0.0.1")]
    pub admin_host: String,
    /// Port of the admin listener (0 picks a free port). Unset: the port after --port (a free
    /// one when --port is 0) when no --admin-api-key is given, else no admin listener (the
    /// admin API is on the main listener, behind the key).
    #[arg(long)]
    pub admin_port: Option<u16>,
    /// Names a browser may reach the admin API by besides the admin listener's own (its address,
    /// and `localhost` on a loopback listener): `gateway.internal` or `gateway.internal:30001`.
    /// Without an admin key, a request whose `Host` is none of these is refused (403), so a web
    /// page whose name was rebound to this address (DNS rebinding) cannot reach the admin API.
    #[arg(long = "admin-allowed-hosts", value_delimiter = ',', num_args = 0.., value_name = "HOST")]
    pub admin_allowed_hosts: Vec<String>,
    /// Address of the metrics listener (--prometheus-port).
    #[arg(long, default_value = "127.0.0.1")]
    pub prometheus_host: String,
    /// Also serve `GET /metrics` (and `/health`) on a listener of its own at --prometheus-host
    /// on this port (0 picks a free port), as SMG does; `/metrics` stays on --port too. Unset: no
    /// metrics listener.
    #[arg(long)]
    pub prometheus_port: Option<u16>,
    /// Serve the admin API without a key on a non-loopback --admin-host: anyone who reaches it
    /// can add workers (which then receive clients' prompts). Logged loudly at start.
    #[arg(long)]
    pub admin_insecure: bool,
    /// Most workers registered at once (POST /workers, discovery, --worker-urls); further
    /// registrations are refused with 409.
    #[arg(long, default_value_t = 4096)]
    pub max_workers: usize,
    /// Where workers may be: CIDRs (`10.0.0.0/8`, `127.0.0.1/32`), host names (`engine-1`) or
    /// name patterns (`*.svc.cluster.local`); a worker URL (and its KV event endpoints) whose
    /// host matches none is refused. A name is allowed when it matches a pattern, or when every
    /// address it resolves to is in an allowed CIDR. Empty: any address.
    #[arg(long = "worker-url-allow", value_delimiter = ',', num_args = 0.., value_name = "CIDR_OR_HOST")]
    pub worker_url_allow: Vec<String>,
    /// Route to each data-parallel rank of an engine as a worker of its own (SMG's `--dp-aware`):
    /// at registration the gateway reads the engine's `dp_size` from SGLang's `GET /server_info`,
    /// registers one worker per rank (named `URL@RANK`, with its own load, in-flight count,
    /// prefix state and, given one endpoint per rank, KV events) and sends the chosen rank in
    /// the request body as `data_parallel_rank`.
    #[arg(long)]
    pub dp_aware: bool,
    /// Bearer token sent to workers.
    #[arg(long, env = "KVGATE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// When set, the inference endpoints require `Authorization: Bearer KEY` with one of these
    /// keys (401 otherwise); the client's key is not forwarded to workers. `KEY=TENANT` names
    /// the key's tenant (split at the last `=`; a plain KEY is the tenant `default`).
    #[arg(long, env = "KVGATE_CLIENT_API_KEYS", value_delimiter = ',', hide_env_values = true)]
    pub client_api_keys: Vec<String>,
    /// More client keys, one `KEY TENANT [CLASS]` per line (`#` starts a comment), read at start
    /// and again on SIGHUP (a file that does not parse keeps the keys in use); with it, the
    /// inference endpoints require a key even when the file lists none.
    #[arg(long, value_name = "FILE")]
    pub client_api_keys_file: Option<std::path::PathBuf>,
    /// Header naming a request's tenant when no client keys are configured (with keys, the key
    /// names the tenant and the header is ignored); without it, the body's `user` field, else
    /// the tenant `default`.
    #[arg(long, default_value = "x-kvgate-tenant")]
    pub tenant_header: String,
    /// Header naming a request's priority class (`high`, `normal`, `low`); without it, the
    /// tenant's class. With client keys, it can only lower the class the tenant has.
    #[arg(long, default_value = "x-kvgate-priority")]
    pub priority_header: String,
    /// Tell the engines each request's priority class as the body's `priority` field (on chat,
    /// completions and generate requests), so an engine with priority scheduling serves a
    /// higher class's prefill first: `vllm` (lower values first: high -1, normal 0, low 1) or
    /// `sglang` (higher first: high 1, normal 0, low -1). The engines must run priority
    /// scheduling (vLLM `--scheduling-policy priority`, SGLang `--enable-priority-scheduling`,
    /// `kvgate mock --priority-scheduling`); off: the body as the client sent it.
    #[arg(long, value_enum, default_value_t = ForwardPriority::Off)]
    pub forward_priority: ForwardPriority,
    /// Per-tenant quotas, weights and priority classes (YAML only): `tenants: {defaults:
    /// {requests_per_minute, tokens_per_minute, max_concurrent, weight, class}, named: {NAME:
    /// {...}}, classes: {high: {queue_timeout_secs, reserved_concurrency}}}`.
    #[arg(skip)]
    #[serde(skip_serializing_if = "TenantsConfig::is_empty")]
    pub tenants: TenantsConfig,

    /// Forward the client's credentials (`Authorization`, `Cookie`, `X-Api-Key`, `Api-Key`) to
    /// the worker. Off by default: a worker gets only --api-key. Never with --client-api-keys
    /// (those are the gateway's).
    #[arg(long)]
    pub forward_client_auth: bool,

    /// Seconds a client has to send a complete request head, counted from the connection's
    /// start (TLS handshake included) or from the first byte of a later request; a client that
    /// has not finished by then (or sent nothing) is disconnected.
    #[arg(long, default_value_t = 10.0)]
    pub header_read_timeout_secs: f64,
    /// Seconds an idle keep-alive client connection (no request in progress) stays open after
    /// its last response before it is closed.
    #[arg(long, default_value_t = 60.0)]
    pub keep_alive_timeout_secs: f64,
    /// Most client connections open at once; connections beyond it are closed as soon as they
    /// are accepted. Keep it below the process's file descriptor limit (`ulimit -n`), leaving
    /// room for worker connections.
    #[arg(long, default_value_t = 10000)]
    pub max_connections: usize,
    /// Serve HTTPS: the listener's certificate chain (PEM), with --tls-key-path.
    #[arg(long, value_name = "FILE")]
    pub tls_cert_path: Option<std::path::PathBuf>,
    /// The listener's private key (PEM: PKCS#8, PKCS#1 or SEC1), with --tls-cert-path.
    #[arg(long, value_name = "FILE")]
    pub tls_key_path: Option<std::path::PathBuf>,
    /// CA certificates (PEM) trusted for `https://` workers, instead of the built-in Mozilla
    /// roots.
    #[arg(long = "ca-cert-paths", num_args = 0.., value_name = "FILE")]
    pub ca_cert_paths: Vec<std::path::PathBuf>,
    /// Client certificate chain (PEM) presented to `https://` workers (mTLS), with
    /// --client-key-path.
    #[arg(long, value_name = "FILE")]
    pub client_cert_path: Option<std::path::PathBuf>,
    /// The private key (PEM) of --client-cert-path.
    #[arg(long, value_name = "FILE")]
    pub client_key_path: Option<std::path::PathBuf>,

    /// Log level (error, warn, info, debug, trace) or a tracing filter directive.
    #[arg(long, default_value = "info")]
    pub log_level: String,
    /// Log as JSON lines.
    #[arg(long, alias = "json-log")]
    pub log_json: bool,
    /// Also write the log to DIR/kvgate.log (appended; the directory is created), beside stderr
    /// (`kvgate launch`).
    #[arg(long, value_name = "DIR")]
    pub log_dir: Option<std::path::PathBuf>,
    /// Export a trace span per proxied request over OTLP/HTTP (protobuf) to this collector URL
    /// (e.g. `http://127.0.0.1:4318/v1/traces`): the route reason, prefix index and
    /// predicted-TTFT terms of each attempt, retries, time to first byte; the client's W3C
    /// `traceparent` is continued and the span's own goes to the engines. Unset: off.
    #[arg(long, value_name = "URL")]
    pub otlp_traces_endpoint: Option<String>,
    /// Add x-kvgate-worker and x-kvgate-route headers to proxied responses.
    #[arg(long)]
    pub expose_routing_headers: bool,
    /// Seconds in-flight requests may take to finish after SIGTERM/SIGINT.
    #[arg(long, default_value_t = 30.0)]
    pub shutdown_grace_period_secs: f64,
    /// Threads of the async runtime (default: one per CPU core); used where the runtime is built
    /// (`kvgate launch`, the Python package), not by an embedder's own runtime.
    #[arg(long, value_name = "N")]
    pub worker_threads: Option<usize>,

    /// Share approximate routing with the other gateway replicas through this Redis server
    /// (`redis://HOST:PORT[/DB]`): each replica publishes what it routes (the prompt's block
    /// hashes and the worker) and its in-flight count per worker, and applies its peers'. A lost
    /// Redis leaves each replica routing on its own state (warning, metric) until it is back.
    /// Unset: no sharing.
    #[arg(long, value_name = "URL")]
    pub replica_sync_redis_url: Option<String>,
    /// The Redis pub/sub channel the replicas of one deployment share.
    #[arg(long, default_value = "kvgate:replica-sync")]
    pub replica_sync_channel: String,
    /// Milliseconds between two publications of this replica's in-flight counts; a peer not
    /// heard from within five intervals no longer counts.
    #[arg(long, default_value_t = 200)]
    pub replica_sync_interval_ms: u64,
    /// Most prompt blocks routed by peers kept per pool (least recently used go first; about
    /// 100 bytes each). A block is the tree's --block-size tokens, or 256 bytes of text.
    #[arg(long, default_value_t = 1048576)]
    pub replica_sync_max_blocks: usize,

    /// The secret every replica of a deployment shares: each message is signed with it
    /// (HMAC-SHA256) and peers' messages that do not verify are dropped. Required with
    /// --replica-sync-redis-url; at least 16 bytes.
    #[arg(long, env = "KVGATE_REPLICA_SYNC_SECRET", hide_env_values = true)]
    pub replica_sync_secret: Option<String>,
    /// Oldest peer message applied, in milliseconds (also the clock difference tolerated
    /// between replicas); older ones, and ones numbered at or below their sender's last, are
    /// dropped as replays.
    #[arg(long, default_value_t = 10000)]
    pub replica_sync_max_age_ms: u64,
    /// Largest replica-sync message read, in bytes (this replica's own stay below half of it).
    #[arg(long, default_value_t = 1024 * 1024, value_name = "BYTES")]
    pub replica_sync_max_message_bytes: usize,
    /// Most block hashes in one routing record: this replica sends a prompt's first ones; a
    /// peer's longer record is dropped alone.
    #[arg(long, default_value_t = 4096)]
    pub replica_sync_max_hashes_per_record: usize,
    /// Most peer replicas tracked at once; messages of further replica ids are dropped.
    #[arg(long, default_value_t = 64)]
    pub replica_sync_max_peers: usize,
    /// Most requests one peer may claim in flight on one worker; larger claims are clamped.
    #[arg(long, default_value_t = 1024)]
    pub replica_sync_max_peer_in_flight: u64,

    /// Serve client connections on this many I/O threads (default: one per CPU core), each with
    /// its own single-threaded runtime, its own SO_REUSEPORT listener and its own upstream
    /// connections, so a connection's requests never cross threads (nginx's worker model); 0
    /// serves them on the main multi-threaded runtime (--worker-threads) instead.
    #[arg(long, value_name = "N")]
    pub io_threads: Option<usize>,

    /// Find workers as Kubernetes pods (--selector, or --prefill-selector/--decode-selector with
    /// --pd-disaggregation): Ready pods join, pods deleted or no longer Ready leave.
    #[arg(long)]
    pub service_discovery: bool,
    /// Label selector of the worker pods, as `key=value` pairs (all must match).
    #[arg(long, num_args = 1.., value_name = "KEY=VALUE")]
    pub selector: Vec<String>,
    /// Label selector of the prefill pods (with --pd-disaggregation), as `key=value` pairs.
    #[arg(long, num_args = 1.., value_name = "KEY=VALUE")]
    pub prefill_selector: Vec<String>,
    /// Label selector of the decode pods (with --pd-disaggregation), as `key=value` pairs.
    #[arg(long, num_args = 1.., value_name = "KEY=VALUE")]
    pub decode_selector: Vec<String>,
    /// Namespace whose pods are watched (unset: every namespace, which needs cluster-wide
    /// permission to list and watch pods).
    #[arg(long, value_name = "NAMESPACE")]
    pub service_discovery_namespace: Option<String>,
    /// Port of the workers on the discovered pods: a pod is the worker `http://{podIP}:{port}`.
    #[arg(long, default_value_t = 8000)]
    pub service_discovery_port: u16,
    /// Pod annotation holding a prefill pod's SGLang bootstrap port.
    #[arg(long, default_value = "sglang.ai/bootstrap-port")]
    pub bootstrap_port_annotation: String,
    /// Pod annotation that overrides --service-discovery-port for one pod (pods whose worker
    /// listens elsewhere).
    #[arg(long, default_value = "kvgate.io/worker-port")]
    pub worker_port_annotation: String,
    /// Kubeconfig file of the cluster to watch (unset: the in-cluster service account, else
    /// $KUBECONFIG or ~/.kube/config).
    #[arg(long, value_name = "FILE")]
    pub service_discovery_kubeconfig: Option<std::path::PathBuf>,
}

/// Most `--io-threads`.
pub const MAX_IO_THREADS: usize = 1024;

impl GatewayConfig {
    /// How many I/O threads serve client connections (`--io-threads`, by default one per core);
    /// 0 when they are served on the caller's runtime.
    pub fn io_thread_count(&self) -> usize {
        self.io_threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
    }

    /// Where the admin listener binds: `--admin-host` with `--admin-port`, else, without an admin
    /// key, the port after `--port` (a free one with `--port 0`); `None`: no admin listener (the
    /// admin API is on the main listener, behind the key).
    pub fn admin_listener(&self) -> Option<(String, u16)> {
        let port = match (self.admin_port, &self.admin_api_key) {
            (Some(port), _) => port,
            (None, Some(_)) => return None,
            (None, None) if self.port == 0 => 0,
            (None, None) => self.port.checked_add(1)?,
        };
        Some((self.admin_host.clone(), port))
    }

    /// How many threads tokenize (`--tokenizer-threads`, by default half the cores, at least 1).
    pub fn tokenizer_thread_count(&self) -> usize {
        self.tokenizer_threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()) / 2)
            .max(1)
    }
}

impl Default for GatewayConfig {
    fn default() -> Self {
        use clap::Parser;
        #[derive(Parser)]
        struct Defaults {
            #[command(flatten)]
            config: GatewayConfig,
        }
        Defaults::parse_from(["kvgate"]).config
    }
}

impl GatewayConfig {
    /// A builder reaching every option (one setter per field, named as the field; unset options
    /// keep the command line's defaults), for embedding the gateway in a Rust program:
    /// `GatewayConfig::builder().port(0u16).worker_urls(vec![url]).build()?`, then
    /// [`crate::start`] and [`crate::GatewayHandle::shutdown`].
    pub fn builder() -> GatewayConfigBuilder {
        GatewayConfigBuilder::default()
    }

    /// Read a YAML configuration file (keys are the field names, routing options under
    /// `routing:`) and lay the command line's explicitly given flags (`explicit`: their clap ids,
    /// which are the field names) over it. Unknown keys and wrong types are errors.
    pub fn with_file(
        yaml: &str,
        cli: &GatewayConfig,
        explicit: &[String],
    ) -> Result<GatewayConfig, ValidationErrors> {
        let file = if yaml.trim().is_empty() { GatewayConfig::default() } else { Self::from_yaml(yaml)? };
        // YAML values (not JSON) so that NaN and infinities survive the merge and reach validation.
        let configuration_error =
            |e: serde_norway::Error| FieldError::new("configuration", e.to_string()).with_flag(None);
        let mut merged = serde_norway::to_value(&file).map_err(configuration_error)?;
        let given = serde_norway::to_value(cli).map_err(configuration_error)?;
        for id in explicit {
            if let Some(value) = given.get(id) {
                merged[id] = value.clone();
            } else if let Some(value) = given["routing"].get(id) {
                merged["routing"][id] = value.clone();
            }
        }
        // Read back as YAML text through the file's parser, not from the value: one instance of
        // the configuration's deserializer in the binary instead of two (about 0.1 MB), and the
        // file's lenient scalars (`api_key: 1234` is the string "1234") read alike.
        Self::from_yaml(&serde_norway::to_string(&merged).map_err(configuration_error)?)
    }

    /// The configuration of a YAML text, errors named by the field's path.
    fn from_yaml(yaml: &str) -> Result<GatewayConfig, ValidationErrors> {
        serde_path_to_error::deserialize(serde_norway::Deserializer::from_str(yaml)).map_err(file_error)
    }

    /// The policy configuration of `model`: `routing` with the model's `models:` entry laid over it.
    pub fn model_routing(&self, model: &str) -> Result<PolicyConfig, String> {
        let Some(overrides) = self.models.get(model) else { return Ok(self.routing.clone()) };
        let mut merged = serde_norway::to_value(&self.routing).map_err(|e| e.to_string())?;
        let serde_norway::Value::Mapping(entries) = overrides else {
            return Err(format!("models.{model} must be a map of policy options"));
        };
        for (key, value) in entries {
            let Some(key) = key.as_str() else {
                return Err(format!("models.{model}: keys must be option names"));
            };
            merged[key] = value.clone();
        }
        serde_norway::from_value(merged).map_err(|e| format!("models.{model}: {e}"))
    }

    /// The configuration as YAML, readable back with `--config` (secrets shown as `<set>`).
    pub fn to_yaml(&self) -> Result<String, String> {
        let mut shown = self.clone();
        for secret in [&mut shown.admin_api_key, &mut shown.api_key, &mut shown.replica_sync_secret] {
            if secret.is_some() {
                *secret = Some("<set>".into());
            }
        }
        if !shown.client_api_keys.is_empty() {
            shown.client_api_keys = vec!["<set>".into()];
        }
        // A Redis password in the URL (AUTH) is a secret too.
        shown.replica_sync_redis_url =
            shown.replica_sync_redis_url.map(|url| crate::worker_url::redact_credentials(&url));
        serde_norway::to_string(&shown).map_err(|e| e.to_string())
    }

    /// The effective load poll interval in milliseconds.
    pub fn load_poll_interval_ms(&self) -> u64 {
        match self.load_monitor_interval {
            Some(secs) => (secs * 1000.0).round().max(1.0) as u64,
            None => self.load_monitor_interval_ms,
        }
    }
}

/// One worker given at start: URL, role, bootstrap port.
#[derive(Clone, Debug, PartialEq)]
pub struct InitialWorker {
    pub url: String,
    pub role: WorkerRole,
    pub bootstrap_port: Option<u16>,
}

/// Whether a `--prefill` value is a bootstrap port (else it starts the next worker's URL).
fn is_port_value(text: &str) -> bool {
    text.eq_ignore_ascii_case("none") || text.bytes().all(|b| b.is_ascii_digit())
}

/// The `--prefill` values grouped into (URL, bootstrap port) entries.
fn prefill_groups(values: &[String]) -> Vec<Vec<String>> {
    let mut groups: Vec<Vec<String>> = Vec::new();
    for value in values {
        match groups.last_mut() {
            Some(group) if group.len() == 1 && is_port_value(value) => group.push(value.clone()),
            _ => groups.push(vec![value.clone()]),
        }
    }
    groups
}

/// A `--prefill` entry's bootstrap port: a port number or `none`.
fn parse_bootstrap_port(text: &str) -> Result<Option<u16>, String> {
    if text.eq_ignore_ascii_case("none") {
        return Ok(None);
    }
    match text.parse::<u16>() {
        Ok(port) if port > 0 => Ok(Some(port)),
        _ => Err(format!("bootstrap port {text:?} is not a port number (1-65535) or `none`")),
    }
}

impl GatewayConfig {
    /// Per-worker overload protection's bounds (`--worker-overload-*`).
    pub fn overload_settings(&self) -> kvgate_policy::OverloadSettings {
        kvgate_policy::OverloadSettings {
            waiting_requests: self.worker_overload_waiting_requests,
            token_usage: self.worker_overload_token_usage,
            shed: self.worker_overload_shed,
        }
    }

    /// Every worker given at start, in the order --worker-urls, --prefill, --decode (the order of
    /// --kv-events-endpoints). Entries that fail validation are skipped.
    pub fn initial_workers(&self) -> Vec<InitialWorker> {
        let regular = self.worker_urls.iter().map(|url| InitialWorker {
            url: url.clone(),
            role: WorkerRole::Regular,
            bootstrap_port: None,
        });
        let prefill = prefill_groups(&self.prefill).into_iter().filter_map(|entry| {
            let port = match entry.get(1) {
                Some(text) => parse_bootstrap_port(text).ok()?,
                None => None,
            };
            Some(InitialWorker {
                url: entry.first()?.clone(),
                role: WorkerRole::Prefill,
                bootstrap_port: port,
            })
        });
        let decode = self.decode.iter().map(|url| InitialWorker {
            url: url.clone(),
            role: WorkerRole::Decode,
            bootstrap_port: None,
        });
        regular.chain(prefill).chain(decode).collect()
    }

    /// The KV events source of the `index`-th initial worker (validated by `validate`).
    pub fn kv_events_source(&self, index: usize) -> Result<Option<KvEventsSource>, String> {
        let Some(events) = self.kv_events_endpoints.get(index) else { return Ok(None) };
        KvEventsSource::parse(events, self.kv_events_replay_endpoints.get(index).map(String::as_str))
    }
}

/// `prefill` in YAML: a list of `URL`, `[URL, PORT]` or `{url, bootstrap_port}` entries.
mod prefill_entries {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    #[serde(untagged)]
    enum Port {
        Number(u16),
        Text(String),
    }

    #[derive(Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Entry {
        url: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        bootstrap_port: Option<Port>,
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Given {
        Url(String),
        List(Vec<String>),
        Map(Entry),
    }

    fn port_text(port: Port) -> String {
        match port {
            Port::Number(n) => n.to_string(),
            Port::Text(text) => text,
        }
    }

    pub fn serialize<S: Serializer>(values: &[String], serializer: S) -> Result<S::Ok, S::Error> {
        let maps: Vec<Entry> = super::prefill_groups(values)
            .iter()
            .map(|entry| Entry {
                url: entry.first().cloned().unwrap_or_default(),
                bootstrap_port: entry.get(1).map(|port| Port::Text(port.clone())),
            })
            .collect();
        maps.serialize(serializer)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<String>, D::Error> {
        let given = Vec::<Given>::deserialize(deserializer)?;
        Ok(given
            .into_iter()
            .flat_map(|entry| match entry {
                Given::Url(url) => vec![url],
                Given::List(list) => list,
                Given::Map(Entry { url, bootstrap_port }) => {
                    std::iter::once(url).chain(bootstrap_port.map(port_text)).collect()
                }
            })
            .collect())
    }
}

/// A configuration file that does not parse as the schema: the field by its path (an unknown key
/// named in full, e.g. `routing.cache_treshold`) and the parser's message.
fn file_error<E: std::fmt::Display>(error: serde_path_to_error::Error<E>) -> ValidationErrors {
    let path = error.path().to_string();
    let mut message = error.inner().to_string();
    // The YAML parser prefixes nested errors with their parent's path: the field says it already.
    if let Some((prefix, rest)) = message.split_once(": ") {
        if !prefix.contains(' ') && path.starts_with(prefix) {
            message = rest.to_string();
        }
    }
    let error = if path == "." {
        FieldError::new("configuration", message).with_flag(None)
    } else if message.starts_with("unknown field") {
        FieldError::new(path, message).with_flag(None)
    } else {
        FieldError::new(path, message)
    };
    error.into()
}

impl GatewayConfigBuilder {
    /// The configuration, validated: every problem at once, as from the command line or a file.
    pub fn build(&self) -> Result<GatewayConfig, ValidationErrors> {
        let config =
            self.assemble().map_err(|e| FieldError::new("builder", e.to_string()).with_flag(None))?;
        config.validate()?;
        Ok(config)
    }
}

mod discovery;
mod kv_events_source;
mod validate;

pub use discovery::label_selector;
pub use kv_events_source::{KvEventsSource, RankEndpoints, NO_ENDPOINT};
pub use kvgate_policy::tenants::{ClassSettings, PriorityClass, TenantLimits, TenantsConfig};

#[cfg(test)]
mod tests;
