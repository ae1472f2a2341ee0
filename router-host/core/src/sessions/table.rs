//! The in-memory [`SessionTable`]: per-session entries, versioned bindings, expiry and counters.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use plugin_api::{AffinityTarget, RowId};

use super::types::ShowTarget;
use super::{
    check_session_id, Binding, BindingGranularity, BindingMode, Clock, DispatchOutcome, Lease,
    SessionError, SessionStats,
};

#[derive(Debug, Default)]
struct Counters {
    created: AtomicU64,
    kept: AtomicU64,
    moved: AtomicU64,
    stale: AtomicU64,
    expired: AtomicU64,
    hard_violations: AtomicU64,
    rejected_ids: AtomicU64,
    invalidated: AtomicU64,
    table_full: AtomicU64,
}

fn bump(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

/// One tracked session. It exists while the session has a binding or requests in flight.
#[derive(Debug)]
struct Entry {
    /// `None` only while requests of an invalidated binding are still in flight.
    binding: Option<AffinityTarget>,
    /// Table-unique version of the current binding state; changes on create, move and removal.
    version: u64,
    /// Requests of this session dispatched and not yet completed.
    in_flight: u64,
    /// When `in_flight` last dropped to zero (or when the entry was created).
    idle_since: Duration,
}

impl Entry {
    /// Expired = bound, idle, and strictly past `idle_since + ttl`. A deadline that overflows
    /// `Duration` never passes.
    fn expired(&self, now: Duration, ttl: Duration) -> bool {
        self.in_flight == 0
            && self.binding.is_some()
            && self.idle_since.checked_add(ttl).is_some_and(|d| now > d)
    }
}

#[derive(Debug)]
struct Inner {
    map: HashMap<Arc<str>, Entry>,
    /// Entries with `binding: Some` (what `max_bindings` caps and `len` reports).
    bound: usize,
    /// Next binding version. Table-wide rather than per entry so a binding removed and re-created
    /// never reuses a version an old lease could hold (no ABA).
    next_version: u64,
    /// A lower bound on the earliest idle deadline, so a full table only sweeps when something can
    /// actually have expired (`None` = no idle binding known).
    expiry_hint: Option<Duration>,
}

fn next_version(counter: &mut u64) -> u64 {
    let v = *counter;
    *counter = counter.wrapping_add(1).max(1);
    v
}

/// The host's session-binding table. See the module docs for the request lifecycle.
///
/// All methods take `&self`; one mutex guards the map and is held only for a hash lookup and a few
/// field updates (no allocation while locked when the session already exists; the creation path
/// inserts an id already allocated by `lookup`).
pub struct SessionTable {
    mode: BindingMode,
    ttl: Duration,
    max_bindings: usize,
    granularity: BindingGranularity,
    clock: Arc<dyn Clock>,
    inner: Mutex<Inner>,
    stats: Counters,
}

impl fmt::Debug for SessionTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionTable")
            .field("mode", &self.mode)
            .field("ttl", &self.ttl)
            .field("max_bindings", &self.max_bindings)
            .field("granularity", &self.granularity)
            .field("len", &self.len())
            .finish_non_exhaustive()
    }
}

impl SessionTable {
    /// A table in `mode` whose bindings expire `ttl` after the session's last in-flight request
    /// completes, holding at most `max_bindings` bindings (0 = never create one). New bindings are
    /// worker-level; see [`SessionTable::with_granularity`].
    pub fn new(
        mode: BindingMode,
        ttl: Duration,
        max_bindings: usize,
        clock: Arc<dyn Clock>,
    ) -> Self {
        Self {
            mode,
            ttl,
            max_bindings,
            granularity: BindingGranularity::default(),
            clock,
            inner: Mutex::new(Inner {
                map: HashMap::new(),
                bound: 0,
                next_version: 1,
                expiry_hint: None,
            }),
            stats: Counters::default(),
        }
    }

    /// Choose what new bindings remember of the dispatched row (default: the worker).
    #[must_use]
    pub fn with_granularity(mut self, granularity: BindingGranularity) -> Self {
        self.granularity = granularity;
        self
    }

