//! The control API: HTTP/JSON on the coordinator, and Prometheus metrics on the same port, served
//! by axum on the runtime's I/O runtime ([`crate::io`]). `weir_client::ControlClient` calls it.
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
//! Every error answer is JSON: `{"error": "..."}`.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Request as HttpRequest, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use crossbeam_channel::Sender;
use weir_crds::control::{ApiError, CheckpointHistory, CheckpointOutcome, SavepointRequest, SavepointStatus};

use crate::executor::Request;
use crate::metrics::JobMetrics;

/// How long a `wait: true` savepoint request is held before it is answered with 202 and the
/// status so far.
const WAIT_LIMIT: Duration = Duration::from_secs(600);
/// How long the coordinator may take to accept a savepoint request.
const ACCEPT_LIMIT: Duration = Duration::from_secs(30);

/// What the handlers share.
struct ControlState {
    metrics: Arc<JobMetrics>,
    requests: Sender<Request>,
}

/// A running control server; dropping it stops it at once, [`ControlServer::shutdown`] lets the
/// requests being answered finish first.
pub struct ControlServer {
    /// The bound address.
    pub addr: std::net::SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl ControlServer {
    /// Stops accepting connections and waits (up to `timeout`) for the requests being answered,
    /// e.g. a `wait: true` stop request whose answer is the savepoint the job just stopped with.
    pub fn shutdown(mut self, timeout: Duration) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let abort = task.abort_handle();
            if crate::io().block_on(async { tokio::time::timeout(timeout, task).await }).is_err() {
                abort.abort();
            }
        }
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Starts serving on `addr` (e.g. `127.0.0.1:8081`, port 0 for any).
pub fn serve(
    addr: &str,
    token: Option<String>,
    metrics: Arc<JobMetrics>,
    requests: Sender<Request>,
) -> std::io::Result<ControlServer> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    let bound = listener.local_addr()?;
    let app = router(token, metrics, requests);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = {
        let _runtime = crate::io().enter();
        let listener = tokio::net::TcpListener::from_std(listener)?;
        crate::io().spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = stopped.await;
                })
                .await
        })
    };
    Ok(ControlServer { addr: bound, stop: Some(stop), task: Some(task) })
}

/// The routes, behind the bearer token when one is set (all but `/healthz`).
fn router(token: Option<String>, metrics: Arc<JobMetrics>, requests: Sender<Request>) -> Router {
    let state = Arc::new(ControlState { metrics, requests });
    let token: Option<Arc<str>> = token.map(Arc::from);
    Router::new()
        .route("/v1/job", get(job))
        .route("/v1/checkpoints", get(checkpoints))
        .route("/v1/checkpoints/latest", get(latest_checkpoint))
        .route("/v1/savepoints", post(trigger_savepoint))
        .route("/v1/savepoints/{id}", get(savepoint))
        .route("/v1/stop", post(stop))
        .route("/v1/cancel", post(cancel))
        .route("/metrics", get(prometheus))
        .route_layer(middleware::from_fn_with_state(token, require_bearer))
        .route("/healthz", get(|| async { Json(serde_json::json!({"ok": true})) }))
        .fallback(|| async { Failure(StatusCode::NOT_FOUND, "no such endpoint".into()) })
        .method_not_allowed_fallback(|| async {
            Failure(StatusCode::METHOD_NOT_ALLOWED, "method not allowed on this endpoint".into())
        })
        .with_state(state)
}

/// An error answer: a status and a JSON body naming what went wrong.
struct Failure(StatusCode, String);

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        (self.0, Json(ApiError { error: self.1 })).into_response()
    }
}

/// Refuses requests without `Authorization: Bearer <token>` when a token is configured.
async fn require_bearer(
    State(token): State<Option<Arc<str>>>,
    headers: HeaderMap,
    request: HttpRequest,
    next: Next,
) -> Response {
    let Some(token) = token else { return next.run(request).await };
    let offered = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match offered {
        Some(offered) if constant_time_eq(offered.as_bytes(), token.as_bytes()) => next.run(request).await,
        _ => Failure(StatusCode::UNAUTHORIZED, "missing or wrong bearer token".into()).into_response(),
    }
}

