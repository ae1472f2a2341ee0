//! What `router-host serve` adds to a request's latency (docs/performance.md,
//! "`serve`: added latency").
//!
//! One process, three tokio runtimes on their own threads: two engines (the mock engine with
//! scripted answers, started by `tests/common/engine.rs` as the `serve_*` tests start it, on
//! 127.0.0.1 port 0), `serve` itself
//! started in-process in front of them (as the tests start it), and the load generator's HTTP
//! client. A pacer thread issues short streamed completions open loop at a fixed rate (Poisson
//! arrivals by default), alternately straight to an engine and through `serve`, in blocks, so
//! both sides see the same machine load. Each request is timed from just before it is sent to
//! the last byte of its body (`data: [DONE]`). Per setup and rate it prints the latency
//! percentiles of both sides, their difference percentile by percentile (the added latency),
//! the router's own `router_overhead_seconds` histogram over the measured requests, the
//! achieved rates, errors, and the process CPU time per request on each side.
//!
//! Setups: the built-in `round-robin` and the shipped two-tier policy (from its `.so`), each with
//! remote tokenization (the engine's `/tokenize`) and local tokenization
//! (`tests/data/tokenizer/`); and `bare-proxy`, the floor: the same HTTP stack (hyper's HTTP/1
//! server with `TCP_NODELAY`, a reqwest client) forwarding each body round-robin and relaying the
//! answer, with no parsing, tokenizing, routing, metrics or logging, which is what any proxy
//! costs on this machine.
//!
//! `cargo bench -p router-host --bench serve`; `-- --test` (or any run not started by
//! `cargo bench`) runs a tiny smoke version. Knobs: `ROUTER_BENCH_SERVE_SECS` (seconds per side
//! per point, default 10), `ROUTER_BENCH_SERVE_RATES` (default `500,2000`),
//! `ROUTER_BENCH_SERVE_SETUPS` (comma-separated names in the order to run, default all; a
//! `/migration-N` suffix sets `serve.migration_limit`; tokenizer `local-bpe` is the trained
//! byte-level BPE `tests/data/bpe-tokenizer`, with the word split and the prefix cache),
//! `ROUTER_BENCH_ARRIVALS` (`poisson` or `fixed`), `ROUTER_BENCH_SERVE_LOG=off` (no `info`
//! subscriber; by default the router's per-request log line is formatted, as `serve` does, into
//! a sink), `ROUTER_BENCH_SERVE_PROMPT_BYTES` (prompts of about that many bytes of the same
//! words instead of 48 words: 16384 for the long-prompt figures).

mod common;
#[path = "../tests/common/engine.rs"]
mod engine;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use engine::{workers_yaml, Engine, TestRouter};

// ---- what engine.rs takes from tests/common ------------------------------------------------

/// A scratch directory removed when dropped (engine.rs's `TestRouter` keeps its config in one).
pub struct TempDir(PathBuf);

impl std::ops::Deref for TempDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn temp_dir(name: &str) -> TempDir {
    let dir = std::env::temp_dir().join(format!("router-host-bench-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create temp dir");
    TempDir(dir)
}

pub fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write bench file");
    path
}

// ---- setups ----------------------------------------------------------------------------------

const SETUPS: &[&str] = &[
    "bare-proxy",
    "round-robin/local",
    "round-robin/remote",
    "two-tier/remote",
    "two-tier/local",
];

