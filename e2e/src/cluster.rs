//! The harness of the scenario suite: one scenario against the cluster that `KUBECONFIG` names
//! (e.g. from `e2e/local/up`), in a namespace of its own (restricted Pod Security enforced), with
//! its own S3 server (`s3s-fs` on the node address, which pods and host both reach) and its own
//! operator watching only that namespace. The operator is, as in production, installed by
//! `helm install` of `charts/weir-operator` and runs in a pod with the chart's ServiceAccount and
//! RBAC, reaching runtimes through their headless Services by cluster DNS
//! (`WEIR_E2E_OPERATOR=cluster`, the default); or, for development, a `weir-operator` process of
//! the workspace running out of cluster and reaching runtimes by pod IP
//! (`WEIR_E2E_OPERATOR=process`). When a scenario fails, its pods, logs, events, StreamJobs and
//! the operator's log are dumped; when it ends, everything it started is stopped.

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use weir_checkpoint::Storage;
use weir_crds::StreamJob;

/// The label selector of the chart's operator pods.
const OPERATOR_SELECTOR: &str = "app.kubernetes.io/name=weir-operator";

/// Bucket of checkpoints, savepoints and job output.
pub const BUCKET: &str = "weir-e2e";
/// The runtime image the scenarios run (imported into the cluster beforehand).
pub fn runtime_image() -> String {
    std::env::var("WEIR_E2E_RUNTIME_IMAGE").unwrap_or_else(|_| "weir.local/weir-runtime:dev".into())
}

/// The operator image of `WEIR_E2E_OPERATOR=cluster` (imported into the cluster beforehand).
pub fn operator_image() -> String {
    std::env::var("WEIR_E2E_OPERATOR_IMAGE").unwrap_or_else(|_| "weir.local/weir-operator:dev".into())
}

/// Where the scenarios' operator runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OperatorMode {
    /// In a pod, installed by `helm install` (`WEIR_E2E_OPERATOR=cluster`, the default).
    InCluster,
    /// A process of this workspace on the host (`WEIR_E2E_OPERATOR=process`).
    Process,
}

/// The operator mode `WEIR_E2E_OPERATOR` asks for.
pub fn operator_mode() -> OperatorMode {
    match std::env::var("WEIR_E2E_OPERATOR").as_deref() {
        Ok("process") => OperatorMode::Process,
        Ok("cluster") | Err(_) => OperatorMode::InCluster,
        Ok(other) => panic!("WEIR_E2E_OPERATOR={other}: use cluster or process"),
    }
}

/// `helm`: `$WEIR_HELM_BIN` (set by `.ci/install-tools.sh`), else the cached one, else PATH.
pub fn helm_binary() -> PathBuf {
    tool("WEIR_HELM_BIN", ".cache/weir/tools/bin/helm", "helm")
}

/// A tool: the path in `$env`, else `~/<cached>` when it exists, else `name` from PATH.
fn tool(env: &str, cached: &str, name: &str) -> PathBuf {
    if let Ok(p) = std::env::var(env) {
        return p.into();
    }
    let built = PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(cached);
    if built.exists() {
        built
    } else {
        PathBuf::from(name)
    }
}

/// The node address: pods and this process both reach services listening on it.
pub fn node_ip() -> String {
    std::env::var("WEIR_E2E_NODE_IP").unwrap_or_else(|_| "10.244.0.1".into())
}

fn s3s_binary() -> PathBuf {
    if let Ok(p) = std::env::var("WEIR_S3S_BIN") {
        return p.into();
    }
    PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/weir/tools/bin/s3s-fs")
}

/// `kubectl`: `$KUBECTL`, else the one `build-k8s.sh --all` built, else from PATH.
pub fn kubectl_binary() -> PathBuf {
    tool("KUBECTL", ".cache/weir/k8s/v1.35.8/bin/kubectl", "kubectl")
}

/// A child process killed when dropped (and by a watchdog shell when this process dies).
struct Guarded(Child);

