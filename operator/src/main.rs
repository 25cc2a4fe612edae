//! `weir-operator`: runs the StreamJob controller in or out of a cluster.

use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::Api;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::CustomResourceExt;
use weir_crds::StreamJob;
use weir_operator::children::ControlIngress;
use weir_operator::controller::{run_with_metrics, ControlAddress, Settings};
use weir_operator::leader::LeaderElection;
use weir_operator::metrics::{serve, OperatorMetrics};

#[derive(Parser)]
#[command(name = "weir-operator", version, about = "Runs Weir StreamJobs on Kubernetes")]
struct Args {
    /// Kubeconfig to use (default: in-cluster config, else the current context).
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<String>,
    /// Storage root for jobs that name none: s3://, gs:// or az://bucket/prefix (credentials
    /// from the operator's environment) or a path.
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
    /// How to reach each job's control API: `service` (cluster DNS; in-cluster) or `pod-ip`
    /// (straight to the pod; for an operator outside the cluster on a host that routes to pods).
    #[arg(long, env = "WEIR_CONTROL_ADDRESS", value_enum, default_value_t = ControlAddress::Service)]
    control_address: ControlAddress,
    /// At most this many StreamJobs reconciled at once.
    #[arg(long, env = "WEIR_MAX_CONCURRENT_RECONCILES", default_value_t = 16)]
    max_concurrent_reconciles: u16,
    /// Refresh a running job's status (newest checkpoint) this often, in seconds.
    #[arg(long, env = "WEIR_STATUS_REFRESH_SECS", default_value_t = 30)]
    status_refresh_secs: u64,
    /// Give each job a NetworkPolicy that admits only the operator's pods (labelled
    /// `app.kubernetes.io/name=weir-operator` in --lease-namespace) to its control API. Leave
    /// off when the operator runs outside the cluster.
    #[arg(long, env = "WEIR_CONTROL_NETWORK_POLICY")]
    control_network_policy: bool,
    /// With --control-network-policy: further namespaces admitted to the control API (e.g. the
    /// one Prometheus scrapes from), comma-separated.
    #[arg(long, env = "WEIR_CONTROL_INGRESS_NAMESPACES", value_delimiter = ',')]
    control_ingress_namespaces: Vec<String>,
    /// Watch StreamJobs in this namespace only (default: all namespaces).
    #[arg(long, env = "WEIR_WATCH_NAMESPACE")]
    namespace: Option<String>,
    /// Further storage roots each namespace may use with the operator's own credentials,
    /// comma-separated, each with `{namespace}` (e.g. `s3://weir-{namespace}/jobs`). The default
    /// storage's `<root>/<namespace>` is always one; outside them a job needs its own
    /// credentialsSecret (and local paths are refused).
    #[arg(long, env = "WEIR_ALLOWED_STORAGE_ROOTS", value_delimiter = ',')]
    allowed_storage_roots: Vec<String>,
    /// Honour the `weir.dev/control-url` annotation of a job (reach its control API there). Only
    /// for an operator running outside the cluster (tests): in a cluster the annotation would
    /// send the job's token wherever its author points it.
    #[arg(long, env = "WEIR_OUT_OF_CLUSTER_CONTROL_URLS")]
    out_of_cluster_control_urls: bool,
    /// Abandon one reconcile after this many seconds (retried with backoff).
    #[arg(long, env = "WEIR_RECONCILE_TIMEOUT_SECS", default_value_t = 60)]
    reconcile_timeout_secs: u64,
    /// How long to wait for the StreamJob CRD to be established at start.
    #[arg(long, default_value_t = 60)]
    crd_wait_secs: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_logging()?;
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
    let http = serve(&args.http_addr, metrics.clone())
        .await
        .with_context(|| format!("serving metrics on {}", args.http_addr))?;
    tracing::info!(%http, "metrics and health endpoints listening");
    wait_for_crd(&client, Duration::from_secs(args.crd_wait_secs)).await?;
    let identity = args.identity.clone().unwrap_or_else(|| {
        std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| format!("weir-operator-{}", std::process::id()))
    });
    let election =
        LeaderElection::new(client.clone(), &args.lease_namespace, "weir-operator", &identity, Duration::from_secs(15));
    tracing::info!(%identity, "waiting for the leader lease");
    election.acquire().await?;
    tracing::info!(default_storage = %args.default_storage, %identity, "leader: weir-operator running");
    let storage_policy =
        weir_operator::tenancy::StoragePolicy::new(&args.default_storage).allow(&args.allowed_storage_roots)?;
    let settings = Settings {
        storage_policy,
        control_url_annotation: args.out_of_cluster_control_urls,
        reconcile_timeout: Duration::from_secs(args.reconcile_timeout_secs.max(1)),
        default_storage: args.default_storage,
        control_address: args.control_address,
        max_concurrent_reconciles: args.max_concurrent_reconciles,
        status_refresh: Duration::from_secs(args.status_refresh_secs.max(1)),
        control_ingress: args.control_network_policy.then(|| ControlIngress {
            operator_namespace: args.lease_namespace.clone(),
            operator_pod_labels: [("app.kubernetes.io/name".to_string(), "weir-operator".to_string())].into(),
            extra_namespaces: args.control_ingress_namespaces.clone(),
        }),
        namespace: args.namespace.clone(),
    };
    tokio::select! {
        ended = run_with_metrics(client, settings, metrics) => ended?,
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
            if crd
                .status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
            {
                return Ok(());
            }
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "CRD {name} not established after {timeout:?}: apply crds/streamjob.yaml first"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Logs to stderr, filtered by `WEIR_LOG` (else `RUST_LOG`, else `info`) in tracing's filter
/// syntax (`debug`, `info,weir_operator::controller=debug`, `info,kube=debug`);
/// `WEIR_LOG_FORMAT=json` writes one JSON object per line for a cluster's log collector.
fn init_logging() -> anyhow::Result<()> {
    let spec = std::env::var("WEIR_LOG").or_else(|_| std::env::var("RUST_LOG")).unwrap_or_else(|_| "info".into());
    let filter = tracing_subscriber::EnvFilter::try_new(&spec).with_context(|| format!("WEIR_LOG `{spec}`"))?;
    let logs = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false);
    match std::env::var("WEIR_LOG_FORMAT").as_deref() {
        Ok("json") => logs.json().init(),
        Ok("text") | Err(_) => logs.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).init(),
        Ok(other) => anyhow::bail!("WEIR_LOG_FORMAT `{other}`: use text or json"),
    }
    Ok(())
}
