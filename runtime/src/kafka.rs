//! What the Kafka source and sinks share: client configuration (with `${env:NAME}` secrets
//! that never reach a log), checks against the broker at start (topics exist, the broker's
//! transaction timeout limit), and the commit markers of the exactly-once sink.
//!
//! Every call to the broker has a timeout: an unreachable broker is an error naming the
//! bootstrap servers, never a hang.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, ResourceSpecifier, TopicReplication};
use std::sync::{Arc, Mutex, OnceLock};

use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::metadata::Metadata;
use rdkafka::{Offset, TopicPartitionList};
use serde::{Deserialize, Serialize};

/// How long a metadata or admin request may take before the broker counts as unreachable.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

/// Why talking to Kafka failed, by step.
#[derive(Debug, thiserror::Error)]
pub enum KafkaClientError {
    /// A `${env:NAME}` property names an unset variable (its value is never printed).
    #[error("property `{property}`: environment variable `{variable}` is not set")]
    MissingEnv {
        /// The librdkafka property.
        property: String,
        /// The variable.
        variable: String,
    },
    /// A `${env:NAME}` property names a variable that no Secret the job declares provides
    /// (with [`only_declared_env`]: the operator's pods).
    #[error(
        "property `{property}`: `${{env:{variable}}}` is not a key of a Secret in the job's \
         podTemplate.envFromSecrets (only those may be referenced)"
    )]
    UndeclaredEnv {
        /// The librdkafka property.
        property: String,
        /// The variable.
        variable: String,
    },
    /// librdkafka refused the configuration.
    #[error("configuring the Kafka client: {0}")]
    Configure(KafkaError),
    /// Metadata could not be fetched in time.
    #[error("cannot reach Kafka at {bootstrap}: {reason}")]
    Unreachable {
        /// The bootstrap servers.
        bootstrap: String,
        /// librdkafka's error, and what the client last reported (an authentication failure,
        /// say).
        reason: String,
    },
    /// A topic the job names does not exist.
    #[error("topic `{topic}` does not exist on {bootstrap}; create it first")]
    UnknownTopic {
        /// The topic.
        topic: String,
        /// The bootstrap servers.
        bootstrap: String,
    },
    /// The marker topic exists but cannot hold markers safely.
    #[error("marker topic `{topic}`: {reason}")]
    UnsafeMarkerTopic {
        /// The topic.
        topic: String,
        /// What is wrong with it, and what to do.
        reason: String,
    },
    /// The sink's transaction timeout exceeds what the broker allows.
    #[error(
        "transactionTimeout is {wanted_ms} ms but the broker allows at most {max_ms} ms \
         (transaction.max.timeout.ms): lower transactionTimeout or raise the broker's limit"
    )]
    TransactionTimeoutTooLong {
        /// The sink's.
        wanted_ms: u64,
        /// The broker's.
        max_ms: u64,
    },
    /// An admin request failed.
    #[error("{step}: {source}")]
    Admin {
        /// What was asked.
        step: &'static str,
        /// librdkafka's error.
        source: KafkaError,
    },
    /// Reading the commit markers failed.
    #[error("reading commit markers from `{topic}`: {reason}")]
    ReadMarkers {
        /// The marker topic.
        topic: String,
        /// Why.
        reason: String,
    },
}

/// Remembers the last error librdkafka reported for a client: an authentication failure, for
/// one, arrives only this way, while the request that failed says "transport failure". The
/// text is librdkafka's, which never includes credentials.
#[derive(Clone, Default)]
pub struct ErrorCapture(Arc<Mutex<Option<String>>>);

impl ErrorCapture {
    fn remember(&self, message: String) {
        *self.0.lock().expect("not poisoned") = Some(message);
    }

    /// `; the client reported: <last error>`, or nothing.
    pub fn detail(&self) -> String {
        match self.0.lock().expect("not poisoned").as_ref() {
            Some(e) => format!("; the client reported: {e}"),
            None => String::new(),
        }
    }
}

