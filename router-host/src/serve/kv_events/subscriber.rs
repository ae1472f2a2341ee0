//! One `(worker, rank)` subscriber: a ZMQ SUB connected to the engine's publisher, its own
//! tokio task. It decodes each message, applies it to the current configuration's routing core
//! in one batch per message (a short write lock on the KV index, never awaited under), and
//! reconnects with backoff when the engine goes away. A gap in the sequence numbers is counted
//! and, with a replay endpoint, filled by asking the engine's replay socket.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use router_core::kv_index::Tier;
use zeromq::{Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

use super::decode::{decode_payload, decode_seq, DecodeError};
use super::ingest::{RowIngest, SeqCheck, Sink, Tally, Update};
use super::Spec;
use crate::model::RowId;
use crate::serve::metrics::{KvKindLabels, KvMetrics, RowLabels, RowTierLabels};
use crate::serve::state::Current;
use crate::serve::Stop;

/// First and longest wait between connection attempts.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Limit on one connection attempt, and on each replay step.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// How often a quiet subscriber checks for a reloaded configuration (to seed its new index).
const GENERATION_CHECK: Duration = Duration::from_millis(500);

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
    generation: u64,
    /// Conditions already logged at `warn` (later ones go to `debug`).
    warned: HashSet<&'static str>,
}

