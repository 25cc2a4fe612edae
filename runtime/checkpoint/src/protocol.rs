//! The checkpoint coordinator's protocol as a pure state machine: it decides when to trigger,
//! collects acknowledgements, completes, aborts and counts failures. It does no I/O and reads
//! no clock: the caller passes `now` (milliseconds) and carries out the returned [`Action`]s.
//!
//! Rules:
//! - a periodic checkpoint starts when `interval` has passed since the previous trigger, fewer
//!   than `max_concurrent` are pending, and `min_pause` has passed since the previous one ended;
//! - a requested savepoint jumps the queue (no interval, pause or concurrency limit; one
//!   savepoint at a time);
//! - when every source has finished, a final checkpoint is triggered at once; its completion
//!   lets the job finish;
//! - a pending checkpoint older than `timeout`, or declined by a task, is aborted;
//! - more than `tolerable_failures` consecutive failed checkpoints fail the job (failed
//!   savepoints are reported to their requester and do not count); when they expired before
//!   any checkpoint of the coordinator completed, the next attempt allows its checkpoints
//!   twice as long ([`timeout_scale_after`], up to [`MAX_TIMEOUT_SCALE`] times the timeout);
//! - completing N aborts (subsumes) every pending checkpoint older than N;
//! - while checkpoints are held (a restore is still bringing in state it has not read and
//!   verified yet), neither periodic nor final checkpoints start: a checkpoint must not
//!   complete, and sinks commit, on state that may turn out damaged. Savepoints still start
//!   (a full image waits for the whole state in the task).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// Identifies a task (one subtask of one vertex) to the coordinator.
pub type TaskId = u32;

/// Coordinator settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CoordinatorConfig {
    /// Periodic checkpoints on or off.
    pub periodic: bool,
    /// Time between the starts of two checkpoints.
    pub interval_ms: u64,
    /// Least time between the end of one checkpoint and the start of the next.
    pub min_pause_ms: u64,
    /// Abort a checkpoint not complete after this long.
    pub timeout_ms: u64,
    /// Checkpoints in flight at once.
    pub max_concurrent: u32,
    /// Consecutive failures tolerated.
    pub tolerable_failures: u32,
}

/// What a triggered snapshot is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TriggerKind {
    /// A periodic (or final) checkpoint.
    Checkpoint,
    /// A savepoint; `stop` ends the job when it completes, `drain` flushes windows first.
    Savepoint {
        /// Request id, echoed back in completion and failure.
        request: u64,
        /// Stop the job after the savepoint.
        stop: bool,
        /// Advance event time to the end before the barrier.
        drain: bool,
    },
}

impl TriggerKind {
    /// Whether this is a savepoint.
    pub fn is_savepoint(&self) -> bool {
        matches!(self, TriggerKind::Savepoint { .. })
    }
}

/// What the caller must do.
#[derive(Clone, Debug, PartialEq)]
pub enum Action<A> {
    /// Inject barrier `id` at the sources.
    Trigger {
        /// Checkpoint id.
        id: u64,
        /// Checkpoint or savepoint.
        kind: TriggerKind,
        /// Whether every source had finished (the final checkpoint).
        is_final: bool,
    },
    /// Every task acknowledged: write `_metadata` from `acks`, then call
    /// [`Coordinator::completed`] or [`Coordinator::completion_failed`].
    Complete {
        /// Checkpoint id.
        id: u64,
        /// Checkpoint or savepoint.
        kind: TriggerKind,
        /// The final checkpoint.
        is_final: bool,
        /// Acknowledgements by task.
        acks: BTreeMap<TaskId, A>,
    },
    /// Tell the tasks that `id` was abandoned (sinks abort its transactions).
    Abort {
        /// Checkpoint id.
        id: u64,
        /// Checkpoint or savepoint.
        kind: TriggerKind,
        /// Why.
        reason: String,
    },
    /// Too many consecutive failures: fail the job (it restarts from the newest checkpoint).
    FailJob {
        /// Why.
        reason: String,
        /// The last failure was a checkpoint that expired, and no checkpoint of this
        /// coordinator completed (a savepoint may have: [`timeout_scale_after`]).
        expired_before_any_completed: bool,
    },
}

