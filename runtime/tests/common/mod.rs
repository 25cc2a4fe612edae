//! Helpers shared by the engine's integration tests: job files, in-process and out-of-process
//! runs, and record-by-record comparison of committed output.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use weir_runtime::executor::{run_job, JobError, JobOutcome, Request, RunOptions};
use weir_runtime::metrics::JobMetrics;

/// Settings of the test job.
#[derive(Clone, Debug)]
pub struct JobParams {
    pub name: String,
    pub parallelism: u32,
    pub count: u64,
    pub rate: Option<u64>,
    pub mode: &'static str,
    pub tolerable_failures: u32,
    /// Extra operator YAML appended after the standard ones (list items).
    pub extra_operators: String,
    /// Drop the dedupe branch (to test a removed stateful uid).
    pub without_dedupe: bool,
    /// Periodic full images merged in the background whatever the state's size
    /// (`backgroundFullImageAbove: 0`).
    pub background_merges: bool,
}

impl JobParams {
    pub fn new(name: &str) -> Self {
        JobParams {
            name: name.to_string(),
            parallelism: 2,
            count: 12_000,
            rate: None,
            mode: "exactly-once",
            tolerable_failures: 2,
            extra_operators: String::new(),
            without_dedupe: false,
            background_merges: false,
        }
    }
}

/// The test job: two sources; a running count per user, sliding windows per word with
/// count/sum/min/max, and a dedupe of ids; three exactly-once file sinks under `out`.
pub fn job_yaml(p: &JobParams, out: &Path) -> String {
    let rate = p.rate.map(|r| format!("ratePerSecond: {r}")).unwrap_or_default();
    let out = out.display();
    let dedupe_ops = if p.without_dedupe {
        String::new()
    } else {
        "  - { name: by-id, input: ids, keyBy: { fields: [id] } }\n  \
         - { name: unique-ids, uid: unique-ids, dedupe: {} }\n"
            .to_string()
    };
    let dedupe_sink = if p.without_dedupe {
        String::new()
    } else {
        format!("  - {{ name: ids-out, input: unique-ids, uid: ids-out, file: {{ path: {out}/ids }} }}\n")
    };
    let ids_source = if p.without_dedupe {
        String::new()
    } else {
        format!(
            "  - name: ids\n    uid: ids\n    generator:\n      count: {}\n      {rate}\n      \
             fields:\n        - {{ name: id, modulo: 3000 }}\n",
            p.count / 2
        )
    };
    let merges = if p.background_merges { "  backgroundFullImageAbove: 0\n" } else { "" };
    format!(
        r#"name: {name}
parallelism: {par}
maxParallelism: 64
checkpointing:
  interval: 100ms
  timeout: 10s
  mode: {mode}
  retained: 3
  tolerableFailures: {tol}
  fullEvery: 4
{merges}restart:
  strategy: fixed-delay
  attempts: 1000
  delay: 10ms
sources:
  - name: events
    uid: events
    generator:
      count: {count}
      {rate}
      timeStep: 1ms
      fields:
        - {{ name: seq, sequence: {{}} }}
        - {{ name: user, modulo: 500 }}
        - {{ name: word, word: {{ cardinality: 300 }} }}
        - {{ name: amount, uniform: {{ min: 1, max: 100 }} }}
{ids_source}operators:
  - {{ name: by-user, input: events, keyBy: {{ fields: [user] }} }}
  - name: user-counts
    uid: user-counts
    aggregate: {{ aggregates: [ {{ fn: count, as: n }} ] }}
  - {{ name: by-word, input: events, keyBy: {{ fields: [word] }} }}
  - name: word-windows
    uid: word-windows
    window:
      type: sliding
      size: 200ms
      slide: 100ms
      aggregates:
        - {{ fn: count, as: n }}
        - {{ fn: sum, field: amount, as: total }}
        - {{ fn: min, field: amount, as: lo }}
        - {{ fn: max, field: amount, as: hi }}
{dedupe_ops}{extra}sinks:
  - {{ name: counts-out, input: user-counts, uid: counts-out, file: {{ path: {out}/counts }} }}
  - {{ name: windows-out, input: word-windows, uid: windows-out, file: {{ path: {out}/windows }} }}
{dedupe_sink}"#,
        name = p.name,
        par = p.parallelism,
        mode = p.mode,
        tol = p.tolerable_failures,
        count = p.count,
        extra = p.extra_operators,
    )
}

