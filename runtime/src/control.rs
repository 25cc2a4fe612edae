//! The control API: HTTP/JSON on the coordinator, and Prometheus metrics on the same port.
//!
//! | method | path                      | what                                       |
//! |--------|---------------------------|--------------------------------------------|
//! | GET    | `/v1/job`                 | job status                                 |
//! | GET    | `/v1/checkpoints`         | checkpoint history, newest first           |
//! | GET    | `/v1/checkpoints/latest`  | the newest completed checkpoint (404 none) |
//! | POST   | `/v1/savepoints`          | trigger a savepoint → request id (`{"wait":true}`: answer when done) |
//! | GET    | `/v1/savepoints/{id}`     | a savepoint request's status               |
//! | POST   | `/v1/stop`                | stop with a savepoint (`{"drain":true}`)   |
//! | POST   | `/v1/cancel`              | cancel without a savepoint                 |
//! | GET    | `/metrics`                | Prometheus text                            |
//! | GET    | `/healthz`                | liveness (no token needed)                 |
//!
//! When a token is configured every request but `/healthz` needs `Authorization: Bearer <token>`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Sender;
use serde::Serialize;
use weir_crds::control::{ApiError, CheckpointHistory, JobStatus, SavepointRequest};

use crate::executor::Request;
use crate::metrics::JobMetrics;

/// A running control server.
pub struct ControlServer {
    server: Arc<tiny_http::Server>,
    thread: Option<std::thread::JoinHandle<()>>,
    in_flight: Arc<std::sync::atomic::AtomicUsize>,
    /// The bound address.
    pub addr: std::net::SocketAddr,
}

