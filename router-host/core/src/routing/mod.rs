//! The routing core: one value shared by every routing thread through `&self`.
//!
//! A request reads top to bottom through [`RoutingCore::route`] (or [`RoutingCore::submit`]
//! with admission):
//!
//! 1. load the current [`Topology`] snapshot (no lock);
//! 2. session lookup: take a lease, turn a soft binding into the advisory target and a hard one
//!    into a pin (`plan`);
//! 3. admission, for requests with a policy class (`try_admit`, [`crate::admission`]);
//! 4. the [`Selector`] decides over the eligible rows, reading load from the [`crate::ledger::Ledger`] and
//!    overlap from the request's blocks in the [`KvIndex`] (or from a caller's source);
//! 5. dispatch: book the row in the ledger and record the booking, update the session binding,
//!    tell the deciding instance (`dispatch`).
//!
//! [`RoutingCore::complete`] / [`RoutingCore::finish`] release exactly what the booking added.
//! The contract each step implements is `docs/routing-contract.md`.
//!
//! Locks, all short and never held across a policy call: the topology writer (membership
//! changes and observations), one mutex per in-flight shard (every book and release happens
//! under its request's shard; `remove_worker` holds all of them while it clears a removed
//! worker's slots, so a slot is never reset or reused under a booking), the queue mutex, and the
//! KV index's sharded read-write lock (read per decision, written per event batch; events resolve their slot
//! under it, so none lands on a slot being cleared).

mod dispatch;
mod queue;
mod signals;
mod workers;

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crossbeam_utils::sync::{ShardedLock, ShardedLockReadGuard, ShardedLockWriteGuard};
use crossbeam_utils::CachePadded;
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::admission::{AdmissionStats, ClassSpec, Lanes};
use crate::eligibility::EligibilityError;
use crate::fast_hash::FastMap;
use crate::kv_index::KvIndex;
use crate::ledger::Charge;
use crate::model::{Cluster, RowId, RowLoad};
use crate::select::{Decision, InstanceId, SelectError, Selector};
use crate::sessions::{Clock, DispatchOutcome, SessionError, SessionStore, SystemClock};
use crate::topology::{Slot, SlotAllocator, Topology};

pub use dispatch::Submitted;
pub use queue::Drained;
pub use signals::{IndexOverlap, OverlapBuffers};
pub use workers::RemovedWorker;

/// Identifies a dispatched request until it completes: the caller's id, or one the core drew.
pub type RequestId = u64;

/// Why a request was not routed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RouteError {
    #[error(transparent)]
    Select(#[from] SelectError),
    #[error("session: {0}")]
    Session(#[from] SessionError),
    #[error("unknown policy class `{name}`; defined classes: {}", if .defined.is_empty() { "none".to_string() } else { .defined.join(", ") })]
    UnknownClass { name: String, defined: Vec<String> },
    #[error("request id {0} is already in flight")]
    DuplicateRequestId(RequestId),
    #[error(
        "worker {worker_id} was removed while the request was being decided; nothing was booked"
    )]
    WorkerRemoved { worker_id: u64 },
    #[error("waited {waited_ms} ms in the queue of policy class `{class}`, over its max_wait of {max_wait_ms} ms; nothing was booked")]
    QueueTimeout {
        class: String,
        waited_ms: u64,
        max_wait_ms: u64,
    },
    #[error("cancelled while queued; nothing was booked")]
    Cancelled,
}

impl From<EligibilityError> for RouteError {
    fn from(err: EligibilityError) -> Self {
        RouteError::Select(SelectError::Eligibility(err))
    }
}

/// A dispatched request.
#[derive(Debug, Clone, PartialEq)]
pub struct Routed {
    pub id: RequestId,
    pub decision: Decision,
    /// What happened to the session binding (when affinity is on and the request has a session).
    pub session: Option<SessionOutcome>,
    /// How long the request waited in an admission queue (zero when dispatched at once).
    pub queued_for: Duration,
}

/// The binding side of a dispatch.
#[derive(Debug, Clone, PartialEq)]
pub enum SessionOutcome {
    Dispatched(DispatchOutcome),
    /// Hard mode: the bound row was gone; the binding was invalidated and selection ran once
    /// without it.
    HardBindingGone,
    /// The binding could not be honoured or recorded (e.g. table full); routed without it.
    NotRecorded(SessionError),
}

/// How the core is set up; built by the caller from its configuration.
#[derive(Clone, Default)]
pub struct CoreSettings {
    /// Session bindings, when affinity is on.
    pub sessions: Option<Arc<dyn SessionStore>>,
    /// Policy classes, in configuration order; requests without a class use the one named
    /// `default`, if any.
    pub classes: Vec<ClassSpec>,
    /// Session TTLs and queue waits; the wall clock when `None`.
    pub clock: Option<Arc<dyn Clock>>,
}

/// What one dispatched request holds until it completes.
#[derive(Debug, Clone)]
struct Booking {
    row: RowId,
    slot: Slot,
    /// The instance configured for the request (told about dispatch and completion).
    instance: InstanceId,
    charge: Charge,
    session: Option<Arc<str>>,
    /// Whether the session store counts this request in flight (release it on completion).
    holds_lease: bool,
}

const SHARDS: usize = 16;

