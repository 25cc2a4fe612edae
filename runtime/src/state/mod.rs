//! Keyed state of one operator subtask, on one of two backends:
//!
//! - **heap**: a hash map holding every entry;
//! - **rocksdb**: the same map as a bounded write-back cache in front of a RocksDB store on
//!   local disk ([`store`]), so that state may outgrow memory.
//!
//! Entries carry their key group (or the state computes it from the key, for a value that holds
//! its entry's flags in bits of its own: [`slot`]), and change tracking makes a checkpoint's
//! synchronous part cost O(changed keys). A snapshot encodes the entries changed since the
//! previous snapshot (or all of them for a full image) into an owned [`KeyedSnapshot`] in the
//! canonical state-file format, whichever the backend: a checkpoint or savepoint taken on one
//! backend restores on the other, and at any parallelism (entries are filtered by key group).
//! Upload happens later, off the task thread. Savepoints take full copies without disturbing
//! change tracking, so the next incremental checkpoint still holds every change since the
//! previous checkpoint.

pub mod bulk;
mod chain;
pub mod lazy;
pub mod map;
pub mod slot;
pub mod store;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rustc_hash::FxHashSet;
use weir_checkpoint::format::{
    keyed_entries, keyed_entries_in, Decoder, Encoder, FileKind, FormatError, StateFileStream, StateFileWriter,
};
use weir_checkpoint::local::WriterThread;

pub use chain::ChainFile;
pub use store::{StateStore, StoreError, StoreSettings};

use crate::value::{Key, StateKey};
use slot::{Slot, StateSlot, DIRTY, STORED, TOUCHED};

/// The largest full image the rocksdb backend keeps in memory; larger ones go to local disk.
pub const FULL_IMAGE_IN_MEMORY: usize = 8 << 20;

/// The largest full image the heap backend's task keeps in memory by default; larger ones go
/// to local disk. The keyed count's periodic images of 1M keys (about 20 MB) stay in memory;
/// a state of long values, whose image is about as large as the state, does not need twice
/// its memory when it writes one (a savepoint's, or the first after a restore from elsewhere).
/// Written to disk an image costs a sequential write, and on a local checkpoint directory
/// nothing more: it is linked there, not copied.
pub const HEAP_FULL_IMAGE_IN_MEMORY: u64 = 64 << 20;

/// A state value that can be written to and read from state files.
pub trait StateValue: Clone + Send + 'static {
    /// How the map holds the value beside its key: in a [`slot::Slot`] with the entry's key
    /// group and flags, or with the flags in bits of its own ([`slot::FlagsInside`]).
    type Slot: StateSlot<Self>;
    /// Binary encoding.
    fn encode(&self, e: &mut Encoder);
    /// Reads what `encode` wrote.
    fn decode(d: &mut Decoder<'_>) -> Result<Self, FormatError>;
    /// Reads a word of whatever the value keeps outside the map's entry (a heap slice), so that
    /// [`KeyedState::prefetch`] brings it into the CPU's caches with the entry. Returns the
    /// word read, for the caller to keep the read from being optimized away.
    #[inline]
    fn touch_outside(&self) -> usize {
        0
    }
    /// The value of every entry, when the type has only one (the `()` of a set of keys, such
    /// as a dedupe's). A key of such a state changes only by being inserted or removed, so an
    /// increment writes the keys inserted since the previous snapshot without looking up
    /// their entries (see [`KeyedState::snapshot_checkpoint`]).
    #[inline]
    fn only_value() -> Option<Self> {
        None
    }
}

impl StateValue for () {
    type Slot = Slot<Self>;

    fn encode(&self, _: &mut Encoder) {}
    fn decode(_: &mut Decoder<'_>) -> Result<Self, FormatError> {
        Ok(())
    }
    #[inline]
    fn only_value() -> Option<Self> {
        Some(())
    }
}

/// The `rocksdb` backend's store and the bound of the cache in front of it.
struct Spill<K> {
    store: StateStore,
    cache_entries: usize,
    /// Keys the last [`KeyedState::prefetch`] found in neither the cache nor the store: the
    /// batch's updates create them without reading the store again. A key leaves the set when
    /// it is inserted (it may be evicted to the store later in the batch).
    absent: FxHashSet<K>,
    /// A restore's entries, loaded into the store by [`KeyedState::after_restore`].
    restoring: Option<bulk::BulkLoad>,
    /// A restore's table files (local copies), taken into the store first by
    /// [`KeyedState::after_restore`], and the key groups to keep of them.
    restoring_tables: Vec<std::path::PathBuf>,
    restoring_key_groups: Option<(u32, u32)>,
    /// A restore's table files to bring in behind the job ([`KeyedState::restore_lazy_tables`]).
    restoring_lazily: Vec<Arc<dyn lazy::TableSource>>,
    /// Those tables as one source, their ranges, and the increments routed to the ranges (from
    /// the first restored file on).
    lazy_restore: Option<LazyRestore>,
    /// The shard the next eviction pass starts at ([`KeyedState::make_room`]'s clock hand).
    evict_from: usize,
    /// Entries evicted while changed since the last snapshot, as the store got them, in
    /// eviction order: the next increment takes them from here instead of reading them back
    /// from the store.
    evicted_changes: EvictedChanges<K>,
}

/// Entries evicted while changed (see [`Spill::evicted_changes`]).
struct EvictedChanges<K> {
    /// Key group, key, and the value's place in `values`.
    entries: Vec<(u32, K, std::ops::Range<usize>)>,
    values: Vec<u8>,
    /// More were evicted than are kept ([`EVICTED_CHANGES_MAX_BYTES`]): the next increment
    /// reads every evicted change back from the store, as if none were kept.
    overflowed: bool,
}

impl<K> Default for EvictedChanges<K> {
    fn default() -> Self {
        EvictedChanges { entries: Vec::new(), values: Vec::new(), overflowed: false }
    }
}

impl<K> EvictedChanges<K> {
    fn clear(&mut self) {
        self.entries.clear();
        self.values.clear();
        self.overflowed = false;
    }
}

/// Bytes of evicted changes kept for the next increment (values, plus 64 per entry); beyond
/// them the increment reads evicted changes back from the store. Without checkpoints nothing
/// takes them, so this is also all they ever hold. Tests keep a few, so that both ways are
/// taken.
const EVICTED_CHANGES_MAX_BYTES: usize = if cfg!(test) { 256 } else { 16 << 20 };

/// A lazy restore in the making: its tables as one source, their key ranges, and the
/// increments routed to the ranges as they are read.
struct LazyRestore {
    source: Arc<dyn lazy::TableSource>,
    ranges: lazy::Ranges,
    increments: bulk::RangeGroups,
}

impl<K> Spill<K> {
    /// The same store and cache bookkeeping with its keys `convert`ed (see
    /// [`KeyedState::into_keys`]): the store holds keys encoded, which `convert` keeps.
    fn into_keys<K2: StateKey>(self, convert: impl Fn(K) -> K2) -> Spill<K2> {
        let EvictedChanges { entries, values, overflowed } = self.evicted_changes;
        Spill {
            store: self.store,
            cache_entries: self.cache_entries,
            absent: self.absent.into_iter().map(&convert).collect(),
            restoring: self.restoring,
            restoring_tables: self.restoring_tables,
            restoring_key_groups: self.restoring_key_groups,
            restoring_lazily: self.restoring_lazily,
            lazy_restore: self.lazy_restore,
            evict_from: self.evict_from,
            evicted_changes: EvictedChanges {
                entries: entries.into_iter().map(|(group, key, at)| (group, convert(key), at)).collect(),
                values,
                overflowed,
            },
        }
    }

    /// Tables of a subtask that owned key groups `source` are restored into a store that owns
    /// `key_groups`: when the source owned more, the others are deleted after they come in.
    fn keep_key_groups_of(&mut self, source: (u32, u32), key_groups: (u32, u32)) {
        if source.0 < key_groups.0 || source.1 > key_groups.1 {
            self.restoring_key_groups = Some(key_groups);
        }
    }

    /// The lazy restore the registered table sources make, built once; `None` when there are
    /// none (or none has a table: an empty image).
    fn lazy_restore(&mut self) -> Result<Option<&mut LazyRestore>, StoreError> {
        if self.lazy_restore.is_none() {
            let sources: Vec<_> =
                std::mem::take(&mut self.restoring_lazily).into_iter().filter(|t| !t.first_keys().is_empty()).collect();
            if sources.is_empty() {
                return Ok(None);
            }
            let source: Arc<dyn lazy::TableSource> = if sources.len() == 1 {
                sources.into_iter().next().expect("one")
            } else {
                Arc::new(lazy::Combined::new(sources))
            };
            let Some(ranges) = lazy::Ranges::new(source.first_keys().to_vec()) else {
                return Err(StoreError::LazyRestore(format!("the first keys of {} overlap", source.describe())));
            };
            let increments = bulk::RangeGroups::new(&self.store.dir().join("increments"), ranges.len());
            self.lazy_restore = Some(LazyRestore { source, ranges, increments });
        }
        Ok(self.lazy_restore.as_mut())
    }
}

/// Tracked changes below which [`KeyedState::check_tracking`] does not look (and the entries
/// it counts at least). Tests look early.
const TRACKED_CHANGES_CHECK: usize = if cfg!(test) { 64 } else { 1 << 20 };

/// Keys of a batch looked up ahead ([`KeyedState::prefetch`]) before the batch's updates of
/// them run, at a time. The whole batch at once (8K words per batch in the CEL pipeline, after
/// its flatMap) brought in more entries and control bytes than the CPU's second-level cache
/// holds, and the updates missed them again.
pub const PREFETCH_CHUNK: usize = 512;

/// Changed keys whose lookups a snapshot runs back to back before encoding their entries.
const SNAPSHOT_LOOKUP_CHUNK: usize = 64;

/// Bytes of a store's entries that a full image reads and copies in about the time it encodes
/// one heap entry (see [`KeyedState::full_image_cost_in_entries`]).
const STORED_BYTES_PER_ENTRY_OF_WORK: u64 = 14;

/// Keyed state of one operator subtask, its keys held as `K` (see [`StateKey`]).
pub struct KeyedState<V: StateValue, K = Key> {
    /// Every entry (heap backend), or the cached ones (rocksdb backend).
    map: map::ShardedMap<K, V::Slot>,
    /// Keys changed since the last snapshot, with their key groups. With the heap backend,
    /// only while few: once more than a quarter of the keys changed, the next snapshot scans
    /// the dirty flags instead and the list stops growing (but a one-valued state's always
    /// lists them: [`Self::write_inserted_keys`]). With the rocksdb backend always, and it may
    /// repeat keys (an entry evicted while dirty leaves the map, and so its flag).
    changed: Vec<(u32, K)>,
    scan: bool,
    deleted: Vec<(u32, K)>,
    /// Nothing is tracked until the next snapshot, a full image: without incremental
    /// checkpoints always (before, a job without checkpoints grew its lists without bound),
    /// and after more keys changed or were removed since the last snapshot than twice the
    /// entries (a full image is then no larger than the increment would have been).
    untracked: bool,
    /// The tracked changes' count at which [`Self::check_tracking`] looks again.
    next_tracking_check: usize,
    max_parallelism: u32,
    incremental: bool,
    full_every: u32,
    /// Above this many entries the periodic full image is left to the uploader's background
    /// merge (see [`KeyedState::with_background_full_image_above`]).
    background_full_image_above: u64,
    increments_since_full: u32,
    /// Bytes per entry of the last increment: the next one's buffer is sized by it, so that
    /// it is taken whole from the spare buffers (`weir_checkpoint::spare`) instead of grown
    /// one doubling at a time into fresh memory.
    increment_entry_bytes: usize,
    force_full: Arc<AtomicBool>,
    /// Where the full images the task writes (forced ones, savepoints') go.
    images: FullImageBudget,
    spill: Option<Spill<K>>,
}

/// Where a full image written by the task goes: held in memory up to a number of bytes, moved
/// to a local file beyond that and written on there (deleted once uploaded). A heap state of
/// long values is about as large as its full image: the first checkpoint after a restore
/// from another root, or a savepoint, held in memory next to the state, would need twice
/// the state's memory.
#[derive(Clone, Debug)]
pub struct FullImageBudget {
    /// Most bytes of a full image held in memory.
    pub in_memory_max: u64,
    /// Where larger ones are written (files named `full-image-<pid>-<n>`: a killed process's
    /// are deleted by the next process that spills an image or opens a state store there).
    pub dir: std::path::PathBuf,
}

impl Default for FullImageBudget {
    /// Every image in memory.
    fn default() -> Self {
        FullImageBudget { in_memory_max: u64::MAX, dir: std::env::temp_dir().join("weir-state") }
    }
}

/// A snapshot of keyed state, already encoded as a state file by the task thread (encoding the
/// changed entries costs what copying them would, and the bytes are what the uploader needs).
pub struct KeyedSnapshot {
    /// Full image or increment.
    pub kind: FileKind,
    /// The state file (empty when it is in `file`).
    pub data: bytes::Bytes,
    /// The state file on local disk instead, when it was too large to hold in memory (the
    /// rocksdb backend's full images). Deleted when dropped.
    pub file: Option<LocalStateFile>,
    /// Its CRC-32C.
    pub crc32c: u32,
    /// Entries written.
    pub entries: u64,
    /// How many keys the state held when it was taken (heap backend; `None` on the rocksdb
    /// backend, which does not count them), for a restore to make room for at once.
    pub live_entries: Option<u64>,
    /// (heap backend) Where the puts start among the entries: deletions before, each key put
    /// once after ([`weir_checkpoint::metadata::FileRef::puts_from`]); 0 for a full image. `None`
    /// on the rocksdb backend, whose full images list a key twice when both its store and its
    /// cache hold it (the later entry wins).
    pub puts_from: Option<u64>,
    /// (heap backend, except a set's increments) The bytes of each shard's puts, in shard
    /// order: the file lists its puts shard after shard
    /// ([`weir_checkpoint::metadata::FileRef::shard_bytes`]).
    pub shard_bytes: Option<Vec<u64>>,
    /// (heap backend) Each shard's puts are in window order ([`map::window_order`]), which a
    /// restore of a chain reads front to back ([`weir_checkpoint::FileRef::in_window_order`]):
    /// the increments written from the changed keys. Full images and increments written by a
    /// scan of the map list each shard in its table's order.
    pub in_window_order: bool,
    /// Every key of the state's chain, this file and the ones before it, is one integer: the
    /// state holds its keys as [`crate::value::IntKey`]s
    /// ([`weir_checkpoint::SubtaskSnapshot::int_keys`]).
    pub int_keys: bool,
    /// (heap backend) The bytes an entry takes in the map's tables
    /// ([`weir_checkpoint::SubtaskSnapshot::table_slot_bytes`]).
    pub table_slot_bytes: Option<u32>,
}

impl<V: StateValue, K: StateKey> KeyedState<V, K> {
    /// Empty heap state. `incremental` and `full_every` come from the job's checkpointing
    /// settings.
    pub fn new(max_parallelism: u32, incremental: bool, full_every: u32) -> Self {
        KeyedState {
            map: map::ShardedMap::default(),
            changed: Vec::new(),
            // Without incremental checkpoints every snapshot is a full image: nothing to track.
            scan: !incremental,
            deleted: Vec::new(),
            untracked: !incremental,
            next_tracking_check: TRACKED_CHANGES_CHECK,
            max_parallelism,
            incremental,
            full_every: full_every.max(1),
            background_full_image_above: u64::MAX,
            increments_since_full: 0,
            increment_entry_bytes: 16,
            // The first checkpoint of a run is always a full image.
            force_full: Arc::new(AtomicBool::new(true)),
            images: FullImageBudget::default(),
            spill: None,
        }
    }

    /// The same state with its keys held as `K2`, each `convert`ed: for an operator whose
    /// keys outgrew their type (held as [`crate::value::IntKey`]s until a key of another
    /// value came). `convert` must keep a key's encoding, so that what was tracked for the
    /// next snapshot, the chain written so far and the rocksdb backend's store stay valid.
    pub fn into_keys<K2: StateKey>(self, convert: impl Fn(K) -> K2) -> KeyedState<V, K2> {
        let tracked = |list: Vec<(u32, K)>| list.into_iter().map(|(group, key)| (group, convert(key))).collect();
        KeyedState {
            changed: tracked(self.changed),
            deleted: tracked(self.deleted),
            map: self.map.into_keys(&convert),
            spill: self.spill.map(|spill| spill.into_keys(&convert)),
            scan: self.scan,
            untracked: self.untracked,
            next_tracking_check: self.next_tracking_check,
            max_parallelism: self.max_parallelism,
            incremental: self.incremental,
            full_every: self.full_every,
            background_full_image_above: self.background_full_image_above,
            increments_since_full: self.increments_since_full,
            increment_entry_bytes: self.increment_entry_bytes,
            force_full: self.force_full,
            images: self.images,
        }
    }

    /// Full images written by the task (heap backend) held in memory up to `budget`, on
    /// local disk beyond it.
    pub fn with_full_image_budget(mut self, budget: FullImageBudget) -> Self {
        self.images = budget;
        self
    }

    /// Empty state on the rocksdb backend: at most `cache_entries` entries in memory, the rest
    /// in `store`.
    pub fn on_store(mut self, store: StateStore, cache_entries: usize) -> Self {
        self.images = FullImageBudget {
            in_memory_max: self.images.in_memory_max.min(FULL_IMAGE_IN_MEMORY as u64),
            dir: store.parent_dir().to_path_buf(),
        };
        self.spill = Some(Spill {
            store,
            cache_entries: cache_entries.max(1),
            absent: FxHashSet::default(),
            restoring: None,
            restoring_tables: Vec::new(),
            restoring_key_groups: None,
            restoring_lazily: Vec::new(),
            lazy_restore: None,
            evict_from: 0,
            evicted_changes: EvictedChanges::default(),
        });
        self
    }

    /// Periodic full images of a state with more than `entries` entries (on the rocksdb
    /// backend, counting stored bytes too: [`Self::full_image_cost_in_entries`]) are not
    /// written by the task: its checkpoints stay increments, and the uploader merges the chain it has
    /// uploaded into a new full image in the background (`crate::compact`). Forced full images
    /// (the first of a run, after a failed upload) are still written here. Default: never.
    pub fn with_background_full_image_above(mut self, entries: u64) -> Self {
        self.background_full_image_above = entries;
        self
    }

