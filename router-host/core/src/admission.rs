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
use crate::routed::{RouteError, Routed};

crate::spelled_enum! {
    /// How a policy class decides that a queued request may go (docs/routing-contract.md §8).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub enum AdmissionMode {
        /// Dispatch while any eligible row is under the threshold (a deferral signal, not a
        /// reservation: the policy may still pick a busy row).
        #[default]
        AnyEligible = "any_eligible",
        /// Decide first; dispatch only if the chosen row is under the threshold.
        ChosenRow = "chosen_row",
    }
}

/// One policy class: its busy rule, its priority and how long its requests may wait.
#[derive(Debug, Clone, PartialEq, Default)]
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
    /// Higher = more important: when the queues are full, a queued request of a lower
    /// priority is shed to make room (docs/admission.md, "Overload").
    pub priority: i64,
    /// Prefill-saturated: a row whose engine reports more waiting requests than this is busy.
    pub max_engine_waiting: Option<u64>,
    /// Decode-saturated: a row whose engine reports a KV-cache usage (0..1) over this is busy.
    pub max_kv_usage: Option<f64>,
}

/// What a row's engine last reported about itself (its `/metrics`); `None` = not known (no
/// scrape yet, or the engine does not export it), which never saturates a row.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineSignals {
    /// `vllm:num_requests_waiting`.
    pub waiting: Option<u64>,
    /// `vllm:kv_cache_usage_perc`, 0..1.
    pub kv_usage: Option<f64>,
}

crate::spelled_enum! {
    /// Which engine limit a saturated row is over.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum Saturation {
        /// Waiting requests over `max_engine_waiting`.
        Prefill = "prefill",
        /// KV-cache usage over `max_kv_usage`.
        Decode = "decode",
    }
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

    /// Whether the class reads engine signals at all (configs without the limits never do).
    pub fn uses_engine_signals(&self) -> bool {
        self.max_engine_waiting.is_some() || self.max_kv_usage.is_some()
    }

    /// The limit `signals` are over, if any. Strict comparisons; an unknown signal is under.
    pub fn saturation(&self, signals: EngineSignals) -> Option<Saturation> {
        if let (Some(limit), Some(waiting)) = (self.max_engine_waiting, signals.waiting) {
            if waiting > limit {
                return Some(Saturation::Prefill);
            }
        }
        if let (Some(limit), Some(usage)) = (self.max_kv_usage, signals.kv_usage) {
            if usage > limit {
                return Some(Saturation::Decode);
            }
        }
        None
    }
}

/// How many requests the admission queues hold together when the configuration sets no
/// `max_queued_requests`. Each queued request holds its prompt's block hashes (a 128k-token
/// prompt is 64 KiB of them), so this bounds the queues' memory to tens of MiB, and a backlog
/// this deep already waits longer than any useful queue deadline.
pub const DEFAULT_MAX_QUEUED: usize = 1024;

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
    /// Lane heads whose evaluation ran past the stall limit (a hung policy call), after which
    /// their lane moved on without them.
    pub stalled: u64,
    /// Queued requests shed to make room for a request of a higher priority.
    pub shed: u64,
    /// Requests refused a place because the queues were full of requests of their priority or
    /// higher.
    pub refused: u64,
}

enum TicketState {
    Waiting(Option<Waker>),
    // Boxed: only queued requests that someone waits on pay for it.
    Done(Option<Box<Result<Routed, RouteError>>>),
    /// The caller gave up while the request was being re-evaluated: the core releases whatever
    /// it gets ([`crate::routing::RoutingCore::abandon`]).
    Abandoned,
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

    /// Whether nobody but the queue holds this ticket (the caller reads outcomes from `drain`).
    pub(crate) fn is_orphan(&self) -> bool {
        Arc::strong_count(&self.shared) == 1
    }

    /// Whether the request left its queue (dispatched, failed, expired or cancelled).
    pub fn is_done(&self) -> bool {
        !matches!(*self.shared.lock(), TicketState::Waiting(_))
    }

    /// The outcome, if there is one and nobody took it yet.
    pub fn try_take(&self) -> Option<Result<Routed, RouteError>> {
        match &mut *self.shared.lock() {
            TicketState::Done(result) => result.take().map(|r| *r),
            TicketState::Waiting(_) | TicketState::Abandoned => None,
        }
    }

