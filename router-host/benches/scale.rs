//! Decision cost and memory against fleet size (docs/performance.md, "Fleet size").
//!
//! For N rows in 8, 64, 256, 1,024 and 4,096, in two shapes (N/8 workers x 8 DP ranks, and N
//! workers x 1 rank), with the built-in `default` selector and with the two-tier plugin loaded
//! from its `.so`, one routing core holds:
//!
//! * a KV index fed through the core's own event path (`RoutingCore::apply_kv_events`): every
//!   row caches `ROUTER_BENCH_SCALE_PROMPTS` (default 4) prompts of 256 blocks (4,096 tokens in
//!   16-token blocks), drawn from a pool of 2N prompts, each opening with one of 8 tenants'
//!   32-block system prompts; so the index grows with the fleet as a real one does (each engine
//!   caches its own share), and a prompt is on about two rows;
//! * 256 decision prompts, each held whole by 2 rows and in part (its system prompt plus 0 to
//!   159 blocks) by 8 more, whatever N (a conversation's earlier turns went to a few engines,
//!   not to a fixed share of the fleet): the two-tier cache tier fires and picks one of the two
//!   (asserted);
//! * 0 to 12 requests booked on every row.
//!
//! One decision is what `serve` asks of the core: `submit_indexed(request, explain = true)`
//! (overlap from the request's blocks in the core's index, selection, the policy's pick and its
//! explanation, booking) and then `complete`; also timed without the explanation
//! (`route_indexed(request, false)`), and its parts: the KV walk alone and the decision with no
//! overlap lookup. Each is timed one decision at a time (with `Instant`, about 20 ns each) over
//! `ROUTER_BENCH_SCALE_SAMPLES` decisions (default 20,000) after a warm-up, and p50 / p99
//! printed, with the p99 of the thread's CPU time for the whole decisions (on a shared machine a
//! decision of tens of microseconds is often preempted, and the wall-clock p99 is then the
//! scheduler's). The last line times a fixed loop the same way: the machine's own tail.
//!
//! Memory: every (shape, N, policy) runs in a child process of this benchmark, so its resident
//! set is its own: the growth of `VmRSS` while the core, its index and the load were built, and
//! the process's peak (`VmHWM`). Last, the time to clear one row's entries
//! (`RoutingCore::clear_kv_row`, what an engine restart does), during which the index's write
//! lock keeps every decision waiting.
//!
//! ```text
//! cargo bench -p router-host --bench scale                       # the whole table (a few minutes)
//! ROUTER_BENCH_SCALE_ROWS=1024,4096 cargo bench -p router-host --bench scale
//! ROUTER_BENCH_SCALE_SHAPES=flat ROUTER_BENCH_SCALE_POLICIES=two-tier cargo bench ...
//! cargo bench -p router-host --bench scale -- --test             # smoke run: 8 and 64 rows
//! ```
//!
//! Instruction counts (the machine is shared, wall time is not): `ROUTER_BENCH_PROFILE=<part>:
//! <shape>:<rows>:<policy>` builds that one configuration in this process and runs
//! `ROUTER_BENCH_ITERS` (default 2,000) decisions of one part (`serve`, `route`, `no_lookup`,
//! `walk`) inside `common::profile_loop`, for
//! `valgrind --tool=callgrind --collect-atstart=no --toggle-collect='*profile_loop*'`.

mod common;

use std::hint::black_box;
use std::process::Command;
use std::time::Instant;

use router_host::config::RouterConfig;
use router_host::host::{Host, NoOverlap, Submitted};
use router_host::kv_index::{KvEventKind, Tier};
use router_host::model::{Cluster, Request, RowId, Worker};

use common::{Rng, BLOCK_SIZE, PREFIX_BLOCKS, PROMPTS, PROMPT_BLOCKS, PROMPT_TOKENS, TENANTS};

