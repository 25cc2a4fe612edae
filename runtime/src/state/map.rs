//! The heap backend's map: [`SHARDS`] hash maps, each key in the one that bits of its hash
//! choose.
//!
//! One map of every entry has to move all of them when it grows: a heap state of 15M entries
//! stopped its task for 5 s. griddle's map moved a few entries per insert instead, but while it
//! moved them every lookup of a missing key probed both tables, and a state that keeps growing
//! (a dedupe keeps an entry per record) was always moving: on the CEL pipeline the map took 11–13%
//! more CPU than one that grows at once. Shards grow at once, each on its own: a growth moves
//! 1/64 of the state.
//!
//! Hashes spread keys evenly, so shards that grew only when full would all fill up within a few
//! thousand inserts of each other and grow one after the other: a 90M-entry state stopped its
//! task for 13 s. Each shard therefore grows at its own fill ([`grows_at`]), from three quarters
//! of its capacity for the first shard to all of it for the last: the shards' growths are spread
//! over the last third of the way between two doublings of the state. (Spread over the whole
//! way, from half full, the 90M-entry state needed 15 GB instead of 11 and restored in 40 s
//! instead of 27; checkpoints were no better.)

use std::hash::{BuildHasher, Hash};

use hashbrown::hash_table;
use rustc_hash::FxBuildHasher;

use crate::malloc::TableAlloc;

/// One shard's table, allocated by [`TableAlloc`].
type HashTable<T> = hash_table::HashTable<T, TableAlloc>;

/// Shards of the map: a power of two.
pub const SHARDS: usize = 64;

/// Threads at most that fault a restored map's tables in ([`ShardedMap::reserve_prefaulted`]):
/// zeroing pages is bound by memory, which a few cores saturate.
const MAX_POPULATING_THREADS: usize = 4;

/// Where a hash's shard bits start. hashbrown takes a bucket's index from the low bits and its
/// control byte from the top seven; the shard bits are neither, so keys within a shard still
/// spread over its buckets and control bytes.
const SHARD_SHIFT: u32 = 40;

/// The shard of a key's hash.
#[inline]
pub fn shard_of(hash: u64) -> usize {
    (hash >> SHARD_SHIFT) as usize & (SHARDS - 1)
}

/// The bits of a key's hash below the window of a restoring table that holds it: a window is
/// the 2^12 buckets ([`WINDOW_BUCKETS`]) whose indexes share their bits from the 13th up.
pub const WINDOW_LOW_BITS: u32 = 12;

/// Buckets of a window ([`WINDOW_LOW_BITS`]): 4096 of a count's entries (16 to 40 bytes) and
/// their control bytes take 100–170 KB, which the second-level cache holds.
pub const WINDOW_BUCKETS: usize = 1 << WINDOW_LOW_BITS;

/// Where a key of `hash` goes in a file in window order: its shard, then the bits of its hash
/// from [`WINDOW_LOW_BITS`] up, the lowest bit first (the most significant in the order).
///
/// A table of 2^R buckets (R at least 12) holds a key in bucket `hash & (2^R - 1)`, in the
/// window of bits 12 to R of the hash. Those bits are the first the order compares, so the
/// keys of a window lie together in the file, for every R, and the windows come one after
/// the other (in the bit-reversed order of their indexes, [`window_position`]). A restore
/// into a table of any size then reads each such file front to back once and fills one window
/// at a time from all of them, where a file in the bucket order of its writer's table (one
/// size: the state grows between checkpoints) had to be sorted by the restore first: a third
/// of a 90M-key chain's apply (session 46). The writer loses nothing: its lookups in this order
/// also visit its own table window by window.
///
/// The order is part of the state file format ([`weir_checkpoint::FileRef::in_window_order`]):
/// changing it, or [`WINDOW_LOW_BITS`], makes files that say they are in window order lie.
#[inline]
pub fn window_order(hash: u64) -> u64 {
    ((shard_of(hash) as u64) << SHARD_IN_ORDER) | (above_window_reversed(hash) >> (64 - SHARD_IN_ORDER))
}

/// The bits of `hash` from [`WINDOW_LOW_BITS`] up, reversed: the lowest is the top bit.
#[inline(always)]
fn above_window_reversed(hash: u64) -> u64 {
    (hash >> WINDOW_LOW_BITS).reverse_bits()
}

/// Where [`window_order`] puts the shard: above the hash's bits.
const SHARD_IN_ORDER: u32 = 58;

/// The shard of a place [`window_order`] gave.
#[inline]
pub fn shard_in_order(order: u64) -> usize {
    (order >> SHARD_IN_ORDER) as usize
}

/// When a restore fills the window of a key of `hash` in a table of `2^(12 + window_bits)`
/// buckets, visiting the windows in [`window_order`]: the window's index with its
/// `window_bits` bits reversed. Non-decreasing along a shard's entries in window order.
#[inline(always)]
pub fn window_position(hash: u64, window_bits: u32) -> usize {
    match window_bits {
        0 => 0,
        bits => (above_window_reversed(hash) >> (64 - bits)) as usize,
    }
}

/// The index of the window filled at `position` ([`window_position`]) in a table of
/// `2^(12 + window_bits)` buckets: the position with its `window_bits` bits reversed.
#[inline]
pub fn window_at(position: usize, window_bits: u32) -> usize {
    match window_bits {
        0 => 0,
        bits => position.reverse_bits() >> (usize::BITS - bits),
    }
}