    /// The configured mode.
    pub fn mode(&self) -> BindingMode {
        self.mode
    }

    /// The configured idle TTL.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The configured cap on bindings.
    pub fn max_bindings(&self) -> usize {
        self.max_bindings
    }

    /// The configured granularity of new bindings.
    pub fn granularity(&self) -> BindingGranularity {
        self.granularity
    }

    /// A poisoned lock is recovered, not propagated: no code path panics while holding it, and a
    /// session table that refused all work after an unrelated panic would take routing down with it.
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Checks the id with [`check_session_id`], counting rejections.
    fn validate(&self, session_id: &str) -> Result<(), SessionError> {
        check_session_id(session_id).inspect_err(|_| bump(&self.stats.rejected_ids, 1))
    }

    /// Called when a request arrives: the binding it should honour and the version it saw.
    ///
    /// A binding whose idle TTL has passed is removed here (and the lease shows none). Taking a
    /// lease does not count the request in flight.
    ///
    /// # Errors
    /// [`SessionError::EmptySessionId`] or [`SessionError::SessionIdTooLong`]; the caller routes
    /// the request without session affinity.
    pub fn lookup(&self, session_id: &str) -> Result<Lease, SessionError> {
        self.validate(session_id)?;
        let (key, binding, version) = {
            let mut guard = self.lock();
            let inner = &mut *guard;
            let now = self.clock.now();
            // One hash of the id on the common path (a live entry or none); an expired entry
            // is looked up again to remove it.
            match inner.map.get_key_value(session_id) {
                None => (None, None, 0),
                Some((k, e)) if !e.expired(now, self.ttl) => {
                    (Some(Arc::clone(k)), e.binding, e.version)
                }
                Some(_) => {
                    // Idle entries have no requests in flight, so the whole entry goes.
                    let key = inner.map.remove_entry(session_id).map(|(k, _)| k);
                    inner.bound = inner.bound.saturating_sub(1);
                    bump(&self.stats.expired, 1);
                    (key, None, 0)
                }
            }
        };
        // Allocate a fresh id (unknown session) outside the lock.
        let session_id = key.unwrap_or_else(|| Arc::from(session_id));
        Ok(Lease {
            session_id,
            binding: binding.map(|target| Binding {
                target,
                mode: self.mode,
            }),
            version,
        })
    }

