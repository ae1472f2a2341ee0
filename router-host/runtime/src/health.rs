//! Engine health and observed load: a periodic `GET /health` of every engine (an engine that
//! does not answer 2xx in time is made unavailable in the routing core, so no request is routed
//! to it, until it answers again), and optionally its `/metrics` (vLLM's
//! `vllm:num_requests_running` + `vllm:num_requests_waiting` per `engine` label = DP rank),
//! reported to the core as observed load (docs/routing-contract.md §7), with
//! `vllm:kv_cache_usage_perc` (or the older `vllm:gpu_cache_usage_perc`) kept for the router's
//! metrics and `vllm:cache_config_info`'s `block_size` checked against the worker's: an engine
//! that caches blocks of another size is made unavailable, with an error naming the worker
//! (docs/engines.md).
//! The `/ready` report is `ready.rs`.

use std::collections::HashMap;
use std::sync::RwLock;
use std::time::Duration;

use super::engine_calls::{call_engine, AnswerError, HEALTH_ANSWER_LIMIT, METRICS_ANSWER_LIMIT};
use super::metrics::Metrics;
use super::state::{LoadedConfig, Upstream};
use router_core::admission::EngineSignals;
use router_core::model::RowId;

#[derive(Debug, Clone)]
struct Entry {
    url: String,
    healthy: bool,
    last_error: Option<String>,
    /// `vllm:kv_cache_usage_perc` by DP rank, from the last scrape (empty when none).
    kv_usage: Vec<(u32, f64)>,
    /// The last (configured `total_kv_blocks`, engine `num_gpu_blocks`) seen, so that a
    /// disagreement is logged once, not at every probe.
    kv_capacity_seen: Option<(Option<u64>, u64)>,
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
                kv_usage: Vec::new(),
                kv_capacity_seen: None,
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

    /// The error of the last failed probe of engine `id`, if any.
    pub fn last_error(&self, id: u64) -> Option<String> {
        self.read().get(&id).and_then(|e| e.last_error.clone())
    }

    fn set_kv_usage(&self, id: u64, usage: Vec<(u32, f64)>) {
        if let Some(entry) = self.write().get_mut(&id) {
            entry.kv_usage = usage;
        }
    }

    /// Record the configured and the engine's KV capacity of `id`; `true` when either changed.
    fn see_kv_capacity(&self, id: u64, configured: Option<u64>, engine: u64) -> bool {
        match self.write().get_mut(&id) {
            Some(entry) if entry.kv_capacity_seen != Some((configured, engine)) => {
                entry.kv_capacity_seen = Some((configured, engine));
                true
            }
            _ => false,
        }
    }

    /// (worker id, dp rank, KV-cache usage 0..1) from the last scrape of every engine, by id.
    pub fn kv_usage(&self) -> Vec<(u64, u32, f64)> {
        let mut rows: Vec<_> = self
            .read()
            .iter()
            .flat_map(|(id, e)| e.kv_usage.iter().map(move |(rank, u)| (*id, *rank, *u)))
            .collect();
        rows.sort_by_key(|r| (r.0, r.1));
        rows
    }

    /// Give `loaded`'s routing core the table's availability of every engine, and the KV
    /// capacity each reported last where the configuration sets none (a reload then does not
    /// wait for the next probe to know it).
    pub fn apply(&self, loaded: &LoadedConfig) {
        let core = loaded.host.core();
        for u in &loaded.upstreams {
            let healthy = self.is_healthy(u.id);
            let _ = core.set_worker_state(u.id, Some(healthy), None, None);
            let configured = configured_kv_capacity(loaded, u.id);
            let reported = self
                .read()
                .get(&u.id)
                .and_then(|e| e.kv_capacity_seen)
                .map(|(_, engine)| engine);
            if let (None, Some(blocks)) = (configured, reported) {
                let _ = core.set_kv_capacity(u.id, Some(blocks));
            }
        }
    }
}

