//! A prompt's tokens (local or remote tokenizer, inline or off the async worker) and the body
//! rewritten with them under `serve.forward_token_ids`.

use axum::body::Bytes;

use crate::serve::app::App;
use crate::serve::errors::ApiError;
use crate::serve::request::{self, Endpoint, Parsed, Prompt};
use crate::serve::state::LoadedConfig;
use crate::serve::tokenize::{self, TokenizeError, Tokens};

/// The bytes of text a prompt gives the tokenizer (chat: its messages' contents, plus a little
/// per message for the template); 0 for token ids.
fn text_bytes(prompt: &Prompt) -> usize {
    match prompt {
        Prompt::Text(text) => text.len(),
        Prompt::Tokens(_) => 0,
        Prompt::Chat(messages) => messages
            .iter()
            .map(|m| request::content_text(m.get("content")).len() + 8)
            .sum(),
    }
}

/// A rough token count for a prompt that could not be tokenized (routing without overlap).
pub(super) fn estimate_tokens(prompt: &Prompt) -> u64 {
    match prompt {
        Prompt::Tokens(ids) => ids.len() as u64,
        _ => (text_bytes(prompt) as u64).div_ceil(4),
    }
}

/// Requests with more text than this are tokenized off the async worker: a 64 KiB prompt takes
/// a few milliseconds (serve/words.rs), one near `max_body_bytes` up to seconds, and a worker
/// held that long holds every request queued on it.
const INLINE_TOKENIZE_BYTES: usize = 64 << 10;

/// Every prompt's tokens, in order (one entry but for a batched completion); `Ok(None)` when
/// the remote tokenizer is unavailable for any of them (counted and logged: the request is
/// routed without overlap).
pub(super) async fn tokens_for(
    app: &App,
    loaded: &LoadedConfig,
    parsed: &Parsed,
) -> Result<Option<Vec<Tokens>>, ApiError> {
    let given: Option<Vec<Tokens>> = parsed
        .prompts()
        .map(|prompt| prompt.token_ids().map(Tokens::given))
        .collect();
    if given.is_some() {
        return Ok(given);
    }
    if let Some(local) = &loaded.tokenizer {
        let tokenize = || local.tokenize_all(parsed);
        let tokens = if parsed.prompts().map(text_bytes).sum::<usize>() > INLINE_TOKENIZE_BYTES {
            crate::session_store::blocking(tokenize)
        } else {
            tokenize()
        };
        return tokens.map(Some).map_err(ApiError::from);
    }
    let Some(upstream) = app.tokenizer_upstream(loaded) else {
        app.metrics.tokenize_fallbacks.inc();
        return Ok(None);
    };
    let timeout = loaded.serve.timeouts.tokenize;
    let target = tokenize::TokenizeTarget {
        client: &loaded.client,
        base: &upstream.base,
        worker: upstream.id,
        metrics: Some(&app.metrics),
        answer_limit: crate::serve::engine_calls::tokenize_answer_limit(
            loaded.serve.max_body_bytes,
        ),
        turns: Some(&upstream.tokenize_turns),
    };
    match tokenize::remote_all(&target, parsed, timeout).await {
        Ok(tokens) => Ok(Some(tokens)),
        Err(err @ (TokenizeError::Invalid(_) | TokenizeError::TooLarge(_))) => {
            Err(ApiError::from(err))
        }
        Err(TokenizeError::Unavailable(message)) => {
            app.metrics.tokenize_fallbacks.inc();
            tracing::warn!(
                worker = upstream.id,
                error = %message,
                "remote tokenization failed; routing without prompt overlap"
            );
            Ok(None)
        }
    }
}

/// `serve.forward_token_ids`: the body with a completion's text prompt replaced by its token ids
/// (vLLM takes `prompt` as ids), and a list of text prompts by the list of their id lists, so
/// the engine skips its own tokenization. `ids` holds each prompt's ids, in order. `None` (the
/// body goes as received) for chat, ids already, or prompts not tokenized.
pub(super) fn with_token_ids(
    endpoint: Endpoint,
    parsed: &Parsed,
    ids: &[Vec<u32>],
) -> Option<Bytes> {
    use serde_json::Value;
    if endpoint != Endpoint::Completions
        || ids.len() != parsed.prompt_count()
        || ids.iter().any(Vec::is_empty)
    {
        return None;
    }
    let prompt = match (parsed.body.get("prompt"), ids) {
        (Some(Value::String(_)), [one]) => Value::from(one.clone()),
        (Some(Value::Array(texts)), _) if texts.iter().all(Value::is_string) => {
            Value::from(ids.to_vec())
        }
        _ => return None,
    };
    let mut body = parsed.body.clone();
    body.insert("prompt".to_owned(), prompt);
    serde_json::to_vec(&body).ok().map(Bytes::from)
}
