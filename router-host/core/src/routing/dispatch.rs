//! The request path: plan (sessions), admission, decision, dispatch (booking), completion.

use std::cell::RefCell;
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};
use std::time::Duration;

use abi_stable::std_types::RSlice;
use plugin_api::abi::{opt_str, CompleteEvent, CompletionCode, DispatchEvent};

use super::signals::{CoreSignals, IndexOverlap, OverlapBuffers};
use super::{
    lock, shard_of_slot, Booking, RequestId, RouteError, Routed, RoutingCore, SessionOutcome,
    Shard, DRAWN_ID_BIT,
};
use crate::admission::{AdmissionMode, LaneKey, NoRoom, Ticket};
use crate::eligibility::{check_pin, eligible};
use crate::ledger::{Charge, DecodeBooking, Ledger};
use crate::model::{OverlapSource, Request, RowId};
use crate::select::{Decision, Scratch, Selection};
use crate::sessions::{BindingMode, Lease, SessionError};
use crate::topology::{Slot, Topology};

/// What `submit` did with a request.
// Returned by value and consumed at once; boxing would add an allocation per dispatch.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Submitted {
    Dispatched(Routed),
    /// Waiting for capacity in its class lane: wait on the ticket, or read it from `drain`.
    Queued(Ticket),
}

/// What admission decided for a request with a class.
// Consumed at once, like `Submitted`.
#[allow(clippy::large_enum_variant)]
enum Admitted {
    Now(Routed),
    Queue(LaneKey),
}

/// Session lookup and selection inputs of one request, before dispatch.
pub(super) struct Plan<'r> {
    pub selection: Selection<'r>,
    pub lease: Option<Lease>,
    pub hard_binding_gone: bool,
}

thread_local! {
    // Per routing thread: selection and index walks reuse these, so steady-state routing
    // allocates nothing and threads never share buffers.
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
    static OVERLAP: RefCell<OverlapBuffers> = RefCell::new(OverlapBuffers::default());
    // The last topology snapshot this thread routed with, reused while its generation is the
    // current one: checking costs one plain load, where taking an arc-swap guard costs atomic
    // read-modify-writes on every request.
    static SNAPSHOT: RefCell<Option<Arc<Topology>>> = const { RefCell::new(None) };
}

/// Run `f` with this thread's buffer (a fresh one if it is already in use further up the stack).
/// The result leaves through `out`, not through the thread-local's closure: a decision is large,
/// and every `Option`/`Result` layer it crossed cost a copy.
#[inline]
fn with_buffer<T: Default, R>(
    key: &'static std::thread::LocalKey<RefCell<T>>,
    f: impl FnOnce(&mut T) -> R,
) -> R {
    let mut f = Some(f);
    let mut out = None;
    let _ = key.try_with(|cell| {
        // In use further up the stack: leave `f` for the fresh buffer below.
        if let Ok(mut buffer) = cell.try_borrow_mut() {
            if let Some(f) = f.take() {
                out = Some(f(&mut buffer));
            }
        }
    });
    if let Some(result) = out {
        return result;
    }
    match f {
        Some(f) => f(&mut T::default()),
        None => unreachable!("the closure ran but returned no result"),
    }
}

/// The class index of a queued request (0 for one whose class is gone, which cannot happen:
/// the classes are fixed for the core's life).
fn entry_class_index(core: &RoutingCore, request: &Request) -> usize {
    core.class_of(request).ok().flatten().unwrap_or(0)
}

/// Run `f` with this thread's KV-walk buffers.
pub(super) fn with_overlap_buffers<R>(f: impl FnOnce(&mut OverlapBuffers) -> R) -> R {
    with_buffer(&OVERLAP, f)
}

impl RoutingCore {
    /// Run `f` on the current topology snapshot: this thread's cached one while it is current,
    /// else a fresh one (cached for next time). A nested call takes a guard instead. The result
    /// leaves through `out`, as in [`with_buffer`].
    #[inline]
    fn with_topology<R>(&self, f: impl FnOnce(&Topology) -> R) -> R {
        let current = self.generation.load(Ordering::Acquire);
        let mut f = Some(f);
        let mut out = None;
        let _ = SNAPSHOT.try_with(|cell| {
            let Ok(mut cached) = cell.try_borrow_mut() else {
                return;
            };
            if cached.as_ref().map(|t| t.generation()) != Some(current) {
                *cached = Some(self.topology.load_full());
            }
            if let Some(topology) = cached.as_deref() {
                if let Some(f) = f.take() {
                    out = Some(f(topology));
                }
            }
        });
        if let Some(result) = out {
            return result;
        }
        match f {
            Some(f) => f(&self.topology.load()),
            None => unreachable!("the closure ran but returned no result"),
        }
    }

