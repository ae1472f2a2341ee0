//! The store's background thread: off every request's path, it
//! - releases the leases of sessions whose last local request ended (pipelined);
//! - renews this replica's leases every third of `lease_secs` (the heartbeat: a replica that
//!   dies stops renewing, and its in-flight counts vanish a lease later);
//! - while the store is down, probes it every [`PROBE_INTERVAL`] and ends the outage on the
//!   first answer.

use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use redis::{Connection, RedisError};

use super::connection::is_outage;
use super::redis_store::{describe, Shared};

/// How often an unreachable store is tried again.
pub const PROBE_INTERVAL: Duration = Duration::from_millis(200);
/// Background calls carry many commands at once: they may take this long at least.
const MIN_BACKGROUND_TIMEOUT: Duration = Duration::from_secs(1);
/// Commands per pipeline.
const BATCH: usize = 512;

fn lock<T>(m: &std::sync::Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

pub(super) fn spawn(shared: Arc<Shared>) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("session-store".to_owned())
        .spawn(move || Worker::new(shared).run())
}

struct Worker {
    shared: Arc<Shared>,
    con: Option<Connection>,
    timeout: Duration,
    heartbeat: Duration,
}

impl Worker {
    fn new(shared: Arc<Shared>) -> Worker {
        let timeout = shared.pool.timeout().max(MIN_BACKGROUND_TIMEOUT);
        let heartbeat = (shared.rules.lease / 3).max(Duration::from_millis(50));
        Worker {
            shared,
            con: None,
            timeout,
            heartbeat,
        }
    }

    fn run(mut self) {
        let mut next_beat = Instant::now() + self.heartbeat;
        loop {
            let stopping = self.wait(next_beat);
            if !self.shared.health.is_up() {
                if self.probe().is_err() {
                    // Releases cannot be sent; the leases end by themselves a lease later, and
                    // a long outage must not pile them up.
                    lock(&self.shared.released).clear();
                    if stopping {
                        return;
                    }
                    continue;
                }
                self.shared.health.recovered();
            }
            self.release();
            if Instant::now() >= next_beat {
                self.renew();
                next_beat = Instant::now() + self.heartbeat;
            }
            if stopping {
                return;
            }
        }
    }

    /// Sleep until there is work, the heartbeat is due, a probe is due, or the store is
    /// dropped; returns whether it is.
    fn wait(&self, next_beat: Instant) -> bool {
        let shared = &self.shared;
        let released = lock(&shared.released);
        let up = shared.health.is_up();
        // While the store is down, pending releases wait for it: probe at the probe's pace
        // rather than spin on them.
        if (!up || released.is_empty()) && !shared.stop.load(Ordering::Acquire) {
            let wait = if up {
                next_beat.saturating_duration_since(Instant::now())
            } else {
                PROBE_INTERVAL
            };
            let _ = shared
                .wake
                .wait_timeout(released, wait)
                .unwrap_or_else(PoisonError::into_inner);
        }
        shared.stop.load(Ordering::Acquire)
    }

    /// A connection for background work, with the scripts loaded.
    fn connection(&mut self) -> Result<&mut Connection, RedisError> {
        if self.con.is_none() {
            let deadline = Instant::now() + self.timeout;
            let con = self.shared.pool.connect(deadline)?;
            con.set_read_timeout(Some(self.timeout))?;
            con.set_write_timeout(Some(self.timeout))?;
            self.con = Some(con);
            self.load_scripts()?;
        }
        self.con.as_mut().ok_or_else(|| {
            RedisError::from(std::io::Error::other("no connection to the session store"))
        })
    }

    fn load_scripts(&mut self) -> Result<(), RedisError> {
        let scripts = &self.shared.scripts;
        if let Some(con) = self.con.as_mut() {
            scripts.complete.load(con)?;
            scripts.renew.load(con)?;
        }
        Ok(())
    }

    fn probe(&mut self) -> Result<(), RedisError> {
        self.con = None;
        let result = self.connection().and_then(|con| {
            let _: String = redis::cmd("PING").query(con)?;
            Ok(())
        });
        if result.is_err() {
            self.con = None;
        }
        result
    }

    /// A background call failed: an outage if the connection did.
    fn failed(&mut self, what: &str, err: &RedisError) {
        self.con = None;
        if is_outage(err) {
            self.shared.pool.clear();
            self.shared
                .health
                .fail(&format!("{what} (background): {}", describe(err)));
        } else {
            tracing::warn!(store = %self.shared.url, "session store {what} failed: {}", describe(err));
        }
    }

    /// Run `build`'s commands for `sessions` in pipelines of [`BATCH`]; scripts flushed by the
    /// store (`NOSCRIPT`) are loaded again once.
    fn pipelined(
        &mut self,
        what: &str,
        sessions: &[Arc<str>],
        build: impl Fn(&Shared, &mut redis::Pipeline, &str),
    ) {
        for chunk in sessions.chunks(BATCH) {
            let shared = self.shared.clone();
            let mut pipe = redis::pipe();
            for session in chunk {
                build(&shared, &mut pipe, session);
            }
            let mut reloaded = false;
            loop {
                let result = self
                    .connection()
                    .and_then(|con| pipe.query::<()>(con).map(|_| ()));
                match result {
                    Ok(()) => break,
                    Err(err)
                        if !reloaded
                            && err.kind()
                                == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
                    {
                        reloaded = true;
                        if let Err(err) = self.load_scripts() {
                            self.failed(what, &err);
                            return;
                        }
                    }
                    Err(err) => {
                        self.failed(what, &err);
                        return;
                    }
                }
            }
        }
    }

    /// Release the leases of sessions whose last local request ended, unless a request of
    /// the session started again meanwhile (its dispatch renewed the lease).
    fn release(&mut self) {
        let pending = std::mem::take(&mut *lock(&self.shared.released));
        if pending.is_empty() {
            return;
        }
        let sessions: Vec<Arc<str>> = {
            let local = lock(&self.shared.local);
            pending
                .into_iter()
                .filter(|s| !local.contains_key(s))
                .collect()
        };
        if !self.shared.health.is_up() {
            // The leases expire by themselves a lease later.
            return;
        }
        self.pipelined("lease release", &sessions, |shared, pipe, session| {
            pipe.cmd("EVALSHA")
                .arg(shared.scripts.complete.get_hash())
                .arg(1)
                .arg(shared.rules.session_key(session))
                .arg(&shared.lease_field)
                .arg(shared.rules.ttl_ms())
                .ignore();
        });
    }

    /// The heartbeat: renew the lease of every session with requests in flight here.
    fn renew(&mut self) {
        if !self.shared.health.is_up() {
            return;
        }
        let sessions: Vec<Arc<str>> = lock(&self.shared.local).keys().cloned().collect();
        if sessions.is_empty() {
            return;
        }
        self.pipelined("lease renewal", &sessions, |shared, pipe, session| {
            pipe.cmd("EVALSHA")
                .arg(shared.scripts.renew.get_hash())
                .arg(1)
                .arg(shared.rules.session_key(session))
                .arg(&shared.lease_field)
                .arg(shared.rules.lease_ms())
                .arg(shared.rules.ttl_ms())
                .ignore();
        });
    }
}
