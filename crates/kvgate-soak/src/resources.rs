//! The soak process's own resources: resident memory (`VmRSS` of `/proc/self/status`), open
//! file descriptors (the entries of `/proc/self/fd`) and CPU time (`/proc/self/stat`). The
//! gateway, the engines and the client all run in this one process, so these cover all three.

use serde::Serialize;

/// One reading, `at_secs` after the load started (negative: before it).
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Sample {
    pub label: String,
    pub at_secs: f64,
    pub rss_kb: u64,
    pub fds: usize,
    /// User + system CPU time of the process so far.
    pub cpu_secs: f64,
    /// Estimated memory of the soak's own per-request bookkeeping at that point (the client's
    /// records and the engines' soak id counts), which grows with every request by design.
    pub bookkeeping_kb: u64,
}

/// Resident memory in kB (0 when `/proc` is not there).
fn rss_kb() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Open file descriptors, not counting the one that lists them.
fn fds() -> usize {
    match std::fs::read_dir("/proc/self/fd") {
        Ok(entries) => entries.count().saturating_sub(1),
        Err(_) => 0,
    }
}

/// `/proc` reports CPU times in USER_HZ, 100 per second on Linux.
const USER_HZ: f64 = 100.0;

/// User + system CPU seconds of the process (0 when `/proc` is not there).
fn cpu_secs() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which is in parentheses and may hold spaces): state is
    // the first, utime the 12th, stime the 13th.
    let fields: Vec<&str> =
        stat.rsplit_once(')').map_or(Vec::new(), |(_, rest)| rest.split_whitespace().collect());
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    (ticks(11) + ticks(12)) as f64 / USER_HZ
}

/// Estimated bytes one request's soak id takes in an engine's count map (key, value, table
/// slack and the key's heap allocation).
const SOAK_ID_ENTRY_BYTES: u64 = 72;

/// A reading after `requests` requests, each kept as a `record_bytes` record by the client.
pub(crate) fn sample(label: &str, at_secs: f64, requests: u64, record_bytes: usize) -> Sample {
    Sample {
        label: label.to_string(),
        at_secs,
        rss_kb: rss_kb(),
        fds: fds(),
        cpu_secs: cpu_secs(),
        bookkeeping_kb: requests * (record_bytes as u64 + SOAK_ID_ENTRY_BYTES) / 1024,
    }
}

/// Lowest and highest value of `value` over `samples`.
pub(crate) fn range<T: Copy + Ord>(samples: &[&Sample], value: impl Fn(&Sample) -> T) -> Option<(T, T)> {
    let min = samples.iter().map(|s| value(s)).min()?;
    let max = samples.iter().map(|s| value(s)).max()?;
    Some((min, max))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_memory_and_descriptors() {
        let before = sample("before", 0.0, 0, 0);
        assert!(before.rss_kb > 0 && before.fds >= 3, "{before:?}");
        // Spin until the kernel's CPU-time counter (10 ms ticks) moves, with a deadline: on a
        // loaded machine 50 ms of wall time may hold less than one tick of this thread's CPU.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let mut later = sample("later", 0.0, 1024, 56);
        while later.cpu_secs <= before.cpu_secs && std::time::Instant::now() < deadline {
            let spin = std::time::Instant::now();
            while spin.elapsed() < std::time::Duration::from_millis(20) {
                std::hint::black_box(());
            }
            later = sample("later", 0.0, 1024, 56);
        }
        assert!(later.cpu_secs > before.cpu_secs || cfg!(not(target_os = "linux")));
        assert_eq!(later.bookkeeping_kb, 128);
    }
}
