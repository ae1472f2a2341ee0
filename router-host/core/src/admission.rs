//! Queue admission (policy classes, lanes) and the tickets queued requests wait on.
//!
//! A request with a policy class is dispatched at once when its class admits it, and otherwise
//! waits in a lane: one per class, plus one per (class, pinned row), so a busy pin (explicit, or
//! a hard session binding) holds up only its own lane. The rules are in
//! `docs/routing-contract.md`, "Admission"; [`crate::routing::RoutingCore`] applies them.
//!
//! A [`Ticket`] is the caller's handle on a queued request. It can be waited on by blocking
//! ([`Ticket::wait`]), with a deadline ([`crate::routing::RoutingCore::wait`]), or as a
//! `Future` from any async runtime (it stores a `Waker`; the core depends on none).

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::model::{Request, RowId, RowLoad};
use crate::routing::{RouteError, Routed};

/// How a policy class decides that a queued request may go (docs/routing-contract.md §8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum AdmissionMode {
    /// Dispatch while any eligible row is under the threshold (a deferral signal, not a
    /// reservation: the policy may still pick a busy row).
    #[default]
    AnyEligible,
    /// Decide first; dispatch only if the chosen row is under the threshold.
    ChosenRow,
}

impl AdmissionMode {
    /// Every mode, in declaration order.
    pub const ALL: [AdmissionMode; 2] = [AdmissionMode::AnyEligible, AdmissionMode::ChosenRow];

    /// The YAML / metrics spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            AdmissionMode::AnyEligible => "any_eligible",
            AdmissionMode::ChosenRow => "chosen_row",
        }
    }

    /// The mode spelled `name` (as [`Self::as_str`] writes it), if any.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|mode| mode.as_str() == name)
    }
}

impl fmt::Display for AdmissionMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One policy class: its busy rule and how long its requests may wait.
#[derive(Debug, Clone, PartialEq)]
pub struct ClassSpec {
    pub name: String,
    /// Busy when a row's pending prefill tokens exceed this.
    pub prefill_busy_threshold: Option<u64>,
    /// Busy when pending prefill tokens exceed this fraction of the worker's
    /// `max_num_batched_tokens` (never, for a worker whose batch size is unknown).
    pub prefill_busy_threshold_frac: Option<f64>,
    pub mode: AdmissionMode,
    /// A request queued longer than this fails with [`RouteError::QueueTimeout`] and books
    /// nothing; `None` = waits until admitted or cancelled.
    pub max_wait: Option<Duration>,
}

impl ClassSpec {
    /// Strict comparisons; a worker whose batch size is unknown is never busy by the fraction.
    pub fn is_busy(&self, load: RowLoad, max_num_batched_tokens: Option<u64>) -> bool {
        let tokens = load.active_prefill_tokens;
        self.prefill_busy_threshold.is_some_and(|abs| tokens > abs)
            || match (self.prefill_busy_threshold_frac, max_num_batched_tokens) {
                (Some(frac), Some(batch)) => tokens as f64 > frac * batch as f64,
                _ => false,
            }
    }
}

/// Identifies a queued request.
pub type TicketId = u64;

/// Admission counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AdmissionStats {
    /// Requests that entered a queue.
    pub queued: u64,
    /// Requests waiting now.
    pub waiting: u64,
    /// Queued requests cancelled before dispatch (they booked nothing).
    pub cancelled: u64,
    /// Queued requests that waited past their class's `max_wait` (they booked nothing).
    pub expired: u64,
}

enum TicketState {
    Waiting(Option<Waker>),
    // Boxed: only queued requests that someone waits on pay for it.
    Done(Option<Box<Result<Routed, RouteError>>>),
}

/// What a bounded wait on a [`Ticket`] saw.
// Returned by value and consumed at once, like `Submitted`.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Waited {
    /// The request left its queue with this outcome.
    Done(Result<Routed, RouteError>),
    /// It left its queue, but the outcome was already taken through another handle.
    Taken,
    /// Still queued at the deadline.
    TimedOut,
}

struct TicketShared {
    id: TicketId,
    state: Mutex<TicketState>,
    ready: Condvar,
}

impl TicketShared {
    fn lock(&self) -> MutexGuard<'_, TicketState> {
        // The state is a plain value: a panic elsewhere cannot leave it half-written.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A queued request's handle: wait on it, poll it as a future, or cancel it through the core.
#[derive(Clone)]
pub struct Ticket {
    shared: Arc<TicketShared>,
}

impl Ticket {
    fn new(id: TicketId) -> Ticket {
        Ticket {
            shared: Arc::new(TicketShared {
                id,
                state: Mutex::new(TicketState::Waiting(None)),
                ready: Condvar::new(),
            }),
        }
    }

    pub fn id(&self) -> TicketId {
        self.shared.id
    }

    /// Whether the request left its queue (dispatched, failed, expired or cancelled).
    pub fn is_done(&self) -> bool {
        matches!(*self.shared.lock(), TicketState::Done(_))
    }

    /// The outcome, if there is one and nobody took it yet.
    pub fn try_take(&self) -> Option<Result<Routed, RouteError>> {
        match &mut *self.shared.lock() {
            TicketState::Done(result) => result.take().map(|r| *r),
            TicketState::Waiting(_) => None,
        }
    }

    /// Block until the request leaves its queue. Returns `None` only if the outcome was already
    /// taken through another handle.
    pub fn wait(&self) -> Option<Result<Routed, RouteError>> {
        let mut state = self.shared.lock();
        loop {
            match &mut *state {
                TicketState::Done(result) => return result.take().map(|r| *r),
                TicketState::Waiting(_) => {
                    state = self
                        .shared
                        .ready
                        .wait(state)
                        .unwrap_or_else(PoisonError::into_inner);
                }
            }
        }
    }

