//! Engine health and observed load: a periodic `GET /health` of every engine (an engine that
//! does not answer 2xx in time is made unavailable in the routing core, so no request is routed
//! to it, until it answers again), and optionally its `/metrics` (vLLM's
//! `vllm:num_requests_running` + `vllm:num_requests_waiting` per `engine` label = DP rank),
//! reported to the core as observed load (docs/routing-contract.md §7).
//! Also the proxy's own `/health` (alive) and `/ready` (configured and an engine healthy).

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use super::state::{Generation, Upstream};
use super::App;
use crate::model::RowId;

#[derive(Debug, Clone)]
struct Entry {
    url: String,
    healthy: bool,
    last_error: Option<String>,
}

/// Health of every engine, by worker id; kept across reloads for engines whose URL is unchanged.
#[derive(Debug, Default)]
pub struct HealthTable {
    entries: RwLock<HashMap<u64, Entry>>,
}

impl HealthTable {
    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<u64, Entry>> {
        self.entries
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<u64, Entry>> {
        self.entries
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Make the table hold exactly `upstreams`: an engine whose id and URL are unchanged keeps
    /// its state, a new one starts healthy (until its first probe).
    pub fn sync(&self, upstreams: &[Upstream]) {
        let mut entries = self.write();
        entries.retain(|id, e| upstreams.iter().any(|u| u.id == *id && u.base == e.url));
        for u in upstreams {
            entries.entry(u.id).or_insert_with(|| Entry {
                url: u.base.clone(),
                healthy: true,
                last_error: None,
            });
        }
    }

    /// Record a probe; returns whether the state changed.
    fn set(&self, id: u64, healthy: bool, error: Option<String>) -> bool {
        let mut entries = self.write();
        match entries.get_mut(&id) {
            Some(entry) => {
                let changed = entry.healthy != healthy;
                entry.healthy = healthy;
                entry.last_error = error;
                changed
            }
            None => false,
        }
    }

    pub fn is_healthy(&self, id: u64) -> bool {
        self.read().get(&id).is_some_and(|e| e.healthy)
    }

    pub fn any_healthy(&self) -> bool {
        self.read().values().any(|e| e.healthy)
    }

    /// (worker id, url, healthy), by id.
    pub fn snapshot(&self) -> Vec<(u64, String, bool)> {
        let mut rows: Vec<_> = self
            .read()
            .iter()
            .map(|(id, e)| (*id, e.url.clone(), e.healthy))
            .collect();
        rows.sort_by_key(|r| r.0);
        rows
    }

    fn last_error(&self, id: u64) -> Option<String> {
        self.read().get(&id).and_then(|e| e.last_error.clone())
    }

    /// Give `generation`'s routing core the table's availability of every engine.
    pub fn apply(&self, generation: &Generation) {
        for u in &generation.upstreams {
            let healthy = self.is_healthy(u.id);
            let _ = generation
                .host
                .core()
                .set_worker_state(u.id, Some(healthy), None, None);
        }
    }
}

/// Mark one engine healthy or not, in the table and in `generation`'s routing core.
pub fn mark(app: &App, generation: &Generation, id: u64, healthy: bool, error: Option<String>) {
    let changed = app.health.set(id, healthy, error.clone());
    if changed {
        let _ = generation
            .host
            .core()
            .set_worker_state(id, Some(healthy), None, None);
        if healthy {
            tracing::info!(worker = id, "engine healthy again: routing to it");
        } else {
            tracing::warn!(
                worker = id,
                error = error.as_deref().unwrap_or(""),
                "engine unhealthy: no requests are routed to it until it answers"
            );
        }
    }
}

/// Running + waiting requests per DP rank from vLLM's Prometheus text.
pub fn parse_engine_load(text: &str) -> HashMap<u32, u64> {
    let mut load: HashMap<u32, u64> = HashMap::new();
    for line in text.lines() {
        let Some(rest) = line
            .strip_prefix("vllm:num_requests_running")
            .or_else(|| line.strip_prefix("vllm:num_requests_waiting"))
        else {
            continue;
        };
        let (labels, value) = match rest.strip_prefix('{') {
            Some(rest) => match rest.split_once('}') {
                Some((labels, value)) => (labels, value),
                None => continue,
            },
            None => ("", rest),
        };
        if !value.starts_with(' ') {
            continue; // another metric whose name starts the same way
        }
        let Some(value) = value
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        let rank = labels
            .split(',')
            .find_map(|kv| kv.trim().strip_prefix("engine=\""))
            .and_then(|v| v.trim_end_matches('"').parse::<u32>().ok())
            .unwrap_or(0);
        if value.is_finite() && value >= 0.0 {
            *load.entry(rank).or_default() += value as u64;
        }
    }
    load
}

async fn probe(client: &reqwest::Client, base: &str, timeout: Duration) -> Result<(), String> {
    let url = format!("{base}/health");
    match client.get(&url).timeout(timeout).send().await {
        Ok(response) if response.status().is_success() => Ok(()),
        Ok(response) => Err(format!("GET {url}: {}", response.status())),
        Err(err) => Err(format!("GET {url}: {}", super::proxy::error_chain(&err))),
    }
}

async fn scrape(client: &reqwest::Client, base: &str, timeout: Duration) -> Option<String> {
    let response = client
        .get(format!("{base}/metrics"))
        .timeout(timeout)
        .send()
        .await
        .ok()?;
    if !response.status().is_success() {
        return None;
    }
    response.text().await.ok()
}

/// Probe every engine of `generation` once, concurrently.
pub async fn probe_round(app: &App, generation: &Generation) {
    let health = generation.serve.health;
    let probes = generation.upstreams.iter().map(|u| async move {
        let result = probe(&generation.client, &u.base, health.timeout).await;
        let load = match (&result, health.scrape_load) {
            (Ok(()), true) => scrape(&generation.client, &u.base, health.timeout).await,
            _ => None,
        };
        (u, result, load)
    });
    for (u, result, load) in futures_util::future::join_all(probes).await {
        let core = generation.host.core();
        match load {
            Some(text) => {
                let by_rank = parse_engine_load(&text);
                for rank in 0..u.dp_size {
                    let row = RowId {
                        worker_id: u.id,
                        dp_rank: rank,
                    };
                    core.observe_load(row, Some(by_rank.get(&rank).copied().unwrap_or(0)));
                }
            }
            None => {
                for rank in 0..u.dp_size {
                    let row = RowId {
                        worker_id: u.id,
                        dp_rank: rank,
                    };
                    core.observe_load(row, None);
                }
            }
        }
        match result {
            Ok(()) => mark(app, generation, u.id, true, None),
            Err(err) => mark(app, generation, u.id, false, Some(err)),
        }
        sync_flag(generation, u.id, app.health.is_healthy(u.id));
    }
}

/// Make the core's availability flag of worker `id` say `healthy`, if it does not already (a
/// state marked on another generation while this one was being swapped in).
fn sync_flag(generation: &Generation, id: u64, healthy: bool) {
    let core = generation.host.core();
    let available = core.topology().cluster().worker(id).map(|w| w.available);
    if available.is_some_and(|available| available != healthy) {
        let _ = core.set_worker_state(id, Some(healthy), None, None);
    }
}

/// Probe forever, every `serve.health.interval` of the generation serving now.
pub async fn probe_loop(app: Arc<App>) {
    loop {
        let generation = app.current.load();
        let interval = generation.serve.health.interval;
        probe_round(&app, &generation).await;
        drop(generation);
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = app.stopping.cancelled() => return,
        }
    }
}

/// `GET /health`: the proxy is alive.
pub async fn alive() -> Response {
    (
        StatusCode::OK,
        [("content-type", "application/json")],
        r#"{"status":"ok"}"#,
    )
        .into_response()
}

/// `GET /ready`: a configuration is loaded and at least one engine is healthy.
pub async fn ready(State(app): State<Arc<App>>) -> Response {
    let generation = app.current.load();
    let engines: Vec<serde_json::Value> = app
        .health
        .snapshot()
        .into_iter()
        .map(|(id, url, healthy)| {
            serde_json::json!({
                "worker": id,
                "url": url,
                "healthy": healthy,
                "error": app.health.last_error(id),
            })
        })
        .collect();
    let ready = app.health.any_healthy() && !app.stopping.is_cancelled();
    let body = serde_json::json!({
        "ready": ready,
        "config_generation": generation.number,
        "engines": engines,
    });
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_load_per_rank_from_vllm_metrics() {
        let text = "\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0
vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 1.0
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2.0
vllm:num_requests_waiting_by_reason{engine=\"0\",reason=\"x\"} 9.0
vllm:num_requests_running_total 7
";
        let load = parse_engine_load(text);
        assert_eq!(load.get(&0), Some(&5));
        assert_eq!(load.get(&1), Some(&1));
        assert_eq!(load.len(), 2);
        assert_eq!(
            parse_engine_load("vllm:num_requests_waiting 4\n").get(&0),
            Some(&4)
        );
    }
}
