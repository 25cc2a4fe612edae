//! The part of a runtime Pod the operator reads: metadata (name, labels, owner, uid, deletion)
//! and a few fields of its status (phase, reason, IP, how its containers terminated). Pods are
//! listed and watched as this type, so the rest of each Pod (its spec, conditions, images) is
//! skipped while parsing and never held: the watch cache keeps a few hundred bytes per job
//! instead of the 2.4 KiB a `Pod` value takes before any of its strings.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

use crate::children::{JOB_LABEL, SPEC_HASH_LABEL};

/// A runtime Pod as the operator sees it (`v1` `Pod`, most fields left out).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct RuntimePod {
    /// The Pod's metadata.
    pub metadata: ObjectMeta,
    /// What the kubelet reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<RuntimePodStatus>,
}

/// The fields of a Pod's status the operator reads.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RuntimePodStatus {
    /// `Pending`, `Running`, `Succeeded`, `Failed` or `Unknown`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// Why the pod is in this phase (`Evicted`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The pod's IP, once it has one.
    #[serde(default, rename = "podIP", skip_serializing_if = "Option::is_none")]
    pub pod_ip: Option<String>,
    /// One per container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub container_statuses: Vec<RuntimeContainerStatus>,
}

/// A container's status: only how it terminated, if it did.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct RuntimeContainerStatus {
    /// The container's current state.
    #[serde(default)]
    pub state: RuntimeContainerState,
}

/// A container's state: only its termination.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct RuntimeContainerState {
    /// Set once the container has exited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub terminated: Option<Terminated>,
}

/// How a container exited.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Terminated {
    /// The process's exit code.
    pub exit_code: i32,
    /// Why (`Error`, `OOMKilled`, `Completed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The termination message (the runtime's last words: why it failed, or its savepoint).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl k8s_openapi::Resource for RuntimePod {
    const API_VERSION: &'static str = "v1";
    const GROUP: &'static str = "";
    const KIND: &'static str = "Pod";
    const VERSION: &'static str = "v1";
    const URL_PATH_SEGMENT: &'static str = "pods";
    type Scope = k8s_openapi::NamespaceResourceScope;
}

impl k8s_openapi::Metadata for RuntimePod {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl RuntimePod {
    /// Drops what the operator never reads from the metadata (managed fields, annotations,
    /// labels other than the job's and the spec hash), for the watch cache.
    pub fn slim(&mut self) {
        let meta = &mut self.metadata;
        meta.managed_fields = None;
        meta.annotations = None;
        meta.generate_name = None;
        if let Some(labels) = meta.labels.take() {
            let kept: BTreeMap<String, String> =
                labels.into_iter().filter(|(k, _)| k == JOB_LABEL || k == SPEC_HASH_LABEL).collect();
            meta.labels = (!kept.is_empty()).then_some(kept);
        }
    }

    /// How each container terminated, for those that did.
    pub fn terminations(&self) -> impl Iterator<Item = &Terminated> {
        self.status.iter().flat_map(|s| &s.container_statuses).filter_map(|c| c.state.terminated.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Pod as the API server returns it: everything but what the operator reads is skipped.
    #[test]
    fn a_full_pod_parses_into_the_fields_the_operator_reads() {
        let json = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": "j-runtime-0", "namespace": "ns", "uid": "u-1",
                "labels": { JOB_LABEL: "j", SPEC_HASH_LABEL: "h1", "team": "a" },
                "annotations": { "note": "x" },
                "ownerReferences": [{ "apiVersion": "weir.dev/v1alpha1", "kind": "StreamJob", "name": "j",
                    "uid": "sj-1", "controller": true }],
                "managedFields": [{ "manager": "weir-operator", "operation": "Apply" }]
            },
            "spec": { "containers": [{ "name": "runtime", "image": "weir-runtime:dev" }] },
            "status": {
                "phase": "Failed", "podIP": "10.0.0.7", "qosClass": "Burstable",
                "conditions": [{ "type": "Ready", "status": "False" }],
                "containerStatuses": [{
                    "name": "runtime", "image": "weir-runtime:dev", "imageID": "x", "ready": false,
                    "restartCount": 0,
                    "state": { "terminated": { "exitCode": 1, "reason": "Error", "message": "boom",
                        "startedAt": "2026-12-08T00:00:00Z" } }
                }]
            }
        });
        let mut pod: RuntimePod = serde_json::from_value(json).unwrap();
        pod.slim();
        let status = pod.status.as_ref().unwrap();
        assert_eq!(status.phase.as_deref(), Some("Failed"));
        assert_eq!(status.pod_ip.as_deref(), Some("10.0.0.7"));
        let exit = pod.terminations().next().unwrap();
        assert_eq!((exit.exit_code, exit.reason.as_deref(), exit.message.as_deref()), (1, Some("Error"), Some("boom")));
        let labels = pod.metadata.labels.as_ref().unwrap();
        assert_eq!(labels.keys().collect::<Vec<_>>(), [JOB_LABEL, SPEC_HASH_LABEL]);
        assert_eq!(pod.metadata.annotations, None);
        assert_eq!(pod.metadata.managed_fields, None);
        assert_eq!(pod.metadata.owner_references.as_ref().unwrap()[0].uid, "sj-1");
    }

    #[test]
    fn a_new_pod_without_status_parses() {
        let pod: RuntimePod = serde_json::from_str(r#"{"metadata":{"name":"p"}}"#).unwrap();
        assert_eq!(pod.status, None);
        assert_eq!(pod.terminations().count(), 0);
    }

    #[test]
    fn the_value_is_far_smaller_than_a_pod() {
        let slim = std::mem::size_of::<RuntimePod>();
        let full = std::mem::size_of::<k8s_openapi::api::core::v1::Pod>();
        assert!(slim * 4 < full, "RuntimePod {slim} bytes, Pod {full}");
    }
}
