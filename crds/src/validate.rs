//! Pure validation of a [`JobSpec`]: every problem is reported with its field path and reason,
//! and a valid job comes back as a [`ValidatedJob`] whose graph (inputs resolved, schemas
//! inferred, keys known) the runtime can execute without checking again.

use std::collections::{HashMap, HashSet};
use std::fmt;

use crate::job::*;

/// One validation problem.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// Field path, e.g. `job.operators[2].window.size`.
    pub path: String,
    /// What is wrong and, where it helps, what to write instead.
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// All problems found in a job, in document order.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct ValidationErrors(pub Vec<Violation>);

impl fmt::Display for ValidationErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, v) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{v}")?;
        }
        Ok(())
    }
}

/// What a node does, with its settings.
#[derive(Clone, Debug, PartialEq)]
pub enum NodeKind {
    /// Generator source.
    Generator(GeneratorSpec),
    /// File source.
    FileSource(FileSourceSpec),
    /// Kafka source.
    KafkaSource(KafkaSourceSpec),
    /// CEL map.
    Map(MapSpec),
    /// CEL filter.
    Filter(FilterSpec),
    /// Flat map.
    FlatMap(FlatMapSpec),
    /// Key partitioning (no task of its own).
    KeyBy(KeyBySpec),
    /// Keyed event-time window.
    Window(WindowSpec),
    /// Keyed running aggregate.
    Aggregate(AggregateSpec),
    /// Keyed dedupe.
    Dedupe,
    /// Exactly-once file sink.
    FileSink(FileSinkSpec),
    /// Kafka sink.
    KafkaSink(KafkaSinkSpec),
    /// Standard output sink.
    Stdout,
    /// Discarding sink.
    Blackhole,
}

impl NodeKind {
    /// Short name used in messages.
    pub fn label(&self) -> &'static str {
        match self {
            NodeKind::Generator(_) => "generator",
            NodeKind::FileSource(_) => "file source",
            NodeKind::KafkaSource(_) => "kafka source",
            NodeKind::Map(_) => "map",
            NodeKind::Filter(_) => "filter",
            NodeKind::FlatMap(_) => "flatMap",
            NodeKind::KeyBy(_) => "keyBy",
            NodeKind::Window(_) => "window",
            NodeKind::Aggregate(_) => "aggregate",
            NodeKind::Dedupe => "dedupe",
            NodeKind::FileSink(_) => "file sink",
            NodeKind::KafkaSink(_) => "kafka sink",
            NodeKind::Stdout => "stdout sink",
            NodeKind::Blackhole => "blackhole sink",
        }
    }

    /// Whether the node keeps state that must survive restarts (and therefore needs a uid).
    pub fn is_stateful(&self) -> bool {
        matches!(
            self,
            NodeKind::Generator(_)
                | NodeKind::FileSource(_)
                | NodeKind::KafkaSource(_)
                | NodeKind::Window(_)
                | NodeKind::Aggregate(_)
                | NodeKind::Dedupe
                | NodeKind::FileSink(_)
                | NodeKind::KafkaSink(_)
        )
    }

    /// Whether the node keeps per-key state and so needs a keyed input.
    pub fn is_keyed(&self) -> bool {
        matches!(self, NodeKind::Window(_) | NodeKind::Aggregate(_) | NodeKind::Dedupe)
    }

    /// Whether the node is a source.
    pub fn is_source(&self) -> bool {
        matches!(self, NodeKind::Generator(_) | NodeKind::FileSource(_) | NodeKind::KafkaSource(_))
    }

    /// Whether the node is a sink.
    pub fn is_sink(&self) -> bool {
        matches!(self, NodeKind::FileSink(_) | NodeKind::KafkaSink(_) | NodeKind::Stdout | NodeKind::Blackhole)
    }
}

/// A node of the validated graph.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// The node's name.
    pub name: String,
    /// Where it was declared, e.g. `job.operators[2]`.
    pub path: String,
    /// Its state id (always set on stateful nodes).
    pub uid: Option<String>,
    /// Its parallelism.
    pub parallelism: u32,
    /// What it does.
    pub kind: NodeKind,
    /// Indexes of its input nodes (always earlier in [`ValidatedJob::nodes`]).
    pub inputs: Vec<usize>,
    /// Names of its output fields, in order.
    pub schema: Vec<String>,
    /// For keyed operators: the key fields' positions in the input schema.
    pub key: Vec<usize>,
}

