//! The routing core under several threads at once, through the real two-tier `.so` policy.
//!
//! Bounded: every thread runs a fixed number of operations, every wait has a deadline. The
//! assertions hold for any interleaving, so the test cannot pass or fail by timing: every
//! booking released exactly once, the ledger back to zero on every row, every session binding
//! created exactly once and none in flight, every queued request accounted for.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex};

use router_host::config::RouterConfig;
use router_host::host::{Host, RouteError, SessionOutcome, Submitted, Ticket};
use router_host::kv_index::{KvEventKind, Tier};
use router_host::loader::SearchPath;
use router_host::model::{Cluster, Request, RowLoad, Worker};
use router_host::rng::SplitMix64;
use router_host::router::Router;
use router_host::sessions::DispatchOutcome;

use plugin_api::abi::CompletionCode;

const THREADS: u64 = 4;
const OPS: u64 = 1_500;
const SESSIONS: u64 = 64;

/// The host under test; `booking` is its `booking` mapping.
fn host(booking: &str) -> Host {
    let yaml = format!(
        "booking: {booking}\n\
         plugins: [{{path: {}}}]\n\
         worker_selection:\n  aggregated: t\n  instances:\n    - {{name: t, type: dynamo-two-tier-cost-fn, parameters: {{respect_soft_affinity: true}}}}\n\
         session_affinity: {{mode: soft, ttl_secs: 3600}}\n\
         policy_classes:\n  - {{name: default, prefill_busy_threshold: 1500}}\n",
        common::plugin("two_tier_cost_fn").display()
    );
    let config = RouterConfig::from_yaml_str(&yaml, None).expect("valid config");
    let router = Router::from_config(&config, &SearchPath::default()).expect("router starts");
    let workers = (0..8).map(|w| Worker::new(w).with_ranks(0, 2)).collect();
    Host::new(router, Cluster::new(workers).unwrap(), &config)
}

/// What one thread saw.
#[derive(Default)]
struct Seen {
    /// Dispatched requests this thread still has to end.
    held: Vec<u64>,
    /// Sessions whose binding this thread saw created.
    created: Vec<String>,
    tickets: Vec<Ticket>,
    cancelled: u64,
    dispatched: u64,
}

fn record(seen: &mut Seen, routed: &router_host::host::Routed, session: Option<&String>) {
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
    stress("{}");
}

/// The same with each prompt block booked once per row: the per-row block counts are kept
/// under the same locks as the bookings, so they must empty exactly as the ledger does.
#[test]
fn deduplicated_decode_booking_loses_nothing_under_threads_either() {
    stress("{decode: deduplicated}");
}

fn stress(booking: &str) {
    let host = Arc::new(host(booking));
    let start = Arc::new(Barrier::new(THREADS as usize));
    let removed_in_flight = Arc::new(Mutex::new(BTreeSet::new()));
    let draining = Arc::new(AtomicBool::new(false));
    let freed = Arc::new(Mutex::new(Vec::new()));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let draining = Arc::clone(&draining);
            let freed = Arc::clone(&freed);
            let host = Arc::clone(&host);
            let start = Arc::clone(&start);
            let removed_in_flight = Arc::clone(&removed_in_flight);
            std::thread::spawn(move || {
                let core = host.core();
                let mut rng = SplitMix64::new(0x5eed + t);
                let mut seen = Seen::default();
                start.wait();
                for i in 0..OPS {
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
                        blocks: (0..8).map(|b| prefix * 1000 + b).collect(),
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
                            core.apply_kv_events(
                                routed.decision.row,
                                request
                                    .blocks
                                    .iter()
                                    .map(|&b| (KvEventKind::Stored, Tier::Device, b)),
                            );
                            record(&mut seen, &routed, session.as_ref());
                        }
                        Ok(Submitted::Queued(ticket)) => {
                            if rng.next_u64().is_multiple_of(2) {
                                if core.cancel(ticket.id()) {
                                    seen.cancelled += 1;
                                    assert_eq!(ticket.try_take(), Some(Err(RouteError::Cancelled)));
                                } else {
                                    seen.tickets.push(ticket);
                                }
                            } else {
                                seen.tickets.push(ticket);
                            }
                        }
                        // The only errors possible here: the chosen worker left mid-decision.
                        Err(RouteError::WorkerRemoved { worker_id: 3 }) => {}
                        Err(err) => panic!("thread {t} request {i}: {err}"),
                    }
                    // End some held requests: completed, failed, or prefill first.
                    if seen.held.len() > 16 {
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
                    for ticket in std::mem::take(&mut seen.tickets) {
                        // Read before taking: a ticket done before the take must yield its
                        // outcome (one that finishes in between is simply taken next round).
                        let was_done = ticket.is_done();
                        match ticket.try_take() {
                            Some(Ok(routed)) => record(&mut seen, &routed, None),
                            Some(Err(RouteError::WorkerRemoved { .. })) => {}
                            Some(Err(err)) => panic!("queued request failed: {err}"),
                            None if was_done => panic!("outcome taken twice"),
                            None => still.push(ticket),
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
    let core = host.core();

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
            for ticket in std::mem::take(&mut seen.tickets) {
                match ticket.try_take() {
                    Some(Ok(routed)) => {
                        seen.dispatched += 1;
                        seen.held.push(routed.id);
                    }
                    Some(Err(RouteError::WorkerRemoved { .. })) => {}
                    Some(Err(err)) => panic!("queued request failed: {err}"),
                    None => still.push(ticket),
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

    // Each session's binding was created exactly once and nothing holds it any more.
    let table = host.sessions().expect("affinity is on");
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
            for b in 0..8 {
                assert!(
                    !kv.holds(slot, prefix * 1000 + b),
                    "slot {slot} still holds a block"
                );
            }
        }
    }
    assert!(kv.holdings() > 0);
}
