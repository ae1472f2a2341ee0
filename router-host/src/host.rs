//! The request lifecycle around selection: session bindings, queue admission, load booking and
//! completion.
//!
//! `submit` = session lookup -> admission -> [`Router::select`] -> dispatch (book load, update
//! the binding), or queue. `complete` releases the load and the session's in-flight lease;
//! `drain` re-evaluates queued requests once capacity frees. The load booked here is exactly what
//! policies see in their LOAD columns, and what the busy checks of admission read.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use abi_stable::std_types::RSlice;
use plugin_api::abi::{opt_str, CompleteEvent, CompletionCode, DispatchEvent};

use crate::config::{AdmissionMode, AffinityMode, PolicyClassConfig, RouterConfig};
use crate::eligibility::{check_pin, eligible_rows};
use crate::fast_hash::FastMap;
use crate::model::{
    overlap_columns_by_row, Cluster, Request, RowId, RowLoad, Signals, TierOverlap,
};
use crate::router::{Decision, InstanceId, Router, Scratch, SelectError, Selection};
use crate::sessions::{
    BindingGranularity, BindingMode, Clock, DispatchOutcome, Lease, SessionError, SessionTable,
    SystemClock,
};

/// Identifies a dispatched request until it completes.
pub type RequestId = u64;

/// Identifies a queued request until it is dispatched.
pub type Ticket = u64;

/// Booked load per row, dense in cluster order (workers sorted by id, then ranks).
///
/// Read for every candidate row of every decision: candidate rows come in cluster order, so
/// [`LoadTable::fill`] walks the table with one worker lookup per worker instead of a hash
/// lookup per row. The cluster's set of workers and ranks is fixed for the host's lifetime
/// (only their state flags change), which keeps the layout valid.
#[derive(Debug, Clone, Default)]
pub struct LoadTable {
    /// Worker ids, sorted (the cluster's order).
    ids: Vec<u64>,
    dp_start: Vec<u32>,
    /// Index of each worker's first row; one more entry than workers.
    offset: Vec<usize>,
    rows: Vec<RowLoad>,
}

impl LoadTable {
    /// An idle table for every row of `cluster`.
    pub fn new(cluster: &Cluster) -> Self {
        let workers = cluster.workers();
        let mut offset = Vec::with_capacity(workers.len() + 1);
        let mut total = 0;
        for w in workers {
            offset.push(total);
            total += w.dp_size as usize;
        }
        offset.push(total);
        LoadTable {
            ids: workers.iter().map(|w| w.worker_id).collect(),
            dp_start: workers.iter().map(|w| w.dp_start).collect(),
            offset,
            rows: vec![RowLoad::default(); total],
        }
    }

    /// Index of `row` given its worker's position `w`.
    #[inline]
    fn index_in(&self, w: usize, row: RowId) -> Option<usize> {
        let rank = row.dp_rank.checked_sub(self.dp_start[w])? as usize;
        let i = self.offset[w] + rank;
        (i < self.offset[w + 1]).then_some(i)
    }

    #[inline]
    fn index(&self, row: RowId) -> Option<usize> {
        let w = self.ids.binary_search(&row.worker_id).ok()?;
        self.index_in(w, row)
    }

    /// The booked load of `row` (idle for a row the cluster does not have).
    #[inline]
    pub fn get(&self, row: RowId) -> RowLoad {
        self.index(row)
            .map_or_else(RowLoad::default, |i| self.rows[i])
    }

    /// The booked load of every row of `rows` into four columns as long as `rows`; one worker
    /// lookup per change of worker (rows in cluster order make that one per worker).
    #[inline]
    pub fn fill(
        &self,
        rows: &[RowId],
        available: &mut [bool],
        active: &mut [u64],
        prefill: &mut [u64],
        decode: &mut [u64],
    ) {
        let columns = available.iter_mut().zip(active).zip(prefill).zip(decode);
        let mut w = usize::MAX;
        for (&row, (((available, active), prefill), decode)) in rows.iter().zip(columns) {
            if self.ids.get(w) != Some(&row.worker_id) {
                w = self.ids.binary_search(&row.worker_id).unwrap_or(usize::MAX);
            }
            let load = match (w != usize::MAX).then(|| self.index_in(w, row)).flatten() {
                Some(i) => self.rows[i],
                None => RowLoad::default(),
            };
            (*available, *active, *prefill, *decode) = (
                load.available,
                load.active_requests,
                load.active_prefill_tokens,
                load.decode_blocks,
            );
        }
    }

