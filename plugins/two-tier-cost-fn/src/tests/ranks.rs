//! Data-parallel ranks and soft targets.

use super::*;

#[test]
fn worker_target_runs_the_cache_tier_across_its_ranks() {
    // G alone would pick B (full overlap); K over A's ranks: A:1 covers 0.8 > 0.5.
    let rows = [
        TestRow::new(A, 0).active(0),
        TestRow::new(A, 1).device(8.0).active(3),
        TestRow::new(B, 0).device(10.0).active(0),
    ];
    let policy = policy(RESPECT);
    let request = request().target(A, None);
    assert_eq!(picked(&policy, &rows, &request), at(A, 1));
    let e = explained(&policy, &rows, &request);
    assert_eq!(e.reason, "soft_affinity_target");
    assert_eq!(
        e.get_label("tier"),
        Some("cache_tier_least_loaded_among_max_overlap")
    );
    assert_eq!(e.get_label("target_row"), Some("29:1"));
    assert_eq!(e.get("target_active_requests"), Some(3.0));
}

#[test]
fn worker_target_runs_the_load_tier_across_its_ranks() {
    // K over A's ranks: 40 vs 2 is imbalanced, so A's least-loaded rank wins despite A:0's cache.
    let rows = [
        TestRow::new(A, 0).device(10.0).active(40),
        TestRow::new(A, 1).active(2),
        TestRow::new(B, 0).active(0),
    ];
    let policy = policy(RESPECT);
    let request = request().target(A, None);
    assert_eq!(picked(&policy, &rows, &request), at(A, 1));
    let e = explained(&policy, &rows, &request);
    assert_eq!(e.reason, "soft_affinity_target");
    assert_eq!(e.get_label("tier"), Some("load_imbalance_least_loaded"));
}

#[test]
fn rank_target_picks_that_rank() {
    let rows = [
        TestRow::new(A, 0).device(10.0).active(0),
        TestRow::new(A, 1).active(5),
        TestRow::new(B, 0).device(10.0).active(0),
    ];
    let request = request().target(A, Some(1));
    assert_eq!(picked(&policy(RESPECT), &rows, &request), at(A, 1));
}

#[test]
fn rank_target_whose_rank_is_excluded_falls_back_to_all_rows() {
    let rows = [TestRow::new(A, 0).active(0), row(B, 6.0, 0.0, 4)];
    let policy = policy(RESPECT);
    let request = request().target(A, Some(1));
    assert_eq!(picked(&policy, &rows, &request), at(B, 0));
    let e = explained(&policy, &rows, &request);
    assert_eq!(e.reason, "cache_tier_least_loaded_among_max_overlap");
    assert_eq!(e.get_label("soft_affinity"), Some("not_eligible"));
    assert_eq!(e.get("target_active_requests"), None);
}

#[test]
fn gate_compares_the_target_row_with_the_least_loaded_row_of_all() {
    // K picks A:1 (active 3); G.min is B's 0. Gate 1/1.0: 3 - 0 > 1 and 3 > 0 -> released.
    let rows = [
        TestRow::new(A, 0).active(5),
        TestRow::new(A, 1).active(3),
        TestRow::new(B, 0).active(0),
    ];
    let gated = policy(
        r#"{"respect_soft_affinity": true, "soft_affinity_load_gate": true,
            "soft_affinity_gate_abs": 1, "soft_affinity_gate_rel": 1.0}"#,
    );
    let request = request().target(A, None);
    assert_eq!(picked(&gated, &rows, &request), at(B, 0));
    let e = explained(&gated, &rows, &request);
    assert_eq!(e.reason, "soft_affinity_released_load_gate");
    assert_eq!(e.get_label("soft_affinity"), Some("released_by_gate"));
    assert_eq!(e.get("target_active_requests"), Some(3.0));
    assert_eq!(e.get("soft_affinity_gate_abs"), Some(1.0));
    assert_eq!(e.get("min_active_requests"), Some(0.0));
}
