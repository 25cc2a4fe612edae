//! The `StreamJob` custom resource (`weir.dev/v1alpha1`, short name `sj`): what a user applies
//! to run a job on Kubernetes. Every field's doc comment is its `kubectl explain` text; rules
//! that span fields are CEL validations, so a bad manifest is refused at apply time.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{LocalObjectReference, ResourceRequirements, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::duration::HumanDuration;
use crate::job::{
    default_retained, one, CheckpointMode, OperatorSpec, RetentionOnCancel, SinkSpec, SourceSpec, StateBackendKind,
};

/// A stream-processing job run by Weir: its dataflow graph, parallelism, checkpointing and
/// lifecycle.
/// Longest StreamJob name: the control Service `<name>-control` must be a DNS label (63).
pub const MAX_NAME_LEN: usize = 63 - "-control".len();

/// The name rule of the CRD: a DNS label short enough for every derived name.
const NAME_RULE: &str = "self.metadata.name.size() <= 55 && self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')";
const NAME_MESSAGE: &str =
    "metadata.name must be at most 55 lowercase letters, digits and '-', starting with a letter \
                            and ending with a letter or digit: the job's Service <name>-control must be a DNS label";

/// A duration field that must be > 0 (CEL's `duration()` reads the same `1h30m5s500ms` form).
const POSITIVE: &str = "duration(self) > duration('0s')";
const POSITIVE_MESSAGE: &str = "must be > 0";

#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
// Each printcolumn has its own `type_`: clippy reads them as one repeated attribute.
#[allow(clippy::duplicated_attributes)]
#[kube(
    group = "weir.dev",
    version = "v1alpha1",
    kind = "StreamJob",
    namespaced,
    shortname = "sj",
    status = "StreamJobStatus",
    doc = "A stream-processing job run by Weir, with exactly-once checkpoints, savepoints before upgrades and \
           relaunch from the newest valid checkpoint.",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Parallelism", type_ = "integer", json_path = ".spec.parallelism"),
    printcolumn(
        name = "Checkpoint",
        type_ = "date",
        json_path = ".status.latestCheckpoint.completedAt",
        description = "When the newest checkpoint completed"
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    printcolumn(
        name = "Savepoint",
        type_ = "date",
        json_path = ".status.latestSavepoint.completedAt",
        description = "When the newest savepoint completed",
        priority = "1"
    ),
    printcolumn(
        name = "Relaunches",
        type_ = "integer",
        json_path = ".status.relaunchCount",
        description = "Relaunches after failures so far",
        priority = "1"
    ),
    printcolumn(
        name = "Message",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].message",
        description = "Why the job is not Ready (or that it runs)",
        priority = "1"
    ),
    validation = Rule::new(NAME_RULE).message(NAME_MESSAGE)
)]
#[x_kube(
    validation = Rule::new("(has(self.maxParallelism) ? self.maxParallelism : 128) >= self.parallelism")
        .message("maxParallelism (default 128) must be >= parallelism")
)]
#[x_kube(
    validation = Rule::new(
        "(has(self.maxParallelism) ? self.maxParallelism : 128) == \
         (has(oldSelf.maxParallelism) ? oldSelf.maxParallelism : 128)"
    )
    .message("maxParallelism cannot change (unset means 128): state is partitioned by it")
)]
#[serde(rename_all = "camelCase")]
pub struct StreamJobSpec {
    /// Container image of the Weir runtime (it must contain `weir-runtime`).
    #[x_kube(
        validation = Rule::new("self.size() > 0 && !self.contains(' ')")
            .message("must name the runtime image, e.g. registry.example/weir-runtime:0.1")
    )]
    pub image: String,
    /// Image pull policy of the runtime container (Always, IfNotPresent, Never).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(
        validation = Rule::new("self in ['Always', 'IfNotPresent', 'Never']")
            .message("must be Always, IfNotPresent or Never")
    )]
    pub image_pull_policy: Option<String>,
    /// Parallel subtasks of every operator (nodes of the job may set their own).
    #[schemars(range(min = 1, max = 32768))]
    pub parallelism: u32,
    /// Key groups keyed state is split into: the upper bound of parallelism. Fixed once the job
    /// has state (default 128).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 32768))]
    #[x_kube(
        validation = Rule::new("self == oldSelf").message("maxParallelism cannot change: state is partitioned by it")
    )]
    pub max_parallelism: Option<u32>,
    /// The dataflow graph: inline, or in a ConfigMap.
    pub job: JobSource,
    /// Desired lifecycle state: running, suspended (stopped with a savepoint, resumable) or
    /// cancelled.
    #[serde(default)]
    pub state: DesiredState,
    /// How a spec change reaches the running job: savepoint (stop with a savepoint, restore
    /// from it), last-state (restore from the newest checkpoint) or stateless (start fresh).
    #[serde(default)]
    pub upgrade_mode: UpgradeMode,
    /// Checkpointing settings.
    #[serde(default)]
    pub checkpointing: CheckpointSettings,
    /// Savepoint settings.
    #[serde(default)]
    pub savepoint: SavepointSettings,
    /// Change this value to restart the job once (from its newest checkpoint).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_nonce: Option<i64>,
    /// Start the first run from this savepoint (or checkpoint) path: within the namespace's
    /// allowed storage roots, or an object store read with the job's credentialsSecret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial_savepoint: Option<String>,
    /// Accept a savepoint holding state of operators the job no longer has.
    #[serde(default)]
    pub allow_non_restored_state: bool,
    /// What to do when the job fails.
    #[serde(default)]
    pub relaunch: RelaunchPolicy,
    /// Where keyed state lives between checkpoints: `heap` (in memory, the default) or
    /// `rocksdb` (RocksDB on the pod's local disk behind an in-memory cache, for state larger
    /// than the pod's memory). Checkpoints and savepoints have one format for both, so changing
    /// it is an ordinary upgrade: the new backend restores the old one's savepoint.
    #[serde(default)]
    pub state_backend: StateBackendKind,
    /// With `stateBackend: rocksdb`, the keyed-state entries each stateful subtask keeps in
    /// memory (default 1000000; each costs about 100 bytes plus its key and value).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 100").message("must be at least 100"))]
    pub state_cache_entries: Option<u64>,
    /// CPU and memory of each runtime pod (default: requests 100m CPU and 256Mi memory, a 2Gi
    /// memory limit; the runtime sizes its state budget from the limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Overrides for the runtime pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_template: Option<PodOverrides>,
}

