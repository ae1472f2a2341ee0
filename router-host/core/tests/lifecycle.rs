//! The routing core's request lifecycle beyond one decision: caller ids, booking and its release
//! (prefill, completion, failure, each exactly once), tickets (wait, cancel, expiry, as a
//! future), observed load, draining and removing workers, overlap from the core's own KV index,
//! and session bindings through the core's `SessionTable` on a `ManualClock`.
//!
//! The tests' own `Cheapest` selector decides (tests/common): its cost is load and overlap only,
//! so each expected row follows from the numbers.

mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use plugin_api::abi::CompletionCode;
use plugin_api::AffinityTarget;
use router_core::kv_index::{KvEventKind, Tier};
use router_core::ledger::DecodeBooking;
use router_core::model::{NoOverlap, Request, RowLoad, Worker};
use router_core::routing::{CoreSettings, RouteError, SessionOutcome, Submitted, DRAWN_ID_BIT};
use router_core::sessions::{
    BindingGranularity, BindingMode, DispatchOutcome, ManualClock, SessionStore, SessionTable,
};

use common::{core_of, default_class, row, sized, Cheapest};

fn req(isl: u64) -> Request {
    Request {
        isl_tokens: isl,
        ..Default::default()
    }
}

fn plain(workers: Vec<Worker>) -> (Arc<Cheapest>, router_core::routing::RoutingCore) {
    let selector = Arc::new(Cheapest::default());
    let core = core_of(selector.clone(), workers, CoreSettings::default());
    (selector, core)
}

#[test]
fn caller_ids_are_the_booking_ids_and_duplicates_book_nothing() {
    let (_, core) = plain(vec![Worker::new(1)]);
    let first = Request {
        id: Some(0xfeed),
        ..req(64)
    };
    assert_eq!(core.route(&first, &NoOverlap, false).unwrap().id, 0xfeed);
    let err = core.route(&first, &NoOverlap, false).unwrap_err();
    assert_eq!(err, RouteError::DuplicateRequestId(0xfeed));
    assert_eq!(err.to_string(), "request id 65261 is already in flight");
    assert_eq!(core.booked(row(1, 0)).active_requests, 1);
    assert!(core.complete(0xfeed));
    assert!(!core.complete(0xfeed));
    assert_eq!(core.booked(row(1, 0)), RowLoad::default());
}

#[test]
fn caller_ids_in_the_drawn_range_are_refused_and_book_nothing() {
    let (_, core) = plain(vec![Worker::new(1)]);
    let drawn = core.route(&req(1), &NoOverlap, false).unwrap().id;
    assert_ne!(
        drawn & DRAWN_ID_BIT,
        0,
        "drawn ids carry the bit: {drawn:#x}"
    );
    for id in [DRAWN_ID_BIT, drawn, u64::MAX] {
        let reserved = Request {
            id: Some(id),
            ..req(1)
        };
        let err = core.route(&reserved, &NoOverlap, false).unwrap_err();
        assert_eq!(err, RouteError::ReservedRequestId(id));
        assert!(err.to_string().contains("2^63 or more"), "{err}");
    }
    assert_eq!(core.in_flight(), 1);
    assert_eq!(core.booked(row(1, 0)).active_requests, 1);
    assert!(core.complete(drawn));
    assert_eq!(core.booked(row(1, 0)), RowLoad::default());
}

#[test]
fn drawn_ids_step_around_ids_callers_already_use() {
    let (_, core) = plain(vec![Worker::new(1)]);
    // Callers take ids 0..16 (what drawn ids looked like before they carried DRAWN_ID_BIT).
    for id in 0..16 {
        let taken = Request {
            id: Some(id),
            ..req(1)
        };
        core.route(&taken, &NoOverlap, false).unwrap();
    }
    let drawn = core.route(&req(1), &NoOverlap, false).unwrap().id;
    assert!(drawn >= 16, "drew {drawn}, already in flight");
    assert_eq!(core.in_flight(), 17);
    for id in (0..16).chain([drawn]) {
        assert!(core.complete(id), "request {id}");
    }
    assert_eq!(core.booked(row(1, 0)), RowLoad::default());
}

