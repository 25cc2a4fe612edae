//! Job-wide counters and status shared by tasks, the coordinator and the control API, and
//! their Prometheus exposition (prometheus-client's OpenMetrics text, every series labelled
//! with the job's name).

use std::borrow::Cow;
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};
use weir_crds::control::{CheckpointInfo, CheckpointOutcome, JobState, JobStatus, SavepointStatus};

const HISTORY: usize = 50;

/// The `Content-Type` of [`JobMetrics::render_prometheus`].
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Counters and status of one job process.
#[derive(Debug)]
pub struct JobMetrics {
    /// Job name.
    pub name: String,
    /// Run id.
    pub job_id: String,
    /// Records read by sources.
    pub records_in: Counter,
    /// Records written by sinks.
    pub records_out: Counter,
    /// Checkpoints completed.
    pub checkpoints_completed: Counter,
    /// Checkpoints failed.
    pub checkpoints_failed: Counter,
    /// Durations of completed checkpoints, seconds.
    pub checkpoint_duration: Histogram,
    /// Bytes of state written by completed checkpoints.
    pub checkpoint_size: Histogram,
    /// Duration of the newest completed checkpoint, seconds.
    pub last_checkpoint_duration: Gauge<f64, AtomicU64>,
    /// Bytes of the newest completed checkpoint.
    pub last_checkpoint_bytes: Gauge,
    /// Total time tasks spent aligning barriers, seconds.
    pub alignment_seconds: Counter<f64, AtomicU64>,
    /// Total time tasks spent in the synchronous part of snapshots (the part that stops their
    /// records: capturing state; encoding happens there too for keyed state), seconds.
    pub snapshot_sync_seconds: Counter<f64, AtomicU64>,
    /// CPU time of the task threads (their records, and the synchronous part of their
    /// snapshots), added as each task ends, seconds. The rest of the process's CPU time is
    /// the uploaders', the background merges', the restores' and the coordinator's.
    pub task_cpu_seconds: Counter<f64, AtomicU64>,
    /// In-process restarts.
    pub restarts: Counter,
    /// Faults injected by the test hook.
    pub injected_faults: Counter,
    /// Records windows dropped because they were behind the watermark.
    pub late_records: Counter,
    /// Full images merged in the background from uploaded chains and adopted by a checkpoint.
    pub state_merges: Counter,
    /// Background merges that failed (their chains were kept).
    pub state_merges_failed: Counter,
    /// Runs of increments merged in the background into one increment and adopted.
    pub state_increment_merges: Counter,
    /// Wakes the control API's requests waiting for a savepoint when one's status changes.
    pub savepoint_changed: tokio::sync::Notify,
    /// Lifecycle state, history, savepoint requests, last error.
    pub status: Mutex<StatusBoard>,
    registry: Registry,
}

/// The parts of status behind a lock.
#[derive(Debug)]
pub struct StatusBoard {
    /// Current lifecycle state.
    pub state: JobState,
    /// Newest first.
    pub history: VecDeque<CheckpointInfo>,
    /// Savepoint requests by id.
    pub savepoints: BTreeMap<u64, SavepointStatus>,
    /// The last failure.
    pub last_error: Option<String>,
    /// What the current attempt restored from.
    pub restored_from: Option<String>,
    /// The fencing epoch of the current attempt (0 before the first claim).
    pub epoch: u64,
    /// What a person should know of (output moved by a rewind), newest last.
    pub notices: Vec<String>,
}

impl StatusBoard {
    /// The newest completed checkpoint or savepoint in the history.
    pub fn latest_completed(&self) -> Option<CheckpointInfo> {
        self.history.iter().find(|c| c.outcome == CheckpointOutcome::Completed).cloned()
    }
}

