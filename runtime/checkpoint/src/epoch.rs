//! Fencing epochs: every start of a job claims a number that only grows, in the job's own
//! storage, with a create-only write (`_epochs/<E>`, S3 `If-None-Match: *`). A runtime checks
//! that no newer claim exists before it publishes a checkpoint's `_metadata` and before it
//! commits output, and stops once one does. So a runtime left over from an earlier start (a
//! frozen process, a pod on a partitioned node, a force-deleted container) stops writing as
//! soon as its replacement has started, instead of interleaving its checkpoints and output
//! with the replacement's.
//!
//! A run claims its epoch *before* it chooses its restore point, then records the point
//! create-only beside the claim (`_epochs/<E>.start`, [`record_start`]) and only then writes
//! anything. The claim fences the previous run while the new one lists and loads (minutes,
//! with large state), and the start records make the job's history a chain that storage
//! keeps: [`history_before`] traces it back from the newest run that started, through the
//! restore point each run started from ([`lineage`]). A restore takes only checkpoints in that
//! history, so a checkpoint that a stale run published after its check (it passed the check,
//! then paused, then wrote `_metadata`) is never restored: its epoch's segment of the history
//! ends at the point its successor restored. Sinks show exactly the output of the history.
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
    /// The restore point the run started from, when the claim records it itself (claims
    /// written before start records existed; see [`Claim::start_apart`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restored: Option<RestoredFrom>,
    /// The run records its start apart ([`record_start`]): it started only once that record
    /// exists. Claims without it started when they were written, from [`Claim::restored`].
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub start_apart: bool,
}

