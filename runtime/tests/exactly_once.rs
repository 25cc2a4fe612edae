//! Exactly-once, proven by comparison: the same bounded job run uninterrupted and run with
//! injected failures (task panics, failed uploads, crashes between checkpoint completion and
//! commit, corrupt checkpoints, killed processes, rescaling) must commit identical output,
//! record by record.

mod common;

use std::time::Duration;

use common::*;
use weir_runtime::executor::{JobOutcome, Request};
use weir_runtime::faults::FaultPlan;

#[test]
fn injected_task_panics_upload_failures_and_commit_crashes_change_nothing() {
    let p = JobParams::new("faults");
    let golden = golden_output(&p);
    assert_eq!(golden["counts"].len(), 12_000, "one running count per record");
    let mut ids = golden["ids"].clone();
    ids.dedup();
    assert!(
        ids.len() == golden["ids"].len() && ids.len() > 2000,
        "each id once: {} of {}",
        ids.len(),
        golden["ids"].len()
    );
    let mut injected = 0;
    for seed in 1..=4u64 {
        let (_d, out, chk) = workdir(&format!("faults-{seed}"));
        let plan = FaultPlan {
            seed,
            task_panic: 0.04,
            upload_failure: 0.05,
            crash_before_commit: 0.3,
            max_faults: 14,
            ..FaultPlan::default()
        };
        let (outcome, m) = run_to_end(&job_yaml(&p, &out), common::RunOptionsExt::with_faults(opts(&chk), plan));
        assert_eq!(outcome, JobOutcome::Finished);
        // Faults are drawn per batch and per checkpoint, so how many fire depends on how the
        // run was scheduled (on a loaded machine batches are larger and fewer): each seed must
        // fire some, and the four together many.
        let n = m.injected_faults.get();
        assert!(n >= 2, "seed {seed}: only {n} faults fired");
        injected += n;
        assert_same_output(
            &golden,
            &committed(&out),
            &format!("seed {seed} with {n} faults, {} restarts", m.restarts.get()),
        );
        assert_retention(&chk, 3);
    }
    eprintln!("injected faults in this test: {injected}");
    assert!(injected >= 20, "only {injected} faults fired over four seeds");
    record_faults(injected);
}

/// Full images merged in the background from the uploaded chains (`backgroundFullImageAbove:
/// 0`): under task panics, failed uploads and crashes before commits the output equals an
/// undisturbed run's, merges were adopted, and retention keeps what it must. Then a run is
/// cancelled once its newest checkpoint builds on a merged image, and the run restored from it
/// finishes with the same output again.
#[test]
fn full_images_merged_in_the_background_are_exactly_once_under_failures_and_restores() {
    let mut p = JobParams::new("merges");
    p.rate = Some(5_000);
    p.background_merges = true;
    let golden = golden_output(&p);
    let mut injected = 0;
    for seed in 1..=2u64 {
        let (_d, out, chk) = workdir(&format!("merges-{seed}"));
        let plan = FaultPlan {
            seed,
            task_panic: 0.03,
            upload_failure: 0.05,
            crash_before_commit: 0.3,
            max_faults: 10,
            ..FaultPlan::default()
        };
        let (outcome, m) = run_to_end(&job_yaml(&p, &out), common::RunOptionsExt::with_faults(opts(&chk), plan));
        assert_eq!(outcome, JobOutcome::Finished);
        let (n, merges) = (m.injected_faults.get(), m.state_merges.get());
        injected += n;
        eprintln!("seed {seed}: {n} faults, {merges} merged full images adopted");
        assert!(merges > 0, "seed {seed}: no merged full image was adopted");
        assert_eq!(m.state_merges_failed.get(), 0, "seed {seed}: merges failed");
        assert_same_output(&golden, &committed(&out), &format!("seed {seed}: {n} faults, {merges} merges"));
        assert_retention_up_to(&chk, 3, None);
    }
    record_faults(injected);

    // On the rocksdb backend (a cache of 100 entries) the merged images come with table files
    // too, and the restore takes those into its store instead of reading the image. The job
    // runs for 8 s, far longer than the first merge takes (0.6-1 s here), so that it is still
    // running when cancelled on a slower machine; the restored run finishes at full speed.
    let long = JobParams { count: 40_000, ..p.clone() };
    let golden = golden_output(&long);
    for rocksdb in [false, true] {
        let (_d, out, chk) = workdir(&format!("merges-restore-{rocksdb}"));
        let backend = if rocksdb { "stateBackend: rocksdb\nstateCacheEntries: 100\n" } else { "" };
        let yaml = job_yaml(&long, &out) + backend;
        let unthrottled = job_yaml(&JobParams { rate: None, ..long.clone() }, &out) + backend;
        let run = InProcess::start(&yaml, opts(&chk));
        let started = std::time::Instant::now();
        let deadline = started + Duration::from_secs(60);
        while run.metrics.state_merges.get() == 0 {
            assert!(std::time::Instant::now() < deadline, "no merge adopted within 60 s");
            std::thread::sleep(Duration::from_millis(5));
        }
        eprintln!("rocksdb {rocksdb}: first merge adopted after {:?}", started.elapsed());
        let completed = run.metrics.checkpoints_completed.get();
        run.wait_for_checkpoints(completed + 2, Duration::from_secs(30));
        run.requests.send(Request::Cancel).unwrap();
        assert_eq!(run.join().0.unwrap(), JobOutcome::Cancelled);
        let newest = newest_checkpoint(&chk);
        let meta =
            weir_checkpoint::CheckpointMetadata::decode(&std::fs::read(newest.join("_metadata")).unwrap()).unwrap();
        let files: Vec<&String> = meta.files().map(|f| &f.path).collect();
        assert!(
            files.iter().any(|f| f.ends_with("-merged.kv")),
            "the newest checkpoint builds on a merged image: {files:?}"
        );
        assert_eq!(
            files.iter().any(|f| f.ends_with(".sst")),
            rocksdb,
            "merged images have table files on the rocksdb backend only: {files:?}"
        );
        let tables_before: Vec<(std::path::PathBuf, Vec<u8>)> = meta
            .files()
            .filter(|f| f.path.ends_with(".sst"))
            .map(|f| {
                let path = chk.join(weir_checkpoint::layout::resolve(
                    &newest.strip_prefix(&chk).unwrap().to_string_lossy(),
                    &f.path,
                ));
                let bytes = std::fs::read(&path).unwrap();
                (path, bytes)
            })
            .collect();
        let (outcome, m) = run_to_end(&unthrottled, RunOptionsExt::restore_latest(opts(&chk)));
        assert_eq!(outcome, JobOutcome::Finished);
        assert!(m.board().restored_from.is_some());
        assert_same_output(
            &golden,
            &committed(&out),
            &format!("restored from a checkpoint on a merged image (rocksdb: {rocksdb})"),
        );
        // The store took the checkpoint's table files in by hard links: they are unchanged
        // (retention may have deleted them since, once newer checkpoints no longer list them).
        for (path, bytes) in tables_before {
            if let Ok(now) = std::fs::read(&path) {
                assert!(now == bytes, "{} changed after a restore took it in", path.display());
            }
        }
    }
}

