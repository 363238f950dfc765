//! When `kvgate replay` sends each request: every request at its scaled timestamp (open loop),
//! except a session's later turns, sent once the previous turn of their session has ended plus
//! their think time ([`SessionSchedule`]: closed loop, one turn of a session in flight at most);
//! at most `--concurrency-limit` requests in flight; nothing sent, and nothing waited for, past
//! the deadline. The sending itself is the caller's (a future per request), so the scheduler is
//! tested on its own in paused time.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use kvgate_trace::{SessionFigures, SessionSchedule};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// How the schedule runs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ScheduleSettings {
    /// Most requests in flight at once (`None`: no limit).
    pub limit: Option<usize>,
    /// From the first send: no request is sent after it, and requests still running then are
    /// abandoned.
    pub deadline: Duration,
    /// Print progress on stderr every few seconds.
    pub show_progress: bool,
}

/// What the schedule did: each request's outcome (in completion order, by position in arrival
/// order), and the sends' timing.
#[derive(Debug)]
pub(crate) struct ScheduleRun<T> {
    pub results: Vec<(usize, T)>,
    pub sent: usize,
    /// Sum over the sends of how late each was behind its due time.
    pub send_delay_total: Duration,
    /// Requests still running at the deadline.
    pub deadline_hits: u64,
    pub wall: Duration,
    /// The per-session figures (wall time), when the requests name sessions.
    pub sessions: Option<SessionFigures>,
}

/// Sends every request of `schedule` by `send(position)` at its time; returns once every request
/// sent has ended, or at the deadline. A request whose future panicked ends as `failed(message)`.
pub(crate) async fn run_schedule<T, F, Fut>(
    schedule: &SessionSchedule,
    settings: ScheduleSettings,
    mut send: F,
    failed: fn(String) -> T,
) -> ScheduleRun<T>
where
    T: Send + 'static,
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
{
    let total = schedule.len();
    let first_us = if total == 0 { 0 } else { schedule.timestamp_us(0) };
    let started = Instant::now();
    let at = |us: u64| started + Duration::from_micros(us.saturating_sub(first_us));
    let clock_us = |instant: Instant| first_us + instant.duration_since(started).as_micros() as u64;
    let hard_stop = started + settings.deadline;
    let limit = Arc::new(Semaphore::new(settings.limit.unwrap_or(Semaphore::MAX_PERMITS)));
    let mut timed = schedule.timed().peekable();
    // Later turns whose previous turn ended: (due, position), soonest first.
    let mut due_turns: BinaryHeap<Reverse<(u64, usize)>> = BinaryHeap::new();
    let mut tasks: JoinSet<(usize, T, Instant)> = JoinSet::new();
    // Each task's request, for a task that panicked.
    let mut task_positions: HashMap<tokio::task::Id, usize> = HashMap::new();
    let (mut sent_us, mut ended_us) = (vec![None; total], vec![None; total]);
    let mut run = ScheduleRun {
        results: Vec::new(),
        sent: 0,
        send_delay_total: Duration::ZERO,
        deadline_hits: 0,
        wall: Duration::ZERO,
        sessions: None,
    };
    let mut last_progress = Instant::now();
    loop {
        let next_timed = timed.peek().map(|&position| (schedule.timestamp_us(position), position));
        let next = match (next_timed, due_turns.peek().map(|Reverse(turn)| *turn)) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        // Nothing is sent at or after the deadline.
        let next = next.filter(|&(due_us, _)| at(due_us) < hard_stop);
        if next.is_none() && tasks.is_empty() {
            break;
        }
        let due = next.map_or(hard_stop, |(due_us, _)| at(due_us));
        tokio::select! {
            biased;
            _ = tokio::time::sleep_until(hard_stop) => {
                run.deadline_hits = tasks.len() as u64;
                tasks.abort_all();
                break;
            }
            Some(joined) = tasks.join_next_with_id(), if !tasks.is_empty() => {
                let (position, result, ended) = match joined {
                    Ok((id, done)) => {
                        task_positions.remove(&id);
                        done
                    }
                    Err(error) => {
                        let position = task_positions.remove(&error.id()).expect("a spawned task");
                        (position, failed(error.to_string()), Instant::now())
                    }
                };
                let ended = clock_us(ended);
                ended_us[position] = Some(ended);
                run.results.push((position, result));
                if let Some(turn) = schedule.next_turn(position, ended) {
                    due_turns.push(Reverse((turn.1, turn.0)));
                }
            }
            _ = tokio::time::sleep_until(due), if next.is_some() => {
                let (due_us, position) = next.expect("a request is due");
                if next == next_timed {
                    timed.next();
                } else {
                    due_turns.pop();
                }
                let permit = tokio::select! {
                    permit = limit.clone().acquire_owned() => permit.expect("the semaphore is never closed"),
                    _ = tokio::time::sleep_until(hard_stop) => continue,
                };
                let now = Instant::now();
                run.send_delay_total += now.saturating_duration_since(at(due_us));
                run.sent += 1;
                sent_us[position] = Some(clock_us(now));
                let request = send(position);
                let task = tasks.spawn(async move {
                    let result = request.await;
                    drop(permit);
                    (position, result, Instant::now())
                });
                task_positions.insert(task.id(), position);
                if settings.show_progress && last_progress.elapsed() >= Duration::from_secs(5) {
                    last_progress = Instant::now();
                    eprintln!(
                        "replay: {}/{total} sent, {} done, {:.0} s",
                        run.sent,
                        run.results.len(),
                        started.elapsed().as_secs_f64()
                    );
                }
            }
        }
    }
    run.wall = started.elapsed();
    run.sessions = schedule.figures(&sent_us, &ended_us);
    run
}

#[cfg(test)]
mod tests;
