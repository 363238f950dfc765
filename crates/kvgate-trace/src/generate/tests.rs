//! The generators: deterministic per seed, read back by the trace parser, and each shape's
//! defining property (documents shared by their questions, the two phases' loads, the stream's
//! load and re-asks).

use super::*;
use crate::trace::TraceRequest;

fn args(shape: Shape, extra: &[(&str, &str)]) -> GenArgs {
    #[derive(clap::Parser)]
    struct Command {
        #[command(flatten)]
        args: GenArgs,
    }
    let shape = clap::ValueEnum::to_possible_value(&shape).unwrap().get_name().to_string();
    let mut argv = vec!["gen".to_string(), "--shape".to_string(), shape];
    for (flag, value) in extra {
        argv.push(format!("--{flag}"));
        argv.push(value.to_string());
    }
    <Command as clap::Parser>::parse_from(argv).args
}

/// Prompt tokens arriving in `[from_s, to_s)`.
fn prompt_tokens(trace: &Trace, from_s: f64, to_s: f64) -> f64 {
    let at = |r: &&TraceRequest| (from_s..to_s).contains(&(r.timestamp_ms / 1000.0));
    trace.requests.iter().filter(at).map(|r| f64::from(r.input_length)).sum()
}

#[test]
fn the_same_seed_gives_the_same_trace_and_it_parses_back() {
    let shapes = [
        Shape::HotDocs,
        Shape::Bursts,
        Shape::LongPrompts,
        Shape::TenantsFlood,
        Shape::Agentic,
        Shape::Rollouts,
        Shape::Reasoning,
        Shape::Conversations,
    ];
    for shape in shapes {
        // Agents' sessions and reasoning contexts are long: more of them, so that seeds differ.
        let load = match shape {
            Shape::Agentic => "20",
            Shape::Reasoning => "3",
            _ => "0.3",
        };
        let small = [("duration-secs", "120"), ("capacity-tokens-per-sec", "8000"), ("load", load)];
        let a = generate(&args(shape, &small)).unwrap();
        let b = generate(&args(shape, &small)).unwrap();
        let other = generate(&args(shape, &[small[0], small[1], small[2], ("seed", "1")])).unwrap();
        assert!(!a.requests.is_empty(), "{shape:?}");
        assert_eq!(a, b, "{shape:?}");
        assert_ne!(a, other, "{shape:?}: another seed, another trace");
        let text: String = a.requests.iter().map(|r| mooncake_line(r) + "\n").collect();
        let parsed = Trace::parse_mooncake(text.as_bytes()).unwrap();
        assert_eq!(parsed.requests.len(), a.requests.len());
        for (read, written) in parsed.requests.iter().zip(&a.requests) {
            assert_eq!((read.input_length, &read.hash_ids), (written.input_length, &written.hash_ids));
            assert_eq!((&read.tenant, &read.priority), (&written.tenant, &written.priority));
            assert_eq!(read.session_id, written.session_id);
            assert_eq!(read.think_ms.map(|ms| ms.round()), written.think_ms.map(|ms| ms.round()));
            assert!((read.timestamp_ms - written.timestamp_ms).abs() < 1e-3);
        }
        assert!(a.requests.windows(2).all(|w| w[0].timestamp_ms <= w[1].timestamp_ms), "arrival order");
    }
}

#[test]
fn hot_documents_are_shared_by_their_questions() {
    let trace =
        generate(&args(Shape::HotDocs, &[("duration-secs", "300"), ("capacity-tokens-per-sec", "8000")]))
            .unwrap();
    let long: Vec<_> = trace.requests.iter().filter(|r| r.input_length >= 40_000).collect();
    let mut docs = std::collections::BTreeMap::new();
    for request in &long {
        assert!(request.input_length <= 120_000 + 1024 + 512, "{}", request.input_length);
        *docs.entry(request.hash_ids[0]).or_insert(0) += 1;
    }
    assert_eq!(docs.len(), 4, "four documents");
    // 300 s, a burst every 5 s of 4 questions on average: ~240 questions per document.
    assert!(docs.values().all(|&n| n > 120), "{docs:?}");
    // Beside them, short chats (0.3 of 8,000 tok/s in sessions of ~15,000 prompt tokens over
    // 3.5 turns: ~170 requests).
    let chats = trace.requests.len() - long.len();
    assert!((100..300).contains(&chats), "{chats} chat requests");
    // Nearly all of the documents' tokens are servable from cache.
    assert!(trace.cache_ceiling().rate() > 0.9, "{}", trace.cache_ceiling().rate());
}

