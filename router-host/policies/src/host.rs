//! The host: the routing core ([`router_core::routing::RoutingCore`]) wired to this process's
//! configuration and loaded policies.
//!
//! Everything about a request's path (sessions, admission, the policy call through the
//! [`PolicySet`], booking, completion) lives in the core, which knows nothing about YAML or
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

use router_config::{PolicyClassConfig, RouterConfig, SessionStoreConfig};
use router_core::model::{Cluster, Request, RowId, RowLoad};

use crate::policy_set::PolicySet;

pub use router_core::admission::{AdmissionStats, Ticket, TicketId};
pub use router_core::model::{InjectedRows, NoOverlap, OverlapSource};
pub use router_core::routing::{
    Drained, OwedHook, RemovedWorker, RequestId, RouteError, Routed, SessionOutcome, Submitted,
    DRAWN_ID_BIT,
};

/// See the module docs.
pub struct Host {
    router: Arc<PolicySet>,
    core: RoutingCore,
    sessions: Option<Arc<SessionTable>>,
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
    pub fn new(router: PolicySet, cluster: Cluster, config: &RouterConfig) -> Self {
        Self::with_clock(router, cluster, config, Arc::new(SystemClock))
    }

    /// A host whose session TTLs and queue waits run on `clock` (tests and replay use simulated
    /// time).
    ///
    /// Session bindings are always this process's own table here, whatever
    /// `session_affinity.store` says: the one-shot tools and the replay (simulated time) share
    /// nothing. `serve` builds its host with [`Host::with_shared_store`] when bindings are shared.
    pub fn with_clock(
        router: PolicySet,
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
        Self::assemble(router, cluster, config, clock, store, sessions, 0)
    }

    /// A host on the wall clock whose session bindings live in `store`, a store shared with
    /// other replicas (`session_affinity.store.kind: redis`, connected by the caller). The
    /// request ids the core draws carry `id_tag`, this replica's tag (docs/replicas.md).
    pub fn with_shared_store(
        router: PolicySet,
        cluster: Cluster,
        config: &RouterConfig,
        store: Arc<dyn SessionStore>,
        id_tag: u16,
    ) -> Self {
        Self::assemble(
            router,
            cluster,
            config,
            Arc::new(SystemClock),
            Some(store),
            None,
            id_tag,
        )
    }

    /// The session table of `previous` when a configuration that replaces it (`serve`'s
    /// reload) keeps bindings in this process with the same mode, TTL and cap: a host built
    /// on it ([`Host::with_table`]) keeps every session binding and the in-flight counts of
    /// requests still running on the previous configuration. `None` when the table cannot be
    /// shared (bindings in a shared store outlive the process anyway).
    pub fn reusable_table(config: &RouterConfig, previous: &Host) -> Option<Arc<SessionTable>> {
        match (
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
        }
    }

    /// A host on the wall clock whose bindings live in `table`, an in-process table kept from
    /// a previous host ([`Host::reusable_table`]).
    pub fn with_table(
        router: PolicySet,
        cluster: Cluster,
        config: &RouterConfig,
        table: Arc<SessionTable>,
    ) -> Self {
        let store = table.clone() as Arc<dyn SessionStore>;
        Self::assemble(
            router,
            cluster,
            config,
            Arc::new(SystemClock),
            Some(store),
            Some(table),
            0,
        )
    }

    /// Whether this host's bindings live in `other`'s table (a reload that kept them).
    pub fn shares_sessions_with(&self, other: &Host) -> bool {
        match (&self.sessions, &other.sessions) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    fn assemble(
        router: PolicySet,
        cluster: Cluster,
        config: &RouterConfig,
        clock: Arc<dyn Clock>,
        store: Option<Arc<dyn SessionStore>>,
        sessions: Option<Arc<SessionTable>>,
        id_tag: u16,
    ) -> Self {
        let router = Arc::new(router);
        let settings = CoreSettings {
            sessions: store,
            classes: config.policy_classes.iter().map(class_spec).collect(),
            clock: Some(clock),
            id_tag,
            drain_stall: Some(router.longest_hang_after()),
            decode_booking: config.booking.decode,
            max_queued: config.max_queued_requests,
            recent_window: config.kv_recent_window,
        };
        let core = RoutingCore::new(router.clone(), cluster, settings);
        Host {
            router,
            core,
            sessions,
        }
    }

    pub fn policy_set(&self) -> &PolicySet {
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
pub fn granularity(mode: BindingMode) -> BindingGranularity {
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
        priority: config.priority,
        max_engine_waiting: config.max_engine_waiting,
        max_kv_usage: config.max_kv_usage,
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