const SIZES: [usize; 5] = [8, 64, 256, 1024, 4096];
/// The child's environment variable: `shape:rows:policy`.
const CHILD: &str = "ROUTER_BENCH_SCALE_CHILD";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// N/8 workers of 8 DP ranks.
    Ranks8,
    /// N workers of 1 rank.
    Flat,
}

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::Ranks8 => "dp8",
            Shape::Flat => "flat",
        }
    }

    fn parse(s: &str) -> Option<Shape> {
        match s {
            "dp8" => Some(Shape::Ranks8),
            "flat" => Some(Shape::Flat),
            _ => None,
        }
    }

    fn ranks(self, rows: usize) -> u32 {
        match self {
            Shape::Ranks8 => 8.min(rows as u32),
            Shape::Flat => 1,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Policy {
    Default,
    TwoTier,
}

impl Policy {
    fn name(self) -> &'static str {
        match self {
            Policy::Default => "default",
            Policy::TwoTier => "two-tier",
        }
    }

    fn parse(s: &str) -> Option<Policy> {
        match s {
            "default" => Some(Policy::Default),
            "two-tier" => Some(Policy::TwoTier),
            _ => None,
        }
    }
}

fn env_list<T>(name: &str, parse: impl Fn(&str) -> Option<T>) -> Option<Vec<T>> {
    let value = std::env::var(name).ok()?;
    Some(
        value
            .split(',')
            .map(|s| parse(s.trim()).unwrap_or_else(|| panic!("{name}: cannot read `{s}`")))
            .collect(),
    )
}

fn env_usize(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{name}: `{v}` is not a count")),
        Err(_) => default,
    }
}

/// `field` of `/proc/self/status` in KiB (0 where there is no such file).
fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

struct Setup {
    host: Host,
    requests: Vec<Request>,
    /// Per decision prompt, the two row indices holding all of it.
    full_rows: Vec<[usize; 2]>,
    ranks: u32,
}