    /// Entries in the state: exact on the heap backend; on the rocksdb backend the cached ones
    /// plus the store's estimate.
    /// Called when [`Self::next_tracking_check`] changes are tracked: stops tracking (see
    /// [`Self::untracked`]) when they are more than twice the entries, or looks again at
    /// twice as many.
    #[cold]
    fn check_tracking(&mut self) {
        let tracked = self.changed.len() + self.deleted.len();
        let entries = self.estimated_entries().max(TRACKED_CHANGES_CHECK as u64);
        if tracked as u64 > entries.saturating_mul(2) {
            tracing::debug!(
                tracked,
                entries,
                "more changes than entries since the last snapshot: the next is a full image"
            );
            self.untracked = true;
            self.scan = true;
            self.changed = Vec::new();
            self.deleted = Vec::new();
        } else {
            self.next_tracking_check = tracked.saturating_mul(2);
        }
    }

    /// Checks the tracked changes when due (see [`Self::check_tracking`]).
    #[inline]
    fn track_within_bounds(&mut self) {
        if self.changed.len() + self.deleted.len() >= self.next_tracking_check {
            self.check_tracking();
        }
    }

    /// After a full image: every change is in it, and tracking starts again (when increments
    /// are taken at all).
    fn tracking_restarts(&mut self) {
        self.changed.clear();
        self.deleted.clear();
        self.untracked = !self.incremental;
        self.scan = self.untracked;
        self.next_tracking_check = TRACKED_CHANGES_CHECK;
    }

    fn estimated_entries(&self) -> u64 {
        match &self.spill {
            None => self.map.len() as u64,
            // Tables still coming in are not counted by the store: the state is taken to be
            // large, so that the task does not write a full image (which would wait for them).
            Some(spill) if spill.store.loading() => u64::MAX,
            Some(spill) => spill.store.estimated_entries() + self.map.len() as u64,
        }
    }

    /// What a full image written by the task would cost it, in entries of the heap backend
    /// (about 45 ns each on the keyed count). On the rocksdb backend the task also reads and
    /// copies every stored byte, at about 3.3 ns a byte (a 578 MB image of 630-byte entries
    /// held the task for 1.83 s, 1,016 MB for 3.6 s): its entries count once more for every
    /// [`STORED_BYTES_PER_ENTRY_OF_WORK`] bytes of its table files, so that large values do
    /// not keep the image on the task (`backgroundFullImageAbove` is in these entries). Those
    /// files are compressed (fewer bytes than the image) but also hold keys' older versions,
    /// which a scan reads and skips: a rough estimate, which is all the choice needs.
    fn full_image_cost_in_entries(&self) -> u64 {
        match &self.spill {
            Some(spill) if !spill.store.loading() => {
                self.estimated_entries().saturating_add(spill.store.estimated_bytes() / STORED_BYTES_PER_ENTRY_OF_WORK)
            }
            _ => self.estimated_entries(),
        }
    }

    /// The flag the uploader raises when an upload failed (the next snapshot must be full).
    pub fn force_full_flag(&self) -> Arc<AtomicBool> {
        self.force_full.clone()
    }

    /// Number of entries in memory: every key on the heap backend, the cached ones otherwise.
    pub fn cached_len(&self) -> usize {
        self.map.len()
    }

    /// The key group of a key.
    #[inline]
    pub fn key_group(&self, key: &K) -> u32 {
        key.key_group(self.max_parallelism)
    }

    /// Brings a key's entry from the store into the cache when it is only in the store; whether
    /// the key exists. Heap backend: whether it is in the map.
    fn load(&mut self, key: &K) -> Result<bool, StoreError> {
        if self.map.contains_key(key) {
            return Ok(true);
        }
        let Some(spill) = &self.spill else { return Ok(false) };
        if spill.absent.contains(key) {
            return Ok(false);
        }
        let key_group = key.key_group(self.max_parallelism);
        let raw = StateStore::key_of(key_group, key);
        // The stored value is pinned in the store's cache only while it is decoded.
        let value = match spill.store.get(&raw)? {
            Some(stored) => V::decode(&mut Decoder::new(&stored))?,
            None => return Ok(false),
        };
        self.make_room(1)?;
        self.map.insert(key.clone(), V::Slot::new(value, key_group, TOUCHED | STORED));
        Ok(true)
    }

    /// Evicts entries (writing the dirty ones to the store) until `incoming` more fit in the
    /// cache. Evicts an eighth of the cache at once so that the pass over the map, which
    /// gives recently used entries a second chance, is paid once per many insertions.
    ///
    /// The pass is a clock hand over the map's shards: it goes on from the shard where the last
    /// one stopped, and stops after the shard where enough were evicted. Passes that always
    /// began at the first shard emptied the first shards over and over and left the last ones
    /// full: each shard's table grew to the most it ever held, and a cache of 10K entries had
    /// tables with room for 54K (a cache of 100K took 48 MB of tables, where 15 MB do).
    fn make_room(&mut self, incoming: usize) -> Result<(), StoreError> {
        let Some(spill) = &mut self.spill else { return Ok(()) };
        let capacity = spill.cache_entries;
        if self.map.len() + incoming <= capacity {
            return Ok(());
        }
        let target = capacity.saturating_sub(incoming.max(capacity / 8));
        let mut excess = self.map.len().saturating_sub(target);
        let mut batch = spill.store.batch();
        let mut raw_key = Vec::with_capacity(32);
        let mut value = Encoder::default();
        let evicted_changes = &mut spill.evicted_changes;
        let keep_changes = self.incremental;
        let max_parallelism = self.max_parallelism;
        for second_chance in [true, false] {
            let mut visited = 0;
            while excess > 0 && visited < map::SHARDS {
                let shard = spill.evict_from;
                spill.evict_from = (shard + 1) % map::SHARDS;
                visited += 1;
                self.map.retain_shard(shard, |k, s| {
                    if excess == 0 {
                        return true;
                    }
                    if second_chance && s.touched() {
                        s.set_touched(false);
                        return true;
                    }
                    if !s.stored() {
                        raw_key.clear();
                        StateStore::encode_key(s.key_group_of(k, max_parallelism), k, &mut raw_key);
                        value.buf.clear();
                        s.value().encode(&mut value);
                        batch.put(&raw_key, &value.buf);
                        if s.dirty() && keep_changes && !evicted_changes.overflowed {
                            let kept = evicted_changes.values.len() + evicted_changes.entries.len() * 64;
                            if kept + value.buf.len() > EVICTED_CHANGES_MAX_BYTES {
                                // Their memory too: without checkpoints, nothing would.
                                *evicted_changes = EvictedChanges { overflowed: true, ..EvictedChanges::default() };
                            } else {
                                let at = evicted_changes.values.len();
                                evicted_changes.values.extend_from_slice(&value.buf);
                                evicted_changes.entries.push((
                                    s.key_group_of(k, max_parallelism),
                                    k.clone(),
                                    at..at + value.buf.len(),
                                ));
                            }
                        }
                    }
                    excess -= 1;
                    false
                });
            }
        }
        spill.store.write(batch)
    }

    /// The value of a key, for reading.
    pub fn get(&mut self, key: &K) -> Result<Option<&V>, StoreError> {
        if self.spill.is_some() {
            self.load(key)?;
        }
        Ok(self.map.get_mut(key).map(|s| {
            s.set_touched(true);
            s.value()
        }))
    }

    /// Inserts `key` with `value` unless it exists; whether it was inserted. One lookup where
    /// [`Self::get`] then [`Self::update`] would take two (two store reads for a new key).
    pub fn insert_new(&mut self, key: K, value: V) -> Result<bool, StoreError> {
        self.insert_new_hashed(map::hash_of(&key), key, value)
    }

    /// [`Self::insert_new`] of a key whose hash [`Self::prefetch`] returned.
    pub fn insert_new_hashed(&mut self, hash: u64, key: K, value: V) -> Result<bool, StoreError> {
        self.insert_new_grouped(hash, None, key, value)
    }

    /// [`Self::insert_new_hashed`], with the key's key group when the caller computed it.
    #[inline]
    fn insert_new_grouped(&mut self, hash: u64, key_group: Option<u32>, key: K, value: V) -> Result<bool, StoreError> {
        self.track_within_bounds();
        if self.spill.is_none() {
            // Heap backend: one probe of the map finds the key or the slot for it (a lookup
            // and then an insert probed twice; dedupe inserts a new key per record).
            let (changed, scan, max_parallelism) = (&mut self.changed, self.scan, self.max_parallelism);
            return Ok(self.map.insert_absent_hashed(hash, key, |key| {
                let key_group = key_group.unwrap_or_else(|| key.key_group(max_parallelism));
                if !scan {
                    changed.push((key_group, key.clone()));
                }
                V::Slot::new(value, key_group, DIRTY | TOUCHED)
            }));
        }
        if self.load(&key)? {
            return Ok(false);
        }
        self.make_room(1)?;
        let key_group = key_group.unwrap_or_else(|| key.key_group(self.max_parallelism));
        if !self.scan {
            self.changed.push((key_group, key.clone()));
        }
        if let Some(spill) = &mut self.spill {
            spill.absent.remove(&key);
        }
        self.map.insert(key, V::Slot::new(value, key_group, DIRTY | TOUCHED));
        Ok(true)
    }

    /// [`Self::insert_new`] of every key of a batch, with `value`; whether each was inserted.
    ///
    /// Heap backend: the keys are hashed and looked up ([`Self::prefetch`]), then inserted in a
    /// loop that does nothing else. A new key's entry is written to a bucket missing from the
    /// CPU's caches; a loop that also moved each record stalled on those writes one by one
    /// (the CEL pipeline: 2-4% less CPU; hashing alone, without the lookups, measured no
    /// better). The chunk's key groups are computed in a pass of their own too: each is a
    /// chain of multiplications that, computed inside the insert loop, ran one after the
    /// other, and in a loop of their own overlap (with the keys moved out whole, below: the
    /// CEL pipeline 4-18% less CPU in six concurrent pairs). A key already there has had its
    /// key group computed for nothing.
    pub fn insert_new_all(&mut self, keys: Vec<K>, value: V) -> Result<Vec<bool>, StoreError> {
        let mut inserted = Vec::with_capacity(keys.len());
        let mut keys = keys.into_iter();
        let mut chunk = Vec::with_capacity(PREFETCH_CHUNK.min(keys.len()));
        loop {
            chunk.extend(keys.by_ref().take(PREFETCH_CHUNK));
            if chunk.is_empty() {
                return Ok(inserted);
            }
            let hashes = self.prefetch(&chunk)?;
            // Each key is moved out of the chunk whole: taken through the drain's `Option`,
            // its first byte was read apart from the rest, and the rest was copied in two
            // overlapping pieces that the next copy read back before they reached the cache.
            let key_groups: Vec<u32> = chunk.iter().map(|k| k.key_group(self.max_parallelism)).collect();
            for ((hash, key_group), slot) in hashes.into_iter().zip(key_groups).zip(chunk.iter_mut()) {
                let key = std::mem::replace(slot, K::vacated());
                inserted.push(self.insert_new_grouped(hash, Some(key_group), key, value.clone())?);
            }
            chunk.clear();
        }
    }

