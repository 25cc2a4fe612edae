//! The Helm chart: it lints, refuses bad values with a reason, and its RBAC is enough for the
//! operator's whole lifecycle (deploy, status, events, kill on a failed savepoint, the storage
//! read with a job's credentials Secret, the finalizer, the Lease) and no more: the operator runs
//! here against a real API server *as the chart's ServiceAccount*.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::eventually;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use weir_crds::StreamJob;
use weir_e2e::apiserver::TestApiServer;
use weir_operator::children::ControlIngress;
use weir_operator::controller::{run_with_metrics, Settings};
use weir_operator::leader::LeaderElection;
use weir_operator::metrics::OperatorMetrics;

const RELEASE_NS: &str = "weir-system";
const JOBS_NS: &str = "jobs";
/// The Kubernetes version the tests run against (helm assumes 1.20 when offline).
const KUBE_VERSION: &str = "1.35.8";

fn helm() -> PathBuf {
    let bin = std::env::var("WEIR_HELM_BIN").map(PathBuf::from).unwrap_or_else(|_| PathBuf::from("helm"));
    assert!(
        Command::new(&bin).arg("version").output().is_ok_and(|o| o.status.success()),
        "helm not found at {}: run the suite with `bash .ci/run` (it builds helm) or set WEIR_HELM_BIN",
        bin.display()
    );
    bin
}

fn chart() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/weir-operator")
}

