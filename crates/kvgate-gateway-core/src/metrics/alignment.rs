//! The alignment probe's and the index repair's metric families, registered with the gateway's
//! other metrics: what each probe of a worker concluded, the cause it named, and what the
//! gateway did about an index found wrong (by the probe or the closed loop).

use prometheus::{IntCounterVec, IntGaugeVec, Opts, Registry};

#[derive(Clone)]
pub struct AlignmentMetrics {
    /// Probes by model, worker and result (`passed`, `failed`, `inconclusive`).
    pub probes: IntCounterVec,
    /// Failed probes by model, worker and the cause they named.
    pub failures: IntCounterVec,
    /// 1 while the worker's last conclusive probe passed, 0 after a failed one.
    pub aligned: IntGaugeVec,
    /// 1 while the worker is quarantined (its pool routed on the approximate tree).
    pub quarantined: IntGaugeVec,
    /// Repairs by model, what found the index wrong (`probe`, `closed_loop`), its cause and the
    /// action taken (`resync`, `quarantine`, `warn`, and `release` when a quarantine ends).
    pub repairs: IntCounterVec,
}

impl AlignmentMetrics {
    pub fn register(registry: &Registry) -> Self {
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let family = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry.register(Box::new(family.clone())).expect("unique metric");
            family
        };
        let gauge = |name: &str, help: &str, labels: &[&str]| {
            let family = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry.register(Box::new(family.clone())).expect("unique metric");
            family
        };
        Self {
            probes: counter(
                "kvgate_alignment_probes_total",
                "Alignment probes of a worker (a canary prompt sent twice, as a completion and a chat, \
                 its second answer's cached tokens against the index's prediction), by result: passed, \
                 failed, inconclusive (blocks evicted meanwhile, or the worker did not answer).",
                &["model", "worker", "result"],
            ),
            failures: counter(
                "kvgate_alignment_failures_total",
                "Failed alignment probes by the cause they named: events_not_flowing, block_size, hash, \
                 tokenizer, template_or_content_format, last_token_rule, stale_index, \
                 no_cached_tokens_reported, no_prefix_caching, unexplained.",
                &["model", "worker", "cause"],
            ),
            aligned: gauge(
                "kvgate_alignment_aligned",
                "1 while the worker's last conclusive alignment probe passed, 0 after a failed one.",
                &["model", "worker"],
            ),
            quarantined: gauge(
                "kvgate_index_quarantined",
                "1 while the worker is quarantined (--index-repair quarantine: its pool routes on the \
                 approximate tree until a probe of it passes), else 0.",
                &["model", "worker"],
            ),
            repairs: counter(
                "kvgate_index_repairs_total",
                "Actions on a worker's index found wrong, by what found it (probe, closed_loop), the cause \
                 named and the action (resync, quarantine, warn; release when a quarantine ends).",
                &["model", "source", "cause", "action"],
            ),
        }
    }
}
