//! Draining a worker (`workers[].draining`, applied by a reload): it takes no new requests,
//! not even session-bound ones, while requests in flight on it finish; `/ready` shows it.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::engine::{client, header, post, Engine, TestRouter};
use serde_json::{json, Value};

fn yaml(engines: &[&Engine], draining: &[u64]) -> String {
    let mut out = String::from("block_size: 4\nsession_affinity:\n  mode: soft\nworkers:\n");
    for e in engines {
        out.push_str(&format!(
            "  - id: {}\n    url: {}\n    draining: {}\n",
            e.state.id,
            e.url(),
            draining.contains(&e.state.id)
        ));
    }
    out
}

fn completion(session: &str) -> Value {
    json!({"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 4, "user": session})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_worker_takes_no_new_requests_and_finishes_its_own() {
    let one = Engine::start(1).await;
    let two = Engine::start(2).await;
    let router = TestRouter::start("serve_drain", &yaml(&[&one, &two], &[1])).await;
    let http = client();
    let url = router.url("/v1/completions");

    // Worker 1 drains from the start: every request, whatever its session, goes to 2.
    for i in 0..6 {
        let response = post(&http, &url, &completion(&format!("s{i}"))).await;
        assert_eq!(response.status(), 200);
        assert_eq!(header(&response, "x-router-worker"), "2");
    }
    assert_eq!(one.state.seen.completions.load(Ordering::SeqCst), 0);
    let ready = http.get(router.url("/ready")).send().await.expect("ready");
    let ready: Value = serde_json::from_str(&ready.text().await.expect("body")).expect("JSON");
    let draining: Vec<&Value> = ready["engines"]
        .as_array()
        .expect("engines")
        .iter()
        .filter(|e| e["draining"] == true)
        .collect();
    assert_eq!(draining.len(), 1, "{ready}");
    assert_eq!(draining[0]["worker"], 1, "{ready}");
    assert_eq!(ready["ready"], true, "{ready}");

    // A slow stream in flight on 2 while 2 is drained and 1 undrained by a reload.
    two.state.controls.chunks.store(5, Ordering::SeqCst);
    two.state
        .controls
        .chunk_delay_ms
        .store(150, Ordering::SeqCst);
    let stream = {
        let (http, url) = (http.clone(), url.clone());
        tokio::spawn(async move {
            let mut body = completion("s0");
            body["stream"] = json!(true);
            let response = post(&http, &url, &body).await;
            let worker = header(&response, "x-router-worker");
            (worker, response.status(), response.text().await)
        })
    };
    assert!(
        common::engine::eventually(Duration::from_secs(10), || {
            two.state.seen.active.load(Ordering::SeqCst) == 1
        })
        .await,
        "the stream never started on worker 2"
    );
    std::fs::write(&router.config, yaml(&[&one, &two], &[2])).expect("write config");
    router.handle.reload().await.expect("reload");

    // New requests, the session bound to 2 included, go to 1 now.
    for i in 0..4 {
        let response = post(&http, &url, &completion(&format!("s{i}"))).await;
        assert_eq!(response.status(), 200);
        assert_eq!(header(&response, "x-router-worker"), "1");
    }
    // The stream that was in flight on 2 finished whole.
    let (worker, status, text) = tokio::time::timeout(Duration::from_secs(30), stream)
        .await
        .expect("the stream ends within 30 s")
        .expect("stream task");
    assert_eq!((worker.as_str(), status.as_u16()), ("2", 200));
    assert!(text.expect("body").ends_with("data: [DONE]\n\n"));
    assert!(
        common::engine::eventually(Duration::from_secs(10), || router.in_flight() == (0, 0)).await,
        "bookings left: {:?}",
        router.in_flight()
    );

    // Every worker draining: nothing can take a request, and /ready says so.
    std::fs::write(&router.config, yaml(&[&one, &two], &[1, 2])).expect("write config");
    router.handle.reload().await.expect("reload");
    let response = post(&http, &url, &completion("s9")).await;
    assert_eq!(response.status(), 503);
    let ready = http.get(router.url("/ready")).send().await.expect("ready");
    assert_eq!(ready.status(), 503);
    router.stop().await;
}
