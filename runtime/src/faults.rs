//! The fault-injection test hook. Off unless a [`FaultPlan`] is given (the CLI reads one from
//! `WEIR_FAULTS`, e.g. `seed=7,panic=0.002,upload=0.05,commit-crash=0.2,max=20`). Every
//! injected fault is counted in the job's metrics; `upload-delay=<ms>` (slow storage) is not a
//! fault and is not counted. `stop-before-metadata=<id>` and `stop-before-commit=<id>` are
//! not random: the process stops itself (SIGSTOP) at that point of checkpoint `<id>`, after
//! its fence check and before the write it guards, for a test to start a successor and wake it
//! (SIGCONT) later.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::metrics::JobMetrics;
use crate::value::mix64;

/// Probabilities of each fault, and a budget.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FaultPlan {
    /// Seed of the deterministic random stream.
    pub seed: u64,
    /// Per processed batch: the task panics.
    pub task_panic: f64,
    /// Per state or staged upload: it fails.
    pub upload_failure: f64,
    /// Per completed checkpoint: the job fails after `_metadata` is written and before any sink
    /// commits (in-process restart).
    pub crash_before_commit: f64,
    /// Per completed checkpoint: the process aborts at that same point.
    pub abort_before_commit: f64,
    /// Per savepoint: it fails (the upload of its state is refused).
    pub savepoint_failure: f64,
    /// Per Kafka transaction: the process aborts after sending its records and marker, before
    /// committing it.
    pub abort_in_transaction: f64,
    /// Per Kafka transaction: the process aborts right after committing it, before the task
    /// reports the commit.
    pub abort_after_transaction: f64,
    /// Per Kafka transaction: it stalls, open, for longer than its transaction timeout, so
    /// that the broker aborts it.
    pub stall_in_transaction: f64,
    /// Most faults injected in total (0 = no limit).
    pub max_faults: u64,
    /// Every upload of a subtask's keyed state waits this long first, as on a slow store.
    pub upload_delay_ms: u64,
    /// The process stops itself once checkpoint `id` passed its fence check, before its
    /// `_metadata` is written.
    pub stop_before_metadata: Option<u64>,
    /// The process stops itself once checkpoint `id` passed the fence check of its commit,
    /// before any sink commits.
    pub stop_before_commit: Option<u64>,
}

impl FaultPlan {
    /// Parses `key=value` pairs separated by commas.
    pub fn parse(text: &str) -> Result<FaultPlan, String> {
        let mut plan = FaultPlan::default();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| format!("`{part}`: expected key=value"))?;
            let num = |v: &str| v.parse::<f64>().map_err(|_| format!("`{part}`: not a number"));
            match k {
                "seed" => plan.seed = v.parse().map_err(|_| format!("`{part}`: not an integer"))?,
                "panic" => plan.task_panic = num(v)?,
                "upload" => plan.upload_failure = num(v)?,
                "commit-crash" => plan.crash_before_commit = num(v)?,
                "commit-abort" => plan.abort_before_commit = num(v)?,
                "savepoint" => plan.savepoint_failure = num(v)?,
                "txn-abort-open" => plan.abort_in_transaction = num(v)?,
                "txn-abort-committed" => plan.abort_after_transaction = num(v)?,
                "txn-stall" => plan.stall_in_transaction = num(v)?,
                "max" => plan.max_faults = v.parse().map_err(|_| format!("`{part}`: not an integer"))?,
                "stop-before-metadata" => {
                    plan.stop_before_metadata = Some(v.parse().map_err(|_| format!("`{part}`: not a checkpoint id"))?)
                }
                "stop-before-commit" => {
                    plan.stop_before_commit = Some(v.parse().map_err(|_| format!("`{part}`: not a checkpoint id"))?)
                }
                "upload-delay" => {
                    plan.upload_delay_ms = v.parse().map_err(|_| format!("`{part}`: not a number of milliseconds"))?
                }
                other => {
                    return Err(format!(
                        "unknown fault `{other}` (panic, upload, commit-crash, commit-abort, savepoint, \
                         txn-abort-open, txn-abort-committed, txn-stall, seed, max, upload-delay, \
                         stop-before-metadata, stop-before-commit)"
                    ))
                }
            }
        }
        Ok(plan)
    }
}

/// Decides, deterministically per seed, whether a fault fires now.
#[derive(Clone, Debug)]
pub struct Faults {
    plan: Option<Arc<FaultPlan>>,
    draws: Arc<AtomicU64>,
    metrics: Arc<JobMetrics>,
}

/// Where [`Faults::stop_at`] may stop the process: each right after a fence check, before
/// the write that check guards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopPoint {
    /// Before a checkpoint's `_metadata` is written.
    BeforeMetadata,
    /// Before the sinks commit a completed checkpoint.
    BeforeCommit,
}

