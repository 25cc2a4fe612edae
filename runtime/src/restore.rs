//! Loading a checkpoint or savepoint for a restore: every referenced file is verified (length
//! and CRC-32C), so that a corrupt snapshot is rejected as a whole and recovery can fall back to
//! an older one. Files held in memory or copied for the rocksdb backend are verified before any
//! task starts; the local copies of a heap restore larger than its budget of files in memory
//! (links to a local checkpoint's files, or files read from object storage as they are
//! applied: [`streamed`]) are verified as the tasks read them, a mismatch recorded as the
//! file's damage.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use weir_checkpoint::recovery::{self, Restorable, Verdict};
use weir_checkpoint::{FileDigest, FileRef, SnapshotKind, Storage, StorageError, SubtaskSnapshot};

use crate::malloc::PrefaultedTables;
use crate::state::map;

pub mod streamed;

/// Why a snapshot could not be restored.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// Storage failed.
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// The directory holds no usable snapshot.
    #[error("{path} cannot be restored: {reason}")]
    Invalid {
        /// What was asked for.
        path: String,
        /// Why not.
        reason: String,
    },
    /// A state file does not match its metadata.
    #[error("state file {path} is corrupt: {reason}")]
    CorruptFile {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// Restore points exist but none can be restored.
    #[error(
        "no valid checkpoint or savepoint under {root}, refusing to start without the job's state:\n  {}",
        defects.join("\n  ")
    )]
    NoValidRestorePoint {
        /// The job's storage root.
        root: String,
        /// Each restore point and its defect.
        defects: Vec<String>,
    },
    /// A state file could not be copied to local disk.
    #[error("copying a state file into {dir}: {source}")]
    LocalCopy {
        /// The local directory.
        dir: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The snapshot does not fit the job.
    #[error("snapshot {path} does not fit this job: {reason}")]
    Incompatible {
        /// The snapshot.
        path: String,
        /// Why.
        reason: String,
    },
}

/// Where a restore keeps the keyed state files it reads.
#[derive(Clone, Debug, Default)]
pub enum KeyedFilesIn {
    /// In memory (the heap backend, whose state is in memory anyway).
    #[default]
    Memory,
    /// In local files under this directory, read back in parts (the rocksdb backend, whose
    /// state may be larger than memory).
    LocalDir(PathBuf),
    /// In memory while a restore's keyed state files take at most `bytes` in all, else read
    /// in parts as [`Self::LocalReadOnce`] (the heap backend). Files in memory are applied on
    /// every core, but stay there until the state they fill is built: a restore whose files
    /// are about as large as its state (long values) needed twice its memory.
    MemoryUpTo {
        /// Most bytes of keyed state files held in memory.
        bytes: u64,
        /// Where larger restores keep them.
        dir: PathBuf,
        /// The parallelism of each keyed operator (by uid) of the restoring job: with it the
        /// restore knows the size of the hash tables its subtasks will reserve, and faults
        /// their memory in while it reads the files ([`restored_table_bytes`]). Empty: not
        /// before the tables are reserved.
        parallelism: BTreeMap<String, u32>,
    },
    /// (A larger restore of [`Self::MemoryUpTo`]) Read in parts, each file once, and verified
    /// as the restore reads it rather than before: a state that fills memory leaves no page
    /// cache to read its files from twice. On a local filesystem from hard links under this
    /// directory to the snapshot's files ([`LocalCopy::verify_read`]); from object storage
    /// from the storage itself, with no copy ([`streamed`]).
    LocalReadOnce(PathBuf),
}

/// Bytes of keyed state files per key the snapshot counted from which a heap restore from
/// object storage reads its files in ranges as it applies them ([`KeyedFilesIn::LocalReadOnce`])
/// even when they would fit its budget of files in memory. Held in memory, every file is
/// downloaded before the first is applied; in ranges, the downloading and the applying go on
/// at once. That pays where applying is cheap per byte (long values); a chain of short entries
/// in memory is applied shard by shard instead, twice as fast as in ranges. Measured from MinIO
/// on 1 GiB states, seconds per GiB in memory against in ranges (`runtime/BENCHMARKS.md`,
/// session 45): 630 bytes a key 1.86–2.25 against 1.35–2.27 (median 1.96 against 1.61); 320
/// bytes 1.89–1.91 against 1.47–2.15; 170 bytes 1.99–2.05 against 1.84–2.26; 90 bytes
/// 2.32–2.90 against 2.61–2.69; 13 bytes (a count; in parts from local disk) 3.0–3.8 against
/// 6.0–6.5.
pub const STREAMED_FROM_BYTES_PER_KEY: u64 = 512;

impl KeyedFilesIn {
    /// Where a restore of the snapshot `m` keeps its keyed state files: [`Self::MemoryUpTo`]
    /// decided by the bytes of all of them, and for a restore from object storage
    /// (`from_object_storage`) by the bytes per key too ([`STREAMED_FROM_BYTES_PER_KEY`]).
    pub fn for_snapshot(&self, m: &weir_checkpoint::CheckpointMetadata, from_object_storage: bool) -> KeyedFilesIn {
        let KeyedFilesIn::MemoryUpTo { bytes, dir, .. } = self else { return self.clone() };
        let keyed: u64 =
            m.operators.values().flat_map(|op| &op.subtasks).flat_map(|s| &s.keyed_state).map(|f| f.len).sum();
        let long_keys = from_object_storage && long_keys(m, keyed);
        if keyed <= *bytes && !long_keys {
            return KeyedFilesIn::Memory;
        }
        if keyed <= *bytes {
            tracing::info!(
                keyed_bytes = keyed,
                "the restore's keyed state files are read in ranges from object storage as they are applied \
                 (long values: applying goes on while the rest downloads)"
            );
        } else {
            tracing::info!(
                keyed_bytes = keyed,
                in_memory_max = bytes,
                "the restore's keyed state files are read in parts, not held in memory"
            );
        }
        // A heap job opens no state store, which would delete what killed processes left.
        crate::state::store::remove_stores_of_dead_processes(dir);
        KeyedFilesIn::LocalReadOnce(dir.clone())
    }
}

/// The bytes of the hash tables (those a restore faults in, [`map::restored_table_bytes`])
/// the subtasks of a heap job restoring `m` reserve when each keyed operator runs at
/// `parallelism[uid]`: each subtask's share of the keys its key groups held, as
/// [`RestoredState::keyed_for`] counts them, in slots of the size the snapshot recorded. An
/// operator of another parallelism or a subtask that did not count its keys or its slots adds
/// nothing: a restore faults those tables in when it reserves them.
pub fn restored_table_bytes(m: &weir_checkpoint::CheckpointMetadata, parallelism: &BTreeMap<String, u32>) -> u64 {
    let mut bytes = 0;
    for (uid, op) in &m.operators {
        let Some(&restoring) = parallelism.get(uid) else { continue };
        let held: Vec<&SubtaskSnapshot> = op.subtasks.iter().filter(|s| !s.keyed_state.is_empty()).collect();
        let Some(slot) = held.iter().map(|s| s.table_slot_bytes).max().flatten() else { continue };
        for subtask in 0..restoring {
            let taken = crate::value::key_group_range(subtask, m.max_parallelism, restoring);
            let entries: Option<u64> = held
                .iter()
                .filter(|s| s.key_groups.0 < taken.1 && taken.0 < s.key_groups.1)
                .map(|s| Some(share_of_entries(counted_entries(s.keyed_entries, files_of(s))?, s.key_groups, taken)))
                .sum();
            if let Some(entries) = entries {
                bytes += map::restored_table_bytes(entries, u64::from(slot));
            }
        }
    }
    bytes
}

/// The files of a subtask's snapshot: its chain and its table files.
fn files_of(s: &SubtaskSnapshot) -> impl Iterator<Item = &FileRef> {
    s.keyed_state.iter().chain(&s.store_tables)
}

/// A snapshot's count of keys, `keyed_entries`, believed up to the bytes of its `files`: an
/// entry takes more than a byte, so a larger count (a damaged or forged document) would only
/// reserve memory that nothing fills.
fn counted_entries<'f>(keyed_entries: Option<u64>, files: impl Iterator<Item = &'f FileRef>) -> Option<u64> {
    let bytes: u64 = files.map(|f| f.len).sum();
    keyed_entries.map(|entries| entries.min(bytes))
}

/// Whether the keyed state files of `m` (`keyed` bytes in all) hold at least
/// [`STREAMED_FROM_BYTES_PER_KEY`] bytes per key it counted; not when a subtask with files did
/// not count its keys.
fn long_keys(m: &weir_checkpoint::CheckpointMetadata, keyed: u64) -> bool {
    let counted: Option<u64> = m
        .operators
        .values()
        .flat_map(|op| &op.subtasks)
        .filter(|s| !s.keyed_state.is_empty())
        .map(|s| s.keyed_entries)
        .sum();
    counted.is_some_and(|keys| keyed >= keys.saturating_mul(STREAMED_FROM_BYTES_PER_KEY))
}

/// A verified keyed state file of a restore.
#[derive(Clone, Debug)]
pub enum KeyedFile {
    /// Held in memory, its bytes verified against the checkpoint's metadata (see
    /// [`weir_checkpoint::format::open_verified`]).
    Memory {
        /// The file.
        data: Bytes,
        /// An increment of the heap backend: where its puts start among its entries
        /// ([`FileRef::puts_from`]).
        puts_from: Option<u64>,
        /// A file of the heap backend: where each shard's puts start among them, and where the
        /// last one ends ([`FileRef::shard_starts`]).
        shard_starts: Option<Vec<u64>>,
        /// A file of the heap backend whose shards' puts are in window order
        /// ([`FileRef::in_window_order`]).
        in_window_order: bool,
    },
    /// Copied to a local file (shared by the clones of a [`RestoredState`]).
    Local(Arc<LocalCopy>),
    /// (heap backend, a restore over its budget of files in memory, from object storage) Read
    /// from storage by the restore as it applies it, and verified as it is read.
    Streamed(Arc<streamed::StreamedFile>),
    /// (rocksdb backend, restoring lazily) An increment ordered by key group left where the
    /// snapshot keeps it: its length and index were verified, and each range's loader fetches
    /// and verifies its stretch of it ([`crate::state::bulk::StoredIncrement`]).
    Stored(Arc<StoredIncrementFile>),
}

/// An increment ordered by key group in a snapshot's storage, read by stretches.
#[derive(Debug)]
pub struct StoredIncrementFile {
    storage: Storage,
    found: Restorable,
    file: FileRef,
    /// Its index, verified by its own checksum.
    pub index: weir_checkpoint::format::IncrementIndex,
    /// Where a whole copy goes.
    dir: PathBuf,
    /// The whole file copied to local disk and verified, once the restore's background copy
    /// has it ([`copy_stored_in_background`]): stretches are then read from it.
    copied: std::sync::OnceLock<(Arc<LocalCopy>, std::fs::File)>,
}

/// Bytes of a stored increment's start fetched to read its index: enough for the index of
/// thousands of key groups; a longer one is fetched with a second request.
const STORED_HEAD_BYTES: u64 = 16 << 10;

impl StoredIncrementFile {
    /// `f` as a stored increment when it is an increment ordered by key group whose index has
    /// checksums (`None` for other files, which are copied whole). Fetches its start only, and
    /// refuses a file of another length than its metadata's or with a damaged index.
    async fn of(
        storage: &Storage,
        found: &Restorable,
        f: &FileRef,
        dir: &std::path::Path,
    ) -> Result<Option<StoredIncrementFile>, RestoreError> {
        use weir_checkpoint::format::{head_len, read_increment_index, PartsError};
        let path = found.resolve(&f.path);
        let (mut head, len) = match storage.get_head(&path, STORED_HEAD_BYTES.min(f.len.max(1))).await {
            Ok(got) => got,
            Err(StorageError::NotFound(_)) => return Err(corrupt(storage, found, f, "missing")),
            Err(e) => return Err(e.into()),
        };
        if len != f.len {
            return Err(corrupt(storage, found, f, format!("{len} bytes, metadata says {}", f.len)));
        }
        let needed = head_len(&head, len).map_err(|e| corrupt(storage, found, f, e))?;
        if needed > head.len() as u64 {
            head = storage.get_range(&path, 0..needed).await?;
        }
        let index = match read_increment_index(&head[..], len) {
            Ok(Some(index)) if index.checked => index,
            Ok(_) => return Ok(None),
            Err(PartsError::Format(e)) => return Err(corrupt(storage, found, f, e)),
            Err(PartsError::Read(e)) => return Err(corrupt(storage, found, f, e)),
            Err(PartsError::Consume(never)) => match never {},
        };
        Ok(Some(StoredIncrementFile {
            storage: storage.clone(),
            found: found.clone(),
            file: f.clone(),
            index,
            dir: dir.to_path_buf(),
            copied: std::sync::OnceLock::new(),
        }))
    }

