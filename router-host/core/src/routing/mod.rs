//! The routing core: one value shared by every routing thread through `&self`.
//!
//! A request reads top to bottom through [`RoutingCore::route`] (or [`RoutingCore::submit`]
//! with admission):
//!
//! 1. take the current [`Topology`] snapshot (no lock; a thread reuses its last one while it is
//!    current, `dispatch.rs` `with_topology`);
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
//! changes and observations), one mutex per in-flight shard, the caller-id directory's shards,
//! the queue mutex, and the KV index's sharded read-write lock (read per decision, written per
//! event batch; events resolve their slot under it, so none lands on a slot being cleared).
//!
//! In-flight shards own slots: slot `s` belongs to shard `s % SHARDS`, and every booking and
//! release of a slot happens under its shard's lock. So one slot's ledger cell has one writer at
//! a time and needs no locked instruction (`crate::ledger`), and `remove_worker`, holding every
//! shard, never has a slot reset or reused under a booking. An id the core draws names its
//! shard (`draw_id`); a caller's id is found through the directory. Lock order: directory
//! shard, then in-flight shard.

mod dispatch;
mod held;
mod queue;
mod signals;
mod workers;

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crossbeam_utils::sync::{ShardedLock, ShardedLockReadGuard, ShardedLockWriteGuard};
use crossbeam_utils::CachePadded;
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::admission::{AdmissionStats, ClassSpec, EngineSignals, Lanes, DEFAULT_MAX_QUEUED};
use crate::fast_hash::FastMap;
use crate::kv_index::trust::RowTrust;
use crate::kv_index::KvIndex;
use crate::ledger::{Charge, DecodeBooking, Ledger};
use crate::model::{Cluster, RowId, RowLoad};
use crate::recency::Recency;
use crate::select::{InstanceId, Selector};
use crate::sessions::{Clock, SessionStore, SystemClock};
use crate::topology::{Slot, SlotAllocator, Topology};
use held::HeldBlocks;

pub use crate::routed::{RequestId, RouteError, Routed, SessionOutcome, DRAWN_ID_BIT, ID_TAG_BITS};
pub use dispatch::{OwedHook, Submitted};
pub use queue::Drained;
pub use signals::{IndexOverlap, OverlapBuffers};
pub use workers::RemovedWorker;

/// Where the replica tag sits in a drawn id.
const ID_TAG_SHIFT: u32 = 63 - ID_TAG_BITS;

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
    /// This process's replica tag, put into every id the core draws (bits 47..63, see
    /// [`ID_TAG_BITS`]) so that replicas sharing session bindings never hand plugins the same
    /// id; 0 for a single router (docs/routing-contract.md §3).
    pub id_tag: u16,
    /// How long one queued request's re-evaluation may hold its lane before the lane moves on
    /// without it (its policy call is taken to be hung); [`DEFAULT_DRAIN_STALL`] when `None`.
    /// Set it to the longest time after which the caller's watchdog declares a call hung.
    pub drain_stall: Option<Duration>,
    /// How prompts are booked as KV blocks (`decode_blocks`, docs/routing-contract.md §7).
    pub decode_booking: DecodeBooking,
    /// How many requests the admission queues hold together ([`DEFAULT_MAX_QUEUED`] when
    /// `None`); past it the lowest priority is shed (docs/routing-contract.md §8).
    pub max_queued: Option<usize>,
    /// The window of the `kv_recent_device_blocks` column (`crate::recency`); `None`: not
    /// tracked, and the column is not sent.
    pub recent_window: Option<Duration>,
}

/// The watchdog's default hang limit (router-host's `hang_after_ms`).
pub const DEFAULT_DRAIN_STALL: Duration = Duration::from_secs(1);

/// What one dispatched request holds until it completes.
#[derive(Debug, Clone)]
struct Booking {
    row: RowId,
    slot: Slot,
    /// The instance configured for the request (told about dispatch and completion).
    instance: InstanceId,
    /// What releasing it gives back; for [`DecodeBooking::Deduplicated`] `decode_blocks` is
    /// only the part its block ids do not name, the rest being what its held ids free.
    charge: Charge,
    session: Option<Arc<str>>,
    /// Whether the session store counts this request in flight (release it on completion).
    holds_lease: bool,
}

