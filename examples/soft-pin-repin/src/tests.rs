use plugin_api::testing::{create, create_boxed, TestRequest, TestRow, TestRows};
use plugin_api::{Explanation, RowId};

use super::*;

const A: u64 = 29;
const B: u64 = 41;
const C: u64 = 57;

fn request() -> TestRequest {
    TestRequest::new(160, 16)
}

fn repin(max_active_requests: u64) -> SoftPinRepin {
    create::<SoftPinRepinType>(&format!(
        r#"{{"max_active_requests": {max_active_requests}}}"#
    ))
    .expect("valid parameters")
}

fn at(worker_id: u64, dp_rank: u32) -> RowId {
    RowId { worker_id, dp_rank }
}

/// The pick and its explanation, checked to agree.
fn decide(policy: &SoftPinRepin, rows: &[TestRow], request: &TestRequest) -> (RowId, Explanation) {
    let rows = TestRows::new(rows.to_vec());
    let picked = rows.pick(policy, request).expect("a row is picked");
    let explanation = rows.explain(policy, request).expect("an explanation");
    assert_eq!(explanation.row, picked);
    (rows.row(picked), explanation)
}

#[test]
fn target_within_limit_keeps_the_target() {
    let rows = [TestRow::new(A, 0).active(1), TestRow::new(B, 0).active(0)];
    let (row, e) = decide(&repin(2), &rows, &request().target(A, None));
    assert_eq!(row, at(A, 0));
    assert_eq!(e.reason, "target_within_limit");
    assert_eq!(e.get("target_active_requests"), Some(1.0));
    assert_eq!(e.get("max_active_requests"), Some(2.0));
    assert_eq!(e.get_label("target"), Some("29:*"));
}

#[test]
fn the_limit_is_inclusive() {
    let rows = [TestRow::new(A, 0).active(2), TestRow::new(B, 0).active(0)];
    let request = request().target(A, None);
    assert_eq!(decide(&repin(2), &rows, &request).0, at(A, 0));
    assert_eq!(decide(&repin(1), &rows, &request).0, at(B, 0));
}

#[test]
fn target_over_limit_moves_to_the_least_loaded_other_row() {
    let rows = [
        TestRow::new(A, 0).active(1),
        TestRow::new(C, 0).active(3),
        TestRow::new(B, 0).active(3),
    ];
    let (row, e) = decide(&repin(0), &rows, &request().target(A, None));
    // B and C tie on load: lowest worker id wins.
    assert_eq!(row, at(B, 0));
    assert_eq!(e.reason, "target_over_limit_moved");
    assert_eq!(e.get("target_active_requests"), Some(1.0));
    assert_eq!(e.get("picked_active_requests"), Some(3.0));
    assert_eq!(e.get_label("target_row"), Some("29:0"));
}

#[test]
fn over_limit_without_alternative_stays_on_the_target() {
    let rows = [TestRow::new(A, 0).active(5), TestRow::new(A, 1).active(4)];
    let (row, e) = decide(&repin(0), &rows, &request().target(A, None));
    assert_eq!(row, at(A, 1));
    assert_eq!(e.reason, "target_over_limit_no_alternative");
}

#[test]
fn worker_target_uses_its_least_loaded_rank() {
    let rows = [
        TestRow::new(A, 0).active(3),
        TestRow::new(A, 1).active(1),
        TestRow::new(B, 0).active(0),
    ];
    let (row, e) = decide(&repin(1), &rows, &request().target(A, None));
    assert_eq!(row, at(A, 1));
    assert_eq!(e.get_label("target_row"), Some("29:1"));
}

#[test]
fn rank_target_considers_only_that_rank() {
    let rows = [
        TestRow::new(A, 0).active(3),
        TestRow::new(A, 1).active(1),
        TestRow::new(B, 0).active(2),
    ];
    // Rank 0 is over the limit; its sibling rank 1 does not match the target, so it is an
    // alternative like any other row, and the least-loaded one.
    let (row, e) = decide(&repin(1), &rows, &request().target(A, Some(0)));
    assert_eq!(row, at(A, 1));
    assert_eq!(e.reason, "target_over_limit_moved");
    assert_eq!(e.get_label("target"), Some("29:0"));
    // Within the limit the rank itself is kept, even though rank 1 is less loaded.
    assert_eq!(
        decide(&repin(3), &rows, &request().target(A, Some(0))).0,
        at(A, 0)
    );
}

