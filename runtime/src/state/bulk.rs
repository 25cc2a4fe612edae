//! Restores onto the `rocksdb` backend by bulk load: the entries of a restored chain are sorted
//! into runs, the runs merged (the newest entry of a key wins; into an empty store a deletion
//! leaves nothing, over a restore's table files it stays a tombstone), and the result written as
//! table files that the store takes in whole ([`super::StateStore::ingest`]).
//!
//! Writing a restored entry into the store one put at a time costs a memtable insert, a share of
//! a flush and of every compaction after it: 245–465 s per GiB of state files on the keyed count.
//! A chain also repeats most keys (each increment of a count rewrites the keys that changed),
//! and the merge keeps one entry per key, so only the live state reaches the store, written
//! once, in order, into files that sit in the store's last level without being compacted.
//!
//! Memory: one run (at most [`RUN_BYTES`] of entries and their index) while loading, and a
//! 256 KiB buffer per run while merging; runs beyond [`MERGE_FAN_IN`] are merged in passes.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

#[cfg(feature = "rocksdb")]
use rocksdb::SstFileWriter;
use weir_checkpoint::local::SyncedWriter;

#[cfg(feature = "rocksdb")]
use super::store::StateStore;
use super::store::StoreError;

/// The bytes of entries (and of their index) sorted in memory before a run goes to disk.
const RUN_BYTES: usize = 16 << 20;

/// At most this many runs are merged at once (one open file and buffer each).
const MERGE_FAN_IN: usize = 64;

/// A table file is closed and a new one started beyond this size.
#[cfg(feature = "rocksdb")]
const TABLE_BYTES: u64 = 32 << 20;

/// The length that marks a deletion in a run file.
const DELETED: u32 = u32::MAX;

/// One entry of the run in memory.
struct Indexed {
    /// The store key's first 8 bytes, big-endian and zero-padded: most comparisons end here.
    prefix: u64,
    /// Order of arrival: the later of two entries of a key wins.
    seq: u32,
    key: (u32, u32),
    /// Offset and length of the value; length [`DELETED`] for a deletion.
    value: (u32, u32),
}

/// A run sorted and written to disk.
struct RunFile {
    path: PathBuf,
}

