//! `weir-runtime`: run a job file locally or in a pod, take savepoints, inspect checkpoints.

use std::process::ExitCode;
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
        /// Most bytes of keyed state files the heap backend holds in memory: a restore's files
        /// (a larger restore, or one of long values from object storage, reads them in parts:
        /// from local files under the temporary directory, or in ranges from object storage),
        /// and each keyed subtask's share of it, at most 64 MiB, for a full image it
        /// writes (a savepoint's, or the first checkpoint's after a restore from elsewhere; a
        /// larger image is written to a local file there). Default: a quarter of the memory the
        /// process may use, its cgroup's limit or the machine's.
        #[arg(long, env = "WEIR_STATE_FILES_IN_MEMORY_MAX", alias = "restore-files-in-memory-max")]
        state_files_in_memory_max: Option<u64>,
        /// File to write how the job ended into (Kubernetes' termination message,
        /// `/dev/termination-log`): `savepoint=<path>` after a stop with savepoint, the error
        /// when it failed.
        #[arg(long, env = "WEIR_TERMINATION_LOG")]
        termination_log: Option<String>,
        /// `${env:NAME}` in Kafka properties reads only the variable `<PREFIX>NAME` (the
        /// operator sets the keys of the job's `podTemplate.envFromSecrets` Secrets with this
        /// prefix too, so that a job reaches those and nothing else of the environment).
        #[arg(long, value_name = "PREFIX")]
        declared_env_prefix: Option<String>,
        /// Serve the control API over TLS with this certificate (PEM; the operator issues one per
        /// job). Needs --tls-key-file.
        #[arg(long, requires = "tls_key_file", env = "WEIR_CONTROL_TLS_CERT_FILE")]
        tls_cert_file: Option<String>,
        /// The private key (PEM) of --tls-cert-file.
        #[arg(long, requires = "tls_cert_file", env = "WEIR_CONTROL_TLS_KEY_FILE")]
        tls_key_file: Option<String>,
    },
    /// Check a job file and print its execution plan.
    Validate {
        /// The job file (YAML), or a StreamJob manifest with an inline job.
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
        /// The runtime's certificate (PEM, the `tls.crt` of the job's token Secret): the control
        /// API is reached over TLS and trusted by this certificate alone.
        #[arg(long, env = "WEIR_CONTROL_TLS_CERT_FILE")]
        tls_cert_file: Option<String>,
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
            state_files_in_memory_max,
            termination_log,
            declared_env_prefix,
            tls_cert_file,
            tls_key_file,
        } => {
            if let Some(prefix) = declared_env_prefix.filter(|p| !p.is_empty()) {
                #[cfg(feature = "kafka")]
                if let Err(e) = weir_runtime::kafka::only_declared_env(&prefix) {
                    eprintln!("error: --declared-env-prefix: {e}");
                    return ExitCode::from(2);
                }
                // Without the Kafka connectors nothing reads `${env:NAME}`.
                #[cfg(not(feature = "kafka"))]
                let _ = prefix;
            }
            let tls = match (tls_cert_file, tls_key_file) {
                (Some(cert), Some(key)) => match read_tls(&cert, &key) {
                    Ok(tls) => Some(tls),
                    Err(code) => return code,
                },
                _ => None,
            };
            run(
                &job,
                RunArgs { checkpoint_dir, restore, allow: allow_non_restored_state, fresh, state_files_in_memory_max },
                control_addr,
                token_file,
                quiet,
                termination_log.as_deref(),
                tls,
            )
        }
        Command::Validate { job } => validate(&job),
        Command::Savepoint { addr, stop, drain, token_file, tls_cert_file, timeout_secs } => {
            savepoint(&addr, stop, drain, token_file, tls_cert_file, timeout_secs)
        }
        Command::Checkpoints { dir } => checkpoints(&dir),
    }
}

fn read_text(path: &str) -> Result<String, ExitCode> {
    std::fs::read_to_string(path).map_err(|e| {
        eprintln!("error: cannot read {path}: {e}");
        ExitCode::from(2)
    })
}

fn read_job(path: &str) -> Result<weir_crds::ValidatedJob, ExitCode> {
    let text = read_text(path)?;
    weir_runtime::load_job(&text).map_err(|e| {
        eprintln!("error: {path} is not a valid job:\n{e}");
        ExitCode::from(2)
    })
}

