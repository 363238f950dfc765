//! Tests of the gateway configuration: files and flags, validation, the builder, defaults.

use super::*;

#[test]
fn defaults_are_valid_and_loopback() {
    let config = GatewayConfig::default();
    assert_eq!(config.host, "127.0.0.1");
    assert_eq!(config.port, 30000);
    assert_eq!(config.health_check_endpoint, "/health");
    config.validate().unwrap();
}

#[test]
fn yaml_file_with_command_line_overrides() {
    let yaml = "port: 31000\nworker_urls: [\"http://127.0.0.1:8000\"]\nrouting:\n  policy: round_robin\n  cache_threshold: 0.5\n";
    let cli = GatewayConfig { port: 32000, ..GatewayConfig::default() };
    let merged = GatewayConfig::with_file(yaml, &cli, &["port".to_string()]).unwrap();
    assert_eq!(merged.port, 32000, "an explicit flag wins over the file");
    assert_eq!(merged.worker_urls, ["http://127.0.0.1:8000"]);
    assert_eq!(merged.routing.policy, kvgate_policy::PolicyKind::RoundRobin);
    assert_eq!(merged.routing.cache_threshold, 0.5);
    assert_eq!(merged.health_check_endpoint, "/health", "unset keys keep their defaults");
    let flag = GatewayConfig::with_file(yaml, &GatewayConfig::default(), &["cache_threshold".to_string()]);
    assert_eq!(flag.unwrap().routing.cache_threshold, 0.3, "routing flags override too");
    assert_eq!(GatewayConfig::with_file("", &cli, &[]).unwrap(), GatewayConfig::default());
}

#[test]
fn yaml_scalars_read_as_strings_with_flags_laid_over_as_without() {
    // A plain scalar is a string where the field is one (`api_key: 1234`), and laying flags over
    // the file (a second read of the merged YAML) keeps every value as the file gave it.
    let yaml = "api_key: 1234\nkv_events_topic: 7\nrequest_timeout_secs: 30\nrouting:\n  cache_threshold: .nan\nmodels:\n  m: {policy: manual}\n";
    let cli = GatewayConfig { port: 0, ..GatewayConfig::default() };
    for explicit in [&[][..], &["port".to_string()][..]] {
        let config = GatewayConfig::with_file(yaml, &cli, explicit).unwrap();
        assert_eq!(config.api_key.as_deref(), Some("1234"), "{explicit:?}");
        assert_eq!(config.kv_events_topic, "7");
        assert_eq!(config.request_timeout_secs, 30.0);
        assert!(config.routing.cache_threshold.is_nan(), "NaN reaches validation");
        assert_eq!(config.models["m"]["policy"], serde_norway::Value::String("manual".into()));
        assert_eq!(config.port, if explicit.is_empty() { 30000 } else { 0 });
    }
}

#[test]
fn yaml_unknown_keys_and_wrong_types_are_errors_named_by_path() {
    let load =
        |yaml: &str| GatewayConfig::with_file(yaml, &GatewayConfig::default(), &[]).unwrap_err().to_string();
    let unknown = load("prot: 1\n");
    assert!(
        unknown.contains("invalid prot: unknown field `prot`, expected one of `host`, `port`"),
        "{unknown}"
    );
    let nested = load("routing:\n  cache_treshold: 1\n");
    assert!(nested.contains("invalid routing.cache_treshold: unknown field `cache_treshold`"), "{nested}");
    let wrong = load("port: many\n");
    assert!(wrong.contains("invalid port (--port): invalid type"), "{wrong}");
}

#[test]
fn nan_and_infinities_from_a_file_are_rejected_naming_field_and_flag() {
    let yaml = "request_timeout_secs: .nan\nrouting:\n  cache_threshold: .inf\n  eviction_interval: -1\n";
    let config = GatewayConfig::with_file(yaml, &GatewayConfig::default(), &[]).unwrap();
    let errors = config.validate().unwrap_err().to_string();
    for line in [
        "invalid routing.cache_threshold (--cache-threshold): must be a finite number in (0, 1], got inf",
        "invalid routing.eviction_interval (--eviction-interval): must be a finite number in (0, inf), got -1",
        "invalid request_timeout_secs (--request-timeout-secs): must be a finite number in (0, inf), got NaN",
    ] {
        assert!(errors.contains(line), "{errors}");
    }
    assert!(errors.starts_with("invalid configuration (3 problems):"), "{errors}");
}

/// The option names of the schema: the clap ids of every `kvgate launch` option of the struct.
fn schema_ids() -> std::collections::BTreeSet<String> {
    use clap::Args;
    let command = GatewayConfig::augment_args(clap::Command::new("schema"));
    command.get_arguments().map(|arg| arg.get_id().to_string()).filter(|id| id != "help").collect()
}

