//! A restored chain of heap state files applied shard by shard instead of file by file.
//!
//! The files of a chain each hold a part of the keys (an increment the keys changed in one
//! interval, an early full image the keys of a smaller state), spread over tables reserved for
//! all of them: applied one file after the other, every insert writes a cache line and a page
//! of its own, and a 20M-key chain of 6 files applied at 0.42–0.46 GB per second where a full
//! image of the same keys applies at 1.18 (`runtime/BENCHMARKS.md`, session 37). The heap
//! backend's files list their entries shard after shard, each shard's in its table's order.
//! Applied shard by shard, each file's entries of the shard in the chain's order, and within a
//! shard window by window (a stable partition of those entries by the top bits of their bucket
//! in the restoring table), all the files fill one window of the table while it is in the
//! caches. Within a window, the entries are applied group of 16 buckets after group (a second
//! stable partition), so that the window fills front to back as a full image in the table's
//! order does: the 20M-key chain applied in 303–326 ms against 342–348 in window order (3
//! alternating runs each, session 39). Every key's entries fall in the same shard, window and
//! group in every file, so each key still sees its changes in the chain's order. Whether a file
//! is in shard order is checked entry by entry as it is applied: one that is not leaves the
//! chain to the file by file restore.
//!
//! Sorting every entry into windows was a third of that apply (session 46). The increments
//! the heap backend writes from its changed keys, and merged images, now list each shard in
//! window order ([`map::window_order`]): for a table of any size, a window's keys lie
//! together in the file, the windows in one order. Such files are read front to back once, a
//! cursor each, window after window, while the others' entries are still sorted into windows;
//! and while a window fills, the next one's memory is fetched ([`LinesAhead`]). The 90M-key
//! chain of a count (26 files, 1.17 GB) applied in 0.83-0.94 s on 2 threads, against 1.89-1.93
//! s sorted (session 47).

use weir_checkpoint::format::{keyed_entries, Decoder};

use super::{map, owns, KeyedState, StateKey, StateSlot, StateValue, StoreError, FILL_AHEAD};

/// Buckets of the restoring table applied together: 4096 of a count's entries (48 bytes then,
/// 40 now) and their control bytes are 200 KB, which the second-level cache holds. Measured
/// on that 20M-key chain: 1024 buckets, 404–442 ms; 4096, 383–392 ms; 16384, 406–409 ms; whole
/// shards, 488–548 ms (file by file: 593–610 ms). Applied group by group within the window
/// (session 39), 16384 buckets measured the same as 4096 (307–315 ms against 308–314). Files
/// in window order ([`map::window_order`]) fix it at 4096.
const WINDOW_BUCKETS: usize = map::WINDOW_BUCKETS;

/// Entries of a body between two whose offsets [`shard_starts`] keeps.
const SAMPLE_EVERY: usize = 64;

/// Where each shard's entries start in `body` (index `s`: the first entry of shard `s` or a
/// later one; index [`map::SHARDS`]: the end), by this map's hash of each entry's key, for a
/// body in shard order. It reads past the entries (their lengths only), keeping every
/// [`SAMPLE_EVERY`]th one's offset, then finds each shard's start among those by a binary
/// search and from the last one before it entry by entry: a few thousand keys decoded, where
/// decoding and hashing every key took 69–86 ms of a 20M-key chain's restore. A body out of
/// shard order gives starts that cut it wrongly, which [`WindowFill::apply`] finds: each
/// entry it takes must be of the shard it takes it for.
fn shard_starts<K: StateKey>(body: &[u8]) -> Result<Vec<usize>, StoreError> {
    let mut samples = Vec::new();
    let mut entries = keyed_entries(body);
    for n in 0.. {
        let at = entries.position();
        let Some(entry) = entries.next() else { break };
        entry?;
        if n % SAMPLE_EVERY == 0 {
            samples.push(at);
        }
    }
    // The shard of the entry at `at` (an entry's start).
    let shard_at = |at: usize| -> Result<usize, StoreError> {
        match keyed_entries(&body[at..]).next() {
            Some(entry) => Ok(K::decode_then(entry?.key, |key| map::shard_of(map::hash_of(&key)))?),
            None => Ok(map::SHARDS),
        }
    };
    let mut starts = Vec::with_capacity(map::SHARDS + 1);
    starts.push(0);
    for shard in 1..map::SHARDS {
        // The first sample of `shard` or later; the shard starts after the sample before it.
        let (mut below, mut above) = (0, samples.len());
        while below < above {
            let mid = (below + above) / 2;
            if shard_at(samples[mid])? < shard {
                below = mid + 1;
            } else {
                above = mid;
            }
        }
        let from = below.checked_sub(1).map_or(0, |i| samples[i]);
        let to = samples.get(below).copied().unwrap_or(body.len());
        let mut start = to;
        let mut entries = keyed_entries(&body[from..to]);
        loop {
            let at = from + entries.position();
            let Some(entry) = entries.next() else { break };
            if K::decode_then(entry?.key, |key| map::shard_of(map::hash_of(&key)))? >= shard {
                start = at;
                break;
            }
        }
        let previous = starts[shard - 1];
        starts.push(start.max(previous));
    }
    starts.push(body.len());
    Ok(starts)
}

