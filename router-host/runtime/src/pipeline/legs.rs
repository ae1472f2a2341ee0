//! A request's legs: each one routed, booked and sent to one row. A leg that fails before its
//! first byte (the engine refused the connection, timed out, or answered 502-504) is released
//! and, while `serve.retries` allows, followed by another leg on a row not tried yet
//! ([`Retries`]). Migration of a stream that fails mid-way, and prefill on one worker then
//! decode on another, are further legs of the same request.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use hyper::http::{header, HeaderMap, HeaderValue, StatusCode};
use plugin_api::abi::CompletionCode;

use super::admit::admit;
use super::book::book;
use super::{Answer, Inbound, Prepared};
use crate::app::App;
use crate::errors::ApiError;
use crate::health;
use crate::lifecycle::Flight;
use crate::prompt::Endpoint;
use crate::state::{LoadedConfig, Upstream};
use crate::upstream::UpstreamResponse;
use router_core::model::{Request, RowId};

/// One leg: a booking on a row, and the engine that row is on.
pub struct Leg<'a> {
    pub flight: Flight,
    pub upstream: &'a Upstream,
}

/// Whether a leg starts its request or carries on one that admission already let in. Further
/// legs queue past the queues' bound and are never shed (`router_core::model::Request::continues`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LegKind {
    /// The request's first leg: admitted, queued, shed or refused by its class.
    First,
    /// A retry after a leg failed before its first byte: a refusal is the client's answer.
    Retry,
    /// A stream continuing on another row (`serve.migration_limit`): a refusal ends the stream
    /// with its error event.
    Continuation,
}

impl LegKind {
    /// Whether admission turning this leg away is answered to the client as such (a `429`),
    /// and so counted in `router_admission_rejected_total`.
    pub fn refusal_is_the_answer(self) -> bool {
        self != LegKind::Continuation
    }
}

/// Route one leg: admission and the policy (the core), then the booking. `allowed` limits the
/// rows (after failed legs); `None` allows every row.
pub async fn route<'a>(
    app: &Arc<App>,
    loaded: &'a Arc<LoadedConfig>,
    inbound: &Inbound,
    prepared: &Prepared,
    allowed: Option<Vec<u64>>,
    kind: LegKind,
) -> Result<Leg<'a>, ApiError> {
    let request = Request {
        blocks: prepared.blocks.clone(),
        isl_tokens: prepared.isl_tokens,
        session_id: inbound.session.clone(),
        allowed_worker_ids: allowed,
        expected_output_tokens: prepared.expected_output_tokens,
        policy_class: super::admit::priority_class(&inbound.headers)?,
        continues: kind != LegKind::First,
        ..Request::default()
    };
    let decide_started = Instant::now();
    let routed = admit(app, loaded, request, inbound.endpoint, kind).await?;
    let decide_time = decide_started.elapsed().saturating_sub(routed.queued_for);
    app.metrics.stage("decide", decide_time.as_secs_f64());
    let flight = book(app, loaded, &routed, inbound.endpoint, inbound.received);
    let worker = flight.info.row.worker_id;
    let Some(upstream) = loaded.upstream(worker) else {
        flight.release_uncounted(CompletionCode::FAILED);
        return Err(ApiError::internal(format!(
            "worker {worker} has no upstream URL"
        )));
    };
    let overhead = inbound.received.elapsed().saturating_sub(routed.queued_for);
    app.metrics.stage("total", overhead.as_secs_f64());
    Ok(Leg { flight, upstream })
}

/// An upstream failure before the response headers.
#[derive(Debug)]
pub struct UpstreamFailure {
    pub kind: &'static str,
    pub message: String,
    pub status: StatusCode,
}

/// The kind of an [`UpstreamFailure`] that is the router's own (descriptors, ports, memory).
pub const LOCAL_FAILURE: &str = "local";

static LOCAL_RESOURCE_LOG: router_core::log_limit::LogLimit =
    router_core::log_limit::LogLimit::new(10_000);

/// Request headers forwarded to the engine.
const FORWARDED: &[&str] = &["authorization", "x-request-id", "traceparent", "tracestate"];