#[test]
fn builder_file_and_flags_reach_the_same_options_with_the_same_defaults() {
    // Every schema option is a field (a YAML key and a builder setter), and every field an option.
    let value = serde_norway::to_value(GatewayConfig::default()).unwrap();
    let mut keys = std::collections::BTreeSet::new();
    for (key, entry) in value.as_mapping().unwrap() {
        let key = key.as_str().unwrap().to_string();
        match key.as_str() {
            "routing" => {
                keys.extend(entry.as_mapping().unwrap().keys().map(|k| k.as_str().unwrap().to_string()))
            }
            "models" => {}
            _ => {
                keys.insert(key);
            }
        }
    }
    keys.insert("load_monitor_interval".into()); // unset, so not serialized
    assert_eq!(keys, schema_ids());
    // Defaults: the command line's, the file's (empty), the builder's.
    let cli = GatewayConfig::default();
    assert_eq!(GatewayConfig::with_file("", &cli, &[]).unwrap(), cli);
    assert_eq!(GatewayConfig::with_file("port: 30000\n", &cli, &[]).unwrap(), cli);
    assert_eq!(GatewayConfig::builder().build().unwrap(), cli);
    assert_eq!(PolicyConfig::builder().build().unwrap(), cli.routing);
}

#[test]
fn the_builder_sets_options_and_reports_every_problem() {
    let routing = PolicyConfig::builder()
        .policy(kvgate_policy::PolicyKind::KvAware)
        .cache_threshold(0.5)
        .build()
        .unwrap();
    let config = GatewayConfig::builder()
        .port(0u16)
        .worker_urls(vec!["http://127.0.0.1:8001".to_string()])
        .routing(routing)
        .worker_threads(2usize)
        .request_timeout_secs(60.0)
        .build()
        .unwrap();
    assert_eq!((config.port, config.worker_threads, config.request_timeout_secs), (0, Some(2), 60.0));
    assert_eq!(config.routing.policy, kvgate_policy::PolicyKind::KvAware);
    let bad = GatewayConfig::builder()
        .request_timeout_secs(f64::INFINITY)
        .health_failure_threshold(0u32)
        .routing(PolicyConfig { balance_rel_threshold: 0.5, ..PolicyConfig::default() })
        .build()
        .unwrap_err();
    let fields: Vec<&str> = bad.iter().map(|e| e.field.as_str()).collect();
    assert_eq!(fields, ["routing.balance_rel_threshold", "request_timeout_secs", "health_failure_threshold"]);
    let policy = PolicyConfig::builder().cache_threshold(f64::NAN).build().unwrap_err();
    assert!(policy.to_string().contains("invalid cache_threshold (--cache-threshold)"), "{policy}");
}
#[test]
fn all_errors_reported_at_once() {
    let config = GatewayConfig {
        request_timeout_secs: f64::NAN,
        cb_timeout_duration_secs: f64::INFINITY,
        health_failure_threshold: 0,
        worker_urls: vec!["ftp://x".into()],
        ..GatewayConfig::default()
    };
    let fields: Vec<_> = config.validate().unwrap_err().iter().map(|e| e.field.clone()).collect();
    assert_eq!(
        fields,
        ["request_timeout_secs", "cb_timeout_duration_secs", "health_failure_threshold", "worker_urls"]
    );
}

#[test]
fn pd_workers_from_flags_and_yaml() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        config: GatewayConfig,
    }
    let cli = Cli::try_parse_from([
        "kvgate",
        "--pd-disaggregation",
        "--prefill",
        "http://127.0.0.1:1",
        "8998",
        "--prefill",
        "http://127.0.0.1:2",
        "--decode",
        "http://127.0.0.1:3",
        "--prefill-policy",
        "cache_aware",
        "--decode-policy",
        "round_robin",
        "--pd-protocol",
        "vllm",
    ])
    .unwrap()
    .config;
    cli.validate().unwrap();
    let workers = cli.initial_workers();
    assert_eq!(workers.len(), 3);
    assert_eq!((workers[0].role, workers[0].bootstrap_port), (WorkerRole::Prefill, Some(8998)));
    assert_eq!((workers[1].role, workers[1].bootstrap_port), (WorkerRole::Prefill, None));
    assert_eq!(workers[2].role, WorkerRole::Decode);
    assert_eq!(cli.pd_protocol, PdProtocol::Vllm);
    let yaml = concat!(
        "pd_disaggregation: true\nprefill:\n  - http://127.0.0.1:1\n",
        "  - [http://127.0.0.1:2, \"8999\"]\n  - {url: \"http://127.0.0.1:4\", bootstrap_port: 9000}\n",
        "decode: [http://127.0.0.1:3]\n"
    );
    let file = GatewayConfig::with_file(yaml, &GatewayConfig::default(), &[]).unwrap();
    file.validate().unwrap();
    let ports: Vec<_> = file.initial_workers().iter().map(|w| w.bootstrap_port).collect();
    assert_eq!(ports, [None, Some(8999), Some(9000), None]);
    let bad = GatewayConfig {
        prefill: vec!["http://127.0.0.1:1".into(), "99999".into()],
        decode: vec!["ftp://x".into()],
        ..GatewayConfig::default()
    };
    let fields: Vec<_> = bad.validate().unwrap_err().iter().map(|e| e.field.clone()).collect();
    assert_eq!(fields, ["prefill", "decode", "prefill", "decode"]);
}

