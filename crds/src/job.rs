//! The job a user writes: a dataflow graph of sources → operators → sinks, in YAML.
//!
//! The same document is `StreamJob.spec.job` in Kubernetes and the file given to
//! `weir-runtime run job.yaml`. Parsing only checks shapes; [`crate::validate`] checks meaning.

#[cfg(feature = "kubernetes")]
use schemars::JsonSchema;
use serde::{Deserialize, Deserializer, Serialize};

use crate::duration::HumanDuration;

/// A whole job: its name, parallelism, checkpointing, restart strategy and dataflow graph.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JobSpec {
    /// Job name: names checkpoint directories and output files. Letters, digits, `-`, `_`, `.`.
    pub name: String,
    /// Default number of parallel subtasks of every operator (each node may override it).
    #[serde(default = "default_parallelism")]
    pub parallelism: u32,
    /// Number of key groups keyed state is partitioned into; the upper bound for any parallelism.
    /// Fixed at the first run: a restore with another value is refused.
    #[serde(default = "default_max_parallelism")]
    pub max_parallelism: u32,
    /// How and how often state is checkpointed.
    #[serde(default)]
    pub checkpointing: CheckpointingSpec,
    /// What happens when a task fails inside the process.
    #[serde(default)]
    pub restart: RestartSpec,
    /// Where keyed state (aggregates, windows, dedupe) lives between checkpoints: `heap` (in
    /// memory; fastest) or `rocksdb` (a RocksDB store on the pod's local disk behind an
    /// in-memory cache of `stateCacheEntries` entries per subtask, for state larger than
    /// memory). Checkpoints and savepoints have the same format on both, so a job can switch
    /// backend across a savepoint or a restart.
    #[serde(default)]
    pub state_backend: StateBackendKind,
    /// With `stateBackend: rocksdb`, how many keyed-state entries each stateful subtask keeps
    /// in memory (the rest are on disk). Each costs about 100 bytes plus its key and value.
    #[serde(default = "default_state_cache_entries")]
    pub state_cache_entries: u64,
    /// Where records come from.
    pub sources: Vec<SourceSpec>,
    /// Transformations, in order; each reads the node(s) named in `input`.
    #[serde(default)]
    pub operators: Vec<OperatorSpec>,
    /// Where results go.
    pub sinks: Vec<SinkSpec>,
}

/// Keyed state backends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "kebab-case")]
pub enum StateBackendKind {
    /// Every entry in memory.
    #[default]
    Heap,
    /// RocksDB on local disk behind a bounded in-memory cache.
    Rocksdb,
}

fn default_state_cache_entries() -> u64 {
    1_000_000
}

fn default_parallelism() -> u32 {
    1
}

fn default_max_parallelism() -> u32 {
    128
}

/// Checkpoint consistency mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "kebab-case")]
pub enum CheckpointMode {
    /// Barriers are aligned: a task with several inputs waits for barrier N on all of them.
    #[default]
    ExactlyOnce,
    /// Barriers are not aligned: lower latency, records may be replayed after a failure.
    AtLeastOnce,
}

/// What to do with retained checkpoints when the job is cancelled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "kebab-case")]
pub enum RetentionOnCancel {
    /// Keep them: the job can be resumed from the newest one.
    #[default]
    Retain,
    /// Delete them.
    Delete,
}

