//! One `(worker, rank)` subscriber: a ZMTP SUB connection to the engine's publisher
//! ([`super::zmtp`]), its own tokio task. It decodes each message, applies it to the current
//! configuration's routing core in one batch per message (a short write lock on the KV index,
//! never awaited under), and reconnects with backoff when the connection breaks or the peer
//! breaks the protocol. A gap in the sequence numbers is counted and, with a replay endpoint,
//! filled by asking the engine's replay socket.
//!
//! At start (a [`WarmGate`] given), right after its first subscribe, it asks the replay socket
//! for everything the engine still buffers and applies it: the row's index then holds what
//! the engine's replay buffer can give before the first live batch, and live batches the
//! replay already gave are skipped.
//!
//! It also decides how far the row's index can be trusted ([`KvIndexState`], docs/serve.md, "KV
//! index states") from what it saw ([`Trust`]), and sets it in the core, the gauges and the
//! transitions counter whenever it changes.

use std::collections::HashSet;
use std::hash::{BuildHasher, Hasher};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use plugin_api::KvIndexState;
use router_core::kv_index::Tier;
use tokio::time::Instant;

use super::decode::{decode_batch, decode_seq, DecodeError, MAX_PAYLOAD_BYTES};
use super::ingest::{capacity_limit, RowIngest, SeqCheck, Sink, Tally, Update};
use super::zmtp::{Connection, Limits, ProtocolError, SocketType};
use super::{Spec, WarmGate};
use crate::metrics::{
    KvKindLabels, KvMetrics, RowLabels, RowStateLabels, RowTierLabels, RowTierReasonLabels,
    RowTransitionLabels,
};
use crate::state::Current;
use crate::stop::Stop;
use router_core::model::RowId;

/// First and longest wait between connection attempts (each wait is shortened by up to a
/// fifth at random, so that rows restarted together do not reconnect in lockstep).
pub(super) const BACKOFF_MIN: Duration = Duration::from_millis(100);
pub(super) const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Limit on one connection attempt (TCP connect and handshake), and on each replay step.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// After a warm start, live batches at or below the last replayed sequence number are the
/// replay's own (queued on the subscription meanwhile) and skipped for this long; later, a
/// sequence number going back is an engine restart again.
const WARM_SKIP_WINDOW: Duration = Duration::from_secs(5);
/// How often a quiet subscriber checks for a reloaded configuration (to seed its new index).
const GENERATION_CHECK: Duration = Duration::from_millis(500);
/// What a publisher may send: a message is `[topic, seq, payload]` (a replay reply has one
/// more, empty, frame), the payload at most [`MAX_PAYLOAD_BYTES`], and once a message started
/// its next byte comes within `stall`.
pub(super) const LIMITS: Limits = Limits {
    max_message: MAX_PAYLOAD_BYTES + (64 << 10),
    max_frames: 8,
    stall: Duration::from_secs(3),
};
/// Least time between two warnings that a row's index went over its limit.
const OVERFLOW_LOG_EVERY: Duration = Duration::from_secs(60);
/// Least time between two lines that a row's index state changed (a lag hovering at the bound,
/// or a publisher alternating gaps and clears, changes it per batch; the counter has them all).
const STATE_LOG_EVERY: Duration = Duration::from_secs(10);

/// Run `session`; a panic in it becomes its message (the subscriber then reconnects instead
/// of leaving its row silently dead).
async fn caught<T>(session: impl std::future::Future<Output = T>) -> Result<T, String> {
    AssertUnwindSafe(session)
        .catch_unwind()
        .await
        .map_err(|panic| {
            panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(no message)".to_owned())
        })
}

/// A random fraction in [0, 1) (jitter; no need for a generator).
fn random_fraction() -> f64 {
    let bits = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

/// What a row's [`KvIndexState`] is derived from. One rule, [`Trust::state`]: unknown until a
/// batch arrived since the last (re)connect; then stale while a gap replay could not fill is
/// not yet cleared; then lagging while the last batch came later than `max_lag_ms`; else
/// current.
#[derive(Debug, Default)]
struct Trust {
    /// A batch arrived since the subscriber (re)connected.
    fresh: bool,
    /// Set at a gap replay could not fill: when the row's entries are cleared (unless the
    /// engine's restart or its `AllBlocksCleared` empties them first).
    stale_until: Option<Instant>,
    /// The last batch arrived more than `max_lag_ms` after its timestamp.
    lagging: bool,
    /// The state last published (gauges, counter, log); `None` before the first.
    published: Option<KvIndexState>,
}

impl Trust {
    fn state(&self) -> KvIndexState {
        if !self.fresh {
            KvIndexState::Unknown
        } else if self.stale_until.is_some() {
            KvIndexState::Stale
        } else if self.lagging {
            KvIndexState::Lagging
        } else {
            KvIndexState::Current
        }
    }
}

/// The core of the configuration serving now, for one row.
struct CoreSink<'a> {
    core: &'a router_core::routing::RoutingCore,
    row: RowId,
}

