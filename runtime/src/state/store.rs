//! The store of the `rocksdb` keyed-state backend: a RocksDB instance on local disk holding the
//! entries that [`super::KeyedState`]'s in-memory cache evicted, so that a subtask's state may
//! be larger than its memory.
//!
//! The store is a working copy, not a durable one: checkpoints write the canonical state files
//! (the same format as the heap backend's, so either backend restores the other's snapshots),
//! and a restarted subtask rebuilds its store from them. Writes therefore skip RocksDB's
//! write-ahead log, and the directory is deleted when the store is dropped.
//!
//! Store keys are the key group (2 bytes, big-endian) followed by the encoded key, so the
//! entries of a key group are contiguous; values are the encoded state value.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use rocksdb::{BlockBasedOptions, Cache, DBCompressionType, Options, WriteBatch, WriteOptions, DB};
use weir_checkpoint::format::{Encoder, FormatError};

use crate::value::Key;

/// Why the state store failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store's directory could not be prepared.
    #[error("preparing the state store directory {dir}: {source}")]
    PrepareDir {
        /// The directory.
        dir: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// RocksDB could not open the store.
    #[error("opening the state store at {dir}: {source}")]
    Open {
        /// The directory.
        dir: String,
        /// RocksDB's error.
        source: rocksdb::Error,
    },
    /// A read failed.
    #[error("reading the state store: {0}")]
    Read(rocksdb::Error),
    /// A write failed.
    #[error("writing the state store: {0}")]
    Write(rocksdb::Error),
    /// A scan of every entry failed.
    #[error("scanning the state store: {0}")]
    Scan(rocksdb::Error),
    /// A full image could not be written to local disk.
    #[error("writing a full image to local disk: {0}")]
    SpillImage(std::io::Error),
    /// A restore's sorted runs could not be written to or read from local disk.
    #[error("bulk-loading restored state through local disk: {0}")]
    BulkLoad(std::io::Error),
    /// A restore's table file could not be written.
    #[error("writing a table file of restored state: {0}")]
    WriteTable(rocksdb::Error),
    /// The store refused a restore's table files.
    #[error("loading restored table files into the state store: {0}")]
    Ingest(rocksdb::Error),
    /// An entry could not be decoded (the store holds only what this process wrote, so this is
    /// a corrupted local disk).
    #[error("decoding an entry of the state store: {0}")]
    Decode(#[from] FormatError),
}

/// Settings of the `rocksdb` backend for one subtask's keyed state.
#[derive(Clone, Debug)]
pub struct StoreSettings {
    /// Where the store's directory goes (a fresh directory is made under it).
    pub parent_dir: PathBuf,
    /// How many entries the in-memory cache in front of the store holds.
    pub cache_entries: usize,
}

/// One subtask's store.
pub struct StateStore {
    db: Option<DB>,
    dir: PathBuf,
    parent_dir: PathBuf,
    no_wal: WriteOptions,
}

/// Makes store directory names unique within the process.
static NEXT_STORE: AtomicU64 = AtomicU64::new(0);

/// RocksDB's own memory per store: two 8 MiB memtables and a 16 MiB block cache (about 32 MiB),
/// so that a process's memory is mostly the cache of decoded entries, which the job sizes
/// (`stateCacheEntries`).
const WRITE_BUFFER_BYTES: usize = 8 << 20;
const BLOCK_CACHE_BYTES: usize = 16 << 20;

impl StateStore {
    /// Opens an empty store in a new directory under `parent_dir`, named after `label`.
    pub fn open(parent_dir: &Path, label: &str) -> Result<Self, StoreError> {
        let n = NEXT_STORE.fetch_add(1, Ordering::Relaxed);
        let safe: String = label.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
        let dir = parent_dir.join(format!("{}-{}-{n}", safe, std::process::id()));
        let prepare = |source| StoreError::PrepareDir { dir: dir.display().to_string(), source };
        // In the background: after many kills there may be gigabytes to delete.
        let parent = parent_dir.to_path_buf();
        std::thread::spawn(move || remove_stores_of_dead_processes(&parent));
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(prepare)?;
        }
        std::fs::create_dir_all(&dir).map_err(prepare)?;
        let db =
            DB::open(&options(), &dir).map_err(|source| StoreError::Open { dir: dir.display().to_string(), source })?;
        let mut no_wal = WriteOptions::default();
        no_wal.disable_wal(true);
        Ok(StateStore { db: Some(db), dir, parent_dir: parent_dir.to_path_buf(), no_wal })
    }

    /// The directory the store's own directory is in.
    pub fn parent_dir(&self) -> &Path {
        &self.parent_dir
    }

    /// The store's own directory (deleted with the store).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn db(&self) -> &DB {
        perf_counters_off();
        self.db.as_ref().expect("the store is open until dropped")
    }

    /// The store key of `key` in `key_group`, appended to `out`.
    pub fn encode_key(key_group: u32, key: &Key, out: &mut Vec<u8>) {
        let mut e = Encoder { buf: std::mem::take(out) };
        e.buf.extend_from_slice(&(key_group as u16).to_be_bytes());
        key.encode(&mut e);
        *out = e.buf;
    }

    /// The store key of `key` in `key_group`.
    pub fn key_of(key_group: u32, key: &Key) -> Vec<u8> {
        let mut raw = Vec::with_capacity(16);
        Self::encode_key(key_group, key, &mut raw);
        raw
    }

    /// The store key of an already encoded key (as a state file holds it), appended to `out`.
    pub fn encoded_key(key_group: u32, encoded: &[u8], out: &mut Vec<u8>) {
        out.extend_from_slice(&(key_group as u16).to_be_bytes());
        out.extend_from_slice(encoded);
    }

    /// Splits a store key into its key group and the encoded key.
    pub fn split_key(raw: &[u8]) -> Result<(u32, &[u8]), FormatError> {
        match raw {
            [a, b, rest @ ..] => Ok((u32::from(u16::from_be_bytes([*a, *b])), rest)),
            _ => Err(FormatError::Truncated(raw.len())),
        }
    }

    /// The value stored under a store key.
    pub fn get(&self, store_key: &[u8]) -> Result<Option<rocksdb::DBPinnableSlice<'_>>, StoreError> {
        self.db().get_pinned(store_key).map_err(StoreError::Read)
    }

    /// The values stored under several store keys, in their order, in one call.
    pub fn multi_get(&self, store_keys: &[Vec<u8>]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        self.db().multi_get(store_keys).into_iter().map(|r| r.map_err(StoreError::Read)).collect()
    }

    /// Applies a batch of puts and deletes.
    pub fn write(&self, batch: WriteBatch) -> Result<(), StoreError> {
        if batch.is_empty() {
            return Ok(());
        }
        self.db().write_opt(batch, &self.no_wal).map_err(StoreError::Write)
    }

    /// Moves table files written by [`super::bulk::BulkLoad`] into the store: into its last
    /// level when the store is empty and the files do not overlap, as a restore's are.
    pub fn ingest(&self, tables: Vec<PathBuf>) -> Result<(), StoreError> {
        if tables.is_empty() {
            return Ok(());
        }
        let mut opts = rocksdb::IngestExternalFileOptions::default();
        opts.set_move_files(true);
        self.db().ingest_external_file_opts(&opts, tables).map_err(StoreError::Ingest)
    }

    /// RocksDB's estimate of the number of entries stored (`rocksdb.estimate-num-keys`; it
    /// counts overwritten and deleted keys until compactions drop them). 0 when unavailable.
    pub fn estimated_entries(&self) -> u64 {
        self.db().property_int_value("rocksdb.estimate-num-keys").ok().flatten().unwrap_or(0)
    }

    /// Calls `f` with every entry's store key and value, in key order.
    pub fn scan<E: From<StoreError>>(&self, mut f: impl FnMut(&[u8], &[u8]) -> Result<(), E>) -> Result<(), E> {
        let mut it = self.db().raw_iterator();
        it.seek_to_first();
        while let (Some(k), Some(v)) = (it.key(), it.value()) {
            f(k, v)?;
            it.next();
        }
        it.status().map_err(|e| E::from(StoreError::Scan(e)))
    }
}

