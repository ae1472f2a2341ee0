//! Replicas sharing the load they booked through a real `redis-server` (docs/replicas.md,
//! "Shared load"): two `router-host serve` processes in front of the same stand-in engines, and
//! the store side (`SharedLoad`) against the server directly for what other programs may leave
//! in it.
//!
//! The engines hold requests with a head delay: a request booked on a row stays booked there
//! (prompt tokens and KV blocks) until the test lets it go or kills its replica. Every wait
//! polls with a deadline; every process is on 127.0.0.1 and killed on drop.

mod common;
mod support_redis;
mod support_replicas;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::engine::{client, eventually, metric_value};
use router_host::config::{RouterConfig, SessionStoreConfig};
use router_host::model::{RowId, RowLoad};
use router_host::session_store::shared_load::{key_names, SharedLoadError};
use router_host::session_store::{Booked, SharedLoad, Sketch};
use serde_json::json;
use support_redis::RedisServer;
use support_replicas::{rig, Replica, Rig};

const ROW_1: &str = "router_shared_load_active_requests{worker=\"1\",dp_rank=\"0\"}";
const ROW_1_BLOCKS: &str = "router_shared_load_decode_blocks{worker=\"1\",dp_rank=\"0\"}";
const REPLICAS: &str = "router_shared_load_replicas";

/// Held long enough for any test here; the replica or the engine is stopped before.
const HELD_MS: u64 = 60_000;

/// `n` requests through `replica` that engine 1 holds (its head delay), and the tasks that
/// wait for them. Engine 2 is unhealthy meanwhile, so they all book row (1, 0).
async fn hold_on_engine_1(
    rig: &Rig,
    http: &reqwest::Client,
    replica: &Replica,
    n: usize,
) -> Vec<tokio::task::JoinHandle<()>> {
    let (one, two) = (&rig.engines[0], &rig.engines[1]);
    one.state
        .controls
        .head_delay_ms
        .store(HELD_MS, Ordering::SeqCst);
    two.state.controls.healthy.store(false, Ordering::SeqCst);
    let (_, unhealthy) = replica
        .wait_metric(
            http,
            "router_engine_healthy{worker=\"2\"}",
            Duration::from_secs(10),
            |v| v == 0.0,
        )
        .await;
    let before = one.state.seen.active.load(Ordering::SeqCst);
    let mut tasks = Vec::new();
    for i in 0..n {
        let url = replica.url("/v1/completions");
        let http = http.clone();
        let prompt = format!("a long held prompt number {i} ").repeat(8);
        tasks.push(tokio::spawn(async move {
            let _ = http
                .post(url)
                .header("content-type", "application/json")
                .body(json!({"model": "tiny", "prompt": prompt, "max_tokens": 4}).to_string())
                .send()
                .await;
        }));
    }
    assert!(
        eventually(Duration::from_secs(20), || {
            one.state.seen.active.load(Ordering::SeqCst) >= before + n as i64
        })
        .await,
        "the held requests reached engine 1 (engine 2 seen unavailable: {unhealthy})\n{}",
        replica.log()
    );
    two.state.controls.healthy.store(true, Ordering::SeqCst);
    tasks
}

/// Wait until both replicas probed engine 2 healthy again.
async fn engine_2_back(rig: &Rig, http: &reqwest::Client, replicas: &[&Replica]) {
    for replica in replicas {
        let (_, ok) = replica
            .wait_metric(
                http,
                "router_engine_healthy{worker=\"2\"}",
                Duration::from_secs(10),
                |v| v == 1.0,
            )
            .await;
        assert!(ok, "engine 2 available again\n{}", replica.log());
    }
    let _ = rig;
}

