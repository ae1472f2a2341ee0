//! `session_affinity:`: whether requests of a session stick to a worker, for how long, and where
//! the bindings live (`store:`, this process or a Redis/Valkey shared by several replicas).

use std::fmt;
use std::time::Duration;

use serde::de;
use serde::{Deserialize, Deserializer};

use super::error::excerpt;
use super::numbers::{de_max_bindings, de_ttl_secs, de_uint, narrow_or};
use super::strings::de_affinity_mode;
use super::{AffinityMode, DEFAULT_MAX_BINDINGS, DEFAULT_SESSION_TTL};

/// Default `session_affinity.store.key_prefix`.
pub const DEFAULT_STORE_KEY_PREFIX: &str = "router:";
/// Default `session_affinity.store.timeout_ms`: the longest one store call may delay a request.
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_millis(50);
/// Largest accepted `session_affinity.store.timeout_ms`.
pub const MAX_STORE_TIMEOUT_MS: u64 = 10_000;
/// Default `session_affinity.store.lease_secs`: how long a dead replica's in-flight counts live.
pub const DEFAULT_STORE_LEASE: Duration = Duration::from_secs(30);
/// Largest accepted `session_affinity.store.lease_secs`.
pub const MAX_STORE_LEASE_SECS: u64 = 86_400;
/// Default `session_affinity.store.load_publish_ms`: how often a replica publishes the load it
/// booked and reads the others' (docs/replicas.md, "Shared load"). A replica decides on the view
/// its last round read, so this bounds how old that view is while the replica sees no bookings
/// of its own. On the replicas bench, 4 replicas spread the active load as one does at 20 ms and
/// not at 50 or 200 (views up to 140 ms old there); a round of a few rows is one small round
/// trip, and a slow round spaces the next ones out itself (the serve loop waits at least four
/// times as long as a round took).
pub const DEFAULT_LOAD_PUBLISH: Duration = Duration::from_millis(20);
/// Shortest accepted `session_affinity.store.load_publish_ms`.
pub const MIN_LOAD_PUBLISH_MS: u64 = 20;
/// Longest accepted `session_affinity.store.load_publish_ms`.
pub const MAX_LOAD_PUBLISH_MS: u64 = 10_000;
/// Longest accepted `session_affinity.store.key_prefix`, in bytes.
pub const MAX_KEY_PREFIX_BYTES: usize = 64;

/// `session_affinity:` settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionAffinityConfig {
    /// Soft (advisory target, binding follows the dispatch) or hard (binding is a pin).
    pub mode: AffinityMode,
    /// Idle timeout of a binding.
    pub ttl: Duration,
    /// Maximum number of bindings held at once.
    pub max_bindings: usize,
}

/// `session_affinity.store`: where the bindings live (`RouterConfig::session_store`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum SessionStoreConfig {
    /// `kind: memory` (the default): this process's own table.
    #[default]
    Memory,
    /// `kind: redis`: one Redis/Valkey shared by every replica (docs/replicas.md).
    Redis(RedisStoreConfig),
}

/// `session_affinity.store` with `kind: redis`.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisStoreConfig {
    /// `redis://[user:password@]host:port/db` (or `redis+unix:///path`); it parses.
    pub url: String,
    /// Prefix of every key the router writes (no whitespace or control characters).
    pub key_prefix: String,
    /// Longest one store call may take before the request goes on without it.
    pub timeout: Duration,
    /// What requests carrying a session get while the store is unreachable.
    pub on_unavailable: OnStoreUnavailable,
    /// How long an in-flight count of a replica that stopped renewing it survives.
    pub lease: Duration,
    /// The tag in this replica's request ids; `None` = allocated from the store at start.
    pub replica_id: Option<u16>,
    /// Whether replicas share the load they booked per row through the store (`share_load`).
    pub share_load: bool,
    /// How often the booked load is published and the others' read (`load_publish_ms`).
    pub load_publish: Duration,
}

impl fmt::Debug for RedisStoreConfig {
    // The URL may carry a password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStoreConfig")
            .field("url", &redact_url(&self.url))
            .field("key_prefix", &self.key_prefix)
            .field("timeout", &self.timeout)
            .field("on_unavailable", &self.on_unavailable)
            .field("lease", &self.lease)
            .field("replica_id", &self.replica_id)
            .field("share_load", &self.share_load)
            .field("load_publish", &self.load_publish)
            .finish()
    }
}

/// `session_affinity.store.on_unavailable`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnStoreUnavailable {
    /// Route the request as if the session had no binding (counted, logged once per outage).
    #[default]
    Route,
    /// Refuse requests that carry a session with 503 `session_store_unavailable`.
    Refuse,
}