    /// The whole file copied to local disk and verified, for a store that does not restore
    /// lazily after all. Blocks.
    pub fn copy_whole(&self) -> Result<Arc<LocalCopy>, String> {
        if let Some((copy, _)) = self.copied.get() {
            return Ok(copy.clone());
        }
        crate::io().block_on(self.copy()).map_err(|e| e.to_string())
    }

    async fn copy(&self) -> Result<Arc<LocalCopy>, RestoreError> {
        copy_verified_retrying(&self.storage, &self.found, &self.file, &self.dir).await
    }
}

/// Copies a restore's stored increments whole to local disk behind the job, a few at a time and
/// in chain order, verified like any copy: stretches fetched before an increment's copy is
/// there are read from storage, later ones from the copy. So a restore needs one request per
/// increment and per range it loads early, not one per increment and per range; and the first
/// ranges do not wait for the copies.
fn copy_stored_in_background(files: Vec<Arc<StoredIncrementFile>>) {
    if files.is_empty() {
        return;
    }
    crate::io().spawn(async move {
        futures::stream::iter(files.into_iter().map(|f| async move {
            let copied = f.copy().await.and_then(|copy| {
                let file = std::fs::File::open(&copy.path)
                    .map_err(|e| RestoreError::LocalCopy { dir: f.dir.display().to_string(), source: e })?;
                Ok((copy, file))
            });
            match copied {
                Ok(copied) => {
                    let _ = f.copied.set(copied);
                }
                // Its stretches are fetched from storage and verified one by one instead.
                Err(e) => tracing::warn!(
                    file = %crate::state::bulk::StoredIncrement::describe(&*f),
                    error = %e,
                    "a stored increment was not copied whole"
                ),
            }
        }))
        .buffered(FILES_IN_FLIGHT)
        .collect::<()>()
        .await
    });
}

impl crate::state::bulk::StoredIncrement for StoredIncrementFile {
    fn fetch(&self, offset: u64, len: u64) -> futures::future::BoxFuture<'_, Result<Bytes, String>> {
        Box::pin(async move {
            if let Some((copy, file)) = self.copied.get() {
                use std::os::unix::fs::FileExt;
                let mut bytes = vec![0; len as usize];
                return match file.read_exact_at(&mut bytes, offset) {
                    Ok(()) => Ok(Bytes::from(bytes)),
                    Err(e) => Err(format!("reading the local copy {}: {e}", copy.path.display())),
                };
            }
            let path = self.found.resolve(&self.file.path);
            let what = self.storage.url_of(&path);
            let got =
                retrying(&what, || async { Ok(self.storage.get_range(&path, offset..offset + len).await?) }).await;
            match got {
                Ok(bytes) if bytes.len() as u64 == len => Ok(bytes),
                Ok(bytes) => {
                    let why = format!("bytes {offset}..{}: {} came", offset + len, bytes.len());
                    self.damaged(&why).await;
                    Err(format!("{what}: {why}"))
                }
                Err(RestoreError::Storage(StorageError::NotFound(_))) => {
                    self.damaged("missing").await;
                    Err(format!("{what}: missing"))
                }
                Err(e) => Err(e.to_string()),
            }
        })
    }

    fn damaged<'a>(&'a self, why: &'a str) -> futures::future::BoxFuture<'a, ()> {
        Box::pin(async move { record_damage(&self.storage, &self.found.resolve(&self.file.path), why).await })
    }

    fn describe(&self) -> String {
        self.storage.url_of(&self.found.resolve(&self.file.path))
    }
}

/// Records that the state file `path` (from the storage root) is damaged and why
/// ([`weir_checkpoint::layout::DAMAGED`]), found after its restore started: no later restore
/// picks a snapshot that needs it. A record that cannot be written is logged.
async fn record_damage(storage: &Storage, path: &str, why: &str) {
    let record = weir_checkpoint::layout::damage_record(path);
    tracing::error!(
        file = %storage.url_of(path),
        %why,
        "a state file of the restore is damaged; no later restore will pick a snapshot that needs it"
    );
    let put = retrying(&record, || async { Ok(storage.put(&record, Bytes::from(why.to_string())).await?) });
    if let Err(e) = put.await {
        tracing::error!(record = %storage.url_of(&record), error = %e, "recording the damage failed");
    }
}

/// A local copy of a state file, deleted when the last reference goes. A killed process's
/// copies are deleted by the next process that opens a state store in the same directory.
#[derive(Debug)]
pub struct LocalCopy {
    /// The file.
    pub path: PathBuf,
    /// Its length.
    pub len: u64,
    /// A file of the heap backend: where its puts start among its entries
    /// ([`FileRef::puts_from`]), so that its parts are applied on every core.
    pub puts_from: Option<u64>,
    /// A link to a snapshot's file that was not read yet: verified as it is read.
    pub unverified: Option<Box<SnapshotFile>>,
}

/// A snapshot's state file that a restore reads unverified (a [`LocalCopy`] linked unread, a
/// [`streamed::StreamedFile`]): what to verify it against once read, and where to record its
/// damage ([`weir_checkpoint::layout::DAMAGED`]).
#[derive(Clone, Debug)]
pub struct SnapshotFile {
    storage: Storage,
    /// The file's path from the storage root.
    path: String,
    file: FileRef,
}

impl SnapshotFile {
    /// Its URL, for messages.
    pub fn url(&self) -> String {
        self.storage.url_of(&self.path)
    }

    /// After the whole file was read, what was read (`digest`) against the snapshot's
    /// reference: a mismatch is recorded as the file's damage, so that no later restore picks
    /// a snapshot that needs it, and returned.
    pub fn verify(&self, digest: &weir_checkpoint::FileDigest) -> Result<(), String> {
        let Err(why) = self.file.check(digest) else { return Ok(()) };
        crate::io().block_on(record_damage(&self.storage, &self.path, &why));
        Err(format!("{}: {why}", self.url()))
    }
}

impl LocalCopy {
    /// Whether the copy is a link that must be verified as it is read.
    pub fn unverified(&self) -> bool {
        self.unverified.is_some()
    }

    /// After the whole of an unverified copy was read, what was read (`digest`) against the
    /// snapshot's reference: a mismatch is recorded as the file's damage, so that no later
    /// restore picks a snapshot that needs it, and returned. A verified copy passes.
    pub fn verify_read(&self, digest: &weir_checkpoint::FileDigest) -> Result<(), String> {
        match &self.unverified {
            Some(link) => link.verify(digest),
            None => Ok(()),
        }
    }

    /// [`Self::verify_read`] of the whole file read again: for a read that stopped early.
    pub fn verify_whole(&self) -> Result<(), String> {
        if self.unverified.is_none() {
            return Ok(());
        }
        let digest = weir_checkpoint::local::file_digest(&self.path)
            .map_err(|e| format!("reading the local copy {}: {e}", self.path.display()))?;
        self.verify_read(&digest)
    }
}

/// Reads through to `inner`, computing the digest of every byte read when asked to.
pub struct DigestingReader<R> {
    inner: R,
    /// Of the bytes read so far; `None` when not computed.
    pub digest: Option<weir_checkpoint::FileDigest>,
}

impl<R> DigestingReader<R> {
    /// Nothing read yet; the digest computed only `when` (a verified copy needs none).
    pub fn new(inner: R, when: bool) -> Self {
        DigestingReader { inner, digest: when.then(weir_checkpoint::FileDigest::default) }
    }
}

impl<R: std::io::Read> std::io::Read for DigestingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        if let Some(digest) = &mut self.digest {
            digest.update(&buf[..n]);
        }
        Ok(n)
    }
}

impl Drop for LocalCopy {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

static NEXT_LOCAL_COPY: AtomicU64 = AtomicU64::new(0);

#[cfg(test)]
impl KeyedFile {
    /// `data` written to a local copy under `dir`, as a restore on the rocksdb backend has it.
    pub(crate) fn local_for_test(dir: &std::path::Path, data: &[u8]) -> KeyedFile {
        std::fs::create_dir_all(dir).unwrap();
        let n = NEXT_LOCAL_COPY.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("restore-{}-{n}", std::process::id()));
        std::fs::write(&path, data).unwrap();
        KeyedFile::Local(Arc::new(LocalCopy { path, len: data.len() as u64, puts_from: None, unverified: None }))
    }
}

/// Keyed state handed to one operator subtask.
#[derive(Clone, Debug, Default)]
pub struct KeyedRestore {
    /// Verified state files to apply in order (each filtered to the subtask's key groups).
    pub files: Vec<KeyedFile>,
    /// The restored incremental chain continues (same key groups, from a checkpoint).
    pub continue_chain: bool,
    /// The chain's file references, when it continues or is [`adoptable`](Self::adoptable)
    /// (relative to the directory of the `_metadata` that listed them).
    pub chain: Vec<FileRef>,
    /// The references of the table files of the chain's first file, when it continues and has
    /// them (the uploader lists them again while the chain begins with that file).
    pub chain_tables: Vec<FileRef>,
    /// (rocksdb backend) Full images restored from their table files instead of their entries:
    /// per restored subtask that had them, its key groups and the verified table files. Each
    /// stands for the first file of that subtask's chain, which `files` then leaves out.
    pub tables: Vec<((u32, u32), Vec<KeyedFile>)>,
    /// (rocksdb backend) The same, for table files not fetched yet: the store fetches them
    /// behind the job ([`crate::state::lazy`]).
    pub lazy_tables: Vec<((u32, u32), Arc<LazyTables>)>,
    /// The operator documents of the snapshot's subtasks whose key groups overlap this
    /// subtask's, with those key groups (keyed operators with per-key-group operator state,
    /// such as a window's watermark, take each key group's value from its previous owner).
    pub operator_docs: Vec<((u32, u32), Vec<u8>)>,
    /// How many keys the restored chains hold in this subtask's key groups: each restored
    /// subtask's count, in the share of its key groups that this subtask takes (keys spread
    /// evenly over key groups). `None` when a chain's count is unknown.
    pub entries: Option<u64>,
    /// A chain the job may go on from although it lies outside the job's root (another job's
    /// checkpoint, a savepoint): same key groups, written by the heap backend, without table
    /// files. [`KeyedRestore::adopt_chain`] takes it.
    pub adoptable: Option<ChainSource>,
    /// Every key of every restored chain is one integer (each snapshot says so, or there is
    /// none): the operator may hold them as [`crate::value::IntKey`]s.
    pub int_keys: bool,
    /// (heap backend) Memory faulted in for the restore's hash tables while it read the files
    /// ([`RestoredState::faulted_tables`]).
    pub faulted_tables: Option<Arc<PrefaultedTables>>,
}

/// Where a restored chain's files are: the storage root and the directory of the `_metadata`
/// that lists them (their references are relative to it).
#[derive(Clone, Debug)]
pub struct ChainSource {
    /// The root the snapshot was found in.
    pub storage: Storage,
    /// The snapshot's directory under that root.
    pub dir: String,
}

impl ChainSource {
    /// The path under [`Self::storage`] of a file the chain lists.
    pub fn resolve(&self, relative: &str) -> String {
        weir_checkpoint::layout::resolve(&self.dir, relative)
    }
}

impl KeyedRestore {
    /// Continues an [`adoptable`](Self::adoptable) chain instead of starting a new one with a
    /// full image: the first checkpoint copies its files into the job's root
    /// ([`crate::upload::RestoredChain::copy_from`]) and lists them with its increment, so the
    /// task does not stop to encode the whole state again (11.5–12.6 s at 10 GiB of heap state,
    /// `runtime/BENCHMARKS.md`). Returns where the files are to be copied from; `None` (nothing
    /// changed) when the chain is not adoptable.
    pub fn adopt_chain(&mut self) -> Option<ChainSource> {
        let source = self.adoptable.take()?;
        self.continue_chain = true;
        Some(source)
    }

    /// How many files the restored chains have, those that table files stand for included.
    pub fn chain_len(&self) -> usize {
        self.files.len() + self.tables.len() + self.lazy_tables.len()
    }
}

/// One restored subtask's table files, fetched when its store asks for them: a restore onto
/// the rocksdb backend that does not wait for its state (see [`crate::state::lazy`]). Each
/// table is copied to local disk and verified (length and CRC-32C) when fetched; a table that
/// fails is replaced by the entries of the full image it stands for, which is fetched then.
#[derive(Debug)]
pub struct LazyTables {
    storage: Storage,
    found: Restorable,
    tables: Vec<FileRef>,
    first_keys: Vec<Vec<u8>>,
    /// The full image the tables stand for (the chain's first file).
    image: FileRef,
    /// Where local copies go.
    dir: PathBuf,
    /// The image's local copy, once a table needed it.
    image_copy: std::sync::Mutex<Option<Arc<LocalCopy>>>,
    /// Raised when a table could not be taken in ([`Self::fell_back_flag`]).
    fell_back: Arc<std::sync::atomic::AtomicBool>,
}

