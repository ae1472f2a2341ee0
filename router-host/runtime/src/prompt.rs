//! What a request asks of an engine, whatever front end received it: the engine endpoint
//! (vLLM's OpenAI-compatible API), the prompts to tokenize for routing, and the body as
//! received. `request.rs` parses and checks the OpenAI bodies into these.

use serde_json::{Map, Value};

/// Which OpenAI endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Endpoint {
    Completions,
    ChatCompletions,
    Models,
}

impl Endpoint {
    /// The metrics label.
    pub fn label(self) -> &'static str {
        match self {
            Endpoint::Completions => "completions",
            Endpoint::ChatCompletions => "chat_completions",
            Endpoint::Models => "models",
        }
    }

    /// The engine path the request is forwarded to.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::ChatCompletions => "/v1/chat/completions",
            Endpoint::Models => "/v1/models",
        }
    }
}

/// What has to be tokenized for routing: one prompt.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// A completion prompt as text (one of a list of strings, or the string).
    Text(String),
    /// A completion prompt given as token ids (the list of ids, or one of a list of lists).
    Tokens(Vec<u32>),
    /// Chat messages (validated to be a non-empty list of objects with a string `role`).
    Chat(Vec<Value>),
}

impl Prompt {
    /// The ids of a prompt given as token ids (`None`: text or chat, to be tokenized).
    pub fn token_ids(&self) -> Option<&[u32]> {
        match self {
            Prompt::Tokens(ids) => Some(ids),
            Prompt::Text(_) | Prompt::Chat(_) => None,
        }
    }
}

/// A parsed request body.
#[derive(Debug, Clone)]
pub struct Parsed {
    pub endpoint: Endpoint,
    pub model: String,
    pub stream: bool,
    /// The chat messages, or the completion's prompt (the first one of a batch).
    pub prompt: Prompt,
    /// A batched completion's prompts after the first, in order (empty for a single prompt, a
    /// list of one, and chat). Kept apart from `prompt` so code that reads one prompt reads the
    /// first, as vLLM's own `/tokenize` does.
    pub more_prompts: Vec<Prompt>,
    /// The body as received (its fields are passed to `/tokenize` for chat requests).
    pub body: Map<String, Value>,
    /// vLLM's `cache_salt`, part of the block ids' root.
    pub cache_salt: Option<String>,
}

impl Parsed {
    /// Every prompt, in order: the one of a chat or single-prompt request, each of a batch's.
    pub fn prompts(&self) -> impl Iterator<Item = &Prompt> + Clone {
        std::iter::once(&self.prompt).chain(&self.more_prompts)
    }

    /// How many prompts the request has (1 but for a batched completion).
    pub fn prompt_count(&self) -> usize {
        1 + self.more_prompts.len()
    }
}

/// The text of one chat message's content for a local chat template: a string as is, a list of
/// content parts as its `text` parts joined by newlines (as vLLM does for string-content
/// templates), null as empty.
pub fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|part| match part {
                Value::String(text) => Some(text.as_str()),
                Value::Object(o) => o.get("text").and_then(Value::as_str),
                _ => None,
            })
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}
