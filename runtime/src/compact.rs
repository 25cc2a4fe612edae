//! Full images merged in the background from files already uploaded.
//!
//! A periodic full image written by the task stops its records while it encodes every entry,
//! and its upload holds back the checkpoints behind it: with 90M entries, 36 s. Above a size
//! ([`weir_crds::job::CheckpointingSpec::background_full_image_above`]) the task writes only
//! increments, and once a chain is longer than `fullEvery` files its uploader asks this merger
//! for a new full image:
//! 1. every file of the chain is downloaded to local disk and verified (length and CRC-32C),
//!    then read in parts into a [`BulkLoad`] (sorted runs, spilled to disk: memory stays
//!    bounded whatever the state's size), each entry under its key's place in window order
//!    ([`crate::state::map::window_order`]), then its key;
//! 2. the runs are merged (the newest entry of a key wins; a deletion leaves nothing) into
//!    one full image, in window order (so that a heap restore fills its tables window by
//!    window), streamed to a local file and uploaded under its final name
//!    ([`layout::shared_merged_file`], after the checkpoint whose chain it merges), registered
//!    first as a [`PendingFiles`] entry so that retention leaves it alone until a checkpoint
//!    lists it;
//! 3. the uploader's next checkpoint adopts it when its chain still begins with the files
//!    merged: it lists it in place of those files. Otherwise (the chain was restarted by a full
//!    image meanwhile) the merged image is deleted. Nothing is copied or renamed: on an object
//!    store a rename is a copy, which took 4.5 s for a 550 MB image on the S3 server here, held
//!    a checkpoint back that long, and cannot copy an object over 5 GiB in one request.
//!
//! On the rocksdb backend, whose increments are ordered by key group, a run of increments after
//! the image can also be merged into one increment ([`merge_increments`]), listed in place of
//! the run the same way; the uploader's policy (`upload::chain_step`) says which.
//!
//! The merged image holds exactly the entries a restore of the chain would: the chain's files
//! are read in chain order, and within a file in file order, as a restore applies them.
//! Nothing here changes a file a checkpoint lists, so a failed or abandoned merge loses
//! nothing: the chain stays as it was and the next one is tried later.
//!
//! When its uploader goes (the run ends, or restarts in the same process), the merger is
//! cancelled: queued merges never start and the running one stops at its next file, part (a
//! megabyte) or 64K merged entries, deleting its scratch files, instead of competing with the
//! next run's tasks (a download or upload in progress is finished first). A merge staged while
//! its uploader went, which nobody will adopt, is deleted by the merger itself.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use weir_checkpoint::format::{self, ConcatError, FileKind, FormatError, PartsError, StateFileStream};
use weir_checkpoint::local::SyncedWriter;
use weir_checkpoint::retention::PendingFiles;
use weir_checkpoint::{layout, FileRef, Storage, StorageError};

use crate::state::bulk::BulkLoad;
use crate::state::map::{hash_of, shard_in_order, window_order};
use crate::state::{StateStore, StoreError};

/// How much of a downloaded file is read at once.
const PART_BYTES: usize = 1 << 20;

/// Entries sorted in memory before a run goes to disk, and runs merged at once (a 256 KiB
/// buffer each): a merge runs beside the job, in the same memory limit, so it takes about
/// 10 MiB (a restore, which runs alone, takes about 32).
const RUN_BYTES: usize = 4 << 20;
const MERGE_FAN_IN: usize = 16;

/// Entries per table file a merge writes (RocksDB keeps 8 bytes per key of the file being
/// written, 4 MiB here): with 32 MiB files, the 5×-memory test's job went over its limit.
#[cfg(feature = "rocksdb")]
const TABLE_ENTRIES: u64 = 512 << 10;

/// A chain of one operator's keyed-state files to merge.
#[derive(Clone, Debug)]
pub struct MergeRequest {
    /// Operator uid.
    pub uid: String,
    /// Subtask index.
    pub subtask: u32,
    /// The checkpoint whose chain this is (its files are relative to its directory).
    pub checkpoint_id: u64,
    /// The chain: a full image, then increments in order.
    pub chain: Vec<FileRef>,
    /// The files of `chain` to merge: all of them into a new full image (`0..chain.len()`),
    /// or a run of increments after the full image into one increment, which replaces them
    /// (the rocksdb backend's increments, ordered by key group: see [`merge_increments`]).
    pub run: Range<usize>,
    /// Also write the image as the rocksdb backend's table files (sorted by store key rather
    /// than by the heap map's bucket), for that backend's restores to take in whole.
    pub store_tables: bool,
}

/// A file a merge wrote: where it is, its length and CRC-32C.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagedFile {
    /// Relative to the job root.
    pub path: String,
    /// Relative to a checkpoint directory (as a checkpoint lists it).
    pub rel: String,
    /// Its length.
    pub len: u64,
    /// Its CRC-32C.
    pub crc32c: u32,
    /// A table file's first store key (see [`FileRef::first_key`]).
    pub first_key: Option<Vec<u8>>,
    /// A merged image, which lists each key once: 0 (see [`FileRef::puts_from`]).
    pub puts_from: Option<u64>,
    /// A merged image for the heap backend: the bytes of each shard's entries (see
    /// [`FileRef::shard_bytes`]).
    pub shard_bytes: Option<Vec<u64>>,
    /// A merged image for the heap backend, in window order (see [`FileRef::in_window_order`]).
    pub in_window_order: bool,
}

impl StagedFile {
    /// The reference a checkpoint lists for it.
    pub fn listed(&self) -> FileRef {
        let file = FileRef::new(self.rel.clone(), self.len, self.crc32c)
            .with_puts_from(self.puts_from)
            .with_shard_bytes(self.shard_bytes.as_deref())
            .with_window_order(self.in_window_order);
        match &self.first_key {
            Some(key) => file.with_first_key(key),
            None => file,
        }
    }
}

/// A merge written to storage, waiting to be adopted.
#[derive(Clone, Debug)]
pub struct StagedMerge {
    /// What was merged.
    pub request: MergeRequest,
    /// The merged image, or the merged increment.
    pub file: StagedFile,
    /// The files of the request's chain it replaces: all of them for an image.
    pub replaces: Range<usize>,
    /// Live entries in a merged image (a merged increment's are not counted).
    pub entries: u64,
    /// The same entries as table files, in key order (when the request asked for them).
    pub tables: Vec<StagedFile>,
    /// How long the merge took.
    pub took: Duration,
}

