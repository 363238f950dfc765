//! When `kvgate replay` sends each request: every request at its scaled timestamp (open loop),
//! except a session's later turns, sent once the previous turn of their session has ended plus
//! their think time ([`SessionSchedule`]: closed loop, one turn of a session in flight at most);
//! at most `--concurrency-limit` requests in flight; nothing sent, and nothing waited for, past
//! the deadline. The sending itself is the caller's (a future per request), so the scheduler is
//! tested on its own in paused time.
//!
//! Keeping time while hundreds of answers stream in: the scheduler prepares each request ahead
//! of its due time (`prepare(position)`: the caller builds its body then, so that at the due
//! time only the send is left) and hands the prepared future at its due time to the runtime that
//! reads the answers (`spawn_on`). `kvgate replay` runs the scheduler on a thread of its own
//! ([`run_on_sending_thread`]): on the runtime that read the answers, building a burst's bodies
//! and reading hundreds of streams kept its timer waiting, and the sends of S10's rollouts
//! went out 50-120 ms late (docs/BENCHMARKS.md, S9 and S10 over HTTP). The delay reported is
//! measured when each request's future first runs, behind its due time.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use kvgate_trace::{SessionFigures, SessionSchedule};
use tokio::runtime::Handle;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// How far ahead of its due time a request is prepared (its body built).
const LOOKAHEAD: Duration = Duration::from_millis(200);

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
    /// Sum over the requests that ran of how late each began behind its due time.
    pub send_delay_total: Duration,
    /// Requests still running at the deadline.
    pub deadline_hits: u64,
    pub wall: Duration,
    /// The per-session figures (wall time), when the requests name sessions.
    pub sessions: Option<SessionFigures>,
}

/// Runs [`run_schedule`] on a thread of its own (a single-threaded runtime that only keeps time
/// and prepares requests), the requests running on the caller's runtime: a dedicated thread
/// that sleeps between sends wakes on time however busy the runtime reading the answers is.
pub(crate) async fn run_on_sending_thread<T, F, Fut>(
    schedule: SessionSchedule,
    settings: ScheduleSettings,
    prepare: F,
    failed: fn(String) -> T,
) -> std::io::Result<ScheduleRun<T>>
where
    T: Send + 'static,
    F: FnMut(usize) -> Fut + Send + 'static,
    Fut: Future<Output = T> + Send + 'static,
{
    let answers = Handle::current();
    let (done, run) = tokio::sync::oneshot::channel();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build()?;
    std::thread::Builder::new().name("kvgate-replay-send".into()).spawn(move || {
        let run = runtime.block_on(run_schedule(&schedule, settings, &answers, prepare, failed));
        let _ = done.send(run);
    })?;
    run.await.map_err(|_| std::io::Error::other("the sending thread ended without a report"))
}

