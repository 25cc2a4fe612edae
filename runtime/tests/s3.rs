//! Checkpoint storage and the file sink on a real S3-compatible server (`s3s-fs`, installed by
//! `.ci/install-tools.sh`), started by the tests on a loopback port.

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use weir_checkpoint::Storage;

const BUCKET: &str = "weir-test";

struct S3Server {
    _child: Child,
    endpoint: String,
}

fn s3s_binary() -> String {
    if let Ok(b) = std::env::var("WEIR_S3S_BIN") {
        return b;
    }
    let home = std::env::var("HOME").unwrap_or_default();
    let default = format!("{home}/.cache/weir/tools/bin/s3s-fs");
    assert!(
        std::path::Path::new(&default).exists(),
        "s3s-fs not found: run `bash .ci/install-tools.sh` (or set WEIR_S3S_BIN)"
    );
    default
}

/// One server per test process; the AWS_* variables point object_store at it.
fn server() -> &'static S3Server {
    static SERVER: OnceLock<S3Server> = OnceLock::new();
    SERVER.get_or_init(|| {
        // Kept past this process (statics are never dropped): the watchdog below removes it.
        let root = tempfile::tempdir().unwrap().keep();
        std::fs::create_dir(root.join(BUCKET)).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        // A shell watches this test process and, when it is gone, stops the server and removes
        // its files (statics are never dropped, so nothing else would: every run left its
        // bucket, up to 100 MB, in the temporary directory).
        let watchdog = concat!(
            r#"parent=$1; root=$2; shift 2; "$@" & server=$!; "#,
            r#"while kill -0 "$parent" 2>/dev/null; do sleep 0.2; done; "#,
            r#"kill "$server"; wait "$server"; rm -rf "$root""#
        );
        let child = Command::new("sh")
            .args(["-c", watchdog, "sh", &std::process::id().to_string()])
            .arg(&root)
            .arg(s3s_binary())
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--access-key",
                "weirtest",
                "--secret-key",
                "weirtestsecret",
            ])
            .arg(&root)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("s3s-fs starts");
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "s3s-fs did not listen on {port}");
            std::thread::sleep(Duration::from_millis(20));
        }
        let endpoint = format!("http://127.0.0.1:{port}");
        for (k, v) in s3_env(&endpoint) {
            std::env::set_var(k, v);
        }
        S3Server { _child: child, endpoint }
    })
}

fn s3_env(endpoint: &str) -> Vec<(&'static str, String)> {
    vec![
        ("AWS_ACCESS_KEY_ID", "weirtest".into()),
        ("AWS_SECRET_ACCESS_KEY", "weirtestsecret".into()),
        ("AWS_REGION", "us-east-1".into()),
        ("AWS_ENDPOINT", endpoint.to_string()),
        ("AWS_ALLOW_HTTP", "true".into()),
    ]
}

#[tokio::test(flavor = "multi_thread")]
async fn storage_operations_on_s3() {
    server();
    let s = Storage::open(&format!("s3://{BUCKET}/unit")).unwrap();
    s.put("checkpoints/chk-1/_metadata.inprogress", Bytes::from_static(b"m")).await.unwrap();
    s.rename("checkpoints/chk-1/_metadata.inprogress", "checkpoints/chk-1/_metadata").await.unwrap();
    s.put("checkpoints/chk-2/op/0.state", Bytes::from_static(b"abc")).await.unwrap();
    assert_eq!(s.list_dirs("checkpoints").await.unwrap(), vec!["chk-1", "chk-2"]);
    assert_eq!(s.size("checkpoints/chk-2/op/0.state").await.unwrap(), Some(3));
    assert_eq!(&s.get("checkpoints/chk-1/_metadata").await.unwrap()[..], b"m");
    assert!(s.size("checkpoints/chk-1/_metadata.inprogress").await.unwrap().is_none());
    s.delete_dir("checkpoints/chk-2").await.unwrap();
    assert_eq!(s.list_dirs("checkpoints").await.unwrap(), vec!["chk-1"]);
    assert_eq!(weir_checkpoint::recovery::highest_id(&s).await.unwrap(), 1);
}

