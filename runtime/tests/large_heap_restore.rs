//! A heap state of long values, whose checkpoint is about as large as the state, restores
//! under the memory limit it ran in: its files are read in parts, where holding them in memory
//! next to the state they fill is OOM-killed.
//!
//! Needs root and the cgroup memory controller, like `large_state.rs`; `.ci/run` runs it in
//! release after that file's tests (`cargo test --release -p weir-runtime --test
//! large_heap_restore -- --ignored`), not beside them: run at the same time, it sped up the
//! first run of `large_state.rs`'s rocksdb restore test, whose restore is then OOM-killed (see
//! `runtime/BENCHMARKS.md`, session 40).

mod common;
mod memory_limits;

use std::path::Path;

use common::*;
use memory_limits::*;

/// Keys of the heap restore test, each holding a 64-word text (about 600 bytes): the state's
/// checkpoint is about as large as the state.
const TEXT_KEYS: u64 = 600_000;
/// Keys `0..TEXT_SECOND` are counted twice.
const TEXT_SECOND: u64 = 60_000;
/// The memory limit of the heap restore test. Without a limit the job peaked at 595 MB; its
/// restore from a 378 MB checkpoint at 632 MB reading the files in parts, at 894 MB holding
/// them in memory.
const TEXT_LIMIT: u64 = 720 << 20;
/// The heap restore test's first run is killed once its newest checkpoint holds this much.
const TEXT_CHAIN_AT_KILL: u64 = 330 << 20;

fn text_job(out: &Path) -> String {
    format!(
        r#"name: large-text-state
parallelism: 1
checkpointing: {{ interval: 1s, timeout: 60s, backgroundFullImageAbove: 1000 }}
sources:
  - name: src
    uid: src
    generator: {{ count: {records}, ratePerSecond: 100000, fields: [ {{ name: seq, sequence: {{}} }},
      {{ name: line, text: {{ words: 64, vocabulary: 100000 }} }} ] }}
operators:
  - {{ name: keyed, map: {{ fields: {{ key: "seq % {TEXT_KEYS}", line: "line" }} }} }}
  - {{ name: by-key, keyBy: {{ fields: [key] }} }}
  - {{ name: counts, uid: counts, aggregate: {{ aggregates: [ {{ fn: count, as: "n" }},
      {{ fn: max, field: line, as: m }} ] }} }}
  - {{ name: seconds, filter: {{ expr: "n == 2" }} }}
  - {{ name: short, map: {{ fields: {{ key: "key", n: "n" }} }} }}
sinks:
  - {{ name: out, uid: out, file: {{ path: {out}/counts }} }}
"#,
        records = TEXT_KEYS + TEXT_SECOND,
        out = out.display()
    )
}

#[test]
#[ignore = "run in release by .ci/run (cargo test --release ... -- --ignored): ten times slower in a debug build"]
fn a_heap_state_of_long_values_restores_within_the_memory_limit_it_ran_in_exactly_once() {
    // The job is killed once its newest checkpoint holds about half the memory limit, then
    // restored from it under the same limit. Holding the checkpoint's files in memory next to
    // the state they fill (as every heap restore did) needs more than the limit: that restore
    // is OOM-killed. By default a restore whose files take more than a quarter of the limit
    // reads them in parts, and completes.
    let (_dir, out, _) = workdir("large-text-state");
    let dir = out.parent().unwrap().to_path_buf();
    let yaml = text_job(&out);
    let first = MemoryCgroup::new("text-1", Some(TEXT_LIMIT));
    let chain_when_killed = std::cell::Cell::new(0);
    let (status, peak, time) = run_until(&first, &yaml, &dir, &[], |chk| {
        let bytes = newest_chain_bytes(chk);
        chain_when_killed.set(bytes);
        bytes > TEXT_CHAIN_AT_KILL
    });
    let chain = chain_when_killed.get();
    eprintln!(
        "first run under {} MiB: {status} after {time:?}, newest checkpoint's keyed state {} MiB, peak RSS {} MiB",
        TEXT_LIMIT >> 20,
        chain >> 20,
        peak >> 20
    );
    assert!(!first.oom_killed(), "the first run ran out of memory");
    assert!(
        !status.success() && chain > TEXT_CHAIN_AT_KILL,
        "the job must be killed mid-run ({status}, {chain} bytes)"
    );

    let in_memory = MemoryCgroup::new("text-in-memory", Some(TEXT_LIMIT));
    let all_in_memory = ["--restore", "latest", "--state-files-in-memory-max", "1000000000000"];
    let (status, peak, _) = run_until(&in_memory, &yaml, &dir, &all_in_memory, |_| false);
    eprintln!("restore holding its files in memory: {status}, peak RSS {} MiB", peak >> 20);
    assert!(!status.success() && in_memory.oom_killed(), "the files and the state fit in the limit: {status}");

    let second = MemoryCgroup::new("text-2", Some(TEXT_LIMIT));
    let (status, peak, time) = run_until(&second, &yaml, &dir, &["--restore", "latest"], |_| false);
    eprintln!("restored run (files in parts): {status} in {time:?}, peak RSS {} MiB", peak >> 20);
    assert!(status.success() && !second.oom_killed(), "the restored run under the limit failed: {status}");
    assert_second_counts_exactly_once(&out, TEXT_SECOND);
}

