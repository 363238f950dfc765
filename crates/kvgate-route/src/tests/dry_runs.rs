//! Deciding is not recording, above the shortlist's size: any number of dry runs (the previews a
//! kv_aware pair weighs its paths with) between live plans changes no live decision, on pools of
//! more than 256 workers where a dry run's shortlist draws at random. The same seed, the same
//! requests, with and without dry runs interleaved: the live plans are identical.

use proptest::prelude::*;

use super::*;
use crate::pick::preview;
use crate::Side;

/// Workers per side: above the shortlist's size (256).
const WORKERS: usize = 300;

/// One request: which prompt, and its length in tokens.
#[derive(Clone, Debug)]
struct Ask {
    prompt: u8,
    tokens: u64,
}

#[derive(Clone, Debug)]
struct Step {
    live: Ask,
    dry: Vec<(Ask, bool)>,
}

fn an_ask() -> impl Strategy<Value = Ask> {
    (0u8..6, 0u64..40_000).prop_map(|(prompt, tokens)| Ask { prompt, tokens })
}

fn step() -> impl Strategy<Value = Step> {
    (an_ask(), proptest::collection::vec((an_ask(), any::<bool>()), 0..4))
        .prop_map(|(live, dry)| Step { live, dry })
}

fn prompt_text(prompt: u8) -> String {
    format!(
        "<system>be brief</system> {} question {prompt}",
        "lorem ".repeat(usize::from(prompt / 2) * 20 + 10)
    )
}

/// A side of `WORKERS` kv_aware workers from `first`, with mixed fresh loads (and a kept load
/// order when `keep_order`).
fn side(first: WorkerId, keep_order: bool) -> FixedPool {
    let config = PolicyConfig { policy: PolicyKind::KvAware, ..PolicyConfig::default() };
    let in_flight: Vec<u64> = (0..WORKERS).map(|i| (i * 7 % 5) as u64).collect();
    let loads: Vec<(u64, u64)> = (0..WORKERS).map(|i| ((i * 3 % 4) as u64, (i % 6) as u64)).collect();
    let mut side = with_loads(fixed_pool_with(&config, first, &in_flight), &loads);
    if keep_order {
        side.keep_order();
    }
    side
}

/// The live plans of `steps` on a fresh kv_aware pair under the conditional rule, each sent,
/// with each step's dry runs (on the decode side or the prefill side) made first when
/// `dry_runs`, all on the one RNG; the candidates found by one pass over the offer, or on each
/// side's kept load order (`keep_order`).
fn live_plans(steps: &[Step], dry_runs: bool, keep_order: bool) -> Vec<String> {
    let (prefill, decode) = (side(0, keep_order), side(1_000, keep_order));
    let rule = PolicyConfig { pd_conditional: true, ..PolicyConfig::default() }.pd_rule();
    let pair = Pools::Pair { prefill: &prefill, decode: &decode, rule };
    let prompts: Vec<String> = (0..6).map(prompt_text).collect();
    let mut rng = SmallRng::seed_from_u64(11);
    let mut plans = Vec::new();
    for step in steps {
        if dry_runs {
            for (ask, on_decode) in &step.dry {
                let request = request(&prompts[usize::from(ask.prompt)], ask.tokens);
                let ctx = context(&mut rng, OFF, Planning::Live);
                let (pool, side) =
                    if *on_decode { (&decode, Side::Decode) } else { (&prefill, Side::Prefill) };
                preview(pool, side, &request, &[], &ctx).expect("a dry decision");
            }
        }
        let request = request(&prompts[usize::from(step.live.prompt)], step.live.tokens);
        let plan = pair.plan(&request, &[], None, &mut context(&mut rng, OFF, Planning::Live));
        plans.push(describe(&plan));
        plan.expect("a plan").on_routed(&pair);
    }
    plans
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn dry_runs_on_a_large_pair_change_no_live_plan(steps in proptest::collection::vec(step(), 1..12)) {
        for keep_order in [false, true] {
            prop_assert_eq!(live_plans(&steps, false, keep_order), live_plans(&steps, true, keep_order));
        }
    }
}
