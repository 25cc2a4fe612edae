//! Fencing at process level: two runtimes on one storage root, the older frozen and woken
//! after its replacement started (as a pod on a partitioned node would be). The stale one
//! stops with the fenced exit code; output stays exactly once. Frozen at a random moment, it
//! publishes nothing; stopped exactly between a fence check and the write it guards, what it
//! writes is outside the job's history and never restored. The random freeze on S3 is in
//! `s3.rs`.

mod common;

use std::time::{Duration, Instant};

#[test]
fn a_frozen_runtime_woken_after_its_replacement_started_is_fenced_on_local_storage() {
    let (_d, out, chk) = common::workdir("zombie");
    common::zombie_scenario("zombie", chk.to_str().unwrap(), out.to_str().unwrap(), &[]);
}

/// Whether process `pid` is stopped (state `T` in `/proc/<pid>/stat`).
fn stopped(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('T'))
}

/// Staged (not yet committed) output files of `epoch` for checkpoint `checkpoint`, in every sink.
fn staged_of(out: &str, epoch: u64, checkpoint: u64) -> usize {
    weir_runtime::io().block_on(async {
        let mut n = 0;
        for sink in ["counts", "windows", "ids"] {
            let s = weir_checkpoint::Storage::open(&format!("{out}/{sink}")).unwrap();
            for path in s.list("").await.unwrap() {
                let f = weir_runtime::sinks::file::parse_name(&format!("{sink}-out"), &path);
                n += usize::from(f.is_some_and(|f| f.staged && f.epoch == epoch && f.checkpoint == checkpoint));
            }
        }
        n
    })
}

/// One job file, storage root and output directory, and runtimes started on them.
struct Scene {
    _dirs: (tempfile::TempDir, tempfile::TempDir),
    job_file: std::path::PathBuf,
    out: String,
    chk: String,
    storage: weir_checkpoint::Storage,
    golden: std::collections::BTreeMap<String, Vec<String>>,
}

impl Scene {
    /// A job of 20,000 records at 4,000 a second, checkpointed every 100 ms.
    fn new(name: &str) -> Scene {
        let (work, out, chk) = common::workdir(name);
        let (out, chk) = (out.to_str().unwrap().to_string(), chk.to_str().unwrap().to_string());
        let mut p = common::JobParams::new(name);
        p.count = 20_000;
        let golden = common::golden_output(&p);
        p.rate = Some(4_000);
        let dir = tempfile::tempdir().unwrap();
        let job_file = dir.path().join("job.yaml");
        std::fs::write(&job_file, common::job_yaml(&p, std::path::Path::new(&out))).unwrap();
        let storage = weir_checkpoint::Storage::open(&chk).unwrap();
        Scene { _dirs: (work, dir), job_file, out, chk, storage, golden }
    }

    /// Starts a runtime on the scene (`--restore latest` when `restore`), with `WEIR_FAULTS`.
    fn run(&self, restore: bool, faults: Option<&str>) -> std::process::Child {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_weir-runtime"));
        cmd.args(["run", self.job_file.to_str().unwrap(), "--checkpoint-dir", &self.chk, "--quiet"]);
        if restore {
            cmd.args(["--restore", "latest"]);
        }
        if let Some(f) = faults {
            cmd.env("WEIR_FAULTS", f);
        }
        cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped()).spawn().unwrap()
    }

    fn newest_epoch(&self) -> u64 {
        weir_runtime::io().block_on(weir_checkpoint::epoch::newest(&self.storage)).unwrap()
    }

    /// The output committed so far, compared with the undisturbed run's, record by record.
    fn assert_exact(&self, what: &str) {
        common::assert_same_output(&self.golden, &common::committed_at(&self.out, &["counts", "windows", "ids"]), what);
    }
}

