//! Chaos campaigns against the `weir-runtime` binary: job shapes that stress every stateful
//! structure (event-time windows over keys that come and go, a multi-stage graph with a
//! different parallelism per stage and a dedupe, the file source, rescaling through
//! stop-with-savepoint, corrupt newest checkpoints) are SIGKILLed at random moments, some runs
//! abort themselves between a checkpoint's completion and its commit, and every run restarts
//! with `--restore latest`. Meanwhile a reader tails the output and fails the test the moment
//! a published file disappears or changes (a rewind may only move it under `_superseded/`).
//! At the end the committed output must equal an undisturbed run's, record by record (lost,
//! duplicated and unexpected all 0), and every published file must be listed, with its length
//! and CRC-32C, in a commit manifest.
//!
//! Each run picks the heap or the rocksdb state backend at random (the latter with a cache of
//! 100 entries, so most keys are on disk), so restores cross between the two backends.
//!
//! The campaign seed is printed; `WEIR_CHAOS_SEED=<seed>` replays the same kill schedule.
//! `WEIR_CHAOS_KILLS=<n>` sets the kills per campaign for a soak run (default: 70, 70 and 60,
//! plus as many as the file source lasts for: over 200 in all); the generated inputs grow with
//! it, so that the jobs last for that many kills.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use weir_runtime::value::mix64;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_weir-runtime"))
}

fn seed() -> u64 {
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *SEED.get_or_init(|| {
        let seed = std::env::var("WEIR_CHAOS_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
                % 1_000_000
        });
        eprintln!("chaos seed: {seed} (replay with WEIR_CHAOS_SEED={seed})");
        seed
    })
}