/// A job that passed validation.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidatedJob {
    /// The job as written.
    pub spec: JobSpec,
    /// Sources, then operators, then sinks, in document order.
    pub nodes: Vec<Node>,
}

/// Most nodes (sources, operators and sinks together) in one job: the operator validates every
/// tenant's graph, and the runtime starts a thread per subtask of each.
pub const MAX_GRAPH_NODES: usize = 256;

/// Validates a job, returning its resolved graph or every problem found.
pub fn validate(spec: &JobSpec) -> Result<ValidatedJob, ValidationErrors> {
    let mut v = Validator { errors: Vec::new() };
    let size = spec.sources.len() + spec.operators.len() + spec.sinks.len();
    if size > MAX_GRAPH_NODES {
        // Not validated further: each node costs work, and so would each of its problems.
        v.err("job", format!("has {size} sources, operators and sinks; at most {MAX_GRAPH_NODES} are allowed"));
        return Err(ValidationErrors(v.errors));
    }
    let nodes = v.graph(spec);
    v.job_settings(spec);
    if v.errors.is_empty() {
        Ok(ValidatedJob { spec: spec.clone(), nodes })
    } else {
        Err(ValidationErrors(v.errors))
    }
}

struct Validator {
    errors: Vec<Violation>,
}

/// Fields every Kafka source record has after its value field(s).
pub const KAFKA_METADATA_FIELDS: [&str; 6] = ["key", "topic", "partition", "offset", "timestamp", "headers"];

/// Partitioners librdkafka knows.
pub const KAFKA_PARTITIONERS: [&str; 7] =
    ["murmur2_random", "murmur2", "consistent_random", "consistent", "fnv1a", "fnv1a_random", "random"];

/// librdkafka properties Weir sets itself: a job may not override them.
pub const MANAGED_KAFKA_PROPERTIES: [&str; 9] = [
    "bootstrap.servers",
    "group.id",
    "enable.auto.commit",
    "enable.auto.offset.store",
    "isolation.level",
    "transactional.id",
    "transaction.timeout.ms",
    "enable.idempotence",
    "partitioner",
];

/// librdkafka properties that hold secrets: a job may only reference them from the environment
/// (`${env:NAME}`), never write them.
pub const SECRET_KAFKA_PROPERTIES: [&str; 7] = [
    "sasl.password",
    "sasl.oauthbearer.client.secret",
    "ssl.key.password",
    "ssl.key.pem",
    "ssl.keystore.password",
    "ssl.truststore.password",
    "sasl.kerberos.keytab",
];

const TOPIC_RULE: &str = "1-249 letters, digits, '.', '_' or '-', not `.` or `..`";

fn valid_topic(t: &str) -> bool {
    !t.is_empty()
        && t.len() <= 249
        && t != "."
        && t != ".."
        && t.chars().all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '_' || c == '-')
}

/// The fields of a Kafka source's records: the value field(s), then the metadata fields.
pub fn kafka_source_schema(k: &KafkaSourceSpec) -> Vec<String> {
    let values: Vec<String> = match k.format {
        KafkaFormat::Raw => vec!["value".to_string()],
        KafkaFormat::Json => k.fields.clone(),
    };
    values.into_iter().chain(KAFKA_METADATA_FIELDS.iter().map(|f| f.to_string())).collect()
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
        && !name.starts_with(['.', '-', '_'])
}

impl Validator {
    fn err(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.errors.push(Violation { path: path.into(), message: message.into() });
    }

    fn job_settings(&mut self, spec: &JobSpec) {
        if !valid_name(&spec.name) {
            self.err("job.name", "must be 1-63 letters, digits, '-', '_' or '.', not starting with a symbol");
        }
        if spec.max_parallelism == 0 || spec.max_parallelism > 32_768 {
            self.err("job.maxParallelism", "must be between 1 and 32768");
        }
        if spec.parallelism == 0 {
            self.err("job.parallelism", "must be > 0");
        } else if spec.parallelism > spec.max_parallelism {
            self.err("job.parallelism", format!("must be <= maxParallelism ({})", spec.max_parallelism));
        }
        if spec.state_cache_entries < 100 {
            self.err("job.stateCacheEntries", "must be at least 100");
        }
        let c = &spec.checkpointing;
        if c.interval.as_millis() == 0 {
            self.err("job.checkpointing.interval", "must be > 0");
        }
        if c.timeout.as_millis() == 0 {
            self.err("job.checkpointing.timeout", "must be > 0");
        }
        if c.max_concurrent == 0 {
            self.err("job.checkpointing.maxConcurrent", "must be >= 1");
        }
        if c.retained == 0 {
            self.err("job.checkpointing.retained", "must be >= 1 (the newest checkpoint is always kept)");
        }
        if c.full_every == 0 {
            self.err("job.checkpointing.fullEvery", "must be >= 1");
        }
        if let Some(storage) = &c.storage {
            if let Err(reason) = check_storage_url(storage) {
                self.err("job.checkpointing.storage", reason);
            }
        }
        let r = &spec.restart;
        if r.multiplier.is_nan() || r.multiplier < 1.0 || !r.multiplier.is_finite() {
            self.err("job.restart.multiplier", "must be a number >= 1");
        }
        if r.max_delay < r.delay {
            self.err("job.restart.maxDelay", "must be >= delay");
        }
    }

