//! Which checkpoints and shared files to delete: a pure plan, and the I/O that carries it out.
//!
//! Keep the newest `retained` complete checkpoints of the job's history (so the newest is never
//! deleted; a checkpoint a superseded run published outside the history counts as corrupt,
//! [`mark_outside_history`], so it never displaces one a restore could take), and also
//! the newest complete checkpoint that shares no keyed-state file with the newest one: the
//! kept checkpoints of one incremental chain all build on one full image, and if that file is
//! damaged, recovery needs a checkpoint outside the chain to fall back to. Delete older
//! directories (complete, incomplete or corrupt); delete shared files that no kept checkpoint
//! references, but only those created by a checkpoint no newer than the newest complete one
//! (newer files may belong to checkpoints still in flight) and by this run's epoch or an
//! older one (a newer epoch's files belong to the run that replaced this one). Files a
//! background merge wrote and no complete checkpoint lists yet ([`PendingFiles`]) are never
//! deleted.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use crate::layout;
use crate::metadata::{CheckpointMetadata, MetadataError};
use crate::store::{Storage, StorageError};

/// A checkpoint directory as found in storage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoundCheckpoint {
    /// Its id.
    pub id: u64,
    /// Resolved paths (relative to the job root) of every file its valid metadata references;
    /// `None` when it has no readable metadata (in progress, aborted or corrupt).
    pub references: Option<BTreeSet<String>>,
    /// The epoch of the run that wrote its metadata (0 when it has none, or predates epochs).
    pub epoch: u64,
    /// Its metadata is of a format newer than this Weir reads (written before a downgrade):
    /// neither it nor any shared file it could list is deleted, for the newer Weir to read.
    pub newer_format: bool,
}

/// Shared files this run wrote ahead of the checkpoint that will list them: a background merge
/// uploads its image (and table files) under their final names, and a later checkpoint adopts
/// them. Until a complete checkpoint lists a file, retention must not take it for an
/// unreferenced one. The merger adds a file before it uploads it and removes the files it
/// deletes; retention stops protecting a file once a complete checkpoint lists it (from then on
/// it is kept or deleted like any shared file), or once the uploader has stopped listing it
/// ([`PendingFiles::dropped`]) and every checkpoint that could list it is over.
#[derive(Clone, Debug, Default)]
pub struct PendingFiles(Arc<Mutex<BTreeMap<String, Option<u64>>>>);

impl PendingFiles {
    /// Protects `path` (relative to the job root); call before uploading it.
    pub fn add(&self, path: &str) {
        self.lock().insert(path.to_string(), None);
    }

    /// Stops protecting `path` (it was deleted).
    pub fn remove(&self, path: &str) {
        self.lock().remove(path);
    }

    /// The uploader's chain no longer lists `path` from checkpoint `from` on (a full image or a
    /// newer merge replaced it): once no checkpoint before `from` is in flight, nothing can list
    /// it any more. A path that is not pending is left as it is.
    pub fn dropped(&self, path: &str, from: u64) {
        if let Some(at) = self.lock().get_mut(path) {
            *at = Some(from);
        }
    }

    /// Stops protecting every file: for a new run, once no retention pass of the last one is
    /// running. Its files that no complete checkpoint lists will never be listed (its
    /// checkpoints are over), and retention deletes them like any unlisted file.
    pub fn clear(&self) {
        self.lock().clear();
    }

    /// The files protected now.
    pub fn snapshot(&self) -> BTreeSet<String> {
        self.lock().keys().cloned().collect()
    }

