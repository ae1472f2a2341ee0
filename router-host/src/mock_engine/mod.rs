//! `router-host mock-engine`: the flags of the simulated vLLM engine (docs/engines.md, "The
//! mock engine") and a process around it. The engine itself is the `router-mock-engine` crate
//! (its engine model answers, with KV-cache events over ZMQ), the one the tests use in-process.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context as _;
use mock_engine::{Answers, Engine, EventFormat, EventOptions, ModelOptions, Options, Tokenizer};

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
        Some(dir) => Tokenizer::load(dir).map_err(|err| anyhow::anyhow!("--tokenizer: {err}"))?,
        None => Tokenizer::Bytes,
    };
    let events = args.kv_events.as_ref().map(|endpoint| EventOptions {
        endpoint: endpoint.clone(),
        replay: args.replay_endpoint.clone(),
        topic: args.topic.clone(),
        buffer: args.replay_buffer,
        format: EventFormat {
            legacy: args.legacy_events,
            bytes_hashes: args.bytes_hashes,
        },
        drop_live: args.drop_live.clone(),
    });
    let options = Options {
        id: 0,
        listen: args.listen,
        model: args.model.clone(),
        check_model: true,
        max_model_len: args.max_model_len,
        tokenizer,
        answers: Answers::Model(ModelOptions {
            params,
            block_size: args.block_size,
            dp_size: args.dp_size,
            events,
        }),
        max_body_bytes: mock_engine::DEFAULT_MAX_BODY_BYTES,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("mock-engine")
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async move {
        let mut engine = Engine::start(options).await.map_err(|err| match err {
            mock_engine::Error::KvEvents(message) => anyhow::anyhow!("--kv-events: {message}"),
            mock_engine::Error::Replay(message) => {
                anyhow::anyhow!("--replay-endpoint: {message}")
            }
            other => anyhow::anyhow!(other),
        })?;
        let addr = engine.addr;
        let line = serde_json::json!({
            "http": addr.to_string(),
            "kv_events": engine.kv_events,
            "replay": engine.replay,
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
            if engine.kv_events.is_empty() {
                String::new()
            } else {
                format!(", KV events on {}", engine.kv_events.join(", "))
            }
        );
        {
            use tokio::signal::unix::{signal, SignalKind};
            let mut term = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
            let mut int = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        engine.stop().await;
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(std::process::ExitCode::SUCCESS)
}
