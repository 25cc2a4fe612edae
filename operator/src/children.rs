//! The Kubernetes objects a StreamJob owns, built as plain values (no client): the job file
//! ConfigMap, the control API Service, the NetworkPolicy guarding it, and the runtime Pod.
//! Pods run under the restricted Pod Security profile: non-root, no privilege escalation, all
//! capabilities dropped, seccomp RuntimeDefault and a read-only root filesystem.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, EmptyDirVolumeSource, EnvFromSource,
    HTTPGetAction, Pod, PodSecurityContext, PodSpec, Probe, ResourceRequirements, SeccompProfile, SecretEnvSource,
    SecretVolumeSource, SecurityContext, Service, ServicePort, ServiceSpec, Volume, VolumeMount,
};
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort, NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::Resource;
use weir_crds::job::{CheckpointingSpec, JobSpec, RestartSpec, RestartStrategyKind, StateBackendKind};
use weir_crds::streamjob::{JobGraph, RestoreMode, SnapshotRef, StreamJob};

/// Port of the runtime's control API and metrics.
pub const CONTROL_PORT: i32 = 8081;
/// Label naming the job a pod belongs to.
pub const JOB_LABEL: &str = "weir.dev/job";
/// Label holding the spec hash the pod was built from.
pub const SPEC_HASH_LABEL: &str = "weir.dev/spec-hash";
/// Where the job file is mounted.
const JOB_DIR: &str = "/etc/weir/job";
/// Where the control token is mounted.
const TOKEN_DIR: &str = "/var/run/weir/token";
/// Non-root user of the runtime container.
const RUNTIME_UID: i64 = 65532;
/// Size limit of the runtime's scratch directory (`/tmp`: the rocksdb backend's files, staged
/// output): past it the kubelet evicts the pod instead of filling the node's disk.
pub const SCRATCH_SIZE_LIMIT: &str = "20Gi";

/// The runtime container's resources when `spec.resources` names none: a request the scheduler
/// can place, and a memory limit so that one job cannot take a node's memory from the others
/// (the runtime sizes its state budget from it).
pub fn default_resources() -> ResourceRequirements {
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    let q = |s: &str| Quantity(s.to_string());
    ResourceRequirements {
        requests: Some(BTreeMap::from([("cpu".to_string(), q("100m")), ("memory".to_string(), q("256Mi"))])),
        limits: Some(BTreeMap::from([("memory".to_string(), q("2Gi"))])),
        ..ResourceRequirements::default()
    }
}

/// Why children could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The StreamJob lacks a name, namespace or uid (not read from the API server).
    #[error("StreamJob has no {0}")]
    MissingMetadata(&'static str),
    /// The job graph could not be rendered.
    #[error("rendering the job file: {0}")]
    Render(String),
}

/// Names of a job's children.
pub fn config_map_name(job: &str) -> String {
    format!("{job}-job")
}
/// Name of the control Service.
pub fn service_name(job: &str) -> String {
    format!("{job}-control")
}
/// Name of the runtime pod.
pub fn pod_name(job: &str) -> String {
    format!("{job}-runtime-0")
}
/// Name of the Secret holding the control API token.
pub fn token_secret_name(job: &str) -> String {
    format!("{job}-control-token")
}

/// The token Secret's key holding the control API's bearer token.
pub const TOKEN_KEY: &str = "token";
/// The token Secret's key holding the certificate (PEM) the runtime serves the control API with,
/// which the operator issues and then trusts alone at the job's address.
pub const TLS_CERT_KEY: &str = "tls.crt";
/// The token Secret's key holding that certificate's private key (PEM).
pub const TLS_KEY_KEY: &str = "tls.key";

/// The names a job's control API certificate is issued for: its Service's, short and long (the
/// operator pins the certificate and does not check names; these are for people and tools).
pub fn control_names(job: &str, ns: &str) -> Vec<String> {
    let svc = service_name(job);
    vec![format!("{svc}.{ns}.svc"), format!("{svc}.{ns}.svc.cluster.local")]
}

/// The job's storage root: `<storage>/<namespace>/<name>`.
pub fn storage_root(storage: &str, namespace: &str, name: &str) -> String {
    format!("{}/{namespace}/{name}", storage.trim_end_matches('/'))
}

/// Labels every child carries.
pub fn labels(name: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".to_string(), "weir-runtime".to_string()),
        ("app.kubernetes.io/instance".to_string(), name.to_string()),
        ("app.kubernetes.io/managed-by".to_string(), "weir-operator".to_string()),
        (JOB_LABEL.to_string(), name.to_string()),
    ])
}