impl LazyTables {
    /// The tables of a subtask's snapshot, if they can be restored lazily: each has a valid
    /// first key and the keys increase (checkpoints written before first keys were recorded
    /// restore by fetching every table first).
    fn of(
        storage: &Storage,
        found: &Restorable,
        s: &weir_checkpoint::SubtaskSnapshot,
        dir: &std::path::Path,
    ) -> Option<LazyTables> {
        let image = s.keyed_state.first()?.clone();
        let first_keys: Vec<Vec<u8>> = s.store_tables.iter().map(FileRef::first_key_bytes).collect::<Option<_>>()?;
        if !crate::state::lazy::Ranges::increasing(&first_keys) {
            return None;
        }
        Some(LazyTables {
            storage: storage.clone(),
            found: found.clone(),
            tables: s.store_tables.clone(),
            first_keys,
            image,
            dir: dir.to_path_buf(),
            image_copy: std::sync::Mutex::new(None),
            fell_back: Arc::default(),
        })
    }

    /// Raised once a table of these could not be taken in and its range came from the image:
    /// the uploader of a continued chain then stops listing the tables
    /// ([`crate::upload::RestoredChain::tables_fell_back`]).
    pub fn fell_back_flag(&self) -> Arc<std::sync::atomic::AtomicBool> {
        self.fell_back.clone()
    }

    /// A file copied to local disk and verified, storage errors retried.
    fn copy(&self, f: &FileRef) -> Result<Arc<LocalCopy>, String> {
        crate::io()
            .block_on(copy_verified_retrying(&self.storage, &self.found, f, &self.dir))
            .map_err(|e| e.to_string())
    }
}

impl crate::state::lazy::TableSource for LazyTables {
    fn first_keys(&self) -> &[Vec<u8>] {
        &self.first_keys
    }

    fn fetch(&self, i: usize) -> Result<crate::state::lazy::Fetched, String> {
        let copy = self.copy(&self.tables[i])?;
        Ok(crate::state::lazy::Fetched { path: copy.path.clone(), keep: Box::new(copy) })
    }

    fn image_entries(
        &self,
        start: &[u8],
        end: Option<&[u8]>,
        emit: &mut crate::state::lazy::EmitEntry<'_>,
    ) -> Result<(), String> {
        let copy = {
            let mut held = self.image_copy.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            match &*held {
                Some(copy) => copy.clone(),
                None => held.insert(self.copy(&self.image)?).clone(),
            }
        };
        let read = std::fs::File::open(&copy.path).map_err(|e| format!("opening {}: {e}", copy.path.display()))?;
        let mut store_key = Vec::with_capacity(32);
        weir_checkpoint::format::read_keyed_parts(read, copy.len, LOCAL_COPY_PART_BYTES, |body| {
            for entry in weir_checkpoint::format::keyed_entries(body) {
                let entry = entry?;
                store_key.clear();
                crate::state::StateStore::encoded_key(entry.key_group, entry.key, &mut store_key);
                let in_range = store_key.as_slice() >= start && end.is_none_or(|end| store_key.as_slice() < end);
                if let (true, Some(value)) = (in_range, entry.value) {
                    emit(&store_key, value)?;
                }
            }
            Ok(())
        })
        .map(|_| ())
        .map_err(|e: weir_checkpoint::format::PartsError<crate::state::StoreError>| match e {
            weir_checkpoint::format::PartsError::Read(e) => format!("reading the full image: {e}"),
            weir_checkpoint::format::PartsError::Format(e) => format!("the full image: {e}"),
            weir_checkpoint::format::PartsError::Consume(e) => e.to_string(),
        })
    }

    fn describe(&self) -> String {
        format!("{} table files of {}", self.tables.len(), self.storage.url_of(&self.found.dir))
    }

    fn fell_back(&self, _: usize) {
        self.fell_back.store(true, Ordering::Release);
    }
}

/// How much of a state file's local copy a restore reads at once (so that a state larger than
/// memory restores within it).
pub const LOCAL_COPY_PART_BYTES: usize = 8 << 20;

/// One restored subtask's state.
#[derive(Clone, Debug, Default)]
pub struct RestoredSubtask {
    /// Key groups it owned.
    pub key_groups: (u32, u32),
    /// Its operator-state document.
    pub operator_doc: Option<Vec<u8>>,
    /// Its keyed-state chain, verified; without its first file when `store_tables` stand for
    /// it.
    pub keyed_files: Vec<KeyedFile>,
    /// References of that chain (all of it).
    pub keyed_refs: Vec<FileRef>,
    /// The chain's first file as table files, verified (only for the rocksdb backend).
    pub store_tables: Vec<KeyedFile>,
    /// The same, not fetched yet: the store fetches them behind the job.
    pub lazy_tables: Option<Arc<LazyTables>>,
    /// References of the chain's table files (whether they were read or not).
    pub table_refs: Vec<FileRef>,
    /// How many keys the chain holds, when the snapshot counted them.
    pub keyed_entries: Option<u64>,
    /// Every key of the chain is one integer ([`weir_checkpoint::SubtaskSnapshot::int_keys`]).
    pub int_keys: bool,
}

impl RestoredSubtask {
    /// The keys its snapshot counted, at most one per byte of its chain's files: an entry
    /// takes more than a byte, so a larger count (a damaged or forged document) would only
    /// reserve memory that nothing fills.
    fn counted_entries(&self) -> Option<u64> {
        counted_entries(self.keyed_entries, self.keyed_refs.iter().chain(&self.table_refs))
    }
}

/// One restored operator.
#[derive(Clone, Debug, Default)]
pub struct RestoredOperator {
    /// Parallelism at snapshot time.
    pub parallelism: u32,
    /// By subtask index.
    pub subtasks: Vec<RestoredSubtask>,
    /// What its state holds, when the snapshot says
    /// ([`weir_checkpoint::OperatorSnapshot::state_layout`]).
    pub state_layout: Option<String>,
}

/// A loaded, verified snapshot.
#[derive(Clone, Debug)]
pub struct RestoredState {
    /// Its checkpoint id.
    pub checkpoint_id: u64,
    /// Checkpoint or savepoint.
    pub kind: SnapshotKind,
    /// Where it came from (for status and logs).
    pub path: String,
    /// Key groups of the job that wrote it.
    pub max_parallelism: u32,
    /// Epoch of the run that wrote it (0: before epochs existed).
    pub epoch: u64,
    /// Total bytes read.
    pub bytes: u64,
    /// State by uid.
    pub operators: BTreeMap<String, RestoredOperator>,
    /// Whether it lies in the storage root the job checkpoints to. Only then may the job's
    /// incremental checkpoints go on from its chain, referencing its files: a checkpoint of
    /// another root (another job's, or an older root of this one) is not the job's to keep,
    /// and its files' references would not resolve in the job's root. Restored from another
    /// root, each keyed state's first checkpoint is a full image (Flink's `NO_CLAIM` restore
    /// mode), unless its chains are adopted: copied into the job's root by its first
    /// checkpoint ([`KeyedRestore::adopt_chain`]). [`RestoredState::load`] assumes the job's
    /// root; whoever opened another sets it.
    pub in_job_root: bool,
    /// Where its files are (`None` only for snapshots built by hand in tests).
    pub source: Option<ChainSource>,
    /// (heap backend, [`KeyedFilesIn::MemoryUpTo`] with the job's parallelism, from object
    /// storage) Memory for the hash tables its subtasks reserve ([`restored_table_bytes`]),
    /// faulted in on other threads from the moment the metadata was read, while the files
    /// were downloading: the subtasks carve their tables from it
    /// ([`crate::malloc::PrefaultedTables`]). Dropped with the restored state, what no table
    /// took is unmapped.
    pub faulted_tables: Option<Arc<PrefaultedTables>>,
}

impl RestoredState {
    /// Reads and verifies every file of a snapshot found in `storage`, keeping the keyed state
    /// files where `keyed_in` says.
    pub async fn load(
        storage: &Storage,
        found: &Restorable,
        keyed_in: &KeyedFilesIn,
    ) -> Result<RestoredState, RestoreError> {
        let m = &found.metadata;
        // From object storage only: reading local files keeps both cores busy here, and
        // faulting the tables in beside it slowed the restore (`runtime/BENCHMARKS.md`,
        // session 48).
        let faulted_tables = match keyed_in {
            KeyedFilesIn::MemoryUpTo { parallelism, .. } if !storage.is_local_filesystem() => {
                let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
                // A damaged document's slot size must not fault in more than the process may
                // use: at most half of it (the tables' reserves fault in the rest themselves).
                let most = crate::memory_limit::process_memory_limit().map_or(u64::MAX, |limit| limit / 2);
                PrefaultedTables::start(restored_table_bytes(m, parallelism).min(most), cores).map(Arc::new)
            }
            _ => None,
        };
        let keyed_in = &keyed_in.for_snapshot(m, !storage.is_local_filesystem());
        let damaged = damaged_files(storage).await?;
        let mut operators = BTreeMap::new();
        let mut stored = Vec::new();
        let mut bytes = 0;
        for (uid, op) in &m.operators {
            let mut subtasks = Vec::new();
            for s in &op.subtasks {
                if let Some(f) = s.keyed_state.iter().find(|f| damaged.contains(&found.resolve(&f.path))) {
                    let damage = recovery::recorded_damage(storage, &found.resolve(&f.path)).await;
                    return Err(corrupt(storage, found, f, damage));
                }
                let mut sub = RestoredSubtask {
                    key_groups: s.key_groups,
                    keyed_refs: s.keyed_state.clone(),
                    table_refs: s.store_tables.clone(),
                    keyed_entries: s.keyed_entries,
                    int_keys: s.int_keys,
                    ..Default::default()
                };
                if let Some(f) = &s.operator_state {
                    let data = read_verified(storage, found, f).await?;
                    bytes += data.len() as u64;
                    let (_, body) =
                        weir_checkpoint::format::open_verified(&data).map_err(|e| corrupt(storage, found, f, e))?;
                    let doc =
                        weir_checkpoint::format::operator_document(body).map_err(|e| corrupt(storage, found, f, e))?;
                    sub.operator_doc = Some(doc.to_vec());
                }
                let mut image_from_tables = false;
                if let (KeyedFilesIn::LocalDir(dir), false) = (keyed_in, s.store_tables.is_empty()) {
                    if let Some(lazy) = LazyTables::of(storage, found, s, dir) {
                        // Not read here: table files are not required (the image stands for
                        // them), and each is verified when fetched.
                        sub.lazy_tables = Some(Arc::new(lazy));
                        image_from_tables = true;
                    } else {
                        match copy_tables_verified(storage, found, &s.store_tables, dir).await {
                            Ok(tables) => {
                                bytes += s.store_tables.iter().map(|f| f.len).sum::<u64>();
                                sub.store_tables = tables;
                                image_from_tables = true;
                            }
                            // The image they stand for is still there: restore from it, and a
                            // continued chain stops listing the damaged tables.
                            Err(RestoreError::CorruptFile { path, reason }) => {
                                tracing::warn!(
                                    %path,
                                    %reason,
                                    "a checkpoint's table file is damaged; its full image is restored instead"
                                );
                                sub.table_refs.clear();
                            }
                            Err(e) => return Err(e),
                        }
                    }
                }
                let chain = &s.keyed_state[usize::from(image_from_tables).min(s.keyed_state.len())..];
                // A lazy restore leaves increments that can be read by stretches where they are.
                let stored_in = match (keyed_in, &sub.lazy_tables) {
                    (KeyedFilesIn::LocalDir(dir), Some(_)) => Some(dir),
                    _ => None,
                };
                let loaded: Vec<(KeyedFile, u64)> = futures::stream::iter(
                    chain.iter().map(|f| load_keyed_file(storage, found, keyed_in, stored_in, f)),
                )
                .buffered(FILES_IN_FLIGHT)
                .try_collect()
                .await?;
                bytes += loaded.iter().map(|(_, read)| read).sum::<u64>();
                sub.keyed_files = loaded.into_iter().map(|(file, _)| file).collect();
                stored.extend(sub.keyed_files.iter().filter_map(|f| match f {
                    KeyedFile::Stored(stored) => Some(stored.clone()),
                    _ => None,
                }));
                subtasks.push(sub);
            }
            subtasks.sort_by_key(|s| s.key_groups.0);
            operators.insert(
                uid.clone(),
                RestoredOperator { parallelism: op.parallelism, subtasks, state_layout: op.state_layout.clone() },
            );
        }
        // Only once the whole snapshot loaded: a restore point passed over copies nothing.
        copy_stored_in_background(stored);
        Ok(RestoredState {
            checkpoint_id: m.checkpoint_id,
            kind: m.kind,
            path: storage.url_of(&found.dir),
            max_parallelism: m.max_parallelism,
            epoch: m.epoch,
            bytes,
            operators,
            in_job_root: true,
            source: Some(ChainSource { storage: storage.clone(), dir: found.dir.clone() }),
            faulted_tables,
        })
    }

