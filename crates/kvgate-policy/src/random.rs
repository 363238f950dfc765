//! `random`: each request goes to a uniformly random candidate (drawn from the injected RNG).

use rand::Rng;

use crate::{Candidates, Decision, NoRoute, Policy, Reason, RouteRequest, SelectContext};

#[derive(Debug, Default)]
pub struct RandomPolicy;

impl Policy for RandomPolicy {
    fn name(&self) -> &'static str {
        "random"
    }

    fn decide(
        &self,
        _request: &RouteRequest<'_>,
        candidates: Candidates<'_>,
        ctx: &mut SelectContext<'_>,
    ) -> Result<Decision, NoRoute> {
        let idx = ctx.rng.random_range(0..candidates.len());
        Ok(Decision::plain(candidates[idx].id, Reason::Random))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{candidates, ctx_rng};

    #[test]
    fn covers_every_candidate_and_is_seeded() {
        let pool = candidates(&[0, 0, 0, 0]);
        let run = |seed| {
            let mut rng = ctx_rng(seed);
            let mut ctx =
                SelectContext { now_ms: 0, load_poll_interval_ms: 1000, rng: &mut rng, prefix_index: None };
            (0..200)
                .map(|_| {
                    RandomPolicy
                        .decide(&RouteRequest::EMPTY, Candidates::new(&pool).unwrap(), &mut ctx)
                        .unwrap()
                        .worker
                })
                .collect::<Vec<_>>()
        };
        let picks = run(7);
        for id in 0..4 {
            assert!(picks.contains(&id), "worker {id} never picked");
        }
        assert_eq!(picks, run(7), "same seed, same picks");
    }
}
