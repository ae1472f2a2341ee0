//! `tie_break`: rows every tier finds equal share the traffic by default, and `lowest_row`
//! keeps the port's first behaviour.

use super::*;

/// Four idle, cold rows: every request ties on all of them, in the fallback tier.
fn idle() -> Vec<TestRow> {
    (0..4).map(|w| TestRow::new(10 + w, 0)).collect()
}

fn counts(policy: &TwoTierCostFn, rows: &[TestRow], requests: u64) -> [u32; 4] {
    let mut counts = [0u32; 4];
    for isl in 1..=requests {
        let request = TestRequest::new(isl * 7, 16);
        let first = picked(policy, rows, &request);
        // The same request breaks the same way whatever the row order, and explain agrees.
        for order in orders(rows) {
            assert_eq!(picked(policy, &order, &request), first, "{isl}");
            let e = explained(policy, &order, &request);
            assert_eq!(TestRows::new(order.clone()).row(e.row), first);
        }
        counts[(first.worker_id - 10) as usize] += 1;
    }
    counts
}

#[test]
fn spread_shares_idle_equal_rows_and_lowest_row_piles_them_on_the_lowest() {
    let spread = policy(DEFAULTS);
    assert_eq!(spread.params().tie_break, TieBreak::Spread);
    let shares = counts(&spread, &idle(), 400);
    // 100 expected each; a draw this far off would be a broken key, not bad luck.
    assert!(
        shares.iter().all(|&c| (60..=140).contains(&c)),
        "{shares:?}"
    );
    assert_eq!(counts(&policy(LOWEST_ROW), &idle(), 400), [400, 0, 0, 0]);
}