#[derive(Debug)]
struct Pending<A> {
    kind: TriggerKind,
    is_final: bool,
    triggered_ms: u64,
    awaiting: BTreeSet<TaskId>,
    acks: BTreeMap<TaskId, A>,
    completing: bool,
}

/// The coordinator's state. `A` is whatever tasks acknowledge with (their state handles).
#[derive(Debug)]
pub struct Coordinator<A> {
    config: CoordinatorConfig,
    tasks: BTreeSet<TaskId>,
    next_id: u64,
    pending: BTreeMap<u64, Pending<A>>,
    last_trigger_ms: Option<u64>,
    last_end_ms: Option<u64>,
    consecutive_failures: u32,
    /// Whether a checkpoint (not a savepoint) completed.
    checkpoint_completed: bool,
    /// Periodic and final checkpoints wait ([`Self::hold_checkpoints`]).
    held: bool,
    queued_savepoints: VecDeque<TriggerKind>,
    sources_finished: bool,
    stopping: bool,
    latest_completed: Option<u64>,
}

impl<A> Coordinator<A> {
    /// A coordinator for `tasks`, whose first checkpoint id is `first_id`.
    pub fn new(config: CoordinatorConfig, tasks: impl IntoIterator<Item = TaskId>, first_id: u64, now_ms: u64) -> Self {
        Coordinator {
            config,
            tasks: tasks.into_iter().collect(),
            next_id: first_id,
            pending: BTreeMap::new(),
            // The first periodic checkpoint comes one interval after start.
            last_trigger_ms: Some(now_ms),
            last_end_ms: None,
            consecutive_failures: 0,
            checkpoint_completed: false,
            held: false,
            queued_savepoints: VecDeque::new(),
            sources_finished: false,
            stopping: false,
            latest_completed: None,
        }
    }

    /// Checkpoints in flight.
    pub fn pending_ids(&self) -> Vec<u64> {
        self.pending.keys().copied().collect()
    }

    /// The newest checkpoint completed by this coordinator.
    pub fn latest_completed(&self) -> Option<u64> {
        self.latest_completed
    }

    /// The id the next trigger will use.
    pub fn next_id(&self) -> u64 {
        self.next_id
    }

    /// Queues a savepoint; it is triggered on the next [`Self::poll`].
    pub fn request_savepoint(&mut self, request: u64, stop: bool, drain: bool) {
        self.queued_savepoints.push_back(TriggerKind::Savepoint { request, stop, drain });
    }

    /// Holds periodic and final checkpoints while `held` (see the module's rules).
    pub fn hold_checkpoints(&mut self, held: bool) {
        self.held = held;
    }

    /// Records that every source has read all its input.
    pub fn sources_finished(&mut self) {
        self.sources_finished = true;
    }

