//! The runtime's control API (HTTP/JSON on the coordinator): requests and responses shared by
//! the runtime that serves it and the operator that calls it.

use serde::{Deserialize, Serialize};

/// Lifecycle state of a running job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum JobState {
    /// Restoring state and starting tasks.
    Starting,
    /// Processing records.
    Running,
    /// A task failed; the job is restarting from the newest complete checkpoint.
    Restarting,
    /// Taking a final savepoint before stopping.
    Stopping,
    /// Bounded input ended and everything was committed.
    Finished,
    /// Stopped with a savepoint.
    Stopped,
    /// Cancelled without a savepoint.
    Cancelled,
    /// Failed for good (restart attempts exhausted).
    Failed,
}

/// `GET /v1/job`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JobStatus {
    /// Job name.
    pub name: String,
    /// Identifier of this run (changes when the process starts).
    pub job_id: String,
    /// Lifecycle state.
    pub state: JobState,
    /// In-process restarts so far.
    pub restarts: u32,
    /// Records read by the sources.
    pub records_in: u64,
    /// Records written by the sinks.
    pub records_out: u64,
    /// The newest complete checkpoint, if any.
    pub latest_checkpoint: Option<CheckpointInfo>,
    /// What the job was restored from at start, if anything.
    pub restored_from: Option<String>,
    /// The fencing epoch of the running attempt: it grows with every start of the job.
    #[serde(default)]
    pub epoch: u64,
    /// Things this run did that a person should know of, e.g. output moved under
    /// `_superseded/` because it restored an older point than the output had reached.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notices: Vec<String>,
    /// The last failure, if any.
    pub last_error: Option<String>,
    /// Faults injected by the test hook so far (0 in production).
    pub injected_faults: u64,
}

/// Whether a checkpoint is a periodic checkpoint or a savepoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CheckpointKind {
    /// Periodic, may be incremental, deleted by retention.
    Checkpoint,
    /// Full, self-contained, never deleted by the runtime.
    Savepoint,
}

/// Outcome of a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CheckpointOutcome {
    /// Still being taken.
    InProgress,
    /// Metadata written; the checkpoint can be restored.
    Completed,
    /// Aborted (timeout, decline, failed upload).
    Failed,
}

/// One checkpoint or savepoint in the history.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointInfo {
    /// Checkpoint id (ids of checkpoints and savepoints share one counter).
    pub id: u64,
    /// Checkpoint or savepoint.
    pub kind: CheckpointKind,
    /// Outcome.
    pub outcome: CheckpointOutcome,
    /// Storage path of the checkpoint directory (for savepoints: what to restore from).
    pub path: String,
    /// Trigger time, milliseconds since the Unix epoch.
    pub triggered_at_ms: u64,
    /// Duration from trigger to completion or failure.
    pub duration_ms: Option<u64>,
    /// Bytes of state written for this checkpoint.
    pub bytes: u64,
    /// Why it failed.
    pub failure: Option<String>,
}

/// `GET /v1/checkpoints`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointHistory {
    /// Newest first, bounded.
    pub checkpoints: Vec<CheckpointInfo>,
    /// Completed checkpoints so far in this process.
    pub completed: u64,
    /// Failed checkpoints so far in this process.
    pub failed: u64,
}

/// `POST /v1/savepoints` and `POST /v1/stop`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SavepointRequest {
    /// Flush all windows (watermark to the end of time) before the savepoint; only with stop.
    #[serde(default)]
    pub drain: bool,
    /// Answer only when the savepoint has completed or failed (instead of at once with 202).
    #[serde(default)]
    pub wait: bool,
}

/// Answer to a savepoint or stop request: poll `GET /v1/savepoints/{requestId}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SavepointStatus {
    /// Request id.
    pub request_id: u64,
    /// Pending, completed or failed.
    pub outcome: CheckpointOutcome,
    /// The savepoint's path when completed.
    pub path: Option<String>,
    /// Why it failed.
    pub failure: Option<String>,
}

/// Error body of every non-2xx answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ApiError {
    /// What went wrong.
    pub error: String,
}
