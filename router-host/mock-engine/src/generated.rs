//! Generated answers: every next token a deterministic function of the whole token prefix
//! (prompt ids, then the tokens generated so far), so a request continued on another engine
//! from its prompt plus the tokens already generated (as a completion with a token-id prompt)
//! gets exactly the tokens this engine would have produced. Answers are shaped as vLLM's, with
//! its `return_token_ids` fields: `prompt_token_ids` and `token_ids` present and null unless
//! asked (vLLM sets them explicitly, so they survive its `exclude_unset`); asked, a stream's
//! first chunk carries the prompt's ids (a completion per choice, a chat at the top level) and
//! each chunk its token's id.
//!
//! The fault `die_after_tokens` cuts the connection after that many tokens of an answer (a
//! whole answer: after a few bytes of its body), as an engine that dies mid-stream does.

use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, StreamBody};
use hyper::body::Frame;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::StatusCode;
use serde_json::{json, Value};

use crate::answer::{bad_request, check_model, full, Completion, Response};
use crate::request::{self, Prompt};
use crate::EngineState;

/// The generator's state after a prefix: feed it every id in order.
#[derive(Debug, Clone, Copy)]
pub struct Generator(u64);

impl Default for Generator {
    fn default() -> Self {
        Generator(0xcbf2_9ce4_8422_2325)
    }
}

impl Generator {
    /// The state after `prefix`.
    pub fn after(prefix: &[u32]) -> Generator {
        let mut g = Generator::default();
        for &id in prefix {
            g.push(id);
        }
        g
    }

    pub fn push(&mut self, id: u32) {
        for byte in id.to_le_bytes() {
            self.0 = (self.0 ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }

    /// The token that follows the prefix seen so far: 1000 to 1999.
    pub fn next(&self) -> u32 {
        // splitmix64's finaliser spreads FNV's low bits.
        let mut z = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        1000 + (z % 1000) as u32
    }
}

/// The `n` tokens generated after `prompt`.
pub fn generate(prompt: &[u32], n: usize) -> Vec<u32> {
    let mut g = Generator::after(prompt);
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let id = g.next();
        g.push(id);
        out.push(id);
    }
    out
}

/// A generated token's text: ` w1234`, or ` ü1235` for every fifth id (two-byte UTF-8, so text
/// comparisons see more than ASCII).
pub fn token_text(id: u32) -> String {
    if id.is_multiple_of(5) {
        format!(" ü{id}")
    } else {
        format!(" w{id}")
    }
}

fn ids_or_null(asked: bool, ids: &[u32]) -> Value {
    if asked {
        json!(ids)
    } else {
        Value::Null
    }
}

/// vLLM's field order (pydantic's declaration order) for one streamed choice or answer; `json!`
/// would sort the keys.
fn object(fields: &[(&str, Value)]) -> String {
    let mut out = String::from("{");
    for (i, (key, value)) in fields.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&Value::from(*key).to_string());
        out.push(':');
        out.push_str(&value.to_string());
    }
    out.push('}');
    out
}

struct Shape {
    chat: bool,
    id: String,
    model: String,
    asked: bool,
    prompt: Vec<u32>,
}

impl Shape {
    fn head(&self, object_name: &str) -> Vec<(&'static str, Value)> {
        vec![
            ("id", Value::from(self.id.clone())),
            ("object", Value::from(object_name)),
            ("created", Value::from(0)),
            ("model", Value::from(self.model.clone())),
        ]
    }

