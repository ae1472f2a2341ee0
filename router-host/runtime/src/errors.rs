//! What a client is told when its request is refused ([`ApiError`]: a status and an
//! OpenAI-style JSON body, which each front end frames in its own protocol). The errors that are not a client's answer (start-up and reload, resource
//! exhaustion, cause chains) are in `failure.rs`, re-exported here.

use std::time::Duration;

use hyper::http::StatusCode;

pub use super::failure::{is_local_resource, is_local_resource_io, ServeError};
use super::tokenize::TokenizeError;

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
        ApiError::shed("queue_timeout", message, retry_after)
    }

    /// 429: admission refused or shed the request (`code` is its `x-router-rejected-reason`).
    pub fn shed(code: &'static str, message: impl Into<String>, retry_after: Duration) -> Self {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            kind: ErrorKind::RateLimited,
            message: message.into(),
            param: None,
            code,
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
            ErrorKind::RateLimited if self.code == "queue_timeout" => "queue_timeout",
            ErrorKind::RateLimited => "shed",
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

/// A prompt that could not be tokenized, as the client is told: a `413` for one the engine
/// refused as too large, else a `400`.
impl From<TokenizeError> for ApiError {
    fn from(err: TokenizeError) -> Self {
        match err {
            TokenizeError::TooLarge(message) => ApiError {
                status: StatusCode::PAYLOAD_TOO_LARGE,
                kind: ErrorKind::TooLarge,
                ..ApiError::bad_request("prompt_too_large", message)
            },
            other => ApiError::bad_request("tokenization_failed", other.to_string()),
        }
    }
}

impl ApiError {
    /// The `x-router-rejected-reason` header's value: the body's `code`, for a request the
    /// router refused for lack of capacity (`429`, `503`).
    pub fn rejected_reason(&self) -> Option<&'static str> {
        matches!(self.kind, ErrorKind::RateLimited | ErrorKind::Unavailable).then_some(self.code)
    }

    /// Seconds for the `retry-after` header, when the error has one (at least 1).
    pub fn retry_after_secs(&self) -> Option<u64> {
        self.retry_after
            .map(|after| after.as_secs_f64().ceil().max(1.0) as u64)
    }
}
