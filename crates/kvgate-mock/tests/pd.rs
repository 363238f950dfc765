//! Prefill/decode disaggregation over loopback HTTP: SGLang pairs (the same body to both engines), vLLM's two steps, the decode's 502s, and faults on PD engines.

mod common;

use std::future::Future;
use std::time::{Duration, Instant};

use common::{spawn, sse_payloads, words, Harness};
use kvgate_mock::{MockArgs, WorkerRole, SOAK_ID_HEADER};
use serde_json::{json, Value};

/// Every wait in these tests gives up after this long.
const WAIT: Duration = Duration::from_secs(5);

async fn bounded<T>(future: impl Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, future).await.expect("answered in time")
}

/// A prefill and a decode fleet of one engine each, ten times faster than real time.
async fn pd_pair(configure: impl Fn(&mut MockArgs)) -> (Harness, Harness) {
    let prefill = spawn(|args| {
        args.time_scale = 10.0;
        args.role = WorkerRole::Prefill;
        configure(args);
    })
    .await;
    let decode = spawn(|args| {
        args.time_scale = 10.0;
        args.role = WorkerRole::Decode;
        configure(args);
    })
    .await;
    assert_eq!(prefill.fleet.role(), WorkerRole::Prefill);
    assert_eq!(prefill.fleet.bootstrap_ports().len(), 1);
    assert!(decode.fleet.bootstrap_ports().is_empty());
    (prefill, decode)
}

/// A generation body for `path` with an exact output length.
fn body(path: &str, prompt: &str, max_tokens: u32, stream: bool) -> Value {
    match path {
        "/v1/chat/completions" => json!({"messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "ignore_eos": true, "stream": stream,
            "stream_options": {"include_usage": true}}),
        "/v1/completions" => json!({"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true,
            "stream": stream, "stream_options": {"include_usage": true}}),
        _ => json!({"text": prompt, "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": true},
            "stream": stream}),
    }
}

fn with_sglang_room(mut body: Value, bootstrap_port: u16, room: u64) -> Value {
    body["bootstrap_host"] = json!("127.0.0.1");
    body["bootstrap_port"] = json!(bootstrap_port);
    body["bootstrap_room"] = json!(room);
    body
}

/// (prompt tokens, completion tokens) of a whole answer or of a stream's `data:` payloads.
async fn token_counts(response: reqwest::Response, stream: bool) -> (u64, u64) {
    assert_eq!(response.status(), 200);
    let last = if stream {
        let payloads = sse_payloads(&bounded(response.text()).await.unwrap());
        assert_eq!(payloads.last().map(String::as_str), Some("[DONE]"));
        serde_json::from_str::<Value>(&payloads[payloads.len() - 2]).unwrap()
    } else {
        bounded(response.json::<Value>()).await.unwrap()
    };
    let counts = if last["usage"].is_object() { &last["usage"] } else { &last["meta_info"] };
    (counts["prompt_tokens"].as_u64().unwrap(), counts["completion_tokens"].as_u64().unwrap())
}

