//! A runtime killed with SIGKILL is relaunched by the operator from the newest *valid*
//! checkpoint in storage, against a real API server and the real runtime run as a local
//! process; the output stays exactly once. The newest checkpoint is corrupted while the job is
//! down, keeping every file's length, so only the runtime (which verifies checksums) can tell:
//! the operator relaunches with `--restore latest` and the runtime falls back. (It used to pass
//! the checkpoint it had checked by lengths only, and the job crash-looped into Failed.)

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use weir_crds::StreamJob;
use weir_e2e::apiserver::TestApiServer;
use weir_e2e::local_pods::{runtime_binary, LocalPod};
use weir_operator::controller::{run, Settings};

mod common;
use common::*;

fn newest_complete(chk: &std::path::Path) -> Option<u64> {
    std::fs::read_dir(chk)
        .ok()?
        .flatten()
        .filter(|e| e.path().join("_metadata").exists())
        .filter_map(|e| weir_checkpoint::layout::parse_checkpoint_dir(&e.file_name().to_string_lossy()))
        .max()
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_runtime_is_relaunched_from_the_newest_valid_checkpoint() {
    let binary = runtime_binary();
    assert!(binary.exists(), "{} missing: build it with `cargo build -p weir-runtime`", binary.display());
    let ns = "relaunch";
    let (_server, client) = TestApiServer::with_namespace(ns).await.expect("API server with the CRD starts");
    let state = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let out = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    // Status refreshed every second: the relaunched run is short, and its notices (output moved
    // by the fallback) are read from its status while it runs.
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
        &counter_job(
            20000,
            out.path(),
            "  checkpointing: { interval: 200ms, retained: 3 }\n  relaunch: { backoff: 1s, limit: 3 }",
        ),
    )
    .await
    .unwrap();
    let first = eventually("first pod", 30, || async { pods.get_opt("counter-runtime-0").await.unwrap() }).await;
    let first_uid = first.metadata.uid.clone();
    let mut local = LocalPod::start(&client, &first, &binary).await.unwrap();
    point_operator_at(&jobs, "counter", &local.control_url).await;

    // Let a few checkpoints complete, then kill the runtime and corrupt its newest checkpoint.
    let chk = state.path().join("relaunch/counter/checkpoints");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    // ...and until the newest one's output is published, so the fallback must move it.
    let published = |n: u64| {
        std::fs::read_dir(out.path()).unwrap().flatten().any(|f| {
            let name = f.file_name().to_string_lossy().to_string();
            name.starts_with("part-") && name.contains(&format!("-{n:010}-"))
        })
    };
    let first_corrupt = loop {
        assert!(tokio::time::Instant::now() < deadline, "no checkpoints with output; log:\n{}", local.log());
        match newest_complete(&chk) {
            Some(n) if n >= 3 && published(n) => break n,
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    local.kill();
    let newest = newest_complete(&chk).unwrap();
    for id in first_corrupt..=newest {
        let dir = chk.join(format!("chk-{id}"));
        let Ok(bytes) = std::fs::read(dir.join("_metadata")) else { continue };
        let meta = weir_checkpoint::CheckpointMetadata::decode(&bytes).unwrap();
        // A file of this checkpoint only (not a shared base other checkpoints build on).
        let own = meta
            .files()
            .find(|f| !f.path.starts_with(".."))
            .expect("the checkpoint has a file of its own")
            .path
            .clone();
        let mut bytes = std::fs::read(dir.join(&own)).unwrap();
        let i = bytes.len() / 2;
        bytes[i] ^= 0x20;
        std::fs::write(dir.join(&own), bytes).unwrap();
    }
    assert_eq!(wait_exit(&mut local, "the killed runtime", 10).await, 137);

    // The operator relaunches from the previous checkpoint.
    let second = eventually("a relaunched pod", 60, || async {
        let p = pods.get_opt("counter-runtime-0").await.unwrap()?;
        (p.metadata.uid != first_uid).then_some(p)
    })
    .await;
    let args = second.spec.as_ref().unwrap().containers[0].args.as_ref().unwrap().join(" ");
    assert!(args.contains("--restore latest"), "the runtime chooses the restore point: {args}");
    // The count is written ahead of the pod (an operator dying in between loses nothing), and a
    // reconcile from a stale cache cannot write the old count back.
    let counted = jobs.get("counter").await.unwrap().status.unwrap_or_default().relaunch_count;
    assert_eq!(counted, 1, "relaunchCount is written before the relaunched pod exists");
    let mut local2 = LocalPod::start(&client, &second, &binary).await.unwrap();
    point_operator_at(&jobs, "counter", &local2.control_url).await;
    assert_eq!(wait_exit(&mut local2, "the relaunched runtime to finish", 90).await, 0, "{}", local2.log());
    let log = local2.log();
    assert!(
        log.contains("skipping a restore point") && log.contains(&format!("chk-{newest}")),
        "the corrupt checkpoint {newest} is skipped: {log}"
    );
    // The output of checkpoint {first_corrupt} was published before the fallback: it moved
    // under _superseded/, and the operator said so in an event.
    assert!(out.path().join("_superseded").exists(), "{log}");
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), ns);
    let moved = eventually("an OutputSuperseded event", 30, || async {
        events
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("OutputSuperseded"))
    })
    .await;
    assert!(moved.note.as_deref().unwrap_or_default().contains("_superseded"), "{moved:?}");
    eventually("Finished", 30, || async {
        (jobs.get("counter").await.unwrap().status?.phase == Some(weir_crds::streamjob::Phase::Finished)).then_some(())
    })
    .await;
    assert_eq!(assert_running_counts_exactly_once(out.path()), 20_000);
    controller.abort();
}
