//! The mock's tokenizers: a real `tokenizer.json` (with its chat template) through the same
//! loader as `serve.tokenizer.path`, or a built-in byte tokenizer that needs no files.
//!
//! The byte tokenizer makes token `b` of every UTF-8 byte `b`, and renders chat messages as
//! `<|role|>\ncontent\n` each, then `<|assistant|>\n` (with `add_generation_prompt`, the
//! default). It is the default because a laptop demo should need no model files, and because a
//! prompt that extends another one tokenizes to an extension of its tokens, so prefix caching
//! behaves as with a real tokenizer on multi-turn conversations.

use std::path::Path;

use router_host::serve::request::{content_text, Parsed, Prompt};
use router_host::serve::tokenize::LocalTokenizer;
use serde_json::Value;

pub enum MockTokenizer {
    Bytes,
    Local(Box<LocalTokenizer>),
}

impl MockTokenizer {
    pub fn load(dir: &Path) -> Result<MockTokenizer, String> {
        LocalTokenizer::load(dir).map(|t| MockTokenizer::Local(Box::new(t)))
    }

    /// The prompt's token ids, as `/tokenize` answers and the completion endpoints compute them.
    pub fn tokenize(&self, parsed: &Parsed) -> Result<Vec<u32>, String> {
        match self {
            MockTokenizer::Local(t) => t
                .tokenize(parsed)
                .map(|tokens| tokens.ids)
                .map_err(|err| err.to_string()),
            MockTokenizer::Bytes => Ok(match &parsed.prompt {
                Prompt::Tokens(ids) => ids.clone(),
                Prompt::Text(text) => bytes(text),
                Prompt::Chat(messages) => {
                    let add = parsed
                        .body
                        .get("add_generation_prompt")
                        .and_then(Value::as_bool)
                        .unwrap_or(true);
                    bytes(&render_chat(messages, add))
                }
            }),
        }
    }

    /// The text of generated token `i` (the mock generates the same words for everyone).
    pub fn word(i: u64) -> &'static str {
        const WORDS: [&str; 8] = [
            " the", " cache", " is", " warm", " and", " the", " router", " knows",
        ];
        WORDS[(i % WORDS.len() as u64) as usize]
    }
}

fn bytes(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
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
    use router_host::serve::request::{parse, Endpoint};

    #[test]
    fn byte_tokens_extend_with_the_conversation() {
        let t = MockTokenizer::Bytes;
        let one = parse(
            Endpoint::ChatCompletions,
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"add_generation_prompt":false}"#,
        )
        .expect("parses");
        let two = parse(
            Endpoint::ChatCompletions,
            br#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":[{"type":"text","text":"yo"}]}]}"#,
        )
        .expect("parses");
        let (a, b) = (t.tokenize(&one).unwrap(), t.tokenize(&two).unwrap());
        assert_eq!(a, bytes("<|user|>\nhi\n"));
        assert!(b.starts_with(&a));
        assert_eq!(b, bytes("<|user|>\nhi\n<|assistant|>\nyo\n<|assistant|>\n"));
        let text = parse(Endpoint::Completions, br#"{"model":"m","prompt":"ab"}"#).unwrap();
        assert_eq!(t.tokenize(&text).unwrap(), vec![97, 98]);
        let ids = parse(Endpoint::Completions, br#"{"model":"m","prompt":[7,8]}"#).unwrap();
        assert_eq!(t.tokenize(&ids).unwrap(), vec![7, 8]);
    }
}
