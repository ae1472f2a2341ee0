//! The host: the routing core ([`router_core::routing::RoutingCore`]) wired to this process's
//! configuration and loaded policies.
//!
//! Everything about a request's path (sessions, admission, the policy call through the
//! [`Router`], booking, completion) lives in the core, which knows nothing about YAML or
//! plugin files; this facade builds it from a [`RouterConfig`] and keeps the concrete session
//! table for tools that print it. Every method takes `&self`: one `Host` serves many threads.

use std::sync::Arc;

use plugin_api::abi::CompletionCode;
use router_core::admission::ClassSpec;
use router_core::routing::{CoreSettings, RoutingCore};
use router_core::sessions::{
    BindingGranularity, BindingMode, Clock, SessionStore, SessionTable, SystemClock,
};
use router_core::topology::Topology;

use crate::config::{PolicyClassConfig, RouterConfig, SessionStoreConfig};
use crate::model::{Cluster, Request, RowId, RowLoad};
use crate::router::Router;
use crate::session_store::{RedisStore, StoreError};

pub use crate::model::{InjectedRows, NoOverlap, OverlapSource};
pub use router_core::admission::{AdmissionStats, Ticket, TicketId};
pub use router_core::routing::{
    Drained, OwedHook, RemovedWorker, RequestId, RouteError, Routed, SessionOutcome, Submitted,
    DRAWN_ID_BIT,
};

/// See the module docs.
pub struct Host {
    router: Arc<Router>,
    core: RoutingCore,
    sessions: Option<Arc<SessionTable>>,
    /// The shared store, when `session_affinity.store.kind` is `redis` (built by
    /// [`Host::shared`]).
    redis: Option<Arc<RedisStore>>,
}

/// The booked load of every row, read through the host (see [`Host::load`]).
pub struct LoadView<'a>(&'a RoutingCore);

impl LoadView<'_> {
    /// The load of `row` as policies see it (idle for a row the cluster does not have).
    pub fn get(&self, row: RowId) -> RowLoad {
        self.0.load(row)
    }
}

impl Host {
    /// A host with the wall clock, using `config`'s session affinity and policy classes.
    pub fn new(router: Router, cluster: Cluster, config: &RouterConfig) -> Self {
        Self::with_clock(router, cluster, config, Arc::new(SystemClock))
    }

    /// A host whose session TTLs and queue waits run on `clock` (tests and replay use simulated
    /// time).
    ///
    /// Session bindings are always this process's own table here, whatever
    /// `session_affinity.store` says: the one-shot tools and the replay (simulated time) share
    /// nothing. `serve` builds its host with [`Host::shared`].
    pub fn with_clock(
        router: Router,
        cluster: Cluster,
        config: &RouterConfig,
        clock: Arc<dyn Clock>,
    ) -> Self {
        let sessions = config.session_affinity.as_ref().map(|a| {
            Arc::new(
                SessionTable::new(a.mode, a.ttl, a.max_bindings, clock.clone())
                    .with_granularity(granularity(a.mode)),
            )
        });
        let store = sessions.clone().map(|table| table as Arc<dyn SessionStore>);
        Self::assemble(router, cluster, config, clock, store, sessions, None)
    }

    /// A host on the wall clock whose session bindings live where `session_affinity.store`
    /// says: this process's table, or a Redis/Valkey shared with other replicas (connected
    /// here, bounded by the store timeout; an unreachable store starts in an outage and
    /// reconnects by itself). With Redis, the request ids the core draws carry this replica's
    /// tag (docs/replicas.md).
    ///
    /// # Errors
    /// [`StoreError`] when the store's URL cannot be used or its thread cannot start.
    pub fn shared(
        router: Router,
        cluster: Cluster,
        config: &RouterConfig,
    ) -> Result<Self, StoreError> {
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        match (&config.session_affinity, &config.session_store) {
            (Some(a), SessionStoreConfig::Redis(redis)) => {
                let store = Arc::new(RedisStore::start(
                    redis,
                    a.mode,
                    granularity(a.mode),
                    a.ttl,
                )?);
                let shared = store.clone() as Arc<dyn SessionStore>;
                Ok(Self::assemble(
                    router,
                    cluster,
                    config,
                    clock,
                    Some(shared),
                    None,
                    Some(store),
                ))
            }
            _ => Ok(Self::with_clock(router, cluster, config, clock)),
        }
    }

    /// [`Host::shared`] for a configuration that replaces `previous` (`serve`'s reload): when
    /// both keep bindings in this process with the same mode, TTL and cap, the new host shares
    /// the previous one's table, so a reload keeps every session binding and the in-flight
    /// counts of requests still running on the previous configuration. Any other store is
    /// built anew ([`Host::shared`]; bindings in Redis outlive the process anyway).
    ///
    /// # Errors
    /// As [`Host::shared`].
    pub fn shared_after(
        router: Router,
        cluster: Cluster,
        config: &RouterConfig,
        previous: &Host,
    ) -> Result<Self, StoreError> {
        let reusable = match (
            &config.session_affinity,
            &config.session_store,
            &previous.sessions,
        ) {
            (Some(a), SessionStoreConfig::Memory, Some(table))
                if table.mode() == a.mode
                    && table.ttl() == a.ttl
                    && table.max_bindings() == a.max_bindings =>
            {
                Some(table.clone())
            }
            _ => None,
        };
        match reusable {
            Some(table) => {
                let store = table.clone() as Arc<dyn SessionStore>;
                Ok(Self::assemble(
                    router,
                    cluster,
                    config,
                    Arc::new(SystemClock),
                    Some(store),
                    Some(table),
                    None,
                ))
            }
            None => Self::shared(router, cluster, config),
        }
    }