#[test]
fn no_target_picks_the_least_loaded_row() {
    let rows = [
        TestRow::new(B, 0).active(1),
        TestRow::new(A, 1).active(1),
        TestRow::new(C, 0).active(4),
    ];
    let (row, e) = decide(&repin(0), &rows, &request());
    assert_eq!(row, at(A, 1));
    assert_eq!(e.reason, "no_target_least_loaded");
    assert_eq!(e.get_label("target"), Some("none"));
    assert_eq!(e.get("target_active_requests"), None);
}

#[test]
fn target_without_matching_rows_picks_the_least_loaded_row() {
    let rows = [TestRow::new(A, 0).active(2), TestRow::new(B, 0).active(1)];
    let (row, e) = decide(&repin(0), &rows, &request().target(999, None));
    assert_eq!(row, at(B, 0));
    assert_eq!(e.reason, "no_target_least_loaded");
    assert_eq!(e.get_label("target"), Some("999:*"));
    // A rank target whose rank is gone matches nothing either.
    let (row, _) = decide(&repin(9), &rows, &request().target(A, Some(1)));
    assert_eq!(row, at(B, 0));
}

#[test]
fn row_order_does_not_change_the_pick() {
    let rows = vec![
        TestRow::new(C, 0).active(2),
        TestRow::new(B, 1).active(2),
        TestRow::new(A, 0).active(4),
        TestRow::new(B, 0).active(2),
    ];
    for shift in 0..rows.len() {
        let mut order = rows.clone();
        order.rotate_left(shift);
        for order in [order.clone(), order.into_iter().rev().collect()] {
            assert_eq!(
                decide(&repin(1), &order, &request().target(A, None)).0,
                at(B, 0)
            );
            assert_eq!(decide(&repin(1), &order, &request()).0, at(B, 0));
        }
    }
}

#[test]
fn zero_rows_is_an_error() {
    let err = TestRows::new(vec![])
        .pick(&repin(0), &request().target(A, None))
        .expect_err("no rows");
    assert!(err.message().contains("no rows"), "{err}");
}

#[test]
fn missing_parameter_is_named() {
    let err = create::<SoftPinRepinType>("{}").expect_err("required parameter");
    assert!(err.to_string().contains("max_active_requests"), "{err}");
}

#[test]
fn unknown_key_is_rejected_by_name() {
    let err = create::<SoftPinRepinType>(r#"{"max_active_requests": 1, "max_active": 2}"#)
        .expect_err("unknown key");
    assert!(err.to_string().contains("max_active"), "{err}");
    assert!(err.key().ends_with("max_active"), "{err}");
}

#[test]
fn mistyped_parameter_is_rejected_by_name() {
    let err = create::<SoftPinRepinType>(r#"{"max_active_requests": -1}"#).expect_err("negative");
    assert_eq!(err.key(), "max_active_requests", "{err}");
}

#[test]
fn declares_load_only_and_works_through_the_exported_adapter() {
    let boxed = create_boxed::<SoftPinRepinType>(r#"{"max_active_requests": 0}"#).unwrap();
    assert_eq!(boxed.required_inputs(), Inputs::LOAD);
    let rows = TestRows::new(vec![
        TestRow::new(A, 0).active(1),
        TestRow::new(B, 0).active(0),
    ]);
    let picked = rows
        .pick_through_abi(&boxed, &request().target(A, None))
        .ok();
    assert_eq!(picked.map(|i| rows.row(i)), Some(at(B, 0)));
}

/// Design §9: one session sent three times goes A -> B -> B. The host's part (booking the
/// dispatched row, rebinding the session to it) is played by hand here.
#[test]
fn session_walkthrough_goes_a_then_b_then_b() {
    let policy = repin(0);
    // First: no binding yet; A idle, B busy.
    let first = [TestRow::new(A, 0).active(0), TestRow::new(B, 0).active(3)];
    let (row, e) = decide(&policy, &first, &request().session("s1"));
    assert_eq!(
        (row, e.reason.as_str()),
        (at(A, 0), "no_target_least_loaded")
    );
    // Second: bound to A, whose first request is still running (1 > 0): move to B.
    let second = [TestRow::new(A, 0).active(1), TestRow::new(B, 0).active(0)];
    let (row, e) = decide(&policy, &second, &request().session("s1").target(A, None));
    assert_eq!(
        (row, e.reason.as_str()),
        (at(B, 0), "target_over_limit_moved")
    );
    // Third: rebound to B, everything drained: B is within the limit and keeps the session,
    // although plain least-loaded would prefer A's lower worker id.
    let third = [TestRow::new(A, 0).active(0), TestRow::new(B, 0).active(0)];
    let (row, e) = decide(&policy, &third, &request().session("s1").target(B, None));
    assert_eq!((row, e.reason.as_str()), (at(B, 0), "target_within_limit"));
}
