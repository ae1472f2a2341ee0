//! The OpenAI endpoints: read and check the body, tokenize the prompt, turn its tokens into
//! block ids, route it through the core (`submit_indexed`: sessions, admission, the policy,
//! booking), forward the body (unchanged, or with the prompt as its ids under
//! `serve.forward_token_ids`) to the chosen engine and relay its answer byte for byte.
//! The routing rules are the core's; this file only maps HTTP onto them.
//!
//! Here: the handlers and `proxy()`, which reads the body, parses it, and hands it to the
//! front-end-neutral `pipeline` (tokens, block ids, limits, admission, the policy, booking,
//! the legs to engines); `forward.rs` answers with the engine's status and headers,
//! `relay.rs` streams its body.

mod forward;

use forward::respond;

use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;

use router_runtime::app::App;
use router_runtime::errors::ApiError;
use router_runtime::pipeline::{self, Inbound};
use router_runtime::request::{self, Endpoint};
use router_runtime::state::LoadedConfig;

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
    match proxy(&app, &loaded, endpoint, headers, body, received).await {
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
            crate::json_error(err)
        }
    }
}

static BODY_TIMEOUT_LOG: router_core::log_limit::LogLimit =
    router_core::log_limit::LogLimit::new(10_000);

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

/// The body read within `serve.timeouts.body_read_ms`, parsed and checked, then the pipeline;
/// the engine's answer is relayed.
async fn proxy(
    app: &Arc<App>,
    loaded: &Arc<LoadedConfig>,
    endpoint: Endpoint,
    headers: HeaderMap,
    body: Body,
    received: Instant,
) -> Result<Response, ApiError> {
    let serve = &loaded.serve;
    let body_read = serve.timeouts.body_read;
    let bytes = match tokio::time::timeout(
        body_read,
        read_body(&headers, body, serve.max_body_bytes),
    )
    .await
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
    let session = request::session_id(&headers, &parsed.body, serve)?;
    let inbound = Inbound {
        endpoint,
        parsed,
        body: bytes,
        session,
        headers,
        received,
    };
    let (answer, moving) = pipeline::run_moving(app, loaded, inbound).await?;
    Ok(respond(loaded, answer, moving))
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
        let answer = router_runtime::engine_calls::call_engine(
            Some(&app.metrics),
            upstream.id,
            "models",
            request,
            router_runtime::engine_calls::MODELS_ANSWER_LIMIT,
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
    crate::json_error(err)
}
