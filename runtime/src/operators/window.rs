//! Event-time tumbling and sliding windows with aggregates, per key, computed by slicing:
//! records are aggregated into panes of `gcd(size, slide)`, so a record costs one accumulator
//! update however many windows overlap it; a window's result merges its `size / pane` panes
//! when the watermark reaches its end. It emits key fields, `window_start`, `window_end` and
//! the aggregates (windows without records emit nothing). Records behind the watermark
//! (every window containing them has fired) are dropped and counted.
//!
//! The watermark is part of the snapshot (its operator document, per key group): a restored
//! subtask must not take a window that fired before the checkpoint as open again, or a late
//! record would make it fire twice. Rescaled, each key group keeps its previous owner's
//! watermark until the new one passes it.

use std::collections::BTreeMap;

use weir_checkpoint::format::{Decoder, Encoder, FormatError};
use weir_crds::job::{WindowKind, WindowSpec};

use crate::message::Barrier;
use crate::operator::{Operator, StateParts, TaskError};
use crate::operators::accumulators::{Acc, Accs, Aggregates};
use crate::operators::keyed::KeyedContext;
use crate::restore::KeyedRestore;
use crate::state::{KeyedState, StateValue};
use crate::value::{Fields, Key, Record, Value};

/// The panes of one key and the end of its next window not yet emitted.
#[derive(Clone, Debug, Default)]
pub struct KeyPanes {
    next_end: i64,
    /// `(pane start, accumulators)`, sorted by start.
    panes: Vec<(i64, Accs)>,
}

impl StateValue for KeyPanes {
    type Slot = crate::state::slot::Slot<Self>;

    fn encode(&self, e: &mut Encoder) {
        e.svarint(self.next_end);
        e.varint(self.panes.len() as u64);
        for (start, accs) in &self.panes {
            e.svarint(*start);
            e.varint(accs.len() as u64);
            for a in accs {
                a.encode(e);
            }
        }
    }

    fn decode(d: &mut Decoder<'_>) -> Result<Self, FormatError> {
        let next_end = d.svarint()?;
        let n = d.varint()? as usize;
        let mut panes = Vec::with_capacity(n.min(4096));
        for _ in 0..n {
            let start = d.svarint()?;
            let m = d.varint()? as usize;
            let accs: Accs = (0..m).map(|_| Acc::decode(d)).collect::<Result<Vec<_>, _>>()?.into();
            panes.push((start, accs));
        }
        Ok(KeyPanes { next_end, panes })
    }
}

fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// A watermark that holds for the key groups `[start, end)`.
type KeyGroupWatermark = ((u32, u32), i64);

/// The window operator.
pub struct WindowOperator {
    ctx: KeyedContext,
    size: i64,
    slide: i64,
    pane: i64,
    aggregates: Aggregates,
    state: KeyedState<KeyPanes>,
    /// Window end → keys to look at then (derived; rebuilt on restore; may hold stale entries).
    timers: BTreeMap<i64, Vec<Key>>,
    watermark: i64,
    /// Restored watermarks above `watermark`, by key-group range (after a rescale, each key
    /// group keeps its previous owner's watermark until this subtask's passes it).
    floors: Vec<KeyGroupWatermark>,
    late_records: u64,
    /// The job's `weir_late_records_total`, when the operator runs in a job.
    late_metric: Option<prometheus_client::metrics::counter::Counter>,
}

