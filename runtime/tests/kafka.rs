//! Kafka in, Kafka out, against a real Apache Kafka broker (KRaft, from Maven Central; see
//! `kafka_broker`): exactly-once under SIGKILLs and aborts at every phase of the commit
//! protocol, a broker-side transaction timeout, at-least-once without loss, rescale through a
//! savepoint, and clear refusals of what cannot work.
//!
//! Output is read back `read_committed` and checked record by record against a model: the
//! job counts records per word, so word `w` with `n` input records must appear with the
//! counts 1..=n, each exactly once.

#![cfg(feature = "kafka")]

mod common;
mod kafka_broker;

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::*;
use kafka_broker::broker;

static TOPICS: AtomicU64 = AtomicU64::new(0);

/// A topic name unique to this test process.
fn topic(what: &str) -> String {
    format!("{what}-{}-{}", std::process::id(), TOPICS.fetch_add(1, Ordering::Relaxed))
}

const WORDS: u64 = 37;

/// Input record `i`: key `i`, value `{"id": i, "word": "w<i mod 37>"}`.
fn input(i: u64) -> (String, String) {
    (i.to_string(), format!(r#"{{"id":{i},"word":"w{}"}}"#, i % WORDS))
}

/// The job: read `input` (JSON), count per word, write `{word, n}` to `output`.
#[allow(clippy::too_many_arguments)]
fn job_yaml(
    name: &str,
    bootstrap: &str,
    input: &str,
    output: &str,
    bounded: bool,
    delivery: &str,
    parallelism: u32,
    extra_sink: &str,
) -> String {
    format!(
        r#"name: {name}
parallelism: {parallelism}
checkpointing: {{ interval: 300ms, timeout: 10s }}
restart: {{ strategy: fixed-delay, attempts: 20, delay: 200ms, maxDelay: 1s }}
sources:
  - name: events
    uid: events
    kafka:
      bootstrapServers: "{bootstrap}"
      topics: [{input}]
      format: json
      fields: [id, word]
      bounded: {bounded}
operators:
  - {{ name: by-word, keyBy: {{ fields: [word] }} }}
  - {{ name: counts, uid: counts, aggregate: {{ aggregates: [ {{ fn: count, as: n }} ] }} }}
sinks:
  - name: out
    uid: out
    kafka:
      bootstrapServers: "{bootstrap}"
      topic: {output}
      delivery: {delivery}
      keyField: word
      {extra_sink}
"#
    )
}

/// Word → the counts seen in the output, in order of appearance.
fn counts_by_word(records: &[(Option<String>, String)]) -> BTreeMap<String, Vec<u64>> {
    let mut by_word: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for (key, value) in records {
        let v: serde_json::Value = serde_json::from_str(value).expect("output is JSON");
        let word = v["word"].as_str().expect("word").to_string();
        assert_eq!(key.as_deref(), Some(word.as_str()), "the key is the word");
        by_word.entry(word).or_default().push(v["n"].as_u64().expect("n"));
    }
    by_word
}

/// The model: after records 0..total, word `w` has counts 1..=n(w).
fn expected_counts(total: u64) -> BTreeMap<String, u64> {
    let mut n = BTreeMap::new();
    for i in 0..total {
        *n.entry(format!("w{}", i % WORDS)).or_insert(0) += 1;
    }
    n
}

/// Exactly once: every word's counts are exactly 1..=n, each once (sorted; two subtasks'
/// transactions may interleave across partitions of the output topic).
fn assert_exactly_once(records: &[(Option<String>, String)], total: u64, what: &str) {
    let got = counts_by_word(records);
    let want = expected_counts(total);
    let mut problems = Vec::new();
    for (word, &n) in &want {
        let mut counts = got.get(word).cloned().unwrap_or_default();
        counts.sort_unstable();
        let expect: Vec<u64> = (1..=n).collect();
        if counts != expect {
            let dup = counts.windows(2).filter(|w| w[0] == w[1]).count();
            let missing = expect.iter().filter(|c| counts.binary_search(c).is_err()).count();
            problems.push(format!("{word}: {} records, {dup} duplicated, {missing} missing of 1..={n}", counts.len()));
        }
    }
    for word in got.keys().filter(|w| !want.contains_key(*w)) {
        problems.push(format!("{word}: not in the input"));
    }
    assert!(problems.is_empty(), "{what}: output is not exactly once:\n{}", problems.join("\n"));
    assert_eq!(records.len() as u64, total, "{what}: one output record per input record");
}

#[test]
fn a_bounded_job_writes_every_count_once_and_commits_markers() {
    let b = broker();
    let (input_topic, output_topic) = (topic("in"), topic("out"));
    b.create_topic(&input_topic, 3);
    b.create_topic(&output_topic, 2);
    let total = 5_000;
    b.produce(&input_topic, (0..total).map(input));
    let (_dir, _out, chk) = workdir("kafka-bounded");
    let yaml = job_yaml("kafka-bounded", &b.bootstrap, &input_topic, &output_topic, true, "exactly-once", 2, "");
    let (outcome, metrics) = run_to_end(&yaml, opts(&chk));
    assert_eq!(outcome, weir_runtime::executor::JobOutcome::Finished);
    assert_eq!(metrics.records_in.get(), total);
    let out = b.read_committed(&output_topic);
    assert_exactly_once(&out, total, "bounded run");
    // The markers say which checkpoints each subtask committed.
    let markers = b.read_committed("weir-commit-markers");
    assert!(markers.iter().any(|(k, _)| k.as_deref().is_some_and(|k| k.starts_with("weir-kafka-bounded/out/"))));
}

#[test]
fn at_least_once_delivers_everything() {
    let b = broker();
    let (input_topic, output_topic) = (topic("in"), topic("out"));
    b.create_topic(&input_topic, 2);
    b.create_topic(&output_topic, 1);
    let total = 3_000;
    b.produce(&input_topic, (0..total).map(input));
    let (_dir, _out, chk) = workdir("kafka-alo");
    let yaml = job_yaml("kafka-alo", &b.bootstrap, &input_topic, &output_topic, true, "at-least-once", 1, "");
    run_to_end(&yaml, opts(&chk));
    assert_exactly_once(&b.read_committed(&output_topic), total, "at-least-once without failures");
}

fn start_error(yaml: &str, chk: &std::path::Path) -> String {
    let started = Instant::now();
    let (r, _) = InProcess::start(yaml, opts(chk)).join();
    let e = r.expect_err("the job must be refused").to_string();
    assert!(started.elapsed() < Duration::from_secs(120), "refused only after {:?}", started.elapsed());
    e
}

/// A marker topic someone created before the job is checked, not trusted: with more than one
/// partition (recovery reads one) or without compaction (old markers expire) it is refused,
/// naming the fix; one Weir created passes the same check.
#[test]
fn an_existing_marker_topic_that_could_lose_markers_is_refused() {
    let b = broker();
    let config = weir_runtime::kafka::client_config(&b.bootstrap, &BTreeMap::new()).unwrap();
    let (partitioned, deleting, fresh) = (topic("markers-3p"), topic("markers-delete"), topic("markers-new"));
    b.create_topic(&partitioned, 3);
    b.create_topic(&deleting, 1);
    let err = weir_runtime::kafka::ensure_marker_topic(&config, &partitioned).unwrap_err().to_string();
    assert!(err.contains("it has 3 partitions and must have exactly 1"), "{err}");
    let err = weir_runtime::kafka::ensure_marker_topic(&config, &deleting).unwrap_err().to_string();
    assert!(err.contains("cleanup.policy is `delete` and must be `compact`"), "{err}");
    weir_runtime::kafka::ensure_marker_topic(&config, &fresh).expect("created compacted with one partition");
    weir_runtime::kafka::ensure_marker_topic(&config, &fresh).expect("and accepted once it exists");
}

#[test]
fn unknown_topics_unreachable_brokers_and_too_long_transactions_are_refused() {
    let b = broker();
    let (input_topic, output_topic) = (topic("in"), topic("out"));
    b.create_topic(&input_topic, 1);
    b.create_topic(&output_topic, 1);
    let (_dir, _out, chk) = workdir("kafka-refused");
    let one_attempt = |yaml: String| yaml.replace("attempts: 20", "attempts: 0");

    let yaml = job_yaml("refused", &b.bootstrap, "no-such-topic", &output_topic, true, "exactly-once", 1, "");
    let e = start_error(&one_attempt(yaml), &chk);
    assert!(e.contains("no-such-topic") && e.contains("does not exist"), "{e}");

    let yaml = job_yaml("refused", &b.bootstrap, &input_topic, "no-such-output", true, "exactly-once", 1, "");
    let e = start_error(&one_attempt(yaml), &chk);
    assert!(e.contains("no-such-output") && e.contains("does not exist"), "{e}");

    let yaml = job_yaml(
        "refused",
        &b.bootstrap,
        &input_topic,
        &output_topic,
        true,
        "exactly-once",
        1,
        "transactionTimeout: 2h",
    );
    let e = start_error(&one_attempt(yaml), &chk);
    assert!(e.contains("transaction.max.timeout.ms") && e.contains("7200000"), "{e}");

    // Nothing listens on this port.
    let dead =
        format!("127.0.0.1:{}", std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port());
    let yaml = job_yaml("refused", &dead, &input_topic, &output_topic, true, "exactly-once", 1, "");
    let e = start_error(&one_attempt(yaml), &chk);
    assert!(e.contains(&dead), "names the unreachable broker: {e}");
}

/// Runs the runtime binary on `job_file`, restoring the newest checkpoint.
fn runtime(job_file: &std::path::Path, chk: &std::path::Path, faults: Option<String>) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_weir-runtime"));
    cmd.args(["run", job_file.to_str().unwrap(), "--checkpoint-dir", chk.to_str().unwrap(), "--restore", "latest"])
        .arg("--quiet")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(f) = faults {
        cmd.env("WEIR_FAULTS", f);
    }
    cmd
}

fn seed() -> u64 {
    let seed = std::env::var("WEIR_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 % 10_000
    });
    eprintln!("seed {seed} (set WEIR_TEST_SEED to replay)");
    seed
}

