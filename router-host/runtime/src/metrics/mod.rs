//! `GET /metrics`: Prometheus (OpenMetrics text) metrics of the proxy.
//!
//! Two kinds: counters and histograms the request path updates as things happen ([`Metrics`]),
//! and values read from the current configuration at scrape time (the collector
//! [`Metrics::new`] is given: serve's `scrape::StateCollector`, booked load per row, queue
//! depth, per-instance policy counters, engine health). The names and labels are listed in
//! docs/serve.md.
//!
//! Here: [`Metrics`], the registry and the request path's counters; `labels.rs` holds the label
//! sets, `kv.rs` what KV-event ingestion counts ([`KvMetrics`]).

mod kv;
mod labels;

pub use kv::KvMetrics;
pub use labels::{
    ConnectionLabels, DecisionLabels, EngineAnswerLabels, KvKindLabels, OpLabels, OutcomeLabels,
    ReasonLabels, RejectedLabels, RequestLabels, RowLabels, RowStateLabels, RowTierLabels,
    RowTierReasonLabels, RowTransitionLabels, StageLabels, UpstreamLabels,
};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use prometheus_client::collector::Collector;

use super::upstream::ConnectionUse;

type HistogramFamily<S> = Family<S, Histogram, fn() -> Histogram>;

fn overhead_histogram() -> Histogram {
    // 10 us .. ~5 s.
    Histogram::new(exponential_buckets(0.000_01, 2.0, 20))
}

fn labels(outcome: &str) -> OutcomeLabels {
    OutcomeLabels {
        outcome: outcome.to_owned(),
    }
}

