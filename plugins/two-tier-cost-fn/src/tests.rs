use plugin_api::abi::PickFailureKind;
use plugin_api::testing::{create, create_boxed, create_with, TestRequest, TestRow, TestRows};
use plugin_api::{Explanation, RowId};

use super::*;

const A: u64 = 29;
const B: u64 = 41;
const DEFAULTS: &str = "{}";
const RESPECT: &str = r#"{"respect_soft_affinity": true}"#;
const RESPECT_GATE: &str = r#"{"respect_soft_affinity": true, "soft_affinity_load_gate": true}"#;

/// isl 160 at block size 16: R = 10.
fn request() -> TestRequest {
    TestRequest::new(160, 16)
}

fn policy(json: &str) -> TwoTierCostFn {
    create::<TwoTierCostFnType>(json).expect("valid parameters")
}

/// A rank-0 row written as in the design table: (worker, device, host, active).
fn row(worker: u64, device: f64, host: f64, active: u64) -> TestRow {
    TestRow::new(worker, 0)
        .device(device)
        .host(host)
        .active(active)
}

fn picked(policy: &TwoTierCostFn, rows: &[TestRow], request: &TestRequest) -> RowId {
    TestRows::new(rows.to_vec())
        .pick_worker(policy, request)
        .expect("a row is picked")
}

fn explained(policy: &TwoTierCostFn, rows: &[TestRow], request: &TestRequest) -> Explanation {
    let rows = TestRows::new(rows.to_vec());
    let explanation = rows.explain(policy, request).expect("an explanation");
    // explain describes exactly the row pick returns.
    assert_eq!(Ok(explanation.row), rows.pick(policy, request));
    explanation
}

fn at(worker_id: u64, dp_rank: u32) -> RowId {
    RowId { worker_id, dp_rank }
}

// ---- conformance table of docs/policies/two-tier-cost-fn.md ------------------------------------------------------------

struct Case {
    params: &'static str,
    target: Option<u64>,
    rows: [(u64, f64, f64, u64); 2],
    picks: u64,
    why: &'static str,
}

