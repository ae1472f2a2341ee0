//! `router-host serve` tokenization: the local tokenizer (`tokenizers` + the chat template with
//! `minijinja`) gives the same ids, so the same block ids, as the engine's own `/tokenize`.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::engine::{client, post, tokenizer_dir, workers_yaml, Engine, TestRouter};
use router_core::blocks::{BlockHasher, Tenant};
use router_host::serve::request::{parse, Endpoint};
use router_host::serve::tokenize::{remote, tokenize_body, LocalTokenizer};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_and_remote_tokenization_give_the_same_ids() {
    let engine = Engine::start(1).await;
    let local = LocalTokenizer::load(&tokenizer_dir()).expect("the fixture loads");
    let http = client();
    let hasher = BlockHasher::new(4, Tenant::default()).unwrap();
    let cases = [
        (
            Endpoint::Completions,
            json!({"model": "tiny", "prompt": "The quick brown fox jumps over the lazy dog."}),
        ),
        (
            Endpoint::Completions,
            json!({"model": "tiny", "prompt": ["Hello, world! unknownword here", "second"]}),
        ),
        (
            Endpoint::ChatCompletions,
            json!({"model": "tiny", "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "  What is two plus two?  "},
                {"role": "assistant", "content": "four"},
                {"role": "user", "content": "Tell me a story about cats and dogs"}]}),
        ),
        (
            Endpoint::ChatCompletions,
            json!({"model": "tiny", "add_generation_prompt": false, "messages": [
                {"role": "user", "content": "please write a poem about the sea"}]}),
        ),
        (
            Endpoint::ChatCompletions,
            json!({"model": "tiny", "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hello world"}]}]}),
        ),
    ];
    for (endpoint, body) in cases {
        let parsed = parse(endpoint, body.to_string().as_bytes()).unwrap();
        let local_ids = local.tokenize(&parsed).unwrap().ids;
        let request = tokenize_body(&parsed).unwrap();
        let remote_ids = remote(&http, &engine.url(), &request, Duration::from_secs(5))
            .await
            .unwrap()
            .ids;
        assert!(local_ids.len() > 4, "{body}: {local_ids:?}");
        assert_eq!(local_ids, remote_ids, "{body}");
        let (mut a, mut b) = (Vec::new(), Vec::new());
        hasher.prompt_blocks(&local_ids, &mut a);
        hasher.prompt_blocks(&remote_ids, &mut b);
        assert_eq!(a, b);
        assert!(!a.is_empty());
    }
    // The fixture really tokenizes: known words get their own ids, the template its tokens.
    let parsed = parse(
        Endpoint::ChatCompletions,
        br#"{"model":"tiny","messages":[{"role":"user","content":"hello"}]}"#,
    )
    .unwrap();
    assert_eq!(local.tokenize(&parsed).unwrap().ids, vec![1, 3, 14, 2, 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_with_a_local_tokenizer_never_asks_the_engine() {
    let engine = Engine::start(1).await;
    let yaml = format!(
        "block_size: 4\nserve:\n  tokenizer:\n    path: {}\n  max_prompt_tokens: 50\n{}",
        tokenizer_dir().display(),
        workers_yaml(&[&engine])
    );
    let router = TestRouter::start("serve_local_tokenizer", &yaml).await;
    let http = client();
    let response = post(
        &http,
        &router.url("/v1/chat/completions"),
        &json!({"model": "tiny", "messages": [{"role": "user", "content": "hello world"}]}),
    )
    .await;
    assert_eq!(response.status(), 200);
    let response = post(
        &http,
        &router.url("/v1/completions"),
        &json!({"model": "tiny", "prompt": "the ".repeat(60)}),
    )
    .await;
    assert_eq!(response.status(), 400, "61 tokens with <s>, over 50");
    assert_eq!(engine.state.seen.tokenize.load(Ordering::SeqCst), 0);
    assert_eq!(engine.state.seen.completions.load(Ordering::SeqCst), 1);
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_local_tokenizer_is_a_startup_error_naming_the_key() {
    let engine = Engine::start(1).await;
    let dir = common::temp_dir("serve_tokenizer_missing");
    let config = common::write(
        &dir,
        "router.yaml",
        &format!(
            "serve:\n  tokenizer: {{path: no-such-dir}}\n{}",
            workers_yaml(&[&engine])
        ),
    );
    let err = router_host::serve::Server::bind(router_host::serve::ServeOptions {
        config,
        plugin_dirs: Vec::new(),
        listen: Some("127.0.0.1:0".parse().unwrap()),
    })
    .await
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("router.yaml: serve.tokenizer.path:")
            && err.contains("no-such-dir/tokenizer.json"),
        "{err}"
    );
}

/// `serve.forward_token_ids`: a completion's text prompt reaches the engine as the ids the
/// router computed (the engine's own ids here: the fixture is the engine's tokenizer), and the
/// rest of the body unchanged; chat and prompts given as ids go as they came (a batch of texts:
/// tests/serve_batch.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forward_token_ids_sends_the_routers_ids_for_a_text_completion() {
    let engine = Engine::start(1).await;
    let local = LocalTokenizer::load(&tokenizer_dir()).expect("the fixture loads");
    let yaml = format!(
        "block_size: 4\nserve:\n  forward_token_ids: true\n  tokenizer:\n    path: {}\n{}",
        tokenizer_dir().display(),
        workers_yaml(&[&engine])
    );
    let router = TestRouter::start("serve_forward_ids", &yaml).await;
    let http = client();
    let last_body = || {
        engine
            .state
            .seen
            .last_body
            .lock()
            .unwrap()
            .clone()
            .expect("a body")
    };
    let text = "The quick brown fox jumps over the lazy dog.";
    let body = json!({"model": "tiny", "prompt": text, "max_tokens": 3, "temperature": 0});
    let response = post(&http, &router.url("/v1/completions"), &body).await;
    assert_eq!(response.status(), 200);
    let _ = response.bytes().await;
    let sent = last_body();
    let expected = local.encode(text, true).expect("tokenizes");
    assert!(!expected.is_empty());
    assert_eq!(sent["prompt"], json!(expected));
    assert_eq!(
        (sent["max_tokens"].clone(), sent["temperature"].clone()),
        (json!(3), json!(0))
    );

    for unchanged in [
        json!({"model": "tiny", "prompt": [5, 6, 7]}),
        json!({"model": "tiny", "messages": [{"role": "user", "content": "hello world"}]}),
    ] {
        let url = if unchanged.get("messages").is_some() {
            router.url("/v1/chat/completions")
        } else {
            router.url("/v1/completions")
        };
        let response = post(&http, &url, &unchanged).await;
        assert_eq!(response.status(), 200, "{unchanged}");
        let _ = response.bytes().await;
        assert_eq!(last_body(), unchanged);
    }
    assert_eq!(engine.state.seen.tokenize.load(Ordering::SeqCst), 0);
    router.stop().await;
}

/// The segment cache (docs/serve.md, "The segment cache"): a conversation's later turns take
/// their system prompt and history from it, and the ids are those of the whole text, which
/// the engine's own `/tokenize` gives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_reuses_its_earlier_pieces_with_the_same_ids() {
    let engine = Engine::start(1).await;
    let plain = LocalTokenizer::load(&tokenizer_dir()).expect("the fixture loads");
    let cached = LocalTokenizer::load(&tokenizer_dir())
        .expect("the fixture loads")
        .with_segment_cache(1 << 20);
    assert!(
        cached.segment_stats().is_some(),
        "the fixture's pieces are independent"
    );
    let yaml = format!(
        "block_size: 4\nserve:\n  tokenizer:\n    path: {}\n{}",
        tokenizer_dir().display(),
        workers_yaml(&[&engine])
    );
    let router = TestRouter::start("serve_segment_cache", &yaml).await;
    let http = client();
    let system = "You are a helpful assistant. Answer the question about cats and dogs. ".repeat(3);
    let mut messages = vec![json!({"role": "system", "content": system})];
    for turn in 0..4 {
        messages.push(json!({"role": "user", "content": format!(
            "Question {turn}: what is the story of the quick brown fox and the lazy dog, in full?"
        )}));
        let body = json!({"model": "tiny", "messages": messages});
        let parsed = parse(Endpoint::ChatCompletions, body.to_string().as_bytes()).unwrap();
        let whole = plain.tokenize(&parsed).unwrap().ids;
        assert_eq!(cached.tokenize(&parsed).unwrap().ids, whole, "turn {turn}");
        let request = tokenize_body(&parsed).unwrap();
        let engine_ids = remote(&http, &engine.url(), &request, Duration::from_secs(5))
            .await
            .unwrap()
            .ids;
        assert_eq!(engine_ids, whole, "turn {turn}: the engine's ids");
        let response = post(&http, &router.url("/v1/chat/completions"), &body).await;
        assert_eq!(response.status(), 200, "turn {turn}");
        let _ = response.bytes().await;
        messages.push(
            json!({"role": "assistant", "content": format!("answer number {turn} about the dog")}),
        );
    }
    let hits = router.metric("router_tokenizer_segments_total{outcome=\"hit\"}");
    let misses = router.metric("router_tokenizer_segments_total{outcome=\"miss\"}");
    // Turn k reuses the system prompt and the k-1 earlier questions (answers are under 64 bytes).
    assert!(hits >= 1.0 + 2.0 + 3.0, "hits {hits}, misses {misses}");
    assert!(
        misses >= 4.0,
        "each turn's new question is tokenized once: {misses}"
    );
    assert!(router.metric("router_tokenizer_cache_bytes{cache=\"segments\"}") > 0.0);
    router.stop().await;
}

