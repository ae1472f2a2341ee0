//! Session-binding table (design `worker-selection.md` §5).
//!
//! Multi-turn and agentic traffic only reuses a worker's KV cache if the router remembers where a
//! session went. This module is that memory, and nothing else: it does not select, book or route.
//! The host drives it through a request's lifecycle:
//!
//! 1. [`SessionTable::lookup`] when the request arrives: returns a [`Lease`] with the binding the
//!    request should honour (a pin in hard mode, an advisory target in soft mode) and the binding
//!    version it saw;
//! 2. [`SessionTable::dispatched`] once the request was booked on a row: creates, keeps or moves the
//!    binding (a versioned compare-and-swap against the lease) and counts the request in flight;
//! 3. [`SessionTable::completed`] when it finishes: the idle TTL restarts when the last in-flight
//!    request of the session completes.
//!
//! The table is safe to share between threads (the replay simulator and a server use the same
//! one), and time comes from an injected [`Clock`] so tests and replay run on simulated time.
//!
//! In-flight counts belong to the *session*, not to one binding: invalidating a binding (hard
//! violation, worker gone) keeps counting the session's requests still running, so a binding created
//! afterwards does not start its idle TTL while older requests of the same session are still in
//! flight, and their completions cannot drive the count negative.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use plugin_api::{AffinityTarget, RowId};
use thiserror::Error;

/// Longest accepted session id, in bytes (design §5): ids are hashed and stored per binding, so an
/// unbounded id would let one client make every lookup and every stored key arbitrarily large.
pub const MAX_SESSION_ID_BYTES: usize = 256;

/// Default cap on the number of bindings (design §5); bounds the table's memory.
pub const DEFAULT_MAX_BINDINGS: usize = 65_536;

/// How much of a rejected id an error message quotes: enough to recognise it in a log, never a
/// 10 KB blob.
const ID_PREVIEW_BYTES: usize = 32;

// ---------------------------------------------------------------------------------------------
// Clock
// ---------------------------------------------------------------------------------------------

/// Time since the Unix epoch.
///
/// Session TTLs and queue waits are measured on it. Wall time, so that the instant a binding was
/// last used means the same thing to every router process sharing the binding (see
/// `docs/routing-contract.md`, "Sessions"). Injected so that tests and the replay simulator can
/// drive expiry with simulated time instead of sleeping.
pub trait Clock: Send + Sync {
    /// Time elapsed since the Unix epoch (or, for a simulated clock, since its own start).
    fn now(&self) -> Duration;
}

/// The system's wall clock. A step backwards (NTP) only makes bindings look younger: expiry uses
/// saturating differences, so nothing breaks, a binding just lives a little longer.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl SystemClock {
    pub fn new() -> Self {
        SystemClock
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO)
    }
}

/// A clock that only moves when told to, for tests and the replay simulator.
///
/// Shareable via `Arc` (the table holds one handle, the driver another); atomics make `set` and
/// `advance` usable through `&self` from any thread. Resolution is one nanosecond; values beyond
/// `u64::MAX` nanoseconds (about 584 years) saturate.
#[derive(Debug, Default)]
pub struct ManualClock {
    nanos: AtomicU64,
}

impl ManualClock {
    /// A clock reading `start`.
    pub fn new(start: Duration) -> Self {
        Self {
            nanos: AtomicU64::new(duration_to_nanos(start)),
        }
    }

    /// Jump to `t` (may move backwards; that is the caller's business in a simulation).
    pub fn set(&self, t: Duration) {
        self.nanos.store(duration_to_nanos(t), Ordering::SeqCst);
    }

    /// Move forward by `d`, saturating instead of wrapping.
    pub fn advance(&self, d: Duration) {
        let step = duration_to_nanos(d);
        // The closure always returns `Some`, so `fetch_update` cannot fail.
        let _ = self
            .nanos
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                Some(n.saturating_add(step))
            });
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::SeqCst))
    }
}

fn duration_to_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