    /// Decides what to do at `now`: abort timed-out checkpoints, trigger new ones.
    pub fn poll(&mut self, now_ms: u64) -> Vec<Action<A>> {
        let mut actions = Vec::new();
        let timed_out: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| !p.completing && now_ms.saturating_sub(p.triggered_ms) >= self.config.timeout_ms)
            .map(|(id, _)| *id)
            .collect();
        for id in timed_out {
            let reason = format!("checkpoint {id} expired after {} ms", self.config.timeout_ms);
            self.fail(id, reason, true, now_ms, &mut actions);
        }
        if self.stopping {
            return actions;
        }
        // Savepoints jump the queue.
        if !self.pending.values().any(|p| p.kind.is_savepoint()) {
            if let Some(kind) = self.queued_savepoints.pop_front() {
                if let TriggerKind::Savepoint { stop: true, .. } = kind {
                    self.stopping = true;
                }
                actions.push(self.trigger(kind, now_ms));
                return actions;
            }
        }
        if self.held {
            return actions;
        }
        if self.sources_finished {
            // The final checkpoint: at once, once nothing else is in flight.
            if self.pending.is_empty() {
                actions.push(self.trigger(TriggerKind::Checkpoint, now_ms));
            }
            return actions;
        }
        if !self.config.periodic || self.pending.len() >= self.config.max_concurrent as usize {
            return actions;
        }
        let interval_due = self.last_trigger_ms.is_none_or(|t| now_ms.saturating_sub(t) >= self.config.interval_ms);
        let pause_due = self.last_end_ms.is_none_or(|t| now_ms.saturating_sub(t) >= self.config.min_pause_ms);
        let pause_blocks = self.config.min_pause_ms > 0 && !self.pending.is_empty();
        if interval_due && pause_due && !pause_blocks {
            actions.push(self.trigger(TriggerKind::Checkpoint, now_ms));
        }
        actions
    }

    fn trigger(&mut self, kind: TriggerKind, now_ms: u64) -> Action<A> {
        let id = self.next_id;
        self.next_id += 1;
        self.last_trigger_ms = Some(now_ms);
        let is_final = self.sources_finished && !kind.is_savepoint();
        self.pending.insert(
            id,
            Pending {
                kind,
                is_final,
                triggered_ms: now_ms,
                awaiting: self.tasks.clone(),
                acks: BTreeMap::new(),
                completing: false,
            },
        );
        Action::Trigger { id, kind, is_final }
    }

    /// A task acknowledged `id` with its state handles.
    pub fn ack(&mut self, id: u64, task: TaskId, ack: A) -> Vec<Action<A>> {
        let Some(p) = self.pending.get_mut(&id) else { return Vec::new() };
        if !p.awaiting.remove(&task) {
            return Vec::new();
        }
        p.acks.insert(task, ack);
        if p.awaiting.is_empty() && !p.completing {
            p.completing = true;
            let acks = std::mem::take(&mut p.acks);
            return vec![Action::Complete { id, kind: p.kind, is_final: p.is_final, acks }];
        }
        Vec::new()
    }

    /// A task could not take its part of `id`.
    pub fn decline(&mut self, id: u64, task: TaskId, reason: &str, now_ms: u64) -> Vec<Action<A>> {
        let mut actions = Vec::new();
        if self.pending.contains_key(&id) {
            self.fail(id, format!("task {task} declined checkpoint {id}: {reason}"), false, now_ms, &mut actions);
        }
        actions
    }

    /// `_metadata` of `id` was written: the checkpoint is complete.
    pub fn completed(&mut self, id: u64, now_ms: u64) -> Vec<Action<A>> {
        let mut actions = Vec::new();
        let Some(p) = self.pending.remove(&id) else { return actions };
        self.last_end_ms = Some(now_ms);
        self.latest_completed = Some(self.latest_completed.map_or(id, |l| l.max(id)));
        if !p.kind.is_savepoint() {
            self.consecutive_failures = 0;
            self.checkpoint_completed = true;
        }
        let older: Vec<u64> =
            self.pending.range(..id).filter(|(_, p)| !p.kind.is_savepoint()).map(|(i, _)| *i).collect();
        for old in older {
            if let Some(p) = self.pending.remove(&old) {
                actions.push(Action::Abort { id: old, kind: p.kind, reason: format!("subsumed by checkpoint {id}") });
            }
        }
        actions
    }

    /// Writing `_metadata` of `id` failed.
    pub fn completion_failed(&mut self, id: u64, reason: &str, now_ms: u64) -> Vec<Action<A>> {
        let mut actions = Vec::new();
        if self.pending.contains_key(&id) {
            let reason = format!("could not write metadata of checkpoint {id}: {reason}");
            self.fail(id, reason, false, now_ms, &mut actions);
        }
        actions
    }

    fn fail(&mut self, id: u64, reason: String, expired: bool, now_ms: u64, actions: &mut Vec<Action<A>>) {
        let Some(p) = self.pending.remove(&id) else { return };
        self.last_end_ms = Some(now_ms);
        if let TriggerKind::Savepoint { stop: true, .. } = p.kind {
            // The job keeps running: the stop did not happen.
            self.stopping = false;
        }
        let counts = !p.kind.is_savepoint();
        actions.push(Action::Abort { id, kind: p.kind, reason: reason.clone() });
        if counts {
            self.consecutive_failures += 1;
            if self.consecutive_failures > self.config.tolerable_failures {
                actions.push(Action::FailJob {
                    reason: format!(
                        "{} consecutive checkpoint failures exceed tolerableFailures={} (last: {reason})",
                        self.consecutive_failures, self.config.tolerable_failures
                    ),
                    expired_before_any_completed: expired && !self.checkpoint_completed,
                });
            }
        }
    }
}