impl StagedMerge {
    /// Deletes what it wrote (nobody will adopt it) and stops protecting it.
    pub async fn delete(&self, storage: &Storage, pending: &PendingFiles) {
        for f in std::iter::once(&self.file).chain(&self.tables) {
            let _ = storage.delete(&f.path).await;
            pending.remove(&f.path);
        }
    }
}

/// What [`merge`] wrote.
#[derive(Debug)]
pub struct Merged {
    /// The image, or the increment.
    pub file: StagedFile,
    /// The files of the request's chain it replaces.
    pub replaces: Range<usize>,
    /// Live entries in an image (0 for an increment, whose entries are not decoded).
    pub entries: u64,
    /// Its table files, in key order (when asked for).
    pub tables: Vec<StagedFile>,
}

/// Why a merge failed, by step.
#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    /// A file of the chain could not be downloaded.
    #[error("downloading {path}: {source}")]
    Download {
        /// The file.
        path: String,
        /// Why.
        source: Box<StorageError>,
    },
    /// A downloaded file is not the one the checkpoint lists.
    #[error("{path} does not match its checkpoint: {reason}")]
    Mismatch {
        /// The file.
        path: String,
        /// Length or checksum.
        reason: String,
    },
    /// A file could not be parsed.
    #[error("reading {path}: {reason}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// Sorting, spilling or merging the entries failed.
    #[error("merging: {0}")]
    Merge(StoreError),
    /// The merged image or increment could not be written to local disk.
    #[error("writing the merged file: {0}")]
    WriteImage(std::io::Error),
    /// The merged image or increment could not be uploaded.
    #[error("uploading the merged file: {0}")]
    Upload(Box<StorageError>),
    /// The merger was cancelled (its uploader is gone) before the merge was staged.
    #[error("cancelled: the uploader that asked for the merge is gone")]
    Cancelled,
}

impl MergeError {
    /// Whether a file of the chain is missing or not what its checkpoint lists (as opposed
    /// to a failure of this merge's own I/O).
    pub fn damaged_input(&self) -> bool {
        match self {
            MergeError::Mismatch { .. } | MergeError::Read { .. } => true,
            MergeError::Download { source, .. } => matches!(**source, StorageError::NotFound(_)),
            _ => false,
        }
    }
}

/// How a merge ended.
#[derive(Debug)]
pub enum MergeOutcome {
    /// Staged, to be adopted.
    Staged(StagedMerge),
    /// Failed; the chain stays as it is.
    Failed {
        /// What was to be merged.
        request: MergeRequest,
        /// Why.
        error: MergeError,
    },
}

/// One task's merger: two threads, each started by its first request, one merging chains into
/// images and one merging runs of increments, each one merge at a time. A run takes seconds
/// where an image of a large state takes minutes; in one queue, runs waited behind every image
/// and the chain grew by one file per checkpoint meanwhile.
pub struct Merger {
    name: String,
    storage: Storage,
    /// The run's files written ahead of the checkpoints that will list them.
    pending: PendingFiles,
    epoch: u64,
    local_dir: PathBuf,
    /// Merges into images, and merges of runs.
    lanes: [Lane; 2],
    /// Each operator's merges running or queued: the chain's length at the request of an
    /// image, and whether a run is merging.
    in_flight: HashMap<String, InFlight>,
    /// Set when the merger is dropped or cancelled; its threads check it between steps.
    cancelled: Arc<AtomicBool>,
}

/// One of a merger's threads, and its queues.
#[derive(Default)]
struct Lane {
    requests: Option<Sender<MergeRequest>>,
    outcomes: Option<Receiver<MergeOutcome>>,
    /// The thread; it returns how many merges it started.
    thread: Option<JoinHandle<u32>>,
}

/// What of one operator's chain is being merged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InFlight {
    /// An image of the chain's first this many files.
    pub image: Option<usize>,
    /// A run of increments.
    pub run: bool,
}

/// The lane of a request: 0 for an image, 1 for a run.
fn lane_of(request: &MergeRequest) -> usize {
    usize::from(request.run.start > 0)
}

static NEXT_SCRATCH: AtomicU64 = AtomicU64::new(0);

impl Merger {
    /// A merger whose threads (named after `name`) write merges to `storage` as `epoch`,
    /// protected from retention by `pending` until adopted, working in local files under
    /// `local_dir`.
    pub fn new(name: String, storage: Storage, pending: PendingFiles, epoch: u64, local_dir: PathBuf) -> Merger {
        Merger {
            name,
            storage,
            pending,
            epoch,
            local_dir,
            lanes: Default::default(),
            in_flight: HashMap::new(),
            cancelled: Arc::default(),
        }
    }

    /// Stops the merger: queued merges never start, running ones stop at their next step and
    /// stage nothing. The threads that ran are returned to be joined (each returns how many
    /// merges it started); dropping the merger cancels it without waiting.
    pub fn cancel(mut self) -> Vec<JoinHandle<u32>> {
        self.cancelled.store(true, Ordering::Release);
        self.lanes
            .iter_mut()
            .filter_map(|lane| {
                lane.requests = None;
                lane.thread.take()
            })
            .collect()
    }

    fn start(&mut self, lane: usize) -> Option<&Sender<MergeRequest>> {
        if self.lanes[lane].requests.is_none() {
            let (requests, jobs) = crossbeam_channel::unbounded::<MergeRequest>();
            let (done, outcomes) = crossbeam_channel::unbounded::<MergeOutcome>();
            // The thread's own end of its outcomes: what the uploader never took when it went.
            let untaken = outcomes.clone();
            let (storage, epoch, local_dir) = (self.storage.clone(), self.epoch, self.local_dir.clone());
            let pending = self.pending.clone();
            let cancelled = self.cancelled.clone();
            let name = format!("{}{}", self.name, if lane == 0 { "" } else { "-runs" });
            let spawned = std::thread::Builder::new().name(name).spawn(move || {
                lower_this_threads_priority();
                // Scratch files of merges a killed process left behind.
                crate::state::store::remove_stores_of_dead_processes(&local_dir);
                let mut started_merges = 0;
                for request in jobs {
                    if cancelled.load(Ordering::Acquire) {
                        break;
                    }
                    started_merges += 1;
                    let started = Instant::now();
                    let stop = || cancelled.load(Ordering::Acquire);
                    let outcome = match merge(&storage, &pending, epoch, &local_dir, &request, &stop) {
                        Ok(m) => MergeOutcome::Staged(StagedMerge {
                            request,
                            file: m.file,
                            replaces: m.replaces,
                            entries: m.entries,
                            tables: m.tables,
                            took: started.elapsed(),
                        }),
                        Err(error) => MergeOutcome::Failed { request, error },
                    };
                    if done.send(outcome).is_err() {
                        break;
                    }
                }
                // The loop ends when the uploader is gone: merges staged after its last look
                // are nobody's to adopt.
                for outcome in untaken.try_iter() {
                    if let MergeOutcome::Staged(s) = outcome {
                        crate::io().block_on(s.delete(&storage, &pending));
                    }
                }
                started_merges
            });
            match spawned {
                Ok(thread) => self.lanes[lane].thread = Some(thread),
                Err(error) => {
                    tracing::warn!(%error, "the background merger could not start; full images stay with the tasks");
                    return None;
                }
            }
            self.lanes[lane].requests = Some(requests);
            self.lanes[lane].outcomes = Some(outcomes);
        }
        self.lanes[lane].requests.as_ref()
    }

