//! The deterministic generator: record `seq` has fields and event time that are pure functions
//! of `seq`, so any replay yields the very same records. The sequence is cut into splits
//! (`seq ≡ split mod splits`); a subtask owns the splits `i` with `i mod parallelism == subtask`
//! and emits them round-robin, so its watermark is the smallest next event time of its splits.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use smol_str::SmolStr;
use weir_crds::job::GeneratorSpec;

use crate::operator::TaskError;
use crate::sources::{Source, SourcePoll};
use crate::value::{mix64, Fields, Record, Value};

enum FieldGen {
    Sequence,
    Modulo(u64, u64),
    Word(u64, u64, Vocabulary),
    Text(u32, u64, u64, Vocabulary),
    Uniform(i64, u64, u64),
}

/// Words for `word` and `text` fields: precomputed up to a size, formatted beyond it.
#[derive(Clone)]
struct Vocabulary(Arc<Vec<SmolStr>>);

const SYLLABLES: [&str; 16] =
    ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "si", "de", "ba", "zu", "po", "fe", "gi", "ha", "jo"];

fn word_text(mut i: u64) -> String {
    let mut s = String::with_capacity(12);
    loop {
        s.push_str(SYLLABLES[(i % 16) as usize]);
        i /= 16;
        if i == 0 {
            break;
        }
    }
    s
}

impl Vocabulary {
    fn new(size: u64) -> Self {
        let n = size.min(100_000);
        Vocabulary(Arc::new((0..n).map(|i| SmolStr::from(word_text(i))).collect()))
    }

    fn word(&self, i: u64) -> SmolStr {
        match self.0.get(i as usize) {
            Some(w) => w.clone(),
            None => SmolStr::from(word_text(i)),
        }
    }

    /// Appends word `i` to `line`, without copying it into a value first.
    fn push_word(&self, i: u64, line: &mut String) {
        match self.0.get(i as usize) {
            Some(w) => line.push_str(w),
            None => line.push_str(&word_text(i)),
        }
    }
}

#[derive(Serialize, Deserialize, Default)]
struct Positions {
    /// split index → next k (the split's next sequence number is `split + k * splits`).
    splits: BTreeMap<u64, u64>,
}

/// A generator subtask.
pub struct GeneratorSource {
    fields: Vec<FieldGen>,
    count: Option<u64>,
    total_splits: u64,
    start_time: i64,
    step_ms: i64,
    /// (split index, next k), only the active ones.
    splits: Vec<(u64, u64)>,
    finished_splits: BTreeMap<u64, u64>,
    rate: Option<f64>,
    started: Instant,
    emitted: u64,
}

impl GeneratorSource {
    /// Builds subtask `subtask` of `parallelism`, from the union of restored position documents.
    pub fn new(
        spec: &GeneratorSpec,
        max_parallelism: u32,
        subtask: u32,
        parallelism: u32,
        restored: &[&[u8]],
    ) -> Result<Self, TaskError> {
        let total_splits = u64::from(spec.splits.unwrap_or(max_parallelism));
        let mut positions: BTreeMap<u64, u64> = BTreeMap::new();
        for doc in restored {
            let p: Positions = serde_json::from_slice(doc)
                .map_err(|e| TaskError::Restore { uid: "generator".into(), reason: e.to_string() })?;
            positions.extend(p.splits);
        }
        let fields = spec
            .fields
            .iter()
            .enumerate()
            .map(|(i, f)| {
                let salt = mix64((i as u64 + 1).wrapping_mul(0x2545_f491_4f6c_dd1d));
                if f.sequence.is_some() {
                    FieldGen::Sequence
                } else if let Some(m) = f.modulo {
                    FieldGen::Modulo(m, salt)
                } else if let Some(w) = &f.word {
                    FieldGen::Word(w.cardinality, salt, Vocabulary::new(w.cardinality))
                } else if let Some(t) = &f.text {
                    FieldGen::Text(t.words, t.vocabulary, salt, Vocabulary::new(t.vocabulary))
                } else if let Some(u) = &f.uniform {
                    FieldGen::Uniform(u.min, (u.max - u.min) as u64 + 1, salt)
                } else {
                    FieldGen::Sequence
                }
            })
            .collect();
        let mut splits = Vec::new();
        let mut finished_splits = BTreeMap::new();
        for split in (0..total_splits).filter(|s| s % u64::from(parallelism) == u64::from(subtask)) {
            let k = positions.get(&split).copied().unwrap_or(0);
            if spec.count.is_some_and(|c| split + k * total_splits >= c) {
                finished_splits.insert(split, k);
            } else {
                splits.push((split, k));
            }
        }
        Ok(GeneratorSource {
            fields,
            count: spec.count,
            total_splits,
            start_time: spec.start_time_ms,
            step_ms: spec.time_step.as_millis() as i64,
            splits,
            finished_splits,
            rate: spec.rate_per_second.map(|r| r as f64 / f64::from(parallelism)),
            started: Instant::now(),
            emitted: 0,
        })
    }

