//! Where session bindings live when several `serve` replicas share them: [`RedisStore`], the
//! core's [`router_core::sessions::SessionStore`] on Redis/Valkey (docs/replicas.md). The core
//! has no I/O, so the store lives here; the in-memory table stays the core's `SessionTable`.
//!
//! Layout: `redis_store.rs` (the trait implementation and its hot path), `scripts.rs` (the Lua
//! that applies the binding rules atomically in Redis, and the key layout), `connection.rs`
//! (the pool, the timeout, up/down), `background.rs` (lease releases, heartbeat, reconnection),
//! `shared_load.rs` (the load each replica booked per row, published and read every
//! `load_publish_ms`; docs/replicas.md, "Shared load").

mod background;
mod connection;
mod redis_store;
mod scripts;
pub mod shared_load;
pub mod sketch;

use std::sync::Arc;
use std::time::{Duration, Instant};

pub use redis_store::RedisStore;
pub use shared_load::{Booked, SharedLoad, SharedLoadStats};
pub use sketch::Sketch;

use router_config::{redact_url, RedisStoreConfig, RouterConfig, SessionStoreConfig};
use router_core::model::Cluster;
use router_core::sessions::SessionStore;
use router_policies::host::{granularity, Host};
use router_policies::policy_set::PolicySet;

/// The host a live router runs, its session bindings where `session_affinity.store` says: this
/// process's table, or a Redis/Valkey shared with other replicas (connected here, bounded by the
/// store timeout; an unreachable store starts in an outage and reconnects by itself), returned
/// beside the host for its metrics. On a reload, `previous` is the running host: its in-process
/// table is kept when the settings allow ([`Host::reusable_table`]).
///
/// # Errors
/// [`StoreError`] when the store's URL cannot be used or its thread cannot start.
pub fn live_host(
    router: PolicySet,
    cluster: Cluster,
    config: &RouterConfig,
    previous: Option<&Host>,
) -> Result<(Host, Option<Arc<RedisStore>>), StoreError> {
    if let Some(table) = previous.and_then(|previous| Host::reusable_table(config, previous)) {
        return Ok((Host::with_table(router, cluster, config, table), None));
    }
    match (&config.session_affinity, &config.session_store) {
        (Some(a), SessionStoreConfig::Redis(redis)) => {
            let store = Arc::new(RedisStore::start(
                redis,
                a.mode,
                granularity(a.mode),
                a.ttl,
            )?);
            let shared = store.clone() as Arc<dyn SessionStore>;
            let host = Host::with_shared_store(router, cluster, config, shared, store.id_tag());
            Ok((host, Some(store)))
        }
        _ => Ok((Host::new(router, cluster, config), None)),
    }
}

/// Why a store could not be set up or reached.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("session_affinity.store.url: `{url}` is not usable: {reason}")]
    Url { url: String, reason: String },
    #[error("cannot start the session store's background thread: {0}")]
    Thread(std::io::Error),
    #[error("session store {url}: {reason}")]
    Unreachable { url: String, reason: String },
}

/// The store's own counters, for metrics (the binding outcomes are in `SessionStats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// The last call or probe reached the store.
    pub up: bool,
    /// Outages begun since start.
    pub outages: u64,
    /// Requests with a session served without the store (routed without binding, or refused).
    pub degraded: u64,
    /// Keys found holding something else than a binding (skipped, never written).
    pub foreign: u64,
    /// Store calls that failed or timed out.
    pub errors: u64,
}

/// What `router-host check --connect-store` reports of a reachable store.
#[derive(Debug, Clone)]
pub struct StoreCheck {
    /// The URL, password hidden.
    pub url: String,
    /// `redis_version` (or `valkey_version`) from `INFO server`.
    pub version: String,
    /// One round trip (`PING`).
    pub round_trip: Duration,
}

/// Connect to the store of `config` once (bounded by its timeout, at least one second), check
/// that it answers and that its scripting works, and report what it is.
///
/// # Errors
/// [`StoreError::Unreachable`] naming the URL (password hidden) and the cause: refused,
/// timed out, wrong password, no scripting.
pub fn connect_check(config: &RedisStoreConfig) -> Result<StoreCheck, StoreError> {
    let url = redact_url(&config.url);
    let unreachable = |reason: String| StoreError::Unreachable {
        url: url.clone(),
        reason,
    };
    let client = redis::Client::open(config.url.as_str()).map_err(|err| StoreError::Url {
        url: url.clone(),
        reason: err.to_string(),
    })?;
    let timeout = config.timeout.max(Duration::from_secs(1));
    let mut con = client
        .get_connection_with_timeout(timeout)
        .map_err(|err| unreachable(redis_store::describe(&err)))?;
    con.set_read_timeout(Some(timeout))
        .and_then(|()| con.set_write_timeout(Some(timeout)))
        .map_err(|err| unreachable(redis_store::describe(&err)))?;
    let started = Instant::now();
    let _: String = redis::cmd("PING")
        .query(&mut con)
        .map_err(|err| unreachable(redis_store::describe(&err)))?;
    let round_trip = started.elapsed();
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query(&mut con)
        .map_err(|err| unreachable(redis_store::describe(&err)))?;
    let version = info
        .lines()
        .find_map(|line| {
            line.strip_prefix("valkey_version:")
                .map(|v| format!("valkey {v}"))
                .or_else(|| {
                    line.strip_prefix("redis_version:")
                        .map(|v| format!("redis {v}"))
                })
        })
        .unwrap_or_else(|| "unknown version".to_owned())
        .trim()
        .to_owned();
    scripts::Scripts::new()
        .lookup
        .load(&mut con)
        .map_err(|err| unreachable(format!("cannot load the binding scripts: {err}")))?;
    Ok(StoreCheck {
        url,
        version,
        round_trip,
    })
}

/// Run `f`, which may wait on the session store (at most its timeout) or compute for long (a
/// large prompt's tokenizing), from async code: on tokio's multi-thread runtime through
/// `block_in_place` (the worker hands its other tasks to another thread meanwhile); elsewhere
/// (a current-thread runtime, plain threads) directly.
pub fn blocking<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}
