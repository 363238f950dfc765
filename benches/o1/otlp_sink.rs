//! The traced targets' collector: an OTLP/HTTP traces sink on 127.0.0.1 that takes every export
//! request, decodes it to count the spans, and answers 200 (discarding them). It runs on a thread
//! and runtime of its own in the bench process, so its CPU is not the gateway's.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use prost::Message;

pub struct Sink {
    /// `http://127.0.0.1:PORT/v1/traces`.
    pub url: String,
    spans: Arc<AtomicU64>,
}

impl Sink {
    pub fn start() -> Self {
        let spans = Arc::new(AtomicU64::new(0));
        let counted = spans.clone();
        let (sender, receiver) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            runtime.block_on(serve(counted, sender));
        });
        let url = receiver.recv().expect("the OTLP sink starts");
        Self { url, spans }
    }

    /// Spans received so far.
    pub fn spans(&self) -> u64 {
        self.spans.load(Ordering::Relaxed)
    }
}

async fn serve(spans: Arc<AtomicU64>, started: std::sync::mpsc::Sender<String>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    started.send(format!("http://{}/v1/traces", listener.local_addr().unwrap())).unwrap();
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let spans = spans.clone();
        tokio::spawn(async move {
            let service =
                hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
                    let spans = spans.clone();
                    async move {
                        let body = request.into_body().collect().await?.to_bytes();
                        if let Ok(export) = ExportTraceServiceRequest::decode(body) {
                            let n: usize = export
                                .resource_spans
                                .iter()
                                .flat_map(|r| &r.scope_spans)
                                .map(|s| s.spans.len())
                                .sum();
                            spans.fetch_add(n as u64, Ordering::Relaxed);
                        }
                        let mut answer = hyper::Response::new(Full::new(Bytes::new()));
                        answer.headers_mut().insert(
                            hyper::header::CONTENT_TYPE,
                            hyper::header::HeaderValue::from_static("application/x-protobuf"),
                        );
                        Ok::<_, hyper::Error>(answer)
                    }
                });
            let io = hyper_util::rt::TokioIo::new(stream);
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
        });
    }
}