impl Setup {
    /// `profiled`: under callgrind a decision runs tens of times slower, and the instance would
    /// be quarantined for its time budget (its decisions then made by the fallback): give it
    /// a budget it cannot reach.
    fn new(shape: Shape, rows: usize, policy: Policy, per_row: usize, profiled: bool) -> Setup {
        let config = match (policy, profiled) {
            (Policy::TwoTier, false) => common::two_tier_config("{}", ""),
            (Policy::Default, false) => {
                RouterConfig::from_yaml_str(&format!("block_size: {BLOCK_SIZE}\n"), None)
                    .expect("default config")
            }
            (policy, true) => {
                let (plugins, kind) = match policy {
                    Policy::TwoTier => (
                        format!("plugins: [{{path: {}}}]\n", common::two_tier_so().display()),
                        "dynamo-two-tier-cost-fn",
                    ),
                    Policy::Default => (String::new(), "default"),
                };
                let yaml = format!(
                    "block_size: {BLOCK_SIZE}\n{plugins}worker_selection:\n  aggregated: p\n  \
                     instances:\n    - {{name: p, type: {kind}, pick_budget_us: 1000000000}}\n"
                );
                RouterConfig::from_yaml_str(&yaml, None).expect("profile config")
            }
        };
        let ranks = shape.ranks(rows);
        let workers = rows as u32 / ranks;
        let cluster = Cluster::new(
            (0..u64::from(workers))
                .map(|w| Worker::new(w).with_ranks(0, ranks))
                .collect(),
        )
        .expect("benchmark cluster");
        let host = Host::new(common::two_tier_router(&config), cluster, &config);
        let row = |i: usize| RowId {
            worker_id: (i / ranks as usize) as u64,
            dp_rank: (i % ranks as usize) as u32,
        };
        let core = host.core();
        let store = |r: usize, blocks: &[u64]| {
            let events = blocks
                .iter()
                .map(|&b| (KvEventKind::Stored, Tier::Device, b));
            assert!(core.apply_kv_events(row(r), events), "row {r} registered");
        };
        // Every row's own share of the cache, from a pool that grows with the fleet.
        let mut rng = Rng::new(7);
        let pool: Vec<Vec<u64>> = (0..2 * rows)
            .map(|_| common::CacheFixture::prompt(&mut rng, TENANTS))
            .collect();
        for r in 0..rows {
            for _ in 0..per_row {
                store(r, &pool[rng.below(pool.len() as u64) as usize]);
            }
        }
        drop(pool);
        // The decision prompts: whole on two rows, in part on eight more.
        let mut rng = Rng::new(11);
        let mut requests = Vec::with_capacity(PROMPTS);
        let mut full_rows = Vec::with_capacity(PROMPTS);
        for p in 0..PROMPTS {
            let tenant = p as u64 % TENANTS;
            let blocks: Vec<u64> = (0..PROMPT_BLOCKS)
                .map(|i| {
                    if i < PREFIX_BLOCKS {
                        tenant * 1_000 + i as u64
                    } else {
                        common::fresh_block(&mut rng)
                    }
                })
                .collect();
            let full = [
                rng.below(rows as u64) as usize,
                rng.below(rows as u64) as usize,
            ];
            for r in full {
                store(r, &blocks);
            }
            for _ in 0..8 {
                let r = rng.below(rows as u64) as usize;
                if !full.contains(&r) {
                    store(r, &blocks[..PREFIX_BLOCKS + rng.below(160) as usize]);
                }
            }
            full_rows.push(full);
            requests.push(Request {
                isl_tokens: PROMPT_TOKENS,
                blocks,
                ..Request::default()
            });
        }
        // Steady background load: 0..=12 pinned requests on each row, never completed.
        for r in 0..rows {
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
        Setup {
            host,
            requests,
            full_rows,
            ranks,
        }
    }

    fn index_of(&self, row: RowId) -> usize {
        row.worker_id as usize * self.ranks as usize + row.dp_rank as usize
    }

    /// One decision as `route_indexed` + `complete`; returns the row index.
    #[inline(always)]
    fn route(&self, p: usize) -> usize {
        let core = self.host.core();
        let routed = core
            .route_indexed(black_box(&self.requests[p]), false)
            .expect("routed");
        core.complete(routed.id);
        self.index_of(routed.decision.row)
    }

    /// One decision as `serve` asks for it: `submit_indexed(request, explain)` + `complete`.
    #[inline(always)]
    fn serve_path(&self, request: Request) -> usize {
        let core = self.host.core();
        match core.submit_indexed(black_box(request), true) {
            Ok(Submitted::Dispatched(routed)) => {
                core.complete(routed.id);
                self.index_of(routed.decision.row)
            }
            other => panic!("not dispatched: {other:?}"),
        }
    }

    /// The decision without an overlap lookup (every row cold).
    #[inline(always)]
    fn route_no_overlap(&self, p: usize) -> usize {
        let core = self.host.core();
        let routed = core
            .route(black_box(&self.requests[p]), &NoOverlap, false)
            .expect("routed");
        core.complete(routed.id);
        self.index_of(routed.decision.row)
    }

    /// The KV walk alone, for every row.
    #[inline(always)]
    fn walk(&self, p: usize, buffers: &mut [Vec<u32>; 3], alive: &mut Vec<u64>) {
        let [device, host, disk] = buffers;
        self.host.core().kv_index().overlaps_by_tier(
            black_box(&self.requests[p].blocks),
            device,
            host,
            disk,
            alive,
        );
    }
}

/// This thread's CPU time in nanoseconds: unlike the wall clock it stops while the thread is
/// preempted, which on a shared 2-core machine is most of a slow decision's wall-clock tail.
fn thread_cpu_ns() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `clock_gettime` writes the struct it is given, which lives for the call.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 * 1e9 + t.tv_nsec as f64
}

