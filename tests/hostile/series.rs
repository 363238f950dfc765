//! Removed workers' metric series: the health loop set gauges for its old snapshot after the
//! worker's series were removed (834 stale series after 10,000 add/delete), and
//! `kvgate_requests_total` by worker was never dropped. Now every series labelled by a worker
//! is made through its handle, which removal closes: 1,000 add/remove cycles, with health rounds
//! and load polls in flight and requests served by each worker, leave no series behind.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use kvgate_policy::PolicyKind;
use serde_json::json;

use crate::common::{chat, client, config, eventually, gateway, metrics_text, upstream};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_workers_series_go_with_it_whatever_loop_is_in_flight() {
    let steady = upstream("steady", "m").await;
    let mut churned = Vec::new();
    for i in 0..8 {
        let worker = upstream(&format!("churned{i}"), "m").await;
        worker.health_delay_ms.store(5, Ordering::SeqCst); // a health round is often in flight
        worker.loads_body.lock().unwrap().clear(); // its load polls fail: a failure series
        churned.push(worker);
    }
    let mut cfg = config(vec![steady.url.clone()]);
    cfg.health_check_interval_secs = 0.02;
    cfg.routing.policy = PolicyKind::LeastLoad; // the load monitor polls
    cfg.load_monitor_interval_ms = 20;
    cfg.routing_key_override = true; // each request names its worker
    let gw = gateway(cfg).await;
    let (admin, url) = (gw.admin_url(), gw.url());
    let tasks: Vec<_> = churned
        .iter()
        .map(|worker| {
            let (admin, url, worker) = (admin.clone(), url.clone(), Arc::clone(worker));
            tokio::spawn(async move {
                let encoded: String = worker.url.bytes().map(|c| format!("%{c:02X}")).collect();
                for cycle in 0..125 {
                    let body = json!({"url": worker.url, "model_id": "m"});
                    let res = client().post(format!("{admin}/workers")).json(&body).send().await.unwrap();
                    assert_eq!(res.status(), 201);
                    if cycle % 5 == 0 {
                        let res = client()
                            .post(format!("{url}/v1/chat/completions"))
                            .header("x-kvgate-target-worker", &worker.url)
                            .json(&chat("m"))
                            .send()
                            .await
                            .unwrap();
                        assert_eq!(res.status(), 200);
                        res.bytes().await.unwrap();
                    }
                    let res = client().delete(format!("{admin}/workers/{encoded}")).send().await.unwrap();
                    assert_eq!(res.status(), 200);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    assert!(churned.iter().all(|worker| worker.requests.load(Ordering::SeqCst) == 25));
    // Health rounds and polls that were in flight at a removal have ended by now.
    let mut text = String::new();
    let clean = eventually(5.0, async || {
        text = metrics_text(&gw).await;
        churned.iter().all(|worker| !text.contains(&worker.url))
    })
    .await;
    let stale: Vec<&str> =
        text.lines().filter(|line| churned.iter().any(|worker| line.contains(&worker.url))).collect();
    assert!(clean, "{} series of removed workers remain, e.g. {:?}", stale.len(), stale.first());
    assert!(
        text.contains(&format!("kvgate_worker_healthy{{worker=\"{}\"}} 1", steady.url)),
        "the steady one stays"
    );
    gw.shutdown().await;
}
