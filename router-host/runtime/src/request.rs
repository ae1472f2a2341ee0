//! The OpenAI request bodies `serve` reads: just enough of `/v1/completions` and
//! `/v1/chat/completions` to tokenize the prompt, find the session and refuse hostile input.
//! The body itself is forwarded to the engine unchanged.

use hyper::http::HeaderMap;
use serde_json::{Map, Value};

use super::errors::ApiError;
pub use super::prompt::{content_text, Endpoint, Parsed, Prompt};
use router_config::ServeConfig;
use router_core::sessions::MAX_SESSION_ID_BYTES;

fn wrong_type(param: &'static str, expected: &str, found: &Value) -> ApiError {
    ApiError::bad_request(
        "invalid_type",
        format!("`{param}` must be {expected}, found {}", describe(found)),
    )
    .param(param)
}

fn describe(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A token id: an integer from 0 to 2^32 - 1.
fn token_id(value: &Value) -> Option<u32> {
    value.as_u64().and_then(|n| u32::try_from(n).ok())
}

/// The ids of a list of token ids at `where_` (`prompt` or `prompt[i]`), or a 400 naming the
/// first element that is not one.
fn token_list(items: &[Value], where_: &str) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            token_id(item).ok_or_else(|| {
                let found = match item {
                    Value::Number(n) => n.to_string(),
                    other => describe(other).to_owned(),
                };
                ApiError::bad_request(
                    "invalid_value",
                    format!(
                        "`{where_}` token ids must be integers from 0 to 4294967295; \
                         `{where_}[{i}]` is {found}"
                    ),
                )
                .param("prompt")
            })
        })
        .collect()
}

/// Every prompt of a completion request: a string, a list of strings, a list of token ids or a
/// list of lists of token ids, as vLLM accepts them (a list of one is the same as one prompt).
/// A list's items must all be of its first item's kind.
fn completion_prompts(value: Option<&Value>) -> Result<Vec<Prompt>, ApiError> {
    const EXPECTED: &str =
        "a string, a list of strings, a list of token ids or a list of lists of token ids";
    let value = match value {
        None | Some(Value::Null) => {
            return Err(
                ApiError::bad_request("missing_field", "`prompt` is required").param("prompt"),
            )
        }
        Some(value) => value,
    };
    let empty = |where_: &str| {
        ApiError::bad_request(
            "invalid_value",
            format!("`{where_}` must not be an empty list"),
        )
        .param("prompt")
    };
    let unlike_the_first = |i: usize, kind: &str, found: &Value| {
        ApiError::bad_request(
            "invalid_type",
            format!(
                "`prompt[{i}]` must be {kind} like `prompt[0]` (a batch's prompts are all of one \
                 kind), found {}",
                describe(found)
            ),
        )
        .param("prompt")
    };
    match value {
        Value::String(text) => Ok(vec![Prompt::Text(text.clone())]),
        Value::Array(items) => match items.first() {
            None => Err(empty("prompt")),
            Some(Value::String(_)) => items
                .iter()
                .enumerate()
                .map(|(i, item)| match item {
                    Value::String(text) => Ok(Prompt::Text(text.clone())),
                    other => Err(unlike_the_first(i, "a string", other)),
                })
                .collect(),
            Some(Value::Number(_)) => Ok(vec![Prompt::Tokens(token_list(items, "prompt")?)]),
            Some(Value::Array(_)) => items
                .iter()
                .enumerate()
                .map(|(i, item)| match item {
                    Value::Array(ids) if ids.is_empty() => Err(empty(&format!("prompt[{i}]"))),
                    Value::Array(ids) => {
                        token_list(ids, &format!("prompt[{i}]")).map(Prompt::Tokens)
                    }
                    other => Err(unlike_the_first(i, "a list of token ids", other)),
                })
                .collect(),
            Some(_) => Err(wrong_type("prompt", EXPECTED, value)),
        },
        other => Err(wrong_type("prompt", EXPECTED, other)),
    }
}

