//! The proxy's own `GET /health` (alive) and `GET /ready` (configured, an engine healthy, and
//! every role with a policy instance that can serve it).

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use router_runtime::app::App;

/// `GET /health`: the proxy is alive.
pub async fn alive() -> Response {
    (
        StatusCode::OK,
        [("content-type", "application/json")],
        r#"{"status":"ok"}"#,
    )
        .into_response()
}

/// `GET /ready`: a configuration is loaded and at least one engine is healthy
/// ([`router_runtime::ready::readiness`]).
pub async fn ready(State(app): State<Arc<App>>) -> Response {
    let report = router_runtime::ready::readiness(&app);
    let status = if report.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        [("content-type", "application/json")],
        report.body.to_string(),
    )
        .into_response()
}
