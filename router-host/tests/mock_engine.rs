//! `router-host mock-engine` behind `router-host serve`: the real binary on free 127.0.0.1
//! ports, the proxy in this process, and the outcomes a user would check: answers streamed and
//! not, the router's index equal to what the engine published, prefix-cache hits on the
//! engine's own metrics, evictions arriving as removals, data-parallel ranks, a restart, and a
//! lost batch filled from the replay socket.

mod common;

use common::engine::{client, eventually, header, post, TestRouter};
use common::mock::{eventually_async, Mock, FAST, WAIT};
use router_core::blocks::{BlockHasher, Tenant};
use serde_json::{json, Value};

const BLOCK: u32 = 4;

/// A router config for `(worker id, mock, dp_size)`; block size 4, remote tokenizer.
fn yaml(workers: &[(u64, &Mock, u32)], replay: bool) -> String {
    let mut out = format!(
        "block_size: {BLOCK}\nserve:\n  health:\n    interval_ms: 200\n  tokenizer: remote\n\
         workers:\n"
    );
    for (id, mock, dp) in workers {
        out.push_str(&format!(
            "  - id: {id}\n    url: {}\n    dp_size: {dp}\n    kv_events:\n      endpoint: {}\n",
            mock.url(""),
            mock.kv_events[0]
        ));
        if replay {
            out.push_str(&format!("      replay_endpoint: {}\n", mock.replay[0]));
        }
    }
    out
}

fn mock(extra: &[&str]) -> Mock {
    let mut args = vec!["--kv-events", "tcp://127.0.0.1:0", "--block-size", "4"];
    args.extend_from_slice(FAST);
    args.extend_from_slice(extra);
    Mock::start(&args)
}

fn blocks(router: &TestRouter, worker: u64, rank: u32) -> f64 {
    router.metric(&format!(
        "router_kv_index_blocks{{worker=\"{worker}\",dp_rank=\"{rank}\",tier=\"device\"}}"
    ))
}

/// How many leading router ids of `tokens`' full blocks the row holds.
fn held(router: &TestRouter, worker: u64, tokens: &[u32]) -> usize {
    let mut ids = Vec::new();
    BlockHasher::new(BLOCK, Tenant::default())
        .expect("hasher")
        .prompt_blocks(tokens, &mut ids);
    common::engine::held_ids(router, worker, &ids)
}

/// The `data:` payloads of an SSE body, `[DONE]` included.
fn sse(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|event| event.strip_prefix("data: "))
        .map(str::to_owned)
        .collect()
}

