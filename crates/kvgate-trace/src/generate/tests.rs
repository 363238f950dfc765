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
    for shape in [Shape::HotDocs, Shape::Bursts, Shape::LongPrompts, Shape::TenantsFlood] {
        let small = [("duration-secs", "120"), ("capacity-tokens-per-sec", "8000")];
        let a = generate(&args(shape, &small)).unwrap();
        let b = generate(&args(shape, &small)).unwrap();
        let other = generate(&args(shape, &[small[0], small[1], ("seed", "1")])).unwrap();
        assert!(!a.requests.is_empty());
        assert_eq!(a, b, "{shape:?}");
        assert_ne!(a, other, "{shape:?}: another seed, another trace");
        let text: String = a.requests.iter().map(|r| mooncake_line(r) + "\n").collect();
        let parsed = Trace::parse_mooncake(text.as_bytes()).unwrap();
        assert_eq!(parsed.requests.len(), a.requests.len());
        for (read, written) in parsed.requests.iter().zip(&a.requests) {
            assert_eq!((read.input_length, &read.hash_ids), (written.input_length, &written.hash_ids));
            assert_eq!((&read.tenant, &read.priority), (&written.tenant, &written.priority));
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
