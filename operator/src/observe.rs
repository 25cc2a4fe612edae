//! Turning what the cluster and storage show into the planner's [`Observation`] inputs: the
//! phase of a job's pods, and the checkpoints in its storage with a verdict on each (so that
//! a relaunch uses the newest *valid* one even when the runtime is gone).

use weir_checkpoint::recovery::{self, Verdict};
use weir_checkpoint::{layout, Storage, StorageError};
use weir_crds::streamjob::SnapshotRef;

use crate::children::SPEC_HASH_LABEL;
use crate::plan::{FoundCheckpoint, PodsPhase};
use crate::runtime_pod::RuntimePod;

/// The phase of a job's runtime pods and the spec hash they were built from.
pub fn pods_phase(pods: &[RuntimePod]) -> (PodsPhase, Option<String>) {
    if pods.is_empty() {
        return (PodsPhase::Absent, None);
    }
    let hash = pods.iter().find_map(|p| p.metadata.labels.as_ref().and_then(|l| l.get(SPEC_HASH_LABEL).cloned()));
    if pods.iter().any(|p| p.metadata.deletion_timestamp.is_some()) {
        return (PodsPhase::Terminating, hash);
    }
    let mut all_running = true;
    let mut all_succeeded = true;
    for p in pods {
        let status = p.status.as_ref();
        let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("Pending");
        let terminated = p.terminations().find(|t| t.exit_code != 0);
        if phase == "Failed" || terminated.is_some() {
            // The runtime's termination message says why (e.g. each restore point and its
            // defect when none could be restored), without secrets; bounded for status.
            let reason = terminated
                .map(|t| {
                    let message = t
                        .message
                        .as_deref()
                        .map(str::trim)
                        .filter(|m| !m.is_empty())
                        .map(|m| format!(": {}", m.chars().take(600).collect::<String>()))
                        .unwrap_or_default();
                    format!(
                        "container exited {}{}{message}",
                        t.exit_code,
                        t.reason.as_ref().map(|r| format!(" ({r})")).unwrap_or_default()
                    )
                })
                .or_else(|| status.and_then(|s| s.reason.clone()))
                .unwrap_or_else(|| "pod failed".into());
            let name = p.metadata.name.clone().unwrap_or_default();
            return (PodsPhase::Failed(format!("{name}: {reason}")), hash);
        }
        all_running &= phase == "Running";
        all_succeeded &= phase == "Succeeded";
    }
    let phase = if all_succeeded {
        PodsPhase::Succeeded
    } else if all_running {
        PodsPhase::Running
    } else {
        PodsPhase::Starting
    };
    (phase, hash)
}

/// The savepoint a stopped runtime reported in its termination message (`savepoint=<path>`).
pub fn stopped_with_savepoint(pods: &[RuntimePod]) -> Option<String> {
    pods.iter().flat_map(RuntimePod::terminations).filter(|t| t.exit_code == 0).find_map(|t| {
        t.message.as_deref()?.lines().find_map(|l| l.strip_prefix("savepoint=").map(|p| p.trim().to_string()))
    })
}

