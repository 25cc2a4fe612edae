//! Every way a job file can be wrong is reported with its field path and a reason.

use weir_crds::{validate, JobSpec};

const BASE: &str = r#"
name: shop
parallelism: 2
sources:
  - name: orders
    uid: orders
    generator:
      count: 100
      fields:
        - { name: id, sequence: {} }
        - { name: user, modulo: 10 }
        - { name: amount, uniform: { min: 1, max: 9 } }
operators:
  - { name: by-user, keyBy: { fields: [user] } }
  - name: totals
    uid: totals
    window: { type: tumbling, size: 1s, aggregates: [ { fn: sum, field: amount, as: total } ] }
sinks:
  - { name: out, uid: out, file: { path: /tmp/out } }
"#;

fn errors_of(yaml: &str) -> String {
    match JobSpec::from_yaml(yaml) {
        Err(e) => e.to_string(),
        Ok(spec) => match validate(&spec) {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        },
    }
}

fn with(from: &str, to: &str) -> String {
    assert!(BASE.contains(from), "fixture lacks `{from}`");
    BASE.replacen(from, to, 1)
}

#[test]
fn the_base_fixture_is_valid_and_resolved() {
    let job = validate(&JobSpec::from_yaml(BASE).unwrap()).unwrap();
    let totals = job.nodes.iter().find(|n| n.name == "totals").unwrap();
    assert_eq!(totals.schema, vec!["user", "window_start", "window_end", "total"]);
    assert_eq!(totals.key, vec![1]);
    assert_eq!(job.spec.checkpointing.interval.as_millis(), 1000, "defaults apply");
}

