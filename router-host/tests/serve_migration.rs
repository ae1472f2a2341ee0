//! Mid-stream failover (`serve.migration_limit`) against mock engines with generated answers:
//! every next token is a function of the whole token prefix, so a stream continued on another
//! engine from the prompt plus the tokens already generated must equal an uninterrupted run,
//! token for token and byte for byte in text. One engine dies after K tokens
//! (`die_after_tokens`: its connection is cut). The last test kills a `router-host mock-engine`
//! process (the engine model, as the chaos test runs it) mid-stream.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::engine::{client, eventually, header, tokenizer_dir, TestRouter};
use serde_json::{json, Value};

const ROUND_ROBIN: &str = "\
worker_selection:
  aggregated: rr
  instances:
    - name: rr
      type: round-robin
";

async fn engine(id: u64) -> mock_engine::Engine {
    let tokenizer = mock_engine::Tokenizer::load(&tokenizer_dir()).expect("the fixture loads");
    mock_engine::Engine::start(mock_engine::Options::generated(id, tokenizer))
        .await
        .expect("the engine starts")
}

fn yaml(engines: &[&mock_engine::Engine], serve: &str) -> String {
    let mut out = format!(
        "block_size: 4\n{ROUND_ROBIN}serve:\n  health:\n    interval_ms: 60000\n{serve}workers:\n"
    );
    for e in engines {
        out.push_str(&format!("  - id: {}\n    url: {}\n", e.state.id, e.url()));
    }
    out
}

fn path(chat: bool) -> &'static str {
    if chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    }
}

fn request(chat: bool, stream: bool, max_tokens: u64, usage: bool) -> Value {
    let mut body = if chat {
        json!({"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story."}]})
    } else {
        json!({"model": "tiny", "prompt": "Once upon a time there was"})
    };
    body["max_tokens"] = json!(max_tokens);
    body["temperature"] = json!(0);
    if stream {
        body["stream"] = json!(true);
        if usage {
            body["stream_options"] = json!({"include_usage": true});
        }
    }
    body
}

async fn send(
    http: &reqwest::Client,
    url: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> (u16, String, String) {
    let mut request = http
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string());
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.expect("the request is answered");
    let status = response.status().as_u16();
    let worker = header(&response, "x-router-worker");
    let text = tokio::time::timeout(Duration::from_secs(30), response.text())
        .await
        .expect("the body ends in time")
        .expect("the body reads whole");
    (status, worker, text)
}

/// A stream's events: the JSON ones, and whether it ended with `[DONE]`.
fn events(text: &str) -> (Vec<Value>, bool) {
    let mut out = Vec::new();
    let mut done = false;
    for event in text.split("\n\n").filter(|e| !e.is_empty()) {
        let data = event.strip_prefix("data: ").expect("every event is data");
        assert!(!done, "nothing after [DONE]: {text}");
        if data == "[DONE]" {
            done = true;
            continue;
        }
        out.push(serde_json::from_str(data).expect("every event is JSON"));
    }
    (out, done)
}

/// The text a stream (or a whole answer) carries, and its last finish reason.
fn content(chat: bool, stream: bool, text: &str) -> (String, Option<String>) {
    let chunks = if stream {
        events(text).0
    } else {
        vec![serde_json::from_str(text).expect("a JSON answer")]
    };
    let mut out = String::new();
    let mut finish = None;
    for chunk in &chunks {
        assert!(chunk.get("error").is_none(), "no error: {text}");
        let Some(choice) = chunk["choices"].as_array().and_then(|c| c.first()) else {
            continue;
        };
        let piece = match (chat, stream) {
            (true, true) => &choice["delta"]["content"],
            (true, false) => &choice["message"]["content"],
            (false, _) => &choice["text"],
        };
        out.push_str(piece.as_str().unwrap_or(""));
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = Some(f.to_owned());
        }
    }
    (out, finish)
}

/// The expected text of `n` generated tokens after the engine's prompt ids.
fn expected_text(engine: &mock_engine::Engine, body: &Value, n: usize) -> (Vec<u32>, String) {
    let prompt = engine.state.tokenize(body).expect("tokenizes");
    let tokens = mock_engine::generate(&prompt, n);
    let text = tokens
        .iter()
        .map(|&id| mock_engine::token_text(id))
        .collect();
    (prompt, text)
}

