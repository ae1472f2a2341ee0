//! The routing core's request lifecycle beyond one decision: caller ids, tickets (wait, cancel,
//! expiry, as a future), observed load, draining and removing workers, overlap from the core's
//! own KV index. The built-in `default` policy decides (no plugin needed): its cost is load and
//! overlap only, so each expected row follows from the numbers.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use router_host::config::RouterConfig;
use router_host::host::{Host, NoOverlap, RouteError, Submitted, DRAWN_ID_BIT};
use router_host::kv_index::{KvEventKind, Tier};
use router_host::loader::SearchPath;
use router_host::model::{Cluster, Request, RowId, RowLoad, Worker};
use router_host::router::Router;
use router_host::sessions::ManualClock;

fn row(worker_id: u64, dp_rank: u32) -> RowId {
    RowId { worker_id, dp_rank }
}

fn host(yaml: &str, workers: Vec<Worker>, clock: Arc<ManualClock>) -> Host {
    let config = RouterConfig::from_yaml_str(yaml, None).expect("valid config");
    let router = Router::from_config(&config, &SearchPath::default()).expect("router starts");
    Host::with_clock(router, Cluster::new(workers).unwrap(), &config, clock)
}

fn sized(id: u64) -> Worker {
    let mut w = Worker::new(id);
    w.max_num_batched_tokens = Some(1000);
    w
}

const ONE_SLOT: &str =
    "policy_classes:\n  - {name: default, prefill_busy_threshold: 100, max_queue_wait_ms: 500}\n";

fn req(isl: u64) -> Request {
    Request {
        isl_tokens: isl,
        ..Default::default()
    }
}

#[test]
fn caller_ids_are_the_booking_ids_and_duplicates_book_nothing() {
    let host = host("{}", vec![Worker::new(1)], Arc::new(ManualClock::default()));
    let core = host.core();
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
    let host = host("{}", vec![Worker::new(1)], Arc::new(ManualClock::default()));
    let core = host.core();
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
    let host = host("{}", vec![Worker::new(1)], Arc::new(ManualClock::default()));
    let core = host.core();
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

#[test]
fn queued_tickets_wait_expire_cancel_and_resolve_as_futures() {
    let clock = Arc::new(ManualClock::default());
    let host = host(ONE_SLOT, vec![sized(1)], clock.clone());
    let core = host.core();
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
    // Past the class's max_queue_wait_ms on the core's clock: expired at the next drain.
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
    assert!(
        woke.0.load(std::sync::atomic::Ordering::SeqCst),
        "waker not woken"
    );
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
struct Flag(std::sync::atomic::AtomicBool);

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

#[test]
fn observed_load_corrects_booked_load_without_double_counting() {
    // Active requests count in the default selector's cost only with a weight.
    let host = host(
        "default_selector: {decode_active_request_weight: 1.0}\n",
        vec![Worker::new(1), Worker::new(2)],
        Arc::new(ManualClock::default()),
    );
    let core = host.core();
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
    let host = host(
        "{}",
        vec![Worker::new(1), Worker::new(2)],
        Arc::new(ManualClock::default()),
    );
    let core = host.core();
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
    let removed = core.remove_worker(1).unwrap();
    assert_eq!(removed.in_flight, vec![held]);
    assert_eq!(removed.cached_blocks, 2);
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
}

#[test]
fn overlap_comes_from_the_requests_blocks_in_the_cores_index() {
    let host = host(
        "{}",
        vec![Worker::new(1), Worker::new(2), Worker::new(3)],
        Arc::new(ManualClock::default()),
    );
    let core = host.core();
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
