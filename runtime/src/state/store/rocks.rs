//! The store on RocksDB (the `rocksdb` feature): Debian's librocksdb, linked (see
//! `.cargo/config.toml`).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use rocksdb::{BlockBasedOptions, Cache, DBCompressionType, Options, WriteOptions, DB};

use super::super::bulk::{BulkLoad, RangeGroups, TableWriter};
use super::super::lazy::{Pending, Ranges, TableSource};
use super::{remove_stores_of_dead_processes, StoreError};

/// A batch of puts and deletes for [`StateStore::write`].
pub use rocksdb::WriteBatch;

/// A value read from the store, pinned in its block cache while borrowed.
pub type StoredValue<'s> = rocksdb::DBPinnableSlice<'s>;

/// The engine's own error.
pub type EngineError = rocksdb::Error;

/// One subtask's store.
pub struct StateStore {
    db: Option<Arc<DB>>,
    dir: PathBuf,
    parent_dir: PathBuf,
    no_wal: WriteOptions,
    /// A lazy restore's table files still coming in ([`Self::load_lazily`]).
    lazy: Option<LazyLoad>,
    /// Counts this store while a lazy restore loads into it ([`Self::count_lazy_restores_in`]).
    restores_loading: Option<Arc<AtomicUsize>>,
}

/// The loaders of a lazy restore and what they have loaded.
struct LazyLoad {
    pending: Arc<Pending>,
    loaders: Vec<std::thread::JoinHandle<()>>,
}

/// Makes store directory names unique within the process.
static NEXT_STORE: AtomicU64 = AtomicU64::new(0);

/// RocksDB's own memory per store: up to four 8 MiB memtables and a 16 MiB block cache (about
/// 48 MiB, plus the table files' indexes and bloom filters, which grow with the keys), so that
/// a process's memory is mostly the cache of decoded entries, which the job sizes
/// (`stateCacheEntries`). Four memtables rather than two: with two, writes stopped whenever a
/// flush (slowed by compactions sharing the cores) had not finished before the next memtable
/// filled.
const WRITE_BUFFER_BYTES: usize = 8 << 20;
const WRITE_BUFFERS: i32 = 4;
const BLOCK_CACHE_BYTES: usize = 16 << 20;

/// Level-0 files at which writes slow down, and stop (see [`options`]).
const LEVEL0_SLOWDOWN_FILES: i32 = 48;
const LEVEL0_STOP_FILES: i32 = 80;
/// Background jobs: RocksDB sizes the process's shared thread pools by the largest any store
/// asks for (4: one flush thread and three compaction threads, against one and one by
/// default). And the threads one L0→L1 compaction may split over.
const BACKGROUND_JOBS: i32 = 4;
const SUBCOMPACTIONS: u32 = 2;

/// The size of the table files compactions write. RocksDB builds a file's bloom filter from
/// the hashes of all of its keys, held in memory until the file is finished: with its default
/// of 64 MiB files (millions of small entries each), that buffer was 30 MB of the peak heap of
/// a 5M-key count with a cache of 100K entries.
const TARGET_FILE_BYTES: u64 = 8 << 20;

