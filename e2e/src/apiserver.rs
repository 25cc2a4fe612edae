//! A real etcd + kube-apiserver for tests, started by `e2e/tools/start-apiserver.sh` on free
//! loopback ports in a temporary directory, stopped when dropped (and by a watchdog when the
//! test process dies first).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};

/// Why the API server could not be started or used.
#[derive(Debug, thiserror::Error)]
pub enum ApiServerError {
    /// The binaries are missing.
    #[error("no etcd/kube-apiserver in {0}: run `bash e2e/tools/build-k8s.sh` (or set KUBEBUILDER_ASSETS)")]
    MissingBinaries(String),
    /// The start script failed.
    #[error("starting the API server failed: {0}")]
    Start(String),
    /// The kubeconfig could not be used.
    #[error("client: {0}")]
    Client(String),
    /// The CRD was not applied or never became established.
    #[error("CRD: {0}")]
    Crd(String),
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("e2e/ is inside the repository").to_path_buf()
}

/// The directory holding etcd and kube-apiserver: `KUBEBUILDER_ASSETS`, else the cache
/// `build-k8s.sh` fills.
pub fn assets() -> Result<PathBuf, ApiServerError> {
    let dir = match std::env::var("KUBEBUILDER_ASSETS") {
        Ok(d) if !d.is_empty() => PathBuf::from(d),
        _ => {
            let cache = std::env::var("WEIR_CACHE")
                .map(PathBuf::from)
                .unwrap_or_else(|_| PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/weir"));
            cache.join("k8s/v1.35.8/bin")
        }
    };
    if dir.join("etcd").exists() && dir.join("kube-apiserver").exists() {
        Ok(dir)
    } else {
        Err(ApiServerError::MissingBinaries(dir.display().to_string()))
    }
}

/// `N` distinct free loopback ports. Every listener is held until all are chosen, so no two
/// are the same port (three separate bind-and-close calls once gave etcd's client and peer
/// listeners one port); they close on return, just before the children bind them.
fn free_ports<const N: usize>() -> Result<[u16; N], ApiServerError> {
    let start = |e: std::io::Error| ApiServerError::Start(format!("choosing free ports: {e}"));
    let listeners =
        (0..N).map(|_| std::net::TcpListener::bind("127.0.0.1:0")).collect::<Result<Vec<_>, _>>().map_err(start)?;
    let mut ports = [0; N];
    for (port, listener) in ports.iter_mut().zip(&listeners) {
        *port = listener.local_addr().map_err(start)?.port();
    }
    Ok(ports)
}

/// A running API server.
pub struct TestApiServer {
    dir: tempfile::TempDir,
    kubeconfig: PathBuf,
    watchdog: Option<Child>,
}

impl TestApiServer {
    /// Starts etcd and kube-apiserver and waits until the API server is ready. A port taken
    /// between choosing and binding it (by another test's server) makes the start script fail;
    /// it is then tried again on new ports, up to three times in all.
    pub fn start() -> Result<TestApiServer, ApiServerError> {
        const ATTEMPTS: usize = 3;
        let mut attempt = 1;
        loop {
            match free_ports().and_then(TestApiServer::start_on) {
                Err(ApiServerError::Start(why)) if why.contains("address already in use") && attempt < ATTEMPTS => {
                    eprintln!("API server start {attempt}/{ATTEMPTS}: a chosen port was taken, trying new ports");
                    attempt += 1;
                }
                started => return started,
            }
        }
    }

    /// Starts on the given API server, etcd client and etcd peer ports.
    fn start_on([apiserver_port, etcd_port, etcd_peer_port]: [u16; 3]) -> Result<TestApiServer, ApiServerError> {
        let assets = assets()?;
        let dir = tempfile::Builder::new()
            .prefix("weir-apiserver-")
            .tempdir()
            .map_err(|e| ApiServerError::Start(e.to_string()))?;
        let script = repo_root().join("e2e/tools/start-apiserver.sh");
        let out = Command::new("bash")
            .arg(&script)
            .arg("start")
            .arg(dir.path())
            .env("KUBEBUILDER_ASSETS", &assets)
            .env("APISERVER_PORT", apiserver_port.to_string())
            .env("ETCD_PORT", etcd_port.to_string())
            .env("ETCD_PEER_PORT", etcd_peer_port.to_string())
            .stdin(Stdio::null())
            .output()
            .map_err(|e| ApiServerError::Start(e.to_string()))?;
        // Whatever happened, stop what was started when this process goes away.
        let watchdog = Command::new("sh")
            .args(["-c", r#"while kill -0 "$1" 2>/dev/null; do sleep 0.5; done; bash "$2" stop "$3""#, "sh"])
            .arg(std::process::id().to_string())
            .arg(&script)
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok();
        if !out.status.success() {
            return Err(ApiServerError::Start(
                String::from_utf8_lossy(&out.stderr).lines().rev().take(15).collect::<Vec<_>>().join("\n"),
            ));
        }
        let kubeconfig = dir.path().join("kubeconfig");
        Ok(TestApiServer { dir, kubeconfig, watchdog })
    }

    /// The kubeconfig file (admin token, the server's CA).
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// A client authenticated as the admin user.
    pub async fn client(&self) -> Result<kube::Client, ApiServerError> {
        let kc = Kubeconfig::read_from(&self.kubeconfig).map_err(|e| ApiServerError::Client(e.to_string()))?;
        let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
            .await
            .map_err(|e| ApiServerError::Client(e.to_string()))?;
        kube::Client::try_from(config).map_err(|e| ApiServerError::Client(e.to_string()))
    }

    /// Starts a server with the StreamJob CRD installed and namespace `ns` ready for pods (with
    /// the `default` ServiceAccount a controller-manager would create).
    pub async fn with_namespace(ns: &str) -> Result<(TestApiServer, kube::Client), ApiServerError> {
        use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
        let server = TestApiServer::start()?;
        let client = server.client().await?;
        server.install_crd(&client).await?;
        let create = |e: kube::Error| ApiServerError::Client(e.to_string());
        let namespace = Namespace {
            metadata: kube::api::ObjectMeta { name: Some(ns.to_string()), ..Default::default() },
            ..Default::default()
        };
        Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &namespace).await.map_err(create)?;
        let sa = ServiceAccount {
            metadata: kube::api::ObjectMeta { name: Some("default".into()), ..Default::default() },
            ..Default::default()
        };
        Api::<ServiceAccount>::namespaced(client.clone(), ns)
            .create(&PostParams::default(), &sa)
            .await
            .map_err(create)?;
        Ok((server, client))
    }

    /// Creates the StreamJob CRD from `crds/streamjob.yaml` and waits until it is established.
    pub async fn install_crd(&self, client: &kube::Client) -> Result<(), ApiServerError> {
        let text = std::fs::read_to_string(repo_root().join("crds/streamjob.yaml"))
            .map_err(|e| ApiServerError::Crd(e.to_string()))?;
        let crd: CustomResourceDefinition =
            serde_yaml::from_str(&text).map_err(|e| ApiServerError::Crd(e.to_string()))?;
        let api: Api<CustomResourceDefinition> = Api::all(client.clone());
        api.create(&PostParams::default(), &crd).await.map_err(|e| ApiServerError::Crd(e.to_string()))?;
        let name = crd.metadata.name.clone().unwrap_or_default();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let got = api.get(&name).await.map_err(|e| ApiServerError::Crd(e.to_string()))?;
            let established = got
                .status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True");
            if established {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                return Err(ApiServerError::Crd(format!("{name} not established after 30s")));
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
}

impl Drop for TestApiServer {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(repo_root().join("e2e/tools/start-apiserver.sh"))
            .arg("stop")
            .arg(self.dir.path())
            .stderr(Stdio::null())
            .status();
        if let Some(mut w) = self.watchdog.take() {
            let _ = w.kill();
            let _ = w.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn free_ports_are_distinct() {
        for _ in 0..50 {
            let ports: [u16; 3] = super::free_ports().unwrap();
            assert!(ports[0] != ports[1] && ports[1] != ports[2] && ports[0] != ports[2], "{ports:?}");
        }
    }

    /// A port taken between choosing and binding it once let a second test's API server use
    /// the first test's etcd (its objects appeared in the other test). A start whose etcd port
    /// is held by another server's etcd must fail, naming the taken port, and not come up on the
    /// foreign etcd.
    #[test]
    fn a_start_on_another_servers_etcd_port_fails_instead_of_sharing_it() {
        let first_ports: [u16; 3] = super::free_ports().unwrap();
        let _first = super::TestApiServer::start_on(first_ports).expect("the first server starts");
        let [apiserver, _, peer]: [u16; 3] = super::free_ports().unwrap();
        match super::TestApiServer::start_on([apiserver, first_ports[1], peer]) {
            Err(super::ApiServerError::Start(why)) => assert!(why.contains("address already in use"), "{why}"),
            Err(other) => panic!("failed for another reason: {other}"),
            Ok(_) => panic!("a second server came up on the first server's etcd"),
        }
    }
}
