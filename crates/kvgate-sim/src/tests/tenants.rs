//! Tenants in the simulator: behind the gateway's cap, the fair queue keeps a flooding tenant
//! from delaying an interactive one (which waits behind the flood in arrival order), and the
//! report gives each tenant's figures.

use super::*;

/// A tenant `flood` queuing 200 long prompts at once beside `chat` sending a short one every
/// 200 ms.
fn flood_trace() -> Trace {
    let mut requests = Vec::new();
    for i in 0..200u64 {
        let mut flood = request(
            i as f64,
            4096,
            8,
            &[
                10_000 + 8 * i,
                10_001 + 8 * i,
                10_002 + 8 * i,
                10_003 + 8 * i,
                10_004 + 8 * i,
                10_005 + 8 * i,
                10_006 + 8 * i,
                10_007 + 8 * i,
            ],
        );
        flood.tenant = Some("flood".to_string());
        requests.push(flood);
    }
    for i in 0..20u64 {
        let mut chat = request(i as f64 * 200.0, 256, 8, &[i]);
        chat.tenant = Some("chat".to_string());
        requests.push(chat);
    }
    Trace { requests }
}

fn chat_p99(report: &SimReport) -> f64 {
    let tenants = &report.runs[0].metrics.tenants;
    assert_eq!(tenants.iter().map(|t| t.tenant.as_str()).collect::<Vec<_>>(), ["chat", "flood"]);
    assert_eq!(tenants.iter().map(|t| t.completed).sum::<u64>(), 220, "every request completes");
    tenants[0].ttft_p99_ms
}

#[test]
fn the_fair_queue_keeps_the_flood_from_delaying_the_interactive_tenant() {
    let mut fifo = args("round_robin", 2);
    fifo.max_concurrent_requests = Some(2);
    fifo.ignore_tenants = true;
    let mut fair = fifo.clone();
    fair.ignore_tenants = false;
    let mut local = fair.clone();
    local.fairness_locality_bound = 10_000;
    let trace = flood_trace();
    let (fifo, fair, local) = (simulate(&fifo, &trace), simulate(&fair, &trace), simulate(&local, &trace));
    let (fifo_p99, fair_p99, local_p99) = (chat_p99(&fifo), chat_p99(&fair), chat_p99(&local));
    assert!(fair_p99 * 10.0 < fifo_p99, "fair {fair_p99} ms vs arrival order {fifo_p99} ms");
    assert!(local_p99 * 10.0 < fifo_p99, "locality {local_p99} ms vs arrival order {fifo_p99} ms");
    // Where the slowest tenth's TTFT went: behind the flood in arrival order, the gateway's
    // queue; the parts add up to their mean TTFT (at least the p90).
    let chat = |report: &SimReport| report.runs[0].metrics.tenants[0].clone();
    for report in [&fifo, &fair, &local] {
        let chat = chat(report);
        let parts = chat.tail_gateway_wait_ms
            + chat.tail_engine_wait_ms
            + chat.tail_prefill_own_ms
            + chat.tail_prefill_shared_ms;
        assert!(parts >= chat.ttft_p90_ms * 0.999, "{chat:?}");
        assert!(chat.tail_prefill_own_ms > 0.0 && chat.decode_mean_ms > 0.0, "{chat:?}");
    }
    let fifo_chat = chat(&fifo);
    assert!(fifo_chat.tail_gateway_wait_ms > 0.9 * fifo_chat.ttft_p90_ms, "{fifo_chat:?}");
    assert!(chat(&fair).tail_gateway_wait_ms * 10.0 < fifo_chat.tail_gateway_wait_ms);
    let markdown = fair.markdown();
    assert!(markdown.contains("Per tenant, `round_robin`") && markdown.contains("| chat |"), "{markdown}");
    assert!(markdown.contains("TTFT of the slowest tenth by part"), "{markdown}");
    assert!(fair.to_json().contains("\"tenants\""));
}

/// `--tenants` written to a file of its own (the gateway's `tenants:` section).
fn tenants_file(name: &str, yaml: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("kvgate-sim-tenants-{name}-{}.yaml", std::process::id()));
    std::fs::write(&path, yaml).unwrap();
    path
}