    fn slot(&mut self, row: RowId) -> Option<&mut RowLoad> {
        let i = self.index(row)?;
        self.rows.get_mut(i)
    }

    /// Only rows of the cluster are ever booked: they come from decisions over its rows.
    fn book(&mut self, row: RowId, booking: &Booking) {
        // Saturating: prompt sizes come from callers, and a wrapped counter would look idle.
        if let Some(load) = self.slot(row) {
            load.active_requests = load.active_requests.saturating_add(1);
            load.active_prefill_tokens = load
                .active_prefill_tokens
                .saturating_add(booking.prefill_tokens);
            load.decode_blocks = load.decode_blocks.saturating_add(booking.decode_blocks);
        }
    }

    fn release_prefill(&mut self, row: RowId, tokens: u64) {
        if let Some(load) = self.slot(row) {
            load.active_prefill_tokens = load.active_prefill_tokens.saturating_sub(tokens);
        }
    }

    fn release(&mut self, row: RowId, booking: &Booking) {
        if let Some(load) = self.slot(row) {
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
    /// The instance configured for the request (told about dispatch and completion).
    instance: InstanceId,
    /// Prompt tokens still to prefill (released at prefill completion or at completion).
    prefill_tokens: u64,
    decode_blocks: u64,
    /// The request's session id.
    session: Option<Arc<str>>,
    /// Whether the session table counts this request in flight (release it on completion).
    holds_lease: bool,
}

/// Per-row signals for the request being routed that the host does not own itself: prompt
/// overlap (from a KV index, or injected) and, for scripted scenarios, injected load.
pub trait OverlapSource {
    fn overlap(&self, row: RowId) -> TierOverlap;

    /// Load to use for `row` instead of the host's booked load (scenarios); `None` = booked.
    fn load_override(&self, row: RowId) -> Option<RowLoad> {
        let _ = row;
        None
    }

    /// Whether [`OverlapSource::load_override`] may return `Some` for any row (if not, load
    /// columns are read straight from the booked table).
    fn overrides_load(&self) -> bool {
        false
    }

    /// See [`Signals::overlap_columns`]: the overlap of every row at once.
    fn overlap_columns(
        &self,
        rows: &[RowId],
        device: &mut [f64],
        host: &mut [f64],
        disk: &mut [f64],
    ) {
        overlap_columns_by_row(rows, device, host, disk, |row| self.overlap(row));
    }
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

impl OverlapSource for InjectedRows {
    fn overlap(&self, row: RowId) -> TierOverlap {
        self.get(&row).map(|(o, _)| *o).unwrap_or_default()
    }

    fn load_override(&self, row: RowId) -> Option<RowLoad> {
        self.get(&row).map(|(_, l)| *l)
    }

    fn overrides_load(&self) -> bool {
        !self.is_empty()
    }
}

/// The one snapshot both admission and selection read.
struct HostSignals<'a, O: ?Sized> {
    source: &'a O,
    load: &'a LoadTable,
}

impl<O: OverlapSource + ?Sized> Signals for HostSignals<'_, O> {
    fn overlap(&self, row: RowId) -> TierOverlap {
        self.source.overlap(row)
    }

    fn load(&self, row: RowId) -> RowLoad {
        self.source
            .load_override(row)
            .unwrap_or_else(|| self.load.get(row))
    }

    fn overlap_columns(
        &self,
        rows: &[RowId],
        device: &mut [f64],
        host: &mut [f64],
        disk: &mut [f64],
    ) {
        self.source.overlap_columns(rows, device, host, disk);
    }

    fn load_columns(
        &self,
        rows: &[RowId],
        available: &mut [bool],
        active: &mut [u64],
        prefill: &mut [u64],
        decode: &mut [u64],
    ) {
        if self.source.overrides_load() {
            crate::model::load_columns_by_row(rows, available, active, prefill, decode, |row| {
                self.load(row)
            });
        } else {
            self.load.fill(rows, available, active, prefill, decode);
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
    #[error("unknown policy class `{name}`; defined classes: {}", if .defined.is_empty() { "none".to_string() } else { .defined.join(", ") })]
    UnknownClass { name: String, defined: Vec<String> },
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

/// What `submit` did with a request.
// Returned by value and consumed at once; boxing would add an allocation per dispatch.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Submitted {
    Dispatched(Routed),
    /// Waiting for capacity in its class lane; `drain` dispatches it later.
    Queued(Ticket),
}

/// A queued request that `drain` dispatched (or that failed when re-evaluated).
#[derive(Debug, Clone, PartialEq)]
pub struct Drained {
    pub ticket: Ticket,
    pub result: Result<Routed, RouteError>,
}

/// A policy class's busy rule (design §10).
#[derive(Debug, Clone, PartialEq)]
struct Class {
    name: String,
    abs: Option<u64>,
    frac: Option<f64>,
    mode: AdmissionMode,
}

impl Class {
    /// Strict comparisons; a worker whose batch size is unknown is never busy by `frac`.
    fn is_busy(&self, load: RowLoad, max_num_batched_tokens: Option<u64>) -> bool {
        let tokens = load.active_prefill_tokens;
        self.abs.is_some_and(|abs| tokens > abs)
            || match (self.frac, max_num_batched_tokens) {
                (Some(frac), Some(batch)) => tokens as f64 > frac * batch as f64,
                _ => false,
            }
    }
}

/// Queued requests wait per lane: one per class, plus one per (class, pinned row), so a busy pin
/// (explicit, or a hard session binding) blocks only its own lane. `BTreeMap` keeps drain order deterministic.
type LaneKey = (usize, Option<RowId>);

#[derive(Debug)]
struct Queued {
    ticket: Ticket,
    request: Request,
    since: Duration,
}

/// Admission counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AdmissionStats {
    /// Requests that entered a queue.
    pub queued: u64,
    /// Requests waiting now.
    pub waiting: u64,
}

/// Session lookup and selection inputs of one request, before dispatch.
struct Plan<'r> {
    selection: Selection<'r>,
    lease: Option<Lease>,
    hard_binding_gone: bool,
}

/// The host: policies, cluster state, booked load, session bindings, admission queues.
pub struct Host {
    router: Router,
    cluster: Cluster,
    load: LoadTable,
    sessions: Option<SessionTable>,
    classes: Vec<Class>,
    lanes: BTreeMap<LaneKey, VecDeque<Queued>>,
    clock: Arc<dyn Clock>,
    /// Keyed by the host's own sequential ids: the fixed hash is safe and cheaper than SipHash.
    inflight: FastMap<RequestId, Booking>,
    next_id: RequestId,
    next_ticket: Ticket,
    stats: AdmissionStats,
    scratch: Scratch,
    eligible: Vec<RowId>,
}

impl Host {
    /// A host with the wall clock, using `config`'s session affinity and policy classes.
    pub fn new(router: Router, cluster: Cluster, config: &RouterConfig) -> Self {
        Self::with_clock(router, cluster, config, Arc::new(SystemClock::new()))
    }