/// Checkpointing settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CheckpointingSpec {
    /// Turn periodic checkpoints off (a final checkpoint is still taken when bounded input ends).
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Time between the starts of two checkpoints.
    #[serde(default = "default_interval")]
    pub interval: HumanDuration,
    /// `exactly-once` (aligned barriers) or `at-least-once`.
    #[serde(default)]
    pub mode: CheckpointMode,
    /// A checkpoint not complete after this long is aborted. When an attempt fails because
    /// its checkpoints expired before any of them completed, the next attempt in the same
    /// process allows twice as long, up to 8 times this and within what an exactly-once Kafka
    /// sink's `transactionTimeout` outlives (the first checkpoint after a restore that cannot
    /// go on from the restored files writes every key).
    #[serde(default = "default_timeout")]
    pub timeout: HumanDuration,
    /// Least time between the end of one checkpoint and the start of the next.
    #[serde(default)]
    pub min_pause: HumanDuration,
    /// How many checkpoints may be in flight at once.
    #[serde(default = "one")]
    pub max_concurrent: u32,
    /// Consecutive failed checkpoints tolerated before the job fails and restarts.
    #[serde(default)]
    pub tolerable_failures: u32,
    /// How many complete checkpoints to keep (the newest is never deleted).
    #[serde(default = "default_retained")]
    pub retained: u32,
    /// Keep or delete retained checkpoints when the job is cancelled.
    #[serde(default)]
    pub retention_on_cancel: RetentionOnCancel,
    /// Storage URL for checkpoints and savepoints: a local path, `file:///...`, `s3://bucket/prefix`,
    /// `gs://bucket/prefix` or `az://container/prefix`.
    /// The command line's `--checkpoint-dir` overrides it.
    #[serde(default)]
    pub storage: Option<String>,
    /// Write only the keyed state changed since the previous checkpoint.
    #[serde(default = "yes")]
    pub incremental: bool,
    /// With incremental checkpoints, every `fullEvery`-th checkpoint writes a full image (the
    /// others write only the keys changed since the previous one).
    #[serde(default = "default_full_every")]
    pub full_every: u32,
    /// Keyed-state entries of one subtask above which the task no longer writes the periodic
    /// full image itself (which stops its records while it encodes every entry): the
    /// checkpoints' uploader merges the last full image and the increments after it, already
    /// uploaded, into a new full image in the background, and later checkpoints build on that.
    /// On the rocksdb backend every 14 bytes stored count as one more entry (reading them back
    /// costs the task about as long as encoding an entry). `0`: always in the background.
    #[serde(default = "default_background_full_image_above")]
    pub background_full_image_above: u64,
}

fn yes() -> bool {
    true
}
pub(crate) fn one() -> u32 {
    1
}
fn default_interval() -> HumanDuration {
    HumanDuration::from_secs(1)
}
fn default_timeout() -> HumanDuration {
    HumanDuration::from_secs(60)
}
pub(crate) fn default_retained() -> u32 {
    3
}
fn default_full_every() -> u32 {
    10
}
/// About 0.1 s of the task's time to encode (45 ns per entry measured on the keyed count).
fn default_background_full_image_above() -> u64 {
    2_000_000
}

impl Default for CheckpointingSpec {
    fn default() -> Self {
        CheckpointingSpec {
            enabled: true,
            interval: default_interval(),
            mode: CheckpointMode::default(),
            timeout: default_timeout(),
            min_pause: HumanDuration::default(),
            max_concurrent: 1,
            tolerable_failures: 0,
            retained: default_retained(),
            retention_on_cancel: RetentionOnCancel::default(),
            storage: None,
            incremental: true,
            full_every: default_full_every(),
            background_full_image_above: default_background_full_image_above(),
        }
    }
}

/// Restart strategy kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "kebab-case")]
pub enum RestartStrategyKind {
    /// Wait `delay` between attempts.
    #[default]
    FixedDelay,
    /// Wait `delay`, then multiply by `multiplier` each attempt, up to `maxDelay`.
    ExponentialBackoff,
    /// Never restart: a task failure fails the job.
    None,
}

/// In-process restart after a task failure: the whole job restarts from the newest complete
/// checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RestartSpec {
    /// `fixed-delay`, `exponential-backoff` or `none`.
    #[serde(default)]
    pub strategy: RestartStrategyKind,
    /// Restarts allowed before the job fails for good.
    #[serde(default = "default_attempts")]
    pub attempts: u32,
    /// Delay before the first restart.
    #[serde(default = "default_delay")]
    pub delay: HumanDuration,
    /// Upper bound of the delay (exponential backoff).
    #[serde(default = "default_max_delay")]
    pub max_delay: HumanDuration,
    /// Growth factor of the delay (exponential backoff).
    #[serde(default = "default_multiplier")]
    pub multiplier: f64,
}