/// What a run records once it has chosen its restore point, before it writes anything.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Start {
    /// The restore point the run started from; `None` for a fresh start.
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

    /// Whether a restore may take checkpoint `checkpoint` written by epoch `epoch`: when it is
    /// in the history, or was written before epochs existed (epoch 0, nothing to judge by).
    pub fn admits(&self, epoch: u64, checkpoint: u64) -> bool {
        epoch == 0 || self.contains(epoch, checkpoint) == Some(true)
    }

    /// Why [`Lineage::admits`] refuses checkpoint `checkpoint` of epoch `epoch`.
    pub fn refusal(&self, epoch: u64, checkpoint: u64) -> String {
        match self.segments.iter().find(|(e, _)| *e == epoch) {
            Some((_, up_to)) => format!(
                "not in the job's history: epoch {epoch} wrote checkpoint {checkpoint} after {up_to}, the one \
                 the next run of the job restored (a superseded run that had not yet stopped)"
            ),
            None if epoch < self.floor => format!(
                "not in the job's history: epoch {epoch} predates epoch {}, which started the history afresh",
                self.floor
            ),
            None => format!("not in the job's history: no run in it restored from epoch {epoch}"),
        }
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

/// Whether (and from where) the run of `epoch` started: `None` when it never did (or its
/// claim is gone or unreadable).
pub async fn read_start(storage: &Storage, epoch: u64) -> Result<Option<Start>, StorageError> {
    let Some(claim) = read_claim(storage, epoch).await? else { return Ok(None) };
    if !claim.start_apart {
        return Ok(Some(Start { restored: claim.restored }));
    }
    match storage.get(&layout::epoch_start(epoch)).await {
        Ok(bytes) => Ok(serde_json::from_slice(&bytes).ok()),
        Err(StorageError::NotFound(_)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Traces the history of restore point `point` back through the start records under
/// `storage`; `None` when the point's epoch is unknown (written before epochs existed).
pub async fn lineage(storage: &Storage, point: RestoredFrom) -> Result<Option<Lineage>, StorageError> {
    if point.epoch == 0 {
        return Ok(None);
    }
    let mut segments = vec![(point.epoch, point.id)];
    let mut floor = point.epoch;
    let mut at = point.epoch;
    // Each step goes to a strictly older epoch, so this ends.
    while let Some(Start { restored: Some(from) }) = read_start(storage, at).await? {
        if from.epoch == 0 || from.epoch >= at {
            break;
        }
        segments.push((from.epoch, from.id));
        floor = from.epoch;
        at = from.epoch;
    }
    Ok(Some(Lineage { segments, floor }))
}

/// The history a run of epoch `next` continues: everything the newest earlier run that
/// started wrote, and back from its restore point as [`lineage`] traces it. `None` when no
/// earlier run started (a new job root).
pub async fn history_before(storage: &Storage, next: u64) -> Result<Option<Lineage>, StorageError> {
    let mut epochs: Vec<u64> = storage
        .list(layout::EPOCHS)
        .await?
        .iter()
        .filter_map(|p| p.rsplit('/').next().and_then(layout::parse_epoch_claim))
        .filter(|e| *e < next)
        .collect();
    epochs.sort_unstable_by(|a, b| b.cmp(a));
    for epoch in epochs {
        let Some(start) = read_start(storage, epoch).await? else { continue };
        let mut history = Lineage { segments: vec![(epoch, u64::MAX)], floor: epoch };
        if let Some(from) = start.restored.filter(|f| f.epoch != 0 && f.epoch < epoch) {
            if let Some(before) = lineage(storage, from).await? {
                history.segments.extend(before.segments);
                history.floor = before.floor;
            }
        }
        return Ok(Some(history));
    }
    Ok(None)
}

/// The newest epoch claimed under a job root (0 when none).
pub async fn newest(storage: &Storage) -> Result<u64, StorageError> {
    let claims = storage.list(layout::EPOCHS).await?;
    Ok(claims.iter().filter_map(|p| p.rsplit('/').next().and_then(layout::parse_epoch_claim)).max().unwrap_or(0))
}

/// The history the next run would continue (whatever epoch it claims): [`history_before`]
/// every claim, from one listing of the claims.
pub async fn current_history(storage: &Storage) -> Result<Option<Lineage>, StorageError> {
    history_before(storage, u64::MAX).await
}

/// Claims the next epoch; `holder` (e.g. host and process id) is written into the claim. The
/// run has not started until [`record_start`] says where from.
pub async fn claim(storage: &Storage, holder: &str) -> Result<u64, EpochError> {
    for _ in 0..CLAIM_ATTEMPTS {
        let next = newest(storage).await? + 1;
        let claim = Claim { epoch: next, holder: holder.to_string(), restored: None, start_apart: true };
        let body = serde_json::to_vec(&claim).expect("claim serializes");
        match storage.put_if_absent(&layout::epoch_claim(next), Bytes::from(body)).await {
            Ok(()) => return Ok(next),
            Err(StorageError::AlreadyExists(_)) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(EpochError::Contended(CLAIM_ATTEMPTS))
}

/// Records, create-only, that the run of `epoch` starts from `restored`, then checks that it
/// still holds the newest epoch: a run superseded before its start was recorded never starts
/// (and so never enters the job's history).
pub async fn record_start(storage: &Storage, epoch: u64, restored: Option<RestoredFrom>) -> Result<(), EpochError> {
    let body = serde_json::to_vec(&Start { restored }).expect("start serializes");
    storage.put_if_absent(&layout::epoch_start(epoch), Bytes::from(body)).await?;
    check(storage, epoch).await
}

/// Claims the next epoch and records its start from `restored` at once: for a run that has
/// nothing to choose (tests, tools).
pub async fn claim_started(storage: &Storage, holder: &str, restored: Option<RestoredFrom>) -> Result<u64, EpochError> {
    let epoch = claim(storage, holder).await?;
    record_start(storage, epoch, restored).await?;
    Ok(epoch)
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
        let a = claim_started(&s, "a", None).await.unwrap();
        check(&s, a).await.unwrap();
        let b = claim_started(&s, "b", None).await.unwrap();
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
            handles.push(tokio::spawn(async move { claim(&s, &format!("run-{i}")).await.unwrap() }));
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
        assert_eq!(claim_started(&s, "a", None).await.unwrap(), 1);
        claim_started(&s, "b", Some(RestoredFrom { id: 9, epoch: 1 })).await.unwrap();
        claim_started(&s, "c", Some(RestoredFrom { id: 14, epoch: 2 })).await.unwrap();
        claim_started(&s, "d", Some(RestoredFrom { id: 5, epoch: 1 })).await.unwrap();
        claim_started(&s, "e", Some(RestoredFrom { id: 20, epoch: 3 })).await.unwrap();
        let l = lineage(&s, RestoredFrom { id: 20, epoch: 3 }).await.unwrap().unwrap();
        assert_eq!(l, Lineage { segments: vec![(3, 20), (2, 14), (1, 9)], floor: 1 });
        assert_eq!(l.contains(1, 9), Some(true));
        assert_eq!(l.contains(1, 10), Some(false), "1's output after 9 is not in this history");
        assert_eq!(l.contains(4, 21), Some(false), "the rewound run's output is not either");
        let rewound = lineage(&s, RestoredFrom { id: 30, epoch: 4 }).await.unwrap().unwrap();
        assert_eq!(rewound.segments, vec![(4, 30), (1, 5)]);
        assert_eq!(lineage(&s, RestoredFrom { id: 3, epoch: 0 }).await.unwrap(), None, "written before epochs");
    }

    /// The history the next run continues starts at the newest run that recorded its start:
    /// a run that claimed and never started (it died while loading, or was superseded first)
    /// adds nothing, and what a superseded run wrote after its successor's restore point is
    /// not in it.
    #[tokio::test]
    async fn the_next_run_continues_the_newest_run_that_started() {
        let s = Storage::open("memory://").unwrap();
        assert_eq!(history_before(&s, 1).await.unwrap(), None, "a new root has no history");
        claim_started(&s, "a", None).await.unwrap();
        // 2 claims, and 1 (not yet stopped) is fenced from then on; 2 restores 1's 9.
        let two = claim(&s, "b").await.unwrap();
        assert!(matches!(check(&s, 1).await, Err(EpochError::Superseded { mine: 1, newest: 2 })));
        record_start(&s, two, Some(RestoredFrom { id: 9, epoch: 1 })).await.unwrap();
        // 3 claims and dies while loading its state, before recording its start.
        let three = claim(&s, "c").await.unwrap();
        let four = claim(&s, "d").await.unwrap();
        let history = history_before(&s, four).await.unwrap().unwrap();
        assert_eq!(history, Lineage { segments: vec![(2, u64::MAX), (1, 9)], floor: 1 });
        assert!(history.admits(2, 40), "everything the newest started run wrote");
        assert!(history.admits(1, 9) && history.admits(1, 3));
        assert!(!history.admits(1, 10), "published by 1 after 2 restored 9");
        assert!(history.refusal(1, 10).contains("epoch 1 wrote checkpoint 10 after 9"), "{}", history.refusal(1, 10));
        assert!(!history.admits(three, 41), "3 never started");
        assert!(history.admits(0, 5), "written before epochs: nothing to judge by");
        // A run superseded before it recorded its start never starts.
        assert!(matches!(
            record_start(&s, three, None).await,
            Err(EpochError::Superseded { mine, newest }) if mine == three && newest == four
        ));
    }

    /// Claims that record their restore point themselves (no start record) started when they
    /// were written: their history is traced as before.
    #[tokio::test]
    async fn claims_without_a_start_record_started_from_their_own_restore_point() {
        let s = Storage::open("memory://").unwrap();
        for (epoch, restored) in [(1, None), (2, Some(RestoredFrom { id: 9, epoch: 1 }))] {
            let claim = Claim { epoch, holder: "old".into(), restored, start_apart: false };
            let body = serde_json::to_vec(&claim).unwrap();
            assert!(!String::from_utf8_lossy(&body).contains("start_apart"));
            s.put_if_absent(&layout::epoch_claim(epoch), Bytes::from(body)).await.unwrap();
        }
        let three = claim_started(&s, "new", Some(RestoredFrom { id: 20, epoch: 2 })).await.unwrap();
        assert_eq!(three, 3);
        let history = history_before(&s, 4).await.unwrap().unwrap();
        assert_eq!(history.segments, vec![(3, u64::MAX), (2, 20), (1, 9)]);
        assert_eq!(read_start(&s, 2).await.unwrap(), Some(Start { restored: Some(RestoredFrom { id: 9, epoch: 1 }) }));
    }
}