    /// Records that the request holding `lease` was booked on `row`.
    ///
    /// - no binding (or it expired since the lease was taken) -> create one from `row` with the
    ///   table's granularity: [`DispatchOutcome::Created`];
    /// - `row` matches the binding -> [`DispatchOutcome::Kept`];
    /// - `row` differs and the binding changed since the lease was taken -> leave the newer binding
    ///   alone: [`DispatchOutcome::Stale`] (in either mode: the request was routed against a view
    ///   that is no longer current, so it must not overwrite or invalidate the newer binding);
    /// - soft mode, `row` differs, lease current -> the binding follows `row`, keeping its
    ///   granularity: [`DispatchOutcome::Moved`];
    /// - hard mode, `row` differs, lease current -> the binding is removed and
    ///   [`SessionError::HardAffinityViolated`] returned.
    ///
    /// Every `Ok` counts the request in flight for its session; errors do not. Call
    /// [`SessionTable::completed`] exactly once per `Ok`. On [`SessionError::TableFull`] the request
    /// itself can still be routed; it just leaves no binding behind.
    ///
    /// # Errors
    /// [`SessionError::HardAffinityViolated`] (hard mode, see above) or
    /// [`SessionError::TableFull`]. Neither undoes the booking.
    pub fn dispatched(&self, lease: &Lease, row: RowId) -> Result<DispatchOutcome, SessionError> {
        let key: &str = &lease.session_id;
        let mut guard = self.lock();
        let inner = &mut *guard;
        let now = self.clock.now();

        if let Some(entry) = inner.map.get_mut(key) {
            if entry.expired(now, self.ttl) {
                // Expired while the request was queued: logically gone, recreate below.
                inner.map.remove(key);
                inner.bound = inner.bound.saturating_sub(1);
                bump(&self.stats.expired, 1);
            } else if let Some(current) = entry.binding {
                if current.matches(row) {
                    entry.in_flight = entry.in_flight.saturating_add(1);
                    bump(&self.stats.kept, 1);
                    return Ok(DispatchOutcome::Kept);
                }
                if entry.version != lease.version {
                    entry.in_flight = entry.in_flight.saturating_add(1);
                    bump(&self.stats.stale, 1);
                    return Ok(DispatchOutcome::Stale);
                }
                match self.mode {
                    BindingMode::Soft => {
                        let to = AffinityTarget {
                            worker_id: row.worker_id,
                            dp_rank: current.dp_rank.map(|_| row.dp_rank),
                        };
                        entry.binding = Some(to);
                        entry.version = next_version(&mut inner.next_version);
                        entry.in_flight = entry.in_flight.saturating_add(1);
                        bump(&self.stats.moved, 1);
                        return Ok(DispatchOutcome::Moved { from: current, to });
                    }
                    BindingMode::Hard => {
                        entry.binding = None;
                        entry.version = next_version(&mut inner.next_version);
                        if entry.in_flight == 0 {
                            inner.map.remove(key);
                        }
                        inner.bound = inner.bound.saturating_sub(1);
                        bump(&self.stats.hard_violations, 1);
                        drop(guard);
                        tracing::debug!(
                            session_id = key,
                            bound = %ShowTarget(&current),
                            worker_id = row.worker_id,
                            dp_rank = row.dp_rank,
                            "hard session affinity violated; binding invalidated"
                        );
                        return Err(SessionError::HardAffinityViolated {
                            session_id: key.to_owned(),
                            bound: current,
                            dispatched: row,
                        });
                    }
                }
            }
            // Otherwise: an entry without binding (invalidated, requests still in flight) -> fill.
        }

        if inner.bound >= self.max_bindings {
            if inner.expiry_hint.is_some_and(|d| now > d) {
                self.purge_locked(inner, now);
            }
            if inner.bound >= self.max_bindings {
                bump(&self.stats.table_full, 1);
                drop(guard);
                tracing::debug!(
                    max_bindings = self.max_bindings,
                    "session table full; request routed without a binding"
                );
                return Err(SessionError::TableFull {
                    max: self.max_bindings,
                });
            }
        }

        let target = self.granularity.target_for(row);
        let version = next_version(&mut inner.next_version);
        match inner.map.get_mut(key) {
            Some(entry) => {
                entry.binding = Some(target);
                entry.version = version;
                entry.in_flight = entry.in_flight.saturating_add(1);
            }
            None => {
                inner.map.insert(
                    Arc::clone(&lease.session_id),
                    Entry {
                        binding: Some(target),
                        version,
                        in_flight: 1,
                        idle_since: now,
                    },
                );
            }
        }
        inner.bound += 1;
        bump(&self.stats.created, 1);
        Ok(DispatchOutcome::Created)
    }

    /// One in-flight request of the session completed. When none remain, the idle TTL restarts
    /// from now. Unknown sessions (never bound, invalidated and drained, invalid ids) are a no-op,
    /// as is a completion with nothing in flight (the count never goes negative).
    pub fn completed(&self, session_id: &str) {
        if check_session_id(session_id).is_err() {
            return;
        }
        let mut guard = self.lock();
        let inner = &mut *guard;
        let now = self.clock.now();
        let Some(entry) = inner.map.get_mut(session_id) else {
            return;
        };
        if entry.in_flight == 0 {
            drop(guard);
            tracing::debug!(
                session_id,
                "session completion with no request in flight ignored"
            );
            return;
        }
        entry.in_flight -= 1;
        if entry.in_flight > 0 {
            return;
        }
        if entry.binding.is_none() {
            // Last request of an invalidated binding: nothing left to remember.
            inner.map.remove(session_id);
            return;
        }
        entry.idle_since = now;
        if let Some(deadline) = now.checked_add(self.ttl) {
            inner.expiry_hint = Some(inner.expiry_hint.map_or(deadline, |h| h.min(deadline)));
        }
    }

