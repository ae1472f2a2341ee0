//! The request sent to the chosen engine and its answer relayed: forwarded headers, upstream
//! failures, the decision headers.

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::Response;

use super::relay::Relay;
use crate::model::RowId;
use crate::serve::lifecycle::{DecisionInfo, Flight};
use crate::serve::request::Endpoint;
use crate::serve::state::{LoadedConfig, Upstream};
use crate::serve::upstream::UpstreamResponse;

/// An upstream failure before the response headers.
pub(super) struct UpstreamFailure {
    pub(super) kind: &'static str,
    pub(super) message: String,
    pub(super) status: StatusCode,
}

/// Request headers forwarded to the engine.
const FORWARDED: &[&str] = &["authorization", "x-request-id", "traceparent", "tracestate"];

pub(super) async fn send(
    loaded: &LoadedConfig,
    upstream: &Upstream,
    row: RowId,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<UpstreamResponse, UpstreamFailure> {
    let mut forwarded = HeaderMap::new();
    forwarded.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    for name in FORWARDED {
        if let Some(value) = headers.get(*name) {
            forwarded.insert(*name, value.clone());
        }
    }
    if upstream.dp_size > 1 {
        // vLLM's external data-parallel routing header.
        forwarded.insert("x-data-parallel-rank", HeaderValue::from(row.dp_rank));
    }
    let timeout = loaded.serve.timeouts.response;
    let url = upstream.url(endpoint);
    match tokio::time::timeout(timeout, loaded.upstream.post(&url, forwarded, body)).await {
        Err(_) => Err(UpstreamFailure {
            kind: "timeout",
            message: format!(
                "engine {} sent no response within {} ms (serve.timeouts.response_ms)",
                upstream.id,
                timeout.as_millis()
            ),
            status: StatusCode::GATEWAY_TIMEOUT,
        }),
        Ok(Err(err)) => Err(UpstreamFailure {
            kind: if err.is_local() {
                LOCAL_FAILURE
            } else if err.is_connect() {
                "connect"
            } else {
                "request"
            },
            message: format!("engine {}: {err}", upstream.id),
            status: StatusCode::BAD_GATEWAY,
        }),
        Ok(Ok(response)) => Ok(response),
    }
}

/// The kind of an [`UpstreamFailure`] that is the router's own (descriptors, ports, memory).
pub(super) const LOCAL_FAILURE: &str = "local";

pub(super) static LOCAL_RESOURCE_LOG: crate::log_limit::LogLimit =
    crate::log_limit::LogLimit::new(10_000);

/// Statuses that mean "this engine cannot take it now": retried on another row.
pub(super) fn retryable_status(status: StatusCode) -> bool {
    matches!(status.as_u16(), 502..=504)
}

/// Response headers not relayed (hop-by-hop, and the length: the body is re-framed).
fn relayed(name: &HeaderName) -> bool {
    !matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "transfer-encoding"
            | "content-length"
            | "te"
            | "trailer"
            | "upgrade"
            | "proxy-authenticate"
            | "proxy-connection"
    )
}

/// Header text from a policy-supplied value: visible ASCII kept, anything else as `?`.
fn header_value(text: &str) -> HeaderValue {
    HeaderValue::from_str(text).unwrap_or_else(|_| {
        let cleaned: String = text
            .chars()
            .map(|c| {
                if c.is_ascii_graphic() || c == ' ' {
                    c
                } else {
                    '?'
                }
            })
            .collect();
        HeaderValue::from_str(&cleaned).unwrap_or_else(|_| HeaderValue::from_static("?"))
    })
}

pub fn decision_headers(headers: &mut HeaderMap, info: &DecisionInfo, config_number: u64) {
    let mut put = |name: &'static str, value: HeaderValue| {
        headers.insert(HeaderName::from_static(name), value);
    };
    put("x-router-worker", HeaderValue::from(info.row.worker_id));
    put("x-router-dp-rank", HeaderValue::from(info.row.dp_rank));
    put("x-router-instance", header_value(&info.instance));
    put("x-router-policy", header_value(&info.policy));
    put("x-router-reason", header_value(&info.reason));
    put("x-router-session", header_value(&info.session));
    put("x-router-config", HeaderValue::from(config_number));
    if let Some(fallback) = &info.fallback {
        put("x-router-fallback", header_value(fallback));
    }
}

/// The engine's answer relayed: its status, its headers (less hop-by-hop ones), the decision
/// headers, and its body byte for byte through a [`Relay`].
pub(super) fn respond(
    loaded: &LoadedConfig,
    response: UpstreamResponse,
    flight: Flight,
) -> Response {
    let status = response.status;
    let mut headers = HeaderMap::new();
    for (name, value) in &response.headers {
        if relayed(name) {
            headers.append(name.clone(), value.clone());
        }
    }
    if loaded.serve.decision_headers {
        decision_headers(&mut headers, &flight.info, loaded.number);
    }
    let ok = status.is_success();
    let sse = response
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("text/event-stream"));
    let relay = Relay::new(
        response.body,
        flight,
        loaded.serve.timeouts.stream_idle,
        ok,
        sse,
    );
    let mut out = Response::new(Body::from_stream(relay));
    *out.status_mut() = status;
    *out.headers_mut() = headers;
    out
}
