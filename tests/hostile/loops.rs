//! The gateway's own address under other spellings: `http://127.1:PORT`, `http://2130706433:PORT`
//! and `http://0x7f000001:PORT` were accepted as workers (the check parsed the host as an IP
//! literal; the connector resolves more forms). Now the URL is resolved as the connector resolves
//! it, and a loop registration cannot see (a TCP forwarder in front of the gateway) is refused at
//! request time by the `x-kvgate-via` hop header. Second round (issue 40): the
//! `--prometheus-port` listener was not counted as the gateway's own address.

use serde_json::{json, Value};

use crate::common::{chat, client, config, gateway, workers};

/// Forwards every connection on a free loopback port to `target`.
async fn forwarder(target: std::net::SocketAddr) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_under_any_spelling_is_not_a_worker() {
    let gw = gateway(config(Vec::new())).await;
    let port = gw.addr.port();
    let workers = format!("{}/workers", gw.admin_url());
    for host in [
        "127.1",
        "2130706433",
        "0x7f000001",
        "0177.0.0.1",
        "127.0.0.2",
        "[::ffff:127.0.0.1]",
        "localhost",
        "0",
    ] {
        let url = format!("http://{host}:{port}");
        let res = client().post(&workers).json(&json!({"url": url, "model_id": "m"})).send().await.unwrap();
        let status = res.status();
        let body: Value = res.json().await.unwrap();
        assert_eq!(status, 400, "{url}: {body}");
        assert!(body["error"]["message"].as_str().unwrap().contains("own address"), "{body}");
    }
    // Behind a forwarder the registration cannot tell; the request comes back through it
    // carrying this gateway's id and is refused with 508, once.
    let forwarded = forwarder(gw.addr).await;
    let res = client().post(&workers).json(&json!({"url": forwarded, "model_id": "m"})).send().await.unwrap();
    assert_eq!(res.status(), 201);
    let res =
        client().post(format!("{}/v1/chat/completions", gw.url())).json(&chat("m")).send().await.unwrap();
    assert_eq!(res.status(), 508);
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["error"]["code"], "loop_detected", "{body}");
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_listener_is_the_gateways_own_address_too() {
    let mut cfg = config(Vec::new());
    cfg.prometheus_port = Some(0);
    let gw = gateway(cfg).await;
    let port = gw.metrics_addr.expect("a metrics listener").port();
    for host in ["127.0.0.1", "127.1", "localhost"] {
        let url = format!("http://{host}:{port}");
        let res = client()
            .post(format!("{}/workers", gw.admin_url()))
            .json(&json!({"url": url, "model_id": "m"}))
            .send()
            .await
            .unwrap();
        let status = res.status();
        let body: Value = res.json().await.unwrap();
        assert_eq!(status, 400, "{url}: {body}");
        assert!(body["error"]["message"].as_str().unwrap().contains("own address"), "{body}");
    }
    assert!(workers(&gw).await.is_empty());
    gw.shutdown().await;
}