    /// Route and dispatch one request now, bypassing admission; overlap from `source`.
    pub fn route<O: OverlapSource + ?Sized>(
        &self,
        request: &Request,
        source: &O,
        explain: bool,
    ) -> Result<Routed, RouteError> {
        self.with_topology(|topology| self.route_on(topology, request, source, explain))
    }

    fn route_on<O: OverlapSource + ?Sized>(
        &self,
        topology: &Topology,
        request: &Request,
        source: &O,
        explain: bool,
    ) -> Result<Routed, RouteError> {
        let plan = self.plan(topology, request, explain)?;
        let decision = self.decide(topology, &plan, source)?;
        self.dispatch(topology, request, decision, plan, source, Duration::ZERO)
    }

    /// [`RoutingCore::route`] with overlap from the request's blocks in the core's KV index.
    pub fn route_indexed(&self, request: &Request, explain: bool) -> Result<Routed, RouteError> {
        self.with_topology(|topology| {
            with_buffer(&OVERLAP, |buffers| {
                let source = IndexOverlap::new(topology, &self.kv, &request.blocks, buffers)
                    .with_trust(&self.trust)
                    .all_current(self.not_current.none());
                self.route_on(topology, request, &source, explain)
            })
        })
    }

    /// Admit one request: dispatch it, or queue it in its class lane (docs/routing-contract.md §8).
    pub fn submit<O: OverlapSource + ?Sized>(
        &self,
        request: Request,
        source: &O,
        explain: bool,
    ) -> Result<Submitted, RouteError> {
        match self.with_topology(|topology| self.admit(topology, &request, source, explain))? {
            Admitted::Now(routed) => Ok(Submitted::Dispatched(routed)),
            Admitted::Queue(lane) => self.enqueue(lane, request),
        }
    }

    /// [`RoutingCore::submit`] with overlap from the request's blocks in the core's KV index.
    pub fn submit_indexed(&self, request: Request, explain: bool) -> Result<Submitted, RouteError> {
        let admitted = self.with_topology(|topology| {
            with_buffer(&OVERLAP, |buffers| {
                let source = IndexOverlap::new(topology, &self.kv, &request.blocks, buffers)
                    .with_trust(&self.trust)
                    .all_current(self.not_current.none());
                self.admit(topology, &request, &source, explain)
            })
        })?;
        match admitted {
            Admitted::Now(routed) => Ok(Submitted::Dispatched(routed)),
            Admitted::Queue(lane) => self.enqueue(lane, request),
        }
    }

    /// Dispatch `request` now if admission lets it (no class, or its class admits it and its
    /// lane has no backlog), else say which lane it waits in.
    fn admit<O: OverlapSource + ?Sized>(
        &self,
        topology: &Topology,
        request: &Request,
        source: &O,
        explain: bool,
    ) -> Result<Admitted, RouteError> {
        let Some(class) = self.class_of(request)? else {
            return self
                .route_on(topology, request, source, explain)
                .map(Admitted::Now);
        };
        let plan = self.plan(topology, request, explain)?;
        // A pin (explicit, or a hard session binding) waits in its own lane, so a busy pinned
        // row never holds up the class's other requests.
        let lane = (class, plan.selection.pin);
        // A lane with a backlog keeps its order: later arrivals wait behind it.
        if lock(&self.queues).has_backlog(lane) {
            return Ok(Admitted::Queue(lane));
        }
        Ok(
            match self.try_admit(topology, request, plan, class, source, Duration::ZERO)? {
                Some(routed) => Admitted::Now(routed),
                None => Admitted::Queue(lane),
            },
        )
    }

