//! Mid-stream failover: a streamed request whose engine fails after its first byte continues on
//! another row from the tokens already generated (docs/serve.md, "Mid-stream failover").
//!
//! - [`plan`] decides, before the first leg, whether the request may move: its limit
//!   (`serve.migration_limit`, lowered by the `x-router-migration-limit` header) and whether a
//!   continuation can be exact ([`refusal`]). When it may, the first leg asks the engine for
//!   token ids (vLLM's `return_token_ids`: the prompt's ids in the first chunk, each chunk's
//!   generated ids).
//! - [`Tracker`] reads the relayed stream event by event: it keeps the prompt's ids and the ids
//!   generated so far, and strips the id fields the client did not ask for (vLLM sends them as
//!   `null` when not asked, so the client's bytes are those it would have got). Only whole events
//!   are relayed, so a leg that dies mid-event leaves nothing half-sent.
//! - [`continuation`] is the body of the next leg: a completion whose prompt is the prompt's ids
//!   plus the generated ids, with the remaining token budget and the same sampling parameters;
//!   the tracker reshapes its chunks into the client's stream (the same id, `created` and
//!   `model`; chat chunks for a chat), and counts usage over every leg.

use bytes::Bytes;
use hyper::http::HeaderMap;
use serde_json::{json, Map, Value};

use crate::errors::ApiError;
use crate::prompt::{Endpoint, Parsed};
use crate::state::LoadedConfig;

/// The request header that lowers `serve.migration_limit` for one request.
pub const LIMIT_HEADER: &str = "x-router-migration-limit";

/// The most token ids kept per request (prompt and generated each), whatever the budget says.
pub const MAX_IDS: usize = 1 << 20;

/// The longest server-sent event buffered while a stream is tracked (a first chunk carries the
/// prompt's ids: about 8 bytes each).
pub const EVENT_LIMIT: usize = 16 << 20;

/// Fields a continuation carries unchanged: they act the same on the prompt plus the tokens
/// generated so far as on the prompt alone.
const CARRIED: &[&str] = &[
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "cache_salt",
    "priority",
    "user",
];

/// Fields the continuation does not need (the prompt is its ids; the router rewrites the
/// budget and the stream options), or that [`refusal`] checked hold their defaults.
const REPLACED: &[&str] = &[
    "prompt",
    "messages",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "return_token_ids",
    "n",
    "best_of",
    "echo",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "stop",
    "seed",
    "tool_choice",
    "tools",
    "parallel_tool_calls",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "documents",
    "suffix",
];

/// What the pipeline knows about a request that may move.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Further legs allowed.
    pub limit: u32,
    /// The client asked for token ids itself: they are relayed, not stripped.
    pub client_wants_ids: bool,
}

/// The request's migration limit: `serve.migration_limit`, or the header's lower value.
pub fn limit(loaded: &LoadedConfig, headers: &HeaderMap) -> Result<u32, ApiError> {
    let configured = loaded.serve.migration_limit;
    let Some(value) = headers.get(LIMIT_HEADER) else {
        return Ok(configured);
    };
    let asked = value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<u32>().ok())
        .ok_or_else(|| {
            ApiError::bad_request(
                "invalid_header",
                format!(
                    "the `{LIMIT_HEADER}` header must be a whole number from 0 to \
                     {configured} (serve.migration_limit), found {:?}",
                    String::from_utf8_lossy(value.as_bytes())
                ),
            )
        })?;
    // Bounded by the configuration: a client may only ask for less.
    Ok(asked.min(configured))
}

fn truthy(value: Option<&Value>) -> bool {
    match value {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(Value::Number(n)) => n.as_f64() != Some(0.0),
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
    }
}

