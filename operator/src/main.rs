//! `weir-operator`: runs the StreamJob controller in or out of a cluster.

use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::Api;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::CustomResourceExt;
use weir_crds::StreamJob;
use weir_operator::controller::{run_with_metrics, Settings};
use weir_operator::leader::LeaderElection;
use weir_operator::metrics::{serve, OperatorMetrics};

#[derive(Parser)]
#[command(name = "weir-operator", version, about = "Runs Weir StreamJobs on Kubernetes")]
struct Args {
    /// Kubeconfig to use (default: in-cluster config, else the current context).
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<String>,
    /// Storage root for jobs that name none: s3://bucket/prefix (credentials from the
    /// operator's environment) or a path.
    #[arg(long, env = "WEIR_DEFAULT_STORAGE")]
    default_storage: String,
    /// Serve /metrics, /healthz and /readyz on this address.
    #[arg(long, env = "WEIR_OPERATOR_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    http_addr: String,
    /// Namespace of the leader-election Lease (default: the pod's namespace, else `default`).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    lease_namespace: String,
    /// This replica's identity in the Lease (default: the pod name, else the host name).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// How long to wait for the StreamJob CRD to be established at start.
    #[arg(long, default_value_t = 60)]
    crd_wait_secs: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_writer(std::io::stderr).with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).with_target(false).init();
    let args = Args::parse();
    let config = match &args.kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path).with_context(|| format!("reading kubeconfig {path}"))?;
            kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    let client = kube::Client::try_from(config)?;
    let metrics = OperatorMetrics::shared();
    let http = serve(&args.http_addr, metrics.clone()).with_context(|| format!("serving metrics on {}", args.http_addr))?;
    tracing::info!(%http, "metrics and health endpoints listening");
    wait_for_crd(&client, Duration::from_secs(args.crd_wait_secs)).await?;
    let identity = args.identity.clone().unwrap_or_else(|| std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_string()).unwrap_or_else(|_| format!("weir-operator-{}", std::process::id())));
    let election = LeaderElection::new(client.clone(), &args.lease_namespace, "weir-operator", &identity, Duration::from_secs(15));
    tracing::info!(%identity, "waiting for the leader lease");
    election.acquire().await?;
    tracing::info!(default_storage = %args.default_storage, %identity, "leader: weir-operator running");
    tokio::select! {
        () = run_with_metrics(client, Settings { default_storage: args.default_storage }, metrics) => {}
        lost = election.keep() => anyhow::bail!("stopping: {lost}"),
    }
    tracing::info!("weir-operator stopped");
    Ok(())
}

async fn wait_for_crd(client: &kube::Client, timeout: Duration) -> anyhow::Result<()> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let name = StreamJob::crd_name();
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(crd) = api.get_opt(name).await? {
            if crd.status.and_then(|s| s.conditions).unwrap_or_default().iter().any(|c| c.type_ == "Established" && c.status == "True") {
                return Ok(());
            }
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "CRD {name} not established after {timeout:?}: apply crds/streamjob.yaml first");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
