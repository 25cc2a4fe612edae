//! State larger than memory: a keyed count over 15M keys (the first million of them updated a
//! second time at the end) runs under a cgroup memory limit of a fifth of what the same job
//! needs on the heap backend. On the rocksdb backend it must complete with each of those keys'
//! second counts in the output exactly once (each needs the key's first count, which by then
//! was evicted to disk); on the heap backend the same limit must kill it, which shows that the
//! limit is real. A heap state of long values, whose checkpoint is about as large as the
//! state, restores under the memory limit it ran in (its files read in parts), where holding
//! the files in memory next to the state is OOM-killed.
//!
//! Needs root and the cgroup memory controller (v1 as on these machines, or v2). `.ci/run`
//! runs it in release (`cargo test --release -p weir-runtime --test large_state -- --ignored`):
//! 16M records through a debug build's state code take about ten times as long as in release
//! (in release: about 100 s here, with the heap runs).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::*;

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

/// Checks the committed output of a job that counted keys `0..second` twice: each of those
/// keys' second count exactly once, and nothing else.
fn assert_second_counts_exactly_once(out: &Path, second: u64) {
    let lines = committed(out).remove("counts").expect("the sink wrote");
    let mut seen = vec![false; second as usize];
    let mut bad = Vec::new();
    for line in &lines {
        let fields: Vec<&str> = line.split(|c: char| !c.is_ascii_digit()).filter(|s| !s.is_empty()).collect();
        match fields.as_slice() {
            [key, "2"] => match key.parse::<usize>() {
                Ok(k) if k < seen.len() && !seen[k] => seen[k] = true,
                _ => bad.push(line.clone()),
            },
            _ => bad.push(line.clone()),
        }
    }
    let missing = seen.iter().filter(|s| !**s).count();
    assert!(
        bad.is_empty() && missing == 0,
        "every key's second count exactly once: {} unexpected or duplicate lines (first: {:?}), {missing} keys missing",
        bad.len(),
        bad.first()
    );
}

/// A memory cgroup of its own, removed when dropped.
struct MemoryCgroup {
    dir: PathBuf,
    v2: bool,
}

