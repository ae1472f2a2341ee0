//! `serve:`: settings of the live proxy, `router-host serve` (docs/serve.md). Other commands
//! ignore them; they are still validated by every command that reads the file.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

use super::error::excerpt;
use super::numbers::de_uint;
use super::{config_dir, Builder};

/// Default `serve.listen`.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8000";
/// Default `serve.session_headers`, tried in order.
pub const DEFAULT_SESSION_HEADERS: &[&str] = &["x-session-id", "x-dynamo-session-id"];
/// Default `serve.session_body_fields`, tried after the headers.
pub const DEFAULT_SESSION_BODY_FIELDS: &[&str] = &["user"];
/// Default `serve.max_body_bytes`: 8 MiB.
pub const DEFAULT_MAX_BODY_BYTES: u64 = 8 * 1024 * 1024;
/// Largest accepted `serve.max_body_bytes`: 1 GiB.
pub const MAX_MAX_BODY_BYTES: u64 = 1024 * 1024 * 1024;
/// Default `serve.retries`.
pub const DEFAULT_RETRIES: u32 = 1;
/// Largest accepted `serve.retries`.
pub const MAX_RETRIES: u64 = 16;
/// Default `serve.migration_limit`: one engine failing at a time is the common case, and one
/// more leg covers it; a stream that never fails only pays for reading its token ids.
pub const DEFAULT_MIGRATION_LIMIT: u32 = 1;
/// Largest accepted `serve.migration_limit`.
pub const MAX_MIGRATION_LIMIT: u64 = 16;
/// Longest accepted timeout or interval: one day.
pub const MAX_TIMEOUT_MS: u64 = 86_400_000;
/// Largest accepted `serve.max_connections`.
pub const MAX_MAX_CONNECTIONS: u64 = 16 * 1024 * 1024;

/// `serve:` settings, with their defaults filled in.
#[derive(Debug, Clone, PartialEq)]
pub struct ServeConfig {
    /// Address to listen on (`--listen` overrides it).
    pub listen: SocketAddr,
    /// Where prompts are tokenized.
    pub tokenizer: TokenizerConfig,
    /// Request headers that carry a session id, tried in order (lowercase).
    pub session_headers: Vec<String>,
    /// Top-level body fields that carry a session id, tried after the headers.
    pub session_body_fields: Vec<String>,
    /// Add `x-router-*` headers with the decision to every routed response.
    pub decision_headers: bool,
    /// Served by `GET /v1/models` instead of asking an engine; empty = ask the first healthy one.
    pub models: Vec<String>,
    /// Send a completion's text prompt to the engine as the token ids the router computed, so
    /// the engine does not tokenize it again. Safe only when those ids are the engine's: remote
    /// tokenization, or a local tokenizer directory holding the engine's own files.
    pub forward_token_ids: bool,
    /// `model` names that are LoRA adapters (vLLM's `--lora-modules` names): their prompts are
    /// hashed in the adapter's tenant, as the engine's KV events name them.
    pub lora_adapters: Vec<String>,
    /// Request bodies over this many bytes get 413.
    pub max_body_bytes: u64,
    /// Prompts of more tokens get 400; `None` = only the engine's `max_model_len` (when known).
    pub max_prompt_tokens: Option<u64>,
    /// How many more rows a request that failed before its first upstream byte is tried on.
    pub retries: u32,
    /// How many times a request whose engine fails mid-answer is continued on another row
    /// (a stream from the tokens already generated, a whole answer from the start); 0: never.
    /// A request's `x-router-migration-limit` header may lower it.
    pub migration_limit: u32,
    /// Client connections open at once; more are shed at accept. `None`: derived from the
    /// process's open-files limit (`serve::accept::default_max_connections`).
    pub max_connections: Option<u64>,
    pub timeouts: ServeTimeouts,
    pub health: HealthConfig,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            listen: DEFAULT_LISTEN.parse().unwrap_or_else(|_| {
                SocketAddr::from(([127, 0, 0, 1], 8000)) // unreachable: the constant parses
            }),
            tokenizer: TokenizerConfig::Remote,
            session_headers: DEFAULT_SESSION_HEADERS
                .iter()
                .map(|s| s.to_string())
                .collect(),
            session_body_fields: DEFAULT_SESSION_BODY_FIELDS
                .iter()
                .map(|s| s.to_string())
                .collect(),
            decision_headers: true,
            models: Vec::new(),
            lora_adapters: Vec::new(),
            forward_token_ids: false,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_prompt_tokens: None,
            retries: DEFAULT_RETRIES,
            migration_limit: DEFAULT_MIGRATION_LIMIT,
            max_connections: None,
            timeouts: ServeTimeouts::default(),
            health: HealthConfig::default(),
        }
    }
}

