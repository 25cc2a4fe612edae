//! What the tests of state under a memory limit share: a memory cgroup of their own, runs of
//! `weir-runtime` in it (killed when a condition holds), the newest checkpoint's keyed state,
//! and the check of their jobs' output (each of keys `0..second` counted twice, its second
//! count exactly once).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::common::committed;

/// Checks the committed output of a job that counted keys `0..second` twice: each of those
/// keys' second count exactly once, and nothing else.
pub fn assert_second_counts_exactly_once(out: &Path, second: u64) {
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
pub struct MemoryCgroup {
    dir: PathBuf,
    v2: bool,
}

impl MemoryCgroup {
    pub fn new(name: &str, limit: Option<u64>) -> Self {
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
    pub fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(format!("echo $$ > {}/cgroup.procs && exec \"$0\" \"$@\"", self.dir.display()))
            .arg(env!("CARGO_BIN_EXE_weir-runtime"))
            .args(args);
        cmd
    }

    /// The most memory charged to the cgroup (what the limit is enforced on).
    pub fn peak(&self) -> u64 {
        let file = if self.v2 { "memory.peak" } else { "memory.max_usage_in_bytes" };
        std::fs::read_to_string(self.dir.join(file)).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
    }

    /// Whether the kernel's OOM killer acted in this cgroup.
    pub fn oom_killed(&self) -> bool {
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
pub fn run(cgroup: &MemoryCgroup, yaml: &str, dir: &Path) -> (ExitStatus, u64, Duration) {
    run_until(cgroup, yaml, dir, &[], |_| false)
}

/// Like [`run`], with `extra` arguments, and SIGKILLed as soon as `kill_when` (polled with the
/// job's checkpoint directory) holds.
pub fn run_until(
    cgroup: &MemoryCgroup,
    yaml: &str,
    dir: &Path,
    extra: &[&str],
    kill_when: impl Fn(&Path) -> bool,
) -> (ExitStatus, u64, Duration) {
    run_in_root_until(cgroup, yaml, dir, &dir.join("state"), extra, kill_when)
}

/// [`run_until`] with the job's checkpoints under `chk` instead of `dir/state`.
pub fn run_in_root_until(
    cgroup: &MemoryCgroup,
    yaml: &str,
    dir: &Path,
    chk: &Path,
    extra: &[&str],
    kill_when: impl Fn(&Path) -> bool,
) -> (ExitStatus, u64, Duration) {
    let job_file = dir.join("job.yaml");
    std::fs::write(&job_file, yaml).unwrap();
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
        if kill_when(chk) {
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

/// The directory of the newest complete checkpoint under the job root `chk`.
pub fn newest_checkpoint(chk: &Path) -> Option<PathBuf> {
    let dirs = std::fs::read_dir(chk.join("checkpoints")).ok()?;
    let newest = dirs
        .flatten()
        .filter_map(|d| weir_checkpoint::layout::parse_checkpoint_dir(&d.file_name().to_string_lossy()))
        .filter(|id| {
            let dir = weir_checkpoint::layout::checkpoint_dir(*id);
            chk.join(dir).join(weir_checkpoint::layout::METADATA).exists()
        })
        .max()?;
    Some(chk.join(weir_checkpoint::layout::checkpoint_dir(newest)))
}

/// The files of the `counts` operator's chains (every subtask's) in `chk`'s newest complete
/// checkpoint; none when there is none.
fn newest_counts_chain(chk: &Path) -> Vec<weir_checkpoint::FileRef> {
    let Some(newest) = newest_checkpoint(chk) else { return Vec::new() };
    let Ok(m) = std::fs::read(newest.join(weir_checkpoint::layout::METADATA))
        .map_err(|_| ())
        .and_then(|b| weir_checkpoint::CheckpointMetadata::decode(&b).map_err(|_| ()))
    else {
        return Vec::new();
    };
    m.operators.get("counts").map_or(Vec::new(), |op| op.subtasks.iter().flat_map(|s| s.keyed_state.clone()).collect())
}

/// The paths of the files of the `counts` operator's chains in `chk`'s newest checkpoint.
pub fn newest_chain_files(chk: &Path) -> Vec<String> {
    newest_counts_chain(chk).into_iter().map(|f| f.path).collect()
}

/// Bytes of the newest complete checkpoint's keyed state of `counts` (its whole chain).
pub fn newest_chain_bytes(chk: &Path) -> u64 {
    newest_counts_chain(chk).iter().map(|f| f.len).sum()
}