    /// A host whose session TTLs and queue waits run on `clock` (tests and replay use simulated
    /// time).
    pub fn with_clock(
        router: Router,
        cluster: Cluster,
        config: &RouterConfig,
        clock: Arc<dyn Clock>,
    ) -> Self {
        let sessions = config.session_affinity.as_ref().map(|a| {
            let (mode, granularity) = match a.mode {
                AffinityMode::Soft => (BindingMode::Soft, BindingGranularity::Worker),
                // A hard binding acts as a pin, and a pin is one exact row.
                AffinityMode::Hard => (BindingMode::Hard, BindingGranularity::Rank),
            };
            SessionTable::new(mode, a.ttl, a.max_bindings, clock.clone())
                .with_granularity(granularity)
        });
        let load = LoadTable::new(&cluster);
        Host {
            router,
            cluster,
            load,
            sessions,
            classes: config.policy_classes.iter().map(class_of).collect(),
            lanes: BTreeMap::new(),
            clock,
            inflight: FastMap::default(),
            next_id: 0,
            next_ticket: 0,
            stats: AdmissionStats::default(),
            scratch: Scratch::default(),
            eligible: Vec::new(),
        }
    }

    pub fn router(&self) -> &Router {
        &self.router
    }

    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// Change a worker's availability or overload flag (`None` = leave as is); returns whether
    /// the worker exists. The set of workers and ranks is fixed for the host's lifetime: the
    /// load table is laid out over it.
    pub fn set_worker_state(
        &mut self,
        worker_id: u64,
        available: Option<bool>,
        overloaded: Option<bool>,
    ) -> bool {
        let Some(worker) = self.cluster.worker_mut(worker_id) else {
            return false;
        };
        if let Some(available) = available {
            worker.available = available;
        }
        if let Some(overloaded) = overloaded {
            worker.overloaded = overloaded;
        }
        true
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

    pub fn admission_stats(&self) -> AdmissionStats {
        self.stats
    }

    /// Route and dispatch one request now, bypassing admission.
    pub fn route<O: OverlapSource + ?Sized>(
        &mut self,
        request: &Request,
        source: &O,
        explain: bool,
    ) -> Result<Routed, RouteError> {
        let plan = self.plan(request, explain)?;
        let decision = self.decide(&plan, source)?;
        Ok(self.dispatch(request, decision, plan, Duration::ZERO))
    }

    /// Admit one request: dispatch it, or queue it in its class lane (design §10).
    pub fn submit<O: OverlapSource + ?Sized>(
        &mut self,
        request: Request,
        source: &O,
        explain: bool,
    ) -> Result<Submitted, RouteError> {
        let Some(class) = self.class_of(&request)? else {
            return self
                .route(&request, source, explain)
                .map(Submitted::Dispatched);
        };
        // A pin (explicit, or a hard session binding) waits in its own lane, so a busy pinned
        // row never holds up the class's other requests.
        let plan = self.plan(&request, explain)?;
        let lane = (class, plan.selection.pin);
        // A lane with a backlog keeps its order: later arrivals wait behind it.
        let admitted = if self.lanes.get(&lane).is_some_and(|q| !q.is_empty()) {
            None
        } else {
            self.try_admit(&request, plan, class, source, Duration::ZERO)?
        };
        match admitted {
            Some(routed) => Ok(Submitted::Dispatched(routed)),
            None => Ok(Submitted::Queued(self.enqueue(lane, request))),
        }
    }

    /// Re-evaluate queued requests, lane by lane in order, dispatching each lane's head while it
    /// is admissible. Call after completions free capacity. `source_for` supplies the per-row
    /// signals of each queued request.
    pub fn drain<O: OverlapSource>(
        &mut self,
        mut source_for: impl FnMut(Ticket, &Request) -> O,
        explain: bool,
    ) -> Vec<Drained> {
        let mut drained = Vec::new();
        let keys: Vec<LaneKey> = self.lanes.keys().copied().collect();
        for lane in keys {
            while let Some(head) = self.lanes.get_mut(&lane).and_then(VecDeque::pop_front) {
                let source = source_for(head.ticket, &head.request);
                let waited = self.clock.now().saturating_sub(head.since);
                let admitted = self
                    .plan(&head.request, explain)
                    .and_then(|plan| self.try_admit(&head.request, plan, lane.0, &source, waited));
                match admitted {
                    Ok(Some(routed)) => drained.push(Drained {
                        ticket: head.ticket,
                        result: Ok(routed),
                    }),
                    Ok(None) => {
                        // Still not admissible: back to the head of its lane.
                        if let Some(q) = self.lanes.get_mut(&lane) {
                            q.push_front(head);
                        }
                        break;
                    }
                    Err(err) => drained.push(Drained {
                        ticket: head.ticket,
                        result: Err(err),
                    }),
                }
            }
        }
        self.lanes.retain(|_, q| !q.is_empty());
        self.stats.waiting = self.lanes.values().map(|q| q.len() as u64).sum();
        drained
    }

    /// Requests still waiting, by ticket.
    pub fn queued(&self) -> impl Iterator<Item = (Ticket, &Request)> {
        self.lanes
            .values()
            .flat_map(|q| q.iter().map(|e| (e.ticket, &e.request)))
    }

    fn enqueue(&mut self, lane: LaneKey, request: Request) -> Ticket {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.stats.queued += 1;
        self.stats.waiting += 1;
        let since = self.clock.now();
        self.lanes.entry(lane).or_default().push_back(Queued {
            ticket,
            request,
            since,
        });
        ticket
    }

    fn class_of(&self, request: &Request) -> Result<Option<usize>, RouteError> {
        match &request.policy_class {
            Some(name) => self
                .classes
                .iter()
                .position(|c| &c.name == name)
                .map(Some)
                .ok_or_else(|| RouteError::UnknownClass {
                    name: name.clone(),
                    defined: self.classes.iter().map(|c| c.name.clone()).collect(),
                }),
            None => Ok(self.classes.iter().position(|c| c.name == "default")),
        }
    }

    /// Dispatch `request` if its class admits it now; `Ok(None)` = keep it queued.
    fn try_admit<O: OverlapSource + ?Sized>(
        &mut self,
        request: &Request,
        plan: Plan<'_>,
        class: usize,
        source: &O,
        waited: Duration,
    ) -> Result<Option<Routed>, RouteError> {
        let decision = match self.classes[class].mode {
            // A deferral signal, not a reservation: while any eligible row has room, the
            // request goes, even if the policy then keeps a busy soft target.
            AdmissionMode::AnyEligible => {
                let mut rows = std::mem::take(&mut self.eligible);
                let eligible = eligible_rows(&self.cluster, request, plan.selection.pin, &mut rows);
                let all_busy =
                    eligible.is_ok() && rows.iter().all(|&r| self.is_busy(class, source, r));
                self.eligible = rows;
                if all_busy {
                    return Ok(None);
                }
                self.decide(&plan, source)?
            }
            // Never books onto a row over the class threshold, whatever the policy picks.
            AdmissionMode::ChosenRow => {
                let decision = self.decide(&plan, source)?;
                if self.is_busy(class, source, decision.row) {
                    return Ok(None);
                }
                decision
            }
        };
        Ok(Some(self.dispatch(request, decision, plan, waited)))
    }

    /// Whether `row` is over `class`'s prefill threshold, on the same snapshot selection reads.
    fn is_busy<O: OverlapSource + ?Sized>(&self, class: usize, source: &O, row: RowId) -> bool {
        let signals = HostSignals {
            source,
            load: &self.load,
        };
        let batch = self
            .cluster
            .worker(row.worker_id)
            .and_then(|w| w.max_num_batched_tokens);
        self.classes[class].is_busy(signals.load(row), batch)
    }

    /// Session lookup: the pin and advisory target this request routes with.
    fn plan<'r>(&self, request: &'r Request, explain: bool) -> Result<Plan<'r>, RouteError> {
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
        Ok(Plan {
            selection,
            lease,
            hard_binding_gone,
        })
    }

