//! A task: one subtask of one chain. Source tasks poll their source; other tasks select over
//! their input channels, aligning barriers in exactly-once mode (an input that delivered
//! barrier N is not read again until every input has) or merely counting them in
//! at-least-once mode. On barrier N a task snapshots its chain synchronously, forwards the
//! barrier at once and hands the snapshot to its uploader.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Select, Sender};
use weir_checkpoint::protocol::TaskId;
use weir_crds::job::CheckpointMode;

use crate::faults::{Fault, Faults};
use crate::message::{Barrier, Event, Message, TaskControl};
use crate::metrics::JobMetrics;
use crate::operator::{ChainedOperator, TaskError};
use crate::plan::Partition;
use crate::sources::{Source, SourcePoll};
use crate::upload::UploadJob;
use crate::value::{subtask_for_key_group, Key, Record};

/// Records per batch a source emits.
pub const BATCH_SIZE: usize = 1024;

/// One output edge of a task.
pub struct Output {
    senders: Vec<Sender<Message>>,
    partition: Partition,
    max_parallelism: u32,
    next: usize,
}

impl Output {
    /// An output over the channels to each consumer subtask (one channel when forward).
    pub fn new(senders: Vec<Sender<Message>>, partition: Partition, max_parallelism: u32, subtask: u32) -> Self {
        let next = subtask as usize % senders.len().max(1);
        Output { senders, partition, max_parallelism, next }
    }

    fn send_records(&mut self, batch: Vec<Record>) -> Result<(), TaskError> {
        if batch.is_empty() {
            return Ok(());
        }
        match &self.partition {
            Partition::Forward => self.senders[0].send(Message::Records(batch)).map_err(|_| TaskError::Shutdown),
            Partition::Rebalance => {
                let i = self.next;
                self.next = (self.next + 1) % self.senders.len();
                self.senders[i].send(Message::Records(batch)).map_err(|_| TaskError::Shutdown)
            }
            Partition::Keyed(fields) => {
                let n = self.senders.len() as u32;
                if n == 1 {
                    return self.senders[0].send(Message::Records(batch)).map_err(|_| TaskError::Shutdown);
                }
                let mut parts: Vec<Vec<Record>> =
                    (0..n).map(|_| Vec::with_capacity(batch.len() / n as usize + 8)).collect();
                for r in batch {
                    let kg = Key::key_group_of(&r, fields, self.max_parallelism);
                    parts[subtask_for_key_group(kg, self.max_parallelism, n) as usize].push(r);
                }
                for (i, p) in parts.into_iter().enumerate() {
                    if !p.is_empty() {
                        self.senders[i].send(Message::Records(p)).map_err(|_| TaskError::Shutdown)?;
                    }
                }
                Ok(())
            }
        }
    }

    fn broadcast(&self, make: impl Fn() -> Message) -> Result<(), TaskError> {
        for s in &self.senders {
            s.send(make()).map_err(|_| TaskError::Shutdown)?;
        }
        Ok(())
    }
}

/// How a task ended.
#[derive(Debug, PartialEq, Eq)]
pub enum TaskEnd {
    /// Input ended and everything was committed.
    Finished,
    /// Told to stop.
    Cancelled,
}

/// Where a task's records come from.
pub enum Head {
    /// A source subtask and its uid.
    Source {
        /// State uid of the source.
        uid: String,
        /// The source.
        source: Box<dyn Source>,
    },
    /// Input channels (one per upstream subtask per edge).
    Inputs(Vec<Receiver<Message>>),
}

/// Everything a task runs with.
pub struct Task {
    /// Coordinator-wide id.
    pub id: TaskId,
    /// Display name, e.g. `counts[1/3]`.
    pub name: String,
    /// Subtask index.
    pub subtask: u32,
    /// Parallelism of the chain.
    pub parallelism: u32,
    /// Key groups owned (for keyed operators' acks).
    pub key_groups: (u32, u32),
    /// Record origin.
    pub head: Head,
    /// Chained operators.
    pub chain: Vec<ChainedOperator>,
    /// Output edges.
    pub outputs: Vec<Output>,
    /// Instructions from the coordinator.
    pub control: Receiver<TaskControl>,
    /// Reports to the coordinator.
    pub events: Sender<Event>,
    /// Snapshots to upload.
    pub uploads: Sender<UploadJob>,
    /// Alignment mode.
    pub mode: CheckpointMode,
    /// Job metrics.
    pub metrics: Arc<JobMetrics>,
    /// Test hook.
    pub faults: Faults,
}

struct InputState {
    rx: Receiver<Message>,
    watermark: i64,
    ended: bool,
}

