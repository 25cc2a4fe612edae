//! A restore onto the rocksdb backend that does not wait for its state: the job starts once
//! the increments after the merged image are found (only the start of each is read), and the
//! image's table files come in behind it, the ones that a read waits for first. Increments
//! ordered by key group (as the rocksdb backend writes them) are not read before the job
//! starts: the loader of each range reads the stretch of its key groups of each, from
//! checkpoint storage when the index has checksums (`bulk::StoredIncrement`). Others are
//! copied, read and routed, unsorted, to the ranges below. The job holds its checkpoints
//! until every range is in (`Coordinator::hold_checkpoints`).
//!
//! The key space is cut at the tables' first keys into ranges, one per table
//! ([`Ranges`]). A range is *ready* once its table is in the store and the restored
//! increments' entries of that range are over it; until then no read or write of the store
//! touches it. So a table always goes into a key range the store holds nothing of, and the
//! increments go in after it, newer than it, as a restore that loaded everything first would
//! have them. A read of a key whose range is not ready waits for it, and asks for it to be
//! fetched next ([`Pending::wait_for`]).
//!
//! This module is the pure part: the ranges and the bookkeeping of which are ready. The store
//! fetches and loads them (`store::rocks`); the restore says where the tables are
//! ([`TableSource`], implemented by `crate::restore`).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};

use super::StoreError;

/// Takes one entry (store key, value) of a full image.
pub type EmitEntry<'a> = dyn FnMut(&[u8], &[u8]) -> Result<(), StoreError> + 'a;

/// Where a lazy restore's table files come from (a checkpoint's `store_tables`).
pub trait TableSource: Send + Sync + std::fmt::Debug {
    /// The tables' first store keys, in increasing order (one per table).
    fn first_keys(&self) -> &[Vec<u8>];

    /// Fetches table `i` to a local file and verifies it (length and CRC-32C); blocks.
    fn fetch(&self, i: usize) -> Result<Fetched, String>;

    /// The fallback when table `i` is damaged, missing or refused: calls `emit` with the store
    /// key and value of every entry of the full image the tables stand for whose store key is
    /// in `[start, end)` (`end` `None`: no end). Blocks.
    fn image_entries(&self, start: &[u8], end: Option<&[u8]>, emit: &mut EmitEntry<'_>) -> Result<(), String>;

    /// For logs: where the tables are.
    fn describe(&self) -> String;

    /// Table `i` could not be taken in (damaged, missing or refused), and its range came from
    /// the full image instead: the source tells whoever lists the tables again (a continued
    /// chain stops listing them, so that no later restore tries them).
    fn fell_back(&self, i: usize);
}

/// The tables of several sources (a restore at a lower parallelism, whose subtask takes the
/// key groups of several earlier ones) as one, in key order. The sources' key groups are
/// disjoint, so their tables do not interleave.
#[derive(Debug)]
pub struct Combined {
    parts: Vec<std::sync::Arc<dyn TableSource>>,
    first_keys: Vec<Vec<u8>>,
    /// Table `i` is table `.1` of part `.0`.
    tables: Vec<(usize, usize)>,
}

impl Combined {
    /// The tables of `parts`, sorted by their first keys.
    pub fn new(parts: Vec<std::sync::Arc<dyn TableSource>>) -> Self {
        let mut tables: Vec<(Vec<u8>, usize, usize)> = parts
            .iter()
            .enumerate()
            .flat_map(|(p, part)| part.first_keys().iter().enumerate().map(move |(t, key)| (key.clone(), p, t)))
            .collect();
        tables.sort();
        Combined {
            parts,
            first_keys: tables.iter().map(|(key, _, _)| key.clone()).collect(),
            tables: tables.into_iter().map(|(_, p, t)| (p, t)).collect(),
        }
    }

    /// The part holding a key (the one whose table's range it falls in).
    fn part_of(&self, key: &[u8]) -> usize {
        self.tables.get(start_at_or_below(&self.first_keys, key)).map_or(0, |(p, _)| *p)
    }
}

impl TableSource for Combined {
    fn first_keys(&self) -> &[Vec<u8>] {
        &self.first_keys
    }

