//! The prefill/decode flags: the worker role, their validation, and the model-time durations (hold timeout, KV transfer time) turned into wall time.

use std::time::Duration;

use kvgate_config::{Checks, FieldError, Range};

use crate::args::{EngineKind, MockArgs};

/// The prefill/decode disaggregation role of every engine of one fleet.
pub use kvgate_protocol::WorkerRole;

/// The PD timings of one fleet, in wall time (model time divided by `--time-scale`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct PdTiming {
    /// How long a prefill engine holds a KV nobody pulls, and a decode engine waits for its KV.
    pub(crate) hold_timeout: Duration,
    /// Wall seconds to transfer one prompt token's KV.
    transfer_secs_per_token: f64,
}

impl PdTiming {
    pub(crate) fn from_args(args: &MockArgs) -> Self {
        let model_secs_per_token = args.kv_bytes_per_token as f64 / (args.kv_transfer_gbps * 1e9);
        Self {
            hold_timeout: wall_duration(args.kv_hold_timeout_secs / args.time_scale),
            transfer_secs_per_token: model_secs_per_token / args.time_scale,
        }
    }

    /// Wall time of the KV transfer of a prompt of `prompt_tokens` tokens.
    pub(crate) fn transfer_time(&self, prompt_tokens: u64) -> Duration {
        wall_duration(prompt_tokens as f64 * self.transfer_secs_per_token)
    }
}

/// Seconds as a `Duration`, clamped to [0, 1e9] s (validated flags give finite values).
fn wall_duration(secs: f64) -> Duration {
    if secs.is_finite() {
        Duration::from_secs_f64(secs.clamp(0.0, 1e9))
    } else {
        Duration::from_secs(1_000_000_000)
    }
}

impl MockArgs {
    /// Problems with the prefill/decode flags.
    pub(crate) fn pd_problems(&self, checks: &mut Checks) {
        if self.role != WorkerRole::Regular && self.engine != EngineKind::Realistic {
            checks.push(FieldError::new("role", "prefill and decode need --engine realistic"));
        }
        if self.bootstrap_base_port.is_some() && self.role != WorkerRole::Prefill {
            checks.push(FieldError::new("bootstrap_base_port", "is only for --role prefill"));
        }
        self.check_port_range(checks, "bootstrap_base_port", self.bootstrap_base_port);
        checks.in_range("kv_transfer_gbps", self.kv_transfer_gbps, Range::POSITIVE);
        checks.in_range("kv_hold_timeout_secs", self.kv_hold_timeout_secs, Range::POSITIVE);
        checks.at_least("kv_bytes_per_token", self.kv_bytes_per_token, 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pd_problems(args: &MockArgs) -> Vec<FieldError> {
        let mut checks = Checks::new();
        args.pd_problems(&mut checks);
        checks.finish().err().map(|e| e.0).unwrap_or_default()
    }

    #[test]
    fn defaults_are_regular_with_a_llama_8b_link() {
        let args = MockArgs::default();
        assert_eq!(args.role, WorkerRole::Regular);
        assert_eq!((args.kv_bytes_per_token, args.kv_transfer_gbps), (131_072, 25.0));
        assert!(pd_problems(&args).is_empty());
        // 10,000 tokens x 128 KiB at 25 GB/s: 52.4 ms; twice as fast at --time-scale 2.
        let timing = PdTiming::from_args(&MockArgs { time_scale: 2.0, ..args });
        assert_eq!(timing.transfer_time(10_000).as_micros(), 26_214);
        assert_eq!(timing.hold_timeout, Duration::from_secs(15));
    }

    #[test]
    fn pd_flags_are_checked_together() {
        let args = MockArgs {
            role: WorkerRole::Decode,
            engine: EngineKind::Canned,
            bootstrap_base_port: Some(0),
            kv_transfer_gbps: 0.0,
            kv_hold_timeout_secs: f64::NAN,
            kv_bytes_per_token: 0,
            ..MockArgs::default()
        };
        assert_eq!(pd_problems(&args).len(), 5, "{:?}", pd_problems(&args));
        let prefill =
            MockArgs { role: WorkerRole::Prefill, bootstrap_base_port: Some(7000), ..MockArgs::default() };
        assert!(pd_problems(&prefill).is_empty());
        assert_eq!(prefill.validate(), Ok(()));
        let overflow = MockArgs { count: 2, bootstrap_base_port: Some(65_535), ..prefill };
        let errors = overflow.validate().unwrap_err();
        assert_eq!(errors.errors().len(), 1, "{errors}");
        assert_eq!(errors.errors()[0].field, "bootstrap_base_port");
    }
}
