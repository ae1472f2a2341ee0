//! A request's way from its parsed body to what the routing core is asked, front-end neutral:
//! [`prepare`] runs the steps in order, each a function of its own: the prompt's [`tokens`]
//! (local or remote tokenizer, inline or off the async worker), their [`lengths`], the
//! [`check_limits`] vLLM applies, and the first prompt's block ids ([`blocks`]); then
//! [`with_token_ids`] rewrites the body under `serve.forward_token_ids`. Errors are
//! [`PrepareError`]s, which each front end answers in its own protocol.
//!
//! Tokens are only computed when something reads them ([`PromptIds`], decided once per loaded
//! configuration): with a policy that reads neither cache overlap nor load (round-robin,
//! random), no policy class or limit that counts tokens and no `serve.forward_token_ids`, a
//! request is routed on an estimate of its size and no tokenizer is called.

use std::time::Instant;

use bytes::Bytes;
use plugin_api::abi::Inputs;
use router_config::{RouterConfig, ServeConfig};
use router_core::blocks::{BlockHasher, Tenant};
use router_core::model::RequestRole;
use router_policies::policy_set::PolicySet;

use crate::app::App;
use crate::errors::ApiError;
use crate::prompt::{content_text, Endpoint, Parsed, Prompt};
use crate::state::LoadedConfig;
use crate::tokenize::{self, TokenizeError, Tokens};

/// Why a request cannot be routed as it is; nothing was booked.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// The tokenizer refused the prompt (`Invalid`, `TooLarge`).
    #[error(transparent)]
    Tokenize(TokenizeError),
    /// A prompt is over a token limit: `serve.max_prompt_tokens` or the engine's
    /// `max_model_len` (`limit_name`). `index` counts a batch's prompts from 0.
    #[error("{}", prompt_too_long(*.index, *.tokens, *.limit, .limit_name, *.prompts))]
    PromptTooLong {
        index: usize,
        tokens: u64,
        limit: u64,
        limit_name: &'static str,
        prompts: usize,
    },
    /// Block ids cannot be computed with this configuration.
    #[error("{0}")]
    Blocks(String),
}

fn prompt_too_long(index: usize, n: u64, limit: u64, what: &str, prompts: usize) -> String {
    if prompts == 1 {
        format!("the prompt has {n} tokens, over the limit of {limit} ({what})")
    } else {
        format!(
            "prompt {index} has {n} tokens, over the limit of {limit} ({what}); the batch's \
             {prompts} prompts count from 0"
        )
    }
}

impl PrepareError {
    /// As the OpenAI client is told: a tokenizer refusal as `ApiError::from` says, a prompt
    /// over a limit as a `400` naming the endpoint's prompt field.
    pub fn into_api_error(self, endpoint: Endpoint) -> ApiError {
        match self {
            PrepareError::Tokenize(err) => ApiError::from(err),
            err @ PrepareError::PromptTooLong { .. } => {
                ApiError::bad_request("prompt_too_long", err.to_string()).param(
                    if endpoint == Endpoint::Completions {
                        "prompt"
                    } else {
                        "messages"
                    },
                )
            }
            PrepareError::Blocks(message) => ApiError::internal(message),
        }
    }
}

/// What the routing core is asked about one request, and what the engine is sent.
#[derive(Debug)]
pub struct Prepared {
    /// Each prompt's token ids, in order (empty when the prompts could not be tokenized).
    pub ids: Vec<Vec<u32>>,
    /// The prompt tokens the engine prefills: every prompt of a batch.
    pub isl_tokens: u64,
    /// The first prompt's block ids: a batch is routed by its first prompt (its shared
    /// preamble); the others' own overlap is not credited.
    pub blocks: Vec<u64>,
    /// `max_completion_tokens` or `max_tokens`, when the request states one.
    pub expected_output_tokens: Option<u64>,
}

/// Whether the requests of one loaded configuration need their prompts' token ids (or exact
/// token counts), and what reads them. Decided once per loaded configuration
/// (`LoadedConfig::load`, so a reload decides again), from:
///
/// - the policy instance `serve` routes with (the aggregated role's): its declared inputs,
///   `CACHE` (the prompt's overlap, from its block ids) and `LOAD` (booked load, which counts
///   prompt tokens and, under `booking.prefill: uncached` and `booking.decode: deduplicated`,
///   block ids);
/// - a policy class with a prefill busy threshold (reads booked prompt tokens);
/// - `serve.forward_token_ids` (sends the ids) and `serve.max_prompt_tokens` (counts them).
///
/// Not readers: the booking itself (what it books only matters to whoever reads the load: the
/// two above; without them `router_booked_*` count estimated sizes), the KV index (engines'
/// events), mid-stream failover (it continues from the ids the engine sends back,
/// `pipeline/migrate.rs`), session affinity. A policy's fallback (the built-in `default` after
/// the instance failed) decides without overlap when prompts are not tokenized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptIds {
    /// What reads the ids; empty: nothing, and prompts are not tokenized.
    pub readers: Vec<String>,
}