    fn fetch(&self, i: usize) -> Result<Fetched, String> {
        let (p, t) = self.tables[i];
        self.parts[p].fetch(t)
    }

    fn image_entries(&self, start: &[u8], end: Option<&[u8]>, emit: &mut EmitEntry<'_>) -> Result<(), String> {
        // A range ends where the next table (of this part or the next) begins, so only the
        // part of its first table has entries in it.
        self.parts[self.part_of(start)].image_entries(start, end, emit)
    }

    fn fell_back(&self, i: usize) {
        let (p, t) = self.tables[i];
        self.parts[p].fell_back(t);
    }

    fn describe(&self) -> String {
        self.parts.iter().map(|p| p.describe()).collect::<Vec<_>>().join(", ")
    }
}

/// A fetched table file, deleted (or released) when dropped.
pub struct Fetched {
    /// The local file.
    pub path: PathBuf,
    /// Whatever keeps the file until it is taken in (a restore's local copy).
    pub keep: Box<dyn std::any::Any + Send>,
}

/// The key space cut at sorted start keys: range `i` holds the keys from `starts[i]` up to
/// `starts[i + 1]`, and range 0 also every key below `starts[0]`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ranges {
    starts: Vec<Vec<u8>>,
}

/// The index of the last of sorted `starts` at or below `key`; 0 when every start is above it.
fn start_at_or_below(starts: &[Vec<u8>], key: &[u8]) -> usize {
    starts.partition_point(|s| s.as_slice() <= key).saturating_sub(1)
}

impl Ranges {
    /// Ranges beginning at `starts`, which must be strictly increasing; `None` when they are
    /// not (the tables would overlap, or a first key was damaged).
    pub fn new(starts: Vec<Vec<u8>>) -> Option<Self> {
        Self::increasing(&starts).then_some(Ranges { starts })
    }

    /// Whether `starts` are strictly increasing, as [`Self::new`] requires.
    pub fn increasing(starts: &[Vec<u8>]) -> bool {
        starts.windows(2).all(|w| w[0] < w[1])
    }

    /// How many ranges (one per start).
    pub fn len(&self) -> usize {
        self.starts.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.starts.is_empty()
    }

    /// The range holding `key`.
    pub fn range_of(&self, key: &[u8]) -> usize {
        start_at_or_below(&self.starts, key)
    }

    /// Range `i`'s bounds `[start, end)`: `start` `None` for range 0 (no lower bound), `end`
    /// `None` for the last range.
    pub fn bounds(&self, i: usize) -> (Option<&[u8]>, Option<&[u8]>) {
        let start = (i > 0).then(|| self.starts[i].as_slice());
        (start, self.starts.get(i + 1).map(Vec::as_slice))
    }

    /// The key groups `[first, last)` that range `i`'s store keys can belong to (a store key
    /// begins with its key group, two bytes big-endian).
    pub fn key_groups_of(&self, i: usize) -> (u32, u32) {
        let key_group = |key: &[u8]| {
            u32::from(u16::from_be_bytes([key.first().copied().unwrap_or(0), key.get(1).copied().unwrap_or(0)]))
        };
        let (start, end) = self.bounds(i);
        let first = start.map_or(0, key_group);
        // A range ending at a key group's first key does not reach into that key group.
        let last = end.map_or(u32::MAX, |e| key_group(e) + u32::from(e.len() > 2));
        (first, last)
    }
}

/// Where one range is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RangeState {
    /// Not started.
    Waiting,
    /// A loader is fetching or loading it.
    Loading,
    /// In the store: reads and writes may touch it.
    Ready,
}

#[derive(Debug)]
struct Schedule {
    states: Vec<RangeState>,
    /// Ranges a reader waits for, oldest first: loaded before the others.
    wanted: VecDeque<usize>,
    /// The lowest range that may still be waiting (ranges are otherwise taken in order).
    next: usize,
    ready: usize,
    /// Why loading stopped, for every reader after it.
    failed: Option<String>,
    cancelled: bool,
}

