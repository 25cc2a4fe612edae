//! The lifecycle planner: a pure function of (spec, status, observations) that decides the
//! next step of a StreamJob. The reconciler observes (pods, the runtime's control API,
//! checkpoint storage), calls [`plan`], and carries out the returned actions; status changes are
//! returned too, so that every transition is unit-tested without a cluster.
//!
//! Long operations (a savepoint before an upgrade, suspend or cancel) are remembered in status
//! (`operation`), and an upgrade's target and restore point are written to status *before*
//! any pod is deleted (`pending_upgrade`), so an operator restarted at any point resumes the
//! same transition.

use std::collections::BTreeMap;

use weir_crds::streamjob::{
    DesiredState, OnSavepointFailure, PendingUpgrade, RestoreMode, SnapshotRef, StreamJobSpec, UpgradeMode,
};
pub use weir_crds::streamjob::{OperationKind, Phase};

/// What the job's runtime pods look like.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodsPhase {
    /// No pod exists.
    Absent,
    /// Pods exist but are not all running yet.
    Starting,
    /// All pods run.
    Running,
    /// A pod failed or was lost (reason).
    Failed(String),
    /// The runtime exited successfully (bounded input finished).
    Succeeded,
    /// Pods are being deleted.
    Terminating,
}

/// A checkpoint found in storage, newest first in [`Observation::checkpoints`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoundCheckpoint {
    /// Id and path.
    pub snapshot: SnapshotRef,
    /// Completion time, ms since the epoch.
    pub completed_at_ms: u64,
    /// `None` when valid, else why it cannot be restored.
    pub invalid: Option<String>,
    /// What each operator's state holds, by uid, as the checkpoint recorded it (`None` for an
    /// operator in a checkpoint written before layouts were recorded).
    pub state_layouts: BTreeMap<String, Option<String>>,
}

/// The state of a savepoint the operator asked the runtime for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SavepointProgress {
    /// Still being taken.
    InProgress,
    /// Done: restore from here.
    Completed(SnapshotRef),
    /// The runtime reported a failure (or the request could not be made).
    Failed(String),
}

/// A savepoint operation in flight, as recorded in status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Operation {
    /// What it is for.
    pub kind: OperationKind,
    /// When it started, ms since the epoch.
    pub started_at_ms: u64,
    /// The generation that asked for it.
    pub generation: i64,
}

/// What the reconciler observed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observation {
    /// Now, ms since the epoch.
    pub now_ms: u64,
    /// The runtime pods.
    pub pods: PodsPhase,
    /// Spec hash label of the existing pods.
    pub pods_spec_hash: Option<String>,
    /// Progress of the savepoint of the operation in status, if any.
    pub savepoint: Option<SavepointProgress>,
    /// Checkpoints in storage, newest first.
    pub checkpoints: Vec<FoundCheckpoint>,
}

/// The parts of status the planner reads and writes.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct PlanState {
    /// Phase shown by `kubectl get`.
    pub phase: Option<Phase>,
    /// Savepoint operation in flight.
    pub operation: Option<Operation>,
    /// Write-ahead record of an upgrade in progress.
    pub pending_upgrade: Option<PendingUpgrade>,
    /// Where a stopped job resumes from.
    pub recovery_point: Option<SnapshotRef>,
    /// Relaunches so far.
    pub relaunch_count: u32,
    /// When the last relaunch happened.
    pub last_relaunch_ms: Option<u64>,
    /// Last handled restart nonce.
    pub observed_restart_nonce: Option<i64>,
    /// Last handled savepoint nonce.
    pub observed_savepoint_nonce: Option<i64>,
    /// The newest savepoint.
    pub latest_savepoint: Option<SnapshotRef>,
    /// Savepoints taken, newest first, with their completion times (ms).
    pub savepoint_history: Vec<(SnapshotRef, u64)>,
    /// When the last savepoint was taken.
    pub last_savepoint_ms: Option<u64>,
}

/// A step for the reconciler to carry out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Create the pods (and their Service and ConfigMap) for the desired spec.
    Deploy {
        /// The snapshot to restore (`snapshot`), or the one the operator saw (`latest`).
        restore_from: Option<SnapshotRef>,
        /// How to restore.
        mode: RestoreMode,
    },
    /// Ask the runtime for a savepoint; `stop` ends the job after it.
    RequestSavepoint {
        /// Stop with the savepoint.
        stop: bool,
    },
    /// Delete the pods (each with its uid as a precondition, so a replacement pod of the same
    /// name is never deleted by mistake); `grace_seconds: Some(KILL_GRACE_SECONDS)` kills them.
    /// The pod object stays until the kubelet confirms its containers are gone, and a
    /// replacement is only deployed once it is gone.
    DeletePods {
        /// Termination grace period override.
        grace_seconds: Option<i64>,
    },
    /// Delete a savepoint that left the history (by count or age).
    DeleteSavepoint {
        /// Its path.
        path: String,
    },
}

/// The reason of an event on a StreamJob: the planner's transitions, and what the controller
/// reports around them. Metrics count by it; `as_str` is the Event's reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventReason {
    /// Pods are being created (first deploy, resume, relaunch).
    Deploying,
    /// A spec change is being applied.
    Upgrading,
    /// The new spec is running.
    Upgraded,
    /// A savepoint was requested from the runtime.
    SavepointRequested,
    /// A savepoint completed.
    SavepointCompleted,
    /// A savepoint failed; the job keeps running.
    SavepointFailed,
    /// The savepoint of a cancel or suspend failed or timed out: the pods were killed.
    SavepointFailedPodsKilled,
    /// The savepoint before an upgrade failed: the previous spec keeps running.
    UpgradeSavepointFailed,
    /// A spec whose job could not read the job's state was not applied: the previous spec
    /// keeps running, or a stopped job stays stopped.
    UpgradeRefused,
    /// The job failed and is relaunched from its newest valid checkpoint.
    Relaunching,
    /// The job failed more often than `relaunch.limit`.
    RelaunchLimitReached,
    /// The newest checkpoint is older than `relaunch.maxCheckpointAge`.
    CheckpointTooOld,
    /// A restore moved published output outside the restored history under `_superseded/`.
    OutputSuperseded,
    /// The spec or job graph breaks a rule.
    InvalidJob,
    /// A referenced ConfigMap or key is missing.
    MissingConfigMap,
    /// The credentials Secret is missing.
    MissingSecret,
    /// The initial savepoint is missing.
    MissingSavepoint,
    /// The initial savepoint holds state the job cannot read.
    IncompatibleSavepoint,
    /// The credentials Secret has keys Weir does not take.
    ForbiddenCredentials,
    /// A storage path of the job is outside the storage its namespace may use.
    StorageNotAllowed,
    /// An object of a child's name exists and is not the job's own: it is left alone and
    /// nothing is deployed.
    NameConflict,
    /// A runtime reported a savepoint outside the job's storage: it is not used.
    ForeignSavepoint,
    /// The job was deleted with `weir.dev/force-delete`: its finalizer was removed without
    /// the stop it stands for.
    ForceDeleted,
    /// A reconcile failed (API or storage error); it is retried.
    ReconcileFailed,
}

