//! The Redis session store (`router_host::session_store::RedisStore`) against a real
//! `redis-server`: the in-memory table's rules across two stores ("replicas"), the race on a new
//! session, idle TTL and leases kept by Redis, values that are not bindings, outages in both
//! modes, a wrong password, request ids per replica, and the configuration's bad inputs.
//!
//! Every wait polls with a deadline; every server is on 127.0.0.1 and killed on drop.

mod common;
mod support_redis;

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use plugin_api::AffinityTarget;
use router_host::config::{OnStoreUnavailable, RedisStoreConfig, RouterConfig};
use router_host::host::Host;
use router_host::loader::SearchPath;
use router_host::model::{Cluster, Request, RowId, Worker};
use router_host::policy_set::PolicySet;
use router_host::session_store::{connect_check, live_host, RedisStore};
use router_host::sessions::{
    BindingGranularity, BindingMode, DispatchOutcome, SessionError, SessionStore,
};
use support_redis::RedisServer;

use crate::common::TempDir;

fn row(worker_id: u64) -> RowId {
    RowId {
        worker_id,
        dp_rank: 0,
    }
}

fn config(server: &RedisServer, prefix: &str) -> RedisStoreConfig {
    server.store_config(prefix, false)
}

fn store(config: &RedisStoreConfig, mode: BindingMode, ttl: Duration) -> RedisStore {
    let granularity = match mode {
        BindingMode::Soft => BindingGranularity::Worker,
        BindingMode::Hard => BindingGranularity::Rank,
    };
    RedisStore::start(config, mode, granularity, ttl).expect("store starts")
}

/// A redis-server in a fresh temp dir, or `None` (skip) when not installed.
fn server(test: &str) -> Option<(RedisServer, TempDir)> {
    let binary = support_redis::available(test)?;
    let dir = common::temp_dir(test);
    Some((RedisServer::start(&binary, &dir, None), dir))
}

