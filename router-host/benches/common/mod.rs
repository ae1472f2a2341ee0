//! Shared by the benchmarks: building and finding the plugin `.so`, the benchmark cluster and
//! cache contents, a deterministic generator, paired timing, and the callgrind entry point.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use criterion::Criterion;
use plugin_api::Columns;

use router_host::config::RouterConfig;
use router_host::host::{Host, NoOverlap};
use router_host::kv_index::{KvEvent, KvEventKind, KvIndex, RowMap};
use router_host::loader::SearchPath;
use router_host::model::{Cluster, Request, RowId, Worker};
use router_host::policy_set::PolicySet;

pub mod prose;

/// Workers and ranks of the benchmark cluster (16 workers x 8 ranks).
pub const WORKERS: u32 = 16;
pub const RANKS: u32 = 8;
/// A 4,096-token prompt in 16-token blocks.
pub const BLOCK_SIZE: u32 = 16;
pub const PROMPT_TOKENS: u64 = 4096;
pub const PROMPT_BLOCKS: usize = (PROMPT_TOKENS / BLOCK_SIZE as u64) as usize;

/// `target/<profile>`, from this benchmark executable's location (`target/<profile>/deps/`).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("benchmark executable path");
    exe.parent()
        .and_then(Path::parent)
        .expect("benchmark executable lives in target/<profile>/deps")
        .to_path_buf()
}

/// Build `two-tier-cost-fn` (once per process) with this benchmark's target directory and
/// profile, as `tests/common` does, and return the path of `libtwo_tier_cost_fn.so`.
///
/// `cargo bench` leaves this binary in `target/release/deps`, so the plugin is built with
/// `--release`: the same optimisation settings as the statically linked copy it is compared with.
pub fn two_tier_so() -> &'static Path {
    static SO: OnceLock<PathBuf> = OnceLock::new();
    SO.get_or_init(|| {
        let dir = profile_dir();
        let target_dir = dir.parent().expect("target dir").to_path_buf();
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "--quiet", "-p", "two-tier-cost-fn"]);
        match dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") => {}
            Some("release") => {
                cmd.arg("--release");
            }
            Some(other) => {
                cmd.args(["--profile", other]);
            }
            None => {}
        }
        cmd.env("CARGO_TARGET_DIR", &target_dir)
            .current_dir(env!("CARGO_MANIFEST_DIR"));
        let status = cmd.status().expect("run cargo build for two-tier-cost-fn");
        assert!(status.success(), "building two-tier-cost-fn failed");
        let so = dir.join("libtwo_tier_cost_fn.so");
        assert!(so.is_file(), "{} missing after the build", so.display());
        so
    })
}

/// Router config text: the two-tier plugin loaded from `two_tier_so()` serving the aggregated
/// role with `parameters` (a YAML flow mapping), plus `extra` top-level YAML.
pub fn two_tier_config(parameters: &str, extra: &str) -> RouterConfig {
    let yaml = format!(
        "block_size: {BLOCK_SIZE}\nplugins: [{{path: {}}}]\nworker_selection:\n  aggregated: t\n  instances:\n    - {{name: t, type: dynamo-two-tier-cost-fn, parameters: {parameters}}}\n{extra}",
        two_tier_so().display()
    );
    RouterConfig::from_yaml_str(&yaml, None).expect("benchmark config")
}

/// A router with the two-tier instance loaded through the real loader.
pub fn two_tier_router(config: &RouterConfig) -> PolicySet {
    PolicySet::from_config(config, &SearchPath::default()).expect("load the two-tier plugin")
}

/// `WORKERS` workers of `RANKS` ranks each.
pub fn cluster() -> Cluster {
    Cluster::new(
        (0..u64::from(WORKERS))
            .map(|w| Worker::new(w).with_ranks(0, RANKS))
            .collect(),
    )
    .expect("benchmark cluster")
}

pub use router_host::rng::SplitMix64 as Rng;

