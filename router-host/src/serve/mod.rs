//! `router-host serve`: the live OpenAI-compatible routing proxy (docs/serve.md).
//!
//! An adapter around the routing core, like `select` and `replay`: per request it tokenizes the
//! prompt (`tokenize.rs`), turns the tokens into block ids with the core's one rule, routes it
//! with `RoutingCore::submit_indexed` (sessions, admission, the policy call and booking are the
//! core's), forwards the body unchanged to the chosen engine and relays the answer byte for byte
//! (`proxy/`), mapping the request's edges onto the core with guards that cannot leak
//! (`lifecycle.rs`). Engine health and observed load come from a periodic probe (`health.rs`);
//! `/metrics` is in `metrics/`; one loaded configuration is a [`state::LoadedConfig`], swapped
//! atomically on reload (SIGHUP) while requests in flight finish on the one they started with.
//!
//! The modules in two layers; a lower one never imports a higher one.
//!
//! - The HTTP front end: this file (the axum router, the server, shutdown), `accept.rs`
//!   (client connections: the cap, shedding, header timeouts), `proxy/` (the OpenAI endpoints,
//!   and the engine's body relayed as the response), `request.rs` (the OpenAI bodies parsed and
//!   checked), `errors.rs` (the OpenAI-style error answers), `status.rs` (`/health`, `/ready`).
//! - Below it, nothing HTTP-server specific: `app.rs` (what handlers and tasks share; reload),
//!   `state.rs` (loaded configurations), `prompt.rs` (what a request asks of an engine),
//!   `pipeline.rs` (tokens, limits and block ids: what the core is asked), `tokenize.rs`
//!   with `segments.rs` and `words.rs`, `lifecycle.rs` (a request's edges on the core),
//!   `upstream.rs` (the client that sends completions to engines, on connections the request's
//!   own task drives), `coalesce.rs` (the relayed body's ready chunks joined into one write),
//!   `engine_calls.rs` (the router's own bounded calls to engines), `health.rs`, `metrics/` and
//!   `scrape.rs` (the values read at scrape time), `kv_events/`, `decider.rs` (which calls run
//!   on the async worker and which under `block_in_place`), `failure.rs` (start-up and reload
//!   errors, cause chains), `stop.rs`.

pub mod accept;
mod app;
pub mod coalesce;
pub mod decider;
pub mod engine_calls;
pub mod errors;
pub mod failure;
pub mod health;
pub mod kv_events;
#[cfg(test)]
mod layers;
pub mod lifecycle;
pub mod metrics;
pub mod pipeline;
pub mod prompt;
pub mod proxy;
pub mod request;
pub mod scrape;
pub mod segments;
pub mod state;
pub mod status;
mod stop;
#[cfg(test)]
mod test_tokenizers;
pub mod tokenize;
pub mod upstream;
pub mod words;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

pub use app::App;
pub use errors::ApiError;
pub use failure::ServeError;
pub use state::{LoadedConfig, ServeOptions, Upstream};
pub use stop::Stop;

use health::HealthTable;
use metrics::Metrics;
use state::Current;

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

/// An [`ApiError`] as an HTTP response: its status, `retry-after` when it has one, its JSON body.
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

async fn metrics_endpoint(axum::extract::State(app): axum::extract::State<Arc<App>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        app.metrics.encode(),
    )
        .into_response()
}

fn routes(app: Arc<App>) -> axum::Router {
    axum::Router::new()
        .route("/v1/completions", post(proxy::completions))
        .route("/v1/chat/completions", post(proxy::chat_completions))
        .route("/v1/models", get(proxy::models))
        .route("/health", get(status::alive))
        .route("/ready", get(status::ready))
        .route("/metrics", get(metrics_endpoint))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(app)
}

/// Probe forever, every `serve.health.interval` of the loaded configuration serving now.
async fn probe_loop(app: Arc<App>) {
    loop {
        let loaded = app.current.load();
        let interval = loaded.serve.health.interval;
        health::probe_round(&app.health, &app.metrics, &loaded).await;
        drop(loaded);
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = app.stopping.cancelled() => return,
        }
    }
}

/// Re-evaluate queues on a timer too: a class's `max_queue_wait_ms` ends a wait even when no
/// request completes meanwhile.
async fn queue_ticker(app: Arc<App>) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
            _ = app.stopping.cancelled() => return,
        }
        // In a task of its own, like every drain: a hung one must not stop this timer.
        lifecycle::after_release(&app, &app.current.load(), None);
    }
}

impl Server {
    /// Load the configuration (plugins, instances, workers, tokenizer), probe the engines once
    /// and bind the listening socket.
    pub async fn bind(options: ServeOptions) -> Result<Server, ServeError> {
        let load_options = options.clone();
        let loaded =
            tokio::task::spawn_blocking(move || LoadedConfig::load(&load_options, 1, None))
                .await
                .map_err(|err| ServeError::ReloadTask(err.to_string()))??;
        // Once the configuration is known to load: a refused one says only why.
        let open_files = accept::raise_open_files_limit();
        let max_connections = accept::default_max_connections(open_files);
        let addr = options.listen.unwrap_or(loaded.serve.listen);
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|cause| ServeError::Bind { addr, cause })?;
        let addr = listener.local_addr()?;
        let health = Arc::new(HealthTable::default());
        health.sync(&loaded.upstreams);
        let current = Arc::new(Current::new(loaded));
        let metrics = Metrics::new(Box::new(scrape::StateCollector {
            current: current.clone(),
            health: health.clone(),
        }));
        let app = Arc::new(App {
            current,
            options,
            metrics,
            health,
            flights: AtomicUsize::new(0),
            stopping: Stop::default(),
            reload_lock: tokio::sync::Mutex::new(()),
            loaded_configs: AtomicU64::new(1),
            reloads_started: AtomicU64::new(0),
            swapped_reload: AtomicU64::new(0),
            tokenizer_turn: AtomicUsize::new(0),
            kv_subscribers: kv_events::Subscribers::default(),
            decider: decider::Decider::for_current_runtime(),
        });
        let loaded = app.current.load();
        health::probe_round(&app.health, &app.metrics, &loaded).await;
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
        let prober = tokio::spawn(probe_loop(app.clone()));
        let ticker = tokio::spawn(queue_ticker(app.clone()));
        app.kv_subscribers
            .sync(&app.current.load(), &app.current, &app.metrics.kv);
        let server = accept::serve(
            app.clone(),
            self.listener,
            routes(app.clone()),
            self.max_connections,
        );
        let deadline = async {
            app.stopping.cancelled().await;
            let limit = app.current.load().serve.timeouts.shutdown;
            tracing::info!(
                in_flight = app.flights.load(Ordering::SeqCst),
                deadline_ms = limit.as_millis() as u64,
                "shutting down: no new connections; waiting for requests in flight"
            );
            tokio::time::sleep(limit).await;
        };
        let result = tokio::select! {
            () = server => Ok(()),
            () = deadline => {
                tracing::warn!(
                    in_flight = app.flights.load(Ordering::SeqCst),
                    "shutdown deadline passed; stopping with requests still in flight"
                );
                Ok(())
            }
        };
        app.stopping.cancel();
        prober.abort();
        ticker.abort();
        app.kv_subscribers.stop_all();
        tracing::info!("stopped");
        result
    }
}