fn default_attempts() -> u32 {
    3
}
fn default_delay() -> HumanDuration {
    HumanDuration::from_millis(500)
}
fn default_max_delay() -> HumanDuration {
    HumanDuration::from_secs(30)
}
fn default_multiplier() -> f64 {
    2.0
}

impl Default for RestartSpec {
    fn default() -> Self {
        RestartSpec {
            strategy: RestartStrategyKind::default(),
            attempts: default_attempts(),
            delay: default_delay(),
            max_delay: default_max_delay(),
            multiplier: default_multiplier(),
        }
    }
}

/// The upstream node names of an operator or sink: `input` (one) or `inputs` (several, unioned).
pub fn input_names<'a>(input: &'a Option<String>, inputs: &'a Option<Vec<String>>) -> Option<Vec<&'a str>> {
    match (input, inputs) {
        (None, None) => None,
        (Some(one), None) => Some(vec![one.as_str()]),
        (None, Some(many)) => Some(many.iter().map(String::as_str).collect()),
        (Some(one), Some(many)) => Some(std::iter::once(one.as_str()).chain(many.iter().map(String::as_str)).collect()),
    }
}

/// A source node. Exactly one of `generator`, `file` or `kafka` is set.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SourceSpec {
    /// Name other nodes use in `input`.
    pub name: String,
    /// Stable id of this node's state (its read positions); required.
    #[serde(default)]
    pub uid: Option<String>,
    /// Parallelism of this node (default: the job's).
    #[serde(default)]
    pub parallelism: Option<u32>,
    /// Deterministic synthetic records.
    #[serde(default)]
    pub generator: Option<GeneratorSpec>,
    /// Lines of a local file or of every file in a directory.
    #[serde(default)]
    pub file: Option<FileSourceSpec>,
    /// Records of Apache Kafka topics, with their offsets kept in checkpoints.
    #[serde(default)]
    pub kafka: Option<KafkaSourceSpec>,
}

/// The deterministic generator: every field and the event time derive from the sequence number,
/// so a replay produces the very same records.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GeneratorSpec {
    /// Number of records; absent means unbounded.
    #[serde(default)]
    pub count: Option<u64>,
    /// Records per second over the whole source; absent means as fast as possible.
    #[serde(default)]
    pub rate_per_second: Option<u64>,
    /// Number of splits the sequence is cut into (default: the job's maxParallelism). Fixed for
    /// the life of the job: splits are the unit of redistribution on rescale.
    #[serde(default)]
    pub splits: Option<u32>,
    /// Event time of record 0.
    #[serde(default)]
    pub start_time_ms: i64,
    /// Event time step between consecutive sequence numbers.
    #[serde(default = "default_time_step")]
    pub time_step: HumanDuration,
    /// The record's fields, in order.
    pub fields: Vec<GeneratorField>,
}

fn default_time_step() -> HumanDuration {
    HumanDuration::from_millis(1)
}

/// One generated field. Exactly one kind is set.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GeneratorField {
    /// Field name. Quote names YAML 1.1 reads as booleans (`name: "y"`, not `name: y`).
    pub name: String,
    /// The sequence number itself (int).
    #[serde(default)]
    pub sequence: Option<Empty>,
    /// A well-mixed int in `[0, modulo)`; the same sequence number always gives the same value.
    #[serde(default)]
    pub modulo: Option<u64>,
    /// A word from a fixed vocabulary of `cardinality` words (string).
    #[serde(default)]
    pub word: Option<WordField>,
    /// A line of `words` words drawn from a vocabulary of `vocabulary` words (string).
    #[serde(default)]
    pub text: Option<TextField>,
    /// An int drawn uniformly from `[min, max]`.
    #[serde(default)]
    pub uniform: Option<UniformField>,
}

/// An empty mapping (`{}`), used for options that take no settings.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct Empty {}

/// Settings of a `word` field.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WordField {
    /// How many distinct words.
    pub cardinality: u64,
}

/// Settings of a `text` field.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TextField {
    /// Words per line.
    pub words: u32,
    /// Vocabulary size.
    pub vocabulary: u64,
}

/// Settings of a `uniform` field.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UniformField {
    /// Smallest value.
    pub min: i64,
    /// Largest value.
    pub max: i64,
}

