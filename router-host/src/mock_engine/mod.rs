//! `router-host mock-engine`: a simulated vLLM engine for running the whole stack without a GPU
//! (docs/engines.md, "The mock engine").
//!
//! Its timing and KV cache are the replay's engine model (`router_host::replay::engine`, the
//! same code `replay` runs), driven in real time: simulated nanoseconds are nanoseconds since
//! start. Around it, what a vLLM server shows the router: the OpenAI subset, `/tokenize`,
//! `/metrics` with vLLM's names, and KV-cache events over ZMQ in vLLM's wire format.
//!
//! Files: `rank.rs` (one data-parallel rank: the model, its requests, its events), `events.rs`
//! (block hashes, msgpack batches, the PUB and replay sockets), `tokens.rs` (tokenizers),
//! `http.rs` (the HTTP endpoints).

mod events;
mod http;
mod rank;
mod tokens;

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;

/// Run a simulated vLLM engine: the OpenAI subset, `/tokenize`, `/metrics` with vLLM's names,
/// and KV-cache events over ZMQ.
#[derive(Debug, Clone, clap::Args)]
pub struct MockArgs {
    /// HTTP address, IP:PORT (port 0 picks a free one; the chosen addresses are printed as one
    /// JSON line on stdout).
    #[arg(long, default_value = "127.0.0.1:8101")]
    pub listen: SocketAddr,
    /// Publish KV-cache events on this ZMQ PUB endpoint, `tcp://HOST:PORT` (`*` binds every
    /// interface); rank r binds PORT + r. Without it no events are published.
    #[arg(long, value_name = "tcp://HOST:PORT")]
    pub kv_events: Option<String>,
    /// Answer replay requests on this ZMQ ROUTER endpoint (rank r: PORT + r).
    #[arg(long, value_name = "tcp://HOST:PORT", requires = "kv_events")]
    pub replay_endpoint: Option<String>,
    /// Topic frame of every event message.
    #[arg(long, default_value = "")]
    pub topic: String,
    /// Publish events in the legacy positional-array form (vLLM before mid-2026) instead of
    /// maps tagged `type`.
    #[arg(long)]
    pub legacy_events: bool,
    /// Block hashes as 32-byte binaries (vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)
    /// instead of u64 integers.
    #[arg(long)]
    pub bytes_hashes: bool,
    /// Batches kept for replay requests, per rank (vLLM's `buffer_steps`).
    #[arg(long, default_value_t = 10_000, value_name = "N")]
    pub replay_buffer: usize,
    /// Served model name (`model` in requests must equal it).
    #[arg(long, default_value = "mock")]
    pub model: String,
    /// Tokens per KV block (vLLM's --block-size).
    #[arg(long, default_value_t = 16, value_name = "TOKENS")]
    pub block_size: u32,
    /// Data-parallel ranks: each a model of its own; rank r publishes on the events port + r.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub dp_size: u32,
    /// Longest prompt + max_tokens accepted.
    #[arg(long, default_value_t = 8192, value_name = "TOKENS")]
    pub max_model_len: u64,
    /// Tokenizer directory with `tokenizer.json` (and `tokenizer_config.json` for chat), as
    /// `serve.tokenizer.path`. Default: the built-in byte tokenizer (one token per UTF-8 byte).
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,
    #[command(flatten)]
    pub engine: crate::engine_flags::EngineFlags,
    /// KV capacity per rank in tokens (rounded down to blocks), instead of `--kv-blocks`.
    #[arg(long, value_name = "TOKENS", conflicts_with = "kv_blocks")]
    pub kv_tokens: Option<u64>,
    /// For tests of gap handling: sequence numbers (per rank) that go to the replay buffer but
    /// are not published live, as if the PUB socket had dropped them.
    #[arg(long, value_name = "SEQ", value_delimiter = ',', hide = true)]
    pub drop_live: Vec<u64>,
}

/// Settings every part of the mock reads.
#[derive(Debug)]
pub struct Settings {
    pub model: String,
    pub block_size: u32,
    pub max_model_len: u64,
    pub capacity_blocks: Option<u64>,
}

