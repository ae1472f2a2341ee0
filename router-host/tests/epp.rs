//! `router-host epp` in-process: an ext_proc client in the test drives the picker over
//! 127.0.0.1 as Envoy does (one gRPC stream per HTTP request, in the body modes Envoy offers),
//! against mock engines as the `workers:`. It checks the destination (header and `envoy.lb`
//! metadata, the same), the body passed on unchanged, the subset hint, sessions, the
//! refusals Envoy answers for the picker, and that every booking is released: at the end of
//! the response, on an engine's 5xx, and when the stream is dropped mid-way.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::engine::{workers_yaml, Engine};
use common::epp::Picker;
use router_epp::proto::ext_proc::external_processor_client::ExternalProcessorClient;
use router_epp::proto::ext_proc::{
    body_mutation, processing_request, processing_response, HttpBody, HttpHeaders,
    ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
};
use router_epp::proto::{
    BodySendMode, EnvoyHeaderMap, EnvoyHeaderValue, Kind, ListValue, Metadata, Struct, Value,
};
use tokio::sync::mpsc;

const WAIT: Duration = Duration::from_secs(30);

async fn start(test: &str, yaml: &str) -> Picker {
    Picker::start(test, yaml).await
}

/// One ext_proc stream, as Envoy's filter holds it.
struct Stream {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: router_epp::proto::Streaming<ProcessingResponse>,
}

async fn open(picker: &Picker) -> Stream {
    let mut client = ExternalProcessorClient::connect(format!("http://{}", picker.grpc))
        .await
        .expect("connect to the picker");
    let (tx, mut requests) = mpsc::channel::<ProcessingRequest>(16);
    let outbound = futures_util::stream::poll_fn(move |cx| requests.poll_recv(cx));
    let rx = client
        .process(outbound)
        .await
        .expect("the picker accepts the stream")
        .into_inner();
    Stream { tx, rx }
}

impl Stream {
    async fn send(&self, message: ProcessingRequest) {
        self.tx.send(message).await.expect("the stream is open");
    }

    async fn answer(&mut self) -> ProcessingResponse {
        tokio::time::timeout(WAIT, self.rx.message())
            .await
            .expect("an answer within 30 s")
            .expect("a good stream")
            .expect("an answer, not the stream's end")
    }
}

fn headers(list: &[(&str, &str)]) -> EnvoyHeaderMap {
    EnvoyHeaderMap {
        headers: list
            .iter()
            .map(|(k, v)| EnvoyHeaderValue {
                key: (*k).to_owned(),
                value: String::new(),
                raw_value: v.as_bytes().to_vec(),
            })
            .collect(),
    }
}

fn request_headers(mode: BodySendMode, path: &str, extra: &[(&str, &str)]) -> ProcessingRequest {
    let mut list = vec![(":method", "POST"), (":path", path), (":authority", "gw")];
    list.extend_from_slice(extra);
    ProcessingRequest {
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(headers(&list)),
            end_of_stream: false,
            ..HttpHeaders::default()
        })),
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: mode as i32,
            response_body_mode: mode as i32,
            send_body_without_waiting_for_header_response: false,
        }),
        ..ProcessingRequest::default()
    }
}

fn body(request: bool, bytes: &[u8], end: bool) -> ProcessingRequest {
    let body = HttpBody {
        body: bytes.to_vec(),
        end_of_stream: end,
        ..HttpBody::default()
    };
    ProcessingRequest {
        request: Some(if request {
            processing_request::Request::RequestBody(body)
        } else {
            processing_request::Request::ResponseBody(body)
        }),
        ..ProcessingRequest::default()
    }
}

fn response_headers(status: &str, end: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::ResponseHeaders(HttpHeaders {
            headers: Some(headers(&[(":status", status)])),
            end_of_stream: end,
            ..HttpHeaders::default()
        })),
        ..ProcessingRequest::default()
    }
}