/// Waits until `engine`'s handler has started on the request with soak id `id`.
async fn wait_received(engine: &Harness, id: &str) {
    let started = Instant::now();
    while engine.fleet.soak_ids().get(id).map_or(0, |seen| seen.received) == 0 {
        assert!(started.elapsed() < WAIT, "{id} never reached the engine");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn token_usage(harness: &Harness) -> f64 {
    bounded(harness.loads()).await["token_usage"].as_f64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_pair_answers_on_every_endpoint_streamed_and_whole() {
    let (prefill, decode) = pd_pair(|_| {}).await;
    let port = prefill.fleet.bootstrap_ports()[0];
    let prompt = words(0, 600);
    let mut room = 1u64 << 63;
    for path in ["/v1/completions", "/v1/chat/completions", "/generate"] {
        for stream in [false, true] {
            room += 1;
            let body = with_sglang_room(body(path, &prompt, 8, stream), port, room);
            let (prefilled, decoded) =
                bounded(async { tokio::join!(prefill.post(path, &body), decode.post(path, &body)) }).await;
            let (prompt_tokens, completion_tokens) = token_counts(prefilled, stream).await;
            assert_eq!(completion_tokens, 1, "{path} stream={stream}: the prefill generates one token");
            let decoded = token_counts(decoded, stream).await;
            assert_eq!(decoded, (prompt_tokens, 8), "{path} stream={stream}");
        }
    }
    // Every held KV was pulled and released.
    assert_eq!(token_usage(&prefill).await, 0.0);
    // The room as a string of digits, and a decode that comes before its prefill.
    let body = body("/v1/completions", &prompt, 4, false);
    let mut pd_body = with_sglang_room(body.clone(), port, 0);
    pd_body["bootstrap_room"] = json!("18446744073709551615");
    let early = tokio::spawn({
        let (client, url, pd_body) = (decode.client.clone(), decode.url.clone(), pd_body.clone());
        let request = client.post(format!("{url}/v1/completions")).header(SOAK_ID_HEADER, "early");
        async move { request.json(&pd_body).send().await }
    });
    wait_received(&decode, "early").await;
    token_counts(bounded(prefill.post("/v1/completions", &pd_body)).await, false).await;
    let decoded = bounded(early).await.unwrap().unwrap();
    assert_eq!(token_counts(decoded, false).await.1, 4);
    // Without PD fields both engines serve regular requests.
    assert_eq!(token_counts(bounded(prefill.post("/v1/completions", &body)).await, false).await.1, 4);
    assert_eq!(token_counts(bounded(decode.post("/v1/completions", &body)).await, false).await.1, 4);
    prefill.fleet.shutdown().await;
    decode.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_holds_the_kv_until_the_decode_pulls_it() {
    let (prefill, decode) = pd_pair(|_| {}).await;
    let body = with_sglang_room(
        body("/v1/completions", &words(0, 1_000), 4, false),
        prefill.fleet.bootstrap_ports()[0],
        7,
    );
    token_counts(bounded(prefill.post("/v1/completions", &body)).await, false).await;
    // ceil(1,001 / 16) = 63 blocks held with nothing running.
    let held = bounded(prefill.loads()).await;
    assert_eq!(
        (held["num_running_reqs"].as_u64(), held["num_used_tokens"].as_u64()),
        (Some(0), Some(63 * 16))
    );
    assert!(held["token_usage"].as_f64().unwrap() > 0.0);
    let decoded = bounded(decode.post("/v1/completions", &body)).await;
    assert_eq!(token_counts(decoded, false).await.1, 4);
    assert_eq!(token_usage(&prefill).await, 0.0);
    prefill.fleet.shutdown().await;
    decode.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_two_steps_pass_the_prefills_kv_transfer_params() {
    let (prefill, decode) = pd_pair(|_| {}).await;
    let path = "/v1/chat/completions";
    let original = body(path, &words(0, 300), 6, true);
    let mut step_one = original.clone();
    step_one["max_tokens"] = json!(1);
    step_one["stream"] = json!(false);
    step_one["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false,
        "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
    let answer: Value = bounded(prefill.post_json(path, &step_one)).await;
    let params = answer["kv_transfer_params"].clone();
    let prompt_tokens = answer["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(answer["usage"]["completion_tokens"], 1);
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["do_remote_decode"], false);
    assert_eq!(params["remote_host"], "127.0.0.1");
    assert_eq!(params["remote_port"], prefill.fleet.bootstrap_ports()[0]);
    assert_eq!(params["tp_size"], 1);
    assert!(params["remote_engine_id"].is_string() && params["remote_request_id"].is_string(), "{params}");
    let blocks = params["remote_block_ids"].as_array().unwrap();
    assert_eq!(blocks.len() as u64, (prompt_tokens + 1).div_ceil(16));
    assert!(token_usage(&prefill).await > 0.0);

    let mut step_two = original;
    step_two["kv_transfer_params"] = params;
    let decoded = bounded(decode.post(path, &step_two)).await;
    assert_eq!(token_counts(decoded, true).await, (prompt_tokens, 6));
    assert_eq!(token_usage(&prefill).await, 0.0);
    // The KV went to one decode: pulling it again fails at once.
    let again = bounded(decode.post(path, &step_two)).await;
    assert_eq!(again.status(), 502);
    // Each step on the wrong engine is refused.
    assert_eq!(bounded(decode.post(path, &step_one)).await.status(), 400);
    assert_eq!(bounded(prefill.post(path, &step_two)).await.status(), 400);
    prefill.fleet.shutdown().await;
    decode.fleet.shutdown().await;
}

/// `usage.prompt_tokens_details.cached_tokens` of a whole OpenAI answer.
async fn cached_tokens(response: reqwest::Response) -> u64 {
    assert_eq!(response.status(), 200);
    let answer: Value = bounded(response.json()).await.unwrap();
    answer["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("a cached count")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_reports_what_its_prefill_found_cached_not_the_kv_it_received() {
    // The decode engine holds the prompt (served in place first); its KV then arrives by
    // transfer from a prefill engine that computed it all, then from one that had it cached.
    // The answer's cached count is the prefill engine's both times (0, then the prompt's full
    // blocks), never the decode engine's own match: it computed no prompt, so its cache saved
    // nothing, and a PD fleet's hit rate measured at the client must be the prefill side's.
    let (prefill, decode) = pd_pair(|_| {}).await;
    let port = prefill.fleet.bootstrap_ports()[0];
    let path = "/v1/completions";
    let plain = body(path, &words(0, 1_000), 4, false);
    assert_eq!(cached_tokens(bounded(decode.post(path, &plain)).await).await, 0);
    assert!(cached_tokens(bounded(decode.post(path, &plain)).await).await > 900, "in place: its own hit");
    for room in [1u64, 2] {
        let pd_body = with_sglang_room(plain.clone(), port, room);
        let (prefilled, decoded) =
            bounded(async { tokio::join!(prefill.post(path, &pd_body), decode.post(path, &pd_body)) }).await;
        let prefill_cached = cached_tokens(prefilled).await;
        let decode_cached = cached_tokens(decoded).await;
        assert_eq!(decode_cached, prefill_cached, "room {room}");
        if room == 1 {
            assert_eq!(prefill_cached, 0, "the prefill engine's first sight of the prompt");
        } else {
            assert!(prefill_cached > 900, "the prefill engine's own hit: {prefill_cached}");
        }
    }
    // vLLM's two steps carry it the same way.
    let mut step_one = plain.clone();
    step_one["max_tokens"] = json!(1);
    step_one["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false});
    let answer: Value = bounded(prefill.post_json(path, &step_one)).await;
    let prefill_cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    let mut step_two = plain;
    step_two["kv_transfer_params"] = answer["kv_transfer_params"].clone();
    assert_eq!(cached_tokens(bounded(decode.post(path, &step_two)).await).await, prefill_cached);
    prefill.fleet.shutdown().await;
    decode.fleet.shutdown().await;
}

/// Asserts a 502 with an OpenAI-style JSON error, and returns its message.
async fn kv_transfer_error(response: reqwest::Response) -> String {
    assert_eq!(response.status(), 502);
    let error: Value = bounded(response.json()).await.unwrap();
    assert_eq!(error["error"]["type"], "kv_transfer_error", "{error}");
    assert_eq!(error["error"]["code"], 502);
    error["error"]["message"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_answers_502_when_the_kv_never_comes() {
    // A hold timeout of 3 s of model time: 300 ms of wall time.
    let (prefill, decode) = pd_pair(|args| args.kv_hold_timeout_secs = 3.0).await;
    let port = prefill.fleet.bootstrap_ports()[0];
    let started = Instant::now();
    let body = with_sglang_room(body("/v1/completions", "a b c", 4, true), port, 99);
    let message = kv_transfer_error(bounded(decode.post("/v1/completions", &body)).await).await;
    assert!(message.contains("unknown"), "{message}");
    assert!(started.elapsed() >= Duration::from_millis(300));
    // Nobody listens on the port of a dropped listener: refused at once.
    let closed_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let body = with_sglang_room(body.clone(), closed_port, 100);
    let started = Instant::now();
    kv_transfer_error(bounded(decode.post("/v1/completions", &body)).await).await;
    assert!(started.elapsed() < Duration::from_millis(300));
    // A prefilled KV nobody pulls expires: the prefill engine frees it after the hold timeout.
    let body = with_sglang_room(body.clone(), port, 101);
    token_counts(bounded(prefill.post("/v1/completions", &body)).await, true).await;
    let held_at = Instant::now();
    assert!(token_usage(&prefill).await > 0.0);
    while token_usage(&prefill).await > 0.0 {
        assert!(held_at.elapsed() < WAIT, "the held KV never expired");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(held_at.elapsed() >= Duration::from_millis(250));
    let message = kv_transfer_error(bounded(decode.post("/v1/completions", &body)).await).await;
    assert!(message.contains("expired"), "{message}");
    prefill.fleet.shutdown().await;
    decode.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_prefill_fails_the_decode_fast() {
    let prefill = spawn(|args| {
        args.role = WorkerRole::Prefill;
        args.fail_rate = 1.0;
    })
    .await;
    let decode = spawn(|args| args.role = WorkerRole::Decode).await;
    let port = prefill.fleet.bootstrap_ports()[0];
    for (room, decode_first) in [(1, false), (2, true)] {
        let body = with_sglang_room(body("/v1/completions", &words(0, 100), 4, false), port, room);
        let started = Instant::now();
        let id = format!("decode-{room}");
        let decoded = tokio::spawn({
            let (client, url, body) = (decode.client.clone(), decode.url.clone(), body.clone());
            let request = client.post(format!("{url}/v1/completions")).header(SOAK_ID_HEADER, &id);
            async move { request.json(&body).send().await }
        });
        if decode_first {
            wait_received(&decode, &id).await;
        }
        let refused = bounded(prefill.post("/v1/completions", &body)).await;
        assert_eq!(refused.status(), 500);
        let message = kv_transfer_error(bounded(decoded).await.unwrap().unwrap()).await;
        assert!(message.contains("500"), "{message}");
        // Far from the 30 s hold timeout.
        assert!(started.elapsed() < Duration::from_secs(2));
        assert_eq!(token_usage(&prefill).await, 0.0);
    }
    prefill.fleet.shutdown().await;
    decode.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_cut_stream_stops_after_some_tokens() {
    let (prefill, decode) =
        pd_pair(|args| args.cut_stream_rate = f64::from(u8::from(args.role == WorkerRole::Decode))).await;
    let body = with_sglang_room(
        body("/v1/completions", &words(0, 100), 8, true),
        prefill.fleet.bootstrap_ports()[0],
        5,
    );
    let (prefilled, mut decoded) = bounded(async {
        tokio::join!(prefill.post("/v1/completions", &body), decode.post("/v1/completions", &body))
    })
    .await;
    assert_eq!(token_counts(prefilled, true).await.1, 1);
    assert_eq!(decoded.status(), 200);
    let mut received = Vec::new();
    let cut = loop {
        match bounded(decoded.chunk()).await {
            Ok(Some(bytes)) => received.extend_from_slice(&bytes),
            Ok(None) => break false,
            Err(_) => break true,
        }
    };
    assert!(cut, "the stream completed: {}", String::from_utf8_lossy(&received));
    let text = String::from_utf8_lossy(&received);
    assert!(text.matches("data: ").count() >= 1 && !text.contains("[DONE]"), "{text}");
    prefill.fleet.shutdown().await;
    decode.fleet.shutdown().await;
}