fn wait_for(what: &str, cond: &dyn Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn signal(sig: &str, pid: u32) {
    assert!(std::process::Command::new("kill").args([sig, &pid.to_string()]).status().unwrap().success())
}

/// The process's exit status within two minutes (killed after), and what it wrote to stderr.
fn finish(mut child: std::process::Child) -> (std::process::ExitStatus, String) {
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            break child.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    (status, err)
}

/// The narrowest window of the fence: run A passed its check for checkpoint 4 and stopped
/// before writing its `_metadata` (`stop-before-metadata=4`, deterministic). Run B started
/// meanwhile: it restored checkpoint 3, the newest complete one, and discarded what A had
/// staged for 4; it was killed before completing a checkpoint of its own. A, woken, writes
/// checkpoint 4's `_metadata` (its check had passed) and is fenced at its commit. Checkpoint 4
/// is outside the job's history (B restored 3): run C, `--restore latest`, must take 3, not 4,
/// whose staged output is gone (a restore of 4 fails to re-commit it and restarts forever),
/// and the output must be the undisturbed run's, record by record.
#[test]
fn a_checkpoint_published_between_a_stale_runs_fence_and_its_write_is_never_restored() {
    let scene = Scene::new("phantom");
    let a = scene.run(false, Some("stop-before-metadata=4"));
    wait_for("A to stop before checkpoint 4's _metadata", &|| stopped(a.id()));
    assert_eq!(common::newest_complete(&scene.storage), 3);
    let epoch_a = scene.newest_epoch();
    assert!(staged_of(&scene.out, epoch_a, 4) > 0, "A staged output for checkpoint 4 before it stopped");

    // B never completes a checkpoint (every upload fails), so nothing newer than 4 appears.
    let mut b = scene.run(true, Some("seed=1,upload=1"));
    wait_for("B to claim", &|| scene.newest_epoch() > epoch_a);
    wait_for("B to discard what A staged for 4", &|| staged_of(&scene.out, epoch_a, 4) == 0);
    let _ = b.kill();
    let _ = b.wait();

    signal("-CONT", a.id());
    let (status_a, err) = finish(a);
    assert_eq!(status_a.code(), Some(3), "A must exit as fenced: {err}");
    weir_runtime::io().block_on(async {
        let listed = weir_checkpoint::recovery::list_checkpoints(&scene.storage).await.unwrap();
        let (_, verdict, meta) = listed.iter().find(|(id, _, _)| *id == 4).expect("checkpoint 4 is there");
        assert_eq!(meta.as_ref().map(|m| m.epoch), Some(epoch_a), "A published checkpoint 4 after B claimed");
        use weir_checkpoint::recovery::Verdict;
        let outside = matches!(verdict, Verdict::Invalid(why) if why.contains("not in the job's history"));
        assert!(outside, "{verdict:?}");
    });

    let (status_c, err) = finish(scene.run(true, None));
    assert!(status_c.success(), "C failed: {err}");
    scene.assert_exact("A stopped between its fence check and its _metadata write, B killed, C restored");
}

/// The other window: run A completed checkpoint 3 (its `_metadata` is written), passed the
/// fence check of its commit and stopped before any sink committed (`stop-before-commit=3`).
/// Run B restores checkpoint 3 (A's, in the history), commits what A staged for it and runs
/// to the end. A, woken, commits too late: what it renames is already published under the
/// same names, and it is fenced at its next check. The output is the undisturbed run's.
#[test]
fn a_commit_released_after_the_successor_recommitted_it_changes_nothing() {
    let scene = Scene::new("late-commit");
    let a = scene.run(false, Some("stop-before-commit=3"));
    wait_for("A to stop before committing checkpoint 3", &|| stopped(a.id()));
    let epoch_a = scene.newest_epoch();
    assert_eq!(common::newest_complete(&scene.storage), 3);
    assert!(staged_of(&scene.out, epoch_a, 3) > 0, "A staged output for checkpoint 3 and has not committed it");

    let (status_b, err) = finish(scene.run(true, None));
    assert!(status_b.success(), "B failed: {err}");
    assert_eq!(staged_of(&scene.out, epoch_a, 3), 0, "B committed what A staged for checkpoint 3");
    scene.assert_exact("B ran to the end while A was stopped before its commit");

    signal("-CONT", a.id());
    let (status_a, err) = finish(a);
    assert_eq!(status_a.code(), Some(3), "A must exit as fenced: {err}");
    scene.assert_exact("A released after B finished");
}
