//! One loaded configuration ([`LoadedConfig`]): the YAML, the `Host` built from it (policies,
//! routing core), the engines' URLs, the tokenizer and the upstream HTTP client. A reload builds
//! a new one off the request path and swaps it in ([`Current`]); a request keeps the loaded configuration
//! it started on until it finishes.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;

pub use super::engine_calls::{
    call_engine, tokenize_answer_limit, Answer, AnswerError, HEALTH_ANSWER_LIMIT,
    METRICS_ANSWER_LIMIT, MODELS_ANSWER_LIMIT, TOKENIZE_IN_FLIGHT_PER_ENGINE,
};
use super::failure::ServeError;
use super::prompt::Endpoint;
use super::tokenize::LocalTokenizer;
use super::upstream::UpstreamClient;
use crate::session_store::RedisStore;
use router_config::{RouterConfig, ServeConfig, TokenizerConfig};
use router_core::model::{Cluster, Worker};
use router_policies::host::Host;
use router_policies::loader::SearchPath;
use router_policies::policy_set::PolicySet;

/// What `serve` was started with (not configuration: it does not change on reload).
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// The router YAML, read again on every reload.
    pub config: PathBuf,
    /// Directories searched first for plugins given by `name:`.
    pub plugin_dirs: Vec<PathBuf>,
    /// Overrides `serve.listen` (not re-read on reload: the socket stays).
    pub listen: Option<std::net::SocketAddr>,
}

/// How long a connection to an engine may wait unused before it is closed instead of reused.
const IDLE_CONNECTION_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Idle connections per engine kept by the client of `/tokenize`, `/health`, `/metrics` and
/// `/v1/models` (the completions pool keeps up to 256): a burst of tokenize calls leaves at
/// most this many open afterwards.
pub const AUX_IDLE_PER_ENGINE: usize = 32;
/// One engine as the proxy reaches it.
#[derive(Debug, Clone)]
pub struct Upstream {
    pub id: u64,
    /// Base URL without a trailing `/`.
    pub base: String,
    pub dp_size: u32,
    /// `base` + `/v1/completions` and `/v1/chat/completions`, parsed once at load rather than
    /// for every request.
    completions: reqwest::Url,
    chat_completions: reqwest::Url,
    /// Turns for `/tokenize` calls to this engine ([`TOKENIZE_IN_FLIGHT_PER_ENGINE`]).
    pub tokenize_turns: Arc<tokio::sync::Semaphore>,
}

impl PartialEq for Upstream {
    fn eq(&self, other: &Upstream) -> bool {
        (self.id, &self.base, self.dp_size) == (other.id, &other.base, other.dp_size)
    }
}

impl Eq for Upstream {}

impl Upstream {
    fn new(id: u64, base: &str, dp_size: u32) -> Result<Upstream, String> {
        let base = base.trim_end_matches('/').to_owned();
        reqwest::Url::parse(&base).map_err(|err| err.to_string())?;
        let url = |endpoint: Endpoint| {
            reqwest::Url::parse(&format!("{base}{}", endpoint.path())).map_err(|e| e.to_string())
        };
        Ok(Upstream {
            id,
            completions: url(Endpoint::Completions)?,
            chat_completions: url(Endpoint::ChatCompletions)?,
            base,
            dp_size,
            tokenize_turns: Arc::new(tokio::sync::Semaphore::new(TOKENIZE_IN_FLIGHT_PER_ENGINE)),
        })
    }

    /// Where a request to `endpoint` goes on this engine.
    pub fn url(&self, endpoint: Endpoint) -> reqwest::Url {
        match endpoint {
            Endpoint::ChatCompletions => self.chat_completions.clone(),
            Endpoint::Completions | Endpoint::Models => self.completions.clone(),
        }
    }
}

/// One loaded configuration.
pub struct LoadedConfig {
    /// 1 for the configuration loaded at start, +1 per successful reload.
    pub number: u64,
    pub config: RouterConfig,
    /// `serve:` with its defaults when the file has none.
    pub serve: ServeConfig,
    pub host: Host,
    /// The session store shared with other replicas, when bindings live in Redis.
    pub shared_sessions: Option<Arc<RedisStore>>,
    /// Sorted by id.
    pub upstreams: Vec<Upstream>,
    /// `None`: remote tokenization.
    pub tokenizer: Option<Arc<LocalTokenizer>>,
    /// Whether requests are tokenized: what reads their token ids.
    pub prompt_ids: crate::pipeline::PromptIds,
    /// For `/tokenize`, `/v1/models` and the like; completions go through `upstream`.
    pub client: reqwest::Client,
    pub upstream: UpstreamClient,
}

impl std::fmt::Debug for LoadedConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generation")
            .field("number", &self.number)
            .field("upstreams", &self.upstreams)
            .finish_non_exhaustive()
    }
}