impl ClientContext for ErrorCapture {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
        // Connection failures (authentication among them) are logged by librdkafka's own
        // threads; errors come as events only when the client is polled.
        use rdkafka::config::RDKafkaLogLevel as Level;
        if matches!(level, Level::Emerg | Level::Alert | Level::Critical | Level::Error) {
            tracing::debug!(fac, message, "kafka client error");
            self.remember(message.to_string());
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        tracing::debug!(%error, reason, "kafka client error");
        self.remember(reason.to_string());
    }
}

impl ConsumerContext for ErrorCapture {}

/// A consumer that remembers its client's last error.
pub type CheckedConsumer = BaseConsumer<ErrorCapture>;

/// Why `consumer` could not fetch metadata: `source`, with what the client reported (its error
/// events are served by a poll, which is made here).
fn unreachable(consumer: &CheckedConsumer, bootstrap: &str, source: KafkaError) -> KafkaClientError {
    if let Some(Err(e)) = consumer.poll(Duration::from_millis(100)) {
        consumer.context().remember(e.to_string());
    }
    let reason = format!("{source}{}", consumer.context().detail());
    KafkaClientError::Unreachable { bootstrap: bootstrap.to_string(), reason }
}

/// Creates a consumer on `config` that remembers its client's errors.
pub fn checked_consumer(config: &ClientConfig) -> Result<CheckedConsumer, KafkaClientError> {
    config.create_with_context(ErrorCapture::default()).map_err(KafkaClientError::Configure)
}

/// The prefix under which the declared variables are also set (see [`only_declared_env`]).
static DECLARED_ENV_PREFIX: OnceLock<String> = OnceLock::new();

/// From now on, `${env:NAME}` reads only the variable `<prefix>NAME`: in the operator's pods
/// the keys of the Secrets a job names in `podTemplate.envFromSecrets` are set twice, as
/// themselves and with this prefix, so that a job's Kafka properties reach those and nothing
/// else of the runtime's environment (the storage credentials, the image's or the cluster's
/// variables). Without it (a local run) `${env:NAME}` reads `NAME`. Set once; a second call
/// with another prefix is refused.
pub fn only_declared_env(prefix: &str) -> Result<(), String> {
    let set = DECLARED_ENV_PREFIX.get_or_init(|| prefix.to_string());
    (set == prefix).then_some(()).ok_or_else(|| format!("declared-variable prefix already set to `{set}`"))
}