/// How many entries shard `index` of `capacity` holds when the next new key makes it grow: from
/// three quarters of its capacity (shard 0) to all of it (the last shard).
#[inline]
pub fn grows_at(index: usize, capacity: usize) -> usize {
    capacity * (3 * SHARDS + index + 1) / (4 * SHARDS)
}

/// A shard's part of `entries` spread over the shards, with a margin of a sixteenth for the
/// unevenness of hashes.
fn share_of(entries: u64) -> u64 {
    let share = entries.div_ceil(SHARDS as u64);
    share + share / 16
}

/// The capacity each shard of a map that restores `entries` reserves
/// ([`ShardedMap::reserve_prefaulted`]): its share, with a margin.
fn restored_capacity(entries: u64) -> u64 {
    share_of(entries)
}

/// The bytes of the tables a map whose entries take `slot_bytes` each (a key and its value)
/// allocates to restore `entries` ([`ShardedMap::reserve_prefaulted`]), counting only tables
/// of [`crate::malloc::CARVED_FROM_BYTES`] or more, each rounded up to whole pages: what a
/// restore can fault in before it knows the map's types
/// ([`crate::malloc::PrefaultedTables`]). hashbrown's layout: a power of two of buckets at
/// most seven eighths full, each a slot and a control byte, and a group of control bytes
/// more.
pub fn restored_table_bytes(entries: u64, slot_bytes: u64) -> u64 {
    const GROUP: u64 = 16;
    let capacity = restored_capacity(entries);
    if capacity < 15 || slot_bytes == 0 {
        return 0;
    }
    let buckets = (capacity * 8 / 7).next_power_of_two();
    let table = (buckets * slot_bytes).next_multiple_of(GROUP) + buckets + GROUP;
    if table < crate::malloc::CARVED_FROM_BYTES as u64 {
        return 0;
    }
    SHARDS as u64 * table.next_multiple_of(4096)
}

/// The hash the map gives a key.
#[inline]
pub fn hash_of<K: Hash>(key: &K) -> u64 {
    FxBuildHasher.hash_one(key)
}

/// The hashes of a batch's keys, in one pass of their own.
///
/// A lookup of a key missing from the CPU's caches waits on memory, and the CPU overlaps the
/// misses of independent lookups only as far as it runs ahead. Hashing a key of variable
/// length branches on its length, and a mispredicted branch throws away the lookups started
/// past it: with the hash computed next to the probe, inserting 8M new composite keys took
/// 550 ns each; hashed first in a loop of their own, 210 ns (hashbrown, this machine).
pub fn hashes_of<K: Hash>(keys: &[K]) -> Vec<u64> {
    keys.iter().map(hash_of).collect()
}

/// A hash map in [`SHARDS`] shards. A key is hashed once per operation: the hash picks the
/// shard and is the shard's hash too.
pub struct ShardedMap<K, V> {
    shards: Box<[HashTable<(K, V)>]>,
    /// Entries in all shards (counting the shards would visit each).
    len: usize,
}

impl<K, V> Default for ShardedMap<K, V> {
    fn default() -> Self {
        ShardedMap { shards: (0..SHARDS).map(|_| HashTable::new_in(TableAlloc)).collect(), len: 0 }
    }
}

/// A key's place in a [`ShardedMap`]: its entry, or where it would go.
pub enum MapEntry<'a, K, V> {
    /// The key is there.
    Occupied(OccupiedEntry<'a, K, V>),
    /// It is not.
    Vacant(VacantEntry<'a, K, V>),
}

/// A present key's entry in a [`ShardedMap`].
pub struct OccupiedEntry<'a, K, V> {
    entry: hash_table::OccupiedEntry<'a, (K, V), TableAlloc>,
}

impl<'a, K, V> OccupiedEntry<'a, K, V> {
    /// The key.
    pub fn key(&self) -> &K {
        &self.entry.get().0
    }

    /// The value.
    pub fn get(&self) -> &V {
        &self.entry.get().1
    }

    /// The value, for update, for as long as the map is borrowed.
    pub fn into_mut(self) -> &'a mut V {
        &mut self.entry.into_mut().1
    }
}

/// A missing key's place in a [`ShardedMap`].
pub struct VacantEntry<'a, K, V> {
    entry: hash_table::VacantEntry<'a, (K, V), TableAlloc>,
    key: K,
    len: &'a mut usize,
}

impl<'a, K, V> VacantEntry<'a, K, V> {
    /// The key.
    pub fn key(&self) -> &K {
        &self.key
    }

    /// Inserts the key with `value`.
    pub fn insert(self, value: V) -> &'a mut V {
        *self.len += 1;
        &mut self.entry.insert((self.key, value)).into_mut().1
    }
}

impl<K: Hash + Eq, V> ShardedMap<K, V> {
    /// Entries.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The value of a key.
    #[inline]
    pub fn get(&self, key: &K) -> Option<&V> {
        self.get_hashed(hash_of(key), key)
    }

    /// The value of a key whose [`hash_of`] the caller computed.
    #[inline]
    pub fn get_hashed(&self, hash: u64, key: &K) -> Option<&V> {
        self.shards[shard_of(hash)].find(hash, |(k, _)| k == key).map(|(_, v)| v)
    }

