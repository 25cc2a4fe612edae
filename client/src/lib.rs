//! The typed client of a Weir runtime's control API (see `weir_runtime::control` for the server),
//! used by the `weir-runtime savepoint` command and by the operator.
//!
//! One [`ControlClient`] talks to one runtime. Its HTTP connections come from a
//! [`reqwest::Client`] that callers with many runtimes (the operator) share, so connections are
//! pooled and kept alive. Every call has a timeout; a request that waits for a savepoint has a
//! longer one of its own. A runtime the operator deploys serves TLS with a certificate the
//! operator issued for its job: clients reach it at `https://` and trust that certificate alone
//! ([`pin`]).

pub mod pin;

use std::time::Duration;

use serde::de::DeserializeOwned;
use weir_crds::control::{ApiError, CheckpointHistory, CheckpointInfo, JobStatus, SavepointRequest, SavepointStatus};

/// How long a call may take unless it waits for a savepoint.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(15);
/// How long a call with `wait: true` may take: the server answers by 600 s with the status so far.
pub const DEFAULT_WAIT_TIMEOUT: Duration = Duration::from_secs(630);
/// How long connecting may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest answer read (a metrics page of a large job is a few hundred KiB): a runtime image is
/// the tenant's, and its answers are read by an operator that serves every tenant.
pub const MAX_ANSWER_BYTES: usize = 8 << 20;

/// Why a control API call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The base URL does not parse.
    #[error("control URL `{url}`: {source}")]
    ParseUrl {
        /// The URL given.
        url: String,
        /// Why it does not parse.
        #[source]
        source: url::ParseError,
    },
    /// The base URL is not `http://host:port` or `https://host:port`.
    #[error("control URL `{0}`: the control API is served on http://host:port or https://host:port")]
    UrlScheme(String),
    /// A certificate to pin could not be read, or TLS could not be set up with it.
    #[error("control API certificate: {0}")]
    Certificate(String),
    /// The token given is empty: a request carrying it would look authenticated and not be.
    #[error("the control API token is empty")]
    EmptyToken,
    /// The answer is longer than [`MAX_ANSWER_BYTES`] (it was not read further).
    #[error("{method} {url}: answer longer than {limit} bytes")]
    TooLarge {
        /// HTTP method.
        method: &'static str,
        /// Full URL.
        url: String,
        /// The bound.
        limit: usize,
    },
    /// The HTTP client could not be built.
    #[error("building the HTTP client: {0}")]
    BuildClient(#[source] reqwest::Error),
    /// No complete answer within the call's timeout.
    #[error("{method} {url}: no answer within {after:?}")]
    Timeout {
        /// HTTP method.
        method: &'static str,
        /// Full URL.
        url: String,
        /// The timeout that ran out.
        after: Duration,
    },
    /// Connecting, sending or reading the answer failed.
    #[error("{method} {url}: {source}")]
    Send {
        /// HTTP method.
        method: &'static str,
        /// Full URL.
        url: String,
        /// The transport error.
        #[source]
        source: reqwest::Error,
    },
    /// The runtime answered with an error status.
    #[error("{method} {url} answered {status}: {message}")]
    Status {
        /// HTTP method.
        method: &'static str,
        /// Full URL.
        url: String,
        /// HTTP status code.
        status: u16,
        /// The `error` of the JSON error body (or the body as text).
        message: String,
    },
    /// The answer is not the JSON the call expects.
    #[error("{method} {url}: unreadable answer: {source}")]
    Decode {
        /// HTTP method.
        method: &'static str,
        /// Full URL.
        url: String,
        /// Why it does not parse.
        #[source]
        source: serde_json::Error,
    },
}

impl ClientError {
    /// The HTTP status of an error answer, if the runtime answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Status { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// Whether the request never reached the runtime: its name did not resolve or the
    /// connection was refused or timed out. Such a request can be sent again safely.
    pub fn never_sent(&self) -> bool {
        matches!(self, ClientError::Send { source, .. } if source.is_connect())
    }
}

/// An HTTP client for control API calls: pooled keep-alive connections, a connect timeout, and
/// no proxy (a runtime's address is only meaningful inside its network).
pub fn http_client() -> Result<reqwest::Client, ClientError> {
    reqwest::Client::builder()
        .connect_timeout(CONNECT_TIMEOUT)
        .pool_idle_timeout(Duration::from_secs(30))
        .no_proxy()
        .build()
        .map_err(ClientError::BuildClient)
}

