//! The generated CRD on a real kube-apiserver + etcd: a valid StreamJob is stored, and invalid
//! manifests are refused at apply time with the field path and the reason.

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use weir_crds::StreamJob;
use weir_e2e::apiserver::TestApiServer;

const VALID: &str = r#"
apiVersion: weir.dev/v1alpha1
kind: StreamJob
metadata: { name: NAME }
spec:
  image: weir-runtime:dev
  parallelism: 2
  maxParallelism: 64
  job:
    inline:
      sources: [ { name: s, uid: s, generator: { fields: [ { name: a, sequence: {} } ] } } ]
      operators:
        - { name: k, keyBy: { fields: [a] } }
        - { name: w, uid: w, window: { type: tumbling, size: 1s, aggregates: [ { fn: count, as: n } ] } }
      sinks: [ { name: o, stdout: {} } ]
  checkpointing: { interval: 5s, retained: 3, storage: "s3://weir-bucket/jobs" }
  savepoint: { timeout: 2m }
  relaunch: { backoff: 10s, limit: 3 }
"#;

fn manifest(name: &str, from: &str, to: &str) -> DynamicObject {
    let base = VALID.replace("NAME", name);
    assert!(from.is_empty() || base.contains(from), "fixture lacks `{from}`");
    let text = if from.is_empty() { base } else { base.replacen(from, to, 1) };
    serde_yaml::from_str(&text).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn invalid_manifests_are_refused_with_field_and_reason() {
    let server = TestApiServer::start().expect("API server starts");
    let client = server.client().await.unwrap();
    server.install_crd(&client).await.unwrap();
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_yaml::from_str("metadata: { name: crd-validation }").unwrap();
    namespaces.create(&PostParams::default(), &ns).await.unwrap();
    let ar = ApiResource::erase::<StreamJob>(&());
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), "crd-validation", &ar);

    // The valid one is accepted and reads back as a typed StreamJob.
    api.create(&PostParams::default(), &manifest("ok", "", "")).await.expect("valid manifest accepted");
    let typed: Api<StreamJob> = Api::namespaced(client.clone(), "crd-validation");
    let got = typed.get("ok").await.unwrap();
    assert_eq!(got.spec.parallelism, 2);
    assert_eq!(got.spec.checkpointing.retained, 3);

    let cases: Vec<(&str, &str, &str)> = vec![
        ("interval: 5s", "interval: -1s", "spec.checkpointing.interval"),
        ("interval: 5s", "interval: 0s", "must be > 0"),
        ("retained: 3", "retained: 0", "spec.checkpointing.retained"),
        ("parallelism: 2", "parallelism: 0", "spec.parallelism"),
        ("maxParallelism: 64", "maxParallelism: 1", "maxParallelism (default 128) must be >= parallelism"),
        ("storage: \"s3://weir-bucket/jobs\"", "storage: \"ftp://host/x\"", "storage must be s3://bucket"),
        ("storage: \"s3://weir-bucket/jobs\"", "storage: \"s3://\"", "storage must be s3://bucket"),
        ("  savepoint: { timeout: 2m }", "  savepoint: { timeout: soon }", "spec.savepoint.timeout"),
        ("relaunch: { backoff: 10s", "relaunch: { backoff: 10", "spec.relaunch.backoff"),
        ("  parallelism: 2\n", "  parallelism: 2\n  upgradeMode: yolo\n", "spec.upgradeMode"),
        ("  parallelism: 2\n", "  parallelism: 2\n  state: paused\n", "spec.state"),
        (
            "  parallelism: 2\n",
            "  parallelism: 2\n  imagePullPolicy: Sometimes\n",
            "must be Always, IfNotPresent or Never",
        ),
        ("  image: weir-runtime:dev\n", "", "spec.image"),
        (
            "  job:\n    inline:",
            "  job:\n    configMapRef: { name: jobs }\n    inline:",
            "set exactly one of inline or configMapRef",
        ),
        ("checkpointing: { interval: 5s,", "checkpointing: { mode: twice, interval: 5s,", "spec.checkpointing.mode"),
        (
            "checkpointing: { interval: 5s,",
            "checkpointing: { maxConcurrent: 0, interval: 5s,",
            "spec.checkpointing.maxConcurrent",
        ),
        ("type: tumbling", "type: hopping", "spec.job.inline.operators[1].window.type"),
        ("{ fn: count, as: n }", "{ fn: median, as: n }", "fn"),
        // What kubectl sends for an unquoted `as: n` (YAML 1.1 reads it as a boolean): refused
        // as a type error naming the field and "boolean" (README, "YAML 1.1 and field names").
        ("{ fn: count, as: n }", "{ fn: count, as: false }", "spec.job.inline.operators[1].window.aggregates[0].as"),
        ("{ fn: count, as: n }", "{ fn: count, as: false }", "must be of type string: \"boolean\""),
        (
            "{ name: a, sequence: {} }",
            "{ name: true, sequence: {} }",
            "spec.job.inline.sources[0].generator.fields[0].name",
        ),
        (
            "  image: weir-runtime:dev\n",
            "  image: \"\"\n",
            "spec.image: Invalid value: \"\": must name the runtime image",
        ),
        (
            "  savepoint: { timeout: 2m }",
            "  savepoint: { timeout: 0s }",
            "spec.savepoint.timeout: Invalid value: \"0s\": must be > 0",
        ),
        ("  savepoint: { timeout: 2m }", "  savepoint: { timeout: \"0\" }", "spec.savepoint.timeout"),
        (
            "checkpointing: { interval: 5s,",
            "checkpointing: { timeout: 0ms, interval: 5s,",
            "spec.checkpointing.timeout",
        ),
        ("relaunch: { backoff: 10s,", "relaunch: { backoff: 10s, maxBackoff: 5s,", "maxBackoff must be >= backoff"),
        (
            "relaunch: { backoff: 10s,",
            "relaunch: { maxCheckpointAge: 0s, backoff: 10s,",
            "spec.relaunch.maxCheckpointAge",
        ),
        // Kafka nodes: rules within one connector are CEL at apply time.
        (
            "sinks: [ { name: o, stdout: {} } ]",
            "sinks: [ { name: o, uid: o, kafka: { bootstrapServers: \"k:9092\", topic: t, format: raw } } ]",
            "spec.job.inline.sinks[0].kafka: Invalid value: valueField is required with format: raw",
        ),
        (
            "sources: [ { name: s, uid: s, generator: { fields: [ { name: a, sequence: {} } ] } } ]",
            "sources: [ { name: s, uid: s, kafka: { bootstrapServers: \"k:9092\", topics: [] } } ]",
            "spec.job.inline.sources[0].kafka: Invalid value: at least one topic is required",
        ),
        (
            "sources: [ { name: s, uid: s, generator: { fields: [ { name: a, sequence: {} } ] } } ]",
            "sources: [ { name: s, uid: s, kafka: { bootstrapServers: \"k:9092\", topics: [a], \
             startFrom: timestamp } } ]",
            "startTimestampMs is required with startFrom: timestamp",
        ),
        (
            "sources: [ { name: s, uid: s, generator: { fields: [ { name: a, sequence: {} } ] } } ]",
            "sources: [ { name: s, uid: s, kafka: { bootstrapServers: \"k:9092\", topics: [a], \
             startFrom: newest } } ]",
            "spec.job.inline.sources[0].kafka.startFrom",
        ),
    ];
    assert!(cases.len() >= 15);
    for (i, (from, to, expected)) in cases.iter().enumerate() {
        let name = format!("bad-{i}");
        match api.create(&PostParams::default(), &manifest(&name, from, to)).await {
            Err(kube::Error::Api(e)) => {
                assert_eq!(e.code, 422, "case {i}: {}", e.message);
                assert!(e.message.contains(expected), "case {i}: expected `{expected}` in: {}", e.message);
            }
            other => panic!("case {i} (`{to}`) was not refused: {other:?}"),
        }
    }

    // Names: the job's Service `<name>-control` must be a DNS label, so at most 55 characters,
    // starting with a letter, no dots. The longest allowed name is accepted.
    let longest = "j".repeat(weir_crds::streamjob::MAX_NAME_LEN);
    api.create(&PostParams::default(), &manifest(&longest, "", "")).await.expect("a 55-character name");
    for name in ["j".repeat(weir_crds::streamjob::MAX_NAME_LEN + 1), "1job".into(), "my.job".into()] {
        match api.create(&PostParams::default(), &manifest(&name, "", "")).await {
            Err(kube::Error::Api(e)) => {
                assert!(
                    e.code == 422 && e.message.contains("metadata.name must be at most 55"),
                    "{name}: {}",
                    e.message
                )
            }
            other => panic!("name `{name}` was not refused: {other:?}"),
        }
        let stored = serde_yaml::from_str::<StreamJob>(&VALID.replace("NAME", &name)).unwrap();
        assert!(
            weir_crds::streamjob::spec_violations(&name, &stored.spec).iter().any(|v| v.path == "metadata.name"),
            "the operator's own check refuses `{name}` too"
        );
    }

    // maxParallelism is immutable once set.
    let mut changed = api.get("ok").await.unwrap();
    changed.data["spec"]["maxParallelism"] = serde_json::json!(32);
    match api.replace("ok", &PostParams::default(), &changed).await {
        Err(kube::Error::Api(e)) => assert!(e.message.contains("maxParallelism cannot change"), "{}", e.message),
        other => panic!("maxParallelism change accepted: {other:?}"),
    }
    // Unset means 128: setting it later to another value is the same change, refused; to 128,
    // accepted.
    api.create(&PostParams::default(), &manifest("unset", "  maxParallelism: 64\n", ""))
        .await
        .expect("a job without maxParallelism");
    let mut set = api.get("unset").await.unwrap();
    set.data["spec"]["maxParallelism"] = serde_json::json!(64);
    match api.replace("unset", &PostParams::default(), &set).await {
        Err(kube::Error::Api(e)) => assert!(e.message.contains("unset means 128"), "{}", e.message),
        other => panic!("maxParallelism unset → 64 accepted: {other:?}"),
    }
    set.data["spec"]["maxParallelism"] = serde_json::json!(128);
    api.replace("unset", &PostParams::default(), &set).await.expect("unset → 128 is no change");
}