impl Sink for CoreSink<'_> {
    fn apply(&mut self, updates: &[Update]) {
        self.core.apply_kv_events(self.row, updates.iter().copied());
    }

    fn clear(&mut self) {
        self.core.clear_kv_row(self.row);
    }

    fn clear_tier(&mut self, tier: Tier) {
        self.core.clear_kv_row_tier(self.row, tier);
    }
}

pub(super) struct Subscriber {
    spec: Spec,
    current: Arc<Current>,
    metrics: KvMetrics,
    stop: Stop,
    ingest: RowIngest,
    /// The configuration whose core holds this row's blocks.
    config_number: u64,
    /// Conditions already logged at `warn` (later ones go to `debug`).
    warned: HashSet<&'static str>,
    /// Most blocks indexed per tier without a known capacity.
    max_indexed_blocks: u64,
    /// When an over-limit clear was last logged at `warn`.
    overflow_logged: Option<Instant>,
    /// What the row's index state is derived from.
    trust: Trust,
    /// Thins the state-change log lines.
    state_log: router_core::log_limit::LogThrottle,
    /// The warm start still to run at the first subscribe, and what `/ready` waits for.
    warm: Option<WarmGate>,
    /// Live batches up to this sequence number were replayed by the warm start (until then).
    warm_skip: Option<(u64, Instant)>,
    /// The sequence number of the last batch a replay applied.
    replayed: Option<u64>,
}

impl Subscriber {
    pub(super) fn new(
        spec: Spec,
        current: Arc<Current>,
        metrics: KvMetrics,
        stop: Stop,
        warm: Option<WarmGate>,
    ) -> Result<Subscriber, router_core::blocks::BlockHashError> {
        let ingest = RowIngest::new(spec.block_size)?;
        let max_indexed_blocks = spec.max_indexed_blocks;
        let config_number = current.load().number;
        Ok(Subscriber {
            spec,
            current,
            metrics,
            stop,
            ingest,
            config_number,
            warned: HashSet::new(),
            max_indexed_blocks,
            overflow_logged: None,
            trust: Trust::default(),
            state_log: router_core::log_limit::LogThrottle::new(),
            warm,
            warm_skip: None,
            replayed: None,
        })
    }

    fn row(&self) -> RowId {
        RowId {
            worker_id: self.spec.worker,
            dp_rank: self.spec.rank,
        }
    }

    fn row_labels(&self) -> RowLabels {
        RowLabels {
            worker: self.spec.worker.to_string(),
            dp_rank: self.spec.rank.to_string(),
        }
    }

    fn tier_labels(&self, tier: Tier) -> RowTierLabels {
        RowTierLabels {
            worker: self.spec.worker.to_string(),
            dp_rank: self.spec.rank.to_string(),
            tier: tier.as_str().to_owned(),
        }
    }

    fn kind_labels(&self, kind: &str) -> KvKindLabels {
        KvKindLabels {
            worker: self.spec.worker.to_string(),
            dp_rank: self.spec.rank.to_string(),
            kind: kind.to_owned(),
        }
    }

    /// Log a condition at `warn` the first time, at `debug` after that (`disconnected` is
    /// warned again after each successful subscribe: each outage is worth one line).
    fn warn_once(&mut self, condition: &'static str, detail: &dyn std::fmt::Display) {
        let (worker, rank, endpoint) = (self.spec.worker, self.spec.rank, &self.spec.endpoint);
        if self.warned.insert(condition) {
            tracing::warn!(worker, dp_rank = rank, endpoint = %endpoint, condition, %detail,
                "KV events: {condition} (repeats are logged at debug; counted in metrics)");
        } else {
            tracing::debug!(worker, dp_rank = rank, condition, %detail, "KV events");
        }
    }

