//! The values read at scrape time from the configuration serving now: booked load per row,
//! queue depth, per-instance policy counters, engine health.
//!
//! The server hands it to `Metrics::new`. It lives beside `metrics`, not in it, because it
//! reads the configuration and the health table, and those record into `Metrics`.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use crate::health::HealthTable;
use crate::state::Current;

/// Values read at scrape time from the configuration serving now.
#[derive(Debug)]
pub struct StateCollector {
    pub current: Arc<Current>,
    pub health: Arc<HealthTable>,
}

fn family<L: EncodeLabelSet, M: EncodeMetric>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    kind: MetricType,
    rows: impl IntoIterator<Item = (L, M)>,
) -> Result<(), std::fmt::Error> {
    let mut metric = encoder.encode_descriptor(name, help, None, kind)?;
    for (labels, value) in rows {
        value.encode(metric.encode_family(&labels)?)?;
    }
    Ok(())
}

type Labels = Vec<(&'static str, String)>;

/// One family per `(name, help, value)`, each a single unlabelled counter.
fn constant_counters(
    encoder: &mut DescriptorEncoder<'_>,
    counters: &[(&str, &str, u64)],
) -> Result<(), std::fmt::Error> {
    for &(name, help, value) in counters {
        family(
            encoder,
            name,
            help,
            MetricType::Counter,
            std::iter::once((Labels::new(), ConstCounter::new(value))),
        )?;
    }
    Ok(())
}

/// A per-instance counter: name, help, and how to read it from a snapshot.
type CounterSpec = (
    &'static str,
    &'static str,
    fn(&router_policies::instance::InstanceCounters) -> u64,
);
/// A per-instance flag: name, help, and how to read it.
type FlagSpec = (
    &'static str,
    &'static str,
    fn(&router_policies::instance::PolicyInstance) -> bool,
);

impl Collector for StateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let loaded = self.current.load();
        let host = &loaded.host;
        let core = host.core();
        let topology = core.topology();
        let rows: Vec<_> = topology
            .cluster()
            .workers()
            .iter()
            .flat_map(|w| w.rows().collect::<Vec<_>>())
            .collect();
        let row_labels = |row: &router_core::model::RowId| -> Labels {
            vec![
                ("worker", row.worker_id.to_string()),
                ("dp_rank", row.dp_rank.to_string()),
            ]
        };
        let booked: Vec<_> = rows
            .iter()
            .map(|r| (row_labels(r), core.booked(*r)))
            .collect();
        family(
            &mut encoder,
            "router_booked_active_requests",
            "Requests the router booked on each row and has not released",
            MetricType::Gauge,
            booked
                .iter()
                .map(|(l, load)| (l.clone(), ConstGauge::new(load.active_requests as i64))),
        )?;
        family(
            &mut encoder,
            "router_booked_prefill_tokens",
            "Prompt tokens booked on each row whose prefill has not finished",
            MetricType::Gauge,
            booked.iter().map(|(l, load)| {
                (
                    l.clone(),
                    ConstGauge::new(load.active_prefill_tokens as i64),
                )
            }),
        )?;
        family(
            &mut encoder,
            "router_booked_decode_blocks",
            "KV blocks booked on each row by requests in flight",
            MetricType::Gauge,
            booked
                .iter()
                .map(|(l, load)| (l.clone(), ConstGauge::new(load.decode_blocks as i64))),
        )?;
        family(
            &mut encoder,
            "router_worker_kv_capacity_blocks",
            "KV capacity per rank in blocks, as policies see it (workers[].total_kv_blocks, else \
             the engine's num_gpu_blocks less its null block); absent while unknown",
            MetricType::Gauge,
            topology.cluster().workers().iter().filter_map(|w| {
                let blocks = i64::try_from(w.total_kv_blocks?).ok()?;
                Some((
                    vec![("worker", w.worker_id.to_string())],
                    ConstGauge::new(blocks),
                ))
            }),
        )?;
        family(
            &mut encoder,
            "router_load_active_requests",
            "Active requests per row as policies see them: max(booked here + booked by other replicas, observed on the engine)",
            MetricType::Gauge,
            rows.iter().map(|r| {
                (
                    row_labels(r),
                    ConstGauge::new(core.load(*r).active_requests as i64),
                )
            }),
        )?;
        let none: [(Labels, ConstGauge); 0] = [];
        family(
            &mut encoder,
            "router_core_in_flight",
            "Bookings the routing core holds for the configuration serving now",
            MetricType::Gauge,
            none.into_iter().chain(std::iter::once((
                Labels::new(),
                ConstGauge::new(core.in_flight() as i64),
            ))),
        )?;
        let admission = core.admission_stats();
        family(
            &mut encoder,
            "router_queue_depth",
            "Requests waiting in admission queues now",
            MetricType::Gauge,
            std::iter::once((Labels::new(), ConstGauge::new(admission.waiting as i64))),
        )?;
        // Only the signals some class limits: an operator sees when a limit has nothing to read.
        let classes = core.classes();
        let limited = [
            (
                "waiting",
                classes.iter().any(|c| c.max_engine_waiting.is_some()),
            ),
            ("kv_usage", classes.iter().any(|c| c.max_kv_usage.is_some())),
        ];
        family(
            &mut encoder,
            "router_engine_saturation_unknown_rows",
            "Rows whose engine has not reported a signal a policy class limits (max_engine_waiting: waiting, max_kv_usage: kv_usage); such a row is never saturated",
            MetricType::Gauge,
            limited
                .into_iter()
                .filter(|(_, used)| *used)
                .map(|(signal, _)| {
                    let unknown = rows
                        .iter()
                        .filter(|r| {
                            let seen = core.engine_signals(**r);
                            match signal {
                                "waiting" => seen.waiting.is_none(),
                                _ => seen.kv_usage.is_none(),
                            }
                        })
                        .count();
                    (
                        vec![("signal", signal.to_owned())],
                        ConstGauge::new(unknown as i64),
                    )
                }),
        )?;
        family(
            &mut encoder,
            "router_queue_stalled",
            "Queued requests whose re-evaluation hung (ran past the longest hang_after_ms): their lane moved on without them (this configuration)",
            MetricType::Counter,
            std::iter::once((Labels::new(), ConstCounter::new(admission.stalled))),
        )?;
        family(
            &mut encoder,
            "router_config_generation",
            "Number of the configuration serving now (1 at start, +1 per successful reload)",
            MetricType::Gauge,
            std::iter::once((Labels::new(), ConstGauge::new(loaded.number as i64))),
        )?;
        family(
            &mut encoder,
            "router_prompts_tokenized",
            "1 when this configuration tokenizes prompts (something reads their token ids), 0 \
             when it routes on their estimated size (docs/serve.md)",
            MetricType::Gauge,
            std::iter::once((
                Labels::new(),
                ConstGauge::new(i64::from(loaded.prompt_ids.tokenize())),
            )),
        )?;
        if let Some(stats) = loaded.tokenizer.as_ref().and_then(|t| t.segment_stats()) {
            // docs/serve.md, "The segment cache": pieces of prompts not tokenized again.
            family(
                &mut encoder,
                "router_tokenizer_segments",
                "Closed prompt pieces looked up in the local tokenizer's segment cache",
                MetricType::Counter,
                [("hit", stats.hits), ("miss", stats.misses)].map(|(outcome, n)| {
                    (vec![("outcome", outcome.to_owned())], ConstCounter::new(n))
                }),
            )?;
            let words = loaded.tokenizer.as_ref().and_then(|t| t.word_stats());
            if let Some(words) = words {
                // docs/serve.md, "The word split": words not tokenized again.
                family(
                    &mut encoder,
                    "router_tokenizer_words",
                    "Words of prompts looked up in the local tokenizer's word cache \
                     (fallback: a piece tokenized whole by tokenizers)",
                    MetricType::Counter,
                    [
                        ("hit", words.hits),
                        ("miss", words.misses),
                        ("fallback", words.fallbacks),
                    ]
                    .map(|(outcome, n)| {
                        (vec![("outcome", outcome.to_owned())], ConstCounter::new(n))
                    }),
                )?;
            }
            let prefixes = loaded.tokenizer.as_ref().and_then(|t| t.prefix_stats());
            if let Some(prefixes) = prefixes {
                // docs/serve.md, "The prefix cache": chunks of long prompts not tokenized again.
                family(
                    &mut encoder,
                    "router_tokenizer_prefixes",
                    "Leading chunks of prompts' open ends looked up in the local tokenizer's \
                     prefix cache",
                    MetricType::Counter,
                    [("hit", prefixes.hits), ("miss", prefixes.misses)].map(|(outcome, n)| {
                        (vec![("outcome", outcome.to_owned())], ConstCounter::new(n))
                    }),
                )?;
            }
            let bytes = [
                ("segments", Some(stats.bytes)),
                ("words", words.map(|w| w.bytes)),
                ("prefixes", prefixes.map(|p| p.bytes)),
            ];
            family(
                &mut encoder,
                "router_tokenizer_cache_bytes",
                "Bytes the local tokenizer's caches hold (texts, ids and overhead), per cache",
                MetricType::Gauge,
                bytes.into_iter().filter_map(|(cache, bytes)| {
                    bytes.map(|b| (vec![("cache", cache.to_owned())], ConstGauge::new(b as i64)))
                }),
            )?;
        }
        if let Some(table) = host.sessions() {
            family(
                &mut encoder,
                "router_session_bindings_held",
                "Session bindings held now",
                MetricType::Gauge,
                std::iter::once((Labels::new(), ConstGauge::new(table.len() as i64))),
            )?;
        }
        if let Some(store) = &loaded.shared_sessions {
            // docs/replicas.md, "Outages": what the shared session store costs and did.
            let s = store.store_stats();
            family(
                &mut encoder,
                "router_session_store_up",
                "1 when the shared session store answered the last call or probe, else 0",
                MetricType::Gauge,
                std::iter::once((Labels::new(), ConstGauge::new(i64::from(s.up)))),
            )?;
            let counters: [(&str, &str, u64); 4] = [
                (
                    "router_session_store_outages",
                    "Outages of the shared session store begun",
                    s.outages,
                ),
                (
                    "router_session_store_degraded_requests",
                    "Requests with a session served without the store (routed without binding, or refused)",
                    s.degraded,
                ),
                (
                    "router_session_store_foreign_keys",
                    "Store keys that held something else than a binding (skipped, never written)",
                    s.foreign,
                ),
                (
                    "router_session_store_errors",
                    "Store calls that failed or timed out",
                    s.errors,
                ),
            ];
            constant_counters(&mut encoder, &counters)?;
            if let Some(share) = store.shared_load() {
                // docs/replicas.md, "Shared load".
                let s = share.stats();
                let gauges: [(&str, &str, f64); 3] = [
                    (
                        "router_shared_load_up",
                        "1 when the last shared-load round reached the store, else 0",
                        f64::from(u8::from(s.up)),
                    ),
                    (
                        "router_shared_load_replicas",
                        "Other replicas whose booked load this replica adds to its own now",
                        s.replicas as f64,
                    ),
                    (
                        "router_shared_load_view_age_seconds",
                        "Seconds since the other replicas' load applied now was read (since start while none was)",
                        s.view_age_secs,
                    ),
                ];
                for (name, help, value) in gauges {
                    family(
                        &mut encoder,
                        name,
                        help,
                        MetricType::Gauge,
                        std::iter::once((Labels::new(), ConstGauge::new(value))),
                    )?;
                }
                let counters: [(&str, &str, u64); 4] = [
                    (
                        "router_shared_load_outages",
                        "Shared-load outages begun (a round failed after one that did not)",
                        s.outages,
                    ),
                    (
                        "router_shared_load_dropped",
                        "Times the other replicas' load was dropped: no answer from the store for the TTL",
                        s.dropped,
                    ),
                    (
                        "router_shared_load_refused",
                        "Other replicas' hashes and fields refused (not a hash, over the bounds, unparsable)",
                        s.refused,
                    ),
                    (
                        "router_shared_load_errors",
                        "Shared-load rounds that failed",
                        s.errors,
                    ),
                ];
                constant_counters(&mut encoder, &counters)?;
                let shared: Vec<_> = rows
                    .iter()
                    .map(|r| (row_labels(r), core.shared_load(*r)))
                    .collect();
                type Read = fn(&router_core::model::RowLoad) -> u64;
                let per_row: [(&str, &str, Read); 3] = [
                    (
                        "router_shared_load_active_requests",
                        "Requests other replicas booked on each row, added to this replica's",
                        |l| l.active_requests,
                    ),
                    (
                        "router_shared_load_prefill_tokens",
                        "Prompt tokens other replicas booked on each row, added to this replica's",
                        |l| l.active_prefill_tokens,
                    ),
                    (
                        "router_shared_load_decode_blocks",
                        "KV blocks other replicas booked on each row, added to this replica's",
                        |l| l.decode_blocks,
                    ),
                ];
                for (name, help, read) in per_row {
                    family(
                        &mut encoder,
                        name,
                        help,
                        MetricType::Gauge,
                        shared.iter().map(|(l, load)| {
                            (
                                l.clone(),
                                ConstGauge::new(i64::try_from(read(load)).unwrap_or(i64::MAX)),
                            )
                        }),
                    )?;
                }
            }
        }
        let router = host.policy_set();
        let instance_labels = |i: &router_policies::instance::PolicyInstance| -> Labels {
            vec![
                ("instance", i.name.clone()),
                ("policy", i.type_name.clone()),
            ]
        };
        let instances: Vec<_> = router
            .instances()
            .iter()
            .map(|i| (instance_labels(i), i.stats.snapshot(), i))
            .collect();
        let counters: [CounterSpec; 7] = [
            (
                "router_policy_picks",
                "Picks asked of each policy instance",
                |c| c.picks,
            ),
            (
                "router_policy_errors",
                "Picks that returned an error",
                |c| c.errors,
            ),
            (
                "router_policy_panics",
                "Picks that panicked (the instance is then poisoned)",
                |c| c.panics,
            ),
            (
                "router_policy_fallbacks",
                "Requests of the instance decided by the built-in default instead",
                |c| c.fallbacks,
            ),
            (
                "router_policy_slow_picks",
                "Decisions over the instance's pick_budget_us because the pick alone was",
                |c| c.slow_picks,
            ),
            (
                "router_policy_slow_explains",
                "Decisions over the instance's pick_budget_us because explain pushed pick + \
                 explain past it (serve explains every decision)",
                |c| c.slow_explains,
            ),
            (
                "router_policy_hangs",
                "Calls found running past the instance's hang_after_ms",
                |c| c.hangs,
            ),
        ];
        for (name, help, get) in counters {
            family(
                &mut encoder,
                name,
                help,
                MetricType::Counter,
                instances
                    .iter()
                    .map(|(l, c, _)| (l.clone(), ConstCounter::new(get(c)))),
            )?;
        }
        let flags: [FlagSpec; 3] = [
            (
                "router_policy_quarantined",
                "1 while the instance is quarantined after repeated slow picks",
                |i| i.is_quarantined(),
            ),
            (
                "router_policy_poisoned",
                "1 once the instance panicked",
                |i| i.is_poisoned(),
            ),
            (
                "router_policy_hung",
                "1 once a call into the instance hung",
                |i| i.is_hung(),
            ),
        ];
        for (name, help, get) in flags {
            family(
                &mut encoder,
                name,
                help,
                MetricType::Gauge,
                instances
                    .iter()
                    .map(|(l, _, i)| (l.clone(), ConstGauge::new(i64::from(get(i))))),
            )?;
        }
        family(
            &mut encoder,
            "router_plugin_images_mapped",
            "Plugin images (shared objects) mapped in this process: one per distinct plugin file \
             ever loaded; a reload of a changed plugin adds one, and none is ever unmapped",
            MetricType::Gauge,
            std::iter::once((
                Labels::new(),
                ConstGauge::new(router_policies::loader::images_mapped() as i64),
            )),
        )?;
        family(
            &mut encoder,
            "router_plugin_images_max",
            "plugin_images_max of the configuration serving now: a reload that would map more \
             plugin images fails (restart to go back to one image per plugin)",
            MetricType::Gauge,
            std::iter::once((
                Labels::new(),
                ConstGauge::new(router.plugin_images_max() as i64),
            )),
        )?;
        // One series per instance and state, 1 for the state it is in: an alert can match
        // `state!="in_service"` without knowing the states.
        family(
            &mut encoder,
            "router_policy_instance_state",
            "1 for the state each policy instance is in (in_service, poisoned, quarantined, \
             hung), 0 for the others; out of service, its requests go to its fallback (or fail \
             with on_error: fail)",
            MetricType::Gauge,
            instances.iter().flat_map(|(l, _, i)| {
                let now = i.state();
                router_policies::instance::InstanceState::ALL.map(|state| {
                    let mut labels = l.clone();
                    labels.push(("state", state.as_str().to_owned()));
                    (labels, ConstGauge::new(i64::from(state == now)))
                })
            }),
        )?;
        let health = self.health.snapshot();
        family(
            &mut encoder,
            "router_engine_healthy",
            "1 while the engine answers its health probe (an unhealthy engine gets no requests)",
            MetricType::Gauge,
            health.iter().map(|(id, url, healthy)| {
                (
                    vec![("worker", id.to_string()), ("url", url.clone())],
                    ConstGauge::new(i64::from(*healthy)),
                )
            }),
        )?;
        family(
            &mut encoder,
            "router_engine_kv_cache_usage",
            "The engine's KV-cache usage (0..1), vllm:kv_cache_usage_perc from its last scrape",
            MetricType::Gauge,
            self.health.kv_usage().into_iter().map(|(id, rank, usage)| {
                (
                    vec![("worker", id.to_string()), ("dp_rank", rank.to_string())],
                    ConstGauge::new(usage),
                )
            }),
        )?;
        Ok(())
    }
}
