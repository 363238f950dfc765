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
    let markdown = fair.markdown();
    assert!(markdown.contains("Per tenant, `round_robin`") && markdown.contains("| chat |"), "{markdown}");
    assert!(fair.to_json().contains("\"tenants\""));
}
