//! `workers:`: the engines `router-host serve` routes to (ignored by `select` and `replay`, which
//! take their workers from the scenario or the simulator), in the config or in the file
//! `workers_file:` names (the same schema, parsed and checked by the same code).

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer};

use super::error::{excerpt, ConfigError, ConfigErrorKind};
use super::limits::MAX_ROWS;
use super::locate::{key, Seg};
use super::numbers::de_uint;
use super::{Builder, LINE_LOOKUP_BUDGET};

/// One entry of `workers:`: an engine process with an OpenAI-compatible HTTP server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerConfig {
    /// The worker id the router and its policies know the engine by (unique).
    pub id: u64,
    /// Base URL of the engine's HTTP server, `http://` or `https://`, without a trailing `/`
    /// (`http://127.0.0.1:8101`); paths such as `/v1/completions` are appended to it.
    pub url: String,
    /// Data-parallel ranks `0 .. dp_size` (default 1).
    pub dp_size: u32,
    /// The engine's prefill token budget per step (vLLM `--max-num-batched-tokens`), for the
    /// `prefill_busy_threshold_frac` admission rule; `None` = unknown.
    pub max_num_batched_tokens: Option<u64>,
    /// The engine's KV capacity in blocks, when known.
    pub total_kv_blocks: Option<u64>,
    /// Where the engine publishes its KV-cache events (vLLM `--kv-events-config`), if it does.
    pub kv_events: Option<KvEventsConfig>,
    /// Draining: the worker takes no new requests (not even pinned or session-bound ones);
    /// requests in flight on it finish. Set and cleared by editing the file and reloading.
    pub draining: bool,
    /// The engine's KV block size in tokens (vLLM `--block-size`); events of another size are
    /// refused. Defaults to, and must equal, the top-level `block_size`.
    pub block_size: u32,
    /// 1-based line of the entry in the file (best effort).
    pub line: Option<usize>,
}

/// `workers[].kv_events`: the engine's ZMQ publisher (docs/serve.md, "KV-cache events").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsConfig {
    /// `tcp://HOST:PORT` the engine's rank 0 publishes on; rank `r` publishes on `PORT + r`.
    pub endpoint: String,
    /// `tcp://HOST:PORT` of the engine's replay socket (rank `r` on `PORT + r`), if set.
    pub replay_endpoint: Option<String>,
    /// Topic prefix to subscribe to (`""`: every message).
    pub topic: String,
    /// Most blocks indexed per rank and tier (on the device, the engine's known KV capacity
    /// plus a quarter plus 64 blocks, when that is smaller).
    pub max_indexed_blocks: u64,
    /// A row whose batches arrive more than this many ms after their timestamp is `lagging`
    /// (docs/serve.md, "KV index states").
    pub max_lag_ms: u64,
    /// How long a row stays `stale` after a gap replay could not fill before its entries are
    /// cleared and it is `current` again with what arrives from then on.
    pub stale_clear_ms: u64,
    /// At start, how long the row's subscriber may spend filling the index from the engine's
    /// replay socket before `/ready` stops waiting for it (0: no warm start).
    pub warm_start_ms: u64,
}

/// Default `kv_events.max_indexed_blocks`: above the device cache of real engines (a 7-8B
/// model on an 80 GB GPU holds about 30,000 blocks of 16 tokens, a 0.5B one about 300,000)
/// and of a host offload tier of a few hundred GB, while bounding one rank's tier to about
/// 150 MB of index.
pub const DEFAULT_MAX_INDEXED_BLOCKS: u64 = 1 << 20;

/// Default `kv_events.max_lag_ms`: a batch reaches the router within a millisecond on loopback
/// (two mock engines behind `serve`, 200 requests: `router_kv_event_lag_seconds` under 1 ms),
/// a few ms on a LAN, and NTP keeps hosts within tens of ms of each other; 5 s is two orders of
/// magnitude above that, so only a real backlog (or an engine clock that is badly off, which
/// the lag gauge then shows) makes a row lagging.
pub const DEFAULT_MAX_LAG_MS: u64 = 5_000;

/// Default `kv_events.stale_clear_ms`: two scrapes at Prometheus' usual 15 s interval see the
/// row stale, and the row routes load-only for at most that long before its index starts
/// over from what arrives.
pub const DEFAULT_STALE_CLEAR_MS: u64 = 30_000;

