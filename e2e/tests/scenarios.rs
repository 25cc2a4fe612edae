//! The end-to-end scenario suite, against the cluster KUBECONFIG names: the runtime really runs
//! in pods (image WEIR_E2E_RUNTIME_IMAGE), the operator is installed by `helm install` and runs
//! in a pod (image WEIR_E2E_OPERATOR_IMAGE; WEIR_E2E_OPERATOR=process runs it out of cluster),
//! checkpoints and output go to a real S3 server.
//!
//! ```sh
//! images/build.sh        # prints the image refs and archives
//! eval "$(e2e/local/up --image RUNTIME.tar --image OPERATOR.tar)"
//! WEIR_E2E_RUNTIME_IMAGE=... WEIR_E2E_OPERATOR_IMAGE=... \
//!   cargo test -p weir-e2e --test scenarios -- --ignored --test-threads=1
//! ```
//! (`.ci/run` does both.) Each scenario has a namespace of its own; on failure it dumps pods,
//! logs, events, StreamJobs and the operator log. Waits are on conditions with timeouts.

use std::time::{Duration, Instant};

use kube::api::{Patch, PatchParams};
use weir_e2e::cluster::{assert_running_counts_exactly_once, runtime_image, runtime_pids, Scenario, BUCKET};
use weir_e2e::eventually;

