//! Fencing epochs: every start of a job claims a number that only grows, in the job's own
//! storage, with a create-only write (`_epochs/<E>`, S3 `If-None-Match: *`). A runtime checks
//! that no newer claim exists before it publishes a checkpoint's `_metadata` and before it
//! commits output, and stops once one does. So a runtime left over from an earlier start (a
//! frozen process, a pod on a partitioned node, a force-deleted container) stops writing as
//! soon as its replacement has started, instead of interleaving its checkpoints and output
//! with the replacement's.
//!
//! A claim also records the restore point its run started from (its id and the epoch that
//! wrote it), so the history of any restore point can be traced back through the runs that
//! led to it ([`lineage`]): a sink shows exactly the output of that history.
//!
//! Claims are create-only objects rather than one `_epoch` object updated with
//! compare-and-swap because object_store's local filesystem store has no conditional update
//! (`PutMode::Update`), while every store it supports, the local one included, has
//! create-only writes; the claims also tell who started when.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::layout;
use crate::store::{Storage, StorageError};

/// How many times a claim is retried when other starts race for the same number.
const CLAIM_ATTEMPTS: u32 = 64;

/// Why an epoch could not be claimed or is no longer held.
#[derive(Debug, thiserror::Error)]
pub enum EpochError {
    /// Storage failed while listing or claiming.
    #[error("epoch claim: {0}")]
    Storage(#[from] StorageError),
    /// Every attempt lost the race to another start.
    #[error("could not claim an epoch after {0} attempts: other runs of this job keep starting")]
    Contended(u32),
    /// A newer run of this job has started: this one must stop writing.
    #[error("fenced: this run holds epoch {mine} but epoch {newest} has been claimed by a newer run of the job")]
    Superseded {
        /// This run's epoch.
        mine: u64,
        /// The newest claimed.
        newest: u64,
    },
}

/// What a claim records.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claim {
    /// The epoch.
    pub epoch: u64,
    /// Who claimed it (host and process).
    pub holder: String,
    /// The restore point the run started from, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restored: Option<RestoredFrom>,
}

/// A restore point, as a claim records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestoredFrom {
    /// Its checkpoint id.
    pub id: u64,
    /// The epoch of the run that wrote it (0: unknown, written before epochs existed).
    pub epoch: u64,
}

/// The history of a restore point: the runs (epochs) that led to it and how far each one's
/// output belongs to it. Output of epoch `e` with checkpoint `c` belongs to the history when a
/// segment `(e, up_to)` has `c <= up_to`; output of epochs below `floor` predates the history
/// (a fresh start began it) and is left alone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lineage {
    /// `(epoch, newest checkpoint of that epoch in the history)`, newest run first.
    pub segments: Vec<(u64, u64)>,
    /// The oldest epoch of the history.
    pub floor: u64,
}

impl Lineage {
    /// Whether output of `epoch` for `checkpoint` belongs to the history; `None` when it
    /// predates it.
    pub fn contains(&self, epoch: u64, checkpoint: u64) -> Option<bool> {
        if epoch < self.floor {
            return None;
        }
        Some(self.segments.iter().any(|(e, up_to)| *e == epoch && checkpoint <= *up_to))
    }
}