#[rustfmt::skip]
const CONFORMANCE: &[Case] = &[
    Case { params: DEFAULTS, target: None, rows: [(A, 0.0, 0.0, 0), (B, 6.0, 0.0, 4)], picks: B, why: "0.6 > 0.5" },
    Case { params: DEFAULTS, target: None, rows: [(A, 0.0, 0.0, 0), (B, 5.0, 0.0, 4)], picks: A, why: "0.5 is not > 0.5" },
    Case { params: r#"{"cache_threshold": 0.2}"#, target: None, rows: [(A, 0.0, 0.0, 0), (B, 3.0, 0.0, 4)], picks: B, why: "0.3 > 0.2" },
    Case { params: DEFAULTS, target: None, rows: [(A, 0.0, 0.0, 0), (B, 10.0, 0.0, 40)], picks: A, why: "load tier" },
    Case { params: DEFAULTS, target: None, rows: [(A, 0.0, 0.0, 640), (B, 10.0, 0.0, 704)], picks: B, why: "704 is not > 1.1*640" },
    Case { params: DEFAULTS, target: None, rows: [(A, 0.0, 0.0, 640), (B, 10.0, 0.0, 705)], picks: A, why: "705 > 1.1*640" },
    Case { params: DEFAULTS, target: None, rows: [(A, 0.0, 0.0, 0), (B, 0.0, 8.0, 4)], picks: B, why: "8*0.75 = 6 -> 0.6" },
    Case { params: r#"{"host_cache_weight": 0}"#, target: None, rows: [(A, 0.0, 0.0, 0), (B, 0.0, 8.0, 4)], picks: A, why: "host tier ignored" },
    Case { params: DEFAULTS, target: Some(A), rows: [(A, 0.0, 0.0, 0), (B, 6.0, 0.0, 4)], picks: B, why: "target ignored by default" },
    Case { params: RESPECT, target: Some(A), rows: [(A, 0.0, 0.0, 0), (B, 6.0, 0.0, 4)], picks: A, why: "target respected" },
    Case { params: RESPECT, target: Some(999), rows: [(A, 0.0, 0.0, 0), (B, 6.0, 0.0, 4)], picks: B, why: "fallback" },
    Case { params: RESPECT, target: Some(A), rows: [(A, 0.0, 0.0, 40), (B, 0.0, 0.0, 2)], picks: A, why: "no gate: overloaded target kept" },
    Case { params: RESPECT_GATE, target: Some(A), rows: [(A, 0.0, 0.0, 40), (B, 0.0, 0.0, 2)], picks: B, why: "released" },
    Case { params: RESPECT_GATE, target: Some(A), rows: [(A, 0.0, 0.0, 30), (B, 0.0, 0.0, 2)], picks: A, why: "gap 28 is not > 32" },
];

#[test]
fn conformance_table_of_the_design() {
    for (n, case) in CONFORMANCE.iter().enumerate() {
        let policy = policy(case.params);
        let request = match case.target {
            Some(worker) => request().target(worker, None),
            None => request(),
        };
        let rows: Vec<TestRow> = case
            .rows
            .iter()
            .map(|&(w, device, host, active)| row(w, device, host, active))
            .collect();
        let mut reversed = rows.clone();
        reversed.reverse();
        for rows in [rows, reversed] {
            assert_eq!(
                picked(&policy, &rows, &request),
                at(case.picks, 0),
                "case {n} ({}, {})",
                case.params,
                case.why
            );
        }
    }
}

// ---- validation ---------------------------------------------------------------------------------

fn invalid(json: &str) -> CreateError {
    create::<TwoTierCostFnType>(json).expect_err("parameters must be rejected")
}

/// The error names `key`, the valid range and the bad value.
fn assert_names(err: &CreateError, key: &str, range: &str, value: &str) {
    assert_eq!(err.key(), key, "{err}");
    let text = err.to_string();
    for part in [key, range, value] {
        assert!(text.contains(part), "`{text}` should mention `{part}`");
    }
}

#[test]
fn cache_threshold_out_of_range_is_rejected() {
    assert_names(
        &invalid(r#"{"cache_threshold": -0.1}"#),
        "cache_threshold",
        "0.0..=1.0",
        "-0.1",
    );
    assert_names(
        &invalid(r#"{"cache_threshold": 1.1}"#),
        "cache_threshold",
        "0.0..=1.0",
        "1.1",
    );
}

#[test]
fn nan_thresholds_are_rejected() {
    let nan_cache = TwoTierParams {
        cache_threshold: f64::NAN,
        ..TwoTierParams::default()
    };
    let err = nan_cache.validate(0.75).expect_err("NaN cache_threshold");
    assert_names(&err, "cache_threshold", "0.0..=1.0", "NaN");

    let nan_rel = TwoTierParams {
        balance_rel_threshold: f64::NAN,
        ..TwoTierParams::default()
    };
    let err = TwoTierCostFn::new(&nan_rel, 0.75).expect_err("NaN balance_rel_threshold");
    assert_names(&err, "balance_rel_threshold", ">= 1.0", "NaN");

    let nan_gate = TwoTierParams {
        soft_affinity_gate_rel: Some(f64::NAN),
        ..TwoTierParams::default()
    };
    let err = nan_gate
        .validate(0.75)
        .expect_err("NaN soft_affinity_gate_rel");
    assert_names(&err, "soft_affinity_gate_rel", ">= 1.0", "NaN");
}

#[test]
fn balance_rel_threshold_below_one_is_rejected() {
    assert_names(
        &invalid(r#"{"balance_rel_threshold": 0.9}"#),
        "balance_rel_threshold",
        ">= 1.0",
        "0.9",
    );
}

#[test]
fn negative_host_cache_weight_is_rejected() {
    assert_names(
        &invalid(r#"{"host_cache_weight": -0.1}"#),
        "host_cache_weight",
        ">= 0.0",
        "-0.1",
    );
}

#[test]
fn soft_affinity_gate_rel_below_one_is_rejected() {
    assert_names(
        &invalid(r#"{"soft_affinity_gate_rel": 0.5}"#),
        "soft_affinity_gate_rel",
        ">= 1.0",
        "0.5",
    );
}

#[test]
fn unknown_key_is_rejected_by_name() {
    let err = invalid(r#"{"cache_affinity_threshold": 0.5}"#);
    assert!(
        err.to_string().contains("cache_affinity_threshold"),
        "{err}"
    );
    // plugin-api 1.0.0 doubles the key (`cache_affinity_threshold.cache_affinity_threshold`);
    // accept both that and the fixed spelling.
    assert!(err.key().ends_with("cache_affinity_threshold"), "{err}");
}

#[test]
fn mistyped_value_is_rejected_by_name() {
    let err = invalid(r#"{"balance_abs_threshold": -1}"#);
    assert_eq!(err.key(), "balance_abs_threshold", "{err}");
}

#[test]
fn invalid_host_setting_is_blamed_on_the_host_not_a_policy_key() {
    let err =
        create_with::<TwoTierCostFnType>(DEFAULTS, f64::NAN, 16).expect_err("NaN host weight");
    assert_eq!(err.key(), "");
    assert!(err.message().contains("host_cache_hit_weight"), "{err}");
    // A policy value overrides the broken host setting.
    assert!(
        create_with::<TwoTierCostFnType>(r#"{"host_cache_weight": 0.5}"#, f64::NAN, 16).is_ok()
    );
}

#[test]
fn defaults_are_resolved_per_the_design() {
    let p = *policy(DEFAULTS).params();
    assert_eq!(
        p,
        ResolvedParams {
            cache_threshold: 0.5,
            balance_abs_threshold: 32,
            balance_rel_threshold: 1.1,
            host_cache_weight: 0.75,
            host_cache_weight_source: WeightSource::HostSetting,
            respect_soft_affinity: false,
            soft_affinity_load_gate: false,
            soft_affinity_gate_abs: 32,
            soft_affinity_gate_rel: 1.1,
            load_signal: LoadSignal::ActiveRequests,
            kv_capacity_limit: None,
        }
    );
}

#[test]
fn gate_thresholds_default_to_the_balance_thresholds_in_force() {
    let p = *policy(r#"{"balance_abs_threshold": 5, "balance_rel_threshold": 2.0}"#).params();
    assert_eq!(
        (p.soft_affinity_gate_abs, p.soft_affinity_gate_rel),
        (5, 2.0)
    );
    let p = *policy(r#"{"balance_abs_threshold": 5, "soft_affinity_gate_abs": 7, "soft_affinity_gate_rel": 3.0}"#)
        .params();
    assert_eq!(
        (p.soft_affinity_gate_abs, p.soft_affinity_gate_rel),
        (7, 3.0)
    );
}

// ---- host_cache_weight source -------------------------------------------------------------------

#[test]
fn host_cache_weight_defaults_to_the_host_setting() {
    let rows = [row(A, 0.0, 0.0, 0), row(B, 0.0, 8.0, 4)];
    let ignoring_host_tier = create_with::<TwoTierCostFnType>(DEFAULTS, 0.0, 16).unwrap();
    assert_eq!(ignoring_host_tier.params().host_cache_weight, 0.0);
    assert_eq!(picked(&ignoring_host_tier, &rows, &request()), at(A, 0));

    let crediting_host_tier = create_with::<TwoTierCostFnType>(DEFAULTS, 0.75, 16).unwrap();
    assert_eq!(crediting_host_tier.params().host_cache_weight, 0.75);
    assert_eq!(picked(&crediting_host_tier, &rows, &request()), at(B, 0));
}

#[test]
fn policy_host_cache_weight_overrides_the_host_setting() {
    let policy =
        create_with::<TwoTierCostFnType>(r#"{"host_cache_weight": 0.75}"#, 0.0, 16).unwrap();
    assert_eq!(
        policy.params().host_cache_weight_source,
        WeightSource::Policy
    );
    let rows = [row(A, 0.0, 0.0, 0), row(B, 0.0, 8.0, 4)];
    assert_eq!(picked(&policy, &rows, &request()), at(B, 0));
}

// ---- data-parallel ranks and soft targets ------------------------------------------------------

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

// ---- load_signal: prefill_backlog ---------------------------------------------------------------

const BACKLOG: &str = r#"{"load_signal": "prefill_backlog"}"#;

/// `(worker, device, active, active_prefill_tokens)`.
fn loaded(worker: u64, device: f64, active: u64, prefill: u64) -> TestRow {
    TestRow::new(worker, 0)
        .device(device)
        .active(active)
        .prefill_tokens(prefill)
}

struct BacklogCase {
    rows: [(u64, f64, u64, u64); 2],
    /// The pick with the default `active_requests` signal, then with `prefill_backlog`.
    active_requests: u64,
    prefill_backlog: u64,
    why: &'static str,
}

// isl 160 at block size 16 (R = 10): a row's backlog is its active_prefill_tokens plus
// 160 - 16 * device.
#[rustfmt::skip]
const BACKLOG_CASES: &[BacklogCase] = &[
    BacklogCase { rows: [(A, 0.0, 0, 1000), (B, 0.0, 3, 0)], active_requests: A, prefill_backlog: B, why: "fallback tier: 1160 > 160 tokens" },
    BacklogCase { rows: [(A, 0.0, 0, 100), (B, 0.0, 3, 100)], active_requests: A, prefill_backlog: A, why: "equal backlog: fewer active requests" },
    BacklogCase { rows: [(A, 4.0, 2, 0), (B, 0.0, 1, 0)], active_requests: B, prefill_backlog: A, why: "0.4 is no cache winner, but 96 < 160 tokens" },
    BacklogCase { rows: [(A, 6.0, 1, 800), (B, 6.0, 4, 0)], active_requests: A, prefill_backlog: B, why: "cache tier among equal overlap: 864 > 64" },
    BacklogCase { rows: [(A, 0.0, 0, 0), (B, 6.0, 4, 5000)], active_requests: B, prefill_backlog: B, why: "cache tier still goes to the best overlap" },
    BacklogCase { rows: [(A, 0.0, 40, 0), (B, 0.0, 0, 5000)], active_requests: B, prefill_backlog: B, why: "load tier compares active requests" },
];

#[test]
fn prefill_backlog_changes_only_what_least_loaded_means() {
    for (n, case) in BACKLOG_CASES.iter().enumerate() {
        let rows: Vec<TestRow> = case
            .rows
            .iter()
            .map(|&(w, device, active, prefill)| loaded(w, device, active, prefill))
            .collect();
        for (params, expected) in [
            (DEFAULTS, case.active_requests),
            (BACKLOG, case.prefill_backlog),
        ] {
            let policy = policy(params);
            for order in orders(&rows) {
                assert_eq!(
                    picked(&policy, &order, &request()).worker_id,
                    expected,
                    "case {n} ({}) with {params}",
                    case.why
                );
            }
        }
    }
}

#[test]
fn prefill_backlog_is_resolved_logged_and_spelled() {
    assert_eq!(
        policy(BACKLOG).params().load_signal,
        LoadSignal::PrefillBacklog
    );
    assert_eq!(
        policy(r#"{"load_signal": "active_requests"}"#),
        policy(DEFAULTS)
    );
    let err = invalid(r#"{"load_signal": "tokens"}"#);
    assert_eq!(err.key(), "load_signal");
    assert!(
        err.message().contains("active_requests") && err.message().contains("prefill_backlog"),
        "{}",
        err.message()
    );
    let logs = creation_log(BACKLOG, 0.75);
    assert!(
        logs.iter()
            .any(|l| l.contains("load_signal=prefill_backlog")),
        "{logs:?}"
    );
}

#[test]
fn prefill_backlog_saturates_and_ignores_nan_overlap() {
    let policy = policy(BACKLOG);
    // A backlog at u64::MAX does not wrap to "idle"; a NaN overlap caches nothing.
    let rows = [
        loaded(A, 0.0, 0, u64::MAX),
        TestRow::new(B, 0).device(f64::NAN).active(5),
    ];
    assert_eq!(picked(&policy, &rows, &request()).worker_id, B);
    // Overlap beyond the prompt leaves no prompt tokens (no underflow): among equal best
    // overlap, A's 10 pending tokens lose to B's none, though B runs more requests.
    let rows = [loaded(A, 99.0, 0, 10), loaded(B, 99.0, 3, 0)];
    assert_eq!(picked(&policy, &rows, &request()).worker_id, B);
}

// ---- kv_capacity_limit --------------------------------------------------------------------------

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
/// has 95 decode blocks booked (95 + 10 > 100); C is the least-loaded row (1 active) at
/// 30 + 10 <= 100; B runs 2.
fn over_full_cache_row() -> [(TestRow, f64); 3] {
    [
        (booked(A, 6.0, 4, 95), 100.0),
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
        (booked(A, 6.0, 4, 95), 100.0),
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
        (booked(A, 6.0, 4, 95), 100.0),
        (booked(B, 0.0, 0, 91), 100.0),
        (booked(C, 0.0, 3, 0), 100.0),
        (booked(D, 0.0, 5, 0), 100.0),
    ];
    let (row, e) = capacity_decision(&policy(LIMIT), &rows, &request());
    assert_eq!(row, at(C, 0));
    assert_eq!(e.reason, "cache_row_over_kv_capacity_least_loaded");
    // With `prefill_backlog` the order among the rows with room is by backlog: D has none.
    let rows = [
        (booked(A, 6.0, 4, 95), 100.0),
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
    // Booked + R exactly at limit * capacity is not over it; one block more is.
    for (limit, at_limit) in [(1.0, 90), (1.5, 140), (0.5, 40)] {
        let policy = policy(&format!(r#"{{"kv_capacity_limit": {limit}}}"#));
        let rows = |decode: u64| {
            [
                (booked(A, 6.0, 4, decode), 100.0),
                (booked(B, 0.0, 0, 0), 100.0),
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
        (booked(A, 6.0, 4, 95), 100.0),
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
        (booked(A, 6.0, 4, 95), 100.0),
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
        (booked(A, 5.0, 0, 95), 100.0),
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
        (booked(A, 5.0, 0, 95), 100.0),
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
        (booked(A, 6.0, 1, 95).prefill_tokens(1000), 100.0),
        (booked(B, 0.0, 0, 0).prefill_tokens(5000), 100.0),
        (booked(C, 0.0, 3, 0), 100.0),
    ];
    let (row, e) = capacity_decision(&policy(LIMIT), &rows, &request());
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
            TestRow::new(A, 0).device(8.0).active(3).decode_blocks(95),
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
        (booked(A, 8.0, 3, 95), 100.0),
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

// ---- parameter documentation --------------------------------------------------------------------

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

    let doc = include_str!("../../../docs/policies/two-tier-cost-fn.md");
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

/// Every rotation of `rows`, forwards and backwards.
fn orders<T: Clone>(rows: &[T]) -> Vec<Vec<T>> {
    let mut out = Vec::new();
    for shift in 0..rows.len() {
        let mut order = rows.to_vec();
        order.rotate_left(shift);
        out.push(order.clone());
        order.reverse();
        out.push(order);
    }
    out
}

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
        (DEFAULTS, request(), at(A, 0)), // cache tier: lowest id among best, equal load
        (DEFAULTS, TestRequest::new(1600, 16), at(A, 2)), // no cache winner: least-loaded, lowest id
        (RESPECT, request().target(B, None), at(B, 0)),
        (RESPECT, request().target(A, Some(2)), at(A, 2)),
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

fn creation_log(json: &str, host_cache_hit_weight: f64) -> Vec<String> {
    let (created, events) = plugin_api::testing::capture_logs(|| {
        create_with::<TwoTierCostFnType>(json, host_cache_hit_weight, 16)
    });
    created.expect("valid parameters");
    events
}

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