/// `serve.tokenizer`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerConfig {
    /// `remote`: the engine's own `POST /tokenize`.
    Remote,
    /// `{path: DIR}`: `DIR/tokenizer.json` (+ `DIR/tokenizer_config.json` for the chat
    /// template), resolved against the YAML file's directory. `cache_bytes`: the segment
    /// cache's bound (`cache_mib`, 0: off; serve/segments.rs).
    Local { path: PathBuf, cache_bytes: u64 },
}

/// `serve.tokenizer.cache_mib` when absent.
pub const DEFAULT_TOKENIZER_CACHE_MIB: u64 = 64;
/// The largest `serve.tokenizer.cache_mib`.
pub const MAX_TOKENIZER_CACHE_MIB: u64 = 64 * 1024;

/// Default `serve.timeouts.header_read_ms`: hyper's own default, and longer than the idle
/// time after which common HTTP clients stop reusing a pooled connection.
pub const DEFAULT_HEADER_READ_MS: u64 = 30_000;
/// Default `serve.timeouts.body_read_ms`: the default 8 MiB body at about 1 Mbit/s.
pub const DEFAULT_BODY_READ_MS: u64 = 60_000;

/// `serve.timeouts`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeTimeouts {
    /// Connecting to an engine.
    pub connect: Duration,
    /// From sending a request upstream to the engine's response headers.
    pub response: Duration,
    /// Longest gap between two chunks of an upstream body.
    pub stream_idle: Duration,
    /// A remote `/tokenize` call.
    pub tokenize: Duration,
    /// Longest wait in an admission queue for a class without `max_queue_wait_ms`.
    pub queue: Duration,
    /// Graceful shutdown: how long in-flight requests may take to finish.
    pub shutdown: Duration,
    /// A client's request head (line and headers) must arrive within this, counted from its
    /// first byte or, on a kept-alive connection, from the end of the previous response (so it
    /// is also how long an idle client connection is kept).
    pub header_read: Duration,
    /// A client's whole request body must arrive within this, counted from its head.
    pub body_read: Duration,
}

impl Default for ServeTimeouts {
    fn default() -> Self {
        ServeTimeouts {
            connect: Duration::from_millis(2_000),
            response: Duration::from_millis(300_000),
            stream_idle: Duration::from_millis(60_000),
            tokenize: Duration::from_millis(10_000),
            queue: Duration::from_millis(30_000),
            shutdown: Duration::from_millis(30_000),
            header_read: Duration::from_millis(DEFAULT_HEADER_READ_MS),
            body_read: Duration::from_millis(DEFAULT_BODY_READ_MS),
        }
    }
}

/// `serve.health`: the probe of every engine's `GET /health`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthConfig {
    /// Time between two probes of one engine.
    pub interval: Duration,
    /// A probe not answered within this fails.
    pub timeout: Duration,
    /// Read the engines' `/metrics` on every probe and report their running + waiting requests
    /// as observed load.
    pub scrape_load: bool,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            interval: Duration::from_millis(1_000),
            timeout: Duration::from_millis(1_000),
            scrape_load: true,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a `serve` mapping")]
