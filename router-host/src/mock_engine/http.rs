//! The mock's HTTP side, shaped like vLLM's OpenAI server: `/v1/completions` and
//! `/v1/chat/completions` (streamed as SSE with the final usage chunk, or whole), `/v1/models`,
//! `/tokenize`, `/health`, `/metrics` (vLLM's metric names, labelled by `engine` = DP rank) and
//! `/reset_prefix_cache`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use router_host::serve::request::{self, Endpoint, Parsed};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::rank::{Progress, Rank};
use super::tokens::MockTokenizer;
use super::Settings;

pub struct App {
    settings: Arc<Settings>,
    tokenizer: MockTokenizer,
    ranks: Vec<Arc<Rank>>,
    next_id: AtomicU64,
    created: u64,
}

impl App {
    pub fn new(settings: Arc<Settings>, tokenizer: MockTokenizer, ranks: Vec<Arc<Rank>>) -> App {
        App {
            settings,
            tokenizer,
            ranks,
            next_id: AtomicU64::new(0),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        }
    }
}

pub fn routes(app: Arc<App>) -> axum::Router {
    axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/tokenize", post(tokenize))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .with_state(app)
}

/// vLLM's error body.
fn error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    let body = json!({"error": {"message": message.into(), "type": kind, "param": null,
                                "code": status.as_u16()}});
    (
        status,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn bad_request(message: impl Into<String>) -> Response {
    error(StatusCode::BAD_REQUEST, "BadRequestError", message)
}

fn json_response(value: &Value) -> Response {
    ([("content-type", "application/json")], value.to_string()).into_response()
}

/// Parse a body as the endpoint's request, with the model checked as vLLM does.
/// Errors are boxed: a `Response` is large.
fn parse(app: &App, endpoint: Endpoint, body: &[u8]) -> Result<Parsed, Box<Response>> {
    let parsed =
        request::parse(endpoint, body).map_err(|e| Box::new(router_host::serve::json_error(e)))?;
    if parsed.model != app.settings.model {
        return Err(Box::new(error(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            format!("The model `{}` does not exist.", parsed.model),
        )));
    }
    Ok(parsed)
}

async fn tokenize(State(app): State<Arc<App>>, body: Bytes) -> Response {
    // `{"model", "prompt"}` or `{"model", "messages", ...}`, as vLLM's /tokenize.
    let is_chat = serde_json::from_slice::<Value>(&body)
        .ok()
        .is_some_and(|v| v.get("messages").is_some());
    let endpoint = if is_chat {
        Endpoint::ChatCompletions
    } else {
        Endpoint::Completions
    };
    let parsed = match parse(&app, endpoint, &body) {
        Ok(parsed) => parsed,
        Err(response) => return *response,
    };
    match app.tokenizer.tokenize(&parsed) {
        Ok(tokens) => json_response(&json!({
            "count": tokens.len(),
            "max_model_len": app.settings.max_model_len,
            "tokens": tokens,
            "token_strs": null,
        })),
        Err(err) => bad_request(err),
    }
}

async fn completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    complete(app, Endpoint::Completions, headers, body).await
}

async fn chat_completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    complete(app, Endpoint::ChatCompletions, headers, body).await
}

/// `max_tokens` (or chat's `max_completion_tokens`), vLLM's default 16 when absent.
fn max_tokens(parsed: &Parsed) -> Result<u64, String> {
    let value = parsed
        .body
        .get("max_completion_tokens")
        .filter(|v| !v.is_null())
        .or_else(|| parsed.body.get("max_tokens").filter(|v| !v.is_null()));
    match value {
        None => Ok(16),
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => Ok(n),
            _ => Err(format!(
                "max_tokens must be an integer of at least 1, got {v}"
            )),
        },
    }
}

/// The rank named by `x-data-parallel-rank`, or the least busy one.
fn pick_rank(app: &App, headers: &HeaderMap) -> Result<Arc<Rank>, Box<Response>> {
    if let Some(value) = headers.get("x-data-parallel-rank") {
        let rank = value
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&r| r < app.ranks.len());
        return match rank {
            Some(r) => Ok(app.ranks[r].clone()),
            None => Err(Box::new(bad_request(format!(
                "x-data-parallel-rank: {value:?} is not a rank from 0 to {}",
                app.ranks.len() - 1
            )))),
        };
    }
    app.ranks
        .iter()
        .min_by_key(|r| r.active())
        .cloned()
        .ok_or_else(|| {
            Box::new(error(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                "no rank",
            ))
        })
}

