//! Hostile engines against a real `serve` on 127.0.0.1: answers to the router's own calls that
//! never end or are hundreds of megabytes, redirects that would send the prompt elsewhere, a
//! `413` from `/tokenize`, and a stream cut mid-way. `serve` must read every answer with a
//! byte limit, follow no redirect, and end a cut stream with an error event
//! (docs/serve.md, "What is read from engines").

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::child::{self, ServeChild};
use common::engine::{
    client, metric_value, post as post_json, raw_full, raw_stream, serve_raw, RawResponse,
    TestRouter,
};
use futures_util::StreamExt;
use hyper::Method;
use serde_json::json;

/// How a stand-in misbehaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Metrics {
    Plain,
    /// A chunked answer that never ends.
    Endless,
    /// `content-length: 300 MB`, then as many bytes.
    Huge,
}

#[derive(Clone, Debug)]
enum Tokenize {
    Plain,
    /// A 200 MB answer (a valid one, if read whole: `token_strs` is one long string).
    Huge,
    /// `307` to this URL.
    Redirect(String),
    /// `413`, as an engine with a body limit answers.
    TooLarge,
}

#[derive(Clone, Debug)]
struct Behaviour {
    metrics: Metrics,
    tokenize: Tokenize,
    /// Streamed completions break off after two events.
    cut_streams: bool,
    /// `/v1/models` never ends.
    endless_models: bool,
    /// `/tokenize` answers after this long.
    tokenize_delay: Duration,
}

impl Default for Behaviour {
    fn default() -> Self {
        Behaviour {
            metrics: Metrics::Plain,
            tokenize: Tokenize::Plain,
            cut_streams: false,
            endless_models: false,
            tokenize_delay: Duration::ZERO,
        }
    }
}

/// `n` chunks of `chunk`, or endless (`None`).
fn repeated(chunk: &'static [u8], n: Option<usize>) -> RawResponse {
    let stream = futures_util::stream::iter(std::iter::repeat_n((), n.unwrap_or(usize::MAX)))
        .map(move |()| Ok::<_, std::io::Error>(Bytes::from_static(chunk)));
    raw_stream(stream)
}

const MIB: &[u8] = &[b'#'; 1 << 20];

/// A text answer, as a plain web framework sends a `String`.
fn text(status: u16, body: String) -> RawResponse {
    raw_full(
        status,
        &[("content-type", "text/plain; charset=utf-8".to_owned())],
        body,
    )
}

async fn metrics(b: &Behaviour) -> RawResponse {
    match b.metrics {
        Metrics::Plain => text(200, "vllm:num_requests_running{engine=\"0\"} 0.0\n".into()),
        Metrics::Endless => repeated(MIB, None),
        Metrics::Huge => {
            let mut r = repeated(MIB, Some(300));
            r.headers_mut()
                .insert(hyper::header::CONTENT_LENGTH, (300usize << 20).into());
            r
        }
    }
}

async fn tokenize(b: &Behaviour) -> RawResponse {
    tokio::time::sleep(b.tokenize_delay).await;
    match &b.tokenize {
        Tokenize::Plain => text(
            200,
            json!({"tokens": [1, 2, 3], "max_model_len": 4096}).to_string(),
        ),
        Tokenize::Huge => {
            let head = futures_util::stream::once(async {
                Ok::<_, std::io::Error>(Bytes::from_static(
                    b"{\"tokens\": [1, 2, 3], \"token_strs\": \"",
                ))
            });
            let bulk = futures_util::stream::iter(0..200)
                .map(|_| Ok::<_, std::io::Error>(Bytes::from_static(&[b'a'; 1 << 20])));
            let tail = futures_util::stream::once(async {
                Ok::<_, std::io::Error>(Bytes::from_static(b"\"}"))
            });
            raw_stream(head.chain(bulk).chain(tail))
        }
        Tokenize::Redirect(to) => raw_full(307, &[("location", to.clone())], ""),
        Tokenize::TooLarge => text(413, json!({"detail": "length limit exceeded"}).to_string()),
    }
}

fn completions(b: &Behaviour) -> RawResponse {
    let events: Vec<Result<Bytes, std::io::Error>> = vec![
        Ok(Bytes::from_static(
            b"data: {\"choices\":[{\"text\":\" one\"}]}\n\n",
        )),
        Ok(Bytes::from_static(
            b"data: {\"choices\":[{\"text\":\" two\"}]}\n\n",
        )),
    ];
    let end: Result<Bytes, std::io::Error> = if b.cut_streams {
        Err(std::io::Error::other("engine died"))
    } else {
        Ok(Bytes::from_static(b"data: [DONE]\n\n"))
    };
    let stream = futures_util::stream::iter(events).chain(futures_util::stream::once(async move {
        // The first events leave before the cut.
        tokio::time::sleep(Duration::from_millis(100)).await;
        end
    }));
    let mut r = raw_stream(stream);
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        "text/event-stream".parse().expect("header"),
    );
    r
}