pub(super) struct RawServe {
    #[serde(default, deserialize_with = "de_listen")]
    listen: Option<SocketAddr>,
    #[serde(default, deserialize_with = "de_tokenizer")]
    tokenizer: Option<RawTokenizer>,
    #[serde(default, deserialize_with = "de_header_list")]
    session_headers: Option<Vec<String>>,
    #[serde(default, deserialize_with = "de_name_list")]
    session_body_fields: Option<Vec<String>>,
    #[serde(default)]
    decision_headers: Option<bool>,
    #[serde(default, deserialize_with = "de_name_list")]
    models: Option<Vec<String>>,
    #[serde(default, deserialize_with = "de_name_list")]
    lora_adapters: Option<Vec<String>>,
    #[serde(default)]
    forward_token_ids: Option<bool>,
    #[serde(default, deserialize_with = "de_body_bytes")]
    max_body_bytes: Option<u64>,
    #[serde(default, deserialize_with = "de_positive")]
    max_prompt_tokens: Option<u64>,
    #[serde(default, deserialize_with = "de_retries")]
    retries: Option<u64>,
    #[serde(default, deserialize_with = "de_migration_limit")]
    migration_limit: Option<u64>,
    #[serde(default, deserialize_with = "de_max_connections")]
    max_connections: Option<u64>,
    #[serde(default)]
    timeouts: Option<RawTimeouts>,
    #[serde(default)]
    health: Option<RawHealth>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a `serve.timeouts` mapping")]
struct RawTimeouts {
    #[serde(default, deserialize_with = "de_ms")]
    connect_ms: Option<u64>,
    #[serde(default, deserialize_with = "de_ms")]
    response_ms: Option<u64>,
    #[serde(default, deserialize_with = "de_ms")]
    stream_idle_ms: Option<u64>,
    #[serde(default, deserialize_with = "de_ms")]
    tokenize_ms: Option<u64>,
    #[serde(default, deserialize_with = "de_ms")]
    queue_ms: Option<u64>,
    #[serde(default, deserialize_with = "de_ms")]
    shutdown_ms: Option<u64>,
    #[serde(default, deserialize_with = "de_ms")]
    header_read_ms: Option<u64>,
    #[serde(default, deserialize_with = "de_ms")]
    body_read_ms: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a `serve.health` mapping")]
struct RawHealth {
    #[serde(default, deserialize_with = "de_ms")]
    interval_ms: Option<u64>,
    #[serde(default, deserialize_with = "de_ms")]
    timeout_ms: Option<u64>,
    #[serde(default)]
    scrape_load: Option<bool>,
}

/// `tokenizer:` as written.
enum RawTokenizer {
    Remote,
    Local(RawLocalTokenizer),
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a local tokenizer mapping `{path: DIR}` (optionally with `cache_mib`)"
)]
struct RawLocalTokenizer {
    #[serde(deserialize_with = "de_dir")]
    path: String,
    #[serde(default, deserialize_with = "de_cache_mib")]
    cache_mib: Option<u64>,
}

fn de_cache_mib<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 0, MAX_TOKENIZER_CACHE_MIB)
}

fn de_ms<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 1, MAX_TIMEOUT_MS)
}

fn de_positive<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 1, u64::MAX)
}

fn de_body_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 1, MAX_MAX_BODY_BYTES)
}

fn de_max_connections<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 1, MAX_MAX_CONNECTIONS)
}

fn de_retries<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 0, MAX_RETRIES)
}

fn de_migration_limit<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 0, MAX_MIGRATION_LIMIT)
}

/// A string checked by `check`; null means "absent".
struct CheckedStr {
    expecting: &'static str,
    check: fn(&str) -> Result<String, String>,
}

impl Visitor<'_> for CheckedStr {
    type Value = Option<String>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.expecting)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        (self.check)(v).map(Some).map_err(E::custom)
    }

    null_is_absent!();
}

fn check_listen(v: &str) -> Result<String, String> {
    v.parse::<SocketAddr>().map(|_| v.to_owned()).map_err(|_| {
        format!(
            "invalid listen address `{}`: expected IP:PORT, such as `127.0.0.1:8000` or \
             `[::1]:8000` (a host name is not accepted)",
            excerpt(v)
        )
    })
}

pub(super) fn de_listen<'de, D: Deserializer<'de>>(d: D) -> Result<Option<SocketAddr>, D::Error> {
    let text = d.deserialize_any(CheckedStr {
        expecting: "a listen address IP:PORT, such as `127.0.0.1:8000`",
        check: check_listen,
    })?;
    text.map(|t| t.parse::<SocketAddr>().map_err(de::Error::custom))
        .transpose()
}

fn check_dir(v: &str) -> Result<String, String> {
    if v.is_empty() {
        Err("invalid tokenizer path: the path is empty".to_owned())
    } else if v.contains('\0') {
        Err(format!(
            "invalid tokenizer path `{}`: contains a NUL character",
            excerpt(v)
        ))
    } else {
        Ok(v.to_owned())
    }
}

fn de_dir<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    const EXPECTING: &str = "a directory holding tokenizer.json (a non-empty string)";
    d.deserialize_any(CheckedStr {
        expecting: EXPECTING,
        check: check_dir,
    })?
    .ok_or_else(|| de::Error::invalid_type(de::Unexpected::Unit, &EXPECTING))
}

/// `remote`, or `{path: DIR}`; null means "absent".
struct TokenizerVisitor;

