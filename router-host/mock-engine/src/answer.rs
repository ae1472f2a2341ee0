//! What an answer is made of, for both ways of answering (`model.rs`, `scripted.rs`) and the
//! HTTP routing (`http.rs`): the response types, vLLM's error bodies, the model check, and the
//! [`Active`] guard that counts a completion until its body ends.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{HeaderMap, StatusCode};
use serde_json::{json, Value};

use crate::EngineState;

/// A body whose error cuts the connection mid-answer (the `die_after_tokens` fault).
pub type Body = http_body_util::combinators::UnsyncBoxBody<Bytes, std::io::Error>;
pub type Response = hyper::Response<Body>;
/// A refusal on the way to an answer (boxed: a response is large).
pub type Refusal = Box<Response>;

pub fn full(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response {
    let mut response = hyper::Response::new(
        Full::new(body.into())
            .map_err(|never: Infallible| match never {})
            .boxed_unsync(),
    );
    *response.status_mut() = status;
    if !content_type.is_empty() {
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    }
    response
}

pub fn json_response(value: &Value) -> Response {
    full(StatusCode::OK, "application/json", value.to_string())
}

/// vLLM's error body.
pub fn error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    let body = json!({"error": {"message": message.into(), "type": kind, "param": null,
                                "code": status.as_u16()}});
    full(status, "application/json", body.to_string())
}

pub fn bad_request(message: impl Into<String>) -> Response {
    error(StatusCode::BAD_REQUEST, "BadRequestError", message)
}

/// A poisoned lock still holds what was last written; the engine goes on with it.
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The model check, as vLLM answers a request for a model it does not serve.
pub fn check_model(state: &EngineState, model: &str) -> Result<(), Refusal> {
    if state.check_model && model != state.model {
        return Err(Box::new(error(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            format!("The model `{model}` does not exist."),
        )));
    }
    Ok(())
}

/// Counts a completion as active until dropped (a streamed body is dropped when it ends or
/// when its reader goes away).
pub struct Active {
    state: Arc<EngineState>,
    pub finished: bool,
}

impl Active {
    pub fn new(state: Arc<EngineState>) -> Active {
        state.seen.active.fetch_add(1, Ordering::SeqCst);
        Active {
            state,
            finished: false,
        }
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        self.state.seen.active.fetch_sub(1, Ordering::SeqCst);
        if !self.finished {
            self.state.seen.streams_cut.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// What a completion answer is given.
pub struct Completion {
    pub chat: bool,
    pub headers: HeaderMap,
    pub bytes: Bytes,
    pub body: Value,
    pub active: Active,
}
