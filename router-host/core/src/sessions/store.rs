//! The [`SessionStore`] abstraction over where bindings live, and its in-memory implementation.

use std::fmt;

use plugin_api::RowId;

use super::{Binding, DispatchOutcome, Lease, SessionError, SessionStats, SessionTable};

/// Where session bindings live. The in-memory [`SessionTable`] is one implementation; a store
/// shared by several router processes is another. Every method is called from many routing
/// threads at once.
///
/// The contract (a lease per request, a versioned compare-and-swap at dispatch, one
/// `completed` per successful `dispatched`) is [`SessionTable`]'s, documented on its methods and
/// in `docs/routing-contract.md`, "Sessions".
pub trait SessionStore: Send + Sync + fmt::Debug {
    /// See [`SessionTable::lookup`].
    fn lookup(&self, session_id: &str) -> Result<Lease, SessionError>;
    /// See [`SessionTable::dispatched`].
    fn dispatched(&self, lease: &Lease, row: RowId) -> Result<DispatchOutcome, SessionError>;
    /// See [`SessionTable::completed`].
    fn completed(&self, session_id: &str);
    /// See [`SessionTable::invalidate`].
    fn invalidate(&self, session_id: &str) -> bool;
    /// See [`SessionTable::binding`].
    fn binding(&self, session_id: &str) -> Option<Binding>;
    /// See [`SessionTable::stats`].
    fn stats(&self) -> SessionStats;
}

impl SessionStore for SessionTable {
    fn lookup(&self, session_id: &str) -> Result<Lease, SessionError> {
        SessionTable::lookup(self, session_id)
    }
    fn dispatched(&self, lease: &Lease, row: RowId) -> Result<DispatchOutcome, SessionError> {
        SessionTable::dispatched(self, lease, row)
    }
    fn completed(&self, session_id: &str) {
        SessionTable::completed(self, session_id);
    }
    fn invalidate(&self, session_id: &str) -> bool {
        SessionTable::invalidate(self, session_id)
    }
    fn binding(&self, session_id: &str) -> Option<Binding> {
        SessionTable::binding(self, session_id)
    }
    fn stats(&self) -> SessionStats {
        SessionTable::stats(self)
    }
}
