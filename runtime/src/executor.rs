//! Runs a job: restores state, recovers sinks, starts the tasks, drives the checkpoint
//! coordinator, and restarts everything from the newest complete checkpoint when a task fails.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{bounded, unbounded, Receiver, RecvTimeoutError, Sender};
use weir_checkpoint::protocol::{timeout_scale_after, Action, Coordinator, CoordinatorConfig, TaskId, TriggerKind};
use weir_checkpoint::{
    epoch, layout, recovery, retention, CheckpointMetadata, OperatorSnapshot, SnapshotKind, Storage,
};
use weir_crds::control::{CheckpointInfo, CheckpointKind, CheckpointOutcome, JobState, SavepointStatus};
use weir_crds::job::{RestartStrategyKind, RetentionOnCancel, StateBackendKind};
use weir_crds::validate::{NodeKind, ValidatedJob};

use crate::faults::{Fault, FaultPlan, Faults, StopPoint};
use crate::message::{Barrier, Event, SnapshotTarget, TaskAck, TaskControl};
use crate::metrics::JobMetrics;
use crate::operator::{ChainedOperator, Operator, TaskError};
use crate::operators::keyed::{aggregate_operator, dedupe_operator, KeyedContext};
use crate::operators::stateless::{FilterOperator, FlatMapOperator, MapOperator};
use crate::operators::window::WindowOperator;
use crate::plan::{self, Vertex};
use crate::restore::{newest_valid, open_path, KeyedFilesIn, RestoreError, RestoredState};
use crate::sinks;
use crate::sinks::file::{CommitGroup, Committable, FileSink};
use crate::sinks::stdout::{BlackholeSink, StdoutSink};
use crate::sources::file::FileSource;
use crate::sources::generator::GeneratorSource;
use crate::sources::Source;
use crate::state::StoreSettings;
use crate::task::{Head, Output, Task, TaskEnd};
use crate::value::{IntKey, Key, PackedKey};

/// Capacity of a data channel, in batches: the backpressure window.
const CHANNEL_CAPACITY: usize = 8;
/// How often the coordinator wakes up when nothing happens.
const TICK: Duration = Duration::from_millis(5);

/// A staging file (an object being written, before its rename) that nobody wrote for this long
/// was left by a writer killed mid-write ([`Storage::discard_abandoned_staging`]).
const STAGING_IDLE: Duration = Duration::from_secs(120);

/// How often a run looks for such files, in its checkpoint storage and its file sinks' output
/// directories (with a retention pass; the first pass looks).
const STAGING_SWEEP_EVERY: Duration = Duration::from_secs(300);

/// What to restore from at start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RestoreRequest {
    /// The newest valid checkpoint under the job's checkpoint storage (none: start fresh).
    Latest,
    /// A checkpoint (`.../checkpoints/chk-N`) or savepoint directory.
    Path(String),
}

/// How to run a job.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Storage root of this job's checkpoints and savepoints (overrides the job file).
    pub checkpoint_dir: Option<String>,
    /// What to restore from.
    pub restore: Option<RestoreRequest>,
    /// Accept a snapshot holding state of uids the job no longer has.
    pub allow_non_restored_state: bool,
    /// Start without state although the storage root holds checkpoints or savepoints (they
    /// are kept; the job's earlier output is kept too). Without `restore` or `fresh`, such a
    /// start is refused.
    pub fresh: bool,
    /// Who this run is, written into its epoch claim (e.g. host and pid).
    pub holder: Option<String>,
    /// Test hook.
    pub faults: Option<FaultPlan>,
    /// Most bytes of keyed state files the heap backend holds in memory: a restore's files (a
    /// larger restore reads them in parts from local files), and each keyed subtask's share of
    /// it, at most 64 MiB, for a full image it writes (a larger one goes to a local file).
    /// `None`: a quarter of the memory the process may use, [`default_state_files_in_memory_max`].
    pub state_files_in_memory_max: Option<u64>,
}

/// A quarter of the memory this process may use ([`crate::memory_limit::process_memory_limit`]):
/// the most bytes of keyed state files the heap backend holds in memory by default. A
/// restore's files in memory are applied on every core, but stay there next to the state they
/// fill until it is built; a full image in memory stays next to the state it was taken of
/// until it is uploaded. A job whose state fits in its limit must restore and checkpoint
/// within it too.
pub fn default_state_files_in_memory_max() -> u64 {
    crate::memory_limit::process_memory_limit().map_or(u64::MAX, |limit| limit / 4)
}

/// An instruction from the control API.
#[derive(Debug)]
pub enum Request {
    /// Take a savepoint (and stop the job when `stop`); the request id is sent back.
    Savepoint {
        /// Stop after it.
        stop: bool,
        /// Flush windows first (with stop).
        drain: bool,
        /// Where to send the request id.
        reply: tokio::sync::oneshot::Sender<u64>,
    },
    /// Cancel without a savepoint.
    Cancel,
}

/// How a job ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobOutcome {
    /// Bounded input ended; everything committed.
    Finished,
    /// Stopped with a savepoint at this path.
    Stopped {
        /// The savepoint.
        savepoint: String,
    },
    /// Cancelled.
    Cancelled,
}

/// Why a job could not run or failed for good.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The checkpoint storage could not be opened.
    #[error("checkpoint storage: {0}")]
    Storage(#[from] weir_checkpoint::StorageError),
    /// The requested snapshot could not be restored.
    #[error(transparent)]
    Restore(#[from] RestoreError),
    /// The storage root holds state and neither a restore nor a fresh start was asked for.
    #[error(
        "{root} already holds this job's state (newest restore point: {newest}); pass --restore latest to continue \
         from it, or --fresh to start without state (earlier output and snapshots are kept)"
    )]
    ExistingState {
        /// The storage root.
        root: String,
        /// The newest complete checkpoint or savepoint.
        newest: String,
    },
    /// A newer run of this job claimed a newer epoch: this one stopped without writing more.
    #[error(transparent)]
    Fenced(weir_checkpoint::epoch::EpochError),
    /// No epoch could be claimed (storage failed, or other starts kept taking the next one).
    #[error("claiming an epoch: {0}")]
    Claim(weir_checkpoint::epoch::EpochError),
    /// The job uses a connector this build of the runtime leaves out.
    #[error("{path}: this weir-runtime was built without its `{feature}` feature (rebuild with --features {feature})")]
    MissingFeature {
        /// The node using it.
        path: String,
        /// The cargo feature.
        feature: &'static str,
    },
    /// The job failed and its restart strategy gave up.
    #[error("job failed after {restarts} restart(s): {reason}")]
    Failed {
        /// The last failure.
        reason: String,
        /// Restarts made.
        restarts: u32,
    },
}

