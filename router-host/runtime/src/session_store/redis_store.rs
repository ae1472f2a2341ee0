//! [`RedisStore`]: the core's [`SessionStore`] on a Redis/Valkey shared by several replicas.
//!
//! The rules are the in-memory table's (`router_core::sessions::SessionTable`); the scripts in
//! `scripts.rs` apply them atomically inside Redis. Per request on the hot path: one round trip
//! at `lookup`, one at `dispatched`; `completed` only updates this replica's count and, when the
//! session's last local request ended, queues the lease release for the background thread
//! (`background.rs`), so a finishing request never waits for the store.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use plugin_api::{AffinityTarget, RowId};
use redis::{Connection, RedisError};
use router_core::sessions::{
    check_session_id, Binding, BindingGranularity, BindingMode, DispatchOutcome, Lease,
    SessionError, SessionStats, SessionStore,
};

use super::background;
use super::connection::{is_outage, Health, Pool};
use super::scripts::Scripts;
use super::shared_load::SharedLoad;
use super::{StoreError, StoreStats};
use router_config::{redact_url, OnStoreUnavailable, RedisStoreConfig};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What the binding rules need besides the connection.
#[derive(Debug, Clone)]
pub(super) struct Rules {
    pub mode: BindingMode,
    pub granularity: BindingGranularity,
    pub ttl: Duration,
    pub lease: Duration,
    pub on_unavailable: OnStoreUnavailable,
    pub prefix: String,
}

impl Rules {
    pub fn session_key(&self, session_id: &str) -> String {
        format!("{}s:{session_id}", self.prefix)
    }

    pub fn version_key(&self) -> String {
        format!("{}version", self.prefix)
    }

    pub fn ttl_ms(&self) -> u64 {
        u64::try_from(self.ttl.as_millis()).unwrap_or(u64::MAX)
    }

    pub fn lease_ms(&self) -> u64 {
        u64::try_from(self.lease.as_millis()).unwrap_or(u64::MAX)
    }
}

#[derive(Debug, Default)]
pub(super) struct Counters {
    pub created: AtomicU64,
    pub kept: AtomicU64,
    pub moved: AtomicU64,
    pub stale: AtomicU64,
    pub hard_violations: AtomicU64,
    pub rejected_ids: AtomicU64,
    pub invalidated: AtomicU64,
    /// Keys that held something else than a binding (skipped, never written).
    pub foreign: AtomicU64,
    /// Store calls that failed or timed out.
    pub errors: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// State shared by the request threads and the background thread.
pub(super) struct Shared {
    pub rules: Rules,
    pub pool: Pool,
    pub health: Health,
    pub scripts: Scripts,
    pub counters: Counters,
    /// This replica's number (`PREFIX replicas` counter, or the configured id); names its
    /// lease fields `l:N`.
    pub replica: u64,
    /// `l:N`.
    pub lease_field: String,
    /// Requests of each session in flight on this replica (the lease is held while > 0).
    pub local: Mutex<HashMap<Arc<str>, u64>>,
    /// Sessions whose last local request ended: their lease is released by the background.
    pub released: Mutex<Vec<Arc<str>>>,
    pub wake: Condvar,
    pub stop: std::sync::atomic::AtomicBool,
    pub url: String,
    /// When a foreign key was last logged (milliseconds since start), to log at most once a
    /// second.
    foreign_logged: AtomicU64,
    started: Instant,
}

/// See the module docs.
pub struct RedisStore {
    shared: Arc<Shared>,
    id_tag: u16,
    background: Option<JoinHandle<()>>,
    /// This replica's side of the shared load (`share_load`), published under its number.
    shared_load: Option<Arc<SharedLoad>>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("url", &self.shared.url)
            .field("prefix", &self.shared.rules.prefix)
            .field("replica", &self.shared.replica)
            .field("up", &self.shared.health.is_up())
            .finish_non_exhaustive()
    }
}

/// One script answer: a list of strings.
type Answer = Vec<String>;

