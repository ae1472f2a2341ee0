//! Overload control in the core: the queues' bound, shedding the lowest priority first (the
//! newest among equals), refusing a newcomer nobody ranks below, a leg of a request under way
//! queuing past the bound, never shed, overdue requests leaving a
//! full queue before anyone is shed, and engine saturation (waiting requests, KV usage) making
//! a row busy only for classes that limit it.

mod common;

use std::sync::Arc;
use std::time::Duration;

use router_core::admission::{ClassSpec, EngineSignals, Ticket};
use router_core::model::{NoOverlap, Request, RowLoad};
use router_core::routing::{CoreSettings, RouteError, RoutingCore, Submitted};
use router_core::sessions::ManualClock;

use common::{core_of, row, sized, Cheapest};

fn class(name: &str, priority: i64, max_wait: Option<Duration>) -> ClassSpec {
    ClassSpec {
        name: name.to_owned(),
        prefill_busy_threshold: Some(100),
        priority,
        max_wait,
        ..ClassSpec::default()
    }
}

fn req(class: &str, isl: u64) -> Request {
    Request {
        isl_tokens: isl,
        policy_class: Some(class.to_owned()),
        ..Default::default()
    }
}

/// One worker and the classes `low` (0), `mid` (1), `high` (2); the queues hold 3.
fn core(clock: Arc<ManualClock>, low_wait: Option<Duration>) -> RoutingCore {
    core_of(
        Arc::new(Cheapest::default()),
        vec![sized(1)],
        CoreSettings {
            classes: vec![
                class("low", 0, low_wait),
                class("mid", 1, None),
                class("high", 2, None),
            ],
            clock: Some(clock),
            max_queued: Some(3),
            ..CoreSettings::default()
        },
    )
}

fn queued(core: &RoutingCore, class: &str) -> Ticket {
    match core.submit(req(class, 10), &NoOverlap, false) {
        Ok(Submitted::Queued(ticket)) => ticket,
        other => panic!("expected {class} to queue, got {other:?}"),
    }
}

fn shed_by(ticket: &Ticket) -> (String, String) {
    match ticket.try_take() {
        Some(Err(RouteError::Shed {
            class, by_class, ..
        })) => (class, by_class),
        other => panic!("expected ticket {} shed, got {other:?}", ticket.id()),
    }
}