/// The storage root a job uses: the override, the job file's, or `./.weir/<job>`.
pub fn storage_url(job: &ValidatedJob, opts: &RunOptions) -> String {
    opts.checkpoint_dir
        .clone()
        .or_else(|| job.spec.checkpointing.storage.clone())
        .unwrap_or_else(|| format!(".weir/{}", job.spec.name))
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

enum AttemptEnd {
    Done(JobOutcome),
    Failed(String),
    /// A newer run holds the epoch: stop at once, write nothing more.
    Fenced(weir_checkpoint::epoch::EpochError),
}

struct Running {
    tasks: Vec<JoinHandle<()>>,
    uploaders: Vec<JoinHandle<()>>,
    controls: Vec<Sender<TaskControl>>,
    source_tasks: Vec<TaskId>,
    /// State stores of this attempt still bringing in a lazy restore's state: checkpoints
    /// wait until it is all in and verified ([`Coordinator::hold_checkpoints`]).
    restores_loading: Arc<std::sync::atomic::AtomicUsize>,
}

impl Running {
    fn send_all(&self, msg: &TaskControl) {
        for c in &self.controls {
            let _ = c.send(msg.clone());
        }
    }

    fn send_sources(&self, msg: &TaskControl) {
        for t in &self.source_tasks {
            let _ = self.controls[*t as usize].send(msg.clone());
        }
    }

    fn stop(self) {
        self.send_all(&TaskControl::Cancel);
        drop(self.controls);
        for t in self.tasks {
            let _ = t.join();
        }
        for u in self.uploaders {
            let _ = u.join();
        }
    }
}

/// The first part of `job` that this build of the runtime leaves out (a cargo feature that was
/// off), as the error a run of it fails with.
pub fn missing_feature(job: &ValidatedJob) -> Option<JobError> {
    if !cfg!(feature = "kafka") {
        if let Some(n) = job.nodes.iter().find(|n| matches!(n.kind, NodeKind::KafkaSource(_) | NodeKind::KafkaSink(_)))
        {
            return Some(JobError::MissingFeature { path: n.path.clone(), feature: "kafka" });
        }
    }
    if !cfg!(feature = "rocksdb") && job.spec.state_backend == StateBackendKind::Rocksdb {
        return Some(JobError::MissingFeature { path: "stateBackend".into(), feature: "rocksdb" });
    }
    None
}

/// Runs a job to its end.
pub fn run_job(
    job: &ValidatedJob,
    opts: &RunOptions,
    metrics: Arc<JobMetrics>,
    requests: Receiver<Request>,
) -> Result<JobOutcome, JobError> {
    if let Some(missing) = missing_feature(job) {
        return Err(missing);
    }
    if job.spec.state_backend == StateBackendKind::Rocksdb {
        // The on-disk backend bounds the process's memory by the cache it is given: that holds
        // only if memory freed is given back.
        crate::malloc::keep_returning_free_memory();
    } else {
        // The heap backend's maps free a table each time they grow: its memory serves the next.
        crate::malloc::keep_freed_memory_for_reuse();
    }
    let storage = Storage::open(&storage_url(job, opts))?;
    let faults = Faults::new(opts.faults.clone(), metrics.clone());
    let mut exec = Executor {
        job,
        opts,
        storage,
        metrics: metrics.clone(),
        faults,
        requests,
        next_id: 1,
        next_request: 1,
        savepoint_requests: HashMap::new(),
        retention_running: Arc::default(),
        staging_swept_at: Default::default(),
        known_corrupt: Default::default(),
        pending_files: Default::default(),
        epoch: 0,
        commits: CommitTracker::default(),
        file_sinks: job
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(node, n)| match (&n.kind, &n.uid) {
                (NodeKind::FileSink(f), Some(uid)) => {
                    Some(Storage::open(&f.path).map(|storage| FileSinkDir { node, uid: uid.clone(), storage }))
                }
                _ => None,
            })
            .collect::<Result<_, _>>()?,
        checkpoint_timeout_scale: 1,
    };
    // The epoch is claimed before the restore point is chosen: from here on the previous run
    // (if it still runs) is fenced, so nothing it writes while this one lists and loads can
    // enter the history this one continues.
    // A start that will be refused (the root holds state and neither a restore nor a fresh
    // start was asked for) claims nothing: it must not fence a run of the job already going.
    exec.refuse_existing_state()?;
    exec.claim_epoch().map_err(JobError::Claim)?;
    let (mut restore, mut restore_reason) = exec.initial_restore()?;
    // Only where the run started from is kept: each attempt drops its state once its tasks
    // hold it (a heap restore's files are about as large as the state they fill).
    let initial = restore.as_ref().map(RunRestorePoint::of);
    let mut restarts = 0u32;
    loop {
        metrics.set_state(JobState::Starting);
        metrics.board().restored_from = restore.as_ref().map(|r| r.path.clone());
        let end = exec.attempt(restore.take(), &restore_reason);
        let failure = match &end {
            AttemptEnd::Fenced(e) => format!("the run was fenced before it completed: {e}"),
            AttemptEnd::Done(JobOutcome::Finished) => "the job finished before it completed".to_string(),
            AttemptEnd::Done(JobOutcome::Cancelled) => "the job was cancelled before it completed".to_string(),
            AttemptEnd::Done(JobOutcome::Stopped { savepoint }) => {
                format!("the job stopped with another savepoint ({savepoint}) before it completed")
            }
            AttemptEnd::Failed(reason) => format!("the job attempt failed before it completed: {reason}"),
        };
        metrics.fail_savepoints_in_progress(&failure);
        match end {
            AttemptEnd::Fenced(e) => {
                tracing::error!(error = %e, "fenced by a newer run of this job: stopping without writing more");
                metrics.board().last_error = Some(e.to_string());
                metrics.set_state(JobState::Failed);
                return Err(JobError::Fenced(e));
            }
            AttemptEnd::Done(outcome) => {
                let state = match &outcome {
                    JobOutcome::Finished => JobState::Finished,
                    JobOutcome::Stopped { .. } => JobState::Stopped,
                    JobOutcome::Cancelled => JobState::Cancelled,
                };
                exec.wait_for_retention();
                if outcome == JobOutcome::Cancelled
                    && job.spec.checkpointing.retention_on_cancel == RetentionOnCancel::Delete
                {
                    let in_flight_from = exec.next_id;
                    match crate::io().block_on(retention::delete_on_cancel(&exec.storage, exec.epoch, in_flight_from)) {
                        Ok(_) => {}
                        Err(e @ epoch::EpochError::Superseded { .. }) => {
                            metrics.set_state(JobState::Failed);
                            return Err(JobError::Fenced(e));
                        }
                        Err(epoch::EpochError::Storage(e)) => return Err(JobError::Storage(e)),
                        Err(e) => return Err(JobError::Claim(e)),
                    }
                } else {
                    // Leave storage as retention says, not as the last background pass got to. The
                    // uploaders are gone: a merge nobody adopted is nobody's to adopt.
                    let in_flight_from = exec.next_id;
                    crate::io().block_on(retention::apply(
                        &exec.storage,
                        job.spec.checkpointing.retained as usize,
                        in_flight_from,
                        exec.epoch,
                        &exec.known_corrupt.borrow(),
                        &retention::PendingFiles::default(),
                    ))?;
                }
                metrics.set_state(state);
                return Ok(outcome);
            }
            AttemptEnd::Failed(reason) => {
                tracing::warn!(%reason, "job attempt failed");
                metrics.board().last_error = Some(reason.clone());
                let r = &job.spec.restart;
                if r.strategy == RestartStrategyKind::None || restarts >= r.attempts {
                    metrics.set_state(JobState::Failed);
                    return Err(JobError::Failed { reason, restarts });
                }
                restarts += 1;
                metrics.restarts.inc();
                metrics.set_state(JobState::Restarting);
                let delay = match r.strategy {
                    RestartStrategyKind::ExponentialBackoff => {
                        let ms = r.delay.as_millis() as f64 * r.multiplier.powi(restarts as i32 - 1);
                        Duration::from_millis((ms as u64).min(r.max_delay.as_millis()))
                    }
                    _ => r.delay.0,
                };
                if let Ok(Request::Cancel) = exec.requests.recv_timeout(delay) {
                    metrics.set_state(JobState::Cancelled);
                    return Ok(JobOutcome::Cancelled);
                }
                // Restart in this process only while this run still holds the newest epoch: a
                // stale run must not claim a new one and fence its own replacement.
                if let Err(e) = crate::io().block_on(epoch::check(&exec.storage, exec.epoch)) {
                    metrics.set_state(JobState::Failed);
                    return Err(JobError::Fenced(e));
                }
                exec.claim_epoch().map_err(JobError::Claim)?;
                (restore, restore_reason) = exec.failover_restore(initial.as_ref())?;
                tracing::info!(
                    restarts,
                    from = restore.as_ref().map(|r| r.path.as_str()).unwrap_or("scratch"),
                    checkpoint_timeout_ms = exec.checkpoint_timeout_ms(),
                    "restarting job"
                );
            }
        }
    }
}

/// The checkpoint timeout of an attempt at `scale` ([`timeout_scale_after`]): the job's, times
/// `scale`, but never so long that a Kafka transaction (`transactionTimeout`, which validation
/// makes exceed `interval + timeout + restart.maxDelay` for the job's own timeout) could be
/// aborted by its broker while its checkpoint is still allowed to complete.
fn scaled_checkpoint_timeout_ms(spec: &weir_crds::JobSpec, scale: u64) -> u64 {
    let timeout = spec.checkpointing.timeout.as_millis();
    let outlived_by_transactions = spec
        .sinks
        .iter()
        .filter_map(|s| s.kafka.as_ref())
        .filter(|k| k.delivery == weir_crds::job::KafkaDelivery::ExactlyOnce)
        .map(|k| {
            k.transaction_timeout
                .as_millis()
                .saturating_sub(spec.checkpointing.interval.as_millis() + spec.restart.max_delay.as_millis() + 1)
        })
        .min()
        .unwrap_or(u64::MAX);
    timeout.saturating_mul(scale).min(outlived_by_transactions.max(timeout))
}

/// Where a run started from, without its state: what a restart in the same process needs to
/// take it again ([`Executor::failover_restore`]).
#[derive(Clone, Debug)]
struct RunRestorePoint {
    /// Its checkpoint id: a restart takes none older.
    checkpoint_id: u64,
    /// Where it is ([`RestoredState::path`]), read again when no newer one will do.
    path: String,
    /// [`RestoredState::in_job_root`], as the run's start decided it.
    in_job_root: bool,
}