/// `policy/tokenizer`, or `policy/tokenizer/migration-N` for a `serve.migration_limit` other
/// than the default (not in `SETUPS`: name it in `ROUTER_BENCH_SERVE_SETUPS` to compare).
fn setup_yaml(name: &str, engines: &[&Engine]) -> String {
    let (policy, rest) = name.split_once('/').expect("policy/tokenizer");
    let (tokenizer, migration) = match rest.split_once('/') {
        Some((tokenizer, limit)) => {
            let limit = limit
                .strip_prefix("migration-")
                .expect("policy/tokenizer/migration-N");
            (tokenizer, format!("  migration_limit: {limit}\n"))
        }
        None => (rest, String::new()),
    };
    let tokenizer = match tokenizer {
        "local" => format!("{{path: {}}}", engine::tokenizer_dir().display()),
        "local-bpe" => format!(
            "{{path: {}}}",
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/data/bpe-tokenizer")
                .display()
        ),
        _ => "remote".to_owned(),
    };
    let policy = match policy {
        "round-robin" => "worker_selection:\n  aggregated: rr\n  instances:\n    - {name: rr, type: round-robin}\n".to_owned(),
        _ => format!(
            "plugins: [{{path: {}}}]\nworker_selection:\n  aggregated: t\n  instances:\n    - {{name: t, type: dynamo-two-tier-cost-fn}}\n",
            common::two_tier_so().display()
        ),
    };
    format!(
        "block_size: 16\nserve:\n  tokenizer: {tokenizer}\n  decision_headers: true\n{migration}{policy}{}",
        workers_yaml(engines)
    )
}

// ---- the floor: a proxy that only proxies -------------------------------------------------------

struct BareProxy {
    addr: std::net::SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

async fn start_bare_proxy(engines: &[&Engine]) -> BareProxy {
    use futures_util::TryStreamExt as _;
    let client = reqwest::Client::builder()
        .no_proxy()
        .tcp_nodelay(true)
        .build()
        .expect("bare proxy client");
    let upstreams: Arc<[String]> = engines
        .iter()
        .map(|e| format!("{}/v1/completions", e.url()))
        .collect();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (addr, task) = engine::serve_raw(move |_method, _path, body| {
        let (client, upstreams, next) = (client.clone(), upstreams.clone(), next.clone());
        async move {
            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % upstreams.len();
            let sent = client
                .post(&upstreams[i])
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(body)
                .send()
                .await;
            match sent {
                Ok(response) => {
                    let status = response.status().as_u16();
                    let mut out =
                        engine::raw_stream(response.bytes_stream().map_err(std::io::Error::other));
                    *out.status_mut() = hyper::StatusCode::from_u16(status)
                        .unwrap_or(hyper::StatusCode::BAD_GATEWAY);
                    out
                }
                Err(err) => engine::raw_full(502, &[], err.to_string()),
            }
        }
    })
    .await;
    BareProxy { addr, task }
}

/// What requests go through: `serve`, or the floor.
enum Front {
    Serve(TestRouter),
    Bare(BareProxy),
}

impl Front {
    fn url(&self, path: &str) -> String {
        match self {
            Front::Serve(router) => router.url(path),
            Front::Bare(bare) => format!("http://{}{path}", bare.addr),
        }
    }

    fn port(&self) -> u16 {
        match self {
            Front::Serve(router) => router.addr.port(),
            Front::Bare(bare) => bare.addr.port(),
        }
    }

    /// The router's `/metrics` (empty for the floor: it has none).
    fn metrics_text(&self) -> String {
        match self {
            Front::Serve(router) => router.handle.metrics_text(),
            Front::Bare(_) => String::new(),
        }
    }
}

// ---- the load generator ----------------------------------------------------------------------

/// Words of the fixture tokenizer's vocabulary (one token each).
const WORDS: &[&str] = &[
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "hello",
    "world",
    "you",
    "are",
    "a",
    "helpful",
    "assistant",
    "what",
    "is",
    "two",
    "plus",
    "tell",
    "me",
    "story",
    "about",
    "cats",
    "and",
    "dogs",
    "please",
    "write",
    "poem",
    "sun",
    "moon",
    "sea",
    "sky",
    "tree",
    "river",
];

/// `ROUTER_BENCH_SERVE_PROMPT_BYTES`, 0 when unset.
fn prompt_bytes() -> usize {
    static BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| env_or("ROUTER_BENCH_SERVE_PROMPT_BYTES", 0))
}

