//! Reloading (SIGHUP): the YAML read again and a new [`LoadedConfig`] built off the request
//! path, then swapped in while requests in flight finish on the one they started with.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::app::App;
use crate::failure::ServeError;
use crate::health;
use crate::state::LoadedConfig;

impl App {
    /// Read the YAML again, build a new loaded configuration off the request path and swap it in.
    /// A configuration that fails keeps the running one; the error is logged and counted.
    ///
    /// Loading runs outside the reload lock: a load that never returns (a plugin's `create`
    /// hung; the watchdog reports it) must not hold up every reload after it. Only the swap is
    /// one at a time, and a load that finishes after a later-started one was swapped in is
    /// discarded (it read an older file).
    pub async fn reload(self: &Arc<Self>) -> Result<u64, ServeError> {
        let started = self.reloads.started.fetch_add(1, Ordering::SeqCst) + 1;
        let options = self.options.clone();
        let previous = self.current.load();
        self.metrics.reloads_loading.inc();
        let rule = self.front_end_rule.get().copied();
        let loading = tokio::task::spawn_blocking(move || {
            // Numbered when swapped in.
            let loaded = LoadedConfig::load(&options, 0, Some(&previous))?;
            match rule.map(|rule| rule(&loaded.config)) {
                Some(Err(reason)) => Err(ServeError::FrontEnd { reason }),
                _ => Ok(loaded),
            }
        })
        .await;
        self.metrics.reloads_loading.dec();
        let loaded = loading
            .map_err(|err| ServeError::ReloadTask(err.to_string()))
            .and_then(|r| r);
        let _one_at_a_time = self.reloads.swap_lock.lock().await;
        let swapped = self.reloads.swapped.load(Ordering::SeqCst);
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
        let number = self.reloads.serving.load(Ordering::SeqCst) + 1;
        next.number = number;
        self.health.sync(&next.upstreams);
        self.health.apply(&next);
        let next = Arc::new(next);
        let previous = self.current.swap(next.clone());
        self.reloads.serving.store(number, Ordering::SeqCst);
        self.reloads.swapped.store(started, Ordering::SeqCst);
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