impl EventReason {
    /// The CamelCase reason written on the Event.
    pub fn as_str(self) -> &'static str {
        match self {
            EventReason::Deploying => "Deploying",
            EventReason::Upgrading => "Upgrading",
            EventReason::Upgraded => "Upgraded",
            EventReason::SavepointRequested => "SavepointRequested",
            EventReason::SavepointCompleted => "SavepointCompleted",
            EventReason::SavepointFailed => "SavepointFailed",
            EventReason::SavepointFailedPodsKilled => "SavepointFailedPodsKilled",
            EventReason::UpgradeSavepointFailed => "UpgradeSavepointFailed",
            EventReason::UpgradeRefused => "UpgradeRefused",
            EventReason::Relaunching => "Relaunching",
            EventReason::RelaunchLimitReached => "RelaunchLimitReached",
            EventReason::CheckpointTooOld => "CheckpointTooOld",
            EventReason::OutputSuperseded => "OutputSuperseded",
            EventReason::InvalidJob => "InvalidJob",
            EventReason::MissingConfigMap => "MissingConfigMap",
            EventReason::MissingSecret => "MissingSecret",
            EventReason::MissingSavepoint => "MissingSavepoint",
            EventReason::IncompatibleSavepoint => "IncompatibleSavepoint",
            EventReason::ForbiddenCredentials => "ForbiddenCredentials",
            EventReason::StorageNotAllowed => "StorageNotAllowed",
            EventReason::NameConflict => "NameConflict",
            EventReason::ForeignSavepoint => "ForeignSavepoint",
            EventReason::ForceDeleted => "ForceDeleted",
            EventReason::ReconcileFailed => "ReconcileFailed",
        }
    }
}

/// An event to record on the StreamJob.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedEvent {
    /// Warning (true) or Normal.
    pub warning: bool,
    /// Why: the event's reason, and what metrics count.
    pub reason: EventReason,
    /// What happened and why.
    pub message: String,
}

/// The planner's decision.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Plan {
    /// Steps, in order.
    pub actions: Vec<Action>,
    /// The status to write.
    pub state: PlanState,
    /// Events to record.
    pub events: Vec<PlannedEvent>,
    /// Message for the Degraded condition, when degraded.
    pub degraded: Option<String>,
    /// Reconcile again after this long (ms) even without a change.
    pub requeue_after_ms: Option<u64>,
}

impl Plan {
    fn event(&mut self, warning: bool, reason: EventReason, message: impl Into<String>) {
        self.events.push(PlannedEvent { warning, reason, message: message.into() });
    }
}

/// The desired spec with its identity. The spec hash covers every field whose change needs a
/// redeploy, `restartNonce` included: changing the nonce redeploys through `upgradeMode` like
/// any other change.
#[derive(Clone, Debug)]
pub struct Desired<'a> {
    /// The spec.
    pub spec: &'a StreamJobSpec,
    /// metadata.generation.
    pub generation: i64,
    /// Hash of the spec parts that need a redeploy when they change.
    pub spec_hash: &'a str,
    /// The runtime's job as the spec asks for it (`None` when it is not known): an upgrade
    /// whose job cannot read the state of the running one is refused before anything stops.
    pub job: Option<&'a weir_crds::ValidatedJob>,
}

/// Grace period of a kill (after a failed savepoint, or before a relaunch): short, but not
/// zero, because a zero grace period force-deletes the pod object while its container may
/// still run on an unreachable node, and a replacement of the same name could start beside it.
pub const KILL_GRACE_SECONDS: i64 = 5;

/// Re-check interval while waiting on something that sends no watch event (a savepoint).
const POLL_MS: u64 = 2_000;
/// Fallback re-check while waiting on pods: pod changes wake the controller through its watch.
const WATCH_MS: u64 = 30_000;

fn newest_valid(obs: &Observation) -> Option<&FoundCheckpoint> {
    obs.checkpoints.iter().find(|c| c.invalid.is_none())
}

/// Whether [`plan`] can depend on the checkpoints in storage for this observation (whose
/// `checkpoints` need not be filled yet). Listing and verifying checkpoints reads the job's
/// storage, so the reconciler does it only when the decision can use it: a relaunch, a
/// last-state upgrade, a resume without a recovery point, a stop of pods that do not run, or a
/// stop whose savepoint failed or timed out (the kill names the recovery checkpoint).
pub fn needs_checkpoints(desired: &Desired<'_>, current: &PlanState, obs: &Observation) -> bool {
    let spec = desired.spec;
    if let Some(op) = &current.operation {
        let timed_out = obs.now_ms.saturating_sub(op.started_at_ms) > spec.savepoint.timeout.as_millis();
        let failing = timed_out || matches!(obs.savepoint, Some(SavepointProgress::Failed(_)));
        return failing
            && matches!(op.kind, OperationKind::Suspend | OperationKind::Cancel)
            && spec.savepoint.on_cancel_failure == OnSavepointFailure::Kill;
    }
    if spec.state != DesiredState::Running {
        return current.recovery_point.is_none() && !matches!(obs.pods, PodsPhase::Absent | PodsPhase::Running);
    }
    if let Some(up) = &current.pending_upgrade {
        // Only a relaunch of the new pods, failed before they ran, reads them.
        let new_pods = obs.pods_spec_hash.as_deref() == Some(up.target_spec_hash.as_str());
        return new_pods && matches!(obs.pods, PodsPhase::Failed(_)) && current.relaunch_count < spec.relaunch.limit;
    }
    match &obs.pods {
        // A deploy that restores the job's own state, checked against its checkpoints.
        PodsPhase::Absent => {
            current.phase != Some(Phase::Finished) && (current.phase.is_some() || spec.initial_savepoint.is_none())
        }
        PodsPhase::Failed(_) => current.relaunch_count < spec.relaunch.limit,
        // A stateful upgrade: restored from the newest checkpoint (last-state), and checked
        // against the state the checkpoints hold before anything stops (both).
        PodsPhase::Running => {
            spec.upgrade_mode != UpgradeMode::Stateless && obs.pods_spec_hash.as_deref() != Some(desired.spec_hash)
        }
        PodsPhase::Starting | PodsPhase::Terminating | PodsPhase::Succeeded => false,
    }
}

