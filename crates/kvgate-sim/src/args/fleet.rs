//! The fleet the options describe: `--workers` regular engines, or a prefill/decode disaggregated fleet (`--prefill-workers`, `--decode-workers`, `--decode-policy`, the KV link flags).

use super::{policy_config, PolicyEntry, SimArgs};
use crate::sim::{Fleet, PdSetup};
use crate::SimError;
use kvgate_config::ValidationErrors;

impl SimArgs {
    /// The fleet to simulate, checked (every problem reported at once).
    pub fn fleet(&self) -> Result<Fleet, SimError> {
        self.parse_fleet().map_err(|problems| {
            SimError::InvalidOptions(ValidationErrors(problems.into_iter().map(super::flag_error).collect()))
        })
    }

    pub(super) fn parse_fleet(&self) -> Result<Fleet, Vec<String>> {
        let (prefill_workers, decode_workers) = match (self.prefill_workers, self.decode_workers) {
            (None, None) if self.workers == 0 => {
                return Err(vec!["--workers must be at least 1".to_string()])
            }
            (None, None) => return Ok(Fleet::Regular { n_workers: self.workers }),
            (Some(prefill), Some(decode)) => (prefill, decode),
            (Some(_), None) => return Err(vec!["--prefill-workers needs --decode-workers".to_string()]),
            (None, Some(_)) => return Err(vec!["--decode-workers needs --prefill-workers".to_string()]),
        };
        let mut problems = Vec::new();
        if prefill_workers == 0 {
            problems.push("--prefill-workers must be at least 1".to_string());
        }
        if decode_workers == 0 {
            problems.push("--decode-workers must be at least 1".to_string());
        }
        // The link's options are the policy's (`PolicyConfig`, validated with it): the fleet
        // moves KV at the rate the conditional rule predicts with.
        let (kv_transfer_gbps, kv_bytes_per_token) =
            (self.policy.kv_transfer_gbps, self.policy.kv_bytes_per_token);
        if !(kv_transfer_gbps.is_finite() && kv_transfer_gbps > 0.0) {
            problems.push(format!("--kv-transfer-gbps must be a finite number > 0, got {kv_transfer_gbps}"));
        }
        if kv_bytes_per_token == 0 {
            problems.push("--kv-bytes-per-token must be at least 1".to_string());
        }
        let entry = self.decode_policy.trim();
        let decode_policy = match PolicyEntry::parse(entry) {
            Ok(parsed) if parsed.entry.label.is_some() => {
                problems.push(format!("--decode-policy `{entry}` takes no @label"));
                None
            }
            Ok(parsed) => policy_config(&self.policy, parsed.kind, &parsed.entry.overrides)
                .map_err(|error| problems.push(format!("--decode-policy: {error}")))
                .ok(),
            Err(error) => {
                problems.push(error.replace("--policies", "--decode-policy"));
                None
            }
        };
        match decode_policy {
            Some(decode_policy) if problems.is_empty() => Ok(Fleet::Disaggregated(Box::new(PdSetup {
                prefill_workers,
                decode_workers,
                decode_policy_entry: entry.to_string(),
                decode_policy,
                kv_transfer_gbps,
                kv_bytes_per_token,
            }))),
            _ => Err(problems),
        }
    }
}

#[cfg(test)]
mod tests {
    use kvgate_policy::PolicyKind;

    use super::*;

    fn fleet(extra: &[&str]) -> Result<Fleet, Vec<String>> {
        #[derive(clap::Parser)]
        struct Command {
            #[command(flatten)]
            args: SimArgs,
        }
        let mut argv = vec!["kvgate-sim", "--trace", "t.jsonl"];
        argv.extend_from_slice(extra);
        <Command as clap::Parser>::try_parse_from(argv).unwrap().args.parse_fleet()
    }

    #[test]
    fn prefill_and_decode_workers_make_a_disaggregated_fleet_with_least_load_decode() {
        assert_eq!(fleet(&[]), Ok(Fleet::Regular { n_workers: 8 }));
        let Ok(Fleet::Disaggregated(pd)) = fleet(&["--prefill-workers", "4", "--decode-workers", "2"]) else {
            panic!("expected a disaggregated fleet");
        };
        assert_eq!((pd.prefill_workers, pd.decode_workers), (4, 2));
        assert_eq!(pd.decode_policy.policy, PolicyKind::LeastLoad);
        assert_eq!((pd.kv_transfer_gbps, pd.kv_bytes_per_token), (25.0, 131_072));
        // 10,000 tokens x 128 KiB at 25 GB/s: 52.4 ms, as the mock engines' transfer.
        assert_eq!(pd.transfer_us(10_000), 52_429);
        let Ok(Fleet::Disaggregated(pd)) = fleet(&[
            "--prefill-workers",
            "1",
            "--decode-workers",
            "1",
            "--decode-policy",
            "power_of_two",
            "--kv-transfer-gbps",
            "50",
        ]) else {
            panic!("expected a disaggregated fleet");
        };
        assert_eq!(pd.decode_policy.policy, PolicyKind::PowerOfTwo);
        assert_eq!(pd.transfer_us(10_000), 26_214);
    }

    #[test]
    fn disaggregated_fleet_problems_are_reported_together() {
        assert_eq!(
            fleet(&["--prefill-workers", "2"]),
            Err(vec!["--prefill-workers needs --decode-workers".into()])
        );
        let problems = fleet(&[
            "--prefill-workers",
            "0",
            "--decode-workers",
            "0",
            "--kv-transfer-gbps",
            "0",
            "--kv-bytes-per-token",
            "0",
            "--decode-policy",
            "fastest",
        ])
        .unwrap_err();
        assert_eq!(problems.len(), 5, "{problems:?}");
        assert!(problems[4].starts_with("unknown policy `fastest` in --decode-policy"), "{problems:?}");
        let problems =
            fleet(&["--prefill-workers", "1", "--decode-workers", "1", "--decode-policy", "random@x"]);
        assert_eq!(problems, Err(vec!["--decode-policy `random@x` takes no @label".into()]));
    }
}
