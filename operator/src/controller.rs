//! The StreamJob controller: for each job, observe (pods, the runtime's savepoint progress,
//! checkpoint storage) → validate (the job graph) → plan (pure, [`crate::plan`]) → apply
//! (children by server-side apply, deletions, savepoint requests) → status (server-side apply
//! of the status subresource), with an event for every transition.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{self, Action as Requeue, Controller};
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Resource, ResourceExt};
use weir_checkpoint::Storage;
use weir_crds::control::CheckpointOutcome;
use weir_crds::streamjob::{DesiredState, JobGraph, OperationStatus, StreamJob, StreamJobStatus};

use crate::children::{self, JOB_LABEL};
use crate::control_client;
use crate::observe;
use crate::plan::{self, Action, Desired, Observation, Operation, Phase, Plan, PlanState, SavepointProgress};

/// The field manager of everything the operator applies.
pub const FIELD_MANAGER: &str = "weir-operator";
/// Finalizer that lets a deleted StreamJob stop with a savepoint (or be killed) first.
pub const FINALIZER: &str = "weir.dev/stop-with-savepoint";
/// Annotation overriding a job's control API URL (for an operator running outside the cluster).
pub const CONTROL_URL_ANNOTATION: &str = "weir.dev/control-url";

/// How the operator reaches a job's control API.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ControlAddress {
    /// Through the job's Service by cluster DNS (`<job>-control.<ns>.svc`): in-cluster.
    Service,
    /// Straight to the pod IP: an operator outside the cluster on a host that routes to pods.
    PodIp,
}

/// Operator-wide settings.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Storage root used when a job names none (e.g. `s3://weir-state` or a local path).
    pub default_storage: String,
    /// How to reach the runtimes' control APIs.
    pub control_address: ControlAddress,
    /// At most this many StreamJobs reconciled at once.
    pub max_concurrent_reconciles: u16,
    /// How often a running job's status (newest checkpoint, job id) is refreshed from its
    /// control API.
    pub status_refresh: Duration,
    /// When set, each job gets a NetworkPolicy admitting only these peers to its control API.
    pub control_ingress: Option<children::ControlIngress>,
    /// Watch StreamJobs (and their pods) in this namespace only; `None`: all namespaces.
    pub namespace: Option<String>,
}

impl Settings {
    /// Defaults: control API through Services, 16 concurrent reconciles, status refreshed
    /// every 30 s, no NetworkPolicy, all namespaces.
    pub fn new(default_storage: impl Into<String>) -> Settings {
        Settings {
            default_storage: default_storage.into(),
            control_address: ControlAddress::Service,
            max_concurrent_reconciles: 16,
            status_refresh: Duration::from_secs(30),
            control_ingress: None,
            namespace: None,
        }
    }
}

/// What every reconcile shares.
pub struct Context {
    /// API client.
    pub client: kube::Client,
    /// Settings.
    pub settings: Settings,
    /// Event recorder.
    pub recorder: Recorder,
    /// Metrics.
    pub metrics: Arc<crate::metrics::OperatorMetrics>,
    /// The runtime pods of every job, kept current by a watch (spec and managed fields dropped).
    pub pods: Store<Pod>,
    /// Control API tokens by `namespace/name`, read once from each job's Secret.
    pub tokens: std::sync::Mutex<BTreeMap<String, String>>,
    /// Runtime notices already reported as events, by `namespace/name`: the run (job id) and
    /// how many of its notices. (Kept in memory: a restarted operator reports a running job's
    /// notices once more.)
    pub notices_reported: std::sync::Mutex<BTreeMap<String, (String, usize)>>,
}

