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
//! When a token is configured every request but `/healthz` needs `Authorization: Bearer <token>`
//! (an empty token is refused at start). Every error answer is JSON: `{"error": "..."}`. With a
//! certificate and key ([`tls_config`]: the operator issues them for each job) the API is served
//! over TLS only, so the token never crosses the pod network in clear; the operator trusts that
//! certificate alone (`weir_client::pin`).
//!
//! The server is exposed to the pod network, so it holds up against slow and greedy clients:
//! at most [`MAX_CONNECTIONS`] connections at once, request headers within
//! [`HEADER_READ_TIMEOUT`] and [`MAX_HEADER_BYTES`], bodies within [`BODY_READ_TIMEOUT`] and
//! [`MAX_BODY_BYTES`]; a TLS handshake, too, within [`HEADER_READ_TIMEOUT`].

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

/// Connections served at once; further ones wait in the listen backlog.
pub const MAX_CONNECTIONS: usize = 64;
/// How long a client may take to send a request's headers (a slowloris client is cut off).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(15);
/// Largest request head.
pub const MAX_HEADER_BYTES: usize = 16 << 10;
/// How long a client may take to send a request's body.
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(15);
/// Largest request body (requests are a few bytes of JSON).
pub const MAX_BODY_BYTES: usize = 64 << 10;

/// Why the control server did not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The address could not be bound or listened on.
    #[error("listening on {addr}: {source}")]
    Listen {
        /// The address asked for.
        addr: String,
        /// The socket error.
        #[source]
        source: std::io::Error,
    },
    /// The token is empty: every request would carry the same non-secret.
    #[error("the control API token is empty (the token file holds no token)")]
    EmptyToken,
    /// The TLS certificate or key could not be read or used.
    #[error("control API TLS: {0}")]
    Tls(String),
}

/// The TLS configuration of a server presenting the certificate chain `cert_pem` with the
/// private key `key_pem` (both PEM, as in a `kubernetes.io/tls`-style Secret).
pub fn tls_config(cert_pem: &[u8], key_pem: &[u8]) -> Result<Arc<rustls::ServerConfig>, ServeError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| ServeError::Tls(format!("the certificate: {e}")))?;
    if certs.is_empty() {
        return Err(ServeError::Tls("the certificate file holds no certificate".into()));
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| ServeError::Tls(format!("the key: {e}")))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ServeError::Tls(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| ServeError::Tls(format!("the certificate and key: {e}")))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

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

/// Starts serving on `addr` (e.g. `127.0.0.1:8081`, port 0 for any), over TLS with `tls`.
pub fn serve(
    addr: &str,
    token: Option<String>,
    tls: Option<Arc<rustls::ServerConfig>>,
    metrics: Arc<JobMetrics>,
    requests: Sender<Request>,
) -> Result<ControlServer, ServeError> {
    if token.as_deref().is_some_and(|t| t.trim().is_empty()) {
        return Err(ServeError::EmptyToken);
    }
    let listen = |source| ServeError::Listen { addr: addr.to_string(), source };
    let listener = std::net::TcpListener::bind(addr).map_err(listen)?;
    listener.set_nonblocking(true).map_err(listen)?;
    let bound = listener.local_addr().map_err(listen)?;
    let app = router(token, metrics, requests);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = {
        let _runtime = crate::io().enter();
        let listener = tokio::net::TcpListener::from_std(listener).map_err(listen)?;
        crate::io().spawn(accept_loop(listener, app, tls.map(tokio_rustls::TlsAcceptor::from), stopped))
    };
    Ok(ControlServer { addr: bound, stop: Some(stop), task: Some(task) })
}

