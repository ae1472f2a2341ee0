//! The engine's tokenizers: a tokenizer directory (`tokenizer.json` and, for chat, the
//! `chat_template` of `tokenizer_config.json`) the way vLLM uses it, or a built-in byte
//! tokenizer that needs no files.
//!
//! The directory tokenizer is this crate's own code (`tokenizers` and `minijinja` called
//! directly), deliberately not the router's tokenizer: the router tokenizes prompts locally to
//! compute block ids and must agree with the engine's `/tokenize`. Tests compare the two; if
//! the engine shared the router's code, a router bug would be mirrored here and pass unseen.
//!
//! The byte tokenizer makes token `b` of every UTF-8 byte `b`, and renders chat messages as
//! `<|role|>\ncontent\n` each, then `<|assistant|>\n` (with `add_generation_prompt`, the
//! default). It is the default because a laptop demo should need no model files, and because a
//! prompt that extends another one tokenizes to an extension of its tokens, so prefix caching
//! behaves as with a real tokenizer on multi-turn conversations.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::request::{Prompt, Request};

/// Why a tokenizer directory cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("tokenizer directory {}: {message}", dir.display())]
pub struct TokenizerError {
    pub dir: PathBuf,
    pub message: String,
}

/// How the engine turns prompts into token ids.
pub enum Tokenizer {
    /// One token per UTF-8 byte; no files.
    Bytes,
    /// A tokenizer directory.
    Files(Box<FileTokenizer>),
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tokenizer::Bytes => f.write_str("Tokenizer::Bytes"),
            Tokenizer::Files(t) => write!(f, "Tokenizer::Files({})", t.dir.display()),
        }
    }
}

/// A tokenizer directory, loaded.
pub struct FileTokenizer {
    dir: PathBuf,
    tokenizer: tokenizers::Tokenizer,
    /// The chat template as the template named `chat`, when the directory has one.
    chat: Option<minijinja::Environment<'static>>,
    bos: String,
    eos: String,
}

/// A special token of `tokenizer_config.json`: a string or `{"content": ...}`.
fn special(config: &Value, key: &str) -> String {
    match config.get(key) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        _ => String::new(),
    }
}

/// The template text: a string, or the `default` of a list of `{name, template}`.
fn template_text(config: &Value) -> Option<String> {
    match config.get("chat_template")? {
        Value::String(t) => Some(t.clone()),
        Value::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_owned),
        _ => None,
    }
}

impl Tokenizer {
    /// Load a tokenizer directory.
    pub fn load(dir: &Path) -> Result<Tokenizer, TokenizerError> {
        let fail = |message: String| TokenizerError {
            dir: dir.to_path_buf(),
            message,
        };
        let tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json"))
            .map_err(|err| fail(format!("tokenizer.json: {err}")))?;
        let config_path = dir.join("tokenizer_config.json");
        let config: Value = match std::fs::read(&config_path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|err| fail(format!("tokenizer_config.json is not JSON: {err}")))?,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => Value::Null,
            Err(err) => return Err(fail(format!("tokenizer_config.json: {err}"))),
        };
        let chat = match template_text(&config) {
            None => None,
            Some(template) => {
                let mut env = minijinja::Environment::new();
                // Python Jinja's settings as transformers applies them to chat templates.
                let syntax = minijinja::syntax::SyntaxConfig::builder()
                    .trim_blocks(true)
                    .lstrip_blocks(true)
                    .build()
                    .map_err(|err| fail(format!("template syntax: {err}")))?;
                env.set_syntax(syntax);
                env.set_unknown_method_callback(
                    minijinja_contrib::pycompat::unknown_method_callback,
                );
                env.add_function("raise_exception", |message: String| -> Result<String, _> {
                    Err(minijinja::Error::new(
                        minijinja::ErrorKind::InvalidOperation,
                        message,
                    ))
                });
                env.add_template_owned("chat", template)
                    .map_err(|err| fail(format!("chat_template: {err}")))?;
                Some(env)
            }
        };
        Ok(Tokenizer::Files(Box::new(FileTokenizer {
            dir: dir.to_path_buf(),
            tokenizer,
            chat,
            bos: special(&config, "bos_token"),
            eos: special(&config, "eos_token"),
        })))
    }

    /// The prompt's token ids, as `/tokenize` answers and the completion endpoints compute them:
    /// a completion's text with the special tokens added, chat messages rendered by the
    /// template and encoded without (the template writes them), token ids as they are.
    pub fn tokenize(
        &self,
        prompt: &Prompt,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, String> {
        if let Prompt::Tokens(ids) = prompt {
            return Ok(ids.clone());
        }
        match self {
            Tokenizer::Bytes => Ok(match prompt {
                Prompt::Chat(messages) => bytes(&render_chat(messages, add_generation_prompt)),
                Prompt::Text(text) => bytes(text),
                Prompt::Tokens(ids) => ids.clone(),
            }),
            Tokenizer::Files(t) => t.tokenize(prompt, add_generation_prompt),
        }
    }

    /// Tokenize the request's first prompt.
    pub(crate) fn tokenize_request(&self, request: &Request) -> Result<Vec<u32>, String> {
        self.tokenize(request.prompt(), request.add_generation_prompt())
    }

    /// The text of generated token `i` (the model answers the same words to everyone).
    pub fn word(i: u64) -> &'static str {
        WORDS[(i % WORDS.len() as u64) as usize]
    }

    /// The id of generated token `i`: its place in the cycle of `WORDS`, above [`WORD_IDS`].
    pub fn word_id(i: u64) -> u32 {
        WORD_IDS + (i % WORDS.len() as u64) as u32
    }

    /// Where an answer to `prompt` starts in the cycle of words: right after the word the
    /// prompt's last token is, else at the first. A prompt that ends in generated tokens (a
    /// router continuing a stream from the prompt's ids plus the ids generated so far) thus
    /// gets the words the first engine would have gone on with.
    pub fn first_word(prompt: &[u32]) -> u64 {
        match prompt.last() {
            Some(&id) if (WORD_IDS..WORD_IDS + WORDS.len() as u32).contains(&id) => {
                u64::from(id - WORD_IDS) + 1
            }
            _ => 0,
        }
    }
}