impl RedisStore {
    /// Connect to the store of `config` (bounded by its timeout) and start the background
    /// thread. An unreachable store is not an error: the replica starts in an outage (logged)
    /// and reconnects by itself; only a URL the client cannot use is.
    pub fn start(
        config: &RedisStoreConfig,
        mode: BindingMode,
        granularity: BindingGranularity,
        ttl: Duration,
    ) -> Result<RedisStore, StoreError> {
        let url = redact_url(&config.url);
        let client = redis::Client::open(config.url.as_str()).map_err(|err| StoreError::Url {
            url: url.clone(),
            reason: err.to_string(),
        })?;
        let rules = Rules {
            mode,
            granularity,
            ttl,
            lease: config.lease,
            on_unavailable: config.on_unavailable,
            prefix: config.key_prefix.clone(),
        };
        let load_client = client.clone();
        let pool = Pool::new(client, config.timeout);
        let health = Health::new(url.clone(), config.on_unavailable);
        // The replica number names the lease fields: from the store when it answers (a new one
        // per start and per reload, so an old configuration still draining never releases the
        // new one's leases), else from the process id and the clock. The id tag is the
        // configured `replica_id`, else derived from that number.
        let allocated = allocate_replica(&pool, &rules);
        let replica = match &allocated {
            Ok(n) => *n,
            Err(_) => fallback_replica(),
        };
        if let Err(err) = &allocated {
            health.fail(&format!("at start: {}", describe(err)));
        }
        let id_tag = config
            .replica_id
            .unwrap_or_else(|| u16::try_from(replica % u64::from(u16::MAX)).unwrap_or(0) + 1);
        let shared_load = config
            .share_load
            .then(|| Arc::new(SharedLoad::new(config, load_client, url.clone(), replica)));
        let shared = Arc::new(Shared {
            lease_field: format!("l:{replica}"),
            rules,
            pool,
            health,
            scripts: Scripts::new(),
            counters: Counters::default(),
            replica,
            local: Mutex::new(HashMap::new()),
            released: Mutex::new(Vec::new()),
            wake: Condvar::new(),
            stop: std::sync::atomic::AtomicBool::new(false),
            url,
            foreign_logged: AtomicU64::new(0),
            started: Instant::now(),
        });
        let background = background::spawn(shared.clone()).map_err(StoreError::Thread)?;
        tracing::info!(
            store = %shared.url,
            replica,
            id_tag,
            "session bindings shared through Redis"
        );
        Ok(RedisStore {
            shared,
            id_tag,
            background: Some(background),
            shared_load,
        })
    }

    /// The tag this replica puts into the request ids it draws (`CoreSettings::id_tag`).
    pub fn id_tag(&self) -> u16 {
        self.id_tag
    }

    /// This replica's side of the shared load, when `share_load` is on.
    pub fn shared_load(&self) -> Option<&Arc<SharedLoad>> {
        self.shared_load.as_ref()
    }

    /// This replica's number in the store (its lease fields are `l:N`).
    pub fn replica(&self) -> u64 {
        self.shared.replica
    }

    /// Whether the last call (or probe) reached the store.
    pub fn is_up(&self) -> bool {
        self.shared.health.is_up()
    }

    /// The store's own counters.
    pub fn store_stats(&self) -> StoreStats {
        let c = &self.shared.counters;
        let h = &self.shared.health;
        StoreStats {
            up: h.is_up(),
            outages: h.outages.load(Ordering::Relaxed),
            degraded: h.degraded.load(Ordering::Relaxed),
            foreign: c.foreign.load(Ordering::Relaxed),
            errors: c.errors.load(Ordering::Relaxed),
        }
    }

    /// Sessions with requests in flight on this replica.
    pub fn local_sessions(&self) -> usize {
        lock(&self.shared.local).len()
    }

