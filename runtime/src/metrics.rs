//! Job-wide counters and status shared by tasks, the coordinator and the control API, and
//! their Prometheus text rendering.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use weir_crds::control::{CheckpointInfo, CheckpointOutcome, JobState, SavepointStatus};

const HISTORY: usize = 50;

/// Counters and status of one job process.
#[derive(Debug)]
pub struct JobMetrics {
    /// Job name.
    pub name: String,
    /// Run id.
    pub job_id: String,
    /// Records read by sources.
    pub records_in: AtomicU64,
    /// Records written by sinks.
    pub records_out: AtomicU64,
    /// Checkpoints completed.
    pub checkpoints_completed: AtomicU64,
    /// Checkpoints failed.
    pub checkpoints_failed: AtomicU64,
    /// Sum of completed checkpoint durations, ms.
    pub checkpoint_duration_ms_sum: AtomicU64,
    /// Duration of the newest completed checkpoint, ms.
    pub last_checkpoint_duration_ms: AtomicU64,
    /// Bytes of the newest completed checkpoint.
    pub last_checkpoint_bytes: AtomicU64,
    /// Total barrier alignment time, ms.
    pub alignment_ms: AtomicU64,
    /// In-process restarts.
    pub restarts: AtomicU64,
    /// Faults injected by the test hook.
    pub injected_faults: AtomicU64,
    /// Records dropped as late by windows.
    pub late_records: AtomicU64,
    /// Lifecycle state, history, savepoint requests, last error.
    pub status: Mutex<StatusBoard>,
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

impl JobMetrics {
    /// Fresh metrics.
    pub fn new(name: &str, job_id: &str) -> Self {
        JobMetrics {
            name: name.to_string(),
            job_id: job_id.to_string(),
            records_in: AtomicU64::new(0),
            records_out: AtomicU64::new(0),
            checkpoints_completed: AtomicU64::new(0),
            checkpoints_failed: AtomicU64::new(0),
            checkpoint_duration_ms_sum: AtomicU64::new(0),
            last_checkpoint_duration_ms: AtomicU64::new(0),
            last_checkpoint_bytes: AtomicU64::new(0),
            alignment_ms: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
            injected_faults: AtomicU64::new(0),
            late_records: AtomicU64::new(0),
            status: Mutex::new(StatusBoard {
                state: JobState::Starting,
                history: VecDeque::new(),
                savepoints: BTreeMap::new(),
                last_error: None,
                restored_from: None,
                epoch: 0,
                notices: Vec::new(),
            }),
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
            self.checkpoints_completed.fetch_add(1, Ordering::Relaxed);
            let d = info.duration_ms.unwrap_or(0);
            self.checkpoint_duration_ms_sum.fetch_add(d, Ordering::Relaxed);
            self.last_checkpoint_duration_ms.store(d, Ordering::Relaxed);
            self.last_checkpoint_bytes.store(info.bytes, Ordering::Relaxed);
        } else if info.outcome == CheckpointOutcome::Failed {
            self.checkpoints_failed.fetch_add(1, Ordering::Relaxed);
        }
        let mut board = self.board();
        if let Some(existing) = board.history.iter_mut().find(|c| c.id == info.id) {
            *existing = info;
        } else {
            board.history.push_front(info);
            board.history.truncate(HISTORY);
        }
    }

    /// The newest completed checkpoint or savepoint.
    pub fn latest_completed(&self) -> Option<CheckpointInfo> {
        self.board().history.iter().find(|c| c.outcome == CheckpointOutcome::Completed).cloned()
    }

    /// Prometheus text exposition.
    pub fn render_prometheus(&self) -> String {
        let mut out = String::new();
        let job = &self.name;
        let mut counter = |name: &str, help: &str, kind: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{job=\"{job}\"}} {v}");
        };
        counter(
            "weir_records_in_total",
            "Records read by sources.",
            "counter",
            self.records_in.load(Ordering::Relaxed),
        );
        counter(
            "weir_records_out_total",
            "Records written by sinks.",
            "counter",
            self.records_out.load(Ordering::Relaxed),
        );
        counter(
            "weir_checkpoints_completed_total",
            "Completed checkpoints and savepoints.",
            "counter",
            self.checkpoints_completed.load(Ordering::Relaxed),
        );
        counter(
            "weir_checkpoints_failed_total",
            "Failed checkpoints and savepoints.",
            "counter",
            self.checkpoints_failed.load(Ordering::Relaxed),
        );
        counter(
            "weir_checkpoint_duration_ms_sum",
            "Sum of completed checkpoint durations in ms.",
            "counter",
            self.checkpoint_duration_ms_sum.load(Ordering::Relaxed),
        );
        counter(
            "weir_last_checkpoint_duration_ms",
            "Duration of the newest completed checkpoint in ms.",
            "gauge",
            self.last_checkpoint_duration_ms.load(Ordering::Relaxed),
        );
        counter(
            "weir_last_checkpoint_size_bytes",
            "Bytes written by the newest completed checkpoint.",
            "gauge",
            self.last_checkpoint_bytes.load(Ordering::Relaxed),
        );
        counter(
            "weir_checkpoint_alignment_ms_total",
            "Time tasks spent aligning barriers in ms.",
            "counter",
            self.alignment_ms.load(Ordering::Relaxed),
        );
        counter(
            "weir_restarts_total",
            "In-process restarts from the newest checkpoint.",
            "counter",
            self.restarts.load(Ordering::Relaxed),
        );
        counter(
            "weir_late_records_total",
            "Records dropped by windows as late.",
            "counter",
            self.late_records.load(Ordering::Relaxed),
        );
        counter(
            "weir_injected_faults_total",
            "Faults injected by the test hook.",
            "counter",
            self.injected_faults.load(Ordering::Relaxed),
        );
        out
    }
}
