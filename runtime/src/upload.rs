//! The asynchronous part of a snapshot: one uploader thread per task encodes keyed state,
//! stages sink data, writes state files and acknowledges (or declines) to the coordinator.
//! Uploads of a task happen in barrier order, so an increment is only written after the file
//! it builds on; when an upload fails, later increments are declined until a full image has
//! been written again. Sink data whose staging failed is kept and staged again before any
//! later checkpoint of the task is acknowledged: a later checkpoint's state still lists that
//! transaction as pending, so it must not complete without the data.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};
use weir_checkpoint::format::{FileKind, StateFileWriter};
use weir_checkpoint::protocol::TaskId;
use weir_checkpoint::retention::PendingFiles;
use weir_checkpoint::{layout, CopiedBy, FileRef, Storage, SubtaskSnapshot};

use crate::compact::{InFlight, MergeOutcome, MergeRequest, Merger};
use crate::faults::{Fault, Faults};
use crate::message::{Barrier, Event, OperatorAck, SnapshotTarget, TaskAck};
use crate::operator::{StagedWrite, StateParts};
use crate::restore::ChainSource;

/// A snapshot handed from a task to its uploader.
pub struct UploadJob {
    /// The barrier it belongs to.
    pub barrier: Barrier,
    /// Which task.
    pub task: TaskId,
    /// Its subtask index.
    pub subtask: u32,
    /// Its parallelism.
    pub parallelism: u32,
    /// Its key groups.
    pub key_groups: (u32, u32),
    /// Per stateful operator uid.
    pub parts: Vec<(String, StateParts)>,
    /// Alignment time.
    pub alignment_ms: u64,
}

#[derive(Default)]
struct Chain {
    files: Vec<FileRef>,
    /// The first file's entries as the rocksdb backend's table files (see
    /// [`SubtaskSnapshot::store_tables`]); empty when it has none.
    tables: Vec<FileRef>,
    /// See [`RestoredChain::tables_fell_back`].
    tables_fell_back: Option<Arc<AtomicBool>>,
    /// See [`RestoredChain::copy_from`]; `None` once copied.
    copy_from: Option<ChainSource>,
    broken: bool,
}

impl Chain {
    /// The table files to list with the chain: none from the moment a restore could not take
    /// one of them in (damaged, missing or refused), so that no later restore tries them again
    /// (it reads the full image they stand for instead).
    fn listed_tables(&mut self) -> Vec<FileRef> {
        if self.tables_fell_back.as_ref().is_some_and(|f| f.load(Ordering::Acquire)) {
            tracing::warn!(
                tables = self.tables.len(),
                "a restore could not take a table file of its chain in; the chain stops listing its table files"
            );
            self.tables.clear();
            self.tables_fell_back = None;
        }
        self.tables.clone()
    }
}

/// A restored keyed-state chain that a task's uploader continues.
#[derive(Clone, Debug, Default)]
pub struct RestoredChain {
    /// Its files: a full image, then increments.
    pub files: Vec<FileRef>,
    /// The full image's table files, if it has them.
    pub tables: Vec<FileRef>,
    /// Raised when the restore could not take one of `tables` in and read its range from the
    /// image: from the next checkpoint on, the chain lists no table files.
    pub tables_fell_back: Option<Arc<AtomicBool>>,
    /// Where `files` are when they lie outside the job's root (a chain restored from another
    /// job's checkpoint or from a savepoint, [`crate::restore::KeyedRestore::adopt_chain`]):
    /// the first checkpoint copies them into the root's shared directory before it writes the
    /// increment that builds on them, and lists the copies. The originals are only read.
    pub copy_from: Option<ChainSource>,
}

/// A chain of more than `fullEvery` files is merged once its increments hold at least this
/// fraction of its base's bytes (a restore then reads at most 1.5 times the state), or once it
/// has more than [`MERGE_ANYWAY_FACTOR`] times `fullEvery` files. Merging every `fullEvery`
/// checkpoints regardless would rewrite a large state that changes little over and over.
const MERGE_AT_INCREMENTS_OF_BASE: f64 = 0.5;

/// See [`MERGE_AT_INCREMENTS_OF_BASE`].
const MERGE_ANYWAY_FACTOR: usize = 4;

/// A chain of more than this many times `fullEvery` files whose last
/// [`MERGE_FAILURES_BEFORE_FULL_IMAGE`] merges failed gets a full image from its task (its
/// flag is raised): restores must not read unbounded chains. A chain that is only long, because
/// it was restored so or grew while a slow merge ran, gets another merge: a full image written
/// by the task stops it for as long as encoding the whole state takes (6.7 s at 32M keys on
/// rocksdb, 9.5 s at 42M), where a merge runs beside it.
const CHAIN_LIMIT_FACTOR: usize = 8;

/// See [`CHAIN_LIMIT_FACTOR`].
const MERGE_FAILURES_BEFORE_FULL_IMAGE: u32 = 2;

/// Increments ordered by key group (the rocksdb backend's) are merged into one increment once a
/// run of them holds at least `fullEvery` within this factor of its largest ([`similar_run`]),
/// before the chain is merged into an image for holding [`MERGE_AT_INCREMENTS_OF_BASE`] of its
/// base in increments (a run takes seconds where an image of a large state takes minutes).
/// A merged increment holds its run's bytes, `fullEvery` (≥ 4) times one of them, so it joins a
/// later run only with others like it: the chain keeps fewer than `fullEvery` files per tier of
/// sizes, and a byte is rewritten once per tier it passes, not at every merge.
const SIMILAR_INCREMENTS: u64 = 4;

/// Background merges of one task's chains (see [`crate::compact`]).
pub struct Merges {
    /// A chain longer than this many files is merged.
    pub full_every: usize,
    /// The merger.
    pub merger: Merger,
    /// Merges staged and not yet adopted (a savepoint came first).
    pub staged: Vec<crate::compact::StagedMerge>,
    /// Counts adopted and failed merges.
    pub metrics: Arc<crate::metrics::JobMetrics>,
    /// Merged images are also written as the rocksdb backend's table files (the job's
    /// backend), so that its restores take them in whole.
    pub store_tables: bool,
    /// Merges of each operator's chain that failed since its last adopted one.
    pub failures_in_a_row: HashMap<String, u32>,
}