/// The value of `${env:variable}` for `property`: `<prefix>variable` when a prefix declares
/// the variables a job may read, else `variable`, looked up by `lookup`.
fn env_reference(
    property: &str,
    variable: &str,
    prefix: Option<&str>,
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<String, KafkaClientError> {
    let (property, variable_name) = (property.to_string(), variable.to_string());
    match prefix {
        Some(prefix) => lookup(&format!("{prefix}{variable}"))
            .ok_or(KafkaClientError::UndeclaredEnv { property, variable: variable_name }),
        None => lookup(variable).ok_or(KafkaClientError::MissingEnv { property, variable: variable_name }),
    }
}

/// A client configuration: `bootstrap.servers`, then the job's properties with `${env:NAME}`
/// values read from the environment (only the declared variables, see [`only_declared_env`]).
pub fn client_config(bootstrap: &str, properties: &BTreeMap<String, String>) -> Result<ClientConfig, KafkaClientError> {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", bootstrap);
    // Errors only (librdkafka never logs secrets); they reach ErrorCapture::log. Set here and
    // not through the `log` crate's level, which this process does not configure.
    config.set_log_level(rdkafka::config::RDKafkaLogLevel::Error);
    let prefix = DECLARED_ENV_PREFIX.get().map(String::as_str);
    for (key, value) in properties {
        let value = match value.strip_prefix("${env:").and_then(|r| r.strip_suffix('}')) {
            Some(variable) => env_reference(key, variable, prefix, |name| std::env::var(name).ok())?,
            None => value.clone(),
        };
        config.set(key, value);
    }
    Ok(config)
}

/// Fetches metadata of `topics` (all topics when empty), failing on an unreachable broker or a
/// missing topic.
pub fn topic_metadata(
    consumer: &CheckedConsumer,
    bootstrap: &str,
    topics: &[String],
) -> Result<HashMap<String, Vec<i32>>, KafkaClientError> {
    let mut partitions = HashMap::new();
    for topic in topics {
        let md: Metadata =
            consumer.fetch_metadata(Some(topic), REQUEST_TIMEOUT).map_err(|e| unreachable(consumer, bootstrap, e))?;
        let t = md.topics().iter().find(|t| t.name() == topic);
        let found = t.filter(|t| t.error().is_none() && !t.partitions().is_empty());
        let Some(t) = found else {
            return Err(KafkaClientError::UnknownTopic { topic: topic.clone(), bootstrap: bootstrap.to_string() });
        };
        let mut ids: Vec<i32> = t.partitions().iter().map(|p| p.id()).collect();
        ids.sort_unstable();
        partitions.insert(topic.clone(), ids);
    }
    Ok(partitions)
}

/// The broker's `transaction.max.timeout.ms`, read from the first broker of the metadata.
pub fn broker_transaction_max_timeout(config: &ClientConfig, bootstrap: &str) -> Result<u64, KafkaClientError> {
    let probe = checked_consumer(config)?;
    let md = probe.fetch_metadata(None, REQUEST_TIMEOUT).map_err(|e| unreachable(&probe, bootstrap, e))?;
    let admin: AdminClient<ErrorCapture> =
        config.create_with_context(ErrorCapture::default()).map_err(KafkaClientError::Configure)?;
    let broker = md.brokers().first().map(|b| b.id()).unwrap_or(0);
    let step = "reading the broker's configuration";
    match config_value(&admin, ResourceSpecifier::Broker(broker), "transaction.max.timeout.ms", step)? {
        Some(v) => v.parse().map_err(|_| KafkaClientError::Admin {
            step: "reading transaction.max.timeout.ms",
            source: KafkaError::AdminOp(RDKafkaErrorCode::InvalidConfig),
        }),
        // Kafka's default, when the broker does not say.
        None => Ok(900_000),
    }
}

/// The value of configuration `key` of a broker or topic, if it has one; `step` names the
/// request in errors.
fn config_value(
    admin: &AdminClient<ErrorCapture>,
    resource: ResourceSpecifier<'_>,
    key: &str,
    step: &'static str,
) -> Result<Option<String>, KafkaClientError> {
    let opts = AdminOptions::new().request_timeout(Some(REQUEST_TIMEOUT));
    let results = crate::io()
        .block_on(admin.describe_configs([&resource], &opts))
        .map_err(|source| KafkaClientError::Admin { step, source })?;
    for r in results {
        let r = r.map_err(|code| KafkaClientError::Admin { step, source: KafkaError::AdminOp(code) })?;
        if let Some(v) = r.get(key).and_then(|e| e.value.clone()) {
            return Ok(Some(v));
        }
    }
    Ok(None)
}

/// Creates the compacted marker topic when it does not exist (one partition: recovery reads
/// it whole).
pub fn ensure_marker_topic(config: &ClientConfig, topic: &str) -> Result<(), KafkaClientError> {
    let admin: AdminClient<ErrorCapture> =
        config.create_with_context(ErrorCapture::default()).map_err(KafkaClientError::Configure)?;
    let brokers = admin
        .inner()
        .fetch_metadata(None, REQUEST_TIMEOUT)
        .map(|md| md.brokers().len())
        .map_err(|source| KafkaClientError::Admin { step: "listing brokers", source })?;
    let replication = brokers.clamp(1, 3) as i32;
    let new = NewTopic::new(topic, 1, TopicReplication::Fixed(replication)).set("cleanup.policy", "compact");
    let opts = AdminOptions::new().request_timeout(Some(REQUEST_TIMEOUT));
    let results = crate::io()
        .block_on(admin.create_topics([&new], &opts))
        .map_err(|source| KafkaClientError::Admin { step: "creating the marker topic", source })?;
    for r in results {
        match r {
            Ok(_) => return Ok(()),
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((_, code)) => {
                return Err(KafkaClientError::Admin {
                    step: "creating the marker topic",
                    source: KafkaError::AdminOp(code),
                })
            }
        }
    }
    check_marker_topic(&admin, topic)
}

/// Refuses an existing marker topic that could lose markers or hide them: recovery reads
/// partition 0 only (markers written to another partition would never be seen, and the
/// checkpoints they cover would be sent again), and a topic that is not compacted deletes old
/// markers once its retention passes.
fn check_marker_topic(admin: &AdminClient<ErrorCapture>, topic: &str) -> Result<(), KafkaClientError> {
    let unsafe_topic = |reason: String| KafkaClientError::UnsafeMarkerTopic { topic: topic.to_string(), reason };
    let md = admin
        .inner()
        .fetch_metadata(Some(topic), REQUEST_TIMEOUT)
        .map_err(|source| KafkaClientError::Admin { step: "reading the marker topic", source })?;
    let partitions = md.topics().iter().find(|t| t.name() == topic).map_or(0, |t| t.partitions().len());
    if partitions != 1 {
        return Err(unsafe_topic(format!(
            "it has {partitions} partitions and must have exactly 1 (recovery reads every marker from one \
             partition); delete it and let Weir create it, or name another markerTopic"
        )));
    }
    let step = "reading the marker topic's configuration";
    let policy = config_value(admin, ResourceSpecifier::Topic(topic), "cleanup.policy", step)?.unwrap_or_default();
    if !policy.split(',').any(|p| p.trim() == "compact") || policy.contains("delete") {
        return Err(unsafe_topic(format!(
            "its cleanup.policy is `{policy}` and must be `compact` (with `delete`, markers older than the \
             topic's retention are deleted and the checkpoints they cover sent again)"
        )));
    }
    Ok(())
}

/// The commit marker written in the same transaction as a checkpoint's records: under key
/// `<prefix>/<uid>/<subtask>/<epoch>`, the newest checkpoint of that subtask and epoch whose
/// records are committed. Within one epoch a subtask commits its checkpoints in order, so one
/// compacted key per (subtask, epoch) says exactly which of them are in the topic.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommitMarker {
    /// The newest committed checkpoint.
    pub checkpoint: u64,
    /// Records it held.
    pub records: u64,
    /// Epoch of the run that committed it (the staging run's, or a later one's recovery).
    pub committed_by: u64,
}