fn poll(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if check() {
            return true;
        }
        if start.elapsed() > limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn target(worker_id: u64) -> Option<AffinityTarget> {
    Some(AffinityTarget {
        worker_id,
        dp_rank: None,
    })
}

#[test]
fn two_stores_share_create_keep_move_and_stale() {
    let Some((server, _dir)) = server("two_stores_share") else {
        return;
    };
    let cfg = config(&server, "t1:");
    let a = store(&cfg, BindingMode::Soft, Duration::from_secs(600));
    let b = store(&cfg, BindingMode::Soft, Duration::from_secs(600));
    assert_ne!(a.replica(), b.replica(), "each store is its own replica");
    assert_ne!(
        a.id_tag(),
        b.id_tag(),
        "and tags its request ids differently"
    );
    let mut fixed = cfg.clone();
    fixed.replica_id = Some(7);
    let c = store(&fixed, BindingMode::Soft, Duration::from_secs(600));
    assert_eq!(c.id_tag(), 7, "a configured replica_id is the tag");
    assert_ne!(c.replica(), a.replica(), "but leases are still per start");
    drop(c);

    let lease = a.lookup("conv").unwrap();
    assert_eq!(lease.binding(), None);
    assert_eq!(lease.version(), 0);
    assert_eq!(
        a.dispatched(&lease, row(1)).unwrap(),
        DispatchOutcome::Created
    );

    // The other replica sees it and keeps it.
    let lease_b = b.lookup("conv").unwrap();
    assert_eq!(lease_b.target(), target(1));
    assert_eq!(
        b.dispatched(&lease_b, row(1)).unwrap(),
        DispatchOutcome::Kept
    );

    // A soft move by B (its lease is current) is what A sees next.
    let stale_a = a.lookup("conv").unwrap();
    let lease_b = b.lookup("conv").unwrap();
    assert!(matches!(
        b.dispatched(&lease_b, row(2)).unwrap(),
        DispatchOutcome::Moved { .. }
    ));
    assert_eq!(a.lookup("conv").unwrap().target(), target(2));
    assert_eq!(a.binding("conv").map(|b| b.target), target(2));

    // A request routed on the view before the move must not overwrite it.
    assert_eq!(
        a.dispatched(&stale_a, row(3)).unwrap(),
        DispatchOutcome::Stale
    );
    assert_eq!(b.lookup("conv").unwrap().target(), target(2));

    // Invalidate, then the next dispatch creates afresh.
    assert!(b.invalidate("conv"));
    assert!(!b.invalidate("conv"), "nothing left to invalidate");
    let lease = a.lookup("conv").unwrap();
    assert_eq!(lease.binding(), None);
    assert_eq!(
        a.dispatched(&lease, row(3)).unwrap(),
        DispatchOutcome::Created
    );

    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!(sa.created, 2);
    assert_eq!(sa.stale, 1);
    assert_eq!(sb.kept, 1);
    assert_eq!(sb.moved, 1);
    assert_eq!(sb.invalidated, 1);

    // Invalid ids are rejected before any round trip, as by the table.
    assert_eq!(a.lookup(""), Err(SessionError::EmptySessionId));
    assert!(matches!(
        a.lookup(&"x".repeat(300)),
        Err(SessionError::SessionIdTooLong { .. })
    ));
    assert_eq!(a.stats().rejected_ids, 2);
}

#[test]
fn hard_mode_violation_invalidates_the_binding() {
    let Some((server, _dir)) = server("hard_violation") else {
        return;
    };
    let cfg = config(&server, "t2:");
    let a = store(&cfg, BindingMode::Hard, Duration::from_secs(600));
    let b = store(&cfg, BindingMode::Hard, Duration::from_secs(600));
    let lease = a.lookup("pinned").unwrap();
    assert_eq!(
        a.dispatched(&lease, row(1)).unwrap(),
        DispatchOutcome::Created
    );
    let lease = b.lookup("pinned").unwrap();
    assert_eq!(
        lease.target(),
        Some(AffinityTarget {
            worker_id: 1,
            dp_rank: Some(0)
        }),
        "hard bindings are rank-level"
    );
    assert!(matches!(
        b.dispatched(&lease, row(2)),
        Err(SessionError::HardAffinityViolated { .. })
    ));
    assert_eq!(a.lookup("pinned").unwrap().binding(), None);
    assert_eq!(b.stats().hard_violations, 1);
    // A's request is still in flight: its lease keeps the (now binding-less) entry.
    a.completed("pinned");
}

#[test]
fn racing_replicas_on_a_new_session_leave_one_binding() {
    let Some((server, _dir)) = server("racing_replicas") else {
        return;
    };
    let cfg = config(&server, "t3:");
    let stores = [
        Arc::new(store(&cfg, BindingMode::Soft, Duration::from_secs(600))),
        Arc::new(store(&cfg, BindingMode::Soft, Duration::from_secs(600))),
    ];
    for round in 0..40 {
        let session = format!("race-{round}");
        let barrier = Arc::new(Barrier::new(2));
        let handles: Vec<_> = stores
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let (s, barrier, session) = (s.clone(), barrier.clone(), session.clone());
                std::thread::spawn(move || {
                    let lease = s.lookup(&session).unwrap();
                    barrier.wait();
                    // Each replica's policy chose a different worker.
                    let outcome = s.dispatched(&lease, row(i as u64 + 1)).unwrap();
                    (outcome, i as u64 + 1)
                })
            })
            .collect();
        let outcomes: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let created: Vec<_> = outcomes
            .iter()
            .filter(|(o, _)| *o == DispatchOutcome::Created)
            .collect();
        assert_eq!(created.len(), 1, "round {round}: {outcomes:?}");
        let loser = outcomes
            .iter()
            .find(|(o, _)| *o != DispatchOutcome::Created)
            .unwrap();
        assert_eq!(
            loser.0,
            DispatchOutcome::Stale,
            "round {round}: {outcomes:?}"
        );
        // The winner's binding stands for both.
        for s in &stores {
            assert_eq!(s.lookup(&session).unwrap().target(), target(created[0].1));
        }
    }
}

