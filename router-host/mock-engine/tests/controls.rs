//! The engine's fault controls and counters, changed while it runs, in both ways of answering.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use mock_engine::{stream_chunks, Answers, Engine, EngineParams, ModelOptions, Options, Tokenizer};
use serde_json::{json, Value};

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

async fn scripted(id: u64) -> Engine {
    Engine::start(Options::scripted(id, Tokenizer::Bytes))
        .await
        .expect("starts")
}

async fn post(engine: &Engine, path: &str, body: &Value) -> reqwest::Response {
    client()
        .post(format!("{}{path}", engine.url()))
        .header("content-type", "application/json")
        .header("x-test", "yes")
        .body(body.to_string())
        .send()
        .await
        .expect("the engine answers")
}

async fn json_of(response: reqwest::Response) -> Value {
    let text = response.text().await.expect("body");
    serde_json::from_str(&text).unwrap_or_else(|err| panic!("not JSON ({err}): {text}"))
}

/// Poll `check` every 10 ms for up to 10 s.
async fn eventually(mut check: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    check()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripted_answers_are_the_scripted_bytes_and_are_counted() {
    let engine = scripted(7).await;
    engine.state.controls.chunks.store(4, Ordering::SeqCst);
    let body = json!({"model": "any", "prompt": "hi", "stream": true,
                      "stream_options": {"include_usage": true}});
    let response = post(&engine, "/v1/completions", &body).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-engine-id"], "7");
    let text = response.text().await.expect("body");
    assert_eq!(text, stream_chunks(7, false, 4, true).concat());
    let seen = &engine.state.seen;
    assert_eq!(seen.completions.load(Ordering::SeqCst), 1);
    assert_eq!(seen.last_body.lock().unwrap().as_ref(), Some(&body));
    let headers = seen.last_headers.lock().unwrap().clone().expect("headers");
    assert_eq!(headers["x-test"], "yes");
    assert!(eventually(|| seen.active.load(Ordering::SeqCst) == 0).await);
    assert_eq!(seen.streams_cut.load(Ordering::SeqCst), 0);

    let whole = post(
        &engine,
        "/v1/chat/completions",
        &json!({"model": "m", "messages": []}),
    )
    .await;
    let whole = json_of(whole).await;
    assert_eq!(
        whole["choices"][0]["message"]["content"],
        " tok0 tok1 tok2 tok3"
    );
    assert_eq!(seen.completions.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_status_and_head_delay_apply_while_it_runs() {
    let engine = scripted(1).await;
    let body = json!({"model": "m", "prompt": "hi"});
    assert_eq!(post(&engine, "/v1/completions", &body).await.status(), 200);
    engine
        .state
        .controls
        .fail_status
        .store(503, Ordering::SeqCst);
    let failed = post(&engine, "/v1/completions", &body).await;
    assert_eq!(failed.status(), 503);
    let failed = json_of(failed).await;
    assert_eq!(failed["error"]["message"], "injected failure");
    engine.state.controls.fail_status.store(0, Ordering::SeqCst);
    assert_eq!(post(&engine, "/v1/completions", &body).await.status(), 200);

    // A delayed head: the completion is active (and /metrics says running) until it answers.
    engine
        .state
        .controls
        .head_delay_ms
        .store(400, Ordering::SeqCst);
    let started = Instant::now();
    let pending = tokio::spawn({
        let url = format!("{}/v1/completions", engine.url());
        async move { client().post(url).body(body.to_string()).send().await }
    });
    assert!(eventually(|| engine.state.seen.active.load(Ordering::SeqCst) == 1).await);
    let metrics = client()
        .get(format!("{}/metrics", engine.url()))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    assert!(
        metrics.contains("vllm:num_requests_running{engine=\"0\",model_name=\"tiny\"} 1.0"),
        "{metrics}"
    );
    let answered = pending.await.expect("task").expect("answer");
    assert_eq!(answered.status(), 200);
    assert!(started.elapsed() >= Duration::from_millis(400));
    assert_eq!(engine.state.seen.completions.load(Ordering::SeqCst), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_going_away_is_a_cut_stream() {
    let engine = scripted(1).await;
    engine.state.controls.chunks.store(1000, Ordering::SeqCst);
    engine
        .state
        .controls
        .chunk_delay_ms
        .store(50, Ordering::SeqCst);
    let body = json!({"model": "m", "prompt": "hi", "stream": true});
    let mut response = post(&engine, "/v1/completions", &body).await;
    let first = response
        .chunk()
        .await
        .expect("read")
        .expect("a first chunk");
    assert!(first.starts_with(b"data: "));
    assert_eq!(engine.state.seen.active.load(Ordering::SeqCst), 1);
    drop(response);
    let seen = &engine.state.seen;
    assert!(eventually(|| seen.streams_cut.load(Ordering::SeqCst) == 1).await);
    assert_eq!(seen.active.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_max_model_len_stop_and_restart() {
    let mut engine = scripted(1).await;
    let http = client();
    let health = |http: reqwest::Client, url: String| async move {
        http.get(format!("{url}/health"))
            .send()
            .await
            .map(|r| r.status().as_u16())
    };
    assert_eq!(health(http.clone(), engine.url()).await.expect("up"), 200);
    engine.state.controls.healthy.store(false, Ordering::SeqCst);
    assert_eq!(health(http.clone(), engine.url()).await.expect("up"), 503);
    assert_eq!(engine.state.seen.health.load(Ordering::SeqCst), 2);

    engine
        .state
        .controls
        .max_model_len
        .store(20, Ordering::SeqCst);
    let tokenized = post(
        &engine,
        "/tokenize",
        &json!({"model": "m", "prompt": "abc"}),
    )
    .await;
    let tokenized = json_of(tokenized).await;
    assert_eq!(tokenized["max_model_len"], 20);
    assert_eq!(tokenized["tokens"], json!([97, 98, 99]));

    engine.stop().await;
    assert!(
        health(http.clone(), engine.url()).await.is_err(),
        "refused when stopped"
    );
    let addr = engine.addr;
    engine.restart().await.expect("listens again");
    assert_eq!(engine.addr, addr);
    assert_eq!(health(http, engine.url()).await.expect("up again"), 503);
    assert_eq!(engine.state.seen.health.load(Ordering::SeqCst), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_over_the_limit_are_refused() {
    let mut options = Options::scripted(1, Tokenizer::Bytes);
    options.max_body_bytes = 1000;
    let engine = Engine::start(options).await.expect("starts");
    let big = json!({"model": "m", "prompt": "x".repeat(2000)});
    let response = post(&engine, "/v1/completions", &big).await;
    assert_eq!(response.status(), 413);
    assert_eq!(engine.state.seen.active.load(Ordering::SeqCst), 0);
    let response = post(&engine, "/tokenize", &big).await;
    assert_eq!(response.status(), 413);
}

/// The engine model with free steps: answers at once.
async fn instant_model() -> Engine {
    let spec = router_sim::replay::engine::EngineSpec {
        step_overhead_ms: Some(0.0),
        decode_ms_per_seq: Some(0.0),
        prefill_ms_per_token: Some(0.0),
        ..Default::default()
    };
    let params: EngineParams = spec.resolve(4).expect("valid spec");
    Engine::start(Options {
        id: 0,
        listen: "127.0.0.1:0".parse().expect("addr"),
        model: "tiny".into(),
        check_model: true,
        max_model_len: 64,
        tokenizer: Tokenizer::Bytes,
        answers: Answers::Model(ModelOptions {
            params,
            block_size: 4,
            dp_size: 1,
            events: None,
        }),
        max_body_bytes: mock_engine::DEFAULT_MAX_BODY_BYTES,
    })
    .await
    .expect("starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_model_answers_and_the_controls_apply_to_it_too() {
    let engine = instant_model().await;
    let body = json!({"model": "tiny", "prompt": [1, 2, 3, 4, 5], "max_tokens": 3});
    let answer = post(&engine, "/v1/completions", &body).await;
    assert_eq!(answer.status(), 200);
    let answer = json_of(answer).await;
    assert_eq!(answer["choices"][0]["text"], " the cache is");
    assert_eq!(answer["usage"]["prompt_tokens"], 5);
    // The same prompt again: its full block is cached.
    let again = json_of(post(&engine, "/v1/completions", &body).await).await;
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 4);

    let other = post(
        &engine,
        "/v1/completions",
        &json!({"model": "x", "prompt": [1]}),
    )
    .await;
    assert_eq!(other.status(), 404);
    let long = json!({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 62});
    assert_eq!(post(&engine, "/v1/completions", &long).await.status(), 400);
    engine
        .state
        .controls
        .max_model_len
        .store(100, Ordering::SeqCst);
    assert_eq!(post(&engine, "/v1/completions", &long).await.status(), 200);

    engine
        .state
        .controls
        .fail_status
        .store(500, Ordering::SeqCst);
    assert_eq!(post(&engine, "/v1/completions", &body).await.status(), 500);
    assert_eq!(engine.state.seen.completions.load(Ordering::SeqCst), 6);
    assert!(engine.state.seen.active.load(Ordering::SeqCst) == 0);
}

/// Generated answers carry vLLM's `return_token_ids` fields where vLLM puts them (null unless
/// asked; asked: the prompt's ids in the first chunk, per choice for a completion and at the top
/// level for a chat, and each chunk's ids), take a prompt of token ids, and continue a prefix
/// exactly; `die_after_tokens` cuts the connection after that many tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generated_answers_return_token_ids_and_die_on_demand() {
    let engine = Engine::start(Options::generated(3, Tokenizer::Bytes))
        .await
        .expect("starts");
    let events = |text: &str| -> Vec<Value> {
        text.split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).expect("JSON"))
            .collect()
    };
    let prompt: Vec<u32> = "hello".bytes().map(u32::from).collect();
    let expected = mock_engine::generate(&prompt, 4);
    for chat in [false, true] {
        let (path, mut body) = if chat {
            (
                "/v1/chat/completions",
                json!({"model": "m", "messages": [{"role": "user", "content": "hello"}]}),
            )
        } else {
            ("/v1/completions", json!({"model": "m", "prompt": "hello"}))
        };
        body["stream"] = json!(true);
        body["max_tokens"] = json!(4);
        let plain = events(&post(&engine, path, &body).await.text().await.expect("body"));
        assert!(
            plain.iter().all(|e| {
                let c = &e["choices"][0];
                c["token_ids"].is_null() && c.get("prompt_token_ids").is_none_or(Value::is_null)
            }),
            "{plain:?}"
        );
        body["return_token_ids"] = json!(true);
        let asked = events(&post(&engine, path, &body).await.text().await.expect("body"));
        let first_prompt = if chat {
            asked[0]["prompt_token_ids"].clone()
        } else {
            asked[0]["choices"][0]["prompt_token_ids"].clone()
        };
        let engine_prompt = engine.state.tokenize(&body).expect("tokenizes");
        assert_eq!(first_prompt, json!(engine_prompt));
        let ids: Vec<u64> = asked
            .iter()
            .filter_map(|e| e["choices"][0]["token_ids"].as_array())
            .flatten()
            .map(|id| id.as_u64().expect("an id"))
            .collect();
        let tokens = mock_engine::generate(&engine_prompt, 4);
        assert_eq!(
            ids,
            tokens.iter().map(|&t| u64::from(t)).collect::<Vec<_>>()
        );
    }
    // A completion of the prompt's ids plus two generated goes on with the other two.
    let mut prefix = prompt.clone();
    prefix.extend_from_slice(&expected[..2]);
    let body = json!({"model": "m", "prompt": prefix, "max_tokens": 2});
    let answer = json_of(post(&engine, "/v1/completions", &body).await).await;
    let text: String = expected[2..]
        .iter()
        .map(|&t| mock_engine::token_text(t))
        .collect();
    assert_eq!(answer["choices"][0]["text"], text);

    engine
        .state
        .controls
        .die_after_tokens
        .store(2, Ordering::SeqCst);
    let body = json!({"model": "m", "prompt": "hello", "max_tokens": 4, "stream": true});
    let mut response = post(&engine, "/v1/completions", &body).await;
    let mut got = String::new();
    let cut = loop {
        match response.chunk().await {
            Ok(Some(chunk)) => got.push_str(&String::from_utf8_lossy(&chunk)),
            Ok(None) => break false,
            Err(_) => break true,
        }
    };
    assert!(cut, "the connection was cut: {got}");
    assert_eq!(events(&got).len(), 2, "two tokens came first: {got}");
    assert!(eventually(|| engine.state.seen.streams_cut.load(Ordering::SeqCst) == 1).await);
}

/// The engine model answers like vLLM for a router's failover: `return_token_ids` puts the
/// prompt's ids in the first chunk (per choice for a completion, at the top level for a chat)
/// and each chunk's generated ids in `choices[0].token_ids` (`null` unless asked), takes a
/// prompt of token ids as those ids, and a prompt ending in generated ids goes on with the
/// words the first answer would have had: a stream continued elsewhere reads as one answer of
/// the requested length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_model_returns_token_ids_and_continues_from_them() {
    let engine = instant_model().await;
    let events = |text: &str| -> Vec<Value> {
        text.split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).expect("JSON"))
            .collect()
    };
    const N: u64 = 11;
    let whole_text: String = (0..N).map(Tokenizer::word).collect();
    let word_ids: Vec<u64> = (0..N).map(|i| u64::from(Tokenizer::word_id(i))).collect();
    for chat in [false, true] {
        let (path, mut body) = if chat {
            (
                "/v1/chat/completions",
                json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}),
            )
        } else {
            (
                "/v1/completions",
                json!({"model": "tiny", "prompt": "hello"}),
            )
        };
        body["stream"] = json!(true);
        body["max_tokens"] = json!(N);
        let plain = events(&post(&engine, path, &body).await.text().await.expect("body"));
        assert!(
            plain.iter().all(|e| {
                let c = &e["choices"][0];
                c["token_ids"].is_null()
                    && c["prompt_token_ids"].is_null()
                    && e["prompt_token_ids"].is_null()
            }),
            "{plain:?}"
        );
        body["return_token_ids"] = json!(true);
        let asked = events(&post(&engine, path, &body).await.text().await.expect("body"));
        let engine_prompt = engine.state.tokenize(&body).expect("tokenizes");
        let first_prompt = if chat {
            assert!(asked[0]["choices"][0]["prompt_token_ids"].is_null());
            asked[0]["prompt_token_ids"].clone()
        } else {
            assert!(asked[0].get("prompt_token_ids").is_none());
            asked[0]["choices"][0]["prompt_token_ids"].clone()
        };
        assert_eq!(first_prompt, json!(engine_prompt), "{asked:?}");
        // Only the first chunk carries the prompt's ids.
        assert!(asked[1..]
            .iter()
            .all(|e| e["prompt_token_ids"].is_null()
                && e["choices"][0]["prompt_token_ids"].is_null()));
        let mut ids = Vec::new();
        let mut text = String::new();
        for event in &asked {
            let c = &event["choices"][0];
            let piece = if chat {
                c["delta"]["content"].as_str()
            } else {
                c["text"].as_str()
            };
            let piece = piece.unwrap_or("");
            let these: Vec<u64> = c["token_ids"]
                .as_array()
                .map(|l| l.iter().map(|i| i.as_u64().expect("an id")).collect())
                .unwrap_or_default();
            // One id for every chunk with text, none for the chat role chunk.
            assert_eq!(these.len(), usize::from(!piece.is_empty()), "{event}");
            ids.extend(these);
            text.push_str(piece);
        }
        assert_eq!(ids, word_ids);
        assert_eq!(text, whole_text);

        // The prompt's ids plus the first K generated, as a completion for the rest: the
        // concatenation is the uninterrupted answer.
        for k in [1usize, 5, 8] {
            let mut prefix: Vec<u64> = engine_prompt.iter().map(|&t| u64::from(t)).collect();
            prefix.extend_from_slice(&ids[..k]);
            let rest = json!({"model": "tiny", "prompt": prefix, "max_tokens": N - k as u64,
                              "stream": true, "return_token_ids": true,
                              "stream_options": {"include_usage": true}});
            let got = events(
                &post(&engine, "/v1/completions", &rest)
                    .await
                    .text()
                    .await
                    .expect("body"),
            );
            assert_eq!(got[0]["choices"][0]["prompt_token_ids"], json!(prefix));
            let more: String = got
                .iter()
                .filter_map(|e| e["choices"][0]["text"].as_str())
                .collect();
            let head: String = (0..k as u64).map(Tokenizer::word).collect();
            assert_eq!(format!("{head}{more}"), whole_text, "continued after {k}");
            let more_ids: Vec<u64> = got
                .iter()
                .filter_map(|e| e["choices"][0]["token_ids"].as_array())
                .flatten()
                .map(|i| i.as_u64().expect("an id"))
                .collect();
            assert_eq!(more_ids, word_ids[k..]);
            let usage = &got.last().expect("a usage chunk")["usage"];
            assert_eq!(usage["completion_tokens"], N - k as u64);
            assert_eq!(usage["prompt_tokens"], prefix.len());
        }
    }
    // A whole answer carries them too.
    let body = json!({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3,
                      "return_token_ids": true});
    let answer = json_of(post(&engine, "/v1/completions", &body).await).await;
    assert_eq!(answer["choices"][0]["prompt_token_ids"], json!([1, 2, 3]));
    assert_eq!(answer["choices"][0]["token_ids"], json!(word_ids[..3]));
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                      "max_tokens": 2});
    let answer = json_of(post(&engine, "/v1/chat/completions", &body).await).await;
    assert!(answer["prompt_token_ids"].is_null() && answer["choices"][0]["token_ids"].is_null());
    assert_eq!(answer["choices"][0]["message"]["content"], " the cache");
}