impl RunRestorePoint {
    fn of(r: &RestoredState) -> RunRestorePoint {
        RunRestorePoint { checkpoint_id: r.checkpoint_id, path: r.path.clone(), in_job_root: r.in_job_root }
    }
}

struct Executor<'a> {
    job: &'a ValidatedJob,
    opts: &'a RunOptions,
    storage: Storage,
    metrics: Arc<JobMetrics>,
    faults: Faults,
    requests: Receiver<Request>,
    next_id: u64,
    next_request: u64,
    savepoint_requests: HashMap<u64, u64>,
    retention_running: Arc<std::sync::atomic::AtomicBool>,
    /// When a retention pass last looked for abandoned staging files.
    staging_swept_at: std::cell::Cell<Option<Instant>>,
    /// Checkpoints a restore of this run found corrupt: retention must not count them.
    known_corrupt: std::cell::RefCell<BTreeSet<u64>>,
    /// Files background merges wrote that no complete checkpoint lists yet: retention leaves
    /// them alone.
    pending_files: retention::PendingFiles,
    /// This attempt's fencing epoch.
    epoch: u64,
    /// Transactions committed by checkpoint completions, until their manifests are written.
    commits: CommitTracker,
    /// The job's file sinks with their output directories, opened once per run.
    file_sinks: Vec<FileSinkDir>,
    /// What the checkpoint timeout is multiplied by ([`timeout_scale_after`]): for the
    /// attempt that starts next, set as the current one completes a checkpoint or fails.
    checkpoint_timeout_scale: u64,
}

/// Deletes the abandoned staging files under each of `dirs` ([`STAGING_IDLE`]), off the async
/// threads (a walk of a large output directory takes a while); a failure is logged, and the
/// next sweep tries again.
async fn discard_abandoned_staging(dirs: Vec<Storage>) {
    let swept = tokio::task::spawn_blocking(move || {
        dirs.iter().map(|d| (d.url().to_string(), d.discard_abandoned_staging(STAGING_IDLE))).collect::<Vec<_>>()
    })
    .await;
    for (dir, result) in swept.unwrap_or_default() {
        match result {
            Ok(0) => {}
            Ok(removed) => tracing::info!(%dir, removed, "deleted staging files that writers killed mid-write left"),
            Err(e) => tracing::warn!(%dir, error = %e, "looking for abandoned staging files failed; will retry"),
        }
    }
}

/// A file sink node and its output directory.
struct FileSinkDir {
    node: usize,
    uid: String,
    storage: Storage,
}

/// Follows the transactions a completed checkpoint commits, so that the manifest of each
/// sink's checkpoint N is written once every subtask committed its part of N.
#[derive(Default)]
struct CommitTracker {
    /// What is to be committed, by manifest.
    expected: BTreeMap<CommitGroup, BTreeSet<Committable>>,
    /// What has been.
    committed: BTreeMap<CommitGroup, BTreeSet<Committable>>,
    /// Manifests written, while a lagging task's acknowledgement may still list them.
    written: BTreeSet<CommitGroup>,
}

impl CommitTracker {
    /// The completion of checkpoint `id` commits these (every sink subtask's pending list).
    fn expect(&mut self, id: u64, pending: impl IntoIterator<Item = Committable>) {
        let pending: Vec<Committable> = pending.into_iter().filter(|c| c.checkpoint <= id).collect();
        // A transaction older than every pending one was committed before this barrier: no
        // later acknowledgement lists it again, so its group need not be remembered.
        let floor = pending.iter().map(|c| c.checkpoint).min().unwrap_or(id + 1);
        self.written.retain(|g| g.checkpoint >= floor);
        for c in pending {
            let g = c.group();
            if !self.written.contains(&g) {
                self.expected.entry(g).or_default().insert(c);
            }
        }
    }

    /// A task committed these; returns the manifests of the groups now complete.
    fn committed(&mut self, done: Vec<Committable>) -> Vec<(CommitGroup, sinks::file::CommitManifest)> {
        let mut ready = Vec::new();
        for c in done {
            let g = c.group();
            if self.written.contains(&g) {
                continue;
            }
            let have = self.committed.entry(g.clone()).or_default();
            have.insert(c);
            if self.expected.get(&g).is_some_and(|want| want.is_subset(have)) {
                self.expected.remove(&g);
                let files = self.committed.remove(&g).unwrap_or_default();
                self.written.insert(g.clone());
                let manifest = sinks::file::CommitManifest::of(&g, &files);
                ready.push((g, manifest));
            }
        }
        ready
    }

    /// A new attempt: what was not committed is recovered by the sinks.
    fn reset(&mut self) {
        self.expected.clear();
        self.committed.clear();
    }
}

