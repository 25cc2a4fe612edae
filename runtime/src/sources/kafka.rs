//! The Kafka source: partitions are the splits. Partition `p` of topic `t` belongs to subtask
//! `(start(t) + p) mod parallelism`, where `start(t)` is a stable hash of the topic name, so
//! the assignment depends only on the parallelism, and the positions of a restored snapshot
//! (the union of every subtask's) go with their partitions. A position is the next offset to
//! read; it is restored exactly, never taken from the consumer group, to which offsets are only
//! committed on checkpoint completion so lag shows in the usual tools.
//!
//! Event time is the record timestamp. Each partition's watermark trails its newest timestamp
//! by `maxOutOfOrderness`; the subtask's is the smallest over its partitions that yielded a
//! record within `idleTimeout` (or the largest, when all are idle).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use serde::{Deserialize, Serialize};
use weir_crds::job::{KafkaFormat, KafkaSourceSpec, KafkaStartFrom};

use crate::kafka::{self, REQUEST_TIMEOUT};
use crate::operator::TaskError;
use crate::sources::{Source, SourcePoll};
use crate::value::{Fields, Record, Value};

#[derive(Serialize, Deserialize, Default)]
struct Positions {
    /// `topic` → partition → next offset to read.
    topics: BTreeMap<String, BTreeMap<i32, i64>>,
    /// `topic` → partition → newest record timestamp read: a restored partition's watermark
    /// continues from there instead of starting over (absent in snapshots of older versions).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    max_ts: BTreeMap<String, BTreeMap<i32, i64>>,
}

/// The subtask that reads partition `partition` of `topic`.
pub fn owner(topic: &str, partition: i32, parallelism: u32) -> u32 {
    let start = crc32c::crc32c(topic.as_bytes()) % parallelism;
    ((start as u64 + partition as u64) % parallelism as u64) as u32
}

struct PartitionState {
    /// Next offset to read (unknown until the first record when starting without state).
    next: Option<i64>,
    /// End offset of a bounded read.
    end: Option<i64>,
    /// Newest timestamp seen.
    max_ts: i64,
    last_record: Instant,
}

/// A Kafka source subtask.
pub struct KafkaSource {
    spec: KafkaSourceSpec,
    subtask: u32,
    parallelism: u32,
    consumer: kafka::CheckedConsumer,
    partitions: BTreeMap<(String, i32), PartitionState>,
    /// Positions of each snapshot until its checkpoint completes (then committed to the group).
    snapshots: BTreeMap<u64, TopicPartitionList>,
    next_discovery: Option<Instant>,
    /// Newest timestamps of the restored partitions (see [`Positions::max_ts`]).
    restored_max_ts: HashMap<(String, i32), i64>,
    fields: Vec<String>,
    out_of_orderness: i64,
    idle_timeout: Duration,
}

fn read_error(spec: &KafkaSourceSpec, e: impl std::fmt::Display) -> TaskError {
    TaskError::Read {
        what: format!("kafka topics {} on {}", spec.topics.join(", "), spec.bootstrap_servers),
        reason: e.to_string(),
    }
}