/// Status fields the planner acts on are schema enums and timestamps: an unparsable
/// `operation.startedAt` used to read as "started in 1970", a timed-out savepoint, and killed
/// the job's pods. Now the API server refuses such a status, naming the field.
#[tokio::test(flavor = "multi_thread")]
async fn a_status_with_an_unparsable_time_or_unknown_phase_is_refused() {
    use kube::api::{Patch, PatchParams};
    let server = TestApiServer::start().expect("API server starts");
    let client = server.client().await.unwrap();
    server.install_crd(&client).await.unwrap();
    let ar = ApiResource::erase::<StreamJob>(&());
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), "default", &ar);
    api.create(&PostParams::default(), &manifest("st", "", "")).await.unwrap();
    let good = serde_json::json!({ "status": {
        "phase": "Running",
        "operation": { "kind": "cancel", "startedAt": "2026-11-30T12:00:00Z", "generation": 1 }
    } });
    api.patch_status("st", &PatchParams::default(), &Patch::Merge(good)).await.expect("a well-formed status is stored");
    let typed: Api<StreamJob> = Api::namespaced(client.clone(), "default");
    let op = typed.get("st").await.unwrap().status.unwrap().operation.unwrap();
    assert_eq!(op.kind, weir_crds::streamjob::OperationKind::Cancel);
    for (status, field) in [
        (
            serde_json::json!({ "operation": { "kind": "cancel", "startedAt": "yesterday", "generation": 1 } }),
            "status.operation.startedAt",
        ),
        (
            serde_json::json!({ "operation": { "kind": "nap", "startedAt": "2026-11-30T12:00:00Z", "generation": 1 } }),
            "status.operation.kind",
        ),
        (serde_json::json!({ "phase": "Sleeping" }), "status.phase"),
        (serde_json::json!({ "lastRelaunchTime": "soon" }), "status.lastRelaunchTime"),
    ] {
        match api
            .patch_status("st", &PatchParams::default(), &Patch::Merge(serde_json::json!({ "status": status })))
            .await
        {
            Err(kube::Error::Api(e)) => assert!(e.code == 422 && e.message.contains(field), "{field}: {}", e.message),
            other => panic!("{field}: a malformed status was stored: {other:?}"),
        }
    }
}

