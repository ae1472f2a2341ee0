//! Rows whose KV index is not current (the host's `kv_index_state` column): their overlap is
//! read as zero in every tier, and the reason says so.

use plugin_api::KvIndexState;

use super::*;

const NOT_CURRENT: [KvIndexState; 3] = [
    KvIndexState::Unknown,
    KvIndexState::Stale,
    KvIndexState::Lagging,
];

fn with_states(rows: &[TestRow], states: &[KvIndexState]) -> TestRows {
    TestRows::new(rows.to_vec()).kv_index_states(states)
}

#[test]
fn a_stale_row_holding_the_prompt_is_not_preferred_for_it() {
    // B caches 8 of 10 blocks (the cache tier fires for it) but has one more request than A.
    let rows = [row(A, 0.0, 0.0, 0), row(B, 8.0, 0.0, 1)];
    for json in [DEFAULTS, ACTIVE, LOWEST_ROW] {
        let p = policy(json);
        let current = with_states(&rows, &[KvIndexState::Current; 2]);
        assert_eq!(current.pick_worker(&p, &request()).unwrap(), at(B, 0));
        let e = current.explain(&p, &request()).unwrap();
        assert_eq!(e.reason, "cache_tier_least_loaded_among_max_overlap");
        assert_eq!(e.get_label("kv_load_only"), None);
        for state in NOT_CURRENT {
            let rows = with_states(&rows, &[KvIndexState::Current, state]);
            assert_eq!(
                rows.pick_worker(&p, &request()).unwrap(),
                at(A, 0),
                "{json} {state}: load-only, A is less loaded"
            );
            let e = rows.explain(&p, &request()).unwrap();
            assert_eq!(e.reason, "least_loaded_no_cache_winner_kv_load_only");
            assert_eq!(
                e.get_label("kv_load_only"),
                Some(&*format!("{B}:0={state}"))
            );
            assert_eq!(e.get("max_effective_overlap"), Some(0.0));
        }
    }
}

#[test]
fn host_overlap_and_the_soft_affinity_cache_gate_read_it_as_zero_too() {
    // Host-tier overlap on a lagging row: not a cache winner either.
    let rows = [row(A, 0.0, 0.0, 0), row(B, 0.0, 12.0, 1)];
    let lagging = with_states(&rows, &[KvIndexState::Current, KvIndexState::Lagging]);
    assert_eq!(
        lagging.pick_worker(&policy(DEFAULTS), &request()).unwrap(),
        at(A, 0)
    );
    // The cache gate releases target A only for a row that trustably caches more.
    let rows = [row(A, 2.0, 0.0, 0), row(B, 6.0, 0.0, 0)];
    let request = request().target(A, None);
    let gate = policy(r#"{"respect_soft_affinity": true}"#);
    let stale_b = with_states(&rows, &[KvIndexState::Current, KvIndexState::Stale]);
    let e = stale_b.explain(&gate, &request).unwrap();
    assert_eq!(e.get_label("soft_affinity"), Some("kept"));
    assert_eq!(stale_b.row(e.row), at(A, 0));
    assert_eq!(e.reason, "soft_affinity_target_kv_load_only");
}

#[test]
fn the_cache_gate_keeps_a_target_whose_own_index_is_not_current() {
    // Target A's row restarted (or lost its event stream): its overlap reads as zero, B caches
    // 6 blocks. Unknown is no evidence that B caches more: the session stays on A.
    let rows = [row(A, 0.0, 0.0, 0), row(B, 6.0, 0.0, 0)];
    let request = request().target(A, None);
    let gate = policy(r#"{"respect_soft_affinity": true}"#);
    let current = with_states(&rows, &[KvIndexState::Current; 2]);
    let e = current.explain(&gate, &request).unwrap();
    assert_eq!(
        (current.row(e.row), e.get_label("soft_affinity")),
        (at(B, 0), Some("released_by_cache")),
        "with A's index current, B's cache wins the gate"
    );
    for state in NOT_CURRENT {
        let rows = with_states(&rows, &[state, KvIndexState::Current]);
        let e = rows.explain(&gate, &request).unwrap();
        assert_eq!(rows.row(e.row), at(A, 0), "{state}: the target is kept");
        assert_eq!(e.get_label("soft_affinity"), Some("kept"), "{state}");
    }
}

#[test]
fn all_rows_current_decide_exactly_as_without_the_column() {
    // Every row shape of the conformance-style cases, every row order: same pick, same
    // explanation.
    let cases = [
        vec![row(A, 0.0, 0.0, 0), row(B, 8.0, 0.0, 1)],
        vec![
            row(A, 6.0, 2.0, 3),
            row(B, 6.0, 0.0, 0),
            row(50, 1.0, 9.0, 2),
        ],
        vec![row(A, 0.0, 0.0, 9), row(B, 0.0, 0.0, 0)],
    ];
    for json in [DEFAULTS, ACTIVE, LOWEST_ROW, RESPECT] {
        let p = policy(json);
        for rows in &cases {
            for order in orders(rows) {
                let plain = TestRows::new(order.clone());
                let current = with_states(&order, &vec![KvIndexState::Current; order.len()]);
                let request = request().target(A, None);
                assert_eq!(plain.pick(&p, &request), current.pick(&p, &request));
                assert_eq!(plain.explain(&p, &request), current.explain(&p, &request));
            }
        }
    }
}
