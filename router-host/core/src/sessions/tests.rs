//! Unit tests of the session table.

use std::sync::Arc;
use std::time::Duration;

use plugin_api::{AffinityTarget, RowId};

use super::*;

const TTL: Duration = Duration::from_secs(10);

fn row(worker_id: u64, dp_rank: u32) -> RowId {
    RowId { worker_id, dp_rank }
}

fn worker(worker_id: u64) -> AffinityTarget {
    AffinityTarget {
        worker_id,
        dp_rank: None,
    }
}

fn rank(worker_id: u64, dp_rank: u32) -> AffinityTarget {
    AffinityTarget {
        worker_id,
        dp_rank: Some(dp_rank),
    }
}

fn table(mode: BindingMode) -> (SessionTable, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(Duration::from_secs(100)));
    let t = SessionTable::new(mode, TTL, DEFAULT_MAX_BINDINGS, clock.clone());
    (t, clock)
}

/// lookup + dispatched in one step, for tests that do not care about leases.
fn send(t: &SessionTable, id: &str, r: RowId) -> Result<DispatchOutcome, SessionError> {
    let lease = t.lookup(id).expect("valid id");
    t.dispatched(&lease, r)
}

fn target(t: &SessionTable, id: &str) -> Option<AffinityTarget> {
    t.lookup(id).expect("valid id").target()
}

#[test]
fn binding_is_created_from_the_dispatched_row() {
    let (t, _) = table(BindingMode::Soft);
    let lease = t.lookup("s").unwrap();
    assert_eq!(lease.binding(), None);
    assert_eq!(lease.version(), 0);
    assert_eq!(lease.session_id(), "s");
    // Taking a lease does not count in flight, nor create anything.
    assert_eq!(t.in_flight("s"), 0);
    assert!(t.is_empty());

    assert_eq!(
        t.dispatched(&lease, row(7, 2)),
        Ok(DispatchOutcome::Created)
    );
    assert_eq!(t.len(), 1);
    assert_eq!(t.in_flight("s"), 1);
    let b = t.lookup("s").unwrap().binding().unwrap();
    assert_eq!(b.target, worker(7));
    assert_eq!(b.mode, BindingMode::Soft);
    assert_eq!(t.stats().created, 1);
}

#[test]
fn rank_granularity_creates_rank_bindings() {
    let clock = Arc::new(ManualClock::default());
    let t = SessionTable::new(BindingMode::Soft, TTL, 8, clock)
        .with_granularity(BindingGranularity::Rank);
    assert_eq!(t.granularity(), BindingGranularity::Rank);
    assert_eq!(send(&t, "s", row(7, 2)), Ok(DispatchOutcome::Created));
    assert_eq!(target(&t, "s"), Some(rank(7, 2)));
}

#[test]
fn soft_worker_binding_is_kept_across_ranks_and_moves_worker_level() {
    let (t, _) = table(BindingMode::Soft);
    send(&t, "s", row(1, 0)).unwrap();
    // Another rank of the same worker matches a worker-level binding.
    assert_eq!(send(&t, "s", row(1, 3)), Ok(DispatchOutcome::Kept));
    assert_eq!(
        send(&t, "s", row(2, 5)),
        Ok(DispatchOutcome::Moved {
            from: worker(1),
            to: worker(2)
        })
    );
    assert_eq!(target(&t, "s"), Some(worker(2)));
    assert_eq!(t.in_flight("s"), 3);
    let s = t.stats();
    assert_eq!((s.created, s.kept, s.moved, s.stale), (1, 1, 1, 0));
}

#[test]
fn soft_rank_binding_follows_the_rank() {
    let clock = Arc::new(ManualClock::default());
    let t = SessionTable::new(BindingMode::Soft, TTL, 8, clock)
        .with_granularity(BindingGranularity::Rank);
    send(&t, "s", row(1, 0)).unwrap();
    assert_eq!(send(&t, "s", row(1, 0)), Ok(DispatchOutcome::Kept));
    // Same worker, other rank: a rank binding does not match, it follows the rank.
    assert_eq!(
        send(&t, "s", row(1, 1)),
        Ok(DispatchOutcome::Moved {
            from: rank(1, 0),
            to: rank(1, 1)
        })
    );
    assert_eq!(
        send(&t, "s", row(4, 3)),
        Ok(DispatchOutcome::Moved {
            from: rank(1, 1),
            to: rank(4, 3)
        })
    );
    assert_eq!(target(&t, "s"), Some(rank(4, 3)));
}

