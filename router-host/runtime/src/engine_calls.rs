//! The router's own calls to engines (`/health`, `/metrics`, `/tokenize`, `/v1/models`): each
//! answer read whole up to a limit, redirects refused, and what was refused counted.

use super::failure::{error_chain, is_local_resource};
use super::metrics::Metrics;

/// `/tokenize` calls in flight per engine at most, as many as the completions pool keeps
/// connections; more wait for a turn within `serve.timeouts.tokenize_ms`.
pub const TOKENIZE_IN_FLIGHT_PER_ENGINE: usize = 256;

/// The most bytes read of an engine's answer to `GET /health` (vLLM sends an empty body).
pub const HEALTH_ANSWER_LIMIT: u64 = 64 << 10;
/// The most bytes read of an engine's `/metrics` (vLLM's is 10 to 100 KB per rank).
pub const METRICS_ANSWER_LIMIT: u64 = 16 << 20;
/// The most bytes read of an engine's `/v1/models` (a model and its LoRA adapters).
pub const MODELS_ANSWER_LIMIT: u64 = 4 << 20;

/// The most bytes read of an engine's `/tokenize` answer for a body of at most
/// `max_body_bytes`: a prompt has at most about one token per byte of text, and each id takes
/// at most 12 bytes of JSON (`4294967295, `); plus room for the other fields.
pub fn tokenize_answer_limit(max_body_bytes: u64) -> u64 {
    max_body_bytes.saturating_mul(12).saturating_add(64 << 10)
}

/// Why an engine's answer to one of the router's own calls was not used.
#[derive(Debug, thiserror::Error)]
pub enum AnswerError {
    /// The request did not get an answer (`local`: the router's own resources ran out).
    #[error("{message}")]
    Send { message: String, local: bool },
    #[error("{url}: the engine answered a redirect ({status}, to `{location}`); redirects from engines are not followed")]
    Redirect {
        url: String,
        status: reqwest::StatusCode,
        location: String,
    },
    #[error("{url}: the answer is larger than {limit} bytes; dropped unread")]
    TooLarge { url: String, limit: u64 },
    #[error("{url}: reading the answer: {message}")]
    Body { url: String, message: String },
}

impl AnswerError {
    /// The router's own resources ran out: the engine is not to blame.
    pub fn is_local(&self) -> bool {
        matches!(self, AnswerError::Send { local: true, .. })
    }
}

/// An engine's answer read whole: status, content type, body.
#[derive(Debug)]
pub struct Answer {
    pub status: reqwest::StatusCode,
    pub content_type: Option<reqwest::header::HeaderValue>,
    pub body: bytes::Bytes,
}

static ANSWER_LOG: router_core::log_limit::LogLimit = router_core::log_limit::LogLimit::new(10_000);

/// Send `request` (a call of the router's own to engine `worker`'s `endpoint`) and read its
/// answer, at most `limit` bytes of it: a redirect, or an answer over the limit, is refused,
/// logged (at most one line per 10 s) and counted in
/// `router_engine_answers_rejected_total{worker,endpoint,reason}`.
pub async fn call_engine(
    metrics: Option<&Metrics>,
    worker: u64,
    endpoint: &'static str,
    request: reqwest::RequestBuilder,
    limit: u64,
) -> Result<Answer, AnswerError> {
    let response = request.send().await.map_err(|err| AnswerError::Send {
        local: is_local_resource(&err),
        message: error_chain(&err),
    })?;
    let url = response.url().to_string();
    let status = response.status();
    let rejected = |reason: &'static str, err: AnswerError| {
        if let Some(metrics) = metrics {
            metrics.engine_answer_rejected(worker, endpoint, reason);
        }
        if let Some(left_out) = ANSWER_LOG.check() {
            tracing::warn!(
                worker,
                endpoint,
                reason,
                error = %err,
                similar_lines_left_out = left_out,
                "engine answer refused (router_engine_answers_rejected_total)"
            );
        }
        err
    };
    if status.is_redirection() {
        let location = response
            .headers()
            .get(reqwest::header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .chars()
            .take(200)
            .collect();
        return Err(rejected(
            "redirect",
            AnswerError::Redirect {
                url,
                status,
                location,
            },
        ));
    }
    let content_type = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .cloned();
    if response.content_length().is_some_and(|n| n > limit) {
        return Err(rejected("too_large", AnswerError::TooLarge { url, limit }));
    }
    // Kept as the pieces that came and joined once at the end: a buffer grown by doubling
    // left about six times the answer's size resident (the allocator keeps what it freed).
    let mut response = response;
    let mut pieces: Vec<bytes::Bytes> = Vec::new();
    let mut total: u64 = 0;
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                total += chunk.len() as u64;
                if total > limit {
                    return Err(rejected("too_large", AnswerError::TooLarge { url, limit }));
                }
                pieces.push(chunk);
            }
            Ok(None) => break,
            Err(err) => {
                return Err(AnswerError::Body {
                    url,
                    message: error_chain(&err),
                })
            }
        }
    }
    let body = if pieces.len() == 1 {
        pieces.pop().unwrap_or_default()
    } else {
        let mut joined = Vec::with_capacity(usize::try_from(total).unwrap_or(0));
        for piece in pieces.drain(..) {
            joined.extend_from_slice(&piece);
        }
        bytes::Bytes::from(joined)
    };
    Ok(Answer {
        status,
        content_type,
        body,
    })
}
