//! Connections to the store and its health: a small pool of blocking connections, each call
//! bounded by the configured timeout, and the up/down state that turns the first failure into an
//! outage (logged once) and the background probe's first success into its end (logged once).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use redis::{Client, Connection, RedisError};

use router_config::OnStoreUnavailable;

/// Idle connections kept for reuse; more are opened under load and closed when returned.
const MAX_IDLE: usize = 32;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Whether `err` means the connection (not the command) failed: the store is unreachable,
/// too slow, or refused us (authentication).
pub(super) fn is_outage(err: &RedisError) -> bool {
    err.is_io_error()
        || err.is_timeout()
        || err.is_connection_dropped()
        || err.is_connection_refusal()
        || err.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(
            err.kind(),
            redis::ErrorKind::Server(
                redis::ServerErrorKind::BusyLoading | redis::ServerErrorKind::MasterDown
            )
        )
        || err.code() == Some("NOAUTH")
        || err.code() == Some("WRONGPASS")
}

/// The pool: connections are taken for one call and given back when it succeeded.
pub(super) struct Pool {
    client: Client,
    idle: Mutex<Vec<Connection>>,
    timeout: Duration,
}

impl Pool {
    pub fn new(client: Client, timeout: Duration) -> Pool {
        Pool {
            client,
            idle: Mutex::new(Vec::new()),
            timeout,
        }
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A fresh connection, with every read and write bounded by what remains until `deadline`.
    pub fn connect(&self, deadline: Instant) -> Result<Connection, RedisError> {
        let left = remaining(deadline)?;
        let con = self.client.get_connection_with_timeout(left)?;
        Ok(con)
    }

    /// A connection (idle or new) whose reads and writes end by `deadline`; `true` if it was
    /// idle (it may have gone stale while it waited).
    pub fn take(&self, deadline: Instant) -> Result<(Connection, bool), RedisError> {
        let idle = lock(&self.idle).pop();
        let (con, reused) = match idle {
            Some(con) => (con, true),
            None => (self.connect(deadline)?, false),
        };
        let left = remaining(deadline)?;
        con.set_read_timeout(Some(left))?;
        con.set_write_timeout(Some(left))?;
        Ok((con, reused))
    }

    pub fn give_back(&self, con: Connection) {
        let mut idle = lock(&self.idle);
        if idle.len() < MAX_IDLE {
            idle.push(con);
        }
    }

    /// Drop every idle connection (after an outage they are all suspect).
    pub fn clear(&self) {
        lock(&self.idle).clear();
    }
}

/// Time left until `deadline`, or a timeout error when none is.
fn remaining(deadline: Instant) -> Result<Duration, RedisError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left < Duration::from_micros(100) {
        return Err(RedisError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "the store timeout passed",
        )));
    }
    Ok(left)
}

/// Up or down, with the outage's start and what it cost.
pub(super) struct Health {
    up: AtomicBool,
    outage: Mutex<Option<Outage>>,
    /// Requests with a session routed without their binding, or refused, during outages.
    pub degraded: AtomicU64,
    /// Outages begun.
    pub outages: AtomicU64,
    url: String,
    on_unavailable: OnStoreUnavailable,
}

struct Outage {
    since: Instant,
    degraded_before: u64,
}

impl Health {
    pub fn new(url: String, on_unavailable: OnStoreUnavailable) -> Health {
        Health {
            up: AtomicBool::new(true),
            outage: Mutex::new(None),
            degraded: AtomicU64::new(0),
            outages: AtomicU64::new(0),
            url,
            on_unavailable,
        }
    }

    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    /// The store failed: begin an outage unless one is under way (logged once).
    pub fn fail(&self, reason: &str) {
        let mut outage = lock(&self.outage);
        if outage.is_some() {
            return;
        }
        self.up.store(false, Ordering::Release);
        self.outages.fetch_add(1, Ordering::Relaxed);
        *outage = Some(Outage {
            since: Instant::now(),
            degraded_before: self.degraded.load(Ordering::Relaxed),
        });
        drop(outage);
        let what = match self.on_unavailable {
            OnStoreUnavailable::Route => "routed without their binding",
            OnStoreUnavailable::Refuse => "refused (503 session_store_unavailable)",
        };
        tracing::error!(
            store = %self.url,
            "session store unavailable: {reason}; until it answers again, requests that carry a \
             session are {what} (session_affinity.store.on_unavailable); reconnecting in the \
             background"
        );
    }

    /// The background probe reached the store: end the outage (logged once).
    pub fn recovered(&self) {
        let Some(outage) = lock(&self.outage).take() else {
            return;
        };
        self.up.store(true, Ordering::Release);
        let degraded = self
            .degraded
            .load(Ordering::Relaxed)
            .saturating_sub(outage.degraded_before);
        tracing::warn!(
            store = %self.url,
            "session store reachable again after {:.1} s; {degraded} requests with a session \
             were served without it meanwhile",
            outage.since.elapsed().as_secs_f64()
        );
    }
}