spelled!(OnStoreUnavailable { Route => "route", Refuse => "refuse" });

/// `url` with any password replaced by `***`, for messages and logs.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or("", |(user, _)| user);
            if userinfo.contains(':') {
                format!("{scheme}://{user}:***@{host}{path}")
            } else {
                // `redis://password@host` is not a form the client reads a password from, but
                // hide it all the same.
                format!("{scheme}://***@{host}{path}")
            }
        }
        None => url.to_owned(),
    }
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a `session_affinity` mapping with `mode`"
)]
pub(super) struct RawSessionAffinity {
    #[serde(deserialize_with = "de_affinity_mode")]
    mode: AffinityMode,
    #[serde(default, deserialize_with = "de_ttl_secs")]
    ttl_secs: Option<u64>,
    #[serde(default, deserialize_with = "de_max_bindings")]
    max_bindings: Option<u64>,
    #[serde(default)]
    store: Option<RawStore>,
}

/// `store:` as written; the cross-field rules run in `TryFrom`, so their errors carry the
/// place of the `store` mapping.
#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a `store` mapping with `kind` (`memory` or `redis`)"
)]
struct RawStoreFields {
    kind: StoreKind,
    #[serde(default, deserialize_with = "de_redis_url")]
    url: Option<String>,
    #[serde(default, deserialize_with = "de_key_prefix")]
    key_prefix: Option<String>,
    #[serde(default, deserialize_with = "de_timeout_ms")]
    timeout_ms: Option<u64>,
    #[serde(default)]
    on_unavailable: Option<OnUnavailableName>,
    #[serde(default, deserialize_with = "de_lease_secs")]
    lease_secs: Option<u64>,
    #[serde(default, deserialize_with = "de_replica_id")]
    replica_id: Option<u64>,
    #[serde(default)]
    share_load: Option<bool>,
    #[serde(default, deserialize_with = "de_load_publish_ms")]
    load_publish_ms: Option<u64>,
}

#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum StoreKind {
    Memory,
    Redis,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "lowercase")]
enum OnUnavailableName {
    Route,
    Refuse,
}

#[derive(Deserialize)]
#[serde(try_from = "RawStoreFields")]
pub(super) struct RawStore(SessionStoreConfig);

impl TryFrom<RawStoreFields> for RawStore {
    type Error = String;

    fn try_from(raw: RawStoreFields) -> Result<Self, String> {
        if raw.kind == StoreKind::Memory {
            let redis_only = [
                ("url", raw.url.is_some()),
                ("key_prefix", raw.key_prefix.is_some()),
                ("timeout_ms", raw.timeout_ms.is_some()),
                ("on_unavailable", raw.on_unavailable.is_some()),
                ("lease_secs", raw.lease_secs.is_some()),
                ("replica_id", raw.replica_id.is_some()),
                ("share_load", raw.share_load.is_some()),
                ("load_publish_ms", raw.load_publish_ms.is_some()),
            ];
            if let Some((key, _)) = redis_only.iter().find(|(_, set)| *set) {
                return Err(format!(
                    "`{key}` only applies to `kind: redis`; the memory store keeps bindings in \
                     this process (remove `{key}`, or set `kind: redis`)"
                ));
            }
            return Ok(RawStore(SessionStoreConfig::Memory));
        }
        let url = raw.url.ok_or_else(|| {
            "`kind: redis` needs `url`, e.g. `url: redis://127.0.0.1:6379/0`".to_owned()
        })?;
        Ok(RawStore(SessionStoreConfig::Redis(RedisStoreConfig {
            url,
            key_prefix: raw
                .key_prefix
                .unwrap_or_else(|| DEFAULT_STORE_KEY_PREFIX.to_owned()),
            timeout: raw
                .timeout_ms
                .map_or(DEFAULT_STORE_TIMEOUT, Duration::from_millis),
            on_unavailable: match raw.on_unavailable {
                Some(OnUnavailableName::Refuse) => OnStoreUnavailable::Refuse,
                Some(OnUnavailableName::Route) | None => OnStoreUnavailable::Route,
            },
            lease: raw
                .lease_secs
                .map_or(DEFAULT_STORE_LEASE, Duration::from_secs),
            replica_id: raw.replica_id.and_then(|id| u16::try_from(id).ok()),
            share_load: raw.share_load.unwrap_or(true),
            load_publish: raw
                .load_publish_ms
                .map_or(DEFAULT_LOAD_PUBLISH, Duration::from_millis),
        })))
    }
}

/// Accepts a string that passes `rule`, checked inside the visitor so that the error carries
/// the value's own line; null means "absent".
struct CheckedStr {
    expecting: &'static str,
    rule: fn(&str) -> Result<(), String>,
}

