//! Session affinity and queue admission through the host's request lifecycle, with real plugins.
//!
//! Scenarios here drive load only through dispatch and completion (no injected load rows)
//! unless a test says otherwise.

mod common;

use std::sync::Arc;
use std::time::Duration;

use router_host::config::RouterConfig;
use router_host::host::{Host, NoOverlap, SessionOutcome, Submitted};
use router_host::loader::SearchPath;
use router_host::model::{Cluster, Request, RowId, Worker};
use router_host::policy_set::PolicySet;
use router_host::scenario::{self, Outcome, Scenario};
use router_host::sessions::{DispatchOutcome, ManualClock};

const A: u64 = 29;
const B: u64 = 41;

fn config(yaml_body: &str) -> RouterConfig {
    let yaml = format!(
        "plugins:\n  - path: {}\n  - path: {}\n  - path: {}\n{yaml_body}",
        common::plugin("two_tier_cost_fn").display(),
        common::plugin("soft_pin_repin").display(),
        common::plugin("fixture_probe").display(),
    );
    RouterConfig::from_yaml_str(&yaml, None).expect("valid config")
}

fn host_with_clock(yaml_body: &str, workers: Vec<Worker>, clock: Arc<ManualClock>) -> Host {
    let config = config(yaml_body);
    let router = PolicySet::from_config(&config, &SearchPath::default()).expect("router starts");
    Host::with_clock(router, Cluster::new(workers).unwrap(), &config, clock)
}

fn run(yaml_body: &str, scenario_json: &str) -> Vec<Outcome> {
    let config = config(yaml_body);
    let router = PolicySet::from_config(&config, &SearchPath::default()).expect("router starts");
    let scenario = Scenario::from_json_str(scenario_json, "test.json").expect("valid scenario");
    let mut host = Host::new(router, scenario.cluster.clone(), &config);
    scenario::run(&mut host, &scenario)
}

fn worker_of(outcome: &Outcome) -> u64 {
    outcome
        .routed()
        .unwrap_or_else(|| panic!("not routed: {outcome:?}"))
        .decision
        .row
        .worker_id
}

fn session_of(outcome: &Outcome) -> Option<SessionOutcome> {
    outcome.routed().and_then(|r| r.session.clone())
}

const REPIN: &str = "worker_selection:
  aggregated: repin
  instances:
    - {name: repin, type: soft-pin-repin, parameters: {max_active_requests: 0}}
session_affinity: {mode: soft, ttl_secs: 600}
";

#[test]
fn soft_pin_repin_moves_a_busy_session_a_b_b_through_dispatch_and_complete_only() {
    // r0 keeps B busy (pinned, in flight). The session's first request finds A idle; its second
    // arrives while the first still runs on A (1 > 0): it moves to B and the host rebinds the
    // session there; its third, after everything drained, stays on B.
    let outcomes = run(
        REPIN,
        r#"{"workers": [{"worker_id": 29}, {"worker_id": 41}],
            "requests": [
              {"isl_tokens": 160, "pinned_worker": {"worker_id": 41, "dp_rank": 0}},
              {"isl_tokens": 160, "session_id": "s1"},
              {"isl_tokens": 160, "session_id": "s1"},
              {"isl_tokens": 160, "session_id": "s1", "complete": [0, 1, 2]}
            ]}"#,
    );
    let sequence: Vec<u64> = outcomes[1..].iter().map(worker_of).collect();
    assert_eq!(sequence, [A, B, B]);
    assert_eq!(
        session_of(&outcomes[1]),
        Some(SessionOutcome::Dispatched(DispatchOutcome::Created))
    );
    assert!(matches!(
        session_of(&outcomes[2]),
        Some(SessionOutcome::Dispatched(DispatchOutcome::Moved { .. }))
    ));
    assert_eq!(
        session_of(&outcomes[3]),
        Some(SessionOutcome::Dispatched(DispatchOutcome::Kept))
    );
    let reasons: Vec<String> = outcomes[1..]
        .iter()
        .map(|o| {
            o.routed()
                .unwrap()
                .decision
                .explanation
                .clone()
                .unwrap()
                .reason
        })
        .collect();
    assert_eq!(
        reasons,
        [
            "no_target_least_loaded",
            "target_over_limit_moved",
            "target_within_limit"
        ]
    );
}

