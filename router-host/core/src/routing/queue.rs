//! Queued requests: re-evaluation after capacity frees (`drain`), cancellation, expiry, waiting.

use std::time::{Duration, Instant};

use super::dispatch::with_overlap_buffers;
use super::signals::IndexOverlap;
use super::{lock, RouteError, Routed, RoutingCore};
use crate::admission::{LaneKey, Queued, Taken, Ticket, TicketId, Waited};
use crate::model::{OverlapSource, Request};
use plugin_api::abi::CompletionCode;

/// A queued request that left its queue: dispatched, failed when re-evaluated, or expired.
#[derive(Debug, Clone, PartialEq)]
pub struct Drained {
    pub ticket: TicketId,
    pub result: Result<Routed, RouteError>,
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl RoutingCore {
    /// Re-evaluate queued requests, lane by lane in order, dispatching each lane's head while it
    /// is admissible, after failing those that waited past their class's `max_wait`. Call after
    /// completions free capacity. Overlap comes from each request's blocks in the KV index.
    ///
    /// Several threads may drain at once; each lane's head is evaluated by one of them at a time
    /// and the others pass that lane by. A head found not admissible while another drain was
    /// called is evaluated once more, so capacity freed meanwhile is not missed. A head whose
    /// evaluation runs past the core's `drain_stall` (its policy call hung) stops holding its
    /// lane, so one stuck call never stops a queue (docs/routing-contract.md §8). The return
    /// value holds this call's outcomes, and those of requests shed since the last drain whose
    /// caller dropped its ticket; every outcome also reaches its ticket.
    pub fn drain(&self, explain: bool) -> Vec<Drained> {
        self.drain_inner(explain, &mut |_, request, f| {
            with_overlap_buffers(|buffers| {
                let topology = self.topology.load();
                f(
                    &IndexOverlap::new(&topology, &self.kv, &request.blocks, buffers)
                        .with_trust(&self.trust)
                        .all_current(self.not_current.none()),
                )
            })
        })
    }

    /// [`RoutingCore::drain`] with each queued request's overlap from `source_for`.
    pub fn drain_with<O: OverlapSource>(
        &self,
        mut source_for: impl FnMut(TicketId, &Request) -> O,
        explain: bool,
    ) -> Vec<Drained> {
        self.drain_inner(explain, &mut |ticket, request, f| {
            f(&source_for(ticket, request))
        })
    }

    fn drain_inner(&self, explain: bool, with_source: &mut WithSource<'_>) -> Vec<Drained> {
        let mut out = Vec::new();
        let shed = {
            let mut queues = lock(&self.queues);
            queues.drain_called();
            std::mem::take(&mut queues.shed_unread)
        };
        out.extend(shed.into_iter().map(|(ticket, err)| Drained {
            ticket,
            result: Err(err),
        }));
        for (entry, waited) in self.take_expired() {
            let class = entry_class(&entry, self);
            self.deliver(entry, Err(self.timeout_error(&class, waited)), &mut out);
        }
        let keys: Vec<LaneKey> = lock(&self.queues).lanes.keys().copied().collect();
        for lane in keys {
            // Dispatch this lane's heads while they are admissible.
            loop {
                // Its own statement: the queue lock must not be held while deciding.
                let taken = lock(&self.queues).take_head(lane);
                let Some(taken) = taken else { break };
                if !self.evaluate(taken, explain, with_source, &mut out) {
                    break;
                }
            }
        }
        out
    }

    /// Decide on a taken head until it leaves its queue (`true`) or goes back to it (`false`).
    fn evaluate(
        &self,
        mut taken: Taken,
        explain: bool,
        with_source: &mut WithSource<'_>,
        out: &mut Vec<Drained>,
    ) -> bool {
        loop {
            let head = &taken.head;
            let waited = self.clock.now().saturating_sub(head.since);
            let topology = self.topology.load();
            let admitted = with_source(head.ticket.id(), &head.request, &mut |source| {
                self.plan(&topology, &head.request, explain)
                    .and_then(|plan| {
                        self.try_admit(&topology, &head.request, plan, taken.lane.0, source, waited)
                    })
            });
            let result = match admitted {
                Ok(Some(routed)) => Ok(routed),
                Err(err) => Err(err),
                Ok(None) => {
                    let again = lock(&self.queues).put_back(taken);
                    match again {
                        Some(again) => {
                            taken = again;
                            continue;
                        }
                        None => return false,
                    }
                }
            };
            let head = lock(&self.queues).head_done(taken);
            self.deliver(head, result, out);
            return true;
        }
    }

    fn deliver(&self, entry: Queued, result: Result<Routed, RouteError>, out: &mut Vec<Drained>) {
        if entry.ticket.finish(&result) {
            // Its caller gave up on it (`abandon`): nobody will finish it.
            if let Ok(routed) = &result {
                self.finish(routed.id, CompletionCode::CANCELLED);
            }
        }
        out.push(Drained {
            ticket: entry.ticket.id(),
            result,
        });
    }

    fn take_expired(&self) -> Vec<(Queued, Duration)> {
        if self.classes.iter().all(|c| c.max_wait.is_none()) {
            return Vec::new();
        }
        let now = self.clock.now();
        lock(&self.queues).take_expired(&self.classes, now)
    }

    fn timeout_error(&self, class: &str, waited: Duration) -> RouteError {
        let max = self
            .classes
            .iter()
            .find(|c| c.name == class)
            .and_then(|c| c.max_wait)
            .unwrap_or(waited);
        RouteError::QueueTimeout {
            class: class.to_string(),
            waited_ms: millis(waited),
            max_wait_ms: millis(max),
        }
    }

    /// Fail every queued request that waited past its class's `max_wait` (they book nothing).
    /// `drain` does this too; call it on a timer when completions may be rare.
    pub fn expire_queued(&self) -> Vec<Drained> {
        let mut out = Vec::new();
        for (entry, waited) in self.take_expired() {
            let class = entry_class(&entry, self);
            self.deliver(entry, Err(self.timeout_error(&class, waited)), &mut out);
        }
        out
    }

    /// Take a queued request out of its queue: it books nothing, its ticket resolves to
    /// [`RouteError::Cancelled`], and it is counted. `false` = not queued (already dispatched,
    /// failed, or being re-evaluated right now: wait on its ticket and finish it if needed).
    pub fn cancel(&self, ticket: TicketId) -> bool {
        let entry = {
            let mut queues = lock(&self.queues);
            let entry = queues.remove(ticket);
            if entry.is_some() {
                queues.stats.cancelled += 1;
            }
            entry
        };
        match entry {
            Some(entry) => {
                entry.ticket.finish(&Err(RouteError::Cancelled));
                true
            }
            None => false,
        }
    }

    /// Block until `ticket` leaves its queue, at most `timeout`; on timeout the request is
    /// taken out of its queue, books nothing and fails with [`RouteError::QueueTimeout`]
    /// (counted as expired).
    pub fn wait(&self, ticket: &Ticket, timeout: Duration) -> Result<Routed, RouteError> {
        let deadline = Instant::now() + timeout;
        match ticket.wait_until(deadline) {
            Waited::Done(result) => result,
            Waited::Taken => Err(RouteError::Cancelled),
            Waited::TimedOut => {
                let entry = {
                    let mut queues = lock(&self.queues);
                    let entry = queues.remove(ticket.id());
                    if entry.is_some() {
                        queues.stats.expired += 1;
                    }
                    entry
                };
                match entry {
                    Some(entry) => {
                        let waited = self.clock.now().saturating_sub(entry.since);
                        let class = entry_class(&entry, self);
                        let err = RouteError::QueueTimeout {
                            class,
                            waited_ms: millis(waited),
                            max_wait_ms: millis(timeout),
                        };
                        entry.ticket.finish(&Err(err.clone()));
                        Err(err)
                    }
                    // Being re-evaluated right now: its outcome is moments away, unless the
                    // policy call deciding it hung.
                    None => {
                        let stall = self.drain_stall();
                        match ticket.wait_until(Instant::now() + stall) {
                            Waited::Done(result) => result,
                            Waited::Taken => Err(RouteError::Cancelled),
                            Waited::TimedOut => {
                                self.abandon(ticket)
                                    .unwrap_or(Err(RouteError::EvaluationStalled {
                                        stall_ms: millis(stall),
                                    }))
                            }
                        }
                    }
                }
            }
        }
    }

    /// How long one re-evaluation may hold its lane (`CoreSettings::drain_stall`).
    pub fn drain_stall(&self) -> Duration {
        lock(&self.queues).stall()
    }

    /// Give up on a queued request's outcome. Still queued: it is cancelled (as [`Self::cancel`],
    /// `None`). Being re-evaluated right now (`cancel` returned `false` and no outcome came,
    /// say because the policy call hung): `None`, and whatever it gets later the core releases
    /// as cancelled. Already out of its queue: `Some(outcome)`, the caller's to handle (finish a
    /// routed one); `Some(Err(Cancelled))` if the outcome was already taken.
    pub fn abandon(&self, ticket: &Ticket) -> Option<Result<Routed, RouteError>> {
        if self.cancel(ticket.id()) {
            return None;
        }
        match ticket.abandon() {
            Waited::TimedOut => None,
            Waited::Done(outcome) => Some(outcome),
            Waited::Taken => Some(Err(RouteError::Cancelled)),
        }
    }
}

type WithSource<'a> = dyn FnMut(
        TicketId,
        &Request,
        &mut dyn FnMut(&dyn OverlapSource) -> Result<Option<Routed>, RouteError>,
    ) -> Result<Option<Routed>, RouteError>
    + 'a;

/// The class name of a queued entry.
fn entry_class(entry: &Queued, core: &RoutingCore) -> String {
    core.class_of(&entry.request)
        .ok()
        .flatten()
        .and_then(|i| core.classes.get(i))
        .map(|c| c.name.clone())
        .unwrap_or_default()
}