    /// Asks for a merge unless one of the same operator's chain of the same kind (image or
    /// run) is in flight; whether it was asked.
    pub fn request(&mut self, request: MergeRequest) -> bool {
        let lane = lane_of(&request);
        let in_flight = self.in_flight(&request.uid);
        if (lane == 0 && in_flight.image.is_some()) || (lane == 1 && in_flight.run) {
            return false;
        }
        let (uid, chain_len) = (request.uid.clone(), request.chain.len());
        let sent = self.start(lane).is_some_and(|requests| requests.send(request).is_ok());
        if sent {
            let entry = self.in_flight.entry(uid).or_default();
            if lane == 0 {
                entry.image = Some(chain_len);
            } else {
                entry.run = true;
            }
        }
        sent
    }

    /// What of `uid`'s chain is being merged or queued.
    pub fn in_flight(&self, uid: &str) -> InFlight {
        self.in_flight.get(uid).copied().unwrap_or_default()
    }

    /// The files written ahead of the checkpoints that will list them.
    pub fn pending(&self) -> &PendingFiles {
        &self.pending
    }

    /// The merges that ended since the last call.
    pub fn finished(&mut self) -> Vec<MergeOutcome> {
        let mut out = Vec::new();
        for lane in 0..self.lanes.len() {
            let Some(outcomes) = self.lanes[lane].outcomes.clone() else { continue };
            loop {
                match outcomes.try_recv() {
                    Ok(outcome) => {
                        let request = match &outcome {
                            MergeOutcome::Staged(s) => &s.request,
                            MergeOutcome::Failed { request, .. } => request,
                        };
                        if let Some(entry) = self.in_flight.get_mut(&request.uid) {
                            if lane == 0 {
                                entry.image = None;
                            } else {
                                entry.run = false;
                            }
                        }
                        out.push(outcome);
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        // The thread is gone (it panicked): nothing runs in its lane any more,
                        // and the next request starts a new one.
                        tracing::warn!(merger = %self.name, lane, "a background merger stopped; starting it again");
                        for entry in self.in_flight.values_mut() {
                            if lane == 0 {
                                entry.image = None;
                            } else {
                                entry.run = false;
                            }
                        }
                        self.lanes[lane] = Lane::default();
                        break;
                    }
                }
            }
        }
        out
    }
}

impl Drop for Merger {
    fn drop(&mut self) {
        self.cancelled.store(true, Ordering::Release);
    }
}

/// Scratch files of one merge, deleted with it. Named like state stores
/// (`<label>-<pid>-<n>`), so that a killed process's leftovers are deleted by the next process
/// that opens a state store in the same directory.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What a part of a merge's reading loops stopped on.
enum Stop {
    Store(StoreError),
    Cancelled,
}

impl From<StoreError> for Stop {
    fn from(e: StoreError) -> Self {
        Stop::Store(e)
    }
}

impl From<FormatError> for Stop {
    fn from(e: FormatError) -> Self {
        Stop::Store(StoreError::Decode(e))
    }
}

/// Every this many merged entries, a merge asks whether to stop.
const STOP_CHECK_ENTRIES: u64 = 1 << 16;