/// Why a continuation of this request could not be exact (the stream then ends with an error
/// event when its engine fails, as without migration); `None` when it can be.
pub fn refusal(endpoint: Endpoint, parsed: &Parsed) -> Option<String> {
    let body = &parsed.body;
    if endpoint == Endpoint::Completions && !parsed.more_prompts.is_empty() {
        return Some("a batch of prompts".into());
    }
    for field in ["n", "best_of"] {
        if body
            .get(field)
            .and_then(Value::as_u64)
            .is_some_and(|n| n > 1)
        {
            return Some(format!("`{field}` over 1"));
        }
    }
    for field in ["logprobs", "top_logprobs", "echo"] {
        if truthy(body.get(field)) {
            return Some(format!(
                "`{field}`: the engine's answer for it cannot be continued"
            ));
        }
    }
    for field in ["presence_penalty", "frequency_penalty"] {
        if truthy(body.get(field)) {
            return Some(format!(
                "`{field}`: it counts only the tokens generated on the engine, which a \
                 continuation sends as prompt"
            ));
        }
    }
    if truthy(body.get("stop")) {
        return Some("`stop` strings: one spanning the point of failure would not be seen".into());
    }
    let greedy = body.get("temperature").and_then(Value::as_f64) == Some(0.0);
    if body.get("seed").is_some_and(|s| !s.is_null()) && !greedy {
        return Some("`seed`: the engine's random state cannot be carried over".into());
    }
    if matches!(body.get("tool_choice"), Some(v) if !v.is_null() && v != "none")
        || truthy(body.get("tools"))
    {
        return Some("tools: the engine parses the answer".into());
    }
    if truthy(
        body.get("stream_options")
            .and_then(|o| o.get("continuous_usage_stats")),
    ) {
        return Some("`stream_options.continuous_usage_stats`".into());
    }
    for (field, value) in body {
        if value.is_null() || CARRIED.contains(&field.as_str()) {
            continue;
        }
        if !REPLACED.contains(&field.as_str()) {
            return Some(format!("`{field}` cannot be carried over"));
        }
    }
    None
}

/// The plan for a request: `None` when it will not move (limit 0, not streamed, or a refusal,
/// which is logged at debug level).
pub fn plan(endpoint: Endpoint, parsed: &Parsed, limit: u32) -> Option<Plan> {
    if limit == 0 || !parsed.stream {
        return None;
    }
    if let Some(why) = refusal(endpoint, parsed) {
        tracing::debug!(reason = %why, "this stream cannot move to another engine if its own fails");
        return None;
    }
    Some(Plan {
        limit,
        client_wants_ids: parsed.body.get("return_token_ids").and_then(Value::as_bool)
            == Some(true),
    })
}

/// The first leg's body: the one the engine would be sent, asking for token ids.
pub fn first_body(body: &Bytes, plan: &Plan) -> Bytes {
    if plan.client_wants_ids {
        return body.clone();
    }
    let Ok(Value::Object(mut object)) = serde_json::from_slice::<Value>(body) else {
        return body.clone();
    };
    object.insert("return_token_ids".into(), Value::Bool(true));
    serde_json::to_vec(&object)
        .map(Bytes::from)
        .unwrap_or_else(|_| body.clone())
}

/// The token budget the client gave (`None`: the rest of the context): a completion's
/// `max_tokens` defaults to 16, as vLLM's; a chat's is unbounded without one.
pub fn budget(endpoint: Endpoint, body: &Map<String, Value>) -> Option<u64> {
    let stated = body
        .get("max_completion_tokens")
        .filter(|v| !v.is_null())
        .or_else(|| body.get("max_tokens"));
    match (endpoint, stated) {
        (_, Some(v)) if !v.is_null() => v.as_u64(),
        (Endpoint::Completions, None) => Some(16),
        _ => None,
    }
}

