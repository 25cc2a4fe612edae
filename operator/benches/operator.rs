//! Operator figures (not a timed test): RSS idle and with N StreamJobs, reconcile p50/p99 over
//! all reconciles and in the steady state after the last deploy, and the time from creating a
//! StreamJob to its pod existing while 16 other jobs point at storage that accepts connections
//! and never answers (a black hole): the `weir-operator` binary runs as its own process against
//! a real kube-apiserver, and is measured from outside. `cargo bench -p weir-operator --bench
//! operator` uses 1,000 jobs (`WEIR_BENCH_JOBS` sets it); under `cargo test` it runs as a smoke
//! test with 20 jobs and 2 black-holed ones.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, ListParams, PostParams};
use weir_crds::StreamJob;
use weir_e2e::apiserver::TestApiServer;

/// Resident memory of a process, MiB.
fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .unwrap_or(0.0)
        / 1024.0
}

/// One HTTP GET on loopback; the body of a 200 answer.
async fn http_get(addr: &str, path: &str) -> Option<String> {
    let answer =
        reqwest::Client::builder().no_proxy().build().ok()?.get(format!("http://{addr}{path}")).send().await.ok()?;
    answer.status().is_success().then_some(())?;
    answer.text().await.ok()
}

/// The `q` quantile of a histogram in Prometheus text: the upper bound of the first bucket that
/// holds it (what `histogram_quantile` would interpolate inside).
fn histogram_quantile(text: &str, name: &str, q: f64) -> f64 {
    let prefix = format!("{name}_bucket{{le=\"");
    let buckets: Vec<(f64, f64)> = text
        .lines()
        .filter_map(|l| {
            let (le, count) = l.strip_prefix(&prefix)?.split_once("\"} ")?;
            Some((if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? }, count.trim().parse().ok()?))
        })
        .collect();
    let total = buckets.last().map_or(0.0, |b| b.1);
    buckets.iter().find(|(_, n)| *n >= q * total).map_or(f64::NAN, |b| b.0)
}

/// The buckets of histogram `name` in `later` minus those in `earlier`, as a histogram text of
/// the same name: the reconciles between two scrapes.
fn histogram_between(earlier: &str, later: &str, name: &str) -> String {
    let prefix = format!("{name}_bucket{{");
    let counts = |text: &str| -> Vec<(String, f64)> {
        text.lines()
            .filter(|l| l.starts_with(&prefix))
            .filter_map(|l| {
                let (key, count) = l.rsplit_once(' ')?;
                Some((key.to_string(), count.parse().ok()?))
            })
            .collect()
    };
    let before: std::collections::HashMap<String, f64> = counts(earlier).into_iter().collect();
    counts(later)
        .into_iter()
        .map(|(key, n)| format!("{key} {}\n", n - before.get(&key).copied().unwrap_or(0.0)))
        .collect()
}

/// A listener that accepts connections and never answers: storage that has gone silent.
fn black_hole() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            held.push(stream);
        }
    });
    format!("http://{addr}")
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok()).unwrap_or(f64::NAN)
}

/// The operator process; killed when dropped.
struct Operator(std::process::Child);

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn job(name: &str, extra: &str) -> StreamJob {
    serde_yaml::from_str(&format!(
        r#"
apiVersion: weir.dev/v1alpha1
kind: StreamJob
metadata: {{ name: {name} }}
spec:
  image: weir-runtime:dev
  parallelism: 1
{extra}
  job:
    inline:
      sources: [ {{ name: s, uid: s, generator: {{ fields: [ {{ name: a, sequence: {{}} }} ] }} }} ]
      sinks: [ {{ name: o, stdout: {{}} }} ]
"#
    ))
    .unwrap()
}

