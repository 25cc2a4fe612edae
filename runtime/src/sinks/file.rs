//! The exactly-once file sink, by two-phase commit.
//!
//! - **begin**: records of the open transaction are buffered as JSON lines;
//! - **pre-commit** on barrier N: the buffer is staged as `.part-<uid>-<N>-<subtask>.inprogress`
//!   (uploaded before the task acknowledges N) and the committable goes into the snapshot;
//! - **commit** when N completes: every pending committable up to N is renamed to
//!   `part-<uid>-<N>-<subtask>.jsonl`; a commit whose staged file is gone but whose final file
//!   exists was already done (commit is idempotent);
//! - **recovery** before a (re)start from checkpoint R: the committables in R's state are
//!   committed, staged files of this sink are deleted, and files this sink committed for
//!   checkpoints after R are deleted too: they belong to a run that was rolled back (for
//!   instance when the newest checkpoint was corrupt and R is an older one), and keeping them
//!   would duplicate what the restarted job writes again.
//!
//! Committed files are the only files in the directory whose names start with neither `_`
//! nor `.`.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use weir_checkpoint::{Storage, StorageError};

use crate::message::Barrier;
use crate::metrics::JobMetrics;
use crate::operator::{Operator, StagedWrite, StateParts, TaskError};
use crate::value::{write_json_line, Record};

/// A pre-committed transaction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Committable {
    /// The checkpoint whose barrier closed it.
    pub checkpoint: u64,
    /// Staged object name.
    pub staged: String,
    /// Final object name.
    pub published: String,
    /// Records in the transaction.
    #[serde(default)]
    pub records: u64,
}

#[derive(Serialize, Deserialize, Default)]
struct SinkState {
    pending: Vec<Committable>,
}

/// Staged name of a transaction.
pub fn staged_name(uid: &str, checkpoint: u64, subtask: u32) -> String {
    format!(".part-{uid}-{checkpoint:010}-{subtask}.inprogress")
}

/// Published name of a transaction.
pub fn published_name(uid: &str, checkpoint: u64, subtask: u32) -> String {
    format!("part-{uid}-{checkpoint:010}-{subtask}.jsonl")
}

/// The checkpoint id of a published file of sink `uid`, if `name` is one.
pub fn parse_published(uid: &str, name: &str) -> Option<u64> {
    let rest = name.strip_prefix("part-")?.strip_prefix(uid)?.strip_prefix('-')?;
    let rest = rest.strip_suffix(".jsonl")?;
    let (chk, subtask) = rest.split_once('-')?;
    if chk.len() != 10 || !chk.bytes().all(|b| b.is_ascii_digit()) || subtask.is_empty() || !subtask.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    chk.parse().ok()
}

fn is_staged_of(uid: &str, name: &str) -> bool {
    name.strip_prefix(".part-").and_then(|r| r.strip_prefix(uid)).is_some_and(|r| r.starts_with('-')) && name.ends_with(".inprogress")
}

/// One file sink subtask.
pub struct FileSink {
    uid: String,
    subtask: u32,
    schema: Vec<String>,
    storage: Storage,
    buffer: Vec<u8>,
    buffered_records: u64,
    pending: Vec<Committable>,
    metrics: Arc<JobMetrics>,
}

impl FileSink {
    /// A sink subtask writing to `storage` (the output directory).
    pub fn new(uid: &str, subtask: u32, schema: Vec<String>, storage: Storage, metrics: Arc<JobMetrics>) -> Self {
        FileSink { uid: uid.to_string(), subtask, schema, storage, buffer: Vec::new(), buffered_records: 0, pending: Vec::new(), metrics }
    }

    /// Commits one transaction; succeeds when it was committed before.
    pub async fn commit(storage: &Storage, c: &Committable) -> Result<bool, StorageError> {
        match storage.rename(&c.staged, &c.published).await {
            Ok(()) => Ok(true),
            Err(StorageError::NotFound(_)) => match storage.size(&c.published).await? {
                Some(_) => Ok(false),
                None => Err(StorageError::NotFound(format!("{} (and {} was never published)", c.staged, c.published))),
            },
            Err(e) => Err(e),
        }
    }

    /// Recovery before tasks start: re-commit what the restored state holds, delete staged
    /// leftovers and files of rolled-back checkpoints. Returns (re-committed, deleted).
    pub async fn recover(storage: &Storage, uid: &str, restored_docs: &[&[u8]], restored_checkpoint: Option<u64>) -> Result<(usize, usize), String> {
        let mut recommitted = 0;
        for doc in restored_docs {
            let state: SinkState = serde_json::from_slice(doc).map_err(|e| format!("sink `{uid}` state unreadable: {e}"))?;
            for c in &state.pending {
                if Self::commit(storage, c).await.map_err(|e| format!("sink `{uid}`: re-commit of checkpoint {}: {e}", c.checkpoint))? {
                    recommitted += 1;
                }
            }
        }
        let mut deleted = 0;
        for path in storage.list("").await.map_err(|e| e.to_string())? {
            if path.contains('/') {
                continue;
            }
            let stale_staged = is_staged_of(uid, &path);
            let rolled_back = parse_published(uid, &path).is_some_and(|chk| restored_checkpoint.is_none_or(|r| chk > r));
            if stale_staged || rolled_back {
                storage.delete(&path).await.map_err(|e| e.to_string())?;
                deleted += 1;
            }
        }
        Ok((recommitted, deleted))
    }