impl PromptIds {
    /// What reads token ids under `config` with `policies` (the policy set built from it).
    pub fn of(config: &RouterConfig, serve: &ServeConfig, policies: &PolicySet) -> PromptIds {
        let mut readers = Vec::new();
        let instance = policies.instance(policies.instance_for(RequestRole::Aggregated));
        let named = format!("instance `{}` ({})", instance.name, instance.type_name);
        if instance.inputs.contains(Inputs::CACHE) {
            readers.push(format!("{named} reads cache overlap"));
        }
        if instance.inputs.contains(Inputs::LOAD) {
            readers.push(format!("{named} reads load (booked prompt tokens)"));
        }
        for class in &config.policy_classes {
            if class.prefill_busy_threshold.is_some() || class.prefill_busy_threshold_frac.is_some()
            {
                readers.push(format!(
                    "policy class `{}` has a prefill busy threshold (booked prompt tokens)",
                    class.name
                ));
            }
        }
        if serve.forward_token_ids {
            readers.push("serve.forward_token_ids sends them".to_owned());
        }
        if serve.max_prompt_tokens.is_some() {
            readers.push("serve.max_prompt_tokens counts them".to_owned());
        }
        PromptIds { readers }
    }

    /// Whether requests are tokenized.
    pub fn tokenize(&self) -> bool {
        !self.readers.is_empty()
    }

    /// The log line of a configuration being loaded (number `config`): whether and why.
    pub fn log(&self, config: u64) {
        if self.tokenize() {
            tracing::info!(
                config,
                readers = %self.readers.join("; "),
                "prompts are tokenized: their token ids are read"
            );
        } else {
            tracing::info!(
                config,
                "prompts are not tokenized: nothing configured reads their token ids (policy \
                 inputs, policy classes, serve.forward_token_ids, serve.max_prompt_tokens); \
                 prompt sizes are estimated as bytes / 4"
            );
        }
    }
}

/// Tokens, lengths, limits and block ids of `parsed`, in that order (the `tokenize` stage
/// of `router_overhead_seconds` is recorded here). Without readers of the ids
/// ([`LoadedConfig::prompt_ids`]) nothing is tokenized: lengths are estimates and there are no
/// block ids (counted in `router_tokenize_skipped_total`).
pub async fn prepare(
    app: &App,
    loaded: &LoadedConfig,
    parsed: &Parsed,
) -> Result<Prepared, PrepareError> {
    let tokens = if loaded.prompt_ids.tokenize() {
        let started = Instant::now();
        let tokens = tokens(app, loaded, parsed)
            .await
            .map_err(PrepareError::Tokenize)?;
        app.metrics
            .stage("tokenize", started.elapsed().as_secs_f64());
        tokens
    } else {
        app.metrics.tokenize_skipped.inc();
        None
    };
    let (ids, max_model_len): (Vec<Vec<u32>>, Option<u64>) = match tokens {
        Some(tokens) => {
            let max_model_len = tokens.iter().filter_map(|t| t.max_model_len).min();
            (tokens.into_iter().map(|t| t.ids).collect(), max_model_len)
        }
        None => (Vec::new(), None),
    };
    let lengths = lengths(parsed, &ids);
    check_limits(&lengths, loaded.serve.max_prompt_tokens, max_model_len)?;
    let blocks = blocks(loaded, parsed, ids.first().map_or(&[][..], Vec::as_slice))?;
    let expected_output_tokens = parsed
        .body
        .get("max_completion_tokens")
        .or_else(|| parsed.body.get("max_tokens"))
        .and_then(serde_json::Value::as_u64);
    Ok(Prepared {
        isl_tokens: lengths.iter().fold(0u64, |sum, &n| sum.saturating_add(n)),
        ids,
        blocks,
        expected_output_tokens,
    })
}

/// Each prompt's length in tokens: its ids, or an estimate for a prompt not tokenized.
pub fn lengths(parsed: &Parsed, ids: &[Vec<u32>]) -> Vec<u64> {
    parsed
        .prompts()
        .enumerate()
        .map(|(i, prompt)| match ids.get(i) {
            Some(ids) if !ids.is_empty() => ids.len() as u64,
            _ => estimate_tokens(prompt),
        })
        .collect()
}

