//! A GitOps-style upgrade with `upgradeMode: savepoint`, against a real API server and the
//! real `weir-runtime` (run as a local process in place of a kubelet): the operator stops the
//! job with a savepoint, records it, replaces the pod, and the new pod restores from it. The
//! committed output across the upgrade is checked record by record: every running count of
//! every key exactly once. Before it, a change whose job could not read the running job's
//! state (the count's uid now also sums) is refused: nothing stops, the job is Degraded and
//! says why.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams, PostParams};
use weir_crds::StreamJob;
use weir_e2e::apiserver::TestApiServer;
use weir_e2e::local_pods::{runtime_binary, LocalPod};
use weir_operator::controller::{run, Settings};

mod common;
use common::*;

/// Input records: at 4,000 per second, time for a refused change and an upgrade.
const RECORDS: u64 = 40_000;

#[tokio::test(flavor = "multi_thread")]
async fn savepoint_upgrade_with_the_real_runtime_is_exactly_once() {
    let binary = runtime_binary();
    assert!(
        binary.exists(),
        "{} missing: build it with `cargo build -p weir-runtime` (cargo test --workspace does)",
        binary.display()
    );
    let ns = "upgrade";
    let (_server, client) = TestApiServer::with_namespace(ns).await.expect("API server with the CRD starts");
    // Shared by the operator and the "pod" process, so not under /tmp (the pod's scratch mount).
    let state = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let out = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let settings = Settings {
        status_refresh: Duration::from_secs(1),
        control_url_annotation: true,
        ..Settings::new(state.path().display().to_string())
    };
    let controller = tokio::spawn(run(client.clone(), settings));

    let jobs: Api<StreamJob> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    jobs.create(
        &PostParams::default(),
        &counter_job(RECORDS, out.path(), "  upgradeMode: savepoint\n  checkpointing: { interval: 300ms }"),
    )
    .await
    .unwrap();

    let first = eventually("first pod", 30, || async { pods.get_opt("counter-runtime-0").await.unwrap() }).await;
    let first_hash = first.metadata.labels.as_ref().unwrap()["weir.dev/spec-hash"].clone();
    let mut local = LocalPod::start(&client, &first, &binary).await.unwrap();
    point_operator_at(&jobs, "counter", &local.control_url).await;
    eventually("Running", 30, || async {
        (jobs.get("counter").await.unwrap().status?.phase == Some(weir_crds::streamjob::Phase::Running)).then_some(())
    })
    .await;
    let chk_dir = state.path().join("upgrade/counter/checkpoints");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !std::fs::read_dir(&chk_dir)
        .map(|d| d.flatten().any(|e| e.path().join("_metadata").exists()))
        .unwrap_or(false)
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no checkpoint in {}; runtime log:\n{}",
            chk_dir.display(),
            local.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Status shows the runtime's newest checkpoint.
    let shown = eventually("newest checkpoint in status", 30, || async {
        jobs.get("counter").await.unwrap().status?.latest_checkpoint
    })
    .await;
    assert!(shown.path.contains("/checkpoints/chk-") && shown.completed_at.is_some(), "{shown:?}");
    assert!(jobs.get("counter").await.unwrap().status.unwrap().job_id.is_some());

    // A change the state cannot follow: `counts` also sums. Refused before the savepoint.
    let counting = jobs.get("counter").await.unwrap().spec.job.inline.unwrap().operators;
    let mut summing = serde_json::to_value(&counting).unwrap();
    summing[1]["aggregate"]["aggregates"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({ "fn": "sum", "field": "k", "as": "total" }));
    let operators =
        |ops: serde_json::Value| serde_json::json!({ "spec": { "job": { "inline": { "operators": ops } } } });
    jobs.patch("counter", &PatchParams::default(), &Patch::Merge(operators(summing))).await.unwrap();
    let message = degraded(&jobs, "counter", "NeedsAttention").await;
    assert!(
        message.contains("is not applied and the running job goes on: checkpoint ")
            && message.contains(
                "operator uid `counts` holds aggregate[count] state in the snapshot and is \
                                 aggregate[count,sum] in the job"
            ),
        "{message}"
    );
    assert!(warning_event(&client, ns, "counter", "UpgradeRefused").await.contains("operator uid `counts`"));
    assert_eq!(local.reap().await.unwrap(), None, "the runtime goes on; log:\n{}", local.log());
    let pod = pods.get("counter-runtime-0").await.unwrap();
    assert_eq!(pod.metadata.uid, first.metadata.uid, "the pod is not replaced");

    // The GitOps change: the aggregates as they were, and another parallelism.
    let mut change = operators(serde_json::to_value(&counting).unwrap());
    change["spec"]["parallelism"] = serde_json::json!(2);
    jobs.patch("counter", &PatchParams::default(), &Patch::Merge(change)).await.unwrap();
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
    point_operator_at(&jobs, "counter", &local2.control_url).await;
    let code = wait_exit(&mut local2, "the new runtime to finish", 90).await;
    assert_eq!(code, 0, "new runtime log:\n{}", local2.log());
    eventually("Finished", 30, || async {
        (jobs.get("counter").await.unwrap().status?.phase == Some(weir_crds::streamjob::Phase::Finished)).then_some(())
    })
    .await;

    // Every running count of every key, exactly once, across the upgrade.
    assert_eq!(assert_running_counts_exactly_once(out.path()), RECORDS as usize, "one output per input record");
    controller.abort();
}
