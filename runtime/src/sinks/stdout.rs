//! The `stdout` sink (JSON lines; at-least-once across restarts) and the `blackhole` sink
//! (counts and discards, for benchmarks).

use std::io::Write;
use std::sync::Arc;

use crate::metrics::JobMetrics;
use crate::operator::{Operator, TaskError};
use crate::value::{write_json_line, Record};

/// Prints records as JSON lines.
pub struct StdoutSink {
    schema: Vec<String>,
    metrics: Arc<JobMetrics>,
    buf: Vec<u8>,
}

impl StdoutSink {
    /// A sink for records of `schema`.
    pub fn new(schema: Vec<String>, metrics: Arc<JobMetrics>) -> Self {
        StdoutSink { schema, metrics, buf: Vec::new() }
    }
}

impl Operator for StdoutSink {
    fn process(&mut self, batch: Vec<Record>, _out: &mut Vec<Record>) -> Result<(), TaskError> {
        self.buf.clear();
        for r in &batch {
            write_json_line(&self.schema, r, &mut self.buf);
        }
        let mut stdout = std::io::stdout().lock();
        // A closed stdout (e.g. `| head`) ends the job like any other sink failure.
        stdout.write_all(&self.buf).map_err(|e| TaskError::Commit { what: "stdout".into(), reason: e.to_string() })?;
        self.metrics.records_out.inc_by(batch.len() as u64);
        Ok(())
    }
}

/// Counts and drops records.
pub struct BlackholeSink {
    metrics: Arc<JobMetrics>,
}

impl BlackholeSink {
    /// A discarding sink.
    pub fn new(metrics: Arc<JobMetrics>) -> Self {
        BlackholeSink { metrics }
    }
}

impl Operator for BlackholeSink {
    fn process(&mut self, batch: Vec<Record>, _out: &mut Vec<Record>) -> Result<(), TaskError> {
        self.metrics.records_out.inc_by(batch.len() as u64);
        Ok(())
    }
}
