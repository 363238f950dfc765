//! The shapes: chat sessions (the background of `hot-docs`, all of `bursts`, the interactive
//! tenants of `tenants-flood`), hot shared documents asked in bursts, a stream of distinct long
//! documents asked again later, a tenant flooding questions on long documents, and a fixed set
//! of conversations carried on by a few clients.

use rand::rngs::StdRng;
use rand::Rng;

use super::context::{documents, exponential, log_uniform, mean, uniform, whole_blocks, Blocks, Context};
use super::GenArgs;
use crate::trace::TraceRequest;

/// Chat sessions: each picks one of the shared system prompts, then asks
/// `1..=session_max_turns` questions `think_secs` apart (exponential), each turn's prompt the
/// previous one plus its answer and the new user message. Written as a session: each later turn
/// is sent its think time after the previous answer.
struct Sessions {
    system_prompts: Vec<Context>,
}

impl Sessions {
    fn new(args: &GenArgs, blocks: &mut Blocks) -> Sessions {
        let system_prompts = (0..args.system_prompts)
            .map(|_| Context::fresh(whole_blocks(args.system_prompt_tokens), blocks))
            .collect();
        Sessions { system_prompts }
    }

    /// Prompt tokens of a session, on average: turn i's prompt is the system prompt, i user
    /// messages and i - 1 answers, for i in 1..=n, n uniform in 1..=session_max_turns.
    fn prompt_tokens(args: &GenArgs) -> f64 {
        let max = f64::from(args.session_max_turns);
        let n = (1.0 + max) / 2.0;
        let n2 = (1.0 + max) * (2.0 * max + 1.0) / 6.0;
        let (system, user) = (
            f64::from(whole_blocks(args.system_prompt_tokens)),
            mean(args.user_min_tokens, args.user_max_tokens),
        );
        let answer = mean(args.output_min_tokens, args.output_max_tokens);
        // sum_i (S + i U + (i - 1) A) = n S + U n(n+1)/2 + A n(n-1)/2, averaged over n.
        n * system + user * (n2 + n) / 2.0 + answer * (n2 - n) / 2.0
    }

    /// One session starting at `start_s`; turns after `end_s` are dropped.
    fn session(
        &self,
        args: &GenArgs,
        rng: &mut StdRng,
        blocks: &mut Blocks,
        start_s: f64,
        end_s: f64,
        out: &mut Vec<TraceRequest>,
    ) {
        let system = &self.system_prompts[rng.random_range(0..self.system_prompts.len())];
        let turns = uniform(rng, 1, args.session_max_turns);
        let session = blocks.session();
        let mut context = system.then_fresh(uniform(rng, args.user_min_tokens, args.user_max_tokens), blocks);
        let mut at_s = start_s;
        let mut answer = 0;
        let mut think_s = None;
        for turn in 0..turns {
            if turn > 0 {
                let think = exponential(rng, args.think_secs);
                at_s += think;
                think_s = Some(think);
                context.extend(answer + uniform(rng, args.user_min_tokens, args.user_max_tokens), blocks);
            }
            if at_s > end_s {
                return;
            }
            answer = uniform(rng, args.output_min_tokens, args.output_max_tokens);
            out.push(context.session_request(at_s, answer, &session, think_s));
        }
    }

    /// Sessions starting as a Poisson process whose load (prompt tokens over the capacity) is
    /// `load_at(t)`, piecewise constant, from 0 to `args.duration_secs`.
    fn poisson(
        &self,
        args: &GenArgs,
        rng: &mut StdRng,
        blocks: &mut Blocks,
        load_at: impl Fn(f64) -> f64,
        out: &mut Vec<TraceRequest>,
    ) {
        let per_session = Self::prompt_tokens(args);
        let rate_at = |t: f64| load_at(t) * args.capacity_tokens_per_sec / per_session;
        // Thinning against the highest rate: exact for a piecewise-constant rate.
        let peak = (0..=1000)
            .map(|i| rate_at(args.duration_secs * f64::from(i) / 1000.0))
            .fold(0.0f64, f64::max)
            .max(f64::MIN_POSITIVE);
        let mut t = 0.0;
        loop {
            t += exponential(rng, 1.0 / peak);
            if t > args.duration_secs {
                return;
            }
            if rng.random_range(0.0..1.0) < rate_at(t) / peak {
                self.session(args, rng, blocks, t, args.duration_secs, out);
            }
        }
    }
}

/// `hot-docs`: `docs` shared documents, each asked in bursts (`burst_questions` on average,
/// within `burst_spread_secs`) every `burst_interval_secs` on average, beside chat sessions at
/// `load`.
pub(super) fn hot_docs(args: &GenArgs, rng: &mut StdRng) -> Vec<TraceRequest> {
    let mut blocks = Blocks::default();
    let mut out = Vec::new();
    let docs = documents(args.docs, (args.doc_min_tokens, args.doc_max_tokens), rng, &mut blocks);
    for doc in &docs {
        let mut t = exponential(rng, args.burst_interval_secs);
        while t <= args.duration_secs {
            for _ in 0..uniform(rng, 1, 2 * args.burst_questions - 1) {
                let at_s = t + rng.random_range(0.0..=args.burst_spread_secs);
                let question = doc.then_fresh(uniform(rng, 50, args.question_max_tokens), &mut blocks);
                let output = uniform(rng, args.output_min_tokens, args.output_max_tokens);
                out.push(question.request(at_s * 1000.0, output));
            }
            t += exponential(rng, args.burst_interval_secs);
        }
    }
    let sessions = Sessions::new(args, &mut blocks);
    sessions.poisson(args, rng, &mut blocks, |_| args.load, &mut out);
    out
}