/// A full image larger than memory is streamed from local disk in parts (multipart upload):
/// 20 MiB, over two 8 MiB parts, comes back byte for byte, on S3 and on a local directory.
#[tokio::test(flavor = "multi_thread")]
async fn a_local_file_is_streamed_to_storage_byte_for_byte() {
    server();
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("image.wst");
    let data: Vec<u8> = (0..20u64 << 20).map(|i| (weir_runtime::value::mix64(i) >> 7) as u8).collect();
    std::fs::write(&local, &data).unwrap();
    std::fs::create_dir(dir.path().join("store")).unwrap();
    for url in [format!("s3://{BUCKET}/streamed"), dir.path().join("store").display().to_string()] {
        let s = Storage::open(&url).unwrap();
        s.put_file("shared/op/full.state", &local).await.unwrap();
        assert_eq!(s.size("shared/op/full.state").await.unwrap(), Some(data.len() as u64), "{url}");
        assert!(s.get("shared/op/full.state").await.unwrap() == data, "{url}: the object differs from the file");
    }
}

/// A large object is fetched from the server as ranges at once, written into one buffer with
/// the parts' checksums combined: it comes back byte for byte with the checksum of its bytes,
/// whether its ranges divide it or not; said to be a byte longer or shorter than it is, it is
/// read whole (the restore's check of the length then refuses it).
#[tokio::test(flavor = "multi_thread")]
async fn a_large_object_read_as_ranges_is_its_bytes_and_checksum() {
    use weir_checkpoint::store::{GET_RANGE_BYTES, RANGED_GET_FROM};
    server();
    let s = Storage::open(&format!("s3://{BUCKET}/ranged")).unwrap();
    let longest = 3 * GET_RANGE_BYTES as usize + 4_321;
    let data: Vec<u8> = (0..longest as u64).map(|i| (weir_runtime::value::mix64(i) >> 11) as u8).collect();
    for len in [RANGED_GET_FROM as usize, longest] {
        let name = format!("shared/op/{len}.state");
        s.put(&name, Bytes::copy_from_slice(&data[..len])).await.unwrap();
        for said in [len, len - 1, len + 1] {
            let (read, crc) = s.get_with_crc32c(&name, said as u64).await.unwrap();
            assert!(read == data[..len], "{len} bytes said to be {said}: the object's bytes");
            assert_eq!(crc, crc32c::crc32c(&data[..len]), "{len} bytes said to be {said}");
        }
        // Read as ranges indeed when said right; not when said wrong.
        let ranged = s.get_in_ranges(&name, len as u64).await.unwrap();
        assert!(ranged.is_some_and(|(read, crc)| read == data[..len] && crc == crc32c::crc32c(&read)), "{len}");
        for said in [len - 1, len + 1] {
            assert!(!matches!(s.get_in_ranges(&name, said as u64).await, Ok(Some(_))), "{len} said to be {said}");
        }
    }
}

#[test]
fn checkpoints_and_exactly_once_output_on_s3_survive_sigkill() {
    sigkill_campaign_on_s3("on-s3", false, &[]);
}

/// The rocksdb backend with full images merged in the background: its restores fetch the
/// merged images' table files from the S3 server behind the job, a read waiting for the table
/// of its key.
#[test]
fn rocksdb_state_and_its_table_files_on_s3_survive_sigkill() {
    let restores_with_tables = sigkill_campaign_on_s3("rocks-on-s3", true, &[]);
    assert!(restores_with_tables > 0, "no restore found a merged image's table files (with first keys) on S3");
}

