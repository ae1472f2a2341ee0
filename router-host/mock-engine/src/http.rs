//! The HTTP side, shaped like vLLM's OpenAI server: hyper's HTTP/1 server and a path/method
//! match, with what both ways of answering share (body limits, the fault controls, the
//! counters, `/tokenize`, `/v1/models`, `/health`); the answers themselves are in
//! `scripted.rs` and `model.rs`, the pieces they are made of in `answer.rs`.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Limited};
use hyper::body::Incoming;
use hyper::{Method, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::answer::{
    bad_request, check_model, error, full, json_response, lock, Active, Completion, Refusal,
    Response,
};
use crate::{EngineState, Mode};

/// Accept connections until `stop` turns true (or its sender goes), then let the open ones end
/// their answers (idle ones close at once) for up to 10 s.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<EngineState>,
    mut stop: watch::Receiver<bool>,
) {
    let mut connections = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            changed = stop.changed() => {
                if changed.is_err() || *stop.borrow() {
                    break;
                }
            }
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    // Streamed chunks are small writes: without TCP_NODELAY each can wait
                    // ~40 ms for the reader's delayed ACK.
                    let _ = stream.set_nodelay(true);
                    connections.spawn(connection(stream, state.clone(), stop.clone()));
                }
                Err(err) => {
                    // Out of file descriptors and the like: wait instead of spinning.
                    tracing::warn!(error = %err, "mock-engine: cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    let _ = tokio::time::timeout(Duration::from_secs(10), async {
        while connections.join_next().await.is_some() {}
    })
    .await;
}

async fn connection(
    stream: tokio::net::TcpStream,
    state: Arc<EngineState>,
    mut stop: watch::Receiver<bool>,
) {
    let service = hyper::service::service_fn(move |request| {
        let state = state.clone();
        async move { Ok::<_, Infallible>(route(state, request).await) }
    });
    let conn =
        hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    let stopped = async move {
        // The guard `wait_for` returns is dropped here, before the connection is awaited.
        let _ = stop.wait_for(|stop| *stop).await.is_ok();
    };
    tokio::select! {
        _ = conn.as_mut() => {}
        () = stopped => {
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
    }
}

async fn route(state: Arc<EngineState>, request: hyper::Request<Incoming>) -> Response {
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let model = match &state.mode {
        Mode::Model(model) => Some(model),
        Mode::Scripted | Mode::Generated => None,
    };
    match (method, path.as_str()) {
        (Method::POST, "/v1/completions") => completion(state, false, request).await,
        (Method::POST, "/v1/chat/completions") => completion(state, true, request).await,
        (Method::POST, "/tokenize") => tokenize(state, request).await,
        (Method::GET | Method::HEAD, "/v1/models") => models(&state),
        (Method::GET | Method::HEAD, "/health") => health(&state),
        (Method::GET | Method::HEAD, "/metrics") => match model {
            Some(model) => model.metrics(&state.model),
            None => crate::scripted::metrics(&state),
        },
        (Method::POST, "/reset_prefix_cache") if model.is_some() => match model {
            Some(model) => model.reset_prefix_cache(),
            None => not_found(),
        },
        (
            _,
            "/v1/completions"
            | "/v1/chat/completions"
            | "/tokenize"
            | "/v1/models"
            | "/health"
            | "/metrics",
        ) => plain(StatusCode::METHOD_NOT_ALLOWED, ""),
        (_, "/reset_prefix_cache") if model.is_some() => plain(StatusCode::METHOD_NOT_ALLOWED, ""),
        _ => not_found(),
    }
}

fn plain(status: StatusCode, text: &'static str) -> Response {
    full(status, "", text)
}

fn not_found() -> Response {
    plain(StatusCode::NOT_FOUND, "")
}

/// The body, at most `max_body_bytes` of it.
async fn read_body(state: &EngineState, body: Incoming) -> Result<Bytes, Refusal> {
    match Limited::new(body, state.max_body_bytes).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(err) if err.is::<http_body_util::LengthLimitError>() => Err(Box::new(error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "BadRequestError",
            format!(
                "the request body is over the engine's limit of {} bytes",
                state.max_body_bytes
            ),
        ))),
        Err(err) => Err(Box::new(bad_request(format!(
            "cannot read the request body: {err}"
        )))),
    }
}

async fn completion(
    state: Arc<EngineState>,
    chat: bool,
    request: hyper::Request<Incoming>,
) -> Response {
    let (parts, body) = request.into_parts();
    state.seen.completions.fetch_add(1, Ordering::SeqCst);
    *lock(&state.seen.last_headers) = Some(parts.headers.clone());
    let bytes = match read_body(&state, body).await {
        Ok(bytes) => bytes,
        Err(response) => return *response,
    };
    let body: Value = match serde_json::from_slice(&bytes) {
        Ok(v) => v,
        Err(err) => return bad_request(format!("request body is not valid JSON: {err}")),
    };
    *lock(&state.seen.last_body) = Some(body.clone());
    let mut active = Active::new(state.clone());
    let delay = state.controls.head_delay_ms.load(Ordering::SeqCst);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    let fail = state.controls.fail_status.load(Ordering::SeqCst);
    if fail != 0 {
        active.finished = true;
        return error(
            StatusCode::from_u16(fail).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            "InjectedFailure",
            "injected failure",
        );
    }
    let completion = Completion {
        chat,
        headers: parts.headers,
        bytes,
        body,
        active,
    };
    match &state.mode {
        Mode::Scripted => crate::scripted::answer(&state, completion),
        Mode::Generated => crate::generated::answer(&state, completion),
        Mode::Model(model) => model.answer(&state, completion).await,
    }
}

async fn tokenize(state: Arc<EngineState>, request: hyper::Request<Incoming>) -> Response {
    state.seen.tokenize.fetch_add(1, Ordering::SeqCst);
    let bytes = match read_body(&state, request.into_body()).await {
        Ok(bytes) => bytes,
        Err(response) => return *response,
    };
    // `{"model", "prompt"}` or `{"model", "messages", ...}`, as vLLM's /tokenize.
    let chat = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .is_some_and(|v| v.get("messages").is_some());
    let request = match crate::request::read(chat, &bytes) {
        Ok(request) => request,
        Err(message) => return bad_request(message),
    };
    if let Err(response) = check_model(&state, &request.model) {
        return *response;
    }
    match state.tokenizer.tokenize_request(&request) {
        Ok(tokens) => json_response(&json!({
            "count": tokens.len(),
            "max_model_len": state.controls.max_model_len.load(Ordering::SeqCst),
            "tokens": tokens,
            "token_strs": null,
        })),
        Err(message) => bad_request(message),
    }
}

fn models(state: &EngineState) -> Response {
    state.seen.models.fetch_add(1, Ordering::SeqCst);
    json_response(&json!({"object": "list", "data": [{
        "id": state.model, "object": "model", "created": state.created,
        "owned_by": "vllm", "root": state.model, "parent": null,
        "max_model_len": state.max_model_len}]}))
}

fn health(state: &EngineState) -> Response {
    state.seen.health.fetch_add(1, Ordering::SeqCst);
    if state.controls.healthy.load(Ordering::SeqCst) {
        plain(StatusCode::OK, "")
    } else {
        plain(StatusCode::SERVICE_UNAVAILABLE, "")
    }
}
