//! A mocked Kubernetes API server on 127.0.0.1 serving just what kube-rs's pod watcher asks:
//! `GET /api/v1/namespaces/{ns}/pods` as a list (with `labelSelector`) and as a watch
//! (`watch=true&resourceVersion=..`: JSON lines of ADDED/MODIFIED/DELETED events from that
//! version on). Tests change pods, break open watches, and make the next watch answer
//! `410 Gone` so that the watcher re-lists.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use serde_json::{json, Value};
use tokio::sync::broadcast;

pub struct KubeApi {
    pub url: String,
    inner: Mutex<Inner>,
    /// List requests answered.
    pub lists: AtomicUsize,
    /// Watch requests answered.
    pub watches: AtomicUsize,
    /// The next watch answers with a 410 Gone error event (its version is too old).
    gone_next_watch: AtomicBool,
    events: broadcast::Sender<Option<(u64, String)>>,
}

#[derive(Default)]
struct Inner {
    version: u64,
    pods: BTreeMap<String, Value>,
    /// Every event with its resource version, for watches that start from an older version.
    history: Vec<(u64, String)>,
}

/// A pod in namespace `ns` with labels, on `127.0.0.1` with its worker on `port` (annotation).
pub fn pod(name: &str, labels: Value, port: u16, ready: bool) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ns", "labels": labels,
                     "annotations": {"kvgate.io/worker-port": port.to_string()}},
        "status": {"podIP": "127.0.0.1", "phase": "Running",
                   "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]}
    })
}

impl KubeApi {
    /// Create or change a pod (ADDED or MODIFIED).
    pub fn put(&self, pod: Value) {
        let name = pod["metadata"]["name"].as_str().unwrap().to_string();
        let mut inner = self.inner.lock().unwrap();
        let kind = if inner.pods.contains_key(&name) { "MODIFIED" } else { "ADDED" };
        self.record(&mut inner, kind, name, Some(pod));
    }

    /// Delete a pod (DELETED).
    pub fn delete(&self, name: &str) {
        let mut inner = self.inner.lock().unwrap();
        self.record(&mut inner, "DELETED", name.to_string(), None);
    }

    /// Delete a pod without telling open watches (as if the event was lost in an outage).
    pub fn delete_silently(&self, name: &str) {
        let mut inner = self.inner.lock().unwrap();
        inner.version += 1;
        inner.pods.remove(name);
    }

    /// End every open watch stream, and answer the next watch with 410 Gone.
    pub fn break_watches(&self) {
        self.gone_next_watch.store(true, Ordering::SeqCst);
        let _ = self.events.send(None);
    }

    fn record(&self, inner: &mut Inner, kind: &str, name: String, pod: Option<Value>) {
        inner.version += 1;
        let version = inner.version;
        let mut object = match pod {
            Some(pod) => pod,
            None => inner.pods.get(&name).cloned().expect("the pod exists"),
        };
        object["metadata"]["resourceVersion"] = json!(version.to_string());
        if kind == "DELETED" {
            inner.pods.remove(&name);
        } else {
            inner.pods.insert(name, object.clone());
        }
        let line = format!("{}\n", json!({"type": kind, "object": object}));
        inner.history.push((version, line.clone()));
        let _ = self.events.send(Some((version, line)));
    }
}

fn matches(pod: &Value, selector: &str) -> bool {
    selector.split(',').filter(|pair| !pair.is_empty()).all(|pair| match pair.split_once('=') {
        Some((key, value)) => pod["metadata"]["labels"][key].as_str() == Some(value),
        None => false,
    })
}

async fn pods(
    State(api): State<Arc<KubeApi>>,
    Path(namespace): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    assert_eq!(namespace, "ns", "the watcher asks for the configured namespace");
    let selector = query.get("labelSelector").cloned().unwrap_or_default();
    if query.get("watch").map(String::as_str) != Some("true") {
        api.lists.fetch_add(1, Ordering::SeqCst);
        let inner = api.inner.lock().unwrap();
        let items: Vec<Value> = inner.pods.values().filter(|pod| matches(pod, &selector)).cloned().collect();
        let list = json!({"apiVersion": "v1", "kind": "PodList",
                          "metadata": {"resourceVersion": inner.version.to_string()}, "items": items});
        return ([("content-type", "application/json")], list.to_string()).into_response();
    }
    api.watches.fetch_add(1, Ordering::SeqCst);
    if api.gone_next_watch.swap(false, Ordering::SeqCst) {
        let gone = json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                          "message": "too old resource version", "reason": "Expired", "code": 410}});
        return ([("content-type", "application/json")], format!("{gone}\n")).into_response();
    }
    let from: u64 = query.get("resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(0);
    let (backlog, receiver) = {
        let inner = api.inner.lock().unwrap();
        let backlog: Vec<(u64, String)> = inner.history.iter().filter(|(v, _)| *v > from).cloned().collect();
        (backlog, api.events.subscribe())
    };
    let keep = move |line: &str| {
        let event: Value = serde_json::from_str(line).unwrap();
        matches(&event["object"], &selector)
    };
    let backlog: Vec<String> = backlog.into_iter().map(|(_, line)| line).filter(|l| keep(l)).collect();
    let live = futures_util::stream::unfold(receiver, |mut receiver| async move {
        match receiver.recv().await {
            Ok(Some(event)) => Some((event, receiver)),
            // A break, or a lagging watch: the stream ends and the watcher re-watches.
            Ok(None) | Err(_) => None,
        }
    });
    use futures_util::StreamExt;
    let stream = futures_util::stream::iter(backlog.into_iter().map(Ok::<_, std::io::Error>)).chain(
        live.filter(move |(version, line)| std::future::ready(*version > from && keep(line)))
            .map(|(_, line)| Ok(line)),
    );
    Response::builder()
        .header("content-type", "application/json")
        .body(Body::from_stream(stream.map(|line| line.map(Bytes::from))))
        .unwrap()
}

/// Start the API server on a free loopback port.
pub async fn start() -> Arc<KubeApi> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let api = Arc::new(KubeApi {
        url,
        inner: Mutex::new(Inner::default()),
        lists: AtomicUsize::new(0),
        watches: AtomicUsize::new(0),
        gone_next_watch: AtomicBool::new(false),
        events: broadcast::channel(1024).0,
    });
    let app = Router::new().route("/api/v1/namespaces/{namespace}/pods", get(pods)).with_state(api.clone());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    api
}

/// A kubeconfig pointing at `api` (namespace `ns`), written to a fresh temporary file.
pub fn kubeconfig(api: &KubeApi, name: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("kvgate-test-{}-{name}.kubeconfig", std::process::id()));
    let yaml = format!(
        "apiVersion: v1\nkind: Config\ncurrent-context: mock\nclusters:\n- name: mock\n  cluster:\n    server: {}\n\
         contexts:\n- name: mock\n  context:\n    cluster: mock\n    user: mock\n    namespace: ns\n\
         users:\n- name: mock\n  user: {{}}\n",
        api.url
    );
    std::fs::write(&path, yaml).unwrap();
    path
}
