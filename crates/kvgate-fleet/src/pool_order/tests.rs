//! A pool's order holds its healthy workers with their requests in flight, and the samples the
//! book tells it of; a worker moved to another order leaves the first.

use std::sync::Arc;
use std::time::Duration;

use kvgate_policy::{Candidate, LoadSample};

use super::*;
use crate::worker::CircuitSettings;
use crate::worker::Worker;
use kvgate_gateway_core::metrics::Metrics;

fn worker(id: WorkerId) -> Worker {
    let circuit = CircuitSettings { enabled: false, failure_threshold: 1, open_duration: Duration::ZERO };
    let url = format!("http://127.0.0.1:{}", id + 1);
    let series = Metrics::new().worker_series(&url);
    Worker::new(id, url, Some("m".into()), true, circuit, series, None)
}

#[test]
fn an_attached_worker_moves_with_its_requests_health_and_samples() {
    let book = OrderBook::default();
    let (first, second) = (Arc::new(PoolOrder::default()), Arc::new(PoolOrder::default()));
    let a = worker(1);
    a.begin_request();
    book.attach(&a, &first);
    let get = |order: &PoolOrder| order.with(|order| order.get(1).copied());
    assert_eq!(get(&first), Some(Candidate { id: 1, in_flight: 1, load: None }));
    a.begin_request();
    a.end_request();
    a.begin_request();
    let sample = LoadSample { token_usage: 0.5, fetched_at_ms: 7, ..LoadSample::default() };
    book.set_loads([(1, Some(sample)), (2, Some(sample))]);
    assert_eq!(get(&first), Some(Candidate { id: 1, in_flight: 2, load: Some(sample) }));
    assert_eq!(first.with(|order| order.len()), 1, "a worker not attached is not added");
    a.record_health(false, 1, 1);
    assert_eq!(get(&first), None, "unhealthy: out");
    a.record_health(true, 1, 1);
    assert_eq!(get(&first), Some(Candidate { id: 1, in_flight: 2, load: None }), "back without a sample");
    book.attach(&a, &second);
    assert_eq!((get(&first), get(&second).map(|c| c.in_flight)), (None, Some(2)));
    book.detach(&a);
    a.end_request();
    assert_eq!((get(&second), a.order().is_none(), book.is_empty()), (None, true, true));
}
