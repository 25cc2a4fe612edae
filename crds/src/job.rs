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
    /// Where records come from.
    pub sources: Vec<SourceSpec>,
    /// Transformations, in order; each reads the node(s) named in `input`.
    #[serde(default)]
    pub operators: Vec<OperatorSpec>,
    /// Where results go.
    pub sinks: Vec<SinkSpec>,
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
    /// A checkpoint not complete after this long is aborted.
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

/// A source node. Exactly one of `generator` or `file` is set.
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

/// A sink node. Exactly one of `file`, `stdout`, `blackhole` is set.
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