/// `bursts`: chat sessions whose load is `low_load` for `low_secs`, then `high_load` for
/// `high_secs`, and so on.
pub(super) fn bursts(args: &GenArgs, rng: &mut StdRng) -> Vec<TraceRequest> {
    let mut blocks = Blocks::default();
    let mut out = Vec::new();
    let period = args.low_secs + args.high_secs;
    let sessions = Sessions::new(args, &mut blocks);
    let load_at = |t: f64| if t % period < args.low_secs { args.low_load } else { args.high_load };
    sessions.poisson(args, rng, &mut blocks, load_at, &mut out);
    out
}

/// `conversations`: `conversations` chats of `session_max_turns` turns, each its own system
/// prompt (`system_prompt_tokens`, not rounded to whole blocks: nothing shares it), dealt to
/// `clients` clients (conversation i to client i mod `clients`). A client is one closed-loop
/// session: it sends turn 1 of each of its conversations, then turn 2 of each, and so on, each
/// request `think_secs` (exponential) after the previous answer, from time 0.
pub(super) fn conversations(args: &GenArgs, rng: &mut StdRng) -> Vec<TraceRequest> {
    let mut blocks = Blocks::default();
    let mut out = Vec::new();
    let clients = args.clients.max(1);
    // Each chat: its client, its context so far, and the length of its last answer.
    let mut chats: Vec<(u32, Context, u32)> = (0..args.conversations)
        .map(|i| {
            let first = args.system_prompt_tokens + uniform(rng, args.user_min_tokens, args.user_max_tokens);
            (i % clients, Context::fresh(first, &mut blocks), 0)
        })
        .collect();
    for client in 0..clients {
        let session = format!("client-{}", client + 1);
        let mut at_s = 0.0;
        let mut think_s = None;
        for turn in 0..args.session_max_turns {
            for (_, context, answer) in chats.iter_mut().filter(|(owner, _, _)| *owner == client) {
                if turn > 0 {
                    let question = uniform(rng, args.user_min_tokens, args.user_max_tokens);
                    context.extend(*answer + question, &mut blocks);
                }
                *answer = uniform(rng, args.output_min_tokens, args.output_max_tokens);
                out.push(context.session_request(at_s, *answer, &session, think_s));
                let think = exponential(rng, args.think_secs);
                at_s += think;
                think_s = Some(think);
            }
        }
    }
    out
}

/// `long-prompts`: distinct documents (log-uniform lengths), each followed by a question, asked
/// at `load` (prompt tokens of every ask, first and again); a document is asked again `reasks`
/// times on average (geometric), `reask_secs` apart on average.
pub(super) fn long_prompts(args: &GenArgs, rng: &mut StdRng) -> Vec<TraceRequest> {
    let mut blocks = Blocks::default();
    let mut out = Vec::new();
    let (low, high) =
        (f64::from(args.doc_min_tokens), f64::from(args.doc_max_tokens.max(args.doc_min_tokens)));
    let mean_doc = if high > low { (high - low) / (high / low).ln() } else { low };
    let per_doc = (mean_doc + mean(50, args.question_max_tokens)) * (1.0 + args.reasks);
    let rate = args.load * args.capacity_tokens_per_sec / per_doc;
    let again = args.reasks / (1.0 + args.reasks);
    let mut t = exponential(rng, 1.0 / rate);
    while t <= args.duration_secs {
        let doc = Context::fresh(
            whole_blocks(log_uniform(rng, args.doc_min_tokens, args.doc_max_tokens)),
            &mut blocks,
        );
        let mut at_s = t;
        loop {
            let question = doc.then_fresh(uniform(rng, 50, args.question_max_tokens), &mut blocks);
            let output = uniform(rng, args.output_min_tokens, args.output_max_tokens);
            out.push(question.request(at_s * 1000.0, output));
            at_s += exponential(rng, args.reask_secs);
            if at_s > args.duration_secs || rng.random_range(0.0..1.0) >= again {
                break;
            }
        }
        t += exponential(rng, 1.0 / rate);
    }
    out
}

/// `tenants-flood`: `interactive_tenants` tenants, each running chat sessions (its own system
/// prompts) at `load / interactive_tenants`, and the tenant `flood` asking questions on one of
/// `docs` long documents (drawn uniformly) as a Poisson stream at `flood_factor` times the
/// interactive tenants' total request rate.
pub(super) fn tenants_flood(args: &GenArgs, rng: &mut StdRng) -> Vec<TraceRequest> {
    let mut blocks = Blocks::default();
    let mut out = Vec::new();
    let tenants = args.interactive_tenants.max(1);
    let per_tenant = args.load / tenants as f64;
    for tenant in 1..=tenants {
        let from = out.len();
        let sessions = Sessions::new(args, &mut blocks);
        sessions.poisson(args, rng, &mut blocks, |_| per_tenant, &mut out);
        for request in &mut out[from..] {
            request.tenant = Some(format!("interactive-{tenant}"));
        }
    }
    let interactive_rate = out.len() as f64 / args.duration_secs;
    let rate = args.flood_factor * interactive_rate;
    if rate <= 0.0 {
        return out;
    }
    let docs = documents(args.docs, (args.doc_min_tokens, args.doc_max_tokens), rng, &mut blocks);
    let mut t = exponential(rng, 1.0 / rate);
    while t <= args.duration_secs {
        let doc = &docs[rng.random_range(0..docs.len())];
        let question = doc.then_fresh(uniform(rng, 50, args.question_max_tokens), &mut blocks);
        let output = uniform(rng, args.output_min_tokens, args.output_max_tokens);
        let mut request = question.request(t * 1000.0, output);
        request.tenant = Some("flood".to_string());
        out.push(request);
        t += exponential(rng, 1.0 / rate);
    }
    out
}