/// Every committed line under each sink directory of `out`, sorted.
pub fn committed(out: &Path) -> BTreeMap<String, Vec<String>> {
    let mut result = BTreeMap::new();
    let Ok(dirs) = std::fs::read_dir(out) else { return result };
    for d in dirs.flatten() {
        let mut lines = Vec::new();
        for f in std::fs::read_dir(d.path()).unwrap().flatten() {
            let name = f.file_name().to_string_lossy().to_string();
            if name.starts_with('.') || name.starts_with('_') {
                continue;
            }
            lines.extend(std::fs::read_to_string(f.path()).unwrap().lines().map(str::to_string));
        }
        lines.sort();
        result.insert(d.file_name().to_string_lossy().to_string(), lines);
    }
    result
}

/// Asserts two outputs are identical record by record, explaining the difference.
pub fn assert_same_output(golden: &BTreeMap<String, Vec<String>>, got: &BTreeMap<String, Vec<String>>, what: &str) {
    assert_eq!(golden.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>(), "{what}: sinks differ");
    for (sink, expected) in golden {
        let actual = &got[sink];
        if expected == actual {
            continue;
        }
        let mut counts: BTreeMap<&str, i64> = BTreeMap::new();
        for l in expected {
            *counts.entry(l).or_default() += 1;
        }
        for l in actual {
            *counts.entry(l).or_default() -= 1;
        }
        let lost: Vec<_> = counts.iter().filter(|(_, c)| **c > 0).take(5).collect();
        let dup: Vec<_> = counts.iter().filter(|(_, c)| **c < 0).take(5).collect();
        panic!(
            "{what}: sink `{sink}` has {} records, golden {}; {} lost (e.g. {lost:?}), \
             {} duplicated or extra (e.g. {dup:?})",
            actual.len(),
            expected.len(),
            counts.values().filter(|c| **c > 0).count(),
            counts.values().filter(|c| **c < 0).count(),
        );
    }
}

/// Asserts nothing from `golden` is missing in `got` (at-least-once).
pub fn assert_no_loss(golden: &BTreeMap<String, Vec<String>>, got: &BTreeMap<String, Vec<String>>) {
    for (sink, expected) in golden {
        let actual: std::collections::BTreeSet<&String> = got[sink].iter().collect();
        let missing = expected.iter().filter(|l| !actual.contains(l)).count();
        assert_eq!(missing, 0, "sink `{sink}` lost {missing} records");
    }
}

/// A job run in this process, on its own thread.
pub struct InProcess {
    pub metrics: Arc<JobMetrics>,
    pub requests: Sender<Request>,
    handle: std::thread::JoinHandle<Result<JobOutcome, JobError>>,
}

impl InProcess {
    pub fn start(yaml: &str, opts: RunOptions) -> InProcess {
        let job = weir_runtime::load_job(yaml).expect("valid test job");
        let metrics = Arc::new(JobMetrics::new(&job.spec.name, "test"));
        let (tx, rx) = crossbeam_channel::unbounded();
        let m = metrics.clone();
        let handle = std::thread::spawn(move || run_job(&job, &opts, m, rx));
        InProcess { metrics, requests: tx, handle }
    }