fn models(b: &Behaviour) -> RawResponse {
    if b.endless_models {
        repeated(MIB, None)
    } else {
        text(
            200,
            json!({"object": "list", "data": [{"id": "tiny"}]}).to_string(),
        )
    }
}

async fn start(behaviour: Behaviour) -> SocketAddr {
    let b = Arc::new(behaviour);
    let (addr, _task) = serve_raw(move |method, path, _body| {
        let b = b.clone();
        async move {
            match (method, path.as_str()) {
                (Method::GET, "/health") => raw_full(200, &[], ""),
                (Method::GET, "/metrics") => metrics(&b).await,
                (Method::POST, "/tokenize") => tokenize(&b).await,
                (Method::POST, "/v1/completions") => completions(&b),
                (Method::GET, "/v1/models") => models(&b),
                _ => raw_full(404, &[], ""),
            }
        }
    })
    .await;
    addr
}

fn workers(addrs: &[SocketAddr]) -> String {
    let mut out = String::from("block_size: 16\nworkers:\n");
    for (i, addr) in addrs.iter().enumerate() {
        out.push_str(&format!("  - id: {}\n    url: http://{addr}\n", i + 1));
    }
    out
}

/// Peak RSS bound for a `serve` whose engines send endless or huge answers. The debug binary
/// with well-behaved engines peaks at about 40 MiB here; the largest answer it may hold is a
/// 16 MiB `/metrics` scrape, twice while its pieces are joined, for each of two engines
/// probed at once: about 104 MiB in all, and 160 MiB leaves room for the allocator. Without
/// the limits the same engines took it to 1 GB and more (657 MB for the `/tokenize` case).
const PEAK_RSS_BOUND_KB: u64 = 160 * 1024;

/// One engine whose `/metrics` never ends, one that declares and sends 300 MB: every probe
/// drops them at the limit, counts and logs it; memory stays bounded and both engines stay
/// healthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endless_and_huge_metrics_scrapes_are_cut_at_the_limit() {
    let endless = start(Behaviour {
        metrics: Metrics::Endless,
        ..Behaviour::default()
    })
    .await;
    let huge = start(Behaviour {
        metrics: Metrics::Huge,
        ..Behaviour::default()
    })
    .await;
    let yaml = format!(
        "{}serve:\n  health: {{interval_ms: 200, timeout_ms: 5000}}\n",
        workers(&[endless, huge])
    );
    let (serve, metrics, peak) = tokio::task::spawn_blocking(move || {
        let serve = ServeChild::start("hostile_metrics", &yaml, None);
        let metrics = child::poll(Duration::from_secs(30), || {
            let (_, text) = child::get(&serve.url("/metrics"))?;
            let rejected = |w: u64| {
                metric_value(
                    &text,
                    &format!(
                        "router_engine_answers_rejected_total{{worker=\"{w}\",endpoint=\"metrics\",reason=\"too_large\"}}"
                    ),
                )
            };
            (rejected(1) >= 3.0 && rejected(2) >= 3.0).then_some(text)
        });
        let peak = serve.status_kb("VmHWM");
        (serve, metrics, peak)
    })
    .await
    .expect("test thread");
    let metrics = metrics.unwrap_or_else(|| panic!("scrapes never rejected\n{}", serve.log()));
    assert!(
        peak < PEAK_RSS_BOUND_KB,
        "peak RSS {peak} kB over {PEAK_RSS_BOUND_KB} kB"
    );
    for w in [1, 2] {
        assert_eq!(
            metric_value(&metrics, &format!("router_engine_healthy{{worker=\"{w}\"")),
            1.0
        );
    }
    let log = serve.log();
    assert!(log.contains("engine answer refused"), "{log}");
    assert!(log.matches("engine answer refused").count() <= 5, "{log}");
}

