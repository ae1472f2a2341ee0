//! The engine's body relayed to the client: the runtime's [`Relay`] (flight edges, idle
//! timeout, mid-stream failover, the error event) is the HTTP response body as it is.

pub use router_runtime::pipeline::relay::{Moving, Relay};
