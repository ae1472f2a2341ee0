//! Hostile clients against a real `serve` on 127.0.0.1: connections that never finish their
//! request head, bodies that never arrive, and more half-sent requests than the process has
//! descriptors. `serve` must keep answering, count and log what it shed, and never blame the
//! engines for descriptors it ran out of itself (docs/serve.md, "Client connections").

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::child::{self, ServeChild};
use common::engine::{metric_value, workers_yaml, Engine, TestRouter};

/// A connection that sent the start of a request head and nothing more.
fn half_sent(addr: std::net::SocketAddr) -> Option<TcpStream> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    let _ = stream.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-");
    Some(stream)
}

/// The metrics of a child serve, once it answers (it may be shedding for a while).
fn child_metrics(serve: &ServeChild, limit: Duration) -> String {
    child::poll(limit, || {
        child::get(&serve.url("/metrics"))
            .and_then(|(status, body)| (status == 200).then_some(body))
    })
    .unwrap_or_else(|| panic!("serve never answered /metrics\n{}", serve.log()))
}

/// Many more half-sent requests than the open-files limit allows, against the binary run with
/// a limit of 256 descriptors: connections over `serve.max_connections` (64, derived from the
/// limit) are shed at accept, the ones held are closed at `header_read_ms`, the engines stay
/// healthy, and a real request is answered while the attackers' sockets are still open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_sent_requests_past_the_descriptor_limit_are_shed_and_serve_keeps_answering() {
    let e1 = Engine::start(1).await;
    let e2 = Engine::start(2).await;
    let yaml = format!(
        "block_size: 16\n{}serve:\n  timeouts: {{header_read_ms: 1000}}\n  health: {{interval_ms: 200}}\n",
        workers_yaml(&[&e1, &e2])
    );
    let serve = tokio::task::spawn_blocking(move || {
        let serve = ServeChild::start("hostile_half_sent", &yaml, Some(256));
        let mut held = Vec::new();
        for _ in 0..300 {
            if let Some(stream) = half_sent(serve.addr) {
                held.push(stream);
            }
        }
        // A real request gets through while the 300 sockets are still open: once the held
        // ones time out, their places are free again.
        let body = r#"{"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 2}"#;
        let answered = child::poll(Duration::from_secs(15), || {
            child::post(&serve.url("/v1/completions"), body).filter(|(status, _)| *status == 200)
        });
        let metrics = child_metrics(&serve, Duration::from_secs(15));
        drop(held);
        (serve, answered, metrics)
    })
    .await
    .expect("test thread");
    let (serve, answered, metrics) = serve;
    assert!(answered.is_some(), "no request answered\n{}", serve.log());
    let shed = metric_value(
        &metrics,
        "router_client_connections_shed_total{reason=\"over_limit\"}",
    );
    assert!(shed >= 100.0, "shed {shed}\n{metrics}");
    let timeouts = metric_value(&metrics, "router_client_timeouts_total{reason=\"header\"}");
    assert!(timeouts >= 1.0, "header timeouts {timeouts}");
    for worker in [1, 2] {
        assert_eq!(
            metric_value(
                &metrics,
                &format!("router_engine_healthy{{worker=\"{worker}\"")
            ),
            1.0,
            "worker {worker} is healthy\n{}",
            serve.log()
        );
    }
    let log = serve.log();
    assert!(log.contains("open-files limit (RLIMIT_NOFILE)"), "{log}");
    assert!(log.contains("max_connections=64"), "{log}");
    assert!(log.contains("client connection shed at accept"), "{log}");
    // Rate-limited: far fewer lines than connections shed.
    let lines = log.matches("client connection shed at accept").count();
    assert!(lines <= 5, "{lines} shed lines");
    assert!(
        e1.state
            .seen
            .health
            .load(std::sync::atomic::Ordering::SeqCst)
            > 0
    );
}

