//! The host's whole decision for one request.
//!
//! 16 workers x 8 ranks (128 rows) with the two-tier policy loaded from its `.so`. Each
//! iteration is `Host::route` (eligibility, overlap lookup in the replay's KV index for a
//! 4,096-token prompt = 256 blocks of 16 tokens, column materialisation, the pick through the
//! plugin ABI, booking) followed by `Host::complete` (release), so the load stays steady.
//!
//! Cache contents: every rank caches 125 prompts of 256 blocks (1,000 prompts' worth per worker,
//! the fixture of `benches/kv_index.rs`; every rank holds all 8 tenants' 32-block system
//! prompts). The decisions rotate through 256 benchmark prompts; for each, a quarter of the rows
//! hold a varied leading run of it (system prompt plus 0 to 159 blocks) and two rows hold all of
//! it, so the cache tier fires. Load: 0 to 12 requests booked per row (pinned, never completed).
//!
//! Variants: `same_prompt` (one prompt, index entries warm in the CPU caches), `no_overlap`
//! (no lookup at all), `overlap_lookup` (only the lookup), `soft_session` (soft session affinity
//! with a session id: the sticky config's extra session-table work and allocation).
//!
//! After criterion's report, 20,000 decisions are timed one by one and p50 / p90 / p99 printed.
//! `ROUTER_BENCH_PROFILE=route` (or `route_same_prompt`, `route_no_overlap`,
//! `route_soft_session`, `overlap`) runs a plain loop for callgrind.

mod common;

use std::cell::RefCell;
use std::hint::black_box;
use std::time::Instant;

use criterion::Criterion;

use router_host::config::RouterConfig;
use router_host::host::{Host, NoOverlap, OverlapSource};
use router_host::kv_index::RowMap;
use router_host::model::{Request, RowId};

use common::{CacheFixture, OverlapScratch, RequestOverlap, PROMPTS, PROMPT_TOKENS};

struct Setup {
    host: Host,
    fixture: CacheFixture,
    prompts: Vec<Vec<u64>>,
    /// Per prompt, the two rows holding all of it.
    full_rows: Vec<[usize; 2]>,
    next: usize,
    rows: RowMap,
    scratch: RefCell<OverlapScratch>,
    request: Request,
}

impl Setup {
    fn new(config: &RouterConfig, request: Request) -> Setup {
        let router = common::two_tier_router(config);
        let host = Host::new(router, common::cluster(), config);
        let rows = common::ROWS;
        let mut fixture = common::decision_fixture();
        let (prompts, full_rows) = common::bench_prompts(|r, run| {
            for &block in run {
                fixture.index.apply(&common::stored(r as u32, block));
            }
        })
        .into_iter()
        .map(|p| (p.blocks, p.full_rows))
        .unzip();
        common::background_load(&host);
        Setup {
            host,
            fixture,
            prompts,
            full_rows,
            next: 0,
            rows,
            scratch: RefCell::new(OverlapScratch::default()),
            request,
        }
    }

    /// The next prompt of the rotation (`rotate`), or always the first.
    #[inline(always)]
    fn prompt(&mut self, rotate: bool) -> usize {
        let p = self.next;
        if rotate {
            self.next = (self.next + 1) % self.prompts.len();
        }
        p
    }

    /// One full decision: route with the KV index's overlap, then complete.
    #[inline(always)]
    fn route(&mut self, rotate: bool) -> RowId {
        let p = self.prompt(rotate);
        let overlap = RequestOverlap::new(
            &self.fixture.index,
            &self.prompts[p],
            self.rows,
            &self.scratch,
        );
        let routed = self
            .host
            .route(black_box(&self.request), &overlap, false)
            .expect("routed");
        self.host.complete(routed.id);
        routed.decision.row
    }

    /// The same without any overlap lookup (every row cold).
    #[inline(always)]
    fn route_no_overlap(&mut self) -> RowId {
        let routed = self
            .host
            .route(black_box(&self.request), &NoOverlap, false)
            .expect("routed");
        self.host.complete(routed.id);
        routed.decision.row
    }

