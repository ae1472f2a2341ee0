//! `router-host serve`: the request lifecycle on the routing core. Bookings are released
//! whatever way a request ends (client gone mid-stream or while queued, queue timeout, engine
//! down), and an engine that stops answering is routed around until it answers again.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::engine::{client, eventually, post, workers_yaml, Engine, TestRouter};
use futures_util::StreamExt;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_mid_stream_releases_the_booking() {
    let engine = Engine::start(1).await;
    engine.state.controls.chunks.store(50, Ordering::SeqCst);
    engine
        .state
        .controls
        .chunk_delay_ms
        .store(50, Ordering::SeqCst);
    let yaml = format!("block_size: 4\n{}", workers_yaml(&[&engine]));
    let router = TestRouter::start("serve_disconnect_stream", &yaml).await;
    let http = client();
    let response = post(
        &http,
        &router.url("/v1/completions"),
        &json!({"model": "tiny", "prompt": "the quick brown fox jumps over", "stream": true}),
    )
    .await;
    assert_eq!(response.status(), 200);
    let mut body = response.bytes_stream();
    let first = body.next().await.expect("a first chunk").expect("readable");
    assert!(first.starts_with(b"data: "));
    // Mid-stream: booked, prefill released (the first byte came), one in flight.
    assert_eq!(router.in_flight(), (1, 1));
    let loaded = router.handle.loaded();
    let row = router_host::model::RowId {
        worker_id: 1,
        dp_rank: 0,
    };
    let booked = loaded.host.core().booked(row);
    assert_eq!(booked.active_requests, 1);
    assert_eq!(
        booked.active_prefill_tokens, 0,
        "prefill released at the first byte"
    );
    assert!(booked.decode_blocks > 0);
    assert_eq!(
        router.metric("router_inflight_requests{worker=\"1\",dp_rank=\"0\"}"),
        1.0
    );
    drop(body); // the client goes away
    assert!(
        eventually(WAIT, || router.in_flight() == (0, 0)).await,
        "the booking was released: {:?}",
        router.in_flight()
    );
    assert_eq!(loaded.host.core().booked(row).decode_blocks, 0);
    assert_eq!(
        router.metric("router_inflight_requests{worker=\"1\",dp_rank=\"0\"}"),
        0.0
    );
    assert_eq!(
        router.metric("router_requests_total{endpoint=\"completions\",outcome=\"cancelled\"}"),
        1.0
    );
    // The router let go of the upstream stream too.
    assert!(
        eventually(WAIT, || engine
            .state
            .seen
            .streams_cut
            .load(Ordering::SeqCst)
            == 1)
        .await
    );
    router.stop().await;
}

