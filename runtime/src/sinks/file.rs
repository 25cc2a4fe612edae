//! The exactly-once file sink, by two-phase commit, whose published output is immutable.
//!
//! - **begin**: records of the open transaction are buffered as JSON lines;
//! - **pre-commit** on barrier N: the buffer is staged as
//!   `.part-<uid>-<epoch>-<N>-<subtask>.inprogress` (uploaded before the task acknowledges N)
//!   and its committable (sink URL, names, length, CRC-32C) goes into the snapshot;
//! - **commit** when checkpoint N completes, or a savepoint N that stops the job: every pending
//!   committable up to N is renamed to `part-<uid>-<epoch>-<N>-<subtask>.jsonl`; a commit whose
//!   staged file is gone but whose published file exists was already done (commit is
//!   idempotent). A savepoint that does not stop the job commits nothing: its transactions are
//!   committed by the next checkpoint, as in Flink since 1.15. Once every subtask committed
//!   N, the coordinator writes `_commits/<epoch>-<N>.json` listing the files with their
//!   lengths and checksums ([`CommitManifest`]), so a reader can take complete checkpoints
//!   only and verify them;
//! - **recovery** before a (re)start ([`recover`]): the committables in the restored state are
//!   committed (in the directory they were staged in, even if the job's `file.path` changed),
//!   staged files of older runs are discarded (they were never published), and manifests a
//!   crash left unwritten are written. When the restore point is older than output already
//!   published (a fallback past a corrupt checkpoint, an older savepoint restored on purpose),
//!   the files of later checkpoints are moved under `_superseded/<epoch>/` with a manifest of
//!   what moved and why: the job writes those records again, so the output keeps every record
//!   exactly once, and nothing is lost. A fresh start moves nothing.
//!
//! Published files are never deleted or rewritten. The epoch in every name means two runs
//! never write the same object. Files and directories whose names start with `.` or `_` are
//! not output.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use weir_checkpoint::epoch::Lineage;
use weir_checkpoint::{Storage, StorageError};

use crate::message::Barrier;
use crate::metrics::JobMetrics;
use crate::operator::{Operator, StagedWrite, StateParts, TaskError};
use crate::value::{write_json_line, Record};

/// Directory of commit manifests in a sink's output directory.
pub const COMMITS_DIR: &str = "_commits";
/// Directory that rewound output is moved to.
pub const SUPERSEDED_DIR: &str = "_superseded";

/// A pre-committed transaction.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Committable {
    /// URL of the output directory it was staged in.
    #[serde(default)]
    pub sink: String,
    /// The sink's uid.
    #[serde(default)]
    pub uid: String,
    /// Epoch of the run that staged it.
    #[serde(default)]
    pub epoch: u64,
    /// The checkpoint whose barrier closed it.
    pub checkpoint: u64,
    /// The subtask that wrote it.
    #[serde(default)]
    pub subtask: u32,
    /// Staged object name.
    pub staged: String,
    /// Final object name.
    pub published: String,
    /// Records in the transaction.
    #[serde(default)]
    pub records: u64,
    /// Bytes.
    #[serde(default)]
    pub len: u64,
    /// CRC-32C of the bytes.
    #[serde(default)]
    pub crc32c: u32,
}

#[derive(Serialize, Deserialize, Default)]
struct SinkState {
    pending: Vec<Committable>,
}

/// One file of a commit manifest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestFile {
    /// Published name, relative to the output directory.
    pub name: String,
    /// Bytes.
    pub len: u64,
    /// CRC-32C.
    pub crc32c: u32,
    /// Records (lines).
    pub records: u64,
}

/// `_commits/<epoch>-<N>.json`: everything sink `uid` published for checkpoint N.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommitManifest {
    /// The sink's uid.
    pub uid: String,
    /// Epoch of the run that staged the files.
    pub epoch: u64,
    /// The checkpoint.
    pub checkpoint: u64,
    /// The files, by name.
    pub files: Vec<ManifestFile>,
}

/// One file moved out of the output by a rewind.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MovedFile {
    /// Its name (in the output directory before, under `_superseded/<epoch>/` now).
    pub name: String,
    /// The checkpoint it was published for.
    pub checkpoint: u64,
    /// Bytes.
    pub len: u64,
}

/// `_superseded/<epoch>/_manifest-<uid>.json`: what a rewind moved, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SupersededManifest {
    /// The sink's uid.
    pub uid: String,
    /// Epoch of the run that restored and moved the files.
    pub epoch: u64,
    /// The checkpoint it restored (files of later checkpoints were moved).
    pub restored_checkpoint: u64,
    /// Why it restored that checkpoint.
    pub reason: String,
    /// The files moved out.
    pub moved: Vec<MovedFile>,
    /// Files of the restored history that an earlier rewind had moved out and that came back
    /// (`<from> -> <name>`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub returned: Vec<MovedFile>,
}

/// What a file name in a sink directory is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutputName {
    /// Staged (not yet published).
    pub staged: bool,
    /// Epoch of the run that wrote it.
    pub epoch: u64,
    /// Its checkpoint.
    pub checkpoint: u64,
    /// Its subtask.
    pub subtask: u32,
}

/// Staged name of a transaction.
pub fn staged_name(uid: &str, epoch: u64, checkpoint: u64, subtask: u32) -> String {
    format!(".part-{uid}-{epoch:06}-{checkpoint:010}-{subtask}.inprogress")
}