/// Kinds of fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// A task panics.
    TaskPanic,
    /// An upload fails.
    Upload,
    /// The job fails between checkpoint completion and commit.
    CrashBeforeCommit,
    /// The process aborts between checkpoint completion and commit.
    AbortBeforeCommit,
    /// A savepoint fails.
    Savepoint,
    /// The process aborts inside a Kafka transaction.
    AbortInTransaction,
    /// The process aborts after a Kafka transaction committed.
    AbortAfterTransaction,
    /// A Kafka transaction stalls past its timeout.
    StallInTransaction,
}

impl Faults {
    /// No faults.
    pub fn none(metrics: Arc<JobMetrics>) -> Self {
        Faults { plan: None, draws: Arc::new(AtomicU64::new(0)), metrics }
    }

    /// Faults from a plan.
    pub fn new(plan: Option<FaultPlan>, metrics: Arc<JobMetrics>) -> Self {
        Faults { plan: plan.map(Arc::new), draws: Arc::new(AtomicU64::new(0)), metrics }
    }

    /// How long each upload of keyed state waits first ([`FaultPlan::upload_delay_ms`]).
    pub fn upload_delay(&self) -> Option<std::time::Duration> {
        let ms = self.plan.as_ref()?.upload_delay_ms;
        (ms > 0).then(|| std::time::Duration::from_millis(ms))
    }

    /// Stops this process (SIGSTOP) when the plan says to stop at `point` of checkpoint `id`;
    /// it goes on when woken (SIGCONT).
    pub fn stop_at(&self, point: StopPoint, id: u64) {
        let Some(plan) = &self.plan else { return };
        let at = match point {
            StopPoint::BeforeMetadata => plan.stop_before_metadata,
            StopPoint::BeforeCommit => plan.stop_before_commit,
        };
        if at == Some(id) {
            tracing::warn!(checkpoint = id, ?point, "injected stop: stopping this process until it is woken");
            // kill(1) rather than raise(3): no unsafe code for a test hook.
            let pid = std::process::id().to_string();
            if let Err(e) = std::process::Command::new("kill").args(["-STOP", &pid]).status() {
                tracing::error!(error = %e, "the injected stop failed: going on");
            }
        }
    }

    /// Whether `fault` fires now (and counts it when it does).
    pub fn fires(&self, fault: Fault) -> bool {
        let Some(plan) = &self.plan else { return false };
        let p = match fault {
            Fault::TaskPanic => plan.task_panic,
            Fault::Upload => plan.upload_failure,
            Fault::CrashBeforeCommit => plan.crash_before_commit,
            Fault::AbortBeforeCommit => plan.abort_before_commit,
            Fault::Savepoint => plan.savepoint_failure,
            Fault::AbortInTransaction => plan.abort_in_transaction,
            Fault::AbortAfterTransaction => plan.abort_after_transaction,
            Fault::StallInTransaction => plan.stall_in_transaction,
        };
        if p <= 0.0 {
            return false;
        }
        if plan.max_faults > 0 && self.metrics.injected_faults.get() >= plan.max_faults {
            return false;
        }
        let draw = self.draws.fetch_add(1, Ordering::Relaxed);
        let x = (mix64(plan.seed ^ mix64(draw.wrapping_add(fault as u64 * 0x1000_0000))) >> 11) as f64
            / (1u64 << 53) as f64;
        if x < p {
            self.metrics.injected_faults.inc_by(1);
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_respects_the_budget() {
        let plan = FaultPlan::parse("seed=3, panic=1, max=2").unwrap();
        assert_eq!(plan.task_panic, 1.0);
        let m = Arc::new(JobMetrics::new("j", "id"));
        let f = Faults::new(Some(plan), m.clone());
        assert!(f.fires(Fault::TaskPanic));
        assert!(f.fires(Fault::TaskPanic));
        assert!(!f.fires(Fault::TaskPanic), "budget of 2 spent");
        assert!(!f.fires(Fault::Upload), "probability 0");
        assert_eq!(m.injected_faults.get(), 2);
        assert!(FaultPlan::parse("boom=1").unwrap_err().contains("unknown fault"));
        let slow = Faults::new(Some(FaultPlan::parse("upload-delay=250").unwrap()), m.clone());
        assert_eq!(slow.upload_delay(), Some(std::time::Duration::from_millis(250)));
        assert!(!slow.fires(Fault::Upload), "a delay is not a fault");
        assert_eq!(f.upload_delay(), None);
        assert!(FaultPlan::parse("upload-delay=soon").unwrap_err().contains("milliseconds"));
    }
}