impl WindowOperator {
    /// Builds the operator, restoring its state when given.
    pub fn new(
        ctx: KeyedContext,
        spec: &WindowSpec,
        input: &[String],
        restore: Option<&KeyedRestore>,
    ) -> Result<Self, TaskError> {
        let size = spec.size.as_millis() as i64;
        let slide = match spec.kind {
            WindowKind::Tumbling => size,
            WindowKind::Sliding => spec.slide.map(|s| s.as_millis() as i64).unwrap_or(size),
        };
        let state: KeyedState<KeyPanes> = ctx.state(restore)?;
        let restored = match restore {
            Some(r) => decode_watermarks(&r.operator_docs)
                .map_err(|e| TaskError::Restore { uid: ctx.uid.clone(), reason: format!("window watermarks: {e}") })?,
            None => Vec::new(),
        };
        let (watermark, floors) = restored_watermarks(&restored, ctx.key_groups);
        let mut timers: BTreeMap<i64, Vec<Key>> = BTreeMap::new();
        state
            .for_each(|key, panes| timers.entry(panes.next_end).or_default().push(key.clone()))
            .map_err(|e| ctx.state_failed(e))?;
        Ok(WindowOperator {
            ctx,
            size,
            slide,
            pane: gcd(size, slide),
            aggregates: Aggregates::new(&spec.aggregates, input),
            state,
            timers,
            watermark,
            floors,
            late_records: 0,
            late_metric: None,
        })
    }

    /// Counts late records in `counter` too (the job's metric; shared by every subtask).
    pub fn counting_late_records_in(mut self, counter: prometheus_client::metrics::counter::Counter) -> Self {
        self.late_metric = Some(counter);
        self
    }

    /// Records dropped because they were behind the watermark.
    pub fn late_records(&self) -> u64 {
        self.late_records
    }

    /// The watermark that applies to `key`: this subtask's, or a restored one that is higher.
    fn watermark_of(&self, key: &Key) -> i64 {
        if self.floors.is_empty() {
            return self.watermark;
        }
        let kg = key.key_group(self.ctx.max_parallelism);
        self.floors.iter().filter(|((a, b), _)| kg >= *a && kg < *b).map(|(_, w)| *w).fold(self.watermark, i64::max)
    }

    /// The operator document: the watermark of each key-group range this subtask owns.
    fn watermark_doc(&self) -> Vec<u8> {
        let mut e = Encoder::default();
        let above: Vec<_> = self.floors.iter().filter(|(_, w)| *w > self.watermark).collect();
        e.varint(1 + above.len() as u64);
        for ((a, b), w) in std::iter::once(&(self.ctx.key_groups, self.watermark)).chain(above) {
            e.varint(u64::from(*a));
            e.varint(u64::from(*b));
            e.svarint(*w);
        }
        e.buf
    }

    /// The end of the first window containing pane `p`.
    fn first_end(&self, p: i64) -> i64 {
        (p - self.size).div_euclid(self.slide) * self.slide + self.slide + self.size
    }

    /// The first window end after `t`.
    fn next_end_after(&self, t: i64) -> i64 {
        if t == i64::MIN {
            return i64::MIN;
        }
        let next = t + 1;
        next + (self.size - next).rem_euclid(self.slide)
    }

    /// Emits every window of `key` ending at or before the watermark.
    fn fire(&mut self, key: Key, out: &mut Vec<Record>) -> Result<(), TaskError> {
        let (size, slide, watermark) = (self.size, self.slide, self.watermark);
        let first_end = |p: i64| (p - size).div_euclid(slide) * slide + slide + size;
        let Some(kp) = self.state.update_existing(&key).map_err(|e| self.ctx.state_failed(e))? else { return Ok(()) };
        let mut e = kp.next_end;
        if e > watermark {
            return Ok(()); // a stale timer: this key's windows up to here were emitted already
        }
        while e <= watermark {
            let start = e - size;
            let mut merged: Option<Accs> = None;
            for (_, accs) in kp.panes.iter().filter(|(p, _)| *p >= start && *p < e) {
                match &mut merged {
                    None => merged = Some(accs.clone()),
                    Some(m) => Aggregates::merge(m, accs),
                }
            }
            if let Some(accs) = merged {
                let mut fields = Fields::from(key.values());
                fields.push(Value::Int(start));
                fields.push(Value::Int(e));
                Aggregates::results(&accs, &mut fields);
                out.push(Record { time: e - 1, fields });
            }
            e += slide;
            // Skip windows that hold no pane.
            match kp.panes.iter().find(|(p, _)| *p >= e - size) {
                Some((p, _)) => e = e.max(first_end(*p)),
                None => break,
            }
        }
        kp.next_end = e;
        kp.panes.retain(|(p, _)| *p >= e - size);
        if kp.panes.is_empty() {
            self.state.remove(&key).map_err(|e| self.ctx.state_failed(e))?;
        } else {
            self.timers.entry(e).or_default().push(key);
        }
        Ok(())
    }
}

