//! Sinks: where results leave a job.

pub mod file;
#[cfg(feature = "kafka")]
pub mod kafka;
pub mod stdout;

/// Committables of Kafka sinks carry `kafka://<topic>` instead of a storage URL.
pub const KAFKA_SINK_SCHEME: &str = "kafka://";

/// Whether a committable belongs to a Kafka sink (it has no commit manifest).
pub fn is_kafka(c: &file::Committable) -> bool {
    c.sink.starts_with(KAFKA_SINK_SCHEME)
}
