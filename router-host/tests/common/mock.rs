//! The real `router-host mock-engine` binary as a child process on 127.0.0.1, for tests that
//! put `serve` in front of it: start (on free ports, read back from its JSON line on stdout),
//! restart on the same ports, read its `/metrics`, and bring a router's subscriber in step with
//! it.

#![allow(dead_code)]

use std::io::BufRead as _;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::engine::{client, metric_value, post, TestRouter};

/// Longest wait for anything in these tests.
pub const WAIT: Duration = Duration::from_secs(20);

/// Flags for answers in (simulated) zero time.
pub const FAST: &[&str] = &[
    "--step-overhead-ms",
    "0",
    "--decode-ms-per-seq",
    "0",
    "--prefill-ms-per-token",
    "0",
];

pub struct Mock {
    child: Option<Child>,
    args: Vec<String>,
    /// `127.0.0.1:PORT`.
    pub http: String,
    pub kv_events: Vec<String>,
    pub replay: Vec<String>,
}

fn port_of(endpoint: &str) -> u16 {
    endpoint
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .expect("endpoint with a port")
}

impl Mock {
    /// Start `router-host mock-engine --listen 127.0.0.1:0 --model tiny ARGS`.
    pub fn start(args: &[&str]) -> Mock {
        let mut all: Vec<String> = vec![
            "mock-engine".into(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--model".into(),
            "tiny".into(),
        ];
        all.extend(args.iter().map(|a| (*a).to_owned()));
        Mock::spawn(all)
    }

    fn spawn(args: Vec<String>) -> Mock {
        let mut child = Command::new(super::router_host_bin())
            .args(&args)
            .env_remove("RUST_LOG")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start router-host mock-engine");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = std::io::BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = match rx.recv_timeout(WAIT) {
            Ok(line) if !line.is_empty() => line,
            other => {
                let _ = child.kill();
                let status = child.wait();
                panic!("mock-engine {args:?} did not start: {other:?}, {status:?}");
            }
        };
        let info: Value = serde_json::from_str(&line).expect("the start line is JSON");
        let list = |key: &str| -> Vec<String> {
            info[key]
                .as_array()
                .map(|l| {
                    l.iter()
                        .filter_map(|v| v.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default()
        };
        Mock {
            http: info["http"].as_str().expect("http address").to_owned(),
            kv_events: list("kv_events"),
            replay: list("replay"),
            child: Some(child),
            args,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.http)
    }

    /// Kill the process (as a crash would) and wait for it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kill it and start it again on the same ports, with the same flags: an engine restart.
    pub fn restart(&mut self) {
        self.kill();
        let mut args = self.args.clone();
        let set = |args: &mut Vec<String>, flag: &str, value: String| {
            if let Some(i) = args.iter().position(|a| a == flag) {
                args[i + 1] = value;
            }
        };
        set(&mut args, "--listen", self.http.clone());
        if let Some(kv) = self.kv_events.first() {
            set(
                &mut args,
                "--kv-events",
                format!("tcp://127.0.0.1:{}", port_of(kv)),
            );
        }
        if let Some(replay) = self.replay.first() {
            set(
                &mut args,
                "--replay-endpoint",
                format!("tcp://127.0.0.1:{}", port_of(replay)),
            );
        }
        // The ports were just freed; give the kernel a few tries.
        let deadline = Instant::now() + WAIT;
        loop {
            let attempt = std::panic::catch_unwind(|| Mock::spawn(args.clone()));
            match attempt {
                Ok(mock) => {
                    *self = mock;
                    return;
                }
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(err) => std::panic::resume_unwind(err),
            }
        }
    }

    /// Its `/metrics` text.
    pub async fn metrics(&self) -> String {
        client()
            .get(self.url("/metrics"))
            .send()
            .await
            .expect("mock /metrics")
            .text()
            .await
            .expect("mock /metrics text")
    }

    /// One sample of its `/metrics` (labels as a subset, as [`metric_value`]).
    pub async fn metric(&self, sample: &str) -> f64 {
        metric_value(&self.metrics().await, sample)
    }

    /// Blocks of rank `rank` published as stored and not removed.
    pub async fn published(&self, rank: u32) -> f64 {
        self.metric(&format!("mock:kv_published_blocks{{engine=\"{rank}\"}}"))
            .await
    }

    /// Bring `router`'s subscriber of `(worker, rank)` in step with this engine: send requests
    /// straight to the engine until the router has received one of their batches (a SUB misses
    /// what is published before its subscription arrives), then reset the engine's prefix cache.
    /// From then on both start empty and the router sees every batch.
    pub async fn sync(&self, router: &TestRouter, worker: u64, rank: u32) {
        let http = client();
        let sample =
            format!("router_kv_event_batches_total{{worker=\"{worker}\",dp_rank=\"{rank}\"}}");
        let before = router.metric(&sample);
        let deadline = Instant::now() + WAIT;
        let mut n = 0u32;
        while router.metric(&sample) <= before {
            assert!(
                Instant::now() < deadline,
                "the router never received a batch from worker {worker} rank {rank}"
            );
            n += 1;
            let prompt: Vec<u32> = (0..4).map(|i| 60_000 + n * 4 + i).collect();
            let response = http
                .post(self.url("/v1/completions"))
                .header("x-data-parallel-rank", rank.to_string())
                .header("content-type", "application/json")
                .body(json!({"model": "tiny", "prompt": prompt, "max_tokens": 1}).to_string())
                .send()
                .await
                .expect("the mock answers");
            assert_eq!(response.status(), 200);
            let _ = response.bytes().await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let clears = format!(
            "router_kv_row_clears_total{{worker=\"{worker}\",dp_rank=\"{rank}\",kind=\"all_blocks_cleared\"}}"
        );
        let cleared = router.metric(&clears);
        let deadline = Instant::now() + WAIT;
        loop {
            let reset = post(&http, &self.url("/reset_prefix_cache"), &json!({})).await;
            if reset.status() == 200 {
                break;
            }
            assert!(Instant::now() < deadline, "the mock never became idle");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let deadline = Instant::now() + WAIT;
        while router.metric(&clears) <= cleared {
            assert!(
                Instant::now() < deadline,
                "the router never saw AllBlocksCleared from worker {worker} rank {rank}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for Mock {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Poll an async check every 20 ms until it holds or [`WAIT`] passes; returns whether it held.
pub async fn eventually_async<F, Fut>(mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + WAIT;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
