//! The front-end-neutral runtime of a live router: everything a running `serve` (or any other
//! front end) shares, and the request pipeline each front end drives. It knows no HTTP server
//! and no front end's protocol framing; `router-http` (the OpenAI-compatible proxy) is built on
//! it (docs/architecture.md).
//!
//! - [`app::App`]: what every front end and background task shares (the configuration
//!   serving now, health, metrics, requests in flight, KV-event subscribers, reload), started
//!   with [`app::App::start`] and [`background::start`].
//! - [`pipeline`]: one request top to bottom: tokens, limits, block ids, admission and the
//!   policy (the routing core), booking, the legs to engines and the retry rule.
//! - [`lifecycle`]: a request's edges on the core ([`lifecycle::Flight`]), released exactly
//!   once whatever way the request ends.
//! - The OpenAI request bodies ([`request`], [`prompt`]) and error answers ([`errors`]), which
//!   every front end reads and answers.
//! - [`state`] (loaded configurations), [`tokenize`] with [`segments`], [`words`] and
//!   [`prefixes`], [`upstream`] (the client that sends completions to engines), [`coalesce`],
//!   [`engine_calls`] (the router's own bounded calls to engines), [`health`], [`metrics`] and
//!   [`scrape`], [`ready`] (what `/ready` reports), [`kv_events`], [`session_store`]
//!   (bindings shared through Redis), [`decider`] (which calls run on the async worker and
//!   which under `block_in_place`), [`failure`] (start-up and reload errors, cause chains),
//!   [`stop`].

pub mod app;
pub mod background;
pub mod cache_stats;
pub mod coalesce;
pub mod decider;
pub mod engine_calls;
pub mod errors;
pub mod failure;
pub mod health;
pub mod kv_events;
pub mod lifecycle;
pub mod metrics;
pub mod pipeline;
pub mod prefixes;
pub mod prompt;
pub mod ready;
mod reload;
pub mod request;
pub mod scrape;
pub mod segments;
pub mod session_store;
pub mod state;
pub mod stop;
#[cfg(test)]
mod test_tokenizers;
pub mod tokenize;
pub mod upstream;
pub mod words;

pub use app::App;
pub use errors::ApiError;
pub use failure::ServeError;
pub use state::{LoadedConfig, ServeOptions, Upstream};
pub use stop::Stop;
