//! The operator's Prometheus metrics (`weir_operator_*`, prometheus-client's OpenMetrics text)
//! and its health endpoints, served by axum on one port: `/metrics`, `/healthz` (the process is
//! alive), `/readyz` (the controller runs).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

/// The `Content-Type` of [`OperatorMetrics::render`].
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The label of failed reconciles: the error's category.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CategoryLabel {
    category: String,
}

/// The label of the jobs gauge: a phase.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabel {
    phase: String,
}

/// The label of savepoints: how they ended.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: String,
}

/// Counters and gauges of the operator.
#[derive(Debug)]
pub struct OperatorMetrics {
    /// The controller is running (readiness).
    pub ready: AtomicBool,
    reconciles: Counter,
    reconcile_duration: Histogram,
    errors: Family<CategoryLabel, Counter>,
    jobs: Family<PhaseLabel, Gauge>,
    /// The phase of each job (`namespace/name` → phase), to move it between phases in `jobs`.
    phases: Mutex<BTreeMap<String, String>>,
    savepoints: Family<OutcomeLabel, Counter>,
    relaunches: Counter,
    kills: Counter,
    registry: Registry,
}

impl Default for OperatorMetrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("weir_operator");
        let metrics = OperatorMetrics {
            ready: AtomicBool::new(false),
            reconciles: Counter::default(),
            // 1 ms to about 65 s.
            reconcile_duration: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
            errors: Family::default(),
            jobs: Family::default(),
            phases: Mutex::new(BTreeMap::new()),
            savepoints: Family::default(),
            relaunches: Counter::default(),
            kills: Counter::default(),
            registry: Registry::default(),
        };
        registry.register("reconciles", "Reconciles run", metrics.reconciles.clone());
        registry.register_with_unit(
            "reconcile_duration",
            "Reconcile durations",
            Unit::Seconds,
            metrics.reconcile_duration.clone(),
        );
        registry.register("reconcile_errors", "Failed reconciles by error category", metrics.errors.clone());
        registry.register("jobs", "StreamJobs by phase", metrics.jobs.clone());
        registry.register("savepoints", "Savepoints by outcome", metrics.savepoints.clone());
        registry.register("relaunches", "Relaunches after job failures", metrics.relaunches.clone());
        registry.register("pod_kills", "Pods killed after a failed savepoint", metrics.kills.clone());
        OperatorMetrics { registry, ..metrics }
    }
}

impl OperatorMetrics {
    /// Shared, empty metrics.
    pub fn shared() -> Arc<OperatorMetrics> {
        Arc::new(OperatorMetrics::default())
    }

    /// Records one reconcile's duration.
    pub fn observe_reconcile(&self, took: Duration) {
        self.reconciles.inc();
        self.reconcile_duration.observe(took.as_secs_f64());
    }

    /// Counts a failed reconcile.
    pub fn error(&self, category: &'static str) {
        self.errors.get_or_create(&CategoryLabel { category: category.to_string() }).inc();
    }

    /// Counts a savepoint outcome.
    pub fn savepoint(&self, outcome: &'static str) {
        self.savepoints.get_or_create(&OutcomeLabel { outcome: outcome.to_string() }).inc();
    }

    /// Counts what an event on a StreamJob says happened (savepoints, relaunches, kills).
    pub fn event(&self, reason: crate::plan::EventReason) {
        use crate::plan::EventReason as R;
        match reason {
            R::SavepointCompleted => self.savepoint("completed"),
            R::SavepointFailedPodsKilled => {
                self.savepoint("failed");
                self.kills.inc();
            }
            R::SavepointFailed | R::UpgradeSavepointFailed => self.savepoint("failed"),
            R::Relaunching => {
                self.relaunches.inc();
            }
            R::Deploying
            | R::Upgrading
            | R::Upgraded
            | R::SavepointRequested
            | R::RelaunchLimitReached
            | R::CheckpointTooOld
            | R::OutputSuperseded
            | R::InvalidJob
            | R::MissingConfigMap
            | R::MissingSecret
            | R::MissingSavepoint
            | R::UpgradeRefused
            | R::IncompatibleSavepoint
            | R::ForbiddenCredentials
            | R::StorageNotAllowed
            | R::NameConflict
            | R::ForeignSavepoint
            | R::ForceDeleted
            | R::ReconcileFailed => {}
        }
    }