/// Reads text lines; each record has one string field `line`, and its event time is the line's
/// number within its file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FileSourceSpec {
    /// A file, or a directory whose regular files (sorted by name) are read.
    pub path: String,
}

/// Reads Apache Kafka topics. Partitions are spread over the subtasks (stable for a given
/// parallelism); the offset of every partition is part of each checkpoint and is restored
/// exactly, never taken from the consumer group. Each record has the fields `value` (format
/// `raw`) or the names in `fields` (format `json`), then `key`, `topic`, `partition`, `offset`,
/// `timestamp` (ms) and `headers` (a JSON object as a string). Its event time is the record's
/// timestamp.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "kubernetes", derive(kube::KubeSchema))]
#[cfg_attr(
    feature = "kubernetes",
    x_kube(
        validation = kube::core::Rule::new("self.topics.size() > 0").message("at least one topic is required")
    )
)]
#[cfg_attr(
    feature = "kubernetes",
    x_kube(
        validation = kube::core::Rule::new(
            "(has(self.startFrom) && self.startFrom == 'timestamp') == has(self.startTimestampMs)"
        )
        .message("startTimestampMs is required with startFrom: timestamp, and only read with it")
    )
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KafkaSourceSpec {
    /// Brokers to bootstrap from, `host:port[,host:port...]`.
    pub bootstrap_servers: String,
    /// Topics to read; they must exist when the job starts.
    pub topics: Vec<String>,
    /// Consumer group that offsets are committed to when a checkpoint completes, for lag
    /// monitoring only (and for `startFrom: group-offsets`). Default: `weir-<job name>`.
    #[serde(default)]
    pub group_id: Option<String>,
    /// Where a partition without a checkpointed offset starts: `earliest` (default), `latest`,
    /// `group-offsets` (the group's committed offset, else earliest) or `timestamp`
    /// (`startTimestampMs`).
    #[serde(default)]
    pub start_from: KafkaStartFrom,
    /// First record timestamp (ms since the epoch) read with `startFrom: timestamp`.
    #[serde(default)]
    pub start_timestamp_ms: Option<i64>,
    /// Read only records of committed transactions (`isolation.level=read_committed`).
    #[serde(default = "default_true")]
    pub read_committed: bool,
    /// How a record's value is read: `raw` (UTF-8 text in field `value`) or `json` (an object
    /// whose fields named in `fields` become the record's fields).
    #[serde(default)]
    pub format: KafkaFormat,
    /// Fields taken from a `json` value, in order (absent fields are null).
    #[serde(default)]
    pub fields: Vec<String>,
    /// Stop at the end offsets found when the job starts (a bounded read), instead of reading
    /// forever.
    #[serde(default)]
    pub bounded: bool,
    /// How far out of order record timestamps may be within a partition: the watermark trails
    /// the newest timestamp by this much.
    #[serde(default)]
    pub max_out_of_orderness: HumanDuration,
    /// A partition that yields no record for this long stops holding the watermark back.
    #[serde(default = "default_idle_timeout")]
    pub idle_timeout: HumanDuration,
    /// How often the topics are checked for new partitions (`0s`: never); new partitions are
    /// read from their beginning.
    #[serde(default = "default_discovery_interval")]
    pub partition_discovery_interval: HumanDuration,
    /// Further librdkafka consumer properties (e.g. `security.protocol`, `sasl.mechanism`).
    /// Values of the form `${env:NAME}` are read from the runtime's environment, so secrets
    /// come from a Secret and never appear in the job (in a StreamJob, only the keys of its
    /// `podTemplate.envFromSecrets` Secrets).
    #[serde(default)]
    pub properties: std::collections::BTreeMap<String, String>,
}

fn default_true() -> bool {
    true
}

fn default_idle_timeout() -> HumanDuration {
    HumanDuration::from_millis(30_000)
}

fn default_discovery_interval() -> HumanDuration {
    HumanDuration::from_millis(10_000)
}