impl Drop for StateStore {
    fn drop(&mut self) {
        // A working copy: checkpoints hold the state, so nothing here is anyone's data.
        drop(self.db.take());
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            tracing::warn!(dir = %self.dir.display(), error = %e, "could not delete a state store directory");
        }
    }
}

thread_local! {
    static PERF_COUNTERS_OFF: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Turns RocksDB's per-thread performance counters off on the calling thread, once. They are on
/// by default, and counting costs every read and write a lookup of the counters' thread-local
/// storage in the shared library: 7.5% of the task thread's time on the keyed count with a
/// cache of a tenth of the keys.
fn perf_counters_off() {
    PERF_COUNTERS_OFF.with(|off| {
        if !off.get() {
            rocksdb::perf::set_perf_stats(rocksdb::perf::PerfStatsLevel::Disable);
            off.set(true);
        }
    });
}

/// Deletes the store directories, full-image files, restored local copies and background
/// merges' scratch files that processes killed before they could delete theirs left under
/// `parent_dir` (named `<label>-<pid>-<n>`; a process that no longer exists). What a live
/// process (or one whose pid was reused) owns is left alone.
pub(crate) fn remove_stores_of_dead_processes(parent_dir: &Path) {
    let Ok(entries) = std::fs::read_dir(parent_dir) else { return };
    let me = std::process::id();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        let mut parts = name.rsplitn(3, '-');
        let (Some(n), Some(pid), Some(_label)) = (parts.next(), parts.next(), parts.next()) else { continue };
        let (Ok(_), Ok(pid)) = (n.parse::<u64>(), pid.parse::<u32>()) else { continue };
        if pid != me && !Path::new(&format!("/proc/{pid}")).exists() {
            // Stores are directories; full images and restored files are files.
            let removed = match entry.file_type() {
                Ok(t) if t.is_dir() => std::fs::remove_dir_all(entry.path()),
                _ => std::fs::remove_file(entry.path()),
            };
            match removed {
                Ok(()) => tracing::info!(dir = %entry.path().display(), "deleted the state store of a dead process"),
                Err(e) => {
                    tracing::warn!(dir = %entry.path().display(), error = %e, "could not delete a dead process's store")
                }
            }
        }
    }
}