/// The next leg's body: a streamed completion of the prompt's ids plus the generated ids, with
/// the budget left and the carried sampling parameters.
pub fn continuation(parsed: &Parsed, tracker: &Tracker) -> Bytes {
    let mut body = Map::new();
    for field in CARRIED {
        if let Some(value) = parsed.body.get(*field) {
            body.insert((*field).into(), value.clone());
        }
    }
    let mut prompt = Vec::with_capacity(tracker.prompt.len() + tracker.generated.len());
    prompt.extend_from_slice(&tracker.prompt);
    prompt.extend_from_slice(&tracker.generated);
    body.insert("prompt".into(), json!(prompt));
    body.insert("stream".into(), Value::Bool(true));
    body.insert("return_token_ids".into(), Value::Bool(true));
    let generated = tracker.generated.len() as u64;
    body.insert(
        "max_tokens".into(),
        match tracker.remaining() {
            Some(left) => json!(left),
            // Explicitly unbounded: a completion's default is 16.
            None => Value::Null,
        },
    );
    if let Some(min) = parsed.body.get("min_tokens").and_then(Value::as_u64) {
        let left = min.saturating_sub(generated);
        if left > 0 {
            body.insert("min_tokens".into(), json!(left));
        }
    }
    Bytes::from(Value::Object(body).to_string())
}

/// An engine's stream that cannot be read as one: the leg fails (never a panic).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Garbage(pub String);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Leg {
    First,
    Continuation,
}

/// The tracked state of a stream that may move (see the module docs).
#[derive(Debug)]
pub struct Tracker {
    chat: bool,
    client_wants_ids: bool,
    client_usage: bool,
    leg: Leg,
    buffer: Vec<u8>,
    /// How far `buffer` was searched for an event's end.
    scanned: usize,
    /// The prompt's ids, as the engine gave them.
    prompt: Vec<u32>,
    prompt_seen: bool,
    /// Every id generated so far, over every leg; relayed to the client.
    pub generated: Vec<u32>,
    budget: Option<u64>,
    id: Option<Value>,
    created: Option<Value>,
    model: Option<Value>,
    role_sent: bool,
    usage_sent: bool,
    /// A finish reason was relayed: generation is over.
    pub finished: bool,
    /// Tracking was given up (the stream is relayed as it comes): why.
    pub lost: Option<String>,
    /// Some bytes of this stream reached the client.
    relayed: bool,
}

impl Tracker {
    pub fn new(endpoint: Endpoint, parsed: &Parsed, plan: &Plan) -> Tracker {
        Tracker {
            chat: endpoint == Endpoint::ChatCompletions,
            client_wants_ids: plan.client_wants_ids,
            client_usage: parsed
                .body
                .get("stream_options")
                .and_then(|o| o.get("include_usage"))
                .and_then(Value::as_bool)
                == Some(true),
            leg: Leg::First,
            buffer: Vec::new(),
            scanned: 0,
            prompt: Vec::new(),
            prompt_seen: false,
            generated: Vec::new(),
            budget: budget(endpoint, &parsed.body),
            id: None,
            created: None,
            model: None,
            role_sent: false,
            usage_sent: false,
            finished: false,
            lost: None,
            relayed: false,
        }
    }

    /// The tokens the budget has left (`None`: the rest of the context).
    pub fn remaining(&self) -> Option<u64> {
        self.budget
            .map(|b| b.saturating_sub(self.generated.len() as u64).max(1))
    }

    /// The prompt's ids, as the engine gave them.
    pub fn prompt(&self) -> &[u32] {
        &self.prompt
    }

    /// What is buffered of an event the engine never ended, as it would be relayed.
    pub fn rest(&mut self) -> Bytes {
        let rest = std::mem::take(&mut self.buffer);
        let mut out = Vec::new();
        if !rest.is_empty() && self.leg == Leg::First {
            self.relay_first(&rest, &mut out);
        }
        self.relayed |= !out.is_empty();
        Bytes::from(out)
    }

    /// Whether a failure now can be continued elsewhere.
    pub fn movable(&self) -> Result<(), String> {
        if let Some(why) = &self.lost {
            return Err(why.clone());
        }
        if !self.prompt_seen || self.id.is_none() {
            return Err("the engine failed before it sent the prompt's token ids".into());
        }
        Ok(())
    }