#[test]
fn idle_ttl_and_leases_are_kept_by_redis() {
    let Some((server, _dir)) = server("idle_ttl") else {
        return;
    };
    let mut cfg = config(&server, "t4:");
    cfg.lease = Duration::from_secs(1);
    let ttl = Duration::from_secs(2);
    let mut con = server.connection();
    let pttl = |con: &mut redis::Connection, key: &str| -> i64 {
        redis::cmd("PTTL").arg(key).query(con).unwrap()
    };

    // A live replica renews its lease: the binding outlives ttl + lease while in flight.
    let a = store(&cfg, BindingMode::Soft, ttl);
    let lease = a.lookup("long").unwrap();
    a.dispatched(&lease, row(1)).unwrap();
    // Longer than lease + ttl (3 s): only the heartbeat can have kept the key.
    std::thread::sleep(Duration::from_secs(4));
    assert!(
        pttl(&mut con, "t4:s:long") > 0,
        "a request in flight keeps its binding alive past ttl + lease"
    );
    // Completed: the idle TTL starts (the release is queued, so poll).
    a.completed("long");
    assert!(poll(Duration::from_secs(10), || pttl(
        &mut con,
        "t4:s:long"
    ) == -2));
    assert_eq!(a.lookup("long").unwrap().binding(), None, "expired");

    // A replica that dies with a request in flight stops renewing: its lease ends, and the
    // binding expires a lease + ttl later without anyone completing it.
    let dead = store(&cfg, BindingMode::Soft, ttl);
    let lease = dead.lookup("orphan").unwrap();
    dead.dispatched(&lease, row(1)).unwrap();
    drop(dead);
    assert!(pttl(&mut con, "t4:s:orphan") > 0);
    assert!(poll(Duration::from_secs(15), || pttl(
        &mut con,
        "t4:s:orphan"
    ) == -2));

    // And a survivor's own request of that session is not held up by the dead lease.
    let b = store(&cfg, BindingMode::Soft, Duration::from_secs(600));
    let dead = store(&cfg, BindingMode::Soft, Duration::from_secs(600));
    let lease = dead.lookup("shared").unwrap();
    dead.dispatched(&lease, row(1)).unwrap();
    drop(dead);
    let lease = b.lookup("shared").unwrap();
    assert_eq!(b.dispatched(&lease, row(1)).unwrap(), DispatchOutcome::Kept);
    // Wait for the dead lease's deadline, then complete: the idle TTL (600 s) starts now.
    std::thread::sleep(Duration::from_millis(1100));
    b.completed("shared");
    assert!(poll(Duration::from_secs(10), || {
        let left = pttl(&mut con, "t4:s:shared");
        left > 0 && left <= 600_000
    }));
    let fields: Vec<String> = redis::cmd("HKEYS")
        .arg("t4:s:shared")
        .query(&mut con)
        .unwrap();
    assert!(
        !fields.iter().any(|f| f.starts_with("l:")),
        "no lease left: {fields:?}"
    );
}

#[test]
fn a_value_that_is_not_a_binding_is_skipped_counted_and_left_alone() {
    let Some((server, _dir)) = server("foreign_value") else {
        return;
    };
    let cfg = config(&server, "t5:");
    let a = store(&cfg, BindingMode::Soft, Duration::from_secs(600));
    let mut con = server.connection();
    let _: () = redis::cmd("SET")
        .arg("t5:s:str")
        .arg("hello")
        .query(&mut con)
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg("t5:s:hash")
        .arg("owner")
        .arg("someone else")
        .query(&mut con)
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg("t5:s:badw")
        .arg("w")
        .arg("abc")
        .arg("v")
        .arg("3")
        .query(&mut con)
        .unwrap();
    for session in ["str", "hash", "badw"] {
        let lease = a
            .lookup(session)
            .expect("a foreign value is no error at lookup");
        assert_eq!(lease.binding(), None, "{session}");
        let err = a.dispatched(&lease, row(1)).unwrap_err();
        assert!(
            matches!(&err, SessionError::StoreValue { key, .. } if key == &format!("t5:s:{session}")),
            "{session}: {err}"
        );
        assert!(
            err.to_string().contains("does not hold a session binding"),
            "{err}"
        );
    }
    // Nothing was written over them.
    let s: String = redis::cmd("GET").arg("t5:s:str").query(&mut con).unwrap();
    assert_eq!(s, "hello");
    let owner: String = redis::cmd("HGET")
        .arg("t5:s:hash")
        .arg("owner")
        .query(&mut con)
        .unwrap();
    assert_eq!(owner, "someone else");
    let w: String = redis::cmd("HGET")
        .arg("t5:s:badw")
        .arg("w")
        .query(&mut con)
        .unwrap();
    assert_eq!(w, "abc");
    assert_eq!(
        a.store_stats().foreign,
        6,
        "three lookups, three dispatches"
    );
    assert!(a.store_stats().up, "a foreign value is not an outage");
}