/// A short request through `replica`: (status, worker).
async fn ask(http: &reqwest::Client, replica: &Replica, i: usize) -> (u16, String) {
    let response = http
        .post(replica.url("/v1/completions"))
        .header("content-type", "application/json")
        .body(
            json!({"model": "tiny", "prompt": "hi ".repeat(1 + i % 13), "max_tokens": 2})
                .to_string(),
        )
        .send()
        .await
        .unwrap_or_else(|err| panic!("{err}\n{}", replica.log()));
    let worker = response
        .headers()
        .get("x-router-worker")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    (response.status().as_u16(), worker)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replicas_booked_load_steers_the_other_and_leaves_with_it() {
    let Some(rig) = rig("shared_load_steers", "    load_publish_ms: 100\n").await else {
        return;
    };
    let (a, b) = (Replica::start(&rig.config), Replica::start(&rig.config));
    let http = client();
    let held = hold_on_engine_1(&rig, &http, &a, 3).await;

    // B sees A's three requests on row (1, 0), with their KV blocks, within a few rounds.
    let (seen, ok) = b
        .wait_metric(&http, ROW_1, Duration::from_secs(10), |v| v == 3.0)
        .await;
    assert!(ok, "B's view of row 1: {seen}\n{}", b.log());
    assert!(b.metric(&http, ROW_1_BLOCKS).await >= 3.0);
    assert_eq!(b.metric(&http, REPLICAS).await, 1.0);
    assert_eq!(
        a.metric(&http, ROW_1).await,
        0.0,
        "A never counts its own load twice"
    );
    assert_eq!(
        b.metric(
            &http,
            "router_booked_active_requests{worker=\"1\",dp_rank=\"0\"}"
        )
        .await,
        0.0,
        "B publishes only what B booked"
    );

    // B's own decisions: both engines healthy and idle as far as B booked, yet every new
    // request goes to worker 2, because worker 1 carries A's load. (Without the shared load
    // the spread tie-break puts each on either worker.)
    engine_2_back(&rig, &http, &[&a, &b]).await;
    for i in 0..8 {
        let (status, worker) = ask(&http, &b, i).await;
        assert_eq!(
            (status, worker.as_str()),
            (200, "2"),
            "request {i}\n{}",
            b.log()
        );
    }

    // A dies with its requests: B's view drops them within the TTL (1 s at 100 ms rounds).
    a.kill();
    let killed = Instant::now();
    let (left, ok) = b
        .wait_metric(&http, ROW_1, Duration::from_secs(10), |v| v == 0.0)
        .await;
    assert!(
        ok,
        "B still sees {left} requests of the dead replica\n{}",
        b.log()
    );
    assert!(
        killed.elapsed() < Duration::from_secs(8),
        "dropped in {:?}, well past the 1 s TTL",
        killed.elapsed()
    );
    assert_eq!(b.metric(&http, REPLICAS).await, 0.0);
    assert_eq!(
        b.metric(&http, "router_shared_load_outages_total").await,
        0.0
    );
    for task in held {
        task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_booking_publishes_sooner_than_the_period() {
    // Rounds every 10 s (the longest period): without a release neither replica rounds again
    // before 10 s after its start; a release lets each round a quarter period (2.5 s) after
    // its last.
    let Some(rig) = rig("shared_load_early", "    load_publish_ms: 10000\n").await else {
        return;
    };
    let started = Instant::now();
    let (a, b) = (Replica::start(&rig.config), Replica::start(&rig.config));
    let http = client();
    let held = hold_on_engine_1(&rig, &http, &a, 2).await;
    engine_2_back(&rig, &http, &[&a, &b]).await;
    // The held requests keep waiting; new ones on engine 1 answer at once (B, not knowing of
    // A's load yet, may well send some there).
    rig.engines[0]
        .state
        .controls
        .head_delay_ms
        .store(0, Ordering::SeqCst);
    // Short requests through both replicas release bookings on each, until B's view shows
    // A's two held requests.
    let mut i = 0;
    let seen = loop {
        for replica in [&a, &b] {
            let (status, _) = ask(&http, replica, i).await;
            assert_eq!(status, 200, "{}", replica.log());
        }
        i += 1;
        let seen = b.metric(&http, ROW_1).await;
        if seen == 2.0 || started.elapsed() > Duration::from_millis(9_500) {
            break seen;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert_eq!(
        seen,
        2.0,
        "B's view of A's held requests {:?} after start, short of the 10 s period\n{}",
        started.elapsed(),
        b.log()
    );
    eprintln!(
        "B saw A's held requests {:?} after start",
        started.elapsed()
    );
    for task in held {
        task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_keeps_the_view_for_the_ttl_then_routes_on_local_load() {
    // Rounds every 1 s, so the TTL is 5 s: long enough to see the view kept through the
    // beginning of the outage on a busy machine.
    let Some(mut rig) = rig("shared_load_outage", "    load_publish_ms: 1000\n").await else {
        return;
    };
    let (a, b) = (Replica::start(&rig.config), Replica::start(&rig.config));
    let http = client();
    let held = hold_on_engine_1(&rig, &http, &a, 2).await;
    let (seen, ok) = b
        .wait_metric(&http, ROW_1, Duration::from_secs(15), |v| v == 2.0)
        .await;
    assert!(ok, "B's view of row 1: {seen}\n{}", b.log());
    engine_2_back(&rig, &http, &[&a, &b]).await;
    // New requests only to engine 2 from here on (engine 1 holds every request).
    rig.engines[0]
        .state
        .controls
        .healthy
        .store(false, Ordering::SeqCst);
    for replica in [&a, &b] {
        let (_, ok) = replica
            .wait_metric(
                &http,
                "router_engine_healthy{worker=\"1\"}",
                Duration::from_secs(10),
                |v| v == 0.0,
            )
            .await;
        assert!(ok, "engine 1 seen unhealthy\n{}", replica.log());
    }

    rig.redis.stop();
    // The outage is noticed at B's next round; until the TTL passes, the view stays whole.
    let mut kept_while_down = false;
    let deadline = Instant::now() + Duration::from_secs(30);
    let dropped = loop {
        assert!(
            Instant::now() < deadline,
            "B never dropped the view\n{}",
            b.log()
        );
        let text = match http.get(b.url("/metrics")).send().await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(err) => panic!("B answers /metrics during the outage: {err}"),
        };
        let up = metric_value(&text, "router_shared_load_up");
        let age = metric_value(&text, "router_shared_load_view_age_seconds");
        let row = metric_value(&text, ROW_1);
        if up == 0.0 && age < 4.0 {
            assert_eq!(row, 2.0, "a blip does not drop the view (age {age} s)");
            kept_while_down = true;
        }
        if row == 0.0 {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        kept_while_down,
        "the view was seen kept while the store was down"
    );
    assert_eq!(metric_value(&dropped, REPLICAS), 0.0);
    assert_eq!(
        metric_value(&dropped, "router_shared_load_dropped_total"),
        1.0
    );
    assert!(metric_value(&dropped, "router_shared_load_outages_total") >= 1.0);

    // Both keep routing, counted as degraded session-store requests only if they carry one.
    for i in 0..4 {
        for replica in [&a, &b] {
            let (status, worker) = ask(&http, replica, i).await;
            assert_eq!((status, worker.as_str()), (200, "2"), "{}", replica.log());
        }
    }

    // The store back: B reads A's load again, logged once each way.
    rig.redis.restart();
    let (seen, ok) = b
        .wait_metric(&http, ROW_1, Duration::from_secs(20), |v| v == 2.0)
        .await;
    assert!(ok, "B's view after the outage: {seen}\n{}", b.log());
    assert_eq!(b.metric(&http, REPLICAS).await, 1.0);
    let log = b.log();
    assert_eq!(
        log.matches("shared load: the store failed").count(),
        1,
        "{log}"
    );
    assert_eq!(
        log.matches("shared load: store reachable again").count(),
        1,
        "{log}"
    );
    for task in held {
        task.abort();
    }
}

fn row(worker_id: u64) -> RowId {
    RowId {
        worker_id,
        dp_rank: 0,
    }
}

fn load(a: u64, p: u64, d: u64) -> RowLoad {
    RowLoad {
        available: true,
        active_requests: a,
        active_prefill_tokens: p,
        decode_blocks: d,
    }
}

#[test]
fn what_other_programs_leave_in_the_store_is_bounded_refused_and_counted() {
    let Some(binary) = support_redis::available("shared_load_garbage") else {
        return;
    };
    let dir = common::temp_dir("shared_load_garbage");
    let server = RedisServer::start(&binary, &dir, None);
    let mut config = server.store_config("g:", true);
    // A TTL of 10 s: the peer's entry outlives this test's steps on any machine.
    config.load_publish = Duration::from_secs(2);
    let url = server.url();
    let client = || redis::Client::open(url.as_str()).unwrap();
    let me = SharedLoad::new(&config, client(), server.url(), 1);
    let peer = SharedLoad::new(&config, client(), server.url(), 2);
    let known = |r: RowId| r.dp_rank == 0 && (r.worker_id == 1 || r.worker_id == 2);

    // A peer's load is summed per known row; its unknown row is skipped, not refused.
    peer.exchange(
        &[
            (row(1), load(2, 10, 3).into()),
            (row(9), load(5, 5, 5).into()),
        ],
        2,
        &known,
    )
    .expect("peer publishes");
    let view = me
        .exchange(&[(row(2), load(1, 1, 1).into())], 2, &known)
        .expect("exchange");
    assert_eq!(view.replicas, 1);
    assert_eq!(view.rows.get(&row(1)), Some(&load(2, 10, 3)));
    assert_eq!(view.rows.len(), 1, "{view:?}");
    assert_eq!(view.refused, 0);

    // Garbage beside it: a bad field in a peer's hash, a registry entry that is no number,
    // one whose key is a string, one whose hash is far larger than any replica's load.
    let (base, registry) = key_names("g:");
    let mut con = server.connection();
    let far = 4_102_444_800_000u64; // 2100: the entries stay live.
    let _: () = redis::cmd("HSET")
        .arg(format!("{base}2"))
        .arg("not-a-row")
        .arg("1 2 3")
        .query(&mut con)
        .unwrap();
    for member in ["abc", "77", "78"] {
        let _: () = redis::cmd("ZADD")
            .arg(&registry)
            .arg(far)
            .arg(member)
            .query(&mut con)
            .unwrap();
    }
    let _: () = redis::cmd("SET")
        .arg(format!("{base}77"))
        .arg("x".repeat(1000))
        .query(&mut con)
        .unwrap();
    let mut big = redis::cmd("HSET");
    big.arg(format!("{base}78"));
    for i in 0..10_000 {
        big.arg(format!("1:{i}")).arg("1 1 1");
    }
    let _: () = big.query(&mut con).unwrap();
    let view = me.exchange(&[], 2, &known).expect("exchange");
    assert_eq!(view.rows.get(&row(1)), Some(&load(2, 10, 3)), "{view:?}");
    assert_eq!(view.refused, 4, "{view:?}");
    assert_eq!(me.stats().refused, 4);
    let kind: String = redis::cmd("TYPE")
        .arg(format!("{base}77"))
        .query(&mut con)
        .unwrap();
    assert_eq!(kind, "string", "a foreign key is never written");

    // What this replica wrote: its rows, with the TTL; nothing booked = no hash.
    me.exchange(&[(row(2), load(4, 40, 2).into())], 2, &known)
        .unwrap();
    let (fields, ttl): (Vec<String>, i64) = redis::pipe()
        .cmd("HGETALL")
        .arg(me.own_key())
        .cmd("PTTL")
        .arg(me.own_key())
        .query(&mut con)
        .unwrap();
    assert_eq!(fields, ["2:0", "4 40 2"]);
    assert!(ttl > 0 && ttl <= 10_000, "{ttl}");

    // Under deduplicated booking the held block ids go out as a count and a sketch, and
    // blocks both replicas hold count once: the peer's 5 held ids are all this replica's too.
    let ids: Vec<u64> = (1..=5).collect();
    let held = |load, ids: &[u64]| Booked {
        load,
        held: Some((ids.len() as u64, Sketch::of(ids))),
    };
    peer.exchange(&[(row(1), held(load(2, 10, 6), &ids))], 2, &known)
        .unwrap();
    let (peer_fields,): (Vec<String>,) = redis::pipe()
        .cmd("HGETALL")
        .arg(peer.own_key())
        .query(&mut con)
        .unwrap();
    assert_eq!(
        peer_fields,
        [
            "1:0".to_owned(),
            format!("2 10 6 5 {}", Sketch::of(&ids).encode())
        ]
    );
    let view = me.exchange(&[], 2, &known).unwrap();
    assert_eq!(view.rows.get(&row(1)), Some(&load(2, 10, 1)), "{view:?}");
    let mine = Sketch::of(&ids);
    assert_eq!(
        view.load(row(1), Some(&mine)),
        Some(load(2, 10, 1)),
        "held here too"
    );
    assert_eq!(
        view.load(row(1), None),
        Some(load(2, 10, 6)),
        "held there only"
    );

    me.exchange(&[], 2, &known).unwrap();
    let exists: i64 = redis::cmd("EXISTS")
        .arg(me.own_key())
        .query(&mut con)
        .unwrap();
    assert_eq!(exists, 0);

    // The registry replaced by another program's value: refused, left as it is.
    let _: () = redis::cmd("DEL").arg(&registry).query(&mut con).unwrap();
    let _: () = redis::cmd("SET")
        .arg(&registry)
        .arg("mine")
        .query(&mut con)
        .unwrap();
    match me.exchange(&[(row(1), load(1, 1, 1).into())], 2, &known) {
        Err(SharedLoadError::Foreign { key, kind }) => {
            assert_eq!((key.as_str(), kind.as_str()), (registry.as_str(), "string"));
        }
        other => panic!("{other:?}"),
    }
    let value: String = redis::cmd("GET").arg(&registry).query(&mut con).unwrap();
    assert_eq!(value, "mine");

    // The store gone: a clear error, no panic, bounded by the timeout.
    drop(server);
    let started = Instant::now();
    let fresh = SharedLoad::new(&config, client(), "gone".to_owned(), 3);
    assert!(matches!(
        fresh.exchange(&[], 2, &known),
        Err(SharedLoadError::Unreachable(_))
    ));
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn share_load_settings_parse_with_their_defaults_and_places() {
    let base = "session_affinity:\n  mode: soft\n  store:\n    kind: redis\n    url: redis://127.0.0.1:6379/0\n";
    let config = RouterConfig::from_yaml_str(base, None).unwrap();
    let SessionStoreConfig::Redis(r) = config.session_store else {
        panic!("redis")
    };
    assert!(r.share_load, "on by default with a shared store");
    assert_eq!(r.load_publish, Duration::from_millis(20));

    let config = RouterConfig::from_yaml_str(
        &format!("{base}    share_load: false\n    load_publish_ms: 50\n"),
        None,
    )
    .unwrap();
    let SessionStoreConfig::Redis(r) = config.session_store else {
        panic!("redis")
    };
    assert!(!r.share_load);
    assert_eq!(r.load_publish, Duration::from_millis(50));

    for bad in ["0", "19", "10001", "fast"] {
        let err = RouterConfig::from_yaml_str(&format!("{base}    load_publish_ms: {bad}\n"), None)
            .err()
            .unwrap_or_else(|| panic!("accepted {bad}"))
            .to_string();
        assert!(
            err.contains("session_affinity.store.load_publish_ms"),
            "{err}"
        );
        assert!(err.contains("line 6"), "{err}");
    }
    let err = match RouterConfig::from_yaml_str(
        "session_affinity:\n  mode: soft\n  store:\n    kind: memory\n    share_load: true\n",
        None,
    ) {
        Ok(_) => panic!("share_load accepted with a memory store"),
        Err(err) => err.to_string(),
    };
    assert!(
        err.contains("`share_load` only applies to `kind: redis`"),
        "{err}"
    );
}
