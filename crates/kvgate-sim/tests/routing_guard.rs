//! The routing guard binary end to end on one scenario: a baseline it writes passes; a baseline
//! 5% better than reality on one figure (what a change making that scenario 5% worse looks like)
//! fails it with that figure in the table; 2% passes, printed as within tolerance.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn guard(baseline: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_routing-guard"))
        .args([
            "--baseline",
            baseline.to_str().unwrap(),
            "--scenarios",
            "S8",
            "--policies",
            "round_robin,cache_aware",
        ])
        .args(extra)
        .output()
        .expect("the guard runs")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The baseline with S8's cache_aware TTFT p99 divided by `factor`.
fn doctored(baseline: &Path, factor: f64, name: &str) -> PathBuf {
    let mut value: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(baseline).unwrap()).unwrap();
    let figure = &mut value["scenarios"][0]["policies"]["cache_aware"]["ttft_p99_ms"];
    *figure = (figure.as_f64().unwrap() / factor).into();
    let path = baseline.with_file_name(name);
    std::fs::write(&path, value.to_string()).unwrap();
    path
}

#[test]
fn a_scenario_five_percent_worse_than_its_baseline_fails_the_guard() {
    let dir = std::env::temp_dir().join(format!("kvgate-routing-guard-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let baseline = dir.join("routing.json");

    let update = guard(&baseline, &["--update"]);
    assert!(update.status.success(), "{}{}", stdout(&update), String::from_utf8_lossy(&update.stderr));
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&baseline).unwrap()).unwrap();
    assert_eq!(written["scenarios"][0]["id"], "S8");
    assert!(written["scenarios"][0]["policies"]["round_robin"]["ttft_mean_ms"].as_f64().unwrap() > 0.0);

    let same = guard(&baseline, &[]);
    assert!(same.status.success(), "{}", stdout(&same));
    assert!(stdout(&same).contains("No figure moved (6 compared)"), "{}", stdout(&same));

    // Reality 5% worse than the baseline says: the guard fails and names the figure.
    let five = guard(&doctored(&baseline, 1.05, "five.json"), &[]);
    assert_eq!(five.status.code(), Some(1), "{}", stdout(&five));
    let table = stdout(&five);
    assert!(
        table.contains("| S8 | cache_aware | ttft_p99_ms |")
            && table.contains("| +5.00% | **worse: fails** |"),
        "{table}"
    );
    assert!(table.contains("The routing guard FAILS: 1 figures more than 3% worse"), "{table}");

    // 2% worse: printed, within tolerance.
    let two = guard(&doctored(&baseline, 1.02, "two.json"), &[]);
    assert!(two.status.success(), "{}", stdout(&two));
    assert!(stdout(&two).contains("| +2.00% | worse, within tolerance |"), "{}", stdout(&two));

    // A baseline that cannot be read is an error (exit 2), not a pass.
    let missing = guard(&dir.join("none.json"), &[]);
    assert_eq!(missing.status.code(), Some(2));
    std::fs::remove_dir_all(&dir).unwrap();
}