/// See the module docs.
pub struct RoutingCore {
    selector: Arc<dyn Selector>,
    topology: ArcSwap<Topology>,
    writer: Mutex<SlotAllocator>,
    /// Sharded: a read lock touches only the reading thread's shard, so concurrent decisions do
    /// not bounce one lock word between cores (writes, per event batch, take every shard).
    kv: ShardedLock<KvIndex>,
    sessions: Option<Arc<dyn SessionStore>>,
    classes: Vec<ClassSpec>,
    queues: Mutex<Lanes>,
    drainer: Mutex<()>,
    drain_requested: std::sync::atomic::AtomicBool,
    /// Keyed by request id with the fixed multiplicative hash: ids are the caller's, but a
    /// collision only costs a probe (the table is per shard and bounded by requests in flight).
    /// Each shard on its own cache lines, so threads working on different shards never share one.
    inflight: [CachePadded<Mutex<FastMap<RequestId, Booking>>>; SHARDS],
    /// The generation of the current topology snapshot (`workers.rs` `publish`): a booking
    /// checks it with one plain load instead of taking a second snapshot guard.
    generation: AtomicU64,
    /// Per shard: the next id the core draws for requests without one (see `draw_id`).
    next_ids: [CachePadded<AtomicU64>; SHARDS],
    clock: Arc<dyn Clock>,
}

// Every guarded value here stays consistent even if a thread panicked while holding the lock
// (each critical section is a single insert, remove or counter update), so poisoning is ignored.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
fn read<T>(m: &ShardedLock<T>) -> ShardedLockReadGuard<'_, T> {
    m.read().unwrap_or_else(PoisonError::into_inner)
}
fn write<T>(m: &ShardedLock<T>) -> ShardedLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(PoisonError::into_inner)
}

impl RoutingCore {
    pub fn new(selector: Arc<dyn Selector>, cluster: Cluster, settings: CoreSettings) -> Self {
        let mut alloc = SlotAllocator::default();
        let topology = alloc.initial(cluster);
        let kv = KvIndex::new(topology.slot_bound());
        RoutingCore {
            selector,
            topology: ArcSwap::from_pointee(topology),
            writer: Mutex::new(alloc),
            kv: ShardedLock::new(kv),
            sessions: settings.sessions,
            classes: settings.classes,
            queues: Mutex::new(Lanes::default()),
            drainer: Mutex::new(()),
            drain_requested: std::sync::atomic::AtomicBool::new(false),
            inflight: std::array::from_fn(|_| CachePadded::new(Mutex::new(FastMap::default()))),
            generation: AtomicU64::new(0),
            next_ids: std::array::from_fn(|_| CachePadded::new(AtomicU64::new(0))),
            clock: settings.clock.unwrap_or_else(|| Arc::new(SystemClock)),
        }
    }

    /// The current cluster and slots (a snapshot: later changes do not show in it).
    pub fn topology(&self) -> Arc<Topology> {
        self.topology.load_full()
    }

    pub fn selector(&self) -> &Arc<dyn Selector> {
        &self.selector
    }

    pub fn sessions(&self) -> Option<&Arc<dyn SessionStore>> {
        self.sessions.as_ref()
    }

    pub fn classes(&self) -> &[ClassSpec] {
        &self.classes
    }

    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// The load of `row` as policies see it (idle for a row that is not registered).
    pub fn load(&self, row: RowId) -> RowLoad {
        let topology = self.topology.load();
        topology
            .slot(row)
            .map_or_else(RowLoad::default, |s| topology.ledger().load(s))
    }

    /// The booked load of `row`, without observed corrections.
    pub fn booked(&self, row: RowId) -> RowLoad {
        let topology = self.topology.load();
        topology
            .slot(row)
            .map_or_else(RowLoad::default, |s| topology.ledger().booked(s))
    }

    /// Report the active requests observed on `row` (engine metrics), or `None` to forget them.
    /// Returns whether the row is registered. See [`crate::ledger::Ledger::observe`] for the rule.
    pub fn observe_load(&self, row: RowId, active_requests: Option<u64>) -> bool {
        // Under the writer lock: a removed worker's slot is never observed after its reset.
        let _w = lock(&self.writer);
        let topology = self.topology.load();
        match topology.slot(row) {
            Some(slot) => {
                topology.ledger().observe(slot, active_requests);
                true
            }
            None => false,
        }
    }

    /// Requests dispatched and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.inflight.iter().map(|s| lock(s).len()).sum()
    }

    pub fn admission_stats(&self) -> AdmissionStats {
        lock(&self.queues).stats
    }

    /// Read access to the KV-overlap index (rows are slots).
    pub fn kv_index(&self) -> ShardedLockReadGuard<'_, KvIndex> {
        read(&self.kv)
    }

    /// The in-flight shard of request `id`: `id % SHARDS` (caller ids spread over the shards
    /// as they come; drawn ids land in the drawing thread's own shard).
    fn shard(&self, id: RequestId) -> &Mutex<FastMap<RequestId, Booking>> {
        &self.inflight[(id % SHARDS as u64) as usize]
    }

    /// An id for a request that brought none: `n * SHARDS + s`, from the counter of this
    /// thread's shard `s`, so a thread's bookings stay in memory its own core last touched and
    /// the counters are not shared between threads.
    fn draw_id(&self) -> RequestId {
        let s = crate::striped::thread_stripe() % SHARDS;
        let n = self.next_ids[s].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        n.wrapping_mul(SHARDS as u64).wrapping_add(s as u64)
    }
}

impl std::fmt::Debug for RoutingCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoutingCore")
            .field("cluster", self.topology.load().cluster())
            .field("in_flight", &self.in_flight())
            .field("admission", &self.admission_stats())
            .finish_non_exhaustive()
    }
}
