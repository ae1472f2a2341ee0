//! The routing core under several threads at once: submitting (some queued, some cancelled),
//! ending requests every way (completed, failed, prefill first), draining queues, workers
//! joining, draining and leaving, KV events, soft session bindings.
//!
//! Bounded: every thread runs a fixed number of operations, every wait has a bound. The
//! assertions hold for any interleaving, so the test cannot pass or fail by timing: every
//! booking released exactly once, the ledger back to zero on every row and no prompt block
//! held, the policy told of each dispatch and each end exactly once, every session binding
//! created exactly once and none in flight, every queued request accounted for.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use plugin_api::abi::CompletionCode;
use router_core::admission::Ticket;
use router_core::kv_index::{KvEventKind, Tier};
use router_core::ledger::DecodeBooking;
use router_core::model::{NoOverlap, Request, RowId, RowLoad, Worker};
use router_core::rng::SplitMix64;
use router_core::routing::{
    CoreSettings, RouteError, Routed, RoutingCore, SessionOutcome, Submitted,
};
use router_core::sessions::{
    BindingGranularity, BindingMode, DispatchOutcome, SessionStore, SessionTable, SystemClock,
    DEFAULT_MAX_BINDINGS,
};

use common::{core_of, default_class, Cheapest};

const THREADS: u64 = 4;
const OPS: u64 = 1_500;
const SESSIONS: u64 = 64;
/// A row is busy past this many pending prefill tokens. The ballast makes every row busy at the
/// start, so the queue is used whatever the interleaving; after it, each thread ends its
/// requests down to 4 after every operation, so rows free up and requests are dispatched both
/// at once and from the queue.
const BUSY_TOKENS: u64 = 4_000;
/// Blocks in every prompt (its session's prefix).
const BLOCKS: u64 = 8;
/// Ids of the requests that keep every row busy at the start (no thread uses ids this high).
const BALLAST: u64 = 1 << 40;

struct Setup {
    core: RoutingCore,
    selector: Arc<Cheapest>,
    table: Arc<SessionTable>,
}

/// Eight workers of two ranks, soft session affinity (TTL an hour), one class whose rows are
/// busy past 4,000 pending prefill tokens; prompts booked as `decode_booking` says.
fn setup(decode_booking: DecodeBooking) -> Setup {
    let table = Arc::new(
        SessionTable::new(
            BindingMode::Soft,
            Duration::from_secs(3600),
            DEFAULT_MAX_BINDINGS,
            Arc::new(SystemClock),
        )
        .with_granularity(BindingGranularity::Worker),
    );
    let selector = Arc::new(Cheapest::tracking(true));
    let core = core_of(
        selector.clone(),
        (0..8).map(|w| Worker::new(w).with_ranks(0, 2)).collect(),
        CoreSettings {
            sessions: Some(table.clone() as Arc<dyn SessionStore>),
            classes: vec![default_class(BUSY_TOKENS, None)],
            decode_booking,
            // Every request must be accounted for: a bound would refuse some (tests/overload.rs).
            max_queued: Some(usize::MAX),
            ..CoreSettings::default()
        },
    );
    Setup {
        core,
        selector,
        table,
    }
}

/// What one thread saw.
#[derive(Default)]
struct Seen {
    /// Dispatched requests this thread still has to end.
    held: Vec<u64>,
    /// Sessions whose binding this thread saw created.
    created: Vec<String>,
    /// Queued requests still waiting, with their prompt's prefix.
    tickets: Vec<(Ticket, u64)>,
    cancelled: u64,
    dispatched: u64,
}

/// The events of an engine storing the blocks of a prompt with `prefix`.
fn stored(prefix: u64) -> impl Iterator<Item = (KvEventKind, Tier, u64)> {
    (0..BLOCKS).map(move |b| (KvEventKind::Stored, Tier::Device, prefix * 1000 + b))
}

fn record(seen: &mut Seen, routed: &Routed, session: Option<&String>) {
    seen.dispatched += 1;
    seen.held.push(routed.id);
    if let (Some(SessionOutcome::Dispatched(DispatchOutcome::Created)), Some(s)) =
        (&routed.session, session)
    {
        seen.created.push(s.clone());
    }
}

#[test]
fn many_threads_route_complete_cancel_and_change_workers_without_losing_anything() {
    stress(DecodeBooking::Prompt);
}

/// The same with each prompt block booked once per row: the per-row block counts are kept
/// under the same locks as the bookings, so they must empty exactly as the ledger does.
#[test]
fn deduplicated_decode_booking_loses_nothing_under_threads_either() {
    stress(DecodeBooking::Deduplicated);
}

