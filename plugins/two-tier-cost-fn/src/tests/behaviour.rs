//! Parameter documentation, determinism, explanations, edge cases and the construction log.

use super::*;

/// The keys the parser accepts, from its own unknown-key error.
fn accepted_keys() -> Vec<String> {
    let err = invalid(r#"{"no_such_parameter": 0}"#);
    let message = err.message();
    let expected = message
        .split_once("expected one of")
        .map(|(_, rest)| rest)
        .unwrap_or_else(|| panic!("no key list in `{message}`"));
    expected
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_parameter_is_documented_for_describe_and_in_the_policy_doc() {
    let documented: Vec<String> = TwoTierCostFnType::parameters()
        .into_iter()
        .map(|doc| doc.name)
        .collect();
    let mut accepted = accepted_keys();
    assert!(
        accepted.contains(&"kv_capacity_limit".to_owned()),
        "{accepted:?}"
    );
    accepted.sort();
    let mut sorted = documented.clone();
    sorted.sort();
    assert_eq!(
        sorted, accepted,
        "describe must list exactly the accepted keys"
    );

    let doc = include_str!("../../../../docs/policies/two-tier-cost-fn.md");
    for name in &documented {
        assert!(
            doc.contains(&format!("| `{name}` |")),
            "docs/policies/two-tier-cost-fn.md has no Parameters row for `{name}`"
        );
    }
    let limit = TwoTierCostFnType::parameters()
        .into_iter()
        .find(|doc| doc.name == "kv_capacity_limit")
        .expect("kv_capacity_limit is documented");
    assert_eq!(limit.type_name, "f64 or absent");
    assert!(limit.meaning.contains("> 0.0"), "{}", limit.meaning);
    for reason in [
        "load_imbalance_least_loaded",
        "cache_tier_least_loaded_among_max_overlap",
        "cache_row_over_kv_capacity_least_loaded",
        "least_loaded_no_cache_winner",
        "soft_affinity_target",
        "soft_affinity_released_load_gate",
    ] {
        assert!(
            doc.contains(&format!("| `{reason}` |")),
            "the Explanation table of the doc has no row for `{reason}`"
        );
    }
}

// ---- determinism --------------------------------------------------------------------------------

#[test]
fn row_order_does_not_change_the_pick() {
    // Ties everywhere: equal overlap, equal load, several ranks per worker.
    let rows = [
        TestRow::new(B, 1).device(7.0).active(2),
        TestRow::new(A, 1).device(7.0).active(2),
        TestRow::new(B, 0).device(7.0).active(2),
        TestRow::new(A, 2).device(3.0).active(1),
        TestRow::new(A, 0).device(7.0).active(2),
        TestRow::new(77, 0).active(1),
    ];
    let cases = [
        (LOWEST_ROW, request(), at(A, 0)), // cache tier: lowest id among best, equal load
        (LOWEST_ROW, TestRequest::new(1600, 16), at(A, 2)), // no cache winner: least-loaded, lowest id
        (RESPECT_LOWEST_ROW, request().target(B, None), at(B, 0)),
        (RESPECT_LOWEST_ROW, request().target(A, Some(2)), at(A, 2)),
    ];
    for (params, request, expected) in cases {
        let policy = policy(params);
        for order in orders(&rows) {
            assert_eq!(
                picked(&policy, &order, &request),
                expected,
                "{params} {order:?}"
            );
        }
    }
    // Spread (the default): the same request picks the same row in every order, one of the rows
    // tied for it.
    let tied_for_cache = [at(A, 0), at(A, 1), at(B, 0), at(B, 1)];
    let cases = [
        (DEFAULTS, request(), &tied_for_cache[..]),
        // No cache winner: with the default prefill backlog the rows caching 7 blocks have the
        // least to prefill; with active requests the two rows running one request tie.
        (DEFAULTS, TestRequest::new(1600, 16), &tied_for_cache[..]),
        (
            ACTIVE,
            TestRequest::new(1600, 16),
            &[at(A, 2), at(77, 0)][..],
        ),
        (
            RESPECT,
            request().target(B, None),
            &[at(B, 0), at(B, 1)][..],
        ),
        (RESPECT, request().target(A, Some(2)), &[at(A, 2)][..]),
    ];
    for (params, request, tied) in cases {
        let policy = policy(params);
        let first = picked(&policy, &rows, &request);
        assert!(tied.contains(&first), "{params}: {first:?} not in {tied:?}");
        for order in orders(&rows) {
            assert_eq!(
                picked(&policy, &order, &request),
                first,
                "{params} {order:?}"
            );
        }
    }
}

// ---- explanations -------------------------------------------------------------------------------

#[test]
fn explanation_of_the_cache_tier_reports_thresholds_and_overlap() {
    let rows = [row(A, 0.0, 0.0, 0), row(B, 6.0, 0.0, 4)];
    let e = explained(&policy(DEFAULTS), &rows, &request());
    assert_eq!(e.reason, "cache_tier_least_loaded_among_max_overlap");
    for (name, value) in [
        ("cache_threshold", 0.5),
        ("balance_abs_threshold", 32.0),
        ("balance_rel_threshold", 1.1),
        ("host_cache_weight", 0.75),
        ("cache_ratio", 0.6),
        ("max_effective_overlap", 6.0),
        ("min_active_requests", 0.0),
        ("max_active_requests", 4.0),
    ] {
        assert_eq!(e.get(name), Some(value), "{name}");
    }
    assert_eq!(e.get_label("max_overlap_row"), Some("41:0"));
    assert_eq!(e.get_label("soft_affinity"), Some("none"));
    assert_eq!(e.get("target_active_requests"), None);
}

#[test]
fn explanation_of_the_load_tier() {
    let rows = [row(A, 0.0, 0.0, 0), row(B, 10.0, 0.0, 40)];
    let e = explained(&policy(DEFAULTS), &rows, &request());
    assert_eq!(e.reason, "load_imbalance_least_loaded");
    assert_eq!(e.get("max_active_requests"), Some(40.0));
    assert_eq!(e.get("cache_ratio"), Some(1.0));
}

#[test]
fn explanation_of_least_loaded_without_cache_winner() {
    let rows = [row(A, 0.0, 0.0, 0), row(B, 5.0, 0.0, 4)];
    let e = explained(&policy(DEFAULTS), &rows, &request());
    assert_eq!(e.reason, "least_loaded_no_cache_winner");
    assert_eq!(e.get("cache_ratio"), Some(0.5));
}

#[test]
fn explanation_of_a_kept_and_a_released_target() {
    let rows = [row(A, 0.0, 0.0, 40), row(B, 0.0, 0.0, 2)];
    let request = request().target(A, None);

    let kept = explained(&policy(RESPECT), &rows, &request);
    assert_eq!(kept.reason, "soft_affinity_target");
    assert_eq!(kept.get_label("soft_affinity"), Some("kept"));
    assert_eq!(kept.get("target_active_requests"), Some(40.0));

    let released = explained(&policy(RESPECT_GATE), &rows, &request);
    assert_eq!(released.reason, "soft_affinity_released_load_gate");
    assert_eq!(
        released.get_label("soft_affinity"),
        Some("released_by_gate")
    );
    assert_eq!(
        released.get_label("tier"),
        Some("load_imbalance_least_loaded")
    );
}

#[test]
fn explanation_when_the_target_is_absent() {
    let rows = [row(A, 0.0, 0.0, 0), row(B, 6.0, 0.0, 4)];
    let e = explained(&policy(RESPECT), &rows, &request().target(999, None));
    assert_eq!(e.reason, "cache_tier_least_loaded_among_max_overlap");
    assert_eq!(e.get_label("soft_affinity"), Some("not_eligible"));
}

// ---- edge cases ---------------------------------------------------------------------------------

#[test]
fn a_request_without_blocks_has_no_cache_winner() {
    let rows = [row(A, 0.0, 0.0, 0), row(B, 6.0, 0.0, 4)];
    let e = explained(&policy(DEFAULTS), &rows, &TestRequest::new(0, 16));
    assert_eq!(e.row, 0);
    assert_eq!(e.get("cache_ratio"), Some(0.0));
}

#[test]
fn nan_overlap_counts_as_nothing_cached() {
    let rows = [row(A, f64::NAN, 0.0, 0), row(B, 6.0, 0.0, 4)];
    assert_eq!(picked(&policy(DEFAULTS), &rows, &request()), at(B, 0));
    let rows = [row(A, 0.0, 0.0, 0), row(B, f64::NAN, 0.0, 4)];
    assert_eq!(picked(&policy(DEFAULTS), &rows, &request()), at(A, 0));
}

#[test]
fn zero_rows_is_an_error() {
    let err = TestRows::new(vec![])
        .pick(&policy(DEFAULTS), &request())
        .expect_err("no rows");
    assert!(err.message().contains("no rows"), "{err}");
    assert!(TestRows::new(vec![])
        .explain(&policy(DEFAULTS), &request())
        .is_none());
}

#[test]
fn exported_adapter_picks_and_reports_errors_without_panicking() {
    let boxed = create_boxed::<TwoTierCostFnType>(DEFAULTS).expect("valid parameters");
    let rows = TestRows::new(vec![row(A, 0.0, 0.0, 0), row(B, 6.0, 0.0, 4)]);
    let picked = rows.pick_through_abi(&boxed, &request()).ok();
    assert_eq!(picked.map(|i| rows.row(i)), Some(at(B, 0)));

    let failure = TestRows::new(vec![])
        .pick_through_abi(&boxed, &request())
        .expect_err("no rows");
    assert_eq!(failure.kind, PickFailureKind::FAILED);
    // An error is not a panic: the instance keeps working.
    assert_eq!(rows.pick_through_abi(&boxed, &request()).ok(), Some(1));
}

// ---- construction log ---------------------------------------------------------------------------

#[test]
fn construction_logs_resolved_parameters_once() {
    let events = creation_log(r#"{"balance_abs_threshold": 8}"#, 0.5);
    assert_eq!(events.len(), 1, "{events:?}");
    for part in [
        "instance=test",
        "cache_threshold=0.5",
        "balance_abs_threshold=8",
        "balance_rel_threshold=1.1",
        "host_cache_weight=0.5",
        "host_cache_weight_source=host setting",
        "respect_soft_affinity=false",
        "soft_affinity_load_gate=false",
        "soft_affinity_gate_abs=8",
        "soft_affinity_gate_rel=1.1",
    ] {
        assert!(
            events[0].contains(part),
            "`{}` should contain `{part}`",
            events[0]
        );
    }
    let events = creation_log(r#"{"host_cache_weight": 0.25}"#, 0.5);
    assert!(
        events[0].contains("host_cache_weight=0.25"),
        "{}",
        events[0]
    );
    assert!(
        events[0].contains("host_cache_weight_source=policy"),
        "{}",
        events[0]
    );
}

#[test]
fn construction_logs_kv_capacity_limit_off_or_its_value() {
    let events = creation_log(DEFAULTS, 0.75);
    assert!(events[0].contains("kv_capacity_limit=off"), "{}", events[0]);
    let events = creation_log(r#"{"kv_capacity_limit": 1.5}"#, 0.75);
    assert!(events[0].contains("kv_capacity_limit=1.5"), "{}", events[0]);
    let events = creation_log(r#"{"kv_capacity_limit": 1}"#, 0.75);
    assert!(events[0].contains("kv_capacity_limit=1.0"), "{}", events[0]);
}

#[test]
fn the_cache_gate_releases_a_target_another_row_caches_more_of_the_prompt_than() {
    // Target A caches 2 blocks of the prompt, B 6: staying would prefill what B holds.
    let rows = [row(A, 2.0, 0.0, 0), row(B, 6.0, 0.0, 0)];
    let request = request().target(A, None);
    let gate = policy(r#"{"respect_soft_affinity": true}"#);
    assert!(gate.params().soft_affinity_cache_gate, "on by default");
    for order in orders(&rows) {
        assert_eq!(picked(&gate, &order, &request), at(B, 0));
        let e = explained(&gate, &order, &request);
        assert_eq!(e.reason, "soft_affinity_released_cache");
        assert_eq!(e.get_label("soft_affinity"), Some("released_by_cache"));
        assert_eq!(picked(&policy(RESPECT), &order, &request), at(A, 0));
    }
    // As much cached on the target (or nothing anywhere): kept.
    for rows in [
        [row(A, 6.0, 0.0, 0), row(B, 6.0, 0.0, 0)],
        [row(A, 0.0, 0.0, 0), row(B, 0.0, 0.0, 0)],
    ] {
        let e = explained(&gate, &rows, &request);
        assert_eq!(e.get_label("soft_affinity"), Some("kept"), "{rows:?}");
        assert_eq!(TestRows::new(rows.to_vec()).row(e.row), at(A, 0));
    }
}