/// Decides the next step.
pub fn plan(desired: &Desired<'_>, current: &PlanState, obs: &Observation) -> Plan {
    let mut p = Plan { state: current.clone(), ..Plan::default() };
    let spec = desired.spec;
    let pods_exist = !matches!(obs.pods, PodsPhase::Absent);

    // 1. A savepoint operation in flight decides everything until it ends.
    if let Some(op) = current.operation.clone() {
        return continue_operation(desired, current, obs, op, p);
    }

    // 2. Stop requests.
    if spec.state != DesiredState::Running {
        let (stopping, stopped, kind) = match spec.state {
            DesiredState::Suspended => (Phase::Suspending, Phase::Suspended, OperationKind::Suspend),
            _ => (Phase::Cancelling, Phase::Cancelled, OperationKind::Cancel),
        };
        if pods_exist && current.recovery_point.is_some() {
            // The stop already happened (its savepoint, or the kill, named the recovery point):
            // the pods only have to go, even if they still look running for a moment.
            p.actions.push(Action::DeletePods { grace_seconds: None });
            p.state.phase = Some(stopping);
            p.requeue_after_ms = Some(WATCH_MS);
        } else if matches!(obs.pods, PodsPhase::Running) {
            p.actions.push(Action::RequestSavepoint { stop: true });
            p.state.operation = Some(Operation { kind, started_at_ms: obs.now_ms, generation: desired.generation });
            p.state.phase = Some(stopping);
            p.event(
                false,
                EventReason::SavepointRequested,
                format!("taking a savepoint to {}", if kind == OperationKind::Suspend { "suspend" } else { "cancel" }),
            );
            p.requeue_after_ms = Some(POLL_MS);
        } else if pods_exist {
            // Never ran (starting, failed): nothing to save; the newest valid checkpoint is the
            // recovery point.
            p.actions.push(Action::DeletePods { grace_seconds: None });
            p.state.recovery_point = newest_valid(obs).map(|c| c.snapshot.clone());
            p.state.phase = Some(stopping);
            p.requeue_after_ms = Some(WATCH_MS);
        } else {
            p.state.phase = Some(stopped);
        }
        return p;
    }

    // 3. A write-ahead upgrade resumes wherever it stopped.
    if let Some(up) = current.pending_upgrade.clone() {
        let old_pods = pods_exist && obs.pods_spec_hash.as_deref() != Some(up.target_spec_hash.as_str());
        p.state.phase = Some(Phase::Upgrading);
        if old_pods {
            p.actions.push(Action::DeletePods { grace_seconds: None });
            p.requeue_after_ms = Some(WATCH_MS);
        } else if !pods_exist {
            let mode = up.restore_mode();
            p.actions.push(Action::Deploy { restore_from: up.restore_from.clone(), mode });
            p.event(
                false,
                EventReason::Deploying,
                format!("deploying generation {} from {}", up.target_generation, describe(&up.restore_from, mode)),
            );
            p.requeue_after_ms = Some(WATCH_MS);
        } else if matches!(obs.pods, PodsPhase::Running) {
            p.state.pending_upgrade = None;
            p.state.phase = Some(Phase::Running);
            p.event(false, EventReason::Upgraded, format!("generation {} is running", up.target_generation));
        } else if let PodsPhase::Failed(reason) = &obs.pods {
            // The new pods failed before they ran: a relaunch like any other, counted against
            // `relaunch.limit` and backed off, not a wait for a Running that never comes.
            relaunch(desired, current, obs, reason, &mut p);
        } else if matches!(obs.pods, PodsPhase::Succeeded) {
            // A bounded job that finished before it was seen running.
            p.state.pending_upgrade = None;
            p.state.phase = Some(Phase::Finished);
        } else {
            p.requeue_after_ms = Some(WATCH_MS);
        }
        return p;
    }

    let hash_differs = pods_exist && obs.pods_spec_hash.as_deref() != Some(desired.spec_hash);
    match &obs.pods {
        PodsPhase::Absent => {
            // First deploy, resume after suspend/cancel, or after a kill.
            let (restore, mode) = match current.phase {
                None => match spec.initial_savepoint.clone() {
                    Some(path) => (Some(SnapshotRef { id: 0, path, completed_at: None }), RestoreMode::Snapshot),
                    None => (None, RestoreMode::Latest),
                },
                Some(Phase::Finished) => return p,
                // After a stop: exactly its savepoint. After a kill or a failure: the newest
                // valid restore point, which the runtime verifies (falling back past a corrupt
                // one the operator could not see).
                _ => match current.recovery_point.clone() {
                    Some(sp) if is_savepoint(&sp) => (Some(sp), RestoreMode::Snapshot),
                    other => (other.or_else(|| newest_valid(obs).map(|c| c.snapshot.clone())), RestoreMode::Latest),
                },
            };
            // Resuming (or starting where checkpoints of the job's name remain): the job's
            // own state must fit the spec, as for an upgrade; `spec.initialSavepoint` was
            // checked with the spec (`inputs`).
            let own_state = current.phase.is_some() || spec.initial_savepoint.is_none();
            if let Some(why) = own_state.then(|| state_conflict(desired, obs)).flatten() {
                p.degraded =
                    Some(format!("generation {} is not deployed and the job stays stopped: {why}", desired.generation));
                if current.phase != Some(Phase::Degraded) {
                    p.event(true, EventReason::UpgradeRefused, p.degraded.clone().unwrap_or_default());
                }
                return p;
            }
            p.actions.push(Action::Deploy { restore_from: restore.clone(), mode });
            p.state.phase = Some(Phase::Deploying);
            p.state.recovery_point = None;
            p.event(false, EventReason::Deploying, format!("deploying from {}", describe(&restore, mode)));
            p.requeue_after_ms = Some(WATCH_MS);
        }
        PodsPhase::Succeeded => {
            p.state.phase = Some(Phase::Finished);
        }
        PodsPhase::Failed(reason) => relaunch(desired, current, obs, reason, &mut p),
        PodsPhase::Starting | PodsPhase::Terminating => {
            p.requeue_after_ms = Some(WATCH_MS);
        }
        PodsPhase::Running if hash_differs && upgrade_refused(desired, obs).is_none() => {
            start_upgrade(desired, obs, &mut p)
        }
        PodsPhase::Running => {
            p.state.phase = Some(Phase::Running);
            if let Some(why) = hash_differs.then(|| upgrade_refused(desired, obs)).flatten() {
                // The running generation goes on (savepoints included) until the spec changes.
                p.degraded = Some(format!(
                    "generation {} is not applied and the running job goes on: {why}",
                    desired.generation
                ));
                if current.phase != Some(Phase::Degraded) {
                    p.event(true, EventReason::UpgradeRefused, p.degraded.clone().unwrap_or_default());
                }
            }
            p.state.observed_restart_nonce = spec.restart_nonce;
            let nonce_changed = spec.savepoint.trigger_nonce.is_some()
                && spec.savepoint.trigger_nonce != current.observed_savepoint_nonce;
            let periodic_due = spec.savepoint.periodic_interval.is_some_and(|i| {
                current.last_savepoint_ms.is_none_or(|t| obs.now_ms.saturating_sub(t) >= i.as_millis())
            });
            if nonce_changed || periodic_due {
                p.state.observed_savepoint_nonce = spec.savepoint.trigger_nonce;
                p.state.operation = Some(Operation {
                    kind: OperationKind::Savepoint,
                    started_at_ms: obs.now_ms,
                    generation: desired.generation,
                });
                p.actions.push(Action::RequestSavepoint { stop: false });
                p.event(
                    false,
                    EventReason::SavepointRequested,
                    if nonce_changed { "savepoint.triggerNonce changed" } else { "periodic savepoint due" },
                );
                p.requeue_after_ms = Some(POLL_MS);
            } else if let Some(i) = spec.savepoint.periodic_interval {
                let since = current.last_savepoint_ms.map_or(0, |t| obs.now_ms.saturating_sub(t));
                p.requeue_after_ms = Some(i.as_millis().saturating_sub(since).max(1_000));
            }
            p.state.relaunch_count = current.relaunch_count;
        }
    }
    p
}

/// Drops savepoints beyond `historyMaxCount` or older than `historyMaxAge` from the history
/// and deletes them; the savepoint a stopped job resumes from is never deleted.
fn trim_history(spec: &StreamJobSpec, now_ms: u64, p: &mut Plan) {
    let max_count = spec.savepoint.history_max_count.max(1) as usize;
    let max_age = spec.savepoint.history_max_age.map(|a| a.as_millis());
    let keep_path = p.state.recovery_point.as_ref().map(|r| r.path.clone());
    let mut kept = Vec::new();
    for (i, (sp, at)) in std::mem::take(&mut p.state.savepoint_history).into_iter().enumerate() {
        let too_many = i >= max_count;
        let too_old = i > 0 && max_age.is_some_and(|a| now_ms.saturating_sub(at) > a);
        if (too_many || too_old) && keep_path.as_deref() != Some(sp.path.as_str()) {
            p.actions.push(Action::DeleteSavepoint { path: sp.path.clone() });
        } else {
            kept.push((sp, at));
        }
    }
    p.state.savepoint_history = kept;
}

/// Whether a snapshot is a savepoint (`.../savepoints/sp-<time>-<id>`).
fn is_savepoint(s: &SnapshotRef) -> bool {
    s.path.trim_end_matches('/').rsplit('/').nth(1) == Some(weir_checkpoint::layout::SAVEPOINTS)
}

fn describe(s: &Option<SnapshotRef>, mode: RestoreMode) -> String {
    match (mode, s) {
        (RestoreMode::Fresh, _) => "no state (a fresh start; earlier output and snapshots are kept)".to_string(),
        (RestoreMode::Snapshot, Some(s)) => s.path.clone(),
        (RestoreMode::Latest, Some(s)) => format!("the newest valid restore point (last seen: {})", s.path),
        (_, None) => "the newest valid restore point, if any".to_string(),
    }
}

/// Why a stateful upgrade to `desired` would leave the job unable to restore: the newest valid
/// checkpoint holds state the new job's operators cannot read, or state of operators it no
/// longer has (without `allowNonRestoredState`). Checked before the savepoint is taken and the
/// running job stops, which a restore refused afterwards would leave stopped, failing at
/// each relaunch. `None` for a stateless upgrade (it restores nothing), or when the new job or
/// the state is unknown.
fn upgrade_refused(desired: &Desired<'_>, obs: &Observation) -> Option<String> {
    if desired.spec.upgrade_mode == UpgradeMode::Stateless {
        return None;
    }
    state_conflict(desired, obs)
}

