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

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use futures_util::Stream;
use plugin_api::abi::CompletionCode;
use prometheus_client::metrics::gauge::Gauge;

use super::app::App;
use super::coalesce::Coalesce;
use super::state::Generation;
use super::upstream::{BodyError, BodyStream};
use crate::host::{OwedHook, RequestId, Routed, Ticket};
use crate::model::RowId;

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
    generation: Arc<Generation>,
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
        generation: Arc<Generation>,
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
        Flight {
            app,
            generation,
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
    pub fn first_byte(&mut self) {
        if !self.prefilled && !self.done {
            self.prefilled = true;
            self.generation.host.prefill_complete(self.id);
            after_release(&self.app, &self.generation, None);
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
        let owed = self.generation.host.core().finish_owing_hook(self.id, code);
        self.gauge.dec();
        self.app
            .flights
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        after_release(&self.app, &self.generation, owed);
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
                config = self.generation.number,
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

/// What a release still owes, made in a task of its own by `offload.rs`'s rule: the policy's
/// `on_complete` call, and re-evaluating the queues (only when requests wait), which calls
/// policies too. Called where the release happens (a response body's poll or drop), a call that
/// never returned would hold that worker with no permit, and strand whatever task its poll had
/// just woken (docs/serve.md, "Where decisions run"). Off a runtime (a test's drop) it runs here.
pub fn after_release(app: &Arc<App>, generation: &Arc<Generation>, mut owed: Option<OwedHook>) {
    // A built-in policy's hook is the host's own code, which returns: no task needed for it.
    if let Some(hook) = owed.take_if(|hook| {
        generation
            .host
            .router()
            .instance(hook.instance())
            .is_builtin()
    }) {
        generation.host.core().call_hook(hook);
    }
    if owed.is_none() && !queued_requests(generation) {
        return;
    }
    let run = {
        let generation = generation.clone();
        move || {
            if let Some(owed) = owed {
                generation.host.core().call_hook(owed);
            }
            if queued_requests(&generation) {
                generation.host.core().drain(true);
            }
        }
    };
    match tokio::runtime::Handle::try_current() {
        Ok(handle) => {
            let (app, generation) = (app.clone(), generation.clone());
            handle.spawn(async move { app.offload.decide(&generation, run).await });
        }
        Err(_) => run(),
    }
}

fn queued_requests(generation: &Generation) -> bool {
    generation.host.core().admission_stats().waiting > 0
}

/// The upstream body relayed to the client, driving the [`Flight`]'s edges: the first chunk
/// releases the prefill, the end completes it, an upstream error or an idle gap longer than
/// `serve.timeouts.stream_idle_ms` fails it; dropped early (client gone), it is cancelled.
pub struct Relay {
    inner: Pin<Box<Coalesce<BodyStream, BodyError>>>,
    flight: Option<Flight>,
    idle: Pin<Box<tokio::time::Sleep>>,
    idle_timeout: Duration,
    /// The engine answered 2xx: the end of the body completes the request; otherwise (an error
    /// relayed to the client) it fails it.
    ok: bool,
    /// A 2xx server-sent-event stream: a failure of the engine mid-stream ends it with an error
    /// event (OpenAI's and vLLM's `data: {"error": ...}`, then `data: [DONE]`) instead of a cut.
    sse: bool,
    /// What ends the bytes relayed so far: `2` at an event's end (`\n\n`), `1` after one
    /// line end, `0` mid-line.
    line_ends: u8,
}

/// The SSE event that ends a stream whose engine failed, after the bytes relayed so far
/// (which end `line_ends` line ends into an event): the open event, if any, is ended first.
pub fn stream_error_event(message: &str, line_ends: u8) -> Bytes {
    let body =
        super::errors::ApiError::upstream(axum::http::StatusCode::BAD_GATEWAY, message).body();
    let close = match line_ends {
        0 => "\n\n",
        1 => "\n",
        _ => "",
    };
    Bytes::from(format!("{close}data: {body}\n\ndata: [DONE]\n\n"))
}

impl Relay {
    pub fn new(
        body: BodyStream,
        flight: Flight,
        idle_timeout: Duration,
        ok: bool,
        sse: bool,
    ) -> Relay {
        Relay {
            inner: Box::pin(Coalesce::new(body)),
            flight: Some(flight),
            idle: Box::pin(tokio::time::sleep(idle_timeout)),
            idle_timeout,
            ok,
            sse: sse && ok,
            line_ends: 2,
        }
    }

    fn fail(
        &mut self,
        kind: &'static str,
        message: String,
    ) -> Poll<Option<Result<Bytes, std::io::Error>>> {
        let sse = self.sse;
        if let Some(flight) = self.flight.take() {
            flight
                .app
                .metrics
                .upstream_error(flight.info.row.worker_id, kind);
            if sse {
                flight
                    .app
                    .metrics
                    .stream_error_events
                    .get_or_create(&super::metrics::ReasonLabels { reason: kind })
                    .inc();
            }
            tracing::warn!(
                worker = flight.info.row.worker_id,
                error = %message,
                error_event_sent = sse,
                "upstream body failed"
            );
            flight.finish(CompletionCode::FAILED, "failed");
        }
        if sse {
            // The stream ends cleanly after the event: the client reads why.
            return Poll::Ready(Some(Ok(stream_error_event(&message, self.line_ends))));
        }
        Poll::Ready(Some(Err(std::io::Error::other(message))))
    }
}

impl Stream for Relay {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.flight.is_none() {
            return Poll::Ready(None);
        }
        match self.inner.as_mut().poll_next(cx) {
            Poll::Ready(Some(Ok(chunk))) => {
                if let Some(flight) = self.flight.as_mut() {
                    flight.first_byte();
                }
                let deadline = tokio::time::Instant::now() + self.idle_timeout;
                self.idle.as_mut().reset(deadline);
                if self.sse && !chunk.is_empty() {
                    let ends = chunk
                        .iter()
                        .rev()
                        .take(2)
                        .take_while(|&&b| b == b'\n')
                        .count();
                    self.line_ends = match ends {
                        // Ends with one `\n` and was the whole chunk: add it to what was there.
                        1 if chunk.len() == 1 => (self.line_ends + 1).min(2),
                        n => n as u8,
                    };
                }
                Poll::Ready(Some(Ok(chunk)))
            }
            Poll::Ready(Some(Err(err))) => self.fail("body", format!("upstream body: {err}")),
            Poll::Ready(None) => {
                let ok = self.ok;
                if let Some(mut flight) = self.flight.take() {
                    flight.first_byte();
                    if ok {
                        flight.finish(CompletionCode::COMPLETED, "completed");
                    } else {
                        flight.finish(CompletionCode::FAILED, "upstream_error");
                    }
                }
                Poll::Ready(None)
            }
            Poll::Pending => {
                if self.idle.as_mut().poll(cx).is_ready() {
                    let ms = self.idle_timeout.as_millis();
                    return self.fail(
                        "idle",
                        format!(
                            "upstream sent nothing for {ms} ms (serve.timeouts.stream_idle_ms)"
                        ),
                    );
                }
                Poll::Pending
            }
        }
    }
}

/// A request waiting in an admission queue; dropped while still waiting (the client went away),
/// it is given up (`RoutingCore::abandon`): taken out of the queue, or, if the core is deciding
/// it at that moment, left for the core to release whatever it gets; a booking it already got
/// is released here as cancelled.
pub struct Queued {
    app: Arc<App>,
    generation: Arc<Generation>,
    ticket: Option<Ticket>,
    endpoint: &'static str,
}

impl Queued {
    pub fn new(
        app: Arc<App>,
        generation: Arc<Generation>,
        ticket: Ticket,
        endpoint: &'static str,
    ) -> Queued {
        Queued {
            app,
            generation,
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
            Some(ticket) if self.generation.host.core().cancel(ticket.id()) => {
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
        let core = self.generation.host.core();
        if let Some(Ok(routed)) = core.abandon(&ticket) {
            let owed = core.finish_owing_hook(routed.id, CompletionCode::CANCELLED);
            after_release(&self.app, &self.generation, owed);
        }
        tracing::debug!(ticket = ticket.id(), "client gone while queued");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_error_event_ends_the_open_event_first_and_parses() {
        for (line_ends, prefix) in [(2, ""), (1, "\n"), (0, "\n\n")] {
            let event = stream_error_event("engine 1: connection reset", line_ends);
            let text = std::str::from_utf8(&event).unwrap();
            let rest = text.strip_prefix(prefix).unwrap();
            let (first, done) = rest.split_once("\n\n").unwrap();
            assert_eq!(done, "data: [DONE]\n\n");
            let json: serde_json::Value =
                serde_json::from_str(first.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(json["error"]["type"], "upstream_error");
            assert!(json["error"]["message"]
                .as_str()
                .unwrap()
                .contains("connection reset"));
        }
    }
}