/// A short streamed completion: a 48-word prompt (49 tokens: 3 blocks of 16), or one of about
/// `ROUTER_BENCH_SERVE_PROMPT_BYTES`, 3 content chunks, the usage chunk and `[DONE]` back.
fn body(rng: &mut common::Rng) -> Bytes {
    let target = prompt_bytes();
    let mut prompt = String::new();
    let mut words = 0;
    while if target == 0 {
        words < 48
    } else {
        prompt.len() < target
    } {
        if words > 0 {
            prompt.push(' ');
        }
        prompt.push_str(WORDS[rng.below(WORDS.len() as u64) as usize]);
        words += 1;
    }
    let body = serde_json::json!({
        "model": "tiny", "prompt": prompt, "max_tokens": 3, "stream": true,
        "stream_options": {"include_usage": true},
    });
    Bytes::from(body.to_string())
}

/// One request's outcome: time to the last byte, and when it finished.
type Outcome = Result<(Duration, Instant), String>;

async fn one(client: reqwest::Client, url: Arc<str>, body: Bytes) -> Outcome {
    let started = Instant::now();
    let response = client
        .post(&*url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .map_err(|e| format!("send: {e}"))?;
    let status = response.status();
    let bytes = response.bytes().await.map_err(|e| format!("body: {e}"))?;
    let elapsed = started.elapsed();
    if status != 200 {
        return Err(format!(
            "status {status}: {}",
            String::from_utf8_lossy(&bytes)
        ));
    }
    if !bytes.ends_with(b"data: [DONE]\n\n") {
        return Err("stream did not end with [DONE]".to_owned());
    }
    Ok((elapsed, Instant::now()))
}

#[derive(Clone, Copy, PartialEq)]
enum Arrivals {
    Poisson,
    Fixed,
}

/// What one side measured over all its blocks.
#[derive(Default)]
struct Side {
    latencies_us: Vec<f64>,
    errors: usize,
    first_error: Option<String>,
    /// Sum over blocks of (requests, seconds from the first send to the last finish).
    completed: usize,
    busy_secs: f64,
    /// Pacer: the worst delay of a send behind its schedule.
    max_lag: Duration,
    /// Process CPU seconds over the side's blocks.
    cpu_secs: f64,
}

fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes the struct it is given and reads nothing else.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 * 1e-6;
    t(usage.ru_utime) + t(usage.ru_stime)
}

/// Drive `n` requests at `rate` per second to `urls` (in turn), open loop, from this thread;
/// the requests run on `client_rt`.
#[allow(clippy::too_many_arguments)]
fn drive(
    client_rt: &tokio::runtime::Runtime,
    client: &reqwest::Client,
    urls: &[Arc<str>],
    rate: f64,
    n: usize,
    arrivals: Arrivals,
    rng: &mut common::Rng,
    side: &mut Side,
) {
    let bodies: Vec<Bytes> = (0..n).map(|_| body(rng)).collect();
    let gaps: Vec<f64> = (0..n)
        .map(|_| match arrivals {
            Arrivals::Poisson => rng.exp() / rate,
            Arrivals::Fixed => 1.0 / rate,
        })
        .collect();
    let cpu = cpu_seconds();
    let start = Instant::now();
    let mut at = start;
    let mut handles = Vec::with_capacity(n);
    for (i, (body, gap)) in bodies.into_iter().zip(gaps).enumerate() {
        at += Duration::from_secs_f64(gap);
        let now = Instant::now();
        if at > now {
            std::thread::sleep(at - now);
        } else {
            side.max_lag = side.max_lag.max(now - at);
        }
        let url = urls[i % urls.len()].clone();
        handles.push(client_rt.spawn(one(client.clone(), url, body)));
    }
    let outcomes: Vec<Outcome> = client_rt.block_on(async move {
        let mut out = Vec::with_capacity(handles.len());
        for h in handles {
            out.push(h.await.unwrap_or_else(|e| Err(format!("task: {e}"))));
        }
        out
    });
    side.cpu_secs += cpu_seconds() - cpu;
    let mut last = start;
    for outcome in outcomes {
        match outcome {
            Ok((latency, finished)) => {
                side.latencies_us.push(latency.as_secs_f64() * 1e6);
                side.completed += 1;
                last = last.max(finished);
            }
            Err(e) => {
                side.errors += 1;
                side.first_error.get_or_insert(e);
            }
        }
    }
    side.busy_secs += (last - start).as_secs_f64();
}

// ---- the router's overhead histogram -----------------------------------------------------------