/// p50 and p99 of `samples` calls of `f(i)`, timed one by one (wall clock), and the p99 of
/// their thread CPU time, after a warm-up; nanoseconds.
fn percentiles(samples: usize, mut f: impl FnMut(usize)) -> (f64, f64, f64) {
    for i in 0..(samples / 10).max(PROMPTS) {
        f(i % PROMPTS);
    }
    let mut ns = Vec::with_capacity(samples);
    let mut cpu = Vec::with_capacity(samples);
    for i in 0..samples {
        let cpu_started = thread_cpu_ns();
        let started = Instant::now();
        f(i % PROMPTS);
        ns.push(started.elapsed().as_nanos() as f64);
        cpu.push(thread_cpu_ns() - cpu_started);
    }
    (
        common::percentile(&mut ns, 0.50),
        common::percentile(&mut ns, 0.99),
        common::percentile(&mut cpu, 0.99),
    )
}

/// Steps of [`fixed_work`]: about 40 µs on the 2-core VM of docs/performance.md.
const FIXED_STEPS: u64 = 12_000;

/// The same work every call: a chain of floating-point steps that touches no memory.
fn fixed_work() {
    let mut x = black_box(1.0f64);
    for _ in 0..black_box(FIXED_STEPS) {
        x = x * 1.000_000_1 + 0.5;
        x -= 0.499_999_9;
    }
    black_box(x);
}

/// The machine's own tail, timed as the decisions are: on a VM whose vCPUs share their host, the
/// p99 of identical work is well above its p50, and no decision of median M can show a p99
/// below about that ratio times M.
fn print_machine_tail(samples: usize) {
    let (p50, p99, cpu99) = percentiles(samples, |_| fixed_work());
    println!(
        "fixed work ({FIXED_STEPS} floating-point steps, no memory; the machine's own tail): \
         p50 {:.1} / p99 {:.1} / p99 CPU {:.1} µs; p99 CPU / p50 {:.2}",
        p50 / 1000.0,
        p99 / 1000.0,
        cpu99 / 1000.0,
        cpu99 / p50
    );
}

/// One (shape, rows, policy): build, time, print one `RESULT` line for the parent.
fn child(spec: &str) {
    let (shape, rows, policy) = parse_spec(spec);
    let samples = env_usize("ROUTER_BENCH_SCALE_SAMPLES", 20_000);
    let per_row = env_usize("ROUTER_BENCH_SCALE_PROMPTS", 4);
    // The .so is built (and loaded once) before the baseline is read.
    if policy == Policy::TwoTier {
        common::two_tier_so();
    }
    let rss_before = status_kib("VmRSS");
    let built = Instant::now();
    let s = Setup::new(shape, rows, policy, per_row, false);
    let build_s = built.elapsed().as_secs_f64();
    let rss_after = status_kib("VmRSS");
    let (blocks, pairs) = {
        let kv = s.host.core().kv_index();
        (kv.len(), kv.holdings())
    };
    // The decisions are real: under two-tier the cache tier sends each prompt to a row holding
    // all of it.
    if policy == Policy::TwoTier {
        for p in 0..PROMPTS {
            let row = s.route(p);
            assert!(
                s.full_rows[p].contains(&row),
                "prompt {p}: row {row} is not one of {:?}",
                s.full_rows[p]
            );
        }
    }
    let route = percentiles(samples, |p| {
        black_box(s.route(p));
    });
    // The request is moved into `submit_indexed`: its copy is made outside the timed call.
    let serve = {
        for p in 0..PROMPTS {
            black_box(s.serve_path(s.requests[p].clone()));
        }
        let mut ns = Vec::with_capacity(samples);
        let mut cpu = Vec::with_capacity(samples);
        for i in 0..samples {
            let request = s.requests[i % PROMPTS].clone();
            let cpu_started = thread_cpu_ns();
            let started = Instant::now();
            black_box(s.serve_path(request));
            ns.push(started.elapsed().as_nanos() as f64);
            cpu.push(thread_cpu_ns() - cpu_started);
        }
        (
            common::percentile(&mut ns, 0.50),
            common::percentile(&mut ns, 0.99),
            common::percentile(&mut cpu, 0.99),
        )
    };
    let no_overlap = percentiles(samples, |p| {
        black_box(s.route_no_overlap(p));
    });
    let mut buffers = [Vec::new(), Vec::new(), Vec::new()];
    let mut alive = Vec::new();
    let walk = percentiles(samples, |p| s.walk(p, &mut buffers, &mut alive));
    assert_eq!(s.host.core().in_flight(), s.host.in_flight());
    // An engine restart clears its row under the index's write lock: every decision waits.
    let cleared = {
        let row = RowId {
            worker_id: 0,
            dp_rank: 0,
        };
        let started = Instant::now();
        let n = s.host.core().clear_kv_row(row);
        let ms = started.elapsed().as_secs_f64() * 1e3;
        assert!(n > 0, "row 0 held blocks");
        ms
    };
    println!(
        "RESULT {} {rows} {} {} {:.0} {:.0} {:.0} {:.0} {:.0} {:.0} {:.0} {:.0} {} {} {} {} {:.1} {:.2} {:.0} {:.0}",
        shape.name(),
        s.ranks,
        policy.name(),
        serve.0,
        serve.1,
        route.0,
        route.1,
        no_overlap.0,
        no_overlap.1,
        walk.0,
        walk.1,
        rss_after.saturating_sub(rss_before),
        status_kib("VmHWM"),
        blocks,
        pairs,
        build_s,
        cleared,
        serve.2,
        route.2,
    );
}