    /// Set the row's index state in the core serving now (every time: a reloaded core starts
    /// with the row current), and, when it changed, in the gauges, the transitions counter and
    /// the log.
    fn publish_trust(&mut self) {
        let state = self.trust.state();
        self.current
            .load()
            .host
            .core()
            .set_kv_index_state(self.row(), state);
        let previous = self.trust.published.replace(state);
        if previous == Some(state) {
            return;
        }
        for s in KvIndexState::ALL {
            self.metrics
                .index_state
                .get_or_create(&RowStateLabels {
                    worker: self.spec.worker.to_string(),
                    dp_rank: self.spec.rank.to_string(),
                    state: s.as_str(),
                })
                .set(i64::from(s == state));
        }
        let Some(previous) = previous else { return };
        self.metrics
            .state_transitions
            .get_or_create(&RowTransitionLabels {
                worker: self.spec.worker.to_string(),
                dp_rank: self.spec.rank.to_string(),
                from: previous.as_str(),
                to: state.as_str(),
            })
            .inc();
        let Some(left_out) = self.state_log.admit_now(STATE_LOG_EVERY) else {
            return;
        };
        // Stale is what an operator acts on; connects and lag come and go with the engine.
        let (worker, rank) = (self.spec.worker, self.spec.rank);
        let (from, to) = (previous.as_str(), state.as_str());
        if state == KvIndexState::Stale {
            tracing::warn!(
                worker,
                dp_rank = rank,
                from,
                to,
                stale_clear_ms = self.spec.stale_clear_ms,
                similar_lines_left_out = left_out,
                "KV index state changed: batches were lost and not replayed; policies route \
                 load-only on this row until its entries are cleared"
            );
        } else {
            tracing::info!(
                worker,
                dp_rank = rank,
                from,
                to,
                similar_lines_left_out = left_out,
                "KV index state changed"
            );
        }
    }

    /// A stale row whose time is up: clear its entries (the index then holds only what arrives
    /// from now on, which is true) and trust it again.
    fn clear_if_stale_expired(&mut self) {
        if self
            .trust
            .stale_until
            .is_none_or(|until| Instant::now() < until)
        {
            return;
        }
        self.trust.stale_until = None;
        self.clear_row("stale");
        tracing::info!(
            worker = self.spec.worker,
            dp_rank = self.spec.rank,
            stale_clear_ms = self.spec.stale_clear_ms,
            "KV events: the row was stale for kv_events.stale_clear_ms; its entries were cleared"
        );
        self.publish_trust();
    }

    fn set_connected(&self, up: bool) {
        self.metrics
            .connected
            .get_or_create(&self.row_labels())
            .set(i64::from(up));
    }

    /// Run until stopped. A session that ends (the peer went away, broke the protocol, or a
    /// bug panicked) sets the connected gauge to 0 and is retried after a backoff of
    /// [`BACKOFF_MIN`] doubling to [`BACKOFF_MAX`]; the backoff starts over after a session
    /// that stayed subscribed for [`BACKOFF_MAX`] (so a publisher that breaks the protocol
    /// right after subscribing is retried, and logged, at most every 5 s). Stopped (its worker
    /// left the configuration), it removes its row's gauges.
    pub(super) async fn run(mut self) {
        self.set_connected(false);
        self.publish_trust();
        let mut backoff = BACKOFF_MIN;
        while !self.stop.is_cancelled() {
            let mut subscribed_at = None;
            let outcome = caught(self.session(&mut subscribed_at)).await;
            self.set_connected(false);
            // Whatever happened while disconnected is unknown until a batch comes again.
            self.trust.fresh = false;
            self.publish_trust();
            match outcome {
                Ok(Ok(())) => break,
                Ok(Err(err)) => self.session_failed(&err),
                Err(panic) => self.session_panicked(&panic),
            }
            if subscribed_at.is_some_and(|at: Instant| at.elapsed() >= BACKOFF_MAX) {
                backoff = BACKOFF_MIN;
            }
            let wait = backoff.mul_f64(1.0 - 0.2 * random_fraction());
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = self.stop.cancelled() => break,
            }
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
        self.forget_gauges();
    }