impl Operator for WindowOperator {
    fn process(&mut self, batch: Vec<Record>, _out: &mut Vec<Record>) -> Result<(), TaskError> {
        for r in batch {
            let t = r.time;
            let key = Key::of(&r, &self.ctx.key);
            let watermark = self.watermark_of(&key);
            // The last window containing t starts at the slide boundary at or before t.
            let last_end = t - t.rem_euclid(self.slide) + self.size;
            if last_end <= watermark {
                self.late_records += 1;
                if let Some(metric) = &self.late_metric {
                    metric.inc();
                }
                continue;
            }
            let p = t - t.rem_euclid(self.pane);
            let first_end = self.first_end(p);
            let floor = self.next_end_after(watermark);
            let aggregates = &self.aggregates;
            let mut new_pane_key = None;
            let kp = match self.state.update(key.clone(), || KeyPanes { next_end: i64::MAX, panes: Vec::new() }) {
                Ok(kp) => kp,
                Err(e) => return Err(self.ctx.state_failed(e)),
            };
            match kp.panes.binary_search_by_key(&p, |(s, _)| *s) {
                Ok(i) => aggregates.add(&mut kp.panes[i].1, &r),
                Err(i) => {
                    let mut accs = aggregates.init();
                    aggregates.add(&mut accs, &r);
                    kp.panes.insert(i, (p, accs));
                    // Windows ending at or before the watermark have fired: this record only
                    // joins the later ones.
                    let due = first_end.max(floor);
                    if due < kp.next_end {
                        kp.next_end = due;
                        new_pane_key = Some((key, due));
                    }
                }
            }
            if let Some((k, due)) = new_pane_key {
                self.timers.entry(due).or_default().push(k);
            }
        }
        Ok(())
    }

    fn on_watermark(&mut self, watermark: i64, out: &mut Vec<Record>) -> Result<(), TaskError> {
        if watermark <= self.watermark {
            return Ok(());
        }
        self.watermark = watermark;
        self.floors.retain(|(_, w)| *w > watermark);
        while let Some(entry) = self.timers.first_entry() {
            if *entry.key() > watermark {
                break;
            }
            for key in entry.remove() {
                self.fire(key, out)?;
            }
        }
        Ok(())
    }

    fn snapshot(&mut self, barrier: &Barrier) -> Result<StateParts, TaskError> {
        let mut parts = self.ctx.snapshot(&mut self.state, barrier)?;
        parts.operator_doc = Some(self.watermark_doc());
        Ok(parts)
    }
}

/// Decodes the watermark documents of restored subtasks: `(key groups, watermark)` entries.
fn decode_watermarks(docs: &[((u32, u32), Vec<u8>)]) -> Result<Vec<KeyGroupWatermark>, FormatError> {
    let mut out = Vec::new();
    for (_, doc) in docs {
        let mut d = Decoder::new(doc);
        let n = d.varint()?;
        for _ in 0..n {
            let a = d.varint()? as u32;
            let b = d.varint()? as u32;
            out.push(((a, b), d.svarint()?));
        }
    }
    Ok(out)
}

