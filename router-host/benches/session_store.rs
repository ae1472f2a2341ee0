//! What the shared session store adds per request (docs/performance.md, "Shared session
//! store"): one request's session calls, `lookup` + `dispatched` + `completed`, on the
//! in-memory `SessionTable` and on the `RedisStore` against a real `redis-server` this bench
//! starts on a free 127.0.0.1 port.
//!
//! Each iteration is one turn of one of 1,000 sessions (so lookups find bindings, as in a
//! multi-turn workload), timed alone; the bench prints p50 / p90 / p99 / max of both and their
//! difference percentile by percentile. `completed` is timed too, though with Redis it only
//! queues the lease release for the background thread.
//!
//! `cargo bench -p router-host --bench session_store`; `-- --test` (or any run not started by
//! `cargo bench`) runs a short smoke version. `ROUTER_BENCH_STORE_ITERS` sets the measured
//! iterations (default 20,000). Without `redis-server` installed it prints why and exits.

#[path = "../tests/support_redis/mod.rs"]
mod support_redis;

use std::sync::Arc;
use std::time::{Duration, Instant};

use router_host::config::{OnStoreUnavailable, RedisStoreConfig};
use router_host::model::RowId;
use router_host::session_store::RedisStore;
use router_host::sessions::{
    BindingGranularity, BindingMode, SessionStore, SessionTable, SystemClock,
};

const SESSIONS: usize = 1_000;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// Time `iters` turns on `store`, after `warm` untimed ones. `stay`: each session always goes
/// to the same worker (its binding's: the common case); else the worker rotates, so most turns
/// move the binding.
fn run(
    store: &dyn SessionStore,
    ids: &[String],
    warm: usize,
    iters: usize,
    stay: bool,
) -> Vec<Duration> {
    let mut samples = Vec::with_capacity(iters);
    for i in 0..warm + iters {
        let session = i % ids.len();
        let id = &ids[session];
        let worker = if stay {
            session % 4
        } else {
            (i / ids.len() + session) % 4
        };
        let row = RowId {
            worker_id: worker as u64,
            dp_rank: 0,
        };
        let started = Instant::now();
        let lease = store.lookup(id).expect("lookup");
        let ok = store.dispatched(&lease, row).is_ok();
        if ok {
            store.completed(id);
        }
        let took = started.elapsed();
        if i >= warm {
            samples.push(took);
        }
    }
    samples.sort();
    samples
}

fn us(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e6)
}

fn main() {
    let smoke =
        !std::env::args().any(|a| a == "--bench") || std::env::args().any(|a| a == "--test");
    let iters = if smoke {
        500
    } else {
        std::env::var("ROUTER_BENCH_STORE_ITERS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(20_000)
    };
    let Some(binary) = support_redis::available("bench session_store") else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("router-host-bench-store-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let server = support_redis::RedisServer::start(&binary, &dir, None);

    let ids: Vec<String> = (0..SESSIONS)
        .map(|i| format!("bench-session-{i}"))
        .collect();
    let memory = SessionTable::new(
        BindingMode::Soft,
        Duration::from_secs(600),
        65_536,
        Arc::new(SystemClock),
    );
    let redis = RedisStore::start(
        &RedisStoreConfig {
            url: server.url(),
            key_prefix: "bench:".to_owned(),
            timeout: Duration::from_millis(50),
            on_unavailable: OnStoreUnavailable::Route,
            lease: Duration::from_secs(30),
            replica_id: None,
            share_load: false,
            load_publish: router_host::config::DEFAULT_LOAD_PUBLISH,
        },
        BindingMode::Soft,
        BindingGranularity::Worker,
        Duration::from_secs(600),
    )
    .expect("store");
    // Every session bound before timing starts (turns of known sessions).
    let warm = SESSIONS;
    println!("session store, one turn (lookup + dispatched + completed), {iters} turns over {SESSIONS} sessions, 1 thread");
    println!("| turns | store | p50 us | p90 us | p99 us | max us |");
    println!("|---|---|---|---|---|---|");
    for (label, stay) in [("stay on binding", true), ("move binding", false)] {
        let mem = run(&memory, &ids, warm, iters, stay);
        let red = run(&redis, &ids, warm, iters, stay);
        for (name, s) in [("memory", &mem), ("redis (loopback)", &red)] {
            println!(
                "| {label} | {name} | {} | {} | {} | {} |",
                us(percentile(s, 0.5)),
                us(percentile(s, 0.9)),
                us(percentile(s, 0.99)),
                us(percentile(s, 1.0))
            );
        }
        let added = |p: f64| percentile(&red, p).saturating_sub(percentile(&mem, p));
        println!(
            "| {label} | **added by redis** | {} | {} | {} | |",
            us(added(0.5)),
            us(added(0.9)),
            us(added(0.99))
        );
    }
    let degraded = redis.store_stats().degraded;
    println!(
        "store outages during the run: {degraded} degraded turns (must be 0 for valid figures)"
    );
    drop(redis);
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}