    /// Records a job's phase (`None` when the job is gone).
    pub fn phase(&self, job: String, phase: Option<String>) {
        let mut phases = self.phases.lock().unwrap_or_else(|e| e.into_inner());
        let before = match phase {
            Some(p) if phases.get(&job) == Some(&p) => return,
            Some(p) => {
                self.jobs.get_or_create(&PhaseLabel { phase: p.clone() }).inc();
                phases.insert(job, p)
            }
            None => phases.remove(&job),
        };
        if let Some(before) = before {
            self.jobs.get_or_create(&PhaseLabel { phase: before }).dec();
        }
    }

    /// The OpenMetrics text exposition (Prometheus reads it; see [`CONTENT_TYPE`]).
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// The health and metrics routes.
fn router(metrics: Arc<OperatorMetrics>) -> axum::Router {
    axum::Router::new()
        .route(
            "/metrics",
            get(|axum::extract::State(m): axum::extract::State<Arc<OperatorMetrics>>| async move {
                ([(header::CONTENT_TYPE, CONTENT_TYPE)], m.render())
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(|axum::extract::State(m): axum::extract::State<Arc<OperatorMetrics>>| async move {
                if m.ready.load(Ordering::Relaxed) {
                    (StatusCode::OK, "ok\n").into_response()
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "controller not running\n").into_response()
                }
            }),
        )
        .with_state(metrics)
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `addr` from a task on the current tokio
/// runtime; answers the bound address.
pub async fn serve(addr: &str, metrics: Arc<OperatorMetrics>) -> std::io::Result<std::net::SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router(metrics)).await {
            tracing::error!(error = %e, "the metrics and health endpoints stopped");
        }
    });
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_phases_and_a_histogram() {
        let m = OperatorMetrics::default();
        m.observe_reconcile(Duration::from_millis(250));
        m.observe_reconcile(Duration::from_millis(3));
        m.error("kube-api");
        m.savepoint("failed");
        m.phase("a/x".into(), Some("Running".into()));
        m.phase("a/y".into(), Some("Running".into()));
        m.phase("a/z".into(), Some("Suspended".into()));
        m.phase("a/z".into(), Some("Suspended".into()));
        m.phase("a/y".into(), Some("Degraded".into()));
        m.phase("a/z".into(), None);
        let text = m.render();
        assert!(text.contains("weir_operator_reconciles_total 2\n"), "{text}");
        assert!(text.contains("weir_operator_reconcile_errors_total{category=\"kube-api\"} 1\n"), "{text}");
        assert!(text.contains("weir_operator_jobs{phase=\"Running\"} 1\n"), "{text}");
        assert!(text.contains("weir_operator_jobs{phase=\"Degraded\"} 1\n"), "{text}");
        assert!(text.contains("weir_operator_jobs{phase=\"Suspended\"} 0\n"), "{text}");
        assert!(text.contains("weir_operator_savepoints_total{outcome=\"failed\"} 1\n"), "{text}");
        assert!(text.contains("weir_operator_reconcile_duration_seconds_count 2\n"), "{text}");
        assert!(text.contains("weir_operator_reconcile_duration_seconds_sum 0.253\n"), "{text}");
        assert!(text.contains("weir_operator_reconcile_duration_seconds_bucket{le=\"0.004\"} 1\n"), "{text}");
        assert!(text.contains("weir_operator_reconcile_duration_seconds_bucket{le=\"0.256\"} 2\n"), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[tokio::test]
    async fn serves_health_and_metrics() {
        let m = OperatorMetrics::shared();
        let addr = serve("127.0.0.1:0", m.clone()).await.unwrap();
        let http = reqwest::Client::builder().no_proxy().build().unwrap();
        let get = |path: &'static str| {
            let http = http.clone();
            async move {
                let r = http.get(format!("http://{addr}{path}")).send().await.unwrap();
                (r.status().as_u16(), r.text().await.unwrap())
            }
        };
        assert_eq!(get("/healthz").await.0, 200);
        assert_eq!(get("/readyz").await, (503, "controller not running\n".to_string()));
        m.ready.store(true, Ordering::Relaxed);
        assert_eq!(get("/readyz").await.0, 200);
        let (status, text) = get("/metrics").await;
        assert_eq!(status, 200);
        assert!(text.contains("weir_operator_reconciles_total 0"), "{text}");
        assert_eq!(get("/nowhere").await.0, 404);
    }
}
