//! The validate step of a reconcile: reads what a StreamJob refers to (the job graph's
//! ConfigMap, the credentials Secret, the initial savepoint) and checks the whole job as the
//! runtime would, CEL expressions included. The outcome is the job file to deploy, or an
//! [`Invalid`] naming the field and the reason: the job is then reported Degraded and nothing is
//! deployed (a missing reference is not an error to retry in a loop, but an input a person
//! fixes; the watch on the StreamJob, and a slow requeue for referenced objects, pick up the fix).

use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::Api;
use weir_checkpoint::metadata::CheckpointMetadata;
use weir_checkpoint::Storage;
use weir_crds::streamjob::{JobGraph, StreamJob};
use weir_crds::ValidatedJob;

use crate::children;
use crate::plan::EventReason;
use crate::tenancy::{self, StorageIdentity, StoragePolicy};

/// Longest job file the operator renders into the job's ConfigMap (a ConfigMap holds at most
/// 1 MiB, and the whole StreamJob is written back with every status update).
pub const MAX_JOB_FILE_BYTES: usize = 256 << 10;

/// Why a StreamJob cannot be deployed as it stands. The reason is the Degraded condition's
/// reason and the Warning event's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InvalidReason {
    /// The spec or the job graph breaks a rule (field path in the message).
    InvalidJob,
    /// `spec.job.configMapRef` names a ConfigMap (or key) that does not exist.
    MissingConfigMap,
    /// `spec.checkpointing.credentialsSecret` names a Secret that does not exist.
    MissingSecret,
    /// `spec.initialSavepoint` names a path holding no savepoint.
    MissingSavepoint,
    /// `spec.initialSavepoint` holds state the job cannot read (other aggregates or kind of
    /// operator under a uid, a uid the job does not have, another maxParallelism).
    IncompatibleSavepoint,
    /// The credentials Secret has keys Weir does not take (they could steer where credentials
    /// come from).
    ForbiddenCredentials,
    /// `spec.checkpointing.storage` or `spec.initialSavepoint` is outside the storage the
    /// job's namespace may use.
    StorageNotAllowed,
}

impl InvalidReason {
    /// The Degraded condition's reason and the Warning event's.
    pub fn event_reason(self) -> EventReason {
        match self {
            InvalidReason::InvalidJob => EventReason::InvalidJob,
            InvalidReason::MissingConfigMap => EventReason::MissingConfigMap,
            InvalidReason::MissingSecret => EventReason::MissingSecret,
            InvalidReason::MissingSavepoint => EventReason::MissingSavepoint,
            InvalidReason::IncompatibleSavepoint => EventReason::IncompatibleSavepoint,
            InvalidReason::ForbiddenCredentials => EventReason::ForbiddenCredentials,
            InvalidReason::StorageNotAllowed => EventReason::StorageNotAllowed,
        }
    }
}

/// A StreamJob that cannot be deployed: why, and a message naming the field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Invalid {
    /// The class of problem.
    pub reason: InvalidReason,
    /// `<field path>: <what is wrong>`, one line per problem.
    pub message: String,
}

impl Invalid {
    fn new(reason: InvalidReason, message: impl Into<String>) -> Invalid {
        Invalid { reason, message: message.into() }
    }
}

