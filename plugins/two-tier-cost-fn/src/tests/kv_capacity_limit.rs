//! `kv_capacity_limit`.

use super::*;

const LIMIT: &str = r#"{"kv_capacity_limit": 1.0}"#;
const C: u64 = 77;

/// A rank-0 row `(worker, device, active, decode_blocks)`.
fn booked(worker: u64, device: f64, active: u64, decode: u64) -> TestRow {
    TestRow::new(worker, 0)
        .device(device)
        .active(active)
        .decode_blocks(decode)
}

/// `rows` with a `kv_capacity_blocks` column: each row's capacity next to it.
fn with_capacity(rows: &[(TestRow, f64)]) -> TestRows {
    TestRows::new(rows.iter().map(|(row, _)| *row).collect())
        .kv_capacity_blocks(rows.iter().map(|(_, capacity)| *capacity).collect())
}

/// The row `policy` picks over `rows` (with their capacities) and its explanation; the same
/// row, reason and tier in every row order, and `explain` describes the row `pick` returns.
fn capacity_decision(
    policy: &TwoTierCostFn,
    rows: &[(TestRow, f64)],
    request: &TestRequest,
) -> (RowId, Explanation) {
    let mut first: Option<(RowId, Explanation)> = None;
    for order in orders(rows) {
        let rows = with_capacity(&order);
        let e = rows.explain(policy, request).expect("an explanation");
        assert_eq!(Ok(e.row), rows.pick(policy, request), "{order:?}");
        let row = rows.row(e.row);
        match &first {
            Some((first_row, first)) => assert_eq!(
                (row, e.reason.as_str(), e.get_label("tier")),
                (*first_row, first.reason.as_str(), first.get_label("tier")),
                "{order:?}"
            ),
            None => first = Some((row, e)),
        }
    }
    first.expect("at least one row")
}

/// R = 10 (isl 160 at block size 16), capacity 100 everywhere. A caches 0.6 of the prompt and
/// has 99 decode blocks booked (99 + 10 > 100: 9 blocks over, more than the 6 a move throws
/// away); C is the least-loaded row (1 active) at
/// 30 + 10 <= 100; B runs 2.
fn over_full_cache_row() -> [(TestRow, f64); 3] {
    [
        (booked(A, 6.0, 4, 99), 100.0),
        (booked(B, 0.0, 2, 0), 100.0),
        (booked(C, 0.0, 1, 30), 100.0),
    ]
}

#[test]
fn kv_capacity_limit_moves_an_over_full_cache_row_to_the_least_loaded_row() {
    let (row, e) = capacity_decision(&policy(LIMIT), &over_full_cache_row(), &request());
    assert_eq!(row, at(C, 0));
    assert_eq!(e.reason, "cache_row_over_kv_capacity_least_loaded");
    assert_eq!(
        e.get_label("tier"),
        Some("cache_row_over_kv_capacity_least_loaded")
    );
    assert_eq!(e.get_label("soft_affinity"), Some("none"));
    // The cache tier fired: the row it would have taken is still reported.
    assert_eq!(e.get_label("max_overlap_row"), Some("29:0"));
    assert_eq!(e.get("cache_ratio"), Some(0.6));
    assert_eq!(e.get("kv_capacity_limit"), Some(1.0));
}

#[test]
fn kv_capacity_limit_absent_changes_nothing() {
    let (row, e) = capacity_decision(&policy(DEFAULTS), &over_full_cache_row(), &request());
    assert_eq!(row, at(A, 0));
    assert_eq!(e.reason, "cache_tier_least_loaded_among_max_overlap");
    assert_eq!(e.get("kv_capacity_limit"), None);
    assert_eq!(policy(DEFAULTS).params().kv_capacity_limit, None);
}

#[test]
fn cache_row_under_the_limit_is_kept() {
    let mut rows = over_full_cache_row();
    rows[0].0 = booked(A, 6.0, 4, 50);
    let (row, e) = capacity_decision(&policy(LIMIT), &rows, &request());
    assert_eq!(row, at(A, 0));
    assert_eq!(e.reason, "cache_tier_least_loaded_among_max_overlap");
    // Set but not firing: the value in force is still reported.
    assert_eq!(e.get("kv_capacity_limit"), Some(1.0));
}

#[test]
fn cache_row_is_kept_when_every_other_row_is_over_the_limit_too() {
    let rows = [
        (booked(A, 6.0, 4, 99), 100.0),
        (booked(B, 0.0, 0, 91), 100.0),
    ];
    let (row, e) = capacity_decision(&policy(LIMIT), &rows, &request());
    assert_eq!(row, at(A, 0));
    assert_eq!(e.reason, "cache_tier_least_loaded_among_max_overlap");
}