/// Where each shard's entries start in each of `files`: as recorded by the writer
/// ([`weir_checkpoint::metadata::FileRef::shard_starts`]) when those fit the body (a start per
/// shard and its end, from 0 to the body's length, in order), else [`shard_starts`] of it, on
/// up to `threads` threads that take the largest bodies first. Recorded starts saved the
/// 20M-key chain's restore the 35–37 ms that 2 threads took to read every entry (session 39).
fn all_shard_starts<K: StateKey>(files: &[ChainFile<'_>], threads: usize) -> Result<Vec<Vec<usize>>, StoreError> {
    let fitting = |file: &ChainFile<'_>| -> Option<Vec<usize>> {
        let starts = file.recorded_starts?;
        let fits = starts.len() == map::SHARDS + 1
            && starts.first() == Some(&0)
            && starts.last() == Some(&(file.body.len() as u64))
            && starts.windows(2).all(|w| w[0] <= w[1]);
        fits.then(|| starts.iter().map(|&at| at as usize).collect())
    };
    let mut starts: Vec<Vec<usize>> = files.iter().map(|f| fitting(f).unwrap_or_default()).collect();
    let mut largest_first: Vec<usize> = (0..files.len()).filter(|&i| starts[i].is_empty()).collect();
    largest_first.sort_by_key(|&i| std::cmp::Reverse(files[i].body.len()));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let work = || -> Result<Vec<(usize, Vec<usize>)>, StoreError> {
        let mut found = Vec::new();
        while let Some(&i) = largest_first.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
            found.push((i, shard_starts::<K>(files[i].body)?));
        }
        Ok(found)
    };
    std::thread::scope(|scope| {
        let others: Vec<_> = (1..threads.min(largest_first.len())).map(|_| scope.spawn(work)).collect();
        let mut result = work();
        for other in others {
            let theirs = other.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            result = result.and_then(|mut mine| {
                theirs.map(|t| {
                    mine.extend(t);
                    mine
                })
            });
        }
        for (i, found) in result? {
            starts[i] = found;
        }
        Ok(starts)
    })
}

/// The shards a chain's apply threads take ([`KeyedState::restore_chain_by_shard`]): each
/// thread a range of its own, from its first shard up, and once its range is done, the last
/// shard of the range with the most left. With a range each and nothing more, a thread slowed
/// by anything else on its core (the server of the files, memory being unmapped) left the other
/// idle for the last 0.2-0.3 s of the 90M-key chain's apply. Shards taken one by one from a
/// common counter instead (threads on neighbouring shards) applied it in 1.3-1.7 s instead of
/// 0.8-0.9 s from MinIO (5 alternating runs; `perf`: the apply's own loop slower).
struct ShardRanges {
    ranges: Vec<std::sync::Mutex<std::ops::Range<usize>>>,
}

impl ShardRanges {
    /// [`map::SHARDS`] split into `threads` ranges.
    fn new(threads: usize) -> Self {
        let per_thread = map::SHARDS.div_ceil(threads);
        let ranges = (0..threads)
            .map(|t| std::sync::Mutex::new((t * per_thread).min(map::SHARDS)..((t + 1) * per_thread).min(map::SHARDS)))
            .collect();
        ShardRanges { ranges }
    }

    /// The next shard for thread `thread`; `None` once every shard is taken.
    fn take(&self, thread: usize) -> Option<usize> {
        loop {
            if let Some(shard) = self.range(thread).next() {
                return Some(shard);
            }
            let (most, _) = (0..self.ranges.len())
                .map(|i| (i, self.range(i).len()))
                .filter(|&(_, left)| left > 0)
                .max_by_key(|&(_, left)| left)?;
            if let Some(shard) = self.range(most).next_back() {
                return Some(shard);
            }
        }
    }

    /// Range `i`, locked (a thread that panicked holding it left it whole).
    fn range(&self, i: usize) -> std::sync::MutexGuard<'_, std::ops::Range<usize>> {
        self.ranges[i].lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A file of a restored chain, as [`KeyedState::restore_chain_by_shard`] takes it.
pub struct ChainFile<'a> {
    /// Its entries: the body of the state file.
    pub body: &'a [u8],
    /// Where its writer says each shard's entries start, and where the last one ends
    /// ([`weir_checkpoint::metadata::FileRef::shard_starts`]), if it says.
    pub recorded_starts: Option<&'a [u64]>,
    /// Its writer says each shard's entries are in window order
    /// ([`weir_checkpoint::metadata::FileRef::in_window_order`]).
    pub in_window_order: bool,
}