    fn chunk_object(&self) -> &'static str {
        if self.chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        }
    }

    /// Chat's first chunk: the role, and the prompt's ids at the top level.
    fn role_chunk(&self) -> String {
        let choice = object(&[
            ("index", json!(0)),
            ("delta", json!({"role": "assistant", "content": ""})),
            ("logprobs", Value::Null),
            ("finish_reason", Value::Null),
        ]);
        let mut fields = self.head(self.chunk_object());
        fields.push(("choices", Value::Null));
        fields.push(("prompt_token_ids", ids_or_null(self.asked, &self.prompt)));
        let text = object(&fields).replace("\"choices\":null", &format!("\"choices\":[{choice}]"));
        format!("data: {text}\n\n")
    }

    /// One token's chunk; `first` (completions) carries the prompt's ids.
    fn token_chunk(&self, id: u32, first: bool, last: bool) -> String {
        let finish = if last {
            Value::from("length")
        } else {
            Value::Null
        };
        let choice = if self.chat {
            object(&[
                ("index", json!(0)),
                ("delta", json!({"content": token_text(id)})),
                ("logprobs", Value::Null),
                ("finish_reason", finish),
                ("token_ids", ids_or_null(self.asked, &[id])),
            ])
        } else {
            let prompt = ids_or_null(self.asked && first, &self.prompt);
            object(&[
                ("index", json!(0)),
                ("text", Value::from(token_text(id))),
                ("logprobs", Value::Null),
                ("finish_reason", finish),
                ("stop_reason", Value::Null),
                ("prompt_token_ids", prompt),
                ("token_ids", ids_or_null(self.asked, &[id])),
            ])
        };
        let mut fields = self.head(self.chunk_object());
        fields.push(("choices", Value::Null));
        let text = object(&fields).replace("\"choices\":null", &format!("\"choices\":[{choice}]"));
        format!("data: {text}\n\n")
    }

    fn usage(&self, generated: usize) -> Value {
        let (p, n) = (self.prompt.len(), generated);
        json!({"prompt_tokens": p, "total_tokens": p + n, "completion_tokens": n})
    }

    fn usage_chunk(&self, generated: usize) -> String {
        let mut fields = self.head(self.chunk_object());
        fields.push(("choices", json!([])));
        fields.push(("usage", self.usage(generated)));
        format!("data: {}\n\n", object(&fields))
    }

    fn whole(&self, tokens: &[u32]) -> String {
        let text: String = tokens.iter().map(|&id| token_text(id)).collect();
        if self.chat {
            let choice = object(&[
                ("index", json!(0)),
                ("message", json!({"role": "assistant", "content": text})),
                ("logprobs", Value::Null),
                ("finish_reason", Value::from("length")),
                ("stop_reason", Value::Null),
                ("token_ids", ids_or_null(self.asked, tokens)),
            ]);
            let mut fields = self.head("chat.completion");
            fields.push(("choices", Value::Null));
            fields.push(("usage", self.usage(tokens.len())));
            fields.push(("prompt_token_ids", ids_or_null(self.asked, &self.prompt)));
            object(&fields).replace("\"choices\":null", &format!("\"choices\":[{choice}]"))
        } else {
            let choice = object(&[
                ("index", json!(0)),
                ("text", Value::from(text)),
                ("logprobs", Value::Null),
                ("finish_reason", Value::from("length")),
                ("stop_reason", Value::Null),
                ("token_ids", ids_or_null(self.asked, tokens)),
                ("prompt_token_ids", ids_or_null(self.asked, &self.prompt)),
            ]);
            let mut fields = self.head("text_completion");
            fields.push(("choices", Value::Null));
            fields.push(("usage", self.usage(tokens.len())));
            object(&fields).replace("\"choices\":null", &format!("\"choices\":[{choice}]"))
        }
    }
}

