//! Weir's stream engine: a job graph of sources, operators and sinks, run as parallel tasks in
//! one process with bounded channels, checkpointed by asynchronous barrier snapshots, restored
//! by operator uid, and written out exactly once by two-phase commit.

pub mod compact;
pub mod control;
pub mod executor;
pub mod expr;
pub mod faults;
#[cfg(feature = "kafka")]
pub mod kafka;
pub mod malloc;
pub mod memory_limit;
pub mod message;
pub mod metrics;
pub mod operator;
pub mod operators;
pub mod plan;
pub mod prefetch;
pub mod restore;
pub mod sinks;
pub mod sources;
pub mod state;
pub mod task;
pub mod upload;
pub mod value;
pub mod wiring;

use std::sync::OnceLock;

/// The process-wide runtime for storage I/O (object_store is async); task threads block on it.
pub fn io() -> &'static tokio::runtime::Runtime {
    static IO: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    IO.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("weir-io")
            .enable_all()
            .build()
            .expect("the I/O runtime starts")
    })
}

/// Parses and validates a job file, naming the field path of every problem, including CEL
/// expressions that do not compile.
pub fn load_job(text: &str) -> Result<weir_crds::ValidatedJob, String> {
    let spec = weir_crds::JobSpec::from_yaml(text).map_err(|e| e.to_string())?;
    weir_crds::validate(&spec).map_err(|e| e.to_string())
}