/// A read of a referenced object failed for a reason other than its absence (a transient API
/// error, or storage that cannot be reached): retried with backoff.
#[derive(Debug, thiserror::Error)]
pub enum InputsError {
    /// Reading the ConfigMap or Secret failed.
    #[error("reading {what}: {source}")]
    Read {
        /// The object, e.g. `ConfigMap jobs`.
        what: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// The storage holding the initial savepoint could not be read.
    #[error("reading the initial savepoint {path}: {source}")]
    Savepoint {
        /// The savepoint path.
        path: String,
        /// The storage error.
        #[source]
        source: weir_checkpoint::StorageError,
    },
    /// The storage holding the initial savepoint (the tenant's own) did not answer in time.
    #[error("reading the initial savepoint {path}: no answer within {after:?}")]
    SavepointTimeout {
        /// The savepoint path.
        path: String,
        /// The bound ([`tenancy::TENANT_STORAGE_TIMEOUT`]).
        after: std::time::Duration,
    },
    /// The job file could not be rendered.
    #[error(transparent)]
    Build(#[from] children::BuildError),
}

/// The job file to deploy, or why the job cannot be deployed.
pub type Verdict = Result<String, Invalid>;

/// What the validate step read and concluded.
pub struct Inputs {
    /// Deploy this job file, or report why not.
    pub verdict: Verdict,
    /// Whose identity reads the job's checkpoint storage: the operator's within the
    /// namespace's roots, else the job's credentials Secret; `None` (with the verdict saying
    /// why) when neither may.
    pub storage: Option<StorageIdentity>,
    /// The job file of the verdict, validated: what its operators' state holds is compared
    /// with the job's checkpoints before an upgrade or a resume.
    pub job: Option<ValidatedJob>,
}

/// Validates a StreamJob and what it refers to. `first_deploy`: no run has started yet, so the
/// initial savepoint (if any) is what the first pod will restore, and it must exist.
pub async fn validate(
    client: &kube::Client,
    sj: &StreamJob,
    ns: &str,
    storage_root: &str,
    policy: &StoragePolicy,
    first_deploy: bool,
) -> Result<Inputs, InputsError> {
    let credentials = credentials(client, sj, ns).await?;
    let storage = match &credentials {
        Ok(keys) => tenancy::storage_identity(policy, ns, STORAGE_FIELD, storage_root, keys.as_deref())
            .map_err(|why| Invalid::new(InvalidReason::StorageNotAllowed, why)),
        Err(invalid) => Err(invalid.clone()),
    };
    let keys = credentials.as_ref().ok().and_then(|keys| keys.as_deref());
    let checked = match &storage {
        Ok(_) => verdict(client, sj, ns, storage_root, policy, first_deploy, keys).await?,
        Err(invalid) => Err(invalid.clone()),
    };
    let (verdict, job) = match checked {
        Ok((job_yaml, job)) => (Ok(job_yaml), Some(job)),
        Err(invalid) => (Err(invalid), None),
    };
    Ok(Inputs { verdict, storage: storage.ok(), job })
}

/// How a job's root is named in messages (`<storage>/<namespace>/<name>`).
const STORAGE_FIELD: &str = "spec.checkpointing.storage (the job's root)";

/// The allow-listed keys of the credentials Secret (`None` when the job names none), or why
/// the job cannot use it: missing, or with keys Weir does not take.
async fn credentials(
    client: &kube::Client,
    sj: &StreamJob,
    ns: &str,
) -> Result<Result<Option<Vec<(String, String)>>, Invalid>, InputsError> {
    let Some(secret) = sj.spec.checkpointing.credentials_secret.as_ref().map(|r| r.name.as_str()) else {
        return Ok(Ok(None));
    };
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let found = secrets
        .get_opt(secret)
        .await
        .map_err(|source| InputsError::Read { what: format!("Secret {secret}"), source })?;
    let Some(found) = found else {
        return Ok(Err(Invalid::new(
            InvalidReason::MissingSecret,
            format!("spec.checkpointing.credentialsSecret.name: Secret `{secret}` not found in namespace {ns}"),
        )));
    };
    let data = found.data.unwrap_or_default().into_iter().map(|(k, v)| (k, v.0)).collect();
    Ok(tenancy::credential_env(&data).map(Some).map_err(|refused| {
        Invalid::new(InvalidReason::ForbiddenCredentials, tenancy::refused_keys_message(secret, &refused))
    }))
}

async fn verdict(
    client: &kube::Client,
    sj: &StreamJob,
    ns: &str,
    storage_root: &str,
    policy: &StoragePolicy,
    first_deploy: bool,
    keys: Option<&[(String, String)]>,
) -> Result<Result<(String, ValidatedJob), Invalid>, InputsError> {
    let name = sj.metadata.name.as_deref().unwrap_or_default();
    let spec_problems = weir_crds::streamjob::spec_violations(name, &sj.spec);
    if !spec_problems.is_empty() {
        let lines: Vec<String> = spec_problems.iter().map(ToString::to_string).collect();
        return Ok(Err(Invalid::new(InvalidReason::InvalidJob, lines.join("\n"))));
    }
    let graph = match job_graph(client, sj, ns).await? {
        Ok(graph) => graph,
        Err(invalid) => return Ok(Err(invalid)),
    };
    let job_yaml = children::job_file(sj, &graph, storage_root)?;
    if job_yaml.len() > MAX_JOB_FILE_BYTES {
        return Ok(Err(Invalid::new(
            InvalidReason::InvalidJob,
            format!(
                "spec.job: the job file is {} KiB; at most {} KiB are allowed",
                job_yaml.len() >> 10,
                MAX_JOB_FILE_BYTES >> 10
            ),
        )));
    }
    let checked = match weir_crds::JobSpec::from_yaml(&job_yaml) {
        Ok(spec) => weir_crds::validate(&spec).map_err(|errors| {
            let lines: Vec<String> =
                errors.0.iter().map(|v| format!("{}: {}", manifest_path(&v.path, sj), v.message)).collect();
            lines.join("\n")
        }),
        Err(e) => Err(e.to_string()),
    };
    let job = match checked {
        Ok(job) => job,
        Err(problems) => return Ok(Err(Invalid::new(InvalidReason::InvalidJob, problems))),
    };
    if let (true, Some(path)) = (first_deploy, &sj.spec.initial_savepoint) {
        // Held to the namespace's storage before anything is read: a refusal says nothing of
        // whether the path exists or what it holds.
        let identity = match tenancy::storage_identity(policy, ns, "spec.initialSavepoint", path, keys) {
            Ok(identity) => identity,
            Err(why) => return Ok(Err(Invalid::new(InvalidReason::StorageNotAllowed, why))),
        };
        let metadata = identity
            .bounded(savepoint_metadata(path, &identity))
            .await
            .map_err(|after| InputsError::SavepointTimeout { path: path.clone(), after })?
            .map_err(|source| InputsError::Savepoint { path: path.clone(), source })?;
        let refused = match metadata {
            None => Some((
                InvalidReason::MissingSavepoint,
                format!("no savepoint or checkpoint at {path} (it has no _metadata)"),
            )),
            Some(Err(e)) => Some((InvalidReason::MissingSavepoint, format!("{path}/_metadata is unreadable: {e}"))),
            Some(Ok(m)) => initial_state_conflict(&job, &m, sj.spec.allow_non_restored_state)
                .map(|why| (InvalidReason::IncompatibleSavepoint, format!("{path} does not fit this job: {why}"))),
        };
        if let Some((reason, why)) = refused {
            return Ok(Err(Invalid::new(reason, format!("spec.initialSavepoint: {why}"))));
        }
    }
    Ok(Ok((job_yaml, job)))
}

/// The job graph: inline, or from its ConfigMap key.
async fn job_graph(client: &kube::Client, sj: &StreamJob, ns: &str) -> Result<Result<JobGraph, Invalid>, InputsError> {
    if let Some(inline) = &sj.spec.job.inline {
        return Ok(Ok(inline.clone()));
    }
    let r = sj.spec.job.config_map_ref.clone().unwrap_or_default();
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let cm = cms
        .get_opt(&r.name)
        .await
        .map_err(|source| InputsError::Read { what: format!("ConfigMap {}", r.name), source })?;
    let Some(cm) = cm else {
        return Ok(Err(Invalid::new(
            InvalidReason::MissingConfigMap,
            format!("spec.job.configMapRef.name: ConfigMap `{}` not found in namespace {ns}", r.name),
        )));
    };
    let Some(text) = cm.data.and_then(|d| d.get(&r.key).cloned()) else {
        return Ok(Err(Invalid::new(
            InvalidReason::MissingConfigMap,
            format!("spec.job.configMapRef.key: ConfigMap `{}` has no key `{}`", r.name, r.key),
        )));
    };
    Ok(match weir_crds::JobSpec::from_yaml(&text) {
        Ok(spec) => Ok(JobGraph { sources: spec.sources, operators: spec.operators, sinks: spec.sinks }),
        Err(e) => Err(Invalid::new(
            InvalidReason::InvalidJob,
            format!("spec.job.configMapRef: ConfigMap `{}` key `{}` is not a job file: {e}", r.name, r.key),
        )),
    })
}

/// The `_metadata` of the snapshot at `path`: `None` when there is none, why not inside when
/// it is too large to read or does not decode (as a restore reads it,
/// [`weir_checkpoint::recovery::read_metadata`]).
async fn savepoint_metadata(
    path: &str,
    identity: &StorageIdentity,
) -> Result<Option<Result<CheckpointMetadata, String>>, weir_checkpoint::StorageError> {
    use weir_checkpoint::recovery::{read_metadata, Verdict};
    let Some(storage) = Storage::open_for(path, identity.settings())? else { return Ok(None) };
    Ok(match read_metadata(&storage, "").await? {
        Ok(metadata) => Some(Ok(metadata)),
        Err(Verdict::Invalid(why)) => Some(Err(why)),
        Err(Verdict::Incomplete | Verdict::Valid) => None,
    })
}

/// Why `job` cannot start from the snapshot of `metadata` (the checks the runtime makes when
/// it restores, made before anything is deployed).
fn initial_state_conflict(
    job: &ValidatedJob,
    metadata: &CheckpointMetadata,
    allow_non_restored: bool,
) -> Option<String> {
    use weir_crds::compat::{max_parallelism_conflict, restore_conflict};
    let held = metadata.operators.iter().map(|(uid, op)| (uid.clone(), op.state_layout.clone())).collect();
    max_parallelism_conflict(metadata.max_parallelism, job.spec.max_parallelism)
        .or_else(|| restore_conflict(job, &held, allow_non_restored).err())
}

/// Where a job-file field path (`job.operators[0].filter.expr`) is in the StreamJob: under
/// `spec.job.inline`, or in the ConfigMap key; settings the operator renders come from `spec`.
pub fn manifest_path(path: &str, sj: &StreamJob) -> String {
    let rest = path.strip_prefix("job.").unwrap_or(path);
    let graph = ["sources", "operators", "sinks"].iter().any(|g| rest.starts_with(g));
    match (&sj.spec.job.config_map_ref, graph) {
        (Some(r), true) => format!("ConfigMap {} key {}: {rest}", r.name, r.key),
        (None, true) => format!("spec.job.inline.{rest}"),
        (_, false) if rest == "name" => "metadata.name".to_string(),
        (_, false) => format!("spec.{rest}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_file_paths_name_the_manifest_field() {
        let inline: StreamJob = serde_yaml::from_str(
            "apiVersion: weir.dev/v1alpha1\nkind: StreamJob\nmetadata: { name: j }\n\
             spec: { image: i, parallelism: 1, job: { inline: { sources: [], sinks: [] } } }",
        )
        .unwrap();
        let from_cm: StreamJob = serde_yaml::from_str(
            "apiVersion: weir.dev/v1alpha1\nkind: StreamJob\nmetadata: { name: j }\n\
             spec: { image: i, parallelism: 1, job: { configMapRef: { name: jobs } } }",
        )
        .unwrap();
        assert_eq!(manifest_path("job.operators[0].filter.expr", &inline), "spec.job.inline.operators[0].filter.expr");
        assert_eq!(manifest_path("job.sinks[1].uid", &from_cm), "ConfigMap jobs key job.yaml: sinks[1].uid");
        assert_eq!(manifest_path("job.checkpointing.interval", &from_cm), "spec.checkpointing.interval");
        assert_eq!(manifest_path("job.name", &inline), "metadata.name");
    }
}