/// Default `kv_events.warm_start_ms`: a full 10,000-batch replay buffer (the mock engine's, as
/// vLLM's default `buffer_steps`) filled a starting router's index in 0.31 s on loopback (debug
/// build, docs/serve.md, "Warm start"); 5 s leaves a margin of more than ten and is still short
/// next to an engine's own start. An engine that does not answer holds `/ready` no longer.
pub const DEFAULT_WARM_START_MS: u64 = 5_000;

/// Longest accepted `kv_events.warm_start_ms`: a minute.
const MAX_WARM_START_MS: u64 = 60_000;

/// Upper bound of the `kv_events` times in ms: a day.
const MAX_KV_EVENTS_MS: u64 = 86_400_000;

impl KvEventsConfig {
    /// The endpoint of `rank`: the port plus the rank.
    pub fn endpoint_for(&self, rank: u32) -> String {
        offset_port(&self.endpoint, rank)
    }

    /// The replay endpoint of `rank`, when one is configured.
    pub fn replay_endpoint_for(&self, rank: u32) -> Option<String> {
        self.replay_endpoint
            .as_deref()
            .map(|e| offset_port(e, rank))
    }
}

/// `tcp://host:port` with `port + rank` (the endpoint was checked by [`check_zmq_endpoint`]).
fn offset_port(endpoint: &str, rank: u32) -> String {
    match endpoint.rsplit_once(':') {
        Some((head, port)) => match port.parse::<u32>() {
            Ok(port) => format!("{head}:{}", port + rank),
            Err(_) => endpoint.to_owned(),
        },
        None => endpoint.to_owned(),
    }
}

/// A ZMQ endpoint the router connects to: `tcp://HOST:PORT`, a concrete host (not `*`).
pub(super) fn check_zmq_endpoint(v: &str) -> Result<u16, String> {
    let bad = |why: &str| format!("invalid ZMQ endpoint `{}`: {why}", excerpt(v));
    let rest = v
        .strip_prefix("tcp://")
        .ok_or_else(|| bad("it must start with `tcp://` (the router connects over TCP)"))?;
    if v.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(bad("it contains whitespace or control characters"));
    }
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| bad("it needs a port, as in `tcp://127.0.0.1:5557`"))?;
    if host.is_empty() || host.contains('/') {
        return Err(bad("it has no host"));
    }
    if host == "*" || host == "0.0.0.0" || host == "[::]" {
        return Err(bad(
            "the router connects to the engine: name the engine's host, not a wildcard",
        ));
    }
    port.parse::<u16>()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| bad("the port must be a number from 1 to 65535"))
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a `kv_events` mapping with `endpoint`"
)]
pub(super) struct RawKvEvents {
    #[serde(deserialize_with = "de_endpoint")]
    endpoint: String,
    #[serde(default, deserialize_with = "de_opt_endpoint")]
    replay_endpoint: Option<String>,
    #[serde(default)]
    topic: Option<String>,
    #[serde(default, deserialize_with = "de_positive")]
    max_indexed_blocks: Option<u64>,
    #[serde(default, deserialize_with = "de_kv_ms")]
    max_lag_ms: Option<u64>,
    #[serde(default, deserialize_with = "de_kv_ms")]
    stale_clear_ms: Option<u64>,
    #[serde(default, deserialize_with = "de_warm_start_ms")]
    warm_start_ms: Option<u64>,
}

/// Accepts a ZMQ endpoint the router connects to (see [`check_zmq_endpoint`]).
struct EndpointVisitor;

impl<'de> Visitor<'de> for EndpointVisitor {
    type Value = Option<String>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a ZMQ endpoint such as `tcp://127.0.0.1:5557`")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Option<String>, E> {
        check_zmq_endpoint(v).map_err(E::custom)?;
        Ok(Some(v.to_owned()))
    }

    null_is_absent!();
}

fn de_endpoint<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    d.deserialize_any(EndpointVisitor)?
        .ok_or_else(|| de::Error::invalid_type(de::Unexpected::Unit, &EndpointVisitor))
}

