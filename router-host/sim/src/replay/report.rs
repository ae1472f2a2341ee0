//! The replay report: what each config did to cache reuse, latency, load and the host, as a
//! human table and as JSON (the field names below are the script contract, `docs/replay.md`).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use super::engine::{EngineParams, PooledLru};
use super::sim::{RunOutput, Shape};
use super::trace::{ratio, Workload, WorkloadStats};

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub workload: WorkloadReport,
    pub cluster: ClusterReport,
    pub configs: Vec<ConfigReport>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkloadReport {
    /// `trace PATH` or the synthetic generator's settings.
    pub source: String,
    pub requests: usize,
    /// Tokens per block (per `hash_ids` entry); every config runs with this block size.
    pub block_size: u32,
    pub prompt_blocks: u64,
    /// Fraction of prompt blocks in the leading run of blocks seen in an earlier request.
    pub ideal_hit_rate: f64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub sessions: usize,
    pub duration_s: f64,
    /// Requests that arrive their client's gap after another request ends (the trace's
    /// `after`, with `--closed-loop`); 0 for an open-loop replay.
    pub closed_loop_requests: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ClusterReport {
    pub workers: u32,
    pub dp_size: u32,
    /// Simulated engines (`workers * dp_size`).
    pub engines: u32,
}

/// p50/p90/p99 and mean, linear interpolation between order statistics; 0 when empty.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
    pub max: f64,
}

impl Percentiles {
    pub fn of(mut values: Vec<f64>) -> Percentiles {
        if values.is_empty() {
            return Percentiles::default();
        }
        values.sort_by(f64::total_cmp);
        let at = |q: f64| {
            let pos = q * (values.len() - 1) as f64;
            let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
            values[lo] + (values[hi] - values[lo]) * (pos - lo as f64)
        };
        Percentiles {
            p50: at(0.50),
            p90: at(0.90),
            p99: at(0.99),
            mean: values.iter().sum::<f64>() / values.len() as f64,
            max: values[values.len() - 1],
        }
    }

    fn rounded(self, digits: i32) -> Percentiles {
        Percentiles {
            p50: round(self.p50, digits),
            p90: round(self.p90, digits),
            p99: round(self.p99, digits),
            mean: round(self.mean, digits),
            max: round(self.max, digits),
        }
    }
}

fn round(x: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (x * f).round() / f
}

#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct QueueReport {
    /// Requests that waited in a host admission queue.
    pub queued: u64,
    /// Their waits.
    pub wait_ms: Percentiles,
}

