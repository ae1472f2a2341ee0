//! KV-event ingestion with a whole fleet publishing at once (docs/performance.md, "Fleet size").
//!
//! `serve` runs in this process on its own tokio runtime (2 worker threads, as `router-host
//! serve` has on this 2-core machine), configured with `ROUTER_BENCH_INGEST_ENGINES` workers
//! (default 1,024), each with `kv_events`. Every engine is a real ZMQ PUB socket on 127.0.0.1
//! (the `zeromq` crate, on a second runtime with 1 thread), so what is measured is the path a live
//! router runs: one subscriber task and TCP connection per row, ZMTP framing, the msgpack decode,
//! the block hashing, the write to the core's KV index and the metrics. (Feeding the decoder
//! directly would leave out the connections, the tasks' scheduling and the lock between
//! subscribers, which is what a thousand publishers add.)
//!
//! After every subscriber is connected and has received a batch, all engines publish at once:
//! `ROUTER_BENCH_INGEST_BATCHES` batches (default 32) of one `BlockStored` of 16 new blocks each,
//! stamped with the publish time as vLLM stamps them. Printed: how long until the index has
//! applied every event (polled), events per second over that time, and the lag the router
//! itself measured per row (`router_kv_event_lag_seconds`: publish stamp to applied, of each
//! row's last batch): p50 and max over rows. Then a paced phase: every engine publishes one
//! batch every `ROUTER_BENCH_INGEST_PERIOD_MS` (default 100) for 5 s, and the lag gauges are
//! sampled every 250 ms (p50, p99 and max over all samples). Also the process's threads and
//! open descriptors with the subscribers running.
//!
//! ```text
//! cargo bench -p router-host --bench kv_ingest
//! ROUTER_BENCH_INGEST_ENGINES=256 cargo bench -p router-host --bench kv_ingest
//! cargo bench -p router-host --bench kv_ingest -- --test     # smoke run: 16 engines
//! ```

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use rmpv::Value;
use zeromq::{Socket, SocketSend, ZmqMessage};

const BLOCK: u64 = 16;
const BLOCKS_PER_BATCH: u64 = 16;
/// Longest wait for any setup step (connections, first batches, a burst applied).
const WAIT: Duration = Duration::from_secs(120);

fn env_usize(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{name}: `{v}` is not a count")),
        Err(_) => default,
    }
}

fn now_secs() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64()
}

fn s(v: &str) -> Value {
    Value::from(v)
}

/// One engine's publisher and what it stored so far.
struct Publisher {
    socket: zeromq::PubSocket,
    port: u16,
    engine: u64,
    seq: u64,
    batches: u64,
    parent: Option<u64>,
}

impl Publisher {
    async fn bind(engine: u64) -> Publisher {
        let mut socket = zeromq::PubSocket::new();
        let endpoint = socket
            .bind("tcp://127.0.0.1:0")
            .await
            .expect("bind a publisher");
        let port = match endpoint {
            zeromq::Endpoint::Tcp(_, port) => port,
            other => panic!("not a TCP endpoint: {other:?}"),
        };
        Publisher {
            socket,
            port,
            engine,
            seq: 0,
            batches: 0,
            parent: None,
        }
    }

    async fn publish(&mut self, events: Vec<Value>) {
        let mut payload = Vec::new();
        rmpv::encode::write_value(
            &mut payload,
            &Value::Array(vec![
                Value::F64(now_secs()),
                Value::Array(events),
                Value::from(0),
            ]),
        )
        .expect("encode");
        let frames = vec![
            Bytes::from_static(b"kv"),
            Bytes::from(self.seq.to_be_bytes().to_vec()),
            Bytes::from(payload),
        ];
        self.seq += 1;
        let message = ZmqMessage::try_from(frames).expect("frames");
        self.socket.send(message).await.expect("publish");
    }

    /// One batch: a `BlockStored` of 16 blocks new to the index, chained after the last.
    async fn store_next(&mut self) {
        let b = self.batches;
        self.batches += 1;
        let hashes: Vec<u64> = (0..BLOCKS_PER_BATCH)
            .map(|i| (self.engine << 32) | (b * BLOCKS_PER_BATCH + i + 1))
            .collect();
        let tokens: Vec<Value> = (0..BLOCKS_PER_BATCH * BLOCK)
            .map(|i| Value::from(((self.engine as u32) << 20) ^ ((b as u32) << 8) ^ i as u32))
            .collect();
        let event = Value::Map(vec![
            (s("type"), s("BlockStored")),
            (
                s("block_hashes"),
                Value::Array(hashes.iter().map(|&h| Value::from(h)).collect()),
            ),
            (
                s("parent_block_hash"),
                self.parent.map_or(Value::Nil, Value::from),
            ),
            (s("token_ids"), Value::Array(tokens)),
            (s("block_size"), Value::from(BLOCK)),
            (s("lora_id"), Value::Nil),
            (s("medium"), s("GPU")),
        ]);
        self.parent = hashes.last().copied();
        self.publish(vec![event]).await;
    }
}