/// Why a reconcile failed; the category names Event reasons and metric labels.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// The object lacks metadata the API server always sets.
    #[error("StreamJob has no {0}")]
    Metadata(&'static str),
    /// Reading the job graph from its ConfigMap failed.
    #[error("reading job graph from ConfigMap {name}: {reason}")]
    JobConfigMap {
        /// ConfigMap name.
        name: String,
        /// Why.
        reason: String,
    },
    /// Building children failed.
    #[error(transparent)]
    Build(#[from] children::BuildError),
    /// An API call failed.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// The Secret named by `checkpointing.credentialsSecret` could not be read.
    #[error("reading credentials Secret {name}: {reason}")]
    CredentialsSecret {
        /// Secret name.
        name: String,
        /// Why.
        reason: String,
    },
    /// Checkpoint storage could not be read.
    #[error("checkpoint storage: {0}")]
    Storage(#[from] weir_checkpoint::StorageError),
}

impl ReconcileError {
    /// Short category for events and metrics.
    pub fn category(&self) -> &'static str {
        match self {
            ReconcileError::Metadata(_) => "metadata",
            ReconcileError::JobConfigMap { .. } => "job-configmap",
            ReconcileError::Build(_) => "build",
            ReconcileError::Kube(_) => "kube-api",
            ReconcileError::CredentialsSecret { .. } => "credentials-secret",
            ReconcileError::Storage(_) => "storage",
        }
    }
}

fn ms_to_time(ms: u64) -> Option<Time> {
    Timestamp::from_millisecond(ms as i64).ok().map(Time)
}

fn time_to_ms(t: &Option<Time>) -> Option<u64> {
    t.as_ref().map(|t| t.0.as_millisecond().max(0) as u64)
}

fn now_ms() -> u64 {
    Timestamp::now().as_millisecond() as u64
}

/// Status → the planner's view.
pub fn plan_state(status: &StreamJobStatus) -> PlanState {
    PlanState {
        phase: status.phase,
        operation: status.operation.as_ref().map(|o| Operation {
            kind: o.kind,
            started_at_ms: o.started_at.0.as_millisecond().max(0) as u64,
            generation: o.generation,
        }),
        pending_upgrade: status.pending_upgrade.clone(),
        recovery_point: status.recovery_point.clone(),
        relaunch_count: status.relaunch_count,
        last_relaunch_ms: time_to_ms(&status.last_relaunch_time),
        observed_restart_nonce: status.observed_restart_nonce,
        observed_savepoint_nonce: status.observed_savepoint_nonce,
        latest_savepoint: status.latest_savepoint.clone(),
        savepoint_history: status
            .savepoint_history
            .iter()
            .map(|s| (s.clone(), time_to_ms(&s.completed_at).unwrap_or(0)))
            .collect(),
        last_savepoint_ms: time_to_ms(&status.last_savepoint_time),
    }
}

/// The checkpoint id in a savepoint path (`.../sp-<time>-<id>`).
fn savepoint_id(path: &str) -> u64 {
    path.trim_end_matches('/').rsplit('-').next().and_then(|n| n.parse().ok()).unwrap_or(0)
}

fn token_of(secret: &Secret) -> Option<String> {
    secret.data.as_ref()?.get("token").map(|b| String::from_utf8_lossy(&b.0).to_string())
}

fn random_token() -> String {
    let mut buf = [0u8; 24];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        let _ = f.read_exact(&mut buf);
    }
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

/// Reconciles one StreamJob, counting it in the metrics.
pub async fn reconcile(sj: Arc<StreamJob>, ctx: Arc<Context>) -> Result<Requeue, ReconcileError> {
    let started = std::time::Instant::now();
    let result = reconcile_inner(sj, ctx.clone()).await;
    ctx.metrics.observe_reconcile(started.elapsed().as_micros() as u64);
    if let Err(e) = &result {
        ctx.metrics.error(e.category());
    }
    result
}

async fn reconcile_inner(sj: Arc<StreamJob>, ctx: Arc<Context>) -> Result<Requeue, ReconcileError> {
    let name = sj.metadata.name.clone().ok_or(ReconcileError::Metadata("name"))?;
    let ns = sj.metadata.namespace.clone().ok_or(ReconcileError::Metadata("namespace"))?;
    let generation = sj.metadata.generation.unwrap_or(0);
    let client = ctx.client.clone();
    let status = sj.status.clone().unwrap_or_default();
    let jobs_api: Api<StreamJob> = Api::namespaced(client.clone(), &ns);
    let deleting = sj.metadata.deletion_timestamp.is_some();
    let finalizers = sj.finalizers().to_vec();
    if !deleting && !finalizers.iter().any(|f| f == FINALIZER) {
        let mut with = finalizers.clone();
        with.push(FINALIZER.to_string());
        jobs_api
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({ "metadata": { "finalizers": with } })),
            )
            .await?;
    }
    if deleting && !finalizers.iter().any(|f| f == FINALIZER) {
        return Ok(Requeue::await_change());
    }
    // A deleted job is cancelled first (savepoint, or kill when that fails).
    let mut effective = sj.spec.clone();
    if deleting {
        effective.state = DesiredState::Cancelled;
    }
    let storage_url = sj.spec.checkpointing.storage.clone().unwrap_or_else(|| ctx.settings.default_storage.clone());
    let root = children::storage_root(&storage_url, &ns, &name);

    // Observe: pods from the watch cache; an empty cache is confirmed by one live list so a
    // pod created a moment ago is not created twice.
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let mut listed: Vec<Pod> = ctx
        .pods
        .state_filter(|p| {
            p.metadata.namespace.as_deref() == Some(ns.as_str()) && p.labels().get(JOB_LABEL) == Some(&name)
        })
        .iter()
        .map(|p| Pod::clone(p))
        .collect();
    if listed.is_empty() {
        listed = pods.list(&ListParams::default().labels(&format!("{JOB_LABEL}={name}"))).await?.items;
    }
    let (pods_phase, pods_hash) = observe::pods_phase(&listed);
    let key = format!("{ns}/{name}");
    let control_url = control_url(&sj, &ns, &name, &listed, ctx.settings.control_address);
    let stopped_with = observe::stopped_with_savepoint(&listed);
    let needs_token = status.operation.is_some() || matches!(pods_phase, plan::PodsPhase::Running);
    let mut token = if needs_token { Some(token(&ctx, &sj, &ns, &name, &key).await?) } else { None };
    let savepoint = match status.operation.as_ref().and_then(|o| o.request_id) {
        None => None,
        // The runtime already exited after the stop: its termination message names the savepoint.
        Some(_) if stopped_with.is_some() => {
            let path = stopped_with.unwrap_or_default();
            Some(SavepointProgress::Completed(weir_crds::streamjob::SnapshotRef {
                id: savepoint_id(&path),
                path,
                completed_at: ms_to_time(now_ms()),
            }))
        }
        Some(id) => {
            Some(match control_client::savepoint_status(&control_url, token.as_deref().unwrap_or_default(), id).await {
                Ok(s) => match s.outcome {
                    CheckpointOutcome::InProgress => SavepointProgress::InProgress,
                    CheckpointOutcome::Completed => {
                        let path = s.path.unwrap_or_default();
                        SavepointProgress::Completed(weir_crds::streamjob::SnapshotRef {
                            id: savepoint_id(&path),
                            path,
                            completed_at: ms_to_time(now_ms()),
                        })
                    }
                    CheckpointOutcome::Failed => SavepointProgress::Failed(s.failure.unwrap_or_default()),
                },
                // A runtime that stopped answering has not produced the savepoint.
                Err(e) if matches!(pods_phase, plan::PodsPhase::Running) => {
                    tracing::debug!(job = %name, error = %e, "savepoint status not readable yet");
                    SavepointProgress::InProgress
                }
                Err(e) => SavepointProgress::Failed(e.to_string()),
            })
        }
    };
    // The runtime's own view of a running job: its id and newest checkpoint, for status.
    let mut job_id = status.job_id.clone();
    let mut latest_checkpoint = status.latest_checkpoint.clone();
    let mut notices = Vec::new();
    if matches!(pods_phase, plan::PodsPhase::Running) && status.operation.is_none() {
        match control_client::job_status(&control_url, token.as_deref().unwrap_or_default()).await {
            Ok(job) => {
                // What the run did that a person should know, each notice once (a run adds
                // them while it recovers, possibly after its first status was read).
                {
                    let mut reported = ctx.notices_reported.lock().unwrap_or_else(|e| e.into_inner());
                    let entry = reported.entry(key.clone()).or_default();
                    if entry.0 != job.job_id {
                        *entry = (job.job_id.clone(), 0);
                    }
                    notices = job.notices.get(entry.1..).unwrap_or_default().to_vec();
                    entry.1 = entry.1.max(job.notices.len());
                }
                job_id = Some(job.job_id);
                if let Some(c) = job.latest_checkpoint {
                    let completed = c.triggered_at_ms + c.duration_ms.unwrap_or(0);
                    latest_checkpoint = Some(weir_crds::streamjob::SnapshotRef {
                        id: c.id,
                        path: c.path,
                        completed_at: ms_to_time(completed),
                    });
                }
            }
            Err(e) => tracing::debug!(job = %name, error = %e, "job status not readable"),
        }
    }
    let mut obs = Observation {
        now_ms: now_ms(),
        pods: pods_phase,
        pods_spec_hash: pods_hash,
        savepoint,
        checkpoints: Vec::new(),
    };

    // Validate: a job graph the runtime would refuse is reported, not deployed.
    let graph = job_graph(&client, &sj, &ns).await?;
    let job_yaml = children::job_file(&sj, &graph, &root)?;
    let invalid = match weir_crds::JobSpec::from_yaml(&job_yaml) {
        Ok(spec) => weir_crds::validate(&spec).err().map(|e| e.to_string()),
        Err(e) => Some(e.to_string()),
    };

    // Plan.
    let hash = children::spec_hash(&sj);
    let desired = Desired { spec: &effective, generation, spec_hash: &hash };
    let current = plan_state(&status);
    // Storage is read only when the decision can depend on its checkpoints.
    let storage = StorageAccess { client: &client, sj: &sj, ns: &ns, root: &root };
    if plan::needs_checkpoints(&desired, &current, &obs) {
        obs.checkpoints = storage.checkpoints().await?;
    }
    let mut p = if let (Some(reason), true) = (&invalid, effective.state == DesiredState::Running) {
        Plan {
            state: current.clone(),
            degraded: Some(format!("the job graph is invalid: {reason}")),
            ..Plan::default()
        }
    } else {
        plan::plan(&desired, &current, &obs)
    };

    for notice in notices {
        p.events.push(plan::PlannedEvent { warning: true, reason: "OutputSuperseded", message: notice });
    }

    // Apply.
    let mut request_id = status.operation.as_ref().and_then(|o| o.request_id);
    for action in p.actions.clone() {
        match action {
            Action::Deploy { restore_from, mode } => {
                // The pod reads its token from this Secret: make sure it exists.
                token = Some(ensure_token(&client, &sj, &ns, &name).await?);
                ctx.tokens
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(key.clone(), token.clone().unwrap_or_default());
                let pp = PatchParams::apply(FIELD_MANAGER).force();
                let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
                cms.patch(
                    &children::config_map_name(&name),
                    &pp,
                    &Patch::Apply(children::config_map(&sj, job_yaml.clone())?),
                )
                .await?;
                let svcs: Api<Service> = Api::namespaced(client.clone(), &ns);
                svcs.patch(&children::service_name(&name), &pp, &Patch::Apply(children::service(&sj)?)).await?;
                if let Some(ingress) = &ctx.settings.control_ingress {
                    let nps: Api<NetworkPolicy> = Api::namespaced(client.clone(), &ns);
                    nps.patch(
                        &children::network_policy_name(&name),
                        &pp,
                        &Patch::Apply(children::network_policy(&sj, ingress)?),
                    )
                    .await?;
                }
                let pod = children::pod(&sj, &hash, &root, restore_from.as_ref(), mode)?;
                pods.patch(&children::pod_name(&name), &pp, &Patch::Apply(pod)).await?;
            }
            Action::DeletePods { grace_seconds } => delete_pods(&pods, &listed, grace_seconds).await?,
            Action::DeleteSavepoint { path } => {
                // Savepoints live under the job's storage root; anything else is left alone.
                let storage = storage.open().await?;
                match path.strip_prefix(storage.url()).map(|rel| rel.trim_start_matches('/').to_string()) {
                    Some(rel) if rel.starts_with(weir_checkpoint::layout::SAVEPOINTS) => {
                        storage.delete_dir(&rel).await?
                    }
                    _ => tracing::warn!(job = %name, %path, "not deleting a savepoint outside the job's storage root"),
                }
            }
            Action::RequestSavepoint { stop } => {
                match control_client::request_savepoint(&control_url, token.as_deref().unwrap_or_default(), stop).await
                {
                    Ok(s) => request_id = Some(s.request_id),
                    Err(e) => {
                        // The savepoint cannot even start: plan again with that failure (e.g. kill).
                        let mut failed =
                            Observation { savepoint: Some(SavepointProgress::Failed(e.to_string())), ..obs.clone() };
                        if failed.checkpoints.is_empty() && plan::needs_checkpoints(&desired, &p.state, &failed) {
                            failed.checkpoints = storage.checkpoints().await?;
                        }
                        let mut retry = plan::plan(&desired, &p.state, &failed);
                        retry.events.splice(0..0, p.events.drain(..));
                        for a in &retry.actions {
                            if let Action::DeletePods { grace_seconds } = a {
                                delete_pods(&pods, &listed, *grace_seconds).await?;
                            }
                        }
                        request_id = None;
                        p = retry;
                        break;
                    }
                }
            }
        }
    }

    // Status.
    for e in &p.events {
        match e.reason {
            "SavepointCompleted" => ctx.metrics.savepoint("completed"),
            "SavepointFailedPodsKilled" => {
                ctx.metrics.savepoint("failed");
                ctx.metrics.kills.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            "SavepointFailed" | "UpgradeSavepointFailed" => ctx.metrics.savepoint("failed"),
            "Relaunching" => {
                ctx.metrics.relaunches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            _ => {}
        }
        let ev = KubeEvent {
            type_: if e.warning { EventType::Warning } else { EventType::Normal },
            reason: e.reason.to_string(),
            note: Some(e.message.chars().take(1000).collect()),
            action: "Reconcile".into(),
            secondary: None,
        };
        if let Err(err) = ctx.recorder.publish(&ev, &sj.object_ref(&())).await {
            tracing::warn!(job = %name, error = %err, "could not record event");
        }
    }
    let mut new_status = status_from(&status, &p, generation, request_id, invalid.is_some());
    new_status.job_id = job_id;
    new_status.latest_checkpoint = latest_checkpoint;
    ctx.metrics
        .phase(format!("{ns}/{name}"), if deleting { None } else { new_status.phase.map(|p| p.as_str().to_string()) });
    if write_status(&jobs_api, &sj, &status, &new_status).await? == StatusWrite::Conflict {
        tracing::debug!(job = %name, "status changed since this reconcile read it; planning again");
        return Ok(Requeue::requeue(Duration::from_millis(200)));
    }
    if deleting && p.actions.is_empty() && p.state.phase == Some(Phase::Cancelled) {
        // Stopped (with a savepoint, or killed): let the deletion proceed.
        let rest: Vec<String> = finalizers.into_iter().filter(|f| f != FINALIZER).collect();
        jobs_api
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({ "metadata": { "finalizers": rest } })),
            )
            .await?;
        return Ok(Requeue::await_change());
    }
    Ok(match p.requeue_after_ms {
        Some(ms) => Requeue::requeue(Duration::from_millis(ms.max(200))),
        None if new_status.phase == Some(Phase::Running) => Requeue::requeue(ctx.settings.status_refresh),
        None => Requeue::requeue(Duration::from_secs(60)),
    })
}

