//! Helpers for the operator's tests against a real API server.

#![allow(dead_code)]

use std::time::Duration;

use kube::api::{Api, Patch, PatchParams};
use weir_crds::StreamJob;
use weir_e2e::local_pods::LocalPod;
use weir_operator::controller::CONTROL_URL_ANNOTATION;

pub use weir_e2e::eventually;

/// Waits for a local runtime process to exit (reporting it in its pod's status).
pub async fn wait_exit(pod: &mut LocalPod, what: &str, secs: u64) -> i32 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(code) = pod.reap().await.unwrap() {
            return code;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for: {what}; log:\n{}", pod.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub async fn point_operator_at(jobs: &Api<StreamJob>, name: &str, url: &str) {
    let patch = serde_json::json!({ "metadata": { "annotations": { CONTROL_URL_ANNOTATION: url } } });
    jobs.patch(name, &PatchParams::default(), &Patch::Merge(patch)).await.unwrap();
}

/// Reads a file sink directory of running counts (`{"k":..,"n":..}`) and checks that every
/// count of every key is there exactly once; returns the number of records.
pub fn assert_running_counts_exactly_once(dir: &std::path::Path) -> usize {
    let mut records = Vec::new();
    for f in std::fs::read_dir(dir).unwrap().flatten() {
        let name = f.file_name().to_string_lossy().to_string();
        if name.starts_with('.') || name.starts_with('_') {
            continue;
        }
        for line in std::fs::read_to_string(f.path()).unwrap().lines() {
            records.push(serde_json::from_str(line).unwrap());
        }
    }
    weir_e2e::cluster::assert_running_counts_exactly_once(&records)
}

/// The StreamJob the runtime-backed tests run: a rate-limited generator of `count` records
/// over 40 keys, a running count per key (`uid: counts`) and an exactly-once file sink in
/// `out`; `spec_extra` adds spec lines (two-space indented).
pub fn counter_job(count: u64, out: &std::path::Path, spec_extra: &str) -> StreamJob {
    let text = format!(
        r#"
apiVersion: weir.dev/v1alpha1
kind: StreamJob
metadata: {{ name: counter }}
spec:
  image: weir-runtime:dev
  parallelism: 1
{spec_extra}
  job:
    inline:
      sources: [ {{ name: events, uid: events,
                    generator: {{ count: {count}, ratePerSecond: 4000, fields: [ {{ name: k, modulo: 40 }} ] }} }} ]
      operators:
        - {{ name: by-k, keyBy: {{ fields: [k] }} }}
        - {{ name: counts, uid: counts, aggregate: {{ aggregates: [ {{ fn: count, as: n }} ] }} }}
      sinks: [ {{ name: out, uid: out, file: {{ path: {} }} }} ]
"#,
        out.display()
    );
    serde_yaml::from_str(&text).expect("valid test manifest")
}

/// Waits for `name` to be Degraded with `reason`; returns the condition's message.
pub async fn degraded(jobs: &Api<StreamJob>, name: &str, reason: &str) -> String {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let status = jobs.get(name).await.unwrap().status;
        let found =
            status.as_ref().and_then(|s| s.conditions.iter().find(|c| c.type_ == "Degraded" && c.status == "True"));
        match found {
            Some(c) if c.reason == reason => return c.message.clone(),
            _ if tokio::time::Instant::now() > deadline => panic!("{name} not Degraded with {reason}: {status:?}"),
            _ => tokio::time::sleep(std::time::Duration::from_millis(100)).await,
        }
    }
}

/// Waits for a Warning event with `reason` about `name`; returns its note.
pub async fn warning_event(client: &kube::Client, ns: &str, name: &str, reason: &str) -> String {
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), ns);
    eventually(&format!("a {reason} event on {name}"), 20, || async {
        events.list(&Default::default()).await.unwrap().items.into_iter().find_map(|e| {
            let about = e.regarding.as_ref()?.name.as_deref() == Some(name);
            (about && e.reason.as_deref() == Some(reason) && e.type_.as_deref() == Some("Warning"))
                .then_some(e.note)
                .flatten()
        })
    })
    .await
}