/// Published name of a transaction.
pub fn published_name(uid: &str, epoch: u64, checkpoint: u64, subtask: u32) -> String {
    format!("part-{uid}-{epoch:06}-{checkpoint:010}-{subtask}.jsonl")
}

/// Name of the commit manifest of checkpoint `checkpoint` staged in `epoch`.
pub fn commit_manifest_name(epoch: u64, checkpoint: u64) -> String {
    format!("{COMMITS_DIR}/{epoch:06}-{checkpoint:010}.json")
}

/// The epoch and checkpoint of a commit manifest's path ([`commit_manifest_name`]).
fn parse_commit_manifest_name(path: &str) -> Option<(u64, u64)> {
    let core = path.strip_prefix(COMMITS_DIR)?.strip_prefix('/')?.strip_suffix(".json")?;
    let (epoch, checkpoint) = core.split_once('-')?;
    Some((epoch.parse().ok()?, checkpoint.parse().ok()?))
}

/// Parses a staged or published name of sink `uid` strictly: the fields are read from the
/// right, so `part-out-2-...` is never taken for a file of uid `out`.
pub fn parse_name(uid: &str, name: &str) -> Option<OutputName> {
    let (staged, core) = if let Some(core) = name.strip_prefix(".part-").and_then(|r| r.strip_suffix(".inprogress")) {
        (true, core)
    } else {
        (false, name.strip_prefix("part-").and_then(|r| r.strip_suffix(".jsonl"))?)
    };
    let mut fields = core.rsplitn(4, '-');
    let (subtask, checkpoint, epoch, rest) = (fields.next()?, fields.next()?, fields.next()?, fields.next()?);
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if rest != uid
        || !digits(subtask)
        || checkpoint.len() != 10
        || !digits(checkpoint)
        || epoch.len() < 6
        || !digits(epoch)
    {
        return None;
    }
    Some(OutputName {
        staged,
        epoch: epoch.parse().ok()?,
        checkpoint: checkpoint.parse().ok()?,
        subtask: subtask.parse().ok()?,
    })
}

/// Why a sink could not be recovered.
#[derive(Debug, thiserror::Error)]
pub enum RecoveryError {
    /// The restored state of the sink is not a sink state document.
    #[error("sink `{uid}`: restored state unreadable: {reason}")]
    State {
        /// The sink.
        uid: String,
        /// Why.
        reason: String,
    },
    /// A pre-committed transaction could not be committed.
    #[error("sink `{uid}`: re-commit of checkpoint {checkpoint}: {source}")]
    Recommit {
        /// The sink.
        uid: String,
        /// Its checkpoint.
        checkpoint: u64,
        /// The storage error.
        #[source]
        source: StorageError,
    },
    /// The output directory could not be read or written.
    #[error("sink `{uid}`: {step}: {source}")]
    Storage {
        /// The sink.
        uid: String,
        /// Which step.
        step: &'static str,
        /// The storage error.
        #[source]
        source: StorageError,
    },
}

/// What [`recover`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Transactions committed now (the crash came between completion and commit).
    pub recommitted: usize,
    /// Staged files of older runs removed (never published).
    pub discarded_staged: usize,
    /// Published files moved under `_superseded/<epoch>/`.
    pub superseded: Vec<String>,
    /// Published files of the restored history moved back from `_superseded/`.
    pub returned: Vec<String>,
    /// Commit manifests written that a crash had left unwritten.
    pub manifests_repaired: usize,
}

/// Commits one transaction; `Ok(false)` when it was committed before.
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

/// Writes the commit manifest of one checkpoint of one sink unless it exists.
pub async fn write_commit_manifest(storage: &Storage, manifest: &CommitManifest) -> Result<(), StorageError> {
    let body = serde_json::to_vec_pretty(manifest).expect("manifest serializes");
    match storage.put_if_absent(&commit_manifest_name(manifest.epoch, manifest.checkpoint), Bytes::from(body)).await {
        Ok(()) | Err(StorageError::AlreadyExists(_)) => Ok(()),
        Err(e) => Err(e),
    }
}

/// What one commit manifest covers: a sink's (its directory's) checkpoint, staged in an epoch.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct CommitGroup {
    /// URL of the output directory.
    pub sink: String,
    /// The sink's uid.
    pub uid: String,
    /// Epoch of the run that staged it.
    pub epoch: u64,
    /// The checkpoint.
    pub checkpoint: u64,
}

impl Committable {
    /// The manifest this transaction belongs in.
    pub fn group(&self) -> CommitGroup {
        CommitGroup { sink: self.sink.clone(), uid: self.uid.clone(), epoch: self.epoch, checkpoint: self.checkpoint }
    }
}

impl CommitManifest {
    /// The manifest of `group`, listing the committed transactions `files` (of that group).
    pub fn of<'a>(group: &CommitGroup, files: impl IntoIterator<Item = &'a Committable>) -> CommitManifest {
        let mut files: Vec<ManifestFile> = files
            .into_iter()
            .map(|c| ManifestFile { name: c.published.clone(), len: c.len, crc32c: c.crc32c, records: c.records })
            .collect();
        files.sort_by(|a, b| a.name.cmp(&b.name));
        files.dedup_by(|a, b| a.name == b.name);
        CommitManifest { uid: group.uid.clone(), epoch: group.epoch, checkpoint: group.checkpoint, files }
    }
}

