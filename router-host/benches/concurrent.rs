//! Decisions per second from one and from two threads sharing one routing core.
//!
//! The setting of `benches/decision.rs` (16 workers x 8 ranks, the two-tier policy from its
//! `.so`, a 4,096-token prompt of 256 blocks, every rank caching 125 prompts, background load of
//! 0 to 12 requests per row), but the cache lives in the core's own KV index and each decision
//! is `RoutingCore::route_indexed` (overlap from the request's blocks) then `complete`, so the
//! measured path is the one a live server runs. Threads share the core through `&self`.
//!
//! Prints, per thread count, the median of several rounds of decisions per second, the
//! two-thread speed-up, and the single-thread route+complete p50 / p90 / p99 of 20,000
//! decisions timed one by one. `cargo bench --bench concurrent`; `-- --test` runs a tiny round.

mod common;

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use router_host::host::Host;
use router_host::kv_index::{KvEventKind, Tier};
use router_host::model::{Request, RowId};

use common::{row, PROMPTS, PROMPT_TOKENS};

fn setup() -> (Host, Vec<Request>) {
    let config = common::two_tier_config("{}", "");
    let host = Host::new(common::two_tier_router(&config), common::cluster(), &config);
    let core = host.core();
    let fixture = common::decision_fixture();
    for (r, held) in fixture.held.iter().enumerate() {
        for &p in held {
            let blocks = fixture.prompts[p]
                .iter()
                .map(|&b| (KvEventKind::Stored, Tier::Device, b));
            assert!(core.apply_kv_events(row(r), blocks));
        }
    }
    let requests = common::bench_prompts(|r, run| {
        let stored = run.iter().map(|&b| (KvEventKind::Stored, Tier::Device, b));
        core.apply_kv_events(row(r), stored);
    })
    .into_iter()
    .map(|p| Request {
        isl_tokens: PROMPT_TOKENS,
        blocks: p.blocks,
        ..Request::default()
    })
    .collect();
    common::background_load(&host);
    (host, requests)
}

/// One decision: route with the core's index, then complete.
#[inline(always)]
fn decide(host: &Host, request: &Request) -> RowId {
    let core = host.core();
    let routed = core
        .route_indexed(black_box(request), false)
        .expect("routed");
    core.complete(routed.id);
    routed.decision.row
}

/// Decisions per second with `threads` threads for `length`; thread `t` uses `hosts[t % len]`.
fn throughput(
    hosts: &[Arc<Host>],
    requests: &Arc<Vec<Request>>,
    threads: usize,
    length: Duration,
) -> f64 {
    let start = Arc::new(Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let host = hosts[t % hosts.len()].clone();
            let (requests, start) = (requests.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                let began = Instant::now();
                let mut done = 0u64;
                let mut p = t * 97;
                while began.elapsed() < length {
                    for _ in 0..64 {
                        black_box(decide(&host, &requests[p % PROMPTS]));
                        p += 1;
                    }
                    done += 64;
                }
                done as f64 / began.elapsed().as_secs_f64()
            })
        })
        .collect();
    start.wait();
    handles
        .into_iter()
        .map(|h| h.join().expect("bench thread"))
        .sum()
}

fn main() {
    let quick = common::quick_mode();
    let (host, requests) = setup();
    let (host, requests) = (Arc::new(host), Arc::new(requests));
    // The machine's own ceiling: the same work on two cores that share nothing (a second,
    // identical host per thread). The shared core's speed-up is read against it.
    let (twin, _) = setup();
    let apart = [host.clone(), Arc::new(twin)];
    let shared = [host.clone()];
    // Warm every thread's scratch and the index's pages.
    let warm = Duration::from_millis(if quick { 10 } else { 500 });
    throughput(&shared, &requests, 2, warm);
    throughput(&apart, &requests, 2, warm);
    let (rounds, length) = if quick {
        (1, Duration::from_millis(20))
    } else {
        (7, Duration::from_secs(2))
    };
    let (mut one, mut two, mut ceiling) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        one.push(throughput(&shared, &requests, 1, length));
        two.push(throughput(&shared, &requests, 2, length));
        ceiling.push(throughput(&apart, &requests, 2, length));
    }
    let one = common::median(&mut one);
    let two = common::median(&mut two);
    let ceiling = common::median(&mut ceiling);
    println!("decisions/s, 1 thread                 : {one:>10.0}");
    println!(
        "decisions/s, 2 threads, one core      : {two:>10.0}  speed-up {:.2}",
        two / one
    );
    println!(
        "decisions/s, 2 threads, separate cores: {ceiling:>10.0}  speed-up {:.2} (machine ceiling)",
        ceiling / one
    );

    let samples = if quick { 200 } else { 20_000 };
    let mut times = Vec::with_capacity(samples);
    for i in 0..samples {
        let started = Instant::now();
        black_box(decide(&host, &requests[i % PROMPTS]));
        times.push(started.elapsed().as_nanos() as f64);
    }
    println!(
        "route_indexed+complete, 1 thread: p50 {:.0} ns, p90 {:.0} ns, p99 {:.0} ns",
        common::percentile(&mut times, 0.50),
        common::percentile(&mut times, 0.90),
        common::percentile(&mut times, 0.99)
    );
    assert_eq!(host.core().in_flight(), host.in_flight());
}
