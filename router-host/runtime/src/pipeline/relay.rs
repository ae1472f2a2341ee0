//! The engine's body relayed to a client, front-end neutral: chunks coalesced, the
//! [`Flight`]'s edges driven by what arrives, an idle engine timed out, a stream whose engine
//! fails continued on another row when the request may move (`migrate.rs`), and otherwise
//! ended with an OpenAI-style error event.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::Stream;
use hyper::http::{header, HeaderMap, StatusCode};
use plugin_api::abi::CompletionCode;

use super::migrate::{self, Tracker};
use super::{blocks, legs, Answer, Inbound, Prepared};
use crate::app::App;
use crate::coalesce::Coalesce;
use crate::errors::ApiError;
use crate::health;
use crate::lifecycle::Flight;
use crate::metrics::ReasonLabels;
use crate::prompt::Endpoint;
use crate::state::LoadedConfig;
use crate::upstream::{BodyError, BodyStream};

/// The SSE event that ends a stream whose engine failed, after the bytes relayed so far
/// (which end `line_ends` line ends into an event): the open event, if any, is ended first.
pub fn stream_error_event(message: &str, line_ends: u8) -> Bytes {
    let body = ApiError::upstream(StatusCode::BAD_GATEWAY, message).body();
    let close = match line_ends {
        0 => "\n\n",
        1 => "\n",
        _ => "",
    };
    Bytes::from(format!("{close}data: {body}\n\ndata: [DONE]\n\n"))
}

/// Whether a response is a server-sent-event stream.
pub fn is_sse(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("text/event-stream"))
}

/// What a request that may move carries to its next leg.
pub struct Moving {
    pub app: Arc<App>,
    pub loaded: Arc<LoadedConfig>,
    pub inbound: Arc<Inbound>,
    pub tracker: Tracker,
    /// The first leg's body: sent again, unchanged, when the engine fails before anything
    /// reached the client.
    pub first_body: Bytes,
    /// Further legs allowed.
    pub left: u32,
    /// Workers a failed leg was on.
    pub tried: Vec<u64>,
}

type NextLeg = Pin<Box<dyn Future<Output = (Result<Answer, String>, Vec<u64>, u32)> + Send>>;