/// Which ranges of a lazy restore are ready, which are being loaded, and which readers wait.
#[derive(Debug)]
pub struct Pending {
    ranges: Ranges,
    schedule: Mutex<Schedule>,
    changed: Condvar,
    /// Every range is ready: reads no longer look at the schedule.
    all_ready: AtomicBool,
}

impl Pending {
    /// Every range of `ranges` waiting.
    pub fn new(ranges: Ranges) -> Self {
        let n = ranges.len();
        Pending {
            all_ready: AtomicBool::new(n == 0),
            ranges,
            schedule: Mutex::new(Schedule {
                states: vec![RangeState::Waiting; n],
                wanted: VecDeque::new(),
                next: 0,
                ready: 0,
                failed: None,
                cancelled: false,
            }),
            changed: Condvar::new(),
        }
    }

    /// The ranges.
    pub fn ranges(&self) -> &Ranges {
        &self.ranges
    }

    /// Whether every range is ready.
    #[inline]
    pub fn all_ready(&self) -> bool {
        self.all_ready.load(Ordering::Acquire)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Schedule> {
        self.schedule.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Blocks until the range holding `key` is ready; the loading's failure otherwise.
    pub fn wait_for_key(&self, key: &[u8]) -> Result<(), StoreError> {
        if self.all_ready() {
            return Ok(());
        }
        self.wait_for(self.ranges.range_of(key))
    }

    /// Blocks until range `i` is ready, asking for it to be loaded next if no loader has
    /// started it; the loading's failure otherwise.
    pub fn wait_for(&self, i: usize) -> Result<(), StoreError> {
        let mut s = self.lock();
        if s.states[i] == RangeState::Waiting && !s.wanted.contains(&i) {
            s.wanted.push_back(i);
        }
        loop {
            if s.states[i] == RangeState::Ready {
                return Ok(());
            }
            if let Some(why) = &s.failed {
                return Err(StoreError::LazyRestore(why.clone()));
            }
            s = self.changed.wait(s).unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }

    /// Blocks until every range is ready (a scan of the whole store).
    pub fn wait_for_all(&self) -> Result<(), StoreError> {
        for i in 0..self.ranges.len() {
            if self.all_ready() {
                break;
            }
            self.wait_for(i)?;
        }
        Ok(())
    }

    /// For a loader: the next range to load (a wanted one first, else the lowest waiting),
    /// marked as loading; `None` when none is left or loading stopped.
    pub fn next_to_load(&self) -> Option<usize> {
        let mut s = self.lock();
        if s.failed.is_some() || s.cancelled {
            return None;
        }
        while let Some(i) = s.wanted.pop_front() {
            if s.states[i] == RangeState::Waiting {
                s.states[i] = RangeState::Loading;
                return Some(i);
            }
        }
        while s.next < s.states.len() && s.states[s.next] != RangeState::Waiting {
            s.next += 1;
        }
        let i = s.next;
        let state = s.states.get_mut(i)?;
        *state = RangeState::Loading;
        Some(i)
    }

    /// For a loader: range `i` is in the store.
    pub fn loaded(&self, i: usize) {
        let mut s = self.lock();
        if s.states[i] != RangeState::Ready {
            s.states[i] = RangeState::Ready;
            s.ready += 1;
        }
        if s.ready == s.states.len() {
            self.all_ready.store(true, Ordering::Release);
        }
        drop(s);
        self.changed.notify_all();
    }

    /// For a loader: loading failed; every reader waiting now or later gets `why`.
    pub fn fail(&self, why: String) {
        let mut s = self.lock();
        s.failed.get_or_insert(why);
        drop(s);
        self.changed.notify_all();
    }

    /// The store is going away: loaders stop after the range they are on.
    pub fn cancel(&self) {
        self.lock().cancelled = true;
        self.changed.notify_all();
    }

    /// How many ranges are ready.
    #[cfg(test)]
    pub fn ready(&self) -> usize {
        self.lock().ready
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn ranges(starts: &[&[u8]]) -> Ranges {
        Ranges::new(starts.iter().map(|s| s.to_vec()).collect()).unwrap()
    }

    /// Every key is in exactly one range: the last whose start is at or below it, or the first.
    #[test]
    fn a_key_is_in_the_range_of_the_last_start_at_or_below_it() {
        let r = ranges(&[b"b", b"d", b"f"]);
        for (key, range) in [(&b""[..], 0), (b"a", 0), (b"b", 0), (b"c", 0), (b"d", 1), (b"e", 1), (b"f", 2), (b"z", 2)]
        {
            assert_eq!(r.range_of(key), range, "{key:?}");
        }
        assert_eq!(r.bounds(0), (None, Some(&b"d"[..])));
        assert_eq!(r.bounds(1), (Some(&b"d"[..]), Some(&b"f"[..])));
        assert_eq!(r.bounds(2), (Some(&b"f"[..]), None));
        assert_eq!(Ranges::new(vec![b"b".to_vec(), b"b".to_vec()]), None, "starts must increase");
        assert_eq!(Ranges::new(vec![b"c".to_vec(), b"b".to_vec()]), None);
    }

    /// Loaders take ranges in order, except that a range a reader waits for goes first; a
    /// reader returns once its range is loaded, and everyone learns of a failure.
    #[test]
    fn a_range_names_every_key_group_its_keys_can_be_in() {
        let r = ranges(&[&[0, 3, 9], &[0, 5], &[0, 5, 0], &[1, 0, 7]]);
        assert_eq!(r.key_groups_of(0), (0, 5), "below [0 5]: no key of key group 5 is");
        assert_eq!(r.key_groups_of(1), (5, 5 + 1), "[0 5] up to [0 5 0]");
        assert_eq!(r.key_groups_of(2), (5, 257), "up to a key of key group 256");
        assert_eq!(r.key_groups_of(3), (256, u32::MAX));
        let key_group = |key: &[u8]| u32::from(u16::from_be_bytes([key[0], key[1]]));
        for key in [&[0u8, 0][..], &[0, 4, 255], &[0, 5], &[0, 5, 0], &[0, 5, 0, 1], &[0, 255, 1], &[1, 0, 7], &[9, 9]]
        {
            let (first, last) = r.key_groups_of(r.range_of(key));
            assert!((first..last).contains(&key_group(key)), "{key:?}");
        }
    }

    #[test]
    fn a_wanted_range_is_loaded_first_and_readers_wake_when_it_is_ready() {
        let pending = Arc::new(Pending::new(ranges(&[b"a", b"c", b"e", b"g"])));
        assert_eq!(pending.next_to_load(), Some(0));
        let reader = {
            let pending = pending.clone();
            std::thread::spawn(move || pending.wait_for_key(b"f"))
        };
        // The reader asked for range 2.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while pending.lock().wanted.is_empty() {
            assert!(std::time::Instant::now() < deadline, "the reader never asked");
            std::thread::yield_now();
        }
        assert_eq!(pending.next_to_load(), Some(2), "the wanted range first");
        assert_eq!(pending.next_to_load(), Some(1), "then in order");
        assert!(!reader.is_finished());
        pending.loaded(2);
        reader.join().unwrap().unwrap();
        assert_eq!(pending.next_to_load(), Some(3));
        assert_eq!(pending.next_to_load(), None, "every range taken");
        assert!(!pending.all_ready());
        for i in [0, 1, 3] {
            pending.loaded(i);
        }
        assert!(pending.all_ready());
        assert_eq!(pending.ready(), 4);
        pending.wait_for_all().unwrap();

        let failing = Pending::new(ranges(&[b"a", b"c"]));
        assert_eq!(failing.next_to_load(), Some(0));
        failing.fail("table 0 is damaged and so is the image".into());
        assert!(matches!(failing.wait_for_key(b"d"), Err(StoreError::LazyRestore(why)) if why.contains("damaged")));
        assert_eq!(failing.next_to_load(), None, "loaders stop");

        let cancelled = Pending::new(ranges(&[b"a"]));
        cancelled.cancel();
        assert_eq!(cancelled.next_to_load(), None);
        assert!(Pending::new(Ranges::default()).all_ready(), "no tables: nothing to wait for");
    }
}
