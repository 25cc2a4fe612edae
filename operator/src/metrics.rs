//! The operator's Prometheus metrics (`weir_operator_*`) and its health endpoints, served on
//! one port: `/metrics`, `/healthz` (the process is alive), `/readyz` (the controller runs).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Counters and gauges of the operator.
#[derive(Debug, Default)]
pub struct OperatorMetrics {
    /// Reconciles run.
    pub reconciles: AtomicU64,
    /// Sum of reconcile durations, microseconds.
    pub reconcile_micros: AtomicU64,
    /// Failed reconciles by error category.
    pub errors: Mutex<BTreeMap<&'static str, u64>>,
    /// The phase of each job (`namespace/name` → phase).
    pub phases: Mutex<BTreeMap<String, String>>,
    /// Savepoints by outcome (`completed`, `failed`).
    pub savepoints: Mutex<BTreeMap<&'static str, u64>>,
    /// Relaunches after failures.
    pub relaunches: AtomicU64,
    /// Pods killed because a savepoint on cancel, suspend or delete failed.
    pub kills: AtomicU64,
    /// The controller is running (readiness).
    pub ready: AtomicBool,
    /// The most recent reconcile durations in microseconds (bounded), for percentiles.
    pub recent_micros: Mutex<std::collections::VecDeque<u64>>,
}

impl OperatorMetrics {
    /// Shared, empty metrics.
    pub fn shared() -> Arc<OperatorMetrics> {
        Arc::new(OperatorMetrics::default())
    }

    fn bump(map: &Mutex<BTreeMap<&'static str, u64>>, key: &'static str) {
        *map.lock().unwrap_or_else(|e| e.into_inner()).entry(key).or_default() += 1;
    }

    /// Records one reconcile's duration.
    pub fn observe_reconcile(&self, micros: u64) {
        self.reconciles.fetch_add(1, Ordering::Relaxed);
        self.reconcile_micros.fetch_add(micros, Ordering::Relaxed);
        let mut recent = self.recent_micros.lock().unwrap_or_else(|e| e.into_inner());
        if recent.len() >= 10_000 {
            recent.pop_front();
        }
        recent.push_back(micros);
    }

    /// The `q` quantile (0..=1) of recent reconcile durations, microseconds.
    pub fn reconcile_quantile(&self, q: f64) -> u64 {
        let mut v: Vec<u64> = self.recent_micros.lock().unwrap_or_else(|e| e.into_inner()).iter().copied().collect();
        if v.is_empty() {
            return 0;
        }
        v.sort_unstable();
        v[((v.len() - 1) as f64 * q).round() as usize]
    }

    /// Counts a failed reconcile.
    pub fn error(&self, category: &'static str) {
        Self::bump(&self.errors, category);
    }

    /// Counts a savepoint outcome.
    pub fn savepoint(&self, outcome: &'static str) {
        Self::bump(&self.savepoints, outcome);
    }