    /// Waits until `n` checkpoints have completed in this run.
    pub fn wait_for_checkpoints(&self, n: u64, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.metrics.checkpoints_completed.get() < n {
            assert!(Instant::now() < deadline, "{n} checkpoints not complete within {timeout:?}");
            assert!(!self.handle.is_finished(), "job ended before {n} checkpoints");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Asks for a savepoint (a stop when `stop`) and waits until it is accepted; returns the
    /// request id.
    pub fn request_savepoint(&self, stop: bool, drain: bool) -> u64 {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.requests.send(Request::Savepoint { stop, drain, reply: tx }).unwrap();
        weir_runtime::io()
            .block_on(async { tokio::time::timeout(Duration::from_secs(10), rx).await })
            .expect("savepoint request accepted in time")
            .expect("savepoint request accepted")
    }

    pub fn join(self) -> (Result<JobOutcome, JobError>, Arc<JobMetrics>) {
        (self.handle.join().expect("job thread"), self.metrics)
    }
}

/// Runs a job to its end in this process.
pub fn run_to_end(yaml: &str, opts: RunOptions) -> (JobOutcome, Arc<JobMetrics>) {
    let (r, m) = InProcess::start(yaml, opts).join();
    (r.expect("job succeeds"), m)
}

/// A fresh directory for a test.
pub fn workdir(name: &str) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::Builder::new().prefix(&format!("weir-{name}-")).tempdir().unwrap();
    let out = dir.path().join("out");
    let chk = dir.path().join("state");
    (dir, out, chk)
}

pub fn opts(chk: &Path) -> RunOptions {
    RunOptions { checkpoint_dir: Some(chk.display().to_string()), ..RunOptions::default() }
}

/// Builders on [`RunOptions`].
pub trait RunOptionsExt {
    fn with_faults(self, plan: weir_runtime::faults::FaultPlan) -> Self;
    fn restore_latest(self) -> Self;
    fn restore_path(self, path: &str) -> Self;
}

impl RunOptionsExt for RunOptions {
    fn with_faults(mut self, plan: weir_runtime::faults::FaultPlan) -> Self {
        self.faults = Some(plan);
        self
    }
    fn restore_latest(mut self) -> Self {
        self.restore = Some(weir_runtime::executor::RestoreRequest::Latest);
        self
    }
    fn restore_path(mut self, path: &str) -> Self {
        self.restore = Some(weir_runtime::executor::RestoreRequest::Path(path.to_string()));
        self
    }
}

/// What a kill-and-restart loop did.
#[derive(Debug, Default)]
pub struct KillReport {
    pub kills: u64,
    pub aborts: u64,
    pub runs: u64,
}

/// Runs `make(round)` repeatedly: the first `kills` runs are SIGKILLed at a pseudo-random
/// moment after they made progress (a new complete checkpoint, read by `newest_complete`);
/// runs that abort themselves through the fault hook count as aborts; after that, a run must
/// finish with success.
pub fn kill_restart_loop(
    make: impl Fn(u64) -> std::process::Command,
    newest_complete: impl Fn() -> u64,
    kills: u64,
) -> KillReport {
    use std::io::Read;
    let mut report = KillReport::default();
    for round in 0..200u64 {
        report.runs += 1;
        let before = newest_complete();
        let mut child = make(round)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn weir-runtime");
        let must_finish = report.kills >= kills;
        let deadline = Instant::now() + Duration::from_secs(if must_finish { 180 } else { 60 });
        let mut progressed_at: Option<Instant> = None;
        let extra = Duration::from_millis(weir_runtime::value::mix64(round) % 400);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            assert!(Instant::now() < deadline, "run {round} neither progressed nor ended in time");
            if !must_finish {
                match progressed_at {
                    None if newest_complete() > before => progressed_at = Some(Instant::now()),
                    Some(t) if t.elapsed() >= extra => break None,
                    _ => {}
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        match status {
            Some(s) if s.success() => {
                assert!(
                    must_finish || report.kills > 0 || report.aborts > 0,
                    "the job finished before any kill: make it slower"
                );
                return report;
            }
            Some(s) => {
                let mut err = String::new();
                child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
                assert!(err.contains("injected fault: aborting"), "run {round} failed with {s}: {err}");
                report.aborts += 1;
            }
            None => {
                child.kill().unwrap(); // SIGKILL
                child.wait().unwrap();
                report.kills += 1;
            }
        }
    }
    panic!("no run finished: {report:?}");
}

/// The newest complete checkpoint id under a job's storage root (0 when none).
pub fn newest_complete(storage: &weir_checkpoint::Storage) -> u64 {
    weir_runtime::io()
        .block_on(weir_checkpoint::retention::scan(storage))
        .map(|found| found.iter().filter(|c| c.references.is_some()).map(|c| c.id).max().unwrap_or(0))
        .unwrap_or(0)
}

/// The committed output of an uninterrupted run of the test job (no rate limit).
pub fn golden_output(p: &JobParams) -> BTreeMap<String, Vec<String>> {
    let p = JobParams { rate: None, ..p.clone() };
    let (_d, out, chk) = workdir(&format!("{}-golden", p.name));
    let (outcome, m) = run_to_end(&job_yaml(&p, &out), opts(&chk));
    assert_eq!(outcome, JobOutcome::Finished);
    assert_eq!(m.restarts.get(), 0);
    let g = committed(&out);
    assert!(g.values().all(|v| !v.is_empty()), "every sink wrote something");
    g
}

/// Every committed line under `<url>/<sink>` for each sink, sorted: what a reader of the output
/// takes (names starting with `_` or `.`, and everything under such directories, excluded).
pub fn committed_at(url: &str, sinks: &[&str]) -> BTreeMap<String, Vec<String>> {
    weir_runtime::io().block_on(async {
        let mut out = BTreeMap::new();
        for sink in sinks {
            let storage = weir_checkpoint::Storage::open(&format!("{}/{sink}", url.trim_end_matches('/'))).unwrap();
            let mut lines = Vec::new();
            for path in storage.list("").await.unwrap() {
                if path.split('/').any(|seg| seg.starts_with('_') || seg.starts_with('.')) {
                    continue;
                }
                let data = storage.get(&path).await.unwrap();
                lines.extend(String::from_utf8(data.to_vec()).unwrap().lines().map(str::to_string));
            }
            lines.sort();
            out.insert(sink.to_string(), lines);
        }
        out
    })
}

/// The zombie scenario on any storage: runtime A runs, is frozen (SIGSTOP) after a few
/// checkpoints, B starts on the same storage root with `--restore latest` and runs on, then A
/// is woken (SIGCONT). A must stop with the fenced exit code (3) without publishing a
/// checkpoint or committing output past the point B restored, and B must finish with output
/// equal to an undisturbed run's.
pub fn zombie_scenario(name: &str, chk: &str, out: &str, env: &[(&'static str, String)]) {
    let mut p = JobParams::new(name);
    p.count = 20_000;
    let golden = golden_output(&p);
    p.rate = Some(4_000);
    let dir = tempfile::tempdir().unwrap();
    let job_file = dir.path().join("job.yaml");
    std::fs::write(&job_file, job_yaml(&p, std::path::Path::new(out))).unwrap();
    let storage = weir_checkpoint::Storage::open(chk).unwrap();
    let run = |restore: bool| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_weir-runtime"));
        cmd.args(["run", job_file.to_str().unwrap(), "--checkpoint-dir", chk, "--quiet"])
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())));
        if restore {
            cmd.args(["--restore", "latest"]);
        }
        cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped()).spawn().unwrap()
    };
    let wait_for = |what: &str, cond: &dyn Fn() -> bool| {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !cond() {
            assert!(Instant::now() < deadline, "{name}: timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    let mut a = run(false);
    wait_for("A's third checkpoint", &|| newest_complete(&storage) >= 3);
    let signal = |sig: &str, pid: u32| {
        assert!(std::process::Command::new("kill").args([sig, &pid.to_string()]).status().unwrap().success())
    };
    signal("-STOP", a.id());
    let epoch_a = weir_runtime::io().block_on(weir_checkpoint::epoch::newest(&storage)).unwrap();
    let restore_point = newest_complete(&storage);
    let mut b = run(true);
    wait_for("B's epoch", &|| weir_runtime::io().block_on(weir_checkpoint::epoch::newest(&storage)).unwrap() > epoch_a);
    wait_for("three checkpoints of B", &|| newest_complete(&storage) >= restore_point + 3);
    signal("-CONT", a.id());
    let deadline = Instant::now() + Duration::from_secs(60);
    let status_a = loop {
        if let Some(s) = a.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "{name}: the woken runtime A did not stop");
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(a.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert_eq!(status_a.code(), Some(3), "{name}: A must exit as fenced: {err}");
    assert!(err.contains("fenced"), "{err}");
    let status_b = b.wait().unwrap();
    assert!(status_b.success(), "{name}: B failed");
    // A wrote no checkpoint and committed no output past the point B restored.
    weir_runtime::io().block_on(async {
        for (id, _, meta) in weir_checkpoint::recovery::list_checkpoints(&storage).await.unwrap() {
            if let Some(m) = meta {
                assert!(
                    m.epoch != epoch_a || id <= restore_point,
                    "{name}: the stale runtime published checkpoint {id}"
                );
            }
        }
        for sink in ["counts", "windows", "ids"] {
            let s = weir_checkpoint::Storage::open(&format!("{out}/{sink}")).unwrap();
            for path in s.list("").await.unwrap() {
                if let Some(f) = weir_runtime::sinks::file::parse_name(&format!("{sink}-out"), &path) {
                    assert!(
                        f.staged || f.epoch != epoch_a || f.checkpoint <= restore_point,
                        "{name}: the stale runtime committed {path} after it was replaced"
                    );
                }
            }
        }
    });
    assert_same_output(
        &golden,
        &committed_at(out, &["counts", "windows", "ids"]),
        &format!("{name}: A frozen and woken while B ran"),
    );
}

/// Adds `n` to the suite-wide count of injected failures (`.ci/run` prints the total).
pub fn record_faults(n: u64) {
    use std::io::Write;
    let path = std::env::temp_dir().join("weir-injected-faults.log");
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path).unwrap();
    writeln!(f, "{n}").unwrap();
}

/// A directory of `files` input files for the file source, `lines` lines each, line `i` of file
/// `f` being `line(f, i)`; returns the temporary directory (keep it alive) and the input path.
pub fn input_files(
    name: &str,
    files: u64,
    lines: u64,
    line: impl Fn(u64, u64) -> String,
) -> (tempfile::TempDir, PathBuf) {
    let (d, _, _) = workdir(name);
    let input = d.path().join("input");
    std::fs::create_dir(&input).unwrap();
    for f in 0..files {
        let text: String = (0..lines).map(|i| line(f, i) + "\n").collect();
        std::fs::write(input.join(format!("part-{f}.txt")), text).unwrap();
    }
    (d, input)
}