// ---------------------------------------------------------------------------------------------
// Public types
// ---------------------------------------------------------------------------------------------

/// How a binding constrains later requests of its session (`session_affinity.mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BindingMode {
    /// The binding is an advisory target; it follows wherever the request was actually dispatched.
    Soft,
    /// The binding is a pin; a dispatch elsewhere is an error and invalidates the binding.
    Hard,
}

impl BindingMode {
    /// Every mode, in declaration order.
    pub const ALL: [BindingMode; 2] = [BindingMode::Soft, BindingMode::Hard];

    /// The YAML / metrics spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            BindingMode::Soft => "soft",
            BindingMode::Hard => "hard",
        }
    }

    /// The mode spelled `name` (as [`Self::as_str`] writes it), if any.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|mode| mode.as_str() == name)
    }
}

impl fmt::Display for BindingMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a *new* binding remembers of the dispatched row. Existing bindings keep their granularity
/// when they move (design §5: worker-level stays worker-level, a rank binding follows the rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum BindingGranularity {
    /// `{worker_id, None}`: any rank of the worker matches, so the policy keeps the freedom to
    /// balance the session across that worker's DP ranks.
    #[default]
    Worker,
    /// `{worker_id, Some(dp_rank)}`: only that rank matches.
    Rank,
}

impl BindingGranularity {
    fn target_for(self, row: RowId) -> AffinityTarget {
        AffinityTarget {
            worker_id: row.worker_id,
            dp_rank: match self {
                BindingGranularity::Worker => None,
                BindingGranularity::Rank => Some(row.dp_rank),
            },
        }
    }
}

/// A session's current binding as seen by a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Binding {
    /// Where the session is bound.
    pub target: AffinityTarget,
    /// Whether the request must go there (hard) or may be steered elsewhere (soft).
    pub mode: BindingMode,
}

/// What a request saw at [`SessionTable::lookup`], handed back to [`SessionTable::dispatched`].
///
/// Fields are private so a lease can only come from `lookup`: the version is the compare half of
/// the compare-and-swap and must not be forged. Taking a lease does not count the request as in
/// flight (it may still be queued or rejected); only a successful `dispatched` does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    session_id: Arc<str>,
    binding: Option<Binding>,
    version: u64,
}

impl Lease {
    /// The (validated) session id.
    pub fn session_id(&self) -> &str {
        &self.session_id
    }

    /// The session id as the table holds it: a second handle, not a copy (no allocation).
    pub fn shared_session_id(&self) -> Arc<str> {
        Arc::clone(&self.session_id)
    }

    /// The binding the request should honour, if the session had one.
    pub fn binding(&self) -> Option<Binding> {
        self.binding
    }

    /// Shorthand for the binding's target.
    pub fn target(&self) -> Option<AffinityTarget> {
        self.binding.map(|b| b.target)
    }

    /// The binding version the request saw (0 = the session was not tracked at all).
    pub fn version(&self) -> u64 {
        self.version
    }
}

/// What [`SessionTable::dispatched`] did to the binding. Every variant means the request is now
/// counted in flight; call [`SessionTable::completed`] exactly once for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DispatchOutcome {
    /// The session had no binding; one was created from the dispatched row.
    Created,
    /// The dispatched row matches the binding; nothing changed.
    Kept,
    /// Soft mode: the binding followed the dispatched row.
    Moved {
        from: AffinityTarget,
        to: AffinityTarget,
    },
    /// Soft or hard mode: the binding changed (or appeared) after this request's lease was taken
    /// and the row does not match it; the newer binding was left in place.
    Stale,
}

impl DispatchOutcome {
    /// Stable label for metrics and traces.
    pub fn as_str(&self) -> &'static str {
        match self {
            DispatchOutcome::Created => "created",
            DispatchOutcome::Kept => "kept",
            DispatchOutcome::Moved { .. } => "moved",
            DispatchOutcome::Stale => "stale",
        }
    }
}