impl<V: StateValue, K: StateKey> KeyedState<V, K> {
    /// Applies `files`, a restored chain's files in order (each listing each key's put once
    /// and no deletions: [`super::KeyedSnapshot::puts_from`] of 0), shard by shard, keeping
    /// only key groups in `key_groups`; false, with the map emptied again (its room kept), when
    /// they are not all in shard order, a start a file's writer recorded is not where its shard
    /// starts, or a file said to be in window order is not (then apply them file by file). On
    /// the heap backend only, into a map that reserved room for the chain's keys first
    /// ([`Self::reserve_restored_entries`]): its shards' buckets decide the windows. A thread
    /// per core finds the shard starts the files do not come with ([`all_shard_starts`]), then
    /// a thread per core applies a range of shards, and then the last shards of the others'
    /// ([`ShardRanges`]).
    pub fn restore_chain_by_shard(
        &mut self,
        files: &[ChainFile<'_>],
        key_groups: (u32, u32),
    ) -> Result<bool, StoreError> {
        // Entries are found by 32-bit offsets into a shard's part of a file.
        if self.spill.is_some()
            || V::only_value().is_some()
            || files.iter().any(|f| u32::try_from(f.body.len()).is_err())
        {
            return Ok(false);
        }
        let started = std::time::Instant::now();
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        let threads = cores.clamp(1, map::SHARDS);
        let starts = all_shard_starts::<K>(files, threads)?;
        let starts_found = started.elapsed();
        let buckets: Vec<usize> = (0..map::SHARDS).map(|shard| self.map.shard_buckets(shard)).collect();
        let in_window_order: Vec<bool> = files.iter().map(|f| f.in_window_order).collect();
        let (starts, buckets, in_window_order) = (&starts, &buckets, &in_window_order);
        let shards = ShardRanges::new(threads);
        let in_order = self.map.fill_concurrently(|fill| {
            // Whether every entry a thread took was of the shard it took it for.
            let apply = |thread: usize| -> Result<bool, StoreError> {
                let mut window = WindowFill::default();
                let mut filler = fill.filler();
                let mut parts = Vec::with_capacity(files.len());
                while let Some(shard) = shards.take(thread) {
                    parts.clear();
                    parts.extend(
                        files.iter().zip(starts).map(|(file, starts)| &file.body[starts[shard]..starts[shard + 1]]),
                    );
                    let shard_fill =
                        ShardFill { parts: &parts, in_window_order, shard, buckets: buckets[shard], key_groups };
                    if !window.apply::<K, V>(&mut filler, &shard_fill)? {
                        return Ok(false);
                    }
                }
                Ok(true)
            };
            let apply = &apply;
            std::thread::scope(|scope| {
                let others: Vec<_> = (1..threads).map(|t| scope.spawn(move || apply(t))).collect();
                let mut result = apply(0);
                for other in others {
                    let theirs = other.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
                    result = result.and_then(|mine| Ok(mine & theirs?));
                }
                result
            })
        })?;
        if !in_order {
            // Some of the chain is in the map, some not: it starts over, file by file, in the
            // room it made.
            self.map.clear();
            return Ok(false);
        }
        tracing::debug!(
            files = files.len(),
            in_window_order = in_window_order.iter().filter(|&&w| w).count(),
            threads,
            starts_ms = starts_found.as_millis() as u64,
            apply_ms = (started.elapsed() - starts_found).as_millis() as u64,
            "restored chain applied shard by shard"
        );
        Ok(true)
    }
}

/// One shard's entries from every file of a chain, put in window order ([`WINDOW_BUCKETS`]) by
/// reference: the buffers serve the next shard.
///
/// An entry is decoded where it is applied. Decoded into a buffer first (its hash, key and
/// value: 64 bytes), a shard's entries were 20 MB per thread at 20M keys, more than the caches
/// hold with two threads: the 20M-key chain applied in 402–437 ms (one run 483), against
/// 363–384 ms with 16-byte references and each entry decoded again (6 alternating runs).
#[derive(Default)]
struct WindowFill {
    /// The shard's entries in the chain's order: hash, file and offset in the file's part.
    found: Vec<EntryRef>,
    /// Where each window's entries end in `ordered`.
    window_ends: Vec<u32>,
    /// `found`, window after window, each window's in the chain's order.
    ordered: Vec<EntryRef>,
    /// Where each group of buckets of a window ends in `in_window` ([`group_in_window`]).
    group_ends: Vec<u32>,
    /// One window's entries of `ordered`, group of buckets after group, each group's in the
    /// chain's order.
    in_window: Vec<EntryRef>,
    /// (files in window order) Where each part's entries not yet applied start.
    cursors: Vec<usize>,
    /// (files in window order) The memory of the next window to fill, fetched a line per
    /// entry applied in this one.
    ahead: LinesAhead,
}

/// Cache lines of memory that a restore asks the CPU to fetch one at a time
/// ([`LinesAhead::fetch_one`]): the next window's control bytes and entries while a window
/// fills. A window's entries are applied in no particular order within it: its 1,600 lines
/// (4096 buckets of 24 bytes and their control bytes) were each missed at their first write,
/// and the 90M-key chain's inserts took 0.75 s of each thread's 1.3-1.4 s (decoding alone:
/// 0.62-0.66 s).
#[derive(Default)]
struct LinesAhead {
    /// The ranges (address, bytes) still to fetch, the current one first.
    ranges: [(usize, usize); 2],
}

impl LinesAhead {
    /// The lines of `ranges` (address and length) from their first.
    fn of(ranges: [(*const u8, usize); 2]) -> Self {
        LinesAhead { ranges: ranges.map(|(at, len)| (at as usize, len)) }
    }

    /// Asks the CPU for the next line, if any is left.
    #[inline(always)]
    fn fetch_one(&mut self) {
        if self.ranges[0].1 == 0 {
            if self.ranges[1].1 == 0 {
                return;
            }
            self.ranges = [self.ranges[1], (0, 0)];
        }
        let (at, len) = &mut self.ranges[0];
        crate::prefetch::for_read(*at as *const u8);
        let step = 64 - (*at % 64);
        *at += step;
        *len = len.saturating_sub(step);
    }
}

/// What [`WindowFill::apply`] applies: a shard's entries in each file of a chain.
struct ShardFill<'p, 'b> {
    /// The shard's entries in each file, in the chain's order.
    parts: &'p [&'b [u8]],
    /// Whether each file is in window order ([`map::window_order`]).
    in_window_order: &'p [bool],
    /// The shard.
    shard: usize,
    /// Its table's buckets.
    buckets: usize,
    /// The key groups restored; entries of others are left out.
    key_groups: (u32, u32),
}

/// Where an entry of a file in window order falls against the window being filled.
enum Placed {
    /// In it: applied.
    Applied,
    /// In a later window: the window's entries of this file end here.
    Later,
    /// In an earlier window or another shard: the file is not in window order.
    OutOfOrder,
}

/// Buckets of a group that [`WindowFill`] applies in no particular order (hashbrown probes
/// 16 control bytes at once).
const GROUP_BUCKETS: usize = 16;

/// The group of buckets of a key of `hash` in its window, in a table of `mask + 1` buckets.
#[inline(always)]
fn group_in_window(hash: u64, mask: usize) -> usize {
    ((hash as usize & mask) / GROUP_BUCKETS) % (WINDOW_BUCKETS / GROUP_BUCKETS)
}

/// `from`'s references into `into`, part after part by `part_of` their hash (below `parts`),
/// each part's in `from`'s order (a counting sort); then `ends[p]` is where part `p` ends.
fn partition_stably(
    from: &[EntryRef],
    into: &mut Vec<EntryRef>,
    ends: &mut Vec<u32>,
    parts: usize,
    part_of: impl Fn(u64) -> usize,
) {
    ends.clear();
    ends.resize(parts + 1, 0);
    for e in from {
        ends[part_of(e.hash) + 1] += 1;
    }
    for p in 1..=parts {
        ends[p] += ends[p - 1];
    }
    into.clear();
    into.resize(from.len(), EntryRef::default());
    for e in from {
        let at = &mut ends[part_of(e.hash)];
        into[*at as usize] = *e;
        *at += 1;
    }
}