/// Mark one engine healthy or not, in the table and in `loaded`'s routing core.
pub fn mark(
    table: &HealthTable,
    loaded: &LoadedConfig,
    id: u64,
    healthy: bool,
    error: Option<String>,
) {
    let changed = table.set(id, healthy, error.clone());
    if changed {
        let _ = loaded
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

/// What the router reads from an engine's `/metrics` (vLLM's Prometheus text), by DP rank (the
/// `engine` label; 0 when there is none).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineMetrics {
    /// `vllm:num_requests_running` + `vllm:num_requests_waiting`.
    pub load: HashMap<u32, u64>,
    /// `vllm:num_requests_waiting` alone: prefill saturation (`max_engine_waiting`).
    pub waiting: HashMap<u32, u64>,
    /// `vllm:kv_cache_usage_perc`, or the older `vllm:gpu_cache_usage_perc` when the engine has
    /// no new one (0..1).
    pub kv_usage: HashMap<u32, f64>,
    /// The `block_size` label of `vllm:cache_config_info`.
    pub block_size: HashMap<u32, u64>,
    /// The `num_gpu_blocks` label of `vllm:cache_config_info`: the rank's KV capacity in blocks
    /// (0 or unparsable are left out).
    pub num_gpu_blocks: HashMap<u32, u64>,
}

/// One sample line: `(name, labels, value)`; `None` for comments and lines that do not parse.
fn sample(line: &str) -> Option<(&str, &str, f64)> {
    if line.starts_with('#') {
        return None;
    }
    let (name, labels, rest) = match line.find(['{', ' ']) {
        Some(i) if line.as_bytes()[i] == b'{' => {
            let (labels, rest) = line[i + 1..].split_once('}')?;
            (&line[..i], labels, rest)
        }
        Some(i) => (&line[..i], "", &line[i..]),
        None => return None,
    };
    let value = rest.split_whitespace().next()?.parse::<f64>().ok()?;
    Some((name, labels, value))
}

/// The value of label `key` in a label list `a="x",b="y"`.
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    labels.split(',').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k.trim() == key).then(|| v.trim().trim_matches('"'))
    })
}

/// Parse vLLM's `/metrics` text.
pub fn parse_engine_metrics(text: &str) -> EngineMetrics {
    let mut out = EngineMetrics::default();
    let mut old_usage: HashMap<u32, f64> = HashMap::new();
    for line in text.lines() {
        let Some((name, labels, value)) = sample(line) else {
            continue;
        };
        let rank = label(labels, "engine")
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(0);
        match name {
            "vllm:num_requests_running" | "vllm:num_requests_waiting"
                if value.is_finite() && value >= 0.0 =>
            {
                *out.load.entry(rank).or_default() += value as u64;
                if name == "vllm:num_requests_waiting" {
                    *out.waiting.entry(rank).or_default() += value as u64;
                }
            }
            "vllm:kv_cache_usage_perc" if value.is_finite() => {
                out.kv_usage.insert(rank, value.clamp(0.0, 1.0));
            }
            "vllm:gpu_cache_usage_perc" if value.is_finite() => {
                old_usage.insert(rank, value.clamp(0.0, 1.0));
            }
            "vllm:cache_config_info" => {
                if let Some(size) = label(labels, "block_size").and_then(|v| v.parse().ok()) {
                    out.block_size.insert(rank, size);
                }
                if let Some(blocks) = label(labels, "num_gpu_blocks")
                    .and_then(|v| v.parse::<u64>().ok())
                    .filter(|&b| b > 0)
                {
                    out.num_gpu_blocks.insert(rank, blocks);
                }
            }
            _ => {}
        }
    }
    for (rank, usage) in old_usage {
        out.kv_usage.entry(rank).or_insert(usage);
    }
    out
}

/// Running + waiting requests per DP rank from vLLM's Prometheus text.
pub fn parse_engine_load(text: &str) -> HashMap<u32, u64> {
    parse_engine_metrics(text).load
}

/// The error for an engine whose `vllm:cache_config_info` block size is not the worker's.
fn block_size_error(
    worker: u64,
    url: &str,
    configured: u32,
    metrics: &EngineMetrics,
) -> Option<String> {
    let mut wrong: Vec<(u32, u64)> = metrics
        .block_size
        .iter()
        .filter(|(_, &size)| size != u64::from(configured))
        .map(|(&rank, &size)| (rank, size))
        .collect();
    wrong.sort_unstable();
    let (rank, size) = *wrong.first()?;
    Some(format!(
        "worker {worker} ({url}): the engine caches blocks of {size} tokens \
         (vllm:cache_config_info block_size, rank {rank}), the worker's block_size is \
         {configured}: its KV events would be refused and its prompts hashed differently; \
         not routed to until they agree (set block_size, or start the engine with \
         --block-size {configured})"
    ))
}

