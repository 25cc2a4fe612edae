//! Throughput and checkpoint cost, printed as figures (not a timed test).
//!
//! `cargo bench -p weir-runtime --bench throughput` runs, on this machine and in this run:
//! - a baseline: counting the same key stream in a plain hash map on one thread;
//! - keyed count over 1M keys, checkpoints off vs every 1 s (exactly-once, incremental), three
//!   runs of each, alternating, reported as medians;
//! - a sliding-window aggregation (10 s windows every 1 s, 1K keys, sum and max), checkpoints
//!   off vs every 1 s;
//! - the CEL pipeline (lines split into words by a CEL `flatMap`, CEL filter, CEL map, keyBy,
//!   running count and sum, keyBy, dedupe), checkpoints every 1 s, in words per CPU-second (the
//!   median of three runs); and
//!   its expressions evaluated alone, by the lowered tree and by the `cel` interpreter;
//! - restoring the newest keyed-count checkpoint.
//!
//! Figures are records/s of the job, records per CPU-second (the per-core figure: the job runs
//! a source thread and an operator thread), checkpoint overhead as a ratio of the two runs,
//! checkpoint p50/p99 durations and restore seconds per GiB. `WEIR_BENCH_SCALE` (default 1)
//! multiplies the record counts.

use std::sync::Arc;
use std::time::Instant;

use weir_runtime::executor::{run_job, RunOptions};
use weir_runtime::metrics::JobMetrics;

#[path = "support/cpu.rs"]
mod cpu;
use cpu::cpu_seconds;

struct Run {
    records: u64,
    wall: f64,
    cpu: f64,
    durations: Vec<u64>,
    bytes: Vec<u64>,
    checkpoints: u64,
    /// Seconds tasks spent in snapshots' synchronous part (records stopped).
    sync_seconds: f64,
    /// Full images merged in the background and adopted.
    merges: u64,
    /// CPU seconds of the task threads (records and snapshots' synchronous part).
    task_cpu: f64,
}

impl Run {
    fn rate(&self) -> f64 {
        self.records as f64 / self.wall
    }
    fn per_cpu(&self) -> f64 {
        self.records as f64 / self.cpu
    }
}

/// The run with the median records per CPU-second.
fn median_run(mut runs: Vec<Run>) -> Run {
    runs.sort_by(|a, b| a.per_cpu().total_cmp(&b.per_cpu()));
    runs.swap_remove(runs.len() / 2)
}

fn percentile(v: &[u64], p: f64) -> u64 {
    if v.is_empty() {
        return 0;
    }
    let mut s = v.to_vec();
    s.sort_unstable();
    s[((s.len() - 1) as f64 * p).round() as usize]
}

fn run(yaml: &str, dir: &std::path::Path) -> Run {
    let job = weir_runtime::load_job(yaml).expect("bench job is valid");
    let metrics = Arc::new(JobMetrics::new(&job.spec.name, "bench"));
    let (_tx, rx) = crossbeam_channel::unbounded();
    let opts = RunOptions { checkpoint_dir: Some(dir.display().to_string()), ..RunOptions::default() };
    let cpu0 = cpu_seconds();
    let t0 = Instant::now();
    run_job(&job, &opts, metrics.clone(), rx).expect("bench job runs");
    let wall = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    let board = metrics.board();
    let done: Vec<_> =
        board.history.iter().filter(|c| c.outcome == weir_crds::control::CheckpointOutcome::Completed).collect();
    Run {
        records: metrics.records_in.get(),
        wall,
        cpu,
        durations: done.iter().filter_map(|c| c.duration_ms).collect(),
        bytes: done.iter().map(|c| c.bytes).collect(),
        checkpoints: metrics.checkpoints_completed.get(),
        sync_seconds: metrics.snapshot_sync_seconds.get(),
        merges: metrics.state_merges.get(),
        task_cpu: metrics.task_cpu_seconds.get(),
    }
}

/// The share of a run's CPU time spent outside its task threads: uploads, background merges,
/// the coordinator.
fn outside_tasks(r: &Run) -> f64 {
    1.0 - r.task_cpu / r.cpu
}

/// The job's state backend lines: the heap, or rocksdb with a cache of `cache` entries.
fn backend_lines(rocksdb_cache: Option<u64>) -> String {
    rocksdb_cache.map(|c| format!("stateBackend: rocksdb\nstateCacheEntries: {c}\n")).unwrap_or_default()
}

fn keyed_count_job(records: u64, checkpoints: bool) -> String {
    keyed_count_job_on(records, checkpoints, None)
}

