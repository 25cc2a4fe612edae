//! Event-time tumbling and sliding windows with aggregates, per key. A window fires when the
//! watermark reaches its end: it emits key fields, `window_start`, `window_end` and the
//! aggregates, then its state is dropped. Records behind the watermark (late) are dropped and
//! counted.

use std::collections::BTreeMap;

use weir_checkpoint::format::{Decoder, Encoder, FormatError};
use weir_crds::job::{WindowKind, WindowSpec};

use crate::message::Barrier;
use crate::operator::{Operator, StateParts, TaskError};
use crate::operators::accumulators::{Acc, Aggregates};
use crate::operators::keyed::{snapshot_keyed, KeyedContext};
use crate::restore::KeyedRestore;
use crate::state::{KeyedState, StateValue};
use crate::value::{Key, Record, Value};

/// Open windows of one key: `(window start, accumulators)`, sorted by start.
#[derive(Clone, Debug, Default)]
pub struct KeyWindows(Vec<(i64, Vec<Acc>)>);

impl StateValue for KeyWindows {
    fn encode(&self, e: &mut Encoder) {
        e.varint(self.0.len() as u64);
        for (start, accs) in &self.0 {
            e.svarint(*start);
            e.varint(accs.len() as u64);
            for a in accs {
                a.encode(e);
            }
        }
    }

    fn decode(d: &mut Decoder<'_>) -> Result<Self, FormatError> {
        let n = d.varint()? as usize;
        let mut out = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            let start = d.svarint()?;
            let m = d.varint()? as usize;
            let mut accs = Vec::with_capacity(m.min(64));
            for _ in 0..m {
                accs.push(Acc::decode(d)?);
            }
            out.push((start, accs));
        }
        Ok(KeyWindows(out))
    }
}

/// The window operator.
pub struct WindowOperator {
    ctx: KeyedContext,
    size: i64,
    slide: i64,
    aggregates: Aggregates,
    state: KeyedState<KeyWindows>,
    /// Window end → keys with a window ending there (derived; rebuilt on restore).
    timers: BTreeMap<i64, Vec<Key>>,
    watermark: i64,
    late_records: u64,
}

impl WindowOperator {
    /// Builds the operator, restoring its state when given.
    pub fn new(ctx: KeyedContext, spec: &WindowSpec, input: &[String], restore: Option<&KeyedRestore>) -> Result<Self, TaskError> {
        let size = spec.size.as_millis() as i64;
        let slide = match spec.kind {
            WindowKind::Tumbling => size,
            WindowKind::Sliding => spec.slide.map(|s| s.as_millis() as i64).unwrap_or(size),
        };
        let state: KeyedState<KeyWindows> = ctx.state(restore)?;
        let mut timers: BTreeMap<i64, Vec<Key>> = BTreeMap::new();
        for (key, windows) in state.iter() {
            for (start, _) in &windows.0 {
                timers.entry(start + size).or_default().push(key.clone());
            }
        }
        Ok(WindowOperator { ctx, size, slide, aggregates: Aggregates::new(&spec.aggregates, input), state, timers, watermark: i64::MIN, late_records: 0 })
    }

    /// Records dropped because they were behind the watermark.
    pub fn late_records(&self) -> u64 {
        self.late_records
    }
}

impl Operator for WindowOperator {
    fn process(&mut self, batch: Vec<Record>, _out: &mut Vec<Record>) -> Result<(), TaskError> {
        for r in batch {
            // Windows containing t: starts in (t - size, t], aligned to the slide.
            let t = r.time;
            let last_start = t - t.rem_euclid(self.slide);
            let mut start = last_start;
            let key = Key::of(&r, &self.ctx.key);
            let mut any = false;
            while start > t - self.size {
                if start + self.size > self.watermark {
                    any = true;
                }
                start -= self.slide;
            }
            if !any {
                self.late_records += 1;
                continue;
            }
            let aggregates = &self.aggregates;
            let windows = self.state.update(key.clone(), KeyWindows::default);
            let mut start = last_start;
            while start > t - self.size {
                let end = start + self.size;
                if end > self.watermark {
                    match windows.0.binary_search_by_key(&start, |(s, _)| *s) {
                        Ok(i) => aggregates.add(&mut windows.0[i].1, &r),
                        Err(i) => {
                            let mut accs = aggregates.init();
                            aggregates.add(&mut accs, &r);
                            windows.0.insert(i, (start, accs));
                            self.timers.entry(end).or_default().push(key.clone());
                        }
                    }
                }
                start -= self.slide;
            }
        }
        Ok(())
    }

