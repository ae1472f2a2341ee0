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
pub async fn admit(
    app: &Arc<App>,
    loaded: &Arc<LoadedConfig>,
    request: Request,
    endpoint: Endpoint,
) -> Result<Routed, ApiError> {
    let core = loaded.host.core();
    let wait = loaded
        .config
        .policy_class(request.policy_class.as_deref().unwrap_or("default"))
        .and_then(|c| c.max_queue_wait)
        .unwrap_or(loaded.serve.timeouts.queue);
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
        Err(err) => return Err(route_error(err)),
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
