//! The Kafka sink: `at-least-once` (records sent as they come, flushed on every barrier) and
//! `exactly-once` by two-phase commit with librdkafka as it is.
//!
//! librdkafka cannot resume a transaction another producer opened, so exactly-once never
//! carries an open transaction across a checkpoint:
//! - **begin**: records of the open checkpoint are buffered (key, value, headers);
//! - **pre-commit** on barrier N: the buffer is staged in the job's checkpoint storage
//!   (`kafka-staging/<uid>/<epoch>-<N>-<subtask>.records`) before the task acknowledges N, and
//!   its committable goes into the snapshot;
//! - **commit** when checkpoint N completes: the staged records are sent in one Kafka
//!   transaction together with a [`CommitMarker`] under key `<prefix>/<uid>/<subtask>/<epoch>`
//!   in the compacted marker topic; then the staged file is deleted;
//! - **recovery** before a (re)start ([`recover`]): a producer is initialised for every
//!   transactional id this sink may have used (`<prefix>-<uid>-<subtask>`, for the subtasks of
//!   the restored state and of the new run), which fences any producer of an earlier run still
//!   alive and aborts its open transaction. Then the markers are read `read_committed`, and
//!   exactly the restored committables that no marker covers are sent again, each in its own
//!   transaction with its marker. A crash anywhere (before staging, after staging, after the
//!   checkpoint completed but before the commit, during the commit, after it) therefore ends
//!   with each checkpoint's records in the topic once. A transaction the broker aborted on
//!   timeout is the same case: its marker is absent, its records are sent again.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::ClientContext;
use serde::{Deserialize, Serialize};
use weir_checkpoint::Storage;
use weir_crds::job::{KafkaDelivery, KafkaFormat, KafkaSinkSpec};

use crate::faults::{Fault, Faults};
use crate::kafka::{self, encode_record, CommitMarker, KafkaClientError, OutRecord};
use crate::message::Barrier;
use crate::metrics::JobMetrics;
use crate::operator::{Operator, StagedWrite, StateParts, TaskError};
use crate::sinks::file::Committable;
use crate::value::{Record, Value};

/// Directory of staged checkpoint records in the job's checkpoint storage.
pub const STAGING_DIR: &str = "kafka-staging";

/// How long a transaction's commit, or a flush, may take.
const COMMIT_TIMEOUT: Duration = Duration::from_secs(60);

/// The committable URL of a Kafka sink (for messages; its commits are recorded by markers in
/// Kafka, so none is reported to the file sinks' commit manifests).
pub fn sink_url(topic: &str) -> String {
    format!("kafka://{topic}")
}

/// Staged object of `(uid, epoch, checkpoint, subtask)` in the job's checkpoint storage.
pub fn staged_path(uid: &str, epoch: u64, checkpoint: u64, subtask: u32) -> String {
    format!("{STAGING_DIR}/{uid}/{epoch:06}-{checkpoint:010}-{subtask}.records")
}

/// The transactional id of a subtask.
pub fn transactional_id(prefix: &str, uid: &str, subtask: u32) -> String {
    format!("{prefix}-{uid}-{subtask}")
}

/// The prefix of a sink's transactional ids and marker keys.
pub fn id_prefix(spec: &KafkaSinkSpec, job: &str) -> String {
    spec.transactional_id_prefix.clone().unwrap_or_else(|| format!("weir-{job}"))
}

#[derive(Serialize, Deserialize, Default)]
struct SinkState {
    pending: Vec<Committable>,
    #[serde(default)]
    parallelism: u32,
}

/// Keeps the first delivery error of a producer.
#[derive(Clone, Default)]
pub struct DeliveryErrors(Arc<Mutex<Option<String>>>);

impl DeliveryErrors {
    fn take(&self) -> Option<String> {
        self.0.lock().expect("not poisoned").take()
    }
}

impl ClientContext for DeliveryErrors {}

impl ProducerContext for DeliveryErrors {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        if let Err((e, _)) = result {
            self.0.lock().expect("not poisoned").get_or_insert_with(|| e.to_string());
        }
    }
}

type KafkaProducer = ThreadedProducer<DeliveryErrors>;