fn read_tls(cert: &str, key: &str) -> Result<Arc<rustls::ServerConfig>, ExitCode> {
    let cert = std::fs::read(cert).map_err(|e| {
        eprintln!("error: cannot read TLS certificate {cert}: {e}");
        ExitCode::from(2)
    })?;
    let key = std::fs::read(key).map_err(|e| {
        eprintln!("error: cannot read TLS key {key}: {e}");
        ExitCode::from(2)
    })?;
    weir_runtime::control::tls_config(&cert, &key).map_err(|e| {
        eprintln!("error: {e}");
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
    state_files_in_memory_max: Option<u64>,
}

fn run(
    path: &str,
    args: RunArgs,
    control_addr: Option<String>,
    token_file: Option<String>,
    quiet: bool,
    termination_log: Option<&str>,
    tls: Option<Arc<rustls::ServerConfig>>,
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
        state_files_in_memory_max: args.state_files_in_memory_max,
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
    let server = match &control_addr {
        Some(addr) => match weir_runtime::control::serve(addr, token, tls, metrics.clone(), req_tx.clone()) {
            Ok(s) => {
                tracing::info!(addr = %s.addr, "control API listening");
                Some(s)
            }
            Err(e) => {
                eprintln!("error: control API: {e}");
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
                let rin = m.records_in.get();
                let rate = (rin - last_in) as f64 / last.elapsed().as_secs_f64();
                last_in = rin;
                last = Instant::now();
                eprintln!(
                    "weir: {:>5.0}s {:?} | in {} ({}/s) | out {} | checkpoints {} ok {} failed, \
                     last {:.0} ms {} KiB | restarts {}",
                    start.elapsed().as_secs_f64(),
                    state,
                    human(rin as f64),
                    human(rate),
                    human(m.records_out.get() as f64),
                    m.checkpoints_completed.get(),
                    m.checkpoints_failed.get(),
                    m.last_checkpoint_duration.get() * 1000.0,
                    m.last_checkpoint_bytes.get() / 1024,
                    m.restarts.get(),
                );
            }
        })
    });
    let started = Instant::now();
    let result = run_job(&job, &opts, metrics.clone(), req_rx);
    drop(progress);
    if let Some(server) = server {
        // Let a client waiting for the stop savepoint read its answer before the process ends.
        server.shutdown(Duration::from_secs(5));
    }
    let summary = format!(
        "in {} records, out {}, {} checkpoints ({} failed), {} restarts, {} injected faults, {:.1}s",
        metrics.records_in.get(),
        metrics.records_out.get(),
        metrics.checkpoints_completed.get(),
        metrics.checkpoints_failed.get(),
        metrics.restarts.get(),
        metrics.injected_faults.get(),
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

/// Validates a job file, or the inline job of a StreamJob manifest. A manifest is also checked for
/// values kubectl (YAML 1.1) reads as booleans where Weir (YAML 1.2) reads strings, e.g. `as: n`.
fn validate(path: &str) -> ExitCode {
    let text = match read_text(path) {
        Ok(t) => t,
        Err(code) => return code,
    };
    let ambiguous = match weir_crds::yaml11::ambiguous_scalars(&text) {
        Ok(found) => found,
        Err(e) => {
            eprintln!("error: {path} is not YAML: {e}");
            return ExitCode::from(2);
        }
    };
    let manifest: Option<serde_json::Value> = serde_yaml::from_str::<serde_json::Value>(&text)
        .ok()
        .filter(|v| v.get("kind").and_then(|k| k.as_str()) == Some("StreamJob"));
    let job_text = match &manifest {
        None => {
            for a in &ambiguous {
                eprintln!("warning: {path}: {a} (if this job is ever put inline into a StreamJob)");
            }
            text
        }
        Some(manifest) => {
            if !ambiguous.is_empty() {
                eprintln!("error: {path}: kubectl would change these values:");
                for a in &ambiguous {
                    eprintln!("  {a}");
                }
                return ExitCode::from(2);
            }
            match manifest.pointer("/spec/job/inline") {
                Some(inline) => serde_yaml::to_string(inline).unwrap_or_default(),
                None => {
                    eprintln!("{path}: the job is not inline (spec.job.configMapRef): validate that job file");
                    return ExitCode::SUCCESS;
                }
            }
        }
    };
    let job = match weir_runtime::load_job(&job_text) {
        Ok(job) => job,
        Err(e) => {
            let what = if manifest.is_some() { "spec.job.inline of " } else { "" };
            eprintln!("error: {what}{path} is not a valid job:\n{e}");
            return ExitCode::from(2);
        }
    };
    println!("job `{}` is valid; tasks:", job.spec.name);
    for v in weir_runtime::plan::build(&job) {
        let names: Vec<&str> = v.nodes.iter().map(|&n| job.nodes[n].name.as_str()).collect();
        println!("  {} × {}", names.join(" → "), v.parallelism);
    }
    // Valid wherever the runtime has every feature (the operator's image does), but this build
    // would refuse to run it.
    if let Some(missing) = weir_runtime::executor::missing_feature(&job) {
        eprintln!("warning: {path}: this build cannot run the job: {missing}");
    }
    ExitCode::SUCCESS
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

fn savepoint(
    addr: &str,
    stop: bool,
    drain: bool,
    token_file: Option<String>,
    tls_cert_file: Option<String>,
    timeout_secs: u64,
) -> ExitCode {
    let token = match read_token(token_file) {
        Ok(t) => t,
        Err(code) => return code,
    };
    let timeout = Duration::from_secs(timeout_secs);
    let client = match tls_cert_file {
        Some(file) => match read_text(&file) {
            Ok(pem) => weir_client::ControlClient::pinned(addr, token, pem.as_bytes()),
            Err(code) => return code,
        },
        None => weir_client::ControlClient::new(addr, token),
    };
    let client = match client {
        Ok(c) => c.wait_timeout(timeout),
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let request = weir_crds::control::SavepointRequest { drain, wait: true };
    let deadline = Instant::now() + timeout;
    weir_runtime::io().block_on(async {
        let answer = if stop { client.stop(&request).await } else { client.trigger_savepoint(&request).await };
        let accepted = match answer {
            Ok(a) => a,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        };
        if let Some(code) = finished_savepoint(&accepted) {
            return code;
        }
        // The runtime answers a waiting request after 600 s at most: poll for the rest.
        while Instant::now() < deadline {
            match client.savepoint(accepted.request_id).await {
                Ok(s) => {
                    if let Some(code) = finished_savepoint(&s) {
                        return code;
                    }
                }
                Err(e) => tracing::debug!("polling the savepoint: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        eprintln!("error: savepoint not complete after {timeout_secs}s");
        ExitCode::FAILURE
    })
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
