//! A small stand-in for a vLLM engine, for the `serve_*` tests: an OpenAI-compatible HTTP
//! server on 127.0.0.1 answering `/v1/completions` and `/v1/chat/completions` (streaming and
//! not, with vLLM's final usage chunk), `/tokenize`, `/v1/models`, `/metrics` and `/health` the
//! way vLLM does, with failures and delays the tests control. It tokenizes with the fixture
//! `tests/data/tokenizer/` (its own code: `tokenizers` and `minijinja` called directly, not the
//! router's), so local and remote tokenization can be compared.
//!
//! Also a harness that writes a router config for a set of engines and runs `serve` in-process.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post as post_route};
use serde_json::{json, Value};

/// The fixture tokenizer directory.
pub fn tokenizer_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer")
}

/// What the stand-in does, changed by tests while it runs.
#[derive(Debug)]
pub struct Controls {
    /// Non-zero: completions answer this status with a vLLM-style error body.
    pub fail_status: AtomicU16,
    /// Before the response headers of a completion.
    pub head_delay_ms: AtomicU64,
    /// Between two streamed chunks.
    pub chunk_delay_ms: AtomicU64,
    /// Content chunks per streamed completion.
    pub chunks: AtomicUsize,
    /// `/health` answers 200 (else 503).
    pub healthy: AtomicBool,
    /// `max_model_len` reported by `/tokenize`.
    pub max_model_len: AtomicU64,
}

/// What the stand-in saw.
#[derive(Debug, Default)]
pub struct Seen {
    pub completions: AtomicUsize,
    pub tokenize: AtomicUsize,
    pub health: AtomicUsize,
    pub models: AtomicUsize,
    /// Completions being answered now (a streamed one until its body is dropped).
    pub active: AtomicI64,
    /// Streamed bodies dropped before their end (the reader went away).
    pub streams_cut: AtomicUsize,
    /// Headers of the last completion request.
    pub last_headers: Mutex<Option<HeaderMap>>,
    /// Body of the last completion request.
    pub last_body: Mutex<Option<Value>>,
}

pub struct EngineState {
    pub id: u64,
    pub controls: Controls,
    pub seen: Seen,
    tokenizer: tokenizers::Tokenizer,
    chat: minijinja::Environment<'static>,
}

/// A running stand-in engine.
pub struct Engine {
    pub state: Arc<EngineState>,
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

fn chat_environment() -> minijinja::Environment<'static> {
    let config: Value = serde_json::from_slice(
        &std::fs::read(tokenizer_dir().join("tokenizer_config.json")).expect("fixture config"),
    )
    .expect("fixture config is JSON");
    let template = config["chat_template"]
        .as_str()
        .expect("fixture has a chat template")
        .to_owned();
    let mut env = minijinja::Environment::new();
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .expect("syntax"),
    );
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_template_owned("chat", template)
        .expect("fixture template compiles");
    env
}

impl EngineState {
    fn new(id: u64) -> EngineState {
        EngineState {
            id,
            controls: Controls {
                fail_status: AtomicU16::new(0),
                head_delay_ms: AtomicU64::new(0),
                chunk_delay_ms: AtomicU64::new(0),
                chunks: AtomicUsize::new(3),
                healthy: AtomicBool::new(true),
                max_model_len: AtomicU64::new(4096),
            },
            seen: Seen::default(),
            tokenizer: tokenizers::Tokenizer::from_file(tokenizer_dir().join("tokenizer.json"))
                .expect("fixture tokenizer loads"),
            chat: chat_environment(),
        }
    }

    /// Token ids the way vLLM computes them: completion prompts with special tokens, chat
    /// messages through the template (add_generation_prompt defaults to true), without.
    pub fn tokenize(&self, body: &Value) -> Vec<u32> {
        if let Some(messages) = body.get("messages") {
            // vLLM hands a string-content template each message's text parts joined by "\n".
            let messages: Vec<Value> = messages
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .map(|mut m| {
                    if let Some(Value::Array(parts)) = m.get("content").cloned() {
                        let texts: Vec<&str> =
                            parts.iter().filter_map(|p| p["text"].as_str()).collect();
                        m["content"] = Value::String(texts.join("\n"));
                    }
                    m
                })
                .collect();
            let add = body
                .get("add_generation_prompt")
                .and_then(Value::as_bool)
                .unwrap_or(true);
            let text = self
                .chat
                .get_template("chat")
                .expect("template")
                .render(minijinja::Value::from(minijinja::value::Serde(json!({
                    "messages": messages,
                    "add_generation_prompt": add,
                    "bos_token": "<s>",
                    "eos_token": "</s>",
                }))))
                .expect("template renders");
            self.tokenizer
                .encode(text, false)
                .expect("encode")
                .get_ids()
                .to_vec()
        } else {
            let prompt = body["prompt"].as_str().unwrap_or_default().to_owned();
            self.tokenizer
                .encode(prompt, true)
                .expect("encode")
                .get_ids()
                .to_vec()
        }
    }
}