    /// The row's worker left the configuration: its gauges go from `/metrics` (a removed
    /// worker shown as disconnected, stale or holding blocks would page an operator for an
    /// engine nobody runs). Its counters stay: what happened, happened.
    fn forget_gauges(&self) {
        let row = self.row_labels();
        self.metrics.connected.remove(&row);
        self.metrics.lag.remove(&row);
        for tier in Tier::ALL {
            self.metrics.blocks.remove(&self.tier_labels(tier));
        }
        for state in KvIndexState::ALL {
            self.metrics.index_state.remove(&RowStateLabels {
                worker: row.worker.clone(),
                dp_rank: row.dp_rank.clone(),
                state: state.as_str(),
            });
        }
    }

    fn session_failed(&mut self, err: &ProtocolError) {
        let Some(kind) = err.kind() else {
            self.warn_once("disconnected", err);
            return;
        };
        self.metrics
            .protocol_errors
            .get_or_create(&self.kind_labels(kind))
            .inc();
        // A protocol violation is logged every time: it drops the connection, so it repeats
        // at most once per backoff.
        tracing::warn!(
            worker = self.spec.worker,
            dp_rank = self.spec.rank,
            endpoint = %self.spec.endpoint,
            kind,
            error = %err,
            "KV events: protocol error; connection dropped, reconnecting"
        );
    }

    fn session_panicked(&mut self, message: &str) {
        self.metrics.panics.get_or_create(&self.row_labels()).inc();
        tracing::error!(
            worker = self.spec.worker,
            dp_rank = self.spec.rank,
            endpoint = %self.spec.endpoint,
            panic = message,
            "KV events: the subscriber panicked; reconnecting"
        );
    }

    /// One connection: `Ok` when stopped, `Err` when the connection could not be made or broke.
    async fn session(&mut self, subscribed_at: &mut Option<Instant>) -> Result<(), ProtocolError> {
        let endpoint = self.spec.endpoint.clone();
        let mut conn = tokio::select! {
            conn = Connection::connect(&endpoint, SocketType::Sub, LIMITS, CONNECT_TIMEOUT) => conn?,
            () = self.stop.cancelled() => return Ok(()),
        };
        conn.subscribe(self.spec.topic.as_bytes()).await?;
        *subscribed_at = Some(Instant::now());
        self.set_connected(true);
        self.warned.remove("disconnected");
        tracing::info!(
            worker = self.spec.worker,
            dp_rank = self.spec.rank,
            endpoint = %self.spec.endpoint,
            "KV events: subscribed"
        );
        if let Some(gate) = self.warm.take() {
            let stop = self.stop.clone();
            tokio::select! {
                () = self.warm_start(&gate) => {}
                () = stop.cancelled() => return Ok(()),
            }
            gate.finish();
        }
        let mut tick = tokio::time::interval(GENERATION_CHECK);
        loop {
            tokio::select! {
                message = conn.recv() => self.message(message?).await,
                _ = tick.tick() => {
                    self.follow_generation();
                    self.clear_if_stale_expired();
                }
                () = self.stop.cancelled() => return Ok(()),
            }
        }
    }

    /// Fill the row from the replay socket: every batch the engine still buffers, before its
    /// deadline (`warm_start_ms` from the start). What arrived is applied whatever happens
    /// next; a warm start that fails or runs out of time leaves the row to the live batches.
    async fn warm_start(&mut self, gate: &WarmGate) {
        let Some(endpoint) = self.spec.replay_endpoint.clone() else {
            return;
        };
        let started = Instant::now();
        let deadline = Instant::from_std(gate.deadline);
        self.replayed = None;
        let outcome = tokio::time::timeout_at(deadline, self.replay(&endpoint, 0, u64::MAX)).await;
        // Whatever ended the replay, the live batches continue from the last batch it applied
        // (a gap after it is replayed), and none is applied twice.
        if let Some(last) = self.replayed.take() {
            let _ = self.ingest.check_seq(last);
            self.warm_skip = Some((last, Instant::now() + WARM_SKIP_WINDOW));
            self.trust.fresh = true;
            self.publish_trust();
        }
        let (worker, rank) = (self.spec.worker, self.spec.rank);
        let kind = match outcome {
            Ok(Ok((applied, last))) => {
                tracing::info!(
                    worker,
                    dp_rank = rank,
                    batches = applied,
                    last_seq = last,
                    blocks = self.ingest.blocks_on(Tier::Device),
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "KV events: warm start filled the row from the engine's replay buffer"
                );
                "warm_ok"
            }
            Ok(Err(err)) => {
                self.warn_once("warm start failed", &err);
                "warm_error"
            }
            Err(_) => {
                tracing::warn!(
                    worker,
                    dp_rank = rank,
                    warm_start_ms = self.spec.warm_start_ms,
                    blocks = self.ingest.blocks_on(Tier::Device),
                    "KV events: warm start did not finish within kv_events.warm_start_ms; the \
                     row goes on with what it got and the live batches"
                );
                "warm_timeout"
            }
        };
        self.metrics
            .replays
            .get_or_create(&self.kind_labels(kind))
            .inc();
    }