#[test]
#[ignore = "run in release by .ci/run (cargo test --release ... -- --ignored): ten times slower in a debug build"]
fn a_heap_state_restored_into_other_roots_checkpoints_within_the_memory_limit_exactly_once() {
    // Restored into another job root at the same parallelism (a savepoint's restore is one),
    // the first checkpoint links the restored chain's files into the new root and goes on
    // with increments. Restored at another parallelism, each subtask's first checkpoint is a
    // full image of its share of the state, here about a quarter of the limit each: held in
    // memory next to the state it was taken of (as every heap image was), the images needed
    // more than the limit, and the run was OOM-killed at that checkpoint, again at each
    // restart. A full image over 64 MiB is now written to a local file instead.
    let (_dir, out, _) = workdir("large-text-moved");
    let dir = out.parent().unwrap().to_path_buf();
    let yaml = text_job(&out);
    let first = MemoryCgroup::new("moved-1", Some(TEXT_LIMIT));
    let (status, peak, time) = run_until(&first, &yaml, &dir, &[], |chk| newest_chain_bytes(chk) > TEXT_CHAIN_AT_KILL);
    eprintln!("first run under {} MiB: {status} after {time:?}, peak RSS {} MiB", TEXT_LIMIT >> 20, peak >> 20);
    assert!(!first.oom_killed() && !status.success(), "the job must be killed mid-run: {status}");
    let restore_point = newest_checkpoint(&dir.join("state")).expect("a complete checkpoint");
    let from = ["--restore", restore_point.to_str().unwrap()];

    for parallelism in [1, 2] {
        // Two subtasks restoring at once (each reading the whole chain for its key groups, in
        // an allocator arena of its own) peaked at 733 MiB of RSS under the limit and were
        // killed under 656 MiB, before any checkpoint: 32 MiB more for them. Full images held
        // in memory would still need about 360 MiB more than the state.
        let limit = TEXT_LIMIT + if parallelism == 2 { 32 << 20 } else { 0 };
        let moved = MemoryCgroup::new(&format!("moved-p{parallelism}"), Some(limit));
        let other_root = dir.join(format!("root-p{parallelism}"));
        let yaml = yaml.replace("parallelism: 1\n", &format!("parallelism: {parallelism}\n"));
        let (status, peak, time) = run_in_root_until(&moved, &yaml, &dir, &other_root, &from, |_| false);
        let chain = newest_chain_bytes(&other_root);
        let adopted = newest_chain_files(&other_root).iter().any(|f| f.contains("-adopted-"));
        eprintln!(
            "restored into another root at parallelism {parallelism}: {status} in {time:?}, peak RSS {} MiB \
             (the cgroup's peak {} MiB), its newest checkpoint's keyed state {} MiB (adopted files: {adopted})",
            peak >> 20,
            moved.peak() >> 20,
            chain >> 20
        );
        assert!(
            status.success() && !moved.oom_killed(),
            "parallelism {parallelism}: the run under the limit failed: {status}"
        );
        assert!(
            chain > TEXT_CHAIN_AT_KILL,
            "parallelism {parallelism}: the new root's checkpoint holds the whole state ({chain} bytes)"
        );
        assert_eq!(adopted, parallelism == 1, "parallelism {parallelism}: only the same key groups adopt the chain");
        assert_second_counts_exactly_once(&out, TEXT_SECOND);
    }
}