/// The bytes of a streamed completion, exactly as the stand-in sends them (no timestamps or
/// counters: the same request gets the same bytes).
pub fn stream_chunks(engine: u64, chat: bool, chunks: usize, usage: bool) -> Vec<String> {
    let mut out = Vec::new();
    for i in 0..chunks {
        let chunk = if chat {
            json!({"id": format!("chatcmpl-{engine}"), "object": "chat.completion.chunk",
                   "created": 0, "model": "tiny",
                   "choices": [{"index": 0, "delta": {"content": format!(" tok{i}")},
                                "logprobs": null, "finish_reason": null}]})
        } else {
            json!({"id": format!("cmpl-{engine}"), "object": "text_completion", "created": 0,
                   "model": "tiny",
                   "choices": [{"index": 0, "text": format!(" tok{i}"), "logprobs": null,
                                "finish_reason": null, "stop_reason": null}]})
        };
        out.push(format!("data: {chunk}\n\n"));
    }
    if usage {
        let object = if chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let chunk = json!({"id": format!("cmpl-{engine}"), "object": object, "created": 0,
                           "model": "tiny", "choices": [],
                           "usage": {"prompt_tokens": 5, "total_tokens": 5 + chunks,
                                     "completion_tokens": chunks}});
        out.push(format!("data: {chunk}\n\n"));
    }
    out.push("data: [DONE]\n\n".to_owned());
    out
}

/// Counts a completion as active until dropped (a streamed body is dropped when it ends or
/// when its reader goes away).
struct Active {
    state: Arc<EngineState>,
    finished: bool,
}

impl Drop for Active {
    fn drop(&mut self) {
        self.state.seen.active.fetch_sub(1, Ordering::SeqCst);
        if !self.finished {
            self.state.seen.streams_cut.fetch_add(1, Ordering::SeqCst);
        }
    }
}