/// The word split (docs/serve.md, "The word split") on a trained byte-level BPE
/// (tests/data/bpe-tokenizer): completion prompts reach the engine as exactly the ids HF
/// `tokenizers` gives the whole text, and words seen before come from the cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_byte_level_bpe_prompt_reaches_the_engine_as_tokenizers_own_ids() {
    let bpe = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/bpe-tokenizer");
    let reference =
        tokenizers::Tokenizer::from_file(bpe.join("tokenizer.json")).expect("the fixture loads");
    let engine = Engine::start(1).await;
    let yaml = format!(
        "block_size: 16\nserve:\n  forward_token_ids: true\n  tokenizer:\n    path: {}\n{}",
        bpe.display(),
        workers_yaml(&[&engine])
    );
    let router = TestRouter::start("serve_word_split", &yaml).await;
    let http = client();
    let base = "The router sends each session back to the engine that holds its cache. ";
    let prompts = [
        base.repeat(20),
        format!(
            "{}  two spaces,\ta tab,\n\nblank lines, 12345 digits",
            base.repeat(3)
        ),
        format!("{base}<|user|>\nan added token inside a completion prompt</s> and after it"),
        "Zürich, 東京, 😀 — bytes the vocabulary lacks; trailing spaces   ".to_owned(),
        format!("{}unheardofword anotherunseenword", base.repeat(2)),
    ];
    for (i, text) in prompts.iter().enumerate() {
        let body = json!({"model": "tiny", "prompt": text, "max_tokens": 2});
        let response = post(&http, &router.url("/v1/completions"), &body).await;
        assert_eq!(response.status(), 200, "prompt {i}");
        let _ = response.bytes().await;
        let sent = engine
            .state
            .seen
            .last_body
            .lock()
            .unwrap()
            .clone()
            .expect("a body");
        let want = reference
            .encode_fast(text.as_str(), true)
            .expect("tokenizes");
        assert!(want.len() > 10, "prompt {i}");
        assert_eq!(
            sent["prompt"],
            json!(want.get_ids()),
            "prompt {i}: {text:?}"
        );
    }
    let hits = router.metric("router_tokenizer_words_total{outcome=\"hit\"}");
    let misses = router.metric("router_tokenizer_words_total{outcome=\"miss\"}");
    assert!(
        misses > 0.0 && hits > misses,
        "hits {hits}, misses {misses}"
    );
    assert_eq!(
        router.metric("router_tokenizer_words_total{outcome=\"fallback\"}"),
        0.0
    );
    assert!(router.metric("router_tokenizer_cache_bytes{cache=\"words\"}") > 0.0);
    router.stop().await;
}