/// The limits hold per prompt, as vLLM checks them: `serve.max_prompt_tokens`, then the
/// engine's `max_model_len`.
pub fn check_limits(
    lengths: &[u64],
    max_prompt_tokens: Option<u64>,
    max_model_len: Option<u64>,
) -> Result<(), PrepareError> {
    for (limit, limit_name) in [
        (max_prompt_tokens, "serve.max_prompt_tokens"),
        (max_model_len, "the engine's max_model_len"),
    ] {
        let Some(limit) = limit else { continue };
        if let Some((index, &tokens)) = lengths.iter().enumerate().find(|&(_, &n)| n > limit) {
            return Err(PrepareError::PromptTooLong {
                index,
                tokens,
                limit,
                limit_name,
                prompts: lengths.len(),
            });
        }
    }
    Ok(())
}

/// The block ids of `ids` under the request's tenant: a LoRA adapter's KV is its own (vLLM keys
/// its blocks with the adapter's name), and so is a `cache_salt`'s.
pub fn blocks(
    loaded: &LoadedConfig,
    parsed: &Parsed,
    ids: &[u32],
) -> Result<Vec<u64>, PrepareError> {
    let serve = &loaded.serve;
    let lora = Some(parsed.model.as_str()).filter(|m| serve.lora_adapters.iter().any(|a| a == m));
    let tenant = Tenant {
        lora,
        cache_salt: parsed.cache_salt.as_deref(),
    };
    let hasher = BlockHasher::new(loaded.config.block_size, tenant)
        .map_err(|err| PrepareError::Blocks(err.to_string()))?;
    let mut blocks = Vec::new();
    hasher.prompt_blocks(ids, &mut blocks);
    Ok(blocks)
}

/// The bytes of text a prompt gives the tokenizer (chat: its messages' contents, plus a little
/// per message for the template); 0 for token ids.
fn text_bytes(prompt: &Prompt) -> usize {
    match prompt {
        Prompt::Text(text) => text.len(),
        Prompt::Tokens(_) => 0,
        Prompt::Chat(messages) => messages
            .iter()
            .map(|m| content_text(m.get("content")).len() + 8)
            .sum(),
    }
}

/// A rough token count for a prompt that could not be tokenized (routing without overlap).
pub fn estimate_tokens(prompt: &Prompt) -> u64 {
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
pub async fn tokens(
    app: &App,
    loaded: &LoadedConfig,
    parsed: &Parsed,
) -> Result<Option<Vec<Tokens>>, TokenizeError> {
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
        return tokens.map(Some);
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
        answer_limit: crate::engine_calls::tokenize_answer_limit(loaded.serve.max_body_bytes),
        turns: Some(&upstream.tokenize_turns),
    };
    match tokenize::remote_all(&target, parsed, timeout).await {
        Ok(tokens) => Ok(Some(tokens)),
        Err(err @ (TokenizeError::Invalid(_) | TokenizeError::TooLarge(_))) => Err(err),
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
///
/// The body is written field by field with the ids in place of the prompt: neither the body
/// (with its prompt text) nor the ids are copied into JSON values first.
pub fn with_token_ids(endpoint: Endpoint, parsed: &Parsed, ids: &[Vec<u32>]) -> Option<Bytes> {
    use serde::ser::{SerializeMap, Serializer};
    use serde_json::Value;
    if endpoint != Endpoint::Completions
        || ids.len() != parsed.prompt_count()
        || ids.iter().any(Vec::is_empty)
    {
        return None;
    }
    let prompt = match (parsed.body.get("prompt"), ids) {
        (Some(Value::String(_)), [one]) => IdsPrompt::One(one),
        (Some(Value::Array(texts)), _) if texts.iter().all(Value::is_string) => {
            IdsPrompt::Many(ids)
        }
        _ => return None,
    };
    struct Body<'a> {
        body: &'a serde_json::Map<String, Value>,
        prompt: IdsPrompt<'a>,
    }
    impl serde::Serialize for Body<'_> {
        fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            let mut map = serializer.serialize_map(Some(self.body.len()))?;
            for (key, value) in self.body {
                if key == "prompt" {
                    map.serialize_entry(key, &self.prompt)?;
                } else {
                    map.serialize_entry(key, value)?;
                }
            }
            map.end()
        }
    }
    let count: usize = ids.iter().map(Vec::len).sum();
    let mut out = Vec::with_capacity(count * 6 + 256);
    serde_json::to_writer(
        &mut out,
        &Body {
            body: &parsed.body,
            prompt,
        },
    )
    .ok()?;
    Some(Bytes::from(out))
}