#[test]
fn outage_in_route_mode_routes_without_binding_then_recovers() {
    let Some((mut server, _dir)) = server("outage_route") else {
        return;
    };
    let cfg = config(&server, "t6:");
    let a = store(&cfg, BindingMode::Soft, Duration::from_secs(600));
    let lease = a.lookup("s").unwrap();
    a.dispatched(&lease, row(1)).unwrap();
    a.completed("s");

    server.stop();
    // The first call finds out (within the timeout); the rest skip the store at once.
    for _ in 0..5 {
        let started = Instant::now();
        let lease = a.lookup("s").expect("route mode: no error");
        assert_eq!(lease.binding(), None);
        assert!(
            started.elapsed() < cfg.timeout * 2 + Duration::from_secs(2),
            "a store call is bounded by the timeout: {:?}",
            started.elapsed()
        );
        assert!(matches!(
            a.dispatched(&lease, row(2)),
            Err(SessionError::StoreUnavailable { .. })
        ));
    }
    let stats = a.store_stats();
    assert!(!stats.up);
    assert_eq!(stats.outages, 1, "one outage, however many requests");
    assert_eq!(stats.degraded, 5);

    server.restart();
    assert!(
        poll(Duration::from_secs(20), || a.is_up()),
        "reconnects by itself"
    );
    let lease = a.lookup("s").unwrap();
    // The restarted server kept nothing (no persistence): a fresh binding.
    assert_eq!(lease.binding(), None);
    assert_eq!(
        a.dispatched(&lease, row(2)).unwrap(),
        DispatchOutcome::Created
    );
    assert_eq!(a.lookup("s").unwrap().target(), target(2));
}