/// The marker key of `(subtask, epoch)` of sink `uid`.
pub fn marker_key(prefix: &str, uid: &str, subtask: u32, epoch: u64) -> String {
    format!("{prefix}/{uid}/{subtask}/{epoch}")
}

/// Reads every committed marker of sink `uid` (`read_committed`, to the end of the topic as it
/// is now): `(subtask, epoch)` → newest committed checkpoint. A transaction still open
/// elsewhere holds the read back until it ends; `wait` bounds that.
pub fn read_markers(
    config: &ClientConfig,
    topic: &str,
    prefix: &str,
    uid: &str,
    wait: Duration,
) -> Result<BTreeMap<(u32, u64), u64>, KafkaClientError> {
    let fail = |reason: String| KafkaClientError::ReadMarkers { topic: topic.to_string(), reason };
    let mut c = config.clone();
    c.set("group.id", format!("{prefix}-markers"))
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .set("enable.partition.eof", "true");
    let consumer: BaseConsumer = c.create().map_err(|e| fail(e.to_string()))?;
    // The end of the log, open transactions included. A `read_committed` consumer's own
    // watermark is the last stable offset, which stops in front of any transaction still open
    // in the topic; another job's commit in flight there would hide this sink's markers behind
    // it, and their checkpoints would be sent again.
    let mut ends = config.clone();
    ends.set("group.id", format!("{prefix}-markers")).set("isolation.level", "read_uncommitted");
    let ends: BaseConsumer = ends.create().map_err(|e| fail(e.to_string()))?;
    let (_, high) = ends.fetch_watermarks(topic, 0, REQUEST_TIMEOUT).map_err(|e| fail(e.to_string()))?;
    drop(ends);
    let mut markers = BTreeMap::new();
    if high == 0 {
        return Ok(markers);
    }
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Beginning).map_err(|e| fail(e.to_string()))?;
    consumer.assign(&tpl).map_err(|e| fail(e.to_string()))?;
    let want = format!("{prefix}/{uid}/");
    let deadline = Instant::now() + wait;
    loop {
        if Instant::now() > deadline {
            return Err(fail(format!(
                "the end of the topic (offset {high}) was not reached in {wait:?}: a transaction of another \
                 producer is still open"
            )));
        }
        match consumer.poll(Duration::from_millis(200)) {
            None => {}
            Some(Err(KafkaError::PartitionEOF(_))) => {
                // Read everything visible; done once the position passed the end seen at start.
                let pos = consumer.position().map_err(|e| fail(e.to_string()))?;
                let at = pos.find_partition(topic, 0).and_then(|p| p.offset().to_raw()).unwrap_or(0);
                if at >= high {
                    break;
                }
            }
            Some(Err(e)) => return Err(fail(e.to_string())),
            Some(Ok(m)) => {
                let Some(key) = m.key().and_then(|k| std::str::from_utf8(k).ok()) else { continue };
                let Some(rest) = key.strip_prefix(&want) else { continue };
                let Some((subtask, epoch)) = rest.split_once('/') else { continue };
                let (Ok(subtask), Ok(epoch)) = (subtask.parse::<u32>(), epoch.parse::<u64>()) else { continue };
                let Some(payload) = m.payload() else { continue };
                let marker: CommitMarker = serde_json::from_slice(payload).map_err(|e| fail(e.to_string()))?;
                let e = markers.entry((subtask, epoch)).or_insert(0);
                *e = (*e).max(marker.checkpoint);
                if m.offset() + 1 >= high {
                    break;
                }
            }
        }
    }
    Ok(markers)
}