    /// Run one script under the timeout. A stale pooled connection (the store restarted) is
    /// retried once on a fresh one while time remains; a failure of the connection begins an
    /// outage.
    fn call(
        &self,
        what: &str,
        run: impl Fn(&Scripts, &mut Connection) -> Result<Answer, RedisError>,
    ) -> Result<Answer, SessionError> {
        let shared = &self.shared;
        let deadline = Instant::now() + shared.pool.timeout();
        let mut retried = false;
        loop {
            let (err, reused) = match shared.pool.take(deadline) {
                Ok((mut con, reused)) => match run(&shared.scripts, &mut con) {
                    Ok(answer) => {
                        shared.pool.give_back(con);
                        return Ok(answer);
                    }
                    // Not given back: a connection that failed is not trusted again.
                    Err(err) => (err, reused),
                },
                Err(err) => (err, false),
            };
            bump(&shared.counters.errors);
            if reused && !retried && !err.is_timeout() && is_outage(&err) {
                // Maybe only this connection was stale (the store restarted): all idle ones are
                // suspect; one more try on a fresh one, within the same deadline.
                shared.pool.clear();
                retried = true;
                continue;
            }
            let reason = format!("{what}: {}", describe(&err));
            if is_outage(&err) {
                shared.pool.clear();
                shared.health.fail(&reason);
                // The background may be asleep until its next heartbeat: start probing now.
                shared.wake.notify_all();
            } else {
                tracing::warn!(store = %shared.url, "session store call failed: {reason}");
            }
            return Err(SessionError::StoreUnavailable { reason });
        }
    }

    /// The outage answer of `lookup`: a lease without binding, or the refusal.
    fn degraded_lease(&self, session_id: &str, reason: String) -> Result<Lease, SessionError> {
        self.shared.health.degraded.fetch_add(1, Ordering::Relaxed);
        match self.shared.rules.on_unavailable {
            OnStoreUnavailable::Route => Ok(Lease::from_store(Arc::from(session_id), None, 0)),
            OnStoreUnavailable::Refuse => Err(SessionError::StoreUnavailable { reason }),
        }
    }

    /// A key that is not a binding: counted, logged at most once a second, never written.
    fn foreign(&self, key: String, reason: String) -> SessionError {
        bump(&self.shared.counters.foreign);
        let now = u64::try_from(self.shared.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        let last = self.shared.foreign_logged.load(Ordering::Relaxed);
        if (last == 0 || now.saturating_sub(last) >= 1000)
            && self
                .shared
                .foreign_logged
                .compare_exchange(last, now.max(1), Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(
                store = %self.shared.url,
                key = %key,
                "session store key does not hold a session binding ({reason}); left untouched, \
                 the request is routed without it (counted in \
                 router_session_store_foreign_keys_total)"
            );
        }
        SessionError::StoreValue { key, reason }
    }

    fn unavailable_reason(&self) -> String {
        format!("{} is unreachable (reconnecting)", self.shared.url)
    }

    /// This replica counts one more request of the session in flight.
    fn count_in(&self, lease: &Lease) {
        let mut local = lock(&self.shared.local);
        *local.entry(lease.shared_session_id()).or_insert(0) += 1;
    }
}

/// Allocate this replica's number: `INCR PREFIX replicas`.
fn allocate_replica(pool: &Pool, rules: &Rules) -> Result<u64, RedisError> {
    let deadline = Instant::now() + pool.timeout();
    let (mut con, _) = pool.take(deadline)?;
    let n: u64 = redis::cmd("INCR")
        .arg(format!("{}replicas", rules.prefix))
        .query(&mut con)?;
    pool.give_back(con);
    Ok(n)
}

/// A replica number when the store cannot hand one out at start: the clock's nanoseconds with
/// the process id, so two replicas starting together during an outage still differ.
fn fallback_replica() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    (u64::from(std::process::id()) << 32) | u64::from(nanos)
}

/// A store error as an operator reads it (never the URL's password: the client does not
/// quote it).
pub(super) fn describe(err: &RedisError) -> String {
    if err.kind() == redis::ErrorKind::AuthenticationFailed
        || err.code() == Some("WRONGPASS")
        || err.code() == Some("NOAUTH")
    {
        return format!("authentication failed ({err}); check the user and password in the URL");
    }
    if err.is_timeout() {
        return format!("no answer within session_affinity.store.timeout_ms ({err})");
    }
    err.to_string()
}

fn parse_u64(s: &str) -> Option<u64> {
    s.parse().ok()
}

fn parse_rank(s: &str) -> Option<Option<u32>> {
    if s.is_empty() {
        Some(None)
    } else {
        s.parse().ok().map(Some)
    }
}

