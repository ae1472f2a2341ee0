//! What every handler and background task of a running server shares ([`App`]): the
//! configuration serving now, the health table, the metrics, the requests in flight, the
//! KV-event subscribers, where decisions run. Nothing here knows a front end's protocol: each
//! front end holds an `Arc<App>`. Reloading is in `reload.rs`, the background work in
//! `background.rs`.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use super::failure::ServeError;
use super::health::{self, HealthTable};
use super::metrics::Metrics;
use super::state::{Current, LoadedConfig, ServeOptions, Upstream};
use super::stop::Stop;
use super::{decider, kv_events, scrape};

/// Shared by every handler and background task.
pub struct App {
    pub current: Arc<Current>,
    pub options: ServeOptions,
    pub metrics: Metrics,
    pub health: Arc<HealthTable>,
    /// Requests booked and not yet finished, across loaded configurations.
    pub flights: AtomicUsize,
    /// A request was booked or released: the shared load publishes sooner than its period
    /// (`background::share_load`), so the other replicas see a row fill and free up (the next
    /// turn of a session may be on its way to one of them) about as soon as this one does.
    pub booking_changed: tokio::sync::Notify,
    pub stopping: Stop,
    /// Which reloads started and which was swapped in (`App::reload`, `reload.rs`).
    pub(crate) reloads: Reloads,
    tokenizer_turn: AtomicUsize,
    /// KV-event subscribers, one per `(worker, rank)` with `kv_events` (`kv_events/`).
    pub kv_subscribers: kv_events::Subscribers,
    /// Where routing decisions run (`decider.rs`): for the whole process, across reloads.
    pub decider: decider::Decider,
    /// A front end's own rule on the configuration (`epp`: workers by IP), set once after
    /// start and checked by every reload: a configuration that breaks it is refused.
    pub front_end_rule: std::sync::OnceLock<FrontEndRule>,
}

/// A front end's rule on a loaded configuration: `Err` says what breaks it, naming the file and
/// the entry.
pub type FrontEndRule = fn(&router_config::RouterConfig) -> Result<(), String>;

impl std::fmt::Debug for App {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("App")
            .field("current", &self.current)
            .field("flights", &self.flights)
            .finish_non_exhaustive()
    }
}

impl App {
    /// Load the configuration (plugins, instances, workers, tokenizer) and build what every
    /// front end shares; nothing runs yet ([`App::probe_engines`], [`crate::background::start`]).
    pub async fn start(options: ServeOptions) -> Result<Arc<App>, ServeError> {
        let load_options = options.clone();
        let loaded =
            tokio::task::spawn_blocking(move || LoadedConfig::load(&load_options, 1, None))
                .await
                .map_err(|err| ServeError::ReloadTask(err.to_string()))??;
        let health = Arc::new(HealthTable::default());
        health.sync(&loaded.upstreams);
        let current = Arc::new(Current::new(loaded));
        let metrics = Metrics::new(Box::new(scrape::StateCollector {
            current: current.clone(),
            health: health.clone(),
        }));
        Ok(Arc::new(App {
            current,
            options,
            metrics,
            health,
            flights: AtomicUsize::new(0),
            booking_changed: tokio::sync::Notify::new(),
            stopping: Stop::default(),
            reloads: Reloads::default(),
            tokenizer_turn: AtomicUsize::new(0),
            kv_subscribers: kv_events::Subscribers::default(),
            decider: decider::Decider::for_current_runtime(),
            front_end_rule: std::sync::OnceLock::new(),
        }))
    }

    /// One round of health probes: before serving, so the first requests know which engines
    /// answer.
    pub async fn probe_engines(&self) {
        let loaded = self.current.load();
        health::probe_round(&self.health, &self.metrics, &loaded).await;
    }

    /// The engine to ask for remote tokenization: the healthy ones in turn.
    pub(crate) fn tokenizer_upstream<'g>(&self, loaded: &'g LoadedConfig) -> Option<&'g Upstream> {
        let healthy: Vec<&Upstream> = loaded
            .upstreams
            .iter()
            .filter(|u| self.health.is_healthy(u.id))
            .collect();
        if healthy.is_empty() {
            return None;
        }
        let turn = self.tokenizer_turn.fetch_add(1, Ordering::Relaxed);
        Some(healthy[turn % healthy.len()])
    }
}

/// Which reloads started and which was swapped in last.
#[derive(Debug)]
pub(crate) struct Reloads {
    /// Held while a reload swaps its configuration in (not while it loads).
    pub(crate) swap_lock: tokio::sync::Mutex<()>,
    /// The number of the configuration serving now.
    pub(crate) serving: AtomicU64,
    /// Reloads started, and which of them was swapped in last.
    pub(crate) started: AtomicU64,
    pub(crate) swapped: AtomicU64,
}

impl Default for Reloads {
    fn default() -> Reloads {
        Reloads {
            swap_lock: tokio::sync::Mutex::new(()),
            // The configuration loaded at start is number 1.
            serving: AtomicU64::new(1),
            started: AtomicU64::new(0),
            swapped: AtomicU64::new(0),
        }
    }
}