impl KafkaSource {
    /// Builds subtask `subtask` of `parallelism` of a job named `job`, from the union of the
    /// restored positions.
    pub fn new(
        spec: &KafkaSourceSpec,
        job: &str,
        subtask: u32,
        parallelism: u32,
        restored: &[&[u8]],
    ) -> Result<Self, TaskError> {
        let fail = |e: &dyn std::fmt::Display| read_error(spec, e);
        let mut config: ClientConfig =
            kafka::client_config(&spec.bootstrap_servers, &spec.properties).map_err(|e| fail(&e))?;
        let group = spec.group_id.clone().unwrap_or_else(|| format!("weir-{job}"));
        config
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "true")
            .set("isolation.level", if spec.read_committed { "read_committed" } else { "read_uncommitted" });
        let consumer: kafka::CheckedConsumer =
            config.create_with_context(kafka::ErrorCapture::default()).map_err(|e| fail(&e))?;
        let mut restored_positions: HashMap<(String, i32), i64> = HashMap::new();
        let mut restored_max_ts: HashMap<(String, i32), i64> = HashMap::new();
        for doc in restored {
            let p: Positions = serde_json::from_slice(doc)
                .map_err(|e| TaskError::Restore { uid: "kafka".into(), reason: e.to_string() })?;
            for (topic, parts) in p.topics {
                for (partition, offset) in parts {
                    restored_positions.insert((topic.clone(), partition), offset);
                }
            }
            for (topic, parts) in p.max_ts {
                for (partition, ts) in parts {
                    restored_max_ts.insert((topic.clone(), partition), ts);
                }
            }
        }
        let fields = match spec.format {
            KafkaFormat::Raw => vec!["value".to_string()],
            KafkaFormat::Json => spec.fields.clone(),
        };
        let mut source = KafkaSource {
            spec: spec.clone(),
            subtask,
            parallelism,
            consumer,
            partitions: BTreeMap::new(),
            snapshots: BTreeMap::new(),
            next_discovery: None,
            restored_max_ts,
            fields,
            out_of_orderness: spec.max_out_of_orderness.as_millis() as i64,
            idle_timeout: Duration::from_millis(spec.idle_timeout.as_millis()),
        };
        source.assign_new(&restored_positions, true)?;
        Ok(source)
    }

    /// Looks up the topics' partitions and starts reading those of this subtask it does not
    /// read yet: from the restored position, else (at the first start) from `startFrom`, else
    /// (a partition added while running) from the beginning.
    fn assign_new(&mut self, restored: &HashMap<(String, i32), i64>, first: bool) -> Result<(), TaskError> {
        let spec = &self.spec;
        let found = kafka::topic_metadata(&self.consumer, &spec.bootstrap_servers, &spec.topics)
            .map_err(|e| read_error(spec, e))?;
        let mut added = Vec::new();
        for (topic, ids) in &found {
            for &p in ids {
                if owner(topic, p, self.parallelism) == self.subtask
                    && !self.partitions.contains_key(&(topic.clone(), p))
                {
                    added.push((topic.clone(), p));
                }
            }
        }
        if added.is_empty() && !first {
            return Ok(());
        }
        let mut start = TopicPartitionList::new();
        for (topic, p) in &added {
            let offset = match restored.get(&(topic.clone(), *p)) {
                Some(&o) => Offset::Offset(o),
                None if !first => Offset::Beginning,
                None => match spec.start_from {
                    KafkaStartFrom::Earliest => Offset::Beginning,
                    KafkaStartFrom::Latest => Offset::End,
                    KafkaStartFrom::GroupOffsets | KafkaStartFrom::Timestamp => Offset::Invalid,
                },
            };
            if offset == Offset::Invalid {
                // Resolved below (group offsets, timestamp).
                start.add_partition(topic, *p);
            } else {
                start.add_partition_offset(topic, *p, offset).map_err(|e| read_error(spec, e))?;
            }
        }
        self.resolve_start(&mut start)?;
        for (topic, p) in added {
            let start_at = start.find_partition(&topic, p).map(|e| e.offset());
            let high = if spec.bounded || start_at == Some(Offset::End) {
                let (_, high) =
                    self.consumer.fetch_watermarks(&topic, p, REQUEST_TIMEOUT).map_err(|e| read_error(spec, e))?;
                Some(high)
            } else {
                None
            };
            let end = high.filter(|_| spec.bounded);
            // "The end" becomes an offset now, so that the first checkpoint records it: a
            // restart before the first record must not skip what arrived in between.
            let next = match start_at {
                Some(Offset::Offset(o)) => Some(o),
                Some(Offset::End) => high,
                _ => None,
            };
            let max_ts = self.restored_max_ts.get(&(topic.clone(), p)).copied().unwrap_or(i64::MIN);
            self.partitions.insert((topic, p), PartitionState { next, end, max_ts, last_record: Instant::now() });
        }
        let mut all = TopicPartitionList::new();
        for ((topic, p), st) in &self.partitions {
            let offset = st
                .next
                .map(Offset::Offset)
                .unwrap_or_else(|| start.find_partition(topic, *p).map(|e| e.offset()).unwrap_or(Offset::Beginning));
            all.add_partition_offset(topic, *p, offset).map_err(|e| read_error(spec, e))?;
        }
        self.consumer.assign(&all).map_err(|e| read_error(spec, e))?;
        Ok(())
    }

    /// Turns group-offset and timestamp starts into offsets.
    fn resolve_start(&self, start: &mut TopicPartitionList) -> Result<(), TaskError> {
        let spec = &self.spec;
        let unresolved: Vec<(String, i32)> = start
            .elements()
            .iter()
            .filter(|e| e.offset() == Offset::Invalid)
            .map(|e| (e.topic().to_string(), e.partition()))
            .collect();
        if unresolved.is_empty() {
            return Ok(());
        }
        let mut ask = TopicPartitionList::new();
        for (t, p) in &unresolved {
            ask.add_partition(t, *p);
        }
        let resolved = match spec.start_from {
            KafkaStartFrom::GroupOffsets => {
                self.consumer.committed_offsets(ask, REQUEST_TIMEOUT).map_err(|e| read_error(spec, e))?
            }
            _ => {
                let ts = spec.start_timestamp_ms.unwrap_or(0);
                let mut times = TopicPartitionList::new();
                for (t, p) in &unresolved {
                    times.add_partition_offset(t, *p, Offset::Offset(ts)).map_err(|e| read_error(spec, e))?;
                }
                self.consumer.offsets_for_times(times, REQUEST_TIMEOUT).map_err(|e| read_error(spec, e))?
            }
        };
        for (t, p) in unresolved {
            let offset = match resolved.find_partition(&t, p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => Offset::Offset(o),
                // No committed offset: the oldest record. No record at or after the timestamp:
                // the end.
                _ if spec.start_from == KafkaStartFrom::GroupOffsets => Offset::Beginning,
                _ => Offset::End,
            };
            start.set_partition_offset(&t, p, offset).map_err(|e| read_error(spec, e))?;
        }
        Ok(())
    }

    fn record(&self, m: &rdkafka::message::BorrowedMessage<'_>) -> Result<Record, TaskError> {
        let text = |b: Option<&[u8]>| b.map_or(Value::Null, |b| Value::str(&String::from_utf8_lossy(b)));
        let mut fields = Fields::with_capacity(self.fields.len() + 6);
        match self.spec.format {
            KafkaFormat::Raw => fields.push(text(m.payload())),
            KafkaFormat::Json => {
                let parsed: serde_json::Value = match m.payload() {
                    None => serde_json::Value::Null,
                    Some(b) => serde_json::from_slice(b).map_err(|e| TaskError::Read {
                        what: format!("{}[{}] offset {}", m.topic(), m.partition(), m.offset()),
                        reason: format!("the value is not JSON: {e}"),
                    })?,
                };
                for f in &self.fields {
                    fields.push(json_value(parsed.get(f)));
                }
            }
        }
        let ts = m.timestamp().to_millis().unwrap_or(0);
        fields.push(text(m.key()));
        fields.push(Value::str(m.topic()));
        fields.push(Value::Int(m.partition() as i64));
        fields.push(Value::Int(m.offset()));
        fields.push(Value::Int(ts));
        let headers = match m.headers() {
            None => Value::str("{}"),
            Some(h) => {
                let map: serde_json::Map<String, serde_json::Value> = h
                    .iter()
                    .map(|h| {
                        let v = h.value.map_or(serde_json::Value::Null, |v| String::from_utf8_lossy(v).into());
                        (h.key.to_string(), v)
                    })
                    .collect();
                Value::str(&serde_json::Value::Object(map).to_string())
            }
        };
        fields.push(headers);
        Ok(Record { time: ts, fields })
    }

    fn all_ended(&self) -> bool {
        self.spec.bounded
            && self.partitions.values().all(|st| match (st.next, st.end) {
                (Some(n), Some(e)) => n >= e,
                (None, Some(e)) => e == 0,
                _ => false,
            })
    }
}