impl Drop for RunFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Restored entries on their way into a store (empty, or holding only a restore's table files),
/// in the order the chain applies them.
pub struct BulkLoad {
    dir: PathBuf,
    arena: Vec<u8>,
    index: Vec<Indexed>,
    /// Spilled runs, oldest first.
    runs: Vec<RunFile>,
    run_bytes: usize,
    fan_in: usize,
    next_file: u64,
}

fn io_failed(e: std::io::Error) -> StoreError {
    StoreError::BulkLoad(e)
}

impl BulkLoad {
    /// A bulk load whose runs and table files go under `dir` (created if missing; the store's
    /// own directory, so that they are deleted with it).
    pub fn new(dir: &Path) -> Self {
        Self::with_limits(dir, RUN_BYTES, MERGE_FAN_IN)
    }

    /// [`Self::new`] with other limits: runs of `run_bytes` in memory, and at most `fan_in`
    /// runs (a 256 KiB buffer each) merged at once. Background merges use less memory than
    /// restores; tests force many runs and merge passes.
    pub fn with_limits(dir: &Path, run_bytes: usize, fan_in: usize) -> Self {
        BulkLoad {
            dir: dir.to_path_buf(),
            arena: Vec::new(),
            index: Vec::new(),
            runs: Vec::new(),
            run_bytes: run_bytes.max(1),
            fan_in: fan_in.max(2),
            next_file: 0,
        }
    }

    /// Adds a put (`Some(value)`) or a deletion of a store key; later entries win.
    pub fn add(&mut self, store_key: &[u8], value: Option<&[u8]>) -> Result<(), StoreError> {
        let key_at = self.arena.len() as u32;
        self.arena.extend_from_slice(store_key);
        let value = match value {
            Some(v) => {
                let at = self.arena.len() as u32;
                self.arena.extend_from_slice(v);
                (at, v.len() as u32)
            }
            None => (0, DELETED),
        };
        self.index.push(Indexed {
            prefix: prefix_of(store_key),
            seq: self.index.len() as u32,
            key: (key_at, store_key.len() as u32),
            value,
        });
        if self.arena.len() + self.index.len() * std::mem::size_of::<Indexed>() >= self.run_bytes {
            self.spill_run()?;
        }
        Ok(())
    }

    fn key(&self, e: &Indexed) -> &[u8] {
        &self.arena[e.key.0 as usize..(e.key.0 + e.key.1) as usize]
    }

    fn value(&self, e: &Indexed) -> Option<&[u8]> {
        (e.value.1 != DELETED).then(|| &self.arena[e.value.0 as usize..(e.value.0 + e.value.1) as usize])
    }

    /// Sorts the run in memory by key and keeps the newest entry of each key; the positions in
    /// the index of the survivors.
    fn sorted_run(&mut self) -> Vec<usize> {
        let mut index = std::mem::take(&mut self.index);
        index.sort_unstable_by(|a, b| {
            a.prefix.cmp(&b.prefix).then_with(|| self.key(a).cmp(self.key(b))).then(a.seq.cmp(&b.seq))
        });
        let mut keep = Vec::with_capacity(index.len());
        for i in 0..index.len() {
            let newest_of_key = index
                .get(i + 1)
                .is_none_or(|next| next.prefix != index[i].prefix || self.key(next) != self.key(&index[i]));
            if newest_of_key {
                keep.push(i);
            }
        }
        self.index = index;
        keep
    }

    fn new_path(&mut self, what: &str) -> Result<PathBuf, StoreError> {
        std::fs::create_dir_all(&self.dir).map_err(io_failed)?;
        self.next_file += 1;
        Ok(self.dir.join(format!("{what}-{}", self.next_file)))
    }

    /// Writes the run in memory to disk, sorted, and starts the next one.
    fn spill_run(&mut self) -> Result<(), StoreError> {
        let keep = self.sorted_run();
        let path = self.new_path("run")?;
        let run = RunFile { path };
        let mut out = RunWriter::create(&run.path)?;
        for i in keep {
            let e = &self.index[i];
            out.write(self.key(e), self.value(e))?;
        }
        out.finish()?;
        self.runs.push(run);
        self.arena.clear();
        self.index.clear();
        Ok(())
    }

    /// Loads what was added into `store`: the table files are moved into it, and this load's
    /// directory is deleted. Into an empty store a deletion leaves nothing; `over_existing`
    /// (the store already holds a restore's base tables) keeps deletions as tombstones, so that
    /// they hide the entries below them.
    #[cfg(feature = "rocksdb")]
    pub fn into_store(self, store: &StateStore, over_existing: bool) -> Result<(), StoreError> {
        // Beside this load's directory, which is deleted before they are written out.
        let dir = self.dir.with_extension("tables");
        store.ingest(self.into_tables(&dir, over_existing)?)?;
        let _ = std::fs::remove_dir_all(dir);
        Ok(())
    }

    /// Writes what was added as table files under `dir` (sorted, the newest entry of each key;
    /// deletions kept as tombstones when `keep_deletions`, for a store that holds older entries
    /// of these keys). This load's own directory is deleted.
    #[cfg(feature = "rocksdb")]
    pub fn into_tables(self, dir: &Path, keep_deletions: bool) -> Result<Vec<PathBuf>, StoreError> {
        let own_dir = self.dir.clone();
        let opts = super::store::options();
        let mut tables = TableWriter::new(dir, &opts);
        let merged = self.merge_all(keep_deletions, |key, value| match value {
            Some(value) => tables.put(key, value),
            None => tables.delete(key),
        });
        let _ = std::fs::remove_dir_all(own_dir);
        merged?;
        tables.finish()
    }

    /// Writes what was added as table files split at `starts` (sorted store keys; see
    /// [`super::lazy::Ranges`]): the files of range `i` (keys from `starts[i]` up to the next
    /// start; the first range also holds every key below `starts[0]`) under `dir/<i>/`,
    /// deletions kept as tombstones, for a store that takes each range's base table first.
    /// Ranges without entries have no files. This load's own directory is deleted.
    #[cfg(feature = "rocksdb")]
    pub fn into_range_tables(self, ranges: &super::lazy::Ranges, dir: &Path) -> Result<Vec<Vec<PathBuf>>, StoreError> {
        let own_dir = self.dir.clone();
        let opts = super::store::options();
        let mut by_range: Vec<Vec<PathBuf>> = vec![Vec::new(); ranges.len().max(1)];
        let mut open: Option<(usize, TableWriter<'_>)> = None;
        let merged = self.merge_all(true, |key, value| {
            let range = ranges.range_of(key);
            if open.as_ref().is_none_or(|(r, _)| *r != range) {
                if let Some((r, tables)) = open.take() {
                    by_range[r] = tables.finish()?;
                }
                open = Some((range, TableWriter::new(&dir.join(range.to_string()), &opts)));
            }
            let (_, tables) = open.as_mut().expect("opened above");
            match value {
                Some(value) => tables.put(key, value),
                None => tables.delete(key),
            }
        });
        let _ = std::fs::remove_dir_all(own_dir);
        merged?;
        if let Some((r, tables)) = open.take() {
            by_range[r] = tables.finish()?;
        }
        Ok(by_range)
    }

    /// Sorts and merges what was added: `emit` gets every live entry (the newest of its key,
    /// deletions applied) once, in the store keys' order. This load's directory is deleted
    /// when it returns.
    pub fn into_live_entries(
        self,
        mut emit: impl FnMut(&[u8], &[u8]) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let dir = self.dir.clone();
        let merged = self.merge_all(false, |key, value| match value {
            Some(value) => emit(key, value),
            None => Ok(()),
        });
        let _ = std::fs::remove_dir_all(dir);
        merged
    }

    /// `emit` gets each key once, in order, with its newest value; deletions (`None`) only when
    /// `keep_deletions`.
    fn merge_all(
        mut self,
        keep_deletions: bool,
        mut emit: impl FnMut(&[u8], Option<&[u8]>) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        if self.runs.is_empty() {
            // Everything fit in one run: straight from memory, and nothing is older than it.
            let keep = self.sorted_run();
            for i in keep {
                let e = &self.index[i];
                let value = self.value(e);
                if keep_deletions || value.is_some() {
                    emit(self.key(e), value)?;
                }
            }
            return Ok(());
        }
        if !self.index.is_empty() {
            self.spill_run()?;
        }
        // Merge passes until the runs fit one merge. Runs are merged in groups of consecutive
        // runs, so that a merged run keeps its place among the others; only the group holding
        // the oldest run may drop deletions. With fewer than twice the fan-in, one pass merges
        // just enough of the oldest runs, so that few entries are written twice.
        while self.runs.len() > self.fan_in {
            let runs = std::mem::take(&mut self.runs);
            let partial = runs.len() < 2 * self.fan_in;
            let group_len = if partial { runs.len() - self.fan_in + 1 } else { self.fan_in };
            let mut runs = runs.into_iter().peekable();
            let mut oldest = true;
            while runs.peek().is_some() {
                let group: Vec<RunFile> = runs.by_ref().take(group_len).collect();
                if group.len() == 1 {
                    self.runs.extend(group);
                } else {
                    let merged = RunFile { path: self.new_path("run")? };
                    let mut out = RunWriter::create(&merged.path)?;
                    merge(&group, keep_deletions || !oldest, |key, value| out.write(key, value))?;
                    out.finish()?;
                    self.runs.push(merged);
                }
                oldest = false;
                if partial {
                    // The partial pass: the rest stays as it is.
                    self.runs.extend(runs.by_ref());
                }
            }
        }
        merge(&self.runs, keep_deletions, emit)
    }
}

/// A lazy restore's increments. Those ordered by key group (as the rocksdb backend writes
/// them) stay where they are, in checkpoint storage or in local copies: each range's loader
/// reads the stretch of its key groups of each ([`RangeGroups::take_range_by_key_group`]), so
/// the job waits for none of their entries. Others are routed to groups of key ranges as they
/// are read, unsorted and in their order: sorting them and writing their table files is left
/// to the loaders, a group at a time, when the first range of the group is needed
/// ([`RangeGroups::take_range`]). So the job waits for them to be read, not sorted.
pub struct RangeGroups {
    dir: PathBuf,
    ranges: usize,
    groups: Vec<Mutex<Group>>,
    /// Increments ordered by key group, in chain order, all newer than the routed entries.
    by_key_group: Vec<IncrementByKeyGroup>,
}

/// A restored increment ordered by key group, read a stretch at a time.
pub struct IncrementByKeyGroup {
    /// Where it is read from.
    pub file: IncrementFile,
    /// Where each key group's entries are in it.
    pub index: weir_checkpoint::format::IncrementIndex,
    /// The key groups the restoring subtask owns: entries of others are left out.
    pub key_groups: (u32, u32),
    /// Whatever keeps the file until the restore is done with it (a restore's local copy).
    pub keep: Box<dyn std::any::Any + Send + Sync>,
}

/// Where an increment ordered by key group is read from.
pub enum IncrementFile {
    /// A local copy, verified whole.
    Local(PathBuf),
    /// Left where the checkpoint keeps it: each stretch is fetched when its range is loaded
    /// and verified against the index's checksums of its key groups.
    Stored(std::sync::Arc<dyn StoredIncrement>),
}

/// An increment ordered by key group in a checkpoint's storage (`crate::restore`).
pub trait StoredIncrement: Send + Sync {
    /// Fetches bytes `[offset, offset + len)` of the increment (storage errors retried).
    fn fetch(&self, offset: u64, len: u64) -> futures::future::BoxFuture<'_, Result<bytes::Bytes, String>>;

    /// The increment was found damaged (`why`): the source records it, so that no later
    /// restore picks a checkpoint that needs it.
    fn damaged<'a>(&'a self, why: &'a str) -> futures::future::BoxFuture<'a, ()>;

    /// For errors and logs: where it is.
    fn describe(&self) -> String;
}

/// Bytes of an increment's stretch a loader reads at once.
const STRETCH_PART_BYTES: usize = 1 << 20;

/// A stored increment's stretch is fetched in pieces of whole key groups of about this many
/// bytes (a larger key group is one piece), [`PIECES_IN_FLIGHT`] at a time across the
/// increments of a range: a range's first record waits for as many round trips as it has
/// pieces divided by that, not one per increment.
const STORED_PIECE_BYTES: u64 = 1 << 20;
const PIECES_IN_FLIGHT: usize = 8;

/// One group of ranges' increments.
#[cfg_attr(not(feature = "rocksdb"), allow(dead_code))] // Only a store splits them.
enum Group {
    /// Being written: the file, and its writer once an entry came.
    Writing(PathBuf, Option<RunWriter>),
    /// Written, not split yet (the file, if any entry came).
    Unsplit(Option<PathBuf>),
    /// Split into table files, by range (each taken once).
    Split(Vec<Vec<PathBuf>>),
}

/// Groups of ranges a lazy restore's increments are routed to: each is a file being written
/// (a 256 KiB buffer), and a loader splits a whole group when one of its ranges is needed.
/// Tests use 3, so that their few ranges share groups.
const RANGE_GROUPS: usize = if cfg!(test) { 3 } else { 16 };

impl RangeGroups {
    /// Groups for `ranges` ranges, their files under `dir`.
    pub fn new(dir: &Path, ranges: usize) -> Self {
        let groups = RANGE_GROUPS.min(ranges.max(1));
        RangeGroups {
            dir: dir.to_path_buf(),
            ranges,
            groups: (0..groups).map(|g| Mutex::new(Group::Writing(dir.join(format!("group-{g}")), None))).collect(),
            by_key_group: Vec::new(),
        }
    }

    /// Adds an increment ordered by key group, newer than everything added before.
    pub fn add_by_key_group(&mut self, increment: IncrementByKeyGroup) {
        self.by_key_group.push(increment);
    }

    /// Routes the entries of the increments ordered by key group added so far, as [`Self::add`]
    /// does: before entries of an older kind of increment that is newer than them are added.
    pub fn route_increments_by_key_group(&mut self, ranges: &super::lazy::Ranges) -> Result<(), StoreError> {
        let mut raw = Vec::with_capacity(32);
        let increments = std::mem::take(&mut self.by_key_group);
        for (n, increment) in increments.iter().enumerate() {
            let path = match &increment.file {
                IncrementFile::Local(path) => path,
                IncrementFile::Stored(_) => {
                    let pieces = increment.index.pieces_of(increment.key_groups, STORED_PIECE_BYTES);
                    let pieces = pieces
                        .into_iter()
                        .map(|(offset, len)| StoredPiece {
                            increment: n,
                            key_groups: increment.key_groups,
                            offset,
                            len,
                        })
                        .collect();
                    take_stored_pieces(&increments, pieces, &mut |key_groups, body| {
                        for entry in weir_checkpoint::format::keyed_entries(body) {
                            let entry = entry?;
                            if (key_groups.0..key_groups.1).contains(&entry.key_group) {
                                raw.clear();
                                super::store::StateStore::encoded_key(entry.key_group, entry.key, &mut raw);
                                self.add(ranges.range_of(&raw), &raw, entry.value)?;
                            }
                        }
                        Ok(())
                    })?;
                    continue;
                }
            };
            let file = File::open(path).map_err(io_failed)?;
            let len = file.metadata().map_err(io_failed)?.len();
            let parts = weir_checkpoint::format::read_keyed_parts(file, len, STRETCH_PART_BYTES, |body| {
                for entry in weir_checkpoint::format::keyed_entries(body) {
                    let entry = entry?;
                    if (increment.key_groups.0..increment.key_groups.1).contains(&entry.key_group) {
                        raw.clear();
                        super::store::StateStore::encoded_key(entry.key_group, entry.key, &mut raw);
                        self.add(ranges.range_of(&raw), &raw, entry.value)?;
                    }
                }
                Ok(())
            });
            parts.map_err(from_parts)?;
        }
        Ok(())
    }

    /// The table files of range `range`'s entries in the increments ordered by key group (the
    /// newest entry of each key, deletions kept as tombstones), under `dir`: to take in after
    /// [`Self::take_range`]'s. Reads only the stretch of each increment that holds the range's
    /// key groups.
    #[cfg(feature = "rocksdb")]
    pub fn take_range_by_key_group(
        &self,
        range: usize,
        ranges: &super::lazy::Ranges,
        dir: &Path,
        run_bytes: usize,
        fan_in: usize,
    ) -> Result<Vec<PathBuf>, StoreError> {
        use std::io::{Seek, SeekFrom};
        if self.by_key_group.is_empty() {
            return Ok(Vec::new());
        }
        let (start, end) = ranges.bounds(range);
        let in_range = |key: &[u8]| start.is_none_or(|s| key >= s) && end.is_none_or(|e| key < e);
        let range_key_groups = ranges.key_groups_of(range);
        let mut load = BulkLoad::with_limits(&dir.join("runs"), run_bytes, fan_in);
        let mut raw = Vec::with_capacity(32);
        let mut take = |key_groups: (u32, u32), body: &[u8]| -> Result<(), StoreError> {
            for entry in weir_checkpoint::format::keyed_entries(body) {
                let entry = entry?;
                if !(key_groups.0..key_groups.1).contains(&entry.key_group) {
                    continue;
                }
                raw.clear();
                super::store::StateStore::encoded_key(entry.key_group, entry.key, &mut raw);
                if in_range(&raw) {
                    load.add(&raw, entry.value)?;
                }
            }
            Ok(())
        };
        // The range's key groups of each increment, in chain order.
        let mut stored_pieces = Vec::new();
        for (n, increment) in self.by_key_group.iter().enumerate() {
            let key_groups =
                (range_key_groups.0.max(increment.key_groups.0), range_key_groups.1.min(increment.key_groups.1));
            if key_groups.0 >= key_groups.1 {
                continue;
            }
            match &increment.file {
                IncrementFile::Stored(_) => stored_pieces.extend(
                    increment
                        .index
                        .pieces_of(key_groups, STORED_PIECE_BYTES)
                        .into_iter()
                        .map(|(offset, len)| StoredPiece { increment: n, key_groups, offset, len }),
                ),
                IncrementFile::Local(path) => {
                    // Stored increments before it first, in order.
                    take_stored_pieces(&self.by_key_group, std::mem::take(&mut stored_pieces), &mut take)?;
                    let (offset, len) = increment.index.stretch_of(key_groups);
                    if len == 0 {
                        continue;
                    }
                    let mut file = File::open(path).map_err(io_failed)?;
                    file.seek(SeekFrom::Start(offset)).map_err(io_failed)?;
                    weir_checkpoint::format::read_entry_parts(file.take(len), len, STRETCH_PART_BYTES, |body| {
                        take(key_groups, body)
                    })
                    .map_err(from_parts)?;
                }
            }
        }
        take_stored_pieces(&self.by_key_group, stored_pieces, &mut take)?;
        load.into_tables(dir, true)
    }

    fn group_of(&self, range: usize) -> usize {
        range * self.groups.len() / self.ranges.max(1)
    }

    fn lock(&self, group: usize) -> std::sync::MutexGuard<'_, Group> {
        self.groups[group].lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Appends an entry of range `range` (`None`: a deletion); later entries win.
    pub fn add(&mut self, range: usize, store_key: &[u8], value: Option<&[u8]>) -> Result<(), StoreError> {
        let group = self.group_of(range);
        let g = self.groups[group].get_mut().unwrap_or_else(|poisoned| poisoned.into_inner());
        let Group::Writing(path, writer) = g else { unreachable!("entries are added before finish") };
        if writer.is_none() {
            std::fs::create_dir_all(&self.dir).map_err(io_failed)?;
            *writer = Some(RunWriter::small(path)?);
        }
        writer.as_mut().expect("created above").write(store_key, value)
    }

    /// Closes the files: every entry is added.
    pub fn finish(&mut self) -> Result<(), StoreError> {
        for group in 0..self.groups.len() {
            let mut g = self.lock(group);
            if let Group::Writing(path, writer) = &mut *g {
                let written = match writer.take() {
                    Some(w) => {
                        w.finish()?;
                        Some(path.clone())
                    }
                    None => None,
                };
                *g = Group::Unsplit(written);
            }
        }
        Ok(())
    }

    /// The table files of range `range`'s increments (sorted, newest entry of each key,
    /// deletions kept as tombstones), under `dir`. The first range of a group taken splits
    /// the whole group (sorted runs of `run_bytes`, merged `fan_in` at a time); the others
    /// of the group wait for that.
    #[cfg(feature = "rocksdb")]
    pub fn take_range(
        &self,
        range: usize,
        ranges: &super::lazy::Ranges,
        run_bytes: usize,
        fan_in: usize,
    ) -> Result<Vec<PathBuf>, StoreError> {
        let group = self.group_of(range);
        let mut g = self.lock(group);
        if let Group::Unsplit(file) = &mut *g {
            let split = match file.take() {
                Some(path) => {
                    let dir = self.dir.join(format!("split-{group}"));
                    let mut load = BulkLoad::with_limits(&dir.join("runs"), run_bytes, fan_in);
                    let mut reader = RunReader::open(&path)?;
                    while reader.advance()? {
                        load.add(reader.key(), reader.value())?;
                    }
                    let _ = std::fs::remove_file(&path);
                    load.into_range_tables(ranges, &dir)?
                }
                None => Vec::new(),
            };
            *g = Group::Split(split);
        }
        match &mut *g {
            Group::Split(by_range) => Ok(by_range.get_mut(range).map(std::mem::take).unwrap_or_default()),
            _ => unreachable!("finished before ranges are taken"),
        }
    }
}

/// A failed read of a state file's parts as the store's error.
fn from_parts(e: weir_checkpoint::format::PartsError<StoreError>) -> StoreError {
    match e {
        weir_checkpoint::format::PartsError::Read(e) => StoreError::BulkLoad(e),
        weir_checkpoint::format::PartsError::Format(e) => StoreError::Decode(e),
        weir_checkpoint::format::PartsError::Consume(e) => e,
    }
}

/// The store key's first 8 bytes as a big-endian number, zero-padded: ordering by it first and
/// by the whole key next is the keys' byte order.
fn prefix_of(key: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    let n = key.len().min(8);
    b[..n].copy_from_slice(&key[..n]);
    u64::from_be_bytes(b)
}

/// Merges sorted runs (oldest first): `emit` gets each key once, in order, with its newest
/// value (`None`: a deletion). Deletions are left out unless `keep_deletions` (they must shadow
/// older runs that are not in this merge).
fn merge(
    runs: &[RunFile],
    keep_deletions: bool,
    mut emit: impl FnMut(&[u8], Option<&[u8]>) -> Result<(), StoreError>,
) -> Result<(), StoreError> {
    let mut readers = Vec::with_capacity(runs.len());
    for run in runs {
        readers.push(RunReader::open(&run.path)?);
    }
    // A binary min-heap of the readers that have an entry: the smallest key first and, of
    // equal keys, the newest run's (the highest index) first.
    let first = |readers: &[RunReader], a: usize, b: usize| {
        let (ra, rb) = (&readers[a], &readers[b]);
        match ra.prefix.cmp(&rb.prefix).then_with(|| ra.key().cmp(rb.key())) {
            std::cmp::Ordering::Less => true,
            std::cmp::Ordering::Greater => false,
            std::cmp::Ordering::Equal => a > b,
        }
    };
    let sift_down = |heap: &mut [usize], readers: &[RunReader], mut at: usize| loop {
        let (l, r) = (2 * at + 1, 2 * at + 2);
        let mut top = at;
        if l < heap.len() && first(readers, heap[l], heap[top]) {
            top = l;
        }
        if r < heap.len() && first(readers, heap[r], heap[top]) {
            top = r;
        }
        if top == at {
            return;
        }
        heap.swap(at, top);
        at = top;
    };
    let mut heap = Vec::with_capacity(readers.len());
    for (i, r) in readers.iter_mut().enumerate() {
        if r.advance()? {
            heap.push(i);
        }
    }
    for at in (0..heap.len() / 2).rev() {
        sift_down(&mut heap, &readers, at);
    }
    let mut last: Option<(u64, Vec<u8>)> = None;
    while let Some(&i) = heap.first() {
        let reader = &readers[i];
        if last.as_ref().is_none_or(|(prefix, key)| *prefix != reader.prefix || key != reader.key()) {
            if keep_deletions || reader.value().is_some() {
                emit(reader.key(), reader.value())?;
            }
            let last = last.get_or_insert_with(|| (0, Vec::new()));
            last.0 = reader.prefix;
            last.1.clear();
            last.1.extend_from_slice(reader.key());
        }
        if !readers[i].advance()? {
            heap.swap_remove(0);
        }
        sift_down(&mut heap, &readers, 0);
    }
    Ok(())
}

/// Writes a sorted run: `key len u32-le | key | value len u32-le (DELETED for a deletion) | value`.
struct RunWriter {
    out: SyncedWriter,
}

impl RunWriter {
    fn create(path: &Path) -> Result<Self, StoreError> {
        Ok(RunWriter { out: SyncedWriter::create(path).map_err(io_failed)? })
    }

    /// A writer with a 256 KiB buffer, synced every 2 MiB (one of many written at once).
    fn small(path: &Path) -> Result<Self, StoreError> {
        Ok(RunWriter { out: SyncedWriter::with_limits(path, 256 << 10, 2 << 20).map_err(io_failed)? })
    }

    fn write(&mut self, key: &[u8], value: Option<&[u8]>) -> Result<(), StoreError> {
        let mut put = || -> std::io::Result<()> {
            self.out.write_all(&(key.len() as u32).to_le_bytes())?;
            self.out.write_all(key)?;
            match value {
                Some(v) => {
                    self.out.write_all(&(v.len() as u32).to_le_bytes())?;
                    self.out.write_all(v)?;
                }
                None => self.out.write_all(&DELETED.to_le_bytes())?,
            }
            Ok(())
        };
        put().map_err(io_failed)
    }

    fn finish(mut self) -> Result<(), StoreError> {
        self.out.flush().map_err(io_failed)
    }
}

/// Reads a sorted run back, an entry at a time, parsed in place from a buffer of the file.
struct RunReader {
    file: File,
    buf: Vec<u8>,
    /// Where the unread bytes start, and end.
    pos: usize,
    end: usize,
    eof: bool,
    /// The current entry's key and value (`None`: a deletion), as ranges of `buf`.
    key: (usize, usize),
    /// The current key's [`prefix_of`].
    prefix: u64,
    value: Option<(usize, usize)>,
}

impl RunReader {
    fn open(path: &Path) -> Result<Self, StoreError> {
        Ok(RunReader {
            file: File::open(path).map_err(io_failed)?,
            buf: vec![0; 256 << 10],
            pos: 0,
            end: 0,
            eof: false,
            key: (0, 0),
            prefix: 0,
            value: None,
        })
    }

    fn key(&self) -> &[u8] {
        &self.buf[self.key.0..self.key.1]
    }

    fn value(&self) -> Option<&[u8]> {
        self.value.map(|(a, b)| &self.buf[a..b])
    }

    /// Moves to the next entry; false at the end of the run.
    fn advance(&mut self) -> Result<bool, StoreError> {
        loop {
            if let Some(next) = self.parse() {
                self.pos = next;
                return Ok(true);
            }
            if self.eof {
                if self.pos == self.end {
                    return Ok(false);
                }
                return Err(io_failed(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "a truncated run")));
            }
            // Keep the partial entry, make room (an entry may be larger than the buffer), read.
            self.buf.copy_within(self.pos..self.end, 0);
            self.end -= self.pos;
            self.pos = 0;
            if self.end == self.buf.len() {
                self.buf.resize(self.buf.len() * 2, 0);
            }
            let n = match self.file.read(&mut self.buf[self.end..]) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io_failed(e)),
            };
            self.eof = n == 0;
            self.end += n;
        }
    }

    /// Parses the entry at `pos` if it is whole in the buffer; where the next one starts.
    fn parse(&mut self) -> Option<usize> {
        let bytes = &self.buf[self.pos..self.end];
        let len_at = |at: usize| -> Option<u32> { Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?)) };
        let key_len = len_at(0)? as usize;
        let value_len = len_at(4 + key_len)?;
        let value_at = 8 + key_len;
        let next = if value_len == DELETED { value_at } else { value_at + value_len as usize };
        if next > bytes.len() {
            return None;
        }
        self.prefix = prefix_of(&bytes[4..4 + key_len]);
        self.key = (self.pos + 4, self.pos + 4 + key_len);
        self.value = (value_len != DELETED).then(|| (self.pos + value_at, self.pos + next));
        Some(self.pos + next)
    }
}

