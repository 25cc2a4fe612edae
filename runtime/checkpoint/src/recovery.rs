//! Finding what to restore from: the newest *valid* retained checkpoint, or a named checkpoint
//! or savepoint directory. A checkpoint is valid when its metadata passes its checksum and every
//! file it references exists with the recorded length; the loader then checks each file's
//! CRC-32C and falls back further when one does not match.

use crate::layout;
use crate::metadata::CheckpointMetadata;
use crate::store::{Storage, StorageError};
use std::collections::BTreeSet;

/// A restorable snapshot: its metadata and the directory references resolve against.
#[derive(Clone, Debug)]
pub struct Restorable {
    /// Directory holding `_metadata`, relative to the storage root it was found in.
    pub dir: String,
    /// The verified metadata.
    pub metadata: CheckpointMetadata,
}

impl Restorable {
    /// The storage path (relative to the root) of a file reference.
    pub fn resolve(&self, relative: &str) -> String {
        layout::resolve(&self.dir, relative)
    }
}

/// The verdict on one checkpoint directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Metadata and files check out.
    Valid,
    /// No `_metadata`: the checkpoint never completed (in progress, aborted, or its run died
    /// first). Not a restore point, and not a defect.
    Incomplete,
    /// It completed once but cannot be used now, and why (a defect).
    Invalid(String),
}

/// Largest `_metadata` read: a document past it is a defect, not an allocation (storage may be
/// written by whoever runs the job; the operator reads it for every tenant).
pub const MAX_METADATA_BYTES: u64 = 64 << 20;

/// Reads and verifies the `_metadata` of a snapshot directory (relative to `storage`); the
/// verdict when there is none ([`Verdict::Incomplete`]), it is larger than
/// [`MAX_METADATA_BYTES`], or it does not verify.
pub async fn read_metadata(storage: &Storage, dir: &str) -> Result<Result<CheckpointMetadata, Verdict>, StorageError> {
    let bytes = match storage.get_at_most(&layout::resolve(dir, layout::METADATA), MAX_METADATA_BYTES).await {
        Ok(Ok(b)) => b,
        Ok(Err(len)) => {
            let too_large = crate::metadata::MetadataError::TooLarge { len, limit: MAX_METADATA_BYTES };
            return Ok(Err(Verdict::Invalid(too_large.to_string())));
        }
        Err(StorageError::NotFound(_)) => return Ok(Err(Verdict::Incomplete)),
        Err(e) => return Err(e),
    };
    Ok(CheckpointMetadata::decode(&bytes).map_err(|e| Verdict::Invalid(e.to_string())))
}

/// Checks one snapshot directory (relative to `storage`): its metadata, and that every file a
/// restore needs exists with the recorded length (checksums are the loader's to verify) and has
/// no damage record ([`damaged_files`]). Table files are not needed
/// ([`CheckpointMetadata::required_files`]): one missing does not make the checkpoint unusable,
/// and the restore takes the full image it stands for.
pub async fn inspect(storage: &Storage, dir: &str) -> Result<(Verdict, Option<CheckpointMetadata>), StorageError> {
    inspect_with(storage, dir, &damaged_files(storage).await?).await
}

/// [`inspect`] with the damage records already listed.
async fn inspect_with(
    storage: &Storage,
    dir: &str,
    damaged: &BTreeSet<String>,
) -> Result<(Verdict, Option<CheckpointMetadata>), StorageError> {
    let metadata = match read_metadata(storage, dir).await? {
        Ok(m) => m,
        Err(verdict) => return Ok((verdict, None)),
    };
    let files: Vec<_> = metadata.required_files().cloned().collect();
    for f in files {
        let path = layout::resolve(dir, &f.path);
        let invalid = match storage.size(&path).await? {
            None => format!("missing file {}", f.path),
            Some(len) if len != f.len => format!("file {} has {len} bytes, metadata says {}", f.path, f.len),
            Some(_) if damaged.contains(&path) => format!("file {}: {}", f.path, recorded_damage(storage, &path).await),
            Some(_) => continue,
        };
        return Ok((Verdict::Invalid(invalid), Some(metadata)));
    }
    Ok((Verdict::Valid, Some(metadata)))
}