    fn state_doc(&self) -> Vec<u8> {
        serde_json::to_vec(&SinkState { pending: self.pending.clone() }).expect("sink state serializes")
    }
}

impl Operator for FileSink {
    fn process(&mut self, batch: Vec<Record>, _out: &mut Vec<Record>) -> Result<(), TaskError> {
        for r in &batch {
            write_json_line(&self.schema, r, &mut self.buffer);
        }
        self.buffered_records += batch.len() as u64;
        Ok(())
    }

    fn snapshot(&mut self, barrier: &Barrier) -> Result<StateParts, TaskError> {
        let mut staged = Vec::new();
        if !self.buffer.is_empty() {
            let c = Committable {
                checkpoint: barrier.id,
                staged: staged_name(&self.uid, barrier.id, self.subtask),
                published: published_name(&self.uid, barrier.id, self.subtask),
                records: self.buffered_records,
            };
            let data = Bytes::from(std::mem::take(&mut self.buffer));
            staged.push(StagedWrite { storage: self.storage.clone(), path: c.staged.clone(), data });
            self.pending.push(c);
            self.buffered_records = 0;
        }
        Ok(StateParts { operator_doc: Some(self.state_doc()), staged, ..StateParts::default() })
    }

    fn on_checkpoint_complete(&mut self, id: u64) -> Result<(), TaskError> {
        let due: Vec<Committable> = self.pending.iter().filter(|c| c.checkpoint <= id).cloned().collect();
        if due.is_empty() {
            return Ok(());
        }
        let storage = self.storage.clone();
        crate::io().block_on(async {
            for c in &due {
                Self::commit(&storage, c).await.map_err(|e| TaskError::Commit { what: c.published.clone(), reason: e.to_string() })?;
            }
            Ok::<(), TaskError>(())
        })?;
        self.pending.retain(|c| c.checkpoint > id);
        self.metrics.records_out.fetch_add(due.iter().map(|c| c.records).sum(), Ordering::Relaxed);
        Ok(())
    }

    fn has_uncommitted(&self) -> bool {
        !self.pending.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_strictly() {
        assert_eq!(parse_published("out", &published_name("out", 12, 3)), Some(12));
        assert_eq!(parse_published("out", &published_name("out-2", 12, 3)), None);
        assert_eq!(parse_published("out", "part-out-1-0000000005-0.jsonl"), None);
        assert!(is_staged_of("out", &staged_name("out", 1, 0)));
        assert!(!is_staged_of("out", &staged_name("outer", 1, 0)));
    }

    #[tokio::test]
    async fn commit_is_idempotent_and_recovery_rolls_back_later_files() {
        let dir = tempfile::tempdir().unwrap();
        let s = Storage::open(dir.path().to_str().unwrap()).unwrap();
        let c3 = Committable { checkpoint: 3, staged: staged_name("o", 3, 0), published: published_name("o", 3, 0), records: 1 };
        s.put(&c3.staged, Bytes::from_static(b"{\"a\":1}\n")).await.unwrap();
        assert!(FileSink::commit(&s, &c3).await.unwrap());
        assert!(!FileSink::commit(&s, &c3).await.unwrap(), "second commit is a no-op");
        // A later checkpoint's published file, a stray staged file, another sink's file.
        s.put(&published_name("o", 5, 1), Bytes::from_static(b"x\n")).await.unwrap();
        s.put(&staged_name("o", 6, 0), Bytes::from_static(b"y\n")).await.unwrap();
        s.put(&published_name("other", 9, 0), Bytes::from_static(b"z\n")).await.unwrap();
        let c4 = Committable { checkpoint: 4, staged: staged_name("o", 4, 1), published: published_name("o", 4, 1), records: 1 };
        s.put(&c4.staged, Bytes::from_static(b"w\n")).await.unwrap();
        let doc = serde_json::to_vec(&SinkState { pending: vec![c4.clone()] }).unwrap();
        let (recommitted, deleted) = FileSink::recover(&s, "o", &[&doc], Some(4)).await.unwrap();
        assert_eq!((recommitted, deleted), (1, 2));
        let mut left = s.list("").await.unwrap();
        left.sort();
        assert_eq!(left, vec![published_name("o", 3, 0), published_name("o", 4, 1), published_name("other", 9, 0)]);
        let lost = Committable { checkpoint: 7, staged: staged_name("o", 7, 0), published: published_name("o", 7, 0), records: 0 };
        assert!(FileSink::commit(&s, &lost).await.is_err(), "neither staged nor published: data lost, reported");
    }
}
