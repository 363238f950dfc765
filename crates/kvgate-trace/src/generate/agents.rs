//! The shapes of agents and reasoning models (docs/SCENARIOS.md S9-S11): agents' tool loops on
//! their applications' long tool prompts (closed-loop sessions), RL rollouts (batches of prompts
//! each sampled n times at once, long reasoning outputs), and reasoning answers to questions on
//! popular shared contexts.

use rand::rngs::StdRng;
use rand::Rng;

use super::context::{
    documents, exponential, log_normal, mean, uniform, whole_blocks, Blocks, Context, Popularity,
};
use super::GenArgs;
use crate::trace::TraceRequest;

/// Prompts of distinct contexts drawn by popularity: their mean length in tokens.
fn popular_mean(contexts: &[Context], popularity: &Popularity) -> f64 {
    contexts.iter().zip(popularity.shares()).map(|(context, share)| f64::from(context.tokens) * share).sum()
}

/// `agentic`: `apps` applications, each a tool-definition prompt of
/// `tool_prompt_min_tokens..=tool_prompt_max_tokens` (whole blocks) shared by all its sessions,
/// the k-th most popular starting sessions in proportion to 1 / k^`popularity_skew`. Sessions
/// start as a Poisson process at `load` (prompt tokens over the capacity, as if no call's
/// context reached `context_max_tokens`). A session is a task (a user message of
/// `user_min_tokens..=user_max_tokens` after its application's prompt) worked on in
/// `calls_min..=calls_max` calls: each call's answer is `output_min_tokens..=output_max_tokens`,
/// then the agent runs its tool for `tool_min_secs..=tool_max_secs` and sends the next call: the
/// whole context again, plus that answer and the tool's result
/// (`tool_result_min_tokens..=tool_result_max_tokens`). A session stops before a call whose
/// context would exceed `context_max_tokens`.
pub(super) fn agentic(args: &GenArgs, rng: &mut StdRng) -> Vec<TraceRequest> {
    let mut blocks = Blocks::default();
    let mut out = Vec::new();
    let apps: Vec<Context> = (0..args.apps)
        .map(|_| {
            let tokens = uniform(rng, args.tool_prompt_min_tokens, args.tool_prompt_max_tokens);
            Context::fresh(whole_blocks(tokens), &mut blocks)
        })
        .collect();
    let popularity = Popularity::new(apps.len(), args.popularity_skew);
    // Prompt tokens of a session of n calls: n (P + U) + (A + R) n (n - 1) / 2, averaged over n.
    let (mut calls, mut growth) = (0.0, 0.0);
    for n in args.calls_min..=args.calls_max {
        calls += f64::from(n);
        growth += f64::from(n) * f64::from(n - 1) / 2.0;
    }
    let choices = f64::from(args.calls_max - args.calls_min + 1);
    let per_call = popular_mean(&apps, &popularity) + mean(args.user_min_tokens, args.user_max_tokens);
    let step = mean(args.output_min_tokens, args.output_max_tokens)
        + mean(args.tool_result_min_tokens, args.tool_result_max_tokens);
    let per_session = (calls * per_call + growth * step) / choices;
    let rate = args.load * args.capacity_tokens_per_sec / per_session;
    let mut t = exponential(rng, 1.0 / rate);
    while t <= args.duration_secs {
        let app = &apps[popularity.draw(rng)];
        let session = blocks.session();
        let mut context =
            app.then_fresh(uniform(rng, args.user_min_tokens, args.user_max_tokens), &mut blocks);
        let (mut at_s, mut tool_s) = (t, None);
        for _ in 0..uniform(rng, args.calls_min, args.calls_max) {
            if context.tokens > args.context_max_tokens || at_s > args.duration_secs {
                break;
            }
            let answer = uniform(rng, args.output_min_tokens, args.output_max_tokens);
            out.push(context.session_request(at_s, answer, &session, tool_s));
            let tool = rng.random_range(args.tool_min_secs..=args.tool_max_secs);
            let result = uniform(rng, args.tool_result_min_tokens, args.tool_result_max_tokens);
            context.extend(answer + result, &mut blocks);
            (at_s, tool_s) = (at_s + tool, Some(tool));
        }
        t += exponential(rng, 1.0 / rate);
    }
    out
}

/// `rollouts`: a training step every `step_secs` from 0 to `duration_secs`, each a batch of
/// `batch_prompts` prompts arriving within `batch_spread_secs`: a task family's shared prefix
/// (`families` of them, `family_prefix_min_tokens..=family_prefix_max_tokens`, whole blocks,
/// drawn uniformly) then a problem of `problem_min_tokens..=problem_max_tokens`; every prompt
/// is sampled `samples_min..=samples_max` times at once (the samples share the whole prompt),
/// each sample's output log-normal (`reasoning_median_tokens`, `reasoning_sigma`, cut at
/// `reasoning_max_tokens`). The load is the batch's, not `load`.
pub(super) fn rollouts(args: &GenArgs, rng: &mut StdRng) -> Vec<TraceRequest> {
    let mut blocks = Blocks::default();
    let mut out = Vec::new();
    let families: Vec<Context> = (0..args.families)
        .map(|_| {
            let tokens = uniform(rng, args.family_prefix_min_tokens, args.family_prefix_max_tokens);
            Context::fresh(whole_blocks(tokens), &mut blocks)
        })
        .collect();
    let mut step_s = 0.0;
    while step_s <= args.duration_secs {
        for _ in 0..args.batch_prompts {
            let family = &families[rng.random_range(0..families.len())];
            let problem = uniform(rng, args.problem_min_tokens, args.problem_max_tokens);
            let prompt = family.then_fresh(problem, &mut blocks);
            let at_s = step_s + rng.random_range(0.0..=args.batch_spread_secs);
            for _ in 0..uniform(rng, args.samples_min, args.samples_max) {
                let output = log_normal(
                    rng,
                    args.reasoning_median_tokens,
                    args.reasoning_sigma,
                    args.reasoning_max_tokens,
                );
                out.push(prompt.request(at_s * 1000.0, output));
            }
        }
        step_s += args.step_secs;
    }
    out
}

/// `reasoning`: `docs` shared contexts (`doc_min_tokens..=doc_max_tokens`, whole blocks), the
/// k-th most popular asked in proportion to 1 / k^`popularity_skew`; questions
/// (50..=`question_max_tokens` new tokens after the context) arrive as a Poisson process at
/// `load` (prompt tokens over the capacity), each answered at reasoning length (log-normal:
/// `reasoning_median_tokens`, `reasoning_sigma`, cut at `reasoning_max_tokens`).
pub(super) fn reasoning(args: &GenArgs, rng: &mut StdRng) -> Vec<TraceRequest> {
    let mut blocks = Blocks::default();
    let mut out = Vec::new();
    let docs = documents(args.docs, (args.doc_min_tokens, args.doc_max_tokens), rng, &mut blocks);
    let popularity = Popularity::new(docs.len(), args.popularity_skew);
    let per_question = popular_mean(&docs, &popularity) + mean(50, args.question_max_tokens);
    let rate = args.load * args.capacity_tokens_per_sec / per_question;
    let mut t = exponential(rng, 1.0 / rate);
    while t <= args.duration_secs {
        let doc = &docs[popularity.draw(rng)];
        let question = doc.then_fresh(uniform(rng, 50, args.question_max_tokens), &mut blocks);
        let output =
            log_normal(rng, args.reasoning_median_tokens, args.reasoning_sigma, args.reasoning_max_tokens);
        out.push(question.request(t * 1000.0, output));
        t += exponential(rng, 1.0 / rate);
    }
    out
}
