//! `weir-runtime`: run a job file locally or in a pod, take savepoints, inspect checkpoints.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use weir_runtime::executor::{run_job, storage_url, JobError, JobOutcome, RestoreRequest, RunOptions};
use weir_runtime::faults::FaultPlan;
use weir_runtime::metrics::JobMetrics;

#[derive(Parser)]
#[command(
    name = "weir-runtime",
    version,
    about = "Weir's stream engine: run a job, take savepoints, inspect checkpoints"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a job file until its bounded input ends, it is stopped, or it fails for good.
    Run {
        /// The job file (YAML).
        job: String,
        /// Storage root of this job's checkpoints and savepoints: a path, file:///..., s3://, gs:// or
        /// az://bucket/prefix.
        #[arg(long, env = "WEIR_CHECKPOINT_DIR")]
        checkpoint_dir: Option<String>,
        /// Restore from a checkpoint or savepoint directory, or `latest` (the newest valid checkpoint;
        /// none: start fresh).
        #[arg(long, env = "WEIR_RESTORE")]
        restore: Option<String>,
        /// Accept a snapshot with state of operators the job no longer has.
        #[arg(long)]
        allow_non_restored_state: bool,
        /// Start without state although the storage root holds checkpoints or savepoints of
        /// the job (they are kept, and so is earlier output). Without --restore or --fresh such
        /// a start is refused.
        #[arg(long, conflicts_with = "restore", env = "WEIR_FRESH")]
        fresh: bool,
        /// Serve the control API and metrics on this address (e.g. 0.0.0.0:8081).
        #[arg(long, env = "WEIR_CONTROL_ADDR")]
        control_addr: Option<String>,
        /// File holding the bearer token the control API requires.
        #[arg(long, env = "WEIR_CONTROL_TOKEN_FILE")]
        token_file: Option<String>,
        /// No progress lines.
        #[arg(long)]
        quiet: bool,
        /// File to write how the job ended into (Kubernetes' termination message,
        /// `/dev/termination-log`): `savepoint=<path>` after a stop with savepoint, the error
        /// when it failed.
        #[arg(long, env = "WEIR_TERMINATION_LOG")]
        termination_log: Option<String>,
    },
    /// Check a job file and print its execution plan.
    Validate {
        /// The job file (YAML).
        job: String,
    },
    /// Trigger a savepoint on a running job through its control API, and wait for it.
    Savepoint {
        /// Control API address, e.g. 127.0.0.1:8081.
        addr: String,
        /// Stop the job after the savepoint.
        #[arg(long)]
        stop: bool,
        /// With --stop: flush all windows first.
        #[arg(long)]
        drain: bool,
        /// File holding the bearer token.
        #[arg(long, env = "WEIR_CONTROL_TOKEN_FILE")]
        token_file: Option<String>,
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 120)]
        timeout_secs: u64,
    },
    /// List the checkpoints under a job's storage root, newest first, and whether each can be restored.
    Checkpoints {
        /// The job's storage root (the --checkpoint-dir a job ran with).
        dir: String,
    },
}

fn main() -> ExitCode {
    if let Err(e) = init_logging() {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let cli = Cli::parse();
    match cli.command {
        Command::Run {
            job,
            checkpoint_dir,
            restore,
            allow_non_restored_state,
            fresh,
            control_addr,
            token_file,
            quiet,
            termination_log,
        } => run(
            &job,
            RunArgs { checkpoint_dir, restore, allow: allow_non_restored_state, fresh },
            control_addr,
            token_file,
            quiet,
            termination_log.as_deref(),
        ),
        Command::Validate { job } => validate(&job),
        Command::Savepoint { addr, stop, drain, token_file, timeout_secs } => {
            savepoint(&addr, stop, drain, token_file, timeout_secs)
        }
        Command::Checkpoints { dir } => checkpoints(&dir),
    }
}

fn read_job(path: &str) -> Result<weir_crds::ValidatedJob, ExitCode> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: cannot read {path}: {e}");
            return Err(ExitCode::from(2));
        }
    };
    weir_runtime::load_job(&text).map_err(|e| {
        eprintln!("error: {path} is not a valid job:\n{e}");
        ExitCode::from(2)
    })
}