/// Where a Kafka partition without a checkpointed offset starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "kebab-case")]
pub enum KafkaStartFrom {
    /// The oldest retained record.
    #[default]
    Earliest,
    /// Records produced after the job started.
    Latest,
    /// The consumer group's committed offset, or the oldest record when it has none.
    GroupOffsets,
    /// The first record at or after `startTimestampMs`.
    Timestamp,
}

/// How Kafka record values are read or written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "kebab-case")]
pub enum KafkaFormat {
    /// Text: one field's value as is.
    #[default]
    Raw,
    /// A JSON object of the record's fields.
    Json,
}

/// An operator node. Exactly one kind (`map`, `filter`, `flatMap`, `keyBy`, `window`,
/// `aggregate`, `dedupe`) is set.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OperatorSpec {
    /// Name other nodes use in `input`.
    pub name: String,
    /// Upstream node; default: the previous operator, or the only source for the first one.
    #[serde(default)]
    pub input: Option<String>,
    /// Several upstream nodes whose records are unioned (instead of `input`).
    #[serde(default)]
    pub inputs: Option<Vec<String>>,
    /// Stable id of this operator's state; required on stateful operators (window, aggregate,
    /// dedupe), because savepoint compatibility depends on it.
    #[serde(default)]
    pub uid: Option<String>,
    /// Parallelism of this node (default: the job's).
    #[serde(default)]
    pub parallelism: Option<u32>,
    /// Computes the output fields from CEL expressions over the input fields.
    #[serde(default)]
    pub map: Option<MapSpec>,
    /// Keeps the records for which a CEL expression is true.
    #[serde(default)]
    pub filter: Option<FilterSpec>,
    /// Turns each record into zero or more records.
    #[serde(default)]
    pub flat_map: Option<FlatMapSpec>,
    /// Partitions the stream by key for the stateful operator that follows.
    #[serde(default)]
    pub key_by: Option<KeyBySpec>,
    /// Event-time windows with aggregates, per key.
    #[serde(default)]
    pub window: Option<WindowSpec>,
    /// Running aggregates per key, emitted on every update.
    #[serde(default)]
    pub aggregate: Option<AggregateSpec>,
    /// Drops records whose key was seen before.
    #[serde(default)]
    pub dedupe: Option<Empty>,
}

/// `map` settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MapSpec {
    /// Output fields in order: name → CEL expression over the input fields.
    pub fields: NamedExprs,
    /// Keep the input fields not overwritten by `fields` (before the new ones).
    #[serde(default)]
    pub keep_input: bool,
}

/// An ordered mapping of names to expressions (YAML mapping order is kept).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct NamedExprs(pub Vec<(String, String)>);

#[cfg(feature = "kubernetes")]
impl JsonSchema for NamedExprs {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "NamedExprs".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "object",
            "description": "Field name → CEL expression, in output order.",
            "additionalProperties": { "type": "string" }
        })
    }

    fn inline_schema() -> bool {
        true
    }
}

impl Serialize for NamedExprs {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for NamedExprs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = NamedExprs;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a mapping of field names to CEL expressions")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut access: A) -> Result<NamedExprs, A::Error> {
                let mut out = Vec::new();
                while let Some((k, v)) = access.next_entry::<String, String>()? {
                    out.push((k, v));
                }
                Ok(NamedExprs(out))
            }
        }
        d.deserialize_map(Visitor)
    }
}

/// `filter` settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FilterSpec {
    /// A CEL expression that must be true for the record to pass.
    pub expr: String,
}

/// `flatMap` settings. Exactly one of `split` or `expr` is set.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FlatMapSpec {
    /// Built-in: split a string field on whitespace into one record per token.
    #[serde(default)]
    pub split: Option<SplitSpec>,
    /// A CEL expression yielding a list; one record per element, named by `as`.
    #[serde(default)]
    pub expr: Option<String>,
    /// With `expr`: the output field holding each element (the other input fields are kept).
    /// Quote names YAML 1.1 reads as booleans (`as: "y"`, not `as: y`).
    #[serde(default, rename = "as")]
    pub as_field: Option<String>,
}

/// The built-in whitespace split.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SplitSpec {
    /// The string field to split.
    pub field: String,
    /// The output field holding each token; it takes the split field's place.
    pub into: String,
    /// Lower-case each token.
    #[serde(default)]
    pub lowercase: bool,
}