    /// Removes the session's binding, e.g. because its hard-bound worker is gone (the caller then
    /// runs normal selection once and the next dispatch creates a fresh binding). Requests still in
    /// flight keep being counted. Returns whether a live binding was removed.
    pub fn invalidate(&self, session_id: &str) -> bool {
        if check_session_id(session_id).is_err() {
            return false;
        }
        let mut guard = self.lock();
        let inner = &mut *guard;
        let now = self.clock.now();
        let Some(entry) = inner.map.get_mut(session_id) else {
            return false;
        };
        if entry.binding.is_none() {
            return false;
        }
        let was_expired = entry.expired(now, self.ttl);
        entry.binding = None;
        entry.version = next_version(&mut inner.next_version);
        if entry.in_flight == 0 {
            inner.map.remove(session_id);
        }
        inner.bound = inner.bound.saturating_sub(1);
        if was_expired {
            bump(&self.stats.expired, 1);
            false
        } else {
            bump(&self.stats.invalidated, 1);
            true
        }
    }

    /// The session's live binding, without side effects (an expired binding reads as none but is
    /// not removed). For traces and tests; routing uses [`SessionTable::lookup`].
    pub fn binding(&self, session_id: &str) -> Option<Binding> {
        let guard = self.lock();
        let now = self.clock.now();
        let entry = guard.map.get(session_id)?;
        if entry.expired(now, self.ttl) {
            return None;
        }
        entry.binding.map(|target| Binding {
            target,
            mode: self.mode,
        })
    }

    /// Requests of the session dispatched and not yet completed (0 for unknown sessions).
    pub fn in_flight(&self, session_id: &str) -> u64 {
        self.lock().map.get(session_id).map_or(0, |e| e.in_flight)
    }

    /// Number of bindings held, including expired ones not yet removed (removal is lazy: on
    /// lookup, when the table is full, or via [`SessionTable::purge_expired`]).
    pub fn len(&self) -> usize {
        self.lock().bound
    }

    /// Whether no binding is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Removes every expired binding now and returns how many. Optional: expiry is otherwise lazy,
    /// which is enough for correctness; a periodic purge just keeps `len` and metrics current.
    pub fn purge_expired(&self) -> usize {
        let mut guard = self.lock();
        let now = self.clock.now();
        self.purge_locked(&mut guard, now)
    }

    /// Sweeps the whole map (O(n) under the lock; only when the table is full and the hint says
    /// something may have expired, or on an explicit purge) and recomputes the expiry hint.
    fn purge_locked(&self, inner: &mut Inner, now: Duration) -> usize {
        let ttl = self.ttl;
        let mut removed = 0usize;
        let mut hint: Option<Duration> = None;
        inner.map.retain(|_, e| {
            if e.expired(now, ttl) {
                removed += 1;
                return false;
            }
            if e.in_flight == 0 && e.binding.is_some() {
                if let Some(d) = e.idle_since.checked_add(ttl) {
                    hint = Some(hint.map_or(d, |h| h.min(d)));
                }
            }
            true
        });
        inner.bound = inner.bound.saturating_sub(removed);
        inner.expiry_hint = hint;
        bump(&self.stats.expired, removed as u64);
        removed
    }

    /// Snapshot of the cumulative counters (each read independently; not one atomic snapshot).
    pub fn stats(&self) -> SessionStats {
        let s = &self.stats;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        SessionStats {
            created: get(&s.created),
            kept: get(&s.kept),
            moved: get(&s.moved),
            stale: get(&s.stale),
            expired: get(&s.expired),
            hard_violations: get(&s.hard_violations),
            rejected_ids: get(&s.rejected_ids),
            invalidated: get(&s.invalidated),
            table_full: get(&s.table_full),
        }
    }
}