/// Send `body` through the router until its first leg lands on `worker` (round-robin: within
/// two tries); the answers of the other tries are returned too, for the caller to ignore.
async fn send_until_first_leg_on(
    http: &reqwest::Client,
    router: &TestRouter,
    chat: bool,
    body: &Value,
    worker: &str,
) -> (u16, String) {
    for _ in 0..4 {
        let (status, first, text) = send(http, &router.url(path(chat)), body, &[]).await;
        if first == worker {
            return (status, text);
        }
    }
    panic!("round-robin never sent the request to worker {worker}");
}

/// The acceptance test: with `migration_limit: 1` (the default) and one engine killed mid-stream,
/// completions and chat streams reach the client whole: the same text as an uninterrupted run,
/// one id, the last leg's finish reason, usage over both legs, no error; the continuation went
/// as a completion of the prompt's ids plus the generated ids with the budget left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_engine_dies_continues_on_another_row_token_for_token() {
    let (a, b) = (engine(1).await, engine(2).await);
    let router = TestRouter::start("serve_migration", &yaml(&[&a, &b], "")).await;
    let http = client();
    const N: u64 = 12;
    const K: u64 = 5;
    a.state.controls.die_after_tokens.store(K, Ordering::SeqCst);
    let mut migrations = 0.0;
    for chat in [false, true] {
        for usage in [false, true] {
            let body = request(chat, true, N, usage);
            let (prompt, expected) = expected_text(&a, &body, N as usize);
            let cut_before = a.state.seen.streams_cut.load(Ordering::SeqCst);
            let (status, text) = send_until_first_leg_on(&http, &router, chat, &body, "1").await;
            assert_eq!(status, 200, "{text}");
            assert_eq!(
                a.state.seen.streams_cut.load(Ordering::SeqCst),
                cut_before + 1,
                "engine 1 died mid-stream"
            );
            let (got, finish) = content(chat, true, &text);
            assert_eq!(got, expected, "chat {chat}, usage {usage}: {text}");
            assert_eq!(finish.as_deref(), Some("length"));
            let (chunks, done) = events(&text);
            assert!(done, "ends with [DONE]: {text}");
            let ids: Vec<&Value> = chunks.iter().map(|c| &c["id"]).collect();
            assert!(ids.iter().all(|id| *id == ids[0]), "one id: {ids:?}");
            let object = if chat {
                "chat.completion.chunk"
            } else {
                "text_completion"
            };
            assert!(chunks.iter().all(|c| c["object"] == object), "{text}");
            // The client did not ask for token ids: none reach it.
            assert!(!text.contains("\"token_ids\":["), "{text}");
            let usages: Vec<&Value> = chunks.iter().filter_map(|c| c.get("usage")).collect();
            if usage {
                assert_eq!(usages.len(), 1, "{text}");
                assert_eq!(usages[0]["completion_tokens"], N, "{text}");
                assert_eq!(usages[0]["prompt_tokens"], prompt.len(), "{text}");
            } else {
                assert!(usages.iter().all(|u| u.is_null()), "{text}");
            }
            // The second leg: a completion of the prompt's ids and the K generated, for the rest.
            let sent = b
                .state
                .seen
                .last_body
                .lock()
                .unwrap()
                .clone()
                .expect("a body");
            let mut continued = prompt.clone();
            continued.extend(mock_engine::generate(&prompt, K as usize));
            assert_eq!(sent["prompt"], json!(continued));
            assert_eq!(sent["max_tokens"], N - K);
            assert_eq!(sent["return_token_ids"], true);
            migrations += 1.0;
            assert_eq!(
                router.metric("router_migrations_total{outcome=\"continued\"}"),
                migrations
            );
        }
    }
    assert_eq!(
        router.metric("router_requests_total{outcome=\"completed\"}") as u64,
        router.metric("router_requests_total") as u64,
        "every request completed, counted once"
    );
    assert!(eventually(Duration::from_secs(5), || router.in_flight() == (0, 0)).await);
    router.stop().await;
}