/// A `/tokenize` answer of 200 MB is dropped at the limit derived from `max_body_bytes`: the
/// request is routed without prompt overlap, and memory stays bounded (it took serve to
/// 657 MB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_200_mb_tokenize_answer_is_cut_at_the_limit() {
    let engine = start(Behaviour {
        tokenize: Tokenize::Huge,
        ..Behaviour::default()
    })
    .await;
    let yaml = format!("{}serve:\n  max_body_bytes: 1048576\n", workers(&[engine]));
    let (serve, answer, metrics, peak) = tokio::task::spawn_blocking(move || {
        let serve = ServeChild::start("hostile_tokenize", &yaml, None);
        let answer = child::post(
            &serve.url("/v1/completions"),
            r#"{"model": "tiny", "prompt": "hello there", "stream": true}"#,
        );
        let metrics = child::get(&serve.url("/metrics")).map(|(_, t)| t);
        let peak = serve.status_kb("VmHWM");
        (serve, answer, metrics, peak)
    })
    .await
    .expect("test thread");
    let (status, body) = answer.unwrap_or_else(|| panic!("no answer\n{}", serve.log()));
    assert_eq!(status, 200, "{body}");
    let metrics = metrics.expect("metrics");
    assert_eq!(
        metric_value(
            &metrics,
            "router_engine_answers_rejected_total{worker=\"1\",endpoint=\"tokenize\",reason=\"too_large\"}"
        ),
        1.0,
        "{metrics}"
    );
    assert_eq!(
        metric_value(&metrics, "router_tokenize_fallbacks_total"),
        1.0
    );
    assert!(
        peak < PEAK_RSS_BOUND_KB,
        "peak RSS {peak} kB over {PEAK_RSS_BOUND_KB} kB"
    );
}

/// A `307` from `/tokenize` to another local listener: the router does not follow it (the
/// prompt never reaches that listener); the request is routed without overlap, and the
/// redirect is counted.
#[tokio::test]
async fn a_redirect_from_an_engine_is_never_followed() {
    let elsewhere = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let elsewhere_addr = elsewhere.local_addr().expect("addr");
    let contacted = Arc::new(AtomicUsize::new(0));
    let counter = contacted.clone();
    tokio::spawn(async move {
        while let Ok((socket, _)) = elsewhere.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            drop(socket);
        }
    });
    let engine = start(Behaviour {
        tokenize: Tokenize::Redirect(format!("http://{elsewhere_addr}/tokenize")),
        ..Behaviour::default()
    })
    .await;
    let router = TestRouter::start("hostile_redirect", &workers(&[engine])).await;
    let http = client();
    let response = post_json(
        &http,
        &router.url("/v1/completions"),
        &json!({"model": "tiny", "prompt": "a secret prompt", "stream": true}),
    )
    .await;
    assert_eq!(response.status(), 200);
    let _ = response.bytes().await;
    assert_eq!(
        contacted.load(Ordering::SeqCst),
        0,
        "the redirect was followed"
    );
    assert_eq!(
        router.metric(
            "router_engine_answers_rejected_total{worker=\"1\",endpoint=\"tokenize\",reason=\"redirect\"}"
        ),
        1.0
    );
    assert_eq!(router.metric("router_tokenize_fallbacks_total"), 1.0);
    router.stop().await;
}

/// An engine that refuses a prompt with `413` on `/tokenize`: the client gets a `413` with an
/// OpenAI-style body, not a `400 tokenization_failed`.
#[tokio::test]
async fn a_413_from_tokenize_is_a_clean_413() {
    let engine = start(Behaviour {
        tokenize: Tokenize::TooLarge,
        ..Behaviour::default()
    })
    .await;
    let router = TestRouter::start("hostile_tokenize_413", &workers(&[engine])).await;
    let http = client();
    let response = post_json(
        &http,
        &router.url("/v1/completions"),
        &json!({"model": "tiny", "prompt": "a long prompt"}),
    )
    .await;
    assert_eq!(response.status(), 413);
    let body: serde_json::Value =
        serde_json::from_slice(&response.bytes().await.expect("body")).expect("json");
    assert_eq!(body["error"]["code"], "prompt_too_large", "{body}");
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("length limit exceeded"),
        "{body}"
    );
    router.stop().await;
}