/// Runs the uploader of one task until its task drops the sender.
pub fn run(
    jobs: Receiver<UploadJob>,
    storage: Storage,
    epoch: u64,
    events: Sender<Event>,
    faults: Faults,
    restored_chains: HashMap<String, RestoredChain>,
    mut merges: Option<Merges>,
) {
    let mut chains: HashMap<String, Chain> = restored_chains
        .into_iter()
        .map(|(uid, c)| {
            let chain = Chain {
                files: c.files,
                tables: c.tables,
                tables_fell_back: c.tables_fell_back,
                copy_from: c.copy_from,
                broken: false,
            };
            (uid, chain)
        })
        .collect();
    let mut unstaged: Vec<StagedWrite> = Vec::new();
    for job in jobs {
        let id = job.barrier.id;
        let task = job.task;
        let checkpoint = matches!(job.barrier.target, SnapshotTarget::Checkpoint);
        let subtask = job.subtask;
        let flags: Vec<(String, Arc<AtomicBool>)> =
            job.parts.iter().filter_map(|(uid, p)| Some((uid.clone(), p.force_full.clone()?))).collect();
        if let (Some(m), true) = (&mut merges, checkpoint) {
            crate::io().block_on(adopt_merges(&storage, m, &mut chains, id, &flags));
        }
        let started = std::time::Instant::now();
        let pending = merges.as_ref().map(|m| m.merger.pending().clone());
        let result =
            crate::io().block_on(upload(&storage, epoch, &faults, &mut chains, &mut unstaged, pending.as_ref(), job));
        tracing::debug!(
            checkpoint = id,
            task,
            upload_ms = started.elapsed().as_millis() as u64,
            bytes = result.as_ref().map(|a| a.bytes).unwrap_or(0),
            "snapshot uploaded"
        );
        match (&result, checkpoint) {
            (Ok(_), true) => {
                if let Some(m) = &mut merges {
                    request_merges(m, &chains, id, subtask, &flags);
                }
            }
            (Err(_), true) => {
                // Every keyed part of this snapshot was taken from its state's change tracking,
                // also those the failed upload never reached (a sink's staging fails first):
                // each chain misses an increment, so each next snapshot is full.
                for (uid, flag) in &flags {
                    flag.store(true, Ordering::Release);
                    chains.entry(uid.clone()).or_default().broken = true;
                }
            }
            (_, false) => {}
        }
        let event = match result {
            Ok(ack) => Event::Ack { id, task, ack },
            Err(reason) => Event::Decline { id, task, reason },
        };
        if events.send(event).is_err() {
            break;
        }
    }
    if let Some(mut m) = merges {
        // Merges nobody will adopt: the staged files go (a running merge stops; one staged
        // after this last look is deleted by the merger's thread when it sees the uploader go).
        let outcomes = m.merger.finished();
        let pending = m.merger.pending().clone();
        // Not joined: a running merge stops at its next part, and a restart need not wait.
        drop(m.merger.cancel());
        let staged = m.staged.into_iter().chain(outcomes.into_iter().filter_map(|o| match o {
            MergeOutcome::Staged(s) => Some(s),
            MergeOutcome::Failed { .. } => None,
        }));
        for s in staged {
            crate::io().block_on(s.delete(&storage, &pending));
        }
    }
}

/// Adopts, in checkpoint `id` (about to be uploaded), the merges whose chain is still the
/// beginning of their operator's chain: each replaces the files it merged. The others are
/// deleted.
async fn adopt_merges(
    storage: &Storage,
    merges: &mut Merges,
    chains: &mut HashMap<String, Chain>,
    id: u64,
    flags: &[(String, Arc<AtomicBool>)],
) {
    for outcome in merges.merger.finished() {
        match outcome {
            MergeOutcome::Staged(staged) => merges.staged.push(staged),
            MergeOutcome::Failed { request, error } => {
                let current =
                    chains.get(&request.uid).is_some_and(|c| merged_at(&c.files, &request, &request.run).is_some());
                if !current {
                    // A full image restarted the chain meanwhile, and retention may have
                    // deleted the files it was reading: nothing was lost.
                    tracing::debug!(uid = %request.uid, %error, "a merge of a replaced chain ended");
                    continue;
                }
                merges.metrics.state_merges_failed.inc();
                *merges.failures_in_a_row.entry(request.uid.clone()).or_default() += 1;
                if error.damaged_input() {
                    // A file the newest checkpoints list is missing or not what they say: the
                    // next snapshot is full, so that later checkpoints stop building on it.
                    if let Some((_, flag)) = flags.iter().find(|(u, _)| *u == request.uid) {
                        flag.store(true, Ordering::Release);
                    }
                }
                tracing::warn!(
                    uid = %request.uid,
                    files = request.chain.len(),
                    %error,
                    "a background merge of keyed state failed; its chain is kept and merged again later"
                )
            }
        }
    }
    for staged in std::mem::take(&mut merges.staged) {
        let uid = &staged.request.uid;
        let chain = chains.get_mut(uid).filter(|c| !c.broken);
        let Some((chain, at)) =
            chain.and_then(|c| merged_at(&c.files, &staged.request, &staged.replaces).map(|at| (c, at)))
        else {
            // A full image restarted the chain meanwhile (or, for a run, an image took its files).
            staged.delete(storage, merges.merger.pending()).await;
            continue;
        };
        // Listed as written: nothing is renamed. Retention leaves the files alone until a
        // complete checkpoint lists them (they are pending until then).
        let listed = crate::compact::StagedFile::listed;
        let image = staged.replaces.start == 0;
        let replaced: Vec<FileRef> =
            chain.files.splice(at..at + staged.replaces.len(), [listed(&staged.file)]).collect();
        let old_tables = if image {
            chain.tables_fell_back = None;
            std::mem::replace(&mut chain.tables, staged.tables.iter().map(listed).collect())
        } else {
            Vec::new()
        };
        // An earlier merge replaced here may never have been listed by a complete checkpoint.
        for f in replaced.iter().chain(&old_tables) {
            merges.merger.pending().dropped(&layout::resolve(&layout::checkpoint_dir(id), &f.path), id);
        }
        if image {
            merges.metrics.state_merges.inc();
        } else {
            merges.metrics.state_increment_merges.inc();
        }
        merges.failures_in_a_row.remove(uid.as_str());
        tracing::info!(
            uid = %uid,
            checkpoint = id,
            files = replaced.len(),
            into = if image { "image" } else { "increment" },
            entries = staged.entries,
            bytes = staged.file.len,
            tables = staged.tables.len(),
            seconds = staged.took.as_secs_f64(),
            "keyed state: files merged in the background replace those of the chain"
        );
    }
}