const SHARD_BITS: u32 = 4;
const SHARDS: usize = 1 << SHARD_BITS;

/// One in-flight shard: the bookings on the slots it owns, and how many ids it has drawn.
#[derive(Debug, Default)]
struct Shard {
    bookings: FastMap<RequestId, Booking>,
    /// The prompt blocks held on the shard's slots ([`DecodeBooking::Deduplicated`] only).
    held: HeldBlocks,
    drawn: u64,
    /// The replica tag, already shifted into place (the same in every shard).
    tag: u64,
}

/// The in-flight shard that owns `slot`.
fn shard_of_slot(slot: Slot) -> usize {
    slot as usize % SHARDS
}

/// See the module docs.
pub struct RoutingCore {
    selector: Arc<dyn Selector>,
    topology: ArcSwap<Topology>,
    /// Booked load by slot; never replaced (it grows in place), so a release needs no snapshot.
    ledger: Ledger,
    writer: Mutex<SlotAllocator>,
    /// Sharded: a read lock touches only the reading thread's shard, so concurrent decisions do
    /// not bounce one lock word between cores (writes, per event batch, take every shard).
    kv: ShardedLock<KvIndex>,
    /// Per slot, how far its KV index can be trusted: read by decisions without a lock,
    /// written by the row's event feeder (`workers.rs` `set_kv_index_state`).
    trust: RowTrust,
    /// How many slots of `trust` are not current: while none is, a decision sends the
    /// `kv_index_state` column as zeros without reading every slot.
    not_current: signals::NotCurrent,
    sessions: Option<Arc<dyn SessionStore>>,
    classes: Vec<ClassSpec>,
    queues: Mutex<Lanes>,
    /// Bookings, sharded by slot (module docs), keyed by request id with the fixed
    /// multiplicative hash: a caller's ids can collide, but that only costs a probe (the table
    /// is bounded by requests in flight). Each shard on its own cache lines, so threads working
    /// on different shards never share one.
    inflight: [CachePadded<Mutex<Shard>>; SHARDS],
    /// For callers' ids in flight: the in-flight shard holding each (sharded by id).
    callers: [CachePadded<Mutex<FastMap<RequestId, u8>>>; SHARDS],
    /// The generation of the current topology snapshot (`workers.rs` `publish`): a thread checks
    /// its cached snapshot, and a booking its decision's, with one plain load.
    generation: AtomicU64,
    clock: Arc<dyn Clock>,
    decode_booking: DecodeBooking,
    /// What each row's engine last reported about its saturation (`observe_engine`); read only
    /// by classes that set engine limits. Holds registered rows only.
    engine: std::sync::RwLock<FastMap<RowId, EngineSignals>>,
    /// What each row's requests used lately (`kv_recent_device_blocks`), when the window is on.
    recency: Option<Recency>,
}

/// Topology publications, numbered across the process so that a thread's cached snapshot can
/// never be taken for another core's.
static PUBLICATIONS: AtomicU64 = AtomicU64::new(0);

