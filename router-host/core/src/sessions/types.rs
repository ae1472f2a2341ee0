//! The session table's public value types: modes, bindings, leases, outcomes, errors and stats.

use std::fmt;
use std::sync::Arc;

use plugin_api::{AffinityTarget, RowId};
use thiserror::Error;

// Only named by doc links.
#[cfg(doc)]
use super::{SessionTable, MAX_SESSION_ID_BYTES};

crate::spelled_enum! {
    /// How a binding constrains later requests of its session (`session_affinity.mode`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum BindingMode {
        /// The binding is an advisory target; it follows wherever the request was actually
        /// dispatched.
        Soft = "soft",
        /// The binding is a pin; a dispatch elsewhere is an error and invalidates the binding.
        Hard = "hard",
    }
}

/// What a *new* binding remembers of the dispatched row. Existing bindings keep their granularity
/// when they move (docs/routing-contract.md §5: worker-level stays worker-level, a rank binding follows the rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum BindingGranularity {
    /// `{worker_id, None}`: any rank of the worker matches, so the policy keeps the freedom to
    /// balance the session across that worker's DP ranks.
    #[default]
    Worker,
    /// `{worker_id, Some(dp_rank)}`: only that rank matches.
    Rank,
}

impl BindingGranularity {
    /// The target a new binding made from `row` remembers.
    pub fn target_for(self, row: RowId) -> AffinityTarget {
        AffinityTarget {
            worker_id: row.worker_id,
            dp_rank: match self {
                BindingGranularity::Worker => None,
                BindingGranularity::Rank => Some(row.dp_rank),
            },
        }
    }
}

/// A session's current binding as seen by a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Binding {
    /// Where the session is bound.
    pub target: AffinityTarget,
    /// Whether the request must go there (hard) or may be steered elsewhere (soft).
    pub mode: BindingMode,
}

/// What a request saw at [`SessionTable::lookup`], handed back to [`SessionTable::dispatched`].
///
/// Fields are private so a lease can only come from `lookup`: the version is the compare half of
/// the compare-and-swap and must not be forged. Taking a lease does not count the request as in
/// flight (it may still be queued or rejected); only a successful `dispatched` does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub(super) session_id: Arc<str>,
    pub(super) binding: Option<Binding>,
    pub(super) version: u64,
}

impl Lease {
    /// A lease as a [`SessionStore`](super::SessionStore) other than [`SessionTable`] hands it
    /// out from its `lookup`. `session_id` must have passed
    /// [`check_session_id`](super::check_session_id), and `version` must be the store's own
    /// version of `binding` (0 = not tracked): it is the compare half of the store's
    /// compare-and-swap, so only the store that reads it may build the lease.
    pub fn from_store(session_id: Arc<str>, binding: Option<Binding>, version: u64) -> Self {
        Lease {
            session_id,
            binding,
            version,
        }
    }

    /// The (validated) session id.
    pub fn session_id(&self) -> &str {
        &self.session_id
    }

    /// The session id as the table holds it: a second handle, not a copy (no allocation).
    pub fn shared_session_id(&self) -> Arc<str> {
        Arc::clone(&self.session_id)
    }

    /// The binding the request should honour, if the session had one.
    pub fn binding(&self) -> Option<Binding> {
        self.binding
    }

    /// Shorthand for the binding's target.
    pub fn target(&self) -> Option<AffinityTarget> {
        self.binding.map(|b| b.target)
    }

    /// The binding version the request saw (0 = the session was not tracked at all).
    pub fn version(&self) -> u64 {
        self.version
    }
}

/// What [`SessionTable::dispatched`] did to the binding. Every variant means the request is now
/// counted in flight; call [`SessionTable::completed`] exactly once for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DispatchOutcome {
    /// The session had no binding; one was created from the dispatched row.
    Created,
    /// The dispatched row matches the binding; nothing changed.
    Kept,
    /// Soft mode: the binding followed the dispatched row.
    Moved {
        from: AffinityTarget,
        to: AffinityTarget,
    },
    /// Soft or hard mode: the binding changed (or appeared) after this request's lease was taken
    /// and the row does not match it; the newer binding was left in place.
    Stale,
}