    /// Where shard `index` keeps its control bytes, and how many buckets it has: from the first
    /// full bucket's address and index (hashbrown keeps bucket `i` `i + 1` entries below the
    /// control bytes). `None` for a shard less than an eighth full: finding its first full
    /// bucket could mean a long scan (a map that reserved room for a restore, or lost most of
    /// its keys, keeps its buckets). Only [`Self::prefetch_probes`] uses the address.
    fn control_bytes_of(&self, index: usize) -> Option<(*const u8, usize)> {
        let shard = &self.shards[index];
        if shard.is_empty() || shard.len() < shard.num_buckets() / 8 {
            return None;
        }
        let first = shard.iter_buckets().next()?;
        let entry: *const (K, V) = shard.get_bucket(first)?;
        Some((entry.wrapping_add(first + 1).cast::<u8>(), shard.num_buckets()))
    }

    /// Asks the CPU to fetch, for reading, the control bytes and the first bucket of each
    /// hash's probe, before the lookups of a batch run. A lookup loads the control bytes and
    /// then the bucket they point to, one miss after the other; with both asked for ahead, the
    /// batch's misses overlap, and its lookups find them in the caches.
    pub fn prefetch_probes(&self, hashes: &[u64]) {
        let mut shards: [Option<Option<(*const u8, usize)>>; SHARDS] = [None; SHARDS];
        for &hash in hashes {
            let index = shard_of(hash);
            let Some((control, buckets)) = *shards[index].get_or_insert_with(|| self.control_bytes_of(index)) else {
                continue;
            };
            let start = (hash as usize) & (buckets - 1);
            crate::prefetch::for_read(control.wrapping_add(start));
            crate::prefetch::for_read(control.cast::<(K, V)>().wrapping_sub(start + 1));
        }
    }