fn with_subset(mut message: ProcessingRequest, subset: &[String]) -> ProcessingRequest {
    let list = Value {
        kind: Some(Kind::ListValue(ListValue {
            values: subset
                .iter()
                .map(|s| Value {
                    kind: Some(Kind::StringValue(s.clone())),
                })
                .collect(),
        })),
    };
    let mut metadata = Metadata::default();
    metadata.filter_metadata.insert(
        "envoy.lb.subset_hint".to_owned(),
        Struct {
            fields: [("x-gateway-destination-endpoint-subset".to_owned(), list)].into(),
        },
    );
    message.metadata_context = Some(metadata);
    message
}

/// The header mutation's value of `name` in a headers or body answer.
fn set_header(answer: &ProcessingResponse, name: &str) -> Option<String> {
    let common = match answer.response.as_ref()? {
        processing_response::Response::RequestHeaders(h)
        | processing_response::Response::ResponseHeaders(h) => h.response.as_ref()?,
        processing_response::Response::RequestBody(b)
        | processing_response::Response::ResponseBody(b) => b.response.as_ref()?,
        _ => return None,
    };
    let header = common
        .header_mutation
        .as_ref()?
        .set_headers
        .iter()
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key == name)?;
    Some(String::from_utf8_lossy(&header.raw_value).into_owned())
}

fn metadata_destination(answer: &ProcessingResponse) -> Option<String> {
    let lb = answer.dynamic_metadata.as_ref()?.fields.get("envoy.lb")?;
    let Some(Kind::StructValue(inner)) = &lb.kind else {
        return None;
    };
    match &inner.fields.get("x-gateway-destination-endpoint")?.kind {
        Some(Kind::StringValue(text)) => Some(text.clone()),
        _ => None,
    }
}

fn streamed_body(answer: &ProcessingResponse) -> Option<(Vec<u8>, bool)> {
    let Some(processing_response::Response::RequestBody(b)) = &answer.response else {
        return None;
    };
    match b
        .response
        .as_ref()?
        .body_mutation
        .as_ref()?
        .mutation
        .as_ref()?
    {
        body_mutation::Mutation::StreamedResponse(s) => Some((s.body.clone(), s.end_of_stream)),
        _ => None,
    }
}

fn endpoint_of(engine: &Engine) -> String {
    engine
        .url()
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned()
}

fn completion(prompt: &str) -> Vec<u8> {
    serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 4})
        .to_string()
        .into_bytes()
}

/// Pick in `FULL_DUPLEX_STREAMED`, body in two chunks; the destination, checked against the
/// metadata and the body echoed unchanged.
async fn pick_full_duplex(
    picker: &Picker,
    extra: &[(&str, &str)],
    subset: Option<&[String]>,
    payload: &[u8],
) -> (Stream, String) {
    let mut stream = open(picker).await;
    let first = request_headers(BodySendMode::FullDuplexStreamed, "/v1/completions", extra);
    let first = match subset {
        Some(subset) => with_subset(first, subset),
        None => first,
    };
    stream.send(first).await;
    let (a, b) = payload.split_at(payload.len() / 2);
    stream.send(body(true, a, false)).await;
    stream.send(body(true, b, true)).await;
    let headers = stream.answer().await;
    let destination = set_header(&headers, "x-gateway-destination-endpoint")
        .unwrap_or_else(|| panic!("no destination header: {headers:?}"));
    assert_eq!(
        metadata_destination(&headers).as_deref(),
        Some(destination.as_str())
    );
    let mut echoed = Vec::new();
    for (i, chunk) in [a, b].into_iter().enumerate() {
        let answer = stream.answer().await;
        let (bytes, end) = streamed_body(&answer)
            .unwrap_or_else(|| panic!("chunk {i} not streamed back: {answer:?}"));
        assert_eq!(bytes, chunk, "chunk {i} re-emitted unchanged");
        assert_eq!(end, i == 1);
        echoed.extend_from_slice(&bytes);
    }
    assert_eq!(echoed, payload);
    (stream, destination)
}

/// The response phase of a picked stream: headers, two body chunks, end.
async fn respond_ok(stream: &mut Stream) {
    stream.send(response_headers("200", false)).await;
    let answer = stream.answer().await;
    assert_eq!(
        set_header(&answer, "x-router-config").as_deref(),
        Some("1"),
        "{answer:?}"
    );
    stream.send(body(false, b"data: {}\n\n", false)).await;
    stream.answer().await;
    stream.send(body(false, b"data: [DONE]\n\n", true)).await;
    stream.answer().await;
}