/// Cumulative `(le, count)` of `router_overhead_seconds{stage}` in `/metrics` text.
fn buckets(text: &str, stage: &str) -> Vec<(f64, f64)> {
    let stage = format!("stage=\"{stage}\"");
    let mut out: Vec<(f64, f64)> = text
        .lines()
        .filter(|l| l.starts_with("router_overhead_seconds_bucket{") && l.contains(&stage))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            let count = l.rsplit_once(' ')?.1.parse().ok()?;
            Some((le, count))
        })
        .collect();
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

/// `after - before`, bucket by bucket.
fn bucket_delta(before: &[(f64, f64)], after: &[(f64, f64)]) -> Vec<(f64, f64)> {
    after
        .iter()
        .map(|&(le, n)| {
            let was = before.iter().find(|b| b.0 == le).map_or(0.0, |b| b.1);
            (le, n - was)
        })
        .collect()
}

fn bucket_sum(a: &mut Vec<(f64, f64)>, b: &[(f64, f64)]) {
    if a.is_empty() {
        a.extend_from_slice(b);
        return;
    }
    for (x, y) in a.iter_mut().zip(b) {
        x.1 += y.1;
    }
}

/// Percentile `q` of a cumulative histogram in microseconds, linear within a bucket.
fn bucket_percentile(buckets: &[(f64, f64)], q: f64) -> f64 {
    let total = buckets.last().map_or(0.0, |b| b.1);
    if total == 0.0 {
        return f64::NAN;
    }
    let target = q * total;
    let (mut prev_le, mut prev_n) = (0.0, 0.0);
    for &(le, n) in buckets {
        if n >= target {
            if le.is_infinite() {
                return prev_le * 1e6;
            }
            let part = if n > prev_n {
                (target - prev_n) / (n - prev_n)
            } else {
                1.0
            };
            return (prev_le + (le - prev_le) * part) * 1e6;
        }
        (prev_le, prev_n) = (le, n);
    }
    prev_le * 1e6
}

/// `ROUTER_BENCH_SERVE_NODELAY=1`: set `TCP_NODELAY` on this process's sockets bound to `port`
/// (the router's listener, which Linux accepted sockets inherit it from, and the connections
/// already accepted), emulating a `serve` that sets it on what it accepts. Returns how many.
fn nodelay_on_port(port: u16) -> usize {
    let mut count = 0;
    let Ok(entries) = std::fs::read_dir("/proc/self/fd") else {
        return 0;
    };
    for entry in entries.flatten() {
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        // SAFETY: plain socket calls on an fd of this process; a non-socket fails harmlessly.
        unsafe {
            let mut addr: libc::sockaddr_in = std::mem::zeroed();
            let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            if libc::getsockname(fd, (&raw mut addr).cast(), &mut len) != 0
                || i32::from(addr.sin_family) != libc::AF_INET
                || u16::from_be(addr.sin_port) != port
            {
                continue;
            }
            let one: libc::c_int = 1;
            if libc::setsockopt(
                fd,
                libc::IPPROTO_TCP,
                libc::TCP_NODELAY,
                (&raw const one).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            ) == 0
            {
                count += 1;
            }
        }
    }
    count
}

// ---- the run -----------------------------------------------------------------------------------

const QS: [f64; 4] = [0.50, 0.90, 0.99, 0.999];

fn pcts(values: &mut [f64]) -> [f64; 4] {
    QS.map(|q| common::percentile(values, q))
}

fn fmt4(v: [f64; 4]) -> String {
    v.map(|x| format!("{x:>8.0}")).join(" ")
}