/// Where the dataflow graph comes from: exactly one of `inline` or `configMapRef`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[x_kube(
    validation = Rule::new("has(self.inline) != has(self.configMapRef)")
        .message("set exactly one of inline or configMapRef")
)]
#[serde(rename_all = "camelCase")]
pub struct JobSource {
    /// The graph, written as in a job file (sources, operators, sinks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inline: Option<JobGraph>,
    /// A ConfigMap key holding a job file (its sources, operators and sinks are used).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map_ref: Option<ConfigMapKeyRef>,
}

/// The graph part of a job file.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct JobGraph {
    /// Where records come from.
    pub sources: Vec<SourceSpec>,
    /// Transformations, in order.
    #[serde(default)]
    pub operators: Vec<OperatorSpec>,
    /// Where results go.
    pub sinks: Vec<SinkSpec>,
}

/// A key of a ConfigMap in the job's namespace.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ConfigMapKeyRef {
    /// ConfigMap name.
    pub name: String,
    /// Key within it (default `job.yaml`).
    #[serde(default = "default_job_key")]
    pub key: String,
}

fn default_job_key() -> String {
    "job.yaml".into()
}

/// Desired lifecycle state.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
pub enum DesiredState {
    /// Run the job.
    #[default]
    Running,
    /// Stop it with a savepoint; setting running again resumes from it.
    Suspended,
    /// Stop it for good (with a savepoint when one can be taken).
    Cancelled,
}

/// How spec changes are applied.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
pub enum UpgradeMode {
    /// Stop with a savepoint, then restore the new spec from it.
    #[default]
    Savepoint,
    /// Stop, then restore the new spec from the newest checkpoint.
    LastState,
    /// Stop and start the new spec without state.
    Stateless,
}

