//! The engine's body relayed to the client as the HTTP response body: chunks coalesced,
//! the [`Flight`]'s edges driven by what arrives, an idle engine timed out, and an SSE stream
//! whose engine fails ended with an OpenAI-style error event.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::StatusCode;
use futures_util::Stream;
use plugin_api::abi::CompletionCode;

use router_runtime::coalesce::Coalesce;
use router_runtime::errors::ApiError;
use router_runtime::lifecycle::Flight;
use router_runtime::metrics::ReasonLabels;
use router_runtime::upstream::{BodyError, BodyStream};

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
    let body = ApiError::upstream(StatusCode::BAD_GATEWAY, message).body();
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
