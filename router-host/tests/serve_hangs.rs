//! `router-host serve` with a policy whose `pick` never returns: the request it was deciding is
//! lost, but the server is not. With one worker thread every decision is handed off
//! (`block_in_place`), since a decision made inline on that thread would stop the server (and
//! the engine stand-in beside it) for good. With two, the first one runs inline
//! (serve/offload.rs) and holds its worker for good, and the other worker must keep serving:
//! nothing the hung task had woken may be stranded behind it (the remote tokenizer's connection
//! is). The test's client runs on a runtime of its own, so its timeouts fire whatever happens to
//! the server's.

mod common;

use std::time::Duration;

use common::engine::{client, post, workers_yaml, Engine, Router};
use serde_json::json;

/// Far more than a hang threshold of 100 ms plus the watchdog's ticks needs on a loaded machine.
const LIMIT: Duration = Duration::from_secs(30);

#[test]
fn a_pick_that_never_returns_costs_its_request_not_the_server() {
    hung_pick_costs_its_request_not_the_server(1);
}

#[test]
fn a_pick_that_never_returns_on_one_of_two_workers_costs_its_request_not_the_server() {
    hung_pick_costs_its_request_not_the_server(2);
}

/// The server runs on `workers` threads; its policy blocks for good in its first pick.
fn hung_pick_costs_its_request_not_the_server(workers: usize) {
    // Never dropped on a failed assertion: dropping a runtime waits for its worker, which a
    // parked pick holds for good.
    let server = std::mem::ManuallyDrop::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .enable_all()
            .build()
            .unwrap(),
    );
    let (engine, router) = server.block_on(async {
        let engine = Engine::start(1).await;
        let yaml = format!(
            "block_size: 4\nplugins:\n  - path: {}\nworker_selection:\n  aggregated: stuck\n  instances:\n    - {{name: stuck, type: hangs, parameters: {{at: pick}}, hang_after_ms: 100}}\n{}",
            common::plugin("fixture_faulty").display(),
            workers_yaml(&[&engine])
        );
        let router = Router::start(&format!("serve_hangs_{workers}"), &yaml).await;
        (engine, router)
    });
    let url = router.url("/v1/completions");
    let body = json!({"model": "tiny", "prompt": "hello"});

    let client_side = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    client_side.block_on(async {
        // The first pick parks its thread for good: that request never gets an answer.
        let lost = tokio::time::timeout(Duration::from_secs(2), post(&client(), &url, &body)).await;
        assert!(lost.is_err(), "the hung request was answered: {lost:?}");
        let hung = "router_policy_hangs_total{instance=\"stuck\",policy=\"hangs\"}";
        let deadline = std::time::Instant::now() + LIMIT;
        while router.metric(hung) != 1.0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the watchdog did not report the hang:\n{}",
                router.handle.metrics_text()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        // The server still answers, one request after another and many at once: the next
        // requests go to the built-in fallback.
        let answered = |response: reqwest::Response| async move {
            let status = response.status();
            let policy = response
                .headers()
                .get("x-router-policy")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let text = response.text().await.expect("the whole body");
            assert_eq!(status, 200, "{text}");
            assert_eq!(policy.as_deref(), Some("default"), "{text}");
        };
        for _ in 0..8 {
            let response = tokio::time::timeout(LIMIT, post(&client(), &url, &body))
                .await
                .expect("serve answered after a hung pick");
            tokio::time::timeout(LIMIT, answered(response))
                .await
                .expect("the body ended");
        }
        let together = futures_util::future::join_all((0..16).map(|_| async {
            let response = post(&client(), &url, &body).await;
            answered(response).await;
        }));
        tokio::time::timeout(LIMIT, together)
            .await
            .expect("serve answered 16 requests at once after a hung pick");
        let health = tokio::time::timeout(LIMIT, client().get(router.url("/health")).send())
            .await
            .expect("/health answered")
            .unwrap();
        assert_eq!(health.status(), 200);
    });
    // The parked pick never returns; the runtime is not waited for.
    drop((router, engine));
    std::mem::ManuallyDrop::into_inner(server).shutdown_background();
}