/// A stable hash of everything in the spec whose change needs a redeploy (the job, image,
/// parallelism, checkpointing, state backend, resources, pod overrides and the restart nonce),
/// as hex. The state backend counts only when set: jobs that never set it keep the hash they
/// had before the field existed, so upgrading the operator redeploys nothing.
pub fn spec_hash(sj: &StreamJob) -> String {
    let s = &sj.spec;
    let mut relevant = serde_json::json!({
        "image": s.image, "pull": s.image_pull_policy, "p": s.parallelism, "maxp": s.max_parallelism, "job": s.job,
        "ck": s.checkpointing, "restart": s.restart_nonce, "res": s.resources, "pod": s.pod_template,
    });
    if s.state_backend != StateBackendKind::Heap || s.state_cache_entries.is_some() {
        relevant["state"] = serde_json::json!([s.state_backend, s.state_cache_entries]);
    }
    let text = serde_json::to_string(&relevant).unwrap_or_default();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// The runtime job file for a StreamJob and its graph (inline, or read from the ConfigMap).
pub fn job_file(sj: &StreamJob, graph: &JobGraph, storage_root: &str) -> Result<String, BuildError> {
    let s = &sj.spec;
    let c = &s.checkpointing;
    let defaults = JobSpec::from_yaml("name: x\nsources: []\nsinks: []").expect("the smallest job file parses");
    let job = JobSpec {
        name: sj.metadata.name.clone().ok_or(BuildError::MissingMetadata("name"))?,
        parallelism: s.parallelism,
        max_parallelism: s.max_parallelism.unwrap_or(128),
        checkpointing: CheckpointingSpec {
            enabled: true,
            interval: c.interval,
            mode: c.mode,
            timeout: c.timeout,
            min_pause: c.min_pause,
            max_concurrent: c.max_concurrent,
            tolerable_failures: c.tolerable_failures,
            retained: c.retained,
            retention_on_cancel: c.retention_on_cancel,
            storage: Some(storage_root.to_string()),
            ..CheckpointingSpec::default()
        },
        // In-process restarts first; the operator relaunches when they are used up.
        restart: RestartSpec { strategy: RestartStrategyKind::ExponentialBackoff, ..RestartSpec::default() },
        state_backend: s.state_backend,
        state_cache_entries: s.state_cache_entries.unwrap_or(defaults.state_cache_entries),
        sources: graph.sources.clone(),
        operators: graph.operators.clone(),
        sinks: graph.sinks.clone(),
    };
    serde_yaml::to_string(&job).map_err(|e| BuildError::Render(e.to_string()))
}

fn meta(sj: &StreamJob, name: String, extra_labels: BTreeMap<String, String>) -> Result<ObjectMeta, BuildError> {
    let job = sj.metadata.name.clone().ok_or(BuildError::MissingMetadata("name"))?;
    let namespace = sj.metadata.namespace.clone().ok_or(BuildError::MissingMetadata("namespace"))?;
    let owner = sj.controller_owner_ref(&()).ok_or(BuildError::MissingMetadata("uid"))?;
    let mut l = labels(&job);
    l.extend(extra_labels);
    Ok(ObjectMeta {
        name: Some(name),
        namespace: Some(namespace),
        labels: Some(l),
        owner_references: Some(vec![owner]),
        ..ObjectMeta::default()
    })
}

/// The ConfigMap holding the job file.
pub fn config_map(sj: &StreamJob, job_yaml: String) -> Result<ConfigMap, BuildError> {
    let job = sj.metadata.name.clone().ok_or(BuildError::MissingMetadata("name"))?;
    Ok(ConfigMap {
        metadata: meta(sj, config_map_name(&job), BTreeMap::new())?,
        data: Some(BTreeMap::from([("job.yaml".to_string(), job_yaml)])),
        ..ConfigMap::default()
    })
}

/// Who may reach a job's control API (savepoints, stop, cancel, metrics) when NetworkPolicies
/// are enforced: the operator's pods, and any namespaces named for scraping metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ControlIngress {
    /// Namespace the operator runs in.
    pub operator_namespace: String,
    /// Labels of the operator's pods.
    pub operator_pod_labels: BTreeMap<String, String>,
    /// Further namespaces allowed in (e.g. `monitoring` for Prometheus).
    pub extra_namespaces: Vec<String>,
}