    fn parallelism(&mut self, spec: &JobSpec, path: &str, p: Option<u32>) -> u32 {
        let p = spec.parallelism_of(p);
        if p == 0 {
            self.err(format!("{path}.parallelism"), "must be > 0");
            return 1;
        }
        if p > spec.max_parallelism {
            self.err(format!("{path}.parallelism"), format!("must be <= maxParallelism ({})", spec.max_parallelism));
        }
        p
    }

    fn graph(&mut self, spec: &JobSpec) -> Vec<Node> {
        let mut nodes: Vec<Node> = Vec::new();
        let mut by_name: HashMap<String, usize> = HashMap::new();
        let mut uids: HashMap<String, String> = HashMap::new();

        if spec.sources.is_empty() {
            self.err("job.sources", "at least one source is required");
        }
        if spec.sinks.is_empty() {
            self.err("job.sinks", "at least one sink is required");
        }

        for (i, s) in spec.sources.iter().enumerate() {
            let path = format!("job.sources[{i}]");
            let kinds = [s.generator.is_some(), s.file.is_some(), s.kafka.is_some()];
            let kind = match kinds.iter().filter(|k| **k).count() {
                1 => {
                    if let Some(g) = &s.generator {
                        self.generator(&path, g, spec);
                        NodeKind::Generator(g.clone())
                    } else if let Some(f) = &s.file {
                        if f.path.trim().is_empty() {
                            self.err(format!("{path}.file.path"), "must not be empty");
                        }
                        NodeKind::FileSource(f.clone())
                    } else if let Some(k) = &s.kafka {
                        self.kafka_source(&format!("{path}.kafka"), k);
                        NodeKind::KafkaSource(k.clone())
                    } else {
                        unreachable!("one kind counted")
                    }
                }
                0 => {
                    self.err(path.clone(), "set exactly one of: generator, file, kafka");
                    continue;
                }
                _ => {
                    self.err(path.clone(), "set only one of: generator, file, kafka");
                    continue;
                }
            };
            let schema = match &kind {
                NodeKind::Generator(g) => g.fields.iter().map(|f| f.name.clone()).collect(),
                NodeKind::KafkaSource(k) => kafka_source_schema(k),
                _ => vec!["line".to_string()],
            };
            let parallelism = self.parallelism(spec, &path, s.parallelism);
            self.add_node(
                &mut nodes,
                &mut by_name,
                &mut uids,
                Node {
                    name: s.name.clone(),
                    path,
                    uid: s.uid.clone(),
                    parallelism,
                    kind,
                    inputs: vec![],
                    schema,
                    key: vec![],
                },
            );
        }

        let default_first_input = if spec.sources.len() == 1 { Some(spec.sources[0].name.clone()) } else { None };
        let mut previous: Option<String> = default_first_input.clone();
        for (i, o) in spec.operators.iter().enumerate() {
            let path = format!("job.operators[{i}]");
            if o.input.is_some() && o.inputs.is_some() {
                self.err(format!("{path}.inputs"), "set input or inputs, not both");
            }
            let inputs = self.inputs(
                &path,
                input_names(&o.input, &o.inputs),
                previous.as_deref(),
                &by_name,
                "a source or an earlier operator",
            );
            previous = Some(o.name.clone());
            let set: Vec<&str> = [
                ("map", o.map.is_some()),
                ("filter", o.filter.is_some()),
                ("flatMap", o.flat_map.is_some()),
                ("keyBy", o.key_by.is_some()),
                ("window", o.window.is_some()),
                ("aggregate", o.aggregate.is_some()),
                ("dedupe", o.dedupe.is_some()),
            ]
            .into_iter()
            .filter(|(_, on)| *on)
            .map(|(n, _)| n)
            .collect();
            if set.len() != 1 {
                let what = if set.is_empty() {
                    "set exactly one of".to_string()
                } else {
                    format!("{} are set; set only one of", set.join(" and "))
                };
                self.err(path.clone(), format!("{what}: map, filter, flatMap, keyBy, window, aggregate, dedupe"));
                continue;
            }
            let kind = if let Some(m) = &o.map {
                NodeKind::Map(m.clone())
            } else if let Some(f) = &o.filter {
                NodeKind::Filter(f.clone())
            } else if let Some(f) = &o.flat_map {
                NodeKind::FlatMap(f.clone())
            } else if let Some(k) = &o.key_by {
                NodeKind::KeyBy(k.clone())
            } else if let Some(w) = &o.window {
                NodeKind::Window(w.clone())
            } else if let Some(a) = &o.aggregate {
                NodeKind::Aggregate(a.clone())
            } else {
                NodeKind::Dedupe
            };
            let Some(inputs) = inputs else { continue };
            let input_schema = self.union_schema(&path, &inputs, &nodes);
            let (schema, key) = self.operator(&path, &kind, &inputs, &input_schema, &nodes);
            let parallelism = self.parallelism(spec, &path, o.parallelism);
            self.add_node(
                &mut nodes,
                &mut by_name,
                &mut uids,
                Node { name: o.name.clone(), path, uid: o.uid.clone(), parallelism, kind, inputs, schema, key },
            );
        }

        for (i, s) in spec.sinks.iter().enumerate() {
            let path = format!("job.sinks[{i}]");
            if s.input.is_some() && s.inputs.is_some() {
                self.err(format!("{path}.inputs"), "set input or inputs, not both");
            }
            let inputs = self.inputs(
                &path,
                input_names(&s.input, &s.inputs),
                previous.as_deref(),
                &by_name,
                "a source or an operator",
            );
            let set = [s.file.is_some(), s.kafka.is_some(), s.stdout.is_some(), s.blackhole.is_some()]
                .iter()
                .filter(|x| **x)
                .count();
            if set != 1 {
                self.err(path.clone(), "set exactly one of: file, kafka, stdout, blackhole");
                continue;
            }
            let kind = if let Some(f) = &s.file {
                if let Err(reason) = check_storage_url(&f.path) {
                    self.err(format!("{path}.file.path"), reason);
                }
                NodeKind::FileSink(f.clone())
            } else if let Some(k) = &s.kafka {
                NodeKind::KafkaSink(k.clone())
            } else if s.stdout.is_some() {
                NodeKind::Stdout
            } else {
                NodeKind::Blackhole
            };
            let Some(inputs) = inputs else { continue };
            let schema = self.union_schema(&path, &inputs, &nodes);
            if let NodeKind::KafkaSink(k) = &kind {
                self.kafka_sink(&format!("{path}.kafka"), k, &schema, spec);
            }
            let parallelism = self.parallelism(spec, &path, s.parallelism);
            self.add_node(
                &mut nodes,
                &mut by_name,
                &mut uids,
                Node { name: s.name.clone(), path, uid: s.uid.clone(), parallelism, kind, inputs, schema, key: vec![] },
            );
        }

        // Every non-sink node must feed something, or its work is silently lost.
        let mut consumed: HashSet<usize> = HashSet::new();
        for n in &nodes {
            consumed.extend(n.inputs.iter().copied());
        }
        for (i, n) in nodes.iter().enumerate() {
            if !n.kind.is_sink() && !consumed.contains(&i) {
                self.err(n.path.clone(), format!("`{}` feeds no operator or sink", n.name));
            }
        }
        nodes
    }

