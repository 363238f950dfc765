//! Routing an arrival as the gateway does: the one routing plan (`kvgate_route`) on the fleet's
//! pools (a regular pool, or the prefill and decode pools with the run's conditional rule), live
//! with the run's RNG and the run's overload bounds, then sent at once: each side's policy
//! records its decision (`on_routed`), its pool counts the request in flight, and the outcome
//! counts the decisions. The admission queue's locality score is the same plan as a dry run.

use kvgate_policy::{Decision, IndexKind, PdChoice, PdRule, Reason, RouteRequest, RoutingKey};
use kvgate_route::{PlanContext, Planning, Pools, Side};
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::pool::SimPool;
use super::Simulation;

/// The plan's pools: the regular pool, or the prefill and decode pools with `rule`.
fn pools_of(pools: &[SimPool], rule: Option<PdRule>) -> Pools<'_, SimPool> {
    match pools {
        [prefill, decode] => Pools::Pair { prefill, decode, rule },
        _ => Pools::Single(&pools[0]),
    }
}

/// The pool (index into `Simulation::pools`) of a plan's side.
fn pool_index(side: Side) -> usize {
    match side {
        Side::Regular | Side::Prefill => 0,
        Side::Decode => 1,
    }
}

/// What a live plan sent: the worker (pool-local) on each pool it used, and a disaggregated
/// plan's verdict.
pub(super) struct Sent {
    /// By pool index: the regular or prefill pool's worker, then the decode pool's.
    pub workers: [Option<usize>; 2],
    pub pd: Option<PdChoice>,
}

impl Simulation<'_> {
    /// Plans request `id` live and sends it: each side's policy records its decision, its pool
    /// counts the request in flight (its prompt too, on the exact index, where the pick's request
    /// carries it), the outcome counts the decisions. `None`: no plan (the request is unrouted).
    pub(super) fn plan_sent(
        &mut self,
        now: u64,
        id: u64,
        prompt: &[u32],
        prompt_tokens: u32,
    ) -> Option<Sent> {
        let setup = self.setup;
        let rule = self.pd.as_ref().and_then(|pd| pd.rule);
        let request = RouteRequest {
            key: RoutingKey::Tokens(prompt),
            prompt_tokens: u64::from(prompt_tokens),
            session: Some(&self.session),
        };
        let mut ctx = PlanContext {
            now_ms: now / 1000,
            load_poll_interval_ms: setup.load_monitor_interval_ms,
            overload: setup.overload,
            planning: Planning::Live,
            rng: &mut self.rng,
        };
        let pools = pools_of(&self.pools, rule);
        let plan = pools.plan(&request, &[], None, &mut ctx).ok()?;
        plan.on_routed(&pools);
        let picks: Vec<(usize, Decision, bool)> = plan
            .picks()
            .map(|(side, pick)| {
                (pool_index(side), pick.decision, matches!(pick.request.key, RoutingKey::Tokens(_)))
            })
            .collect();
        let mut sent = Sent { workers: [None; 2], pd: plan.pd().copied() };
        drop(plan);
        for (pool, decision, with_prompt) in picks {
            let worker = decision.worker as usize;
            self.pools[pool].routed(worker, id, if with_prompt { prompt } else { &[] });
            if let Some(predicted) = decision.predicted {
                self.pools[pool].predicted(id, predicted);
            }
            self.count_decision(pool, id, &decision);
            sent.workers[pool] = Some(worker);
        }
        if let (Some(paths), Some(outcome)) =
            (sent.pd.and_then(|pd| pd.inputs.predicted), self.outcome.pd.as_mut())
        {
            outcome.predicted.add(&paths);
        }
        Some(sent)
    }

    /// The prompt tokens the plan predicts cached where it would route request `id` now (the
    /// admission queue's locality score): a dry run, as the gateway's, that records nothing, its
    /// random draws from an RNG of its own so the run's draws stay as without it.
    pub(super) fn predicted_cached(&self, now: u64, id: u64, prompt: &[u32], prompt_tokens: u32) -> u64 {
        let request = RouteRequest {
            key: RoutingKey::Tokens(prompt),
            prompt_tokens: u64::from(prompt_tokens),
            session: Some(&self.session),
        };
        let mut rng = StdRng::seed_from_u64(id);
        let mut ctx = PlanContext {
            now_ms: now / 1000,
            load_poll_interval_ms: self.setup.load_monitor_interval_ms,
            overload: self.setup.overload,
            planning: Planning::DryRun,
            rng: &mut rng,
        };
        Pools::Single(&self.pools[0])
            .plan(&request, &[], None, &mut ctx)
            .map_or(0, |plan| plan.predicted_cached_tokens(request.prompt_tokens))
    }

    /// Counts a decision of pool `pool`: the run's policy (pool 0) in the outcome, the decode
    /// side's in `pd`.
    fn count_decision(&mut self, pool: usize, id: u64, decision: &Decision) {
        let reason_index = Reason::ALL.iter().position(|&r| r == decision.reason).unwrap_or(0);
        if pool > 0 {
            if let Some(pd) = &mut self.outcome.pd {
                pd.decode_decisions[reason_index] += 1;
            }
            return;
        }
        self.outcome.decisions[reason_index] += 1;
        if let Some(slot) =
            self.order.get(id as usize).and_then(|&i| self.outcome.reason_by_request.get_mut(i))
        {
            *slot = reason_index as u8;
        }
        if let Some(kind) = decision.index {
            self.outcome.index_decisions[IndexKind::ALL.iter().position(|&k| k == kind).unwrap_or(0)] += 1;
        }
        if let Some(predicted) = decision.predicted {
            for (sum, term) in self.outcome.predicted_sums.iter_mut().zip(predicted.terms()) {
                *sum += term;
            }
            self.outcome.predicted_decisions += 1;
        }
        if let Some(matches) = decision.matches {
            self.outcome.chosen_match_sum += matches.chosen_match_rate;
            self.outcome.best_match_sum += matches.best_match_rate;
            self.outcome.match_decisions += 1;
        }
    }
}