/// Which output a recovery shows: the output of the history that led to the restore point.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OutputHistory {
    /// A fresh start: nothing is moved.
    Fresh,
    /// The traced history of the restore point: output outside it (of checkpoints after the
    /// point, or of runs that an earlier rewind abandoned) is moved out, and output inside it
    /// that an earlier rewind moved out comes back. Output older than the history is kept.
    Lineage(Lineage),
    /// A restore point whose history is unknown (written before epochs existed, or from
    /// another job's storage): output of checkpoints after it is moved out.
    After(u64),
}

impl OutputHistory {
    /// Whether a published file belongs in the output; `None`: leave it where it is.
    fn wants(&self, f: &OutputName) -> Option<bool> {
        match self {
            OutputHistory::Fresh => None,
            OutputHistory::Lineage(l) => l.contains(f.epoch, f.checkpoint),
            OutputHistory::After(r) => Some(f.checkpoint <= *r),
        }
    }
}

/// What a recovery restores: the restore point's sink state documents and the history of its
/// output, why it was chosen, and the newest complete restore point of the job (of any
/// history), which bounds what staged data may still be needed.
#[derive(Clone, Copy, Debug)]
pub struct RecoveryInput<'a> {
    /// The sink state documents of the restore point (none for a fresh start).
    pub restored_docs: &'a [&'a [u8]],
    /// Which output the sink must show.
    pub history: &'a OutputHistory,
    /// The newest complete checkpoint or savepoint id of the job: staged data of checkpoints
    /// up to it may be pending in a restore point that a later start restores.
    pub newest_complete: u64,
    /// Why this restore point, for the superseded manifest.
    pub reason: &'a str,
}

/// Recovery of sink `uid` before a run of `epoch` starts its tasks:
/// 1. output outside the restored history moves under `_superseded/<epoch>/`, and output of
///    it that an earlier rewind moved there comes back;
/// 2. what the restored state pre-committed is committed, where it was staged;
/// 3. staged data no restore point can need is discarded, and commit manifests a crash left
///    unwritten are written.
pub async fn recover(
    storage: &Storage,
    uid: &str,
    epoch: u64,
    input: RecoveryInput<'_>,
) -> Result<RecoveryReport, RecoveryError> {
    let RecoveryInput { restored_docs, history, newest_complete, reason } = input;
    let fail = |step: &'static str| move |source| RecoveryError::Storage { uid: uid.to_string(), step, source };
    let mut report = RecoveryReport::default();
    let mut pending: Vec<Committable> = Vec::new();
    for doc in restored_docs {
        let state: SinkState = serde_json::from_slice(doc)
            .map_err(|e| RecoveryError::State { uid: uid.to_string(), reason: e.to_string() })?;
        pending.extend(state.pending);
    }
    // Every directory involved: the sink's, and those transactions were staged in.
    let mut dirs: BTreeMap<String, Storage> = BTreeMap::new();
    dirs.insert(storage.url().to_string(), storage.clone());
    for c in &pending {
        if !c.sink.is_empty() && !dirs.contains_key(&c.sink) {
            dirs.insert(
                c.sink.clone(),
                Storage::open(&c.sink).map_err(fail("opening the directory a transaction was staged in"))?,
            );
        }
    }
    for dir in dirs.values() {
        rewind(dir, uid, epoch, history, reason, &mut report)
            .await
            .map_err(|(step, source)| RecoveryError::Storage { uid: uid.to_string(), step, source })?;
    }
    for c in &pending {
        let target = if c.sink.is_empty() { storage } else { &dirs[&c.sink] };
        if commit(target, c).await.map_err(|source| RecoveryError::Recommit {
            uid: uid.to_string(),
            checkpoint: c.checkpoint,
            source,
        })? {
            report.recommitted += 1;
        }
    }
    for dir in dirs.values() {
        let names: Vec<String> =
            dir.list("").await.map_err(fail("listing the output"))?.into_iter().filter(|p| !p.contains('/')).collect();
        let mut published: BTreeMap<(u64, u64), Vec<String>> = BTreeMap::new();
        for name in &names {
            let Some(parsed) = parse_name(uid, name).filter(|p| p.epoch < epoch) else { continue };
            if parsed.staged {
                // Staged by an older run and not committed above. Garbage when no complete
                // restore point can list it as pending: its checkpoint never completed (it is
                // newer than every complete one), or it belongs to the restored history (it
                // would have been pending in the restore point, and committed above). Data
                // staged for a complete checkpoint of another history is kept: a later start
                // may restore that checkpoint and commit it.
                if parsed.checkpoint > newest_complete || history.wants(&parsed) == Some(true) {
                    dir.delete(name).await.map_err(fail("discarding staged files of older runs"))?;
                    report.discarded_staged += 1;
                }
            } else {
                published.entry((parsed.epoch, parsed.checkpoint)).or_default().push(name.clone());
            }
        }
        // Manifests a crash left unwritten (every subtask committed, the coordinator had not yet
        // written it): rebuilt from the published files themselves.
        let existing: BTreeSet<String> =
            dir.list(COMMITS_DIR).await.map_err(fail("listing commit manifests"))?.into_iter().collect();
        for ((e, n), files) in published {
            if existing.contains(&commit_manifest_name(e, n)) {
                continue;
            }
            let mut manifest = CommitManifest { uid: uid.to_string(), epoch: e, checkpoint: n, files: Vec::new() };
            for name in files {
                let data = dir.get(&name).await.map_err(fail("reading published output for its manifest"))?;
                let records = data.iter().filter(|b| **b == b'\n').count() as u64;
                manifest.files.push(ManifestFile {
                    name,
                    len: data.len() as u64,
                    crc32c: crc32c::crc32c(&data),
                    records,
                });
            }
            write_commit_manifest(dir, &manifest).await.map_err(fail("writing a commit manifest"))?;
            report.manifests_repaired += 1;
        }
    }
    Ok(report)
}