#[test]
fn the_replacement_is_the_least_loaded_row_with_room() {
    // B is the least-loaded row but over the limit too; of the rows with room, C (3 active)
    // is less loaded than D (5).
    const D: u64 = 88;
    let rows = [
        (booked(A, 6.0, 4, 99), 100.0),
        (booked(B, 0.0, 0, 91), 100.0),
        (booked(C, 0.0, 3, 0), 100.0),
        (booked(D, 0.0, 5, 0), 100.0),
    ];
    let (row, e) = capacity_decision(&policy(LIMIT), &rows, &request());
    assert_eq!(row, at(C, 0));
    assert_eq!(e.reason, "cache_row_over_kv_capacity_least_loaded");
    // With `prefill_backlog` the order among the rows with room is by backlog: D has none.
    let rows = [
        (booked(A, 6.0, 4, 99), 100.0),
        (booked(B, 0.0, 0, 91).prefill_tokens(0), 100.0),
        (booked(C, 0.0, 3, 0).prefill_tokens(500), 100.0),
        (booked(D, 0.0, 5, 0).prefill_tokens(0), 100.0),
    ];
    let backlog = policy(r#"{"kv_capacity_limit": 1.0, "load_signal": "prefill_backlog"}"#);
    let (row, e) = capacity_decision(&backlog, &rows, &request());
    assert_eq!(row, at(D, 0));
    assert_eq!(e.reason, "cache_row_over_kv_capacity_least_loaded");
}

#[test]
fn kv_capacity_limit_is_strict() {
    // Booked + R exactly at limit * capacity is not over it; one block more is. B caches as
    // much (a move throws nothing away) but runs more, so the cache tier takes A.
    for (limit, at_limit) in [(1.0, 90), (1.5, 140), (0.5, 40)] {
        let policy = policy(&format!(r#"{{"kv_capacity_limit": {limit}}}"#));
        let rows = |decode: u64| {
            [
                (booked(A, 6.0, 4, decode), 100.0),
                (booked(B, 6.0, 5, 0), 100.0),
            ]
        };
        let (row, e) = capacity_decision(&policy, &rows(at_limit), &request());
        assert_eq!(row, at(A, 0), "limit {limit}: {at_limit} + 10 is not over");
        assert_eq!(e.reason, "cache_tier_least_loaded_among_max_overlap");
        let (row, e) = capacity_decision(&policy, &rows(at_limit + 1), &request());
        assert_eq!(
            row,
            at(B, 0),
            "limit {limit}: {} + 10 is over",
            at_limit + 1
        );
        assert_eq!(e.reason, "cache_row_over_kv_capacity_least_loaded");
    }
    // The least-loaded row exactly at the limit is not over it either.
    let rows = [
        (booked(A, 6.0, 4, 99), 100.0),
        (booked(B, 0.0, 0, 90), 100.0),
    ];
    assert_eq!(
        capacity_decision(&policy(LIMIT), &rows, &request()).0,
        at(B, 0)
    );
}

#[test]
fn without_a_capacity_column_the_limit_never_fires() {
    let rows: Vec<TestRow> = over_full_cache_row().iter().map(|(row, _)| *row).collect();
    let policy = policy(LIMIT);
    for order in orders(&rows) {
        assert_eq!(picked(&policy, &order, &request()), at(A, 0), "{order:?}");
    }
    let e = explained(&policy, &rows, &request());
    assert_eq!(e.reason, "cache_tier_least_loaded_among_max_overlap");
}

#[test]
fn unknown_capacity_is_never_full() {
    let policy = policy(LIMIT);
    // The cache row's capacity is unknown: it is never over, so it is kept.
    let mut rows = over_full_cache_row();
    rows[0].1 = f64::NAN;
    let (row, e) = capacity_decision(&policy, &rows, &request());
    assert_eq!(row, at(A, 0));
    assert_eq!(e.reason, "cache_tier_least_loaded_among_max_overlap");
    // The least-loaded row's capacity is unknown: it is never over, so it takes the request
    // from a cache row that is.
    let rows = [
        (booked(A, 6.0, 4, 99), 100.0),
        (booked(B, 0.0, 0, 5000), f64::NAN),
    ];
    let (row, e) = capacity_decision(&policy, &rows, &request());
    assert_eq!(row, at(B, 0));
    assert_eq!(e.reason, "cache_row_over_kv_capacity_least_loaded");
}

#[test]
fn a_capacity_column_of_the_wrong_length_counts_as_absent() {
    let rows = TestRows::new(over_full_cache_row().iter().map(|(row, _)| *row).collect())
        .kv_capacity_blocks(vec![100.0]);
    let policy = policy(LIMIT);
    let picked = rows.pick(&policy, &request()).expect("a row is picked");
    assert_eq!(rows.row(picked), at(A, 0));
}

#[test]
fn load_tier_wins_before_the_capacity_rule() {
    // Imbalanced (40 vs 0): the load tier decides, whatever the capacity says.
    let rows = [
        (booked(A, 10.0, 40, 95), 100.0),
        (booked(B, 0.0, 0, 0), 100.0),
    ];
    let (row, e) = capacity_decision(&policy(LIMIT), &rows, &request());
    assert_eq!(row, at(B, 0));
    assert_eq!(e.reason, "load_imbalance_least_loaded");
    assert_eq!(e.get_label("tier"), Some("load_imbalance_least_loaded"));
}

#[test]
fn kv_capacity_limit_applies_to_the_least_loaded_tier_too() {
    // No cache winner (0.5 is not > 0.5): the least-loaded row, A, would overfill (95 + 10 >
    // 100), so the least-loaded row with room, B, takes the request.
    let rows = [
        (booked(A, 5.0, 0, 99), 100.0),
        (booked(B, 0.0, 4, 0), 100.0),
    ];
    let (row, e) = capacity_decision(&policy(LIMIT), &rows, &request());
    assert_eq!(row, at(B, 0));
    assert_eq!(e.reason, "least_loaded_row_over_kv_capacity_least_loaded");
    assert_eq!(
        e.get_label("tier"),
        Some("least_loaded_row_over_kv_capacity_least_loaded")
    );
    // Without the limit, or with no row that has room, A keeps it.
    let (row, e) = capacity_decision(&policy("{}"), &rows, &request());
    assert_eq!(
        (row, e.reason.as_str()),
        (at(A, 0), "least_loaded_no_cache_winner")
    );
    let full = [
        (booked(A, 5.0, 0, 99), 100.0),
        (booked(B, 0.0, 4, 91), 100.0),
    ];
    let (row, e) = capacity_decision(&policy(LIMIT), &full, &request());
    assert_eq!(
        (row, e.reason.as_str()),
        (at(A, 0), "least_loaded_no_cache_winner")
    );
}

#[test]
fn kv_capacity_limit_applies_to_the_load_tier_too() {
    // Imbalanced (40 vs 0): the load tier takes the fewest-active row, B, but B would overfill;
    // C, the least-loaded row with room, takes the request instead of A (40 active).
    let rows = [
        (booked(A, 0.0, 40, 0), 100.0),
        (booked(B, 0.0, 0, 95), 100.0),
        (booked(C, 0.0, 5, 0), 100.0),
    ];
    let (row, e) = capacity_decision(&policy(LIMIT), &rows, &request());
    assert_eq!(row, at(C, 0));
    assert_eq!(e.reason, "load_imbalance_row_over_kv_capacity_least_loaded");
    let (row, e) = capacity_decision(&policy("{}"), &rows, &request());
    assert_eq!(
        (row, e.reason.as_str()),
        (at(B, 0), "load_imbalance_least_loaded")
    );
}

#[test]
fn kv_capacity_limit_gives_way_to_the_least_loaded_row_of_the_load_signal_in_force() {
    // A: the cache row, over its limit. B runs fewest requests but has 5000 prefill tokens
    // pending; C has the smallest backlog (160 tokens).
    let rows = [
        (booked(A, 6.0, 1, 99).prefill_tokens(1000), 100.0),
        (booked(B, 0.0, 0, 0).prefill_tokens(5000), 100.0),
        (booked(C, 0.0, 3, 0), 100.0),
    ];
    let active = policy(r#"{"kv_capacity_limit": 1.0, "load_signal": "active_requests"}"#);
    let (row, e) = capacity_decision(&active, &rows, &request());
    assert_eq!(row, at(B, 0));
    assert_eq!(e.reason, "cache_row_over_kv_capacity_least_loaded");
    let backlog = policy(r#"{"kv_capacity_limit": 1.0, "load_signal": "prefill_backlog"}"#);
    let (row, e) = capacity_decision(&backlog, &rows, &request());
    assert_eq!(row, at(C, 0));
    assert_eq!(e.reason, "cache_row_over_kv_capacity_least_loaded");
}

#[test]
fn kv_capacity_column_reaches_the_exported_adapter() {
    let boxed = create_boxed::<TwoTierCostFnType>(LIMIT).expect("valid parameters");
    let rows = with_capacity(&over_full_cache_row());
    let picked = rows.pick_through_abi(&boxed, &request()).ok();
    assert_eq!(picked.map(|i| rows.row(i)), Some(at(C, 0)));
}

// With respect_soft_affinity, the rule runs inside each tier run: in G over all rows and in K
// over the target's rows. K is kept (unless the active-request gate releases it), so the rule
// moves a request only between the target's own rows.

const RESPECT_LIMIT: &str = r#"{"respect_soft_affinity": true, "kv_capacity_limit": 1.0}"#;

#[test]
fn kv_capacity_limit_moves_a_worker_target_to_another_of_its_ranks() {
    // K over A's ranks: the cache tier fires on A:0 (0.8), which is over its limit; A:1 is the
    // least-loaded rank of A and under it. B (idle, under its limit) is not considered.
    let rows = [
        (
            TestRow::new(A, 0).device(8.0).active(3).decode_blocks(99),
            100.0,
        ),
        (TestRow::new(A, 1).active(1).decode_blocks(0), 100.0),
        (TestRow::new(B, 0).active(0).decode_blocks(0), 100.0),
    ];
    let request = request().target(A, None);
    let (row, e) = capacity_decision(&policy(RESPECT_LIMIT), &rows, &request);
    assert_eq!(row, at(A, 1));
    assert_eq!(e.reason, "soft_affinity_target");
    assert_eq!(e.get_label("soft_affinity"), Some("kept"));
    assert_eq!(
        e.get_label("tier"),
        Some("cache_row_over_kv_capacity_least_loaded")
    );
    assert_eq!(e.get_label("target_row"), Some("29:1"));
    assert_eq!(e.get("target_active_requests"), Some(1.0));
    // Without the limit K keeps the cache row.
    let (row, _) = capacity_decision(&policy(RESPECT), &rows, &request);
    assert_eq!(row, at(A, 0));
}

#[test]
fn kv_capacity_limit_releases_a_target_whose_row_would_overfill() {
    // The target has one row: it is both K's cache row and K's only row, so the rule cannot
    // move the request inside K. K's row is over its limit and G's (B) is not: the target is
    // released, with or without the active-request gate (which does not fire: 3 against 0 is
    // within its defaults).
    let rows = [
        (booked(A, 8.0, 3, 99), 100.0),
        (booked(B, 0.0, 0, 0), 100.0),
    ];
    for params in [
        RESPECT_LIMIT,
        r#"{"respect_soft_affinity": true, "soft_affinity_load_gate": true, "kv_capacity_limit": 1.0}"#,
    ] {
        for request in [request().target(A, None), request().target(A, Some(0))] {
            let (row, e) = capacity_decision(&policy(params), &rows, &request);
            assert_eq!(row, at(B, 0), "{params} {request:?}");
            assert_eq!(e.reason, "soft_affinity_released_kv_capacity");
            assert_eq!(
                e.get_label("soft_affinity"),
                Some("released_by_kv_capacity")
            );
            assert_eq!(
                e.get_label("tier"),
                Some("cache_row_over_kv_capacity_least_loaded")
            );
            assert_eq!(e.get_label("target_row"), Some("29:0"));
        }
    }
    // Without the limit the target is kept, however full.
    let (row, e) = capacity_decision(&policy(RESPECT), &rows, &request().target(A, None));
    assert_eq!(row, at(A, 0));
    assert_eq!(e.reason, "soft_affinity_target");
    // Kept when G's row would overfill too (every row is over: nothing better to go to), and
    // while the target's row has room.
    for (a_booked, b_booked) in [(95, 95), (50, 0)] {
        let rows = [
            (booked(A, 8.0, 3, a_booked), 100.0),
            (booked(B, 0.0, 0, b_booked), 100.0),
        ];
        let (row, e) = capacity_decision(&policy(RESPECT_LIMIT), &rows, &request().target(A, None));
        assert_eq!(row, at(A, 0), "A {a_booked}, B {b_booked}");
        assert_eq!(e.reason, "soft_affinity_target");
        assert_eq!(e.get_label("soft_affinity"), Some("kept"));
    }
    // G over all rows does move it: a new session (no target yet) goes to B.
    let (row, e) = capacity_decision(&policy(RESPECT_LIMIT), &rows, &request());
    assert_eq!(row, at(B, 0));
    assert_eq!(e.reason, "cache_row_over_kv_capacity_least_loaded");
    assert_eq!(e.get_label("soft_affinity"), Some("none"));
}

#[test]
fn kv_capacity_limit_applies_when_the_target_has_no_eligible_row() {
    let (row, e) = capacity_decision(
        &policy(RESPECT_LIMIT),
        &over_full_cache_row(),
        &request().target(999, None),
    );
    assert_eq!(row, at(C, 0));
    assert_eq!(e.reason, "cache_row_over_kv_capacity_least_loaded");
    assert_eq!(e.get_label("soft_affinity"), Some("not_eligible"));
}

#[test]
fn kv_capacity_limit_must_be_finite_and_positive() {
    for (json, value) in [
        (r#"{"kv_capacity_limit": 0}"#, "0"),
        (r#"{"kv_capacity_limit": 0.0}"#, "0"),
        (r#"{"kv_capacity_limit": -1.5}"#, "-1.5"),
    ] {
        assert_names(&invalid(json), "kv_capacity_limit", "> 0.0", value);
    }
    // JSON has no NaN or infinity; a host or a linked caller can still pass them.
    for (limit, value) in [
        (f64::NAN, "NaN"),
        (f64::INFINITY, "inf"),
        (f64::NEG_INFINITY, "-inf"),
    ] {
        let params = TwoTierParams {
            kv_capacity_limit: Some(limit),
            ..TwoTierParams::default()
        };
        let err = TwoTierCostFn::new(&params, 0.75).expect_err("rejected");
        assert_names(&err, "kv_capacity_limit", "> 0.0", value);
    }
    let err = invalid(r#"{"kv_capacity_limit": "high"}"#);
    assert_eq!(err.key(), "kv_capacity_limit", "{err}");

    assert_eq!(
        policy(r#"{"kv_capacity_limit": 1.5}"#)
            .params()
            .kv_capacity_limit,
        Some(1.5)
    );
    assert_eq!(
        policy(r#"{"kv_capacity_limit": 1e-9}"#)
            .params()
            .kv_capacity_limit,
        Some(1e-9)
    );
    // null is absent: off.
    assert_eq!(policy(r#"{"kv_capacity_limit": null}"#), policy(DEFAULTS));
}

#[test]
fn explanation_reports_the_kv_capacity_limit_in_force() {
    let rows = [row(A, 0.0, 0.0, 0), row(B, 6.0, 0.0, 4)];
    let e = explained(&policy(r#"{"kv_capacity_limit": 1.5}"#), &rows, &request());
    assert_eq!(e.get("kv_capacity_limit"), Some(1.5));
    assert_eq!(e.reason, "cache_tier_least_loaded_among_max_overlap");
    let e = explained(&policy(DEFAULTS), &rows, &request());
    assert_eq!(e.get("kv_capacity_limit"), None);
}

#[test]
fn a_row_over_the_limit_keeps_the_request_unless_moving_throws_away_less_cache() {
    // A caches 6 blocks of the prompt, B none. Over by 5 (95 + 10 - 100): moving throws away
    // 6 blocks to spare 5, so the request stays; over by 6, a tie, it stays; over by 7 it moves.
    for (decode, over, moves) in [(95, 5, false), (96, 6, false), (97, 7, true)] {
        let rows = [
            (booked(A, 6.0, 4, decode), 100.0),
            (booked(B, 0.0, 0, 0), 100.0),
        ];
        let (row, e) = capacity_decision(&policy(LIMIT), &rows, &request());
        let expected = if moves { at(B, 0) } else { at(A, 0) };
        assert_eq!(row, expected, "over by {over}");
        let reason = if moves {
            "cache_row_over_kv_capacity_least_loaded"
        } else {
            "cache_tier_least_loaded_among_max_overlap"
        };
        assert_eq!(e.reason, reason, "over by {over}");
    }
    // The same comparison releases a soft target: 8 blocks cached on the target, 5 over, stays.
    let rows = [
        (booked(A, 8.0, 3, 95), 100.0),
        (booked(B, 0.0, 0, 0), 100.0),
    ];
    let (row, e) = capacity_decision(&policy(RESPECT_LIMIT), &rows, &request().target(A, None));
    assert_eq!(row, at(A, 0));
    assert_eq!(e.get_label("soft_affinity"), Some("kept"));
}
