//! The OpenAI endpoints: read and check the body, tokenize the prompt, turn its tokens into
//! block ids, route it through the core (`submit_indexed`: sessions, admission, the policy,
//! booking), forward the body (unchanged, or with the prompt as its ids under
//! `serve.forward_token_ids`) to the chosen engine and relay its answer byte for byte.
//! The routing rules are the core's; this file only maps HTTP onto them.
//!
//! Here: the handlers and `proxy()`, one request from its body to the engine's answer;
//! `pipeline.rs` (below the front end) prepares what the core is asked, `route.rs` routes it through admission, `forward.rs`
//! sends it to the engine and answers with the engine's status and headers, `relay.rs` streams
//! its body.

mod forward;
mod relay;
mod route;

pub use forward::decision_headers;

use forward::{
    respond, retryable_status, send, UpstreamFailure, LOCAL_FAILURE, LOCAL_RESOURCE_LOG,
};
use route::{admit, decision_info, record_decision};

use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use plugin_api::abi::CompletionCode;

use super::app::App;
use super::errors::ApiError;
use super::health;
use super::lifecycle::Flight;
use super::pipeline::{self, with_token_ids, Prepared};
use super::request::{self, Endpoint};
use super::state::LoadedConfig;
use crate::model::Request;

/// `POST /v1/completions`.
pub async fn completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    handle(app, Endpoint::Completions, headers, body).await
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(app, Endpoint::ChatCompletions, headers, body).await
}

async fn handle(app: Arc<App>, endpoint: Endpoint, headers: HeaderMap, body: Body) -> Response {
    let received = Instant::now();
    let loaded = app.current.load();
    match proxy(&app, &loaded, endpoint, &headers, body, received).await {
        Ok(response) => response,
        Err(err) => {
            app.metrics.request(endpoint.label(), err.outcome());
            tracing::info!(
                endpoint = endpoint.label(),
                status = err.status.as_u16(),
                code = err.code,
                error = %err.message,
                "request refused"
            );
            err.into_response()
        }
    }
}

static BODY_TIMEOUT_LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new(10_000);

/// Read the body, refusing one over `limit` bytes with 413. A body a little over the limit is
/// read to its end first (so the client, still sending, gets the answer rather than a reset);
/// one far over it is cut off.
async fn read_body(headers: &HeaderMap, body: Body, limit: u64) -> Result<Bytes, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let discard_up_to = limit.saturating_mul(4).max(64 * 1024 * 1024);
    if declared.is_some_and(|n| n > discard_up_to) {
        return Err(ApiError::too_large(limit));
    }
    let mut stream = body.into_data_stream();
    let mut buffer: Vec<u8> =
        Vec::with_capacity(usize::try_from(declared.unwrap_or(0).min(limit)).unwrap_or(0));
    let mut seen: u64 = 0;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|err| {
            ApiError::bad_request("body_read_failed", format!("cannot read the body: {err}"))
        })?;
        seen = seen.saturating_add(chunk.len() as u64);
        if seen > discard_up_to {
            return Err(ApiError::too_large(limit));
        }
        if seen <= limit {
            buffer.extend_from_slice(&chunk);
        }
    }
    if seen > limit {
        return Err(ApiError::too_large(limit));
    }
    Ok(Bytes::from(buffer))
}