/// A write-ahead decision (an upgrade's restore point) is only written over the object it was
/// planned from: an operator that was deposed while it planned, or planned from a stale
/// cache, gets a conflict and the newer decision stays. (It used to overwrite it.)
#[tokio::test(flavor = "multi_thread")]
async fn a_stale_writer_cannot_overwrite_the_write_ahead_status() {
    use weir_crds::streamjob::{PendingUpgrade, RestoreMode, SnapshotRef, StreamJobStatus};
    use weir_operator::controller::{write_status, StatusWrite};
    let server = TestApiServer::start().expect("API server starts");
    let client = server.client().await.unwrap();
    server.install_crd(&client).await.unwrap();
    let ar = ApiResource::erase::<StreamJob>(&());
    Api::<DynamicObject>::namespaced_with(client.clone(), "default", &ar)
        .create(&PostParams::default(), &manifest("wa", "", ""))
        .await
        .unwrap();
    let jobs: Api<StreamJob> = Api::namespaced(client.clone(), "default");
    let upgrade = |id: u64| StreamJobStatus {
        pending_upgrade: Some(PendingUpgrade {
            target_generation: 2,
            target_spec_hash: "h2".into(),
            restore_from: Some(SnapshotRef { id, path: format!("s3://b/savepoints/sp-1-{id}"), completed_at: None }),
            restore: Some(RestoreMode::Snapshot),
        }),
        ..StreamJobStatus::default()
    };
    // Two operators read the same object; the leader writes its decision first.
    let stale = jobs.get("wa").await.unwrap();
    let leader_view = jobs.get("wa").await.unwrap();
    assert_eq!(
        write_status(&jobs, &leader_view, &StreamJobStatus::default(), &upgrade(7)).await.unwrap(),
        StatusWrite::Written
    );
    // The deposed one, from its older read, is refused; the leader's decision stays.
    assert_eq!(
        write_status(&jobs, &stale, &StreamJobStatus::default(), &upgrade(3)).await.unwrap(),
        StatusWrite::Conflict
    );
    let stored = jobs.get("wa").await.unwrap().status.unwrap().pending_upgrade.unwrap();
    assert_eq!(stored.restore_from.unwrap().id, 7);
    // From a fresh read it may write.
    let fresh = jobs.get("wa").await.unwrap();
    let current = fresh.status.clone().unwrap();
    assert_eq!(write_status(&jobs, &fresh, &current, &upgrade(9)).await.unwrap(), StatusWrite::Written);

    // Every field, not only the write-ahead ones. Found in CI: the relaunched pod's event ran a
    // reconcile on the cached object from before the relaunch was counted, and it wrote the old
    // count back over the new one.
    let before_count = jobs.get("wa").await.unwrap();
    let read = before_count.status.clone().unwrap();
    let counted = StreamJobStatus { relaunch_count: 1, ..read.clone() };
    assert_eq!(write_status(&jobs, &before_count, &read, &counted).await.unwrap(), StatusWrite::Written);
    let from_stale_cache = StreamJobStatus { last_error: Some("pod failed".into()), ..read.clone() };
    assert_eq!(write_status(&jobs, &before_count, &read, &from_stale_cache).await.unwrap(), StatusWrite::Conflict);
    assert_eq!(jobs.get("wa").await.unwrap().status.unwrap().relaunch_count, 1, "the count stays");
}