/// A class whose rows are busy while any prompt is being prefilled: a second request queues
/// behind the first, whose engine holds its answer.
fn queue_yaml(engine: &Engine, max_wait_ms: u64) -> String {
    format!(
        "block_size: 4\npolicy_classes:\n  - name: default\n    prefill_busy_threshold: 0\n    max_queue_wait_ms: {max_wait_ms}\n{}",
        workers_yaml(&[engine])
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_timeout_gets_429_with_retry_after_and_books_nothing() {
    let engine = Engine::start(1).await;
    engine
        .state
        .controls
        .head_delay_ms
        .store(1500, Ordering::SeqCst);
    let router = TestRouter::start("serve_queue_timeout", &queue_yaml(&engine, 200)).await;
    let http = client();
    let url = router.url("/v1/completions");
    let body = json!({"model": "tiny", "prompt": "hello world you are"});
    let first = tokio::spawn({
        let (http, url, body) = (http.clone(), url.clone(), body.clone());
        async move { post(&http, &url, &body).await.status() }
    });
    assert!(eventually(WAIT, || router.in_flight() == (1, 1)).await);
    let second = post(&http, &url, &body).await;
    assert_eq!(second.status(), 429);
    assert_eq!(
        second
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok()),
        Some("1")
    );
    let error: serde_json::Value = serde_json::from_slice(&second.bytes().await.unwrap()).unwrap();
    assert_eq!(error["error"]["type"], "rate_limit_error");
    assert!(error["error"]["message"]
        .as_str()
        .unwrap()
        .contains("queue"));
    assert_eq!(router.in_flight(), (1, 1), "the 429 booked nothing");
    assert_eq!(first.await.unwrap(), 200);
    assert!(eventually(WAIT, || router.in_flight() == (0, 0)).await);
    let loaded = router.handle.loaded();
    assert_eq!(loaded.host.core().admission_stats().waiting, 0);
    assert_eq!(
        router.metric("router_requests_total{endpoint=\"completions\",outcome=\"queue_timeout\"}"),
        1.0
    );
    assert_eq!(
        router.metric("router_queue_total{outcome=\"timeout\"}"),
        1.0
    );
    assert_eq!(engine.state.seen.completions.load(Ordering::SeqCst), 1);
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_request_is_admitted_when_the_row_frees_up() {
    let engine = Engine::start(1).await;
    engine
        .state
        .controls
        .head_delay_ms
        .store(300, Ordering::SeqCst);
    let router = TestRouter::start("serve_queue_admit", &queue_yaml(&engine, 20_000)).await;
    let http = client();
    let url = router.url("/v1/completions");
    let body = json!({"model": "tiny", "prompt": "hello world you are", "stream": true});
    let first = tokio::spawn({
        let (http, url, body) = (http.clone(), url.clone(), body.clone());
        async move { post(&http, &url, &body).await.bytes().await.unwrap().len() }
    });
    assert!(eventually(WAIT, || router.in_flight() == (1, 1)).await);
    let second = tokio::spawn({
        let (http, url, body) = (http.clone(), url.clone(), body.clone());
        async move {
            let response = post(&http, &url, &body).await;
            (response.status(), response.bytes().await.unwrap().len())
        }
    });
    let loaded = router.handle.loaded();
    assert!(
        eventually(WAIT, || loaded.host.core().admission_stats().waiting == 1).await,
        "the second request queues while the first is in prefill"
    );
    assert!(first.await.unwrap() > 0);
    let (status, len) = second.await.unwrap();
    assert_eq!(status, 200);
    assert!(len > 0);
    assert!(eventually(WAIT, || router.in_flight() == (0, 0)).await);
    assert_eq!(
        router.metric("router_queue_total{outcome=\"admitted\"}"),
        1.0
    );
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_while_queued_is_removed_from_the_queue() {
    let engine = Engine::start(1).await;
    engine
        .state
        .controls
        .head_delay_ms
        .store(1500, Ordering::SeqCst);
    let router = TestRouter::start("serve_queue_cancel", &queue_yaml(&engine, 60_000)).await;
    let http = client();
    let url = router.url("/v1/completions");
    let body = json!({"model": "tiny", "prompt": "hello world you are"});
    let first = tokio::spawn({
        let (http, url, body) = (http.clone(), url.clone(), body.clone());
        async move { post(&http, &url, &body).await.status() }
    });
    assert!(eventually(WAIT, || router.in_flight() == (1, 1)).await);
    let loaded = router.handle.loaded();
    // The second client gives up after 200 ms, while queued.
    let gave_up = http
        .post(&url)
        .header("content-type", "application/json")
        .body(body.to_string())
        .timeout(Duration::from_millis(200))
        .send()
        .await;
    assert!(gave_up.is_err(), "the client timed out");
    assert!(
        eventually(WAIT, || {
            let stats = loaded.host.core().admission_stats();
            stats.waiting == 0 && stats.cancelled == 1
        })
        .await,
        "removed from the queue: {:?}",
        loaded.host.core().admission_stats()
    );
    assert_eq!(router.in_flight(), (1, 1), "only the first is booked");
    assert_eq!(
        router.metric("router_queue_total{outcome=\"cancelled\"}"),
        1.0
    );
    assert_eq!(
        router.metric("router_requests_total{endpoint=\"completions\",outcome=\"cancelled\"}"),
        1.0
    );
    assert_eq!(first.await.unwrap(), 200);
    assert!(eventually(WAIT, || router.in_flight() == (0, 0)).await);
    assert_eq!(engine.state.seen.completions.load(Ordering::SeqCst), 1);
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_stops_answering_is_routed_around_and_comes_back() {
    let (e1, mut e2) = (Engine::start(1).await, Engine::start(2).await);
    let yaml = format!(
        "block_size: 4\nworker_selection:\n  aggregated: rr\n  instances:\n    - name: rr\n      type: round-robin\nserve:\n  health:\n    interval_ms: 50\n    timeout_ms: 500\n{}",
        workers_yaml(&[&e1, &e2])
    );
    let router = TestRouter::start("serve_engine_down", &yaml).await;
    let http = client();
    let url = router.url("/v1/completions");
    let body = json!({"model": "tiny", "prompt": "hello"});
    let served_by = |response: &reqwest::Response| {
        response
            .headers()
            .get("x-router-worker")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned()
    };
    let mut workers = std::collections::BTreeSet::new();
    for _ in 0..4 {
        let response = post(&http, &url, &body).await;
        workers.insert(served_by(&response));
    }
    assert_eq!(workers.len(), 2, "both engines serve at first");

    e2.stop().await;
    // Every request still succeeds: the first failure is retried on engine 1, and the probe
    // takes engine 2 out.
    for _ in 0..6 {
        let response = post(&http, &url, &body).await;
        assert_eq!(response.status(), 200);
        assert_eq!(served_by(&response), "1");
    }
    let health = router.handle.loaded();
    assert!(
        eventually(WAIT, || {
            router.metric("router_engine_healthy{worker=\"2\"}") == 0.0
                && !health
                    .host
                    .topology()
                    .cluster()
                    .worker(2)
                    .is_some_and(|w| w.available)
        })
        .await
    );
    let ready = http.get(router.url("/ready")).send().await.unwrap();
    assert_eq!(ready.status(), 200, "one engine is enough to be ready");

    e2.restart().await;
    assert!(
        eventually(WAIT, || router
            .metric("router_engine_healthy{worker=\"2\"}")
            == 1.0)
        .await,
        "engine 2 is healthy again"
    );
    let mut workers = std::collections::BTreeSet::new();
    for _ in 0..4 {
        let response = post(&http, &url, &body).await;
        assert_eq!(response.status(), 200);
        workers.insert(served_by(&response));
    }
    assert_eq!(workers.len(), 2, "engine 2 gets requests again");
    assert!(eventually(WAIT, || router.in_flight() == (0, 0)).await);
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_any_mix_of_outcomes_nothing_stays_in_flight() {
    let (e1, e2) = (Engine::start(1).await, Engine::start(2).await);
    e1.state.controls.chunks.store(20, Ordering::SeqCst);
    e1.state.controls.chunk_delay_ms.store(5, Ordering::SeqCst);
    e2.state.controls.head_delay_ms.store(20, Ordering::SeqCst);
    let yaml = format!(
        "block_size: 4\nworker_selection:\n  aggregated: rr\n  instances:\n    - name: rr\n      type: round-robin\nserve:\n  timeouts:\n    response_ms: 100\n{}",
        workers_yaml(&[&e1, &e2])
    );
    let router = TestRouter::start("serve_mix", &yaml).await;
    let http = client();
    let url = router.url("/v1/completions");
    let mut tasks = Vec::new();
    for i in 0..40u64 {
        let (http, url) = (http.clone(), url.clone());
        let e2_state = e2.state.clone();
        tasks.push(tokio::spawn(async move {
            match i % 5 {
                // Streamed to the end.
                0 => {
                    let body = json!({"model": "tiny", "prompt": "hello", "stream": true});
                    let _ = post(&http, &url, &body).await.bytes().await;
                }
                // Client gone after the first chunk.
                1 => {
                    let body = json!({"model": "tiny", "prompt": "hello", "stream": true});
                    let mut stream = post(&http, &url, &body).await.bytes_stream();
                    let _ = stream.next().await;
                }
                // Hostile.
                2 => {
                    let _ = http.post(&url).body("{").send().await;
                }
                // Upstream too slow for the response timeout now and then.
                3 => {
                    e2_state
                        .controls
                        .head_delay_ms
                        .store(if i % 2 == 0 { 500 } else { 0 }, Ordering::SeqCst);
                    let body = json!({"model": "tiny", "prompt": "hello"});
                    let _ = post(&http, &url, &body).await.bytes().await;
                }
                // Client gives up before any answer.
                _ => {
                    let body = json!({"model": "tiny", "prompt": "hello"});
                    let _ = http
                        .post(&url)
                        .body(body.to_string())
                        .timeout(Duration::from_millis(10))
                        .send()
                        .await;
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert!(
        eventually(WAIT, || router.in_flight() == (0, 0)).await,
        "in flight after the mix: {:?}",
        router.in_flight()
    );
    for worker in ["1", "2"] {
        let sample = format!("router_inflight_requests{{worker=\"{worker}\",dp_rank=\"0\"}}");
        assert_eq!(router.metric(&sample), 0.0, "{sample}");
        let booked = format!("router_booked_active_requests{{worker=\"{worker}\",dp_rank=\"0\"}}");
        assert_eq!(router.metric(&booked), 0.0, "{booked}");
    }
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_stops_at_its_deadline_with_a_stream_still_running() {
    let engine = Engine::start(1).await;
    // A stream of about two minutes: far longer than TestRouter::stop waits (30 s).
    engine.state.controls.chunks.store(600, Ordering::SeqCst);
    engine
        .state
        .controls
        .chunk_delay_ms
        .store(200, Ordering::SeqCst);
    let yaml = format!(
        "block_size: 4\nserve:\n  timeouts:\n    shutdown_ms: 300\n{}",
        workers_yaml(&[&engine])
    );
    let router = TestRouter::start("serve_shutdown_deadline", &yaml).await;
    // No client timeout: the stream must be cut by the router's deadline, not by the client.
    let http = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client");
    let url = router.url("/v1/completions");
    let body = json!({"model": "tiny", "prompt": "a long story", "stream": true});
    let stream = tokio::spawn(async move {
        let response = post(&http, &url, &body).await;
        let mut chunks = response.bytes_stream();
        while let Some(Ok(_)) = chunks.next().await {}
    });
    assert!(
        eventually(Duration::from_secs(10), || {
            engine.state.seen.active.load(Ordering::SeqCst) == 1
        })
        .await,
        "the stream never started"
    );
    assert_eq!(router.in_flight().0, 1);
    // `run` returns at the 300 ms deadline although the stream is still running (stop() fails
    // the test if it takes more than 30 s).
    router.stop().await;
    stream.abort();
}