    /// Looks up `keys` back to back, reading a flag at the end of each entry found. An entry
    /// (key and slot) is 72 bytes and so spans two cache lines: the key's comparison loads the
    /// first, the flag the second, and the caller's update or encoding that follows finds both
    /// in cache. A value that keeps part of itself outside the entry has that read too
    /// ([`StateValue::touch_outside`]).
    fn touch<'k>(&self, keys: impl IntoIterator<Item = (u64, &'k K)>) {
        let read = keys
            .into_iter()
            .filter_map(|(hash, k)| self.map.get_hashed(hash, k))
            .fold(0usize, |read, s| read.wrapping_add(usize::from(s.dirty())).wrapping_add(s.value().touch_outside()));
        std::hint::black_box(read);
    }

    /// Prepares a batch's keys before the batch updates them, and returns their hashes in the
    /// map, for [`Self::update_hashed`] and [`Self::insert_new_hashed`] (the keys are hashed in
    /// a pass of their own: see [`map::hashes_of`]).
    ///
    /// Heap backend: brings their entries into the CPU's caches. A lookup's time is mostly two
    /// cache misses (the control bytes, then the entry); in a loop that does nothing else the
    /// CPU overlaps the misses of many independent lookups, where interleaved with each
    /// record's other work it waits for them one by one. On the 1M-key count (parallelism 2)
    /// this took the job from 3.1M to 4.2M records per CPU-second; reading the second cache
    /// line of each entry too (see [`Self::touch`]) took the 1M-key count's CPU time down by
    /// another 10% (three runs of 12M records each way, alternating). The two misses of one
    /// lookup still came one after the other; prefetch instructions for every key's control
    /// bytes and probe's first bucket ([`map::ShardedMap::prefetch_probes`]), before the
    /// lookups, let them all overlap: the 1M-key count took 25-30% less CPU time, the CEL
    /// pipeline 5-10%. (A prefetch, for writing, of where each key not found would be
    /// inserted paid before the probes were prefetched, 13-20% of the CEL pipeline, and
    /// nothing after: 0.92-1.00 without it, reversed 0.92-1.07, and the keyed count 0.95-0.96,
    /// so it went, with the guess of a new key's bucket it needed.)
    ///
    /// Rocksdb backend: reads the keys missing from the cache from the store in one call.
    pub fn prefetch(&mut self, keys: &[K]) -> Result<Vec<u64>, StoreError> {
        let hashes = map::hashes_of(keys);
        if self.spill.is_none() {
            self.map.prefetch_probes(&hashes);
            self.touch(hashes.iter().copied().zip(keys));
            return Ok(hashes);
        }
        let mut seen = FxHashSet::default();
        let mut missing: Vec<(&K, u32)> = Vec::new();
        for (&hash, k) in hashes.iter().zip(keys) {
            if self.map.get_hashed(hash, k).is_none() && seen.insert(k) {
                missing.push((k, k.key_group(self.max_parallelism)));
            }
        }
        let spill = self.spill.as_mut().expect("checked above");
        spill.absent.clear();
        if missing.is_empty() {
            return Ok(hashes);
        }
        let raw: Vec<Vec<u8>> = missing.iter().map(|(k, kg)| StateStore::key_of(*kg, *k)).collect();
        let found = spill.store.multi_get(&raw)?;
        let mut loaded: Vec<(K, u32, V)> = Vec::with_capacity(found.len());
        for ((k, kg), v) in missing.into_iter().zip(found) {
            match v {
                Some(v) => loaded.push((k.clone(), kg, V::decode(&mut Decoder::new(&v))?)),
                None => {
                    spill.absent.insert(k.clone());
                }
            }
        }
        self.make_room(loaded.len())?;
        for (key, key_group, value) in loaded {
            self.map.insert(key, V::Slot::new(value, key_group, TOUCHED | STORED));
        }
        Ok(hashes)
    }

    /// The value of a key for update, created with `init` when absent; marks it changed.
    #[inline]
    pub fn update(&mut self, key: K, init: impl FnOnce() -> V) -> Result<&mut V, StoreError> {
        self.update_hashed(map::hash_of(&key), key, init)
    }

    /// [`Self::update`] of a key whose hash [`Self::prefetch`] returned.
    #[inline]
    pub fn update_hashed(&mut self, hash: u64, key: K, init: impl FnOnce() -> V) -> Result<&mut V, StoreError> {
        use map::MapEntry as Entry;
        self.track_within_bounds();
        if self.spill.is_some() && !self.load(&key)? {
            self.make_room(1)?;
        }
        let len = self.map.len();
        let track_all = self.spill.is_some();
        match self.map.entry_hashed(hash, key) {
            Entry::Occupied(o) => {
                if !o.get().dirty() && !self.scan {
                    self.changed.push((o.get().key_group_of(o.key(), self.max_parallelism), o.key().clone()));
                    self.scan = !track_all && self.changed.len() * 4 > len;
                }
                let slot = o.into_mut();
                slot.mark_written();
                Ok(slot.value_mut())
            }
            Entry::Vacant(v) => {
                let key_group = v.key().key_group(self.max_parallelism);
                if !self.scan {
                    self.changed.push((key_group, v.key().clone()));
                }
                if let Some(spill) = &mut self.spill {
                    spill.absent.remove(v.key());
                }
                Ok(v.insert(V::Slot::new(init(), key_group, DIRTY | TOUCHED)).value_mut())
            }
        }
    }

    /// Like [`Self::update`] for an existing key; `None` when absent.
    pub fn update_existing(&mut self, key: &K) -> Result<Option<&mut V>, StoreError> {
        self.track_within_bounds();
        if self.spill.is_some() {
            self.load(key)?;
        }
        let (changed, scan, max_parallelism) = (&mut self.changed, self.scan, self.max_parallelism);
        Ok(self.map.get_mut(key).map(|slot| {
            if !slot.dirty() && !scan {
                changed.push((slot.key_group_of(key, max_parallelism), key.clone()));
            }
            slot.mark_written();
            slot.value_mut()
        }))
    }

    /// Removes a key.
    pub fn remove(&mut self, key: &K) -> Result<Option<V>, StoreError> {
        self.track_within_bounds();
        if self.spill.is_some() {
            self.load(key)?;
        }
        let Some(slot) = self.map.remove(key) else { return Ok(None) };
        if let Some(spill) = &self.spill {
            let raw = StateStore::key_of(slot.key_group_of(key, self.max_parallelism), key);
            let mut batch = spill.store.batch();
            batch.delete(&raw);
            spill.store.write(batch)?;
        }
        if !self.untracked {
            self.deleted.push((slot.key_group_of(key, self.max_parallelism), key.clone()));
        }
        Ok(Some(slot.into_value()))
    }

    /// Calls `f` with every entry (for rebuilding derived indexes after a restore, and tests).
    pub fn for_each(&self, mut f: impl FnMut(&K, &V)) -> Result<(), StoreError> {
        for (k, s) in self.map.iter() {
            f(k, s.value());
        }
        if let Some(spill) = &self.spill {
            spill.store.scan(|raw_key, raw_value| {
                let (_, encoded_key) = StateStore::split_key(raw_key)?;
                let key = K::decode(encoded_key)?;
                if !self.map.contains_key(&key) {
                    f(&key, &V::decode(&mut Decoder::new(raw_value))?);
                }
                Ok::<_, StoreError>(())
            })?;
        }
        Ok(())
    }

    /// Takes the synchronous part of a checkpoint: an increment of the changes since the
    /// previous snapshot, or a full image when due. Cost: O(changed keys) for an increment
    /// (a sequential scan replaces per-key lookups when most keys changed on the heap backend;
    /// the rocksdb backend reads the evicted changed entries back in one call).
    pub fn snapshot_checkpoint(&mut self) -> Result<KeyedSnapshot, StoreError> {
        let snapshot = self.checkpoint_file()?;
        Ok(self.described(snapshot))
    }

    /// The state file of [`Self::snapshot_checkpoint`].
    fn checkpoint_file(&mut self) -> Result<KeyedSnapshot, StoreError> {
        let periodic = self.increments_since_full + 1 >= self.full_every
            && self.full_image_cost_in_entries() <= self.background_full_image_above;
        let full = !self.incremental || self.force_full.swap(false, Ordering::AcqRel) || periodic || self.untracked;
        if full {
            self.increments_since_full = 0;
            self.tracking_restarts();
            for s in self.map.values_mut() {
                s.set_dirty(false);
            }
            if let Some(spill) = &mut self.spill {
                // In the store, which the image reads whole.
                spill.evicted_changes.clear();
            }
            return self.full_image();
        }
        if self.spill.is_some() {
            return self.snapshot_checkpoint_on_store();
        }
        // A set of keys writes its increment from the changed list alone, however long.
        let only_value = V::only_value().filter(|_| !self.scan);
        let scan = std::mem::take(&mut self.scan) || (only_value.is_none() && self.changed.len() * 4 > self.map.len());
        self.increments_since_full = self.increments_since_full.saturating_add(1);
        let mut w = StateFileWriter::new(FileKind::KeyedIncrement, self.increment_capacity(0));
        // Deletions first: a key removed and inserted again since the previous snapshot is in
        // both lists, and a restore applies entries in file order, so its put must come last.
        let deleted = std::mem::take(&mut self.deleted);
        for (kg, k) in &deleted {
            w.delete_encoded(*kg, |e| k.encode(e));
        }
        // Each key once from here: the map's dirty entries, or a set's inserted keys (a key
        // inserted again is put again, with the same value).
        let puts_from = w.entries_len() as u64;
        let mut shard_bytes = vec![0u64; map::SHARDS];
        let in_window_order = only_value.is_none() && !scan;
        if let Some(value) = &only_value {
            self.write_inserted_keys(&mut w, &deleted, value);
        } else if scan {
            shard_bytes = self.put_dirty_by_shard(&mut w);
            self.changed.clear();
        } else {
            // The increment then lists its entries in window order, as a restore fills its map.
            let mut changed = std::mem::take(&mut self.changed);
            let order = Self::in_window_order(&changed);
            for chunk in order.chunks(SNAPSHOT_LOOKUP_CHUNK) {
                self.touch(chunk.iter().map(|&(_, hash, i)| (hash, &changed[i].1)));
                for &(_, hash, i) in chunk {
                    let (key_group, k) = (changed[i].0, &changed[i].1);
                    if let Some(s) = self.map.get_mut_hashed(hash, k) {
                        if s.dirty() {
                            s.set_dirty(false);
                            let from = w.entries_len();
                            w.put_encoded(key_group, |e| k.encode(e), |e| s.value().encode(e));
                            // In window order, shard after shard.
                            shard_bytes[map::shard_of(hash)] += (w.entries_len() - from) as u64;
                        }
                    }
                }
            }
            // The list's memory serves the next interval's changes.
            changed.clear();
            self.changed = changed;
        }
        // The list's memory serves the next interval's removals.
        let mut deleted = deleted;
        deleted.clear();
        self.deleted = deleted;
        let mut snapshot = finish(FileKind::KeyedIncrement, w);
        snapshot.puts_from = Some(puts_from);
        snapshot.shard_bytes = only_value.is_none().then_some(shard_bytes);
        snapshot.in_window_order = in_window_order;
        Ok(self.increment_written(snapshot))
    }

    /// Puts the map's changed entries into `w` shard after shard, each then clean; the bytes of
    /// each shard's.
    fn put_dirty_by_shard(&mut self, w: &mut StateFileWriter) -> Vec<u64> {
        let max_parallelism = self.max_parallelism;
        (0..map::SHARDS)
            .map(|shard| {
                let from = w.entries_len();
                for (k, s) in self.map.shard_iter_mut(shard).filter(|(_, s)| s.dirty()) {
                    s.set_dirty(false);
                    w.put_encoded(s.key_group_of(k, max_parallelism), |e| k.encode(e), |e| s.value().encode(e));
                }
                (w.entries_len() - from) as u64
            })
            .collect()
    }

    /// `snapshot` with what the state knows of its keys: whether they are all integers
    /// ([`StateKey::INTEGERS_ONLY`]), and the number it holds now: on the heap backend the map's,
    /// which holds them all; on the rocksdb backend a full image's puts, which list every key
    /// once, but twice a key whose changed value is still only in the cache (the count a
    /// restore would make by reading the image, at most the cache's size above the keys). The
    /// rocksdb backend's increments count nothing (its store is not counted as it changes).
    /// A savepoint taken on the rocksdb backend thus tells a heap restore how much room to
    /// make without a pass over the image to count it.
    fn described(&self, mut snapshot: KeyedSnapshot) -> KeyedSnapshot {
        snapshot.live_entries = match (&self.spill, snapshot.kind) {
            (None, _) => Some(self.map.len() as u64),
            (Some(_), FileKind::KeyedFull) => Some(snapshot.entries),
            (Some(_), _) => None,
        };
        snapshot.int_keys = K::INTEGERS_ONLY;
        snapshot.table_slot_bytes = match &self.spill {
            None => u32::try_from(map::ShardedMap::<K, V::Slot>::SLOT_BYTES).ok(),
            Some(_) => None,
        };
        snapshot
    }

    /// The puts of an increment of a state whose entries all hold `value`
    /// ([`StateValue::only_value`]): every changed key, in the order the keys changed, without
    /// looking up its entry. Such a key changed by being inserted (an update cannot change its
    /// value), and it is still in the map unless it is among the keys removed since, `deleted`
    /// (those are looked up: removed after it was inserted, it must not be put back). A key
    /// listed twice (inserted, removed and inserted again) is put twice, which restores the same.
    ///
    /// The entries' dirty flags stay set. For a one-valued state that costs nothing wrong: an
    /// update that finds the flag set is not listed, and it changed nothing; a scan, if one
    /// comes, writes the entry again with the value it has.
    ///
    /// The increment is not in window order (as the others are, for a restore that fills its
    /// map window by window): sorting the list took back what the lookups saved, because reading
    /// a list larger than the CPU's caches out of its order misses them at every key. On the
    /// CEL pipeline, whose dedupe inserts a new key per record, the job took 4-5% less CPU
    /// time; taking each key group from the list instead of computing it again, 3% more.
    fn write_inserted_keys(&mut self, w: &mut StateFileWriter, deleted: &[(u32, K)], value: &V) {
        let removed: FxHashSet<&K> = deleted.iter().map(|(_, k)| k).collect();
        let mut changed = std::mem::take(&mut self.changed);
        for (key_group, k) in &changed {
            if !removed.is_empty() && removed.contains(k) && self.map.get(k).is_none() {
                continue;
            }
            w.put_encoded(*key_group, |e| k.encode(e), |e| value.encode(e));
        }
        changed.clear();
        self.changed = changed;
    }

    /// `keys` in window order ([`map::window_order`]), as (that order, hash, index into
    /// `keys`): looked up in this order, in chunks whose entries [`Self::touch`] brings into the
    /// CPU's caches first (as [`Self::prefetch`] does), their lookups run back to back. In a map
    /// larger than the CPU's caches, keys taken in the order they changed cost a TLB and two
    /// cache misses each, which a loop that also encodes waits for one by one; in window order
    /// the lookups visit the map's tables 4096 buckets at a time. Equal keys come out side by
    /// side (equal hashes).
    fn in_window_order(keys: &[(u32, K)]) -> Vec<(u64, u64, usize)> {
        let mut order: Vec<(u64, u64, usize)> = keys
            .iter()
            .enumerate()
            .map(|(i, (_, k))| {
                let hash = map::hash_of(k);
                (map::window_order(hash), hash, i)
            })
            .collect();
        order.sort_unstable();
        order
    }

    /// The bytes the next increment will likely take: its changes at the last one's bytes per
    /// entry, plus `evicted_bytes` of evicted changes' values; at most the largest spare
    /// buffer (`weir_checkpoint::spare::MAX_SPARE_BYTES`), beyond which a guess gains nothing
    /// and a wrong one (a few huge entries last time, many small ones now) could ask for more
    /// memory than the machine has.
    fn increment_capacity(&self, evicted_bytes: usize) -> usize {
        let changes = self.changed.len() + self.deleted.len();
        changes
            .saturating_mul(self.increment_entry_bytes)
            .saturating_add(evicted_bytes)
            .min(weir_checkpoint::spare::MAX_SPARE_BYTES)
    }

    /// Learns the bytes per entry of an increment just written ([`Self::increment_capacity`]).
    fn increment_written(&mut self, snapshot: KeyedSnapshot) -> KeyedSnapshot {
        if let Some(per_entry) = (snapshot.data.len() as u64).checked_div(snapshot.entries) {
            self.increment_entry_bytes = (per_entry as usize).clamp(8, 1 << 20);
        }
        snapshot
    }

    /// [`Self::snapshot_checkpoint`] on the rocksdb backend.
    fn snapshot_checkpoint_on_store(&mut self) -> Result<KeyedSnapshot, StoreError> {
        let evicted_changes = std::mem::take(&mut self.spill.as_mut().expect("on the rocksdb backend").evicted_changes);
        self.increments_since_full = self.increments_since_full.saturating_add(1);
        // Ordered by key group when finished, so that a lazy restore reads a range's part of it
        // without the rest (`bulk::RangeGroups::take_range_by_key_group`).
        let mut w = StateFileWriter::increment_by_key_group(self.increment_capacity(evicted_changes.values.len()));
        // Deletions first (see `snapshot_checkpoint`), then the changes evicted since (in the
        // order the store got them), then the cached changes: each later entry of a key is
        // its newer value.
        let deleted = std::mem::take(&mut self.deleted);
        for (kg, k) in &deleted {
            w.delete_encoded(*kg, |e| k.encode(e));
        }
        let deleted: FxHashSet<&K> = deleted.iter().map(|(_, k)| k).collect();
        // An evicted change whose key is cached again is written from the cache below (it is
        // among the changed keys). One whose key was removed since is read back from the
        // store instead: the removal comes first in the file, and the store knows whether the
        // key came back after it.
        let overflowed = evicted_changes.overflowed;
        for (kg, k, at) in &evicted_changes.entries {
            if !self.map.contains_key(k) && !deleted.contains(k) {
                w.put_encoded(*kg, |e| k.encode(e), |e| e.buf.extend_from_slice(&evicted_changes.values[at.clone()]));
            }
        }
        let changed = std::mem::take(&mut self.changed);
        let mut evicted: Vec<&K> = Vec::new();
        // In window order, as the heap backend's increments take them (the cache's lookups
        // visit its tables window by window); the order also brings a key's repeats together.
        let order = Self::in_window_order(&changed);
        // Where the keys of the current hash begin in `order`.
        let mut same_hash_from = 0;
        for (chunk_at, chunk) in order.chunks(SNAPSHOT_LOOKUP_CHUNK).enumerate() {
            self.touch(chunk.iter().map(|&(_, hash, i)| (hash, &changed[i].1)));
            for (j, &(_, hash, i)) in chunk.iter().enumerate() {
                let at = chunk_at * SNAPSHOT_LOOKUP_CHUNK + j;
                if order[same_hash_from].1 != hash {
                    same_hash_from = at;
                }
                let k = &changed[i].1;
                if order[same_hash_from..at].iter().any(|&(_, _, earlier)| changed[earlier].1 == *k) {
                    continue;
                }
                match self.map.get_mut_hashed(hash, k) {
                    // Clean entries too: one may have been evicted while dirty and read back
                    // since.
                    Some(s) => {
                        s.set_dirty(false);
                        w.put_encoded(
                            s.key_group_of(k, self.max_parallelism),
                            |e| k.encode(e),
                            |e| s.value().encode(e),
                        );
                    }
                    None if overflowed || deleted.contains(k) => evicted.push(k),
                    // Written from the evicted changes above.
                    None => {}
                }
            }
        }
        let spill = self.spill.as_mut().expect("on the rocksdb backend");
        let mut reuse = evicted_changes;
        reuse.clear();
        spill.evicted_changes = reuse;
        let raw: Vec<Vec<u8>> =
            evicted.iter().map(|k| StateStore::key_of(k.key_group(self.max_parallelism), *k)).collect();
        for (raw_key, value) in raw.iter().zip(spill.store.multi_get(&raw)?) {
            // Absent: removed after it changed, and the removal is written above.
            if let Some(value) = value {
                let (key_group, encoded_key) = StateStore::split_key(raw_key)?;
                w.put_encoded(key_group, |e| e.buf.extend_from_slice(encoded_key), |e| e.buf.extend_from_slice(&value));
            }
        }
        Ok(self.increment_written(finish(FileKind::KeyedIncrement, w)))
    }

    /// Every entry, cached or stored, as a full image.
    ///
    /// On the rocksdb backend the image is streamed (it stays in memory up to
    /// [`FULL_IMAGE_IN_MEMORY`] bytes and goes to a file next to the store beyond that): every
    /// stored entry, then the cache's entries that the store lacks (or holds an older value
    /// of). A key in both appears twice, and a restore, which applies entries in file order,
    /// keeps the cached value; no stored key has to be looked up in the cache.
    fn full_image(&self) -> Result<KeyedSnapshot, StoreError> {
        let Some(spill) = &self.spill else {
            let mut w = StateFileStream::new(FileKind::KeyedFull, self.image_out());
            let shard_bytes = (0..map::SHARDS)
                .map(|shard| put_shard::<K, V, _>(&mut w, self.map.shard_iter(shard), self.max_parallelism))
                .collect::<std::io::Result<Vec<u64>>>()
                .map_err(StoreError::SpillImage)?;
            // The map's keys, each once (the rocksdb backend's below may list a key twice).
            return Ok(KeyedSnapshot { puts_from: Some(0), shard_bytes: Some(shard_bytes), ..sealed_image(w)? });
        };
        let spill_failed = |e: std::io::Error| StoreError::SpillImage(e);
        let mut w = StateFileStream::new(FileKind::KeyedFull, self.image_out());
        spill.store.scan(|raw_key, raw_value| {
            let (key_group, encoded_key) = StateStore::split_key(raw_key)?;
            w.put(key_group, encoded_key, raw_value).map_err(spill_failed)
        })?;
        let mut cached = StateFileWriter::new(FileKind::KeyedFull, 0);
        for (k, s) in self.map.iter().filter(|(_, s)| !s.stored()) {
            cached.put_encoded(s.key_group_of(k, self.max_parallelism), |e| k.encode(e), |e| s.value().encode(e));
        }
        let (cached, cached_entries) = cached.into_entries();
        w.put_entries(&cached, cached_entries).map_err(spill_failed)?;
        sealed_image(w)
    }

    /// Where the task's next full image goes: memory up to the budget, then a local file.
    fn image_out(&self) -> SpillingBuffer {
        let bound = usize::try_from(self.images.in_memory_max).unwrap_or(usize::MAX);
        // The heap map's image takes at least 16 bytes an entry (sized as the increments'
        // buffers are, it would not be grown one doubling at a time from empty).
        let guess = if self.spill.is_none() { self.map.len().saturating_mul(16) } else { 0 };
        SpillingBuffer { memory: Vec::with_capacity(guess.min(bound)), bound, dir: self.images.dir.clone(), file: None }
    }

    /// A full image for a savepoint; change tracking is left as it is.
    pub fn snapshot_full_copy(&self) -> Result<KeyedSnapshot, StoreError> {
        Ok(self.described(self.full_image()?))
    }

    /// Makes room for `entries` keys about to be restored: the number the restored snapshot
    /// counted (`SubtaskSnapshot::keyed_entries`), so that a chain whose increments add keys
    /// does not grow the map as it is applied; its tables carved from `faulted` as far as it
    /// goes (memory the restore faulted in while it read the files). Nothing to do on the
    /// rocksdb backend, which restores into its store.
    pub fn reserve_restored_entries(&mut self, entries: u64, faulted: Option<&crate::malloc::PrefaultedTables>) {
        if self.spill.is_none() {
            self.map.reserve_prefaulted(usize::try_from(entries).unwrap_or(usize::MAX), faulted);
        }
    }

    /// Makes room for the entries of a full image in `[start, end)` before it is restored,
    /// when the snapshot did not count its keys ([`Self::reserve_restored_entries`]): a map
    /// grown one doubling at a time moves every entry again at each doubling and touches
    /// fresh pages each time. Only full images: an increment's puts mostly replace keys that
    /// already exist, so its count would reserve memory the state never uses. Nothing to do on
    /// the rocksdb backend, which restores into its store.
    pub fn reserve_for_full_image(&mut self, body: &[u8], key_groups: (u32, u32)) -> Result<(), FormatError> {
        if self.spill.is_some() {
            return Ok(());
        }
        let mut puts = 0;
        for entry in keyed_entries(body) {
            let entry = entry?;
            puts += usize::from(entry.value.is_some() && owns(key_groups, entry.key_group));
        }
        self.map.reserve_prefaulted(puts, None);
        Ok(())
    }

    /// Applies one restored state file body, keeping only key groups in `[start, end)`.
    /// Entries are decoded in batches whose lookups run back to back before the batch is
    /// applied (see [`Self::prefetch`]); within a file, entries apply in file order. A body
    /// of a megabyte or more is decoded on a second thread while this one applies. On the
    /// rocksdb backend the entries are collected, without decoding them, for a bulk load of the
    /// store when the chain is complete ([`Self::after_restore`]), over the table files of
    /// [`Self::restore_tables`] if any.
    pub fn restore_file(&mut self, body: &[u8], key_groups: (u32, u32)) -> Result<(), StoreError> {
        if let Some(spill) = &mut self.spill {
            let mut raw = Vec::with_capacity(32);
            if let Some(lazy) = spill.lazy_restore()? {
                // Newer than the increments ordered by key group before it: those go first.
                lazy.increments.route_increments_by_key_group(&lazy.ranges)?;
                // Routed to their ranges unsorted: the loaders sort them.
                for entry in keyed_entries(body) {
                    let entry = entry?;
                    if owns(key_groups, entry.key_group) {
                        raw.clear();
                        StateStore::encoded_key(entry.key_group, entry.key, &mut raw);
                        lazy.increments.add(lazy.ranges.range_of(&raw), &raw, entry.value)?;
                    }
                }
                return Ok(());
            }
            let restoring =
                spill.restoring.get_or_insert_with(|| bulk::BulkLoad::new(&spill.store.dir().join("restore")));
            for entry in keyed_entries(body) {
                let entry = entry?;
                if !owns(key_groups, entry.key_group) {
                    continue;
                }
                raw.clear();
                StateStore::encoded_key(entry.key_group, entry.key, &mut raw);
                restoring.add(&raw, entry.value)?;
            }
            return Ok(());
        }
        if body.len() < RESTORE_PIPELINE_MIN_BYTES {
            return decode_in_batches(body, key_groups, |batch| {
                self.apply_restored(batch);
                true
            });
        }
        // A large body is decoded on a second thread while this one applies the batches:
        // decoding is about half of a restore's CPU time, and the two halves overlap.
        std::thread::scope(|scope| {
            let (full_tx, full_rx) = crossbeam_channel::bounded::<Vec<Restored<K, V>>>(RESTORE_BATCHES_IN_FLIGHT);
            let (empty_tx, empty_rx) = crossbeam_channel::bounded::<Vec<Restored<K, V>>>(RESTORE_BATCHES_IN_FLIGHT);
            let decoder = std::thread::Builder::new()
                .name("restore-decode".into())
                .spawn_scoped(scope, move || {
                    decode_in_batches(body, key_groups, |batch| {
                        let next = empty_rx.try_recv().unwrap_or_else(|_| Vec::with_capacity(RESTORE_BATCH));
                        full_tx.send(std::mem::replace(batch, next)).is_ok()
                    })
                })
                .map_err(StoreError::RestoreThread)?;
            for mut batch in full_rx {
                self.apply_restored(&mut batch);
                let _ = empty_tx.try_send(batch);
            }
            decoder.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    }

    /// [`Self::restore_file`] of a file whose entries list its deletions, then each key's put
    /// once, from `puts_from` on ([`KeyedSnapshot::puts_from`]: the heap backend's increments,
    /// its full images and merged images, from 0). Either half's entries commute (a deletion
    /// repeated, or a set's key put again with the same value, leaves what one leaves), so
    /// each is applied on several threads at once, the deletions first. On the heap backend a
    /// half of [`RESTORE_CONCURRENT_MIN_BYTES`] or more is cut into a stretch per core
    /// ([`stretch_bounds`]), and a thread per stretch decodes its entries and inserts them,
    /// locking the shard of the map it inserts into ([`map::ShardedMap::fill_concurrently`]);
    /// a file lists its entries shard after shard, so a thread takes a lock per shard, not per
    /// entry.
    ///
    /// The pipeline of [`Self::restore_file`] spent about as much time handing entries from
    /// its decoding thread to its applying thread as either spent on them: each entry written
    /// into a batch, read back on the other core, and its key copied in pieces on the way to
    /// the map, where a load waited on the stores before it (`perf annotate`: three fifths of
    /// each thread's samples). One thread decoding and inserting each entry itself applied a
    /// 20M-key image as fast as the two of them did.
    pub fn restore_unordered(&mut self, body: &[u8], puts_from: u64, key_groups: (u32, u32)) -> Result<(), StoreError> {
        let Some(split) = usize::try_from(puts_from).ok().filter(|&at| at <= body.len()) else {
            return Err(StoreError::Decode(FormatError::Malformed(body.len())));
        };
        let (deletions, puts) = body.split_at(split);
        self.restore_commuting(deletions, key_groups)?;
        self.restore_commuting(puts, key_groups)
    }

    /// Applies entries whose order does not matter: a body of [`RESTORE_CONCURRENT_MIN_BYTES`]
    /// or more on a thread per core (see [`Self::restore_unordered`]); a smaller one, or on the
    /// rocksdb backend, as [`Self::restore_file`] does.
    /// [`Self::restore_unordered`] of one part of a file's entries (read in parts from a local
    /// file), `part_at` bytes into them: the parts in file order, each on several threads.
    pub fn restore_unordered_part(
        &mut self,
        part: &[u8],
        part_at: u64,
        puts_from: u64,
        key_groups: (u32, u32),
    ) -> Result<(), StoreError> {
        let split = puts_from.saturating_sub(part_at).min(part.len() as u64) as usize;
        let (deletions, puts) = part.split_at(split);
        self.restore_commuting(deletions, key_groups)?;
        self.restore_commuting(puts, key_groups)
    }

    fn restore_commuting(&mut self, body: &[u8], key_groups: (u32, u32)) -> Result<(), StoreError> {
        if self.spill.is_some() || body.len() < RESTORE_CONCURRENT_MIN_BYTES {
            return self.restore_file(body, key_groups);
        }
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        if cores < 2 {
            return self.restore_file(body, key_groups);
        }
        let stretches = stretch_bounds(body.len(), cores);
        self.map.fill_concurrently(|fill| {
            std::thread::scope(|scope| {
                let mut result = Ok(());
                let mut threads = Vec::with_capacity(stretches.len());
                for &stretch in &stretches[1..] {
                    let spawned = std::thread::Builder::new()
                        .name("restore-fill".into())
                        .spawn_scoped(scope, move || fill_from_entries::<K, V>(fill, body, stretch, key_groups));
                    match spawned {
                        Ok(thread) => threads.push(thread),
                        // No thread for it: this one takes the stretch too.
                        Err(_) => result = result.and(fill_from_entries::<K, V>(fill, body, stretch, key_groups)),
                    }
                }
                result = result.and(fill_from_entries::<K, V>(fill, body, stretches[0], key_groups));
                for thread in threads {
                    result = result.and(thread.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)));
                }
                result
            })
        })
    }

    fn apply_restored(&mut self, batch: &mut Vec<Restored<K, V>>) {
        let hashes: Vec<u64> = batch.iter().map(|(hash, ..)| *hash).collect();
        // As for a batch of records (see `Self::prefetch`): without the probes prefetched,
        // three quarters of this function's time was the lookups' first miss.
        self.map.prefetch_probes(&hashes);
        self.touch(batch.iter().map(|(hash, _, k, _)| (*hash, k)));
        for (hash, key_group, key, value) in batch.drain(..) {
            match value {
                Some(value) => {
                    self.map.insert_hashed(hash, key, V::Slot::restored(value, key_group));
                }
                None => {
                    self.map.remove_hashed(hash, &key);
                }
            }
        }
    }

    /// (rocksdb backend, restoring lazily: [`Self::restore_lazy_tables`]) Restores the next
    /// file of the chain, an increment ordered by key group, without reading it (from a local
    /// copy or from checkpoint storage): each range's loader reads the stretch of it that
    /// holds the range's key groups. Whether the state took it; when not, restore it with [`Self::restore_file`].
    pub fn restore_increment_by_key_group(&mut self, increment: bulk::IncrementByKeyGroup) -> Result<bool, StoreError> {
        let Some(spill) = &mut self.spill else { return Ok(false) };
        let Some(lazy) = spill.lazy_restore()? else { return Ok(false) };
        lazy.increments.add_by_key_group(increment);
        Ok(true)
    }

    /// (rocksdb backend) Restores a full image from its table files (a checkpoint's
    /// `store_tables`, verified local copies) instead of its entries: they are taken into the
    /// store whole by [`Self::after_restore`]. When the subtask that wrote them owned key
    /// groups (`source`) beyond this one's (`key_groups`), the others are deleted. Call before
    /// [`Self::restore_file`] applies the increments that follow the image. Whether the backend
    /// takes table files (the heap backend restores the image itself).
    pub fn restore_tables(
        &mut self,
        tables: &[std::path::PathBuf],
        source: (u32, u32),
        key_groups: (u32, u32),
    ) -> bool {
        let Some(spill) = &mut self.spill else { return false };
        spill.restoring_tables.extend(tables.iter().cloned());
        spill.keep_key_groups_of(source, key_groups);
        true
    }

    /// (rocksdb backend) Restores a full image from table files that are fetched after the job
    /// started (see [`lazy`]): the increments restored with [`Self::restore_file`] go over
    /// each table as it comes in, and reads wait for the table of their key. `source` and
    /// `key_groups` as for [`Self::restore_tables`]. Every source's tables come before the
    /// first restored file (whose entries are routed to the tables' ranges). Whether the
    /// backend takes table files.
    pub fn restore_lazy_tables(
        &mut self,
        tables: Arc<dyn lazy::TableSource>,
        source: (u32, u32),
        key_groups: (u32, u32),
    ) -> Result<bool, StoreError> {
        let Some(spill) = &mut self.spill else { return Ok(false) };
        if spill.lazy_restore.is_some() {
            return Err(StoreError::LazyRestore(format!(
                "{} were given after the restored files that go over them",
                tables.describe()
            )));
        }
        spill.restoring_lazily.push(tables);
        spill.keep_key_groups_of(source, key_groups);
        Ok(true)
    }

    /// After a restore: continue the restored incremental chain of `chain_len` files (same key
    /// groups) or start a new one with a full image. A continued chain keeps counting towards
    /// its next full image, so restarting in a loop cannot grow a chain without bound. On the
    /// rocksdb backend this loads the restored entries into the store: table files first, then
    /// the other entries over them.
    pub fn after_restore(&mut self, continue_chain: bool, chain_len: usize) -> Result<(), StoreError> {
        self.tracking_restarts();
        self.increments_since_full = if continue_chain { chain_len.saturating_sub(1) as u32 } else { 0 };
        self.force_full.store(!continue_chain, Ordering::Release);
        if let Some(spill) = &mut self.spill {
            spill.evicted_changes.clear();
            let tables = std::mem::take(&mut spill.restoring_tables);
            spill.lazy_restore()?;
            let lazily = spill.lazy_restore.take();
            let keep = spill.restoring_key_groups.take();
            let over_tables = !tables.is_empty();
            let started = std::time::Instant::now();
            if over_tables {
                spill.store.take_tables(&tables)?;
                if let Some(key_groups) = keep {
                    spill.store.keep_only_key_groups(key_groups)?;
                }
            }
            let tables_ms = started.elapsed().as_millis() as u64;
            if let Some(LazyRestore { source, ranges, mut increments }) = lazily {
                increments.finish()?;
                let tables = ranges.len();
                spill.store.load_lazily(source, ranges, increments, keep, LAZY_RESTORE_LOADERS)?;
                tracing::debug!(
                    tables,
                    tables_ms,
                    "restoring into the state store; the tables and increments come in behind the job"
                );
                return Ok(());
            }
            if let Some(restoring) = spill.restoring.take() {
                spill.store.bulk_load(restoring, over_tables)?;
            }
            tracing::debug!(
                tables = tables.len(),
                tables_ms,
                bulk_load_ms = started.elapsed().as_millis() as u64 - tables_ms,
                "restored into the state store"
            );
        }
        Ok(())
    }
}