/// The job's control API base URL: the annotation override, else by Service or pod IP.
fn control_url(sj: &StreamJob, ns: &str, name: &str, pods: &[Pod], how: ControlAddress) -> String {
    if let Some(url) = sj.annotations().get(CONTROL_URL_ANNOTATION) {
        return url.clone();
    }
    let pod_ip = pods.iter().find_map(|p| p.status.as_ref()?.pod_ip.clone());
    match (how, pod_ip) {
        (ControlAddress::PodIp, Some(ip)) if ip.contains(':') => format!("http://[{ip}]:{}", children::CONTROL_PORT),
        (ControlAddress::PodIp, Some(ip)) => format!("http://{ip}:{}", children::CONTROL_PORT),
        _ => format!("http://{}.{ns}.svc:{}", children::service_name(name), children::CONTROL_PORT),
    }
}

/// The job's control API token: cached, else read from (or created in) its Secret.
async fn token(ctx: &Context, sj: &StreamJob, ns: &str, name: &str, key: &str) -> Result<String, ReconcileError> {
    if let Some(t) = ctx.tokens.lock().unwrap_or_else(|e| e.into_inner()).get(key) {
        return Ok(t.clone());
    }
    let t = ensure_token(&ctx.client, sj, ns, name).await?;
    ctx.tokens.lock().unwrap_or_else(|e| e.into_inner()).insert(key.to_string(), t.clone());
    Ok(t)
}