/// Reads the claim of `epoch`, if it is there and readable.
pub async fn read_claim(storage: &Storage, epoch: u64) -> Result<Option<Claim>, StorageError> {
    match storage.get(&layout::epoch_claim(epoch)).await {
        Ok(bytes) => Ok(serde_json::from_slice(&bytes).ok()),
        Err(StorageError::NotFound(_)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Traces the history of restore point `point` back through the claims under `storage`;
/// `None` when the point's epoch is unknown (written before epochs existed).
pub async fn lineage(storage: &Storage, point: RestoredFrom) -> Result<Option<Lineage>, StorageError> {
    if point.epoch == 0 {
        return Ok(None);
    }
    let mut segments = vec![(point.epoch, point.id)];
    let mut floor = point.epoch;
    let mut at = point.epoch;
    // Each step goes to a strictly older epoch, so this ends.
    while let Some(Claim { restored: Some(from), .. }) = read_claim(storage, at).await? {
        if from.epoch == 0 || from.epoch >= at {
            break;
        }
        segments.push((from.epoch, from.id));
        floor = from.epoch;
        at = from.epoch;
    }
    Ok(Some(Lineage { segments, floor }))
}

/// The newest epoch claimed under a job root (0 when none).
pub async fn newest(storage: &Storage) -> Result<u64, StorageError> {
    let claims = storage.list(layout::EPOCHS).await?;
    Ok(claims.iter().filter_map(|p| p.rsplit('/').next().and_then(layout::parse_epoch_claim)).max().unwrap_or(0))
}

/// Claims the next epoch for a run that starts from `restored`; `holder` (e.g. host and
/// process id) is written into the claim.
pub async fn claim(storage: &Storage, holder: &str, restored: Option<RestoredFrom>) -> Result<u64, EpochError> {
    for _ in 0..CLAIM_ATTEMPTS {
        let next = newest(storage).await? + 1;
        let body =
            serde_json::to_vec(&Claim { epoch: next, holder: holder.to_string(), restored }).expect("claim serializes");
        match storage.put_if_absent(&layout::epoch_claim(next), Bytes::from(body)).await {
            Ok(()) => return Ok(next),
            Err(StorageError::AlreadyExists(_)) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(EpochError::Contended(CLAIM_ATTEMPTS))
}

/// Succeeds while `mine` is still the newest epoch. Claims are made one above the newest, so
/// a newer run exists exactly when the claim of `mine + 1` does: one HEAD request, however
/// many runs the job has had.
pub async fn check(storage: &Storage, mine: u64) -> Result<(), EpochError> {
    if storage.size(&layout::epoch_claim(mine + 1)).await?.is_some() {
        let newest = newest(storage).await?;
        return Err(EpochError::Superseded { mine, newest });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn claims_grow_and_a_newer_claim_fences_the_older_run() {
        let dir = tempfile::tempdir().unwrap();
        let s = Storage::open(dir.path().to_str().unwrap()).unwrap();
        assert_eq!(newest(&s).await.unwrap(), 0);
        let a = claim(&s, "a", None).await.unwrap();
        check(&s, a).await.unwrap();
        let b = claim(&s, "b", None).await.unwrap();
        assert!(b > a);
        assert!(matches!(check(&s, a).await, Err(EpochError::Superseded { mine, newest }) if mine == a && newest == b));
        check(&s, b).await.unwrap();
    }

    #[tokio::test]
    async fn racing_claims_never_share_a_number() {
        let s = Storage::open("memory://").unwrap();
        let mut handles = Vec::new();
        for i in 0..8 {
            let s = s.clone();
            handles.push(tokio::spawn(async move { claim(&s, &format!("run-{i}"), None).await.unwrap() }));
        }
        let mut got = Vec::new();
        for h in handles {
            got.push(h.await.unwrap());
        }
        got.sort_unstable();
        assert_eq!(got, (1..=8).collect::<Vec<u64>>());
    }

    #[tokio::test]
    async fn lineage_follows_the_restore_points_of_each_run() {
        let s = Storage::open("memory://").unwrap();
        // 1 starts fresh; 2 restores 1's checkpoint 9; 3 restores 2's 14 (a newer savepoint);
        // 4 rewinds to 1's checkpoint 5 (an older savepoint); 5 restores 3's 20.
        assert_eq!(claim(&s, "a", None).await.unwrap(), 1);
        claim(&s, "b", Some(RestoredFrom { id: 9, epoch: 1 })).await.unwrap();
        claim(&s, "c", Some(RestoredFrom { id: 14, epoch: 2 })).await.unwrap();
        claim(&s, "d", Some(RestoredFrom { id: 5, epoch: 1 })).await.unwrap();
        claim(&s, "e", Some(RestoredFrom { id: 20, epoch: 3 })).await.unwrap();
        let l = lineage(&s, RestoredFrom { id: 20, epoch: 3 }).await.unwrap().unwrap();
        assert_eq!(l, Lineage { segments: vec![(3, 20), (2, 14), (1, 9)], floor: 1 });
        assert_eq!(l.contains(1, 9), Some(true));
        assert_eq!(l.contains(1, 10), Some(false), "1's output after 9 is not in this history");
        assert_eq!(l.contains(4, 21), Some(false), "the rewound run's output is not either");
        let rewound = lineage(&s, RestoredFrom { id: 30, epoch: 4 }).await.unwrap().unwrap();
        assert_eq!(rewound.segments, vec![(4, 30), (1, 5)]);
        assert_eq!(lineage(&s, RestoredFrom { id: 3, epoch: 0 }).await.unwrap(), None, "written before epochs");
    }
}