/// Session binding outcomes of dispatched requests, counted by the replay and reported as is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct SessionReport {
    /// First request of a session (binding created).
    pub new: u64,
    /// Went to the row its binding named.
    pub kept: u64,
    /// Went elsewhere; the binding followed.
    pub moved: u64,
    pub stale: u64,
    pub hard_binding_gone: u64,
    pub not_recorded: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LoadOverTime {
    pub interval_s: f64,
    /// `active_requests[k][w]`: requests on worker w at `k * interval_s` after the first arrival.
    pub active_requests: Vec<Vec<u32>>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConfigReport {
    /// The config file as given on the command line.
    pub config: String,
    /// The instance serving aggregated requests, `name (type)`.
    pub policy: String,
    /// The config's own `block_size` when the replay replaced it with the workload's.
    pub block_size_replaced: Option<u32>,
    pub engine: EngineParams,
    /// Requests the host dispatched to a row.
    pub requests_routed: u64,
    pub requests_completed: u64,
    /// Requests that failed: routing errors, engine refusals, still queued at the end.
    pub errors: u64,
    pub error_kinds: BTreeMap<String, u64>,
    /// Prompt blocks the engines found cached / prompt blocks of requests that reached one.
    pub hit_rate: f64,
    pub hit_blocks: u64,
    pub prompt_blocks: u64,
    /// Arrival to first token.
    pub ttft_ms: Percentiles,
    /// Arrival to last token.
    pub e2e_ms: Percentiles,
    /// Dispatch to admission into the engine's batch.
    pub engine_wait_ms: Percentiles,
    pub output_tokens_per_s: f64,
    /// First arrival to last completion, simulated seconds.
    pub makespan_s: f64,
    pub requests_per_worker: Vec<u64>,
    /// max / mean of `requests_per_worker`.
    pub load_imbalance: f64,
    /// Fraction of the makespan each worker's engines spent in steps (mean over its ranks).
    pub busy_per_worker: Vec<f64>,
    pub prefill_tokens: u64,
    pub evicted_blocks: u64,
    pub kv_events: u64,
    pub queue: QueueReport,
    pub sessions: SessionReport,
    /// Decisions the built-in default made because the configured policy failed.
    pub fallbacks: u64,
    /// Wall-clock nanoseconds per decision around `Host::submit` (or its share of a `drain`):
    /// session lookup, admission, overlap lookup, the policy call, booking. Not deterministic.
    pub decision_ns: Percentiles,
    pub load_over_time: LoadOverTime,
    /// The same workload on the pooled-LRU reference of this config's engines.
    pub pooled_lru_reference: ReferenceReport,
    /// Where the config comes from and the settings it ran with (docs/replay.md, "Column
    /// settings").
    pub settings: super::ColumnSettings,
    /// Every request's outcome, in workload order: `--requests` writes them, the JSON does not.
    #[serde(skip)]
    pub requests: Vec<RequestOutcome>,
}

/// What happened to one request in one config (a line of `--requests`).
#[derive(Debug, Clone, PartialEq)]
pub struct RequestOutcome {
    /// Arrival, milliseconds after the workload's first.
    pub arrival_ms: f64,
    /// Where it was sent; `None` when it failed before reaching an engine.
    pub worker: Option<u32>,
    pub rank: Option<u32>,
    pub input_tokens: u64,
    pub prompt_blocks: u32,
    /// Prompt blocks found cached at admission; `None` if never admitted.
    pub hit_blocks: Option<u32>,
    /// Dispatch to admission into the engine's batch.
    pub engine_wait_ms: Option<f64>,
    pub ttft_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
}

/// The columns of `--requests`, in order (docs/replay.md, "Per-request CSV").
pub const REQUEST_COLUMNS: [&str; 11] = [
    "config",
    "request",
    "arrival_ms",
    "worker",
    "rank",
    "input_tokens",
    "prompt_blocks",
    "hit_blocks",
    "engine_wait_ms",
    "ttft_ms",
    "e2e_ms",
];

/// The pooled-LRU reference ([`super::engine::pooled_lru`]): all engines' KV blocks as one LRU
/// cache, each request alone on an idle engine.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReferenceReport {
    /// The pooled capacity in blocks; `null` = unlimited.
    pub kv_blocks: Option<u64>,
    pub hit_rate: f64,
    /// Arrival to first token.
    pub ttft_ms: Percentiles,
}

impl ReferenceReport {
    pub fn new(reference: &PooledLru) -> Self {
        ReferenceReport {
            kv_blocks: reference.capacity_blocks,
            hit_rate: ratio(reference.hit_blocks, reference.prompt_blocks),
            ttft_ms: Percentiles::of(reference.ttft_ns.iter().map(|&n| n as f64 / 1e6).collect())
                .rounded(3),
        }
    }
}

impl WorkloadReport {
    pub fn new(workload: &Workload, stats: &WorkloadStats) -> Self {
        WorkloadReport {
            source: workload.source.clone(),
            requests: stats.requests,
            block_size: workload.block_size,
            prompt_blocks: stats.prompt_blocks,
            ideal_hit_rate: stats.ideal_hit_rate,
            input_tokens: stats.input_tokens,
            output_tokens: stats.output_tokens,
            sessions: stats.sessions,
            duration_s: round(stats.duration_s, 3),
            closed_loop_requests: workload.links.iter().filter(|l| l.after.is_some()).count(),
        }
    }
}

impl ClusterReport {
    pub fn new(shape: Shape) -> Self {
        ClusterReport {
            workers: shape.workers,
            dp_size: shape.dp_size,
            engines: shape.workers * shape.dp_size,
        }
    }
}

