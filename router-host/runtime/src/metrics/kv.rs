//! What KV-event ingestion counts, registered with the other metrics.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::{
    KvKindLabels, RowLabels, RowStateLabels, RowTierLabels, RowTierReasonLabels,
    RowTransitionLabels,
};

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
    /// Rows cleared, by `kind` (cause): `restart`, `all_blocks_cleared`, `over_capacity`, `stale`.
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
    /// 1 for the state the row's KV index is in (`current`, `unknown`, `stale`, `lagging`), 0
    /// for the others.
    pub index_state: Family<RowStateLabels, Gauge>,
    /// Changes of a row's KV index state, by `from` and `to`.
    pub state_transitions: Family<RowTransitionLabels, Counter>,
}

impl KvMetrics {
    pub(super) fn register(&self, registry: &mut Registry) {
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
            "Rows whose index entries were dropped, by cause (restart, all_blocks_cleared, stale, \
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
        registry.register(
            "router_kv_index_state",
            "1 for the state the row's KV index is in (current, unknown, stale, lagging), 0 for \
             the others; policies use the overlap of current rows only",
            self.index_state.clone(),
        );
        registry.register(
            "router_kv_index_state_transitions",
            "Changes of a row's KV index state, by from and to",
            self.state_transitions.clone(),
        );
    }
}