/// A job whose keyed state grows by new keys (a dedupe of a sequence) on the rocksdb backend
/// with merges in the background: runs of its increments are merged into one increment (the
/// state outgrows its increments, so the chain needs no image for a while). Under task panics,
/// failed uploads and crashes before commits every id comes out exactly once; then runs are
/// cancelled once their newest checkpoint lists a merged increment and restored from it, and
/// the job still finishes with every id exactly once.
#[test]
fn runs_of_increments_merged_in_the_background_are_exactly_once_under_failures_and_restores() {
    let job = |out: &std::path::Path, count: u64| {
        format!(
            r#"name: growing
parallelism: 2
maxParallelism: 32
stateBackend: rocksdb
stateCacheEntries: 100
checkpointing: {{ interval: 50ms, tolerableFailures: 3, fullEvery: 4, backgroundFullImageAbove: 0 }}
restart: {{ attempts: 100, delay: 10ms }}
sources:
  - name: ids
    uid: ids
    generator: {{ count: {count}, ratePerSecond: 10000, fields: [ {{ name: id, sequence: {{}} }} ] }}
operators:
  - {{ name: by-id, keyBy: {{ fields: [id] }} }}
  - {{ name: unique, uid: unique, dedupe: {{}} }}
sinks:
  - {{ name: out, uid: out, file: {{ path: {out}/ids }} }}
"#,
            out = out.display()
        )
    };
    // Every id of 0..count once, record by record.
    let exactly_once = |out: &std::path::Path, count: u64, what: &str| {
        let lines = committed(out).remove("ids").unwrap_or_default();
        let mut ids: Vec<u64> = lines
            .iter()
            .map(|l| l.trim_start_matches("{\"id\":").trim_end_matches('}').parse().unwrap_or_else(|_| panic!("{l}")))
            .collect();
        ids.sort_unstable();
        let duplicates = ids.windows(2).filter(|w| w[0] == w[1]).count();
        ids.dedup();
        assert_eq!(duplicates, 0, "{what}: {duplicates} ids written twice");
        assert_eq!(ids.len() as u64, count, "{what}: {} of {count} ids written", ids.len());
        assert_eq!((ids[0], *ids.last().unwrap()), (0, count - 1), "{what}");
    };
    let (_d, out, chk) = workdir("increment-merges-faults");
    let plan = FaultPlan {
        seed: 7,
        task_panic: 0.02,
        upload_failure: 0.03,
        crash_before_commit: 0.3,
        max_faults: 8,
        ..FaultPlan::default()
    };
    let (outcome, m) = run_to_end(&job(&out, 60_000), RunOptionsExt::with_faults(opts(&chk), plan));
    assert_eq!(outcome, JobOutcome::Finished);
    record_faults(m.injected_faults.get());
    eprintln!(
        "merged increments adopted: {}, images: {}, failed: {}",
        m.state_increment_merges.get(),
        m.state_merges.get(),
        m.state_merges_failed.get()
    );
    assert!(m.state_increment_merges.get() > 0, "no run of increments was merged");
    exactly_once(&out, 60_000, "under failures");

    // Cancelled once the newest checkpoint lists a merged increment, restored from it.
    let (_d, out, chk) = workdir("increment-merges-restore");
    let count = 300_000;
    let mut restored_on_a_merged_increment = 0;
    for round in 0..6 {
        let options = if round == 0 { opts(&chk) } else { RunOptionsExt::restore_latest(opts(&chk)) };
        let run = InProcess::start(&job(&out, count), options);
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while run.metrics.state_increment_merges.get() == 0 {
            assert!(std::time::Instant::now() < deadline, "round {round}: no merged increment within 60 s");
            std::thread::sleep(Duration::from_millis(5));
        }
        let completed = run.metrics.checkpoints_completed.get();
        run.wait_for_checkpoints(completed + 1, Duration::from_secs(30));
        run.requests.send(Request::Cancel).unwrap();
        assert_eq!(run.join().0.unwrap(), JobOutcome::Cancelled);
        let newest = newest_checkpoint(&chk);
        let meta =
            weir_checkpoint::CheckpointMetadata::decode(&std::fs::read(newest.join("_metadata")).unwrap()).unwrap();
        if meta.files().any(|f| f.path.ends_with("-merged-increment.kv")) {
            restored_on_a_merged_increment += 1;
            if restored_on_a_merged_increment == 2 {
                break;
            }
        }
    }
    eprintln!("cancelled on a checkpoint listing a merged increment: {restored_on_a_merged_increment} times");
    assert!(restored_on_a_merged_increment > 0, "no newest checkpoint listed a merged increment when cancelled");
    // The rest, at full speed.
    let (outcome, m) =
        run_to_end(&job(&out, count).replace("ratePerSecond: 10000, ", ""), RunOptionsExt::restore_latest(opts(&chk)));
    assert_eq!(outcome, JobOutcome::Finished);
    assert!(m.board().restored_from.is_some());
    exactly_once(&out, count, "restored from checkpoints on merged increments");
}

/// A running count of 900K records over `keys` keys (`seq % keys`), with `checkpointing`'s
/// settings, its output under `out`; `rate` a `ratePerSecond: N, ` or nothing.
fn running_count_job(name: &str, checkpointing: &str, keys: u64, out: &std::path::Path, rate: &str) -> String {
    format!(
        r#"name: {name}
parallelism: 1
maxParallelism: 32
checkpointing: {{ {checkpointing} }}
restart: {{ attempts: 100, delay: 10ms }}
sources:
  - name: draws
    uid: draws
    generator: {{ count: 900000, {rate}fields: [ {{ name: seq, sequence: {{}} }} ] }}
operators:
  - {{ name: keyed, map: {{ fields: {{ id: "seq % {keys}" }} }} }}
  - {{ name: by-id, keyBy: {{ fields: [id] }} }}
  - {{ name: counts, uid: counts, aggregate: {{ aggregates: [ {{ fn: count, as: n }} ] }} }}
sinks:
  - {{ name: out, uid: out, file: {{ path: {out}/counts }} }}
"#,
        out = out.display()
    )
}

/// Runs the job `job` writes for an output directory once per seed, under task panics, failed
/// uploads and crashes before commits, and checks that its output equals `golden` record by
/// record.
fn same_output_under_faults(
    golden: &std::collections::BTreeMap<String, Vec<String>>,
    name: &str,
    seeds: &[u64],
    job: impl Fn(&std::path::Path) -> String,
) {
    same_output_under_faults_with(golden, name, seeds, job, opts)
}

/// [`same_output_under_faults`], each run with `options` for its checkpoint directory.
fn same_output_under_faults_with(
    golden: &std::collections::BTreeMap<String, Vec<String>>,
    name: &str,
    seeds: &[u64],
    job: impl Fn(&std::path::Path) -> String,
    options: impl Fn(&std::path::Path) -> weir_runtime::executor::RunOptions,
) {
    for &seed in seeds {
        let (_d, out, chk) = workdir(&format!("{name}-{seed}"));
        let plan = FaultPlan {
            seed,
            task_panic: 0.002,
            upload_failure: 0.05,
            crash_before_commit: 0.3,
            max_faults: 6,
            ..FaultPlan::default()
        };
        let (outcome, m) = run_to_end(&job(&out), RunOptionsExt::with_faults(options(&chk), plan));
        assert_eq!(outcome, JobOutcome::Finished);
        record_faults(m.injected_faults.get());
        let restarts = m.restarts.get();
        assert_same_output(golden, &committed(&out), &format!("{name}, seed {seed}, {restarts} restarts"));
    }
}

/// The newest complete checkpoint's metadata under `chk`, if there is one.
fn newest_metadata(chk: &std::path::Path) -> Option<weir_checkpoint::CheckpointMetadata> {
    let complete = std::fs::read_dir(chk.join("checkpoints")).into_iter().flatten().flatten().any(|e| {
        weir_checkpoint::layout::parse_checkpoint_dir(&e.file_name().to_string_lossy()).is_some()
            && e.path().join("_metadata").exists()
    });
    if !complete {
        return None;
    }
    let raw = std::fs::read(newest_checkpoint(chk).join("_metadata")).ok()?;
    Some(weir_checkpoint::CheckpointMetadata::decode(&raw).unwrap())
}