/// Where an entry of a shard is: its key's hash, its file (index into the parts), and its
/// offset in the file's part of the shard.
#[derive(Clone, Copy, Default)]
struct EntryRef {
    hash: u64,
    part: u32,
    offset: u32,
}

impl WindowFill {
    /// Applies a shard's entries from every file of the chain to the shard, window by window.
    /// False, having applied some of them perhaps, when one of them holds an entry of another
    /// shard, or a file said to be in window order is not.
    fn apply<K: StateKey, V: StateValue>(
        &mut self,
        filler: &mut map::Filler<'_, '_, K, V::Slot>,
        fill: &ShardFill<'_, '_>,
    ) -> Result<bool, StoreError> {
        if fill.in_window_order.iter().any(|&w| w) {
            self.apply_reading_in_window_order::<K, V>(filler, fill)
        } else {
            self.apply_sorted::<K, V>(filler, fill)
        }
    }

    /// The references of the entries of `fill`'s files not in window order (or of all of
    /// them, `all`), in the chain's order, into `found`. False when one does not decode or is
    /// of another shard.
    fn find_entries<K: StateKey>(&mut self, fill: &ShardFill<'_, '_>, all: bool) -> bool {
        self.found.clear();
        for (index, part) in fill.parts.iter().enumerate() {
            if !all && fill.in_window_order[index] {
                continue;
            }
            let mut entries = keyed_entries(part);
            loop {
                let offset = entries.position();
                let Some(entry) = entries.next() else { break };
                // A part that does not read as entries of this shard was cut where no shard
                // starts (a writer's wrong start): the file by file restore reads the files
                // whole, and says what is malformed in them if anything is.
                let Ok(entry) = entry else { return false };
                if !owns(fill.key_groups, entry.key_group) {
                    continue;
                }
                let Ok(hash) = K::decode_then(entry.key, |key| map::hash_of(&key)) else { return false };
                if map::shard_of(hash) != fill.shard {
                    return false;
                }
                self.found.push(EntryRef { hash, part: index as u32, offset: offset as u32 });
            }
        }
        true
    }

    /// Applies the shard's entries window by window, the windows in the order of
    /// [`map::window_position`]: within each window, file after file in the chain's order, a
    /// file in window order from where its previous window ended up to its first entry of a
    /// later window, another one's entries of the window (sorted into windows first). Each
    /// entry is applied while its window is filled and each key's entries in the chain's order,
    /// whatever the files' order: an entry of a file in window order found in an earlier
    /// window than the one filled, or of another shard, stops the restore (false).
    ///
    /// The 90M-key chain of a count (32 files, 1.17 GB) applied in 1.97-2.0 s on 2 threads
    /// sorted ([`Self::apply_sorted`]): per thread, decoding and hashing every entry 0.39-0.54
    /// s, the partition into windows 0.40-0.45, into groups 0.17-0.20, decoding again and
    /// inserting 0.70-0.75. Written in window order (26 files, 1.17 GB), it applied in
    /// 1.26-1.56 s read this way, 0.83-0.94 s with the next window fetched ahead; decoding
    /// alone took 0.62-0.66 s.
    fn apply_reading_in_window_order<K: StateKey, V: StateValue>(
        &mut self,
        filler: &mut map::Filler<'_, '_, K, V::Slot>,
        fill: &ShardFill<'_, '_>,
    ) -> Result<bool, StoreError> {
        let window_bits = (fill.buckets.max(WINDOW_BUCKETS) / WINDOW_BUCKETS).trailing_zeros();
        let windows = 1usize << window_bits;
        if !self.find_entries::<K>(fill, false) {
            return Ok(false);
        }
        let position_of = |hash: u64| map::window_position(hash, window_bits);
        partition_stably(&self.found, &mut self.ordered, &mut self.window_ends, windows, position_of);
        self.cursors.clear();
        self.cursors.resize(fill.parts.len(), 0);
        let mut taken = 0;
        for position in 0..windows {
            let end = self.window_ends[position] as usize;
            let next = map::window_at(position + 1, window_bits) * WINDOW_BUCKETS;
            self.ahead = match filler.memory_of(fill.shard, next..next + WINDOW_BUCKETS) {
                Some(memory) if position + 1 < windows => LinesAhead::of(memory),
                _ => LinesAhead::default(),
            };
            for (index, part) in fill.parts.iter().enumerate() {
                if fill.in_window_order[index] {
                    if !self.apply_window_of_part::<K, V>(filler, fill, index, position, window_bits)? {
                        return Ok(false);
                    }
                    continue;
                }
                while let Some(at) = self.ordered[taken..end].first().filter(|at| at.part as usize == index) {
                    apply_entry::<K, V>(filler, part, at)?;
                    self.ahead.fetch_one();
                    taken += 1;
                }
            }
        }
        // Every window filled, so every entry of every part taken.
        let read_whole = (fill.parts.iter().zip(&self.cursors).zip(fill.in_window_order))
            .all(|((part, &at), &in_window_order)| !in_window_order || at == part.len());
        Ok(read_whole && taken == self.ordered.len())
    }