#[test]
fn the_printed_configuration_reads_back() {
    let config = GatewayConfig {
        port: 31234,
        api_key: Some("hunter2-api".into()),
        replica_sync_secret: Some("hunter2-replica-sync".into()),
        replica_sync_redis_url: Some("rediss://kvgate:hunter2@127.0.0.1:6380".into()),
        ..GatewayConfig::default()
    };
    let yaml = config.to_yaml().unwrap();
    assert!(yaml.contains("port: 31234") && !yaml.contains("hunter2"), "{yaml}");
    let back = GatewayConfig::with_file(&yaml, &GatewayConfig::default(), &[]).unwrap();
    assert_eq!(back.port, 31234);
    assert_eq!(back.routing, config.routing);
}

#[test]
fn models_get_their_own_policy_options() {
    let yaml = "routing:\n  cache_threshold: 0.4\nmodels:\n  llama:\n    policy: CacheAware\n    cache_threshold: 0.7\n  qwen:\n    policy: manual\n";
    let config = GatewayConfig::with_file(yaml, &GatewayConfig::default(), &[]).unwrap();
    config.validate().unwrap();
    let llama = config.model_routing("llama").unwrap();
    assert_eq!((llama.policy, llama.cache_threshold), (kvgate_policy::PolicyKind::CacheAware, 0.7));
    let qwen = config.model_routing("qwen").unwrap();
    assert_eq!((qwen.policy, qwen.cache_threshold), (kvgate_policy::PolicyKind::Manual, 0.4));
    assert_eq!(config.model_routing("other").unwrap(), config.routing, "unlisted models take routing:");
    let bad = "models:\n  llama:\n    cache_treshold: 0.7\n  qwen:\n    cache_threshold: 7\n";
    let config = GatewayConfig::with_file(bad, &GatewayConfig::default(), &[]).unwrap();
    let errors: Vec<String> = config.validate().unwrap_err().iter().map(|e| e.to_string()).collect();
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(errors[0].contains("llama") && errors[0].contains("cache_treshold"), "{errors:?}");
    assert!(errors[1].contains("qwen") && errors[1].contains("cache_threshold"), "{errors:?}");
}

#[test]
fn kv_events_endpoints_are_one_per_worker() {
    let urls = vec!["http://127.0.0.1:1".to_string(), "http://127.0.0.1:2".to_string()];
    let good = GatewayConfig {
        worker_urls: urls.clone(),
        kv_events_endpoints: vec!["tcp://127.0.0.1:5557".into(), "-".into()],
        kv_events_replay_endpoints: vec!["tcp://127.0.0.1:5558".into(), "-".into()],
        ..GatewayConfig::default()
    };
    good.validate().unwrap();
    assert_eq!(
        good.kv_events_source(0).unwrap().unwrap().ranks[0].replay.as_deref(),
        Some("tcp://127.0.0.1:5558")
    );
    assert_eq!(good.kv_events_source(1).unwrap(), None);
    let bad = GatewayConfig {
        worker_urls: urls,
        kv_events_endpoints: vec!["tcp://*:5557".into()],
        kv_events_replay_endpoints: vec!["-".into(), "-".into()],
        mock_tokenizer: true,
        tokenizer_path: Some("t.json".into()),
        ..GatewayConfig::default()
    };
    let fields: Vec<_> = bad.validate().unwrap_err().iter().map(|e| e.field.clone()).collect();
    assert_eq!(
        fields,
        ["kv_events_endpoints", "kv_events_replay_endpoints", "kv_events_endpoints", "mock_tokenizer"]
    );
    let yaml = "worker_urls: [http://127.0.0.1:1]\nkv_events_endpoints: [tcp://127.0.0.1:5557]\n\
                tokenizer_path: /models/m\nrouting:\n  prefix_index: exact\n";
    let file = GatewayConfig::with_file(yaml, &GatewayConfig::default(), &[]).unwrap();
    file.validate().unwrap();
    assert_eq!(file.kv_events_source(0).unwrap().unwrap().ranks[0].events, "tcp://127.0.0.1:5557");
    assert_eq!(file.routing.prefix_index, kvgate_policy::PrefixIndexMode::Exact);
    assert_eq!(file.tokenizer_path.as_deref(), Some(std::path::Path::new("/models/m")));
}

#[test]
fn the_traces_endpoint_is_an_otlp_http_url() {
    let with =
        |url: &str| GatewayConfig { otlp_traces_endpoint: Some(url.into()), ..GatewayConfig::default() };
    assert!(with("http://127.0.0.1:4318/v1/traces").validate().is_ok());
    assert!(with("https://collector.example:4318/v1/traces").validate().is_ok());
    for wrong in ["localhost:4317", "grpc://127.0.0.1:4317", "not a url", ""] {
        let errors = with(wrong).validate().unwrap_err();
        let fields: Vec<_> = errors.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(fields, ["otlp_traces_endpoint"], "{wrong:?}");
        assert!(errors.to_string().contains("OTLP/HTTP URL"), "{errors}");
    }
}