    /// The value of a key, for update.
    #[inline]
    pub fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        self.get_mut_hashed(hash_of(key), key)
    }

    /// The value of a key whose [`hash_of`] the caller computed, for update.
    #[inline]
    pub fn get_mut_hashed(&mut self, hash: u64, key: &K) -> Option<&mut V> {
        self.shards[shard_of(hash)].find_mut(hash, |(k, _)| k == key).map(|(_, v)| v)
    }

    /// Whether the key is there.
    #[inline]
    pub fn contains_key(&self, key: &K) -> bool {
        self.get(key).is_some()
    }

    /// Inserts or replaces.
    #[inline]
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        let hash = hash_of(&key);
        Self::shard_to_insert_into(&mut self.shards, hash);
        self.insert_hashed(hash, key, value)
    }

    /// Removes a key.
    #[inline]
    pub fn remove(&mut self, key: &K) -> Option<V> {
        self.remove_hashed(hash_of(key), key)
    }

    /// Removes a key whose [`hash_of`] the caller computed.
    #[inline]
    pub fn remove_hashed(&mut self, hash: u64, key: &K) -> Option<V> {
        let found = self.shards[shard_of(hash)].find_entry(hash, |(k, _)| k == key).ok()?;
        self.len -= 1;
        Some(found.remove().0 .1)
    }

    /// The entry of a key.
    #[inline]
    pub fn entry(&mut self, key: K) -> MapEntry<'_, K, V> {
        self.entry_hashed(hash_of(&key), key)
    }

    /// The entry of a key whose [`hash_of`] the caller computed.
    #[inline]
    pub fn entry_hashed(&mut self, hash: u64, key: K) -> MapEntry<'_, K, V> {
        debug_assert_eq!(hash, hash_of(&key), "the hash given is the key's");
        match Self::shard_to_insert_into(&mut self.shards, hash).entry(hash, |(k, _)| *k == key, |(k, _)| hash_of(k)) {
            hash_table::Entry::Occupied(entry) => MapEntry::Occupied(OccupiedEntry { entry }),
            hash_table::Entry::Vacant(entry) => MapEntry::Vacant(VacantEntry { entry, key, len: &mut self.len }),
        }
    }

    /// Inserts a key whose [`hash_of`] the caller computed, with the value `value` makes of
    /// it, unless the key is there; whether it was inserted. Always inlined, with no entry
    /// type between the probe and the insert, so that the key is not copied between stack
    /// slots on its way to the bucket. (Through [`Self::entry_hashed`] the vacant entry was
    /// written in one set of pieces and read in another, and the read waited for the
    /// writes. Alone this change measured neutral: the stall moved to the key's copy out of
    /// its batch, which `KeyedState::insert_new_all` now takes whole.)
    #[inline(always)]
    pub fn insert_absent_hashed(&mut self, hash: u64, key: K, value: impl FnOnce(&K) -> V) -> bool {
        debug_assert_eq!(hash, hash_of(&key), "the hash given is the key's");
        match Self::shard_to_insert_into(&mut self.shards, hash).entry(hash, |(k, _)| *k == key, |(k, _)| hash_of(k)) {
            hash_table::Entry::Occupied(_) => false,
            hash_table::Entry::Vacant(entry) => {
                let value = value(&key);
                entry.insert((key, value));
                self.len += 1;
                true
            }
        }
    }

    /// Inserts or replaces a key whose [`hash_of`] the caller computed; the value it replaced.
    /// Its shard grows only when full, not at its growth point ([`grows_at`]), as a restore
    /// fills a map ([`Self::reserve_prefaulted`]); [`Self::insert`] grows it at the point
    /// first.
    #[inline]
    pub fn insert_hashed(&mut self, hash: u64, key: K, value: V) -> Option<V> {
        debug_assert_eq!(hash, hash_of(&key), "the hash given is the key's");
        match self.shards[shard_of(hash)].entry(hash, |(k, _)| *k == key, |(k, _)| hash_of(k)) {
            hash_table::Entry::Occupied(mut o) => Some(std::mem::replace(&mut o.get_mut().1, value)),
            hash_table::Entry::Vacant(v) => {
                v.insert((key, value));
                self.len += 1;
                None
            }
        }
    }

    /// The shard of `hash` (of `shards`, this map's), grown first if an insert would take it past [`grows_at`].
    #[inline(always)]
    fn shard_to_insert_into(shards: &mut [HashTable<(K, V)>], hash: u64) -> &mut HashTable<(K, V)> {
        let index = shard_of(hash);
        let shard = &mut shards[index];
        grow_if_due(shard, index);
        shard
    }

    /// Removes every entry, keeping each shard's table and its room.
    pub fn clear(&mut self) {
        for shard in self.shards.iter_mut() {
            shard.clear();
        }
        self.len = 0;
    }

    /// The buckets of shard `index`'s table.
    pub fn shard_buckets(&self, index: usize) -> usize {
        self.shards[index].num_buckets()
    }

    /// Entries the shards' tables have room for without growing.
    pub fn capacity(&self) -> usize {
        self.shards.iter().map(HashTable::capacity).sum()
    }

    /// Keeps the entries of shard `shard` (of [`SHARDS`]) that `keep` returns true for.
    pub fn retain_shard(&mut self, shard: usize, mut keep: impl FnMut(&K, &mut V) -> bool) {
        let table = &mut self.shards[shard];
        let before = table.len();
        table.retain(|(k, v)| keep(k, v));
        self.len -= before - table.len();
    }

    /// Keeps the entries `keep` returns true for, shard after shard.
    pub fn retain(&mut self, mut keep: impl FnMut(&K, &mut V) -> bool) {
        for shard in self.shards.iter_mut() {
            shard.retain(|(k, v)| keep(k, v));
        }
        self.len = self.shards.iter().map(HashTable::len).sum();
    }

    /// Every entry.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.shards.iter().flat_map(|s| s.iter().map(|(k, v)| (k, v)))
    }

    /// Every entry, for update.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&K, &mut V)> {
        self.shards.iter_mut().flat_map(|s| s.iter_mut().map(|(k, v)| (&*k, v)))
    }

    /// The entries of shard `index` (of [`SHARDS`]): [`Self::iter`] lists them shard after
    /// shard.
    pub fn shard_iter(&self, index: usize) -> impl Iterator<Item = (&K, &V)> {
        self.shards[index].iter().map(|(k, v)| (k, v))
    }

    /// The entries of shard `index` (of [`SHARDS`]), for update: [`Self::iter_mut`] lists them
    /// shard after shard.
    pub fn shard_iter_mut(&mut self, index: usize) -> impl Iterator<Item = (&K, &mut V)> {
        self.shards[index].iter_mut().map(|(k, v)| (&*k, v))
    }

    /// Every value, for update.
    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        self.iter_mut().map(|(_, v)| v)
    }

    /// The bytes an entry takes in a table (its key and value, without the control byte).
    pub const SLOT_BYTES: usize = std::mem::size_of::<(K, V)>();

    /// Makes room for `additional` more entries about to be restored: each shard its share
    /// and a sixteenth ([`restored_capacity`]), in tables faulted in first, on every core
    /// ([`crate::malloc::populate`]). A restore fills them through [`Self::fill_concurrently`]
    /// or [`Self::insert_hashed`], which grow a shard only when it is full; the shards
    /// whose growth points ([`grows_at`]) fall below what they hold then grow at their next
    /// insert of a new key, one by one as new keys come. Reserved below every shard's growth
    /// point instead, 90M keys took 8.2 GB of tables (a power of two of buckets more for the
    /// first 15 shards) and restored in 2.9–3.8 s; reserved their share, 6.6 GB and 2.0–2.1 s
    /// (`runtime/BENCHMARKS.md`, session 38).
    ///
    /// With `faulted`, memory faulted in while the restore read its files, the tables are
    /// carved from it as far as it goes ([`crate::malloc::PrefaultedTables::carve_while`]),
    /// and only the others are faulted in here.
    pub fn reserve_prefaulted(&mut self, additional: usize, faulted: Option<&crate::malloc::PrefaultedTables>) {
        let share = restored_capacity(additional as u64) as usize;
        let reserve = || {
            for shard in self.shards.iter_mut() {
                shard.reserve(share, |(k, _)| hash_of(k));
            }
        };
        let blocks = match faulted {
            Some(faulted) => faulted.carve_while(reserve),
            None => crate::malloc::record_tables(reserve),
        };
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        crate::malloc::populate(&blocks, cores.min(MAX_POPULATING_THREADS));
    }

    /// The same entries with their keys `convert`ed, each where the map's hash of the new key
    /// puts it: for a key type that hashes as the old one (see [`crate::value::IntKey`]),
    /// where it was. Shard by shard, each old table freed once its entries moved, so that
    /// the memory this takes beyond the new map is one shard's.
    pub fn into_keys<K2: Hash + Eq>(self, mut convert: impl FnMut(K) -> K2) -> ShardedMap<K2, V> {
        let shards = Vec::from(self.shards)
            .into_iter()
            .map(|mut old| {
                let mut new = HashTable::with_capacity_in(old.capacity(), TableAlloc);
                for (key, value) in old.drain() {
                    let key = convert(key);
                    new.insert_unique(hash_of(&key), (key, value), |(k, _)| hash_of(k));
                }
                new
            })
            .collect();
        ShardedMap { shards, len: self.len }
    }

    /// Runs `fill` with the map's shards behind locks, so that several threads can change it
    /// at once ([`ConcurrentFill::filler`]), then counts the entries the shards hold.
    pub fn fill_concurrently<R>(&mut self, fill: impl FnOnce(&ConcurrentFill<'_, K, V>) -> R) -> R {
        let result = fill(&ConcurrentFill { shards: self.shards.iter_mut().map(std::sync::Mutex::new).collect() });
        self.len = self.shards.iter().map(HashTable::len).sum();
        result
    }
}