impl StateStore {
    /// Opens an empty store in a new directory under `parent_dir`, named after `label`.
    pub fn open(parent_dir: &Path, label: &str) -> Result<Self, StoreError> {
        let n = NEXT_STORE.fetch_add(1, Ordering::Relaxed);
        let safe: String = label.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
        let dir = parent_dir.join(format!("{}-{}-{n}", safe, std::process::id()));
        let prepare = |source| StoreError::PrepareDir { dir: dir.display().to_string(), source };
        // In the background: after many kills there may be gigabytes to delete.
        let parent = parent_dir.to_path_buf();
        std::thread::spawn(move || remove_stores_of_dead_processes(&parent));
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(prepare)?;
        }
        std::fs::create_dir_all(&dir).map_err(prepare)?;
        let db =
            DB::open(&options(), &dir).map_err(|source| StoreError::Open { dir: dir.display().to_string(), source })?;
        let mut no_wal = WriteOptions::default();
        no_wal.disable_wal(true);
        Ok(StateStore {
            db: Some(Arc::new(db)),
            dir,
            parent_dir: parent_dir.to_path_buf(),
            no_wal,
            lazy: None,
            restores_loading: None,
        })
    }

    /// The directory the store's own directory is in.
    pub fn parent_dir(&self) -> &Path {
        &self.parent_dir
    }

    /// The store's own directory (deleted with the store).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn db(&self) -> &DB {
        perf_counters_off();
        self.db.as_ref().expect("the store is open until dropped")
    }

    /// Waits until the key's range is in the store, during a lazy restore.
    #[inline]
    fn wait_for(&self, store_key: &[u8]) -> Result<(), StoreError> {
        match &self.lazy {
            Some(lazy) => lazy.pending.wait_for_key(store_key),
            None => Ok(()),
        }
    }

    /// Counts this store in `counter` for as long as a lazy restore loads into it (its job
    /// holds checkpoints until then).
    pub fn count_lazy_restores_in(&mut self, counter: Arc<AtomicUsize>) {
        self.restores_loading = Some(counter);
    }

    /// Whether a lazy restore is still bringing table files in.
    pub fn loading(&self) -> bool {
        self.lazy.as_ref().is_some_and(|l| !l.pending.all_ready())
    }

    /// Starts a lazy restore into this store, which holds nothing in `ranges` yet: `loaders`
    /// threads fetch the source's tables, the ones that reads wait for first, and load each
    /// range's table, then its restored increments over it (sorted by the loaders, a group
    /// of ranges at a time: [`RangeGroups::take_range`]; then those ordered by key group, read
    /// a range at a time: [`RangeGroups::take_range_by_key_group`]). With `keep` (a restore at another
    /// parallelism), entries of other key groups in each range are deleted after its table
    /// came in. Until a range is in, reads of it wait ([`super::super::lazy`]).
    pub fn load_lazily(
        &mut self,
        source: Arc<dyn TableSource>,
        ranges: Ranges,
        increments: RangeGroups,
        keep: Option<(u32, u32)>,
        loaders: usize,
    ) -> Result<(), StoreError> {
        if ranges.is_empty() {
            return Err(StoreError::LazyRestore(format!("{} has no tables", source.describe())));
        }
        let pending = Arc::new(Pending::new(ranges));
        let job = Arc::new(LoaderJob {
            db: self.db.clone().expect("the store is open until dropped"),
            dir: self.dir.join("lazy"),
            source,
            pending: pending.clone(),
            increments,
            keep,
            started: std::time::Instant::now(),
            running: AtomicUsize::new(0),
            from_image: AtomicUsize::new(0),
            counted: self.restores_loading.clone().inspect(|c| {
                c.fetch_add(1, Ordering::AcqRel);
            }),
        });
        let loaders = loaders.clamp(1, pending.ranges().len().max(1));
        let mut handles = Vec::with_capacity(loaders);
        for n in 0..loaders {
            job.running.fetch_add(1, Ordering::AcqRel);
            let loader = job.clone();
            let spawned = std::thread::Builder::new().name(format!("restore-load-{n}")).spawn(move || loader.run());
            match spawned {
                Ok(handle) => handles.push(handle),
                Err(e) => {
                    job.running.fetch_sub(1, Ordering::AcqRel);
                    if handles.is_empty() {
                        return Err(StoreError::RestoreThread(e));
                    }
                    break;
                }
            }
        }
        self.lazy = Some(LazyLoad { pending, loaders: handles });
        Ok(())
    }

    /// An empty batch for [`Self::write`].
    pub fn batch(&self) -> WriteBatch {
        WriteBatch::default()
    }

    /// Loads a restore's entries into this store as table files: into an empty store, or
    /// `over_existing` table files a restore took in first (deletions then stay tombstones).
    pub fn bulk_load(&self, load: BulkLoad, over_existing: bool) -> Result<(), StoreError> {
        load.into_store(self, over_existing)
    }

    /// Takes a checkpoint's table files (local copies of them, which may be links to the
    /// checkpoint's own files) into this empty store: each is linked again under the store's
    /// directory and that link moved in, so the copies stay for other subtasks. The files must
    /// not overlap. Into an empty store they keep sequence number 0, so RocksDB writes nothing
    /// into them (it would write an ingested file's global sequence number in place).
    pub fn take_tables(&self, tables: &[PathBuf]) -> Result<(), StoreError> {
        take_tables(self.db(), &self.dir.join("taken"), tables)
    }

    /// Deletes every entry outside key groups `[start, end)` (a restore at another parallelism
    /// took in table files of a subtask that owned more).
    pub fn keep_only_key_groups(&self, key_groups: (u32, u32)) -> Result<(), StoreError> {
        let mut batch = WriteBatch::default();
        for (from, to) in other_key_groups_within(key_groups, None, None) {
            batch.delete_range(from, to);
        }
        self.write(batch)
    }

    /// The value stored under a store key.
    pub fn get(&self, store_key: &[u8]) -> Result<Option<StoredValue<'_>>, StoreError> {
        self.wait_for(store_key)?;
        self.db().get_pinned(store_key).map_err(StoreError::Read)
    }

    /// The values stored under several store keys, in their order, in one call.
    pub fn multi_get(&self, store_keys: &[Vec<u8>]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        for key in store_keys {
            self.wait_for(key)?;
        }
        self.db().multi_get(store_keys).into_iter().map(|r| r.map_err(StoreError::Read)).collect()
    }

    /// Applies a batch of puts and deletes. During a lazy restore, only of keys that were read
    /// first (so their ranges are in): the keyed state reads every key before it writes it.
    pub fn write(&self, batch: WriteBatch) -> Result<(), StoreError> {
        if batch.is_empty() {
            return Ok(());
        }
        self.db().write_opt(batch, &self.no_wal).map_err(StoreError::Write)
    }

    /// Moves table files written by [`super::bulk::BulkLoad`] into the store: into its last
    /// level when the store is empty and the files do not overlap, as a restore's are.
    pub fn ingest(&self, tables: Vec<PathBuf>) -> Result<(), StoreError> {
        if tables.is_empty() {
            return Ok(());
        }
        ingest(self.db(), tables)
    }

    /// RocksDB's estimate of the number of entries stored (`rocksdb.estimate-num-keys`; it
    /// counts overwritten and deleted keys until compactions drop them). 0 when unavailable.
    pub fn estimated_entries(&self) -> u64 {
        self.db().property_int_value("rocksdb.estimate-num-keys").ok().flatten().unwrap_or(0)
    }

    /// The bytes of the store's table files (`rocksdb.live-sst-files-size`: compressed, and
    /// with the older versions of keys that compactions have not dropped yet, all of which a
    /// scan reads). RocksDB's `estimate-live-data-size` counts only the lowest file of each key
    /// range, which with keys in random order misses most of level 0 and the upper levels.
    /// The memtables (at most 32 MiB) are not counted. 0 when unavailable.
    pub fn estimated_bytes(&self) -> u64 {
        self.db().property_int_value("rocksdb.live-sst-files-size").ok().flatten().unwrap_or(0)
    }

    /// Writes the memtables out to table files (tests).
    #[cfg(test)]
    pub(crate) fn flush(&self) {
        self.db().flush().expect("the store flushes");
    }

    /// Calls `f` with every entry's store key and value, in key order.
    pub fn scan<E: From<StoreError>>(&self, mut f: impl FnMut(&[u8], &[u8]) -> Result<(), E>) -> Result<(), E> {
        if let Some(lazy) = &self.lazy {
            lazy.pending.wait_for_all()?;
        }
        let mut it = self.db().raw_iterator();
        it.seek_to_first();
        while let (Some(k), Some(v)) = (it.key(), it.value()) {
            f(k, v)?;
            it.next();
        }
        it.status().map_err(|e| E::from(StoreError::Scan(e)))
    }
}

