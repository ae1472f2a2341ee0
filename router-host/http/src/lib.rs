//! `router-host serve`: the OpenAI-compatible HTTP front end of the live router
//! (docs/serve.md), over router-runtime.
//!
//! What a request does is router-runtime's pipeline (`router_runtime::pipeline`: tokens,
//! limits, block ids, admission and the policy, booking, the legs to engines and retries);
//! this crate maps HTTP onto it: this file (the axum routes, [`Server`], [`ServeHandle`],
//! shutdown, [`json_error`]), `accept.rs` (client connections: the cap, shedding, header
//! timeouts), `proxy/` (the OpenAI endpoints: the body read within its limit and timeout,
//! parsed and handed to the pipeline; the engine's answer relayed with the `Flight`'s edges
//! driven by its body), `status.rs` (`/health`, `/ready`). It is the only crate that names
//! axum.

pub mod accept;
pub mod proxy;
pub mod status;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use router_runtime::{ApiError, App, LoadedConfig, ServeError, ServeOptions};

/// A handle on a running server: reload, shut down, look inside.
#[derive(Debug, Clone)]
pub struct ServeHandle {
    app: Arc<App>,
}

impl ServeHandle {
    /// What SIGHUP does: reload the configuration; the number of the new one on success.
    pub async fn reload(&self) -> Result<u64, ServeError> {
        self.app.reload().await
    }

    /// What SIGTERM does: stop accepting, let requests in flight finish up to
    /// `serve.timeouts.shutdown_ms`, then [`Server::run`] returns.
    pub fn shutdown(&self) {
        self.app.stopping.cancel();
    }

    /// Requests booked and not finished, across configurations.
    pub fn in_flight(&self) -> usize {
        self.app.flights.load(Ordering::SeqCst)
    }

    /// The configuration serving new requests.
    pub fn loaded(&self) -> Arc<LoadedConfig> {
        self.app.current.load()
    }

    /// The `/metrics` text.
    pub fn metrics_text(&self) -> String {
        self.app.metrics.encode()
    }
}

/// A bound, not yet running server.
#[derive(Debug)]
pub struct Server {
    app: Arc<App>,
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
    /// `serve.max_connections` when the configuration sets none.
    max_connections: u64,
}

/// An [`ApiError`] as an HTTP response: its status, `retry-after` when it has one,
/// `x-router-rejected-reason` (the body's `code`) when it was refused for lack of capacity, its
/// JSON body.
pub fn json_error(err: ApiError) -> Response {
    let mut response = (err.status, err.body().to_string()).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(secs) = err.retry_after_secs() {
        headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    if let Some(reason) = err.rejected_reason() {
        headers.insert("x-router-rejected-reason", HeaderValue::from_static(reason));
    }
    response
}

async fn not_found() -> Response {
    json_error(ApiError {
        status: StatusCode::NOT_FOUND,
        ..ApiError::bad_request(
            "not_found",
            "no such endpoint; serve has POST /v1/completions, POST /v1/chat/completions, GET \
             /v1/models, /health, /ready, /metrics",
        )
    })
}

async fn method_not_allowed() -> Response {
    json_error(ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        ..ApiError::bad_request("method_not_allowed", "method not allowed on this endpoint")
    })
}

fn routes(app: Arc<App>) -> axum::Router {
    axum::Router::new()
        .route("/v1/completions", post(proxy::completions))
        .route("/v1/chat/completions", post(proxy::chat_completions))
        .route("/v1/models", get(proxy::models))
        .route("/health", get(status::alive))
        .route("/ready", get(status::ready))
        .route("/metrics", get(status::metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(app)
}

impl Server {
    /// Load the configuration (plugins, instances, workers, tokenizer), probe the engines once
    /// and bind the listening socket.
    pub async fn bind(options: ServeOptions) -> Result<Server, ServeError> {
        let app = App::start(options).await?;
        // Once the configuration is known to load: a refused one says only why.
        let open_files = accept::raise_open_files_limit();
        let max_connections = accept::default_max_connections(open_files);
        let loaded = app.current.load();
        let addr = app.options.listen.unwrap_or(loaded.serve.listen);
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|cause| ServeError::Bind { addr, cause })?;
        let addr = listener.local_addr()?;
        app.probe_engines().await;
        tracing::info!(
            open_files,
            max_connections = loaded.serve.max_connections.unwrap_or(max_connections),
            configured = loaded.serve.max_connections.is_some(),
            "client connections capped (serve.max_connections)"
        );
        Ok(Server {
            app,
            listener,
            addr,
            max_connections,
        })
    }

    /// The address the server listens on (the bound port when the configuration said `:0`).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn handle(&self) -> ServeHandle {
        ServeHandle {
            app: self.app.clone(),
        }
    }

    /// Serve until [`ServeHandle::shutdown`]; then stop accepting and wait for requests in
    /// flight, at most `serve.timeouts.shutdown_ms`.
    pub async fn run(self) -> Result<(), ServeError> {
        let app = self.app;
        let background = router_runtime::background::start(&app);
        let server = accept::serve(
            app.clone(),
            self.listener,
            routes(app.clone()),
            self.max_connections,
        );
        let result = tokio::select! {
            () = server => Ok(()),
            () = router_runtime::background::shutdown_deadline(&app) => Ok(()),
        };
        app.stopping.cancel();
        background.stop();
        tracing::info!("stopped");
        result
    }
}
