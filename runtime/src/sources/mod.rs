//! Sources: where records enter a job. A source subtask reads its assigned splits and keeps
//! its positions in checkpoints; on restore, the union of every subtask's positions is
//! redistributed over the new parallelism.

use std::time::Duration;

use crate::operator::TaskError;
use crate::value::Record;

pub mod file;
pub mod generator;
#[cfg(feature = "kafka")]
pub mod kafka;

/// What a poll produced.
#[derive(Debug, PartialEq, Eq)]
pub enum SourcePoll {
    /// Records were appended.
    Data,
    /// Nothing now (rate limit); ask again after this long.
    Idle(Duration),
    /// All assigned input was read.
    Finished,
}

/// A source subtask.
pub trait Source: Send {
    /// Appends up to `max` records to `out`.
    fn poll(&mut self, out: &mut Vec<Record>, max: usize) -> Result<SourcePoll, TaskError>;
    /// The event time below which no further record will come.
    fn watermark(&self) -> i64;
    /// The positions document for checkpoint `checkpoint`.
    fn snapshot(&mut self, checkpoint: u64) -> Vec<u8>;
    /// Checkpoint `checkpoint` completed (its positions are durable).
    fn on_checkpoint_complete(&mut self, _checkpoint: u64) {}
}
