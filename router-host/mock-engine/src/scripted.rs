//! Scripted answers: no model, the same bytes for the same request. Each completion is
//! `controls.chunks` words ` tok0`, ` tok1`, ... (streamed one per chunk, `chunk_delay_ms`
//! apart, then vLLM's usage chunk when asked and `[DONE]`), with ids from the worker id and
//! `created` 0; the header `x-engine-id` names the worker.

use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, StreamBody};
use hyper::body::Frame;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::StatusCode;
use serde_json::{json, Value};

use crate::answer::{full, Completion, Response};
use crate::EngineState;

/// The bytes of a streamed scripted completion, exactly as the engine sends them.
pub fn stream_chunks(engine: u64, chat: bool, chunks: usize, usage: bool) -> Vec<String> {
    let mut out = Vec::new();
    for i in 0..chunks {
        let chunk = if chat {
            json!({"id": format!("chatcmpl-{engine}"), "object": "chat.completion.chunk",
                   "created": 0, "model": "tiny",
                   "choices": [{"index": 0, "delta": {"content": format!(" tok{i}")},
                                "logprobs": null, "finish_reason": null}]})
        } else {
            json!({"id": format!("cmpl-{engine}"), "object": "text_completion", "created": 0,
                   "model": "tiny",
                   "choices": [{"index": 0, "text": format!(" tok{i}"), "logprobs": null,
                                "finish_reason": null, "stop_reason": null}]})
        };
        out.push(format!("data: {chunk}\n\n"));
    }
    if usage {
        let object = if chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let chunk = json!({"id": format!("cmpl-{engine}"), "object": object, "created": 0,
                           "model": "tiny", "choices": [],
                           "usage": {"prompt_tokens": 5, "total_tokens": 5 + chunks,
                                     "completion_tokens": chunks}});
        out.push(format!("data: {chunk}\n\n"));
    }
    out.push("data: [DONE]\n\n".to_owned());
    out
}

fn engine_header(response: &mut Response, id: u64) {
    if let Ok(value) = HeaderValue::from_str(&id.to_string()) {
        response.headers_mut().insert("x-engine-id", value);
    }
}

pub fn answer(state: &EngineState, completion: Completion) -> Response {
    let Completion {
        chat,
        body,
        mut active,
        ..
    } = completion;
    let chunks = state.controls.chunks.load(Ordering::SeqCst);
    let id = state.id;
    if body.get("stream").and_then(Value::as_bool) == Some(true) {
        let usage = body
            .pointer("/stream_options/include_usage")
            .and_then(Value::as_bool)
            == Some(true);
        let parts = stream_chunks(id, chat, chunks, usage);
        let gap = Duration::from_millis(state.controls.chunk_delay_ms.load(Ordering::SeqCst));
        let stream = futures_util::stream::unfold(
            (parts.into_iter(), Some(active), true),
            move |(mut parts, mut active, first)| async move {
                if !first && !gap.is_zero() {
                    tokio::time::sleep(gap).await;
                }
                match parts.next() {
                    Some(part) => Some((
                        Ok::<_, std::io::Error>(Frame::data(Bytes::from(part))),
                        (parts, active, false),
                    )),
                    None => {
                        if let Some(a) = active.as_mut() {
                            a.finished = true;
                        }
                        drop(active.take());
                        None
                    }
                }
            },
        );
        let mut response = hyper::Response::new(StreamBody::new(stream).boxed_unsync());
        response.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream; charset=utf-8"),
        );
        engine_header(&mut response, id);
        return response;
    }
    active.finished = true;
    let text: String = (0..chunks).map(|i| format!(" tok{i}")).collect();
    let usage = json!({"prompt_tokens": 5, "total_tokens": 5 + chunks,
                       "completion_tokens": chunks});
    let answer = if chat {
        json!({"id": format!("chatcmpl-{id}"), "object": "chat.completion", "created": 0,
               "model": "tiny",
               "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                            "logprobs": null, "finish_reason": "length"}],
               "usage": usage})
    } else {
        json!({"id": format!("cmpl-{id}"), "object": "text_completion", "created": 0,
               "model": "tiny",
               "choices": [{"index": 0, "text": text, "logprobs": null,
                            "finish_reason": "length"}],
               "usage": usage})
    };
    let mut response = full(StatusCode::OK, "application/json", answer.to_string());
    engine_header(&mut response, id);
    response
}

/// vLLM's load gauges, with the completions being answered as running.
pub fn metrics(state: &EngineState) -> Response {
    let running = state.seen.active.load(Ordering::SeqCst).max(0);
    let text = format!(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{engine=\"0\",model_name=\"tiny\"}} {running}.0\n\
         # HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{engine=\"0\",model_name=\"tiny\"}} 0.0\n"
    );
    full(StatusCode::OK, "text/plain; version=0.0.4", text)
}
