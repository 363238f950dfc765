//! Per-worker overload protection (SMG 1.13's `--worker-overload-waiting-requests` and
//! `--worker-overload-token-usage`): a worker whose fresh load sample shows at least that many
//! queued requests, or at least that KV usage, is left out of a decision while another candidate
//! is under both bounds; when every candidate is over them, the least loaded one takes the
//! request, or none does (`shed`: the host answers 503). A worker without a fresh sample is never
//! left out for it (a stale snapshot drives nothing). The host applies it to the candidates
//! before any policy sees them, so it holds for every policy.

use kvgate_config::{Checks, FieldError, Range, ValidationErrors};

use crate::inflight::fresh_load;
use crate::{Candidate, LoadSample};

/// The bounds; `None` turns a bound off.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OverloadSettings {
    /// Queued (waiting) requests at or above which a worker is overloaded (at least 1).
    pub waiting_requests: Option<u64>,
    /// KV usage at or above which a worker is overloaded, in (0, 1].
    pub token_usage: Option<f64>,
    /// When every candidate is overloaded: refuse the request instead of sending it to the least
    /// loaded one.
    pub shed: bool,
}

impl OverloadSettings {
    /// Whether either bound is on (the host then polls the engines' loads).
    pub fn enabled(&self) -> bool {
        self.waiting_requests.is_some() || self.token_usage.is_some()
    }

    /// Every problem of the bounds at once (the gateway's `--worker-overload-*` options, and the
    /// simulator's): a waiting bound of 0, a usage bound outside (0, 1].
    pub fn check(&self) -> Result<(), ValidationErrors> {
        let mut checks = Checks::new();
        if self.waiting_requests == Some(0) {
            checks.push(
                FieldError::new(
                    "worker_overload_waiting_requests",
                    "must be at least 1 (the bound is inclusive: 0 would leave out every worker; unset: off)",
                )
                .got(0),
            );
        }
        if let Some(usage) = self.token_usage {
            checks.in_range("worker_overload_token_usage", usage, Range::FRACTION);
        }
        checks.finish()
    }

    fn overloaded(&self, load: &LoadSample) -> bool {
        self.waiting_requests.is_some_and(|bound| load.num_waiting_reqs >= bound)
            || self.token_usage.is_some_and(|bound| load.token_usage >= bound)
    }
}

/// Which candidates a decision may use.
#[derive(Clone, Debug, PartialEq)]
pub enum Admitted {
    /// Every candidate (none is overloaded, or the protection is off).
    All,
    /// Only these: the ones under the bounds, or the least loaded when every one is over them.
    Only(Vec<Candidate>),
    /// Every candidate is overloaded and `shed` is set.
    Shed,
}

/// The candidates of one decision under `settings`, with samples older than three poll intervals
/// ignored.
pub fn admit(
    candidates: &[Candidate],
    settings: &OverloadSettings,
    now_ms: u64,
    poll_interval_ms: u64,
) -> Admitted {
    if !settings.enabled() {
        return Admitted::All;
    }
    let overloaded = |candidate: &Candidate| {
        fresh_load(candidate, now_ms, poll_interval_ms).is_some_and(|load| settings.overloaded(&load))
    };
    let under: Vec<Candidate> = candidates.iter().filter(|c| !overloaded(c)).copied().collect();
    if under.len() == candidates.len() {
        return Admitted::All;
    }
    if !under.is_empty() {
        return Admitted::Only(under);
    }
    if settings.shed {
        return Admitted::Shed;
    }
    // Every one is over a bound: the least loaded (fewest waiting, then lowest KV usage, then
    // fewest in flight here; the first in the host's order on a tie).
    let load_of = |c: &Candidate| {
        let load = fresh_load(c, now_ms, poll_interval_ms).unwrap_or_default();
        (load.num_waiting_reqs, load.token_usage, c.in_flight)
    };
    let least = candidates
        .iter()
        .min_by(|a, b| load_of(a).partial_cmp(&load_of(b)).unwrap_or(std::cmp::Ordering::Equal))
        .copied();
    Admitted::Only(least.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(id: u32, waiting: u64, usage: f64, fetched_at_ms: u64) -> Candidate {
        let load = LoadSample {
            token_usage: usage,
            num_waiting_reqs: waiting,
            fetched_at_ms,
            ..LoadSample::default()
        };
        Candidate { id, in_flight: 0, load: Some(load) }
    }

    fn ids(admitted: &Admitted) -> Vec<u32> {
        match admitted {
            Admitted::Only(kept) => kept.iter().map(|c| c.id).collect(),
            Admitted::All => vec![u32::MAX],
            Admitted::Shed => Vec::new(),
        }
    }

    const ON: OverloadSettings =
        OverloadSettings { waiting_requests: Some(8), token_usage: Some(0.8), shed: false };

    #[test]
    fn an_overloaded_worker_is_left_out_while_another_is_under_both_bounds() {
        let now = 1_000;
        let fleet = [candidate(0, 8, 0.1, now), candidate(1, 0, 0.8, now), candidate(2, 7, 0.79, now)];
        assert_eq!(ids(&admit(&fleet, &ON, now, 100)), vec![2], "the bounds are inclusive");
        assert_eq!(admit(&fleet[2..], &ON, now, 100), Admitted::All);
        assert_eq!(admit(&fleet, &OverloadSettings::default(), now, 100), Admitted::All, "off");
        let only_waiting = OverloadSettings { token_usage: None, ..ON };
        assert_eq!(ids(&admit(&fleet, &only_waiting, now, 100)), vec![1, 2]);
    }

    #[test]
    fn when_every_worker_is_over_the_least_loaded_one_takes_it_or_none_with_shed() {
        let now = 1_000;
        let fleet = [candidate(0, 20, 0.9, now), candidate(1, 9, 0.95, now), candidate(2, 9, 0.85, now)];
        assert_eq!(ids(&admit(&fleet, &ON, now, 100)), vec![2]);
        assert_eq!(admit(&fleet, &OverloadSettings { shed: true, ..ON }, now, 100), Admitted::Shed);
    }

    #[test]
    fn bounds_that_would_leave_out_every_worker_are_refused() {
        let problems = |settings: OverloadSettings| match settings.check() {
            Ok(()) => Vec::new(),
            Err(errors) => errors.0.into_iter().map(|e| e.field).collect(),
        };
        assert!(problems(ON).is_empty() && problems(OverloadSettings::default()).is_empty());
        let zero = OverloadSettings { waiting_requests: Some(0), token_usage: Some(0.0), shed: false };
        assert_eq!(problems(zero), ["worker_overload_waiting_requests", "worker_overload_token_usage"]);
        assert!(problems(OverloadSettings { token_usage: Some(f64::NAN), ..ON }).len() == 1);
    }

    #[test]
    fn a_stale_or_missing_sample_never_leaves_a_worker_out() {
        let now = 10_000;
        let stale = candidate(0, 50, 0.99, now - 301);
        let unknown = Candidate { id: 1, in_flight: 3, load: None };
        assert_eq!(admit(&[stale, unknown], &ON, now, 100), Admitted::All);
        let fresh = candidate(2, 50, 0.99, now);
        assert_eq!(ids(&admit(&[stale, fresh], &ON, now, 100)), vec![0]);
    }
}
