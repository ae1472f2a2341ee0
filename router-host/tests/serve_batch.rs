//! `router-host serve` with batched completion requests (`prompt` as a list of texts or of id
//! lists): every prompt is tokenized (locally, or with one `/tokenize` call per text, a few at a
//! time) and booked, the length limits hold per prompt and name the one over, the overlap comes
//! from the first prompt, and `serve.forward_token_ids` sends a list of id lists.
//!
//! A booking is read while the engine holds the request open (the stand-in's head delay), after
//! the router reports the request in flight; the client then goes away and the booking must be
//! released.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::engine::{
    client, eventually, header, held_ids, post, raw_full, serve_raw, tokenizer_dir, workers_yaml,
    Engine, RawResponse, TestRouter,
};
use common::mock::{Mock, FAST};
use router_core::blocks::{BlockHasher, Tenant};
use router_host::serve::tokenize::{LocalTokenizer, MAX_TOKENIZE_IN_FLIGHT};
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(10);
/// How long an engine holds a completion open: far longer than any test reads its booking.
const HOLD_MS: u64 = 120_000;
const BOOKED: &str = "router_booked_prefill_tokens{worker=\"1\",dp_rank=\"0\"}";
const BATCH: [&str; 3] = [
    "The quick brown fox jumps over the lazy dog.",
    "hello world",
    "Tell me a story about cats and dogs",
];

fn local() -> LocalTokenizer {
    LocalTokenizer::load(&tokenizer_dir()).expect("the fixture loads")
}

/// The fixture tokenizer's ids of `text` as a completion prompt (the stand-in's ids too).
fn ids(text: &str) -> Vec<u32> {
    local().encode(text, true).expect("the fixture tokenizes")
}

fn local_yaml(extra: &str, engine: &Engine) -> String {
    format!(
        "block_size: 4\nserve:\n  tokenizer:\n    path: {}\n{extra}{}",
        tokenizer_dir().display(),
        workers_yaml(&[engine])
    )
}

fn remote_yaml(extra: &str, engine: &Engine) -> String {
    format!(
        "block_size: 4\nserve:\n  tokenizer: remote\n{extra}{}",
        workers_yaml(&[engine])
    )
}

/// Send `body` to `/v1/completions` while the engine holds completions open, read the prefill
/// tokens booked on worker 1 once the router has the request in flight and `arrived` says the
/// engine has it (so a test can then look at what the engine received: on a busy machine the
/// client could otherwise go away between the booking and the forward), then let the client go
/// and check that the booking is released.
async fn booked_while_held(router: &TestRouter, body: &Value, arrived: impl Fn() -> bool) -> f64 {
    let (http, url, body) = (client(), router.url("/v1/completions"), body.clone());
    let request = tokio::spawn(async move {
        let response = post(&http, &url, &body).await;
        let status = response.status();
        (status, response.text().await.unwrap_or_default())
    });
    let in_flight = eventually(WAIT, || {
        (router.in_flight() == (1, 1) && arrived()) || request.is_finished()
    })
    .await;
    if request.is_finished() {
        let answer = request.await.expect("the request task");
        panic!("the request was answered instead of held: {answer:?}");
    }
    assert!(
        in_flight,
        "never in flight and at the engine: {:?}, arrived {}",
        router.in_flight(),
        arrived()
    );
    let booked = router.metric(BOOKED);
    request.abort();
    assert!(
        eventually(WAIT, || router.in_flight() == (0, 0)).await,
        "the booking was released when the client went away: {:?}",
        router.in_flight()
    );
    assert_eq!(router.metric(BOOKED), 0.0);
    booked
}

/// Whether `engine` has received a completion since this was called.
fn received(engine: &Engine) -> impl Fn() -> bool + '_ {
    let before = engine.state.seen.completions.load(Ordering::SeqCst);
    move || engine.state.seen.completions.load(Ordering::SeqCst) > before
}

fn hold(engine: &Engine) {
    engine
        .state
        .controls
        .head_delay_ms
        .store(HOLD_MS, Ordering::SeqCst);
}

