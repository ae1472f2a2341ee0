//! Engine settings: the `engine:` block of a router config ([`EngineSpec`], parsed from JSON and
//! overlaid with the replay flags), its defaults (`DEFAULT_*`), and the resolved, validated
//! [`EngineParams`] an [`Engine`](super::Engine) runs with.

use std::fmt;
use std::str::FromStr;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize};

/// Default KV capacity in tokens (`kv_blocks = kv_tokens / block_size`).
pub const DEFAULT_KV_TOKENS: u64 = 1 << 20;
pub const DEFAULT_MAX_NUM_BATCHED_TOKENS: u64 = 8192;
pub const DEFAULT_MAX_NUM_SEQS: u64 = 256;
pub const DEFAULT_STEP_OVERHEAD_MS: f64 = 5.0;
pub const DEFAULT_DECODE_MS_PER_SEQ: f64 = 0.1;
pub const DEFAULT_PREFILL_MS_PER_TOKEN: f64 = 0.05;
/// vLLM's API server spends its own time on a request (rendering, tokenizing) before the engine
/// sees it; the default leaves it out, as the engine model always has.
pub const DEFAULT_API_OVERHEAD_MS: f64 = 0.0;
/// vLLM caches every full block of a request, generated tokens included.
pub const DEFAULT_CACHE_GENERATED: bool = true;

/// KV capacity of one engine: a number of blocks, or unlimited (no eviction).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvCapacity {
    Blocks(u64),
    Unlimited,
}

impl FromStr for KvCapacity {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s == "unlimited" {
            return Ok(KvCapacity::Unlimited);
        }
        match s.parse::<u64>() {
            Ok(0) => Err("must be at least 1 block (or `unlimited`)".to_string()),
            Ok(n) => Ok(KvCapacity::Blocks(n)),
            Err(_) => Err(format!(
                "expected a number of blocks or `unlimited`, got `{s}`"
            )),
        }
    }
}

impl fmt::Display for KvCapacity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KvCapacity::Blocks(n) => write!(f, "{n}"),
            KvCapacity::Unlimited => f.write_str("unlimited"),
        }
    }
}

impl<'de> Deserialize<'de> for KvCapacity {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = KvCapacity;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number of blocks >= 1 or \"unlimited\"")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<KvCapacity, E> {
                if v == 0 {
                    Err(E::invalid_value(de::Unexpected::Unsigned(0), &self))
                } else {
                    Ok(KvCapacity::Blocks(v))
                }
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<KvCapacity, E> {
                Err(E::invalid_value(de::Unexpected::Signed(v), &self))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<KvCapacity, E> {
                Err(E::invalid_value(de::Unexpected::Float(v), &self))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<KvCapacity, E> {
                if v == "unlimited" {
                    Ok(KvCapacity::Unlimited)
                } else {
                    Err(E::invalid_value(de::Unexpected::Str(v), &self))
                }
            }
        }
        deserializer.deserialize_any(V)
    }
}

impl Serialize for KvCapacity {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            KvCapacity::Blocks(n) => s.serialize_u64(*n),
            KvCapacity::Unlimited => s.serialize_str("unlimited"),
        }
    }
}

/// The `engine:` block of a router config (and the replay flags of the same names): every key
/// optional, unknown keys rejected.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineSpec {
    pub kv_blocks: Option<KvCapacity>,
    pub kv_tokens: Option<u64>,
    pub max_num_batched_tokens: Option<u64>,
    pub max_num_seqs: Option<u64>,
    pub step_overhead_ms: Option<f64>,
    pub decode_ms_per_seq: Option<f64>,
    pub prefill_ms_per_token: Option<f64>,
    pub api_overhead_ms: Option<f64>,
    pub cache_generated: Option<bool>,
}

/// The keys of the `engine:` block.
pub const ENGINE_KEYS: [&str; 9] = [
    "kv_blocks",
    "kv_tokens",
    "max_num_batched_tokens",
    "max_num_seqs",
    "step_overhead_ms",
    "decode_ms_per_seq",
    "prefill_ms_per_token",
    "api_overhead_ms",
    "cache_generated",
];