    fn add_node(
        &mut self,
        nodes: &mut Vec<Node>,
        by_name: &mut HashMap<String, usize>,
        uids: &mut HashMap<String, String>,
        node: Node,
    ) {
        if !valid_name(&node.name) {
            self.err(
                format!("{}.name", node.path),
                "must be 1-63 letters, digits, '-', '_' or '.', not starting with a symbol",
            );
        }
        if by_name.contains_key(&node.name) {
            self.err(format!("{}.name", node.path), format!("`{}` is already the name of another node", node.name));
        }
        match &node.uid {
            Some(uid) => {
                if !valid_name(uid) {
                    self.err(
                        format!("{}.uid", node.path),
                        "must be 1-63 letters, digits, '-', '_' or '.', not starting with a symbol",
                    );
                }
                if let Some(other) = uids.get(uid) {
                    self.err(format!("{}.uid", node.path), format!("`{uid}` is already the uid of {other}"));
                }
                uids.insert(uid.clone(), node.path.clone());
            }
            None if node.kind.is_stateful() => self.err(
                format!("{}.uid", node.path),
                format!(
                    "required: `{}` is a stateful {} and its state is restored by uid",
                    node.name,
                    node.kind.label()
                ),
            ),
            None => {}
        }
        by_name.insert(node.name.clone(), nodes.len());
        nodes.push(node);
    }

