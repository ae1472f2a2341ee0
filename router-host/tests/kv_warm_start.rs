//! Warm start (docs/serve.md, "Warm start"): a router that starts in front of an engine that
//! already holds blocks fills its KV index from the engine's replay socket before `/ready`
//! says ready, and `/ready` waits for a replay socket that never answers at most
//! `kv_events.warm_start_ms`. The real `router-host mock-engine` on 127.0.0.1, `serve` in this
//! process.

mod common;

use std::time::{Duration, Instant};

use common::engine::{client, post, TestRouter};
use common::mock::{eventually_async, Mock, FAST, WAIT};
use serde_json::{json, Value};

const DEVICE_BLOCKS: &str = "router_kv_index_blocks{worker=\"1\",dp_rank=\"0\",tier=\"device\"}";

fn mock(replay: bool) -> Mock {
    let mut args = vec!["--kv-events", "tcp://127.0.0.1:0", "--block-size", "4"];
    if replay {
        args.extend_from_slice(&["--replay-endpoint", "tcp://127.0.0.1:0"]);
    }
    args.extend_from_slice(FAST);
    Mock::start(&args)
}

fn yaml(m: &Mock, replay_endpoint: &str, warm_start_ms: u64) -> String {
    format!(
        "block_size: 4\nserve:\n  health:\n    interval_ms: 100\n  tokenizer: remote\nworkers:\n  \
         - id: 1\n    url: {}\n    kv_events:\n      endpoint: {}\n      replay_endpoint: \
         {replay_endpoint}\n      warm_start_ms: {warm_start_ms}\n",
        m.url(""),
        m.kv_events[0]
    )
}

async fn ready(router: &TestRouter) -> (u16, Value) {
    let response = client()
        .get(router.url("/ready"))
        .send()
        .await
        .expect("GET /ready");
    let status = response.status().as_u16();
    let text = response.text().await.unwrap_or_default();
    let body = serde_json::from_str(&text).unwrap_or(Value::Null);
    (status, body)
}

