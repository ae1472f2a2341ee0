//! One request's way through the router, front-end neutral, top to bottom:
//!
//! 1. [`prepare`]: the prompt's tokens, their lengths against the limits, its block ids
//!    (`prepare.rs`);
//! 2. [`forwarded_body`]: the body the engine is sent (`serve.forward_token_ids`);
//! 3. per leg ([`legs::route`]): [`admit`] (sessions, admission queues and the policy, run by
//!    the routing core) and [`book`] (the decision recorded, its [`Flight`] opened);
//! 4. [`legs::send`] to the leg's engine, and [`Retries::settle`]: the answer, or another leg
//!    on a row not tried yet, or the error the client gets;
//! 5. the answer's body read through to its end drives the [`Flight`]'s edges (first byte,
//!    end, failure, client gone) and so the release (`lifecycle.rs`); [`relay::Relay`] does
//!    that for a front end, and moves a stream whose engine fails to another row when the
//!    request may move ([`migrate`]; [`run_moving`]).
//!
//! A front end adapts its protocol to [`Inbound`] and [`Answer`] and nothing else: the OpenAI
//! HTTP proxy runs [`run`]; a front end that only picks a row (and lets another proxy send
//! the request) runs [`prepare`] and [`legs::route`]. Errors are [`ApiError`]s: OpenAI-style
//! status, code and message, which each front end answers in its own framing.
//!
//! [`Flight`]: crate::lifecycle::Flight
//! [`ApiError`]: crate::errors::ApiError

mod admit;
mod book;
pub mod legs;
pub mod migrate;
mod prepare;
pub mod relay;

pub use admit::{admit, route_error};
pub use book::{book, decision_headers};
pub use legs::{Leg, Next, Retries, UpstreamFailure};
pub use prepare::{
    blocks, check_limits, estimate_tokens, lengths, prepare, tokens, with_token_ids, PrepareError,
    Prepared, PromptIds,
};

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use hyper::http::HeaderMap;

use crate::app::App;
use crate::errors::ApiError;
use crate::lifecycle::Flight;
use crate::prompt::{Endpoint, Parsed};
use crate::state::LoadedConfig;
use crate::upstream::UpstreamResponse;

/// A request as a front end hands it to the pipeline.
pub struct Inbound {
    pub endpoint: Endpoint,
    pub parsed: Parsed,
    /// The body as the client sent it.
    pub body: Bytes,
    /// The session, from the request's headers or body.
    pub session: Option<String>,
    /// The client's headers (the ones an engine is sent are picked by [`legs::send`]).
    pub headers: HeaderMap,
    /// When the request arrived: its duration and the router's overhead count from here.
    pub received: Instant,
}

/// An engine's answer and the booking it holds until its body ends.
pub struct Answer {
    pub response: UpstreamResponse,
    pub flight: Flight,
}

/// The body the engine is sent: as received, or under `serve.forward_token_ids` with a
/// completion's text prompts replaced by their token ids.
pub fn forwarded_body(loaded: &LoadedConfig, inbound: &Inbound, prepared: &Prepared) -> Bytes {
    if loaded.serve.forward_token_ids {
        if let Some(body) = with_token_ids(inbound.endpoint, &inbound.parsed, &prepared.ids) {
            return body;
        }
    }
    inbound.body.clone()
}

/// The whole pipeline for a front end that proxies: prepare, then legs until one is answered
/// or the request fails. The caller reads the [`Answer`]'s body through (or drops it: the
/// client went away); its [`Flight`] releases the booking either way.
pub async fn run(
    app: &Arc<App>,
    loaded: &Arc<LoadedConfig>,
    inbound: &Inbound,
) -> Result<Answer, ApiError> {
    let prepared = prepare(app, loaded, &inbound.parsed)
        .await
        .map_err(|err| err.into_api_error(inbound.endpoint))?;
    let body = forwarded_body(loaded, inbound, &prepared);
    answered(
        app,
        loaded,
        inbound,
        &prepared,
        &body,
        &mut Retries::new(loaded.serve.retries),
    )
    .await
}

/// Legs until one is answered (`Retries` settles each) or the request fails.
async fn answered(
    app: &Arc<App>,
    loaded: &Arc<LoadedConfig>,
    inbound: &Inbound,
    prepared: &Prepared,
    body: &Bytes,
    retries: &mut Retries,
) -> Result<Answer, ApiError> {
    loop {
        let allowed = retries.allowed(loaded);
        let kind = retries.next_kind();
        let leg = match legs::route(app, loaded, inbound, prepared, allowed, kind).await {
            Ok(leg) => leg,
            Err(err) => return Err(retries.refused(err)),
        };
        let sent = legs::send(
            loaded,
            &leg,
            inbound.endpoint,
            &inbound.headers,
            body.clone(),
        )
        .await;
        match retries.settle(app, loaded, leg.flight, sent) {
            Next::Answer(answer) => return Ok(answer),
            Next::Retry => continue,
            Next::Fail(err) => return Err(err),
        }
    }
}