/// Where the files a merge of `request` replaces (`replaces`, of its chain) now are in `chain`:
/// an image's chain must still begin the chain (at 0); a run's files must still follow each
/// other in it, wherever an image merged meanwhile moved them.
fn merged_at(chain: &[FileRef], request: &MergeRequest, replaces: &Range<usize>) -> Option<usize> {
    if replaces.start == 0 {
        return chain.starts_with(&request.chain).then_some(0);
    }
    let run = request.chain.get(replaces.clone()).filter(|run| !run.is_empty())?;
    chain.windows(run.len()).position(|w| w == run).filter(|&at| at > 0)
}

/// Asks for a background merge of every chain that [`chain_step`] says needs one, and raises
/// the full-image flag of those it says need a full image from their task.
fn request_merges(
    merges: &mut Merges,
    chains: &HashMap<String, Chain>,
    id: u64,
    subtask: u32,
    flags: &[(String, Arc<AtomicBool>)],
) {
    for (uid, chain) in chains {
        if chain.files.len() <= 1 {
            // A full image restarted the chain: the merges that failed on the chain before it
            // say nothing about this one.
            merges.failures_in_a_row.remove(uid);
        }
        let lens: Vec<u64> = chain.files.iter().map(|f| f.len).collect();
        let failures = merges.failures_in_a_row.get(uid).copied().unwrap_or(0);
        let in_flight = merges.merger.in_flight(uid);
        // The rocksdb backend's increments are ordered by key group: runs of them merge into one.
        let runs = merges.store_tables;
        match chain_step(&lens, merges.full_every, runs, chain.broken, in_flight, failures) {
            ChainStep::Keep => {}
            ChainStep::FullImageFromTask => {
                if let Some((_, flag)) = flags.iter().find(|(u, _)| u == uid) {
                    tracing::warn!(
                        uid = %uid,
                        files = lens.len(),
                        failures,
                        "keyed state: the chain is too long and its merges fail; the task writes a full image"
                    );
                    flag.store(true, Ordering::Release);
                }
            }
            ChainStep::Merge(run) => {
                merges.merger.request(MergeRequest {
                    uid: uid.clone(),
                    subtask,
                    checkpoint_id: id,
                    chain: chain.files.clone(),
                    run,
                    store_tables: merges.store_tables,
                });
            }
        }
    }
}

/// What to do with a chain after a checkpoint.
#[derive(Debug, PartialEq, Eq)]
enum ChainStep {
    /// Nothing yet.
    Keep,
    /// Merge these files of it in the background: all of them into an image (`0..len`), or
    /// a run of increments into one increment.
    Merge(Range<usize>),
    /// Have the task write a full image at its next checkpoint.
    FullImageFromTask,
}

/// The merge policy for a chain of files of `lens` bytes (the first the full image). A chain
/// longer than `full_every` files is merged into an image once its increments hold
/// [`MERGE_AT_INCREMENTS_OF_BASE`] of its base's bytes; with `runs` (increments that merge into
/// one), a run of similar increments ([`SIMILAR_INCREMENTS`]) is first merged into one
/// increment, also while an image of the files before it is being merged. A chain of more than
/// [`MERGE_ANYWAY_FACTOR`] × `full_every` files is merged anyway (its increments into one with
/// `runs`, into an image without). Past [`CHAIN_LIMIT_FACTOR`] × `full_every` files, a chain
/// whose merges keep failing gets a full image from its task instead. Nothing is asked for a
/// `broken` chain, nor an image while a merge of the chain is in flight (`in_flight`).
fn chain_step(
    lens: &[u64],
    full_every: usize,
    runs: bool,
    broken: bool,
    in_flight: InFlight,
    failures_in_a_row: u32,
) -> ChainStep {
    let files = lens.len();
    if broken || files <= full_every {
        return ChainStep::Keep;
    }
    // A run first: it takes seconds where an image of a large state takes minutes, and the
    // image, asked for at a later checkpoint, then has fewer files to read. A run of files an
    // image being merged reads would be thrown away when the image is adopted.
    let free_from = in_flight.image.unwrap_or(1).max(1);
    if runs && !in_flight.run && free_from < files {
        if let Some(run) = similar_run(&lens[free_from..], full_every.max(2)) {
            return ChainStep::Merge(run.start + free_from..run.end + free_from);
        }
    }
    if in_flight.image.is_some() || in_flight.run {
        return ChainStep::Keep;
    }
    if files > CHAIN_LIMIT_FACTOR * full_every && failures_in_a_row >= MERGE_FAILURES_BEFORE_FULL_IMAGE {
        return ChainStep::FullImageFromTask;
    }
    let (base_bytes, increment_bytes) = (lens[0], lens[1..].iter().sum::<u64>());
    if increment_bytes as f64 >= MERGE_AT_INCREMENTS_OF_BASE * base_bytes as f64 {
        return ChainStep::Merge(0..files);
    }
    if files > MERGE_ANYWAY_FACTOR * full_every {
        // With runs, the increments into one: no run of similar ones, and small beside the image.
        return ChainStep::Merge(if runs { 1..files } else { 0..files });
    }
    ChainStep::Keep
}

