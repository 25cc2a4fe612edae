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

use weir_checkpoint::format::{keyed_entries, Decoder};

use super::{map, owns, KeyedState, Slot, StateKey, StateValue, StoreError, FILL_AHEAD};

/// Buckets of the restoring table applied together: 4096 of a count's entries (48 bytes then,
/// 40 now) and their control bytes are 200 KB, which the second-level cache holds. Measured
/// on that 20M-key chain: 1024 buckets, 404–442 ms; 4096, 383–392 ms; 16384, 406–409 ms; whole
/// shards, 488–548 ms (file by file: 593–610 ms). Applied group by group within the window
/// (session 39), 16384 buckets measured the same as 4096 (307–315 ms against 308–314).
const WINDOW_BUCKETS: usize = 4096;

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

/// Where each shard's entries start in each of `bodies`: as `recorded` by the writer
/// ([`weir_checkpoint::metadata::FileRef::shard_starts`]) when those fit the body (a start per
/// shard and its end, from 0 to the body's length, in order), else [`shard_starts`] of it, on
/// up to `threads` threads that take the largest bodies first. Recorded starts saved the
/// 20M-key chain's restore the 35–37 ms that 2 threads took to read every entry (session 39).
fn all_shard_starts<K: StateKey>(
    bodies: &[&[u8]],
    recorded: &[Option<&[u64]>],
    threads: usize,
) -> Result<Vec<Vec<usize>>, StoreError> {
    let fitting = |i: usize| -> Option<Vec<usize>> {
        let starts = recorded.get(i).copied().flatten()?;
        let fits = starts.len() == map::SHARDS + 1
            && starts.first() == Some(&0)
            && starts.last() == Some(&(bodies[i].len() as u64))
            && starts.windows(2).all(|w| w[0] <= w[1]);
        fits.then(|| starts.iter().map(|&at| at as usize).collect())
    };
    let mut starts: Vec<Vec<usize>> = (0..bodies.len()).map(|i| fitting(i).unwrap_or_default()).collect();
    let mut largest_first: Vec<usize> = (0..bodies.len()).filter(|&i| starts[i].is_empty()).collect();
    largest_first.sort_by_key(|&i| std::cmp::Reverse(bodies[i].len()));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let work = || -> Result<Vec<(usize, Vec<usize>)>, StoreError> {
        let mut found = Vec::new();
        while let Some(&i) = largest_first.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
            found.push((i, shard_starts::<K>(bodies[i])?));
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

impl<V: StateValue, K: StateKey> KeyedState<V, K> {
    /// Applies `bodies`, a restored chain's files in order (each listing each key's put once
    /// and no deletions: [`super::KeyedSnapshot::puts_from`] of 0), shard by shard, keeping
    /// only key groups in `key_groups`; false, with the map emptied again (its room kept), when
    /// they are not all in shard order, or a start `recorded_starts` gives for a file is not
    /// where its shard starts (then apply them file by file). On the heap backend only, into
    /// a map that reserved room for the chain's keys first ([`Self::reserve_restored_entries`]):
    /// its shards' buckets decide the windows. A thread per core finds the shard starts the
    /// files do not come with ([`all_shard_starts`]), then a thread per core applies a range of
    /// shards.
    pub fn restore_chain_by_shard(
        &mut self,
        bodies: &[&[u8]],
        recorded_starts: &[Option<&[u64]>],
        key_groups: (u32, u32),
    ) -> Result<bool, StoreError> {
        // Entries are found by 32-bit offsets into a shard's part of a file.
        if self.spill.is_some() || V::only_value().is_some() || bodies.iter().any(|b| u32::try_from(b.len()).is_err()) {
            return Ok(false);
        }
        let started = std::time::Instant::now();
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        let threads = cores.clamp(1, map::SHARDS);
        let starts = all_shard_starts::<K>(bodies, recorded_starts, threads)?;
        let starts_found = started.elapsed();
        let buckets: Vec<usize> = (0..map::SHARDS).map(|shard| self.map.shard_buckets(shard)).collect();
        let (starts, buckets) = (&starts, &buckets);
        let per_thread = map::SHARDS.div_ceil(threads);
        let in_order = self.map.fill_concurrently(|fill| {
            // Whether every entry a thread took was of the shard it took it for.
            let apply = |first: usize| -> Result<bool, StoreError> {
                let mut window = WindowFill::default();
                let mut filler = fill.filler();
                let mut parts = Vec::with_capacity(bodies.len());
                for shard in first..(first + per_thread).min(map::SHARDS) {
                    parts.clear();
                    parts.extend(
                        bodies.iter().zip(starts).map(|(body, starts)| &body[starts[shard]..starts[shard + 1]]),
                    );
                    if !window.apply(&mut filler, &parts, shard, buckets[shard], key_groups)? {
                        return Ok(false);
                    }
                }
                Ok(true)
            };
            let apply = &apply;
            std::thread::scope(|scope| {
                let others: Vec<_> = (1..threads).map(|t| scope.spawn(move || apply(t * per_thread))).collect();
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
            files = bodies.len(),
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
    /// Applies shard `shard`'s `parts` (one per file, in the chain's order) to the shard, whose
    /// table has `buckets` buckets, window by window. False, having applied none of them, when
    /// one of them holds an entry of another shard (a file out of shard order).
    fn apply<K: StateKey, V: StateValue>(
        &mut self,
        filler: &mut map::Filler<'_, '_, K, Slot<V>>,
        parts: &[&[u8]],
        shard: usize,
        buckets: usize,
        key_groups: (u32, u32),
    ) -> Result<bool, StoreError> {
        let mask = buckets.max(1) - 1;
        let shift = WINDOW_BUCKETS.trailing_zeros();
        self.found.clear();
        for (index, part) in parts.iter().enumerate() {
            let mut entries = keyed_entries(part);
            loop {
                let offset = entries.position();
                let Some(entry) = entries.next() else { break };
                // A part that does not read as entries of this shard was cut where no shard
                // starts (a writer's wrong start): the file by file restore reads the files
                // whole, and says what is malformed in them if anything is.
                let Ok(entry) = entry else { return Ok(false) };
                if !owns(key_groups, entry.key_group) {
                    continue;
                }
                let Ok(hash) = K::decode_then(entry.key, |key| map::hash_of(&key)) else { return Ok(false) };
                if map::shard_of(hash) != shard {
                    return Ok(false);
                }
                self.found.push(EntryRef { hash, part: index as u32, offset: offset as u32 });
            }
        }
        // Window by window, then within each window group by group; each in the chain's order.
        let windows = (buckets >> shift).max(1);
        let window_of = |hash: u64| ((hash as usize) & mask) >> shift;
        partition_stably(&self.found, &mut self.ordered, &mut self.window_ends, windows, window_of);
        let mut from = 0;
        for w in 0..windows {
            let to = self.window_ends[w] as usize;
            let group_of = |hash: u64| group_in_window(hash, mask);
            let groups = WINDOW_BUCKETS / GROUP_BUCKETS;
            partition_stably(&self.ordered[from..to], &mut self.in_window, &mut self.group_ends, groups, group_of);
            from = to;
            self.apply_in_order(filler, parts)?;
        }
        Ok(true)
    }

    /// Applies the entries of `in_window`, in their order.
    fn apply_in_order<K: StateKey, V: StateValue>(
        &self,
        filler: &mut map::Filler<'_, '_, K, Slot<V>>,
        parts: &[&[u8]],
    ) -> Result<(), StoreError> {
        for (n, at) in self.in_window.iter().enumerate() {
            if let Some(ahead) = self.in_window.get(n + FILL_AHEAD) {
                filler.prefetch(ahead.hash);
            }
            let part = parts[at.part as usize];
            let Some(entry) = keyed_entries(&part[at.offset as usize..]).next() else {
                return Err(StoreError::Decode(weir_checkpoint::format::FormatError::Malformed(at.offset as usize)));
            };
            let entry = entry?;
            // Files of puts only (the caller's promise): a deletion here is a malformed file.
            let Some(raw) = entry.value else {
                return Err(StoreError::Decode(weir_checkpoint::format::FormatError::Malformed(at.offset as usize)));
            };
            // The slot is made inside the closure: made outside, it was read back from memory
            // by a load that waited for the writes that made it (`perf`: a quarter of the
            // apply's samples). The closure is inlined (256–259 ms against 263–268 for the
            // 20M-key chain); the key's first copy still waits on its decoding's writes, its
            // tag and its number written apart and read as one (a sixth of the samples).
            let (value, key_group) = (V::decode(&mut Decoder::new(raw))?, entry.key_group);
            K::decode_then(
                entry.key,
                #[inline(always)]
                |key| filler.apply(at.hash, key, Some(Slot::restored(value, key_group))),
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::value::{Key, Value};
    use weir_checkpoint::format::{open, FileKind, StateFileWriter};

    fn key(i: i64) -> Key {
        Key::One(Value::Int(i))
    }

    /// A chain's files, and where each file's writer says each shard's entries start.
    struct Chain {
        files: Vec<bytes::Bytes>,
        recorded: Vec<Vec<u64>>,
    }

    impl Chain {
        fn recorded(&self) -> Vec<Option<&[u64]>> {
            self.recorded.iter().map(|r| Some(r.as_slice())).collect()
        }
    }

    /// The files of a running sum over 5 rounds of 120K new keys each, every third key
    /// changed again in each later round, so that the files repeat keys with other values,
    /// then a round that changes every hundredth key (an increment written from the list of
    /// changed keys, the others from a scan of the map): a full image, then increments of puts
    /// only. And the keys the state holds at the end.
    fn growing_chain() -> (Chain, u64) {
        let mut s = KeyedState::<i64>::new(16, true, 100);
        let mut chain = Chain { files: Vec::new(), recorded: Vec::new() };
        let per_round = 120_000i64;
        for round in 0..6i64 {
            let (new, every) = if round < 5 { (round * per_round..(round + 1) * per_round, 3) } else { (0..0, 100) };
            for i in new {
                *s.update(key(i), || 0).unwrap() += i;
            }
            for i in (0..round.min(5) * per_round).step_by(every) {
                *s.update(key(i), || 0).unwrap() += round;
            }
            let snapshot = s.snapshot_checkpoint().unwrap();
            assert_eq!(snapshot.puts_from, Some(0), "round {round}: puts only");
            let lens = snapshot.shard_bytes.clone().expect("the heap backend's files say where shards start");
            let file = weir_checkpoint::FileRef::new(String::new(), 0, 0).with_shard_bytes(Some(&lens));
            chain.recorded.push(file.shard_starts().unwrap());
            chain.files.push(snapshot.bytes());
        }
        (chain, s.map.len() as u64)
    }

    fn bodies(files: &[bytes::Bytes]) -> Vec<&[u8]> {
        files.iter().map(|f| open(f).unwrap().1).collect()
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
    /// the chain restores the same with the starts recorded or found.
    #[test]
    fn a_chain_applied_by_shard_restores_what_file_by_file_restores() {
        let (chain, live) = growing_chain();
        let files = &chain.files;
        assert!(files.len() >= 2 && files[0].len() > 1 << 20);
        for (body, recorded) in bodies(files).iter().zip(&chain.recorded) {
            let found: Vec<u64> = shard_starts::<Key>(body).unwrap().into_iter().map(|at| at as u64).collect();
            assert_eq!(recorded, &found);
        }
        for (range, recorded) in [((0, 16), false), ((3, 11), false), ((0, 16), true), ((2, 14), true)] {
            let mut by_file = KeyedState::<i64>::new(16, true, 100);
            by_file.reserve_restored_entries(live);
            for body in bodies(files) {
                by_file.restore_file(body, range).unwrap();
            }
            let mut by_shard = KeyedState::<i64>::new(16, true, 100);
            by_shard.reserve_restored_entries(live);
            let windows = (0..map::SHARDS).map(|s| by_shard.map.shard_buckets(s) / WINDOW_BUCKETS).max().unwrap();
            assert!(windows >= 2, "the shards' entries are applied in {windows} windows");
            let starts = if recorded { chain.recorded() } else { vec![None; files.len()] };
            assert!(by_shard.restore_chain_by_shard(&bodies(files), &starts, range).unwrap(), "{range:?}");
            let expected = sorted(&by_file);
            assert!(expected.len() as u64 > live / 2, "{range:?}: {} keys", expected.len());
            assert_eq!(sorted(&by_shard), expected, "{range:?}");
            assert_eq!(by_shard.cached_len(), expected.len(), "{range:?}: the map counts its entries");
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
            s.reserve_restored_entries(live);
            let room = s.map.capacity();
            if taken {
                assert!(!s.restore_chain_by_shard(&bodies(files), &starts, (0, 16)).unwrap(), "case {n}");
                assert_eq!((s.cached_len(), s.map.capacity()), (0, room), "case {n}: emptied, its room kept");
                for body in bodies(files) {
                    s.restore_file(body, (0, 16)).unwrap();
                }
            } else {
                assert!(s.restore_chain_by_shard(&bodies(files), &starts, (0, 16)).unwrap(), "case {n}");
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
        s.reserve_restored_entries(live + 1000);
        let room = s.map.capacity();
        assert!(!s.restore_chain_by_shard(&bodies(&files), &[None, None], (0, 16)).unwrap());
        assert_eq!((s.cached_len(), s.map.capacity()), (0, room), "emptied, its room kept");
        let mut by_file = KeyedState::<i64>::new(16, true, 100);
        for body in bodies(&files) {
            s.restore_file(body, (0, 16)).unwrap();
            by_file.restore_file(body, (0, 16)).unwrap();
        }
        assert_eq!(sorted(&s), sorted(&by_file));
        assert_eq!(s.cached_len(), 120_000, "the first image's keys; the file's are among them");
        let mut set = KeyedState::<()>::new(16, true, 100);
        assert!(!set.restore_chain_by_shard(&bodies(image), &[None], (0, 16)).unwrap());
    }
}