    fn decide<O: OverlapSource + ?Sized>(
        &mut self,
        plan: &Plan<'_>,
        source: &O,
    ) -> Result<Decision, RouteError> {
        let signals = HostSignals {
            source,
            load: &self.load,
        };
        Ok(self
            .router
            .select(&self.cluster, plan.selection, &signals, &mut self.scratch)?)
    }

    fn dispatch(
        &mut self,
        request: &Request,
        decision: Decision,
        plan: Plan<'_>,
        queued_for: Duration,
    ) -> Routed {
        let id = self.next_id;
        self.next_id += 1;
        let mut booking = Booking {
            row: decision.row,
            instance: decision.instance,
            prefill_tokens: request.isl_tokens,
            decode_blocks: self.router.request_blocks(request.isl_tokens),
            // With session affinity the lease already holds the id: share it rather than copy it.
            session: match &plan.lease {
                Some(lease) => Some(lease.shared_session_id()),
                None => request.session_id.as_deref().map(Arc::from),
            },
            holds_lease: false,
        };
        self.load.book(decision.row, &booking);
        let session = match (&self.sessions, plan.lease) {
            (Some(table), Some(lease)) => {
                let outcome = match table.dispatched(&lease, decision.row) {
                    Ok(outcome) => {
                        booking.holds_lease = true;
                        SessionOutcome::Dispatched(outcome)
                    }
                    Err(err) => {
                        tracing::warn!(session = lease.session_id(), "{err}");
                        SessionOutcome::NotRecorded(err)
                    }
                };
                Some(match outcome {
                    // The binding could not be recorded: that is the news, whatever happened
                    // to the old one.
                    SessionOutcome::NotRecorded(_) => outcome,
                    _ if plan.hard_binding_gone => SessionOutcome::HardBindingGone,
                    _ => outcome,
                })
            }
            _ => None,
        };
        self.router.notify_dispatch(
            decision.instance,
            &DispatchEvent {
                request_id: id,
                row: decision.row,
                session_id: opt_str(request.session_id.as_deref()),
                prompt_tokens: request.isl_tokens,
                fallback: decision.fallback.is_some(),
                extensions: RSlice::EMPTY,
            },
        );
        self.inflight.insert(id, booking);
        Routed {
            id,
            decision,
            session,
            queued_for,
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
        self.finish(id, CompletionCode::COMPLETED)
    }

    /// The request ended with `outcome` (completed, failed, cancelled): release it as
    /// [`Host::complete`] does and tell its policy how it ended.
    pub fn finish(&mut self, id: RequestId, outcome: CompletionCode) -> bool {
        let Some(booking) = self.inflight.remove(&id) else {
            return false;
        };
        self.load.release(booking.row, &booking);
        if let (Some(table), Some(session), true) =
            (&self.sessions, &booking.session, booking.holds_lease)
        {
            table.completed(session);
        }
        self.router.notify_complete(
            booking.instance,
            &CompleteEvent {
                request_id: id,
                row: booking.row,
                session_id: opt_str(booking.session.as_deref()),
                outcome,
                extensions: RSlice::EMPTY,
            },
        );
        true
    }
}

fn class_of(config: &PolicyClassConfig) -> Class {
    Class {
        name: config.name.clone(),
        abs: config.prefill_busy_threshold,
        frac: config.prefill_busy_threshold_frac,
        mode: config.admission,
    }
}

impl std::fmt::Debug for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Host")
            .field("router", &self.router)
            .field("cluster", &self.cluster)
            .field("in_flight", &self.inflight.len())
            .field("admission", &self.stats)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Worker;