/// The oldest run of consecutive `increments` (their sizes) holding at least `fan_in` within
/// [`SIMILAR_INCREMENTS`] of its largest, as long as it goes. Smaller ones inside it or after
/// it go with it: a few small increments left between two runs (too few for a run of their
/// own) would otherwise keep the runs on either side apart for good, and rewriting them costs
/// little. A larger one ends it, unless enough others are like it.
///
/// For each start, the sizes since it that are within the factor of the largest so far are
/// kept smallest first: the largest only grows, so one that falls out never comes back, and
/// each start costs O(n log n) instead of recounting every end's run (O(n²) per start: about
/// n³/6 steps for a chain, 4.5M for one of 300 increments, at every checkpoint).
fn similar_run(increments: &[u64], fan_in: usize) -> Option<Range<usize>> {
    let mut like_largest = BinaryHeap::with_capacity(increments.len());
    (0..increments.len()).find_map(|start| {
        let mut run = None;
        let mut largest = 0u64;
        like_largest.clear();
        for (end, &len) in increments.iter().enumerate().skip(start) {
            largest = largest.max(len);
            like_largest.push(Reverse(len));
            while like_largest.peek().is_some_and(|&Reverse(l)| !within_similar(l, largest)) {
                like_largest.pop();
            }
            if like_largest.len() >= fan_in {
                run = Some(start..end + 1);
            }
        }
        run
    })
}

/// Whether an increment of `len` bytes is within [`SIMILAR_INCREMENTS`] of one of `largest`.
fn within_similar(len: u64, largest: u64) -> bool {
    len.saturating_mul(SIMILAR_INCREMENTS) >= largest
}

async fn upload(
    storage: &Storage,
    epoch: u64,
    faults: &Faults,
    chains: &mut HashMap<String, Chain>,
    unstaged: &mut Vec<StagedWrite>,
    pending: Option<&PendingFiles>,
    job: UploadJob,
) -> Result<TaskAck, String> {
    let savepoint_dir = match &job.barrier.target {
        SnapshotTarget::Savepoint { dir } => Some(dir.clone()),
        SnapshotTarget::Checkpoint => None,
    };
    let base = savepoint_dir.clone().unwrap_or_else(|| layout::checkpoint_dir(job.barrier.id));
    let mut ack = TaskAck { alignment_ms: job.alignment_ms, ..TaskAck::default() };
    let mut flags = Vec::new();
    // Sink data joins the queue before anything can fail: the sink lists its transaction as
    // pending from now on, so a later checkpoint must not complete without it.
    for parts in job.parts.iter() {
        unstaged.extend(parts.1.staged.iter().cloned());
        ack.pending_commits.extend(parts.1.pending_commits.iter().cloned());
    }
    let outcome: Result<(), String> = async {
        if savepoint_dir.is_some() && faults.fires(Fault::Savepoint) {
            return Err("injected fault: savepoint upload refused".to_string());
        }
        while let Some(staged) = unstaged.first() {
            if faults.fires(Fault::Upload) {
                return Err(format!("injected fault: staging {} failed", staged.path));
            }
            ack.bytes += staged.data.len() as u64;
            staged
                .storage
                .put(&staged.path, staged.data.clone())
                .await
                .map_err(|e| format!("staging sink data: {e}"))?;
            unstaged.remove(0);
        }
        for (uid, parts) in job.parts {
            if let Some(flag) = &parts.force_full {
                flags.push((uid.clone(), flag.clone()));
            }
            let mut snap = SubtaskSnapshot {
                subtask: job.subtask,
                key_groups: job.key_groups,
                operator_state: None,
                keyed_state: Vec::new(),
                store_tables: Vec::new(),
                keyed_entries: None,
                int_keys: false,
                table_slot_bytes: None,
            };
            if let Some(doc) = parts.operator_doc {
                let mut w = StateFileWriter::new(FileKind::OperatorState, doc.len());
                w.document(&doc);
                let (data, crc) = w.finish();
                let rel = layout::operator_state_file(&uid, job.subtask, epoch);
                if faults.fires(Fault::Upload) {
                    return Err(format!("injected fault: upload of {rel} failed"));
                }
                let len = data.len() as u64;
                storage
                    .put(&layout::resolve(&base, &rel), data)
                    .await
                    .map_err(|e| format!("uploading operator state of `{uid}`: {e}"))?;
                ack.bytes += len;
                snap.operator_state = Some(FileRef::new(rel, len, crc));
            }
            if let Some(keyed) = parts.keyed {
                let kind = keyed.kind;
                let chain = chains.entry(uid.clone()).or_default();
                if savepoint_dir.is_none() && kind == FileKind::KeyedIncrement && chain.broken {
                    return Err(format!("`{uid}`: an earlier increment was lost; waiting for a full image"));
                }
                if let (None, FileKind::KeyedIncrement, Some(source)) = (&savepoint_dir, kind, &chain.copy_from) {
                    // Before the increment that builds on them; a failure fails the
                    // checkpoint, and the next snapshot is a full image.
                    let (id, subtask) = (job.barrier.id, job.subtask);
                    chain.files =
                        copy_restored_chain(storage, source, &chain.files, &uid, subtask, id, epoch, faults).await?;
                    chain.copy_from = None;
                }
                let (len, crc) = (keyed.len(), keyed.crc32c);
                snap.keyed_entries = keyed.live_entries;
                snap.int_keys = keyed.int_keys;
                snap.table_slot_bytes = keyed.table_slot_bytes;
                let rel = match &savepoint_dir {
                    Some(_) => layout::savepoint_keyed_file(&uid, job.subtask),
                    None => layout::shared_keyed_file(&uid, job.subtask, job.barrier.id, epoch),
                };
                if faults.fires(Fault::Upload) {
                    return Err(format!("injected fault: upload of {rel} failed"));
                }
                if let Some(delay) = faults.upload_delay() {
                    tokio::time::sleep(delay).await;
                }
                let target = layout::resolve(&base, &rel);
                match &keyed.file {
                    // A full image larger than memory, streamed from local disk.
                    Some(file) => storage.put_file(&target, &file.path).await,
                    None => storage.put(&target, keyed.data.clone()).await,
                }
                .map_err(|e| format!("uploading keyed state of `{uid}`: {e}"))?;
                // Its memory serves the next checkpoint's file (`weir_checkpoint::spare`).
                weir_checkpoint::spare::give_back_bytes(keyed.data);
                ack.bytes += len;
                let file = FileRef::new(rel, len, crc)
                    .with_puts_from(keyed.puts_from)
                    .with_shard_bytes(keyed.shard_bytes.as_deref())
                    .with_window_order(keyed.in_window_order);
                if savepoint_dir.is_some() {
                    snap.keyed_state = vec![file];
                } else {
                    if kind == FileKind::KeyedFull {
                        // A merge adopted into the chain may not be listed by any complete
                        // checkpoint yet: from this one on, none lists it.
                        if let Some(pending) = pending {
                            for f in chain.files.iter().chain(&chain.tables) {
                                pending.dropped(&layout::resolve(&base, &f.path), job.barrier.id);
                            }
                        }
                        chain.files.clear();
                        chain.tables.clear();
                        chain.tables_fell_back = None;
                        chain.copy_from = None;
                        chain.broken = false;
                    }
                    chain.files.push(file);
                    snap.keyed_state = chain.files.clone();
                    snap.store_tables = chain.listed_tables();
                }
            }
            ack.operators.push(OperatorAck { uid, parallelism: job.parallelism, snapshot: snap });
        }
        Ok(())
    }
    .await;
    if let Err(reason) = outcome {
        if savepoint_dir.is_none() {
            // The lost file may be an increment others build on: the next snapshot is full.
            for (uid, flag) in flags {
                flag.store(true, Ordering::Release);
                chains.entry(uid).or_default().broken = true;
            }
        }
        return Err(reason);
    }
    Ok(ack)
}

