//! # router-host
//!
//! The router's binary side and its live server: `serve` ([`serve`], the OpenAI-compatible
//! proxy with KV-event subscribers, health, metrics and reload), the Redis/Valkey session store
//! replicas share ([`session_store`]), and the `mock-engine` and CLI commands in the binary.
//!
//! The routing itself lives in the crates below, re-exported here at their old paths so tools
//! and tests need one dependency: router-core ([`model`], [`eligibility`], [`kv_index`],
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

pub mod serve;
pub mod session_store;