/// Writes entries in key order into table files of about [`TABLE_BYTES`] each: the rocksdb
/// backend's own files, which a store takes in whole ([`StateStore::ingest`]).
#[cfg(feature = "rocksdb")]
pub(crate) struct TableWriter<'o> {
    dir: PathBuf,
    opts: &'o rocksdb::Options,
    files: Vec<PathBuf>,
    /// Each file's first key.
    first_keys: Vec<Vec<u8>>,
    writer: Option<SstFileWriter<'o>>,
    /// A file is closed after this many entries.
    max_entries: u64,
    entries: u64,
}

#[cfg(feature = "rocksdb")]
impl<'o> TableWriter<'o> {
    /// Table files named `table-<i>.sst` under `dir` (created when the first entry comes),
    /// written with `opts` (the store's: [`super::store::options`]).
    pub(crate) fn new(dir: &Path, opts: &'o rocksdb::Options) -> Self {
        TableWriter {
            dir: dir.to_path_buf(),
            opts,
            files: Vec::new(),
            first_keys: Vec::new(),
            writer: None,
            max_entries: u64::MAX,
            entries: 0,
        }
    }

    /// Files of at most `max_entries` entries too. RocksDB holds 8 bytes per key of the file
    /// it is writing until the file is closed (to build its bloom filter): a background merge,
    /// which runs beside the job in its memory limit, bounds that.
    pub(crate) fn with_max_entries(mut self, max_entries: u64) -> Self {
        self.max_entries = max_entries.max(1);
        self
    }

