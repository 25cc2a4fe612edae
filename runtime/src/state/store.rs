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
//!
//! RocksDB is linked from the system (Debian's `librocksdb-dev`) and only with the `rocksdb`
//! feature (a default one): a runtime built without it has no store, and a job asking for
//! `stateBackend: rocksdb` is refused before it starts (`JobError::MissingFeature`).

use std::path::{Path, PathBuf};

use weir_checkpoint::format::{Encoder, FormatError};

use crate::value::StateKey;

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
    /// The store could not be opened.
    #[error("opening the state store at {dir}: {source}")]
    Open {
        /// The directory.
        dir: String,
        /// RocksDB's error.
        source: EngineError,
    },
    /// A read failed.
    #[error("reading the state store: {0}")]
    Read(EngineError),
    /// A write failed.
    #[error("writing the state store: {0}")]
    Write(EngineError),
    /// A scan of every entry failed.
    #[error("scanning the state store: {0}")]
    Scan(EngineError),
    /// A full image could not be written to local disk.
    #[error("writing a full image to local disk: {0}")]
    SpillImage(std::io::Error),
    /// A restore's sorted runs could not be written to or read from local disk.
    #[error("bulk-loading restored state through local disk: {0}")]
    BulkLoad(std::io::Error),
    /// A restore could not start the thread that decodes a state file.
    #[error("starting a restore's decoding thread: {0}")]
    RestoreThread(std::io::Error),
    /// A restore's table file could not be written.
    #[error("writing a table file of restored state: {0}")]
    WriteTable(EngineError),
    /// A checkpoint's table file could not be linked or copied into the store's directory.
    #[error("linking a checkpoint's table file into the state store: {0}")]
    TakeTable(std::io::Error),
    /// The store refused a restore's table files.
    #[error("loading restored table files into the state store: {0}")]
    Ingest(EngineError),
    /// A lazy restore could not bring a range of keys into the store (its table file and the
    /// full image it stands for both failed): the task fails, and the job restarts from a
    /// restore point.
    #[error("restoring state in the background: {0}")]
    LazyRestore(String),
    /// This runtime was built without the `rocksdb` feature (`cargo build
    /// --no-default-features` leaves it out).
    #[error("this runtime was built without the rocksdb state backend; no state store under {dir}")]
    NotBuiltIn {
        /// Where the store would have gone.
        dir: String,
    },
    /// An entry could not be decoded (the store holds only what this process wrote, so this is
    /// a corrupted local disk).
    #[error("decoding an entry of the state store: {0}")]
    Decode(#[from] FormatError),
    /// State holding its keys as integers did not finish moving to keys of any value when a
    /// key of another value came (`crate::operators::keyed::IntKeysWhileIntegers`).
    #[error("holding keys of any value instead of integers: {0}")]
    MoveKeys(&'static str),
}

/// Settings of the `rocksdb` backend for one subtask's keyed state.
#[derive(Clone, Debug)]
pub struct StoreSettings {
    /// Where the store's directory goes (a fresh directory is made under it).
    pub parent_dir: PathBuf,
    /// How many entries the in-memory cache in front of the store holds.
    pub cache_entries: usize,
    /// Counts the job's stores while a lazy restore loads into them (the job holds its
    /// checkpoints until none does).
    pub restores_loading: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

#[cfg(not(feature = "rocksdb"))]
mod absent;
#[cfg(feature = "rocksdb")]
mod rocks;

#[cfg(not(feature = "rocksdb"))]
pub use absent::{EngineError, StateStore, StoredValue, WriteBatch};
#[cfg(feature = "rocksdb")]
pub(crate) use rocks::options;
#[cfg(feature = "rocksdb")]
pub use rocks::{EngineError, StateStore, StoredValue, WriteBatch};

impl StateStore {
    /// The store key of `key` in `key_group`, appended to `out`.
    pub fn encode_key<K: StateKey>(key_group: u32, key: &K, out: &mut Vec<u8>) {
        let mut e = Encoder { buf: std::mem::take(out) };
        e.buf.extend_from_slice(&(key_group as u16).to_be_bytes());
        key.encode(&mut e);
        *out = e.buf;
    }

    /// The store key of `key` in `key_group`.
    pub fn key_of<K: StateKey>(key_group: u32, key: &K) -> Vec<u8> {
        let mut raw = Vec::with_capacity(16);
        Self::encode_key(key_group, key, &mut raw);
        raw
    }

    /// The store key of an already encoded key (as a state file holds it); tests compare
    /// state files with stores by it.
    #[cfg(test)]
    pub(crate) fn key_of_encoded(key_group: u32, encoded: &[u8]) -> Vec<u8> {
        let mut raw = Vec::with_capacity(2 + encoded.len());
        Self::encoded_key(key_group, encoded, &mut raw);
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

#[cfg(feature = "rocksdb")]
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
        let dir = store.dir().to_path_buf();
        drop(store);
        assert!(!dir.exists(), "a dropped store deletes its directory");
    }
}
