//! Queued requests: re-evaluation after capacity frees (`drain`), cancellation, expiry, waiting.

use std::sync::atomic::Ordering;
use std::sync::TryLockError;
use std::time::{Duration, Instant};

use super::dispatch::with_overlap_buffers;
use super::signals::IndexOverlap;
use super::{lock, RouteError, Routed, RoutingCore};
use crate::admission::{LaneKey, Queued, Ticket, TicketId, Waited};
use crate::model::{OverlapSource, Request};

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
    /// One thread drains at a time; a call made while another thread drains asks that thread to
    /// run once more and returns at once (its outcomes reach their tickets, and that thread's
    /// return value).
    pub fn drain(&self, explain: bool) -> Vec<Drained> {
        self.drain_inner(explain, &mut |_, request, f| {
            with_overlap_buffers(|buffers| {
                let topology = self.topology.load();
                f(&IndexOverlap::new(
                    &topology,
                    &self.kv,
                    &request.blocks,
                    buffers,
                ))
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
        let mut drained = Vec::new();
        self.drain_requested.store(true, Ordering::SeqCst);
        loop {
            let guard = match self.drainer.try_lock() {
                Ok(guard) => guard,
                Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
                Err(TryLockError::WouldBlock) => return drained,
            };
            while self.drain_requested.swap(false, Ordering::SeqCst) {
                self.drain_pass(explain, with_source, &mut drained);
            }
            drop(guard);
            // A request made after our last pass but before we let go: take it, or leave it to
            // the thread that now holds the drainer.
            if !self.drain_requested.load(Ordering::SeqCst) {
                return drained;
            }
        }
    }

    fn drain_pass(&self, explain: bool, with_source: &mut WithSource<'_>, out: &mut Vec<Drained>) {
        for (entry, waited) in self.take_expired() {
            let class = entry_class(&entry, self);
            self.deliver(entry, Err(self.timeout_error(&class, waited)), out);
        }
        let keys: Vec<LaneKey> = lock(&self.queues).lanes.keys().copied().collect();
        for lane in keys {
            loop {
                let Some(head) = lock(&self.queues).take_head(lane) else {
                    break;
                };
                let waited = self.clock.now().saturating_sub(head.since);
                let topology = self.topology.load();
                let admitted = with_source(head.ticket.id(), &head.request, &mut |source| {
                    self.plan(&topology, &head.request, explain)
                        .and_then(|plan| {
                            self.try_admit(&topology, &head.request, plan, lane.0, source, waited)
                        })
                });
                match admitted {
                    Ok(Some(routed)) => {
                        lock(&self.queues).head_done(lane);
                        self.deliver(head, Ok(routed), out);
                    }
                    Ok(None) => {
                        // Still not admissible: back to the head of its lane.
                        lock(&self.queues).put_back(lane, head);
                        break;
                    }
                    Err(err) => {
                        lock(&self.queues).head_done(lane);
                        self.deliver(head, Err(err), out);
                    }
                }
            }
        }
    }

    fn deliver(&self, entry: Queued, result: Result<Routed, RouteError>, out: &mut Vec<Drained>) {
        entry.ticket.finish(&result);
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
                    // Being re-evaluated right now: its outcome is moments away.
                    None => ticket.wait().unwrap_or(Err(RouteError::Cancelled)),
                }
            }
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
