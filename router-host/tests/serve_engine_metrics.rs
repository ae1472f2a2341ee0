//! `router-host serve` reading its engines' `/metrics`: load that bypasses the router is seen
//! and steers routing, the KV-cache usage is shown, an engine whose `vllm:cache_config_info`
//! block size is not the worker's gets no traffic (also when it comes up after the router), and
//! the event lag is measured. The engines are the real `router-host mock-engine` binary.

mod common;

use std::time::Duration;

use common::engine::{client, eventually, header, post, TestRouter};
use common::mock::{eventually_async, Mock, FAST, WAIT};
use serde_json::{json, Value};

fn yaml(workers: &[(u64, &str)], kv: &[(u64, &str)]) -> String {
    let mut out = String::from(
        "block_size: 4\nserve:\n  health:\n    interval_ms: 100\n  tokenizer: remote\nworkers:\n",
    );
    for (id, url) in workers {
        out.push_str(&format!("  - id: {id}\n    url: {url}\n"));
        if let Some((_, endpoint)) = kv.iter().find(|(k, _)| k == id) {
            out.push_str(&format!("    kv_events:\n      endpoint: {endpoint}\n"));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_that_bypasses_the_router_is_seen_and_steers_routing() {
    // Steps of 20 ms: a request of 300 tokens runs about 6 s. 1000 KV blocks per engine.
    let slow = [
        "--block-size",
        "4",
        "--step-overhead-ms",
        "20",
        "--decode-ms-per-seq",
        "0",
        "--prefill-ms-per-token",
        "0",
        "--kv-blocks",
        "1000",
    ];
    let (m1, m2) = (Mock::start(&slow), Mock::start(&slow));
    // The built-in default weighs active requests only when told to (its default weight is 0,
    // Dynamo's): observed load changes `active_requests`, nothing else.
    let config = yaml(&[(1, &m1.url("")), (2, &m2.url(""))], &[])
        + "default_selector:\n  decode_active_request_weight: 1.0\n";
    let router = TestRouter::start("engine_metrics_bypass", &config).await;
    let http = client();
    // Three streams straight to engine 1: the router books nothing for them.
    let mut streams = Vec::new();
    for i in 0..3u32 {
        let body = json!({"model": "tiny", "prompt": [i, 1, 2, 3, 4, 5, 6, 7], "max_tokens": 300,
                          "stream": true});
        let response = post(&http, &m1.url("/v1/completions"), &body).await;
        assert_eq!(response.status(), 200);
        streams.push(tokio::spawn(response.text()));
    }
    let load = "router_load_active_requests{worker=\"1\",dp_rank=\"0\"}";
    assert!(
        eventually(WAIT, || router.metric(load) == 3.0).await,
        "observed load {}",
        router.metric(load)
    );
    assert_eq!(
        router.metric("router_booked_active_requests{worker=\"1\",dp_rank=\"0\"}"),
        0.0
    );
    // Each holds 2 prompt + 75 output blocks of the 1000: usage 0.231, as the engine says.
    let usage = "router_engine_kv_cache_usage{worker=\"1\",dp_rank=\"0\"}";
    assert!(
        eventually(WAIT, || (router.metric(usage) - 0.231).abs() < 1e-9).await,
        "usage {}",
        router.metric(usage)
    );
    assert!((m1.metric("vllm:kv_cache_usage_perc").await - 0.231).abs() < 1e-9);

    // A new prompt (no overlap anywhere) goes to the idle engine.
    for i in 0..2u32 {
        let body = json!({"model": "tiny", "prompt": [900 + i, 1, 2, 3], "max_tokens": 1});
        let response = post(&http, &router.url("/v1/completions"), &body).await;
        assert_eq!(response.status(), 200);
        assert_eq!(header(&response, "x-router-worker"), "2");
        let _ = response.bytes().await;
    }
    for stream in streams {
        let text = stream.await.expect("task").expect("stream body");
        assert!(text.ends_with("data: [DONE]\n\n"));
    }
    // Finished on the engine: the observed load goes back to what the router booked.
    assert!(eventually(WAIT, || router.metric(load) == 0.0).await);
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_with_another_block_size_gets_no_traffic() {
    let good = ["--block-size", "4"];
    let mut args: Vec<&str> = FAST.to_vec();
    args.extend(good);
    let m1 = Mock::start(&args);
    // Engine 3 is down when the router starts and comes up later with blocks of 8.
    let mut wrong: Vec<&str> = FAST.to_vec();
    wrong.extend(["--block-size", "8"]);
    let m2 = Mock::start(&wrong);
    let mut m3 = Mock::start(&wrong);
    m3.kill();
    let router = TestRouter::start(
        "engine_metrics_block_size",
        &yaml(&[(1, &m1.url("")), (2, &m2.url("")), (3, &m3.url(""))], &[]),
    )
    .await;
    let healthy = |id: u64| router.metric(&format!("router_engine_healthy{{worker=\"{id}\"}}"));
    assert!(
        eventually(WAIT, || healthy(1) == 1.0
            && healthy(2) == 0.0
            && healthy(3) == 0.0)
        .await
    );
    m3.restart();
    let http = client();
    let ready = || async {
        let r = http.get(router.url("/ready")).send().await.expect("ready");
        let v: Value = serde_json::from_slice(&r.bytes().await.expect("body")).expect("JSON");
        v
    };
    // Engine 3 answers its probe now, and is refused for its block size as well.
    let refused = |v: &Value, id: u64| {
        v["engines"].as_array().is_some_and(|engines| {
            engines.iter().any(|e| {
                e["worker"] == id
                    && e["healthy"] == false
                    && e["error"].as_str().is_some_and(|m| {
                        m.contains(&format!("worker {id} "))
                            && m.contains("block_size is 4")
                            && m.contains("blocks of 8 tokens")
                    })
            })
        })
    };
    assert!(
        eventually_async(|| async { refused(&ready().await, 2) && refused(&ready().await, 3) })
            .await,
        "{}",
        ready().await
    );
    for i in 0..4u32 {
        let body = json!({"model": "tiny", "prompt": [i, 1, 2, 3], "max_tokens": 1});
        let response = post(&http, &router.url("/v1/completions"), &body).await;
        assert_eq!(response.status(), 200);
        assert_eq!(header(&response, "x-router-worker"), "1");
        let _ = response.bytes().await;
    }
    assert_eq!(healthy(2), 0.0);
    assert_eq!(healthy(3), 0.0);
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_event_lag_is_measured_from_the_batch_timestamp() {
    use zeromq::{Socket, SocketSend, ZmqMessage};
    let mut args: Vec<&str> = FAST.to_vec();
    args.extend(["--block-size", "4"]);
    let m = Mock::start(&args);
    // A publisher whose batches are stamped 5 s in the past (an engine clock behind, or a
    // batch that waited).
    let mut publisher = zeromq::PubSocket::new();
    let endpoint = match publisher.bind("tcp://127.0.0.1:0").await.expect("bind") {
        zeromq::Endpoint::Tcp(_, port) => format!("tcp://127.0.0.1:{port}"),
        other => panic!("not TCP: {other:?}"),
    };
    let router = TestRouter::start(
        "engine_metrics_lag",
        &yaml(&[(1, &m.url(""))], &[(1, &endpoint)]),
    )
    .await;
    let batches = "router_kv_event_batches_total{worker=\"1\",dp_rank=\"0\"}";
    let deadline = std::time::Instant::now() + WAIT;
    let mut seq = 0u64;
    while router.metric(batches) < 1.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no batch reached the router"
        );
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs_f64()
            - 5.0;
        let mut payload = Vec::new();
        rmpv::encode::write_value(
            &mut payload,
            &rmpv::Value::Array(vec![rmpv::Value::F64(ts), rmpv::Value::Array(vec![])]),
        )
        .expect("encode");
        let frames: Vec<bytes::Bytes> = vec![
            bytes::Bytes::new(),
            bytes::Bytes::copy_from_slice(&seq.to_be_bytes()),
            bytes::Bytes::from(payload),
        ];
        publisher
            .send(ZmqMessage::try_from(frames).expect("frames"))
            .await
            .expect("publish");
        seq += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let lag = router.metric("router_kv_event_lag_seconds{worker=\"1\",dp_rank=\"0\"}");
    assert!((5.0..5.0 + WAIT.as_secs_f64()).contains(&lag), "lag {lag}");
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_capacity_is_learned_from_the_engine_unless_configured() {
    common::logs::logs();
    let mut a: Vec<&str> = FAST.to_vec();
    a.extend(["--block-size", "4", "--kv-blocks", "300"]);
    let mut b: Vec<&str> = FAST.to_vec();
    b.extend(["--block-size", "4", "--kv-blocks", "500"]);
    let (m1, m2) = (Mock::start(&a), Mock::start(&b));
    // Worker 2's capacity is configured: the engine's 500 does not replace it.
    let config = yaml(&[(1, &m1.url("")), (2, &m2.url(""))], &[])
        + "  - id: 3\n    url: http://127.0.0.1:9\n    total_kv_blocks: 7\n";
    let config = config.replacen(
        &format!("    url: {}\n", m2.url("")),
        &format!("    url: {}\n    total_kv_blocks: 64\n", m2.url("")),
        1,
    );
    let router = TestRouter::start("engine_metrics_kv_capacity", &config).await;
    let capacity = |id: u64| {
        router.metric(&format!(
            "router_worker_kv_capacity_blocks{{worker=\"{id}\"}}"
        ))
    };
    assert!(
        eventually(WAIT, || capacity(1) == 300.0).await,
        "worker 1 learned {}",
        capacity(1)
    );
    assert_eq!(capacity(2), 64.0, "configured wins over the engine's");
    // Worker 3 never answers: its configured capacity stands all the same.
    assert_eq!(capacity(3), 7.0);
    // The disagreement is logged, naming both values, once: not at every probe (100 ms).
    let disagreement = || {
        common::logs::log_lines_with("differs from the engine's KV capacity")
            .into_iter()
            .filter(|l| l.contains("worker=2 "))
            .collect::<Vec<_>>()
    };
    assert!(eventually(WAIT, || !disagreement().is_empty()).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let lines = disagreement();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].contains("total_kv_blocks=64") && lines[0].contains("engine_kv_blocks=500"),
        "{}",
        lines[0]
    );
    assert!(common::logs::log_lines_with("worker=1 ")
        .iter()
        .all(|l| !l.contains("differs from the engine's KV capacity")));
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_the_capacity_learned_from_the_engine() {
    let mut a: Vec<&str> = FAST.to_vec();
    a.extend(["--block-size", "4", "--kv-blocks", "300"]);
    let m1 = Mock::start(&a);
    // One probe round runs before the router listens; the next would be a minute later.
    let config = yaml(&[(1, &m1.url(""))], &[]).replace("interval_ms: 100", "interval_ms: 60000");
    let router = TestRouter::start("engine_metrics_kv_capacity_reload", &config).await;
    let capacity = || router.metric("router_worker_kv_capacity_blocks{worker=\"1\"}");
    assert_eq!(capacity(), 300.0, "learned by the probe round at start");
    // The new configuration's core starts without it: the health table hands it over.
    std::fs::write(
        &router.config,
        config.replace("block_size: 4\n", "block_size: 4\n\n"),
    )
    .expect("rewrite the config");
    assert_eq!(router.handle.reload().await.expect("reload"), 2);
    assert_eq!(
        capacity(),
        300.0,
        "kept across the reload, before any probe"
    );
    router.stop().await;
}