/// The longest whole (non-streamed) answer read before it is relayed, when a failure while
/// reading it may send the request to another row.
pub const WHOLE_ANSWER_LIMIT: usize = 64 << 20;

/// [`run`] for a front end that relays through [`relay::Relay`], with mid-answer failover under
/// `serve.migration_limit` (lowered by the `x-router-migration-limit` header): a stream that
/// may move is sent asking for token ids and comes with what its next leg needs
/// ([`relay::Moving`], for [`relay::Relay::moving`]); a whole answer is read before it is
/// relayed, and one whose body fails is sent again, from the start, to another row.
pub async fn run_moving(
    app: &Arc<App>,
    loaded: &Arc<LoadedConfig>,
    inbound: Inbound,
) -> Result<(Answer, Option<Box<relay::Moving>>), ApiError> {
    let limit = migrate::limit(loaded, &inbound.headers)?;
    let prepared = prepare(app, loaded, &inbound.parsed)
        .await
        .map_err(|err| err.into_api_error(inbound.endpoint))?;
    let plan = migrate::plan(inbound.endpoint, &inbound.parsed, limit);
    let mut body = forwarded_body(loaded, &inbound, &prepared);
    if let Some(plan) = &plan {
        body = migrate::first_body(&body, plan);
    }
    let inbound = Arc::new(inbound);
    let mut whole_left = if inbound.parsed.stream { 0 } else { limit };
    let mut retries = Retries::new(loaded.serve.retries);
    loop {
        let mut answer = answered(app, loaded, &inbound, &prepared, &body, &mut retries).await?;
        let whole = answer.response.status.is_success() && !relay::is_sse(&answer.response.headers);
        if limit > 0 && !inbound.parsed.stream && whole {
            let idle = loaded.serve.timeouts.stream_idle;
            let body = std::mem::replace(
                &mut answer.response.body,
                Box::pin(futures_util::stream::empty()),
            );
            match read_whole(body, idle).await {
                Ok(bytes) => {
                    answer.response.body =
                        Box::pin(futures_util::stream::once(std::future::ready(Ok(bytes))));
                }
                Err((kind, why)) => {
                    let worker = answer.flight.info.row.worker_id;
                    app.metrics.upstream_error(worker, kind);
                    let why = format!("engine {worker}: {why}");
                    if whole_left == 0 {
                        app.metrics.migration("exhausted");
                        answer
                            .flight
                            .release_uncounted(plugin_api::abi::CompletionCode::FAILED);
                        return Err(ApiError::upstream(
                            hyper::http::StatusCode::BAD_GATEWAY,
                            format!("{why}; serve.migration_limit allows no further leg"),
                        ));
                    }
                    whole_left -= 1;
                    app.metrics.migration("continued");
                    answer.flight.migrated(&why);
                    retries.exclude(worker, why);
                    continue;
                }
            }
        }
        let moving = plan.map(|plan| {
            Box::new(relay::Moving {
                app: app.clone(),
                loaded: loaded.clone(),
                tracker: migrate::Tracker::new(inbound.endpoint, &inbound.parsed, &plan),
                first_body: body.clone(),
                inbound: inbound.clone(),
                left: plan.limit,
                tried: Vec::new(),
            })
        });
        return Ok((answer, moving));
    }
}

/// A whole answer's body, each piece within `idle` of the one before, at most
/// [`WHOLE_ANSWER_LIMIT`] bytes; or the failure's kind (`body`, `idle`, `too_large`) and text.
async fn read_whole(
    mut body: crate::upstream::BodyStream,
    idle: std::time::Duration,
) -> Result<Bytes, (&'static str, String)> {
    use futures_util::StreamExt;
    let mut out = Vec::new();
    loop {
        match tokio::time::timeout(idle, body.next()).await {
            Err(_) => {
                return Err((
                    "idle",
                    format!(
                        "the answer's body sent nothing for {} ms (serve.timeouts.stream_idle_ms)",
                        idle.as_millis()
                    ),
                ))
            }
            Ok(None) => return Ok(Bytes::from(out)),
            Ok(Some(Err(err))) => return Err(("body", format!("upstream body: {err}"))),
            Ok(Some(Ok(chunk))) => {
                if out.len() + chunk.len() > WHOLE_ANSWER_LIMIT {
                    return Err((
                        "too_large",
                        format!("the answer is over {WHOLE_ANSWER_LIMIT} bytes"),
                    ));
                }
                out.extend_from_slice(&chunk);
            }
        }
    }
}
