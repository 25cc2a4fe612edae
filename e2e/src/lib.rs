//! Weir's end-to-end tooling: a real kube-apiserver and etcd (built from the Kubernetes Go
//! modules by `e2e/tools/build-k8s.sh`) started on loopback for tests, pods run as local
//! processes for API-server-only tests, and the harness of the scenario suite that runs against
//! a real cluster (`e2e/local/up`, or any cluster KUBECONFIG names).

pub mod apiserver;
pub mod cluster;
pub mod local_pods;

use std::path::{Path, PathBuf};
use std::time::Duration;

/// A binary of the workspace built next to the running test
/// (`target/<profile>/deps/<test>` → `target/<profile>/<name>`).
pub fn workspace_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    exe.parent().and_then(Path::parent).map(|d| d.join(name)).unwrap_or_default()
}

/// Polls `f` every 100 ms until it yields a value; fails the test after `secs` seconds, naming
/// `what` was awaited.
pub async fn eventually<T, F, Fut>(what: &str, secs: u64, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out after {secs} s waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