async fn complete(app: Arc<App>, endpoint: Endpoint, headers: HeaderMap, body: Bytes) -> Response {
    let parsed = match parse(&app, endpoint, &body) {
        Ok(parsed) => parsed,
        Err(response) => return *response,
    };
    // The engine model runs one sequence per request; answering a batch for its first prompt
    // would be a silent fallback.
    if parsed.prompt_count() > 1 {
        return bad_request(format!(
            "the mock engine serves one prompt per request; this one has {} (send them one by one)",
            parsed.prompt_count()
        ));
    }
    let tokens = match app.tokenizer.tokenize(&parsed) {
        Ok(tokens) => tokens,
        Err(err) => return bad_request(err),
    };
    let output = match max_tokens(&parsed) {
        Ok(n) => n,
        Err(err) => return bad_request(err),
    };
    let total = (tokens.len() as u64).saturating_add(output);
    if total > app.settings.max_model_len {
        return bad_request(format!(
            "This model's maximum context length is {} tokens. However, you requested {total} \
             tokens ({} in the messages, {output} in the completion).",
            app.settings.max_model_len,
            tokens.len()
        ));
    }
    let rank = match pick_rank(&app, &headers) {
        Ok(rank) => rank,
        Err(response) => return *response,
    };
    let progress = match rank.submit(&tokens, output, parsed.cache_salt.as_deref()) {
        Ok(progress) => progress,
        Err(refused) => return bad_request(refused.0),
    };
    let n = app.next_id.fetch_add(1, Ordering::Relaxed);
    let chat = endpoint == Endpoint::ChatCompletions;
    let answer = Answer {
        id: if chat {
            format!("chatcmpl-mock-{}-{n}", rank.index)
        } else {
            format!("cmpl-mock-{}-{n}", rank.index)
        },
        chat,
        model: app.settings.model.clone(),
        created: app.created,
        prompt_tokens: tokens.len() as u64,
        output,
    };
    let mut response = if parsed.stream {
        let usage = parsed
            .body
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            == Some(true);
        stream(answer, rank, progress, usage)
    } else {
        whole(answer, progress).await
    };
    if let Some(id) = headers.get("x-request-id") {
        response.headers_mut().insert("x-request-id", id.clone());
    }
    response
}

/// What every chunk of one answer shares.
struct Answer {
    id: String,
    chat: bool,
    model: String,
    created: u64,
    prompt_tokens: u64,
    output: u64,
}

impl Answer {
    fn object(&self, streamed: bool) -> &'static str {
        match (self.chat, streamed) {
            (true, true) => "chat.completion.chunk",
            (true, false) => "chat.completion",
            (false, _) => "text_completion",
        }
    }

    fn usage(&self, cached: u64) -> Value {
        json!({"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens + self.output,
               "completion_tokens": self.output,
               "prompt_tokens_details": {"cached_tokens": cached}})
    }

    /// One streamed chunk: `text` (None: the role-only first chat chunk), `last` sets the
    /// finish reason.
    fn chunk(&self, text: Option<&str>, last: bool) -> Bytes {
        let finish = if last { json!("length") } else { Value::Null };
        let choice = if self.chat {
            let delta = match text {
                None => json!({"role": "assistant", "content": ""}),
                Some(t) => json!({"content": t}),
            };
            json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": text.unwrap_or(""), "logprobs": null,
                   "finish_reason": finish, "stop_reason": null})
        };
        let value = json!({"id": self.id, "object": self.object(true), "created": self.created,
                           "model": self.model, "choices": [choice]});
        Bytes::from(format!("data: {value}\n\n"))
    }

    fn usage_chunk(&self, cached: u64) -> Bytes {
        let value = json!({"id": self.id, "object": self.object(true), "created": self.created,
                           "model": self.model, "choices": [], "usage": self.usage(cached)});
        Bytes::from(format!("data: {value}\n\n"))
    }

    fn text(&self) -> String {
        (0..self.output).map(MockTokenizer::word).collect()
    }
}