/// Moves output of `dir` outside `history` under `_superseded/<epoch>/` (with a manifest
/// written first, so a crash while moving leaves a record of every file meant to move), and
/// output of `history` that an earlier rewind moved out back in.
async fn rewind(
    dir: &Storage,
    uid: &str,
    epoch: u64,
    history: &OutputHistory,
    reason: &str,
    report: &mut RecoveryReport,
) -> Result<(), (&'static str, StorageError)> {
    let fail = |step: &'static str| move |source| (step, source);
    let all = dir.list("").await.map_err(fail("listing the output"))?;
    let names: BTreeSet<&str> = all.iter().filter(|p| !p.contains('/')).map(String::as_str).collect();
    let mut moving_out: Vec<(String, OutputName)> = Vec::new();
    for name in &names {
        if let Some(parsed) =
            parse_name(uid, name).filter(|p| !p.staged && p.epoch < epoch && history.wants(p) == Some(false))
        {
            moving_out.push((name.to_string(), parsed));
        }
    }
    let mut coming_back: Vec<(String, String, OutputName)> = Vec::new();
    for path in all.iter().filter(|p| p.starts_with(&format!("{SUPERSEDED_DIR}/"))) {
        let Some(name) = path.rsplit('/').next() else { continue };
        let Some(parsed) = parse_name(uid, name).filter(|p| !p.staged && p.epoch < epoch) else { continue };
        if history.wants(&parsed) == Some(true)
            && !names.contains(name)
            && !coming_back.iter().any(|(_, n, _)| n == name)
        {
            coming_back.push((path.clone(), name.to_string(), parsed));
        }
    }
    // Commit manifests of checkpoints outside the history go with their files. They are taken
    // from the listing, not from the files moving now: a recovery killed after it moved the
    // files and before it moved their manifests left manifests whose files are gone.
    let manifests_out: Vec<&String> = all
        .iter()
        .filter(|p| {
            parse_commit_manifest_name(p).is_some_and(|(e, n)| {
                let probe = OutputName { staged: false, epoch: e, checkpoint: n, subtask: 0 };
                e < epoch && history.wants(&probe) == Some(false)
            })
        })
        .collect();
    if moving_out.is_empty() && coming_back.is_empty() && manifests_out.is_empty() {
        return Ok(());
    }
    let moved_dir = format!("{SUPERSEDED_DIR}/{epoch:06}");
    let mut moved = Vec::new();
    for (name, parsed) in &moving_out {
        let len = dir.size(name).await.map_err(fail("reading superseded output"))?.unwrap_or(0);
        moved.push(MovedFile { name: name.clone(), checkpoint: parsed.checkpoint, len });
    }
    let returned = coming_back
        .iter()
        .map(|(from, name, parsed)| MovedFile {
            name: format!("{from} -> {name}"),
            checkpoint: parsed.checkpoint,
            len: 0,
        })
        .collect();
    let restored_checkpoint = match history {
        OutputHistory::Lineage(l) => l.segments.first().map_or(0, |s| s.1),
        OutputHistory::After(r) => *r,
        OutputHistory::Fresh => 0,
    };
    let manifest = SupersededManifest {
        uid: uid.to_string(),
        epoch,
        restored_checkpoint,
        reason: reason.to_string(),
        moved,
        returned,
    };
    let body = serde_json::to_vec_pretty(&manifest).expect("manifest serializes");
    dir.put(&format!("{moved_dir}/_manifest-{uid}.json"), Bytes::from(body))
        .await
        .map_err(fail("writing the superseded manifest"))?;
    for m in manifests_out {
        dir.rename(m, &format!("{moved_dir}/{m}")).await.map_err(fail("moving superseded commit manifests"))?;
    }
    for (name, _) in &moving_out {
        dir.rename(name, &format!("{moved_dir}/{name}")).await.map_err(fail("moving superseded output"))?;
        report.superseded.push(name.clone());
    }
    for (from, name, parsed) in &coming_back {
        dir.rename(from, name).await.map_err(fail("bringing output of the restored history back"))?;
        report.returned.push(name.clone());
        // Its commit manifest comes back too (or is rebuilt afterwards).
        let m = commit_manifest_name(parsed.epoch, parsed.checkpoint);
        let moved_manifest = format!("{}/{m}", from.rsplit_once('/').map_or("", |x| x.0));
        if dir.size(&m).await.map_err(fail("reading commit manifests"))?.is_none()
            && dir.size(&moved_manifest).await.map_err(fail("reading commit manifests"))?.is_some()
        {
            dir.rename(&moved_manifest, &m).await.map_err(fail("bringing commit manifests back"))?;
        }
    }
    Ok(())
}

/// One file sink subtask.
pub struct FileSink {
    uid: String,
    subtask: u32,
    epoch: u64,
    schema: Vec<String>,
    storage: Storage,
    buffer: Vec<u8>,
    buffered_records: u64,
    pending: Vec<Committable>,
    metrics: Arc<JobMetrics>,
}