/// The store's options, also those of the table files a restore writes.
pub(super) fn options() -> Options {
    let mut opts = Options::default();
    // Flushes, compactions and a restore's table files are synced as they are written: under a
    // cgroup v1 memory limit, dirty pages count against the limit until written back.
    opts.set_bytes_per_sync(weir_checkpoint::local::SYNC_EVERY_BYTES as u64);
    opts.create_if_missing(true);
    opts.set_compression_type(DBCompressionType::Lz4);
    opts.set_write_buffer_size(WRITE_BUFFER_BYTES);
    opts.set_max_write_buffer_number(2);
    let mut table = BlockBasedOptions::default();
    match Cache::new_lru_cache(BLOCK_CACHE_BYTES) {
        Ok(cache) => table.set_block_cache(&cache),
        Err(e) => tracing::warn!(error = %e, "no block cache for the state store"),
    }
    // Most reads of a cache miss are of keys the store has never seen (new keys): a bloom
    // filter answers those without reading a block.
    table.set_bloom_filter(10.0, false);
    opts.set_block_based_table_factory(&table);
    // The same for the memtables: without a filter, every miss walks the skiplists, which
    // took a third of the process's CPU time on a keyed count whose state was 10× the cache.
    opts.set_memtable_whole_key_filtering(true);
    opts.set_memtable_prefix_bloom_ratio(0.1);
    opts
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SIGKILLed process cannot delete its store: the next store opened in the same directory
    /// does, and leaves live processes' stores and anything not named like a store alone.
    #[test]
    fn opening_a_store_deletes_those_of_dead_processes_only() {
        let parent = tempfile::tempdir().unwrap();
        let dead = parent.path().join("counts-kg0-999999999-3");
        let live = parent.path().join(format!("counts-kg0-{}-99", std::process::id()));
        let other = parent.path().join("not-a-store");
        for d in [&dead, &live, &other] {
            std::fs::create_dir_all(d.join("sub")).unwrap();
        }
        let dead_copy = parent.path().join("restore-999999999-7");
        let live_image = parent.path().join(format!("full-image-{}-1", std::process::id()));
        for f in [&dead_copy, &live_image] {
            std::fs::write(f, b"state").unwrap();
        }
        let store = StateStore::open(parent.path(), "counts").unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while (dead.exists() || dead_copy.exists()) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(!dead.exists(), "the dead process's store is deleted");
        assert!(!dead_copy.exists(), "the dead process's restored copy is deleted");
        assert!(live.exists() && other.exists() && live_image.exists());
        let dir = store.dir.clone();
        drop(store);
        assert!(!dir.exists(), "a dropped store deletes its directory");
    }
}