/// Send the leg's request: `body`, with the client's authorization, request id and trace
/// context headers, to the leg's row, within `serve.timeouts.response_ms` for the response
/// headers.
pub async fn send(
    loaded: &LoadedConfig,
    leg: &Leg<'_>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<UpstreamResponse, UpstreamFailure> {
    let upstream = leg.upstream;
    let row: RowId = leg.flight.info.row;
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

/// Statuses that mean "this engine cannot take it now": retried on another row.
pub fn retryable_status(status: StatusCode) -> bool {
    matches!(status.as_u16(), 502..=504)
}

/// What follows a leg.
// Returned once per leg and matched at once, never stored: boxing the answer would only add
// an allocation per request.
#[allow(clippy::large_enum_variant)]
pub enum Next {
    /// The engine answered: relay it.
    Answer(Answer),
    /// The leg failed before its first byte and was released; route another.
    Retry,
    /// The request ends with this error (its leg already released).
    Fail(ApiError),
}

/// The retry rule: up to `serve.retries` further legs, each on a row no failed leg was on.
pub struct Retries {
    left: u32,
    excluded: Vec<u64>,
    last_failure: Option<UpstreamFailure>,
}

impl Retries {
    pub fn new(retries: u32) -> Retries {
        Retries {
            left: retries,
            excluded: Vec::new(),
            last_failure: None,
        }
    }

    /// The next leg's kind: a retry once a leg failed.
    pub fn next_kind(&self) -> LegKind {
        match self.excluded.is_empty() {
            true => LegKind::First,
            false => LegKind::Retry,
        }
    }

    /// The rows the next leg may take: `None` (every row) until a leg failed.
    pub fn allowed(&self, loaded: &LoadedConfig) -> Option<Vec<u64>> {
        (!self.excluded.is_empty()).then(|| {
            loaded
                .upstreams
                .iter()
                .map(|u| u.id)
                .filter(|id| !self.excluded.contains(id))
                .collect()
        })
    }

    /// A leg on `worker` failed after its answer began (a whole answer's body broke off): the
    /// next leg avoids it, and a refusal to route names `why`. Takes no retry.
    pub fn exclude(&mut self, worker: u64, why: String) {
        self.excluded.push(worker);
        self.last_failure = Some(UpstreamFailure {
            kind: "body",
            message: why,
            status: StatusCode::BAD_GATEWAY,
        });
    }

    /// Routing the next leg was refused: when no row is left after a failed leg, the client
    /// gets that leg's upstream failure rather than "no eligible worker".
    pub fn refused(&mut self, err: ApiError) -> ApiError {
        match self.last_failure.take() {
            Some(failure) if err.status == StatusCode::SERVICE_UNAVAILABLE => {
                ApiError::upstream(failure.status, failure.message)
            }
            _ => err,
        }
    }

    /// Judge what `leg` got from its engine: count it, mark the engine down when it refused the
    /// connection, release the leg when it failed, and say what follows.
    pub fn settle(
        &mut self,
        app: &App,
        loaded: &LoadedConfig,
        flight: Flight,
        sent: Result<UpstreamResponse, UpstreamFailure>,
    ) -> Next {
        let worker = flight.info.row.worker_id;
        let last = self.left == 0;
        if let Ok(response) = &sent {
            app.metrics.upstream_connection(response.connection);
        }
        match sent {
            Ok(response) if retryable_status(response.status) && !last => {
                app.metrics.upstream_error(worker, "status");
                let why = format!("engine {worker} answered {}", response.status);
                self.retry(app, flight, worker, &why, None)
            }
            Ok(response) => Next::Answer(Answer { response, flight }),
            // The router's own descriptors or ports ran out: the engine is not at fault, and
            // another row would fail the same way.
            Err(failure) if failure.kind == LOCAL_FAILURE => {
                app.metrics.local_resource_error("upstream_connect");
                if let Some(left_out) = LOCAL_RESOURCE_LOG.check() {
                    tracing::error!(
                        worker,
                        error = %failure.message,
                        similar_lines_left_out = left_out,
                        "cannot connect to the engine: the router ran out of file descriptors, \
                         local ports or memory; the engine is not marked unhealthy \
                         (router_local_resource_errors_total)"
                    );
                }
                // Counted and logged once, by the front end, as the 503 it answers.
                flight.release_uncounted(CompletionCode::CANCELLED);
                Next::Fail(ApiError::local_resources(format!(
                    "the router is out of local resources (file descriptors, ports or memory) \
                     and cannot reach an engine now; retry later: {}",
                    failure.message
                )))
            }
            Err(failure) => {
                app.metrics.upstream_error(worker, failure.kind);
                if failure.kind == "connect" {
                    let why = Some(failure.message.clone());
                    health::mark(&app.health, loaded, worker, false, why);
                }
                if last {
                    tracing::warn!(worker, error = %failure.message, "upstream failed");
                    flight.release_uncounted(CompletionCode::FAILED);
                    return Next::Fail(ApiError::upstream(failure.status, failure.message));
                }
                let why = failure.message.clone();
                self.retry(app, flight, worker, &why, Some(failure))
            }
        }
    }

    fn retry(
        &mut self,
        app: &App,
        flight: Flight,
        worker: u64,
        why: &str,
        failure: Option<UpstreamFailure>,
    ) -> Next {
        app.metrics.retries.inc();
        flight.retried(why);
        self.excluded.push(worker);
        self.left = self.left.saturating_sub(1);
        if failure.is_some() {
            self.last_failure = failure;
        }
        Next::Retry
    }
}