/// The test job on the S3 server (8,000 records at `rate` per second; on the rocksdb backend
/// with full images merged in the background, or the heap backend), with the output of an
/// undisturbed run to compare with.
struct S3Job {
    golden: std::collections::BTreeMap<String, Vec<String>>,
    /// Output and checkpoint URLs.
    out: String,
    chk: String,
    job_file: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl S3Job {
    fn new(name: &str, rocksdb: bool, rate: u64) -> S3Job {
        let mut p = JobParams::new(name);
        p.count = 8_000;
        p.background_merges = rocksdb;
        let golden = golden_output(&p);
        p.rate = Some(rate);
        let out = format!("s3://{BUCKET}/out-{name}");
        let chk = format!("s3://{BUCKET}/jobs/{name}");
        let dir = tempfile::tempdir().unwrap();
        let job_file = dir.path().join("job.yaml");
        let mut yaml = job_yaml(&p, std::path::Path::new(&out));
        if rocksdb {
            yaml.push_str("stateBackend: rocksdb\nstateCacheEntries: 100\n");
        }
        std::fs::write(&job_file, yaml).unwrap();
        S3Job { golden, out, chk, job_file, _dir: dir }
    }
}

/// Runs a job on the S3 server, SIGKILLed at random moments and restarted with `--restore
/// latest` (on the rocksdb backend at half the rate: its first kill waits for a merged image),
/// and checks its committed output record by record against an undisturbed run's;
/// returns how many restarts restored from a checkpoint that lists table files with their
/// first keys (a lazy restore). `args` go to each run's command line.
fn sigkill_campaign_on_s3(name: &str, rocksdb: bool, args: &[&str]) -> u64 {
    let srv = server();
    let S3Job { golden, out, chk, job_file, _dir } = S3Job::new(name, rocksdb, if rocksdb { 2_000 } else { 4_000 });
    let storage = Storage::open(&chk).unwrap();
    // Whether checkpoint `id` lists table files with their first keys: a restart from it
    // restores lazily, the tables fetched from the S3 server behind the job.
    let lists_tables = |id: u64| {
        let dir = weir_checkpoint::layout::checkpoint_dir(id);
        let metadata = weir_runtime::io().block_on(weir_checkpoint::recovery::read_metadata(&storage, &dir));
        metadata.ok().and_then(Result::ok).is_some_and(|m| {
            let mut tables = m.operators.values().flat_map(|o| &o.subtasks).flat_map(|s| &s.store_tables).peekable();
            tables.peek().is_some() && tables.all(|t| t.first_key_bytes().is_some_and(|k| !k.is_empty()))
        })
    };
    let restores_with_tables = std::cell::Cell::new(0);
    let report = kill_restart_loop(
        |round| {
            if round > 0 && lists_tables(newest_complete(&storage)) {
                restores_with_tables.set(restores_with_tables.get() + 1);
            }
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_weir-runtime"));
            cmd.args(["run", job_file.to_str().unwrap(), "--checkpoint-dir", &chk, "--restore", "latest", "--quiet"])
                .args(args)
                .envs(s3_env(&srv.endpoint));
            cmd
        },
        // On the rocksdb backend, until a restart has restored lazily, a run is killed only
        // once a checkpoint listing table files has completed: whether a background merge is
        // adopted before a kill at a random moment is up to the machine's speed, and a
        // campaign without one would not test the tables' fetching at all.
        || {
            let newest = newest_complete(&storage);
            let waiting_for_tables = rocksdb && restores_with_tables.get() == 0;
            if waiting_for_tables && !lists_tables(newest) {
                0
            } else {
                newest
            }
        },
        4,
    );
    let kills = report.kills;
    eprintln!("{name}: {report:?}, {} restores with table files", restores_with_tables.get());
    assert_same_output(
        &golden,
        &committed_at(&out, &["counts", "windows", "ids"]),
        &format!("{name}: S3 run with {kills} SIGKILLs"),
    );
    let listing = Command::new(env!("CARGO_BIN_EXE_weir-runtime"))
        .args(["checkpoints", &chk])
        .envs(s3_env(&srv.endpoint))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&listing.stdout);
    assert!(listing.status.success() && text.contains("yes"), "{text}{}", String::from_utf8_lossy(&listing.stderr));
    restores_with_tables.get()
}