impl SessionStore for RedisStore {
    fn lookup(&self, session_id: &str) -> Result<Lease, SessionError> {
        if let Err(err) = check_session_id(session_id) {
            bump(&self.shared.counters.rejected_ids);
            return Err(err);
        }
        if !self.shared.health.is_up() {
            return self.degraded_lease(session_id, self.unavailable_reason());
        }
        let key = self.shared.rules.session_key(session_id);
        let rules = &self.shared.rules;
        let answer = self.call("lookup", |scripts, con| {
            scripts
                .lookup
                .key(&key)
                .arg(&self.shared.lease_field)
                .arg(rules.lease_ms())
                .arg(rules.ttl_ms())
                .invoke(con)
        });
        let answer = match answer {
            Ok(answer) => answer,
            Err(SessionError::StoreUnavailable { reason }) => {
                return self.degraded_lease(session_id, reason)
            }
            Err(other) => return Err(other),
        };
        let id: Arc<str> = Arc::from(session_id);
        let mode = self.shared.rules.mode;
        match answer.iter().map(String::as_str).collect::<Vec<_>>()[..] {
            ["none"] => Ok(Lease::from_store(id, None, 0)),
            ["unbound", version] => {
                Ok(Lease::from_store(id, None, parse_u64(version).unwrap_or(0)))
            }
            ["bound", version, worker, rank] => {
                match (parse_u64(version), parse_u64(worker), parse_rank(rank)) {
                    (Some(version), Some(worker_id), Some(dp_rank)) => Ok(Lease::from_store(
                        id,
                        Some(Binding {
                            target: AffinityTarget { worker_id, dp_rank },
                            mode,
                        }),
                        version,
                    )),
                    _ => {
                        let _ = self.foreign(key, "numbers out of range".to_owned());
                        Ok(Lease::from_store(id, None, 0))
                    }
                }
            }
            ["foreign", reason] => {
                let _ = self.foreign(key, reason.to_owned());
                Ok(Lease::from_store(id, None, 0))
            }
            _ => {
                let _ = self.foreign(key, format!("unexpected script answer {answer:?}"));
                Ok(Lease::from_store(id, None, 0))
            }
        }
    }

    fn dispatched(&self, lease: &Lease, row: RowId) -> Result<DispatchOutcome, SessionError> {
        // The request stays where its binding points: `lookup` already took this replica's
        // lease, so there is nothing to write. (Had the binding moved since, the full script
        // would answer `stale`, which changes nothing in the store either; only the label
        // differs in that race.)
        if lease.target().is_some_and(|t| t.matches(row)) {
            bump(&self.shared.counters.kept);
            self.count_in(lease);
            return Ok(DispatchOutcome::Kept);
        }
        if !self.shared.health.is_up() {
            // Counted at lookup (or there: the outage began in between).
            return Err(SessionError::StoreUnavailable {
                reason: self.unavailable_reason(),
            });
        }
        let rules = &self.shared.rules;
        let key = rules.session_key(lease.session_id());
        let version_key = rules.version_key();
        let keeps_rank = matches!(rules.granularity, BindingGranularity::Rank);
        let mode = match rules.mode {
            BindingMode::Soft => "soft",
            BindingMode::Hard => "hard",
        };
        let answer = self.call("dispatched", |scripts, con| {
            scripts
                .dispatch
                .key(&key)
                .key(&version_key)
                .arg(lease.version())
                .arg(row.worker_id)
                .arg(row.dp_rank)
                .arg(if keeps_rank { "1" } else { "0" })
                .arg(mode)
                .arg(&self.shared.lease_field)
                .arg(rules.lease_ms())
                .arg(rules.ttl_ms())
                .invoke(con)
        })?;
        let c = &self.shared.counters;
        let old_target = |worker: &str, rank: &str| -> Option<AffinityTarget> {
            Some(AffinityTarget {
                worker_id: parse_u64(worker)?,
                dp_rank: parse_rank(rank)?,
            })
        };
        match answer.iter().map(String::as_str).collect::<Vec<_>>()[..] {
            ["created"] => {
                bump(&c.created);
                self.count_in(lease);
                Ok(DispatchOutcome::Created)
            }
            ["kept"] => {
                bump(&c.kept);
                self.count_in(lease);
                Ok(DispatchOutcome::Kept)
            }
            ["stale"] => {
                bump(&c.stale);
                self.count_in(lease);
                Ok(DispatchOutcome::Stale)
            }
            ["moved", worker, rank] => {
                bump(&c.moved);
                self.count_in(lease);
                let from = old_target(worker, rank).unwrap_or(AffinityTarget {
                    worker_id: row.worker_id,
                    dp_rank: None,
                });
                let to = AffinityTarget {
                    worker_id: row.worker_id,
                    dp_rank: from.dp_rank.map(|_| row.dp_rank),
                };
                Ok(DispatchOutcome::Moved { from, to })
            }
            ["violated", worker, rank] => {
                bump(&c.hard_violations);
                let bound = old_target(worker, rank).unwrap_or(AffinityTarget {
                    worker_id: row.worker_id,
                    dp_rank: None,
                });
                Err(SessionError::HardAffinityViolated {
                    session_id: lease.session_id().to_owned(),
                    bound,
                    dispatched: row,
                })
            }
            ["foreign", reason] => Err(self.foreign(key, reason.to_owned())),
            _ => Err(self.foreign(key, format!("unexpected script answer {answer:?}"))),
        }
    }