/// The state files (paths from the storage root) that restores found damaged after they had
/// started: each has a record under [`layout::DAMAGED`] saying why. No restore picks a snapshot
/// that needs one of them, and the operator reports such checkpoints as invalid.
pub async fn damaged_files(storage: &Storage) -> Result<BTreeSet<String>, StorageError> {
    let prefix = format!("{}/", layout::DAMAGED);
    let records = storage.list(layout::DAMAGED).await?;
    Ok(records.iter().filter_map(|r| r.strip_prefix(&prefix)).map(str::to_string).collect())
}

/// What the damage record of the state file at `path` (from the storage root, listed by
/// [`damaged_files`]) says, as a restore and the operator report it.
pub async fn recorded_damage(storage: &Storage, path: &str) -> String {
    let why = match storage.get(&layout::damage_record(path)).await {
        Ok(record) => String::from_utf8_lossy(&record).into_owned(),
        Err(e) => format!("its record could not be read: {e}"),
    };
    format!("an earlier restore found it damaged ({why})")
}

/// Every checkpoint directory of a job root, newest first, with its verdict: a checkpoint
/// outside the job's history (written by a superseded run after its successor chose its
/// restore point, [`crate::epoch::history_before`] the next run) is invalid, as a restore
/// would find it.
pub async fn list_checkpoints(
    storage: &Storage,
) -> Result<Vec<(u64, Verdict, Option<CheckpointMetadata>)>, StorageError> {
    let mut ids: Vec<u64> =
        storage.list_dirs(layout::CHECKPOINTS).await?.iter().filter_map(|n| layout::parse_checkpoint_dir(n)).collect();
    ids.sort_unstable_by(|a, b| b.cmp(a));
    let damaged = damaged_files(storage).await?;
    let history = crate::epoch::current_history(storage).await?;
    let mut out = Vec::new();
    for id in ids {
        let (mut verdict, meta) = inspect_with(storage, &layout::checkpoint_dir(id), &damaged).await?;
        if let (Verdict::Valid, Some(m), Some(h)) = (&verdict, &meta, &history) {
            if !h.admits(m.epoch, id) {
                verdict = Verdict::Invalid(h.refusal(m.epoch, id));
            }
        }
        out.push((id, verdict, meta));
    }
    Ok(out)
}

/// Valid checkpoints of a job root, newest first, with the reasons others were skipped
/// (`(id, reason)`, only for those newer than the first valid one).
pub async fn restorable_checkpoints(storage: &Storage) -> Result<(Vec<Restorable>, Vec<(u64, String)>), StorageError> {
    let mut valid = Vec::new();
    let mut skipped = Vec::new();
    for (id, verdict, meta) in list_checkpoints(storage).await? {
        match (verdict, meta) {
            (Verdict::Valid, Some(metadata)) => valid.push(Restorable { dir: layout::checkpoint_dir(id), metadata }),
            (Verdict::Invalid(reason), _) if valid.is_empty() => skipped.push((id, reason)),
            (Verdict::Incomplete, _) if valid.is_empty() => {
                skipped.push((id, "no _metadata (incomplete or aborted)".to_string()))
            }
            _ => {}
        }
    }
    Ok((valid, skipped))
}

/// A snapshot directory that a restore could start from: a checkpoint or a savepoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestorePoint {
    /// Its checkpoint id (ids are shared by checkpoints and savepoints and never reused).
    pub id: u64,
    /// Its directory, relative to the job root.
    pub dir: String,
}