/// What a booking adds, and that each way of ending it gives back exactly that, once: a second
/// prefill completion, completion or failure of the same request releases nothing more (and so
/// never takes from another request's booking on the row), and the policy hears of each
/// dispatch and each end exactly once.
#[test]
fn prefill_completion_completion_and_failure_each_release_exactly_once() {
    let (selector, core) = plain(vec![Worker::new(1)]);
    let hooks = &selector.hooks;
    let a = core.route(&req(100), &NoOverlap, false).unwrap().id;
    let b = core.route(&req(50), &NoOverlap, false).unwrap().id;
    // 100 tokens are 7 blocks of 16, 50 are 4.
    let booked = |active, prefill, decode| RowLoad {
        available: true,
        active_requests: active,
        active_prefill_tokens: prefill,
        decode_blocks: decode,
    };
    assert_eq!(core.booked(row(1, 0)), booked(2, 150, 11));
    assert_eq!(hooks.dispatched(), 2);

    core.prefill_complete(a);
    assert_eq!(core.booked(row(1, 0)), booked(2, 50, 11));
    core.prefill_complete(a);
    core.prefill_complete(0xdead);
    assert_eq!(
        core.booked(row(1, 0)),
        booked(2, 50, 11),
        "a second prefill completion released b's prompt"
    );
    // Completing after the prefill gives back the rest, not the prompt again.
    assert!(core.complete(a));
    assert_eq!(core.booked(row(1, 0)), booked(1, 50, 4));
    assert!(!core.complete(a));
    assert!(!core.finish(a, CompletionCode::FAILED));
    core.prefill_complete(a);
    assert_eq!(core.booked(row(1, 0)), booked(1, 50, 4));
    assert_eq!((hooks.completed(), hooks.failed()), (1, 0));

    assert!(core.finish(b, CompletionCode::FAILED));
    assert_eq!(core.booked(row(1, 0)), RowLoad::default());
    assert!(!core.finish(b, CompletionCode::FAILED));
    assert!(!core.complete(b));
    assert_eq!((hooks.completed(), hooks.failed()), (2, 1));

    // Released at once, the policy told later: the hook is owed, and owed only once.
    let c = core.route(&req(16), &NoOverlap, false).unwrap().id;
    let owed = core
        .finish_owing_hook(c, CompletionCode::COMPLETED)
        .expect("c is in flight");
    assert_eq!(core.booked(row(1, 0)), RowLoad::default());
    assert_eq!(core.in_flight(), 0);
    assert!(core
        .finish_owing_hook(c, CompletionCode::COMPLETED)
        .is_none());
    assert!(!core.complete(c));
    assert_eq!(hooks.completed(), 2, "told before the hook was called");
    core.call_hook(owed);
    assert_eq!((hooks.dispatched(), hooks.completed()), (3, 3));
}

#[test]
fn queued_tickets_wait_expire_cancel_and_resolve_as_futures() {
    let clock = Arc::new(ManualClock::default());
    let core = core_of(
        Arc::new(Cheapest::default()),
        vec![sized(1)],
        CoreSettings {
            classes: vec![default_class(100, Some(Duration::from_millis(500)))],
            clock: Some(clock.clone()),
            ..CoreSettings::default()
        },
    );
    let busy = match core.submit(req(500), &NoOverlap, false).unwrap() {
        Submitted::Dispatched(r) => r.id,
        other => panic!("{other:?}"),
    };
    let queued = |isl| match core.submit(req(isl), &NoOverlap, false).unwrap() {
        Submitted::Queued(t) => t,
        other => panic!("expected to queue, got {other:?}"),
    };
    // A bounded wait that runs out takes the request out of its queue.
    let a = queued(10);
    let err = core.wait(&a, Duration::from_millis(20)).unwrap_err();
    assert!(
        matches!(err, RouteError::QueueTimeout { ref class, max_wait_ms: 20, .. } if class == "default"),
        "{err}"
    );
    // Cancelled: booked nothing, counted, ticket resolves to the error.
    let b = queued(10);
    assert!(core.cancel(b.id()));
    assert!(!core.cancel(b.id()), "cancelled twice");
    assert_eq!(b.try_take(), Some(Err(RouteError::Cancelled)));
    // Past the class's max_wait on the core's clock: expired at the next drain.
    let c = queued(10);
    clock.advance(Duration::from_millis(501));
    let drained = core.drain(false);
    assert_eq!(drained.len(), 1);
    assert_eq!(drained[0].ticket, c.id());
    let err = c.try_take().unwrap().unwrap_err();
    assert_eq!(
        err.to_string(),
        "waited 501 ms in the queue of policy class `default`, over its max_wait of 500 ms; nothing was booked"
    );
    // A future resolves once capacity frees and a drain dispatches it.
    let mut d = queued(10);
    let woke = Arc::new(Flag::default());
    let waker = Waker::from(woke.clone());
    let mut cx = Context::from_waker(&waker);
    assert!(Pin::new(&mut d).poll(&mut cx).is_pending());
    assert!(core.complete(busy));
    let drained = core.drain(false);
    assert_eq!(drained.len(), 1);
    assert!(woke.0.load(Ordering::SeqCst), "waker not woken");
    let routed = match Pin::new(&mut d).poll(&mut cx) {
        Poll::Ready(Some(Ok(routed))) => routed,
        other => panic!("{other:?}"),
    };
    assert!(core.complete(routed.id));
    let stats = core.admission_stats();
    assert_eq!(
        (stats.queued, stats.waiting, stats.cancelled, stats.expired),
        (4, 0, 1, 2)
    );
    assert_eq!(core.in_flight(), 0);
    assert_eq!(core.booked(row(1, 0)), RowLoad::default());
}

