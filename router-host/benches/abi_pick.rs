//! The two-tier pick through the loaded `.so` versus the same picker
//! linked statically, at 8, 64, 256 and 1,024 rows.
//!
//! * `static/N`: `two_tier_cost_fn` linked as an rlib; per call, `Rows::from_raw` and
//!   `Context::from_raw` over the same ABI columns, then `Policy::pick`.
//! * `so/N`: the same policy loaded by the host's loader from `libtwo_tier_cost_fn.so`
//!   (release build), called through the `sabi_trait` vtable and plugin-api's `Adapter`
//!   (poison check, view check, `catch_unwind`, `RResult`).
//!
//! After criterion's report a paired measurement (both sides timed back to back, alternating)
//! prints the per-call difference and the ratio for each size.
//!
//! Instruction counts (robust on a shared machine):
//! `ROUTER_BENCH_PROFILE=so:256 valgrind --tool=callgrind --collect-atstart=no
//! --toggle-collect='*profile_loop*' target/release/deps/abi_pick-*` (and `static:256`);
//! divide the total by `ROUTER_BENCH_ITERS` (default 100,000).

mod common;

use std::hint::black_box;

use abi_stable::std_types::{ROption, RResult, RSlice};
use criterion::{BenchmarkId, Criterion, Throughput};
use plugin_api::abi::{PolicyBox, RawCandidateView, RawRequestContext, RoleCode};
use plugin_api::{Columns, Context, Inputs, Policy, Rows};
use two_tier_cost_fn::{TwoTierCostFn, TwoTierParams};

const SIZES: [usize; 4] = [8, 64, 256, 1024];

/// The columns of `n` rows: 8 ranks per worker, varied overlap and load (no tier short-cuts:
/// every row is scanned in every call whatever tier decides).
fn columns(n: usize) -> Columns {
    let mut rng = common::Rng::new(n as u64);
    let mut c = Columns::default();
    for i in 0..n {
        c.worker_id.push((i / 8) as u64);
        c.dp_rank.push((i % 8) as u32);
        c.device.push(rng.below(200) as f64);
        c.host.push(rng.below(40) as f64);
        c.disk.push(0.0);
        c.available.push(true);
        c.active_requests.push(rng.below(24));
        c.active_prefill_tokens.push(rng.below(8192));
        c.decode_blocks.push(rng.below(4096));
    }
    c
}

fn context() -> RawRequestContext<'static> {
    RawRequestContext {
        prompt_tokens: common::PROMPT_TOKENS,
        request_blocks: common::PROMPT_BLOCKS as u64,
        block_size: common::BLOCK_SIZE,
        role: RoleCode::AGGREGATED,
        affinity_target: ROption::RNone,
        pinned_worker: ROption::RNone,
        session_id: ROption::RNone,
        expected_output_tokens: ROption::RNone,
        priority: 0,
        extensions: RSlice::EMPTY,
    }
}

/// One statically linked pick, as a host linking the policy would make it.
#[inline(always)]
fn pick_static(policy: &TwoTierCostFn, ctx: &RawRequestContext<'_>, view: &RawCandidateView<'_>) {
    let rows = Rows::from_raw(black_box(view)).expect("consistent view");
    let ctx = Context::from_raw(black_box(ctx));
    black_box(policy.pick(&ctx, &rows).expect("a row"));
}

/// One pick through the loaded library.
#[inline(always)]
fn pick_so(policy: &PolicyBox, ctx: &RawRequestContext<'_>, view: &RawCandidateView<'_>) {
    match policy.pick(black_box(ctx), black_box(view)) {
        RResult::ROk(row) => {
            black_box(row);
        }
        RResult::RErr(e) => panic!("pick failed: {e:?}"),
    }
}

struct Fixture {
    policy_so: &'static PolicyBox,
    policy_static: TwoTierCostFn,
}