    /// Every subtask's operator document of `uid` (sources and sinks redistribute the union).
    pub fn operator_docs(&self, uid: &str) -> Vec<&[u8]> {
        self.operators
            .get(uid)
            .map(|op| op.subtasks.iter().filter_map(|s| s.operator_doc.as_deref()).collect())
            .unwrap_or_default()
    }

    /// The keyed state for a subtask owning `key_groups` at `parallelism`.
    pub fn keyed_for(&self, uid: &str, key_groups: (u32, u32), parallelism: u32) -> Option<KeyedRestore> {
        let op = self.operators.get(uid)?;
        let overlaps = |s: &&RestoredSubtask| s.key_groups.0 < key_groups.1 && key_groups.0 < s.key_groups.1;
        let operator_docs =
            op.subtasks.iter().filter(overlaps).filter_map(|s| Some((s.key_groups, s.operator_doc.clone()?))).collect();
        let overlapping: Vec<&RestoredSubtask> = op
            .subtasks
            .iter()
            .filter(overlaps)
            .filter(|s| !s.keyed_files.is_empty() || !s.store_tables.is_empty() || s.lazy_tables.is_some())
            .collect();
        let same = op.parallelism == parallelism && overlapping.len() == 1 && overlapping[0].key_groups == key_groups;
        let continue_chain = same && self.kind == SnapshotKind::Checkpoint && self.in_job_root;
        // Files of the heap backend say where their puts start; the rocksdb backend's do not,
        // and its chains may have table files (not copied: its full images are written off
        // the task thread anyway).
        let adoptable = same
            && !continue_chain
            && overlapping[0].table_refs.is_empty()
            && overlapping[0].lazy_tables.is_none()
            && overlapping[0].keyed_refs.iter().all(|f| f.puts_from.is_some());
        let listed = continue_chain || adoptable;
        let adoptable = self.source.clone().filter(|_| adoptable);
        Some(KeyedRestore {
            files: overlapping.iter().flat_map(|s| s.keyed_files.iter().cloned()).collect(),
            continue_chain,
            adoptable,
            chain: if listed { overlapping[0].keyed_refs.clone() } else { Vec::new() },
            chain_tables: if continue_chain { overlapping[0].table_refs.clone() } else { Vec::new() },
            tables: overlapping
                .iter()
                .filter(|s| !s.store_tables.is_empty())
                .map(|s| (s.key_groups, s.store_tables.clone()))
                .collect(),
            lazy_tables: overlapping.iter().filter_map(|s| Some((s.key_groups, s.lazy_tables.clone()?))).collect(),
            operator_docs,
            entries: overlapping
                .iter()
                .map(|s| Some(share_of_entries(s.counted_entries()?, s.key_groups, key_groups)))
                .sum(),
            int_keys: overlapping.iter().all(|s| s.int_keys),
            faulted_tables: self.faulted_tables.clone(),
        })
    }
}

/// The part of `entries`, held in key groups `held`, that falls in key groups `taken`: keys
/// spread evenly over key groups (a key's group is its hash's).
fn share_of_entries(entries: u64, held: (u32, u32), taken: (u32, u32)) -> u64 {
    let overlap = held.1.min(taken.1).saturating_sub(held.0.max(taken.0));
    let held_groups = held.1.saturating_sub(held.0).max(1);
    (u128::from(entries) * u128::from(overlap)).div_ceil(u128::from(held_groups)) as u64
}

fn corrupt(storage: &Storage, found: &Restorable, f: &FileRef, e: impl std::fmt::Display) -> RestoreError {
    RestoreError::CorruptFile { path: storage.url_of(&found.resolve(&f.path)), reason: e.to_string() }
}

async fn read_verified(storage: &Storage, found: &Restorable, f: &FileRef) -> Result<Bytes, RestoreError> {
    let path = found.resolve(&f.path);
    let (data, crc) = match storage.get_with_crc32c(&path, f.len).await {
        Ok(read) => read,
        Err(StorageError::NotFound(_)) => {
            return Err(RestoreError::CorruptFile { path: storage.url_of(&path), reason: "missing".into() })
        }
        Err(e) => return Err(e.into()),
    };
    f.check(&FileDigest::from_parts(data.len() as u64, crc, &data))
        .map_err(|reason| RestoreError::CorruptFile { path: storage.url_of(&path), reason })?;
    Ok(data)
}

/// The state files (paths from the storage root) that restores found damaged after they had
/// started ([`weir_checkpoint::layout::DAMAGED`]).
async fn damaged_files(storage: &Storage) -> Result<std::collections::BTreeSet<String>, RestoreError> {
    retrying("listing damage records", || async { Ok(recovery::damaged_files(storage).await?) }).await
}

/// Files a restore fetches at once. One download at a time left the link idle between a
/// file's last byte and the next one's first, and a server (or a disk) that answers several
/// requests at once waiting: from the S3 server of the tests, a rocksdb checkpoint of 284 MB
/// (merged image's tables and increments) took 5.21–5.24 s one by one, 1.24–1.36 s eight at a
/// time.
const FILES_IN_FLIGHT: usize = 8;

/// A keyed state file where `keyed_in` keeps it, verified like [`read_verified`], and the bytes
/// read. With `stored_in` (a lazy restore's local directory), an increment that can be read by
/// stretches stays where it is ([`KeyedFile::Stored`]): only its start is read.
async fn load_keyed_file(
    storage: &Storage,
    found: &Restorable,
    keyed_in: &KeyedFilesIn,
    stored_in: Option<&PathBuf>,
    f: &FileRef,
) -> Result<(KeyedFile, u64), RestoreError> {
    if let Some(dir) = stored_in {
        if let Some(stored) = StoredIncrementFile::of(storage, found, f, dir).await? {
            return Ok((KeyedFile::Stored(Arc::new(stored)), 0));
        }
    }
    Ok(match keyed_in {
        // `MemoryUpTo` was decided for the whole snapshot before ([`KeyedFilesIn::for_snapshot`]).
        KeyedFilesIn::Memory | KeyedFilesIn::MemoryUpTo { .. } => {
            let data = read_verified(storage, found, f).await?;
            weir_checkpoint::format::open_verified(&data).map_err(|e| corrupt(storage, found, f, e))?;
            let file = KeyedFile::Memory {
                data,
                puts_from: f.puts_from,
                shard_starts: f.shard_starts(),
                in_window_order: f.in_window_order,
            };
            (file, f.len)
        }
        KeyedFilesIn::LocalDir(dir) => (KeyedFile::Local(copy_verified(storage, found, f, dir).await?), f.len),
        KeyedFilesIn::LocalReadOnce(dir) => match link_unread(storage, found, f, dir).await? {
            Some(link) => (KeyedFile::Local(link), f.len),
            None => (KeyedFile::Streamed(Arc::new(streamed::StreamedFile::of(storage, found, f).await?)), f.len),
        },
    })
}

/// Copies every table file to local files under `dir`, verified like [`read_verified`],
/// [`FILES_IN_FLIGHT`] at a time. On an error the copies made are deleted (each copy's drop).
async fn copy_tables_verified(
    storage: &Storage,
    found: &Restorable,
    tables: &[FileRef],
    dir: &std::path::Path,
) -> Result<Vec<KeyedFile>, RestoreError> {
    futures::stream::iter(
        tables.iter().map(|f| async move {
            Ok::<_, RestoreError>(KeyedFile::Local(copy_verified(storage, found, f, dir).await?))
        }),
    )
    .buffered(FILES_IN_FLIGHT)
    .try_collect()
    .await
}

/// [`copy_verified`], storage errors retried: for the copies a restore makes after it started,
/// which no restore-point selection retries.
async fn copy_verified_retrying(
    storage: &Storage,
    found: &Restorable,
    f: &FileRef,
    dir: &std::path::Path,
) -> Result<Arc<LocalCopy>, RestoreError> {
    let what = storage.url_of(&found.resolve(&f.path));
    retrying(&what, || copy_verified(storage, found, f, dir)).await
}

/// A new local copy's path under `dir` (created): named like the state stores
/// (`<label>-<pid>-<n>`), so that the copies of a killed process are deleted with its stores.
fn new_local_copy_path(dir: &std::path::Path) -> Result<PathBuf, RestoreError> {
    std::fs::create_dir_all(dir).map_err(|e| RestoreError::LocalCopy { dir: dir.display().to_string(), source: e })?;
    let n = NEXT_LOCAL_COPY.fetch_add(1, Ordering::Relaxed);
    Ok(dir.join(format!("restore-{}-{n}", std::process::id())))
}

/// A storage error reading the state file `path`: a missing one is a corrupt snapshot.
fn missing_or_failed(storage: &Storage, path: &str, e: StorageError) -> RestoreError {
    match e {
        StorageError::NotFound(_) => RestoreError::CorruptFile { path: storage.url_of(path), reason: "missing".into() },
        e => e.into(),
    }
}

/// Copies a state file to a new local file under `dir`, verified like [`read_verified`].
async fn copy_verified(
    storage: &Storage,
    found: &Restorable,
    f: &FileRef,
    dir: &std::path::Path,
) -> Result<Arc<LocalCopy>, RestoreError> {
    let path = found.resolve(&f.path);
    // Deleted by its drop if anything below fails.
    let copy = LocalCopy { path: new_local_copy_path(dir)?, len: f.len, puts_from: f.puts_from, unverified: None };
    let digest = storage.get_to_file(&path, &copy.path).await.map_err(|e| missing_or_failed(storage, &path, e))?;
    f.check(&digest).map_err(|reason| RestoreError::CorruptFile { path: storage.url_of(&path), reason })?;
    Ok(Arc::new(copy))
}

/// A state file linked to a new local file under `dir` unread, its length checked, to be
/// verified as it is read ([`LocalCopy::verify_read`]); `None` where it cannot be linked
/// (object storage, another filesystem).
async fn link_unread(
    storage: &Storage,
    found: &Restorable,
    f: &FileRef,
    dir: &std::path::Path,
) -> Result<Option<Arc<LocalCopy>>, RestoreError> {
    let path = found.resolve(&f.path);
    let link_path = new_local_copy_path(dir)?;
    let linked = storage.link_to_file(&path, &link_path).map_err(|e| missing_or_failed(storage, &path, e))?;
    let Some(len) = linked else { return Ok(None) };
    let link = LocalCopy {
        path: link_path,
        len: f.len,
        puts_from: f.puts_from,
        unverified: Some(Box::new(SnapshotFile { storage: storage.clone(), path, file: f.clone() })),
    };
    if len != f.len {
        return Err(corrupt(storage, found, f, format!("{len} bytes where the metadata says {}", f.len)));
    }
    Ok(Some(Arc::new(link)))
}

/// Opens a snapshot named by path or URL: a `.../checkpoints/chk-<N>` directory (whose shared
/// files live beside it) or a self-contained savepoint directory.
pub async fn open_path(path: &str) -> Result<(Storage, Restorable), RestoreError> {
    let trimmed = path.trim_end_matches('/');
    let mut parts: Vec<&str> = trimmed.rsplitn(3, '/').collect();
    parts.reverse();
    let (root, dir) = match parts.as_slice() {
        [root, "checkpoints", chk] if weir_checkpoint::layout::parse_checkpoint_dir(chk).is_some() => {
            let root = if root.is_empty() { "/" } else { root };
            (root.to_string(), format!("checkpoints/{chk}"))
        }
        _ => (trimmed.to_string(), String::new()),
    };
    if !root.contains("://") && !std::path::Path::new(&root).exists() {
        return Err(RestoreError::Invalid { path: path.to_string(), reason: "no such directory".into() });
    }
    let storage = Storage::open(&root)?;
    // Files are verified by the loader (length and checksum); here only the metadata.
    match recovery::read_metadata(&storage, &dir).await? {
        Ok(metadata) => Ok((storage, Restorable { dir, metadata })),
        Err(Verdict::Invalid(reason)) => Err(RestoreError::Invalid { path: path.to_string(), reason }),
        Err(_) => Err(RestoreError::Invalid {
            path: path.to_string(),
            reason: "no _metadata: not a complete checkpoint or savepoint".into(),
        }),
    }
}

/// A restore point that was passed over, and its defect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skipped {
    /// Its id.
    pub id: u64,
    /// Its directory (URL).
    pub path: String,
    /// What is wrong with it.
    pub defect: String,
}

/// What [`newest_valid`] found.
#[derive(Debug, Default)]
pub struct Selection {
    /// The newest restore point that loaded and verified, if any.
    pub restored: Option<RestoredState>,
    /// Newer restore points passed over because they are corrupt, newest first.
    pub skipped: Vec<Skipped>,
    /// Restore points passed over because they are outside the job's history, newest first:
    /// not defects (a run that starts afresh leaves the older history behind).
    pub outside: Vec<Skipped>,
}

