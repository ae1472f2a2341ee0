//! `router-host serve` replicas (real processes of the binary) and the rig they share: a real
//! `redis-server`, two stand-in engines and one config (docs/replicas.md). Included by the
//! replica tests as `mod support_replicas;` beside `mod common;` and `mod support_redis;`.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common;
use crate::common::engine::{metric_value, workers_yaml, Engine};
use crate::support_redis::{self, RedisServer};

/// A `serve` process.
pub struct Replica {
    child: Child,
    pub addr: SocketAddr,
    log: Arc<Mutex<String>>,
}

impl Replica {
    /// Start `router-host serve -c CONFIG --listen 127.0.0.1:0` and wait (30 s at most) for
    /// the line that says where it listens.
    pub fn start(config: &Path) -> Replica {
        let mut child = Command::new(common::router_host_bin())
            .args(["serve", "-c"])
            .arg(config)
            .args(["--listen", "127.0.0.1:0"])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn router-host serve");
        let stderr = child.stderr.take().expect("stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let sink = log.clone();
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(addr) = line
                    .split("listening on http://")
                    .nth(1)
                    .and_then(|rest| rest.split_whitespace().next())
                    .and_then(|a| a.parse::<SocketAddr>().ok())
                {
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(addr);
                    }
                }
                if let Ok(mut log) = sink.lock() {
                    log.push_str(&line);
                    log.push('\n');
                }
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(addr) => addr,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "serve did not start within 30 s:\n{}",
                    log.lock().map(|l| l.clone()).unwrap_or_default()
                );
            }
        };
        Replica { child, addr, log }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn log(&self) -> String {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// One sample of its `/metrics` (0 if absent).
    pub async fn metric(&self, http: &reqwest::Client, sample: &str) -> f64 {
        let text = match http.get(self.url("/metrics")).send().await {
            Ok(response) => response.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        metric_value(&text, sample)
    }

    /// Poll `sample` on its `/metrics` every 20 ms until `check` holds or `limit` passes;
    /// returns the last value and whether it held.
    pub async fn wait_metric(
        &self,
        http: &reqwest::Client,
        sample: &str,
        limit: Duration,
        check: impl Fn(f64) -> bool,
    ) -> (f64, bool) {
        let deadline = Instant::now() + limit;
        loop {
            let value = self.metric(http, sample).await;
            if check(value) {
                return (value, true);
            }
            if Instant::now() > deadline {
                return (value, false);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILL: no drain, no lease released, nothing said to the store (its published load
    /// stays until its TTL).
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Redis, two engines, and the config both replicas read.
pub struct Rig {
    pub redis: RedisServer,
    pub engines: Vec<Engine>,
    pub config: PathBuf,
    pub _dir: common::TempDir,
}

pub async fn rig(test: &str, store_extra: &str) -> Option<Rig> {
    let binary = support_redis::available(test)?;
    let dir = common::temp_dir(test);
    let redis = RedisServer::start(&binary, &dir, None);
    let engines = vec![Engine::start(1).await, Engine::start(2).await];
    let yaml = format!(
        "default_selector: {{tie_break: spread}}\n\
         session_affinity:\n  mode: soft\n  ttl_secs: 600\n  store:\n    kind: redis\n    url: {}\n    key_prefix: \"{test}:\"\n    timeout_ms: 500\n{store_extra}\
         serve:\n  health: {{interval_ms: 50, timeout_ms: 500}}\n{}",
        redis.url(),
        workers_yaml(&engines.iter().collect::<Vec<_>>()),
    );
    let config = common::write(&dir, "router.yaml", &yaml);
    Some(Rig {
        redis,
        engines,
        config,
        _dir: dir,
    })
}