#[tokio::main]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let smoke = !std::env::args().any(|a| a == "--bench");
    let n: usize =
        std::env::var("WEIR_BENCH_JOBS").ok().and_then(|v| v.parse().ok()).unwrap_or(if smoke { 20 } else { 1000 });
    let ns = "bench";
    let (server, client) = TestApiServer::with_namespace(ns).await.expect("API server with the CRD starts");
    let storage = tempfile::tempdir().unwrap();

    // The real operator binary, as users run it out of cluster.
    let http = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    // `WEIR_BENCH_WRAPPER` runs the operator under a profiler (`heaptrack`, `perf record --`).
    let wrapper: Vec<String> =
        std::env::var("WEIR_BENCH_WRAPPER").unwrap_or_default().split_whitespace().map(String::from).collect();
    let mut command = match wrapper.split_first() {
        Some((program, args)) => {
            let mut c = std::process::Command::new(program);
            c.args(args).arg(env!("CARGO_BIN_EXE_weir-operator"));
            c
        }
        None => std::process::Command::new(env!("CARGO_BIN_EXE_weir-operator")),
    };
    let child = command
        .args([
            "--kubeconfig",
            &server.kubeconfig().display().to_string(),
            "--default-storage",
            &storage.path().display().to_string(),
            "--http-addr",
            &http,
        ])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("weir-operator starts");
    let operator = Operator(child);
    let pid = operator.0.id();
    let deadline = Instant::now() + Duration::from_secs(60);
    while http_get(&http, "/readyz").await.is_none() {
        assert!(Instant::now() < deadline, "weir-operator not ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_idle = rss_mib(pid);

    let jobs: Api<StreamJob> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    // Jobs whose own storage is a black hole: each deploy first lists its checkpoints there.
    let stuck = if smoke { 2 } else { 16 };
    let keys: Secret = serde_yaml::from_str(&format!(
        "metadata: {{ name: silent-keys }}\nstringData: {{ AWS_ACCESS_KEY_ID: k, AWS_SECRET_ACCESS_KEY: s, \
         AWS_REGION: us-east-1, AWS_ALLOW_HTTP: \"true\", AWS_ENDPOINT: \"{}\" }}",
        black_hole()
    ))
    .unwrap();
    Api::<Secret>::namespaced(client.clone(), ns).create(&PostParams::default(), &keys).await.unwrap();
    let silent = "  checkpointing: { storage: \"s3://silent/weir\", credentialsSecret: { name: silent-keys } }";
    for i in 0..stuck {
        jobs.create(&PostParams::default(), &job(&format!("stuck-{i}"), silent)).await.unwrap();
    }
    let started = Instant::now();
    let mut to_pod = Vec::new();
    for i in 0..n {
        let name = format!("job-{i}");
        let t0 = Instant::now();
        jobs.create(&PostParams::default(), &job(&name, "")).await.unwrap();
        // Sample the apply → pod latency on every 50th job (the others are created back to back).
        if i % 50 == 0 {
            let pod = format!("{name}-runtime-0");
            while pods.get_opt(&pod).await.unwrap().is_none() {
                assert!(
                    t0.elapsed() < Duration::from_secs(120),
                    "no pod for {name}; operator metrics:\n{}",
                    http_get(&http, "/metrics").await.unwrap_or_default()
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            to_pod.push(t0.elapsed().as_millis() as u64);
        }
    }
    // Wait until every job (but the black-holed ones) has its pod.
    loop {
        let count = pods.list(&ListParams::default().labels("weir.dev/job")).await.unwrap().items.len();
        if count >= n {
            assert_eq!(count, n, "a black-holed job was deployed");
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(1800), "only {count} of {n} pods");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let all_deployed = started.elapsed();
    // Steady state: every job reconciled again (requeues) for a while, measured on its own.
    let settle = Duration::from_secs(if smoke { 1 } else { 20 });
    tokio::time::sleep(settle).await;
    let steady_from = http_get(&http, "/metrics").await.expect("metrics");
    let window = Duration::from_secs(if smoke { 2 } else { 90 });
    tokio::time::sleep(window).await;
    let rss_loaded = rss_mib(pid);
    to_pod.sort_unstable();
    let m = http_get(&http, "/metrics").await.expect("metrics");
    let hist = "weir_operator_reconcile_duration_seconds";
    let steady = histogram_between(&steady_from, &m, hist);
    let reconciles = metric(&m, "weir_operator_reconciles_total");
    println!("weir-operator (release binary, separate process) with {n} StreamJobs on a real kube-apiserver:");
    println!("| figure | value |\n|---|---|");
    println!("| RSS idle (no jobs) | {rss_idle:.1} MiB |");
    let after = (settle + window).as_secs();
    println!("| RSS with {n} jobs, {after} s after the last pod | {rss_loaded:.1} MiB |");
    println!("| reconciles | {reconciles} |");
    println!(
        "| reconcile p50 / p99 (histogram bucket bounds) | ≤ {:.0} ms / ≤ {:.0} ms |",
        histogram_quantile(&m, "weir_operator_reconcile_duration_seconds", 0.5) * 1000.0,
        histogram_quantile(&m, "weir_operator_reconcile_duration_seconds", 0.99) * 1000.0
    );
    println!(
        "| steady state ({} s from {} s after the last pod): reconciles, p50 / p99 | {} / ≤ {:.0} ms / \
         ≤ {:.0} ms |",
        window.as_secs(),
        settle.as_secs(),
        metric(&m, "weir_operator_reconciles_total") - metric(&steady_from, "weir_operator_reconciles_total"),
        histogram_quantile(&steady, hist, 0.5) * 1000.0,
        histogram_quantile(&steady, hist, 0.99) * 1000.0
    );
    println!(
        "| create → pod exists, {stuck} black-holed jobs retrying (sampled, p50 / max) | {} ms / {} ms |",
        to_pod[to_pod.len() / 2],
        to_pod[to_pod.len() - 1]
    );
    println!("| all {n} jobs deployed | {:.1} s |", all_deployed.as_secs_f64());
    let failed: f64 = m
        .lines()
        .filter(|l| l.starts_with("weir_operator_reconcile_errors_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>()
        .abs();
    println!("| failed reconciles (the black-holed jobs' attempts) | {failed} |");
    let by_category: Vec<&str> = m.lines().filter(|l| l.starts_with("weir_operator_reconcile_errors_total{")).collect();
    println!("| failures by category | {} |", by_category.join("; "));
    if smoke {
        assert!(reconciles as usize >= n);
        println!("1 passed, 0 failed");
    }
}