#[test]
fn outage_in_refuse_mode_refuses_sessions() {
    let Some((mut server, _dir)) = server("outage_refuse") else {
        return;
    };
    let mut cfg = config(&server, "t7:");
    cfg.on_unavailable = OnStoreUnavailable::Refuse;
    let a = store(&cfg, BindingMode::Soft, Duration::from_secs(600));
    assert!(a.lookup("s").is_ok());
    server.stop();
    let err = a.lookup("s").unwrap_err();
    assert!(
        matches!(err, SessionError::StoreUnavailable { .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("session store unavailable"),
        "{err}"
    );
    server.restart();
    assert!(poll(Duration::from_secs(20), || a.is_up()));
    assert!(a.lookup("s").is_ok());
}

#[test]
fn a_wrong_password_is_a_clear_error_and_an_outage_not_a_crash() {
    let Some(binary) = support_redis::available("wrong_password") else {
        return;
    };
    let dir = common::temp_dir("wrong_password");
    let server = RedisServer::start(&binary, &dir, Some("right-pass"));
    let mut cfg = config(&server, "t8:");
    cfg.url = format!("redis://:wrong-pass@127.0.0.1:{}/0", server.port);
    let err = connect_check(&cfg).unwrap_err().to_string();
    assert!(err.contains("authentication failed"), "{err}");
    assert!(
        !err.contains("wrong-pass"),
        "the password is never printed: {err}"
    );
    assert!(err.contains(":***@127.0.0.1"), "{err}");

    // `serve` starts anyway, in an outage, and routes without bindings (route mode).
    let a = store(&cfg, BindingMode::Soft, Duration::from_secs(600));
    assert!(!a.is_up());
    assert_eq!(a.lookup("s").unwrap().binding(), None);

    cfg.url = server.url();
    let ok = connect_check(&cfg).expect("the right password connects");
    assert!(ok.version.starts_with("redis "), "{}", ok.version);
}

fn replica_host(server: &RedisServer, prefix: &str) -> Host {
    let yaml = format!(
        "session_affinity:\n  mode: soft\n  store:\n    kind: redis\n    url: {}\n    key_prefix: \"{prefix}\"\n    timeout_ms: 500\n",
        server.url()
    );
    let config = RouterConfig::from_yaml_str(&yaml, None).expect("valid config");
    let router = PolicySet::from_config(&config, &SearchPath::default()).expect("router");
    let workers = (1..=2).map(|w| Worker::new(w).with_ranks(0, 1)).collect();
    live_host(router, Cluster::new(workers).unwrap(), &config, None)
        .expect("host")
        .0
}

#[test]
fn request_ids_differ_across_replicas_and_bindings_are_shared() {
    let Some((server, _dir)) = server("request_ids") else {
        return;
    };
    let a = replica_host(&server, "t9:");
    let b = replica_host(&server, "t9:");
    let tag = |id: u64| (id >> 47) & 0xffff;
    let request = Request {
        isl_tokens: 64,
        session_id: Some("ids".to_owned()),
        ..Request::default()
    };
    let first = a
        .route(&request, &router_host::host::NoOverlap, false)
        .unwrap();
    let second = b
        .route(&request, &router_host::host::NoOverlap, false)
        .unwrap();
    assert_ne!(first.id, second.id);
    assert_ne!(
        tag(first.id),
        tag(second.id),
        "{:#x} {:#x}",
        first.id,
        second.id
    );
    assert_ne!(tag(first.id), 0);
    assert_eq!(
        second.decision.row, first.decision.row,
        "B follows A's binding"
    );
    assert!(a.complete(first.id));
    assert!(b.complete(second.id));
}

fn config_error(yaml: &str) -> String {
    match RouterConfig::from_yaml_str(yaml, None) {
        Ok(_) => panic!("accepted:\n{yaml}"),
        Err(err) => err.to_string(),
    }
}

#[test]
fn bad_store_configuration_is_named_with_its_place() {
    let base = "session_affinity:\n  mode: soft\n  store:\n    kind: redis\n";
    let err = config_error(&format!("{base}    url: \"http://h:1/\"\n"));
    assert!(err.contains("line 5"), "{err}");
    assert!(err.contains("session_affinity.store.url"), "{err}");
    assert!(err.contains("not a usable Redis URL"), "{err}");

    let err = config_error(&format!("{base}    url: \"redis://h:99999999/0\"\n"));
    assert!(err.contains("not a usable Redis URL"), "{err}");

    let err = config_error(&format!("{base}    url: redis://:hunter2@[::1/0\n"));
    assert!(!err.contains("hunter2"), "passwords are not quoted: {err}");

    let err = config_error(&format!(
        "{base}    url: redis://127.0.0.1:6379/0\n    key_prefix: \"my router:\"\n"
    ));
    assert!(err.contains("line 6"), "{err}");
    assert!(err.contains("session_affinity.store.key_prefix"), "{err}");
    assert!(err.contains("whitespace"), "{err}");

    let err = config_error(base);
    assert!(err.contains("needs `url`"), "{err}");

    let err = config_error("session_affinity:\n  mode: soft\n  store:\n    kind: memory\n    url: redis://127.0.0.1/\n");
    assert!(err.contains("only applies to `kind: redis`"), "{err}");

    let err = config_error("session_affinity:\n  mode: soft\n  store:\n    kind: etcd\n");
    assert!(err.contains("unknown variant `etcd`"), "{err}");
    assert!(err.contains("session_affinity.store.kind"), "{err}");

    let err = config_error(&format!(
        "{base}    url: redis://127.0.0.1:6379/0\n    timeout_ms: 0\n"
    ));
    assert!(err.contains("session_affinity.store.timeout_ms"), "{err}");

    let err = config_error(&format!(
        "{base}    url: redis://127.0.0.1:6379/0\n    on_unavailable: wait\n"
    ));
    assert!(
        err.contains("session_affinity.store.on_unavailable"),
        "{err}"
    );

    let err = config_error(&format!(
        "{base}    url: redis://127.0.0.1:6379/0\n  max_bindings: 10\n"
    ));
    assert!(err.contains("max_bindings"), "{err}");
    assert!(err.contains("maxmemory"), "{err}");

    // The good form parses, with its defaults.
    let config =
        RouterConfig::from_yaml_str(&format!("{base}    url: redis://127.0.0.1:6379/0\n"), None)
            .unwrap();
    match config.session_store {
        router_host::config::SessionStoreConfig::Redis(r) => {
            assert_eq!(r.key_prefix, "router:");
            assert_eq!(r.timeout, Duration::from_millis(50));
            assert_eq!(r.on_unavailable, OnStoreUnavailable::Route);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn check_connect_store_reports_reachable_and_unreachable_stores() {
    let Some((server, dir)) = server("check_connect_store") else {
        return;
    };
    let good = common::write(
        &dir,
        "good.yaml",
        &format!(
            "session_affinity:\n  mode: soft\n  store:\n    kind: redis\n    url: {}\n",
            server.url()
        ),
    );
    let (code, out, err) =
        common::run_cli(&["check", "-c", good.to_str().unwrap(), "--connect-store"]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("connected: redis"), "{out}");
    let (code, out, _) = common::run_cli(&["check", "-c", good.to_str().unwrap()]);
    assert_eq!(code, 0);
    assert!(out.contains("not connected (add --connect-store)"), "{out}");

    // A port nobody listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let bad = common::write(
        &dir,
        "bad.yaml",
        &format!(
            "session_affinity:\n  mode: soft\n  store:\n    kind: redis\n    url: redis://127.0.0.1:{port}/0\n"
        ),
    );
    let (code, _, err) =
        common::run_cli(&["check", "-c", bad.to_str().unwrap(), "--connect-store"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("bad.yaml"), "{err}");
    assert!(err.contains(&format!("127.0.0.1:{port}")), "{err}");
    assert!(err.to_lowercase().contains("refused"), "{err}");
}

/// `EVALSHA` + `EVAL` calls the server has answered since its stats were reset.
fn script_calls(con: &mut redis::Connection) -> u64 {
    let info: String = redis::cmd("INFO").arg("commandstats").query(con).unwrap();
    info.lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

#[test]
fn a_turn_that_stays_on_its_binding_costs_one_round_trip() {
    let Some((server, _dir)) = server("one_round_trip") else {
        return;
    };
    let mut cfg = config(&server, "t10:");
    // No heartbeat during the test (its renewals would be counted too).
    cfg.lease = Duration::from_secs(3_000);
    let a = store(&cfg, BindingMode::Soft, Duration::from_secs(600));
    let b = store(&cfg, BindingMode::Soft, Duration::from_secs(600));
    // Load the scripts on both (a first call may fall back from EVALSHA to EVAL).
    for s in [&a, &b] {
        let lease = s.lookup("warm").unwrap();
        s.dispatched(&lease, row(1)).unwrap();
    }
    let mut con = server.connection();
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut con)
        .unwrap();

    // A new session: lookup, then the create.
    let lease = a.lookup("one").unwrap();
    assert_eq!(
        a.dispatched(&lease, row(1)).unwrap(),
        DispatchOutcome::Created
    );
    assert_eq!(script_calls(&mut con), 2);
    // Its next turn on the other replica, staying on the binding: the lookup only.
    let lease = b.lookup("one").unwrap();
    assert_eq!(b.dispatched(&lease, row(1)).unwrap(), DispatchOutcome::Kept);
    assert_eq!(script_calls(&mut con), 3);
    // And that lookup took B's lease: the session is held by both replicas now.
    let fields: Vec<String> = redis::cmd("HKEYS")
        .arg("t10:s:one")
        .query(&mut con)
        .unwrap();
    assert_eq!(
        fields.iter().filter(|f| f.starts_with("l:")).count(),
        2,
        "{fields:?}"
    );
    // A turn routed elsewhere needs the compare-and-swap: a second round trip.
    let lease = b.lookup("one").unwrap();
    assert!(matches!(
        b.dispatched(&lease, row(2)).unwrap(),
        DispatchOutcome::Moved { .. }
    ));
    assert_eq!(script_calls(&mut con), 5);
}