/// Threads of a lazy restore that fetch and load table files at once, per subtask. A
/// download leaves its link idle between files and the server waiting; eight at a time took
/// a restore's downloads from the S3 server of the tests 4× faster than one at a time
/// (`crate::restore`).
const LAZY_RESTORE_LOADERS: usize = 8;

/// A restored entry, decoded: its key's hash in the map ([`map::hash_of`], computed on the
/// decoding thread, which has time to spare where the restoring thread has none), its key
/// group, key, and value (`None`: deleted).
type Restored<K, V> = (u64, u32, K, Option<V>);

/// Restored entries applied together, their lookups run back to back first.
const RESTORE_BATCH: usize = 256;

/// Below this many bytes a restored file body is decoded and applied on one thread.
const RESTORE_PIPELINE_MIN_BYTES: usize = 1 << 20;

/// Below this many bytes entries whose order does not matter (either half of a file that lists
/// its deletions, then each key's put once) are applied on one thread: about 20K entries, half a
/// millisecond of work, against a few tens of microseconds to start a thread.
const RESTORE_CONCURRENT_MIN_BYTES: usize = 256 << 10;

/// Decoded batches a restore's decoding thread may run ahead of the thread applying them.
const RESTORE_BATCHES_IN_FLIGHT: usize = 64;

/// Decodes a restored entry, or `None` when its key group is outside `key_groups`. Inlined
/// into the decoding loop, as the entry's reading is (see `keyed_entries`): the entry passed to
/// it through memory stalled the loop as its return had.
#[inline(always)]
fn decode_restored<K: StateKey, V: StateValue>(
    entry: weir_checkpoint::format::KeyedEntry<'_>,
    key_groups: (u32, u32),
) -> Result<Option<Restored<K, V>>, FormatError> {
    if !owns(key_groups, entry.key_group) {
        return Ok(None);
    }
    let key = K::decode(entry.key)?;
    let value = match entry.value {
        Some(raw) => Some(V::decode(&mut Decoder::new(raw))?),
        None => None,
    };
    Ok(Some((map::hash_of(&key), entry.key_group, key, value)))
}

/// Decodes the entries of `body` in `key_groups` into batches of [`RESTORE_BATCH`] and hands
/// each full batch, then the last one, to `take`, which leaves it empty or replaces it; `take`
/// returns false to stop early.
fn decode_in_batches<K: StateKey, V: StateValue>(
    body: &[u8],
    key_groups: (u32, u32),
    mut take: impl FnMut(&mut Vec<Restored<K, V>>) -> bool,
) -> Result<(), StoreError> {
    let mut batch = Vec::with_capacity(RESTORE_BATCH);
    let mut heaps = crate::malloc::HugePageHeaps::new();
    for entry in keyed_entries(body) {
        if let Some(decoded) = decode_restored::<K, V>(entry?, key_groups)? {
            batch.push(decoded);
            if batch.len() == RESTORE_BATCH {
                heaps.advise_current();
                if !take(&mut batch) {
                    return Ok(());
                }
            }
        }
    }
    take(&mut batch);
    Ok(())
}

/// Entries a restoring thread decodes ahead of the one it applies, their probes prefetched
/// ([`map::Filler::prefetch`]).
const FILL_AHEAD: usize = 16;

/// What reading past an entry without decoding it ([`keyed_entries_in`]) costs, as a share of
/// decoding and inserting it: measured on a 20M-key image, 39 ms to read past half of it
/// against 313 ms to apply that half.
const SKIP_COST: f64 = 0.125;

/// The stretches `[from, to)` of a body of `len` bytes that `threads` threads apply at once, in
/// order, so that they finish together: a thread reads past the entries before its stretch,
/// which costs [`SKIP_COST`], so the later a stretch starts the shorter it is (two threads:
/// 53% and 47%).
fn stretch_bounds(len: usize, threads: usize) -> Vec<(usize, usize)> {
    let threads = threads.max(1);
    // Each thread's cost, SKIP_COST * start + (end - start), the same `each` for all.
    let each = SKIP_COST / (1.0 - (1.0 - SKIP_COST).powi(threads as i32));
    let mut start = 0.0;
    let mut bounds = Vec::with_capacity(threads);
    for thread in 0..threads {
        let end = if thread + 1 == threads { 1.0 } else { each + (1.0 - SKIP_COST) * start };
        bounds.push(((start * len as f64) as usize, ((end * len as f64) as usize).min(len)));
        start = end;
    }
    if let Some(last) = bounds.last_mut() {
        last.1 = len;
    }
    bounds
}

/// Decodes the entries of `body` that start in `stretch` ([`keyed_entries_in`]), in
/// `key_groups`, and applies each to `fill` itself; an entry whose shard another thread holds is
/// applied after the rest (see [`KeyedState::restore_unordered`]: such a file lists each key
/// once, so the order of its entries does not matter).
///
/// Entries wait [`FILL_AHEAD`] places between their decoding (and the prefetch of their
/// place) and their change, as their key, value and key group: their slot is made where it
/// is applied. Queued as a slot, a count's (16 bytes, written in three pieces) was read back
/// by a wider load that waited for the pieces (`perf`: a quarter of the function's samples);
/// the 20M-key image applied in 205–215 ms this way against 250–270 (session 39).
fn fill_from_entries<K: StateKey, V: StateValue>(
    fill: &map::ConcurrentFill<'_, K, V::Slot>,
    body: &[u8],
    stretch: (usize, usize),
    key_groups: (u32, u32),
) -> Result<(), StoreError> {
    let mut filler = fill.filler();
    let mut later = Vec::new();
    let mut ahead = std::collections::VecDeque::with_capacity(FILL_AHEAD + 1);
    let mut entries = keyed_entries_in(body, stretch.0, stretch.1);
    let (mut heaps, mut decoded) = (crate::malloc::HugePageHeaps::new(), 0usize);
    loop {
        let next = entries.next();
        if let Some(entry) = next {
            let entry = entry?;
            if !owns(key_groups, entry.key_group) {
                continue;
            }
            decoded += 1;
            if decoded % RESTORE_BATCH == 0 {
                heaps.advise_current();
            }
            let value = match entry.value {
                Some(raw) => Some(V::decode(&mut Decoder::new(raw))?),
                None => None,
            };
            let key_group = entry.key_group;
            K::decode_then(entry.key, |key| {
                let hash = map::hash_of(&key);
                filler.prefetch(hash);
                ahead.push_back((hash, key, value, key_group));
            })?;
            if ahead.len() <= FILL_AHEAD {
                continue;
            }
        }
        let Some((hash, key, value, key_group)) = ahead.pop_front() else { break };
        let slot = value.map(|value| V::Slot::restored(value, key_group));
        if let Err(back) = filler.try_apply(hash, key, slot) {
            later.push(back);
        }
    }
    for (hash, key, slot) in later {
        filler.apply(hash, key, slot);
    }
    Ok(())
}

/// Whether `key_group` is in the range `[start, end)`.
fn owns(key_groups: (u32, u32), key_group: u32) -> bool {
    (key_groups.0..key_groups.1).contains(&key_group)
}

/// Puts `entries` (one shard's, in its order) into a full image; the bytes they took.
fn put_shard<'a, K: StateKey + 'a, V: StateValue + 'a, W: std::io::Write>(
    w: &mut StateFileStream<W>,
    entries: impl Iterator<Item = (&'a K, &'a V::Slot)>,
    max_parallelism: u32,
) -> std::io::Result<u64> {
    let from = w.entries_len();
    for (k, s) in entries {
        w.put_encoded(s.key_group_of(k, max_parallelism), |e| k.encode(e), |e| s.value().encode(e))?;
    }
    Ok(w.entries_len() - from)
}

/// The full image written to `w`, sealed: in memory, or in its local file (synced).
fn sealed_image(w: StateFileStream<SpillingBuffer>) -> Result<KeyedSnapshot, StoreError> {
    let entries = w.entries();
    let (out, len, crc32c) = w.finish().map_err(StoreError::SpillImage)?;
    let (data, file) = match out.file {
        Some((f, path)) => {
            // Deleted when dropped, also when the sync fails.
            let file = LocalStateFile { path, len };
            f.finish().map_err(StoreError::SpillImage)?;
            (bytes::Bytes::new(), Some(file))
        }
        None => (bytes::Bytes::from(out.memory), None),
    };
    Ok(written(FileKind::KeyedFull, data, file, crc32c, entries))
}

fn finish(kind: FileKind, w: StateFileWriter) -> KeyedSnapshot {
    let entries = w.entries();
    let (data, crc32c) = w.finish();
    written(kind, data, None, crc32c, entries)
}

