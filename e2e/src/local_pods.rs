//! Runs a pod's runtime container as a local process, for tests against an API server without
//! a kubelet: its ConfigMap and Secret volumes become files, its control port a free loopback
//! port, and its exit (with the termination message) is reported in the pod's status as a
//! kubelet would.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use kube::api::{Api, Patch, PatchParams};

/// Why a pod could not be run.
#[derive(Debug, thiserror::Error)]
pub enum LocalPodError {
    /// Reading the pod's volumes or patching its status failed.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// Files or the process could not be created.
    #[error("local process: {0}")]
    Io(#[from] std::io::Error),
    /// The pod is not what this runner understands.
    #[error("pod: {0}")]
    Pod(String),
}

/// A pod's container running as a local process.
pub struct LocalPod {
    child: Child,
    dir: tempfile::TempDir,
    /// The control API's address: `https://127.x.y.z:<port>` when the pod serves it over TLS
    /// (as the operator's pods do), else `http://`. Each local pod has a loopback address of its
    /// own, as each pod has its IP: the operator pins each job's certificate by host.
    pub control_url: String,
    name: String,
    /// The uid of the pod this process stands for: its status is reported to that pod only.
    uid: Option<String>,
    pods: Api<Pod>,
}

/// A loopback address of its own for a local pod (`127.0.0.0/8` is all loopback on Linux).
fn loopback_host() -> String {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + std::process::id() * 7;
    format!("127.{}.{}.{}", 1 + n % 250, (n / 250) % 250, 2 + (n / 62_500) % 250)
}

/// The `weir-runtime` binary built next to the running test.
pub fn runtime_binary() -> PathBuf {
    crate::workspace_binary("weir-runtime")
}

impl LocalPod {
    /// Materializes the pod's volumes, starts its container's command locally and marks the
    /// pod Running.
    pub async fn start(client: &kube::Client, pod: &Pod, binary: &Path) -> Result<LocalPod, LocalPodError> {
        let ns = pod.metadata.namespace.clone().ok_or_else(|| LocalPodError::Pod("no namespace".into()))?;
        let name = pod.metadata.name.clone().ok_or_else(|| LocalPodError::Pod("no name".into()))?;
        let spec = pod.spec.clone().ok_or_else(|| LocalPodError::Pod("no spec".into()))?;
        let container = spec.containers.first().cloned().ok_or_else(|| LocalPodError::Pod("no container".into()))?;
        let dir = tempfile::Builder::new().prefix(&format!("pod-{name}-")).tempdir()?;
        let mut mounts: Vec<(String, PathBuf)> = Vec::new();
        for v in spec.volumes.unwrap_or_default() {
            let local = dir.path().join("volumes").join(&v.name);
            std::fs::create_dir_all(&local)?;
            if let Some(cm) = &v.config_map {
                let got = Api::<ConfigMap>::namespaced(client.clone(), &ns).get(&cm.name).await?;
                for (k, text) in got.data.unwrap_or_default() {
                    std::fs::write(local.join(k), text)?;
                }
            }
            if let Some(sec) = &v.secret {
                let got = Api::<Secret>::namespaced(client.clone(), &ns)
                    .get(sec.secret_name.as_deref().unwrap_or_default())
                    .await?;
                for (k, bytes) in got.data.unwrap_or_default() {
                    std::fs::write(local.join(k), bytes.0)?;
                }
            }
            if let Some(m) = container.volume_mounts.iter().flatten().find(|m| m.name == v.name) {
                mounts.push((m.mount_path.clone(), local));
            }
        }
        let host = loopback_host();
        let port = std::net::TcpListener::bind((host.as_str(), 0))?.local_addr()?.port();
        let termination_log = dir.path().join("termination-log");
        let args: Vec<String> = container
            .args
            .unwrap_or_default()
            .into_iter()
            .map(|a| {
                let mut a = a;
                if let Some(p) = a.strip_prefix("0.0.0.0:") {
                    if p.parse::<u16>().is_ok() {
                        a = format!("{host}:{port}");
                    }
                }
                // The longest mount path that prefixes the argument, once.
                if let Some((mount, local)) =
                    mounts.iter().filter(|(m, _)| a.starts_with(m.as_str())).max_by_key(|(m, _)| m.len())
                {
                    a = format!("{}{}", local.display(), &a[mount.len()..]);
                }
                if a == "/dev/termination-log" {
                    a = termination_log.display().to_string();
                }
                a
            })
            .collect();
        let work = dir.path().join("work");
        std::fs::create_dir_all(&work)?;
        let log = std::fs::File::create(dir.path().join("runtime.log"))?;
        let child = Command::new(binary).args(&args).current_dir(&work).stdout(Stdio::null()).stderr(log).spawn()?;
        let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
        pods.patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "status": { "phase": "Running" } })),
        )
        .await?;
        let scheme = if args.iter().any(|a| a == "--tls-cert-file") { "https" } else { "http" };
        Ok(LocalPod {
            child,
            dir,
            control_url: format!("{scheme}://{host}:{port}"),
            name,
            uid: pod.metadata.uid.clone(),
            pods,
        })
    }

    /// When the process has exited: reports it in the pod's status (phase, exit code,
    /// termination message) and returns the exit code.
    pub async fn reap(&mut self) -> Result<Option<i32>, LocalPodError> {
        let Some(status) = self.child.try_wait()? else { return Ok(None) };
        let code = status.code().unwrap_or(137);
        let message = std::fs::read_to_string(self.dir.path().join("termination-log")).unwrap_or_default();
        let phase = if code == 0 { "Succeeded" } else { "Failed" };
        // The uid is a precondition: a new pod of the same name (the operator may already
        // have replaced this one) must not get this process's exit.
        let patch = serde_json::json!({
            "metadata": { "uid": self.uid },
            "status": { "phase": phase, "containerStatuses": [ {
                "name": "runtime", "image": "local", "imageID": "local", "ready": false, "restartCount": 0,
                "state": { "terminated": {
                    "exitCode": code,
                    "message": message,
                    "reason": if code == 0 { "Completed" } else { "Error" }
                } }
            } ] }
        });
        match self.pods.patch_status(&self.name, &PatchParams::default(), &Patch::Merge(patch)).await {
            Ok(_) => Ok(Some(code)),
            // The pod is gone or replaced: as for a kubelet, there is nothing left to report to.
            // (A replaced pod answers 409, or 422 "metadata.uid: field is immutable".)
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(Some(code)),
            Err(kube::Error::Api(s)) if s.code == 422 && s.message.contains("metadata.uid") => Ok(Some(code)),
            Err(e) => Err(e.into()),
        }
    }

    /// Kills the process (SIGKILL), as a lost node or an OOM kill would.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
    }

    /// The runtime's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("runtime.log")).unwrap_or_default()
    }
}

impl Drop for LocalPod {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