/// `keyBy` settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KeyBySpec {
    /// The fields forming the key.
    pub fields: Vec<String>,
}

/// Window kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "kebab-case")]
pub enum WindowKind {
    /// Fixed, non-overlapping windows of `size`.
    Tumbling,
    /// Windows of `size` starting every `slide`.
    Sliding,
}

/// `window` settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WindowSpec {
    /// `tumbling` or `sliding`.
    #[serde(rename = "type")]
    pub kind: WindowKind,
    /// Window length.
    pub size: HumanDuration,
    /// Distance between window starts (sliding windows only).
    #[serde(default)]
    pub slide: Option<HumanDuration>,
    /// The aggregates computed per key and window.
    pub aggregates: Vec<AggregateFn>,
}

/// `aggregate` settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AggregateSpec {
    /// The aggregates computed per key.
    pub aggregates: Vec<AggregateFn>,
}

/// Aggregate function kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "kebab-case")]
pub enum AggregateKind {
    /// Number of records.
    Count,
    /// Sum of a numeric field.
    Sum,
    /// Smallest value of a field.
    Min,
    /// Largest value of a field.
    Max,
    /// Mean of a numeric field (a double).
    Avg,
}

/// One aggregate: a function, its input field (all but `count`) and its output name.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AggregateFn {
    /// `count`, `sum`, `min`, `max` or `avg`.
    #[serde(rename = "fn")]
    pub function: AggregateKind,
    /// The input field (not used by `count`).
    #[serde(default)]
    pub field: Option<String>,
    /// The output field name. Quote names YAML 1.1 reads as booleans: kubectl turns `as: n`
    /// (or y, yes, no, on, off) into `false`; write `as: "n"`.
    #[serde(rename = "as")]
    pub output: String,
}

/// A sink node. Exactly one of `file`, `kafka`, `stdout`, `blackhole` is set.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SinkSpec {
    /// Name of this node.
    pub name: String,
    /// Upstream node; default: the last operator (or the only source).
    #[serde(default)]
    pub input: Option<String>,
    /// Several upstream nodes whose records are unioned (instead of `input`).
    #[serde(default)]
    pub inputs: Option<Vec<String>>,
    /// Stable id of this sink's state (its pending transactions); required for `file`.
    #[serde(default)]
    pub uid: Option<String>,
    /// Parallelism of this node (default: the job's).
    #[serde(default)]
    pub parallelism: Option<u32>,
    /// Exactly-once files (JSON lines), published when a checkpoint completes.
    #[serde(default)]
    pub file: Option<FileSinkSpec>,
    /// Records written to an Apache Kafka topic, exactly once by default.
    #[serde(default)]
    pub kafka: Option<KafkaSinkSpec>,
    /// JSON lines on standard output (at-least-once after a restart).
    #[serde(default)]
    pub stdout: Option<Empty>,
    /// Counts and discards records (benchmarks).
    #[serde(default)]
    pub blackhole: Option<Empty>,
}

/// `file` sink settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FileSinkSpec {
    /// Output directory: a local path, `file:///...` or `s3://bucket/prefix`. Committed files are
    /// named `part-<uid>-<checkpoint>-<subtask>.jsonl`; staged files start with `.`.
    pub path: String,
}

