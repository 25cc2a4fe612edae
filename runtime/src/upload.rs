//! The asynchronous part of a snapshot: one uploader thread per task encodes keyed state,
//! stages sink data, writes state files and acknowledges (or declines) to the coordinator.
//! Uploads of a task happen in barrier order, so an increment is only written after the file
//! it builds on; when an upload fails, later increments are declined until a full image has
//! been written again. Sink data whose staging failed is kept and staged again before any
//! later checkpoint of the task is acknowledged: a later checkpoint's state still lists that
//! transaction as pending, so it must not complete without the data.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use crossbeam_channel::{Receiver, Sender};
use weir_checkpoint::format::{FileKind, StateFileWriter};
use weir_checkpoint::protocol::TaskId;
use weir_checkpoint::{layout, FileRef, Storage, SubtaskSnapshot};

use crate::faults::{Fault, Faults};
use crate::message::{Barrier, Event, OperatorAck, SnapshotTarget, TaskAck};
use crate::operator::{StagedWrite, StateParts};

/// A snapshot handed from a task to its uploader.
pub struct UploadJob {
    /// The barrier it belongs to.
    pub barrier: Barrier,
    /// Which task.
    pub task: TaskId,
    /// Its subtask index.
    pub subtask: u32,
    /// Its parallelism.
    pub parallelism: u32,
    /// Its key groups.
    pub key_groups: (u32, u32),
    /// Per stateful operator uid.
    pub parts: Vec<(String, StateParts)>,
    /// Alignment time.
    pub alignment_ms: u64,
}

#[derive(Default)]
struct Chain {
    files: Vec<FileRef>,
    broken: bool,
}

/// Runs the uploader of one task until its task drops the sender.
pub fn run(
    jobs: Receiver<UploadJob>,
    storage: Storage,
    epoch: u64,
    events: Sender<Event>,
    faults: Faults,
    restored_chains: HashMap<String, Vec<FileRef>>,
) {
    let mut chains: HashMap<String, Chain> =
        restored_chains.into_iter().map(|(uid, files)| (uid, Chain { files, broken: false })).collect();
    let mut unstaged: Vec<StagedWrite> = Vec::new();
    for job in jobs {
        let id = job.barrier.id;
        let task = job.task;
        let result = crate::io().block_on(upload(&storage, epoch, &faults, &mut chains, &mut unstaged, job));
        let event = match result {
            Ok(ack) => Event::Ack { id, task, ack },
            Err(reason) => Event::Decline { id, task, reason },
        };
        if events.send(event).is_err() {
            return;
        }
    }
}

async fn upload(
    storage: &Storage,
    epoch: u64,
    faults: &Faults,
    chains: &mut HashMap<String, Chain>,
    unstaged: &mut Vec<StagedWrite>,
    job: UploadJob,
) -> Result<TaskAck, String> {
    let savepoint_dir = match &job.barrier.target {
        SnapshotTarget::Savepoint { dir } => Some(dir.clone()),
        SnapshotTarget::Checkpoint => None,
    };
    let base = savepoint_dir.clone().unwrap_or_else(|| layout::checkpoint_dir(job.barrier.id));
    let mut ack = TaskAck { alignment_ms: job.alignment_ms, ..TaskAck::default() };
    let mut flags = Vec::new();
    // Sink data joins the queue before anything can fail: the sink lists its transaction as
    // pending from now on, so a later checkpoint must not complete without it.
    for parts in job.parts.iter() {
        unstaged.extend(parts.1.staged.iter().cloned());
        ack.pending_commits.extend(parts.1.pending_commits.iter().cloned());
    }
    let outcome: Result<(), String> = async {
        if savepoint_dir.is_some() && faults.fires(Fault::Savepoint) {
            return Err("injected fault: savepoint upload refused".to_string());
        }
        while let Some(staged) = unstaged.first() {
            if faults.fires(Fault::Upload) {
                return Err(format!("injected fault: staging {} failed", staged.path));
            }
            ack.bytes += staged.data.len() as u64;
            staged
                .storage
                .put(&staged.path, staged.data.clone())
                .await
                .map_err(|e| format!("staging sink data: {e}"))?;
            unstaged.remove(0);
        }
        for (uid, parts) in job.parts {
            if let Some(flag) = &parts.force_full {
                flags.push((uid.clone(), flag.clone()));
            }
            let mut snap = SubtaskSnapshot {
                subtask: job.subtask,
                key_groups: job.key_groups,
                operator_state: None,
                keyed_state: Vec::new(),
            };
            if let Some(doc) = parts.operator_doc {
                let mut w = StateFileWriter::new(FileKind::OperatorState, doc.len());
                w.document(&doc);
                let (data, crc) = w.finish();
                let rel = layout::operator_state_file(&uid, job.subtask, epoch);
                if faults.fires(Fault::Upload) {
                    return Err(format!("injected fault: upload of {rel} failed"));
                }
                let len = data.len() as u64;
                storage
                    .put(&layout::resolve(&base, &rel), data)
                    .await
                    .map_err(|e| format!("uploading operator state of `{uid}`: {e}"))?;
                ack.bytes += len;
                snap.operator_state = Some(FileRef { path: rel, len, crc32c: crc });
            }
            if let Some(keyed) = parts.keyed {
                let kind = keyed.kind;
                let chain = chains.entry(uid.clone()).or_default();
                if savepoint_dir.is_none() && kind == FileKind::KeyedIncrement && chain.broken {
                    return Err(format!("`{uid}`: an earlier increment was lost; waiting for a full image"));
                }
                let (len, crc) = (keyed.len(), keyed.crc32c);
                let rel = match &savepoint_dir {
                    Some(_) => layout::savepoint_keyed_file(&uid, job.subtask),
                    None => layout::shared_keyed_file(&uid, job.subtask, job.barrier.id, epoch),
                };
                if faults.fires(Fault::Upload) {
                    return Err(format!("injected fault: upload of {rel} failed"));
                }
                let target = layout::resolve(&base, &rel);
                match &keyed.file {
                    // A full image larger than memory, streamed from local disk.
                    Some(file) => storage.put_file(&target, &file.path).await,
                    None => storage.put(&target, keyed.data.clone()).await,
                }
                .map_err(|e| format!("uploading keyed state of `{uid}`: {e}"))?;
                drop(keyed);
                ack.bytes += len;
                let file = FileRef { path: rel, len, crc32c: crc };
                if savepoint_dir.is_some() {
                    snap.keyed_state = vec![file];
                } else {
                    if kind == FileKind::KeyedFull {
                        chain.files.clear();
                        chain.broken = false;
                    }
                    chain.files.push(file);
                    snap.keyed_state = chain.files.clone();
                }
            }
            ack.operators.push(OperatorAck { uid, parallelism: job.parallelism, snapshot: snap });
        }
        Ok(())
    }
    .await;
    if let Err(reason) = outcome {
        if savepoint_dir.is_none() {
            // The lost file may be an increment others build on: the next snapshot is full.
            for (uid, flag) in flags {
                flag.store(true, Ordering::Release);
                chains.entry(uid).or_default().broken = true;
            }
        }
        return Err(reason);
    }
    Ok(ack)
}
