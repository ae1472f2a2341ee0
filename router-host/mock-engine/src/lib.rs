//! # router-mock-engine
//!
//! A fake vLLM engine, in-process: an HTTP server on hyper answering what a vLLM server shows a
//! router (`/v1/completions` and `/v1/chat/completions` streamed as SSE with the final usage
//! chunk or whole, `/tokenize`, `/v1/models`, `/health`, `/metrics` with vLLM's names), with
//! fault controls a caller changes while it runs ([`Controls`]) and counters of what it saw
//! ([`Seen`]). `router-host mock-engine` runs it as a process; the router's tests and the
//! `serve` benchmark start it in their own runtime.
//!
//! Two ways to answer ([`Answers`]):
//! - [`Answers::Model`]: the replay's engine model (`router_sim::replay::engine`, the code
//!   `replay` runs) driven in real time, one model per data-parallel rank, with KV-cache events
//!   over ZMQ in vLLM's wire format and `/reset_prefix_cache`. Simulated nanoseconds are
//!   nanoseconds since start; zero step costs make it answer at once.
//! - [`Answers::Scripted`]: no model; every completion answers the same deterministic chunks
//!   ([`stream_chunks`]), so tests can compare bytes, and `/metrics` reports the completions
//!   being answered as running.
//! - [`Answers::Generated`]: no model; every next token is a deterministic function of the
//!   whole token prefix ([`generate`]), with vLLM's `return_token_ids` fields and token-id
//!   prompts, so a stream continued elsewhere from its prompt plus the tokens already generated
//!   can be compared token for token with one that was not interrupted.
//!
//! The fault controls and counters work in both.
//!
//! Reading requests and tokenizing ([`Tokenizer`]: a tokenizer directory through `tokenizers`
//! and the chat template through `minijinja`, or one token per byte) are this crate's own code,
//! not the router's, on purpose: the router tokenizes prompts locally to compute block ids, and
//! its ids must equal the engine's. Tests check that by comparing the router's local tokenizer
//! with this engine's `/tokenize`; if the engine called the router's code, a router bug would
//! be on both sides of the comparison and pass unseen. For the same reason the crate depends
//! on no router code beyond the engine model (router-sim) and the KV event kinds (router-core).

mod answer;
mod events;
mod generated;
mod http;
mod model;
mod rank;
mod request;
mod scripted;
mod tokens;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU16, AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper::HeaderMap;
use serde_json::Value;

pub use events::Format as EventFormat;
pub use generated::{generate, token_text, Generator};
pub use request::Prompt;
pub use router_sim::replay::engine::EngineParams;
pub use scripted::stream_chunks;
pub use tokens::{FileTokenizer, Tokenizer, TokenizerError, WORD_IDS};

/// Why the engine cannot start.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    /// The KV-event (PUB) endpoint.
    #[error("{0}")]
    KvEvents(String),
    /// The replay (ROUTER) endpoint.
    #[error("{0}")]
    Replay(String),
    #[error("{0}")]
    Options(String),
}

/// What the engine does, changed by its user while it runs.
#[derive(Debug)]
pub struct Controls {
    /// Non-zero: completions answer this status with a vLLM-style error body.
    pub fail_status: AtomicU16,
    /// Before the response headers of a completion.
    pub head_delay_ms: AtomicU64,
    /// Between two streamed chunks (scripted answers).
    pub chunk_delay_ms: AtomicU64,
    /// Content chunks per completion (scripted answers).
    pub chunks: AtomicUsize,
    /// `/health` answers 200 (else 503).
    pub healthy: AtomicBool,
    /// `max_model_len` reported by `/tokenize`, and the model's prompt + output limit.
    pub max_model_len: AtomicU64,
    /// Non-zero (generated answers): a stream's connection is cut after this many tokens, a
    /// whole answer's after a few bytes, as an engine that dies mid-answer.
    pub die_after_tokens: AtomicU64,
}

/// What the engine saw.
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
    /// Body of the last completion request (when it was JSON).
    pub last_body: Mutex<Option<Value>>,
}

/// How completions are answered.
#[derive(Debug)]
pub enum Answers {
    /// Deterministic chunks, no model.
    Scripted,
    /// Tokens generated from the whole prefix, no model (`generated.rs`).
    Generated,
    /// The engine model.
    Model(ModelOptions),
}

/// The engine model's settings.
#[derive(Debug, Clone)]
pub struct ModelOptions {
    /// Capacity and step costs of each rank (`EngineSpec::resolve`).
    pub params: EngineParams,
    /// Tokens per KV block (vLLM's --block-size), at least 1.
    pub block_size: u32,
    /// Data-parallel ranks, 1 to 64: each a model of its own.
    pub dp_size: u32,
    /// Publish KV-cache events; none without.
    pub events: Option<EventOptions>,
}

/// Where and how KV-cache events are published.
#[derive(Debug, Clone)]
pub struct EventOptions {
    /// ZMQ PUB endpoint `tcp://HOST:PORT` (`*` binds every interface); rank r binds PORT + r.
    pub endpoint: String,
    /// ZMQ ROUTER endpoint answering replay requests (rank r: PORT + r).
    pub replay: Option<String>,
    /// Topic frame of every event message.
    pub topic: String,
    /// Batches kept for replay requests, per rank.
    pub buffer: usize,
    pub format: EventFormat,
    /// Sequence numbers (per rank) that go to the replay buffer but are not published live, as
    /// if the PUB socket had dropped them (for tests of gap handling).
    pub drop_live: Vec<u64>,
}