    /// Whether this host's bindings live in `other`'s table (a reload that kept them).
    pub fn shares_sessions_with(&self, other: &Host) -> bool {
        match (&self.sessions, &other.sessions) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    fn assemble(
        router: Router,
        cluster: Cluster,
        config: &RouterConfig,
        clock: Arc<dyn Clock>,
        store: Option<Arc<dyn SessionStore>>,
        sessions: Option<Arc<SessionTable>>,
        redis: Option<Arc<RedisStore>>,
    ) -> Self {
        let router = Arc::new(router);
        let settings = CoreSettings {
            sessions: store,
            classes: config.policy_classes.iter().map(class_spec).collect(),
            clock: Some(clock),
            id_tag: redis.as_ref().map_or(0, |r| r.id_tag()),
            drain_stall: Some(router.longest_hang_after()),
            decode_booking: config.booking.decode,
        };
        let core = RoutingCore::new(router.clone(), cluster, settings);
        Host {
            router,
            core,
            sessions,
            redis,
        }
    }

    pub fn router(&self) -> &Router {
        &self.router
    }

    /// The routing core itself (membership, KV events, tickets, observed load).
    pub fn core(&self) -> &RoutingCore {
        &self.core
    }

    /// The current cluster and its row slots.
    pub fn topology(&self) -> Arc<Topology> {
        self.core.topology()
    }

    /// Change a worker's availability or overload flag (`None` = leave as is); returns whether
    /// the worker exists.
    pub fn set_worker_state(
        &self,
        worker_id: u64,
        available: Option<bool>,
        overloaded: Option<bool>,
    ) -> bool {
        self.core
            .set_worker_state(worker_id, available, overloaded, None)
            .is_ok()
    }

    pub fn load(&self) -> LoadView<'_> {
        LoadView(&self.core)
    }

    pub fn sessions(&self) -> Option<&SessionTable> {
        self.sessions.as_deref()
    }

    /// The shared session store, when bindings live in Redis.
    pub fn redis_store(&self) -> Option<&RedisStore> {
        self.redis.as_deref()
    }

    /// Requests dispatched and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.core.in_flight()
    }

    pub fn admission_stats(&self) -> AdmissionStats {
        self.core.admission_stats()
    }

    /// Route and dispatch one request now, bypassing admission.
    pub fn route<O: OverlapSource + ?Sized>(
        &self,
        request: &Request,
        source: &O,
        explain: bool,
    ) -> Result<Routed, RouteError> {
        self.core.route(request, source, explain)
    }

    /// Admit one request: dispatch it, or queue it in its class lane (docs/routing-contract.md §8).
    pub fn submit<O: OverlapSource + ?Sized>(
        &self,
        request: Request,
        source: &O,
        explain: bool,
    ) -> Result<Submitted, RouteError> {
        self.core.submit(request, source, explain)
    }

    /// Re-evaluate queued requests (see [`RoutingCore::drain`]); `source_for` supplies the
    /// per-row signals of each queued request.
    pub fn drain<O: OverlapSource>(
        &self,
        source_for: impl FnMut(TicketId, &Request) -> O,
        explain: bool,
    ) -> Vec<Drained> {
        self.core.drain_with(source_for, explain)
    }

    /// The request's prefill finished: its prompt tokens no longer count as pending prefill.
    pub fn prefill_complete(&self, id: RequestId) {
        self.core.prefill_complete(id);
    }

    /// The request finished: release its load and its session lease. Unknown ids are ignored
    /// (completing twice is harmless).
    pub fn complete(&self, id: RequestId) -> bool {
        self.core.complete(id)
    }

    /// The request ended with `outcome` (completed, failed, cancelled).
    pub fn finish(&self, id: RequestId, outcome: CompletionCode) -> bool {
        self.core.finish(id, outcome)
    }
}

/// What new bindings remember of the dispatched row in `mode`.
fn granularity(mode: BindingMode) -> BindingGranularity {
    match mode {
        BindingMode::Soft => BindingGranularity::Worker,
        // A hard binding acts as a pin, and a pin is one exact row.
        BindingMode::Hard => BindingGranularity::Rank,
    }
}

/// A configured policy class as the core applies it.
pub fn class_spec(config: &PolicyClassConfig) -> ClassSpec {
    ClassSpec {
        name: config.name.clone(),
        prefill_busy_threshold: config.prefill_busy_threshold,
        prefill_busy_threshold_frac: config.prefill_busy_threshold_frac,
        mode: config.admission,
        max_wait: config.max_queue_wait,
    }
}

impl std::fmt::Debug for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Host")
            .field("router", &self.router)
            .field("core", &self.core)
            .finish_non_exhaustive()
    }
}