fn last_body(engine: &Engine) -> Value {
    engine
        .state
        .seen
        .last_body
        .lock()
        .unwrap()
        .clone()
        .expect("the engine received a completion")
}

/// The prefill tokens a batch of [`BATCH`] books: every prompt's, more than the first's alone.
fn batch_tokens() -> f64 {
    let counts: Vec<usize> = BATCH.iter().map(|t| ids(t).len()).collect();
    assert!(counts.iter().all(|&n| n > 1), "{counts:?}");
    counts.iter().sum::<usize>() as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_texts_is_booked_by_all_its_prompts_with_the_local_tokenizer() {
    let engine = Engine::start(1).await;
    hold(&engine);
    let router = TestRouter::start("batch_booked_local", &local_yaml("", &engine)).await;
    let body = json!({"model": "tiny", "prompt": BATCH, "max_tokens": 2});
    assert_eq!(
        booked_while_held(&router, &body, received(&engine)).await,
        batch_tokens()
    );
    assert_eq!(engine.state.seen.tokenize.load(Ordering::SeqCst), 0);
    // Without `forward_token_ids` the batch reaches the engine as sent.
    assert_eq!(last_body(&engine), body);
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_texts_is_tokenized_by_the_engine_once_per_prompt() {
    let engine = Engine::start(1).await;
    hold(&engine);
    let router = TestRouter::start("batch_booked_remote", &remote_yaml("", &engine)).await;
    let body = json!({"model": "tiny", "prompt": BATCH});
    // The engine's ids are the fixture's: the same total as the local tokenizer books.
    assert_eq!(
        booked_while_held(&router, &body, received(&engine)).await,
        batch_tokens()
    );
    assert_eq!(
        engine.state.seen.tokenize.load(Ordering::SeqCst),
        BATCH.len()
    );
    assert_eq!(router.metric("router_tokenize_fallbacks_total"), 0.0);
    // A list of one is one prompt: one call, its tokens.
    let one = json!({"model": "tiny", "prompt": [BATCH[1]]});
    assert_eq!(
        booked_while_held(&router, &one, received(&engine)).await,
        ids(BATCH[1]).len() as f64
    );
    assert_eq!(
        engine.state.seen.tokenize.load(Ordering::SeqCst),
        BATCH.len() + 1
    );
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_token_id_lists_is_booked_by_the_sum_of_their_lengths() {
    let engine = Engine::start(1).await;
    hold(&engine);
    let router = TestRouter::start("batch_booked_ids", &remote_yaml("", &engine)).await;
    let lists: Vec<Vec<u32>> = vec![(1..=10).collect(), (20..28).collect(), vec![5, 6, 7]];
    let body = json!({"model": "tiny", "prompt": lists});
    assert_eq!(
        booked_while_held(&router, &body, received(&engine)).await,
        21.0
    );
    assert_eq!(
        engine.state.seen.tokenize.load(Ordering::SeqCst),
        0,
        "ids need no tokenizer"
    );
    assert_eq!(last_body(&engine), body);
    router.stop().await;
}

/// The error of a refused request: (status, param, code, message).
async fn refusal(response: reqwest::Response) -> (u16, Value, String, String) {
    let status = response.status().as_u16();
    let error: Value = serde_json::from_slice(&response.bytes().await.unwrap()).unwrap();
    (
        status,
        error["error"]["param"].clone(),
        error["error"]["code"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        error["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_prompt_over_the_limit_refuses_the_batch_naming_it_and_books_nothing() {
    let long = "the ".repeat(30);
    let long_tokens = ids(&long).len();
    let short_tokens = ids("the ".repeat(15).as_str()).len();
    assert!(
        long_tokens > 20 && short_tokens <= 20,
        "{long_tokens} {short_tokens}"
    );
    let http = client();

    // serve.max_prompt_tokens, local tokenizer: prompt 1 of 3 is over.
    let engine = Engine::start(1).await;
    let router = TestRouter::start(
        "batch_too_long_local",
        &local_yaml("  max_prompt_tokens: 20\n", &engine),
    )
    .await;
    let url = router.url("/v1/completions");
    let body = json!({"model": "tiny", "prompt": ["hello world", long, "hello"]});
    let (status, param, code, message) = refusal(post(&http, &url, &body).await).await;
    assert_eq!(
        (status, param, code.as_str()),
        (400, json!("prompt"), "prompt_too_long")
    );
    let expected = format!(
        "prompt 1 has {long_tokens} tokens, over the limit of 20 (serve.max_prompt_tokens)"
    );
    assert!(message.contains(&expected), "{message:?}");
    assert_eq!(engine.state.seen.completions.load(Ordering::SeqCst), 0);
    assert_eq!(router.in_flight(), (0, 0));
    assert_eq!(router.metric(BOOKED), 0.0);
    assert_eq!(
        router.metric("router_inflight_requests{worker=\"1\",dp_rank=\"0\"}"),
        0.0
    );
    // The limit is per prompt: three prompts under it pass, whatever their sum.
    let short = "the ".repeat(15);
    let body = json!({"model": "tiny", "prompt": [short, short, short]});
    let response = post(&http, &url, &body).await;
    assert_eq!(
        response.status(),
        200,
        "3 x {short_tokens} tokens, each under 20"
    );
    let _ = response.bytes().await;
    assert_eq!(engine.state.seen.completions.load(Ordering::SeqCst), 1);
    router.stop().await;

    // The engine's max_model_len (from its /tokenize), remote tokenizer: the last prompt.
    let engine = Engine::start(1).await;
    engine
        .state
        .controls
        .max_model_len
        .store(20, Ordering::SeqCst);
    let router = TestRouter::start("batch_too_long_remote", &remote_yaml("", &engine)).await;
    let body = json!({"model": "tiny", "prompt": ["hello world", "hello", long]});
    let response = post(&http, &router.url("/v1/completions"), &body).await;
    let (status, param, code, message) = refusal(response).await;
    assert_eq!(
        (status, param, code.as_str()),
        (400, json!("prompt"), "prompt_too_long")
    );
    let expected = format!(
        "prompt 2 has {long_tokens} tokens, over the limit of 20 (the engine's max_model_len)"
    );
    assert!(message.contains(&expected), "{message:?}");
    assert_eq!(engine.state.seen.tokenize.load(Ordering::SeqCst), 3);
    assert_eq!(engine.state.seen.completions.load(Ordering::SeqCst), 0);
    assert_eq!(router.in_flight(), (0, 0));
    assert_eq!(router.metric(BOOKED), 0.0);
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forward_token_ids_sends_a_batch_of_texts_as_a_list_of_id_lists() {
    let engine = Engine::start(1).await;
    let router = TestRouter::start(
        "batch_forward_ids",
        &local_yaml("  forward_token_ids: true\n", &engine),
    )
    .await;
    let http = client();
    let url = router.url("/v1/completions");
    let body = json!({"model": "tiny", "prompt": BATCH, "max_tokens": 3, "temperature": 0});
    let response = post(&http, &url, &body).await;
    assert_eq!(response.status(), 200);
    let _ = response.bytes().await;
    let sent = last_body(&engine);
    let expected: Vec<Vec<u32>> = BATCH.iter().map(|t| ids(t)).collect();
    assert_eq!(sent["prompt"], json!(expected));
    let mut rest = sent.clone();
    rest["prompt"] = body["prompt"].clone();
    assert_eq!(rest, body, "the rest of the body goes unchanged");
    // A list of one text: a list of one id list.
    let response = post(&http, &url, &json!({"model": "tiny", "prompt": [BATCH[2]]})).await;
    assert_eq!(response.status(), 200);
    let _ = response.bytes().await;
    assert_eq!(last_body(&engine)["prompt"], json!([ids(BATCH[2])]));
    assert_eq!(engine.state.seen.tokenize.load(Ordering::SeqCst), 0);
    router.stop().await;
}

/// A batch's first prompt cached on worker 2 (its blocks published by the real mock engine as
/// KV events) brings the batch there; a batch with a new first prompt goes by the tie-break
/// (worker 1), whatever its later prompts: the overlap is the first prompt's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_goes_to_the_worker_that_caches_its_first_prompt() {
    let start = || {
        let mut args = vec!["--kv-events", "tcp://127.0.0.1:0", "--block-size", "4"];
        args.extend_from_slice(FAST);
        Mock::start(&args)
    };
    let (m1, m2) = (start(), start());
    let mut yaml = String::from(
        "block_size: 4\nserve:\n  health:\n    interval_ms: 200\n  tokenizer: remote\nworkers:\n",
    );
    for (id, mock) in [(1, &m1), (2, &m2)] {
        yaml.push_str(&format!(
            "  - id: {id}\n    url: {}\n    kv_events:\n      endpoint: {}\n",
            mock.url(""),
            mock.kv_events[0]
        ));
    }
    let router = TestRouter::start("batch_overlap", &yaml).await;
    m1.sync(&router, 1, 0).await;
    m2.sync(&router, 2, 0).await;
    let http = client();

    let preamble = "You are a careful assistant. Answer in one short sentence, please.";
    let response = post(
        &http,
        &m2.url("/v1/completions"),
        &json!({"model": "tiny", "prompt": preamble, "max_tokens": 1}),
    )
    .await;
    assert_eq!(response.status(), 200);
    let _ = response.bytes().await;
    let tokenized = post(
        &http,
        &m2.url("/tokenize"),
        &json!({"model": "tiny", "prompt": preamble}),
    )
    .await
    .bytes()
    .await
    .expect("the mock's /tokenize answers");
    let tokenized: Value = serde_json::from_slice(&tokenized).expect("as JSON");
    let tokens: Vec<u32> = serde_json::from_value(tokenized["tokens"].clone()).expect("tokens");
    let mut block_ids = Vec::new();
    BlockHasher::new(4, Tenant::default())
        .expect("hasher")
        .prompt_blocks(&tokens, &mut block_ids);
    assert!(block_ids.len() >= 10, "{} blocks", block_ids.len());
    assert!(
        eventually(WAIT, || held_ids(&router, 2, &block_ids) == block_ids.len()).await,
        "worker 2's blocks reached the router: {} of {}",
        held_ids(&router, 2, &block_ids),
        block_ids.len()
    );
    assert_eq!(held_ids(&router, 1, &block_ids), 0);

    let url = router.url("/v1/completions");
    let batch = json!({"model": "tiny", "max_tokens": 1, "prompt": [
        preamble, "What is the capital of France?", "Name a prime number above ten."]});
    // The mock engine runs one sequence per request and refuses a batch (docs/engines.md);
    // what is tested here is where the router sent it, which the relayed answer's decision
    // headers say.
    let refused_by_the_mock = |text: &str| text.contains("one prompt per request");
    let response = post(&http, &url, &batch).await;
    assert_eq!(response.status(), 400);
    assert_eq!(header(&response, "x-router-worker"), "2");
    let text = response.text().await.unwrap_or_default();
    assert!(refused_by_the_mock(&text), "{text}");

    let new_first = json!({"model": "tiny", "max_tokens": 1, "prompt": [
        "A first prompt that no engine has seen yet, long enough for blocks.", preamble]});
    let response = post(&http, &url, &new_first).await;
    assert_eq!(response.status(), 400);
    assert_eq!(header(&response, "x-router-worker"), "1");
    let text = response.text().await.unwrap_or_default();
    assert!(refused_by_the_mock(&text), "{text}");
    assert!(eventually(WAIT, || router.in_flight() == (0, 0)).await);
    router.stop().await;
}

/// A bare engine for what the stand-in does not do: its `/tokenize` answers 503, or answers
/// each byte as a token after a pause while counting how many calls overlap; its completions
/// are held open.
struct Bare {
    tokenize_fails: AtomicBool,
    calls: AtomicUsize,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
}

/// Counts a `/tokenize` call as in flight until dropped.
struct Call<'a>(&'a Bare);

impl Drop for Call<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn bare_tokenize(bare: Arc<Bare>, body: Bytes) -> RawResponse {
    bare.calls.fetch_add(1, Ordering::SeqCst);
    if bare.tokenize_fails.load(Ordering::SeqCst) {
        return raw_full(
            503,
            &[("content-type", "text/plain; charset=utf-8".to_owned())],
            "overloaded",
        );
    }
    let now = bare.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    let _call = Call(&bare);
    bare.max_in_flight.fetch_max(now, Ordering::SeqCst);
    // Long enough for calls that are not bounded to pile up.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let body: Value = serde_json::from_slice(&body).unwrap_or_default();
    let tokens: Vec<u32> = body["prompt"]
        .as_str()
        .unwrap_or_default()
        .bytes()
        .map(u32::from)
        .collect();
    let answer = json!({"count": tokens.len(), "max_model_len": 4096, "tokens": tokens});
    raw_full(
        200,
        &[("content-type", "application/json".to_owned())],
        answer.to_string(),
    )
}

async fn bare_completion() -> RawResponse {
    tokio::time::sleep(Duration::from_millis(HOLD_MS)).await;
    raw_full(
        200,
        &[("content-type", "application/json".to_owned())],
        "{}",
    )
}

async fn start_bare(tokenize_fails: bool) -> (Arc<Bare>, SocketAddr) {
    let bare = Arc::new(Bare {
        tokenize_fails: AtomicBool::new(tokenize_fails),
        calls: AtomicUsize::new(0),
        in_flight: AtomicUsize::new(0),
        max_in_flight: AtomicUsize::new(0),
    });
    let state = bare.clone();
    let (addr, _task) = serve_raw(move |method, path, body| {
        let bare = state.clone();
        async move {
            match (method, path.as_str()) {
                (hyper::Method::GET, "/health") => raw_full(200, &[], ""),
                (hyper::Method::POST, "/tokenize") => bare_tokenize(bare, body).await,
                (hyper::Method::POST, "/v1/completions") => bare_completion().await,
                _ => raw_full(404, &[], ""),
            }
        }
    })
    .await;
    (bare, addr)
}

fn bare_yaml(addr: SocketAddr) -> String {
    format!(
        "block_size: 4\nserve:\n  tokenizer: remote\n  health:\n    scrape_load: false\n\
         workers:\n  - id: 1\n    url: http://{addr}\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_tokenize_calls_of_a_batch_are_bounded() {
    let (bare, addr) = start_bare(false).await;
    let router = TestRouter::start("batch_tokenize_bounded", &bare_yaml(addr)).await;
    let prompts: Vec<String> = (0..20).map(|i| format!("prompt number {i}")).collect();
    let bytes: usize = prompts.iter().map(String::len).sum();
    let body = json!({"model": "tiny", "prompt": prompts});
    assert_eq!(
        booked_while_held(&router, &body, || true).await,
        bytes as f64
    );
    assert_eq!(bare.calls.load(Ordering::SeqCst), 20, "one call per prompt");
    let most = bare.max_in_flight.load(Ordering::SeqCst);
    assert!(
        (1..=MAX_TOKENIZE_IN_FLIGHT).contains(&most),
        "{most} calls in flight at once"
    );
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_whose_remote_tokenization_fails_is_routed_on_its_estimated_size() {
    let (bare, addr) = start_bare(true).await;
    let router = TestRouter::start("batch_tokenize_fallback", &bare_yaml(addr)).await;
    let body = json!({"model": "tiny", "prompt": BATCH});
    // bytes / 4 per prompt, rounded up, for every prompt.
    let estimate: usize = BATCH.iter().map(|t| t.len().div_ceil(4)).sum();
    assert_eq!(
        booked_while_held(&router, &body, || true).await,
        estimate as f64
    );
    assert_eq!(router.metric("router_tokenize_fallbacks_total"), 1.0);
    let calls = bare.calls.load(Ordering::SeqCst);
    assert!((1..=BATCH.len()).contains(&calls), "{calls} calls");
    router.stop().await;
}
