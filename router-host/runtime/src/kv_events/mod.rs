//! KV-cache events from the engines (vLLM's ZMQ publisher) into the routing core's KV index
//! (docs/serve.md, "KV-cache events").
//!
//! One subscriber task per `(worker, rank)` with `kv_events` configured (`subscriber.rs`); the
//! wire format is decoded in `decode/` and turned into router block ids in `ingest/`. The
//! set of subscribers follows the configuration: [`Subscribers::sync`] on start and on every
//! reload starts the new ones and stops those whose worker or settings are gone; a subscriber
//! whose settings are unchanged keeps running and seeds the reloaded core with its blocks.
//!
//! Warm start: the subscribers of the first sync (the process starting) with a replay endpoint
//! and `warm_start_ms > 0` first fill their row from the engine's replay buffer; `/ready` waits
//! for them ([`Subscribers::warming`]), each at most its `warm_start_ms`.

pub mod decode;
pub mod ingest;
mod subscriber;
pub mod zmtp;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::metrics::KvMetrics;
use super::state::{Current, LoadedConfig};
use super::stop::Stop;

/// What one subscriber is: its row and settings (a change restarts it).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Spec {
    pub worker: u64,
    pub rank: u32,
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub topic: String,
    pub block_size: u32,
    pub max_indexed_blocks: u64,
    pub max_lag_ms: u64,
    pub stale_clear_ms: u64,
    pub warm_start_ms: u64,
}

/// The subscribers a configuration asks for.
pub fn specs(loaded: &LoadedConfig) -> Vec<Spec> {
    let mut out = Vec::new();
    for w in &loaded.config.workers {
        let Some(kv) = &w.kv_events else { continue };
        for rank in 0..w.dp_size {
            out.push(Spec {
                worker: w.id,
                rank,
                endpoint: kv.endpoint_for(rank),
                replay_endpoint: kv.replay_endpoint_for(rank),
                topic: kv.topic.clone(),
                block_size: w.block_size,
                max_indexed_blocks: kv.max_indexed_blocks,
                max_lag_ms: kv.max_lag_ms,
                stale_clear_ms: kv.stale_clear_ms,
                warm_start_ms: kv.warm_start_ms,
            });
        }
    }
    out
}

/// One row's warm start as `/ready` waits for it: until the subscriber says it is done, or
/// its deadline passes (an engine that never answers holds nobody up longer).
#[derive(Debug)]
pub(super) struct WarmGate {
    pub deadline: Instant,
    done: Arc<AtomicBool>,
}

impl WarmGate {
    /// The warm start ended (filled, failed or out of time).
    pub fn finish(&self) {
        self.done.store(true, Ordering::Release);
    }
}

impl Drop for WarmGate {
    fn drop(&mut self) {
        self.finish();
    }
}

/// The running subscribers.
#[derive(Debug, Default)]
pub struct Subscribers {
    running: Mutex<HashMap<Spec, (Stop, tokio::task::JoinHandle<()>)>>,
    /// Whether the first sync (the process starting) ran: only its rows warm-start.
    synced: AtomicBool,
    /// The warm starts `/ready` waits for: their deadline and whether they are done.
    warm: Mutex<Vec<(Instant, Arc<AtomicBool>)>>,
}

impl Subscribers {
    /// Make the running set match `loaded`: start what is new, stop what is gone.
    /// Must run inside the tokio runtime.
    pub fn sync(&self, loaded: &LoadedConfig, current: &Arc<Current>, metrics: &KvMetrics) {
        let wanted = specs(loaded);
        let first = !self.synced.swap(true, Ordering::AcqRel);
        let mut running = match self.running.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        running.retain(|spec, (stop, task)| {
            let keep = wanted.contains(spec);
            if !keep {
                stop.cancel();
                tracing::info!(
                    worker = spec.worker,
                    dp_rank = spec.rank,
                    "KV events: subscriber stopped (configuration changed)"
                );
            } else if task.is_finished() {
                // A subscriber only ends when stopped: this one died (it catches panics in
                // its sessions, so this is a bug). Started again below.
                tracing::error!(
                    worker = spec.worker,
                    dp_rank = spec.rank,
                    "KV events: subscriber task had ended; restarted"
                );
                metrics
                    .panics
                    .get_or_create(&super::metrics::RowLabels {
                        worker: spec.worker.to_string(),
                        dp_rank: spec.rank.to_string(),
                    })
                    .inc();
                return false;
            }
            keep
        });
        for spec in wanted {
            if running.contains_key(&spec) {
                continue;
            }
            let stop = Stop::default();
            // Only at start: a worker added by a reload joins a router that is serving.
            let gate = (first && spec.replay_endpoint.is_some() && spec.warm_start_ms > 0)
                .then(|| self.gate(Duration::from_millis(spec.warm_start_ms)));
            match subscriber::Subscriber::new(
                spec.clone(),
                current.clone(),
                metrics.clone(),
                stop.clone(),
                gate,
            ) {
                Ok(sub) => {
                    let task = tokio::spawn(sub.run());
                    running.insert(spec, (stop, task));
                }
                Err(err) => tracing::error!(
                    worker = spec.worker,
                    dp_rank = spec.rank,
                    error = %err,
                    "KV events: subscriber not started"
                ),
            }
        }
    }

    fn gate(&self, budget: Duration) -> WarmGate {
        let done = Arc::new(AtomicBool::new(false));
        let deadline = Instant::now() + budget;
        if let Ok(mut warm) = self.warm.lock() {
            warm.push((deadline, done.clone()));
        }
        WarmGate { deadline, done }
    }

    /// Rows still filling their KV index from their engine's replay buffer at start, each
    /// counted until it is done or its `warm_start_ms` has passed.
    pub fn warming(&self) -> usize {
        let Ok(mut warm) = self.warm.lock() else {
            return 0;
        };
        let now = Instant::now();
        warm.retain(|(deadline, done)| !done.load(Ordering::Acquire) && now < *deadline);
        warm.len()
    }

    /// Stop every subscriber (shutdown).
    pub fn stop_all(&self) {
        let mut running = match self.running.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        for (_, (stop, task)) in running.drain() {
            stop.cancel();
            task.abort();
        }
    }

    /// How many subscribers run.
    pub fn len(&self) -> usize {
        self.running.lock().map(|r| r.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
