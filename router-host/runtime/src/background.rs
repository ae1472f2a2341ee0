//! The work a running [`App`] does besides requests: the health probes, the admission
//! queues' timer and the KV-event subscribers, started by [`start`] and stopped by
//! [`Background::stop`] (or when the app stops).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::app::App;
use crate::{health, lifecycle};

/// Resolves `serve.timeouts.shutdown_ms` after the stop signal ([`App::stopping`]): how long a
/// front end lets the requests in flight finish once it stopped taking new ones. It completes
/// only when the deadline passes with requests still running (both logged); a front end races
/// it against its own server finishing.
pub async fn shutdown_deadline(app: &App) {
    app.stopping.cancelled().await;
    let limit = app.current.load().serve.timeouts.shutdown;
    tracing::info!(
        in_flight = app.flights.load(Ordering::SeqCst),
        deadline_ms = u64::try_from(limit.as_millis()).unwrap_or(u64::MAX),
        "shutting down: no new requests; waiting for requests in flight"
    );
    tokio::time::sleep(limit).await;
    tracing::warn!(
        in_flight = app.flights.load(Ordering::SeqCst),
        "shutdown deadline passed; stopping with requests still in flight"
    );
}

/// Start the background work; it runs until [`Background::stop`] or [`App::stopping`].
pub fn start(app: &Arc<App>) -> Background {
    let prober = tokio::spawn(probe_loop(app.clone()));
    let ticker = tokio::spawn(queue_ticker(app.clone()));
    app.kv_subscribers
        .sync(&app.current.load(), &app.current, &app.metrics.kv);
    Background {
        app: app.clone(),
        tasks: [prober, ticker],
    }
}

/// The background work of a running [`App`] (health probes, the queue timer, KV-event
/// subscribers).
#[derive(Debug)]
pub struct Background {
    app: Arc<App>,
    tasks: [tokio::task::JoinHandle<()>; 2],
}

impl Background {
    /// Stop it all: the tasks are aborted and the subscribers disconnected.
    pub fn stop(self) {
        for task in &self.tasks {
            task.abort();
        }
        self.app.kv_subscribers.stop_all();
    }
}

/// Probe forever, every `serve.health.interval` of the loaded configuration serving now.
async fn probe_loop(app: Arc<App>) {
    loop {
        let loaded = app.current.load();
        let interval = loaded.serve.health.interval;
        health::probe_round(&app.health, &app.metrics, &loaded).await;
        drop(loaded);
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = app.stopping.cancelled() => return,
        }
    }
}

/// Re-evaluate queues on a timer too: a class's `max_queue_wait_ms` ends a wait even when no
/// request completes meanwhile.
async fn queue_ticker(app: Arc<App>) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
            _ = app.stopping.cancelled() => return,
        }
        // In a task of its own, like every drain: a hung one must not stop this timer.
        lifecycle::after_release(&app, &app.current.load(), None);
    }
}