/// `ROUTER_BENCH_PROFILE=<part>:<shape>:<rows>:<policy>`: one part's decisions in a plain loop.
fn profile(part: &str, spec: &str) {
    let (shape, rows, policy) = parse_spec(spec);
    let per_row = env_usize("ROUTER_BENCH_SCALE_PROMPTS", 4);
    let s = Setup::new(shape, rows, policy, per_row, true);
    let iters = common::profile_iters(2_000);
    let mut p = 0;
    let mut next = || {
        p = (p + 1) % PROMPTS;
        p
    };
    match part {
        "serve" => common::profile_loop(iters, &mut || {
            let request = s.requests[next()].clone();
            black_box(s.serve_path(request));
        }),
        "route" => common::profile_loop(iters, &mut || {
            black_box(s.route(next()));
        }),
        "no_lookup" => common::profile_loop(iters, &mut || {
            black_box(s.route_no_overlap(next()));
        }),
        "walk" => {
            let mut buffers = [Vec::new(), Vec::new(), Vec::new()];
            let mut alive = Vec::new();
            common::profile_loop(iters, &mut || s.walk(next(), &mut buffers, &mut alive));
        }
        other => {
            panic!("ROUTER_BENCH_PROFILE: unknown part `{other}` (serve, route, no_lookup, walk)")
        }
    }
    // Still the configured instance's decisions (no fallback).
    let core = s.host.core();
    let routed = core.route_indexed(&s.requests[0], false).expect("routed");
    core.complete(routed.id);
    assert!(
        routed.decision.fallback.is_none()
            && routed.decision.decided_by == routed.decision.instance,
        "the profiled decisions fell back: {:?}",
        routed.decision.fallback
    );
    eprintln!("profiled {part} {spec}: {iters} decisions");
}

fn parse_spec(spec: &str) -> (Shape, usize, Policy) {
    let parts: Vec<&str> = spec.split(':').collect();
    match parts.as_slice() {
        [shape, rows, policy] => (
            Shape::parse(shape).expect("shape"),
            rows.parse::<usize>().expect("rows"),
            Policy::parse(policy).expect("policy"),
        ),
        _ => panic!("expected shape:rows:policy, got `{spec}`"),
    }
}