#[derive(Default)]
struct Flag(AtomicBool);

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[test]
fn observed_load_corrects_booked_load_without_double_counting() {
    let (_, core) = plain(vec![Worker::new(1), Worker::new(2)]);
    // Traffic that bypassed the router: 3 requests seen on worker 1.
    assert!(core.observe_load(row(1, 0), Some(3)));
    assert!(!core.observe_load(row(9, 0), Some(3)), "unknown row");
    let routed = core.route(&req(16), &NoOverlap, false).unwrap();
    assert_eq!(
        routed.decision.row,
        row(2, 0),
        "the observed load steers away from worker 1"
    );
    assert_eq!(core.load(row(1, 0)).active_requests, 3);
    // Our own booking is already in what the engine reports: max, not sum.
    assert!(core.observe_load(row(2, 0), Some(1)));
    assert_eq!(core.load(row(2, 0)).active_requests, 1);
    core.observe_load(row(1, 0), None);
    assert_eq!(core.load(row(1, 0)).active_requests, 0);
    assert!(core.complete(routed.id));
}

#[test]
fn draining_and_removed_workers_take_nothing_new_and_removal_releases_their_bookings() {
    let (selector, core) = plain(vec![Worker::new(1), Worker::new(2)]);
    let on_1 = Request {
        pinned_worker: Some(row(1, 0)),
        ..req(64)
    };
    let held = core.route(&on_1, &NoOverlap, false).unwrap().id;
    core.set_worker_state(1, None, None, Some(true)).unwrap();
    let err = core.route(&on_1, &NoOverlap, false).unwrap_err();
    assert!(
        err.to_string()
            .contains("pinned worker 1:0 is unknown, has no such rank, or is unavailable"),
        "{err}"
    );
    for _ in 0..3 {
        let r = core.route(&req(1), &NoOverlap, false).unwrap();
        assert_eq!(r.decision.row, row(2, 0));
        core.complete(r.id);
    }
    // The draining worker's request is still in flight; removal takes it with the worker.
    core.apply_kv_events(
        row(1, 0),
        [
            (KvEventKind::Stored, Tier::Device, 7),
            (KvEventKind::Stored, Tier::Device, 8),
        ],
    );
    let failed_before = selector.hooks.failed();
    let removed = core.remove_worker(1).unwrap();
    assert_eq!(removed.in_flight, vec![held]);
    assert_eq!(removed.cached_blocks, 2);
    assert_eq!(
        selector.hooks.failed(),
        failed_before + 1,
        "the policy hears the removed request failed"
    );
    assert!(!core.complete(held));
    assert_eq!(core.in_flight(), 0);
    assert!(core.remove_worker(1).is_err());
    // A new worker reuses the freed slot, idle and cold.
    core.add_worker(Worker::new(3)).unwrap();
    assert_eq!(core.topology().slot(row(3, 0)), Some(0));
    assert_eq!(core.booked(row(3, 0)), RowLoad::default());
    assert!(!core.kv_index().holds(0, 7));
    assert_eq!(
        core.add_worker(Worker::new(3)).unwrap_err().to_string(),
        "worker 3 is already registered"
    );
    assert_eq!(selector.hooks.dispatched(), selector.hooks.completed());
}