    /// Applies file `index`'s entries of the window at `position`, from its cursor up to its
    /// first entry of a later window, where the cursor then stays. False when an entry is of an
    /// earlier window or another shard, or does not decode (the file is not in window order).
    #[inline]
    fn apply_window_of_part<K: StateKey, V: StateValue>(
        &mut self,
        filler: &mut map::Filler<'_, '_, K, V::Slot>,
        fill: &ShardFill<'_, '_>,
        index: usize,
        position: usize,
        window_bits: u32,
    ) -> Result<bool, StoreError> {
        let part = fill.parts[index];
        let from = self.cursors[index];
        let mut entries = keyed_entries(&part[from..]);
        loop {
            let at = entries.position();
            let Some(entry) = entries.next() else {
                self.cursors[index] = part.len();
                return Ok(true);
            };
            let Ok(entry) = entry else { return Ok(false) };
            // Entries of key groups not restored are passed over wherever they are.
            if !owns(fill.key_groups, entry.key_group) {
                continue;
            }
            // Files of puts only (the caller's promise): a deletion here is a malformed file.
            let Some(raw) = entry.value else {
                return Err(StoreError::Decode(weir_checkpoint::format::FormatError::Malformed(from + at)));
            };
            let key_group = entry.key_group;
            // The value is decoded once the entry is known to be of this window (the first
            // entry of the next one is read again then), and its slot made where it is put.
            let placed = K::decode_then(
                entry.key,
                #[inline(always)]
                |key| {
                    let hash = map::hash_of(&key);
                    let found = map::window_position(hash, window_bits);
                    if map::shard_of(hash) != fill.shard || found < position {
                        return Ok(Placed::OutOfOrder);
                    }
                    if found > position {
                        return Ok(Placed::Later);
                    }
                    let value = V::decode(&mut Decoder::new(raw))?;
                    filler.apply(hash, key, Some(V::Slot::restored(value, key_group)));
                    Ok(Placed::Applied)
                },
            );
            match placed {
                Ok(Ok(Placed::Applied)) => self.ahead.fetch_one(),
                Ok(Ok(Placed::Later)) => {
                    self.cursors[index] = from + at;
                    return Ok(true);
                }
                // A value that does not decode is a malformed file, whatever the order.
                Ok(Err(e)) => return Err(StoreError::Decode(e)),
                Ok(Ok(Placed::OutOfOrder)) | Err(_) => return Ok(false),
            }
        }
    }

    /// Applies the shard's entries with every file sorted into windows (none in window
    /// order): window by window, and within each window group of buckets by group.
    fn apply_sorted<K: StateKey, V: StateValue>(
        &mut self,
        filler: &mut map::Filler<'_, '_, K, V::Slot>,
        fill: &ShardFill<'_, '_>,
    ) -> Result<bool, StoreError> {
        let mask = fill.buckets.max(1) - 1;
        let shift = WINDOW_BUCKETS.trailing_zeros();
        if !self.find_entries::<K>(fill, true) {
            return Ok(false);
        }
        // Window by window, then within each window group by group; each in the chain's order.
        let windows = (fill.buckets >> shift).max(1);
        let window_of = |hash: u64| ((hash as usize) & mask) >> shift;
        partition_stably(&self.found, &mut self.ordered, &mut self.window_ends, windows, window_of);
        let mut from = 0;
        for w in 0..windows {
            let to = self.window_ends[w] as usize;
            let group_of = |hash: u64| group_in_window(hash, mask);
            let groups = WINDOW_BUCKETS / GROUP_BUCKETS;
            partition_stably(&self.ordered[from..to], &mut self.in_window, &mut self.group_ends, groups, group_of);
            from = to;
            self.apply_in_order::<K, V>(filler, fill.parts)?;
        }
        Ok(true)
    }

    /// Applies the entries of `in_window`, in their order.
    fn apply_in_order<K: StateKey, V: StateValue>(
        &self,
        filler: &mut map::Filler<'_, '_, K, V::Slot>,
        parts: &[&[u8]],
    ) -> Result<(), StoreError> {
        for (n, at) in self.in_window.iter().enumerate() {
            if let Some(ahead) = self.in_window.get(n + FILL_AHEAD) {
                filler.prefetch(ahead.hash);
            }
            apply_entry::<K, V>(filler, parts[at.part as usize], at)?;
        }
        Ok(())
    }
}