fn chat_messages(value: Option<&Value>) -> Result<Prompt, ApiError> {
    let items = match value {
        None | Some(Value::Null) => {
            return Err(
                ApiError::bad_request("missing_field", "`messages` is required").param("messages"),
            )
        }
        Some(Value::Array(items)) => items,
        Some(other) => return Err(wrong_type("messages", "a list of message objects", other)),
    };
    if items.is_empty() {
        return Err(
            ApiError::bad_request("invalid_value", "`messages` must not be empty")
                .param("messages"),
        );
    }
    for (index, message) in items.iter().enumerate() {
        let Some(object) = message.as_object() else {
            return Err(ApiError::bad_request(
                "invalid_type",
                format!(
                    "`messages[{index}]` must be an object, found {}",
                    describe(message)
                ),
            )
            .param("messages"));
        };
        match object.get("role") {
            Some(Value::String(_)) => {}
            other => {
                return Err(ApiError::bad_request(
                    "invalid_type",
                    format!(
                        "`messages[{index}].role` must be a string, found {}",
                        other.map_or("nothing", describe)
                    ),
                )
                .param("messages"))
            }
        }
        match object.get("content") {
            None | Some(Value::Null | Value::String(_) | Value::Array(_)) => {}
            Some(other) => {
                return Err(ApiError::bad_request(
                    "invalid_type",
                    format!(
                        "`messages[{index}].content` must be a string, a list of content parts \
                         or null, found {}",
                        describe(other)
                    ),
                )
                .param("messages"))
            }
        }
    }
    Ok(Prompt::Chat(items.clone()))
}

/// Parse and check a request body for `endpoint` (completions or chat completions).
pub fn parse(endpoint: Endpoint, bytes: &[u8]) -> Result<Parsed, ApiError> {
    let value: Value = serde_json::from_slice(bytes).map_err(|err| {
        ApiError::bad_request(
            "invalid_json",
            format!("request body is not valid JSON: {err}"),
        )
    })?;
    let Value::Object(body) = value else {
        return Err(ApiError::bad_request(
            "invalid_type",
            format!(
                "request body must be a JSON object, found {}",
                describe(&value)
            ),
        ));
    };
    let model = match body.get("model") {
        Some(Value::String(model)) if !model.is_empty() => model.clone(),
        Some(Value::String(_)) => {
            return Err(
                ApiError::bad_request("invalid_value", "`model` must not be empty").param("model"),
            )
        }
        None | Some(Value::Null) => {
            return Err(
                ApiError::bad_request("missing_field", "`model` is required").param("model"),
            )
        }
        Some(other) => return Err(wrong_type("model", "a string", other)),
    };
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(stream)) => *stream,
        Some(other) => return Err(wrong_type("stream", "a boolean", other)),
    };
    for field in ["user", "cache_salt"] {
        match body.get(field) {
            None | Some(Value::Null | Value::String(_)) => {}
            Some(other) => {
                let param = if field == "user" {
                    "user"
                } else {
                    "cache_salt"
                };
                return Err(wrong_type(param, "a string", other));
            }
        }
    }
    match body.get("stream_options") {
        None | Some(Value::Null | Value::Object(_)) => {}
        Some(other) => return Err(wrong_type("stream_options", "an object", other)),
    }
    let (prompt, more_prompts) = match endpoint {
        Endpoint::Completions => {
            let mut prompts = completion_prompts(body.get("prompt"))?.into_iter();
            match prompts.next() {
                Some(first) => (first, prompts.collect()),
                None => return Err(ApiError::internal("a parsed `prompt` has no prompt")),
            }
        }
        Endpoint::ChatCompletions | Endpoint::Models => {
            (chat_messages(body.get("messages"))?, Vec::new())
        }
    };
    let cache_salt = body
        .get("cache_salt")
        .and_then(Value::as_str)
        .map(str::to_owned);
    Ok(Parsed {
        endpoint,
        model,
        stream,
        prompt,
        more_prompts,
        body,
        cache_salt,
    })
}