/// How a probe of one engine ended.
enum Probe {
    Healthy,
    Unhealthy(String),
    /// The router's own descriptors, ports or memory ran out: says nothing of the engine.
    Local(String),
}

async fn probe(
    router_metrics: &Metrics,
    client: &reqwest::Client,
    u: &Upstream,
    timeout: Duration,
) -> Probe {
    let url = format!("{}/health", u.base);
    let request = client.get(&url).timeout(timeout);
    match call_engine(
        Some(router_metrics),
        u.id,
        "health",
        request,
        HEALTH_ANSWER_LIMIT,
    )
    .await
    {
        Ok(answer) if answer.status.is_success() => Probe::Healthy,
        Ok(answer) => Probe::Unhealthy(format!("GET {url}: {}", answer.status)),
        Err(err) if err.is_local() => Probe::Local(format!("GET {url}: {err}")),
        Err(AnswerError::Send { message, .. }) => Probe::Unhealthy(format!("GET {url}: {message}")),
        Err(err) => Probe::Unhealthy(format!("GET {url}: {err}")),
    }
}

async fn scrape(
    router_metrics: &Metrics,
    client: &reqwest::Client,
    u: &Upstream,
    timeout: Duration,
) -> Option<String> {
    let request = client.get(format!("{}/metrics", u.base)).timeout(timeout);
    let answer = match call_engine(
        Some(router_metrics),
        u.id,
        "metrics",
        request,
        METRICS_ANSWER_LIMIT,
    )
    .await
    {
        Ok(answer) => answer,
        Err(err) => {
            if err.is_local() {
                router_metrics.local_resource_error("probe");
            }
            return None;
        }
    };
    if !answer.status.is_success() {
        return None;
    }
    Some(String::from_utf8_lossy(&answer.body).into_owned())
}

static LOCAL_PROBE_LOG: router_core::log_limit::LogLimit =
    router_core::log_limit::LogLimit::new(10_000);

/// Probe every engine of `loaded` once, concurrently.
pub async fn probe_round(table: &HealthTable, router_metrics: &Metrics, loaded: &LoadedConfig) {
    let health = loaded.serve.health;
    let probes = loaded.upstreams.iter().map(|u| async move {
        let result = probe(router_metrics, &loaded.client, u, health.timeout).await;
        let load = match (&result, health.scrape_load) {
            (Probe::Healthy, true) => {
                scrape(router_metrics, &loaded.client, u, health.timeout).await
            }
            _ => None,
        };
        (u, result, load)
    });
    for (u, result, load) in futures_util::future::join_all(probes).await {
        let mut result = match result {
            Probe::Healthy => Ok(()),
            Probe::Unhealthy(err) => Err(err),
            Probe::Local(err) => {
                // The engine keeps the state it had; its load is unknown until the next probe.
                router_metrics.local_resource_error("probe");
                if let Some(left_out) = LOCAL_PROBE_LOG.check() {
                    tracing::error!(
                        worker = u.id,
                        error = %err,
                        similar_lines_left_out = left_out,
                        "cannot probe the engine: the router ran out of file descriptors, \
                         local ports or memory; its health is left as it was \
                         (router_local_resource_errors_total)"
                    );
                }
                continue;
            }
        };
        let core = loaded.host.core();
        match load {
            Some(text) => {
                let metrics = parse_engine_metrics(&text);
                let by_rank = &metrics.load;
                let configured = loaded
                    .config
                    .workers
                    .iter()
                    .find(|w| w.id == u.id)
                    .map_or(loaded.config.block_size, |w| w.block_size);
                if let Some(err) = block_size_error(u.id, &u.base, configured, &metrics) {
                    if table.is_healthy(u.id)
                        || table.last_error(u.id).as_deref() != Some(err.as_str())
                    {
                        tracing::error!(worker = u.id, url = %u.base, "{err}");
                    }
                    result = Err(err);
                }
                let mut usage: Vec<(u32, f64)> = metrics
                    .kv_usage
                    .iter()
                    .filter(|(rank, _)| **rank < u.dp_size)
                    .map(|(r, v)| (*r, *v))
                    .collect();
                usage.sort_by_key(|r| r.0);
                table.set_kv_usage(u.id, usage);
                learn_kv_capacity(table, loaded, u, &metrics);
                for rank in 0..u.dp_size {
                    let row = RowId {
                        worker_id: u.id,
                        dp_rank: rank,
                    };
                    core.observe_load(row, Some(by_rank.get(&rank).copied().unwrap_or(0)));
                    // Only what the engine exports: a missing metric stays unknown (never
                    // saturated, and counted in router_engine_saturation_unknown_rows).
                    core.observe_engine(
                        row,
                        EngineSignals {
                            waiting: metrics.waiting.get(&rank).copied(),
                            kv_usage: metrics.kv_usage.get(&rank).copied(),
                        },
                    );
                }
            }
            None => {
                table.set_kv_usage(u.id, Vec::new());
                for rank in 0..u.dp_size {
                    let row = RowId {
                        worker_id: u.id,
                        dp_rank: rank,
                    };
                    core.observe_load(row, None);
                    core.observe_engine(row, EngineSignals::default());
                }
            }
        }
        match result {
            Ok(()) => mark(table, loaded, u.id, true, None),
            Err(err) => mark(table, loaded, u.id, false, Some(err)),
        }
        sync_flag(loaded, u.id, table.is_healthy(u.id));
    }
}