fn immediate(answer: &ProcessingResponse) -> (u16, String, Option<String>, serde_json::Value) {
    let Some(processing_response::Response::ImmediateResponse(imm)) = &answer.response else {
        panic!("not an immediate response: {answer:?}");
    };
    let header = |name: &str| {
        imm.headers.as_ref().and_then(|m| {
            m.set_headers
                .iter()
                .filter_map(|o| o.header.as_ref())
                .find(|h| h.key == name)
                .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned())
        })
    };
    let status = imm.status.as_ref().map_or(0, |s| s.code as u16);
    let body = serde_json::from_slice(&imm.body).expect("a JSON body");
    (
        status,
        header("x-router-rejected-reason").unwrap_or_default(),
        header("retry-after"),
        body,
    )
}

fn rr_yaml(engines: &[&Engine], extra: &str) -> String {
    format!(
        "block_size: 4\nworker_selection:\n  aggregated: rr\n  instances:\n    - name: rr\n      \
         type: round-robin\n{extra}{}",
        workers_yaml(engines)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_duplex_picks_an_engine_echoes_the_body_and_releases_at_the_end() {
    let one = Engine::start(1).await;
    let two = Engine::start(2).await;
    let picker = start("epp_full_duplex", &rr_yaml(&[&one, &two], "")).await;
    let endpoints = [endpoint_of(&one), endpoint_of(&two)];
    let mut seen = Vec::new();
    for i in 0..4 {
        let payload = completion(&format!("the quick brown fox {i}"));
        let (mut stream, destination) = pick_full_duplex(&picker, &[], None, &payload).await;
        assert!(
            endpoints.contains(&destination),
            "{destination} is no engine"
        );
        assert_eq!(picker.in_flight(), (1, 1), "booked while the response runs");
        respond_ok(&mut stream).await;
        picker.released().await;
        seen.push(destination);
    }
    // Round-robin: both engines picked.
    assert!(
        seen.contains(&endpoints[0]) && seen.contains(&endpoints[1]),
        "{seen:?}"
    );
    assert_eq!(
        picker.metric("router_requests_total{endpoint=\"completions\",outcome=\"completed\"}"),
        4.0
    );
    // The metrics port.
    let text = reqwest::get(format!("http://{}/metrics", picker.metrics))
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("text");
    assert!(text.contains("router_requests_total"), "{text}");
    let ready = reqwest::get(format!("http://{}/ready", picker.metrics))
        .await
        .expect("GET /ready");
    assert_eq!(ready.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_mode_answers_headers_at_once_and_the_destination_on_the_body() {
    let one = Engine::start(1).await;
    let picker = start("epp_buffered", &rr_yaml(&[&one], "")).await;
    let mut stream = open(&picker).await;
    stream
        .send(request_headers(
            BodySendMode::Buffered,
            "/v1/chat/completions",
            &[],
        ))
        .await;
    let headers = stream.answer().await;
    assert!(
        matches!(
            headers.response,
            Some(processing_response::Response::RequestHeaders(_))
        ),
        "{headers:?}"
    );
    let payload =
        serde_json::json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
            .to_string();
    stream.send(body(true, payload.as_bytes(), true)).await;
    let answer = stream.answer().await;
    assert!(
        matches!(
            answer.response,
            Some(processing_response::Response::RequestBody(_))
        ),
        "{answer:?}"
    );
    assert_eq!(
        streamed_body(&answer),
        None,
        "BUFFERED: the body is not mutated"
    );
    let destination = endpoint_of(&one);
    assert_eq!(
        set_header(&answer, "x-gateway-destination-endpoint"),
        Some(destination.clone())
    );
    assert_eq!(metadata_destination(&answer), Some(destination));
    // No body in the response: its headers end the request.
    stream.send(response_headers("200", true)).await;
    stream.answer().await;
    picker.released().await;
    assert_eq!(
        picker.metric("router_requests_total{endpoint=\"chat_completions\",outcome=\"completed\"}"),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_sticks_to_its_engine() {
    let one = Engine::start(1).await;
    let two = Engine::start(2).await;
    let yaml = rr_yaml(
        &[&one, &two],
        "session_affinity: {mode: hard, ttl_secs: 600}\n",
    );
    let picker = start("epp_sessions", &yaml).await;
    let mut picks = Vec::new();
    for i in 0..4 {
        let payload = completion(&format!("turn {i}"));
        let (mut stream, destination) =
            pick_full_duplex(&picker, &[("x-session-id", "s-1")], None, &payload).await;
        respond_ok(&mut stream).await;
        picks.push(destination);
    }
    assert!(
        picks.iter().all(|p| *p == picks[0]),
        "session moved: {picks:?}"
    );
    picker.released().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subset_hint_is_honoured_and_an_empty_subset_gets_503() {
    let one = Engine::start(1).await;
    let two = Engine::start(2).await;
    let picker = start("epp_subset", &rr_yaml(&[&one, &two], "")).await;
    let only_two = [endpoint_of(&two)];
    for i in 0..3 {
        let payload = completion(&format!("subset {i}"));
        let (mut stream, destination) =
            pick_full_duplex(&picker, &[], Some(&only_two), &payload).await;
        assert_eq!(destination, only_two[0]);
        respond_ok(&mut stream).await;
    }
    let mut stream = open(&picker).await;
    stream
        .send(with_subset(
            request_headers(BodySendMode::FullDuplexStreamed, "/v1/completions", &[]),
            &["127.0.0.1:1".to_owned()],
        ))
        .await;
    stream.send(body(true, &completion("x"), true)).await;
    let (status, reason, _, error) = immediate(&stream.answer().await);
    assert_eq!(status, 503);
    assert_eq!(reason, "no_endpoint_in_subset");
    assert_eq!(error["error"]["code"], "no_endpoint_in_subset");
    picker.released().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_body_gets_400_and_no_healthy_engine_gets_503_with_the_reason() {
    let one = Engine::start(1).await;
    let picker = start("epp_refusals", &rr_yaml(&[&one], "")).await;
    let mut stream = open(&picker).await;
    stream
        .send(request_headers(
            BodySendMode::FullDuplexStreamed,
            "/v1/completions",
            &[],
        ))
        .await;
    stream.send(body(true, br#"{"model": "tiny"}"#, true)).await;
    let (status, reason, _, error) = immediate(&stream.answer().await);
    assert_eq!(status, 400);
    assert_eq!(error["error"]["param"], "prompt");
    assert_eq!(reason, error["error"]["code"].as_str().expect("a code"));

    // A body over serve.max_body_bytes: 413.
    let small = start(
        "epp_too_large",
        &rr_yaml(&[&one], "serve:\n  max_body_bytes: 1024\n"),
    )
    .await;
    let mut stream = open(&small).await;
    stream
        .send(request_headers(
            BodySendMode::FullDuplexStreamed,
            "/v1/completions",
            &[],
        ))
        .await;
    stream.send(body(true, &[b' '; 800], false)).await;
    stream.send(body(true, &[b' '; 800], false)).await;
    let (status, ..) = immediate(&stream.answer().await);
    assert_eq!(status, 413);

    // The engine goes unhealthy: no worker to pick, 503.
    one.state.controls.healthy.store(false, Ordering::SeqCst);
    let start_wait = Instant::now();
    while picker.app.health.any_healthy() {
        assert!(
            start_wait.elapsed() < WAIT,
            "the engine never went unhealthy"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut stream = open(&picker).await;
    stream
        .send(request_headers(
            BodySendMode::FullDuplexStreamed,
            "/v1/completions",
            &[],
        ))
        .await;
    stream.send(body(true, &completion("x"), true)).await;
    let (status, reason, _, error) = immediate(&stream.answer().await);
    assert_eq!(status, 503, "{error}");
    assert_eq!(reason, error["error"]["code"].as_str().expect("a code"));
    picker.released().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_stream_and_an_engine_5xx_release_the_booking() {
    let one = Engine::start(1).await;
    let picker = start("epp_release", &rr_yaml(&[&one], "")).await;

    // Dropped after the response headers: the client went away.
    let (mut stream, _) = pick_full_duplex(&picker, &[], None, &completion("drop me")).await;
    stream.send(response_headers("200", false)).await;
    stream.answer().await;
    assert_eq!(picker.in_flight(), (1, 1));
    drop(stream);
    picker.released().await;
    assert_eq!(
        picker.metric("router_requests_total{endpoint=\"completions\",outcome=\"cancelled\"}"),
        1.0
    );

    // The engine answered 503: the request failed.
    let (mut stream, _) = pick_full_duplex(&picker, &[], None, &completion("fail me")).await;
    stream.send(response_headers("503", true)).await;
    stream.answer().await;
    picker.released().await;
    assert_eq!(
        picker.metric("router_requests_total{endpoint=\"completions\",outcome=\"failed\"}"),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admission_queue_timeout_gets_429_with_retry_after_and_the_reason() {
    let one = Engine::start(1).await;
    let yaml = format!(
        "block_size: 4\npolicy_classes:\n  - name: default\n    prefill_busy_threshold: 0\n    \
         max_queue_wait_ms: 200\n{}",
        workers_yaml(&[&one])
    );
    let picker = start("epp_queue_timeout", &yaml).await;
    // The first request is picked and its response not begun: the engine is busy prefilling.
    let (mut first, _) = pick_full_duplex(&picker, &[], None, &completion("first one")).await;
    let mut second = open(&picker).await;
    second
        .send(request_headers(
            BodySendMode::FullDuplexStreamed,
            "/v1/completions",
            &[],
        ))
        .await;
    second
        .send(body(true, &completion("second one"), true))
        .await;
    let (status, reason, retry_after, error) = immediate(&second.answer().await);
    assert_eq!(status, 429, "{error}");
    assert_eq!(retry_after.as_deref(), Some("1"));
    assert_eq!(error["error"]["type"], "rate_limit_error");
    assert_eq!(reason, error["error"]["code"].as_str().expect("a code"));
    assert_eq!(picker.in_flight(), (1, 1), "the 429 booked nothing");
    respond_ok(&mut first).await;
    picker.released().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_mode_answers_each_chunk_and_names_the_destination_on_the_last() {
    let one = Engine::start(1).await;
    let picker = start("epp_streamed", &rr_yaml(&[&one], "")).await;
    let payload = completion("streamed mode");
    let (a, b) = payload.split_at(payload.len() / 2);
    let destination = endpoint_of(&one);

    // Envoy waits for the headers' answer before it sends the body: answered at once.
    let mut stream = open(&picker).await;
    stream
        .send(request_headers(
            BodySendMode::Streamed,
            "/v1/completions",
            &[],
        ))
        .await;
    let headers = stream.answer().await;
    assert_eq!(set_header(&headers, "x-gateway-destination-endpoint"), None);
    stream.send(body(true, a, false)).await;
    let chunk = stream.answer().await;
    assert_eq!(
        streamed_body(&chunk),
        None,
        "STREAMED: chunks go on as they are"
    );
    assert_eq!(set_header(&chunk, "x-gateway-destination-endpoint"), None);
    stream.send(body(true, b, true)).await;
    let last = stream.answer().await;
    assert_eq!(
        set_header(&last, "x-gateway-destination-endpoint"),
        Some(destination.clone())
    );
    assert_eq!(metadata_destination(&last), Some(destination.clone()));
    stream.send(response_headers("200", true)).await;
    stream.answer().await;

    // With send_body_without_waiting_for_header_response the headers' answer waits for the
    // body and carries the destination.
    let mut stream = open(&picker).await;
    let mut first = request_headers(BodySendMode::Streamed, "/v1/completions", &[]);
    if let Some(config) = first.protocol_config.as_mut() {
        config.send_body_without_waiting_for_header_response = true;
    }
    stream.send(first).await;
    stream.send(body(true, a, false)).await;
    stream.send(body(true, b, true)).await;
    let headers = stream.answer().await;
    assert!(
        matches!(
            headers.response,
            Some(processing_response::Response::RequestHeaders(_))
        ),
        "{headers:?}"
    );
    assert_eq!(
        set_header(&headers, "x-gateway-destination-endpoint"),
        Some(destination)
    );
    for _ in 0..2 {
        let chunk = stream.answer().await;
        assert!(
            matches!(
                chunk.response,
                Some(processing_response::Response::RequestBody(_))
            ),
            "{chunk:?}"
        );
    }
    stream.send(response_headers("200", true)).await;
    stream.answer().await;
    picker.released().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_response_body_the_streams_end_after_the_headers_completes_the_request() {
    let one = Engine::start(1).await;
    let picker = start("epp_no_response_body", &rr_yaml(&[&one], "")).await;
    let mut stream = open(&picker).await;
    let mut first = request_headers(BodySendMode::FullDuplexStreamed, "/v1/completions", &[]);
    if let Some(config) = first.protocol_config.as_mut() {
        config.response_body_mode = BodySendMode::None as i32;
    }
    stream.send(first).await;
    stream.send(body(true, &completion("no body"), true)).await;
    for _ in 0..2 {
        stream.answer().await;
    }
    stream.send(response_headers("200", false)).await;
    stream.answer().await;
    assert_eq!(picker.in_flight(), (1, 1));
    // Envoy ends the stream once the response headers are processed (it resets it).
    drop(stream);
    picker.released().await;
    assert_eq!(
        picker.metric("router_requests_total{endpoint=\"completions\",outcome=\"completed\"}"),
        1.0
    );
}

async fn health_status(
    channel: &router_epp::proto::Channel,
    service: &str,
) -> router_epp::proto::health::health_check_response::ServingStatus {
    use router_epp::proto::health::{health_client::HealthClient, HealthCheckRequest};
    HealthClient::new(channel.clone())
        .check(HealthCheckRequest {
            service: service.to_owned(),
        })
        .await
        .expect("a health answer")
        .into_inner()
        .status()
}

async fn until_health(
    channel: &router_epp::proto::Channel,
    service: &str,
    wanted: router_epp::proto::health::health_check_response::ServingStatus,
) {
    let start = Instant::now();
    loop {
        let now = health_status(channel, service).await;
        if now == wanted {
            return;
        }
        assert!(start.elapsed() < WAIT, "{service} stayed {now:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grpc_health_service_reports_liveness_and_readiness() {
    use router_epp::proto::health::health_check_response::ServingStatus;

    let one = Engine::start(1).await;
    let picker = start("epp_grpc_health", &rr_yaml(&[&one], "")).await;
    let channel = router_epp::proto::Channel::from_shared(format!("http://{}", picker.grpc))
        .expect("a URI")
        .connect()
        .await
        .expect("connect to the picker's gRPC port");
    assert_eq!(
        health_status(&channel, "liveness").await,
        ServingStatus::Serving
    );
    until_health(&channel, "readiness", ServingStatus::Serving).await;
    until_health(
        &channel,
        "envoy.service.ext_proc.v3.ExternalProcessor",
        ServingStatus::Serving,
    )
    .await;
    one.state.controls.healthy.store(false, Ordering::SeqCst);
    until_health(&channel, "readiness", ServingStatus::NotServing).await;
    assert_eq!(
        health_status(&channel, "liveness").await,
        ServingStatus::Serving
    );
    // The ext_proc service shares the port.
    one.state.controls.healthy.store(true, Ordering::SeqCst);
    until_health(&channel, "readiness", ServingStatus::Serving).await;
    let (mut stream, _) = pick_full_duplex(&picker, &[], None, &completion("still picking")).await;
    respond_ok(&mut stream).await;
    picker.released().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_paths_and_out_of_order_streams_are_refused_with_their_reason() {
    let one = Engine::start(1).await;
    let picker = start("epp_protocol", &rr_yaml(&[&one], "")).await;
    let mut stream = open(&picker).await;
    stream
        .send(request_headers(
            BodySendMode::FullDuplexStreamed,
            "/v1/embeddings",
            &[],
        ))
        .await;
    let (status, reason, _, error) = immediate(&stream.answer().await);
    assert_eq!((status, reason.as_str()), (404, "not_found"), "{error}");
    assert!(error["error"]["message"]
        .as_str()
        .expect("a message")
        .contains("/v1/embeddings"));

    let mut stream = open(&picker).await;
    stream
        .send(body(true, &completion("no headers"), true))
        .await;
    let (status, reason, _, error) = immediate(&stream.answer().await);
    assert_eq!(
        (status, reason.as_str()),
        (400, "ext_proc_protocol"),
        "{error}"
    );
    assert_eq!(picker.in_flight(), (0, 0));
}

/// `message` with the data plane's report of the endpoint that served (`envoy.lb:
/// {x-gateway-destination-endpoint-served}` in `metadata_context`).
fn with_served(mut message: ProcessingRequest, served: &str) -> ProcessingRequest {
    let mut metadata = Metadata::default();
    metadata.filter_metadata.insert(
        "envoy.lb".to_owned(),
        Struct {
            fields: [(
                "x-gateway-destination-endpoint-served".to_owned(),
                Value {
                    kind: Some(Kind::StringValue(served.to_owned())),
                },
            )]
            .into(),
        },
    );
    message.metadata_context = Some(metadata);
    message
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fallbacks_follow_the_pick_in_the_header_and_the_metadata_inside_the_subset() {
    let (one, two, three) = (
        Engine::start(1).await,
        Engine::start(2).await,
        Engine::start(3).await,
    );
    let picker = Picker::start_with(
        "epp_fallbacks",
        &rr_yaml(&[&one, &two, &three], ""),
        "  fallbacks: 2\n",
    )
    .await;
    let mut all: Vec<String> = [&one, &two, &three].map(endpoint_of).into();
    all.sort();
    // Without a hint: the pick, then the two others (pick_full_duplex checks the header and
    // the metadata carry the same list).
    let (stream, destination) =
        pick_full_duplex(&picker, &[], None, &completion("fallbacks")).await;
    let listed: Vec<&str> = destination.split(',').collect();
    assert_eq!(listed.len(), 3, "{destination}");
    let mut sorted: Vec<String> = listed.iter().map(|s| (*s).to_owned()).collect();
    sorted.sort();
    assert_eq!(sorted, all, "every engine once: {destination}");

    // The first request still booked on its engine: the next pick lists it last, after the
    // idle one (the least loaded first).
    let (second, next) = pick_full_duplex(&picker, &[], None, &completion("busy")).await;
    let next: Vec<&str> = next.split(',').collect();
    assert_eq!(next.len(), 3);
    assert_ne!(next[0], listed[0], "round-robin picked another engine");
    assert_eq!(
        next[2], listed[0],
        "the busy engine is the last fallback: {next:?}"
    );
    drop(stream);
    drop(second);
    picker.released().await;

    // With a hint of two: the pick and the one other of the subset, never the third.
    let subset = [all[0].clone(), all[2].clone()];
    let (stream, destination) =
        pick_full_duplex(&picker, &[], Some(&subset), &completion("subset")).await;
    let listed: Vec<&str> = destination.split(',').collect();
    assert_eq!(listed.len(), 2, "{destination}");
    assert_ne!(listed[0], listed[1]);
    assert!(
        listed.iter().all(|e| subset.iter().any(|s| s == e)),
        "{destination}"
    );
    drop(stream);
    picker.released().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_served_by_another_engine_moves_the_booking_there() {
    let (one, two) = (Engine::start(1).await, Engine::start(2).await);
    let picker = start("epp_served_moves", &rr_yaml(&[&one, &two], "")).await;
    let (mut stream, destination) =
        pick_full_duplex(&picker, &[], None, &completion("served")).await;
    let (picked, other) = if destination == endpoint_of(&one) {
        (1, 2)
    } else {
        (2, 1)
    };
    let other_endpoint = endpoint_of(if other == 1 { &one } else { &two });
    assert_eq!((picker.booked_on(picked), picker.booked_on(other)), (1, 0));

    stream
        .send(with_served(response_headers("200", false), &other_endpoint))
        .await;
    let answer = stream.answer().await;
    assert_eq!(
        set_header(&answer, "x-router-worker").as_deref(),
        Some(other.to_string().as_str()),
        "the decision headers name the row that served: {answer:?}"
    );
    assert_eq!((picker.booked_on(picked), picker.booked_on(other)), (0, 1));
    assert_eq!(
        picker.metric("router_epp_served_elsewhere_total{outcome=\"moved\"}"),
        1.0
    );
    assert_eq!(picker.in_flight(), (1, 1), "one booking, not two");
    stream.send(body(false, b"data: [DONE]\n\n", true)).await;
    stream.answer().await;
    picker.released().await;
    assert_eq!(
        picker.metric("router_requests_total{endpoint=\"completions\",outcome=\"completed\"}"),
        1.0,
        "the request is counted once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_served_endpoint_that_is_the_pick_or_no_worker_keeps_the_booking() {
    let (one, two) = (Engine::start(1).await, Engine::start(2).await);
    let picker = start("epp_served_keeps", &rr_yaml(&[&one, &two], "")).await;
    for served in [None, Some("10.255.0.1:1"), Some("")] {
        let (mut stream, destination) =
            pick_full_duplex(&picker, &[], None, &completion("keeps")).await;
        let picked = if destination == endpoint_of(&one) {
            1
        } else {
            2
        };
        let served = served.unwrap_or(&destination);
        stream
            .send(with_served(response_headers("200", false), served))
            .await;
        stream.answer().await;
        assert_eq!(
            picker.booked_on(picked),
            1,
            "served {served:?}: the booking stays"
        );
        assert_eq!(picker.in_flight(), (1, 1));
        stream.send(body(false, b"data: [DONE]\n\n", true)).await;
        stream.answer().await;
        picker.released().await;
    }
    assert_eq!(
        picker.metric("router_epp_served_elsewhere_total{outcome=\"unknown_endpoint\"}"),
        2.0,
        "an unknown ip:port and an empty value are counted"
    );
    assert_eq!(
        picker.metric("router_epp_served_elsewhere_total{outcome=\"moved\"}"),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_by_host_name_is_refused_by_epp_at_start_and_reload_and_taken_by_serve() {
    let one = Engine::start(1).await;
    let port = one
        .url()
        .trim_end_matches('/')
        .rsplit(':')
        .next()
        .unwrap()
        .to_owned();
    let by_name = format!(
        "block_size: 4\nworkers:\n  - id: 1\n    url: http://{}\n  - id: 7\n    url: http://localhost:{port}\n",
        endpoint_of(&one)
    );

    // epp: refused at start, naming the worker, its entry and why.
    let dir = common::temp_dir("epp_host_name");
    let yaml = format!("{by_name}epp:\n  listen: 127.0.0.1:0\n  metrics_listen: 127.0.0.1:0\n");
    let config = common::write(&dir, "router.yaml", &yaml);
    let err = router_epp::Epp::bind(router_runtime::ServeOptions {
        config,
        plugin_dirs: Vec::new(),
        listen: None,
    })
    .await
    .err()
    .expect("a worker by host name is refused")
    .to_string();
    for part in [
        "router.yaml",
        "workers[1].url (line 5)",
        "worker 7",
        "`localhost`",
        "not an IP address",
        "ORIGINAL_DST",
    ] {
        assert!(err.contains(part), "{part:?} not in: {err}");
    }

    // epp: a reload that brings one in is refused the same way, and the set stays.
    let picker = start("epp_host_name_reload", &rr_yaml(&[&one], "")).await;
    std::fs::write(
        &picker.config,
        format!("{by_name}epp:\n  listen: 127.0.0.1:0\n  metrics_listen: 127.0.0.1:0\n"),
    )
    .unwrap();
    let err = picker.app.reload().await.expect_err("refused").to_string();
    assert!(
        err.contains("worker 7") && err.contains("not an IP address"),
        "{err}"
    );
    assert_eq!(
        picker.metric("router_config_reloads_total{outcome=\"error\"}"),
        1.0
    );
    assert_eq!(picker.app.current.load().config.workers.len(), 1);

    // serve: host names are fine.
    let router = common::engine::TestRouter::start("serve_host_name", &by_name).await;
    assert_eq!(router.handle.loaded().config.workers.len(), 2);
    router.stop().await;
}