/// Poll `/ready` until it is 200 (at most [`WAIT`]); its body.
async fn wait_ready(router: &TestRouter) -> Value {
    let deadline = Instant::now() + WAIT;
    loop {
        let (status, body) = ready(router).await;
        if status == 200 {
            return body;
        }
        assert!(Instant::now() < deadline, "never ready: {body}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Requests straight to the engine (no router yet): it caches their blocks and publishes
/// them. Returns the blocks it holds as published.
async fn fill(m: &Mock, prompts: u32) -> f64 {
    let http = client();
    for p in 0..prompts {
        let prompt: Vec<u32> = (0..8).map(|i| 1_000 + 10 * p + i).collect();
        let response = post(
            &http,
            &m.url("/v1/completions"),
            &json!({"model": "tiny", "prompt": prompt, "max_tokens": 1}),
        )
        .await;
        assert_eq!(response.status(), 200);
        let _ = response.bytes().await;
    }
    let deadline = Instant::now() + WAIT;
    loop {
        let published = m.published(0).await;
        if published >= f64::from(prompts) {
            return published;
        }
        assert!(
            Instant::now() < deadline,
            "the engine published {published} blocks"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_router_fills_its_index_from_the_replay_buffer_before_it_is_ready() {
    let m = mock(true);
    let filled = fill(&m, 20).await;

    // Without a warm start the router is ready with an empty index: the engine is idle, so
    // nothing it holds is ever published again.
    let cold = TestRouter::start("warm_start_off", &yaml(&m, &m.replay[0], 0)).await;
    let body = wait_ready(&cold).await;
    assert_eq!(body["kv_warm_start"]["rows_warming"], 0, "{body}");
    assert!(
        eventually_async(|| async {
            cold.metric("router_kv_subscriber_connected{worker=\"1\",dp_rank=\"0\"}") == 1.0
        })
        .await
    );
    assert_eq!(cold.metric(DEVICE_BLOCKS), 0.0);
    cold.stop().await;

    // With it: ready only once the index holds every block the engine published.
    let warm = TestRouter::start("warm_start_on", &yaml(&m, &m.replay[0], 10_000)).await;
    let body = wait_ready(&warm).await;
    let published = m.published(0).await;
    assert!(published >= filled);
    assert_eq!(warm.metric(DEVICE_BLOCKS), published, "{body}");
    assert_eq!(
        warm.metric("router_kv_event_replays_total{worker=\"1\",dp_rank=\"0\",kind=\"warm_ok\"}"),
        1.0
    );
    assert_eq!(
        warm.metric("router_kv_index_state{worker=\"1\",dp_rank=\"0\",state=\"current\"}"),
        1.0,
        "{body}"
    );

    // The live batches go on from the replayed ones: in order, nothing lost or cleared.
    let more = fill(&m, 21).await;
    assert!(more > published);
    assert!(
        eventually_async(|| async { warm.metric(DEVICE_BLOCKS) == m.published(0).await }).await,
        "router {} blocks, engine {}",
        warm.metric(DEVICE_BLOCKS),
        m.published(0).await
    );
    assert_eq!(
        warm.metric("router_kv_event_gaps_total{worker=\"1\",dp_rank=\"0\"}"),
        0.0
    );
    assert_eq!(
        warm.metric("router_kv_row_clears_total{worker=\"1\",dp_rank=\"0\",kind=\"restart\"}"),
        0.0
    );
    warm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_waits_for_a_silent_replay_socket_at_most_warm_start_ms() {
    let m = mock(false);
    // Accepts connections (the kernel does) and never says a word.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let endpoint = format!("tcp://{}", silent.local_addr().expect("addr"));
    let started = Instant::now();
    let router = TestRouter::start("warm_start_silent", &yaml(&m, &endpoint, 3_000)).await;
    let (status, body) = ready(&router).await;
    if started.elapsed() < Duration::from_millis(1_500) {
        // Asked well inside the budget: not ready, and saying why.
        assert_eq!(status, 503, "{body}");
        assert_eq!(body["kv_warm_start"]["rows_warming"], 1, "{body}");
    }
    let body = wait_ready(&router).await;
    assert_eq!(body["kv_warm_start"]["rows_warming"], 0, "{body}");
    let ended = |kind: &str| {
        router.metric(&format!(
            "router_kv_event_replays_total{{worker=\"1\",dp_rank=\"0\",kind=\"{kind}\"}}"
        ))
    };
    assert_eq!(ended("warm_timeout") + ended("warm_error"), 1.0);
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "ready in {:?}",
        started.elapsed()
    );
    router.stop().await;
    drop(silent);
}

#[test]
fn warm_start_ms_parses_with_its_default_range_and_place() {
    let base = "workers:\n  - id: 1\n    url: http://127.0.0.1:8101\n    kv_events:\n      \
                endpoint: tcp://127.0.0.1:5557\n";
    let warm = |yaml: &str| {
        router_host::config::RouterConfig::from_yaml_str(yaml, None).map(|c| {
            c.workers[0]
                .kv_events
                .as_ref()
                .map(|k| k.warm_start_ms)
                .unwrap_or_default()
        })
    };
    assert_eq!(
        warm(base).ok(),
        Some(router_host::config::DEFAULT_WARM_START_MS)
    );
    assert_eq!(
        warm(&format!("{base}      warm_start_ms: 0\n")).ok(),
        Some(0)
    );
    for bad in ["60001", "-1", "soon"] {
        match warm(&format!("{base}      warm_start_ms: {bad}\n")) {
            Ok(v) => panic!("accepted {bad} as {v}"),
            Err(err) => {
                let err = err.to_string();
                assert!(err.contains("warm_start_ms"), "{err}");
                assert!(err.contains("line 6"), "{err}");
            }
        }
    }
}