/// Grows shard `index`'s `table` when one more entry would take it past [`grows_at`]: doubles
/// it (hashbrown grows to the next power of two of buckets).
#[inline(always)]
fn grow_if_due<K: Hash, V>(table: &mut HashTable<(K, V)>, index: usize) {
    if table.len() >= grows_at(index, table.capacity()) {
        table.reserve(table.capacity() + 1 - table.len(), |(k, _)| hash_of(k));
    }
}

/// A shard of a [`ConcurrentFill`]'s map.
type ShardRef<'m, K, V> = &'m mut HashTable<(K, V)>;

/// A [`ShardedMap`] that several threads fill at once for a restore, each shard behind a lock
/// ([`ShardedMap::fill_concurrently`]); its shards grow only when full.
pub struct ConcurrentFill<'m, K, V> {
    shards: Box<[std::sync::Mutex<ShardRef<'m, K, V>>]>,
}

impl<'m, K: Hash + Eq, V> ConcurrentFill<'m, K, V> {
    /// One thread's way into the map.
    pub fn filler(&self) -> Filler<'_, 'm, K, V> {
        Filler { fill: self, held: None, layout: None }
    }
}

/// One thread's changes to a [`ConcurrentFill`]. It keeps the lock of the shard it changed
/// last until a key of another shard comes: entries that come in the map's order (the heap
/// backend's state files list them shard after shard) take a lock per shard, not per entry.
pub struct Filler<'f, 'm, K, V> {
    fill: &'f ConcurrentFill<'m, K, V>,
    /// The index of the shard whose lock it holds, and the lock.
    held: Option<(usize, std::sync::MutexGuard<'f, ShardRef<'m, K, V>>)>,
    /// Where the held shard keeps its control bytes, and its buckets, once an entry changed
    /// in it told ([`Self::prefetch`]).
    layout: Option<(*const u8, usize)>,
}

impl<'f, 'm, K: Hash + Eq, V> Filler<'f, 'm, K, V> {
    /// Inserts or replaces (`Some`) or removes (`None`) a key whose [`hash_of`] the caller
    /// computed, unless another thread holds its shard: then hands it back, to be applied
    /// later with [`Self::apply`]. The caller decides whether the order of changes to one key
    /// matters across threads.
    #[inline(always)]
    pub fn try_apply(&mut self, hash: u64, key: K, value: Option<V>) -> Result<(), (u64, K, Option<V>)> {
        match self.shard(shard_of(hash), false) {
            Some(table) => {
                let layout = change(table, hash, key, value);
                self.layout = layout.or(self.layout);
                Ok(())
            }
            None => Err((hash, key, value)),
        }
    }

    /// [`Self::try_apply`], waiting for the shard's lock.
    #[inline(always)]
    pub fn apply(&mut self, hash: u64, key: K, value: Option<V>) {
        if let Some(table) = self.shard(shard_of(hash), true) {
            let layout = change(table, hash, key, value);
            self.layout = layout.or(self.layout);
        }
    }

    /// Shard `index`'s table, its lock taken unless it is the one held (the one held before is
    /// let go); `None` when another thread holds it and `wait` is false.
    #[inline(always)]
    fn shard(&mut self, index: usize, wait: bool) -> Option<&mut HashTable<(K, V)>> {
        let held = &mut self.held;
        if !matches!(held, Some((at, _)) if *at == index) {
            *held = None;
            self.layout = None;
            let lock = &self.fill.shards[index];
            let table = if wait {
                lock.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
            } else {
                match lock.try_lock() {
                    Ok(table) => table,
                    Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                    Err(std::sync::TryLockError::WouldBlock) => return None,
                }
            };
            *held = Some((index, table));
        }
        held.as_mut().map(|(_, table)| &mut ***table)
    }

    /// Where shard `shard` keeps the control bytes and the entries of its buckets `buckets`
    /// (as address and length in bytes), when it is the shard held and an entry changed in it
    /// told where its table is: for a restore that asks the CPU to fetch them ahead.
    pub fn memory_of(&self, shard: usize, buckets: std::ops::Range<usize>) -> Option<[(*const u8, usize); 2]> {
        let held = self.held.as_ref().map(|(index, _)| *index);
        let (Some(held), Some((control, in_table))) = (held, self.layout) else { return None };
        if held != shard || buckets.end > in_table || buckets.is_empty() {
            return None;
        }
        // hashbrown keeps bucket `i` `i + 1` entries below the control bytes.
        let size = std::mem::size_of::<(K, V)>();
        let entries = control.wrapping_sub(buckets.end * size);
        Some([(control.wrapping_add(buckets.start), buckets.len()), (entries, buckets.len() * size)])
    }