    /// After a reload the core is new and its index empty: give it this row's blocks.
    fn follow_generation(&mut self) {
        let loaded = self.current.load();
        if loaded.number == self.config_number {
            return;
        }
        self.config_number = loaded.number;
        let row = self.row();
        let core = loaded.host.core();
        // The state first: the new core takes the row as current until told otherwise.
        core.set_kv_index_state(row, self.trust.state());
        core.clear_kv_row(row);
        core.apply_kv_events(row, self.ingest.holdings());
    }

    fn count_protocol_error(&self, err: &ProtocolError) {
        if let Some(kind) = err.kind() {
            self.metrics
                .protocol_errors
                .get_or_create(&self.kind_labels(kind))
                .inc();
        }
    }

    fn count_decode_error(&mut self, kind: &'static str, err: &DecodeError) {
        self.metrics
            .decode_errors
            .get_or_create(&self.kind_labels(kind))
            .inc();
        self.warn_once(kind, err);
    }

    /// A live message: `[topic, seq, payload]`.
    async fn message(&mut self, frames: Vec<Bytes>) {
        self.follow_generation();
        if frames
            .first()
            .is_some_and(|topic| !topic.starts_with(self.spec.topic.as_bytes()))
        {
            return; // another topic (a publisher that does not filter)
        }
        if frames.len() != 3 {
            self.count_decode_error("frames", &DecodeError::Frames(frames.len()));
            return;
        }
        let seq = match decode_seq(&frames[1]) {
            Ok(seq) => seq,
            Err(err) => return self.count_decode_error("frames", &err),
        };
        if let Some((last, until)) = self.warm_skip {
            if seq <= last && Instant::now() < until {
                return; // the warm start's replay gave it already
            }
            self.warm_skip = None;
        }
        self.metrics.batches.get_or_create(&self.row_labels()).inc();
        self.trust.fresh = true;
        match self.ingest.check_seq(seq) {
            SeqCheck::First | SeqCheck::InOrder => {}
            SeqCheck::Restart { last, got } => {
                // The engine's cache is gone with it: the index starts over, nothing stale.
                self.trust.stale_until = None;
                self.restart(last, got);
            }
            SeqCheck::Gap { expected, got } => {
                self.metrics.gaps.get_or_create(&self.row_labels()).inc();
                self.warn_once(
                    "sequence gap",
                    &format_args!("batches {expected}..{got} lost"),
                );
                let filled = match self.spec.replay_endpoint.clone() {
                    Some(replay) => {
                        let outcome = match self.replay(&replay, expected, got).await {
                            Ok(_) => "ok",
                            Err(err) => {
                                self.warn_once("replay failed", &err);
                                "error"
                            }
                        };
                        self.metrics
                            .replays
                            .get_or_create(&self.kind_labels(outcome))
                            .inc();
                        outcome == "ok"
                    }
                    None => false,
                };
                if !filled && self.trust.stale_until.is_none() {
                    let clear_after = Duration::from_millis(self.spec.stale_clear_ms);
                    self.trust.stale_until = Some(Instant::now() + clear_after);
                }
            }
        }
        self.payload(&frames[2]);
        self.publish_trust();
    }

    fn restart(&mut self, last: u64, got: u64) {
        tracing::info!(
            worker = self.spec.worker,
            dp_rank = self.spec.rank,
            last_seq = last,
            seq = got,
            "KV events: the sequence went backwards (engine restarted); row cleared"
        );
        self.clear_row("restart");
    }

    /// Drop every block of this row from the index serving now (counted by `kind`).
    fn clear_row(&mut self, kind: &str) {
        self.metrics
            .clears
            .get_or_create(&self.kind_labels(kind))
            .inc();
        let loaded = self.current.load();
        self.config_number = loaded.number;
        let mut sink = CoreSink {
            core: loaded.host.core(),
            row: self.row(),
        };
        self.ingest.clear(&mut sink);
        self.update_blocks();
    }

