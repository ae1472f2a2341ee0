//! # router-core
//!
//! The router's routing core, with no I/O: no YAML, no async runtime, no files, no sockets, no
//! plugin loading (its manifest lists what it may use). It owns the vocabulary of rows and
//! requests ([`model`]), the eligibility view ([`eligibility`]), session bindings
//! ([`sessions`]) and the KV-overlap index ([`kv_index`]). The CLI, `replay` and a live server
//! are adapters around it.
//!
//! Architecture, invariants and the crate map are in `docs/architecture.md`.

pub mod admission;
pub mod blocks;
pub mod eligibility;
pub mod fast_hash;
pub mod kv_index;
pub mod ledger;
pub mod log_limit;
pub mod model;
pub mod recency;
pub mod rng;
pub mod routed;
pub mod routing;
pub mod select;
pub mod sessions;
pub mod spelled;
pub mod striped;
pub mod topology;