/// The sum of every sample of `name` and how many samples are above zero.
fn samples(text: &str, name: &str) -> Vec<f64> {
    let prefix = format!("{name}{{");
    text.lines()
        .filter(|l| l.starts_with(&prefix))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .collect()
}

/// Poll `check` every 10 ms until it holds; panics (saying `what`) after [`WAIT`].
fn wait_for(what: &str, mut check: impl FnMut() -> bool) -> Duration {
    let started = Instant::now();
    while !check() {
        assert!(started.elapsed() < WAIT, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
    started.elapsed()
}

/// Threads and open descriptors of this process.
fn threads_and_fds() -> (usize, usize) {
    let threads = std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count());
    let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count());
    (threads, fds)
}

fn main() {
    let quick = common::quick_mode();
    let engines = env_usize("ROUTER_BENCH_INGEST_ENGINES", if quick { 16 } else { 1024 });
    let batches = env_usize("ROUTER_BENCH_INGEST_BATCHES", if quick { 4 } else { 32 });
    let period = Duration::from_millis(env_usize("ROUTER_BENCH_INGEST_PERIOD_MS", 100) as u64);
    let paced_for = if quick {
        Duration::from_millis(500)
    } else {
        Duration::from_secs(5)
    };

    let publishers_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("publishers' runtime");
    let serve_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("serve's runtime");
    let (threads_before, fds_before) = threads_and_fds();

    let publishers: Vec<Publisher> = publishers_rt.block_on(async {
        let mut out = Vec::with_capacity(engines);
        for e in 0..engines {
            out.push(Publisher::bind(e as u64).await);
        }
        out
    });
    // Engines at an address nobody listens on: health probes fail fast and rarely (the
    // interval is long), and no request is sent.
    let mut yaml = format!(
        "block_size: {BLOCK}\nserve:\n  health: {{interval_ms: 600000, timeout_ms: 100, scrape_load: false}}\n  tokenizer: remote\nworkers:\n"
    );
    for p in &publishers {
        yaml.push_str(&format!(
            "  - {{id: {}, url: \"http://127.0.0.1:9\", kv_events: {{endpoint: \"tcp://127.0.0.1:{}\", topic: kv}}}}\n",
            p.engine, p.port
        ));
    }
    let dir = std::env::temp_dir().join(format!("router-bench-kv-ingest-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let config = dir.join("router.yaml");
    std::fs::write(&config, yaml).expect("write the config");
    let server = serve_rt
        .block_on(router_host::serve::Server::bind(
            router_host::serve::ServeOptions {
                config,
                plugin_dirs: Vec::new(),
                listen: Some("127.0.0.1:0".parse().expect("address")),
            },
        ))
        .unwrap_or_else(|err| panic!("serve did not start: {err}"));
    let handle = server.handle();
    let serving = serve_rt.spawn(server.run());

    let connected = wait_for("every subscriber to connect", || {
        samples(&handle.metrics_text(), "router_kv_subscriber_connected")
            .iter()
            .filter(|&&v| v > 0.0)
            .count()
            == engines
    });
    // A SUB misses what is published before its subscription arrives: empty batches until
    // every row has received one.
    let mut publishers = publishers;
    let primed = {
        let started = Instant::now();
        loop {
            let received = samples(&handle.metrics_text(), "router_kv_event_batches_total")
                .iter()
                .filter(|&&v| v > 0.0)
                .count();
            if received == engines {
                break;
            }
            assert!(started.elapsed() < WAIT, "not every row received a batch");
            publishers_rt.block_on(async {
                for p in publishers.iter_mut() {
                    p.publish(vec![]).await;
                }
            });
            std::thread::sleep(Duration::from_millis(50));
        }
        started.elapsed()
    };
    let (threads, fds) = threads_and_fds();
    println!(
        "{engines} engines: every subscriber connected in {:.2} s, primed in {:.2} s; this process: \
         {threads} threads ({threads_before} before serve; serve's runtime has 2 workers), \
         {fds} open descriptors ({fds_before} before; each engine here has its PUB listener and \
         its accepted end of the subscriber's connection in this process too)",
        connected.as_secs_f64(),
        primed.as_secs_f64()
    );

    let events = || handle.loaded().host.core().kv_index().events();
    // Every engine publishes on its own task; `rounds` batches each, one per `period` (or as
    // fast as its socket takes them). Returns the engines and when the last batch was sent.
    let publish_all = |publishers: Vec<Publisher>, rounds: usize, period: Option<Duration>| {
        publishers_rt.block_on(async move {
            let tasks: Vec<_> = publishers
                .into_iter()
                .map(|mut p| {
                    tokio::spawn(async move {
                        let mut tick = period.map(tokio::time::interval);
                        for _ in 0..rounds {
                            if let Some(tick) = tick.as_mut() {
                                tick.tick().await;
                            }
                            p.store_next().await;
                        }
                        (p, Instant::now())
                    })
                })
                .collect();
            let mut out = Vec::with_capacity(tasks.len());
            let mut last = None::<Instant>;
            for task in tasks {
                let (p, sent) = task.await.expect("publisher task");
                last = Some(last.map_or(sent, |l| l.max(sent)));
                out.push(p);
            }
            (out, last)
        })
    };

    let before = events();
    let expected = (engines * batches) as u64 * BLOCKS_PER_BATCH;
    let started = Instant::now();
    // The burst runs on the publishers' runtime while this thread polls the index.
    let (tx, rx) = std::sync::mpsc::channel();
    let applied = std::thread::scope(|scope| {
        scope.spawn(|| {
            let _ = tx.send(publish_all(publishers, batches, None));
        });
        wait_for("the burst to be applied", || events() >= before + expected)
    });
    let (returned, sent) = rx.recv().expect("publishers back");
    let mut publishers = returned;
    let sent = sent.unwrap_or(started);
    let lags = {
        let mut lags = samples(&handle.metrics_text(), "router_kv_event_lag_seconds");
        lags.sort_by(f64::total_cmp);
        lags
    };
    let p = |q: f64, v: &[f64]| {
        if v.is_empty() {
            return f64::NAN;
        }
        v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1]
    };
    println!(
        "burst: {engines} engines x {batches} batches x {BLOCKS_PER_BATCH} blocks = {expected} \
         events applied in {:.3} s: {:.0} events/s ({:.0} batches/s); published in {:.3} s; \
         last event applied {:.1} ms after the last publish; lag of each row's last batch \
         (router_kv_event_lag_seconds) p50 {:.1} ms, max {:.1} ms",
        applied.as_secs_f64(),
        expected as f64 / applied.as_secs_f64(),
        (engines * batches) as f64 / applied.as_secs_f64(),
        (sent - started).as_secs_f64(),
        (started + applied)
            .saturating_duration_since(sent)
            .as_secs_f64()
            * 1e3,
        p(0.5, &lags) * 1e3,
        lags.last().copied().unwrap_or(f64::NAN) * 1e3,
    );

    // Paced: every engine one batch per period, for a few seconds; the lag gauges sampled.
    let before = events();
    let rounds = (paced_for.as_millis() / period.as_millis().max(1)).max(1) as usize;
    let (tx, rx) = std::sync::mpsc::channel();
    let mut lags = Vec::new();
    std::thread::scope(|scope| {
        let moved = std::mem::take(&mut publishers);
        let done = scope.spawn(move || {
            let _ = tx.send(publish_all(moved, rounds, Some(period)));
        });
        while !done.is_finished() {
            std::thread::sleep(Duration::from_millis(250));
            lags.extend(samples(
                &handle.metrics_text(),
                "router_kv_event_lag_seconds",
            ));
        }
    });
    let (returned, _) = rx.recv().expect("publishers back");
    let expected = (engines * rounds) as u64 * BLOCKS_PER_BATCH;
    wait_for("the paced batches to be applied", || {
        events() >= before + expected
    });
    lags.sort_by(f64::total_cmp);
    println!(
        "paced: {engines} engines x 1 batch every {} ms ({:.0} events/s offered) for {:.1} s: lag \
         gauges sampled every 250 ms: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({} samples)",
        period.as_millis(),
        engines as f64 * BLOCKS_PER_BATCH as f64 / period.as_secs_f64(),
        paced_for.as_secs_f64(),
        p(0.5, &lags) * 1e3,
        p(0.99, &lags) * 1e3,
        lags.last().copied().unwrap_or(f64::NAN) * 1e3,
        lags.len()
    );
    drop(returned);
    handle.shutdown();
    serve_rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(30), serving).await })
        .expect("serve stops within 30 s")
        .expect("serve task")
        .expect("serve ran without error");
    let _ = std::fs::remove_dir_all(&dir);
}