    fn row(worker_id: u64, dp_rank: u32) -> RowId {
        RowId { worker_id, dp_rank }
    }

    #[test]
    fn load_table_columns_match_row_lookups_in_any_order() {
        let cluster = Cluster::new(vec![
            Worker::new(9).with_ranks(4, 2),
            Worker::new(3),
            Worker::new(5).with_ranks(0, 3),
        ])
        .unwrap();
        let mut table = LoadTable::new(&cluster);
        let booking = |tokens| Booking {
            row: row(0, 0),
            instance: 0,
            prefill_tokens: tokens,
            decode_blocks: 2,
            session: None,
            holds_lease: false,
        };
        table.book(row(5, 2), &booking(10));
        table.book(row(9, 5), &booking(20));
        table.book(row(9, 5), &booking(30));
        // Rows of no worker, or ranks out of range, are never booked and read as idle.
        table.book(row(9, 3), &booking(99));
        table.book(row(7, 0), &booking(99));
        assert_eq!(table.get(row(9, 5)).active_requests, 2);
        assert_eq!(table.get(row(9, 5)).active_prefill_tokens, 50);
        assert_eq!(table.get(row(5, 2)).decode_blocks, 2);
        assert_eq!(table.get(row(9, 3)), RowLoad::default());
        assert_eq!(table.get(row(7, 0)), RowLoad::default());

        let rows = [
            row(3, 0),
            row(5, 0),
            row(5, 2),
            row(9, 5),
            row(9, 4),
            row(5, 2),
            row(7, 0),
            row(9, 6),
            row(3, 0),
        ];
        let n = rows.len();
        let (mut available, mut active, mut prefill, mut decode) =
            (vec![false; n], vec![0; n], vec![0; n], vec![0; n]);
        table.fill(
            &rows,
            &mut available,
            &mut active,
            &mut prefill,
            &mut decode,
        );
        for (i, &r) in rows.iter().enumerate() {
            let expected = table.get(r);
            assert_eq!(
                (available[i], active[i], prefill[i], decode[i]),
                (
                    expected.available,
                    expected.active_requests,
                    expected.active_prefill_tokens,
                    expected.decode_blocks
                ),
                "row {r:?}"
            );
        }
        table.release(row(9, 5), &booking(20));
        table.release_prefill(row(9, 5), 30);
        assert_eq!(table.get(row(9, 5)).active_requests, 1);
        assert_eq!(table.get(row(9, 5)).active_prefill_tokens, 0);
    }
}