/// With no failure the client gets exactly the bytes the engine sends without the router (which
/// asked for token ids and strips them), for chat and completions, streamed and whole; a client
/// that asks for token ids gets them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_failure_the_client_sees_the_bytes_it_saw_before() {
    let a = engine(1).await;
    let router = TestRouter::start("serve_migration_bytes", &yaml(&[&a], "")).await;
    let http = client();
    for chat in [false, true] {
        for (stream, usage) in [(true, false), (true, true), (false, false)] {
            for ids in [false, true] {
                let mut body = request(chat, stream, 6, usage);
                if ids {
                    body["return_token_ids"] = json!(true);
                }
                let direct = format!("{}{}", a.url(), path(chat));
                let (_, _, expected) = send(&http, &direct, &body, &[]).await;
                let (status, _, got) = send(&http, &router.url(path(chat)), &body, &[]).await;
                assert_eq!(status, 200);
                assert_eq!(got, expected, "chat {chat}, stream {stream}, ids {ids}");
                if stream {
                    let sent = a
                        .state
                        .seen
                        .last_body
                        .lock()
                        .unwrap()
                        .clone()
                        .expect("a body");
                    assert_eq!(sent["return_token_ids"], true, "the router asked for ids");
                }
                assert_eq!(expected.contains("\"token_ids\":["), ids);
            }
        }
    }
    router.stop().await;
}

/// Migration off (the header lowers the limit to 0) or exhausted (the other engine dies too):
/// the stream ends with an OpenAI-style error event, then `[DONE]`; a bad header is a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn off_or_exhausted_the_stream_ends_with_an_error_event() {
    let (a, b) = (engine(1).await, engine(2).await);
    let router = TestRouter::start("serve_migration_off", &yaml(&[&a, &b], "")).await;
    let http = client();
    a.state.controls.die_after_tokens.store(2, Ordering::SeqCst);
    b.state.controls.die_after_tokens.store(2, Ordering::SeqCst);
    let body = request(false, true, 8, false);
    for limit in [Some("0"), None] {
        let headers: Vec<(&str, &str)> = limit
            .map(|l| ("x-router-migration-limit", l))
            .into_iter()
            .collect();
        let (status, _, text) = send(&http, &router.url("/v1/completions"), &body, &headers).await;
        assert_eq!(status, 200);
        let (chunks, done) = events(&text);
        assert!(done, "{text}");
        let error = &chunks.last().expect("events")["error"];
        assert_eq!(error["type"], "upstream_error", "{text}");
        assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()));
        // The tokens before the failure came, each once.
        let texts = chunks.iter().filter(|c| c.get("choices").is_some()).count();
        let expected = if limit.is_some() { 2 } else { 4 };
        assert_eq!(texts, expected, "{text}");
    }
    assert_eq!(
        router.metric("router_migrations_total{outcome=\"exhausted\"}"),
        1.0
    );
    assert_eq!(
        router.metric("router_migrations_total{outcome=\"continued\"}"),
        1.0
    );

    let (status, _, text) = send(
        &http,
        &router.url("/v1/completions"),
        &body,
        &[("x-router-migration-limit", "lots")],
    )
    .await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("x-router-migration-limit"), "{text}");
    assert!(eventually(Duration::from_secs(5), || router.in_flight() == (0, 0)).await);
    router.stop().await;
}