/// Checkpointing settings of a StreamJob.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new(
        "!has(self.storage) || \
         self.storage.matches('^(s3|gs|az)://[a-z0-9][-a-z0-9.]*[a-z0-9](/.*)?$|^file:///.+|^/.+')"
    )
    .message("storage must be s3://bucket[/prefix], gs://, az://, file:///path or an absolute path")
)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointSettings {
    /// Time between the starts of two checkpoints.
    #[serde(default = "default_interval")]
    #[x_kube(validation = Rule::new(POSITIVE).message(POSITIVE_MESSAGE))]
    pub interval: HumanDuration,
    /// exactly-once (aligned barriers) or at-least-once.
    #[serde(default)]
    pub mode: CheckpointMode,
    /// A checkpoint not complete after this long is aborted. When an attempt fails because
    /// its checkpoints expired before any of them completed, the next attempt in the same
    /// process allows twice as long, up to 8 times this and within what an exactly-once Kafka
    /// sink's `transactionTimeout` outlives (the first checkpoint after a restore that cannot
    /// go on from the restored files writes every key).
    #[serde(default = "default_timeout")]
    #[x_kube(validation = Rule::new(POSITIVE).message(POSITIVE_MESSAGE))]
    pub timeout: HumanDuration,
    /// Least time between the end of one checkpoint and the start of the next.
    #[serde(default)]
    pub min_pause: HumanDuration,
    /// Checkpoints in flight at once.
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 16))]
    pub max_concurrent: u32,
    /// Consecutive failed checkpoints tolerated before the job restarts.
    #[serde(default)]
    pub tolerable_failures: u32,
    /// Complete checkpoints kept (the newest is never deleted).
    #[serde(default = "default_retained")]
    #[schemars(range(min = 1, max = 100))]
    pub retained: u32,
    /// retain or delete the checkpoints when the job is cancelled.
    #[serde(default)]
    pub retention_on_cancel: RetentionOnCancel,
    /// Storage root for checkpoints and savepoints; the job's files go under
    /// `<storage>/<namespace>/<name>/`. Default: the operator's configured storage. Without a
    /// credentialsSecret it must lie within the roots the operator allows this namespace (its
    /// default storage's `<root>/<namespace>`, and `storage.allowedRoots` of the chart); local
    /// paths only ever there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage: Option<String>,
    /// Secret whose keys become the runtime's environment and the operator's only settings for
    /// this job's storage (never mixed with the operator's own credentials). Allowed keys:
    /// AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION,
    /// AWS_DEFAULT_REGION, AWS_ENDPOINT, AWS_ENDPOINT_URL, AWS_ALLOW_HTTP,
    /// GOOGLE_SERVICE_ACCOUNT_KEY, AZURE_STORAGE_ACCOUNT_NAME, AZURE_STORAGE_ACCOUNT_KEY,
    /// AZURE_STORAGE_SAS_KEY, AZURE_STORAGE_ENDPOINT; a Secret with any other key is refused.
    /// Values are never logged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret: Option<LocalObjectReference>,
}

fn default_interval() -> HumanDuration {
    HumanDuration::from_secs(10)
}
fn default_timeout() -> HumanDuration {
    HumanDuration::from_secs(600)
}

impl Default for CheckpointSettings {
    fn default() -> Self {
        CheckpointSettings {
            interval: default_interval(),
            mode: CheckpointMode::default(),
            timeout: default_timeout(),
            min_pause: HumanDuration::default(),
            max_concurrent: 1,
            tolerable_failures: 0,
            retained: default_retained(),
            retention_on_cancel: RetentionOnCancel::default(),
            storage: None,
            credentials_secret: None,
        }
    }
}

/// What to do when a savepoint on cancel or suspend fails or times out.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
pub enum OnSavepointFailure {
    /// Kill the pods at once (grace period 0); the newest retained checkpoint is the recovery
    /// point, named in status.
    #[default]
    Kill,
    /// Leave the job running and report the failure.
    KeepRunning,
}

