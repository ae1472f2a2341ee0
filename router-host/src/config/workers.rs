//! `workers:`: the engines `router-host serve` routes to (ignored by `select` and `replay`, which
//! take their workers from the scenario or the simulator).

use std::fmt;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer};

use super::error::{excerpt, ConfigError, ConfigErrorKind};
use super::locate::{key, Seg};
use super::numbers::de_uint;
use super::Builder;

/// Most data-parallel ranks one worker may declare.
pub const MAX_DP_SIZE: u64 = 65_536;

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
    /// 1-based line of the entry in the file (best effort).
    pub line: Option<usize>,
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
    #[serde(default, deserialize_with = "de_dp_size")]
    dp_size: Option<u64>,
    #[serde(default, deserialize_with = "de_positive")]
    max_num_batched_tokens: Option<u64>,
    #[serde(default, deserialize_with = "de_positive")]
    total_kv_blocks: Option<u64>,
}

fn de_worker_id<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    de_uint(d, 0, u64::MAX)?.ok_or_else(|| {
        de::Error::invalid_type(de::Unexpected::Unit, &"a worker id (an integer >= 0)")
    })
}

fn de_dp_size<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 1, MAX_DP_SIZE)
}

fn de_positive<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 1, u64::MAX)
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
    ) -> Result<Vec<WorkerConfig>, ConfigError> {
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
            workers.push(WorkerConfig {
                line: self.entry_line(&path),
                id: worker.id,
                url: worker.url,
                dp_size: worker
                    .dp_size
                    .and_then(|n| u32::try_from(n).ok())
                    .unwrap_or(1),
                max_num_batched_tokens: worker.max_num_batched_tokens,
                total_kv_blocks: worker.total_kv_blocks,
            });
        }
        Ok(workers)
    }
}