/// Give the core worker `u`'s KV capacity from its engine (the smallest `num_gpu_blocks` of its
/// ranks), unless the configuration sets `total_kv_blocks`: what the operator wrote wins, and
/// an engine that reports another capacity is logged (once per value it reports).
fn learn_kv_capacity(
    table: &HealthTable,
    loaded: &LoadedConfig,
    u: &Upstream,
    metrics: &EngineMetrics,
) {
    let Some(blocks) = engine_kv_capacity(metrics, u.dp_size) else {
        return;
    };
    let configured = configured_kv_capacity(loaded, u.id);
    let changed = table.see_kv_capacity(u.id, configured, blocks);
    if let Some(configured) = configured {
        if changed && configured != blocks {
            tracing::warn!(
                worker = u.id,
                url = %u.base,
                total_kv_blocks = configured,
                engine_kv_blocks = blocks,
                "workers[].total_kv_blocks differs from the engine's KV capacity \
                 (vllm:cache_config_info num_gpu_blocks); policies see the configured value \
                 (remove total_kv_blocks to use the engine's)"
            );
        }
        return;
    }
    let core = loaded.host.core();
    let known = core
        .topology()
        .cluster()
        .worker(u.id)
        .and_then(|w| w.total_kv_blocks);
    if known != Some(blocks) && core.set_kv_capacity(u.id, Some(blocks)).is_ok() {
        tracing::info!(
            worker = u.id,
            url = %u.base,
            kv_capacity_blocks = blocks,
            previous = ?known,
            "KV capacity learned from the engine (vllm:cache_config_info num_gpu_blocks)"
        );
    }
}

/// Worker `id`'s `workers[].total_kv_blocks` in `loaded`'s configuration.
fn configured_kv_capacity(loaded: &LoadedConfig, id: u64) -> Option<u64> {
    loaded
        .config
        .workers
        .iter()
        .find(|w| w.id == id)
        .and_then(|w| w.total_kv_blocks)
}

/// The blocks a request can use on the smallest of ranks `0 .. dp_size`, if any rank reports
/// its `num_gpu_blocks`: one less than it, because vLLM counts its null block there (its block
/// pool takes one block for itself at start and never hands it out).
fn engine_kv_capacity(metrics: &EngineMetrics, dp_size: u32) -> Option<u64> {
    metrics
        .num_gpu_blocks
        .iter()
        .filter(|(rank, _)| **rank < dp_size)
        .map(|(_, blocks)| blocks.saturating_sub(1))
        .min()
        .filter(|&usable| usable > 0)
}