/// Savepoint settings of a StreamJob.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SavepointSettings {
    /// How long a savepoint may take before it counts as failed (on a cancel, the pods are then
    /// killed: zero would kill at once, so it must be > 0).
    #[serde(default = "default_savepoint_timeout")]
    #[x_kube(validation = Rule::new(POSITIVE).message(POSITIVE_MESSAGE))]
    pub timeout: HumanDuration,
    /// What happens when the savepoint of a cancel or suspend fails or times out.
    #[serde(default)]
    pub on_cancel_failure: OnSavepointFailure,
    /// Take a savepoint this often while running (absent: never).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new(POSITIVE).message(POSITIVE_MESSAGE))]
    pub periodic_interval: Option<HumanDuration>,
    /// Savepoints remembered in status (older ones are forgotten and deleted).
    #[serde(default = "default_history")]
    #[schemars(range(min = 1, max = 100))]
    pub history_max_count: u32,
    /// Forget and delete savepoints older than this (absent: by count only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new(POSITIVE).message(POSITIVE_MESSAGE))]
    pub history_max_age: Option<HumanDuration>,
    /// Change this value to take one savepoint now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trigger_nonce: Option<i64>,
}

fn default_savepoint_timeout() -> HumanDuration {
    HumanDuration::from_secs(300)
}
fn default_history() -> u32 {
    10
}

impl Default for SavepointSettings {
    fn default() -> Self {
        SavepointSettings {
            timeout: default_savepoint_timeout(),
            on_cancel_failure: OnSavepointFailure::default(),
            periodic_interval: None,
            history_max_count: default_history(),
            history_max_age: None,
            trigger_nonce: None,
        }
    }
}

/// Relaunch after a failure, from the newest valid retained checkpoint.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new("duration(self.maxBackoff) >= duration(self.backoff)")
        .message("maxBackoff must be >= backoff")
)]
#[serde(rename_all = "camelCase")]
pub struct RelaunchPolicy {
    /// Wait before the first relaunch; doubled after each failed one.
    #[serde(default = "default_backoff")]
    pub backoff: HumanDuration,
    /// Upper bound of the wait.
    #[serde(default = "default_max_backoff")]
    pub max_backoff: HumanDuration,
    /// Relaunches allowed before the job is marked Failed (0: never relaunch).
    #[serde(default = "default_limit")]
    pub limit: u32,
    /// Do not relaunch from a checkpoint older than this (the job is marked Degraded and waits
    /// for a person instead of silently reprocessing a long stretch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new(POSITIVE).message(POSITIVE_MESSAGE))]
    pub max_checkpoint_age: Option<HumanDuration>,
}

fn default_backoff() -> HumanDuration {
    HumanDuration::from_secs(10)
}
fn default_max_backoff() -> HumanDuration {
    HumanDuration::from_secs(300)
}
fn default_limit() -> u32 {
    10
}

impl Default for RelaunchPolicy {
    fn default() -> Self {
        RelaunchPolicy {
            backoff: default_backoff(),
            max_backoff: default_max_backoff(),
            limit: default_limit(),
            max_checkpoint_age: None,
        }
    }
}

/// Overrides applied to the runtime pods.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PodOverrides {
    /// Extra labels; none under `weir.dev/`, `app.kubernetes.io/`, `kubernetes.io/` or `k8s.io/`
    /// (the job's Service and NetworkPolicy select its pods by those).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Extra annotations; none under `weir.dev/`, and no AppArmor or seccomp annotation (the
    /// runtime runs under the restricted Pod Security profile).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Node selector.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Service account of the pods (default: the namespace's default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account_name: Option<String>,
    /// Image pull secrets.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<LocalObjectReference>,
    /// Secrets whose keys become environment variables of the runtime container, e.g. Kafka
    /// credentials, which Kafka `properties` reference as `${env:KEY}` so that no secret is
    /// written in the job. Only these keys can be referenced so (the storage credentials and
    /// the rest of the runtime's environment cannot).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env_from_secrets: Vec<LocalObjectReference>,
}

