//! kvgate's own headers (`x-kvgate-*`), one namespace both ways: no client header in it reaches
//! an engine and no engine header in it reaches a client; the gateway sets its own where it
//! decides them. Also what the simulated engines read of a client's headers.

use http::HeaderName;

/// The namespace's prefix.
pub const GATEWAY_HEADER_PREFIX: &str = "x-kvgate-";

/// Whether `name` is in kvgate's namespace.
pub fn is_gateway_header(name: &HeaderName) -> bool {
    name.as_str().starts_with(GATEWAY_HEADER_PREFIX)
}

/// The gateways a request passed through, by instance id (loop detection).
pub static VIA: HeaderName = HeaderName::from_static("x-kvgate-via");
/// Names the worker a request must go to (with `--routing-key-override`).
pub static TARGET_WORKER: HeaderName = HeaderName::from_static("x-kvgate-target-worker");
/// How many times a stream moved to another engine (`--migrate-streams`).
pub static RESUMED: HeaderName = HeaderName::from_static("x-kvgate-resumed");

// The routing headers of an answer (`--expose-routing-headers`).
/// The worker that answered (a pair's decode side).
pub static WORKER: HeaderName = HeaderName::from_static("x-kvgate-worker");
/// Why the policy chose it.
pub static ROUTE: HeaderName = HeaderName::from_static("x-kvgate-route");
/// The prefix index the decision consulted.
pub static PREFIX_INDEX: HeaderName = HeaderName::from_static("x-kvgate-prefix-index");
/// kv_aware's predicted time to first token, by term.
pub static PREDICTED_TTFT: HeaderName = HeaderName::from_static("x-kvgate-predicted-ttft");
/// A pair's prefill worker, its reason and its index.
pub static PREFILL_WORKER: HeaderName = HeaderName::from_static("x-kvgate-prefill-worker");
pub static PREFILL_ROUTE: HeaderName = HeaderName::from_static("x-kvgate-prefill-route");
pub static PREFILL_PREFIX_INDEX: HeaderName = HeaderName::from_static("x-kvgate-prefill-prefix-index");
/// A disaggregated request's path (a pair, or in place).
pub static PD_PATH: HeaderName = HeaderName::from_static("x-kvgate-pd-path");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_header_is_in_the_namespace() {
        for name in [
            &VIA,
            &TARGET_WORKER,
            &RESUMED,
            &WORKER,
            &ROUTE,
            &PREFIX_INDEX,
            &PREDICTED_TTFT,
            &PREFILL_WORKER,
            &PREFILL_ROUTE,
            &PREFILL_PREFIX_INDEX,
            &PD_PATH,
        ] {
            assert!(is_gateway_header(name), "{name}");
        }
        assert!(!is_gateway_header(&HeaderName::from_static("x-request-id")));
    }
}
