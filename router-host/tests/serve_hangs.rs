//! `router-host serve` with a policy whose `pick` never returns: the request it was deciding is
//! lost, but the server is not. `serve` runs on a runtime with one worker thread, where a
//! decision made inline on that thread would stop the server (and the engine stand-in beside it)
//! for good. The test's client runs on a runtime of its own, so its timeouts fire whatever
//! happens to the server's.

mod common;

use std::time::Duration;

use common::engine::{client, post, workers_yaml, Engine, Router};
use serde_json::json;

/// Far more than a hang threshold of 100 ms plus the watchdog's ticks needs on a loaded machine.
const LIMIT: Duration = Duration::from_secs(30);

#[test]
fn a_pick_that_never_returns_costs_its_request_not_the_server() {
    // Never dropped on a failed assertion: dropping a runtime waits for its worker, which a
    // parked pick holds for good.
    let server = std::mem::ManuallyDrop::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
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
        let router = Router::start("serve_hangs", &yaml).await;
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
        assert!(lost.is_err(), "the hung request was answered");
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

        // The server still answers: the next request goes to the built-in fallback.
        let response = tokio::time::timeout(LIMIT, post(&client(), &url, &body))
            .await
            .expect("serve answered after a hung pick");
        assert_eq!(response.status(), 200);
        assert_eq!(
            response
                .headers()
                .get("x-router-policy")
                .and_then(|v| v.to_str().ok()),
            Some("default")
        );
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
