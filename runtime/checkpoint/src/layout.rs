//! Every object path of a job's checkpoint storage, in one place.
//!
//! ```text
//! <job>/checkpoints/chk-<N>/_metadata
//! <job>/checkpoints/chk-<N>/<uid>/<subtask>.state          operator (non-keyed) state
//! <job>/checkpoints/shared/<uid>/<subtask>-<N>-<seq>.kv    keyed state files, shared by the
//!                                                          incremental checkpoints that list them
//! <job>/checkpoints/shared/<uid>/<subtask>-<N>-<E>-merged.kv  a full image merged from the
//!                                                          chain of checkpoint N
//! <job>/checkpoints/shared/<uid>/<subtask>-<N>-<E>-merged-<i>.sst  that image as the rocksdb
//!                                                          backend's table files
//! <job>/checkpoints/shared/<uid>/<subtask>-<N>-<E>.staged  a merge staged by an older Weir
//! <job>/savepoints/sp-<time>-<N>/_metadata                 self-contained, relocatable
//! <job>/savepoints/sp-<time>-<N>/<uid>/<subtask>.state|.kv
//! <job>/_epochs/<E>                                        fencing: one claim per start
//! ```
//! Operator-state files are named `<subtask>-<E>.state` and shared files
//! `<subtask>-<N>-<E>.kv`, with `E` the epoch of the run that wrote them, so two runs on one
//! root (a stale one that has not noticed it lost its epoch, and its replacement) never write
//! the same object; `_metadata` is written create-only, so one of them wins each `chk-N`.
//! File references inside `_metadata` are relative to the directory holding `_metadata`
//! (checkpoints reach shared files with `../shared/...`).

/// Name of the metadata object in a checkpoint or savepoint directory.
pub const METADATA: &str = "_metadata";
/// Directory of epoch claims under the job root.
pub const EPOCHS: &str = "_epochs";
/// Directory of periodic checkpoints under the job root.
pub const CHECKPOINTS: &str = "checkpoints";
/// Directory of shared (incremental) files under the checkpoints directory.
pub const SHARED: &str = "shared";
/// Directory of savepoints under the job root.
pub const SAVEPOINTS: &str = "savepoints";
/// Directory of damage records under a storage root: a restore that found a state file
/// damaged after it had started (a stretch of an increment read alone) records it here, at
/// the file's own path, so that no later restore picks a snapshot that needs the file.
/// Nothing deletes them.
pub const DAMAGED: &str = "_damaged";

/// The damage record of the state file at `path` (relative to the storage root).
pub fn damage_record(path: &str) -> String {
    format!("{DAMAGED}/{path}")
}

/// Directory of checkpoint `id`, relative to the job root.
pub fn checkpoint_dir(id: u64) -> String {
    format!("{CHECKPOINTS}/chk-{id}")
}

/// Parses `chk-<N>` (a directory name) into `N`.
pub fn parse_checkpoint_dir(name: &str) -> Option<u64> {
    name.strip_prefix("chk-")?.parse().ok()
}

/// Directory of a savepoint, relative to the job root.
pub fn savepoint_dir(time_ms: u64, id: u64) -> String {
    format!("{SAVEPOINTS}/sp-{time_ms}-{id}")
}

/// Parses `sp-<time>-<N>` into `(time, N)`.
pub fn parse_savepoint_dir(name: &str) -> Option<(u64, u64)> {
    let rest = name.strip_prefix("sp-")?;
    let (time, id) = rest.split_once('-')?;
    Some((time.parse().ok()?, id.parse().ok()?))
}

/// The claim of epoch `epoch`, relative to the job root.
pub fn epoch_claim(epoch: u64) -> String {
    format!("{EPOCHS}/{epoch:020}")
}

/// Where the run of `epoch` records its start ([`crate::epoch::record_start`]): beside its
/// claim, under a name [`parse_epoch_claim`] does not take for a claim.
pub fn epoch_start(epoch: u64) -> String {
    format!("{}.start", epoch_claim(epoch))
}

/// Parses an epoch claim's name.
pub fn parse_epoch_claim(name: &str) -> Option<u64> {
    if name.len() != 20 || !name.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    name.parse().ok()
}

/// Operator state file of one subtask written in `epoch`, relative to its checkpoint or
/// savepoint directory.
pub fn operator_state_file(uid: &str, subtask: u32, epoch: u64) -> String {
    format!("{uid}/{subtask}-{epoch}.state")
}

/// A shared keyed-state file created by checkpoint `id` in `epoch`, relative to a checkpoint
/// directory.
pub fn shared_keyed_file(uid: &str, subtask: u32, id: u64, epoch: u64) -> String {
    format!("../{SHARED}/{uid}/{subtask}-{id}-{epoch}.kv")
}

/// A full image merged in the background from the chain of checkpoint `id` in `epoch`, listed
/// by a later checkpoint once adopted (relative to a checkpoint directory). Until then no
/// checkpoint lists it, though its name says a complete checkpoint created it: the run protects
/// it from retention (`retention::PendingFiles`).
pub fn shared_merged_file(uid: &str, subtask: u32, id: u64, epoch: u64) -> String {
    format!("../{SHARED}/{uid}/{subtask}-{id}-{epoch}-merged.kv")
}