struct Row {
    setup: String,
    rate: f64,
    direct: [f64; 4],
    via: [f64; 4],
    added: [f64; 4],
    overhead: [f64; 4],
    achieved: (f64, f64),
    errors: (usize, usize),
    cpu_us: (f64, f64),
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn runtime(name: &str, threads: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(name)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn main() {
    // `cargo bench` passes `--bench`; anything else (`-- --test`, `cargo test --benches`) is a
    // smoke run.
    let quick = common::quick_mode() || !std::env::args().any(|a| a == "--bench");
    if std::env::var("ROUTER_BENCH_SERVE_LOG").as_deref() != Ok("off") {
        // `serve` logs one `info` line per request; format it as it would, into a sink.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
            .with_writer(std::io::sink)
            .with_ansi(false)
            .try_init();
    }
    let secs: f64 = if quick {
        0.05
    } else {
        env_or("ROUTER_BENCH_SERVE_SECS", 10.0)
    };
    let rates: Vec<f64> = if quick {
        vec![200.0]
    } else {
        std::env::var("ROUTER_BENCH_SERVE_RATES")
            .unwrap_or_else(|_| "500,2000".to_owned())
            .split(',')
            .map(|r| r.trim().parse().expect("ROUTER_BENCH_SERVE_RATES: numbers"))
            .collect()
    };
    // The setups named, in the order given (variants outside `SETUPS` too), or all of `SETUPS`.
    let setups: Vec<String> = match std::env::var("ROUTER_BENCH_SERVE_SETUPS") {
        Ok(wanted) => wanted
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect(),
        Err(_) => SETUPS.iter().map(|s| (*s).to_owned()).collect(),
    };
    let arrivals = match std::env::var("ROUTER_BENCH_ARRIVALS").as_deref() {
        Ok("fixed") => Arrivals::Fixed,
        _ => Arrivals::Poisson,
    };
    let blocks = if quick { 1 } else { 5 };

    // Engines, router and client each on their own runtime threads (all on the same 2 cores).
    let engine_rt = runtime("engine", 1);
    let router_rt = runtime("serve", 2);
    let client_rt = runtime("client", 1);
    let engines = engine_rt.block_on(async { [Engine::start(1).await, Engine::start(2).await] });
    let direct_urls: Vec<Arc<str>> = engines
        .iter()
        .map(|e| Arc::from(format!("{}/v1/completions", e.url())))
        .collect();
    let client = reqwest::Client::builder()
        .no_proxy()
        .tcp_nodelay(true)
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client");
    let mut rng = common::Rng::new(13);
    let mut rows = Vec::new();

    println!(
        "serve bench: {} arrivals, {secs} s per side per point in {blocks} alternating blocks; \
         latency to the last byte in us; p50 p90 p99 p99.9",
        if arrivals == Arrivals::Poisson {
            "Poisson"
        } else {
            "fixed-interval"
        }
    );
    for setup in &setups {
        let router = if setup == "bare-proxy" {
            Front::Bare(router_rt.block_on(start_bare_proxy(&[&engines[0], &engines[1]])))
        } else {
            let yaml = setup_yaml(setup, &[&engines[0], &engines[1]]);
            Front::Serve(router_rt.block_on(TestRouter::start(&setup.replace('/', "-"), &yaml)))
        };
        let via_urls: Vec<Arc<str>> = vec![Arc::from(router.url("/v1/completions"))];
        let nodelay = std::env::var("ROUTER_BENCH_SERVE_NODELAY").as_deref() == Ok("1");
        if nodelay {
            nodelay_on_port(router.port());
        }
        for &rate in &rates {
            // Warm the connection pools and the router's caches.
            let warm = if quick {
                10
            } else {
                (rate as usize / 2).max(100)
            };
            let mut scratch = Side::default();
            drive(
                &client_rt,
                &client,
                &direct_urls,
                rate,
                warm,
                arrivals,
                &mut rng,
                &mut scratch,
            );
            drive(
                &client_rt,
                &client,
                &via_urls,
                rate,
                warm,
                arrivals,
                &mut rng,
                &mut scratch,
            );
            assert_eq!(
                scratch.errors, 0,
                "warm-up errors: {:?}",
                scratch.first_error
            );

            let per_block = ((rate * secs) / blocks as f64).ceil() as usize;
            let (mut direct, mut via) = (Side::default(), Side::default());
            let mut stages: [Vec<(f64, f64)>; 3] = Default::default();
            for block in 0..blocks {
                let mut sides = [
                    (&direct_urls, &mut direct, false),
                    (&via_urls, &mut via, true),
                ];
                if block % 2 == 1 {
                    sides.reverse();
                }
                for (urls, side, through) in sides {
                    if nodelay && through {
                        nodelay_on_port(router.port());
                    }
                    let before = through.then(|| router.metrics_text());
                    drive(
                        &client_rt, &client, urls, rate, per_block, arrivals, &mut rng, side,
                    );
                    if let Some(before) = before {
                        let after = router.metrics_text();
                        for (sum, stage) in stages.iter_mut().zip(["total", "tokenize", "decide"]) {
                            bucket_sum(
                                sum,
                                &bucket_delta(&buckets(&before, stage), &buckets(&after, stage)),
                            );
                        }
                    }
                }
            }
            let d = pcts(&mut direct.latencies_us);
            let v = pcts(&mut via.latencies_us);
            let added = [0, 1, 2, 3].map(|i| v[i] - d[i]);
            let overhead = QS.map(|q| bucket_percentile(&stages[0], q));
            let n = (direct.completed + direct.errors) as f64;
            let row = Row {
                setup: setup.to_string(),
                rate,
                direct: d,
                via: v,
                added,
                overhead,
                achieved: (
                    direct.completed as f64 / direct.busy_secs,
                    via.completed as f64 / via.busy_secs,
                ),
                errors: (direct.errors, via.errors),
                cpu_us: (
                    direct.cpu_secs / n * 1e6,
                    via.cpu_secs / (via.completed + via.errors) as f64 * 1e6,
                ),
            };
            println!(
                "\n{setup} @ {rate} req/s ({} requests per side)",
                per_block * blocks
            );
            println!("  direct        {}   achieved {:.0} req/s, errors {}, cpu {:.0} us/req, pacer lag max {:?}",
                fmt4(row.direct), row.achieved.0, row.errors.0, row.cpu_us.0, direct.max_lag);
            println!("  through serve {}   achieved {:.0} req/s, errors {}, cpu {:.0} us/req, pacer lag max {:?}",
                fmt4(row.via), row.achieved.1, row.errors.1, row.cpu_us.1, via.max_lag);
            println!("  added         {}", fmt4(row.added));
            for (stage, buckets) in ["total", "tokenize", "decide"]
                .iter()
                .zip(&stages)
                .filter(|(_, b)| !b.is_empty())
            {
                println!(
                    "  router_overhead_seconds{{stage={stage:<8}}} {}   ({} samples, bucket-interpolated)",
                    fmt4(QS.map(|q| bucket_percentile(buckets, q))),
                    buckets.last().map_or(0.0, |b| b.1)
                );
            }
            for e in [&direct.first_error, &via.first_error]
                .into_iter()
                .flatten()
            {
                println!("  first error: {e}");
            }
            if quick {
                assert_eq!(row.errors, (0, 0), "smoke run: no errors");
            }
            rows.push(row);
        }
        match router {
            Front::Serve(router) => {
                let (inflight, core) = router.in_flight();
                assert_eq!((inflight, core), (0, 0), "bookings left after {setup}");
                router_rt.block_on(router.stop());
            }
            Front::Bare(bare) => bare.task.abort(),
        }
    }

    println!("\n| setup | rate (req/s) | achieved direct / serve | direct p50 / p99 (us) | serve p50 / p99 (us) | added p50 / p90 / p99 / p99.9 (us) | `router_overhead_seconds{{stage=\"total\"}}` p50 / p99 (us) | CPU per request direct / serve (us) | errors |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {:.0} | {:.0} / {:.0} | {:.0} / {:.0} | {:.0} / {:.0} | {:.0} / {:.0} / {:.0} / {:.0} | {} | {:.0} / {:.0} | {} / {} |",
            r.setup, r.rate, r.achieved.0, r.achieved.1, r.direct[0], r.direct[2], r.via[0],
            r.via[2], r.added[0], r.added[1], r.added[2], r.added[3],
            // The floor has no histogram.
            if r.overhead[0].is_nan() {
                "-".to_owned()
            } else {
                format!("{:.0} / {:.0}", r.overhead[0], r.overhead[2])
            },
            r.cpu_us.0, r.cpu_us.1, r.errors.0, r.errors.1
        );
    }
    drop(engines);
}
