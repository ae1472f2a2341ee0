//! What routing one request gives: the request's id, the dispatched request ([`Routed`]) or
//! why it was not routed ([`RouteError`]). Below both the routing core and admission, whose
//! tickets resolve to the same outcomes.

use std::time::Duration;

use crate::eligibility::EligibilityError;
use crate::select::{Decision, SelectError};
use crate::sessions::{DispatchOutcome, SessionError};

/// Identifies a dispatched request until it completes: the caller's id, or one the core drew.
pub type RequestId = u64;

/// Ids the core draws have this bit set (`RoutingCore::draw_id`); callers' ids must not.
pub const DRAWN_ID_BIT: u64 = 1 << 63;

/// Bits of a drawn id that carry the replica tag ([`crate::routing::CoreSettings::id_tag`]), just below
/// [`DRAWN_ID_BIT`]: several router processes drawing ids at once never draw the same one.
pub const ID_TAG_BITS: u32 = 16;

/// Why a request was not routed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RouteError {
    #[error(transparent)]
    Select(#[from] SelectError),
    // The cause is in the message and not a `source()` (no `#[from]`): printed with its chain
    // it would otherwise say it twice.
    #[error("session: {0}")]
    Session(SessionError),
    #[error("unknown policy class `{name}`; defined classes: {}", if .defined.is_empty() { "none".to_string() } else { .defined.join(", ") })]
    UnknownClass { name: String, defined: Vec<String> },
    #[error("request id {0} is already in flight")]
    DuplicateRequestId(RequestId),
    #[error("request id {0} is 2^63 or more; ids from 2^63 up are the ones the core draws itself")]
    ReservedRequestId(RequestId),
    #[error(
        "worker {worker_id} was removed while the request was being decided; nothing was booked"
    )]
    WorkerRemoved { worker_id: u64 },
    #[error("waited {waited_ms} ms in the queue of policy class `{class}`, over its max_wait of {max_wait_ms} ms; nothing was booked")]
    QueueTimeout {
        class: String,
        waited_ms: u64,
        max_wait_ms: u64,
    },
    #[error("cancelled while queued; nothing was booked")]
    Cancelled,
    #[error("the admission queues hold their limit of {limit} requests (max_queued_requests), none of a lower priority than policy class `{class}`; nothing was booked")]
    QueueFull { class: String, limit: usize },
    #[error("shed from the queue of policy class `{class}` (priority {priority}) to make room for a request of class `{by_class}` (priority {by_priority}); nothing was booked")]
    Shed {
        class: String,
        priority: i64,
        by_class: String,
        by_priority: i64,
    },
    #[error("the queued request was still being re-evaluated {stall_ms} ms after its wait ended (a policy call hung); it was given up, and whatever it gets is released")]
    EvaluationStalled { stall_ms: u64 },
}

impl From<SessionError> for RouteError {
    fn from(err: SessionError) -> Self {
        RouteError::Session(err)
    }
}

impl From<EligibilityError> for RouteError {
    fn from(err: EligibilityError) -> Self {
        RouteError::Select(SelectError::Eligibility(err))
    }
}

/// A dispatched request.
#[derive(Debug, Clone, PartialEq)]
pub struct Routed {
    pub id: RequestId,
    pub decision: Decision,
    /// What happened to the session binding (when affinity is on and the request has a session).
    pub session: Option<SessionOutcome>,
    /// How long the request waited in an admission queue (zero when dispatched at once).
    pub queued_for: Duration,
}

/// The binding side of a dispatch.
#[derive(Debug, Clone, PartialEq)]
pub enum SessionOutcome {
    Dispatched(DispatchOutcome),
    /// Hard mode: the bound row was gone; the binding was invalidated and selection ran once
    /// without it.
    HardBindingGone,
    /// The binding could not be honoured or recorded (e.g. table full); routed without it.
    NotRecorded(SessionError),
}