#[test]
fn spread_applies_in_every_tier_and_only_to_exact_ties() {
    let spread = policy(DEFAULTS);
    let workers = |rows: &[TestRow], request: &TestRequest| {
        (0..64)
            .map(|s| picked(&spread, rows, &request.clone().session(&format!("s-{s}"))))
            .collect::<std::collections::BTreeSet<_>>()
    };
    // Cache tier: the two rows holding 8 of 10 blocks with equal load share; the cold one never.
    let cache = [
        row(10, 8.0, 0.0, 1),
        row(11, 8.0, 0.0, 1),
        row(12, 0.0, 0.0, 0),
    ];
    assert_eq!(
        workers(&cache, &request()),
        [at(10, 0), at(11, 0)].into_iter().collect()
    );
    // Load tier: the two least-loaded rows share; the busy, well-cached one never.
    let load = [
        row(10, 0.0, 0.0, 2),
        row(11, 0.0, 0.0, 2),
        row(12, 10.0, 0.0, 80),
    ];
    assert_eq!(
        workers(&load, &request()),
        [at(10, 0), at(11, 0)].into_iter().collect()
    );
    // Fallback tier under `prefill_backlog`: equal backlog and load share; more backlog never.
    let backlog = policy(r#"{"load_signal": "prefill_backlog"}"#);
    let rows = [
        TestRow::new(10, 0),
        TestRow::new(11, 0),
        TestRow::new(12, 0).prefill_tokens(16),
    ];
    let seen: std::collections::BTreeSet<_> = (0..64)
        .map(|s| picked(&backlog, &rows, &request().session(&format!("s-{s}"))))
        .collect();
    assert_eq!(seen, [at(10, 0), at(11, 0)].into_iter().collect());
    // One active request more is not a tie.
    let rows = [row(10, 0.0, 0.0, 1), row(11, 0.0, 0.0, 0)];
    assert_eq!(
        workers(&rows, &request()),
        [at(11, 0)].into_iter().collect()
    );
}

#[test]
fn the_session_id_takes_part_in_the_draw() {
    let spread = policy(DEFAULTS);
    let seen: std::collections::BTreeSet<_> = (0..64)
        .map(|s| {
            picked(
                &spread,
                &idle(),
                &request().session(&format!("session-{s:05}")),
            )
        })
        .collect();
    assert_eq!(seen.len(), 4, "{seen:?}");
}

#[test]
fn tie_break_is_explained_logged_and_validated() {
    let e = explained(&policy(DEFAULTS), &idle(), &request());
    assert_eq!(e.get_label("tie_break"), Some("spread"));
    let e = explained(&policy(LOWEST_ROW), &idle(), &request());
    assert_eq!(e.get_label("tie_break"), Some("lowest_row"));
    assert!(creation_log(DEFAULTS, 0.75)
        .iter()
        .any(|line| line.contains("tie_break=spread")));
    let err = invalid(r#"{"tie_break": "random"}"#);
    assert_eq!(err.key(), "tie_break");
    assert!(
        err.message()
            .contains("unknown variant `random`, expected `lowest_row` or `spread`"),
        "{}",
        err.message()
    );
}

/// Idle, cold rows of 80 blocks whose caches hold `indexed` blocks (of other prompts).
fn with_caches(indexed: [f64; 4]) -> TestRows {
    TestRows::new(idle())
        .kv_capacity_blocks(vec![80.0; 4])
        .kv_indexed_device_blocks(indexed.to_vec())
}

#[test]
fn spread_sends_a_prompt_nobody_caches_where_the_cache_has_most_room() {
    let spread = policy(DEFAULTS);
    for indexed in [[70.0f64, 20.0, 60.0, 80.0], [10.0, 70.0, 70.0, 75.0]] {
        let roomiest = indexed
            .iter()
            .enumerate()
            .min_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| 10 + i as u64)
            .unwrap_or_default();
        for isl in 1..=50u64 {
            let request = TestRequest::new(isl * 7, 16).session(&format!("s{isl}"));
            let rows = with_caches(indexed);
            let row = rows.pick_worker(&spread, &request).expect("a row");
            assert_eq!(row.worker_id, roomiest, "{indexed:?}, isl {}", isl * 7);
        }
    }
    // Equal room: the spread rank decides, as without the columns.
    let shares = {
        let mut counts = [0u32; 4];
        for isl in 1..=400u64 {
            let rows = with_caches([40.0; 4]);
            let row = rows
                .pick_worker(&spread, &TestRequest::new(isl * 7, 16))
                .expect("a row");
            counts[(row.worker_id - 10) as usize] += 1;
        }
        counts
    };
    assert!(
        shares.iter().all(|&c| (60..=140).contains(&c)),
        "{shares:?}"
    );
    // `lowest_row` keeps its rule: room is not part of it.
    let rows = with_caches([70.0, 20.0, 60.0, 80.0]);
    let lowest = rows
        .pick_worker(&policy(LOWEST_ROW), &request())
        .expect("a row");
    assert_eq!(lowest, at(10, 0));
}

#[test]
fn room_never_overrides_a_tier() {
    // Row 10 caches the prompt (the cache tier fires) although its cache is the fullest.
    let mut rows = idle();
    rows[0] = rows[0].device(8.0);
    let rows = TestRows::new(rows)
        .kv_capacity_blocks(vec![80.0; 4])
        .kv_indexed_device_blocks(vec![80.0, 0.0, 0.0, 0.0]);
    let row = rows
        .pick_worker(&policy(DEFAULTS), &request())
        .expect("a row");
    assert_eq!(row, at(10, 0));
}

#[test]
fn room_not_recent_sends_a_new_prompt_where_the_cache_is_coldest_and_is_validated() {
    let not_recent = policy(r#"{"room": "not_recent"}"#);
    let free = policy(DEFAULTS);
    // Every cache is full; only row 12's was not used lately.
    let full = || {
        TestRows::new(idle())
            .kv_capacity_blocks(vec![80.0; 4])
            .kv_indexed_device_blocks(vec![80.0; 4])
    };
    let mut free_rows = std::collections::BTreeSet::new();
    for isl in 1..=50u64 {
        let request = TestRequest::new(isl * 7, 16).session(&format!("s{isl}"));
        let rows = full().kv_recent_device_blocks(vec![80.0, 75.0, 10.0, 80.0]);
        let row = rows.pick_worker(&not_recent, &request).expect("a row");
        assert_eq!(row, at(12, 0), "isl {}", isl * 7);
        free_rows.insert(rows.pick_worker(&free, &request).expect("a row"));
        // Without the column (an older host, or its window off) `not_recent` is `free`.
        assert_eq!(
            full().pick_worker(&not_recent, &request).expect("a row"),
            full().pick_worker(&free, &request).expect("a row")
        );
    }
    assert_eq!(
        free_rows.len(),
        4,
        "free sees four equal full caches: {free_rows:?}"
    );
    let e = explained(&not_recent, &idle(), &request());
    assert_eq!(e.get_label("room"), Some("not_recent"));
    assert_eq!(
        explained(&free, &idle(), &request()).get_label("room"),
        None
    );
    let err = invalid(r#"{"room": "empty"}"#);
    assert_eq!(err.key(), "room");
    assert!(
        err.message()
            .contains("unknown variant `empty`, expected `free` or `not_recent`"),
        "{}",
        err.message()
    );
}