/// Opens a job's checkpoint storage on demand, with the keys of its credentials Secret.
struct StorageAccess<'a> {
    client: &'a kube::Client,
    sj: &'a StreamJob,
    ns: &'a str,
    root: &'a str,
}

impl StorageAccess<'_> {
    async fn open(&self) -> Result<Storage, ReconcileError> {
        let mut env = Vec::new();
        if let Some(secret) = &self.sj.spec.checkpointing.credentials_secret {
            let secrets: Api<Secret> = Api::namespaced(self.client.clone(), self.ns);
            let found = secrets
                .get(&secret.name)
                .await
                .map_err(|e| ReconcileError::CredentialsSecret { name: secret.name.clone(), reason: e.to_string() })?;
            for (k, v) in found.data.unwrap_or_default() {
                env.push((k, String::from_utf8_lossy(&v.0).to_string()));
            }
        }
        Ok(Storage::open_with_env(self.root, &env)?)
    }

    async fn checkpoints(&self) -> Result<Vec<plan::FoundCheckpoint>, ReconcileError> {
        Ok(observe::checkpoints(&self.open().await?).await?)
    }
}

async fn ensure_token(client: &kube::Client, sj: &StreamJob, ns: &str, name: &str) -> Result<String, ReconcileError> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let secret_name = children::token_secret_name(name);
    if let Some(existing) = secrets.get_opt(&secret_name).await? {
        if let Some(t) = token_of(&existing) {
            return Ok(t);
        }
    }
    let token = random_token();
    let mut secret = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(secret_name.clone()),
            namespace: Some(ns.to_string()),
            labels: Some(children::labels(name)),
            owner_references: sj.controller_owner_ref(&()).map(|o| vec![o]),
            ..Default::default()
        },
        ..Secret::default()
    };
    secret.string_data = Some(BTreeMap::from([("token".to_string(), token.clone())]));
    match secrets.create(&PostParams::default(), &secret).await {
        Ok(_) => Ok(token),
        Err(kube::Error::Api(e)) if e.code == 409 => {
            let s = secrets.get(&secret_name).await?;
            Ok(token_of(&s).unwrap_or(token))
        }
        Err(e) => Err(e.into()),
    }
}