/// Sends every request of `schedule` at its time: `prepare(position)` ahead of it (within
/// [`LOOKAHEAD`], a later turn as soon as its time is known), the future it returned spawned on
/// `spawn_on` at the due time; returns once every request sent has ended, or at the deadline. A
/// request whose future panicked ends as `failed(message)`.
pub(crate) async fn run_schedule<T, F, Fut>(
    schedule: &SessionSchedule,
    settings: ScheduleSettings,
    spawn_on: &Handle,
    mut prepare: F,
    failed: fn(String) -> T,
) -> ScheduleRun<T>
where
    T: Send + 'static,
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
{
    let total = schedule.len();
    let first_us = if total == 0 { 0 } else { schedule.timestamp_us(0) };
    let timed_positions: Vec<usize> = schedule.timed().collect();
    // Requests prepared ahead of their due time, by position; the open-loop ones before
    // `timed_prepared` are. Those due within the first LOOKAHEAD are prepared before the clock
    // starts.
    let mut prepared: HashMap<usize, Fut> = HashMap::new();
    let mut timed_prepared = 0usize;
    let lookahead_us = LOOKAHEAD.as_micros() as u64;
    while let Some(&position) = timed_positions.get(timed_prepared) {
        if schedule.timestamp_us(position).saturating_sub(first_us) >= lookahead_us {
            break;
        }
        prepared.insert(position, prepare(position));
        timed_prepared += 1;
    }
    let started = Instant::now();
    let at = |us: u64| started + Duration::from_micros(us.saturating_sub(first_us));
    let clock_us = |instant: Instant| first_us + instant.duration_since(started).as_micros() as u64;
    let hard_stop = started + settings.deadline;
    let limit = Arc::new(Semaphore::new(settings.limit.unwrap_or(Semaphore::MAX_PERMITS)));
    let mut timed = schedule.timed().peekable();
    // Later turns whose previous turn ended: (due, position), soonest first.
    let mut due_turns: BinaryHeap<Reverse<(u64, usize)>> = BinaryHeap::new();
    let mut tasks: JoinSet<(usize, T, Instant, Instant)> = JoinSet::new();
    // Each task's request, for a task that panicked.
    let mut task_positions: HashMap<tokio::task::Id, usize> = HashMap::new();
    let (mut sent_us, mut ended_us) = (vec![None; total], vec![None; total]);
    let mut due_at: Vec<Option<Instant>> = vec![None; total];
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
        // The next preparation: the soonest open-loop request not prepared, LOOKAHEAD ahead of
        // its due time. One at a time, so that a request due meanwhile is not kept waiting.
        while timed_positions.get(timed_prepared).is_some_and(|&position| sent_us[position].is_some()) {
            timed_prepared += 1; // sent before its turn to be prepared came (prepared then)
        }
        let prepare_next = timed_positions
            .get(timed_prepared)
            .copied()
            .filter(|&position| at(schedule.timestamp_us(position)) < hard_stop);
        let prepare_at = prepare_next
            .map(|position| at(schedule.timestamp_us(position)).checked_sub(LOOKAHEAD).unwrap_or(started));
        tokio::select! {
            biased;
            _ = tokio::time::sleep_until(hard_stop) => {
                run.deadline_hits = tasks.len() as u64;
                tasks.abort_all();
                break;
            }
            // A request due is sent before answers that ended are counted.
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
                let request = match prepared.remove(&position) {
                    Some(request) => request,
                    None => prepare(position),
                };
                let now = Instant::now();
                run.sent += 1;
                sent_us[position] = Some(clock_us(now));
                due_at[position] = Some(at(due_us));
                let task = tasks.spawn_on(
                    async move {
                        let begun = Instant::now();
                        let result = request.await;
                        drop(permit);
                        (position, result, begun, Instant::now())
                    },
                    spawn_on,
                );
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
            Some(joined) = tasks.join_next_with_id(), if !tasks.is_empty() => {
                let (position, result, ended) = match joined {
                    Ok((id, (position, result, begun, ended))) => {
                        task_positions.remove(&id);
                        if let Some(due) = due_at[position] {
                            run.send_delay_total += begun.saturating_duration_since(due);
                        }
                        (position, result, ended)
                    }
                    Err(error) => {
                        let position = task_positions.remove(&error.id()).expect("a spawned task");
                        (position, failed(error.to_string()), Instant::now())
                    }
                };
                let ended = clock_us(ended);
                ended_us[position] = Some(ended);
                run.results.push((position, result));
                if let Some((next, due_us)) = schedule.next_turn(position, ended) {
                    if at(due_us) < hard_stop {
                        prepared.insert(next, prepare(next));
                    }
                    due_turns.push(Reverse((due_us, next)));
                }
            }
            _ = tokio::time::sleep_until(prepare_at.unwrap_or(hard_stop)), if prepare_at.is_some() => {
                let position = prepare_next.expect("a request to prepare");
                prepared.insert(position, prepare(position));
                timed_prepared += 1;
            }
        }
    }
    run.wall = started.elapsed();
    run.sessions = schedule.figures(&sent_us, &ended_us);
    run
}

#[cfg(test)]
mod tests;