/// Soft affinity kept whatever another row caches (no cache gate), so turn 2 below shows the
/// binding winning over a better-cached row.
const STICKY: &str = "worker_selection:
  aggregated: sticky
  instances:
    - {name: sticky, type: dynamo-two-tier-cost-fn, parameters: {respect_soft_affinity: true, soft_affinity_cache_gate: false}}
session_affinity: {mode: soft, ttl_secs: 600}
";

#[test]
fn two_tier_with_respect_soft_affinity_keeps_the_session_then_falls_back_when_its_worker_leaves() {
    // Turn 1 lands on A (cold cluster, lowest row). Turn 2: B holds 60% of the prompt, which
    // would win the cache tier, but the session stays on A. Turn 3: A leaves; the policy falls
    // back to its normal decision and the binding follows to B.
    let outcomes = run(
        STICKY,
        r#"{"workers": [{"worker_id": 29}, {"worker_id": 41}],
            "requests": [
              {"isl_tokens": 160, "session_id": "s1"},
              {"isl_tokens": 160, "session_id": "s1", "complete": [0],
               "rows": [{"worker_id": 41, "device_blocks": 6}]},
              {"isl_tokens": 160, "session_id": "s1", "complete": [1],
               "worker_updates": [{"worker_id": 29, "available": false}]},
              {"isl_tokens": 160, "session_id": "s1", "complete": [2],
               "worker_updates": [{"worker_id": 29, "available": true}]}
            ]}"#,
    );
    let sequence: Vec<u64> = outcomes.iter().map(worker_of).collect();
    assert_eq!(sequence, [A, A, B, B]);
    let reason = |i: usize| {
        outcomes[i]
            .routed()
            .unwrap()
            .decision
            .explanation
            .clone()
            .unwrap()
    };
    assert_eq!(reason(1).reason, "soft_affinity_target");
    assert_eq!(reason(2).get_label("soft_affinity"), Some("not_eligible"));
    assert!(matches!(
        session_of(&outcomes[2]),
        Some(SessionOutcome::Dispatched(DispatchOutcome::Moved { .. }))
    ));
    assert_eq!(
        reason(3).reason,
        "soft_affinity_target",
        "the binding followed to B"
    );
}

#[test]
fn without_affinity_configured_sessions_get_no_target() {
    let outcomes = run(
        "worker_selection:\n  aggregated: p\n  instances:\n    - {name: p, type: probe}\n",
        r#"{"workers": [{"worker_id": 29}, {"worker_id": 41}],
            "requests": [{"isl_tokens": 16, "session_id": "s"}, {"isl_tokens": 16, "session_id": "s"}]}"#,
    );
    let e = outcomes[1]
        .routed()
        .unwrap()
        .decision
        .explanation
        .clone()
        .unwrap();
    assert_eq!(e.get_label("target"), Some("none"));
    assert_eq!(session_of(&outcomes[1]), None);
}

const HARD: &str = "worker_selection:
  aggregated: p
  instances:
    - {name: p, type: probe}
session_affinity: {mode: hard, ttl_secs: 600}
";