fn producer_config(spec: &KafkaSinkSpec, transactional_id: Option<&str>) -> Result<ClientConfig, KafkaClientError> {
    let mut c = kafka::client_config(&spec.bootstrap_servers, &spec.properties)?;
    c.set("partitioner", spec.partitioner.as_deref().unwrap_or("murmur2_random"));
    c.set("enable.idempotence", "true");
    if let Some(id) = transactional_id {
        c.set("transactional.id", id);
        c.set("transaction.timeout.ms", spec.transaction_timeout.as_millis().to_string());
    }
    Ok(c)
}

fn create_producer(config: &ClientConfig) -> Result<KafkaProducer, KafkaClientError> {
    config.create_with_context(DeliveryErrors::default()).map_err(KafkaClientError::Configure)
}

/// Sends one record, waiting while librdkafka's queue is full.
fn send(producer: &KafkaProducer, topic: &str, r: &OutRecord) -> Result<(), KafkaError> {
    let mut headers = OwnedHeaders::new_with_capacity(r.headers.len());
    for (name, value) in &r.headers {
        headers = headers.insert(Header { key: name, value: Some(value) });
    }
    let mut record: BaseRecord<'_, [u8], [u8]> = BaseRecord::to(topic).payload(&r.value[..]);
    if let Some(k) = &r.key {
        record = record.key(&k[..]);
    }
    if !r.headers.is_empty() {
        record = record.headers(headers);
    }
    loop {
        match producer.send(record) {
            Ok(()) => return Ok(()),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                record = back;
                std::thread::sleep(Duration::from_millis(5));
            }
            Err((e, _)) => return Err(e),
        }
    }
}

/// Sends `records` and their marker in one transaction of `producer`.
fn commit_transaction(
    producer: &KafkaProducer,
    spec: &KafkaSinkSpec,
    marker_key: &str,
    marker: &CommitMarker,
    records: &[OutRecord],
    faults: &Faults,
) -> Result<(), KafkaError> {
    producer.begin_transaction()?;
    let sent = (|| {
        for r in records {
            send(producer, &spec.topic, r)?;
        }
        let value = serde_json::to_vec(marker).expect("a marker serializes");
        let m = OutRecord { key: Some(marker_key.as_bytes().to_vec()), value, headers: Vec::new() };
        send(producer, &spec.marker_topic, &m)?;
        if faults.fires(Fault::StallInTransaction) {
            let stall = Duration::from_millis(spec.transaction_timeout.as_millis()) + Duration::from_secs(3);
            tracing::warn!(?stall, "injected fault: a Kafka transaction stalls past its timeout");
            std::thread::sleep(stall);
        }
        if faults.fires(Fault::AbortInTransaction) {
            eprintln!("injected fault: aborting inside a Kafka transaction");
            std::process::abort();
        }
        producer.commit_transaction(COMMIT_TIMEOUT)
    })();
    if let Err(e) = sent {
        // A fenced producer cannot abort; any other failure leaves nothing behind either way:
        // the broker aborts what is not committed.
        let _ = producer.abort_transaction(COMMIT_TIMEOUT);
        return Err(e);
    }
    if faults.fires(Fault::AbortAfterTransaction) {
        eprintln!("injected fault: aborting after a Kafka transaction committed");
        std::process::abort();
    }
    Ok(())
}

/// Everything a Kafka sink subtask is built from.
pub struct KafkaSinkContext {
    /// The sink's uid.
    pub uid: String,
    /// The job's name (default transactional id prefix).
    pub job: String,
    /// This subtask.
    pub subtask: u32,
    /// Subtasks of the sink.
    pub parallelism: u32,
    /// The run's fencing epoch.
    pub epoch: u64,
    /// The input's fields.
    pub schema: Vec<String>,
    /// The job's checkpoint storage (exactly-once stages records there).
    pub storage: Storage,
    /// Metrics.
    pub metrics: Arc<JobMetrics>,
    /// Fault injection.
    pub faults: Faults,
}

/// One Kafka sink subtask.
pub struct KafkaSink {
    ctx: KafkaSinkContext,
    spec: KafkaSinkSpec,
    prefix: String,
    producer: KafkaProducer,
    errors: DeliveryErrors,
    key: Option<usize>,
    value: Option<usize>,
    headers: Vec<(String, usize)>,
    /// Exactly-once: the open checkpoint's records, encoded.
    buffer: Vec<u8>,
    buffered: u64,
    /// Exactly-once: staged and not yet committed, with the data while this run holds it.
    pending: Vec<(Committable, Bytes)>,
}