/// With the cap set above what the descriptors allow, the process itself runs out: `accept`
/// sheds with `fd_limit`, and a request whose engine connection cannot get a descriptor gets
/// `503 local_resources_exhausted`; the engine is not marked unhealthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_out_of_descriptors_is_never_blamed_on_the_engine() {
    const LIMIT: usize = 200;
    let e1 = Engine::start(1).await;
    let yaml = format!(
        "block_size: 16\n{}serve:\n  max_connections: 100000\n  retries: 0\n  timeouts: {{header_read_ms: 20000}}\n  health: {{interval_ms: 60000, scrape_load: false}}\n",
        workers_yaml(&[&e1])
    );
    let engine = e1.state.clone();
    let outcome = tokio::task::spawn_blocking(move || {
        let serve = ServeChild::start("hostile_fd_limit", &yaml, Some(LIMIT as u64));
        // The probe rounds at start (bind, then run) are over: no probe opens a descriptor
        // while the table is being filled (the next is a minute away).
        child::poll(Duration::from_secs(10), || {
            (engine.seen.health.load(std::sync::atomic::Ordering::SeqCst) >= 2).then_some(())
        })
        .expect("the first probes");
        // Fill the descriptor table up to one free slot, one connection at a time (descriptors
        // inherited above the limit, such as cargo's jobserver pipe, take no slot).
        let mut held = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(15);
        while serve.open_fds_below(LIMIT) < LIMIT - 1 && Instant::now() < deadline {
            let before = serve.open_fds_below(LIMIT);
            if let Some(stream) = half_sent(serve.addr) {
                held.push(stream);
            }
            let accepted = Instant::now() + Duration::from_secs(1);
            while serve.open_fds_below(LIMIT) <= before && Instant::now() < accepted {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        assert_eq!(serve.open_fds_below(LIMIT), LIMIT - 1, "{}", serve.log());
        // Accepted with the last descriptor; the engine connection finds none.
        let body = r#"{"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 2}"#;
        let mut real = TcpStream::connect(serve.addr).expect("connect");
        real.set_read_timeout(Some(Duration::from_secs(15)))
            .expect("timeout");
        child::poll(Duration::from_secs(5), || {
            (serve.open_fds_below(LIMIT) == LIMIT).then_some(())
        })
        .unwrap_or_else(|| panic!("the last connection was not accepted\n{}", serve.log()));
        let request = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        real.write_all(request.as_bytes()).expect("send");
        let mut answer = String::new();
        let _ = real.read_to_string(&mut answer);
        // Nothing waited to be accepted yet, however often `accept` found the table full: no
        // shed counted, and the spare descriptor still held (the answered connection's slot is
        // the one free; the metrics request takes it).
        child::poll(Duration::from_secs(5), || {
            (serve.open_fds_below(LIMIT) == LIMIT - 1).then_some(())
        })
        .unwrap_or_else(|| panic!("the answered connection was not closed\n{}", serve.log()));
        let before_shedding = child_metrics(&serve, Duration::from_secs(5));
        // More connections: `accept` itself runs out.
        for _ in 0..20 {
            if let Some(stream) = half_sent(serve.addr) {
                held.push(stream);
            }
        }
        std::thread::sleep(Duration::from_millis(300));
        drop(held);
        let metrics = child_metrics(&serve, Duration::from_secs(40));
        (serve, answer, before_shedding, metrics)
    })
    .await
    .expect("test thread");
    let (serve, answer, before_shedding, metrics) = outcome;
    assert!(
        answer.starts_with("HTTP/1.1 503"),
        "{answer}\n{}",
        serve.log()
    );
    assert_eq!(
        metric_value(
            &before_shedding,
            "router_client_connections_shed_total{reason=\"fd_limit\"}"
        ),
        0.0,
        "a full table with no connection waiting is not a shed\n{before_shedding}"
    );
    assert!(answer.contains("local_resources_exhausted"), "{answer}");
    assert_eq!(
        metric_value(&metrics, "router_engine_healthy{worker=\"1\""),
        1.0,
        "the engine was blamed\n{}",
        serve.log()
    );
    assert!(
        metric_value(
            &metrics,
            "router_local_resource_errors_total{op=\"upstream_connect\"}"
        ) >= 1.0,
        "{metrics}"
    );
    assert_eq!(
        metric_value(&metrics, "router_upstream_errors_total{worker=\"1\""),
        0.0,
        "{metrics}"
    );
    assert_eq!(
        metric_value(
            &metrics,
            "router_requests_total{endpoint=\"completions\",outcome=\"unavailable\"}"
        ),
        1.0,
        "counted once\n{metrics}"
    );
    assert!(
        metric_value(
            &metrics,
            "router_client_connections_shed_total{reason=\"fd_limit\"}"
        ) >= 1.0,
        "{metrics}"
    );
    assert!(serve
        .log()
        .contains("the router ran out of file descriptors"));
}

/// A client that sends its request head one byte at a time, slower than `header_read_ms`
/// allows in total, is disconnected, counted and logged.
#[tokio::test]
async fn a_slowloris_head_is_cut_at_header_read_ms() {
    let e1 = Engine::start(1).await;
    let yaml = format!(
        "block_size: 16\n{}serve:\n  timeouts: {{header_read_ms: 500}}\n",
        workers_yaml(&[&e1])
    );
    let router = TestRouter::start("hostile_slowloris", &yaml).await;
    let addr = router.addr;
    let started = Instant::now();
    let closed = tokio::task::spawn_blocking(move || {
        let mut stream = TcpStream::connect(addr).expect("connect");
        let mut reader = stream.try_clone().expect("clone");
        // The server closing the connection ends this read (0 bytes, or a reset).
        let eof = std::thread::spawn(move || {
            let mut buf = [0u8; 1024];
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 {
                    break;
                }
            }
        });
        // One byte every 50 ms, never the end of the head: at most 20 s.
        for _ in 0..400 {
            if eof.is_finished() || stream.write_all(b"a").is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = stream.write_all(b"GET /health HTTP/1.1\r\nx-slow: ");
        eof.is_finished()
    })
    .await
    .expect("client thread");
    assert!(closed, "the connection was never closed");
    assert!(started.elapsed() < Duration::from_secs(20));
    assert!(router.metric("router_client_timeouts_total{reason=\"header\"}") >= 1.0);
    router.stop().await;
}

/// A body that stops arriving gets `408 body_read_timeout` at `body_read_ms`, and the request
/// reaches no engine.
#[tokio::test]
async fn a_body_that_never_arrives_gets_408_at_body_read_ms() {
    let e1 = Engine::start(1).await;
    let yaml = format!(
        "block_size: 16\n{}serve:\n  timeouts: {{body_read_ms: 500}}\n",
        workers_yaml(&[&e1])
    );
    let router = TestRouter::start("hostile_slow_body", &yaml).await;
    let addr = router.addr;
    let answer = tokio::task::spawn_blocking(move || {
        let mut stream = TcpStream::connect(addr).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(15)))
            .expect("timeout");
        stream
            .write_all(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
                  content-length: 1000\r\n\r\n{\"model\": \"tiny\", ",
            )
            .expect("write");
        let mut answer = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = stream.read(&mut buf) {
            if n == 0 {
                break;
            }
            answer.extend_from_slice(&buf[..n]);
            if answer.windows(4).any(|w| w == b"}}\r\n") || answer.ends_with(b"}}") {
                break;
            }
        }
        String::from_utf8_lossy(&answer).into_owned()
    })
    .await
    .expect("client thread");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("body_read_timeout"), "{answer}");
    assert_eq!(
        router.metric("router_client_timeouts_total{reason=\"body\"}"),
        1.0
    );
    assert_eq!(
        e1.state
            .seen
            .completions
            .load(std::sync::atomic::Ordering::SeqCst),
        0
    );
    router.stop().await;
}