/// Observed state of a StreamJob, written only by the operator.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct StreamJobStatus {
    /// The spec generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// One word for `kubectl get`: Deploying, Running, Upgrading, Suspending, Suspended,
    /// Cancelling, Cancelled, Relaunching, Finished, Failed, Degraded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    /// Conditions: `Ready` (the job is where its spec asks: running, or suspended, cancelled or
    /// finished; its message says why not), `Progressing` (a
    /// transition is under way), `Degraded` (something needs attention), and kstatus's
    /// `Reconciling` (= Progressing) and `Stalled` (failed, or degraded until the spec or the
    /// cluster changes) that Flux and `kstatus` read.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// Id of the current run of the runtime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_id: Option<String>,
    /// The newest complete checkpoint known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latest_checkpoint: Option<SnapshotRef>,
    /// The newest savepoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latest_savepoint: Option<SnapshotRef>,
    /// Savepoints taken, newest first (bounded by savepoint.historyMaxCount/MaxAge).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub savepoint_history: Vec<SnapshotRef>,
    /// Relaunches after failures so far.
    #[serde(default)]
    pub relaunch_count: u32,
    /// Where the job resumes from when it is started again (set when it was stopped or killed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery_point: Option<SnapshotRef>,
    /// A spec change being applied, recorded before anything is deleted (write-ahead).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_upgrade: Option<PendingUpgrade>,
    /// Last handled restartNonce.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_restart_nonce: Option<i64>,
    /// Last handled savepoint.triggerNonce.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_savepoint_nonce: Option<i64>,
    /// A savepoint the operator is waiting for (before an upgrade, suspend or cancel, or on
    /// request).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation: Option<OperationStatus>,
    /// When the job was last relaunched after a failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_relaunch_time: Option<Time>,
    /// When the newest savepoint completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_savepoint_time: Option<Time>,
    /// The last error, without secrets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// A savepoint operation in flight.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct OperationStatus {
    /// Why the savepoint is taken: upgrade, suspend, cancel or savepoint.
    pub kind: OperationKind,
    /// The runtime's savepoint request id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<u64>,
    /// When it started: `savepoint.timeout` counts from here.
    pub started_at: Time,
    /// The generation that asked for it.
    pub generation: i64,
}

/// Lifecycle phase of a StreamJob, for `kubectl get`.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Pods being created.
    Deploying,
    /// Processing.
    Running,
    /// A spec change is being applied.
    Upgrading,
    /// Stopping with a savepoint to suspend.
    Suspending,
    /// Stopped; resumable.
    Suspended,
    /// Stopping for good.
    Cancelling,
    /// Stopped for good.
    Cancelled,
    /// Waiting to relaunch after a failure.
    Relaunching,
    /// Bounded input ended.
    Finished,
    /// Relaunch limit reached.
    Failed,
    /// Needs a person (e.g. the newest checkpoint is too old to relaunch from).
    Degraded,
}

impl Phase {
    /// Every phase, in lifecycle order.
    pub const ALL: [Phase; 11] = [
        Phase::Deploying,
        Phase::Running,
        Phase::Upgrading,
        Phase::Suspending,
        Phase::Suspended,
        Phase::Cancelling,
        Phase::Cancelled,
        Phase::Relaunching,
        Phase::Finished,
        Phase::Failed,
        Phase::Degraded,
    ];

    /// The word shown in status.
    pub fn as_str(&self) -> &'static str {
        match self {
            Phase::Deploying => "Deploying",
            Phase::Running => "Running",
            Phase::Upgrading => "Upgrading",
            Phase::Suspending => "Suspending",
            Phase::Suspended => "Suspended",
            Phase::Cancelling => "Cancelling",
            Phase::Cancelled => "Cancelled",
            Phase::Relaunching => "Relaunching",
            Phase::Finished => "Finished",
            Phase::Failed => "Failed",
            Phase::Degraded => "Degraded",
        }
    }
}

/// Why the operator is taking a savepoint.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum OperationKind {
    /// Stop-with-savepoint before deploying a new spec.
    Upgrade,
    /// Stop-with-savepoint for `state: suspended`.
    Suspend,
    /// Stop-with-savepoint for `state: cancelled` (or deletion).
    Cancel,
    /// A savepoint while running (trigger nonce or periodic).
    Savepoint,
}

/// A checkpoint or savepoint.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotRef {
    /// Checkpoint id.
    pub id: u64,
    /// Storage path to restore from.
    pub path: String,
    /// When it completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<Time>,
}

/// A spec change in progress.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PendingUpgrade {
    /// The generation being deployed.
    pub target_generation: i64,
    /// Hash of the spec being deployed.
    pub target_spec_hash: String,
    /// The savepoint (or checkpoint) the new spec restores from; absent for stateless.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_from: Option<SnapshotRef>,
    /// How the new pods restore: `snapshot` (exactly restoreFrom), `latest` (the newest valid
    /// checkpoint or savepoint in the job's storage, which the runtime verifies file by file,
    /// falling back past corrupt ones; restoreFrom is what the operator saw) or `fresh` (no
    /// state; earlier output and snapshots are kept). Absent in statuses written before it
    /// existed: `snapshot` when restoreFrom is set, else `latest`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore: Option<RestoreMode>,
}

