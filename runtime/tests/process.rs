//! The `weir-runtime` binary as users run it: killed with SIGKILL (and aborting itself between
//! checkpoint completion and commit) and restarted with `--restore latest` until it finishes,
//! it must commit exactly the golden output. Also: the control API with a token, the
//! `savepoint` and `checkpoints` commands, and validation errors with field paths.

mod common;

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_weir-runtime"))
}

#[allow(dead_code)]
fn wait_with_deadline(child: &mut Child, deadline: Instant) -> Option<std::process::ExitStatus> {
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

#[test]
fn sigkill_and_restart_with_restore_latest_until_done_is_exactly_once() {
    let mut p = JobParams::new("killed");
    p.count = 16_000;
    let golden = golden_output(&p);
    p.rate = Some(6_000);
    let (dir, out, chk) = workdir("killed");
    let job_file = dir.path().join("job.yaml");
    std::fs::write(&job_file, job_yaml(&p, &out)).unwrap();
    // Staging files a writer killed an hour ago left, in the checkpoint storage and in a
    // sink's output directory (where a reader of the directory takes it for output): the first
    // retention pass deletes them.
    let abandoned = [chk.join("checkpoints/shared/counts/0-3-1.kv#4242000001"), out.join("counts/part-0-1#4242000002")];
    for file in &abandoned {
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(file, b"half of it").unwrap();
        let an_hour_ago = std::time::SystemTime::now() - Duration::from_secs(3600);
        std::fs::File::options().write(true).open(file).unwrap().set_modified(an_hour_ago).unwrap();
    }
    let storage = weir_checkpoint::Storage::open(chk.to_str().unwrap()).unwrap();
    let report = kill_restart_loop(
        |round| {
            let mut cmd = bin();
            cmd.args([
                "run",
                job_file.to_str().unwrap(),
                "--checkpoint-dir",
                chk.to_str().unwrap(),
                "--restore",
                "latest",
                "--quiet",
            ]);
            // Some runs abort themselves after a checkpoint completes, before its commit.
            if round % 3 == 1 {
                cmd.env("WEIR_FAULTS", format!("seed={round},commit-abort=1,max=1"));
            }
            cmd
        },
        || newest_complete(&storage),
        6,
    );
    let (kills, aborts) = (report.kills, report.aborts);
    eprintln!("SIGKILLs: {kills}, self-aborts before commit: {aborts}, runs: {}", report.runs);
    assert!(aborts >= 1, "no run aborted between completion and commit");
    record_faults(kills + aborts);
    assert_same_output(&golden, &committed(&out), &format!("{kills} SIGKILLs and {aborts} aborts"));
    for file in &abandoned {
        assert!(!file.exists(), "{} is still there", file.display());
    }

    // The checkpoints command lists what is left and says it is valid.
    let listing = bin().args(["checkpoints", chk.to_str().unwrap()]).output().unwrap();
    let text = String::from_utf8_lossy(&listing.stdout);
    assert!(listing.status.success() && text.contains("yes"), "{text}");
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn control_api_requires_the_token_and_stop_with_savepoint_works() {
    let mut p = JobParams::new("controlled");
    p.count = 1_000_000;
    p.rate = Some(5_000);
    let (dir, out, chk) = workdir("controlled");
    let job_file = dir.path().join("job.yaml");
    std::fs::write(&job_file, job_yaml(&p, &out)).unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "s3cret-token\n").unwrap();
    let addr = format!("127.0.0.1:{}", free_port());
    let mut child = bin()
        .args([
            "run",
            job_file.to_str().unwrap(),
            "--checkpoint-dir",
            chk.to_str().unwrap(),
            "--control-addr",
            &addr,
            "--token-file",
            token_file.to_str().unwrap(),
            "--quiet",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let io = weir_runtime::io();
    let client = weir_client::ControlClient::new(&addr, Some("s3cret-token".into())).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    // Wait for the API and a first checkpoint.
    loop {
        assert!(Instant::now() < deadline, "no checkpoint within 30s");
        // While the process starts, connections may be refused: keep asking.
        if let Ok(Some(latest)) = io.block_on(client.latest_checkpoint()) {
            assert_eq!(latest.outcome, weir_crds::control::CheckpointOutcome::Completed);
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for token in [None, Some("wrong".to_string())] {
        let stranger = weir_client::ControlClient::new(&addr, token).unwrap();
        let err = io.block_on(stranger.job()).unwrap_err();
        assert_eq!(err.status(), Some(401), "{err}");
        assert!(err.to_string().contains("missing or wrong bearer token"), "a JSON error body: {err}");
        assert_eq!(io.block_on(stranger.metrics()).unwrap_err().status(), Some(401));
    }
    let open = weir_client::ControlClient::new(&addr, None).unwrap();
    io.block_on(open.healthz()).expect("/healthz needs no token");
    let job = io.block_on(client.job()).unwrap();
    assert_eq!(job.state, weir_crds::control::JobState::Running);
    assert_eq!(job.name, "controlled");
    assert!(job.records_in > 0, "{job:?}");
    let history = io.block_on(client.checkpoints()).unwrap();
    assert!(history.completed >= 1 && !history.checkpoints.is_empty(), "{history:?}");
    let metrics = io.block_on(client.metrics()).unwrap();
    assert!(metrics.contains("weir_checkpoints_completed_total{job=\"controlled\"}"), "{metrics}");
    assert!(metrics.contains("weir_checkpoint_duration_seconds_count{job=\"controlled\"}"), "{metrics}");
    assert!(!metrics.contains("s3cret"), "no secret in metrics");
    // A savepoint that does not stop the job, answered when it is done.
    let request = weir_crds::control::SavepointRequest { drain: false, wait: true };
    let taken = io.block_on(client.trigger_savepoint(&request)).unwrap();
    assert_eq!(taken.outcome, weir_crds::control::CheckpointOutcome::Completed, "{taken:?}");
    assert_eq!(io.block_on(client.savepoint(taken.request_id)).unwrap(), taken);
    let drain = weir_crds::control::SavepointRequest { drain: true, wait: false };
    let err = io.block_on(client.trigger_savepoint(&drain)).unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    assert_eq!(io.block_on(client.savepoint(999_999)).unwrap_err().status(), Some(404));

    let sp = bin().args(["savepoint", &addr, "--stop", "--token-file", token_file.to_str().unwrap()]).output().unwrap();
    assert!(sp.status.success(), "{}", String::from_utf8_lossy(&sp.stderr));
    let savepoint = String::from_utf8_lossy(&sp.stdout).trim().to_string();
    assert!(savepoint.contains("/savepoints/sp-"), "{savepoint}");
    let status =
        wait_with_deadline(&mut child, Instant::now() + Duration::from_secs(20)).expect("stops after the savepoint");
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    assert!(status.success(), "{status}: {stderr}");
    let mut stdout = String::new();
    child.stdout.take().unwrap().read_to_string(&mut stdout).unwrap();
    assert_eq!(stdout.trim(), savepoint, "run prints the savepoint it stopped with");
    assert!(std::path::Path::new(&savepoint).join("_metadata").exists());
}

#[test]
fn invalid_job_files_are_refused_with_field_paths() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("name: j\nsources: []\nsinks: []\n", "job.sources: at least one source is required"),
        (
            "name: j\nsources: [{name: s, uid: s, generator: {fields: [{name: a, sequence: {}}]}}]\n\
             operators: [{name: k, keyBy: {fields: [a]}}, \
             {name: w, uid: w, window: {type: tumbling, size: 0s, aggregates: [{fn: count, as: n}]}}]\n\
             sinks: [{name: o, stdout: {}}]\n",
            "job.operators[1].window.size: must be > 0",
        ),
        (
            "name: j\nsources: [{name: s, uid: s, generator: {fields: [{name: a, sequence: {}}]}}]\n\
             operators: [{name: k, keyBy: {fields: [a]}}, {name: c, aggregate: {aggregates: [{fn: count, as: n}]}}]\n\
             sinks: [{name: o, stdout: {}}]\n",
            "job.operators[1].uid: required",
        ),
        (
            "name: j\nsources: [{name: s, uid: s, generator: {fields: [{name: a, sequence: {}}]}}]\n\
             operators: [{name: f, filter: {expr: \"b > 1\"}}]\nsinks: [{name: o, stdout: {}}]\n",
            "job.operators[0].filter.expr: CEL expression `b > 1` uses `b`",
        ),
        ("name: j\ncheckpointing: {interval: fast}\nsources: []\nsinks: []\n", "job.checkpointing.interval"),
    ];
    for (i, (yaml, expected)) in cases.iter().enumerate() {
        let f = dir.path().join(format!("bad{i}.yaml"));
        std::fs::write(&f, yaml).unwrap();
        let o = bin().args(["validate", f.to_str().unwrap()]).output().unwrap();
        assert_eq!(o.status.code(), Some(2), "case {i}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(expected), "case {i}: expected `{expected}` in:\n{err}");
    }
    let ok =
        bin().args(["validate", concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/wordcount.yaml")]).output().unwrap();
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
}

/// Running a job a second time on the same storage used to start it fresh and delete the first
/// run's published output. Now it is refused, naming the newest valid restore point; `--fresh`
/// starts without state and keeps every earlier file; `--restore latest` continues.
#[test]
fn a_second_run_needs_restore_or_fresh_and_never_deletes_earlier_output() {
    let mut p = JobParams::new("twice");
    p.count = 2_000;
    let golden = golden_output(&p);
    let (dir, out, chk) = workdir("twice");
    let job_file = dir.path().join("job.yaml");
    std::fs::write(&job_file, job_yaml(&p, &out)).unwrap();
    let run = |extra: &[&str]| {
        bin()
            .args(["run", job_file.to_str().unwrap(), "--checkpoint-dir", chk.to_str().unwrap(), "--quiet"])
            .args(extra)
            .output()
            .unwrap()
    };
    let first = run(&[]);
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    let storage = weir_checkpoint::Storage::open(chk.to_str().unwrap()).unwrap();
    let epochs = || weir_runtime::io().block_on(storage.list(weir_checkpoint::layout::EPOCHS)).unwrap();
    let epochs_after_first = epochs();
    let snapshot = |out: &std::path::Path| -> std::collections::BTreeMap<std::path::PathBuf, Vec<u8>> {
        let mut files = std::collections::BTreeMap::new();
        for sink in std::fs::read_dir(out).unwrap().flatten() {
            for f in std::fs::read_dir(sink.path()).unwrap().flatten() {
                if f.file_name().to_string_lossy().starts_with("part-") {
                    files.insert(f.path(), std::fs::read(f.path()).unwrap());
                }
            }
        }
        files
    };
    let after_first = snapshot(&out);
    assert_same_output(&golden, &committed(&out), "first run");

    let second = run(&[]);
    let err = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(2), "{err}");
    assert!(
        err.contains("already holds this job's state")
            && err.contains("chk-")
            && err.contains("--restore latest")
            && err.contains("--fresh"),
        "{err}"
    );
    assert_eq!(snapshot(&out), after_first, "a refused run touches nothing");
    assert_eq!(epochs(), epochs_after_first, "nor claims an epoch (which would fence a run going on)");

    let fresh = run(&["--fresh"]);
    assert!(fresh.status.success(), "{}", String::from_utf8_lossy(&fresh.stderr));
    let after_fresh = snapshot(&out);
    for (f, bytes) in &after_first {
        assert_eq!(after_fresh.get(f), Some(bytes), "{} was deleted or changed by the fresh run", f.display());
    }
    let twice: std::collections::BTreeMap<String, Vec<String>> = golden
        .iter()
        .map(|(k, v)| {
            let mut d: Vec<String> = v.iter().flat_map(|l| [l.clone(), l.clone()]).collect();
            d.sort();
            (k.clone(), d)
        })
        .collect();
    assert_same_output(&twice, &committed(&out), "a fresh run adds its own output beside the first run's");

    let resumed = run(&["--restore", "latest"]);
    assert!(resumed.status.success(), "{}", String::from_utf8_lossy(&resumed.stderr));
    assert_eq!(snapshot(&out), after_fresh, "restoring a finished run changes nothing");
}

/// kubectl reads manifests as YAML 1.1, where `as: n` is `false`; the API server's refusal does
/// not say why. `validate` on the manifest names the value and the fix; quoted, it passes.
#[test]
fn a_manifest_with_yaml11_booleans_is_refused_naming_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let manifest = |as_name: &str| {
        format!(
            "apiVersion: weir.dev/v1alpha1\nkind: StreamJob\nmetadata: {{name: counts}}\nspec:\n  \
             image: weir-runtime:dev\n  job:\n    inline:\n      name: counts\n      sources:\n        \
             - {{name: s, uid: s, generator: {{count: 10, fields: [{{name: k, sequence: {{}}}}]}}}}\n      \
             operators:\n        - {{name: key, keyBy: {{fields: [k]}}}}\n        - name: c\n          \
             uid: c\n          aggregate: {{aggregates: [{{fn: count, as: {as_name}}}]}}\n      \
             sinks: [{{name: o, stdout: {{}}}}]\n"
        )
    };
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, manifest("n")).unwrap();
    let o = bin().args(["validate", bad.to_str().unwrap()]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains(
            "line 15: spec.job.inline.operators[1].aggregate.aggregates[0].as: `n` is the string \"n\" to Weir"
        ) && err.contains("the boolean false to kubectl (YAML 1.1); quote it: as: \"n\""),
        "{err}"
    );
    let good = dir.path().join("good.yaml");
    std::fs::write(&good, manifest("\"n\"")).unwrap();
    let o = bin().args(["validate", good.to_str().unwrap()]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("job `counts` is valid"));
    // The same job as a job file is YAML 1.2 to Weir: valid, with a warning for later.
    let job_file = dir.path().join("job.yaml");
    std::fs::write(
        &job_file,
        "name: counts\nsources: [{name: s, uid: s, generator: {count: 10, fields: [{name: k, sequence: {}}]}}]\n\
         operators: [{name: key, keyBy: {fields: [k]}},\
         {name: c, uid: c, aggregate: {aggregates: [{fn: count, as: n}]}}]\n\
         sinks: [{name: o, stdout: {}}]\n",
    )
    .unwrap();
    let o = bin().args(["validate", job_file.to_str().unwrap()]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("warning:") && err.contains("quote it: as: \"n\""), "{err}");
}

/// One traced system call: `fsync` of a path, or a rename.
#[derive(Debug)]
enum Traced {
    Fsync(String),
    Rename(String, String),
}

/// Parses `strace -f -y` lines: `PID fsync(7</dir/file>) = 0` and `PID rename("a", "b") = 0`
/// (or `renameat`/`renameat2` with `AT_FDCWD` arguments); failed calls are skipped. A call that
/// another thread interrupted (`<unfinished ...>`) counts where it completes (`<... resumed>`).
fn parse_strace(log: &str) -> Vec<Traced> {
    let quoted = |s: &str| -> Vec<String> { s.split('"').skip(1).step_by(2).map(str::to_string).collect() };
    let mut unfinished: std::collections::HashMap<String, String> = Default::default();
    let mut calls = Vec::new();
    for line in log.lines() {
        let (pid, call) = line.split_once(' ').unwrap_or(("", line));
        let call = call.trim_start();
        let call = match call.strip_suffix("<unfinished ...>") {
            Some(start) => {
                unfinished.insert(pid.to_string(), start.to_string());
                continue;
            }
            None if call.starts_with("<... ") => match (unfinished.remove(pid), call.split_once("resumed>")) {
                (Some(start), Some((_, end))) => format!("{start}{end}"),
                _ => continue,
            },
            None => call.to_string(),
        };
        if !call.trim_end().ends_with("= 0") {
            continue;
        }
        if let Some(rest) = call.strip_prefix("fsync(") {
            if let Some((_, path)) = rest.split_once('<') {
                if let Some((path, _)) = path.split_once('>') {
                    calls.push(Traced::Fsync(path.to_string()));
                }
            }
        } else if call.starts_with("rename") {
            let paths = quoted(&call);
            if paths.len() == 2 {
                calls.push(Traced::Rename(paths[0].clone(), paths[1].clone()));
            }
        }
    }
    calls
}

/// Local storage is durable before output is published: every published file's staged bytes
/// are fsynced before the rename that publishes it, and its directory after, as `strace` sees
/// the real process do it (a power loss can then never publish a file whose data is lost).
#[test]
fn published_files_are_fsynced_before_and_their_directory_after_the_rename() {
    let mut p = JobParams::new("fsync");
    p.count = 2_000;
    let (dir, out, chk) = workdir("fsync");
    let job_file = dir.path().join("job.yaml");
    std::fs::write(&job_file, job_yaml(&p, &out)).unwrap();
    let log = dir.path().join("strace.log");
    let run = Command::new("strace")
        .args(["-f", "-y", "-qq", "-e", "trace=fsync,rename,renameat,renameat2", "-o"])
        .arg(&log)
        .arg(env!("CARGO_BIN_EXE_weir-runtime"))
        .args(["run", job_file.to_str().unwrap(), "--checkpoint-dir", chk.to_str().unwrap(), "--quiet"])
        .output()
        .expect("strace runs (.ci/install-tools.sh installs it)");
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let calls = parse_strace(&std::fs::read_to_string(&log).unwrap());
    let mut published = 0;
    for sink in std::fs::read_dir(&out).unwrap().flatten() {
        for f in std::fs::read_dir(sink.path()).unwrap().flatten() {
            let name = f.file_name().to_string_lossy().to_string();
            if !name.starts_with("part-") {
                continue;
            }
            published += 1;
            let target = f.path().display().to_string();
            let at = calls
                .iter()
                .position(|c| matches!(c, Traced::Rename(_, to) if *to == target))
                .unwrap_or_else(|| panic!("{target} was not published by a rename"));
            let Traced::Rename(staged, _) = &calls[at] else { unreachable!() };
            assert!(staged.contains("/.part-"), "{target} published from {staged}");
            // Fsynced under its name, or under a name it was renamed from after the fsync
            // (local storage writes a staging file, syncs it, and renames it into place).
            let mut synced = std::collections::HashSet::new();
            for c in &calls[..at] {
                match c {
                    Traced::Fsync(p) => {
                        synced.insert(p.clone());
                    }
                    Traced::Rename(from, to) => {
                        if synced.remove(from) {
                            synced.insert(to.clone());
                        } else {
                            synced.remove(to);
                        }
                    }
                }
            }
            assert!(synced.contains(staged), "{staged} was not fsynced before its publish");
            let dir = sink.path().display().to_string();
            assert!(
                calls[at..].iter().any(|c| matches!(c, Traced::Fsync(p) if *p == dir)),
                "{dir} was not fsynced after {target} was published"
            );
        }
    }
    assert!(published >= 3, "every sink published: {published} files");
}