/// A heap state whose checkpoint files are 256 KiB or more is restored on a thread per core:
/// full images, and increments whose metadata says where their puts start. Cancelled each time
/// its newest checkpoint ends in such an increment and restored from it, and under task
/// panics, failed uploads and crashes before commits, the job's output equals an undisturbed
/// run's, record by record.
#[test]
fn large_heap_states_restored_on_several_threads_are_exactly_once() {
    let job = |out: &std::path::Path, rate: &str| {
        running_count_job("large-restores", "interval: 500ms, tolerableFailures: 3, fullEvery: 3", 100_000, out, rate)
    };
    let (_d, out, chk) = workdir("large-restores-golden");
    let (outcome, _) = run_to_end(&job(&out, ""), opts(&chk));
    assert_eq!(outcome, JobOutcome::Finished);
    let golden = committed(&out);
    assert_eq!(golden["counts"].len(), 900_000, "one running count per record");

    // The newest checkpoint's last file, when it is an increment a restore applies on several
    // threads (256 KiB or more: `RESTORE_CONCURRENT_MIN_BYTES`).
    let large_increment_last = |chk: &std::path::Path| {
        let Some(meta) = newest_metadata(chk) else { return false };
        let chain = meta.operators.get("counts").map(|o| &o.subtasks[0].keyed_state);
        chain.and_then(|c| c.last()).is_some_and(|f| f.puts_from.is_some() && f.len > 256 << 10)
    };
    let (_d, out, chk) = workdir("large-restores-cancelled");
    for round in 0..2 {
        let options = if round == 0 { opts(&chk) } else { RunOptionsExt::restore_latest(opts(&chk)) };
        let run = InProcess::start(&job(&out, "ratePerSecond: 100000, "), options);
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !large_increment_last(&chk) {
            assert!(std::time::Instant::now() < deadline, "round {round}: no large increment within 60 s");
            std::thread::sleep(Duration::from_millis(5));
        }
        run.requests.send(Request::Cancel).unwrap();
        assert_eq!(run.join().0.unwrap(), JobOutcome::Cancelled);
    }
    assert!(large_increment_last(&chk), "the restore below starts from a large increment");
    let (outcome, m) = run_to_end(&job(&out, ""), RunOptionsExt::restore_latest(opts(&chk)));
    assert_eq!(outcome, JobOutcome::Finished);
    assert!(m.board().restored_from.is_some());
    assert_same_output(&golden, &committed(&out), "cancelled twice and restored from large increments");
    same_output_under_faults(&golden, "large-restores", &[3, 11], |out| job(out, ""));
}

/// A heap state restored from a chain of a megabyte or more of files that list only puts (a
/// running count's full image, then increments) is applied shard by shard, all files at once
/// (`KeyedState::restore_chain_by_shard`), the files in window order read front to back, the
/// others sorted into windows. Cancelled once such a chain of three files or more, two of them
/// in window order, is the newest checkpoint, restored from it, and cancelled and restored again, the job's
/// output equals an undisturbed run's, record by record: each key's count, restored from the
/// files in their order, goes on from its newest value. Each restore is of 240,000 keys or
/// more: 8,192 buckets a shard or more, two windows or more, whose keys each file in window
/// order lists apart (and from the second restore on, keys changed again after an older
/// file listed them).
#[test]
fn long_chains_restored_shard_by_shard_are_exactly_once() {
    let job = |out: &std::path::Path, rate: &str| {
        running_count_job(
            "chain-restores",
            "interval: 200ms, tolerableFailures: 3, fullEvery: 1000",
            300_000,
            out,
            rate,
        )
    };
    let (_d, out, chk) = workdir("chain-restores-golden");
    let (outcome, _) = run_to_end(&job(&out, ""), opts(&chk));
    assert_eq!(outcome, JobOutcome::Finished);
    let golden = committed(&out);
    assert_eq!(golden["counts"].len(), 900_000, "one running count per record");

    // The newest checkpoint's chain: three files or more, each of puts only, two of them in
    // window order (increments of the changed keys, read front to back by the restore), 1 MiB
    // or more in all (`CHAIN_BY_SHARD_MIN_BYTES`), of 240,000 keys or more, newer than `after`.
    let long_chain_newest = |chk: &std::path::Path, after: u64| {
        let meta = newest_metadata(chk)?;
        let subtask = &meta.operators.get("counts")?.subtasks[0];
        let chain = &subtask.keyed_state;
        let long = chain.len() >= 3
            && subtask.keyed_entries >= Some(240_000)
            && chain.iter().all(|f| f.puts_from == Some(0))
            && chain.iter().filter(|f| f.in_window_order).count() >= 2
            && chain.iter().map(|f| f.len).sum::<u64>() >= 1 << 20;
        (long && meta.checkpoint_id > after).then_some(meta.checkpoint_id)
    };
    let (_d, out, chk) = workdir("chain-restores-cancelled");
    let mut restored_from = 0;
    for round in 0..3 {
        let options = if round == 0 { opts(&chk) } else { RunOptionsExt::restore_latest(opts(&chk)) };
        let run = InProcess::start(&job(&out, "ratePerSecond: 150000, "), options);
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let newest = loop {
            if let Some(id) = long_chain_newest(&chk, restored_from) {
                break id;
            }
            assert!(std::time::Instant::now() < deadline, "round {round}: no long chain within 60 s");
            std::thread::sleep(Duration::from_millis(5));
        };
        run.requests.send(Request::Cancel).unwrap();
        assert_eq!(run.join().0.unwrap(), JobOutcome::Cancelled);
        restored_from = newest;
    }
    assert!(long_chain_newest(&chk, 0).is_some(), "the restore below starts from a long chain");
    let ints = newest_metadata(&chk).unwrap().operators["counts"].subtasks[0].int_keys;
    assert!(ints, "of integer keys, restored as integers");
    let (outcome, m) = run_to_end(&job(&out, ""), RunOptionsExt::restore_latest(opts(&chk)));
    assert_eq!(outcome, JobOutcome::Finished);
    assert!(m.board().restored_from.is_some());
    assert_same_output(&golden, &committed(&out), "cancelled three times and restored from long chains");
    // Restarted in the process after task panics, failed uploads and crashes before commits.
    same_output_under_faults(&golden, "chain-restores", &[5, 13], |out| job(out, ""));
}

/// A running count whose keys are integers first and, from the 300,000th record on, every
/// other one a text: the state holds them as integers (its checkpoints say so) until the first
/// text comes, then as values (its checkpoints no longer say so). Cancelled once on a
/// checkpoint of integers and once on one after the move, each time restored from it with
/// `--restore latest`, and under task panics, failed uploads and crashes before commits, the
/// output equals an undisturbed run's, record by record; on both state backends.
#[test]
fn keys_that_turn_from_integers_to_texts_are_exactly_once_across_the_move() {
    for rocksdb in [false, true] {
        keys_that_turn_from_integers_to_texts_on(rocksdb);
    }
}

