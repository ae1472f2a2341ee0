//! The request lifecycle around selection: session bindings, load booking, completion.
//!
//! `route` = session lookup -> [`Router::select`] -> dispatch (book load, update the binding).
//! `complete` releases the load and the session's in-flight lease. The load booked here is
//! exactly what policies see in their LOAD columns.

use std::collections::HashMap;
use std::sync::Arc;

use crate::config::{AffinityMode, SessionAffinityConfig};
use crate::eligibility::check_pin;
use crate::model::{Cluster, Request, RowId, RowLoad, Signals, TierOverlap};
use crate::router::{Decision, Router, Scratch, SelectError, Selection};
use crate::sessions::{
    BindingGranularity, BindingMode, Clock, DispatchOutcome, Lease, SessionError, SessionTable,
    SystemClock,
};

/// Identifies a dispatched request until it completes.
pub type RequestId = u64;

/// Booked load per row.
#[derive(Debug, Clone, Default)]
pub struct LoadTable {
    rows: HashMap<RowId, RowLoad>,
}

impl LoadTable {
    pub fn get(&self, row: RowId) -> RowLoad {
        self.rows.get(&row).copied().unwrap_or_default()
    }

    fn book(&mut self, row: RowId, booking: &Booking) {
        let load = self.rows.entry(row).or_default();
        load.active_requests += 1;
        load.active_prefill_tokens += booking.prefill_tokens;
        load.decode_blocks += booking.decode_blocks;
    }

    fn release_prefill(&mut self, row: RowId, tokens: u64) {
        if let Some(load) = self.rows.get_mut(&row) {
            load.active_prefill_tokens = load.active_prefill_tokens.saturating_sub(tokens);
        }
    }

    fn release(&mut self, row: RowId, booking: &Booking) {
        if let Some(load) = self.rows.get_mut(&row) {
            load.active_requests = load.active_requests.saturating_sub(1);
            load.active_prefill_tokens = load
                .active_prefill_tokens
                .saturating_sub(booking.prefill_tokens);
            load.decode_blocks = load.decode_blocks.saturating_sub(booking.decode_blocks);
        }
    }
}

/// What one dispatched request holds until it completes.
#[derive(Debug, Clone)]
struct Booking {
    row: RowId,
    /// Prompt tokens still to prefill (released at prefill completion or at completion).
    prefill_tokens: u64,
    decode_blocks: u64,
    session: Option<Arc<str>>,
}

/// Per-row prompt overlap for the request being routed (the KV index, or injected rows).
pub trait OverlapSource {
    fn overlap(&self, row: RowId) -> TierOverlap;
}

/// No cached prefix anywhere.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoOverlap;

impl OverlapSource for NoOverlap {
    fn overlap(&self, _: RowId) -> TierOverlap {
        TierOverlap::default()
    }
}

/// Rows injected by a caller (e.g. a `select` scenario): they override overlap and load.
pub type InjectedRows = HashMap<RowId, (TierOverlap, RowLoad)>;

struct HostSignals<'a, O: ?Sized> {
    overlap: &'a O,
    load: &'a LoadTable,
    injected: Option<&'a InjectedRows>,
}

impl<O: OverlapSource + ?Sized> Signals for HostSignals<'_, O> {
    fn overlap(&self, row: RowId) -> TierOverlap {
        match self.injected.and_then(|m| m.get(&row)) {
            Some((overlap, _)) => *overlap,
            None => self.overlap.overlap(row),
        }
    }

    fn load(&self, row: RowId) -> RowLoad {
        match self.injected.and_then(|m| m.get(&row)) {
            Some((_, load)) => *load,
            None => self.load.get(row),
        }
    }
}