/// Every checkpoint and savepoint directory of a job root, highest id first (unverified).
pub async fn restore_points(storage: &Storage) -> Result<Vec<RestorePoint>, StorageError> {
    let mut out: Vec<RestorePoint> = storage
        .list_dirs(layout::CHECKPOINTS)
        .await?
        .iter()
        .filter_map(|n| layout::parse_checkpoint_dir(n))
        .map(|id| RestorePoint { id, dir: layout::checkpoint_dir(id) })
        .collect();
    for name in storage.list_dirs(layout::SAVEPOINTS).await? {
        if let Some((time, id)) = layout::parse_savepoint_dir(&name) {
            out.push(RestorePoint { id, dir: layout::savepoint_dir(time, id) });
        }
    }
    out.sort_by(|a, b| b.id.cmp(&a.id).then_with(|| a.dir.cmp(&b.dir)));
    Ok(out)
}

/// The highest checkpoint id used so far under a job root (checkpoints and savepoints), so a
/// new run never reuses an id.
pub async fn highest_id(storage: &Storage) -> Result<u64, StorageError> {
    Ok(restore_points(storage).await?.first().map_or(0, |p| p.id))
}

/// Of `points` (highest id first), the first that completed (has `_metadata`, verified or
/// not): one HEAD request per incomplete directory above it.
pub async fn newest_complete(storage: &Storage, points: &[RestorePoint]) -> Result<Option<RestorePoint>, StorageError> {
    for point in points {
        if storage.size(&layout::resolve(&point.dir, layout::METADATA)).await?.is_some() {
            return Ok(Some(point.clone()));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metadata::*;
    use bytes::Bytes;
    use std::collections::BTreeMap;

    async fn write_checkpoint(s: &Storage, id: u64, file_len: usize) {
        let dir = layout::checkpoint_dir(id);
        let rel = layout::shared_keyed_file("op", 0, id, 0);
        s.put(&layout::resolve(&dir, &rel), Bytes::from(vec![1u8; file_len])).await.unwrap();
        let table = format!("{rel}.sst");
        s.put(&layout::resolve(&dir, &table), Bytes::from(vec![2u8; file_len])).await.unwrap();
        let mut operators = BTreeMap::new();
        operators.insert(
            "op".to_string(),
            OperatorSnapshot {
                parallelism: 1,
                subtasks: vec![SubtaskSnapshot {
                    subtask: 0,
                    key_groups: (0, 8),
                    operator_state: None,
                    keyed_state: vec![FileRef::new(rel, file_len as u64, 0)],
                    store_tables: vec![FileRef::new(table, file_len as u64, 0)],
                    keyed_entries: None,
                    int_keys: false,
                    table_slot_bytes: None,
                }],
                state_layout: None,
            },
        );
        let m = CheckpointMetadata {
            format_version: FORMAT_VERSION,
            checkpoint_id: id,
            kind: SnapshotKind::Checkpoint,
            job_name: "j".into(),
            epoch: 1,
            created_at_ms: 0,
            max_parallelism: 8,
            operators,
        };
        s.put(&format!("{dir}/_metadata"), Bytes::from(m.encode())).await.unwrap();
    }

    /// Checkpoints 1, 2 and 3, each a 4-byte image and its table file.
    async fn three_checkpoints() -> Storage {
        let s = Storage::open("memory://").unwrap();
        for id in 1..=3 {
            write_checkpoint(&s, id, 4).await;
        }
        s
    }

    #[tokio::test]
    async fn falls_back_past_corrupt_and_incomplete_checkpoints() {
        let s = three_checkpoints().await;
        // 3: a truncated state file; 4: no metadata at all.
        s.put("checkpoints/shared/op/0-3-0.kv", Bytes::from_static(b"12")).await.unwrap();
        s.put("checkpoints/chk-4/op/0.state", Bytes::from_static(b"x")).await.unwrap();
        // 2: corrupt metadata.
        let mut meta = s.get("checkpoints/chk-2/_metadata").await.unwrap().to_vec();
        let n = meta.len();
        meta[n - 2] ^= 0xff;
        s.put("checkpoints/chk-2/_metadata", Bytes::from(meta)).await.unwrap();

        let (valid, skipped) = restorable_checkpoints(&s).await.unwrap();
        assert_eq!(valid.iter().map(|r| r.metadata.checkpoint_id).collect::<Vec<_>>(), vec![1]);
        let skipped_ids: Vec<u64> = skipped.iter().map(|(id, _)| *id).collect();
        assert_eq!(skipped_ids, vec![4, 3, 2]);
        assert!(skipped[1].1.contains("has 2 bytes"), "{:?}", skipped[1]);
        assert!(skipped[2].1.contains("checksum"), "{:?}", skipped[2]);
        assert_eq!(highest_id(&s).await.unwrap(), 4);
    }

    /// A table file stands for the full image the checkpoint also lists: one missing or cut
    /// short leaves the checkpoint valid (the loader takes the image), a missing image does not.
    #[tokio::test]
    async fn a_missing_table_file_leaves_the_checkpoint_valid_and_a_missing_image_does_not() {
        let s = three_checkpoints().await;
        s.delete("checkpoints/shared/op/0-3-0.kv.sst").await.unwrap();
        s.put("checkpoints/shared/op/0-2-0.kv.sst", Bytes::from_static(b"1")).await.unwrap();
        let (valid, skipped) = restorable_checkpoints(&s).await.unwrap();
        assert_eq!(valid.iter().map(|r| r.metadata.checkpoint_id).collect::<Vec<_>>(), vec![3, 2, 1]);
        assert!(skipped.is_empty(), "{skipped:?}");

        s.delete("checkpoints/shared/op/0-3-0.kv").await.unwrap();
        let (valid, skipped) = restorable_checkpoints(&s).await.unwrap();
        assert_eq!(valid.iter().map(|r| r.metadata.checkpoint_id).collect::<Vec<_>>(), vec![2, 1]);
        assert_eq!(skipped, vec![(3, "missing file ../shared/op/0-3-0.kv".to_string())]);
    }

    /// A state file that an earlier restore found damaged (its record under `_damaged`) makes
    /// every checkpoint that needs it invalid, with the record's reason; a record for a table
    /// file (which the image stands in for) or for a file no checkpoint lists changes nothing.
    #[tokio::test]
    async fn a_damage_record_makes_the_checkpoints_needing_the_file_invalid() {
        let s = three_checkpoints().await;
        let image = "checkpoints/shared/op/0-3-0.kv";
        s.put(&layout::damage_record(image), Bytes::from_static(b"bytes 9..20: key group 1 does not match"))
            .await
            .unwrap();
        s.put(&layout::damage_record("checkpoints/shared/op/0-2-0.kv.sst"), Bytes::from_static(b"crc32c"))
            .await
            .unwrap();
        s.put(&layout::damage_record("checkpoints/shared/op/0-9-0.kv"), Bytes::from_static(b"gone")).await.unwrap();
        assert_eq!(damaged_files(&s).await.unwrap().len(), 3);
        let listed = list_checkpoints(&s).await.unwrap();
        let verdicts: Vec<(u64, &Verdict)> = listed.iter().map(|(id, v, _)| (*id, v)).collect();
        assert_eq!(
            verdicts,
            vec![
                (
                    3,
                    &Verdict::Invalid(
                        "file ../shared/op/0-3-0.kv: an earlier restore found it damaged \
                         (bytes 9..20: key group 1 does not match)"
                            .into()
                    )
                ),
                (2, &Verdict::Valid),
                (1, &Verdict::Valid)
            ]
        );
        let (valid, skipped) = restorable_checkpoints(&s).await.unwrap();
        assert_eq!(valid.iter().map(|r| r.metadata.checkpoint_id).collect::<Vec<_>>(), vec![2, 1]);
        assert_eq!(skipped.len(), 1);
        assert_eq!(inspect(&s, &layout::checkpoint_dir(3)).await.unwrap().0, listed[0].1);
    }
}
