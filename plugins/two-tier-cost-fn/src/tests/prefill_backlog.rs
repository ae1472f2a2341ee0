//! `load_signal: prefill_backlog`.

use super::*;

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
    /// The pick with the `active_requests` signal, then with `prefill_backlog` (the default).
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
            (ACTIVE, case.active_requests),
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
        policy(BACKLOG),
        policy(DEFAULTS),
        "prefill_backlog is the default"
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