    /// Queue `request` in `lane`; at the queues' bound, shed the lowest priority below the
    /// request's to make room, or refuse it (docs/routing-contract.md §8).
    fn enqueue(&self, lane: LaneKey, request: Request) -> Result<Submitted, RouteError> {
        // Overdue requests leave a full queue first: nobody is shed for room they hold.
        if lock(&self.queues).is_full() {
            self.expire_queued();
        }
        let since = self.clock.now();
        let (ticket, shed) = {
            let mut queues = lock(&self.queues);
            match queues.make_room(lane.0, request.continues, &self.classes) {
                Ok(shed) => (queues.enqueue(lane, request, since), shed),
                Err(NoRoom::Full { limit }) => {
                    return Err(RouteError::QueueFull {
                        class: self.class_name(lane.0),
                        limit,
                    })
                }
            }
        };
        // Told outside the queue lock: a waiting caller wakes at once.
        if let Some(entry) = shed {
            let class = self.classes.get(entry_class_index(self, &entry.request));
            let by = self.classes.get(lane.0);
            let err = RouteError::Shed {
                class: class.map(|c| c.name.clone()).unwrap_or_default(),
                priority: class.map_or(0, |c| c.priority),
                by_class: by.map(|c| c.name.clone()).unwrap_or_default(),
                by_priority: by.map_or(0, |c| c.priority),
            };
            tracing::debug!(ticket = entry.ticket.id(), "{err}");
            if entry.ticket.is_orphan() {
                // Its caller reads outcomes from `drain` (`select`, `replay`).
                lock(&self.queues)
                    .shed_unread
                    .push((entry.ticket.id(), err));
            } else {
                entry.ticket.finish(&Err(err));
            }
        }
        Ok(Submitted::Queued(ticket))
    }

    fn class_name(&self, class: usize) -> String {
        self.classes
            .get(class)
            .map(|c| c.name.clone())
            .unwrap_or_default()
    }