/// Compares without an early exit, so answer times do not reveal how much of a token matched.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn job(State(s): State<Arc<ControlState>>) -> Response {
    Json(s.metrics.job_status()).into_response()
}

async fn checkpoints(State(s): State<Arc<ControlState>>) -> Response {
    let checkpoints = s.metrics.board().history.iter().cloned().collect();
    let (completed, failed) = s.metrics.checkpoint_counts();
    Json(CheckpointHistory { checkpoints, completed, failed }).into_response()
}

async fn latest_checkpoint(State(s): State<Arc<ControlState>>) -> Response {
    match s.metrics.latest_completed() {
        Some(c) => Json(c).into_response(),
        None => Failure(StatusCode::NOT_FOUND, "no checkpoint has completed yet".into()).into_response(),
    }
}

async fn trigger_savepoint(State(s): State<Arc<ControlState>>, body: axum::body::Bytes) -> Response {
    savepoint_request(&s, false, &body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn stop(State(s): State<Arc<ControlState>>, body: axum::body::Bytes) -> Response {
    savepoint_request(&s, true, &body).await.unwrap_or_else(IntoResponse::into_response)
}

/// Hands a savepoint (or stop) request to the coordinator and answers with its status: at once
/// (202), or with `wait` when it ended (200; 202 with the status so far after [`WAIT_LIMIT`]).
async fn savepoint_request(s: &ControlState, stop: bool, body: &[u8]) -> Result<Response, Failure> {
    let parsed: SavepointRequest = if body.iter().all(u8::is_ascii_whitespace) {
        SavepointRequest::default()
    } else {
        serde_json::from_slice(body).map_err(|e| Failure(StatusCode::BAD_REQUEST, format!("request body: {e}")))?
    };
    if parsed.drain && !stop {
        return Err(Failure(StatusCode::BAD_REQUEST, "drain is only allowed with /v1/stop".into()));
    }
    let (reply, accepted) = tokio::sync::oneshot::channel();
    if s.requests.send(Request::Savepoint { stop, drain: parsed.drain, reply }).is_err() {
        return Err(Failure(StatusCode::CONFLICT, "the job is not running".into()));
    }
    let conflict = || Failure(StatusCode::CONFLICT, "the job is restarting or ending; try again".into());
    let id = tokio::time::timeout(ACCEPT_LIMIT, accepted).await.map_err(|_| conflict())?.map_err(|_| conflict())?;
    let deadline = tokio::time::Instant::now() + WAIT_LIMIT;
    loop {
        let changed = s.metrics.savepoint_changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let status = s.metrics.board().savepoints.get(&id).cloned();
        let Some(status) = status else {
            return Err(Failure(StatusCode::INTERNAL_SERVER_ERROR, "savepoint request lost".into()));
        };
        if !parsed.wait {
            return Ok((StatusCode::ACCEPTED, Json(status)).into_response());
        }
        if status.outcome != CheckpointOutcome::InProgress {
            return Ok(Json(status).into_response());
        }
        if tokio::time::timeout_at(deadline, changed).await.is_err() {
            return Ok((StatusCode::ACCEPTED, Json(status)).into_response());
        }
    }
}

async fn savepoint(State(s): State<Arc<ControlState>>, Path(id): Path<String>) -> Response {
    let Ok(id) = id.parse::<u64>() else {
        return Failure(StatusCode::BAD_REQUEST, "savepoint request id must be a number".into()).into_response();
    };
    let status: Option<SavepointStatus> = s.metrics.board().savepoints.get(&id).cloned();
    match status {
        Some(status) => Json(status).into_response(),
        None => Failure(StatusCode::NOT_FOUND, "no such savepoint request".into()).into_response(),
    }
}

async fn cancel(State(s): State<Arc<ControlState>>) -> Response {
    let _ = s.requests.send(Request::Cancel);
    (StatusCode::ACCEPTED, Json(serde_json::json!({"cancelling": true}))).into_response()
}

async fn prometheus(State(s): State<Arc<ControlState>>) -> Response {
    ([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], s.metrics.render_prometheus()).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_comparison_needs_every_byte() {
        assert!(constant_time_eq(b"s3cret", b"s3cret"));
        assert!(!constant_time_eq(b"s3cret", b"s3creT"));
        assert!(!constant_time_eq(b"s3cret", b"s3cre"));
    }
}
