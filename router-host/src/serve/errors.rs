//! Errors: what can stop the server from starting or reloading ([`ServeError`]), and what a
//! client is told when its request is refused ([`ApiError`], an OpenAI-style JSON body).

use std::path::PathBuf;
use std::time::Duration;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::config::ConfigError;
use crate::router::StartupError;

/// Why `serve` could not start, or a reload was refused.
///
/// Its message is the whole story, cause included, and it has no `source()` of its own: the
/// reload log line prints it with `%` (Display only), `main` with `{:#}` (the chain), and both
/// must say every context once. So a cause is a field named `cause`, rendered into the message,
/// never a `#[source]` or `#[from]` (thiserror would make it a `source()` as well, printed a
/// second time by `{:#}`). `Config` is transparent: message and source are the `ConfigError`'s.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("config {file}: {}", Chain(cause.as_ref()))]
    Startup {
        file: PathBuf,
        cause: Box<StartupError>,
    },
    #[error("config {file}: workers: `serve` needs at least one engine in `workers:` (each with `id` and `url`)")]
    NoWorkers { file: PathBuf },
    #[error("config {file}: workers: {reason}")]
    Cluster { file: PathBuf, reason: String },
    #[error("config {file}: workers[{index}].url: `{url}` is not a usable URL: {reason}")]
    WorkerUrl {
        file: PathBuf,
        index: usize,
        url: String,
        reason: String,
    },
    #[error("config {file}: serve.tokenizer.path: {reason}")]
    Tokenizer { file: PathBuf, reason: String },
    #[error("config {file}: block_size: {reason}")]
    BlockSize { file: PathBuf, reason: String },
    #[error("config {file}: {}", Chain(cause))]
    SessionStore {
        file: PathBuf,
        cause: crate::session_store::StoreError,
    },
    #[error("cannot build the upstream HTTP client: {0}")]
    Client(String),
    #[error("cannot listen on {addr}: {cause}")]
    Bind {
        addr: std::net::SocketAddr,
        cause: std::io::Error,
    },
    #[error("server failed: {0}")]
    Io(std::io::Error),
    #[error("reload {started} finished after a later one was swapped in (configuration {serving} is serving); it was discarded")]
    ReloadSuperseded { started: u64, serving: u64 },
    #[error("the reload task stopped before it finished: {0}")]
    ReloadTask(String),
}

impl From<std::io::Error> for ServeError {
    fn from(err: std::io::Error) -> Self {
        ServeError::Io(err)
    }
}

/// An error and its `source()` chain on one line, `error: cause: its cause`, as `{:#}` prints an
/// `anyhow` chain (anyhow is the binary's; this is the library's).
pub(crate) struct Chain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut next = self.0.source();
        while let Some(cause) = next {
            write!(f, ": {cause}")?;
            next = cause.source();
        }
        Ok(())
    }
}

/// OS errors that say the router itself ran out (descriptors, local ports, buffers, memory),
/// not that the engine at the other end failed.
const LOCAL_RESOURCE_ERRNOS: [i32; 5] = [
    libc::EMFILE,
    libc::ENFILE,
    libc::ENOBUFS,
    libc::ENOMEM,
    libc::EADDRNOTAVAIL,
];

/// Whether `err` is one of the router's own resources running out.
pub fn is_local_resource_io(err: &std::io::Error) -> bool {
    err.raw_os_error()
        .is_some_and(|code| LOCAL_RESOURCE_ERRNOS.contains(&code))
}

/// Whether `err`, or an error in its source chain, is one of the router's own resources
/// running out (an engine must not be blamed for it).
pub fn is_local_resource(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(err);
    while let Some(e) = next {
        if e.downcast_ref::<std::io::Error>()
            .is_some_and(is_local_resource_io)
        {
            return true;
        }
        next = e.source();
    }
    false
}

/// The `type` of an OpenAI-style error body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// 4xx: the request itself is wrong.
    InvalidRequest,
    /// 413.
    TooLarge,
    /// 429: shed load.
    RateLimited,
    /// 503: no worker can take it now.
    Unavailable,
    /// 502/504: the engine failed.
    Upstream,
    /// 500: a fault of the router.
    Internal,
}

impl ErrorKind {
    fn type_name(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest | ErrorKind::TooLarge => "invalid_request_error",
            ErrorKind::RateLimited => "rate_limit_error",
            ErrorKind::Unavailable => "service_unavailable",
            ErrorKind::Upstream => "upstream_error",
            ErrorKind::Internal => "internal_error",
        }
    }
}

/// A refused request: status, OpenAI-style body, and the outcome label metrics count it under.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: ErrorKind,
    pub message: String,
    /// The body field at fault (`param` in the body), if any.
    pub param: Option<&'static str>,
    /// A machine-readable code (`code` in the body).
    pub code: &'static str,
    pub retry_after: Option<Duration>,
}