fn read_token(file: Option<String>) -> Result<Option<String>, ExitCode> {
    match file {
        None => Ok(None),
        Some(f) => std::fs::read_to_string(&f).map(|t| Some(t.trim().to_string())).map_err(|e| {
            eprintln!("error: cannot read token file {f}: {e}");
            ExitCode::from(2)
        }),
    }
}

fn human(n: f64) -> String {
    if n >= 1e6 {
        format!("{:.2}M", n / 1e6)
    } else if n >= 1e3 {
        format!("{:.1}K", n / 1e3)
    } else {
        format!("{n:.0}")
    }
}

/// Exit code of a run stopped because a newer run of the job claimed a newer epoch.
const EXIT_FENCED: u8 = 3;
/// Exit code of a run that refused to start: restore points exist and none is valid.
const EXIT_NO_VALID_STATE: u8 = 4;

/// What `run` restores and where.
struct RunArgs {
    checkpoint_dir: Option<String>,
    restore: Option<String>,
    allow: bool,
    fresh: bool,
}

fn run(
    path: &str,
    args: RunArgs,
    control_addr: Option<String>,
    token_file: Option<String>,
    quiet: bool,
    termination_log: Option<&str>,
) -> ExitCode {
    let job = match read_job(path) {
        Ok(j) => j,
        Err(code) => return code,
    };
    let token = match read_token(token_file) {
        Ok(t) => t,
        Err(code) => return code,
    };
    let faults = match std::env::var("WEIR_FAULTS") {
        Ok(text) if !text.trim().is_empty() => match FaultPlan::parse(&text) {
            Ok(p) => Some(p),
            Err(e) => {
                eprintln!("error: WEIR_FAULTS: {e}");
                return ExitCode::from(2);
            }
        },
        _ => None,
    };
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_default();
    let opts = RunOptions {
        checkpoint_dir: args.checkpoint_dir,
        restore: args.restore.map(|r| if r == "latest" { RestoreRequest::Latest } else { RestoreRequest::Path(r) }),
        allow_non_restored_state: args.allow,
        fresh: args.fresh,
        holder: Some(format!("{host} pid {}", std::process::id())),
        faults,
    };
    let job_id = format!(
        "{:016x}",
        weir_runtime::value::mix64(
            std::process::id() as u64
                ^ Instant::now().elapsed().as_nanos() as u64
                ^ std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(0)
        )
    );
    let metrics = Arc::new(JobMetrics::new(&job.spec.name, &job_id));
    let (req_tx, req_rx) = crossbeam_channel::unbounded();
    let _server = match &control_addr {
        Some(addr) => match weir_runtime::control::serve(addr, token, metrics.clone(), req_tx.clone()) {
            Ok(s) => {
                tracing::info!(addr = %s.addr, "control API listening");
                Some(s)
            }
            Err(e) => {
                eprintln!("error: control API on {addr}: {e}");
                return ExitCode::from(2);
            }
        },
        None => None,
    };
    eprintln!("weir: running job `{}` (checkpoints in {})", job.spec.name, storage_url(&job, &opts));
    let progress = (!quiet).then(|| {
        let m = metrics.clone();
        std::thread::spawn(move || {
            let start = Instant::now();
            let mut last_in = 0;
            let mut last = Instant::now();
            loop {
                std::thread::sleep(Duration::from_secs(2));
                let state = m.board().state;
                if matches!(
                    state,
                    weir_crds::control::JobState::Finished
                        | weir_crds::control::JobState::Stopped
                        | weir_crds::control::JobState::Cancelled
                        | weir_crds::control::JobState::Failed
                ) {
                    return;
                }
                let rin = m.records_in.load(Ordering::Relaxed);
                let rate = (rin - last_in) as f64 / last.elapsed().as_secs_f64();
                last_in = rin;
                last = Instant::now();
                eprintln!(
                    "weir: {:>5.0}s {:?} | in {} ({}/s) | out {} | checkpoints {} ok {} failed, \
                     last {} ms {} KiB | restarts {}",
                    start.elapsed().as_secs_f64(),
                    state,
                    human(rin as f64),
                    human(rate),
                    human(m.records_out.load(Ordering::Relaxed) as f64),
                    m.checkpoints_completed.load(Ordering::Relaxed),
                    m.checkpoints_failed.load(Ordering::Relaxed),
                    m.last_checkpoint_duration_ms.load(Ordering::Relaxed),
                    m.last_checkpoint_bytes.load(Ordering::Relaxed) / 1024,
                    m.restarts.load(Ordering::Relaxed),
                );
            }
        })
    });
    let started = Instant::now();
    let result = run_job(&job, &opts, metrics.clone(), req_rx);
    drop(progress);
    if let Some(server) = &_server {
        // Let a client waiting for the stop savepoint read its answer before the process ends.
        server.drain(Duration::from_secs(5));
    }
    let summary = format!(
        "in {} records, out {}, {} checkpoints ({} failed), {} restarts, {} injected faults, {:.1}s",
        metrics.records_in.load(Ordering::Relaxed),
        metrics.records_out.load(Ordering::Relaxed),
        metrics.checkpoints_completed.load(Ordering::Relaxed),
        metrics.checkpoints_failed.load(Ordering::Relaxed),
        metrics.restarts.load(Ordering::Relaxed),
        metrics.injected_faults.load(Ordering::Relaxed),
        started.elapsed().as_secs_f64()
    );
    if let Some(log) = termination_log {
        let message = match &result {
            Ok(JobOutcome::Stopped { savepoint }) => format!("savepoint={savepoint}\n"),
            Ok(JobOutcome::Finished) => "finished\n".to_string(),
            Ok(JobOutcome::Cancelled) => "cancelled\n".to_string(),
            Err(e) => format!("failed: {e}\n"),
        };
        if let Err(e) = std::fs::write(log, message) {
            eprintln!("warning: cannot write the termination log {log}: {e}");
        }
    }
    match result {
        Ok(JobOutcome::Finished) => {
            eprintln!("weir: job `{}` finished: {summary}", job.spec.name);
            ExitCode::SUCCESS
        }
        Ok(JobOutcome::Stopped { savepoint }) => {
            eprintln!("weir: job `{}` stopped with savepoint {savepoint}: {summary}", job.spec.name);
            println!("{savepoint}");
            ExitCode::SUCCESS
        }
        Ok(JobOutcome::Cancelled) => {
            eprintln!("weir: job `{}` cancelled: {summary}", job.spec.name);
            ExitCode::SUCCESS
        }
        Err(e @ JobError::Fenced(_)) => {
            eprintln!("error: job `{}`: {e} ({summary})", job.spec.name);
            ExitCode::from(EXIT_FENCED)
        }
        Err(e @ JobError::Restore(weir_runtime::restore::RestoreError::NoValidRestorePoint { .. })) => {
            eprintln!("error: job `{}`: {e}", job.spec.name);
            ExitCode::from(EXIT_NO_VALID_STATE)
        }
        Err(e @ JobError::ExistingState { .. }) => {
            eprintln!("error: job `{}`: {e}", job.spec.name);
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("error: job `{}`: {e} ({summary})", job.spec.name);
            ExitCode::FAILURE
        }
    }
}

