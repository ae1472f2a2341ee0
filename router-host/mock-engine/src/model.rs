//! Answers from the engine model: one model per data-parallel rank (`rank.rs`), the prompt's
//! tokens submitted to the rank named by `x-data-parallel-rank` or the least busy one, the
//! first token when the model finishes the prefill and the following ones paced at its decode
//! step; `/metrics` with vLLM's names labelled by `engine` = rank, and `/reset_prefix_cache`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt as _, StreamBody};
use hyper::body::Frame;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{HeaderMap, StatusCode};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::answer::{
    bad_request, check_model, error, full, json_response, Active, Completion, Refusal, Response,
};
use crate::events;
use crate::rank::{Progress, Rank, Settings};
use crate::request::Request;
use crate::{EngineState, Error, ModelOptions, Options, Tokenizer};

pub struct Model {
    settings: Arc<Settings>,
    ranks: Vec<Arc<Rank>>,
    next_id: AtomicU64,
}

/// A started model: its ranks' and sockets' tasks and the endpoints bound.
pub struct Started {
    pub model: Model,
    pub tasks: Vec<tokio::task::JoinHandle<()>>,
    pub kv_events: Vec<String>,
    pub replay: Vec<String>,
}

impl Model {
    /// Check the options, bind the event sockets and start the ranks.
    pub async fn start(options: &Options, model: &ModelOptions) -> Result<Started, Error> {
        if model.block_size == 0 {
            return Err(Error::Options("the block size must be at least 1".into()));
        }
        if options.max_model_len == 0 || options.max_model_len > u64::from(u32::MAX) {
            return Err(Error::Options(format!(
                "max_model_len must be from 1 to {}, got {}",
                u32::MAX,
                options.max_model_len
            )));
        }
        if model.dp_size == 0 || model.dp_size > 64 {
            return Err(Error::Options(format!(
                "the data-parallel size must be from 1 to 64, got {}",
                model.dp_size
            )));
        }
        let settings = Arc::new(Settings {
            block_size: model.block_size,
            capacity_blocks: model.params.capacity(),
        });
        let mut started = Started {
            model: Model {
                settings: settings.clone(),
                ranks: Vec::new(),
                next_id: AtomicU64::new(0),
            },
            tasks: Vec::new(),
            kv_events: Vec::new(),
            replay: Vec::new(),
        };
        let bases = match &model.events {
            Some(e) => Some((
                events::free_base(&e.endpoint, model.dp_size).map_err(Error::KvEvents)?,
                match &e.replay {
                    Some(r) => Some(events::free_base(r, model.dp_size).map_err(Error::Replay)?),
                    None => None,
                },
            )),
            None => None,
        };
        let (mut kv_base, mut replay_base) = (None, None);
        for r in 0..model.dp_size {
            let mut format = events::Format::default();
            let publisher = match (&model.events, &bases) {
                (Some(options), Some((endpoint, replay))) => {
                    format = options.format;
                    let endpoint =
                        events::rank_endpoint(endpoint, r, kv_base).map_err(Error::KvEvents)?;
                    let replay = match replay {
                        Some(e) => {
                            Some(events::rank_endpoint(e, r, replay_base).map_err(Error::Replay)?)
                        }
                        None => None,
                    };
                    let publisher = events::Publisher::start(events::PublisherOptions {
                        endpoint,
                        replay,
                        topic: options.topic.clone(),
                        buffer: options.buffer,
                        drop_live: options.drop_live.clone(),
                    })
                    .await?;
                    if r == 0 {
                        kv_base = Some(publisher.port);
                        replay_base = publisher.replay_port;
                    }
                    started.kv_events.push(publisher.endpoint.clone());
                    started.replay.extend(publisher.replay_endpoint.clone());
                    started.tasks.extend(publisher.tasks);
                    Some(publisher.sender)
                }
                _ => None,
            };
            let (rank, driver) = Rank::start(r, model.params, settings.clone(), format, publisher);
            started.model.ranks.push(rank);
            started.tasks.push(driver);
        }
        Ok(started)
    }

