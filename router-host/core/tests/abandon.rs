//! A caller that gives up on a queued request while its re-evaluation is stuck in a slow policy
//! call (`RoutingCore::wait` past its timeout and the core's `drain_stall`): the wait returns
//! `EvaluationStalled`, and when the call comes back after all, the core releases the booking
//! that nobody is left to finish. The selector here is the test's own: it holds its call for the
//! request marked by its prompt length until the test lets it go.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use plugin_api::abi::{CompleteEvent, DispatchEvent};
use router_core::admission::{AdmissionMode, ClassSpec};
use router_core::model::{Cluster, NoOverlap, Request, RowId, RowLoad, Signals, Worker};
use router_core::routing::{CoreSettings, RouteError, RoutingCore, Submitted};
use router_core::select::{Decision, InstanceId, Scratch, SelectError, Selection, Selector};

/// Prompt length of the request whose decision is held.
const HELD_ISL: u64 = 11;
const LIMIT: Duration = Duration::from_secs(60);

#[derive(Default)]
struct Held {
    entered: AtomicBool,
    released: AtomicBool,
}

impl Selector for Held {
    fn select(
        &self,
        cluster: &Cluster,
        selection: Selection<'_>,
        _signals: &dyn Signals,
        _scratch: &mut Scratch,
    ) -> Result<Decision, SelectError> {
        if selection.request.isl_tokens == HELD_ISL {
            self.entered.store(true, Ordering::SeqCst);
            let deadline = Instant::now() + LIMIT;
            while !self.released.load(Ordering::SeqCst) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        Ok(Decision {
            row: RowId {
                worker_id: cluster.workers()[0].worker_id,
                dp_rank: 0,
            },
            instance: 0,
            decided_by: 0,
            fallback: None,
            explanation: None,
            candidates: 1,
            pick_ns: 0,
        })
    }

    fn request_blocks(&self, isl_tokens: u64) -> u64 {
        isl_tokens.div_ceil(4)
    }

    fn notify_dispatch(&self, _: InstanceId, _: &DispatchEvent<'_>) {}

    fn notify_complete(&self, _: InstanceId, _: &CompleteEvent<'_>) {}

    fn instance_name(&self, _: InstanceId) -> &str {
        "held"
    }
}

fn wait_for(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + LIMIT;
    while !done() {
        assert!(Instant::now() < deadline, "gave up waiting: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_wait_given_up_during_a_stuck_evaluation_returns_and_a_late_booking_is_released() {
    let selector = Arc::new(Held::default());
    let mut worker = Worker::new(1);
    worker.max_num_batched_tokens = Some(1000);
    let settings = CoreSettings {
        classes: vec![ClassSpec {
            name: "default".to_owned(),
            prefill_busy_threshold: Some(100),
            prefill_busy_threshold_frac: None,
            mode: AdmissionMode::AnyEligible,
            max_wait: None,
            ..ClassSpec::default()
        }],
        drain_stall: Some(Duration::from_millis(50)),
        ..CoreSettings::default()
    };
    let core = Arc::new(RoutingCore::new(
        selector.clone(),
        Cluster::new(vec![worker]).unwrap(),
        settings,
    ));
    let sized = |isl| Request {
        isl_tokens: isl,
        ..Default::default()
    };
    let busy = match core.submit(sized(500), &NoOverlap, false).unwrap() {
        Submitted::Dispatched(routed) => routed,
        other => panic!("expected a dispatch, got {other:?}"),
    };
    let ticket = match core.submit(sized(HELD_ISL), &NoOverlap, false).unwrap() {
        Submitted::Queued(ticket) => ticket,
        other => panic!("expected to queue, got {other:?}"),
    };
    assert!(core.complete(busy.id));
    let drain = std::thread::spawn({
        let core = core.clone();
        move || core.drain(false)
    });
    wait_for("the drain is deciding the queued request", || {
        selector.entered.load(Ordering::SeqCst)
    });
    // The wait runs out while the request is out of its queue, then waits the stall limit
    // for the evaluation, then gives up.
    let err = core.wait(&ticket, Duration::from_millis(10)).unwrap_err();
    assert_eq!(err, RouteError::EvaluationStalled { stall_ms: 50 });
    assert!(err.to_string().contains("a policy call hung"), "{err}");
    assert_eq!(ticket.try_take(), None);
    // The call comes back: the request is dispatched, and released by the core at once.
    selector.released.store(true, Ordering::SeqCst);
    let drained = drain.join().expect("the drain returns");
    assert_eq!(drained.len(), 1);
    assert!(drained[0].result.is_ok(), "{drained:?}");
    assert_eq!(core.in_flight(), 0, "the abandoned booking was released");
    let row = RowId {
        worker_id: 1,
        dp_rank: 0,
    };
    assert_eq!(core.booked(row), RowLoad::default());
}