/// Run until SIGTERM or SIGINT.
pub fn run(args: &MockArgs) -> anyhow::Result<std::process::ExitCode> {
    if args.block_size == 0 {
        anyhow::bail!("--block-size must be at least 1");
    }
    if args.max_model_len == 0 || args.max_model_len > u64::from(u32::MAX) {
        anyhow::bail!(
            "--max-model-len must be from 1 to {}, got {}",
            u32::MAX,
            args.max_model_len
        );
    }
    if args.dp_size == 0 || args.dp_size > 64 {
        anyhow::bail!("--dp-size must be from 1 to 64, got {}", args.dp_size);
    }
    let spec = args.engine.spec(args.kv_tokens);
    // The replay's validation, with its messages (`engine.KEY: ...`) named as our flags.
    let params = spec
        .resolve(args.block_size)
        .map_err(|err| anyhow::anyhow!("{}", err.replace("engine.", "--").replace('_', "-")))?;
    let tokenizer = match &args.tokenizer {
        Some(dir) => {
            tokens::MockTokenizer::load(dir).map_err(|err| anyhow::anyhow!("--tokenizer: {err}"))?
        }
        None => tokens::MockTokenizer::Bytes,
    };
    let settings = Arc::new(Settings {
        model: args.model.clone(),
        block_size: args.block_size,
        max_model_len: args.max_model_len,
        capacity_blocks: params.capacity(),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("mock-engine")
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async move {
        let format = events::Format {
            legacy: args.legacy_events,
            bytes_hashes: args.bytes_hashes,
        };
        let mut ranks = Vec::new();
        let mut published = Vec::new();
        let mut replays = Vec::new();
        let (mut kv_base, mut replay_base) = (None, None);
        let kv_events = match &args.kv_events {
            Some(e) => Some(events::free_base(e, args.dp_size).context("--kv-events")?),
            None => None,
        };
        let replay_endpoint = match &args.replay_endpoint {
            Some(e) => Some(events::free_base(e, args.dp_size).context("--replay-endpoint")?),
            None => None,
        };
        for r in 0..args.dp_size {
            let publisher = match &kv_events {
                Some(endpoint) => {
                    let endpoint =
                        events::rank_endpoint(endpoint, r, kv_base).context("--kv-events")?;
                    let replay = match &replay_endpoint {
                        Some(e) => Some(
                            events::rank_endpoint(e, r, replay_base)
                                .context("--replay-endpoint")?,
                        ),
                        None => None,
                    };
                    let started = events::Publisher::start(events::PublisherOptions {
                        endpoint,
                        replay: replay.clone(),
                        topic: args.topic.clone(),
                        buffer: args.replay_buffer,
                        drop_live: args.drop_live.clone(),
                    })
                    .await
                    .with_context(|| format!("rank {r}"))?;
                    if r == 0 {
                        kv_base = Some(started.port);
                        replay_base = started.replay_port;
                    }
                    published.push(started.endpoint.clone());
                    if let Some(e) = &started.replay_endpoint {
                        replays.push(e.clone());
                    }
                    Some(started.sender)
                }
                None => None,
            };
            ranks.push(rank::Rank::start(
                r,
                params,
                settings.clone(),
                format,
                publisher,
            ));
        }
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("cannot listen on {}", args.listen))?;
        let addr = listener.local_addr().context("local address")?;
        let app = Arc::new(http::App::new(settings.clone(), tokenizer, ranks));
        let line = serde_json::json!({
            "http": addr.to_string(),
            "kv_events": published,
            "replay": replays,
            "block_size": args.block_size,
            "dp_size": args.dp_size,
        });
        {
            let mut out = std::io::stdout().lock();
            writeln!(out, "{line}").context("stdout")?;
            out.flush().context("stdout")?;
        }
        eprintln!(
            "router-host mock-engine: listening on http://{addr}, model {}, block size {}, {} \
             rank(s){}",
            args.model,
            args.block_size,
            args.dp_size,
            if published.is_empty() {
                String::new()
            } else {
                format!(", KV events on {}", published.join(", "))
            }
        );
        let shutdown = async {
            use tokio::signal::unix::{signal, SignalKind};
            let (Ok(mut term), Ok(mut int)) = (
                signal(SignalKind::terminate()),
                signal(SignalKind::interrupt()),
            ) else {
                return std::future::pending().await;
            };
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        };
        // Streamed chunks are small writes: without TCP_NODELAY each can wait ~40 ms for the
        // reader's delayed ACK (docs/performance.md, "`serve`: added latency").
        let listener = axum::serve::ListenerExt::tap_io(listener, |stream| {
            let _ = stream.set_nodelay(true);
        });
        axum::serve(listener, http::routes(app))
            .with_graceful_shutdown(shutdown)
            .await
            .context("HTTP server failed")?;
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(std::process::ExitCode::SUCCESS)
}