    /// Nothing of the stream reached the client yet (the engine failed after its response
    /// head, before its first event): the request can start again elsewhere, as it came.
    pub fn untouched(&self) -> bool {
        !self.relayed && self.leg == Leg::First && self.lost.is_none()
    }

    /// The request starts again on another row: its stream is a first leg again.
    pub fn restart(&mut self) {
        self.buffer.clear();
        self.scanned = 0;
    }

    /// A new leg's stream follows (a continuation): what is buffered of the failed one is
    /// dropped, never relayed.
    pub fn next_leg(&mut self) {
        self.leg = Leg::Continuation;
        self.buffer.clear();
        self.scanned = 0;
    }

    /// The end of a stream whose generation finished before its engine failed: the usage
    /// chunk the client asked for (if not yet sent) and `[DONE]`.
    pub fn end(&mut self) -> Bytes {
        let mut out = Vec::new();
        self.usage(&mut out);
        out.extend_from_slice(b"data: [DONE]\n\n");
        Bytes::from(out)
    }

    /// Feed a piece of the engine's body; returns the whole events to relay (possibly none).
    pub fn feed(&mut self, chunk: &[u8]) -> Result<Bytes, Garbage> {
        self.buffer.extend_from_slice(chunk);
        let mut out = Vec::new();
        loop {
            let from = self.scanned.saturating_sub(1);
            let Some(at) = self.buffer[from..]
                .windows(2)
                .position(|w| w == b"\n\n")
                .map(|i| i + from)
            else {
                self.scanned = self.buffer.len();
                break;
            };
            let event: Vec<u8> = self.buffer.drain(..at + 2).collect();
            self.scanned = 0;
            self.event(&event, &mut out)?;
        }
        if self.buffer.len() > EVENT_LIMIT {
            return Err(Garbage(format!(
                "the engine sent a server-sent event of over {EVENT_LIMIT} bytes"
            )));
        }
        self.relayed |= !out.is_empty();
        Ok(Bytes::from(out))
    }

    fn event(&mut self, event: &[u8], out: &mut Vec<u8>) -> Result<(), Garbage> {
        let payload = event
            .strip_prefix(b"data:")
            .map(|p| p.strip_prefix(b" ").unwrap_or(p))
            .map(|p| p.trim_ascii_end());
        let Some(payload) = payload else {
            // A comment or another field: as it came.
            out.extend_from_slice(event);
            return Ok(());
        };
        if payload == b"[DONE]" {
            if self.leg == Leg::Continuation {
                self.usage(out);
            }
            out.extend_from_slice(event);
            return Ok(());
        }
        if self.lost.is_some() && self.leg == Leg::First {
            self.relay_first(event, out);
            return Ok(());
        }
        let value: Value = serde_json::from_slice(payload)
            .map_err(|err| Garbage(format!("the engine sent an event that is not JSON: {err}")))?;
        if value.get("error").is_some_and(|e| !e.is_null()) {
            self.lost = Some("the engine sent an error event".into());
            out.extend_from_slice(event);
            return Ok(());
        }
        match self.leg {
            Leg::First => {
                self.first_leg(&value)?;
                self.relay_first(event, out);
            }
            Leg::Continuation => self.continued(&value, out)?,
        }
        Ok(())
    }

    fn relay_first(&self, event: &[u8], out: &mut Vec<u8>) {
        if self.client_wants_ids {
            out.extend_from_slice(event);
        } else {
            null_ids(event, out);
        }
    }