/// A snapshot of a state file written, before the state says what else it knows of it.
fn written(
    kind: FileKind,
    data: bytes::Bytes,
    file: Option<LocalStateFile>,
    crc32c: u32,
    entries: u64,
) -> KeyedSnapshot {
    KeyedSnapshot {
        kind,
        data,
        file,
        crc32c,
        entries,
        live_entries: None,
        puts_from: None,
        shard_bytes: None,
        in_window_order: false,
        int_keys: false,
        table_slot_bytes: None,
    }
}

/// A state file written to local disk, deleted when dropped (once uploaded, or when its
/// checkpoint was abandoned).
#[derive(Debug)]
pub struct LocalStateFile {
    /// Where it is.
    pub path: std::path::PathBuf,
    /// Its length in bytes.
    pub len: u64,
}

impl Drop for LocalStateFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl KeyedSnapshot {
    /// The state file's length.
    pub fn len(&self) -> u64 {
        self.file.as_ref().map_or(self.data.len() as u64, |f| f.len)
    }

    /// Whether the file is empty (it never is: a state file has a header).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The state file's bytes, read from disk when it is there (tests).
    pub fn bytes(&self) -> bytes::Bytes {
        match &self.file {
            Some(f) => std::fs::read(&f.path).expect("the local state file is readable").into(),
            None => self.data.clone(),
        }
    }
}

/// An [`std::io::Write`] that keeps the bytes in memory up to a bound, then moves them to a file
/// (synced as it is written, by a thread of its own, so that the encoding and the disk's
/// writing overlap) and streams the rest there.
struct SpillingBuffer {
    memory: Vec<u8>,
    bound: usize,
    dir: std::path::PathBuf,
    file: Option<(WriterThread, std::path::PathBuf)>,
}

impl std::io::Write for SpillingBuffer {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        if self.file.is_none() && self.memory.len() + bytes.len() > self.bound {
            static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            std::fs::create_dir_all(&self.dir)?;
            // A heap job opens no state store, which would delete what killed processes left.
            crate::state::store::remove_stores_of_dead_processes(&self.dir);
            let path = self.dir.join(format!("full-image-{}-{n}", std::process::id()));
            let mut f = WriterThread::create(&path, "weir-image-writer")?;
            f.write_all(&std::mem::take(&mut self.memory))?;
            self.file = Some((f, path));
        }
        match &mut self.file {
            Some((f, _)) => f.write_all(bytes)?,
            None => self.memory.extend_from_slice(bytes),
        }
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match &mut self.file {
            Some((f, _)) => f.flush(),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
impl<V: StateValue, K: StateKey> KeyedState<V, K> {
    /// Every entry, cached or stored (tests).
    pub(crate) fn entries(&self) -> Vec<(K, V)> {
        let mut out = Vec::new();
        self.for_each(|k, v| out.push((k.clone(), v.clone()))).expect("the store scans");
        out
    }

    /// This state moved onto the rocksdb backend with a cache of `cache_entries` (tests). Full
    /// images over 64 bytes go to local files, so that tests take that path too.
    pub(crate) fn on_test_store(self, cache_entries: usize) -> Self {
        let store = StateStore::open(&std::env::temp_dir().join("weir-state-tests"), "test").expect("a store opens");
        let mut state = self.on_store(store, cache_entries);
        state.images.in_memory_max = 64;
        state
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::value::Value;
    use weir_checkpoint::format::open;

    fn key(i: i64) -> Key {
        Key::One(Value::Int(i))
    }

    /// A running aggregate's entry of one accumulator under a single-field key is one cache
    /// line, three quarters of one for a count or a sum, half of one for a count alone (its
    /// flags in the count's spare bits), a quarter under an integer key; a dedupe's, under a
    /// composite key, half of one.
    #[test]
    fn state_entries_are_a_cache_line_or_less() {
        use crate::operators::accumulators::{AccCount, AccList, AccOne};
        fn entry_bytes<K, V: StateValue>() -> usize {
            std::mem::size_of::<(K, V::Slot)>()
        }
        assert_eq!(entry_bytes::<Key, AccList>(), 64);
        assert_eq!(entry_bytes::<Key, AccOne>(), 48);
        assert_eq!(entry_bytes::<Key, AccCount>(), 32);
        assert_eq!(entry_bytes::<crate::value::IntKey, AccCount>(), 16);
        assert_eq!(entry_bytes::<crate::value::PackedKey, ()>(), 32);
    }

    /// A cache of 10K entries in front of the store, streamed through by 400K new keys with
    /// a few of them kept hot: the map stays near the size of the cache, whatever shards the
    /// evictions visit, and the hot keys stay cached.
    #[test]
    fn the_cache_map_stays_the_size_of_the_cache() {
        let cache = 10_000;
        let mut s = KeyedState::<i64>::new(16, true, 100).on_test_store(cache);
        for i in 0..400_000i64 {
            *s.update(key(i), || 0).unwrap() += 1;
            *s.update(key(-1 - i % 64), || 0).unwrap() += 1;
        }
        assert!(s.map.len() <= cache, "{} cached", s.map.len());
        let room = s.map.capacity();
        assert!(room <= 4 * cache, "room for {room} entries in a cache of {cache}");
        let hot = (0..64).filter(|i| s.map.get(&key(-1 - i)).is_some()).count();
        assert_eq!(hot, 64, "recently used keys get a second chance");
        assert_eq!(s.get(&key(123)).unwrap(), Some(&1));
    }

    /// On the rocksdb backend a key changed, evicted, read back and changed again between two
    /// checkpoints is listed as changed more than once: its increment still holds it once,
    /// with its newest value, and the chain restores to what the state holds.
    #[test]
    fn a_key_changed_again_after_its_eviction_is_in_the_increment_once() {
        let mut s = KeyedState::<i64>::new(16, true, 100).on_test_store(8);
        let full = s.snapshot_checkpoint().unwrap();
        let mut model = std::collections::BTreeMap::new();
        for round in 0..6i64 {
            for i in 0..40i64 {
                // Keys 0..4 in every round, the rest once each: the cache of 8 evicts them all.
                if i < 4 || i / 8 == round {
                    *s.update(key(i), || 0).unwrap() += i + 1;
                    *model.entry(i).or_insert(0) += i + 1;
                }
            }
        }
        let repeats = s.changed.len() - s.changed.iter().collect::<FxHashSet<_>>().len();
        assert!(repeats > 0, "the test repeats no key");
        let inc = s.snapshot_checkpoint().unwrap();
        let bytes = inc.bytes();
        let (kind, body) = open(&bytes).unwrap();
        assert_eq!(kind, FileKind::KeyedIncrement);
        let mut written = std::collections::BTreeMap::new();
        for entry in weir_checkpoint::format::keyed_entries(body) {
            let entry = entry.unwrap();
            *written.entry(entry.key.to_vec()).or_insert(0) += 1;
        }
        assert!(written.values().all(|&n| n == 1), "keys written more than once: {written:?}");
        assert_eq!(written.len(), model.len());
        let mut restored = restore_chain(&[full.bytes(), bytes], (0, 16));
        assert_eq!(restored.entries().len(), model.len());
        for (i, n) in model {
            assert_eq!(restored.get(&key(i)).unwrap(), Some(&n), "key {i}");
        }
    }

    /// A heap full image larger than the task may hold in memory (a forced one: the first
    /// after a restore from elsewhere, and a savepoint's) goes to a local file: the same bytes,
    /// checksum, shard starts and counts as the image in memory, a file deleted with the
    /// snapshot, changes tracked after it as after an image in memory, and a chain over it
    /// restores to the state. A killed process's image left in the directory is deleted.
    #[test]
    fn heap_full_images_over_their_budget_go_to_local_files_with_the_same_bytes() {
        let dir = tempfile::tempdir().unwrap();
        // Left by a killed process (pid 4294967295 is never one).
        let dead = dir.path().join("full-image-4294967295-0");
        std::fs::write(&dead, b"image").unwrap();
        let budget = |bytes| FullImageBudget { in_memory_max: bytes, dir: dir.path().to_path_buf() };
        let mut s = KeyedState::<i64>::new(16, true, 100);
        for i in 0..50_000i64 {
            *s.update(key(i), || 0).unwrap() += i;
        }
        let same = |a: &KeyedSnapshot, b: &KeyedSnapshot| {
            assert_eq!((a.kind, a.crc32c, a.entries, a.live_entries), (b.kind, b.crc32c, b.entries, b.live_entries));
            assert_eq!((a.puts_from, &a.shard_bytes), (b.puts_from, &b.shard_bytes));
            assert!(a.bytes() == b.bytes(), "the same bytes");
        };
        // The map's order (its shards, in order) is the same for each image of the same state.
        let in_memory = s.snapshot_full_copy().unwrap();
        assert!(in_memory.file.is_none(), "by default every image is in memory");
        s = s.with_full_image_budget(budget(4096));
        let savepoint = s.snapshot_full_copy().unwrap();
        let file = savepoint.file.as_ref().expect("a savepoint's image over the budget is on disk").path.clone();
        assert!(file.starts_with(dir.path()) && savepoint.data.is_empty());
        assert!(!dead.exists(), "a killed process's image is deleted");
        same(&in_memory, &savepoint);
        drop(savepoint);
        assert!(!file.exists(), "deleted with its snapshot");

        // The first checkpoint of a run is a forced full image.
        let image = s.snapshot_checkpoint().unwrap();
        assert!(image.file.is_some());
        assert_eq!(image.kind, FileKind::KeyedFull);
        let body_len = image.len() - 5 - 4;
        assert_eq!(
            image.shard_bytes.as_ref().map(|s| s.iter().sum::<u64>()),
            Some(body_len),
            "all but header and seal"
        );
        same(&in_memory, &image);
        // Its entries are clean: the next increment holds the changes since, and nothing more.
        for i in (0..50_000i64).step_by(10) {
            *s.update(key(i), || 0).unwrap() += 1;
        }
        let increment = s.snapshot_checkpoint().unwrap();
        assert_eq!((increment.kind, increment.entries), (FileKind::KeyedIncrement, 5_000));
        let mut restored = restore_chain(&[image.bytes(), increment.bytes()], (0, 16));
        assert_eq!(restored.entries().len(), 50_000);
        for i in 0..50_000i64 {
            assert_eq!(restored.get(&key(i)).unwrap(), Some(&(i + i64::from(i % 10 == 0))), "key {i}");
        }

        // Within the budget an image stays in memory.
        s.images.in_memory_max = u64::MAX;
        let unbounded = s.snapshot_full_copy().unwrap();
        s = s.with_full_image_budget(budget(1 << 30));
        let within = s.snapshot_full_copy().unwrap();
        assert!(within.file.is_none());
        same(&unbounded, &within);
        drop(image);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "no image left behind");
    }

    fn restore_chain(files: &[bytes::Bytes], range: (u32, u32)) -> KeyedState<i64> {
        let mut s = KeyedState::<i64>::new(16, true, 100);
        for f in files {
            match open(f).unwrap() {
                // The heap backend's images list each key once (`KeyedSnapshot::puts_from`).
                (FileKind::KeyedFull, body) => s.restore_unordered(body, 0, range).unwrap(),
                (_, body) => s.restore_file(body, range).unwrap(),
            }
        }
        s
    }

    /// A chain whose increments add keys (and remove some): each snapshot counts the keys the
    /// state holds then, and a restore that makes room for the newest count first applies the
    /// whole chain without growing its map (each doubling would move every entry again); the
    /// restored state is the state. The rocksdb backend does not count its keys.
    #[test]
    fn snapshots_count_their_keys_and_a_restore_that_reserves_them_never_grows() {
        let mut s = KeyedState::<i64>::new(16, true, 100);
        let mut model = std::collections::BTreeMap::new();
        let mut chain = Vec::new();
        let (mut newest, mut slot) = (None, None);
        for round in 0..6i64 {
            for i in round * 20_000..(round + 1) * 20_000 {
                *s.update(key(i), || 0).unwrap() += i;
                model.insert(i, i);
            }
            for i in (0..round * 20_000).step_by(7) {
                if s.remove(&key(i)).unwrap().is_some() {
                    model.remove(&i);
                }
            }
            let snapshot = s.snapshot_checkpoint().unwrap();
            assert_eq!(snapshot.live_entries, Some(model.len() as u64), "round {round}");
            newest = snapshot.live_entries;
            slot = snapshot.table_slot_bytes;
            chain.push(snapshot.bytes());
        }
        // The tables' memory, faulted in from the counts and the slot size alone (as a
        // restore does while it reads the files), is what the restore's tables take.
        let tables = map::restored_table_bytes(newest.unwrap(), u64::from(slot.unwrap()));
        assert!(tables > 0);
        let faulted = crate::malloc::PrefaultedTables::start(tables, 2).unwrap();
        let mut restored = KeyedState::<i64>::new(16, true, 100);
        restored.reserve_restored_entries(newest.unwrap(), Some(&faulted));
        assert_eq!(faulted.carved_bytes() as u64, tables, "every table carved, and all of it");
        let room = restored.map.capacity();
        assert!(room >= model.len(), "room for {room} entries, {} to restore", model.len());
        for f in &chain {
            restored.restore_file(open(f).unwrap().1, (0, 16)).unwrap();
        }
        assert_eq!(restored.map.capacity(), room, "the map grew while the chain was applied");
        assert_eq!(restored.entries().len(), model.len());
        for (i, n) in model {
            assert_eq!(restored.get(&key(i)).unwrap(), Some(&n), "key {i}");
        }
    }

    /// The stretches a body is cut into cover it once, in order, each thread's reading past the
    /// entries before its stretch and applying its own costing about the same.
    #[test]
    fn stretches_cover_the_body_and_even_out_each_threads_cost() {
        for threads in 1..=5usize {
            for len in [0usize, 1, 7, 1_000, 259_000_000] {
                let bounds = stretch_bounds(len, threads);
                assert_eq!(bounds.len(), threads);
                assert_eq!((bounds[0].0, bounds[threads - 1].1), (0, len), "{threads} threads, {len} bytes");
                assert!(bounds.windows(2).all(|w| w[0].1 == w[1].0), "{bounds:?}");
                assert!(bounds.iter().all(|(from, to)| from <= to), "{bounds:?}");
                if len >= 1_000 {
                    let costs: Vec<f64> =
                        bounds.iter().map(|&(from, to)| SKIP_COST * from as f64 + (to - from) as f64).collect();
                    let (least, most) = costs.iter().fold((f64::MAX, 0f64), |(l, m), &c| (l.min(c), m.max(c)));
                    assert!(most - least <= 2.0, "{threads} threads, {len} bytes: costs {costs:?}");
                }
            }
        }
        let two = stretch_bounds(1_000_000, 2);
        assert_eq!(two[0].1, 533_333, "the first of two stretches is 53%: {two:?}");
    }

    /// The rocksdb backend's full image lists a key twice when both its store and its cache
    /// hold it (the later entry, the cache's, wins): it does not say that it lists each key
    /// once, so a restore applies it in file order. The heap backend's images and increments
    /// say so.
    #[test]
    fn only_files_that_list_each_key_once_say_so() {
        let mut on_store = KeyedState::<i64>::new(16, true, 100).on_test_store(1_000);
        for i in 0..30_000i64 {
            *on_store.update(key(i), || 0).unwrap() += i;
        }
        let first = on_store.snapshot_checkpoint().unwrap();
        assert_eq!((first.kind, first.puts_from), (FileKind::KeyedFull, None));
        for i in 0..500i64 {
            *on_store.update(key(i), || 0).unwrap() += 1_000_000;
        }
        let image = on_store.snapshot_full_copy().unwrap();
        assert_eq!(image.puts_from, None);
        let bytes = image.bytes();
        let body = open(&bytes).unwrap().1;
        let mut listed = std::collections::BTreeMap::new();
        for entry in keyed_entries(body) {
            *listed.entry(entry.unwrap().key.to_vec()).or_insert(0) += 1;
        }
        assert!(listed.values().any(|&n| n > 1), "a key in both the store and the cache is listed twice");
        let mut restored = KeyedState::<i64>::new(16, true, 100);
        restored.restore_file(body, (0, 16)).unwrap();
        for i in [0i64, 7, 499] {
            assert_eq!(restored.get(&key(i)).unwrap(), Some(&(i + 1_000_000)), "key {i}: the cache's value");
        }

        let mut heap = KeyedState::<i64>::new(16, true, 100);
        for i in 0..1_000i64 {
            *heap.update(key(i), || 0).unwrap() += i;
        }
        assert_eq!(heap.snapshot_checkpoint().unwrap().puts_from, Some(0), "a full image");
        heap.remove(&key(3)).unwrap();
        *heap.update(key(4), || 0).unwrap() += 1;
        let increment = heap.snapshot_checkpoint().unwrap();
        assert_eq!(increment.kind, FileKind::KeyedIncrement);
        assert!(increment.puts_from.is_some_and(|at| at > 0), "after its deletion");
        assert_eq!(heap.snapshot_full_copy().unwrap().puts_from, Some(0), "a savepoint's image");
    }

    /// On the rocksdb backend a full image (a savepoint's, or a checkpoint's) counts its keys,
    /// and a heap restore that reserves that count never grows its map; an increment counts
    /// nothing.
    #[test]
    fn rocksdb_full_images_count_their_keys_for_a_heap_restore() {
        let mut on_store = KeyedState::<i64>::new(16, true, 100).on_test_store(1_000);
        let mut model = std::collections::BTreeMap::new();
        for i in 0..30_000i64 {
            *on_store.update(key(i), || 0).unwrap() += i;
            model.insert(i, i);
        }
        let first = on_store.snapshot_checkpoint().unwrap();
        assert_eq!(first.kind, FileKind::KeyedFull, "a chain starts with a full image");
        assert_eq!(first.live_entries, Some(model.len() as u64));
        *on_store.update(key(1), || 0).unwrap() += 5;
        *model.get_mut(&1).unwrap() += 5;
        for i in (0..30_000i64).step_by(11) {
            if on_store.remove(&key(i)).unwrap().is_some() {
                model.remove(&i);
            }
        }
        let increment = on_store.snapshot_checkpoint().unwrap();
        assert_eq!(increment.kind, FileKind::KeyedIncrement);
        assert_eq!(increment.live_entries, None);
        let savepoint = on_store.snapshot_full_copy().unwrap();
        let counted = savepoint.live_entries.unwrap();
        assert!(counted >= model.len() as u64, "{counted} counted, {} keys", model.len());
        assert!(counted <= model.len() as u64 + 1_000, "{counted} counted: more than the cache above the keys");

        let mut restored = KeyedState::<i64>::new(16, true, 100);
        restored.reserve_restored_entries(counted, None);
        let room = restored.map.capacity();
        restored.restore_file(open(&savepoint.bytes()).unwrap().1, (0, 16)).unwrap();
        assert_eq!(restored.map.capacity(), room, "the map grew while the savepoint was applied");
        assert_eq!(restored.entries().len(), model.len());
        for (i, n) in model {
            assert_eq!(restored.get(&key(i)).unwrap(), Some(&n), "key {i}");
        }
    }

    #[test]
    fn increments_hold_only_changes_and_chains_restore_exactly() {
        let mut s = KeyedState::<i64>::new(16, true, 100);
        for i in 0..100 {
            *s.update(key(i), || 0).unwrap() += i;
        }
        let full = s.snapshot_checkpoint().unwrap();
        assert_eq!(full.kind, FileKind::KeyedFull, "the first snapshot is full");
        assert_eq!(full.crc32c, crc32c::crc32c(&full.data[..full.data.len() - 4]), "the file's seal");
        *s.update(key(5), || 0).unwrap() += 1000;
        *s.update(key(500), || 0).unwrap() += 1;
        s.remove(&key(7)).unwrap();
        let inc = s.snapshot_checkpoint().unwrap();
        assert_eq!(inc.kind, FileKind::KeyedIncrement);
        assert_eq!(inc.entries, 3, "two puts and a deletion");
        let files = vec![full.data, inc.data];
        let mut r = restore_chain(&files, (0, 16));
        assert_eq!(r.entries().len(), 100);
        assert_eq!(r.get(&key(5)).unwrap(), Some(&1005));
        assert_eq!(r.get(&key(7)).unwrap(), None);
        assert_eq!(r.get(&key(500)).unwrap(), Some(&1));
    }

    /// Bodies above [`RESTORE_PIPELINE_MIN_BYTES`] are decoded on a second thread: the
    /// restored state is the same, deletions and key-group filtering included, and a corrupt
    /// body fails the restore instead of ending it early.
    #[test]
    fn large_bodies_restore_through_the_decoding_thread_exactly() {
        let mut s = KeyedState::<i64>::new(16, true, 100);
        let keys = 300_000i64;
        for i in 0..keys {
            *s.update(key(i), || 0).unwrap() += i * 3;
        }
        let full = s.snapshot_checkpoint().unwrap();
        for i in (0..keys).step_by(3) {
            *s.update(key(i), || 0).unwrap() += 1;
        }
        for i in (1..keys).step_by(7) {
            s.remove(&key(i)).unwrap();
        }
        let inc = s.snapshot_checkpoint().unwrap();
        assert!(open(&full.data).unwrap().1.len() > RESTORE_PIPELINE_MIN_BYTES, "the full image takes the pipeline");
        let files = vec![full.data.clone(), inc.data];
        for range in [(0, 16), (3, 11)] {
            let mut r = restore_chain(&files, range);
            let mut expected = 0;
            for i in 0..keys {
                let owned = owns(range, key(i).key_group(16));
                let want = (owned && i % 7 != 1).then_some(i * 3 + i64::from(i % 3 == 0));
                expected += usize::from(want.is_some());
                assert_eq!(r.get(&key(i)).unwrap().copied(), want, "key {i}, key groups {range:?}");
            }
            assert_eq!(r.entries().len(), expected);
        }
        // The body without the file's checksum check (which would catch this first).
        let mut body = open(&full.data).unwrap().1.to_vec();
        let middle = body.len() / 2;
        body[middle..middle + 64].fill(0xff);
        let mut r = KeyedState::<i64>::new(16, true, 100);
        assert!(r.restore_file(&body, (0, 16)).is_err(), "a corrupt entry fails the restore");
        for at in [body.len() / 10, middle, body.len() - 100] {
            let mut body = open(&full.data).unwrap().1.to_vec();
            body[at..at + 64].fill(0xff);
            let mut r = KeyedState::<i64>::new(16, true, 100);
            assert!(r.restore_unordered(&body, 0, (0, 16)).is_err(), "a corrupt entry at {at} fails the restore");
        }
    }

    /// An increment of the heap backend lists its deletions, then each key's put once: applied
    /// as those two halves, each on a thread per core, it restores what applying its entries
    /// in order restores, keys removed and inserted again included, for a map of counts and
    /// for a set of keys (whose keys inserted again are put again).
    #[test]
    fn increments_applied_in_halves_by_several_threads_restore_what_one_thread_restores() {
        let mut s = KeyedState::<i64>::new(16, true, 100);
        for i in 0..400_000i64 {
            *s.update(key(i), || 0).unwrap() += i;
        }
        let full = s.snapshot_checkpoint().unwrap();
        for i in 0..300_000i64 {
            s.remove(&key(i)).unwrap();
        }
        for i in (0..300_000i64).step_by(3) {
            *s.update(key(i), || 0).unwrap() += 7;
        }
        for i in (300_000..500_000i64).step_by(2) {
            *s.update(key(i), || 0).unwrap() += 1;
        }
        let inc = s.snapshot_checkpoint().unwrap();
        let puts_from = inc.puts_from.expect("a heap increment says where its puts start") as usize;
        let (kind, body) = open(&inc.data).unwrap();
        assert_eq!(kind, FileKind::KeyedIncrement);
        assert!(puts_from >= RESTORE_CONCURRENT_MIN_BYTES, "deletions: {puts_from} bytes");
        assert!(body.len() - puts_from >= RESTORE_CONCURRENT_MIN_BYTES, "puts: {} bytes", body.len() - puts_from);
        assert!(keyed_entries(&body[..puts_from]).all(|e| e.unwrap().value.is_none()), "deletions first");
        assert!(keyed_entries(&body[puts_from..]).all(|e| e.unwrap().value.is_some()), "then puts");
        let sorted = |s: &KeyedState<i64>| {
            let mut all: Vec<(String, i64)> = s.entries().into_iter().map(|(k, v)| (format!("{k:?}"), v)).collect();
            all.sort_unstable();
            all
        };
        let (_, image) = open(&full.data).unwrap();
        for range in [(0, 16), (2, 9)] {
            let mut in_order = KeyedState::<i64>::new(16, true, 100);
            in_order.restore_unordered(image, 0, range).unwrap();
            in_order.restore_file(body, range).unwrap();
            let mut halves = KeyedState::<i64>::new(16, true, 100);
            halves.restore_unordered(image, 0, range).unwrap();
            halves.restore_unordered(body, puts_from as u64, range).unwrap();
            let (halves_all, in_order_all) = (sorted(&halves), sorted(&in_order));
            let differ = halves_all.iter().zip(&in_order_all).position(|(a, b)| a != b);
            assert!(halves_all == in_order_all, "key groups {range:?}: first difference at {differ:?}");
            let expected = (0..500_000i64)
                .filter(|&i| owns(range, key(i).key_group(16)))
                .filter(|&i| match i {
                    ..300_000 => i % 3 == 0,
                    300_000..400_000 => true,
                    _ => i % 2 == 0,
                })
                .count();
            assert_eq!((halves.map.len(), halves.entries().len()), (expected, expected), "key groups {range:?}");
            assert_eq!(halves.get(&key(3)).unwrap().copied(), owns(range, key(3).key_group(16)).then_some(7));
            // Read in parts (a local file's), one straddling where the puts start: the same.
            for part_bytes in [300_000, 1 << 20] {
                let mut parts = KeyedState::<i64>::new(16, true, 100);
                parts.restore_unordered(image, 0, range).unwrap();
                let (mut part_at, mut straddled) = (0u64, false);
                let read = weir_checkpoint::format::read_entry_parts(body, body.len() as u64, part_bytes, |part| {
                    let end = part_at + part.len() as u64;
                    straddled |= part_at < puts_from as u64 && end > puts_from as u64;
                    let applied = parts.restore_unordered_part(part, part_at, puts_from as u64, range);
                    part_at = end;
                    applied
                });
                assert!(read.is_ok(), "{part_bytes}-byte parts");
                assert!(straddled, "{part_bytes}-byte parts: one holds deletions and puts");
                assert!(sorted(&parts) == in_order_all, "key groups {range:?}, {part_bytes}-byte parts");
            }
        }
        let mut r = KeyedState::<i64>::new(16, true, 100);
        assert!(r.restore_unordered(body, body.len() as u64 + 1, (0, 16)).is_err(), "puts past the end");

        // A set of keys: a key removed and inserted again, or inserted twice, is put again.
        let mut set = KeyedState::<()>::new(16, true, 100);
        for i in 0..200_000i64 {
            set.insert_new(key(i), ()).unwrap();
        }
        let full = set.snapshot_checkpoint().unwrap();
        for i in (0..200_000i64).step_by(2) {
            set.remove(&key(i)).unwrap();
        }
        for i in (0..200_000i64).step_by(4).chain(200_000..400_000).chain((0..200_000).step_by(4)) {
            set.remove(&key(i)).unwrap();
            set.insert_new(key(i), ()).unwrap();
        }
        let inc = set.snapshot_checkpoint().unwrap();
        let restored = |halves: bool| {
            let mut r = KeyedState::<()>::new(16, true, 100);
            r.restore_unordered(open(&full.data).unwrap().1, 0, (0, 16)).unwrap();
            let body = open(&inc.data).unwrap().1;
            match halves {
                true => r.restore_unordered(body, inc.puts_from.unwrap(), (0, 16)).unwrap(),
                false => r.restore_file(body, (0, 16)).unwrap(),
            }
            let mut keys: Vec<String> = r.entries().into_iter().map(|(k, ())| format!("{k:?}")).collect();
            keys.sort_unstable();
            (r.map.len(), keys)
        };
        let (len, keys) = restored(true);
        assert_eq!((len, keys.len()), (350_000, 350_000));
        assert!(keys == restored(false).1, "the same keys as applied in order");
    }

    /// A full image of [`RESTORE_CONCURRENT_MIN_BYTES`] or more is applied by a thread per core, each its stretch of
    /// the entries: the restored state is what one thread applying them in order leaves, for
    /// keys of one integer (built where the map takes them) and of other values alike.
    #[test]
    fn full_images_applied_by_several_threads_restore_what_one_thread_restores() {
        let keys: [fn(i64) -> Key; 2] = [key, |i| Key::One(Value::Str(format!("word-{i}").into()))];
        for key in keys {
            let mut s = KeyedState::<i64>::new(16, true, 100);
            for i in 0..150_000i64 {
                *s.update(key(i), || 0).unwrap() += i * 5;
            }
            let full = s.snapshot_checkpoint().unwrap();
            let (kind, body) = open(&full.data).unwrap();
            assert_eq!(kind, FileKind::KeyedFull);
            assert!(body.len() >= RESTORE_CONCURRENT_MIN_BYTES, "{} bytes: one thread would apply it", body.len());
            for range in [(0, 16), (5, 12)] {
                let mut one = KeyedState::<i64>::new(16, true, 100);
                one.restore_file(body, range).unwrap();
                let mut several = KeyedState::<i64>::new(16, true, 100);
                several.restore_unordered(body, 0, range).unwrap();
                let sorted = |s: &KeyedState<i64>| {
                    let mut all: Vec<(String, i64)> =
                        s.entries().into_iter().map(|(k, v)| (format!("{k:?}"), v)).collect();
                    all.sort_unstable();
                    all
                };
                let (several_all, one_all) = (sorted(&several), sorted(&one));
                let differ = several_all.iter().zip(&one_all).position(|(a, b)| a != b);
                assert!(several_all == one_all, "key groups {range:?}: first difference at {differ:?}");
                let owned = (0..150_000).filter(|&i| owns(range, key(i).key_group(16))).count();
                assert_eq!((several.map.len(), several.entries().len()), (owned, owned), "key groups {range:?}");
                let last = owns(range, key(149_999).key_group(16)).then_some(149_999 * 5);
                assert_eq!(several.get(&key(149_999)).unwrap().copied(), last);
            }
        }
    }

    #[test]
    fn savepoint_copies_do_not_disturb_change_tracking() {
        let mut s = KeyedState::<i64>::new(16, true, 100);
        s.update(key(1), || 1).unwrap();
        let _ = s.snapshot_checkpoint().unwrap();
        s.update(key(2), || 2).unwrap();
        let sp = s.snapshot_full_copy().unwrap();
        assert_eq!(sp.entries, 2);
        let inc = s.snapshot_checkpoint().unwrap();
        assert_eq!(inc.entries, 1, "key 2 changed since the last checkpoint");
    }

    #[test]
    fn full_image_every_n_and_after_a_failed_upload() {
        let mut s = KeyedState::<i64>::new(16, true, 3);
        s.update(key(1), || 1).unwrap();
        assert_eq!(s.snapshot_checkpoint().unwrap().kind, FileKind::KeyedFull);
        assert_eq!(s.snapshot_checkpoint().unwrap().kind, FileKind::KeyedIncrement);
        assert_eq!(s.snapshot_checkpoint().unwrap().kind, FileKind::KeyedIncrement);
        assert_eq!(s.snapshot_checkpoint().unwrap().kind, FileKind::KeyedFull, "every third checkpoint is full");
        s.force_full_flag().store(true, Ordering::Release);
        assert_eq!(s.snapshot_checkpoint().unwrap().kind, FileKind::KeyedFull);
    }

    /// Above the size where full images are merged in the background, the task writes only
    /// increments, except the forced full images (the first of a run, after a failed upload);
    /// at or below it, the periodic ones too.
    #[test]
    fn large_states_leave_periodic_full_images_to_the_background_merge() {
        let kinds = |above: u64| {
            let mut s = KeyedState::<i64>::new(16, true, 2).with_background_full_image_above(above);
            s.update(key(1), || 1).unwrap();
            s.update(key(2), || 1).unwrap();
            let mut kinds: Vec<FileKind> = (0..4).map(|_| s.snapshot_checkpoint().unwrap().kind).collect();
            s.force_full_flag().store(true, Ordering::Release);
            kinds.push(s.snapshot_checkpoint().unwrap().kind);
            kinds
        };
        use FileKind::{KeyedFull as F, KeyedIncrement as I};
        assert_eq!(kinds(1), vec![F, I, I, I, F], "2 entries are above 1");
        assert_eq!(kinds(2), vec![F, I, F, I, F], "2 entries are not above 2: every 2nd is full");
    }

    /// A value of `len` bytes that do not compress (tests of stored sizes).
    #[cfg(feature = "rocksdb")]
    #[derive(Clone, Debug, PartialEq)]
    struct Blob(Vec<u8>);

    #[cfg(feature = "rocksdb")]
    impl StateValue for Blob {
        type Slot = super::Slot<Self>;

        fn encode(&self, e: &mut Encoder) {
            e.bytes(&self.0)
        }
        fn decode(d: &mut Decoder<'_>) -> Result<Self, FormatError> {
            Ok(Blob(d.bytes()?.to_vec()))
        }
    }

    /// On the rocksdb backend a full image reads every stored byte back: a few hundred large
    /// entries cost the task more than thousands of small ones, so their periodic full images
    /// go to the background merge while the small ones' stay on the task.
    #[cfg(feature = "rocksdb")]
    #[test]
    fn stored_bytes_count_toward_leaving_full_images_to_the_background() {
        fn kinds<V: StateValue + Clone>(mut value: impl FnMut(i64) -> V) -> Vec<FileKind> {
            let mut s = KeyedState::<V>::new(16, true, 2).with_background_full_image_above(1_000).on_test_store(10);
            for k in 0..300 {
                s.update(key(k), || value(k)).unwrap();
            }
            let mut kinds = vec![s.snapshot_checkpoint().unwrap().kind];
            s.spill.as_ref().unwrap().store.flush();
            kinds.extend((0..3).map(|_| s.snapshot_checkpoint().unwrap().kind));
            kinds
        }
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut noise = move |len: usize| {
            (0..len)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u8
                })
                .collect::<Vec<u8>>()
        };
        use FileKind::{KeyedFull as F, KeyedIncrement as I};
        assert_eq!(kinds(|k| k), vec![F, I, F, I], "300 small entries: the task writes every 2nd image");
        assert_eq!(
            kinds(|_| Blob(noise(1_000))),
            vec![F, I, I, I],
            "300 KB stored count as about 21,000 entries, above 1,000"
        );
    }