impl<'de> Visitor<'de> for TokenizerVisitor {
    type Value = Option<RawTokenizer>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("`remote` or a mapping `{path: DIR}`")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        if v == "remote" {
            Ok(Some(RawTokenizer::Remote))
        } else {
            Err(E::custom(format_args!(
                "invalid tokenizer `{}`: expected `remote` (the engine's POST /tokenize) or a \
                 mapping `{{path: DIR}}` (a local tokenizer.json)",
                excerpt(v)
            )))
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        let local = RawLocalTokenizer::deserialize(de::value::MapAccessDeserializer::new(map))?;
        Ok(Some(RawTokenizer::Local(local)))
    }

    null_is_absent!();
}

fn de_tokenizer<'de, D: Deserializer<'de>>(d: D) -> Result<Option<RawTokenizer>, D::Error> {
    d.deserialize_any(TokenizerVisitor)
}

/// A list of strings, each checked (and normalised) by `check`; null means "absent".
struct ListVisitor {
    expecting: &'static str,
    check: fn(&str) -> Result<String, String>,
}

impl<'de> Visitor<'de> for ListVisitor {
    type Value = Option<Vec<String>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.expecting)
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::new();
        while let Some(item) = seq.next_element_seed(CheckedItem(CheckedStr {
            expecting: "a string",
            check: self.check,
        }))? {
            if !out.contains(&item) {
                out.push(item);
            }
        }
        Ok(Some(out))
    }

    null_is_absent!();
}

/// One checked list item (required: null is an error).
struct CheckedItem(CheckedStr);

impl<'de> de::DeserializeSeed<'de> for CheckedItem {
    type Value = String;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<String, D::Error> {
        let expecting = self.0.expecting;
        d.deserialize_any(self.0)?
            .ok_or_else(|| de::Error::invalid_type(de::Unexpected::Unit, &expecting))
    }
}

/// An HTTP header name (RFC 9110 token characters), lowercased.
fn check_header(v: &str) -> Result<String, String> {
    let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    if v.is_empty() || v.len() > 128 || !v.bytes().all(token) {
        return Err(format!(
            "invalid header name `{}`: 1 to 128 letters, digits or `!#$%&'*+-.^_`|~`",
            excerpt(v)
        ));
    }
    Ok(v.to_ascii_lowercase())
}

fn check_non_empty(v: &str) -> Result<String, String> {
    if v.is_empty() || v.len() > 256 || v.chars().any(char::is_control) {
        Err(format!(
            "invalid entry `{}`: expected 1 to 256 bytes without control characters",
            excerpt(v)
        ))
    } else {
        Ok(v.to_owned())
    }
}

fn de_header_list<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<String>>, D::Error> {
    d.deserialize_any(ListVisitor {
        expecting: "a list of header names",
        check: check_header,
    })
}

fn de_name_list<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<String>>, D::Error> {
    d.deserialize_any(ListVisitor {
        expecting: "a list of strings",
        check: check_non_empty,
    })
}