    fn ids(&self, value: &Value, what: &str, room: usize) -> Result<Vec<u32>, Garbage> {
        let Value::Array(items) = value else {
            return Err(Garbage(format!("the engine's `{what}` is not a list")));
        };
        if items.len() > room {
            return Err(Garbage(format!(
                "the engine sent more `{what}` than the request allows ({room})"
            )));
        }
        items
            .iter()
            .map(|item| {
                item.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| {
                        Garbage(format!(
                            "the engine's `{what}` holds {item}, not a token id"
                        ))
                    })
            })
            .collect()
    }

    fn room(&self) -> usize {
        let budget = self
            .budget
            .map_or(MAX_IDS, |b| usize::try_from(b).unwrap_or(MAX_IDS))
            .min(MAX_IDS);
        budget.saturating_sub(self.generated.len())
    }

    fn first_leg(&mut self, value: &Value) -> Result<(), Garbage> {
        if self.id.is_none() {
            self.id = value.get("id").cloned();
            self.created = value.get("created").cloned();
            self.model = value.get("model").cloned();
        }
        let choices = value.get("choices").and_then(Value::as_array);
        let choice = choices.and_then(|c| c.first());
        if choices.is_some_and(|c| c.len() > 1) {
            self.lost = Some("the engine sent more than one choice".into());
            return Ok(());
        }
        if !self.prompt_seen {
            let prompt = if self.chat {
                value.get("prompt_token_ids")
            } else {
                choice.and_then(|c| c.get("prompt_token_ids"))
            };
            if let Some(prompt) = prompt.filter(|p| !p.is_null()) {
                self.prompt = self.ids(prompt, "prompt_token_ids", MAX_IDS)?;
                self.prompt_seen = true;
            }
        }
        let Some(choice) = choice else {
            return Ok(());
        };
        if self.chat {
            if let Some(delta) = choice.get("delta").and_then(Value::as_object) {
                if let Some((key, _)) = delta
                    .iter()
                    .find(|(k, v)| !v.is_null() && k.as_str() != "role" && k.as_str() != "content")
                {
                    self.lost = Some(format!("the engine's answer carries `{key}`"));
                    return Ok(());
                }
                self.role_sent |= delta.contains_key("role");
            }
        }
        match choice.get("token_ids") {
            Some(ids) if !ids.is_null() => {
                let room = self.room();
                let ids = self.ids(ids, "token_ids", room)?;
                self.generated.extend_from_slice(&ids);
            }
            _ => {
                let text = if self.chat {
                    choice.pointer("/delta/content")
                } else {
                    choice.get("text")
                };
                if text.and_then(Value::as_str).is_some_and(|t| !t.is_empty()) {
                    self.lost = Some("the engine does not return token ids".into());
                }
            }
        }
        if choice.get("finish_reason").is_some_and(|f| !f.is_null()) {
            self.finished = true;
        }
        if value.get("usage").is_some_and(|u| !u.is_null()) {
            self.usage_sent = true;
        }
        Ok(())
    }

    fn head(&self) -> Map<String, Value> {
        let mut head = Map::new();
        head.insert("id".into(), self.id.clone().unwrap_or(Value::Null));
        let object = if self.chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        head.insert("object".into(), Value::from(object));
        head.insert(
            "created".into(),
            self.created.clone().unwrap_or(Value::Null),
        );
        head.insert("model".into(), self.model.clone().unwrap_or(Value::Null));
        head
    }

    fn push_event(out: &mut Vec<u8>, value: Map<String, Value>) {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(Value::Object(value).to_string().as_bytes());
        out.extend_from_slice(b"\n\n");
    }

    fn ids_value(&self, ids: &[u32]) -> Value {
        if self.client_wants_ids {
            json!(ids)
        } else {
            Value::Null
        }
    }

    fn usage(&mut self, out: &mut Vec<u8>) {
        if !self.client_usage || self.usage_sent {
            return;
        }
        self.usage_sent = true;
        let (p, n) = (self.prompt.len() as u64, self.generated.len() as u64);
        let mut chunk = self.head();
        chunk.insert("choices".into(), json!([]));
        chunk.insert(
            "usage".into(),
            json!({"prompt_tokens": p, "total_tokens": p + n, "completion_tokens": n}),
        );
        Self::push_event(out, chunk);
    }

    /// A continuation's chunk, reshaped into the client's stream.
    fn continued(&mut self, value: &Value, out: &mut Vec<u8>) -> Result<(), Garbage> {
        let Some(choice) = value
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|c| c.first())
        else {
            // The continuation's own usage chunk: the client's is counted over every leg.
            return Ok(());
        };
        let text = choice.get("text").and_then(Value::as_str).unwrap_or("");
        let room = self.room();
        let ids = match choice.get("token_ids") {
            Some(ids) if !ids.is_null() => self.ids(ids, "token_ids", room)?,
            _ if text.is_empty() => Vec::new(),
            _ => {
                return Err(Garbage(
                    "the engine continuing the stream does not return token ids".into(),
                ))
            }
        };
        let finish = choice.get("finish_reason").cloned().unwrap_or(Value::Null);
        let stop = choice.get("stop_reason").cloned().unwrap_or(Value::Null);
        if text.is_empty() && ids.is_empty() && finish.is_null() {
            return Ok(());
        }
        self.generated.extend_from_slice(&ids);
        self.finished |= !finish.is_null();
        if self.chat && !self.role_sent {
            self.role_sent = true;
            let mut chunk = self.head();
            chunk.insert(
                "choices".into(),
                json!([{"index": 0, "delta": {"role": "assistant", "content": ""},
                        "logprobs": null, "finish_reason": null}]),
            );
            chunk.insert("prompt_token_ids".into(), self.ids_value(&self.prompt));
            Self::push_event(out, chunk);
        }
        let mut chunk = self.head();
        let choice = if self.chat {
            json!({"index": 0, "delta": {"content": text}, "logprobs": null,
                   "finish_reason": finish, "stop_reason": stop,
                   "token_ids": self.ids_value(&ids)})
        } else {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish,
                   "stop_reason": stop, "prompt_token_ids": null,
                   "token_ids": self.ids_value(&ids)})
        };
        chunk.insert("choices".into(), json!([choice]));
        Self::push_event(out, chunk);
        Ok(())
    }
}

