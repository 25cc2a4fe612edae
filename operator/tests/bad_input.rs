//! Bad input the API server accepts (it cannot see other objects, compile CEL or read a
//! savepoint), refused by the operator before it creates anything: each class is reported in
//! status within seconds, Degraded with a reason and the field, with a Warning event, and no
//! pod. A reconcile that fails on an API error says so in status too. Real API server, real
//! operator.

use k8s_openapi::api::core::v1::{ConfigMap, Pod, ResourceQuota};
use kube::api::{Api, PostParams};
use weir_crds::StreamJob;
use weir_e2e::apiserver::TestApiServer;
use weir_operator::controller::{run_with_metrics, Settings};

mod common;
use common::{degraded, eventually, warning_event};

/// A StreamJob named `name`, with `extra` spec lines and `job` as its `job:` block.
fn job(name: &str, extra: &str, job: &str) -> StreamJob {
    let text = format!(
        "apiVersion: weir.dev/v1alpha1\nkind: StreamJob\nmetadata: {{ name: {name} }}\n\
         spec:\n  image: weir-runtime:dev\n  parallelism: 1\n{extra}  job:\n{job}"
    );
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

const GRAPH: &str = "    inline:
      sources: [ { name: events, uid: events, generator: { count: 10, fields: [ { name: k, modulo: 4 } ] } } ]
      operators: [ { name: small, filter: { expr: \"k < 2\" } } ]
      sinks: [ { name: out, stdout: {} } ]
";

#[tokio::test(flavor = "multi_thread")]
async fn each_class_of_bad_input_is_reported_with_its_field_and_nothing_is_deployed() {
    let ns = "bad-input";
    let (_server, client) = TestApiServer::with_namespace(ns).await.expect("API server with the CRD starts");
    let state = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let metrics = weir_operator::metrics::OperatorMetrics::shared();
    let settings = Settings::new(state.path().display().to_string());
    let controller = tokio::spawn(run_with_metrics(client.clone(), settings, metrics.clone()));
    let jobs: Api<StreamJob> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pp = PostParams::default();
    // A savepoint of a job whose uid `events` read Kafka: the generator of uid `events` cannot
    // take its positions over.
    let kafka_savepoint = state.path().join("bad-input/elsewhere/savepoints/sp-1-3");
    std::fs::create_dir_all(&kafka_savepoint).unwrap();
    let metadata = weir_checkpoint::CheckpointMetadata {
        format_version: weir_checkpoint::metadata::FORMAT_VERSION,
        checkpoint_id: 3,
        kind: weir_checkpoint::metadata::SnapshotKind::Savepoint,
        job_name: "elsewhere".into(),
        epoch: 1,
        created_at_ms: 1,
        max_parallelism: 128,
        operators: [(
            "events".to_string(),
            weir_checkpoint::OperatorSnapshot {
                parallelism: 1,
                subtasks: Vec::new(),
                state_layout: Some("kafka source".into()),
            },
        )]
        .into(),
    };
    std::fs::write(kafka_savepoint.join("_metadata"), metadata.encode()).unwrap();

    let cases: Vec<(StreamJob, &str, &str)> = vec![
        // CEL is compiled by the operator, not first by the crashing runtime.
        (
            job("cel", "", &GRAPH.replace("k < 2", "k <")),
            "InvalidJob",
            "spec.job.inline.operators[0].filter.expr: CEL expression `k <` does not compile",
        ),
        (
            job("cel-field", "", &GRAPH.replace("k < 2", "price < 2")),
            "InvalidJob",
            "spec.job.inline.operators[0].filter.expr: CEL expression `price < 2` uses `price`",
        ),
        (
            job("no-configmap", "", "    configMapRef: { name: nowhere }\n"),
            "MissingConfigMap",
            "spec.job.configMapRef.name: ConfigMap `nowhere` not found",
        ),
        (
            job("no-secret", "  checkpointing: { credentialsSecret: { name: s3-keys } }\n", GRAPH),
            "MissingSecret",
            "spec.checkpointing.credentialsSecret.name: Secret `s3-keys` not found",
        ),
        (
            job("no-savepoint", &format!("  initialSavepoint: {}/bad-input/sp-1-7\n", state.path().display()), GRAPH),
            "MissingSavepoint",
            "spec.initialSavepoint: no savepoint or checkpoint at",
        ),
        (
            job("other-state", &format!("  initialSavepoint: {}\n", kafka_savepoint.display()), GRAPH),
            "IncompatibleSavepoint",
            "does not fit this job: operator uid `events` holds kafka source state in the snapshot and is \
             generator in the job",
        ),
    ];
    for (sj, _, _) in &cases {
        jobs.create(&pp, sj).await.unwrap();
    }
    for (sj, reason, expected) in &cases {
        let name = sj.metadata.name.as_deref().unwrap();
        let message = degraded(&jobs, name, reason).await;
        assert!(message.contains(expected), "{name}: expected `{expected}` in `{message}`");
        assert!(warning_event(&client, ns, name, reason).await.contains(expected));
        let status = jobs.get(name).await.unwrap().status.unwrap();
        assert_eq!(status.phase, Some(weir_crds::streamjob::Phase::Degraded), "{name}");
    }
    for (sj, _, _) in &cases {
        let name = sj.metadata.name.as_deref().unwrap();
        assert!(pods.get_opt(&format!("{name}-runtime-0")).await.unwrap().is_none(), "{name}: a pod was created");
    }

    // Fixed, the job deploys: the ConfigMap it named now exists.
    let cm: ConfigMap = serde_yaml::from_str(
        "metadata: { name: nowhere }
data:
  job.yaml: |
    name: x
    sources: [ { name: events, uid: events, generator: { count: 10, fields: [ { name: k, modulo: 4 } ] } } ]
    sinks: [ { name: out, stdout: {} } ]
",
    )
    .unwrap();
    Api::<ConfigMap>::namespaced(client.clone(), ns).create(&pp, &cm).await.unwrap();
    eventually("the fixed job's pod", 40, || async { pods.get_opt("no-configmap-runtime-0").await.unwrap() }).await;

    // A reconcile that fails on the API (pods forbidden by a quota) is reported in status and
    // as an event, with the API's error; it is retried, and nothing else is left half done.
    let quota: ResourceQuota =
        serde_yaml::from_str("metadata: { name: no-pods }\nspec: { hard: { pods: \"0\" } }").unwrap();
    let quotas = Api::<ResourceQuota>::namespaced(client.clone(), ns);
    quotas.create(&pp, &quota).await.unwrap();
    // No controller manager here to count usage: the status it would write, by hand.
    let usage = serde_json::json!({ "status": { "hard": { "pods": "0" }, "used": { "pods": "0" } } });
    quotas.patch_status("no-pods", &Default::default(), &kube::api::Patch::Merge(usage)).await.unwrap();
    jobs.create(&pp, &job("quota", "", GRAPH)).await.unwrap();
    let message = degraded(&jobs, "quota", "ReconcileFailed").await;
    assert!(message.contains("kube-api") && message.contains("forbidden"), "{message}");
    assert!(warning_event(&client, ns, "quota", "ReconcileFailed").await.contains("forbidden"));
    assert!(pods.get_opt("quota-runtime-0").await.unwrap().is_none());
    // Retried (with backoff), each retry failing the same way: the status says so once and
    // then holds still through two more retries, instead of flapping between the deploy it
    // writes ahead and the failure (every write carrying the whole object).
    let failed = || {
        let text = metrics.render();
        let count =
            text.lines().find_map(|l| l.strip_prefix("weir_operator_reconcile_errors_total{category=\"kube-api\"} "));
        count.and_then(|n| n.trim().parse::<f64>().ok()).unwrap_or(0.0)
    };
    let before = jobs.get("quota").await.unwrap().metadata.resource_version;
    let failed_before = failed();
    eventually("two more failed retries", 30, || async { (failed() >= failed_before + 2.0).then_some(()) }).await;
    let after = jobs.get("quota").await.unwrap();
    assert_eq!(after.metadata.resource_version, before, "the status changed while the same failure repeated");
    assert!(pods.get_opt("quota-runtime-0").await.unwrap().is_none());
    controller.abort();
}
