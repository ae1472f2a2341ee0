//! The shipped two-tier `.so` policy deciding for several routing threads at once, through a
//! `Host` built from YAML (soft session affinity, both `booking.decode` modes).
//!
//! The core's own concurrency contract (queues, cancellation, membership changes, exactly-once
//! release) is tested in router-core (`tests/concurrency.rs`) with a selector of its own; this
//! checks what only the host has: a loaded plugin's picks and hooks from many threads, and the
//! configuration that sets the booking mode. Bounded: every thread runs a fixed number of
//! operations, and the assertions hold for any interleaving.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Barrier};

use router_host::config::RouterConfig;
use router_host::host::{Host, SessionOutcome};
use router_host::kv_index::{KvEventKind, Tier};
use router_host::loader::SearchPath;
use router_host::model::{Cluster, Request, RowLoad, Worker};
use router_host::policy_set::PolicySet;
use router_host::rng::SplitMix64;
use router_host::sessions::DispatchOutcome;

use plugin_api::abi::CompletionCode;

const THREADS: u64 = 4;
const OPS: u64 = 1_000;
const SESSIONS: u64 = 64;

/// The host under test; `booking` is its `booking` mapping. The pick budget is 10 s so that a
/// busy machine's slow picks never quarantine the plugin: every decision must be the plugin's.
fn host(booking: &str) -> Host {
    let yaml = format!(
        "booking: {booking}\n\
         plugins: [{{path: {}}}]\n\
         worker_selection:\n  aggregated: t\n  instances:\n    - {{name: t, type: dynamo-two-tier-cost-fn, pick_budget_us: 10000000, parameters: {{respect_soft_affinity: true}}}}\n\
         session_affinity: {{mode: soft, ttl_secs: 3600}}\n",
        common::plugin("two_tier_cost_fn").display()
    );
    let config = RouterConfig::from_yaml_str(&yaml, None).expect("valid config");
    let router = PolicySet::from_config(&config, &SearchPath::default()).expect("router starts");
    let workers = (0..8).map(|w| Worker::new(w).with_ranks(0, 2)).collect();
    Host::new(router, Cluster::new(workers).unwrap(), &config)
}

#[test]
fn the_two_tier_plugin_routes_for_many_threads_and_everything_is_released() {
    stress("{}");
}

/// With each prompt block booked once per row, the per-row block counts empty as the ledger
/// does.
#[test]
fn deduplicated_decode_booking_from_yaml_loses_nothing_under_threads() {
    stress("{decode: deduplicated}");
}

fn stress(booking: &str) {
    let host = Arc::new(host(booking));
    let start = Arc::new(Barrier::new(THREADS as usize));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let host = Arc::clone(&host);
            let start = Arc::clone(&start);
            std::thread::spawn(move || {
                let core = host.core();
                let mut rng = SplitMix64::new(0x5eed + t);
                let mut held = Vec::new();
                let mut created = Vec::new();
                start.wait();
                for i in 0..OPS {
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
                    let routed = core
                        .route_indexed(&request, false)
                        .unwrap_or_else(|err| panic!("thread {t} request {i}: {err}"));
                    assert_eq!(routed.decision.fallback, None, "the plugin did not decide");
                    core.apply_kv_events(
                        routed.decision.row,
                        request
                            .blocks
                            .iter()
                            .map(|&b| (KvEventKind::Stored, Tier::Device, b)),
                    );
                    if let (Some(SessionOutcome::Dispatched(DispatchOutcome::Created)), Some(s)) =
                        (&routed.session, session)
                    {
                        created.push(s);
                    }
                    held.push(routed.id);
                    // End some held requests: completed, failed, or prefill first.
                    if held.len() > 16 {
                        let at = (rng.next_u64() as usize) % held.len();
                        let id = held.swap_remove(at);
                        let released = match rng.next_u64() % 3 {
                            0 => core.finish(id, CompletionCode::FAILED),
                            1 => {
                                core.prefill_complete(id);
                                core.complete(id)
                            }
                            _ => core.complete(id),
                        };
                        assert!(released, "request {id}");
                    }
                }
                for id in held {
                    assert!(core.complete(id), "request {id}");
                    assert!(!core.complete(id), "request {id} released twice");
                }
                created
            })
        })
        .collect();
    let created: Vec<Vec<String>> = threads
        .into_iter()
        .map(|h| h.join().expect("no thread panicked"))
        .collect();
    let core = host.core();

    // Nothing booked anywhere, nothing in flight.
    assert_eq!(core.in_flight(), 0);
    assert_eq!(core.held_blocks(), (0, 0));
    for (row, _) in core.topology().rows() {
        assert_eq!(core.booked(row), RowLoad::default(), "row {row:?}");
    }
    assert!(core.kv_index().holdings() > 0);

    // Each session's binding was created exactly once and nothing holds it any more.
    let table = host.sessions().expect("affinity is on");
    let mut counts: HashMap<String, u32> = HashMap::new();
    for s in created.into_iter().flatten() {
        *counts.entry(s).or_default() += 1;
    }
    assert_eq!(table.stats().created as usize, table.len());
    assert!(!counts.is_empty(), "no session was ever bound");
    for (session, n) in &counts {
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
}