    /// The file `key` goes into: the open one, or a new one that `key` begins.
    fn writer(&mut self, key: &[u8]) -> Result<&mut SstFileWriter<'o>, StoreError> {
        if self.writer.is_none() {
            std::fs::create_dir_all(&self.dir).map_err(io_failed)?;
            let path = self.dir.join(format!("table-{}.sst", self.files.len()));
            let w = SstFileWriter::create(self.opts);
            w.open(&path).map_err(StoreError::WriteTable)?;
            self.writer = Some(w);
            self.files.push(path);
            self.first_keys.push(key.to_vec());
        }
        Ok(self.writer.as_mut().expect("opened above"))
    }

    fn end_of_entry(&mut self) -> Result<(), StoreError> {
        self.entries += 1;
        if self.entries >= self.max_entries || self.writer.as_ref().is_some_and(|w| w.file_size() >= TABLE_BYTES) {
            let mut w = self.writer.take().expect("an entry was just written");
            w.finish().map_err(StoreError::WriteTable)?;
            self.entries = 0;
        }
        Ok(())
    }

    /// Adds a put; keys must come in increasing order.
    pub(crate) fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), StoreError> {
        self.writer(key)?.put(key, value).map_err(StoreError::WriteTable)?;
        self.end_of_entry()
    }

    /// Adds a deletion (a tombstone hiding the key in the files below); keys in order.
    pub(crate) fn delete(&mut self, key: &[u8]) -> Result<(), StoreError> {
        self.writer(key)?.delete(key).map_err(StoreError::WriteTable)?;
        self.end_of_entry()
    }

    /// Closes the last file; the files written, in key order.
    pub(crate) fn finish(self) -> Result<Vec<PathBuf>, StoreError> {
        Ok(self.finish_with_first_keys()?.into_iter().map(|(path, _)| path).collect())
    }

    /// [`Self::finish`], with each file's first key.
    pub(crate) fn finish_with_first_keys(mut self) -> Result<Vec<(PathBuf, Vec<u8>)>, StoreError> {
        if let Some(mut w) = self.writer.take() {
            w.finish().map_err(StoreError::WriteTable)?;
        }
        Ok(self.files.into_iter().zip(self.first_keys).collect())
    }
}