/// Runs `rounds` disturbed runs of the runtime on `job_file`: each is SIGKILLed at a random
/// moment after it made progress, or aborts itself through the fault `phases[i]`. Returns
/// (kills, aborts).
fn disturbed_runs(
    job_file: &std::path::Path,
    chk: &std::path::Path,
    seed: u64,
    rounds: u64,
    phases: &[Option<&str>],
) -> (u64, u64) {
    let storage = weir_checkpoint::Storage::open(chk.to_str().unwrap()).unwrap();
    let (mut kills, mut aborts) = (0, 0);
    for round in 0..rounds {
        let phase = phases[((seed + round) % phases.len() as u64) as usize];
        let faults = phase.map(|p| format!("seed={},{p},max=1", seed + round));
        let before = newest_complete(&storage);
        let mut child = runtime(job_file, chk, faults.clone()).spawn().unwrap();
        let extra = Duration::from_millis(weir_runtime::value::mix64(seed ^ round) % 700);
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut progressed: Option<Instant> = None;
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break Some(s);
            }
            assert!(Instant::now() < deadline, "round {round} made no progress in 60 s ({faults:?})");
            match progressed {
                None if newest_complete(&storage) > before => progressed = Some(Instant::now()),
                Some(t) if t.elapsed() >= extra && (phase.is_none() || t.elapsed() > Duration::from_secs(3)) => {
                    break None
                }
                _ => {}
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        match status {
            None => {
                child.kill().unwrap();
                child.wait().unwrap();
                kills += 1;
            }
            Some(s) => {
                let mut err = String::new();
                std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
                assert!(err.contains("injected fault: aborting"), "round {round} ended with {s}: {err}");
                aborts += 1;
            }
        }
    }
    (kills, aborts)
}

