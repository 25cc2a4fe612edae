//! Sinks: where results leave a job.

pub mod file;
#[cfg(feature = "kafka")]
pub mod kafka;
pub mod stdout;