/// A prompt past serve's inline limit (64 KiB of text) is tokenized through `block_in_place` on
/// the multi-thread runtime and directly on a current-thread one; either way the engine gets
/// `tokenizers`' own ids.
async fn long_prompt_reaches_the_engine_as_tokenizers_own_ids(test: &str) {
    let bpe = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/bpe-tokenizer");
    let reference =
        tokenizers::Tokenizer::from_file(bpe.join("tokenizer.json")).expect("the fixture loads");
    let engine = Engine::start(1).await;
    let yaml = format!(
        "block_size: 16\nserve:\n  forward_token_ids: true\n  max_prompt_tokens: 1000000\n  tokenizer:\n    path: {}\n{}",
        bpe.display(),
        workers_yaml(&[&engine])
    );
    let router = TestRouter::start(test, &yaml).await;
    let http = client();
    let text = "The router sends each session back to the engine that holds its cache, \
                and a long document is no exception.\n"
        .repeat(1600);
    assert!(text.len() > 128 << 10);
    let body = json!({"model": "tiny", "prompt": text, "max_tokens": 2});
    let response = post(&http, &router.url("/v1/completions"), &body).await;
    assert_eq!(response.status(), 200);
    let _ = response.bytes().await;
    let sent = engine
        .state
        .seen
        .last_body
        .lock()
        .unwrap()
        .clone()
        .expect("a body");
    let want = reference
        .encode_fast(text.as_str(), true)
        .expect("tokenizes");
    assert_eq!(sent["prompt"], json!(want.get_ids()));
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prompt_gets_the_same_ids_on_the_multi_thread_runtime() {
    long_prompt_reaches_the_engine_as_tokenizers_own_ids("serve_long_prompt_mt").await;
}

#[tokio::test(flavor = "current_thread")]
async fn a_long_prompt_gets_the_same_ids_on_a_current_thread_runtime() {
    long_prompt_reaches_the_engine_as_tokenizers_own_ids("serve_long_prompt_ct").await;
}

/// Round-robin reads neither cache overlap nor load: its requests are routed without any
/// tokenizer call, local or remote (counted in `router_tokenize_skipped_total`); two-tier reads
/// the overlap, so each of its prompts is tokenized. A reload decides again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_are_tokenized_only_when_something_reads_their_ids() {
    let engine = Engine::start(1).await;
    let bpe = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/bpe-tokenizer");
    let round_robin =
        "worker_selection:\n  aggregated: rr\n  instances:\n    - {name: rr, type: round-robin}\n"
            .to_owned();
    let two_tier = format!(
        "plugins:\n  - path: {}\nworker_selection:\n  aggregated: t\n  instances:\n    \
         - {{name: t, type: dynamo-two-tier-cost-fn}}\n",
        common::plugin("two_tier_cost_fn").display()
    );
    let local = format!("{{path: {}}}", bpe.display());
    let http = client();
    const REQUESTS: usize = 3;
    for tokenizer in ["remote", local.as_str()] {
        let yaml = |policy: &str| {
            format!(
                "block_size: 4\n{policy}serve:\n  tokenizer: {tokenizer}\n{}",
                workers_yaml(&[&engine])
            )
        };
        let router = TestRouter::start("serve_tokenize_readers", &yaml(&round_robin)).await;
        for (round, (policy, tokenized)) in [(&round_robin, false), (&two_tier, true)]
            .into_iter()
            .enumerate()
        {
            if round > 0 {
                std::fs::write(&router.config, yaml(policy)).unwrap();
                assert_eq!(router.handle.reload().await.unwrap(), 2);
            }
            let asked = engine.state.seen.tokenize.load(Ordering::SeqCst);
            let skipped = router.metric("router_tokenize_skipped_total");
            let words = || {
                router.metric("router_tokenizer_words_total{outcome=\"hit\"}")
                    + router.metric("router_tokenizer_words_total{outcome=\"miss\"}")
            };
            let words_before = words();
            for i in 0..REQUESTS {
                let response = post(
                    &http,
                    &router.url("/v1/completions"),
                    &json!({"model": "tiny", "prompt": format!("hello world {i} the quick fox")}),
                )
                .await;
                assert_eq!(response.status(), 200, "{tokenizer}, round {round}");
                let _ = response.bytes().await;
            }
            let case = format!("{tokenizer}, tokenized {tokenized}");
            assert_eq!(
                router.metric("router_prompts_tokenized"),
                if tokenized { 1.0 } else { 0.0 },
                "{case}"
            );
            let remote_calls = engine.state.seen.tokenize.load(Ordering::SeqCst) - asked;
            let skipped = router.metric("router_tokenize_skipped_total") - skipped;
            let words = words() - words_before;
            if tokenized {
                assert_eq!(skipped, 0.0, "{case}");
                if tokenizer == "remote" {
                    assert_eq!(remote_calls, REQUESTS, "{case}");
                } else {
                    assert_eq!(remote_calls, 0, "{case}");
                    assert!(words >= REQUESTS as f64, "{case}: {words} words looked up");
                }
            } else {
                assert_eq!(skipped, REQUESTS as f64, "{case}");
                assert_eq!(remote_calls, 0, "{case}: no /tokenize call");
                assert_eq!(words, 0.0, "{case}: the local tokenizer was not called");
            }
        }
        router.stop().await;
    }
}