/// Everything the engine is started with.
#[derive(Debug)]
pub struct Options {
    /// Worker id: the `x-engine-id` header and the ids of scripted answers.
    pub id: u64,
    pub listen: SocketAddr,
    /// Served model name, in answers and `/v1/models`.
    pub model: String,
    /// Refuse (404, as vLLM) requests naming another model; else any model is served.
    pub check_model: bool,
    /// Longest prompt + max_tokens accepted; `/v1/models` reports it.
    pub max_model_len: u64,
    pub tokenizer: Tokenizer,
    pub answers: Answers,
    /// Longest request body read; longer ones get 413.
    pub max_body_bytes: usize,
}

impl Options {
    /// Scripted answers as worker `id`, any model accepted, on a free port of 127.0.0.1.
    pub fn scripted(id: u64, tokenizer: Tokenizer) -> Options {
        Options {
            id,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            model: "tiny".into(),
            check_model: false,
            max_model_len: 4096,
            tokenizer,
            answers: Answers::Scripted,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
        }
    }

    /// Generated answers as worker `id`, otherwise as [`Options::scripted`].
    pub fn generated(id: u64, tokenizer: Tokenizer) -> Options {
        Options {
            answers: Answers::Generated,
            ..Options::scripted(id, tokenizer)
        }
    }
}

/// 2 MiB: far over any prompt a demo or test sends, and the limit it always had.
pub const DEFAULT_MAX_BODY_BYTES: usize = 2 << 20;

/// The engine's state, shared by its connections and its user.
pub struct EngineState {
    pub id: u64,
    pub controls: Controls,
    pub seen: Seen,
    model: String,
    check_model: bool,
    max_model_len: u64,
    max_body_bytes: usize,
    /// `created` in answers: 0 for scripted ones (the same request gets the same bytes).
    created: u64,
    tokenizer: Tokenizer,
    mode: Mode,
}

enum Mode {
    Scripted,
    Generated,
    Model(model::Model),
}

impl EngineState {
    /// Token ids of a request body the way this engine computes them (vLLM's way): a
    /// completion's first prompt with special tokens, chat messages through the template
    /// (add_generation_prompt defaults to true) without.
    pub fn tokenize(&self, body: &Value) -> Result<Vec<u32>, String> {
        let chat = body.get("messages").is_some();
        let bytes = serde_json::to_vec(body).map_err(|err| err.to_string())?;
        let request = request::read(chat, &bytes)?;
        self.tokenizer.tokenize_request(&request)
    }
}

struct Server {
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

/// A running engine.
pub struct Engine {
    pub state: Arc<EngineState>,
    pub addr: SocketAddr,
    /// The KV-event endpoints bound, one per rank (model answers with events).
    pub kv_events: Vec<String>,
    /// The replay endpoints bound, one per rank.
    pub replay: Vec<String>,
    server: Option<Server>,
    /// The ranks' drivers and the event sockets' tasks.
    background: Vec<tokio::task::JoinHandle<()>>,
}

impl Engine {
    /// Start the engine (and its ranks and event sockets) in the current tokio runtime.
    pub async fn start(options: Options) -> Result<Engine, Error> {
        let created = match options.answers {
            Answers::Scripted | Answers::Generated => 0,
            Answers::Model(_) => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        };
        let mut background = Vec::new();
        let (mode, kv_events, replay) = match &options.answers {
            Answers::Scripted => (Mode::Scripted, Vec::new(), Vec::new()),
            Answers::Generated => (Mode::Generated, Vec::new(), Vec::new()),
            Answers::Model(model) => {
                let started = model::Model::start(&options, model).await?;
                background.extend(started.tasks);
                (
                    Mode::Model(started.model),
                    started.kv_events,
                    started.replay,
                )
            }
        };
        let state = Arc::new(EngineState {
            id: options.id,
            controls: Controls {
                fail_status: AtomicU16::new(0),
                head_delay_ms: AtomicU64::new(0),
                chunk_delay_ms: AtomicU64::new(0),
                chunks: AtomicUsize::new(3),
                healthy: AtomicBool::new(true),
                max_model_len: AtomicU64::new(options.max_model_len),
                die_after_tokens: AtomicU64::new(0),
            },
            seen: Seen::default(),
            model: options.model,
            check_model: options.check_model,
            max_model_len: options.max_model_len,
            max_body_bytes: options.max_body_bytes,
            created,
            tokenizer: options.tokenizer,
            mode,
        });
        let mut engine = Engine {
            state,
            addr: options.listen,
            kv_events,
            replay,
            server: None,
            background,
        };
        engine.listen(options.listen).await?;
        Ok(engine)
    }

    async fn listen(&mut self, addr: SocketAddr) -> Result<(), Error> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| Error::Listen { addr, source })?;
        self.addr = listener
            .local_addr()
            .map_err(|source| Error::Listen { addr, source })?;
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(http::serve(listener, self.state.clone(), stopped));
        self.server = Some(Server { stop, task });
        Ok(())
    }

    /// `http://IP:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stop listening (connections are refused) and close every connection: answers in flight
    /// get up to 10 s to finish, then are cut. The state, ranks and event sockets stay.
    pub async fn stop(&mut self) {
        if let Some(server) = self.server.take() {
            let _ = server.stop.send(true);
            let abort = server.task.abort_handle();
            if tokio::time::timeout(Duration::from_secs(10), server.task)
                .await
                .is_err()
            {
                abort.abort();
            }
        }
    }

    /// Listen again on the same address, with the same state.
    pub async fn restart(&mut self) -> Result<(), Error> {
        self.stop().await;
        self.listen(self.addr).await
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            let _ = server.stop.send(true);
            server.task.abort();
        }
        for task in self.background.drain(..) {
            task.abort();
        }
    }
}