/// The words the engine model generates, in a cycle.
const WORDS: [&str; 8] = [
    " the", " cache", " is", " warm", " and", " the", " router", " knows",
];

/// The first generated token's id. Above every vocabulary in use (the largest are about 260k
/// ids) and above a byte: no tokenizer gives one, so only generated tokens end a prompt in one.
pub const WORD_IDS: u32 = 1 << 24;

impl FileTokenizer {
    fn tokenize(&self, prompt: &Prompt, add_generation_prompt: bool) -> Result<Vec<u32>, String> {
        let (text, special_tokens) = match prompt {
            Prompt::Tokens(ids) => return Ok(ids.clone()),
            Prompt::Text(text) => (text.clone(), true),
            Prompt::Chat(messages) => {
                let Some(env) = &self.chat else {
                    return Err("the tokenizer has no chat template".into());
                };
                // vLLM hands a string-content template each message's text parts joined by
                // "\n".
                let messages: Vec<Value> = messages
                    .iter()
                    .map(|m| {
                        let mut m = m.clone();
                        if let Some(Value::Array(parts)) = m.get("content") {
                            let texts: Vec<&str> =
                                parts.iter().filter_map(|p| p["text"].as_str()).collect();
                            m["content"] = Value::String(texts.join("\n"));
                        }
                        m
                    })
                    .collect();
                let template = env
                    .get_template("chat")
                    .map_err(|err| format!("chat template: {err}"))?;
                let text = template
                    .render(minijinja::Value::from(minijinja::value::Serde(json!({
                        "messages": messages,
                        "add_generation_prompt": add_generation_prompt,
                        "bos_token": self.bos,
                        "eos_token": self.eos,
                    }))))
                    .map_err(|err| format!("chat template: {err}"))?;
                (text, false)
            }
        };
        self.tokenizer
            .encode(text, special_tokens)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(|err| format!("cannot tokenize the prompt: {err}"))
    }
}

fn bytes(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// A message's content as text: a string, or its text parts joined by newlines.
fn content_text(content: Option<&Value>) -> String {
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

fn render_chat(messages: &[Value], add_generation_prompt: bool) -> String {
    let mut out = String::new();
    for m in messages {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
        out.push_str(&format!("<|{role}|>\n{}\n", content_text(m.get("content"))));
    }
    if add_generation_prompt {
        out.push_str("<|assistant|>\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::read;

    #[test]
    fn byte_tokens_extend_with_the_conversation() {
        let t = Tokenizer::Bytes;
        let one = read(
            true,
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"add_generation_prompt":false}"#,
        )
        .expect("parses");
        let two = read(
            true,
            br#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":[{"type":"text","text":"yo"}]}]}"#,
        )
        .expect("parses");
        let (a, b) = (
            t.tokenize_request(&one).unwrap(),
            t.tokenize_request(&two).unwrap(),
        );
        assert_eq!(a, bytes("<|user|>\nhi\n"));
        assert!(b.starts_with(&a));
        assert_eq!(b, bytes("<|user|>\nhi\n<|assistant|>\nyo\n<|assistant|>\n"));
        let text = read(false, br#"{"model":"m","prompt":"ab"}"#).unwrap();
        assert_eq!(t.tokenize_request(&text).unwrap(), vec![97, 98]);
        let ids = read(false, br#"{"model":"m","prompt":[7,8]}"#).unwrap();
        assert_eq!(t.tokenize_request(&ids).unwrap(), vec![7, 8]);
    }

    #[test]
    fn a_prompt_ending_in_generated_tokens_goes_on_with_the_next_word() {
        assert_eq!(Tokenizer::first_word(&[]), 0);
        assert_eq!(Tokenizer::first_word(&[97, 98]), 0);
        assert_eq!(Tokenizer::first_word(&[WORD_IDS - 1]), 0);
        assert_eq!(Tokenizer::first_word(&[WORD_IDS + 8]), 0);
        for i in 0..20u64 {
            let next = Tokenizer::first_word(&[97, Tokenizer::word_id(i)]);
            assert_eq!(Tokenizer::word(next), Tokenizer::word(i + 1));
            assert_eq!(Tokenizer::word_id(next), Tokenizer::word_id(i + 1));
        }
    }

    #[test]
    fn a_missing_directory_is_named() {
        let err = Tokenizer::load(Path::new("/nonexistent/tok")).expect_err("no files");
        assert!(err.to_string().contains("/nonexistent/tok"), "{err}");
    }
}