impl Executor<'_> {
    /// The next attempt's checkpoint timeout ([`scaled_checkpoint_timeout_ms`]).
    fn checkpoint_timeout_ms(&self) -> u64 {
        scaled_checkpoint_timeout_ms(&self.job.spec, self.checkpoint_timeout_scale)
    }

    /// Refuses a start without `--restore` on a root that already holds restore points,
    /// unless `fresh`.
    fn refuse_existing_state(&self) -> Result<(), JobError> {
        if self.opts.restore.is_some() || self.opts.fresh {
            return Ok(());
        }
        let newest = crate::io().block_on(async {
            let points = recovery::restore_points(&self.storage).await?;
            recovery::newest_complete(&self.storage, &points).await
        })?;
        match newest {
            Some(p) => Err(JobError::ExistingState {
                root: self.storage.url().to_string(),
                newest: format!("{} (id {})", self.storage.url_of(&p.dir), p.id),
            }),
            None => Ok(()),
        }
    }

    /// What the first attempt restores, and why: the request, or nothing for a fresh start.
    fn initial_restore(&mut self) -> Result<(Option<RestoredState>, String), JobError> {
        let started = std::time::Instant::now();
        let (restored, reason) = match &self.opts.restore {
            None => (None, "fresh start".to_string()),
            Some(RestoreRequest::Latest) => {
                let history = self.history()?;
                let selection =
                    crate::io().block_on(newest_valid(&self.storage, 0, &self.keyed_files_in(), history.as_ref()))?;
                self.known_corrupt.borrow_mut().extend(selection.skipped.iter().map(|s| s.id));
                for s in &selection.skipped {
                    tracing::warn!(
                        path = %s.path,
                        defect = %s.defect,
                        "skipping a restore point that cannot be restored"
                    );
                }
                for s in &selection.outside {
                    let why = &s.defect;
                    tracing::warn!(path = %s.path, %why, "skipping a restore point outside the job's history");
                }
                let reason = selection.reason();
                (selection.restored, reason)
            }
            Some(RestoreRequest::Path(p)) => {
                let (storage, found) = crate::io().block_on(open_path(p))?;
                let mut r = crate::io().block_on(RestoredState::load(&storage, &found, &self.keyed_files_in()))?;
                r.in_job_root = storage.is_same_root(&self.storage);
                let reason = format!("restored {} (id {}) on request", r.path, r.checkpoint_id);
                (Some(r), reason)
            }
        };
        if let Some(r) = &restored {
            self.check_compatible(r)?;
            let load_ms = started.elapsed().as_millis() as u64;
            let (checkpoint, bytes) = (r.checkpoint_id, r.bytes);
            tracing::info!(path = %r.path, checkpoint, bytes, load_ms, %reason, "restoring");
        }
        Ok((restored, reason))
    }

    /// After a failure in this process: the newest valid restore point at or above the one
    /// the run started from (or that one itself, read again, when it lives outside the job's
    /// root). When the run took the newest valid one (`--restore latest`) and a lazy restore has
    /// since found that one damaged, the newest valid one below it, as a new process would take.
    fn failover_restore(&self, initial: Option<&RunRestorePoint>) -> Result<(Option<RestoredState>, String), JobError> {
        let floor = initial.map_or(0, |r| r.checkpoint_id);
        let keyed_in = self.keyed_files_in();
        let history = self.history()?;
        let history = history.as_ref();
        let selection = match crate::io().block_on(newest_valid(&self.storage, floor, &keyed_in, history)) {
            Err(RestoreError::NoValidRestorePoint { defects, .. })
                if floor > 0 && matches!(self.opts.restore, Some(RestoreRequest::Latest)) =>
            {
                for defect in &defects {
                    tracing::warn!(%defect, "the run's restore point is damaged; looking for an older one");
                }
                crate::io().block_on(newest_valid(&self.storage, 0, &keyed_in, history))?
            }
            selection => selection?,
        };
        self.known_corrupt.borrow_mut().extend(selection.skipped.iter().map(|s| s.id));
        let reason = selection.reason();
        match selection.restored {
            Some(r) => Ok((Some(r), reason)),
            None => {
                let reason = "restarted from the restore point of the run".to_string();
                let Some(point) = initial else { return Ok((None, reason)) };
                let (storage, found) = crate::io().block_on(open_path(&point.path))?;
                let mut r = crate::io().block_on(RestoredState::load(&storage, &found, &keyed_in))?;
                if r.checkpoint_id != point.checkpoint_id {
                    return Err(JobError::Restore(RestoreError::Invalid {
                        path: point.path.clone(),
                        reason: format!(
                            "it held checkpoint {} when the run started and holds {} now",
                            point.checkpoint_id, r.checkpoint_id
                        ),
                    }));
                }
                r.in_job_root = point.in_job_root;
                Ok((Some(r), reason))
            }
        }
    }

    /// Each keyed subtask's bound on the full images it holds in memory: its share of
    /// [`RunOptions::state_files_in_memory_max`] (the subtasks of a checkpoint may all write one
    /// at once, the first after a restore from elsewhere, and a savepoint takes one from each),
    /// at most [`crate::state::HEAP_FULL_IMAGE_IN_MEMORY`].
    fn full_image_budget(&self, vertices: &[Vertex]) -> crate::state::FullImageBudget {
        let keyed_subtasks: u64 = vertices
            .iter()
            .map(|v| {
                let keyed = v.nodes.iter().filter(|&&n| holds_keyed_state(&self.job.nodes[n].kind)).count();
                keyed as u64 * u64::from(v.parallelism)
            })
            .sum();
        let bytes = self.opts.state_files_in_memory_max.unwrap_or_else(default_state_files_in_memory_max);
        let share = (bytes / keyed_subtasks.max(1)).min(crate::state::HEAP_FULL_IMAGE_IN_MEMORY);
        crate::state::FullImageBudget { in_memory_max: share, dir: local_state_dir() }
    }

    /// Where a restore keeps keyed state files: on local disk for the rocksdb backend, whose
    /// state (and so its checkpoint) may be larger than memory; in memory for the heap backend
    /// up to [`RunOptions::state_files_in_memory_max`].
    fn keyed_files_in(&self) -> KeyedFilesIn {
        match self.job.spec.state_backend {
            StateBackendKind::Rocksdb => KeyedFilesIn::LocalDir(local_state_dir()),
            StateBackendKind::Heap => KeyedFilesIn::MemoryUpTo {
                bytes: self.opts.state_files_in_memory_max.unwrap_or_else(default_state_files_in_memory_max),
                dir: local_state_dir(),
                parallelism: self.keyed_parallelism(),
            },
        }
    }

    /// The parallelism of each keyed operator of the job, by uid.
    fn keyed_parallelism(&self) -> BTreeMap<String, u32> {
        let job = self.job;
        plan::build(job)
            .iter()
            .flat_map(|v| v.nodes.iter().map(move |&n| (&job.nodes[n], v.parallelism)))
            .filter(|(node, _)| holds_keyed_state(&node.kind))
            .filter_map(|(node, parallelism)| Some((node.uid.clone()?, parallelism)))
            .collect()
    }

    fn check_compatible(&self, r: &RestoredState) -> Result<(), JobError> {
        let incompatible =
            |reason: String| JobError::Restore(RestoreError::Incompatible { path: r.path.clone(), reason });
        if let Some(why) = weir_crds::compat::max_parallelism_conflict(r.max_parallelism, self.job.spec.max_parallelism)
        {
            return Err(incompatible(why));
        }
        let held = r.operators.iter().map(|(uid, op)| (uid.clone(), op.state_layout.clone())).collect();
        let dropped = weir_crds::compat::restore_conflict(self.job, &held, self.opts.allow_non_restored_state)
            .map_err(incompatible)?;
        if !dropped.is_empty() {
            tracing::warn!(uids = ?dropped, "dropping state of uids the job no longer has (allowNonRestoredState)");
        }
        Ok(())
    }

    /// Claims the next epoch for an attempt that has yet to choose its restore point.
    fn claim_epoch(&mut self) -> Result<(), epoch::EpochError> {
        let holder = self.opts.holder.clone().unwrap_or_else(|| format!("pid {}", std::process::id()));
        self.epoch = crate::io().block_on(epoch::claim(&self.storage, &holder))?;
        tracing::info!(epoch = self.epoch, "claimed epoch");
        Ok(())
    }

    /// The history this run continues ([`epoch::history_before`] its epoch): restores take
    /// only checkpoints in it.
    fn history(&self) -> Result<Option<epoch::Lineage>, JobError> {
        Ok(crate::io().block_on(epoch::history_before(&self.storage, self.epoch))?)
    }

    /// Where a restore point came from, for this run's start record: its id and the epoch that
    /// wrote it, when it lives in this job's storage (a savepoint from elsewhere has no
    /// history here).
    fn restored_from(&self, restored: Option<&RestoredState>) -> Option<epoch::RestoredFrom> {
        let r = restored?;
        let own = r.path.starts_with(self.storage.url());
        Some(epoch::RestoredFrom { id: r.checkpoint_id, epoch: if own { r.epoch } else { 0 } })
    }

    /// Which output the sinks must show after restoring `restored`.
    fn output_history(&self, restored: Option<&RestoredState>) -> Result<sinks::file::OutputHistory, String> {
        use sinks::file::OutputHistory;
        let Some(from) = self.restored_from(restored) else { return Ok(OutputHistory::Fresh) };
        match crate::io()
            .block_on(epoch::lineage(&self.storage, from))
            .map_err(|e| format!("tracing the restore point's history: {e}"))?
        {
            Some(lineage) => Ok(OutputHistory::Lineage(lineage)),
            None => Ok(OutputHistory::After(from.id)),
        }
    }

    /// Recovers every file sink; `newest_complete` is the newest complete restore point id of
    /// any history (staged data up to it may still be needed).
    fn recover_sinks(
        &self,
        restored: Option<&RestoredState>,
        reason: &str,
        newest_complete: u64,
    ) -> Result<(), String> {
        let history = self.output_history(restored)?;
        for sink in &self.file_sinks {
            let uid = &sink.uid;
            let docs = restored.map(|r| r.operator_docs(uid)).unwrap_or_default();
            let input = sinks::file::RecoveryInput { restored_docs: &docs, history: &history, newest_complete, reason };
            let report = crate::io()
                .block_on(sinks::file::recover(&sink.storage, uid, self.epoch, input))
                .map_err(|e| e.to_string())?;
            if !report.superseded.is_empty() || !report.returned.is_empty() {
                let notice = format!(
                    "sink `{uid}`: {} published file(s) outside the restored history moved to {}, \
                     {} moved back from an earlier rewind ({reason})",
                    report.superseded.len(),
                    sink.storage.url_of(&format!("{}/{:06}", sinks::file::SUPERSEDED_DIR, self.epoch)),
                    report.returned.len()
                );
                tracing::warn!(sink = %uid, "{notice}");
                self.metrics.board().notices.push(notice);
            }
            if report != sinks::file::RecoveryReport::default() {
                tracing::info!(
                    sink = %uid,
                    recommitted = report.recommitted,
                    discarded_staged = report.discarded_staged,
                    manifests_repaired = report.manifests_repaired,
                    "file sink recovered"
                );
            }
        }
        self.recover_kafka_sinks(restored)
    }

    /// Fences every Kafka sink's earlier producers and commits what the restored state staged
    /// and no marker shows committed.
    #[cfg(feature = "kafka")]
    fn recover_kafka_sinks(&self, restored: Option<&RestoredState>) -> Result<(), String> {
        for node in &self.job.nodes {
            let (NodeKind::KafkaSink(spec), Some(uid)) = (&node.kind, &node.uid) else { continue };
            let docs = restored.map(|r| r.operator_docs(uid)).unwrap_or_default();
            let report = sinks::kafka::recover(
                spec,
                &self.job.spec.name,
                uid,
                self.epoch,
                node.parallelism,
                &docs,
                &self.storage,
                &self.faults,
            )
            .map_err(|e| format!("kafka sink `{uid}`: {e}"))?;
            tracing::info!(
                sink = %uid,
                fenced = report.fenced,
                already_committed = report.already_committed,
                recommitted = report.recommitted,
                "kafka sink recovered"
            );
        }
        Ok(())
    }

    #[cfg(not(feature = "kafka"))]
    fn recover_kafka_sinks(&self, _restored: Option<&RestoredState>) -> Result<(), String> {
        Ok(())
    }

    fn attempt(&mut self, restored_state: Option<RestoredState>, reason: &str) -> AttemptEnd {
        let restored = restored_state.as_ref();
        // Merges the last attempt wrote and never got listed are orphans from now on (its
        // checkpoints are over); a retention pass it started may still rely on them being
        // protected, so it ends first.
        self.wait_for_retention();
        self.pending_files.clear();
        // The run starts (enters the job's history) only once its restore point is recorded
        // beside its claim, and only if no newer run has claimed since.
        match crate::io().block_on(epoch::record_start(&self.storage, self.epoch, self.restored_from(restored))) {
            Ok(()) => {}
            Err(e @ epoch::EpochError::Superseded { .. }) => return AttemptEnd::Fenced(e),
            Err(e) => return AttemptEnd::Failed(format!("recording the start of epoch {}: {e}", self.epoch)),
        }
        self.metrics.board().epoch = self.epoch;
        tracing::info!(epoch = self.epoch, "started epoch");
        self.commits.reset();
        // One listing serves both: ids are never reused, and staged data up to the newest
        // complete restore point may still be needed.
        let points = crate::io().block_on(async {
            let points = recovery::restore_points(&self.storage).await?;
            let complete = recovery::newest_complete(&self.storage, &points).await?;
            Ok::<_, weir_checkpoint::StorageError>((points.first().map_or(0, |p| p.id), complete.map_or(0, |p| p.id)))
        });
        let (highest, newest_complete) = match points {
            Ok(p) => p,
            Err(e) => return AttemptEnd::Failed(format!("listing checkpoints: {e}")),
        };
        self.next_id = self.next_id.max(highest + 1).max(restored.map_or(0, |r| r.checkpoint_id + 1));
        if let Err(e) = self.recover_sinks(restored, reason, newest_complete) {
            return AttemptEnd::Failed(format!("recovering sinks: {e}"));
        }
        let (events_tx, events) = unbounded();
        let running = match self.start_tasks(restored, events_tx) {
            Ok(r) => r,
            Err(e) => return AttemptEnd::Failed(e.to_string()),
        };
        // The tasks hold what they restored: the files it came from are not needed any more
        // (a restart reads its restore point again).
        drop(restored_state);
        self.metrics.set_state(JobState::Running);
        let end = self.coordinate(&running, &events);
        running.stop();
        end
    }

    fn start_tasks(&self, restored: Option<&RestoredState>, events: Sender<Event>) -> Result<Running, TaskError> {
        let job = self.job;
        let spec = &job.spec;
        let vertices = plan::build(job);
        // Task ids, in vertex order.
        let mut first_task = Vec::with_capacity(vertices.len());
        let mut total = 0u32;
        for v in &vertices {
            first_task.push(total);
            total += v.parallelism;
        }
        // The channels, as planned by `wiring::wire`: created here, each receiver taken once.
        let wiring = crate::wiring::wire(&vertices);
        let (senders, receivers): (Vec<_>, Vec<_>) = wiring.channels.iter().map(|_| bounded(CHANNEL_CAPACITY)).unzip();
        let mut senders: Vec<Option<Sender<crate::message::Message>>> = senders.into_iter().map(Some).collect();
        let mut receivers: Vec<Option<Receiver<crate::message::Message>>> = receivers.into_iter().map(Some).collect();
        let mut running = Running {
            tasks: Vec::new(),
            uploaders: Vec::new(),
            controls: Vec::new(),
            source_tasks: Vec::new(),
            restores_loading: Arc::default(),
        };
        let factory = OperatorFactory {
            job,
            metrics: &self.metrics,
            #[cfg(feature = "kafka")]
            faults: &self.faults,
            storage: &self.storage,
            file_sinks: &self.file_sinks,
            epoch: self.epoch,
            restores_loading: &running.restores_loading,
            full_images: self.full_image_budget(&vertices),
        };
        let mut chains_built = factory.build_chains(&vertices, restored).into_iter();
        let mut built = Vec::new();
        for (vi, v) in vertices.iter().enumerate() {
            for subtask in 0..v.parallelism {
                let id = first_task[vi] + subtask;
                let key_groups = crate::value::key_group_range(subtask, spec.max_parallelism, v.parallelism);
                let (control_tx, control_rx) = unbounded();
                let (upload_tx, upload_rx) = unbounded();
                let (chain, chains) = chains_built.next().expect("a chain per subtask")?;
                let head_node = &job.nodes[v.nodes[0]];
                let head = if head_node.kind.is_source() {
                    let uid = head_node.uid.clone().unwrap_or_default();
                    let docs = restored.map(|r| r.operator_docs(&uid)).unwrap_or_default();
                    let source: Box<dyn Source> = match &head_node.kind {
                        NodeKind::Generator(g) => {
                            Box::new(GeneratorSource::new(g, spec.max_parallelism, subtask, v.parallelism, &docs)?)
                        }
                        NodeKind::FileSource(f) => Box::new(FileSource::new(&f.path, subtask, v.parallelism, &docs)?),
                        #[cfg(feature = "kafka")]
                        NodeKind::KafkaSource(k) => Box::new(crate::sources::kafka::KafkaSource::new(
                            k,
                            &spec.name,
                            subtask,
                            v.parallelism,
                            &docs,
                        )?),
                        _ => unreachable!("is_source"),
                    };
                    running.source_tasks.push(id);
                    Head::Source { uid, source }
                } else {
                    let channels = &wiring.inputs[vi][subtask as usize];
                    Head::Inputs(
                        channels.iter().map(|&c| receivers[c].take().expect("each channel is read once")).collect(),
                    )
                };
                let name = format!(
                    "{}[{}/{}]",
                    v.nodes.iter().map(|&n| job.nodes[n].name.as_str()).collect::<Vec<_>>().join("→"),
                    subtask + 1,
                    v.parallelism
                );
                let task = Task {
                    id,
                    name: name.clone(),
                    subtask,
                    parallelism: v.parallelism,
                    key_groups,
                    head,
                    chain,
                    outputs: wiring.outputs[vi][subtask as usize]
                        .iter()
                        .map(|o| {
                            let to =
                                o.channels.iter().map(|&c| senders[c].take().expect("each channel is written once"));
                            Output::new(to.collect(), o.partition.clone(), spec.max_parallelism, subtask)
                        })
                        .collect(),
                    control: control_rx,
                    events: events.clone(),
                    uploads: upload_tx,
                    mode: spec.checkpointing.mode,
                    metrics: self.metrics.clone(),
                    faults: self.faults.clone(),
                };
                running.controls.push(control_tx);
                built.push((task, upload_rx, chains));
            }
        }
        for (task, upload_rx, chains) in built {
            let storage = self.storage.clone();
            let ev = events.clone();
            let faults = self.faults.clone();
            let epoch = self.epoch;
            let merges = spec.checkpointing.incremental.then(|| crate::upload::Merges {
                full_every: spec.checkpointing.full_every.max(1) as usize,
                merger: crate::compact::Merger::new(
                    format!("merge-{}", task.id),
                    storage.clone(),
                    self.pending_files.clone(),
                    epoch,
                    local_state_dir(),
                ),
                staged: Vec::new(),
                metrics: self.metrics.clone(),
                store_tables: spec.state_backend == StateBackendKind::Rocksdb,
                failures_in_a_row: HashMap::new(),
            });
            running.uploaders.push(
                std::thread::Builder::new()
                    .name(format!("upload-{}", task.id))
                    .spawn(move || crate::upload::run(upload_rx, storage, epoch, ev, faults, chains, merges))
                    .map_err(|e| TaskError::Read { what: "thread".into(), reason: e.to_string() })?,
            );
            let ev = events.clone();
            let name = task.name.clone();
            let metrics = self.metrics.clone();
            running.tasks.push(
                std::thread::Builder::new()
                    .name(name.clone())
                    .spawn(move || {
                        let id = task.id;
                        let result = std::panic::catch_unwind(AssertUnwindSafe(move || task.run()));
                        metrics.add_task_cpu();
                        let event = match result {
                            Ok(Ok(TaskEnd::Finished)) => Event::TaskFinished { task: id },
                            Ok(Ok(TaskEnd::Cancelled)) | Ok(Err(TaskError::Shutdown)) => return,
                            Ok(Err(e)) => Event::TaskFailed { task: id, error: format!("{name}: {e}") },
                            Err(panic) => {
                                let msg = panic
                                    .downcast_ref::<String>()
                                    .cloned()
                                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                                    .unwrap_or_default();
                                Event::TaskFailed { task: id, error: format!("{name} panicked: {msg}") }
                            }
                        };
                        let _ = ev.send(event);
                    })
                    .map_err(|e| TaskError::Read { what: "thread".into(), reason: e.to_string() })?,
            );
        }
        Ok(running)
    }

    fn coordinate(&mut self, running: &Running, events: &Receiver<Event>) -> AttemptEnd {
        let c = &self.job.spec.checkpointing;
        let config = CoordinatorConfig {
            periodic: c.enabled,
            interval_ms: c.interval.as_millis(),
            min_pause_ms: c.min_pause.as_millis(),
            timeout_ms: self.checkpoint_timeout_ms(),
            max_concurrent: c.max_concurrent,
            tolerable_failures: c.tolerable_failures,
        };
        let task_count = running.controls.len() as u32;
        let mut coord: Coordinator<TaskAck> = Coordinator::new(config, 0..task_count, self.next_id, now_ms());
        let mut started: HashMap<u64, (u64, TriggerKind, String)> = HashMap::new();
        let mut sources_finished = BTreeSet::new();
        let mut finished = 0u32;
        let mut outcome: Option<JobOutcome> = None;
        // Checkpoints held while a lazy restore loads ([`Running::restores_loading`]).
        let mut held = false;
        loop {
            while let Ok(req) = self.requests.try_recv() {
                match req {
                    Request::Cancel => return AttemptEnd::Done(JobOutcome::Cancelled),
                    Request::Savepoint { stop, drain, reply } => {
                        let request = self.next_request;
                        self.next_request += 1;
                        self.metrics.set_savepoint(SavepointStatus {
                            request_id: request,
                            outcome: CheckpointOutcome::InProgress,
                            path: None,
                            failure: None,
                        });
                        coord.request_savepoint(request, stop, drain);
                        let _ = reply.send(request);
                    }
                }
            }
            let loading = running.restores_loading.load(std::sync::atomic::Ordering::Acquire);
            if (loading > 0) != held {
                held = loading > 0;
                if held {
                    tracing::info!(
                        stores = loading,
                        "checkpoints wait until the restore has brought in and verified its state"
                    );
                } else {
                    tracing::info!("the restored state is all in; checkpoints resume");
                }
            }
            coord.hold_checkpoints(held);
            let mut actions = coord.poll(now_ms());
            match events.recv_timeout(TICK) {
                Ok(Event::Ack { id, task, ack }) => actions.extend(coord.ack(id, task, ack)),
                Ok(Event::Decline { id, task, reason }) => actions.extend(coord.decline(id, task, &reason, now_ms())),
                Ok(Event::SourceFinished { task }) => {
                    sources_finished.insert(task);
                    if sources_finished.len() == running.source_tasks.len() {
                        coord.sources_finished();
                    }
                }
                Ok(Event::TaskFinished { .. }) => {
                    finished += 1;
                    if finished == task_count {
                        return AttemptEnd::Done(outcome.unwrap_or(JobOutcome::Finished));
                    }
                }
                Ok(Event::TaskFailed { error, .. }) => return AttemptEnd::Failed(error),
                Ok(Event::Committed { committed, .. }) => {
                    if let Err(e) = self.write_manifests(committed) {
                        return AttemptEnd::Failed(format!("writing a commit manifest: {e}"));
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return AttemptEnd::Failed("all tasks vanished".into()),
            }
            // Actions may produce further actions (completion → subsumption).
            while !actions.is_empty() {
                let mut next = Vec::new();
                for action in actions {
                    match self.apply(action, &mut coord, running, &mut started, &mut outcome) {
                        Ok(more) => next.extend(more),
                        Err(end) => return end,
                    }
                }
                actions = next;
            }
        }
    }

    fn apply(
        &mut self,
        action: Action<TaskAck>,
        coord: &mut Coordinator<TaskAck>,
        running: &Running,
        started: &mut HashMap<u64, (u64, TriggerKind, String)>,
        outcome: &mut Option<JobOutcome>,
    ) -> Result<Vec<Action<TaskAck>>, AttemptEnd> {
        match action {
            Action::Trigger { id, kind, is_final } => {
                self.next_id = self.next_id.max(id + 1);
                let now = now_ms();
                let (target, dir, stop, drain) = match kind {
                    TriggerKind::Savepoint { request, stop, drain } => {
                        self.savepoint_requests.insert(id, request);
                        let dir = layout::savepoint_dir(now, id);
                        (SnapshotTarget::Savepoint { dir: dir.clone() }, dir, stop, drain)
                    }
                    TriggerKind::Checkpoint => {
                        (SnapshotTarget::Checkpoint, layout::checkpoint_dir(id), is_final, false)
                    }
                };
                started.insert(id, (now, kind, dir.clone()));
                self.record(id, kind, &dir, now, CheckpointOutcome::InProgress, 0, None);
                running.send_sources(&TaskControl::Trigger { barrier: Barrier { id, target }, stop, drain });
                Ok(Vec::new())
            }
            Action::Complete { id, kind, is_final, acks } => {
                let (t0, _, dir) = started.get(&id).cloned().unwrap_or((now_ms(), kind, layout::checkpoint_dir(id)));
                let bytes: u64 = acks.values().map(|a| a.bytes).sum();
                let metadata = self.metadata(id, kind, &acks);
                // Fencing: publish `_metadata` only while this run holds the newest epoch, and
                // create-only, so a stale run can never replace a newer run's checkpoint N.
                if let Err(e) = crate::io().block_on(epoch::check(&self.storage, self.epoch)) {
                    return Err(fenced_or_failed(e));
                }
                self.faults.stop_at(StopPoint::BeforeMetadata, id);
                let write = crate::io().block_on(
                    self.storage
                        .put_if_absent(&layout::resolve(&dir, layout::METADATA), bytes::Bytes::from(metadata.encode())),
                );
                match write {
                    Ok(()) => {}
                    Err(weir_checkpoint::StorageError::AlreadyExists(path)) => {
                        if let Err(e) = crate::io().block_on(epoch::check(&self.storage, self.epoch)) {
                            return Err(fenced_or_failed(e));
                        }
                        return Ok(coord.completion_failed(
                            id,
                            &format!("{path} was written by another run"),
                            now_ms(),
                        ));
                    }
                    Err(e) => return Ok(coord.completion_failed(id, &e.to_string(), now_ms())),
                }
                let mut more = coord.completed(id, now_ms());
                if !kind.is_savepoint() {
                    self.checkpoint_timeout_scale = timeout_scale_after(self.checkpoint_timeout_scale, false, true);
                }
                let path = self.storage.url_of(&dir);
                self.record(id, kind, &dir, t0, CheckpointOutcome::Completed, bytes, None);
                tracing::debug!(
                    checkpoint = id,
                    bytes,
                    duration_ms = now_ms().saturating_sub(t0),
                    "checkpoint complete"
                );
                if self.faults.fires(Fault::AbortBeforeCommit) {
                    tracing::error!(
                        checkpoint = id,
                        "injected fault: aborting the process after checkpoint completion, before commit"
                    );
                    std::process::abort();
                }
                if self.faults.fires(Fault::CrashBeforeCommit) {
                    return Err(AttemptEnd::Failed(format!(
                        "injected fault: crash after checkpoint {id} completed, before commit"
                    )));
                }
                let stop = matches!(kind, TriggerKind::Savepoint { stop: true, .. });
                // Commit on checkpoints and on a savepoint that stops the job; a savepoint
                // that does not stop it commits nothing (the next checkpoint does), so output
                // never runs ahead of the restore points that `--restore latest` can find.
                if !kind.is_savepoint() || stop {
                    if let Err(e) = crate::io().block_on(epoch::check(&self.storage, self.epoch)) {
                        return Err(fenced_or_failed(e));
                    }
                    self.faults.stop_at(StopPoint::BeforeCommit, id);
                    self.commits.expect(id, acks.values().flat_map(|a| a.pending_commits.iter().cloned()));
                    running.send_all(&TaskControl::Complete(id));
                }
                if !kind.is_savepoint() {
                    self.spawn_retention(coord.pending_ids().first().copied().unwrap_or(coord.next_id()));
                }
                if is_final || stop {
                    if stop {
                        self.metrics.set_state(JobState::Stopping);
                        *outcome = Some(JobOutcome::Stopped { savepoint: path });
                    }
                    running.send_sources(&TaskControl::Finish);
                }
                more.retain(|a| !matches!(a, Action::Trigger { .. }));
                Ok(more)
            }
            Action::Abort { id, kind, reason } => {
                tracing::warn!(checkpoint = id, %reason, "checkpoint aborted");
                let (t0, _, dir) = started.remove(&id).unwrap_or((now_ms(), kind, layout::checkpoint_dir(id)));
                self.record(id, kind, &dir, t0, CheckpointOutcome::Failed, 0, Some(reason));
                running.send_all(&TaskControl::Abort(id));
                Ok(Vec::new())
            }
            Action::FailJob { mut reason, expired_before_any_completed } => {
                if expired_before_any_completed {
                    let next = timeout_scale_after(self.checkpoint_timeout_scale, true, false);
                    self.checkpoint_timeout_scale = next;
                    let allowed = self.checkpoint_timeout_ms();
                    let scaled = self.job.spec.checkpointing.timeout.as_millis().saturating_mul(next);
                    let capped = if allowed < scaled { ", less so that Kafka transactions outlive it" } else { "" };
                    reason.push_str(&format!(
                        "; no checkpoint of this attempt completed: a restart allows each {allowed} ms \
                         (checkpointing.timeout × {next}{capped})"
                    ));
                }
                Err(AttemptEnd::Failed(reason))
            }
        }
    }

    /// Records a checkpoint's progress in the history and, once it ended, in the status of
    /// the savepoint request that asked for it.
    #[allow(clippy::too_many_arguments)]
    fn record(
        &mut self,
        id: u64,
        kind: TriggerKind,
        dir: &str,
        t0: u64,
        outcome: CheckpointOutcome,
        bytes: u64,
        failure: Option<String>,
    ) {
        let path = self.storage.url_of(dir);
        let ended = outcome != CheckpointOutcome::InProgress;
        self.metrics.record_checkpoint(CheckpointInfo {
            id,
            kind: if kind.is_savepoint() { CheckpointKind::Savepoint } else { CheckpointKind::Checkpoint },
            outcome,
            path: path.clone(),
            triggered_at_ms: t0,
            duration_ms: ended.then(|| now_ms().saturating_sub(t0)),
            bytes,
            failure: failure.clone(),
        });
        if !ended {
            return;
        }
        if let Some(request) = self.savepoint_requests.remove(&id) {
            let path = (outcome == CheckpointOutcome::Completed).then_some(path);
            self.metrics.set_savepoint(SavepointStatus { request_id: request, outcome, path, failure });
        }
    }

    /// Waits for a background retention pass to end.
    fn wait_for_retention(&self) {
        while self.retention_running.load(std::sync::atomic::Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Deletes old checkpoints in the background (one pass at a time; a skipped pass is
    /// covered by the next one), only while this run holds the newest epoch; every
    /// [`STAGING_SWEEP_EVERY`], the pass also deletes the staging files killed writers left in
    /// the checkpoint storage and the file sinks' directories (no listing shows them, so
    /// nothing else ever would).
    fn spawn_retention(&self, in_flight_from: u64) {
        if self.retention_running.swap(true, std::sync::atomic::Ordering::AcqRel) {
            return;
        }
        let sweep_due = self.staging_swept_at.get().is_none_or(|at| at.elapsed() >= STAGING_SWEEP_EVERY);
        let mut sweep: Vec<Storage> = Vec::new();
        if sweep_due {
            self.staging_swept_at.set(Some(Instant::now()));
            sweep.push(self.storage.clone());
            sweep.extend(self.file_sinks.iter().map(|s| s.storage.clone()));
        }
        let storage = self.storage.clone();
        let retained = self.job.spec.checkpointing.retained as usize;
        let running = self.retention_running.clone();
        let mine = self.epoch;
        let corrupt = self.known_corrupt.borrow().clone();
        let pending = self.pending_files.clone();
        crate::io().spawn(async move {
            let result = match epoch::check(&storage, mine).await {
                Ok(()) => retention::apply(&storage, retained, in_flight_from, mine, &corrupt, &pending)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match result {
                Ok(()) if !sweep.is_empty() => discard_abandoned_staging(sweep).await,
                Ok(()) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "checkpoint retention skipped; will retry after the next checkpoint")
                }
            }
            running.store(false, std::sync::atomic::Ordering::Release);
        });
    }

    /// Writes the commit manifests of every sink checkpoint that `committed` completed.
    fn write_manifests(&mut self, committed: Vec<Committable>) -> Result<(), weir_checkpoint::StorageError> {
        for (group, manifest) in self.commits.committed(committed) {
            // Transactions of this run are staged in the sinks' own directories.
            let storage = match self.file_sinks.iter().find(|s| s.storage.url() == group.sink) {
                Some(s) => s.storage.clone(),
                None => Storage::open(&group.sink)?,
            };
            crate::io().block_on(sinks::file::write_commit_manifest(&storage, &manifest))?;
        }
        Ok(())
    }

    fn metadata(&self, id: u64, kind: TriggerKind, acks: &BTreeMap<TaskId, TaskAck>) -> CheckpointMetadata {
        let mut operators: BTreeMap<String, OperatorSnapshot> = BTreeMap::new();
        for ack in acks.values() {
            for op in &ack.operators {
                let entry = operators.entry(op.uid.clone()).or_insert_with(|| OperatorSnapshot {
                    parallelism: op.parallelism,
                    subtasks: Vec::new(),
                    state_layout: weir_crds::compat::state_layout_of(self.job, &op.uid),
                });
                entry.subtasks.push(op.snapshot.clone());
            }
        }
        for op in operators.values_mut() {
            op.subtasks.sort_by_key(|s| s.subtask);
        }
        CheckpointMetadata {
            format_version: weir_checkpoint::metadata::FORMAT_VERSION,
            checkpoint_id: id,
            kind: if kind.is_savepoint() { SnapshotKind::Savepoint } else { SnapshotKind::Checkpoint },
            job_name: self.job.spec.name.clone(),
            epoch: self.epoch,
            created_at_ms: now_ms(),
            max_parallelism: self.job.spec.max_parallelism,
            operators,
        }
    }
}

/// What building the operators of a task needs from the executor: shared by the threads that
/// build (and restore) the tasks' chains in parallel.
struct OperatorFactory<'a> {
    job: &'a ValidatedJob,
    metrics: &'a Arc<JobMetrics>,
    /// For the Kafka sink.
    #[cfg(feature = "kafka")]
    faults: &'a Faults,
    /// The job's root: the Kafka sink's, and where adopted chains are copied to.
    storage: &'a Storage,
    file_sinks: &'a [FileSinkDir],
    epoch: u64,
    /// Counts the attempt's state stores that are restoring lazily.
    restores_loading: &'a Arc<std::sync::atomic::AtomicUsize>,
    /// Each keyed subtask's bound on the full images it holds in memory.
    full_images: crate::state::FullImageBudget,
}

/// A task's chained operators, and the keyed-state chains its uploader continues (by uid).
type BuiltChain = (Vec<ChainedOperator>, HashMap<String, crate::upload::RestoredChain>);

impl OperatorFactory<'_> {
    /// Every task's chain (all but a source head), in task order. They are built on up to one
    /// thread per core: building restores keyed state, so a restore takes about the time of its
    /// largest subtask rather than the sum of all.
    fn build_chains(
        &self,
        vertices: &[Vertex],
        restored: Option<&RestoredState>,
    ) -> Vec<Result<BuiltChain, TaskError>> {
        let tasks: Vec<(&Vertex, u32)> =
            vertices.iter().flat_map(|v| (0..v.parallelism).map(move |subtask| (v, subtask))).collect();
        let next = std::sync::atomic::AtomicUsize::new(0);
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(tasks.len()).max(1);
        let mut results: Vec<(usize, Result<BuiltChain, TaskError>)> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    scope.spawn(|| {
                        let mut done = Vec::new();
                        loop {
                            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            let Some(&(v, subtask)) = tasks.get(i) else { return done };
                            done.push((i, self.build_chain(v, subtask, restored)));
                        }
                    })
                })
                .collect();
            workers
                .into_iter()
                .flat_map(|w| w.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
                .collect()
        });
        results.sort_by_key(|(i, _)| *i);
        results.into_iter().map(|(_, r)| r).collect()
    }

    /// The chain of subtask `subtask` of `v`.
    fn build_chain(&self, v: &Vertex, subtask: u32, restored: Option<&RestoredState>) -> Result<BuiltChain, TaskError> {
        let key_groups = crate::value::key_group_range(subtask, self.job.spec.max_parallelism, v.parallelism);
        let head_node = &self.job.nodes[v.nodes[0]];
        let chain_nodes = if head_node.kind.is_source() { &v.nodes[1..] } else { &v.nodes[..] };
        let mut chains = HashMap::new();
        let mut chain = Vec::new();
        for &ni in chain_nodes {
            chain.push(self.build_operator(ni, v, subtask, key_groups, restored, &mut chains)?);
        }
        Ok((chain, chains))
    }

    #[allow(clippy::too_many_arguments)]
    fn build_operator(
        &self,
        ni: usize,
        v: &Vertex,
        subtask: u32,
        key_groups: (u32, u32),
        restored: Option<&RestoredState>,
        chains: &mut HashMap<String, crate::upload::RestoredChain>,
    ) -> Result<ChainedOperator, TaskError> {
        let job = self.job;
        let node = &job.nodes[ni];
        let input_schema: &[String] = node.inputs.first().map(|&i| job.nodes[i].schema.as_slice()).unwrap_or(&[]);
        let uid = node.uid.clone().unwrap_or_default();
        let keyed = || KeyedContext {
            uid: uid.clone(),
            key: node.key.clone(),
            max_parallelism: job.spec.max_parallelism,
            key_groups,
            // Without checkpoints nothing takes increments, and the state tracks no changes.
            incremental: job.spec.checkpointing.incremental && job.spec.checkpointing.enabled,
            full_every: job.spec.checkpointing.full_every,
            background_full_image_above: job.spec.checkpointing.background_full_image_above,
            full_images: self.full_images.clone(),
            store: (job.spec.state_backend == StateBackendKind::Rocksdb).then(|| StoreSettings {
                parent_dir: local_state_dir(),
                cache_entries: job.spec.state_cache_entries.try_into().unwrap_or(usize::MAX),
                restores_loading: self.restores_loading.clone(),
            }),
        };
        let mut keyed_restore = restored.and_then(|r| r.keyed_for(&uid, key_groups, v.parallelism));
        let composite_key = keyed().composite();
        // A one-field key is held as an integer while it is one, unless a restored chain holds
        // keys of other values.
        let int_keys = !composite_key && keyed_restore.as_ref().is_none_or(|r| r.int_keys);
        if let Some(k) = &mut keyed_restore {
            // The heap backend goes on from a chain of another root when its files can be
            // copied without passing through the process (linked, or copied by the store): the
            // first checkpoint copies them instead of the stopped task writing a full image.
            // Streamed, the copy would take about as long as the restore's reading.
            let largest = k.chain.iter().map(|f| f.len).max().unwrap_or(0);
            let cheap = k.adoptable.as_ref().is_some_and(|s| self.storage.copies_cheaply_from(&s.storage, largest));
            let copy_from = match job.spec.state_backend {
                StateBackendKind::Heap if cheap => k.adopt_chain(),
                StateBackendKind::Heap | StateBackendKind::Rocksdb => None,
            };
            if k.continue_chain {
                let chain = crate::upload::RestoredChain {
                    files: k.chain.clone(),
                    tables: k.chain_tables.clone(),
                    tables_fell_back: k.lazy_tables.first().map(|(_, t)| t.fell_back_flag()),
                    copy_from,
                };
                chains.insert(uid.clone(), chain);
            }
        }
        let op: Box<dyn Operator> = match &node.kind {
            NodeKind::Map(m) => Box::new(MapOperator::new(m, input_schema, &node.schema)?),
            NodeKind::Filter(f) => Box::new(FilterOperator::new(&f.expr, input_schema)?),
            NodeKind::FlatMap(f) => Box::new(FlatMapOperator::new(f, input_schema)?),
            NodeKind::Window(w) => Box::new(
                WindowOperator::new(keyed(), w, input_schema, keyed_restore.as_ref())?
                    .counting_late_records_in(self.metrics.late_records.clone()),
            ),
            NodeKind::Aggregate(a) => {
                let (specs, restore) = (&a.aggregates, keyed_restore.as_ref());
                if composite_key {
                    aggregate_operator::<PackedKey>(keyed(), specs, input_schema, restore)?
                } else if int_keys {
                    aggregate_operator::<IntKey>(keyed(), specs, input_schema, restore)?
                } else {
                    aggregate_operator::<Key>(keyed(), specs, input_schema, restore)?
                }
            }
            NodeKind::Dedupe if composite_key => dedupe_operator::<PackedKey>(keyed(), keyed_restore.as_ref())?,
            NodeKind::Dedupe if int_keys => dedupe_operator::<IntKey>(keyed(), keyed_restore.as_ref())?,
            NodeKind::Dedupe => dedupe_operator::<Key>(keyed(), keyed_restore.as_ref())?,
            NodeKind::FileSink(_) => {
                let storage = self
                    .file_sinks
                    .iter()
                    .find(|s| s.node == ni)
                    .map(|s| s.storage.clone())
                    .expect("every file sink node was opened at start");
                Box::new(FileSink::new(&uid, subtask, self.epoch, node.schema.clone(), storage, self.metrics.clone()))
            }
            #[cfg(feature = "kafka")]
            NodeKind::KafkaSink(k) => {
                let ctx = sinks::kafka::KafkaSinkContext {
                    uid: uid.clone(),
                    job: job.spec.name.clone(),
                    subtask,
                    parallelism: v.parallelism,
                    epoch: self.epoch,
                    schema: node.schema.clone(),
                    storage: self.storage.clone(),
                    metrics: self.metrics.clone(),
                    faults: self.faults.clone(),
                };
                Box::new(sinks::kafka::KafkaSink::new(ctx, k)?)
            }
            #[cfg(not(feature = "kafka"))]
            NodeKind::KafkaSink(_) => unreachable!("refused by run_job without the kafka feature"),
            NodeKind::Stdout => Box::new(StdoutSink::new(node.schema.clone(), self.metrics.clone())),
            NodeKind::Blackhole => Box::new(BlackholeSink::new(self.metrics.clone())),
            NodeKind::KeyBy(_) | NodeKind::Generator(_) | NodeKind::FileSource(_) | NodeKind::KafkaSource(_) => {
                unreachable!("not a chain element")
            }
        };
        Ok(ChainedOperator { uid: node.uid.clone().filter(|_| node.kind.is_stateful()), op })
    }
}