/// An HTTP client for control API calls like [`http_client`]'s, whose `https://` connections
/// trust only the certificates `pins` holds, each at its host.
pub fn pinned_http_client(pins: pin::Pins) -> Result<reqwest::Client, ClientError> {
    reqwest::Client::builder()
        .use_preconfigured_tls(pin::pinned_tls_config(pins)?)
        .connect_timeout(CONNECT_TIMEOUT)
        .pool_idle_timeout(Duration::from_secs(30))
        .no_proxy()
        .build()
        .map_err(ClientError::BuildClient)
}

/// A client of one runtime's control API. Its `Debug` form leaves the token out.
#[derive(Clone)]
pub struct ControlClient {
    http: reqwest::Client,
    base: url::Url,
    token: Option<String>,
    timeout: Duration,
    wait_timeout: Duration,
}

impl ControlClient {
    /// A client of the runtime at `base` (`http://host:port`), sending `token` as a bearer token,
    /// over a connection pool of its own.
    pub fn new(base: &str, token: Option<String>) -> Result<Self, ClientError> {
        Self::with_http(http_client()?, base, token)
    }

    /// A client of the runtime at `base` (`https://host:port`) that trusts only the certificate
    /// in `certificate_pem` (the `tls.crt` of the job's token Secret), over a connection pool of
    /// its own.
    pub fn pinned(base: &str, token: Option<String>, certificate_pem: &[u8]) -> Result<Self, ClientError> {
        let pins = pin::Pins::default();
        let url = if base.contains("://") { base.to_string() } else { format!("https://{base}") };
        let parsed = url::Url::parse(&url).map_err(|source| ClientError::ParseUrl { url: base.to_string(), source })?;
        let host = pin::pin_host(&parsed).ok_or_else(|| ClientError::UrlScheme(base.to_string()))?;
        pins.pin(&host, pin::pem_fingerprint(certificate_pem)?);
        Self::with_http(pinned_http_client(pins)?, &url, token)
    }

    /// A client of the runtime at `base` over a shared connection pool (see [`http_client`] and
    /// [`pinned_http_client`]).
    pub fn with_http(http: reqwest::Client, base: &str, token: Option<String>) -> Result<Self, ClientError> {
        let url = if base.contains("://") { base.to_string() } else { format!("http://{base}") };
        let parsed = url::Url::parse(&url).map_err(|source| ClientError::ParseUrl { url: base.to_string(), source })?;
        if !matches!(parsed.scheme(), "http" | "https") || parsed.host().is_none() {
            return Err(ClientError::UrlScheme(base.to_string()));
        }
        if token.as_deref().is_some_and(|t| t.trim().is_empty()) {
            return Err(ClientError::EmptyToken);
        }
        Ok(ControlClient { http, base: parsed, token, timeout: DEFAULT_TIMEOUT, wait_timeout: DEFAULT_WAIT_TIMEOUT })
    }

    /// The same client with another timeout for calls that do not wait for a savepoint.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The same client with another timeout for calls that wait for a savepoint (`wait: true`).
    pub fn wait_timeout(mut self, timeout: Duration) -> Self {
        self.wait_timeout = timeout;
        self
    }

    /// `GET /v1/job`: the job's state, counters and newest checkpoint.
    pub async fn job(&self) -> Result<JobStatus, ClientError> {
        self.json(self.get("/v1/job").await?)
    }

    /// `GET /v1/checkpoints`: the checkpoint history, newest first.
    pub async fn checkpoints(&self) -> Result<CheckpointHistory, ClientError> {
        self.json(self.get("/v1/checkpoints").await?)
    }