/// Name of the NetworkPolicy guarding the control API.
pub fn network_policy_name(job: &str) -> String {
    format!("{job}-control")
}

/// A NetworkPolicy that admits only `ingress` to the runtime pods' control port, and nothing
/// else to any other port of theirs.
pub fn network_policy(sj: &StreamJob, ingress: &ControlIngress) -> Result<NetworkPolicy, BuildError> {
    let job = sj.metadata.name.clone().ok_or(BuildError::MissingMetadata("name"))?;
    let namespace_is = |ns: &str| LabelSelector {
        match_labels: Some(BTreeMap::from([("kubernetes.io/metadata.name".to_string(), ns.to_string())])),
        ..LabelSelector::default()
    };
    let mut from = vec![NetworkPolicyPeer {
        namespace_selector: Some(namespace_is(&ingress.operator_namespace)),
        pod_selector: Some(LabelSelector {
            match_labels: Some(ingress.operator_pod_labels.clone()),
            ..LabelSelector::default()
        }),
        ..NetworkPolicyPeer::default()
    }];
    for ns in &ingress.extra_namespaces {
        from.push(NetworkPolicyPeer { namespace_selector: Some(namespace_is(ns)), ..NetworkPolicyPeer::default() });
    }
    Ok(NetworkPolicy {
        metadata: meta(sj, network_policy_name(&job), BTreeMap::new())?,
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some(BTreeMap::from([(JOB_LABEL.to_string(), job.clone())])),
                ..LabelSelector::default()
            }),
            policy_types: Some(vec!["Ingress".into()]),
            ingress: Some(vec![NetworkPolicyIngressRule {
                from: Some(from),
                ports: Some(vec![NetworkPolicyPort {
                    port: Some(IntOrString::Int(CONTROL_PORT)),
                    protocol: Some("TCP".into()),
                    ..NetworkPolicyPort::default()
                }]),
            }]),
            ..NetworkPolicySpec::default()
        }),
    })
}