    pub(super) fn class_of(&self, request: &Request) -> Result<Option<usize>, RouteError> {
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
    pub(super) fn try_admit<O: OverlapSource + ?Sized>(
        &self,
        topology: &Topology,
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
                let all_busy = with_buffer(&SCRATCH, |scratch| {
                    let eligible = eligible(
                        topology.cluster(),
                        request,
                        plan.selection.pin,
                        &mut scratch.rows,
                    );
                    eligible.is_ok_and(|rows| {
                        rows.iter()
                            .all(|&r| self.is_busy(topology, class, source, r))
                    })
                });
                if all_busy {
                    return Ok(None);
                }
                self.decide(topology, &plan, source)?
            }
            // Never books onto a row over the class threshold, whatever the policy picks.
            AdmissionMode::ChosenRow => {
                let decision = self.decide(topology, &plan, source)?;
                if self.is_busy(topology, class, source, decision.row) {
                    return Ok(None);
                }
                decision
            }
        };
        self.dispatch(topology, request, decision, plan, source, waited)
            .map(Some)
    }

    /// Whether `row` is over `class`'s prefill threshold, on the same snapshot selection reads.
    fn is_busy<O: OverlapSource + ?Sized>(
        &self,
        topology: &Topology,
        class: usize,
        source: &O,
        row: RowId,
    ) -> bool {
        use crate::model::Signals;
        let signals = CoreSignals {
            source,
            topology,
            ledger: &self.ledger,
            recency: None,
        };
        let batch = topology
            .cluster()
            .worker(row.worker_id)
            .and_then(|w| w.max_num_batched_tokens);
        let spec = &self.classes[class];
        // Engine saturation only for classes that set its limits: others decide as before.
        spec.is_busy(signals.load(row), batch)
            || (spec.uses_engine_signals() && spec.saturation(self.engine_signals(row)).is_some())
    }

    /// Session lookup: the pin and advisory target this request routes with.
    pub(super) fn plan<'r>(
        &self,
        topology: &Topology,
        request: &'r Request,
        explain: bool,
    ) -> Result<Plan<'r>, RouteError> {
        let lease = match (&self.sessions, &request.session_id) {
            (Some(store), Some(id)) => Some(store.lookup(id)?),
            _ => None,
        };
        let mut selection = Selection::of(request);
        selection.explain = explain;
        let hard_binding_gone = match &lease {
            Some(lease) => self.apply_binding(topology, request, lease, &mut selection),
            None => false,
        };
        Ok(Plan {
            selection,
            lease,
            hard_binding_gone,
        })
    }

    /// Route with `lease`'s binding, if it has one: a soft one becomes the advisory target, a
    /// hard one the pin. `true` when the hard binding's row is gone (the binding is invalidated
    /// and normal selection runs once). Out of line: requests without a session never run it.
    #[inline(never)]
    fn apply_binding(
        &self,
        topology: &Topology,
        request: &Request,
        lease: &Lease,
        selection: &mut Selection<'_>,
    ) -> bool {
        let Some(binding) = lease.binding() else {
            return false;
        };
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
                if check_pin(topology.cluster(), request, row).is_ok() {
                    selection.pin = Some(row);
                } else if let Some(store) = &self.sessions {
                    // The bound row is gone: invalidate, and run normal selection once.
                    store.invalidate(lease.session_id());
                    return true;
                }
            }
            BindingMode::Hard => {}
        }
        false
    }

    pub(super) fn decide<O: OverlapSource + ?Sized>(
        &self,
        topology: &Topology,
        plan: &Plan<'_>,
        source: &O,
    ) -> Result<Decision, RouteError> {
        let signals = CoreSignals {
            source,
            topology,
            ledger: &self.ledger,
            recency: self.recency.as_ref().map(|r| (r, &*self.clock)),
        };
        with_buffer(&SCRATCH, |scratch| {
            self.selector
                .select(topology.cluster(), plan.selection, &signals, scratch)
                .map_err(RouteError::from)
        })
    }

    /// Record the session binding, book the decision and record the booking; then the
    /// instance's hook. `source` is the overlap the decision read: the charge may depend on the
    /// chosen row's.
    pub(super) fn dispatch<O: OverlapSource + ?Sized>(
        &self,
        snapshot: &Topology,
        request: &Request,
        decision: Decision,
        plan: Plan<'_>,
        source: &O,
        queued_for: Duration,
    ) -> Result<Routed, RouteError> {
        if let Some(id) = request.id.filter(|id| id & DRAWN_ID_BIT != 0) {
            return Err(RouteError::ReservedRequestId(id));
        }
        let charge = self.charge(request, decision.row, source);
        // The binding first, with no lock held (a shared store is a network round trip): the
        // booking is then inserted already knowing whether it holds a session lease, so a
        // completion racing this dispatch (a caller's id, or `remove_worker`) ends the lease
        // exactly once. If booking fails below, the lease is ended here instead.
        let (session_outcome, lease_held) = match (&self.sessions, &plan.lease) {
            (Some(_), Some(lease)) => self.record_binding(lease, &plan, decision.row),
            _ => (None, false),
        };
        let end_lease = || {
            if let (true, Some(store), Some(lease)) = (lease_held, &self.sessions, &plan.lease) {
                store.completed(lease.session_id());
            }
        };
        // With session affinity the lease already holds the id: share it rather than copy it.
        let session = match &plan.lease {
            Some(lease) => Some(lease.shared_session_id()),
            None => request.session_id.as_deref().map(Arc::from),
        };
        // A caller's id: held in the directory from the duplicate check to the insert, so two
        // requests with one id cannot both book.
        let mut directory = match request.id {
            Some(id) => {
                let directory = lock(self.callers_of(id));
                if directory.contains_key(&id) {
                    drop(directory);
                    end_lease();
                    return Err(RouteError::DuplicateRequestId(id));
                }
                Some(directory)
            }
            None => None,
        };
        let (slot, index, mut shard) = match self.lock_slot(snapshot, decision.row) {
            Ok(locked) => locked,
            Err(err) => {
                drop(directory);
                end_lease();
                return Err(err);
            }
        };
        let id = match request.id {
            Some(id) => id,
            None => Self::draw_id(&mut shard, index),
        };
        let charge = match self.decode_booking {
            DecodeBooking::Prompt => {
                self.ledger.book(slot, charge);
                charge
            }
            DecodeBooking::Deduplicated => {
                hold_prompt(&self.ledger, &mut shard, id, slot, request, charge)
            }
        };
        shard.bookings.insert(
            id,
            Booking {
                row: decision.row,
                slot,
                instance: decision.instance,
                charge,
                session,
                holds_lease: lease_held,
            },
        );
        if let Some(directory) = directory.as_mut() {
            directory.insert(id, index as u8);
        }
        drop(shard);
        drop(directory);
        if let Some(recency) = &self.recency {
            let cached = source.overlap(decision.row).device;
            recency.record(snapshot, decision.row, request, cached, self.clock.now());
        }
        self.selector.notify_dispatch(
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
        Ok(Routed {
            id,
            decision,
            session: session_outcome,
            queued_for,
        })
    }

    /// Record `lease`'s binding to `row` in the session store: what happened, and whether the
    /// booking holds the lease. Out of line: requests without a session never run it
    /// (docs/performance.md, "What the profiles showed").
    #[inline(never)]
    fn record_binding(
        &self,
        lease: &Lease,
        plan: &Plan<'_>,
        row: RowId,
    ) -> (Option<SessionOutcome>, bool) {
        let Some(store) = &self.sessions else {
            return (None, false);
        };
        match store.dispatched(lease, row) {
            Ok(outcome) => (
                Some(if plan.hard_binding_gone {
                    SessionOutcome::HardBindingGone
                } else {
                    SessionOutcome::Dispatched(outcome)
                }),
                true,
            ),
            Err(err) => {
                // The binding could not be recorded: that is the news, whatever happened to
                // the old one. An unavailable store is logged by the store, once per outage,
                // not once per request.
                if matches!(err, SessionError::StoreUnavailable { .. }) {
                    tracing::debug!(session = lease.session_id(), "{err}");
                } else {
                    tracing::warn!(session = lease.session_id(), "{err}");
                }
                (Some(SessionOutcome::NotRecorded(err)), false)
            }
        }
    }

    /// What booking `request` on `row` adds to it (docs/routing-contract.md §7): the selector's
    /// rule, reading the row's device overlap from `source` only if the rule asks for it. A row
    /// whose KV index is not current counts as caching nothing: its prefill is the whole prompt.
    fn charge<O: OverlapSource + ?Sized>(
        &self,
        request: &Request,
        row: RowId,
        source: &O,
    ) -> Charge {
        self.selector.charge(request.isl_tokens, &|| {
            if source.kv_index_state(row).is_current() {
                source.overlap(row).device
            } else {
                0.0
            }
        })
    }

    /// The slot of `row` and its in-flight shard, locked, on the newest snapshot: while a shard
    /// is held, `remove_worker` (which publishes first, then takes every shard) cannot clear
    /// its slots, so either a booking lands first and is taken away with the worker, or this
    /// sees the worker gone. Usually the decision's snapshot is the newest (one plain load).
    fn lock_slot(
        &self,
        snapshot: &Topology,
        row: RowId,
    ) -> Result<(Slot, usize, MutexGuard<'_, Shard>), RouteError> {
        let slot = snapshot.slot(row).ok_or(RouteError::WorkerRemoved {
            worker_id: row.worker_id,
        })?;
        let index = shard_of_slot(slot);
        let shard = lock(&self.inflight[index]);
        if self.generation.load(Ordering::Acquire) == snapshot.generation() {
            return Ok((slot, index, shard));
        }
        drop(shard);
        self.lock_slot_on_newest(row)
    }

    /// [`RoutingCore::lock_slot`] after a topology change raced the decision: retried on the
    /// newest snapshot until no change lands between reading it and locking the shard. Cold
    /// and out of line, so the request path's code stays small.
    #[cold]
    #[inline(never)]
    fn lock_slot_on_newest(
        &self,
        row: RowId,
    ) -> Result<(Slot, usize, MutexGuard<'_, Shard>), RouteError> {
        loop {
            let newest = self.topology.load_full();
            let slot = newest.slot(row).ok_or(RouteError::WorkerRemoved {
                worker_id: row.worker_id,
            })?;
            let index = shard_of_slot(slot);
            let shard = lock(&self.inflight[index]);
            if self.generation.load(Ordering::Acquire) == newest.generation() {
                return Ok((slot, index, shard));
            }
        }
    }

    /// The request's prefill finished: its prompt tokens no longer count as pending prefill.
    pub fn prefill_complete(&self, id: RequestId) {
        self.with_booking(id, |booking| {
            self.ledger
                .release_prefill(booking.slot, booking.charge.prefill_tokens);
            booking.charge.prefill_tokens = 0;
        });
    }

    /// The request finished: release its load and its session lease. Unknown ids are ignored
    /// (completing twice is harmless) and return `false`.
    pub fn complete(&self, id: RequestId) -> bool {
        self.finish(id, CompletionCode::COMPLETED)
    }

    /// The request ended with `outcome` (completed, failed, cancelled): release it as
    /// [`RoutingCore::complete`] does and tell its policy how it ended.
    pub fn finish(&self, id: RequestId, outcome: CompletionCode) -> bool {
        match self.finish_owing_hook(id, outcome) {
            Some(owed) => {
                self.call_hook(owed);
                true
            }
            None => false,
        }
    }

    /// [`RoutingCore::finish`] without the policy's `on_complete` call, which the caller makes
    /// later with [`RoutingCore::call_hook`], somewhere a call that never returns can do no harm.
    /// The load and the session lease are released at once. `None` for unknown ids.
    pub fn finish_owing_hook(&self, id: RequestId, outcome: CompletionCode) -> Option<OwedHook> {
        let booking = self.take_booking(id)?;
        self.release_lease(&booking);
        Some(OwedHook {
            id,
            booking,
            outcome,
        })
    }

    /// Tell the policy how the request of `owed` ended.
    pub fn call_hook(&self, owed: OwedHook) {
        let OwedHook {
            id,
            booking,
            outcome,
        } = owed;
        self.selector.notify_complete(
            booking.instance,
            &CompleteEvent {
                request_id: id,
                row: booking.row,
                session_id: opt_str(booking.session.as_deref()),
                outcome,
                extensions: RSlice::EMPTY,
            },
        );
    }

    /// Everything after the release: the session lease and the instance's hook (no lock held).
    pub(super) fn end(&self, id: RequestId, booking: Booking, outcome: CompletionCode) {
        self.release_lease(&booking);
        self.call_hook(OwedHook {
            id,
            booking,
            outcome,
        });
    }

    fn release_lease(&self, booking: &Booking) {
        if let (Some(store), Some(session), true) =
            (&self.sessions, &booking.session, booking.holds_lease)
        {
            store.completed(session);
        }
    }
}