fn kills(default: u64) -> u64 {
    std::env::var("WEIR_CHAOS_KILLS").ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// How many times their usual input the generated jobs read: enough for the kills asked for
/// by `WEIR_CHAOS_KILLS` (the usual input is sized for about 70), so that a longer campaign is
/// not cut short by its input running out.
fn input_scale() -> u64 {
    kills(70).div_ceil(70).max(1)
}

/// A job shape: its YAML for an output directory, a rate (None: full speed) and a parallelism.
type JobYaml = Box<dyn Fn(&Path, Option<u64>, u32) -> String>;

struct Shape {
    name: &'static str,
    yaml: JobYaml,
}

const CHECKPOINTING: &str = "checkpointing: { interval: 40ms, timeout: 10s, retained: 3, \
                             fullEvery: 3, tolerableFailures: 10 }\n\
                             restart: { strategy: fixed-delay, attempts: 1000, delay: 10ms }\n";

fn rate_line(rate: Option<u64>) -> String {
    rate.map(|r| format!("ratePerSecond: {r}, ")).unwrap_or_default()
}

/// Event-time tumbling windows over sparse keys: each key gets a record every 97 ms of event
/// time, so its pane fires, the key leaves the state, and it comes back, many times between
/// two barriers; every 5,000 records the key space shifts.
fn sparse_windows() -> Shape {
    Shape {
        name: "sparse-windows",
        yaml: Box::new(|out, rate, parallelism| {
            format!(
                r#"name: chaos-windows
parallelism: {parallelism}
maxParallelism: 32
{CHECKPOINTING}sources:
  - name: events
    uid: events
    generator: {{ count: {count}, {rate}timeStep: 1ms,
                  fields: [ {{ name: seq, sequence: {{}} }}, {{ name: amount, uniform: {{ min: 1, max: 100 }} }} ] }}
operators:
  - {{ name: keyed, map: {{ fields: {{ key: "seq % 97 + (seq / 5000) % 3 * 1000", amount: "amount" }} }} }}
  - {{ name: by-key, keyBy: {{ fields: [key] }} }}
  - name: windows
    uid: windows
    window: {{ type: tumbling, size: 40ms,
               aggregates: [ {{ fn: count, as: n }}, {{ fn: sum, field: amount, as: total }},
                             {{ fn: max, field: amount, as: hi }} ] }}
sinks:
  - {{ name: out, uid: out, file: {{ path: {out}/windows }} }}
"#,
                count = 150_000 * input_scale(),
                rate = rate_line(rate),
                out = out.display()
            )
        }),
    }
}

/// Split, filter, map (CEL), keyBy into running counts at parallelism 3, keyBy into a dedupe
/// at parallelism 1, sinks at 2: every stage at its own parallelism.
fn pipeline() -> Shape {
    Shape {
        name: "pipeline",
        yaml: Box::new(|out, rate, parallelism| {
            format!(
                r#"name: chaos-pipeline
parallelism: {parallelism}
maxParallelism: 32
{CHECKPOINTING}sources:
  - name: lines
    uid: lines
    generator: {{ count: {count}, {rate}fields: [ {{ name: seq, sequence: {{}} }},
                                                {{ name: line, text: {{ words: 4, vocabulary: 300 }} }} ] }}
operators:
  - {{ name: words, flatMap: {{ split: {{ field: line, into: word, lowercase: true }} }} }}
  - {{ name: long, filter: {{ expr: "size(word) > 3" }} }}
  - {{ name: tagged, map: {{ fields: {{ word: "word", id: "(seq * 7 + size(word)) % 4000" }} }} }}
  - {{ name: by-word, input: tagged, keyBy: {{ fields: [word] }} }}
  - {{ name: counts, uid: counts, parallelism: 3, aggregate: {{ aggregates: [ {{ fn: count, as: n }} ] }} }}
  - {{ name: ids, input: tagged, map: {{ fields: {{ id: "id" }} }} }}
  - {{ name: by-id, input: ids, keyBy: {{ fields: [id] }} }}
  - {{ name: unique, uid: unique, parallelism: 1, dedupe: {{}} }}
sinks:
  - {{ name: counts-out, input: counts, uid: counts-out, file: {{ path: {out}/counts }} }}
  - {{ name: unique-out, input: unique, uid: unique-out, parallelism: 2, file: {{ path: {out}/unique }} }}
"#,
                count = 60_000 * input_scale(),
                rate = rate_line(rate),
                out = out.display()
            )
        }),
    }
}

/// The file source (positions are byte offsets per file), CEL parsing, a dedupe and a running
/// count and sum (held inline, `AccPair`). The sum is of a value fixed per key: a running sum of
/// the quantities would depend on how the parallel readers interleave. The file source
/// has no rate limit: its input is large enough to be killed mid-way.
fn file_source(input: PathBuf) -> Shape {
    Shape {
        name: "file-source",
        yaml: Box::new(move |out, _rate, parallelism| {
            format!(
                r#"name: chaos-files
parallelism: {parallelism}
maxParallelism: 32
{CHECKPOINTING}sources:
  - {{ name: lines, uid: lines, file: {{ path: {input} }} }}
operators:
  - name: parsed
    map: {{ fields: {{ user: "line.split(' ')[0]", item: "line.split(' ')[1]", qty: "int(line.split(' ')[2])",
                      width: "size(line.split(' ')[0])" }} }}
  - {{ name: by-user, keyBy: {{ fields: [user] }} }}
  - name: totals
    uid: totals
    aggregate: {{ aggregates: [ {{ fn: count, as: n }}, {{ fn: sum, field: width, as: widths }} ] }}
  - {{ name: pairs, input: parsed, map: {{ fields: {{ user: user, item: item }} }} }}
  - {{ name: by-pair, keyBy: {{ fields: [user, item] }} }}
  - {{ name: first, uid: first, dedupe: {{}} }}
sinks:
  - {{ name: totals-out, input: totals, uid: totals-out, file: {{ path: {out}/totals }} }}
  - {{ name: first-out, input: first, uid: first-out, file: {{ path: {out}/first }} }}
"#,
                input = input.display(),
                out = out.display()
            )
        }),
    }
}

/// What the reader saw: every published file with its length and checksum.
#[derive(Default)]
struct Seen {
    files: BTreeMap<PathBuf, (u64, u32)>,
    violations: Vec<String>,
}

fn is_output(name: &str) -> bool {
    !name.starts_with('.') && !name.starts_with('_')
}

/// Where a moved file went: `<sink>/_superseded/<epoch>/<name>`, if anywhere.
fn superseded_copy(file: &Path) -> Option<PathBuf> {
    let sink = file.parent()?;
    let name = file.file_name()?;
    std::fs::read_dir(sink.join("_superseded")).ok()?.flatten().map(|e| e.path().join(name)).find(|p| p.exists())
}

/// One pass of the reader over `out/<sink>/*`.
fn observe(out: &Path, seen: &mut Seen) {
    let Ok(sinks) = std::fs::read_dir(out) else { return };
    let mut present = BTreeSet::new();
    for sink in sinks.flatten() {
        let Ok(files) = std::fs::read_dir(sink.path()) else { continue };
        for f in files.flatten() {
            let name = f.file_name().to_string_lossy().to_string();
            if !is_output(&name) {
                continue;
            }
            let path = f.path();
            present.insert(path.clone());
            if let std::collections::btree_map::Entry::Vacant(slot) = seen.files.entry(path) {
                if let Ok(data) = std::fs::read(slot.key()) {
                    slot.insert((data.len() as u64, crc32c::crc32c(&data)));
                }
            }
        }
    }
    check_seen(seen, &present, false);
}

/// Every file seen so far is still there (or moved under `_superseded`) with its length; with
/// `verify`, with its checksum too (the last pass: reading every file on each pass would
/// cost the job its CPU). A rewind may move a file between two looks, so a file is only
/// reported after it was found neither in place nor moved, three looks in a row.
fn check_seen(seen: &mut Seen, present: &BTreeSet<PathBuf>, verify: bool) {
    let intact = |path: &Path, len: u64, crc: u32| {
        if verify {
            std::fs::read(path).is_ok_and(|data| data.len() as u64 == len && crc32c::crc32c(&data) == crc)
        } else {
            std::fs::metadata(path).is_ok_and(|m| m.len() == len)
        }
    };
    let mut violations = Vec::new();
    for (path, (len, crc)) in &seen.files {
        if present.contains(path) && intact(path, *len, *crc) {
            continue;
        }
        let mut verdict = None;
        for _ in 0..3 {
            let moved = superseded_copy(path);
            verdict = match (intact(path, *len, *crc), moved) {
                (true, _) => None,
                (false, Some(m)) if intact(&m, *len, *crc) => None,
                (false, Some(m)) => Some(format!("{} changed (moved to {})", path.display(), m.display())),
                (false, None) if path.exists() => Some(format!("{} changed in place", path.display())),
                (false, None) => Some(format!("published file {} disappeared", path.display())),
            };
            if verdict.is_none() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        violations.extend(verdict);
    }
    seen.violations.extend(violations);
}

/// Tails `out` on a thread until dropped.
struct Reader {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Seen>>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Reader {
    fn start(out: &Path) -> Reader {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (s, v, out) = (stop.clone(), seen.clone(), out.to_path_buf());
        let handle = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                observe(&out, &mut v.lock().unwrap());
                std::thread::sleep(Duration::from_millis(25));
            }
        });
        Reader { stop, seen, handle: Some(handle) }
    }

    /// Stops, takes a last look, and returns the violations.
    fn finish(mut self, out: &Path) -> Vec<String> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            h.join().unwrap();
        }
        let mut seen = self.seen.lock().unwrap();
        observe(out, &mut seen);
        let present: BTreeSet<PathBuf> = seen.files.keys().filter(|p| p.exists()).cloned().collect();
        check_seen(&mut seen, &present, true);
        seen.violations.clone()
    }
}

