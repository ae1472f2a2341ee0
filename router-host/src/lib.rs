//! # router-host
//!
//! The `router-host` binary's library side: the crates below re-exported at their old paths,
//! so tools and tests need one dependency. The CLI and `mock-engine` are in the binary.
//!
//! The live router is router-runtime (the pipeline, engines, KV events, the Redis session
//! store [`session_store`], metrics, reload) under router-http (the OpenAI-compatible HTTP
//! front end), together at [`serve`]; the routing is router-core ([`model`], [`eligibility`], [`kv_index`],
//! [`sessions`], ...), router-config ([`config`], [`input`]), router-policies ([`loader`],
//! [`builtin`], [`catalog`], [`instance`], [`watchdog`], [`policy_set`], [`host`]) and
//! router-sim ([`replay`], [`scenario`]).
//!
//! Architecture, invariants and the crate map are in `docs/architecture.md`.

pub use router_config as config;
pub use router_config::input;
pub use router_core::{eligibility, fast_hash, kv_index, log_limit, model, rng, sessions};
pub use router_policies::{
    builtin, catalog, host, instance, loader, plugin_log, policy_set, watchdog,
};
pub use router_sim::{replay, scenario};

pub use router_runtime::session_store;

/// `serve`: the OpenAI HTTP front end (router-http) over the runtime's modules (router-runtime),
/// at the paths they had when both were one module.
pub mod serve {
    pub use router_http::*;
    pub use router_runtime::{
        app, coalesce, decider, engine_calls, errors, failure, health, kv_events, lifecycle,
        metrics, pipeline, prefixes, prompt, request, scrape, segments, state, stop, tokenize,
        upstream, words, ApiError, App, LoadedConfig, ServeError, ServeOptions, Stop, Upstream,
    };
}