/// Links table files under `linked_dir` and moves the links into the store (see
/// [`StateStore::take_tables`]); none may need a sequence number of its own.
fn take_tables(db: &DB, linked_dir: &Path, tables: &[PathBuf]) -> Result<(), StoreError> {
    std::fs::create_dir_all(linked_dir).map_err(StoreError::TakeTable)?;
    let mut linked = Vec::with_capacity(tables.len());
    for (i, table) in tables.iter().enumerate() {
        let link = linked_dir.join(format!("{i}.sst"));
        let _ = std::fs::remove_file(&link);
        if std::fs::hard_link(table, &link).is_err() {
            std::fs::copy(table, &link).map_err(StoreError::TakeTable)?;
        }
        linked.push(link);
    }
    let mut opts = rocksdb::IngestExternalFileOptions::default();
    opts.set_move_files(true);
    // A file that would need a sequence number of its own (it overlaps another or the
    // store is not empty) is refused instead of written into: it may be a hard link to a
    // checkpoint's file.
    opts.set_allow_global_seqno(false);
    let taken = db.ingest_external_file_opts(&opts, linked).map_err(StoreError::Ingest);
    let _ = std::fs::remove_dir_all(linked_dir);
    taken
}

/// Moves table files this process wrote into the store, at the level RocksDB picks.
fn ingest(db: &DB, tables: Vec<PathBuf>) -> Result<(), StoreError> {
    if tables.is_empty() {
        return Ok(());
    }
    let mut opts = rocksdb::IngestExternalFileOptions::default();
    opts.set_move_files(true);
    db.ingest_external_file_opts(&opts, tables).map_err(StoreError::Ingest)
}