impl<'de> de::Visitor<'de> for CheckedStr {
    type Value = Option<String>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.expecting)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        (self.rule)(v).map_err(E::custom)?;
        Ok(Some(v.to_owned()))
    }

    null_is_absent!();
}

fn de_redis_url<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    d.deserialize_any(CheckedStr {
        expecting: "a Redis URL such as `redis://127.0.0.1:6379/0`",
        rule: check_redis_url,
    })
}

/// The URL rule: what the Redis client accepts, checked here so that `check` reports it with
/// its line. The message never repeats a password.
pub fn check_redis_url(url: &str) -> Result<(), String> {
    use redis::IntoConnectionInfo;
    match url.into_connection_info() {
        Ok(_) => Ok(()),
        Err(err) => Err(format!(
            "`{}` is not a usable Redis URL ({}); expected \
             redis://[user:password@]host:port/db or redis+unix:///path/to/socket",
            excerpt(&redact_url(url)),
            // The client's message can quote the URL; keep only its first clause.
            err.to_string().split(" - ").next().unwrap_or("invalid URL"),
        )),
    }
}

fn de_key_prefix<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    d.deserialize_any(CheckedStr {
        expecting: "a key prefix such as `router:`",
        rule: check_key_prefix,
    })
}

/// The key-prefix rule: at most 64 bytes, no whitespace or control characters (a prefix is
/// typed into `redis-cli` and shell scripts; a space there splits it).
fn check_key_prefix(prefix: &str) -> Result<(), String> {
    if prefix.len() > MAX_KEY_PREFIX_BYTES {
        return Err(format!(
            "key prefix `{}` is {} bytes, over the {MAX_KEY_PREFIX_BYTES}-byte limit",
            excerpt(prefix),
            prefix.len()
        ));
    }
    if let Some(bad) = prefix.chars().find(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!(
            "key prefix {:?} contains {}; use letters, digits and punctuation such as `router:`",
            excerpt(prefix),
            if bad.is_whitespace() {
                "whitespace"
            } else {
                "a control character"
            }
        ));
    }
    Ok(())
}

fn de_timeout_ms<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 1, MAX_STORE_TIMEOUT_MS)
}

fn de_lease_secs<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 1, MAX_STORE_LEASE_SECS)
}

fn de_load_publish_ms<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, MIN_LOAD_PUBLISH_MS, MAX_LOAD_PUBLISH_MS)
}

fn de_replica_id<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 0, u64::from(u16::MAX))
}

impl RawSessionAffinity {
    /// The settings and the store, with the defaults for what is left out.
    pub(super) fn into_config(self) -> Result<(SessionAffinityConfig, SessionStoreConfig), String> {
        let store = self.store.map(|s| s.0).unwrap_or_default();
        if matches!(store, SessionStoreConfig::Redis(_)) && self.max_bindings.is_some() {
            // Not silently ignored: the operator bounds a shared store in Redis itself.
            return Err(
                "`max_bindings` bounds the in-memory table; with `store.kind: redis` the bound is \
                 Redis's own (`maxmemory`, docs/replicas.md): remove `max_bindings`"
                    .to_owned(),
            );
        }
        Ok((
            SessionAffinityConfig {
                mode: self.mode,
                ttl: self
                    .ttl_secs
                    .map_or(DEFAULT_SESSION_TTL, Duration::from_secs),
                max_bindings: narrow_or(self.max_bindings, DEFAULT_MAX_BINDINGS),
            },
            store,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::{check_key_prefix, redact_url};

    #[test]
    fn passwords_never_reach_a_message() {
        assert_eq!(
            redact_url("redis://user:pw@host:6379/0"),
            "redis://user:***@host:6379/0"
        );
        assert_eq!(redact_url("redis://:pw@host/0"), "redis://:***@host/0");
        assert_eq!(redact_url("redis://pw@host/0"), "redis://***@host/0");
        assert_eq!(redact_url("redis://host:6379/0"), "redis://host:6379/0");
        assert_eq!(redact_url("not a url"), "not a url");
        assert_eq!(
            redact_url("redis://u:p@ss@host/0"),
            "redis://u:***@host/0",
            "an `@` inside the password"
        );
    }

    #[test]
    fn key_prefix_rule() {
        assert!(check_key_prefix("router:").is_ok());
        assert!(check_key_prefix("").is_ok());
        assert!(check_key_prefix("a b").unwrap_err().contains("whitespace"));
        assert!(check_key_prefix("a\u{1}").unwrap_err().contains("control"));
        assert!(check_key_prefix(&"x".repeat(65))
            .unwrap_err()
            .contains("64-byte"));
    }
}