async fn proxy(
    app: &Arc<App>,
    loaded: &Arc<LoadedConfig>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Body,
    received: Instant,
) -> Result<Response, ApiError> {
    let serve = &loaded.serve;
    let body_read = serve.timeouts.body_read;
    let bytes =
        match tokio::time::timeout(body_read, read_body(headers, body, serve.max_body_bytes)).await
        {
            Ok(read) => read?,
            Err(_elapsed) => {
                app.metrics.client_timeout("body");
                if let Some(left_out) = BODY_TIMEOUT_LOG.check() {
                    tracing::warn!(
                        body_read_ms = body_read.as_millis() as u64,
                        similar_lines_left_out = left_out,
                        "client request body too slow; answered 408 and closed \
                     (serve.timeouts.body_read_ms)"
                    );
                }
                return Err(ApiError::body_timeout(body_read));
            }
        };
    let parsed = request::parse(endpoint, &bytes)?;
    let session = request::session_id(headers, &parsed.body, serve)?;

    let Prepared {
        ids,
        isl_tokens: isl,
        blocks,
        expected_output_tokens,
    } = pipeline::prepare(app, loaded, &parsed)
        .await
        .map_err(|err| ApiError::prepare(err, endpoint))?;

    let bytes = if serve.forward_token_ids {
        with_token_ids(endpoint, &parsed, &ids).unwrap_or(bytes)
    } else {
        bytes
    };

    let attempts = 1 + serve.retries as usize;
    let mut excluded: Vec<u64> = Vec::new();
    let mut last_failure: Option<UpstreamFailure> = None;
    for attempt in 0..attempts {
        let allowed = (!excluded.is_empty()).then(|| {
            loaded
                .upstreams
                .iter()
                .map(|u| u.id)
                .filter(|id| !excluded.contains(id))
                .collect::<Vec<_>>()
        });
        let request = Request {
            blocks: blocks.clone(),
            isl_tokens: isl,
            session_id: session.clone(),
            allowed_worker_ids: allowed,
            expected_output_tokens,
            ..Request::default()
        };
        let decide_started = Instant::now();
        let routed = match admit(app, loaded, request, endpoint).await {
            Ok(routed) => routed,
            // Retrying, and no other row is left: the client gets the upstream failure.
            Err(err) if attempt > 0 && err.status == StatusCode::SERVICE_UNAVAILABLE => {
                if let Some(failure) = last_failure {
                    return Err(ApiError::upstream(failure.status, failure.message));
                }
                return Err(err);
            }
            Err(err) => return Err(err),
        };
        let decide_time = decide_started.elapsed().saturating_sub(routed.queued_for);
        app.metrics.stage("decide", decide_time.as_secs_f64());
        let info = decision_info(loaded, &routed);
        record_decision(app, loaded, &routed, &info);
        let row = info.row;
        let flight = Flight::new(
            app.clone(),
            loaded.clone(),
            &routed,
            info,
            endpoint.label(),
            received,
        );
        let Some(upstream) = loaded.upstream(row.worker_id) else {
            flight.release_uncounted(CompletionCode::FAILED);
            return Err(ApiError::internal(format!(
                "worker {} has no upstream URL",
                row.worker_id
            )));
        };
        let overhead = received.elapsed().saturating_sub(routed.queued_for);
        app.metrics.stage("total", overhead.as_secs_f64());
        let last = attempt + 1 == attempts;
        let sent = send(loaded, upstream, row, endpoint, headers, bytes.clone()).await;
        if let Ok(response) = &sent {
            app.metrics.upstream_connection(response.connection);
        }
        match sent {
            Ok(response) if retryable_status(response.status) && !last => {
                app.metrics.upstream_error(row.worker_id, "status");
                app.metrics.retries.inc();
                flight.retried(&format!(
                    "engine {} answered {}",
                    row.worker_id, response.status
                ));
                excluded.push(row.worker_id);
            }
            Ok(response) => return Ok(respond(loaded, response, flight)),
            // The router's own descriptors or ports ran out: the engine is not at fault, and
            // another row would fail the same way.
            Err(failure) if failure.kind == LOCAL_FAILURE => {
                app.metrics.local_resource_error("upstream_connect");
                if let Some(left_out) = LOCAL_RESOURCE_LOG.check() {
                    tracing::error!(
                        worker = row.worker_id,
                        error = %failure.message,
                        similar_lines_left_out = left_out,
                        "cannot connect to the engine: the router ran out of file descriptors, \
                         local ports or memory; the engine is not marked unhealthy \
                         (router_local_resource_errors_total)"
                    );
                }
                // Counted and logged once, by `handle`, as the 503 it answers.
                flight.release_uncounted(CompletionCode::CANCELLED);
                return Err(ApiError::local_resources(format!(
                    "the router is out of local resources (file descriptors, ports or memory) \
                     and cannot reach an engine now; retry later: {}",
                    failure.message
                )));
            }
            Err(failure) => {
                app.metrics.upstream_error(row.worker_id, failure.kind);
                if failure.kind == "connect" {
                    health::mark(
                        &app.health,
                        loaded,
                        row.worker_id,
                        false,
                        Some(failure.message.clone()),
                    );
                }
                if last {
                    tracing::warn!(worker = row.worker_id, error = %failure.message, "upstream failed");
                    flight.release_uncounted(CompletionCode::FAILED);
                    return Err(ApiError::upstream(failure.status, failure.message));
                }
                app.metrics.retries.inc();
                flight.retried(&failure.message);
                excluded.push(row.worker_id);
                last_failure = Some(failure);
            }
        }
    }
    Err(ApiError::internal("no attempt was made"))
}

/// `GET /v1/models`: `serve.models` when configured, else the first healthy engine's list.
pub async fn models(State(app): State<Arc<App>>) -> Response {
    let loaded = app.current.load();
    let label = Endpoint::Models.label();
    if !loaded.serve.models.is_empty() {
        let data: Vec<serde_json::Value> = loaded
            .serve
            .models
            .iter()
            .map(|id| serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "router-host"}))
            .collect();
        app.metrics.request(label, "completed");
        let body = serde_json::json!({"object": "list", "data": data}).to_string();
        return ([(header::CONTENT_TYPE, "application/json")], body).into_response();
    }
    let mut last_error = String::from("no engine is healthy");
    for upstream in &loaded.upstreams {
        if !app.health.is_healthy(upstream.id) {
            continue;
        }
        let url = format!("{}/v1/models", upstream.base);
        let timeout = loaded.serve.timeouts.tokenize;
        let request = loaded.client.get(&url).timeout(timeout);
        let answer = super::engine_calls::call_engine(
            Some(&app.metrics),
            upstream.id,
            "models",
            request,
            super::engine_calls::MODELS_ANSWER_LIMIT,
        )
        .await;
        match answer {
            Ok(answer) if answer.status.is_success() => {
                app.metrics.request(label, "completed");
                let mut response = Response::new(Body::from(answer.body));
                if let Some(content_type) = answer.content_type {
                    response
                        .headers_mut()
                        .insert(header::CONTENT_TYPE, content_type);
                }
                return response;
            }
            Ok(answer) => last_error = format!("GET {url}: {}", answer.status),
            Err(err) => {
                if err.is_local() {
                    app.metrics.local_resource_error("models");
                }
                last_error = format!("GET {url}: {err}");
            }
        }
    }
    let err = ApiError::unavailable(
        "no_healthy_worker",
        format!("cannot list models: {last_error}"),
    );
    app.metrics.request(label, err.outcome());
    err.into_response()
}
