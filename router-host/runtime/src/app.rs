//! What every handler and background task of a running server shares ([`App`]): the
//! configuration serving now, the health table, the metrics, the requests in flight, the
//! KV-event subscribers, and reloading. Nothing here knows HTTP: the front end's handlers
//! (`proxy`, `status`, `accept`) take an `Arc<App>` as their state.

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
    pub stopping: Stop,
    /// Held while a reload swaps its configuration in (not while it loads).
    reload_lock: tokio::sync::Mutex<()>,
    /// The number of the configuration serving now.
    loaded_configs: AtomicU64,
    /// Reloads started, and which of them was swapped in last.
    reloads_started: AtomicU64,
    swapped_reload: AtomicU64,
    tokenizer_turn: AtomicUsize,
    /// KV-event subscribers, one per `(worker, rank)` with `kv_events` (`kv_events/`).
    pub kv_subscribers: kv_events::Subscribers,
    /// Where routing decisions run (`decider.rs`): for the whole process, across reloads.
    pub decider: decider::Decider,
}

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
            stopping: Stop::default(),
            reload_lock: tokio::sync::Mutex::new(()),
            loaded_configs: AtomicU64::new(1),
            reloads_started: AtomicU64::new(0),
            swapped_reload: AtomicU64::new(0),
            tokenizer_turn: AtomicUsize::new(0),
            kv_subscribers: kv_events::Subscribers::default(),
            decider: decider::Decider::for_current_runtime(),
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

    /// Read the YAML again, build a new loaded configuration off the request path and swap it in.
    /// A configuration that fails keeps the running one; the error is logged and counted.
    ///
    /// Loading runs outside the reload lock: a load that never returns (a plugin's `create`
    /// hung; the watchdog reports it) must not hold up every reload after it. Only the swap is
    /// one at a time, and a load that finishes after a later-started one was swapped in is
    /// discarded (it read an older file).
    pub async fn reload(self: &Arc<Self>) -> Result<u64, ServeError> {
        let started = self.reloads_started.fetch_add(1, Ordering::SeqCst) + 1;
        let options = self.options.clone();
        let previous = self.current.load();
        self.metrics.reloads_loading.inc();
        let loading = tokio::task::spawn_blocking(move || {
            // Numbered when swapped in.
            LoadedConfig::load(&options, 0, Some(&previous))
        })
        .await;
        self.metrics.reloads_loading.dec();
        let loaded = loading
            .map_err(|err| ServeError::ReloadTask(err.to_string()))
            .and_then(|r| r);
        let _one_at_a_time = self.reload_lock.lock().await;
        let swapped = self.swapped_reload.load(Ordering::SeqCst);
        if started < swapped {
            let serving = self.current.load().number;
            self.metrics.reload("superseded");
            tracing::warn!(
                reload = started,
                serving,
                "a reload finished after a later one was swapped in; discarded"
            );
            return Err(ServeError::ReloadSuperseded { started, serving });
        }
        let mut next = match loaded {
            Ok(next) => next,
            Err(err) => {
                self.metrics.reload("error");
                tracing::error!(
                    error = %err,
                    serving = self.current.load().number,
                    "reload failed; still serving the running configuration"
                );
                return Err(err);
            }
        };
        let number = self.loaded_configs.load(Ordering::SeqCst) + 1;
        next.number = number;
        self.health.sync(&next.upstreams);
        self.health.apply(&next);
        let next = Arc::new(next);
        let previous = self.current.swap(next.clone());
        self.loaded_configs.store(number, Ordering::SeqCst);
        self.swapped_reload.store(started, Ordering::SeqCst);
        self.kv_subscribers
            .sync(&next, &self.current, &self.metrics.kv);
        self.metrics.reload("ok");
        if next.serve.listen != previous.serve.listen && self.options.listen.is_none() {
            tracing::warn!(
                listening = %previous.serve.listen,
                configured = %next.serve.listen,
                "serve.listen changed; the socket stays where it is until a restart"
            );
        }
        tracing::info!(
            config = number,
            workers = next.upstreams.len(),
            still_in_flight_on_previous = previous.host.in_flight(),
            "configuration reloaded"
        );
        let app = self.clone();
        tokio::spawn(async move {
            let loaded = app.current.load();
            health::probe_round(&app.health, &app.metrics, &loaded).await;
        });
        Ok(number)
    }
}