/// A whole (non-streamed) answer whose body breaks off is sent again, from the start, to
/// another row: the client gets the complete answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_answer_whose_body_fails_is_sent_again_to_another_row() {
    let (a, b) = (engine(1).await, engine(2).await);
    let router = TestRouter::start("serve_migration_whole", &yaml(&[&a, &b], "")).await;
    let http = client();
    a.state.controls.die_after_tokens.store(1, Ordering::SeqCst);
    for chat in [false, true] {
        let body = request(chat, false, 7, false);
        let (_, expected) = expected_text(&a, &body, 7);
        // Round-robin: within two tries the first leg lands on engine 1, which dies.
        let cut = || a.state.seen.streams_cut.load(Ordering::SeqCst);
        let before = cut();
        let mut answered = None;
        for _ in 0..4 {
            let (status, worker, text) = send(&http, &router.url(path(chat)), &body, &[]).await;
            assert_eq!((status, worker.as_str()), (200, "2"), "{text}");
            if cut() > before {
                answered = Some(text);
                break;
            }
        }
        let text = answered.expect("engine 1 took a first leg and died");
        let (got, finish) = content(chat, false, &text);
        assert_eq!(got, expected);
        assert_eq!(finish.as_deref(), Some("length"));
        let answer: Value = serde_json::from_str(&text).expect("JSON");
        assert!(
            answer["id"].as_str().is_some_and(|id| id.ends_with("-2")),
            "{text}"
        );
    }
    assert_eq!(
        router.metric("router_migrations_total{outcome=\"continued\"}"),
        2.0
    );

    // Both engines die: after the one further leg the client gets a 502 naming the limit.
    b.state.controls.die_after_tokens.store(1, Ordering::SeqCst);
    let body = request(false, false, 7, false);
    let (status, _, text) = send(&http, &router.url("/v1/completions"), &body, &[]).await;
    assert_eq!(status, 502, "{text}");
    let error: Value = serde_json::from_str(&text).expect("an OpenAI error body");
    assert_eq!(error["error"]["code"], "upstream_error", "{text}");
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("serve.migration_limit")),
        "{text}"
    );
    assert_eq!(
        router.metric("router_migrations_total{outcome=\"exhausted\"}"),
        1.0
    );
    assert!(eventually(Duration::from_secs(5), || router.in_flight() == (0, 0)).await);
    router.stop().await;
}

/// An engine that stalls mid-stream (`serve.timeouts.stream_idle_ms` passes) is left and the
/// stream continues elsewhere; a client that asked for token ids gets every one of them, the
/// prompt's in the first chunk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_stream_continues_and_asked_for_ids_come_through() {
    let (a, b) = (engine(1).await, engine(2).await);
    let serve = "  timeouts:\n    stream_idle_ms: 300\n";
    let router = TestRouter::start("serve_migration_idle", &yaml(&[&a, &b], serve)).await;
    let http = client();
    // Engine 1 sends its first chunk at once, then one every 30 s: it stalls.
    a.state
        .controls
        .chunk_delay_ms
        .store(30_000, Ordering::SeqCst);
    for chat in [false, true] {
        let mut body = request(chat, true, 9, true);
        body["return_token_ids"] = json!(true);
        let (prompt, expected) = expected_text(&a, &body, 9);
        let (status, text) = send_until_first_leg_on(&http, &router, chat, &body, "1").await;
        assert_eq!(status, 200, "{text}");
        let (got, finish) = content(chat, true, &text);
        assert_eq!(got, expected, "{text}");
        assert_eq!(finish.as_deref(), Some("length"));
        let (chunks, _) = events(&text);
        let mut ids = Vec::new();
        let mut prompts = Vec::new();
        for chunk in &chunks {
            let choice = chunk["choices"].as_array().and_then(|c| c.first());
            let prompt_ids = if chat {
                chunk.get("prompt_token_ids")
            } else {
                choice.and_then(|c| c.get("prompt_token_ids"))
            };
            if let Some(p) = prompt_ids.filter(|p| !p.is_null()) {
                prompts.push(p.clone());
            }
            if let Some(t) = choice.and_then(|c| c["token_ids"].as_array()) {
                ids.extend(t.iter().map(|id| id.as_u64().expect("an id") as u32));
            }
        }
        assert_eq!(prompts, [json!(prompt)], "the prompt's ids once: {text}");
        assert_eq!(ids, mock_engine::generate(&prompt, 9), "{text}");
    }
    assert_eq!(
        router.metric("router_upstream_errors_total{worker=\"1\",kind=\"idle\"}"),
        2.0
    );
    assert_eq!(
        router.metric("router_migrations_total{outcome=\"continued\"}"),
        2.0
    );
    // The stalled streams were dropped: engine 1 answers nothing any more.
    assert!(
        eventually(Duration::from_secs(5), || a
            .state
            .seen
            .active
            .load(Ordering::SeqCst)
            == 0)
        .await
    );
    assert!(eventually(Duration::from_secs(5), || router.in_flight() == (0, 0)).await);
    router.stop().await;
}

