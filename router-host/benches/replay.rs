//! Replay throughput on the shared Mooncake conversation trace.
//!
//! The whole trace through the real host (and the two-tier `.so`) on 8 simulated workers, once
//! per config: `examples/replay/{default,two-tier,round-robin}.yaml`. Throughput is simulated
//! requests per second of wall time. The trace is looked for at `$ROUTER_BENCH_TRACE`, then at
//! `../shared/traces/mooncake_conversation/conversation_trace.jsonl` next to the workspace; when
//! it is absent the benchmark prints a note and measures nothing.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use criterion::Throughput;

use router_host::replay::trace::{Workload, DEFAULT_TRACE_BLOCK_SIZE};
use router_host::replay::{prepare_file, sim, RunConfig, Setup};

const CONFIGS: [&str; 3] = ["default", "two-tier", "round-robin"];
const WORKERS: u32 = 8;

fn trace_path() -> Option<PathBuf> {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf();
    let candidates = [
        std::env::var_os("ROUTER_BENCH_TRACE").map(PathBuf::from),
        Some(workspace.join("../shared/traces/mooncake_conversation/conversation_trace.jsonl")),
    ];
    candidates.into_iter().flatten().find(|p| p.is_file())
}

fn run(workload: &Workload, setup: &Setup, config: &RunConfig) -> usize {
    let output = sim::run(workload, setup.shape, config, &mut |_| {})
        .unwrap_or_else(|e| panic!("replay {}: {e}", config.label));
    output.jobs.len()
}

fn main() {
    let Some(trace) = trace_path() else {
        println!(
            "replay benchmark skipped: the Mooncake conversation trace is not there \
             (set ROUTER_BENCH_TRACE, or place it at ../shared/traces/mooncake_conversation/)"
        );
        return;
    };
    let workload = Workload::from_jsonl_file(&trace, DEFAULT_TRACE_BLOCK_SIZE)
        .unwrap_or_else(|e| panic!("{}: {e}", trace.display()));
    let mut setup = Setup::new(WORKERS, 1);
    // `two-tier.yaml` names its plugin; resolve it to the one built for this run.
    setup.plugin_dirs = vec![common::two_tier_so()
        .parent()
        .expect("plugin dir")
        .to_path_buf()];
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/replay");
    let configs: Vec<RunConfig> = CONFIGS
        .iter()
        .map(|name| {
            prepare_file(
                &examples.join(format!("{name}.yaml")),
                &setup,
                workload.block_size,
            )
            .unwrap_or_else(|e| panic!("{name}: {e}"))
        })
        .collect();
    let requests = workload.requests.len();
    println!("trace {}: {requests} requests", trace.display());

    if let Some((name, _)) = common::profile_request() {
        let index = CONFIGS
            .iter()
            .position(|c| *c == name)
            .unwrap_or_else(|| panic!("ROUTER_BENCH_PROFILE: one of {CONFIGS:?}"));
        common::profile_loop(1, &mut || {
            run(&workload, &setup, &configs[index]);
        });
        return;
    }

    let mut c = common::criterion()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(3));
    {
        let mut group = c.benchmark_group("replay_mooncake_8_workers");
        group.throughput(Throughput::Elements(requests as u64));
        for (name, config) in CONFIGS.iter().zip(&configs) {
            group.bench_function(*name, |b| b.iter(|| run(&workload, &setup, config)));
        }
        group.finish();
    }
    c.final_summary();
    if !common::quick_mode() {
        // The CLI's whole job minus parsing and reporting: three configs back to back.
        let started = Instant::now();
        for config in &configs {
            assert_eq!(run(&workload, &setup, config), requests);
        }
        let wall = started.elapsed().as_secs_f64();
        println!(
            "\nthree configs back to back: {:.3} s, {:.0} simulated requests/s ({} simulated)",
            wall,
            (3 * requests) as f64 / wall,
            3 * requests
        );
    }
}
