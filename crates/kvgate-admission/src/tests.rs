//! Admission end to end: the queue's order by class and by weight, the class timeouts, and
//! quota refusals.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use super::*;
use kvgate_gateway_core::metrics::Metrics;

fn admission(max_concurrent: usize, queue_size: usize, tenants: &str) -> Arc<Admission> {
    admission_with_bound(max_concurrent, queue_size, tenants, 0)
}

fn admission_with_bound(
    max_concurrent: usize,
    queue_size: usize,
    tenants: &str,
    bound: u64,
) -> Arc<Admission> {
    admission_with_kv(max_concurrent, queue_size, tenants, bound, Arc::default())
}

fn admission_with_kv(
    max_concurrent: usize,
    queue_size: usize,
    tenants: &str,
    bound: u64,
    kv_map: Arc<KvMap>,
) -> Arc<Admission> {
    let limits = Limits {
        max_concurrent: Some(max_concurrent),
        rate_per_sec: None,
        queue_size,
        queue_timeout: Duration::from_secs(600),
        locality_bound: bound,
    };
    let tenants = serde_norway::from_str(tenants).unwrap();
    Arc::new(Admission::new(limits, tenants, Metrics::new().admission.clone(), kv_map))
}

fn ticket(tenant: &str, class: PriorityClass, tokens: u64) -> Ticket<'_> {
    Ticket { tenant, class, tokens, open_ended: false }
}