/// Cache contents shaped like a multi-tenant conversation workload.
///
/// A pool of `pool` prompts of `PROMPT_BLOCKS` blocks each: the first `PREFIX_BLOCKS` blocks are
/// one of `TENANTS` shared system prompts, the rest are unique to the prompt. Every row (engine)
/// caches `per_row` prompts drawn from the pool, so a block is held by a few rows and the index
/// holds about `pool * (PROMPT_BLOCKS - PREFIX_BLOCKS)` distinct blocks.
pub struct CacheFixture {
    pub index: KvIndex,
    pub prompts: Vec<Vec<u64>>,
    /// Pool indices each row holds, oldest first.
    pub held: Vec<std::collections::VecDeque<usize>>,
    pub rng: Rng,
}

pub const TENANTS: u64 = 8;
pub const PREFIX_BLOCKS: usize = 32;

/// A block id no pool prompt uses (the benchmark request's own blocks, and fresh prompts).
pub fn fresh_block(rng: &mut Rng) -> u64 {
    rng.next_u64() | (1 << 63)
}

impl CacheFixture {
    pub fn new(rows: usize, pool: usize, per_row: usize, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let prompts: Vec<Vec<u64>> = (0..pool).map(|_| Self::prompt(&mut rng, TENANTS)).collect();
        let mut index = KvIndex::new(rows);
        let mut held = vec![std::collections::VecDeque::new(); rows];
        for (row, list) in held.iter_mut().enumerate() {
            for _ in 0..per_row {
                let p = rng.below(pool as u64) as usize;
                for &block in &prompts[p] {
                    index.apply(&stored(row as u32, block));
                }
                list.push_back(p);
            }
        }
        CacheFixture {
            index,
            prompts,
            held,
            rng,
        }
    }

    /// A prompt: one tenant's shared prefix, then blocks of its own.
    pub fn prompt(rng: &mut Rng, tenants: u64) -> Vec<u64> {
        let tenant = rng.below(tenants);
        (0..PROMPT_BLOCKS)
            .map(|i| {
                if i < PREFIX_BLOCKS {
                    // Small ids: shared by every prompt of the tenant.
                    tenant * 1_000 + i as u64
                } else {
                    rng.next_u64() & !(1 << 63)
                }
            })
            .collect()
    }

    /// Row-block pairs held.
    pub fn holdings(&self) -> u64 {
        self.index.holdings()
    }
}

/// Distinct benchmark prompts the decisions rotate through (`benches/decision.rs`,
/// `benches/concurrent.rs`), so the index lookups are not all served from a cache warmed by the
/// previous iteration.
pub const PROMPTS: usize = 256;

/// The benchmark cluster's rows, in row-index order.
pub const ROWS: RowMap = RowMap {
    workers: WORKERS,
    dp_size: RANKS,
};

/// The row of row index `index` of the benchmark cluster.
pub fn row(index: usize) -> RowId {
    ROWS.row(index)
}

/// The cache contents of the decision benchmarks: every row caches 125 prompts of a 4,000-prompt
/// pool (1,000 prompts' worth per worker), so every row holds all 8 tenants' system prompts.
pub fn decision_fixture() -> CacheFixture {
    CacheFixture::new(ROWS.rows(), 4_000, 125, 7)
}

/// One of the [`PROMPTS`] benchmark prompts.
pub struct BenchPrompt {
    /// `PROMPT_BLOCKS` blocks: a tenant's system prompt, then blocks of its own.
    pub blocks: Vec<u64>,
    /// The two rows holding all of it.
    pub full_rows: [usize; 2],
}

