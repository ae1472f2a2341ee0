//! # router-sim
//!
//! The router without a network: the same policies and routing core as `serve`, driven by
//! simulated engines. [`replay`] runs a request trace (recorded or synthetic) against engines
//! whose prefix caches, prefill and decode are modelled ([`replay::engine`], which the
//! `mock-engine` test server reuses) and reports hit rates and latencies; [`scenario`] reads the
//! one-shot decisions of `router-host select`.
//!
//! No async runtime, no sockets: time is simulated, and a run is deterministic for its seed.

pub mod replay;
pub mod scenario;
