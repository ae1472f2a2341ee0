//! A second front end, written here in a few dozen lines against `router-runtime` alone (no
//! code of the HTTP front end, `router-http`): newline-delimited JSON over TCP, one completion
//! body per line, answered with one line `STATUS BODY`. It drives the same pipeline as `serve`
//! (tokens, block ids, limits, admission, the policy, booking, legs with retries, release),
//! which the tests check through the runtime's own metrics and bookings.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::engine::{metric_value, workers_yaml, Engine};
use futures_util::StreamExt;
use plugin_api::abi::CompletionCode;
use router_runtime::background::Background;
use router_runtime::pipeline::{self, Answer, Inbound};
use router_runtime::prompt::Endpoint;
use router_runtime::{request, App, ServeOptions};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

// ---- the front end ----------------------------------------------------------------------

/// Serve the line protocol on `listener` until the task is dropped.
async fn line_front_end(app: Arc<App>, listener: TcpListener) {
    while let Ok((socket, _)) = listener.accept().await {
        let app = app.clone();
        tokio::spawn(async move {
            let (read, mut write) = socket.into_split();
            let mut lines = BufReader::new(read).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let reply = answer(&app, line).await;
                if write.write_all(reply.as_bytes()).await.is_err() {
                    return;
                }
            }
        });
    }
}

/// One request: parsed as the OpenAI body it is, run through the pipeline, and the engine's
/// whole body read (its end releases the booking).
async fn answer(app: &Arc<App>, line: String) -> String {
    let loaded = app.current.load();
    let endpoint = Endpoint::Completions;
    let parsed = match request::parse(endpoint, line.as_bytes()) {
        Ok(parsed) => parsed,
        Err(err) => return format!("{} {}\n", err.status.as_u16(), err.body()),
    };
    let inbound = Inbound {
        endpoint,
        parsed,
        body: line.into(),
        session: None,
        headers: Default::default(),
        received: Instant::now(),
    };
    let Answer {
        response,
        mut flight,
    } = match pipeline::run(app, &loaded, &inbound).await {
        Ok(answer) => answer,
        Err(err) => return format!("{} {}\n", err.status.as_u16(), err.body()),
    };
    let mut body = Vec::new();
    let mut stream = response.body;
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(chunk) => {
                flight.first_byte();
                body.extend_from_slice(&chunk);
            }
            Err(err) => {
                flight.finish(CompletionCode::FAILED, "failed");
                return format!("502 {err}\n");
            }
        }
    }
    flight.finish(CompletionCode::COMPLETED, "completed");
    let text = String::from_utf8_lossy(&body).replace('\n', " ");
    format!("{} {text}\n", response.status.as_u16())
}

// ---- the tests --------------------------------------------------------------------------

/// The runtime started on `yaml` (no HTTP server), its background work, and the line front
/// end on a free port.
async fn start(test: &str, yaml: &str) -> (Arc<App>, Background, SocketAddr, common::TempDir) {
    let dir = common::temp_dir(test);
    let config = common::write(&dir, "router.yaml", yaml);
    let app = App::start(ServeOptions {
        config,
        plugin_dirs: Vec::new(),
        listen: None,
    })
    .await
    .unwrap_or_else(|err| panic!("the runtime did not start: {err}\n{yaml}"));
    app.probe_engines().await;
    let background = router_runtime::background::start(&app);
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(line_front_end(app.clone(), listener));
    (app, background, addr, dir)
}

/// Send `lines` on one connection and read as many answer lines.
async fn exchange(addr: SocketAddr, lines: &[String]) -> Vec<String> {
    let socket = TcpStream::connect(addr).await.expect("connect");
    let (read, mut write) = socket.into_split();
    for line in lines {
        write
            .write_all(format!("{line}\n").as_bytes())
            .await
            .expect("send");
    }
    let mut reader = BufReader::new(read).lines();
    let mut answers = Vec::new();
    for _ in lines {
        let line = tokio::time::timeout(Duration::from_secs(30), reader.next_line())
            .await
            .expect("an answer within 30 s")
            .expect("read")
            .expect("a line");
        answers.push(line);
    }
    answers
}

fn metric(app: &App, sample: &str) -> f64 {
    metric_value(&app.metrics.encode(), sample)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_line_protocol_front_end_routes_retries_and_releases_through_the_pipeline() {
    let broken = Engine::start(1).await;
    let healthy = Engine::start(2).await;
    broken
        .state
        .controls
        .fail_status
        .store(503, Ordering::SeqCst);
    // Round-robin: whichever row a request's first leg takes, the broken engine gets some.
    let yaml = format!(
        "block_size: 4\nserve:\n  retries: 1\nworker_selection:\n  aggregated: rr\n  \
         instances:\n    - name: rr\n      type: round-robin\n{}",
        workers_yaml(&[&broken, &healthy])
    );
    let (app, background, addr, _dir) = start("second_front_end", &yaml).await;

    let ok = serde_json::json!({"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 4});
    let bad = serde_json::json!({"model": "tiny"});
    let (ok, bad) = (ok.to_string(), bad.to_string());
    let answers = exchange(addr, &[ok.clone(), bad, ok.clone(), ok]).await;

    // Every completion was answered by the healthy engine: a 503 from the broken one was
    // retried on the other row by the pipeline.
    for answer in [&answers[0], &answers[2], &answers[3]] {
        assert!(answer.starts_with("200 "), "{answer}");
        assert!(
            answer.contains("\"object\":\"text_completion\""),
            "{answer}"
        );
    }
    assert_eq!(healthy.state.seen.completions.load(Ordering::SeqCst), 3);
    // The OpenAI body check is the runtime's: the same 400 and code as `serve` answers.
    assert!(answers[1].starts_with("400 "), "{}", answers[1]);
    assert!(
        answers[1].contains("\"param\":\"prompt\""),
        "{}",
        answers[1]
    );

    let tried = broken.state.seen.completions.load(Ordering::SeqCst);
    assert!(tried >= 1, "round-robin never chose the broken engine");
    assert_eq!(metric(&app, "router_retries_total"), tried as f64);
    assert_eq!(
        metric(
            &app,
            "router_requests_total{endpoint=\"completions\",outcome=\"completed\"}"
        ),
        3.0
    );
    // Every booking was released: none in flight, in the front ends' count or the core's.
    assert_eq!(app.flights.load(Ordering::SeqCst), 0);
    assert_eq!(app.current.load().host.core().in_flight(), 0);
    background.stop();
}