/// A run of increments of checkpoint `id`'s chain in `epoch` merged in the background into one
/// increment (relative to a checkpoint directory); protected from retention as
/// [`shared_merged_file`] is until a checkpoint lists it.
pub fn shared_merged_increment(uid: &str, subtask: u32, id: u64, epoch: u64) -> String {
    format!("../{SHARED}/{uid}/{subtask}-{id}-{epoch}-merged-increment.kv")
}

/// Where a merge was staged by a Weir that renamed merges on adoption (relative to a checkpoint
/// directory); retention deletes those of earlier runs.
pub fn shared_staged_merge(uid: &str, subtask: u32, id: u64, epoch: u64) -> String {
    format!("../{SHARED}/{uid}/{subtask}-{id}-{epoch}.staged")
}

/// Table file `index` of the merged full image of checkpoint `id`'s chain in `epoch` (see
/// [`shared_merged_file`]), relative to a checkpoint directory.
pub fn shared_merged_table(uid: &str, subtask: u32, id: u64, epoch: u64, index: usize) -> String {
    format!("../{SHARED}/{uid}/{subtask}-{id}-{epoch}-merged-{index}.sst")
}

/// File `index` of a keyed-state chain restored from another root (another job's, a
/// savepoint), copied into this root by checkpoint `id` in `epoch` so that the job's chain can
/// go on from it (relative to a checkpoint directory). Named for the checkpoint that copies it,
/// as its increment is: retention keeps it while a checkpoint lists it, like any shared file.
pub fn shared_adopted_file(uid: &str, subtask: u32, id: u64, epoch: u64, index: usize) -> String {
    format!("../{SHARED}/{uid}/{subtask}-{id}-{epoch}-adopted-{index}.kv")
}

/// A shared file's name without its kind: `.kv` (state files) or `.sst` (table files).
fn shared_stem(file_name: &str) -> Option<&str> {
    file_name.strip_suffix(".kv").or_else(|| file_name.strip_suffix(".sst"))
}

/// The epoch of a staged merge (from its name `<subtask>-<N>-<E>.staged`).
pub fn staged_merge_epoch(file_name: &str) -> Option<u64> {
    file_name.strip_suffix(".staged")?.split('-').nth(2)?.parse().ok()
}

/// The epoch that wrote a shared file (from its name `<subtask>-<N>-<E>….kv|.sst`).
pub fn shared_file_epoch(file_name: &str) -> Option<u64> {
    shared_stem(file_name)?.split('-').nth(2)?.parse().ok()
}

/// A savepoint's keyed-state file, relative to the savepoint directory.
pub fn savepoint_keyed_file(uid: &str, subtask: u32) -> String {
    format!("{uid}/{subtask}.kv")
}

/// The checkpoint id that created a shared file (from its name `<subtask>-<N>-….kv|.sst`).
pub fn shared_file_creator(file_name: &str) -> Option<u64> {
    let stem = shared_stem(file_name)?;
    let mut parts = stem.split('-');
    let _subtask = parts.next()?;
    parts.next()?.parse().ok()
}

/// Joins a directory and a relative reference, resolving `..` segments.
pub fn resolve(dir: &str, relative: &str) -> String {
    let mut parts: Vec<&str> = dir.split('/').filter(|p| !p.is_empty()).collect();
    for seg in relative.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            s => parts.push(s),
        }
    }
    parts.join("/")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        assert_eq!(parse_checkpoint_dir(&checkpoint_dir(42)["checkpoints/".len()..]), Some(42));
        assert_eq!(parse_savepoint_dir("sp-1700-9"), Some((1700, 9)));
        assert_eq!(shared_file_creator("3-17-0.kv"), Some(17));
        assert_eq!(shared_file_epoch(&shared_keyed_file("op", 3, 17, 9)["../shared/op/".len()..]), Some(9));
        assert_eq!(parse_epoch_claim(&epoch_claim(12)["_epochs/".len()..]), Some(12));
        let merged = &shared_merged_file("op", 3, 17, 9)["../shared/op/".len()..];
        assert_eq!((shared_file_creator(merged), shared_file_epoch(merged)), (Some(17), Some(9)));
        let staged = &shared_staged_merge("op", 3, 17, 9)["../shared/op/".len()..];
        assert_eq!((shared_file_creator(staged), shared_file_epoch(staged)), (None, None));
        assert_eq!(staged_merge_epoch(staged), Some(9));
        let increment = &shared_merged_increment("op", 3, 17, 9)["../shared/op/".len()..];
        assert_eq!((shared_file_creator(increment), shared_file_epoch(increment)), (Some(17), Some(9)));
        let table = &shared_merged_table("op", 3, 17, 9, 4)["../shared/op/".len()..];
        assert_eq!((shared_file_creator(table), shared_file_epoch(table)), (Some(17), Some(9)));
        let adopted = &shared_adopted_file("op", 3, 17, 9, 2)["../shared/op/".len()..];
        assert_eq!((shared_file_creator(adopted), shared_file_epoch(adopted)), (Some(17), Some(9)));
        assert_eq!(parse_epoch_claim("12"), None);
        assert_eq!(parse_checkpoint_dir("chk-x"), None);
    }

    #[test]
    fn resolves_shared_references_from_a_checkpoint_dir() {
        let dir = checkpoint_dir(7);
        let shared = shared_keyed_file("counts", 1, 5, 0);
        assert_eq!(resolve(&dir, &shared), "checkpoints/shared/counts/1-5-0.kv");
        assert_eq!(resolve("savepoints/sp-1-2", "a/0.kv"), "savepoints/sp-1-2/a/0.kv");
    }
}
