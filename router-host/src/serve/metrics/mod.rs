//! `GET /metrics`: Prometheus (OpenMetrics text) metrics of the proxy.
//!
//! Two kinds: counters and histograms the request path updates as things happen ([`Metrics`]),
//! and values read from the current configuration at scrape time (`StateCollector`: booked
//! load per row, queue depth, per-instance policy counters, engine health). The names and labels
//! are listed in docs/serve.md.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use super::health::HealthTable;
use super::state::Current;
use super::upstream::ConnectionUse;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub endpoint: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabels {
    pub stage: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RowLabels {
    pub worker: String,
    pub dp_rank: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RowTierLabels {
    pub worker: String,
    pub dp_rank: String,
    /// `device`, `host` or `disk` (`router_core::kv_index::Tier::name`).
    pub tier: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    pub instance: String,
    pub policy: String,
    pub reason: String,
    pub fallback: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamLabels {
    pub worker: String,
    pub kind: String,
}

/// `router_upstream_connections`' label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConnectionLabels {
    pub connection: &'static str,
}

/// A metric with one `reason` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

/// `router_engine_answers_rejected_total`'s labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EngineAnswerLabels {
    pub worker: String,
    pub endpoint: &'static str,
    pub reason: &'static str,
}

/// `router_local_resource_errors_total`'s label: what the router was doing.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabels {
    pub op: &'static str,
}

/// A KV-index metric of one row's tier, with a reason.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RowTierReasonLabels {
    pub worker: String,
    pub dp_rank: String,
    pub tier: String,
    pub reason: String,
}

/// A KV-event metric of one row, with a kind or reason.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KvKindLabels {
    pub worker: String,
    pub dp_rank: String,
    pub kind: String,
}

/// What KV-event ingestion counts (`serve/kv_events/`); cheap to clone (shared families).
#[derive(Clone, Debug, Default)]
pub struct KvMetrics {
    /// Events applied, by `kind`: `block_stored`, `block_removed`, `all_blocks_cleared`.
    pub events: Family<KvKindLabels, Counter>,
    /// Messages (event batches) received, by row.
    pub batches: Family<RowLabels, Counter>,
    /// Sequence gaps (batches lost), by row.
    pub gaps: Family<RowLabels, Counter>,
    /// Replay requests, by `kind` (outcome): `ok`, `error`.
    pub replays: Family<KvKindLabels, Counter>,
    /// Rows cleared, by `kind` (cause): `restart`, `all_blocks_cleared`.
    pub clears: Family<KvKindLabels, Counter>,
    /// Events refused, by `kind` (reason).
    pub refused: Family<KvKindLabels, Counter>,
    /// Events ignored on purpose, by `kind` (reason): `medium`, `group`, `unknown_type`,
    /// `unknown_block`.
    pub ignored: Family<KvKindLabels, Counter>,
    /// Messages or events that could not be decoded, by `kind`: `frames`, `payload`, `event`.
    pub decode_errors: Family<KvKindLabels, Counter>,
    /// 1 while the subscriber of the row is connected to its engine.
    pub connected: Family<RowLabels, Gauge>,
    /// Blocks the row's engine-hash map holds (what the index holds for the row).
    pub blocks: Family<RowTierLabels, Gauge>,
    /// Seconds from the last batch's timestamp (the engine's clock) to its being applied.
    pub lag: Family<RowLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    /// Connections dropped because the publisher broke ZMTP, by `kind`.
    pub protocol_errors: Family<KvKindLabels, Counter>,
    /// Subscriber sessions or tasks that panicked (and were restarted), by row.
    pub panics: Family<RowLabels, Counter>,
    /// Blocks dropped from a row's tier to keep it within its limit, by `tier` and `reason`.
    pub evictions: Family<RowTierReasonLabels, Counter>,
}