fn main() {
    if let Some((part, spec)) = common::profile_request() {
        profile(&part, &spec);
        return;
    }
    if let Ok(spec) = std::env::var(CHILD) {
        child(&spec);
        return;
    }
    let quick = common::quick_mode();
    let sizes = env_list("ROUTER_BENCH_SCALE_ROWS", |s| s.parse::<usize>().ok())
        .unwrap_or_else(|| if quick { vec![8, 64] } else { SIZES.to_vec() });
    let shapes = env_list("ROUTER_BENCH_SCALE_SHAPES", Shape::parse)
        .unwrap_or_else(|| vec![Shape::Ranks8, Shape::Flat]);
    let policies = env_list("ROUTER_BENCH_SCALE_POLICIES", Policy::parse)
        .unwrap_or_else(|| vec![Policy::Default, Policy::TwoTier]);
    // Build the plugin once, before any child needs it.
    common::two_tier_so();
    let exe = std::env::current_exe().expect("benchmark executable");
    println!(
        "one decision: p50 / p99 in microseconds, timed one by one (wall clock), and the p99 of the \
         thread's CPU time (what is left of the tail without preemption); `serve` = submit_indexed \
         with the explanation + complete, `route` = route_indexed + complete, `no lookup` = route \
         without the KV walk, `walk` = the KV walk alone; memory: VmRSS growth while the core, \
         its index and the load were built, and the child's peak VmHWM"
    );
    println!(
        "{:<5} {:>5} {:>5} {:<8} | {:>23} | {:>23} | {:>15} | {:>15} | {:>8} {:>8} | {:>9} {:>10} {:>7} {:>8}",
        "shape",
        "rows",
        "ranks",
        "policy",
        "serve p50/p99/p99 CPU",
        "route p50/p99/p99 CPU",
        "no lookup",
        "walk",
        "RSS+ MiB",
        "peak MiB",
        "blocks",
        "pairs",
        "build s",
        "clear ms"
    );
    for &shape in &shapes {
        for &rows in &sizes {
            for &policy in &policies {
                let mut cmd = Command::new(&exe);
                cmd.env(CHILD, format!("{}:{rows}:{}", shape.name(), policy.name()));
                if quick {
                    cmd.env("ROUTER_BENCH_SCALE_SAMPLES", "500");
                }
                let out = cmd.output().expect("run the benchmark's child");
                let stdout = String::from_utf8_lossy(&out.stdout);
                let Some(line) = stdout.lines().find_map(|l| l.strip_prefix("RESULT ")) else {
                    panic!(
                        "child {} {rows} {} failed: {}\n{stdout}\n{}",
                        shape.name(),
                        policy.name(),
                        out.status,
                        String::from_utf8_lossy(&out.stderr)
                    );
                };
                let f: Vec<&str> = line.split_whitespace().collect();
                let us = |i: usize| f[i].parse::<f64>().unwrap_or(f64::NAN) / 1000.0;
                let mib = |i: usize| f[i].parse::<f64>().unwrap_or(f64::NAN) / 1024.0;
                println!(
                    "{:<5} {:>5} {:>5} {:<8} | {:>7.1} {:>7.1} {:>7.1} | {:>7.1} {:>7.1} {:>7.1} | {:>7.1} {:>7.1} | {:>7.1} {:>7.1} | {:>8.1} {:>8.1} | {:>9} {:>10} {:>7} {:>8}",
                    f[0], f[1], f[2], f[3],
                    us(4), us(5), us(18), us(6), us(7), us(19), us(8), us(9), us(10), us(11),
                    mib(12), mib(13), f[14], f[15], f[16], f[17]
                );
            }
        }
    }
    print_machine_tail(if quick {
        500
    } else {
        env_usize("ROUTER_BENCH_SCALE_SAMPLES", 20_000)
    });
}
