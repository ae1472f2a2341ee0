//! A request's life on an engine ([`Job`]) and what an engine reports back after a step
//! ([`Outbox`]).

use router_core::kv_index::KvEvent;
use router_policies::host::RequestId;

use crate::replay::trace::WorkloadRequest;

/// One request's life on an engine.
#[derive(Debug, Clone, Default)]
pub struct Job {
    /// Index in the workload.
    pub request: u32,
    pub host_id: RequestId,
    pub arrival_ns: u64,
    /// When it reached the engine (after any host admission queue).
    pub dispatched_ns: u64,
    pub admitted_ns: Option<u64>,
    pub first_token_ns: Option<u64>,
    pub finish_ns: Option<u64>,
    /// Prompt blocks found in the engine's cache at admission.
    pub hit_blocks: u32,
    /// The engine it was sent to (`worker * dp_size + rank`).
    pub engine: Option<u32>,
    pub(super) prompt_blocks: u32,
    pub(super) output_blocks: u32,
    pub(super) input_tokens: u64,
    pub(super) output_tokens: u64,
    pub(super) computed_tokens: u64,
    /// Leading prompt blocks this job references in the cache.
    pub(super) stored_blocks: u32,
    /// Reserved blocks that are not cache entries (uncomputed prompt blocks, output blocks).
    pub(super) private_blocks: u64,
    /// Ids of the full blocks its generated tokens complete (the trace's `output_hash_ids`),
    /// cached when it ends if the engine caches generated blocks.
    pub(super) output_hash_ids: Vec<u64>,
}

impl Job {
    pub fn new(
        request: u32,
        w: &WorkloadRequest,
        block_size: u32,
        arrival_ns: u64,
        dispatched_ns: u64,
    ) -> Job {
        Job {
            request,
            arrival_ns,
            dispatched_ns,
            prompt_blocks: w.hash_ids.len() as u32,
            output_blocks: output_blocks(w, block_size),
            input_tokens: w.input_length,
            output_tokens: output_tokens(w),
            ..Job::default()
        }
    }

    /// The ids its generated tokens' full blocks are cached under (see
    /// [`EngineParams::cache_generated`](super::EngineParams::cache_generated)).
    pub fn with_output_hash_ids(mut self, ids: &[u64]) -> Job {
        self.output_hash_ids = ids.to_vec();
        self
    }

    pub fn prompt_blocks(&self) -> u32 {
        self.prompt_blocks
    }

    pub fn input_tokens(&self) -> u64 {
        self.input_tokens
    }

    pub fn output_tokens(&self) -> u64 {
        self.output_tokens
    }
}

/// Tokens a request generates: `max(output_length, 1)` (prefill always yields the first token).
fn output_tokens(w: &WorkloadRequest) -> u64 {
    w.output_length.max(1)
}

/// KV blocks a request reserves at admission for its output.
pub(super) fn output_blocks(w: &WorkloadRequest, block_size: u32) -> u32 {
    output_tokens(w).div_ceil(u64::from(block_size.max(1))) as u32
}

/// Prompt tokens an engine does not compute when the first `hit_blocks` blocks are cached. A
/// fully cached prompt still computes its last token, which yields the first output token.
pub(super) fn reused_tokens(hit_blocks: u32, input_tokens: u64, block_size: u64) -> u64 {
    (u64::from(hit_blocks) * block_size).min(input_tokens.saturating_sub(1))
}

/// What an engine reports to the host side after a step.
#[derive(Debug, Default)]
pub struct Outbox {
    pub events: Vec<KvEvent>,
    /// Jobs whose prefill finished (first token out).
    pub first_tokens: Vec<u32>,
    pub finished: Vec<u32>,
}

impl Outbox {
    pub fn clear(&mut self) {
        self.events.clear();
        self.first_tokens.clear();
        self.finished.clear();
    }
}