fn validate(path: &str) -> ExitCode {
    let job = match read_job(path) {
        Ok(j) => j,
        Err(code) => return code,
    };
    println!("job `{}` is valid; tasks:", job.spec.name);
    for v in weir_runtime::plan::build(&job) {
        let names: Vec<&str> = v.nodes.iter().map(|&n| job.nodes[n].name.as_str()).collect();
        println!("  {} × {}", names.join(" → "), v.parallelism);
    }
    ExitCode::SUCCESS
}

/// A minimal HTTP/1.1 exchange (the control API is plain HTTP on a trusted network).
fn http(addr: &str, method: &str, path: &str, token: Option<&str>, body: &str) -> Result<(u16, String), String> {
    let mut stream = TcpStream::connect(addr).map_err(|e| format!("connecting to {addr}: {e}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(60))).map_err(|e| e.to_string())?;
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Content-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(req.as_bytes()).map_err(|e| e.to_string())?;
    let mut resp = String::new();
    stream.read_to_string(&mut resp).map_err(|e| e.to_string())?;
    let status = resp.split_whitespace().nth(1).and_then(|s| s.parse().ok()).ok_or("malformed HTTP response")?;
    let body = resp.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Ok((status, body))
}

/// Prints a finished savepoint's path (or its failure); `None` while it is in progress.
fn finished_savepoint(s: &weir_crds::control::SavepointStatus) -> Option<ExitCode> {
    match s.outcome {
        weir_crds::control::CheckpointOutcome::Completed => {
            println!("{}", s.path.clone().unwrap_or_default());
            Some(ExitCode::SUCCESS)
        }
        weir_crds::control::CheckpointOutcome::Failed => {
            eprintln!("error: savepoint failed: {}", s.failure.clone().unwrap_or_default());
            Some(ExitCode::FAILURE)
        }
        weir_crds::control::CheckpointOutcome::InProgress => None,
    }
}

fn savepoint(addr: &str, stop: bool, drain: bool, token_file: Option<String>, timeout_secs: u64) -> ExitCode {
    let token = match read_token(token_file) {
        Ok(t) => t,
        Err(code) => return code,
    };
    let path = if stop { "/v1/stop" } else { "/v1/savepoints" };
    let body = serde_json::json!({ "drain": drain, "wait": true }).to_string();
    let (status, text) = match http(addr, "POST", path, token.as_deref(), &body) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    if status != 202 && status != 200 {
        eprintln!("error: {path} answered {status}: {text}");
        return ExitCode::FAILURE;
    }
    let Ok(accepted) = serde_json::from_str::<weir_crds::control::SavepointStatus>(&text) else {
        eprintln!("error: unexpected answer: {text}");
        return ExitCode::FAILURE;
    };
    if let Some(code) = finished_savepoint(&accepted) {
        return code;
    }
    let deadline = Instant::now() + Duration::from_secs(timeout_secs);
    while Instant::now() < deadline {
        if let Ok((200, text)) =
            http(addr, "GET", &format!("/v1/savepoints/{}", accepted.request_id), token.as_deref(), "")
        {
            if let Some(code) = serde_json::from_str(&text).ok().as_ref().and_then(finished_savepoint) {
                return code;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("error: savepoint not complete after {timeout_secs}s");
    ExitCode::FAILURE
}

fn checkpoints(dir: &str) -> ExitCode {
    let storage = match weir_checkpoint::Storage::open(dir) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    match weir_runtime::io().block_on(weir_checkpoint::recovery::list_checkpoints(&storage)) {
        Ok(list) if list.is_empty() => {
            println!("no checkpoints under {}", storage.url());
            ExitCode::SUCCESS
        }
        Ok(list) => {
            println!("{:>8}  {:<8}  {:>12}  path", "id", "valid", "bytes");
            for (id, verdict, meta) in list {
                let bytes = meta.as_ref().map(|m| m.state_bytes()).unwrap_or(0);
                let path = storage.url_of(&weir_checkpoint::layout::checkpoint_dir(id));
                match verdict {
                    weir_checkpoint::recovery::Verdict::Valid => println!("{id:>8}  {:<8}  {bytes:>12}  {path}", "yes"),
                    weir_checkpoint::recovery::Verdict::Invalid(why) => {
                        println!("{id:>8}  {:<8}  {bytes:>12}  {path}  ({why})", "NO")
                    }
                    weir_checkpoint::recovery::Verdict::Incomplete => {
                        println!("{id:>8}  {:<8}  {bytes:>12}  {path}  (never completed)", "no")
                    }
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Logs to stderr, filtered by `WEIR_LOG` (else `RUST_LOG`, else `info`) in tracing's filter
/// syntax (`debug`, `info,weir_runtime::executor=debug`); `WEIR_LOG_FORMAT=json` writes one JSON
/// object per line for a cluster's log collector. A filter that does not parse is an error.
fn init_logging() -> Result<(), String> {
    let spec = std::env::var("WEIR_LOG").or_else(|_| std::env::var("RUST_LOG")).unwrap_or_else(|_| "info".into());
    let filter = tracing_subscriber::EnvFilter::try_new(&spec).map_err(|e| format!("WEIR_LOG `{spec}`: {e}"))?;
    let logs = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false);
    match std::env::var("WEIR_LOG_FORMAT").as_deref() {
        Ok("json") => logs.json().init(),
        Ok("text") | Err(_) => logs.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).init(),
        Ok(other) => return Err(format!("WEIR_LOG_FORMAT `{other}`: use text or json")),
    }
    Ok(())
}