#[test]
fn overlap_comes_from_the_requests_blocks_in_the_cores_index() {
    let (_, core) = plain(vec![Worker::new(1), Worker::new(2), Worker::new(3)]);
    let blocks: Vec<u64> = (100..108).collect();
    core.apply_kv_events(
        row(3, 0),
        blocks
            .iter()
            .map(|&b| (KvEventKind::Stored, Tier::Device, b)),
    );
    core.apply_kv_events(
        row(2, 0),
        blocks[..2]
            .iter()
            .map(|&b| (KvEventKind::Stored, Tier::Device, b)),
    );
    let request = Request {
        blocks: blocks.clone(),
        isl_tokens: 8 * 16,
        ..Default::default()
    };
    let routed = core.route_indexed(&request, false).unwrap();
    assert_eq!(
        routed.decision.row,
        row(3, 0),
        "worker 3 holds the whole prompt"
    );
    core.complete(routed.id);
    // Evicted: the next best is worker 2's two blocks.
    core.apply_kv_events(
        row(3, 0),
        blocks
            .iter()
            .map(|&b| (KvEventKind::Evicted, Tier::Device, b)),
    );
    let routed = core.route_indexed(&request, false).unwrap();
    assert_eq!(routed.decision.row, row(2, 0));
    core.complete(routed.id);
    // Without blocks every row is cold: lowest id on a tie.
    let routed = core.route_indexed(&req(128), false).unwrap();
    assert_eq!(routed.decision.row, row(1, 0));
}

#[test]
fn held_blocks_of_a_row_are_its_requests_distinct_prompt_blocks() {
    let selector = Arc::new(Cheapest::default());
    let core = core_of(
        selector,
        vec![Worker::new(1)],
        CoreSettings {
            decode_booking: DecodeBooking::Deduplicated,
            ..CoreSettings::default()
        },
    );
    let r = row(1, 0);
    let prompt = |tail: std::ops::Range<u64>| Request {
        blocks: (100..104).chain(tail).collect(),
        isl_tokens: 8 * 16,
        ..Default::default()
    };
    let held = |core: &router_core::routing::RoutingCore| {
        let mut ids = vec![7];
        core.held_blocks_of(r, &mut ids);
        ids.sort_unstable();
        ids
    };
    assert!(held(&core).is_empty(), "nothing in flight");
    let a = core.route_indexed(&prompt(200..204), false).unwrap();
    let b = core.route_indexed(&prompt(300..304), false).unwrap();
    // A shared system prompt counts once: 4 + 4 + 4, as the booked decode blocks.
    let both: Vec<u64> = (100..104).chain(200..204).chain(300..304).collect();
    assert_eq!(held(&core), both);
    assert_eq!(core.booked(r).decode_blocks, 12);
    core.complete(a.id);
    assert_eq!(held(&core), (100..104).chain(300..304).collect::<Vec<_>>());
    core.complete(b.id);
    assert!(held(&core).is_empty());
    let mut ids = vec![7];
    core.held_blocks_of(row(9, 0), &mut ids);
    assert!(ids.is_empty(), "an unknown row holds nothing");
}

/// A core with session bindings in `mode` (TTL 60 s) on `clock`, with the granularity
/// router-host gives that mode.
fn with_sessions(
    mode: BindingMode,
    workers: Vec<Worker>,
    clock: Arc<ManualClock>,
) -> (Arc<SessionTable>, router_core::routing::RoutingCore) {
    let granularity = match mode {
        BindingMode::Soft => BindingGranularity::Worker,
        BindingMode::Hard => BindingGranularity::Rank,
    };
    let table = Arc::new(
        SessionTable::new(mode, Duration::from_secs(60), 16, clock.clone())
            .with_granularity(granularity),
    );
    let core = core_of(
        Arc::new(Cheapest::following_targets()),
        workers,
        CoreSettings {
            sessions: Some(table.clone() as Arc<dyn SessionStore>),
            clock: Some(clock),
            ..CoreSettings::default()
        },
    );
    (table, core)
}

fn in_session(session: &str, isl: u64) -> Request {
    Request {
        session_id: Some(session.to_owned()),
        ..req(isl)
    }
}