/// The headless Service naming the control API (`<job>-control.<ns>.svc` → the pod).
pub fn service(sj: &StreamJob) -> Result<Service, BuildError> {
    let job = sj.metadata.name.clone().ok_or(BuildError::MissingMetadata("name"))?;
    Ok(Service {
        metadata: meta(sj, service_name(&job), BTreeMap::new())?,
        spec: Some(ServiceSpec {
            // Headless: the name resolves straight to the pod, and no cluster IP is used up per
            // job (a /24 service range would otherwise cap a cluster at ~250 jobs).
            cluster_ip: Some("None".into()),
            // The name resolves as soon as the pod has an IP, ready or not: the operator must
            // reach a runtime that is starting or failing too (to stop it with a savepoint),
            // and a name that appears only at readiness leaves a window of cached NXDOMAIN.
            publish_not_ready_addresses: Some(true),
            selector: Some(BTreeMap::from([(JOB_LABEL.to_string(), job.clone())])),
            ports: Some(vec![ServicePort {
                name: Some("control".into()),
                port: CONTROL_PORT,
                target_port: Some(IntOrString::Int(CONTROL_PORT)),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    })
}

/// The runtime pod, restoring as `mode` says: exactly `restore_from`, the newest valid restore
/// point in the job's storage, or no state.
pub fn pod(
    sj: &StreamJob,
    spec_hash: &str,
    storage_root: &str,
    restore_from: Option<&SnapshotRef>,
    mode: RestoreMode,
) -> Result<Pod, BuildError> {
    let s = &sj.spec;
    let job = sj.metadata.name.clone().ok_or(BuildError::MissingMetadata("name"))?;
    let overrides = s.pod_template.clone().unwrap_or_default();
    let mut extra = overrides.labels.clone();
    extra.insert(SPEC_HASH_LABEL.to_string(), spec_hash.to_string());
    let mut metadata = meta(sj, pod_name(&job), extra)?;
    if !overrides.annotations.is_empty() {
        metadata.annotations = Some(overrides.annotations.clone());
    }
    let restore: Vec<String> = match (mode, restore_from) {
        (RestoreMode::Snapshot, Some(r)) => vec!["--restore".into(), r.path.clone()],
        (RestoreMode::Fresh, _) => vec!["--fresh".into()],
        (RestoreMode::Latest, _) | (RestoreMode::Snapshot, None) => vec!["--restore".into(), "latest".into()],
    };
    let mut args =
        vec!["run".to_string(), format!("{JOB_DIR}/job.yaml"), "--checkpoint-dir".into(), storage_root.to_string()];
    args.extend(restore);
    args.extend([
        "--control-addr".into(),
        format!("0.0.0.0:{CONTROL_PORT}"),
        "--token-file".into(),
        format!("{TOKEN_DIR}/{TOKEN_KEY}"),
        "--tls-cert-file".into(),
        format!("{TOKEN_DIR}/{TLS_CERT_KEY}"),
        "--tls-key-file".into(),
        format!("{TOKEN_DIR}/{TLS_KEY_KEY}"),
        "--quiet".into(),
        "--termination-log".into(),
        "/dev/termination-log".into(),
        "--declared-env-prefix".into(),
        DECLARED_ENV_PREFIX.into(),
    ]);
    if s.allow_non_restored_state {
        args.push("--allow-non-restored-state".into());
    }
    let container = Container {
        name: "runtime".into(),
        image: Some(s.image.clone()),
        image_pull_policy: s.image_pull_policy.clone(),
        command: Some(vec!["weir-runtime".into()]),
        args: Some(args),
        ports: Some(vec![ContainerPort {
            name: Some("control".into()),
            container_port: CONTROL_PORT,
            ..ContainerPort::default()
        }]),
        env_from: env_from_secrets(s),
        resources: Some(s.resources.clone().unwrap_or_else(default_resources)),
        readiness_probe: Some(Probe {
            http_get: Some(HTTPGetAction {
                path: Some("/healthz".into()),
                port: IntOrString::Int(CONTROL_PORT),
                // The control API is served over TLS only (the kubelet does not check the
                // certificate; the operator does).
                scheme: Some("HTTPS".into()),
                ..HTTPGetAction::default()
            }),
            period_seconds: Some(5),
            ..Probe::default()
        }),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            run_as_non_root: Some(true),
            capabilities: Some(Capabilities { drop: Some(vec!["ALL".into()]), ..Capabilities::default() }),
            seccomp_profile: Some(SeccompProfile { type_: "RuntimeDefault".into(), ..SeccompProfile::default() }),
            ..SecurityContext::default()
        }),
        volume_mounts: Some(vec![
            VolumeMount {
                name: "job".into(),
                mount_path: JOB_DIR.into(),
                read_only: Some(true),
                ..VolumeMount::default()
            },
            VolumeMount {
                name: "token".into(),
                mount_path: TOKEN_DIR.into(),
                read_only: Some(true),
                ..VolumeMount::default()
            },
            VolumeMount { name: "scratch".into(), mount_path: "/tmp".into(), ..VolumeMount::default() },
        ]),
        working_dir: Some("/tmp".into()),
        ..Container::default()
    };
    Ok(Pod {
        metadata,
        spec: Some(PodSpec {
            containers: vec![container],
            // The operator decides about relaunches (from the newest *valid* checkpoint).
            restart_policy: Some("Never".into()),
            service_account_name: overrides.service_account_name.clone(),
            automount_service_account_token: Some(false),
            node_selector: (!overrides.node_selector.is_empty()).then(|| overrides.node_selector.clone()),
            tolerations: (!overrides.tolerations.is_empty()).then(|| overrides.tolerations.clone()),
            image_pull_secrets: (!overrides.image_pull_secrets.is_empty())
                .then(|| overrides.image_pull_secrets.clone()),
            security_context: Some(PodSecurityContext {
                run_as_non_root: Some(true),
                run_as_user: Some(RUNTIME_UID),
                run_as_group: Some(RUNTIME_UID),
                fs_group: Some(RUNTIME_UID),
                seccomp_profile: Some(SeccompProfile { type_: "RuntimeDefault".into(), ..SeccompProfile::default() }),
                ..PodSecurityContext::default()
            }),
            volumes: Some(vec![
                Volume {
                    name: "job".into(),
                    config_map: Some(ConfigMapVolumeSource {
                        name: config_map_name(&job),
                        ..ConfigMapVolumeSource::default()
                    }),
                    ..Volume::default()
                },
                Volume {
                    name: "token".into(),
                    secret: Some(SecretVolumeSource {
                        secret_name: Some(token_secret_name(&job)),
                        ..SecretVolumeSource::default()
                    }),
                    ..Volume::default()
                },
                Volume {
                    name: "scratch".into(),
                    empty_dir: Some(EmptyDirVolumeSource {
                        size_limit: Some(k8s_openapi::apimachinery::pkg::api::resource::Quantity(
                            SCRATCH_SIZE_LIMIT.into(),
                        )),
                        ..EmptyDirVolumeSource::default()
                    }),
                    ..Volume::default()
                },
            ]),
            ..PodSpec::default()
        }),
        ..Pod::default()
    })
}

/// The prefix under which the keys of `podTemplate.envFromSecrets` are set a second time: the
/// runtime (`--declared-env-prefix`) resolves a Kafka property's `${env:NAME}` only from
/// `<prefix>NAME`, so a job reads the Secrets it declares and nothing else of the runtime's
/// environment (its storage credentials above all).
pub const DECLARED_ENV_PREFIX: &str = "WEIR_SECRET_";

/// The Secrets whose keys the runtime container gets as environment variables: the
/// checkpoint storage credentials, then `podTemplate.envFromSecrets` (Kafka credentials and
/// the like) as they are and again with [`DECLARED_ENV_PREFIX`]. A missing Secret keeps the
/// pod from starting (`optional: false`).
fn env_from_secrets(s: &weir_crds::StreamJobSpec) -> Option<Vec<EnvFromSource>> {
    let from = |name: &str, prefix: Option<&str>| EnvFromSource {
        prefix: prefix.map(str::to_string),
        secret_ref: Some(SecretEnvSource { name: name.to_string(), optional: Some(false) }),
        ..EnvFromSource::default()
    };
    let declared: Vec<&str> =
        s.pod_template.iter().flat_map(|t| t.env_from_secrets.iter()).map(|r| r.name.as_str()).collect();
    let secrets: Vec<EnvFromSource> = s
        .checkpointing
        .credentials_secret
        .iter()
        .map(|r| from(&r.name, None))
        .chain(declared.iter().map(|name| from(name, None)))
        .chain(declared.iter().map(|name| from(name, Some(DECLARED_ENV_PREFIX))))
        .collect();
    (!secrets.is_empty()).then_some(secrets)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn network_policy_admits_only_the_operator_and_named_namespaces_to_the_control_port() {
        let ingress = ControlIngress {
            operator_namespace: "weir-system".into(),
            operator_pod_labels: BTreeMap::from([("app.kubernetes.io/name".to_string(), "weir-operator".to_string())]),
            extra_namespaces: vec!["monitoring".into()],
        };
        let np = network_policy(&sj(), &ingress).unwrap();
        assert_eq!(np.metadata.name.as_deref(), Some("orders-control"));
        let spec = np.spec.unwrap();
        assert_eq!(spec.pod_selector.unwrap().match_labels.unwrap()[JOB_LABEL], "orders");
        let rule = &spec.ingress.unwrap()[0];
        assert_eq!(rule.ports.as_ref().unwrap()[0].port, Some(IntOrString::Int(CONTROL_PORT)));
        let from = rule.from.as_ref().unwrap();
        assert_eq!(from.len(), 2);
        assert_eq!(
            from[0].namespace_selector.as_ref().unwrap().match_labels.as_ref().unwrap()["kubernetes.io/metadata.name"],
            "weir-system"
        );
        assert_eq!(
            from[0].pod_selector.as_ref().unwrap().match_labels.as_ref().unwrap()["app.kubernetes.io/name"],
            "weir-operator"
        );
        assert!(from[1].pod_selector.is_none(), "every pod of the monitoring namespace");
    }
    use weir_crds::streamjob::{JobSource, StreamJobSpec};

    fn sj() -> StreamJob {
        let spec: StreamJobSpec = serde_yaml::from_str(
            r#"
image: weir:dev
parallelism: 2
job:
  inline:
    sources: [ { name: s, uid: s, generator: { fields: [ { name: a, sequence: {} } ] } } ]
    sinks: [ { name: o, stdout: {} } ]
checkpointing: { interval: 5s, credentialsSecret: { name: s3-creds } }
podTemplate: { envFromSecrets: [ { name: kafka-creds } ] }
"#,
        )
        .unwrap();
        let mut sj = StreamJob::new("orders", spec);
        sj.metadata.namespace = Some("shop".into());
        sj.metadata.uid = Some("1234".into());
        sj
    }

    #[test]
    fn pod_is_restricted_owned_labelled_and_restores() {
        let sj = sj();
        let root = storage_root("s3://bucket/weir/", "shop", "orders");
        assert_eq!(root, "s3://bucket/weir/shop/orders");
        let p = pod(
            &sj,
            "abc",
            &root,
            Some(&SnapshotRef {
                id: 3,
                path: "s3://bucket/weir/shop/orders/savepoints/sp-1-3".into(),
                completed_at: None,
            }),
            RestoreMode::Snapshot,
        )
        .unwrap();
        let labels = p.metadata.labels.as_ref().unwrap();
        assert_eq!(labels[SPEC_HASH_LABEL], "abc");
        assert_eq!(labels[JOB_LABEL], "orders");
        assert_eq!(p.metadata.owner_references.as_ref().unwrap()[0].uid, "1234");
        let spec = p.spec.unwrap();
        let c = &spec.containers[0];
        let sc = c.security_context.as_ref().unwrap();
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(sc.read_only_root_filesystem, Some(true));
        assert_eq!(sc.capabilities.as_ref().unwrap().drop.as_ref().unwrap(), &vec!["ALL".to_string()]);
        assert_eq!(spec.security_context.as_ref().unwrap().run_as_non_root, Some(true));
        let args = c.args.as_ref().unwrap().join(" ");
        assert!(args.contains("--restore s3://bucket/weir/shop/orders/savepoints/sp-1-3"), "{args}");
        assert!(args.contains("--checkpoint-dir s3://bucket/weir/shop/orders"), "{args}");
        let secrets: Vec<(&str, Option<&str>)> = c
            .env_from
            .iter()
            .flatten()
            .map(|e| (e.secret_ref.as_ref().unwrap().name.as_str(), e.prefix.as_deref()))
            .collect();
        assert_eq!(
            secrets,
            [("s3-creds", None), ("kafka-creds", None), ("kafka-creds", Some(DECLARED_ENV_PREFIX))],
            "storage credentials, then podTemplate.envFromSecrets, and again as the declared variables"
        );
        assert!(args.contains(&format!("--declared-env-prefix {DECLARED_ENV_PREFIX}")), "{args}");
        // The control API over TLS, with the certificate and key of the job's token Secret.
        assert!(args.contains("--tls-cert-file /var/run/weir/token/tls.crt"), "{args}");
        assert!(args.contains("--tls-key-file /var/run/weir/token/tls.key"), "{args}");
        let probe = c.readiness_probe.as_ref().unwrap().http_get.as_ref().unwrap();
        assert_eq!(probe.scheme.as_deref(), Some("HTTPS"));
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        let latest = pod(&sj, "abc", &root, None, RestoreMode::Latest).unwrap();
        let fresh = pod(&sj, "abc", &root, None, RestoreMode::Fresh).unwrap();
        let fresh_args = fresh.spec.unwrap().containers[0].args.clone().unwrap().join(" ");
        assert!(fresh_args.contains("--fresh") && !fresh_args.contains("--restore"), "{fresh_args}");
        assert!(latest.spec.unwrap().containers[0].args.as_ref().unwrap().join(" ").contains("--restore latest"));
    }

    #[test]
    fn job_file_is_a_valid_runtime_job() {
        let sj = sj();
        let JobSource { inline: Some(graph), .. } = &sj.spec.job else { panic!() };
        let text = job_file(&sj, graph, "s3://b/shop/orders").unwrap();
        let job = weir_crds::JobSpec::from_yaml(&text).unwrap();
        weir_crds::validate(&job).unwrap();
        assert_eq!(job.name, "orders");
        assert_eq!(job.checkpointing.interval.as_millis(), 5000);
        assert_eq!(job.checkpointing.storage.as_deref(), Some("s3://b/shop/orders"));
    }

    #[test]
    fn spec_hash_changes_with_the_restart_nonce_but_not_with_the_desired_state() {
        let a = sj();
        let mut b = sj();
        b.spec.state = weir_crds::streamjob::DesiredState::Suspended;
        assert_eq!(spec_hash(&a), spec_hash(&b));
        b.spec.restart_nonce = Some(1);
        assert_ne!(spec_hash(&a), spec_hash(&b));
        // A change of state backend redeploys (through a savepoint, whose format both read).
        let mut c = sj();
        c.spec.state_backend = StateBackendKind::Rocksdb;
        assert_ne!(spec_hash(&a), spec_hash(&c));
        c.spec.state_backend = StateBackendKind::Heap;
        assert_eq!(spec_hash(&a), spec_hash(&c), "the default backend hashes as an unset field did");
        c.spec.state_cache_entries = Some(5000);
        assert_ne!(spec_hash(&a), spec_hash(&c));
        assert_eq!(service(&a).unwrap().spec.unwrap().ports.unwrap()[0].port, CONTROL_PORT);
        assert!(config_map(&a, "x".into()).unwrap().data.unwrap().contains_key("job.yaml"));
    }
}