#[test]
fn hard_violation_invalidates_and_next_lookup_sees_no_binding() {
    let (t, _) = table(BindingMode::Hard);
    send(&t, "s", row(1, 0)).unwrap();
    t.completed("s");
    // Any rank of the bound worker is fine.
    assert_eq!(send(&t, "s", row(1, 1)), Ok(DispatchOutcome::Kept));
    t.completed("s");

    let lease = t.lookup("s").unwrap();
    assert_eq!(lease.binding().unwrap().mode, BindingMode::Hard);
    let err = t.dispatched(&lease, row(2, 0)).unwrap_err();
    assert_eq!(
        err,
        SessionError::HardAffinityViolated {
            session_id: "s".into(),
            bound: worker(1),
            dispatched: row(2, 0),
        }
    );
    let msg = err.to_string();
    assert!(msg.contains("worker 1 (any rank)"), "{msg}");
    assert!(msg.contains("worker 2 rank 0"), "{msg}");
    assert_eq!(t.lookup("s").unwrap().binding(), None);
    assert!(t.is_empty());
    assert_eq!(t.in_flight("s"), 0, "a violating dispatch is not counted");
    assert_eq!(t.stats().hard_violations, 1);

    // Single retry: normal selection, and the next dispatch binds afresh.
    assert_eq!(send(&t, "s", row(2, 0)), Ok(DispatchOutcome::Created));
    assert_eq!(target(&t, "s"), Some(worker(2)));
}

#[test]
fn invalidate_removes_binding_and_keeps_counting_in_flight() {
    let (t, clock) = table(BindingMode::Hard);
    send(&t, "s", row(1, 0)).unwrap();
    assert!(t.invalidate("s"));
    assert!(!t.invalidate("s"));
    assert!(!t.invalidate("unknown"));
    assert_eq!(t.lookup("s").unwrap().binding(), None);
    assert_eq!(t.len(), 0);
    assert_eq!(t.in_flight("s"), 1);

    // New binding while the old request still runs: it must not go idle when one completes.
    assert_eq!(send(&t, "s", row(2, 0)), Ok(DispatchOutcome::Created));
    assert_eq!(t.in_flight("s"), 2);
    t.completed("s");
    clock.advance(TTL * 5);
    assert_eq!(target(&t, "s"), Some(worker(2)));
    t.completed("s");
    assert_eq!(t.in_flight("s"), 0);
    t.completed("s"); // stray: ignored, no underflow
    assert_eq!(t.in_flight("s"), 0);
    assert_eq!(t.stats().invalidated, 1);
}

#[test]
fn ttl_restarts_at_the_last_completion_not_the_first() {
    let (t, clock) = table(BindingMode::Soft);
    send(&t, "s", row(1, 0)).unwrap();
    send(&t, "s", row(1, 0)).unwrap();
    clock.advance(Duration::from_secs(5));
    t.completed("s"); // first of two: session still busy
    clock.advance(Duration::from_secs(20)); // 20 s > TTL after the first completion
    assert_eq!(target(&t, "s"), Some(worker(1)));
    t.completed("s"); // last: idle from here
    clock.advance(TTL);
    // Boundary: at exactly last_completion + ttl the binding is still alive.
    assert_eq!(target(&t, "s"), Some(worker(1)));
    clock.advance(Duration::from_nanos(1));
    assert_eq!(t.binding("s"), None);
    assert_eq!(t.len(), 1, "expiry is lazy until lookup");
    assert_eq!(t.lookup("s").unwrap().binding(), None);
    assert_eq!(t.len(), 0);
    assert_eq!(t.stats().expired, 1);
}

#[test]
fn new_dispatch_after_idle_cancels_expiry() {
    let (t, clock) = table(BindingMode::Soft);
    send(&t, "s", row(1, 0)).unwrap();
    t.completed("s");
    clock.advance(TTL);
    assert_eq!(send(&t, "s", row(1, 0)), Ok(DispatchOutcome::Kept));
    clock.advance(TTL * 3);
    assert_eq!(target(&t, "s"), Some(worker(1)));
}

#[test]
fn binding_with_requests_in_flight_never_expires() {
    let (t, clock) = table(BindingMode::Soft);
    send(&t, "s", row(3, 0)).unwrap();
    clock.advance(TTL * 1000);
    assert_eq!(t.purge_expired(), 0);
    assert_eq!(target(&t, "s"), Some(worker(3)));
    assert_eq!(t.stats().expired, 0);
}

