//! A job whose storage can no longer be read cannot be deleted the ordinary way: its cancel
//! reads the newest checkpoint to name the recovery point, storage refuses, so the finalizer
//! stays and the failure is reported. `weir.dev/force-delete: "true"` lets it go: its pods are
//! killed and a Warning event says what was given up. The job's storage is a real S3 server
//! (s3s-fs) read with the tenant's own credentials, which are then revoked (a wrong secret:
//! refused at once, where an unreachable server is retried for a minute).

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use weir_crds::StreamJob;
use weir_e2e::apiserver::TestApiServer;
use weir_operator::controller::{run, Settings, FORCE_DELETE_ANNOTATION};

mod common;
use common::{degraded, eventually, warning_event};

/// An S3 server (s3s-fs) with bucket `tenant`, on a free port; killed when dropped.
struct S3 {
    child: Child,
    port: u16,
    _root: tempfile::TempDir,
}

impl S3 {
    fn start() -> S3 {
        let binary = std::env::var("WEIR_S3S_BIN")
            .unwrap_or_else(|_| format!("{}/.cache/weir/tools/bin/s3s-fs", std::env::var("HOME").unwrap_or_default()));
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("tenant")).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = Command::new(&binary)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--access-key", "tenantkey", "--secret-key", "tenantsecret"])
            .arg(root.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{binary}: {e} (run .ci/install-tools.sh or set WEIR_S3S_BIN)"));
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(std::time::Instant::now() < deadline, "s3s-fs did not listen on {port}");
            std::thread::sleep(Duration::from_millis(20));
        }
        S3 { child, port, _root: root }
    }
}

impl Drop for S3 {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_job_whose_storage_is_gone_is_let_go_by_force_delete() {
    let ns = "force";
    let (_server, client) = TestApiServer::with_namespace(ns).await.expect("API server with the CRD starts");
    let state = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let s3 = S3::start();
    let controller = tokio::spawn(run(client.clone(), Settings::new(state.path().display().to_string())));
    let jobs: Api<StreamJob> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pp = PostParams::default();
    let keys: Secret = serde_yaml::from_str(&format!(
        "metadata: {{ name: own-keys }}\nstringData: {{ AWS_ACCESS_KEY_ID: tenantkey, \
         AWS_SECRET_ACCESS_KEY: tenantsecret, AWS_REGION: us-east-1, \
         AWS_ENDPOINT: \"http://127.0.0.1:{}\", AWS_ALLOW_HTTP: \"true\" }}",
        s3.port
    ))
    .unwrap();
    Api::<Secret>::namespaced(client.clone(), ns).create(&pp, &keys).await.unwrap();
    let job: StreamJob = serde_yaml::from_str(
        "apiVersion: weir.dev/v1alpha1\nkind: StreamJob\nmetadata: { name: doomed }\nspec:\n  \
         image: weir-runtime:dev\n  parallelism: 1\n  \
         checkpointing: { storage: \"s3://tenant/weir\", credentialsSecret: { name: own-keys } }\n  \
         job: { inline: { sources: [ { name: s, uid: s, generator: { fields: [ { name: a, sequence: {} } ] } } ], \
         sinks: [ { name: o, stdout: {} } ] } }",
    )
    .unwrap();
    jobs.create(&pp, &job).await.unwrap();
    // Deployed after its (empty) checkpoint storage was read with the tenant's credentials.
    eventually("the job's pod", 40, || async { pods.get_opt("doomed-runtime-0").await.unwrap() }).await;

    // Storage unreadable, the job deleted: its cancel cannot read the newest checkpoint, so the
    // finalizer stays and status says why.
    let revoked = serde_json::json!({ "stringData": { "AWS_SECRET_ACCESS_KEY": "revoked" } });
    let secrets = Api::<Secret>::namespaced(client.clone(), ns);
    secrets.patch("own-keys", &PatchParams::default(), &Patch::Merge(revoked)).await.unwrap();
    jobs.delete("doomed", &DeleteParams::default()).await.unwrap();
    let message = degraded(&jobs, "doomed", "ReconcileFailed").await;
    assert!(message.contains("storage"), "{message}");
    let still = jobs.get("doomed").await.unwrap();
    assert!(still.metadata.deletion_timestamp.is_some() && still.metadata.finalizers.is_some());

    // Let go by hand: the pod is killed, the job goes, the event says what was given up.
    let patch = serde_json::json!({ "metadata": { "annotations": { FORCE_DELETE_ANNOTATION: "true" } } });
    jobs.patch("doomed", &PatchParams::default(), &Patch::Merge(patch)).await.unwrap();
    eventually("the job gone", 40, || async { jobs.get_opt("doomed").await.unwrap().is_none().then_some(()) }).await;
    assert!(pods.get_opt("doomed-runtime-0").await.unwrap().is_none(), "the pod was not killed");
    let note = warning_event(&client, ns, "doomed", "ForceDeleted").await;
    assert!(note.contains("killed without a savepoint") && note.contains("s3://tenant/weir/force/doomed"), "{note}");
    controller.abort();
}