async fn job_graph(client: &kube::Client, sj: &StreamJob, ns: &str) -> Result<JobGraph, ReconcileError> {
    if let Some(inline) = &sj.spec.job.inline {
        return Ok(inline.clone());
    }
    let r = sj.spec.job.config_map_ref.clone().unwrap_or_default();
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let cm = cms
        .get(&r.name)
        .await
        .map_err(|e| ReconcileError::JobConfigMap { name: r.name.clone(), reason: e.to_string() })?;
    let text = cm
        .data
        .and_then(|d| d.get(&r.key).cloned())
        .ok_or_else(|| ReconcileError::JobConfigMap { name: r.name.clone(), reason: format!("no key `{}`", r.key) })?;
    let spec = weir_crds::JobSpec::from_yaml(&text)
        .map_err(|e| ReconcileError::JobConfigMap { name: r.name.clone(), reason: e.to_string() })?;
    Ok(JobGraph { sources: spec.sources, operators: spec.operators, sinks: spec.sinks })
}

fn condition(
    type_: &str,
    on: bool,
    reason: &str,
    message: String,
    generation: i64,
    previous: &[Condition],
) -> Condition {
    let status = if on { "True" } else { "False" }.to_string();
    let since =
        previous.iter().find(|c| c.type_ == type_ && c.status == status).map(|c| c.last_transition_time.clone());
    Condition {
        type_: type_.to_string(),
        status,
        reason: reason.to_string(),
        message,
        observed_generation: Some(generation),
        last_transition_time: since.unwrap_or_else(|| Time(Timestamp::now())),
    }
}