    /// Block until the request leaves its queue. Returns `None` only if the outcome was already
    /// taken through another handle.
    pub fn wait(&self) -> Option<Result<Routed, RouteError>> {
        let mut state = self.shared.lock();
        loop {
            match &mut *state {
                TicketState::Done(result) => return result.take().map(|r| *r),
                TicketState::Abandoned => return None,
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
                TicketState::Abandoned => return Waited::Taken,
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
    /// caller dropped it and reads outcomes from `drain`), nothing is stored. `true`: the caller
    /// abandoned the ticket, and whatever it was given must be released.
    pub(crate) fn finish(&self, result: &Result<Routed, RouteError>) -> bool {
        if Arc::strong_count(&self.shared) == 1 {
            return false;
        }
        let waker = {
            let mut state = self.shared.lock();
            let waker = match &mut *state {
                TicketState::Waiting(waker) => waker.take(),
                TicketState::Done(_) => return false,
                TicketState::Abandoned => return true,
            };
            *state = TicketState::Done(Some(Box::new(result.clone())));
            waker
        };
        self.shared.ready.notify_all();
        if let Some(waker) = waker {
            waker.wake();
        }
        false
    }

    /// Give up on the outcome: [`Waited::TimedOut`] if there is none yet (the core will release
    /// what comes), else what [`Ticket::wait_until`] would have seen.
    pub(crate) fn abandon(&self) -> Waited {
        let mut state = self.shared.lock();
        match &mut *state {
            TicketState::Waiting(_) => {
                *state = TicketState::Abandoned;
                Waited::TimedOut
            }
            TicketState::Done(result) => match result.take() {
                Some(result) => Waited::Done(*result),
                None => Waited::Taken,
            },
            TicketState::Abandoned => Waited::Taken,
        }
    }
}

impl Future for Ticket {
    type Output = Option<Result<Routed, RouteError>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut *self.shared.lock() {
            TicketState::Done(result) => Poll::Ready(result.take().map(|r| *r)),
            TicketState::Abandoned => Poll::Ready(None),
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

/// A lane head out of its lane for re-evaluation, and who holds it.
pub(crate) struct Taken {
    pub lane: LaneKey,
    pub head: Queued,
    /// Names this take: a mark another drain replaced (the take stalled) is not cleared by it.
    token: u64,
    /// [`Lanes::drains`] when the head was taken (or last evaluated).
    seen: u64,
}

/// Which take holds a lane's head, since when.
struct Mark {
    token: u64,
    at: Instant,
}

/// Every lane, behind the core's queue lock.
///
/// Drains may run on several threads at once. Each lane's head is evaluated by one drain at a
/// time: the drain takes it out and marks the lane, and while the mark holds, the lane still
/// counts as a backlog (an arrival queues behind the head instead of overtaking it) and other
/// drains pass the lane by. A mark older than `stall` no longer holds the lane: the policy call
/// evaluating that head is taken to be hung (it ran past the watchdog's limit), and the lane's
/// next entry becomes its head.
pub(crate) struct Lanes {
    pub lanes: BTreeMap<LaneKey, VecDeque<Queued>>,
    pub next_ticket: TicketId,
    pub stats: AdmissionStats,
    marks: BTreeMap<LaneKey, Mark>,
    /// Drain calls so far: a head found not admissible while another drain was called (capacity
    /// freed meanwhile, and that drain passed the lane by) is evaluated once more.
    drains: u64,
    next_token: u64,
    stall: Duration,
    /// How many requests all lanes hold together, heads being evaluated included.
    max_queued: usize,
    /// Requests shed whose caller dropped its ticket: the next `drain` returns their outcome
    /// (at most one per shed since the last drain).
    pub shed_unread: Vec<(TicketId, crate::routed::RouteError)>,
}

/// Why a request found no place in the queues.
pub(crate) enum NoRoom {
    /// Full of requests of its priority or higher.
    Full { limit: usize },
}

impl Lanes {
    pub fn new(stall: Duration, max_queued: usize) -> Lanes {
        Lanes {
            lanes: BTreeMap::new(),
            next_ticket: 0,
            stats: AdmissionStats::default(),
            marks: BTreeMap::new(),
            drains: 0,
            next_token: 0,
            stall,
            max_queued,
            shed_unread: Vec::new(),
        }
    }

    /// Requests queued now, counting heads out for re-evaluation (they may come back).
    fn occupied(&self) -> usize {
        usize::try_from(self.stats.waiting).unwrap_or(usize::MAX) + self.marks.len()
    }

    /// Whether the queues hold their bound.
    pub fn is_full(&self) -> bool {
        self.occupied() >= self.max_queued
    }

    /// Make room for a request of `class` when the queues are full: take out the queued request
    /// of the lowest priority below `class`'s (the newest among equals) and return it, the
    /// caller's to fail as shed; or say there is no room. `Ok(None)`: there is room. A leg that
    /// [continues](Request::continues) a request always has room and is never taken out.
    pub fn make_room(
        &mut self,
        class: usize,
        continues: bool,
        classes: &[ClassSpec],
    ) -> Result<Option<Queued>, NoRoom> {
        if continues || self.occupied() < self.max_queued {
            return Ok(None);
        }
        let priority = |class: usize| classes.get(class).map_or(0, |c| c.priority);
        let newcomer = priority(class);
        // Lowest priority first; among equals the newest (the highest ticket id) goes.
        let victim = self
            .lanes
            .iter()
            .flat_map(|(key, lane)| {
                lane.iter()
                    .filter(|e| !e.request.continues)
                    .map(move |e| (priority(key.0), e.ticket.id()))
            })
            .filter(|(p, _)| *p < newcomer)
            .min_by_key(|(p, id)| (*p, std::cmp::Reverse(*id)))
            .map(|(_, id)| id);
        match victim.and_then(|id| self.remove(id)) {
            Some(entry) => {
                self.stats.shed += 1;
                Ok(Some(entry))
            }
            None => {
                self.stats.refused += 1;
                Err(NoRoom::Full {
                    limit: self.max_queued,
                })
            }
        }
    }

    pub fn has_backlog(&self, lane: LaneKey) -> bool {
        self.held(lane) || self.lanes.get(&lane).is_some_and(|q| !q.is_empty())
    }

    /// How long a re-evaluation may hold its lane (`CoreSettings::drain_stall`).
    pub fn stall(&self) -> Duration {
        self.stall
    }

    /// Whether a drain holds `lane`'s head right now (a stalled mark does not).
    fn held(&self, lane: LaneKey) -> bool {
        self.marks
            .get(&lane)
            .is_some_and(|mark| mark.at.elapsed() < self.stall)
    }

    /// A drain starts: heads being evaluated elsewhere will be evaluated once more.
    pub fn drain_called(&mut self) {
        self.drains += 1;
    }

    /// Take the head of `lane` for re-evaluation, unless another drain holds the lane.
    pub fn take_head(&mut self, lane: LaneKey) -> Option<Taken> {
        if self.held(lane) {
            return None;
        }
        if self.marks.remove(&lane).is_some() {
            self.stats.stalled += 1;
            tracing::warn!(
                class = lane.0,
                pinned_worker = lane.1.map(|row| row.worker_id),
                pinned_rank = lane.1.map(|row| row.dp_rank),
                stall_ms = self.stall.as_millis() as u64,
                "a queued request's re-evaluation has run past the drain stall (a hung policy call): its lane moves on without it"
            );
        }
        let head = self.lanes.get_mut(&lane)?.pop_front()?;
        self.stats.waiting = self.stats.waiting.saturating_sub(1);
        self.next_token += 1;
        let token = self.next_token;
        self.marks.insert(
            lane,
            Mark {
                token,
                at: Instant::now(),
            },
        );
        Some(Taken {
            lane,
            head,
            token,
            seen: self.drains,
        })
    }

    /// The taken head is still not admissible. If a drain was called since it was taken (and
    /// its lane is still this take's), it comes back to be evaluated again; otherwise it goes
    /// back to the front of its lane.
    pub fn put_back(&mut self, mut taken: Taken) -> Option<Taken> {
        let ours = self.owns(&taken);
        if ours && taken.seen != self.drains {
            taken.seen = self.drains;
            return Some(taken);
        }
        if ours {
            self.marks.remove(&taken.lane);
        }
        self.lanes
            .entry(taken.lane)
            .or_default()
            .push_front(taken.head);
        self.stats.waiting += 1;
        None
    }

    /// The taken head leaves the queue (dispatched or failed): here it is.
    pub fn head_done(&mut self, taken: Taken) -> Queued {
        if self.owns(&taken) {
            self.marks.remove(&taken.lane);
        }
        if self.lanes.get(&taken.lane).is_some_and(VecDeque::is_empty) {
            self.lanes.remove(&taken.lane);
        }
        taken.head
    }

    fn owns(&self, taken: &Taken) -> bool {
        self.marks
            .get(&taken.lane)
            .is_some_and(|m| m.token == taken.token)
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

#[cfg(test)]
mod tests {
    use super::*;

    const LANE: LaneKey = (0, None);

    fn lanes_with(n: usize, stall: Duration) -> (Lanes, Vec<Ticket>) {
        let mut lanes = Lanes::new(stall, DEFAULT_MAX_QUEUED);
        let tickets = (0..n)
            .map(|_| lanes.enqueue(LANE, Request::default(), Duration::ZERO))
            .collect();
        (lanes, tickets)
    }

    #[test]
    fn a_taken_head_holds_its_lane_until_it_goes_back_or_leaves() {
        let (mut lanes, tickets) = lanes_with(2, Duration::from_secs(3600));
        let first = lanes.take_head(LANE).expect("a head");
        assert_eq!(first.head.ticket, tickets[0]);
        assert!(
            lanes.take_head(LANE).is_none(),
            "another drain holds the lane"
        );
        assert!(lanes.has_backlog(LANE));
        assert_eq!(lanes.stats.waiting, 1);
        assert!(
            lanes.put_back(first).is_none(),
            "no drain was called meanwhile"
        );
        assert_eq!(lanes.stats.waiting, 2);
        let again = lanes.take_head(LANE).expect("the lane is free again");
        assert_eq!(again.head.ticket, tickets[0], "put back at the front");
        let head = lanes.head_done(again);
        assert_eq!(head.ticket, tickets[0]);
        let second = lanes.take_head(LANE).expect("the next head");
        assert_eq!(second.head.ticket, tickets[1]);
        lanes.head_done(second);
        assert!(!lanes.has_backlog(LANE));
        assert_eq!(lanes.stats.stalled, 0);
    }

    #[test]
    fn a_head_found_not_admissible_while_a_drain_was_called_is_evaluated_again() {
        let (mut lanes, tickets) = lanes_with(1, Duration::from_secs(3600));
        let taken = lanes.take_head(LANE).expect("a head");
        // Capacity freed elsewhere: that drain passes the held lane by.
        lanes.drain_called();
        assert!(lanes.take_head(LANE).is_none());
        let again = lanes.put_back(taken).expect("evaluated once more");
        assert_eq!(again.head.ticket, tickets[0]);
        assert!(lanes.has_backlog(LANE), "still held");
        assert!(lanes.put_back(again).is_none(), "nothing new since");
        assert_eq!(lanes.stats.waiting, 1);
    }

    #[test]
    fn a_stalled_take_stops_holding_its_lane_and_its_late_return_disturbs_nobody() {
        let (mut lanes, tickets) = lanes_with(3, Duration::ZERO);
        let stuck = lanes.take_head(LANE).expect("a head");
        assert!(
            !lanes.has_backlog((1, None)) && lanes.has_backlog(LANE),
            "the lane's other entries are still a backlog"
        );
        let next = lanes.take_head(LANE).expect("past a stalled take");
        assert_eq!(next.head.ticket, tickets[1]);
        assert_eq!(lanes.stats.stalled, 1);
        // The stuck call comes back after all, not admissible: its request goes back to the
        // front, and the lane stays the newer take's.
        lanes.drain_called();
        assert!(lanes.put_back(stuck).is_none(), "not its lane any more");
        assert_eq!(lanes.stats.waiting, 2);
        let again = lanes.put_back(next).expect("the newer take saw the drain");
        lanes.head_done(again);
        let front = lanes.take_head(LANE).expect("a head");
        assert_eq!(front.head.ticket, tickets[0], "the late one is first again");
    }

    #[test]
    fn with_only_a_stalled_head_out_the_lane_is_no_backlog() {
        let (mut lanes, _tickets) = lanes_with(1, Duration::ZERO);
        let _stuck = lanes.take_head(LANE).expect("a head");
        assert!(
            !lanes.has_backlog(LANE),
            "an arrival need not queue behind a hung call"
        );
    }
}