impl EngineSpec {
    /// Parse a config's `engine` value. Errors start with the key path (`engine.KEY: ...`); a
    /// null value means the key is absent.
    pub fn from_json(value: &serde_json::Value) -> Result<EngineSpec, String> {
        fn get<'de, T: Deserialize<'de>>(
            key: &str,
            value: &'de serde_json::Value,
        ) -> Result<Option<T>, String> {
            if value.is_null() {
                return Ok(None);
            }
            T::deserialize(value)
                .map(Some)
                .map_err(|e| format!("engine.{key}: {e}"))
        }
        let Some(map) = value.as_object() else {
            return Err("engine: must be a mapping".to_string());
        };
        let mut spec = EngineSpec::default();
        for (key, v) in map {
            match key.as_str() {
                "kv_blocks" => spec.kv_blocks = get(key, v)?,
                "kv_tokens" => spec.kv_tokens = get(key, v)?,
                "max_num_batched_tokens" => spec.max_num_batched_tokens = get(key, v)?,
                "max_num_seqs" => spec.max_num_seqs = get(key, v)?,
                "step_overhead_ms" => spec.step_overhead_ms = get(key, v)?,
                "decode_ms_per_seq" => spec.decode_ms_per_seq = get(key, v)?,
                "prefill_ms_per_token" => spec.prefill_ms_per_token = get(key, v)?,
                "api_overhead_ms" => spec.api_overhead_ms = get(key, v)?,
                "cache_generated" => spec.cache_generated = get(key, v)?,
                other => {
                    return Err(format!(
                        "engine: unknown key `{other}`, expected one of {}",
                        ENGINE_KEYS
                            .iter()
                            .map(|k| format!("`{k}`"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ))
                }
            }
        }
        Ok(spec)
    }

    /// `self` with every key `over` sets replaced (capacity is one setting: setting either
    /// `kv_blocks` or `kv_tokens` in `over` replaces both).
    pub fn overlay(&self, over: &EngineSpec) -> EngineSpec {
        let capacity_set = over.kv_blocks.is_some() || over.kv_tokens.is_some();
        EngineSpec {
            kv_blocks: if capacity_set {
                over.kv_blocks
            } else {
                self.kv_blocks
            },
            kv_tokens: if capacity_set {
                over.kv_tokens
            } else {
                self.kv_tokens
            },
            max_num_batched_tokens: over.max_num_batched_tokens.or(self.max_num_batched_tokens),
            max_num_seqs: over.max_num_seqs.or(self.max_num_seqs),
            step_overhead_ms: over.step_overhead_ms.or(self.step_overhead_ms),
            decode_ms_per_seq: over.decode_ms_per_seq.or(self.decode_ms_per_seq),
            prefill_ms_per_token: over.prefill_ms_per_token.or(self.prefill_ms_per_token),
            api_overhead_ms: over.api_overhead_ms.or(self.api_overhead_ms),
            cache_generated: over.cache_generated.or(self.cache_generated),
        }
    }

    /// Fill defaults and validate, for blocks of `block_size` tokens.
    pub fn resolve(&self, block_size: u32) -> Result<EngineParams, String> {
        let block_size = u64::from(block_size.max(1));
        let kv = match (self.kv_blocks, self.kv_tokens) {
            (Some(_), Some(_)) => {
                return Err("engine: set `kv_blocks` or `kv_tokens`, not both".to_string());
            }
            (Some(c), None) => c,
            (None, Some(0)) => return Err("engine.kv_tokens: must be at least 1".to_string()),
            (None, Some(tokens)) => KvCapacity::Blocks((tokens / block_size).max(1)),
            (None, None) => KvCapacity::Blocks((DEFAULT_KV_TOKENS / block_size).max(1)),
        };
        let params = EngineParams {
            kv_blocks: kv,
            max_num_batched_tokens: self
                .max_num_batched_tokens
                .unwrap_or(DEFAULT_MAX_NUM_BATCHED_TOKENS),
            max_num_seqs: self.max_num_seqs.unwrap_or(DEFAULT_MAX_NUM_SEQS),
            step_overhead_ms: self.step_overhead_ms.unwrap_or(DEFAULT_STEP_OVERHEAD_MS),
            decode_ms_per_seq: self.decode_ms_per_seq.unwrap_or(DEFAULT_DECODE_MS_PER_SEQ),
            prefill_ms_per_token: self
                .prefill_ms_per_token
                .unwrap_or(DEFAULT_PREFILL_MS_PER_TOKEN),
            api_overhead_ms: self.api_overhead_ms.unwrap_or(DEFAULT_API_OVERHEAD_MS),
            cache_generated: self.cache_generated.unwrap_or(DEFAULT_CACHE_GENERATED),
        };
        if params.max_num_batched_tokens == 0 {
            return Err("engine.max_num_batched_tokens: must be at least 1".to_string());
        }
        if params.max_num_seqs == 0 {
            return Err("engine.max_num_seqs: must be at least 1".to_string());
        }
        if params.max_num_seqs > params.max_num_batched_tokens {
            return Err(format!(
                "engine.max_num_seqs: {} must not exceed max_num_batched_tokens ({}): every decoding request takes one token of the step budget",
                params.max_num_seqs, params.max_num_batched_tokens
            ));
        }
        for (key, value) in [
            ("step_overhead_ms", params.step_overhead_ms),
            ("decode_ms_per_seq", params.decode_ms_per_seq),
            ("prefill_ms_per_token", params.prefill_ms_per_token),
            ("api_overhead_ms", params.api_overhead_ms),
        ] {
            if !(value.is_finite() && (0.0..=1e9).contains(&value)) {
                return Err(format!(
                    "engine.{key}: must be a finite number from 0 to 1e9, got {value}"
                ));
            }
        }
        Ok(params)
    }
}

/// Resolved engine parameters (see the [`engine`](super) module docs).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct EngineParams {
    pub kv_blocks: KvCapacity,
    pub max_num_batched_tokens: u64,
    pub max_num_seqs: u64,
    pub step_overhead_ms: f64,
    pub decode_ms_per_seq: f64,
    pub prefill_ms_per_token: f64,
    /// Time from the router's dispatch to the request joining the engine's queue (vLLM's API
    /// server: rendering and tokenizing). Replay applies it; the mock engine, which has its own
    /// server, does not.
    pub api_overhead_ms: f64,
    /// Full blocks completed by generated tokens become cache entries when the request ends,
    /// under the ids the trace gives them (`output_hash_ids`).
    pub cache_generated: bool,
}

impl EngineParams {
    /// Step duration in nanoseconds (at least 1).
    pub fn step_ns(&self, decoding: usize, prefill_tokens: u64) -> u64 {
        let ms = self.step_overhead_ms
            + self.decode_ms_per_seq * decoding as f64
            + self.prefill_ms_per_token * prefill_tokens as f64;
        ((ms * 1e6).round() as u64).max(1)
    }