#[test]
fn bursts_switch_between_their_two_loads() {
    // One engine's capacity keeps the trace small; loads are relative to it.
    let args = args(
        Shape::Bursts,
        &[
            ("duration-secs", "3000"),
            ("low-secs", "200"),
            ("high-secs", "100"),
            ("capacity-tokens-per-sec", "8000"),
        ],
    );
    let trace = generate(&args).unwrap();
    let (mut low, mut high) = (0.0, 0.0);
    for period in 0..10 {
        let start = f64::from(period) * 300.0;
        // Skip the first 30 s of each phase: sessions started in the previous one still ask
        // (a session's later turns are its longest prompts).
        low += prompt_tokens(&trace, start + 30.0, start + 200.0) / 170.0;
        high += prompt_tokens(&trace, start + 230.0, start + 300.0) / 70.0;
    }
    let (low, high) = (low / 10.0 / 8_000.0, high / 10.0 / 8_000.0);
    assert!((0.2..0.5).contains(&low), "low phase load {low}");
    assert!((2.4..3.6).contains(&high), "high phase load {high}");
}

#[test]
fn long_prompts_arrive_at_their_load_and_some_are_asked_again() {
    let args = args(
        Shape::LongPrompts,
        &[("duration-secs", "3600"), ("load", "0.5"), ("capacity-tokens-per-sec", "8000")],
    );
    let trace = generate(&args).unwrap();
    let load = prompt_tokens(&trace, 0.0, 3600.0) / 3600.0 / 8_000.0;
    assert!((0.4..0.65).contains(&load), "load {load}");
    let mut asks = std::collections::HashMap::new();
    for request in &trace.requests {
        *asks.entry(request.hash_ids[0]).or_insert(0u32) += 1;
    }
    let mean = trace.requests.len() as f64 / asks.len() as f64;
    assert!((1.7..2.3).contains(&mean), "asks per document {mean}");
}

#[test]
fn bad_options_are_reported_together() {
    let mut bad = GenArgs::new(Shape::Bursts);
    bad.duration_secs = 0.0;
    bad.high_load = f64::NAN;
    bad.user_max_tokens = 10;
    let Err(GenError::InvalidOptions(errors)) = generate(&bad) else { panic!("expected invalid options") };
    let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
    assert_eq!(fields, ["duration_secs", "high_load", "user_max_tokens"]);
}

/// The flood tenant sends `flood-factor` times the interactive tenants' requests, every line
/// names its tenant, and the flood's prompts share its documents.
#[test]
fn the_flood_tenant_sends_its_factor_of_the_interactive_requests() {
    let trace = generate(&args(
        Shape::TenantsFlood,
        &[
            ("duration-secs", "600"),
            ("capacity-tokens-per-sec", "8000"),
            ("doc-min-tokens", "2000"),
            ("doc-max-tokens", "4000"),
        ],
    ))
    .unwrap();
    let count = |name: &str| trace.requests.iter().filter(|r| r.tenant.as_deref() == Some(name)).count();
    let interactive: usize = (1..=3).map(|i| count(&format!("interactive-{i}"))).sum();
    assert!((1..=3).all(|i| count(&format!("interactive-{i}")) > 0));
    assert_eq!(interactive + count("flood"), trace.requests.len(), "every line names its tenant");
    let ratio = count("flood") as f64 / interactive as f64;
    assert!((8.5..11.5).contains(&ratio), "{ratio}");
    let docs: std::collections::BTreeSet<u64> = trace
        .requests
        .iter()
        .filter(|r| r.tenant.as_deref() == Some("flood"))
        .map(|r| r.hash_ids[0])
        .collect();
    assert_eq!(docs.len(), 4, "the flood asks on its --docs documents");
}

/// Each session's requests in arrival order.
fn sessions(trace: &Trace) -> std::collections::BTreeMap<&str, Vec<&TraceRequest>> {
    let mut sessions: std::collections::BTreeMap<&str, Vec<&TraceRequest>> = Default::default();
    for request in &trace.requests {
        sessions
            .entry(request.session_id.as_deref().expect("every turn names its session"))
            .or_default()
            .push(request);
    }
    sessions
}