    /// `GET /v1/checkpoints/latest`: the newest completed checkpoint, `None` before the first.
    pub async fn latest_checkpoint(&self) -> Result<Option<CheckpointInfo>, ClientError> {
        match self.get("/v1/checkpoints/latest").await {
            Ok(answer) => self.json(answer).map(Some),
            Err(e) if e.status() == Some(404) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// `POST /v1/savepoints`: triggers a savepoint. With `wait` the answer comes when it ended.
    pub async fn trigger_savepoint(&self, request: &SavepointRequest) -> Result<SavepointStatus, ClientError> {
        self.json(self.post("/v1/savepoints", request, request.wait).await?)
    }

    /// `POST /v1/stop`: stops the job with a savepoint (after flushing windows with `drain`).
    pub async fn stop(&self, request: &SavepointRequest) -> Result<SavepointStatus, ClientError> {
        self.json(self.post("/v1/stop", request, request.wait).await?)
    }

    /// `GET /v1/savepoints/{id}`: the status of a savepoint request.
    pub async fn savepoint(&self, request_id: u64) -> Result<SavepointStatus, ClientError> {
        self.json(self.get(&format!("/v1/savepoints/{request_id}")).await?)
    }

    /// `POST /v1/cancel`: cancels the job without a savepoint.
    pub async fn cancel(&self) -> Result<(), ClientError> {
        self.post("/v1/cancel", &serde_json::json!({}), false).await.map(drop)
    }

    /// `GET /metrics`: the Prometheus text exposition.
    pub async fn metrics(&self) -> Result<String, ClientError> {
        self.get("/metrics").await.map(|a| String::from_utf8_lossy(&a.body).into_owned())
    }

    /// `GET /healthz`: answers when the process serves requests.
    pub async fn healthz(&self) -> Result<(), ClientError> {
        self.get("/healthz").await.map(drop)
    }

    async fn get(&self, path: &str) -> Result<Answer, ClientError> {
        let url = self.url(path);
        self.send("GET", url.clone(), self.http.get(url), self.timeout).await
    }

    async fn post<B: serde::Serialize>(&self, path: &str, body: &B, wait: bool) -> Result<Answer, ClientError> {
        let url = self.url(path);
        let timeout = if wait { self.wait_timeout } else { self.timeout };
        let body = serde_json::to_vec(body).map_err(|source| ClientError::Decode {
            method: "POST",
            url: url.to_string(),
            source,
        })?;
        let request = self.http.post(url.clone()).header(reqwest::header::CONTENT_TYPE, "application/json").body(body);
        self.send("POST", url, request, timeout).await
    }

    fn url(&self, path: &str) -> url::Url {
        let mut url = self.base.clone();
        url.set_path(path);
        url
    }

    async fn send(
        &self,
        method: &'static str,
        url: url::Url,
        mut request: reqwest::RequestBuilder,
        timeout: Duration,
    ) -> Result<Answer, ClientError> {
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        let failed = |source: reqwest::Error| {
            if source.is_timeout() {
                ClientError::Timeout { method, url: url.to_string(), after: timeout }
            } else {
                ClientError::Send { method, url: url.to_string(), source }
            }
        };
        // The timeout covers the whole exchange, the body included.
        let response = request.timeout(timeout).send().await.map_err(failed)?;
        let status = response.status().as_u16();
        let too_large = || ClientError::TooLarge { method, url: url.to_string(), limit: MAX_ANSWER_BYTES };
        if response.content_length().is_some_and(|len| len > MAX_ANSWER_BYTES as u64) {
            return Err(too_large());
        }
        let mut body = Vec::new();
        let mut response = response;
        while let Some(chunk) = response.chunk().await.map_err(failed)? {
            if body.len() + chunk.len() > MAX_ANSWER_BYTES {
                return Err(too_large());
            }
            body.extend_from_slice(&chunk);
        }
        if !(200..300).contains(&status) {
            let message = serde_json::from_slice::<ApiError>(&body)
                .map(|e| e.error)
                .unwrap_or_else(|_| String::from_utf8_lossy(&body).trim().to_string());
            return Err(ClientError::Status { method, url: url.to_string(), status, message });
        }
        Ok(Answer { method, url, body })
    }

    fn json<T: DeserializeOwned>(&self, answer: Answer) -> Result<T, ClientError> {
        serde_json::from_slice(&answer.body).map_err(|source| ClientError::Decode {
            method: answer.method,
            url: answer.url.to_string(),
            source,
        })
    }
}

impl std::fmt::Debug for ControlClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlClient")
            .field("base", &self.base.as_str())
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("timeout", &self.timeout)
            .field("wait_timeout", &self.wait_timeout)
            .finish()
    }
}