/// Accepts connections while fewer than [`MAX_CONNECTIONS`] are open, each served by hyper with
/// a header timeout; once `stopped`, accepts no more and lets the open ones finish their
/// requests.
async fn accept_loop(
    listener: tokio::net::TcpListener,
    app: Router,
    tls: Option<tokio_rustls::TlsAcceptor>,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) -> std::io::Result<()> {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let (closing, _) = tokio::sync::watch::channel(false);
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_header_size(MAX_HEADER_BYTES);
    loop {
        let slot = tokio::select! {
            _ = &mut stopped => break,
            slot = slots.clone().acquire_owned() => slot.expect("the semaphore is never closed"),
        };
        let stream = tokio::select! {
            _ = &mut stopped => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // Out of file descriptors and the like: the next accept may succeed.
                Err(e) => {
                    tracing::warn!(error = %e, "control API: accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let (http, app, tls, closing) = (http.clone(), app.clone(), tls.clone(), closing.subscribe());
        tokio::spawn(async move {
            match tls {
                None => serve_connection(http, stream, app, closing).await,
                // The handshake holds a slot too, so it is bounded like the headers that follow.
                Some(tls) => match tokio::time::timeout(HEADER_READ_TIMEOUT, tls.accept(stream)).await {
                    Ok(Ok(stream)) => serve_connection(http, stream, app, closing).await,
                    Ok(Err(e)) => tracing::debug!(error = %e, "control API: TLS handshake failed"),
                    Err(_) => tracing::debug!("control API: TLS handshake not done in time"),
                },
            }
            drop(slot);
        });
    }
    let _ = closing.send(true);
    // Every open connection holds a slot: all slots back means all connections ended.
    let _ = slots.acquire_many(MAX_CONNECTIONS as u32).await;
    Ok(())
}

/// Serves one connection's requests until the client closes it, or, once `closing`, until the
/// request being answered is done.
async fn serve_connection<S>(
    http: hyper::server::conn::http1::Builder,
    stream: S,
    app: Router,
    mut closing: tokio::sync::watch::Receiver<bool>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper_util::service::TowerToHyperService::new(app);
    let connection = http.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
    let mut connection = std::pin::pin!(connection);
    tokio::select! {
        _ = connection.as_mut() => {}
        _ = closing.changed() => {
            connection.as_mut().graceful_shutdown();
            let _ = connection.await;
        }
    }
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
        .layer(middleware::from_fn(bounded_body))
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

/// Reads a request's body within [`BODY_READ_TIMEOUT`] and [`MAX_BODY_BYTES`] before any
/// handler sees it.
async fn bounded_body(request: HttpRequest, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    match tokio::time::timeout(BODY_READ_TIMEOUT, axum::body::to_bytes(body, MAX_BODY_BYTES)).await {
        Ok(Ok(bytes)) => next.run(HttpRequest::from_parts(parts, axum::body::Body::from(bytes))).await,
        Ok(Err(_)) => {
            Failure(StatusCode::PAYLOAD_TOO_LARGE, format!("request body over {MAX_BODY_BYTES} bytes")).into_response()
        }
        Err(_) => Failure(StatusCode::REQUEST_TIMEOUT, "request body not sent in time".into()).into_response(),
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

    fn server(token: Option<&str>) -> Result<ControlServer, ServeError> {
        let (requests, _) = crossbeam_channel::unbounded();
        let metrics = Arc::new(JobMetrics::new("control-test", "r1"));
        serve("127.0.0.1:0", token.map(str::to_string), None, metrics, requests)
    }

    #[test]
    fn an_empty_token_is_refused_at_start() {
        assert!(matches!(server(Some("")), Err(ServeError::EmptyToken)));
        assert!(matches!(server(Some("  \n")), Err(ServeError::EmptyToken)));
        assert!(server(Some("t0ken")).is_ok());
    }

    /// Slow clients holding every connection slot, sending a header byte now and then, are cut
    /// off after the header timeout; a request sent meanwhile is answered once a slot frees up,
    /// and requests with too large a body or a wrong or empty bearer are refused.
    #[test]
    fn slow_and_greedy_clients_do_not_keep_others_out() {
        use std::io::{Read, Write};
        let server = server(Some("t0ken")).unwrap();
        let addr = server.addr;
        let slow: Vec<std::net::TcpStream> = (0..MAX_CONNECTIONS + 8)
            .map(|_| {
                let mut s = std::net::TcpStream::connect(addr).unwrap();
                s.write_all(b"GET /v1/job HTTP/1.1\r\nHost: x\r\n").unwrap();
                s
            })
            .collect();
        let dripping = std::thread::spawn(move || {
            let mut slow = slow;
            let until = std::time::Instant::now() + HEADER_READ_TIMEOUT + Duration::from_secs(5);
            while std::time::Instant::now() < until {
                for s in &mut slow {
                    let _ = s.write_all(b"X");
                }
                std::thread::sleep(Duration::from_millis(500));
            }
            // Each was closed by the server: reading ends (EOF, an answer, or a reset) instead of
            // waiting out the read timeout. Those that waited in the backlog while the first
            // ones held every slot were accepted later, so their header timeout ends later too.
            slow.iter()
                .filter(|s| {
                    let mut stream: &std::net::TcpStream = s;
                    stream.set_read_timeout(Some(HEADER_READ_TIMEOUT + Duration::from_secs(5))).unwrap();
                    let mut buf = [0u8; 256];
                    match stream.read(&mut buf) {
                        Ok(n) => n <= buf.len(),
                        Err(e) => !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
                    }
                })
                .count()
        });
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let started = std::time::Instant::now();
        let client = weir_client::ControlClient::new(&addr.to_string(), Some("t0ken".into()))
            .unwrap()
            .timeout(HEADER_READ_TIMEOUT * 2);
        let status = rt.block_on(client.job()).expect("answered once the slow clients are cut off");
        assert_eq!(status.name, "control-test");
        assert!(started.elapsed() < HEADER_READ_TIMEOUT + Duration::from_secs(10), "{:?}", started.elapsed());
        let wrong = weir_client::ControlClient::new(&addr.to_string(), Some("other".into())).unwrap();
        assert_eq!(rt.block_on(wrong.job()).unwrap_err().status(), Some(401));
        let raw = |request: String| {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            s.write_all(request.as_bytes()).unwrap();
            let mut answer = String::new();
            let _ = s.read_to_string(&mut answer);
            answer
        };
        let empty =
            raw("GET /v1/job HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \r\nConnection: close\r\n\r\n".into());
        assert!(empty.starts_with("HTTP/1.1 401"), "{empty}");
        let big = "x".repeat(MAX_BODY_BYTES + 1);
        let too_big = raw(format!(
            "POST /v1/savepoints HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t0ken\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n{big}",
            big.len()
        ));
        assert!(too_big.starts_with("HTTP/1.1 413"), "{too_big}");
        assert_eq!(dripping.join().unwrap(), MAX_CONNECTIONS + 8, "every slow connection was closed");
    }

    /// Over TLS the API answers a client that trusts its certificate, and no one else: not a
    /// client that pinned another certificate (another job's), not plain HTTP.
    #[test]
    fn over_tls_only_a_client_pinning_its_certificate_is_answered() {
        let names = vec!["job-control.ns.svc".to_string()];
        let issued = rcgen::generate_simple_self_signed(names.clone()).unwrap();
        let other = rcgen::generate_simple_self_signed(names).unwrap();
        let (cert, key) = (issued.cert.pem(), issued.signing_key.serialize_pem());
        let tls = tls_config(cert.as_bytes(), key.as_bytes()).unwrap();
        let (requests, _) = crossbeam_channel::unbounded();
        let metrics = Arc::new(JobMetrics::new("control-test", "r1"));
        let server = serve("127.0.0.1:0", Some("t0ken".into()), Some(tls), metrics, requests).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let base = format!("https://{}", server.addr);
        let token = Some("t0ken".to_string());
        let pinned = weir_client::ControlClient::pinned(&base, token.clone(), cert.as_bytes()).unwrap();
        assert_eq!(rt.block_on(pinned.job()).unwrap().name, "control-test");
        let wrong = weir_client::ControlClient::pinned(&base, token.clone(), other.cert.pem().as_bytes()).unwrap();
        let refused = rt.block_on(wrong.job()).unwrap_err();
        assert_eq!(refused.status(), None, "the handshake is refused, nothing is answered: {refused}");
        let plain = weir_client::ControlClient::new(&format!("http://{}", server.addr), token).unwrap();
        let plain = plain.timeout(Duration::from_secs(5));
        assert!(rt.block_on(plain.job()).is_err(), "plain HTTP is not served");
        assert!(matches!(tls_config(b"", key.as_bytes()), Err(ServeError::Tls(_))));
        assert!(matches!(tls_config(cert.as_bytes(), b"not a key"), Err(ServeError::Tls(_))));
        assert!(matches!(
            tls_config(cert.as_bytes(), other.signing_key.serialize_pem().as_bytes()),
            Err(ServeError::Tls(_))
        ));
    }

    #[test]
    fn token_comparison_needs_every_byte() {
        assert!(constant_time_eq(b"s3cret", b"s3cret"));
        assert!(!constant_time_eq(b"s3cret", b"s3creT"));
        assert!(!constant_time_eq(b"s3cret", b"s3cre"));
    }
}