/// Sorted runs of a loader that reads a range from the full image or sorts a group of ranges'
/// increments: 4 MiB in memory, and 16 merged at once (a 256 KiB buffer each).
const LOADER_RUN_BYTES: usize = 4 << 20;
const LOADER_MERGE_FAN_IN: usize = 16;

/// What the loaders of one lazy restore share.
struct LoaderJob {
    db: Arc<DB>,
    /// Scratch space under the store's directory.
    dir: PathBuf,
    source: Arc<dyn TableSource>,
    pending: Arc<Pending>,
    increments: RangeGroups,
    keep: Option<(u32, u32)>,
    started: std::time::Instant,
    /// Loaders still running: the last one out logs the outcome.
    running: AtomicUsize,
    /// Ranges loaded from the full image because their table failed.
    from_image: AtomicUsize,
    /// Counted while the loaders run, released when the last one is done (the job is dropped)
    /// and every range is in. A restore that failed or stopped keeps it: its attempt is over,
    /// and no checkpoint may complete on its state in the meantime.
    counted: Option<Arc<AtomicUsize>>,
}

impl Drop for LoaderJob {
    fn drop(&mut self) {
        if let (Some(counter), true) = (&self.counted, self.pending.all_ready()) {
            counter.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl LoaderJob {
    /// One loader: ranges until none is left, loading stops, or one fails.
    fn run(&self) {
        perf_counters_off();
        while let Some(i) = self.pending.next_to_load() {
            // A panic must not leave the range loading forever and its readers waiting.
            let loaded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.load_range(i)))
                .unwrap_or_else(|_| Err(format!("loading range {i} panicked")));
            match loaded {
                Ok(()) => self.pending.loaded(i),
                Err(why) => {
                    tracing::error!(range = i, tables = %self.source.describe(), %why, "a lazy restore failed");
                    self.pending.fail(why);
                }
            }
        }
        if self.running.fetch_sub(1, Ordering::AcqRel) == 1 && self.pending.all_ready() {
            tracing::info!(
                tables = self.pending.ranges().len(),
                from_image = self.from_image.load(Ordering::Relaxed),
                ms = self.started.elapsed().as_millis() as u64,
                "every table file of the restore is in the state store"
            );
        }
    }

    /// Range `i`: its table (or, when the table fails, the image's entries in the range), the
    /// other key groups' entries in it deleted when asked, then the increments over it.
    fn load_range(&self, i: usize) -> Result<(), String> {
        let scratch = self.dir.join(i.to_string());
        if let Err(why) = self.take_table(i, &scratch) {
            tracing::warn!(
                range = i,
                tables = %self.source.describe(),
                %why,
                "a table file of the restore could not be taken in; its entries come from the full image"
            );
            self.load_from_image(i, &scratch)?;
            self.from_image.fetch_add(1, Ordering::Relaxed);
            self.source.fell_back(i);
        }
        let (start, end) = self.pending.ranges().bounds(i);
        if let Some(key_groups) = self.keep {
            let mut batch = WriteBatch::default();
            for (from, to) in other_key_groups_within(key_groups, start, end) {
                batch.delete_range(from, to);
            }
            let mut no_wal = WriteOptions::default();
            no_wal.disable_wal(true);
            self.db.write_opt(batch, &no_wal).map_err(|e| format!("deleting other key groups: {e}"))?;
        }
        let increments = self
            .increments
            .take_range(i, self.pending.ranges(), LOADER_RUN_BYTES, LOADER_MERGE_FAN_IN)
            .map_err(|e| format!("sorting the increments over table {i}: {e}"))?;
        ingest(&self.db, increments).map_err(|e| format!("loading the increments over table {i}: {e}"))?;
        let by_key_group = self
            .increments
            .take_range_by_key_group(
                i,
                self.pending.ranges(),
                &scratch.join("by-key-group"),
                LOADER_RUN_BYTES,
                LOADER_MERGE_FAN_IN,
            )
            .map_err(|e| format!("reading the increments over table {i}: {e}"))?;
        ingest(&self.db, by_key_group).map_err(|e| format!("loading the increments over table {i}: {e}"))?;
        let _ = std::fs::remove_dir_all(&scratch);
        Ok(())
    }

    /// Fetches table `i` and takes it in: linked, as it is; or, when the store refuses it
    /// without a sequence number of its own, a copy of it with one.
    fn take_table(&self, i: usize, scratch: &Path) -> Result<(), String> {
        let fetched = self.source.fetch(i)?;
        if let Err(linked) = take_tables(&self.db, &scratch.join("linked"), std::slice::from_ref(&fetched.path)) {
            std::fs::create_dir_all(scratch).map_err(|e| format!("{linked}; then preparing a copy: {e}"))?;
            let copy = scratch.join("copy.sst");
            std::fs::copy(&fetched.path, &copy).map_err(|e| format!("{linked}; then copying it: {e}"))?;
            ingest(&self.db, vec![copy]).map_err(|e| format!("{linked}; then its copy: {e}"))?;
        }
        Ok(())
    }

    /// Range `i`'s entries from the full image the tables stand for, written as table files.
    fn load_from_image(&self, i: usize, scratch: &Path) -> Result<(), String> {
        let (start, end) = self.pending.ranges().bounds(i);
        // Beside the job and up to seven other loaders, in the same memory limit: smaller runs
        // than a restore's own.
        let mut load = BulkLoad::with_limits(&scratch.join("image"), LOADER_RUN_BYTES, LOADER_MERGE_FAN_IN);
        self.source.image_entries(start.unwrap_or(&[]), end, &mut |key, value| load.add(key, Some(value)))?;
        let opts = options();
        let mut tables = TableWriter::new(&scratch.join("image-tables"), &opts);
        load.into_live_entries(|key, value| tables.put(key, value))
            .map_err(|e| format!("sorting the image's entries: {e}"))?;
        let files = tables.finish().map_err(|e| format!("writing the image's entries: {e}"))?;
        ingest(&self.db, files).map_err(|e| format!("loading the image's entries: {e}"))
    }
}

/// The parts of `[start, end)` (no bound: `None`) outside key groups `[first, last)`, as
/// store-key ranges for deletion.
fn other_key_groups_within(
    (first, last): (u32, u32),
    start: Option<&[u8]>,
    end: Option<&[u8]>,
) -> Vec<(Vec<u8>, Vec<u8>)> {
    // Key groups are below 2^15, so no store key begins with two 0xff bytes.
    let (lowest, beyond) = (vec![0u8, 0], vec![0xffu8, 0xff, 0xff]);
    let (own_from, own_to) = ((first as u16).to_be_bytes().to_vec(), (last as u16).to_be_bytes().to_vec());
    let clip = |from: Vec<u8>, to: Vec<u8>| {
        let from = match start {
            Some(s) if s > from.as_slice() => s.to_vec(),
            _ => from,
        };
        let to = match end {
            Some(e) if e < to.as_slice() => e.to_vec(),
            _ => to,
        };
        (from < to).then_some((from, to))
    };
    [clip(lowest, own_from), clip(own_to, beyond)].into_iter().flatten().collect()
}

impl Drop for StateStore {
    fn drop(&mut self) {
        // A working copy: checkpoints hold the state, so nothing here is anyone's data.
        if let Some(lazy) = self.lazy.take() {
            lazy.pending.cancel();
            for loader in lazy.loaders {
                let _ = loader.join();
            }
        }
        drop(self.db.take());
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            tracing::warn!(dir = %self.dir.display(), error = %e, "could not delete a state store directory");
        }
    }
}