/// A heap restore over its budget of files in memory (here any: `state_files_in_memory_max`
/// 0) downloads its files from the S3 server while it applies them, each verified as it is
/// read. Restored from a newest checkpoint whose largest keyed file had a byte flipped, the
/// damage is found as the file is read and recorded, and the restart takes an older
/// checkpoint; rescaled from two subtasks to three through a savepoint (three readers of
/// copies still downloading); SIGKILLed at random moments and restarted: each time the output
/// equals an undisturbed run's, record by record.
#[test]
fn heap_restores_download_from_s3_as_they_apply_exactly_once_and_find_damage_as_they_read() {
    use weir_runtime::executor::{JobOutcome, Request, RunOptions};
    let _ = server();
    let in_parts = |chk: &str| RunOptions {
        checkpoint_dir: Some(chk.to_string()),
        state_files_in_memory_max: Some(0),
        ..RunOptions::default()
    };
    let sinks = ["counts", "windows", "ids"];

    let name = "parts-damaged-s3";
    let mut p = JobParams::new(name);
    p.count = 8_000;
    let golden = golden_output(&p);
    p.rate = Some(4_000);
    let (out, chk) = (format!("s3://{BUCKET}/out-{name}"), format!("s3://{BUCKET}/jobs/{name}"));
    let yaml = job_yaml(&p, std::path::Path::new(&out));
    for round in 0..2 {
        let options = if round == 0 { in_parts(&chk) } else { in_parts(&chk).restore_latest() };
        let run = InProcess::start(&yaml, options);
        run.wait_for_checkpoints(4, Duration::from_secs(60));
        run.requests.send(Request::Cancel).unwrap();
        assert_eq!(run.join().0.unwrap(), JobOutcome::Cancelled);
    }
    let storage = Storage::open(&chk).unwrap();
    let (dir, _, victim) = damage_the_newest_checkpoints_largest_keyed_file(&storage);
    let (outcome, m) = run_to_end(&yaml, in_parts(&chk).restore_latest());
    assert_eq!(outcome, JobOutcome::Finished);
    assert_the_damage_was_found_as_read(&storage, &m, &dir, &victim);
    assert_same_output(&golden, &committed_at(&out, &sinks), "restored in parts from S3, the newest damaged");

    let name = "parts-rescale-s3";
    let mut p = JobParams::new(name);
    p.count = 8_000;
    let golden = golden_output(&JobParams { parallelism: 1, ..p.clone() });
    p.rate = Some(4_000);
    let (out, chk) = (format!("s3://{BUCKET}/out-{name}"), format!("s3://{BUCKET}/jobs/{name}"));
    let run = InProcess::start(&job_yaml(&p, std::path::Path::new(&out)), in_parts(&chk));
    run.wait_for_checkpoints(3, Duration::from_secs(60));
    run.request_savepoint(true, false);
    let JobOutcome::Stopped { savepoint } = run.join().0.unwrap() else { panic!("expected a stop with savepoint") };
    p.parallelism = 3;
    let (outcome, m) = run_to_end(&job_yaml(&p, std::path::Path::new(&out)), in_parts(&chk).restore_path(&savepoint));
    assert_eq!(outcome, JobOutcome::Finished);
    assert_eq!(m.board().restored_from.as_deref(), Some(savepoint.as_str()));
    assert_same_output(&golden, &committed_at(&out, &sinks), "rescaled 2 → 3 in parts from S3");

    sigkill_campaign_on_s3("parts-on-s3", false, &["--state-files-in-memory-max", "0"]);
}

/// A heap state of long values well within its budget of files in memory, restored from the
/// S3 server: its files are read in ranges as they are applied
/// (`weir_runtime::restore::STREAMED_FROM_BYTES_PER_KEY`), so a byte flipped in the newest
/// checkpoint is found as it is read, which fails the attempt, records the damage and restarts
/// from the checkpoint before (held in memory, the load would have skipped it before any
/// attempt: no restart); the output is exactly an undisturbed run's, record by record.
#[test]
fn long_values_restored_from_s3_within_the_budget_are_read_as_applied_exactly_once() {
    use weir_runtime::executor::{JobOutcome, Request, RunOptions};
    use weir_runtime::restore::KeyedFilesIn;
    let _ = server();
    let name = "long-values-s3";
    let yaml = |out: &str, rate: &str| {
        format!(
            // Every record a key of its own: a running max's outputs would otherwise depend on
            // the order a key's records come in, which the generator's rate changes.
            r#"name: {name}
parallelism: 2
maxParallelism: 64
checkpointing: {{ interval: 100ms, timeout: 10s, mode: exactly-once, retained: 3, fullEvery: 4 }}
restart: {{ strategy: fixed-delay, attempts: 1000, delay: 10ms }}
sources:
  - name: lines
    uid: lines
    generator:
      count: 6000
      {rate}
      fields:
        - {{ name: key, sequence: {{}} }}
        - {{ name: line, text: {{ words: 128, vocabulary: 1000 }} }}
operators:
  - {{ name: by-key, keyBy: {{ fields: [key] }} }}
  - {{ name: longest, uid: longest, aggregate: {{ aggregates: [ {{ fn: max, field: line, as: m }} ] }} }}
sinks:
  - {{ name: out, input: longest, uid: out, file: {{ path: {out}/out }} }}
"#
        )
    };
    let (_d, golden_out, golden_chk) = workdir(name);
    let (outcome, _) = run_to_end(&yaml(&golden_out.display().to_string(), ""), opts(&golden_chk));
    assert_eq!(outcome, JobOutcome::Finished);
    let golden = committed_at(&golden_out.display().to_string(), &["out"]);

    let (out, chk) = (format!("s3://{BUCKET}/out-{name}"), format!("s3://{BUCKET}/jobs/{name}"));
    let on_s3 = || RunOptions { checkpoint_dir: Some(chk.clone()), ..RunOptions::default() };
    let run = InProcess::start(&yaml(&out, "ratePerSecond: 3000"), on_s3());
    run.wait_for_checkpoints(6, Duration::from_secs(60));
    run.requests.send(Request::Cancel).unwrap();
    assert_eq!(run.join().0.unwrap(), JobOutcome::Cancelled);

    let storage = Storage::open(&chk).unwrap();
    let (dir, metadata, victim) = damage_the_newest_checkpoints_largest_keyed_file(&storage);
    let local = tempfile::tempdir().unwrap();
    let within_any_budget =
        KeyedFilesIn::MemoryUpTo { bytes: u64::MAX, dir: local.path().to_path_buf(), parallelism: Default::default() };
    assert!(
        matches!(within_any_budget.for_snapshot(&metadata, true), KeyedFilesIn::LocalReadOnce(_)),
        "long values from object storage are read as they are applied: {metadata:?}"
    );

    let (outcome, m) = run_to_end(&yaml(&out, "ratePerSecond: 3000"), on_s3().restore_latest());
    assert_eq!(outcome, JobOutcome::Finished);
    assert_the_damage_was_found_as_read(&storage, &m, &dir, &victim);
    assert_same_output(&golden, &committed_at(&out, &["out"]), "long values restored from S3 as read");
}