impl JobMetrics {
    /// Fresh metrics.
    pub fn new(name: &str, job_id: &str) -> Self {
        let job_label = std::iter::once((Cow::Borrowed("job"), Cow::Owned(name.to_string())));
        let mut registry = Registry::with_prefix_and_labels("weir", job_label);
        let records_in = Counter::default();
        let records_out = Counter::default();
        let checkpoints_completed = Counter::default();
        let checkpoints_failed = Counter::default();
        // 10 ms to about 2.7 hours.
        let checkpoint_duration = Histogram::new(exponential_buckets(0.01, 4.0, 11));
        // 1 KiB to 1 TiB.
        let checkpoint_size = Histogram::new(exponential_buckets(1024.0, 4.0, 16));
        let last_checkpoint_duration = Gauge::<f64, AtomicU64>::default();
        let last_checkpoint_bytes = Gauge::default();
        let alignment_seconds = Counter::<f64, AtomicU64>::default();
        let snapshot_sync_seconds = Counter::<f64, AtomicU64>::default();
        let task_cpu_seconds = Counter::<f64, AtomicU64>::default();
        let restarts = Counter::default();
        let injected_faults = Counter::default();
        let late_records = Counter::default();
        let state_merges = Counter::default();
        let state_merges_failed = Counter::default();
        let state_increment_merges = Counter::default();
        registry.register("records_in", "Records read by sources", records_in.clone());
        registry.register("records_out", "Records written by sinks", records_out.clone());
        registry.register(
            "checkpoints_completed",
            "Completed checkpoints and savepoints",
            checkpoints_completed.clone(),
        );
        registry.register("checkpoints_failed", "Failed checkpoints and savepoints", checkpoints_failed.clone());
        registry.register_with_unit(
            "checkpoint_duration",
            "Durations of completed checkpoints and savepoints, trigger to completion",
            Unit::Seconds,
            checkpoint_duration.clone(),
        );
        registry.register_with_unit(
            "checkpoint_size",
            "State written by completed checkpoints and savepoints",
            Unit::Bytes,
            checkpoint_size.clone(),
        );
        registry.register_with_unit(
            "last_checkpoint_duration",
            "Duration of the newest completed checkpoint",
            Unit::Seconds,
            last_checkpoint_duration.clone(),
        );
        registry.register_with_unit(
            "last_checkpoint_size",
            "State written by the newest completed checkpoint",
            Unit::Bytes,
            last_checkpoint_bytes.clone(),
        );
        registry.register_with_unit(
            "checkpoint_alignment",
            "Time tasks spent aligning barriers",
            Unit::Seconds,
            alignment_seconds.clone(),
        );
        registry.register_with_unit(
            "checkpoint_sync",
            "Time tasks spent in the synchronous part of snapshots, records stopped",
            Unit::Seconds,
            snapshot_sync_seconds.clone(),
        );
        registry.register_with_unit(
            "task_cpu",
            "CPU time of task threads (records and snapshots' synchronous part), added as each task ends",
            Unit::Seconds,
            task_cpu_seconds.clone(),
        );
        registry.register("restarts", "In-process restarts from the newest checkpoint", restarts.clone());
        registry.register("injected_faults", "Faults injected by the test hook", injected_faults.clone());
        registry.register("late_records", "Records windows dropped as behind the watermark", late_records.clone());
        registry.register(
            "state_merges",
            "Full images of keyed state merged in the background from uploaded files and adopted",
            state_merges.clone(),
        );
        registry.register(
            "state_merges_failed",
            "Background merges of keyed state that failed (their files were kept)",
            state_merges_failed.clone(),
        );
        registry.register(
            "state_increment_merges",
            "Runs of keyed-state increments merged in the background into one increment and adopted",
            state_increment_merges.clone(),
        );
        JobMetrics {
            name: name.to_string(),
            job_id: job_id.to_string(),
            records_in,
            records_out,
            checkpoints_completed,
            checkpoints_failed,
            checkpoint_duration,
            checkpoint_size,
            last_checkpoint_duration,
            last_checkpoint_bytes,
            alignment_seconds,
            snapshot_sync_seconds,
            task_cpu_seconds,
            restarts,
            injected_faults,
            late_records,
            state_merges,
            state_merges_failed,
            state_increment_merges,
            savepoint_changed: tokio::sync::Notify::new(),
            status: Mutex::new(StatusBoard {
                state: JobState::Starting,
                history: VecDeque::new(),
                savepoints: BTreeMap::new(),
                last_error: None,
                restored_from: None,
                epoch: 0,
                notices: Vec::new(),
            }),
            registry,
        }
    }