    fn update_blocks(&self) {
        for tier in Tier::ALL {
            if tier != Tier::Device && !self.ingest.has_seen(tier) {
                continue; // no offload tier on this engine (yet): no series for it
            }
            let blocks = self.ingest.blocks_on(tier);
            self.metrics
                .blocks
                .get_or_create(&self.tier_labels(tier))
                .set(i64::try_from(blocks).unwrap_or(i64::MAX));
        }
    }

    /// The limits of this row's tiers: `max_indexed_blocks`, and on the device the engine's
    /// reported capacity (plus slack) when known and smaller. The capacity comes from the
    /// engine's own `/metrics`, as untrusted as its events: it can lower the bound, not raise it.
    fn set_limits(&mut self, core: &router_core::routing::RoutingCore) {
        let capacity = core
            .topology()
            .cluster()
            .worker(self.spec.worker)
            .and_then(|w| w.total_kv_blocks)
            .map(capacity_limit);
        let cap = usize::try_from(self.max_indexed_blocks).unwrap_or(usize::MAX);
        for tier in Tier::ALL {
            match capacity {
                Some(limit) if tier == Tier::Device && limit <= cap => {
                    self.ingest.set_limit(tier, limit, "over_capacity")
                }
                _ => self.ingest.set_limit(tier, cap, "over_limit"),
            }
        }
    }

    /// Decode and apply one payload.
    fn payload(&mut self, payload: &[u8]) {
        let batch = match decode_batch(payload) {
            Ok(batch) => batch,
            Err(err) => return self.count_decode_error("payload", &err),
        };
        let loaded = self.current.load();
        self.set_limits(loaded.host.core());
        let mut sink = CoreSink {
            core: loaded.host.core(),
            row: self.row(),
        };
        let mut tally = Tally::default();
        let ts = batch.ts;
        self.ingest.apply(batch.events, &mut sink, &mut tally);
        self.record(&tally);
        self.update_blocks();
        let cleared = tally
            .clears
            .iter()
            .any(|&(cause, n)| cause == "all_blocks_cleared" && n > 0);
        // The engine emptied its device cache: what arrives from here is the whole truth, unless
        // an offload tier (which that event does not clear) may still hold lost entries.
        if cleared && !self.ingest.has_seen(Tier::Host) && !self.ingest.has_seen(Tier::Disk) {
            self.trust.stale_until = None;
        }
        if let Some(ts) = ts.filter(|ts| ts.is_finite()) {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            // Clock skew between hosts can make it negative: shown as 0.
            let lag = (now - ts).max(0.0);
            self.metrics.lag.get_or_create(&self.row_labels()).set(lag);
            self.trust.lagging = lag * 1000.0 > self.spec.max_lag_ms as f64;
        }
    }

    fn record_evictions(&mut self, tally: &Tally) {
        for &(tier, reason, blocks) in &tally.evicted {
            self.metrics
                .evictions
                .get_or_create(&RowTierReasonLabels {
                    worker: self.spec.worker.to_string(),
                    dp_rank: self.spec.rank.to_string(),
                    tier: tier.as_str().to_owned(),
                    reason: reason.to_owned(),
                })
                .inc_by(blocks);
            let now = Instant::now();
            let due = self
                .overflow_logged
                .is_none_or(|at| now.duration_since(at) >= OVERFLOW_LOG_EVERY);
            if due {
                self.overflow_logged = Some(now);
                tracing::warn!(
                    worker = self.spec.worker,
                    dp_rank = self.spec.rank,
                    tier = tier.as_str(),
                    reason,
                    blocks,
                    "KV events: the row's index went over its limit (the engine's events \
                     contradict its capacity); tier cleared (logged at most once a minute; \
                     counted in router_kv_index_evictions_total)"
                );
            } else {
                tracing::debug!(
                    worker = self.spec.worker,
                    dp_rank = self.spec.rank,
                    tier = tier.as_str(),
                    reason,
                    blocks,
                    "KV events: tier cleared (over its limit)"
                );
            }
        }
    }

