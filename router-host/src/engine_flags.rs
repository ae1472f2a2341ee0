//! The simulated engine's flags, shared by `replay` and `mock-engine`: both run the replay's
//! engine model (`router_host::replay::engine`), so both take the same knobs, validated once by
//! `EngineSpec::resolve`.

use router_host::replay::engine::{EngineSpec, KvCapacity};

/// Capacity and step costs of each simulated engine (one per data-parallel rank).
#[derive(clap::Args, Debug, Clone)]
pub struct EngineFlags {
    /// KV capacity of each engine in blocks, or `unlimited` (no eviction) [default: 1048576
    /// tokens' worth].
    #[arg(long, value_name = "N|unlimited")]
    pub kv_blocks: Option<KvCapacity>,
    /// Engine token budget per step [default: 8192].
    #[arg(long, value_name = "TOKENS")]
    pub max_num_batched_tokens: Option<u64>,
    /// Engine batch limit: requests running at once [default: 256].
    #[arg(long, value_name = "N")]
    pub max_num_seqs: Option<u64>,
    /// Fixed cost of every engine step [default: 5]; 0 with the two below makes steps free.
    #[arg(long, value_name = "MS")]
    pub step_overhead_ms: Option<f64>,
    /// Step cost per decoding request in the batch [default: 0.1].
    #[arg(long, value_name = "MS")]
    pub decode_ms_per_seq: Option<f64>,
    /// Step cost per prefilled (uncached) prompt token [default: 0.05].
    #[arg(long, value_name = "MS")]
    pub prefill_ms_per_token: Option<f64>,
}

impl EngineFlags {
    /// The engine settings these flags ask for; `kv_tokens` is the capacity given in tokens
    /// instead (mock-engine's `--kv-tokens`).
    pub fn spec(&self, kv_tokens: Option<u64>) -> EngineSpec {
        EngineSpec {
            kv_blocks: self.kv_blocks,
            kv_tokens,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            step_overhead_ms: self.step_overhead_ms,
            decode_ms_per_seq: self.decode_ms_per_seq,
            prefill_ms_per_token: self.prefill_ms_per_token,
            // Replay's own engine-model flags (`replay_cli`) fill the rest.
            ..EngineSpec::default()
        }
    }
}