fn next_generation() -> u64 {
    PUBLICATIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1
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
        let topology = alloc.initial(cluster).published_as(next_generation());
        let generation = topology.generation();
        let kv = KvIndex::new(topology.slot_bound());
        let topology_slots = topology.slot_bound();
        RoutingCore {
            selector,
            ledger: Ledger::with_slots(topology.slot_bound()),
            topology: ArcSwap::from_pointee(topology),
            writer: Mutex::new(alloc),
            kv: ShardedLock::new(kv),
            trust: RowTrust::with_slots(topology_slots),
            not_current: signals::NotCurrent::default(),
            sessions: settings.sessions,
            classes: settings.classes,
            queues: Mutex::new(Lanes::new(
                settings.drain_stall.unwrap_or(DEFAULT_DRAIN_STALL),
                settings.max_queued.unwrap_or(DEFAULT_MAX_QUEUED).max(1),
            )),
            inflight: std::array::from_fn(|_| {
                CachePadded::new(Mutex::new(Shard {
                    tag: u64::from(settings.id_tag) << ID_TAG_SHIFT,
                    ..Shard::default()
                }))
            }),
            callers: std::array::from_fn(|_| CachePadded::new(Mutex::new(FastMap::default()))),
            generation: AtomicU64::new(generation),
            clock: settings.clock.unwrap_or_else(|| Arc::new(SystemClock)),
            decode_booking: settings.decode_booking,
            engine: std::sync::RwLock::new(FastMap::default()),
            recency: settings.recent_window.map(Recency::new),
        }
    }

    /// Report what `row`'s engine says about its saturation (waiting requests, KV-cache usage);
    /// all `None` forgets it. Returns whether the row is registered (others are not kept).
    pub fn observe_engine(&self, row: RowId, signals: EngineSignals) -> bool {
        let topology = self.topology.load();
        let registered = topology.slot(row).is_some();
        let mut engine = self.engine.write().unwrap_or_else(PoisonError::into_inner);
        if !registered || signals == EngineSignals::default() {
            engine.remove(&row);
        } else {
            engine.insert(row, signals);
        }
        // Rows removed since are dropped here, so the table never outgrows the topology.
        if engine.len() > topology.slot_bound() {
            engine.retain(|row, _| topology.slot(*row).is_some());
        }
        registered
    }

    /// What `row`'s engine last reported (all unknown when nothing was).
    pub fn engine_signals(&self, row: RowId) -> EngineSignals {
        self.engine
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&row)
            .copied()
            .unwrap_or_default()
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
        self.topology
            .load()
            .slot(row)
            .map_or_else(RowLoad::default, |s| self.ledger.load(s))
    }

    /// The booked load of `row`, without observed corrections.
    pub fn booked(&self, row: RowId) -> RowLoad {
        self.topology
            .load()
            .slot(row)
            .map_or_else(RowLoad::default, |s| self.ledger.booked(s))
    }

    /// The distinct prompt blocks this core's requests in flight on `row` hold, into `out`
    /// (cleared first): what its booked `decode_blocks` counts under
    /// [`DecodeBooking::Deduplicated`] besides blocks without ids; nothing under
    /// [`DecodeBooking::Prompt`]. For replicas that share their load and must count a block
    /// that several of them hold once (docs/replicas.md, "Shared load"). Off the request path:
    /// a copy under the shard's lock.
    pub fn held_blocks_of(&self, row: RowId, out: &mut Vec<u64>) {
        out.clear();
        if let Some(slot) = self.topology.load().slot(row) {
            lock(&self.inflight[shard_of_slot(slot)])
                .held
                .ids_into(slot, out);
        }
    }

    /// Report the active requests observed on `row` (engine metrics), or `None` to forget them.
    /// Returns whether the row is registered. See [`crate::ledger::Ledger::observe`] for the rule.
    pub fn observe_load(&self, row: RowId, active_requests: Option<u64>) -> bool {
        // Under the writer lock: a removed worker's slot is never observed after its reset.
        let _w = lock(&self.writer);
        match self.topology.load().slot(row) {
            Some(slot) => {
                self.ledger.observe(slot, active_requests);
                true
            }
            None => false,
        }
    }

    /// Set the load other replicas booked on each registered row (`load_of` answers per row;
    /// `None`: none), replacing what was set before. Every read of a row's load (policies,
    /// admission) adds it to this core's own bookings; what this core books stays apart
    /// ([`RoutingCore::booked`]). docs/replicas.md, "Shared load".
    pub fn set_shared_load(&self, load_of: impl Fn(RowId) -> Option<RowLoad>) {
        // Under the writer lock: a removed worker's slot is never written after its reset.
        let _w = lock(&self.writer);
        for (row, slot) in self.topology.load().rows() {
            self.ledger.set_shared(slot, load_of(row));
        }
    }

    /// The load other replicas booked on `row`, as last set by
    /// [`RoutingCore::set_shared_load`].
    pub fn shared_load(&self, row: RowId) -> RowLoad {
        self.topology
            .load()
            .slot(row)
            .map_or_else(RowLoad::default, |s| self.ledger.shared(s))
    }

    /// Requests dispatched and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.inflight.iter().map(|s| lock(s).bookings.len()).sum()
    }

    /// Distinct prompt blocks held by requests in flight, summed over rows, and the requests
    /// holding them (always 0 unless [`DecodeBooking::Deduplicated`]); for invariant checks:
    /// both 0 once nothing is in flight.
    pub fn held_blocks(&self) -> (usize, usize) {
        self.inflight
            .iter()
            .map(|s| lock(s).held.totals())
            .fold((0, 0), |(b, r), (sb, sr)| (b + sb, r + sr))
    }

    pub fn admission_stats(&self) -> AdmissionStats {
        lock(&self.queues).stats
    }

    /// Set `slot`'s index state, keeping the count of slots not current.
    fn set_trust(
        &self,
        slot: crate::topology::Slot,
        state: plugin_api::KvIndexState,
    ) -> plugin_api::KvIndexState {
        let before = self.trust.set(slot, state);
        self.not_current.changed(before, state);
        before
    }

    /// Read access to the KV-overlap index (rows are slots).
    pub fn kv_index(&self) -> ShardedLockReadGuard<'_, KvIndex> {
        read(&self.kv)
    }

    /// The directory shard for a caller's id.
    fn callers_of(&self, id: RequestId) -> &Mutex<FastMap<RequestId, u8>> {
        &self.callers[(id % SHARDS as u64) as usize]
    }

    /// The id of the `n`th request shard `shard` draws: `DRAWN_ID_BIT | tag << 47 |
    /// n << SHARD_BITS | shard` (`n` modulo 2^43), so the id names its shard, never collides
    /// with a caller's, and never with another replica's (distinct tags). Drawn under the
    /// shard's lock: the count is a plain field, with no shared counter to bounce.
    fn draw_id(shard: &mut Shard, index: usize) -> RequestId {
        const COUNTER: u64 = ((1 << ID_TAG_SHIFT) - 1) & !((1 << SHARD_BITS) - 1);
        let n = shard.drawn;
        shard.drawn = shard.drawn.wrapping_add(1);
        DRAWN_ID_BIT | shard.tag | ((n << SHARD_BITS) & COUNTER) | index as u64
    }

    /// The in-flight shard holding request `id`, if it is in flight.
    fn shard_of_request(&self, id: RequestId) -> Option<usize> {
        if id & DRAWN_ID_BIT != 0 {
            Some((id % SHARDS as u64) as usize)
        } else {
            lock(self.callers_of(id)).get(&id).map(|&s| usize::from(s))
        }
    }

    /// Run `f` on request `id`'s booking under its shard's lock (`None`: not in flight).
    fn with_booking<R>(&self, id: RequestId, f: impl FnOnce(&mut Booking) -> R) -> Option<R> {
        let shard = self.shard_of_request(id)?;
        lock(&self.inflight[shard]).bookings.get_mut(&id).map(f)
    }

    /// Remove request `id`'s booking and release its load, under its shard's lock (and, for a
    /// caller's id, its directory shard's, so the id is free again only once released).
    fn take_booking(&self, id: RequestId) -> Option<Booking> {
        let release = |shard: &mut Shard| {
            let booking = shard.bookings.remove(&id)?;
            let mut charge = booking.charge;
            if self.decode_booking == DecodeBooking::Deduplicated {
                let freed = shard.held.release(id, booking.slot);
                charge.decode_blocks = charge.decode_blocks.saturating_add(freed);
            }
            self.ledger.release(booking.slot, charge);
            Some(booking)
        };
        if id & DRAWN_ID_BIT != 0 {
            return release(&mut lock(&self.inflight[(id % SHARDS as u64) as usize]));
        }
        let mut directory = lock(self.callers_of(id));
        let shard = usize::from(directory.remove(&id)?);
        release(&mut lock(&self.inflight[shard]))
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
