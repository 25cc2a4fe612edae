//! Kafka → Kafka throughput and the latency exactly-once adds, against a real broker (the
//! tests' KRaft broker, `runtime/tests/kafka_broker`), printed as figures (not a timed test).
//!
//! `cargo bench -p weir-runtime --bench kafka` runs, in this run on this machine:
//! - throughput of one job (Kafka → JSON map → Kafka, bounded read of the same input topic)
//!   with checkpoints off, with checkpoints every 1 s and an at-least-once sink, and with
//!   checkpoints every 1 s and the exactly-once sink; records/s and records per CPU-second of
//!   the runtime (the broker runs in its own process and is not counted);
//! - end-to-end latency at a steady input rate: the time from a record's producer timestamp
//!   until a `read_committed` consumer sees its result, p50/p99, at-least-once vs exactly-once.
//!
//! Under `cargo test` it runs as a quick smoke test. `WEIR_BENCH_SCALE` multiplies the record
//! counts.

#[path = "../tests/kafka_broker/mod.rs"]
mod kafka_broker;

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kafka_broker::broker;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use weir_runtime::executor::{run_job, RunOptions};
use weir_runtime::metrics::JobMetrics;

#[path = "support/cpu.rs"]
mod cpu;
use cpu::cpu_seconds;

fn job(name: &str, input: &str, output: &str, checkpoints: bool, delivery: &str, bounded: bool) -> String {
    let bootstrap = &broker().bootstrap;
    let checkpointing = if checkpoints { "{ interval: 1s, timeout: 30s }" } else { "{ enabled: false }" };
    format!(
        r#"name: {name}
parallelism: 2
checkpointing: {checkpointing}
sources:
  - name: events
    uid: events
    kafka:
      {{ bootstrapServers: "{bootstrap}", topics: [{input}], format: json, fields: [id, word], bounded: {bounded} }}
operators:
  - {{ name: tagged, map: {{ fields: {{ id: "id", word: "word", sent: "timestamp" }} }} }}
sinks:
  - name: out
    uid: out
    kafka: {{ bootstrapServers: "{bootstrap}", topic: {output}, delivery: {delivery}, keyField: word }}
"#
    )
}

struct Run {
    records: u64,
    wall: f64,
    cpu: f64,
}

fn run_bounded(yaml: &str) -> Run {
    let job = weir_runtime::load_job(yaml).expect("bench job is valid");
    let metrics = Arc::new(JobMetrics::new(&job.spec.name, "bench"));
    let dir = tempfile::tempdir().unwrap();
    let opts = RunOptions { checkpoint_dir: Some(dir.path().display().to_string()), ..RunOptions::default() };
    let (_tx, rx) = crossbeam_channel::unbounded();
    let (cpu0, t0) = (cpu_seconds(), Instant::now());
    run_job(&job, &opts, metrics.clone(), rx).expect("bench job runs");
    Run { records: metrics.records_in.get(), wall: t0.elapsed().as_secs_f64(), cpu: cpu_seconds() - cpu0 }
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as i64
}