fn keyed_count_job_on(records: u64, checkpoints: bool, rocksdb_cache: Option<u64>) -> String {
    backend_lines(rocksdb_cache)
        + &format!(
            r#"name: bench-count
parallelism: 1
checkpointing: {{ enabled: {checkpoints}, interval: 1s, mode: exactly-once, incremental: true, fullEvery: 10 }}
sources:
  - name: src
    uid: src
    generator: {{ count: {records}, fields: [ {{ name: key, modulo: 1000000 }} ] }}
operators:
  - {{ name: by-key, keyBy: {{ fields: [key] }} }}
  - {{ name: counts, uid: counts, aggregate: {{ aggregates: [ {{ fn: count, as: n }} ] }} }}
sinks:
  - {{ name: out, blackhole: {{}} }}
"#
        )
}

fn window_job(records: u64, checkpoints: bool) -> String {
    format!(
        r#"name: bench-window
parallelism: 1
checkpointing: {{ enabled: {checkpoints}, interval: 1s, mode: exactly-once, incremental: true, fullEvery: 10 }}
sources:
  - name: src
    uid: src
    generator:
      count: {records}
      timeStep: 1ms
      fields: [ {{ name: key, modulo: 1000 }}, {{ name: value, uniform: {{ min: 0, max: 1000 }} }} ]
operators:
  - {{ name: by-key, keyBy: {{ fields: [key] }} }}
  - name: windows
    uid: windows
    window: {{ type: sliding, size: 10s, slide: 1s,
               aggregates: [ {{ fn: sum, field: value, as: total }}, {{ fn: max, field: value, as: hi }} ] }}
sinks:
  - {{ name: out, blackhole: {{}} }}
"#
    )
}

/// A keyed count in which every record has a key of its own (`keys` of them), checkpoints
/// every second: its state for the restore-at-scale figure.
///
/// `WEIR_BENCH_BACKGROUND_FULL_IMAGE_ABOVE` sets `backgroundFullImageAbove` (entries above which
/// the uploader merges full images in the background instead of the task writing them; on the
/// rocksdb backend every 14 stored bytes count as one more): set it well above the key count
/// to measure the task writing every tenth checkpoint in full.
fn distinct_keys_job(keys: u64) -> String {
    let job = keyed_count_job(keys, true).replace("modulo: 1000000", "sequence: {}");
    match std::env::var("WEIR_BENCH_BACKGROUND_FULL_IMAGE_ABOVE").ok().and_then(|s| s.parse::<u64>().ok()) {
        Some(above) => job.replace("fullEvery: 10 }", &format!("fullEvery: 10, backgroundFullImageAbove: {above} }}")),
        None => job,
    }
}

/// Words per generated line of the CEL pipeline.
const WORDS_PER_LINE: u64 = 8;

fn cel_pipeline_job(lines: u64) -> String {
    format!(
        r#"name: bench-cel
parallelism: 1
checkpointing: {{ interval: 1s, mode: exactly-once, incremental: true, fullEvery: 10 }}
sources:
  - name: lines
    uid: lines
    generator:
      count: {lines}
      fields: [ {{ name: line, text: {{ words: {WORDS_PER_LINE}, vocabulary: 100000 }} }} ]
operators:
  - {{ name: words, flatMap: {{ expr: "line.split(' ')", as: word }} }}
  - {{ name: long, filter: {{ expr: "size(word) > 3 && !word.startsWith('x')" }} }}
  - {{ name: tagged, map: {{ fields: {{ word: "word.lowerAscii()", len: "size(word)" }} }} }}
  - {{ name: by-word, keyBy: {{ fields: [word] }} }}
  - name: counts
    uid: counts
    aggregate: {{ aggregates: [ {{ fn: count, as: n }}, {{ fn: sum, field: len, as: total }} ] }}
  - {{ name: by-count, keyBy: {{ fields: [word, n] }} }}
  - {{ name: unique, uid: unique, dedupe: {{}} }}
sinks:
  - {{ name: out, blackhole: {{}} }}
"#
    )
}