fn json_value(v: Option<&serde_json::Value>) -> Value {
    match v {
        None | Some(serde_json::Value::Null) => Value::Null,
        Some(serde_json::Value::Bool(b)) => Value::Bool(*b),
        Some(serde_json::Value::Number(n)) => match n.as_i64() {
            Some(i) => Value::Int(i),
            None => Value::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Some(serde_json::Value::String(s)) => Value::str(s),
        Some(other) => Value::str(&other.to_string()),
    }
}

impl Source for KafkaSource {
    fn poll(&mut self, out: &mut Vec<Record>, max: usize) -> Result<SourcePoll, TaskError> {
        let interval = self.spec.partition_discovery_interval.as_millis();
        if interval > 0 && !self.spec.bounded {
            let now = Instant::now();
            match self.next_discovery {
                Some(at) if now < at => {}
                Some(_) => {
                    self.assign_new(&HashMap::new(), false)?;
                    self.next_discovery = Some(now + Duration::from_millis(interval));
                }
                None => self.next_discovery = Some(now + Duration::from_millis(interval)),
            }
        }
        if self.all_ended() {
            return Ok(SourcePoll::Finished);
        }
        let mut wait = Duration::from_millis(50);
        while out.len() < max {
            let polled = self.consumer.poll(wait);
            wait = Duration::ZERO;
            match polled {
                None => break,
                Some(Err(KafkaError::PartitionEOF(p))) => {
                    // Caught up. A bounded read of a partition is over once the consumer's
                    // position passed the end (control records of transactions may follow the
                    // last record, so the last record's offset + 1 may fall short of it).
                    if self.spec.bounded {
                        let positions = self.consumer.position().map_err(|e| read_error(&self.spec, e))?;
                        for ((topic, partition), st) in self.partitions.iter_mut() {
                            let at = positions.find_partition(topic, *partition).and_then(|e| e.offset().to_raw());
                            if *partition == p && st.end.is_some_and(|e| at.is_some_and(|a| a >= e)) {
                                st.next = Some(st.next.unwrap_or(0).max(at.unwrap_or(0)));
                            }
                        }
                    }
                }
                Some(Err(e)) => return Err(read_error(&self.spec, e)),
                Some(Ok(m)) => {
                    let key = (m.topic().to_string(), m.partition());
                    let record = self.record(&m)?;
                    let Some(st) = self.partitions.get_mut(&key) else { continue };
                    if st.end.is_some_and(|e| m.offset() >= e) {
                        continue;
                    }
                    st.next = Some(m.offset() + 1);
                    st.max_ts = st.max_ts.max(record.time);
                    st.last_record = Instant::now();
                    out.push(record);
                }
            }
        }
        if !out.is_empty() {
            return Ok(SourcePoll::Data);
        }
        if self.all_ended() {
            return Ok(SourcePoll::Finished);
        }
        Ok(SourcePoll::Idle(Duration::from_millis(10)))
    }

    fn watermark(&self) -> i64 {
        if self.all_ended() {
            return i64::MAX;
        }
        let now = Instant::now();
        let active = self.partitions.values().filter(|st| now.duration_since(st.last_record) < self.idle_timeout);
        let wm = |st: &PartitionState| st.max_ts.saturating_sub(self.out_of_orderness);
        match active.map(wm).min() {
            Some(w) => w,
            None => self.partitions.values().map(wm).max().unwrap_or(i64::MIN),
        }
    }

    fn snapshot(&mut self, checkpoint: u64) -> Vec<u8> {
        let mut positions = Positions::default();
        let mut commit = TopicPartitionList::new();
        for ((topic, p), st) in &self.partitions {
            if let Some(next) = st.next {
                positions.topics.entry(topic.clone()).or_default().insert(*p, next);
                let _ = commit.add_partition_offset(topic, *p, Offset::Offset(next));
            }
            if st.max_ts > i64::MIN {
                positions.max_ts.entry(topic.clone()).or_default().insert(*p, st.max_ts);
            }
        }
        self.snapshots.insert(checkpoint, commit);
        serde_json::to_vec(&positions).expect("positions serialize")
    }

    fn on_checkpoint_complete(&mut self, checkpoint: u64) {
        let Some(positions) = self.snapshots.remove(&checkpoint) else { return };
        self.snapshots.retain(|&id, _| id > checkpoint);
        if positions.count() == 0 {
            return;
        }
        // For lag monitoring only: a failure here loses nothing. The last commit of a bounded
        // read waits, so that the group shows the end once the job has finished.
        let mode = if self.all_ended() { CommitMode::Sync } else { CommitMode::Async };
        if let Err(e) = self.consumer.commit(&positions, mode) {
            tracing::debug!(error = %e, "committing offsets to the consumer group");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_partition_has_one_owner_and_owners_are_spread() {
        for parallelism in 1..6u32 {
            let mut load = vec![0; parallelism as usize];
            for p in 0..12 {
                let o = owner("events", p, parallelism);
                assert!(o < parallelism);
                load[o as usize] += 1;
            }
            let (min, max) = (load.iter().min().unwrap(), load.iter().max().unwrap());
            assert!(max - min <= 1, "round robin from a start: {load:?}");
        }
        assert_eq!(owner("a", 3, 4), owner("a", 3, 4), "stable");
    }

    #[test]
    fn positions_keep_each_partitions_newest_timestamp_and_read_older_snapshots() {
        let old: Positions = serde_json::from_str(r#"{"topics":{"t":{"0":5}}}"#).unwrap();
        assert_eq!(old.topics["t"][&0], 5);
        assert!(old.max_ts.is_empty(), "a snapshot without timestamps restores with none");
        let mut p = Positions::default();
        p.topics.entry("t".into()).or_default().insert(1, 9);
        p.max_ts.entry("t".into()).or_default().insert(1, 1_700_000_000_000);
        let back: Positions = serde_json::from_slice(&serde_json::to_vec(&p).unwrap()).unwrap();
        assert_eq!(back.max_ts["t"][&1], 1_700_000_000_000);
    }
}