/// The benchmark prompts, storing what the rows cache of each with `store(row index, blocks)`:
/// a quarter of the rows hold a varied leading run of the prompt (system prompt plus 0 to 159
/// blocks) and two rows hold all of it, so the cache tier fires. `store` is called for every row
/// of every prompt, with an empty run for a row that holds none of it.
pub fn bench_prompts(mut store: impl FnMut(usize, &[u64])) -> Vec<BenchPrompt> {
    let n = ROWS.rows();
    let mut rng = Rng::new(11);
    (0..PROMPTS)
        .map(|p| {
            // A tenant's system prompt (every rank caches all 8), then blocks of its own.
            let tenant = p as u64 % TENANTS;
            let blocks: Vec<u64> = (0..PROMPT_BLOCKS)
                .map(|i| {
                    if i < PREFIX_BLOCKS {
                        tenant * 1_000 + i as u64
                    } else {
                        fresh_block(&mut rng)
                    }
                })
                .collect();
            // A quarter of the rows hold a varied part of the rest (earlier turns of the
            // conversation went there); two rows hold all of it (the previous turn).
            let full_rows = [rng.below(n as u64) as usize, rng.below(n as u64) as usize];
            for r in 0..n {
                let run = if full_rows.contains(&r) {
                    PROMPT_BLOCKS
                } else if rng.below(4) == 0 {
                    PREFIX_BLOCKS + rng.below(160) as usize
                } else {
                    0
                };
                store(r, &blocks[..run]);
            }
            BenchPrompt { blocks, full_rows }
        })
        .collect()
}

/// Steady background load: 0..=12 pinned requests booked on each row, never completed.
pub fn background_load(host: &Host) {
    for r in 0..ROWS.rows() {
        for _ in 0..(r * 7) % 13 {
            let pinned = Request {
                isl_tokens: 1024,
                pinned_worker: Some(row(r)),
                ..Request::default()
            };
            host.route(&pinned, &NoOverlap, false)
                .expect("background load");
        }
    }
}

pub fn stored(row: u32, block: u64) -> KvEvent {
    KvEvent::on_device(row, KvEventKind::Stored, block)
}

pub fn evicted(row: u32, block: u64) -> KvEvent {
    KvEvent::on_device(row, KvEventKind::Evicted, block)
}

/// Criterion settings sized so the whole suite stays within a few minutes on 2 cores.
pub fn criterion() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(50)
        .configure_from_args()
}

/// `cargo bench -- --test` / `--list` (and `cargo test --benches`): skip the extra
/// measurements printed after criterion's.
pub fn quick_mode() -> bool {
    std::env::args().any(|a| a == "--test" || a == "--list" || a == "--profile-time")
}

/// The result of [`paired`].
#[derive(Debug, Clone, Copy)]
pub struct Paired {
    /// Median over rounds of per-call nanoseconds.
    pub a_ns: f64,
    pub b_ns: f64,
    /// Median over rounds of `b / a` (each round times both back to back).
    pub ratio: f64,
    /// Median over rounds of `b - a`, per call.
    pub delta_ns: f64,
    /// Fastest round of each side, per call: what is left once interference is filtered out.
    pub a_min_ns: f64,
    pub b_min_ns: f64,
}

/// Time `a` and `b` alternately (`calls` calls each per round, order swapped every round) and
/// take medians over rounds: a load change on a shared machine hits both sides of a round alike,
/// which makes the ratio far steadier than two separate measurements.
pub fn paired(mut a: impl FnMut(), mut b: impl FnMut(), calls: u32, rounds: usize) -> Paired {
    let time = |f: &mut dyn FnMut()| {
        let started = Instant::now();
        for _ in 0..calls {
            f();
        }
        started.elapsed().as_nanos() as f64 / f64::from(calls)
    };
    for _ in 0..rounds / 10 + 1 {
        time(&mut a);
        time(&mut b);
    }
    let (mut ta, mut tb, mut ratio, mut delta) = (
        Vec::with_capacity(rounds),
        Vec::with_capacity(rounds),
        Vec::with_capacity(rounds),
        Vec::with_capacity(rounds),
    );
    for round in 0..rounds {
        let (x, y) = if round % 2 == 0 {
            let x = time(&mut a);
            (x, time(&mut b))
        } else {
            let y = time(&mut b);
            (time(&mut a), y)
        };
        ta.push(x);
        tb.push(y);
        ratio.push(y / x);
        delta.push(y - x);
    }
    let min = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    let (a_min_ns, b_min_ns) = (min(&ta), min(&tb));
    Paired {
        a_min_ns,
        b_min_ns,
        a_ns: median(&mut ta),
        b_ns: median(&mut tb),
        ratio: median(&mut ratio),
        delta_ns: median(&mut delta),
    }
}

