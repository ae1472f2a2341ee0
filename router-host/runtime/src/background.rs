//! The work a running [`App`] does besides requests: the health probes, the admission
//! queues' timer, the KV-event subscribers, the watch on `workers_file` and the load shared
//! with other replicas, started by
//! [`start`] and stopped by [`Background::stop`] (or when the app stops).

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use router_config::FileVersion;

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
    let watcher = tokio::spawn(watch_workers_file(app.clone()));
    let sharer = tokio::spawn(share_load(app.clone()));
    app.kv_subscribers
        .sync(&app.current.load(), &app.current, &app.metrics.kv);
    Background {
        app: app.clone(),
        tasks: [prober, ticker, watcher, sharer],
    }
}

/// The background work of a running [`App`] (health probes, the queue timer, KV-event
/// subscribers, the workers file's watch).
#[derive(Debug)]
pub struct Background {
    app: Arc<App>,
    tasks: [tokio::task::JoinHandle<()>; 4],
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

/// How often a configuration without a shared load is looked at again (a reload may turn it
/// on).
const SHARE_LOAD_IDLE: Duration = Duration::from_secs(1);

/// Least time from one round's start to an early one's (a booking or a release was seen):
/// the change is published this soon under load.
const EARLY_ROUND_MIN: Duration = Duration::from_millis(5);
/// Every round waits at least this many times as long as the round before took, so rounds take
/// at most about a fifth of the time whatever they carry (a large fleet's rounds carry more
/// rows; a slow store answers later).
const ROUND_COST_FACTOR: u32 = 4;

/// How long after a round's start the next one runs, given how long that round took: the
/// regular one after the period, an early one after [`EARLY_ROUND_MIN`] but never after the
/// period; both no sooner than [`ROUND_COST_FACTOR`] times the round.
fn next_rounds_after(took: Duration, period: Duration) -> (Duration, Duration) {
    let cost = took.saturating_mul(ROUND_COST_FACTOR);
    let regular = period.max(cost);
    (regular, EARLY_ROUND_MIN.max(cost).min(regular))
}

/// Share the booked load with the other replicas (docs/replicas.md, "Shared load"): one round
/// every `session_affinity.store.load_publish_ms` of the configuration serving now, on its core,
/// and sooner when a request was booked or released ([`next_rounds_after`]). A round is
/// blocking store I/O bounded by its timeout: it runs on the blocking pool, never on a
/// request's path.
async fn share_load(app: Arc<App>) {
    loop {
        let loaded = app.current.load();
        let share = loaded
            .shared_sessions
            .as_ref()
            .and_then(|store| store.shared_load())
            .cloned();
        let (wait, early) = match share {
            Some(share) => {
                let started = tokio::time::Instant::now();
                let period = share.period();
                let round = tokio::task::spawn_blocking(move || share.round(loaded.host.core()));
                if let Err(err) = round.await {
                    tracing::error!(error = %err, "shared load: a round failed to run");
                }
                let (regular, early) = next_rounds_after(started.elapsed(), period);
                let left = |d: Duration| d.saturating_sub(started.elapsed());
                (left(regular), Some(left(early)))
            }
            None => (SHARE_LOAD_IDLE, None),
        };
        let released = async {
            match early {
                Some(early) => {
                    tokio::time::sleep(early).await;
                    // A change since the last wait left a permit: it counts too.
                    app.booking_changed.notified().await;
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = released => {}
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

/// How often the workers file is looked at. A change is reloaded once the file has looked the
/// same for one more look (a debounce: a writer still writing is not read half-way).
pub const WORKERS_FILE_POLL: Duration = Duration::from_millis(250);

/// One look at the workers file: where, and its version or why it has none (a removed file is
/// a change too: its reload fails, visibly).
type Look = (PathBuf, Result<FileVersion, std::io::ErrorKind>);

/// Reload (as SIGHUP does, [`App::reload`]) when the workers file the serving configuration
/// was read with changes: polled every [`WORKERS_FILE_POLL`], debounced by one poll. The
/// reload logs and counts its outcome (`router_config_reloads_total`); a bad file keeps the
/// running configuration and is not tried again until it changes.
///
/// Polled rather than watched with inotify: a Kubernetes ConfigMap volume replaces the file by
/// swapping a symlink in its directory, which a watch on the file misses, and one `stat` of
/// one file four times a second costs nothing; it also works on every file system.
async fn watch_workers_file(app: Arc<App>) {
    let mut seen: Option<Look> = None;
    let mut tried: Option<Look> = None;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(WORKERS_FILE_POLL) => {}
            _ = app.stopping.cancelled() => return,
        }
        let Some(file) = app.current.load().config.workers_file.clone() else {
            seen = None;
            continue;
        };
        let path = file.path.clone();
        // Off the runtime's threads: a stat on a stuck network file system blocks.
        let version = tokio::task::spawn_blocking(move || FileVersion::of(&path))
            .await
            .unwrap_or(Err(std::io::ErrorKind::Other));
        let now = (file.path.clone(), version);
        if seen.as_ref() != Some(&now) {
            // Changed since the last look: wait for it to settle.
            seen = Some(now);
            continue;
        }
        let serving = file.version.is_some() && now.1.as_ref().ok() == file.version.as_ref();
        if serving || tried.as_ref() == Some(&now) {
            continue;
        }
        tried = Some(now);
        tracing::info!(
            file = %file.path.display(),
            "workers file changed; reloading the configuration"
        );
        // Logged and counted by the reload itself, success or not.
        let _ = app.reload().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_follow_the_period_and_the_floor_unless_a_round_was_slow() {
        let ms = Duration::from_millis;
        let period = ms(20);
        // A quick round: the period, and the floor for an early one.
        assert_eq!(
            next_rounds_after(Duration::from_micros(300), period),
            (period, EARLY_ROUND_MIN)
        );
        // A round of 3 ms: an early one waits 12.
        assert_eq!(next_rounds_after(ms(3), period), (period, ms(12)));
        // A slow round (a large fleet, a slow store): both wait four times as long.
        assert_eq!(next_rounds_after(ms(30), period), (ms(120), ms(120)));
        // A long period: an early round still comes after the floor.
        assert_eq!(next_rounds_after(ms(1), ms(10_000)), (ms(10_000), ms(5)));
    }
}