    /// Adds the calling thread's CPU time so far to [`Self::task_cpu_seconds`] (see
    /// [`thread_cpu_seconds`]); called by each task thread as it ends.
    pub fn add_task_cpu(&self) {
        if let Some(seconds) = thread_cpu_seconds() {
            self.task_cpu_seconds.inc_by(seconds);
        }
    }

    /// Locks the status board (a poisoned lock still yields the data: it is plain status).
    pub fn board(&self) -> std::sync::MutexGuard<'_, StatusBoard> {
        self.status.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets the lifecycle state.
    pub fn set_state(&self, state: JobState) {
        self.board().state = state;
    }

    /// Adds or updates a checkpoint in the history.
    pub fn record_checkpoint(&self, info: CheckpointInfo) {
        if info.outcome == CheckpointOutcome::Completed {
            self.checkpoints_completed.inc();
            let seconds = info.duration_ms.unwrap_or(0) as f64 / 1000.0;
            self.checkpoint_duration.observe(seconds);
            self.checkpoint_size.observe(info.bytes as f64);
            self.last_checkpoint_duration.set(seconds);
            self.last_checkpoint_bytes.set(i64::try_from(info.bytes).unwrap_or(i64::MAX));
        } else if info.outcome == CheckpointOutcome::Failed {
            self.checkpoints_failed.inc();
        }
        let mut board = self.board();
        if let Some(existing) = board.history.iter_mut().find(|c| c.id == info.id) {
            *existing = info;
        } else {
            board.history.push_front(info);
            board.history.truncate(HISTORY);
        }
    }

    /// Sets a savepoint request's status and wakes whoever waits for it.
    pub fn set_savepoint(&self, status: SavepointStatus) {
        self.board().savepoints.insert(status.request_id, status);
        self.savepoint_changed.notify_waiters();
    }

    /// Marks every savepoint request still in progress failed, `failure` saying why: its attempt
    /// ended without it, and the next attempt's coordinator does not know it (whoever asked
    /// must ask again). Before, such a request stayed in progress for good, and a caller
    /// waiting for it (the control API's `wait`, an operator's savepoint before an upgrade)
    /// waited until its own timeout.
    pub fn fail_savepoints_in_progress(&self, failure: &str) {
        let mut board = self.board();
        let mut changed = false;
        for s in board.savepoints.values_mut().filter(|s| s.outcome == CheckpointOutcome::InProgress) {
            s.outcome = CheckpointOutcome::Failed;
            s.failure = Some(failure.to_string());
            changed = true;
        }
        drop(board);
        if changed {
            self.savepoint_changed.notify_waiters();
        }
    }

    /// The newest completed checkpoint or savepoint.
    pub fn latest_completed(&self) -> Option<CheckpointInfo> {
        self.board().latest_completed()
    }

    /// Completed and failed checkpoints so far in this process.
    pub fn checkpoint_counts(&self) -> (u64, u64) {
        (self.checkpoints_completed.get(), self.checkpoints_failed.get())
    }

    /// The job's status as the control API reports it.
    pub fn job_status(&self) -> JobStatus {
        let board = self.board();
        JobStatus {
            name: self.name.clone(),
            job_id: self.job_id.clone(),
            state: board.state,
            restarts: u32::try_from(self.restarts.get()).unwrap_or(u32::MAX),
            records_in: self.records_in.get(),
            records_out: self.records_out.get(),
            latest_checkpoint: board.latest_completed(),
            restored_from: board.restored_from.clone(),
            epoch: board.epoch,
            notices: board.notices.clone(),
            last_error: board.last_error.clone(),
            injected_faults: self.injected_faults.get(),
        }
    }