/// Yields until `n` requests wait in the queue.
async fn until_queued(admission: &Admission, n: usize) {
    for _ in 0..100_000 {
        if admission.queued.load(Ordering::Relaxed) == n {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("{n} requests never queued");
}

/// Queues a request of `tenant`; once admitted it sends its tenant and permit on `admitted`.
fn spawn_waiter(
    admission: &Arc<Admission>,
    tenant: &'static str,
    class: PriorityClass,
    tokens: u64,
    admitted: &mpsc::UnboundedSender<(&'static str, Permit)>,
) {
    let admission = admission.clone();
    let admitted = admitted.clone();
    tokio::spawn(async move {
        let permit = admission.admit(ticket(tenant, class, tokens)).await.expect("admitted");
        let _ = admitted.send((tenant, permit));
    });
}

#[tokio::test]
async fn a_higher_class_overtakes_a_queued_lower_one() {
    let admission = admission(1, 10, "{}");
    let held = admission.admit(ticket("a", PriorityClass::Normal, 1)).await.unwrap();
    let (sender, mut admitted) = mpsc::unbounded_channel();
    spawn_waiter(&admission, "batch", PriorityClass::Low, 1, &sender);
    until_queued(&admission, 1).await;
    spawn_waiter(&admission, "chat", PriorityClass::High, 1, &sender);
    until_queued(&admission, 2).await;
    drop(held);
    let (first, permit) = admitted.recv().await.unwrap();
    assert_eq!(first, "chat");
    assert!(admitted.try_recv().is_err(), "the low request waits while the high one holds the slot");
    drop(permit);
    assert_eq!(admitted.recv().await.unwrap().0, "batch");
}

/// With a slot reserved for `high`, a high request is admitted at once while the low class
/// fills the rest and queues; every queued low request is admitted exactly once as slots free.
#[tokio::test]
async fn a_reserved_slot_admits_a_higher_class_at_once_while_lower_ones_fill_the_rest() {
    let admission = admission(3, 10, "classes: {high: {reserved_concurrency: 1}}");
    let (sender, mut admitted) = mpsc::unbounded_channel();
    let names = ["low-0", "low-1", "low-2", "low-3"];
    for name in names {
        spawn_waiter(&admission, name, PriorityClass::Low, 1, &sender);
    }
    // Two of the three slots go to the low class; the other two low requests wait.
    let mut held = vec![admitted.recv().await.unwrap(), admitted.recv().await.unwrap()];
    until_queued(&admission, 2).await;
    let high =
        tokio::time::timeout(Duration::from_secs(5), admission.admit(ticket("chat", PriorityClass::High, 1)))
            .await
            .expect("the high request takes the reserved slot without waiting")
            .unwrap();
    assert!(admitted.try_recv().is_err(), "the low class never takes the reserved slot");
    // The high request's answer ends: its slot stays reserved (release is synchronous).
    drop(high);
    {
        let state = admission.slots.as_ref().unwrap().lock();
        assert_eq!((state.in_use.in_use(), state.waiting.len()), (2, 2));
    }
    // Low answers end: the waiting low requests take their slots, each exactly once.
    let mut seen: Vec<&str> = held.iter().map(|(name, _)| *name).collect();
    for _ in 0..2 {
        drop(held.remove(0));
        let next = admitted.recv().await.unwrap();
        seen.push(next.0);
        held.push(next);
    }
    seen.sort_unstable();
    assert_eq!(seen, names);
    drop(held);
    let state = admission.slots.as_ref().unwrap().lock();
    assert_eq!((state.in_use.in_use(), state.waiting.len()), (0, 0));
}

#[tokio::test]
async fn contended_tenants_get_tokens_in_proportion_to_their_weights() {
    let admission = admission(1, 1000, "named: {light: {weight: 1}, heavy: {weight: 3}}");
    let held = admission.admit(ticket("x", PriorityClass::Normal, 1)).await.unwrap();
    let (sender, mut admitted) = mpsc::unbounded_channel();
    // The light tenant floods first with ten times the requests.
    for _ in 0..400 {
        spawn_waiter(&admission, "light", PriorityClass::Normal, 100, &sender);
    }
    until_queued(&admission, 400).await;
    for _ in 0..40 {
        spawn_waiter(&admission, "heavy", PriorityClass::Normal, 100, &sender);
    }
    until_queued(&admission, 440).await;
    drop(held);
    let mut served = [0usize; 2];
    for _ in 0..40 {
        let (tenant, permit) = admitted.recv().await.unwrap();
        served[usize::from(tenant == "heavy")] += 1;
        drop(permit);
    }
    let heavy_share = served[1] as f64 / 40.0;
    assert!(
        (heavy_share - 0.75).abs() <= 0.075,
        "heavy got {heavy_share} of the slots, weight 3 of 4: {served:?}"
    );
}

#[tokio::test]
async fn each_class_waits_at_most_its_own_queue_timeout() {
    let admission =
        admission(1, 10, "classes: {high: {queue_timeout_secs: 0.2}, low: {queue_timeout_secs: 600}}");
    let _held = admission.admit(ticket("a", PriorityClass::Normal, 1)).await.unwrap();
    let low = {
        let admission = admission.clone();
        tokio::spawn(async move { admission.admit(ticket("b", PriorityClass::Low, 1)).await.map(|_| ()) })
    };
    until_queued(&admission, 1).await;
    let high = admission.admit(ticket("c", PriorityClass::High, 1)).await;
    assert!(matches!(high, Err(ApiError::QueueTimeout(secs)) if secs == 0.2), "{:?}", high.map(|_| ()));
    assert!(!low.is_finished(), "the low class waits up to its own 600 s");
    low.abort();
    let _ = low.await;
    // Every waiter left the queue.
    assert!(admission.slots.as_ref().unwrap().lock().waiting.is_empty());
}

#[tokio::test]
async fn a_waiter_that_gives_up_leaves_no_slot_behind() {
    let admission = admission(1, 10, "{}");
    let held = admission.admit(ticket("a", PriorityClass::Normal, 1)).await.unwrap();
    let waiting = {
        let admission = admission.clone();
        tokio::spawn(async move { admission.admit(ticket("b", PriorityClass::Normal, 1)).await.map(|_| ()) })
    };
    until_queued(&admission, 1).await;
    waiting.abort();
    let _ = waiting.await;
    drop(held);
    // The slot is free again: two in a row get it at once.
    drop(admission.admit(ticket("c", PriorityClass::Normal, 1)).await.unwrap());
    let _again = admission.admit(ticket("d", PriorityClass::Normal, 1)).await.unwrap();
    assert_eq!(admission.slots.as_ref().unwrap().lock().in_use.in_use(), 1);
}

#[tokio::test]
async fn over_quota_is_refused_before_queueing_and_refused_requests_are_refunded() {
    let admission = admission(1, 0, "defaults: {requests_per_minute: 2}");
    let held = admission.admit(ticket("t", PriorityClass::Normal, 1)).await.unwrap();
    // No room and no queue: 429 for concurrency, and the tenant's request is given back.
    assert!(matches!(
        admission.admit(ticket("t", PriorityClass::Normal, 1)).await,
        Err(ApiError::TooManyRequests(1))
    ));
    drop(held);
    let _second = admission.admit(ticket("t", PriorityClass::Normal, 1)).await.unwrap();
    match admission.admit(ticket("t", PriorityClass::Normal, 1)).await {
        Err(ApiError::OverQuota { tenant, over }) => {
            assert_eq!(
                (tenant.as_str(), over.quota),
                ("t", kvgate_gateway_core::tenant::Quota::RequestsPerMinute)
            );
            assert!(over.retry_after.is_some());
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
}

/// Two waiters of `cold` (score 0) and `warm` (score 500) and a slot held by a request scored by
/// `first_score`; returns the order in which they are admitted once it frees.
async fn freed_slot_order(admission: Arc<Admission>, first_score: impl FnOnce() -> u64) -> [&'static str; 2] {
    let held =
        admission.admit_scored(ticket("first", PriorityClass::Normal, 100), first_score).await.unwrap();
    let (sender, mut admitted) = mpsc::unbounded_channel();
    for (n, (tenant, score)) in [("cold", 0), ("warm", 500)].into_iter().enumerate() {
        let (waiting, sender) = (admission.clone(), sender.clone());
        tokio::spawn(async move {
            let permit = waiting
                .admit_scored(ticket(tenant, PriorityClass::Normal, 100), || score)
                .await
                .expect("admitted");
            let _ = sender.send((tenant, permit));
        });
        until_queued(&admission, n + 1).await;
    }
    drop(held);
    let (first, permit) = admitted.recv().await.unwrap();
    drop(permit);
    let (second, _permit) = admitted.recv().await.unwrap();
    [first, second]
}

/// A tenant over its `max_kv_share` of the fleet's KV loses its locality priority: its waiter
/// is served in fair order, so another tenant's goes first; under its share it keeps it.
#[tokio::test]
async fn a_tenant_over_its_kv_share_loses_its_locality_priority_first() {
    let tenants = "named: {warm: {max_kv_share: 0.3}, cold: {}}";
    for (share, expected) in [(0.2, ["warm", "cold"]), (0.5, ["cold", "warm"])] {
        let kv_map = Arc::new(KvMap::default());
        kv_map.set_shares([("warm".to_string(), share, share > 0.3)]);
        let order = freed_slot_order(admission_with_kv(1, 10, tenants, 1000, kv_map), || 0).await;
        assert_eq!(order, expected, "warm holding {share} of the fleet's KV");
    }
}

/// With a locality bound the freed slot goes to the waiter with the most predicted cached tokens
/// among those within the bound; without one, to the fair order's first. The score is asked
/// only of a request that has to wait.
#[tokio::test]
async fn within_the_locality_bound_the_cached_waiter_goes_first() {
    for (bound, expected) in [(0, ["cold", "warm"]), (1000, ["warm", "cold"])] {
        let scored = Arc::new(AtomicUsize::new(0));
        let counted = scored.clone();
        let order = freed_slot_order(admission_with_bound(1, 10, "{}", bound), move || {
            counted.fetch_add(1, Ordering::Relaxed);
            0
        })
        .await;
        assert_eq!(scored.load(Ordering::Relaxed), 0, "a request admitted at once is not scored");
        assert_eq!(order, expected, "bound {bound}");
    }
}

#[tokio::test]
async fn each_admitted_request_counts_on_its_tenants_series_and_the_unnamed_as_other() {
    let metrics = Metrics::new().admission.clone();
    let limits = Limits {
        max_concurrent: None,
        rate_per_sec: None,
        queue_size: 0,
        queue_timeout: Duration::from_secs(1),
        locality_bound: 0,
    };
    let tenants = serde_norway::from_str("named: {acme: {}}").unwrap();
    let admission = Admission::new(limits, tenants, metrics.clone(), Arc::default());
    for (tenant, class) in [
        ("acme", PriorityClass::High),
        ("acme", PriorityClass::High),
        ("acme", PriorityClass::Low),
        ("stranger", PriorityClass::Normal),
        ("default", PriorityClass::Normal),
    ] {
        admission.admit(ticket(tenant, class, 10)).await.unwrap();
    }
    let requests =
        |tenant: &str, class: &str| metrics.tenant_requests.with_label_values(&[tenant, class]).get();
    let tokens = |tenant: &str, class: &str| metrics.tenant_tokens.with_label_values(&[tenant, class]).get();
    let waits = |tenant: &str, class: &str| {
        metrics.tenant_queue_wait.with_label_values(&[tenant, class]).get_sample_count()
    };
    assert_eq!(
        [
            requests("acme", "high"),
            requests("acme", "low"),
            requests("other", "normal"),
            requests("default", "normal")
        ],
        [2, 1, 1, 1]
    );
    assert_eq!((tokens("acme", "high"), waits("acme", "high"), waits("other", "normal")), (20, 2, 1));
    assert_eq!(requests("stranger", "normal"), 0, "an unnamed tenant gets no series of its own");
    assert_eq!((&*admission.tenant_label("acme"), &*admission.tenant_label("stranger")), ("acme", "other"));
}
