//! A request's edges mapped onto the routing core, with guards so that nothing leaks whatever
//! way a request ends (docs/serve.md, "Lifecycle"):
//!
//! - booked at dispatch ([`Flight::new`], after `submit_indexed` dispatched it);
//! - prefill released at the first upstream body chunk ([`Flight::first_byte`]);
//! - `finish(COMPLETED)` at the end of the upstream body, `finish(FAILED)` on an upstream error
//!   or timeout, and `finish(CANCELLED)` when the [`Flight`] is dropped unfinished: the client
//!   went away (hyper drops the handler future or the response body);
//! - a queued request whose client goes away is taken out of its queue ([`Queued`]'s drop).
//!
//! Every release frees the load at once; the policy's `on_complete` call and re-evaluating the
//! queues (capacity was freed) follow in a task of their own ([`after_release`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use plugin_api::abi::CompletionCode;
use prometheus_client::metrics::gauge::Gauge;

use super::app::App;
use super::metrics::Metrics;
use super::state::LoadedConfig;
use router_core::model::RowId;
use router_policies::host::{OwedHook, RequestId, Routed, Ticket};

/// What the per-request log line and the metrics say about a decision.
#[derive(Debug, Clone)]
pub struct DecisionInfo {
    pub row: RowId,
    /// The configured instance.
    pub instance: String,
    /// The type of the instance that decided (the built-in default on fallback).
    pub policy: String,
    /// The deciding policy's stable reason (`none` when it gives no explanation).
    pub reason: String,
    pub fallback: Option<String>,
    /// What dispatch did to the session binding (`-` without a session or affinity).
    pub session: String,
    pub queued: Duration,
}

/// One dispatched request until it ends: releases its booking exactly once.
pub struct Flight {
    app: Arc<App>,
    loaded: Arc<LoadedConfig>,
    id: RequestId,
    pub info: DecisionInfo,
    endpoint: &'static str,
    gauge: Gauge,
    prefilled: bool,
    done: bool,
    /// Whether this attempt's end is the request's end (false for an attempt being retried).
    final_attempt: bool,
    started: Instant,
}

impl Flight {
    pub fn new(
        app: Arc<App>,
        loaded: Arc<LoadedConfig>,
        routed: &Routed,
        info: DecisionInfo,
        endpoint: &'static str,
        started: Instant,
    ) -> Flight {
        let gauge = app.metrics.inflight(info.row.worker_id, info.row.dp_rank);
        gauge.inc();
        app.metrics.dispatched(info.row.worker_id, info.row.dp_rank);
        app.flights
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        app.booking_changed.notify_one();
        Flight {
            app,
            loaded,
            id: routed.id,
            info,
            endpoint,
            gauge,
            prefilled: false,
            done: false,
            final_attempt: true,
            started,
        }
    }

    /// The first upstream byte arrived: the prompt is prefilled.
    /// The metrics this request counts into.
    pub fn metrics(&self) -> &Metrics {
        &self.app.metrics
    }

    pub fn first_byte(&mut self) {
        if !self.prefilled && !self.done {
            self.prefilled = true;
            self.loaded.host.prefill_complete(self.id);
            after_release(&self.app, &self.loaded, None);
        }
    }

    /// This attempt failed and the request will be retried elsewhere: release it as FAILED
    /// without counting the request as ended.
    pub fn retried(mut self, why: &str) {
        self.final_attempt = false;
        tracing::warn!(
            worker = self.info.row.worker_id,
            dp_rank = self.info.row.dp_rank,
            error = why,
            "upstream failed before its first byte; retrying on another row"
        );
        self.end(CompletionCode::FAILED, "failed");
    }

    /// This leg failed mid-answer and the request moves to another row (mid-stream failover):
    /// release it as FAILED without counting the request as ended.
    pub fn migrated(mut self, why: &str) {
        self.final_attempt = false;
        tracing::warn!(
            worker = self.info.row.worker_id,
            dp_rank = self.info.row.dp_rank,
            error = why,
            "upstream failed mid-answer; the request continues on another row"
        );
        self.end(CompletionCode::FAILED, "failed");
    }

    /// Release the booking as `code` without counting or logging the request: the caller
    /// answers it with an error, which the handler counts and logs.
    pub fn release_uncounted(mut self, code: CompletionCode) {
        self.final_attempt = false;
        self.end(code, "");
    }

    /// The request ended with `code`; `outcome` is its metrics label.
    pub fn finish(mut self, code: CompletionCode, outcome: &'static str) {
        self.end(code, outcome);
    }