/// Why a request was not routed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RouteError {
    #[error(transparent)]
    Select(#[from] SelectError),
    #[error("session: {0}")]
    Session(#[from] SessionError),
}

/// A dispatched request.
#[derive(Debug, Clone, PartialEq)]
pub struct Routed {
    pub id: RequestId,
    pub decision: Decision,
    /// What happened to the session binding (when affinity is on and the request has a session).
    pub session: Option<SessionOutcome>,
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

/// The host: policies, cluster state, booked load, session bindings.
pub struct Host {
    router: Router,
    cluster: Cluster,
    load: LoadTable,
    sessions: Option<SessionTable>,
    inflight: HashMap<RequestId, Booking>,
    next_id: RequestId,
    scratch: Scratch,
}

impl Host {
    /// A host with the wall clock.
    pub fn new(router: Router, cluster: Cluster, affinity: Option<&SessionAffinityConfig>) -> Self {
        Self::with_clock(router, cluster, affinity, Arc::new(SystemClock::new()))
    }

    /// A host whose session TTLs run on `clock` (tests and replay use simulated time).
    pub fn with_clock(
        router: Router,
        cluster: Cluster,
        affinity: Option<&SessionAffinityConfig>,
        clock: Arc<dyn Clock>,
    ) -> Self {
        let sessions = affinity.map(|a| {
            let (mode, granularity) = match a.mode {
                AffinityMode::Soft => (BindingMode::Soft, BindingGranularity::Worker),
                // A hard binding acts as a pin, and a pin is one exact row.
                AffinityMode::Hard => (BindingMode::Hard, BindingGranularity::Rank),
            };
            SessionTable::new(mode, a.ttl, a.max_bindings, clock).with_granularity(granularity)
        });
        Host {
            router,
            cluster,
            load: LoadTable::default(),
            sessions,
            inflight: HashMap::new(),
            next_id: 0,
            scratch: Scratch::default(),
        }
    }

    pub fn router(&self) -> &Router {
        &self.router
    }

    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    pub fn cluster_mut(&mut self) -> &mut Cluster {
        &mut self.cluster
    }

    pub fn load(&self) -> &LoadTable {
        &self.load
    }

    pub fn sessions(&self) -> Option<&SessionTable> {
        self.sessions.as_ref()
    }

    /// Requests dispatched and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.inflight.len()
    }

    /// Route and dispatch one request.
    pub fn route<O: OverlapSource + ?Sized>(
        &mut self,
        request: &Request,
        overlap: &O,
        injected: Option<&InjectedRows>,
        explain: bool,
    ) -> Result<Routed, RouteError> {
        let lease = match (&self.sessions, &request.session_id) {
            (Some(table), Some(id)) => Some(table.lookup(id)?),
            _ => None,
        };
        let mut selection = Selection::of(request);
        selection.explain = explain;
        let mut hard_binding_gone = false;
        if let Some(binding) = lease.as_ref().and_then(Lease::binding) {
            match binding.mode {
                BindingMode::Soft => {
                    if request.affinity_target.is_none() {
                        selection.target = Some(binding.target);
                    }
                }
                // An explicit pin beats the binding.
                BindingMode::Hard if request.pinned_worker.is_none() => {
                    let row = RowId {
                        worker_id: binding.target.worker_id,
                        dp_rank: binding.target.dp_rank.unwrap_or(0),
                    };
                    if check_pin(&self.cluster, request, row).is_ok() {
                        selection.pin = Some(row);
                    } else if let (Some(table), Some(lease)) = (&self.sessions, &lease) {
                        // The bound row is gone: invalidate, and run normal selection once.
                        table.invalidate(lease.session_id());
                        hard_binding_gone = true;
                    }
                }
                BindingMode::Hard => {}
            }
        }
        let signals = HostSignals {
            overlap,
            load: &self.load,
            injected,
        };
        let decision = self
            .router
            .select(&self.cluster, selection, &signals, &mut self.scratch)?;
        Ok(self.dispatch(request, decision, lease, hard_binding_gone))
    }

    fn dispatch(
        &mut self,
        request: &Request,
        decision: Decision,
        lease: Option<Lease>,
        hard_binding_gone: bool,
    ) -> Routed {
        let id = self.next_id;
        self.next_id += 1;
        let mut booking = Booking {
            row: decision.row,
            prefill_tokens: request.isl_tokens,
            decode_blocks: self.router.request_blocks(request.isl_tokens),
            session: None,
        };
        self.load.book(decision.row, &booking);
        let session = match (&self.sessions, lease) {
            (Some(table), Some(lease)) => {
                let outcome = match table.dispatched(&lease, decision.row) {
                    Ok(outcome) => {
                        booking.session = Some(Arc::from(lease.session_id()));
                        SessionOutcome::Dispatched(outcome)
                    }
                    Err(err) => {
                        tracing::warn!(session = lease.session_id(), "{err}");
                        SessionOutcome::NotRecorded(err)
                    }
                };
                Some(if hard_binding_gone {
                    SessionOutcome::HardBindingGone
                } else {
                    outcome
                })
            }
            _ => None,
        };
        self.inflight.insert(id, booking);
        Routed {
            id,
            decision,
            session,
        }
    }

    /// The request's prefill finished: its prompt tokens no longer count as pending prefill.
    pub fn prefill_complete(&mut self, id: RequestId) {
        if let Some(booking) = self.inflight.get_mut(&id) {
            self.load
                .release_prefill(booking.row, booking.prefill_tokens);
            booking.prefill_tokens = 0;
        }
    }

    /// The request finished: release its load and its session lease. Unknown ids are ignored
    /// (completing twice is harmless).
    pub fn complete(&mut self, id: RequestId) -> bool {
        let Some(booking) = self.inflight.remove(&id) else {
            return false;
        };
        self.load.release(booking.row, &booking);
        if let (Some(table), Some(session)) = (&self.sessions, &booking.session) {
            table.completed(session);
        }
        true
    }
}

impl std::fmt::Debug for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Host")
            .field("router", &self.router)
            .field("cluster", &self.cluster)
            .field("in_flight", &self.inflight.len())
            .finish_non_exhaustive()
    }
}
