//! Session-binding table (`docs/routing-contract.md` §5).
//!
//! Multi-turn and agentic traffic only reuses a worker's KV cache if the router remembers where a
//! session went. This module is that memory, and nothing else: it does not select, book or route.
//! The host drives it through a request's lifecycle:
//!
//! 1. [`SessionTable::lookup`] when the request arrives: returns a [`Lease`] with the binding the
//!    request should honour (a pin in hard mode, an advisory target in soft mode) and the binding
//!    version it saw;
//! 2. [`SessionTable::dispatched`] once the request was booked on a row: creates, keeps or moves the
//!    binding (a versioned compare-and-swap against the lease) and counts the request in flight;
//! 3. [`SessionTable::completed`] when it finishes: the idle TTL restarts when the last in-flight
//!    request of the session completes.
//!
//! The table is safe to share between threads (the replay simulator and a server use the same
//! one), and time comes from an injected [`Clock`] so tests and replay run on simulated time.
//!
//! In-flight counts belong to the *session*, not to one binding: invalidating a binding (hard
//! violation, worker gone) keeps counting the session's requests still running, so a binding created
//! afterwards does not start its idle TTL while older requests of the same session are still in
//! flight, and their completions cannot drive the count negative.

mod clock;
mod store;
mod table;
mod types;

#[cfg(test)]
mod tests;

pub use clock::{Clock, ManualClock, SystemClock};
pub use store::SessionStore;
pub use table::SessionTable;
pub use types::{
    Binding, BindingGranularity, BindingMode, DispatchOutcome, Lease, SessionError, SessionStats,
};

/// Longest accepted session id, in bytes (`docs/routing-contract.md` §5): ids are hashed and stored per binding, so an
/// unbounded id would let one client make every lookup and every stored key arbitrarily large.
pub const MAX_SESSION_ID_BYTES: usize = 256;

/// Default cap on the number of bindings (`docs/routing-contract.md` §5); bounds the table's memory.
pub const DEFAULT_MAX_BINDINGS: usize = 65_536;

/// How much of a rejected id an error message quotes: enough to recognise it in a log, never a
/// 10 KB blob.
const ID_PREVIEW_BYTES: usize = 32;

/// The session-id rule of `docs/routing-contract.md` §5, the one place it is written: an id must be non-empty and at
/// most [`MAX_SESSION_ID_BYTES`] long. [`SessionTable::lookup`] rejects (and counts) ids that fail
/// it; [`SessionTable::completed`] and [`SessionTable::invalidate`] treat them as a no-op.
///
/// # Errors
/// [`SessionError::EmptySessionId`] or [`SessionError::SessionIdTooLong`] (whose preview quotes at
/// most the id's first 32 bytes).
pub fn check_session_id(id: &str) -> Result<(), SessionError> {
    if id.is_empty() {
        Err(SessionError::EmptySessionId)
    } else if id.len() > MAX_SESSION_ID_BYTES {
        Err(SessionError::SessionIdTooLong {
            len: id.len(),
            max: MAX_SESSION_ID_BYTES,
            preview: preview(id),
        })
    } else {
        Ok(())
    }
}

/// At most [`ID_PREVIEW_BYTES`] of `id`, cut on a character boundary.
fn preview(id: &str) -> String {
    let mut end = ID_PREVIEW_BYTES.min(id.len());
    while !id.is_char_boundary(end) {
        end -= 1;
    }
    id.get(..end).unwrap_or_default().to_owned()
}