impl LoadedConfig {
    /// Read and validate the YAML, load plugins and create instances, build the cluster and the
    /// host, load a local tokenizer. Blocking (file I/O, `dlopen`): run it off the request path.
    ///
    /// On a reload, `previous` is the running loaded configuration: the new one keeps its session table
    /// when the settings allow ([`Host::reusable_table`]), so a reload forgets no binding. (Its
    /// KV index is seeded by the KV-event subscribers, `kv_events/`.)
    pub fn load(
        options: &ServeOptions,
        number: u64,
        previous: Option<&LoadedConfig>,
    ) -> Result<LoadedConfig, ServeError> {
        let file = options.config.clone();
        let config = RouterConfig::from_file(&file)?;
        if config.workers.is_empty() {
            return Err(ServeError::NoWorkers { file });
        }
        let serve = config.serve.clone().unwrap_or_default();
        let mut upstreams = Vec::with_capacity(config.workers.len());
        let mut workers = Vec::with_capacity(config.workers.len());
        for (index, w) in config.workers.iter().enumerate() {
            let upstream = match Upstream::new(w.id, &w.url, w.dp_size) {
                Ok(upstream) => upstream,
                Err(reason) => {
                    return Err(ServeError::WorkerUrl {
                        file,
                        index,
                        url: w.url.clone(),
                        reason,
                    })
                }
            };
            let mut worker = Worker::new(w.id).with_ranks(0, w.dp_size);
            worker.max_num_batched_tokens = w.max_num_batched_tokens;
            worker.total_kv_blocks = w.total_kv_blocks;
            worker.draining = w.draining;
            workers.push(worker);
            upstreams.push(upstream);
        }
        upstreams.sort_by_key(|u| u.id);
        let cluster = Cluster::new(workers).map_err(|err| ServeError::Cluster {
            file: file.clone(),
            reason: err.to_string(),
        })?;
        router_core::blocks::BlockHasher::new(config.block_size, Default::default()).map_err(
            |err| ServeError::BlockSize {
                file: file.clone(),
                reason: err.to_string(),
            },
        )?;
        let tokenizer = match &serve.tokenizer {
            TokenizerConfig::Remote => None,
            TokenizerConfig::Local { path, cache_bytes } => {
                // Unchanged files: keep the loaded tokenizer, so its caches survive a reload.
                let unchanged = previous
                    .and_then(|p| p.tokenizer.clone())
                    .filter(|t| t.is_loaded_from(path, *cache_bytes));
                match unchanged {
                    Some(tokenizer) => Some(tokenizer),
                    None => {
                        let local =
                            LocalTokenizer::load(path).map_err(|reason| ServeError::Tokenizer {
                                file: file.clone(),
                                reason,
                            })?;
                        Some(Arc::new(local.with_segment_cache(*cache_bytes)))
                    }
                }
            }
        };
        let client = reqwest::Client::builder()
            .connect_timeout(serve.timeouts.connect)
            .no_proxy()
            .tcp_nodelay(true)
            .pool_idle_timeout(IDLE_CONNECTION_TIMEOUT)
            .pool_max_idle_per_host(AUX_IDLE_PER_ENGINE)
            // An engine's redirect would send the prompt (or the probe) elsewhere.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|err| ServeError::Client(err.to_string()))?;
        let upstream = UpstreamClient::new(serve.timeouts.connect, IDLE_CONNECTION_TIMEOUT)
            .map_err(ServeError::Client)?;
        let search = SearchPath::new(options.plugin_dirs.clone(), Some(&file));
        let router =
            PolicySet::from_config(&config, &search).map_err(|err| ServeError::Startup {
                file: file.clone(),
                cause: Box::new(err),
            })?;
        let prompt_ids = crate::pipeline::PromptIds::of(&config, &serve, &router);
        prompt_ids.log(number);
        // The session store is connected here (off the request path): bounded by its timeout.
        let (host, shared_sessions) =
            crate::session_store::live_host(router, cluster, &config, previous.map(|p| &p.host))
                .map_err(|err| ServeError::SessionStore {
                    file: file.clone(),
                    cause: err,
                })?;
        Ok(LoadedConfig {
            number,
            config,
            serve,
            host,
            shared_sessions,
            upstreams,
            tokenizer,
            prompt_ids,
            client,
            upstream,
        })
    }

    pub fn upstream(&self, worker_id: u64) -> Option<&Upstream> {
        self.upstreams
            .binary_search_by_key(&worker_id, |u| u.id)
            .ok()
            .map(|i| &self.upstreams[i])
    }

    /// The configuration file.
    pub fn file(&self) -> &Path {
        self.config
            .source
            .as_deref()
            .unwrap_or(Path::new("<string>"))
    }
}

/// The loaded configuration serving new requests, swapped atomically on reload.
pub struct Current(ArcSwap<LoadedConfig>);

impl std::fmt::Debug for Current {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Current")
            .field(&self.0.load().number)
            .finish()
    }
}

impl Current {
    pub fn new(loaded: LoadedConfig) -> Current {
        Current(ArcSwap::from_pointee(loaded))
    }

    pub fn load(&self) -> Arc<LoadedConfig> {
        self.0.load_full()
    }

    pub fn swap(&self, next: Arc<LoadedConfig>) -> Arc<LoadedConfig> {
        self.0.swap(next)
    }
}