/// The most [`timeout_scale_after`] multiplies a job's checkpoint timeout by: 8 minutes for
/// the default of 60 s.
pub const MAX_TIMEOUT_SCALE: u64 = 8;

/// What the next attempt multiplies the checkpoint timeout by, after an attempt that ran with
/// `scale` ended. An attempt that failed because its checkpoints expired before any completed
/// doubles it (up to [`MAX_TIMEOUT_SCALE`]); one that completed a checkpoint resets it to 1;
/// any other end keeps it.
///
/// The first checkpoint after a restore that cannot go on from the restored files (a
/// savepoint or another job's checkpoint into a new root, another parallelism, another store)
/// writes every key, and may take longer than the timeout the job's increments need. With
/// the same timeout each attempt restored from the same checkpoint and expired again: the job
/// failed, and restarted, after every stateful upgrade for good.
pub fn timeout_scale_after(scale: u64, expired_before_any_completed: bool, completed_any: bool) -> u64 {
    if completed_any {
        1
    } else if expired_before_any_completed {
        scale.saturating_mul(2).clamp(1, MAX_TIMEOUT_SCALE)
    } else {
        scale.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> CoordinatorConfig {
        CoordinatorConfig {
            periodic: true,
            interval_ms: 1000,
            min_pause_ms: 0,
            timeout_ms: 5000,
            max_concurrent: 1,
            tolerable_failures: 0,
        }
    }

    fn triggers(actions: &[Action<()>]) -> Vec<u64> {
        actions.iter().filter_map(|a| if let Action::Trigger { id, .. } = a { Some(*id) } else { None }).collect()
    }

    fn complete_all(c: &mut Coordinator<()>, id: u64, tasks: &[TaskId]) -> Vec<Action<()>> {
        let mut out = Vec::new();
        for t in tasks {
            out.extend(c.ack(id, *t, ()));
        }
        out
    }

    #[test]
    fn triggers_on_interval_and_respects_max_concurrent() {
        let mut c = Coordinator::<()>::new(config(), [0, 1], 1, 0);
        assert!(triggers(&c.poll(999)).is_empty());
        assert_eq!(triggers(&c.poll(1000)), vec![1]);
        // One in flight: no second trigger even when the interval passes.
        assert!(triggers(&c.poll(2500)).is_empty());
        let done = complete_all(&mut c, 1, &[0, 1]);
        assert!(matches!(done.as_slice(), [Action::Complete { id: 1, .. }]));
        c.completed(1, 2600);
        assert_eq!(triggers(&c.poll(2600)), vec![2]);
    }

    #[test]
    fn held_checkpoints_wait_but_savepoints_do_not() {
        let mut c = Coordinator::<()>::new(config(), [0], 1, 0);
        c.hold_checkpoints(true);
        assert!(triggers(&c.poll(5000)).is_empty());
        c.request_savepoint(7, false, false);
        assert_eq!(triggers(&c.poll(5001)), vec![1], "a savepoint starts");
        complete_all(&mut c, 1, &[0]);
        c.completed(1, 5002);
        c.sources_finished();
        assert!(triggers(&c.poll(9000)).is_empty(), "nor the final checkpoint");
        c.hold_checkpoints(false);
        assert_eq!(triggers(&c.poll(9001)), vec![2], "the final checkpoint once released");
    }

    #[test]
    fn completes_only_when_every_task_acked_once() {
        let mut c = Coordinator::<u8>::new(config(), [0, 1, 2], 1, 0);
        c.poll(1000);
        assert!(c.ack(1, 0, 10).is_empty());
        assert!(c.ack(1, 0, 11).is_empty(), "duplicate ack ignored");
        assert!(c.ack(1, 1, 12).is_empty());
        assert!(c.ack(7, 2, 0).is_empty(), "ack of unknown checkpoint ignored");
        match c.ack(1, 2, 13).as_slice() {
            [Action::Complete { acks, .. }] => assert_eq!(acks.values().copied().collect::<Vec<_>>(), vec![10, 12, 13]),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn min_pause_counts_from_the_end_of_the_previous_checkpoint() {
        let mut c =
            Coordinator::<()>::new(CoordinatorConfig { min_pause_ms: 800, max_concurrent: 3, ..config() }, [0], 1, 0);
        assert_eq!(triggers(&c.poll(1000)), vec![1]);
        // Pending with min pause set: never concurrent.
        assert!(triggers(&c.poll(2000)).is_empty());
        complete_all(&mut c, 1, &[0]);
        c.completed(1, 2100);
        assert!(triggers(&c.poll(2500)).is_empty(), "pause not over");
        assert_eq!(triggers(&c.poll(2900)), vec![2]);
    }

    #[test]
    fn concurrent_checkpoints_up_to_the_limit_and_subsumption() {
        let mut c = Coordinator::<()>::new(CoordinatorConfig { max_concurrent: 2, ..config() }, [0], 1, 0);
        assert_eq!(triggers(&c.poll(1000)), vec![1]);
        assert_eq!(triggers(&c.poll(2000)), vec![2]);
        assert!(triggers(&c.poll(3000)).is_empty());
        complete_all(&mut c, 2, &[0]);
        let actions = c.completed(2, 3100);
        assert!(matches!(actions.as_slice(), [Action::Abort { id: 1, .. }]));
        assert_eq!(c.latest_completed(), Some(2));
        assert!(c.pending_ids().is_empty());
    }

    #[test]
    fn timeout_aborts_and_fails_job_beyond_tolerable_failures() {
        let mut c = Coordinator::<()>::new(CoordinatorConfig { tolerable_failures: 1, ..config() }, [0], 1, 0);
        c.poll(1000);
        let a = c.poll(6000);
        assert!(matches!(a[0], Action::Abort { id: 1, .. }));
        assert!(!a.iter().any(|x| matches!(x, Action::FailJob { .. })), "first failure tolerated");
        assert_eq!(triggers(&a), vec![2], "next one triggered right away since the interval passed");
        let b = c.decline(2, 0, "upload failed", 6100);
        assert!(matches!(b.last(), Some(Action::FailJob { expired_before_any_completed: false, .. })), "{b:?}");
    }

    /// A job that fails because its checkpoints expire before any completed says so, and the
    /// next attempt's timeout doubles until one completes; a completed checkpoint, or another
    /// failure, does not double it.
    #[test]
    fn checkpoints_that_expire_before_any_completed_double_the_next_attempts_timeout() {
        let mut c = Coordinator::<()>::new(config(), [0], 1, 0);
        c.poll(1000);
        let a = c.poll(6000);
        assert!(a.iter().any(|x| matches!(x, Action::FailJob { expired_before_any_completed: true, .. })), "{a:?}");

        let mut c = Coordinator::<()>::new(CoordinatorConfig { tolerable_failures: 1, ..config() }, [0], 1, 0);
        c.poll(1000);
        complete_all(&mut c, 1, &[0]);
        c.completed(1, 1100);
        c.poll(2000);
        c.poll(7000);
        let a = c.poll(12_000);
        assert!(a.iter().any(|x| matches!(x, Action::FailJob { expired_before_any_completed: false, .. })), "{a:?}");

        // A savepoint that completed is no checkpoint of the job's root.
        let mut c = Coordinator::<()>::new(config(), [0], 1, 0);
        c.request_savepoint(7, false, false);
        c.poll(10);
        complete_all(&mut c, 1, &[0]);
        c.completed(1, 20);
        assert_eq!(triggers(&c.poll(1100)), vec![2]);
        let a = c.poll(6200);
        assert!(a.iter().any(|x| matches!(x, Action::FailJob { expired_before_any_completed: true, .. })), "{a:?}");

        let scales: Vec<u64> =
            std::iter::successors(Some(1), |&s| Some(timeout_scale_after(s, true, false))).take(6).collect();
        assert_eq!(scales, vec![1, 2, 4, 8, 8, 8]);
        assert_eq!(timeout_scale_after(4, true, true), 1, "a checkpoint completed");
        assert_eq!(timeout_scale_after(4, false, false), 4, "a task failed before any completed");
        assert_eq!(timeout_scale_after(4, false, true), 1);
    }

    #[test]
    fn a_completion_resets_the_failure_count() {
        let mut c = Coordinator::<()>::new(CoordinatorConfig { tolerable_failures: 1, ..config() }, [0], 1, 0);
        c.poll(1000);
        c.decline(1, 0, "x", 1100);
        c.poll(2000);
        complete_all(&mut c, 2, &[0]);
        c.completed(2, 2100);
        c.poll(3100);
        let a = c.decline(3, 0, "y", 3200);
        assert!(!a.iter().any(|x| matches!(x, Action::FailJob { .. })));
    }

    #[test]
    fn savepoints_jump_the_queue_and_do_not_count_as_failures() {
        let mut c = Coordinator::<()>::new(config(), [0], 1, 0);
        c.request_savepoint(9, false, false);
        let a = c.poll(10);
        assert!(matches!(
            a.as_slice(),
            [Action::Trigger { id: 1, kind: TriggerKind::Savepoint { request: 9, .. }, .. }]
        ));
        let f = c.decline(1, 0, "disk full", 20);
        assert!(!f.iter().any(|x| matches!(x, Action::FailJob { .. })), "savepoint failure does not fail the job");
    }

    #[test]
    fn stop_with_savepoint_halts_periodic_triggers_until_it_fails() {
        let mut c = Coordinator::<()>::new(config(), [0], 1, 0);
        c.request_savepoint(1, true, false);
        assert_eq!(triggers(&c.poll(10)), vec![1]);
        assert!(triggers(&c.poll(5000)).is_empty(), "stopping: no periodic trigger");
        // Timed out at 5010: stopping is lifted, periodic checkpoints resume.
        let a = c.poll(5010);
        assert!(matches!(a[0], Action::Abort { id: 1, .. }));
        assert_eq!(triggers(&a), vec![2]);
    }

    #[test]
    fn final_checkpoint_after_sources_finish() {
        let mut c = Coordinator::<()>::new(CoordinatorConfig { periodic: false, ..config() }, [0], 1, 0);
        assert!(triggers(&c.poll(5000)).is_empty(), "periodic off");
        c.sources_finished();
        let a = c.poll(5001);
        assert!(matches!(a.as_slice(), [Action::Trigger { id: 1, is_final: true, .. }]));
        let done = complete_all(&mut c, 1, &[0]);
        assert!(matches!(done.as_slice(), [Action::Complete { is_final: true, .. }]));
    }

    #[test]
    fn metadata_write_failure_counts_as_a_failure() {
        let mut c = Coordinator::<()>::new(config(), [0], 1, 0);
        c.poll(1000);
        complete_all(&mut c, 1, &[0]);
        let a = c.completion_failed(1, "s3 unavailable", 1100);
        assert!(matches!(a.last(), Some(Action::FailJob { .. })));
    }
}