/// How a status write went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatusWrite {
    /// Nothing changed: nothing written.
    Unchanged,
    /// Written.
    Written,
    /// The object changed since `sj` was read and the new status carries write-ahead fields:
    /// not written. Plan again from the fresh object.
    Conflict,
}

/// Writes `new` over `old` (the status of `sj` as read) by server-side apply. The write-ahead
/// fields (an upgrade's target and restore point, the recovery point, a savepoint in flight)
/// are written only over the object the plan was made from (its resourceVersion is a
/// precondition): an operator that lost its lease, or planned from a stale cache, gets a
/// conflict instead of overwriting a newer decision.
pub async fn write_status(
    api: &Api<StreamJob>,
    sj: &StreamJob,
    old: &StreamJobStatus,
    new: &StreamJobStatus,
) -> Result<StatusWrite, kube::Error> {
    if new == old {
        return Ok(StatusWrite::Unchanged);
    }
    let mut patch = serde_json::json!({ "apiVersion": "weir.dev/v1alpha1", "kind": "StreamJob", "status": new });
    let write_ahead = new.pending_upgrade != old.pending_upgrade
        || new.recovery_point != old.recovery_point
        || new.operation != old.operation;
    if let (true, Some(rv)) = (write_ahead, sj.metadata.resource_version.as_ref()) {
        patch["metadata"] = serde_json::json!({ "resourceVersion": rv });
    }
    match api.patch_status(&sj.name_any(), &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(patch)).await {
        Ok(_) => Ok(StatusWrite::Written),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(StatusWrite::Conflict),
        Err(e) => Err(e),
    }
}