thread_local! {
    static PERF_COUNTERS_OFF: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Turns RocksDB's per-thread performance counters off on the calling thread, once. They are on
/// by default, and counting costs every read and write a lookup of the counters' thread-local
/// storage in the shared library: 7.5% of the task thread's time on the keyed count with a
/// cache of a tenth of the keys.
fn perf_counters_off() {
    PERF_COUNTERS_OFF.with(|off| {
        if !off.get() {
            rocksdb::perf::set_perf_stats(rocksdb::perf::PerfStatsLevel::Disable);
            off.set(true);
        }
    });
}

/// The store's options, also those of the table files a restore writes.
pub(crate) fn options() -> Options {
    let mut opts = Options::default();
    // Flushes, compactions and a restore's table files are synced as they are written: under a
    // cgroup v1 memory limit, dirty pages count against the limit until written back.
    opts.set_bytes_per_sync(weir_checkpoint::local::SYNC_EVERY_BYTES as u64);
    opts.create_if_missing(true);
    opts.set_compression_type(DBCompressionType::Lz4);
    opts.set_write_buffer_size(WRITE_BUFFER_BYTES);
    opts.set_max_write_buffer_number(WRITE_BUFFERS);
    opts.set_target_file_size_base(TARGET_FILE_BYTES);
    let mut table = BlockBasedOptions::default();
    match Cache::new_lru_cache(BLOCK_CACHE_BYTES) {
        Ok(cache) => table.set_block_cache(&cache),
        Err(e) => tracing::warn!(error = %e, "no block cache for the state store"),
    }
    // Most reads of a cache miss are of keys the store has never seen (new keys): a bloom
    // filter answers those without reading a block.
    table.set_bloom_filter(10.0, false);
    opts.set_block_based_table_factory(&table);
    // The same for the memtables: without a filter, every miss walks the skiplists, which
    // took a third of the process's CPU time on a keyed count whose state was 10× the cache.
    opts.set_memtable_whole_key_filtering(true);
    opts.set_memtable_prefix_bloom_ratio(0.1);
    // Keys arrive in random order (the store is ordered by key group, a hash, then key): each
    // level-0 file overlaps all of level 1, so every L0→L1 compaction rewrites level 1 whole.
    // Letting level 0 hold more files before writes slow down makes each of those compactions
    // take in more new data per byte of level 1 rewritten; and with three compaction threads
    // and two subcompactions, the L0→L1 compaction (of which only one runs at a time) splits
    // over two threads while another level's compaction runs. On a state of 630-byte entries
    // growing to 6 GiB in 4 minutes (BENCHMARKS.md, "Write stalls"), RocksDB's defaults (20
    // and 36 files, 2 jobs, no subcompactions) stalled writes 89 times in 3 minutes, and a
    // barrier queued behind the throttled task took up to 5.8 s; with these, none by level 0
    // and the state grew twice as fast.
    opts.set_level_zero_slowdown_writes_trigger(LEVEL0_SLOWDOWN_FILES);
    opts.set_level_zero_stop_writes_trigger(LEVEL0_STOP_FILES);
    opts.set_max_background_jobs(BACKGROUND_JOBS);
    opts.set_max_subcompactions(SUBCOMPACTIONS);
    opts
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The settings for keys in random order (see [`options`]) are those a store opens with,
    /// as RocksDB writes them to the store's OPTIONS file.
    #[test]
    fn a_store_opens_with_the_settings_for_random_keys() {
        let store = StateStore::open(&std::env::temp_dir().join("weir-state-tests"), "options").unwrap();
        let options_file = std::fs::read_dir(store.dir())
            .unwrap()
            .flatten()
            .find(|e| e.file_name().to_string_lossy().starts_with("OPTIONS-"))
            .expect("RocksDB writes an OPTIONS file");
        let text = std::fs::read_to_string(options_file.path()).unwrap();
        for setting in [
            format!("level0_slowdown_writes_trigger={LEVEL0_SLOWDOWN_FILES}"),
            format!("level0_stop_writes_trigger={LEVEL0_STOP_FILES}"),
            format!("max_background_jobs={BACKGROUND_JOBS}"),
            format!("max_subcompactions={SUBCOMPACTIONS}"),
            format!("max_write_buffer_number={WRITE_BUFFERS}"),
            format!("write_buffer_size={WRITE_BUFFER_BYTES}"),
        ] {
            assert!(text.lines().any(|l| l.trim() == setting), "{setting} not in {}", options_file.path().display());
        }
    }
}
