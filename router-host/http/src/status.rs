//! The proxy's own `GET /health` (alive), `GET /ready` (configured, an engine healthy, and
//! every role with a policy instance that can serve it) and `GET /metrics`: the pages of
//! [`router_runtime::ready::status_page`], framed by axum.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};

use router_runtime::app::App;
use router_runtime::ready::{status_page, StatusPage};

fn page(app: &App, page: StatusPage) -> Response {
    let (status, content_type, body) = status_page(app, page);
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, [(header::CONTENT_TYPE, content_type)], body).into_response()
}

/// `GET /health`: the proxy is alive.
pub async fn alive(State(app): State<Arc<App>>) -> Response {
    page(&app, StatusPage::Health)
}

/// `GET /ready`: a configuration is loaded and at least one engine is healthy
/// ([`router_runtime::ready::readiness`]).
pub async fn ready(State(app): State<Arc<App>>) -> Response {
    page(&app, StatusPage::Ready)
}

/// `GET /metrics`.
pub async fn metrics(State(app): State<Arc<App>>) -> Response {
    page(&app, StatusPage::Metrics)
}