/// The upstream body relayed to the client, driving the [`Flight`]'s edges: the first chunk
/// releases the prefill, the end completes it, an upstream error or an idle gap longer than
/// `serve.timeouts.stream_idle_ms` fails it (or, for a request that may move, starts the next
/// leg); dropped early (client gone), it is cancelled.
pub struct Relay {
    inner: Option<Pin<Box<Coalesce<BodyStream, BodyError>>>>,
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
    moving: Option<Box<Moving>>,
    next: Option<NextLeg>,
    /// The last bytes, sent before the end.
    tail: Option<Bytes>,
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
            inner: Some(Box::pin(Coalesce::new(body))),
            flight: Some(flight),
            idle: Box::pin(tokio::time::sleep(idle_timeout)),
            idle_timeout,
            ok,
            sse: sse && ok,
            line_ends: 2,
            moving: None,
            next: None,
            tail: None,
        }
    }

    /// A relay that moves the stream to another row when its engine fails (`moving`), as long
    /// as the answer is a 2xx SSE stream.
    pub fn moving(mut self, moving: Option<Box<Moving>>) -> Relay {
        if self.sse {
            self.moving = moving;
        }
        self
    }

    fn mark_line_ends(&mut self, chunk: &[u8]) {
        if !self.sse || chunk.is_empty() {
            return;
        }
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

    /// The request ends with an error: an error event on an SSE stream, a cut otherwise.
    fn fail(
        &mut self,
        kind: &'static str,
        message: String,
    ) -> Poll<Option<Result<Bytes, std::io::Error>>> {
        let sse = self.sse;
        self.inner = None;
        self.moving = None;
        if let Some(flight) = self.flight.take() {
            flight
                .metrics()
                .upstream_error(flight.info.row.worker_id, kind);
            if sse {
                flight
                    .metrics()
                    .stream_error_events
                    .get_or_create(&ReasonLabels { reason: kind })
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

    /// The leg's engine failed (`kind`: body, idle): continue on another row if the request may
    /// move, else [`Relay::fail`].
    fn failed(
        &mut self,
        kind: &'static str,
        message: String,
    ) -> Option<Poll<Option<Result<Bytes, std::io::Error>>>> {
        let Some(moving) = self.moving.as_mut() else {
            return Some(self.fail(kind, message));
        };
        let metrics = &moving.app.metrics;
        let restart = moving.tracker.untouched();
        if !restart {
            if let Err(why) = moving.tracker.movable() {
                metrics.migration("unmovable");
                tracing::info!(reason = %why, "the stream cannot move to another row");
                return Some(self.fail(kind, message));
            }
        }
        let Some(flight) = self.flight.take() else {
            return Some(Poll::Ready(None));
        };
        let worker = flight.info.row.worker_id;
        metrics.upstream_error(worker, kind);
        if moving.tracker.finished {
            // Generation was over: only the end was lost.
            metrics.migration("ended");
            let tail = moving.tracker.end();
            self.inner = None;
            self.moving = None;
            flight.finish(CompletionCode::COMPLETED, "completed");
            self.line_ends = 2;
            return Some(Poll::Ready(Some(Ok(tail))));
        }
        if moving.left == 0 {
            self.flight = Some(flight);
            metrics.migration("exhausted");
            return Some(self.fail(
                kind,
                format!("{message}; serve.migration_limit allows no further leg"),
            ));
        }
        flight.migrated(&message);
        moving.tried.push(worker);
        if restart {
            moving.tracker.restart();
        } else {
            moving.tracker.next_leg();
        }
        self.inner = None;
        self.next = Some(next_leg(moving, restart));
        None
    }
}

/// The next leg of a request that moves: routed on a row no failed leg was on, tried while
/// `left` allows; sent as a completion of the prompt's ids plus the generated ids, or, with
/// `restart` (nothing reached the client), as the first leg's request again. Gives the answer
/// (a 2xx SSE stream) or why there is none, the workers tried, and the legs used.
fn next_leg(moving: &Moving, restart: bool) -> NextLeg {
    let app = moving.app.clone();
    let loaded = moving.loaded.clone();
    let inbound = moving.inbound.clone();
    let (endpoint, body) = if restart {
        (inbound.endpoint, moving.first_body.clone())
    } else {
        (
            Endpoint::Completions,
            migrate::continuation(&inbound.parsed, &moving.tracker),
        )
    };
    let prompt = moving.tracker.prompt();
    let mut ids = Vec::with_capacity(prompt.len() + moving.tracker.generated.len());
    ids.extend_from_slice(prompt);
    ids.extend_from_slice(&moving.tracker.generated);
    let expected_output_tokens = moving.tracker.remaining();
    let mut tried = moving.tried.clone();
    let left = moving.left;
    Box::pin(async move {
        let prepared = if restart {
            // The failure path only: the prompt is tokenized again rather than kept per stream.
            match super::prepare(&app, &loaded, &inbound.parsed).await {
                Ok(prepared) => prepared,
                Err(err) => {
                    app.metrics.migration("exhausted");
                    return (
                        Err(format!("could not prepare the request again: {err}")),
                        tried,
                        0,
                    );
                }
            }
        } else {
            Prepared {
                isl_tokens: ids.len() as u64,
                blocks: blocks(&loaded, &inbound.parsed, &ids).unwrap_or_default(),
                ids: vec![ids],
                expected_output_tokens,
            }
        };
        let mut used = 0;
        let mut last = String::from("no row is left to continue on");
        while used < left {
            let allowed: Vec<u64> = loaded
                .upstreams
                .iter()
                .map(|u| u.id)
                .filter(|id| !tried.contains(id))
                .collect();
            if allowed.is_empty() {
                break;
            }
            used += 1;
            let leg = match legs::route(
                &app,
                &loaded,
                &inbound,
                &prepared,
                Some(allowed),
                legs::LegKind::Continuation,
            )
            .await
            {
                Ok(leg) => leg,
                Err(err) => {
                    last = format!("no row to continue on: {}", err.message);
                    break;
                }
            };
            let worker = leg.flight.info.row.worker_id;
            let sent = legs::send(&loaded, &leg, endpoint, &inbound.headers, body.clone()).await;
            match sent {
                Ok(response) if response.status.is_success() && is_sse(&response.headers) => {
                    app.metrics.upstream_connection(response.connection);
                    app.metrics.migration("continued");
                    let answer = Answer {
                        response,
                        flight: leg.flight,
                    };
                    return (Ok(answer), tried, used);
                }
                Ok(response) => {
                    app.metrics.upstream_error(worker, "status");
                    last = format!("engine {worker} answered {}", response.status);
                }
                Err(failure) => {
                    app.metrics.upstream_error(worker, failure.kind);
                    if failure.kind == "connect" {
                        let why = Some(failure.message.clone());
                        health::mark(&app.health, &loaded, worker, false, why);
                    }
                    last = failure.message;
                }
            }
            leg.flight.migrated(&last);
            tried.push(worker);
        }
        app.metrics.migration("exhausted");
        (Err(last), tried, used)
    })
}

impl Stream for Relay {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        // Unpin: its fields are boxes and options of them.
        let this = self.get_mut();
        this.poll_relay(cx)
    }
}

impl Relay {
    fn poll_relay(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, std::io::Error>>> {
        loop {
            if let Some(tail) = self.tail.take() {
                return Poll::Ready(Some(Ok(tail)));
            }
            if let Some(next) = self.next.as_mut() {
                let (result, tried, used) = match next.as_mut().poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(done) => done,
                };
                self.next = None;
                let Some(moving) = self.moving.as_mut() else {
                    return Poll::Ready(None);
                };
                moving.tried = tried;
                moving.left = moving.left.saturating_sub(used);
                match result {
                    Ok(answer) => {
                        self.inner = Some(Box::pin(Coalesce::new(answer.response.body)));
                        self.flight = Some(answer.flight);
                        let deadline = tokio::time::Instant::now() + self.idle_timeout;
                        self.idle.as_mut().reset(deadline);
                        continue;
                    }
                    Err(message) => {
                        // Already counted as exhausted; the error event ends the stream.
                        self.moving = None;
                        let event = stream_error_event(
                            &format!("the engine failed mid-stream and no other row could continue it: {message}"),
                            self.line_ends,
                        );
                        if let Some(flight) = self.flight.take() {
                            flight.finish(CompletionCode::FAILED, "failed");
                        }
                        self.inner = None;
                        return Poll::Ready(Some(Ok(event)));
                    }
                }
            }
            let Some(inner) = self.inner.as_mut() else {
                // Ended (or failed): a request whose next leg failed has no flight left; one
                // that ended with an error event was released already.
                if let Some(flight) = self.flight.take() {
                    flight.finish(CompletionCode::FAILED, "failed");
                }
                return Poll::Ready(None);
            };
            match inner.as_mut().poll_next(cx) {
                Poll::Ready(Some(Ok(chunk))) => {
                    if let Some(flight) = self.flight.as_mut() {
                        flight.first_byte();
                    }
                    let deadline = tokio::time::Instant::now() + self.idle_timeout;
                    self.idle.as_mut().reset(deadline);
                    let chunk = match self.moving.as_mut() {
                        None => chunk,
                        Some(moving) => match moving.tracker.feed(&chunk) {
                            Ok(out) if out.is_empty() => continue,
                            Ok(out) => out,
                            Err(garbage) => {
                                self.moving = None;
                                return self.fail("garbage", garbage.to_string());
                            }
                        },
                    };
                    self.mark_line_ends(&chunk);
                    return Poll::Ready(Some(Ok(chunk)));
                }
                Poll::Ready(Some(Err(err))) => {
                    match self.failed("body", format!("upstream body: {err}")) {
                        Some(poll) => return poll,
                        None => continue,
                    }
                }
                Poll::Ready(None) => {
                    let ok = self.ok;
                    self.inner = None;
                    // An event the engine never ended: relayed as it came (ids stripped).
                    let rest = self.moving.take().map(|mut m| m.tracker.rest());
                    if let Some(mut flight) = self.flight.take() {
                        flight.first_byte();
                        if ok {
                            flight.finish(CompletionCode::COMPLETED, "completed");
                        } else {
                            flight.finish(CompletionCode::FAILED, "upstream_error");
                        }
                    }
                    return match rest {
                        Some(rest) if !rest.is_empty() => Poll::Ready(Some(Ok(rest))),
                        _ => Poll::Ready(None),
                    };
                }
                Poll::Pending => {
                    if self.idle.as_mut().poll(cx).is_ready() {
                        let ms = self.idle_timeout.as_millis();
                        let message = format!(
                            "upstream sent nothing for {ms} ms (serve.timeouts.stream_idle_ms)"
                        );
                        match self.failed("idle", message) {
                            Some(poll) => return poll,
                            None => continue,
                        }
                    }
                    return Poll::Pending;
                }
            }
        }
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
