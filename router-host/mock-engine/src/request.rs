//! Reading an OpenAI request body the way the engine needs it: the model, whether to stream,
//! the prompt(s) and the fields the answer depends on. The engine's own reading, not the
//! router's: a router bug in parsing must not be mirrored by the engine it is tested against.

use serde_json::{Map, Value};

/// One prompt of a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    /// Chat messages, each an object with a string `role`.
    Chat(Vec<Value>),
}

/// A request body, read.
#[derive(Debug)]
pub struct Request {
    pub model: String,
    pub stream: bool,
    /// At least one.
    pub prompts: Vec<Prompt>,
    pub cache_salt: Option<String>,
    pub body: Map<String, Value>,
}

impl Request {
    pub fn prompt(&self) -> &Prompt {
        // `read` never returns an empty list; an empty text stands in all the same.
        static EMPTY: Prompt = Prompt::Text(String::new());
        self.prompts.first().unwrap_or(&EMPTY)
    }

    /// `chat_template` rendering's `add_generation_prompt`, vLLM's default true.
    pub fn add_generation_prompt(&self) -> bool {
        self.body
            .get("add_generation_prompt")
            .and_then(Value::as_bool)
            .unwrap_or(true)
    }

    /// `stream_options.include_usage`.
    pub fn include_usage(&self) -> bool {
        self.body
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            == Some(true)
    }

    /// `max_tokens` (or chat's `max_completion_tokens`), vLLM's default 16 when absent.
    pub fn max_tokens(&self) -> Result<u64, String> {
        let value = self
            .body
            .get("max_completion_tokens")
            .filter(|v| !v.is_null())
            .or_else(|| self.body.get("max_tokens").filter(|v| !v.is_null()));
        match value {
            None => Ok(16),
            Some(v) => match v.as_u64() {
                Some(n) if n >= 1 => Ok(n),
                _ => Err(format!(
                    "max_tokens must be an integer of at least 1, got {v}"
                )),
            },
        }
    }
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

fn token_ids(items: &[Value], at: &str) -> Result<Vec<u32>, String> {
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            item.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| {
                    format!("`{at}[{i}]` must be a token id from 0 to 4294967295, found {item}")
                })
        })
        .collect()
}

/// A completion's `prompt`: a string, a list of strings, a list of token ids or a list of lists
/// of token ids.
fn prompts(value: Option<&Value>) -> Result<Vec<Prompt>, String> {
    match value {
        None | Some(Value::Null) => Err("`prompt` is required".into()),
        Some(Value::String(text)) => Ok(vec![Prompt::Text(text.clone())]),
        Some(Value::Array(items)) => match items.first() {
            None => Err("`prompt` must not be an empty list".into()),
            Some(Value::Number(_)) => Ok(vec![Prompt::Tokens(token_ids(items, "prompt")?)]),
            Some(_) => items
                .iter()
                .enumerate()
                .map(|(i, item)| match item {
                    Value::String(text) => Ok(Prompt::Text(text.clone())),
                    Value::Array(ids) if !ids.is_empty() => {
                        token_ids(ids, &format!("prompt[{i}]")).map(Prompt::Tokens)
                    }
                    other => Err(format!(
                        "`prompt[{i}]` must be a string or a non-empty list of token ids, found {}",
                        describe(other)
                    )),
                })
                .collect(),
        },
        Some(other) => Err(format!(
            "`prompt` must be a string or a list, found {}",
            describe(other)
        )),
    }
}

fn messages(value: Option<&Value>) -> Result<Vec<Value>, String> {
    let items = match value {
        None | Some(Value::Null) => return Err("`messages` is required".into()),
        Some(Value::Array(items)) if !items.is_empty() => items,
        Some(Value::Array(_)) => return Err("`messages` must not be empty".into()),
        Some(other) => {
            return Err(format!(
                "`messages` must be a list, found {}",
                describe(other)
            ))
        }
    };
    for (i, message) in items.iter().enumerate() {
        if !message.get("role").is_some_and(Value::is_string) {
            return Err(format!(
                "`messages[{i}]` must be an object with a string `role`"
            ));
        }
    }
    Ok(items.clone())
}

/// Read a completion (`chat` false) or chat completion body.
pub fn read(chat: bool, bytes: &[u8]) -> Result<Request, String> {
    let value: Value = serde_json::from_slice(bytes)
        .map_err(|err| format!("request body is not valid JSON: {err}"))?;
    let Value::Object(body) = value else {
        return Err(format!(
            "request body must be a JSON object, found {}",
            describe(&value)
        ));
    };
    let model = match body.get("model") {
        Some(Value::String(model)) if !model.is_empty() => model.clone(),
        Some(other) if !other.is_string() => {
            return Err(format!(
                "`model` must be a string, found {}",
                describe(other)
            ))
        }
        _ => return Err("`model` is required".into()),
    };
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(stream)) => *stream,
        Some(other) => {
            return Err(format!(
                "`stream` must be a boolean, found {}",
                describe(other)
            ))
        }
    };
    let cache_salt = match body.get("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(salt)) => Some(salt.clone()),
        Some(other) => {
            return Err(format!(
                "`cache_salt` must be a string, found {}",
                describe(other)
            ))
        }
    };
    let prompts = if chat {
        vec![Prompt::Chat(messages(body.get("messages"))?)]
    } else {
        prompts(body.get("prompt"))?
    };
    Ok(Request {
        model,
        stream,
        prompts,
        cache_salt,
        body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_of_every_form_and_clear_refusals() {
        let r = read(false, br#"{"model":"m","prompt":[[1,2],[3]]}"#).expect("reads");
        assert_eq!(
            r.prompts,
            vec![Prompt::Tokens(vec![1, 2]), Prompt::Tokens(vec![3])]
        );
        let r = read(false, br#"{"model":"m","prompt":"hi","stream":true}"#).expect("reads");
        assert!(r.stream);
        assert_eq!(r.prompt(), &Prompt::Text("hi".into()));
        for (body, says) in [
            (&br#"[1]"#[..], "JSON object"),
            (br#"{"prompt":"x"}"#, "`model`"),
            (br#"{"model":"m","prompt":[1,-2]}"#, "`prompt[1]`"),
            (br#"{"model":"m","prompt":[]}"#, "empty"),
            (br#"{"model":"m","prompt":"x","stream":1}"#, "`stream`"),
            (
                br#"{"model":"m","prompt":"x","cache_salt":3}"#,
                "`cache_salt`",
            ),
        ] {
            let err = read(false, body).expect_err("refused");
            assert!(err.contains(says), "{err}");
        }
        let err =
            read(true, br#"{"model":"m","messages":[{"content":"x"}]}"#).expect_err("no role");
        assert!(err.contains("messages[0]"), "{err}");
    }
}