/// kube's finalizer helper, run on an object read before its finalizer list changed (or before
/// it went), fails its JSON patch; the operator takes exactly those failures for a stale read
/// and plans again instead of reporting a failed reconcile (a CI run reported one).
#[tokio::test(flavor = "multi_thread")]
async fn finalizer_patches_from_a_stale_read_are_recognised() {
    use std::sync::Arc;

    use kube::runtime::controller::Action;
    use kube::runtime::finalizer::{finalizer, Error, Event};
    use weir_operator::controller::stale_finalizer_patch;
    let server = TestApiServer::start().expect("API server starts");
    let client = server.client().await.unwrap();
    server.install_crd(&client).await.unwrap();
    let ar = ApiResource::erase::<StreamJob>(&());
    Api::<DynamicObject>::namespaced_with(client.clone(), "default", &ar)
        .create(&PostParams::default(), &manifest("fz", "", ""))
        .await
        .unwrap();
    let jobs: Api<StreamJob> = Api::namespaced(client.clone(), "default");
    let noop = |_: Event<StreamJob>| async { Ok::<Action, std::convert::Infallible>(Action::await_change()) };
    let stale = Arc::new(jobs.get("fz").await.unwrap());
    finalizer(&jobs, "weir.dev/test", stale.clone(), noop).await.expect("adds the finalizer");
    match finalizer(&jobs, "weir.dev/test", stale, noop).await {
        Err(Error::AddFinalizer(e)) => assert!(stale_finalizer_patch(&e), "{e:?}"),
        other => panic!("a second add from the stale read: {other:?}"),
    }
    jobs.delete("fz", &Default::default()).await.unwrap();
    let deleting = Arc::new(jobs.get("fz").await.unwrap());
    finalizer(&jobs, "weir.dev/test", deleting.clone(), noop).await.expect("cleanup removes the finalizer");
    match finalizer(&jobs, "weir.dev/test", deleting, noop).await {
        Err(Error::RemoveFinalizer(e)) => assert!(stale_finalizer_patch(&e), "{e:?}"),
        other => panic!("a second removal from the stale read: {other:?}"),
    }
}