    fn completed(&self, session_id: &str) {
        if check_session_id(session_id).is_err() {
            return;
        }
        let mut local = lock(&self.shared.local);
        let Some((key, count)) = local
            .get_key_value(session_id)
            .map(|(k, c)| (k.clone(), *c))
        else {
            return;
        };
        if count > 1 {
            local.insert(key, count - 1);
            return;
        }
        local.remove(session_id);
        drop(local);
        lock(&self.shared.released).push(key);
        self.shared.wake.notify_one();
    }

    fn invalidate(&self, session_id: &str) -> bool {
        if check_session_id(session_id).is_err() || !self.shared.health.is_up() {
            return false;
        }
        let rules = &self.shared.rules;
        let key = rules.session_key(session_id);
        let version_key = rules.version_key();
        let answer = self.call("invalidate", |scripts, con| {
            scripts.invalidate.key(&key).key(&version_key).invoke(con)
        });
        match answer.as_deref() {
            Ok([first, ..]) if first == "removed" => {
                bump(&self.shared.counters.invalidated);
                true
            }
            Ok([first, reason]) if first == "foreign" => {
                let _ = self.foreign(key, reason.clone());
                false
            }
            _ => false,
        }
    }

    fn binding(&self, session_id: &str) -> Option<Binding> {
        if check_session_id(session_id).is_err() || !self.shared.health.is_up() {
            return None;
        }
        let key = self.shared.rules.session_key(session_id);
        let answer = self
            .call("binding", |scripts, con| {
                scripts.lookup.key(&key).arg("").arg(0).arg(0).invoke(con)
            })
            .ok()?;
        match answer.iter().map(String::as_str).collect::<Vec<_>>()[..] {
            ["bound", _, worker, rank] => Some(Binding {
                target: AffinityTarget {
                    worker_id: parse_u64(worker)?,
                    dp_rank: parse_rank(rank)?,
                },
                mode: self.shared.rules.mode,
            }),
            _ => None,
        }
    }

    fn stats(&self) -> SessionStats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        SessionStats {
            created: get(&c.created),
            kept: get(&c.kept),
            moved: get(&c.moved),
            stale: get(&c.stale),
            // Redis expires keys itself; it does not tell this replica.
            expired: 0,
            hard_violations: get(&c.hard_violations),
            rejected_ids: get(&c.rejected_ids),
            invalidated: get(&c.invalidated),
            table_full: 0,
        }
    }
}

impl Drop for RedisStore {
    fn drop(&mut self) {
        // Not joined: the last handle may go on an async worker thread (a reload's old
        // configuration retiring with its last request). The background flushes pending
        // releases (bounded by its timeout) and ends by itself.
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wake.notify_all();
        drop(self.background.take());
    }
}