    /// Block until the request leaves its queue or `deadline` passes.
    pub fn wait_until(&self, deadline: Instant) -> Waited {
        let mut state = self.shared.lock();
        loop {
            match &mut *state {
                TicketState::Done(result) => {
                    return match result.take() {
                        Some(result) => Waited::Done(*result),
                        None => Waited::Taken,
                    }
                }
                TicketState::Waiting(_) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Waited::TimedOut;
                    }
                    state = self
                        .shared
                        .ready
                        .wait_timeout(state, left)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
            }
        }
    }

    /// Hand the outcome to whoever holds a handle. With no handle left but the queue's own (the
    /// caller dropped it and reads outcomes from `drain`), nothing is stored.
    pub(crate) fn finish(&self, result: &Result<Routed, RouteError>) {
        if Arc::strong_count(&self.shared) == 1 {
            return;
        }
        let waker = {
            let mut state = self.shared.lock();
            let waker = match &mut *state {
                TicketState::Waiting(waker) => waker.take(),
                TicketState::Done(_) => return,
            };
            *state = TicketState::Done(Some(Box::new(result.clone())));
            waker
        };
        self.shared.ready.notify_all();
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

impl Future for Ticket {
    type Output = Option<Result<Routed, RouteError>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut *self.shared.lock() {
            TicketState::Done(result) => Poll::Ready(result.take().map(|r| *r)),
            TicketState::Waiting(waker) => {
                match waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    _ => *waker = Some(cx.waker().clone()),
                }
                Poll::Pending
            }
        }
    }
}

impl PartialEq for Ticket {
    fn eq(&self, other: &Ticket) -> bool {
        self.id() == other.id()
    }
}

impl fmt::Debug for Ticket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ticket").field("id", &self.id()).finish()
    }
}

/// Lane key: class index, and the pinned row for pinned requests. `BTreeMap` keeps drain order
/// deterministic.
pub(crate) type LaneKey = (usize, Option<RowId>);

pub(crate) struct Queued {
    pub ticket: Ticket,
    pub request: Request,
    pub since: Duration,
}

/// Every lane, behind the core's queue lock.
#[derive(Default)]
pub(crate) struct Lanes {
    pub lanes: BTreeMap<LaneKey, VecDeque<Queued>>,
    pub next_ticket: TicketId,
    pub stats: AdmissionStats,
    /// The lane whose head the drainer took out to re-evaluate: it still counts as a backlog,
    /// so an arrival meanwhile queues behind the head instead of overtaking it.
    pub draining: Option<LaneKey>,
}

impl Lanes {
    pub fn has_backlog(&self, lane: LaneKey) -> bool {
        self.draining == Some(lane) || self.lanes.get(&lane).is_some_and(|q| !q.is_empty())
    }

    /// Take the head of `lane` for re-evaluation (it stays a backlog until put back or gone).
    pub fn take_head(&mut self, lane: LaneKey) -> Option<Queued> {
        let head = self.lanes.get_mut(&lane)?.pop_front()?;
        self.draining = Some(lane);
        self.stats.waiting = self.stats.waiting.saturating_sub(1);
        Some(head)
    }

    /// The head taken by [`Lanes::take_head`] is still not admissible: back to the front.
    pub fn put_back(&mut self, lane: LaneKey, head: Queued) {
        self.lanes.entry(lane).or_default().push_front(head);
        self.draining = None;
        self.stats.waiting += 1;
    }

    /// The head taken by [`Lanes::take_head`] left the queue.
    pub fn head_done(&mut self, lane: LaneKey) {
        self.draining = None;
        if self.lanes.get(&lane).is_some_and(VecDeque::is_empty) {
            self.lanes.remove(&lane);
        }
    }

    pub fn enqueue(&mut self, lane: LaneKey, request: Request, since: Duration) -> Ticket {
        let ticket = Ticket::new(self.next_ticket);
        self.next_ticket += 1;
        self.stats.queued += 1;
        self.stats.waiting += 1;
        self.lanes.entry(lane).or_default().push_back(Queued {
            ticket: ticket.clone(),
            request,
            since,
        });
        ticket
    }

    /// Take the entry of `ticket` out of whatever lane holds it.
    pub fn remove(&mut self, ticket: TicketId) -> Option<Queued> {
        let (key, at) = self.lanes.iter().find_map(|(key, q)| {
            q.iter()
                .position(|e| e.ticket.id() == ticket)
                .map(|at| (*key, at))
        })?;
        let lane = self.lanes.get_mut(&key)?;
        let entry = lane.remove(at);
        if lane.is_empty() {
            self.lanes.remove(&key);
        }
        self.stats.waiting = self.stats.waiting.saturating_sub(1);
        entry
    }

    /// Take every entry that waited past its class's limit.
    pub fn take_expired(
        &mut self,
        classes: &[ClassSpec],
        now: Duration,
    ) -> Vec<(Queued, Duration)> {
        let mut expired = Vec::new();
        for (&(class, _), lane) in self.lanes.iter_mut() {
            let Some(max) = classes.get(class).and_then(|c| c.max_wait) else {
                continue;
            };
            let mut kept = VecDeque::with_capacity(lane.len());
            for entry in lane.drain(..) {
                let waited = now.saturating_sub(entry.since);
                if waited > max {
                    expired.push((entry, waited));
                } else {
                    kept.push_back(entry);
                }
            }
            *lane = kept;
        }
        self.lanes.retain(|_, q| !q.is_empty());
        let n = expired.len() as u64;
        self.stats.expired += n;
        self.stats.waiting = self.stats.waiting.saturating_sub(n);
        expired
    }
}
