//! `--dp-aware` (SMG 1.13's flag): each data-parallel rank of an engine is a worker of its own.
//! The gateway reads the engine's `dp_size` from SGLang's `GET /server_info` (as SMG's
//! `workflow/steps/local/discover_dp.rs` does), registers `URL@RANK` per rank, and sends the
//! chosen rank in the body as `data_parallel_rank` (the field of SGLang's `GenerateReqInput` and
//! OpenAI requests, `python/sglang/srt/managers/io_struct.py`; SMG's `worker.rs`
//! `prepare_request`). The mock engines run one engine model per rank (`--dp-size`) and count the
//! requests each rank took (`kvgate_mock_rank_requests` in their `/server_info`).

use serde_json::{json, Value};

use crate::common::{client, config, eventually, gateway, json_answer, mock_fleet};

async fn fleet(count: usize, dp_size: u32) -> kvgate_mock::MockFleet {
    mock_fleet(|args| {
        args.count = count;
        args.dp_size = dp_size;
    })
    .await
}

async fn rank_requests(url: &str) -> Vec<u64> {
    let info = json_answer(client().get(format!("{url}/server_info"))).await;
    info["kvgate_mock_rank_requests"].as_array().unwrap().iter().map(|n| n.as_u64().unwrap()).collect()
}

async fn complete(gateway_url: &str, prompt: &str) -> reqwest::Response {
    client()
        .post(format!("{gateway_url}/v1/completions"))
        .json(&json!({"model": "mock-model", "prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn each_rank_is_a_worker_and_gets_its_rank_in_the_body() {
    let fleet = fleet(2, 2).await;
    let urls = fleet.urls();
    let mut cfg = config(urls.clone());
    cfg.dp_aware = true;
    let gw = gateway(cfg).await;
    let workers = json_answer(client().get(format!("{}/workers", gw.admin_url()))).await;
    let mut names: Vec<&str> =
        workers["workers"].as_array().unwrap().iter().map(|w| w["url"].as_str().unwrap()).collect();
    names.sort();
    let mut expected: Vec<String> =
        urls.iter().flat_map(|url| [format!("{url}@0"), format!("{url}@1")]).collect();
    expected.sort();
    assert_eq!(names, expected, "{workers}");
    assert!(workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .all(|w| w["dp_rank"].is_u64() && w["address"].is_string()));

    // round_robin over four targets: every rank of every engine takes two of eight requests.
    for index in 0..8 {
        let response = complete(&gw.url(), &format!("request number {index}")).await;
        assert_eq!(response.status(), 200);
    }
    for url in &urls {
        assert_eq!(rank_requests(url).await, vec![2, 2], "{url}");
    }
    // Removing `URL@1` leaves rank 0 alone on that engine: every request sent there now lands
    // on rank 0, which only the rank named in the body does (the engine's own choice, without
    // one, would alternate between its ranks).
    let removed = json_answer(client().delete(format!(
        "{}/workers/{}",
        gw.admin_url(),
        urlencode(&format!("{}@1", urls[0]))
    )))
    .await;
    assert_eq!(removed["removed"], format!("{}@1", urls[0]));
    for index in 0..6 {
        assert_eq!(complete(&gw.url(), &format!("after removal {index}")).await.status(), 200);
    }
    // Three targets left, two requests each: the engine with one rank took both on rank 0.
    assert_eq!(rank_requests(&urls[0]).await, vec![4, 2]);
    assert_eq!(rank_requests(&urls[1]).await, vec![4, 4]);

    // Removing an engine by its URL removes every rank registered for it.
    let removed =
        json_answer(client().delete(format!("{}/workers/{}", gw.admin_url(), urlencode(&urls[1])))).await;
    assert_eq!(removed["ranks"].as_array().map(Vec::len), Some(2), "{removed}");
    let workers = json_answer(client().get(format!("{}/workers", gw.admin_url()))).await;
    assert_eq!(workers["workers"].as_array().unwrap().len(), 1, "{workers}");
    gw.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test]
async fn cache_aware_keeps_a_prefix_on_its_rank_and_loads_are_per_rank() {
    let fleet = fleet(1, 4).await;
    let mut cfg = config(fleet.urls());
    cfg.dp_aware = true;
    cfg.routing.policy = kvgate_policy::PolicyKind::CacheAware;
    cfg.routing.balance_token_usage_threshold = 0.9; // the KV terms on: the load monitor polls
    cfg.load_monitor_interval_ms = 50;
    let gw = gateway(cfg).await;
    let prefix = "a long shared system prompt that every turn of this one conversation repeats word for word";
    for turn in 0..6 {
        assert_eq!(complete(&gw.url(), &format!("{prefix} turn {turn}")).await.status(), 200);
    }
    let taken = rank_requests(&fleet.urls()[0]).await;
    assert_eq!(taken.iter().sum::<u64>(), 6);
    assert_eq!(taken.iter().filter(|&&n| n > 0).count(), 1, "one rank holds the prefix: {taken:?}");
    // The load monitor reads each rank's own entry of /v1/loads.
    let loads_url = format!("{}/get_loads", gw.url());
    let per_rank = eventually(5.0, async || {
        let loads = json_answer(client().get(&loads_url)).await;
        loads["loads"].as_array().is_some_and(|entries| entries.len() == 4)
    })
    .await;
    assert!(per_rank, "a load sample per rank");
    gw.shutdown().await;
    fleet.shutdown().await;
}

#[tokio::test]
async fn an_engine_without_server_info_is_refused_with_the_reason() {
    let engine = crate::common::upstream("no-server-info", "m").await;
    let mut cfg = config(Vec::new());
    cfg.dp_aware = true;
    let gw = gateway(cfg).await;
    let response = client()
        .post(format!("{}/workers", gw.admin_url()))
        .json(&json!({"url": engine.url}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 502);
    let body: Value = response.json().await.unwrap();
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("--dp-aware") && message.contains("/server_info"), "{message}");
    gw.shutdown().await;
}

fn urlencode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}
