//! The tests' engine and router harness: the fake vLLM engine of `router-mock-engine` with
//! scripted answers (deterministic chunks, fault controls, counters of what it saw) tokenizing
//! the fixture `tests/data/tokenizer/` with its own code, so local and remote tokenization can
//! be compared; and a harness that writes a router config for a set of engines and runs
//! `serve` in-process.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

#[allow(unused_imports)]
pub use mock_engine::stream_chunks;

/// The fixture tokenizer directory.
pub fn tokenizer_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer")
}

/// A running engine with scripted answers (`mock_engine::Answers::Scripted`): its state
/// (`state.controls`, `state.seen`, `state.id`), address, `stop` and `restart`.
pub struct Engine(mock_engine::Engine);

impl Deref for Engine {
    type Target = mock_engine::Engine;
    fn deref(&self) -> &mock_engine::Engine {
        &self.0
    }
}

impl DerefMut for Engine {
    fn deref_mut(&mut self) -> &mut mock_engine::Engine {
        &mut self.0
    }
}

impl Engine {
    /// Start an engine as worker `id` on a free port of 127.0.0.1.
    pub async fn start(id: u64) -> Engine {
        let tokenizer =
            mock_engine::Tokenizer::load(&tokenizer_dir()).expect("the fixture tokenizer loads");
        let engine = mock_engine::Engine::start(mock_engine::Options::scripted(id, tokenizer))
            .await
            .expect("the engine starts");
        Engine(engine)
    }

    /// Listen again on the same address, with the same state.
    pub async fn restart(&mut self) {
        self.0
            .restart()
            .await
            .expect("the engine listens again on its address");
    }
}

/// The body of a deliberately broken engine's answer: an `Err` item cuts the connection
/// mid-body, as an engine that dies does.
pub type RawBody = http_body_util::combinators::UnsyncBoxBody<bytes::Bytes, std::io::Error>;
pub type RawResponse = hyper::Response<RawBody>;

