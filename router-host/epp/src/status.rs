//! The picker's own HTTP port (`epp.metrics_listen`): `GET /metrics`, `/health` (alive) and
//! `/ready` (the runtime's readiness report), on hyper's HTTP/1 server. Connections are
//! capped and each header read is timed out: the port is for scrapers and probes.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::http::{header, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use router_runtime::ready::{status_page, StatusPage};
use router_runtime::App;

/// Connections served at once; more wait in the listen backlog.
const MAX_CONNECTIONS: usize = 64;
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// What `path` answers.
pub fn respond(app: &App, path: &str) -> Response<Full<Bytes>> {
    let (status, content_type, body) = match path {
        "/metrics" => status_page(app, StatusPage::Metrics),
        "/health" => status_page(app, StatusPage::Health),
        "/ready" => status_page(app, StatusPage::Ready),
        _ => (
            404,
            "application/json",
            r#"{"error":"no such endpoint; the picker's HTTP port has /metrics, /health, /ready"}"#
                .to_owned(),
        ),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() =
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        hyper::http::HeaderValue::from_static(content_type),
    );
    response
}

/// Serve `listener` until the task is dropped.
pub async fn serve(app: Arc<App>, listener: TcpListener) {
    let turns = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(permit) = turns.clone().acquire_owned().await else {
            return;
        };
        let socket = match listener.accept().await {
            Ok((socket, _)) => socket,
            Err(err) => {
                tracing::warn!(error = %err, "metrics port: accept failed");
                // A descriptor shortage passes; do not spin on it.
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let app = app.clone();
        tokio::spawn(async move {
            let service =
                hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
                    let response = respond(&app, request.uri().path());
                    async move { Ok::<_, Infallible>(response) }
                });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(socket), service)
                .await;
            drop(permit);
        });
    }
}