/// Until the router's index row holds what the mock published (and that is `at_least`).
async fn index_matches(router: &TestRouter, mock: &Mock, worker: u64, rank: u32, at_least: f64) {
    let ok = eventually_async(|| async {
        let published = mock.published(rank).await;
        published >= at_least && blocks(router, worker, rank) == published
    })
    .await;
    assert!(
        ok,
        "worker {worker} rank {rank}: router holds {} blocks, the mock published {}",
        blocks(router, worker, rank),
        mock.published(rank).await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_streamed_and_not_and_the_index_follows_the_engines() {
    // Worker 2 speaks the legacy array form with 32-byte hashes.
    let m1 = mock(&[]);
    let m2 = mock(&["--legacy-events", "--bytes-hashes"]);
    let router = TestRouter::start(
        "mock_engine_answers",
        &yaml(&[(1, &m1, 1), (2, &m2, 1)], false),
    )
    .await;
    m1.sync(&router, 1, 0).await;
    m2.sync(&router, 2, 0).await;
    let http = client();
    let url = router.url("/v1/completions");
    let queries = "vllm:prefix_cache_queries_total{engine=\"0\"}";
    let hits = "vllm:prefix_cache_hits_total{engine=\"0\"}";
    let before = [
        (m1.metric(queries).await, m1.metric(hits).await),
        (m2.metric(queries).await, m2.metric(hits).await),
    ];

    // 40 bytes: 10 full blocks with the built-in byte tokenizer (asked through /tokenize).
    let prompt = "The quick brown fox jumps over a lazy d.";
    assert_eq!(prompt.len(), 40);
    let response = post(
        &http,
        &url,
        &json!({"model": "tiny", "prompt": prompt, "max_tokens": 5}),
    )
    .await;
    assert_eq!(response.status(), 200);
    let worker: u64 = header(&response, "x-router-worker")
        .parse()
        .expect("worker");
    let answer: Value =
        serde_json::from_slice(&response.bytes().await.expect("body")).expect("JSON");
    assert_eq!(answer["object"], "text_completion");
    assert_eq!(answer["usage"]["prompt_tokens"], 40);
    assert_eq!(answer["usage"]["completion_tokens"], 5);
    assert!(!answer["choices"][0]["text"]
        .as_str()
        .unwrap_or("")
        .is_empty());
    let (m, other) = if worker == 1 { (&m1, 2) } else { (&m2, 1) };
    index_matches(&router, m, worker, 0, 10.0).await;
    assert_eq!(
        held(
            &router,
            worker,
            &prompt.bytes().map(u32::from).collect::<Vec<_>>()
        ),
        10
    );
    assert_eq!(blocks(&router, other, 0), 0.0);

    // The same prompt again, streamed: routed to the row that caches it, served from cache.
    let response = post(
        &http,
        &url,
        &json!({"model": "tiny", "prompt": prompt, "max_tokens": 5, "stream": true,
                "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(response.status(), 200);
    assert_eq!(header(&response, "x-router-worker"), worker.to_string());
    assert!(header(&response, "content-type").starts_with("text/event-stream"));
    let events = sse(&response.text().await.expect("body"));
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("chunk JSON"))
        .collect();
    let texts = chunks
        .iter()
        .filter(|c| c["choices"].as_array().is_some_and(|a| !a.is_empty()))
        .count();
    assert_eq!(texts, 5, "{chunks:?}");
    let usage = &chunks.last().expect("usage chunk")["usage"];
    assert_eq!(usage["completion_tokens"], 5);
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 40);
    // On the engine's own counters (tokens): 80 queried, the second 40 hit.
    let (queries_before, hits_before) = before[(worker - 1) as usize];
    assert_eq!(m.metric(queries).await - queries_before, 80.0);
    assert_eq!(m.metric(hits).await - hits_before, 40.0);

    // Chat, whole and streamed.
    let chat = router.url("/v1/chat/completions");
    let messages = json!([{"role": "user", "content": "Hello there, mock engine!"}]);
    let response = post(
        &http,
        &chat,
        &json!({"model": "tiny", "messages": messages, "max_tokens": 3}),
    )
    .await;
    assert_eq!(response.status(), 200);
    let answer: Value =
        serde_json::from_slice(&response.bytes().await.expect("body")).expect("JSON");
    assert_eq!(answer["object"], "chat.completion");
    assert_eq!(answer["choices"][0]["message"]["role"], "assistant");
    assert_eq!(answer["usage"]["completion_tokens"], 3);
    let response = post(
        &http,
        &chat,
        &json!({"model": "tiny", "messages": messages, "max_tokens": 3, "stream": true}),
    )
    .await;
    assert_eq!(response.status(), 200);
    let events = sse(&response.text().await.expect("body"));
    // Role chunk, 3 content chunks, [DONE] (no usage chunk unless asked).
    assert_eq!(events.len(), 5, "{events:?}");
    let first: Value = serde_json::from_str(&events[0]).expect("JSON");
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let last: Value = serde_json::from_str(&events[3]).expect("JSON");
    assert_eq!(last["choices"][0]["finish_reason"], "length");

    // /v1/models is the engine's list, relayed.
    let models = http
        .get(router.url("/v1/models"))
        .send()
        .await
        .expect("models");
    assert_eq!(models.status(), 200);
    let models: Value = serde_json::from_slice(&models.bytes().await.expect("body")).expect("JSON");
    assert_eq!(models["data"][0]["id"], "tiny");
    assert_eq!(models["data"][0]["max_model_len"], 8192);

    // Hostile sizes get the engine's 400, and the engine goes on.
    for body in [
        json!({"model": "tiny", "prompt": [1, 2], "max_tokens": u64::MAX}),
        json!({"model": "tiny", "prompt": [1, 2], "max_tokens": 0}),
        json!({"model": "tiny", "prompt": (0..9000).collect::<Vec<u32>>()}),
    ] {
        let response = post(&http, &m1.url("/v1/completions"), &body).await;
        assert_eq!(response.status(), 400, "{body}");
    }

    // A wrong model is the engine's 404, relayed.
    let response = post(&http, &url, &json!({"model": "other", "prompt": [1, 2, 3]})).await;
    assert_eq!(response.status(), 404);

    // Both rows hold exactly what their engine published, and nothing stays in flight.
    index_matches(&router, &m1, 1, 0, 0.0).await;
    index_matches(&router, &m2, 2, 0, 0.0).await;
    assert!(
        eventually(WAIT, || router.metric("router_inflight_requests") == 0.0).await,
        "requests left in flight"
    );
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evictions_arrive_as_block_removed() {
    // 12 blocks of 4 tokens; each request takes 4 prompt blocks and 1 output block.
    let m = mock(&["--kv-blocks", "12"]);
    let router = TestRouter::start("mock_engine_evict", &yaml(&[(1, &m, 1)], false)).await;
    m.sync(&router, 1, 0).await;
    let http = client();
    let url = router.url("/v1/completions");
    let prompts: Vec<Vec<u32>> = (0..6u32)
        .map(|p| (0..16).map(|i| 1000 * (p + 1) + i).collect())
        .collect();
    for prompt in &prompts {
        let response = post(
            &http,
            &url,
            &json!({"model": "tiny", "prompt": prompt, "max_tokens": 4}),
        )
        .await;
        assert_eq!(response.status(), 200);
        let _ = response.bytes().await;
    }
    index_matches(&router, &m, 1, 0, 4.0).await;
    assert!(m.published(0).await <= 12.0);
    let removed =
        router.metric("router_kv_events_total{worker=\"1\",dp_rank=\"0\",kind=\"block_removed\"}");
    // 24 prompt blocks stored into 12: at least 12 went.
    assert!(removed >= 12.0, "only {removed} removals");
    // Least recently used first: the first prompt is gone, the last one is there.
    assert_eq!(held(&router, 1, &prompts[0]), 0);
    assert_eq!(held(&router, 1, &prompts[5]), 4);
    assert_eq!(
        router.metric(
            "router_kv_events_ignored_total{worker=\"1\",dp_rank=\"0\",kind=\"unknown_block\"}"
        ),
        0.0
    );
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_dp_rank_publishes_on_its_own_port() {
    let m = mock(&["--dp-size", "2"]);
    assert_eq!(m.kv_events.len(), 2);
    let router = TestRouter::start("mock_engine_dp", &yaml(&[(1, &m, 2)], false)).await;
    m.sync(&router, 1, 0).await;
    m.sync(&router, 1, 1).await;
    let http = client();
    let mut ranks = std::collections::HashSet::new();
    for p in 0..8u32 {
        let prompt: Vec<u32> = (0..12).map(|i| 500 * (p + 1) + i).collect();
        let response = post(
            &http,
            &router.url("/v1/completions"),
            &json!({"model": "tiny", "prompt": prompt, "max_tokens": 2}),
        )
        .await;
        assert_eq!(response.status(), 200);
        ranks.insert(header(&response, "x-router-dp-rank"));
        let _ = response.bytes().await;
    }
    let total = m.published(0).await + m.published(1).await;
    assert!(
        eventually_async(|| async { m.published(0).await + m.published(1).await >= 24.0 }).await,
        "published {total}"
    );
    index_matches(&router, &m, 1, 0, 0.0).await;
    index_matches(&router, &m, 1, 1, 0.0).await;
    // The mock served each request on the rank the router chose (x-data-parallel-rank).
    for rank in ranks {
        let rank: u32 = rank.parse().expect("rank");
        assert!(
            m.published(rank).await > 0.0,
            "rank {rank} got traffic but published nothing"
        );
    }
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_is_detected_and_its_row_rebuilt() {
    let mut m = mock(&[]);
    let router = TestRouter::start("mock_engine_restart", &yaml(&[(1, &m, 1)], false)).await;
    m.sync(&router, 1, 0).await;
    let http = client();
    let url = router.url("/v1/completions");
    let prompt: Vec<u32> = (0..20).collect();
    for _ in 0..3 {
        let response = post(&http, &url, &json!({"model": "tiny", "prompt": prompt})).await;
        assert_eq!(response.status(), 200);
        let _ = response.bytes().await;
    }
    index_matches(&router, &m, 1, 0, 5.0).await;
    // An engine that has run a while: its batch numbers are well past what the restarted one
    // reaches before the subscriber is back (docs/serve.md: otherwise it looks like a gap).
    for n in 0..150u32 {
        let other: Vec<u32> = (0..4).map(|i| 80_000 + 4 * n + i).collect();
        let response = post(
            &http,
            &m.url("/v1/completions"),
            &json!({"model": "tiny", "prompt": other, "max_tokens": 1}),
        )
        .await;
        assert_eq!(response.status(), 200);
    }
    index_matches(&router, &m, 1, 0, 155.0).await;

    m.restart();
    let restarts = "router_kv_row_clears_total{worker=\"1\",dp_rank=\"0\",kind=\"restart\"}";
    // The new process numbers its batches from 0 again: once the subscriber is back, the first
    // one it sees goes backwards.
    let mut n = 0u32;
    let detected = eventually_async(|| {
        n += 1;
        let http = http.clone();
        let url = m.url("/v1/completions");
        let router = &router;
        async move {
            let other: Vec<u32> = (0..4).map(|i| 90_000 + 4 * n + i).collect();
            let body = json!({"model": "tiny", "prompt": other, "max_tokens": 1});
            let _ = post(&http, &url, &body).await;
            tokio::time::sleep(std::time::Duration::from_millis(30)).await;
            router.metric(restarts) >= 1.0
        }
    })
    .await;
    assert!(detected, "the restart was not detected");
    // The old process's blocks are gone from the row; the prompt is stored again on use, once
    // the router's probe has seen the engine back.
    assert_eq!(held(&router, 1, &prompt), 0);
    assert!(
        eventually(WAIT, || router
            .metric("router_engine_healthy{worker=\"1\"}")
            == 1.0)
        .await
    );
    let response = post(&http, &url, &json!({"model": "tiny", "prompt": prompt})).await;
    let status = response.status();
    let body = response.text().await.unwrap_or_default();
    assert_eq!(status, 200, "{body}");
    assert!(eventually(WAIT, || held(&router, 1, &prompt) == 5).await);
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_lost_live_is_filled_from_the_replay_socket() {
    // Batch 60 is kept for replay but never published live.
    let m = mock(&[
        "--replay-endpoint",
        "tcp://127.0.0.1:0",
        "--drop-live",
        "60",
    ]);
    let router = TestRouter::start("mock_engine_replay", &yaml(&[(1, &m, 1)], true)).await;
    m.sync(&router, 1, 0).await;
    let http = client();
    let url = router.url("/v1/completions");
    let mut p = 0u32;
    while m.metric("mock:kv_event_batches_total").await < 64.0 {
        p += 1;
        assert!(p < 500, "the mock did not publish 64 batches");
        let prompt: Vec<u32> = (0..4).map(|i| 100 * p + i).collect();
        let response = post(
            &http,
            &url,
            &json!({"model": "tiny", "prompt": prompt, "max_tokens": 1}),
        )
        .await;
        assert_eq!(response.status(), 200);
        let _ = response.bytes().await;
    }
    index_matches(&router, &m, 1, 0, 1.0).await;
    assert_eq!(
        router.metric("router_kv_event_gaps_total{worker=\"1\",dp_rank=\"0\"}"),
        1.0
    );
    assert_eq!(
        router.metric("router_kv_event_replays_total{worker=\"1\",dp_rank=\"0\",kind=\"ok\"}"),
        1.0
    );
    router.stop().await;
}

/// A `cache_salt` travels as the first block's extra key, as with vLLM: the router roots the
/// chain in the salted tenant, so the salted prompt's ids (the proxy's) are indexed and the
/// same tokens without the salt match nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn salted_prompts_are_indexed_under_their_salt() {
    let m = mock(&[]);
    let router = TestRouter::start("mock_engine_salt", &yaml(&[(1, &m, 1)], false)).await;
    m.sync(&router, 1, 0).await;
    let http = client();
    let prompt: Vec<u32> = (0..8).collect();
    let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 1, "cache_salt": "t1"});
    let response = post(&http, &router.url("/v1/completions"), &body).await;
    assert_eq!(response.status(), 200);
    let _ = response.bytes().await;
    assert!(eventually(WAIT, || blocks(&router, 1, 0) == 2.0).await);
    assert_eq!(m.published(0).await, 2.0);
    let mut salted = Vec::new();
    BlockHasher::new(
        BLOCK,
        Tenant {
            lora: None,
            cache_salt: Some("t1"),
        },
    )
    .expect("hasher")
    .prompt_blocks(&prompt, &mut salted);
    assert_eq!(common::engine::held_ids(&router, 1, &salted), 2);
    assert_eq!(
        held(&router, 1, &prompt),
        0,
        "the unsalted ids match nothing"
    );
    let refused = "router_kv_events_refused_total{worker=\"1\",dp_rank=\"0\",kind=\"extra_keys\"}";
    assert_eq!(router.metric(refused), 0.0);
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokenizer_directory_gives_the_ids_a_real_tokenizer_gives() {
    let dir = common::engine::tokenizer_dir();
    let dir = dir.to_str().expect("utf-8 path");
    let m = mock(&["--tokenizer", dir]);
    // The tests' stand-in engine tokenizes the fixture with its own code.
    let reference = common::engine::Engine::start(9).await;
    let http = client();
    let bodies = [
        json!({"model": "tiny", "prompt": "The capital of France is"}),
        json!({"model": "tiny", "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hello!"}]}),
    ];
    for body in &bodies {
        let response = post(&http, &m.url("/tokenize"), body).await;
        assert_eq!(response.status(), 200);
        let answer: Value =
            serde_json::from_slice(&response.bytes().await.expect("body")).expect("JSON");
        let tokens: Vec<u32> = answer["tokens"]
            .as_array()
            .expect("tokens")
            .iter()
            .map(|t| t.as_u64().expect("id") as u32)
            .collect();
        assert!(!tokens.is_empty());
        let reference_tokens = reference
            .state
            .tokenize(body)
            .expect("the reference tokenizes");
        assert_eq!(tokens, reference_tokens, "{body}");
        assert_eq!(answer["count"], tokens.len());
    }
}

#[test]
fn bad_flags_are_refused_with_the_flag_named() {
    for (args, expected) in [
        (vec!["--block-size", "0"], "--block-size"),
        (vec!["--kv-events", "ipc:///tmp/x"], "--kv-events"),
        (vec!["--max-num-seqs", "0"], "--max-num-seqs"),
        (vec!["--dp-size", "0"], "--dp-size"),
        (vec!["--max-model-len", "0"], "--max-model-len"),
        (vec!["--kv-blocks", "0"], "--kv-blocks"),
        (vec!["--kv-events", "tcp://127.0.0.1:99999"], "--kv-events"),
    ] {
        let mut all = vec!["mock-engine", "--listen", "127.0.0.1:0"];
        all.extend(args.iter());
        let (code, _, stderr) = common::run_cli(&all);
        assert_ne!(code, 0, "{all:?}");
        assert!(stderr.contains(expected), "{all:?}: {stderr}");
    }
}
