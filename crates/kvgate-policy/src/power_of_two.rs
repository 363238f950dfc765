//! `power_of_two`: sample two distinct candidates at random and take the less loaded one.
//!
//! Load is the larger of this gateway's in-flight count and the engine's own running + waiting
//! count from a fresh load sample (which also sees other gateways' traffic); ties go to the lower
//! KV usage, then to either at random.

use rand::Rng;

use crate::inflight::fresh_load;
use crate::{Candidate, Candidates, Decision, NoRoute, Policy, Reason, RouteRequest, SelectContext};

#[derive(Debug, Default)]
pub struct PowerOfTwoPolicy;

fn load_of(candidate: &Candidate, ctx: &SelectContext<'_>) -> (u64, f64) {
    match fresh_load(candidate, ctx.now_ms, ctx.load_poll_interval_ms) {
        Some(load) => {
            (candidate.in_flight.max(load.num_running_reqs + load.num_waiting_reqs), load.token_usage)
        }
        None => (candidate.in_flight, 0.0),
    }
}

impl Policy for PowerOfTwoPolicy {
    fn name(&self) -> &'static str {
        "power_of_two"
    }

    fn needs_loads(&self) -> bool {
        true
    }

    fn decide(
        &self,
        _request: &RouteRequest<'_>,
        candidates: Candidates<'_>,
        ctx: &mut SelectContext<'_>,
    ) -> Result<Decision, NoRoute> {
        let n = candidates.len();
        let worker = match n {
            1 => candidates[0].id,
            _ => {
                let first = ctx.rng.random_range(0..n);
                let second = (first + ctx.rng.random_range(1..n)) % n;
                let (a, b) = (load_of(&candidates[first], ctx), load_of(&candidates[second], ctx));
                let pick = match a.partial_cmp(&b) {
                    Some(std::cmp::Ordering::Less) => first,
                    Some(std::cmp::Ordering::Greater) => second,
                    _ if ctx.rng.random_bool(0.5) => first,
                    _ => second,
                };
                candidates[pick].id
            }
        };
        Ok(Decision::plain(worker, Reason::PowerOfTwo))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{candidates, ctx_rng};
    use crate::LoadSample;

    #[test]
    fn never_picks_the_busier_of_two_and_prefers_the_idle_engine() {
        let pool = candidates(&[50, 0]);
        let mut rng = ctx_rng(3);
        let mut ctx =
            SelectContext { now_ms: 0, load_poll_interval_ms: 1000, rng: &mut rng, prefix_index: None };
        for _ in 0..50 {
            assert_eq!(
                PowerOfTwoPolicy
                    .decide(&RouteRequest::EMPTY, Candidates::new(&pool).unwrap(), &mut ctx)
                    .unwrap()
                    .worker,
                1
            );
        }
    }

    #[test]
    fn the_engines_own_queue_counts_when_fresh() {
        // This gateway sent nothing to worker 0, but its engine is busy with other traffic.
        let mut pool = candidates(&[0, 3]);
        pool[0].load = Some(LoadSample { num_running_reqs: 40, fetched_at_ms: 900, ..LoadSample::default() });
        pool[1].load = Some(LoadSample { num_running_reqs: 3, fetched_at_ms: 900, ..LoadSample::default() });
        let mut rng = ctx_rng(4);
        let mut ctx =
            SelectContext { now_ms: 1000, load_poll_interval_ms: 1000, rng: &mut rng, prefix_index: None };
        assert_eq!(
            PowerOfTwoPolicy
                .decide(&RouteRequest::EMPTY, Candidates::new(&pool).unwrap(), &mut ctx)
                .unwrap()
                .worker,
            1
        );
        // A stale sample is ignored: in-flight counts decide.
        let mut ctx =
            SelectContext { now_ms: 10_000, load_poll_interval_ms: 1000, rng: &mut rng, prefix_index: None };
        assert_eq!(
            PowerOfTwoPolicy
                .decide(&RouteRequest::EMPTY, Candidates::new(&pool).unwrap(), &mut ctx)
                .unwrap()
                .worker,
            0
        );
    }

    #[test]
    fn spreads_over_equal_workers() {
        let pool = candidates(&[0, 0, 0, 0]);
        let mut rng = ctx_rng(5);
        let mut ctx =
            SelectContext { now_ms: 0, load_poll_interval_ms: 1000, rng: &mut rng, prefix_index: None };
        let mut seen = [0; 4];
        for _ in 0..400 {
            seen[PowerOfTwoPolicy
                .decide(&RouteRequest::EMPTY, Candidates::new(&pool).unwrap(), &mut ctx)
                .unwrap()
                .worker as usize] += 1;
        }
        assert!(seen.iter().all(|&n| n > 50), "{seen:?}");
    }
}