#[test]
fn a_soft_binding_is_created_kept_moved_released_and_expires_on_the_cores_clock() {
    let clock = Arc::new(ManualClock::default());
    let (table, core) = with_sessions(
        BindingMode::Soft,
        vec![Worker::new(1), Worker::new(2)],
        clock.clone(),
    );
    let worker = |id| AffinityTarget {
        worker_id: id,
        dp_rank: None,
    };
    // Both idle: the lowest row, and the binding remembers its worker.
    let first = core.route(&in_session("s", 64), &NoOverlap, false).unwrap();
    assert_eq!(first.decision.row, row(1, 0));
    assert_eq!(
        first.session,
        Some(SessionOutcome::Dispatched(DispatchOutcome::Created))
    );
    assert_eq!(table.binding("s").map(|b| b.target), Some(worker(1)));
    // Worker 1 is now the busier one: the binding still takes the session there, while a
    // request without a session goes to the idle worker.
    let second = core.route(&in_session("s", 64), &NoOverlap, false).unwrap();
    assert_eq!(second.decision.row, row(1, 0));
    assert_eq!(
        second.session,
        Some(SessionOutcome::Dispatched(DispatchOutcome::Kept))
    );
    let anonymous = core.route(&req(64), &NoOverlap, false).unwrap();
    assert_eq!(anonymous.decision.row, row(2, 0));
    assert_eq!(anonymous.session, None);
    assert_eq!(table.in_flight("s"), 2);
    // The bound worker drains: the session is decided afresh and its binding follows it.
    core.set_worker_state(1, None, None, Some(true)).unwrap();
    let third = core.route(&in_session("s", 64), &NoOverlap, false).unwrap();
    assert_eq!(third.decision.row, row(2, 0));
    assert_eq!(
        third.session,
        Some(SessionOutcome::Dispatched(DispatchOutcome::Moved {
            from: worker(1),
            to: worker(2)
        }))
    );
    assert_eq!(table.in_flight("s"), 3);
    // Each completion ends its lease once; a second completion ends nothing.
    for id in [first.id, second.id, third.id, anonymous.id] {
        assert!(core.complete(id));
        assert!(!core.complete(id));
    }
    assert_eq!(table.in_flight("s"), 0);
    assert_eq!(table.binding("s").map(|b| b.target), Some(worker(2)));
    // Idle for the TTL: still bound. Past it: the next request finds no binding and makes one.
    core.set_worker_state(1, None, None, Some(false)).unwrap();
    clock.advance(Duration::from_secs(60));
    assert!(table.binding("s").is_some(), "expired at exactly the TTL");
    clock.advance(Duration::from_millis(1));
    assert_eq!(table.binding("s"), None);
    let fresh = core.route(&in_session("s", 64), &NoOverlap, false).unwrap();
    assert_eq!(fresh.decision.row, row(1, 0), "both idle again: lowest row");
    assert_eq!(
        fresh.session,
        Some(SessionOutcome::Dispatched(DispatchOutcome::Created))
    );
    assert!(core.complete(fresh.id));
    let stats = table.stats();
    assert_eq!(
        (stats.created, stats.kept, stats.moved, stats.expired),
        (2, 1, 1, 1)
    );
    assert_eq!(table.in_flight("s"), 0);
    assert_eq!(core.in_flight(), 0);
}

#[test]
fn a_hard_binding_pins_its_rank_and_is_rebound_once_its_row_is_gone() {
    let clock = Arc::new(ManualClock::default());
    let (table, core) = with_sessions(
        BindingMode::Hard,
        vec![Worker::new(1).with_ranks(0, 2), Worker::new(2)],
        clock,
    );
    let first = core.route(&in_session("h", 64), &NoOverlap, false).unwrap();
    assert_eq!(first.decision.row, row(1, 0));
    assert_eq!(
        table.binding("h").map(|b| b.target),
        Some(AffinityTarget {
            worker_id: 1,
            dp_rank: Some(0)
        })
    );
    // A pin: the policy is handed the bound row alone, however busy it is.
    let second = core.route(&in_session("h", 64), &NoOverlap, false).unwrap();
    assert_eq!(second.decision.row, row(1, 0));
    assert_eq!(second.decision.candidates, 1);
    assert_eq!(
        second.session,
        Some(SessionOutcome::Dispatched(DispatchOutcome::Kept))
    );
    // The bound worker drains: the binding is invalidated and selection runs once without it.
    core.set_worker_state(1, None, None, Some(true)).unwrap();
    let third = core.route(&in_session("h", 64), &NoOverlap, false).unwrap();
    assert_eq!(third.decision.row, row(2, 0));
    assert_eq!(third.session, Some(SessionOutcome::HardBindingGone));
    assert_eq!(
        table.binding("h").map(|b| b.target),
        Some(AffinityTarget {
            worker_id: 2,
            dp_rank: Some(0)
        })
    );
    assert_eq!(table.in_flight("h"), 3);
    for id in [first.id, second.id, third.id] {
        assert!(core.complete(id));
    }
    assert_eq!(table.in_flight("h"), 0);
    let stats = table.stats();
    assert_eq!((stats.created, stats.kept, stats.invalidated), (2, 1, 1));
    assert_eq!(core.in_flight(), 0);
}