/// One record as staged for, or sent to, Kafka.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutRecord {
    /// The key.
    pub key: Option<Vec<u8>>,
    /// The value.
    pub value: Vec<u8>,
    /// Headers, by name.
    pub headers: Vec<(String, Vec<u8>)>,
}

const NONE: u32 = u32::MAX;

/// Appends `r` to a staging buffer: lengths are little-endian u32 (`u32::MAX`: no key).
pub fn encode_record(r: &OutRecord, out: &mut Vec<u8>) {
    let bytes = |b: &[u8], out: &mut Vec<u8>| {
        out.extend_from_slice(&(b.len() as u32).to_le_bytes());
        out.extend_from_slice(b);
    };
    match &r.key {
        Some(k) => bytes(k, out),
        None => out.extend_from_slice(&NONE.to_le_bytes()),
    }
    bytes(&r.value, out);
    out.extend_from_slice(&(r.headers.len() as u32).to_le_bytes());
    for (name, value) in &r.headers {
        bytes(name.as_bytes(), out);
        bytes(value, out);
    }
}

/// Reads a staging buffer back; `None` when it is truncated or malformed.
pub fn decode_records(mut data: &[u8]) -> Option<Vec<OutRecord>> {
    fn u32_of(data: &mut &[u8]) -> Option<u32> {
        let (head, rest) = data.split_first_chunk::<4>()?;
        *data = rest;
        Some(u32::from_le_bytes(*head))
    }
    fn bytes_of(data: &mut &[u8], len: u32) -> Option<Vec<u8>> {
        let len = len as usize;
        if data.len() < len {
            return None;
        }
        let (head, rest) = data.split_at(len);
        *data = rest;
        Some(head.to_vec())
    }
    let mut records = Vec::new();
    while !data.is_empty() {
        let key = match u32_of(&mut data)? {
            NONE => None,
            n => Some(bytes_of(&mut data, n)?),
        };
        let n = u32_of(&mut data)?;
        let value = bytes_of(&mut data, n)?;
        let count = u32_of(&mut data)?;
        let mut headers = Vec::new();
        for _ in 0..count {
            let n = u32_of(&mut data)?;
            let name = String::from_utf8(bytes_of(&mut data, n)?).ok()?;
            let n = u32_of(&mut data)?;
            headers.push((name, bytes_of(&mut data, n)?));
        }
        records.push(OutRecord { key, value, headers });
    }
    Some(records)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn record() -> impl Strategy<Value = OutRecord> {
        (
            proptest::option::of(proptest::collection::vec(any::<u8>(), 0..8)),
            proptest::collection::vec(any::<u8>(), 0..16),
            proptest::collection::vec(("[a-z]{0,4}", proptest::collection::vec(any::<u8>(), 0..4)), 0..3),
        )
            .prop_map(|(key, value, headers)| OutRecord { key, value, headers })
    }

    proptest! {
        #[test]
        fn staged_records_round_trip_and_truncation_is_detected(records in proptest::collection::vec(record(), 0..20)) {
            let mut buf = Vec::new();
            for r in &records {
                encode_record(r, &mut buf);
            }
            prop_assert_eq!(decode_records(&buf), Some(records.clone()));
            if !buf.is_empty() {
                prop_assert_eq!(decode_records(&buf[..buf.len() - 1]), None);
            }
        }
    }

    #[test]
    fn env_properties_are_resolved_and_a_missing_variable_is_named_without_a_value() {
        std::env::set_var("WEIR_TEST_KAFKA_SECRET", "s3cret");
        let props = BTreeMap::from([("sasl.password".to_string(), "${env:WEIR_TEST_KAFKA_SECRET}".to_string())]);
        let c = client_config("b:9092", &props).unwrap();
        assert_eq!(c.get("sasl.password"), Some("s3cret"));
        let props = BTreeMap::from([("sasl.password".to_string(), "${env:WEIR_TEST_KAFKA_UNSET}".to_string())]);
        let e = client_config("b:9092", &props).unwrap_err().to_string();
        assert!(e.contains("sasl.password") && e.contains("WEIR_TEST_KAFKA_UNSET"), "{e}");
    }

    #[test]
    fn with_a_prefix_only_the_declared_variables_are_read() {
        let env = BTreeMap::from([
            ("AWS_SECRET_ACCESS_KEY".to_string(), "storage".to_string()),
            ("KAFKA_PASSWORD".to_string(), "kafka".to_string()),
            ("WEIR_SECRET_KAFKA_PASSWORD".to_string(), "kafka".to_string()),
        ]);
        let lookup = |name: &str| env.get(name).cloned();
        let read = |variable, prefix| env_reference("sasl.password", variable, prefix, lookup);
        assert_eq!(read("KAFKA_PASSWORD", Some("WEIR_SECRET_")).unwrap(), "kafka");
        // The storage credentials are in the environment, but no declared Secret gives them.
        let e = read("AWS_SECRET_ACCESS_KEY", Some("WEIR_SECRET_")).unwrap_err().to_string();
        assert!(e.contains("AWS_SECRET_ACCESS_KEY") && e.contains("envFromSecrets"), "{e}");
        assert!(!e.contains("storage"), "the value is never printed: {e}");
        // A local run reads the environment as it is.
        assert_eq!(read("AWS_SECRET_ACCESS_KEY", None).unwrap(), "storage");
        assert!(read("UNSET", None).unwrap_err().to_string().contains("is not set"));
    }

    #[test]
    fn marker_keys_of_one_uid_do_not_match_another() {
        assert_eq!(marker_key("weir-j", "out", 2, 7), "weir-j/out/2/7");
        assert!(!marker_key("weir-j", "out-2", 0, 1).starts_with("weir-j/out/"));
    }
}