/// A failed epoch check: fenced when a newer run holds the epoch, else a failed attempt
/// (storage could not be asked; the attempt restarts and asks again).
fn fenced_or_failed(e: epoch::EpochError) -> AttemptEnd {
    match e {
        epoch::EpochError::Superseded { .. } => AttemptEnd::Fenced(e),
        other => AttemptEnd::Failed(format!("checking the epoch: {other}")),
    }
}

/// Whether an operator of `kind` keeps keyed state (and so writes full images).
fn holds_keyed_state(kind: &NodeKind) -> bool {
    matches!(kind, NodeKind::Window(_) | NodeKind::Aggregate(_) | NodeKind::Dedupe)
}

/// Where the rocksdb backend's stores go: `weir-state` in the temporary directory (`TMPDIR`,
/// else `/tmp`; in a pod, the `scratch` emptyDir volume mounted there).
fn local_state_dir() -> std::path::PathBuf {
    std::env::temp_dir().join("weir-state")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A restart after expired checkpoints scales the job's timeout, up to what an
    /// exactly-once Kafka sink's transactions outlive (`transactionTimeout` less the interval
    /// and the longest restart delay); never below the job's own timeout.
    #[test]
    fn a_scaled_checkpoint_timeout_stays_within_what_kafka_transactions_outlive() {
        let job = |sink: &str| {
            weir_crds::JobSpec::from_yaml(&format!(
                "name: t\ncheckpointing: {{ interval: 1s, timeout: 5s }}\n\
                 restart: {{ strategy: exponential-backoff, maxDelay: 2s }}\n\
                 sources: [ {{ name: s, generator: {{ count: 1, fields: [ {{ name: n, sequence: {{}} }} ] }} }} ]\n\
                 sinks: [ {sink} ]\n"
            ))
            .unwrap()
        };
        let files = job("{ name: out, uid: out, file: { path: /tmp/out } }");
        let scales: Vec<u64> = [1, 2, 8].iter().map(|&s| scaled_checkpoint_timeout_ms(&files, s)).collect();
        assert_eq!(scales, vec![5_000, 10_000, 40_000]);
        let kafka = |delivery: &str| {
            job(&format!(
                "{{ name: out, uid: out, kafka: {{ bootstrapServers: \"k:9092\", topic: t, delivery: {delivery}, \
                 transactionTimeout: 20s }} }}"
            ))
        };
        let exactly_once = kafka("exactly-once");
        let scales: Vec<u64> = [1, 2, 8].iter().map(|&s| scaled_checkpoint_timeout_ms(&exactly_once, s)).collect();
        assert_eq!(scales, vec![5_000, 10_000, 20_000 - 1_000 - 2_000 - 1]);
        assert_eq!(scaled_checkpoint_timeout_ms(&kafka("at-least-once"), 8), 40_000, "no transactions");
    }
}
