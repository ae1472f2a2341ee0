//! Two `router-host serve` replicas (real processes of the binary) sharing session bindings
//! through a real `redis-server`, in front of the same stand-in engines (docs/replicas.md).
//!
//! The policy is the built-in default with `tie_break: spread`: on idle engines every turn (its
//! prompt length differs) would land on either worker by the draw, so a session staying on one
//! worker across replicas is the shared binding at work.
//!
//! Every wait polls with a deadline; every process is on 127.0.0.1 and killed on drop.

mod common;
mod support_redis;
mod support_replicas;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::engine::{client, eventually};
use serde_json::{json, Value};
use support_replicas::{rig, Replica};

/// Prompts of different lengths, so that the spread tie-break draws differently per turn.
static TURNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// One turn of `session` through `replica`: (status, worker, session outcome, body).
async fn turn(
    http: &reqwest::Client,
    replica: &Replica,
    session: Option<&str>,
) -> (u16, String, String, Value) {
    let words = 1 + TURNS.fetch_add(1, Ordering::Relaxed) % 29;
    let body = json!({"model": "tiny", "prompt": "hello ".repeat(words), "max_tokens": 4});
    let mut request = http
        .post(replica.url("/v1/completions"))
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(session) = session {
        request = request.header("x-session-id", session);
    }
    let response = request
        .send()
        .await
        .unwrap_or_else(|err| panic!("{err}\n{}", replica.log()));
    let status = response.status().as_u16();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned()
    };
    let (worker, outcome) = (header("x-router-worker"), header("x-router-session"));
    let text = response.text().await.unwrap_or_default();
    let body: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    (status, worker, outcome, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_alternating_between_replicas_stay_on_one_worker() {
    let Some(rig) = rig("replicas_alternate", "").await else {
        return;
    };
    let (a, b) = (Replica::start(&rig.config), Replica::start(&rig.config));
    let http = client();
    for s in 0..6 {
        let session = format!("conv-{s}");
        let mut workers = Vec::new();
        for t in 0..4 {
            let replica = if t % 2 == 0 { &a } else { &b };
            let (status, worker, outcome, body) = turn(&http, replica, Some(&session)).await;
            assert_eq!(status, 200, "{body}");
            let expected = if t == 0 { "created" } else { "kept" };
            assert_eq!(outcome, expected, "session {session} turn {t}");
            workers.push(worker);
        }
        assert!(
            workers.iter().all(|w| *w == workers[0]),
            "session {session} moved between workers: {workers:?}"
        );
    }
    // Without a session the draw does use both workers (so the check above could fail).
    let mut used = std::collections::BTreeSet::new();
    for _ in 0..16 {
        used.insert(turn(&http, &a, None).await.1);
    }
    assert_eq!(used.len(), 2, "{used:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_soft_move_made_by_one_replica_is_followed_by_the_other() {
    let Some(rig) = rig("replicas_move", "").await else {
        return;
    };
    let (a, b) = (Replica::start(&rig.config), Replica::start(&rig.config));
    let http = client();
    let (_, first, _, _) = turn(&http, &a, Some("mover")).await;
    let (from, to) = if first == "1" { (0, "2") } else { (1, "1") };
    // The bound engine goes unhealthy: A routes the next turn elsewhere and moves the binding.
    rig.engines[from]
        .state
        .controls
        .healthy
        .store(false, Ordering::SeqCst);
    let mut moved = false;
    for _ in 0..200 {
        let (status, worker, outcome, _) = turn(&http, &a, Some("mover")).await;
        assert_eq!(status, 200);
        if worker == to {
            assert_eq!(outcome, "moved");
            moved = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        moved,
        "A never routed around the unhealthy engine\n{}",
        a.log()
    );
    // Healthy again: both replicas may use it, yet B follows the moved binding.
    rig.engines[from]
        .state
        .controls
        .healthy
        .store(true, Ordering::SeqCst);
    let seen = rig.engines[from].state.seen.health.load(Ordering::SeqCst);
    assert!(
        eventually(Duration::from_secs(10), || {
            rig.engines[from].state.seen.health.load(Ordering::SeqCst) > seen + 4
        })
        .await,
        "the replicas probe the engine again"
    );
    for _ in 0..4 {
        let (status, worker, outcome, _) = turn(&http, &b, Some("mover")).await;
        assert_eq!(status, 200);
        assert_eq!((worker.as_str(), outcome.as_str()), (to, "kept"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_mid_session_and_both_restarted_keep_the_bindings() {
    let Some(rig) = rig("replicas_kill", "").await else {
        return;
    };
    let http = client();
    let a = Replica::start(&rig.config);
    let b = Replica::start(&rig.config);
    let (_, bound, _, _) = turn(&http, &a, Some("survivor")).await;

    // A request of the session in flight on A (slow engine head), then A is killed.
    for e in &rig.engines {
        e.state
            .controls
            .head_delay_ms
            .store(3_000, Ordering::SeqCst);
    }
    let url = a.url("/v1/completions");
    let slow = tokio::spawn({
        let http = http.clone();
        async move {
            http.post(url)
                .header("content-type", "application/json")
                .header("x-session-id", "survivor")
                .body(json!({"model": "tiny", "prompt": "slow turn"}).to_string())
                .send()
                .await
        }
    });
    let engine = rig
        .engines
        .iter()
        .find(|e| e.state.id.to_string() == bound)
        .unwrap();
    assert!(
        eventually(Duration::from_secs(10), || engine
            .state
            .seen
            .active
            .load(Ordering::SeqCst)
            > 0)
        .await,
        "the slow turn reached the engine"
    );
    a.kill();
    assert!(
        slow.await.unwrap().is_err(),
        "the killed replica's client lost its answer"
    );
    for e in &rig.engines {
        e.state.controls.head_delay_ms.store(0, Ordering::SeqCst);
    }

    // B continues the session on the same worker.
    for _ in 0..3 {
        let (status, worker, outcome, _) = turn(&http, &b, Some("survivor")).await;
        assert_eq!(status, 200);
        assert_eq!(
            (worker.as_str(), outcome.as_str()),
            (bound.as_str(), "kept")
        );
    }

    // Both replicas restarted: the bindings are in Redis, not in them.
    drop(b);
    let a = Replica::start(&rig.config);
    let b = Replica::start(&rig.config);
    for replica in [&a, &b, &a] {
        let (status, worker, outcome, _) = turn(&http, replica, Some("survivor")).await;
        assert_eq!(status, 200);
        assert_eq!(
            (worker.as_str(), outcome.as_str()),
            (bound.as_str(), "kept")
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_racing_on_a_new_session_agree_on_one_binding() {
    let Some(rig) = rig("replicas_race", "").await else {
        return;
    };
    let (a, b) = (Replica::start(&rig.config), Replica::start(&rig.config));
    let http = client();
    for round in 0..10 {
        let session = format!("race-{round}");
        let (first_a, first_b) = tokio::join!(
            turn(&http, &a, Some(&session)),
            turn(&http, &b, Some(&session))
        );
        assert_eq!((first_a.0, first_b.0), (200, 200));
        let outcomes = [first_a.2.as_str(), first_b.2.as_str()];
        assert_eq!(
            outcomes.iter().filter(|o| **o == "created").count(),
            1,
            "round {round}: exactly one replica created the binding: {outcomes:?}"
        );
        // Whoever lost, the binding is one: every later turn, on either replica, goes there.
        let (_, winner, _, _) = turn(&http, &a, Some(&session)).await;
        for replica in [&b, &a, &b] {
            let (_, worker, outcome, _) = turn(&http, replica, Some(&session)).await;
            assert_eq!(
                (worker.as_str(), outcome.as_str()),
                (winner.as_str(), "kept"),
                "round {round}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_and_started_route_mode_keeps_answering() {
    let Some(mut rig) = rig("replicas_outage_route", "").await else {
        return;
    };
    let (a, b) = (Replica::start(&rig.config), Replica::start(&rig.config));
    let http = client();
    let (status, _, outcome, _) = turn(&http, &a, Some("during")).await;
    assert_eq!((status, outcome.as_str()), (200, "created"));

    rig.redis.stop();
    for replica in [&a, &b, &a, &b] {
        let (status, _, outcome, body) = turn(&http, replica, Some("during")).await;
        assert_eq!(status, 200, "route mode answers: {body}");
        assert_eq!(outcome, "not_recorded", "no binding could be recorded");
    }
    let metrics = http
        .get(a.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        common::engine::metric_value(&metrics, "router_session_store_up") == 0.0,
        "{metrics}"
    );
    assert!(
        common::engine::metric_value(&metrics, "router_session_store_degraded_requests_total")
            >= 2.0
    );

    rig.redis.restart();
    // Both reconnect by themselves; the empty Redis gets a fresh binding that both then keep.
    let mut created = false;
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        let (status, _, outcome, _) = turn(&http, &a, Some("after")).await;
        assert_eq!(status, 200);
        if outcome == "created" {
            created = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(created, "A reconnected\n{}", a.log());
    let (_, bound, _, _) = turn(&http, &a, Some("after")).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut followed = false;
    while Instant::now() < deadline {
        let (_, worker, outcome, _) = turn(&http, &b, Some("after")).await;
        if outcome == "kept" {
            assert_eq!(worker, bound);
            followed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(followed, "B reconnected\n{}", b.log());
    // The session store's own account of the outage: one line when it began, one when it
    // ended. (The shared load, on the same store, logs its own outage when one of its rounds
    // falls in it: lines of their own, not counted here.)
    assert_eq!(
        a.log().matches("session store unavailable").count(),
        1,
        "logged once per outage:\n{}",
        a.log()
    );
    assert_eq!(
        a.log().matches("session store reachable again").count(),
        1,
        "{}",
        a.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_and_started_refuse_mode_refuses_sessions_only() {
    let Some(mut rig) = rig("replicas_outage_refuse", "    on_unavailable: refuse\n").await else {
        return;
    };
    let a = Replica::start(&rig.config);
    let http = client();
    assert_eq!(turn(&http, &a, Some("s")).await.0, 200);
    rig.redis.stop();
    let (status, _, _, body) = turn(&http, &a, Some("s")).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "session_store_unavailable", "{body}");
    assert_eq!(body["error"]["type"], "service_unavailable", "{body}");
    let (status, _, _, body) = turn(&http, &a, None).await;
    assert_eq!(
        status, 200,
        "requests without a session are not refused: {body}"
    );

    rig.redis.restart();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut answered = false;
    while Instant::now() < deadline {
        if turn(&http, &a, Some("s")).await.0 == 200 {
            answered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(answered, "reconnected\n{}", a.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_the_shared_bindings_and_takes_a_new_id_tag() {
    let Some(rig) = rig("replicas_reload", "").await else {
        return;
    };
    let yaml = std::fs::read_to_string(&rig.config).expect("config");
    // In process this time (the tests' harness), on this multi-thread runtime.
    let router = common::engine::TestRouter::start("replicas_reload_inproc", &yaml).await;
    let http = client();
    let ask = |session: &'static str| {
        let http = http.clone();
        let url = router.url("/v1/completions");
        async move {
            let response = http
                .post(url)
                .header("content-type", "application/json")
                .header("x-session-id", session)
                .body(
                    json!({"model": "tiny", "prompt": "hello hello", "max_tokens": 2}).to_string(),
                )
                .send()
                .await
                .expect("request");
            let get = |name: &str| {
                response
                    .headers()
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_owned()
            };
            (
                response.status().as_u16(),
                get("x-router-worker"),
                get("x-router-session"),
            )
        }
    };
    let (status, bound, outcome) = ask("reloaded").await;
    assert_eq!((status, outcome.as_str()), (200, "created"));
    let tag_before = router
        .handle
        .loaded()
        .shared_sessions
        .as_ref()
        .expect("redis store")
        .id_tag();
    assert_eq!(router.handle.reload().await.expect("reload"), 2);
    let tag_after = router
        .handle
        .loaded()
        .shared_sessions
        .as_ref()
        .unwrap()
        .id_tag();
    assert_ne!(
        tag_before, tag_after,
        "each configuration draws its own ids"
    );
    for _ in 0..3 {
        let (status, worker, outcome) = ask("reloaded").await;
        assert_eq!(
            (status, worker.as_str(), outcome.as_str()),
            (200, bound.as_str(), "kept")
        );
    }
    router.stop().await;
}