/// After a restore of the checkpoint `dir` whose file `victim` was damaged: the damage was found
/// as the file was read (by the first attempt, which failed: at least one restart), recorded
/// beside the file, and the run restored from another checkpoint.
fn assert_the_damage_was_found_as_read(
    storage: &Storage,
    m: &weir_runtime::metrics::JobMetrics,
    dir: &str,
    victim: &str,
) {
    assert!(m.restarts.get() >= 1, "the damage was found as the file was read, failing the first attempt");
    let record = weir_checkpoint::layout::damage_record(victim);
    assert!(weir_runtime::io().block_on(storage.get(&record)).is_ok(), "the damage of {victim} is recorded");
    let restored_from = m.board().restored_from.clone().unwrap_or_default();
    assert!(!restored_from.ends_with(dir), "{restored_from}: not the damaged checkpoint");
}

/// Flips a byte in the middle of the largest keyed state file of the newest complete checkpoint
/// in `storage`; that checkpoint's directory, its metadata and the damaged file's path.
fn damage_the_newest_checkpoints_largest_keyed_file(
    storage: &Storage,
) -> (String, weir_checkpoint::CheckpointMetadata, String) {
    let dir = weir_checkpoint::layout::checkpoint_dir(newest_complete(storage));
    let metadata =
        weir_runtime::io().block_on(weir_checkpoint::recovery::read_metadata(storage, &dir)).unwrap().unwrap();
    let largest = metadata
        .operators
        .values()
        .flat_map(|o| &o.subtasks)
        .flat_map(|s| &s.keyed_state)
        .max_by_key(|f| f.len)
        .unwrap();
    let victim = weir_checkpoint::layout::resolve(&dir, &largest.path);
    let mut bytes = weir_runtime::io().block_on(storage.get(&victim)).unwrap().to_vec();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    weir_runtime::io().block_on(storage.put(&victim, Bytes::from(bytes))).unwrap();
    (dir, metadata, victim)
}