    fn on_watermark(&mut self, watermark: i64, out: &mut Vec<Record>) -> Result<(), TaskError> {
        if watermark <= self.watermark {
            return Ok(());
        }
        self.watermark = watermark;
        while let Some(entry) = self.timers.first_entry() {
            let end = *entry.key();
            if end > watermark {
                break;
            }
            let keys = entry.remove();
            let start = end - self.size;
            for key in keys {
                let Some(windows) = self.state.update_existing(&key) else { continue };
                let Ok(i) = windows.0.binary_search_by_key(&start, |(s, _)| *s) else { continue };
                let (_, accs) = windows.0.remove(i);
                let now_empty = windows.0.is_empty();
                let mut fields: Vec<Value> = key.values().to_vec();
                fields.push(Value::Int(start));
                fields.push(Value::Int(end));
                Aggregates::results(&accs, &mut fields);
                out.push(Record { time: end - 1, fields });
                if now_empty {
                    self.state.remove(&key);
                }
            }
        }
        Ok(())
    }

    fn snapshot(&mut self, barrier: &Barrier) -> Result<StateParts, TaskError> {
        Ok(snapshot_keyed(&mut self.state, barrier))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_crds::job::{AggregateFn, AggregateKind};
    use weir_crds::HumanDuration;

    fn op(kind: WindowKind, size: u64, slide: Option<u64>) -> WindowOperator {
        let spec = WindowSpec {
            kind,
            size: HumanDuration::from_millis(size),
            slide: slide.map(HumanDuration::from_millis),
            aggregates: vec![AggregateFn { function: AggregateKind::Count, field: None, output: "n".into() }],
        };
        let ctx = KeyedContext { uid: "w".into(), key: vec![0], max_parallelism: 8, key_groups: (0, 8), incremental: true, full_every: 5 };
        WindowOperator::new(ctx, &spec, &["k".to_string()], None).unwrap()
    }

    fn rec(k: &str, t: i64) -> Record {
        Record { time: t, fields: vec![Value::str(k)] }
    }

    #[test]
    fn tumbling_windows_fire_on_watermark() {
        let mut w = op(WindowKind::Tumbling, 10, None);
        let mut out = Vec::new();
        w.process(vec![rec("a", 1), rec("a", 9), rec("b", 5), rec("a", 10)], &mut out).unwrap();
        w.on_watermark(9, &mut out).unwrap();
        assert!(out.is_empty(), "window [0,10) ends at 10");
        w.on_watermark(10, &mut out).unwrap();
        let mut got: Vec<_> = out.iter().map(|r| (r.fields[0].to_string(), r.fields[1].clone(), r.fields[3].clone())).collect();
        got.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(got, vec![("a".into(), Value::Int(0), Value::Int(2)), ("b".into(), Value::Int(0), Value::Int(1))]);
        // A record behind the watermark is late.
        w.process(vec![rec("a", 3)], &mut out).unwrap();
        assert_eq!(w.late_records(), 1);
        out.clear();
        w.on_watermark(i64::MAX, &mut out).unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].fields[3], Value::Int(1));
        assert!(w.state.is_empty());
    }

    #[test]
    fn sliding_windows_count_each_record_size_over_slide_times() {
        let mut w = op(WindowKind::Sliding, 10, Some(5));
        let mut out = Vec::new();
        w.process(vec![rec("a", 7)], &mut out).unwrap();
        w.on_watermark(i64::MAX, &mut out).unwrap();
        let starts: Vec<_> = out.iter().map(|r| r.fields[1].clone()).collect();
        assert_eq!(starts, vec![Value::Int(0), Value::Int(5)]);
    }
}