/// Why the job of `desired` cannot read the state the newest valid checkpoint holds (see
/// [`weir_crds::compat::restore_conflict`]); `None` when it can, or when the job or the state
/// is unknown.
fn state_conflict(desired: &Desired<'_>, obs: &Observation) -> Option<String> {
    let (job, newest) = (desired.job?, newest_valid(obs)?);
    let allow = desired.spec.allow_non_restored_state;
    weir_crds::compat::restore_conflict(job, &newest.state_layouts, allow)
        .err()
        .map(|why| format!("checkpoint {}: {why}", newest.snapshot.id))
}

fn start_upgrade(desired: &Desired<'_>, obs: &Observation, p: &mut Plan) {
    p.state.phase = Some(Phase::Upgrading);
    match desired.spec.upgrade_mode {
        UpgradeMode::Savepoint => {
            p.actions.push(Action::RequestSavepoint { stop: true });
            p.state.operation = Some(Operation {
                kind: OperationKind::Upgrade,
                started_at_ms: obs.now_ms,
                generation: desired.generation,
            });
            p.event(
                false,
                EventReason::SavepointRequested,
                format!("spec changed (generation {}): stopping with a savepoint", desired.generation),
            );
            p.requeue_after_ms = Some(POLL_MS);
        }
        UpgradeMode::LastState | UpgradeMode::Stateless => {
            let (from, mode) = if desired.spec.upgrade_mode == UpgradeMode::LastState {
                (newest_valid(obs).map(|c| c.snapshot.clone()), RestoreMode::Latest)
            } else {
                (None, RestoreMode::Fresh)
            };
            // Write-ahead: the next reconcile deletes the pods.
            p.state.pending_upgrade = Some(PendingUpgrade {
                target_generation: desired.generation,
                target_spec_hash: desired.spec_hash.to_string(),
                restore_from: from,
                restore: Some(mode),
            });
            p.event(
                false,
                EventReason::Upgrading,
                format!(
                    "spec changed (generation {}): redeploying ({:?})",
                    desired.generation, desired.spec.upgrade_mode
                ),
            );
            p.requeue_after_ms = Some(0);
        }
    }
}

fn relaunch(desired: &Desired<'_>, current: &PlanState, obs: &Observation, reason: &str, p: &mut Plan) {
    let policy = &desired.spec.relaunch;
    if current.relaunch_count >= policy.limit {
        p.state.phase = Some(Phase::Failed);
        p.degraded = Some(format!("the job failed ({reason}) and the relaunch limit ({}) is reached", policy.limit));
        if current.phase != Some(Phase::Failed) {
            p.event(true, EventReason::RelaunchLimitReached, p.degraded.clone().unwrap_or_default());
        }
        return;
    }
    let newest = newest_valid(obs);
    if let (Some(max_age), Some(c)) = (desired.spec.relaunch.max_checkpoint_age, newest) {
        let age = obs.now_ms.saturating_sub(c.completed_at_ms);
        if age > max_age.as_millis() {
            p.state.phase = Some(Phase::Degraded);
            p.degraded = Some(format!(
                "the job failed ({reason}); its newest valid checkpoint {} is {}s old, \
                 older than relaunch.maxCheckpointAge {max_age}: not relaunching",
                c.snapshot.id,
                age / 1000
            ));
            if current.phase != Some(Phase::Degraded) {
                p.event(true, EventReason::CheckpointTooOld, p.degraded.clone().unwrap_or_default());
            }
            return;
        }
    }
    let backoff = policy
        .backoff
        .as_millis()
        .saturating_mul(1u64 << current.relaunch_count.min(20))
        .min(policy.max_backoff.as_millis());
    if let Some(last) = current.last_relaunch_ms {
        let wait = (last + backoff).saturating_sub(obs.now_ms);
        if wait > 0 && current.relaunch_count > 0 {
            p.state.phase = Some(Phase::Relaunching);
            p.requeue_after_ms = Some(wait);
            return;
        }
    }
    let skipped: Vec<String> = obs
        .checkpoints
        .iter()
        .take_while(|c| c.invalid.is_some())
        .map(|c| format!("{} ({})", c.snapshot.id, c.invalid.as_deref().unwrap_or("")))
        .collect();
    let from = newest.map(|c| c.snapshot.clone()).or_else(|| current.recovery_point.clone());
    p.actions.push(Action::DeletePods { grace_seconds: Some(KILL_GRACE_SECONDS) });
    // The runtime picks the restore point: it verifies every file (the operator checked
    // lengths only) and falls back past a corrupt one instead of crash-looping on it.
    p.state.pending_upgrade = Some(PendingUpgrade {
        target_generation: desired.generation,
        target_spec_hash: desired.spec_hash.to_string(),
        restore_from: from.clone(),
        restore: Some(RestoreMode::Latest),
    });
    p.state.relaunch_count = current.relaunch_count + 1;
    p.state.last_relaunch_ms = Some(obs.now_ms);
    p.state.phase = Some(Phase::Relaunching);
    let mut msg = format!("the job failed ({reason}): relaunching from {}", describe(&from, RestoreMode::Latest));
    if !skipped.is_empty() {
        msg.push_str(&format!(", skipping invalid checkpoint(s) {}", skipped.join(", ")));
    }
    p.event(true, EventReason::Relaunching, msg);
    p.requeue_after_ms = Some(0);
}

