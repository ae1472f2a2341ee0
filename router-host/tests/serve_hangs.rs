//! `router-host serve` with a policy call that never returns: at most the request it was
//! deciding is lost, never the server. The call hangs in a request's own `pick`, in the
//! `on_complete` hook after a request was answered, or in the `pick` of a queued request that a
//! release re-evaluates (a drain). With one worker thread every such call is handed off
//! (`block_in_place`), since a call made inline on that thread would stop the server (and the
//! engine stand-in beside it) for good. With two, the first one runs inline (serve/offload.rs)
//! and holds its worker for good, and the other worker must keep serving: nothing the hung task
//! had woken may be stranded behind it (the remote tokenizer's connection is), and the queues
//! must keep moving. The test's client runs on a runtime of its own, so its timeouts fire
//! whatever happens to the server's.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::engine::{client, header, post, workers_yaml, Engine, TestRouter};
use serde_json::json;

/// Far more than a hang threshold of 100 ms plus the watchdog's ticks needs on a loaded machine.
const LIMIT: Duration = Duration::from_secs(30);

/// Where the policy blocks for good.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Hang {
    /// In the first request's `pick`: that request is never answered.
    Pick,
    /// In the first `on_complete`, after its request was answered.
    Complete,
    /// In the `pick` of a queued request, re-evaluated when the request ahead of it was
    /// prefilled: the queued one gets a 503 once its queue wait and the stall limit are over.
    Drain,
}

#[test]
fn a_pick_that_never_returns_costs_its_request_not_the_server() {
    hung_call_costs_at_most_its_request(1, Hang::Pick);
}

#[test]
fn a_pick_that_never_returns_on_one_of_two_workers_costs_its_request_not_the_server() {
    hung_call_costs_at_most_its_request(2, Hang::Pick);
}

#[test]
fn an_on_complete_that_never_returns_costs_nothing_but_the_server_goes_on() {
    hung_call_costs_at_most_its_request(1, Hang::Complete);
}

#[test]
fn an_on_complete_that_never_returns_on_one_of_two_workers_costs_nothing() {
    hung_call_costs_at_most_its_request(2, Hang::Complete);
}

#[test]
fn a_pick_that_never_returns_in_a_queue_drain_costs_its_request_not_the_queue() {
    hung_call_costs_at_most_its_request(1, Hang::Drain);
}

#[test]
fn a_pick_that_never_returns_in_a_drain_on_one_of_two_workers_costs_its_request_not_the_queue() {
    hung_call_costs_at_most_its_request(2, Hang::Drain);
}

/// The server runs on `workers` threads; its policy blocks for good where `hang` says.
fn hung_call_costs_at_most_its_request(workers: usize, hang: Hang) {
    // Never dropped on a failed assertion: dropping a runtime waits for its worker, which a
    // parked call holds for good.
    let server = std::mem::ManuallyDrop::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .enable_all()
            .build()
            .unwrap(),
    );
    let (parameters, classes) = match hang {
        Hang::Pick => ("{at: pick}", ""),
        Hang::Complete => ("{at: complete}", ""),
        // Busy while any prompt is being prefilled: the second request queues.
        Hang::Drain => (
            "{at: pick, after: 1}",
            "policy_classes:\n  - {name: default, prefill_busy_threshold: 0, max_queue_wait_ms: 10000}\n",
        ),
    };
    let (engine, router) = server.block_on(async {
        let engine = Engine::start(1).await;
        let yaml = format!(
            "block_size: 4\nplugins:\n  - path: {}\nworker_selection:\n  aggregated: stuck\n  instances:\n    - {{name: stuck, type: hangs, parameters: {parameters}, hang_after_ms: 100}}\n{classes}{}",
            common::plugin("fixture_faulty").display(),
            workers_yaml(&[&engine])
        );
        let router = TestRouter::start(&format!("serve_hangs_{hang:?}_{workers}"), &yaml).await;
        (engine, router)
    });
    let head_delay = |ms| {
        engine
            .state
            .controls
            .head_delay_ms
            .store(ms, Ordering::SeqCst)
    };
    let url = router.url("/v1/completions");
    let body = json!({"model": "tiny", "prompt": "hello"});

    let client_side = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    client_side.block_on(async {
        let answered_by = |response: reqwest::Response, policy: &'static str| async move {
            let status = response.status();
            let decided = header(&response, "x-router-policy");
            let text = response.text().await.expect("the whole body");
            assert_eq!(status, 200, "{text}");
            assert_eq!(decided, policy, "{text}");
        };
        let lost = |request| async move {
            let lost = tokio::time::timeout(Duration::from_secs(2), request).await;
            assert!(lost.is_err(), "the hung request was answered: {lost:?}");
        };
        match hang {
            Hang::Pick => lost(post(&client(), &url, &body)).await,
            Hang::Complete => {
                let response = tokio::time::timeout(LIMIT, post(&client(), &url, &body))
                    .await
                    .expect("answered before its hook hangs");
                answered_by(response, "hangs").await;
            }
            Hang::Drain => {
                // The first request is in prefill for a while, so the second queues; the
                // first one's first byte re-evaluates the second, whose pick hangs.
                head_delay(500);
                let first = tokio::spawn({
                    let (url, body) = (url.clone(), body.clone());
                    async move { post(&client(), &url, &body).await }
                });
                let waiting = common::engine::eventually(LIMIT, || router.in_flight() == (1, 1));
                assert!(waiting.await, "the first request is in flight");
                // Given up after its 10 s wait and the 100 ms stall limit (the longest
                // hang_after_ms): told why, not left hanging.
                let stalled = tokio::time::timeout(LIMIT, post(&client(), &url, &body))
                    .await
                    .expect("the stalled request is answered");
                assert_eq!(stalled.status(), 503);
                let error: serde_json::Value =
                    serde_json::from_slice(&stalled.bytes().await.expect("a body")).expect("JSON");
                assert_eq!(error["error"]["code"], "policy_stalled", "{error}");
                let response = tokio::time::timeout(LIMIT, first)
                    .await
                    .expect("the first request was answered")
                    .expect("its task");
                answered_by(response, "hangs").await;
                // Long enough that requests sent together queue behind each other, short
                // enough that 16 of them wait well under 10 s.
                head_delay(100);
            }
        }
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
        let answered = |response| answered_by(response, "default");
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
        if hang == Hang::Drain {
            // Sent together, most of the 16 queued (only one prompt is prefilled at a time):
            // drains after the hung one dispatched them.
            let admitted = router.metric("router_queue_total{outcome=\"admitted\"}");
            assert!(admitted >= 1.0, "{}", router.handle.metrics_text());
            // The hung one's lane moved on without it, once.
            let stalled = router.metric("router_queue_stalled_total");
            assert_eq!(stalled, 1.0, "{}", router.handle.metrics_text());
            assert_eq!(
                router.handle.loaded().host.core().admission_stats().waiting,
                0
            );
        }
        let health = tokio::time::timeout(LIMIT, client().get(router.url("/health")).send())
            .await
            .expect("/health answered")
            .unwrap();
        assert_eq!(health.status(), 200);
    });
    // The parked call never returns; the runtime is not waited for.
    drop((router, engine));
    std::mem::ManuallyDrop::into_inner(server).shutdown_background();
}
