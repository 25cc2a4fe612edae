//! The StreamJob controller: for each job, observe (pods, the runtime's savepoint progress,
//! checkpoint storage) → validate (the job graph) → plan (pure, [`crate::plan`]) → apply
//! (children by server-side apply, deletions, savepoint requests) → status (server-side apply
//! of the status subresource), with an event for every transition.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{self, Action as Requeue, Controller};
use kube::runtime::finalizer;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Resource, ResourceExt};
use weir_checkpoint::Storage;
use weir_client::{ClientError, ControlClient};
use weir_crds::control::CheckpointOutcome;
use weir_crds::streamjob::{DesiredState, OperationStatus, StreamJob, StreamJobStatus};

use crate::children::{self, JOB_LABEL};
use crate::inputs;
use crate::observe;
use crate::plan::{
    self, Action, Desired, EventReason, Observation, Operation, Phase, Plan, PlanState, PlannedEvent, SavepointProgress,
};
use crate::runtime_pod::RuntimePod;
use crate::tenancy::{self, StorageIdentity, StoragePolicy};

/// The field manager of everything the operator applies.
pub const FIELD_MANAGER: &str = "weir-operator";
/// Finalizer that lets a deleted StreamJob stop with a savepoint (or be killed) first.
pub const FINALIZER: &str = "weir.dev/stop-with-savepoint";
/// Annotation overriding a job's control API URL, honoured only by an operator started with
/// [`Settings::control_url_annotation`] (one running outside the cluster, for tests): in a
/// cluster it would send the job's token to any host its author names.
pub const CONTROL_URL_ANNOTATION: &str = "weir.dev/control-url";
/// Annotation (`"true"`) letting a deleted job go without the stop its finalizer stands for
/// (storage gone, a runtime that never answers): its pods are killed and the finalizer removed,
/// with an event saying what was given up.
pub const FORCE_DELETE_ANNOTATION: &str = "weir.dev/force-delete";

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
    /// Which storage each namespace may use with the operator's own credentials.
    pub storage_policy: StoragePolicy,
    /// Honour [`CONTROL_URL_ANNOTATION`] (an operator outside the cluster only).
    pub control_url_annotation: bool,
    /// How long one reconcile may take before it is abandoned and retried with backoff, so a
    /// job whose runtime or storage does not answer holds a worker no longer than this.
    pub reconcile_timeout: Duration,
}

impl Settings {
    /// Defaults: control API through Services, 16 concurrent reconciles, status refreshed
    /// every 30 s, no NetworkPolicy, all namespaces, the default storage's `<root>/<namespace>`
    /// as each namespace's only storage, the control-url annotation ignored, 60 s per reconcile.
    pub fn new(default_storage: impl Into<String>) -> Settings {
        let default_storage = default_storage.into();
        Settings {
            storage_policy: StoragePolicy::new(&default_storage),
            default_storage,
            control_address: ControlAddress::Service,
            max_concurrent_reconciles: 16,
            status_refresh: Duration::from_secs(30),
            control_ingress: None,
            namespace: None,
            control_url_annotation: false,
            reconcile_timeout: Duration::from_secs(60),
        }
    }
}

/// What every reconcile shares.
pub struct Context {
    /// API client.
    pub client: kube::Client,
    /// Settings.
    pub settings: Settings,
    /// Publishes events about StreamJobs, repeats counted in series.
    pub events: crate::events::Publisher,
    /// Metrics.
    pub metrics: Arc<crate::metrics::OperatorMetrics>,
    /// Pooled connections to the runtimes' control APIs, shared by every job: over TLS, each
    /// runtime trusted by the certificate pinned for its host in [`Context::pins`].
    pub http: reqwest::Client,
    /// The certificate each runtime's control API must present, by host: pinned as each job is
    /// observed, from its token Secret.
    pub pins: weir_client::pin::Pins,
    /// The runtime pods of every job, kept current by a watch (spec and managed fields dropped).
    pub pods: Store<RuntimePod>,
    /// Control API tokens and certificates by `namespace/name`, read once from each job's Secret.
    pub tokens: std::sync::Mutex<BTreeMap<String, JobSecret>>,
    /// Runtime notices already reported as events, by `namespace/name`: the run (job id) and
    /// how many of its notices. (Kept in memory: a restarted operator reports a running job's
    /// notices once more.)
    pub notices_reported: std::sync::Mutex<BTreeMap<String, (String, usize)>>,
    /// Failed reconciles in a row, by `namespace/name`: the exponent of the job's retry backoff.
    pub failures: std::sync::Mutex<BTreeMap<String, u32>>,
}