impl Guarded {
    fn spawn(cmd: Command) -> std::io::Result<Guarded> {
        // The watchdog ends the child when the test process is gone (statics and panics that
        // abort skip Drop).
        let program = cmd.get_program().to_owned();
        let args: Vec<_> = cmd.get_args().map(|a| a.to_owned()).collect();
        let envs: Vec<_> = cmd.get_envs().filter_map(|(k, v)| Some((k.to_owned(), v?.to_owned()))).collect();
        let watchdog = concat!(
            r#"parent=$1; shift; "$@" & child=$!; trap 'kill $child 2>/dev/null; wait $child; exit 0' TERM; "#,
            r#"while kill -0 "$parent" 2>/dev/null && kill -0 "$child" 2>/dev/null; do sleep 0.3; done; "#,
            r#"kill -9 "$child" 2>/dev/null; wait $child"#
        );
        let mut sh = Command::new("sh");
        sh.args(["-c", watchdog, "sh", &std::process::id().to_string()]).arg(program).args(args).envs(envs);
        if let Some(dir) = cmd.get_current_dir() {
            sh.current_dir(dir);
        }
        sh.stdout(Stdio::null()).stderr(Stdio::null());
        Ok(Guarded(sh.spawn()?))
    }

    fn stop(&mut self) {
        // SIGTERM to the watchdog shell, which forwards it and waits.
        let _ = Command::new("kill").arg(self.0.id().to_string()).stderr(Stdio::null()).status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One scenario's world.
pub struct Scenario {
    /// Its namespace.
    pub ns: String,
    /// Admin client of the cluster.
    pub client: kube::Client,
    /// S3 endpoint (`http://<node ip>:<port>`).
    pub s3_endpoint: String,
    dir: tempfile::TempDir,
    s3: Option<Guarded>,
    mode: OperatorMode,
    /// The operator process (`OperatorMode::Process`).
    operator: Option<Guarded>,
    /// Whether the Helm release is installed (`OperatorMode::InCluster`).
    released: bool,
    operator_starts: u32,
}

/// What S3 clients of this scenario need in their environment.
pub fn s3_env(endpoint: &str) -> Vec<(String, String)> {
    [
        ("AWS_ACCESS_KEY_ID", "weire2e"),
        ("AWS_SECRET_ACCESS_KEY", "weire2esecret"),
        ("AWS_REGION", "us-east-1"),
        ("AWS_ENDPOINT", endpoint),
        ("AWS_ALLOW_HTTP", "true"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

impl Scenario {
    /// Sets up namespace `ns` (deleted first if a previous run left it), its S3 server, the
    /// `weir-s3` Secret the jobs use, and the operator.
    pub async fn start(ns: &str) -> Scenario {
        let client =
            kube::Client::try_default().await.expect("a cluster in KUBECONFIG (bring one up with e2e/local/up)");
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("s3").join(BUCKET)).unwrap();
        std::fs::create_dir_all(dir.path().join("s3").join("weir-examples")).unwrap();
        let ip = node_ip();
        let port = std::net::TcpListener::bind((ip.as_str(), 0))
            .expect("the node address is local (is the cluster up?)")
            .local_addr()
            .unwrap()
            .port();
        let mut cmd = Command::new(s3s_binary());
        cmd.args([
            "--host",
            &ip,
            "--port",
            &port.to_string(),
            "--access-key",
            "weire2e",
            "--secret-key",
            "weire2esecret",
        ])
        .arg(dir.path().join("s3"));
        let s3 = Guarded::spawn(cmd).expect("s3s-fs starts (bash .ci/install-tools.sh builds it)");
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect((ip.as_str(), port)).is_err() {
            assert!(Instant::now() < deadline, "s3s-fs did not listen on {ip}:{port}");
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut s = Scenario {
            ns: ns.to_string(),
            client,
            s3_endpoint: format!("http://{ip}:{port}"),
            dir,
            s3: Some(s3),
            mode: operator_mode(),
            operator: None,
            released: false,
            operator_starts: 0,
        };
        s.apply_crd().await;
        s.create_namespace().await;
        s.put_secret("weir-s3", &[]).await;
        s.start_operator().await;
        s
    }

    /// Applies `crds/streamjob.yaml` (server-side, as `kubectl apply --server-side` would) and
    /// waits until it is established.
    async fn apply_crd(&self) {
        use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../crds/streamjob.yaml")).unwrap();
        let crd: CustomResourceDefinition = serde_yaml::from_str(&text).unwrap();
        let name = crd.metadata.name.clone().unwrap();
        let api: Api<CustomResourceDefinition> = Api::all(self.client.clone());
        api.patch(&name, &PatchParams::apply("weir-e2e").force(), &Patch::Apply(&crd)).await.expect("the CRD applies");
        crate::eventually("the CRD established", 60, || async {
            let got = api.get(&name).await.ok()?;
            got.status?.conditions?.iter().any(|c| c.type_ == "Established" && c.status == "True").then_some(())
        })
        .await;
    }

    async fn create_namespace(&self) {
        let api: Api<Namespace> = Api::all(self.client.clone());
        if api.get_opt(&self.ns).await.unwrap().is_some() {
            self.force_delete_namespace().await;
        }
        let ns: Namespace = serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": self.ns,
                "labels": { "pod-security.kubernetes.io/enforce": "restricted", "weir.dev/e2e": "true" }
            }
        }))
        .unwrap();
        api.create(&PostParams::default(), &ns).await.unwrap();
        // The controller-manager creates the default ServiceAccount pods need.
        crate::eventually("the default ServiceAccount", 60, || async {
            Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(self.client.clone(), &self.ns)
                .get_opt("default")
                .await
                .ok()
                .flatten()
        })
        .await;
    }

    /// Deletes the namespace without an operator: an operator a failed run left there is
    /// uninstalled and waited for (it would put the finalizers back), then StreamJob finalizers
    /// are dropped.
    async fn force_delete_namespace(&self) {
        self.helm_uninstall();
        let _ = self.kubectl(&["delete", "deployment", "-l", OPERATOR_SELECTOR, "--wait=false"], None);
        crate::eventually("the old operator pods gone", 120, || async {
            self.operator_pods().await.is_empty().then_some(())
        })
        .await;
        let jobs: Api<StreamJob> = Api::namespaced(self.client.clone(), &self.ns);
        if let Ok(list) = jobs.list(&ListParams::default()).await {
            for j in list.items {
                let name = j.metadata.name.clone().unwrap_or_default();
                let _ = jobs
                    .patch(
                        &name,
                        &PatchParams::default(),
                        &Patch::Merge(serde_json::json!({ "metadata": { "finalizers": null } })),
                    )
                    .await;
            }
        }
        let api: Api<Namespace> = Api::all(self.client.clone());
        let _ = api.delete(&self.ns, &DeleteParams::default()).await;
        crate::eventually("the old namespace gone", 180, || async {
            api.get_opt(&self.ns).await.unwrap().is_none().then_some(())
        })
        .await;
    }

    /// Creates or replaces Secret `name` with the S3 settings plus `extra` entries.
    pub async fn put_secret(&self, name: &str, extra: &[(&str, &str)]) {
        let mut data: serde_json::Map<String, serde_json::Value> =
            s3_env(&self.s3_endpoint).into_iter().map(|(k, v)| (k, v.into())).collect();
        for (k, v) in extra {
            data.insert(k.to_string(), (*v).into());
        }
        let secret: Secret =
            serde_json::from_value(serde_json::json!({ "metadata": { "name": name }, "stringData": data })).unwrap();
        let api: Api<Secret> = Api::namespaced(self.client.clone(), &self.ns);
        let _ = api.delete(name, &DeleteParams::default()).await;
        api.create(&PostParams::default(), &secret).await.unwrap();
    }

    fn operator_log(&self) -> PathBuf {
        self.dir.path().join("operator.log")
    }

    /// Starts the operator (again), watching this namespace only: installs the chart (first
    /// time) or scales its Deployment back to one replica, or starts the process.
    pub async fn start_operator(&mut self) {
        self.operator_starts += 1;
        match self.mode {
            OperatorMode::InCluster if !self.released => self.helm_install(),
            OperatorMode::InCluster => {
                self.kubectl_ok(&["scale", "deployment", &self.release_deployment(), "--replicas=1"]);
                self.kubectl_ok(&["rollout", "status", "deployment", &self.release_deployment(), "--timeout=120s"]);
            }
            OperatorMode::Process => self.start_operator_process().await,
        }
    }

    /// The Helm release of this scenario's operator (cluster-scoped RBAC objects carry its name).
    fn release(&self) -> String {
        format!("op-{}", self.ns)
    }

    /// The operator Deployment the chart names after the release.
    fn release_deployment(&self) -> String {
        format!("{}-weir-operator", self.release())
    }

    /// `helm install` of `charts/weir-operator` into this namespace, as a user installs it, and
    /// waits until the operator is ready.
    fn helm_install(&mut self) {
        let image = operator_image();
        let (repository, tag) = image.rsplit_once(':').expect("WEIR_E2E_OPERATOR_IMAGE names a tag");
        let chart = concat!(env!("CARGO_MANIFEST_DIR"), "/../charts/weir-operator");
        let kubeconfig = std::env::var("KUBECONFIG").expect("KUBECONFIG names the cluster");
        let sets = [
            format!("image.repository={repository}"),
            format!("image.tag={tag}"),
            "image.pullPolicy=Never".to_string(),
            format!("defaultStorage=s3://{BUCKET}/state"),
            "storageCredentialsSecret=weir-s3".to_string(),
            format!("watchNamespace={}", self.ns),
            "statusRefreshSeconds=2".to_string(),
            "logLevel=info\\,weir_operator=debug".to_string(),
        ];
        let mut cmd = Command::new(helm_binary());
        cmd.args(["install", &self.release(), chart, "--namespace", &self.ns, "--kubeconfig", &kubeconfig]);
        for set in &sets {
            cmd.args(["--set", set]);
        }
        cmd.args(["--wait", "--timeout", "180s"]);
        let out = cmd.output().expect("helm runs");
        self.released = true;
        assert!(
            out.status.success(),
            "helm install failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `helm uninstall` of this scenario's release, if there is one: cluster-scoped objects (the
    /// ClusterRole and its binding) go with it.
    fn helm_uninstall(&self) {
        let kubeconfig = std::env::var("KUBECONFIG").unwrap_or_default();
        let _ = Command::new(helm_binary())
            .args(["uninstall", &self.release(), "--namespace", &self.ns, "--kubeconfig", &kubeconfig, "--wait"])
            .args(["--ignore-not-found"])
            .output();
    }

    /// Starts the operator as a process out of cluster, reaching runtimes by pod IP.
    async fn start_operator_process(&mut self) {
        assert!(self.operator.is_none(), "the operator already runs");
        let binary = crate::workspace_binary("weir-operator");
        assert!(binary.exists(), "{} missing: cargo build -p weir-operator", binary.display());
        let kubeconfig = std::env::var("KUBECONFIG").expect("KUBECONFIG names the cluster");
        let http = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
        // The log is appended to across restarts; the shell redirect keeps it simple.
        let line = format!(
            "exec {} --kubeconfig {} --default-storage s3://{BUCKET}/state --http-addr {http} \
             --control-address pod-ip --namespace {ns} --lease-namespace {ns} --identity e2e-{n} \
             --status-refresh-secs 2 >> {log} 2>&1",
            binary.display(),
            kubeconfig,
            ns = self.ns,
            n = self.operator_starts,
            log = self.operator_log().display()
        );
        let mut cmd = Command::new("sh");
        cmd.args(["-c", &line]).envs(s3_env(&self.s3_endpoint));
        self.operator = Some(Guarded::spawn(cmd).expect("weir-operator starts"));
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let ready = reqwest::Client::builder()
                .no_proxy()
                .build()
                .expect("an HTTP client")
                .get(format!("http://{http}/readyz"))
                .send()
                .await;
            if ready.is_ok_and(|r| r.status().is_success()) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "weir-operator not ready after 60 s; its log:\n{}",
                std::fs::read_to_string(self.operator_log()).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Kills the operator at once (SIGKILL), as a crash would. In the cluster its Deployment is
    /// scaled to zero first, so that nothing restarts it, and its process is killed on the node
    /// before its graceful termination can run.
    pub async fn kill_operator(&mut self) {
        if self.mode == OperatorMode::InCluster {
            let pods = self.operator_pods().await;
            self.kubectl_ok(&["scale", "deployment", &self.release_deployment(), "--replicas=0"]);
            for pod in &pods {
                let uid = pod.metadata.uid.clone().unwrap_or_default();
                for pid in pod_pids(&uid, "weir-operator") {
                    let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
                }
            }
            let api = self.pods();
            crate::eventually("the operator pod gone", 60, || async {
                let left = api.list(&ListParams::default().labels(OPERATOR_SELECTOR)).await.ok()?;
                left.items.is_empty().then_some(())
            })
            .await;
            return;
        }
        if let Some(mut op) = self.operator.take() {
            // The watchdog shell's child is the operator; kill both hard.
            let _ = Command::new("pkill").args(["-9", "-P", &op.0.id().to_string()]).status();
            let _ = op.0.kill();
            let _ = op.0.wait();
        }
    }

    /// The operator's pods (`OperatorMode::InCluster`).
    async fn operator_pods(&self) -> Vec<Pod> {
        self.pods().list(&ListParams::default().labels(OPERATOR_SELECTOR)).await.map(|l| l.items).unwrap_or_default()
    }

    /// `kubectl` in this namespace that must succeed.
    fn kubectl_ok(&self, args: &[&str]) {
        let out = self.kubectl(args, None);
        assert!(out.status.success(), "kubectl {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    }

    /// Runs kubectl in this namespace; `stdin` is piped in when given.
    pub fn kubectl(&self, args: &[&str], stdin: Option<&str>) -> Output {
        use std::io::Write;
        let mut cmd = Command::new(kubectl_binary());
        cmd.arg("-n").arg(&self.ns).args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
        cmd.stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() });
        let mut child = cmd.spawn().expect("kubectl runs");
        if let Some(text) = stdin {
            child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
        }
        child.wait_with_output().unwrap()
    }

    /// `kubectl apply -f -` that must succeed.
    pub fn apply(&self, yaml: &str) {
        let out = self.kubectl(&["apply", "-f", "-"], Some(yaml));
        assert!(out.status.success(), "kubectl apply failed: {}", String::from_utf8_lossy(&out.stderr));
    }

    /// The StreamJob API of this namespace.
    pub fn jobs(&self) -> Api<StreamJob> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// The Pod API of this namespace.
    pub fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// Waits until the job's status phase is `phase`.
    pub async fn wait_phase(&self, job: &str, phase: &str, secs: u64) -> weir_crds::streamjob::StreamJobStatus {
        let jobs = self.jobs();
        crate::eventually(&format!("{job} in phase {phase}"), secs, || async {
            jobs.get(job).await.ok()?.status.filter(|s| s.phase.map(|p| p.as_str()) == Some(phase))
        })
        .await
    }

    /// Waits until the job's pod runs in its container (Running, ready, with a pod IP) and
    /// returns it.
    pub async fn wait_pod_running(&self, job: &str, secs: u64) -> Pod {
        let pods = self.pods();
        let name = format!("{job}-runtime-0");
        crate::eventually(&format!("pod {name} running"), secs, || async {
            let p = pods.get_opt(&name).await.ok()??;
            let st = p.status.as_ref()?;
            let ready = st
                .container_statuses
                .as_ref()?
                .iter()
                .all(|c| c.ready && c.state.as_ref().is_some_and(|s| s.running.is_some()));
            (p.metadata.deletion_timestamp.is_none()
                && st.phase.as_deref() == Some("Running")
                && ready
                && st.pod_ip.is_some())
            .then_some(p)
        })
        .await
    }

    /// The reasons of the job's events, oldest first: what `kubectl describe streamjob` lists.
    pub async fn event_reasons(&self, job: &str) -> Vec<String> {
        use k8s_openapi::api::events::v1::Event;
        let api: Api<Event> = Api::namespaced(self.client.clone(), &self.ns);
        let lp = ListParams::default().fields(&format!("regarding.name={job},regarding.kind=StreamJob"));
        let mut events = api.list(&lp).await.map(|l| l.items).unwrap_or_default();
        events.sort_by_key(|e| {
            let at = e.event_time.as_ref().map(|t| t.0).or(e.metadata.creation_timestamp.as_ref().map(|t| t.0));
            (at, e.metadata.resource_version.clone().and_then(|v| v.parse::<u64>().ok()))
        });
        events.into_iter().filter_map(|e| e.reason).collect()
    }

    /// Storage at `url` as this scenario's S3 clients see it.
    pub fn storage(&self, url: &str) -> Storage {
        Storage::open_with_env(url, &s3_env(&self.s3_endpoint)).expect("S3 storage opens")
    }

    /// The committed output records under `url` (files whose names start with neither `_`
    /// nor `.`), as JSON values.
    pub async fn committed(&self, url: &str) -> Vec<serde_json::Value> {
        let storage = self.storage(url);
        let mut out = Vec::new();
        for f in storage.list("").await.unwrap_or_default() {
            // Not output: staged files, commit manifests (`_commits/`), superseded output.
            if f.split('/').any(|seg| seg.starts_with('_') || seg.starts_with('.')) {
                continue;
            }
            // A file can vanish between the listing and the read: a rewinding sink moves
            // output outside the restored history under `_superseded/`.
            let bytes = match storage.get(&f).await {
                Ok(b) => b,
                Err(weir_checkpoint::StorageError::NotFound(_)) => continue,
                Err(e) => panic!("reading committed file {f}: {e}"),
            };
            for line in String::from_utf8_lossy(&bytes).lines().filter(|l| !l.is_empty()) {
                out.push(serde_json::from_str(line).expect("a JSON line"));
            }
        }
        out
    }

    /// Waits until at least `n` records are committed under `url`.
    pub async fn wait_output(&self, url: &str, n: usize, secs: u64) {
        crate::eventually(&format!("{n} committed records in {url}"), secs, || async {
            let got = self.committed(url).await.len();
            (got >= n).then_some(())
        })
        .await;
    }

    /// Deletes the scenario's StreamJobs through the operator (stop with savepoint), then the
    /// namespace; stops the operator and S3 server.
    pub async fn finish(mut self) {
        let jobs = self.jobs();
        for j in jobs.list(&ListParams::default()).await.unwrap().items {
            let _ = jobs.delete(&j.metadata.name.unwrap_or_default(), &DeleteParams::default()).await;
        }
        crate::eventually("the StreamJobs deleted", 120, || async {
            jobs.list(&ListParams::default()).await.ok()?.items.is_empty().then_some(())
        })
        .await;
        if self.released {
            self.helm_uninstall();
            self.released = false;
        }
        let _ = Api::<Namespace>::all(self.client.clone()).delete(&self.ns, &DeleteParams::default()).await;
        self.operator.take();
        self.s3.take();
    }

    /// Prints what a person needs to see why a scenario failed.
    fn dump(&self) {
        eprintln!("===== scenario {} failed: dump =====", self.ns);
        for args in [
            vec!["get", "streamjobs,pods,services,configmaps,networkpolicies", "-o", "wide"],
            vec!["get", "streamjobs", "-o", "yaml"],
            vec!["describe", "pods"],
            vec!["get", "events", "--sort-by", ".lastTimestamp"],
            vec!["logs", "-l", "weir.dev/job", "--all-containers", "--tail", "200", "--prefix"],
        ] {
            let out = self.kubectl(&args, None);
            eprintln!(
                "----- kubectl {} -----\n{}{}",
                args.join(" "),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let log = match self.mode {
            OperatorMode::Process => std::fs::read_to_string(self.operator_log()).unwrap_or_default(),
            OperatorMode::InCluster => {
                let out = self.kubectl(&["logs", "-l", OPERATOR_SELECTOR, "--tail", "200", "--prefix"], None);
                String::from_utf8_lossy(&out.stdout).into_owned()
            }
        };
        let tail: Vec<&str> = log.lines().rev().take(200).collect();
        eprintln!(
            "----- operator log (last 200 lines) -----\n{}",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
}

impl Drop for Scenario {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.dump();
        }
    }
}

/// Reads running counts (`{"k":..,"n":..}`) and checks that every count of every key is there
/// exactly once, record by record; returns the number of records.
pub fn assert_running_counts_exactly_once(records: &[serde_json::Value]) -> usize {
    let mut per_key: std::collections::BTreeMap<i64, Vec<i64>> = Default::default();
    for v in records {
        per_key.entry(v["k"].as_i64().expect("field k")).or_default().push(v["n"].as_i64().expect("field n"));
    }
    for (k, mut counts) in per_key {
        counts.sort_unstable();
        let expected: Vec<i64> = (1..=counts.len() as i64).collect();
        if counts != expected {
            let dup: Vec<i64> = counts.windows(2).filter(|w| w[0] == w[1]).map(|w| w[0]).collect();
            let missing: Vec<i64> =
                expected.iter().filter(|n| counts.binary_search(n).is_err()).copied().take(10).collect();
            panic!("key {k}: counts are not 1..{} exactly once: duplicated {dup:?}, missing {missing:?}", counts.len());
        }
    }
    records.len()
}

/// Host PIDs of `weir-runtime` processes of the pod with this uid (its cgroup names the pod).
pub fn runtime_pids(pod_uid: &str) -> Vec<u32> {
    pod_pids(pod_uid, "weir-runtime")
}

/// Host PIDs of the processes of the pod with this uid whose command line names `program`.
pub fn pod_pids(pod_uid: &str, program: &str) -> Vec<u32> {
    let mut pids = Vec::new();
    let needle = pod_uid.replace('-', "_");
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        if !String::from_utf8_lossy(&cmdline).contains(program) {
            continue;
        }
        let cgroup = std::fs::read_to_string(e.path().join("cgroup")).unwrap_or_default();
        if cgroup.contains(pod_uid) || cgroup.contains(&needle) {
            pids.push(pid);
        }
    }
    pids
}

/// Host PIDs of the processes named `comm` (as `ps -o comm` shows it) in the kind node container
/// `node` (`docker top`): on kind, a node's kubelet is such a process.
pub fn kind_node_pids(node: &str, comm: &str) -> Vec<u32> {
    let out = Command::new("docker").args(["top", node, "-eo", "pid,comm"]).output();
    let Ok(out) = out else { return Vec::new() };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .skip(1)
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            let pid = words.next()?.parse().ok()?;
            (words.next()? == comm).then_some(pid)
        })
        .collect()
}

/// Runs `args` in the kind node container `node` (`docker exec`).
pub fn kind_node_exec(node: &str, args: &[&str]) -> Output {
    Command::new("docker").arg("exec").arg(node).args(args).output().expect("docker runs")
}

/// Sends `signal` (`STOP`, `CONT`, `KILL`) to host processes.
pub fn signal(pids: &[u32], signal: &str) {
    for pid in pids {
        let _ = Command::new("kill").args([format!("-{signal}"), pid.to_string()]).status();
    }
}

/// Every file of a file sink's output directory but the staged ones (`.part-…`), and its length:
/// published output and commit manifests, which a reader may have consumed and nothing may
/// delete or change.
pub async fn published_files(storage: &Storage) -> std::collections::BTreeMap<String, u64> {
    let mut files = std::collections::BTreeMap::new();
    for f in storage.list("").await.unwrap_or_default() {
        if !f.split('/').any(|seg| seg.starts_with('.')) {
            let len = storage.get(&f).await.map(|b| b.len() as u64).unwrap_or(u64::MAX);
            files.insert(f, len);
        }
    }
    files
}