/// A piece of a stored increment to fetch: whole key groups of it.
struct StoredPiece {
    /// Which increment (an index into the restore's increments ordered by key group).
    increment: usize,
    /// The key groups whose entries to take.
    key_groups: (u32, u32),
    /// Where the piece is in the increment.
    offset: u64,
    len: u64,
}

/// Takes the entries of the given key groups from whole entries of an increment.
type TakeEntries<'a> = dyn FnMut((u32, u32), &[u8]) -> Result<(), StoreError> + 'a;

/// Fetches pieces of stored increments,
/// [`PIECES_IN_FLIGHT`] at a time, verifies each and hands it to `take` in order. A piece
/// that does not match its checksums is reported to its increment's source.
fn take_stored_pieces(
    increments: &[IncrementByKeyGroup],
    pieces: Vec<StoredPiece>,
    take: &mut TakeEntries<'_>,
) -> Result<(), StoreError> {
    use futures::{StreamExt, TryStreamExt};
    if pieces.is_empty() {
        return Ok(());
    }
    let fetches = pieces.into_iter().map(|StoredPiece { increment, key_groups, offset, len }| {
        let increment = &increments[increment];
        async move {
            let IncrementFile::Stored(stored) = &increment.file else {
                return Err(StoreError::LazyRestore("a local increment among stored pieces".into()));
            };
            let bytes = stored.fetch(offset, len).await.map_err(StoreError::LazyRestore)?;
            if let Err(e) = increment.index.verify(offset, &bytes) {
                let why = format!("bytes {offset}..{}: {e}", offset + len);
                stored.damaged(&why).await;
                return Err(StoreError::LazyRestore(format!("{}: {why}", stored.describe())));
            }
            Ok((key_groups, bytes))
        }
    });
    crate::io().block_on(
        futures::stream::iter(fetches)
            .buffered(PIECES_IN_FLIGHT)
            .try_for_each(|(key_groups, bytes)| std::future::ready(take(key_groups, &bytes))),
    )
}

