//! Soak request ids: the `x-soak-id` header values each worker received and answered,
//! summed over the fleet, readable after shutdown.

mod common;

use std::collections::HashMap;

use common::spawn;
use kvgate_mock::{SoakIdSeen, SOAK_ID_HEADER};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_ids_count_received_and_answered_requests_over_the_fleet() {
    let harness = spawn(|args| {
        args.count = 2;
        args.time_scale = 50.0;
    })
    .await;
    let urls = harness.fleet.urls();
    let chat = |stream: bool| json!({"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4, "stream": stream});
    let send = |url: &str, id: Option<&str>, body: Vec<u8>| {
        let mut request = harness
            .client
            .post(format!("{url}/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(body);
        if let Some(id) = id {
            request = request.header(SOAK_ID_HEADER, id);
        }
        request.send()
    };
    let body = |stream: bool| serde_json::to_vec(&chat(stream)).unwrap();
    // "a" reaches both workers (as a retried request would), "b" one of them, streamed.
    for url in &urls {
        let response = send(url, Some("a"), body(false)).await.unwrap();
        assert_eq!(response.status(), 200);
    }
    let response = send(&urls[1], Some("b"), body(true)).await.unwrap();
    assert!(response.text().await.unwrap().contains("[DONE]"));
    // A refused request is received but not answered; one without the header is not counted.
    let response = send(&urls[0], Some("c"), b"{not json".to_vec()).await.unwrap();
    assert_eq!(response.status(), 400);
    assert_eq!(send(&urls[0], None, body(false)).await.unwrap().status(), 200);

    let seen = |received, answered| SoakIdSeen { received, answered, resumed: 0 };
    let expected: HashMap<String, SoakIdSeen> =
        [("a", seen(2, 2)), ("b", seen(1, 1)), ("c", seen(1, 0))].map(|(id, s)| (id.to_string(), s)).into();
    assert_eq!(harness.fleet.soak_ids(), expected);
    let log = harness.fleet.soak_id_log();
    harness.fleet.shutdown().await;
    assert_eq!(log.snapshot(), expected, "the counts outlive the fleet");
}