fn field_of(schema: &[String], name: &Option<String>) -> Option<usize> {
    name.as_ref().and_then(|n| schema.iter().position(|f| f == n))
}

fn text_of(v: &Value) -> Vec<u8> {
    match v {
        Value::Str(s) => s.as_bytes().to_vec(),
        other => other.to_string().into_bytes(),
    }
}

impl KafkaSink {
    /// Builds a subtask: checks the topic exists and (exactly-once) initialises its
    /// transactional producer, which fences any older producer of the same subtask.
    pub fn new(ctx: KafkaSinkContext, spec: &KafkaSinkSpec) -> Result<Self, TaskError> {
        let what = format!("kafka sink `{}`", ctx.uid);
        let fail = |e: &dyn std::fmt::Display| TaskError::Commit { what: what.clone(), reason: e.to_string() };
        let prefix = id_prefix(spec, &ctx.job);
        let exactly_once = spec.delivery == KafkaDelivery::ExactlyOnce;
        let txn_id = exactly_once.then(|| transactional_id(&prefix, &ctx.uid, ctx.subtask));
        let config = producer_config(spec, txn_id.as_deref()).map_err(|e| fail(&e))?;
        let producer = create_producer(&config).map_err(|e| fail(&e))?;
        let check: kafka::CheckedConsumer = kafka::client_config(&spec.bootstrap_servers, &spec.properties)
            .map_err(|e| fail(&e))?
            .create_with_context(kafka::ErrorCapture::default())
            .map_err(|e| fail(&e))?;
        kafka::topic_metadata(&check, &spec.bootstrap_servers, std::slice::from_ref(&spec.topic))
            .map_err(|e| fail(&e))?;
        if exactly_once {
            producer
                .init_transactions(kafka::REQUEST_TIMEOUT)
                .map_err(|e| fail(&format!("initialising transactions: {e}")))?;
        }
        let errors = DeliveryErrors::clone(producer.context());
        let schema = &ctx.schema;
        let key = field_of(schema, &spec.key_field);
        let value = if spec.format == KafkaFormat::Raw { field_of(schema, &spec.value_field) } else { None };
        let headers = spec
            .header_fields
            .iter()
            .filter_map(|h| schema.iter().position(|f| f == h).map(|i| (h.clone(), i)))
            .collect();
        Ok(KafkaSink {
            prefix,
            spec: spec.clone(),
            producer,
            errors,
            key,
            value,
            headers,
            buffer: Vec::new(),
            buffered: 0,
            pending: Vec::new(),
            ctx,
        })
    }

    fn out_record(&self, r: &Record) -> OutRecord {
        let key = self.key.and_then(|i| match &r.fields[i] {
            Value::Null => None,
            v => Some(text_of(v)),
        });
        let value = match self.value {
            Some(i) => text_of(&r.fields[i]),
            None => {
                let mut line = Vec::new();
                crate::value::write_json_line(&self.ctx.schema, r, &mut line);
                line.pop();
                line
            }
        };
        let headers = self.headers.iter().map(|(name, i)| (name.clone(), text_of(&r.fields[*i]))).collect();
        OutRecord { key, value, headers }
    }

    fn exactly_once(&self) -> bool {
        self.spec.delivery == KafkaDelivery::ExactlyOnce
    }

    fn failed(&self, e: impl std::fmt::Display) -> TaskError {
        TaskError::Commit {
            what: format!("kafka sink `{}` (topic {})", self.ctx.uid, self.spec.topic),
            reason: e.to_string(),
        }
    }

    fn state_doc(&self) -> Vec<u8> {
        let pending = self.pending.iter().map(|(c, _)| c.clone()).collect();
        serde_json::to_vec(&SinkState { pending, parallelism: self.ctx.parallelism }).expect("sink state serializes")
    }
}

impl Operator for KafkaSink {
    fn process(&mut self, batch: Vec<Record>, _out: &mut Vec<Record>) -> Result<(), TaskError> {
        if self.exactly_once() {
            for r in &batch {
                encode_record(&self.out_record(r), &mut self.buffer);
            }
            self.buffered += batch.len() as u64;
            return Ok(());
        }
        for r in &batch {
            send(&self.producer, &self.spec.topic, &self.out_record(r)).map_err(|e| self.failed(e))?;
        }
        self.ctx.metrics.records_out.inc_by(batch.len() as u64);
        if let Some(e) = self.errors.take() {
            return Err(self.failed(format!("delivery failed: {e}")));
        }
        Ok(())
    }