/// Make the core's availability flag of worker `id` say `healthy`, if it does not already (a
/// state marked on another loaded configuration while this one was being swapped in).
fn sync_flag(loaded: &LoadedConfig, id: u64, healthy: bool) {
    let core = loaded.host.core();
    let available = core.topology().cluster().worker(id).map(|w| w.available);
    if available.is_some_and(|available| available != healthy) {
        let _ = core.set_worker_state(id, Some(healthy), None, None);
    }
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
        let waiting = parse_engine_metrics(text).waiting;
        assert_eq!(
            waiting.get(&0),
            Some(&2),
            "waiting alone, not waiting_by_reason"
        );
        assert_eq!(
            waiting.get(&1),
            None,
            "a rank that reports none is unknown, not 0"
        );
        let load = parse_engine_load(text);
        assert_eq!(load.get(&0), Some(&5));
        assert_eq!(load.get(&1), Some(&1));
        assert_eq!(load.len(), 2);
        assert_eq!(
            parse_engine_load("vllm:num_requests_waiting 4\n").get(&0),
            Some(&4)
        );
    }

    #[test]
    fn kv_usage_and_block_size_from_vllm_metrics() {
        let text = "\
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25
vllm:gpu_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.9
vllm:gpu_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.5
vllm:kv_cache_usage_perc_other{engine=\"2\"} 0.7
vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",engine=\"0\",num_gpu_blocks=\"100\"} 1.0
vllm:cache_config_info{block_size=\"32\",engine=\"1\"} 1.0
vllm:cache_config_info{cache_dtype=\"auto\",engine=\"2\"} 1.0
";
        let m = parse_engine_metrics(text);
        // The new name wins over the old one on the same rank; the old one alone is used.
        assert_eq!(m.kv_usage.get(&0), Some(&0.25));
        assert_eq!(m.kv_usage.get(&1), Some(&0.5));
        assert_eq!(m.kv_usage.len(), 2);
        assert_eq!(m.block_size.get(&0), Some(&16));
        assert_eq!(m.block_size.get(&1), Some(&32));
        assert_eq!(m.block_size.len(), 2);
        let err = block_size_error(7, "http://e:1", 16, &m).expect("rank 1 differs");
        assert!(
            err.contains("worker 7") && err.contains("32") && err.contains("rank 1"),
            "{err}"
        );
        let same = parse_engine_metrics("vllm:cache_config_info{block_size=\"16\"} 1\n");
        assert_eq!(block_size_error(7, "http://e:1", 16, &same), None);
        // No cache_config_info (another engine, an older vLLM): nothing to check.
        assert_eq!(
            block_size_error(7, "u", 16, &EngineMetrics::default()),
            None
        );
    }

    #[test]
    fn kv_capacity_is_the_smallest_num_gpu_blocks_of_the_workers_ranks() {
        let text = "\
vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"300\"} 1.0
vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"256\"} 1.0
vllm:cache_config_info{block_size=\"16\",engine=\"2\",num_gpu_blocks=\"8\"} 1.0
vllm:cache_config_info{block_size=\"16\",engine=\"3\",num_gpu_blocks=\"0\"} 1.0
vllm:cache_config_info{block_size=\"16\",engine=\"4\",num_gpu_blocks=\"None\"} 1.0
";
        let m = parse_engine_metrics(text);
        // 0 and what does not parse (vLLM prints None before profiling) are no capacity.
        assert_eq!(m.num_gpu_blocks.len(), 3);
        // One block less than reported: vLLM's null block.
        assert_eq!(engine_kv_capacity(&m, 1), Some(299));
        // Rank 2 is not the worker's when it has two ranks.
        assert_eq!(engine_kv_capacity(&m, 2), Some(255));
        assert_eq!(engine_kv_capacity(&m, 5), Some(7));
        assert_eq!(engine_kv_capacity(&EngineMetrics::default(), 1), None);
        // A pool of only the null block holds nothing a request can use: no capacity.
        let one = parse_engine_metrics(
            "vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"1\"} 1.0\n",
        );
        assert_eq!(engine_kv_capacity(&one, 1), None);
    }
}