impl Builder<'_> {
    pub(super) fn serve(&self, raw: Option<RawServe>) -> Option<ServeConfig> {
        let raw = raw?;
        let defaults = ServeConfig::default();
        let ms = |v: Option<u64>, default: Duration| v.map_or(default, Duration::from_millis);
        let timeouts = match raw.timeouts {
            None => defaults.timeouts,
            Some(t) => {
                let d = defaults.timeouts;
                ServeTimeouts {
                    connect: ms(t.connect_ms, d.connect),
                    response: ms(t.response_ms, d.response),
                    stream_idle: ms(t.stream_idle_ms, d.stream_idle),
                    tokenize: ms(t.tokenize_ms, d.tokenize),
                    queue: ms(t.queue_ms, d.queue),
                    shutdown: ms(t.shutdown_ms, d.shutdown),
                    header_read: ms(t.header_read_ms, d.header_read),
                    body_read: ms(t.body_read_ms, d.body_read),
                }
            }
        };
        let health = match raw.health {
            None => defaults.health,
            Some(h) => HealthConfig {
                interval: ms(h.interval_ms, defaults.health.interval),
                timeout: ms(h.timeout_ms, defaults.health.timeout),
                scrape_load: h.scrape_load.unwrap_or(defaults.health.scrape_load),
            },
        };
        let tokenizer = match raw.tokenizer {
            None | Some(RawTokenizer::Remote) => TokenizerConfig::Remote,
            Some(RawTokenizer::Local(local)) => {
                let dir = PathBuf::from(local.path);
                let path = if dir.is_absolute() {
                    dir
                } else {
                    let base = self
                        .source
                        .and_then(config_dir)
                        .unwrap_or(Path::new("."))
                        .to_path_buf();
                    let base = std::path::absolute(&base).unwrap_or(base);
                    base.join(dir)
                };
                TokenizerConfig::Local {
                    path,
                    cache_bytes: local.cache_mib.unwrap_or(DEFAULT_TOKENIZER_CACHE_MIB) << 20,
                }
            }
        };
        Some(ServeConfig {
            listen: raw.listen.unwrap_or(defaults.listen),
            tokenizer,
            session_headers: raw.session_headers.unwrap_or(defaults.session_headers),
            session_body_fields: raw
                .session_body_fields
                .unwrap_or(defaults.session_body_fields),
            decision_headers: raw.decision_headers.unwrap_or(defaults.decision_headers),
            models: raw.models.unwrap_or_default(),
            lora_adapters: raw.lora_adapters.unwrap_or_default(),
            forward_token_ids: raw.forward_token_ids.unwrap_or(defaults.forward_token_ids),
            max_body_bytes: raw.max_body_bytes.unwrap_or(defaults.max_body_bytes),
            max_prompt_tokens: raw.max_prompt_tokens,
            retries: raw
                .retries
                .and_then(|n| u32::try_from(n).ok())
                .unwrap_or(defaults.retries),
            migration_limit: raw
                .migration_limit
                .and_then(|n| u32::try_from(n).ok())
                .unwrap_or(defaults.migration_limit),
            max_connections: raw.max_connections,
            timeouts,
            health,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::time::Duration;

    use crate::{RouterConfig, ServeConfig, TokenizerConfig};

    fn parse(text: &str) -> RouterConfig {
        RouterConfig::from_yaml_str(text, Some(Path::new("/etc/router/r.yaml")))
            .unwrap_or_else(|e| panic!("{e}"))
    }

    fn error(text: &str) -> String {
        RouterConfig::from_yaml_str(text, Some(Path::new("r.yaml")))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn workers_and_serve_with_every_key() {
        let config = parse(
            "workers:
  - id: 2
    url: http://127.0.0.1:8102/
    dp_size: 2
    max_num_batched_tokens: 8192
    total_kv_blocks: 1000
  - {id: 1, url: 'https://engine.example:443'}
serve:
  listen: 0.0.0.0:9000
  tokenizer: {path: tok, cache_mib: 3}
  session_headers: [X-Session-Id, session-id]
  session_body_fields: [user, session_id]
  decision_headers: false
  models: [m1]
  lora_adapters: [sql-lora]
  forward_token_ids: true
  max_body_bytes: 1024
  max_prompt_tokens: 100
  retries: 0
  migration_limit: 3
  max_connections: 500
  timeouts: {connect_ms: 1, response_ms: 2, stream_idle_ms: 3, tokenize_ms: 4, queue_ms: 5, shutdown_ms: 6, header_read_ms: 9, body_read_ms: 10}
  health: {interval_ms: 7, timeout_ms: 8, scrape_load: false}
",
        );
        assert_eq!(config.workers.len(), 2);
        let w = &config.workers[0];
        assert_eq!(
            (
                w.id,
                w.url.as_str(),
                w.dp_size,
                w.max_num_batched_tokens,
                w.total_kv_blocks
            ),
            (2, "http://127.0.0.1:8102", 2, Some(8192), Some(1000))
        );
        assert_eq!(w.line, Some(2));
        assert_eq!(config.workers[1].dp_size, 1);
        let s = config.serve.unwrap();
        assert_eq!(s.listen.to_string(), "0.0.0.0:9000");
        assert_eq!(
            s.tokenizer,
            TokenizerConfig::Local {
                path: "/etc/router/tok".into(),
                cache_bytes: 3 << 20,
            }
        );
        assert_eq!(s.session_headers, ["x-session-id", "session-id"]);
        assert_eq!(s.session_body_fields, ["user", "session_id"]);
        assert!(!s.decision_headers);
        assert_eq!(s.models, ["m1"]);
        assert_eq!(s.lora_adapters, ["sql-lora"]);
        assert!(s.forward_token_ids);
        assert_eq!(
            (s.max_body_bytes, s.max_prompt_tokens, s.retries),
            (1024, Some(100), 0)
        );
        assert_eq!(s.migration_limit, 3);
        assert_eq!(s.timeouts.connect, Duration::from_millis(1));
        assert_eq!(s.timeouts.shutdown, Duration::from_millis(6));
        assert_eq!(s.timeouts.header_read, Duration::from_millis(9));
        assert_eq!(s.timeouts.body_read, Duration::from_millis(10));
        assert_eq!(s.max_connections, Some(500));
        assert_eq!(s.health.timeout, Duration::from_millis(8));
        assert!(!s.health.scrape_load);
    }

    #[test]
    fn defaults_and_absence() {
        let config = parse("block_size: 16\n");
        assert!(config.workers.is_empty());
        assert!(config.serve.is_none());
        let s = parse("serve:\n  tokenizer: remote\n").serve.unwrap();
        assert_eq!(s, ServeConfig::default());
        assert_eq!(s.listen.to_string(), "127.0.0.1:8000");
        assert_eq!(s.session_headers, ["x-session-id", "x-dynamo-session-id"]);
        assert_eq!(s.retries, 1);
        assert_eq!(s.migration_limit, 1);
        assert!(parse("serve:\nworkers:\n").serve.is_none());
    }

    #[test]
    fn errors_name_the_line_and_key() {
        for (text, wanted) in [
            (
                "workers:\n  - id: 1\n    url: ftp://x\n",
                "line 3 column 10: workers[0].url: invalid engine url `ftp://x`: it must start with `http://` or `https://`",
            ),
            (
                "workers:\n  - id: 1\n    url: http://x:99999\n",
                "line 3 column 10: workers[0].url: invalid engine url `http://x:99999`: the port must be a number from 0 to 65535",
            ),
            (
                "workers:\n  - id: 1\n    url: http://a\n  - id: 1\n    url: http://b\n",
                "line 4 column 9: workers[1].id: duplicate worker id 1 (first defined at line 2)",
            ),
            (
                "workers:\n  - id: 1\n    url: http://a\n    dp_size: 0\n",
                "line 4 column 14: workers[0].dp_size: invalid value: integer `0` is out of range, expected an integer from 1 to 65536",
            ),
            (
                "workers:\n  - url: http://a\n",
                "workers[0]: missing field `id`",
            ),
            (
                "workers:\n  - id: 1\n    url: http://a\n    port: 3\n",
                "unknown field `port`, expected one of `id`, `url`, `dp_size`, `max_num_batched_tokens`, `total_kv_blocks`",
            ),
            (
                "serve:\n  listen: localhost:8000\n",
                "line 2 column 11: serve.listen: invalid listen address `localhost:8000`: expected IP:PORT",
            ),
            (
                "serve:\n  tokenizer: local\n",
                "line 2 column 14: serve.tokenizer: invalid tokenizer `local`: expected `remote`",
            ),
            (
                "serve:\n  tokenizer: {dir: x}\n",
                "serve.tokenizer: unknown field `dir`, expected `path`",
            ),
            (
                "serve:\n  tokenizer: {path: x, cache_mib: 65537}\n",
                "serve.tokenizer.cache_mib: invalid value: integer `65537` is out of range, expected an integer from 0 to 65536",
            ),
            (
                "serve:\n  session_headers: [ok, 'bad header']\n",
                "serve.session_headers[1]: invalid header name `bad header`",
            ),
            (
                "serve:\n  retries: 17\n",
                "line 2 column 12: serve.retries: invalid value: integer `17` is out of range, expected an integer from 0 to 16",
            ),
            (
                "serve:\n  migration_limit: 17\n",
                "line 2 column 20: serve.migration_limit: invalid value: integer `17` is out of range, expected an integer from 0 to 16",
            ),
            (
                "serve:\n  timeouts:\n    connect_ms: 0\n",
                "line 3 column 17: serve.timeouts.connect_ms: invalid value: integer `0` is out of range",
            ),
            (
                "serve:\n  health: {interval: 5}\n",
                "serve.health: unknown field `interval`, expected one of `interval_ms`, `timeout_ms`, `scrape_load`",
            ),
            (
                "serve:\n  max_connections: 0\n",
                "serve.max_connections: invalid value: integer `0` is out of range",
            ),
            ("serve:\n  bogus: 1\n", "serve: unknown field `bogus`"),
        ] {
            let err = error(text);
            assert!(err.starts_with("config r.yaml: "), "{err}");
            assert!(err.contains(wanted), "{text}\n got: {err}\nwant: {wanted}");
        }
    }
}