    fn snapshot(&mut self, barrier: &Barrier) -> Result<StateParts, TaskError> {
        if !self.exactly_once() {
            // Everything sent before the barrier is acknowledged by the broker before the
            // checkpoint is: no record of a completed checkpoint is lost.
            self.producer.flush(COMMIT_TIMEOUT).map_err(|e| self.failed(format!("flushing: {e}")))?;
            if let Some(e) = self.errors.take() {
                return Err(self.failed(format!("delivery failed: {e}")));
            }
            return Ok(StateParts::default());
        }
        let mut staged = Vec::new();
        if !self.buffer.is_empty() {
            let data = Bytes::from(std::mem::take(&mut self.buffer));
            let path = staged_path(&self.ctx.uid, self.ctx.epoch, barrier.id, self.ctx.subtask);
            let c = Committable {
                sink: sink_url(&self.spec.topic),
                uid: self.ctx.uid.clone(),
                epoch: self.ctx.epoch,
                checkpoint: barrier.id,
                subtask: self.ctx.subtask,
                staged: path.clone(),
                published: self.spec.topic.clone(),
                records: self.buffered,
                len: data.len() as u64,
                crc32c: crc32c::crc32c(&data),
            };
            staged.push(StagedWrite { storage: self.ctx.storage.clone(), path, data: data.clone() });
            self.pending.push((c, data));
            self.buffered = 0;
        }
        // `pending_commits` stays empty: it feeds the file sinks' commit manifests.
        Ok(StateParts { operator_doc: Some(self.state_doc()), staged, ..StateParts::default() })
    }

    /// Commits every staged checkpoint up to `id`. Returns nothing: the returned list feeds the
    /// file sinks' commit manifests, and these commits are recorded by their markers.
    fn on_checkpoint_complete(&mut self, id: u64) -> Result<Vec<Committable>, TaskError> {
        while self.pending.first().is_some_and(|(c, _)| c.checkpoint <= id) {
            let (c, data) = self.pending.first().cloned().expect("checked");
            let records = kafka::decode_records(&data).expect("this run encoded it");
            let key = kafka::marker_key(&self.prefix, &c.uid, c.subtask, c.epoch);
            let marker = CommitMarker { checkpoint: c.checkpoint, records: c.records, committed_by: self.ctx.epoch };
            commit_transaction(&self.producer, &self.spec, &key, &marker, &records, &self.ctx.faults)
                .map_err(|e| self.failed(format!("committing checkpoint {}: {e}", c.checkpoint)))?;
            self.ctx.metrics.records_out.inc_by(c.records);
            self.pending.remove(0);
            let storage = self.ctx.storage.clone();
            let path = c.staged.clone();
            // The records are in Kafka: the staged copy is only needed to send them again.
            if let Err(e) = crate::io().block_on(async move { storage.delete(&path).await }) {
                tracing::warn!(path = %c.staged, error = %e, "could not delete a committed staging file");
            }
        }
        Ok(Vec::new())
    }

    fn end_of_input(&mut self) -> Result<(), TaskError> {
        if self.exactly_once() {
            // Committed by the final checkpoint, which `has_uncommitted` waits for.
            return Ok(());
        }
        // Without checkpoints nothing else flushes: the job must not end before the broker
        // acknowledged every record.
        self.producer.flush(COMMIT_TIMEOUT).map_err(|e| self.failed(format!("flushing: {e}")))?;
        match self.errors.take() {
            Some(e) => Err(self.failed(format!("delivery failed: {e}"))),
            None => Ok(()),
        }
    }

    fn has_uncommitted(&self) -> bool {
        !self.pending.is_empty()
    }
}

/// What [`recover`] found and did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KafkaRecoveryReport {
    /// Transactional ids initialised (fencing older producers).
    pub fenced: usize,
    /// Restored transactions already committed (their marker was found).
    pub already_committed: usize,
    /// Restored transactions sent again.
    pub recommitted: usize,
}

