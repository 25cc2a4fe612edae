//! A GitOps-style upgrade with `upgradeMode: savepoint`, against a real API server and the
//! real `weir-runtime` (run as a local process in place of a kubelet): the operator stops the
//! job with a savepoint, records it, replaces the pod, and the new pod restores from it. The
//! committed output across the upgrade is checked record by record: every running count of
//! every key exactly once.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use kube::api::{Api, Patch, PatchParams, PostParams};
use weir_crds::StreamJob;
use weir_e2e::apiserver::TestApiServer;
use weir_e2e::local_pods::{runtime_binary, LocalPod};
use weir_operator::controller::{run, Settings, CONTROL_URL_ANNOTATION};

async fn eventually<T, F, Fut>(what: &str, secs: u64, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits for a local runtime process to exit (reporting it in its pod's status).
async fn wait_exit(pod: &mut LocalPod, what: &str, secs: u64) -> i32 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(code) = pod.reap().await.unwrap() {
            return code;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for: {what}; log:\n{}", pod.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn point_operator_at(jobs: &Api<StreamJob>, url: &str) {
    let patch = serde_json::json!({ "metadata": { "annotations": { CONTROL_URL_ANNOTATION: url } } });
    jobs.patch("counter", &PatchParams::default(), &Patch::Merge(patch)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn savepoint_upgrade_with_the_real_runtime_is_exactly_once() {
    let binary = runtime_binary();
    assert!(binary.exists(), "{} missing: build it with `cargo build -p weir-runtime` (cargo test --workspace does)", binary.display());
    let server = TestApiServer::start().expect("API server starts");
    let client = server.client().await.unwrap();
    server.install_crd(&client).await.unwrap();
    let ns = "upgrade";
    Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &serde_yaml::from_str(&format!("metadata: {{ name: {ns} }}")).unwrap()).await.unwrap();
    Api::<ServiceAccount>::namespaced(client.clone(), ns).create(&PostParams::default(), &serde_yaml::from_str("metadata: { name: default }").unwrap()).await.unwrap();
    // Shared by the operator and the "pod" process, so not under /tmp (the pod's scratch mount).
    let state = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let out = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let controller = tokio::spawn(run(client.clone(), Settings { default_storage: state.path().display().to_string() }));

    let manifest = format!(
        r#"
apiVersion: weir.dev/v1alpha1
kind: StreamJob
metadata: {{ name: counter }}
spec:
  image: weir-runtime:dev
  parallelism: 1
  upgradeMode: savepoint
  checkpointing: {{ interval: 300ms }}
  job:
    inline:
      sources: [ {{ name: events, uid: events, generator: {{ count: 24000, ratePerSecond: 4000, fields: [ {{ name: k, modulo: 40 }} ] }} }} ]
      operators:
        - {{ name: by-k, keyBy: {{ fields: [k] }} }}
        - {{ name: counts, uid: counts, aggregate: {{ aggregates: [ {{ fn: count, as: n }} ] }} }}
      sinks: [ {{ name: out, uid: out, file: {{ path: {} }} }} ]
"#,
        out.path().display()
    );
    let jobs: Api<StreamJob> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    jobs.create(&PostParams::default(), &serde_yaml::from_str(&manifest).unwrap()).await.unwrap();

    let first = eventually("first pod", 30, || async { pods.get_opt("counter-runtime-0").await.unwrap() }).await;
    let first_hash = first.metadata.labels.as_ref().unwrap()["weir.dev/spec-hash"].clone();
    let mut local = LocalPod::start(&client, &first, &binary).await.unwrap();
    point_operator_at(&jobs, &local.control_url).await;
    eventually("Running", 30, || async { (jobs.get("counter").await.unwrap().status?.phase.as_deref() == Some("Running")).then_some(()) }).await;
    let chk_dir = state.path().join("upgrade/counter/checkpoints");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !std::fs::read_dir(&chk_dir).map(|d| d.flatten().any(|e| e.path().join("_metadata").exists())).unwrap_or(false) {
        assert!(tokio::time::Instant::now() < deadline, "no checkpoint in {}; runtime log:\n{}", chk_dir.display(), local.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The GitOps change.
    jobs.patch("counter", &PatchParams::default(), &Patch::Merge(serde_json::json!({ "spec": { "parallelism": 2 } }))).await.unwrap();
    // The operator stops the job with a savepoint; the runtime exits and reports it.
    let code = wait_exit(&mut local, "the old runtime to stop", 60).await;
    assert_eq!(code, 0, "old runtime log:\n{}", local.log());
    let second = eventually("the pod of the new spec", 60, || async {
        let p = pods.get_opt("counter-runtime-0").await.unwrap()?;
        (p.metadata.labels.as_ref()?["weir.dev/spec-hash"] != first_hash).then_some(p)
    })
    .await;
    let args = second.spec.as_ref().unwrap().containers[0].args.as_ref().unwrap().join(" ");
    let status = jobs.get("counter").await.unwrap().status.unwrap();
    let savepoint = status.latest_savepoint.expect("savepoint recorded in status").path;
    assert!(savepoint.contains("/savepoints/sp-"), "{savepoint}");
    assert!(args.contains(&format!("--restore {savepoint}")), "new pod restores from the savepoint: {args}");

    let mut local2 = LocalPod::start(&client, &second, &binary).await.unwrap();
    point_operator_at(&jobs, &local2.control_url).await;
    let code = wait_exit(&mut local2, "the new runtime to finish", 90).await;
    assert_eq!(code, 0, "new runtime log:\n{}", local2.log());
    eventually("Finished", 30, || async { (jobs.get("counter").await.unwrap().status?.phase.as_deref() == Some("Finished")).then_some(()) }).await;

    // Every running count of every key, exactly once, across the upgrade.
    let mut per_key: BTreeMap<i64, Vec<i64>> = BTreeMap::new();
    let mut total = 0;
    for f in std::fs::read_dir(out.path()).unwrap().flatten() {
        let name = f.file_name().to_string_lossy().to_string();
        if name.starts_with('.') || name.starts_with('_') {
            continue;
        }
        for line in std::fs::read_to_string(f.path()).unwrap().lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            per_key.entry(v["k"].as_i64().unwrap()).or_default().push(v["n"].as_i64().unwrap());
            total += 1;
        }
    }
    assert_eq!(total, 24_000, "one output per input record");
    for (k, mut counts) in per_key {
        counts.sort_unstable();
        let expected: Vec<i64> = (1..=counts.len() as i64).collect();
        assert_eq!(counts, expected, "key {k}: a count lost or duplicated across the upgrade");
    }
    controller.abort();
}