/// A completion's prompt as token ids: one prompt's, or a batch's lists.
#[derive(Clone, Copy)]
enum IdsPrompt<'a> {
    One(&'a [u32]),
    Many(&'a [Vec<u32>]),
}

impl serde::Serialize for IdsPrompt<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            IdsPrompt::One(ids) => serializer.collect_seq(ids.iter()),
            IdsPrompt::Many(lists) => serializer.collect_seq(lists.iter()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use router_policies::loader::SearchPath;

    fn readers(yaml: &str) -> Vec<String> {
        let yaml = format!("{yaml}\nworkers:\n  - {{id: 1, url: \"http://127.0.0.1:9\"}}\n");
        let config = RouterConfig::from_yaml_str(&yaml, None).expect("a valid config");
        let policies = PolicySet::from_config(&config, &SearchPath::default()).expect("policies");
        let serve = config.serve.clone().unwrap_or_default();
        PromptIds::of(&config, &serve, &policies).readers
    }

    const RR: &str =
        "worker_selection:\n  aggregated: rr\n  instances:\n    - {name: rr, type: round-robin}\n";

    #[test]
    fn round_robin_alone_reads_no_token_ids() {
        assert_eq!(readers(RR), Vec::<String>::new());
        let random =
            "worker_selection:\n  aggregated: r\n  instances:\n    - {name: r, type: random}\n";
        assert_eq!(readers(random), Vec::<String>::new());
        // Session affinity, a class without a prefill threshold and the booking modes (what
        // they book is read by nobody here) read none either.
        let others = format!(
            "{RR}session_affinity:\n  mode: soft\npolicy_classes:\n  - name: default\n    \
             max_engine_waiting: 4\nbooking:\n  prefill: uncached\n  decode: deduplicated\n"
        );
        assert_eq!(readers(&others), Vec::<String>::new());
    }

    #[test]
    fn every_reader_of_token_ids_is_named() {
        let default = readers("");
        assert_eq!(default.len(), 2, "{default:?}");
        assert!(default[0].contains("`default`") && default[0].contains("cache overlap"));
        assert!(default[1].contains("load"));
        let cases = [
            (
                "policy_classes:\n  - name: default\n    prefill_busy_threshold: 100\n",
                "policy class `default`",
            ),
            (
                "serve:\n  forward_token_ids: true\n",
                "serve.forward_token_ids",
            ),
            (
                "serve:\n  max_prompt_tokens: 100\n",
                "serve.max_prompt_tokens",
            ),
        ];
        for (extra, named) in cases {
            let found = readers(&format!("{RR}{extra}"));
            assert_eq!(found.len(), 1, "{extra}: {found:?}");
            assert!(found[0].contains(named), "{extra}: {found:?}");
        }
    }

    /// The body as the copy-based rewrite made it: the body cloned, `prompt` replaced by JSON
    /// values.
    fn copied(parsed: &Parsed, ids: &[Vec<u32>]) -> Vec<u8> {
        let mut body = parsed.body.clone();
        let prompt = if ids.len() == 1 && parsed.body["prompt"].is_string() {
            serde_json::Value::from(ids[0].clone())
        } else {
            serde_json::Value::from(ids.to_vec())
        };
        body.insert("prompt".to_owned(), prompt);
        serde_json::to_vec(&body).unwrap()
    }

    #[test]
    fn ids_replace_the_prompt_in_place_byte_for_byte() {
        let one = br#"{"model":"m","prompt":"a text \u00e9","max_tokens":3,"stream":false}"#;
        let many = br#"{"prompt":["a","b c"],"model":"m","n":1}"#;
        for (body, ids) in [
            (&one[..], vec![vec![1u32, 4_000_000_000, 0, 77]]),
            (&many[..], vec![vec![5], vec![6, 7, 8]]),
        ] {
            let parsed = crate::request::parse(Endpoint::Completions, body).unwrap();
            let written = with_token_ids(Endpoint::Completions, &parsed, &ids).unwrap();
            assert_eq!(&written[..], &copied(&parsed, &ids)[..]);
            let back: serde_json::Value = serde_json::from_slice(&written).unwrap();
            assert_eq!(
                back.as_object().unwrap().keys().next(),
                parsed.body.keys().next()
            );
        }
        let parsed = crate::request::parse(Endpoint::Completions, one).unwrap();
        assert_eq!(
            with_token_ids(Endpoint::ChatCompletions, &parsed, &[vec![1]]),
            None
        );
        assert_eq!(
            with_token_ids(Endpoint::Completions, &parsed, &[vec![]]),
            None
        );
    }
}