    #[test]
    fn restore_filters_key_groups() {
        let mut s = KeyedState::<i64>::new(16, true, 100);
        for i in 0..1000 {
            s.update(key(i), || i).unwrap();
        }
        let file = s.snapshot_checkpoint().unwrap().data;
        let a = restore_chain(std::slice::from_ref(&file), (0, 8));
        let b = restore_chain(std::slice::from_ref(&file), (8, 16));
        assert_eq!(a.entries().len() + b.entries().len(), 1000);
        assert!(a.entries().iter().all(|(k, _)| k.key_group(16) < 8));
    }
}

#[cfg(test)]
mod scan_tests {
    use super::*;
    use crate::value::Value;

    #[test]
    fn mostly_changed_state_is_scanned_and_gives_the_same_increment() {
        let mut s = KeyedState::<()>::new(8, true, 100);
        for i in 0..100 {
            s.update(Key::One(Value::Int(i)), || ()).unwrap();
        }
        let _ = s.snapshot_checkpoint().unwrap();
        for i in 0..90 {
            s.update(Key::One(Value::Int(i)), || ()).unwrap();
        }
        s.update(Key::One(Value::Int(5)), || ()).unwrap();
        let inc = s.snapshot_checkpoint().unwrap();
        assert_eq!(inc.entries, 90, "each changed key once, found by scanning");
        assert_eq!(s.snapshot_checkpoint().unwrap().entries, 0, "flags were cleared");
    }
}

/// Keyed state against a plain map: random puts, updates and removals (keys removed and
/// inserted again between two snapshots included), interleaved with incremental and full
/// checkpoints, savepoint copies and restores, at the same parallelism (the chain continues)
/// and at another one (the key groups are split), must always hold what the model holds.
#[cfg(test)]
mod model_tests {
    use std::collections::{BTreeMap, BTreeSet};

    use proptest::prelude::*;
    use weir_checkpoint::format::open;

    use super::*;
    use crate::value::{key_group_range, Value};

    impl StateValue for i64 {
        type Slot = super::Slot<Self>;

        fn encode(&self, e: &mut Encoder) {
            e.svarint(*self)
        }
        fn decode(d: &mut Decoder<'_>) -> Result<Self, FormatError> {
            d.svarint()
        }
    }

    /// A value of the model: an integer, held as the state holds it.
    trait ModelValue: StateValue + std::fmt::Debug {
        fn of(n: i64) -> Self;
        fn get(&self) -> i64;
        fn add(&mut self, n: i64);
    }

    impl ModelValue for i64 {
        fn of(n: i64) -> Self {
            n
        }
        fn get(&self) -> i64 {
            *self
        }
        fn add(&mut self, n: i64) {
            *self += n;
        }
    }

    /// An integer that lends its top three bits to its entry's flags ([`slot::FlagsInside`]),
    /// as the keyed count's does: the model's properties hold for either kind of slot. The
    /// integer is the low 61 bits, two's complement; it encodes as an `i64` does, so either
    /// restores the other's files.
    #[derive(Clone, Debug)]
    struct Lent(i64);