/// [`keys_that_turn_from_integers_to_texts_are_exactly_once_across_the_move`] on the heap
/// backend, or on rocksdb with a cache of 100 entries.
fn keys_that_turn_from_integers_to_texts_on(rocksdb: bool) {
    let name = format!("int-keys-move-{rocksdb}");
    let backend = if rocksdb { "stateBackend: rocksdb\nstateCacheEntries: 100\n" } else { "" };
    let job = |out: &std::path::Path, rate: &str| {
        running_count_job(&name, "interval: 100ms, tolerableFailures: 3", 5_000, out, rate).replace(
            r#"id: "seq % 5000""#,
            r#"id: "seq >= 300000 && seq % 2 == 0 ? 't' + string(seq % 5000) : seq % 5000""#,
        ) + backend
    };
    let (_d, out, chk) = workdir(&format!("{name}-golden"));
    let (outcome, _) = run_to_end(&job(&out, ""), opts(&chk));
    assert_eq!(outcome, JobOutcome::Finished);
    let golden = committed(&out);
    assert_eq!(golden["counts"].len(), 900_000, "one running count per record");
    assert!(golden["counts"].iter().any(|r| r.contains(r#""t4998""#)), "texts counted too");
    let newest_says_ints = |chk: &std::path::Path| {
        let meta = newest_metadata(chk)?;
        Some((meta.checkpoint_id, meta.operators.get("counts")?.subtasks[0].int_keys))
    };
    assert_eq!(newest_says_ints(&chk).map(|(_, ints)| ints), Some(false), "the last checkpoint, after the move");

    let (_d, out, chk) = workdir(&format!("{name}-cancelled"));
    let mut restored_from = 0;
    // Round 0 stops at its first checkpoint (of integers); round 1, restored from it, takes
    // one of integers again (restored as integers), then one after the move, and stops.
    for (round, wanted) in [vec![true], vec![true, false]].into_iter().enumerate() {
        let options = if round == 0 { opts(&chk) } else { RunOptionsExt::restore_latest(opts(&chk)) };
        let run = InProcess::start(&job(&out, "ratePerSecond: 400000, "), options);
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let mut seen = restored_from;
        for ints in wanted {
            seen = loop {
                match newest_says_ints(&chk) {
                    Some((id, said)) if id > seen && said == ints => break id,
                    _ => {}
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "{name}, round {round}: no checkpoint of int keys {ints} in 60 s"
                );
                std::thread::sleep(Duration::from_millis(2));
            };
        }
        run.requests.send(Request::Cancel).unwrap();
        assert_eq!(run.join().0.unwrap(), JobOutcome::Cancelled);
        restored_from = newest_says_ints(&chk).unwrap().0;
        if round == 0 {
            assert_eq!(newest_says_ints(&chk).map(|(_, ints)| ints), Some(true), "round 1 restores integers");
        }
    }
    let (outcome, m) = run_to_end(&job(&out, ""), RunOptionsExt::restore_latest(opts(&chk)));
    assert_eq!(outcome, JobOutcome::Finished);
    assert!(m.board().restored_from.is_some());
    assert_same_output(&golden, &committed(&out), "cancelled before and after the move and restored");
    same_output_under_faults(&golden, &name, &[3, 17], |out| job(out, ""));
}

/// A heap restore whose files take more than it may hold in memory
/// (`RunOptions::state_files_in_memory_max`, here nothing) reads them in parts from local
/// links to the checkpoint's files, verified as they are read. Cancelled and restored that way
/// twice, then restored from a newest checkpoint whose largest file had a byte flipped (found
/// while it is read: recorded as damaged, and the restart takes an older checkpoint), and
/// under task panics, failed uploads and crashes before commits, the job's output equals an
/// undisturbed run's, record by record.
#[test]
fn heap_restores_read_in_parts_are_exactly_once_and_find_a_damaged_file_as_they_read() {
    let job = |out: &std::path::Path, rate: &str| {
        running_count_job("parts-restores", "interval: 200ms, tolerableFailures: 3", 200_000, out, rate)
    };
    let in_parts =
        |chk: &std::path::Path| weir_runtime::executor::RunOptions { state_files_in_memory_max: Some(0), ..opts(chk) };
    let (_d, out, chk) = workdir("parts-restores-golden");
    let (outcome, _) = run_to_end(&job(&out, ""), opts(&chk));
    assert_eq!(outcome, JobOutcome::Finished);
    let golden = committed(&out);

    let (_d, out, chk) = workdir("parts-restores-cancelled");
    for round in 0..3 {
        let options = if round == 0 { in_parts(&chk) } else { in_parts(&chk).restore_latest() };
        let run = InProcess::start(&job(&out, "ratePerSecond: 150000, "), options);
        run.wait_for_checkpoints(4, Duration::from_secs(60));
        run.requests.send(Request::Cancel).unwrap();
        assert_eq!(run.join().0.unwrap(), JobOutcome::Cancelled);
    }
    let newest = newest_checkpoint(&chk);
    let target = largest_file_referenced(&chk, &newest);
    let mut bytes = std::fs::read(&target).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&target, bytes).unwrap();
    let (outcome, m) = run_to_end(&job(&out, ""), in_parts(&chk).restore_latest());
    assert_eq!(outcome, JobOutcome::Finished);
    assert!(m.restarts.get() >= 1, "the damaged file failed the first attempt's restore");
    let damage_records = std::fs::read_dir(chk.join(weir_checkpoint::layout::DAMAGED)).map_or(0, |d| d.count());
    assert!(damage_records >= 1, "the damage is recorded for later restores");
    assert_ne!(m.board().restored_from.as_deref(), Some(newest.to_str().unwrap()));
    record_faults(1);
    assert_same_output(&golden, &committed(&out), "restored in parts, the newest checkpoint damaged");
    same_output_under_faults_with(&golden, "parts-restores", &[7, 17], |out| job(out, ""), in_parts);
}

#[test]
fn at_least_once_mode_loses_nothing_under_failures() {
    let mut p = JobParams::new("alo");
    p.mode = "at-least-once";
    let golden = golden_output(&p);
    let (_d, out, chk) = workdir("alo-faults");
    let plan = FaultPlan { seed: 9, task_panic: 0.01, max_faults: 6, ..FaultPlan::default() };
    let (outcome, m) = run_to_end(&job_yaml(&p, &out), common::RunOptionsExt::with_faults(opts(&chk), plan));
    assert_eq!(outcome, JobOutcome::Finished);
    record_faults(m.injected_faults.get());
    assert_no_loss(&golden, &committed(&out));
}

#[test]
fn a_corrupt_newest_checkpoint_falls_back_to_the_previous_one() {
    let mut p = JobParams::new("corrupt");
    p.rate = Some(8_000);
    let golden = golden_output(&p);
    let (_d, out, chk) = workdir("corrupt");
    let yaml = job_yaml(&p, &out);
    let mut corrupted = 0;
    for round in 0..3 {
        let run = InProcess::start(&yaml, RunOptionsExt::restore_latest(opts(&chk)));
        run.wait_for_checkpoints(4, Duration::from_secs(60));
        run.requests.send(Request::Cancel).unwrap();
        let (r, _) = run.join();
        assert_eq!(r.unwrap(), JobOutcome::Cancelled);
        // Flip one byte of the newest checkpoint's largest state file (round 0, 2) or metadata.
        let newest = newest_checkpoint(&chk);
        let target = if round == 1 { newest.join("_metadata") } else { largest_file_referenced(&chk, &newest) };
        let mut bytes = std::fs::read(&target).unwrap();
        let i = bytes.len() / 2;
        bytes[i] ^= 0x40;
        std::fs::write(&target, bytes).unwrap();
        corrupted += 1;
    }
    let (outcome, m) = run_to_end(&yaml, RunOptionsExt::restore_latest(opts(&chk)));
    assert_eq!(outcome, JobOutcome::Finished);
    let restored_from = m.board().restored_from.clone().unwrap();
    assert!(!restored_from.is_empty());
    record_faults(corrupted);
    assert_same_output(&golden, &committed(&out), "after three corrupted newest checkpoints");
}

/// Runs a job until it completed three checkpoints, then cancels it.
fn cancel_after_three_checkpoints(yaml: &str, opts: weir_runtime::executor::RunOptions) {
    let run = InProcess::start(yaml, opts);
    run.wait_for_checkpoints(3, Duration::from_secs(60));
    run.requests.send(Request::Cancel).unwrap();
    assert_eq!(run.join().0.unwrap(), JobOutcome::Cancelled);
}

fn newest_checkpoint(chk: &std::path::Path) -> std::path::PathBuf {
    let mut ids: Vec<u64> = std::fs::read_dir(chk.join("checkpoints"))
        .unwrap()
        .flatten()
        .filter_map(|e| weir_checkpoint::layout::parse_checkpoint_dir(&e.file_name().to_string_lossy()))
        .filter(|id| chk.join(format!("checkpoints/chk-{id}/_metadata")).exists())
        .collect();
    ids.sort_unstable();
    chk.join(format!("checkpoints/chk-{}", ids.last().expect("a complete checkpoint")))
}

fn largest_file_referenced(chk: &std::path::Path, dir: &std::path::Path) -> std::path::PathBuf {
    let meta = weir_checkpoint::CheckpointMetadata::decode(&std::fs::read(dir.join("_metadata")).unwrap()).unwrap();
    let rel = dir.strip_prefix(chk).unwrap().to_string_lossy().to_string();
    let f = meta.files().max_by_key(|f| f.len).unwrap();
    chk.join(weir_checkpoint::layout::resolve(&rel, &f.path))
}

#[test]
fn rescaling_through_a_savepoint_two_to_three_and_three_to_two() {
    for (from, to) in [(2u32, 3u32), (3, 2)] {
        let mut p = JobParams::new(&format!("rescale-{from}-{to}"));
        p.rate = Some(10_000);
        let golden = golden_output(&JobParams { parallelism: 1, ..p.clone() });
        let (_d, out, chk) = workdir(&p.name);
        p.parallelism = from;
        let run = InProcess::start(&job_yaml(&p, &out), opts(&chk));
        run.wait_for_checkpoints(3, Duration::from_secs(60));
        run.request_savepoint(true, false);
        let (r, _) = run.join();
        let JobOutcome::Stopped { savepoint } = r.unwrap() else { panic!("expected a stop with savepoint") };
        assert!(savepoint.contains("/savepoints/sp-"), "{savepoint}");
        p.parallelism = to;
        let (outcome, m) = run_to_end(&job_yaml(&p, &out), RunOptionsExt::restore_path(opts(&chk), &savepoint));
        assert_eq!(outcome, JobOutcome::Finished);
        assert_eq!(m.board().restored_from.as_deref(), Some(savepoint.as_str()));
        assert_same_output(&golden, &committed(&out), &format!("rescale {from} → {to}"));
    }
}

#[test]
fn savepoints_restore_with_an_added_operator_and_refuse_a_vanished_uid() {
    let mut p = JobParams::new("evolve");
    p.rate = Some(10_000);
    let (_d, out, chk) = workdir("evolve");
    let run = InProcess::start(&job_yaml(&p, &out), opts(&chk));
    run.wait_for_checkpoints(2, Duration::from_secs(60));
    run.request_savepoint(true, false);
    let JobOutcome::Stopped { savepoint } = run.join().0.unwrap() else { panic!("expected stop") };

    // A new stateful operator (and its sink) is fine: it starts empty.
    let mut added = p.clone();
    added.extra_operators = "  - { name: by-word-2, input: events, keyBy: { fields: [word] } }\n  \
                             - { name: word-totals, uid: word-totals, \
                             aggregate: { aggregates: [ { fn: sum, field: amount, as: total } ] } }\n"
        .into();
    let added_yaml = job_yaml(&added, &out).replace(
        "sinks:\n",
        &format!(
            "sinks:\n  - {{ name: totals-out, input: word-totals, uid: totals-out, file: {{ path: {}/totals }} }}\n",
            out.display()
        ),
    );
    let (outcome, _) = run_to_end(&added_yaml, RunOptionsExt::restore_path(opts(&chk), &savepoint));
    assert_eq!(outcome, JobOutcome::Finished);

    // Without the dedupe branch its state has nowhere to go: refused...
    let mut removed = p.clone();
    removed.without_dedupe = true;
    let removed_yaml = job_yaml(&removed, &out);
    let (r, _) = InProcess::start(&removed_yaml, RunOptionsExt::restore_path(opts(&chk), &savepoint)).join();
    let err = r.unwrap_err().to_string();
    assert!(err.contains("unique-ids") && err.contains("allowNonRestoredState"), "{err}");
    // ...unless allowed.
    let mut o = RunOptionsExt::restore_path(opts(&chk), &savepoint);
    o.allow_non_restored_state = true;
    let (outcome, _) = run_to_end(&removed_yaml, o);
    assert_eq!(outcome, JobOutcome::Finished);
}

/// A small job named `name` run to its end: its params, work directory (kept while the
/// guard lives), output and checkpoint directories.
fn finished_small_job(name: &str) -> (JobParams, tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    let mut p = JobParams::new(name);
    p.count = 2000;
    let (d, out, chk) = workdir(name);
    run_to_end(&job_yaml(&p, &out), opts(&chk));
    (p, d, out, chk)
}

#[test]
fn restoring_a_changed_max_parallelism_is_refused() {
    let (p, _d, out, chk) = finished_small_job("maxpar");
    let yaml = job_yaml(&p, &out).replace("maxParallelism: 64", "maxParallelism: 32");
    let (r, _) = InProcess::start(&yaml, RunOptionsExt::restore_latest(opts(&chk))).join();
    let err = r.unwrap_err().to_string();
    assert!(err.contains("maxParallelism is 64 in the snapshot and 32 in the job"), "{err}");
}

/// An operator whose aggregates changed cannot read its old state: refused once, before
/// anything runs, naming the uid and both layouts (it used to fail reading the state, three
/// times, as a malformed file); so is one keyed by another number of fields. Its fields and
/// output names may change; so may its uid, which starts it empty.
#[test]
fn restoring_changed_aggregates_is_refused_naming_the_operator() {
    let (p, _d, out, chk) = finished_small_job("aggchange");
    let count = "aggregate: { aggregates: [ { fn: count, as: n } ] }";
    let yaml = job_yaml(&p, &out);
    assert!(yaml.contains(count), "{yaml}");

    let summed =
        yaml.replace(count, "aggregate: { aggregates: [ { fn: count, as: n }, { fn: sum, field: amount, as: s } ] }");
    let (r, m) = InProcess::start(&summed, RunOptionsExt::restore_latest(opts(&chk))).join();
    let err = r.unwrap_err().to_string();
    assert!(
        err.contains(
            "operator uid `user-counts` holds aggregate[count] state in the snapshot and is \
                      aggregate[count,sum] in the job"
        ),
        "{err}"
    );
    assert_eq!(m.restarts.get(), 0, "refused, not retried: {err}");

    let as_a_sum = yaml.replace(count, "aggregate: { aggregates: [ { fn: sum, field: amount, as: n } ] }");
    let err = InProcess::start(&as_a_sum, RunOptionsExt::restore_latest(opts(&chk))).join().0.unwrap_err().to_string();
    assert!(err.contains("holds aggregate[count] state in the snapshot and is aggregate[sum]"), "{err}");

    // Keyed by two fields, its keys hash into other key groups and would find none of the
    // snapshot's: refused the same way (it used to restore and count every user from zero).
    let by_user = "keyBy: { fields: [user] }";
    assert!(yaml.contains(by_user), "{yaml}");
    let rekeyed = yaml.replace(by_user, "keyBy: { fields: [user, word] }");
    let (r, m) = InProcess::start(&rekeyed, RunOptionsExt::restore_latest(opts(&chk))).join();
    let err = r.unwrap_err().to_string();
    assert!(
        err.contains("operator uid `user-counts` holds state keyed by 1 field(s) in the snapshot and is keyed by 2"),
        "{err}"
    );
    assert_eq!(m.restarts.get(), 0, "refused, not retried: {err}");
    let other_field = yaml.replace(by_user, "keyBy: { fields: [word] }");
    let (outcome, _) = run_to_end(&other_field, RunOptionsExt::restore_latest(opts(&chk)));
    assert_eq!(outcome, JobOutcome::Finished, "a key of as many fields restores (the user's choice)");

    let renamed = yaml.replace(count, "aggregate: { aggregates: [ { fn: count, as: total } ] }");
    let (outcome, _) = run_to_end(&renamed, RunOptionsExt::restore_latest(opts(&chk)));
    assert_eq!(outcome, JobOutcome::Finished, "an output renamed reads the same state");
}

/// Every published file ever seen under `out`, with its bytes: in place or moved under a
/// sink's `_superseded/<epoch>/`.
fn all_published(out: &std::path::Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let mut all = std::collections::BTreeMap::new();
    for sink in std::fs::read_dir(out).unwrap().flatten() {
        let mut dirs = vec![sink.path()];
        if let Ok(moved) = std::fs::read_dir(sink.path().join("_superseded")) {
            dirs.extend(moved.flatten().map(|e| e.path()));
        }
        for d in dirs {
            for f in std::fs::read_dir(&d).unwrap().flatten() {
                let name = f.file_name().to_string_lossy().to_string();
                if name.starts_with("part-") {
                    all.insert(
                        format!("{}/{name}", sink.file_name().to_string_lossy()),
                        std::fs::read(f.path()).unwrap(),
                    );
                }
            }
        }
    }
    all
}

#[test]
fn restoring_an_older_savepoint_and_then_the_newer_one_is_exactly_once_each_time_and_loses_nothing() {
    let mut p = JobParams::new("rewind");
    p.rate = Some(10_000);
    let golden = golden_output(&p);
    let (_d, out, chk) = workdir("rewind");
    let run = InProcess::start(&job_yaml(&p, &out), opts(&chk));
    run.wait_for_checkpoints(2, Duration::from_secs(60));
    let older = run.request_savepoint(false, false);
    run.wait_for_checkpoints(6, Duration::from_secs(60));
    let newer = run.request_savepoint(false, false);
    // The job keeps running after a plain savepoint, and finishes.
    let (r, m) = run.join();
    assert_eq!(r.unwrap(), JobOutcome::Finished);
    let path = |request: u64| {
        let status = m.board().savepoints.get(&request).cloned().expect("request recorded");
        assert_eq!(status.outcome, weir_crds::control::CheckpointOutcome::Completed, "{status:?}");
        status.path.unwrap()
    };
    let (older, newer) = (path(older), path(newer));
    assert_same_output(&golden, &committed(&out), "run with two savepoints in the middle");
    let mut published = all_published(&out);
    // Back to the older savepoint, then forward to the newer one, then back again: each time
    // the output is exactly the restored history's, and no published file is ever lost.
    for (i, sp) in [&older, &newer, &older].into_iter().enumerate() {
        let (outcome, _) = run_to_end(&job_yaml(&p, &out), RunOptionsExt::restore_path(opts(&chk), sp));
        assert_eq!(outcome, JobOutcome::Finished);
        assert_same_output(&golden, &committed(&out), &format!("restore {i} ({sp})"));
        let now = all_published(&out);
        for (name, bytes) in &published {
            assert_eq!(now.get(name), Some(bytes), "restore {i}: {name} was lost or changed");
        }
        published = now;
    }
    let moved: Vec<_> = std::fs::read_dir(out.join("counts/_superseded")).unwrap().flatten().collect();
    assert!(!moved.is_empty(), "rewinds move output under _superseded");
    assert!(moved.iter().all(|d| d.path().join("_manifest-counts-out.json").exists()), "each move has its manifest");
}

#[test]
fn retention_on_cancel_delete_removes_checkpoints() {
    let mut p = JobParams::new("cancel-delete");
    p.rate = Some(5_000);
    let (_d, out, chk) = workdir("cancel-delete");
    let yaml = job_yaml(&p, &out).replace("  retained: 3\n", "  retained: 3\n  retentionOnCancel: delete\n");
    let run = InProcess::start(&yaml, opts(&chk));
    run.wait_for_checkpoints(2, Duration::from_secs(60));
    assert!(chk.join("checkpoints").exists());
    run.requests.send(Request::Cancel).unwrap();
    assert_eq!(run.join().0.unwrap(), JobOutcome::Cancelled);
    let storage = weir_checkpoint::Storage::open(chk.to_str().unwrap()).unwrap();
    let left = weir_runtime::io().block_on(storage.list("checkpoints")).unwrap();
    assert!(left.is_empty(), "checkpoints deleted on cancel, left: {left:?}");
}

#[test]
fn file_source_with_cel_map_filter_and_dedupe_is_exactly_once_under_failures() {
    let (_d, input) = input_files("files-in", 5, 2000, |f, i| {
        format!("User{} bought item{} x{}", (i * 7 + f) % 97, (i * 13 + f) % 50, i % 5)
    });
    let job = |out: &std::path::Path| {
        format!(
            r#"name: files
parallelism: 2
maxParallelism: 32
checkpointing: {{ interval: 50ms, tolerableFailures: 3 }}
restart: {{ attempts: 100, delay: 10ms }}
sources:
  - {{ name: lines, uid: lines, file: {{ path: {input} }} }}
operators:
  - name: parsed
    map: {{ fields: {{ user: "line.split(' ')[0].lowerAscii()", item: "line.split(' ')[2]",
                      qty: "int(line.split(' ')[3].substring(1))" }} }}
  - {{ name: nonzero, filter: {{ expr: "qty > 0" }} }}
  - {{ name: by-user-item, keyBy: {{ fields: [user, item] }} }}
  - {{ name: first-purchase, uid: first-purchase, dedupe: {{}} }}
  - {{ name: pairs, map: {{ fields: {{ user: user, item: item }} }} }}
sinks:
  - {{ name: out, uid: out, file: {{ path: {out}/pairs }} }}
"#,
            input = input.display(),
            out = out.display()
        )
    };
    let golden = {
        let (_d, out, chk) = workdir("files-golden");
        let (outcome, _) = run_to_end(&job(&out), opts(&chk));
        assert_eq!(outcome, JobOutcome::Finished);
        committed(&out)
    };
    assert!(golden["pairs"].len() > 1000, "{}", golden["pairs"].len());
    assert!(golden["pairs"][0].starts_with("{\"user\":\"user"), "{}", golden["pairs"][0]);
    let (_d2, out, chk) = workdir("files-faults");
    let plan = FaultPlan { seed: 5, task_panic: 0.05, crash_before_commit: 0.3, max_faults: 8, ..FaultPlan::default() };
    let (outcome, m) = run_to_end(&job(&out), RunOptionsExt::with_faults(opts(&chk), plan));
    assert_eq!(outcome, JobOutcome::Finished);
    record_faults(m.injected_faults.get());
    assert_same_output(&golden, &committed(&out), "file source under failures");
}

/// At most `retained` checkpoint directories remain (and a fallback that shares no file with
/// the newest), all complete, and every shared file is referenced by one of them.
fn assert_retention(chk: &std::path::Path, retained: usize) {
    assert_retention_up_to(chk, retained, Some(retained + 1))
}

/// [`assert_retention`], with at most `max_dirs` directories when the oldest is a fallback
/// (`None`: any number after it).
fn assert_retention_up_to(chk: &std::path::Path, retained: usize, max_dirs: Option<usize>) {
    let dirs: Vec<_> = std::fs::read_dir(chk.join("checkpoints"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.starts_with("chk-"))
        .collect();
    let mut referenced = std::collections::BTreeSet::new();
    let mut shared_by_dir = std::collections::BTreeMap::new();
    for d in &dirs {
        let meta = weir_checkpoint::CheckpointMetadata::decode(
            &std::fs::read(chk.join("checkpoints").join(d).join("_metadata")).unwrap(),
        )
        .expect("complete and valid");
        let id = weir_checkpoint::layout::parse_checkpoint_dir(d).unwrap();
        let files: std::collections::BTreeSet<String> = meta
            .files()
            .map(|f| weir_checkpoint::layout::resolve(&format!("checkpoints/{d}"), &f.path))
            .filter(|f| f.starts_with("checkpoints/shared/"))
            .collect();
        for f in meta.files() {
            referenced.insert(weir_checkpoint::layout::resolve(&format!("checkpoints/{d}"), &f.path));
        }
        shared_by_dir.insert(id, files);
    }
    // More than `retained` only from a fallback on: the oldest shares no file with the newest
    // (with merged chains the checkpoints after the fallback are kept as the next fallbacks).
    let fallback = {
        let (oldest, newest) = (shared_by_dir.values().next().unwrap(), shared_by_dir.values().last().unwrap());
        !newest.is_empty() && oldest.is_disjoint(newest)
    };
    assert!(
        dirs.len() <= retained || (fallback && max_dirs.is_none_or(|max| dirs.len() <= max)),
        "{} checkpoint directories left: {dirs:?}",
        dirs.len()
    );
    let shared = chk.join("checkpoints/shared");
    for uid in std::fs::read_dir(&shared).unwrap().flatten() {
        for f in std::fs::read_dir(uid.path()).unwrap().flatten() {
            let rel =
                format!("checkpoints/shared/{}/{}", uid.file_name().to_string_lossy(), f.file_name().to_string_lossy());
            assert!(referenced.contains(&rel), "unreferenced shared file {rel} left behind");
        }
    }
}

#[test]
fn restore_from_an_explicit_checkpoint_path() {
    let mut p = JobParams::new("by-path");
    p.rate = Some(8_000);
    let golden = golden_output(&p);
    let (_d, out, chk) = workdir("by-path");
    cancel_after_three_checkpoints(&job_yaml(&p, &out), opts(&chk));
    let path = newest_checkpoint(&chk);
    let (outcome, m) = run_to_end(&job_yaml(&p, &out), RunOptionsExt::restore_path(opts(&chk), path.to_str().unwrap()));
    assert_eq!(outcome, JobOutcome::Finished);
    assert_eq!(m.board().restored_from.as_deref(), Some(path.to_str().unwrap()));
    assert_same_output(&golden, &committed(&out), "restored from an explicit checkpoint path");
}

/// A job restored from a checkpoint of another storage root (another job's retained
/// checkpoint, as `initialSavepoint` allows) writes checkpoints that stand on their own: its
/// incremental chain starts in its own root instead of referencing files of the other root
/// (whose references would not even resolve in its own). On the heap backend the first
/// checkpoint copies (here links) the restored chain's files into the job's root and goes on
/// with increments; on rocksdb it starts with a full image. The other root is deleted before
/// the job restores again from its own checkpoints, and the output is still exactly the
/// undisturbed run's. Before, every checkpoint of the new root up to its next full image was
/// invalid ("missing file ../shared/..."). On both backends; on rocksdb with merged images in
/// the background, whose table files a restore takes in lazily.
#[test]
fn a_checkpoint_of_another_root_restores_into_checkpoints_that_stand_on_their_own() {
    for rocksdb in [false, true] {
        let mut p = JobParams::new("other-root");
        p.rate = Some(8_000);
        p.background_merges = rocksdb;
        let golden = golden_output(&p);
        let backend = if rocksdb { "stateBackend: rocksdb\nstateCacheEntries: 100\n" } else { "" };
        let (d, out, chk) = workdir(&format!("other-root-{rocksdb}"));
        // No periodic full image in the second run, which would replace the copies.
        let yaml = job_yaml(&p, &out).replace("fullEvery: 4", "fullEvery: 50") + backend;
        cancel_after_three_checkpoints(&yaml, opts(&chk));
        let other_root = newest_checkpoint(&chk);
        let own = d.path().join("own-root");
        cancel_after_three_checkpoints(&yaml, opts(&own).restore_path(other_root.to_str().unwrap()));
        let adopted = adopted_chains(&own);
        match rocksdb {
            false => {
                assert!(adopted.contains(&"user-counts".to_string()), "the heap chains were not adopted: {adopted:?}")
            }
            true => assert!(adopted.is_empty(), "rocksdb chains adopted: {adopted:?}"),
        }
        std::fs::remove_dir_all(&chk).unwrap();
        let storage = weir_checkpoint::Storage::open(&own.display().to_string()).unwrap();
        let listed = weir_runtime::io().block_on(weir_checkpoint::recovery::list_checkpoints(&storage)).unwrap();
        let valid = listed.iter().filter(|(_, v, _)| *v == weir_checkpoint::recovery::Verdict::Valid).count();
        for (id, verdict, _) in &listed {
            assert!(
                !matches!(verdict, weir_checkpoint::recovery::Verdict::Invalid(_)),
                "rocksdb {rocksdb}: checkpoint {id} of the new root: {verdict:?}"
            );
        }
        assert!(valid >= 1, "rocksdb {rocksdb}: the new root holds valid checkpoints: {listed:?}");
        let newest_own = newest_checkpoint(&own);
        let (outcome, m) = run_to_end(&yaml, RunOptionsExt::restore_latest(opts(&own)));
        assert_eq!(outcome, JobOutcome::Finished);
        assert_eq!(m.board().restored_from.as_deref(), Some(newest_own.to_str().unwrap()));
        assert_same_output(
            &golden,
            &committed(&out),
            &format!("rocksdb {rocksdb}: restored from another root, then from its own"),
        );
    }
}

/// Checkpoints that expire before any of an attempt completed do not expire the same way at
/// every restart: the first checkpoint after a restore that cannot go on from the restored
/// files writes every key and may need longer than the job's increments, and with
/// `tolerableFailures: 0` each restart restored the same checkpoint and expired again until
/// the restarts ran out (after a stateful upgrade, for good). Here storage is slow (every
/// keyed upload waits 200 ms, longer than the 150 ms timeout), each failed attempt doubles
/// the next one's timeout, and the job finishes with its output
/// exactly the undisturbed run's, record by record.
#[test]
fn checkpoints_that_expire_before_any_completed_get_a_longer_timeout_at_each_restart() {
    let mut p = JobParams::new("slow-first");
    p.rate = Some(8_000);
    p.tolerable_failures = 0;
    let golden = golden_output(&p);
    let (d, out, chk) = workdir("slow-first");
    let yaml = job_yaml(&p, &out);
    cancel_after_three_checkpoints(&yaml, opts(&chk));
    let other_root = newest_checkpoint(&chk);
    let slow = yaml.replace("timeout: 10s", "timeout: 150ms").replace("attempts: 1000", "attempts: 4");
    let plan = FaultPlan { upload_delay_ms: 200, ..FaultPlan::default() };
    let run =
        RunOptionsExt::with_faults(opts(&d.path().join("new-root")).restore_path(other_root.to_str().unwrap()), plan);
    let (outcome, m) = run_to_end(&slow, run);
    assert_eq!(outcome, JobOutcome::Finished, "the restarts ran out: {:?}", m.board().last_error);
    let restarts = m.restarts.get();
    eprintln!("{restarts} restarts; the last failure: {:?}", m.board().last_error);
    assert!((1..=3).contains(&restarts), "{restarts} restarts");
    let last_error = m.board().last_error.clone().unwrap_or_default();
    assert!(last_error.contains("expired after") && last_error.contains("checkpointing.timeout ×"), "{last_error}");
    assert_same_output(&golden, &committed(&out), &format!("restored onto slow storage, {restarts} restarts"));
}

/// The uids whose keyed-state chain in the newest checkpoint of `chk` begins with files copied
/// from another root ([`weir_checkpoint::layout::shared_adopted_file`]).
fn adopted_chains(chk: &std::path::Path) -> Vec<String> {
    let meta = newest_metadata(chk).expect("a complete checkpoint");
    meta.operators
        .iter()
        .filter(|(_, op)| {
            op.subtasks.iter().any(|s| s.keyed_state.first().is_some_and(|f| f.path.contains("-adopted-")))
        })
        .map(|(uid, _)| uid.clone())
        .collect()
}

/// A stateful upgrade as GitOps does it: stop with a savepoint, start the new version from it
/// in a new root. The heap backend's first checkpoint there copies (links) the savepoint's
/// files into the new root and goes on with increments, where the task used to stop and write
/// the whole state again. The new root must then stand on its own: the savepoint and the old
/// root are deleted (as their owner may), and the job, failing at random (tasks panic, uploads
/// fail; the seed is printed), restarts from the new root's checkpoints to the end; its output
/// is exactly the undisturbed run's, record by record.
#[test]
fn a_savepoint_restored_into_a_new_root_is_adopted_and_that_root_stands_without_it() {
    let mut p = JobParams::new("adopt-savepoint");
    p.rate = Some(8_000);
    let golden = golden_output(&p);
    let (d, out, chk) = workdir("adopt-savepoint");
    let yaml = job_yaml(&p, &out).replace("fullEvery: 4", "fullEvery: 50");
    let run = InProcess::start(&yaml, opts(&chk));
    run.wait_for_checkpoints(3, Duration::from_secs(60));
    run.request_savepoint(true, false);
    let (outcome, _) = run.join();
    let JobOutcome::Stopped { savepoint } = outcome.unwrap() else { panic!("not stopped with a savepoint") };
    let new_root = d.path().join("new-root");
    cancel_after_three_checkpoints(&yaml, opts(&new_root).restore_path(&savepoint));
    let adopted = adopted_chains(&new_root);
    assert!(adopted.contains(&"user-counts".to_string()), "the savepoint's chains were not adopted: {adopted:?}");
    std::fs::remove_dir_all(&savepoint).unwrap();
    std::fs::remove_dir_all(&chk).unwrap();
    let seed = std::env::var("WEIR_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(11);
    eprintln!("seed {seed} (WEIR_SEED)");
    let plan = FaultPlan { seed, task_panic: 0.02, upload_failure: 0.05, max_faults: 6, ..FaultPlan::default() };
    let (outcome, m) = run_to_end(&yaml, RunOptionsExt::with_faults(opts(&new_root), plan).restore_latest());
    assert_eq!(outcome, JobOutcome::Finished, "seed {seed}");
    let faults = m.injected_faults.get();
    eprintln!("seed {seed}: {faults} faults, {} restarts", m.restarts.get());
    assert!(faults >= 1, "seed {seed}: no fault fired");
    assert!(m.board().restored_from.as_deref().is_some_and(|p| p.starts_with(new_root.to_str().unwrap())));
    assert_same_output(
        &golden,
        &committed(&out),
        &format!("seed {seed}: restored from its own root after a savepoint's"),
    );
}

/// A run restored from another root's checkpoint that fails before it checkpointed in its own
/// root restarts from that checkpoint, read again: a run keeps where it started from, not the
/// files it read (a heap restore's files are about as large as the state they fill, and were
/// held for the whole run). The failure comes at the first batch, before any checkpoint.
#[test]
fn a_restart_before_the_first_checkpoint_reads_the_runs_restore_point_again() {
    let mut p = JobParams::new("read-again");
    p.rate = Some(8_000);
    let golden = golden_output(&p);
    let (d, out, chk) = workdir("read-again");
    let yaml = job_yaml(&p, &out);
    cancel_after_three_checkpoints(&yaml, opts(&chk));
    let other_root = newest_checkpoint(&chk);
    let own = d.path().join("own-root");
    let plan = FaultPlan { seed: 3, task_panic: 1.0, max_faults: 1, ..Default::default() };
    let run = RunOptionsExt::with_faults(opts(&own).restore_path(other_root.to_str().unwrap()), plan);
    let (outcome, m) = run_to_end(&yaml, run);
    assert_eq!(outcome, JobOutcome::Finished);
    assert_eq!((m.injected_faults.get(), m.restarts.get()), (1, 1));
    assert_eq!(m.board().restored_from.as_deref(), Some(other_root.to_str().unwrap()));
    assert_same_output(&golden, &committed(&out), "restarted from another root's checkpoint");
}

#[test]
fn stop_with_drain_flushes_every_open_window_into_the_savepoint_commit() {
    let (_d, out, chk) = workdir("drain");
    let yaml = format!(
        r#"name: drain
parallelism: 2
checkpointing: {{ interval: 100ms }}
sources:
  - name: events
    uid: events
    generator: {{ ratePerSecond: 20000, fields: [ {{ name: k, modulo: 50 }} ] }}
operators:
  - {{ name: by-k, keyBy: {{ fields: [k] }} }}
  - {{ name: per-second, uid: per-second,
      window: {{ type: tumbling, size: 1s, aggregates: [ {{ fn: count, as: n }} ] }} }}
sinks:
  - {{ name: out, uid: out, file: {{ path: {} }} }}
"#,
        out.join("windows").display()
    );
    let run = InProcess::start(&yaml, opts(&chk));
    run.wait_for_checkpoints(3, Duration::from_secs(60));
    run.request_savepoint(true, true);
    let (r, m) = run.join();
    assert!(matches!(r.unwrap(), JobOutcome::Stopped { .. }));
    let counted: i64 = committed(&out)["windows"]
        .iter()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap()["n"].as_i64().unwrap())
        .sum();
    let read = m.records_in.get() as i64;
    assert!(read > 0);
    assert_eq!(counted, read, "every record read before the stop is in a committed window");
}

/// A savepoint that does not stop the job commits nothing (as in Flink since 1.15): its
/// transactions are published by the next checkpoint. (It used to publish them at once, so a
/// `--restore latest` from an older checkpoint replayed records already published.)
#[test]
fn a_savepoint_that_does_not_stop_the_job_publishes_nothing() {
    let mut p = JobParams::new("sp-no-commit");
    p.rate = Some(5_000);
    p.count = 1_000_000;
    let (_d, out, chk) = workdir("sp-no-commit");
    // Periodic checkpoints off: only the savepoint could publish anything.
    let yaml = job_yaml(&p, &out).replace("  interval: 100ms\n", "  interval: 100ms\n  enabled: false\n");
    let run = InProcess::start(&yaml, opts(&chk));
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while run.metrics.records_in.get() < 2_000 {
        assert!(std::time::Instant::now() < deadline, "no records read");
        std::thread::sleep(Duration::from_millis(10));
    }
    let request = run.request_savepoint(false, false);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        let s = run.metrics.board().savepoints.get(&request).cloned();
        if let Some(s) = s.filter(|s| s.outcome != weir_crds::control::CheckpointOutcome::InProgress) {
            break s;
        }
        assert!(std::time::Instant::now() < deadline, "savepoint not done");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(status.outcome, weir_crds::control::CheckpointOutcome::Completed, "{status:?}");
    // Tasks handle their instructions in order: a commit for the savepoint would come before
    // the cancel.
    run.requests.send(Request::Cancel).unwrap();
    assert_eq!(run.join().0.unwrap(), JobOutcome::Cancelled);
    assert!(committed(&out).values().all(|lines| lines.is_empty()), "a plain savepoint published output");
}

/// A savepoint in progress when its job attempt fails is reported failed, saying why, so that
/// whoever waits for it (the control API's `wait`, the operator before an upgrade) learns it
/// must ask again: the next attempt's coordinator does not know the request. Before, it stayed
/// in progress for good (found with a savepoint whose image filled the disk: the CLI's wait
/// ran into its two-minute timeout). Every task panics at its first batch, once; the request
/// is queued before the coordinator's first look at its requests.
#[test]
fn a_savepoint_in_progress_when_its_attempt_fails_is_reported_failed() {
    let mut p = JobParams::new("sp-attempt-fails");
    p.rate = Some(8_000);
    let golden = golden_output(&p);
    let (_d, out, chk) = workdir("sp-attempt-fails");
    let plan = FaultPlan { seed: 5, task_panic: 1.0, max_faults: 1, ..FaultPlan::default() };
    let run = InProcess::start(&job_yaml(&p, &out), RunOptionsExt::with_faults(opts(&chk), plan));
    let (reply, accepted) = tokio::sync::oneshot::channel();
    run.requests.send(Request::Savepoint { stop: false, drain: false, reply }).unwrap();
    let request = weir_runtime::io().block_on(accepted).expect("the request was accepted");
    let (r, m) = run.join();
    assert_eq!(r.unwrap(), JobOutcome::Finished);
    assert_eq!(m.restarts.get(), 1);
    let status = m.board().savepoints.get(&request).cloned().unwrap();
    assert_eq!(status.outcome, weir_crds::control::CheckpointOutcome::Failed, "{status:?}");
    let failure = status.failure.unwrap_or_default();
    assert!(failure.contains("the job attempt failed before it completed"), "{failure}");
    assert_same_output(&golden, &committed(&out), "after a savepoint lost with its attempt");
}

/// A savepoint whose upload fails leaves the records it closed pending in the sink: the next
/// checkpoint must stage and commit them. (The failure used to drop their staged data while
/// the sink still listed the transaction, so every later commit and restore failed: found by
/// the cluster scenario whose savepoints all fail.)
#[test]
fn a_failed_savepoint_loses_none_of_the_records_it_closed() {
    let mut p = JobParams::new("sp-fails");
    p.rate = Some(8_000);
    let golden = golden_output(&p);
    let (_d, out, chk) = workdir("sp-fails");
    let plan = FaultPlan { seed: 3, savepoint_failure: 1.0, ..FaultPlan::default() };
    let run = InProcess::start(&job_yaml(&p, &out), RunOptionsExt::with_faults(opts(&chk), plan));
    run.wait_for_checkpoints(2, Duration::from_secs(60));
    let request = run.request_savepoint(false, false);
    let (r, m) = run.join();
    assert_eq!(r.unwrap(), JobOutcome::Finished);
    let status = m.board().savepoints.get(&request).cloned().unwrap();
    assert_eq!(status.outcome, weir_crds::control::CheckpointOutcome::Failed, "{status:?}");
    assert_eq!(m.restarts.get(), 0, "no commit failed");
    assert_same_output(&golden, &committed(&out), "after a failed savepoint");
}