/// Runs the unbounded job while records are produced at `rate` per second for `seconds`, and
/// measures, for each output record, now minus its input record's producer timestamp.
fn latency(name: &str, delivery: &str, rate: u64, seconds: u64) -> (u64, u64, usize) {
    let b = broker();
    let (input, output) = (format!("{name}-in"), format!("{name}-out"));
    b.create_topic(&input, 2);
    b.create_topic(&output, 2);
    let yaml = job(name, &input, &output, true, delivery, false);
    let job = weir_runtime::load_job(&yaml).unwrap();
    let metrics = Arc::new(JobMetrics::new(&job.spec.name, "bench"));
    let dir = tempfile::tempdir().unwrap();
    let opts = RunOptions { checkpoint_dir: Some(dir.path().display().to_string()), ..RunOptions::default() };
    let (tx, rx) = crossbeam_channel::unbounded();
    let m = metrics.clone();
    let running = std::thread::spawn(move || run_job(&job, &opts, m, rx));
    let reader: BaseConsumer = kafka_broker::config(&b.bootstrap)
        .set("group.id", "weir-bench-latency")
        .set("isolation.level", "read_committed")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..2 {
        tpl.add_partition_offset(&output, p, Offset::Beginning).unwrap();
    }
    reader.assign(&tpl).unwrap();
    let mut producer = Some({
        let input = input.clone();
        std::thread::spawn(move || {
            // One producer for the whole run: a record's timestamp is taken when it is sent.
            let producer = broker().producer();
            let per_tick = (rate / 20).max(1);
            let mut next = 0u64;
            let start = Instant::now();
            for tick in 0..seconds * 20 {
                for i in next..next + per_tick {
                    let (key, value) = (i.to_string(), format!(r#"{{"id":{i},"word":"w{}"}}"#, i % 100));
                    let record = rdkafka::producer::BaseRecord::to(&input).key(&key).payload(&value);
                    producer.send(record).map_err(|(e, _)| e).expect("the input is sent");
                }
                next += per_tick;
                let due = start + Duration::from_millis((tick + 1) * 50);
                std::thread::sleep(due.saturating_duration_since(Instant::now()));
            }
            rdkafka::producer::Producer::flush(&producer, Duration::from_secs(30)).unwrap();
            next
        })
    });
    let mut lat = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(seconds + 30);
    let mut produced = None;
    while Instant::now() < deadline {
        if let Some(Ok(m)) = reader.poll(Duration::from_millis(100)) {
            let v: serde_json::Value = serde_json::from_slice(m.payload().unwrap_or_default()).unwrap();
            lat.push((now_ms() - v["sent"].as_i64().unwrap_or(0)).max(0) as u64);
        }
        if producer.as_ref().is_some_and(|p| p.is_finished()) {
            produced = producer.take().map(|p| p.join().unwrap());
        }
        let total = produced.unwrap_or(u64::MAX);
        if lat.len() as u64 >= total {
            break;
        }
    }
    let _ = tx.send(weir_runtime::executor::Request::Cancel);
    let _ = running.join();
    lat.sort_unstable();
    let pick = |p: f64| lat.get(((lat.len().max(1) - 1) as f64 * p) as usize).copied().unwrap_or(0);
    (pick(0.5), pick(0.99), lat.len())
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    // `cargo bench` passes --bench; under `cargo test` this runs as a quick smoke test.
    let smoke = !std::env::args().any(|a| a == "--bench");
    let scale: f64 =
        std::env::var("WEIR_BENCH_SCALE").ok().and_then(|s| s.parse().ok()).unwrap_or(if smoke { 0.01 } else { 1.0 });
    let records = ((1_000_000.0 * scale) as u64).max(1_000);
    let b = broker();
    let input = format!("bench-in-{}", std::process::id());
    b.create_topic(&input, 2);
    let t0 = Instant::now();
    for chunk in (0..records).collect::<Vec<_>>().chunks(50_000) {
        b.produce(&input, chunk.iter().map(|i| (i.to_string(), format!(r#"{{"id":{i},"word":"w{}"}}"#, i % 1000))));
    }
    println!("input: {records} records into {input} in {:.1} s", t0.elapsed().as_secs_f64());
    println!("| sink | checkpoints | records | records/s | records/CPU-s | vs no checkpoints |");
    println!("|---|---|---|---|---|---|");
    let mut baseline = None;
    for (label, checkpoints, delivery) in [
        ("at-least-once", false, "at-least-once"),
        ("at-least-once", true, "at-least-once"),
        ("exactly-once", true, "exactly-once"),
    ] {
        let output = format!("bench-out-{}-{}-{checkpoints}", std::process::id(), delivery);
        b.create_topic(&output, 2);
        let r = run_bounded(&job(&format!("bench-{delivery}"), &input, &output, checkpoints, delivery, true));
        assert_eq!(r.records, records, "every input record was read");
        let rate = r.records as f64 / r.wall;
        let base = *baseline.get_or_insert(rate);
        println!(
            "| {label} | {} | {} | {:.0}K | {:.0}K | {:.2} |",
            if checkpoints { "every 1 s" } else { "off" },
            r.records,
            rate / 1e3,
            r.records as f64 / r.cpu / 1e3,
            rate / base
        );
    }
    let (rate, seconds) = if smoke { (2_000, 3) } else { (20_000, 20) };
    println!("\nlatency at {rate} records/s for {seconds} s (producer timestamp → visible read_committed):");
    println!("| sink | p50 | p99 | records |");
    println!("|---|---|---|---|");
    for delivery in ["at-least-once", "exactly-once"] {
        let (p50, p99, n) = latency(&format!("lat-{}-{delivery}", std::process::id()), delivery, rate, seconds);
        println!("| {delivery} | {p50} ms | {p99} ms | {n} |");
    }
}