impl FileSink {
    /// A sink subtask of a run of `epoch` writing to `storage` (the output directory).
    pub fn new(
        uid: &str,
        subtask: u32,
        epoch: u64,
        schema: Vec<String>,
        storage: Storage,
        metrics: Arc<JobMetrics>,
    ) -> Self {
        FileSink {
            uid: uid.to_string(),
            subtask,
            epoch,
            schema,
            storage,
            buffer: Vec::new(),
            buffered_records: 0,
            pending: Vec::new(),
            metrics,
        }
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
            let data = Bytes::from(std::mem::take(&mut self.buffer));
            let c = Committable {
                sink: self.storage.url().to_string(),
                uid: self.uid.clone(),
                epoch: self.epoch,
                checkpoint: barrier.id,
                subtask: self.subtask,
                staged: staged_name(&self.uid, self.epoch, barrier.id, self.subtask),
                published: published_name(&self.uid, self.epoch, barrier.id, self.subtask),
                records: self.buffered_records,
                len: data.len() as u64,
                crc32c: crc32c::crc32c(&data),
            };
            staged.push(StagedWrite { storage: self.storage.clone(), path: c.staged.clone(), data });
            self.pending.push(c);
            self.buffered_records = 0;
        }
        Ok(StateParts {
            operator_doc: Some(self.state_doc()),
            staged,
            pending_commits: self.pending.clone(),
            ..StateParts::default()
        })
    }

    fn on_checkpoint_complete(&mut self, id: u64) -> Result<Vec<Committable>, TaskError> {
        let due: Vec<Committable> = self.pending.iter().filter(|c| c.checkpoint <= id).cloned().collect();
        if due.is_empty() {
            return Ok(Vec::new());
        }
        let storage = self.storage.clone();
        crate::io().block_on(async {
            for c in &due {
                commit(&storage, c)
                    .await
                    .map_err(|e| TaskError::Commit { what: c.published.clone(), reason: e.to_string() })?;
            }
            Ok::<(), TaskError>(())
        })?;
        self.pending.retain(|c| c.checkpoint > id);
        self.metrics.records_out.inc_by(due.iter().map(|c| c.records).sum());
        Ok(due)
    }

    fn has_uncommitted(&self) -> bool {
        !self.pending.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn committable(s: &Storage, epoch: u64, checkpoint: u64, subtask: u32, data: &'static [u8]) -> Committable {
        Committable {
            sink: s.url().to_string(),
            uid: "o".into(),
            epoch,
            checkpoint,
            subtask,
            staged: staged_name("o", epoch, checkpoint, subtask),
            published: published_name("o", epoch, checkpoint, subtask),
            records: data.iter().filter(|b| **b == b'\n').count() as u64,
            len: data.len() as u64,
            crc32c: crc32c::crc32c(data),
        }
    }

    fn input<'a>(docs: &'a [&'a [u8]], history: &'a OutputHistory, newest_complete: u64) -> RecoveryInput<'a> {
        RecoveryInput { restored_docs: docs, history, newest_complete, reason: "test" }
    }

    fn doc(pending: &[Committable]) -> Vec<u8> {
        serde_json::to_vec(&SinkState { pending: pending.to_vec() }).unwrap()
    }

    #[test]
    fn names_parse_strictly() {
        let p = parse_name("out", &published_name("out", 3, 12, 7)).unwrap();
        assert_eq!(p, OutputName { staged: false, epoch: 3, checkpoint: 12, subtask: 7 });
        assert!(parse_name("out", &staged_name("out", 3, 12, 7)).unwrap().staged);
        assert_eq!(parse_name("out", &published_name("out-2", 3, 12, 7)), None, "uid out-2 is not out");
        assert_eq!(parse_name("out-2", &published_name("out", 3, 12, 7)), None);
        assert!(parse_name("out-2", &published_name("out-2", 3, 12, 7)).is_some());
        assert_eq!(parse_name("out", "part-out-0000000005-0.jsonl"), None, "the format before epochs");
        assert_eq!(parse_name("out", "part-out-000001-5-0.jsonl"), None, "checkpoint not 10 digits");
        assert_eq!(parse_name("out", "part-out-000001-0000000005-x.jsonl"), None);
        assert_eq!(parse_name("out", "part-out-000001-0000000005-0.json"), None);
    }

    #[tokio::test]
    async fn commit_is_idempotent_and_a_lost_transaction_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let s = Storage::open(dir.path().to_str().unwrap()).unwrap();
        let c = committable(&s, 1, 3, 0, b"{\"a\":1}\n");
        s.put(&c.staged, Bytes::from_static(b"{\"a\":1}\n")).await.unwrap();
        assert!(commit(&s, &c).await.unwrap());
        assert!(!commit(&s, &c).await.unwrap(), "second commit is a no-op");
        let lost = committable(&s, 1, 7, 0, b"");
        assert!(commit(&s, &lost).await.is_err(), "neither staged nor published: data lost, reported");
    }

    #[tokio::test]
    async fn recovery_recommits_discards_old_staged_files_and_keeps_everything_published() {
        let dir = tempfile::tempdir().unwrap();
        let s = Storage::open(dir.path().to_str().unwrap()).unwrap();
        // Epoch 1 published checkpoint 3, staged 4 (pending in the restored state) and 6 (not).
        let c3 = committable(&s, 1, 3, 0, b"a\n");
        s.put(&c3.published, Bytes::from_static(b"a\n")).await.unwrap();
        let c4 = committable(&s, 1, 4, 1, b"b\n");
        s.put(&c4.staged, Bytes::from_static(b"b\n")).await.unwrap();
        s.put(&staged_name("o", 1, 6, 0), Bytes::from_static(b"c\n")).await.unwrap();
        // Another sink's file, and a newer run's staged file: neither is touched.
        s.put(&published_name("o-2", 1, 9, 0), Bytes::from_static(b"z\n")).await.unwrap();
        s.put(&staged_name("o", 5, 9, 0), Bytes::from_static(b"y\n")).await.unwrap();
        let report =
            recover(&s, "o", 2, input(&[&doc(std::slice::from_ref(&c4))], &OutputHistory::After(4), 4)).await.unwrap();
        assert_eq!((report.recommitted, report.discarded_staged, report.superseded.len()), (1, 1, 0));
        assert_eq!(report.manifests_repaired, 2, "3 and 4 had no manifest yet");
        let left = s.list("").await.unwrap();
        for expected in [&c3.published, &c4.published, &published_name("o-2", 1, 9, 0), &staged_name("o", 5, 9, 0)] {
            assert!(left.contains(expected), "{expected} missing from {left:?}");
        }
        let m: CommitManifest = serde_json::from_slice(&s.get(&commit_manifest_name(1, 4)).await.unwrap()).unwrap();
        assert_eq!(
            m.files,
            vec![ManifestFile { name: c4.published.clone(), len: 2, crc32c: crc32c::crc32c(b"b\n"), records: 1 }]
        );
        // A fresh start (no restore point) moves nothing and deletes nothing published.
        let report = recover(&s, "o", 3, input(&[], &OutputHistory::Fresh, 4)).await.unwrap();
        assert!(report.superseded.is_empty());
        assert!(s.list("").await.unwrap().contains(&c3.published));
    }

    #[tokio::test]
    async fn a_rewind_moves_later_output_under_superseded_with_a_manifest() {
        let dir = tempfile::tempdir().unwrap();
        let s = Storage::open(dir.path().to_str().unwrap()).unwrap();
        for (n, data) in [(3u64, &b"a\n"[..]), (5, b"b\n"), (6, b"c\n")] {
            let c = committable(&s, 1, n, 0, b"");
            s.put(&c.published, Bytes::copy_from_slice(data)).await.unwrap();
            write_commit_manifest(&s, &CommitManifest { uid: "o".into(), epoch: 1, checkpoint: n, files: vec![] })
                .await
                .unwrap();
        }
        let report = recover(
            &s,
            "o",
            2,
            RecoveryInput { reason: "checkpoint 5 is corrupt", ..input(&[], &OutputHistory::After(4), 6) },
        )
        .await
        .unwrap();
        assert_eq!(report.superseded, vec![published_name("o", 1, 5, 0), published_name("o", 1, 6, 0)]);
        let left = s.list("").await.unwrap();
        assert!(left.contains(&published_name("o", 1, 3, 0)));
        assert!(left.contains(&format!("_superseded/000002/{}", published_name("o", 1, 5, 0))));
        assert!(left.contains(&format!("_superseded/000002/{}", commit_manifest_name(1, 6))));
        assert!(!left.contains(&commit_manifest_name(1, 5)));
        let m: SupersededManifest =
            serde_json::from_slice(&s.get("_superseded/000002/_manifest-o.json").await.unwrap()).unwrap();
        assert_eq!((m.restored_checkpoint, m.moved.len(), m.reason.as_str()), (4, 2, "checkpoint 5 is corrupt"));
        assert_eq!(
            &s.get(&format!("_superseded/000002/{}", published_name("o", 1, 6, 0))).await.unwrap()[..],
            b"c\n",
            "moved, not lost"
        );
    }

    /// A recovery killed after its rewind moved the files and before it moved their commit
    /// manifests left manifests listing files that are gone: the next recovery moves them too.
    #[tokio::test]
    async fn a_rewind_cut_short_before_the_manifests_moved_is_finished_by_the_next_recovery() {
        let dir = tempfile::tempdir().unwrap();
        let s = Storage::open(dir.path().to_str().unwrap()).unwrap();
        for n in [3u64, 5, 6] {
            let c = committable(&s, 1, n, 0, b"");
            s.put(&c.published, Bytes::from_static(b"x\n")).await.unwrap();
            write_commit_manifest(&s, &CommitManifest { uid: "o".into(), epoch: 1, checkpoint: n, files: vec![] })
                .await
                .unwrap();
        }
        // Epoch 2's rewind to checkpoint 4 moved the files of 5 and 6, then its process died.
        for n in [5u64, 6] {
            let name = published_name("o", 1, n, 0);
            s.rename(&name, &format!("_superseded/000002/{name}")).await.unwrap();
        }
        recover(&s, "o", 3, input(&[], &OutputHistory::After(4), 6)).await.unwrap();
        let left = s.list("").await.unwrap();
        assert!(left.contains(&commit_manifest_name(1, 3)), "{left:?}");
        for n in [5u64, 6] {
            assert!(!left.contains(&commit_manifest_name(1, n)), "{left:?}");
            assert!(left.contains(&format!("_superseded/000003/{}", commit_manifest_name(1, n))), "{left:?}");
            assert!(left.contains(&format!("_superseded/000002/{}", published_name("o", 1, n, 0))), "{left:?}");
        }
    }

    #[test]
    fn commit_manifest_names_parse_back() {
        assert_eq!(parse_commit_manifest_name(&commit_manifest_name(7, 1234)), Some((7, 1234)));
        assert_eq!(parse_commit_manifest_name("_commits/000007-0000001234.json#3"), None);
        assert_eq!(parse_commit_manifest_name("_superseded/000002/_commits/000007-0000001234.json"), None);
    }

    #[tokio::test]
    async fn a_transaction_is_committed_where_it_was_staged_after_the_path_changed() {
        let old_dir = tempfile::tempdir().unwrap();
        let new_dir = tempfile::tempdir().unwrap();
        let old = Storage::open(old_dir.path().to_str().unwrap()).unwrap();
        let new = Storage::open(new_dir.path().to_str().unwrap()).unwrap();
        let c = committable(&old, 1, 4, 0, b"x\n");
        old.put(&c.staged, Bytes::from_static(b"x\n")).await.unwrap();
        let report =
            recover(&new, "o", 2, input(&[&doc(std::slice::from_ref(&c))], &OutputHistory::After(4), 4)).await.unwrap();
        assert_eq!(report.recommitted, 1);
        assert_eq!(&old.get(&c.published).await.unwrap()[..], b"x\n");
    }

    /// Restoring an older savepoint moves later output out; restoring the newer savepoint
    /// afterwards brings the output of its history back and moves the rewound run's out, so
    /// the output is again exactly that history's (it used to be deleted for good).
    #[tokio::test]
    async fn a_rewind_can_be_undone_by_restoring_the_newer_point() {
        let dir = tempfile::tempdir().unwrap();
        let s = Storage::open(dir.path().to_str().unwrap()).unwrap();
        let put = |e: u64, n: u64| {
            let s = s.clone();
            async move { s.put(&published_name("o", e, n, 0), Bytes::from(format!("{e}-{n}\n"))).await.unwrap() }
        };
        // Epoch 1 published 3, 5 and 7; savepoints were taken at 4 (older) and 6 (newer).
        for n in [3, 5, 7] {
            put(1, n).await;
        }
        // Epoch 2 rewinds to 4: 5 and 7 move out; it publishes 8.
        let to_4 = Lineage { segments: vec![(1, 4)], floor: 1 };
        let r = recover(&s, "o", 2, input(&[], &OutputHistory::Lineage(to_4), 7)).await.unwrap();
        assert_eq!(r.superseded, vec![published_name("o", 1, 5, 0), published_name("o", 1, 7, 0)]);
        put(2, 8).await;
        // Epoch 3 restores the newer savepoint 6 of epoch 1: 5 comes back, 8 moves out, 7 stays out.
        let to_6 = Lineage { segments: vec![(1, 6)], floor: 1 };
        let r = recover(&s, "o", 3, input(&[], &OutputHistory::Lineage(to_6), 8)).await.unwrap();
        assert_eq!(r.returned, vec![published_name("o", 1, 5, 0)]);
        assert_eq!(r.superseded, vec![published_name("o", 2, 8, 0)]);
        let top: Vec<String> =
            s.list("").await.unwrap().into_iter().filter(|p| !p.contains('/') && is_output(p)).collect();
        assert_eq!(top, vec![published_name("o", 1, 3, 0), published_name("o", 1, 5, 0)]);
        // Output older than the history (before a fresh start) is never touched.
        put(1, 1).await;
        let fresh_history = Lineage { segments: vec![(3, 9)], floor: 3 };
        let r = recover(&s, "o", 4, input(&[], &OutputHistory::Lineage(fresh_history), 9)).await.unwrap();
        assert!(r.superseded.is_empty() && r.returned.is_empty(), "{r:?}");
    }

    fn is_output(name: &str) -> bool {
        !name.starts_with('.') && !name.starts_with('_')
    }

    /// The sink's transactions against a model: records written, barriers, checkpoint
    /// completions with or without the commit that follows (a crash in between), crashes
    /// restored from the newest complete checkpoint and rewinds to older ones, each run with
    /// its own epoch claimed as the engine claims it. After a last checkpoint, the published
    /// output must hold every record of the final history exactly once, and every file ever
    /// published must still exist, in place or under `_superseded/`.
    mod model {
        use proptest::prelude::*;
        use weir_checkpoint::epoch::{self, RestoredFrom};

        use super::*;
        use crate::value::Value;

        #[derive(Clone, Debug)]
        enum Op {
            Write(u64),
            Barrier,
            /// Complete the oldest barrier in flight; commit it unless `false` (a crash before
            /// the commit, which the next op will usually be).
            Complete(bool),
            Crash,
            /// Restore the n-th newest complete checkpoint (a rewind when n > 0).
            Rewind(usize),
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                6 => (1u64..20).prop_map(Op::Write),
                3 => Just(Op::Barrier),
                3 => any::<bool>().prop_map(Op::Complete),
                1 => Just(Op::Crash),
                1 => (0usize..3).prop_map(Op::Rewind),
            ]
        }

        /// A complete checkpoint: its id, the epoch that wrote it, the sink's state document
        /// and how many records came before its barrier.
        #[derive(Clone)]
        struct Point {
            id: u64,
            epoch: u64,
            doc: Vec<u8>,
            position: u64,
        }

        struct Run {
            sink: FileSink,
            epoch: u64,
            position: u64,
            in_flight: Vec<Point>,
        }

        fn start(out: &Storage, job: &Storage, from: Option<&Point>, newest_complete: u64) -> Run {
            let restored = from.map(|p| RestoredFrom { id: p.id, epoch: p.epoch });
            crate::io().block_on(async {
                let history = match restored {
                    None => OutputHistory::Fresh,
                    Some(r) => OutputHistory::Lineage(epoch::lineage(job, r).await.unwrap().unwrap()),
                };
                let e = epoch::claim_started(job, "test", restored).await.unwrap();
                let docs: Vec<&[u8]> = from.map(|p| vec![p.doc.as_slice()]).unwrap_or_default();
                recover(
                    out,
                    "o",
                    e,
                    RecoveryInput { restored_docs: &docs, history: &history, newest_complete, reason: "test" },
                )
                .await
                .unwrap();
                let metrics = Arc::new(JobMetrics::new("j", "t"));
                Run {
                    sink: FileSink::new("o", 0, e, vec!["id".into()], out.clone(), metrics),
                    epoch: e,
                    position: from.map_or(0, |p| p.position),
                    in_flight: Vec::new(),
                }
            })
        }

        fn published(out: &Storage) -> BTreeMap<String, Vec<u8>> {
            crate::io().block_on(async {
                let mut files = BTreeMap::new();
                for path in out.list("").await.unwrap() {
                    let name = path.rsplit('/').next().unwrap();
                    if name.starts_with("part-") {
                        let top = !path.contains('/');
                        files.insert(
                            format!("{}{name}", if top { "" } else { "moved:" }),
                            out.get(&path).await.unwrap().to_vec(),
                        );
                    }
                }
                files
            })
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

            #[test]
            fn output_is_the_final_history_exactly_once(ops in proptest::collection::vec(op(), 1..60)) {
                let dir = tempfile::tempdir().unwrap();
                let out = Storage::open(dir.path().join("out").to_str().unwrap()).unwrap();
                let job = Storage::open("memory://").unwrap();
                let mut complete: Vec<Point> = Vec::new();
                let mut next_id = 1u64;
                let mut run = start(&out, &job, None, 0);
                let mut ever: BTreeMap<String, Vec<u8>> = BTreeMap::new();
                let stage = |sink: &mut FileSink, id: u64| -> Vec<u8> {
                    let parts =
                        sink.snapshot(&Barrier { id, target: crate::message::SnapshotTarget::Checkpoint }).unwrap();
                    crate::io().block_on(async {
                        for w in &parts.staged {
                            w.storage.put(&w.path, w.data.clone()).await.unwrap();
                        }
                    });
                    parts.operator_doc.unwrap()
                };
                for op in ops {
                    match op {
                        Op::Write(n) => {
                            let batch: Vec<Record> = (run.position..run.position + n)
                                .map(|i| Record { time: 0, fields: smallvec::smallvec![Value::Int(i as i64)] })
                                .collect();
                            run.position += n;
                            run.sink.process(batch, &mut Vec::new()).unwrap();
                        }
                        Op::Barrier => {
                            let doc = stage(&mut run.sink, next_id);
                            run.in_flight.push(Point { id: next_id, epoch: run.epoch, doc, position: run.position });
                            next_id += 1;
                        }
                        Op::Complete(commit) => {
                            if !run.in_flight.is_empty() {
                                let p = run.in_flight.remove(0);
                                let id = p.id;
                                complete.push(p);
                                if commit {
                                    run.sink.on_checkpoint_complete(id).unwrap();
                                }
                            }
                        }
                        Op::Crash | Op::Rewind(_) => {
                            let back = if let Op::Rewind(n) = op { n } else { 0 };
                            // Never older than the oldest complete checkpoint: a start without
                            // state on top of published output is `--fresh`, another test.
                            let i = complete
                                .len()
                                .checked_sub(1 + back)
                                .or(if complete.is_empty() { None } else { Some(0) });
                            let from = i.map(|i| complete[i].clone());
                            run = start(&out, &job, from.as_ref(), complete.last().map_or(0, |p| p.id));
                        }
                    }
                    // Nothing published is ever lost or changed: at most moved.
                    let now = published(&out);
                    for (name, bytes) in &ever {
                        let plain = name.trim_start_matches("moved:");
                        let kept =
                            [plain.to_string(), format!("moved:{plain}")].iter().any(|n| now.get(n) == Some(bytes));
                        prop_assert!(kept, "{} lost or changed", plain);
                    }
                    for (name, bytes) in now {
                        ever.insert(name.trim_start_matches("moved:").to_string(), bytes);
                    }
                }
                // A last checkpoint, committed.
                stage(&mut run.sink, next_id);
                run.sink.on_checkpoint_complete(next_id).unwrap();
                let mut ids: Vec<i64> = Vec::new();
                for (name, bytes) in published(&out) {
                    if name.starts_with("moved:") {
                        continue;
                    }
                    for line in String::from_utf8(bytes).unwrap().lines() {
                        let v: serde_json::Value = serde_json::from_str(line).unwrap();
                        ids.push(v["id"].as_i64().unwrap());
                    }
                }
                ids.sort_unstable();
                let want: Vec<i64> = (0..run.position as i64).collect();
                prop_assert_eq!(ids, want);
            }
        }
    }
}