/// Files of a restored chain copied into the job's root at once ([`copy_restored_chain`]).
const COPIES_IN_FLIGHT: usize = 8;

/// Copies `files`, a keyed-state chain of another root (see [`RestoredChain::copy_from`]), into
/// the job's root as checkpoint `id`'s ([`layout::shared_adopted_file`]), and returns the
/// references to the copies: the same lengths, checksums and shard starts. A copy whose bytes
/// passed through this process is checked against its reference (the restore checked the
/// originals as it read them; a link or a copy inside the store has the same bytes).
#[allow(clippy::too_many_arguments)]
async fn copy_restored_chain(
    storage: &Storage,
    source: &ChainSource,
    files: &[FileRef],
    uid: &str,
    subtask: u32,
    id: u64,
    epoch: u64,
    faults: &Faults,
) -> Result<Vec<FileRef>, String> {
    use futures::{StreamExt, TryStreamExt};
    let started = std::time::Instant::now();
    let dir = layout::checkpoint_dir(id);
    let copy = |(index, f): (usize, &FileRef)| {
        let rel = layout::shared_adopted_file(uid, subtask, id, epoch, index);
        let from = source.resolve(&f.path);
        let target = layout::resolve(&dir, &rel);
        let fault = faults.fires(Fault::Upload);
        let f = f.clone();
        async move {
            let failed = |reason: String| {
                let url = source.storage.url_of(&from);
                format!("copying the restored keyed state of `{uid}` from {url} into the job's root: {reason}")
            };
            if fault {
                return Err(failed(format!("injected fault: the copy to {rel} failed")));
            }
            let how =
                match storage.copy_from(&source.storage, &from, &target).await.map_err(|e| failed(e.to_string()))? {
                    CopiedBy::Streaming(digest) => {
                        f.check(&digest).map_err(failed)?;
                        "streamed"
                    }
                    CopiedBy::Link => "linked",
                    CopiedBy::Store => "copied by the store",
                };
            Ok((FileRef { path: rel, ..f }, how))
        }
    };
    // A store copies several objects at once as it copies one (the S3 server of the tests:
    // 10.7 GB in 7 files, 16.5 s one at a time).
    let copied: Vec<(FileRef, &str)> =
        futures::stream::iter(files.iter().enumerate()).map(copy).buffered(COPIES_IN_FLIGHT).try_collect().await?;
    let (copies, mut how): (Vec<FileRef>, Vec<&str>) = copied.into_iter().unzip();
    how.dedup();
    tracing::info!(
        uid,
        subtask,
        checkpoint = id,
        files = files.len(),
        bytes = files.iter().map(|f| f.len).sum::<u64>(),
        how = how.join(", "),
        ms = started.elapsed().as_millis() as u64,
        "keyed state: the chain restored from another root copied into the job's root"
    );
    Ok(copies)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL_EVERY: usize = 10;

    /// A chain of `files` files: a 100-byte base and increments of `increment` bytes each.
    fn chain(files: usize, increment: u64) -> Vec<u64> {
        std::iter::once(100).chain(std::iter::repeat_n(increment, files - 1)).collect()
    }

    /// The step for a chain of `lens`, without runs of increments (the heap backend's chains);
    /// `busy`: an image of it is being merged.
    fn step(lens: &[u64], busy: bool, failures: u32) -> ChainStep {
        let in_flight = InFlight { image: busy.then_some(lens.len()), run: false };
        chain_step(lens, FULL_EVERY, false, false, in_flight, failures)
    }

    #[test]
    fn a_chain_is_merged_once_its_increments_hold_half_its_base_or_it_is_long() {
        let all = |files| ChainStep::Merge(0..files);
        assert_eq!(step(&chain(FULL_EVERY, 50), false, 0), ChainStep::Keep, "not longer than fullEvery");
        assert_eq!(step(&chain(FULL_EVERY + 1, 1), false, 0), ChainStep::Keep, "increments small");
        assert_eq!(step(&chain(FULL_EVERY + 1, 5), false, 0), all(FULL_EVERY + 1), "half the base");
        let long = MERGE_ANYWAY_FACTOR * FULL_EVERY + 1;
        assert_eq!(step(&chain(long, 0), false, 0), all(long), "long");
        assert_eq!(step(&chain(long, 50), true, 0), ChainStep::Keep, "a merge of it is running");
    }

    #[test]
    fn a_chain_past_the_limit_gets_another_merge_until_its_merges_keep_failing() {
        // Restored this long, or grown while a slow merge ran: merged beside the task, not
        // stopped for a full image.
        let files = CHAIN_LIMIT_FACTOR * FULL_EVERY + 1;
        let too_long = chain(files, 1);
        assert_eq!(step(&too_long, false, 0), ChainStep::Merge(0..files));
        assert_eq!(step(&too_long, false, MERGE_FAILURES_BEFORE_FULL_IMAGE - 1), ChainStep::Merge(0..files));
        assert_eq!(step(&too_long, false, MERGE_FAILURES_BEFORE_FULL_IMAGE), ChainStep::FullImageFromTask);
        // While a merge runs, the chain waits for it whatever its length.
        assert_eq!(step(&too_long, true, MERGE_FAILURES_BEFORE_FULL_IMAGE), ChainStep::Keep);
        // Failures alone, on a chain within the limit, change nothing.
        let within = chain(CHAIN_LIMIT_FACTOR * FULL_EVERY, 1);
        assert_eq!(step(&within, false, 5), ChainStep::Merge(0..within.len()));
    }

    /// With increments that merge into one (the rocksdb backend's), runs of similar increments
    /// merge into one, oldest run first, before the chain is merged into an image for holding
    /// half its base in increments.
    #[test]
    fn runs_of_similar_increments_merge_into_one_before_the_chain_needs_an_image() {
        let runs = |lens: &[u64]| chain_step(lens, FULL_EVERY, true, false, InFlight::default(), 0);
        let mut lens = vec![1_000_000u64];
        lens.extend([1000, 3000, 800, 2000, 1000, 1000, 900, 1100, 3100, 1000]);
        assert_eq!(runs(&lens), ChainStep::Merge(1..11), "ten within 4× of each other");
        // One much smaller goes with the run but does not count toward it.
        lens[5] = 100;
        assert_eq!(runs(&lens), ChainStep::Keep, "nine like the largest");
        lens.push(1000);
        assert_eq!(runs(&lens), ChainStep::Merge(1..12));
        // One much larger ends it.
        lens[6] = 100_000;
        assert_eq!(runs(&lens), ChainStep::Keep);
        // A merged increment (ten times one) does not join the run of small ones after it.
        let mut lens = vec![1_000_000u64, 10_000, 10_000];
        lens.extend(std::iter::repeat_n(1000, 9));
        assert_eq!(runs(&lens), ChainStep::Keep, "nine small ones");
        lens.push(1000);
        assert_eq!(runs(&lens), ChainStep::Merge(3..13), "ten small ones");
        // The oldest run first: ten merged increments, and the small ones after them with them.
        let mut tiers = vec![1_000_000u64];
        tiers.extend(std::iter::repeat_n(10_000, 10));
        tiers.extend(std::iter::repeat_n(1000, 10));
        assert_eq!(runs(&tiers), ChainStep::Merge(1..21));
        // A few small ones left between two runs of larger ones do not keep them apart.
        let mut stranded = vec![1_000_000u64];
        stranded.extend([300, 280, 310, 290, 30, 25, 36, 300, 320, 290, 280, 310, 295]);
        assert_eq!(runs(&stranded), ChainStep::Merge(1..14));
        // Increments of half the base: their run first, then an image.
        assert_eq!(runs(&chain(FULL_EVERY + 1, 5)), ChainStep::Merge(1..FULL_EVERY + 1));
        let mut merged_run = vec![100, 50];
        merged_run.extend(std::iter::repeat_n(1, FULL_EVERY - 1));
        assert_eq!(runs(&merged_run), ChainStep::Merge(0..FULL_EVERY + 1), "no run");
        // A long chain with no run: its increments into one.
        let sizes: Vec<u64> = std::iter::once(10_000_000_000).chain((0..45).map(|i| 1u64 << (i % 30))).collect();
        assert_eq!(similar_run(&sizes[1..], FULL_EVERY), None);
        assert_eq!(runs(&sizes), ChainStep::Merge(1..46));
        assert_eq!(similar_run(&[], 2), None);
        assert_eq!(similar_run(&[5, 5], 2), Some(0..2));
    }

    /// [`similar_run`] finds the run that counting every start's every end finds (the
    /// definition, kept here as the model), on random chains of sizes spread over six orders
    /// of magnitude, some long runs of equal sizes among them.
    #[test]
    fn similar_runs_are_the_runs_every_start_and_end_counted_gives() {
        fn model(increments: &[u64], fan_in: usize) -> Option<Range<usize>> {
            (0..increments.len()).find_map(|start| {
                let mut run = None;
                for end in start + 1..=increments.len() {
                    let largest = increments[start..end].iter().copied().max().unwrap_or(0);
                    if increments[start..end].iter().filter(|&&len| within_similar(len, largest)).count() >= fan_in {
                        run = Some(start..end);
                    }
                }
                run
            })
        }
        let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
        println!("seed {seed}");
        let mut next = seed;
        let mut random = move || {
            next = crate::value::mix64(next.wrapping_add(0x9e37_79b9_7f4a_7c15));
            next
        };
        for case in 0..2_000 {
            let len = (random() % 40) as usize;
            let mut sizes = Vec::with_capacity(len);
            while sizes.len() < len {
                let size = 1 + random() % 10u64.pow(1 + (random() % 6) as u32);
                let repeats = if random() % 4 == 0 { 1 + (random() % 12) as usize } else { 1 };
                sizes.extend(std::iter::repeat_n(size, repeats.min(len - sizes.len())));
            }
            let fan_in = 1 + (random() % 10) as usize;
            assert_eq!(
                similar_run(&sizes, fan_in),
                model(&sizes, fan_in),
                "seed {seed}, case {case}: {sizes:?}, fan-in {fan_in}"
            );
        }
    }

    /// While an image of a chain's first files is being merged, a run of the increments after
    /// them is merged beside it, and no run of files the image reads; while a run is merging,
    /// no other run and no image is asked for.
    #[test]
    fn runs_merge_beside_an_image_of_the_files_before_them() {
        let step = |lens: &[u64], image: Option<usize>, run: bool| {
            chain_step(lens, FULL_EVERY, true, false, InFlight { image, run }, 0)
        };
        let mut lens = vec![100u64];
        lens.extend(std::iter::repeat_n(60, 25));
        assert_eq!(step(&lens, None, false), ChainStep::Merge(1..26));
        assert_eq!(step(&lens, Some(12), false), ChainStep::Merge(12..26), "after the image's files");
        assert_eq!(step(&lens, Some(20), false), ChainStep::Keep, "six after the image's files");
        assert_eq!(step(&lens, None, true), ChainStep::Keep, "a run is merging");
        // No run: no image either while one is merging; else the increments make an image.
        let mut lens = vec![100u64, 400];
        lens.extend(std::iter::repeat_n(10, FULL_EVERY - 1));
        assert_eq!(step(&lens, None, false), ChainStep::Merge(0..FULL_EVERY + 1));
        assert_eq!(step(&lens, None, true), ChainStep::Keep);
        assert_eq!(step(&lens, Some(3), false), ChainStep::Keep);
        // Nothing for a broken chain.
        assert_eq!(chain_step(&lens, FULL_EVERY, true, true, InFlight::default(), 0), ChainStep::Keep);
    }

    /// A staged merge replaces its files where they now are: an image the chain's beginning,
    /// if the chain still begins with its files; a run wherever its files still follow each
    /// other (after an image merged meanwhile), and nothing once an image took them.
    #[test]
    fn merges_are_adopted_where_their_files_now_are() {
        let f = |i: u64| FileRef::new(format!("../shared/op/0-{i}-1.kv"), i, 0);
        let chain: Vec<FileRef> = (1..=8).map(f).collect();
        let request = |run: Range<usize>| MergeRequest {
            uid: "op".into(),
            subtask: 0,
            checkpoint_id: 8,
            chain: chain[..6].to_vec(),
            run,
            store_tables: true,
        };
        assert_eq!(merged_at(&chain, &request(0..6), &(0..6)), Some(0));
        assert_eq!(merged_at(&chain, &request(2..6), &(2..6)), Some(2));
        // An image of the first three merged meanwhile: the run moved.
        let mut imaged = vec![FileRef::new("../shared/op/0-3-1-merged.kv".into(), 9, 0)];
        imaged.extend_from_slice(&chain[3..]);
        assert_eq!(merged_at(&imaged, &request(3..6), &(3..6)), Some(1));
        assert_eq!(merged_at(&imaged, &request(2..6), &(2..6)), None, "the image took one of its files");
        assert_eq!(merged_at(&imaged, &request(0..6), &(0..6)), None, "the chain no longer begins with it");
        // A run merged meanwhile: an image whose chain held those files is not adopted.
        let mut run_merged = chain[..3].to_vec();
        run_merged.push(FileRef::new("../shared/op/0-6-1-merged-increment.kv".into(), 9, 0));
        run_merged.extend_from_slice(&chain[6..]);
        assert_eq!(merged_at(&run_merged, &request(0..6), &(0..6)), None);
        assert_eq!(merged_at(&run_merged, &request(0..3), &(0..3)).map(|_| ()), None, "its request's chain is 6 long");
    }

    /// Merge failures counted on a chain that grew past the limit make its task write a full
    /// image; once that image restarts the chain, the count starts again, so that the new chain
    /// is merged in the background again before its task is ever asked for another image.
    #[test]
    fn a_full_image_restarts_the_count_of_failed_merges() {
        let dir = tempfile::tempdir().unwrap();
        let storage = Storage::open("memory://merges").unwrap();
        let merger = Merger::new("test".into(), storage, PendingFiles::default(), 1, dir.path().to_path_buf());
        let mut merges = Merges {
            merger,
            staged: Vec::new(),
            metrics: Arc::new(crate::metrics::JobMetrics::new("job", "test")),
            full_every: FULL_EVERY,
            store_tables: false,
            failures_in_a_row: HashMap::from([("op".to_string(), MERGE_FAILURES_BEFORE_FULL_IMAGE)]),
        };
        let file = |n: usize| FileRef::new(format!("op-{n}.kv"), 100, 0);
        let flag = Arc::new(AtomicBool::new(false));
        let flags = [("op".to_string(), flag.clone())];
        let long = Chain { files: (0..=CHAIN_LIMIT_FACTOR * FULL_EVERY).map(file).collect(), ..Chain::default() };
        request_merges(&mut merges, &HashMap::from([("op".to_string(), long)]), 7, 0, &flags);
        assert!(flag.swap(false, Ordering::AcqRel), "the task is asked for a full image");
        assert_eq!(merges.failures_in_a_row.get("op"), Some(&MERGE_FAILURES_BEFORE_FULL_IMAGE));

        let restarted = Chain { files: vec![file(100)], ..Chain::default() };
        request_merges(&mut merges, &HashMap::from([("op".to_string(), restarted)]), 8, 0, &flags);
        assert_eq!(merges.failures_in_a_row.get("op"), None, "the count starts again");
        assert!(!flag.load(Ordering::Acquire));
    }

    /// A keyed snapshot of `kind` whose file holds `data`.
    fn keyed_job(id: u64, kind: FileKind, data: &'static [u8], force_full: &Arc<AtomicBool>) -> UploadJob {
        let keyed = crate::state::KeyedSnapshot {
            kind,
            data: bytes::Bytes::from_static(data),
            file: None,
            crc32c: crc32c::crc32c(data),
            entries: 1,
            live_entries: Some(1),
            puts_from: Some(0),
            shard_bytes: None,
            in_window_order: false,
            int_keys: false,
            table_slot_bytes: None,
        };
        let parts = StateParts { keyed: Some(keyed), force_full: Some(force_full.clone()), ..StateParts::default() };
        UploadJob {
            barrier: Barrier { id, target: SnapshotTarget::Checkpoint },
            task: 0,
            subtask: 0,
            parallelism: 1,
            key_groups: (0, 64),
            parts: vec![("counts".to_string(), parts)],
            alignment_ms: 0,
        }
    }

    /// A chain restored from another root is copied into the job's root by the first
    /// increment's upload, before the increment, and listed under the copies' names with the
    /// originals' lengths and checksums; the originals stay. A copy that fails fails the
    /// checkpoint: the chain waits for a full image, which drops the restored files.
    #[test]
    fn the_first_increment_copies_a_chain_restored_from_another_root_into_the_job_root() {
        let faults = Faults::none(Arc::new(crate::metrics::JobMetrics::new("t", "t")));
        let io = crate::io();
        let source = Storage::open("memory://other").unwrap();
        let originals =
            [("savepoints/sp-1/counts/0.kv", &b"image"[..]), ("checkpoints/shared/counts/0-2-1.kv", b"inc")];
        for (path, data) in originals {
            io.block_on(source.put(path, bytes::Bytes::from_static(data))).unwrap();
        }
        let refs: Vec<FileRef> = [("counts/0.kv", &b"image"[..]), ("../../checkpoints/shared/counts/0-2-1.kv", b"inc")]
            .iter()
            .map(|(path, data)| {
                FileRef::new(path.to_string(), data.len() as u64, crc32c::crc32c(data)).with_puts_from(Some(0))
            })
            .collect();
        let from = ChainSource { storage: source.clone(), dir: "savepoints/sp-1".into() };
        let restored = |copy_from| Chain { files: refs.clone(), copy_from, ..Chain::default() };
        let storage = Storage::open("memory://job").unwrap();
        let flag = Arc::new(AtomicBool::new(false));
        let mut chains: HashMap<String, Chain> = [("counts".to_string(), restored(Some(from.clone())))].into();
        let job = keyed_job(7, FileKind::KeyedIncrement, b"changes", &flag);
        let ack = io.block_on(upload(&storage, 3, &faults, &mut chains, &mut Vec::new(), None, job)).unwrap();
        let listed = &ack.operators[0].snapshot.keyed_state;
        let paths: Vec<&str> = listed.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(
            paths,
            ["../shared/counts/0-7-3-adopted-0.kv", "../shared/counts/0-7-3-adopted-1.kv", "../shared/counts/0-7-3.kv"]
        );
        for ((copy, restored_ref), (original, data)) in listed.iter().zip(&refs).zip(originals) {
            assert_eq!(
                (copy.len, copy.crc32c, copy.puts_from),
                (restored_ref.len, restored_ref.crc32c, restored_ref.puts_from)
            );
            let copied = io.block_on(storage.get(&layout::resolve("checkpoints/chk-7", &copy.path))).unwrap();
            assert_eq!(&copied[..], data);
            assert_eq!(&io.block_on(source.get(original)).unwrap()[..], data, "the original stays");
        }
        assert!(chains["counts"].copy_from.is_none(), "copied once");
        let next = io.block_on(upload(
            &storage,
            3,
            &faults,
            &mut chains,
            &mut Vec::new(),
            None,
            keyed_job(8, FileKind::KeyedIncrement, b"more", &flag),
        ));
        assert_eq!(next.unwrap().operators[0].snapshot.keyed_state.len(), 4, "the copies, then both increments");

        // The second original is gone: the copy fails, and so does the checkpoint.
        io.block_on(source.delete(originals[1].0)).unwrap();
        let mut chains: HashMap<String, Chain> = [("counts".to_string(), restored(Some(from)))].into();
        let job = keyed_job(9, FileKind::KeyedIncrement, b"changes", &flag);
        let failed = io.block_on(upload(&storage, 4, &faults, &mut chains, &mut Vec::new(), None, job)).unwrap_err();
        assert!(
            failed.contains("copying the restored keyed state of `counts`") && failed.contains("not found"),
            "{failed}"
        );
        assert!(flag.load(Ordering::Acquire) && chains["counts"].broken, "the next snapshot must be full");
        let job = keyed_job(10, FileKind::KeyedIncrement, b"changes", &flag);
        assert!(io.block_on(upload(&storage, 4, &faults, &mut chains, &mut Vec::new(), None, job)).is_err());
        let job = keyed_job(11, FileKind::KeyedFull, b"everything", &flag);
        let ack = io.block_on(upload(&storage, 4, &faults, &mut chains, &mut Vec::new(), None, job)).unwrap();
        let paths: Vec<String> = ack.operators[0].snapshot.keyed_state.iter().map(|f| f.path.clone()).collect();
        assert_eq!(paths, ["../shared/counts/0-11-4.kv"]);
        assert!(chains["counts"].copy_from.is_none() && !chains["counts"].broken);
    }

    /// A continued chain lists its restored table files until its restore could not take one
    /// in; from then on it lists none, even once the flag is down again.
    #[test]
    fn a_chain_stops_listing_its_tables_once_a_restore_fell_back_from_one() {
        let fell_back = Arc::new(AtomicBool::new(false));
        let tables = vec![FileRef::new("t0.sst".into(), 10, 0), FileRef::new("t1.sst".into(), 10, 0)];
        let mut chain = Chain {
            files: vec![FileRef::new("image.kv".into(), 100, 0)],
            tables: tables.clone(),
            tables_fell_back: Some(fell_back.clone()),
            copy_from: None,
            broken: false,
        };
        assert_eq!(chain.listed_tables(), tables);
        fell_back.store(true, Ordering::Release);
        assert_eq!(chain.listed_tables(), Vec::<FileRef>::new());
        fell_back.store(false, Ordering::Release);
        assert_eq!(chain.listed_tables(), Vec::<FileRef>::new());
        assert_eq!(chain.files.len(), 1, "the image they stood for stays");
    }
}
