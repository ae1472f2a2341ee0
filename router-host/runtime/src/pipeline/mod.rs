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
//!    end, failure, client gone) and so the release (`lifecycle.rs`).
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
mod prepare;

pub use admit::{admit, route_error};
pub use book::{book, decision_headers};
pub use legs::{Leg, Next, Retries, UpstreamFailure};
pub use prepare::{
    blocks, check_limits, estimate_tokens, lengths, prepare, tokens, with_token_ids, PrepareError,
    Prepared,
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
    let mut retries = Retries::new(loaded.serve.retries);
    loop {
        let allowed = retries.allowed(loaded);
        let leg = match legs::route(app, loaded, inbound, &prepared, allowed).await {
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