    /// Asks the CPU to fetch the control bytes and the first bucket of the probe of `hash`,
    /// when its shard is the one held and an entry changed in it told where its table is: for
    /// entries decoded ahead of their changes, whose misses then overlap (a restored
    /// increment's keys are spread over the whole map).
    #[inline(always)]
    pub fn prefetch(&self, hash: u64) {
        if let (Some((held, _)), Some((control, buckets))) = (&self.held, self.layout) {
            if *held == shard_of(hash) {
                let start = (hash as usize) & (buckets - 1);
                crate::prefetch::for_read(control.wrapping_add(start));
                crate::prefetch::for_read(control.cast::<(K, V)>().wrapping_sub(start + 1));
            }
        }
    }
}

/// Inserts or replaces (`Some`) or removes (`None`) a key in a restore's `table`, which grows
/// only when full (see [`ShardedMap::reserve_prefaulted`]). After a put into a missing key's
/// bucket, where the table (grown or not) keeps its control bytes and how many buckets it has
/// (hashbrown keeps bucket `i` `i + 1` entries below the control bytes).
#[inline(always)]
fn change<K: Hash + Eq, V>(
    table: &mut HashTable<(K, V)>,
    hash: u64,
    key: K,
    value: Option<V>,
) -> Option<(*const u8, usize)> {
    let Some(value) = value else {
        if let Ok(o) = table.find_entry(hash, |(k, _)| *k == key) {
            o.remove();
        }
        return None;
    };
    let put = match table.entry(hash, |(k, _)| *k == key, |(k, _)| hash_of(k)) {
        hash_table::Entry::Occupied(mut o) => {
            o.get_mut().1 = value;
            return None;
        }
        hash_table::Entry::Vacant(v) => v.insert((key, value)),
    };
    let (at, entry): (usize, *const (K, V)) = (put.bucket_index(), put.get());
    Some((entry.wrapping_add(at + 1).cast::<u8>(), table.num_buckets()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The buckets of the heap backend's map after reserving room for `entries` (hashbrown's
    /// rule: room for 7/8 of the buckets, a power of two).
    fn heap_buckets(entries: u64) -> u64 {
        if entries < 8 {
            return if entries < 4 { 4 } else { 8 };
        }
        (entries.saturating_mul(8) / 7).next_power_of_two()
    }

    /// Hashes sorted in window order come shard after shard and, for a table of any size from
    /// 2^12 to 2^24 buckets, window after window of it: each window's hashes together, the
    /// windows in the order [`window_position`] gives, which is the window's index with its
    /// bits reversed (so every window is visited once).
    #[test]
    fn hashes_in_window_order_lie_window_after_window_for_every_table_size() {
        let mut hashes: Vec<u64> = (0..200_000u64).map(|i| hash_of(&i)).collect();
        hashes.extend((0..64u64).map(|s| s << SHARD_SHIFT));
        hashes.sort_by_key(|&h| window_order(h));
        assert!(hashes.windows(2).all(|w| shard_of(w[0]) <= shard_of(w[1])), "shard after shard");
        assert!(hashes.iter().all(|&h| shard_in_order(window_order(h)) == shard_of(h)));
        for window_bits in 0..=12u32 {
            let buckets = WINDOW_BUCKETS << window_bits;
            for shard in [0, 17, SHARDS - 1] {
                let of_shard: Vec<u64> = hashes.iter().copied().filter(|&h| shard_of(h) == shard).collect();
                let mut seen = std::collections::HashSet::new();
                let mut last = (0, None);
                for &h in &of_shard {
                    let window = (h as usize & (buckets - 1)) >> WINDOW_LOW_BITS;
                    let position = window_position(h, window_bits);
                    let reversed =
                        if window_bits == 0 { 0 } else { window.reverse_bits() >> (usize::BITS - window_bits) };
                    assert_eq!(position, reversed, "window {window} of {buckets} buckets");
                    assert_eq!(window_at(position, window_bits), window, "position {position}");
                    assert!(position >= last.0, "{buckets} buckets: position {position} after {}", last.0);
                    if last.1 != Some(window) {
                        assert!(seen.insert(window), "{buckets} buckets: window {window} twice");
                    }
                    last = (position, Some(window));
                }
            }
        }
    }

    /// The table bytes a restore faults in before it knows the map's types are the bytes of
    /// every table the map then reserves (of a megabyte or more), page by page, for slots of
    /// 16, 24 and 40 bytes; carved from memory faulted in, the tables fill, hold and free their
    /// entries like any, what is left over is too small for the next table, and a map whose
    /// tables do not fit takes the rest from the allocator.
    #[test]
    #[cfg(target_os = "linux")]
    fn restored_table_bytes_are_the_tables_a_restore_reserves_and_carves() {
        fn reserved<K: Hash + Eq, V>(entries: u64) -> u64 {
            let mut map: ShardedMap<K, V> = ShardedMap::default();
            for shard in map.shards.iter_mut() {
                shard.reserve(restored_capacity(entries) as usize, |(k, _)| hash_of(k));
            }
            let tables = map.shards.iter().map(HashTable::allocation_size);
            tables
                .filter(|&len| len >= crate::malloc::CARVED_FROM_BYTES)
                .map(|len| len.next_multiple_of(4096) as u64)
                .sum()
        }
        for entries in [0, 1_000, 30_000, 300_000, 1_000_000, 3_000_000, 9_000_000] {
            assert_eq!(restored_table_bytes(entries, 16), reserved::<u64, u64>(entries), "{entries} of 16 bytes");
            assert_eq!(restored_table_bytes(entries, 24), reserved::<u64, [u64; 2]>(entries), "{entries} of 24");
            assert_eq!(restored_table_bytes(entries, 40), reserved::<u64, [u64; 4]>(entries), "{entries} of 40");
        }
        assert!(restored_table_bytes(3_000_000, 24) > 64 << 20, "a real size");

        let n = 3_000_000u64;
        let faulted = crate::malloc::PrefaultedTables::start(restored_table_bytes(n, 16) + 4096, 2).unwrap();
        let mut map: ShardedMap<u64, u64> = ShardedMap::default();
        map.reserve_prefaulted(n as usize, Some(&faulted));
        assert_eq!(faulted.carved_bytes() as u64, restored_table_bytes(n, 16), "every table carved");
        for k in 0..n {
            assert_eq!(map.insert_hashed(hash_of(&k), k, k + 1), None);
        }
        assert!((0..n).step_by(997).all(|k| map.get(&k) == Some(&(k + 1))), "carved tables hold their entries");
        // Another map's tables no longer fit: the allocator's.
        let mut other: ShardedMap<u64, u64> = ShardedMap::default();
        other.reserve_prefaulted(n as usize, Some(&faulted));
        assert_eq!(faulted.carved_bytes() as u64, restored_table_bytes(n, 16), "no more fits");
        other.insert_hashed(hash_of(&1), 1, 2);
        drop(faulted);
        assert_eq!(other.get(&1), Some(&2));
        // Grown past its reservation, each carved table is freed (unmapped) for a larger one.
        for k in n..3 * n {
            map.insert_hashed(hash_of(&k), k, k + 1);
        }
        assert!((0..3 * n).step_by(991).all(|k| map.get(&k) == Some(&(k + 1))), "after growing");
    }

    /// A map reserved for a restore takes its entries without a shard growing, in the fewest
    /// buckets its share needs; after it, a shard grows at its next new key
    /// when it holds more than its growth point, and only then.
    #[test]
    fn a_restored_map_fills_its_share_and_its_shards_grow_later_one_by_one() {
        // 6,562 keys a shard, each in 8,192 buckets (room for 7,168): above the growth points
        // of the first shards, below the last ones'.
        let n = 420_000u64;
        let mut map: ShardedMap<u64, u64> = ShardedMap::default();
        map.reserve_prefaulted(n as usize, None);
        let reserved: Vec<usize> = map.shards.iter().map(HashTable::capacity).collect();
        for k in 0..n {
            assert_eq!(map.insert_hashed(hash_of(&k), k, k), None);
        }
        assert_eq!(map.insert_hashed(hash_of(&7), 7, 8), Some(7), "a later entry of a key replaces it");
        assert_eq!(map.len(), n as usize);
        assert_eq!(map.shards.iter().map(HashTable::capacity).collect::<Vec<_>>(), reserved, "no shard grew");
        let fewest = heap_buckets(restored_capacity(n));
        assert!(
            map.shards.iter().all(|s| s.num_buckets() == fewest as usize),
            "each shard the buckets its share needs"
        );

        let (mut next, mut grown) = (n, 0);
        for index in 0..SHARDS {
            let (held, capacity) = (map.shards[index].len(), map.shards[index].capacity());
            while shard_of(hash_of(&next)) != index {
                next += 1;
            }
            map.insert(next, next);
            next += 1;
            let grew = map.shards[index].capacity() > capacity;
            assert_eq!(grew, held >= grows_at(index, capacity), "shard {index}: {held} of {capacity}");
            grown += usize::from(grew);
        }
        assert!((1..SHARDS).contains(&grown), "{grown} shards grew");
    }

    /// The control bytes' address [`ShardedMap::prefetch_probes`] takes from a shard's first
    /// full bucket gives every key's bucket where the key is (hashbrown's layout), and the
    /// probe's first bucket is where most keys are. If hashbrown laid its buckets out
    /// otherwise, the prefetches would go to waste: this says so.
    #[test]
    fn probe_prefetches_address_the_buckets_keys_are_in() {
        let mut map: ShardedMap<u64, [u64; 7]> = ShardedMap::default();
        let keys: Vec<u64> = (0..200_000u64).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x77).collect();
        for &k in &keys {
            map.insert(k, [k; 7]);
        }
        let mut at_probe_start = 0;
        for &k in &keys {
            let hash = hash_of(&k);
            let index = shard_of(hash);
            let (control, buckets) = map.control_bytes_of(index).unwrap();
            let shard = &map.shards[index];
            let bucket = shard.find_bucket_index(hash, |(key, _)| *key == k).unwrap();
            let entry: *const (u64, [u64; 7]) = shard.get_bucket(bucket).unwrap();
            assert_eq!(control.cast::<(u64, [u64; 7])>().wrapping_sub(bucket + 1), entry, "key {k}");
            if bucket == (hash as usize) & (buckets - 1) {
                at_probe_start += 1;
            }
        }
        assert!(at_probe_start * 2 > keys.len(), "{at_probe_start} of {} keys at their probe's start", keys.len());
        // Prefetching a batch of hashes, present or not, changes nothing.
        map.prefetch_probes(&keys.iter().map(hash_of).chain((0..1000).map(|i| hash_of(&i))).collect::<Vec<_>>());
        assert_eq!(map.len(), keys.len());
    }

    /// Between two doublings of the state, the shards grow spread over the last third of the
    /// way, not one after another at its end.
    #[test]
    fn shards_grow_at_different_times() {
        let mut map: ShardedMap<u64, ()> = ShardedMap::default();
        let capacities = |m: &ShardedMap<u64, ()>| m.shards.iter().map(HashTable::capacity).collect::<Vec<_>>();
        let mut before = capacities(&map);
        // The total at which each growth happened, once the shards hold a few thousand keys.
        let mut growths = Vec::new();
        for i in 0..(SHARDS as u64 * 8192) {
            map.insert(i.wrapping_mul(0x9e37_79b9_7f4a_7c15), ());
            let now = capacities(&map);
            if now != before {
                if map.len() > SHARDS * 2048 {
                    growths.extend(std::iter::repeat_n(
                        map.len(),
                        now.iter().zip(&before).filter(|(a, b)| a != b).count(),
                    ));
                }
                before = now;
            }
        }
        assert!(growths.len() >= SHARDS, "every shard grew once past 2048 keys each: {}", growths.len());
        // The largest share of growths within any span of a sixteenth of the state.
        let crowded =
            growths.iter().map(|&at| growths.iter().filter(|&&g| g >= at && g < at + at / 16).count()).max().unwrap();
        assert!(crowded <= SHARDS / 4, "{crowded} of {} growths within a sixteenth of the state", growths.len());
        assert!(map.shards.iter().all(|s| s.len() <= s.capacity()));
    }

    /// The shards together behave as one map, and keys spread over every shard.
    /// Threads that change the map at once, each its own keys, leave what one thread leaves,
    /// whether the keys come in the map's order (a lock per shard) or not (a lock per entry,
    /// and entries handed back while another thread holds their shard).
    #[test]
    fn threads_filling_at_once_leave_what_one_thread_leaves() {
        for in_map_order in [true, false] {
            let mut map: ShardedMap<u64, u64> = ShardedMap::default();
            let mut model = std::collections::BTreeMap::new();
            for k in 0..3_000u64 {
                map.insert(k, 1);
                model.insert(k, 1);
            }
            // Each key once: the first thousand removed, the next two replaced, the rest new.
            let mut changes: Vec<(u64, Option<u64>)> =
                (0..60_000u64).map(|k| (k, if k < 1_000 { None } else { Some(k * 3) })).collect();
            if in_map_order {
                changes.sort_by_key(|(k, _)| window_order(hash_of(k)));
            } else {
                changes.sort_by_key(|(k, _)| k.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            }
            for (k, v) in &changes {
                match v {
                    Some(v) => model.insert(*k, *v),
                    None => model.remove(k),
                };
            }
            let handed_back = map.fill_concurrently(|fill| {
                std::thread::scope(|scope| {
                    let threads: Vec<_> = changes
                        .chunks(changes.len() / 4)
                        .map(|part| {
                            scope.spawn(move || {
                                let mut filler = fill.filler();
                                let mut later = Vec::new();
                                for &(k, v) in part {
                                    if let Err(back) = filler.try_apply(hash_of(&k), k, v) {
                                        later.push(back);
                                    }
                                }
                                let handed_back = later.len();
                                for (hash, k, v) in later {
                                    filler.apply(hash, k, v);
                                }
                                handed_back
                            })
                        })
                        .collect();
                    threads.into_iter().map(|t| t.join().unwrap()).sum::<usize>()
                })
            });
            assert_eq!(map.len(), model.len(), "in map order: {in_map_order}");
            assert_eq!(map.len(), map.shards.iter().map(HashTable::len).sum::<usize>());
            let mut all: Vec<(u64, u64)> = map.iter().map(|(k, v)| (*k, *v)).collect();
            all.sort_unstable();
            assert_eq!(all, model.into_iter().collect::<Vec<_>>(), "in map order: {in_map_order}");
            eprintln!("in map order: {in_map_order}: {handed_back} changes handed back");
        }
    }

    #[test]
    fn shards_act_as_one_map() {
        let mut map: ShardedMap<u64, u64> = ShardedMap::default();
        let mut model = std::collections::BTreeMap::new();
        for i in 0..20_000u64 {
            let k = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) % 5_000;
            match i % 5 {
                0 => assert_eq!(map.remove(&k), model.remove(&k)),
                1 => match map.entry(k) {
                    MapEntry::Occupied(o) => *o.into_mut() += i,
                    MapEntry::Vacant(v) => {
                        v.insert(i);
                    }
                },
                _ => assert_eq!(map.insert(k, i), model.insert(k, i)),
            }
            if i % 5 == 1 {
                *model.entry(k).or_insert(0) += i;
            }
        }
        assert_eq!(map.len(), model.len());
        assert_eq!(map.len(), map.shards.iter().map(HashTable::len).sum::<usize>());
        let mut all: Vec<(u64, u64)> = map.iter().map(|(k, v)| (*k, *v)).collect();
        all.sort_unstable();
        assert_eq!(all, model.iter().map(|(k, v)| (*k, *v)).collect::<Vec<_>>());
        assert!(map.shards.iter().all(|s| !s.is_empty()), "every shard holds keys");
        map.retain(|k, _| k % 2 == 0);
        assert_eq!(map.len(), model.keys().filter(|k| *k % 2 == 0).count());
        assert!(map.contains_key(&model.keys().copied().find(|k| k % 2 == 0).unwrap()));
        map.reserve_prefaulted(100_000, None);
        assert!(map.shards.iter().all(|s| s.capacity() >= 100_000 / SHARDS), "every shard has its share");
        for (index, shard) in map.shards.iter().enumerate() {
            let share = shard.len() + 100_000 / SHARDS;
            assert!(shard.capacity() >= share, "shard {index} would grow before its share is in");
        }
        assert_eq!(map.iter_mut().count(), map.len());
    }
}