#[cfg(all(test, feature = "rocksdb"))]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// Random puts and deletions over a small key space, loaded with runs so small that there
    /// are hundreds of them and several merge passes: the store holds exactly what applying
    /// them in order to a map gives.
    #[test]
    fn a_bulk_load_leaves_what_applying_the_entries_in_order_leaves() {
        for (seed, run_bytes, fan_in) in [(1u64, 1 << 30, 64), (2, 4096, 3), (3, 700, 2), (4, 64 << 10, 64)] {
            let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let mut next = move || {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng
            };
            let parent = tempfile::tempdir().unwrap();
            let store = StateStore::open(parent.path(), "bulk").unwrap();
            let mut load = BulkLoad::with_limits(&store.dir().join("bulk"), run_bytes, fan_in);
            let mut merged = BulkLoad::with_limits(&parent.path().join("merged"), run_bytes, fan_in);
            let mut model: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
            for i in 0..20_000u32 {
                let k = next() % 3_000;
                // Keys of varied lengths sharing long prefixes, so the byte order matters.
                let key = format!("{:02}key-{k}", k % 7).into_bytes();
                if next() % 5 == 0 {
                    load.add(&key, None).unwrap();
                    merged.add(&key, None).unwrap();
                    model.remove(&key);
                } else {
                    let value = format!("v{i}-{}", "x".repeat((next() % 40) as usize)).into_bytes();
                    load.add(&key, Some(&value)).unwrap();
                    merged.add(&key, Some(&value)).unwrap();
                    model.insert(key, value);
                }
            }
            load.into_store(&store, false).unwrap();
            // The same entries merged into a stream: each live key once, in byte order.
            let mut emitted = Vec::new();
            merged
                .into_live_entries(|k, v| {
                    emitted.push((k.to_vec(), v.to_vec()));
                    Ok(())
                })
                .unwrap();
            assert!(emitted == model.clone().into_iter().collect::<Vec<_>>(), "seed {seed}: the merged stream");
            assert!(!parent.path().join("merged").exists(), "seed {seed}: the merge's runs are gone");
            let mut stored = BTreeMap::new();
            store
                .scan(|k, v| {
                    stored.insert(k.to_vec(), v.to_vec());
                    Ok::<_, StoreError>(())
                })
                .unwrap();
            assert_eq!(stored.len(), model.len(), "seed {seed}");
            assert!(stored == model, "seed {seed}: the store differs from the model");
            let leftovers: Vec<_> =
                std::fs::read_dir(store.dir().join("bulk")).map(|d| d.count()).into_iter().collect();
            assert!(leftovers.iter().all(|n| *n == 0), "seed {seed}: runs and tables are gone: {leftovers:?}");
        }
    }

    #[test]
    fn nothing_left_loads_nothing() {
        let parent = tempfile::tempdir().unwrap();
        let store = StateStore::open(parent.path(), "bulk").unwrap();
        let mut load = BulkLoad::with_limits(&store.dir().join("bulk"), 100, 2);
        for i in 0..50u32 {
            load.add(&i.to_be_bytes(), Some(b"v")).unwrap();
        }
        for i in 0..50u32 {
            load.add(&i.to_be_bytes(), None).unwrap();
        }
        load.into_store(&store, false).unwrap();
        let mut n = 0;
        store
            .scan(|_, _| {
                n += 1;
                Ok::<_, StoreError>(())
            })
            .unwrap();
        assert_eq!(n, 0);
    }
}