impl Selection {
    /// Why this restore point was chosen, for logs, events and the superseded manifest.
    pub fn reason(&self) -> String {
        let Some(r) = &self.restored else { return "no restore point".to_string() };
        if self.skipped.is_empty() {
            return format!("restored the newest restore point, {} (id {})", r.path, r.checkpoint_id);
        }
        let defects: Vec<String> = self.skipped.iter().map(|s| format!("{} ({})", s.path, s.defect)).collect();
        format!(
            "restored {} (id {}) because newer restore points are corrupt: {}",
            r.path,
            r.checkpoint_id,
            defects.join("; ")
        )
    }
}

/// How often a storage error is retried, and the first pause (it quadruples each time).
const STORAGE_ATTEMPTS: u32 = 5;
const STORAGE_BACKOFF: std::time::Duration = std::time::Duration::from_millis(if cfg!(test) { 1 } else { 100 });

/// Runs `op` until it succeeds or fails with something other than a storage error; storage
/// errors (a network blip, a throttled request) are retried with backoff and never taken for
/// corruption.
async fn retrying<T, F, Fut>(what: &str, mut op: F) -> Result<T, RestoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, RestoreError>>,
{
    let mut pause = STORAGE_BACKOFF;
    for attempt in 1.. {
        match op().await {
            Err(RestoreError::Storage(e)) if attempt < STORAGE_ATTEMPTS => {
                tracing::warn!(%what, attempt, error = %e, "storage error; retrying");
                tokio::time::sleep(pause).await;
                pause *= 4;
            }
            other => return other,
        }
    }
    unreachable!("the loop returns")
}