impl MemoryCgroup {
    fn new(name: &str, limit: Option<u64>) -> Self {
        let (root, v2) = if Path::new("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists() {
            (PathBuf::from("/sys/fs/cgroup/memory"), false)
        } else {
            (PathBuf::from("/sys/fs/cgroup"), true)
        };
        let dir = root.join(format!("weir-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir(&dir);
        std::fs::create_dir(&dir).unwrap_or_else(|e| {
            panic!("creating the memory cgroup {} (this test needs root and cgroups): {e}", dir.display())
        });
        if let Some(limit) = limit {
            let write = |file: &str, value: u64| {
                std::fs::write(dir.join(file), value.to_string())
                    .unwrap_or_else(|e| panic!("setting {file} of {}: {e}", dir.display()))
            };
            if v2 {
                write("memory.max", limit);
                write("memory.swap.max", 0);
            } else {
                write("memory.limit_in_bytes", limit);
                if dir.join("memory.memsw.limit_in_bytes").exists() {
                    write("memory.memsw.limit_in_bytes", limit);
                }
            }
        }
        MemoryCgroup { dir, v2 }
    }

    /// `weir-runtime` with `args`, started inside the cgroup.
    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(format!("echo $$ > {}/cgroup.procs && exec \"$0\" \"$@\"", self.dir.display()))
            .arg(env!("CARGO_BIN_EXE_weir-runtime"))
            .args(args);
        cmd
    }

    /// The most memory charged to the cgroup (what the limit is enforced on).
    fn peak(&self) -> u64 {
        let file = if self.v2 { "memory.peak" } else { "memory.max_usage_in_bytes" };
        std::fs::read_to_string(self.dir.join(file)).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
    }

    /// Whether the kernel's OOM killer acted in this cgroup.
    fn oom_killed(&self) -> bool {
        let (file, field) = if self.v2 { ("memory.events", "oom_kill") } else { ("memory.oom_control", "oom_kill") };
        std::fs::read_to_string(self.dir.join(file))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.strip_prefix(field)?.trim().parse::<u64>().ok())
            .any(|n| n > 0)
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Runs the job in `cgroup` to its end; its exit status and peak resident memory (bytes).
fn run(cgroup: &MemoryCgroup, yaml: &str, dir: &Path) -> (ExitStatus, u64, Duration) {
    run_until(cgroup, yaml, dir, &[], |_| false)
}

/// Like [`run`], with `extra` arguments, and SIGKILLed as soon as `kill_when` (polled with the
/// job's checkpoint directory) holds.
fn run_until(
    cgroup: &MemoryCgroup,
    yaml: &str,
    dir: &Path,
    extra: &[&str],
    kill_when: impl Fn(&Path) -> bool,
) -> (ExitStatus, u64, Duration) {
    let job_file = dir.join("job.yaml");
    std::fs::write(&job_file, yaml).unwrap();
    let chk = dir.join("state");
    let started = Instant::now();
    let mut child = cgroup
        .command(
            &[&["run", job_file.to_str().unwrap(), "--checkpoint-dir", chk.to_str().unwrap(), "--quiet"], extra]
                .concat(),
        )
        .env("TMPDIR", dir)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let status_file = format!("/proc/{}/status", child.id());
    let mut peak_kib = 0u64;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if kill_when(&chk) {
            child.kill().unwrap(); // SIGKILL
            break child.wait().unwrap();
        }
        // VmHWM only grows: the last reading before the exit is the peak, within 50 ms.
        if let Ok(s) = std::fs::read_to_string(&status_file) {
            if let Some(kib) = s
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            {
                peak_kib = peak_kib.max(kib);
            }
        }
        assert!(started.elapsed() < Duration::from_secs(900), "the job did not end in 15 minutes");
        std::thread::sleep(Duration::from_millis(50));
    };
    (status, peak_kib * 1024, started.elapsed())
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

/// Bytes of the newest complete checkpoint's keyed state of `counts` (its whole chain).
fn newest_chain_bytes(chk: &Path) -> u64 {
    let Ok(dirs) = std::fs::read_dir(chk.join("checkpoints")) else { return 0 };
    let newest = dirs
        .flatten()
        .filter_map(|d| weir_checkpoint::layout::parse_checkpoint_dir(&d.file_name().to_string_lossy()))
        .filter(|id| {
            let dir = weir_checkpoint::layout::checkpoint_dir(*id);
            chk.join(dir).join(weir_checkpoint::layout::METADATA).exists()
        })
        .max();
    let Some(id) = newest else { return 0 };
    let path = chk.join(weir_checkpoint::layout::checkpoint_dir(id)).join(weir_checkpoint::layout::METADATA);
    let Ok(m) = std::fs::read(path)
        .map_err(|_| ())
        .and_then(|b| weir_checkpoint::CheckpointMetadata::decode(&b).map_err(|_| ()))
    else {
        return 0;
    };
    m.operators.get("counts").map_or(0, |op| op.subtasks.iter().flat_map(|s| &s.keyed_state).map(|f| f.len).sum())
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
    let all_in_memory = ["--restore", "latest", "--restore-files-in-memory-max", "1000000000000"];
    let (status, peak, _) = run_until(&in_memory, &yaml, &dir, &all_in_memory, |_| false);
    eprintln!("restore holding its files in memory: {status}, peak RSS {} MiB", peak >> 20);
    assert!(!status.success() && in_memory.oom_killed(), "the files and the state fit in the limit: {status}");

    let second = MemoryCgroup::new("text-2", Some(TEXT_LIMIT));
    let (status, peak, time) = run_until(&second, &yaml, &dir, &["--restore", "latest"], |_| false);
    eprintln!("restored run (files in parts): {status} in {time:?}, peak RSS {} MiB", peak >> 20);
    assert!(status.success() && !second.oom_killed(), "the restored run under the limit failed: {status}");
    assert_second_counts_exactly_once(&out, TEXT_SECOND);
}