#[test]
fn hard_affinity_pins_the_bound_rank_then_invalidates_and_retries_once_when_it_is_gone() {
    let outcomes = run(
        HARD,
        r#"{"workers": [{"worker_id": 29, "dp_size": 2}, {"worker_id": 41}],
            "requests": [
              {"isl_tokens": 16, "session_id": "s1", "affinity_target": {"worker_id": 29, "dp_rank": 1}},
              {"isl_tokens": 16, "session_id": "s1"},
              {"isl_tokens": 16, "session_id": "s1", "worker_updates": [{"worker_id": 29, "available": false}]},
              {"isl_tokens": 16, "session_id": "s1", "worker_updates": [{"worker_id": 29, "available": true}]}
            ]}"#,
    );
    let rows_seen = |i: usize| {
        outcomes[i]
            .routed()
            .unwrap()
            .decision
            .explanation
            .clone()
            .unwrap()
            .get_label("row_list")
            .unwrap()
            .to_string()
    };
    // The probe follows the advisory target to 29:1; the binding is rank-exact and acts as a pin.
    assert_eq!(
        outcomes[0].routed().unwrap().decision.row,
        RowId {
            worker_id: A,
            dp_rank: 1
        }
    );
    assert_eq!(rows_seen(1), "29:1");
    // The bound worker left: binding invalidated, one normal selection over the remaining rows.
    assert_eq!(
        session_of(&outcomes[2]),
        Some(SessionOutcome::HardBindingGone)
    );
    assert_eq!(rows_seen(2), "41:0");
    // The session is now bound where that request was dispatched, even though 29 is back.
    assert_eq!(rows_seen(3), "41:0");
    assert_eq!(worker_of(&outcomes[3]), B);
}

#[test]
fn explicit_pin_beats_a_session_binding() {
    let outcomes = run(
        HARD,
        r#"{"workers": [{"worker_id": 29}, {"worker_id": 41}],
            "requests": [
              {"isl_tokens": 16, "session_id": "s1"},
              {"isl_tokens": 16, "session_id": "s1", "pinned_worker": {"worker_id": 41, "dp_rank": 0}}
            ]}"#,
    );
    assert_eq!(worker_of(&outcomes[0]), A);
    assert_eq!(worker_of(&outcomes[1]), B);
    assert!(matches!(
        session_of(&outcomes[1]),
        Some(SessionOutcome::NotRecorded(_))
    ));
}

#[test]
fn soft_binding_expires_after_the_idle_ttl_restarted_by_the_last_completion() {
    let clock = Arc::new(ManualClock::new(Duration::from_secs(1)));
    let host = host_with_clock(
        &STICKY.replace("ttl_secs: 600", "ttl_secs: 10"),
        vec![Worker::new(A), Worker::new(B)],
        clock.clone(),
    );
    let turn = Request {
        isl_tokens: 160,
        session_id: Some("s1".into()),
        ..Default::default()
    };
    let first = host.route(&turn, &NoOverlap, false).unwrap();
    let second = host.route(&turn, &NoOverlap, false).unwrap();
    clock.advance(Duration::from_secs(60));
    // In flight: never expires.
    assert!(host.sessions().unwrap().binding("s1").is_some());
    host.complete(first.id);
    clock.advance(Duration::from_secs(60));
    assert!(
        host.sessions().unwrap().binding("s1").is_some(),
        "one request still in flight"
    );
    host.complete(second.id);
    clock.advance(Duration::from_secs(10));
    let third = host.route(&turn, &NoOverlap, false).unwrap();
    assert_eq!(
        third.session,
        Some(SessionOutcome::Dispatched(DispatchOutcome::Kept)),
        "exactly ttl after the last completion: not yet expired"
    );
    host.complete(third.id);
    clock.advance(Duration::from_secs(10) + Duration::from_nanos(1));
    assert_eq!(
        host.route(&turn, &NoOverlap, false).unwrap().session,
        Some(SessionOutcome::Dispatched(DispatchOutcome::Created)),
        "just past ttl: the binding expired and a new one is created"
    );
}

#[test]
fn oversized_session_ids_are_rejected_with_a_clear_error() {
    let clock = Arc::new(ManualClock::new(Duration::ZERO));
    let host = host_with_clock(STICKY, vec![Worker::new(A)], clock);
    let request = Request {
        isl_tokens: 16,
        session_id: Some("x".repeat(10 * 1024)),
        ..Default::default()
    };
    let err = host
        .route(&request, &NoOverlap, false)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("session id is 10240 bytes, over the 256-byte limit"),
        "{err}"
    );
    assert!(err.len() < 300, "the id is not echoed in full");
    assert_eq!(host.in_flight(), 0);
}