#[test]
fn each_mistake_names_its_field() {
    let cases: Vec<(String, &str)> = vec![
        (with("size: 1s", "size: 0s"), "job.operators[1].window.size: must be > 0"),
        (with("size: 1s", "size: -1s"), "job.operators[1].window.size"),
        (with("type: tumbling", "type: hopping"), "job.operators[1].window.type: unknown variant `hopping`"),
        (with("size: 1s,", "size: 1s, slide: 1s,"), "job.operators[1].window.slide: only for sliding windows"),
        (
            with("type: tumbling, size: 1s", "type: sliding, size: 1s"),
            "job.operators[1].window.slide: required for sliding windows",
        ),
        (
            with("type: tumbling, size: 1s", "type: sliding, size: 1s, slide: 2s"),
            "job.operators[1].window.slide: must be <= size",
        ),
        (with("    uid: totals\n", ""), "job.operators[1].uid: required: `totals` is a stateful window"),
        (with("uid: out, ", ""), "job.sinks[0].uid: required"),
        (
            with("{ name: by-user, keyBy: { fields: [user] } }", "{ name: by-user, keyBy: { fields: [customer] } }"),
            "job.operators[0].keyBy.fields[0]: no field `customer`",
        ),
        (with("field: amount", "field: price"), "job.operators[1].window.aggregates[0].field: no field `price`"),
        (
            with("{ fn: sum, field: amount, as: total }", "{ fn: sum, as: total }"),
            "job.operators[1].window.aggregates[0].field: required for `sum`",
        ),
        (with("parallelism: 2", "parallelism: 0"), "job.parallelism: must be > 0"),
        (with("parallelism: 2", "parallelism: 300"), "job.parallelism: must be <= maxParallelism (128)"),
        (
            with("parallelism: 2", "parallelism: 2\ncheckpointing: { retained: 0 }"),
            "job.checkpointing.retained: must be >= 1",
        ),
        (
            with("parallelism: 2", "parallelism: 2\ncheckpointing: { interval: 0s }"),
            "job.checkpointing.interval: must be > 0",
        ),
        (
            with("parallelism: 2", "parallelism: 2\ncheckpointing: { interval: soon }"),
            "job.checkpointing.interval: `soon` is not a duration",
        ),
        (
            with("parallelism: 2", "parallelism: 2\ncheckpointing: { mode: exactly-twice }"),
            "job.checkpointing.mode: unknown variant `exactly-twice`",
        ),
        (
            with("parallelism: 2", "parallelism: 2\ncheckpointing: { storage: \"ftp://x\" }"),
            "job.checkpointing.storage: unsupported scheme `ftp`",
        ),
        (
            with("parallelism: 2", "parallelism: 2\ncheckpointing: { storage: \"s3://\" }"),
            "job.checkpointing.storage: needs a bucket",
        ),
        (
            with("parallelism: 2", "parallelism: 2\nrestart: { multiplier: 0.5 }"),
            "job.restart.multiplier: must be a number >= 1",
        ),
        (
            with(
                "{ name: out, uid: out, file: { path: /tmp/out } }",
                "{ name: out, uid: out, file: { path: /tmp/out }, stdout: {} }",
            ),
            "job.sinks[0]: set exactly one of: file, kafka, stdout, blackhole",
        ),
        (
            with(
                "{ name: out, uid: out, file: { path: /tmp/out } }",
                "{ name: out, uid: orders, file: { path: /tmp/out } }",
            ),
            "job.sinks[0].uid: `orders` is already the uid of job.sources[0]",
        ),
        (
            with("name: totals\n", "name: by-user\n"),
            "job.operators[1].name: `by-user` is already the name of another node",
        ),
        (
            with(
                "{ name: by-user, keyBy: { fields: [user] } }",
                "{ name: by-user, input: nowhere, keyBy: { fields: [user] } }",
            ),
            "job.operators[0].input: `nowhere` is not a source or an earlier operator",
        ),
        (
            with("{ name: by-user, keyBy: { fields: [user] } }", "{ name: by-user, filter: { expr: \"user > 1\" } }"),
            "job.operators[1].input: a window needs one keyed input",
        ),
        (with("name: shop", "name: \"shop/1\""), "job.name: must be 1-63 letters"),
        (
            with("{ name: by-user, keyBy: { fields: [user] } }", "{ name: cheap, filter: { expr: \"amount <\" } }"),
            "job.operators[0].filter.expr: CEL expression `amount <` does not compile",
        ),
        (
            with("{ name: by-user, keyBy: { fields: [user] } }", "{ name: cheap, filter: { expr: \"price < 3\" } }"),
            "job.operators[0].filter.expr: CEL expression `price < 3` uses `price`, which is not an input field",
        ),
        (
            with(
                "{ name: by-user, keyBy: { fields: [user] } }",
                "{ name: tag, map: { fields: { big: \"amount >\" }, keepInput: true } }",
            ),
            "job.operators[0].map.fields.big: CEL expression `amount >` does not compile",
        ),
        (
            with("{ name: amount, uniform: { min: 1, max: 9 } }", "{ name: amount, uniform: { min: 9, max: 1 } }"),
            "job.sources[0].generator.fields[2].uniform.max: must be >= min",
        ),
        (
            with("{ name: user, modulo: 10 }", "{ name: user, modulo: 10, sequence: {} }"),
            "job.sources[0].generator.fields[1]: set exactly one of",
        ),
        (
            with("count: 100", "count: 100\n      colour: red"),
            "job.sources[0].generator.colour: unknown field `colour`",
        ),
        (
            with("    generator:", "    file: { path: /tmp/in }\n    generator:"),
            "job.sources[0]: set only one of: generator, file",
        ),
    ];
    assert!(cases.len() >= 15);
    for (yaml, expected) in &cases {
        let errors = errors_of(yaml);
        assert!(errors.contains(expected), "expected `{expected}`, got:\n{errors}");
    }
}

#[test]
fn unused_nodes_are_reported() {
    let yaml = with("sinks:\n", "  - { name: idle, input: orders, filter: { expr: \"true\" } }\nsinks:\n");
    let yaml = yaml.replace(
        "{ name: out, uid: out, file: { path: /tmp/out } }",
        "{ name: out, uid: out, input: totals, file: { path: /tmp/out } }",
    );
    assert!(errors_of(&yaml).contains("job.operators[2]: `idle` feeds no operator or sink"), "{}", errors_of(&yaml));
}

const KAFKA: &str = r#"
name: kafka-job
checkpointing: { interval: 1s, timeout: 30s }
sources:
  - name: events
    uid: events
    kafka: { bootstrapServers: "k1:9092,k2:9092", topics: [events], format: json, fields: [id, word] }
operators:
  - { name: by-word, keyBy: { fields: [word] } }
  - { name: counts, uid: counts, aggregate: { aggregates: [ { fn: count, as: n } ] } }
sinks:
  - name: out
    uid: out
    kafka: { bootstrapServers: "k1:9092", topic: counts, keyField: word }
"#;

fn kafka_with(from: &str, to: &str) -> String {
    assert!(KAFKA.contains(from), "fixture lacks `{from}`");
    KAFKA.replacen(from, to, 1)
}