    /// Counts what an event on a StreamJob says happened (savepoints, relaunches, kills).
    pub fn event(&self, reason: crate::plan::EventReason) {
        use crate::plan::EventReason as R;
        match reason {
            R::SavepointCompleted => self.savepoint("completed"),
            R::SavepointFailedPodsKilled => {
                self.savepoint("failed");
                self.kills.fetch_add(1, Ordering::Relaxed);
            }
            R::SavepointFailed | R::UpgradeSavepointFailed => self.savepoint("failed"),
            R::Relaunching => {
                self.relaunches.fetch_add(1, Ordering::Relaxed);
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
            | R::ReconcileFailed => {}
        }
    }

    /// Records a job's phase (`None` when the job is gone).
    pub fn phase(&self, job: String, phase: Option<String>) {
        let mut phases = self.phases.lock().unwrap_or_else(|e| e.into_inner());
        match phase {
            Some(p) => {
                phases.insert(job, p);
            }
            None => {
                phases.remove(&job);
            }
        }
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP weir_operator_reconciles_total Reconciles run.\n\
             # TYPE weir_operator_reconciles_total counter\n\
             weir_operator_reconciles_total {}",
            self.reconciles.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP weir_operator_reconcile_seconds Reconcile durations (quantiles over recent reconciles).\n\
             # TYPE weir_operator_reconcile_seconds summary"
        );
        for q in [0.5, 0.9, 0.99] {
            let _ = writeln!(
                out,
                "weir_operator_reconcile_seconds{{quantile=\"{q}\"}} {:.6}",
                self.reconcile_quantile(q) as f64 / 1e6
            );
        }
        let _ = writeln!(
            out,
            "weir_operator_reconcile_seconds_sum {:.6}",
            self.reconcile_micros.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "weir_operator_reconcile_seconds_count {}", self.reconciles.load(Ordering::Relaxed));
        let _ = writeln!(
            out,
            "# HELP weir_operator_reconcile_errors_total Failed reconciles by category.\n\
             # TYPE weir_operator_reconcile_errors_total counter"
        );
        for (category, n) in self.errors.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = writeln!(out, "weir_operator_reconcile_errors_total{{category=\"{category}\"}} {n}");
        }
        let _ = writeln!(out, "# HELP weir_operator_jobs StreamJobs by phase.\n# TYPE weir_operator_jobs gauge");
        let mut by_phase: BTreeMap<String, u64> = BTreeMap::new();
        for p in self.phases.lock().unwrap_or_else(|e| e.into_inner()).values() {
            *by_phase.entry(p.clone()).or_default() += 1;
        }
        for (phase, n) in by_phase {
            let _ = writeln!(out, "weir_operator_jobs{{phase=\"{phase}\"}} {n}");
        }
        let _ = writeln!(
            out,
            "# HELP weir_operator_savepoints_total Savepoints by outcome.\n\
             # TYPE weir_operator_savepoints_total counter"
        );
        for (outcome, n) in self.savepoints.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = writeln!(out, "weir_operator_savepoints_total{{outcome=\"{outcome}\"}} {n}");
        }
        let _ = writeln!(
            out,
            "# HELP weir_operator_relaunches_total Relaunches after job failures.\n\
             # TYPE weir_operator_relaunches_total counter\n\
             weir_operator_relaunches_total {}",
            self.relaunches.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP weir_operator_pod_kills_total Pods killed after a failed savepoint.\n\
             # TYPE weir_operator_pod_kills_total counter\n\
             weir_operator_pod_kills_total {}",
            self.kills.load(Ordering::Relaxed)
        );
        out
    }
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `addr` from a thread of its own.
pub fn serve(addr: &str, metrics: Arc<OperatorMetrics>) -> std::io::Result<std::net::SocketAddr> {
    let server =
        tiny_http::Server::http(addr).map_err(|e| std::io::Error::new(std::io::ErrorKind::AddrInUse, e.to_string()))?;
    let bound = server.server_addr().to_ip().ok_or_else(|| std::io::Error::other("not an IP listener"))?;
    std::thread::Builder::new().name("weir-operator-http".into()).spawn(move || {
        for req in server.incoming_requests() {
            let (code, body) = match req.url() {
                "/metrics" => (200, metrics.render()),
                "/healthz" => (200, "ok\n".to_string()),
                "/readyz" if metrics.ready.load(Ordering::Relaxed) => (200, "ok\n".to_string()),
                "/readyz" => (503, "controller not running\n".to_string()),
                _ => (404, "not found\n".to_string()),
            };
            let _ = req.respond(tiny_http::Response::from_string(body).with_status_code(code));
        }
    })?;
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_phases() {
        let m = OperatorMetrics::default();
        m.reconciles.fetch_add(3, Ordering::Relaxed);
        m.error("kube-api");
        m.savepoint("failed");
        m.phase("a/x".into(), Some("Running".into()));
        m.phase("a/y".into(), Some("Running".into()));
        m.phase("a/z".into(), Some("Suspended".into()));
        m.phase("a/z".into(), None);
        let text = m.render();
        assert!(text.contains("weir_operator_reconciles_total 3"));
        assert!(text.contains("weir_operator_reconcile_errors_total{category=\"kube-api\"} 1"));
        assert!(text.contains("weir_operator_jobs{phase=\"Running\"} 2"));
        assert!(!text.contains("Suspended"));
        assert!(text.contains("weir_operator_savepoints_total{outcome=\"failed\"} 1"));
        m.observe_reconcile(250_000);
        assert!(m.render().contains("weir_operator_reconcile_seconds{quantile=\"0.5\"} 0.250000"));
    }

    #[test]
    fn serves_health_and_metrics() {
        let m = OperatorMetrics::shared();
        let addr = serve("127.0.0.1:0", m.clone()).unwrap();
        let get = |path: &str| {
            use std::io::{Read, Write};
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
            let mut r = String::new();
            s.read_to_string(&mut r).unwrap();
            r
        };
        assert!(get("/healthz").starts_with("HTTP/1.1 200"));
        assert!(get("/readyz").starts_with("HTTP/1.1 503"));
        m.ready.store(true, Ordering::Relaxed);
        assert!(get("/readyz").starts_with("HTTP/1.1 200"));
        assert!(get("/metrics").contains("weir_operator_reconciles_total 0"));
    }
}
