//! `router-host serve` over capacity: a full admission queue sheds its lowest priority first
//! (the class from `x-router-priority-class`), refuses a newcomer nobody ranks below, and every
//! shed or refused request answers `429` with `retry-after`, `x-router-rejected-reason` and an
//! OpenAI-style body; a row whose engine reports more waiting requests than its class allows is
//! busy, so requests queue (and time out) until the engine catches up.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::engine::{
    client, eventually, header, raw_full, serve_raw, workers_yaml, Engine, TestRouter,
};
use hyper::Method;
use router_core::model::RowId;
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(10);

async fn post_as(
    http: &reqwest::Client,
    url: &str,
    class: Option<&str>,
    body: &Value,
) -> reqwest::Response {
    let mut request = http
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(class) = class {
        request = request.header("x-router-priority-class", class);
    }
    request.send().await.expect("request reaches the router")
}

/// Status, `x-router-rejected-reason`, `retry-after`, the body's `error.code` and `error.type`.
async fn refusal(response: reqwest::Response) -> (u16, String, String, Value, Value) {
    let status = response.status().as_u16();
    let reason = header(&response, "x-router-rejected-reason");
    let retry = header(&response, "retry-after");
    let body: Value = serde_json::from_slice(&response.bytes().await.unwrap()).unwrap();
    (
        status,
        reason,
        retry,
        body["error"]["code"].clone(),
        body["error"]["type"].clone(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_sheds_the_lowest_priority_with_a_reason() {
    let engine = Engine::start(1).await;
    // The first request holds the only row (busy while anything is in prefill).
    engine
        .state
        .controls
        .head_delay_ms
        .store(2000, Ordering::SeqCst);
    let class = |name: &str, priority: i64| {
        format!(
            "  - {{name: {name}, priority: {priority}, prefill_busy_threshold: 0, max_queue_wait_ms: 30000}}\n"
        )
    };
    let yaml = format!(
        "block_size: 4\nmax_queued_requests: 2\npolicy_classes:\n{}{}{}{}",
        class("default", 5),
        class("low", 0),
        class("high", 10),
        workers_yaml(&[&engine])
    );
    let router = TestRouter::start("serve_overload_shed", &yaml).await;
    let http = client();
    let url = router.url("/v1/completions");
    let body = json!({"model": "tiny", "prompt": "hello world you are"});
    let loaded = router.handle.loaded();
    let waiting = || loaded.host.core().admission_stats().waiting;
    let spawn = |class: &'static str| {
        let (http, url, body) = (http.clone(), url.clone(), body.clone());
        tokio::spawn(async move { post_as(&http, &url, Some(class), &body).await })
    };

    let first = {
        let (http, url, body) = (http.clone(), url.clone(), body.clone());
        tokio::spawn(async move { post_as(&http, &url, None, &body).await.status() })
    };
    assert!(eventually(WAIT, || router.in_flight() == (1, 1)).await);
    let older_low = spawn("low");
    assert!(eventually(WAIT, || waiting() == 1).await);
    let newer_low = spawn("low");
    assert!(eventually(WAIT, || waiting() == 2).await);

    // Full, and nothing queued ranks below `low`: refused at once.
    let (status, reason, retry, code, kind) =
        refusal(post_as(&http, &url, Some("low"), &body).await).await;
    assert_eq!(
        (status, reason.as_str(), retry.as_str()),
        (429, "queue_full", "1")
    );
    assert_eq!(
        (code, kind),
        (json!("queue_full"), json!("rate_limit_error"))
    );

    // `high` takes the place of the newest `low`.
    let high = spawn("high");
    let shed = newer_low.await.unwrap();
    let (status, reason, retry, code, _) = refusal(shed).await;
    assert_eq!(
        (status, reason.as_str(), retry.as_str()),
        (429, "shed_for_higher_priority", "1")
    );
    assert_eq!(code, json!("shed_for_higher_priority"));
    assert_eq!(waiting(), 2, "the queue did not grow");
    assert!(!older_low.is_finished());

    // An unknown class is the client's mistake, named with the defined ones.
    let unknown = post_as(&http, &url, Some("gold"), &body).await;
    assert_eq!(unknown.status(), 400);
    let error: Value = serde_json::from_slice(&unknown.bytes().await.unwrap()).unwrap();
    assert_eq!(error["error"]["code"], "unknown_policy_class");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("`gold`") && message.contains("default, low, high"),
        "{message}"
    );

    // The survivors are served once the row frees.
    engine
        .state
        .controls
        .head_delay_ms
        .store(0, Ordering::SeqCst);
    assert_eq!(first.await.unwrap(), 200);
    assert_eq!(high.await.unwrap().status(), 200);
    assert_eq!(older_low.await.unwrap().status(), 200);
    assert!(eventually(WAIT, || router.in_flight() == (0, 0)).await);

    let rejected = |class: &str, reason: &str| {
        router.metric(&format!(
            "router_admission_rejected_total{{class=\"{class}\",reason=\"{reason}\"}}"
        ))
    };
    assert_eq!(rejected("low", "queue_full"), 1.0);
    assert_eq!(rejected("low", "shed_for_higher_priority"), 1.0);
    assert_eq!(router.metric("router_queue_total{outcome=\"shed\"}"), 1.0);
    assert_eq!(
        router.metric("router_requests_total{endpoint=\"completions\",outcome=\"shed\"}"),
        2.0
    );
    let stats = loaded.host.core().admission_stats();
    assert_eq!((stats.shed, stats.refused, stats.waiting), (1, 1, 0));
    assert_eq!(engine.state.seen.completions.load(Ordering::SeqCst), 3);
    router.stop().await;
}

/// An engine that reports `waiting` requests waiting (and no KV usage), and answers
/// completions at once.
async fn reporting_engine(waiting: Arc<AtomicU64>) -> std::net::SocketAddr {
    let (addr, _task) = serve_raw(move |method, path, _body| {
        let waiting = waiting.clone();
        async move {
            match (method, path.as_str()) {
                (Method::GET, "/health") => raw_full(200, &[], ""),
                (Method::GET, "/metrics") => raw_full(
                    200,
                    &[],
                    format!(
                        "vllm:num_requests_running{{engine=\"0\"}} 1.0\n\
                         vllm:num_requests_waiting{{engine=\"0\"}} {}.0\n",
                        waiting.load(Ordering::SeqCst)
                    ),
                ),
                (Method::POST, "/tokenize") => raw_full(
                    200,
                    &[("content-type", "application/json".to_owned())],
                    json!({"tokens": [1, 2, 3], "max_model_len": 4096}).to_string(),
                ),
                (Method::POST, "/v1/completions") => raw_full(
                    200,
                    &[("content-type", "application/json".to_owned())],
                    json!({"choices": [{"index": 0, "text": " ok", "finish_reason": "stop"}]})
                        .to_string(),
                ),
                _ => raw_full(404, &[], ""),
            }
        }
    })
    .await;
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_whose_engine_reports_too_many_waiting_is_busy_until_it_catches_up() {
    let waiting = Arc::new(AtomicU64::new(5));
    let addr = reporting_engine(waiting.clone()).await;
    let yaml = format!(
        "block_size: 16\nserve:\n  health:\n    interval_ms: 50\npolicy_classes:\n  \
         - {{name: default, max_engine_waiting: 2, max_kv_usage: 0.9, max_queue_wait_ms: 300}}\n\
         workers:\n  - id: 1\n    url: http://{addr}\n"
    );
    let router = TestRouter::start("serve_overload_saturated", &yaml).await;
    let loaded = router.handle.loaded();
    let row = RowId {
        worker_id: 1,
        dp_rank: 0,
    };
    let signals = || loaded.host.core().engine_signals(row);
    assert!(eventually(WAIT, || signals().waiting == Some(5)).await);
    // The engine exports no KV usage: that limit has nothing to read, and /metrics says so.
    assert_eq!(signals().kv_usage, None);
    assert_eq!(
        router.metric("router_engine_saturation_unknown_rows{signal=\"kv_usage\"}"),
        1.0
    );
    assert_eq!(
        router.metric("router_engine_saturation_unknown_rows{signal=\"waiting\"}"),
        0.0
    );

    let http = client();
    let url = router.url("/v1/completions");
    let body = json!({"model": "tiny", "prompt": "hello"});
    let (status, reason, retry, code, _) = refusal(post_as(&http, &url, None, &body).await).await;
    assert_eq!(
        (status, reason.as_str(), retry.as_str()),
        (429, "queue_timeout", "1")
    );
    assert_eq!(code, json!("queue_timeout"));
    assert_eq!(
        router.in_flight(),
        (0, 0),
        "the refused request booked nothing"
    );

    // Caught up (2 is not over the limit of 2): routed again.
    waiting.store(2, Ordering::SeqCst);
    assert!(eventually(WAIT, || signals().waiting == Some(2)).await);
    let served = post_as(&http, &url, None, &body).await;
    assert_eq!(served.status(), 200);
    assert_eq!(
        router
            .metric("router_admission_rejected_total{class=\"default\",reason=\"queue_timeout\"}"),
        1.0
    );
    router.stop().await;
}