#[test]
fn a_kafka_job_is_valid_with_metadata_fields_and_exactly_once_by_default() {
    let job = validate(&JobSpec::from_yaml(KAFKA).unwrap()).unwrap();
    let events = job.nodes.iter().find(|n| n.name == "events").unwrap();
    assert_eq!(events.schema, vec!["id", "word", "key", "topic", "partition", "offset", "timestamp", "headers"]);
    let out = job.spec.sinks[0].kafka.as_ref().unwrap();
    assert_eq!(out.delivery, weir_crds::job::KafkaDelivery::ExactlyOnce);
    assert_eq!(out.transaction_timeout.as_millis(), 900_000);
    let raw = kafka_with(", format: json, fields: [id, word]", "")
        .replace("fields: [word]", "fields: [value]")
        .replace("keyField: word", "keyField: value");
    let job = validate(&JobSpec::from_yaml(&raw).unwrap()).unwrap();
    assert_eq!(job.nodes[0].schema[0], "value", "raw values are in `value`");
}

#[test]
fn kafka_mistakes_name_their_field() {
    let cases: Vec<(String, &str)> = vec![
        (
            kafka_with("\"k1:9092,k2:9092\"", "\"k1\""),
            "job.sources[0].kafka.bootstrapServers: `k1`: expected host:port",
        ),
        (kafka_with("topics: [events]", "topics: []"), "job.sources[0].kafka.topics: at least one topic is required"),
        (
            kafka_with("topics: [events]", "topics: [\"a b\"]"),
            "job.sources[0].kafka.topics[0]: `a b` is not a Kafka topic",
        ),
        (
            kafka_with("fields: [id, word]", "fields: [id, word, offset]"),
            "job.sources[0].kafka.fields[2]: `offset` is a metadata field",
        ),
        (kafka_with(", fields: [id, word]", ""), "job.sources[0].kafka.fields: name the JSON fields"),
        (
            kafka_with("format: json", "startFrom: timestamp, format: json"),
            "job.sources[0].kafka.startTimestampMs: required with startFrom: timestamp",
        ),
        (kafka_with("keyField: word", "keyField: nope"), "job.sinks[0].kafka.keyField: no field `nope` in the input"),
        (
            kafka_with("keyField: word", "keyField: word, format: raw"),
            "job.sinks[0].kafka.valueField: required with format: raw",
        ),
        (kafka_with("keyField: word", "keyField: word, partitioner: hash"), "job.sinks[0].kafka.partitioner: `hash`"),
        (
            kafka_with("topic: counts", "topic: counts, markerTopic: counts"),
            "job.sinks[0].kafka.markerTopic: must differ",
        ),
        (
            kafka_with("interval: 1s, timeout: 30s", "enabled: false"),
            "job.sinks[0].kafka.delivery: exactly-once commits on checkpoint completion",
        ),
        (
            kafka_with("keyField: word", "keyField: word, transactionTimeout: 20s"),
            "job.sinks[0].kafka.transactionTimeout: must exceed checkpointing.interval + checkpointing.timeout + \
             restart.maxDelay (",
        ),
        (
            kafka_with("keyField: word", "keyField: word, properties: { transactional.id: mine }"),
            "job.sinks[0].kafka.properties.transactional.id: is set by Weir",
        ),
        (
            kafka_with("keyField: word", "keyField: word, properties: { sasl.password: \"${env:PW\" }"),
            "job.sinks[0].kafka.properties.sasl.password: write an environment reference as ${env:NAME}",
        ),
        (
            kafka_with("keyField: word", "keyField: word, properties: { sasl.password: hunter2 }"),
            "job.sinks[0].kafka.properties.sasl.password: holds a secret: write ${env:NAME}",
        ),
        (
            kafka_with(
                "    kafka: { bootstrapServers: \"k1:9092\"",
                "    stdout: {}\n    kafka: { bootstrapServers: \"k1:9092\"",
            ),
            "job.sinks[0]: set exactly one of: file, kafka, stdout, blackhole",
        ),
    ];
    for (yaml, want) in cases {
        let got = errors_of(&yaml);
        assert!(got.contains(want), "expected `{want}` in:\n{got}\nfor:\n{yaml}");
    }
    // At-least-once needs no checkpointing.
    let alo = kafka_with("keyField: word", "keyField: word, delivery: at-least-once")
        .replace("interval: 1s, timeout: 30s", "enabled: false");
    assert_eq!(errors_of(&alo), "");
}