/// A barrier some inputs have delivered and others not yet.
struct Alignment {
    barrier: Barrier,
    started: Instant,
    /// Per input: delivered this barrier.
    seen: Vec<bool>,
}

impl Task {
    /// Runs the task to its end.
    pub fn run(mut self) -> Result<TaskEnd, TaskError> {
        let head = std::mem::replace(&mut self.head, Head::Inputs(Vec::new()));
        match head {
            Head::Source { uid, source } => self.run_source(uid, source),
            Head::Inputs(inputs) => self.run_inputs(inputs),
        }
    }

    fn emit(&mut self, batch: Vec<Record>) -> Result<(), TaskError> {
        let n = self.outputs.len();
        if n == 0 || batch.is_empty() {
            return Ok(());
        }
        for i in 0..n - 1 {
            self.outputs[i].send_records(batch.clone())?;
        }
        self.outputs[n - 1].send_records(batch)
    }

    fn process_from(&mut self, start: usize, mut batch: Vec<Record>) -> Result<(), TaskError> {
        for i in start..self.chain.len() {
            if batch.is_empty() {
                return Ok(());
            }
            let mut out = Vec::with_capacity(batch.len());
            self.chain[i].op.process(batch, &mut out)?;
            batch = out;
        }
        self.emit(batch)
    }

    fn advance_watermark(&mut self, watermark: i64) -> Result<(), TaskError> {
        for i in 0..self.chain.len() {
            let mut out = Vec::new();
            self.chain[i].op.on_watermark(watermark, &mut out)?;
            if !out.is_empty() {
                self.process_from(i + 1, out)?;
            }
        }
        for o in &self.outputs {
            o.broadcast(|| Message::Watermark(watermark))?;
        }
        Ok(())
    }

    fn after_batch(&self) {
        if self.faults.fires(Fault::TaskPanic) {
            panic!("injected fault: task {} panics", self.name);
        }
    }

    /// Snapshot (synchronous), forward the barrier, hand off the upload.
    fn checkpoint(
        &mut self,
        barrier: Barrier,
        source: Option<(&str, &mut dyn Source)>,
        alignment: Duration,
    ) -> Result<(), TaskError> {
        let started = Instant::now();
        let mut parts = Vec::new();
        if let Some((uid, src)) = source {
            let doc = src.snapshot(barrier.id);
            parts
                .push((uid.to_string(), crate::operator::StateParts { operator_doc: Some(doc), ..Default::default() }));
        }
        for c in &mut self.chain {
            let p = c.op.snapshot(&barrier)?;
            if let Some(uid) = &c.uid {
                parts.push((uid.clone(), p));
            }
        }
        let sync = started.elapsed();
        let alignment_ms = alignment.as_millis() as u64;
        self.metrics.snapshot_sync_seconds.inc_by(sync.as_secs_f64());
        self.metrics.alignment_seconds.inc_by(alignment.as_secs_f64());
        tracing::debug!(
            checkpoint = barrier.id,
            task = %self.name,
            sync_ms = sync.as_millis() as u64,
            alignment_ms,
            "snapshot taken"
        );
        for o in &self.outputs {
            let b = barrier.clone();
            o.broadcast(move || Message::Barrier(b.clone()))?;
        }
        self.uploads
            .send(UploadJob {
                barrier,
                task: self.id,
                subtask: self.subtask,
                parallelism: self.parallelism,
                key_groups: self.key_groups,
                parts,
                alignment_ms,
            })
            .map_err(|_| TaskError::Shutdown)
    }

    fn on_control(&mut self, msg: TaskControl) -> Result<Option<TaskEnd>, TaskError> {
        match msg {
            TaskControl::Complete(id) => {
                let mut committed = Vec::new();
                for c in &mut self.chain {
                    committed.extend(c.op.on_checkpoint_complete(id)?);
                }
                if !committed.is_empty() {
                    self.events.send(Event::Committed { task: self.id, committed }).map_err(|_| TaskError::Shutdown)?;
                }
            }
            TaskControl::Cancel => return Ok(Some(TaskEnd::Cancelled)),
            TaskControl::Abort(_) | TaskControl::Trigger { .. } | TaskControl::Finish => {}
        }
        Ok(None)
    }

    /// After end of input: wait until every pending transaction is committed.
    fn finish(&mut self) -> Result<TaskEnd, TaskError> {
        for c in &mut self.chain {
            c.op.end_of_input()?;
        }
        for o in &self.outputs {
            o.broadcast(|| Message::End)?;
        }
        while self.chain.iter().any(|c| c.op.has_uncommitted()) {
            let msg = self.control.recv().map_err(|_| TaskError::Shutdown)?;
            if let Some(end) = self.on_control(msg)? {
                return Ok(end);
            }
        }
        Ok(TaskEnd::Finished)
    }