/// Wait for the model to finish the request.
async fn until_finished(progress: &mut mpsc::UnboundedReceiver<Progress>) -> Option<u64> {
    let mut cached = None;
    while let Some(p) = progress.recv().await {
        match p {
            Progress::FirstToken { cached_tokens } => cached = Some(cached_tokens),
            Progress::Finished => return Some(cached.unwrap_or(0)),
        }
    }
    None
}

fn gone() -> Response {
    error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "InternalServerError",
        "the engine model dropped the request",
    )
}

async fn whole(answer: Answer, mut progress: mpsc::UnboundedReceiver<Progress>) -> Response {
    let Some(cached) = until_finished(&mut progress).await else {
        return gone();
    };
    let text = answer.text();
    let choice = if answer.chat {
        json!({"index": 0, "message": {"role": "assistant", "content": text},
               "logprobs": null, "finish_reason": "length"})
    } else {
        json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "length",
               "stop_reason": null})
    };
    json_response(&json!({"id": answer.id, "object": answer.object(false),
                          "created": answer.created, "model": answer.model,
                          "choices": [choice], "usage": answer.usage(cached)}))
}

/// Stream the answer: the first token when the model finishes the prefill, the following ones
/// paced at the model's decode step time, the last one when the model finishes the request.
fn stream(
    answer: Answer,
    rank: Arc<Rank>,
    mut progress: mpsc::UnboundedReceiver<Progress>,
    usage: bool,
) -> Response {
    let (sender, receiver) = mpsc::channel::<Bytes>(16);
    tokio::spawn(async move {
        // The client going away ends this task; the model still runs the request to its end.
        let send = |b: Bytes| {
            let sender = sender.clone();
            async move { sender.send(b).await.is_ok() }
        };
        let mut cached = 0;
        let mut finished = false;
        match progress.recv().await {
            Some(Progress::FirstToken { cached_tokens }) => cached = cached_tokens,
            Some(Progress::Finished) => finished = true,
            None => return,
        }
        if answer.chat && !send(answer.chunk(None, false)).await {
            return;
        }
        let mut sent = 0u64;
        while sent + 1 < answer.output && !finished {
            if !send(answer.chunk(Some(MockTokenizer::word(sent)), false)).await {
                return;
            }
            sent += 1;
            let step = rank.decode_step();
            if step < std::time::Duration::from_millis(1) {
                // Below the timer's 1 ms resolution: no pacing (near-zero timing for benchmarks).
                match progress.try_recv() {
                    Ok(Progress::Finished) => finished = true,
                    Ok(Progress::FirstToken { .. }) | Err(mpsc::error::TryRecvError::Empty) => {}
                    Err(mpsc::error::TryRecvError::Disconnected) => return,
                }
                continue;
            }
            tokio::select! {
                p = progress.recv() => match p {
                    Some(Progress::Finished) => finished = true,
                    Some(Progress::FirstToken { .. }) => {}
                    None => return,
                },
                () = tokio::time::sleep(step) => {}
            }
        }
        if !finished && until_finished(&mut progress).await.is_none() {
            return;
        }
        while sent + 1 < answer.output {
            if !send(answer.chunk(Some(MockTokenizer::word(sent)), false)).await {
                return;
            }
            sent += 1;
        }
        if !send(answer.chunk(Some(MockTokenizer::word(sent)), true)).await {
            return;
        }
        if usage && !send(answer.usage_chunk(cached)).await {
            return;
        }
        let _ = send(Bytes::from_static(b"data: [DONE]\n\n")).await;
    });
    let body = futures_util::stream::unfold(receiver, |mut receiver| async move {
        receiver
            .recv()
            .await
            .map(|b| (Ok::<_, std::convert::Infallible>(b), receiver))
    });
    let mut response = Response::new(Body::from_stream(body));
    response.headers_mut().insert(
        "content-type",
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    response
}

async fn models(State(app): State<Arc<App>>) -> Response {
    json_response(&json!({"object": "list", "data": [{
        "id": app.settings.model, "object": "model", "created": app.created,
        "owned_by": "vllm", "root": app.settings.model, "parent": null,
        "max_model_len": app.settings.max_model_len}]}))
}

async fn health() -> Response {
    StatusCode::OK.into_response()
}

async fn reset_prefix_cache(State(app): State<Arc<App>>) -> Response {
    let busy: Vec<u32> = app
        .ranks
        .iter()
        .filter(|r| !r.reset_prefix_cache())
        .map(|r| r.index)
        .collect();
    if busy.is_empty() {
        StatusCode::OK.into_response()
    } else {
        error(
            StatusCode::CONFLICT,
            "Conflict",
            format!("requests are running on rank(s) {busy:?}: the prefix cache is in use"),
        )
    }
}

/// Prometheus text with vLLM's metric names.
async fn metrics(State(app): State<Arc<App>>) -> Response {
    let s = &app.settings;
    let snapshots: Vec<_> = app.ranks.iter().map(|r| (r.index, r.snapshot())).collect();
    let mut out = String::new();
    let labels = |rank: u32| format!("engine=\"{rank}\",model_name=\"{}\"", s.model);
    let mut family = |name: &str, kind: &str, help: &str, value: &dyn Fn(u32) -> String| {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
        for (rank, _) in &snapshots {
            out.push_str(&format!("{name}{{{}}} {}\n", labels(*rank), value(*rank)));
        }
    };
    let snap = |rank: u32| snapshots.iter().find(|(r, _)| *r == rank).map(|(_, s)| *s);
    let capacity = s.capacity_blocks;
    family(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        &|r| format!("{:.1}", snap(r).map_or(0, |s| s.running) as f64),
    );
    family(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        &|r| format!("{:.1}", snap(r).map_or(0, |s| s.waiting) as f64),
    );
    family(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        &|r| {
            let used = snap(r).map_or(0, |s| s.kv_in_use);
            let usage = capacity.map_or(0.0, |c| used as f64 / c.max(1) as f64);
            format!("{usage}")
        },
    );
    let counter = |f: fn(&super::rank::Counters) -> u64| {
        move |r: u32| format!("{:.1}", snap(r).map_or(0, |s| f(&s.counters)) as f64)
    };
    family(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        &counter(|c| c.prefix_queries),
    );
    family(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        &counter(|c| c.prefix_hits),
    );
    family(
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        &counter(|c| c.prompt_tokens),
    );
    family(
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        &counter(|c| c.generation_tokens),
    );
    family(
        "vllm:num_preemptions_total",
        "counter",
        "Cumulative number of preemption from the engine.",
        &|_| "0.0".to_owned(),
    );
    family(
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
        &counter(|c| c.requests_finished),
    );
    // As vLLM counts it: the usable blocks plus its null block.
    let gpu_blocks = capacity.map_or("None".to_owned(), |c| c.saturating_add(1).to_string());
    out.push_str(
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
         # TYPE vllm:cache_config_info gauge\n",
    );
    for (rank, _) in &snapshots {
        out.push_str(&format!(
            "vllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"auto\",\
             enable_prefix_caching=\"True\",engine=\"{rank}\",num_gpu_blocks=\"{gpu_blocks}\"}} \
             1.0\n",
            s.block_size
        ));
    }
    // Not vLLM's: what the published events add up to, for checking a router against it.
    out.push_str(
        "# HELP mock:kv_published_blocks Blocks published as stored and not removed since\n\
         # TYPE mock:kv_published_blocks gauge\n",
    );
    for (rank, snapshot) in &snapshots {
        out.push_str(&format!(
            "mock:kv_published_blocks{{{}}} {}\n",
            labels(*rank),
            snapshot.counters.published_blocks
        ));
    }
    out.push_str(
        "# HELP mock:kv_event_batches Event batches published (the next sequence number)\n\
         # TYPE mock:kv_event_batches counter\n",
    );
    for (rank, snapshot) in &snapshots {
        out.push_str(&format!(
            "mock:kv_event_batches_total{{{}}} {}\n",
            labels(*rank),
            snapshot.counters.batches
        ));
    }
    (
        [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
        out,
    )
        .into_response()
}