    /// Stops protecting the files that complete checkpoints list, and those dropped from
    /// checkpoint `from` on when no checkpoint below `in_flight_from` is in flight any more.
    fn settle(&self, found: &[FoundCheckpoint], in_flight_from: u64) {
        self.lock().retain(|p, dropped| {
            let listed = found.iter().any(|c| c.references.as_ref().is_some_and(|r| r.contains(p)));
            !listed && (*dropped).is_none_or(|from| from > in_flight_from)
        });
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Option<u64>>> {
        // A panic while holding the lock left a map of strings: still the right one.
        self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// What to delete.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RetentionPlan {
    /// Checkpoint ids whose directories go.
    pub delete_checkpoints: Vec<u64>,
    /// Shared files (relative to the job root) that go.
    pub delete_shared: Vec<String>,
}

/// Plans retention. `in_flight_from`: ids at or above it may still be written and are never
/// touched; `epoch`: the epoch of the run applying it (files of newer epochs are never
/// touched); `pending`: shared files never to delete (see [`PendingFiles`]).
pub fn plan(
    found: &[FoundCheckpoint],
    shared_files: &[String],
    retained: usize,
    in_flight_from: u64,
    epoch: u64,
    pending: &BTreeSet<String>,
) -> RetentionPlan {
    let mut complete: Vec<&FoundCheckpoint> = found.iter().filter(|c| c.references.is_some()).collect();
    complete.sort_by_key(|c| std::cmp::Reverse(c.id));
    let mut kept: Vec<&FoundCheckpoint> = complete.iter().take(retained.max(1)).copied().collect();
    let Some(&newest) = kept.first() else { return RetentionPlan::default() };
    let shared_prefix = format!("{}/{}/", layout::CHECKPOINTS, layout::SHARED);
    let newest_shared: BTreeSet<&String> =
        newest.references.iter().flatten().filter(|f| f.starts_with(&shared_prefix)).collect();
    let independent = |c: &FoundCheckpoint| c.references.iter().flatten().all(|f| !newest_shared.contains(f));
    // A newest checkpoint without keyed-state files shares no base with any other.
    if !newest_shared.is_empty() && !kept[1..].iter().any(|c| independent(c)) {
        if let Some(fallback) = complete.iter().skip(1).find(|c| independent(c)) {
            kept.push(fallback);
        }
    }
    kept.sort_by_key(|c| std::cmp::Reverse(c.id));
    let oldest_kept = kept.last().map_or(newest.id, |c| c.id);
    let newest_complete = newest.id;
    let kept_ids: BTreeSet<u64> = kept.iter().map(|c| c.id).collect();
    // Shared files a checkpoint of a newer format could list: those created at or before it.
    let newer_format_up_to = found.iter().filter(|c| c.newer_format).map(|c| c.id).max();
    let delete_checkpoints: Vec<u64> = found
        .iter()
        .filter(|c| {
            !kept_ids.contains(&c.id)
                && !c.newer_format
                && c.id < in_flight_from
                // Complete ones only below the oldest kept: those between a fallback and the
                // newest `retained` are the next fallbacks (once the newest chain no longer
                // shares their files), so deleting them would pin the fallback to an ever
                // older checkpoint. Incomplete and corrupt ones below the newest complete go.
                && (c.id < oldest_kept || (c.references.is_none() && c.id < newest_complete))
        })
        .map(|c| c.id)
        .collect();
    // The files of every checkpoint that stays, kept or not: one between a fallback and the
    // newest `retained` is a next fallback, and without its files it is none. (Only the kept
    // ones' files stayed before: the chaos campaign, seed 535290, damaged the one file the
    // retained checkpoints shared, and every older checkpoint listed files already deleted.)
    let deleted: BTreeSet<u64> = delete_checkpoints.iter().copied().collect();
    let referenced: BTreeSet<&String> = complete
        .iter()
        .filter(|c| !deleted.contains(&c.id))
        .flat_map(|c| c.references.as_ref().into_iter().flatten())
        .collect();
    let delete_shared = shared_files
        .iter()
        .filter(|f| !referenced.contains(f) && !pending.contains(*f))
        .filter(|f| {
            let name = f.rsplit('/').next().unwrap_or("");
            let unreferenced_file = layout::shared_file_creator(name).is_some_and(|creator| {
                creator <= newest_complete
                    && creator < in_flight_from
                    && newer_format_up_to.is_none_or(|newer| creator > newer)
            }) && layout::shared_file_epoch(name).is_some_and(|e| e <= epoch);
            // A merge staged by an earlier run of an older Weir (which renamed merges when it
            // adopted them) was never adopted: its run is gone or fenced.
            let abandoned_merge = layout::staged_merge_epoch(name).is_some_and(|e| e < epoch);
            unreferenced_file || abandoned_merge
        })
        .cloned()
        .collect();
    RetentionPlan { delete_checkpoints, delete_shared }
}

/// Reads the checkpoint directories of a job root.
pub async fn scan(storage: &Storage) -> Result<Vec<FoundCheckpoint>, StorageError> {
    let mut out = Vec::new();
    for name in storage.list_dirs(layout::CHECKPOINTS).await? {
        let Some(id) = layout::parse_checkpoint_dir(&name) else { continue };
        let dir = layout::checkpoint_dir(id);
        let decoded = match storage.get(&format!("{dir}/{}", layout::METADATA)).await {
            Ok(bytes) => Some(CheckpointMetadata::decode(&bytes)),
            Err(StorageError::NotFound(_)) => None,
            Err(e) => return Err(e),
        };
        let newer_format = matches!(decoded, Some(Err(MetadataError::UnsupportedVersion(_))));
        let metadata = decoded.and_then(Result::ok);
        let epoch = metadata.as_ref().map_or(0, |m| m.epoch);
        let references = metadata.map(|m| m.files().map(|f| layout::resolve(&dir, &f.path)).collect());
        out.push(FoundCheckpoint { id, references, epoch, newer_format });
    }
    out.sort_by_key(|c| c.id);
    Ok(out)
}

/// Takes the checkpoints `corrupt` names (found corrupt by a restore: a file's length or
/// CRC-32C does not match its metadata) as corrupt: they are neither kept nor a fallback, so
/// retention never deletes an older valid checkpoint while keeping them in its place.
pub fn mark_corrupt(found: &mut [FoundCheckpoint], corrupt: &BTreeSet<u64>) {
    for c in found.iter_mut().filter(|c| corrupt.contains(&c.id)) {
        c.references = None;
    }
}

/// Takes the checkpoints outside the job's `history` ([`crate::epoch::history_before`] the next
/// run) as corrupt: never restored, they are neither kept nor a fallback.
pub fn mark_outside_history(found: &mut [FoundCheckpoint], history: &crate::epoch::Lineage) {
    for c in found.iter_mut().filter(|c| c.references.is_some() && !history.admits(c.epoch, c.id)) {
        c.references = None;
    }
}

/// Applies retention to a job root for a run of `epoch`, with the checkpoints known to be
/// corrupt (see [`mark_corrupt`]) and the files merges wrote for checkpoints still to come;
/// returns what was deleted.
pub async fn apply(
    storage: &Storage,
    retained: usize,
    in_flight_from: u64,
    epoch: u64,
    corrupt: &BTreeSet<u64>,
    pending: &PendingFiles,
) -> Result<RetentionPlan, StorageError> {
    let mut found = scan(storage).await?;
    mark_corrupt(&mut found, corrupt);
    if let Some(history) = crate::epoch::current_history(storage).await? {
        mark_outside_history(&mut found, &history);
    }
    let shared = storage.list(&format!("{}/{}", layout::CHECKPOINTS, layout::SHARED)).await?;
    // After the listing: a merge adds its file before uploading it, so every pending file the
    // listing shows is in this snapshot.
    pending.settle(&found, in_flight_from);
    let plan = plan(&found, &shared, retained, in_flight_from, epoch, &pending.snapshot());
    for id in &plan.delete_checkpoints {
        storage.delete_dir(&layout::checkpoint_dir(*id)).await?;
    }
    for f in &plan.delete_shared {
        storage.delete(f).await?;
    }
    Ok(plan)
}

/// What `retentionOnCancel: Delete` deletes for a cancelled run of `epoch` whose checkpoints
/// from `in_flight_from` on were never started: every checkpoint this run or an earlier one
/// completed, every incomplete one below `in_flight_from`, and their shared files; never what
/// a newer run wrote (this one may have been superseded since its last fence check).
pub fn cancel_plan(
    found: &[FoundCheckpoint],
    shared_files: &[String],
    epoch: u64,
    in_flight_from: u64,
) -> RetentionPlan {
    let delete_checkpoints = found
        .iter()
        .filter(|c| match c.references {
            Some(_) => c.epoch <= epoch,
            None => c.id < in_flight_from,
        })
        .map(|c| c.id)
        .collect();
    let delete_shared = shared_files
        .iter()
        .filter(|f| {
            let name = f.rsplit('/').next().unwrap_or("");
            let written_by = layout::shared_file_epoch(name).or_else(|| layout::staged_merge_epoch(name));
            written_by.is_none_or(|e| e <= epoch)
        })
        .cloned()
        .collect();
    RetentionPlan { delete_checkpoints, delete_shared }
}

/// Carries out [`cancel_plan`] on a job root, once [`crate::epoch::check`] says this run still
/// holds the newest epoch.
pub async fn delete_on_cancel(
    storage: &Storage,
    epoch: u64,
    in_flight_from: u64,
) -> Result<RetentionPlan, crate::epoch::EpochError> {
    crate::epoch::check(storage, epoch).await?;
    let found = scan(storage).await?;
    let shared = storage.list(&format!("{}/{}", layout::CHECKPOINTS, layout::SHARED)).await?;
    let plan = cancel_plan(&found, &shared, epoch, in_flight_from);
    for id in &plan.delete_checkpoints {
        storage.delete_dir(&layout::checkpoint_dir(*id)).await?;
    }
    for f in &plan.delete_shared {
        storage.delete(f).await?;
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chk(id: u64, refs: &[&str]) -> FoundCheckpoint {
        FoundCheckpoint {
            id,
            references: Some(refs.iter().map(|s| s.to_string()).collect()),
            epoch: 1,
            newer_format: false,
        }
    }

    fn shared(name: &str) -> String {
        format!("checkpoints/shared/op/{name}")
    }

    /// Found by the chaos campaign (CI, 2026-11-30): a restore passed over chk-400 and chk-399
    /// (their shared base was corrupt) and restored chk-397; when chk-402 completed, retention
    /// kept 402, 400 and 399 and deleted 397, the only valid fallback. Once 402 was damaged too,
    /// nothing could be restored. Checkpoints a restore found corrupt no longer count.
    #[test]
    fn checkpoints_found_corrupt_neither_count_nor_displace_a_valid_fallback() {
        let mut found = vec![
            chk(397, &["checkpoints/shared/op/1-397-80.kv"]),
            chk(399, &["checkpoints/shared/op/1-398-81.kv"]),
            chk(400, &["checkpoints/shared/op/1-398-81.kv", "checkpoints/shared/op/1-400-0.kv"]),
            chk(402, &["checkpoints/shared/op/1-402-82.kv"]),
        ];
        let files = vec![shared("1-397-80.kv"), shared("1-398-81.kv"), shared("1-400-0.kv"), shared("1-402-82.kv")];
        // File names are `<subtask>-<checkpoint>-<epoch>.kv`; this run is epoch 82.
        let unaware = plan(&found, &files, 3, 403, 82, &BTreeSet::new());
        assert_eq!(unaware.delete_checkpoints, vec![397], "the failure: the valid fallback goes");
        mark_corrupt(&mut found, &BTreeSet::from([399, 400]));
        let p = plan(&found, &files, 3, 403, 82, &BTreeSet::new());
        assert_eq!(p.delete_checkpoints, vec![399, 400]);
        assert_eq!(p.delete_shared, vec![shared("1-398-81.kv"), shared("1-400-0.kv")]);
    }

    /// Run 2 restored checkpoint 2 (of run 1) and is still loading it; run 1, superseded but
    /// not yet stopped, published checkpoint 3 and applies retention (one retained). Counted,
    /// checkpoint 3 would displace 2 and delete run 2's restore point; outside the history, it
    /// counts for nothing and 2 stays.
    #[test]
    fn a_checkpoint_outside_the_history_never_displaces_the_restore_point_of_the_next_run() {
        let mut found = vec![chk(1, &[]), chk(2, &[]), chk(3, &[])];
        let unaware = plan(&found, &[], 1, 4, 1, &BTreeSet::new());
        assert_eq!(unaware.delete_checkpoints, vec![1, 2], "the failure: run 2's restore point goes");
        let history = crate::epoch::Lineage { segments: vec![(2, u64::MAX), (1, 2)], floor: 1 };
        mark_outside_history(&mut found, &history);
        assert_eq!(found.iter().filter(|c| c.references.is_none()).map(|c| c.id).collect::<Vec<_>>(), vec![3]);
        let p = plan(&found, &[], 1, 4, 1, &BTreeSet::new());
        assert_eq!(p.delete_checkpoints, vec![1], "2 is the newest checkpoint of the history");
    }

    /// After a downgrade, checkpoint 5's metadata is of a newer format: this Weir cannot read
    /// it, but must not take it for a corrupt one and delete it (nor the shared files it could
    /// list), so that the newer Weir, back, can restore it.
    #[test]
    fn a_checkpoint_of_a_newer_format_and_the_files_it_could_list_are_kept() {
        let newer = FoundCheckpoint { id: 5, references: None, epoch: 0, newer_format: true };
        let found = vec![chk(4, &[]), newer, chk(6, &[]), chk(7, &["checkpoints/shared/op/0-7-3.kv"])];
        let files = vec![shared("0-4-2.kv"), shared("0-5-2.kv"), shared("0-6-3.kv")];
        let p = plan(&found, &files, 1, 8, 3, &BTreeSet::new());
        assert_eq!(p.delete_checkpoints, vec![4], "5 stays; 6 is the fallback outside 7's chain");
        assert_eq!(p.delete_shared, vec![shared("0-6-3.kv")], "files created up to checkpoint 5 stay");
    }

    /// Cancelled with `retentionOnCancel: Delete`, run 3 deletes what it and earlier runs
    /// wrote; run 4 (which superseded it after its last check) keeps its checkpoint, its
    /// in-flight directory and its shared files.
    #[test]
    fn delete_on_cancel_leaves_what_a_newer_run_wrote() {
        let mut newer = chk(9, &["checkpoints/shared/op/0-9-4.kv"]);
        newer.epoch = 4;
        let mut mine = chk(7, &["checkpoints/shared/op/0-7-3.kv"]);
        mine.epoch = 3;
        let found = vec![
            chk(5, &["checkpoints/shared/op/0-5-1.kv"]),
            FoundCheckpoint { id: 6, references: None, epoch: 0, newer_format: false },
            mine,
            FoundCheckpoint { id: 8, references: None, epoch: 0, newer_format: false },
            newer,
            FoundCheckpoint { id: 10, references: None, epoch: 0, newer_format: false },
        ];
        let files = vec![
            shared("0-5-1.kv"),
            shared("0-7-3.kv"),
            shared("0-9-4.kv"),
            shared("0-9-4.staged"),
            shared("0-8-4-merged.kv"),
        ];
        let p = cancel_plan(&found, &files, 3, 9);
        assert_eq!(p.delete_checkpoints, vec![5, 6, 7, 8], "9 is run 4's, 10 is in flight");
        assert_eq!(p.delete_shared, vec![shared("0-5-1.kv"), shared("0-7-3.kv")]);
    }

    /// A checkpoint between the fallback and the newest `retained` stays (it is the next
    /// fallback once the newest chain stops sharing its files), and so do its files.
    #[test]
    fn checkpoints_kept_as_next_fallbacks_keep_their_files() {
        let found = vec![
            chk(10, &["checkpoints/shared/op/0-10-1.kv"]),
            chk(11, &["checkpoints/shared/op/0-10-1.kv", "checkpoints/shared/op/0-11-1.kv"]),
            chk(12, &["checkpoints/shared/op/0-12-1.kv", "checkpoints/shared/op/0-11-1.kv"]),
            chk(13, &["checkpoints/shared/op/0-11-1.kv", "checkpoints/shared/op/0-13-1.kv"]),
            chk(14, &["checkpoints/shared/op/0-11-1.kv", "checkpoints/shared/op/0-13-1.kv"]),
        ];
        let files: Vec<String> = [10, 11, 12, 13].iter().map(|i| shared(&format!("0-{i}-1.kv"))).collect();
        let p = plan(&found, &files, 2, 15, 1, &BTreeSet::new());
        // 14 and 13 are the newest two; 10 is the newest that shares no file with 14.
        assert_eq!(p.delete_checkpoints, Vec::<u64>::new());
        assert_eq!(p.delete_shared, Vec::<String>::new(), "0-12 is chk-12's, which stays");
        // Once a newer checkpoint (14) is the fallback, 10–13 go, and the files that only they
        // list.
        let mut later = found.clone();
        later.push(chk(15, &["checkpoints/shared/op/0-15-1.kv"]));
        later.push(chk(16, &["checkpoints/shared/op/0-15-1.kv", "checkpoints/shared/op/0-16-1.kv"]));
        let mut files = files;
        files.extend([shared("0-15-1.kv"), shared("0-16-1.kv")]);
        let p = plan(&later, &files, 2, 17, 1, &BTreeSet::new());
        assert_eq!(p.delete_checkpoints, vec![10, 11, 12, 13]);
        assert_eq!(p.delete_shared, vec![shared("0-10-1.kv"), shared("0-12-1.kv")]);
    }

    #[test]
    fn keeps_the_newest_n_and_their_shared_files() {
        let found = vec![
            chk(1, &["checkpoints/shared/op/0-1-0.kv"]),
            chk(2, &["checkpoints/shared/op/0-1-0.kv", "checkpoints/shared/op/0-2-0.kv"]),
            chk(3, &["checkpoints/shared/op/0-3-0.kv"]),
            chk(4, &["checkpoints/shared/op/0-4-0.kv"]),
        ];
        let files =
            vec![shared("0-1-0.kv"), shared("0-2-0.kv"), shared("0-3-0.kv"), shared("0-4-0.kv"), shared("0-5-0.kv")];
        let p = plan(&found, &files, 2, 5, 0, &BTreeSet::new());
        assert_eq!(p.delete_checkpoints, vec![1, 2]);
        assert_eq!(
            p.delete_shared,
            vec![shared("0-1-0.kv"), shared("0-2-0.kv")],
            "0-5 belongs to a checkpoint in flight"
        );
    }

    #[test]
    fn never_deletes_the_newest_and_skips_incomplete_ones_in_flight() {
        let found = vec![
            chk(1, &[]),
            FoundCheckpoint { id: 2, references: None, epoch: 0, newer_format: false },
            FoundCheckpoint { id: 3, references: None, epoch: 0, newer_format: false },
        ];
        let p = plan(&found, &[], 0, 3, 0, &BTreeSet::new());
        assert_eq!(p.delete_checkpoints, Vec::<u64>::new(), "2 is incomplete but newer than the newest complete (1)");
        let found =
            vec![FoundCheckpoint { id: 1, references: None, epoch: 0, newer_format: false }, chk(2, &[]), chk(3, &[])];
        let p = plan(&found, &[], 1, 4, 0, &BTreeSet::new());
        assert_eq!(p.delete_checkpoints, vec![1, 2]);
    }

    #[test]
    fn nothing_is_deleted_without_a_complete_checkpoint() {
        let found = vec![FoundCheckpoint { id: 1, references: None, epoch: 0, newer_format: false }];
        assert_eq!(plan(&found, &[shared("0-1-0.kv")], 3, 2, 0, &BTreeSet::new()), RetentionPlan::default());
    }

    #[test]
    fn keeps_a_checkpoint_outside_the_newest_chain_so_a_damaged_base_has_a_fallback() {
        // 1 is a full image; 2..=4 are increments on 3's full image (fullEvery 3).
        let found = vec![
            chk(1, &["checkpoints/shared/op/0-1-0.kv"]),
            chk(2, &["checkpoints/shared/op/0-1-0.kv", "checkpoints/shared/op/0-2-0.kv"]),
            chk(3, &["checkpoints/shared/op/0-3-0.kv"]),
            chk(4, &["checkpoints/shared/op/0-3-0.kv", "checkpoints/shared/op/0-4-0.kv"]),
            chk(
                5,
                &["checkpoints/shared/op/0-3-0.kv", "checkpoints/shared/op/0-4-0.kv", "checkpoints/shared/op/0-5-0.kv"],
            ),
        ];
        let files: Vec<String> =
            ["0-1-0.kv", "0-2-0.kv", "0-3-0.kv", "0-4-0.kv", "0-5-0.kv"].iter().map(|n| shared(n)).collect();
        let p = plan(&found, &files, 3, 6, 0, &BTreeSet::new());
        assert_eq!(p.delete_checkpoints, vec![1], "3, 4, 5 share 0-3-0.kv: 2 is kept as well");
        assert_eq!(p.delete_shared, Vec::<String>::new(), "2 still needs 0-1-0.kv");
        // Once a later full image exists, the chain of 3 is the independent one.
        let mut found = found;
        found.push(chk(6, &["checkpoints/shared/op/0-6-0.kv"]));
        let p = plan(&found, &files, 3, 7, 0, &BTreeSet::new());
        assert_eq!(p.delete_checkpoints, vec![1, 2, 3]);
    }

    #[test]
    fn never_deletes_files_of_a_newer_epoch() {
        let found = vec![chk(5, &[]), chk(6, &["checkpoints/shared/op/0-6-1.kv"])];
        let p = plan(&found, &[shared("0-3-2.kv"), shared("0-4-1.kv")], 1, 7, 1, &BTreeSet::new());
        assert_eq!(
            p.delete_shared,
            vec![shared("0-4-1.kv")],
            "0-3-2.kv was written by epoch 2, newer than this run's 1"
        );
    }

    /// A chain merged in the background shares no file with the chain it replaced, so the
    /// fallback is the last checkpoint before the merge, possibly many checkpoints back. The
    /// checkpoints between it and the newest are kept: each becomes the fallback in turn once
    /// the newest chain stops sharing its files (deleting them pinned the fallback to the
    /// first one, found in review). Over rounds of merges the fallback moves forward.
    #[test]
    fn the_fallback_moves_forward_as_merged_chains_replace_older_ones() {
        let f = |i: u64| format!("checkpoints/shared/op/0-{i}-1.kv");
        let m = |i: u64| format!("checkpoints/shared/op/0-{i}-1-merged.kv");
        let c = |id: u64, files: &[String]| FoundCheckpoint {
            id,
            references: Some(files.iter().cloned().collect()),
            epoch: 1,
            newer_format: false,
        };
        // 1..=3 build on base 1; 3's chain is merged and adopted at 5 (keeping 4 and 5);
        // 7's chain ([M5, 4..7]) is merged and adopted at 8.
        let mut found = vec![c(1, &[f(1)]), c(2, &[f(1), f(2)]), c(3, &[f(1), f(2), f(3)])];
        found.push(c(4, &[f(1), f(2), f(3), f(4)]));
        found.push(c(5, &[m(5), f(4), f(5)]));
        let p = plan(&found, &[], 1, 6, 1, &BTreeSet::new());
        assert_eq!(p.delete_checkpoints, vec![1, 2], "3 is the fallback; 4 is kept as the next one");
        found.retain(|x| !p.delete_checkpoints.contains(&x.id));
        found.push(c(6, &[m(5), f(4), f(5), f(6)]));
        found.push(c(7, &[m(5), f(4), f(5), f(6), f(7)]));
        found.push(c(8, &[m(8), f(8)]));
        let p = plan(&found, &[], 1, 9, 1, &BTreeSet::new());
        assert_eq!(p.delete_checkpoints, vec![3, 4, 5, 6], "7 (before the second merge) is the fallback now");
    }

    /// Older Weirs staged a merge under a `.staged` name and renamed it on adoption: those of
    /// earlier runs can never be adopted and go (none are written now). A merged image is kept
    /// while a kept checkpoint lists it, like any shared file.
    #[test]
    fn staged_merges_of_earlier_runs_go_and_this_runs_stay() {
        let found = vec![chk(9, &["checkpoints/shared/op/0-8-3-merged.kv", "checkpoints/shared/op/0-9-3.kv"])];
        let files =
            [shared("0-5-2.staged"), shared("0-7-3.staged"), shared("0-8-3-merged.kv"), shared("0-6-3-merged.kv")];
        let p = plan(&found, &files, 1, 10, 3, &BTreeSet::new());
        assert_eq!(p.delete_shared, vec![shared("0-5-2.staged"), shared("0-6-3-merged.kv")]);
    }

    /// Files a merge wrote for a checkpoint still to come are never deleted, though no
    /// checkpoint lists them and their names say an older, complete checkpoint created them;
    /// once a complete checkpoint lists them they stop being pending, and once none lists them
    /// any more they go like any shared file.
    #[tokio::test]
    async fn files_pending_adoption_stay_until_listed_and_go_once_superseded() {
        let dir = tempfile::tempdir().unwrap();
        let storage = Storage::open(dir.path().to_str().unwrap()).unwrap();
        let put = |rel: String| {
            let storage = storage.clone();
            async move { storage.put(&rel, bytes::Bytes::from_static(b"x")).await.unwrap() }
        };
        let complete = |id: u64, files: Vec<String>| {
            let storage = storage.clone();
            async move {
                let keyed_state: Vec<crate::FileRef> =
                    files.iter().map(|f| crate::FileRef::new(format!("../shared/op/{f}"), 1, 0)).collect();
                let subtask = crate::SubtaskSnapshot { keyed_state, key_groups: (0, 8), ..Default::default() };
                let m = CheckpointMetadata {
                    format_version: crate::metadata::FORMAT_VERSION,
                    checkpoint_id: id,
                    kind: crate::SnapshotKind::Checkpoint,
                    job_name: "j".into(),
                    epoch: 1,
                    created_at_ms: id,
                    max_parallelism: 8,
                    operators: [(
                        "op".to_string(),
                        crate::OperatorSnapshot { parallelism: 1, subtasks: vec![subtask], state_layout: None },
                    )]
                    .into(),
                };
                let at = format!("{}/{}", layout::checkpoint_dir(id), layout::METADATA);
                storage.put(&at, bytes::Bytes::from(m.encode())).await.unwrap();
            }
        };
        let pending = PendingFiles::default();
        put(shared("0-1-1.kv")).await;
        complete(1, vec!["0-1-1.kv".into()]).await;
        // A merge of checkpoint 1's chain, written before checkpoint 2 (which does not list it).
        let merged = shared("0-1-1-merged.kv");
        pending.add(&merged);
        put(merged.clone()).await;
        put(shared("0-2-1.kv")).await;
        complete(2, vec!["0-1-1.kv".into(), "0-2-1.kv".into()]).await;
        apply(&storage, 1, 3, 1, &BTreeSet::new(), &pending).await.unwrap();
        assert!(storage.size(&merged).await.unwrap().is_some(), "a pending merge stays");
        assert!(pending.snapshot().contains(&merged));
        // Checkpoint 3 adopts it.
        put(shared("0-3-1.kv")).await;
        complete(3, vec!["0-1-1-merged.kv".into(), "0-3-1.kv".into()]).await;
        apply(&storage, 1, 4, 1, &BTreeSet::new(), &pending).await.unwrap();
        assert!(pending.snapshot().is_empty(), "listed by a complete checkpoint: no longer pending");
        assert!(storage.size(&merged).await.unwrap().is_some(), "listed by the newest checkpoint");
        // A full image restarts the chain: the merged image is no longer listed, and goes.
        put(shared("0-4-1.kv")).await;
        complete(4, vec!["0-4-1.kv".into()]).await;
        apply(&storage, 1, 5, 1, &BTreeSet::new(), &pending).await.unwrap();
        // Kept once more as the fallback outside the newest chain (checkpoint 3).
        put(shared("0-5-1.kv")).await;
        complete(5, vec!["0-4-1.kv".into(), "0-5-1.kv".into()]).await;
        put(shared("0-6-1.kv")).await;
        complete(6, vec!["0-6-1.kv".into()]).await;
        apply(&storage, 1, 7, 1, &BTreeSet::new(), &pending).await.unwrap();
        assert!(storage.size(&merged).await.unwrap().is_none(), "superseded: deleted");

        // A merge adopted and dropped again before any complete checkpoint listed it (the same
        // upload was a full image): protected while a checkpoint that could list it is in
        // flight, deleted once none is.
        let orphan = shared("0-6-1-merged.kv");
        pending.add(&orphan);
        put(orphan.clone()).await;
        pending.dropped(&orphan, 8);
        apply(&storage, 1, 7, 1, &BTreeSet::new(), &pending).await.unwrap();
        assert!(storage.size(&orphan).await.unwrap().is_some(), "checkpoint 7 may still list it");
        put(shared("0-8-1.kv")).await;
        complete(8, vec!["0-8-1.kv".into()]).await;
        apply(&storage, 1, 9, 1, &BTreeSet::new(), &pending).await.unwrap();
        assert!(storage.size(&orphan).await.unwrap().is_none(), "no checkpoint can list it: deleted");
        assert!(pending.snapshot().is_empty());
    }

    /// A merged image's table files (the rocksdb backend's) follow the same rules as the image:
    /// kept while a kept checkpoint lists them or while pending, deleted once unlisted, never
    /// those of a newer epoch.
    #[test]
    fn table_files_are_kept_and_deleted_like_the_images_they_stand_for() {
        let found =
            vec![chk(9, &["checkpoints/shared/op/0-8-3-merged.kv", "checkpoints/shared/op/0-8-3-merged-0.sst"])];
        let files = [
            shared("0-8-3-merged-0.sst"),
            shared("0-6-3-merged-0.sst"),
            shared("0-6-3-merged-1.sst"),
            shared("0-7-3-merged-0.sst"),
            shared("0-6-4-merged-0.sst"),
        ];
        let pending = [shared("0-7-3-merged-0.sst")].into_iter().collect();
        let p = plan(&found, &files, 1, 10, 3, &pending);
        assert_eq!(p.delete_shared, vec![shared("0-6-3-merged-0.sst"), shared("0-6-3-merged-1.sst")]);
    }
}