/// Errors of the session table. The host fails a request whose session id is invalid (empty or
/// over the limit); for the others it routes the request without (or in spite of) the binding.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SessionError {
    /// An empty id would make every anonymous request share one session.
    #[error("session id is empty")]
    EmptySessionId,
    /// The id exceeds [`MAX_SESSION_ID_BYTES`]; `preview` holds at most its first 32 bytes.
    #[error("session id is {len} bytes, over the {max}-byte limit (starts with {preview:?}...)")]
    SessionIdTooLong {
        len: usize,
        max: usize,
        preview: String,
    },
    /// Hard mode: the request was booked on a row its binding does not match. The binding has been
    /// removed; the booking itself is not undone, and the request is not counted in flight.
    #[error(
        "hard session affinity violated: session {session_id:?} is bound to {}, but the request \
         was dispatched to worker {} rank {}; the binding was invalidated",
        ShowTarget(.bound), .dispatched.worker_id, .dispatched.dp_rank
    )]
    HardAffinityViolated {
        session_id: String,
        bound: AffinityTarget,
        dispatched: RowId,
    },
    /// Creating a binding would exceed `max_bindings` even after evicting expired ones. No binding
    /// was created and the request is not counted in flight; the caller still routes it normally.
    #[error(
        "session table full: {max} bindings, none expired; the request is routed without creating \
         a binding"
    )]
    TableFull { max: usize },
}

/// Renders an [`AffinityTarget`] for messages (`AffinityTarget` itself has no `Display`).
struct ShowTarget<'a>(&'a AffinityTarget);

impl fmt::Display for ShowTarget<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.dp_rank {
            Some(rank) => write!(f, "worker {} rank {}", self.0.worker_id, rank),
            None => write!(f, "worker {} (any rank)", self.0.worker_id),
        }
    }
}

/// Where session bindings live. The in-memory [`SessionTable`] is one implementation; a store
/// shared by several router processes is another. Every method is called from many routing
/// threads at once.
///
/// The contract (a lease per request, a versioned compare-and-swap at dispatch, one
/// `completed` per successful `dispatched`) is [`SessionTable`]'s, documented on its methods and
/// in `docs/routing-contract.md`, "Sessions".
pub trait SessionStore: Send + Sync + fmt::Debug {
    /// See [`SessionTable::lookup`].
    fn lookup(&self, session_id: &str) -> Result<Lease, SessionError>;
    /// See [`SessionTable::dispatched`].
    fn dispatched(&self, lease: &Lease, row: RowId) -> Result<DispatchOutcome, SessionError>;
    /// See [`SessionTable::completed`].
    fn completed(&self, session_id: &str);
    /// See [`SessionTable::invalidate`].
    fn invalidate(&self, session_id: &str) -> bool;
    /// See [`SessionTable::binding`].
    fn binding(&self, session_id: &str) -> Option<Binding>;
    /// See [`SessionTable::stats`].
    fn stats(&self) -> SessionStats;
}

impl SessionStore for SessionTable {
    fn lookup(&self, session_id: &str) -> Result<Lease, SessionError> {
        SessionTable::lookup(self, session_id)
    }
    fn dispatched(&self, lease: &Lease, row: RowId) -> Result<DispatchOutcome, SessionError> {
        SessionTable::dispatched(self, lease, row)
    }
    fn completed(&self, session_id: &str) {
        SessionTable::completed(self, session_id);
    }
    fn invalidate(&self, session_id: &str) -> bool {
        SessionTable::invalidate(self, session_id)
    }
    fn binding(&self, session_id: &str) -> Option<Binding> {
        SessionTable::binding(self, session_id)
    }
    fn stats(&self) -> SessionStats {
        SessionTable::stats(self)
    }
}

