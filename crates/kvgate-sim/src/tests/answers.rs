//! The simulator's host tells a predicting policy of each answer as the gateway does: when a
//! request finishes, `Policy::on_answered` with its decision's prediction, the engine's prompt
//! and cached tokens, and the time from its decision to its first token (the gateway's usage tap,
//! `kvgate_observe::accuracy::Learn`, at the end of a stream). kv_aware learns its fixed cost and,
//! until the load reports teach them, its rates from these answers: without them the simulator
//! ran a kv_aware that never learned what the gateway's learns.

use std::sync::{Arc, Mutex};

use kvgate_policy::{
    Answered, Candidates, Decision, NoRoute, Policy, PolicyConfig, PredictedTtft, Reason, RouteRequest,
    SelectContext,
};

use super::{args, shared_prefix_trace};
use crate::sim::simulate_with_policy;

/// Round robin whose decisions carry a prediction numbering them (`queue_s` = the decision's
/// number), recording every answer it is told of.
#[derive(Default)]
struct Answers {
    decisions: Mutex<u64>,
    answers: Mutex<Vec<Answered>>,
}

impl Policy for Answers {
    fn name(&self) -> &'static str {
        "answers"
    }

    fn decide(
        &self,
        _request: &RouteRequest<'_>,
        candidates: Candidates<'_>,
        _ctx: &mut SelectContext<'_>,
    ) -> Result<Decision, NoRoute> {
        let number = *self.decisions.lock().unwrap();
        let worker = candidates[number as usize % candidates.len()].id;
        let predicted = PredictedTtft { queue_s: number as f64, ..PredictedTtft::default() };
        Ok(Decision { predicted: Some(predicted), ..Decision::plain(worker, Reason::KvAware) })
    }

    fn on_routed(&self, _routed: &kvgate_policy::Routed<'_>) {
        *self.decisions.lock().unwrap() += 1;
    }

    fn on_answered(&self, answered: &Answered) {
        self.answers.lock().unwrap().push(*answered);
    }
}

/// 24 requests sharing a prefix on 3 engines, decided by `policy` (round_robin's plan).
fn run_shared_prefix(policy: Arc<Answers>) -> crate::sim::SimOutcome {
    run_shared_prefix_with(policy, None)
}

/// [`run_shared_prefix`] with the gateway's concurrency cap `max_concurrent` (its admission
/// queue holds the rest).
fn run_shared_prefix_with(policy: Arc<Answers>, max_concurrent: Option<usize>) -> crate::sim::SimOutcome {
    let mut args = args("round_robin", 3);
    args.max_concurrent_requests = max_concurrent;
    let trace = shared_prefix_trace(24, 40.0);
    let fleet = args.fleet().unwrap();
    let engines = (0..fleet.n_engines()).map(|engine| args.engine_config_for(engine)).collect();
    let setup = crate::sim_setup(&args, fleet, engines, &trace).unwrap();
    simulate_with_policy(&trace, &setup, &PolicyConfig::default(), policy)
}

#[test]
fn every_answer_is_handed_to_the_policy_that_predicted_it() {
    let policy = Arc::new(Answers::default());
    let outcome = run_shared_prefix(policy.clone());

    let answers = policy.answers.lock().unwrap().clone();
    assert_eq!(outcome.finished.len(), 24);
    assert_eq!(answers.len(), outcome.finished.len(), "one answer per finished request");
    let mut cached = 0;
    for (i, stats) in outcome.finished.iter().enumerate() {
        // The trace arrives in order: its request k is the k-th decision.
        let number = outcome.finished_requests[i] as f64;
        let answer = answers.iter().find(|a| a.predicted.queue_s == number).expect("its answer");
        assert_eq!(answer.worker as usize, outcome.finished_engines[i], "the worker it decided");
        assert_eq!(answer.prompt_tokens, stats.prompt_tokens);
        assert_eq!(answer.cached_tokens, stats.cached_tokens);
        assert_eq!(answer.ttft_s, stats.ttft_us() as f64 / 1e6, "no admission queue: arrival to first token");
        cached += stats.cached_tokens;
    }
    assert!(cached > 0, "the engines served some prompts from cache: {cached}");
}

/// The answer is timed from the decision, as the gateway's (`Answered::ttft_s`): a request held
/// in the gateway's admission queue is decided when it leaves it, and its wait there, which no
/// engine's prediction includes, is no part of what the policy learns.
#[test]
fn an_answer_is_timed_from_its_decision_not_from_its_arrival() {
    let policy = Arc::new(Answers::default());
    let outcome = run_shared_prefix_with(policy.clone(), Some(1));
    let answers = policy.answers.lock().unwrap().clone();
    assert_eq!(answers.len(), 24);
    let mut queued = 0;
    for (i, stats) in outcome.finished.iter().enumerate() {
        let number = outcome.finished_requests[i] as f64;
        let answer = answers.iter().find(|a| a.predicted.queue_s == number).expect("its answer");
        let gateway_wait_us = outcome.ttft_parts[i].gateway_wait_us;
        let from_decision_us = stats.ttft_us() - gateway_wait_us;
        assert_eq!(answer.ttft_s, from_decision_us as f64 / 1e6, "request {number}");
        queued += u64::from(gateway_wait_us > 0);
    }
    assert!(queued > 0, "some requests waited in the admission queue");
}

#[test]
fn the_report_gives_the_predicted_terms_mean_per_decision() {
    let outcome = run_shared_prefix(Arc::new(Answers::default()));
    // Decision k predicted a queue of k seconds: 0..=23, a mean of 11.5 s, which is the total.
    let (metrics, _) = crate::report::Metrics::from_outcome(&outcome, 1.0, 1.0);
    let term =
        |name: &str| metrics.predicted_mean_ms.iter().find(|(term, _)| term == name).map(|&(_, ms)| ms);
    assert_eq!(metrics.predicted_mean_ms.len(), PredictedTtft::TERMS.len());
    assert_eq!((term("queue"), term("total"), term("decode")), (Some(11_500.0), Some(11_500.0), Some(0.0)));
    // A policy that predicts nothing: no terms.
    let (none, _) = crate::report::Metrics::from_outcome(&crate::sim::SimOutcome::default(), 1.0, 1.0);
    assert!(none.predicted_mean_ms.is_empty());
}