fn error(status: StatusCode, message: &str) -> Response {
    let body = json!({"object": "error", "message": message, "type": "BadRequestError",
                      "param": null, "code": status.as_u16()});
    (
        status,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn complete(
    state: Arc<EngineState>,
    chat: bool,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    state.seen.completions.fetch_add(1, Ordering::SeqCst);
    *state.seen.last_headers.lock().unwrap() = Some(headers);
    let body: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(_) => return error(StatusCode::BAD_REQUEST, "not JSON"),
    };
    *state.seen.last_body.lock().unwrap() = Some(body.clone());
    state.seen.active.fetch_add(1, Ordering::SeqCst);
    let mut active = Active {
        state: state.clone(),
        finished: false,
    };
    let delay = state.controls.head_delay_ms.load(Ordering::SeqCst);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    let fail = state.controls.fail_status.load(Ordering::SeqCst);
    if fail != 0 {
        active.finished = true;
        return error(
            StatusCode::from_u16(fail).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            "injected failure",
        );
    }
    let chunks = state.controls.chunks.load(Ordering::SeqCst);
    let id = state.id;
    let engine_header = [("x-engine-id", id.to_string())];
    if body.get("stream").and_then(Value::as_bool) == Some(true) {
        let usage = body
            .pointer("/stream_options/include_usage")
            .and_then(Value::as_bool)
            == Some(true);
        let parts = stream_chunks(id, chat, chunks, usage);
        let gap = Duration::from_millis(state.controls.chunk_delay_ms.load(Ordering::SeqCst));
        let stream = futures_util::stream::unfold(
            (parts.into_iter(), Some(active), true),
            move |(mut parts, mut active, first)| async move {
                if !first && !gap.is_zero() {
                    tokio::time::sleep(gap).await;
                }
                match parts.next() {
                    Some(part) => Some((
                        Ok::<_, std::io::Error>(Bytes::from(part)),
                        (parts, active, false),
                    )),
                    None => {
                        if let Some(a) = active.as_mut() {
                            a.finished = true;
                        }
                        drop(active.take());
                        None
                    }
                }
            },
        );
        let mut response = Response::new(Body::from_stream(stream));
        response.headers_mut().insert(
            "content-type",
            "text/event-stream; charset=utf-8".parse().unwrap(),
        );
        response
            .headers_mut()
            .insert("x-engine-id", id.to_string().parse().unwrap());
        return response;
    }
    active.finished = true;
    let text: String = (0..chunks).map(|i| format!(" tok{i}")).collect();
    let answer = if chat {
        json!({"id": format!("chatcmpl-{id}"), "object": "chat.completion", "created": 0,
               "model": "tiny",
               "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                            "logprobs": null, "finish_reason": "length"}],
               "usage": {"prompt_tokens": 5, "total_tokens": 5 + chunks,
                         "completion_tokens": chunks}})
    } else {
        json!({"id": format!("cmpl-{id}"), "object": "text_completion", "created": 0,
               "model": "tiny",
               "choices": [{"index": 0, "text": text, "logprobs": null,
                            "finish_reason": "length"}],
               "usage": {"prompt_tokens": 5, "total_tokens": 5 + chunks,
                         "completion_tokens": chunks}})
    };
    (
        StatusCode::OK,
        engine_header,
        [("content-type", "application/json".to_owned())],
        answer.to_string(),
    )
        .into_response()
}

async fn completions(
    State(state): State<Arc<EngineState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    complete(state, false, headers, body).await
}

async fn chat_completions(
    State(state): State<Arc<EngineState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    complete(state, true, headers, body).await
}

async fn tokenize(State(state): State<Arc<EngineState>>, body: Bytes) -> Response {
    state.seen.tokenize.fetch_add(1, Ordering::SeqCst);
    let Ok(body) = serde_json::from_slice::<Value>(&body) else {
        return error(StatusCode::BAD_REQUEST, "not JSON");
    };
    let tokens = state.tokenize(&body);
    let answer = json!({"count": tokens.len(),
                        "max_model_len": state.controls.max_model_len.load(Ordering::SeqCst),
                        "tokens": tokens, "token_strs": null});
    ([("content-type", "application/json")], answer.to_string()).into_response()
}

async fn models(State(state): State<Arc<EngineState>>) -> Response {
    state.seen.models.fetch_add(1, Ordering::SeqCst);
    let answer = json!({"object": "list", "data": [{"id": "tiny", "object": "model",
        "created": 0, "owned_by": "vllm", "root": "tiny", "parent": null,
        "max_model_len": 4096}]});
    ([("content-type", "application/json")], answer.to_string()).into_response()
}

async fn metrics(State(state): State<Arc<EngineState>>) -> Response {
    let running = state.seen.active.load(Ordering::SeqCst).max(0);
    let text = format!(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{engine=\"0\",model_name=\"tiny\"}} {running}.0\n\
         # HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{engine=\"0\",model_name=\"tiny\"}} 0.0\n"
    );
    ([("content-type", "text/plain; version=0.0.4")], text).into_response()
}

async fn health(State(state): State<Arc<EngineState>>) -> Response {
    state.seen.health.fetch_add(1, Ordering::SeqCst);
    if state.controls.healthy.load(Ordering::SeqCst) {
        StatusCode::OK.into_response()
    } else {
        StatusCode::SERVICE_UNAVAILABLE.into_response()
    }
}

fn app(state: Arc<EngineState>) -> axum::Router {
    axum::Router::new()
        .route("/v1/completions", post_route(completions))
        .route("/v1/chat/completions", post_route(chat_completions))
        .route("/tokenize", post_route(tokenize))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/health", get(health))
        .with_state(state)
}

impl Engine {
    /// Start a stand-in with worker id `id` on a free port of 127.0.0.1.
    pub async fn start(id: u64) -> Engine {
        Engine::start_on(
            Arc::new(EngineState::new(id)),
            "127.0.0.1:0".parse().unwrap(),
        )
        .await
    }

    async fn start_on(state: Arc<EngineState>, addr: SocketAddr) -> Engine {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .expect("bind the stand-in engine");
        let addr = listener.local_addr().expect("local addr");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let router = app(state.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, router)
                .with_graceful_shutdown(async move {
                    let _ = stopped.await;
                })
                .await;
        });
        Engine {
            state,
            addr,
            stop: Some(stop),
            task: Some(task),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stop listening and close every connection (the engine "stops answering": connections
    /// are refused). Waits until the socket is closed.
    pub async fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
        }
    }

    /// Listen again on the same address, with the same state.
    pub async fn restart(&mut self) {
        self.stop().await;
        let again = Engine::start_on(self.state.clone(), self.addr).await;
        *self = again;
    }
}

/// Poll `check` every 10 ms until it holds or `limit` passes; returns whether it held.
pub async fn eventually(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if check() {
            return true;
        }
        if start.elapsed() > limit {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The `workers:` YAML for `engines`, ids as the engines'.
pub fn workers_yaml(engines: &[&Engine]) -> String {
    let mut out = String::from("workers:\n");
    for e in engines {
        out.push_str(&format!("  - id: {}\n    url: {}\n", e.state.id, e.url()));
    }
    out
}

/// A `serve` running in this process, on a free port.
pub struct TestRouter {
    pub addr: SocketAddr,
    pub handle: router_host::serve::ServeHandle,
    pub config: PathBuf,
    task: tokio::task::JoinHandle<Result<(), router_host::serve::ServeError>>,
    _dir: super::TempDir,
}

impl TestRouter {
    /// Write `yaml` to a fresh directory and start `serve` on it.
    pub async fn start(test: &str, yaml: &str) -> TestRouter {
        let dir = super::temp_dir(test);
        let config = super::write(&dir, "router.yaml", yaml);
        let server = router_host::serve::Server::bind(router_host::serve::ServeOptions {
            config: config.clone(),
            plugin_dirs: Vec::new(),
            listen: Some("127.0.0.1:0".parse().unwrap()),
        })
        .await
        .unwrap_or_else(|err| panic!("serve did not start: {err}\n{yaml}"));
        let addr = server.local_addr();
        let handle = server.handle();
        let task = tokio::spawn(server.run());
        TestRouter {
            addr,
            handle,
            config,
            task,
            _dir: dir,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Requests booked and not finished (all configurations) and the current core's bookings.
    pub fn in_flight(&self) -> (usize, usize) {
        (
            self.handle.in_flight(),
            self.handle.loaded().host.core().in_flight(),
        )
    }

    /// The value of one sample of `/metrics` (`name{labels}` as written there), 0 if absent.
    pub fn metric(&self, sample: &str) -> f64 {
        metric_value(&self.handle.metrics_text(), sample)
    }

    /// Shut down and wait for `run` to return.
    pub async fn stop(self) {
        self.handle.shutdown();
        let result = tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("serve stops within 30 s")
            .expect("serve task");
        result.expect("serve ran without error");
    }
}

/// The value of the sample `name{labels}` in Prometheus text, 0 if absent. Labels match as a
/// subset written in order, e.g. `router_requests_total{endpoint="completions",outcome="ok"}`.
pub fn metric_value(text: &str, sample: &str) -> f64 {
    let (name, labels) = match sample.split_once('{') {
        Some((name, labels)) => (name, labels.trim_end_matches('}')),
        None => (sample, ""),
    };
    let wanted: Vec<&str> = labels.split(',').filter(|s| !s.is_empty()).collect();
    let mut total = 0.0;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some((key, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (line_name, line_labels) = match key.split_once('{') {
            Some((n, l)) => (n, l.trim_end_matches('}')),
            None => (key, ""),
        };
        if line_name != name {
            continue;
        }
        let have: Vec<&str> = line_labels.split(',').collect();
        if wanted.iter().all(|w| have.contains(w)) {
            total += value.parse::<f64>().unwrap_or(0.0);
        }
    }
    total
}

/// An HTTP client for the tests (no proxy, short timeouts).
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

/// POST `body` as JSON to `url`.
pub async fn post(client: &reqwest::Client, url: &str, body: &Value) -> reqwest::Response {
    client
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("request reaches the router")
}

/// Response header `name` as text ("" when absent or not text).
pub fn header(response: &reqwest::Response, name: &str) -> String {
    response
        .headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned()
}

/// How many of `ids` (leading) the row `(worker, 0)` holds in the current core's KV index.
pub fn held_ids(router: &TestRouter, worker: u64, ids: &[u64]) -> usize {
    let loaded = router.handle.loaded();
    let core = loaded.host.core();
    let Some(slot) = core.topology().slot(router_host::model::RowId {
        worker_id: worker,
        dp_rank: 0,
    }) else {
        return 0;
    };
    let index = core.kv_index();
    ids.iter().take_while(|&&id| index.holds(slot, id)).count()
}