    fn run_source(mut self, uid: String, mut source: Box<dyn Source>) -> Result<TaskEnd, TaskError> {
        let mut paused_for: Option<u64> = None;
        let mut finish_requested = false;
        let mut exhausted = false;
        let mut idle: Option<Duration> = None;
        let mut watermark = i64::MIN;
        loop {
            // Instructions first: block when there is nothing else to do.
            let msg = if paused_for.is_some() || exhausted {
                Some(self.control.recv().map_err(|_| TaskError::Shutdown)?)
            } else if let Some(wait) = idle.take() {
                match self.control.recv_timeout(wait) {
                    Ok(m) => Some(m),
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) => None,
                    Err(_) => return Err(TaskError::Shutdown),
                }
            } else {
                match self.control.try_recv() {
                    Ok(m) => Some(m),
                    Err(crossbeam_channel::TryRecvError::Empty) => None,
                    Err(_) => return Err(TaskError::Shutdown),
                }
            };
            if let Some(msg) = msg {
                match msg {
                    TaskControl::Trigger { barrier, stop, drain } => {
                        if drain && watermark < i64::MAX {
                            watermark = i64::MAX;
                            self.advance_watermark(watermark)?;
                        }
                        let id = barrier.id;
                        self.checkpoint(barrier, Some((&uid, source.as_mut())), Duration::ZERO)?;
                        if stop {
                            paused_for = Some(id);
                        }
                    }
                    TaskControl::Finish => finish_requested = true,
                    TaskControl::Abort(id) => {
                        if paused_for == Some(id) {
                            paused_for = None;
                        }
                    }
                    other => {
                        if let TaskControl::Complete(id) = other {
                            source.on_checkpoint_complete(id);
                        }
                        if let Some(end) = self.on_control(other)? {
                            return Ok(end);
                        }
                    }
                }
                if finish_requested {
                    return self.finish();
                }
                continue;
            }
            if paused_for.is_some() || exhausted {
                continue;
            }
            let mut batch = Vec::with_capacity(BATCH_SIZE);
            match source.poll(&mut batch, BATCH_SIZE)? {
                SourcePoll::Data => {
                    self.metrics.records_in.inc_by(batch.len() as u64);
                    self.process_from(0, batch)?;
                    let wm = source.watermark();
                    if wm > watermark {
                        watermark = wm;
                        self.advance_watermark(wm)?;
                    }
                    self.after_batch();
                }
                SourcePoll::Idle(wait) => {
                    if !batch.is_empty() {
                        self.metrics.records_in.inc_by(batch.len() as u64);
                        self.process_from(0, batch)?;
                    }
                    // An idle input may still move event time on (idle partitions).
                    let wm = source.watermark();
                    if wm > watermark {
                        watermark = wm;
                        self.advance_watermark(wm)?;
                    }
                    idle = Some(wait);
                }
                SourcePoll::Finished => {
                    if !batch.is_empty() {
                        self.metrics.records_in.inc_by(batch.len() as u64);
                        self.process_from(0, batch)?;
                    }
                    exhausted = true;
                    if watermark < i64::MAX {
                        watermark = i64::MAX;
                        self.advance_watermark(watermark)?;
                    }
                    self.events.send(Event::SourceFinished { task: self.id }).map_err(|_| TaskError::Shutdown)?;
                }
            }
        }
    }

    fn run_inputs(mut self, receivers: Vec<Receiver<Message>>) -> Result<TaskEnd, TaskError> {
        let mut inputs: Vec<InputState> =
            receivers.into_iter().map(|rx| InputState { rx, watermark: i64::MIN, ended: false }).collect();
        let mut watermark = i64::MIN;
        // Barriers being aligned, by id. Channels are FIFO, so every input delivers N before
        // N+1 and alignments complete in id order. In exactly-once mode an input that
        // delivered the oldest barrier is not read until all have; in at-least-once mode
        // inputs are never blocked, so with `maxConcurrent > 1` a newer barrier may arrive
        // while an older one is still aligning, and both are tracked.
        let mut aligning: BTreeMap<u64, Alignment> = BTreeMap::new();
        let aligned = self.mode == CheckpointMode::ExactlyOnce;
        loop {
            let mut sel = Select::new();
            sel.recv(&self.control);
            let mut index = Vec::with_capacity(inputs.len());
            let blocked: Option<&Vec<bool>> = if aligned { aligning.values().next().map(|a| &a.seen) } else { None };
            for (i, input) in inputs.iter().enumerate() {
                if !input.ended && !blocked.is_some_and(|seen| seen[i]) {
                    sel.recv(&input.rx);
                    index.push(i);
                }
            }
            let op = sel.select();
            if op.index() == 0 {
                let msg = op.recv(&self.control).map_err(|_| TaskError::Shutdown)?;
                if let Some(end) = self.on_control(msg)? {
                    return Ok(end);
                }
                continue;
            }
            let i = index[op.index() - 1];
            let msg = op.recv(&inputs[i].rx).map_err(|_| TaskError::Shutdown)?;
            match msg {
                Message::Records(batch) => {
                    self.process_from(0, batch)?;
                    self.after_batch();
                }
                Message::Watermark(w) => {
                    inputs[i].watermark = inputs[i].watermark.max(w);
                    let combined = inputs.iter().filter(|x| !x.ended).map(|x| x.watermark).min().unwrap_or(i64::MAX);
                    if combined > watermark {
                        watermark = combined;
                        self.advance_watermark(combined)?;
                    }
                }
                Message::Barrier(b) => {
                    let n = inputs.len();
                    aligning
                        .entry(b.id)
                        .or_insert_with(|| Alignment { barrier: b, started: Instant::now(), seen: vec![false; n] })
                        .seen[i] = true;
                    self.complete_alignments(&inputs, &mut aligning)?;
                }
                Message::End => {
                    inputs[i].ended = true;
                    self.complete_alignments(&inputs, &mut aligning)?;
                    let combined = inputs.iter().filter(|x| !x.ended).map(|x| x.watermark).min().unwrap_or(i64::MAX);
                    if combined > watermark && inputs.iter().any(|x| !x.ended) {
                        watermark = combined;
                        self.advance_watermark(combined)?;
                    }
                    if inputs.iter().all(|x| x.ended) {
                        return self.finish();
                    }
                }
            }
        }
    }

    /// Snapshots every barrier, oldest first, that each input has delivered (or ended before).
    fn complete_alignments(
        &mut self,
        inputs: &[InputState],
        aligning: &mut BTreeMap<u64, Alignment>,
    ) -> Result<(), TaskError> {
        while let Some(entry) = aligning.first_entry() {
            if !inputs.iter().zip(&entry.get().seen).all(|(x, seen)| x.ended || *seen) {
                break;
            }
            let a = entry.remove();
            self.checkpoint(a.barrier, None, a.started.elapsed())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::SnapshotTarget;

    fn barrier(id: u64) -> Message {
        Message::Barrier(Barrier { id, target: SnapshotTarget::Checkpoint })
    }

    /// With `maxConcurrent > 1` in at-least-once mode, barrier 2 can reach a task on one input
    /// before barrier 1 arrived on the other. Both are aligned and snapshotted in order; the
    /// task used to decline checkpoint 1, and with `tolerableFailures: 0` that failed the job.
    #[test]
    fn at_least_once_aligns_overlapping_barriers_in_order_without_declining() {
        // The task reads its ready inputs in random order: repeat so the overlap happens.
        for _ in 0..50 {
            overlapping_barriers_once();
        }
    }

    fn overlapping_barriers_once() {
        let metrics = Arc::new(JobMetrics::new("t", "t"));
        let (a_tx, a_rx) = crossbeam_channel::unbounded();
        let (b_tx, b_rx) = crossbeam_channel::unbounded();
        let (_control_tx, control) = crossbeam_channel::unbounded();
        let (events, events_rx) = crossbeam_channel::unbounded();
        let (uploads, uploads_rx) = crossbeam_channel::unbounded();
        let task = Task {
            id: 0,
            name: "t".into(),
            subtask: 0,
            parallelism: 1,
            key_groups: (0, 8),
            head: Head::Inputs(vec![a_rx, b_rx]),
            chain: Vec::new(),
            outputs: Vec::new(),
            control,
            events,
            uploads,
            mode: CheckpointMode::AtLeastOnce,
            metrics: metrics.clone(),
            faults: Faults::new(None, metrics),
        };
        for m in [barrier(1), barrier(2), Message::End] {
            a_tx.send(m).unwrap();
        }
        for m in [barrier(1), barrier(2), Message::End] {
            b_tx.send(m).unwrap();
        }
        assert_eq!(task.run().unwrap(), TaskEnd::Finished);
        let snapshotted: Vec<u64> = uploads_rx.try_iter().map(|u| u.barrier.id).collect();
        assert_eq!(snapshotted, vec![1, 2]);
        let declines: Vec<String> = events_rx
            .try_iter()
            .filter_map(|e| if let Event::Decline { reason, .. } = e { Some(reason) } else { None })
            .collect();
        assert!(declines.is_empty(), "{declines:?}");
    }
}
