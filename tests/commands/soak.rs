//! `kvgate soak`, shortened to about six seconds (steady 3 s with one worker removed and re-added
//! and one engine killed and restarted, a 1 s burst at ten times the rate, 2 s of recovery): the
//! binary is run as a child process, so its descriptor and memory samples are its own. No
//! request may be lost or duplicated, and descriptors must come back to where they started.

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Descriptors the run may hold beyond its start once idle, not counting pooled connections
/// (timers, a health-check connection being replaced, ...).
const FD_MARGIN: i64 = 8;

#[test]
fn a_short_soak_loses_and_duplicates_nothing_and_returns_its_descriptors() {
    let json = std::env::temp_dir().join(format!("kvgate-soak-{}.json", std::process::id()));
    let started = Instant::now();
    let output = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(["soak", "--workers", "3", "--time-scale", "20", "--rate", "40"])
        .args(["--max-concurrent-requests", "64", "--queue-size", "64", "--queue-timeout-secs", "2"])
        .args(["--steady-secs", "3", "--burst-secs", "1"])
        .args(["--recovery-secs", "2", "--churn-every-secs", "1", "--churn-down-secs", "0.6"])
        .args(["--kill-at-secs", "1.8", "--kill-down-secs", "0.5", "--sample-every-secs", "1"])
        .args(["--idle-secs", "2", "--deadline-secs", "5", "--json"])
        .arg(&json)
        .output()
        .expect("kvgate runs");
    let elapsed = started.elapsed();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "kvgate soak failed:\n{stdout}\n{stderr}");
    assert!(elapsed < Duration::from_secs(20), "bounded: {elapsed:?}");
    assert!(stdout.contains("| steady | 3 | 40 |") && stdout.contains("Verdict: PASS"), "{stdout}");

    let report: Value = serde_json::from_slice(&std::fs::read(&json).expect("the JSON report")).unwrap();
    let _ = std::fs::remove_file(&json);
    let total = &report["total"];
    assert_eq!((total["lost"].as_u64(), total["duplicated"].as_u64()), (Some(0), Some(0)), "{stdout}");
    assert!(total["sent"].as_u64().unwrap() > 100, "{stdout}");
    assert_eq!(report["unknown_engine_ids"], 0);
    assert_eq!(report["succeeded_without_engine_answer"], 0);
    let actions: Vec<&str> =
        report["churn"].as_array().unwrap().iter().map(|e| e["action"].as_str().unwrap()).collect();
    assert_eq!(actions, ["remove", "add", "kill", "remove", "restart", "add"], "{stdout}");
    for event in report["churn"].as_array().unwrap() {
        assert!(["200", "201", "ok"].contains(&event["result"].as_str().unwrap()), "{event}");
    }
    // Descriptors: once idle, only the gateway's pooled engine connections (two descriptors
    // each, both ends in this process) remain beyond the start; after shutdown, none.
    let fds = &report["fd_check"];
    let count = |key: &str| fds[key].as_i64().unwrap();
    let unexplained = count("after_idle") - count("before") - 2 * count("pooled_upstream_idle");
    assert!(unexplained <= FD_MARGIN, "{fds}");
    assert!(count("after_shutdown") <= count("baseline") + FD_MARGIN, "{fds}");
}

/// The stream migration soak, shortened to four seconds (16 closed-loop clients streaming, three
/// engines, three of them killed in turn): every stream an engine failed mid-answer completes
/// whole on another engine (its text the uncut answer, `kvgate mock` continuing exactly) or ends
/// with the error event; none lost, none duplicated, no text repeated. docs/RELIABILITY.md has
/// the two-minute run's figures.
#[test]
fn engines_killed_mid_stream_leave_every_stream_whole_or_ended_with_the_error_event() {
    let json = std::env::temp_dir().join(format!("kvgate-soak-migration-{}.json", std::process::id()));
    let started = Instant::now();
    let output = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(["soak", "--workers", "3", "--time-scale", "20", "--clients", "16", "--stream-fraction", "1"])
        .args(["--steady-secs", "4", "--burst-secs", "0", "--recovery-secs", "0", "--churn-every-secs", "0"])
        .args(["--kills", "3", "--kill-down-secs", "0.5", "--sample-every-secs", "1"])
        .args(["--idle-secs", "1", "--deadline-secs", "10", "--json"])
        .arg(&json)
        .output()
        .expect("kvgate runs");
    let elapsed = started.elapsed();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "kvgate soak failed:\n{stdout}\n{stderr}");
    assert!(elapsed < Duration::from_secs(30), "bounded: {elapsed:?}");
    let report: Value = serde_json::from_slice(&std::fs::read(&json).expect("the JSON report")).unwrap();
    let _ = std::fs::remove_file(&json);
    let total = &report["total"];
    assert_eq!((total["lost"].as_u64(), total["duplicated"].as_u64()), (Some(0), Some(0)), "{stdout}");
    let kills = report["churn"].as_array().unwrap().iter().filter(|e| e["action"] == "kill").count();
    assert_eq!(kills, 3, "{stdout}");
    let m = &report["migrations"];
    let count = |key: &str| m[key].as_u64().unwrap();
    assert!(count("cut") >= 3, "each kill cut streams in flight: {m}");
    assert_eq!(count("wrong_text"), 0, "no text repeated or lost across engines: {m}");
    assert_eq!(count("completed_whole") + count("error_event"), count("cut"), "{m}");
    assert!(count("completed_whole") * 10 >= count("cut") * 9, "cut streams complete on another engine: {m}");
}