/// Merges one chain and stages the result (and its table files, when asked for).
/// Stops with [`MergeError::Cancelled`] at the first file, part, pass or [`STOP_CHECK_ENTRIES`]
/// merged entries after `stop` answers true.
pub fn merge(
    storage: &Storage,
    pending: &PendingFiles,
    epoch: u64,
    local_dir: &Path,
    request: &MergeRequest,
    stop: &dyn Fn() -> bool,
) -> Result<Merged, MergeError> {
    let check = || if stop() { Err(MergeError::Cancelled) } else { Ok(()) };
    let part_check = || if stop() { Err(Stop::Cancelled) } else { Ok(()) };
    // The merge passes' callbacks can only fail with a store error: a stop is recorded here
    // and reported as a cancellation.
    let stopped = std::cell::Cell::new(false);
    let mut emitted = 0u64;
    let mut entry_check = || {
        emitted += 1;
        if emitted.is_multiple_of(STOP_CHECK_ENTRIES) && stop() {
            stopped.set(true);
            return Err(StoreError::SpillImage(std::io::Error::other("the merge was cancelled")));
        }
        Ok(())
    };
    let merge_failed = |e: StoreError| match e {
        _ if stopped.get() => MergeError::Cancelled,
        StoreError::SpillImage(io) => MergeError::WriteImage(io),
        e => MergeError::Merge(e),
    };
    let n = NEXT_SCRATCH.fetch_add(1, Ordering::Relaxed);
    let scratch = Scratch(local_dir.join(format!("merge-{}-{n}", std::process::id())));
    std::fs::create_dir_all(&scratch.0).map_err(MergeError::WriteImage)?;
    if request.run.start > 0 {
        if let Some(file) = merge_increments(storage, pending, epoch, &scratch.0, request, &check)? {
            return Ok(Merged { file, replaces: request.run.clone(), entries: 0, tables: Vec::new() });
        }
        tracing::info!(
            uid = %request.uid,
            "keyed state: a run of increments not all ordered by key group; the whole chain is merged into an image"
        );
    }
    let dir = layout::checkpoint_dir(request.checkpoint_id);
    // Step 1: every file of the chain, downloaded and verified.
    let mut inputs = Vec::with_capacity(request.chain.len());
    for (i, file) in request.chain.iter().enumerate() {
        check()?;
        let path = layout::resolve(&dir, &file.path);
        let input = scratch.0.join(format!("input-{i}"));
        let len = download_verified(storage, &path, file, &input)?;
        inputs.push((path, input, len));
    }
    // Step 2: the entries sorted in window order (`map::window_order`), then by key, and
    // merged (the newest entry of a key wins; a deletion leaves nothing). A key's entries share
    // a hash, so they still meet in the merge; and a restore, whatever the size of its map,
    // fills its tables window by window. With table files the order is the store key's (the
    // tables need it): a heap restore of that image is slower.
    #[cfg(feature = "rocksdb")]
    let with_tables = request.store_tables;
    #[cfg(not(feature = "rocksdb"))]
    let with_tables = false;
    let bucket_bytes = if with_tables { 0 } else { 8 };
    let mut load = BulkLoad::with_limits(&scratch.0.join("runs"), RUN_BYTES, MERGE_FAN_IN);
    let mut sort_key = Vec::with_capacity(64);
    for (path, input, len) in &inputs {
        check()?;
        read_entries(input, *len, path, &part_check, |entry| {
            sort_key.clear();
            if !with_tables {
                let bucket = window_order(heap_hash(entry.key)?);
                sort_key.extend_from_slice(&bucket.to_be_bytes());
            }
            StateStore::encoded_key(entry.key_group, entry.key, &mut sort_key);
            load.add(&sort_key, entry.value)?;
            Ok(())
        })?;
        let _ = std::fs::remove_file(input);
    }
    check()?;
    let image = scratch.0.join("image");
    let mut out =
        StateFileStream::new(FileKind::KeyedFull, SyncedWriter::create(&image).map_err(MergeError::WriteImage)?);
    #[cfg(feature = "rocksdb")]
    let table_opts = crate::state::store::options();
    #[cfg(feature = "rocksdb")]
    let mut tables = with_tables.then(|| {
        crate::state::bulk::TableWriter::new(&scratch.0.join("tables"), &table_opts).with_max_entries(TABLE_ENTRIES)
    });
    // In the heap backend's order: the bytes of each shard's entries.
    let mut shard_bytes = vec![0u64; crate::state::map::SHARDS];
    load.into_live_entries(|raw, value| {
        entry_check()?;
        let store_key = &raw[bucket_bytes..];
        let written = out.entries_len();
        #[cfg(feature = "rocksdb")]
        if let Some(tables) = tables.as_mut() {
            tables.put(store_key, value)?;
        }
        let (key_group, key) = StateStore::split_key(store_key)?;
        out.put(key_group, key, value).map_err(StoreError::SpillImage)?;
        if let Ok(order) = <[u8; 8]>::try_from(&raw[..bucket_bytes]) {
            shard_bytes[shard_in_order(u64::from_be_bytes(order))] += out.entries_len() - written;
        }
        Ok(())
    })
    .map_err(merge_failed)?;
    #[cfg(feature = "rocksdb")]
    let table_paths = match tables {
        Some(tables) => tables.finish_with_first_keys().map_err(MergeError::Merge)?,
        None => Vec::new(),
    };
    #[cfg(not(feature = "rocksdb"))]
    let table_paths: Vec<(PathBuf, Vec<u8>)> = Vec::new();
    let entries = out.entries();
    let (writer, len, crc) = out.finish().map_err(MergeError::WriteImage)?;
    writer.sync_all().map_err(MergeError::WriteImage)?;
    check()?;
    let (uid, subtask, id) = (&request.uid, request.subtask, request.checkpoint_id);
    // Under their final names, each protected from retention before it is uploaded. A failure
    // or a stop deletes what was written so far.
    let mut written: Vec<StagedFile> = Vec::with_capacity(table_paths.len() + 1);
    let mut upload = |local: &Path,
                      rel: String,
                      len: u64,
                      crc32c: u32,
                      first_key: Option<&Vec<u8>>|
     -> Result<StagedFile, MergeError> {
        check()?;
        let first_key = first_key.cloned();
        let file = StagedFile {
            path: layout::resolve(&dir, &rel),
            rel,
            len,
            crc32c,
            first_key,
            puts_from: None,
            shard_bytes: None,
            in_window_order: false,
        };
        pending.add(&file.path);
        written.push(file.clone());
        crate::io().block_on(storage.put_file(&file.path, local)).map_err(|e| MergeError::Upload(Box::new(e)))?;
        Ok(file)
    };
    let mut upload_all = || -> Result<(StagedFile, Vec<StagedFile>), MergeError> {
        let mut tables = Vec::with_capacity(table_paths.len());
        for (i, (table, first_key)) in table_paths.iter().enumerate() {
            // A RocksDB table has no seal of its own: it is named by its whole checksum.
            let digest = weir_checkpoint::local::file_digest(table).map_err(MergeError::WriteImage)?;
            let rel = layout::shared_merged_table(uid, subtask, id, epoch, i);
            tables.push(upload(table, rel, digest.len, digest.crc32c, Some(first_key))?);
        }
        let mut image = upload(&image, layout::shared_merged_file(uid, subtask, id, epoch), len, crc, None)?;
        // The newest entry of each key, deletions left out, shard after shard (in window order
        // without tables).
        image.puts_from = Some(0);
        image.shard_bytes = (!with_tables).then(|| shard_bytes.clone());
        image.in_window_order = !with_tables;
        Ok((image, tables))
    };
    match upload_all() {
        Ok((file, tables)) => Ok(Merged { file, replaces: 0..request.chain.len(), entries, tables }),
        Err(e) => {
            for f in &written {
                let _ = crate::io().block_on(storage.delete(&f.path));
                pending.remove(&f.path);
            }
            Err(e)
        }
    }
}

/// Downloads the chain file `file` (at `path` in storage) to `local` and checks that it is what
/// the checkpoint lists; its length.
fn download_verified(storage: &Storage, path: &str, file: &FileRef, local: &Path) -> Result<u64, MergeError> {
    let digest = crate::io()
        .block_on(storage.get_to_file(path, local))
        .map_err(|source| MergeError::Download { path: path.to_string(), source: Box::new(source) })?;
    file.check(&digest).map_err(|reason| MergeError::Mismatch { path: path.to_string(), reason })?;
    Ok(digest.len)
}