    fn record(&mut self, tally: &Tally) {
        let families = [
            (&self.metrics.events, &tally.applied),
            (&self.metrics.refused, &tally.refused),
            (&self.metrics.ignored, &tally.ignored),
            (&self.metrics.decode_errors, &tally.decode_errors),
            (&self.metrics.clears, &tally.clears),
        ];
        for (family, counts) in families {
            for (label, n) in counts {
                family.get_or_create(&self.kind_labels(label)).inc_by(*n);
            }
        }
        self.record_evictions(tally);
        for (label, _) in &tally.refused {
            self.warn_once(label, &"event refused");
        }
        if !tally.decode_errors.is_empty() {
            self.warn_once("undecodable event", &"event skipped");
        }
    }

    /// Ask the replay socket for batches `from ..` and apply those before `until`, in order;
    /// returns how many were applied and the last one's sequence number.
    /// vLLM's protocol: a DEALER sends `["", start_seq (8 bytes BE)]`; replies are
    /// `["", topic, seq, payload]` (older: `["", seq, payload]`), ending with seq = u64::MAX.
    async fn replay(
        &mut self,
        endpoint: &str,
        from: u64,
        until: u64,
    ) -> Result<(u64, Option<u64>), String> {
        let mut dealer = Connection::connect(endpoint, SocketType::Dealer, LIMITS, CONNECT_TIMEOUT)
            .await
            .map_err(|err| {
                self.count_protocol_error(&err);
                err.to_string()
            })?;
        tokio::time::timeout(REPLAY_TIMEOUT, dealer.send(&[b"", &from.to_be_bytes()]))
            .await
            .map_err(|_| "send timed out".to_owned())?
            .map_err(|err| format!("send: {err}"))?;
        let mut applied = 0;
        let mut last = None;
        loop {
            let reply = tokio::time::timeout(REPLAY_TIMEOUT, dealer.recv())
                .await
                .map_err(|_| "no reply in time".to_owned())?
                .map_err(|err| {
                    self.count_protocol_error(&err);
                    format!("receive: {err}")
                })?;
            let mut frames = reply;
            if frames.first().is_some_and(|f| f.is_empty()) && frames.len() >= 3 {
                frames.remove(0);
            }
            let (seq, payload) = match frames.as_slice() {
                [_, seq, payload] | [seq, payload] => (decode_seq(seq), payload.clone()),
                other => {
                    self.count_decode_error("frames", &DecodeError::Frames(other.len()));
                    continue;
                }
            };
            let seq = match seq {
                Ok(seq) => seq,
                Err(err) => {
                    self.count_decode_error("frames", &err);
                    continue;
                }
            };
            if seq == u64::MAX {
                break;
            }
            if seq >= until {
                // The live message that revealed the gap, and later ones, come live.
                continue;
            }
            if seq < from {
                continue;
            }
            self.payload(&payload);
            applied += 1;
            last = Some(seq);
            self.replayed = last;
        }
        Ok((applied, last))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panicking_session_becomes_an_error_with_its_message() {
        assert_eq!(caught(async { 7 }).await, Ok(7));
        let index = 3;
        let outcome = caught(async move {
            let empty: Vec<u8> = Vec::new();
            empty[index]
        })
        .await;
        assert!(
            matches!(&outcome, Err(m) if m.contains("index out of bounds")),
            "{outcome:?}"
        );
        assert_eq!(
            caught(async { std::panic::panic_any(5u8) }).await,
            Err::<(), _>("(no message)".to_owned())
        );
    }

    #[test]
    fn the_index_state_is_the_first_rule_that_holds() {
        let mut trust = Trust {
            fresh: false,
            stale_until: Some(Instant::now()),
            lagging: true,
            published: None,
        };
        assert_eq!(
            trust.state(),
            KvIndexState::Unknown,
            "nothing since the connect"
        );
        trust.fresh = true;
        assert_eq!(trust.state(), KvIndexState::Stale);
        trust.stale_until = None;
        assert_eq!(trust.state(), KvIndexState::Lagging);
        trust.lagging = false;
        assert_eq!(trust.state(), KvIndexState::Current);
        assert_eq!(Trust::default().state(), KvIndexState::Unknown);
    }

    #[test]
    fn backoff_waits_double_to_the_longest_with_jitter_below() {
        for _ in 0..100 {
            let f = random_fraction();
            assert!((0.0..1.0).contains(&f));
            let wait = BACKOFF_MAX.mul_f64(1.0 - 0.2 * f);
            assert!(wait <= BACKOFF_MAX && wait >= BACKOFF_MAX.mul_f64(0.8));
        }
    }
}