impl PendingUpgrade {
    /// How the pending deploy restores.
    pub fn restore_mode(&self) -> RestoreMode {
        self.restore.unwrap_or(if self.restore_from.is_some() { RestoreMode::Snapshot } else { RestoreMode::Latest })
    }
}

/// How a deploy restores the job's state.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum RestoreMode {
    /// Exactly the named snapshot: the savepoint taken for an upgrade, or `initialSavepoint`.
    Snapshot,
    /// The newest valid checkpoint or savepoint in the job's storage (after a failure, a kill
    /// or a stop, and for `last-state` upgrades): the runtime verifies every file and falls
    /// back past corrupt ones, which the operator cannot see from lengths alone.
    Latest,
    /// No state (a `stateless` upgrade); earlier output and snapshots are kept.
    Fresh,
}

/// Where `crdgen --write` puts the CRD.
pub const CRD_PATH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/streamjob.yaml");
/// The Helm chart's copy of the CRD (Helm installs files under `crds/` before the templates).
pub const CHART_CRD_PATH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../charts/weir-operator/crds/streamjob.yaml");

/// What the CRD's rules refuse at apply, checked again by the operator before it creates
/// anything: a StreamJob stored before a rule existed (or under an older CRD) is reported with
/// the same field path and message instead of failing later.
pub fn spec_violations(name: &str, spec: &StreamJobSpec) -> Vec<crate::validate::Violation> {
    use crate::validate::Violation;
    let mut out = Vec::new();
    let mut err = |path: &str, message: &str| out.push(Violation { path: path.into(), message: message.into() });
    let label = name.len() <= MAX_NAME_LEN
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name.ends_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if !label {
        err("metadata.name", NAME_MESSAGE.trim_start_matches("metadata.name "));
    }
    if spec.image.is_empty() || spec.image.contains(' ') {
        err("spec.image", "must name the runtime image, e.g. registry.example/weir-runtime:0.1");
    }
    let c = &spec.checkpointing;
    let s = &spec.savepoint;
    let r = &spec.relaunch;
    let positive = [
        ("spec.checkpointing.interval", Some(c.interval)),
        ("spec.checkpointing.timeout", Some(c.timeout)),
        ("spec.savepoint.timeout", Some(s.timeout)),
        ("spec.savepoint.periodicInterval", s.periodic_interval),
        ("spec.savepoint.historyMaxAge", s.history_max_age),
        ("spec.relaunch.maxCheckpointAge", r.max_checkpoint_age),
    ];
    for (path, d) in positive {
        if d.is_some_and(|d| d.as_millis() == 0) {
            err(path, POSITIVE_MESSAGE);
        }
    }
    if r.max_backoff < r.backoff {
        err("spec.relaunch", "maxBackoff must be >= backoff");
    }
    if let Some(why) = c.storage.as_deref().and_then(storage_url_problem) {
        err("spec.checkpointing.storage", why);
    }
    if let Some(why) = spec.initial_savepoint.as_deref().and_then(storage_url_problem) {
        err("spec.initialSavepoint", why);
    }
    if let Some(t) = &spec.pod_template {
        for key in t.labels.keys().filter(|k| reserved_label(k)) {
            err(&format!("spec.podTemplate.labels.{key}"), RESERVED_LABEL_MESSAGE);
        }
        for key in t.annotations.keys().filter(|k| reserved_annotation(k)) {
            err(&format!("spec.podTemplate.annotations.{key}"), RESERVED_ANNOTATION_MESSAGE);
        }
    }
    out
}

const RESERVED_LABEL_MESSAGE: &str =
    "is reserved: Weir and Kubernetes set labels under weir.dev/, app.kubernetes.io/, \
     kubernetes.io/ and k8s.io/ (the job's Service and NetworkPolicy select its pods by them)";
const RESERVED_ANNOTATION_MESSAGE: &str = "is reserved: annotations under weir.dev/ are Weir's, and AppArmor and \
     seccomp annotations would change the runtime's security profile (restricted Pod Security)";