/// Deletes the pods that were observed, each with its uid as a precondition: a pod of the
/// same name created since (a replacement) is never deleted by mistake. A pod already gone, or
/// replaced, is not an error.
async fn delete_pods(pods: &Api<Pod>, listed: &[Pod], grace_seconds: Option<i64>) -> Result<(), kube::Error> {
    for pod in listed {
        let dp = DeleteParams {
            grace_period_seconds: grace_seconds.map(|g| g.max(0) as u32),
            preconditions: pod
                .metadata
                .uid
                .clone()
                .map(|uid| kube::api::Preconditions { uid: Some(uid), resource_version: None }),
            ..DeleteParams::default()
        };
        match pods.delete(&pod.name_any(), &dp).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The status to write after a plan.
pub fn status_from(
    old: &StreamJobStatus,
    p: &Plan,
    generation: i64,
    request_id: Option<u64>,
    invalid: bool,
) -> StreamJobStatus {
    let s = &p.state;
    let phase = s.phase.unwrap_or(Phase::Deploying);
    let phase = if p.degraded.is_some() && !matches!(phase, Phase::Failed) { Phase::Degraded } else { phase };
    let ready = phase == Phase::Running;
    let progressing = matches!(
        phase,
        Phase::Deploying | Phase::Upgrading | Phase::Suspending | Phase::Cancelling | Phase::Relaunching
    );
    let degraded_msg = p.degraded.clone().unwrap_or_default();
    let conditions = vec![
        condition(
            "Ready",
            ready,
            phase.as_str(),
            format!("the job is {}", phase.as_str().to_lowercase()),
            generation,
            &old.conditions,
        ),
        condition(
            "Progressing",
            progressing,
            phase.as_str(),
            if progressing { format!("{} in progress", phase.as_str()) } else { "no transition in progress".into() },
            generation,
            &old.conditions,
        ),
        condition(
            "Degraded",
            p.degraded.is_some(),
            if invalid {
                "InvalidJob"
            } else if p.degraded.is_some() {
                "NeedsAttention"
            } else {
                "AsExpected"
            },
            if degraded_msg.is_empty() { "no problem".into() } else { degraded_msg.clone() },
            generation,
            &old.conditions,
        ),
    ];
    StreamJobStatus {
        observed_generation: Some(generation),
        phase: Some(phase),
        conditions,
        job_id: old.job_id.clone(),
        latest_checkpoint: old.latest_checkpoint.clone(),
        latest_savepoint: s.latest_savepoint.clone(),
        savepoint_history: s
            .savepoint_history
            .iter()
            .map(|(sp, at)| weir_crds::streamjob::SnapshotRef { completed_at: ms_to_time(*at), ..sp.clone() })
            .collect(),
        relaunch_count: s.relaunch_count,
        recovery_point: s.recovery_point.clone(),
        pending_upgrade: s.pending_upgrade.clone(),
        observed_restart_nonce: s.observed_restart_nonce,
        observed_savepoint_nonce: s.observed_savepoint_nonce,
        operation: s.operation.as_ref().and_then(|o| {
            Some(OperationStatus {
                kind: o.kind,
                request_id,
                started_at: ms_to_time(o.started_at_ms)?,
                generation: o.generation,
            })
        }),
        last_relaunch_time: s.last_relaunch_ms.and_then(ms_to_time),
        last_savepoint_time: s.last_savepoint_ms.and_then(ms_to_time),
        last_error: if degraded_msg.is_empty() { old.last_error.clone() } else { Some(degraded_msg) },
    }
}

fn error_policy(sj: Arc<StreamJob>, error: &ReconcileError, _ctx: Arc<Context>) -> Requeue {
    tracing::warn!(job = %sj.name_any(), category = error.category(), %error, "reconcile failed");
    // Transient API or storage trouble retries soon; a broken job graph ConfigMap waits longer.
    match error {
        ReconcileError::JobConfigMap { .. } | ReconcileError::Metadata(_) | ReconcileError::Build(_) => {
            Requeue::requeue(Duration::from_secs(60))
        }
        _ => Requeue::requeue(Duration::from_secs(5)),
    }
}

/// Runs the controller until the stream ends (shutdown).
pub async fn run(client: kube::Client, settings: Settings) {
    run_with_metrics(client, settings, crate::metrics::OperatorMetrics::shared()).await
}

/// Runs the controller, recording into `metrics`.
pub async fn run_with_metrics(client: kube::Client, settings: Settings, metrics: Arc<crate::metrics::OperatorMetrics>) {
    let (jobs, pods): (Api<StreamJob>, Api<Pod>) = match &settings.namespace {
        Some(ns) => (Api::namespaced(client.clone(), ns), Api::namespaced(client.clone(), ns)),
        None => (Api::all(client.clone()), Api::all(client.clone())),
    };
    let recorder = Recorder::new(
        client.clone(),
        Reporter { controller: FIELD_MANAGER.into(), instance: std::env::var("POD_NAME").ok() },
    );
    metrics.ready.store(true, std::sync::atomic::Ordering::Relaxed);
    // One watch of the runtime pods feeds both the cache that reconciles read and the
    // controller's triggers. Pod specs and managed fields are dropped: only metadata and status
    // are read, and 1,000 jobs' pods then fit in a few MiB.
    let (pod_store, writer) = reflector::store::<Pod>();
    let pod_events = watcher(pods, watcher::Config::default().labels(JOB_LABEL).any_semantic())
        .default_backoff()
        .modify(|pod| {
            pod.spec = None;
            pod.managed_fields_mut().clear();
            pod.annotations_mut().clear();
        })
        .reflect(writer)
        // Deletions too: a deleted pod is what an upgrade or relaunch waits for.
        .touched_objects();
    let concurrency = settings.max_concurrent_reconciles.max(1);
    let ctx = Arc::new(Context {
        client: client.clone(),
        settings,
        recorder,
        metrics: metrics.clone(),
        pods: pod_store,
        tokens: Default::default(),
        notices_reported: Default::default(),
    });
    // StreamJobs are cached without managed fields and kubectl's last-applied copy of the spec.
    let (job_store, job_writer) = reflector::store::<StreamJob>();
    let job_events = watcher(jobs, watcher::Config::default().any_semantic())
        .default_backoff()
        .modify(|sj| {
            sj.managed_fields_mut().clear();
            sj.annotations_mut().remove("kubectl.kubernetes.io/last-applied-configuration");
        })
        .reflect(job_writer)
        .applied_objects();
    Controller::for_stream(job_events, job_store)
        .owns_stream(pod_events)
        .with_config(controller::Config::default().concurrency(concurrency))
        .shutdown_on_signal()
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(e) = result {
                tracing::debug!(error = %e, "controller event");
            }
        })
        .await;
    metrics.ready.store(false, std::sync::atomic::Ordering::Relaxed);
}
