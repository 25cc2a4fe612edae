//! State larger than memory: a keyed count over 15M keys (the first million of them updated a
//! second time at the end) runs under a cgroup memory limit of a fifth of what the same job
//! needs on the heap backend. On the rocksdb backend it must complete with each of those keys'
//! second counts in the output exactly once (each needs the key's first count, which by then
//! was evicted to disk); on the heap backend the same limit must kill it, which shows that the
//! limit is real.
//!
//! Needs root and the cgroup memory controller (v1 as on these machines, or v2). `.ci/run`
//! runs it in release (`cargo test --release -p weir-runtime --test large_state -- --ignored`):
//! 16M records through a debug build's state code take about ten times as long as in release
//! (in release: about 100 s here, with the heap runs).

mod common;
mod memory_limits;

use std::path::Path;

use common::*;
use memory_limits::*;

/// With 5M keys the limit (193 MiB) was within 10% of what the rocksdb run needs (167–201 MiB),
/// and one CI run was OOM-killed. The heap backend's need grows about twice as fast with the
/// keys as the rocksdb backend's (whose bloom filters, indexes and merges grow with them). At
/// 10M keys the heap map in shards peaks at about 1.45 GiB, a limit of 291 MiB, and the rocksdb
/// run reached it (260 MiB resident); 12M keys need the same tables (a limit of 280 MiB, the
/// rocksdb run at 273 MiB). At 15M keys the shards have grown once more: the heap run peaks at
/// about 3.5 GiB, a limit of about 710 MiB, and the rocksdb run needs about 310 MiB.
const KEYS: u64 = 15_000_000;
/// Keys `0..SECOND` are counted twice.
const SECOND: u64 = 1_000_000;

fn job(out: &Path, rocksdb: bool) -> String {
    let backend = if rocksdb { "stateBackend: rocksdb\nstateCacheEntries: 100000\n" } else { "" };
    format!(
        r#"name: large-state
parallelism: 1
{backend}checkpointing: {{ interval: 1s, timeout: 60s }}
sources:
  - name: src
    uid: src
    generator: {{ count: {records}, fields: [ {{ name: seq, sequence: {{}} }} ] }}
operators:
  - {{ name: keyed, map: {{ fields: {{ key: "seq % {KEYS}" }} }} }}
  - {{ name: by-key, keyBy: {{ fields: [key] }} }}
  - {{ name: counts, uid: counts, aggregate: {{ aggregates: [ {{ fn: count, as: n }} ] }} }}
  - {{ name: seconds, filter: {{ expr: "n == 2" }} }}
sinks:
  - {{ name: out, uid: out, file: {{ path: {out}/counts }} }}
"#,
        records = KEYS + SECOND,
        out = out.display()
    )
}

#[test]
#[ignore = "run in release by .ci/run (cargo test --release ... -- --ignored): ten times slower in a debug build"]
fn state_five_times_the_memory_limit_completes_on_rocksdb_exactly_once() {
    // What the job needs on the heap backend, without a limit.
    let (_heap_dir, heap_out, _) = workdir("large-state-heap");
    let unlimited = MemoryCgroup::new("unlimited", None);
    let (status, heap_peak, heap_time) = run(&unlimited, &job(&heap_out, false), heap_out.parent().unwrap());
    assert!(status.success(), "the heap run without a limit failed: {status}");
    let limit = heap_peak / 5;
    eprintln!(
        "heap backend: peak RSS {} MiB in {heap_time:?}; the limit is a fifth: {} MiB",
        heap_peak >> 20,
        limit >> 20
    );
    assert!(heap_peak > 300 << 20, "the heap run's state should be hundreds of MiB, it peaked at {heap_peak} bytes");

    // The rocksdb backend under that limit completes, exactly once.
    let (_dir, out, _) = workdir("large-state-rocksdb");
    let limited = MemoryCgroup::new("rocksdb", Some(limit));
    let (status, peak, time) = run(&limited, &job(&out, true), out.parent().unwrap());
    eprintln!(
        "rocksdb backend under {} MiB: {status}, peak RSS {} MiB (with pages of the binary and libraries \
         charged elsewhere), cgroup peak {} MiB, in {time:?}",
        limit >> 20,
        peak >> 20,
        limited.peak() >> 20
    );
    assert!(status.success() && !limited.oom_killed(), "the rocksdb run under the limit failed: {status}");
    assert_second_counts_exactly_once(&out, SECOND);

    // The heap backend under the same limit is killed: the limit holds the state's size.
    let (_dir2, out2, _) = workdir("large-state-heap-limited");
    let limited_heap = MemoryCgroup::new("heap", Some(limit));
    let (status, _, _) = run(&limited_heap, &job(&out2, false), out2.parent().unwrap());
    assert!(!status.success() && limited_heap.oom_killed(), "the heap backend fit in a fifth of its memory: {status}");
}