    #[inline]
    fn record(&self, seq: u64) -> Record {
        let mut fields = Fields::with_capacity(self.fields.len());
        for f in &self.fields {
            fields.push(match f {
                FieldGen::Sequence => Value::Int(seq as i64),
                FieldGen::Modulo(m, salt) => Value::Int((mix64(seq ^ salt) % m) as i64),
                FieldGen::Word(card, salt, vocab) => Value::Str(vocab.word(mix64(seq ^ salt) % card)),
                FieldGen::Text(words, vocab_size, salt, vocab) => {
                    let mut line = String::with_capacity((*words as usize).min(1024) * 12);
                    for j in 0..u64::from(*words) {
                        if j > 0 {
                            line.push(' ');
                        }
                        vocab.push_word(
                            mix64(seq.wrapping_mul(1_000_003).wrapping_add(j) ^ salt) % vocab_size,
                            &mut line,
                        );
                    }
                    Value::str(&line)
                }
                FieldGen::Uniform(min, span, salt) => Value::Int(min.wrapping_add((mix64(seq ^ salt) % span) as i64)),
            });
        }
        Record { time: self.start_time.wrapping_add((seq as i64).wrapping_mul(self.step_ms)), fields }
    }
}

impl Source for GeneratorSource {
    fn poll(&mut self, out: &mut Vec<Record>, max: usize) -> Result<SourcePoll, TaskError> {
        if self.splits.is_empty() {
            return Ok(SourcePoll::Finished);
        }
        let mut budget = max;
        if let Some(rate) = self.rate {
            let allowed = (self.started.elapsed().as_secs_f64() * rate) as u64 + 1;
            if self.emitted >= allowed {
                let wait = Duration::from_secs_f64(((self.emitted + 1 - allowed) as f64 / rate).min(0.05));
                return Ok(SourcePoll::Idle(wait.max(Duration::from_millis(1))));
            }
            budget = budget.min((allowed - self.emitted) as usize);
        }
        let per_split = budget.div_ceil(self.splits.len()).max(1);
        let mut produced = 0;
        let mut i = 0;
        while i < self.splits.len() && produced < budget {
            let (split, mut k) = self.splits[i];
            let take = per_split.min(budget - produced);
            for _ in 0..take {
                let seq = split + k * self.total_splits;
                if self.count.is_some_and(|c| seq >= c) {
                    break;
                }
                out.push(self.record(seq));
                k += 1;
                produced += 1;
            }
            self.splits[i].1 = k;
            if self.count.is_some_and(|c| split + k * self.total_splits >= c) {
                self.finished_splits.insert(split, k);
                self.splits.remove(i);
            } else {
                i += 1;
            }
        }
        self.emitted += produced as u64;
        Ok(if produced > 0 {
            SourcePoll::Data
        } else if self.splits.is_empty() {
            SourcePoll::Finished
        } else {
            SourcePoll::Idle(Duration::from_millis(1))
        })
    }