#[test]
fn binding_expired_while_request_was_queued_is_recreated() {
    let (t, clock) = table(BindingMode::Hard);
    send(&t, "s", row(1, 0)).unwrap();
    t.completed("s");
    let lease = t.lookup("s").unwrap();
    assert_eq!(lease.target(), Some(worker(1)));
    clock.advance(TTL * 2);
    // The binding the lease saw is gone: no hard violation, a fresh binding.
    assert_eq!(
        t.dispatched(&lease, row(2, 0)),
        Ok(DispatchOutcome::Created)
    );
    assert_eq!(target(&t, "s"), Some(worker(2)));
    assert_eq!(t.stats().expired, 1);
    assert_eq!(t.len(), 1);
}

#[test]
fn older_lease_cannot_overwrite_a_newer_rebind() {
    let (t, _) = table(BindingMode::Soft);
    send(&t, "s", row(1, 0)).unwrap(); // A
    let l1 = t.lookup("s").unwrap();
    let l2 = t.lookup("s").unwrap();
    assert_eq!(l1.version(), l2.version());
    assert_eq!(
        t.dispatched(&l2, row(2, 0)),
        Ok(DispatchOutcome::Moved {
            from: worker(1),
            to: worker(2)
        })
    );
    assert_eq!(t.dispatched(&l1, row(3, 0)), Ok(DispatchOutcome::Stale));
    assert_eq!(target(&t, "s"), Some(worker(2)));
    // The stale request still counts in flight.
    assert_eq!(t.in_flight("s"), 3);
    // A stale lease whose row happens to match the current binding is simply kept.
    assert_eq!(t.dispatched(&l1, row(2, 1)), Ok(DispatchOutcome::Kept));
    assert_eq!(t.stats().stale, 1);
}

#[test]
fn two_first_requests_race_and_the_later_does_not_overwrite() {
    for mode in [BindingMode::Soft, BindingMode::Hard] {
        let (t, _) = table(mode);
        let l1 = t.lookup("s").unwrap();
        let l2 = t.lookup("s").unwrap();
        assert_eq!(t.dispatched(&l2, row(2, 0)), Ok(DispatchOutcome::Created));
        // Hard mode too: l1 was routed before any binding existed, so it is not a violation.
        assert_eq!(t.dispatched(&l1, row(3, 0)), Ok(DispatchOutcome::Stale));
        assert_eq!(target(&t, "s"), Some(worker(2)), "{mode}");
        assert_eq!(t.in_flight("s"), 2);
    }
}

#[test]
fn session_id_length_is_capped() {
    let (t, _) = table(BindingMode::Soft);
    let ok = "a".repeat(MAX_SESSION_ID_BYTES);
    assert!(t.lookup(&ok).is_ok());

    let over = "a".repeat(MAX_SESSION_ID_BYTES + 1);
    match t.lookup(&over) {
        Err(SessionError::SessionIdTooLong { len, max, .. }) => {
            assert_eq!((len, max), (257, 256));
        }
        other => panic!("expected SessionIdTooLong, got {other:?}"),
    }

    let huge = "x".repeat(10 * 1024);
    let err = t.lookup(&huge).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("10240"), "{msg}");
    assert!(msg.contains("256"), "{msg}");
    assert!(
        msg.len() < 200,
        "message echoes the id: {} bytes",
        msg.len()
    );

    // Multi-byte characters: the preview is cut on a character boundary.
    let wide = "é".repeat(200); // 400 bytes
    match t.lookup(&wide) {
        Err(SessionError::SessionIdTooLong { len, preview, .. }) => {
            assert_eq!(len, 400);
            assert!(preview.len() <= ID_PREVIEW_BYTES);
            assert!(preview.chars().all(|c| c == 'é'));
        }
        other => panic!("expected SessionIdTooLong, got {other:?}"),
    }

    assert_eq!(t.lookup(""), Err(SessionError::EmptySessionId));
    assert_eq!(t.stats().rejected_ids, 4);
    // Invalid ids are harmless elsewhere.
    t.completed(&huge);
    assert!(!t.invalidate(""));
    assert!(t.is_empty());
}

#[test]
fn full_table_errors_then_evicts_expired_bindings_to_make_room() {
    let clock = Arc::new(ManualClock::default());
    let t = SessionTable::new(BindingMode::Soft, TTL, 3, clock.clone());
    for id in ["a", "b"] {
        send(&t, id, row(1, 0)).unwrap();
        t.completed(id);
    }
    send(&t, "busy", row(2, 0)).unwrap(); // in flight: never evicted
    clock.advance(TTL / 2);

    let err = send(&t, "c", row(1, 0)).unwrap_err();
    assert_eq!(err, SessionError::TableFull { max: 3 });
    assert!(err.to_string().contains('3'));
    assert_eq!(t.in_flight("c"), 0);
    // Existing sessions still work when full.
    assert_eq!(send(&t, "a", row(1, 0)), Ok(DispatchOutcome::Kept));
    t.completed("a");

    clock.advance(TTL + Duration::from_secs(1)); // "a" and "b" now idle past their TTL
    assert_eq!(send(&t, "c", row(1, 0)), Ok(DispatchOutcome::Created));
    assert_eq!(t.len(), 2);
    assert_eq!(target(&t, "busy"), Some(worker(2)));
    assert_eq!(target(&t, "a"), None);
    let s = t.stats();
    assert_eq!((s.table_full, s.expired), (1, 2));
}