/// Makes the only row busy (500 booked prefill tokens > 100).
fn fill(core: &RoutingCore) -> u64 {
    match core.submit(req("low", 500), &NoOverlap, false) {
        Ok(Submitted::Dispatched(routed)) => routed.id,
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_full_queue_sheds_the_lowest_priority_newest_first_and_refuses_when_none_ranks_lower() {
    let core = core(Arc::new(ManualClock::default()), None);
    let busy = fill(&core);
    let low_a = queued(&core, "low");
    let low_b = queued(&core, "low");
    let mid_c = queued(&core, "mid");
    assert_eq!(core.admission_stats().waiting, 3);

    // Full: `high` takes the place of the newest of the lowest priority.
    let high_d = queued(&core, "high");
    assert_eq!(shed_by(&low_b), ("low".into(), "high".into()));
    assert!(!low_a.is_done(), "the older low one stays");
    // `mid` outranks only `low`: the last low one goes.
    let mid_e = queued(&core, "mid");
    assert_eq!(shed_by(&low_a), ("low".into(), "mid".into()));
    // Nothing queued ranks below `low`, nor below `mid` (equal priority is no reason to shed).
    for name in ["low", "mid"] {
        let err = core.submit(req(name, 10), &NoOverlap, false).unwrap_err();
        assert_eq!(
            err,
            RouteError::QueueFull {
                class: name.into(),
                limit: 3
            }
        );
    }
    // `high` sheds the newest `mid`.
    let high_f = queued(&core, "high");
    assert_eq!(shed_by(&mid_e), ("mid".into(), "high".into()));
    assert!(!mid_c.is_done());

    let stats = core.admission_stats();
    assert_eq!((stats.waiting, stats.shed, stats.refused), (3, 3, 2));
    assert_eq!(
        core.in_flight(),
        1,
        "shed and refused requests book nothing"
    );

    // The survivors are dispatched once capacity frees.
    assert!(core.complete(busy));
    let drained = core.drain(false);
    let mut left: Vec<u64> = drained.iter().map(|d| d.ticket).collect();
    left.sort_unstable();
    let mut expected = vec![mid_c.id(), high_d.id(), high_f.id()];
    expected.sort_unstable();
    assert_eq!(left, expected);
    for d in drained {
        assert!(core.complete(d.result.expect("dispatched").id));
    }
    assert_eq!(core.booked(row(1, 0)), RowLoad::default());
}

#[test]
fn a_leg_of_a_request_under_way_queues_past_the_bound_and_is_never_shed() {
    let core = core(Arc::new(ManualClock::default()), None);
    let busy = fill(&core);
    let low_a = queued(&core, "low");
    let under_way = queued_continuing(&core, "low");
    let low_b = queued(&core, "low");
    // Full (3): another continuing leg still queues, and sheds nobody.
    let under_way_2 = queued_continuing(&core, "low");
    assert!(!low_a.is_done() && !low_b.is_done());
    assert_eq!(core.admission_stats().waiting, 4);
    // First legs still meet the bound: `high` sheds the newest `low` first leg, never a
    // continuing one, and then nothing is left below it.
    let high = queued(&core, "high");
    assert_eq!(shed_by(&low_b), ("low".into(), "high".into()));
    let _high_2 = queued(&core, "high");
    assert_eq!(shed_by(&low_a), ("low".into(), "high".into()));
    assert_eq!(
        core.submit(req("high", 10), &NoOverlap, false).unwrap_err(),
        RouteError::QueueFull {
            class: "high".into(),
            limit: 3
        }
    );
    assert!(!under_way.is_done() && !under_way_2.is_done() && !high.is_done());
    let stats = core.admission_stats();
    assert_eq!((stats.waiting, stats.shed, stats.refused), (4, 2, 1));
    // Capacity frees: the continuing legs are dispatched like any other queued request.
    assert!(core.complete(busy));
    let drained = core.drain(false);
    assert!(drained.iter().any(|d| d.ticket == under_way.id()));
}

fn queued_continuing(core: &RoutingCore, class: &str) -> Ticket {
    let request = Request {
        continues: true,
        ..req(class, 10)
    };
    match core.submit(request, &NoOverlap, false) {
        Ok(Submitted::Queued(ticket)) => ticket,
        other => panic!("expected the continuing leg to queue, got {other:?}"),
    }
}

#[test]
fn the_bound_counts_every_lane_and_a_shed_request_is_told_at_once() {
    let clock = Arc::new(ManualClock::default());
    let core = core(clock, None);
    fill(&core);
    let tickets: Vec<Ticket> = (0..3).map(|_| queued(&core, "low")).collect();
    let high = queued(&core, "high");
    // Resolved already: a waiter is not left to its deadline.
    assert!(tickets[2].is_done());
    assert!(matches!(
        core.wait(&tickets[2], Duration::from_secs(5)),
        Err(RouteError::Shed { .. })
    ));
    assert!(!high.is_done());
    assert_eq!(core.admission_stats().waiting, 3);
}

#[test]
fn overdue_requests_leave_a_full_queue_before_anyone_is_shed() {
    let clock = Arc::new(ManualClock::default());
    let core = core(clock.clone(), Some(Duration::from_millis(500)));
    fill(&core);
    let low: Vec<Ticket> = (0..3).map(|_| queued(&core, "low")).collect();
    clock.advance(Duration::from_millis(501));
    // Room comes from the expired ones, not from shedding: equal priority still gets in.
    let again = queued(&core, "low");
    for ticket in &low {
        assert!(
            matches!(
                ticket.try_take(),
                Some(Err(RouteError::QueueTimeout { .. }))
            ),
            "expired, not shed"
        );
    }
    assert!(!again.is_done());
    let stats = core.admission_stats();
    assert_eq!((stats.expired, stats.shed, stats.refused), (3, 0, 0));
}

fn saturating(max_engine_waiting: Option<u64>, max_kv_usage: Option<f64>) -> RoutingCore {
    core_of(
        Arc::new(Cheapest::default()),
        vec![sized(1)],
        CoreSettings {
            classes: vec![
                ClassSpec {
                    name: "default".into(),
                    max_engine_waiting,
                    max_kv_usage,
                    ..ClassSpec::default()
                },
                class("plain", 0, None),
            ],
            ..CoreSettings::default()
        },
    )
}

#[test]
fn engine_saturation_makes_a_row_busy_for_classes_that_limit_it() {
    let core = saturating(Some(4), Some(0.9));
    let plain = |core: &RoutingCore| core.submit(req("plain", 10), &NoOverlap, false);
    let submit = |core: &RoutingCore| core.submit(Request::default(), &NoOverlap, false);
    // Unknown signals never saturate.
    assert!(matches!(submit(&core), Ok(Submitted::Dispatched(_))));
    let signals = |waiting, kv_usage| EngineSignals { waiting, kv_usage };
    // Prefill-saturated: more waiting than the limit (strictly).
    assert!(core.observe_engine(row(1, 0), signals(Some(4), Some(0.9))));
    assert!(matches!(submit(&core), Ok(Submitted::Dispatched(_))));
    assert!(core.observe_engine(row(1, 0), signals(Some(5), None)));
    let prefill = match submit(&core) {
        Ok(Submitted::Queued(ticket)) => ticket,
        other => panic!("{other:?}"),
    };
    // A class without engine limits decides as before.
    assert!(matches!(plain(&core), Ok(Submitted::Dispatched(_))));
    // Decode-saturated: KV usage over the limit.
    assert!(core.observe_engine(row(1, 0), signals(Some(0), Some(0.95))));
    assert!(core.drain(false).is_empty(), "still saturated");
    // Back under both: the queued request goes at the next drain.
    assert!(core.observe_engine(row(1, 0), signals(Some(0), Some(0.5))));
    let drained = core.drain(false);
    assert_eq!(drained.len(), 1);
    assert_eq!(drained[0].ticket, prefill.id());
    // Forgotten (the scrape failed): unknown again, not saturated.
    assert!(core.observe_engine(row(1, 0), signals(Some(9), None)));
    assert!(core.observe_engine(row(1, 0), EngineSignals::default()));
    assert_eq!(core.engine_signals(row(1, 0)), EngineSignals::default());
    assert!(matches!(submit(&core), Ok(Submitted::Dispatched(_))));
    // Rows that are not registered are not kept.
    assert!(!core.observe_engine(row(7, 0), signals(Some(9), None)));
    assert_eq!(core.engine_signals(row(7, 0)), EngineSignals::default());
}

#[test]
fn a_caller_that_reads_outcomes_from_drain_gets_the_shed_one_there() {
    let core = core(Arc::new(ManualClock::default()), None);
    fill(&core);
    // Tickets dropped at once, as `select` and `replay` do.
    let ids: Vec<u64> = (0..3).map(|_| queued(&core, "low").id()).collect();
    let high = queued(&core, "high").id();
    let drained = core.drain(false);
    assert_eq!(drained.len(), 1, "{drained:?}");
    assert_eq!(drained[0].ticket, ids[2], "the newest low one");
    assert!(matches!(
        &drained[0].result,
        Err(RouteError::Shed { class, by_class, .. }) if class == "low" && by_class == "high"
    ));
    assert!(core.drain(false).is_empty(), "told once");
    assert_ne!(high, ids[2]);
}