/// A slot reserved for the interactive tenant's class lets it in at once while the flood holds
/// the rest, and with the engines serving by priority its prefill goes ahead of the flood's:
/// its p99 comes within the engine's step time of its p99 with the flood absent, and every
/// request completes once (`chat_p99` counts them).
#[test]
fn reserved_concurrency_and_engine_priority_bring_the_interactive_tenant_near_alone() {
    let mut fair = args("round_robin", 2);
    fair.max_concurrent_requests = Some(4);
    let trace = flood_trace();
    let alone = Trace {
        requests: trace.requests.iter().filter(|r| r.tenant.as_deref() == Some("chat")).cloned().collect(),
    };
    let alone_p99 = simulate(&fair, &alone).runs[0].metrics.tenants[0].ttft_p99_ms;
    let mut reserved = fair.clone();
    reserved.tenants = Some(tenants_file(
        "reserved",
        "named: {chat: {class: high}}\nclasses: {high: {reserved_concurrency: 2}}",
    ));
    let mut prioritized = reserved.clone();
    prioritized.engine.priority_scheduling = true;
    let (fair, reserved, prioritized) =
        (simulate(&fair, &trace), simulate(&reserved, &trace), simulate(&prioritized, &trace));
    let (fair_p99, reserved_p99, prioritized_p99) =
        (chat_p99(&fair), chat_p99(&reserved), chat_p99(&prioritized));
    assert!(reserved_p99 < fair_p99, "reserved {reserved_p99} ms vs fair {fair_p99} ms");
    assert!(prioritized_p99 < reserved_p99, "with engine priority {prioritized_p99} ms vs {reserved_p99} ms");
    // What remains is the engine's step: a chat prompt arriving mid-step waits for it to end
    // (2,048 flood tokens, 256 ms), then shares the next one with the flood's chunk; and, when
    // two chat answers overlap, the wait for one of the two reserved slots.
    assert!(prioritized_p99 <= alone_p99 + 3.0 * 256.0, "{prioritized_p99} ms vs alone {alone_p99} ms");
}

/// The sim takes tenant weights from `--tenants` as the gateway does: two tenants backlogged
/// alike, the one of weight 3 waits less than the one of weight 1; of equal weights, alike.
#[test]
fn tenant_weights_from_the_tenants_file_share_the_queue() {
    let mut requests = Vec::new();
    for i in 0..120u64 {
        for (tenant, base) in [("light", 100_000), ("heavy", 200_000)] {
            let mut r = request(0.0, 1024, 4, &[base + 2 * i, base + 2 * i + 1]);
            r.tenant = Some(tenant.to_string());
            requests.push(r);
        }
    }
    let trace = Trace { requests };
    let mut base = args("round_robin", 1);
    base.max_concurrent_requests = Some(1);
    let mean_queue = |args: &SimArgs| {
        let report = simulate(args, &trace);
        let tenants = &report.runs[0].metrics.tenants;
        assert_eq!(tenants.iter().map(|t| t.completed).sum::<u64>(), 240);
        let of = |name: &str| tenants.iter().find(|t| t.tenant == name).unwrap().mean_queue_ms;
        (of("heavy"), of("light"))
    };
    let (heavy, light) = mean_queue(&base);
    assert!((heavy / light - 1.0).abs() < 0.1, "equal weights: {heavy} vs {light} ms");
    let mut weighted = base.clone();
    weighted.tenants = Some(tenants_file("weights", "named: {heavy: {weight: 3}, light: {weight: 1}}"));
    let (heavy, light) = mean_queue(&weighted);
    assert!(heavy < 0.7 * light, "weight 3 vs 1: {heavy} vs {light} ms");
}

/// `--tenants` is checked as the gateway checks its section.
#[test]
fn a_bad_tenants_file_is_refused_with_every_problem() {
    let mut bad = args("round_robin", 1);
    bad.max_concurrent_requests = Some(2);
    bad.tenants = Some(tenants_file(
        "bad",
        "tenants: {defaults: {weight: 0}, classes: {high: {reserved_concurrency: 2}}}",
    ));
    let text = bad.runs().unwrap_err().to_string();
    assert!(text.contains("tenants.defaults.weight") && text.contains("reserved_concurrency"), "{text}");
}