fn admission(mode: &str) -> String {
    format!(
        "worker_selection:
  aggregated: sticky
  instances:
    - {{name: sticky, type: dynamo-two-tier-cost-fn, parameters: {{respect_soft_affinity: true}}}}
session_affinity: {{mode: soft, ttl_secs: 600}}
policy_classes:
  - {{name: interactive, prefill_busy_threshold: 100, admission: {mode}}}
"
    )
}

/// The seed's admission scenario: the session's soft target A is busy (its first turn, 160
/// prefill tokens > 100, is still in flight), B is idle, and the policy keeps soft targets.
const BUSY_TARGET: &str = r#"{"workers": [{"worker_id": 29}, {"worker_id": 41}],
    "requests": [
      {"isl_tokens": 160, "session_id": "s1", "policy_class": "interactive"},
      {"isl_tokens": 160, "session_id": "s1", "policy_class": "interactive"},
      {"isl_tokens": 16, "complete": [0]}
    ]}"#;

#[test]
fn any_eligible_admission_dispatches_onto_the_busy_soft_target() {
    let outcomes = run(&admission("any_eligible"), BUSY_TARGET);
    assert_eq!(worker_of(&outcomes[0]), A);
    let second = &outcomes[1];
    assert_eq!(
        worker_of(second),
        A,
        "admitted because B is idle, then kept on busy A"
    );
    assert!(matches!(
        second,
        Outcome::Routed {
            admitted_at: None,
            ..
        }
    ));
}

#[test]
fn chosen_row_admission_queues_until_the_soft_target_drains() {
    let outcomes = run(&admission("chosen_row"), BUSY_TARGET);
    assert_eq!(worker_of(&outcomes[0]), A);
    match &outcomes[1] {
        Outcome::Routed {
            routed,
            admitted_at: Some(2),
        } => assert_eq!(
            routed.decision.row.worker_id, A,
            "dispatched to A once it drained"
        ),
        other => panic!("expected queued until step 2, got {other:?}"),
    }
}

#[test]
fn a_busy_pin_blocks_only_its_own_lane() {
    let outcomes = run(
        &admission("any_eligible"),
        r#"{"workers": [{"worker_id": 29}, {"worker_id": 41}],
            "requests": [
              {"isl_tokens": 160, "policy_class": "interactive", "pinned_worker": {"worker_id": 29}},
              {"isl_tokens": 160, "policy_class": "interactive", "pinned_worker": {"worker_id": 29}},
              {"isl_tokens": 16, "policy_class": "interactive"},
              {"isl_tokens": 16, "policy_class": "interactive", "pinned_worker": {"worker_id": 29}},
              {"isl_tokens": 16, "complete": [0]}
            ]}"#,
    );
    assert_eq!(worker_of(&outcomes[0]), A);
    assert!(matches!(
        &outcomes[2],
        Outcome::Routed {
            admitted_at: None,
            ..
        }
    ));
    assert_eq!(
        worker_of(&outcomes[2]),
        B,
        "the unpinned lane is not blocked"
    );
    // The pin lane drains in order: r1 goes when r0 completes; r3 waits behind it (A busy again).
    assert!(matches!(
        &outcomes[1],
        Outcome::Routed {
            admitted_at: Some(4),
            ..
        }
    ));
    assert_eq!(outcomes[3], Outcome::StillQueued);
}

