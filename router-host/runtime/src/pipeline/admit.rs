//! The admission step: the request routed through the core (sessions, admission, the
//! policy, booking) at once, or after a wait in its class's queue; the core's refusals as
//! the client is told them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use router_core::sessions::SessionError;

use crate::app::App;
use crate::errors::ApiError;
use crate::lifecycle::Queued;
use crate::prompt::Endpoint;
use crate::state::LoadedConfig;
use router_core::eligibility::EligibilityError;
use router_core::model::Request;
use router_policies::host::{RouteError, Routed, Submitted};
use router_policies::policy_set::SelectError;

/// The request header naming its policy class (its priority); absent = the class `default`.
pub const PRIORITY_CLASS_HEADER: &str = "x-router-priority-class";

/// How long a client refused or shed by admission is told to wait (`retry-after`).
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The policy class a request names in [`PRIORITY_CLASS_HEADER`] (checked against the
/// configured classes when it is routed: an unknown one is a `400`).
pub fn priority_class(headers: &hyper::http::HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get(PRIORITY_CLASS_HEADER) else {
        return Ok(None);
    };
    match value.to_str().map(str::trim) {
        Ok("") => Ok(None),
        Ok(name) if name.len() <= 128 => Ok(Some(name.to_owned())),
        _ => Err(ApiError::bad_request(
            "unknown_policy_class",
            format!(
                "the `{PRIORITY_CLASS_HEADER}` header must name a policy class (visible ASCII, \
                 at most 128 bytes)"
            ),
        )),
    }
}

/// The `x-router-rejected-reason` of a request admission refused or shed, if it was.
fn rejected_reason(err: &RouteError) -> Option<&'static str> {
    match err {
        RouteError::QueueFull { .. } => Some("queue_full"),
        RouteError::Shed { .. } => Some("shed_for_higher_priority"),
        RouteError::QueueTimeout { .. } => Some("queue_timeout"),
        _ => None,
    }
}

/// Why a request was not routed, as the client is told.
pub fn route_error(err: RouteError) -> ApiError {
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
        e @ (RouteError::QueueTimeout { .. }
        | RouteError::QueueFull { .. }
        | RouteError::Shed { .. }) => {
            let code = rejected_reason(&e).unwrap_or("queue_timeout");
            ApiError::shed(code, e.to_string(), RETRY_AFTER)
        }
        e @ RouteError::UnknownClass { .. } => {
            ApiError::bad_request("unknown_policy_class", e.to_string())
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
pub async fn admit(
    app: &Arc<App>,
    loaded: &Arc<LoadedConfig>,
    request: Request,
    endpoint: Endpoint,
    kind: super::legs::LegKind,
) -> Result<Routed, ApiError> {
    let core = loaded.host.core();
    let class = request
        .policy_class
        .clone()
        .unwrap_or_else(|| "default".to_owned());
    let wait = loaded
        .config
        .policy_class(&class)
        .and_then(|c| c.max_queue_wait)
        .unwrap_or(loaded.serve.timeouts.queue);
    // Counted per request answered `429`: a continuation turned away ends its stream with an
    // error event instead, counted where the migration ends (`router_migrations_total`).
    let counted = kind.refusal_is_the_answer();
    let refused = |err: RouteError| {
        if let Some(reason) = rejected_reason(&err).filter(|_| counted) {
            app.metrics.admission_rejected(&class, reason);
            tracing::debug!(class = %class, reason, "{err}");
        }
        route_error(err)
    };
    // The decision may wait: on a shared session store (a network round trip), or on a policy
    // that hangs (the watchdog takes the instance out of service, but cannot give its thread
    // back). `decider.rs` decides where it runs so that one stuck call never stops the server
    // (tests/serve_hangs.rs).
    let submitted = app
        .decider
        .decide(loaded, || core.submit_indexed(request, true))
        .await;
    let ticket = match submitted {
        Ok(Submitted::Dispatched(routed)) => return Ok(routed),
        Ok(Submitted::Queued(ticket)) => ticket,
        Err(err) => return Err(refused(err)),
    };
    let started = Instant::now();
    let mut queued = Queued::new(app.clone(), loaded.clone(), ticket, endpoint.label());
    let waited = match queued.ticket() {
        Some(ticket) => tokio::time::timeout(wait, ticket).await,
        None => return Err(ApiError::internal("queued request has no ticket")),
    };
    let outcome = match waited {
        Ok(outcome) => outcome,
        Err(_elapsed) if queued.cancel() => {
            app.metrics.queue_outcome("timeout");
            if counted {
                app.metrics.admission_rejected(&class, "queue_timeout");
            }
            app.metrics
                .queue_wait
                .observe(started.elapsed().as_secs_f64());
            return Err(ApiError::queue_timeout(
                format!(
                    "waited {} ms in the admission queue without a free row; retry later",
                    wait.as_millis()
                ),
                RETRY_AFTER,
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
            app.metrics.queue_outcome(match err {
                RouteError::QueueTimeout { .. } => "timeout",
                RouteError::Shed { .. } => "shed",
                _ => "failed",
            });
            Err(refused(err))
        }
        None => Err(ApiError::internal("the queued request's outcome was lost")),
    }
}