    fn end(&mut self, code: CompletionCode, outcome: &'static str) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        let owed = self.loaded.host.core().finish_owing_hook(self.id, code);
        self.gauge.dec();
        self.app
            .flights
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        self.app.booking_changed.notify_one();
        after_release(&self.app, &self.loaded, owed);
        if self.final_attempt {
            self.app.metrics.request(self.endpoint, outcome);
            let info = &self.info;
            tracing::info!(
                endpoint = self.endpoint,
                outcome,
                worker = info.row.worker_id,
                dp_rank = info.row.dp_rank,
                instance = %info.instance,
                policy = %info.policy,
                reason = %info.reason,
                fallback = info.fallback.as_deref().unwrap_or("-"),
                session = %info.session,
                queued_ms = info.queued.as_millis() as u64,
                duration_ms = self.started.elapsed().as_millis() as u64,
                config = self.loaded.number,
                "request"
            );
        }
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        // Dropped unfinished: the client went away before the end of the body.
        self.end(CompletionCode::CANCELLED, "cancelled");
    }
}

/// What a release still owes, made in a task of its own by `decider.rs`'s rule: the policy's
/// `on_complete` call, and re-evaluating the queues (only when requests wait), which calls
/// policies too. Called where the release happens (a response body's poll or drop), a call that
/// never returned would hold that worker with no permit, and strand whatever task its poll had
/// just woken (docs/serve.md, "Where decisions run"). Off a runtime (a test's drop) it runs here.
pub fn after_release(app: &Arc<App>, loaded: &Arc<LoadedConfig>, mut owed: Option<OwedHook>) {
    // A built-in policy's hook is the host's own code, which returns: no task needed for it.
    if let Some(hook) = owed.take_if(|hook| {
        loaded
            .host
            .policy_set()
            .instance(hook.instance())
            .is_builtin()
    }) {
        loaded.host.core().call_hook(hook);
    }
    if owed.is_none() && !queued_requests(loaded) {
        return;
    }
    let run = {
        let loaded = loaded.clone();
        move || {
            if let Some(owed) = owed {
                loaded.host.core().call_hook(owed);
            }
            if queued_requests(&loaded) {
                loaded.host.core().drain(true);
            }
        }
    };
    match tokio::runtime::Handle::try_current() {
        Ok(handle) => {
            let (app, loaded) = (app.clone(), loaded.clone());
            handle.spawn(async move { app.decider.decide(&loaded, run).await });
        }
        Err(_) => run(),
    }
}

fn queued_requests(loaded: &LoadedConfig) -> bool {
    loaded.host.core().admission_stats().waiting > 0
}

/// A request waiting in an admission queue; dropped while still waiting (the client went away),
/// it is given up (`RoutingCore::abandon`): taken out of the queue, or, if the core is deciding
/// it at that moment, left for the core to release whatever it gets; a booking it already got
/// is released here as cancelled.
pub struct Queued {
    app: Arc<App>,
    loaded: Arc<LoadedConfig>,
    ticket: Option<Ticket>,
    endpoint: &'static str,
}

impl Queued {
    pub fn new(
        app: Arc<App>,
        loaded: Arc<LoadedConfig>,
        ticket: Ticket,
        endpoint: &'static str,
    ) -> Queued {
        Queued {
            app,
            loaded,
            ticket: Some(ticket),
            endpoint,
        }
    }

    pub fn ticket(&mut self) -> Option<&mut Ticket> {
        self.ticket.as_mut()
    }

    /// The request left the queue and its outcome was taken: nothing to clean up.
    pub fn disarm(&mut self) {
        self.ticket = None;
    }

    /// Take it out of the queue now: `true` if it was still queued (it booked nothing).
    pub fn cancel(&mut self) -> bool {
        match &self.ticket {
            Some(ticket) if self.loaded.host.core().cancel(ticket.id()) => {
                self.ticket = None;
                true
            }
            _ => false,
        }
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        let Some(ticket) = self.ticket.take() else {
            return;
        };
        self.app.metrics.queue_outcome("cancelled");
        self.app.metrics.request(self.endpoint, "cancelled");
        // Still queued: taken out, booking nothing. Being dispatched right now: the core
        // releases whatever it gets. Already dispatched: released here.
        let core = self.loaded.host.core();
        if let Some(Ok(routed)) = core.abandon(&ticket) {
            let owed = core.finish_owing_hook(routed.id, CompletionCode::CANCELLED);
            self.app.booking_changed.notify_one();
            after_release(&self.app, &self.loaded, owed);
        }
        tracing::debug!(ticket = ticket.id(), "client gone while queued");
    }
}