/// A 2xx answer's body, with what produced it for error messages.
struct Answer {
    method: &'static str,
    url: url::Url,
    body: Vec<u8>,
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// Serves every connection with `answer` after reading the request head.
    async fn raw_server(answer: Vec<u8>) -> std::net::SocketAddr {
        let answer: std::sync::Arc<[u8]> = answer.into();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else { return };
                let answer = answer.clone();
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    if !answer.is_empty() {
                        let _ = stream.write_all(&answer).await;
                    }
                    // Hold the connection open (a server that never answers keeps it forever).
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                });
            }
        });
        addr
    }

    #[tokio::test]
    async fn reads_a_chunked_answer() {
        // The old hand-written clients read up to the end of the stream and kept the chunk sizes.
        let mut answer =
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        for chunk in [r#"{"requestId":7,"outcome":"#, r#""completed","path":"file:///s/sp-7","#, r#""failure":null}"#] {
            answer.extend_from_slice(format!("{:x}\r\n{chunk}\r\n", chunk.len()).as_bytes());
        }
        answer.extend_from_slice(b"0\r\n\r\n");
        let addr = raw_server(answer).await;
        let client = ControlClient::new(&format!("http://{addr}"), Some("t".into())).unwrap();
        let status = client.savepoint(7).await.unwrap();
        assert_eq!(status.request_id, 7);
        assert_eq!(status.outcome, weir_crds::control::CheckpointOutcome::Completed);
        assert_eq!(status.path.as_deref(), Some("file:///s/sp-7"));
    }

    #[tokio::test]
    async fn a_silent_server_times_out() {
        let addr = raw_server(Vec::new()).await;
        let client = ControlClient::new(&addr.to_string(), None).unwrap().timeout(Duration::from_millis(300));
        let started = std::time::Instant::now();
        let err = client.job().await.unwrap_err();
        assert!(matches!(err, ClientError::Timeout { method: "GET", .. }), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5), "gave up after {:?}", started.elapsed());
        assert!(err.to_string().contains("/v1/job: no answer within 300ms"), "{err}");
    }

    #[tokio::test]
    async fn an_error_answer_carries_the_servers_message() {
        let body = r#"{"error":"missing or wrong bearer token"}"#;
        let head = format!(
            "HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        let addr = raw_server(format!("{head}{body}").into_bytes()).await;
        let client = ControlClient::new(&format!("http://{addr}/"), Some("wrong".into())).unwrap();
        let err = client.job().await.unwrap_err();
        assert_eq!(err.status(), Some(401));
        assert!(err.to_string().ends_with("answered 401: missing or wrong bearer token"), "{err}");
    }

    #[test]
    fn an_empty_token_is_refused_and_a_token_never_printed() {
        assert!(matches!(ControlClient::new("127.0.0.1:1", Some(String::new())), Err(ClientError::EmptyToken)));
        assert!(matches!(ControlClient::new("127.0.0.1:1", Some(" \n".into())), Err(ClientError::EmptyToken)));
        let client = ControlClient::new("127.0.0.1:1", Some("s3cr3t-token".into())).unwrap();
        let shown = format!("{client:?}");
        assert!(!shown.contains("s3cr3t") && shown.contains("<redacted>"), "{shown}");
    }

    #[tokio::test]
    async fn an_endless_answer_is_cut_at_its_bound() {
        let head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n";
        let mut answer = head.as_bytes().to_vec();
        let chunk = "x".repeat(1 << 20);
        for _ in 0..(MAX_ANSWER_BYTES >> 20) + 2 {
            answer.extend_from_slice(format!("{:x}\r\n{chunk}\r\n", chunk.len()).as_bytes());
        }
        answer.extend_from_slice(b"0\r\n\r\n");
        let addr = raw_server(answer).await;
        let err = ControlClient::new(&addr.to_string(), None).unwrap().metrics().await.unwrap_err();
        assert!(matches!(err, ClientError::TooLarge { .. }), "{err}");
    }

    #[test]
    fn refuses_urls_it_cannot_call() {
        assert!(matches!(ControlClient::new("ftp://x:1", None), Err(ClientError::UrlScheme(_))));
        assert!(matches!(ControlClient::new("http://", None), Err(ClientError::ParseUrl { .. })));
        let c = ControlClient::new("job-control.ns:8081", None).unwrap();
        assert_eq!(c.url("/v1/job").as_str(), "http://job-control.ns:8081/v1/job");
    }
}