fn stress(decode_booking: DecodeBooking) {
    let setup = Arc::new(setup(decode_booking));
    let start = Arc::new(Barrier::new(THREADS as usize));
    let removed_in_flight = Arc::new(Mutex::new(BTreeSet::new()));
    let draining = Arc::new(AtomicBool::new(false));
    let freed = Arc::new(Mutex::new(Vec::new()));
    // Ballast: every row starts over the class threshold, so each thread's first request
    // queues whatever the interleaving; thread 0 releases it a sixth of the way in.
    let ballast: Vec<u64> = (0..8)
        .flat_map(|w| [(w, 0), (w, 1)])
        .map(|(worker_id, dp_rank)| {
            let pinned = Request {
                id: Some(BALLAST + worker_id * 2 + u64::from(dp_rank)),
                pinned_worker: Some(RowId { worker_id, dp_rank }),
                isl_tokens: BUSY_TOKENS + 1,
                ..Default::default()
            };
            setup.core.route(&pinned, &NoOverlap, false).unwrap().id
        })
        .collect();
    let ballast = Arc::new(ballast);
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let draining = Arc::clone(&draining);
            let freed = Arc::clone(&freed);
            let setup = Arc::clone(&setup);
            let start = Arc::clone(&start);
            let removed_in_flight = Arc::clone(&removed_in_flight);
            let ballast = Arc::clone(&ballast);
            std::thread::spawn(move || {
                let core = &setup.core;
                let mut rng = SplitMix64::new(0x5eed + t);
                let mut seen = Seen::default();
                start.wait();
                for i in 0..OPS {
                    if t == 0 && i == OPS / 6 {
                        for &id in ballast.iter() {
                            assert!(core.complete(id), "ballast {id}");
                        }
                    }
                    // Thread 0 changes membership midway: a worker joins, one drains, one leaves.
                    if t == 0 && i == OPS / 3 {
                        // 50 ranks: past the ledger's first 64 slots, so it grows while others book.
                        core.add_worker(Worker::new(100).with_ranks(0, 50)).unwrap();
                        core.set_worker_state(5, None, None, Some(true)).unwrap();
                        draining.store(true, Ordering::SeqCst);
                    }
                    if t == 0 && i == OPS / 2 {
                        let topology = core.topology();
                        let slots = topology.cluster().worker(3).unwrap().rows();
                        freed
                            .lock()
                            .unwrap()
                            .extend(slots.filter_map(|r| topology.slot(r)));
                        let removed = core.remove_worker(3).unwrap();
                        removed_in_flight.lock().unwrap().extend(removed.in_flight);
                    }
                    let after_draining = draining.load(Ordering::SeqCst);
                    let number = rng.next_u64() % SESSIONS;
                    let session = (!rng.next_u64().is_multiple_of(4)).then(|| format!("s{number}"));
                    // Each session's prompts share its own prefix; anonymous ones share another.
                    let prefix = session.as_ref().map_or(0, |_| number + 1);
                    let request = Request {
                        id: Some((t << 32) | i),
                        blocks: (0..BLOCKS).map(|b| prefix * 1000 + b).collect(),
                        isl_tokens: 256 + rng.next_u64() % 2048,
                        session_id: session.clone(),
                        ..Default::default()
                    };
                    match core.submit_indexed(request.clone(), false) {
                        Ok(Submitted::Dispatched(routed)) => {
                            assert!(
                                !(after_draining && routed.decision.row.worker_id == 5),
                                "a request decided after worker 5 was marked draining went there"
                            );
                            core.apply_kv_events(routed.decision.row, stored(prefix));
                            record(&mut seen, &routed, session.as_ref());
                        }
                        Ok(Submitted::Queued(ticket)) => {
                            if rng.next_u64().is_multiple_of(2) {
                                if core.cancel(ticket.id()) {
                                    seen.cancelled += 1;
                                    assert_eq!(ticket.try_take(), Some(Err(RouteError::Cancelled)));
                                } else {
                                    seen.tickets.push((ticket, prefix));
                                }
                            } else {
                                seen.tickets.push((ticket, prefix));
                            }
                        }
                        // The only errors possible here: the chosen worker left mid-decision.
                        Err(RouteError::WorkerRemoved { worker_id: 3 }) => {}
                        Err(err) => panic!("thread {t} request {i}: {err}"),
                    }
                    // End some held requests: completed, failed, or prefill first.
                    while seen.held.len() > 4 {
                        let at = (rng.next_u64() as usize) % seen.held.len();
                        let id = seen.held.swap_remove(at);
                        match rng.next_u64() % 3 {
                            0 => {
                                core.finish(id, CompletionCode::FAILED);
                            }
                            1 => {
                                core.prefill_complete(id);
                                core.complete(id);
                            }
                            _ => {
                                core.complete(id);
                            }
                        }
                    }
                    if i % 16 == 0 {
                        core.drain(false);
                    }
                    // Waiting tickets resolve through anyone's drain; collect those done.
                    let mut still = Vec::new();
                    for (ticket, prefix) in std::mem::take(&mut seen.tickets) {
                        // Read before taking: a ticket done before the take must yield its
                        // outcome (one that finishes in between is simply taken next round).
                        let was_done = ticket.is_done();
                        match ticket.try_take() {
                            Some(Ok(routed)) => {
                                core.apply_kv_events(routed.decision.row, stored(prefix));
                                record(&mut seen, &routed, None);
                            }
                            Some(Err(RouteError::WorkerRemoved { .. })) => {}
                            Some(Err(err)) => panic!("queued request failed: {err}"),
                            None if was_done => panic!("outcome taken twice"),
                            None => still.push((ticket, prefix)),
                        }
                    }
                    seen.tickets = still;
                }
                seen
            })
        })
        .collect();
    let mut all: Vec<Seen> = threads
        .into_iter()
        .map(|h| h.join().expect("no thread panicked"))
        .collect();
    let core = &setup.core;

    // Release everything still held, then let the queues empty, then release what they gave.
    let removed = removed_in_flight.lock().unwrap().clone();
    let mut ended = BTreeSet::new();
    for _ in 0..5_000 {
        for seen in &mut all {
            for id in seen.held.drain(..) {
                let released = core.complete(id);
                assert_eq!(released, !removed.contains(&id), "request {id}");
                assert!(ended.insert(id), "request {id} ended twice");
                assert!(!core.complete(id), "request {id} released twice");
            }
            let mut still = Vec::new();
            for (ticket, prefix) in std::mem::take(&mut seen.tickets) {
                match ticket.try_take() {
                    Some(Ok(routed)) => {
                        seen.dispatched += 1;
                        seen.held.push(routed.id);
                    }
                    Some(Err(RouteError::WorkerRemoved { .. })) => {}
                    Some(Err(err)) => panic!("queued request failed: {err}"),
                    None => still.push((ticket, prefix)),
                }
            }
            seen.tickets = still;
        }
        core.drain(false);
        if all
            .iter()
            .all(|s| s.held.is_empty() && s.tickets.is_empty())
            && core.admission_stats().waiting == 0
        {
            break;
        }
    }
    let loads: Vec<_> = core
        .topology()
        .rows()
        .map(|(r, _)| (r, core.booked(r)))
        .collect();
    let left: Vec<(usize, usize)> = all
        .iter()
        .map(|s| (s.held.len(), s.tickets.len()))
        .collect();
    assert!(
        all.iter()
            .all(|s| s.held.is_empty() && s.tickets.is_empty()),
        "left (held, queued) per thread: {left:?}; {:?} {loads:?} {}",
        core.admission_stats(),
        core.in_flight()
    );

    // Nothing booked anywhere, nothing in flight, nothing waiting.
    assert_eq!(core.in_flight(), 0);
    assert_eq!(core.held_blocks(), (0, 0));
    let topology = core.topology();
    for (row, _) in topology.rows() {
        assert_eq!(core.booked(row), RowLoad::default(), "row {row:?}");
    }
    assert!(topology.cluster().worker(3).is_none());
    assert!(topology.cluster().worker(100).is_some());
    let stats = core.admission_stats();
    assert_eq!(stats.waiting, 0);
    let cancelled: u64 = all.iter().map(|s| s.cancelled).sum();
    assert_eq!(stats.cancelled, cancelled);
    assert!(
        stats.queued > 0,
        "the workload never queued: the test lost its point"
    );

    // The policy heard of every dispatched request once, and of its end once (the removed
    // worker's requests ended as failed).
    let hooks = &setup.selector.hooks;
    let dispatched = all.iter().map(|s| s.dispatched).sum::<u64>() + ballast.len() as u64;
    assert_eq!(hooks.dispatched(), dispatched, "dispatch hooks");
    assert_eq!(hooks.completed(), dispatched, "completion hooks");
    let per_id = hooks.per_id();
    assert_eq!(per_id.len() as u64, dispatched);
    for (id, told) in &per_id {
        assert_eq!(*told, (1, 1), "request {id}: (dispatch, end) hooks");
    }
    assert!(
        removed.iter().all(|id| per_id.contains_key(id)),
        "a removed worker's request was never dispatched"
    );

    // Each session's binding was created exactly once and nothing holds it any more.
    let table = &setup.table;
    let mut created: HashMap<String, u32> = HashMap::new();
    for s in all.iter().flat_map(|s| &s.created) {
        *created.entry(s.clone()).or_default() += 1;
    }
    assert_eq!(table.stats().created as usize, table.len());
    for (session, n) in &created {
        assert_eq!(*n, 1, "binding for {session} created {n} times");
        assert!(
            table.binding(session).is_some(),
            "binding for {session} lost"
        );
        assert_eq!(
            table.in_flight(session),
            0,
            "session {session} still in flight"
        );
    }
    // The removed worker's cache entries went with it; the others' stayed.
    let kv = core.kv_index();
    let freed = freed.lock().unwrap().clone();
    assert_eq!(freed.len(), 2);
    for slot in freed {
        for prefix in 0..=SESSIONS {
            for b in 0..BLOCKS {
                assert!(
                    !kv.holds(slot, prefix * 1000 + b),
                    "slot {slot} still holds a block"
                );
            }
        }
    }
    assert!(kv.holdings() > 0);
}