pub fn median(values: &mut [f64]) -> f64 {
    percentile(values, 0.5)
}

/// Nearest-rank percentile (`q` in 0..=1); sorts `values`.
pub fn percentile(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(|a, b| a.total_cmp(b));
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    values[rank - 1]
}

/// `ROUTER_BENCH_PROFILE=<name>[:<arg>]`: run one benchmark body in a plain loop instead of
/// criterion (for `valgrind --tool=callgrind --toggle-collect='*profile_loop*'`). Returns the
/// name and argument when set.
pub fn profile_request() -> Option<(String, String)> {
    let spec = std::env::var("ROUTER_BENCH_PROFILE").ok()?;
    let (name, arg) = spec.split_once(':').unwrap_or((&spec, ""));
    Some((name.to_string(), arg.to_string()))
}

/// Iterations for a profile run (`ROUTER_BENCH_ITERS`, default `default`).
pub fn profile_iters(default: u64) -> u64 {
    std::env::var("ROUTER_BENCH_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The loop callgrind's `--toggle-collect='*profile_loop*'` counts: `iters` calls of `f`.
#[inline(never)]
pub fn profile_loop(iters: u64, f: &mut dyn FnMut()) {
    for _ in 0..iters {
        f();
    }
}

// ---- overlap from a bench-local KV index --------------------------------------------------

use std::cell::{Cell, RefCell};

use router_host::model::{Fill, OverlapSource, TierOverlap};

/// Reusable buffers for [`RequestOverlap`].
#[derive(Debug, Default)]
pub struct OverlapScratch {
    out: Vec<u32>,
    alive: Vec<u64>,
}

/// One request's view of a bench-local index (the decision benchmark measures the host with
/// overlap from its own `KvIndex`, as it did before the core kept one), computed on the first row the policy asks about (policies
/// that do not read the CACHE columns never pay for it).
pub struct RequestOverlap<'a> {
    index: &'a KvIndex,
    blocks: &'a [u64],
    rows: RowMap,
    scratch: &'a RefCell<OverlapScratch>,
    computed: Cell<bool>,
}

impl<'a> RequestOverlap<'a> {
    pub fn new(
        index: &'a KvIndex,
        blocks: &'a [u64],
        rows: RowMap,
        scratch: &'a RefCell<OverlapScratch>,
    ) -> Self {
        RequestOverlap {
            index,
            blocks,
            rows,
            scratch,
            computed: Cell::new(false),
        }
    }
}

impl RequestOverlap<'_> {
    /// Walk the index for this request, once.
    fn compute(&self) {
        if !self.computed.get() {
            let mut scratch = self.scratch.borrow_mut();
            let OverlapScratch { out, alive } = &mut *scratch;
            self.index.overlaps(self.blocks, out, alive);
            self.computed.set(true);
        }
    }

    /// Leading blocks of the request held by `row` (after [`RequestOverlap::compute`]).
    fn blocks(&self, out: &[u32], row: RowId) -> f64 {
        let blocks = self.rows.index(row).and_then(|i| out.get(i));
        f64::from(blocks.copied().unwrap_or(0))
    }
}

impl OverlapSource for RequestOverlap<'_> {
    fn overlap(&self, row: RowId) -> TierOverlap {
        if self.rows.index(row).is_none() {
            return TierOverlap::default();
        }
        self.compute();
        TierOverlap {
            device: self.blocks(&self.scratch.borrow().out, row),
            // Only the device tier is simulated.
            host: 0.0,
            disk: 0.0,
        }
    }

    fn overlap_columns(&self, rows: &[RowId], out: &mut Columns) -> Fill {
        self.compute();
        let scratch = self.scratch.borrow();
        for (&row, device) in rows.iter().zip(&mut out.device) {
            *device = self.blocks(&scratch.out, row);
        }
        Fill::Zeros
    }
}