/// Chat sessions are written as sessions: a later turn's think time is its gap after the
/// previous turn's timestamp, and extends its prompt; `--open-loop` writes the same requests
/// without the session fields.
#[test]
fn chat_turns_name_their_session_and_think_time_and_open_loop_leaves_them_out() {
    let small = [("duration-secs", "300"), ("capacity-tokens-per-sec", "8000")];
    let trace = generate(&args(Shape::Bursts, &small)).unwrap();
    let sessions = sessions(&trace);
    assert!(sessions.len() > 10 && sessions.values().any(|turns| turns.len() > 2), "{}", sessions.len());
    for turns in sessions.values() {
        assert_eq!(turns[0].think_ms, None, "a first turn has no previous answer");
        for pair in turns.windows(2) {
            let think_ms = pair[1].think_ms.expect("a later turn's think time");
            assert!((pair[1].timestamp_ms - pair[0].timestamp_ms - think_ms).abs() < 1e-6);
            assert_eq!(
                pair[1].hash_ids[..pair[0].hash_ids.len() - 1],
                pair[0].hash_ids[..pair[0].hash_ids.len() - 1]
            );
        }
    }
    let mut open = args(Shape::Bursts, &small);
    open.open_loop = true;
    let open = generate(&open).unwrap();
    assert!(open.requests.iter().all(|r| r.session_id.is_none() && r.think_ms.is_none()));
    let strip = |r: &TraceRequest| TraceRequest { session_id: None, think_ms: None, ..r.clone() };
    assert_eq!(open.requests, trace.requests.iter().map(strip).collect::<Vec<_>>());
}

/// `conversations`: exactly N chats of T turns, dealt to C clients (the sessions), each client
/// rotating through its chats one request at a time; a chat's later turn extends its previous
/// one by the answer and a question, and no two chats share a block.
#[test]
fn conversations_are_n_chats_of_t_turns_carried_on_by_c_clients() {
    let trace = generate(&args(
        Shape::Conversations,
        &[
            ("conversations", "20"),
            ("session-max-turns", "10"),
            ("clients", "4"),
            ("system-prompt-tokens", "100"),
            ("user-min-tokens", "10"),
            ("user-max-tokens", "20"),
            ("output-min-tokens", "5"),
            ("output-max-tokens", "10"),
        ],
    ))
    .unwrap();
    assert_eq!(trace.requests.len(), 200);
    let clients = sessions(&trace);
    assert_eq!(clients.len(), 4);
    let mut chats: std::collections::BTreeMap<u64, Vec<&TraceRequest>> = Default::default();
    for turns in clients.values() {
        assert_eq!(turns.len(), 50);
        assert_eq!(turns[0].think_ms, None);
        for (i, turn) in turns.iter().enumerate() {
            // Turn 1 of each of the client's five chats, then turn 2 of each, ...
            assert_eq!(i >= 5, turn.input_length > 100 + 20, "{i}: {}", turn.input_length);
            chats.entry(turn.hash_ids[0]).or_default().push(turn);
        }
        for pair in turns.windows(2) {
            let think_ms = pair[1].think_ms.expect("a later request's think time");
            assert!((pair[1].timestamp_ms - pair[0].timestamp_ms - think_ms).abs() < 1e-6);
        }
    }
    assert_eq!(chats.len(), 20, "every chat starts with its own block");
    for turns in chats.values() {
        assert_eq!(turns.len(), 10);
        for pair in turns.windows(2) {
            let (before, after) = (pair[0], pair[1]);
            let grown = after.input_length - before.input_length;
            assert!(grown > before.output_length, "the answer and a question");
            assert_eq!(
                after.hash_ids[..before.hash_ids.len() - 1],
                before.hash_ids[..before.hash_ids.len() - 1]
            );
        }
    }
}