/// Merges the run `request.run` of the chain's increments into one increment and stages it
/// (under [`layout::shared_merged_increment`], pending until adopted); `None` when one of them
/// is not an increment ordered by key group with checksums (the heap backend's, or one written
/// before those), which only a merge into an image takes.
///
/// The increments are concatenated key group by key group
/// ([`format::concat_increments`]): nothing is decoded, sorted or dropped, so the result holds
/// as many bytes as the run, and a restore that applies it applies the run. What this buys is
/// fewer files: a restore fetches each increment's head and index before its first record (one
/// request per file from object storage), and a chain kept short by merges into images alone
/// rewrites the whole state each time, which a state growing faster than the merger writes
/// never catches up with (the 10 GiB job of `runtime/BENCHMARKS.md`: 355 increments).
fn merge_increments(
    storage: &Storage,
    pending: &PendingFiles,
    epoch: u64,
    scratch: &Path,
    request: &MergeRequest,
    check: &dyn Fn() -> Result<(), MergeError>,
) -> Result<Option<StagedFile>, MergeError> {
    let dir = layout::checkpoint_dir(request.checkpoint_id);
    let mut inputs = Vec::with_capacity(request.run.len());
    let mut paths = Vec::with_capacity(request.run.len());
    for (i, file) in request.chain[request.run.clone()].iter().enumerate() {
        check()?;
        let path = layout::resolve(&dir, &file.path);
        let local = scratch.join(format!("input-{i}"));
        let len = download_verified(storage, &path, file, &local)?;
        let read_failed = |reason: String| MergeError::Read { path: path.clone(), reason };
        let mut opened = std::fs::File::open(&local).map_err(|e| read_failed(e.to_string()))?;
        match format::read_increment_index(&mut opened, len) {
            Ok(Some(index)) if index.checked => inputs.push((opened, index)),
            Ok(_) => return Ok(None),
            Err(e) => return Err(read_failed(e.to_string())),
        }
        paths.push(path);
    }
    check()?;
    let local = scratch.join("increment");
    let writer = SyncedWriter::create(&local).map_err(MergeError::WriteImage)?;
    let (writer, len, crc32c) = format::concat_increments(&mut inputs, writer).map_err(|e| match e {
        ConcatError::Read { input, source } => {
            MergeError::Read { path: paths[input].clone(), reason: source.to_string() }
        }
        ConcatError::Format { input, source } => {
            MergeError::Read { path: paths[input].clone(), reason: source.to_string() }
        }
        ConcatError::Write(e) => MergeError::WriteImage(e),
    })?;
    writer.sync_all().map_err(MergeError::WriteImage)?;
    drop(inputs);
    check()?;
    let rel = layout::shared_merged_increment(&request.uid, request.subtask, request.checkpoint_id, epoch);
    // A run's entries keep their order (a later entry of a key wins).
    let file = StagedFile {
        path: layout::resolve(&dir, &rel),
        rel,
        len,
        crc32c,
        first_key: None,
        puts_from: None,
        shard_bytes: None,
        in_window_order: false,
    };
    // Protected from retention before it exists; a failed upload deletes what it may have left.
    pending.add(&file.path);
    if let Err(e) = crate::io().block_on(storage.put_file(&file.path, &local)) {
        let _ = crate::io().block_on(storage.delete(&file.path));
        pending.remove(&file.path);
        return Err(MergeError::Upload(Box::new(e)));
    }
    Ok(Some(file))
}

/// How much lower the merger thread's CPU priority is than the tasks' (a nice value): a merge
/// is background work, and when the cores are busy the tasks' records, and the snapshots that
/// stop them, come first.
const MERGER_NICENESS: i32 = 10;

/// Lowers the calling thread's CPU priority by [`MERGER_NICENESS`] (on Linux a thread has a
/// nice value of its own; lowering it needs no privilege). A failure leaves it as it was.
fn lower_this_threads_priority() {
    let thread = rustix::thread::gettid();
    let current = rustix::process::getpriority_process(Some(thread)).unwrap_or(0);
    if let Err(error) = rustix::process::setpriority_process(Some(thread), current + MERGER_NICENESS) {
        tracing::debug!(%error, "the merger thread's priority stays as it was");
    }
}