/// An engine whose stream carries ids that are not token ids fails its leg with the error event
/// (no panic, no move: its ids cannot be trusted), and the booking is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_token_ids_end_the_stream_with_an_error_event() {
    use common::engine::{raw_full, raw_stream, serve_raw};
    let (addr, task) = serve_raw(|_method, path, _body| async move {
        if path != "/v1/completions" {
            return raw_full(200, &[], r#"{"count":1,"max_model_len":100,"tokens":[1]}"#);
        }
        let first = "data: {\"id\":\"c\",\"object\":\"text_completion\",\"created\":0,\
                     \"model\":\"tiny\",\"choices\":[{\"index\":0,\"text\":\" a\",\
                     \"prompt_token_ids\":[1],\"token_ids\":[-5]}]}\n\n";
        let mut response = raw_stream(futures_util::stream::iter([Ok(bytes::Bytes::from(first))]));
        response
            .headers_mut()
            .insert("content-type", "text/event-stream".parse().expect("header"));
        response
    })
    .await;
    let yaml = format!(
        "block_size: 4\nserve:\n  health:\n    interval_ms: 60000\nworkers:\n  - id: 1\n    url: http://{addr}\n"
    );
    let router = TestRouter::start("serve_migration_garbage", &yaml).await;
    let http = client();
    let (status, _, text) = send(
        &http,
        &router.url("/v1/completions"),
        &request(false, true, 4, false),
        &[],
    )
    .await;
    assert_eq!(status, 200);
    let (chunks, done) = events(&text);
    assert!(done, "{text}");
    assert_eq!(chunks.len(), 1, "only the error event: {text}");
    assert!(
        chunks[0]["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("not a token id")),
        "{text}"
    );
    assert_eq!(
        router.metric("router_stream_error_events_total{reason=\"garbage\"}"),
        1.0
    );
    assert!(eventually(Duration::from_secs(5), || router.in_flight() == (0, 0)).await);
    router.stop().await;
    task.abort();
}

/// `router-host mock-engine` (the engine model, as the chaos test runs it) killed with SIGKILL
/// mid-stream: the stream, completion and chat, reaches the client whole from the other engine:
/// the uninterrupted answer's text, its length in chunks and in usage, one id, `[DONE]`, no
/// error event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_model_engine_stream_finishes_on_the_other() {
    use common::mock::Mock;
    // Paced at 60 ms a token: about 3 s of stream, far longer than reading its first chunks.
    const N: u64 = 48;
    const PACED: &[&str] = &[
        "--block-size",
        "4",
        "--step-overhead-ms",
        "0",
        "--prefill-ms-per-token",
        "0",
        "--decode-ms-per-seq",
        "60",
    ];
    let expected: String = (0..N).map(mock_engine::Tokenizer::word).collect();
    let http = client();
    for chat in [false, true] {
        let mut mocks = [Mock::start(PACED), Mock::start(PACED)];
        let mut yaml = format!(
            "block_size: 4\n{ROUND_ROBIN}serve:\n  tokenizer: remote\n  health:\n    \
             interval_ms: 200\nworkers:\n"
        );
        for (i, mock) in mocks.iter().enumerate() {
            yaml.push_str(&format!("  - id: {}\n    url: {}\n", i + 1, mock.url("")));
        }
        let router = TestRouter::start("serve_migration_killed", &yaml).await;
        // Both engines probed healthy: the continuation has somewhere to go.
        let healthy = |w: u32| router.metric(&format!("router_engine_healthy{{worker=\"{w}\""));
        assert!(
            eventually(Duration::from_secs(20), || healthy(1) == 1.0
                && healthy(2) == 1.0)
            .await,
            "the engines never probed healthy: {} {}",
            healthy(1),
            healthy(2),
        );

        let body = request(chat, true, N, true);
        let mut response = http
            .post(router.url(path(chat)))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .expect("the request is answered");
        assert_eq!(response.status(), 200, "{:?}", response.text().await);
        let worker: usize = header(&response, "x-router-worker")
            .parse()
            .expect("a worker id");
        let mut text = String::new();
        let read = async {
            // A few tokens first, then the engine dies.
            while text.matches("\n\n").count() < 4 {
                let chunk = response.chunk().await.expect("reads").expect("more");
                text.push_str(&String::from_utf8_lossy(&chunk));
            }
            mocks[worker - 1].kill();
            while let Some(chunk) = response.chunk().await.expect("the stream reads whole") {
                text.push_str(&String::from_utf8_lossy(&chunk));
            }
        };
        tokio::time::timeout(Duration::from_secs(30), read)
            .await
            .expect("the stream ends in time");
        let (got, finish) = content(chat, true, &text);
        assert_eq!(got, expected, "chat {chat}: {text}");
        assert_eq!(finish.as_deref(), Some("length"));
        let (chunks, done) = events(&text);
        assert!(done, "{text}");
        let pieces = chunks
            .iter()
            .filter_map(|c| c["choices"].as_array().and_then(|c| c.first()))
            .filter(|c| {
                let piece = if chat {
                    &c["delta"]["content"]
                } else {
                    &c["text"]
                };
                piece.as_str().is_some_and(|p| !p.is_empty())
            })
            .count();
        assert_eq!(pieces as u64, N, "{text}");
        assert!(chunks.iter().all(|c| c["id"] == chunks[0]["id"]), "{text}");
        let usages: Vec<&Value> = chunks.iter().filter_map(|c| c.get("usage")).collect();
        assert_eq!(usages.len(), 1, "{text}");
        assert_eq!(usages[0]["completion_tokens"], N, "{text}");
        assert!(!text.contains("\"token_ids\":["), "{text}");
        assert_eq!(
            router.metric("router_migrations_total{outcome=\"continued\"}"),
            1.0
        );
        router.stop().await;
    }
}