/// Agents' sessions: each call resends the previous call's whole prompt plus its answer and a
/// tool result, a tool time after the answer; an application's tool prompt is shared by all its
/// sessions, the most popular application starts the most; contexts stay under the cap.
#[test]
fn agent_calls_resend_their_context_plus_the_answer_and_a_tool_result() {
    let trace = generate(&args(
        Shape::Agentic,
        &[("duration-secs", "600"), ("capacity-tokens-per-sec", "8000"), ("load", "8")],
    ))
    .unwrap();
    let sessions = sessions(&trace);
    let mut by_app: std::collections::BTreeMap<u64, usize> = Default::default();
    for turns in sessions.values() {
        assert!(turns.len() <= 28);
        *by_app.entry(turns[0].hash_ids[0]).or_default() += 1;
        assert!(turns[0].input_length >= 4_000 + 100 && turns[0].think_ms.is_none());
        for pair in turns.windows(2) {
            let (before, after) = (pair[0], pair[1]);
            let grown = after.input_length - before.input_length;
            assert!((before.output_length + 300..=before.output_length + 6_000).contains(&grown), "{grown}");
            let whole = before.input_length as usize / crate::trace::MOONCAKE_BLOCK_TOKENS;
            assert_eq!(after.hash_ids[..whole], before.hash_ids[..whole], "the context is resent");
            let tool_ms = after.think_ms.unwrap();
            assert!((200.0..=3_000.0).contains(&tool_ms), "{tool_ms}");
        }
        assert!(turns.iter().all(|turn| turn.input_length <= 110_000));
    }
    assert_eq!(by_app.len(), 6, "six applications");
    let mut counts: Vec<usize> = by_app.values().copied().collect();
    counts.sort_unstable();
    assert!(counts[5] > 2 * counts[0], "popularity skewed: {counts:?}");
    // Sessions start at the load asked (8 x 8,000 prompt tokens a second, as if no cap bound).
    let load = prompt_tokens(&trace, 0.0, 600.0) / 600.0 / 8_000.0;
    assert!((6.0..10.0).contains(&load), "load {load}");
    assert!(trace.cache_ceiling().rate() > 0.8, "{}", trace.cache_ceiling().rate());
}

/// Rollouts: every step a batch of prompts, each sampled 8-16 times at the same instant with
/// the same prompt; outputs log-normal around their median, cut at the maximum.
#[test]
fn rollout_samples_share_their_whole_prompt_and_arrive_together() {
    let trace = generate(&args(Shape::Rollouts, &[("duration-secs", "200")])).unwrap();
    let mut groups: std::collections::BTreeMap<(u64, Vec<u64>), Vec<u32>> = Default::default();
    for request in &trace.requests {
        let key = ((request.timestamp_ms * 1000.0) as u64, request.hash_ids.clone());
        groups.entry(key).or_default().push(request.output_length);
    }
    // Steps at 0, 45, 90, 135 and 180 s, 28 prompts each.
    assert_eq!(groups.len(), 5 * 28);
    assert!(groups.values().all(|samples| (8..=16).contains(&samples.len())));
    for (at_us, _) in groups.keys() {
        let into_step = (*at_us as f64 / 1e6) % 45.0;
        assert!(into_step <= 1.0, "{into_step}");
    }
    let families: std::collections::BTreeSet<u64> = groups.keys().map(|(_, ids)| ids[0]).collect();
    assert_eq!(families.len(), 5);
    let mut outputs: Vec<u32> = trace.requests.iter().map(|r| r.output_length).collect();
    outputs.sort_unstable();
    let median = outputs[outputs.len() / 2];
    assert!((800..1_250).contains(&median), "median {median}");
    assert_eq!(*outputs.last().unwrap(), 7_000, "the tail is cut at the maximum");
}

/// Reasoning: questions on popular shared contexts at the load asked, long outputs.
#[test]
fn reasoning_questions_share_popular_contexts_and_get_long_answers() {
    let trace = generate(&args(
        Shape::Reasoning,
        &[
            ("duration-secs", "600"),
            ("capacity-tokens-per-sec", "8000"),
            ("docs", "6"),
            ("doc-min-tokens", "8000"),
            ("doc-max-tokens", "16000"),
            ("load", "1"),
        ],
    ))
    .unwrap();
    let load = prompt_tokens(&trace, 0.0, 600.0) / 600.0 / 8_000.0;
    assert!((0.8..1.2).contains(&load), "load {load}");
    let mut by_doc: std::collections::BTreeMap<u64, usize> = Default::default();
    for request in &trace.requests {
        *by_doc.entry(request.hash_ids[0]).or_default() += 1;
        assert!(request.session_id.is_none());
    }
    let mut counts: Vec<usize> = by_doc.values().copied().collect();
    counts.sort_unstable();
    assert_eq!(counts.len(), 6);
    assert!(counts[5] > 3 * counts[0], "{counts:?}");
    let mut outputs: Vec<u32> = trace.requests.iter().map(|r| r.output_length).collect();
    outputs.sort_unstable();
    assert!((700..1_400).contains(&outputs[outputs.len() / 2]));
}