/// Evaluations per second of the pipeline's expressions on `n` words: by the lowered tree (what
/// jobs use), then by the `cel` interpreter (what they used before it).
fn cel_expressions(n: usize) -> (f64, f64) {
    use weir_runtime::expr::Expr;
    use weir_runtime::value::{Record, Value};
    let schema = ["line".to_string(), "word".to_string()];
    let exprs: Vec<Expr> =
        ["line.split(' ')", "size(word) > 3 && !word.startsWith('x')", "word.lowerAscii()", "size(word)"]
            .iter()
            .map(|t| Expr::compile(t, &schema).unwrap())
            .collect();
    assert!(exprs.iter().all(Expr::is_lowered));
    let records: Vec<Record> = (0..n)
        .map(|i| Record {
            time: 0,
            fields: smallvec::smallvec![
                Value::str(&format!("Alpha beta{i} gamma delta")),
                Value::str(&format!("Word{}", i % 977))
            ],
        })
        .collect();
    let t0 = Instant::now();
    for r in &records {
        std::hint::black_box(exprs[0].eval_list(r).unwrap());
        std::hint::black_box(exprs[1].eval_bool(r).unwrap());
        std::hint::black_box(exprs[2].eval_value(r).unwrap());
        std::hint::black_box(exprs[3].eval_value(r).unwrap());
    }
    let tree = (4 * n) as f64 / t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    for r in &records {
        for e in &exprs {
            std::hint::black_box(e.eval(r).unwrap());
        }
    }
    let interpreter = (4 * n) as f64 / t0.elapsed().as_secs_f64();
    (tree, interpreter)
}

fn baseline(records: u64) -> (f64, usize) {
    // The generator's first field uses this salt: the same key stream as the jobs.
    let salt = weir_runtime::value::mix64(0x2545_f491_4f6c_dd1d);
    let t0 = Instant::now();
    let mut map: rustc_hash::FxHashMap<i64, i64> = rustc_hash::FxHashMap::default();
    for seq in 0..records {
        let key = (weir_runtime::value::mix64(seq ^ salt) % 1_000_000) as i64;
        *map.entry(key).or_insert(0) += 1;
    }
    let rate = records as f64 / t0.elapsed().as_secs_f64();
    (rate, std::hint::black_box(map.len()))
}

/// The keyed count's `counts` state restored from `keyed` as its operator does: on the heap, or
/// on rocksdb with its stores under `stores` and a cache of 1M entries.
fn restored_counts(
    keyed: &weir_runtime::restore::KeyedRestore,
    stores: Option<std::path::PathBuf>,
) -> weir_runtime::state::KeyedState<weir_runtime::operators::accumulators::AccOne> {
    let ctx = weir_runtime::operators::keyed::KeyedContext {
        uid: "counts".into(),
        key: vec![0],
        max_parallelism: 128,
        key_groups: (0, 128),
        incremental: true,
        full_every: 10,
        background_full_image_above: u64::MAX,
        full_images: Default::default(),
        store: stores.map(|parent_dir| weir_runtime::state::StoreSettings {
            parent_dir,
            cache_entries: 1_000_000,
            restores_loading: Default::default(),
        }),
    };
    ctx.state(Some(keyed)).unwrap()
}

fn restore_seconds_per_gib(dir: &std::path::Path, expected_keys: usize, rocksdb: bool) -> (f64, u64) {
    let storage = weir_checkpoint::Storage::open(&dir.display().to_string()).unwrap();
    let (valid, _) = weir_runtime::io().block_on(weir_checkpoint::recovery::restorable_checkpoints(&storage)).unwrap();
    let newest = valid.first().expect("a checkpoint to restore");
    let t0 = Instant::now();
    // As the executor does: the rocksdb backend restores from local copies read in parts.
    let keyed_in = if rocksdb {
        weir_runtime::restore::KeyedFilesIn::LocalDir(dir.join("stores"))
    } else {
        weir_runtime::restore::KeyedFilesIn::Memory
    };
    let restored =
        weir_runtime::io().block_on(weir_runtime::restore::RestoredState::load(&storage, newest, &keyed_in)).unwrap();
    let keyed = restored.keyed_for("counts", (0, 128), 1).expect("counts state");
    let state = restored_counts(&keyed, rocksdb.then(|| dir.join("stores")));
    let secs = t0.elapsed().as_secs_f64();
    if rocksdb {
        let mut keys = 0;
        state.for_each(|_, _| keys += 1).unwrap();
        assert_eq!(keys, expected_keys, "every key restored into the store");
    } else {
        assert_eq!(state.cached_len(), expected_keys, "every key restored");
    }
    (secs / (restored.bytes as f64 / (1u64 << 30) as f64), restored.bytes)
}