    /// Arrival to first token of a request alone on an idle engine with `tokens` prompt tokens
    /// to compute: one prefill step per `max_num_batched_tokens` chunk, nothing decoding.
    pub fn alone_prefill_ns(&self, tokens: u64) -> u64 {
        let budget = self.max_num_batched_tokens.max(1);
        let (full, rest) = (tokens / budget, tokens % budget);
        let last = if rest > 0 { self.step_ns(0, rest) } else { 0 };
        full * self.step_ns(0, budget) + last
    }

    /// [`api_overhead_ms`](Self::api_overhead_ms) in nanoseconds.
    pub fn api_overhead_ns(&self) -> u64 {
        (self.api_overhead_ms * 1e6).round() as u64
    }

    pub fn capacity(&self) -> Option<u64> {
        match self.kv_blocks {
            KvCapacity::Blocks(n) => Some(n),
            KvCapacity::Unlimited => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_parsing_overlay_and_validation() {
        let spec = EngineSpec::from_json(
            &serde_json::json!({"kv_blocks": "unlimited", "max_num_seqs": 8}),
        )
        .unwrap();
        assert_eq!(spec.kv_blocks, Some(KvCapacity::Unlimited));
        let err = EngineSpec::from_json(&serde_json::json!({"kv_blockz": 1})).unwrap_err();
        assert!(err.contains("unknown key `kv_blockz`"), "{err}");
        let err = EngineSpec::from_json(&serde_json::json!({"kv_blocks": 0})).unwrap_err();
        assert!(err.starts_with("engine.kv_blocks: "), "{err}");
        assert!(err.contains("\"unlimited\""), "{err}");
        let err =
            EngineSpec::from_json(&serde_json::json!({"decode_ms_per_seq": "x"})).unwrap_err();
        assert!(err.starts_with("engine.decode_ms_per_seq: "), "{err}");
        let over = EngineSpec {
            kv_tokens: Some(4096),
            ..EngineSpec::default()
        };
        let merged = spec.overlay(&over);
        assert_eq!(merged.kv_blocks, None);
        assert_eq!(merged.max_num_seqs, Some(8));
        let params = merged.resolve(512).unwrap();
        assert_eq!(params.kv_blocks, KvCapacity::Blocks(8));
        let bad = EngineSpec {
            max_num_seqs: Some(10_000),
            ..EngineSpec::default()
        };
        assert!(bad.resolve(16).unwrap_err().contains("max_num_seqs"));
        assert_eq!("unlimited".parse(), Ok(KvCapacity::Unlimited));
        assert!("0".parse::<KvCapacity>().is_err());
    }
}
