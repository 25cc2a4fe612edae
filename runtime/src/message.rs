//! What flows between tasks (records, watermarks, barriers), from the coordinator to tasks
//! (triggers, completion notices), and from tasks back to the coordinator (acks, failures).

use weir_checkpoint::protocol::TaskId;
use weir_checkpoint::SubtaskSnapshot;

use crate::sinks::file::Committable;
use crate::value::Record;

/// Where a barrier's snapshot goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SnapshotTarget {
    /// A periodic checkpoint under `checkpoints/chk-<id>`.
    Checkpoint,
    /// A savepoint in this directory (relative to the job root).
    Savepoint {
        /// e.g. `savepoints/sp-<time>-<id>`.
        dir: String,
    },
}

/// Checkpoint barrier N, travelling in-band between batches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Barrier {
    /// Checkpoint id.
    pub id: u64,
    /// Checkpoint or savepoint.
    pub target: SnapshotTarget,
}

impl Barrier {
    /// Whether this is a savepoint barrier.
    pub fn is_savepoint(&self) -> bool {
        matches!(self.target, SnapshotTarget::Savepoint { .. })
    }
}

/// A message on a data channel.
#[derive(Debug)]
pub enum Message {
    /// A batch of records.
    Records(Vec<Record>),
    /// Event time progress: no record with a smaller time follows on this channel.
    Watermark(i64),
    /// Checkpoint barrier.
    Barrier(Barrier),
    /// The upstream subtask finished.
    End,
}

/// The coordinator's instructions to a task.
#[derive(Clone, Debug)]
pub enum TaskControl {
    /// (Sources) snapshot positions and emit this barrier. `stop`: pause afterwards until
    /// `Finish` or `Abort`; `drain`: advance event time to the end first.
    Trigger {
        /// The barrier to emit.
        barrier: Barrier,
        /// Pause after the barrier (stop-with-savepoint or final checkpoint).
        stop: bool,
        /// Flush windows first.
        drain: bool,
    },
    /// (Sources) the stop or final snapshot completed: end the stream.
    Finish,
    /// Checkpoint `id` completed: commit what it covers.
    Complete(u64),
    /// Checkpoint `id` was abandoned (sources paused for it resume).
    Abort(u64),
    /// Tear down now.
    Cancel,
}

/// One operator's part of a task's acknowledgement.
#[derive(Clone, Debug, PartialEq)]
pub struct OperatorAck {
    /// Operator uid.
    pub uid: String,
    /// Parallelism of the operator.
    pub parallelism: u32,
    /// What this subtask wrote.
    pub snapshot: SubtaskSnapshot,
}

/// A task's acknowledgement of checkpoint N.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct TaskAck {
    /// Per stateful operator of the task's chain.
    pub operators: Vec<OperatorAck>,
    /// Bytes written.
    pub bytes: u64,
    /// Time spent aligning barriers, ms.
    pub alignment_ms: u64,
    /// Transactions of the task's sinks that this checkpoint's completion commits.
    pub pending_commits: Vec<Committable>,
}

/// What tasks and uploaders tell the coordinator.
#[derive(Debug)]
pub enum Event {
    /// Snapshot N of a task is durable.
    Ack {
        /// Checkpoint id.
        id: u64,
        /// Which task.
        task: TaskId,
        /// The handles.
        ack: TaskAck,
    },
    /// A task could not take or upload snapshot N.
    Decline {
        /// Checkpoint id.
        id: u64,
        /// Which task.
        task: TaskId,
        /// Why.
        reason: String,
    },
    /// A source read all its input (and emitted the end-of-time watermark).
    SourceFinished {
        /// Which task.
        task: TaskId,
    },
    /// A task committed these transactions on a checkpoint's completion.
    Committed {
        /// Which task.
        task: TaskId,
        /// What it committed.
        committed: Vec<Committable>,
    },
    /// A task ended normally.
    TaskFinished {
        /// Which task.
        task: TaskId,
    },
    /// A task failed (error or panic).
    TaskFailed {
        /// Which task.
        task: TaskId,
        /// Why.
        error: String,
    },
}