/// The DNS domain of a label or annotation key (`weir.dev` of `weir.dev/job`), lowercased.
fn key_domain(key: &str) -> Option<String> {
    key.split_once('/').map(|(domain, _)| domain.to_ascii_lowercase())
}

fn under(domain: &str, parent: &str) -> bool {
    domain == parent || domain.ends_with(&format!(".{parent}"))
}

/// A label the operator sets or selects by: under `weir.dev`, `app.kubernetes.io`, or
/// Kubernetes' own `kubernetes.io` and `k8s.io` domains.
pub fn reserved_label(key: &str) -> bool {
    key_domain(key).is_some_and(|d| ["weir.dev", "kubernetes.io", "k8s.io"].iter().any(|p| under(&d, p)))
}

/// An annotation that is Weir's (`weir.dev`) or steers the container's security profile
/// (AppArmor, seccomp), which restricted Pod Security fixes.
pub fn reserved_annotation(key: &str) -> bool {
    let lower = key.to_ascii_lowercase();
    key_domain(key).is_some_and(|d| under(&d, "weir.dev")) || lower.contains("apparmor") || lower.contains("seccomp")
}

/// Why a storage URL (`checkpointing.storage`, `initialSavepoint`) is refused: `.`/`..` or empty
/// segments (which would step out of the root a path seems to be under), a query or fragment,
/// or control characters.
pub fn storage_url_problem(url: &str) -> Option<&'static str> {
    let path = url.split_once("://").map_or(url, |(_, rest)| rest);
    if url.chars().any(|c| c.is_control()) {
        return Some("must not contain control characters");
    }
    if url.contains(['?', '#']) {
        return Some("must be a plain path or URL, without a query or fragment");
    }
    let inner = path.trim_end_matches('/');
    let inner = inner.strip_prefix('/').unwrap_or(inner);
    if inner.split('/').any(|seg| seg.is_empty() || seg == "." || seg == "..") {
        return Some("must not have empty, `.` or `..` segments");
    }
    None
}

/// The CRD. kube's derive drops the spec's description when the resource has a root-level
/// rule (the name rule); it is put back here so `kubectl explain streamjob.spec` has it.
pub fn crd() -> k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition {
    use kube::CustomResourceExt;
    let mut crd = StreamJob::crd();
    for version in &mut crd.spec.versions {
        let spec = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
            .and_then(|root| root.properties.as_mut())
            .and_then(|props| props.get_mut("spec"));
        if let Some(spec) = spec {
            spec.description.get_or_insert_with(|| {
                "A stream-processing job run by Weir: its dataflow graph, parallelism, checkpointing and\nlifecycle."
                    .to_string()
            });
            if let Some(d) = spec.description.as_mut() {
                d.push_str(&format!(
                    "\nBounds (every StreamJob may come from another tenant): a string is at most {MAX_FIELD_BYTES} \
                     characters, a list at most {MAX_LIST_ITEMS} items, a map at most {MAX_MAP_ENTRIES} entries; \
                     a CEL expression at most {} bytes, {} levels deep and {} operators; a job at most {} nodes.",
                    crate::expr::MAX_EXPR_BYTES,
                    crate::expr::MAX_EXPR_NESTING,
                    crate::expr::MAX_EXPR_OPERATORS,
                    crate::validate::MAX_GRAPH_NODES,
                ));
            }
            bound(spec);
        }
    }
    crd
}

/// Longest string field of a StreamJob's spec.
pub const MAX_FIELD_BYTES: i64 = 4096;
/// Most items of a list field of a StreamJob's spec.
pub const MAX_LIST_ITEMS: i64 = 256;
/// Most entries of a map field of a StreamJob's spec (labels, Kafka properties, ...).
pub const MAX_MAP_ENTRIES: i64 = 64;

