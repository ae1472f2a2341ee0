//! `router-host serve` over real sockets against stand-in engines: pass-through, decision
//! headers, sessions, hostile bodies, retries, models, health and metrics.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::engine::{client, eventually, post, stream_chunks, workers_yaml, Engine, TestRouter};
use serde_json::{json, Value};

const ROUND_ROBIN: &str = "\
worker_selection:
  aggregated: rr
  instances:
    - name: rr
      type: round-robin
";

fn header<'a>(response: &'a reqwest::Response, name: &str) -> &'a str {
    response
        .headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_is_passed_through_byte_for_byte_with_the_usage_chunk() {
    let engine = Engine::start(1).await;
    engine.state.controls.chunks.store(5, Ordering::SeqCst);
    let yaml = format!("block_size: 4\n{}", workers_yaml(&[&engine]));
    let router = TestRouter::start("serve_stream_bytes", &yaml).await;
    let http = client();
    for (path, body, chat) in [
        (
            "/v1/completions",
            json!({"model": "tiny", "prompt": "the quick brown fox jumps over the lazy dog",
                   "stream": true, "stream_options": {"include_usage": true}}),
            false,
        ),
        (
            "/v1/chat/completions",
            json!({"model": "tiny", "messages": [{"role": "user", "content": "hello world"}],
                   "stream": true, "stream_options": {"include_usage": true}}),
            true,
        ),
    ] {
        let direct = post(&http, &format!("{}{path}", engine.url()), &body).await;
        let direct_bytes = direct.bytes().await.unwrap();
        let via = post(&http, &router.url(path), &body).await;
        assert_eq!(via.status(), 200);
        assert_eq!(
            header(&via, "content-type"),
            "text/event-stream; charset=utf-8"
        );
        assert_eq!(header(&via, "x-router-worker"), "1");
        let via_bytes = via.bytes().await.unwrap();
        assert_eq!(
            via_bytes, direct_bytes,
            "{path}: the router changed the stream"
        );
        let expected: String = stream_chunks(1, chat, 5, true).concat();
        assert_eq!(String::from_utf8_lossy(&via_bytes), expected);
        assert!(expected.contains("\"usage\""), "the usage chunk is there");
    }
    // Non-streaming too.
    let body = json!({"model": "tiny", "prompt": "hello world"});
    let direct = post(&http, &format!("{}/v1/completions", engine.url()), &body)
        .await
        .bytes()
        .await
        .unwrap();
    let via = post(&http, &router.url("/v1/completions"), &body).await;
    assert_eq!(header(&via, "content-type"), "application/json");
    assert_eq!(via.bytes().await.unwrap(), direct);
    assert!(
        eventually(Duration::from_secs(5), || router.in_flight() == (0, 0)).await,
        "every booking released: {:?}",
        router.in_flight()
    );
    assert_eq!(
        router.metric("router_requests_total{endpoint=\"completions\",outcome=\"completed\"}"),
        2.0
    );
    assert_eq!(
        router.metric("router_requests_total{endpoint=\"chat_completions\",outcome=\"completed\"}"),
        1.0
    );
    // One connection for three requests in a row: the client finishes a body only after the
    // router has pooled its connection (the last chunk goes out after that).
    assert_eq!(
        router.metric("router_upstream_connections_total{connection=\"new\"}"),
        1.0
    );
    assert_eq!(
        router.metric("router_upstream_connections_total{connection=\"reused\"}"),
        2.0
    );
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decision_headers_name_the_row_instance_policy_and_reason() {
    let (e1, e2) = (Engine::start(1).await, Engine::start(2).await);
    let yaml = format!(
        "block_size: 4\ndefault_selector: {{tie_break: lowest_row}}\n{}",
        workers_yaml(&[&e1, &e2])
    );
    let router = TestRouter::start("serve_decision_headers", &yaml).await;
    let http = client();
    let response = post(
        &http,
        &router.url("/v1/completions"),
        &json!({"model": "tiny", "prompt": "hello"}),
    )
    .await;
    assert_eq!(response.status(), 200);
    assert_eq!(header(&response, "x-router-worker"), "1"); // idle tie: lowest id
    assert_eq!(header(&response, "x-router-dp-rank"), "0");
    assert_eq!(header(&response, "x-router-instance"), "default");
    assert_eq!(header(&response, "x-router-policy"), "default");
    assert_eq!(header(&response, "x-router-reason"), "lowest_cost");
    assert_eq!(header(&response, "x-router-config"), "1");
    assert_eq!(header(&response, "x-engine-id"), "1");
    let _ = response.bytes().await;
    assert!(
        router.metric(
            "router_decisions_total{instance=\"default\",policy=\"default\",reason=\"lowest_cost\",fallback=\"false\"}"
        ) >= 1.0
    );
    router.stop().await;

    // Off: no x-router-* headers.
    let yaml = format!(
        "block_size: 4\nserve:\n  decision_headers: false\n{}",
        workers_yaml(&[&e1])
    );
    let router = TestRouter::start("serve_decision_headers_off", &yaml).await;
    let response = post(
        &http,
        &router.url("/v1/completions"),
        &json!({"model": "tiny", "prompt": "hello"}),
    )
    .await;
    assert_eq!(response.status(), 200);
    assert!(response
        .headers()
        .keys()
        .all(|k| !k.as_str().starts_with("x-router-")));
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_sticks_to_its_worker_while_others_are_spread() {
    let (e1, e2) = (Engine::start(1).await, Engine::start(2).await);
    let yaml = format!(
        "block_size: 4\n{ROUND_ROBIN}session_affinity:\n  mode: hard\n{}",
        workers_yaml(&[&e1, &e2])
    );
    let router = TestRouter::start("serve_sessions", &yaml).await;
    let http = client();
    let ask = |session: Option<&'static str>, user: Option<&'static str>| {
        let http = http.clone();
        let url = router.url("/v1/completions");
        async move {
            let mut body = json!({"model": "tiny", "prompt": "tell me a story"});
            if let Some(user) = user {
                body["user"] = json!(user);
            }
            let mut request = http
                .post(url)
                .header("content-type", "application/json")
                .body(body.to_string());
            if let Some(session) = session {
                request = request.header("x-session-id", session);
            }
            let response = request.send().await.unwrap();
            assert_eq!(response.status(), 200);
            let worker = header(&response, "x-router-worker").to_owned();
            let outcome = header(&response, "x-router-session").to_owned();
            let _ = response.bytes().await;
            (worker, outcome)
        }
    };
    let (first, outcome) = ask(Some("conversation-a"), None).await;
    assert_eq!(outcome, "created");
    let mut anonymous = std::collections::BTreeSet::new();
    for _ in 0..6 {
        let (worker, outcome) = ask(Some("conversation-a"), None).await;
        assert_eq!(worker, first, "the session stays on its worker");
        assert_eq!(outcome, "kept");
        // Two in a row: the round-robin counter also moves on the pinned requests.
        anonymous.insert(ask(None, None).await.0);
        anonymous.insert(ask(None, None).await.0);
    }
    assert_eq!(anonymous.len(), 2, "requests without a session are spread");
    // The body field `user` is a session too, when no header is given.
    let (by_user, outcome) = ask(None, Some("someone")).await;
    assert_eq!(outcome, "created");
    for _ in 0..3 {
        assert_eq!(
            ask(None, Some("someone")).await,
            (by_user.clone(), "kept".to_owned())
        );
    }
    let sessions = router.handle.loaded().host.sessions().map(|t| t.len());
    assert_eq!(sessions, Some(2));
    assert!(router.metric("router_session_bindings_total{outcome=\"kept\"}") >= 9.0);
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_bodies_get_a_clear_4xx_and_change_no_state() {
    let engine = Engine::start(1).await;
    let yaml = format!(
        "block_size: 4\nsession_affinity:\n  mode: soft\nserve:\n  max_body_bytes: 1048576\n  max_prompt_tokens: 2000\n{}",
        workers_yaml(&[&engine])
    );
    let router = TestRouter::start("serve_hostile", &yaml).await;
    let http = client();
    let url = router.url("/v1/completions");
    let chat_url = router.url("/v1/chat/completions");
    let huge_words = "the ".repeat(3000);
    let many_ids: Vec<u32> = (0..2500).collect();
    let cases: Vec<(&str, String, u16, &str)> = vec![
        (
            url.as_str(),
            "this is not json".into(),
            400,
            "not valid JSON",
        ),
        (
            url.as_str(),
            "[1, 2, 3]".into(),
            400,
            "must be a JSON object",
        ),
        (
            url.as_str(),
            r#"{"prompt": "hi"}"#.into(),
            400,
            "`model` is required",
        ),
        (
            url.as_str(),
            r#"{"model": 7, "prompt": "hi"}"#.into(),
            400,
            "`model` must be a string",
        ),
        (
            url.as_str(),
            r#"{"model": "tiny"}"#.into(),
            400,
            "`prompt` is required",
        ),
        (
            url.as_str(),
            r#"{"model": "tiny", "prompt": {"a": 1}}"#.into(),
            400,
            "`prompt` must be",
        ),
        (
            url.as_str(),
            r#"{"model": "tiny", "prompt": "hi", "stream": "yes"}"#.into(),
            400,
            "`stream` must be a boolean",
        ),
        (
            url.as_str(),
            r#"{"model": "tiny", "prompt": [1, -1]}"#.into(),
            400,
            "token ids",
        ),
        (
            chat_url.as_str(),
            r#"{"model": "tiny", "messages": "hi"}"#.into(),
            400,
            "`messages` must be",
        ),
        (
            chat_url.as_str(),
            r#"{"model": "tiny", "messages": [{"content": "x"}]}"#.into(),
            400,
            "role",
        ),
        (
            url.as_str(),
            json!({"model": "tiny", "prompt": huge_words}).to_string(),
            400,
            "over the limit of 2000",
        ),
        (
            url.as_str(),
            json!({"model": "tiny", "prompt": many_ids}).to_string(),
            400,
            "over the limit of 2000",
        ),
        (
            url.as_str(),
            format!(
                r#"{{"model": "tiny", "prompt": "{}"}}"#,
                "a".repeat(10 * 1024 * 1024)
            ),
            413,
            "larger than 1048576 bytes",
        ),
    ];
    for (target, body, status, message) in &cases {
        let response = http
            .post(*target)
            .header("content-type", "application/json")
            .header("x-session-id", "hostile")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(
            response.status().as_u16(),
            *status,
            "{}",
            &body[..body.len().min(80)]
        );
        assert_eq!(header(&response, "content-type"), "application/json");
        let error: Value = serde_json::from_slice(&response.bytes().await.unwrap()).unwrap();
        let text = error["error"]["message"].as_str().unwrap_or_default();
        assert!(
            text.contains(message),
            "{status}: {text:?} should contain {message:?}"
        );
        assert!(error["error"]["type"].is_string());
    }
    assert_eq!(engine.state.seen.completions.load(Ordering::SeqCst), 0);
    assert_eq!(router.in_flight(), (0, 0));
    let loaded = router.handle.loaded();
    assert_eq!(loaded.host.sessions().map(|t| t.len()), Some(0));
    assert_eq!(
        loaded.host.policy_set().instance(0).stats.snapshot().picks,
        0
    );
    assert_eq!(
        router.metric("router_requests_total{endpoint=\"completions\",outcome=\"rejected\"}")
            + router.metric(
                "router_requests_total{endpoint=\"chat_completions\",outcome=\"rejected\"}"
            ),
        cases.len() as f64
    );
    // Unknown paths and methods get JSON errors too.
    let response = http.get(router.url("/v2/nothing")).send().await.unwrap();
    assert_eq!(response.status(), 404);
    let response = http
        .get(router.url("/v1/completions"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 405);
    // And it still serves.
    let ok = post(&http, &url, &json!({"model": "tiny", "prompt": "hello"})).await;
    assert_eq!(ok.status(), 200);
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_before_the_first_byte_is_retried_once_on_another_row() {
    let (e1, e2) = (Engine::start(1).await, Engine::start(2).await);
    e1.state.controls.fail_status.store(503, Ordering::SeqCst);
    let yaml = format!(
        "block_size: 4\n{ROUND_ROBIN}serve:\n  health:\n    interval_ms: 60000\n{}",
        workers_yaml(&[&e1, &e2])
    );
    let router = TestRouter::start("serve_retry", &yaml).await;
    let http = client();
    for _ in 0..4 {
        let response = post(
            &http,
            &router.url("/v1/completions"),
            &json!({"model": "tiny", "prompt": "hello"}),
        )
        .await;
        assert_eq!(response.status(), 200);
        assert_eq!(header(&response, "x-router-worker"), "2");
        let _ = response.bytes().await;
    }
    assert!(e1.state.seen.completions.load(Ordering::SeqCst) >= 1);
    assert!(router.metric("router_retries_total") >= 1.0);
    assert!(eventually(Duration::from_secs(5), || router.in_flight() == (0, 0)).await);

    // Both failing: the client gets the engine's answer after one retry.
    e2.state.controls.fail_status.store(503, Ordering::SeqCst);
    let before = e1.state.seen.completions.load(Ordering::SeqCst)
        + e2.state.seen.completions.load(Ordering::SeqCst);
    let response = post(
        &http,
        &router.url("/v1/completions"),
        &json!({"model": "tiny", "prompt": "hello"}),
    )
    .await;
    assert_eq!(response.status(), 503);
    let _ = response.bytes().await;
    let after = e1.state.seen.completions.load(Ordering::SeqCst)
        + e2.state.seen.completions.load(Ordering::SeqCst);
    assert_eq!(after - before, 2, "one try and one retry");
    assert!(eventually(Duration::from_secs(5), || router.in_flight() == (0, 0)).await);
    router.stop().await;

    // retries: 0 -> no retry.
    e2.state.controls.fail_status.store(0, Ordering::SeqCst);
    let yaml = format!(
        "block_size: 4\n{ROUND_ROBIN}serve:\n  retries: 0\n{}",
        workers_yaml(&[&e1, &e2])
    );
    let router = TestRouter::start("serve_no_retry", &yaml).await;
    let mut statuses = Vec::new();
    for _ in 0..2 {
        let response = post(
            &http,
            &router.url("/v1/completions"),
            &json!({"model": "tiny", "prompt": "hello"}),
        )
        .await;
        statuses.push(response.status().as_u16());
        let _ = response.bytes().await;
    }
    statuses.sort_unstable();
    assert_eq!(statuses, [200, 503]);
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_ready_and_metrics() {
    let engine = Engine::start(1).await;
    let yaml = format!("block_size: 4\n{}", workers_yaml(&[&engine]));
    let router = TestRouter::start("serve_endpoints", &yaml).await;
    let http = client();
    let models: Value = serde_json::from_slice(
        &http
            .get(router.url("/v1/models"))
            .send()
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(models["data"][0]["id"], "tiny");
    assert_eq!(engine.state.seen.models.load(Ordering::SeqCst), 1);
    let health = http.get(router.url("/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let ready = http.get(router.url("/ready")).send().await.unwrap();
    assert_eq!(ready.status(), 200);
    let ready: Value = serde_json::from_slice(&ready.bytes().await.unwrap()).unwrap();
    assert_eq!(ready["engines"][0]["healthy"], true);

    let _ = post(
        &http,
        &router.url("/v1/completions"),
        &json!({"model": "tiny", "prompt": "hello world you are", "stream": true}),
    )
    .await
    .bytes()
    .await;
    let metrics = http.get(router.url("/metrics")).send().await.unwrap();
    assert!(header(&metrics, "content-type").starts_with("application/openmetrics-text"));
    let text = metrics.text().await.unwrap();
    for name in [
        "router_requests_total{endpoint=\"completions\",outcome=\"completed\"} 1",
        "router_inflight_requests{worker=\"1\",dp_rank=\"0\"} 0",
        "router_overhead_seconds_count{stage=\"tokenize\"} 1",
        "router_overhead_seconds_count{stage=\"decide\"} 1",
        "router_overhead_seconds_count{stage=\"total\"} 1",
        "router_booked_active_requests{worker=\"1\",dp_rank=\"0\"} 0",
        "router_booked_prefill_tokens{worker=\"1\",dp_rank=\"0\"} 0",
        "router_queue_depth 0",
        "router_policy_fallbacks_total{instance=\"default\",policy=\"default\"} 0",
        "router_policy_panics_total{instance=\"default\",policy=\"default\"} 0",
        "router_policy_quarantined{instance=\"default\",policy=\"default\"} 0",
        "router_engine_healthy{worker=\"1\",url=",
        "router_config_reloads_total{outcome=\"error\"} 0",
        "router_config_generation 1",
    ] {
        assert!(text.contains(name), "missing {name} in\n{text}");
    }
    // Configured model list: no engine asked.
    router.stop().await;
    let yaml = format!(
        "serve:\n  models: [tiny, other]\n{}",
        workers_yaml(&[&engine])
    );
    let router = TestRouter::start("serve_models_list", &yaml).await;
    let models: Value = serde_json::from_slice(
        &http
            .get(router.url("/v1/models"))
            .send()
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(models["data"][1]["id"], "other");
    assert_eq!(engine.state.seen.models.load(Ordering::SeqCst), 1);
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prompt_is_tokenized_by_the_engine_and_headers_are_forwarded() {
    let (e1, e2) = (Engine::start(1).await, Engine::start(2).await);
    let yaml = format!("block_size: 4\n{}", workers_yaml(&[&e1, &e2]));
    let router = TestRouter::start("serve_remote_tokenize", &yaml).await;
    let http = client();
    let response = http
        .post(router.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("authorization", "Bearer secret")
        .body(
            json!({"model": "tiny", "messages": [{"role": "user", "content": "hello"}]})
                .to_string(),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let _ = response.bytes().await;
    let tokenized = e1.state.seen.tokenize.load(Ordering::SeqCst)
        + e2.state.seen.tokenize.load(Ordering::SeqCst);
    assert_eq!(tokenized, 1);
    let served = if e1.state.seen.completions.load(Ordering::SeqCst) == 1 {
        &e1
    } else {
        &e2
    };
    let headers = served
        .state
        .seen
        .last_headers
        .lock()
        .unwrap()
        .clone()
        .unwrap();
    assert_eq!(headers["authorization"], "Bearer secret");
    // Token ids in the prompt need no tokenizer.
    let response = post(
        &http,
        &router.url("/v1/completions"),
        &json!({"model": "tiny", "prompt": [1, 2, 3, 4, 5, 6, 7, 8]}),
    )
    .await;
    assert_eq!(response.status(), 200);
    let tokenized_after = e1.state.seen.tokenize.load(Ordering::SeqCst)
        + e2.state.seen.tokenize.load(Ordering::SeqCst);
    assert_eq!(tokenized_after, 1);
    router.stop().await;
}