/// Applies the entry `at` of `part`.
#[inline(always)]
fn apply_entry<K: StateKey, V: StateValue>(
    filler: &mut map::Filler<'_, '_, K, V::Slot>,
    part: &[u8],
    at: &EntryRef,
) -> Result<(), StoreError> {
    let Some(entry) = keyed_entries(&part[at.offset as usize..]).next() else {
        return Err(StoreError::Decode(weir_checkpoint::format::FormatError::Malformed(at.offset as usize)));
    };
    let entry = entry?;
    // Files of puts only (the caller's promise): a deletion here is a malformed file.
    let Some(raw) = entry.value else {
        return Err(StoreError::Decode(weir_checkpoint::format::FormatError::Malformed(at.offset as usize)));
    };
    // The slot is made inside the closure: made outside, it was read back from memory by a
    // load that waited for the writes that made it (`perf`: a quarter of the apply's samples).
    // The closure is inlined (256–259 ms against 263–268 for the 20M-key chain); the key's
    // first copy still waits on its decoding's writes, its tag and its number written apart
    // and read as one (a sixth of the samples).
    let (value, key_group) = (V::decode(&mut Decoder::new(raw))?, entry.key_group);
    K::decode_then(
        entry.key,
        #[inline(always)]
        |key| filler.apply(at.hash, key, Some(V::Slot::restored(value, key_group))),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::value::{Key, Value};
    use weir_checkpoint::format::{open, FileKind, StateFileWriter};

    fn key(i: i64) -> Key {
        Key::One(Value::Int(i))
    }

    /// A chain's files, where each file's writer says each shard's entries start, and whether
    /// it says they are in window order.
    struct Chain {
        files: Vec<bytes::Bytes>,
        recorded: Vec<Vec<u64>>,
        in_window_order: Vec<bool>,
    }

    impl Chain {
        fn recorded(&self) -> Vec<Option<&[u64]>> {
            self.recorded.iter().map(|r| Some(r.as_slice())).collect()
        }

        /// The files as a restore takes them, with `starts` and the order their writers said.
        fn restored<'a>(&'a self, starts: &[Option<&'a [u64]>]) -> Vec<ChainFile<'a>> {
            let bodies = bodies(&self.files);
            (bodies.into_iter().zip(starts).zip(&self.in_window_order))
                .map(|((body, &recorded_starts), &in_window_order)| ChainFile {
                    body,
                    recorded_starts,
                    in_window_order,
                })
                .collect()
        }
    }

    /// The files of a running sum over 5 rounds of 120K new keys each, every third key
    /// changed again in each later round, so that the files repeat keys with other values,
    /// then a round that changes every hundredth key (an increment written from the list of
    /// changed keys, the others from a scan of the map): a full image, then increments of puts
    /// only. And the keys the state holds at the end.
    /// Every shard is taken once, whatever the threads: a thread alone takes its range, then
    /// the others' from their ends; threads taking at once take each shard once between them.
    #[test]
    fn apply_threads_take_every_shard_once() {
        for threads in [1, 2, 3, 64] {
            let alone = ShardRanges::new(threads);
            let mut taken: Vec<usize> = std::iter::from_fn(|| alone.take(0)).collect();
            let own = map::SHARDS.div_ceil(threads);
            assert_eq!(taken[..own], (0..own).collect::<Vec<_>>()[..], "its own range first, in order");
            taken.sort_unstable();
            assert_eq!(taken, (0..map::SHARDS).collect::<Vec<_>>(), "{threads} threads, one taking");
            let together = ShardRanges::new(threads);
            let mut taken: Vec<usize> = std::thread::scope(|scope| {
                let takers: Vec<_> = (0..threads)
                    .map(|t| {
                        let together = &together;
                        scope.spawn(move || std::iter::from_fn(|| together.take(t)).collect::<Vec<_>>())
                    })
                    .collect();
                takers.into_iter().flat_map(|t| t.join().unwrap()).collect()
            });
            taken.sort_unstable();
            assert_eq!(taken, (0..map::SHARDS).collect::<Vec<_>>(), "{threads} threads taking at once");
        }
        // A thread done with its range takes the last shard of the range with the most left.
        let ranges = ShardRanges::new(2);
        assert_eq!(ranges.take(1), Some(32));
        assert_eq!((0..31).filter_map(|_| ranges.take(1)).collect::<Vec<_>>(), (33..64).collect::<Vec<_>>());
        assert_eq!(ranges.take(1), Some(31), "the other's last");
        assert_eq!(ranges.take(0), Some(0), "the other still takes its own from its first");
    }

    fn growing_chain() -> (Chain, u64) {
        chain_of_rounds(&[(120_000, 3); 5], 100)
    }

    /// The files of a running sum over a round of 300K keys, then 6 rounds of 30K new keys
    /// each, every 20th key changed again in each later round: a full image, then increments
    /// written from the changed keys (in window order), by tables that grow from 8192 buckets
    /// a shard to the restore's 16384.
    fn chain_in_window_order() -> (Chain, u64) {
        let mut rounds = vec![(300_000, 20)];
        rounds.extend([(30_000, 20); 6]);
        chain_of_rounds(&rounds, 20)
    }

    /// The chain of a running sum whose round `r` adds `rounds[r].0` new keys and changes every
    /// `rounds[r].1`th key of the earlier rounds again, then a round that changes every
    /// `last_every`th key, each round checkpointed.
    fn chain_of_rounds(rounds: &[(i64, usize)], last_every: usize) -> (Chain, u64) {
        let mut s = KeyedState::<i64>::new(16, true, 100);
        let mut chain = Chain { files: Vec::new(), recorded: Vec::new(), in_window_order: Vec::new() };
        let mut keys = 0i64;
        for (round, &(new, every)) in rounds.iter().chain([(0, last_every)].iter()).enumerate() {
            for i in (0..keys).step_by(every) {
                *s.update(key(i), || 0).unwrap() += round as i64;
            }
            for i in keys..keys + new {
                *s.update(key(i), || 0).unwrap() += i;
            }
            keys += new;
            let snapshot = s.snapshot_checkpoint().unwrap();
            assert_eq!(snapshot.puts_from, Some(0), "round {round}: puts only");
            let lens = snapshot.shard_bytes.clone().expect("the heap backend's files say where shards start");
            let file = weir_checkpoint::FileRef::new(String::new(), 0, 0).with_shard_bytes(Some(&lens));
            chain.recorded.push(file.shard_starts().unwrap());
            chain.in_window_order.push(snapshot.in_window_order);
            chain.files.push(snapshot.bytes());
        }
        (chain, s.map.len() as u64)
    }

    fn bodies(files: &[bytes::Bytes]) -> Vec<&[u8]> {
        files.iter().map(|f| open(f).unwrap().1).collect()
    }

    /// `files` as a restore takes them, none recorded or in window order.
    fn unsaid(files: &[bytes::Bytes]) -> Vec<ChainFile<'_>> {
        let bodies = bodies(files);
        bodies.into_iter().map(|body| ChainFile { body, recorded_starts: None, in_window_order: false }).collect()
    }

    fn sorted(s: &KeyedState<i64>) -> Vec<(i64, i64)> {
        let mut entries: Vec<(i64, i64)> = s
            .entries()
            .into_iter()
            .map(|(k, v)| match k {
                Key::One(Value::Int(i)) => (i, v),
                other => panic!("key {other:?}"),
            })
            .collect();
        entries.sort_unstable();
        entries
    }

    /// A chain applied shard by shard, window by window, restores what applying it file by
    /// file restores, key-group filtering included: each key ends with its newest value. Its
    /// writer said where each shard starts in each file where reading the file finds it, and
    /// the chain restores the same with the starts recorded or found. A chain of files most of
    /// which are in window order (read front to back) restores the same as when none says so
    /// (sorted into windows), and so does a chain with one such file among the others.
    #[test]
    fn a_chain_applied_by_shard_restores_what_file_by_file_restores() {
        for ((chain, live), increments_of_changed_keys) in [(growing_chain(), 1), (chain_in_window_order(), 7)] {
            let files = &chain.files;
            let in_window_order = chain.in_window_order.iter().filter(|&&w| w).count();
            assert!(files.len() >= 2 && files[0].len() > 1 << 20);
            assert!(!chain.in_window_order[0], "a full image is in its map's order");
            assert_eq!(in_window_order, increments_of_changed_keys, "those are in window order");
            for (body, recorded) in bodies(files).iter().zip(&chain.recorded) {
                let found: Vec<u64> = shard_starts::<Key>(body).unwrap().into_iter().map(|at| at as u64).collect();
                assert_eq!(recorded, &found);
            }
            let cases = [((0, 16), false, true), ((3, 11), false, true), ((0, 16), true, true), ((2, 14), true, true)];
            for (range, recorded, said) in cases.into_iter().chain([((0, 16), true, false), ((1, 12), false, false)]) {
                let case = format!("{in_window_order} in window order, {range:?}, recorded {recorded}, said {said}");
                let mut by_file = KeyedState::<i64>::new(16, true, 100);
                by_file.reserve_restored_entries(live, None);
                for body in bodies(files) {
                    by_file.restore_file(body, range).unwrap();
                }
                let mut by_shard = KeyedState::<i64>::new(16, true, 100);
                by_shard.reserve_restored_entries(live, None);
                let windows = (0..map::SHARDS).map(|s| by_shard.map.shard_buckets(s) / WINDOW_BUCKETS).max().unwrap();
                assert!(windows >= 2, "the shards' entries are applied in {windows} windows");
                let starts = if recorded { chain.recorded() } else { vec![None; files.len()] };
                let mut restored = chain.restored(&starts);
                for file in restored.iter_mut().filter(|_| !said) {
                    file.in_window_order = false;
                }
                assert!(by_shard.restore_chain_by_shard(&restored, range).unwrap(), "{case}");
                let expected = sorted(&by_file);
                assert!(expected.len() as u64 > live / 2, "{case}: {} keys", expected.len());
                assert_eq!(sorted(&by_shard), expected, "{case}");
                assert_eq!(by_shard.cached_len(), expected.len(), "{case}: the map counts its entries");
            }
        }
    }

    /// An increment listing `entries` (keys and encoded values) shard after shard, each shard's
    /// by `order_of` their hash, and where its shards start.
    fn increment_in_order(entries: &[(i64, Vec<u8>)], order_of: impl Fn(u64) -> u64) -> (bytes::Bytes, Vec<u64>) {
        // Shard, place in the shard, index into `entries`.
        let mut ordered: Vec<(usize, u64, usize)> = (entries.iter().enumerate())
            .map(|(n, entry)| {
                let hash = map::hash_of(&key(entry.0));
                (map::shard_of(hash), order_of(hash), n)
            })
            .collect();
        ordered.sort_unstable();
        let mut w = StateFileWriter::new(FileKind::KeyedIncrement, 0);
        let mut lens = vec![0u64; map::SHARDS];
        for (shard, _, n) in ordered {
            let (i, value) = &entries[n];
            let from = w.entries_len();
            w.put_encoded(key(*i).key_group(16), |e| key(*i).encode(e), |e| e.buf.extend_from_slice(value));
            lens[shard] += (w.entries_len() - from) as u64;
        }
        let (data, _) = w.finish();
        let starts = weir_checkpoint::FileRef::new(String::new(), 0, 0).with_shard_bytes(Some(&lens));
        (data, starts.shard_starts().unwrap())
    }

    /// `value` encoded as a state file holds it.
    fn encoded(value: i64) -> Vec<u8> {
        let mut e = weir_checkpoint::format::Encoder::default();
        value.encode(&mut e);
        e.buf
    }

    /// A file in window order made here (every hundredth key of a chain changed again) restores
    /// at the end of the chain what the chain applied file by file restores; the same file with
    /// one value that does not decode fails the restore as a malformed file instead of leaving
    /// it to another way of applying.
    #[test]
    fn a_file_in_window_order_restores_its_values_and_fails_on_one_that_does_not_decode() {
        let (chain, live) = growing_chain();
        let mut changed: Vec<(i64, Vec<u8>)> = Vec::new();
        let mut model = KeyedState::<i64>::new(16, true, 100);
        for body in bodies(&chain.files) {
            model.restore_file(body, (0, 16)).unwrap();
        }
        for (i, v) in sorted(&model) {
            if i % 100 == 7 {
                changed.push((i, encoded(v * 3 + 1)));
            }
        }
        let (good, good_starts) = increment_in_order(&changed, map::window_order);
        let mut broken = changed.clone();
        broken[changed.len() / 2].1.clear();
        let (bad, bad_starts) = increment_in_order(&broken, map::window_order);
        model.restore_file(open(&good).unwrap().1, (0, 16)).unwrap();
        for (data, starts, fails) in [(&good, &good_starts, false), (&bad, &bad_starts, true)] {
            let mut files = chain.files.clone();
            files.push(data.clone());
            let mut recorded = chain.recorded();
            recorded.push(Some(starts.as_slice()));
            let mut restored: Vec<ChainFile<'_>> = (bodies(&files).into_iter().zip(recorded).enumerate())
                .map(|(i, (body, recorded_starts))| ChainFile {
                    body,
                    recorded_starts,
                    in_window_order: chain.in_window_order.get(i).copied().unwrap_or(true),
                })
                .collect();
            assert!(restored.last().unwrap().in_window_order);
            let mut s = KeyedState::<i64>::new(16, true, 100);
            s.reserve_restored_entries(live, None);
            let windows = (0..map::SHARDS).map(|shard| s.map.shard_buckets(shard) / WINDOW_BUCKETS).max().unwrap();
            assert!(windows >= 2, "{windows} windows");
            let result = s.restore_chain_by_shard(&restored, (0, 16));
            if fails {
                assert!(matches!(result, Err(StoreError::Decode(_))), "{:?}", result.map(|_| ()));
            } else {
                assert!(result.unwrap(), "applied shard by shard");
                assert_eq!(sorted(&s), sorted(&model));
            }
            restored.clear();
        }
    }

    /// A file that says it is in window order and is not (a full image in its map's order,
    /// an increment written by a scan, one written in the order of a map's buckets) is found
    /// out as it is read: the map is emptied again, keeping its room, and the chain applied
    /// file by file restores what it holds.
    #[test]
    fn files_said_in_window_order_that_are_not_are_found_out() {
        let (chain, live) = growing_chain();
        let files = &chain.files;
        let mut by_file = KeyedState::<i64>::new(16, true, 100);
        for body in bodies(files) {
            by_file.restore_file(body, (0, 16)).unwrap();
        }
        let expected = sorted(&by_file);
        let recorded = chain.recorded();
        let not_in_window_order: Vec<usize> = (0..files.len()).filter(|&i| !chain.in_window_order[i]).collect();
        assert!(not_in_window_order.len() >= 3, "{not_in_window_order:?}");
        // An increment of the last round's keys in the order of the buckets of a map of 2^16
        // buckets a shard, with the lengths of its shards.
        let last = chain.files.len() - 1;
        let every_hundredth: Vec<(i64, Vec<u8>)> =
            expected.iter().filter(|(i, _)| i % 100 == 0).map(|&(i, v)| (i, encoded(v))).collect();
        let in_bucket_order =
            increment_in_order(&every_hundredth, |hash| ((map::shard_of(hash) as u64) << 32) | (hash & 0xffff));
        // The file said to be in window order, and the file put in its place if any.
        type Case<'a> = (usize, Option<&'a (bytes::Bytes, Vec<u64>)>);
        let mut cases: Vec<Case<'_>> = not_in_window_order.iter().map(|&i| (i, None)).collect();
        cases.push((last, Some(&in_bucket_order)));
        for (n, (file, replaced)) in cases.into_iter().enumerate() {
            let mut files = chain.files.clone();
            let mut starts = recorded.clone();
            if let Some((data, file_starts)) = replaced {
                files[file] = data.clone();
                starts[file] = Some(file_starts.as_slice());
            }
            let mut restored: Vec<ChainFile<'_>> = (bodies(&files).into_iter().zip(&starts).enumerate())
                .map(|(i, (body, &recorded_starts))| ChainFile {
                    body,
                    recorded_starts,
                    in_window_order: chain.in_window_order[i],
                })
                .collect();
            restored[file].in_window_order = true;
            let mut s = KeyedState::<i64>::new(16, true, 100);
            s.reserve_restored_entries(live, None);
            let room = s.map.capacity();
            assert!(!s.restore_chain_by_shard(&restored, (0, 16)).unwrap(), "case {n}: file {file}");
            assert_eq!((s.cached_len(), s.map.capacity()), (0, room), "case {n}: emptied, its room kept");
            for body in bodies(&files) {
                s.restore_file(body, (0, 16)).unwrap();
            }
            assert_eq!(sorted(&s), expected, "case {n}");
        }
    }

    /// Starts recorded wrongly for a file (one byte into an entry, a shard's start moved to
    /// the next one's, a list of another length) never restore other entries: a start that
    /// fits the file but cuts it where no shard starts is found out as its entries are taken,
    /// the map is emptied again, and the chain applied file by file restores what it holds;
    /// one that does not fit is not taken, and the file is read for its starts.
    #[test]
    fn starts_recorded_wrongly_restore_nothing_else() {
        let (chain, live) = growing_chain();
        let files = &chain.files;
        let mut by_file = KeyedState::<i64>::new(16, true, 100);
        for body in bodies(files) {
            by_file.restore_file(body, (0, 16)).unwrap();
        }
        let expected = sorted(&by_file);
        let (into_entry, moved, shorter, longer) = {
            let mut r = [chain.recorded[1].clone(), chain.recorded[1].clone(), chain.recorded[2].clone()];
            r[0][7] += 1;
            r[1][7] = r[1][8];
            let mut longer = chain.recorded[0].clone();
            longer.insert(3, longer[3]);
            (r[0].clone(), r[1].clone(), r[2][..map::SHARDS].to_vec(), longer)
        };
        for (n, (file, wrong, taken)) in
            [(1, into_entry, true), (1, moved, true), (2, shorter, false), (0, longer, false)].into_iter().enumerate()
        {
            let mut starts = chain.recorded();
            starts[file] = Some(&wrong);
            let mut s = KeyedState::<i64>::new(16, true, 100);
            s.reserve_restored_entries(live, None);
            let room = s.map.capacity();
            if taken {
                assert!(!s.restore_chain_by_shard(&chain.restored(&starts), (0, 16)).unwrap(), "case {n}");
                assert_eq!((s.cached_len(), s.map.capacity()), (0, room), "case {n}: emptied, its room kept");
                for body in bodies(files) {
                    s.restore_file(body, (0, 16)).unwrap();
                }
            } else {
                assert!(s.restore_chain_by_shard(&chain.restored(&starts), (0, 16)).unwrap(), "case {n}");
            }
            assert_eq!(sorted(&s), expected, "case {n}");
        }
    }

    /// A file whose entries are not in shard order (written by another hash, or a set's
    /// increment) is found out as its entries are taken: the map is emptied again, keeping its
    /// room, and the chain applied file by file restores what it holds. A set's chain is left
    /// to the file by file restore before anything is done.
    #[test]
    fn files_out_of_shard_order_and_sets_are_left_to_the_file_by_file_restore() {
        let mut w = StateFileWriter::new(FileKind::KeyedIncrement, 0);
        for i in 0..1000i64 {
            w.put_encoded(key(i).key_group(16), |e| key(i).encode(e), |e| (i + 7).encode(e));
        }
        let (file, _) = w.finish();
        let (chain, live) = growing_chain();
        let image = &chain.files[..1];
        let files = [image[0].clone(), file];
        let mut s = KeyedState::<i64>::new(16, true, 100);
        s.reserve_restored_entries(live + 1000, None);
        let room = s.map.capacity();
        assert!(!s.restore_chain_by_shard(&unsaid(&files), (0, 16)).unwrap());
        assert_eq!((s.cached_len(), s.map.capacity()), (0, room), "emptied, its room kept");
        let mut by_file = KeyedState::<i64>::new(16, true, 100);
        for body in bodies(&files) {
            s.restore_file(body, (0, 16)).unwrap();
            by_file.restore_file(body, (0, 16)).unwrap();
        }
        assert_eq!(sorted(&s), sorted(&by_file));
        assert_eq!(s.cached_len(), 120_000, "the first image's keys; the file's are among them");
        let mut set = KeyedState::<()>::new(16, true, 100);
        assert!(!set.restore_chain_by_shard(&unsaid(image), (0, 16)).unwrap());
    }
}