/// An engine that fails after its response head, before its first event (the window in which a
/// stream has no prompt ids yet): nothing reached the client, so the request starts again, as it
/// came, on another row, and the client gets that row's whole answer with no error. The raw
/// engine answers every completion so; round-robin sends one of the two requests there first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_engine_fails_before_its_first_event_starts_again_elsewhere() {
    use common::engine::{raw_full, raw_stream, serve_raw};
    let failed = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = failed.clone();
    let (addr, task) = serve_raw(move |_method, path, _body| {
        let counted = counted.clone();
        async move {
            if path != "/v1/completions" {
                return raw_full(200, &[], r#"{"count":1,"max_model_len":100,"tokens":[1]}"#);
            }
            counted.fetch_add(1, Ordering::SeqCst);
            // The head goes out (hyper flushes it while the body is pending), then the body
            // fails: hyper cuts the connection.
            let mut response = raw_stream(futures_util::stream::once(async {
                tokio::time::sleep(Duration::from_millis(200)).await;
                Err(std::io::Error::other("the engine died"))
            }));
            response
                .headers_mut()
                .insert("content-type", "text/event-stream".parse().expect("header"));
            response
        }
    })
    .await;
    let good = engine(2).await;
    let yaml = format!(
        "block_size: 4\n{ROUND_ROBIN}serve:\n  health:\n    interval_ms: 60000\nworkers:\n  \
         - id: 1\n    url: http://{addr}\n  - id: 2\n    url: {}\n",
        good.url()
    );
    let router = TestRouter::start("serve_migration_restart", &yaml).await;
    let http = client();
    let body = request(false, true, 6, true);
    let (_, want) = expected_text(&good, &body, 6);
    for _ in 0..2 {
        let (status, _, text) = send(&http, &router.url("/v1/completions"), &body, &[]).await;
        assert_eq!(status, 200, "{text}");
        let (got, finish) = content(false, true, &text);
        assert_eq!(got, want, "{text}");
        assert_eq!(finish.as_deref(), Some("length"), "{text}");
        let (chunks, done) = events(&text);
        assert!(done, "{text}");
        let usage = chunks
            .last()
            .map(|c| c["usage"]["completion_tokens"].clone());
        assert_eq!(usage, Some(json!(6)), "{text}");
        assert!(
            !text.contains("prompt_token_ids\":["),
            "the ids the client did not ask for stay null: {text}"
        );
    }
    // Each request the failing engine took started again on the good one.
    let failed = failed.load(Ordering::SeqCst);
    assert!(
        failed >= 1,
        "round-robin sent a request to the failing engine"
    );
    assert_eq!(
        router.metric("router_migrations_total{outcome=\"continued\"}"),
        failed as f64
    );
    assert_eq!(
        router.metric("router_migrations_total{outcome=\"unmovable\"}"),
        0.0
    );
    assert_eq!(good.state.seen.completions.load(Ordering::SeqCst), 2);
    assert!(eventually(Duration::from_secs(5), || router.in_flight() == (0, 0)).await);
    router.stop().await;
    task.abort();
}