    /// The rank named by `x-data-parallel-rank`, or the least busy one.
    fn pick_rank(&self, headers: &HeaderMap) -> Result<Arc<Rank>, Refusal> {
        if let Some(value) = headers.get("x-data-parallel-rank") {
            let rank = value
                .to_str()
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
                .and_then(|r| self.ranks.get(r));
            return match rank {
                Some(r) => Ok(r.clone()),
                None => Err(Box::new(bad_request(format!(
                    "x-data-parallel-rank: {value:?} is not a rank from 0 to {}",
                    self.ranks.len().saturating_sub(1)
                )))),
            };
        }
        self.ranks
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

    fn read(state: &EngineState, completion: &Completion) -> Result<Request, Refusal> {
        let request = crate::request::read(completion.chat, &completion.bytes)
            .map_err(|message| Box::new(bad_request(message)))?;
        check_model(state, &request.model)?;
        Ok(request)
    }

    pub async fn answer(&self, state: &EngineState, completion: Completion) -> Response {
        let request = match Model::read(state, &completion) {
            Ok(request) => request,
            Err(response) => return *response,
        };
        // The engine model runs one sequence per request; answering a batch for its first
        // prompt would be a silent fallback.
        if request.prompts.len() > 1 {
            return bad_request(format!(
                "the mock engine serves one prompt per request; this one has {} (send them one \
                 by one)",
                request.prompts.len()
            ));
        }
        let tokens = match state.tokenizer.tokenize_request(&request) {
            Ok(tokens) => tokens,
            Err(err) => return bad_request(err),
        };
        let output = match request.max_tokens() {
            Ok(n) => n,
            Err(err) => return bad_request(err),
        };
        let max_model_len = state.controls.max_model_len.load(Ordering::SeqCst);
        let total = (tokens.len() as u64).saturating_add(output);
        if total > max_model_len {
            return bad_request(format!(
                "This model's maximum context length is {max_model_len} tokens. However, you \
                 requested {total} tokens ({} in the messages, {output} in the completion).",
                tokens.len()
            ));
        }
        let rank = match self.pick_rank(&completion.headers) {
            Ok(rank) => rank,
            Err(response) => return *response,
        };
        let progress = match rank.submit(&tokens, output, request.cache_salt.as_deref()) {
            Ok(progress) => progress,
            Err(refused) => return bad_request(refused.0),
        };
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let chat = completion.chat;
        let answer = Answer {
            id: if chat {
                format!("chatcmpl-mock-{}-{n}", rank.index)
            } else {
                format!("cmpl-mock-{}-{n}", rank.index)
            },
            chat,
            model: state.model.clone(),
            created: state.created,
            prompt_tokens: tokens.len() as u64,
            output,
            start: Tokenizer::first_word(&tokens),
            ids: (request
                .body
                .get("return_token_ids")
                .and_then(Value::as_bool)
                == Some(true))
            .then_some(tokens),
        };
        let mut response = if request.stream {
            stream(
                answer,
                rank,
                progress,
                request.include_usage(),
                completion.active,
            )
        } else {
            let mut active = completion.active;
            let response = whole(answer, progress).await;
            active.finished = true;
            response
        };
        if let Some(id) = completion.headers.get("x-request-id") {
            response.headers_mut().insert("x-request-id", id.clone());
        }
        response
    }

    pub fn reset_prefix_cache(&self) -> Response {
        let busy: Vec<u32> = self
            .ranks
            .iter()
            .filter(|r| !r.reset_prefix_cache())
            .map(|r| r.index)
            .collect();
        if busy.is_empty() {
            full(StatusCode::OK, "", "")
        } else {
            error(
                StatusCode::CONFLICT,
                "Conflict",
                format!("requests are running on rank(s) {busy:?}: the prefix cache is in use"),
            )
        }
    }

    /// Prometheus text with vLLM's metric names.
    pub fn metrics(&self, model: &str) -> Response {
        let s = &self.settings;
        let snapshots: Vec<_> = self.ranks.iter().map(|r| (r.index, r.snapshot())).collect();
        let mut out = String::new();
        let labels = |rank: u32| format!("engine=\"{rank}\",model_name=\"{model}\"");
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
        let counter = |f: fn(&crate::rank::Counters) -> u64| {
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
        full(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            out,
        )
    }
}

/// What every chunk of one answer shares.
struct Answer {
    id: String,
    chat: bool,
    model: String,
    created: u64,
    prompt_tokens: u64,
    output: u64,
    /// Where the answer starts in the cycle of words ([`Tokenizer::first_word`]).
    start: u64,
    /// The prompt's ids when the request asked for token ids (`return_token_ids`), as vLLM
    /// answers it: the prompt's ids in the first chunk, each chunk's generated ids; `None`:
    /// those fields are `null`.
    ids: Option<Vec<u32>>,
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

    /// The prompt's ids, or `null` when not asked for.
    fn prompt_ids(&self) -> Value {
        self.ids.as_ref().map_or(Value::Null, |ids| json!(ids))
    }

    /// The ids of generated tokens `from..to`, or `null` when not asked for.
    fn token_ids(&self, from: u64, to: u64) -> Value {
        match self.ids {
            Some(_) => (from..to)
                .map(|i| Value::from(Tokenizer::word_id(self.start + i)))
                .collect(),
            None => Value::Null,
        }
    }

    /// One streamed chunk: generated token `token` (None: the role-only first chat chunk,
    /// which carries the prompt's ids), `last` sets the finish reason. A completion's first
    /// token carries the prompt's ids.
    fn chunk(&self, token: Option<u64>, last: bool) -> Bytes {
        let finish = if last { json!("length") } else { Value::Null };
        let text = token.map(|i| Tokenizer::word(self.start + i));
        let ids = token.map_or(Value::Null, |i| self.token_ids(i, i + 1));
        let mut value = if self.chat {
            let delta = match text {
                None => json!({"role": "assistant", "content": ""}),
                Some(t) => json!({"content": t}),
            };
            let choice = json!({"index": 0, "delta": delta, "logprobs": null,
                                "finish_reason": finish, "token_ids": ids});
            json!({"id": self.id, "object": self.object(true), "created": self.created,
                   "model": self.model, "choices": [choice]})
        } else {
            let prompt = if token == Some(0) {
                self.prompt_ids()
            } else {
                Value::Null
            };
            let choice = json!({"index": 0, "text": text.unwrap_or(""), "logprobs": null,
                                "finish_reason": finish, "stop_reason": null,
                                "prompt_token_ids": prompt, "token_ids": ids});
            json!({"id": self.id, "object": self.object(true), "created": self.created,
                   "model": self.model, "choices": [choice]})
        };
        if self.chat {
            let prompt = if token.is_none() {
                self.prompt_ids()
            } else {
                Value::Null
            };
            value["prompt_token_ids"] = prompt;
        }
        Bytes::from(format!("data: {value}\n\n"))
    }

    fn usage_chunk(&self, cached: u64) -> Bytes {
        let value = json!({"id": self.id, "object": self.object(true), "created": self.created,
                           "model": self.model, "choices": [], "usage": self.usage(cached)});
        Bytes::from(format!("data: {value}\n\n"))
    }

    fn text(&self) -> String {
        (0..self.output)
            .map(|i| Tokenizer::word(self.start + i))
            .collect()
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
    let ids = answer.token_ids(0, answer.output);
    let (choice, chat_prompt) = if answer.chat {
        let choice = json!({"index": 0, "message": {"role": "assistant", "content": text},
                            "logprobs": null, "finish_reason": "length", "token_ids": ids});
        (choice, answer.prompt_ids())
    } else {
        let choice = json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "length",
                            "stop_reason": null, "token_ids": ids,
                            "prompt_token_ids": answer.prompt_ids()});
        (choice, Value::Null)
    };
    let mut value = json!({"id": answer.id, "object": answer.object(false),
                           "created": answer.created, "model": answer.model,
                           "choices": [choice], "usage": answer.usage(cached)});
    if answer.chat {
        value["prompt_token_ids"] = chat_prompt;
    }
    json_response(&value)
}

/// Stream the answer: the first token when the model finishes the prefill, the following ones
/// paced at the model's decode step time, the last one when the model finishes the request.
fn stream(
    answer: Answer,
    rank: Arc<Rank>,
    mut progress: mpsc::UnboundedReceiver<Progress>,
    usage: bool,
    active: Active,
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
            if !send(answer.chunk(Some(sent), false)).await {
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
            if !send(answer.chunk(Some(sent), false)).await {
                return;
            }
            sent += 1;
        }
        if !send(answer.chunk(Some(sent), true)).await {
            return;
        }
        if usage && !send(answer.usage_chunk(cached)).await {
            return;
        }
        let _ = send(Bytes::from_static(b"data: [DONE]\n\n")).await;
    });
    // The body ends when the task above ends: after `[DONE]` (finished) or early.
    let body = futures_util::stream::unfold(
        (receiver, Some(active)),
        |(mut receiver, mut active)| async move {
            match receiver.recv().await {
                Some(b) => Some((Ok::<_, std::io::Error>(Frame::data(b)), (receiver, active))),
                None => {
                    if let Some(a) = active.as_mut() {
                        a.finished = true;
                    }
                    None
                }
            }
        },
    );
    let mut response = hyper::Response::new(StreamBody::new(body).boxed_unsync());
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    response
}
