//! The Grafana dashboard (`deploy/grafana/kvgate.json`) matches the metrics: every PromQL query
//! in it (panel targets and template variables) names only series that a live gateway exports
//! on `/metrics`, after requests that touch them (kv_aware on `kvgate mock` engines publishing
//! KV events and injected 500s, a model whose workers answer 503 for retries, a concurrency
//! limit for admission refusals).

use crate::common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{client, eventually, gateway, kv_events_config, metrics_text};
use futures_util::StreamExt;
use kvgate_mock::{spawn_fleet, MockArgs};
use serde_json::{json, Value};

const DASHBOARD: &str = include_str!("../../deploy/grafana/kvgate.json");

/// Every query of the dashboard: panel targets' `expr`, and template variables' `query`.
fn queries(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, child) in map {
                match (key.as_str(), child) {
                    ("expr" | "definition", Value::String(query)) => out.push(query.clone()),
                    _ => queries(child, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|item| queries(item, out)),
        _ => {}
    }
}

/// Skips from `chars[i]` (an opening `open`) past its matching `close`.
fn skip_group(chars: &[char], mut i: usize, open: char, close: char) -> usize {
    let mut depth = 0;
    while i < chars.len() {
        match chars[i] {
            '"' => {
                i += 1;
                while i < chars.len() && chars[i] != '"' {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
            }
            c if c == open => depth += 1,
            c if c == close => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    i
}

/// The series a PromQL expression selects: identifiers that are not functions (followed by
/// `(`), keywords, grouping labels (`by (...)`), label matchers (`{...}`), ranges (`[...]`),
/// numbers or strings. `label_values(metric, label)` names its first argument.
fn series_names(expr: &str) -> Vec<String> {
    if let Some(args) = expr.trim().strip_prefix("label_values(") {
        let metric = args.split([',', ')', '{']).next().unwrap_or("").trim();
        return vec![metric.to_string()];
    }
    // Binary and modifier keywords, and the aggregation operators (their `by` clause may come
    // before the parenthesis: `sum by (le) (...)`).
    const KEYWORDS: [&str; 19] = [
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "group_left",
        "group_right",
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
    ];
    let chars: Vec<char> = expr.chars().collect();
    let mut names = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '{' {
            i = skip_group(&chars, i, '{', '}');
        } else if c == '[' {
            i = skip_group(&chars, i, '[', ']');
        } else if c == '"' {
            i = skip_group(&chars, i, '"', '"');
        } else if c.is_ascii_digit() || c == '.' {
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
            {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let mut next = i;
            while next < chars.len() && chars[next].is_whitespace() {
                next += 1;
            }
            let call = chars.get(next) == Some(&'(');
            if matches!(word.as_str(), "by" | "without" | "on" | "ignoring") && call {
                i = skip_group(&chars, next, '(', ')');
            } else if !call && !KEYWORDS.contains(&word.as_str()) {
                names.push(word);
            }
        } else {
            i += 1;
        }
    }
    names
}

#[test]
fn the_query_reader_finds_series_and_nothing_else() {
    assert_eq!(
        series_names(
            r#"histogram_quantile(0.99, sum by (le) (rate(kvgate_request_ttfb_seconds_bucket{model=~"$model"}[$__rate_interval])))"#
        ),
        ["kvgate_request_ttfb_seconds_bucket"]
    );
    assert_eq!(
        series_names("count(kvgate_worker_circuit_state != 0) or vector(0)"),
        ["kvgate_worker_circuit_state"]
    );
    assert_eq!(series_names("sum(a) / on (x) group_left b"), ["a", "b"]);
    assert_eq!(
        series_names("label_values(kvgate_routing_decisions_total, model)"),
        ["kvgate_routing_decisions_total"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_names_a_series_the_gateway_exports() {
    let dashboard: Value = serde_json::from_str(DASHBOARD).expect("the dashboard is JSON");
    let mut all = Vec::new();
    queries(&dashboard, &mut all);
    assert!(all.len() >= 20, "the dashboard's queries: {all:?}");

    let mut args = MockArgs { count: 2, time_scale: 50.0, fail_rate: 0.2, ..MockArgs::default() };
    args.kv_events_base_port = Some(0);
    args.kv_events_replay_base_port = Some(0);
    let mock = spawn_fleet(args).await.expect("the mock fleet starts");
    let mut cfg = kv_events_config(&mock);
    cfg.routing.policy = kvgate_policy::PolicyKind::KvAware;
    cfg.load_monitor_interval_ms = 100;
    cfg.max_concurrent_requests = Some(4);
    let gw = gateway(cfg).await;
    let ready = eventually(10.0, async || {
        common::workers(&gw).await.iter().all(|w| common::healthy(w) && common::kv_events_flowing(w))
    })
    .await;
    assert!(ready, "the engines are healthy and their events flow");
    // A second model on two workers answering 503: its requests are retried.
    let flaky = [common::upstream("flaky-a", "flaky").await, common::upstream("flaky-b", "flaky").await];
    for upstream in &flaky {
        upstream.status.store(503, std::sync::atomic::Ordering::SeqCst);
        let body = json!({"url": upstream.url, "model_id": "flaky", "policy": "round_robin"});
        let res = client().post(format!("{}/workers", gw.admin_url())).json(&body).send().await.unwrap();
        assert_eq!(res.status(), 201);
    }
    let res =
        client().post(format!("{}/v1/chat/completions", gw.url())).json(&common::chat("flaky")).send().await;
    assert_eq!(res.unwrap().status(), 503, "both tried");
    // 40 requests, 8 at a time past a limit of 4: answers, retries of injected 500s, refusals.
    let url = gw.url();
    let statuses: Vec<u16> = futures_util::stream::iter(0..40)
        .map(|n| {
            let url = url.clone();
            async move {
                let body = json!({"model": "mock-model", "max_tokens": 4, "messages": [
                    {"role": "system", "content": "a shared system prompt of a few words"},
                    {"role": "user", "content": format!("question {} of the run", n % 5)}]});
                let res = client()
                    .post(format!("{url}/v1/chat/completions"))
                    .json(&body)
                    .timeout(Duration::from_secs(20))
                    .send()
                    .await
                    .unwrap();
                let status = res.status().as_u16();
                res.bytes().await.unwrap();
                status
            }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    assert!(statuses.contains(&200), "{statuses:?}");

    let exported = async || -> BTreeSet<String> {
        let text = metrics_text(&gw).await;
        kvgate_protocol::exposition::samples(&text).map(|sample| sample.name.to_string()).collect()
    };
    let mut missing = Vec::new();
    let mut names = BTreeSet::new();
    let complete = eventually(10.0, async || {
        let series = exported().await;
        missing.clear();
        names.clear();
        for query in &all {
            let named = series_names(query);
            if named.is_empty() {
                missing.push(format!("{query}: names no series"));
            }
            for name in named {
                if !series.contains(&name) {
                    missing.push(format!("{name} (in {query})"));
                }
                names.insert(name);
            }
        }
        missing.is_empty()
    })
    .await;
    assert!(complete, "dashboard queries naming series /metrics does not export:\n{}", missing.join("\n"));
    assert!(names.len() >= 20, "{names:?}");
    gw.shutdown().await;
}
