//! The controller against a real kube-apiserver + etcd: deploy, running, suspend whose
//! savepoint cannot be taken (pods killed, status and event say so), resume, and a stateless
//! upgrade. There is no kubelet: the test sets pod phases through the pods' status.

use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use weir_crds::StreamJob;
use weir_e2e::apiserver::TestApiServer;
use weir_e2e::eventually;
use weir_operator::children::ControlIngress;
use weir_operator::controller::{run_with_metrics, Settings};
use weir_operator::metrics::OperatorMetrics;

const JOB: &str = r#"
apiVersion: weir.dev/v1alpha1
kind: StreamJob
metadata:
  name: orders
  annotations: { weir.dev/control-url: "http://127.0.0.1:1" }
spec:
  image: weir-runtime:dev
  parallelism: 1
  upgradeMode: stateless
  job:
    inline:
      sources: [ { name: s, uid: s, generator: { fields: [ { name: a, sequence: {} } ] } } ]
      sinks: [ { name: o, stdout: {} } ]
  savepoint: { timeout: 5s }
"#;

async fn set_pod_phase(pods: &Api<Pod>, name: &str, phase: &str) {
    let patch = serde_json::json!({ "status": { "phase": phase } });
    pods.patch_status(name, &PatchParams::default(), &Patch::Merge(patch)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn lifecycle_against_a_real_api_server() {
    let ns = "lifecycle";
    let (_server, client) = TestApiServer::with_namespace(ns).await.expect("API server with the CRD starts");
    let storage = tempfile::tempdir().unwrap();
    let metrics = OperatorMetrics::shared();
    let ingress = ControlIngress {
        operator_namespace: "weir-system".into(),
        operator_pod_labels: [("app.kubernetes.io/name".to_string(), "weir-operator".to_string())].into(),
        extra_namespaces: vec![],
    };
    let settings = Settings {
        control_ingress: Some(ingress),
        control_url_annotation: true,
        ..Settings::new(storage.path().display().to_string())
    };
    let controller = tokio::spawn(run_with_metrics(client.clone(), settings, metrics.clone()));

    let jobs: Api<StreamJob> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    jobs.create(&PostParams::default(), &serde_yaml::from_str(JOB).unwrap()).await.unwrap();

    // Deploy: children exist, owned, restricted.
    let pod = eventually("runtime pod", 40, || async { pods.get_opt("orders-runtime-0").await.unwrap() }).await;
    let owner = &pod.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!((owner.kind.as_str(), owner.name.as_str(), owner.controller), ("StreamJob", "orders", Some(true)));
    let spec = pod.spec.as_ref().unwrap();
    assert_eq!(spec.security_context.as_ref().unwrap().run_as_non_root, Some(true));
    let args = spec.containers[0].args.as_ref().unwrap().join(" ");
    assert!(args.contains(&format!("--checkpoint-dir {}/lifecycle/orders", storage.path().display())), "{args}");
    assert!(Api::<ConfigMap>::namespaced(client.clone(), ns).get_opt("orders-job").await.unwrap().is_some());
    let svc = Api::<Service>::namespaced(client.clone(), ns).get("orders-control").await.unwrap();
    assert_eq!(svc.spec.unwrap().cluster_ip.as_deref(), Some("None"), "headless: no cluster IP per job");
    let policy = Api::<NetworkPolicy>::namespaced(client.clone(), ns)
        .get("orders-control")
        .await
        .expect("the control API's NetworkPolicy");
    assert_eq!(policy.spec.unwrap().ingress.unwrap()[0].from.as_ref().unwrap().len(), 1, "only the operator's pods");
    let token = Api::<Secret>::namespaced(client.clone(), ns).get("orders-control-token").await.unwrap();
    let data = token.data.unwrap();
    assert!(data["token"].0.len() >= 32, "a random per-job token");
    // And the control API's certificate, issued for the job's Service, with its key.
    let cert = String::from_utf8(data["tls.crt"].0.clone()).unwrap();
    assert!(cert.starts_with("-----BEGIN CERTIFICATE-----"), "{cert}");
    assert!(String::from_utf8_lossy(&data["tls.key"].0).contains("PRIVATE KEY"));
    let first_hash = pod.metadata.labels.as_ref().unwrap()["weir.dev/spec-hash"].clone();

    // Running once the pod runs.
    set_pod_phase(&pods, "orders-runtime-0", "Running").await;
    eventually("phase Running with Ready=True", 40, || async {
        let s = jobs.get("orders").await.unwrap().status?;
        (s.phase == Some(weir_crds::streamjob::Phase::Running)
            && s.conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        .then_some(())
    })
    .await;

    // Suspend while the savepoint cannot be taken (the control URL is unreachable): killed.
    jobs.patch(
        "orders",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({ "spec": { "state": "suspended" } })),
    )
    .await
    .unwrap();
    eventually("pod killed", 40, || async { pods.get_opt("orders-runtime-0").await.unwrap().is_none().then_some(()) })
        .await;
    eventually("phase Suspended", 40, || async {
        (jobs.get("orders").await.unwrap().status?.phase == Some(weir_crds::streamjob::Phase::Suspended)).then_some(())
    })
    .await;
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    let evs = events.list(&ListParams::default()).await.unwrap();
    let killed = evs
        .items
        .iter()
        .find(|e| e.reason.as_deref() == Some("SavepointFailedPodsKilled"))
        .expect("a SavepointFailedPodsKilled event");
    assert!(killed.note.as_deref().unwrap_or("").contains("pods killed"), "{:?}", killed.note);

    // Resume: deployed again.
    jobs.patch("orders", &PatchParams::default(), &Patch::Merge(serde_json::json!({ "spec": { "state": "running" } })))
        .await
        .unwrap();
    eventually("pod again", 40, || async { pods.get_opt("orders-runtime-0").await.unwrap() }).await;
    set_pod_phase(&pods, "orders-runtime-0", "Running").await;
    eventually("Running again", 40, || async {
        (jobs.get("orders").await.unwrap().status?.phase == Some(weir_crds::streamjob::Phase::Running)).then_some(())
    })
    .await;

    // Stateless upgrade: a new spec hash replaces the pod.
    jobs.patch("orders", &PatchParams::default(), &Patch::Merge(serde_json::json!({ "spec": { "parallelism": 2 } })))
        .await
        .unwrap();
    let upgraded = eventually("pod with the new spec hash", 40, || async {
        let p = pods.get_opt("orders-runtime-0").await.unwrap()?;
        (p.metadata.labels.as_ref()?["weir.dev/spec-hash"] != first_hash).then_some(p)
    })
    .await;
    assert_eq!(upgraded.metadata.deletion_timestamp, None);
    set_pod_phase(&pods, "orders-runtime-0", "Running").await;
    eventually("upgrade finished", 40, || async {
        let s = jobs.get("orders").await.unwrap().status?;
        (s.phase == Some(weir_crds::streamjob::Phase::Running)
            && s.pending_upgrade.is_none()
            && s.observed_generation == Some(4))
        .then_some(())
    })
    .await;

    // A job graph the runtime would refuse (a stateful operator without uid) is reported as a
    // Degraded condition naming the field, and nothing is deployed.
    let broken = JOB.replace("name: orders", "name: broken").replace(
        "sinks: [ { name: o, stdout: {} } ]",
        "operators: [ { name: k, keyBy: { fields: [a] } }, \
         { name: c, aggregate: { aggregates: [ { fn: count, as: n } ] } } ]\n      sinks: [ { name: o, stdout: {} } ]",
    );
    jobs.create(&PostParams::default(), &serde_yaml::from_str(&broken).unwrap()).await.unwrap();
    let degraded = eventually("Degraded condition", 40, || async {
        let s = jobs.get("broken").await.unwrap().status?;
        s.conditions.into_iter().find(|c| c.type_ == "Degraded" && c.status == "True")
    })
    .await;
    assert_eq!(degraded.reason, "InvalidJob");
    assert!(degraded.message.contains("spec.job.inline.operators[1].uid: required"), "{}", degraded.message);
    assert!(pods.get_opt("broken-runtime-0").await.unwrap().is_none(), "an invalid job is not deployed");

    // Deleting a running job: the finalizer holds it until it is stopped; the savepoint cannot
    // be taken here, so the pods are killed, then the StreamJob goes away.
    assert!(jobs
        .get("orders")
        .await
        .unwrap()
        .metadata
        .finalizers
        .unwrap_or_default()
        .contains(&"weir.dev/stop-with-savepoint".to_string()));
    jobs.delete("orders", &Default::default()).await.unwrap();
    eventually("pod killed on delete", 40, || async {
        pods.get_opt("orders-runtime-0").await.unwrap().is_none().then_some(())
    })
    .await;
    eventually("StreamJob deleted", 40, || async { jobs.get_opt("orders").await.unwrap().is_none().then_some(()) })
        .await;
    let text = metrics.render();
    assert!(text.contains("weir_operator_pod_kills_total 2"), "suspend and delete both killed:\n{text}");
    assert!(text.contains("weir_operator_jobs{phase=\"Degraded\"} 1"), "{text}");
    controller.abort();
}