    fn inputs(
        &mut self,
        path: &str,
        inputs: Option<Vec<&str>>,
        previous: Option<&str>,
        by_name: &HashMap<String, usize>,
        what: &str,
    ) -> Option<Vec<usize>> {
        let names: Vec<String> = match inputs {
            Some(i) => i.into_iter().map(str::to_string).collect(),
            None => match previous {
                Some(p) => vec![p.to_string()],
                None => {
                    self.err(format!("{path}.input"), "required when the job has several sources");
                    return None;
                }
            },
        };
        if names.is_empty() {
            self.err(format!("{path}.input"), "must name at least one node");
            return None;
        }
        let mut out = Vec::new();
        for name in names {
            match by_name.get(&name) {
                Some(&i) => {
                    if out.contains(&i) {
                        self.err(format!("{path}.input"), format!("`{name}` is listed twice"));
                    }
                    out.push(i)
                }
                None => {
                    self.err(format!("{path}.input"), format!("`{name}` is not {what} declared before this node"));
                    return None;
                }
            }
        }
        Some(out)
    }

    fn union_schema(&mut self, path: &str, inputs: &[usize], nodes: &[Node]) -> Vec<String> {
        let first = nodes[inputs[0]].schema.clone();
        for &i in &inputs[1..] {
            if nodes[i].schema != first {
                self.err(
                    format!("{path}.input"),
                    format!(
                        "inputs have different fields ({} vs {}); map them to the same fields first",
                        first.join(","),
                        nodes[i].schema.join(",")
                    ),
                );
            }
        }
        first
    }

    /// A CEL expression must compile against its input's fields.
    fn expression(&mut self, path: String, text: &str, schema: &[String]) {
        if let Err(e) = crate::expr::compile(text, schema) {
            self.err(path, e.to_string());
        }
    }

    fn field(&mut self, path: &str, name: &str, schema: &[String]) -> Option<usize> {
        let pos = schema.iter().position(|f| f == name);
        if pos.is_none() {
            self.err(path, format!("no field `{name}` in the input (fields: {})", schema.join(", ")));
        }
        pos
    }

