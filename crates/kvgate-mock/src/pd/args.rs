//! The prefill/decode flags: the worker role, their validation, and the model-time durations (hold timeout, KV transfer time) turned into wall time.

use std::time::Duration;

use crate::args::MockArgs;

/// The prefill/decode disaggregation role of every engine of one fleet.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WorkerRole {
    /// Prefill and decode every request (PD fields in a request are ignored).
    #[default]
    Regular,
    /// Prefill engine: PD requests are prefilled (one output token) and their KV is held until
    /// a decode engine pulls it over the bootstrap port.
    Prefill,
    /// Decode engine: PD requests pull their prompt's KV from the prefill engine, then decode.
    Decode,
}

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
    pub(crate) fn pd_problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if self.role != WorkerRole::Regular && self.engine != crate::EngineKind::Realistic {
            problems.push("--role prefill and --role decode need --engine realistic".into());
        }
        match self.bootstrap_base_port {
            Some(_) if self.role != WorkerRole::Prefill => {
                problems.push("--bootstrap-base-port is only for --role prefill".into());
            }
            Some(port) if port != 0 && usize::from(port) + self.count > 65_536 => {
                problems.push("--bootstrap-base-port + --count exceeds the port range".into());
            }
            _ => {}
        }
        let positive = [
            ("--kv-transfer-gbps", self.kv_transfer_gbps),
            ("--kv-hold-timeout-secs", self.kv_hold_timeout_secs),
        ];
        for (flag, value) in positive {
            if !(value.is_finite() && value > 0.0) {
                problems.push(format!("{flag} must be a finite number > 0, got {value}"));
            }
        }
        if self.kv_bytes_per_token == 0 {
            problems.push("--kv-bytes-per-token must be at least 1".into());
        }
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EngineKind;

    #[test]
    fn defaults_are_regular_with_a_llama_8b_link() {
        let args = MockArgs::default();
        assert_eq!(args.role, WorkerRole::Regular);
        assert_eq!((args.kv_bytes_per_token, args.kv_transfer_gbps), (131_072, 25.0));
        assert!(args.pd_problems().is_empty());
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
        assert_eq!(args.pd_problems().len(), 5, "{:?}", args.pd_problems());
        let prefill =
            MockArgs { role: WorkerRole::Prefill, bootstrap_base_port: Some(7000), ..MockArgs::default() };
        assert!(prefill.pd_problems().is_empty());
        assert_eq!(prefill.validate(), Ok(()));
        let overflow = MockArgs { count: 2, bootstrap_base_port: Some(65_535), ..prefill };
        assert_eq!(
            overflow.validate().unwrap_err(),
            "--bootstrap-base-port + --count exceeds the port range"
        );
    }
}