    /// The OpenMetrics text exposition (Prometheus reads it; see [`CONTENT_TYPE`]).
    pub fn render_prometheus(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// CPU time (user and system) the calling thread has used, in seconds, from Linux's
/// `/proc/thread-self/stat` (in clock ticks of 10 ms); `None` where that file is missing or
/// unreadable.
pub fn thread_cpu_seconds() -> Option<f64> {
    parse_thread_cpu_ticks(&std::fs::read_to_string("/proc/thread-self/stat").ok()?).map(|t| t as f64 / USER_HZ)
}

/// Linux's clock ticks per second in `/proc` (`USER_HZ`, 100 on every architecture).
const USER_HZ: f64 = 100.0;

/// `utime + stime` (fields 14 and 15) of a `/proc/<pid>/task/<tid>/stat` line. The second
/// field, the thread's name in parentheses, may hold spaces and parentheses, so fields are
/// counted from the last `)`.
fn parse_thread_cpu_ticks(stat: &str) -> Option<u64> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_name.split_ascii_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

#[cfg(test)]
mod tests {
    use weir_crds::control::CheckpointKind;

    use super::*;

    #[test]
    fn renders_base_units_histograms_and_escaped_labels() {
        let m = JobMetrics::new("orders \"eu\"\nwest", "r1");
        m.records_in.inc_by(41);
        m.records_in.inc();
        m.alignment_seconds.inc_by(0.25);
        m.snapshot_sync_seconds.inc_by(0.5);
        m.record_checkpoint(CheckpointInfo {
            id: 1,
            kind: CheckpointKind::Checkpoint,
            outcome: CheckpointOutcome::Completed,
            path: "file:///c/chk-1".into(),
            triggered_at_ms: 0,
            duration_ms: Some(1500),
            bytes: 3 * 1024 * 1024,
            failure: None,
        });
        let text = m.render_prometheus();
        let job = r#"job="orders \"eu\"\nwest""#;
        assert!(text.contains(&format!("weir_records_in_total{{{job}}} 42\n")), "{text}");
        assert!(text.contains(&format!("weir_checkpoint_duration_seconds_sum{{{job}}} 1.5\n")), "{text}");
        assert!(text.contains(&format!("weir_checkpoint_duration_seconds_count{{{job}}} 1\n")), "{text}");
        assert!(text.contains(&format!("weir_checkpoint_duration_seconds_bucket{{{job},le=\"2.56\"}} 1\n")), "{text}");
        assert!(text.contains(&format!("weir_checkpoint_duration_seconds_bucket{{{job},le=\"0.64\"}} 0\n")), "{text}");
        assert!(text.contains(&format!("weir_last_checkpoint_size_bytes{{{job}}} 3145728\n")), "{text}");
        assert!(text.contains(&format!("weir_checkpoint_alignment_seconds_total{{{job}}} 0.25\n")), "{text}");
        assert!(text.contains(&format!("weir_checkpoint_sync_seconds_total{{{job}}} 0.5\n")), "{text}");
        assert!(text.contains("# UNIT weir_checkpoint_duration_seconds seconds\n"), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert!(!text.contains("_ms"), "no millisecond series are left:\n{text}");
    }

    #[test]
    fn a_thread_cpu_time_is_read_after_a_name_with_spaces_and_parentheses() {
        let stat = "24440 (a (b) c) R 24437 24437 4174 0 -1 4194304 100 0 0 0 250 17 0 0 20 0 1 0 1324769";
        assert_eq!(parse_thread_cpu_ticks(stat), Some(267));
        assert_eq!(parse_thread_cpu_ticks("24440 (cat) R 1 2"), None);
        // This thread's own figure grows with work it does.
        let before = thread_cpu_seconds().expect("/proc/thread-self/stat on Linux");
        let started = std::time::Instant::now();
        let mut x = 1u64;
        while started.elapsed() < std::time::Duration::from_millis(120) {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
        let after = thread_cpu_seconds().unwrap();
        assert!(after - before >= 0.05, "{before} → {after}");
    }
}