/// The session id: the first configured header present, then the first configured body field
/// holding a string. An empty value is skipped; one over the session-id limit is refused.
pub fn session_id(
    headers: &HeaderMap,
    body: &Map<String, Value>,
    serve: &ServeConfig,
) -> Result<Option<String>, ApiError> {
    let too_long = |len: usize, source: &str| {
        ApiError::bad_request(
            "invalid_session_id",
            format!(
                "session id from {source} is {len} bytes, over the {MAX_SESSION_ID_BYTES}-byte \
                 limit"
            ),
        )
    };
    for name in &serve.session_headers {
        if let Some(value) = headers.get(name.as_str()) {
            let Ok(text) = value.to_str() else {
                return Err(ApiError::bad_request(
                    "invalid_session_id",
                    format!("header `{name}` is not visible ASCII"),
                ));
            };
            let text = text.trim();
            if text.is_empty() {
                continue;
            }
            if text.len() > MAX_SESSION_ID_BYTES {
                return Err(too_long(text.len(), &format!("header `{name}`")));
            }
            return Ok(Some(text.to_owned()));
        }
    }
    for field in &serve.session_body_fields {
        if let Some(Value::String(text)) = body.get(field.as_str()) {
            if text.is_empty() {
                continue;
            }
            if text.len() > MAX_SESSION_ID_BYTES {
                return Err(too_long(text.len(), &format!("body field `{field}`")));
            }
            return Ok(Some(text.clone()));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every prompt of a completions body, in order.
    fn prompts(body: &str) -> Result<Vec<Prompt>, ApiError> {
        parse(Endpoint::Completions, body.as_bytes()).map(|p| p.prompts().cloned().collect())
    }

    #[test]
    fn prompts_in_every_shape_vllm_accepts() {
        let text = |t: &str| Prompt::Text(t.into());
        assert_eq!(
            prompts(r#"{"model":"m","prompt":"hi"}"#).unwrap(),
            [text("hi")]
        );
        assert_eq!(
            prompts(r#"{"model":"m","prompt":["a","b",""]}"#).unwrap(),
            [text("a"), text("b"), text("")]
        );
        assert_eq!(
            prompts(r#"{"model":"m","prompt":[1,2,3]}"#).unwrap(),
            [Prompt::Tokens(vec![1, 2, 3])]
        );
        assert_eq!(
            prompts(r#"{"model":"m","prompt":[[4,5],[6],[4294967295]]}"#).unwrap(),
            [
                Prompt::Tokens(vec![4, 5]),
                Prompt::Tokens(vec![6]),
                Prompt::Tokens(vec![u32::MAX])
            ]
        );
        // The first prompt is `prompt`, the others `more_prompts`; chat has one.
        let batch = parse(
            Endpoint::Completions,
            br#"{"model":"m","prompt":["a","b"]}"#,
        )
        .unwrap();
        assert_eq!(batch.prompt_count(), 2);
        assert_eq!(
            (batch.prompt, batch.more_prompts),
            (text("a"), vec![text("b")])
        );
        let chat = parse(
            Endpoint::ChatCompletions,
            br#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#,
        )
        .unwrap();
        assert_eq!((chat.prompt_count(), chat.more_prompts.len()), (1, 0));
    }

    #[test]
    fn a_list_of_one_is_the_same_as_one_prompt() {
        let one = |body: &str| {
            let parsed = parse(Endpoint::Completions, body.as_bytes()).unwrap();
            assert_eq!(parsed.prompt_count(), 1, "{body}");
            parsed.prompt
        };
        assert_eq!(
            one(r#"{"model":"m","prompt":["hi"]}"#),
            one(r#"{"model":"m","prompt":"hi"}"#)
        );
        assert_eq!(
            one(r#"{"model":"m","prompt":[[7,8]]}"#),
            one(r#"{"model":"m","prompt":[7,8]}"#)
        );
    }

    #[test]
    fn bad_prompts_are_refused_naming_the_prompt_and_the_item() {
        for (bad, code, says) in [
            (r#"{"model":"m","prompt":[]}"#, "invalid_value", "`prompt` must not be an empty list"),
            (
                r#"{"model":"m","prompt":[1,-2]}"#,
                "invalid_value",
                "`prompt` token ids must be integers from 0 to 4294967295; `prompt[1]` is -2",
            ),
            (r#"{"model":"m","prompt":[1,"a"]}"#, "invalid_value", "`prompt[1]` is a string"),
            (r#"{"model":"m","prompt":[4294967296]}"#, "invalid_value", "`prompt[0]` is 4294967296"),
            (r#"{"model":"m","prompt":[[1],[]]}"#, "invalid_value", "`prompt[1]` must not be an empty list"),
            (r#"{"model":"m","prompt":[[]]}"#, "invalid_value", "`prompt[0]` must not be an empty list"),
            (
                r#"{"model":"m","prompt":[[1],[2,1.5]]}"#,
                "invalid_value",
                "`prompt[1]` token ids must be integers from 0 to 4294967295; `prompt[1][1]` is 1.5",
            ),
            // Mixed kinds in one batch.
            (
                r#"{"model":"m","prompt":["a",1]}"#,
                "invalid_type",
                "`prompt[1]` must be a string like `prompt[0]`",
            ),
            (
                r#"{"model":"m","prompt":["a","b",["c"]]}"#,
                "invalid_type",
                "`prompt[2]` must be a string like `prompt[0]` (a batch's prompts are all of one kind), found an array",
            ),
            (
                r#"{"model":"m","prompt":[[1],"a"]}"#,
                "invalid_type",
                "`prompt[1]` must be a list of token ids like `prompt[0]`",
            ),
            (r#"{"model":"m","prompt":[{"a":1}]}"#, "invalid_type", "`prompt` must be a string"),
            (r#"{"model":"m","prompt":5}"#, "invalid_type", "found a number"),
            (r#"{"model":"m"}"#, "missing_field", "`prompt` is required"),
        ] {
            let err = prompts(bad).unwrap_err();
            assert_eq!(err.status, 400, "{bad}");
            assert_eq!(err.param, Some("prompt"), "{bad}");
            assert_eq!(err.code, code, "{bad}: {}", err.message);
            assert!(err.message.contains(says), "{bad}: {}", err.message);
        }
    }

    #[test]
    fn hostile_bodies_are_refused_with_the_field_named() {
        let e = |body: &str| parse(Endpoint::ChatCompletions, body.as_bytes()).unwrap_err();
        assert_eq!(e("not json").code, "invalid_json");
        assert_eq!(e("[1]").code, "invalid_type");
        assert_eq!(e(r#"{"messages":[]}"#).param, Some("model"));
        assert_eq!(e(r#"{"model":7,"messages":[]}"#).param, Some("model"));
        assert_eq!(
            e(r#"{"model":"m","messages":"hi"}"#).param,
            Some("messages")
        );
        assert_eq!(e(r#"{"model":"m","messages":[]}"#).param, Some("messages"));
        assert_eq!(e(r#"{"model":"m","messages":[1]}"#).param, Some("messages"));
        assert_eq!(
            e(r#"{"model":"m","messages":[{"content":"x"}]}"#).param,
            Some("messages")
        );
        assert_eq!(
            e(r#"{"model":"m","messages":[{"role":"user"}],"stream":"yes"}"#).param,
            Some("stream")
        );
        assert_eq!(
            e(r#"{"model":"m","messages":[{"role":"user"}],"user":1}"#).param,
            Some("user")
        );
    }

    #[test]
    fn session_from_headers_in_order_then_the_body() {
        let serve = ServeConfig::default();
        let mut headers = HeaderMap::new();
        let mut body = Map::new();
        body.insert("user".into(), Value::String("u1".into()));
        assert_eq!(
            session_id(&headers, &body, &serve).unwrap().as_deref(),
            Some("u1")
        );
        headers.insert("x-dynamo-session-id", "d".parse().unwrap());
        assert_eq!(
            session_id(&headers, &body, &serve).unwrap().as_deref(),
            Some("d")
        );
        headers.insert("x-session-id", "s".parse().unwrap());
        assert_eq!(
            session_id(&headers, &body, &serve).unwrap().as_deref(),
            Some("s")
        );
        headers.insert("x-session-id", "x".repeat(300).parse().unwrap());
        assert_eq!(
            session_id(&headers, &body, &serve).unwrap_err().code,
            "invalid_session_id"
        );
    }
}