/// Counter snapshot, for metrics. Counts are cumulative since construction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SessionStats {
    /// Bindings created from a dispatched row.
    pub created: u64,
    /// Dispatches that matched the existing binding.
    pub kept: u64,
    /// Soft rebinds.
    pub moved: u64,
    /// Dispatches whose lease was older than the binding (compare-and-swap lost).
    pub stale: u64,
    /// Bindings removed because their idle TTL passed.
    pub expired: u64,
    /// Hard-mode dispatches to a row outside the binding.
    pub hard_violations: u64,
    /// Session ids rejected by `lookup` (empty or too long).
    pub rejected_ids: u64,
    /// Bindings removed by [`SessionTable::invalidate`].
    pub invalidated: u64,
    /// Bindings not created because the table was full.
    pub table_full: u64,
}

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

// ---------------------------------------------------------------------------------------------
// Table
// ---------------------------------------------------------------------------------------------

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

    /// Checks the id against the limits of design §5, counting rejections.
    fn validate(&self, session_id: &str) -> Result<(), SessionError> {
        let err = if session_id.is_empty() {
            SessionError::EmptySessionId
        } else if session_id.len() > MAX_SESSION_ID_BYTES {
            SessionError::SessionIdTooLong {
                len: session_id.len(),
                max: MAX_SESSION_ID_BYTES,
                preview: preview(session_id),
            }
        } else {
            return Ok(());
        };
        bump(&self.stats.rejected_ids, 1);
        Err(err)
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
            let expired = match inner.map.get(session_id) {
                None => false,
                Some(e) => e.expired(now, self.ttl),
            };
            if expired {
                // Idle entries have no requests in flight, so the whole entry goes.
                let key = inner.map.remove_entry(session_id).map(|(k, _)| k);
                inner.bound = inner.bound.saturating_sub(1);
                bump(&self.stats.expired, 1);
                (key, None, 0)
            } else {
                match inner.map.get_key_value(session_id) {
                    Some((k, e)) => (Some(Arc::clone(k)), e.binding, e.version),
                    None => (None, None, 0),
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
        if session_id.is_empty() || session_id.len() > MAX_SESSION_ID_BYTES {
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
        if session_id.is_empty() || session_id.len() > MAX_SESSION_ID_BYTES {
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

/// At most [`ID_PREVIEW_BYTES`] of `id`, cut on a character boundary.
fn preview(id: &str) -> String {
    let mut end = ID_PREVIEW_BYTES.min(id.len());
    while !id.is_char_boundary(end) {
        end -= 1;
    }
    id.get(..end).unwrap_or_default().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(10);

    fn row(worker_id: u64, dp_rank: u32) -> RowId {
        RowId { worker_id, dp_rank }
    }

    fn worker(worker_id: u64) -> AffinityTarget {
        AffinityTarget {
            worker_id,
            dp_rank: None,
        }
    }

    fn rank(worker_id: u64, dp_rank: u32) -> AffinityTarget {
        AffinityTarget {
            worker_id,
            dp_rank: Some(dp_rank),
        }
    }

    fn table(mode: BindingMode) -> (SessionTable, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::new(Duration::from_secs(100)));
        let t = SessionTable::new(mode, TTL, DEFAULT_MAX_BINDINGS, clock.clone());
        (t, clock)
    }

    /// lookup + dispatched in one step, for tests that do not care about leases.
    fn send(t: &SessionTable, id: &str, r: RowId) -> Result<DispatchOutcome, SessionError> {
        let lease = t.lookup(id).expect("valid id");
        t.dispatched(&lease, r)
    }

    fn target(t: &SessionTable, id: &str) -> Option<AffinityTarget> {
        t.lookup(id).expect("valid id").target()
    }

    #[test]
    fn binding_is_created_from_the_dispatched_row() {
        let (t, _) = table(BindingMode::Soft);
        let lease = t.lookup("s").unwrap();
        assert_eq!(lease.binding(), None);
        assert_eq!(lease.version(), 0);
        assert_eq!(lease.session_id(), "s");
        // Taking a lease does not count in flight, nor create anything.
        assert_eq!(t.in_flight("s"), 0);
        assert!(t.is_empty());

        assert_eq!(
            t.dispatched(&lease, row(7, 2)),
            Ok(DispatchOutcome::Created)
        );
        assert_eq!(t.len(), 1);
        assert_eq!(t.in_flight("s"), 1);
        let b = t.lookup("s").unwrap().binding().unwrap();
        assert_eq!(b.target, worker(7));
        assert_eq!(b.mode, BindingMode::Soft);
        assert_eq!(t.stats().created, 1);
    }

    #[test]
    fn rank_granularity_creates_rank_bindings() {
        let clock = Arc::new(ManualClock::default());
        let t = SessionTable::new(BindingMode::Soft, TTL, 8, clock)
            .with_granularity(BindingGranularity::Rank);
        assert_eq!(t.granularity(), BindingGranularity::Rank);
        assert_eq!(send(&t, "s", row(7, 2)), Ok(DispatchOutcome::Created));
        assert_eq!(target(&t, "s"), Some(rank(7, 2)));
    }

    #[test]
    fn soft_worker_binding_is_kept_across_ranks_and_moves_worker_level() {
        let (t, _) = table(BindingMode::Soft);
        send(&t, "s", row(1, 0)).unwrap();
        // Another rank of the same worker matches a worker-level binding.
        assert_eq!(send(&t, "s", row(1, 3)), Ok(DispatchOutcome::Kept));
        assert_eq!(
            send(&t, "s", row(2, 5)),
            Ok(DispatchOutcome::Moved {
                from: worker(1),
                to: worker(2)
            })
        );
        assert_eq!(target(&t, "s"), Some(worker(2)));
        assert_eq!(t.in_flight("s"), 3);
        let s = t.stats();
        assert_eq!((s.created, s.kept, s.moved, s.stale), (1, 1, 1, 0));
    }

    #[test]
    fn soft_rank_binding_follows_the_rank() {
        let clock = Arc::new(ManualClock::default());
        let t = SessionTable::new(BindingMode::Soft, TTL, 8, clock)
            .with_granularity(BindingGranularity::Rank);
        send(&t, "s", row(1, 0)).unwrap();
        assert_eq!(send(&t, "s", row(1, 0)), Ok(DispatchOutcome::Kept));
        // Same worker, other rank: a rank binding does not match, it follows the rank.
        assert_eq!(
            send(&t, "s", row(1, 1)),
            Ok(DispatchOutcome::Moved {
                from: rank(1, 0),
                to: rank(1, 1)
            })
        );
        assert_eq!(
            send(&t, "s", row(4, 3)),
            Ok(DispatchOutcome::Moved {
                from: rank(1, 1),
                to: rank(4, 3)
            })
        );
        assert_eq!(target(&t, "s"), Some(rank(4, 3)));
    }

    #[test]
    fn hard_violation_invalidates_and_next_lookup_sees_no_binding() {
        let (t, _) = table(BindingMode::Hard);
        send(&t, "s", row(1, 0)).unwrap();
        t.completed("s");
        // Any rank of the bound worker is fine.
        assert_eq!(send(&t, "s", row(1, 1)), Ok(DispatchOutcome::Kept));
        t.completed("s");

        let lease = t.lookup("s").unwrap();
        assert_eq!(lease.binding().unwrap().mode, BindingMode::Hard);
        let err = t.dispatched(&lease, row(2, 0)).unwrap_err();
        assert_eq!(
            err,
            SessionError::HardAffinityViolated {
                session_id: "s".into(),
                bound: worker(1),
                dispatched: row(2, 0),
            }
        );
        let msg = err.to_string();
        assert!(msg.contains("worker 1 (any rank)"), "{msg}");
        assert!(msg.contains("worker 2 rank 0"), "{msg}");
        assert_eq!(t.lookup("s").unwrap().binding(), None);
        assert!(t.is_empty());
        assert_eq!(t.in_flight("s"), 0, "a violating dispatch is not counted");
        assert_eq!(t.stats().hard_violations, 1);

        // Single retry: normal selection, and the next dispatch binds afresh.
        assert_eq!(send(&t, "s", row(2, 0)), Ok(DispatchOutcome::Created));
        assert_eq!(target(&t, "s"), Some(worker(2)));
    }

    #[test]
    fn invalidate_removes_binding_and_keeps_counting_in_flight() {
        let (t, clock) = table(BindingMode::Hard);
        send(&t, "s", row(1, 0)).unwrap();
        assert!(t.invalidate("s"));
        assert!(!t.invalidate("s"));
        assert!(!t.invalidate("unknown"));
        assert_eq!(t.lookup("s").unwrap().binding(), None);
        assert_eq!(t.len(), 0);
        assert_eq!(t.in_flight("s"), 1);

        // New binding while the old request still runs: it must not go idle when one completes.
        assert_eq!(send(&t, "s", row(2, 0)), Ok(DispatchOutcome::Created));
        assert_eq!(t.in_flight("s"), 2);
        t.completed("s");
        clock.advance(TTL * 5);
        assert_eq!(target(&t, "s"), Some(worker(2)));
        t.completed("s");
        assert_eq!(t.in_flight("s"), 0);
        t.completed("s"); // stray: ignored, no underflow
        assert_eq!(t.in_flight("s"), 0);
        assert_eq!(t.stats().invalidated, 1);
    }

    #[test]
    fn ttl_restarts_at_the_last_completion_not_the_first() {
        let (t, clock) = table(BindingMode::Soft);
        send(&t, "s", row(1, 0)).unwrap();
        send(&t, "s", row(1, 0)).unwrap();
        clock.advance(Duration::from_secs(5));
        t.completed("s"); // first of two: session still busy
        clock.advance(Duration::from_secs(20)); // 20 s > TTL after the first completion
        assert_eq!(target(&t, "s"), Some(worker(1)));
        t.completed("s"); // last: idle from here
        clock.advance(TTL);
        // Boundary: at exactly last_completion + ttl the binding is still alive.
        assert_eq!(target(&t, "s"), Some(worker(1)));
        clock.advance(Duration::from_nanos(1));
        assert_eq!(t.binding("s"), None);
        assert_eq!(t.len(), 1, "expiry is lazy until lookup");
        assert_eq!(t.lookup("s").unwrap().binding(), None);
        assert_eq!(t.len(), 0);
        assert_eq!(t.stats().expired, 1);
    }

    #[test]
    fn new_dispatch_after_idle_cancels_expiry() {
        let (t, clock) = table(BindingMode::Soft);
        send(&t, "s", row(1, 0)).unwrap();
        t.completed("s");
        clock.advance(TTL);
        assert_eq!(send(&t, "s", row(1, 0)), Ok(DispatchOutcome::Kept));
        clock.advance(TTL * 3);
        assert_eq!(target(&t, "s"), Some(worker(1)));
    }

    #[test]
    fn binding_with_requests_in_flight_never_expires() {
        let (t, clock) = table(BindingMode::Soft);
        send(&t, "s", row(3, 0)).unwrap();
        clock.advance(TTL * 1000);
        assert_eq!(t.purge_expired(), 0);
        assert_eq!(target(&t, "s"), Some(worker(3)));
        assert_eq!(t.stats().expired, 0);
    }

    #[test]
    fn binding_expired_while_request_was_queued_is_recreated() {
        let (t, clock) = table(BindingMode::Hard);
        send(&t, "s", row(1, 0)).unwrap();
        t.completed("s");
        let lease = t.lookup("s").unwrap();
        assert_eq!(lease.target(), Some(worker(1)));
        clock.advance(TTL * 2);
        // The binding the lease saw is gone: no hard violation, a fresh binding.
        assert_eq!(
            t.dispatched(&lease, row(2, 0)),
            Ok(DispatchOutcome::Created)
        );
        assert_eq!(target(&t, "s"), Some(worker(2)));
        assert_eq!(t.stats().expired, 1);
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn older_lease_cannot_overwrite_a_newer_rebind() {
        let (t, _) = table(BindingMode::Soft);
        send(&t, "s", row(1, 0)).unwrap(); // A
        let l1 = t.lookup("s").unwrap();
        let l2 = t.lookup("s").unwrap();
        assert_eq!(l1.version(), l2.version());
        assert_eq!(
            t.dispatched(&l2, row(2, 0)),
            Ok(DispatchOutcome::Moved {
                from: worker(1),
                to: worker(2)
            })
        );
        assert_eq!(t.dispatched(&l1, row(3, 0)), Ok(DispatchOutcome::Stale));
        assert_eq!(target(&t, "s"), Some(worker(2)));
        // The stale request still counts in flight.
        assert_eq!(t.in_flight("s"), 3);
        // A stale lease whose row happens to match the current binding is simply kept.
        assert_eq!(t.dispatched(&l1, row(2, 1)), Ok(DispatchOutcome::Kept));
        assert_eq!(t.stats().stale, 1);
    }

    #[test]
    fn two_first_requests_race_and_the_later_does_not_overwrite() {
        for mode in [BindingMode::Soft, BindingMode::Hard] {
            let (t, _) = table(mode);
            let l1 = t.lookup("s").unwrap();
            let l2 = t.lookup("s").unwrap();
            assert_eq!(t.dispatched(&l2, row(2, 0)), Ok(DispatchOutcome::Created));
            // Hard mode too: l1 was routed before any binding existed, so it is not a violation.
            assert_eq!(t.dispatched(&l1, row(3, 0)), Ok(DispatchOutcome::Stale));
            assert_eq!(target(&t, "s"), Some(worker(2)), "{mode}");
            assert_eq!(t.in_flight("s"), 2);
        }
    }

    #[test]
    fn session_id_length_is_capped() {
        let (t, _) = table(BindingMode::Soft);
        let ok = "a".repeat(MAX_SESSION_ID_BYTES);
        assert!(t.lookup(&ok).is_ok());

        let over = "a".repeat(MAX_SESSION_ID_BYTES + 1);
        match t.lookup(&over) {
            Err(SessionError::SessionIdTooLong { len, max, .. }) => {
                assert_eq!((len, max), (257, 256));
            }
            other => panic!("expected SessionIdTooLong, got {other:?}"),
        }

        let huge = "x".repeat(10 * 1024);
        let err = t.lookup(&huge).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("10240"), "{msg}");
        assert!(msg.contains("256"), "{msg}");
        assert!(
            msg.len() < 200,
            "message echoes the id: {} bytes",
            msg.len()
        );

        // Multi-byte characters: the preview is cut on a character boundary.
        let wide = "é".repeat(200); // 400 bytes
        match t.lookup(&wide) {
            Err(SessionError::SessionIdTooLong { len, preview, .. }) => {
                assert_eq!(len, 400);
                assert!(preview.len() <= ID_PREVIEW_BYTES);
                assert!(preview.chars().all(|c| c == 'é'));
            }
            other => panic!("expected SessionIdTooLong, got {other:?}"),
        }

        assert_eq!(t.lookup(""), Err(SessionError::EmptySessionId));
        assert_eq!(t.stats().rejected_ids, 4);
        // Invalid ids are harmless elsewhere.
        t.completed(&huge);
        assert!(!t.invalidate(""));
        assert!(t.is_empty());
    }

    #[test]
    fn full_table_errors_then_evicts_expired_bindings_to_make_room() {
        let clock = Arc::new(ManualClock::default());
        let t = SessionTable::new(BindingMode::Soft, TTL, 3, clock.clone());
        for id in ["a", "b"] {
            send(&t, id, row(1, 0)).unwrap();
            t.completed(id);
        }
        send(&t, "busy", row(2, 0)).unwrap(); // in flight: never evicted
        clock.advance(TTL / 2);

        let err = send(&t, "c", row(1, 0)).unwrap_err();
        assert_eq!(err, SessionError::TableFull { max: 3 });
        assert!(err.to_string().contains('3'));
        assert_eq!(t.in_flight("c"), 0);
        // Existing sessions still work when full.
        assert_eq!(send(&t, "a", row(1, 0)), Ok(DispatchOutcome::Kept));
        t.completed("a");

        clock.advance(TTL + Duration::from_secs(1)); // "a" and "b" now idle past their TTL
        assert_eq!(send(&t, "c", row(1, 0)), Ok(DispatchOutcome::Created));
        assert_eq!(t.len(), 2);
        assert_eq!(target(&t, "busy"), Some(worker(2)));
        assert_eq!(target(&t, "a"), None);
        let s = t.stats();
        assert_eq!((s.table_full, s.expired), (1, 2));
    }

    #[test]
    fn zero_capacity_never_binds() {
        let clock = Arc::new(ManualClock::default());
        let t = SessionTable::new(BindingMode::Soft, TTL, 0, clock);
        assert_eq!(
            send(&t, "s", row(1, 0)),
            Err(SessionError::TableFull { max: 0 })
        );
        t.completed("s");
        assert!(t.is_empty());
    }

    #[test]
    fn manual_clock_set_and_advance() {
        let c = ManualClock::new(Duration::from_secs(1));
        c.advance(Duration::from_millis(500));
        assert_eq!(c.now(), Duration::from_millis(1500));
        c.set(Duration::from_secs(7));
        assert_eq!(c.now(), Duration::from_secs(7));
        c.advance(Duration::MAX);
        assert_eq!(c.now(), Duration::from_nanos(u64::MAX));
        let s = SystemClock::new();
        assert!(s.now() <= s.now());
    }

    #[test]
    fn concurrent_use_keeps_in_flight_counts_consistent() {
        const THREADS: u64 = 8;
        const ITERS: u64 = 1000;
        const SESSIONS: u64 = 13;
        let clock = Arc::new(ManualClock::default());
        let t = Arc::new(SessionTable::new(
            BindingMode::Soft,
            Duration::from_millis(50),
            DEFAULT_MAX_BINDINGS,
            clock.clone(),
        ));
        let ids: Arc<Vec<String>> = Arc::new((0..SESSIONS).map(|i| format!("s{i}")).collect());
        let handles: Vec<_> = (0..THREADS)
            .map(|th| {
                let t = Arc::clone(&t);
                let ids = Arc::clone(&ids);
                let clock = Arc::clone(&clock);
                std::thread::spawn(move || {
                    let mut ok = 0u64;
                    let mut held: Vec<&str> = Vec::new();
                    for i in 0..ITERS {
                        let id = ids[((th * 7 + i) % SESSIONS) as usize].as_str();
                        let lease = t.lookup(id).expect("valid id");
                        let r = row((th + i) % 4, (i % 2) as u32);
                        if t.dispatched(&lease, r).is_ok() {
                            ok += 1;
                            held.push(id);
                        }
                        // Keep up to 3 requests in flight per thread, completing oldest first.
                        if held.len() > 3 {
                            t.completed(held.remove(0));
                        }
                        if i % 97 == 0 {
                            t.invalidate(id);
                        }
                        if i % 10 == 0 {
                            clock.advance(Duration::from_millis(7));
                        }
                    }
                    for id in held {
                        t.completed(id);
                    }
                    ok
                })
            })
            .collect();
        let dispatched: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(dispatched, THREADS * ITERS, "soft mode never errors here");
        for id in ids.iter() {
            assert_eq!(t.in_flight(id), 0, "{id}");
        }
        let s = t.stats();
        assert_eq!(s.created + s.kept + s.moved + s.stale, dispatched);
        assert!(t.len() <= SESSIONS as usize);
        clock.advance(Duration::from_secs(1));
        t.purge_expired();
        assert!(t.is_empty());
    }
}