impl Subscriber {
    pub(super) fn new(
        spec: Spec,
        current: Arc<Current>,
        metrics: KvMetrics,
        stop: Stop,
    ) -> Result<Subscriber, router_core::blocks::BlockHashError> {
        let ingest = RowIngest::new(spec.block_size)?;
        let generation = current.load().number;
        Ok(Subscriber {
            spec,
            current,
            metrics,
            stop,
            ingest,
            generation,
            warned: HashSet::new(),
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

    /// Log a condition at `warn` the first time, at `debug` after that.
    fn warn_once(&mut self, condition: &'static str, detail: &dyn std::fmt::Display) {
        let (worker, rank, endpoint) = (self.spec.worker, self.spec.rank, &self.spec.endpoint);
        if self.warned.insert(condition) {
            tracing::warn!(worker, dp_rank = rank, endpoint = %endpoint, condition, %detail,
                "KV events: {condition} (logged once per subscriber; counted in metrics)");
        } else {
            tracing::debug!(worker, dp_rank = rank, condition, %detail, "KV events");
        }
    }

    fn set_connected(&self, up: bool) {
        self.metrics
            .connected
            .get_or_create(&self.row_labels())
            .set(i64::from(up));
    }

    /// Run until stopped.
    pub(super) async fn run(mut self) {
        self.set_connected(false);
        let mut backoff = BACKOFF_MIN;
        while !self.stop.is_cancelled() {
            match self.session().await {
                Ok(()) => return,
                Err(err) => {
                    self.set_connected(false);
                    self.warn_once("disconnected", &err);
                }
            }
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                () = self.stop.cancelled() => break,
            }
            backoff = (backoff * 2).min(BACKOFF_MAX);
            if self.ingest.last_seq().is_some() {
                // A session got far enough to see messages: start the backoff over.
                backoff = BACKOFF_MIN;
            }
        }
        self.set_connected(false);
    }

    /// One connection: `Ok` when stopped, `Err` when the connection could not be made or broke.
    async fn session(&mut self) -> Result<(), String> {
        let mut options = SocketOptions::default();
        options.connect_timeout(CONNECT_TIMEOUT);
        let mut socket = zeromq::SubSocket::with_options(options);
        let mut monitor = socket.monitor();
        let endpoint = self.spec.endpoint.clone();
        tokio::select! {
            connected = tokio::time::timeout(CONNECT_TIMEOUT, socket.connect(&endpoint)) => {
                match connected {
                    Ok(Ok(())) => {}
                    Ok(Err(err)) => return Err(format!("connect: {err}")),
                    Err(_) => return Err("connect: timed out".to_owned()),
                }
            }
            () = self.stop.cancelled() => return Ok(()),
        }
        socket
            .subscribe(&self.spec.topic)
            .await
            .map_err(|err| format!("subscribe: {err}"))?;
        self.set_connected(true);
        self.warned.remove("disconnected");
        tracing::info!(
            worker = self.spec.worker,
            dp_rank = self.spec.rank,
            endpoint = %self.spec.endpoint,
            "KV events: subscribed"
        );
        let mut tick = tokio::time::interval(GENERATION_CHECK);
        loop {
            tokio::select! {
                message = socket.recv() => match message {
                    Ok(message) => self.message(message).await,
                    Err(err) => return Err(format!("receive: {err}")),
                },
                event = monitor.next() => match event {
                    Some(SocketEvent::Connected(..)) => self.set_connected(true),
                    Some(SocketEvent::Disconnected(..)) => self.set_connected(false),
                    Some(_) => {}
                    None => return Err("the socket monitor closed".to_owned()),
                },
                _ = tick.tick() => self.follow_generation(),
                () = self.stop.cancelled() => return Ok(()),
            }
        }
    }

    /// After a reload the core is new and its index empty: give it this row's blocks.
    fn follow_generation(&mut self) {
        let generation = self.current.load();
        if generation.number == self.generation {
            return;
        }
        self.generation = generation.number;
        let row = self.row();
        let core = generation.host.core();
        core.clear_kv_row(row);
        core.apply_kv_events(row, self.ingest.holdings());
    }

    fn count_decode_error(&mut self, kind: &'static str, err: &DecodeError) {
        self.metrics
            .decode_errors
            .get_or_create(&self.kind_labels(kind))
            .inc();
        self.warn_once(kind, err);
    }

    /// A live message: `[topic, seq, payload]`.
    async fn message(&mut self, message: ZmqMessage) {
        self.follow_generation();
        let frames = message.into_vec();
        if frames.len() != 3 {
            self.count_decode_error("frames", &DecodeError::Frames(frames.len()));
            return;
        }
        let seq = match decode_seq(&frames[1]) {
            Ok(seq) => seq,
            Err(err) => return self.count_decode_error("frames", &err),
        };
        self.metrics.batches.get_or_create(&self.row_labels()).inc();
        match self.ingest.check_seq(seq) {
            SeqCheck::First | SeqCheck::InOrder => {}
            SeqCheck::Restart { last, got } => {
                self.restart(last, got);
            }
            SeqCheck::Gap { expected, got } => {
                self.metrics.gaps.get_or_create(&self.row_labels()).inc();
                self.warn_once(
                    "sequence gap",
                    &format_args!("batches {expected}..{got} lost"),
                );
                if let Some(replay) = self.spec.replay_endpoint.clone() {
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
                }
            }
        }
        self.payload(&frames[2]);
    }

    fn restart(&mut self, last: u64, got: u64) {
        self.metrics
            .clears
            .get_or_create(&self.kind_labels("restart"))
            .inc();
        tracing::info!(
            worker = self.spec.worker,
            dp_rank = self.spec.rank,
            last_seq = last,
            seq = got,
            "KV events: the sequence went backwards (engine restarted); row cleared"
        );
        let generation = self.current.load();
        self.generation = generation.number;
        let mut sink = CoreSink {
            core: generation.host.core(),
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

    /// Decode and apply one payload.
    fn payload(&mut self, payload: &[u8]) {
        let batch = match decode_payload(payload) {
            Ok(batch) => batch,
            Err(err) => return self.count_decode_error("payload", &err),
        };
        let generation = self.current.load();
        let mut sink = CoreSink {
            core: generation.host.core(),
            row: self.row(),
        };
        let mut tally = Tally::default();
        let ts = batch.ts;
        self.ingest.apply(batch, &mut sink, &mut tally);
        self.record(&tally);
        self.update_blocks();
        if let Some(ts) = ts.filter(|ts| ts.is_finite()) {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            // Clock skew between hosts can make it negative: shown as 0.
            self.metrics
                .lag
                .get_or_create(&self.row_labels())
                .set((now - ts).max(0.0));
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
        for (label, _) in &tally.refused {
            self.warn_once(label, &"event refused");
        }
        if !tally.decode_errors.is_empty() {
            self.warn_once("undecodable event", &"event skipped");
        }
    }

    /// Ask the replay socket for batches `from ..` and apply those before `until`, in order.
    /// vLLM's protocol: a DEALER sends `["", start_seq (8 bytes BE)]`; replies are
    /// `["", topic, seq, payload]` (older: `["", seq, payload]`), ending with seq = u64::MAX.
    async fn replay(&mut self, endpoint: &str, from: u64, until: u64) -> Result<u64, String> {
        let mut options = SocketOptions::default();
        options.connect_timeout(CONNECT_TIMEOUT);
        let mut dealer = zeromq::DealerSocket::with_options(options);
        tokio::time::timeout(CONNECT_TIMEOUT, dealer.connect(endpoint))
            .await
            .map_err(|_| "connect timed out".to_owned())?
            .map_err(|err| format!("connect: {err}"))?;
        let mut request = ZmqMessage::from(Bytes::new());
        request.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
        tokio::time::timeout(REPLAY_TIMEOUT, dealer.send(request))
            .await
            .map_err(|_| "send timed out".to_owned())?
            .map_err(|err| format!("send: {err}"))?;
        let mut applied = 0;
        loop {
            let reply = tokio::time::timeout(REPLAY_TIMEOUT, dealer.recv())
                .await
                .map_err(|_| "no reply in time".to_owned())?
                .map_err(|err| format!("receive: {err}"))?;
            let mut frames = reply.into_vec();
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
        }
        Ok(applied)
    }
}