/// An engine that dies mid-stream: the client gets the events that came, then an OpenAI-style
/// error event and `[DONE]`, and the stream ends cleanly; counted and logged.
#[tokio::test]
async fn a_stream_cut_by_the_engine_ends_with_an_error_event() {
    let engine = start(Behaviour {
        cut_streams: true,
        ..Behaviour::default()
    })
    .await;
    let router = TestRouter::start("hostile_cut_stream", &workers(&[engine])).await;
    let http = client();
    let response = post_json(
        &http,
        &router.url("/v1/completions"),
        &json!({"model": "tiny", "prompt": [1, 2, 3], "stream": true}),
    )
    .await;
    assert_eq!(response.status(), 200);
    let text = String::from_utf8(
        response
            .bytes()
            .await
            .expect("the stream ends cleanly")
            .to_vec(),
    )
    .expect("utf-8");
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 4, "{text}");
    assert!(events[1].contains(" two"), "{text}");
    let error: serde_json::Value =
        serde_json::from_str(events[2].strip_prefix("data: ").expect("data")).expect("json");
    assert_eq!(error["error"]["type"], "upstream_error", "{error}");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("upstream body"),
        "{error}"
    );
    assert_eq!(events[3], "data: [DONE]");
    assert_eq!(
        router.metric("router_stream_error_events_total{reason=\"body\"}"),
        1.0
    );
    assert_eq!(router.in_flight(), (0, 0));
    router.stop().await;
}

/// An engine whose `/v1/models` never ends: the relay stops at the limit and says why.
#[tokio::test]
async fn an_endless_models_answer_is_cut_at_the_limit() {
    let engine = start(Behaviour {
        endless_models: true,
        ..Behaviour::default()
    })
    .await;
    let router = TestRouter::start("hostile_models", &workers(&[engine])).await;
    let response = client()
        .get(router.url("/v1/models"))
        .send()
        .await
        .expect("answered");
    assert_eq!(response.status(), 503);
    let body = response.text().await.expect("body");
    assert!(body.contains("larger than"), "{body}");
    assert_eq!(
        router.metric(
            "router_engine_answers_rejected_total{worker=\"1\",endpoint=\"models\",reason=\"too_large\"}"
        ),
        1.0
    );
    router.stop().await;
}

/// Established TCP connections whose local port is `port` (the engine's side of the router's
/// connections to it), from /proc/net/tcp.
fn established_to(port: u16) -> usize {
    let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    table
        .lines()
        .skip(1)
        .filter(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local_port = fields
                .get(1)
                .and_then(|a| a.rsplit_once(':'))
                .and_then(|(_, p)| u16::from_str_radix(p, 16).ok());
            local_port == Some(port) && fields.get(3) == Some(&"01")
        })
        .count()
}

/// A burst of 100 requests tokenized remotely at once opens up to 100 connections to the
/// engine; afterwards at most the client's idle cap per engine (32) stay open, not all of them.
/// (The engine refuses every prompt with `413`, so that no completion connection is opened.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokenize_burst_leaves_at_most_the_idle_cap_open() {
    let engine = start(Behaviour {
        tokenize: Tokenize::TooLarge,
        tokenize_delay: Duration::from_millis(300),
        ..Behaviour::default()
    })
    .await;
    let router = TestRouter::start("hostile_tokenize_burst", &workers(&[engine])).await;
    let http = client();
    let url = router.url("/v1/completions");
    let burst = (0..100).map(|i| {
        let (http, url) = (http.clone(), url.clone());
        async move {
            let body = json!({"model": "tiny", "prompt": format!("prompt {i}")});
            let response = post_json(&http, &url, &body).await;
            assert_eq!(response.status(), 413);
            let _ = response.bytes().await;
        }
    });
    futures_util::future::join_all(burst).await;
    // The connections beyond the cap are closed as their calls end; give the pool a moment.
    let settled = common::engine::eventually(Duration::from_secs(10), || {
        established_to(engine.port()) <= 32 + 2
    })
    .await;
    assert!(
        settled,
        "{} connections to the engine stay open",
        established_to(engine.port())
    );
    router.stop().await;
}

/// An engine that sends no response head in time, with no retry left: the client's `504` is
/// counted once in `router_requests_total` (the release of its booking and the refusal were
/// both counted).
#[tokio::test]
async fn a_failed_request_is_counted_once() {
    let engine = common::engine::Engine::start(1).await;
    engine
        .state
        .controls
        .head_delay_ms
        .store(3_000, Ordering::SeqCst);
    let yaml = format!(
        "block_size: 16\n{}serve:\n  retries: 0\n  timeouts: {{response_ms: 200}}\n",
        common::engine::workers_yaml(&[&engine])
    );
    let router = TestRouter::start("hostile_counted_once", &yaml).await;
    let response = post_json(
        &client(),
        &router.url("/v1/completions"),
        &json!({"model": "tiny", "prompt": [1, 2, 3]}),
    )
    .await;
    assert_eq!(response.status(), 504);
    assert_eq!(
        router.metric("router_requests_total{endpoint=\"completions\",outcome=\"failed\"}"),
        1.0
    );
    assert_eq!(router.in_flight(), (0, 0));
    router.stop().await;
}