impl ConfigReport {
    pub fn new(
        label: &str,
        block_size_replaced: Option<u32>,
        engine: EngineParams,
        shape: Shape,
        workload: &Workload,
        run: RunOutput,
        pooled_lru_reference: ReferenceReport,
    ) -> ConfigReport {
        let origin = workload.requests.first().map_or(0, |r| r.arrival_ns);
        let ms = |ns: u64| ns as f64 / 1e6;
        let (mut hit, mut prompt, mut output, mut completed) = (0u64, 0u64, 0u64, 0u64);
        let (mut ttft, mut e2e, mut wait) = (Vec::new(), Vec::new(), Vec::new());
        let ranks = shape.dp_size.max(1);
        let requests = run
            .jobs
            .iter()
            .zip(&run.reached_engine)
            .map(|(job, &reached)| RequestOutcome {
                arrival_ms: ms(job.arrival_ns - origin),
                worker: job.engine.map(|e| e / ranks),
                rank: job.engine.map(|e| e % ranks),
                input_tokens: job.input_tokens(),
                prompt_blocks: job.prompt_blocks(),
                hit_blocks: (reached && job.admitted_ns.is_some()).then_some(job.hit_blocks),
                engine_wait_ms: job
                    .admitted_ns
                    .filter(|_| reached)
                    .map(|a| ms(a - job.dispatched_ns)),
                ttft_ms: job.first_token_ns.map(|t| ms(t - job.arrival_ns)),
                e2e_ms: job.finish_ns.map(|t| ms(t - job.arrival_ns)),
            })
            .collect();
        for (job, reached) in run.jobs.iter().zip(&run.reached_engine) {
            if !reached {
                continue;
            }
            prompt += u64::from(job.prompt_blocks());
            if let Some(admitted) = job.admitted_ns {
                hit += u64::from(job.hit_blocks);
                wait.push(ms(admitted - job.dispatched_ns));
            }
            if let Some(first) = job.first_token_ns {
                ttft.push(ms(first - job.arrival_ns));
            }
            if let Some(finish) = job.finish_ns {
                e2e.push(ms(finish - job.arrival_ns));
                output += job.output_tokens();
                completed += 1;
            }
        }
        let makespan_ns = run.end_ns.saturating_sub(origin);
        let dp = shape.dp_size as usize;
        let workers = shape.workers as usize;
        let requests_per_worker: Vec<u64> = (0..workers)
            .map(|w| run.requests_per_row[w * dp..(w + 1) * dp].iter().sum())
            .collect();
        let routed: u64 = requests_per_worker.iter().sum();
        let mean = routed as f64 / workers.max(1) as f64;
        let max = requests_per_worker.iter().copied().max().unwrap_or(0) as f64;
        let busy_per_worker = (0..workers)
            .map(|w| {
                let busy: u64 = run.engine_stats[w * dp..(w + 1) * dp]
                    .iter()
                    .map(|s| s.busy_ns)
                    .sum();
                round(ratio(busy, makespan_ns) / dp as f64, 4)
            })
            .collect();
        let errors = run.errors.values().sum();
        ConfigReport {
            config: label.to_string(),
            settings: run.settings,
            policy: run.policy,
            block_size_replaced,
            engine,
            requests_routed: routed,
            requests_completed: completed,
            errors,
            error_kinds: run.errors,
            hit_rate: ratio(hit, prompt),
            hit_blocks: hit,
            prompt_blocks: prompt,
            ttft_ms: Percentiles::of(ttft).rounded(3),
            e2e_ms: Percentiles::of(e2e).rounded(3),
            engine_wait_ms: Percentiles::of(wait).rounded(3),
            output_tokens_per_s: round(
                if makespan_ns == 0 {
                    0.0
                } else {
                    output as f64 / (makespan_ns as f64 / 1e9)
                },
                3,
            ),
            makespan_s: round(makespan_ns as f64 / 1e9, 3),
            requests_per_worker,
            load_imbalance: round(if mean > 0.0 { max / mean } else { 0.0 }, 4),
            busy_per_worker,
            prefill_tokens: run.engine_stats.iter().map(|s| s.prefill_tokens).sum(),
            evicted_blocks: run.engine_stats.iter().map(|s| s.evicted_blocks).sum(),
            kv_events: run.kv_events,
            queue: QueueReport {
                queued: run.queue_waits_ns.len() as u64,
                wait_ms: Percentiles::of(run.queue_waits_ns.iter().map(|&n| ms(n)).collect())
                    .rounded(3),
            },
            sessions: run.sessions,
            fallbacks: run.fallbacks,
            decision_ns: Percentiles::of(run.decision_ns.iter().map(|&n| n as f64).collect())
                .rounded(0),
            load_over_time: LoadOverTime {
                interval_s: run.timeline.interval_ns as f64 / 1e9,
                active_requests: run.timeline.samples,
            },
            pooled_lru_reference,
            requests,
        }
    }
}

impl Report {
    /// The JSON document `--json` writes.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }

    /// `--requests`: one CSV record per request and config ([`REQUEST_COLUMNS`]), configs in
    /// order, requests in workload order (`request` is the 0-based index in the workload as
    /// `--write-workload` writes it). What a request never reached is an empty field.
    pub fn write_requests_csv<W: std::io::Write>(&self, out: W) -> Result<(), csv::Error> {
        let mut csv = csv::Writer::from_writer(out);
        csv.write_record(REQUEST_COLUMNS)?;
        for config in &self.configs {
            for (i, r) in config.requests.iter().enumerate() {
                csv.serialize((
                    &config.config,
                    i,
                    r.arrival_ms,
                    r.worker,
                    r.rank,
                    r.input_tokens,
                    r.prompt_blocks,
                    r.hit_blocks,
                    r.engine_wait_ms,
                    r.ttft_ms,
                    r.e2e_ms,
                ))?;
            }
        }
        csv.flush()?;
        Ok(())
    }

    /// The human table for stdout.
    pub fn to_table(&self) -> String {
        let mut s = String::new();
        let w = &self.workload;
        let _ = writeln!(s, "workload: {}", w.source);
        let _ = writeln!(
            s,
            "  {} requests over {:.1} s, {} sessions, {} prompt blocks of {} tokens, {:.0} prompt / {:.0} output tokens per request",
            w.requests,
            w.duration_s,
            w.sessions,
            w.prompt_blocks,
            w.block_size,
            w.input_tokens as f64 / w.requests.max(1) as f64,
            w.output_tokens as f64 / w.requests.max(1) as f64,
        );
        let _ = writeln!(
            s,
            "  ideal prefix-cache hit rate (infinite shared cache): {:.4}",
            w.ideal_hit_rate
        );
        let c = &self.cluster;
        if w.closed_loop_requests > 0 {
            let _ = writeln!(
                s,
                "  closed loop: {} requests arrive their client's gap after the request they follow ends",
                w.closed_loop_requests
            );
        }
        let _ = writeln!(
            s,
            "cluster: {} workers x {} rank(s) = {} simulated engines",
            c.workers, c.dp_size, c.engines
        );
        if let Some(first) = self.configs.first() {
            let e = &first.engine;
            let same = self.configs.iter().all(|c| c.engine == *e);
            let _ = writeln!(
                s,
                "engine{}: kv {} blocks, {} tokens/step, {} seqs, step {} ms + {} ms/decoding seq + {} ms/prefill token",
                if same { "" } else { " (first config; others differ, see --json)" },
                e.kv_blocks,
                e.max_num_batched_tokens,
                e.max_num_seqs,
                e.step_overhead_ms,
                e.decode_ms_per_seq,
                e.prefill_ms_per_token
            );
            if e.api_overhead_ms > 0.0 || !e.cache_generated {
                let _ = writeln!(
                    s,
                    "  api overhead {} ms per request; generated blocks {}",
                    e.api_overhead_ms,
                    if e.cache_generated {
                        "cached"
                    } else {
                        "not cached"
                    }
                );
            }
            if same {
                let r = &first.pooled_lru_reference;
                let blocks = r
                    .kv_blocks
                    .map_or_else(|| "unlimited".to_string(), |b| b.to_string());
                let _ = writeln!(
                    s,
                    "pooled-LRU reference ({blocks} blocks as one LRU cache, each request alone on an idle engine): hit rate {:.3}, TTFT p50 / p90 / p99 {:.1} / {:.1} / {:.1} ms",
                    r.hit_rate, r.ttft_ms.p50, r.ttft_ms.p90, r.ttft_ms.p99
                );
            }
        }
        let names = column_names(&self.configs);
        let replaced: Vec<String> = self
            .configs
            .iter()
            .zip(&names)
            .filter_map(|(c, name)| c.block_size_replaced.map(|b| format!("{name} ({b})")))
            .collect();
        if !replaced.is_empty() {
            let _ = writeln!(
                s,
                "note: configs run with the workload's block_size {}; replaced in {}",
                w.block_size,
                replaced.join(", ")
            );
        }
        s.push('\n');
        let headers = names;
        let f3 = |x: f64| format!("{x:.3}");
        let f1 = |x: f64| format!("{x:.1}");
        let int = |x: u64| x.to_string();
        let mut rows: Vec<(String, Vec<String>)> = Vec::new();
        let mut row = |name: &str, f: &dyn Fn(&ConfigReport) -> String| {
            rows.push((name.to_string(), self.configs.iter().map(f).collect()));
        };
        row("policy (aggregated)", &|c| {
            c.policy.split(' ').next().unwrap_or("").to_string()
        });
        row(&format!("hit rate (ideal {:.3})", w.ideal_hit_rate), &|c| {
            f3(c.hit_rate)
        });
        row("TTFT p50 ms", &|c| f1(c.ttft_ms.p50));
        row("TTFT p90 ms", &|c| f1(c.ttft_ms.p90));
        row("TTFT p99 ms", &|c| f1(c.ttft_ms.p99));
        row("e2e p50 ms", &|c| f1(c.e2e_ms.p50));
        row("e2e p99 ms", &|c| f1(c.e2e_ms.p99));
        row("engine wait p99 ms", &|c| f1(c.engine_wait_ms.p99));
        row("output tok/s", &|c| f1(c.output_tokens_per_s));
        row("prefill tokens", &|c| int(c.prefill_tokens));
        row("requests routed", &|c| int(c.requests_routed));
        row("errors", &|c| int(c.errors));
        row("imbalance max/mean", &|c| {
            format!("{:.2}", c.load_imbalance)
        });
        row("busy % min..max", &|c| {
            let lo = c
                .busy_per_worker
                .iter()
                .copied()
                .fold(f64::INFINITY, f64::min);
            let hi = c.busy_per_worker.iter().copied().fold(0.0, f64::max);
            if lo.is_finite() {
                format!("{:.0}..{:.0}", lo * 100.0, hi * 100.0)
            } else {
                "-".to_string()
            }
        });
        row("queued / wait p99 ms", &|c| {
            if c.queue.queued == 0 {
                "0".to_string()
            } else {
                format!("{} / {:.1}", c.queue.queued, c.queue.wait_ms.p99)
            }
        });
        row("sessions kept/moved/new", &|c| {
            let s = &c.sessions;
            if s.new + s.kept + s.moved + s.stale + s.hard_binding_gone + s.not_recorded == 0 {
                "off".to_string()
            } else {
                format!("{}/{}/{}", s.kept, s.moved, s.new)
            }
        });
        row("fallbacks", &|c| int(c.fallbacks));
        row("decision ns p50", &|c| format!("{:.0}", c.decision_ns.p50));
        row("decision ns p99", &|c| format!("{:.0}", c.decision_ns.p99));
        let name_width = rows.iter().map(|(n, _)| n.len()).max().unwrap_or(0);
        let widths: Vec<usize> = headers
            .iter()
            .enumerate()
            .map(|(i, h)| {
                rows.iter()
                    .map(|(_, v)| v[i].len())
                    .chain([h.len()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let _ = write!(s, "{:name_width$}", "");
        for (h, w) in headers.iter().zip(&widths) {
            let _ = write!(s, "  {h:>w$}");
        }
        s.push('\n');
        for (name, values) in &rows {
            let _ = write!(s, "{name:name_width$}");
            for (v, w) in values.iter().zip(&widths) {
                let _ = write!(s, "  {v:>w$}");
            }
            s.push('\n');
        }
        s.push('\n');
        let _ = writeln!(s, "requests per worker:");
        for (h, c) in headers.iter().zip(&self.configs) {
            let list: Vec<String> = c.requests_per_worker.iter().map(u64::to_string).collect();
            let _ = writeln!(s, "  {h}: {}", list.join(" "));
        }
        let _ = writeln!(
            s,
            "\ncolumn settings (each column ran exactly this; its lines make a config that runs it):"
        );
        for (h, c) in headers.iter().zip(&self.configs) {
            let _ = writeln!(s, "  {h}: {}", c.settings.source);
            for line in c.settings.yaml_lines() {
                let _ = writeln!(s, "    {line}");
            }
        }
        let mut any_errors = false;
        for (h, c) in headers.iter().zip(&self.configs) {
            for (kind, n) in &c.error_kinds {
                if !any_errors {
                    let _ = writeln!(s, "errors:");
                    any_errors = true;
                }
                let _ = writeln!(s, "  {h}: {n} x {kind}");
            }
        }
        s
    }
}

/// Short column names: file stems, or the labels as given when stems collide.
pub fn column_names(configs: &[ConfigReport]) -> Vec<String> {
    let stems: Vec<String> = configs
        .iter()
        .map(|c| {
            std::path::Path::new(&c.config)
                .file_stem()
                .map_or_else(|| c.config.clone(), |s| s.to_string_lossy().into_owned())
        })
        .collect();
    let unique = stems
        .iter()
        .enumerate()
        .all(|(i, s)| !stems[..i].contains(s));
    if unique {
        stems
    } else {
        configs.iter().map(|c| c.config.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate() {
        let p = Percentiles::of((1..=101).map(f64::from).collect());
        assert_eq!((p.p50, p.p90, p.p99, p.max), (51.0, 91.0, 100.0, 101.0));
        let p = Percentiles::of(vec![1.0, 2.0]);
        assert_eq!(p.p50, 1.5);
        assert_eq!(Percentiles::of(vec![]), Percentiles::default());
    }
}
