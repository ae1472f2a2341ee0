//! The OpenAI endpoints: read and check the body, tokenize the prompt, turn its tokens into
//! block ids, route it through the core (`submit_indexed`: sessions, admission, the policy,
//! booking), forward the body (unchanged, or with the prompt as its ids under
//! `serve.forward_token_ids`) to the chosen engine and relay its answer byte for byte.
//! The routing rules are the core's; this file only maps HTTP onto them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use plugin_api::abi::CompletionCode;
use router_core::blocks::{BlockHasher, Tenant};
use router_core::sessions::SessionError;

use super::errors::ApiError;
use super::health;
use super::lifecycle::{DecisionInfo, Flight, Queued, Relay};
use super::request::{self, Endpoint, Parsed, Prompt};
use super::state::{Generation, Upstream};
use super::tokenize::{self, TokenizeError, Tokens};
use super::upstream::UpstreamResponse;
use super::App;
use crate::eligibility::EligibilityError;
use crate::host::{RouteError, Routed, SessionOutcome, Submitted};
use crate::model::{Request, RowId};
use crate::router::SelectError;

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
    let generation = app.current.load();
    match proxy(&app, &generation, endpoint, &headers, body, received).await {
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

/// The bytes of text a prompt gives the tokenizer (chat: its messages' contents, plus a little
/// per message for the template); 0 for token ids.
fn text_bytes(prompt: &Prompt) -> usize {
    match prompt {
        Prompt::Text(text) => text.len(),
        Prompt::Tokens(_) => 0,
        Prompt::Chat(messages) => messages
            .iter()
            .map(|m| request::content_text(m.get("content")).len() + 8)
            .sum(),
    }
}

/// A rough token count for a prompt that could not be tokenized (routing without overlap).
fn estimate_tokens(prompt: &Prompt) -> u64 {
    match prompt {
        Prompt::Tokens(ids) => ids.len() as u64,
        _ => (text_bytes(prompt) as u64).div_ceil(4),
    }
}

/// Requests with more text than this are tokenized off the async worker: a 64 KiB prompt takes
/// a few milliseconds (serve/words.rs), one near `max_body_bytes` up to seconds, and a worker
/// held that long holds every request queued on it.
const INLINE_TOKENIZE_BYTES: usize = 64 << 10;

/// Every prompt's tokens, in order (one entry but for a batched completion); `Ok(None)` when
/// the remote tokenizer is unavailable for any of them (counted and logged: the request is
/// routed without overlap).
async fn tokens_for(
    app: &App,
    generation: &Generation,
    parsed: &Parsed,
) -> Result<Option<Vec<Tokens>>, ApiError> {
    let given: Option<Vec<Tokens>> = parsed
        .prompts()
        .map(|prompt| prompt.token_ids().map(Tokens::given))
        .collect();
    if given.is_some() {
        return Ok(given);
    }
    if let Some(local) = &generation.tokenizer {
        let tokenize = || local.tokenize_all(parsed);
        let tokens = if parsed.prompts().map(text_bytes).sum::<usize>() > INLINE_TOKENIZE_BYTES {
            crate::session_store::blocking(tokenize)
        } else {
            tokenize()
        };
        return tokens.map(Some).map_err(TokenizeError::into_api);
    }
    let Some(upstream) = app.tokenizer_upstream(generation) else {
        app.metrics.tokenize_fallbacks.inc();
        return Ok(None);
    };
    let timeout = generation.serve.timeouts.tokenize;
    let target = tokenize::TokenizeTarget {
        client: &generation.client,
        base: &upstream.base,
        worker: upstream.id,
        metrics: Some(&app.metrics),
        answer_limit: super::state::tokenize_answer_limit(generation.serve.max_body_bytes),
        turns: Some(&upstream.tokenize_turns),
    };
    match tokenize::remote_all(&target, parsed, timeout).await {
        Ok(tokens) => Ok(Some(tokens)),
        Err(err @ (TokenizeError::Invalid(_) | TokenizeError::TooLarge(_))) => Err(err.into_api()),
        Err(TokenizeError::Unavailable(message)) => {
            app.metrics.tokenize_fallbacks.inc();
            tracing::warn!(
                worker = upstream.id,
                error = %message,
                "remote tokenization failed; routing without prompt overlap"
            );
            Ok(None)
        }
    }
}

/// `serve.forward_token_ids`: the body with a completion's text prompt replaced by its token ids
/// (vLLM takes `prompt` as ids), and a list of text prompts by the list of their id lists, so
/// the engine skips its own tokenization. `ids` holds each prompt's ids, in order. `None` (the
/// body goes as received) for chat, ids already, or prompts not tokenized.
fn with_token_ids(endpoint: Endpoint, parsed: &Parsed, ids: &[Vec<u32>]) -> Option<Bytes> {
    use serde_json::Value;
    if endpoint != Endpoint::Completions
        || ids.len() != parsed.prompt_count()
        || ids.iter().any(Vec::is_empty)
    {
        return None;
    }
    let prompt = match (parsed.body.get("prompt"), ids) {
        (Some(Value::String(_)), [one]) => Value::from(one.clone()),
        (Some(Value::Array(texts)), _) if texts.iter().all(Value::is_string) => {
            Value::from(ids.to_vec())
        }
        _ => return None,
    };
    let mut body = parsed.body.clone();
    body.insert("prompt".to_owned(), prompt);
    serde_json::to_vec(&body).ok().map(Bytes::from)
}

/// Why a request was not routed, as the client is told.
fn route_error(err: RouteError) -> ApiError {
    match err {
        RouteError::Select(SelectError::Eligibility(e)) => {
            let code = match e {
                EligibilityError::AllOverloaded => "all_workers_overloaded",
                _ => "no_eligible_worker",
            };
            ApiError::unavailable(code, format!("no worker can take the request: {e}"))
        }
        RouteError::Select(e @ SelectError::Policy { .. }) => {
            ApiError::unavailable("policy_failed", format!("routing failed: {e}"))
        }
        // `session_affinity.store.on_unavailable: refuse` (docs/replicas.md).
        RouteError::Session(e @ SessionError::StoreUnavailable { .. }) => ApiError::unavailable(
            "session_store_unavailable",
            format!("the session binding store cannot be reached, and this router refuses requests that carry a session meanwhile: {e}"),
        ),
        RouteError::Session(e) => {
            ApiError::bad_request("invalid_session_id", format!("session: {e}"))
        }
        e @ RouteError::QueueTimeout { .. } => {
            ApiError::queue_timeout(e.to_string(), Duration::from_secs(1))
        }
        e @ RouteError::WorkerRemoved { .. } => {
            ApiError::unavailable("worker_removed", e.to_string())
        }
        e @ RouteError::EvaluationStalled { .. } => {
            ApiError::unavailable("policy_stalled", e.to_string())
        }
        e => ApiError::internal(e.to_string()),
    }
}

/// Dispatch through admission: at once, or after waiting in the class's queue up to its
/// `max_queue_wait_ms` (else `serve.timeouts.queue_ms`); 429 past that.
async fn admit(
    app: &Arc<App>,
    generation: &Arc<Generation>,
    request: Request,
    endpoint: Endpoint,
) -> Result<Routed, ApiError> {
    let core = generation.host.core();
    let wait = generation
        .config
        .policy_class(request.policy_class.as_deref().unwrap_or("default"))
        .and_then(|c| c.max_queue_wait)
        .unwrap_or(generation.serve.timeouts.queue);
    // The decision may wait: on a shared session store (a network round trip), or on a policy
    // that hangs (the watchdog takes the instance out of service, but cannot give its thread
    // back). `offload.rs` decides where it runs so that one stuck call never stops the server
    // (tests/serve_hangs.rs).
    let submitted = app
        .offload
        .decide(generation, || core.submit_indexed(request, true))
        .await;
    let ticket = match submitted {
        Ok(Submitted::Dispatched(routed)) => return Ok(routed),
        Ok(Submitted::Queued(ticket)) => ticket,
        Err(err) => return Err(route_error(err)),
    };
    let started = Instant::now();
    let mut queued = Queued::new(app.clone(), generation.clone(), ticket, endpoint.label());
    let waited = match queued.ticket() {
        Some(ticket) => tokio::time::timeout(wait, ticket).await,
        None => return Err(ApiError::internal("queued request has no ticket")),
    };
    let outcome = match waited {
        Ok(outcome) => outcome,
        Err(_elapsed) if queued.cancel() => {
            app.metrics.queue_outcome("timeout");
            app.metrics
                .queue_wait
                .observe(started.elapsed().as_secs_f64());
            return Err(ApiError::queue_timeout(
                format!(
                    "waited {} ms in the admission queue without a free row; retry later",
                    wait.as_millis()
                ),
                Duration::from_secs(1),
            ));
        }
        // Being dispatched at this moment: its outcome is moments away, unless the policy call
        // deciding it hung. Past the core's stall limit it is given up: the core releases
        // whatever it gets, and the client hears why.
        Err(_elapsed) => {
            let stall = core.drain_stall();
            let Some(ticket) = queued.ticket() else {
                return Err(ApiError::internal("queued request has no ticket"));
            };
            match tokio::time::timeout(stall, &mut *ticket).await {
                Ok(outcome) => outcome,
                Err(_elapsed) => match core.abandon(ticket) {
                    Some(outcome) => Some(outcome),
                    None => {
                        queued.disarm();
                        app.metrics.queue_outcome("stalled");
                        app.metrics
                            .queue_wait
                            .observe(started.elapsed().as_secs_f64());
                        let stall_ms = u64::try_from(stall.as_millis()).unwrap_or(u64::MAX);
                        return Err(route_error(RouteError::EvaluationStalled { stall_ms }));
                    }
                },
            }
        }
    };
    queued.disarm();
    app.metrics
        .queue_wait
        .observe(started.elapsed().as_secs_f64());
    match outcome {
        Some(Ok(routed)) => {
            app.metrics.queue_outcome("admitted");
            Ok(routed)
        }
        Some(Err(err)) => {
            let timeout = matches!(err, RouteError::QueueTimeout { .. });
            app.metrics
                .queue_outcome(if timeout { "timeout" } else { "failed" });
            Err(route_error(err))
        }
        None => Err(ApiError::internal("the queued request's outcome was lost")),
    }
}

fn decision_info(generation: &Generation, routed: &Routed) -> DecisionInfo {
    let d = &routed.decision;
    let router = generation.host.router();
    let session = match &routed.session {
        None => "-".to_owned(),
        Some(SessionOutcome::Dispatched(o)) => o.as_str().to_owned(),
        Some(SessionOutcome::HardBindingGone) => "hard_binding_gone".to_owned(),
        Some(SessionOutcome::NotRecorded(_)) => "not_recorded".to_owned(),
    };
    DecisionInfo {
        row: d.row,
        instance: router.instance(d.instance).name.clone(),
        policy: router.instance(d.decided_by).type_name.clone(),
        reason: d
            .explanation
            .as_ref()
            .map(|e| e.reason.clone())
            .filter(|r| !r.is_empty())
            .unwrap_or_else(|| "none".to_owned()),
        fallback: d.fallback.as_ref().map(ToString::to_string),
        session,
        queued: routed.queued_for,
    }
}

fn record_decision(app: &App, generation: &Generation, routed: &Routed, info: &DecisionInfo) {
    app.metrics
        .decisions
        .get_or_create(&super::metrics::DecisionLabels {
            instance: info.instance.clone(),
            policy: info.policy.clone(),
            reason: info.reason.clone(),
            fallback: info.fallback.is_some().to_string(),
        })
        .inc();
    if info.session != "-" {
        app.metrics.session(&info.session);
    }
    if let Some(e) = &routed.decision.explanation {
        tracing::debug!(
            worker = info.row.worker_id,
            dp_rank = info.row.dp_rank,
            instance = %info.instance,
            reason = %e.reason,
            fields = ?e.fields,
            labels = ?e.labels,
            candidates = routed.decision.candidates,
            pick_ns = routed.decision.pick_ns,
            config = generation.number,
            "decision explained"
        );
    }
}

/// An upstream failure before the response headers.
struct UpstreamFailure {
    kind: &'static str,
    message: String,
    status: StatusCode,
}

pub(crate) fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// Request headers forwarded to the engine.
const FORWARDED: &[&str] = &["authorization", "x-request-id", "traceparent", "tracestate"];

async fn send(
    generation: &Generation,
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
    let timeout = generation.serve.timeouts.response;
    let url = upstream.url(endpoint);
    match tokio::time::timeout(timeout, generation.upstream.post(&url, forwarded, body)).await {
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
const LOCAL_FAILURE: &str = "local";

static LOCAL_RESOURCE_LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new(10_000);

/// Statuses that mean "this engine cannot take it now": retried on another row.
fn retryable_status(status: StatusCode) -> bool {
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

pub fn decision_headers(headers: &mut HeaderMap, info: &DecisionInfo, generation: u64) {
    let mut put = |name: &'static str, value: HeaderValue| {
        headers.insert(HeaderName::from_static(name), value);
    };
    put("x-router-worker", HeaderValue::from(info.row.worker_id));
    put("x-router-dp-rank", HeaderValue::from(info.row.dp_rank));
    put("x-router-instance", header_value(&info.instance));
    put("x-router-policy", header_value(&info.policy));
    put("x-router-reason", header_value(&info.reason));
    put("x-router-session", header_value(&info.session));
    put("x-router-config", HeaderValue::from(generation));
    if let Some(fallback) = &info.fallback {
        put("x-router-fallback", header_value(fallback));
    }
}

async fn proxy(
    app: &Arc<App>,
    generation: &Arc<Generation>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Body,
    received: Instant,
) -> Result<Response, ApiError> {
    let serve = &generation.serve;
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

    let tokenize_started = Instant::now();
    let tokens = tokens_for(app, generation, &parsed).await?;
    let tokenize_time = tokenize_started.elapsed();
    app.metrics.stage("tokenize", tokenize_time.as_secs_f64());
    // Each prompt's ids, in order (none when it could not be tokenized).
    let (ids, max_model_len): (Vec<Vec<u32>>, Option<u64>) = match tokens {
        Some(tokens) => {
            let max_model_len = tokens.iter().filter_map(|t| t.max_model_len).min();
            (tokens.into_iter().map(|t| t.ids).collect(), max_model_len)
        }
        None => (Vec::new(), None),
    };
    let lengths: Vec<u64> = parsed
        .prompts()
        .enumerate()
        .map(|(i, prompt)| match ids.get(i) {
            Some(ids) if !ids.is_empty() => ids.len() as u64,
            _ => estimate_tokens(prompt),
        })
        .collect();
    // The engine prefills every prompt of a batch: all of them are booked.
    let isl = lengths.iter().fold(0u64, |sum, &n| sum.saturating_add(n));
    // The limits hold per prompt, as vLLM checks them.
    for (limit, what) in [
        (serve.max_prompt_tokens, "serve.max_prompt_tokens"),
        (max_model_len, "the engine's max_model_len"),
    ] {
        let Some(limit) = limit else { continue };
        let Some((index, &n)) = lengths.iter().enumerate().find(|&(_, &n)| n > limit) else {
            continue;
        };
        let message = if lengths.len() == 1 {
            format!("the prompt has {n} tokens, over the limit of {limit} ({what})")
        } else {
            format!(
                "prompt {index} has {n} tokens, over the limit of {limit} ({what}); the batch's \
                 {} prompts count from 0",
                lengths.len()
            )
        };
        return Err(ApiError::bad_request("prompt_too_long", message).param(
            if endpoint == Endpoint::Completions {
                "prompt"
            } else {
                "messages"
            },
        ));
    }
    // An adapter's KV is its own: vLLM keys its blocks with the adapter's name.
    let lora = Some(parsed.model.as_str()).filter(|m| serve.lora_adapters.iter().any(|a| a == m));
    let tenant = Tenant {
        lora,
        cache_salt: parsed.cache_salt.as_deref(),
    };
    let hasher = BlockHasher::new(generation.config.block_size, tenant)
        .map_err(|err| ApiError::internal(err.to_string()))?;
    // The core's `Request` carries one block chain, so a batch is routed by its first prompt's
    // blocks: a batch's shared preamble is in its first prompt, and the others' own overlap is
    // not credited. `isl` above still counts every prompt.
    let mut blocks = Vec::new();
    hasher.prompt_blocks(ids.first().map_or(&[][..], Vec::as_slice), &mut blocks);
    let expected_output_tokens = parsed
        .body
        .get("max_completion_tokens")
        .or_else(|| parsed.body.get("max_tokens"))
        .and_then(serde_json::Value::as_u64);

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
            generation
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
        let routed = match admit(app, generation, request, endpoint).await {
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
        let info = decision_info(generation, &routed);
        record_decision(app, generation, &routed, &info);
        let row = info.row;
        let flight = Flight::new(
            app.clone(),
            generation.clone(),
            &routed,
            info,
            endpoint.label(),
            received,
        );
        let Some(upstream) = generation.upstream(row.worker_id) else {
            flight.release_uncounted(CompletionCode::FAILED);
            return Err(ApiError::internal(format!(
                "worker {} has no upstream URL",
                row.worker_id
            )));
        };
        let overhead = received.elapsed().saturating_sub(routed.queued_for);
        app.metrics.stage("total", overhead.as_secs_f64());
        let last = attempt + 1 == attempts;
        let sent = send(generation, upstream, row, endpoint, headers, bytes.clone()).await;
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
            Ok(response) => return Ok(respond(generation, response, flight)),
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
                        app,
                        generation,
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

/// The engine's answer relayed: its status, its headers (less hop-by-hop ones), the decision
/// headers, and its body byte for byte through a [`Relay`].
fn respond(generation: &Generation, response: UpstreamResponse, flight: Flight) -> Response {
    let status = response.status;
    let mut headers = HeaderMap::new();
    for (name, value) in &response.headers {
        if relayed(name) {
            headers.append(name.clone(), value.clone());
        }
    }
    if generation.serve.decision_headers {
        decision_headers(&mut headers, &flight.info, generation.number);
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
        generation.serve.timeouts.stream_idle,
        ok,
        sse,
    );
    let mut out = Response::new(Body::from_stream(relay));
    *out.status_mut() = status;
    *out.headers_mut() = headers;
    out
}

/// `GET /v1/models`: `serve.models` when configured, else the first healthy engine's list.
pub async fn models(State(app): State<Arc<App>>) -> Response {
    let generation = app.current.load();
    let label = Endpoint::Models.label();
    if !generation.serve.models.is_empty() {
        let data: Vec<serde_json::Value> = generation
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
    for upstream in &generation.upstreams {
        if !app.health.is_healthy(upstream.id) {
            continue;
        }
        let url = format!("{}/v1/models", upstream.base);
        let timeout = generation.serve.timeouts.tokenize;
        let request = generation.client.get(&url).timeout(timeout);
        let answer = super::state::call_engine(
            Some(&app.metrics),
            upstream.id,
            "models",
            request,
            super::state::MODELS_ANSWER_LIMIT,
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