impl DispatchOutcome {
    /// Stable label for metrics and traces.
    pub fn as_str(&self) -> &'static str {
        match self {
            DispatchOutcome::Created => "created",
            DispatchOutcome::Kept => "kept",
            DispatchOutcome::Moved { .. } => "moved",
            DispatchOutcome::Stale => "stale",
        }
    }
}

/// Errors of the session table. The host fails a request whose session id is invalid (empty or
/// over the limit); for the others it routes the request without (or in spite of) the binding.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SessionError {
    /// An empty id would make every anonymous request share one session.
    #[error("session id is empty")]
    EmptySessionId,
    /// The id exceeds [`MAX_SESSION_ID_BYTES`]; `preview` holds at most its first 32 bytes.
    #[error("session id is {len} bytes, over the {max}-byte limit (starts with {preview:?}...)")]
    SessionIdTooLong {
        len: usize,
        max: usize,
        preview: String,
    },
    /// Hard mode: the request was booked on a row its binding does not match. The binding has been
    /// removed; the booking itself is not undone, and the request is not counted in flight.
    #[error(
        "hard session affinity violated: session {session_id:?} is bound to {}, but the request \
         was dispatched to worker {} rank {}; the binding was invalidated",
        ShowTarget(.bound), .dispatched.worker_id, .dispatched.dp_rank
    )]
    HardAffinityViolated {
        session_id: String,
        bound: AffinityTarget,
        dispatched: RowId,
    },
    /// Creating a binding would exceed `max_bindings` even after evicting expired ones. No binding
    /// was created and the request is not counted in flight; the caller still routes it normally.
    #[error(
        "session table full: {max} bindings, none expired; the request is routed without creating \
         a binding"
    )]
    TableFull { max: usize },
    /// A shared store (Redis) did not answer within its timeout or is unreachable. From
    /// `lookup` (only when the store is configured to refuse such requests) the request fails;
    /// from `dispatched` it is routed but leaves no binding behind.
    #[error("session store unavailable: {reason}")]
    StoreUnavailable { reason: String },
    /// A shared store holds something under the session's key that is not a binding (written by
    /// someone else, or by an incompatible version). It is left untouched and the request is
    /// routed without a binding.
    #[error("session store key {key:?} does not hold a session binding ({reason}); left untouched, routed without it")]
    StoreValue { key: String, reason: String },
}

/// Renders an [`AffinityTarget`] for messages (`AffinityTarget` itself has no `Display`).
pub(super) struct ShowTarget<'a>(pub(super) &'a AffinityTarget);

impl fmt::Display for ShowTarget<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.dp_rank {
            Some(rank) => write!(f, "worker {} rank {}", self.0.worker_id, rank),
            None => write!(f, "worker {} (any rank)", self.0.worker_id),
        }
    }
}

/// Counter snapshot, for metrics. Counts are cumulative since construction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SessionStats {
    /// Bindings created from a dispatched row.
    pub created: u64,
    /// Dispatches that matched the existing binding.
    pub kept: u64,
    /// Soft rebinds.
    pub moved: u64,
    /// Dispatches whose lease was older than the binding (compare-and-swap lost).
    pub stale: u64,
    /// Bindings removed because their idle TTL passed.
    pub expired: u64,
    /// Hard-mode dispatches to a row outside the binding.
    pub hard_violations: u64,
    /// Session ids rejected by `lookup` (empty or too long).
    pub rejected_ids: u64,
    /// Bindings removed by [`SessionTable::invalidate`].
    pub invalidated: u64,
    /// Bindings not created because the table was full.
    pub table_full: u64,
}