fn helm_run(args: &[&str]) -> (bool, String) {
    let out = Command::new(helm()).args(args).output().expect("helm runs");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn chart_lints_and_refuses_bad_values_with_a_reason() {
    let chart = chart().display().to_string();
    let (ok, out) = helm_run(&["lint", "--strict", &chart, "--set", "defaultStorage=s3://weir-state/prod"]);
    assert!(ok, "helm lint failed:\n{out}");
    let refused = [
        (vec![], "defaultStorage is required"),
        (vec!["--set", "defaultStorage=s3://weir-state/p", "--set", "replicas=0"], "replicas"),
        (vec!["--set", "defaultStorage=ftp://x"], "defaultStorage"),
        (vec!["--set", "defaultStorage=s3://b/p", "--set", "image.pullPolicy=Sometimes"], "pullPolicy"),
        (vec!["--set", "defaultStorage=s3://b/p", "--set", "maxConcurrentReconciles=0"], "maxConcurrentReconciles"),
        (vec!["--set", "defaultStorage=s3://b/p", "--set", "unknownKey=1"], "unknownKey"),
    ];
    for (extra, reason) in refused {
        let mut args = vec!["template", "weir-operator", chart.as_str(), "--kube-version", KUBE_VERSION];
        args.extend(extra.iter().copied());
        let (ok, out) = helm_run(&args);
        assert!(!ok, "helm template {extra:?} should be refused");
        assert!(out.contains(reason), "refusal of {extra:?} should name {reason}:\n{out}");
    }
}

/// With `watchNamespace`, the operator's rights on jobs are a Role in that namespace only; the
/// cluster-wide role keeps the CRD read, and the operator is told to watch that namespace.
#[test]
fn watch_namespace_confines_the_operators_rights_to_it() {
    let docs = rendered_with("s3://weir-state/prod", &["--set", "watchNamespace=jobs"]);
    let cluster_roles = of_kind::<ClusterRole>(&docs, "ClusterRole");
    let cluster_rules: Vec<_> = cluster_roles.iter().flat_map(|r| r.rules.clone().unwrap_or_default()).collect();
    assert_eq!(cluster_rules.len(), 1, "only the CRD read is cluster-wide: {cluster_rules:?}");
    assert_eq!(cluster_rules[0].resources.as_deref(), Some(&["customresourcedefinitions".to_string()][..]));
    let roles = of_kind::<Role>(&docs, "Role");
    let jobs_role = roles.iter().find(|r| r.metadata.namespace.as_deref() == Some("jobs")).expect("a Role in jobs");
    let resources: Vec<String> =
        jobs_role.rules.iter().flatten().flat_map(|r| r.resources.clone().unwrap_or_default()).collect();
    for needed in ["streamjobs", "streamjobs/status", "pods", "secrets", "events"] {
        assert!(resources.iter().any(|r| r == needed), "the jobs Role lacks {needed}: {resources:?}");
    }
    let bindings = of_kind::<RoleBinding>(&docs, "RoleBinding");
    assert!(bindings.iter().any(|b| b.metadata.namespace.as_deref() == Some("jobs") && b.role_ref.kind == "Role"));
    let deployment = &of_kind::<Deployment>(&docs, "Deployment")[0];
    let args = deployment.spec.as_ref().unwrap().template.spec.as_ref().unwrap().containers[0].args.clone();
    assert!(args.unwrap_or_default().contains(&"--namespace=jobs".to_string()));
}

/// The rendered chart, parsed per document.
fn rendered(storage: &str) -> Vec<serde_yaml::Value> {
    rendered_with(storage, &[])
}

/// The rendered chart with further `helm template` arguments, parsed per document.
fn rendered_with(storage: &str, extra: &[&str]) -> Vec<serde_yaml::Value> {
    let chart = chart().display().to_string();
    let storage = format!("defaultStorage={storage}");
    let mut args =
        vec!["template", "weir-operator", &chart, "--kube-version", KUBE_VERSION, "--namespace", RELEASE_NS, "--set"];
    args.push(&storage);
    args.extend_from_slice(extra);
    let (ok, out) = helm_run(&args);
    assert!(ok, "helm template failed:\n{out}");
    out.split("\n---")
        .filter_map(|doc| serde_yaml::from_str::<serde_yaml::Value>(doc).ok())
        .filter(|v| v.get("kind").is_some())
        .collect()
}

fn of_kind<T: serde::de::DeserializeOwned>(docs: &[serde_yaml::Value], kind: &str) -> Vec<T> {
    docs.iter()
        .filter(|d| d["kind"].as_str() == Some(kind))
        .map(|d| serde_yaml::from_value(d.clone()).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_operator_runs_its_whole_lifecycle_with_only_the_charts_rbac() {
    let (server, admin) = TestApiServer::with_namespace(JOBS_NS).await.expect("API server with the CRD starts");
    let storage = tempfile::tempdir().unwrap();
    let docs = rendered(&storage.path().display().to_string());
    let pp = PostParams::default();
    let ns = Namespace {
        metadata: kube::api::ObjectMeta { name: Some(RELEASE_NS.into()), ..Default::default() },
        ..Default::default()
    };
    Api::<Namespace>::all(admin.clone()).create(&pp, &ns).await.unwrap();
    for sa in of_kind::<ServiceAccount>(&docs, "ServiceAccount") {
        Api::<ServiceAccount>::namespaced(admin.clone(), RELEASE_NS).create(&pp, &sa).await.unwrap();
    }
    for r in of_kind::<ClusterRole>(&docs, "ClusterRole") {
        Api::<ClusterRole>::all(admin.clone()).create(&pp, &r).await.unwrap();
    }
    for b in of_kind::<ClusterRoleBinding>(&docs, "ClusterRoleBinding") {
        Api::<ClusterRoleBinding>::all(admin.clone()).create(&pp, &b).await.unwrap();
    }
    for r in of_kind::<Role>(&docs, "Role") {
        Api::<Role>::namespaced(admin.clone(), RELEASE_NS).create(&pp, &r).await.unwrap();
    }
    for b in of_kind::<RoleBinding>(&docs, "RoleBinding") {
        Api::<RoleBinding>::namespaced(admin.clone(), RELEASE_NS).create(&pp, &b).await.unwrap();
    }
    for s in of_kind::<Service>(&docs, "Service") {
        Api::<Service>::namespaced(admin.clone(), RELEASE_NS).create(&pp, &s).await.unwrap();
    }
    let deployments = of_kind::<Deployment>(&docs, "Deployment");
    assert_eq!(deployments.len(), 1);
    Api::<Deployment>::namespaced(admin.clone(), RELEASE_NS).create(&pp, &deployments[0]).await.unwrap();
    // The operator pod meets the restricted Pod Security profile.
    let pod_spec = deployments[0].spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    let psc = pod_spec.security_context.as_ref().unwrap();
    assert_eq!(
        (psc.run_as_non_root, psc.seccomp_profile.as_ref().map(|s| s.type_.as_str())),
        (Some(true), Some("RuntimeDefault"))
    );
    let csc = pod_spec.containers[0].security_context.as_ref().unwrap();
    assert_eq!(csc.allow_privilege_escalation, Some(false));
    assert_eq!(csc.capabilities.as_ref().unwrap().drop.as_deref(), Some(&["ALL".to_string()][..]));
    let sa_name = pod_spec.service_account_name.clone().unwrap();

    // A client that is the chart's ServiceAccount.
    let kc = Kubeconfig::read_from(server.kubeconfig()).unwrap();
    let mut config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await.unwrap();
    config.auth_info.impersonate = Some(format!("system:serviceaccount:{RELEASE_NS}:{sa_name}"));
    config.auth_info.impersonate_groups = Some(vec![
        "system:serviceaccounts".into(),
        format!("system:serviceaccounts:{RELEASE_NS}"),
        "system:authenticated".into(),
    ]);
    let operator = kube::Client::try_from(config).unwrap();

    // Least privilege: no listing of Secrets, no access to other Leases.
    let forbidden = |r: Result<_, kube::Error>| matches!(r, Err(kube::Error::Api(s)) if s.code == 403);
    assert!(forbidden(
        Api::<Secret>::namespaced(operator.clone(), JOBS_NS).list(&ListParams::default()).await.map(|_| ())
    ));
    assert!(forbidden(
        Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(operator.clone(), RELEASE_NS)
            .get("someone-else")
            .await
            .map(|_| ())
    ));

    let election = LeaderElection::new(
        operator.clone(),
        RELEASE_NS,
        "weir-operator",
        "chart-test",
        std::time::Duration::from_secs(15),
    );
    election.acquire().await.expect("the chart's Role allows the Lease");
    let metrics = OperatorMetrics::shared();
    let ingress = ControlIngress {
        operator_namespace: RELEASE_NS.into(),
        operator_pod_labels: [("app.kubernetes.io/name".to_string(), "weir-operator".to_string())].into(),
        extra_namespaces: vec![],
    };
    let settings = Settings {
        control_ingress: Some(ingress),
        control_url_annotation: true,
        ..Settings::new(storage.path().display().to_string())
    };
    let controller = tokio::spawn(run_with_metrics(operator.clone(), settings, metrics.clone()));

    // A job whose storage reads need its credentials Secret.
    let secrets: Api<Secret> = Api::namespaced(admin.clone(), JOBS_NS);
    let creds: Secret =
        serde_yaml::from_str("metadata: { name: store-creds }\nstringData: { AWS_REGION: us-east-1 }").unwrap();
    secrets.create(&pp, &creds).await.unwrap();
    let jobs: Api<StreamJob> = Api::namespaced(admin.clone(), JOBS_NS);
    let job: StreamJob = serde_yaml::from_str(
        r#"
apiVersion: weir.dev/v1alpha1
kind: StreamJob
metadata: { name: rbac, annotations: { weir.dev/control-url: "http://127.0.0.1:1" } }
spec:
  image: weir-runtime:dev
  parallelism: 1
  job:
    inline:
      sources: [ { name: s, uid: s, generator: { fields: [ { name: a, sequence: {} } ] } } ]
      sinks: [ { name: o, stdout: {} } ]
  checkpointing: { credentialsSecret: { name: store-creds } }
  savepoint: { timeout: 3s }
"#,
    )
    .unwrap();
    jobs.create(&pp, &job).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(admin.clone(), JOBS_NS);
    eventually("the runtime pod", 40, || async { pods.get_opt("rbac-runtime-0").await.unwrap() }).await;
    pods.patch_status(
        "rbac-runtime-0",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({ "status": { "phase": "Running" } })),
    )
    .await
    .unwrap();
    eventually("Running", 40, || async {
        (jobs.get("rbac").await.unwrap().status?.phase == Some(weir_crds::streamjob::Phase::Running)).then_some(())
    })
    .await;

    // Delete: the savepoint cannot be taken, so the pods are killed, the recovery checkpoint
    // is looked up in storage (with the Secret), and the finalizer is removed.
    jobs.delete("rbac", &DeleteParams::default()).await.unwrap();
    eventually("the StreamJob gone", 40, || async { jobs.get_opt("rbac").await.unwrap().is_none().then_some(()) })
        .await;
    assert!(pods.get_opt("rbac-runtime-0").await.unwrap().is_none(), "pods killed");
    let events = Api::<k8s_openapi::api::events::v1::Event>::namespaced(admin.clone(), JOBS_NS)
        .list(&ListParams::default())
        .await
        .unwrap();
    assert!(
        events.items.iter().any(|e| e.reason.as_deref() == Some("SavepointFailedPodsKilled")),
        "events recorded by the ServiceAccount"
    );
    let text = metrics.render();
    let errors: Vec<&str> = text.lines().filter(|l| l.starts_with("weir_operator_reconcile_errors_total{")).collect();
    assert!(errors.is_empty(), "no reconcile failed (a 403 would show here): {errors:?}");
    controller.abort();
}

/// With `admissionPolicy.enabled`, the API server holds each StreamJob to its author's own
/// rights: a person allowed to create StreamJobs and nothing else cannot name a Secret, a
/// ConfigMap or a service account through one, nor an image outside the allowed prefixes; given
/// the right to read the Secret, the same job is accepted.
#[tokio::test(flavor = "multi_thread")]
async fn the_admission_policy_holds_streamjob_authors_to_their_own_rights() {
    use k8s_openapi::api::admissionregistration::v1::{ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding};
    let (server, admin) = TestApiServer::with_namespace(JOBS_NS).await.expect("API server with the CRD starts");
    let docs = rendered_with(
        "s3://weir-state/prod",
        &[
            "--set",
            "admissionPolicy.enabled=true",
            "--set",
            "admissionPolicy.allowedImagePrefixes={registry.example/weir/}",
        ],
    );
    let pp = PostParams::default();
    for policy in of_kind::<ValidatingAdmissionPolicy>(&docs, "ValidatingAdmissionPolicy") {
        Api::<ValidatingAdmissionPolicy>::all(admin.clone()).create(&pp, &policy).await.unwrap();
    }
    for binding in of_kind::<ValidatingAdmissionPolicyBinding>(&docs, "ValidatingAdmissionPolicyBinding") {
        Api::<ValidatingAdmissionPolicyBinding>::all(admin.clone()).create(&pp, &binding).await.unwrap();
    }
    // alice may create StreamJobs in `jobs`, and nothing else.
    let author: Role = serde_yaml::from_str(
        "metadata: { name: streamjob-author }\n\
         rules: [ { apiGroups: [weir.dev], resources: [streamjobs], verbs: [create, get, list, update, patch] } ]",
    )
    .unwrap();
    Api::<Role>::namespaced(admin.clone(), JOBS_NS).create(&pp, &author).await.unwrap();
    let binding = |role: &str| -> RoleBinding {
        serde_yaml::from_str(&format!(
            "metadata: {{ name: alice-{role} }}\n\
             roleRef: {{ apiGroup: rbac.authorization.k8s.io, kind: Role, name: {role} }}\n\
             subjects: [ {{ apiGroup: rbac.authorization.k8s.io, kind: User, name: alice }} ]"
        ))
        .unwrap()
    };
    Api::<RoleBinding>::namespaced(admin.clone(), JOBS_NS).create(&pp, &binding("streamjob-author")).await.unwrap();
    let kc = Kubeconfig::read_from(server.kubeconfig()).unwrap();
    let mut config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await.unwrap();
    config.auth_info.impersonate = Some("alice".into());
    config.auth_info.impersonate_groups = Some(vec!["system:authenticated".into()]);
    let alice: Api<StreamJob> = Api::namespaced(kube::Client::try_from(config).unwrap(), JOBS_NS);

    let job = |name: &str, image: &str, extra: &str| -> StreamJob {
        serde_yaml::from_str(&format!(
            "apiVersion: weir.dev/v1alpha1\nkind: StreamJob\nmetadata: {{ name: {name} }}\nspec:\n  \
             image: {image}\n  parallelism: 1\n{extra}  job: {{ inline: {{ sources: [ {{ name: s, uid: s, \
             generator: {{ fields: [ {{ name: a, sequence: {{}} }} ] }} }} ], \
             sinks: [ {{ name: o, stdout: {{}} }} ] }} }}\n"
        ))
        .unwrap()
    };
    let refusal = |r: Result<StreamJob, kube::Error>| match r {
        Err(kube::Error::Api(s)) if s.code == 403 || s.code == 422 => s.message,
        other => panic!("not refused: {other:?}"),
    };
    let good = "registry.example/weir/runtime:1";
    // The policy takes effect once the API server has loaded it.
    let secret_job = job("keys", good, "  checkpointing: { credentialsSecret: { name: s3-keys } }\n");
    let message = eventually("the admission policy in effect", 30, || async {
        match alice.create(&pp, &secret_job).await {
            Err(kube::Error::Api(s)) if s.code == 403 || s.code == 422 => Some(s.message),
            Ok(_) => panic!("a job naming a Secret alice may not read was accepted"),
            Err(_) => None,
        }
    })
    .await;
    assert!(message.contains("spec.checkpointing.credentialsSecret: you may not read Secret s3-keys"), "{message}");
    let cases = [
        (job("env", good, "  podTemplate: { envFromSecrets: [ { name: db } ] }\n"), "spec.podTemplate.envFromSecrets"),
        (job("pull", good, "  podTemplate: { imagePullSecrets: [ { name: regcred } ] }\n"), "imagePullSecrets"),
        (job("sa", good, "  podTemplate: { serviceAccountName: admin }\n"), "spec.podTemplate.serviceAccountName"),
        (job("image", "evil.example/miner:1", ""), "spec.image: must start with one of registry.example/weir/"),
    ];
    for (sj, expected) in cases {
        let message = refusal(alice.create(&pp, &sj).await);
        assert!(message.contains(expected), "expected `{expected}` in `{message}`");
    }
    let mut cm_job = job("cm", good, "");
    cm_job.spec.job = serde_yaml::from_str("{ configMapRef: { name: jobs } }").unwrap();
    assert!(refusal(alice.create(&pp, &cm_job).await).contains("spec.job.configMapRef"));
    // Nothing named, an allowed image: accepted. Given the right to read the Secret: accepted.
    alice.create(&pp, &job("plain", good, "")).await.expect("a job naming nothing is accepted");
    let reader: Role = serde_yaml::from_str(
        "metadata: { name: s3-keys-reader }\n\
         rules: [ { apiGroups: [\"\"], resources: [secrets], resourceNames: [s3-keys], verbs: [get] } ]",
    )
    .unwrap();
    Api::<Role>::namespaced(admin.clone(), JOBS_NS).create(&pp, &reader).await.unwrap();
    Api::<RoleBinding>::namespaced(admin.clone(), JOBS_NS).create(&pp, &binding("s3-keys-reader")).await.unwrap();
    eventually("alice's job naming a Secret she may read", 30, || async { alice.create(&pp, &secret_job).await.ok() })
        .await;
}