/// An answer of `status` with `headers` and the whole `body`.
pub fn raw_full(
    status: u16,
    headers: &[(&'static str, String)],
    body: impl Into<bytes::Bytes>,
) -> RawResponse {
    use http_body_util::BodyExt as _;
    let body = http_body_util::Full::new(body.into())
        .map_err(|never| match never {})
        .boxed_unsync();
    let mut response = hyper::Response::new(body);
    *response.status_mut() =
        hyper::StatusCode::from_u16(status).expect("tests answer valid statuses");
    for (name, value) in headers {
        response.headers_mut().insert(
            *name,
            value.parse().expect("tests answer valid header values"),
        );
    }
    response
}

/// A 200 answer whose body is `stream`'s items, sent as they come.
pub fn raw_stream(
    stream: impl futures_util::Stream<Item = Result<bytes::Bytes, std::io::Error>> + Send + 'static,
) -> RawResponse {
    use futures_util::StreamExt as _;
    use http_body_util::BodyExt as _;
    let frames = stream.map(|item| item.map(hyper::body::Frame::data));
    hyper::Response::new(http_body_util::StreamBody::new(frames).boxed_unsync())
}

/// A server for what no well-behaved engine does: hyper's HTTP/1 server on a free port of
/// 127.0.0.1 answering every request with `answer(method, path, body)` (the body read whole,
/// up to 64 MiB). Runs until the returned task is aborted or the runtime ends.
pub async fn serve_raw<F, Fut>(answer: F) -> (SocketAddr, tokio::task::JoinHandle<()>)
where
    F: Fn(hyper::Method, String, bytes::Bytes) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = RawResponse> + Send + 'static,
{
    use http_body_util::BodyExt as _;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the raw engine");
    let addr = listener.local_addr().expect("local addr");
    let answer = std::sync::Arc::new(answer);
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            let _ = stream.set_nodelay(true);
            let answer = answer.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |request: hyper::Request<_>| {
                    let answer = answer.clone();
                    async move {
                        let method = request.method().clone();
                        let path = request.uri().path().to_owned();
                        let body = http_body_util::Limited::new(request.into_body(), 64 << 20)
                            .collect()
                            .await
                            .map(|c| c.to_bytes())
                            .unwrap_or_default();
                        Ok::<_, std::convert::Infallible>(answer(method, path, body).await)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (addr, task)
}

/// Poll `check` every 10 ms until it holds or `limit` passes; returns whether it held.
pub async fn eventually(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if check() {
            return true;
        }
        if start.elapsed() > limit {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The `workers:` YAML for `engines`, ids as the engines'.
pub fn workers_yaml(engines: &[&Engine]) -> String {
    let mut out = String::from("workers:\n");
    for e in engines {
        out.push_str(&format!("  - id: {}\n    url: {}\n", e.state.id, e.url()));
    }
    out
}

/// A `serve` running in this process, on a free port.
pub struct TestRouter {
    pub addr: SocketAddr,
    pub handle: router_host::serve::ServeHandle,
    pub config: PathBuf,
    task: tokio::task::JoinHandle<Result<(), router_host::serve::ServeError>>,
    _dir: super::TempDir,
}

impl TestRouter {
    /// Write `yaml` to a fresh directory and start `serve` on it.
    pub async fn start(test: &str, yaml: &str) -> TestRouter {
        let dir = super::temp_dir(test);
        let config = super::write(&dir, "router.yaml", yaml);
        let server = router_host::serve::Server::bind(router_host::serve::ServeOptions {
            config: config.clone(),
            plugin_dirs: Vec::new(),
            listen: Some("127.0.0.1:0".parse().unwrap()),
        })
        .await
        .unwrap_or_else(|err| panic!("serve did not start: {err}\n{yaml}"));
        let addr = server.local_addr();
        let handle = server.handle();
        let task = tokio::spawn(server.run());
        TestRouter {
            addr,
            handle,
            config,
            task,
            _dir: dir,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Requests booked and not finished (all configurations) and the current core's bookings.
    pub fn in_flight(&self) -> (usize, usize) {
        (
            self.handle.in_flight(),
            self.handle.loaded().host.core().in_flight(),
        )
    }

    /// The value of one sample of `/metrics` (`name{labels}` as written there), 0 if absent.
    pub fn metric(&self, sample: &str) -> f64 {
        metric_value(&self.handle.metrics_text(), sample)
    }

    /// Shut down and wait for `run` to return.
    pub async fn stop(self) {
        self.handle.shutdown();
        let result = tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("serve stops within 30 s")
            .expect("serve task");
        result.expect("serve ran without error");
    }
}

/// The value of the sample `name{labels}` in Prometheus text, 0 if absent. Labels match as a
/// subset written in order, e.g. `router_requests_total{endpoint="completions",outcome="ok"}`.
pub fn metric_value(text: &str, sample: &str) -> f64 {
    let (name, labels) = match sample.split_once('{') {
        Some((name, labels)) => (name, labels.trim_end_matches('}')),
        None => (sample, ""),
    };
    let wanted: Vec<&str> = labels.split(',').filter(|s| !s.is_empty()).collect();
    let mut total = 0.0;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some((key, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (line_name, line_labels) = match key.split_once('{') {
            Some((n, l)) => (n, l.trim_end_matches('}')),
            None => (key, ""),
        };
        if line_name != name {
            continue;
        }
        let have: Vec<&str> = line_labels.split(',').collect();
        if wanted.iter().all(|w| have.contains(w)) {
            total += value.parse::<f64>().unwrap_or(0.0);
        }
    }
    total
}

/// An HTTP client for the tests (no proxy, short timeouts).
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

/// POST `body` as JSON to `url`.
pub async fn post(client: &reqwest::Client, url: &str, body: &Value) -> reqwest::Response {
    client
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("request reaches the router")
}

/// Response header `name` as text ("" when absent or not text).
pub fn header(response: &reqwest::Response, name: &str) -> String {
    response
        .headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned()
}

/// How many of `ids` (leading) the row `(worker, 0)` holds in the current core's KV index.
pub fn held_ids(router: &TestRouter, worker: u64, ids: &[u64]) -> usize {
    let loaded = router.handle.loaded();
    let core = loaded.host.core();
    let Some(slot) = core.topology().slot(router_host::model::RowId {
        worker_id: worker,
        dp_rank: 0,
    }) else {
        return 0;
    };
    let index = core.kv_index();
    ids.iter().take_while(|&&id| index.holds(slot, id)).count()
}