/// Why a reconcile failed; the category names Event reasons and metric labels.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// The object lacks metadata the API server always sets.
    #[error("StreamJob has no {0}")]
    Metadata(&'static str),
    /// Building children failed.
    #[error(transparent)]
    Build(#[from] children::BuildError),
    /// An API call failed.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// Checkpoint storage could not be read.
    #[error("checkpoint storage: {0}")]
    Storage(#[from] weir_checkpoint::StorageError),
    /// Reading what the job refers to failed (not its absence, which is reported as Degraded).
    #[error(transparent)]
    Inputs(#[from] Box<inputs::InputsError>),
    /// The operating system gave no random bytes for a control token.
    #[error("generating a control token: {0}")]
    Token(#[source] getrandom::Error),
    /// The control API's certificate could not be issued, or the job's Secret holds one that
    /// does not parse.
    #[error("the control API certificate: {0}")]
    Certificate(String),
    /// Adding or removing the finalizer failed.
    #[error("updating the finalizer: {0}")]
    Finalizer(#[source] kube::Error),
    /// Not a failure: a deleted job is still stopping; the finalizer stays and the job is
    /// reconciled again after this long.
    #[error("still stopping")]
    StillStopping(Duration),
    /// An object of a child's name exists and is not this job's: it is not adopted or
    /// overwritten, and nothing is deployed until it is gone or renamed.
    #[error("{kind} `{name}` already exists and is not owned by this StreamJob: not adopting or overwriting it")]
    NameConflict {
        /// The kind of the object.
        kind: &'static str,
        /// Its name.
        name: String,
    },
    /// The job's storage may not be read (the Degraded condition says why).
    #[error("the job's checkpoint storage may not be read: {0}")]
    StorageRefused(String),
    /// The reconcile took longer than [`Settings::reconcile_timeout`].
    #[error("reconcile abandoned after {0:?} (a runtime or storage that does not answer?)")]
    Deadline(Duration),
    /// Listing the job's own storage (its endpoint) took longer than
    /// [`tenancy::TENANT_STORAGE_TIMEOUT`].
    #[error("checkpoint storage did not answer within {0:?}")]
    StorageTimeout(Duration),
}

impl ReconcileError {
    /// Short category for events and metrics.
    pub fn category(&self) -> &'static str {
        match self {
            ReconcileError::Metadata(_) => "metadata",
            ReconcileError::Build(_) => "build",
            ReconcileError::Kube(_) => "kube-api",
            ReconcileError::Storage(_) => "storage",
            ReconcileError::Inputs(_) => "inputs",
            ReconcileError::Finalizer(_) => "finalizer",
            ReconcileError::Token(_) | ReconcileError::Certificate(_) => "token",
            ReconcileError::StillStopping(_) => "stopping",
            ReconcileError::NameConflict { .. } => "name-conflict",
            ReconcileError::StorageRefused(_) => "storage-refused",
            ReconcileError::Deadline(_) => "deadline",
            ReconcileError::StorageTimeout(_) => "storage-timeout",
        }
    }

    /// The reason of the Degraded condition and Warning event that report it.
    pub fn event_reason(&self) -> EventReason {
        match self {
            ReconcileError::NameConflict { .. } => EventReason::NameConflict,
            _ => EventReason::ReconcileFailed,
        }
    }

    /// Whether only a change by a person helps (the retry then waits longer).
    fn needs_a_person(&self) -> bool {
        matches!(
            self,
            ReconcileError::Metadata(_)
                | ReconcileError::Build(_)
                | ReconcileError::NameConflict { .. }
                | ReconcileError::StorageRefused(_)
        )
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

/// Nothing in status says a run was ever deployed or decided.
fn never_deployed(status: &StreamJobStatus) -> bool {
    status.job_id.is_none()
        && status.latest_checkpoint.is_none()
        && status.latest_savepoint.is_none()
        && status.recovery_point.is_none()
        && status.operation.is_none()
        && status.pending_upgrade.is_none()
        && status.relaunch_count == 0
}

/// Status → the planner's view.
pub fn plan_state(status: &StreamJobStatus) -> PlanState {
    PlanState {
        // A job reported Degraded before anything was deployed (invalid from the start) has
        // not run: the planner sees it as new, so once fixed it deploys as a first deploy (from
        // `initialSavepoint` when set).
        phase: match status.phase {
            Some(Phase::Degraded) if never_deployed(status) => None,
            phase => phase,
        },
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

/// The token in a job's token Secret; an empty or blank one is no token (the runtime refuses
/// to serve with it).
fn token_of(secret: &Secret) -> Option<String> {
    let token =
        secret.data.as_ref()?.get(children::TOKEN_KEY).map(|b| String::from_utf8_lossy(&b.0).trim().to_string())?;
    (!token.is_empty()).then_some(token)
}

/// The token and certificate in a job's token Secret, when both are there and usable.
fn job_secret_of(secret: &Secret) -> Option<JobSecret> {
    let data = secret.data.as_ref()?;
    let cert = data.get(children::TLS_CERT_KEY)?;
    data.get(children::TLS_KEY_KEY).filter(|k| !k.0.is_empty())?;
    let fingerprint = weir_client::pin::pem_fingerprint(&cert.0).ok()?;
    Some(JobSecret { token: token_of(secret)?, fingerprint })
}

/// A new token, and a new certificate for the job's control API with its private key (PEM):
/// self-signed (ECDSA P-256), issued for the job's Service names, and trusted by the operator
/// by its fingerprint alone.
fn new_job_secret(name: &str, ns: &str) -> Result<(JobSecret, BTreeMap<String, String>), ReconcileError> {
    let token = random_token()?;
    let issued = rcgen::generate_simple_self_signed(children::control_names(name, ns))
        .map_err(|e| ReconcileError::Certificate(e.to_string()))?;
    let fingerprint = weir_client::pin::fingerprint(issued.cert.der());
    let data = BTreeMap::from([
        (children::TOKEN_KEY.to_string(), token.clone()),
        (children::TLS_CERT_KEY.to_string(), issued.cert.pem()),
        (children::TLS_KEY_KEY.to_string(), issued.signing_key.serialize_pem()),
    ]);
    Ok((JobSecret { token, fingerprint }, data))
}

/// 192 random bits from the operating system, as hex. Without a random source there is no safe
/// token: the reconcile fails (it used to write a token of zeros).
fn random_token() -> Result<String, ReconcileError> {
    let mut buf = [0u8; 24];
    getrandom::fill(&mut buf).map_err(ReconcileError::Token)?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// Reconciles one StreamJob, counting it in the metrics; a failure is reported on the
/// StreamJob itself (a condition and a Warning event), not only in the operator's log. The
/// finalizer is kube's helper: added before anything is created, removed once a deleted job
/// has stopped (with a savepoint, or killed), which can take several reconciles.
pub async fn reconcile(sj: Arc<StreamJob>, ctx: Arc<Context>) -> Result<Requeue, ReconcileError> {
    let started = std::time::Instant::now();
    let ns = sj.metadata.namespace.clone().ok_or(ReconcileError::Metadata("namespace"))?;
    let api: Api<StreamJob> = Api::namespaced(ctx.client.clone(), &ns);
    let result = finalizer::finalizer(&api, FINALIZER, sj.clone(), |event| async {
        match event {
            finalizer::Event::Apply(sj) => reconcile_within(&sj, &ctx).await.map(|o| Requeue::requeue(o.after)),
            finalizer::Event::Cleanup(sj) if force_delete(&sj) => {
                force_stop(&sj, &ctx).await?;
                Ok(Requeue::await_change())
            }
            finalizer::Event::Cleanup(sj) => {
                let outcome = reconcile_within(&sj, &ctx).await?;
                match outcome.stopped {
                    true => Ok(Requeue::await_change()),
                    // Not stopped yet: the helper keeps the finalizer while cleanup "fails".
                    false => Err(ReconcileError::StillStopping(outcome.after)),
                }
            }
        }
    })
    .await;
    let result = match result {
        Ok(requeue) => Ok(requeue),
        Err(finalizer::Error::CleanupFailed(ReconcileError::StillStopping(after))) => Ok(Requeue::requeue(after)),
        Err(finalizer::Error::ApplyFailed(e) | finalizer::Error::CleanupFailed(e)) => Err(e),
        // A reconcile that ran on a cached object from before the finalizer list changed (or
        // the object went): nothing was changed; plan again from the fresh object. (A CI run
        // counted it as a failed reconcile.)
        Err(finalizer::Error::AddFinalizer(e) | finalizer::Error::RemoveFinalizer(e)) if stale_finalizer_patch(&e) => {
            tracing::debug!(error = %e, "finalizer list changed since this reconcile read it; planning again");
            Ok(Requeue::requeue(Duration::from_millis(200)))
        }
        Err(finalizer::Error::AddFinalizer(e) | finalizer::Error::RemoveFinalizer(e)) => {
            Err(ReconcileError::Finalizer(e))
        }
        Err(finalizer::Error::UnnamedObject) => Err(ReconcileError::Metadata("name")),
        Err(finalizer::Error::InvalidFinalizer) => Err(ReconcileError::Metadata("finalizers")),
    };
    ctx.metrics.observe_reconcile(started.elapsed());
    let key = format!("{ns}/{}", sj.name_any());
    match &result {
        Err(e) => {
            ctx.metrics.error(e.category());
            report_failure(&sj, &ctx, e).await;
        }
        Ok(_) => {
            ctx.failures.lock().unwrap_or_else(|e| e.into_inner()).remove(&key);
        }
    }
    result
}

/// The reconcile steps within [`Settings::reconcile_timeout`].
async fn reconcile_within(sj: &StreamJob, ctx: &Context) -> Result<Outcome, ReconcileError> {
    let limit = ctx.settings.reconcile_timeout;
    tokio::time::timeout(limit, reconcile_steps(sj, ctx)).await.unwrap_or(Err(ReconcileError::Deadline(limit)))
}

/// Whether a deleted job carries `weir.dev/force-delete: "true"`.
fn force_delete(sj: &StreamJob) -> bool {
    sj.metadata.deletion_timestamp.is_some()
        && sj.annotations().get(FORCE_DELETE_ANNOTATION).map(String::as_str) == Some("true")
}

/// The escape for a deleted job that cannot stop (storage gone, a runtime that never answers):
/// its pods are killed at once (the epoch fences whatever still runs), no savepoint is taken
/// and no storage is read, and a Warning event says so; then the finalizer may go.
async fn force_stop(sj: &StreamJob, ctx: &Context) -> Result<(), ReconcileError> {
    let job = JobRef::of(sj, ctx)?;
    let pods: Vec<RuntimePod> = job
        .pods(ctx)
        .list(&ListParams::default().labels(&format!("{JOB_LABEL}={}", job.name)))
        .await?
        .items
        .into_iter()
        .filter(|p| owned_by(&p.metadata, sj))
        .collect();
    delete_pods(&job.pods(ctx), &pods, Some(0)).await?;
    let message = format!(
        "deleted with {FORCE_DELETE_ANNOTATION}: {} pod(s) killed without a savepoint; the newest retained \
         checkpoint in {} is the recovery point, nothing was read from or deleted in storage",
        pods.len(),
        job.root
    );
    ctx.metrics.event(EventReason::ForceDeleted);
    publish(ctx, sj, &job.name, true, EventReason::ForceDeleted, &message).await;
    Ok(())
}

/// Whether `meta` has `sj` as its controller (the operator's children all do).
fn owned_by(meta: &kube::api::ObjectMeta, sj: &StreamJob) -> bool {
    let uid = sj.metadata.uid.as_deref();
    uid.is_some()
        && meta.owner_references.iter().flatten().any(|o| o.controller == Some(true) && Some(o.uid.as_str()) == uid)
}

/// Whether a failed finalizer patch only means the object changed since it was read. kube's
/// helper tests the list it read in its JSON patch: the API server answers 422 (reason
/// `Invalid`; the patch is otherwise fixed) when the list changed, 409 on a conflict, and 404
/// once the object is gone (checked on a real API server).
pub fn stale_finalizer_patch(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404 || s.code == 409 || (s.code == 422 && s.reason == "Invalid"))
}

/// How a reconcile ended: when to look again, and whether a deleted job has stopped.
struct Outcome {
    /// Reconcile again after this long.
    after: Duration,
    /// The job is cancelled and nothing is left to do: a deletion may proceed.
    stopped: bool,
}

/// The steps of a reconcile, in order, each a function of its own: observe → validate →
/// plan → apply → publish events → write status.
async fn reconcile_steps(sj: &StreamJob, ctx: &Context) -> Result<Outcome, ReconcileError> {
    let job = JobRef::of(sj, ctx)?;
    let mut seen = observe(sj, ctx, &job).await?;
    let first_deploy = job.current.phase.is_none();
    let inputs = inputs::validate(&ctx.client, sj, &job.ns, &job.root, &ctx.settings.storage_policy, first_deploy)
        .await
        .map_err(Box::new)?;
    let mut p = plan_step(&job, &mut seen, &inputs).await?;
    // Write-ahead: a plan that creates pods records its decision (the relaunch count, the
    // phase, the restore point) before the pods exist. A conflict (the plan was made from a
    // stale object) creates nothing; an operator that dies after the pods exist loses nothing.
    let written_ahead = match p.actions.iter().any(|a| matches!(a, Action::Deploy { .. })) {
        false => None,
        true => {
            let request_id = job.status.operation.as_ref().and_then(|o| o.request_id);
            let mut ahead = status_of(&job, &seen, &p, request_id, inputs.verdict.as_ref().err());
            // A failure reported by an earlier reconcile stays until this one has applied
            // the plan: written away here, a deploy failing again would make the condition
            // flap with every attempt.
            keep_reported_failure(&job.status, &mut ahead);
            if write_status(&job.api, sj, &job.status, &ahead).await? == StatusWrite::Conflict {
                tracing::debug!(job = %job.name, "status changed since this reconcile read it; planning again");
                return Ok(Outcome { after: Duration::from_millis(200), stopped: false });
            }
            Some(ahead)
        }
    };
    let request_id = apply(sj, ctx, &job, &seen, &inputs, &mut p).await?;
    publish_events(sj, ctx, &job, &p).await;
    let new_status = status_of(&job, &seen, &p, request_id, inputs.verdict.as_ref().err());
    let phase = if job.deleting { None } else { new_status.phase.map(|p| p.as_str().to_string()) };
    ctx.metrics.phase(job.key.clone(), phase);
    // After a write-ahead, a status that differs still is written over the object as read: that
    // conflicts, and the next reconcile (from the fresh object) writes it.
    if written_ahead.as_ref() != Some(&new_status)
        && write_status(&job.api, sj, &job.status, &new_status).await? == StatusWrite::Conflict
    {
        tracing::debug!(job = %job.name, "status changed since this reconcile read it; planning again");
        return Ok(Outcome { after: Duration::from_millis(200), stopped: false });
    }
    Ok(Outcome {
        after: match p.requeue_after_ms {
            Some(ms) => Duration::from_millis(ms.max(200)),
            None if new_status.phase == Some(Phase::Running) => ctx.settings.status_refresh,
            // An invalid job waits for a change to it; referenced objects are looked at again
            // now and then (a created ConfigMap or Secret does not trigger a reconcile).
            None if inputs.verdict.is_err() => Duration::from_secs(15),
            None => Duration::from_secs(60),
        },
        stopped: job.deleting && p.actions.is_empty() && p.state.phase == Some(Phase::Cancelled),
    })
}

/// What one reconcile is about: the job's names, where its state lives, what it was told
/// (spec, as cancelled while being deleted) and its status as read.
struct JobRef {
    name: String,
    ns: String,
    /// `namespace/name`.
    key: String,
    generation: i64,
    /// The job is being deleted: it is cancelled first (savepoint, or kill when that fails).
    deleting: bool,
    /// The spec to reach (`state: cancelled` while being deleted).
    effective: weir_crds::StreamJobSpec,
    /// `<storage>/<namespace>/<name>`.
    root: String,
    status: StreamJobStatus,
    spec_hash: String,
    /// The planner's view of the status.
    current: PlanState,
    api: Api<StreamJob>,
}

impl JobRef {
    fn of(sj: &StreamJob, ctx: &Context) -> Result<JobRef, ReconcileError> {
        let name = sj.metadata.name.clone().ok_or(ReconcileError::Metadata("name"))?;
        let ns = sj.metadata.namespace.clone().ok_or(ReconcileError::Metadata("namespace"))?;
        let deleting = sj.metadata.deletion_timestamp.is_some();
        let mut effective = sj.spec.clone();
        if deleting {
            effective.state = DesiredState::Cancelled;
        }
        let storage_url = sj.spec.checkpointing.storage.clone().unwrap_or_else(|| ctx.settings.default_storage.clone());
        let status = sj.status.clone().unwrap_or_default();
        Ok(JobRef {
            key: format!("{ns}/{name}"),
            root: children::storage_root(&storage_url, &ns, &name),
            generation: sj.metadata.generation.unwrap_or(0),
            deleting,
            effective,
            spec_hash: children::spec_hash(sj),
            current: plan_state(&status),
            status,
            api: Api::namespaced(ctx.client.clone(), &ns),
            name,
            ns,
        })
    }

    fn pods(&self, ctx: &Context) -> Api<RuntimePod> {
        Api::namespaced(ctx.client.clone(), &self.ns)
    }
}

/// What a reconcile saw: the job's pods, the runtime's answers, and the planner's observation.
struct Seen {
    /// The job's pods (watch cache, confirmed by a live list when empty).
    pods: Vec<RuntimePod>,
    control_url: String,
    /// The control API token, when the runtime may be running.
    token: Option<String>,
    obs: Observation,
    /// The run's id and newest checkpoint, from the runtime (else as in status).
    job_id: Option<String>,
    latest_checkpoint: Option<weir_crds::streamjob::SnapshotRef>,
    /// What the run reported that a person should know, not yet reported as events.
    notices: Vec<String>,
}

/// Observe: pods from the watch cache (an empty cache is confirmed by one live list so a pod
/// created a moment ago is not created twice), the progress of a requested savepoint, and the
/// running job's own status.
async fn observe(sj: &StreamJob, ctx: &Context, job: &JobRef) -> Result<Seen, ReconcileError> {
    // Only the job's own pods: a pod of another owner carrying the job's label (made by hand,
    // or another job's) is neither watched over nor deleted.
    let mut listed: Vec<RuntimePod> = ctx
        .pods
        .state_filter(|p| {
            p.metadata.namespace.as_deref() == Some(job.ns.as_str())
                && p.labels().get(JOB_LABEL) == Some(&job.name)
                && owned_by(&p.metadata, sj)
        })
        .iter()
        .map(|p| RuntimePod::clone(p))
        .collect();
    if listed.is_empty() {
        let all = job.pods(ctx).list(&ListParams::default().labels(&format!("{JOB_LABEL}={}", job.name))).await?;
        listed = all.items.into_iter().filter(|p| owned_by(&p.metadata, sj)).collect();
    }
    let (pods_phase, pods_hash) = observe::pods_phase(&listed);
    let control_url = control_url(sj, &job.ns, &job.name, &listed, &ctx.settings);
    let running = matches!(pods_phase, plan::PodsPhase::Running);
    let operation = job.status.operation.as_ref();
    let token = match operation.is_some() || running {
        true => {
            let secret = token(ctx, sj, &job.ns, &job.name, &job.key).await?;
            // Whatever answers at the job's address must hold the job's certificate.
            ctx.pins.pin_url(&control_url, secret.fingerprint);
            Some(secret.token)
        }
        false => None,
    };
    let savepoint = match operation.and_then(|o| o.request_id) {
        None => None,
        Some(id) => {
            let progress = savepoint_progress(ctx, &listed, &control_url, token.as_deref(), id, running).await;
            Some(within_job_root(progress, &job.root))
        }
    };
    let mut seen = Seen {
        job_id: job.status.job_id.clone(),
        latest_checkpoint: job.status.latest_checkpoint.clone(),
        notices: Vec::new(),
        obs: Observation {
            now_ms: now_ms(),
            pods: pods_phase,
            pods_spec_hash: pods_hash,
            savepoint,
            checkpoints: Vec::new(),
        },
        pods: listed,
        control_url,
        token,
    };
    if running && operation.is_none() {
        runtime_status(ctx, job, &mut seen).await;
    }
    Ok(seen)
}

/// The client of a job's control API, over the operator's shared connection pool.
fn control(ctx: &Context, url: &str, token: Option<&str>) -> Result<ControlClient, ClientError> {
    ControlClient::with_http(ctx.http.clone(), url, token.map(str::to_string))
}

/// How the savepoint with this request id is doing.
async fn savepoint_progress(
    ctx: &Context,
    pods: &[RuntimePod],
    control_url: &str,
    token: Option<&str>,
    id: u64,
    running: bool,
) -> SavepointProgress {
    // The runtime already exited after the stop: its termination message names the savepoint.
    if let Some(path) = observe::stopped_with_savepoint(pods) {
        return SavepointProgress::Completed(weir_crds::streamjob::SnapshotRef {
            id: savepoint_id(&path),
            path,
            completed_at: ms_to_time(now_ms()),
        });
    }
    let status = match control(ctx, control_url, token) {
        Ok(client) => client.savepoint(id).await,
        Err(e) => return SavepointProgress::Failed(e.to_string()),
    };
    match status {
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
        Err(e) if running => {
            tracing::debug!(error = %e, "savepoint status not readable yet");
            SavepointProgress::InProgress
        }
        Err(e) => SavepointProgress::Failed(e.to_string()),
    }
}

/// The running job's id, newest checkpoint and new notices, from its control API.
async fn runtime_status(ctx: &Context, job: &JobRef, seen: &mut Seen) {
    let client = match control(ctx, &seen.control_url, seen.token.as_deref()) {
        Ok(client) => client,
        Err(e) => return tracing::warn!(job = %job.name, error = %e, "no control API client"),
    };
    let status = match client.job().await {
        Ok(status) => status,
        Err(e) => return tracing::debug!(job = %job.name, error = %e, "job status not readable"),
    };
    // What the run did that a person should know, each notice once (a run adds them while it
    // recovers, possibly after its first status was read).
    {
        let mut reported = ctx.notices_reported.lock().unwrap_or_else(|e| e.into_inner());
        let entry = reported.entry(job.key.clone()).or_default();
        if entry.0 != status.job_id {
            *entry = (status.job_id.clone(), 0);
        }
        seen.notices = status.notices.get(entry.1..).unwrap_or_default().to_vec();
        entry.1 = entry.1.max(status.notices.len());
    }
    seen.job_id = Some(status.job_id);
    if let Some(c) = status.latest_checkpoint {
        let completed = c.triggered_at_ms + c.duration_ms.unwrap_or(0);
        seen.latest_checkpoint =
            Some(weir_crds::streamjob::SnapshotRef { id: c.id, path: c.path, completed_at: ms_to_time(completed) });
    }
}

/// Plan: the pure planner's decision, reading checkpoint storage only when the decision can
/// depend on it. An invalid job that should run is not planned: it is reported Degraded and
/// whatever runs keeps running.
/// Checkpoints read from storage stay in `seen` for a plan made again in this reconcile.
async fn plan_step(job: &JobRef, seen: &mut Seen, inputs: &inputs::Inputs) -> Result<Plan, ReconcileError> {
    let current = &job.current;
    let mut p = match &inputs.verdict {
        Err(invalid) if job.effective.state == DesiredState::Running => {
            let mut p = Plan { state: current.clone(), degraded: Some(invalid.message.clone()), ..Plan::default() };
            // Once per problem: the Degraded condition already saying so means it was reported.
            if degraded_message(&job.status) != Some(invalid.message.as_str()) {
                p.events.push(PlannedEvent {
                    warning: true,
                    reason: invalid.reason.event_reason(),
                    message: invalid.message.clone(),
                });
            }
            p
        }
        _ => {
            let desired = Desired {
                spec: &job.effective,
                generation: job.generation,
                spec_hash: &job.spec_hash,
                job: inputs.job.as_ref(),
            };
            if plan::needs_checkpoints(&desired, current, &seen.obs) {
                seen.obs.checkpoints = storage(job, inputs).checkpoints().await?;
            }
            plan::plan(&desired, current, &seen.obs)
        }
    };
    for notice in &seen.notices {
        p.events.push(PlannedEvent { warning: true, reason: EventReason::OutputSuperseded, message: notice.clone() });
    }
    Ok(p)
}

fn storage<'a>(job: &'a JobRef, inputs: &'a inputs::Inputs) -> StorageAccess<'a> {
    StorageAccess { root: &job.root, identity: inputs.storage.as_ref(), refused: inputs.verdict.as_ref().err() }
}

/// A savepoint the runtime reports outside the job's storage root is not one of the job's
/// (the runtime image is the tenant's): it counts as failed, and is never restored from nor
/// recorded.
fn within_job_root(progress: SavepointProgress, root: &str) -> SavepointProgress {
    match progress {
        SavepointProgress::Completed(sp) if !tenancy::within(root, &sp.path) => SavepointProgress::Failed(format!(
            "the runtime reported savepoint `{}` outside the job's storage {root}: not used",
            sp.path
        )),
        other => other,
    }
}

/// Keeps in `new` the Degraded and Reconciling conditions of a failed reconcile that `old`
/// reports (see [`failure_conditions`]).
fn keep_reported_failure(old: &StreamJobStatus, new: &mut StreamJobStatus) {
    let reported = |c: &Condition| {
        (c.type_ == "Degraded" || c.type_ == "Reconciling")
            && c.status == "True"
            && (c.reason == EventReason::ReconcileFailed.as_str() || c.reason == EventReason::NameConflict.as_str())
    };
    if !old.conditions.iter().any(|c| c.type_ == "Degraded" && reported(c)) {
        return;
    }
    // In the order `failure_conditions` wrote them (after the others), so that an unchanged
    // status compares equal and is not written again.
    let kept: Vec<Condition> = old.conditions.iter().filter(|c| reported(c)).cloned().collect();
    new.conditions.retain(|n| !kept.iter().any(|k| k.type_ == n.type_));
    new.conditions.extend(kept);
}

/// Apply: carries out the plan's actions in order; returns the savepoint request in flight. A
/// savepoint that cannot even be requested is planned again with that failure (e.g. kill).
async fn apply(
    sj: &StreamJob,
    ctx: &Context,
    job: &JobRef,
    seen: &Seen,
    inputs: &inputs::Inputs,
    p: &mut Plan,
) -> Result<Option<u64>, ReconcileError> {
    let client = &ctx.client;
    let pods = job.pods(ctx);
    let mut request_id = job.status.operation.as_ref().and_then(|o| o.request_id);
    for action in p.actions.clone() {
        match action {
            Action::Deploy { restore_from, mode } => {
                let Ok(job_yaml) = &inputs.verdict else {
                    unreachable!("the planner is not asked to deploy an invalid job")
                };
                // The pod reads its token from this Secret: make sure it exists.
                let secret = ensure_token(client, sj, &job.ns, &job.name).await?;
                ctx.tokens.lock().unwrap_or_else(|e| e.into_inner()).insert(job.key.clone(), secret);
                // Children are applied with force (the operator owns every field it sets), so
                // first make sure each name is free or already the job's own: an object someone
                // else made is never taken over (nor garbage-collected with the job).
                let pp = PatchParams::apply(FIELD_MANAGER).force();
                let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &job.ns);
                let svcs: Api<Service> = Api::namespaced(client.clone(), &job.ns);
                let nps: Api<NetworkPolicy> = Api::namespaced(client.clone(), &job.ns);
                let (cm_name, svc_name) = (children::config_map_name(&job.name), children::service_name(&job.name));
                let np_name = children::network_policy_name(&job.name);
                let pod_name = children::pod_name(&job.name);
                ensure_ours(&cms, "ConfigMap", &cm_name, sj).await?;
                ensure_ours(&svcs, "Service", &svc_name, sj).await?;
                if ctx.settings.control_ingress.is_some() {
                    ensure_ours(&nps, "NetworkPolicy", &np_name, sj).await?;
                }
                ensure_ours(&pods, "Pod", &pod_name, sj).await?;
                let cm = children::config_map(sj, job_yaml.clone())?;
                cms.patch(&cm_name, &pp, &Patch::Apply(cm)).await?;
                svcs.patch(&svc_name, &pp, &Patch::Apply(children::service(sj)?)).await?;
                if let Some(ingress) = &ctx.settings.control_ingress {
                    nps.patch(&np_name, &pp, &Patch::Apply(children::network_policy(sj, ingress)?)).await?;
                }
                let pod = children::pod(sj, &job.spec_hash, &job.root, restore_from.as_ref(), mode)?;
                pods.patch(&pod_name, &pp, &Patch::Apply(pod)).await?;
            }
            Action::DeletePods { grace_seconds } => delete_pods(&pods, &seen.pods, grace_seconds).await?,
            Action::DeleteSavepoint { path } => {
                // Savepoints live under the job's storage root; anything else is left alone.
                let Some(storage) = storage(job, inputs).open()? else { continue };
                match path.strip_prefix(storage.url()).map(|rel| rel.trim_start_matches('/').to_string()) {
                    Some(rel) if rel.starts_with(weir_checkpoint::layout::SAVEPOINTS) => {
                        storage.delete_dir(&rel).await?
                    }
                    _ => {
                        let why = "not deleting a savepoint outside the job's storage root";
                        tracing::warn!(job = %job.name, %path, "{why}")
                    }
                }
            }
            Action::RequestSavepoint { stop } => match request_savepoint(ctx, seen, job, stop).await {
                Ok(s) => request_id = Some(s.request_id),
                Err(e) => {
                    let failed = SavepointProgress::Failed(e.to_string());
                    *p = replan_after_failed_request(job, seen, inputs, p, failed).await?;
                    for a in &p.actions {
                        if let Action::DeletePods { grace_seconds } = a {
                            delete_pods(&pods, &seen.pods, *grace_seconds).await?;
                        }
                    }
                    return Ok(None);
                }
            },
        }
    }
    Ok(request_id)
}

/// Asks the runtime for a savepoint (and to stop after it when `stop`). A request that never
/// reached it (the name of a just-ready pod not yet in cluster DNS, a refused connection) is
/// sent again for a few seconds before it counts as a failed savepoint, which on a cancel kills
/// the pods: a blip must not cost a job its savepoint.
async fn request_savepoint(
    ctx: &Context,
    seen: &Seen,
    job: &JobRef,
    stop: bool,
) -> Result<weir_crds::control::SavepointStatus, ClientError> {
    let request = weir_crds::control::SavepointRequest { drain: false, wait: false };
    let mut pause = Duration::from_millis(250);
    let give_up = tokio::time::Instant::now() + SAVEPOINT_REQUEST_RETRY;
    let client = control(ctx, &seen.control_url, seen.token.as_deref())?;
    loop {
        let answer = if stop { client.stop(&request).await } else { client.trigger_savepoint(&request).await };
        match answer {
            Err(e) if e.never_sent() && tokio::time::Instant::now() + pause < give_up => {
                tracing::debug!(job = %job.name, error = %e, "savepoint request not delivered; sending it again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
            other => return other,
        }
    }
}

/// How long a savepoint request that never reached the runtime is sent again.
const SAVEPOINT_REQUEST_RETRY: Duration = Duration::from_secs(10);

/// The plan again, after the savepoint it requested could not even start; the first plan's
/// events are kept.
async fn replan_after_failed_request(
    job: &JobRef,
    seen: &Seen,
    inputs: &inputs::Inputs,
    first: &mut Plan,
    failed: SavepointProgress,
) -> Result<Plan, ReconcileError> {
    let desired = Desired {
        spec: &job.effective,
        generation: job.generation,
        spec_hash: &job.spec_hash,
        job: inputs.job.as_ref(),
    };
    let mut obs = Observation { savepoint: Some(failed), ..seen.obs.clone() };
    // Checkpoints the first plan read are reused; read only if it did not need them.
    if obs.checkpoints.is_empty() && plan::needs_checkpoints(&desired, &first.state, &obs) {
        obs.checkpoints = storage(job, inputs).checkpoints().await?;
    }
    let mut retry = plan::plan(&desired, &first.state, &obs);
    retry.events.splice(0..0, first.events.drain(..));
    Ok(retry)
}

/// Publish: the plan's events on the StreamJob, counted in the metrics by reason.
async fn publish_events(sj: &StreamJob, ctx: &Context, job: &JobRef, p: &Plan) {
    for e in &p.events {
        ctx.metrics.event(e.reason);
        publish(ctx, sj, &job.name, e.warning, e.reason, &e.message).await;
    }
}

async fn publish(ctx: &Context, sj: &StreamJob, name: &str, warning: bool, reason: EventReason, message: &str) {
    let event = crate::events::EventNote { warning, reason: reason.as_str(), note: message };
    if let Err(err) = ctx.events.publish(event, &sj.object_ref(&())).await {
        tracing::warn!(job = %name, error = %err, "could not record event");
    }
}

/// The status to write: the plan's state, and the runtime's view of the run.
fn status_of(
    job: &JobRef,
    seen: &Seen,
    p: &Plan,
    request_id: Option<u64>,
    invalid: Option<&inputs::Invalid>,
) -> StreamJobStatus {
    let mut status = status_from(&job.status, p, job.generation, request_id, invalid.map(|i| i.reason));
    status.job_id = seen.job_id.clone();
    status.latest_checkpoint = seen.latest_checkpoint.clone();
    status
}

/// The Degraded condition's message, when degraded.
fn degraded_message(status: &StreamJobStatus) -> Option<&str> {
    status.conditions.iter().find(|c| c.type_ == "Degraded" && c.status == "True").map(|c| c.message.as_str())
}

/// A failed reconcile, on the StreamJob: the Degraded condition says what failed (category
/// and error) and a Warning event says it once per distinct error; the rest of the status is
/// kept. Best effort: when even this write fails, the log has it.
async fn report_failure(sj: &StreamJob, ctx: &Context, error: &ReconcileError) {
    let (Some(name), Some(ns)) = (sj.metadata.name.as_deref(), sj.metadata.namespace.as_deref()) else { return };
    let message: String = format!("reconcile failed ({}): {error}", error.category()).chars().take(1000).collect();
    if degraded_message(&sj.status.clone().unwrap_or_default()) == Some(message.as_str()) {
        return;
    }
    let api: Api<StreamJob> = Api::namespaced(ctx.client.clone(), ns);
    // The conditions as they are now, not as this reconcile read them: a write-ahead earlier
    // in the same reconcile added its own, and a merge patch replaces the whole list (dropped
    // here, the next write-ahead would put them back: one write more per failure).
    let fresh = match api.get_status(name).await {
        Ok(fresh) => fresh.status.unwrap_or_default(),
        Err(_) => sj.status.clone().unwrap_or_default(),
    };
    if degraded_message(&fresh) == Some(message.as_str()) {
        return;
    }
    publish(ctx, sj, name, true, error.event_reason(), &message).await;
    let conditions =
        failure_conditions(&fresh.conditions, error.event_reason(), &message, sj.metadata.generation.unwrap_or(0));
    let patch = serde_json::json!({ "status": { "conditions": conditions } });
    if let Err(e) = api.patch_status(name, &PatchParams::default(), &Patch::Merge(patch)).await {
        tracing::warn!(job = %name, error = %e, "could not report the failed reconcile in status");
    }
}

/// The conditions after a failed reconcile: `Degraded` says what failed, `Reconciling` (kstatus:
/// in progress) that it is retried; the others are kept.
pub fn failure_conditions(old: &[Condition], reason: EventReason, message: &str, generation: i64) -> Vec<Condition> {
    let mut conditions: Vec<Condition> =
        old.iter().filter(|c| c.type_ != "Degraded" && c.type_ != "Reconciling").cloned().collect();
    for type_ in ["Degraded", "Reconciling"] {
        conditions.push(condition(type_, true, reason.as_str(), message.to_string(), generation, old));
    }
    conditions
}

/// The job's control API base URL: by Service or pod IP, or the annotation's when the operator
/// runs outside the cluster and says so.
fn control_url(sj: &StreamJob, ns: &str, name: &str, pods: &[RuntimePod], settings: &Settings) -> String {
    if let Some(url) = sj.annotations().get(CONTROL_URL_ANNOTATION).filter(|_| settings.control_url_annotation) {
        return url.clone();
    }
    let pod_ip = pods.iter().find_map(|p| p.status.as_ref()?.pod_ip.clone());
    match (settings.control_address, pod_ip) {
        (ControlAddress::PodIp, Some(ip)) if ip.contains(':') => format!("https://[{ip}]:{}", children::CONTROL_PORT),
        (ControlAddress::PodIp, Some(ip)) => format!("https://{ip}:{}", children::CONTROL_PORT),
        _ => format!("https://{}.{ns}.svc:{}", children::service_name(name), children::CONTROL_PORT),
    }
}

/// What a job's token Secret gives the operator: the bearer token, and the fingerprint of the
/// certificate its runtime serves the control API with.
#[derive(Clone, Debug)]
pub struct JobSecret {
    /// The control API's bearer token.
    pub token: String,
    /// SHA-256 of the certificate (DER).
    pub fingerprint: weir_client::pin::Fingerprint,
}

/// The job's control API token and certificate: cached, else read from (or created in) its
/// Secret.
async fn token(ctx: &Context, sj: &StreamJob, ns: &str, name: &str, key: &str) -> Result<JobSecret, ReconcileError> {
    if let Some(t) = ctx.tokens.lock().unwrap_or_else(|e| e.into_inner()).get(key) {
        return Ok(t.clone());
    }
    let t = ensure_token(&ctx.client, sj, ns, name).await?;
    ctx.tokens.lock().unwrap_or_else(|e| e.into_inner()).insert(key.to_string(), t.clone());
    Ok(t)
}

/// Opens a job's checkpoint storage on demand, with the identity the validate step chose.
struct StorageAccess<'a> {
    root: &'a str,
    identity: Option<&'a StorageIdentity>,
    /// Why no identity may read it.
    refused: Option<&'a inputs::Invalid>,
}

impl StorageAccess<'_> {
    /// The root; `None` when it is a local directory that does not exist (nothing is created).
    fn open(&self) -> Result<Option<Storage>, ReconcileError> {
        let Some(identity) = self.identity else {
            let why = self.refused.map_or("no identity may read it", |i| i.message.as_str());
            return Err(ReconcileError::StorageRefused(why.to_string()));
        };
        Ok(Storage::open_for(self.root, identity.settings())?)
    }

    async fn checkpoints(&self) -> Result<Vec<plan::FoundCheckpoint>, ReconcileError> {
        let (Some(storage), Some(identity)) = (self.open()?, self.identity) else { return Ok(Vec::new()) };
        let found = identity.bounded(observe::checkpoints(&storage)).await.map_err(ReconcileError::StorageTimeout)?;
        Ok(found?)
    }
}

/// Succeeds when no object named `name` exists or the one that does has `sj` as its controller.
async fn ensure_ours<K>(api: &Api<K>, kind: &'static str, name: &str, sj: &StreamJob) -> Result<(), ReconcileError>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.get_metadata_opt(name).await? {
        Some(found) if !owned_by(&found.metadata, sj) => {
            Err(ReconcileError::NameConflict { kind, name: name.to_string() })
        }
        _ => Ok(()),
    }
}

/// The job's token Secret: read, or created with a new token and certificate (see
/// [`new_job_secret`]) owned by the job.
async fn ensure_token(
    client: &kube::Client,
    sj: &StreamJob,
    ns: &str,
    name: &str,
) -> Result<JobSecret, ReconcileError> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let secret_name = children::token_secret_name(name);
    if let Some(existing) = secrets.get_opt(&secret_name).await? {
        // A Secret of that name made by someone else is not the job's token (it could be
        // a token its maker chose, or read the one the operator would write into it).
        if !owned_by(&existing.metadata, sj) {
            return Err(ReconcileError::NameConflict { kind: "Secret", name: secret_name });
        }
        if let Some(found) = job_secret_of(&existing) {
            return Ok(found);
        }
        // The job's own Secret, emptied or missing its certificate (by hand, or by whoever may
        // edit Secrets here): a new token and certificate replace what it holds.
        let (fresh, data) = new_job_secret(name, ns)?;
        let patch = serde_json::json!({ "stringData": data });
        secrets.patch(&secret_name, &PatchParams::default(), &Patch::Merge(patch)).await?;
        return Ok(fresh);
    }
    let (fresh, data) = new_job_secret(name, ns)?;
    let secret = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(secret_name.clone()),
            namespace: Some(ns.to_string()),
            labels: Some(children::labels(name)),
            owner_references: sj.controller_owner_ref(&()).map(|o| vec![o]),
            ..Default::default()
        },
        string_data: Some(data),
        ..Secret::default()
    };
    match secrets.create(&PostParams::default(), &secret).await {
        Ok(_) => Ok(fresh),
        Err(kube::Error::Api(e)) if e.code == 409 => {
            let s = secrets.get(&secret_name).await?;
            if !owned_by(&s.metadata, sj) {
                return Err(ReconcileError::NameConflict { kind: "Secret", name: secret_name });
            }
            Ok(job_secret_of(&s).unwrap_or(fresh))
        }
        Err(e) => Err(e.into()),
    }
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
    /// The object changed since `sj` was read: not written. Plan again from the fresh object.
    Conflict,
}

/// Writes `new` over `old` (the status of `sj` as read) by server-side apply, only over the
/// object the plan was made from (its resourceVersion is a precondition): an operator that
/// lost its lease, or planned from a stale cache, gets a conflict instead of overwriting a
/// newer decision. That holds for every field, not only the write-ahead ones (an upgrade's
/// target and restore point, the recovery point, a savepoint in flight): a reconcile run on
/// the cached object from before a relaunch was counted used to write the old count back.
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
    if let Some(rv) = sj.metadata.resource_version.as_ref() {
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
async fn delete_pods(
    pods: &Api<RuntimePod>,
    listed: &[RuntimePod],
    grace_seconds: Option<i64>,
) -> Result<(), kube::Error> {
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
    invalid: Option<inputs::InvalidReason>,
) -> StreamJobStatus {
    let s = &p.state;
    let phase = s.phase.unwrap_or(Phase::Deploying);
    let phase = if p.degraded.is_some() && !matches!(phase, Phase::Failed) { Phase::Degraded } else { phase };
    // Ready: the job is where its spec asks it to be, nothing in progress (kstatus and Flux
    // read Ready=False as "not done yet", so a suspended or finished job is Ready too).
    let ready = matches!(phase, Phase::Running | Phase::Suspended | Phase::Cancelled | Phase::Finished);
    let progressing = matches!(
        phase,
        Phase::Deploying | Phase::Upgrading | Phase::Suspending | Phase::Cancelling | Phase::Relaunching
    );
    let degraded_msg = p.degraded.clone().unwrap_or_default();
    let stalled = matches!(phase, Phase::Failed | Phase::Degraded);
    let transition =
        if progressing { format!("{} in progress", phase.as_str()) } else { "no transition in progress".into() };
    let in_phase = format!("the job is {}", phase.as_str().to_lowercase());
    // What needs attention: the planner's reason, else the phase itself.
    let problem = if degraded_msg.is_empty() { in_phase.clone() } else { degraded_msg.clone() };
    let ready_message = if ready || !progressing { problem.clone() } else { transition.clone() };
    let conditions = vec![
        condition("Ready", ready, phase.as_str(), ready_message, generation, &old.conditions),
        condition("Progressing", progressing, phase.as_str(), transition.clone(), generation, &old.conditions),
        condition(
            "Degraded",
            p.degraded.is_some(),
            if let Some(reason) = invalid {
                reason.event_reason().as_str()
            } else if p.degraded.is_some() {
                "NeedsAttention"
            } else {
                "AsExpected"
            },
            if degraded_msg.is_empty() { "no problem".into() } else { degraded_msg.clone() },
            generation,
            &old.conditions,
        ),
        // kstatus (Flux, kpt, cli-utils): Reconciling while a transition runs, Stalled when the
        // job cannot get back to Ready by itself.
        condition("Reconciling", progressing, phase.as_str(), transition, generation, &old.conditions),
        condition(
            "Stalled",
            stalled,
            phase.as_str(),
            if stalled { problem } else { "not stalled".into() },
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

fn error_policy(sj: Arc<StreamJob>, error: &ReconcileError, ctx: Arc<Context>) -> Requeue {
    tracing::warn!(job = %sj.name_any(), category = error.category(), %error, "reconcile failed");
    let key = format!("{}/{}", sj.namespace().unwrap_or_default(), sj.name_any());
    let failures = {
        let mut failures = ctx.failures.lock().unwrap_or_else(|e| e.into_inner());
        let n = failures.entry(key).or_default();
        *n = n.saturating_add(1);
        *n
    };
    let jitter = {
        let mut bytes = [0u8; 2];
        getrandom::fill(&mut bytes).map_or(0.5, |_| f64::from(u16::from_le_bytes(bytes)) / f64::from(u16::MAX))
    };
    Requeue::requeue(retry_delay(failures, error.needs_a_person(), jitter))
}

/// How long to wait before the `failures`-th retry in a row: exponential from 1 s (from 30 s
/// when only a person's change helps) up to 5 minutes, with ±25% jitter (`jitter` in [0, 1])
/// so that jobs failing together do not retry together.
pub fn retry_delay(failures: u32, needs_a_person: bool, jitter: f64) -> Duration {
    let (first, max) = if needs_a_person { (30.0, 300.0) } else { (1.0, 300.0) };
    let base: f64 = (first * 2f64.powi(failures.saturating_sub(1).min(16) as i32)).min(max);
    Duration::from_secs_f64(base * (0.75 + 0.5 * jitter.clamp(0.0, 1.0)))
}

/// Runs the controller until the stream ends (shutdown).
pub async fn run(client: kube::Client, settings: Settings) -> Result<(), ClientError> {
    run_with_metrics(client, settings, crate::metrics::OperatorMetrics::shared()).await
}

/// Runs the controller, recording into `metrics`, until the stream ends (shutdown). Fails only
/// when no HTTP client for the runtimes' control APIs can be built.
pub async fn run_with_metrics(
    client: kube::Client,
    settings: Settings,
    metrics: Arc<crate::metrics::OperatorMetrics>,
) -> Result<(), ClientError> {
    let pins = weir_client::pin::Pins::default();
    let http = weir_client::pinned_http_client(pins.clone())?;
    let (jobs, pods): (Api<StreamJob>, Api<RuntimePod>) = match &settings.namespace {
        Some(ns) => (Api::namespaced(client.clone(), ns), Api::namespaced(client.clone(), ns)),
        None => (Api::all(client.clone()), Api::all(client.clone())),
    };
    let events = crate::events::Publisher::new(client.clone(), FIELD_MANAGER, std::env::var("POD_NAME").ok());
    metrics.ready.store(true, std::sync::atomic::Ordering::Relaxed);
    // One watch of the runtime pods feeds both the cache that reconciles read and the
    // controller's triggers. Pods are parsed as `RuntimePod` (the metadata and the few status
    // fields reconciles read) and slimmed further before they are cached.
    let (pod_store, writer) = reflector::store::<RuntimePod>();
    let pod_events = watcher(pods, watcher::Config::default().labels(JOB_LABEL).any_semantic())
        .default_backoff()
        .modify(RuntimePod::slim)
        .reflect(writer)
        // Deletions too: a deleted pod is what an upgrade or relaunch waits for.
        .touched_objects();
    let concurrency = settings.max_concurrent_reconciles.max(1);
    let ctx = Arc::new(Context {
        client: client.clone(),
        settings,
        events,
        metrics: metrics.clone(),
        http,
        pins,
        pods: pod_store,
        tokens: Default::default(),
        notices_reported: Default::default(),
        failures: Default::default(),
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
    Ok(())
}

#[cfg(test)]
mod tests {
    use weir_crds::streamjob::{OperationKind, PendingUpgrade, RestoreMode, SnapshotRef};

    use super::*;

    fn snapshot(id: u64, path: &str) -> SnapshotRef {
        SnapshotRef { id, path: path.into(), completed_at: None }
    }

    /// A state with every field the planner writes set.
    fn full_state(phase: Phase) -> PlanState {
        PlanState {
            phase: Some(phase),
            operation: Some(Operation {
                kind: OperationKind::Upgrade,
                started_at_ms: 1_764_500_000_123,
                generation: 4,
            }),
            pending_upgrade: Some(PendingUpgrade {
                target_generation: 4,
                target_spec_hash: "h4".into(),
                restore_from: Some(snapshot(9, "s3://b/ns/j/savepoints/sp-1-9")),
                restore: Some(RestoreMode::Snapshot),
            }),
            recovery_point: Some(snapshot(7, "s3://b/ns/j/checkpoints/chk-7")),
            relaunch_count: 2,
            last_relaunch_ms: Some(1_764_400_000_456),
            observed_restart_nonce: Some(3),
            observed_savepoint_nonce: Some(5),
            latest_savepoint: Some(snapshot(9, "s3://b/ns/j/savepoints/sp-1-9")),
            // As the planner keeps them: each with its completion time, in status and in ms.
            savepoint_history: [(9, 1_764_300_000_789), (6, 1_764_200_000_000)]
                .map(|(id, at)| {
                    let path = format!("s3://b/ns/j/savepoints/sp-1-{id}");
                    (SnapshotRef { id, path, completed_at: ms_to_time(at) }, at)
                })
                .to_vec(),
            last_savepoint_ms: Some(1_764_300_000_789),
        }
    }

    /// What the planner decides survives the status it is written to: read back, the planner
    /// sees the same state (times kept to the millisecond).
    #[test]
    fn status_and_planner_state_round_trip() {
        for phase in Phase::ALL {
            for state in [full_state(phase), PlanState { phase: Some(phase), ..PlanState::default() }] {
                let plan = Plan { state: state.clone(), ..Plan::default() };
                let status = status_from(&StreamJobStatus::default(), &plan, 4, Some(11), None);
                let mut expected = state.clone();
                // A job Degraded with no trace of a run reads back as new (see `plan_state`).
                if phase == Phase::Degraded && state.relaunch_count == 0 {
                    expected.phase = None;
                }
                assert_eq!(plan_state(&status), expected, "{phase:?}");
                assert_eq!(status.operation.as_ref().and_then(|o| o.request_id), state.operation.as_ref().map(|_| 11));
            }
        }
    }

    /// A degraded plan shows Degraded, and the message, whatever phase it keeps underneath.
    #[test]
    fn a_degraded_plan_is_shown_degraded_with_its_reason() {
        let plan =
            Plan { state: full_state(Phase::Running), degraded: Some("spec.image: ...".into()), ..Plan::default() };
        let status =
            status_from(&StreamJobStatus::default(), &plan, 4, None, Some(inputs::InvalidReason::MissingSecret));
        assert_eq!(status.phase, Some(Phase::Degraded));
        let degraded = status.conditions.iter().find(|c| c.type_ == "Degraded").unwrap();
        assert_eq!((degraded.status.as_str(), degraded.reason.as_str()), ("True", "MissingSecret"));
        assert_eq!(degraded_message(&status), Some("spec.image: ..."));
    }
}