/// Waits until `n` more checkpoints than now completed under `chk`: whatever was in flight
/// (a late or duplicate commit) has had its chance to appear.
fn wait_for_more_checkpoints(chk: &std::path::Path, n: u64) {
    let storage = weir_checkpoint::Storage::open(chk.to_str().unwrap()).unwrap();
    let before = newest_complete(&storage);
    let deadline = Instant::now() + Duration::from_secs(60);
    while newest_complete(&storage) < before + n {
        assert!(Instant::now() < deadline, "no {n} more checkpoints under {} in 60 s", chk.display());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs the job until `topic` holds `total` records, SIGKILLs it, then runs it once more for
/// three checkpoints (recovery of whatever the kill left) and kills that too.
fn finish_then_kill_and_recover(job_file: &std::path::Path, chk: &std::path::Path, topic: &str, total: u64) {
    let mut last = runtime(job_file, chk, None).spawn().unwrap();
    wait_for_output(topic, total, Duration::from_secs(120));
    assert!(last.try_wait().unwrap().is_none(), "the last run ended early");
    wait_for_more_checkpoints(chk, 2);
    last.kill().unwrap();
    last.wait().unwrap();
    let mut again = runtime(job_file, chk, None).spawn().unwrap();
    wait_for_more_checkpoints(chk, 3);
    again.kill().unwrap();
    again.wait().unwrap();
}

#[test]
fn sigkills_and_aborts_at_every_commit_phase_keep_kafka_output_exactly_once() {
    let b = broker();
    let (input_topic, output_topic) = (topic("in"), topic("out"));
    b.create_topic(&input_topic, 3);
    b.create_topic(&output_topic, 2);
    let total: u64 = 24_000;
    // Input arrives while the job runs (about 8 s), so that kills land mid-stream.
    let producer = produce_slowly(&input_topic, total, 500, Duration::from_millis(160));
    let (dir, _out, chk) = workdir("kafka-killed");
    let job_file = dir.path().join("job.yaml");
    let yaml = job_yaml("kafka-killed", &b.bootstrap, &input_topic, &output_topic, false, "exactly-once", 2, "");
    std::fs::write(&job_file, yaml).unwrap();
    let seed = seed();
    let phases = [
        None,                            // SIGKILL at a random moment
        Some("commit-abort=1"),          // checkpoint complete, before any transaction
        Some("txn-abort-open=0.5"),      // records and marker sent, transaction not committed
        Some("txn-abort-committed=0.5"), // committed, not yet reported
        Some("upload=0.3"),              // staging fails: the checkpoint fails, nothing is lost
    ];
    let (kills, aborts) = disturbed_runs(&job_file, &chk, seed, 10, &phases);
    producer.join().unwrap();
    finish_then_kill_and_recover(&job_file, &chk, &output_topic, total);
    eprintln!("SIGKILLs: {kills}, self-aborts: {aborts}");
    record_faults(kills + aborts);
    assert!(kills >= 1 && aborts >= 1, "the campaign disturbed nothing: {kills} kills, {aborts} aborts");
    assert_exactly_once(&b.read_committed(&output_topic), total, &format!("seed {seed}"));
}

#[test]
fn at_least_once_loses_nothing_under_sigkills() {
    let b = broker();
    let (input_topic, output_topic) = (topic("in"), topic("out"));
    b.create_topic(&input_topic, 2);
    b.create_topic(&output_topic, 2);
    let total: u64 = 12_000;
    let producer = produce_slowly(&input_topic, total, 400, Duration::from_millis(150));
    let (dir, _out, chk) = workdir("kafka-alo-killed");
    let job_file = dir.path().join("job.yaml");
    let yaml = job_yaml("kafka-alo-killed", &b.bootstrap, &input_topic, &output_topic, false, "at-least-once", 2, "");
    std::fs::write(&job_file, yaml).unwrap();
    let seed = seed();
    let (kills, _) = disturbed_runs(&job_file, &chk, seed, 4, &[None]);
    producer.join().unwrap();
    // Duplicates are allowed: wait until every (word, count) is there at least once.
    let want = expected_counts(total);
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut last = runtime(&job_file, &chk, None).spawn().unwrap();
    let (records, missing) = loop {
        let records = b.read_committed(&output_topic);
        let got = counts_by_word(&records);
        let missing: u64 = want
            .iter()
            .map(|(w, &n)| {
                let have: std::collections::BTreeSet<u64> = got.get(w).into_iter().flatten().copied().collect();
                (1..=n).filter(|c| !have.contains(c)).count() as u64
            })
            .sum();
        if missing == 0 || Instant::now() > deadline {
            break (records, missing);
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    last.kill().unwrap();
    last.wait().unwrap();
    record_faults(kills);
    let duplicates = records.len() as u64 - total;
    eprintln!("seed {seed}: {kills} SIGKILLs, {} records, {duplicates} duplicates", records.len());
    assert_eq!(missing, 0, "seed {seed}: at-least-once lost {missing} (word, count) records");
}

/// Produces `total` input records in chunks, in the background, while a job runs.
fn produce_slowly(input_topic: &str, total: u64, chunk: u64, pause: Duration) -> std::thread::JoinHandle<()> {
    let input_topic = input_topic.to_string();
    std::thread::spawn(move || {
        for c in 0..total.div_ceil(chunk) {
            broker().produce(&input_topic, (c * chunk..((c + 1) * chunk).min(total)).map(input));
            std::thread::sleep(pause);
        }
    })
}

/// Waits until `topic` holds at least `n` committed records.
fn wait_for_output(topic: &str, n: u64, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let got = broker().read_committed(topic).len() as u64;
        if got >= n {
            return;
        }
        assert!(Instant::now() < deadline, "only {got} of {n} records committed to {topic} in {timeout:?}");
        std::thread::sleep(Duration::from_millis(300));
    }
}

#[test]
fn a_transaction_the_broker_aborts_on_timeout_is_sent_again_once() {
    let b = broker();
    let (input_topic, output_topic) = (topic("in"), topic("out"));
    b.create_topic(&input_topic, 2);
    b.create_topic(&output_topic, 2);
    let total = 6_000;
    b.produce(&input_topic, (0..total).map(input));
    let (_dir, _out, chk) = workdir("kafka-txn-timeout");
    // A short transaction timeout (the broker checks every second, see kafka_broker), and the
    // first transaction stalls past it: the broker aborts it and the sink's commit fails.
    let yaml = job_yaml(
        "kafka-txn-timeout",
        &b.bootstrap,
        &input_topic,
        &output_topic,
        true,
        "exactly-once",
        2,
        "transactionTimeout: 5s",
    )
    .replace("timeout: 10s", "timeout: 2s");
    let plan = weir_runtime::faults::FaultPlan::parse("seed=1,txn-stall=1,max=1").unwrap();
    let started = Instant::now();
    let (outcome, metrics) = run_to_end(&yaml, opts(&chk).with_faults(plan));
    assert_eq!(outcome, weir_runtime::executor::JobOutcome::Finished);
    assert_eq!(metrics.injected_faults.get(), 1, "the transaction stalled");
    assert!(metrics.restarts.get() >= 1, "the aborted transaction failed the job, which restarted");
    record_faults(1);
    eprintln!("finished in {:?} after a stalled transaction", started.elapsed());
    assert_exactly_once(&b.read_committed(&output_topic), total, "after a broker-side abort");
}

#[test]
fn rescaling_through_savepoints_two_three_two_stays_exactly_once() {
    let b = broker();
    let (input_topic, output_topic) = (topic("in"), topic("out"));
    b.create_topic(&input_topic, 6);
    b.create_topic(&output_topic, 3);
    let total = 18_000;
    let mut producer = Some(produce_slowly(&input_topic, total, 600, Duration::from_millis(200)));
    let (_dir, _out, chk) = workdir("kafka-rescale");
    let yaml =
        |p: u32| job_yaml("kafka-rescale", &b.bootstrap, &input_topic, &output_topic, false, "exactly-once", p, "");
    let mut restore: Option<String> = None;
    for (round, parallelism) in [2u32, 3, 2].into_iter().enumerate() {
        let o = match &restore {
            None => opts(&chk),
            Some(path) => opts(&chk).restore_path(path),
        };
        let run = InProcess::start(&yaml(parallelism), o);
        run.wait_for_checkpoints(4, Duration::from_secs(60));
        if round < 2 {
            run.request_savepoint(true, false);
            let (r, _) = run.join();
            let weir_runtime::executor::JobOutcome::Stopped { savepoint } = r.unwrap() else {
                panic!("expected a stop with savepoint")
            };
            eprintln!("parallelism {parallelism} stopped with {savepoint}");
            restore = Some(savepoint);
        } else {
            producer.take().unwrap().join().unwrap();
            wait_for_output(&output_topic, total, Duration::from_secs(120));
            run.request_savepoint(true, false);
            run.join().0.unwrap();
        }
    }
    assert_exactly_once(&b.read_committed(&output_topic), total, "2 → 3 → 2 subtasks");
}

/// Sends SIGSTOP or SIGCONT to a process.
fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill").args([sig, &pid.to_string()]).status().unwrap().success();
    assert!(ok, "kill {sig} {pid}");
}

#[test]
fn a_frozen_runtime_that_wakes_after_its_replacement_started_is_fenced() {
    let b = broker();
    let (input_topic, output_topic) = (topic("in"), topic("out"));
    b.create_topic(&input_topic, 2);
    b.create_topic(&output_topic, 2);
    let total = 12_000;
    let producer = produce_slowly(&input_topic, total, 500, Duration::from_millis(150));
    let (dir, _out, chk) = workdir("kafka-zombie");
    let job_file = dir.path().join("job.yaml");
    let yaml = job_yaml("kafka-zombie", &b.bootstrap, &input_topic, &output_topic, false, "exactly-once", 2, "");
    std::fs::write(&job_file, yaml).unwrap();
    let storage = weir_checkpoint::Storage::open(chk.to_str().unwrap()).unwrap();
    let mut old = runtime(&job_file, &chk, None).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while newest_complete(&storage) < 3 {
        assert!(Instant::now() < deadline, "the first runtime made no progress");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Freeze it (a partitioned node, a long GC pause), start its replacement, let the
    // replacement commit, then wake the old one up.
    signal(old.id(), "-STOP");
    let replaced_at = newest_complete(&storage);
    let mut new = runtime(&job_file, &chk, None).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while newest_complete(&storage) < replaced_at + 3 {
        assert!(Instant::now() < deadline, "the replacement made no progress");
        std::thread::sleep(Duration::from_millis(20));
    }
    signal(old.id(), "-CONT");
    let status = {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(s) = old.try_wait().unwrap() {
                break s;
            }
            assert!(Instant::now() < deadline, "the woken runtime neither stopped nor failed");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let mut err = String::new();
    std::io::Read::read_to_string(old.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(!status.success(), "the stale runtime must stop with an error, not finish");
    assert!(err.contains("fenced") || err.contains("epoch"), "the stale runtime says it was fenced: {err}");
    producer.join().unwrap();
    wait_for_output(&output_topic, total, Duration::from_secs(120));
    wait_for_more_checkpoints(&chk, 2);
    new.kill().unwrap();
    new.wait().unwrap();
    record_faults(1);
    assert_exactly_once(&b.read_committed(&output_topic), total, "a stale runtime woke up");
}

#[test]
fn the_kafka_wordcount_example_counts_every_word_once() {
    let b = broker();
    let (lines, counts) = (topic("lines"), topic("word-counts"));
    b.create_topic(&lines, 2);
    b.create_topic(&counts, 2);
    let vocabulary = ["alpha", "beta", "gamma", "delta", "epsilon"];
    let text: Vec<(String, String)> = (0..3_000usize)
        .map(|i| {
            let line: Vec<&str> = (0..4).map(|j| vocabulary[(i * 7 + j * 3) % vocabulary.len()]).collect();
            (i.to_string(), line.join(" "))
        })
        .collect();
    let mut want: BTreeMap<String, u64> = BTreeMap::new();
    for (_, line) in &text {
        for w in line.split(' ') {
            *want.entry(w.to_string()).or_default() += 1;
        }
    }
    b.produce(&lines, text);
    let example = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/kafka-wordcount.yaml"))
        .unwrap()
        .replace("localhost:9092", &b.bootstrap)
        .replace("topics: [lines]", &format!("topics: [{lines}]"))
        .replace("topic: word-counts", &format!("topic: {counts}"))
        // A bounded read, so that the last windows fire and the job ends.
        .replace("      startFrom: earliest\n", "      startFrom: earliest\n      bounded: true\n");
    let (_dir, _out, chk) = workdir("kafka-example");
    run_to_end(&example, opts(&chk));
    let mut got: BTreeMap<String, u64> = BTreeMap::new();
    let mut windows = std::collections::BTreeSet::new();
    for (key, value) in b.read_committed(&counts) {
        let v: serde_json::Value = serde_json::from_str(&value).unwrap();
        let word = v["word"].as_str().unwrap().to_string();
        assert_eq!(key.as_deref(), Some(word.as_str()));
        assert!(windows.insert((word.clone(), v["window_start"].as_i64().unwrap())), "{word}'s window twice: {v}");
        *got.entry(word).or_default() += v["n"].as_u64().unwrap();
    }
    assert_eq!(got, want, "every word counted once");
}

#[test]
fn partitions_added_while_running_are_read_from_their_start() {
    let b = broker();
    let (input_topic, output_topic) = (topic("in"), topic("out"));
    b.create_topic(&input_topic, 1);
    b.create_topic(&output_topic, 1);
    b.produce(&input_topic, (0..1_000).map(input));
    let (_dir, _out, chk) = workdir("kafka-discovery");
    let yaml = job_yaml("kafka-discovery", &b.bootstrap, &input_topic, &output_topic, false, "exactly-once", 2, "")
        .replace("      bounded: false\n", "      bounded: false\n      partitionDiscoveryInterval: 500ms\n");
    let run = InProcess::start(&yaml, opts(&chk));
    wait_for_output(&output_topic, 1_000, Duration::from_secs(60));
    // Two more partitions; the producer's partitioner spreads new records over all three.
    b.add_partitions(&input_topic, 3);
    b.produce(&input_topic, (1_000..4_000).map(input));
    wait_for_output(&output_topic, 4_000, Duration::from_secs(60));
    run.request_savepoint(true, false);
    run.join().0.unwrap();
    assert_exactly_once(&b.read_committed(&output_topic), 4_000, "partitions added while running");
}

#[test]
fn start_positions_and_offsets_committed_to_the_group() {
    let b = broker();
    let (input_topic, output_topic) = (topic("in"), topic("out"));
    b.create_topic(&input_topic, 1);
    b.produce(&input_topic, (0..600).map(input));
    std::thread::sleep(Duration::from_millis(50));
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis();
    std::thread::sleep(Duration::from_millis(50));
    b.produce(&input_topic, (600..1_000).map(input));
    let run = |name: &str, source_extra: &str| {
        let output = format!("{output_topic}-{name}");
        b.create_topic(&output, 1);
        let (_dir, _out, chk) = workdir(name);
        let yaml = job_yaml(name, &b.bootstrap, &input_topic, &output, true, "exactly-once", 1, "")
            .replace("      bounded: true\n", &format!("      bounded: true\n{source_extra}"));
        run_to_end(&yaml, opts(&chk));
        let ids: Vec<u64> = b
            .read_committed(&output)
            .iter()
            .map(|(_, v)| serde_json::from_str::<serde_json::Value>(v).unwrap()["n"].as_u64().unwrap())
            .collect();
        ids.len()
    };
    assert_eq!(run("from-earliest", ""), 1_000);
    assert_eq!(run("from-timestamp", &format!("      startFrom: timestamp\n      startTimestampMs: {since}\n")), 400);
    // `latest`: only what arrives after the start, and the position is checkpointed before
    // any record came, so a restart in between skips nothing.
    let output = format!("{output_topic}-from-latest");
    b.create_topic(&output, 1);
    let (_dir, _out, chk) = workdir("from-latest");
    let yaml = job_yaml("from-latest", &b.bootstrap, &input_topic, &output, false, "exactly-once", 1, "")
        .replace("      bounded: false\n", "      bounded: false\n      startFrom: latest\n");
    let first = InProcess::start(&yaml, opts(&chk));
    first.wait_for_checkpoints(2, Duration::from_secs(60));
    first.requests.send(weir_runtime::executor::Request::Cancel).unwrap();
    first.join().0.unwrap();
    b.produce(&input_topic, (1_000..1_300).map(input));
    let second = InProcess::start(&yaml, opts(&chk).restore_latest());
    wait_for_output(&output, 300, Duration::from_secs(60));
    wait_for_more_checkpoints(&chk, 2);
    second.requests.send(weir_runtime::executor::Request::Cancel).unwrap();
    second.join().0.unwrap();
    let ids: Vec<u64> = b
        .read_committed(&output)
        .iter()
        .map(|(_, v)| serde_json::from_str::<serde_json::Value>(v).unwrap()["n"].as_u64().unwrap())
        .collect();
    assert_eq!(ids.len(), 300, "exactly the records produced after the start, across a restart");
    // The group's committed offset decides where a stateless start begins...
    b.commit_offsets("weir-group-test", &input_topic, &[250]);
    assert_eq!(run("from-group", "      startFrom: group-offsets\n      groupId: weir-group-test\n"), 1_050);
    // ...and a run commits its checkpointed offsets back to the group (for lag monitoring).
    assert_eq!(b.committed_offsets("weir-group-test", &input_topic, 1), vec![1_300]);
    assert_eq!(b.committed_offsets("weir-from-earliest", &input_topic, 1), vec![1_000], "default group weir-<job>");
}

#[test]
fn keys_values_headers_and_metadata_reach_the_job_and_the_output() {
    let b = broker();
    let (input_topic, output_topic) = (topic("in"), topic("out"));
    b.create_topic(&input_topic, 1);
    b.create_topic(&output_topic, 1);
    {
        use rdkafka::message::{Header, OwnedHeaders};
        let p = b.producer();
        for i in 0..10 {
            let (key, value) = (format!("k{i}"), format!("line {i}"));
            let headers = OwnedHeaders::new().insert(Header { key: "trace", value: Some(&format!("t{i}")) });
            let record = rdkafka::producer::BaseRecord::to(&input_topic).key(&key).payload(&value).headers(headers);
            p.send(record).map_err(|(e, _)| e).unwrap();
        }
        rdkafka::producer::Producer::flush(&p, Duration::from_secs(10)).unwrap();
    }
    let yaml = format!(
        r#"name: kafka-metadata
checkpointing: {{ interval: 300ms }}
sources:
  - name: raw
    uid: raw
    kafka: {{ bootstrapServers: "{bootstrap}", topics: [{input_topic}], bounded: true }}
operators:
  - name: shaped
    map:
      fields:
        id: "key"
        text: "value.upperAscii()"
        where: "topic + '/' + string(partition) + '@' + string(offset)"
        fresh: "timestamp > 0"
        headers: "headers"
sinks:
  - name: out
    uid: out
    kafka:
      bootstrapServers: "{bootstrap}"
      topic: {output_topic}
      keyField: id
      format: raw
      valueField: text
      headerFields: [where, headers]
"#,
        bootstrap = b.bootstrap
    );
    let (_dir, _out, chk) = workdir("kafka-metadata");
    run_to_end(&yaml, opts(&chk));
    let out = b.read_committed_records(&output_topic);
    assert_eq!(out.len(), 10);
    for (i, r) in out.iter().enumerate() {
        assert_eq!(r.key.as_deref(), Some(format!("k{i}").as_str()));
        assert_eq!(r.value, format!("LINE {i}"), "raw value: the text of valueField");
        let header = |name: &str| r.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()).unwrap();
        assert_eq!(header("where"), format!("{input_topic}/0@{i}"));
        assert_eq!(header("headers"), format!(r#"{{"trace":"t{i}"}}"#));
    }
}

#[test]
fn at_least_once_without_checkpoints_delivers_everything_before_the_job_ends() {
    let b = broker();
    let (input_topic, output_topic) = (topic("in"), topic("out"));
    b.create_topic(&input_topic, 2);
    b.create_topic(&output_topic, 2);
    let total = 20_000;
    b.produce(&input_topic, (0..total).map(input));
    let (_dir, _out, chk) = workdir("kafka-no-checkpoints");
    let yaml = job_yaml("kafka-no-chk", &b.bootstrap, &input_topic, &output_topic, true, "at-least-once", 2, "")
        .replace("checkpointing: { interval: 300ms, timeout: 10s }", "checkpointing: { enabled: false }");
    run_to_end(&yaml, opts(&chk));
    // Read right after the job returned: the sink flushed before it ended.
    assert_exactly_once(&b.read_committed(&output_topic), total, "at-least-once, no checkpoints, no failures");
}

#[test]
fn sasl_credentials_come_from_the_environment_and_never_appear_in_errors() {
    let b = broker();
    let (input_topic, output_topic) = (topic("in"), topic("out"));
    b.create_topic(&input_topic, 1);
    b.create_topic(&output_topic, 1);
    b.produce(&input_topic, (0..500).map(input));
    let sasl = "properties: { security.protocol: SASL_PLAINTEXT, sasl.mechanism: PLAIN, sasl.username: weir, \
                sasl.password: \"${env:WEIR_TEST_KAFKA_PASSWORD}\" }";
    let yaml = |name: &str| {
        job_yaml(name, &b.sasl_bootstrap, &input_topic, &output_topic, true, "exactly-once", 1, sasl)
            .replace("      bounded: true\n", &format!("      bounded: true\n      {sasl}\n"))
    };
    // The right password, from the environment: the job runs through the SASL listener.
    std::env::set_var("WEIR_TEST_KAFKA_PASSWORD", kafka_broker::SASL_PASSWORD);
    let (_dir, _out, chk) = workdir("kafka-sasl");
    run_to_end(&yaml("kafka-sasl"), opts(&chk));
    assert_exactly_once(&b.read_committed(&output_topic), 500, "through SASL");
    // A wrong one is refused, and neither the error nor the job's status shows it.
    let wrong = "not-the-password-0c1d";
    std::env::set_var("WEIR_TEST_KAFKA_PASSWORD", wrong);
    let (_dir, _out, chk) = workdir("kafka-sasl-wrong");
    let (r, metrics) =
        InProcess::start(&yaml("kafka-sasl-wrong").replace("attempts: 20", "attempts: 0"), opts(&chk)).join();
    let e = r.expect_err("a wrong password is refused").to_string();
    eprintln!("refused: {e}");
    assert!(e.to_lowercase().contains("auth"), "says authentication failed: {e}");
    let status = serde_json::to_string(&metrics.job_status()).unwrap();
    for text in [&e, &status] {
        assert!(!text.contains(wrong) && !text.contains(kafka_broker::SASL_PASSWORD), "a secret leaked: {text}");
    }

    // As the operator runs it: `${env:NAME}` reads only `WEIR_SECRET_NAME`, the keys of the
    // job's own Secrets. The declared password is found; the storage credentials, although in
    // the environment, cannot be sent to a broker of the job's choosing.
    let declared = |name: &str, variable: &str, file: &str| {
        let (dir, _out, chk) = workdir(name);
        let job_file = dir.path().join(file);
        std::fs::write(
            &job_file,
            yaml(name).replace("WEIR_TEST_KAFKA_PASSWORD", variable).replace("attempts: 20", "attempts: 0"),
        )
        .unwrap();
        let out = runtime(&job_file, &chk, None)
            .args(["--declared-env-prefix", "WEIR_SECRET_"])
            .env("WEIR_SECRET_KAFKA_PASSWORD", kafka_broker::SASL_PASSWORD)
            .env("AWS_SECRET_ACCESS_KEY", kafka_broker::SASL_PASSWORD)
            .output()
            .unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).to_string())
    };
    let (ok, stderr) = declared("kafka-sasl-declared", "KAFKA_PASSWORD", "job.yaml");
    assert!(ok, "the declared variable is read: {stderr}");
    let (ok, stderr) = declared("kafka-sasl-undeclared", "AWS_SECRET_ACCESS_KEY", "job.yaml");
    assert!(!ok, "an undeclared variable is refused");
    assert!(stderr.contains("AWS_SECRET_ACCESS_KEY") && stderr.contains("envFromSecrets"), "{stderr}");
    assert!(!stderr.contains(kafka_broker::SASL_PASSWORD), "a secret leaked: {stderr}");
}

#[test]
fn an_idle_partition_stops_holding_event_time_back() {
    let b = broker();
    let (input_topic, output_topic) = (topic("in"), topic("out"));
    b.create_topic(&input_topic, 2);
    b.create_topic(&output_topic, 1);
    // Records only in partition 0, one every 100 ms of event time over 3 s; partition 1 stays
    // empty. One subtask reads both: without idleness its watermark would wait for partition
    // 1 forever and no window would ever fire.
    let base: i64 = 1_700_000_000_000;
    {
        let p = b.producer();
        for i in 0..30i64 {
            let (key, value) = (i.to_string(), format!(r#"{{"id":{i},"word":"w"}}"#));
            let record = rdkafka::producer::BaseRecord::to(&input_topic)
                .partition(0)
                .timestamp(base + i * 100)
                .key(&key)
                .payload(&value);
            p.send(record).map_err(|(e, _)| e).unwrap();
        }
        rdkafka::producer::Producer::flush(&p, Duration::from_secs(10)).unwrap();
    }
    let yaml = format!(
        r#"name: kafka-idle
parallelism: 1
checkpointing: {{ interval: 300ms }}
sources:
  - name: events
    uid: events
    kafka:
      bootstrapServers: "{bootstrap}"
      topics: [{input_topic}]
      format: json
      fields: [id, word]
      idleTimeout: 1s
operators:
  - {{ name: by-word, keyBy: {{ fields: [word] }} }}
  - name: per-second
    uid: per-second
    window: {{ type: tumbling, size: 1s, aggregates: [ {{ fn: count, as: "n" }} ] }}
sinks:
  - {{ name: out, uid: out, kafka: {{ bootstrapServers: "{bootstrap}", topic: {output_topic}, keyField: word }} }}
"#,
        bootstrap = b.bootstrap
    );
    let (_dir, _out, chk) = workdir("kafka-idle");
    let run = InProcess::start(&yaml, opts(&chk));
    // Event time reaches base + 2.9 s: the windows [base, base+1s) and [base+1s, base+2s) close.
    wait_for_output(&output_topic, 2, Duration::from_secs(30));
    run.requests.send(weir_runtime::executor::Request::Cancel).unwrap();
    run.join().0.unwrap();
    let counts: Vec<u64> = b
        .read_committed(&output_topic)
        .iter()
        .map(|(_, v)| serde_json::from_str::<serde_json::Value>(v).unwrap()["n"].as_u64().unwrap())
        .collect();
    assert_eq!(&counts[..2], &[10, 10], "two full one-second windows fired: {counts:?}");
}

#[test]
fn read_committed_skips_aborted_transactions_and_read_uncommitted_does_not() {
    let b = broker();
    let input_topic = topic("in");
    b.create_topic(&input_topic, 1);
    b.produce(&input_topic, (0..100).map(input));
    {
        // 50 records of a transaction that aborts.
        use rdkafka::producer::Producer;
        let p: rdkafka::producer::ThreadedProducer<rdkafka::producer::DefaultProducerContext> =
            kafka_broker::config(&b.bootstrap)
                .set("transactional.id", format!("aborter-{input_topic}"))
                .create()
                .unwrap();
        p.init_transactions(Duration::from_secs(30)).unwrap();
        p.begin_transaction().unwrap();
        for (k, v) in (100..150).map(input) {
            p.send(rdkafka::producer::BaseRecord::to(&input_topic).key(&k).payload(&v)).map_err(|(e, _)| e).unwrap();
        }
        p.flush(Duration::from_secs(30)).unwrap();
        p.abort_transaction(Duration::from_secs(30)).unwrap();
    }
    for (read_committed, expected) in [(true, 100), (false, 150)] {
        let output = topic("out");
        b.create_topic(&output, 1);
        let name = format!("kafka-isolation-{read_committed}");
        let (_dir, _out, chk) = workdir(&name);
        let yaml = job_yaml(&name, &b.bootstrap, &input_topic, &output, true, "exactly-once", 1, "")
            .replace("      bounded: true\n", &format!("      bounded: true\n      readCommitted: {read_committed}\n"));
        let (_, metrics) = run_to_end(&yaml, opts(&chk));
        assert_eq!(metrics.records_in.get(), expected, "readCommitted: {read_committed}");
        assert_eq!(b.read_committed(&output).len() as u64, expected);
    }
}

/// The tests' reader must see everything committed up to the end of the topic as it was when
/// the read began, even while another producer's transaction is open in front of it (as in the
/// marker topic all tests share). A `read_committed` consumer reports end-of-partition at the
/// first open transaction; stopping there loses the records committed after it.
#[test]
fn reading_back_waits_for_a_transaction_open_in_front_of_committed_records() {
    use rdkafka::producer::Producer;
    let b = broker();
    let shared = topic("shared");
    b.create_topic(&shared, 1);
    let open = b.open_transaction(&format!("open-{shared}"));
    b.send(&open, &shared, "held-open", "v");
    let other = b.open_transaction(&format!("other-{shared}"));
    b.send(&other, &shared, "committed-behind-it", "v");
    other.commit_transaction(Duration::from_secs(30)).unwrap();
    let committer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(2));
        open.commit_transaction(Duration::from_secs(30)).unwrap();
    });
    let keys: Vec<Option<String>> = b.read_committed(&shared).into_iter().map(|(k, _)| k).collect();
    committer.join().unwrap();
    assert_eq!(keys, [Some("held-open".to_string()), Some("committed-behind-it".to_string())]);
}

/// Recovery reads the sink's commit markers to the end of the topic, past a transaction that
/// another job holds open in front of them (the marker topic is shared; any commit in flight
/// is such a transaction). Stopping at the last stable offset, as a `read_committed` consumer's
/// own watermark says, would miss the markers behind it, and recovery would send their
/// checkpoints' records a second time.
#[test]
fn recovery_reads_markers_behind_another_jobs_open_transaction() {
    use rdkafka::producer::Producer;
    use weir_runtime::kafka::{marker_key, read_markers, CommitMarker};
    let b = broker();
    let markers = topic("markers");
    b.create_topic(&markers, 1);
    let other_job = b.open_transaction(&format!("other-job-{markers}"));
    b.send(&other_job, &markers, "weir-other/out/0/1", "{}");
    let this_job = b.open_transaction(&format!("this-job-{markers}"));
    let key = marker_key("weir-recovery", "out", 0, 4);
    let marker = CommitMarker { checkpoint: 9, records: 120, committed_by: 4 };
    let payload = serde_json::to_string(&marker).unwrap();
    b.send(&this_job, &markers, &key, &payload);
    this_job.commit_transaction(Duration::from_secs(30)).unwrap();
    let ends = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(2));
        other_job.commit_transaction(Duration::from_secs(30)).unwrap();
    });
    let started = Instant::now();
    let read =
        read_markers(&kafka_broker::config(&b.bootstrap), &markers, "weir-recovery", "out", Duration::from_secs(30));
    ends.join().unwrap();
    let read = read.expect("the markers are read once the other transaction ends");
    assert_eq!(read, BTreeMap::from([((0, 4), 9)]), "read in {:?}", started.elapsed());
    assert!(started.elapsed() >= Duration::from_secs(1), "the read waited for the open transaction");
}
