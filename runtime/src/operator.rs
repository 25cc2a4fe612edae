//! The operator contract: what every element of a task's chain implements.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use bytes::Bytes;
use weir_checkpoint::Storage;

use crate::message::Barrier;
use crate::sinks::file::Committable;
use crate::state::KeyedSnapshot;
use crate::value::Record;

/// Why a task failed.
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    /// A CEL expression failed on a record.
    #[error(transparent)]
    Expr(#[from] crate::expr::ExprError),
    /// A source could not read.
    #[error("reading {what}: {reason}")]
    Read {
        /// What was read.
        what: String,
        /// Why it failed.
        reason: String,
    },
    /// A sink could not commit.
    #[error("committing {what}: {reason}")]
    Commit {
        /// What was committed.
        what: String,
        /// Why it failed.
        reason: String,
    },
    /// Restored state could not be used.
    #[error("restoring state of `{uid}`: {reason}")]
    Restore {
        /// Operator uid.
        uid: String,
        /// Why.
        reason: String,
    },
    /// The keyed state's store failed (rocksdb backend: local disk).
    #[error("keyed state of `{uid}`: {source}")]
    State {
        /// Operator uid.
        uid: String,
        /// The store's error.
        source: crate::state::StoreError,
    },
    /// A channel closed: the job is being torn down.
    #[error("job is shutting down")]
    Shutdown,
}

/// Data a sink must have durably staged before its checkpoint is acknowledged.
#[derive(Clone)]
pub struct StagedWrite {
    /// Where.
    pub storage: Storage,
    /// Path under `storage`.
    pub path: String,
    /// What.
    pub data: Bytes,
}

/// An operator's synchronous snapshot, handed to the uploader.
#[derive(Default)]
pub struct StateParts {
    /// Non-keyed state document (source positions, pending transactions).
    pub operator_doc: Option<Vec<u8>>,
    /// Keyed state, encoded.
    pub keyed: Option<KeyedSnapshot>,
    /// The keyed state's "next snapshot must be full" flag (raised when an upload fails).
    pub force_full: Option<Arc<AtomicBool>>,
    /// Sink data to stage first.
    pub staged: Vec<StagedWrite>,
    /// (Sinks) every transaction pre-committed and not yet committed, as of this barrier: what
    /// the completion of this checkpoint will commit.
    pub pending_commits: Vec<Committable>,
}

/// One element of a task's chain.
pub trait Operator: Send {
    /// Processes a batch, appending results to `out`.
    fn process(&mut self, batch: Vec<Record>, out: &mut Vec<Record>) -> Result<(), TaskError>;

    /// Event time advanced to `watermark`; fire what is due into `out`.
    fn on_watermark(&mut self, _watermark: i64, _out: &mut Vec<Record>) -> Result<(), TaskError> {
        Ok(())
    }

    /// Takes the synchronous part of a snapshot for `barrier`.
    fn snapshot(&mut self, _barrier: &Barrier) -> Result<StateParts, TaskError> {
        Ok(StateParts::default())
    }

    /// Checkpoint `id` completed (or a savepoint `id` that stops the job): commit what it
    /// covers and return the transactions committed now.
    fn on_checkpoint_complete(&mut self, _id: u64) -> Result<Vec<Committable>, TaskError> {
        Ok(Vec::new())
    }

    /// All input was processed and the job is finishing: deliver what is buffered outside
    /// checkpoints (an at-least-once sink flushes), failing if it cannot.
    fn end_of_input(&mut self) -> Result<(), TaskError> {
        Ok(())
    }

    /// Whether the operator still holds work that a future checkpoint completion will commit.
    fn has_uncommitted(&self) -> bool {
        false
    }
}

/// A chain element with its identity.
pub struct ChainedOperator {
    /// State uid (stateful operators).
    pub uid: Option<String>,
    /// The operator.
    pub op: Box<dyn Operator>,
}