    fn kafka_common(&mut self, path: &str, bootstrap: &str, properties: &std::collections::BTreeMap<String, String>) {
        if bootstrap
            .split(',')
            .any(|b| b.trim().rsplit_once(':').is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err()))
        {
            self.err(format!("{path}.bootstrapServers"), format!("`{bootstrap}`: expected host:port[,host:port...]"));
        }
        for (key, value) in properties {
            if MANAGED_KAFKA_PROPERTIES.contains(&key.as_str()) {
                self.err(
                    format!("{path}.properties.{key}"),
                    "is set by Weir (exactly-once depends on it); use the sink's or source's own field",
                );
            }
            if let Some(rest) = value.strip_prefix("${env:") {
                if !rest.ends_with('}') || rest.len() < 2 {
                    self.err(format!("{path}.properties.{key}"), "write an environment reference as ${env:NAME}");
                }
            } else if SECRET_KAFKA_PROPERTIES.contains(&key.as_str()) {
                // The job is stored in the StreamJob and its ConfigMap, readable by whoever may
                // read those: a secret belongs in a Secret, passed by podTemplate.envFromSecrets.
                self.err(
                    format!("{path}.properties.{key}"),
                    "holds a secret: write ${env:NAME} and give NAME from a Secret (podTemplate.envFromSecrets)",
                );
            }
        }
    }

    fn kafka_source(&mut self, path: &str, k: &KafkaSourceSpec) {
        self.kafka_common(path, &k.bootstrap_servers, &k.properties);
        if k.topics.is_empty() {
            self.err(format!("{path}.topics"), "at least one topic is required");
        }
        for (i, t) in k.topics.iter().enumerate() {
            if !valid_topic(t) {
                self.err(format!("{path}.topics[{i}]"), format!("`{t}` is not a Kafka topic name ({TOPIC_RULE})"));
            }
        }
        match (k.start_from, k.start_timestamp_ms) {
            (KafkaStartFrom::Timestamp, None) => {
                self.err(format!("{path}.startTimestampMs"), "required with startFrom: timestamp")
            }
            (KafkaStartFrom::Timestamp, Some(_)) | (_, None) => {}
            (_, Some(_)) => self.err(format!("{path}.startTimestampMs"), "only read with startFrom: timestamp"),
        }
        match k.format {
            KafkaFormat::Json if k.fields.is_empty() => {
                self.err(format!("{path}.fields"), "name the JSON fields to read (format: json)")
            }
            KafkaFormat::Raw if !k.fields.is_empty() => {
                self.err(format!("{path}.fields"), "only read with format: json (raw values are in field `value`)")
            }
            _ => {}
        }
        let mut seen = HashSet::new();
        for (i, f) in k.fields.iter().enumerate() {
            if KAFKA_METADATA_FIELDS.contains(&f.as_str()) {
                self.err(
                    format!("{path}.fields[{i}]"),
                    format!("`{f}` is a metadata field of every Kafka record ({})", KAFKA_METADATA_FIELDS.join(", ")),
                );
            }
            if !seen.insert(f) {
                self.err(format!("{path}.fields[{i}]"), format!("`{f}` is listed twice"));
            }
        }
    }

    fn kafka_sink(&mut self, path: &str, k: &KafkaSinkSpec, schema: &[String], spec: &JobSpec) {
        self.kafka_common(path, &k.bootstrap_servers, &k.properties);
        if !valid_topic(&k.topic) {
            self.err(format!("{path}.topic"), format!("`{}` is not a Kafka topic name ({TOPIC_RULE})", k.topic));
        }
        if let Some(f) = &k.key_field {
            self.field(&format!("{path}.keyField"), f, schema);
        }
        for (i, f) in k.header_fields.iter().enumerate() {
            self.field(&format!("{path}.headerFields[{i}]"), f, schema);
        }
        match (k.format, &k.value_field) {
            (KafkaFormat::Raw, None) => self.err(format!("{path}.valueField"), "required with format: raw"),
            (KafkaFormat::Raw, Some(f)) => {
                self.field(&format!("{path}.valueField"), f, schema);
            }
            (KafkaFormat::Json, Some(_)) => self.err(format!("{path}.valueField"), "only read with format: raw"),
            (KafkaFormat::Json, None) => {}
        }
        if let Some(p) = &k.partitioner {
            if !KAFKA_PARTITIONERS.contains(&p.as_str()) {
                self.err(
                    format!("{path}.partitioner"),
                    format!("`{p}`: expected one of {}", KAFKA_PARTITIONERS.join(", ")),
                );
            }
        }
        if k.delivery == KafkaDelivery::ExactlyOnce {
            if !valid_topic(&k.marker_topic) {
                self.err(
                    format!("{path}.markerTopic"),
                    format!("`{}` is not a Kafka topic name ({TOPIC_RULE})", k.marker_topic),
                );
            }
            if k.marker_topic == k.topic {
                self.err(format!("{path}.markerTopic"), "must differ from the output topic");
            }
            if let Some(prefix) = &k.transactional_id_prefix {
                if !valid_name(prefix) {
                    self.err(
                        format!("{path}.transactionalIdPrefix"),
                        "must be 1-63 letters, digits, '-', '_' or '.', not starting with a symbol",
                    );
                }
            }
            let c = &spec.checkpointing;
            if !c.enabled {
                self.err(
                    format!("{path}.delivery"),
                    "exactly-once commits on checkpoint completion: enable job.checkpointing, or use at-least-once",
                );
            }
            let needed = c.interval.as_millis() + c.timeout.as_millis() + spec.restart.max_delay.as_millis();
            if k.transaction_timeout.as_millis() <= needed {
                self.err(
                    format!("{path}.transactionTimeout"),
                    format!(
                        "must exceed checkpointing.interval + checkpointing.timeout + restart.maxDelay ({needed} ms): \
                         a transaction must outlive the wait for its checkpoint and a restart"
                    ),
                );
            }
        }
    }

    fn generator(&mut self, path: &str, g: &GeneratorSpec, spec: &JobSpec) {
        if g.fields.is_empty() {
            self.err(format!("{path}.generator.fields"), "at least one field is required");
        }
        if g.rate_per_second == Some(0) {
            self.err(format!("{path}.generator.ratePerSecond"), "must be > 0 (omit it for no limit)");
        }
        if let Some(s) = g.splits {
            if s == 0 || s > spec.max_parallelism.max(1) * 16 {
                self.err(format!("{path}.generator.splits"), "must be between 1 and 16 × maxParallelism");
            }
        }
        let mut seen = HashSet::new();
        for (j, f) in g.fields.iter().enumerate() {
            let fpath = format!("{path}.generator.fields[{j}]");
            if !seen.insert(f.name.clone()) {
                self.err(format!("{fpath}.name"), format!("`{}` appears twice", f.name));
            }
            let kinds =
                [f.sequence.is_some(), f.modulo.is_some(), f.word.is_some(), f.text.is_some(), f.uniform.is_some()];
            if kinds.iter().filter(|k| **k).count() != 1 {
                self.err(fpath.clone(), "set exactly one of: sequence, modulo, word, text, uniform");
            }
            if f.modulo == Some(0) {
                self.err(format!("{fpath}.modulo"), "must be > 0");
            }
            if let Some(w) = &f.word {
                if w.cardinality == 0 || w.cardinality > 10_000_000 {
                    self.err(format!("{fpath}.word.cardinality"), "must be between 1 and 10000000");
                }
            }
            if let Some(t) = &f.text {
                if t.words == 0 {
                    self.err(format!("{fpath}.text.words"), "must be > 0");
                }
                if t.vocabulary == 0 || t.vocabulary > 10_000_000 {
                    self.err(format!("{fpath}.text.vocabulary"), "must be between 1 and 10000000");
                }
            }
            if let Some(u) = &f.uniform {
                if u.min > u.max {
                    self.err(format!("{fpath}.uniform.max"), "must be >= min");
                }
            }
        }
    }

    fn aggregates(&mut self, path: &str, aggs: &[AggregateFn], schema: &[String], taken: &mut HashSet<String>) {
        if aggs.is_empty() {
            self.err(path, "at least one aggregate is required");
        }
        for (j, a) in aggs.iter().enumerate() {
            let apath = format!("{path}[{j}]");
            match (&a.function, &a.field) {
                (AggregateKind::Count, _) => {}
                (_, None) => {
                    self.err(format!("{apath}.field"), format!("required for `{:?}`", a.function).to_lowercase())
                }
                (_, Some(f)) => {
                    self.field(&format!("{apath}.field"), f, schema);
                }
            }
            if !taken.insert(a.output.clone()) {
                self.err(format!("{apath}.as"), format!("output field `{}` is already used", a.output));
            }
        }
    }

    fn operator(
        &mut self,
        path: &str,
        kind: &NodeKind,
        inputs: &[usize],
        schema: &[String],
        nodes: &[Node],
    ) -> (Vec<String>, Vec<usize>) {
        let keyed_input = || -> Option<&Node> {
            match inputs {
                [one] if matches!(nodes[*one].kind, NodeKind::KeyBy(_)) => Some(&nodes[*one]),
                _ => None,
            }
        };
        let mut key = Vec::new();
        if kind.is_keyed() {
            match keyed_input() {
                Some(kb) => {
                    if let NodeKind::KeyBy(k) = &kb.kind {
                        key = k.fields.iter().filter_map(|f| schema.iter().position(|s| s == f)).collect();
                    }
                }
                None => self.err(
                    format!("{path}.input"),
                    format!("a {} needs one keyed input: put a keyBy operator right before it", kind.label()),
                ),
            }
        }
        let out = match kind {
            NodeKind::Map(m) => {
                if m.fields.0.is_empty() {
                    self.err(format!("{path}.map.fields"), "at least one field is required");
                }
                let mut out: Vec<String> = if m.keep_input { schema.to_vec() } else { Vec::new() };
                let mut seen = HashSet::new();
                for (name, expr) in &m.fields.0 {
                    if !seen.insert(name.clone()) {
                        self.err(format!("{path}.map.fields.{name}"), "appears twice");
                    }
                    if expr.trim().is_empty() {
                        self.err(format!("{path}.map.fields.{name}"), "expression must not be empty");
                    } else {
                        self.expression(format!("{path}.map.fields.{name}"), expr, schema);
                    }
                    if !out.contains(name) {
                        out.push(name.clone());
                    }
                }
                out
            }
            NodeKind::Filter(f) => {
                if f.expr.trim().is_empty() {
                    self.err(format!("{path}.filter.expr"), "must not be empty");
                } else {
                    self.expression(format!("{path}.filter.expr"), &f.expr, schema);
                }
                schema.to_vec()
            }
            NodeKind::FlatMap(f) => match (&f.split, &f.expr) {
                (Some(s), None) => {
                    if let Some(pos) = self.field(&format!("{path}.flatMap.split.field"), &s.field, schema) {
                        let mut out = schema.to_vec();
                        out[pos] = s.into.clone();
                        out
                    } else {
                        schema.to_vec()
                    }
                }
                (None, Some(expr)) => {
                    self.expression(format!("{path}.flatMap.expr"), expr, schema);
                    let Some(name) = &f.as_field else {
                        self.err(format!("{path}.flatMap.as"), "required with expr: the field that holds each element");
                        return (schema.to_vec(), key);
                    };
                    let mut out = schema.to_vec();
                    if !out.contains(name) {
                        out.push(name.clone());
                    }
                    out
                }
                _ => {
                    self.err(format!("{path}.flatMap"), "set exactly one of: split, expr");
                    schema.to_vec()
                }
            },
            NodeKind::KeyBy(k) => {
                if k.fields.is_empty() {
                    self.err(format!("{path}.keyBy.fields"), "at least one field is required");
                }
                for (j, f) in k.fields.iter().enumerate() {
                    self.field(&format!("{path}.keyBy.fields[{j}]"), f, schema);
                }
                schema.to_vec()
            }
            NodeKind::Window(w) => {
                let wpath = format!("{path}.window");
                if w.size.as_millis() == 0 {
                    self.err(format!("{wpath}.size"), "must be > 0");
                }
                match (w.kind, w.slide) {
                    (WindowKind::Tumbling, Some(_)) => self.err(format!("{wpath}.slide"), "only for sliding windows"),
                    (WindowKind::Sliding, None) => self.err(format!("{wpath}.slide"), "required for sliding windows"),
                    (WindowKind::Sliding, Some(s)) => {
                        if s.as_millis() == 0 {
                            self.err(format!("{wpath}.slide"), "must be > 0");
                        } else if s > w.size {
                            self.err(format!("{wpath}.slide"), "must be <= size");
                        } else if w.size.as_millis() / s.as_millis() > 1000 {
                            self.err(
                                format!("{wpath}.slide"),
                                "size/slide must be <= 1000 (each record lands in size/slide windows)",
                            );
                        }
                    }
                    _ => {}
                }
                let mut out: Vec<String> = key.iter().map(|&k| schema[k].clone()).collect();
                out.push("window_start".into());
                out.push("window_end".into());
                let mut taken: HashSet<String> = out.iter().cloned().collect();
                self.aggregates(&format!("{wpath}.aggregates"), &w.aggregates, schema, &mut taken);
                out.extend(w.aggregates.iter().map(|a| a.output.clone()));
                out
            }
            NodeKind::Aggregate(a) => {
                let mut out: Vec<String> = key.iter().map(|&k| schema[k].clone()).collect();
                let mut taken: HashSet<String> = out.iter().cloned().collect();
                self.aggregates(&format!("{path}.aggregate.aggregates"), &a.aggregates, schema, &mut taken);
                out.extend(a.aggregates.iter().map(|a| a.output.clone()));
                out
            }
            NodeKind::Dedupe => schema.to_vec(),
            _ => schema.to_vec(),
        };
        (out, key)
    }
}

/// Checks that a storage URL is one Weir can use: a local path, `file:///...`, `s3://bucket/...`,
/// `gs://bucket/...`, `az://container/...` or `memory://`.
pub fn check_storage_url(url: &str) -> Result<(), String> {
    let url = url.trim();
    if url.is_empty() {
        return Err("must not be empty".into());
    }
    match url.split_once("://") {
        None => Ok(()),
        Some(("file", rest)) if rest.starts_with('/') => Ok(()),
        Some(("file", _)) => Err("a file URL needs an absolute path: file:///path".into()),
        Some(("s3" | "gs" | "az", rest)) => {
            let bucket = rest.split('/').next().unwrap_or("");
            if bucket.is_empty() {
                Err("needs a bucket: s3://bucket/prefix".into())
            } else {
                Ok(())
            }
        }
        Some(("memory", _)) => Ok(()),
        Some((scheme, _)) => {
            Err(format!("unsupported scheme `{scheme}` (use a path, file://, s3://, gs://, az:// or memory://)"))
        }
    }
}