fn de_opt_endpoint<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    d.deserialize_any(EndpointVisitor)
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a worker mapping with `id` and `url`"
)]
pub(super) struct RawWorker {
    #[serde(deserialize_with = "de_worker_id")]
    id: u64,
    #[serde(deserialize_with = "de_url")]
    url: String,
    #[serde(default, deserialize_with = "super::limits::de_dp_size")]
    dp_size: Option<u32>,
    #[serde(default, deserialize_with = "de_positive")]
    max_num_batched_tokens: Option<u64>,
    #[serde(default, deserialize_with = "de_positive")]
    total_kv_blocks: Option<u64>,
    #[serde(default)]
    kv_events: Option<RawKvEvents>,
    #[serde(default, deserialize_with = "super::numbers::de_block_size")]
    block_size: Option<u32>,
    #[serde(default)]
    draining: bool,
}

fn de_worker_id<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    de_uint(d, 0, u64::MAX)?.ok_or_else(|| {
        de::Error::invalid_type(de::Unexpected::Unit, &"a worker id (an integer >= 0)")
    })
}

fn de_positive<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 1, u64::MAX)
}

fn de_kv_ms<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 1, MAX_KV_EVENTS_MS)
}

fn de_warm_start_ms<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 0, MAX_WARM_START_MS)
}

/// Accepts an `http://` or `https://` URL with a host and no query or fragment; returns it
/// without a trailing `/`.
struct UrlVisitor;

/// The checks on an engine base URL (shared with nothing else: the server parses it again).
pub(super) fn check_url(v: &str) -> Result<String, String> {
    let bad = |why: &str| format!("invalid engine url `{}`: {why}", excerpt(v));
    let rest = v
        .strip_prefix("http://")
        .or_else(|| v.strip_prefix("https://"))
        .ok_or_else(|| bad("it must start with `http://` or `https://`"))?;
    if v.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(bad("it contains whitespace or control characters"));
    }
    if v.contains(['?', '#']) {
        return Err(bad("a base URL has no query (`?`) or fragment (`#`)"));
    }
    let authority = rest.split('/').next().unwrap_or("");
    if authority.is_empty() || authority.starts_with(':') {
        return Err(bad("it has no host"));
    }
    if authority.contains('@') {
        return Err(bad("credentials in the URL are not supported"));
    }
    if let Some((host, port)) = authority.rsplit_once(':') {
        // `[::1]` alone has colons inside its brackets, and no port.
        let bracketed_without_port = host.starts_with('[') && !host.ends_with(']');
        if !bracketed_without_port && !port.ends_with(']') && port.parse::<u16>().is_err() {
            return Err(bad("the port must be a number from 0 to 65535"));
        }
    }
    Ok(v.trim_end_matches('/').to_owned())
}

impl Visitor<'_> for UrlVisitor {
    type Value = String;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an engine base URL such as `http://127.0.0.1:8101`")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<String, E> {
        check_url(v).map_err(E::custom)
    }
}

fn de_url<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    d.deserialize_any(UrlVisitor)
}