/// The watermark of a subtask owning `key_groups` restored from `entries`, and the higher
/// watermarks of some of its key groups. The subtask's watermark is the lowest over its key
/// groups (a key group no entry covers has none: `i64::MIN`), so that it never treats a window
/// as fired that some key group's previous owner had not fired.
fn restored_watermarks(entries: &[KeyGroupWatermark], key_groups: (u32, u32)) -> (i64, Vec<KeyGroupWatermark>) {
    let clipped: Vec<KeyGroupWatermark> = entries
        .iter()
        .filter_map(|((a, b), w)| {
            let (a, b) = ((*a).max(key_groups.0), (*b).min(key_groups.1));
            (a < b).then_some(((a, b), *w))
        })
        .collect();
    let lowest = (key_groups.0..key_groups.1)
        .map(|kg| clipped.iter().filter(|((a, b), _)| kg >= *a && kg < *b).map(|(_, w)| *w).max().unwrap_or(i64::MIN))
        .min()
        .unwrap_or(i64::MIN);
    (lowest, clipped.into_iter().filter(|(_, w)| *w > lowest).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_crds::job::{AggregateFn, AggregateKind};
    use weir_crds::HumanDuration;

    fn spec(kind: WindowKind, size: u64, slide: Option<u64>) -> WindowSpec {
        WindowSpec {
            kind,
            size: HumanDuration::from_millis(size),
            slide: slide.map(HumanDuration::from_millis),
            aggregates: vec![
                AggregateFn { function: AggregateKind::Count, field: None, output: "n".into() },
                AggregateFn { function: AggregateKind::Sum, field: Some("v".into()), output: "s".into() },
            ],
        }
    }

    fn op(kind: WindowKind, size: u64, slide: Option<u64>) -> WindowOperator {
        let ctx = KeyedContext {
            uid: "w".into(),
            key: vec![0],
            max_parallelism: 8,
            key_groups: (0, 8),
            incremental: true,
            full_every: 5,
            background_full_image_above: u64::MAX,
            full_images: Default::default(),
            store: None,
        };
        WindowOperator::new(ctx, &spec(kind, size, slide), &["k".to_string(), "v".to_string()], None).unwrap()
    }

    /// Checkpoints `w` and builds the operator of `spec` restored from that checkpoint.
    fn checkpoint_and_restore(w: &mut WindowOperator, spec: &WindowSpec) -> WindowOperator {
        let snap = w.snapshot(&Barrier { id: 1, target: crate::message::SnapshotTarget::Checkpoint }).unwrap();
        let restore = KeyedRestore {
            files: vec![crate::restore::KeyedFile::Memory {
                data: snap.keyed.unwrap().data,
                puts_from: None,
                shard_starts: None,
                in_window_order: false,
            }],
            continue_chain: true,
            chain: vec![],
            chain_tables: vec![],
            tables: vec![],
            lazy_tables: vec![],
            operator_docs: vec![(w.ctx.key_groups, snap.operator_doc.unwrap())],
            entries: None,
            adoptable: None,
            int_keys: false,
            faulted_tables: None,
        };
        WindowOperator::new(w.ctx.clone(), spec, &["k".to_string(), "v".to_string()], Some(&restore)).unwrap()
    }

    fn rec(k: &str, t: i64) -> Record {
        Record { time: t, fields: smallvec::smallvec![Value::str(k), Value::Int(t)] }
    }

    fn rows(out: &[Record]) -> Vec<(String, i64, i64, i64, i64)> {
        let int = |v: &Value| if let Value::Int(i) = v { *i } else { panic!("{v:?}") };
        let mut r: Vec<_> = out
            .iter()
            .map(|r| {
                (r.fields[0].to_string(), int(&r.fields[1]), int(&r.fields[2]), int(&r.fields[3]), int(&r.fields[4]))
            })
            .collect();
        r.sort();
        r
    }

    /// What windows should hold, computed the obvious way.
    fn brute_force(records: &[(&str, i64)], size: i64, slide: i64) -> Vec<(String, i64, i64, i64, i64)> {
        let mut m: BTreeMap<(String, i64), (i64, i64)> = BTreeMap::new();
        for (k, t) in records {
            let mut s = t - t.rem_euclid(slide);
            while s > t - size {
                let e = m.entry((k.to_string(), s)).or_default();
                e.0 += 1;
                e.1 += t;
                s -= slide;
            }
        }
        m.into_iter().map(|((k, s), (n, sum))| (k, s, s + size, n, sum)).collect()
    }

    #[test]
    fn tumbling_windows_fire_on_watermark() {
        let late_metric = prometheus_client::metrics::counter::Counter::default();
        let mut w = op(WindowKind::Tumbling, 10, None).counting_late_records_in(late_metric.clone());
        let mut out = Vec::new();
        w.process(vec![rec("a", 1), rec("a", 9), rec("b", 5), rec("a", 10)], &mut out).unwrap();
        w.on_watermark(9, &mut out).unwrap();
        assert!(out.is_empty(), "window [0,10) ends at 10");
        w.on_watermark(10, &mut out).unwrap();
        assert_eq!(rows(&out), vec![("a".into(), 0, 10, 2, 10), ("b".into(), 0, 10, 1, 5)]);
        // A record behind the watermark is late.
        w.process(vec![rec("a", 3)], &mut out).unwrap();
        assert_eq!(w.late_records(), 1);
        assert_eq!(late_metric.get(), 1, "the job's metric counts it too");
        out.clear();
        w.on_watermark(i64::MAX, &mut out).unwrap();
        assert_eq!(rows(&out), vec![("a".into(), 10, 20, 1, 10)]);
        assert_eq!(w.state.cached_len(), 0, "fired windows leave no state");
    }

    #[test]
    fn sliding_windows_match_brute_force_with_gaps_and_out_of_order_panes() {
        for (size, slide) in [(10, 5), (10, 3), (6, 6), (12, 4)] {
            let mut w = op(WindowKind::Sliding, size as u64, Some(slide as u64));
            let records = [("a", 7), ("a", 1), ("b", 40), ("a", 33), ("a", 2), ("b", 41), ("a", 90), ("a", 60)];
            let mut out = Vec::new();
            // Feed in chunks with watermarks that never make a record late.
            w.process(records[..5].iter().map(|(k, t)| rec(k, *t)).collect(), &mut out).unwrap();
            w.on_watermark(0, &mut out).unwrap();
            w.process(records[5..].iter().map(|(k, t)| rec(k, *t)).collect(), &mut out).unwrap();
            w.on_watermark(35, &mut out).unwrap();
            w.on_watermark(i64::MAX, &mut out).unwrap();
            assert_eq!(w.late_records(), 0);
            assert_eq!(rows(&out), brute_force(&records, size, slide), "size {size} slide {slide}");
        }
    }

    #[test]
    fn a_record_after_some_of_its_windows_fired_joins_only_the_later_ones() {
        let mut w = op(WindowKind::Sliding, 10, Some(2));
        let mut out = Vec::new();
        w.process(vec![rec("a", 1)], &mut out).unwrap();
        w.on_watermark(12, &mut out).unwrap();
        w.process(vec![rec("a", 9)], &mut out).unwrap();
        w.on_watermark(i64::MAX, &mut out).unwrap();
        let mut expected: Vec<_> = (-8..=0).step_by(2).map(|s| ("a".to_string(), s, s + 10, 1, 1)).collect();
        expected.extend([4, 6, 8].map(|s| ("a".to_string(), s, s + 10, 1, 9)));
        expected.sort();
        assert_eq!(rows(&out), expected, "no window is emitted twice");
    }

    #[test]
    fn state_survives_a_snapshot_and_restore() {
        let mut w = op(WindowKind::Sliding, 10, Some(5));
        let mut out = Vec::new();
        w.process(vec![rec("a", 7), rec("a", 12)], &mut out).unwrap();
        w.on_watermark(10, &mut out).unwrap();
        let mut r = checkpoint_and_restore(&mut w, &spec(WindowKind::Sliding, 10, Some(5)));
        let mut rest = Vec::new();
        r.on_watermark(i64::MAX, &mut rest).unwrap();
        let mut all = out.clone();
        all.extend(rest);
        assert_eq!(rows(&all), brute_force(&[("a", 7), ("a", 12)], 10, 5));
    }

    /// Shrunk from the model test: a window that fired before the checkpoint stayed closed only
    /// while the watermark lived in memory; restored, a late record opened it and it fired again.
    #[test]
    fn a_window_fired_before_the_checkpoint_stays_fired_after_a_restore() {
        let mut w = op(WindowKind::Tumbling, 10, None);
        let mut out = Vec::new();
        w.process(vec![rec("a", 3)], &mut out).unwrap();
        w.on_watermark(10, &mut out).unwrap();
        assert_eq!(rows(&out), vec![("a".to_string(), 0, 10, 1, 3)]);
        let mut r = checkpoint_and_restore(&mut w, &spec(WindowKind::Tumbling, 10, None));
        let mut rest = Vec::new();
        r.process(vec![rec("a", 5)], &mut rest).unwrap();
        r.on_watermark(i64::MAX, &mut rest).unwrap();
        assert!(rest.is_empty(), "window [0, 10) fired twice: {:?}", rows(&rest));
        assert_eq!(r.late_records(), 1);
    }

    #[test]
    fn rescaled_key_groups_keep_their_previous_owners_watermarks() {
        let entries = [((0, 8), 5), ((8, 16), 9)];
        assert_eq!(restored_watermarks(&entries, (4, 12)), (5, vec![((8, 12), 9)]));
        assert_eq!(restored_watermarks(&entries, (0, 8)), (5, vec![]));
        assert_eq!(restored_watermarks(&entries, (8, 16)), (9, vec![]));
        // A key group nobody covered has no watermark yet.
        assert_eq!(restored_watermarks(&[((0, 4), 7)], (0, 8)), (i64::MIN, vec![((0, 4), 7)]));
        // Documents round-trip, floors included.
        let (kg, wm) = ((0u32, 8u32), 3i64);
        let mut w = op(WindowKind::Tumbling, 10, None);
        w.watermark = wm;
        w.floors = vec![((2, 4), 9), ((4, 6), 1)];
        let decoded = decode_watermarks(&[(kg, w.watermark_doc())]).unwrap();
        assert_eq!(decoded, vec![(kg, 3), ((2, 4), 9)]);
    }

    /// Window panes and timers against a model: random records (keys that come and go, some
    /// behind the watermark), watermarks, checkpoints (full and incremental) and crashes
    /// restored from the last checkpoint at parallelism 1 to 3, with the records since that
    /// checkpoint replayed as a source would: the committed output (what was emitted up to
    /// each restored checkpoint, then everything after) must be exactly the windows computed
    /// the obvious way, each record in the windows that had not fired when it came.
    mod model {
        use proptest::prelude::*;

        use super::*;
        use crate::restore::KeyedFile;
        use crate::state::StoreSettings;
        use crate::value::key_group_range;
        use weir_checkpoint::format::FileKind;

        const MAX_PARALLELISM: u32 = 16;

        #[derive(Clone, Debug)]
        enum Op {
            Record(i64, i64),
            Watermark(i64),
            Checkpoint,
            Crash(u32),
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                10 => (0i64..12, -14i64..9).prop_map(|(k, dt)| Op::Record(k, dt)),
                3 => (0i64..15).prop_map(Op::Watermark),
                2 => Just(Op::Checkpoint),
                1 => (1u32..=3).prop_map(Op::Crash),
            ]
        }

        fn spec(size: u64, slide: u64) -> WindowSpec {
            WindowSpec {
                kind: if size == slide { WindowKind::Tumbling } else { WindowKind::Sliding },
                size: HumanDuration::from_millis(size),
                slide: Some(HumanDuration::from_millis(slide)),
                aggregates: vec![
                    AggregateFn { function: AggregateKind::Count, field: None, output: "n".into() },
                    AggregateFn { function: AggregateKind::Sum, field: Some("v".into()), output: "s".into() },
                ],
            }
        }

        /// The subtasks of the window operator, each with its key groups and checkpoint chain.
        struct Windows {
            parts: Vec<(WindowOperator, (u32, u32), Vec<bytes::Bytes>)>,
        }

        /// One subtask's part of a checkpoint: key groups, keyed chain, watermark document.
        type Part = ((u32, u32), Vec<bytes::Bytes>, Vec<u8>);

        impl Windows {
            fn start(spec: &WindowSpec, parallelism: u32, snapshot: &[Part], store: &Option<StoreSettings>) -> Self {
                let mut parts = Vec::new();
                for s in 0..parallelism {
                    let range = key_group_range(s, MAX_PARALLELISM, parallelism);
                    let overlapping: Vec<_> =
                        snapshot.iter().filter(|(r, _, _)| r.0 < range.1 && range.0 < r.1).collect();
                    let same = overlapping.len() == 1 && overlapping[0].0 == range;
                    let files: Vec<bytes::Bytes> = overlapping.iter().flat_map(|(_, c, _)| c.iter().cloned()).collect();
                    // The rocksdb backend restores from local copies, read back in parts.
                    let restored_files = files
                        .iter()
                        .map(|f| match store {
                            Some(settings) => KeyedFile::local_for_test(&settings.parent_dir, f),
                            None => KeyedFile::Memory {
                                data: f.clone(),
                                puts_from: None,
                                shard_starts: None,
                                in_window_order: false,
                            },
                        })
                        .collect();
                    let restore = KeyedRestore {
                        files: restored_files,
                        continue_chain: same,
                        chain: vec![],
                        chain_tables: vec![],
                        tables: vec![],
                        lazy_tables: vec![],
                        operator_docs: overlapping.iter().map(|(r, _, doc)| (*r, doc.clone())).collect(),
                        entries: None,
                        adoptable: None,
                        int_keys: false,
                        faulted_tables: None,
                    };
                    let ctx = KeyedContext {
                        uid: "w".into(),
                        key: vec![0],
                        max_parallelism: MAX_PARALLELISM,
                        key_groups: range,
                        incremental: true,
                        full_every: 3,
                        background_full_image_above: u64::MAX,
                        full_images: Default::default(),
                        store: store.clone(),
                    };
                    let op = WindowOperator::new(
                        ctx,
                        spec,
                        &["k".to_string(), "v".to_string()],
                        (!snapshot.is_empty()).then_some(&restore),
                    )
                    .unwrap();
                    parts.push((op, range, if same { files } else { Vec::new() }));
                }
                Windows { parts }
            }

            fn record(&mut self, k: i64, t: i64, out: &mut Vec<Record>) {
                let r = Record { time: t, fields: smallvec::smallvec![Value::Int(k), Value::Int(t)] };
                let kg = Key::of(&r, &[0]).key_group(MAX_PARALLELISM);
                let part = self.parts.iter_mut().find(|(_, g, _)| kg >= g.0 && kg < g.1).unwrap();
                part.0.process(vec![r], out).unwrap();
            }

            fn watermark(&mut self, wm: i64, out: &mut Vec<Record>) {
                for (op, _, _) in &mut self.parts {
                    op.on_watermark(wm, out).unwrap();
                }
            }

            fn checkpoint(&mut self, id: u64) -> Vec<Part> {
                let mut snapshot = Vec::new();
                for (op, range, chain) in &mut self.parts {
                    let parts =
                        op.snapshot(&Barrier { id, target: crate::message::SnapshotTarget::Checkpoint }).unwrap();
                    let keyed = parts.keyed.unwrap();
                    if keyed.kind == FileKind::KeyedFull {
                        chain.clear();
                    }
                    chain.push(keyed.bytes());
                    snapshot.push((*range, chain.clone(), parts.operator_doc.unwrap()));
                }
                snapshot
            }
        }

        fn int(v: &Value) -> i64 {
            if let Value::Int(i) = v {
                *i
            } else {
                panic!("{v:?}")
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

            #[test]
            fn windows_equal_the_model_through_crashes_and_rescales(
                ops in proptest::collection::vec(op(), 1..150),
                (size, slide) in prop_oneof![Just((10u64, 10u64)), Just((10, 5)), Just((12, 4))],
                // The heap backend, or rocksdb with a cache of a few keys (most are evicted).
                cache in prop_oneof![Just(None), (1usize..4).prop_map(Some)]
            ) {
                let spec = spec(size, slide);
                let store = cache.map(|cache_entries| StoreSettings {
                    parent_dir: std::env::temp_dir().join("weir-state-tests"),
                    cache_entries,
                    restores_loading: Default::default(),
                });
                let mut windows = Windows::start(&spec, 2, &[], &store);
                let mut snapshot = Vec::new();
                let mut committed: Vec<Record> = Vec::new();
                let mut pending: Vec<Record> = Vec::new();
                // What a source would replay after a crash: records and watermarks since the checkpoint.
                let mut since: Vec<Op> = Vec::new();
                let (mut t, mut wm, mut id) = (0i64, i64::MIN, 0u64);
                let mut all: Vec<(i64, i64, i64)> = Vec::new();
                for op in ops {
                    match op {
                        Op::Record(k, dt) => {
                            // Mostly in event-time order; a negative `dt` is a record behind
                            // the newest, and late when all its windows have fired.
                            let at = t + dt;
                            t = t.max(at);
                            // It joins only the windows that have not fired yet.
                            all.push((k, at, wm));
                            windows.record(k, at, &mut pending);
                            since.push(Op::Record(k, at));
                        }
                        Op::Watermark(lag) => {
                            let w = (t - lag).max(wm);
                            wm = w;
                            windows.watermark(w, &mut pending);
                            since.push(Op::Watermark(w));
                        }
                        Op::Checkpoint => {
                            id += 1;
                            snapshot = windows.checkpoint(id);
                            committed.append(&mut pending);
                            since.clear();
                        }
                        Op::Crash(p) => {
                            pending.clear();
                            windows = Windows::start(&spec, p, &snapshot, &store);
                            for replay in &since {
                                match replay {
                                    Op::Record(k, t) => windows.record(*k, *t, &mut pending),
                                    Op::Watermark(w) => windows.watermark(*w, &mut pending),
                                    _ => unreachable!(),
                                }
                            }
                        }
                    }
                }
                windows.watermark(i64::MAX, &mut pending);
                committed.append(&mut pending);
                let mut got: Vec<(i64, i64, i64, i64, i64)> = committed
                    .iter()
                    .map(|r| {
                        (int(&r.fields[0]), int(&r.fields[1]), int(&r.fields[2]), int(&r.fields[3]), int(&r.fields[4]))
                    })
                    .collect();
                got.sort();
                let mut model: BTreeMap<(i64, i64), (i64, i64)> = BTreeMap::new();
                for (k, t, wm) in &all {
                    let mut s = t - t.rem_euclid(slide as i64);
                    while s > t - size as i64 {
                        if s + size as i64 > *wm {
                            let e = model.entry((*k, s)).or_default();
                            e.0 += 1;
                            e.1 += t;
                        }
                        s -= slide as i64;
                    }
                }
                let want: Vec<(i64, i64, i64, i64, i64)> =
                    model.into_iter().map(|((k, s), (n, sum))| (k, s, s + size as i64, n, sum)).collect();
                prop_assert_eq!(got, want);
            }
        }
    }
}