/// Gives every string, list and map under `schema` a bound (where it has none yet), so the API
/// server refuses an oversized spec at apply and its CEL rules have a bounded cost.
fn bound(schema: &mut k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSONSchemaProps) {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
        JSONSchemaPropsOrArray, JSONSchemaPropsOrBool,
    };
    match schema.type_.as_deref() {
        Some("string") if schema.enum_.is_none() && schema.format.is_none() => {
            schema.max_length.get_or_insert(MAX_FIELD_BYTES);
        }
        Some("array") => {
            schema.max_items.get_or_insert(MAX_LIST_ITEMS);
        }
        Some("object") if schema.additional_properties.is_some() => {
            schema.max_properties.get_or_insert(MAX_MAP_ENTRIES);
        }
        _ => {}
    }
    for child in schema.properties.iter_mut().flat_map(|p| p.values_mut()) {
        bound(child);
    }
    match schema.items.as_mut() {
        Some(JSONSchemaPropsOrArray::Schema(item)) => bound(item),
        Some(JSONSchemaPropsOrArray::Schemas(items)) => items.iter_mut().for_each(bound),
        None => {}
    }
    if let Some(JSONSchemaPropsOrBool::Schema(values)) = schema.additional_properties.as_mut() {
        bound(values);
    }
    for alternatives in [&mut schema.any_of, &mut schema.one_of, &mut schema.all_of] {
        alternatives.iter_mut().flatten().for_each(bound);
    }
}

/// The CRD as YAML, with the header `crdgen` writes (the committed `crds/streamjob.yaml`).
pub fn crd_yaml() -> Result<String, serde_yaml::Error> {
    let body = serde_yaml::to_string(&crd())?;
    Ok(format!("# Generated by `cargo run -p weir-crds --bin crdgen -- --write`; do not edit.\n{body}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(yaml: &str) -> StreamJobSpec {
        let base = "image: weir-runtime:dev\nparallelism: 1\njob: { inline: { sources: [], sinks: [] } }\n";
        serde_yaml::from_str(&format!("{base}{yaml}")).unwrap()
    }

    fn paths(name: &str, yaml: &str) -> Vec<String> {
        spec_violations(name, &spec(yaml)).into_iter().map(|v| v.path).collect::<Vec<_>>()
    }

    #[test]
    fn the_operator_refuses_what_the_crd_rules_refuse() {
        assert!(paths("orders", "").is_empty());
        assert!(paths(&"j".repeat(MAX_NAME_LEN), "").is_empty());
        assert_eq!(paths(&"j".repeat(MAX_NAME_LEN + 1), ""), ["metadata.name"]);
        assert_eq!(paths("2orders", ""), ["metadata.name"]);
        assert_eq!(paths("orders.eu", ""), ["metadata.name"]);
        assert_eq!(paths("orders-", ""), ["metadata.name"]);
        assert_eq!(
            paths("orders", "savepoint: { timeout: 0s, periodicInterval: \"0\" }\ncheckpointing: { timeout: 0ms }"),
            ["spec.checkpointing.timeout", "spec.savepoint.timeout", "spec.savepoint.periodicInterval"]
        );
        assert_eq!(paths("orders", "relaunch: { backoff: 1m, maxBackoff: 30s }"), ["spec.relaunch"]);
        assert_eq!(
            paths(
                "orders",
                "podTemplate: { labels: { weir.dev/job: other, team: a, app.kubernetes.io/name: x }, \
                 annotations: { container.apparmor.security.beta.kubernetes.io/runtime: unconfined, note: a } }"
            ),
            [
                "spec.podTemplate.labels.app.kubernetes.io/name",
                "spec.podTemplate.labels.weir.dev/job",
                "spec.podTemplate.annotations.container.apparmor.security.beta.kubernetes.io/runtime"
            ]
        );
        assert_eq!(
            paths("orders", "initialSavepoint: s3://b/ns/../other/sp-1\ncheckpointing: { storage: \"s3://b//x\" }"),
            ["spec.checkpointing.storage", "spec.initialSavepoint"]
        );
        assert!(paths("orders", "initialSavepoint: s3://b/ns/j/savepoints/sp-1-2/").is_empty());
        let mut no_image = spec("");
        no_image.image = String::new();
        assert_eq!(spec_violations("orders", &no_image)[0].path, "spec.image");
    }

    #[test]
    fn the_name_rule_and_the_limit_agree() {
        assert!(NAME_RULE.contains(&format!("size() <= {MAX_NAME_LEN} ")));
        assert!(NAME_MESSAGE.contains(&format!("at most {MAX_NAME_LEN} ")));
    }
}