#[test]
fn zero_capacity_never_binds() {
    let clock = Arc::new(ManualClock::default());
    let t = SessionTable::new(BindingMode::Soft, TTL, 0, clock);
    assert_eq!(
        send(&t, "s", row(1, 0)),
        Err(SessionError::TableFull { max: 0 })
    );
    t.completed("s");
    assert!(t.is_empty());
}

#[test]
fn manual_clock_set_and_advance() {
    let c = ManualClock::new(Duration::from_secs(1));
    c.advance(Duration::from_millis(500));
    assert_eq!(c.now(), Duration::from_millis(1500));
    c.set(Duration::from_secs(7));
    assert_eq!(c.now(), Duration::from_secs(7));
    c.advance(Duration::MAX);
    assert_eq!(c.now(), Duration::from_nanos(u64::MAX));
    let s = SystemClock::new();
    assert!(s.now() <= s.now());
}

#[test]
fn concurrent_use_keeps_in_flight_counts_consistent() {
    const THREADS: u64 = 8;
    const ITERS: u64 = 1000;
    const SESSIONS: u64 = 13;
    let clock = Arc::new(ManualClock::default());
    let t = Arc::new(SessionTable::new(
        BindingMode::Soft,
        Duration::from_millis(50),
        DEFAULT_MAX_BINDINGS,
        clock.clone(),
    ));
    let ids: Arc<Vec<String>> = Arc::new((0..SESSIONS).map(|i| format!("s{i}")).collect());
    let handles: Vec<_> = (0..THREADS)
        .map(|th| {
            let t = Arc::clone(&t);
            let ids = Arc::clone(&ids);
            let clock = Arc::clone(&clock);
            std::thread::spawn(move || {
                let mut ok = 0u64;
                let mut held: Vec<&str> = Vec::new();
                for i in 0..ITERS {
                    let id = ids[((th * 7 + i) % SESSIONS) as usize].as_str();
                    let lease = t.lookup(id).expect("valid id");
                    let r = row((th + i) % 4, (i % 2) as u32);
                    if t.dispatched(&lease, r).is_ok() {
                        ok += 1;
                        held.push(id);
                    }
                    // Keep up to 3 requests in flight per thread, completing oldest first.
                    if held.len() > 3 {
                        t.completed(held.remove(0));
                    }
                    if i % 97 == 0 {
                        t.invalidate(id);
                    }
                    if i % 10 == 0 {
                        clock.advance(Duration::from_millis(7));
                    }
                }
                for id in held {
                    t.completed(id);
                }
                ok
            })
        })
        .collect();
    let dispatched: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert_eq!(dispatched, THREADS * ITERS, "soft mode never errors here");
    for id in ids.iter() {
        assert_eq!(t.in_flight(id), 0, "{id}");
    }
    let s = t.stats();
    assert_eq!(s.created + s.kept + s.moved + s.stale, dispatched);
    assert!(t.len() <= SESSIONS as usize);
    clock.advance(Duration::from_secs(1));
    t.purge_expired();
    assert!(t.is_empty());
}

#[test]
fn check_session_id_is_the_rule_lookup_applies() {
    assert_eq!(check_session_id(""), Err(SessionError::EmptySessionId));
    assert_eq!(check_session_id("s"), Ok(()));
    assert_eq!(check_session_id(&"a".repeat(MAX_SESSION_ID_BYTES)), Ok(()));
    let over = "a".repeat(MAX_SESSION_ID_BYTES + 1);
    assert_eq!(
        check_session_id(&over),
        Err(SessionError::SessionIdTooLong {
            len: MAX_SESSION_ID_BYTES + 1,
            max: MAX_SESSION_ID_BYTES,
            preview: "a".repeat(ID_PREVIEW_BYTES),
        })
    );
    let (t, _) = table(BindingMode::Soft);
    assert_eq!(
        t.lookup(&over).unwrap_err(),
        check_session_id(&over).unwrap_err()
    );
}