/// Every published file is listed with its length and checksum in a commit manifest, and
/// every file a manifest lists is there.
fn assert_manifests(out: &Path) {
    for sink in std::fs::read_dir(out).unwrap().flatten() {
        let mut listed: BTreeMap<String, (u64, u32)> = BTreeMap::new();
        if let Ok(manifests) = std::fs::read_dir(sink.path().join("_commits")) {
            // Only `*.json`: a process killed inside a write leaves the store's temporary
            // `<name>#<n>` behind, which no reader takes for a manifest.
            for m in manifests.flatten().filter(|m| m.file_name().to_string_lossy().ends_with(".json")) {
                let doc: weir_runtime::sinks::file::CommitManifest =
                    serde_json::from_slice(&std::fs::read(m.path()).unwrap()).unwrap();
                for f in doc.files {
                    listed.insert(f.name, (f.len, f.crc32c));
                }
            }
        }
        for f in std::fs::read_dir(sink.path()).unwrap().flatten() {
            let name = f.file_name().to_string_lossy().to_string();
            if !is_output(&name) {
                continue;
            }
            let data = std::fs::read(f.path()).unwrap();
            assert_eq!(
                listed.remove(&name),
                Some((data.len() as u64, crc32c::crc32c(&data))),
                "{}: no commit manifest lists {name} as it is",
                sink.path().display()
            );
        }
        assert!(
            listed.is_empty(),
            "{}: manifests list files that are not published: {:?}",
            sink.path().display(),
            listed.keys().take(5).collect::<Vec<_>>()
        );
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Flips a byte in the middle of the largest file the newest complete checkpoint references
/// (a shared base image, often), or of its `_metadata`; returns the checkpoint's id. A shared
/// file is only damaged while a checkpoint outside its chain exists to fall back to (retention
/// keeps one); without one, refusing to start is the right answer, tested elsewhere.
/// The shared files of a checkpoint root whose names end in `suffix` (`-merged.kv`: merged full
/// images; `.sst`: their table files, for the rocksdb backend).
fn shared_files_ending(chk: &Path, suffix: &str) -> Vec<PathBuf> {
    let Ok(operators) = std::fs::read_dir(chk.join("checkpoints/shared")) else { return Vec::new() };
    operators
        .flatten()
        .flat_map(|op| std::fs::read_dir(op.path()).into_iter().flatten().flatten())
        .map(|f| f.path())
        .filter(|f| f.to_string_lossy().ends_with(suffix))
        .collect()
}

/// Damages the newest checkpoint that is still restorable: its largest file when an older
/// restorable checkpoint shares none of its files (every other round), else its metadata.
/// `damaged` holds the files damaged so far (paths from the job root): a checkpoint that lists
/// one is not restorable, so it is neither a target nor a fallback. Without that, a round could
/// damage the only chain left after an earlier round had damaged the chain it counted as the
/// fallback, leaving nothing to restore (a refusal the runtime is right to make).
fn corrupt_newest(chk: &Path, round: u64, damaged: &mut BTreeSet<String>) -> Option<u64> {
    let storage = weir_checkpoint::Storage::open(chk.to_str().unwrap()).unwrap();
    let found = weir_runtime::io().block_on(weir_checkpoint::retention::scan(&storage)).ok()?;
    let restorable: Vec<_> = found
        .iter()
        .filter_map(|c| c.references.as_ref().map(|r| (c.id, r)))
        .filter(|(_, refs)| refs.is_disjoint(damaged))
        // Nor is one that lost files: retention deleting it when a kill came (a directory's
        // files are deleted in listing order, `0-…` before `_metadata`). Seed 535290 damaged
        // the one file the retained checkpoints shared, counting on checkpoints whose files
        // retention had deleted while keeping them (fixed in `retention::plan`).
        .filter(|(_, refs)| refs.iter().all(|path| chk.join(path).exists()))
        .collect();
    let (newest, newest_refs) = restorable.iter().max_by_key(|(id, _)| *id)?;
    let newest = *newest;
    let independent = restorable.iter().any(|(id, refs)| *id != newest && refs.is_disjoint(newest_refs));
    if restorable.len() < 2 {
        return None;
    }
    let dir = chk.join(weir_checkpoint::layout::checkpoint_dir(newest));
    let meta = weir_checkpoint::CheckpointMetadata::decode(&std::fs::read(dir.join("_metadata")).ok()?).ok()?;
    let target = if round.is_multiple_of(2) && independent {
        let f = meta.files().max_by_key(|f| f.len)?;
        damaged.insert(weir_checkpoint::layout::resolve(&weir_checkpoint::layout::checkpoint_dir(newest), &f.path));
        PathBuf::from(weir_checkpoint::layout::resolve(dir.to_str().unwrap(), &f.path))
    } else {
        dir.join("_metadata")
    };
    let target = if target.is_absolute() { target } else { PathBuf::from("/").join(target) };
    let mut bytes = std::fs::read(&target).ok()?;
    let i = bytes.len() / 2;
    bytes[i] ^= 0x10;
    std::fs::write(&target, bytes).ok()?;
    Some(newest)
}

/// The campaign's options.
struct Campaign {
    kills: u64,
    corrupt_every: Option<u64>,
    rescale_every: Option<u64>,
    rate: Option<u64>,
}

#[derive(Debug, Default)]
struct Tally {
    kills: u64,
    aborts: u64,
    corrupted: u64,
    rescales: u64,
    /// Runs on the rocksdb backend (the others ran on the heap backend).
    rocksdb_runs: u64,
    /// Runs whose periodic full images were merged in the background from the uploaded
    /// chains (the others' tasks wrote them).
    merging_runs: u64,
    /// Merged full images found in the checkpoint storage between runs.
    merged_images_seen: u64,
    /// Distinct table files of merged images seen (merges of rocksdb runs).
    merged_tables_seen: u64,
    /// Runs of increments merged into one (the rocksdb backend's) seen in the checkpoint storage.
    merged_increments_seen: u64,
}

/// Runs one shape through a campaign and checks it against an undisturbed run.
fn campaign(shape: &Shape, c: Campaign, salt: u64) -> Tally {
    let campaign_seed = mix64(seed() ^ salt);
    // The undisturbed run.
    let (_g, golden_out, golden_chk) = workdir(&format!("chaos-{}-golden", shape.name));
    let golden_job = golden_out.parent().unwrap().join("job.yaml");
    std::fs::write(&golden_job, (shape.yaml)(&golden_out, None, 2)).unwrap();
    let status = bin()
        .args(["run", golden_job.to_str().unwrap(), "--checkpoint-dir", golden_chk.to_str().unwrap(), "--quiet"])
        .status()
        .unwrap();
    assert!(status.success(), "{}: the undisturbed run failed", shape.name);
    let golden = committed(&golden_out);
    assert!(
        golden.values().all(|v| !v.is_empty()),
        "{}: every sink of the undisturbed run wrote something",
        shape.name
    );

    let (dir, out, chk) = workdir(&format!("chaos-{}", shape.name));
    let storage = weir_checkpoint::Storage::open(chk.to_str().unwrap()).unwrap();
    let reader = Reader::start(&out);
    let mut tally = Tally::default();
    let parallelisms = [2u32, 3, 1, 2];
    let mut parallelism = 2u32;
    let mut restore_from: Option<String> = None;
    let mut last_corrupted = 0u64;
    let mut damaged = BTreeSet::new();
    let mut round = 0u64;
    let mut merged_images = BTreeSet::new();
    let mut merged_tables = BTreeSet::new();
    let mut merged_increments = BTreeSet::new();
    loop {
        round += 1;
        assert!(round < 10 * c.kills + 50, "{}: too many rounds ({tally:?})", shape.name);
        let r = mix64(campaign_seed ^ round);
        let must_finish = tally.kills >= c.kills;
        let job_file = dir.path().join(format!("job-{round}.yaml"));
        let mut yaml = (shape.yaml)(&out, if must_finish { None } else { c.rate }, parallelism);
        // Each run picks a state backend: restores cross from one to the other all the time,
        // and the rocksdb runs' cache is small enough that most keys live on disk.
        if (r >> 40).is_multiple_of(2) {
            yaml.push_str("stateBackend: rocksdb\nstateCacheEntries: 100\n");
            tally.rocksdb_runs += 1;
        }
        // And who writes periodic full images: the task, or a background merge of the chain
        // already uploaded (restores then read chains that begin with a merged image).
        if (r >> 41).is_multiple_of(2) && yaml.contains("fullEvery: 3,") {
            yaml = yaml.replace("fullEvery: 3,", "fullEvery: 3, backgroundFullImageAbove: 0,");
            tally.merging_runs += 1;
        }
        merged_images.extend(shared_files_ending(&chk, "-merged.kv"));
        tally.merged_images_seen = merged_images.len() as u64;
        merged_tables.extend(shared_files_ending(&chk, ".sst"));
        tally.merged_tables_seen = merged_tables.len() as u64;
        merged_increments.extend(shared_files_ending(&chk, "-merged-increment.kv"));
        tally.merged_increments_seen = merged_increments.len() as u64;
        std::fs::write(&job_file, yaml).unwrap();
        let rescale = !must_finish && c.rescale_every.is_some_and(|n| r.is_multiple_of(n));
        let port = free_port();
        let mut cmd = bin();
        cmd.args(["run", job_file.to_str().unwrap(), "--checkpoint-dir", chk.to_str().unwrap(), "--quiet"]);
        cmd.args(["--restore", restore_from.take().as_deref().unwrap_or("latest")]);
        if rescale {
            cmd.args(["--control-addr", &format!("127.0.0.1:{port}")]);
        }
        // Some runs abort themselves between a checkpoint's completion and its commit.
        let self_abort = !must_finish && r % 5 == 1;
        if self_abort {
            cmd.env("WEIR_FAULTS", format!("seed={r},commit-abort=0.3,max=1"));
        }
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        // Half the kills come at a random moment, the other half a random time after a new
        // checkpoint completed.
        let before = newest_complete(&storage);
        let delay = Duration::from_millis(30 + (r >> 8) % 600);
        let after_progress = (r >> 20).is_multiple_of(2);
        let started = Instant::now();
        let mut progressed: Option<Instant> = None;
        let deadline = started + Duration::from_secs(if must_finish { 300 } else { 60 });
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            assert!(Instant::now() < deadline, "{}: round {round} neither ended nor was killed in time", shape.name);
            if !must_finish {
                if after_progress && progressed.is_none() && newest_complete(&storage) > before {
                    progressed = Some(Instant::now());
                }
                let due = if after_progress {
                    progressed.is_some_and(|t| t.elapsed() >= delay)
                } else {
                    started.elapsed() >= delay
                };
                if due {
                    break None;
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let stderr = |child: &mut std::process::Child| {
            let mut e = String::new();
            std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut e).unwrap();
            e
        };
        match status {
            None if rescale => {
                // Rescale: stop with a savepoint, restart it at another parallelism.
                let sp = bin()
                    .args(["savepoint", &format!("127.0.0.1:{port}"), "--stop", "--timeout-secs", "60"])
                    .output()
                    .unwrap();
                if sp.status.success() {
                    let status = child.wait().unwrap();
                    assert!(status.success(), "{}: the stopped run failed: {}", shape.name, stderr(&mut child));
                    parallelism = parallelisms[(tally.rescales as usize + 1) % parallelisms.len()];
                    restore_from = Some(String::from_utf8_lossy(&sp.stdout).trim().to_string());
                    tally.rescales += 1;
                } else if let Some(status) = child.try_wait().unwrap() {
                    // It finished while the stop was asked for.
                    assert!(
                        status.success(),
                        "{} (seed {}): round {round} failed: {}",
                        shape.name,
                        seed(),
                        stderr(&mut child)
                    );
                    break;
                } else {
                    // The stop's savepoint failed (it raced a failing checkpoint): kill instead.
                    child.kill().unwrap();
                    child.wait().unwrap();
                    tally.kills += 1;
                }
            }
            None => {
                child.kill().unwrap(); // SIGKILL
                child.wait().unwrap();
                tally.kills += 1;
                if c.corrupt_every.is_some_and(|n| (r >> 32).is_multiple_of(n)) {
                    if let Some(id) = corrupt_newest(&chk, round, &mut damaged).filter(|id| *id > last_corrupted) {
                        last_corrupted = id;
                        tally.corrupted += 1;
                    }
                }
            }
            // Done (before the kill, the campaign ends with the remaining kills unused).
            Some(s) if s.success() => break,
            Some(s) => {
                let err = stderr(&mut child);
                assert!(
                    self_abort && err.contains("injected fault: aborting"),
                    "{} (seed {}): round {round} failed with {s}: {err}",
                    shape.name,
                    seed()
                );
                tally.aborts += 1;
            }
        }
    }
    let violations = reader.finish(&out);
    assert!(
        violations.is_empty(),
        "{} (seed {}): published output disappeared or changed: {:?}",
        shape.name,
        seed(),
        &violations[..violations.len().min(5)]
    );
    assert_same_output(&golden, &committed(&out), &format!("{} (seed {}, {tally:?})", shape.name, seed()));
    assert_manifests(&out);
    if tally.corrupted == 0 {
        for sink in std::fs::read_dir(&out).unwrap().flatten() {
            assert!(
                !sink.path().join("_superseded").exists(),
                "{}: output was superseded although no checkpoint was corrupt",
                shape.name
            );
        }
    }
    assert!(tally.merging_runs > 0, "{}: no run merged its full images in the background", shape.name);
    assert!(
        tally.rocksdb_runs > 0 && tally.rocksdb_runs < round,
        "{}: both state backends ran (seed {}, {tally:?}, {round} rounds)",
        shape.name,
        seed()
    );
    eprintln!("{}: {tally:?} (seed {})", shape.name, seed());
    record_faults(tally.kills + tally.aborts + tally.corrupted);
    tally
}

#[test]
fn sparse_event_time_windows_survive_random_kills_and_corrupt_checkpoints() {
    let t = campaign(
        &sparse_windows(),
        Campaign { kills: kills(70), corrupt_every: Some(6), rescale_every: None, rate: Some(4_000) },
        1,
    );
    assert!(t.kills >= kills(70), "{t:?}");
}

#[test]
fn a_multi_stage_graph_survives_random_kills() {
    let t = campaign(
        &pipeline(),
        Campaign { kills: kills(70), corrupt_every: None, rescale_every: None, rate: Some(1_500) },
        2,
    );
    assert!(t.kills >= kills(70), "{t:?}");
}

#[test]
fn rescaling_through_savepoints_between_random_kills() {
    let t = campaign(
        &pipeline(),
        Campaign { kills: kills(60), corrupt_every: Some(9), rescale_every: Some(5), rate: Some(1_500) },
        3,
    );
    assert!(t.kills >= kills(60) && t.rescales >= 1, "{t:?}");
}

#[test]
fn the_file_source_survives_random_kills() {
    // An optimized build reads 800K lines in well under a second, before most kills are due:
    // it reads ten times as many, so that its campaign is killed mid-way too.
    let lines = if cfg!(debug_assertions) { 200_000 } else { 2_000_000 };
    let (_d, input) = input_files("chaos-files-in", 4, lines, |f, i| {
        format!("user{} item{} {}", mix64(i * 4 + f) % 500, mix64(i + f) % 40, i % 7)
    });
    let t = campaign(
        &file_source(input),
        Campaign { kills: kills(30), corrupt_every: None, rescale_every: None, rate: None },
        4,
    );
    assert!(t.kills >= 3, "the file source finished before it could be killed: make the input larger ({t:?})");
}
