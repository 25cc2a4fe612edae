//! Sinks: where results leave a job.

pub mod file;
pub mod stdout;