    /// Only the overlap lookup, for all rows.
    #[inline(always)]
    fn overlap(&mut self, rotate: bool) {
        let p = self.prompt(rotate);
        let overlap = RequestOverlap::new(
            &self.fixture.index,
            &self.prompts[p],
            self.rows,
            &self.scratch,
        );
        // The first row asked for computes every row's overlap in one walk.
        black_box(OverlapSource::overlap(&overlap, self.rows.row(0)));
    }
}

fn plain_request() -> Request {
    Request {
        isl_tokens: PROMPT_TOKENS,
        ..Request::default()
    }
}

fn session_setup() -> Setup {
    let config = common::two_tier_config(
        "{respect_soft_affinity: true, soft_affinity_load_gate: true}",
        "session_affinity: {mode: soft, ttl_secs: 600}\n",
    );
    let request = Request {
        session_id: Some("conversation-0042".to_string()),
        ..plain_request()
    };
    Setup::new(&config, request)
}

fn bench(c: &mut Criterion, s: &mut Setup, session: &mut Setup) {
    // The decisions are real: the cache tier sends each prompt to a row holding all of it.
    for _ in 0..PROMPTS {
        let p = s.next;
        let row = s.route(true);
        assert!(
            s.full_rows[p].contains(&s.rows.index(row).unwrap()),
            "prompt {p}: unexpected row {row:?}"
        );
    }
    let mut group = c.benchmark_group("decision");
    group.bench_function("route+complete", |b| b.iter(|| black_box(s.route(true))));
    group.bench_function("route+complete_same_prompt", |b| {
        b.iter(|| black_box(s.route(false)))
    });
    group.bench_function("route+complete_no_overlap", |b| {
        b.iter(|| black_box(s.route_no_overlap()))
    });
    group.bench_function("overlap_lookup", |b| b.iter(|| s.overlap(true)));
    group.bench_function("route+complete_soft_session", |b| {
        b.iter(|| black_box(session.route(true)))
    });
    group.finish();
}

/// Time decisions one by one: the p50 the issue asks for, and the tail.
fn distribution(name: &str, mut decide: impl FnMut()) {
    const N: usize = 20_000;
    for _ in 0..2_000 {
        decide();
    }
    let mut ns = Vec::with_capacity(N);
    for _ in 0..N {
        let started = Instant::now();
        decide();
        ns.push(started.elapsed().as_nanos() as f64);
    }
    let mut p = |q| common::percentile(&mut ns, q);
    println!(
        "{name:<34} p50 {:>7.0} ns   p90 {:>7.0} ns   p99 {:>7.0} ns   ({N} decisions timed one by one)",
        p(0.5),
        p(0.9),
        p(0.99)
    );
}

fn main() {
    let mut s = Setup::new(&common::two_tier_config("{}", ""), plain_request());
    let mut session = session_setup();
    println!(
        "KV index: {} distinct blocks, {} (row, block) pairs over {} rows",
        s.fixture.index.len(),
        s.fixture.holdings(),
        s.rows.rows()
    );
    if let Some((name, _)) = common::profile_request() {
        let iters = common::profile_iters(20_000);
        match name.as_str() {
            "route" => common::profile_loop(iters, &mut || {
                black_box(s.route(true));
            }),
            "route_same_prompt" => common::profile_loop(iters, &mut || {
                black_box(s.route(false));
            }),
            "route_no_overlap" => common::profile_loop(iters, &mut || {
                black_box(s.route_no_overlap());
            }),
            "route_soft_session" => common::profile_loop(iters, &mut || {
                black_box(session.route(true));
            }),
            "overlap" => common::profile_loop(iters, &mut || s.overlap(true)),
            other => panic!(
                "ROUTER_BENCH_PROFILE: unknown benchmark `{other}` (route, route_same_prompt, \
                 route_no_overlap, route_soft_session, overlap)"
            ),
        }
        eprintln!("profiled {name}: {iters} iterations");
        return;
    }
    let mut c = common::criterion();
    bench(&mut c, &mut s, &mut session);
    c.final_summary();
    if !common::quick_mode() {
        println!();
        distribution("decision/route+complete", || {
            black_box(s.route(true));
        });
        distribution("decision/route+complete_same_prompt", || {
            black_box(s.route(false));
        });
        distribution("decision/route+complete_no_overlap", || {
            black_box(s.route_no_overlap());
        });
        distribution("decision/route+complete_soft_session", || {
            black_box(session.route(true));
        });
    }
}