    const LENT_BITS: i64 = (1 << 61) - 1;

    impl ModelValue for Lent {
        fn of(n: i64) -> Self {
            Lent(n & LENT_BITS)
        }
        fn get(&self) -> i64 {
            (self.0 << 3) >> 3
        }
        fn add(&mut self, n: i64) {
            self.0 = ((self.get() + n) & LENT_BITS) | (self.0 & !LENT_BITS);
        }
    }

    impl slot::SpareBits for Lent {
        fn spare_bits(&self) -> u8 {
            ((self.0 as u64) >> 61) as u8
        }
        fn set_spare_bits(&mut self, bits: u8) {
            self.0 = (self.0 & LENT_BITS) | ((u64::from(bits & 7) << 61) as i64);
        }
    }

    impl StateValue for Lent {
        type Slot = slot::FlagsInside<Self>;

        fn encode(&self, e: &mut Encoder) {
            e.svarint(self.get())
        }
        fn decode(d: &mut Decoder<'_>) -> Result<Self, FormatError> {
            Ok(Lent::of(d.svarint()?))
        }
    }

    const MAX_PARALLELISM: u32 = 16;

    #[derive(Clone, Debug)]
    enum Op {
        Add(i64, i64),
        /// Insert unless present, as dedupe does.
        InsertNew(i64, i64),
        Remove(i64),
        /// Prepare a batch of keys as an operator does before updating them.
        Prefetch(Vec<i64>),
        Checkpoint,
        Savepoint,
        /// Crash and restore from the last checkpoint at this parallelism (1..=3).
        Restore(u32),
        /// Restore from the last savepoint at this parallelism.
        RestoreSavepoint(u32),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            8 => (0i64..40, -5i64..5).prop_map(|(k, v)| Op::Add(k, v)),
            3 => (0i64..40, -5i64..5).prop_map(|(k, v)| Op::InsertNew(k, v)),
            4 => (0i64..40).prop_map(Op::Remove),
            3 => proptest::collection::vec(0i64..40, 1..6).prop_map(Op::Prefetch),
            3 => Just(Op::Checkpoint),
            1 => Just(Op::Savepoint),
            1 => (1u32..=3).prop_map(Op::Restore),
            1 => (1u32..=3).prop_map(Op::RestoreSavepoint),
        ]
    }

    fn key(i: i64) -> Key {
        Key::One(Value::Int(i))
    }

    /// The entries of state keyed by single integers, as a map.
    fn int_contents(state: &KeyedState<i64>) -> BTreeMap<i64, i64> {
        state
            .entries()
            .into_iter()
            .map(|(k, v)| match k {
                Key::One(Value::Int(i)) => (i, v),
                k => panic!("{k:?}"),
            })
            .collect()
    }

    /// The subtasks of one operator: each with its key groups and its current chain.
    struct Subtasks<V: ModelValue = i64> {
        parts: Vec<(KeyedState<V>, KeyGroups, Chain)>,
    }

    /// Heap state, or rocksdb state with a cache of this many entries.
    type Backend = Option<usize>;

    fn empty(full_every: u32, backend: Backend) -> KeyedState<i64> {
        empty_of(full_every, backend)
    }

    fn empty_of<V: ModelValue>(full_every: u32, backend: Backend) -> KeyedState<V> {
        let state = KeyedState::new(MAX_PARALLELISM, true, full_every);
        match backend {
            None => state,
            Some(cache) => state.on_test_store(cache),
        }
    }

    /// A subtask's key-group range.
    type KeyGroups = (u32, u32);
    /// The snapshot files a restore reads, full snapshot first.
    type Chain = Vec<Bytes>;
    /// Each subtask's key groups and chain, as one snapshot of the operator.
    type Snapshot = Vec<(KeyGroups, Chain)>;

    use bytes::Bytes;

    impl<V: ModelValue> Subtasks<V> {
        fn new(parallelism: u32, full_every: u32, backend: Backend) -> Self {
            let parts = (0..parallelism)
                .map(|s| (empty_of(full_every, backend), key_group_range(s, MAX_PARALLELISM, parallelism), Vec::new()))
                .collect();
            Subtasks { parts }
        }

        fn owner(&mut self, k: &Key) -> &mut KeyedState<V> {
            let kg = k.key_group(MAX_PARALLELISM);
            &mut self
                .parts
                .iter_mut()
                .find(|(_, r, _)| kg >= r.0 && kg < r.1)
                .expect("a subtask owns every key group")
                .0
        }

        fn contents(&self) -> BTreeMap<i64, i64> {
            let mut out = BTreeMap::new();
            for (s, _, _) in &self.parts {
                for (k, v) in s.entries() {
                    let Key::One(Value::Int(i)) = k else { panic!("{k:?}") };
                    assert!(out.insert(i, v.get()).is_none(), "key {i} in two subtasks");
                }
            }
            out
        }

        /// A checkpoint: every subtask's chain as the uploader keeps it.
        fn checkpoint(&mut self) -> Snapshot {
            for (s, _, chain) in &mut self.parts {
                let snap = s.snapshot_checkpoint().unwrap();
                if snap.kind == FileKind::KeyedFull {
                    chain.clear();
                }
                chain.push(snap.bytes());
            }
            self.parts.iter().map(|(_, r, c)| (*r, c.clone())).collect()
        }

        fn savepoint(&self) -> Snapshot {
            self.parts.iter().map(|(s, r, _)| (*r, vec![s.snapshot_full_copy().unwrap().bytes()])).collect()
        }

        /// Restores `snapshot` at `parallelism`, as the engine does: a subtask whose key groups
        /// are unchanged continues the chain of a checkpoint, any other starts a new one.
        fn restore(
            snapshot: &[((u32, u32), Chain)],
            parallelism: u32,
            full_every: u32,
            from_checkpoint: bool,
            backend: Backend,
        ) -> Self {
            let mut parts = Vec::new();
            for s in 0..parallelism {
                let range = key_group_range(s, MAX_PARALLELISM, parallelism);
                let overlapping: Vec<_> = snapshot.iter().filter(|(r, _)| r.0 < range.1 && range.0 < r.1).collect();
                let same = overlapping.len() == 1 && overlapping[0].0 == range;
                let mut state = empty_of(full_every, backend);
                let mut files = Vec::new();
                // A rocksdb backend with an even cache size takes a chain's full image as table
                // files (as a checkpoint's merged image offers them), the others its entries.
                let tables_dir = tempfile::tempdir().unwrap();
                // As the engine does: every source's tables first, then the files.
                #[cfg_attr(not(feature = "rocksdb"), allow(unused_mut))]
                let mut image_as_tables = Vec::new();
                for (source, chain) in &overlapping {
                    let as_tables = backend.is_some_and(|c| c % 2 == 0);
                    let image = chain.first().filter(|f| open(f).unwrap().0 == FileKind::KeyedFull);
                    #[cfg(feature = "rocksdb")]
                    if let (true, Some(f)) = (as_tables, image) {
                        let dir = tables_dir.path().join(format!("{}", source.0));
                        // A cache of 2 takes them lazily (several small tables, the second
                        // damaged), one of 4 before the first record.
                        if backend == Some(2) {
                            let tables = Arc::new(TestTables::of(f, 3, Some(1)));
                            assert!(state.restore_lazy_tables(tables, *source, range).unwrap());
                        } else {
                            assert!(state.restore_tables(&tables_of(f, &dir), *source, range));
                        }
                        image_as_tables.push(*source);
                    }
                    let _ = (as_tables, image, source, &tables_dir);
                }
                // Increments ordered by key group stay in local files for the loaders (most of
                // them: the others are read, after the ones before them).
                #[cfg(feature = "rocksdb")]
                let increments_dir = Arc::new(tempfile::tempdir().unwrap());
                for (source, chain) in &overlapping {
                    for (i, f) in chain.iter().enumerate() {
                        files.push(f.clone());
                        if i == 0 && image_as_tables.contains(source) {
                            continue;
                        }
                        #[cfg(feature = "rocksdb")]
                        if backend == Some(2) && i % 3 != 2 {
                            let index = weir_checkpoint::format::read_increment_index(&f[..], f.len() as u64).unwrap();
                            if let Some(index) = index {
                                let path = increments_dir.path().join(format!("{}-{i}", source.0));
                                std::fs::write(&path, f).unwrap();
                                let keep = Box::new(increments_dir.clone());
                                let increment = bulk::IncrementByKeyGroup {
                                    file: bulk::IncrementFile::Local(path),
                                    index,
                                    key_groups: range,
                                    keep,
                                };
                                if state.restore_increment_by_key_group(increment).unwrap() {
                                    continue;
                                }
                            }
                        }
                        if backend.is_none() {
                            let (_, body) = open(f).expect("a file written by a snapshot verifies");
                            state.restore_file(body, range).unwrap();
                        } else {
                            // As from a local copy: in parts of a few entries, in file order.
                            weir_checkpoint::format::read_keyed_parts(&f[..], f.len() as u64, 24, |body| {
                                state.restore_file(body, range)
                            })
                            .unwrap();
                        }
                    }
                }
                let continue_chain = same && from_checkpoint;
                state.after_restore(continue_chain, files.len()).unwrap();
                parts.push((state, range, if continue_chain { files } else { Vec::new() }));
            }
            Subtasks { parts }
        }
    }

    /// State keeps no more than about twice its entries in change lists: beyond that nothing
    /// is tracked, and the next snapshot is a full image that restores exactly; then tracking
    /// starts again. Without incremental checkpoints (a job without checkpoints) nothing is
    /// ever tracked: the rocksdb backend's list grew by every update of an evicted key, forever.
    #[test]
    fn changes_beyond_twice_the_entries_stop_being_tracked_until_a_full_image() {
        // (incremental, backend): the rocksdb backend's entry count is RocksDB's estimate,
        // which counts every write since the last flush, so only the heap's is exact enough to
        // cross twice the entries here.
        #[cfg(feature = "rocksdb")]
        let cases = [(true, None), (false, None), (false, Some(10))];
        #[cfg(not(feature = "rocksdb"))]
        let cases = [(true, None), (false, None)];
        for (incremental, backend) in cases {
            let backend_name = format!("incremental {incremental}, backend {backend:?}");
            let state = KeyedState::new(MAX_PARALLELISM, incremental, 1000);
            let mut state = match backend {
                None => state,
                Some(cache) => state.on_test_store(cache),
            };
            let mut model = BTreeMap::new();
            assert_eq!(state.snapshot_checkpoint().unwrap().kind, FileKind::KeyedFull);
            for round in 0..40i64 {
                for k in 0..100 {
                    *state.update(key(k), || 0).unwrap() += round;
                    *model.entry(k).or_insert(0) += round;
                }
                // Removals: every one is listed while tracked.
                for k in (round..100).step_by(7) {
                    state.remove(&key(k)).unwrap();
                    model.remove(&k);
                }
                let tracked = state.changed.len() + state.deleted.len();
                let bound = if incremental { 2 * TRACKED_CHANGES_CHECK.max(100) + 150 } else { 0 };
                assert!(tracked <= bound, "{backend_name}: {tracked} tracked");
            }
            assert!(state.untracked, "{backend_name}: 40 rounds changed every key");
            let image = state.snapshot_checkpoint().unwrap();
            assert_eq!(image.kind, FileKind::KeyedFull, "{backend_name}");
            assert_eq!(state.untracked, !incremental);
            *state.update(key(1), || 0).unwrap() += 1;
            *model.entry(1).or_insert(0) += 1;
            let next = state.snapshot_checkpoint().unwrap();
            let expected = if incremental { FileKind::KeyedIncrement } else { FileKind::KeyedFull };
            assert_eq!(next.kind, expected, "{backend_name}: tracked again when incremental");
            let mut restored = empty(1000, None);
            for file in [image.bytes(), next.bytes()] {
                restored.restore_file(open(&file).unwrap().1, (0, MAX_PARALLELISM)).unwrap();
            }
            restored.after_restore(true, 2).unwrap();
            assert_eq!(int_contents(&restored), model, "{backend_name}");
        }
    }

    /// Rocksdb-backed state (cache 1,000) of keys 0..300, each counting its own number, and
    /// its model.
    #[cfg(feature = "rocksdb")]
    fn rocksdb_state_of_300_keys() -> (KeyedState<i64>, BTreeMap<i64, i64>) {
        let mut state = empty(10, Some(1000));
        let mut model = BTreeMap::new();
        for k in 0..300 {
            *state.update(key(k), || 0).unwrap() += k;
            model.insert(k, k);
        }
        (state, model)
    }

    /// A table that cannot be fetched is replaced by the image's entries of its range, and the
    /// store tells the source (a continued chain then stops listing the tables: `upload`).
    #[cfg(feature = "rocksdb")]
    #[test]
    fn a_lazy_restore_replaces_a_damaged_table_by_the_image_and_says_so() {
        let (mut state, model) = rocksdb_state_of_300_keys();
        let image = state.snapshot_checkpoint().unwrap().bytes();
        let all = (0, MAX_PARALLELISM);
        let tables = Arc::new(TestTables::of(&image, 50, Some(2)));
        let mut restored = empty(10, Some(1000));
        assert!(restored.restore_lazy_tables(tables.clone(), all, all).unwrap());
        restored.after_restore(true, 1).unwrap();
        assert_eq!(int_contents(&restored), model, "every key, those of the damaged table's range included");
        assert_eq!(*tables.fell_back.lock().unwrap(), vec![2]);
    }

    /// A lazy restore serves the keys of the tables already in while the fetch of another is
    /// held: the first records flow before all state is read. The increments after the image
    /// (updates, a removal, a new key) are over every table once it is in.
    #[cfg(feature = "rocksdb")]
    #[test]
    fn a_lazy_restore_serves_reads_before_every_table_is_in() {
        let (mut state, mut model) = rocksdb_state_of_300_keys();
        let image = state.snapshot_checkpoint().unwrap().bytes();
        for k in (0..300).step_by(7) {
            *state.update(key(k), || 0).unwrap() += 1000;
            *model.get_mut(&k).unwrap() += 1000;
        }
        state.remove(&key(299)).unwrap();
        state.remove(&key(3)).unwrap();
        state.update(key(1000), || 5).unwrap();
        model.remove(&299);
        model.remove(&3);
        model.insert(1000, 5);
        let increment = state.snapshot_checkpoint().unwrap().bytes();
        assert_eq!(open(&increment).unwrap().0, FileKind::KeyedIncrement);

        let all = (0, MAX_PARALLELISM);
        let probe = TestTables::of(&image, 50, None);
        let last = probe.first_keys.len() - 1;
        assert!(last >= 4, "{} tables", last + 1);
        let last_start = probe.first_keys[last].clone();
        let tables = Arc::new(probe.holding(last));
        let mut restored = empty(10, Some(1000));
        assert!(restored.restore_lazy_tables(tables.clone(), all, all).unwrap());
        // The increment stays in its file: each range's loader reads its key groups of it.
        let increment_dir = tempfile::tempdir().unwrap();
        let path = increment_dir.path().join("increment");
        std::fs::write(&path, &increment).unwrap();
        let index = weir_checkpoint::format::read_increment_index(&increment[..], increment.len() as u64)
            .unwrap()
            .expect("the rocksdb backend's increments are ordered by key group");
        let increment = bulk::IncrementByKeyGroup {
            file: bulk::IncrementFile::Local(path),
            index,
            key_groups: all,
            keep: Box::new(()),
        };
        assert!(restored.restore_increment_by_key_group(increment).unwrap());
        restored.after_restore(true, 2).unwrap();

        let in_held_range = |k: i64| StateStore::key_of(key(k).key_group(MAX_PARALLELISM), &key(k)) >= last_start;
        let mut served = 0;
        for k in (0..300).chain([1000]).filter(|k| !in_held_range(*k)) {
            assert_eq!(restored.get(&key(k)).unwrap().copied(), model.get(&k).copied(), "key {k}");
            served += 1;
        }
        assert!(served > 200, "{served} keys outside the held table");
        assert!(restored.spill.as_ref().unwrap().store.loading(), "the held table is not in");
        assert!(!tables.fetched().contains(&last));
        tables.release();
        let held_key = (0..300).find(|k| in_held_range(*k) && model.contains_key(k)).unwrap();
        assert_eq!(restored.get(&key(held_key)).unwrap().copied(), model.get(&held_key).copied());
        assert_eq!(int_contents(&restored), model);
        assert!(!restored.spill.as_ref().unwrap().store.loading());
    }

    /// An increment ordered by key group in "storage" (memory here): the stretches fetched,
    /// and the damage reported.
    #[cfg(feature = "rocksdb")]
    struct MemoryIncrement {
        bytes: Bytes,
        fetched: std::sync::Mutex<Vec<(u64, u64)>>,
        damaged: std::sync::Mutex<Vec<String>>,
    }

    #[cfg(feature = "rocksdb")]
    impl bulk::StoredIncrement for MemoryIncrement {
        fn fetch(&self, offset: u64, len: u64) -> futures::future::BoxFuture<'_, Result<Bytes, String>> {
            self.fetched.lock().unwrap().push((offset, len));
            let bytes = self.bytes.slice(offset as usize..(offset + len) as usize);
            Box::pin(async move { Ok(bytes) })
        }

        fn damaged<'a>(&'a self, why: &'a str) -> futures::future::BoxFuture<'a, ()> {
            self.damaged.lock().unwrap().push(why.to_string());
            Box::pin(async {})
        }

        fn describe(&self) -> String {
            "the increment in memory".into()
        }
    }

    /// A lazy restore whose increments stay in storage: each range's loader fetches its key
    /// groups' stretch of each (verified by the index's checksums), and the state is the
    /// model's. A flipped bit fails the restore (reads say which key group), and the damage is
    /// reported to the source, which records it so that no later restore picks the checkpoint
    /// (`crate::restore`).
    #[cfg(feature = "rocksdb")]
    #[test]
    fn a_lazy_restore_reads_stored_increments_by_stretches_and_reports_a_damaged_one() {
        let (mut state, mut model) = rocksdb_state_of_300_keys();
        let image = state.snapshot_checkpoint().unwrap().bytes();
        let mut increments = Vec::new();
        for round in 0..2 {
            for k in (round..300).step_by(5) {
                *state.update(key(k), || 0).unwrap() += 1000;
                *model.get_mut(&k).unwrap() += 1000;
            }
            state.remove(&key(10 + round)).unwrap();
            model.remove(&(10 + round));
            increments.push(state.snapshot_checkpoint().unwrap().bytes());
        }
        let all = (0, MAX_PARALLELISM);
        let loading = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let restore = |damage_at: Option<usize>| {
            let tables = Arc::new(TestTables::of(&image, 50, None));
            let mut restored = empty(10, Some(1000));
            restored.spill.as_mut().unwrap().store.count_lazy_restores_in(loading.clone());
            assert!(restored.restore_lazy_tables(tables.clone(), all, all).unwrap());
            let mut stored = Vec::new();
            for (n, increment) in increments.iter().enumerate() {
                let index = weir_checkpoint::format::read_increment_index(&increment[..], increment.len() as u64)
                    .unwrap()
                    .unwrap();
                assert!(index.checked);
                let mut bytes = increment.to_vec();
                if let (1, Some(at)) = (n, damage_at) {
                    bytes[at] ^= 0x20;
                }
                let memory = Arc::new(MemoryIncrement {
                    bytes: Bytes::from(bytes),
                    fetched: Default::default(),
                    damaged: Default::default(),
                });
                stored.push((memory.clone(), index.clone()));
                let file = bulk::IncrementFile::Stored(memory);
                let increment = bulk::IncrementByKeyGroup { file, index, key_groups: all, keep: Box::new(()) };
                assert!(restored.restore_increment_by_key_group(increment).unwrap());
            }
            restored.after_restore(true, 3).unwrap();
            (restored, tables, stored)
        };

        // The job holds its checkpoints while the store loads, and no longer once all is in.
        let loading_now = || loading.load(std::sync::atomic::Ordering::Acquire);
        let released = || {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while loading_now() > 0 && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            loading_now() == 0
        };
        let (restored, tables, stored) = restore(None);
        assert_eq!(int_contents(&restored), model);
        assert!(released(), "the hold is released once every range is in");
        for (memory, index) in &stored {
            let mut fetched = memory.fetched.lock().unwrap().clone();
            fetched.sort();
            assert!(fetched.len() >= tables.first_keys.len().min(index.key_groups.len()), "{fetched:?}");
            // Every byte of the entries fetched, whole key groups at a time (one that two
            // ranges share, a table starting inside it, is fetched by both), and never the
            // whole file at once.
            let mut at = index.key_groups[0].offset;
            for &(offset, len) in &fetched {
                assert!(offset <= at, "bytes {at}..{offset} not fetched");
                assert!(index.key_groups.iter().any(|k| k.offset == offset), "{offset} starts no key group");
                at = at.max(offset + len);
            }
            assert_eq!(at, memory.bytes.len() as u64 - 4);
            assert!(fetched.iter().all(|&(_, len)| len < at - index.key_groups[0].offset), "{fetched:?}");
            assert!(memory.damaged.lock().unwrap().is_empty());
        }

        // A bit flipped in the second increment's entries.
        let index = &stored[1].1;
        let damaged = index.key_groups[index.key_groups.len() / 2];
        let (mut restored, _, stored) = restore(Some((damaged.offset + damaged.len / 2) as usize));
        let (mut served, mut refused) = (0, 0);
        for k in 0..300 {
            match restored.get(&key(k)) {
                Ok(v) => {
                    assert_eq!(v.copied(), model.get(&k).copied(), "key {k}");
                    served += 1;
                }
                Err(e) => {
                    let named = format!("checksum mismatch in the entries of key group {}", damaged.key_group);
                    assert!(e.to_string().contains(&named), "{e}");
                    refused += 1;
                }
            }
        }
        // Once a range fails the restore has failed: what was served before is right, and
        // every read after says why (the task fails on it).
        assert!(refused > 0, "{served} served, {refused} refused");
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert_eq!(loading_now(), 1, "a failed restore keeps holding its attempt's checkpoints");
        let reported = stored[1].0.damaged.lock().unwrap().clone();
        assert_eq!(reported.len(), 1, "{reported:?}");
        assert!(stored[0].0.damaged.lock().unwrap().is_empty());
    }

    /// A lazy restore's tables, on local disk: each fetch is a copy (the store moves what it
    /// takes in), one table may be damaged (its fetch fails, and the store falls back to the
    /// image), and fetches of one table may be held until released.
    #[cfg(feature = "rocksdb")]
    #[derive(Debug)]
    pub(super) struct TestTables {
        paths: Vec<std::path::PathBuf>,
        first_keys: Vec<Vec<u8>>,
        image: BTreeMap<Vec<u8>, Vec<u8>>,
        damaged: Option<usize>,
        /// The table whose fetch waits, and whether it may go on.
        held: Option<(usize, std::sync::Mutex<bool>, std::sync::Condvar)>,
        fetched: std::sync::Mutex<Vec<usize>>,
        /// Tables the store reported it could not take in.
        fell_back: std::sync::Mutex<Vec<usize>>,
        /// Holds the tables and the fetched copies for as long as the store may fetch.
        dir: tempfile::TempDir,
    }

    #[cfg(feature = "rocksdb")]
    impl TestTables {
        /// Full image `file` as tables of at most `entries` entries.
        pub(super) fn of(file: &bytes::Bytes, entries: u64, damaged: Option<usize>) -> Self {
            let dir = tempfile::tempdir().unwrap();
            let (_, body) = open(file).unwrap();
            let mut image = BTreeMap::new();
            for e in keyed_entries(body) {
                let e = e.unwrap();
                image.insert(StateStore::key_of_encoded(e.key_group, e.key), e.value.unwrap().to_vec());
            }
            let opts = store::options();
            let mut w = bulk::TableWriter::new(&dir.path().join("tables"), &opts).with_max_entries(entries);
            for (k, v) in &image {
                w.put(k, v).unwrap();
            }
            let (paths, first_keys) = w.finish_with_first_keys().unwrap().into_iter().unzip();
            TestTables {
                paths,
                first_keys,
                image,
                damaged,
                held: None,
                fetched: Default::default(),
                fell_back: Default::default(),
                dir,
            }
        }

        /// Fetches of table `i` wait for [`Self::release`].
        pub(super) fn holding(mut self, i: usize) -> Self {
            self.held = Some((i, std::sync::Mutex::new(false), std::sync::Condvar::new()));
            self
        }

        pub(super) fn release(&self) {
            let (_, go, cv) = self.held.as_ref().unwrap();
            *go.lock().unwrap() = true;
            cv.notify_all();
        }

        pub(super) fn fetched(&self) -> Vec<usize> {
            self.fetched.lock().unwrap().clone()
        }
    }

    #[cfg(feature = "rocksdb")]
    impl lazy::TableSource for TestTables {
        fn first_keys(&self) -> &[Vec<u8>] {
            &self.first_keys
        }

        fn fetch(&self, i: usize) -> Result<lazy::Fetched, String> {
            if let Some((held, go, cv)) = &self.held {
                if *held == i {
                    let mut go = go.lock().unwrap();
                    while !*go {
                        go = cv.wait(go).unwrap();
                    }
                }
            }
            self.fetched.lock().unwrap().push(i);
            if self.damaged == Some(i) {
                return Err(format!("table {i}: crc32c mismatch"));
            }
            let copy = tempfile::NamedTempFile::new_in(self.dir.path()).unwrap();
            std::fs::copy(&self.paths[i], copy.path()).unwrap();
            Ok(lazy::Fetched { path: copy.path().to_path_buf(), keep: Box::new(copy) })
        }

        fn image_entries(
            &self,
            start: &[u8],
            end: Option<&[u8]>,
            emit: &mut lazy::EmitEntry<'_>,
        ) -> Result<(), String> {
            let upper = end.map_or(std::ops::Bound::Unbounded, |e| std::ops::Bound::Excluded(e.to_vec()));
            for (k, v) in self.image.range((std::ops::Bound::Included(start.to_vec()), upper)) {
                emit(k, v).map_err(|e| e.to_string())?;
            }
            Ok(())
        }

        fn describe(&self) -> String {
            format!("{} test tables", self.paths.len())
        }

        fn fell_back(&self, i: usize) {
            self.fell_back.lock().unwrap().push(i);
        }
    }

    /// The entries of full image `file` as the rocksdb backend's table files under `dir`.
    #[cfg(feature = "rocksdb")]
    fn tables_of(file: &bytes::Bytes, dir: &std::path::Path) -> Vec<std::path::PathBuf> {
        let (_, body) = open(file).unwrap();
        let mut sorted = BTreeMap::new();
        for e in keyed_entries(body) {
            let e = e.unwrap();
            sorted.insert(StateStore::key_of_encoded(e.key_group, e.key), e.value.unwrap().to_vec());
        }
        let opts = store::options();
        let mut w = bulk::TableWriter::new(dir, &opts);
        for (k, v) in &sorted {
            w.put(k, v).unwrap();
        }
        w.finish().unwrap()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        #[test]
        fn keyed_state_equals_a_map_through_snapshots_and_restores(
            ops in proptest::collection::vec(op(), 1..120),
            full_every in 1u32..5,
            // Heap, or rocksdb with a cache so small that most keys are evicted and read back.
            backend in prop_oneof![Just(None), (1usize..6).prop_map(Some)]
        ) {
            state_equals_a_map::<i64>(&ops, full_every, backend)?;
        }

        /// The same with the entries' flags held in the values' own bits.
        #[test]
        fn keyed_state_with_flags_inside_its_values_equals_a_map_through_snapshots_and_restores(
            ops in proptest::collection::vec(op(), 1..120),
            full_every in 1u32..5,
            backend in prop_oneof![Just(None), (1usize..6).prop_map(Some)]
        ) {
            state_equals_a_map::<Lent>(&ops, full_every, backend)?;
        }
    }

    /// The property of the tests above: `ops` on the state of values `V` and on a map leave
    /// them equal after every step, and the last checkpoint restores to the map at any
    /// parallelism and on either backend.
    fn state_equals_a_map<V: ModelValue>(ops: &[Op], full_every: u32, backend: Backend) -> Result<(), TestCaseError> {
        let mut model: BTreeMap<i64, i64> = BTreeMap::new();
        let mut subtasks = Subtasks::<V>::new(1, full_every, backend);
        let mut last_checkpoint: (BTreeMap<i64, i64>, Snapshot) = (BTreeMap::new(), subtasks.checkpoint());
        let mut last_savepoint: Option<(BTreeMap<i64, i64>, Snapshot)> = None;
        for op in ops.iter().cloned() {
            match op {
                Op::Add(k, v) => {
                    subtasks.owner(&key(k)).update(key(k), || V::of(0)).unwrap().add(v);
                    *model.entry(k).or_default() += v;
                }
                Op::InsertNew(k, v) => {
                    let inserted = subtasks.owner(&key(k)).insert_new(key(k), V::of(v)).unwrap();
                    prop_assert_eq!(inserted, !model.contains_key(&k));
                    model.entry(k).or_insert(v);
                }
                Op::Remove(k) => {
                    prop_assert_eq!(
                        subtasks.owner(&key(k)).remove(&key(k)).unwrap().map(|v| v.get()),
                        model.remove(&k)
                    );
                }
                Op::Prefetch(keys) => {
                    for k in keys.iter().map(|k| key(*k)) {
                        let batch: Vec<Key> = keys.iter().map(|k| key(*k)).collect();
                        subtasks.owner(&k).prefetch(&batch).unwrap();
                    }
                }
                Op::Checkpoint => last_checkpoint = (model.clone(), subtasks.checkpoint()),
                Op::Savepoint => last_savepoint = Some((model.clone(), subtasks.savepoint())),
                Op::Restore(p) => {
                    model = last_checkpoint.0.clone();
                    subtasks = Subtasks::restore(&last_checkpoint.1, p, full_every, true, backend);
                }
                Op::RestoreSavepoint(p) => {
                    if let Some((m, snap)) = &last_savepoint {
                        model = m.clone();
                        subtasks = Subtasks::restore(snap, p, full_every, false, backend);
                    }
                }
            }
            prop_assert_eq!(&subtasks.contents(), &model);
        }
        // Whatever happened, the next checkpoint restores to the model too, at any
        // parallelism and on either backend (the snapshot format is the same), and into
        // either kind of slot.
        let snap = subtasks.checkpoint();
        for p in 1..=3 {
            for restored_on in [None, Some(2)] {
                prop_assert_eq!(
                    &Subtasks::<V>::restore(&snap, p, full_every, true, restored_on).contents(),
                    &model,
                    "restored at parallelism {} on {:?} (taken on {:?})",
                    p,
                    restored_on,
                    backend
                );
            }
            prop_assert_eq!(&Subtasks::<i64>::restore(&snap, p, full_every, false, None).contents(), &model);
            prop_assert_eq!(&Subtasks::<Lent>::restore(&snap, p, full_every, false, None).contents(), &model);
        }
        // Chains never grow past fullEvery files.
        for (_, chain) in &snap {
            prop_assert!(
                chain.len() <= full_every as usize,
                "chain of {} files with fullEvery {}",
                chain.len(),
                full_every
            );
        }
        Ok(())
    }

    /// Shrunk from the property above: a key removed and inserted again between two
    /// checkpoints restored as deleted (the increment wrote its put before its deletion).
    #[test]
    fn a_key_removed_and_inserted_again_between_checkpoints_survives_a_restore() {
        let mut s = KeyedState::<i64>::new(MAX_PARALLELISM, true, 10);
        *s.update(key(1), || 0).unwrap() += 1;
        let full = s.snapshot_checkpoint().unwrap();
        s.remove(&key(1)).unwrap();
        *s.update(key(1), || 0).unwrap() += 7;
        let inc = s.snapshot_checkpoint().unwrap();
        let mut r = KeyedState::<i64>::new(MAX_PARALLELISM, true, 10);
        for f in [full.data, inc.data] {
            r.restore_file(open(&f).unwrap().1, (0, MAX_PARALLELISM)).unwrap();
        }
        assert_eq!(r.get(&key(1)).unwrap(), Some(&7));
    }

    /// Shrunk from the property above: restoring a chain restarted the count towards the next
    /// full image, so a job restarted in a loop grew its chain without bound.
    #[test]
    fn a_restored_chain_keeps_counting_towards_its_full_image() {
        let mut s = KeyedState::<i64>::new(MAX_PARALLELISM, true, 3);
        s.update(key(1), || 1).unwrap();
        let chain = [
            s.snapshot_checkpoint().unwrap().data,
            s.snapshot_checkpoint().unwrap().data,
            s.snapshot_checkpoint().unwrap().data,
        ];
        let mut r = KeyedState::<i64>::new(MAX_PARALLELISM, true, 3);
        for f in &chain {
            r.restore_file(open(f).unwrap().1, (0, MAX_PARALLELISM)).unwrap();
        }
        r.after_restore(true, chain.len()).unwrap();
        assert_eq!(
            r.snapshot_checkpoint().unwrap().kind,
            FileKind::KeyedFull,
            "a chain holds at most fullEvery (3) files: the next one is a full image"
        );
    }

    /// What a set of keys (a dedupe's state) is asked to do.
    #[derive(Clone, Debug)]
    enum SetOp {
        /// A batch of keys inserted unless present, as dedupe does (repeats included).
        InsertNewAll(Vec<i64>),
        Remove(i64),
        /// An update of a `()` value: inserts the key when absent, else changes nothing.
        Update(i64),
        Checkpoint,
        /// Crash and restore from the last checkpoint's chain.
        Restore,
    }

    fn set_op() -> impl Strategy<Value = SetOp> {
        prop_oneof![
            6 => proptest::collection::vec(0i64..30, 1..8).prop_map(SetOp::InsertNewAll),
            3 => (0i64..30).prop_map(SetOp::Remove),
            2 => (0i64..30).prop_map(SetOp::Update),
            3 => Just(SetOp::Checkpoint),
            1 => Just(SetOp::Restore),
        ]
    }

    fn restored_set(chain: &[Bytes], full_every: u32) -> KeyedState<()> {
        let mut s = KeyedState::<()>::new(MAX_PARALLELISM, true, full_every);
        for f in chain {
            s.restore_file(open(f).unwrap().1, (0, MAX_PARALLELISM)).unwrap();
        }
        s.after_restore(true, chain.len()).unwrap();
        s
    }

    fn set_contents(s: &KeyedState<()>) -> BTreeSet<i64> {
        s.entries()
            .into_iter()
            .map(|(k, ())| match k {
                Key::One(Value::Int(i)) => i,
                k => panic!("{k:?}"),
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// A one-valued state's increments are written from its changed keys without lookups
        /// ([`KeyedState::write_inserted_keys`]): keys inserted and removed in the same
        /// interval, removed and inserted again, repeated in a batch, or updated (a no-op that
        /// leaves the dirty flag the last increment left set) must restore as the model.
        #[test]
        fn a_set_of_keys_restores_as_a_set_through_increments_and_restores(
            ops in proptest::collection::vec(set_op(), 1..150),
            full_every in 1u32..6,
        ) {
            let mut model: BTreeSet<i64> = BTreeSet::new();
            let mut s = KeyedState::<()>::new(MAX_PARALLELISM, true, full_every);
            let mut chain: Vec<Bytes> = Vec::new();
            let mut last_checkpoint: (BTreeSet<i64>, Vec<Bytes>) = (BTreeSet::new(), Vec::new());
            for op in ops {
                match op {
                    SetOp::InsertNewAll(keys) => {
                        let inserted = s.insert_new_all(keys.iter().map(|k| key(*k)).collect(), ()).unwrap();
                        let expected: Vec<bool> = keys.iter().map(|k| model.insert(*k)).collect();
                        prop_assert_eq!(inserted, expected);
                    }
                    SetOp::Remove(k) => prop_assert_eq!(s.remove(&key(k)).unwrap().is_some(), model.remove(&k)),
                    SetOp::Update(k) => {
                        s.update(key(k), || ()).unwrap();
                        model.insert(k);
                    }
                    SetOp::Checkpoint => {
                        let snap = s.snapshot_checkpoint().unwrap();
                        if snap.kind == FileKind::KeyedFull {
                            chain.clear();
                        }
                        chain.push(snap.data);
                        last_checkpoint = (model.clone(), chain.clone());
                    }
                    SetOp::Restore => {
                        (model, chain) = last_checkpoint.clone();
                        s = restored_set(&chain, full_every);
                    }
                }
                prop_assert_eq!(&set_contents(&s), &model);
            }
            let snap = s.snapshot_checkpoint().unwrap();
            if snap.kind == FileKind::KeyedFull {
                chain.clear();
            }
            chain.push(snap.data);
            prop_assert_eq!(&set_contents(&restored_set(&chain, full_every)), &model);
        }
    }
}

#[cfg(test)]
mod size_tests {
    use super::Slot;
    use crate::operators::accumulators::AccList;
    use crate::value::{Key, Record};

    /// Entry and record sizes are what the throughput figures rest on: the keyed count is
    /// bound by cache misses on its entries, and every record of a batch is moved by value.
    #[test]
    fn state_entries_and_records_stay_small() {
        assert!(std::mem::size_of::<(Key, Slot<AccList>)>() <= 72, "a running-aggregate entry grew");
        assert!(std::mem::size_of::<Record>() <= 88, "a record grew");
    }
}