/// Seconds from starting a new `weir-runtime` process on `job` with `--restore` of the newest
/// checkpoint under `dir` until it has restored the `counts` state (its log line): what a
/// crash costs before records flow again (process start, metadata, reading and restoring),
/// and the checkpoint's bytes. The process then runs the restored job to its end (its source
/// is done) and exits.
///
/// The in-process figure ([`restore_seconds_per_gib`]) comes after every other job of the
/// bench ran in the same process, whose memory and threads they leave behind: its steps took
/// about twice as long as the same steps in a process of their own (session 37,
/// `runtime/BENCHMARKS.md`).
fn restore_in_new_process(dir: &std::path::Path, job: &str, run: usize) -> (f64, u64) {
    use std::io::BufRead;
    let storage = weir_checkpoint::Storage::open(&dir.display().to_string()).unwrap();
    let (valid, _) = weir_runtime::io().block_on(weir_checkpoint::recovery::restorable_checkpoints(&storage)).unwrap();
    let newest = valid.first().expect("a checkpoint to restore");
    let bytes = newest.metadata.state_bytes();
    let job_file = dir.join("restored-job.yaml");
    std::fs::write(&job_file, job).unwrap();
    let t0 = Instant::now();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_weir-runtime"))
        .arg("run")
        .arg(&job_file)
        .arg("--checkpoint-dir")
        .arg(dir.join(format!("restored-{run}")))
        .arg("--restore")
        .arg(dir.join(&newest.dir))
        .env("WEIR_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("weir-runtime starts");
    let mut restored = None;
    for line in std::io::BufReader::new(child.stderr.take().unwrap()).lines() {
        let line = line.unwrap();
        if restored.is_none() && line.contains("keyed state restored") && line.contains("uid=counts") {
            restored = Some(t0.elapsed().as_secs_f64());
        }
    }
    assert!(child.wait().unwrap().success(), "the restored job ends");
    // Its checkpoints hold the state again: gone before the next run.
    let _ = std::fs::remove_dir_all(dir.join(format!("restored-{run}")));
    (restored.expect("the counts state restored"), bytes)
}

/// A rocksdb job whose every record is a new key and whose full images are merged in the
/// background every second checkpoint: its checkpoints list merged images as table files.
/// `rate` (records per second) makes a small job last the few seconds a merge needs.
fn rocksdb_merged_job(keys: u64, rate: Option<u64>) -> String {
    let rate = rate.map(|r| format!("ratePerSecond: {r}, ")).unwrap_or_default();
    backend_lines(Some(1_000_000))
        + &keyed_count_job(keys, true)
            .replace("modulo: 1000000", "sequence: {}")
            .replace(&format!("count: {keys}, "), &format!("count: {keys}, {rate}"))
            .replace("fullEvery: 10 }", "fullEvery: 2, backgroundFullImageAbove: 0 }")
}

/// A rocksdb restore of the newest checkpoint under `dir` that lists table files: seconds until
/// the state is ready for records (what `KeyedContext::state` waits for), then until every
/// entry is in the store (a scan waits for that), and the checkpoint's bytes. `lazy`: as the
/// engine restores (the tables come in behind the job); otherwise the same checkpoint with
/// the tables' first keys left out, which makes the restore take every table in first.
/// `None` when the checkpoint lists no table files (no merge was adopted before the job ended).
fn rocksdb_restore_seconds(dir: &std::path::Path, expected_keys: usize, lazy: bool) -> Option<(f64, f64, u64)> {
    let storage = weir_checkpoint::Storage::open(&dir.display().to_string()).unwrap();
    let (valid, _) = weir_runtime::io().block_on(weir_checkpoint::recovery::restorable_checkpoints(&storage)).unwrap();
    let mut newest = valid.into_iter().next().expect("a checkpoint to restore");
    let subtasks = newest.metadata.operators.values_mut().flat_map(|o| &mut o.subtasks);
    let tables: Vec<&mut weir_checkpoint::FileRef> = subtasks.flat_map(|s| &mut s.store_tables).collect();
    if tables.is_empty() {
        return None;
    }
    for table in tables {
        assert!(table.first_key.is_some(), "merged tables carry their first keys");
        if !lazy {
            table.first_key = None;
        }
    }
    let bytes = newest.metadata.files().map(|f| f.len).sum();
    let stores = dir.join(if lazy { "stores-lazy" } else { "stores-eager" });
    let t0 = Instant::now();
    let keyed_in = weir_runtime::restore::KeyedFilesIn::LocalDir(stores.clone());
    let restored =
        weir_runtime::io().block_on(weir_runtime::restore::RestoredState::load(&storage, &newest, &keyed_in)).unwrap();
    let keyed = restored.keyed_for("counts", (0, 128), 1).expect("counts state");
    assert_eq!(keyed.lazy_tables.is_empty(), !lazy);
    let state = restored_counts(&keyed, Some(stores));
    let ready = t0.elapsed().as_secs_f64();
    let mut keys = 0;
    state.for_each(|_, _| keys += 1).unwrap();
    let all_in = t0.elapsed().as_secs_f64();
    assert_eq!(keys, expected_keys, "every key restored into the store");
    Some((ready, all_in, bytes))
}

/// The rocksdb restore figures: medians of the lazy and the eager restores of one checkpoint.
fn print_rocksdb_restores(lazy: &[(f64, f64, u64)], eager: &[(f64, f64, u64)], keys: u64, merges: u64) {
    let median = |v: &[(f64, f64, u64)], pick: fn(&(f64, f64, u64)) -> f64| {
        let mut x: Vec<f64> = v.iter().map(pick).collect();
        x.sort_by(f64::total_cmp);
        x[x.len() / 2]
    };
    let (eager_ready, lazy_ready) = (median(eager, |r| r.0), median(lazy, |r| r.0));
    let (eager_all, lazy_all) = (median(eager, |r| r.1), median(lazy, |r| r.1));
    println!(
        "rocksdb restore of a merged image in table files ({keys} keys, {} MiB checkpoint, {} merges): \
         ready for records after {:.0} ms, every table in after {:.0} ms; taking every table in first: ready \
         after {:.0} ms ({:.2}× the time to ready), all in after {:.0} ms",
        lazy[0].2 >> 20,
        merges,
        lazy_ready * 1e3,
        lazy_all * 1e3,
        eager_ready * 1e3,
        eager_ready / lazy_ready,
        eager_all * 1e3
    );
}

/// Wall seconds per GiB of checkpoint files of the keyed count (`records` records, as it ran
/// into `dir`) restored from its newest checkpoint at `parallelism` through the engine: its
/// generator, restored at its end, reads nothing more, so the run is the load, the restore of
/// each subtask, the start and the end of the job.
fn restore_run_seconds_per_gib(dir: &std::path::Path, records: u64, parallelism: u32, work: &std::path::Path) -> f64 {
    let storage = weir_checkpoint::Storage::open(&dir.display().to_string()).unwrap();
    let (valid, _) = weir_runtime::io().block_on(weir_checkpoint::recovery::restorable_checkpoints(&storage)).unwrap();
    let found = valid.first().expect("a checkpoint to restore");
    let bytes: u64 = found.metadata.files().map(|f| f.len).sum();
    let newest = storage.url_of(&found.dir);
    let yaml = keyed_count_job(records, true).replace("parallelism: 1", &format!("parallelism: {parallelism}"));
    let job = weir_runtime::load_job(&yaml).expect("bench job is valid");
    let metrics = Arc::new(JobMetrics::new(&job.spec.name, "bench"));
    let (_tx, rx) = crossbeam_channel::unbounded();
    let opts = RunOptions {
        checkpoint_dir: Some(work.display().to_string()),
        restore: Some(weir_runtime::executor::RestoreRequest::Path(newest)),
        ..RunOptions::default()
    };
    let t0 = Instant::now();
    run_job(&job, &opts, metrics.clone(), rx).expect("the restored bench job runs");
    let secs = t0.elapsed().as_secs_f64();
    assert_eq!(metrics.records_in.get(), 0, "restored at its end, the generator reads nothing");
    secs / (bytes as f64 / (1u64 << 30) as f64)
}

/// What a rocksdb full image costs the task thread (records stopped), in milliseconds, with
/// `keys` keys in the store and 1,000 in the cache.
fn rocksdb_full_image_ms(keys: u64, dir: &std::path::Path) -> f64 {
    use weir_runtime::state::{KeyedState, StateStore};
    use weir_runtime::value::{Key, Value};
    let store = StateStore::open(dir, "bench-image").unwrap();
    let mut state: KeyedState<()> = KeyedState::new(128, true, 10).on_store(store, 1_000);
    for k in 0..keys as i64 {
        state.insert_new(Key::One(Value::Int(k)), ()).unwrap();
    }
    state.snapshot_checkpoint().unwrap(); // the first checkpoint of a run is a full image
    state.force_full_flag().store(true, std::sync::atomic::Ordering::Release);
    let t0 = Instant::now();
    let image = state.snapshot_checkpoint().unwrap();
    let sync = t0.elapsed().as_secs_f64() * 1e3;
    assert_eq!(image.entries, keys, "every key in the image");
    sync
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    // `cargo bench` passes --bench; under `cargo test` this runs as a quick smoke test.
    let smoke = !std::env::args().any(|a| a == "--bench");
    let default_scale = if smoke { 0.01 } else { 1.0 };
    let scale: f64 = std::env::var("WEIR_BENCH_SCALE").ok().and_then(|s| s.parse().ok()).unwrap_or(default_scale);
    let count_records = (12_000_000.0 * scale) as u64;
    let window_records = (6_000_000.0 * scale) as u64;
    let tmp = tempfile::tempdir().unwrap();

    let (base, distinct_keys) = baseline(count_records);
    println!("baseline: plain FxHashMap count of the same 1M-key stream, one thread: {:.2}M records/s", base / 1e6);

    // Checkpoints cost a few percent, less than this machine's run-to-run noise: the keyed
    // count runs off and on alternately, and the figures are the medians.
    let repeats = if smoke { 1 } else { 3 };
    let (mut offs, mut ons) = (Vec::new(), Vec::new());
    for i in 0..repeats {
        offs.push(run(&keyed_count_job(count_records, false), &tmp.path().join(format!("count-off-{i}"))));
        ons.push(run(&keyed_count_job(count_records, true), &tmp.path().join(format!("count-on-{i}"))));
    }
    let pair_overheads: Vec<String> =
        offs.iter().zip(&ons).map(|(a, b)| format!("{:+.1}%", (1.0 - b.per_cpu() / a.per_cpu()) * 100.0)).collect();
    // Checkpointing's direct CPU cost within each pair, which the machine's noise moves far
    // less than the ratio of two runs' rates: the synchronous part on the task threads, plus
    // the growth of the CPU share outside them (uploads, merges) against the run without.
    let mut direct_costs: Vec<f64> = offs
        .iter()
        .zip(&ons)
        .map(|(off, on)| on.sync_seconds / on.cpu + outside_tasks(on) - outside_tasks(off))
        .collect();
    direct_costs.sort_by(f64::total_cmp);
    let off = median_run(offs);
    let on = median_run(ons);
    // Every heap-backend job runs before the first rocksdb one: a rocksdb job starts the
    // process's malloc trimmer (`malloc::keep_returning_free_memory`), which then hands the
    // freed pages of later jobs back to the kernel every second (to be faulted in again),
    // where a heap job in a process of its own never has it.
    let w_off = run(&window_job(window_records, false), &tmp.path().join("win-off"));
    let w_on = run(&window_job(window_records, true), &tmp.path().join("win-on"));
    let cel_lines = (1_000_000.0 * scale) as u64;
    // A run's CPU time moves by 10% from one run to the next on these machines: the median of
    // as many runs as the keyed count's.
    let cel_runs: Vec<Run> =
        (0..repeats).map(|i| run(&cel_pipeline_job(cel_lines), &tmp.path().join(format!("cel-{i}")))).collect();
    let cel_each: Vec<String> =
        cel_runs.iter().map(|r| format!("{:.2}M", (r.records * WORDS_PER_LINE) as f64 / r.cpu / 1e6)).collect();
    let cel = median_run(cel_runs);
    let (restore_s_per_gib, restore_bytes) =
        restore_seconds_per_gib(&tmp.path().join("count-on-0"), distinct_keys, false);
    let (restore_rocksdb_s_per_gib, _) = restore_seconds_per_gib(&tmp.path().join("count-on-0"), distinct_keys, true);
    // The rocksdb backend: with a cache that holds every key (1M), and with one that holds a
    // tenth of them, so that most updates miss the cache and read the store.
    // A quarter of the records: each key is still updated three times on average.
    let rocksdb_records = count_records / 4;
    // A rocksdb restore whose merged image is in table files: as the engine does it (the
    // tables come in behind the job) and, on the same checkpoint, taking every table in first.
    let merged_keys = (4_000_000.0 * scale) as u64;
    let merged_dir = tmp.path().join("rocksdb-merged");
    // Paced so that merges into an image are adopted before it ends: unpaced, on a machine
    // that counts its 4M keys in 3 s, its final checkpoint sometimes listed none.
    let merged_rate = Some(if smoke { merged_keys / 4 } else { merged_keys / 8 });
    let merged_job = run(&rocksdb_merged_job(merged_keys, merged_rate), &merged_dir);
    let (mut lazy_restores, mut eager_restores) = (Vec::new(), Vec::new());
    for _ in 0..repeats {
        eager_restores.extend(rocksdb_restore_seconds(&merged_dir, merged_keys as usize, false));
        lazy_restores.extend(rocksdb_restore_seconds(&merged_dir, merged_keys as usize, true));
    }
    // A smoke run's job may end before its first merge is adopted (a loaded machine); the
    // bench's own job (4M keys over 8 s) does not.
    assert!(smoke || !lazy_restores.is_empty(), "the merged job's newest checkpoint lists table files");
    let mut rocksdb_rows = Vec::new();
    for cache in [1_000_000u64, 100_000] {
        for checkpoints in [false, true] {
            let dir = tmp.path().join(format!("count-rocksdb-{cache}-{checkpoints}"));
            rocksdb_rows.push((
                cache,
                checkpoints,
                run(&keyed_count_job_on(rocksdb_records, checkpoints, Some(cache)), &dir),
            ));
        }
    }

    println!();
    println!(
        "| job | checkpoints | records | records/s | records/CPU-s | vs baseline | \
         checkpoints done | p50 ms | p99 ms | mean KiB | sync ms per checkpoint |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for (name, ck, r) in [
        ("keyed count, 1M keys", "off", &off),
        ("keyed count, 1M keys", "1 s", &on),
        ("sliding window 10s/1s, 1K keys", "off", &w_off),
        ("sliding window 10s/1s, 1K keys", "1 s", &w_on),
    ]
    .into_iter()
    .map(|(name, ck, r)| (name.to_string(), ck, r))
    .chain(rocksdb_rows.iter().map(|(cache, checkpoints, r)| {
        (format!("keyed count, 1M keys, rocksdb, cache {}K", cache / 1000), if *checkpoints { "1 s" } else { "off" }, r)
    })) {
        let mean_kib = if r.bytes.is_empty() { 0 } else { r.bytes.iter().sum::<u64>() / r.bytes.len() as u64 / 1024 };
        println!(
            "| {name} | {ck} | {} | {:.2}M | {:.2}M | {:.2}× | {} | {} | {} | {} | {:.1} |",
            r.records,
            r.rate() / 1e6,
            r.per_cpu() / 1e6,
            r.rate() / base,
            r.checkpoints,
            percentile(&r.durations, 0.5),
            percentile(&r.durations, 0.99),
            mean_kib,
            r.sync_seconds * 1e3 / r.checkpoints.max(1) as f64
        );
    }
    println!();
    println!(
        "checkpoint overhead, keyed count (medians of {repeats} runs each): {:+.1}% records/s, {:+.1}% records/CPU-s \
         (each pair: {})",
        (1.0 - on.rate() / off.rate()) * 100.0,
        (1.0 - on.per_cpu() / off.per_cpu()) * 100.0,
        pair_overheads.join(", ")
    );
    println!(
        "synchronous snapshots, keyed count with checkpoints: {:.1}% of its CPU time",
        on.sync_seconds / on.cpu * 100.0
    );
    println!(
        "checkpointing's direct CPU cost, keyed count (synchronous part + growth of the CPU outside the task \
         threads, {:.1}% without checkpoints): median {:.1}% of the job's CPU (each pair: {})",
        outside_tasks(&off) * 100.0,
        direct_costs[direct_costs.len() / 2] * 100.0,
        direct_costs.iter().map(|c| format!("{:.1}%", c * 100.0)).collect::<Vec<_>>().join(", ")
    );
    println!(
        "checkpoint overhead, sliding window: {:+.1}% records/s, {:+.1}% records/CPU-s",
        (1.0 - w_on.rate() / w_off.rate()) * 100.0,
        (1.0 - w_on.per_cpu() / w_off.per_cpu()) * 100.0
    );
    for pair in rocksdb_rows.chunks(2) {
        println!(
            "rocksdb backend, cache {}K: {:.2}× the heap backend's records/CPU-s without checkpoints, \
             checkpoint overhead {:+.1}% records/CPU-s",
            pair[0].0 / 1000,
            pair[0].2.per_cpu() / off.per_cpu(),
            (1.0 - pair[1].2.per_cpu() / pair[0].2.per_cpu()) * 100.0
        );
    }
    if smoke {
        for (_, _, r) in &rocksdb_rows {
            assert_eq!(r.records, rocksdb_records);
        }
        assert_eq!(off.records, count_records);
        assert_eq!(on.records, count_records);
        assert!(on.checkpoints >= 1, "at least the final checkpoint");
        println!("1 passed, 0 failed");
    }
    println!(
        "CEL pipeline (flatMap → filter → map → keyBy → count+sum → keyBy → dedupe, checkpoints 1 s): \
         {:.2}M words/s, {:.2}M words/CPU-s (median of {} runs: {})",
        (cel.records * WORDS_PER_LINE) as f64 / cel.wall / 1e6,
        (cel.records * WORDS_PER_LINE) as f64 / cel.cpu / 1e6,
        cel_each.len(),
        cel_each.join(", ")
    );
    let (tree, interpreter) = cel_expressions((200_000.0 * scale.max(0.05)) as usize);
    println!(
        "CEL expressions of that pipeline alone: lowered tree {:.2}M evaluations/s, cel interpreter {:.2}M/s: {:.1}×",
        tree / 1e6,
        interpreter / 1e6,
        tree / interpreter
    );
    println!(
        "restore: {:.2} s per GiB (newest keyed-count checkpoint, {} MiB, read + verified + rebuilt); \
         onto the rocksdb backend {:.2} s per GiB",
        restore_s_per_gib,
        restore_bytes >> 20,
        restore_rocksdb_s_per_gib
    );
    let image_keys = (2_000_000.0 * scale).max(10_000.0) as u64;
    if lazy_restores.is_empty() {
        println!("rocksdb restore of a merged image in table files: no merge was adopted in this smoke run");
    } else {
        print_rocksdb_restores(&lazy_restores, &eager_restores, merged_keys, merged_job.merges);
    }
    let image_sync = rocksdb_full_image_ms(image_keys, &tmp.path().join("image"));
    println!("rocksdb full image of {image_keys} keys (1,000 cached): {image_sync:.1} ms on the task thread");
    // Restores through the engine: the keyed count's checkpoint at parallelism 1, and the same
    // state checkpointed at parallelism 2 restored at 2, whose subtasks restore in parallel.
    let on_p2 = tmp.path().join("count-on-p2");
    run(&keyed_count_job(count_records, true).replace("parallelism: 1", "parallelism: 2"), &on_p2);
    let p1 = restore_run_seconds_per_gib(&tmp.path().join("count-on-0"), count_records, 1, &tmp.path().join("r1"));
    let p2 = restore_run_seconds_per_gib(&on_p2, count_records, 2, &tmp.path().join("r2"));
    println!(
        "restore through the engine (load, restore, start and end of the job), same state: \
         parallelism 1 {p1:.2} s per GiB, parallelism 2 {p2:.2} s per GiB ({:.2}×)",
        p1 / p2
    );
    // Restore at scale, on request: WEIR_BENCH_RESTORE_KEYS distinct keys (about 12 bytes each
    // in a state file and 72 in memory: 90M keys make a 1 GiB checkpoint and 6.5 GB of heap).
    if let Some(keys) = std::env::var("WEIR_BENCH_RESTORE_KEYS").ok().and_then(|s| s.parse::<u64>().ok()) {
        let dir = tmp.path().join("restore-at-scale");
        let job = run(&distinct_keys_job(keys), &dir);
        // Three new processes, each timed: the median, and each.
        let (mut in_new_process, mut bytes) = (Vec::new(), 0);
        for n in 0..3 {
            let (seconds, of) = restore_in_new_process(&dir, &distinct_keys_job(keys), n);
            in_new_process.push(seconds / (of as f64 / (1u64 << 30) as f64));
            bytes = of;
        }
        let each = in_new_process.iter().map(|s| format!("{s:.2}")).collect::<Vec<_>>().join(", ");
        in_new_process.sort_by(f64::total_cmp);
        let s_per_gib = in_new_process[1];
        let (in_bench_process, _) = restore_seconds_per_gib(&dir, keys as usize, false);
        let (rocksdb_s_per_gib, _) = restore_seconds_per_gib(&dir, keys as usize, true);
        println!("restore at scale onto the rocksdb backend: {rocksdb_s_per_gib:.2} s per GiB");
        println!(
            "restore at scale on the heap backend, in the bench's own process (after its other jobs): \
             {in_bench_process:.2} s per GiB"
        );
        println!(
            "restore at scale: {keys} keys, {} MiB of checkpoint files, {:.2} s per GiB from a new \
             process's start to the state restored (median of 3: {each}) \
             (the job that built it: {:.2}M records/CPU-s, {:.1} s, {} checkpoints, p50 {} ms, p99 {} ms, \
             max {} ms, {:.1} ms synchronous each, {} full images merged in the background)",
            bytes >> 20,
            s_per_gib,
            job.per_cpu() / 1e6,
            job.wall,
            job.checkpoints,
            percentile(&job.durations, 0.5),
            percentile(&job.durations, 0.99),
            job.durations.iter().max().copied().unwrap_or(0),
            job.sync_seconds * 1e3 / job.checkpoints.max(1) as f64,
            job.merges
        );
    }
}