/// The checkpoints under a job's storage root, newest first, each with its verdict.
pub async fn checkpoints(storage: &Storage) -> Result<Vec<FoundCheckpoint>, StorageError> {
    let mut out = Vec::new();
    for (id, verdict, metadata) in recovery::list_checkpoints(storage).await? {
        let path = storage.url_of(&layout::checkpoint_dir(id));
        let completed_at_ms = metadata.as_ref().map_or(0, |m| m.created_at_ms);
        out.push(FoundCheckpoint {
            snapshot: SnapshotRef { id, path, completed_at: None },
            completed_at_ms,
            invalid: match verdict {
                Verdict::Valid => None,
                Verdict::Invalid(why) => Some(why),
                Verdict::Incomplete => Some("no _metadata (incomplete or aborted)".to_string()),
            },
            state_layouts: metadata
                .map(|m| m.operators.into_iter().map(|(uid, op)| (uid, op.state_layout)).collect())
                .unwrap_or_default(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use std::collections::BTreeMap;
    use weir_checkpoint::metadata::{CheckpointMetadata, SnapshotKind, FORMAT_VERSION};

    fn pod(phase: &str, hash: &str, exit: Option<i32>) -> RuntimePod {
        let mut p: RuntimePod = serde_yaml::from_str(&format!(
            "metadata: {{ name: p, labels: {{ {SPEC_HASH_LABEL}: {hash} }} }}\nstatus: {{ phase: {phase} }}"
        ))
        .unwrap();
        if let Some(code) = exit {
            let cs: crate::runtime_pod::RuntimeContainerStatus = serde_yaml::from_str(&format!(
                "{{ name: runtime, image: x, imageID: x, ready: false, restartCount: 0, \
                     state: {{ terminated: {{ exitCode: {code}, reason: OOMKilled }} }} }}"
            ))
            .unwrap();
            p.status.as_mut().unwrap().container_statuses = vec![cs];
        }
        p
    }

    #[test]
    fn pod_phases() {
        assert_eq!(pods_phase(&[]), (PodsPhase::Absent, None));
        assert_eq!(pods_phase(&[pod("Running", "h1", None)]), (PodsPhase::Running, Some("h1".into())));
        assert_eq!(pods_phase(&[pod("Pending", "h1", None)]).0, PodsPhase::Starting);
        assert_eq!(pods_phase(&[pod("Succeeded", "h1", None)]).0, PodsPhase::Succeeded);
        let (failed, _) = pods_phase(&[pod("Running", "h1", Some(137))]);
        assert_eq!(failed, PodsPhase::Failed("p: container exited 137 (OOMKilled)".into()));
    }

    #[test]
    fn a_stopped_runtime_reports_its_savepoint() {
        let mut p = pod("Succeeded", "h1", Some(0));
        let cs = &mut p.status.as_mut().unwrap().container_statuses[0];
        cs.state.terminated.as_mut().unwrap().message = Some("savepoint=s3://b/ns/j/savepoints/sp-1-9\n".into());
        assert_eq!(stopped_with_savepoint(&[p]), Some("s3://b/ns/j/savepoints/sp-1-9".into()));
        assert_eq!(stopped_with_savepoint(&[pod("Running", "h1", None)]), None);
    }

    #[tokio::test]
    async fn checkpoints_carry_verdicts_newest_first() {
        let s = Storage::open("memory://").unwrap();
        for id in [1u64, 2] {
            let m = CheckpointMetadata {
                format_version: FORMAT_VERSION,
                checkpoint_id: id,
                kind: SnapshotKind::Checkpoint,
                job_name: "j".into(),
                epoch: 1,
                created_at_ms: id * 1000,
                max_parallelism: 8,
                operators: BTreeMap::new(),
            };
            s.put(&format!("checkpoints/chk-{id}/_metadata"), Bytes::from(m.encode())).await.unwrap();
        }
        s.put("checkpoints/chk-3/op/0.state", Bytes::from_static(b"x")).await.unwrap();
        let found = checkpoints(&s).await.unwrap();
        assert_eq!(found.iter().map(|c| c.snapshot.id).collect::<Vec<_>>(), vec![3, 2, 1]);
        assert!(found[0].invalid.as_deref().unwrap().contains("no _metadata"));
        assert_eq!(found[1].invalid, None);
        assert_eq!(found[1].completed_at_ms, 2000);
    }

    /// A checkpoint whose state file a restore found damaged (and recorded) is invalid to the
    /// operator too, with the record's reason: the status and the relaunch event say why the
    /// runtime will pass over it. What each operator's state holds comes along (an upgrade is
    /// checked against it).
    #[tokio::test]
    async fn a_checkpoint_with_a_recorded_damage_is_invalid_and_says_why() {
        let s = Storage::open("memory://").unwrap();
        let file = weir_checkpoint::FileRef::new("../shared/counts/0-2-1.kv".into(), 3, 0);
        let m = CheckpointMetadata {
            format_version: FORMAT_VERSION,
            checkpoint_id: 2,
            kind: SnapshotKind::Checkpoint,
            job_name: "j".into(),
            epoch: 1,
            created_at_ms: 2000,
            max_parallelism: 8,
            operators: [(
                "counts".to_string(),
                weir_checkpoint::OperatorSnapshot {
                    parallelism: 1,
                    subtasks: vec![weir_checkpoint::SubtaskSnapshot {
                        subtask: 0,
                        key_groups: (0, 8),
                        operator_state: None,
                        keyed_state: vec![file],
                        store_tables: Vec::new(),
                        keyed_entries: None,
                        int_keys: false,
                        table_slot_bytes: None,
                    }],
                    state_layout: Some("aggregate[count]".into()),
                },
            )]
            .into(),
        };
        s.put("checkpoints/chk-2/_metadata", Bytes::from(m.encode())).await.unwrap();
        s.put("checkpoints/shared/counts/0-2-1.kv", Bytes::from_static(b"abc")).await.unwrap();
        let found = checkpoints(&s).await.unwrap();
        assert_eq!(found[0].invalid, None);
        assert_eq!(found[0].state_layouts, [("counts".to_string(), Some("aggregate[count]".to_string()))].into());
        s.put("_damaged/checkpoints/shared/counts/0-2-1.kv", Bytes::from_static(b"bytes 0..3: crc32c mismatch"))
            .await
            .unwrap();
        let found = checkpoints(&s).await.unwrap();
        let why = found[0].invalid.as_deref().unwrap();
        assert!(why.contains("0-2-1.kv: an earlier restore found it damaged (bytes 0..3: crc32c mismatch)"), "{why}");
    }
}