/// Calls `each` with every entry of the verified local copy `input` of the chain file `path`,
/// read in parts of [`PART_BYTES`], asking `part_check` before each part.
fn read_entries(
    input: &Path,
    len: u64,
    path: &str,
    part_check: &dyn Fn() -> Result<(), Stop>,
    mut each: impl FnMut(format::KeyedEntry<'_>) -> Result<(), Stop>,
) -> Result<(), MergeError> {
    let read_failed = |reason: String| MergeError::Read { path: path.to_string(), reason };
    let opened = std::fs::File::open(input).map_err(|e| read_failed(e.to_string()))?;
    let parts = format::read_keyed_parts(opened, len, PART_BYTES, |body| {
        part_check()?;
        for entry in format::keyed_entries(body) {
            each(entry?)?;
        }
        Ok::<(), Stop>(())
    });
    match parts {
        Ok(_) => Ok(()),
        Err(PartsError::Read(e)) => Err(read_failed(e.to_string())),
        Err(PartsError::Format(e)) => Err(read_failed(e.to_string())),
        Err(PartsError::Consume(Stop::Store(StoreError::Decode(e)))) => Err(read_failed(e.to_string())),
        Err(PartsError::Consume(Stop::Store(e))) => Err(MergeError::Merge(e)),
        Err(PartsError::Consume(Stop::Cancelled)) => Err(MergeError::Cancelled),
    }
}

/// The hash the heap backend's map gives an encoded key (its shard and bucket come from it), as
/// the operator holds the key: a one-field key as a [`Key`](crate::value::Key), a composite
/// one packed ([`PackedKey`](crate::value::PackedKey), see `KeyedContext::composite`).
fn heap_hash(encoded_key: &[u8]) -> Result<u64, StoreError> {
    use crate::value::{is_packed, Key, PackedKey, StateKey};
    let arity = weir_checkpoint::format::Decoder::new(encoded_key).varint()?;
    Ok(if is_packed(arity as usize) {
        hash_of(&PackedKey::decode(encoded_key)?)
    } else {
        hash_of(&<Key as StateKey>::decode(encoded_key)?)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use weir_checkpoint::format::StateFileWriter;

    /// Merged images list entries in the order of the map that restores them, which hashes a
    /// one-field key as a `Key` and a composite one as a `PackedKey`.
    #[test]
    fn merges_order_keys_by_the_hash_of_the_map_that_holds_them() {
        use crate::value::{Key, PackedKey, Record, StateKey, Value};
        use std::hash::BuildHasher;
        let record = Record { time: 0, fields: smallvec::smallvec![Value::str("word"), Value::Int(7)] };
        for fields in [&[0usize][..], &[0, 1]] {
            let key = Key::of(&record, fields);
            let mut e = weir_checkpoint::format::Encoder::default();
            key.encode(&mut e);
            let held = if fields.len() == 1 {
                rustc_hash::FxBuildHasher.hash_one(&key)
            } else {
                rustc_hash::FxBuildHasher.hash_one(PackedKey::of(&record, fields))
            };
            assert_eq!(heap_hash(&e.buf).unwrap(), held, "{fields:?}");
        }
    }

    #[test]
    fn the_merger_thread_runs_at_a_lower_cpu_priority_than_the_tasks() {
        let this = rustix::thread::gettid();
        let before = rustix::process::getpriority_process(Some(this)).unwrap();
        let lowered = std::thread::spawn(|| {
            lower_this_threads_priority();
            rustix::process::getpriority_process(Some(rustix::thread::gettid())).unwrap()
        })
        .join()
        .unwrap();
        assert_eq!(lowered, (before + MERGER_NICENESS).min(19), "nice {before} → {lowered}");
        let after = rustix::process::getpriority_process(Some(this)).unwrap();
        assert_eq!(after, before, "the other threads keep their priority");
    }

    /// Local checkpoint storage in a temporary directory (kept alive by the first value), and
    /// a temporary directory for a merge's scratch files.
    fn storage_and_scratch() -> (tempfile::TempDir, Storage, tempfile::TempDir) {
        let root = tempfile::tempdir().unwrap();
        let storage = Storage::open(root.path().to_str().unwrap()).unwrap();
        (root, storage, tempfile::tempdir().unwrap())
    }

    fn key(i: u32) -> Vec<u8> {
        let mut e = weir_checkpoint::format::Encoder::with_capacity(16);
        crate::value::Key::One(crate::value::Value::Str(format!("key-{i}").into())).encode(&mut e);
        e.buf
    }

    /// Random chains of a full image and increments (puts, deletions, a key deleted and put
    /// again within one file) are merged into one full image that holds exactly what applying
    /// the chain in order holds, and the scratch files are gone afterwards.
    #[test]
    fn a_merged_chain_holds_what_applying_it_in_order_holds() {
        let (_root, storage, local) = storage_and_scratch();
        for seed in 1..=5u64 {
            let mut drawn = 0u64;
            let mut next = move || {
                drawn += 1;
                crate::value::mix64(seed << 32 | drawn)
            };
            let mut model: BTreeMap<(u32, Vec<u8>), Vec<u8>> = BTreeMap::new();
            let mut chain = Vec::new();
            for f in 0..(2 + next() % 8) {
                let kind = if f == 0 { FileKind::KeyedFull } else { FileKind::KeyedIncrement };
                let mut w = StateFileWriter::new(kind, 1024);
                for _ in 0..(next() % 3000) {
                    let i = (next() % 2000) as u32;
                    let kg = i % 16;
                    if kind == FileKind::KeyedIncrement && next() % 4 == 0 {
                        w.delete(kg, &key(i));
                        model.remove(&(kg, key(i)));
                    } else {
                        let value = format!("v{seed}-{f}-{}", next() % 100).into_bytes();
                        w.put(kg, &key(i), &value);
                        model.insert((kg, key(i)), value);
                    }
                }
                let (data, crc32c) = w.finish();
                let rel = layout::shared_keyed_file("op", 0, seed * 100 + f, 1);
                let len = data.len() as u64;
                crate::io()
                    .block_on(storage.put(&layout::resolve(&layout::checkpoint_dir(seed * 100 + f), &rel), data))
                    .unwrap();
                chain.push(FileRef::new(rel, len, crc32c));
            }
            // With table files for the rocksdb backend (when built with it) and without.
            for with_tables in [false, true] {
                if with_tables && !cfg!(feature = "rocksdb") {
                    continue;
                }
                let request = MergeRequest {
                    uid: "op".into(),
                    subtask: 0,
                    checkpoint_id: seed * 100 + 20,
                    chain: chain.clone(),
                    run: 0..chain.len(),
                    store_tables: with_tables,
                };
                let pending = PendingFiles::default();
                let m = merge(&storage, &pending, 1, local.path(), &request, &|| false).unwrap();
                let bytes = crate::io().block_on(storage.get(&m.file.path)).unwrap();
                m.file.listed().check(&weir_checkpoint::FileDigest::of(&bytes)).unwrap();
                assert_eq!(m.file.crc32c, crc32c::crc32c(&bytes[..bytes.len() - 4]), "sealed by its own checksum");
                assert_eq!(m.file.path, layout::resolve(&layout::checkpoint_dir(seed * 100 + 20), &m.file.rel));
                let files: std::collections::BTreeSet<String> =
                    std::iter::once(&m.file).chain(&m.tables).map(|f| f.path.clone()).collect();
                assert_eq!(pending.snapshot(), files, "seed {seed}: every file written is pending");
                let (kind, body) = format::open(&bytes).unwrap();
                assert_eq!(kind, FileKind::KeyedFull);
                let mut merged = BTreeMap::new();
                // Window order, or with table files the store keys' order.
                let mut last = (0, Vec::new());
                let mut shard_bytes = vec![0u64; crate::state::map::SHARDS];
                let mut entries = format::keyed_entries(body);
                loop {
                    let at = entries.position();
                    let Some(e) = entries.next() else { break };
                    let e = e.unwrap();
                    let order = if with_tables {
                        (0, StateStore::key_of_encoded(e.key_group, e.key))
                    } else {
                        (window_order(heap_hash(e.key).unwrap()), Vec::new())
                    };
                    assert!(order >= last, "seed {seed}: {order:?} after {last:?}");
                    shard_bytes[shard_in_order(order.0)] += (entries.position() - at) as u64;
                    last = order;
                    let value = e.value.expect("a full image has no deletions").to_vec();
                    assert!(merged.insert((e.key_group, e.key.to_vec()), value).is_none(), "seed {seed}: a key twice");
                }
                assert_eq!(m.entries, merged.len() as u64);
                // Without tables, the heap backend's order: the image says where its shards are.
                let listed = m.file.listed();
                assert_eq!(listed.shard_bytes.is_some(), !with_tables, "seed {seed}");
                assert_eq!(listed.in_window_order, !with_tables, "seed {seed}");
                if !with_tables {
                    let starts: Vec<u64> = std::iter::once(0)
                        .chain(shard_bytes.iter().scan(0, |at, len| {
                            *at += len;
                            Some(*at)
                        }))
                        .collect();
                    assert_eq!(listed.shard_starts(), Some(starts), "seed {seed}");
                    assert_eq!(shard_bytes.iter().sum::<u64>(), body.len() as u64, "seed {seed}");
                }
                assert!(merged == model, "seed {seed}: the merged image differs from the chain applied in order");
                assert_eq!(m.tables.is_empty(), !with_tables, "seed {seed}");
                #[cfg(feature = "rocksdb")]
                if with_tables {
                    // The table files hold the same entries: a store that takes them in holds
                    // the model.
                    let parent = tempfile::tempdir().unwrap();
                    let store = StateStore::open(parent.path(), "tables").unwrap();
                    let mut copies = Vec::new();
                    for (i, t) in m.tables.iter().enumerate() {
                        let copy = parent.path().join(format!("t{i}"));
                        let got = crate::io().block_on(storage.get_to_file(&t.path, &copy)).unwrap();
                        assert_eq!((got.len, got.crc32c), (t.len, t.crc32c), "seed {seed}: table {i} as staged");
                        copies.push(copy);
                    }
                    store.take_tables(&copies).unwrap();
                    let mut stored = BTreeMap::new();
                    store
                        .scan(|k, v| {
                            let (kg, key) = StateStore::split_key(k)?;
                            stored.insert((kg, key.to_vec()), v.to_vec());
                            Ok::<_, StoreError>(())
                        })
                        .unwrap();
                    assert!(stored == model, "seed {seed}: the table files differ from the chain applied in order");
                }
                assert_eq!(std::fs::read_dir(local.path()).unwrap().count(), 0, "seed {seed}: scratch files are gone");
            }
        }
    }

    /// Applies the keyed files `files` in order, as a restore does.
    fn applied(files: &[bytes::Bytes]) -> BTreeMap<(u32, Vec<u8>), Vec<u8>> {
        let mut state = BTreeMap::new();
        for bytes in files {
            for e in format::keyed_entries(format::open(bytes).unwrap().1) {
                let e = e.unwrap();
                match e.value {
                    Some(v) => state.insert((e.key_group, e.key.to_vec()), v.to_vec()),
                    None => state.remove(&(e.key_group, e.key.to_vec())),
                };
            }
        }
        state
    }

    /// A run of increments ordered by key group (the rocksdb backend's) merges into one
    /// increment: the chain with it in place of the run holds what the chain holds, and a
    /// range of key groups reads from it alone. A run holding an increment of another kind
    /// (the heap backend's) is merged with the whole chain into an image instead.
    #[test]
    fn a_run_of_increments_merges_into_one_that_applies_as_the_run() {
        let (_root, storage, local) = storage_and_scratch();
        for seed in 1..=4u64 {
            let mut drawn = 0u64;
            let mut next = move || {
                drawn += 1;
                crate::value::mix64(seed << 32 | drawn)
            };
            let (mut chain, mut bytes) = (Vec::new(), Vec::new());
            let files = 4 + next() % 6;
            for f in 0..files {
                let mut w = match f {
                    0 => StateFileWriter::new(FileKind::KeyedFull, 1024),
                    // Seed 4: one increment of the run is not ordered by key group.
                    3 if seed == 4 => StateFileWriter::new(FileKind::KeyedIncrement, 1024),
                    _ => StateFileWriter::increment_by_key_group(1024),
                };
                for _ in 0..(next() % 2000) {
                    let i = (next() % 700) as u32;
                    if f > 0 && next() % 4 == 0 {
                        w.delete(i % 16, &key(i));
                    } else {
                        w.put(i % 16, &key(i), format!("v{seed}-{f}-{}", next() % 100).as_bytes());
                    }
                }
                let (data, crc32c) = w.finish();
                let rel = layout::shared_keyed_file("op", 0, seed * 100 + f, 1);
                let path = layout::resolve(&layout::checkpoint_dir(seed * 100 + f), &rel);
                crate::io().block_on(storage.put(&path, data.clone())).unwrap();
                chain.push(FileRef::new(rel, data.len() as u64, crc32c));
                bytes.push(data);
            }
            // The increments after the image, or a run in the middle.
            let run = if seed % 2 == 0 { 1..chain.len() } else { 2..chain.len() - 1 };
            let id = seed * 100 + 20;
            let request = MergeRequest {
                uid: "op".into(),
                subtask: 0,
                checkpoint_id: id,
                chain: chain.clone(),
                run: run.clone(),
                store_tables: false,
            };
            let pending = PendingFiles::default();
            let m = merge(&storage, &pending, 1, local.path(), &request, &|| false).unwrap();
            assert_eq!(pending.snapshot(), [m.file.path.clone()].into(), "seed {seed}: pending until adopted");
            let merged = crate::io().block_on(storage.get(&m.file.path)).unwrap();
            m.file.listed().check(&weir_checkpoint::FileDigest::of(&merged)).unwrap();
            assert_eq!(m.file.crc32c, crc32c::crc32c(&merged[..merged.len() - 4]), "sealed by its own checksum");
            if seed == 4 {
                assert_eq!(m.replaces, 0..chain.len(), "an image of the whole chain");
                assert_eq!(
                    m.file.path,
                    layout::resolve(&layout::checkpoint_dir(id), &layout::shared_merged_file("op", 0, id, 1))
                );
                assert_eq!(applied(&[merged]), applied(&bytes), "seed {seed}");
            } else {
                assert_eq!(m.replaces, run, "seed {seed}");
                let rel = layout::shared_merged_increment("op", 0, id, 1);
                assert_eq!((m.file.rel.as_str(), m.tables.len()), (rel.as_str(), 0));
                let index = format::read_increment_index(&merged[..], m.file.len).unwrap().unwrap();
                for k in &index.key_groups {
                    index.verify(k.offset, &merged[k.offset as usize..(k.offset + k.len) as usize]).unwrap();
                }
                let mut replaced = bytes.clone();
                replaced.splice(run.clone(), [merged]);
                assert!(applied(&replaced) == applied(&bytes), "seed {seed}: the merged run differs from the run");
            }
            assert_eq!(std::fs::read_dir(local.path()).unwrap().count(), 0, "seed {seed}: scratch files are gone");
        }
    }

    /// A chain file that is not what its checkpoint lists (damaged in storage, or another
    /// intact state file of its length in its place) fails the merge, naming the file; nothing
    /// is staged.
    #[test]
    fn a_damaged_or_other_chain_file_fails_the_merge_and_stages_nothing() {
        let (_root, storage, local) = storage_and_scratch();
        let file = |value: &[u8]| {
            let mut w = StateFileWriter::new(FileKind::KeyedFull, 64);
            w.put(1, b"k", value);
            w.finish()
        };
        let (data, crc32c) = file(b"v");
        let (other, _) = file(b"w");
        let mut damaged = data.to_vec();
        damaged[6] ^= 1;
        let rel = layout::shared_keyed_file("op", 0, 1, 1);
        for (found, why) in [(damaged.into(), "damaged"), (other, "another one")] {
            crate::io().block_on(storage.put(&layout::resolve(&layout::checkpoint_dir(1), &rel), found)).unwrap();
            let request = MergeRequest {
                uid: "op".into(),
                subtask: 0,
                checkpoint_id: 1,
                chain: vec![FileRef::new(rel.clone(), data.len() as u64, crc32c)],
                run: 0..1,
                store_tables: false,
            };
            let pending = PendingFiles::default();
            let err = merge(&storage, &pending, 1, local.path(), &request, &|| false).unwrap_err();
            let MergeError::Mismatch { path, reason } = &err else { panic!("{err}") };
            assert!(path.ends_with("0-1-1.kv") && reason.contains(why), "{err}");
            assert!(staged_files(&storage).is_empty(), "{:?}", staged_files(&storage));
            assert!(pending.snapshot().is_empty());
        }
    }

    /// One full image of `entries` keys under `uid`, uploaded as checkpoint 1's file.
    fn uploaded_chain(storage: &Storage, uid: &str, entries: u32) -> Vec<FileRef> {
        let mut w = StateFileWriter::new(FileKind::KeyedFull, 1024);
        for i in 0..entries {
            w.put(i % 16, &key(i), b"value");
        }
        let (data, crc32c) = w.finish();
        let rel = layout::shared_keyed_file(uid, 0, 1, 1);
        let len = data.len() as u64;
        crate::io().block_on(storage.put(&layout::resolve(&layout::checkpoint_dir(1), &rel), data)).unwrap();
        vec![FileRef::new(rel, len, crc32c)]
    }

    /// The merged images and table files in storage.
    fn staged_files(storage: &Storage) -> Vec<String> {
        let listed = crate::io().block_on(storage.list("checkpoints/shared")).unwrap();
        listed.into_iter().filter(|f| f.contains("-merged")).collect()
    }

    /// A merge asked to stop at any of its checks (each file, each 1 MiB part, each pass, every
    /// 64K merged entries) fails as cancelled, stages nothing and leaves no scratch files; asked
    /// at none, the same merge stages its image.
    #[test]
    fn a_merge_stopped_at_any_step_stages_nothing_and_leaves_no_scratch() {
        let (_root, storage, local) = storage_and_scratch();
        let pending = PendingFiles::default();
        // Two files of more than one part each, and more than 64K entries.
        let mut chain = Vec::new();
        for (f, kind) in [FileKind::KeyedFull, FileKind::KeyedIncrement].into_iter().enumerate() {
            let mut w = StateFileWriter::new(kind, 1 << 21);
            for k in (0..70_000u32).map(|i| i + f as u32 * 35_000) {
                w.put(k % 16, &key(k), b"a value of 24 bytes.....");
            }
            let (data, crc32c) = w.finish();
            assert!(data.len() > PART_BYTES);
            let id = f as u64 + 1;
            let rel = layout::shared_keyed_file("op", 0, id, 1);
            let len = data.len() as u64;
            crate::io().block_on(storage.put(&layout::resolve(&layout::checkpoint_dir(id), &rel), data)).unwrap();
            chain.push(FileRef::new(rel, len, crc32c));
        }
        let request = MergeRequest {
            uid: "op".into(),
            subtask: 0,
            checkpoint_id: 3,
            run: 0..chain.len(),
            chain,
            store_tables: false,
        };
        let mut stop_at = 1;
        loop {
            let asked = std::cell::Cell::new(0);
            let stop = || {
                asked.set(asked.get() + 1);
                asked.get() >= stop_at
            };
            match merge(&storage, &pending, 1, local.path(), &request, &stop) {
                Err(MergeError::Cancelled) => {
                    assert!(staged_files(&storage).is_empty(), "stopped at check {stop_at}");
                    assert!(pending.snapshot().is_empty(), "stopped at check {stop_at}");
                    let left = std::fs::read_dir(local.path()).unwrap().count();
                    assert_eq!(left, 0, "stopped at check {stop_at}: scratch files are gone");
                }
                Ok(Merged { entries, .. }) => {
                    assert_eq!(entries, 105_000);
                    assert_eq!(staged_files(&storage).len(), 1);
                    break;
                }
                Err(e) => panic!("stopped at check {stop_at}: {e}"),
            }
            stop_at += 1;
        }
        // 2 files read twice (a check per file and per part: at least 12), one before the merge,
        // one every 64K merged entries and one before the upload.
        assert!(stop_at > 12, "the merge asked whether to stop only {} times", stop_at - 1);
    }

    /// A merge staged after its uploader last looked for finished merges is nobody's to adopt:
    /// when the uploader goes, the merger deletes it.
    #[test]
    fn a_merge_staged_after_the_uploaders_last_look_is_deleted_when_it_goes() {
        let (_root, storage, local) = storage_and_scratch();
        let pending = PendingFiles::default();
        let mut merger =
            Merger::new("merger-test".into(), storage.clone(), pending.clone(), 1, local.path().to_path_buf());
        let chain = uploaded_chain(&storage, "op", 1_000);
        assert!(merger.request(MergeRequest {
            uid: "op".into(),
            subtask: 0,
            checkpoint_id: 2,
            chain,
            run: 0..1,
            store_tables: false
        }));
        let deadline = Instant::now() + Duration::from_secs(30);
        while staged_files(&storage).is_empty() {
            assert!(Instant::now() < deadline, "the merge was never staged");
            std::thread::sleep(Duration::from_millis(5));
        }
        let started: u32 = merger.cancel().into_iter().map(|t| t.join().unwrap()).sum();
        assert_eq!(started, 1);
        assert!(staged_files(&storage).is_empty(), "{:?}", staged_files(&storage));
        assert!(pending.snapshot().is_empty(), "nothing left to protect");
    }

    /// Merges queued behind a cancellation never start: the thread ends without merging, and
    /// nothing is staged.
    #[test]
    fn a_cancelled_merger_starts_none_of_its_queued_merges() {
        let (_root, storage, local) = storage_and_scratch();
        let mut merger =
            Merger::new("merger-test".into(), storage.clone(), PendingFiles::default(), 1, local.path().to_path_buf());
        merger.cancelled.store(true, Ordering::Release);
        for uid in ["a", "b", "c"] {
            let chain = uploaded_chain(&storage, uid, 1_000);
            // The first starts the thread; the thread may be gone before the later ones are sent.
            let request =
                MergeRequest { uid: uid.into(), subtask: 0, checkpoint_id: 2, chain, run: 0..1, store_tables: false };
            merger.request(request);
        }
        let threads = merger.cancel();
        assert!(!threads.is_empty(), "the first request started a thread");
        let started: u32 = threads.into_iter().map(|t| t.join().unwrap()).sum();
        assert_eq!(started, 0, "no queued merge starts after the merger is cancelled");
        assert!(staged_files(&storage).is_empty());
    }
}