impl Builder<'_> {
    pub(super) fn workers(
        &mut self,
        raw: Vec<RawWorker>,
        router_block_size: u32,
    ) -> Result<Vec<WorkerConfig>, ConfigError> {
        // The same cap `serve` meets when it builds the cluster, found by `check` as well.
        let rows: u64 = raw.iter().map(|w| u64::from(w.dp_size.unwrap_or(1))).sum();
        if rows > MAX_ROWS as u64 {
            return Err(self.error(
                &[key("workers")],
                ConfigErrorKind::Yaml {
                    message: format!(
                        "{rows} rows in total (the sum of every dp_size), over the limit of \
                         {MAX_ROWS}"
                    ),
                },
            ));
        }
        let mut first: std::collections::HashMap<u64, usize> = std::collections::HashMap::new();
        let mut workers = Vec::with_capacity(raw.len());
        for (index, worker) in raw.into_iter().enumerate() {
            let path = [key("workers"), Seg::Index(index)];
            if let Some(&earlier) = first.get(&worker.id) {
                let id_path = |i| [key("workers"), Seg::Index(i), key("id")];
                let first_line =
                    super::locate::locate(self.text, &id_path(earlier)).map(|(line, _)| line);
                return Err(self.error(
                    &id_path(index),
                    ConfigErrorKind::DuplicateWorker {
                        id: worker.id,
                        first_line,
                    },
                ));
            }
            first.insert(worker.id, index);
            let dp_size = worker.dp_size.unwrap_or(1);
            let block_size = worker.block_size.unwrap_or(router_block_size);
            if block_size != router_block_size {
                let message = format!(
                    "the worker's block_size {block_size} differs from the top-level \
                     block_size {router_block_size}: prompts are hashed with the top-level \
                     size, so this engine's blocks would never match (use one block size \
                     for every engine)"
                );
                return Err(self.error(
                    &[key("workers"), Seg::Index(index), key("block_size")],
                    ConfigErrorKind::Yaml { message },
                ));
            }
            let kv_events = match worker.kv_events {
                None => None,
                Some(raw) => {
                    let config = KvEventsConfig {
                        endpoint: raw.endpoint,
                        replay_endpoint: raw.replay_endpoint,
                        topic: raw.topic.unwrap_or_default(),
                        max_indexed_blocks: raw
                            .max_indexed_blocks
                            .unwrap_or(DEFAULT_MAX_INDEXED_BLOCKS),
                        max_lag_ms: raw.max_lag_ms.unwrap_or(DEFAULT_MAX_LAG_MS),
                        stale_clear_ms: raw.stale_clear_ms.unwrap_or(DEFAULT_STALE_CLEAR_MS),
                        warm_start_ms: raw.warm_start_ms.unwrap_or(DEFAULT_WARM_START_MS),
                    };
                    let last_rank = dp_size.saturating_sub(1);
                    let endpoints = std::iter::once(("endpoint", Some(&config.endpoint))).chain(
                        std::iter::once(("replay_endpoint", config.replay_endpoint.as_ref())),
                    );
                    for (name, endpoint) in endpoints {
                        let Some(endpoint) = endpoint else { continue };
                        let port = check_zmq_endpoint(endpoint).unwrap_or(0);
                        if u32::from(port) + last_rank > u32::from(u16::MAX) {
                            let message = format!(
                                "port {port} + rank {last_rank} (dp_size {dp_size}) is over 65535"
                            );
                            return Err(self.error(
                                &[
                                    key("workers"),
                                    Seg::Index(index),
                                    key("kv_events"),
                                    key(name),
                                ],
                                ConfigErrorKind::Yaml { message },
                            ));
                        }
                    }
                    Some(config)
                }
            };
            workers.push(WorkerConfig {
                line: self.entry_line(&path),
                id: worker.id,
                url: worker.url,
                dp_size,
                max_num_batched_tokens: worker.max_num_batched_tokens,
                total_kv_blocks: worker.total_kv_blocks,
                kv_events,
                block_size,
                draining: worker.draining,
            });
        }
        Ok(workers)
    }
}

/// `workers_file:`: the file the workers were read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkersFile {
    /// As resolved: relative paths against the config file's directory.
    pub path: PathBuf,
    /// Its version when read; `None` when its metadata could not be read.
    pub version: Option<FileVersion>,
}

/// What tells one version of a file from another without reading it: its metadata, following
/// symlinks (so a Kubernetes ConfigMap's swapped `..data` link is a new version).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileVersion {
    modified: Option<SystemTime>,
    len: u64,
    dev: u64,
    ino: u64,
}

impl FileVersion {
    /// The version of the file at `path` now.
    pub fn of(path: &Path) -> Result<FileVersion, std::io::ErrorKind> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path).map_err(|err| err.kind())?;
        Ok(FileVersion {
            modified: meta.modified().ok(),
            len: meta.len(),
            dev: meta.dev(),
            ino: meta.ino(),
        })
    }
}

/// `workers_file:`: a path (relative: to the config file's directory).
pub(super) fn de_workers_file<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let path = Option::<String>::deserialize(d)?;
    match path {
        Some(path) if path.trim().is_empty() => Err(de::Error::custom(
            "`workers_file` is empty: name the file that lists the workers",
        )),
        Some(path) if path.contains('\0') => {
            Err(de::Error::custom("`workers_file` contains a NUL character"))
        }
        path => Ok(path),
    }
}

/// What a workers file holds: `workers:`, exactly as in the config.
#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a workers file: a mapping with one key, `workers`, a list of workers"
)]
struct RawWorkersFile {
    #[serde(default)]
    workers: Option<Vec<RawWorker>>,
}