#[test]
fn busy_checks_are_strict_and_unknown_batch_size_is_never_busy() {
    let yaml = "policy_classes:
  - {name: default, prefill_busy_threshold: 160}
  - {name: frac, prefill_busy_threshold_frac: 0.5}
";
    let clock = Arc::new(ManualClock::new(Duration::ZERO));
    let mut sized = Worker::new(A);
    sized.max_num_batched_tokens = Some(200);
    let host = host_with_clock(yaml, vec![sized], clock.clone());
    let req = |isl: u64, class: Option<&str>| Request {
        isl_tokens: isl,
        policy_class: class.map(str::to_string),
        ..Default::default()
    };
    // Requests without a class use the class named `default`: 160 tokens is not > 160.
    assert!(matches!(
        host.submit(req(160, None), &NoOverlap, false),
        Ok(Submitted::Dispatched(_))
    ));
    assert!(matches!(
        host.submit(req(1, None), &NoOverlap, false),
        Ok(Submitted::Dispatched(_))
    ));
    assert!(matches!(
        host.submit(req(1, None), &NoOverlap, false),
        Ok(Submitted::Queued(_))
    ));
    // frac: 161 > 0.5 * 200: busy.
    assert!(matches!(
        host.submit(req(1, Some("frac")), &NoOverlap, false),
        Ok(Submitted::Queued(_))
    ));
    let err = host
        .submit(req(1, Some("batch")), &NoOverlap, false)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("unknown policy class `batch`; defined classes: default, frac"),
        "{err}"
    );

    // A worker with unknown max_num_batched_tokens is never busy by the fraction rule.
    let host = host_with_clock(yaml, vec![Worker::new(A)], clock);
    for _ in 0..3 {
        assert!(matches!(
            host.submit(req(10_000, Some("frac")), &NoOverlap, false),
            Ok(Submitted::Dispatched(_))
        ));
    }
    assert_eq!(host.admission_stats().queued, 0);
}

#[test]
fn a_hard_bound_session_waiting_for_its_busy_row_does_not_block_other_requests() {
    let outcomes = run(
        "worker_selection:
  aggregated: p
  instances:
    - {name: p, type: probe}
session_affinity: {mode: hard, ttl_secs: 600}
policy_classes:
  - {name: default, prefill_busy_threshold: 100}
",
        r#"{"workers": [{"worker_id": 29}, {"worker_id": 41}],
            "requests": [
              {"isl_tokens": 160, "session_id": "s1"},
              {"isl_tokens": 160, "session_id": "s1"},
              {"isl_tokens": 16},
              {"isl_tokens": 16, "complete": [0]}
            ]}"#,
    );
    assert_eq!(worker_of(&outcomes[0]), A);
    // The session is hard-bound to busy A: it waits in A's lane ...
    assert!(matches!(
        &outcomes[1],
        Outcome::Routed {
            admitted_at: Some(3),
            ..
        }
    ));
    assert_eq!(worker_of(&outcomes[1]), A);
    // ... while a request without a pin is admitted at once (B is idle), not queued behind it.
    assert!(matches!(
        &outcomes[2],
        Outcome::Routed {
            admitted_at: None,
            ..
        }
    ));
}

#[test]
fn a_hard_binding_found_gone_is_reported_once_through_admission_too() {
    let outcomes = run(
        &format!("{HARD}policy_classes:\n  - {{name: default, prefill_busy_threshold: 1000000}}\n"),
        r#"{"workers": [{"worker_id": 29}, {"worker_id": 41}],
            "requests": [
              {"isl_tokens": 16, "session_id": "s1"},
              {"isl_tokens": 16, "session_id": "s1", "worker_updates": [{"worker_id": 29, "available": false}]},
              {"isl_tokens": 16, "session_id": "s1"}
            ]}"#,
    );
    assert_eq!(worker_of(&outcomes[0]), A);
    assert_eq!(
        session_of(&outcomes[1]),
        Some(SessionOutcome::HardBindingGone)
    );
    assert_eq!(worker_of(&outcomes[1]), B);
    assert_eq!(
        session_of(&outcomes[2]),
        Some(SessionOutcome::Dispatched(DispatchOutcome::Kept))
    );
}