fn continue_operation(
    desired: &Desired<'_>,
    current: &PlanState,
    obs: &Observation,
    op: Operation,
    mut p: Plan,
) -> Plan {
    let spec = desired.spec;
    let timed_out = obs.now_ms.saturating_sub(op.started_at_ms) > spec.savepoint.timeout.as_millis();
    let progress = obs.savepoint.clone().unwrap_or(SavepointProgress::InProgress);
    let failure = match (&progress, timed_out) {
        (SavepointProgress::Failed(r), _) => Some(r.clone()),
        (SavepointProgress::InProgress, true) => {
            Some(format!("no savepoint after savepoint.timeout {}", spec.savepoint.timeout))
        }
        _ => None,
    };
    match (op.kind, progress, failure) {
        (_, SavepointProgress::Completed(sp), _) => {
            p.state.operation = None;
            p.state.latest_savepoint = Some(sp.clone());
            p.state.last_savepoint_ms = Some(obs.now_ms);
            p.state.savepoint_history.insert(0, (sp.clone(), obs.now_ms));
            trim_history(spec, obs.now_ms, &mut p);
            p.event(false, EventReason::SavepointCompleted, format!("savepoint {} taken", sp.path));
            match op.kind {
                OperationKind::Savepoint => {}
                OperationKind::Upgrade => {
                    // Write-ahead: record where the new spec restores from before deleting.
                    p.state.pending_upgrade = Some(PendingUpgrade {
                        target_generation: desired.generation,
                        target_spec_hash: desired.spec_hash.to_string(),
                        restore_from: Some(sp),
                        restore: Some(RestoreMode::Snapshot),
                    });
                    p.state.phase = Some(Phase::Upgrading);
                    p.requeue_after_ms = Some(0);
                }
                OperationKind::Suspend | OperationKind::Cancel => {
                    p.state.recovery_point = Some(sp);
                    p.actions.push(Action::DeletePods { grace_seconds: None });
                    p.state.phase =
                        Some(if op.kind == OperationKind::Suspend { Phase::Suspending } else { Phase::Cancelling });
                    p.requeue_after_ms = Some(WATCH_MS);
                }
            }
        }
        (kind, _, Some(reason)) => {
            p.state.operation = None;
            match kind {
                OperationKind::Suspend | OperationKind::Cancel
                    if spec.savepoint.on_cancel_failure == OnSavepointFailure::Kill =>
                {
                    let recovery = newest_valid(obs).map(|c| c.snapshot.clone());
                    p.actions.push(Action::DeletePods { grace_seconds: Some(KILL_GRACE_SECONDS) });
                    p.state.recovery_point = recovery.clone();
                    p.state.phase =
                        Some(if kind == OperationKind::Suspend { Phase::Suspending } else { Phase::Cancelling });
                    p.event(
                        true,
                        EventReason::SavepointFailedPodsKilled,
                        format!(
                            "savepoint failed ({reason}): pods killed; the job resumes from {}",
                            describe(&recovery, RestoreMode::Latest)
                        ),
                    );
                    p.requeue_after_ms = Some(WATCH_MS);
                }
                OperationKind::Upgrade => {
                    p.state.phase = Some(Phase::Degraded);
                    p.degraded = Some(format!(
                        "upgrade to generation {} not applied: savepoint failed ({reason}); \
                         the previous spec keeps running",
                        desired.generation
                    ));
                    p.event(true, EventReason::UpgradeSavepointFailed, p.degraded.clone().unwrap_or_default());
                }
                _ => {
                    p.state.phase = Some(Phase::Running);
                    p.event(true, EventReason::SavepointFailed, format!("savepoint failed: {reason}"));
                }
            }
        }
        (_, SavepointProgress::InProgress, None) | (_, SavepointProgress::Failed(_), None) => {
            p.requeue_after_ms = Some(POLL_MS);
            let _ = current;
        }
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_crds::streamjob::{JobSource, StreamJobSpec};
    use weir_crds::HumanDuration;

    fn spec() -> StreamJobSpec {
        StreamJobSpec {
            image: "weir:dev".into(),
            image_pull_policy: None,
            parallelism: 2,
            max_parallelism: None,
            job: JobSource::default(),
            state: DesiredState::Running,
            upgrade_mode: UpgradeMode::Savepoint,
            checkpointing: Default::default(),
            savepoint: Default::default(),
            restart_nonce: None,
            initial_savepoint: None,
            allow_non_restored_state: false,
            relaunch: Default::default(),
            state_backend: Default::default(),
            state_cache_entries: None,
            resources: None,
            pod_template: None,
        }
    }

    fn snap(id: u64) -> SnapshotRef {
        SnapshotRef { id, path: format!("s3://b/ns/j/checkpoints/chk-{id}"), completed_at: None }
    }

    fn sp(id: u64) -> SnapshotRef {
        SnapshotRef { id, path: format!("s3://b/ns/j/savepoints/sp-1700000000000-{id}"), completed_at: None }
    }

    fn chk(id: u64, at: u64, invalid: Option<&str>) -> FoundCheckpoint {
        FoundCheckpoint {
            snapshot: snap(id),
            completed_at_ms: at,
            invalid: invalid.map(str::to_string),
            state_layouts: BTreeMap::new(),
        }
    }

    fn obs(pods: PodsPhase, hash: Option<&str>) -> Observation {
        Observation {
            now_ms: 1_000_000,
            pods,
            pods_spec_hash: hash.map(str::to_string),
            savepoint: None,
            checkpoints: vec![],
        }
    }

    fn running(hash: &str) -> Observation {
        obs(PodsPhase::Running, Some(hash))
    }

    fn desired<'a>(s: &'a StreamJobSpec, hash: &'a str) -> Desired<'a> {
        Desired { spec: s, generation: 2, spec_hash: hash, job: None }
    }

    fn state(phase: Phase) -> PlanState {
        PlanState { phase: Some(phase), ..PlanState::default() }
    }

    /// A job counting per key with `aggregates`, its operator's uid `counts`.
    fn counting_job(aggregates: &str) -> weir_crds::ValidatedJob {
        let yaml = format!(
            "name: j\nsources: [ {{ name: s, uid: s, generator: {{ fields: [ {{ name: k, modulo: 5 }} ] }} }} ]\n\
             operators:\n  - {{ name: by-k, keyBy: {{ fields: [k] }} }}\n  \
             - {{ name: counts, uid: counts, aggregate: {{ aggregates: [ {aggregates} ] }} }}\n\
             sinks: [ {{ name: out, uid: out, blackhole: {{}} }} ]\n"
        );
        weir_crds::validate(&weir_crds::JobSpec::from_yaml(&yaml).unwrap()).unwrap()
    }

    /// `c` holding the state of a job that counts (`aggregate[count]` under uid `counts`).
    fn holding_a_count(mut c: FoundCheckpoint) -> FoundCheckpoint {
        c.state_layouts = [
            ("s".to_string(), Some("generator".to_string())),
            ("counts".to_string(), Some("aggregate[count]".to_string())),
        ]
        .into();
        c
    }

    /// `needs_checkpoints` must be true whenever the checkpoints can change the plan: checked
    /// by planning each case with no checkpoint and with a valid and an invalid one.
    #[test]
    fn storage_is_read_whenever_checkpoints_can_change_the_plan() {
        let pods = [
            PodsPhase::Absent,
            PodsPhase::Starting,
            PodsPhase::Running,
            PodsPhase::Failed("exit 1".into()),
            PodsPhase::Succeeded,
            PodsPhase::Terminating,
        ];
        let progress = [
            None,
            Some(SavepointProgress::InProgress),
            Some(SavepointProgress::Failed("x".into())),
            Some(SavepointProgress::Completed(snap(40))),
        ];
        let kinds = [OperationKind::Upgrade, OperationKind::Suspend, OperationKind::Cancel, OperationKind::Savepoint];
        let mut states = vec![
            PlanState::default(),
            state(Phase::Running),
            state(Phase::Finished),
            state(Phase::Suspended),
            PlanState { relaunch_count: 10, ..state(Phase::Running) },
        ];
        states.push(PlanState { recovery_point: Some(snap(3)), ..state(Phase::Suspended) });
        states.push(PlanState {
            pending_upgrade: Some(PendingUpgrade {
                target_generation: 2,
                target_spec_hash: "h2".into(),
                restore_from: None,
                restore: None,
            }),
            ..state(Phase::Upgrading)
        });
        for started in [999_000, 0] {
            for kind in kinds {
                states.push(PlanState {
                    operation: Some(Operation { kind, started_at_ms: started, generation: 2 }),
                    ..state(Phase::Running)
                });
            }
        }
        let mut reads = 0;
        let mut cases = 0;
        for desired_state in [DesiredState::Running, DesiredState::Suspended, DesiredState::Cancelled] {
            for mode in [UpgradeMode::Savepoint, UpgradeMode::LastState, UpgradeMode::Stateless] {
                let mut s = spec();
                s.state = desired_state;
                s.upgrade_mode = mode;
                s.relaunch.limit = 10;
                let counting_and_summing = counting_job("{ fn: count, as: n }, { fn: sum, field: k, as: t }");
                let d = Desired { job: Some(&counting_and_summing), ..desired(&s, "h2") };
                for current in &states {
                    for phase in &pods {
                        for hash in [Some("h1"), Some("h2")] {
                            for sp in &progress {
                                let base = Observation { savepoint: sp.clone(), ..obs(phase.clone(), hash) };
                                let without = plan(&d, current, &base);
                                let mut changed = false;
                                for found in [
                                    vec![chk(9, 999_000, None)],
                                    vec![chk(9, 999_000, Some("corrupt")), chk(8, 998_000, None)],
                                    vec![holding_a_count(chk(9, 999_000, None))],
                                ] {
                                    let with = plan(&d, current, &Observation { checkpoints: found, ..base.clone() });
                                    changed |= with != without;
                                }
                                let needed = needs_checkpoints(&d, current, &base);
                                assert!(
                                    needed || !changed,
                                    "checkpoints change the plan but are not read: \
                                     {desired_state:?} {mode:?} {current:?} {phase:?} {hash:?} {sp:?}"
                                );
                                reads += needed as usize;
                                cases += 1;
                            }
                        }
                    }
                }
            }
        }
        assert!(reads > 0 && reads < cases, "storage read in {reads} of {cases} cases");
        // Steady and waiting states do not read storage.
        let s = spec();
        let d = desired(&s, "h1");
        assert!(!needs_checkpoints(&d, &state(Phase::Running), &running("h1")));
        assert!(!needs_checkpoints(&d, &state(Phase::Deploying), &obs(PodsPhase::Starting, Some("h1"))));
        let op = PlanState {
            operation: Some(Operation { kind: OperationKind::Cancel, started_at_ms: 999_000, generation: 2 }),
            ..state(Phase::Cancelling)
        };
        assert!(!needs_checkpoints(
            &d,
            &op,
            &Observation { savepoint: Some(SavepointProgress::InProgress), ..running("h1") }
        ));
        assert!(needs_checkpoints(
            &d,
            &op,
            &Observation { savepoint: Some(SavepointProgress::Failed("disk full".into())), ..running("h1") }
        ));
        assert!(needs_checkpoints(&d, &state(Phase::Running), &obs(PodsPhase::Failed("exit 137".into()), Some("h1"))));
    }

    #[test]
    fn first_deploy_restores_the_initial_savepoint() {
        let mut s = spec();
        s.initial_savepoint = Some("s3://b/sp".into());
        let p = plan(&desired(&s, "h1"), &PlanState::default(), &obs(PodsPhase::Absent, None));
        assert_eq!(
            p.actions,
            vec![Action::Deploy {
                restore_from: Some(SnapshotRef { id: 0, path: "s3://b/sp".into(), completed_at: None }),
                mode: RestoreMode::Snapshot
            }]
        );
        assert_eq!(p.state.phase, Some(Phase::Deploying));
    }

    #[test]
    fn steady_running_does_nothing() {
        let s = spec();
        let p = plan(&desired(&s, "h1"), &state(Phase::Running), &running("h1"));
        assert!(p.actions.is_empty());
        assert_eq!(p.state.phase, Some(Phase::Running));
    }

    /// A stateful upgrade whose job cannot read the state of the running one (the newest
    /// valid checkpoint's) is refused before the savepoint: nothing stops, the job is
    /// Degraded saying which uid and why, with one Warning event; periodic savepoints go on;
    /// the spec reverted, it is Running again. A stateless upgrade is not checked, and an
    /// upgrade the state allows goes ahead.
    #[test]
    fn an_upgrade_whose_job_cannot_read_the_state_is_refused_and_the_old_job_goes_on() {
        let mut s = spec();
        s.savepoint.periodic_interval = Some(HumanDuration::from_secs(60));
        let summing = counting_job("{ fn: count, as: n }, { fn: sum, field: k, as: t }");
        let d = Desired { job: Some(&summing), ..desired(&s, "h2") };
        let o = Observation {
            checkpoints: vec![
                holding_a_count(chk(9, 999_000, Some("corrupt"))),
                holding_a_count(chk(8, 998_000, None)),
            ],
            ..running("h1")
        };
        let current = PlanState { last_savepoint_ms: Some(999_500), ..state(Phase::Running) };
        let p = plan(&d, &current, &o);
        assert!(p.actions.is_empty(), "nothing stops: {:?}", p.actions);
        assert!(p.state.operation.is_none() && p.state.pending_upgrade.is_none());
        let why = p.degraded.clone().expect("degraded");
        assert!(
            why.starts_with(
                "generation 2 is not applied and the running job goes on: checkpoint 8: operator uid `counts` \
                 holds aggregate[count] state in the snapshot and is aggregate[count,sum] in the job"
            ),
            "{why}"
        );
        assert_eq!(p.events.len(), 1, "{:?}", p.events);
        assert!(p.events[0].warning && p.events[0].reason == EventReason::UpgradeRefused && p.events[0].message == why);
        // Reported once; the job's periodic savepoint still comes when due.
        let again = plan(&d, &PlanState { phase: Some(Phase::Degraded), ..current.clone() }, &o);
        assert!(again.events.is_empty() && again.degraded == p.degraded, "{:?}", again.events);
        let due = PlanState { last_savepoint_ms: Some(900_000), phase: Some(Phase::Degraded), ..current.clone() };
        assert_eq!(plan(&d, &due, &o).actions, vec![Action::RequestSavepoint { stop: false }]);
        // Reverted: running, nothing degraded.
        let reverted = plan(&d, &again.state, &running("h2"));
        assert!(reverted.degraded.is_none() && reverted.state.phase == Some(Phase::Running));

        // Renamed outputs read the same state: the upgrade goes ahead.
        let renamed = counting_job("{ fn: count, as: total }");
        let ok = plan(&Desired { job: Some(&renamed), ..desired(&s, "h2") }, &current, &o);
        assert_eq!(ok.actions, vec![Action::RequestSavepoint { stop: true }]);
        assert!(ok.degraded.is_none());
        // A dropped uid needs allowNonRestoredState.
        let without_counts = weir_crds::validate(
            &weir_crds::JobSpec::from_yaml(
                "name: j\nsources: [ { name: s, uid: s, generator: { fields: [ { name: k, modulo: 5 } ] } } ]\n\
                 sinks: [ { name: out, uid: out, blackhole: {} } ]\n",
            )
            .unwrap(),
        )
        .unwrap();
        let dropped = plan(&Desired { job: Some(&without_counts), ..desired(&s, "h2") }, &current, &o);
        assert!(dropped.degraded.as_deref().is_some_and(|m| m.contains("allowNonRestoredState")), "{dropped:?}");
        let mut allowing = s.clone();
        allowing.allow_non_restored_state = true;
        let allowed = plan(&Desired { job: Some(&without_counts), ..desired(&allowing, "h2") }, &current, &o);
        assert_eq!(allowed.actions, vec![Action::RequestSavepoint { stop: true }]);
        // A stateless upgrade restores nothing: not checked.
        let mut stateless = s.clone();
        stateless.upgrade_mode = UpgradeMode::Stateless;
        let fresh = plan(&Desired { job: Some(&summing), ..desired(&stateless, "h2") }, &current, &o);
        assert!(fresh.degraded.is_none() && fresh.state.pending_upgrade.is_some(), "{fresh:?}");
    }

    #[test]
    fn savepoint_upgrade_writes_ahead_then_deletes_then_deploys() {
        let s = spec();
        let d = desired(&s, "h2");
        // Spec changed: stop with a savepoint.
        let p1 = plan(&d, &state(Phase::Running), &running("h1"));
        assert_eq!(p1.actions, vec![Action::RequestSavepoint { stop: true }]);
        assert_eq!(p1.state.operation.as_ref().unwrap().kind, OperationKind::Upgrade);
        // Savepoint done: only status changes (write-ahead), nothing deleted yet.
        let mut o = running("h1");
        o.savepoint = Some(SavepointProgress::Completed(snap(7)));
        let p2 = plan(&d, &p1.state, &o);
        assert!(p2.actions.is_empty(), "{:?}", p2.actions);
        assert_eq!(p2.state.pending_upgrade.as_ref().unwrap().restore_from, Some(snap(7)));
        // Next: old pods are deleted, then the new spec deployed from the savepoint.
        let p3 = plan(&d, &p2.state, &running("h1"));
        assert_eq!(p3.actions, vec![Action::DeletePods { grace_seconds: None }]);
        let p4 = plan(&d, &p3.state, &obs(PodsPhase::Absent, None));
        assert_eq!(
            p4.actions,
            vec![Action::Deploy { restore_from: Some(snap(7)), mode: RestoreMode::Snapshot }],
            "exactly the upgrade's savepoint"
        );
        let p5 = plan(&d, &p4.state, &running("h2"));
        assert!(p5.state.pending_upgrade.is_none());
        assert_eq!(p5.state.phase, Some(Phase::Running));
    }

    #[test]
    fn operator_restarted_mid_upgrade_resumes_from_the_write_ahead_status() {
        let s = spec();
        let d = desired(&s, "h2");
        // The status says: upgrade to h2 from savepoint 7; pods were already deleted.
        let st = PlanState {
            phase: Some(Phase::Upgrading),
            pending_upgrade: Some(PendingUpgrade {
                target_generation: 2,
                target_spec_hash: "h2".into(),
                restore_from: Some(snap(7)),
                restore: None,
            }),
            ..PlanState::default()
        };
        assert_eq!(
            plan(&d, &st, &obs(PodsPhase::Absent, None)).actions,
            vec![Action::Deploy { restore_from: Some(snap(7)), mode: RestoreMode::Snapshot }]
        );
        // Or the old pods are still there: delete them, never take a second savepoint.
        assert_eq!(plan(&d, &st, &running("h1")).actions, vec![Action::DeletePods { grace_seconds: None }]);
    }

    #[test]
    fn last_state_and_stateless_upgrades() {
        let mut s = spec();
        s.upgrade_mode = UpgradeMode::LastState;
        let mut o = running("h1");
        o.checkpoints = vec![chk(9, 999_000, None)];
        let p = plan(&desired(&s, "h2"), &state(Phase::Running), &o);
        let up = p.state.pending_upgrade.unwrap();
        assert_eq!((up.restore_from.clone(), up.restore_mode()), (Some(snap(9)), RestoreMode::Latest));
        // Stateless starts without state: not from the newest checkpoint (it used to, as the
        // runtime's `--restore latest`).
        s.upgrade_mode = UpgradeMode::Stateless;
        let p = plan(&desired(&s, "h2"), &state(Phase::Running), &o);
        let up = p.state.pending_upgrade.clone().unwrap();
        assert_eq!((up.restore_from.clone(), up.restore_mode()), (None, RestoreMode::Fresh));
        let p = plan(&desired(&s, "h2"), &p.state, &obs(PodsPhase::Absent, None));
        assert_eq!(p.actions, vec![Action::Deploy { restore_from: None, mode: RestoreMode::Fresh }]);
    }

    #[test]
    fn suspend_takes_a_savepoint_then_deletes_and_resume_restores_it() {
        let mut s = spec();
        s.state = DesiredState::Suspended;
        let d = desired(&s, "h1");
        let p1 = plan(&d, &state(Phase::Running), &running("h1"));
        assert_eq!(p1.actions, vec![Action::RequestSavepoint { stop: true }]);
        let mut o = running("h1");
        o.savepoint = Some(SavepointProgress::Completed(sp(4)));
        let p2 = plan(&d, &p1.state, &o);
        assert_eq!(p2.actions, vec![Action::DeletePods { grace_seconds: None }]);
        assert_eq!(p2.state.recovery_point, Some(sp(4)));
        // The runtime exits after the savepoint and its pod terminates; newer-looking
        // checkpoints in storage do not replace the savepoint as the recovery point (a kubelet
        // shows the pod Succeeded or Terminating for a while).
        // The pod may even still look running (the watch lags the runtime's exit): no second
        // stop savepoint is requested.
        for pods in [PodsPhase::Succeeded, PodsPhase::Terminating, PodsPhase::Running] {
            let o = Observation { checkpoints: vec![chk(3, 999_000, None)], ..obs(pods, Some("h1")) };
            let p = plan(&d, &p2.state, &o);
            assert_eq!(p.state.recovery_point, Some(sp(4)));
            assert_eq!(p.actions, vec![Action::DeletePods { grace_seconds: None }]);
            assert_eq!(p.state.phase, Some(Phase::Suspending));
        }
        let p3 = plan(&d, &p2.state, &obs(PodsPhase::Absent, None));
        assert_eq!(p3.state.phase, Some(Phase::Suspended));
        s.state = DesiredState::Running;
        let p4 = plan(&desired(&s, "h1"), &p3.state, &obs(PodsPhase::Absent, None));
        assert_eq!(
            p4.actions,
            vec![Action::Deploy { restore_from: Some(sp(4)), mode: RestoreMode::Snapshot }],
            "exactly the suspend savepoint"
        );

        // Resumed with a spec whose job cannot read the state: not deployed, stays stopped
        // with its savepoint, says why once; fixed, it resumes from the same savepoint.
        let summing = counting_job("{ fn: count, as: n }, { fn: sum, field: k, as: t }");
        let held =
            Observation { checkpoints: vec![holding_a_count(chk(3, 999_000, None))], ..obs(PodsPhase::Absent, None) };
        let refused = plan(&Desired { job: Some(&summing), ..desired(&s, "h2") }, &p3.state, &held);
        assert!(refused.actions.is_empty(), "{:?}", refused.actions);
        assert_eq!(refused.state.recovery_point, Some(sp(4)));
        let why = refused.degraded.clone().unwrap();
        assert!(
            why.starts_with("generation 2 is not deployed and the job stays stopped: checkpoint 3: operator uid"),
            "{why}"
        );
        assert_eq!(refused.events.len(), 1);
        assert_eq!(refused.events[0].reason, EventReason::UpgradeRefused);
        let degraded = PlanState { phase: Some(Phase::Degraded), ..refused.state.clone() };
        let again = plan(&Desired { job: Some(&summing), ..desired(&s, "h2") }, &degraded, &held);
        assert!(again.events.is_empty() && again.actions.is_empty());
        let counting = counting_job("{ fn: count, as: n }");
        let fixed = plan(&Desired { job: Some(&counting), ..desired(&s, "h2") }, &degraded, &held);
        assert_eq!(fixed.actions, vec![Action::Deploy { restore_from: Some(sp(4)), mode: RestoreMode::Snapshot }]);
        assert!(fixed.degraded.is_none());
    }

    #[test]
    fn cancel_whose_savepoint_times_out_kills_the_pods_and_names_the_recovery_checkpoint() {
        let mut s = spec();
        s.state = DesiredState::Cancelled;
        s.savepoint.timeout = HumanDuration::from_secs(30);
        let d = desired(&s, "h1");
        let p1 = plan(&d, &state(Phase::Running), &running("h1"));
        let mut o = running("h1");
        o.now_ms += 31_000;
        o.checkpoints = vec![chk(12, 1_000_000, Some("checksum mismatch")), chk(11, 990_000, None)];
        let p2 = plan(&d, &p1.state, &o);
        assert_eq!(p2.actions, vec![Action::DeletePods { grace_seconds: Some(KILL_GRACE_SECONDS) }]);
        assert_eq!(p2.state.recovery_point, Some(snap(11)), "the newest *valid* checkpoint");
        assert!(
            p2.events
                .iter()
                .any(|e| e.reason == EventReason::SavepointFailedPodsKilled && e.message.contains("chk-11")),
            "{:?}",
            p2.events
        );
        // Before the timeout, it waits.
        let mut early = running("h1");
        early.now_ms += 10_000;
        assert!(plan(&d, &p1.state, &early).actions.is_empty());
        // A reported failure kills at once too.
        let mut failed = running("h1");
        failed.savepoint = Some(SavepointProgress::Failed("storage unwritable".into()));
        assert_eq!(
            plan(&d, &p1.state, &failed).actions,
            vec![Action::DeletePods { grace_seconds: Some(KILL_GRACE_SECONDS) }]
        );
    }

    #[test]
    fn failure_relaunches_from_the_newest_valid_checkpoint_past_corrupt_ones() {
        let s = spec();
        let mut o = obs(PodsPhase::Failed("OOMKilled".into()), Some("h1"));
        o.checkpoints = vec![chk(8, 999_000, Some("missing file")), chk(7, 998_000, None)];
        let p = plan(&desired(&s, "h1"), &state(Phase::Running), &o);
        assert_eq!(p.actions, vec![Action::DeletePods { grace_seconds: Some(KILL_GRACE_SECONDS) }]);
        assert_eq!(p.state.pending_upgrade.unwrap().restore_from, Some(snap(7)));
        assert_eq!(p.state.relaunch_count, 1);
        assert!(
            p.events[0].message.contains("skipping invalid checkpoint(s) 8 (missing file)"),
            "{}",
            p.events[0].message
        );
    }

    #[test]
    fn too_old_checkpoint_means_no_relaunch_and_a_degraded_message() {
        let mut s = spec();
        s.relaunch.max_checkpoint_age = Some(HumanDuration::from_secs(60));
        let mut o = obs(PodsPhase::Failed("Error".into()), Some("h1"));
        o.checkpoints = vec![chk(3, 1_000_000 - 120_000, None)];
        let p = plan(&desired(&s, "h1"), &state(Phase::Running), &o);
        assert!(p.actions.is_empty());
        assert_eq!(p.state.phase, Some(Phase::Degraded));
        assert!(p.degraded.unwrap().contains("120s old, older than relaunch.maxCheckpointAge 1m"));
    }

    /// The pods of an upgrade (or a relaunch) fail before they ever run: each failure is a
    /// relaunch counted against the limit, and at the limit the job is Failed (not a wait for
    /// a Running that never comes).
    #[test]
    fn new_pods_that_fail_before_running_are_relaunched_up_to_the_limit() {
        let mut s = spec();
        s.relaunch.limit = 2;
        s.relaunch.backoff = HumanDuration::from_secs(0);
        let d = desired(&s, "h2");
        let pending = PendingUpgrade {
            target_generation: 2,
            target_spec_hash: "h2".into(),
            restore_from: Some(snap(7)),
            restore: Some(RestoreMode::Snapshot),
        };
        let mut st = PlanState { pending_upgrade: Some(pending), ..state(Phase::Upgrading) };
        let failed = obs(PodsPhase::Failed("exit 1".into()), Some("h2"));
        for attempt in 1..=2 {
            let p = plan(&d, &st, &failed);
            assert_eq!(p.actions, vec![Action::DeletePods { grace_seconds: Some(KILL_GRACE_SECONDS) }], "{attempt}");
            assert_eq!(p.state.relaunch_count, attempt);
            assert_eq!(p.events[0].reason, EventReason::Relaunching);
            st = p.state;
        }
        let p = plan(&d, &st, &failed);
        assert_eq!(p.state.phase, Some(Phase::Failed));
        assert!(p.actions.is_empty());
        assert!(p.degraded.unwrap().contains("relaunch limit (2) is reached"));
        // Pods of the new spec that finished before they were seen running: Finished.
        let st = PlanState { relaunch_count: 0, ..st };
        let p = plan(&d, &st, &obs(PodsPhase::Succeeded, Some("h2")));
        assert_eq!((p.state.phase, p.state.pending_upgrade), (Some(Phase::Finished), None));
    }

    #[test]
    fn relaunch_backs_off_and_stops_at_the_limit() {
        let mut s = spec();
        s.relaunch.backoff = HumanDuration::from_secs(10);
        s.relaunch.limit = 2;
        let o = obs(PodsPhase::Failed("Error".into()), Some("h1"));
        let st = PlanState {
            phase: Some(Phase::Running),
            relaunch_count: 1,
            last_relaunch_ms: Some(o.now_ms - 5_000),
            ..PlanState::default()
        };
        let p = plan(&desired(&s, "h1"), &st, &o);
        assert!(p.actions.is_empty(), "backoff is 20s after one relaunch");
        assert_eq!(p.requeue_after_ms, Some(15_000));
        let st = PlanState { relaunch_count: 2, ..st };
        let p = plan(&desired(&s, "h1"), &st, &o);
        assert_eq!(p.state.phase, Some(Phase::Failed));
        assert!(p.actions.is_empty());
    }

    #[test]
    fn savepoint_nonce_and_restart_nonce() {
        let mut s = spec();
        s.savepoint.trigger_nonce = Some(1);
        let p = plan(&desired(&s, "h1"), &state(Phase::Running), &running("h1"));
        assert_eq!(p.actions, vec![Action::RequestSavepoint { stop: false }]);
        assert_eq!(p.state.observed_savepoint_nonce, Some(1));
        let mut done = running("h1");
        done.savepoint = Some(SavepointProgress::Completed(snap(5)));
        let p2 = plan(&desired(&s, "h1"), &p.state, &done);
        assert_eq!(p2.state.latest_savepoint, Some(snap(5)));
        assert!(plan(&desired(&s, "h1"), &p2.state, &running("h1")).actions.is_empty(), "same nonce: nothing");
        // A new restartNonce changes the spec hash: the job restarts through its upgrade mode.
        s.restart_nonce = Some(3);
        let p3 = plan(&desired(&s, "h1-restart-3"), &p2.state, &running("h1"));
        assert_eq!(p3.actions, vec![Action::RequestSavepoint { stop: true }]);
        assert_eq!(p3.state.observed_restart_nonce, None, "recorded once the new pods run");
    }

    #[test]
    fn savepoint_history_is_trimmed_by_count_and_age() {
        let mut s = spec();
        s.savepoint.history_max_count = 2;
        s.savepoint.history_max_age = Some(HumanDuration::from_secs(100));
        let st = PlanState {
            phase: Some(Phase::Running),
            operation: Some(Operation { kind: OperationKind::Savepoint, started_at_ms: 999_000, generation: 2 }),
            savepoint_history: vec![(snap(3), 990_000), (snap(2), 800_000)],
            ..PlanState::default()
        };
        let mut o = running("h1");
        o.savepoint = Some(SavepointProgress::Completed(snap(4)));
        let p = plan(&desired(&s, "h1"), &st, &o);
        assert_eq!(p.state.savepoint_history.iter().map(|(s, _)| s.id).collect::<Vec<_>>(), vec![4, 3]);
        assert_eq!(p.actions, vec![Action::DeleteSavepoint { path: snap(2).path }], "beyond the count (and too old)");
    }

    #[test]
    fn periodic_savepoints() {
        let mut s = spec();
        s.savepoint.periodic_interval = Some(HumanDuration::from_secs(60));
        let st = PlanState {
            phase: Some(Phase::Running),
            last_savepoint_ms: Some(1_000_000 - 30_000),
            ..PlanState::default()
        };
        let p = plan(&desired(&s, "h1"), &st, &running("h1"));
        assert!(p.actions.is_empty());
        assert_eq!(p.requeue_after_ms, Some(30_000));
        let st = PlanState { last_savepoint_ms: Some(1_000_000 - 61_000), ..st };
        assert_eq!(
            plan(&desired(&s, "h1"), &st, &running("h1")).actions,
            vec![Action::RequestSavepoint { stop: false }]
        );
    }

    #[test]
    fn a_failed_upgrade_savepoint_keeps_the_old_job_and_degrades() {
        let s = spec();
        let d = desired(&s, "h2");
        let p1 = plan(&d, &state(Phase::Running), &running("h1"));
        let mut o = running("h1");
        o.savepoint = Some(SavepointProgress::Failed("disk full".into()));
        let p2 = plan(&d, &p1.state, &o);
        assert!(p2.actions.is_empty(), "nothing is deleted");
        assert!(p2.degraded.unwrap().contains("disk full"));
    }

    #[test]
    fn finished_jobs_stay_finished() {
        let s = spec();
        let p = plan(&desired(&s, "h1"), &state(Phase::Running), &obs(PodsPhase::Succeeded, Some("h1")));
        assert_eq!(p.state.phase, Some(Phase::Finished));
        let p2 = plan(&desired(&s, "h1"), &p.state, &obs(PodsPhase::Absent, None));
        assert!(p2.actions.is_empty(), "a finished job is not redeployed");
    }

    #[test]
    fn resuming_after_a_kill_lets_the_runtime_verify_the_checkpoint() {
        let s = spec();
        let st = PlanState { recovery_point: Some(snap(11)), ..state(Phase::Cancelled) };
        let p = plan(&desired(&s, "h1"), &st, &obs(PodsPhase::Absent, None));
        assert_eq!(p.actions, vec![Action::Deploy { restore_from: Some(snap(11)), mode: RestoreMode::Latest }]);
    }
}