impl ApiError {
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: ErrorKind::InvalidRequest,
            message: message.into(),
            param: None,
            code,
            retry_after: None,
        }
    }

    pub fn param(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }

    pub fn too_large(limit: u64) -> Self {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            kind: ErrorKind::TooLarge,
            message: format!("request body is larger than {limit} bytes (serve.max_body_bytes)"),
            param: None,
            code: "body_too_large",
            retry_after: None,
        }
    }

    /// The client did not send its whole body within `serve.timeouts.body_read_ms`.
    pub fn body_timeout(limit: Duration) -> Self {
        ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            ..ApiError::bad_request(
                "body_read_timeout",
                format!(
                    "the request body did not arrive within {} ms (serve.timeouts.body_read_ms)",
                    limit.as_millis()
                ),
            )
        }
    }

    /// The router ran out of its own descriptors, ports or memory: not the engine's fault.
    pub fn local_resources(message: impl Into<String>) -> Self {
        ApiError::unavailable("local_resources_exhausted", message)
    }

    pub fn unsupported_media(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ..ApiError::bad_request("unsupported_media_type", message)
        }
    }

    pub fn queue_timeout(message: impl Into<String>, retry_after: Duration) -> Self {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            kind: ErrorKind::RateLimited,
            message: message.into(),
            param: None,
            code: "queue_timeout",
            retry_after: Some(retry_after),
        }
    }

    pub fn unavailable(code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: ErrorKind::Unavailable,
            message: message.into(),
            param: None,
            code,
            retry_after: Some(Duration::from_secs(1)),
        }
    }

    pub fn upstream(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind: ErrorKind::Upstream,
            message: message.into(),
            param: None,
            code: "upstream_error",
            retry_after: None,
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: ErrorKind::Internal,
            message: message.into(),
            param: None,
            code: "internal_error",
            retry_after: None,
        }
    }

    /// The outcome label of `router_requests_total`.
    pub fn outcome(&self) -> &'static str {
        match self.kind {
            ErrorKind::InvalidRequest | ErrorKind::TooLarge => "rejected",
            ErrorKind::RateLimited => "queue_timeout",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Upstream => "failed",
            ErrorKind::Internal => "error",
        }
    }

    /// The JSON body: `{"error": {"message", "type", "param", "code"}}`.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind.type_name(),
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.body().to_string();
        let mut response = (self.status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(after) = self.retry_after {
            let secs = after.as_secs_f64().ceil().max(1.0) as u64;
            if let Ok(value) = HeaderValue::from_str(&secs.to_string()) {
                headers.insert(header::RETRY_AFTER, value);
            }
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error;

    use super::*;
    use crate::host::RouteError;
    use crate::loader::LoadError;
    use crate::session_store::StoreError;

    /// No link of `err`'s chain both says its cause and returns it as `source()`: such a link
    /// prints its cause twice under `{:#}` (and any chain walker).
    fn says_each_context_once(err: &(dyn Error + 'static)) {
        let mut link = Some(err);
        while let Some(current) = link {
            if let Some(source) = current.source() {
                assert!(
                    !current.to_string().contains(&source.to_string()),
                    "`{current}` says its source `{source}` and returns it too"
                );
            }
            link = current.source();
        }
    }

    #[test]
    fn serve_errors_say_their_cause_once_whether_printed_alone_or_with_their_chain() {
        let not_found = || LoadError::NotFound {
            name: "two_tier_cost_fm".to_owned(),
            tried: vec![PathBuf::from("./libtwo_tier_cost_fm.so")],
        };
        let startup = ServeError::Startup {
            file: PathBuf::from("router.yaml"),
            cause: Box::new(StartupError::Plugin {
                index: 0,
                line: Some(10),
                source: Box::new(not_found()),
            }),
        };
        let cases = [
            (
                startup,
                "config router.yaml: plugins[0] (line 10): plugin `two_tier_cost_fm` not found; \
                 tried: ./libtwo_tier_cost_fm.so",
            ),
            (
                ServeError::SessionStore {
                    file: PathBuf::from("router.yaml"),
                    cause: StoreError::Unreachable {
                        url: "redis://127.0.0.1:1".to_owned(),
                        reason: "connection refused".to_owned(),
                    },
                },
                "config router.yaml: session store redis://127.0.0.1:1: connection refused",
            ),
            (
                ServeError::Bind {
                    addr: "127.0.0.1:8000".parse().unwrap(),
                    cause: std::io::Error::other("address in use"),
                },
                "cannot listen on 127.0.0.1:8000: address in use",
            ),
            (
                ServeError::from(std::io::Error::other("accept failed")),
                "server failed: accept failed",
            ),
        ];
        for (err, text) in cases {
            says_each_context_once(&err);
            // The whole message, alone (the reload log line) and as a chain (`main`'s `{:#}`).
            assert_eq!(err.to_string(), text);
            assert_eq!(Chain(&err).to_string(), text);
        }
        let route = RouteError::from(crate::sessions::SessionError::EmptySessionId);
        says_each_context_once(&route);
        assert_eq!(Chain(&route).to_string(), "session: session id is empty");
    }

    #[derive(Debug, thiserror::Error)]
    #[error("wrapped")]
    struct Wrapped(#[source] std::io::Error);

    #[test]
    fn local_resource_errors_are_found_in_the_chain() {
        for code in [
            libc::EMFILE,
            libc::ENFILE,
            libc::ENOBUFS,
            libc::EADDRNOTAVAIL,
        ] {
            let err = Wrapped(std::io::Error::from_raw_os_error(code));
            assert!(is_local_resource(&err), "{code}");
        }
        for code in [libc::ECONNREFUSED, libc::ECONNRESET, libc::EHOSTUNREACH] {
            let err = Wrapped(std::io::Error::from_raw_os_error(code));
            assert!(!is_local_resource(&err), "{code}");
        }
    }
}
