//! Operator figures (not a timed test): RSS idle and with N StreamJobs, reconcile p50/p99,
//! and the time from creating a StreamJob to its pod existing, against a real kube-apiserver.
//! `cargo bench -p weir-operator --bench operator` uses 1,000 jobs; under `cargo test` it runs
//! as a smoke test with 20.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use weir_crds::StreamJob;
use weir_e2e::apiserver::TestApiServer;
use weir_operator::controller::{run_with_metrics, Settings};
use weir_operator::metrics::OperatorMetrics;

fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok()).unwrap_or(0.0) / 1024.0
}

fn job(name: &str) -> StreamJob {
    serde_yaml::from_str(&format!(
        r#"
apiVersion: weir.dev/v1alpha1
kind: StreamJob
metadata: {{ name: {name} }}
spec:
  image: weir-runtime:dev
  parallelism: 1
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
    let n: usize = std::env::var("WEIR_BENCH_JOBS").ok().and_then(|v| v.parse().ok()).unwrap_or(if smoke { 20 } else { 1000 });
    let ns = "bench";
    let (_server, client) = TestApiServer::with_namespace(ns).await.expect("API server with the CRD starts");
    let storage = tempfile::tempdir().unwrap();
    let metrics = OperatorMetrics::shared();
    let rss_before = rss_mib();
    tokio::spawn(run_with_metrics(client.clone(), Settings::new(storage.path().display().to_string()), metrics.clone()));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_idle = rss_mib();

    let jobs: Api<StreamJob> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let started = Instant::now();
    let mut to_pod = Vec::new();
    for i in 0..n {
        let name = format!("job-{i}");
        let t0 = Instant::now();
        jobs.create(&PostParams::default(), &job(&name)).await.unwrap();
        // Sample the apply → pod latency on every 50th job (the others are created back to back).
        if i % 50 == 0 {
            let pod = format!("{name}-runtime-0");
            while pods.get_opt(&pod).await.unwrap().is_none() {
                assert!(t0.elapsed() < Duration::from_secs(120), "no pod for {name}");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            to_pod.push(t0.elapsed().as_millis() as u64);
        }
    }
    // Wait until every job has its pod.
    loop {
        let count = pods.list(&Default::default()).await.unwrap().items.len();
        if count >= n {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(1800), "only {count} of {n} pods");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let all_deployed = started.elapsed();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let rss_loaded = rss_mib();
    to_pod.sort_unstable();
    let reconciles = metrics.reconciles.load(Ordering::Relaxed);
    println!("operator with {n} StreamJobs on a real kube-apiserver (controller in this process):");
    println!("| figure | value |\n|---|---|");
    println!("| RSS before the controller | {rss_before:.1} MiB |");
    println!("| RSS idle (controller running, no jobs) | {rss_idle:.1} MiB |");
    println!("| RSS with {n} jobs | {rss_loaded:.1} MiB |");
    println!("| reconciles | {reconciles} |");
    println!("| reconcile p50 / p99 | {:.1} ms / {:.1} ms |", metrics.reconcile_quantile(0.5) as f64 / 1000.0, metrics.reconcile_quantile(0.99) as f64 / 1000.0);
    println!("| create → pod exists (sampled, p50 / max) | {} ms / {} ms |", to_pod[to_pod.len() / 2], to_pod[to_pod.len() - 1]);
    println!("| all {n} jobs deployed | {:.1} s |", all_deployed.as_secs_f64());
    if smoke {
        assert!(reconciles as usize >= n);
        println!("1 passed, 0 failed");
    }
}