/// Keys of the restore test, each 200 bytes: the state is about 650 MB.
const BIG_KEYS: u64 = 3_000_000;
/// Keys `0..BIG_SECOND` are counted twice.
const BIG_SECOND: u64 = 300_000;
/// The memory limit of both runs of the restore test. The job needs about 260 MiB of
/// anonymous memory with these keys (135 MiB with 20-byte keys), mostly the changed entries of
/// the checkpoints in flight; at 320 MiB the first run was OOM-killed once in four.
const RESTORE_LIMIT: u64 = 384 << 20;

fn big_keys_job(out: &Path) -> String {
    let padding = "x".repeat(190);
    format!(
        r#"name: large-checkpoint
parallelism: 1
stateBackend: rocksdb
stateCacheEntries: 100000
checkpointing: {{ interval: 1s, timeout: 120s }}
sources:
  - name: src
    uid: src
    generator: {{ count: {records}, fields: [ {{ name: seq, sequence: {{}} }} ] }}
operators:
  - {{ name: keyed, map: {{ fields: {{ key: "string(seq % {BIG_KEYS}) + '-{padding}'" }} }} }}
  - {{ name: by-key, keyBy: {{ fields: [key] }} }}
  - {{ name: counts, uid: counts, aggregate: {{ aggregates: [ {{ fn: count, as: n }} ] }} }}
  - {{ name: seconds, filter: {{ expr: "n == 2" }} }}
  - {{ name: short, map: {{ fields: {{ key: "key.split('-')[0]", n: "n" }} }} }}
sinks:
  - {{ name: out, uid: out, file: {{ path: {out}/counts }} }}
"#,
        records = BIG_KEYS + BIG_SECOND,
        out = out.display()
    )
}

#[test]
#[ignore = "run in release by .ci/run (cargo test --release ... -- --ignored): ten times slower in a debug build"]
fn a_checkpoint_larger_than_the_memory_limit_restores_on_rocksdb_exactly_once() {
    // The job is killed once its newest checkpoint holds more keyed state than the memory
    // limit, then restored from it under the same limit: the restore must not hold the
    // checkpoint in memory (it used to read every file of the chain into memory first).
    let (_dir, out, _) = workdir("large-checkpoint");
    let dir = out.parent().unwrap().to_path_buf();
    let yaml = big_keys_job(&out);
    let first = MemoryCgroup::new("checkpoint-1", Some(RESTORE_LIMIT));
    let chain_when_killed = std::cell::Cell::new(0);
    let (status, _, time) = run_until(&first, &yaml, &dir, &[], |chk| {
        let bytes = newest_chain_bytes(chk);
        chain_when_killed.set(bytes);
        bytes > RESTORE_LIMIT * 5 / 4
    });
    let chain = chain_when_killed.get();
    eprintln!(
        "first run under {} MiB: {status} after {time:?}, newest checkpoint's keyed state {} MiB, cgroup peak {} MiB",
        RESTORE_LIMIT >> 20,
        chain >> 20,
        first.peak() >> 20
    );
    assert!(!first.oom_killed(), "the first run ran out of memory");
    assert!(
        !status.success() && chain > RESTORE_LIMIT,
        "the job must be killed with a checkpoint larger than the limit (it ended with {status}, {chain} bytes)"
    );

    let second = MemoryCgroup::new("checkpoint-2", Some(RESTORE_LIMIT));
    let (status, _, time) = run_until(&second, &yaml, &dir, &["--restore", "latest"], |_| false);
    eprintln!(
        "restored run under {} MiB: {status} in {time:?}, cgroup peak {} MiB",
        RESTORE_LIMIT >> 20,
        second.peak() >> 20
    );
    assert!(status.success() && !second.oom_killed(), "the restored run under the limit failed: {status}");

    // Every key's second count exactly once, over both runs' committed output: a count lost
    // with the restored state would show as a missing key.
    assert_second_counts_exactly_once(&out, BIG_SECOND);
}
