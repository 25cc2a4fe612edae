//! Fencing epochs: every start of a job claims a number that only grows, in the job's own
//! storage, with a create-only write (`_epochs/<E>`, S3 `If-None-Match: *`). A runtime checks
//! that no newer claim exists before it publishes a checkpoint's `_metadata` and before it
//! commits output, and stops once one does. So a runtime left over from an earlier start (a
//! frozen process, a pod on a partitioned node, a force-deleted container) stops writing as
//! soon as its replacement has started, instead of interleaving its checkpoints and output
//! with the replacement's.
//!
//! Claims are create-only objects rather than one `_epoch` object updated with
//! compare-and-swap because object_store's local filesystem store has no conditional update
//! (`PutMode::Update`), while every store it supports, the local one included, has
//! create-only writes; the claims also tell who started when.

use bytes::Bytes;

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

/// The newest epoch claimed under a job root (0 when none).
pub async fn newest(storage: &Storage) -> Result<u64, StorageError> {
    let claims = storage.list(layout::EPOCHS).await?;
    Ok(claims.iter().filter_map(|p| p.rsplit('/').next().and_then(layout::parse_epoch_claim)).max().unwrap_or(0))
}

/// Claims the next epoch; `holder` (e.g. host and process id) is written into the claim.
pub async fn claim(storage: &Storage, holder: &str) -> Result<u64, EpochError> {
    for _ in 0..CLAIM_ATTEMPTS {
        let next = newest(storage).await? + 1;
        let body = format!("{{\"epoch\":{next},\"holder\":{}}}\n", serde_json::Value::String(holder.to_string()));
        match storage.put_if_absent(&layout::epoch_claim(next), Bytes::from(body)).await {
            Ok(()) => return Ok(next),
            Err(StorageError::AlreadyExists(_)) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(EpochError::Contended(CLAIM_ATTEMPTS))
}

/// Succeeds while `mine` is still the newest epoch.
pub async fn check(storage: &Storage, mine: u64) -> Result<(), EpochError> {
    let newest = newest(storage).await?;
    if newest > mine {
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
        let a = claim(&s, "a").await.unwrap();
        check(&s, a).await.unwrap();
        let b = claim(&s, "b").await.unwrap();
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
}