/// The `on_complete` call a request that ended still owes its policy
/// ([`RoutingCore::finish_owing_hook`]); dropped, the policy is never told.
#[must_use = "the policy is told only when the hook is called"]
#[derive(Debug)]
pub struct OwedHook {
    id: RequestId,
    booking: Booking,
    outcome: CompletionCode,
}

impl OwedHook {
    /// The instance to tell.
    pub fn instance(&self) -> crate::select::InstanceId {
        self.booking.instance
    }
}

/// Book `charge` on `slot` with its prompt blocks counted once per slot
/// ([`DecodeBooking::Deduplicated`], docs/routing-contract.md §7): the ledger gets the blocks
/// the slot did not hold yet plus those the request's ids do not name; the booking keeps the
/// latter as its charge, the shard the ids it holds. Out of line: the default mode never runs it.
#[inline(never)]
fn hold_prompt(
    ledger: &Ledger,
    shard: &mut Shard,
    id: RequestId,
    slot: Slot,
    request: &Request,
    charge: Charge,
) -> Charge {
    let unnamed = Charge {
        decode_blocks: charge
            .decode_blocks
            .saturating_sub(request.blocks.len() as u64),
        ..charge
    };
    let new = shard.held.hold(id, slot, &request.blocks);
    ledger.book(
        slot,
        Charge {
            decode_blocks: unnamed.decode_blocks.saturating_add(new),
            ..charge
        },
    );
    unnamed
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        static COUNTER: RefCell<u32> = const { RefCell::new(0) };
    }

    #[test]
    fn a_nested_buffer_use_gets_a_fresh_buffer_and_both_results_come_back() {
        let (outer, inner) = with_buffer(&COUNTER, |outer| {
            *outer += 1;
            // The thread's buffer is borrowed: this runs on a fresh default one.
            let inner = with_buffer(&COUNTER, |inner| {
                *inner += 10;
                *inner
            });
            (*outer, inner)
        });
        assert_eq!((outer, inner), (1, 10));
        assert_eq!(
            with_buffer(&COUNTER, |c| *c),
            1,
            "the thread's buffer kept its value"
        );
    }
}