pub fn answer(state: &EngineState, completion: Completion) -> Response {
    let Completion {
        chat,
        bytes,
        mut active,
        ..
    } = completion;
    let request = match request::read(chat, &bytes) {
        Ok(request) => request,
        Err(message) => return bad_request(message),
    };
    if let Err(response) = check_model(state, &request.model) {
        return *response;
    }
    if request.prompts.len() != 1 {
        return bad_request("generated answers take one prompt");
    }
    let prompt = match request.prompt() {
        Prompt::Tokens(ids) => ids.clone(),
        _ => match state.tokenizer.tokenize_request(&request) {
            Ok(ids) => ids,
            Err(message) => return bad_request(message),
        },
    };
    let max_tokens = match request.max_tokens() {
        Ok(n) => n,
        Err(message) => return bad_request(message),
    };
    let max_model_len = state.controls.max_model_len.load(Ordering::SeqCst);
    let total = (prompt.len() as u64).saturating_add(max_tokens);
    if total > max_model_len {
        return bad_request(format!(
            "This model's maximum context length is {max_model_len} tokens. However, you \
             requested {total} tokens ({} in the prompt, {max_tokens} in the completion).",
            prompt.len()
        ));
    }
    // Bounded by max_model_len just above.
    let tokens = generate(&prompt, max_tokens as usize);
    let shape = Shape {
        chat,
        id: format!(
            "{}-gen-{}",
            if chat { "chatcmpl" } else { "cmpl" },
            state.id
        ),
        model: request.model.clone(),
        asked: request
            .body
            .get("return_token_ids")
            .and_then(Value::as_bool)
            == Some(true),
        prompt,
    };
    let die_after = state.controls.die_after_tokens.load(Ordering::SeqCst);
    let die_after = (die_after > 0).then_some(die_after as usize);
    if !request.stream {
        let text = shape.whole(&tokens);
        if die_after.is_none() {
            active.finished = true;
            let mut response = full(StatusCode::OK, "application/json", text);
            engine_header(&mut response, state.id);
            return response;
        }
        // A few bytes of the answer, then the connection is cut.
        let head = Bytes::copy_from_slice(&text.as_bytes()[..text.len().min(16)]);
        let body = futures_util::stream::unfold(Some((head, active)), |state| async move {
            let (head, active) = state?;
            if head.is_empty() {
                flushed().await;
                drop(active);
                return Some((Err(died()), None));
            }
            Some((Ok(Frame::data(head)), Some((Bytes::new(), active))))
        });
        let mut response = hyper::Response::new(StreamBody::new(body).boxed_unsync());
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        engine_header(&mut response, state.id);
        return response;
    }
    let mut parts: Vec<String> = Vec::with_capacity(tokens.len() + 3);
    if chat {
        parts.push(shape.role_chunk());
    }
    for (i, &id) in tokens.iter().enumerate() {
        parts.push(shape.token_chunk(id, i == 0, i + 1 == tokens.len()));
    }
    // Where the stream dies: after the role chunk and that many tokens.
    let cut = die_after.map(|k| k.min(tokens.len()) + usize::from(chat));
    if request.include_usage() {
        parts.push(shape.usage_chunk(tokens.len()));
    }
    parts.push("data: [DONE]\n\n".to_owned());
    let gap = Duration::from_millis(state.controls.chunk_delay_ms.load(Ordering::SeqCst));
    let stream = futures_util::stream::unfold(
        (parts.into_iter().enumerate(), Some(active)),
        move |(mut parts, mut active)| async move {
            let (i, part) = match parts.next() {
                Some(next) => next,
                None => {
                    if let Some(a) = active.as_mut() {
                        a.finished = true;
                    }
                    drop(active.take());
                    return None;
                }
            };
            if i > 0 && !gap.is_zero() {
                tokio::time::sleep(gap).await;
            }
            if cut == Some(i) {
                // The reader sees what came, then the connection cut; the stream ends here.
                flushed().await;
                drop(active.take());
                let dead = Vec::new().into_iter().enumerate();
                return Some((Err(died()), (dead, None)));
            }
            Some((Ok(Frame::data(Bytes::from(part))), (parts, active)))
        },
    );
    let mut response = hyper::Response::new(StreamBody::new(stream).boxed_unsync());
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    engine_header(&mut response, state.id);
    response
}

/// Let hyper write what the body gave so far: it buffers ready chunks and flushes when the
/// body waits, and a body error closes the connection with whatever is still buffered unsent.
/// A dying engine has sent its last tokens; without this, one that dies a few tokens in would
/// die before its response head left.
async fn flushed() {
    tokio::task::yield_now().await;
    tokio::time::sleep(Duration::from_millis(20)).await;
}

fn died() -> std::io::Error {
    std::io::Error::other("mock-engine: died mid-answer (die_after_tokens)")
}

fn engine_header(response: &mut Response, id: u64) {
    if let Ok(value) = HeaderValue::from_str(&id.to_string()) {
        response.headers_mut().insert("x-engine-id", value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_is_a_function_of_the_whole_prefix() {
        let prompt = [1u32, 2, 3];
        let all = generate(&prompt, 10);
        // Continued from the prompt plus the first four: the same last six.
        let mut prefix = prompt.to_vec();
        prefix.extend_from_slice(&all[..4]);
        assert_eq!(generate(&prefix, 6), all[4..]);
        // Another prompt, other tokens.
        assert_ne!(generate(&[1, 2, 4], 10), all);
        assert!(all.iter().all(|id| (1000..2000).contains(id)));
    }
}