impl ControlServer {
    /// Waits (up to `timeout`) for requests being answered, e.g. a `wait: true` stop request
    /// whose answer is the savepoint the job just stopped with.
    pub fn drain(&self, timeout: Duration) {
        let deadline = std::time::Instant::now() + timeout;
        while self.in_flight.load(Ordering::Acquire) > 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn json<T: Serialize>(status: u16, body: &T) -> tiny_http::Response<std::io::Cursor<Vec<u8>>> {
    let data = serde_json::to_vec_pretty(body).unwrap_or_default();
    tiny_http::Response::from_data(data).with_status_code(status).with_header(
        tiny_http::Header::from_bytes(&b"Content-Type"[..], &b"application/json"[..]).expect("static header"),
    )
}

fn error(status: u16, msg: &str) -> tiny_http::Response<std::io::Cursor<Vec<u8>>> {
    json(status, &ApiError { error: msg.to_string() })
}

/// Starts serving on `addr` (e.g. `127.0.0.1:8081`, port 0 for any).
pub fn serve(
    addr: &str,
    token: Option<String>,
    metrics: Arc<JobMetrics>,
    requests: Sender<Request>,
) -> std::io::Result<ControlServer> {
    let server = Arc::new(
        tiny_http::Server::http(addr).map_err(|e| std::io::Error::new(std::io::ErrorKind::AddrInUse, e.to_string()))?,
    );
    let bound = server.server_addr().to_ip().ok_or_else(|| std::io::Error::other("not an IP listener"))?;
    let s = server.clone();
    let in_flight = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = in_flight.clone();
    let token: Option<Arc<str>> = token.map(Arc::from);
    let thread = std::thread::Builder::new().name("weir-control".into()).spawn(move || {
        for mut req in s.incoming_requests() {
            // One thread per request: a waiting savepoint request must not block status reads.
            counter.fetch_add(1, Ordering::AcqRel);
            let (token, metrics, requests, done) = (token.clone(), metrics.clone(), requests.clone(), counter.clone());
            let spawned = std::thread::Builder::new().name("weir-control-req".into()).spawn(move || {
                let response = handle(&mut req, token.as_deref(), &metrics, &requests);
                let _ = req.respond(response);
                done.fetch_sub(1, Ordering::AcqRel);
            });
            if spawned.is_err() {
                counter.fetch_sub(1, Ordering::AcqRel);
            }
        }
    })?;
    Ok(ControlServer { server, thread: Some(thread), in_flight, addr: bound })
}

fn authorized(req: &tiny_http::Request, token: Option<&str>) -> bool {
    let Some(token) = token else { return true };
    req.headers().iter().any(|h| {
        h.field.equiv("Authorization")
            && h.value
                .as_str()
                .strip_prefix("Bearer ")
                .is_some_and(|t| constant_time_eq(t.trim().as_bytes(), token.as_bytes()))
    })
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn handle(
    req: &mut tiny_http::Request,
    token: Option<&str>,
    metrics: &JobMetrics,
    requests: &Sender<Request>,
) -> tiny_http::Response<std::io::Cursor<Vec<u8>>> {
    use tiny_http::Method;
    let path = req.url().split('?').next().unwrap_or("").to_string();
    if path == "/healthz" {
        return json(200, &serde_json::json!({"ok": true}));
    }
    if !authorized(req, token) {
        return error(401, "missing or wrong bearer token");
    }
    match (req.method(), path.as_str()) {
        (Method::Get, "/v1/job") => {
            let board = metrics.board();
            let status = JobStatus {
                name: metrics.name.clone(),
                job_id: metrics.job_id.clone(),
                state: board.state,
                restarts: metrics.restarts.load(Ordering::Relaxed) as u32,
                records_in: metrics.records_in.load(Ordering::Relaxed),
                records_out: metrics.records_out.load(Ordering::Relaxed),
                latest_checkpoint: board
                    .history
                    .iter()
                    .find(|c| c.outcome == weir_crds::control::CheckpointOutcome::Completed)
                    .cloned(),
                restored_from: board.restored_from.clone(),
                epoch: board.epoch,
                notices: board.notices.clone(),
                last_error: board.last_error.clone(),
                injected_faults: metrics.injected_faults.load(Ordering::Relaxed),
            };
            json(200, &status)
        }
        (Method::Get, "/v1/checkpoints") => {
            let board = metrics.board();
            json(
                200,
                &CheckpointHistory {
                    checkpoints: board.history.iter().cloned().collect(),
                    completed: metrics.checkpoints_completed.load(Ordering::Relaxed),
                    failed: metrics.checkpoints_failed.load(Ordering::Relaxed),
                },
            )
        }
        (Method::Get, "/v1/checkpoints/latest") => match metrics.latest_completed() {
            Some(c) => json(200, &c),
            None => error(404, "no checkpoint has completed yet"),
        },
        (Method::Post, "/v1/savepoints") | (Method::Post, "/v1/stop") => {
            let stop = path == "/v1/stop";
            let mut body = String::new();
            let _ = req.as_reader().read_to_string(&mut body);
            let parsed: SavepointRequest = if body.trim().is_empty() {
                SavepointRequest::default()
            } else {
                match serde_json::from_str(&body) {
                    Ok(p) => p,
                    Err(e) => return error(400, &format!("request body: {e}")),
                }
            };
            if parsed.drain && !stop {
                return error(400, "drain is only allowed with /v1/stop");
            }
            let (tx, rx) = crossbeam_channel::bounded(1);
            if requests.send(Request::Savepoint { stop, drain: parsed.drain, reply: tx }).is_err() {
                return error(409, "the job is not running");
            }
            let id = match rx.recv_timeout(Duration::from_secs(30)) {
                Ok(id) => id,
                Err(_) => return error(409, "the job is restarting or ending; try again"),
            };
            let deadline = std::time::Instant::now() + Duration::from_secs(600);
            loop {
                let status = metrics.board().savepoints.get(&id).cloned();
                match status {
                    None => return error(500, "savepoint request lost"),
                    Some(s) if !parsed.wait => return json(202, &s),
                    Some(s) if s.outcome != weir_crds::control::CheckpointOutcome::InProgress => return json(200, &s),
                    Some(s) if std::time::Instant::now() > deadline => return json(202, &s),
                    Some(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        }
        (Method::Get, p) if p.starts_with("/v1/savepoints/") => {
            let Ok(id) = p["/v1/savepoints/".len()..].parse::<u64>() else {
                return error(400, "savepoint request id must be a number");
            };
            match metrics.board().savepoints.get(&id) {
                Some(s) => json(200, s),
                None => error(404, "no such savepoint request"),
            }
        }
        (Method::Post, "/v1/cancel") => {
            let _ = requests.send(Request::Cancel);
            json(202, &serde_json::json!({"cancelling": true}))
        }
        (Method::Get, "/metrics") => tiny_http::Response::from_data(metrics.render_prometheus().into_bytes())
            .with_header(
                tiny_http::Header::from_bytes(&b"Content-Type"[..], &b"text/plain; version=0.0.4"[..])
                    .expect("static header"),
            ),
        _ => error(404, "no such endpoint"),
    }
}
