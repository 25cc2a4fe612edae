//! The operator's client of a runtime's control API (plain HTTP/1.1 inside the cluster, a
//! per-job bearer token): request a savepoint, read a savepoint request's status, read the
//! job's status.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use weir_crds::control::{JobStatus, SavepointRequest, SavepointStatus};

/// Why a control API call failed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The URL is not `http://host:port`.
    #[error("control URL `{0}` is not http://host:port")]
    BadUrl(String),
    /// Connecting, sending or reading failed (or timed out).
    #[error("control API at {url}: {reason}")]
    Io {
        /// Where.
        url: String,
        /// Why.
        reason: String,
    },
    /// The runtime answered with an error status.
    #[error("control API answered {status}: {body}")]
    Status {
        /// HTTP status.
        status: u16,
        /// The error body.
        body: String,
    },
}

async fn call(base: &str, method: &str, path: &str, token: &str, body: &str) -> Result<(u16, String), ControlError> {
    let authority =
        base.strip_prefix("http://").ok_or_else(|| ControlError::BadUrl(base.to_string()))?.trim_end_matches('/');
    let io = |reason: String| ControlError::Io { url: base.to_string(), reason };
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(authority).await.map_err(|e| io(e.to_string()))?;
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {authority}\r\nAuthorization: Bearer {token}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(req.as_bytes()).await.map_err(|e| io(e.to_string()))?;
        let mut resp = Vec::new();
        stream.read_to_end(&mut resp).await.map_err(|e| io(e.to_string()))?;
        Ok::<Vec<u8>, ControlError>(resp)
    };
    let resp = tokio::time::timeout(Duration::from_secs(15), exchange)
        .await
        .map_err(|_| io("timed out after 15s".into()))??;
    let text = String::from_utf8_lossy(&resp).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| io("malformed HTTP response".into()))?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Ok((status, body))
}

fn parse<T: serde::de::DeserializeOwned>(status: u16, body: String) -> Result<T, ControlError> {
    if !(200..300).contains(&status) {
        return Err(ControlError::Status { status, body });
    }
    serde_json::from_str(&body)
        .map_err(|e| ControlError::Status { status, body: format!("unreadable answer ({e}): {body}") })
}

/// Asks for a savepoint (and a stop after it when `stop`); answers at once with its request.
pub async fn request_savepoint(base: &str, token: &str, stop: bool) -> Result<SavepointStatus, ControlError> {
    let body = serde_json::to_string(&SavepointRequest { drain: false, wait: false }).unwrap_or_default();
    let (status, text) = call(base, "POST", if stop { "/v1/stop" } else { "/v1/savepoints" }, token, &body).await?;
    parse(status, text)
}

/// The status of a savepoint request.
pub async fn savepoint_status(base: &str, token: &str, request: u64) -> Result<SavepointStatus, ControlError> {
    let (status, text) = call(base, "GET", &format!("/v1/savepoints/{request}"), token, "").await?;
    parse(status, text)
}

/// The job's status (its id, counters and newest checkpoint).
pub async fn job_status(base: &str, token: &str) -> Result<JobStatus, ControlError> {
    let (status, text) = call(base, "GET", "/v1/job", token, "").await?;
    parse(status, text)
}