/// Recovers sink `uid` before the tasks of a run of `epoch` start: fences every transactional
/// id it may have used, then commits the restored transactions no marker covers.
#[allow(clippy::too_many_arguments)]
pub fn recover(
    spec: &KafkaSinkSpec,
    job: &str,
    uid: &str,
    epoch: u64,
    parallelism: u32,
    restored_docs: &[&[u8]],
    storage: &Storage,
    faults: &Faults,
) -> Result<KafkaRecoveryReport, String> {
    let mut report = KafkaRecoveryReport::default();
    if spec.delivery != KafkaDelivery::ExactlyOnce {
        return Ok(report);
    }
    let prefix = id_prefix(spec, job);
    let base = kafka::client_config(&spec.bootstrap_servers, &spec.properties).map_err(|e| e.to_string())?;
    let max = kafka::broker_transaction_max_timeout(&base, &spec.bootstrap_servers).map_err(|e| e.to_string())?;
    if spec.transaction_timeout.as_millis() > max {
        return Err(KafkaClientError::TransactionTimeoutTooLong {
            wanted_ms: spec.transaction_timeout.as_millis(),
            max_ms: max,
        }
        .to_string());
    }
    kafka::ensure_marker_topic(&base, &spec.marker_topic).map_err(|e| e.to_string())?;
    let mut pending: BTreeSet<Committable> = BTreeSet::new();
    let mut subtasks: BTreeSet<u32> = (0..parallelism).collect();
    for doc in restored_docs {
        let state: SinkState =
            serde_json::from_slice(doc).map_err(|e| format!("reading the state of kafka sink `{uid}`: {e}"))?;
        subtasks.extend(0..state.parallelism);
        for c in state.pending {
            subtasks.insert(c.subtask);
            pending.insert(c);
        }
    }
    // Fence: a producer of an earlier run, alive or not, can commit nothing from now on, and
    // its open transaction is aborted.
    let mut producers = BTreeMap::new();
    for s in subtasks {
        let id = transactional_id(&prefix, uid, s);
        let config = producer_config(spec, Some(&id)).map_err(|e| e.to_string())?;
        let p = create_producer(&config).map_err(|e| e.to_string())?;
        p.init_transactions(kafka::REQUEST_TIMEOUT).map_err(|e| format!("fencing transactional id {id}: {e}"))?;
        producers.insert(s, p);
        report.fenced += 1;
    }
    if pending.is_empty() {
        return Ok(report);
    }
    let wait = Duration::from_millis(spec.transaction_timeout.as_millis());
    let markers = kafka::read_markers(&base, &spec.marker_topic, &prefix, uid, wait).map_err(|e| e.to_string())?;
    // Oldest first: a subtask's markers then only grow.
    let mut ordered: Vec<Committable> = pending.into_iter().collect();
    ordered.sort_by_key(|c| (c.subtask, c.epoch, c.checkpoint));
    for c in ordered {
        if markers.get(&(c.subtask, c.epoch)).is_some_and(|&done| done >= c.checkpoint) {
            report.already_committed += 1;
            continue;
        }
        let data = crate::io()
            .block_on(storage.get(&c.staged))
            .map_err(|e| format!("reading the staged records of checkpoint {} ({}): {e}", c.checkpoint, c.staged))?;
        if data.len() as u64 != c.len || crc32c::crc32c(&data) != c.crc32c {
            return Err(format!(
                "the staged records of checkpoint {} ({}) do not match their checksum: refusing to send them",
                c.checkpoint, c.staged
            ));
        }
        let records = kafka::decode_records(&data).ok_or_else(|| format!("{} is not a staging file", c.staged))?;
        let producer = producers.get(&c.subtask).expect("every pending subtask was fenced");
        let key = kafka::marker_key(&prefix, uid, c.subtask, c.epoch);
        let marker = CommitMarker { checkpoint: c.checkpoint, records: c.records, committed_by: epoch };
        commit_transaction(producer, spec, &key, &marker, &records, faults)
            .map_err(|e| format!("sending checkpoint {} again: {e}", c.checkpoint))?;
        report.recommitted += 1;
        if let Err(e) = crate::io().block_on(storage.delete(&c.staged)) {
            tracing::warn!(path = %c.staged, error = %e, "could not delete a committed staging file");
        }
    }
    Ok(report)
}