/// Read, parse and check the workers file `file`; errors name it, the entry's key path
/// (`workers[1].url`) and its line, as errors in the config do.
pub(super) fn from_file(file: &Path, block_size: u32) -> Result<Vec<WorkerConfig>, ConfigError> {
    let bytes = super::read_capped(file)?;
    let text = std::str::from_utf8(&bytes).map_err(|err| {
        let (line, column) = super::line_column(&bytes, err.valid_up_to());
        ConfigError::new(Some(file), ConfigErrorKind::NotUtf8(err)).at(Some((line, column)))
    })?;
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    if let Some(too_deep) = super::nesting_too_deep(text) {
        let (line, column) = match too_deep {
            super::TooDeep::Flow { line, column } | super::TooDeep::Block { line, column } => {
                (line, column)
            }
        };
        let message = "recursion limit exceeded: a workers file nests too deep".to_owned();
        return Err(
            ConfigError::new(Some(file), ConfigErrorKind::Yaml { message })
                .at(Some((line, column))),
        );
    }
    let raw: Option<RawWorkersFile> =
        serde_yaml::from_str(text).map_err(|err| super::yaml_error(&err, Some(file)))?;
    let raw = raw.and_then(|raw| raw.workers).unwrap_or_default();
    if raw.is_empty() {
        let message = "the workers file lists no workers (`workers:` with at least one entry, \
                       each with `id` and `url`)"
            .to_owned();
        return Err(
            ConfigError::new(Some(file), ConfigErrorKind::Yaml { message })
                .key("workers".to_owned()),
        );
    }
    let mut builder = Builder {
        text,
        source: Some(file),
        budget: LINE_LOOKUP_BUDGET,
    };
    builder.workers(raw, block_size)
}

#[cfg(test)]
mod workers_file_tests {
    use crate::RouterConfig;

    fn dir(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("router-config-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    }

    #[test]
    fn a_relative_workers_file_is_read_beside_the_config() {
        let dir = dir("workers-file-ok");
        std::fs::write(
            dir.join("workers.yaml"),
            "workers:\n  - {id: 7, url: 'http://10.0.0.7:8000'}\n",
        )
        .unwrap();
        let config = dir.join("router.yaml");
        std::fs::write(&config, "workers_file: workers.yaml\n").unwrap();
        let parsed = RouterConfig::from_file(&config).expect("valid");
        assert_eq!(parsed.workers.len(), 1);
        assert_eq!(parsed.workers[0].id, 7);
        assert_eq!(parsed.workers[0].line, Some(2));
        let file = parsed.workers_file.expect("the file is recorded");
        assert_eq!(file.path, dir.join("workers.yaml"));
        assert!(file.version.is_some());
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_bad_entry_names_the_workers_file_the_entry_and_its_line() {
        let dir = dir("workers-file-bad");
        std::fs::write(
            dir.join("w.yaml"),
            "workers:\n  - {id: 1, url: 'http://10.0.0.1:8000'}\n  - {id: 2, url: 'ftp://x'}\n",
        )
        .unwrap();
        let config = dir.join("router.yaml");
        std::fs::write(&config, "workers_file: w.yaml\n").unwrap();
        let err = RouterConfig::from_file(&config)
            .expect_err("a bad url")
            .to_string();
        assert!(err.contains("w.yaml"), "{err}");
        assert!(err.contains("line 3"), "{err}");
        assert!(err.contains("workers[1].url"), "{err}");

        std::fs::write(dir.join("w.yaml"), "workers: []\n").unwrap();
        let err = RouterConfig::from_file(&config)
            .expect_err("no workers")
            .to_string();
        assert!(
            err.contains("w.yaml") && err.contains("lists no workers"),
            "{err}"
        );

        std::fs::remove_file(dir.join("w.yaml")).unwrap();
        let err = RouterConfig::from_file(&config)
            .expect_err("no file")
            .to_string();
        assert!(err.contains("w.yaml"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn workers_and_workers_file_together_are_refused() {
        let err = RouterConfig::from_yaml_str(
            "workers:\n  - {id: 1, url: 'http://10.0.0.1:8000'}\nworkers_file: w.yaml\n",
            None,
        )
        .expect_err("both")
        .to_string();
        assert!(
            err.contains("workers_file") && err.contains("both set"),
            "{err}"
        );
    }
}
