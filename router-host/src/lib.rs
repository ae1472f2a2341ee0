//! # router-host
//!
//! The host side of the router: it loads worker-selection policies from shared objects
//! ([`loader`]), validates configuration ([`config`]), decides which rows a request may use
//! ([`eligibility`]), calls the configured policy ([`router`]) and runs the request lifecycle
//! around it: session bindings ([`sessions`]), load booking and completion ([`host`]), with
//! prompt overlap from the KV-overlap index fed by engines' cache events ([`kv_index`]).
//! [`watchdog`] notices a policy call that never returns and takes its instance out of service.
//! [`replay`] drives all of it against simulated engines.
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