fn fixture() -> Fixture {
    let config = common::two_tier_config("{}", "");
    // Leaked so the borrowed policy object can outlive the closures criterion keeps.
    let router: &'static router_host::policy_set::PolicySet =
        Box::leak(Box::new(common::two_tier_router(&config)));
    let instance =
        router.instance(router.instance_for(router_host::model::RequestRole::Aggregated));
    assert_eq!(instance.type_name, "dynamo-two-tier-cost-fn");
    let policy_static =
        TwoTierCostFn::new(&TwoTierParams::default(), config.host_cache_hit_weight).unwrap();
    Fixture {
        policy_so: instance.policy(),
        policy_static,
    }
}

fn bench(c: &mut Criterion, f: &Fixture) {
    let ctx = context();
    let mut group = c.benchmark_group("two_tier_pick");
    for n in SIZES {
        let cols = columns(n);
        let view = cols.view(Inputs::CACHE | Inputs::LOAD);
        // Both sides decide the same row.
        let expected = {
            let rows = Rows::from_raw(&view).unwrap();
            f.policy_static
                .pick(&Context::from_raw(&ctx), &rows)
                .unwrap()
        };
        assert_eq!(f.policy_so.pick(&ctx, &view), RResult::ROk(expected));
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::new("static", n), &n, |b, _| {
            b.iter(|| pick_static(&f.policy_static, &ctx, &view))
        });
        group.bench_with_input(BenchmarkId::new("so", n), &n, |b, _| {
            b.iter(|| pick_so(f.policy_so, &ctx, &view))
        });
    }
    group.finish();
}

/// Paired timing of both sides per size, printed as the ratio table of docs/performance.md.
fn ratios(f: &Fixture) {
    let ctx = context();
    println!();
    println!("two_tier_pick: .so vs static, paired (1,000 alternating rounds of ~10 us per side)");
    println!(
        "{:>6} {:>10} {:>10} {:>12} {:>8} {:>10} {:>10} {:>8}",
        "rows", "static", ".so", "ABI adds", "ratio", "static", ".so", "ratio"
    );
    println!(
        "{:>6} {:>10} {:>10} {:>12} {:>8} {:>10} {:>10} {:>8}",
        "", "p50 ns", "p50 ns", "p50 ns", "p50", "min ns", "min ns", "min"
    );
    for n in SIZES {
        let cols = columns(n);
        let view = cols.view(Inputs::CACHE | Inputs::LOAD);
        let calls = (10_000 / (n as u32 * 2 + 20)).max(8);
        let p = common::paired(
            || pick_static(&f.policy_static, &ctx, &view),
            || pick_so(f.policy_so, &ctx, &view),
            calls,
            1_000,
        );
        println!(
            "{n:>6} {:>10.1} {:>10.1} {:>12.2} {:>8.3} {:>10.1} {:>10.1} {:>8.3}",
            p.a_ns,
            p.b_ns,
            p.delta_ns,
            p.ratio,
            p.a_min_ns,
            p.b_min_ns,
            p.b_min_ns / p.a_min_ns
        );
    }
}

fn profile(f: &Fixture, name: &str, arg: &str) {
    let n: usize = arg.parse().unwrap_or(256);
    let iters = common::profile_iters(100_000);
    let cols = columns(n);
    let view = cols.view(Inputs::CACHE | Inputs::LOAD);
    let ctx = context();
    match name {
        "static" => common::profile_loop(iters, &mut || pick_static(&f.policy_static, &ctx, &view)),
        "so" => common::profile_loop(iters, &mut || pick_so(f.policy_so, &ctx, &view)),
        other => panic!("ROUTER_BENCH_PROFILE: unknown benchmark `{other}` (static, so)"),
    }
    eprintln!("profiled {name} at {n} rows: {iters} calls");
}

fn main() {
    let f = fixture();
    if let Some((name, arg)) = common::profile_request() {
        profile(&f, &name, &arg);
        return;
    }
    let mut c = common::criterion();
    bench(&mut c, &f);
    c.final_summary();
    if !common::quick_mode() {
        ratios(&f);
    }
}