/// `json` with the values of the keys `prompt_token_ids` and `token_ids` that are lists of
/// numbers replaced by `null`, every other byte as it was: what vLLM sends when token ids are
/// not asked for.
pub fn null_ids(json: &[u8], out: &mut Vec<u8>) {
    const KEYS: [&[u8]; 2] = [b"prompt_token_ids", b"token_ids"];
    let mut i = 0;
    let mut copied = 0;
    while i < json.len() {
        if json[i] != b'"' {
            i += 1;
            continue;
        }
        // A string: find its end.
        let start = i + 1;
        let mut j = start;
        while j < json.len() && json[j] != b'"' {
            j += if json[j] == b'\\' { 2 } else { 1 };
        }
        if j >= json.len() {
            break;
        }
        let key = &json[start..j];
        i = j + 1;
        if !KEYS.contains(&key) {
            continue;
        }
        let mut k = i;
        while k < json.len() && json[k].is_ascii_whitespace() {
            k += 1;
        }
        if json.get(k) != Some(&b':') {
            continue;
        }
        k += 1;
        while k < json.len() && json[k].is_ascii_whitespace() {
            k += 1;
        }
        if json.get(k) != Some(&b'[') {
            continue;
        }
        let Some(len) = json[k..].iter().position(|&b| b == b']') else {
            break;
        };
        let list = &json[k + 1..k + len];
        if !list
            .iter()
            .all(|b| b.is_ascii_digit() || *b == b',' || b.is_ascii_whitespace())
        {
            continue;
        }
        out.extend_from_slice(&json[copied..k]);
        out.extend_from_slice(b"null");
        copied = k + len + 1;
        i = copied;
    }
    out.extend_from_slice(&json[copied..]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request;

    fn parsed(endpoint: Endpoint, body: Value) -> Parsed {
        request::parse(endpoint, body.to_string().as_bytes()).expect("parses")
    }

    #[test]
    fn id_lists_become_null_and_nothing_else_changes() {
        let text = br#"{"id":"x","choices":[{"text":"\"token_ids\":[1]","prompt_token_ids":[1, 2],"token_ids":[3]}],"token_ids":null}"#;
        let mut out = Vec::new();
        null_ids(text, &mut out);
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r#"{"id":"x","choices":[{"text":"\"token_ids\":[1]","prompt_token_ids":null,"token_ids":null}],"token_ids":null}"#
        );
    }

    #[test]
    fn what_cannot_be_continued_exactly_is_refused_with_its_reason() {
        let ok = parsed(
            Endpoint::Completions,
            json!({"model": "m", "prompt": "x", "stream": true, "temperature": 0, "seed": 3,
                   "max_tokens": 5, "stream_options": {"include_usage": true}}),
        );
        assert_eq!(refusal(Endpoint::Completions, &ok), None);
        for (body, says) in [
            (json!({"model": "m", "prompt": "x", "n": 2}), "`n`"),
            (
                json!({"model": "m", "prompt": "x", "logprobs": 1}),
                "`logprobs`",
            ),
            (json!({"model": "m", "prompt": ["a", "b"]}), "batch"),
            (
                json!({"model": "m", "prompt": "x", "stop": ["\n"]}),
                "`stop`",
            ),
            (json!({"model": "m", "prompt": "x", "seed": 1}), "`seed`"),
            (
                json!({"model": "m", "prompt": "x", "presence_penalty": 0.5}),
                "presence",
            ),
            (
                json!({"model": "m", "prompt": "x", "guided_json": {}}),
                "`guided_json`",
            ),
        ] {
            let why = refusal(Endpoint::Completions, &parsed(Endpoint::Completions, body))
                .expect("refused");
            assert!(why.contains(says), "{why}");
        }
        let chat = parsed(
            Endpoint::ChatCompletions,
            json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
                   "tools": [{"type": "function"}]}),
        );
        assert!(refusal(Endpoint::ChatCompletions, &chat).is_some());
    }

    #[test]
    fn garbage_ids_are_an_error_and_the_budget_bounds_them() {
        let p = parsed(
            Endpoint::Completions,
            json!({"model": "m", "prompt": "x", "stream": true, "max_tokens": 2}),
        );
        let plan = Plan {
            limit: 1,
            client_wants_ids: false,
        };
        let event = |ids: &str| {
            format!(
                "data: {{\"id\":\"c\",\"choices\":[{{\"index\":0,\"text\":\"a\",\
                 \"prompt_token_ids\":[7],\"token_ids\":{ids}}}]}}\n\n"
            )
        };
        for (ids, says) in [
            ("[-1]", "not a token id"),
            ("[1,2,3]", "more"),
            ("7", "not a list"),
        ] {
            let mut t = Tracker::new(Endpoint::Completions, &p, &plan);
            let err = t.feed(event(ids).as_bytes()).expect_err("garbage");
            assert!(err.0.contains(says), "{err}");
        }
        let mut t = Tracker::new(Endpoint::Completions, &p, &plan);
        // Split anywhere: nothing comes out before the event's end.
        let whole = event("[9]");
        let (a, b) = whole.as_bytes().split_at(20);
        assert!(t.feed(a).expect("part").is_empty());
        let out = t.feed(b).expect("rest");
        assert!(std::str::from_utf8(&out)
            .unwrap()
            .contains("\"token_ids\":null"));
        assert_eq!(t.generated, [9]);
        assert!(t.movable().is_ok());
        assert!(t.feed(b"data: {not json}\n\n").is_err());
        let mut t = Tracker::new(Endpoint::Completions, &p, &plan);
        let big = vec![b'x'; EVENT_LIMIT + 1];
        assert!(t.feed(&big).is_err());
    }
}