/// A savepoint on the S3 server restored into another root, as a stateful upgrade does. Into a
/// root of the same bucket, the heap backend's first checkpoint has the server copy the
/// savepoint's files there and goes on with increments, instead of the task writing the whole
/// state again; into a local directory, where every byte would pass through the process (as
/// slow as reading them again: 59 s for 10.7 GB, past the checkpoint timeout), it writes a full
/// image as before. Either way, the savepoint deleted (as its owner may), the new root restores
/// on its own, and the output is exactly an undisturbed run's, record by record.
#[test]
fn a_savepoint_on_s3_restored_into_another_root_is_copied_there_by_the_server_and_that_root_stands_alone() {
    use weir_runtime::executor::{JobOutcome, Request, RunOptions};
    let _ = server();
    let local = tempfile::tempdir().unwrap();
    let sinks = ["counts", "windows", "ids"];
    let in_bucket = format!("s3://{BUCKET}/jobs/adopt-in-bucket-new");
    let to_local = local.path().join("new-root").display().to_string();
    for (name, new_root, copied) in [("adopt-in-bucket", in_bucket, true), ("adopt-to-local", to_local, false)] {
        let mut p = JobParams::new(name);
        p.count = 8_000;
        let golden = golden_output(&p);
        p.rate = Some(4_000);
        let (out, chk) = (format!("s3://{BUCKET}/out-{name}"), format!("s3://{BUCKET}/jobs/{name}"));
        // No periodic full image in the second run, which would replace the copies.
        let yaml = job_yaml(&p, std::path::Path::new(&out)).replace("fullEvery: 4", "fullEvery: 50");
        let options = |root: &str| RunOptions { checkpoint_dir: Some(root.to_string()), ..RunOptions::default() };
        let run = InProcess::start(&yaml, options(&chk));
        run.wait_for_checkpoints(3, Duration::from_secs(60));
        run.request_savepoint(true, false);
        let JobOutcome::Stopped { savepoint } = run.join().0.unwrap() else { panic!("{name}: not stopped") };
        let run = InProcess::start(&yaml, options(&new_root).restore_path(&savepoint));
        run.wait_for_checkpoints(3, Duration::from_secs(60));
        run.requests.send(Request::Cancel).unwrap();
        assert_eq!(run.join().0.unwrap(), JobOutcome::Cancelled);

        let storage = Storage::open(&new_root).unwrap();
        let dir = weir_checkpoint::layout::checkpoint_dir(newest_complete(&storage));
        let metadata =
            weir_runtime::io().block_on(weir_checkpoint::recovery::read_metadata(&storage, &dir)).unwrap().unwrap();
        let counts = &metadata.operators["user-counts"];
        assert!(
            counts.subtasks.iter().all(|s| s.keyed_state[0].path.contains("-adopted-") == copied),
            "{name}: the savepoint's chain should be adopted: {copied}; {:?}",
            counts.subtasks.iter().map(|s| &s.keyed_state).collect::<Vec<_>>()
        );
        let saved = Storage::open(&savepoint).unwrap();
        for f in weir_runtime::io().block_on(saved.list("")).unwrap() {
            weir_runtime::io().block_on(saved.delete(&f)).unwrap();
        }
        assert!(weir_runtime::io().block_on(saved.list("")).unwrap().is_empty(), "{name}: the savepoint is gone");
        let (outcome, m) = run_to_end(&yaml, options(&new_root).restore_latest());
        assert_eq!(outcome, JobOutcome::Finished);
        assert!(m.board().restored_from.as_deref().is_some_and(|r| r.starts_with(&new_root)), "{name}");
        assert_same_output(
            &golden,
            &committed_at(&out, &sinks),
            &format!("{name}: the savepoint adopted, then deleted"),
        );
    }
}