impl KvMetrics {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "router_kv_events",
            "KV-cache events applied to the index, by row and kind (block_stored, \
             block_removed, all_blocks_cleared)",
            self.events.clone(),
        );
        registry.register(
            "router_kv_event_batches",
            "KV-event messages (batches) received from the row's engine",
            self.batches.clone(),
        );
        registry.register(
            "router_kv_event_gaps",
            "Gaps in a row's event sequence numbers (batches lost)",
            self.gaps.clone(),
        );
        registry.register(
            "router_kv_event_replays",
            "Replay requests sent after a gap, by outcome (ok, error)",
            self.replays.clone(),
        );
        registry.register(
            "router_kv_row_clears",
            "Rows whose index entries were dropped, by cause (restart, all_blocks_cleared, \
             over_capacity)",
            self.clears.clone(),
        );
        registry.register(
            "router_kv_events_refused",
            "KV events refused, by reason (block_size, token_count, unknown_parent, hash, \
             extra_keys)",
            self.refused.clone(),
        );
        registry.register(
            "router_kv_events_ignored",
            "KV events ignored on purpose, by reason (medium, group, unknown_type, \
             unknown_block)",
            self.ignored.clone(),
        );
        registry.register(
            "router_kv_event_decode_errors",
            "KV-event messages or events that could not be decoded, by kind (frames, \
             payload, event)",
            self.decode_errors.clone(),
        );
        registry.register(
            "router_kv_subscriber_connected",
            "1 while the row's KV-event subscriber is connected to its engine",
            self.connected.clone(),
        );
        registry.register(
            "router_kv_index_blocks",
            "Blocks indexed for the row from its engine's events, by tier (device; host and \
             disk once the engine reported an offload tier)",
            self.blocks.clone(),
        );
        registry.register(
            "router_kv_event_lag_seconds",
            "Seconds from the last applied batch's timestamp (engine clock) to its being \
             applied (router clock)",
            self.lag.clone(),
        );
        registry.register(
            "router_kv_protocol_errors",
            "KV-event connections dropped because the publisher broke the ZMTP protocol, by \
             kind (greeting, mechanism, handshake, frame, too_large, too_many_frames, command, \
             peer_error, stalled)",
            self.protocol_errors.clone(),
        );
        registry.register(
            "router_kv_subscriber_panics",
            "KV-event subscriber sessions that panicked and were restarted",
            self.panics.clone(),
        );
        registry.register(
            "router_kv_index_evictions",
            "Blocks dropped from a row's KV-index tier because it went over its limit, by tier \
             and reason (over_capacity: the engine's reported KV capacity; over_limit: \
             kv_events.max_indexed_blocks)",
            self.evictions.clone(),
        );
    }
}

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
    pub sessions: Family<OutcomeLabels, Counter>,
    pub retries: Counter,
    pub upstream_errors: Family<UpstreamLabels, Counter>,
    /// One counter per [`ConnectionUse`], in [`ConnectionUse::ALL`]'s order: created once, so
    /// counting a request allocates nothing.
    upstream_connections: [Counter; 4],
    pub tokenize_fallbacks: Counter,
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
    /// The router's own descriptors, ports or memory ran out, by what it was doing.
    pub local_resource_errors: Family<OpLabels, Counter>,
    /// Streamed responses ended with an error event after the engine failed mid-stream.
    pub stream_error_events: Family<ReasonLabels, Counter>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    pub fn new(current: Arc<Current>, health: Arc<HealthTable>) -> Metrics {
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
        registry.register_collector(Box::new(StateCollector { current, health }));
        Metrics {
            registry,
            requests,
            overhead,
            inflight,
            dispatches,
            decisions,
            queue_wait,
            queue,
            sessions,
            retries,
            upstream_errors,
            upstream_connections,
            tokenize_fallbacks,
            reloads,
            reloads_loading,
            kv,
            client_connections_open,
            client_connections_shed,
            client_timeouts,
            engine_answers_rejected,
            local_resource_errors,
            stream_error_events,
        }
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

    pub fn session(&self, outcome: &str) {
        self.sessions.get_or_create(&labels(outcome)).inc();
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

/// Values read at scrape time from the configuration serving now.
#[derive(Debug)]
struct StateCollector {
    current: Arc<Current>,
    health: Arc<HealthTable>,
}

fn family<L: EncodeLabelSet, M: EncodeMetric>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    kind: MetricType,
    rows: impl IntoIterator<Item = (L, M)>,
) -> Result<(), std::fmt::Error> {
    let mut metric = encoder.encode_descriptor(name, help, None, kind)?;
    for (labels, value) in rows {
        value.encode(metric.encode_family(&labels)?)?;
    }
    Ok(())
}

type Labels = Vec<(&'static str, String)>;
/// A per-instance counter: name, help, and how to read it from a snapshot.
type CounterSpec = (
    &'static str,
    &'static str,
    fn(&crate::policies::InstanceCounters) -> u64,
);
/// A per-instance flag: name, help, and how to read it.
type FlagSpec = (
    &'static str,
    &'static str,
    fn(&crate::policies::PolicyInstance) -> bool,
);

impl Collector for StateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let generation = self.current.load();
        let host = &generation.host;
        let core = host.core();
        let topology = core.topology();
        let rows: Vec<_> = topology
            .cluster()
            .workers()
            .iter()
            .flat_map(|w| w.rows().collect::<Vec<_>>())
            .collect();
        let row_labels = |row: &crate::model::RowId| -> Labels {
            vec![
                ("worker", row.worker_id.to_string()),
                ("dp_rank", row.dp_rank.to_string()),
            ]
        };
        let booked: Vec<_> = rows
            .iter()
            .map(|r| (row_labels(r), core.booked(*r)))
            .collect();
        family(
            &mut encoder,
            "router_booked_active_requests",
            "Requests the router booked on each row and has not released",
            MetricType::Gauge,
            booked
                .iter()
                .map(|(l, load)| (l.clone(), ConstGauge::new(load.active_requests as i64))),
        )?;
        family(
            &mut encoder,
            "router_booked_prefill_tokens",
            "Prompt tokens booked on each row whose prefill has not finished",
            MetricType::Gauge,
            booked.iter().map(|(l, load)| {
                (
                    l.clone(),
                    ConstGauge::new(load.active_prefill_tokens as i64),
                )
            }),
        )?;
        family(
            &mut encoder,
            "router_booked_decode_blocks",
            "KV blocks booked on each row by requests in flight",
            MetricType::Gauge,
            booked
                .iter()
                .map(|(l, load)| (l.clone(), ConstGauge::new(load.decode_blocks as i64))),
        )?;
        family(
            &mut encoder,
            "router_worker_kv_capacity_blocks",
            "KV capacity per rank in blocks, as policies see it (workers[].total_kv_blocks, else \
             the engine's num_gpu_blocks less its null block); absent while unknown",
            MetricType::Gauge,
            topology.cluster().workers().iter().filter_map(|w| {
                let blocks = i64::try_from(w.total_kv_blocks?).ok()?;
                Some((
                    vec![("worker", w.worker_id.to_string())],
                    ConstGauge::new(blocks),
                ))
            }),
        )?;
        family(
            &mut encoder,
            "router_load_active_requests",
            "Active requests per row as policies see them: max(booked, observed on the engine)",
            MetricType::Gauge,
            rows.iter().map(|r| {
                (
                    row_labels(r),
                    ConstGauge::new(core.load(*r).active_requests as i64),
                )
            }),
        )?;
        let none: [(Labels, ConstGauge); 0] = [];
        family(
            &mut encoder,
            "router_core_in_flight",
            "Bookings the routing core holds for the configuration serving now",
            MetricType::Gauge,
            none.into_iter().chain(std::iter::once((
                Labels::new(),
                ConstGauge::new(core.in_flight() as i64),
            ))),
        )?;
        let admission = core.admission_stats();
        family(
            &mut encoder,
            "router_queue_depth",
            "Requests waiting in admission queues now",
            MetricType::Gauge,
            std::iter::once((Labels::new(), ConstGauge::new(admission.waiting as i64))),
        )?;
        family(
            &mut encoder,
            "router_queue_stalled",
            "Queued requests whose re-evaluation hung (ran past the longest hang_after_ms): their lane moved on without them (this configuration)",
            MetricType::Counter,
            std::iter::once((Labels::new(), ConstCounter::new(admission.stalled))),
        )?;
        family(
            &mut encoder,
            "router_config_generation",
            "Number of the configuration serving now (1 at start, +1 per successful reload)",
            MetricType::Gauge,
            std::iter::once((Labels::new(), ConstGauge::new(generation.number as i64))),
        )?;
        if let Some(stats) = generation
            .tokenizer
            .as_ref()
            .and_then(|t| t.segment_stats())
        {
            // docs/serve.md, "The segment cache": pieces of prompts not tokenized again.
            family(
                &mut encoder,
                "router_tokenizer_segments",
                "Closed prompt pieces looked up in the local tokenizer's segment cache",
                MetricType::Counter,
                [("hit", stats.hits), ("miss", stats.misses)].map(|(outcome, n)| {
                    (vec![("outcome", outcome.to_owned())], ConstCounter::new(n))
                }),
            )?;
            let words = generation.tokenizer.as_ref().and_then(|t| t.word_stats());
            if let Some(words) = words {
                // docs/serve.md, "The word split": words not tokenized again.
                family(
                    &mut encoder,
                    "router_tokenizer_words",
                    "Words of prompts looked up in the local tokenizer's word cache \
                     (fallback: a piece tokenized whole by tokenizers)",
                    MetricType::Counter,
                    [
                        ("hit", words.hits),
                        ("miss", words.misses),
                        ("fallback", words.fallbacks),
                    ]
                    .map(|(outcome, n)| {
                        (vec![("outcome", outcome.to_owned())], ConstCounter::new(n))
                    }),
                )?;
            }
            let bytes = [
                ("segments", Some(stats.bytes)),
                ("words", words.map(|w| w.bytes)),
            ];
            family(
                &mut encoder,
                "router_tokenizer_cache_bytes",
                "Bytes the local tokenizer's caches hold (texts, ids and overhead), per cache",
                MetricType::Gauge,
                bytes.into_iter().filter_map(|(cache, bytes)| {
                    bytes.map(|b| (vec![("cache", cache.to_owned())], ConstGauge::new(b as i64)))
                }),
            )?;
        }
        if let Some(table) = host.sessions() {
            family(
                &mut encoder,
                "router_session_bindings_held",
                "Session bindings held now",
                MetricType::Gauge,
                std::iter::once((Labels::new(), ConstGauge::new(table.len() as i64))),
            )?;
        }
        if let Some(store) = host.redis_store() {
            // docs/replicas.md, "Outages": what the shared session store costs and did.
            let s = store.store_stats();
            family(
                &mut encoder,
                "router_session_store_up",
                "1 when the shared session store answered the last call or probe, else 0",
                MetricType::Gauge,
                std::iter::once((Labels::new(), ConstGauge::new(i64::from(s.up)))),
            )?;
            let counters: [(&str, &str, u64); 4] = [
                (
                    "router_session_store_outages",
                    "Outages of the shared session store begun",
                    s.outages,
                ),
                (
                    "router_session_store_degraded_requests",
                    "Requests with a session served without the store (routed without binding, or refused)",
                    s.degraded,
                ),
                (
                    "router_session_store_foreign_keys",
                    "Store keys that held something else than a binding (skipped, never written)",
                    s.foreign,
                ),
                (
                    "router_session_store_errors",
                    "Store calls that failed or timed out",
                    s.errors,
                ),
            ];
            for (name, help, value) in counters {
                family(
                    &mut encoder,
                    name,
                    help,
                    MetricType::Counter,
                    std::iter::once((Labels::new(), ConstCounter::new(value))),
                )?;
            }
        }
        let router = host.router();
        let instance_labels = |i: &crate::policies::PolicyInstance| -> Labels {
            vec![
                ("instance", i.name.clone()),
                ("policy", i.type_name.clone()),
            ]
        };
        let instances: Vec<_> = router
            .instances()
            .iter()
            .map(|i| (instance_labels(i), i.stats.snapshot(), i))
            .collect();
        let counters: [CounterSpec; 7] = [
            (
                "router_policy_picks",
                "Picks asked of each policy instance",
                |c| c.picks,
            ),
            (
                "router_policy_errors",
                "Picks that returned an error",
                |c| c.errors,
            ),
            (
                "router_policy_panics",
                "Picks that panicked (the instance is then poisoned)",
                |c| c.panics,
            ),
            (
                "router_policy_fallbacks",
                "Requests of the instance decided by the built-in default instead",
                |c| c.fallbacks,
            ),
            (
                "router_policy_slow_picks",
                "Decisions over the instance's pick_budget_us because the pick alone was",
                |c| c.slow_picks,
            ),
            (
                "router_policy_slow_explains",
                "Decisions over the instance's pick_budget_us because explain pushed pick + \
                 explain past it (serve explains every decision)",
                |c| c.slow_explains,
            ),
            (
                "router_policy_hangs",
                "Calls found running past the instance's hang_after_ms",
                |c| c.hangs,
            ),
        ];
        for (name, help, get) in counters {
            family(
                &mut encoder,
                name,
                help,
                MetricType::Counter,
                instances
                    .iter()
                    .map(|(l, c, _)| (l.clone(), ConstCounter::new(get(c)))),
            )?;
        }
        let flags: [FlagSpec; 3] = [
            (
                "router_policy_quarantined",
                "1 while the instance is quarantined after repeated slow picks",
                |i| i.is_quarantined(),
            ),
            (
                "router_policy_poisoned",
                "1 once the instance panicked",
                |i| i.is_poisoned(),
            ),
            (
                "router_policy_hung",
                "1 once a call into the instance hung",
                |i| i.is_hung(),
            ),
        ];
        for (name, help, get) in flags {
            family(
                &mut encoder,
                name,
                help,
                MetricType::Gauge,
                instances
                    .iter()
                    .map(|(l, _, i)| (l.clone(), ConstGauge::new(i64::from(get(i))))),
            )?;
        }
        family(
            &mut encoder,
            "router_plugin_images_mapped",
            "Plugin images (shared objects) mapped in this process: one per distinct plugin file \
             ever loaded; a reload of a changed plugin adds one, and none is ever unmapped",
            MetricType::Gauge,
            std::iter::once((
                Labels::new(),
                ConstGauge::new(crate::loader::images_mapped() as i64),
            )),
        )?;
        family(
            &mut encoder,
            "router_plugin_images_max",
            "plugin_images_max of the configuration serving now: a reload that would map more \
             plugin images fails (restart to go back to one image per plugin)",
            MetricType::Gauge,
            std::iter::once((
                Labels::new(),
                ConstGauge::new(router.plugin_images_max() as i64),
            )),
        )?;
        // One series per instance and state, 1 for the state it is in: an alert can match
        // `state!="in_service"` without knowing the states.
        family(
            &mut encoder,
            "router_policy_instance_state",
            "1 for the state each policy instance is in (in_service, poisoned, quarantined, \
             hung), 0 for the others; out of service, its requests go to its fallback (or fail \
             with on_error: fail)",
            MetricType::Gauge,
            instances.iter().flat_map(|(l, _, i)| {
                let now = i.state();
                crate::policies::InstanceState::ALL.map(|state| {
                    let mut labels = l.clone();
                    labels.push(("state", state.as_str().to_owned()));
                    (labels, ConstGauge::new(i64::from(state == now)))
                })
            }),
        )?;
        let health = self.health.snapshot();
        family(
            &mut encoder,
            "router_engine_healthy",
            "1 while the engine answers its health probe (an unhealthy engine gets no requests)",
            MetricType::Gauge,
            health.iter().map(|(id, url, healthy)| {
                (
                    vec![("worker", id.to_string()), ("url", url.clone())],
                    ConstGauge::new(i64::from(*healthy)),
                )
            }),
        )?;
        family(
            &mut encoder,
            "router_engine_kv_cache_usage",
            "The engine's KV-cache usage (0..1), vllm:kv_cache_usage_perc from its last scrape",
            MetricType::Gauge,
            self.health.kv_usage().into_iter().map(|(id, rank, usage)| {
                (
                    vec![("worker", id.to_string()), ("dp_rank", rank.to_string())],
                    ConstGauge::new(usage),
                )
            }),
        )?;
        Ok(())
    }
}