/// Writes records to an Apache Kafka topic.
///
/// `exactly-once`: the records of each checkpoint are staged in the job's checkpoint storage
/// and, when the checkpoint completes, written in one Kafka transaction together with a commit
/// marker in `markerTopic`. After a crash, recovery reads the markers and writes again exactly
/// the checkpoints whose transaction never committed. Consumers must read `read_committed`;
/// records become visible when their checkpoint completes (latency: up to one checkpoint
/// interval). `at-least-once`: records are sent as they come and flushed on every barrier.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "kubernetes", derive(kube::KubeSchema))]
#[cfg_attr(
    feature = "kubernetes",
    x_kube(
        validation = kube::core::Rule::new("!has(self.format) || self.format != 'raw' || has(self.valueField)")
            .message("valueField is required with format: raw")
    )
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KafkaSinkSpec {
    /// Brokers to bootstrap from, `host:port[,host:port...]`.
    pub bootstrap_servers: String,
    /// Topic written to; it must exist when the job starts.
    pub topic: String,
    /// `exactly-once` (default) or `at-least-once`.
    #[serde(default)]
    pub delivery: KafkaDelivery,
    /// Field whose value is the record key (absent: no key).
    #[serde(default)]
    pub key_field: Option<String>,
    /// Value format: `json` (default: the record as a JSON object) or `raw` (the text of
    /// `valueField`).
    #[serde(default = "default_json")]
    pub format: KafkaFormat,
    /// The field written as the value with `format: raw`.
    #[serde(default)]
    pub value_field: Option<String>,
    /// Fields sent as record headers (their text), in addition to the value.
    #[serde(default)]
    pub header_fields: Vec<String>,
    /// librdkafka partitioner: `murmur2_random` (default, as the Java client), `murmur2`,
    /// `consistent_random`, `consistent`, `fnv1a`, `fnv1a_random` or `random`.
    #[serde(default)]
    pub partitioner: Option<String>,
    /// Transaction timeout (`transaction.timeout.ms`, exactly-once). It must exceed
    /// checkpoint interval + checkpoint timeout + restart maxDelay, and not exceed the broker's
    /// `transaction.max.timeout.ms` (checked at start).
    #[serde(default = "default_transaction_timeout")]
    pub transaction_timeout: HumanDuration,
    /// Compacted topic holding commit markers (exactly-once); created when missing. An
    /// existing one must have one partition and `cleanup.policy=compact` (checked at start).
    #[serde(default = "default_marker_topic")]
    pub marker_topic: String,
    /// Prefix of the transactional ids (`<prefix>-<uid>-<subtask>`) and marker keys; must be
    /// unique among the jobs writing to one Kafka cluster. Default: `weir-<job name>`.
    #[serde(default)]
    pub transactional_id_prefix: Option<String>,
    /// Further librdkafka producer properties; `${env:NAME}` values are read from the
    /// runtime's environment (in a StreamJob, only the keys of its `podTemplate.envFromSecrets`
    /// Secrets).
    #[serde(default)]
    pub properties: std::collections::BTreeMap<String, String>,
}

fn default_json() -> KafkaFormat {
    KafkaFormat::Json
}

fn default_transaction_timeout() -> HumanDuration {
    HumanDuration::from_millis(900_000)
}

fn default_marker_topic() -> String {
    "weir-commit-markers".to_string()
}

/// Delivery guarantee of a Kafka sink.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "kubernetes", derive(JsonSchema))]
#[serde(rename_all = "kebab-case")]
pub enum KafkaDelivery {
    /// Transactions committed when a checkpoint completes, with markers for recovery.
    #[default]
    ExactlyOnce,
    /// Sent as they come, flushed on every barrier: duplicates after a failure, no loss.
    AtLeastOnce,
}

/// A parse failure: where in the document and why.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {message}")]
pub struct ParseError {
    /// Field path, e.g. `job.operators[2].window.size`.
    pub path: String,
    /// The reason.
    pub message: String,
}

impl JobSpec {
    /// Parses a job from YAML (or JSON), naming the field path of any shape error.
    pub fn from_yaml(text: &str) -> Result<JobSpec, ParseError> {
        let de = serde_yaml::Deserializer::from_str(text);
        serde_path_to_error::deserialize(de).map_err(|err| {
            let raw = err.path().to_string();
            let path = if raw == "." { "job".to_string() } else { format!("job.{raw}") };
            let message = err.into_inner().to_string();
            // serde_yaml repeats the path in front of its message and appends " at line L
            // column C"; drop the former, keep the latter (it helps find the spot).
            let message = match message.split_once(": ") {
                Some((head, rest)) if !head.contains(' ') && raw.starts_with(head) => rest.to_string(),
                _ => message,
            };
            ParseError { path, message }
        })
    }

    /// The parallelism of a node given its own override.
    pub fn parallelism_of(&self, node_override: Option<u32>) -> u32 {
        node_override.unwrap_or(self.parallelism)
    }
}
