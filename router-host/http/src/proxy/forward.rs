//! The engine's answer relayed: its status, its headers less hop-by-hop ones, the decision
//! headers.

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName};
use axum::response::Response;

use router_runtime::pipeline::relay::{self, Moving, Relay};
use router_runtime::pipeline::{decision_headers, Answer};
use router_runtime::state::LoadedConfig;

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

/// The engine's answer relayed: its status, its headers (less hop-by-hop ones), the decision
/// headers, and its body through a [`Relay`] (byte for byte, but for the token ids a stream
/// that may move asked for and the client did not).
pub(super) fn respond(
    loaded: &LoadedConfig,
    answer: Answer,
    moving: Option<Box<Moving>>,
) -> Response {
    let Answer { response, flight } = answer;
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
    let sse = relay::is_sse(&response.headers);
    let relay = Relay::new(
        response.body,
        flight,
        loaded.serve.timeouts.stream_idle,
        ok,
        sse,
    )
    .moving(moving);
    let mut out = Response::new(Body::from_stream(relay));
    *out.status_mut() = status;
    *out.headers_mut() = headers;
    out
}