    fn watermark(&self) -> i64 {
        self.splits
            .iter()
            .map(|(split, k)| {
                self.start_time.wrapping_add(((split + k * self.total_splits) as i64).wrapping_mul(self.step_ms)) - 1
            })
            .min()
            .unwrap_or(i64::MAX)
    }

    fn snapshot(&mut self, _checkpoint: u64) -> Vec<u8> {
        let mut p = Positions::default();
        p.splits.extend(self.splits.iter().copied());
        p.splits.extend(self.finished_splits.iter().map(|(s, k)| (*s, *k)));
        serde_json::to_vec(&p).expect("positions serialize")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_crds::job::{Empty, GeneratorField, WordField};
    use weir_crds::HumanDuration;

    fn spec(count: u64) -> GeneratorSpec {
        GeneratorSpec {
            count: Some(count),
            rate_per_second: None,
            splits: Some(8),
            start_time_ms: 0,
            time_step: HumanDuration::from_millis(1),
            fields: vec![
                GeneratorField {
                    name: "seq".into(),
                    sequence: Some(Empty {}),
                    modulo: None,
                    word: None,
                    text: None,
                    uniform: None,
                },
                GeneratorField {
                    name: "w".into(),
                    sequence: None,
                    modulo: None,
                    word: Some(WordField { cardinality: 10 }),
                    text: None,
                    uniform: None,
                },
            ],
        }
    }

    fn drain(src: &mut GeneratorSource, max: usize) -> Vec<Record> {
        let mut out = Vec::new();
        while src.poll(&mut out, max).unwrap() != SourcePoll::Finished {}
        out
    }

    #[test]
    fn every_sequence_number_exactly_once_across_subtasks() {
        let mut seen: Vec<i64> = Vec::new();
        for s in 0..3 {
            let mut g = GeneratorSource::new(&spec(1000), 128, s, 3, &[]).unwrap();
            seen.extend(drain(&mut g, 64).iter().map(|r| if let Value::Int(i) = r.fields[0] { i } else { -1 }));
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..1000).collect::<Vec<_>>());
    }

    #[test]
    fn resumes_from_positions_at_another_parallelism() {
        let mut first = Vec::new();
        let mut docs = Vec::new();
        for s in 0..2 {
            let mut g = GeneratorSource::new(&spec(1000), 128, s, 2, &[]).unwrap();
            let mut out = Vec::new();
            g.poll(&mut out, 100).unwrap();
            first.extend(out);
            docs.push(g.snapshot(0));
        }
        let refs: Vec<&[u8]> = docs.iter().map(|d| d.as_slice()).collect();
        let mut rest = Vec::new();
        for s in 0..3 {
            let mut g = GeneratorSource::new(&spec(1000), 128, s, 3, &refs).unwrap();
            rest.extend(drain(&mut g, 50));
        }
        let mut all: Vec<Record> = first.into_iter().chain(rest).collect();
        all.sort_by_key(|r| r.time);
        assert_eq!(all.len(), 1000);
        let again = GeneratorSource::new(&spec(1000), 128, 0, 1, &[]).unwrap();
        assert_eq!(all[417], again.record(417), "same record for the same sequence number");
    }

    #[test]
    fn watermark_is_the_smallest_next_time() {
        let mut g = GeneratorSource::new(&spec(100), 128, 0, 1, &[]).unwrap();
        assert_eq!(g.watermark(), -1);
        let mut out = Vec::new();
        g.poll(&mut out, 16).unwrap();
        assert_eq!(g.watermark(), 15, "2 per split over 8 splits: next seq is 16");
        drain(&mut g, 1000);
        assert_eq!(g.watermark(), i64::MAX);
    }
}
