//! A GitOps-style upgrade with `upgradeMode: savepoint`, against a real API server and the
//! real `weir-runtime` (run as a local process in place of a kubelet): the operator stops the
//! job with a savepoint, records it, replaces the pod, and the new pod restores from it. The
//! committed output across the upgrade is checked record by record: every running count of
//! every key exactly once.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams, PostParams};
use weir_crds::StreamJob;
use weir_e2e::apiserver::TestApiServer;
use weir_e2e::local_pods::{runtime_binary, LocalPod};
use weir_operator::controller::{run, Settings};

mod common;
use common::*;

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
    let settings =
        Settings { status_refresh: Duration::from_secs(1), ..Settings::new(state.path().display().to_string()) };
    let controller = tokio::spawn(run(client.clone(), settings));

    let jobs: Api<StreamJob> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    jobs.create(
        &PostParams::default(),
        &counter_job(24000, out.path(), "  upgradeMode: savepoint\n  checkpointing: { interval: 300ms }"),
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

    // The GitOps change.
    jobs.patch("counter", &PatchParams::default(), &Patch::Merge(serde_json::json!({ "spec": { "parallelism": 2 } })))
        .await
        .unwrap();
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
    assert_eq!(assert_running_counts_exactly_once(out.path()), 24_000, "one output per input record");
    controller.abort();
}