/// Everything the request path counts.
pub struct Metrics {
    registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    pub overhead: HistogramFamily<StageLabels>,
    pub inflight: Family<RowLabels, Gauge>,
    /// Requests dispatched to each row (every attempt of a retried request): how the policy
    /// spreads the load.
    pub dispatches: Family<RowLabels, Counter>,
    pub decisions: Family<DecisionLabels, Counter>,
    pub queue_wait: Histogram,
    pub queue: Family<OutcomeLabels, Counter>,
    /// Requests refused or shed by admission, by class and reason (`x-router-rejected-reason`).
    pub admission_rejected: Family<RejectedLabels, Counter>,
    pub sessions: Family<OutcomeLabels, Counter>,
    pub retries: Counter,
    pub upstream_errors: Family<UpstreamLabels, Counter>,
    /// One counter per [`ConnectionUse`], in [`ConnectionUse::ALL`]'s order: created once, so
    /// counting a request allocates nothing.
    upstream_connections: [Counter; 4],
    pub tokenize_fallbacks: Counter,
    /// Requests routed without tokenizing their prompts: nothing configured reads the ids
    /// (`pipeline::PromptIds`).
    pub tokenize_skipped: Counter,
    pub reloads: Family<OutcomeLabels, Counter>,
    /// Reloads loading their configuration now (one that stays up has hung: a plugin's `create`).
    pub reloads_loading: Gauge,
    pub kv: KvMetrics,
    /// Client connections open now (`accept.rs`).
    pub client_connections_open: Gauge,
    /// Client connections closed at accept, by reason: `over_limit`, `fd_limit`.
    pub client_connections_shed: Family<ReasonLabels, Counter>,
    /// Client connections closed for being too slow, by reason: `header`, `body`.
    pub client_timeouts: Family<ReasonLabels, Counter>,
    /// Engine answers dropped, by worker, endpoint and reason: `too_large`, `redirect`.
    pub engine_answers_rejected: Family<EngineAnswerLabels, Counter>,
    /// `epp`: responses the data plane reports served by another endpoint than the picked
    /// one (`x-gateway-destination-endpoint-served`), by outcome: `moved`, `not_moved`,
    /// `unknown_endpoint`.
    epp_served_elsewhere: Family<OutcomeLabels, Counter>,
    /// The router's own descriptors, ports or memory ran out, by what it was doing.
    pub local_resource_errors: Family<OpLabels, Counter>,
    /// Streamed responses ended with an error event after the engine failed mid-stream.
    pub stream_error_events: Family<ReasonLabels, Counter>,
    /// Engines that failed mid-answer under `serve.migration_limit`, by what followed.
    pub migrations: Family<OutcomeLabels, Counter>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// The request path's metrics, then the values `scrape` reads at scrape time (serve's is
    /// `scrape::StateCollector`, which knows the configuration and the health table).
    pub fn new(scrape: Box<dyn Collector>) -> Metrics {
        let mut registry = Registry::default();
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "router_requests",
            "Requests by endpoint and outcome (completed, failed, cancelled, rejected, \
             unavailable, queue_timeout, error)",
            requests.clone(),
        );
        let overhead: HistogramFamily<StageLabels> =
            Family::new_with_constructor(overhead_histogram);
        registry.register(
            "router_overhead_seconds",
            "Time the router adds before the upstream request is sent: stage tokenize, decide \
             (admission and the policy call), total (received to sent, queue wait excluded)",
            overhead.clone(),
        );
        let inflight = Family::<RowLabels, Gauge>::default();
        registry.register(
            "router_inflight_requests",
            "Requests dispatched to a row and not finished",
            inflight.clone(),
        );
        let dispatches = Family::<RowLabels, Counter>::default();
        registry.register(
            "router_dispatches",
            "Requests dispatched to a row (each attempt of a retried request counts)",
            dispatches.clone(),
        );
        let decisions = Family::<DecisionLabels, Counter>::default();
        registry.register(
            "router_decisions",
            "Routing decisions by configured instance, deciding policy type, the policy's \
             reason and whether the built-in default decided as a fallback",
            decisions.clone(),
        );
        let queue_wait = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        registry.register(
            "router_queue_wait_seconds",
            "Time requests spent in an admission queue (queued requests only)",
            queue_wait.clone(),
        );
        let queue = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "router_queue",
            "Queued requests by how they left the queue: admitted, timeout, cancelled, failed",
            queue.clone(),
        );
        let admission_rejected = Family::<RejectedLabels, Counter>::default();
        registry.register(
            "router_admission_rejected",
            "Requests admission refused or shed, by policy class and reason: queue_full, \
             shed_for_higher_priority, queue_timeout",
            admission_rejected.clone(),
        );
        let sessions = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "router_session_bindings",
            "What dispatch did to the session binding: created, kept, moved, stale, \
             hard_binding_gone, not_recorded",
            sessions.clone(),
        );
        let retries = Counter::default();
        registry.register(
            "router_retries",
            "Requests retried on another row after a failure before the first upstream byte",
            retries.clone(),
        );
        let upstream_errors = Family::<UpstreamLabels, Counter>::default();
        registry.register(
            "router_upstream_errors",
            "Upstream failures by worker and kind (connect, timeout, status, body, idle)",
            upstream_errors.clone(),
        );
        let connections = Family::<ConnectionLabels, Counter>::default();
        registry.register(
            "router_upstream_connections",
            "Requests sent to engines by the connection they went on: new, reused (an idle \
             pooled one), reconnected (a pooled one the engine had closed), https (reqwest's pool)",
            connections.clone(),
        );
        let upstream_connections = ConnectionUse::ALL.map(|used| {
            connections
                .get_or_create(&ConnectionLabels {
                    connection: used.label(),
                })
                .clone()
        });
        let tokenize_fallbacks = Counter::default();
        registry.register(
            "router_tokenize_fallbacks",
            "Requests routed without prompt overlap because the remote tokenizer failed",
            tokenize_fallbacks.clone(),
        );
        let tokenize_skipped = Counter::default();
        registry.register(
            "router_tokenize_skipped",
            "Requests routed without tokenizing their prompts: nothing configured reads their \
             token ids (policy inputs, booking, policy classes, serve.forward_token_ids, \
             serve.max_prompt_tokens)",
            tokenize_skipped.clone(),
        );
        let reloads = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "router_config_reloads",
            "Configuration reloads (SIGHUP) by result: ok, error, superseded",
            reloads.clone(),
        );
        for outcome in ["ok", "error", "superseded"] {
            let _ = reloads.get_or_create(&labels(outcome));
        }
        let reloads_loading = Gauge::default();
        registry.register(
            "router_config_reloads_loading",
            "Reloads still loading their configuration (one that stays up is stuck, say in a plugin's create)",
            reloads_loading.clone(),
        );
        let kv = KvMetrics::default();
        kv.register(&mut registry);
        let client_connections_open = Gauge::default();
        registry.register(
            "router_client_connections_open",
            "Client connections open now (at most serve.max_connections)",
            client_connections_open.clone(),
        );
        let client_connections_shed = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "router_client_connections_shed",
            "Client connections closed at accept, by reason (over_limit: serve.max_connections \
             reached; fd_limit: the process ran out of file descriptors)",
            client_connections_shed.clone(),
        );
        let client_timeouts = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "router_client_timeouts",
            "Client connections or requests ended for being too slow, by reason (header: \
             serve.timeouts.header_read_ms; body: serve.timeouts.body_read_ms)",
            client_timeouts.clone(),
        );
        for reason in ["over_limit", "fd_limit"] {
            let _ = client_connections_shed.get_or_create(&ReasonLabels { reason });
        }
        for reason in ["header", "body"] {
            let _ = client_timeouts.get_or_create(&ReasonLabels { reason });
        }
        let engine_answers_rejected = Family::<EngineAnswerLabels, Counter>::default();
        registry.register(
            "router_engine_answers_rejected",
            "Engine answers to the router's own calls dropped unread, by worker, endpoint \
             (health, metrics, tokenize, models) and reason (too_large, redirect)",
            engine_answers_rejected.clone(),
        );
        let local_resource_errors = Family::<OpLabels, Counter>::default();
        registry.register(
            "router_local_resource_errors",
            "The router's own file descriptors, ports or memory ran out, by what it was doing \
             (upstream_connect, probe, tokenize, models); never counted against an engine",
            local_resource_errors.clone(),
        );
        let stream_error_events = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "router_stream_error_events",
            "Streamed responses ended with an SSE error event because the engine failed \
             mid-stream, by reason (body: its body broke off; idle: stream_idle_ms passed)",
            stream_error_events.clone(),
        );
        let epp_served_elsewhere = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "router_epp_served_elsewhere",
            "epp: responses the data plane reports served by another endpoint than the picked \
             one, by outcome (moved: the booking moved to it; not_moved: it could not be \
             booked; unknown_endpoint: no configured worker has that ip:port)",
            epp_served_elsewhere.clone(),
        );
        for outcome in ["moved", "not_moved", "unknown_endpoint"] {
            let _ = epp_served_elsewhere.get_or_create(&labels(outcome));
        }
        let migrations = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "router_migrations",
            "Engines that failed mid-answer for requests that may move (serve.migration_limit), \
             by outcome: continued (another row took the request over), ended (generation had \
             finished; the router ended the stream), exhausted (no leg or row left, or the next \
             leg failed), unmovable (the request could not continue exactly)",
            migrations.clone(),
        );
        for outcome in ["continued", "ended", "exhausted", "unmovable"] {
            let _ = migrations.get_or_create(&labels(outcome));
        }
        registry.register_collector(scrape);
        Metrics {
            registry,
            requests,
            overhead,
            inflight,
            dispatches,
            decisions,
            queue_wait,
            queue,
            admission_rejected,
            sessions,
            retries,
            upstream_errors,
            upstream_connections,
            tokenize_fallbacks,
            tokenize_skipped,
            reloads,
            reloads_loading,
            kv,
            client_connections_open,
            client_connections_shed,
            client_timeouts,
            engine_answers_rejected,
            local_resource_errors,
            stream_error_events,
            epp_served_elsewhere,
            migrations,
        }
    }

    /// A failure mid-answer of a request that may move, and what followed.
    pub fn migration(&self, outcome: &'static str) {
        self.migrations
            .get_or_create(&OutcomeLabels {
                outcome: outcome.to_owned(),
            })
            .inc();
    }

    pub fn connection_shed(&self, reason: &'static str) {
        self.client_connections_shed
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    pub fn client_timeout(&self, reason: &'static str) {
        self.client_timeouts
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    pub fn engine_answer_rejected(
        &self,
        worker: u64,
        endpoint: &'static str,
        reason: &'static str,
    ) {
        self.engine_answers_rejected
            .get_or_create(&EngineAnswerLabels {
                worker: worker.to_string(),
                endpoint,
                reason,
            })
            .inc();
    }

    pub fn local_resource_error(&self, op: &'static str) {
        self.local_resource_errors
            .get_or_create(&OpLabels { op })
            .inc();
    }

    pub fn request(&self, endpoint: &str, outcome: &str) {
        self.requests
            .get_or_create(&RequestLabels {
                endpoint: endpoint.to_owned(),
                outcome: outcome.to_owned(),
            })
            .inc();
    }

    pub fn stage(&self, stage: &str, seconds: f64) {
        self.overhead
            .get_or_create(&StageLabels {
                stage: stage.to_owned(),
            })
            .observe(seconds);
    }

    /// Count a dispatch to row `(worker, dp_rank)`.
    pub fn dispatched(&self, worker: u64, dp_rank: u32) {
        self.dispatches
            .get_or_create(&RowLabels {
                worker: worker.to_string(),
                dp_rank: dp_rank.to_string(),
            })
            .inc();
    }

    pub fn inflight(&self, worker: u64, dp_rank: u32) -> Gauge {
        self.inflight.get_or_create_owned(&RowLabels {
            worker: worker.to_string(),
            dp_rank: dp_rank.to_string(),
        })
    }

    pub fn queue_outcome(&self, outcome: &str) {
        self.queue.get_or_create(&labels(outcome)).inc();
    }

    /// A request admission refused or shed (`reason` is its `x-router-rejected-reason`).
    pub fn admission_rejected(&self, class: &str, reason: &str) {
        self.admission_rejected
            .get_or_create(&RejectedLabels {
                class: class.to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
    }

    pub fn session(&self, outcome: &str) {
        self.sessions.get_or_create(&labels(outcome)).inc();
    }

    /// `epp`: a response served by another endpoint than the picked one, by `outcome`.
    pub fn epp_served_elsewhere(&self, outcome: &str) {
        self.epp_served_elsewhere
            .get_or_create(&labels(outcome))
            .inc();
    }

    pub fn reload(&self, outcome: &str) {
        self.reloads.get_or_create(&labels(outcome)).inc();
    }

    pub fn upstream_error(&self, worker: u64, kind: &str) {
        self.upstream_errors
            .get_or_create(&UpstreamLabels {
                worker: worker.to_string(),
                kind: kind.to_owned(),
            })
            .inc();
    }

    pub fn upstream_connection(&self, used: ConnectionUse) {
        // `ALL` lists the variants in declaration order, so the discriminant is the index.
        self.upstream_connections[used as usize].inc();
    }

    /// The exposition text.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}