/// The newest restore point (checkpoint or savepoint, by id) at or above `floor` that loads
/// and verifies (every file's length and CRC-32C), passing over corrupt ones and, given the
/// job's `history` ([`weir_checkpoint::epoch::history_before`]), those outside it (written by
/// a superseded run after its successor had chosen its restore point). Storage errors are
/// retried and then returned: they never make a restore point count as corrupt. When restore
/// points exist and none is valid, that is an error naming each one and its defect: a job must
/// never silently start without its state.
pub async fn newest_valid(
    storage: &Storage,
    floor: u64,
    keyed_in: &KeyedFilesIn,
    history: Option<&weir_checkpoint::epoch::Lineage>,
) -> Result<Selection, RestoreError> {
    let points = retrying("listing restore points", || async { Ok(recovery::restore_points(storage).await?) }).await?;
    let mut selection = Selection::default();
    for point in points.into_iter().filter(|p| p.id >= floor) {
        // The metadata, then every file read and verified by the loader (no separate pass of
        // size checks: that would double the requests of a restore).
        let found =
            match retrying(&point.dir, || async { Ok(recovery::read_metadata(storage, &point.dir).await?) }).await? {
                Ok(metadata) => match history.filter(|h| !h.admits(metadata.epoch, point.id)) {
                    Some(h) => {
                        let defect = h.refusal(metadata.epoch, point.id);
                        selection.outside.push(Skipped { id: point.id, path: storage.url_of(&point.dir), defect });
                        continue;
                    }
                    None => Restorable { dir: point.dir.clone(), metadata },
                },
                Err(Verdict::Invalid(defect)) => {
                    selection.skipped.push(Skipped { id: point.id, path: storage.url_of(&point.dir), defect });
                    continue;
                }
                Err(_) => continue,
            };
        match retrying(&point.dir, || RestoredState::load(storage, &found, keyed_in)).await {
            Ok(r) => {
                selection.restored = Some(r);
                return Ok(selection);
            }
            Err(RestoreError::Storage(e)) => return Err(RestoreError::Storage(e)),
            // A local disk that cannot take a copy says nothing about the restore point: it is
            // not passed over (nor then taken for corrupt by retention), the error is returned.
            Err(e @ RestoreError::LocalCopy { .. }) => return Err(e),
            Err(e) => selection.skipped.push(Skipped {
                id: point.id,
                path: storage.url_of(&point.dir),
                defect: e.to_string(),
            }),
        }
    }
    if !selection.skipped.is_empty() {
        let defects: Vec<String> = selection.skipped.iter().map(|s| format!("{}: {}", s.path, s.defect)).collect();
        return Err(RestoreError::NoValidRestorePoint { root: storage.url().to_string(), defects });
    }
    Ok(selection)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use futures::stream::BoxStream;
    use object_store::memory::InMemory;
    use object_store::path::Path;
    use object_store::{
        GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore, PutMultipartOptions, PutOptions,
        PutPayload, PutResult,
    };
    use weir_checkpoint::format::{FileKind, StateFileWriter};
    use weir_checkpoint::metadata::FORMAT_VERSION;
    use weir_checkpoint::{layout, CheckpointMetadata, OperatorSnapshot};

    use super::*;

    /// A snapshot's key count, shared out by key groups: whole when the key groups are the
    /// same; by the fraction taken when a restore splits them; summed when it joins them.
    #[test]
    fn a_restored_subtask_reserves_its_share_of_the_counted_keys() {
        assert_eq!(share_of_entries(1_000, (0, 64), (0, 64)), 1_000);
        assert_eq!(share_of_entries(1_000, (0, 64), (0, 16)), 250);
        assert_eq!(share_of_entries(1_000, (0, 64), (60, 128)), 63, "rounded up");
        assert_eq!(share_of_entries(1_000, (0, 64), (64, 128)), 0, "disjoint");
        assert_eq!(share_of_entries(u64::MAX, (0, 2), (0, 1)), u64::MAX / 2 + 1, "no overflow");
        let operator = RestoredOperator {
            parallelism: 2,
            subtasks: [((0, 32), Some(100)), ((32, 64), Some(300))]
                .into_iter()
                .map(|(key_groups, keyed_entries)| RestoredSubtask {
                    key_groups,
                    keyed_files: vec![KeyedFile::Memory {
                        data: Bytes::new(),
                        puts_from: None,
                        shard_starts: None,
                        in_window_order: false,
                    }],
                    keyed_refs: vec![FileRef::new("../shared/counts/0-1-1.kv".into(), 2_000, 0)],
                    keyed_entries,
                    ..Default::default()
                })
                .collect(),
            state_layout: None,
        };
        let mut restored = RestoredState {
            checkpoint_id: 9,
            kind: SnapshotKind::Checkpoint,
            path: "chk-9".into(),
            max_parallelism: 64,
            epoch: 1,
            bytes: 0,
            operators: [("counts".to_string(), operator)].into(),
            in_job_root: true,
            source: None,
            faulted_tables: None,
        };
        let entries = |restored: &RestoredState, key_groups, parallelism| {
            restored.keyed_for("counts", key_groups, parallelism).unwrap().entries
        };
        assert_eq!(entries(&restored, (0, 32), 2), Some(100));
        assert_eq!(entries(&restored, (0, 64), 1), Some(400));
        assert_eq!(entries(&restored, (16, 48), 3), Some(50 + 150));
        restored.operators.get_mut("counts").unwrap().subtasks[0].keyed_entries = Some(u64::MAX);
        assert_eq!(entries(&restored, (0, 32), 2), Some(2_000), "at most one key per byte of the chain");
        restored.operators.get_mut("counts").unwrap().subtasks[0].keyed_entries = Some(100);
        restored.operators.get_mut("counts").unwrap().subtasks[1].keyed_entries = None;
        assert_eq!(entries(&restored, (0, 64), 1), None, "one count unknown");
        assert_eq!(entries(&restored, (0, 32), 2), Some(100));
    }

    /// The table bytes a heap restore faults in while it reads are those of the shares its
    /// subtasks reserve, at the job's parallelism as at another (each restoring subtask's
    /// share of the counted keys, as `keyed_for` counts them); an operator the job does not
    /// run at a known parallelism, a subtask without its count or slot size, adds nothing.
    #[test]
    fn a_heap_restore_faults_in_the_tables_its_subtasks_reserve() {
        let subtask = |key_groups, keyed_entries, table_slot_bytes| SubtaskSnapshot {
            key_groups,
            keyed_state: vec![FileRef::new("../shared/counts/0-1-1.kv".into(), 1 << 40, 0)],
            keyed_entries,
            table_slot_bytes,
            ..Default::default()
        };
        let mut m = CheckpointMetadata {
            format_version: FORMAT_VERSION,
            checkpoint_id: 1,
            kind: SnapshotKind::Checkpoint,
            job_name: "j".into(),
            epoch: 1,
            created_at_ms: 1,
            max_parallelism: 128,
            operators: [(
                "counts".to_string(),
                OperatorSnapshot {
                    parallelism: 2,
                    subtasks: vec![
                        subtask((0, 64), Some(3_000_000), Some(24)),
                        subtask((64, 128), Some(1_000_000), Some(24)),
                    ],
                    state_layout: None,
                },
            )]
            .into(),
        };
        let at = |p: u32| BTreeMap::from([("counts".to_string(), p)]);
        let tables = |entries| map::restored_table_bytes(entries, 24);
        assert_eq!(restored_table_bytes(&m, &at(2)), tables(3_000_000) + tables(1_000_000));
        assert_eq!(restored_table_bytes(&m, &at(1)), tables(4_000_000));
        assert_eq!(restored_table_bytes(&m, &at(4)), 2 * tables(1_500_000) + 2 * tables(500_000));
        assert!(tables(1_000_000) > 0 && tables(4_000_000) > tables(3_000_000));
        assert_eq!(restored_table_bytes(&m, &BTreeMap::new()), 0, "no parallelism known");
        assert_eq!(restored_table_bytes(&m, &BTreeMap::from([("other".to_string(), 2)])), 0);
        let counts = m.operators.get_mut("counts").unwrap();
        counts.subtasks[1].keyed_entries = None;
        assert_eq!(restored_table_bytes(&m, &at(2)), tables(3_000_000), "the other subtask did not count");
        assert_eq!(restored_table_bytes(&m, &at(1)), 0, "the restoring subtask's count is unknown");
        let counts = m.operators.get_mut("counts").unwrap();
        counts.subtasks[1].keyed_entries = Some(1_000_000);
        counts.subtasks.iter_mut().for_each(|s| s.table_slot_bytes = None);
        assert_eq!(restored_table_bytes(&m, &at(2)), 0, "slot sizes not recorded (the rocksdb backend, older)");
    }

    /// An in-memory store whose reads of paths containing `failing` fail like a network does.
    #[derive(Debug)]
    struct FailingReads {
        inner: InMemory,
        failing: std::sync::Mutex<Option<String>>,
    }

    impl std::fmt::Display for FailingReads {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "FailingReads")
        }
    }

    #[async_trait::async_trait]
    impl ObjectStore for FailingReads {
        async fn put_opts(&self, l: &Path, p: PutPayload, o: PutOptions) -> object_store::Result<PutResult> {
            self.inner.put_opts(l, p, o).await
        }
        async fn put_multipart_opts(
            &self,
            l: &Path,
            o: PutMultipartOptions,
        ) -> object_store::Result<Box<dyn MultipartUpload>> {
            self.inner.put_multipart_opts(l, o).await
        }
        async fn get_opts(&self, l: &Path, o: GetOptions) -> object_store::Result<GetResult> {
            let failing = self.failing.lock().unwrap().clone();
            if !o.head && failing.is_some_and(|f| l.as_ref().contains(&f)) {
                return Err(object_store::Error::Generic { store: "test", source: "connection reset by peer".into() });
            }
            self.inner.get_opts(l, o).await
        }
        async fn delete(&self, l: &Path) -> object_store::Result<()> {
            self.inner.delete(l).await
        }
        fn list(&self, p: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
            self.inner.list(p)
        }
        async fn list_with_delimiter(&self, p: Option<&Path>) -> object_store::Result<ListResult> {
            self.inner.list_with_delimiter(p).await
        }
        async fn copy(&self, f: &Path, t: &Path) -> object_store::Result<()> {
            self.inner.copy(f, t).await
        }
        async fn copy_if_not_exists(&self, f: &Path, t: &Path) -> object_store::Result<()> {
            self.inner.copy_if_not_exists(f, t).await
        }
    }

    /// A complete checkpoint `id` with one operator-state file.
    async fn checkpoint(s: &Storage, id: u64) {
        let mut w = StateFileWriter::new(FileKind::OperatorState, 16);
        w.document(format!("{{\"at\":{id}}}").as_bytes());
        let (data, crc32c) = w.finish();
        let rel = layout::operator_state_file("src", 0, 1);
        let dir = layout::checkpoint_dir(id);
        let len = data.len() as u64;
        s.put(&layout::resolve(&dir, &rel), data).await.unwrap();
        let subtask = SubtaskSnapshot {
            subtask: 0,
            key_groups: (0, 8),
            operator_state: Some(FileRef::new(rel, len, crc32c)),
            keyed_state: vec![],
            store_tables: vec![],
            keyed_entries: None,
            int_keys: false,
            table_slot_bytes: None,
        };
        complete(s, id, "src", subtask).await;
    }

    /// Completes checkpoint `id` of one operator `uid` with one subtask.
    async fn complete(s: &Storage, id: u64, uid: &str, subtask: SubtaskSnapshot) {
        let m = CheckpointMetadata {
            format_version: FORMAT_VERSION,
            checkpoint_id: id,
            kind: SnapshotKind::Checkpoint,
            job_name: "j".into(),
            epoch: 1,
            created_at_ms: id,
            max_parallelism: 8,
            operators: [(
                uid.to_string(),
                OperatorSnapshot { parallelism: 1, subtasks: vec![subtask], state_layout: None },
            )]
            .into(),
        };
        let dir = layout::checkpoint_dir(id);
        s.put(&layout::resolve(&dir, layout::METADATA), bytes::Bytes::from(m.encode())).await.unwrap();
    }

    /// Same length, other bytes: only the checksum can tell.
    async fn corrupt(s: &Storage, id: u64) {
        let path = layout::resolve(&layout::checkpoint_dir(id), &layout::operator_state_file("src", 0, 1));
        let mut data = s.get(&path).await.unwrap().to_vec();
        data[6] ^= 0x01;
        s.put(&path, bytes::Bytes::from(data)).await.unwrap();
    }

    fn store() -> (Arc<FailingReads>, Storage) {
        let store = Arc::new(FailingReads { inner: InMemory::new(), failing: std::sync::Mutex::new(None) });
        let storage = Storage::with_store(store.clone(), "memory://test");
        (store, storage)
    }

    /// A checkpoint `id` of a keyed operator whose chain is one file of `entries` entries.
    async fn keyed_checkpoint(s: &Storage, id: u64, entries: u32) -> FileRef {
        let mut w = StateFileWriter::new(FileKind::KeyedFull, 16);
        for i in 0..entries {
            w.put(i % 8, format!("key-{i}").as_bytes(), &i.to_le_bytes());
        }
        let (data, crc32c) = w.finish();
        let rel = format!("counts-{id}.wst");
        let file = FileRef::new(rel.clone(), data.len() as u64, crc32c);
        s.put(&layout::resolve(&layout::checkpoint_dir(id), &rel), data).await.unwrap();
        let subtask = SubtaskSnapshot { keyed_state: vec![file.clone()], key_groups: (0, 8), ..Default::default() };
        complete(s, id, "counts", subtask).await;
        file
    }

    /// Completes checkpoint `id` of `counts` with `chain` and table files named with their
    /// first keys (key group 1) standing for its first file; returns it as found.
    fn complete_with_tables(s: &Storage, id: u64, chain: &[FileRef], tables: &[(&str, &str)]) -> Restorable {
        let dir = layout::checkpoint_dir(id);
        let mut refs = Vec::new();
        for (rel, first) in tables {
            let data = bytes::Bytes::from(format!("table {rel}"));
            crate::io().block_on(s.put(&layout::resolve(&dir, rel), data.clone())).unwrap();
            let first = crate::state::StateStore::key_of_encoded(1, first.as_bytes());
            refs.push(FileRef::new(rel.to_string(), data.len() as u64, crc32c::crc32c(&data)).with_first_key(&first));
        }
        let subtask = SubtaskSnapshot {
            key_groups: (0, 8),
            keyed_state: chain.to_vec(),
            store_tables: refs,
            ..Default::default()
        };
        crate::io().block_on(complete(s, id, "counts", subtask));
        let metadata = crate::io().block_on(recovery::read_metadata(s, &dir)).unwrap().unwrap();
        Restorable { dir, metadata }
    }

    /// A checkpoint whose chain (a full image and an increment) has the image as two table
    /// files too: a restore to local disk takes the tables instead of the image, one to memory
    /// the image; a damaged table makes the restore take the image, not an older checkpoint.
    #[tokio::test]
    async fn table_files_stand_for_the_image_on_local_disk_and_a_damaged_one_falls_back_to_it() {
        let (_, s) = store();
        let dir = layout::checkpoint_dir(1);
        let mut chain = Vec::new();
        let mut state_files = Vec::new();
        for (rel, kind) in [("image.kv", FileKind::KeyedFull), ("increment.kv", FileKind::KeyedIncrement)] {
            let mut w = StateFileWriter::new(kind, 16);
            w.put(1, rel.as_bytes(), b"v");
            let (data, seal) = w.finish();
            state_files.push(data.to_vec());
            chain.push(FileRef::new(rel.into(), data.len() as u64, seal));
            s.put(&layout::resolve(&dir, rel), data).await.unwrap();
        }
        // More tables than a restore fetches at once: they must come back in their order.
        let mut tables = Vec::new();
        for rel in (0..2 * FILES_IN_FLIGHT + 3).map(|i| format!("t{i}.sst")) {
            let data = bytes::Bytes::from(format!("table {rel}"));
            s.put(&layout::resolve(&dir, &rel), data.clone()).await.unwrap();
            tables.push(FileRef::new(rel, data.len() as u64, crc32c::crc32c(&data)));
        }
        // The tables are not table files: only the loading is under test.
        let subtask = SubtaskSnapshot {
            key_groups: (0, 8),
            keyed_state: chain.clone(),
            store_tables: tables.clone(),
            ..Default::default()
        };
        complete(&s, 1, "counts", subtask).await;
        let metadata = recovery::read_metadata(&s, &dir).await.unwrap().unwrap();
        let found = Restorable { dir: dir.clone(), metadata };
        let local = tempfile::tempdir().unwrap();
        let on_disk = KeyedFilesIn::LocalDir(local.path().to_path_buf());
        let read = |f: &KeyedFile| match f {
            KeyedFile::Local(c) => std::fs::read(&c.path).unwrap(),
            KeyedFile::Memory { data, .. } => data.to_vec(),
            KeyedFile::Stored(_) | KeyedFile::Streamed(_) => panic!("{f:?} is not read here"),
        };

        let copies = || std::fs::read_dir(local.path()).unwrap().count();
        {
            let restored = RestoredState::load(&s, &found, &on_disk).await.unwrap();
            let keyed = restored.keyed_for("counts", (0, 8), 1).unwrap();
            assert_eq!(keyed.files.iter().map(read).collect::<Vec<_>>(), vec![state_files[1].clone()]);
            let [((0, 8), t)] = keyed.tables.as_slice() else { panic!("one subtask's tables: {:?}", keyed.tables) };
            let expected: Vec<Vec<u8>> = tables.iter().map(|f| format!("table {}", f.path).into_bytes()).collect();
            assert_eq!(t.iter().map(read).collect::<Vec<_>>(), expected);
            assert_eq!(keyed.chain_len(), 2, "the tables stand for the image");
            assert_eq!((keyed.chain.clone(), keyed.chain_tables.clone()), (chain.clone(), tables.clone()));
            assert_eq!(copies(), tables.len() + 1);
        }
        assert_eq!(copies(), 0, "copies are deleted with the restored state");

        let in_memory = RestoredState::load(&s, &found, &KeyedFilesIn::Memory).await.unwrap();
        let keyed = in_memory.keyed_for("counts", (0, 8), 1).unwrap();
        assert_eq!(keyed.files.len(), 2, "the heap backend reads the image");
        assert!(keyed.tables.is_empty());

        // One damaged table amid the others: none is used, and none of their copies is left.
        let t9 = layout::resolve(&dir, "t9.sst");
        s.put(&t9, bytes::Bytes::from("table t9.ssT")).await.unwrap();
        let restored = RestoredState::load(&s, &found, &on_disk).await.unwrap();
        let keyed = restored.keyed_for("counts", (0, 8), 1).unwrap();
        assert_eq!(keyed.files.iter().map(read).collect::<Vec<_>>(), state_files);
        assert!(keyed.tables.is_empty(), "a damaged table is not used");
        assert!(keyed.chain_tables.is_empty(), "a continued chain stops listing the damaged tables");
        assert_eq!(copies(), 2, "only the image's and the increment's copies");
        drop((restored, keyed));

        // A missing table: the checkpoint is still valid, and its image is restored.
        s.delete(&t9).await.unwrap();
        assert_eq!(recovery::inspect(&s, &dir).await.unwrap().0, Verdict::Valid);
        let restored = RestoredState::load(&s, &found, &on_disk).await.unwrap();
        let keyed = restored.keyed_for("counts", (0, 8), 1).unwrap();
        assert_eq!(keyed.files.iter().map(read).collect::<Vec<_>>(), state_files);
        assert!(keyed.tables.is_empty() && keyed.chain_tables.is_empty());
    }

    /// Table files listed with their first keys are not read by the load: the store fetches
    /// each when it asks, verified like any state file, and a table that fails its fetch is
    /// stood for by the entries of the image in its range.
    #[test]
    fn tables_with_first_keys_are_fetched_when_the_store_asks() {
        use crate::state::lazy::TableSource;
        use crate::state::StateStore;
        let (_, s) = store();
        let dir = layout::checkpoint_dir(1);
        let store_key = |k: &str| StateStore::key_of_encoded(1, k.as_bytes());
        let mut chain = Vec::new();
        for (rel, kind, keys) in [
            ("image.kv", FileKind::KeyedFull, &["a", "b", "c", "d", "e", "f"][..]),
            ("increment.kv", FileKind::KeyedIncrement, &["b"][..]),
        ] {
            let mut w = StateFileWriter::new(kind, 16);
            for k in keys {
                w.put(1, k.as_bytes(), format!("{rel}:{k}").as_bytes());
            }
            let (data, seal) = w.finish();
            chain.push(FileRef::new(rel.into(), data.len() as u64, seal));
            crate::io().block_on(s.put(&layout::resolve(&dir, rel), data)).unwrap();
        }
        let found = complete_with_tables(&s, 1, &chain, &[("t0.sst", "a"), ("t1.sst", "d")]);
        let local = tempfile::tempdir().unwrap();
        let on_disk = KeyedFilesIn::LocalDir(local.path().to_path_buf());
        let copies = || std::fs::read_dir(local.path()).unwrap().count();

        let restored = crate::io().block_on(RestoredState::load(&s, &found, &on_disk)).unwrap();
        let keyed = restored.keyed_for("counts", (0, 8), 1).unwrap();
        assert!(keyed.tables.is_empty());
        let [((0, 8), lazy)] = keyed.lazy_tables.as_slice() else { panic!("lazy tables: {:?}", keyed.lazy_tables) };
        assert_eq!(keyed.files.len(), 1, "the tables stand for the image, which is not read");
        assert_eq!(keyed.chain_len(), 2);
        assert_eq!(copies(), 1, "only the increment is copied before the job starts");
        assert_eq!(lazy.first_keys(), &[store_key("a"), store_key("d")]);

        let fetched = lazy.fetch(1).unwrap();
        assert_eq!(std::fs::read(&fetched.path).unwrap(), b"table t1.sst");
        assert!(fetched.path.starts_with(local.path()));
        drop(fetched);
        assert_eq!(copies(), 1, "a fetched copy is deleted once taken in");

        let mut entries = Vec::new();
        let mut collect = |k: &[u8], v: &[u8]| {
            entries.push((k.to_vec(), v.to_vec()));
            Ok(())
        };
        lazy.image_entries(&store_key("d"), None, &mut collect).unwrap();
        lazy.image_entries(&[], Some(&store_key("b")), &mut collect).unwrap();
        let expected: Vec<(Vec<u8>, Vec<u8>)> =
            ["d", "e", "f", "a"].iter().map(|k| (store_key(k), format!("image.kv:{k}").into_bytes())).collect();
        assert_eq!(entries, expected, "the image's entries of each range, and nothing of the increment");

        // Same length, other bytes: only the checksum can tell.
        crate::io().block_on(s.put(&layout::resolve(&dir, "t0.sst"), bytes::Bytes::from("table t0.ssT"))).unwrap();
        let damaged = lazy.fetch(0).err().unwrap();
        assert!(damaged.contains("crc32c"), "{damaged}");
        crate::io().block_on(s.delete(&layout::resolve(&dir, "t0.sst"))).unwrap();
        let missing = lazy.fetch(0).err().unwrap();
        assert!(missing.contains("missing"), "{missing}");
        assert_eq!(copies(), 2, "the increment's copy and the image's, kept for other ranges");
        drop((restored, keyed));
        assert_eq!(copies(), 0, "copies are deleted with the restored state");
    }

    /// A lazy restore leaves increments ordered by key group in storage (reading only their
    /// start) and copies them whole behind the job; others are copied before it. A stretch is
    /// fetched when asked, from the copy once it is there; a damaged or missing one is
    /// recorded, and from then on no restore picks a checkpoint that needs the file: the next
    /// one falls back to an older checkpoint, naming the damage.
    /// A heap restore over its budget of files in memory (`KeyedFilesIn::MemoryUpTo`) links a
    /// local checkpoint's files unread; one within it reads them into memory. A link read whole
    /// verifies against the metadata; damaged in place (its length kept), it fails naming the
    /// file and records the damage, so that the next selection passes over the checkpoint. The
    /// link goes with the restore; the checkpoint's file stays.
    #[test]
    fn heap_restores_over_their_budget_link_files_unread_and_verify_them_as_read() {
        let root = tempfile::tempdir().unwrap();
        let s = Storage::open(root.path().to_str().unwrap()).unwrap();
        let file = crate::io().block_on(keyed_checkpoint(&s, 1, 50));
        let local = tempfile::tempdir().unwrap();
        // Left by a killed process (pid 4294967295 is never one): deleted by the next such restore.
        let dead_copy = local.path().join("restore-4294967295-0");
        std::fs::write(&dead_copy, b"copy").unwrap();
        let up_to =
            |bytes| KeyedFilesIn::MemoryUpTo { bytes, dir: local.path().to_path_buf(), parallelism: BTreeMap::new() };
        let load = |keyed_in| crate::io().block_on(newest_valid(&s, 0, &keyed_in, None));
        let within = load(up_to(file.len)).unwrap().restored.unwrap();
        let files = within.keyed_for("counts", (0, 8), 1).unwrap().files;
        assert!(matches!(files.as_slice(), [KeyedFile::Memory { .. }]), "{files:?}");
        assert!(dead_copy.exists(), "a restore in memory leaves the directory alone");

        let over = load(up_to(file.len - 1)).unwrap().restored.unwrap();
        assert_eq!(over.bytes, file.len);
        let keyed = over.keyed_for("counts", (0, 8), 1).unwrap();
        let [KeyedFile::Local(link)] = keyed.files.as_slice() else { panic!("{:?}", keyed.files) };
        assert!(link.unverified());
        assert!(!dead_copy.exists(), "a dead process's copy is deleted");
        let object = root.path().join(layout::resolve(&layout::checkpoint_dir(1), &file.path));
        use std::os::unix::fs::MetadataExt;
        let inode = |p: &std::path::Path| std::fs::metadata(p).unwrap().ino();
        assert_eq!(inode(&link.path), inode(&object), "linked, not copied");
        let read_whole = |path: &std::path::Path| {
            let mut read = DigestingReader::new(std::fs::File::open(path).unwrap(), true);
            std::io::copy(&mut read, &mut std::io::sink()).unwrap();
            read.digest.unwrap()
        };
        link.verify_read(&read_whole(&link.path)).unwrap();
        link.verify_whole().unwrap();

        let mut bytes = std::fs::read(&object).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0x01;
        std::fs::write(&object, bytes).unwrap();
        let why = link.verify_read(&read_whole(&link.path)).unwrap_err();
        assert!(why.contains("counts-1.wst") && why.contains("crc32c"), "{why}");
        assert!(link.verify_whole().is_err());
        let refused = load(up_to(0)).unwrap_err().to_string();
        assert!(refused.contains("damaged"), "{refused}");
        let link_path = link.path.clone();
        drop((keyed, over));
        assert!(!link_path.exists(), "the link goes with the restore");
        assert!(object.exists(), "the checkpoint's file stays");
    }

    /// From object storage, a heap restore over its budget keeps no copy of its files: each
    /// reader fetches its file in ranges as it reads. Read whole, a file holds the snapshot's
    /// bytes and verifies; damaged in place, it fails as it is read, naming the file, and
    /// records the damage; one whose ranges cannot be fetched fails its reader once the retries
    /// are spent, and that is no damage.
    #[test]
    fn heap_restores_over_their_budget_from_object_storage_read_their_files_as_they_apply_them() {
        use std::io::Read;
        let (store, s) = store();
        let file = crate::io().block_on(keyed_checkpoint(&s, 1, 5000));
        assert!(file.len > 4 * streamed::RANGE_BYTES, "{} bytes: several ranges", file.len);
        let object = layout::resolve(&layout::checkpoint_dir(1), &file.path);
        let data = crate::io().block_on(s.get(&object)).unwrap();
        let local = tempfile::tempdir().unwrap();
        let over = KeyedFilesIn::MemoryUpTo {
            bytes: file.len - 1,
            dir: local.path().to_path_buf(),
            parallelism: BTreeMap::new(),
        };
        let load = || crate::io().block_on(newest_valid(&s, 0, &over, None)).map(|sel| sel.restored.unwrap());
        let streamed_of = |restored: &RestoredState| {
            let keyed = restored.keyed_for("counts", (0, 8), 1).unwrap();
            let [KeyedFile::Streamed(streamed)] = keyed.files.as_slice() else { panic!("{:?}", keyed.files) };
            streamed.clone()
        };
        let read_whole = |streamed: &streamed::StreamedFile| -> std::io::Result<(Vec<u8>, FileDigest)> {
            let mut read = DigestingReader::new(streamed.reader(), true);
            let mut bytes = Vec::new();
            read.read_to_end(&mut bytes)?;
            Ok((bytes, read.digest.unwrap()))
        };

        let restored = load().unwrap();
        assert_eq!(restored.bytes, file.len);
        let streamed = streamed_of(&restored);
        assert_eq!(streamed.len(), file.len);
        let (bytes, digest) = read_whole(&streamed).unwrap();
        assert!(bytes == data[..], "the reader reads the snapshot's bytes");
        streamed.source.verify(&digest).unwrap();
        assert_eq!(std::fs::read_dir(local.path()).unwrap().count(), 0, "no local copy");

        *store.failing.lock().unwrap() = Some(file.path.clone());
        let e = read_whole(&streamed).unwrap_err();
        assert!(e.to_string().contains("connection reset by peer"), "{e}");
        *store.failing.lock().unwrap() = None;
        assert!(load().is_ok(), "a failed read is no damage");

        let mut damaged = data.to_vec();
        damaged[data.len() / 2] ^= 0x01;
        crate::io().block_on(s.put(&object, Bytes::from(damaged))).unwrap();
        let (_, digest) = read_whole(&streamed).unwrap();
        let why = streamed.source.verify(&digest).unwrap_err();
        assert!(why.contains("counts-1.wst") && why.contains("crc32c"), "{why}");
        let refused = load().unwrap_err().to_string();
        assert!(refused.contains("damaged"), "{refused}");
        crate::io().block_on(s.delete(&layout::damage_record(&object))).unwrap();
        crate::io().block_on(s.put(&object, data.slice(..data.len() - 1))).unwrap();
        let shorter = load().unwrap_err().to_string();
        assert!(shorter.contains("bytes where the metadata says"), "{shorter}");
    }

    /// Within its budget of files in memory, a heap restore reads them whole first, except
    /// from object storage when they hold long values (at least
    /// [`STREAMED_FROM_BYTES_PER_KEY`] bytes per counted key): those are read in ranges as they
    /// are applied. Over the budget, in parts wherever they are.
    #[test]
    fn a_heap_restore_from_object_storage_reads_long_values_in_ranges_as_it_applies_them() {
        let dir = tempfile::tempdir().unwrap();
        let metadata = |bytes_per_key: u64, counted: [bool; 2]| CheckpointMetadata {
            format_version: FORMAT_VERSION,
            checkpoint_id: 3,
            kind: SnapshotKind::Checkpoint,
            job_name: "j".into(),
            epoch: 1,
            created_at_ms: 3,
            max_parallelism: 128,
            operators: [(
                "latest".to_string(),
                OperatorSnapshot {
                    parallelism: 2,
                    subtasks: (0..2)
                        .map(|i| SubtaskSnapshot {
                            subtask: i,
                            key_groups: (64 * i, 64 * (i + 1)),
                            keyed_state: vec![FileRef::new(
                                format!("../shared/latest/{i}.kv"),
                                1_000 * bytes_per_key,
                                0,
                            )],
                            keyed_entries: counted[i as usize].then_some(1_000),
                            ..Default::default()
                        })
                        .collect(),
                    state_layout: None,
                },
            )]
            .into(),
        };
        let budget =
            |bytes| KeyedFilesIn::MemoryUpTo { bytes, dir: dir.path().to_path_buf(), parallelism: BTreeMap::new() };
        let in_ranges = |m: &CheckpointMetadata, bytes, from_object_storage| {
            matches!(budget(bytes).for_snapshot(m, from_object_storage), KeyedFilesIn::LocalReadOnce(_))
        };
        let long = metadata(STREAMED_FROM_BYTES_PER_KEY, [true, true]);
        assert!(in_ranges(&long, u64::MAX, true), "long values from object storage");
        assert!(!in_ranges(&long, u64::MAX, false), "long values from local disk: whole");
        let short = metadata(STREAMED_FROM_BYTES_PER_KEY - 1, [true, true]);
        assert!(!in_ranges(&short, u64::MAX, true), "short values: whole, applied shard by shard");
        let uncounted = metadata(10 * STREAMED_FROM_BYTES_PER_KEY, [true, false]);
        assert!(!in_ranges(&uncounted, u64::MAX, true), "a subtask did not count its keys");
        assert!(in_ranges(&short, 1_000, false) && in_ranges(&short, 1_000, true), "over the budget");
        assert!(matches!(KeyedFilesIn::Memory.for_snapshot(&long, true), KeyedFilesIn::Memory));
    }

    #[test]
    fn increments_by_key_group_stay_in_storage_and_a_recorded_damage_refuses_their_checkpoints() {
        use crate::state::bulk::StoredIncrement;
        let (_, s) = store();
        let older = crate::io().block_on(keyed_checkpoint(&s, 1, 4));
        let dir = layout::checkpoint_dir(2);
        let mut chain = Vec::new();
        let mut by_key_group = StateFileWriter::increment_by_key_group(16);
        for (key_group, k) in [(5, "x"), (1, "b"), (3, "y"), (1, "c")] {
            by_key_group.put(key_group, k.as_bytes(), b"new");
        }
        let mut older_kind = StateFileWriter::new(FileKind::KeyedIncrement, 16);
        older_kind.put(1, b"a", b"newest");
        let mut image = StateFileWriter::new(FileKind::KeyedFull, 16);
        image.put(1, b"a", b"old");
        for (rel, w) in [("image.kv", image), ("increment.kv", by_key_group), ("older-kind.kv", older_kind)] {
            let (data, seal) = w.finish();
            chain.push(FileRef::new(rel.into(), data.len() as u64, seal));
            crate::io().block_on(s.put(&layout::resolve(&dir, rel), data)).unwrap();
        }
        let found = complete_with_tables(&s, 2, &chain, &[("t0.sst", "a")]);
        let local = tempfile::tempdir().unwrap();
        let on_disk = KeyedFilesIn::LocalDir(local.path().to_path_buf());
        let copies = || std::fs::read_dir(local.path()).unwrap().count();

        let restored = crate::io().block_on(RestoredState::load(&s, &found, &on_disk)).unwrap();
        assert_eq!(restored.bytes, chain[2].len, "only the increment of the older kind is read whole");
        let keyed = restored.keyed_for("counts", (0, 8), 1).unwrap();
        let [KeyedFile::Stored(stored), KeyedFile::Local(_)] = keyed.files.as_slice() else {
            panic!("{:?}", keyed.files)
        };
        // Not before the job starts: the increment by key group is copied behind it.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while copies() < 2 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(copies(), 2, "the increment by key group is copied whole in the background");
        assert!(stored.index.checked);
        let (offset, len) = stored.index.stretch_of((1, 2));
        let stretch = crate::io().block_on(stored.fetch(offset, len)).unwrap();
        stored.index.verify(offset, &stretch).unwrap();
        let keys: Vec<_> = weir_checkpoint::format::keyed_entries(&stretch).map(|e| e.unwrap().key.to_vec()).collect();
        assert_eq!(keys, [b"b".to_vec(), b"c".to_vec()]);
        // On a memory backend nothing restores lazily: every file is read whole.
        let in_memory = crate::io().block_on(RestoredState::load(&s, &found, &KeyedFilesIn::Memory)).unwrap();
        assert!(in_memory
            .keyed_for("counts", (0, 8), 1)
            .unwrap()
            .files
            .iter()
            .all(|f| matches!(f, KeyedFile::Memory { .. })));

        // A loader found a stretch damaged: recorded where every later restore looks.
        crate::io().block_on(stored.damaged("bytes 9..20: key group 1 does not match its checksum"));
        let refused = crate::io().block_on(RestoredState::load(&s, &found, &on_disk)).unwrap_err().to_string();
        assert!(
            refused.contains("increment.kv") && refused.contains("an earlier restore found it damaged (bytes 9..20"),
            "{refused}"
        );
        let selection = crate::io().block_on(newest_valid(&s, 0, &on_disk, None)).unwrap();
        assert_eq!(selection.restored.as_ref().map(|r| r.checkpoint_id), Some(1));
        assert!(selection.reason().contains("an earlier restore found it damaged"), "{}", selection.reason());
        assert!(crate::io().block_on(s.get(&layout::resolve(&layout::checkpoint_dir(1), &older.path))).is_ok());

        // Before its copy is there, a stretch is read from storage; one whose file went missing
        // is recorded too. Once copied, stretches are read from the copy.
        let uncopied =
            crate::io().block_on(StoredIncrementFile::of(&s, &found, &chain[1], local.path())).unwrap().unwrap();
        assert_eq!(crate::io().block_on(uncopied.fetch(offset, len)).unwrap(), stretch);
        let gone = layout::resolve(&dir, "older-kind.kv");
        crate::io().block_on(s.delete(&layout::resolve(&dir, "increment.kv"))).unwrap();
        let missing = crate::io().block_on(uncopied.fetch(offset, len)).unwrap_err();
        assert!(missing.contains("missing"), "{missing}");
        assert_eq!(crate::io().block_on(stored.fetch(offset, len)).unwrap(), stretch, "from the copy");
        let records = crate::io().block_on(s.list(layout::DAMAGED)).unwrap();
        assert_eq!(records, [layout::damage_record(&layout::resolve(&dir, "increment.kv"))]);
        assert!(crate::io().block_on(s.get(&gone)).is_ok(), "nothing else is touched");
        drop((restored, keyed, in_memory, selection));
        assert_eq!(copies(), 0, "copies are deleted with the restored state");
    }

    /// The local directory cannot take the copies (here it is under a regular file): the
    /// restore fails with that error instead of passing over a good checkpoint as corrupt.
    #[tokio::test]
    async fn a_local_disk_that_refuses_the_copy_does_not_make_a_checkpoint_corrupt() {
        let (_, s) = store();
        keyed_checkpoint(&s, 1, 10_000).await;
        keyed_checkpoint(&s, 2, 10_000).await;
        let not_a_dir = tempfile::NamedTempFile::new().unwrap();
        let keyed_in = KeyedFilesIn::LocalDir(not_a_dir.path().join("state"));
        match newest_valid(&s, 0, &keyed_in, None).await {
            Err(RestoreError::LocalCopy { dir, .. }) => assert!(dir.contains("state"), "{dir}"),
            other => panic!("expected the local copy error, got {other:?}"),
        }
        let local = tempfile::tempdir().unwrap();
        let keyed_in = KeyedFilesIn::LocalDir(local.path().to_path_buf());
        assert_eq!(newest_valid(&s, 0, &keyed_in, None).await.unwrap().restored.unwrap().checkpoint_id, 2);
    }

    #[tokio::test]
    async fn keyed_files_copied_to_local_disk_are_verified_read_in_parts_and_deleted() {
        let (_, s) = store();
        let local = tempfile::tempdir().unwrap();
        let keyed_in = KeyedFilesIn::LocalDir(local.path().to_path_buf());
        let file = keyed_checkpoint(&s, 1, 10_000).await;
        let restored = newest_valid(&s, 0, &keyed_in, None).await.unwrap().restored.unwrap();
        assert_eq!(restored.bytes, file.len);
        let keyed = restored.keyed_for("counts", (0, 8), 1).unwrap();
        let [KeyedFile::Local(copy)] = keyed.files.as_slice() else { panic!("one local copy: {:?}", keyed.files) };
        assert_eq!(std::fs::metadata(&copy.path).unwrap().len(), file.len);
        let mut keys = 0;
        let kind = weir_checkpoint::format::read_keyed_parts(
            std::fs::File::open(&copy.path).unwrap(),
            copy.len,
            4096,
            |body| {
                keys += weir_checkpoint::format::keyed_entries(body).count();
                Ok::<_, ()>(())
            },
        )
        .unwrap();
        assert_eq!((kind, keys), (FileKind::KeyedFull, 10_000));
        let copied = copy.path.clone();
        drop(keyed);
        assert!(copied.exists(), "still referenced by the restored state");
        drop(restored);
        assert!(!copied.exists(), "the local copy is deleted with its last reference");

        // A copy that does not match its metadata is refused, and nothing is left behind.
        let path = layout::resolve(&layout::checkpoint_dir(1), &file.path);
        let mut data = s.get(&path).await.unwrap().to_vec();
        data[20] ^= 0x01;
        s.put(&path, bytes::Bytes::from(data)).await.unwrap();
        let err = newest_valid(&s, 0, &keyed_in, None).await.unwrap_err().to_string();
        assert!(err.contains("crc32c") && err.contains("counts-1.wst"), "{err}");
        assert_eq!(std::fs::read_dir(local.path()).unwrap().count(), 0, "no partial copy left");
    }

    /// Another intact state file of the same length in a file's place (a file of another
    /// checkpoint, of another subtask, or restored from a backup) is not the file the
    /// checkpoint wrote: the restore refuses it and falls back, whether it reads the file into
    /// memory or copies it to local disk, from object storage or a filesystem. Checkpoints
    /// written before files' seals were recorded list the whole file's checksum, the same for
    /// every intact state file, and still restore.
    #[tokio::test]
    async fn another_intact_state_file_in_a_files_place_is_refused() {
        let root = tempfile::tempdir().unwrap();
        let local = tempfile::tempdir().unwrap();
        let storages = [store().1, Storage::open(root.path().to_str().unwrap()).unwrap()];
        for (s, keyed_in) in storages
            .iter()
            .flat_map(|s| [(s, KeyedFilesIn::Memory), (s, KeyedFilesIn::LocalDir(local.path().to_path_buf()))])
        {
            keyed_checkpoint(s, 1, 100).await;
            let file = keyed_checkpoint(s, 2, 100).await;
            let path = layout::resolve(&layout::checkpoint_dir(2), &file.path);
            let written = s.get(&path).await.unwrap();
            let mut other = StateFileWriter::new(FileKind::KeyedFull, 16);
            for i in 0..100u32 {
                other.put(i % 8, format!("key-{i}").as_bytes(), &(i + 1).to_le_bytes());
            }
            let (other, _) = other.finish();
            assert_eq!(other.len(), written.len());
            s.put(&path, other).await.unwrap();
            let selection = newest_valid(s, 0, &keyed_in, None).await.unwrap();
            assert_eq!(selection.restored.as_ref().unwrap().checkpoint_id, 1, "{keyed_in:?}");
            assert!(selection.reason().contains("another one"), "{}", selection.reason());

            // As a checkpoint written before seals were recorded lists it.
            let m = recovery::read_metadata(s, &layout::checkpoint_dir(2)).await.unwrap().unwrap();
            let mut old = m.clone();
            old.format_version = 1;
            for op in old.operators.values_mut() {
                for f in op.subtasks.iter_mut().flat_map(|t| t.keyed_state.iter_mut()) {
                    f.crc32c = crc32c::crc32c(&written);
                }
            }
            s.put(&layout::resolve(&layout::checkpoint_dir(2), layout::METADATA), old.encode().into()).await.unwrap();
            s.put(&path, written).await.unwrap();
            let selection = newest_valid(s, 0, &keyed_in, None).await.unwrap();
            assert_eq!(selection.restored.as_ref().unwrap().checkpoint_id, 2, "{keyed_in:?}");
            for id in [1, 2] {
                for f in s.list(&layout::checkpoint_dir(id)).await.unwrap() {
                    s.delete(&f).await.unwrap();
                }
            }
        }
    }

    #[tokio::test]
    async fn a_storage_error_is_not_corruption_and_is_never_skipped() {
        let (store, s) = store();
        checkpoint(&s, 1).await;
        checkpoint(&s, 2).await;
        *store.failing.lock().unwrap() = Some("chk-2/src".into());
        // It used to fall back to checkpoint 1 (and a restart from 1 rewound output).
        match newest_valid(&s, 0, &KeyedFilesIn::Memory, None).await {
            Err(RestoreError::Storage(e)) => assert!(e.to_string().contains("connection reset"), "{e}"),
            other => panic!("expected the storage error, got {other:?}"),
        }
        *store.failing.lock().unwrap() = None;
        assert_eq!(newest_valid(&s, 0, &KeyedFilesIn::Memory, None).await.unwrap().restored.unwrap().checkpoint_id, 2);
    }

    /// Run 1 wrote checkpoints 1 and 2; run 2 claimed, restored 2 and recorded it; run 1, which
    /// had passed its fence check before that claim, then published checkpoint 3. Checkpoint 3
    /// is outside the history: no later restore takes it, and the listing the operator reads
    /// calls it invalid with the reason.
    #[tokio::test]
    async fn a_checkpoint_a_superseded_run_published_late_is_never_restored() {
        use weir_checkpoint::epoch::{self, RestoredFrom};
        let (_, s) = store();
        assert_eq!(epoch::claim_started(&s, "run 1", None).await.unwrap(), 1);
        checkpoint(&s, 1).await;
        checkpoint(&s, 2).await;
        epoch::claim_started(&s, "run 2", Some(RestoredFrom { id: 2, epoch: 1 })).await.unwrap();
        checkpoint(&s, 3).await;
        let next = epoch::claim(&s, "run 3").await.unwrap();
        let history = epoch::history_before(&s, next).await.unwrap().unwrap();
        let selection = newest_valid(&s, 0, &KeyedFilesIn::Memory, Some(&history)).await.unwrap();
        assert_eq!(selection.restored.as_ref().unwrap().checkpoint_id, 2);
        assert_eq!(selection.outside.len(), 1);
        assert!(selection.outside[0].defect.contains("not in the job's history"), "{:?}", selection.outside);
        let listed = recovery::list_checkpoints(&s).await.unwrap();
        let verdicts: Vec<(u64, bool)> = listed.iter().map(|(id, v, _)| (*id, *v == Verdict::Valid)).collect();
        assert_eq!(verdicts, vec![(3, false), (2, true), (1, true)]);
        // Without the history (a tool reading any root), checkpoint 3 looks like the newest.
        let blind = newest_valid(&s, 0, &KeyedFilesIn::Memory, None).await.unwrap();
        assert_eq!(blind.restored.unwrap().checkpoint_id, 3);
    }

    /// A stateless upgrade starts afresh (run 2, no restore point) beside run 1's checkpoints;
    /// a restart of run 2 before its first checkpoint must start afresh again, not restore
    /// run 1's newest (state the upgrade chose to leave behind), and is no error.
    #[tokio::test]
    async fn a_restart_of_a_fresh_start_does_not_reach_back_into_the_older_history() {
        use weir_checkpoint::epoch;
        let (_, s) = store();
        epoch::claim_started(&s, "run 1", None).await.unwrap();
        checkpoint(&s, 1).await;
        checkpoint(&s, 2).await;
        epoch::claim_started(&s, "run 2 (stateless upgrade)", None).await.unwrap();
        let restart = epoch::claim(&s, "run 2's restart").await.unwrap();
        let history = epoch::history_before(&s, restart).await.unwrap().unwrap();
        let selection = newest_valid(&s, 0, &KeyedFilesIn::Memory, Some(&history)).await.unwrap();
        assert!(selection.restored.is_none(), "run 1's checkpoints are not in run 2's history");
        assert_eq!(selection.outside.iter().map(|o| o.id).collect::<Vec<_>>(), vec![2, 1]);
        assert!(selection.outside[0].defect.contains("started the history afresh"), "{:?}", selection.outside);
    }

    #[tokio::test]
    async fn corruption_falls_back_and_nothing_valid_is_refused_naming_each_defect() {
        let (_, s) = store();
        assert!(
            newest_valid(&s, 0, &KeyedFilesIn::Memory, None).await.unwrap().restored.is_none(),
            "an empty root is a fresh start"
        );
        s.put("checkpoints/chk-9/src/0-1.state", bytes::Bytes::from_static(b"x")).await.unwrap();
        assert!(
            newest_valid(&s, 0, &KeyedFilesIn::Memory, None).await.unwrap().restored.is_none(),
            "a checkpoint that never completed is not a defect"
        );
        checkpoint(&s, 1).await;
        checkpoint(&s, 2).await;
        corrupt(&s, 2).await;
        let selection = newest_valid(&s, 0, &KeyedFilesIn::Memory, None).await.unwrap();
        assert_eq!(selection.restored.as_ref().unwrap().checkpoint_id, 1);
        assert_eq!(selection.skipped.iter().map(|k| k.id).collect::<Vec<_>>(), vec![2]);
        assert!(selection.reason().contains("newer restore points are corrupt"), "{}", selection.reason());
        corrupt(&s, 1).await;
        let err = newest_valid(&s, 0, &KeyedFilesIn::Memory, None).await.unwrap_err().to_string();
        assert!(
            err.contains("refusing to start without the job's state")
                && err.contains("chk-2")
                && err.contains("chk-1")
                && err.contains("crc32c"),
            "{err}"
        );
    }
}