/// An increment ordered by key group is read from the S3 server a stretch at a time by a lazy
/// restore, after the job has started. One damaged in place (same length, the index intact,
/// so only its key group's checksum can tell) fails the attempt when its range loads; the
/// damage is recorded, the restart skips every checkpoint that needs the file, no checkpoint
/// completed on the damaged state in between, and the output is still exactly once.
#[test]
fn a_damaged_increment_found_after_a_lazy_restore_started_is_recorded_and_skipped_on_s3() {
    use weir_checkpoint::format::read_increment_index;
    use weir_checkpoint::layout;
    let srv = server();
    let name = "damaged-increment";
    let run = |job: &S3Job| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_weir-runtime"));
        cmd.args(["run", job.job_file.to_str().unwrap(), "--checkpoint-dir", &job.chk, "--restore", "latest"])
            .arg("--quiet")
            .envs(s3_env(&srv.endpoint));
        cmd
    };
    // The newest checkpoint's keyed increments ordered by key group after a merged image with
    // its table files: what a lazy restore leaves on the server.
    let stored_increments = |storage: &Storage, id: u64| -> Vec<String> {
        let dir = layout::checkpoint_dir(id);
        let Ok(Ok(m)) = weir_runtime::io().block_on(weir_checkpoint::recovery::read_metadata(storage, &dir)) else {
            return Vec::new();
        };
        m.operators
            .values()
            .flat_map(|o| &o.subtasks)
            .filter(|s| !s.store_tables.is_empty() && s.store_tables.iter().all(|t| t.first_key_bytes().is_some()))
            .flat_map(|s| s.keyed_state.iter().skip(1))
            // Written by this checkpoint, so that the one before it does not need it.
            .filter(|f| f.path.rsplit('/').next().and_then(layout::shared_file_creator) == Some(id))
            .map(|f| layout::resolve(&dir, &f.path))
            // With entries to damage: an increment of a subtask whose keys did not change
            // since the checkpoint before lists no key group.
            .filter(|path| {
                let data = weir_runtime::io().block_on(storage.get(path)).unwrap();
                data[4] == 4
                    && read_increment_index(&data[..], data.len() as u64)
                        .ok()
                        .flatten()
                        .is_some_and(|index| !index.key_groups.is_empty())
            })
            .collect()
    };
    // Run, killed once the newest checkpoint has such increments. Whether a background merge
    // is adopted before the job ends depends on how busy the machine is: a run that ended
    // without one is started again as a new job (a restore of a finished job writes nothing).
    let (job, storage, victim, newest) = 'found: {
        for attempt in 0..8 {
            let job = S3Job::new(&format!("{name}-{attempt}"), true, 1_000);
            let storage = Storage::open(&job.chk).unwrap();
            let mut child = run(&job).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
            let deadline = Instant::now() + Duration::from_secs(60);
            while Instant::now() < deadline && child.try_wait().unwrap().is_none() {
                std::thread::sleep(Duration::from_millis(50));
                if !stored_increments(&storage, newest_complete(&storage)).is_empty() {
                    break;
                }
            }
            let _ = child.kill();
            let _ = child.wait();
            let newest = newest_complete(&storage);
            if let Some(victim) = stored_increments(&storage, newest).pop() {
                break 'found (job, storage, victim, newest);
            }
            eprintln!("{name}: attempt {attempt} ended at checkpoint {newest} without such increments");
        }
        panic!("no checkpoint with increments ordered by key group after a merged image's tables");
    };
    // Flip one bit in the middle of the increment's first key group's entries.
    let data = weir_runtime::io().block_on(storage.get(&victim)).unwrap();
    let index = read_increment_index(&data[..], data.len() as u64).unwrap().unwrap();
    let first = index.key_groups[0];
    let mut damaged = data.to_vec();
    damaged[(first.offset + first.len / 2) as usize] ^= 0x08;
    weir_runtime::io().block_on(storage.put(&victim, Bytes::from(damaged))).unwrap();

    let finished = run(&job).output().unwrap();
    assert!(finished.status.success(), "{}", String::from_utf8_lossy(&finished.stderr));
    let record = layout::damage_record(&victim);
    let why = weir_runtime::io().block_on(storage.get(&record)).expect("the damage is recorded");
    let why = String::from_utf8_lossy(&why);
    assert!(why.contains(&format!("key group {}", first.key_group)), "{why}");
    assert_same_output(
        &job.golden,
        &committed_at(&job.out, &["counts", "windows", "ids"]),
        &format!("{name}: a restore of checkpoint {newest} found {victim} damaged"),
    );
}

#[test]
fn a_frozen_runtime_woken_after_its_replacement_started_is_fenced_on_s3() {
    let srv = server();
    zombie_scenario(
        "zombie-s3",
        &format!("s3://{BUCKET}/jobs/zombie"),
        &format!("s3://{BUCKET}/out-zombie"),
        &s3_env(&srv.endpoint),
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn epochs_are_claimed_create_only_on_s3() {
    server();
    let s = Storage::open(&format!("s3://{BUCKET}/epochs")).unwrap();
    let a = weir_checkpoint::epoch::claim_started(&s, "a", None).await.unwrap();
    let b = weir_checkpoint::epoch::claim_started(&s, "b", None).await.unwrap();
    assert_eq!((a, b), (1, 2));
    assert!(matches!(
        s.put_if_absent(&weir_checkpoint::layout::epoch_claim(2), Bytes::from_static(b"x")).await,
        Err(weir_checkpoint::StorageError::AlreadyExists(_))
    ));
    assert!(matches!(
        weir_checkpoint::epoch::check(&s, a).await,
        Err(weir_checkpoint::epoch::EpochError::Superseded { .. })
    ));
}