/// The counter job of scenarios b–g: a running count per key, then a map tagging each record
/// with `v` (the expression an upgrade changes), into an exactly-once file sink on S3.
fn counter(ns: &str, parallelism: u32, v: &str, extra: &str) -> String {
    format!(
        r#"
apiVersion: weir.dev/v1alpha1
kind: StreamJob
metadata:
  name: counter
spec:
  image: {image}
  imagePullPolicy: IfNotPresent
  parallelism: {parallelism}
  upgradeMode: savepoint
  checkpointing: {{ interval: 1s, credentialsSecret: {{ name: weir-s3 }} }}
{extra}
  job:
    inline:
      sources: [ {{ name: events, uid: events,
                    generator: {{ ratePerSecond: 300, fields: [ {{ name: k, modulo: 20 }} ] }} }} ]
      operators:
        - {{ name: by-k, keyBy: {{ fields: [k] }} }}
        - {{ name: counts, uid: counts, aggregate: {{ aggregates: [ {{ fn: count, as: "n" }} ] }} }}
        - {{ name: tag, map: {{ keepInput: true, fields: {{ v: "'{v}'" }} }} }}
      sinks: [ {{ name: out, uid: out, file: {{ path: s3://{BUCKET}/output/{ns} }} }} ]
"#,
        image = runtime_image()
    )
}

fn output(ns: &str) -> String {
    format!("s3://{BUCKET}/output/{ns}")
}

async fn patch_spec(s: &Scenario, spec: serde_json::Value) {
    s.jobs()
        .patch("counter", &PatchParams::default(), &Patch::Merge(serde_json::json!({ "spec": spec })))
        .await
        .unwrap();
}

/// Suspends (stop with savepoint: everything before it is committed) and checks the output.
async fn suspend_and_check(s: &Scenario) -> Vec<serde_json::Value> {
    patch_spec(s, serde_json::json!({ "state": "suspended" })).await;
    s.wait_phase("counter", "Suspended", 120).await;
    let records = s.committed(&output(&s.ns)).await;
    let n = assert_running_counts_exactly_once(&records);
    eprintln!("{}: {n} committed records, every running count exactly once", s.ns);
    records
}

/// The tail of a recovery: the job makes progress again (100 more records committed), then it
/// is suspended, every running count is checked exactly once, and the scenario ends.
async fn progresses_then_exactly_once(s: Scenario) {
    let before = s.committed(&output(&s.ns)).await.len();
    s.wait_output(&output(&s.ns), before + 100, 90).await;
    suspend_and_check(&s).await;
    s.finish().await;
}

fn container_args(pod: &k8s_openapi::api::core::v1::Pod) -> String {
    pod.spec.as_ref().unwrap().containers[0].args.clone().unwrap_or_default().join(" ")
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs a cluster: see the module docs"]
async fn a_the_example_runs_checkpoints_and_commits() {
    let s = Scenario::start("e2e-a").await;
    let example = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/streamjob.yaml")).unwrap();
    s.apply(&example.replace("weir.local/weir-runtime:dev", &runtime_image()));
    s.wait_phase("counter", "Running", 180).await;
    let pod = s.wait_pod_running("counter", 120).await;
    assert!(
        pod.status.as_ref().unwrap().container_statuses.as_ref().unwrap()[0].container_id.is_some(),
        "a real container"
    );
    let jobs = s.jobs();
    let chk = eventually("a completed checkpoint in status", 60, || async {
        jobs.get("counter").await.ok()?.status?.latest_checkpoint
    })
    .await;
    assert!(chk.path.contains(&format!("state/{}/counter/checkpoints/chk-", s.ns)), "{chk:?}");
    assert!(chk.completed_at.is_some());
    s.wait_output("s3://weir-examples/counter", 200, 60).await;
    // What `kubectl get streamjobs -o wide` shows a user: the printer columns, in order.
    let wide = s.kubectl(&["get", "streamjobs", "-o", "wide"], None);
    let wide = String::from_utf8_lossy(&wide.stdout).to_string();
    let header: Vec<&str> = wide.lines().next().unwrap_or_default().split_whitespace().collect();
    assert_eq!(
        header,
        ["NAME", "PHASE", "PARALLELISM", "CHECKPOINT", "AGE", "SAVEPOINT", "RELAUNCHES", "MESSAGE"],
        "{wide}"
    );
    let row = wide.lines().nth(1).unwrap_or_default();
    assert!(row.starts_with("counter ") && row.contains(" Running ") && row.ends_with("the job is running"), "{wide}");
    patch_spec(&s, serde_json::json!({ "state": "suspended" })).await;
    s.wait_phase("counter", "Suspended", 120).await;
    assert_running_counts_exactly_once(&s.committed("s3://weir-examples/counter").await);
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs a cluster: see the module docs"]
async fn b_gitops_upgrade_takes_a_savepoint_and_stays_exactly_once() {
    let s = Scenario::start("e2e-b").await;
    s.apply(&counter(&s.ns, 1, "v1", ""));
    let first = s.wait_pod_running("counter", 180).await;
    s.wait_phase("counter", "Running", 60).await;
    s.wait_output(&output(&s.ns), 300, 90).await;

    // The GitOps change: a new map expression, parallelism and state backend (heap to
    // rocksdb: the savepoint's format is the same for both), by kubectl apply.
    s.apply(&counter(&s.ns, 2, "v2", "  stateBackend: rocksdb\n  stateCacheEntries: 100"));
    let pods = s.pods();
    let first_uid = first.metadata.uid.clone().unwrap();
    let second = eventually("the old pod replaced", 180, || async {
        let p = pods.get_opt("counter-runtime-0").await.ok()??;
        (p.metadata.uid.as_deref() != Some(first_uid.as_str())).then_some(p)
    })
    .await;
    let status = s.wait_phase("counter", "Running", 180).await;
    let savepoint = status.latest_savepoint.expect("the upgrade's savepoint in status").path;
    assert!(savepoint.contains("/savepoints/"), "{savepoint}");
    assert!(
        container_args(&second).contains(&format!("--restore {savepoint}")),
        "restored from the savepoint: {}",
        container_args(&second)
    );
    s.wait_pod_running("counter", 120).await;
    eventually("v2 records committed", 90, || async {
        s.committed(&output(&s.ns)).await.iter().any(|r| r["v"] == "v2").then_some(())
    })
    .await;
    // `kubectl describe streamjob` tells the upgrade in order.
    let reasons = s.event_reasons("counter").await;
    let story = ["Deploying", "SavepointRequested", "SavepointCompleted", "Upgraded"];
    let mut told = reasons.iter();
    for step in story {
        assert!(told.any(|r| r == step), "events {reasons:?} do not tell {story:?} in order (missing {step})");
    }
    let records = suspend_and_check(&s).await;
    // Per key, every v1 count precedes every v2 count: the state went across the upgrade.
    let mut last_v1: std::collections::BTreeMap<i64, i64> = Default::default();
    for r in records.iter().filter(|r| r["v"] == "v1") {
        let e = last_v1.entry(r["k"].as_i64().unwrap()).or_default();
        *e = (*e).max(r["n"].as_i64().unwrap());
    }
    for r in records.iter().filter(|r| r["v"] == "v2") {
        let k = r["k"].as_i64().unwrap();
        assert!(
            r["n"].as_i64().unwrap() > last_v1.get(&k).copied().unwrap_or(0),
            "key {k}: a v2 count not after the v1 counts"
        );
    }
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs a cluster: see the module docs"]
async fn c_a_killed_pod_and_a_killed_process_relaunch_from_the_newest_checkpoint() {
    let s = Scenario::start("e2e-c").await;
    s.apply(&counter(&s.ns, 1, "v1", ""));
    let pod = s.wait_pod_running("counter", 180).await;
    s.wait_output(&output(&s.ns), 200, 90).await;
    let jobs = s.jobs();
    eventually("a checkpoint", 60, || async { jobs.get("counter").await.ok()?.status?.latest_checkpoint }).await;

    // 1. The pod is deleted.
    let out = s.kubectl(&["delete", "pod", "counter-runtime-0", "--wait=false"], None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let uid = pod.metadata.uid.clone().unwrap();
    let pods = s.pods();
    let second = eventually("a new pod", 180, || async {
        let p = pods.get_opt("counter-runtime-0").await.ok()??;
        (p.metadata.uid.as_deref() != Some(uid.as_str())).then_some(p)
    })
    .await;
    assert!(
        container_args(&second).contains("--restore latest"),
        "restores the newest valid checkpoint: {}",
        container_args(&second)
    );
    let second = s.wait_pod_running("counter", 180).await;
    let before = s.committed(&output(&s.ns)).await.len();
    s.wait_output(&output(&s.ns), before + 100, 90).await;

    // 2. The runtime process in the container is killed.
    let uid2 = second.metadata.uid.clone().unwrap();
    let pids = eventually("the runtime's process on the node", 30, || async {
        Some(runtime_pids(&uid2)).filter(|p| !p.is_empty())
    })
    .await;
    for pid in pids {
        let _ = std::process::Command::new("kill").args(["-9", &pid.to_string()]).status();
    }
    let third = eventually("a relaunched pod", 180, || async {
        let p = pods.get_opt("counter-runtime-0").await.ok()??;
        (p.metadata.uid.as_deref() != Some(uid2.as_str())).then_some(p)
    })
    .await;
    assert!(container_args(&third).contains("--restore latest"), "{}", container_args(&third));
    let status = s.wait_phase("counter", "Running", 180).await;
    assert!(status.relaunch_count >= 1, "the failure counted as a relaunch: {status:?}");
    s.wait_pod_running("counter", 120).await;
    progresses_then_exactly_once(s).await;
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs a cluster: see the module docs"]
async fn d_cancel_whose_savepoint_fails_kills_the_pods_and_resumes_exactly_once() {
    let s = Scenario::start("e2e-d").await;
    // The runtime's test hook fails every savepoint. It comes from a Secret of its own: a
    // credentials Secret holds credentials only (any other key is refused).
    s.put_secret("weir-faults", &[("WEIR_FAULTS", "savepoint=1")]).await;
    let faults = "  savepoint: { timeout: 20s }\n  podTemplate: { envFromSecrets: [ { name: weir-faults } ] }";
    s.apply(&counter(&s.ns, 1, "v1", faults));
    s.wait_pod_running("counter", 180).await;
    s.wait_output(&output(&s.ns), 200, 90).await;
    let jobs = s.jobs();
    eventually("a checkpoint", 60, || async { jobs.get("counter").await.ok()?.status?.latest_checkpoint }).await;

    let asked = Instant::now();
    patch_spec(&s, serde_json::json!({ "state": "cancelled" })).await;
    let pods = s.pods();
    eventually("the pods gone", 25 + 5, || async {
        pods.get_opt("counter-runtime-0").await.ok()?.is_none().then_some(())
    })
    .await;
    let took = asked.elapsed();
    assert!(took < Duration::from_secs(25), "pods gone {took:?} after cancel (savepoint timeout 20 s + 5 s)");
    let status = s.wait_phase("counter", "Cancelled", 60).await;
    let recovery = status.recovery_point.expect("status names the recovery checkpoint");
    assert!(recovery.path.contains("/checkpoints/chk-"), "{recovery:?}");
    let events = s.kubectl(&["get", "events", "-o", "jsonpath={.items[*].reason}"], None);
    assert!(String::from_utf8_lossy(&events.stdout).contains("SavepointFailedPodsKilled"));

    // Later: the fault is gone, the job resumes from the recovery checkpoint.
    s.put_secret("weir-faults", &[]).await;
    patch_spec(&s, serde_json::json!({ "state": "running" })).await;
    let pod = s.wait_pod_running("counter", 180).await;
    assert!(
        container_args(&pod).contains("--restore latest"),
        "the runtime verifies the recovery checkpoint {}: {}",
        recovery.path,
        container_args(&pod)
    );
    progresses_then_exactly_once(s).await;
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs a cluster: see the module docs"]
async fn e_suspend_and_resume_with_a_savepoint() {
    let s = Scenario::start("e2e-e").await;
    s.apply(&counter(&s.ns, 1, "v1", ""));
    s.wait_pod_running("counter", 180).await;
    s.wait_output(&output(&s.ns), 200, 90).await;
    patch_spec(&s, serde_json::json!({ "state": "suspended" })).await;
    let status = s.wait_phase("counter", "Suspended", 120).await;
    let savepoint = status.recovery_point.expect("resumes from the suspend savepoint");
    assert!(savepoint.path.contains("/savepoints/"), "{savepoint:?}");
    assert!(s.pods().get_opt("counter-runtime-0").await.unwrap().is_none(), "no pod while suspended");
    let suspended = assert_running_counts_exactly_once(&s.committed(&output(&s.ns)).await);

    patch_spec(&s, serde_json::json!({ "state": "running" })).await;
    let pod = s.wait_pod_running("counter", 180).await;
    assert!(container_args(&pod).contains(&format!("--restore {}", savepoint.path)), "{}", container_args(&pod));
    s.wait_output(&output(&s.ns), suspended + 150, 90).await;
    suspend_and_check(&s).await;
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs a cluster: see the module docs"]
async fn f_a_corrupt_newest_checkpoint_is_skipped_on_relaunch() {
    let mut s = Scenario::start("e2e-f").await;
    s.apply(&counter(&s.ns, 1, "v1", ""));
    let pod = s.wait_pod_running("counter", 180).await;
    s.wait_output(&output(&s.ns), 300, 90).await;
    let checkpoints = s.storage(&format!("s3://{BUCKET}/state/{}/counter/checkpoints", s.ns));
    eventually("two checkpoints", 60, || async { (checkpoints.list_dirs("").await.ok()?.len() >= 2).then_some(()) })
        .await;

    // The job goes down while no operator watches; its newest checkpoint is then corrupted.
    s.kill_operator().await;
    let out = s.kubectl(&["delete", "pod", "counter-runtime-0", "--wait=true", "--timeout=120s"], None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let uid = pod.metadata.uid.clone().unwrap();
    eventually("the runtime process gone", 60, || async { runtime_pids(&uid).is_empty().then_some(()) }).await;
    let mut ids: Vec<u64> = checkpoints
        .list_dirs("")
        .await
        .unwrap()
        .iter()
        .filter_map(|d| d.trim_end_matches('/').rsplit("chk-").next()?.parse().ok())
        .collect();
    ids.sort_unstable();
    let newest = *ids.last().unwrap();
    let previous = ids[ids.len() - 2];
    checkpoints.put(&format!("chk-{newest}/_metadata"), bytes::Bytes::from_static(b"not a checkpoint")).await.unwrap();

    s.start_operator().await;
    let pods = s.pods();
    let relaunched =
        eventually("the job relaunched", 180, || async { pods.get_opt("counter-runtime-0").await.ok()? }).await;
    let args = container_args(&relaunched);
    assert!(args.contains("--restore latest"), "the runtime chooses, verifying each file: {args}");
    s.wait_pod_running("counter", 180).await;
    // It restored chk-{previous}, not the corrupt chk-{newest}.
    let restored = eventually("the runtime's restore point", 60, || async {
        let logs = s.kubectl(&["logs", "counter-runtime-0"], None);
        let text = String::from_utf8_lossy(&logs.stdout).to_string();
        text.contains("restoring").then_some(text)
    })
    .await;
    assert!(
        restored.contains(&format!("chk-{previous}")) && restored.contains(&format!("chk-{newest}")),
        "skips chk-{newest}, restores chk-{previous}: {restored}"
    );
    progresses_then_exactly_once(s).await;
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs a cluster: see the module docs"]
async fn g_an_operator_killed_mid_upgrade_completes_it() {
    let mut s = Scenario::start("e2e-g").await;
    s.apply(&counter(&s.ns, 1, "v1", ""));
    let old = s.wait_pod_running("counter", 180).await;
    s.wait_phase("counter", "Running", 60).await;
    s.wait_output(&output(&s.ns), 200, 90).await;

    s.apply(&counter(&s.ns, 2, "v2", ""));
    let jobs = s.jobs();
    eventually("the upgrade under way", 60, || async {
        let st = jobs.get("counter").await.ok()?.status?;
        (st.operation.as_ref().is_some_and(|o| o.kind == weir_crds::streamjob::OperationKind::Upgrade)
            || st.pending_upgrade.is_some())
        .then_some(())
    })
    .await;
    s.kill_operator().await;
    // While no operator runs, the old runtime finishes its stop-with-savepoint and exits; the
    // restarted operator must finish the upgrade from the status it wrote ahead.
    let old_uid = old.metadata.uid.clone().unwrap();
    eventually("the old runtime exited", 120, || async { runtime_pids(&old_uid).is_empty().then_some(()) }).await;
    s.start_operator().await;
    let status = eventually("the upgrade done", 240, || async {
        let st = jobs.get("counter").await.ok()?.status?;
        (st.phase == Some(weir_crds::streamjob::Phase::Running)
            && st.pending_upgrade.is_none()
            && st.operation.is_none()
            && st.observed_generation == Some(2))
        .then_some(st)
    })
    .await;
    let savepoint = status.latest_savepoint.expect("the upgrade's savepoint").path;
    let pod = s.wait_pod_running("counter", 120).await;
    assert!(container_args(&pod).contains(&format!("--restore {savepoint}")), "{}", container_args(&pod));
    eventually("v2 records committed", 90, || async {
        s.committed(&output(&s.ns)).await.iter().any(|r| r["v"] == "v2").then_some(())
    })
    .await;
    suspend_and_check(&s).await;
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs a cluster: see the module docs"]
async fn h_invalid_manifests_are_refused_with_a_clear_message() {
    let s = Scenario::start("e2e-h").await;
    let valid = counter(&s.ns, 1, "v1", "");
    let cases = [
        ("interval: 1s", "interval: -5s", "spec.checkpointing.interval"),
        ("upgradeMode: savepoint", "upgradeMode: sometimes", "spec.upgradeMode"),
        ("parallelism: 1", "parallelism: 1\n  maxParallelism: 0", "spec.maxParallelism"),
        ("interval: 1s,", "interval: 1s, retained: 0,", "spec.checkpointing.retained"),
        ("interval: 1s,", "interval: 1s, storage: 'ftp://x',", "storage must be"),
        ("imagePullPolicy: IfNotPresent", "imagePullPolicy: Sometimes", "spec.imagePullPolicy"),
        ("parallelism: 1", "parallelism: 1\n  stateBackend: disk", "spec.stateBackend"),
        ("parallelism: 1", "parallelism: 1\n  stateCacheEntries: 5", "spec.stateCacheEntries"),
    ];
    for (from, to, expected) in cases {
        assert!(valid.contains(from), "fixture lacks {from}");
        let out = s.kubectl(&["apply", "-f", "-"], Some(&valid.replacen(from, to, 1)));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "`{to}` was accepted");
        assert!(err.contains(expected), "the refusal of `{to}` should name `{expected}`: {err}");
    }
    // A graph the API server cannot judge (a stateful operator without a uid): the operator
    // reports it as a Degraded condition naming the field, and deploys nothing.
    s.apply(&valid.replace("{ name: counts, uid: counts,", "{ name: counts,"));
    let jobs = s.jobs();
    let condition = eventually("Degraded=True", 60, || async {
        jobs.get("counter")
            .await
            .ok()?
            .status?
            .conditions
            .into_iter()
            .find(|c| c.type_ == "Degraded" && c.status == "True")
    })
    .await;
    assert_eq!(condition.reason, "InvalidJob");
    assert!(condition.message.contains("operators[1]") && condition.message.contains("uid"), "{}", condition.message);
    assert!(s.pods().get_opt("counter-runtime-0").await.unwrap().is_none());
    s.finish().await;
}

/// A Kafka broker for the scenario, on the node address (pods and the suite both reach it):
/// the runtime tests' broker harness.
#[path = "../../runtime/tests/kafka_broker/mod.rs"]
mod kafka_broker;

/// The Kafka counter: JSON records `{id, word}` from topic `input`, a running count per word,
/// a map tagging each record with `v`, into topic `output` exactly once (the default).
fn kafka_counter(bootstrap: &str, parallelism: u32, v: &str) -> String {
    format!(
        r#"
apiVersion: weir.dev/v1alpha1
kind: StreamJob
metadata:
  name: kcount
spec:
  image: {image}
  imagePullPolicy: IfNotPresent
  parallelism: {parallelism}
  upgradeMode: savepoint
  checkpointing: {{ interval: 1s, credentialsSecret: {{ name: weir-s3 }} }}
  job:
    inline:
      sources:
        - name: events
          uid: events
          kafka: {{ bootstrapServers: "{bootstrap}", topics: [input], format: json, fields: [id, word] }}
      operators:
        - {{ name: by-word, keyBy: {{ fields: [word] }} }}
        - {{ name: counts, uid: counts, aggregate: {{ aggregates: [ {{ fn: count, as: "n" }} ] }} }}
        - {{ name: tag, map: {{ keepInput: true, fields: {{ v: "'{v}'" }} }} }}
      sinks:
        - name: out
          uid: out
          kafka: {{ bootstrapServers: "{bootstrap}", topic: output, keyField: word }}
"#,
        image = runtime_image()
    )
}

/// Records committed to `topic`, read `read_committed` (blocking the worker thread briefly).
fn kafka_output(broker: &kafka_broker::Broker, topic: &str) -> Vec<serde_json::Value> {
    tokio::task::block_in_place(|| broker.read_committed(topic))
        .into_iter()
        .map(|(_, v)| serde_json::from_str(&v).expect("output is JSON"))
        .collect()
}

async fn wait_kafka_output(broker: &kafka_broker::Broker, topic: &str, n: usize, secs: u64) {
    eventually(&format!("{n} records in {topic}"), secs, || async {
        (kafka_output(broker, topic).len() >= n).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs a cluster: see the module docs"]
async fn i_kafka_in_kafka_out_survives_a_pod_kill_and_an_upgrade_exactly_once() {
    let s = Scenario::start("e2e-i").await;
    let broker =
        tokio::task::spawn_blocking(|| kafka_broker::Broker::start_on(&weir_e2e::cluster::node_ip())).await.unwrap();
    let bootstrap = broker.bootstrap.clone();
    tokio::task::block_in_place(|| {
        broker.create_topic("input", 2);
        broker.create_topic("output", 2);
    });
    // Input keeps arriving (100 records a second for a minute) through the kill and the upgrade.
    let total: u64 = 6_000;
    let producer = {
        let b = bootstrap.clone();
        std::thread::spawn(move || {
            let client = kafka_broker::Broker::client(&b);
            for c in 0..total / 100 {
                client.produce(
                    "input",
                    (c * 100..(c + 1) * 100).map(|i| (i.to_string(), format!(r#"{{"id":{i},"word":"w{}"}}"#, i % 23))),
                );
                std::thread::sleep(Duration::from_secs(1));
            }
        })
    };
    s.apply(&kafka_counter(&bootstrap, 1, "v1"));
    let pod = s.wait_pod_running("kcount", 180).await;
    wait_kafka_output(&broker, "output", 300, 120).await;

    // 1. The pod is deleted mid-stream: the relaunch restores the newest checkpoint, and the
    // sink's recovery commits what that checkpoint staged and no marker shows.
    let out = s.kubectl(&["delete", "pod", "kcount-runtime-0", "--wait=false"], None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let uid = pod.metadata.uid.clone().unwrap();
    let pods = s.pods();
    eventually("a new pod", 180, || async {
        let p = pods.get_opt("kcount-runtime-0").await.ok()??;
        (p.metadata.uid.as_deref() != Some(uid.as_str())).then_some(p)
    })
    .await;
    s.wait_pod_running("kcount", 180).await;
    let before = kafka_output(&broker, "output").len();
    wait_kafka_output(&broker, "output", before + 200, 120).await;

    // 2. A GitOps upgrade (a new tag, two subtasks): stop with savepoint, redeploy from it.
    let jobs = s.jobs();
    let savepoints_before = jobs.get("kcount").await.unwrap().status.unwrap_or_default().savepoint_history.len();
    s.apply(&kafka_counter(&bootstrap, 2, "v2"));
    eventually("the upgrade's savepoint", 180, || async {
        let st = jobs.get("kcount").await.ok()?.status?;
        (st.savepoint_history.len() > savepoints_before).then_some(())
    })
    .await;
    s.wait_phase("kcount", "Running", 180).await;
    producer.join().unwrap();
    wait_kafka_output(&broker, "output", total as usize, 240).await;

    // 3. Suspend (stop with savepoint), then check every running count exactly once.
    s.jobs()
        .patch(
            "kcount",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "spec": { "state": "suspended" } })),
        )
        .await
        .unwrap();
    s.wait_phase("kcount", "Suspended", 120).await;
    let records = kafka_output(&broker, "output");
    let mut by_word: std::collections::BTreeMap<String, Vec<u64>> = Default::default();
    for r in &records {
        by_word.entry(r["word"].as_str().unwrap().to_string()).or_default().push(r["n"].as_u64().unwrap());
    }
    for (word, counts) in &mut by_word {
        counts.sort_unstable();
        let expect: Vec<u64> = (1..=counts.len() as u64).collect();
        assert_eq!(counts, &expect, "{word}: every running count exactly once");
    }
    assert_eq!(records.len() as u64, total, "one output record per input record");
    assert!(records.iter().any(|r| r["v"] == "v1") && records.iter().any(|r| r["v"] == "v2"), "both versions ran");
    eprintln!("{}: {} Kafka records, every running count exactly once", s.ns, records.len());
    s.finish().await;
}

/// The zombie on a cluster: the runtime and the kubelet of its node are frozen (SIGSTOP), as on
/// a node cut off from the cluster. The suspend's savepoint times out and the operator kills the
/// pod, which stays Terminating (its kubelet cannot confirm); an administrator force-deletes it,
/// as one does for a lost node, and the job resumes on the other node. Then the old runtime
/// wakes (SIGCONT), still holding its state and its storage credentials: it must stop with the
/// fencing exit code and publish nothing, and the output stays exactly once, no published file
/// touched. Needs two schedulable nodes (kind with a worker: `e2e/kind/up`).
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs a cluster: see the module docs"]
async fn j_a_frozen_runtime_woken_after_its_relaunch_is_fenced_and_publishes_nothing() {
    use weir_e2e::cluster::{kind_node_exec, kind_node_pids, published_files, signal};
    let s = Scenario::start("e2e-j").await;
    let nodes = s.kubectl(&["get", "nodes", "-o", "name"], None);
    let nodes = String::from_utf8_lossy(&nodes.stdout).lines().count();
    assert!(nodes >= 2, "this scenario freezes a node while another runs the job: {nodes} node(s) here");
    s.apply(&counter(&s.ns, 1, "v1", "  savepoint: { timeout: 10s }"));
    let pod = s.wait_pod_running("counter", 180).await;
    s.wait_output(&output(&s.ns), 200, 90).await;
    let jobs = s.jobs();
    eventually("a checkpoint", 60, || async { jobs.get("counter").await.ok()?.status?.latest_checkpoint }).await;

    // 1. Freeze the runtime and its node's kubelet; keep the node out of scheduling.
    let node = pod.spec.as_ref().and_then(|p| p.node_name.clone()).expect("a scheduled pod");
    let uid = pod.metadata.uid.clone().unwrap();
    let container = pod.status.as_ref().unwrap().container_statuses.as_ref().unwrap()[0].container_id.clone().unwrap();
    let container = container.trim_start_matches("containerd://").to_string();
    let runtime = runtime_pids(&uid);
    let kubelet = kind_node_pids(&node, "kubelet");
    assert!(!runtime.is_empty() && kubelet.len() == 1, "runtime {runtime:?}, kubelet {kubelet:?} on {node}");
    let out = s.kubectl(&["cordon", &node], None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    signal(&kubelet, "STOP");
    signal(&runtime, "STOP");
    eprintln!("{}: froze runtime {runtime:?} and kubelet {kubelet:?} on {node}", s.ns);

    // 2. Suspend: the savepoint times out, the operator kills the pod, which stays Terminating.
    patch_spec(&s, serde_json::json!({ "state": "suspended" })).await;
    let pods = s.pods();
    eventually("the pod killed by the operator", 60, || async {
        pods.get_opt("counter-runtime-0").await.ok()??.metadata.deletion_timestamp.map(|_| ())
    })
    .await;
    // What an administrator does for a lost node (or the pod GC after the node is deleted).
    let out = s.kubectl(&["delete", "pod", "counter-runtime-0", "--force", "--grace-period=0"], None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let status = s.wait_phase("counter", "Suspended", 120).await;
    assert!(status.recovery_point.is_some(), "the kill names the checkpoint to resume from: {status:?}");
    assert!(s.event_reasons("counter").await.iter().any(|r| r == "SavepointFailedPodsKilled"));

    // 3. Resume on the other node; it claims a newer epoch and commits.
    patch_spec(&s, serde_json::json!({ "state": "running" })).await;
    let second = s.wait_pod_running("counter", 180).await;
    assert_ne!(second.spec.as_ref().unwrap().node_name.as_deref(), Some(node.as_str()));
    let before = s.committed(&output(&s.ns)).await.len();
    s.wait_output(&output(&s.ns), before + 100, 90).await;
    let sink = s.storage(&output(&s.ns));
    let published = published_files(&sink).await;

    // 4. Wake the old runtime (its kubelet stays frozen, so nothing kills it): fenced.
    signal(&runtime, "CONT");
    eventually("the woken runtime to stop by itself", 90, || async {
        runtime.iter().all(|p| !std::path::Path::new(&format!("/proc/{p}")).exists()).then_some(())
    })
    .await;
    // Its log and exit status, as containerd on the node kept them.
    let logs =
        kind_node_exec(&node, &["sh", "-c", &format!("cat /var/log/pods/{}_counter-runtime-0_{uid}/*/*.log", s.ns)]);
    let logs = String::from_utf8_lossy(&logs.stdout).to_string();
    assert!(logs.contains("fenced by a newer run"), "the stale runtime stops as fenced; its log:\n{logs}");
    let status = kind_node_exec(
        &node,
        &["cat", &format!("/var/lib/containerd/io.containerd.grpc.v1.cri/containers/{container}/status")],
    );
    let status = String::from_utf8_lossy(&status.stdout).to_string();
    assert!(status.contains("\"ExitCode\":3"), "exits with the fencing code 3: {status}");
    let fenced = logs.lines().filter(|l| l.contains("fenced") || l.contains("epoch")).collect::<Vec<_>>().join("\n");
    eprintln!("{}: the woken runtime stopped with code 3:\n{fenced}", s.ns);
    signal(&kubelet, "CONT");
    let out = s.kubectl(&["uncordon", &node], None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // 5. Nothing published was touched, and the job goes on exactly once.
    let after = published_files(&sink).await;
    for (file, len) in &published {
        assert_eq!(after.get(file), Some(len), "published file {file} deleted or changed");
    }
    progresses_then_exactly_once(s).await;
}
