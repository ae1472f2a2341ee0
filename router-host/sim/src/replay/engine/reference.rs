//! The pooled-LRU reference: what the cluster's KV capacity allows a router, as a yardstick
//! for the policies' results (`docs/replay.md`, "The pooled-LRU reference").
//!
//! Every engine's blocks form one LRU prefix cache, and each request, in arrival order, runs
//! alone on an idle engine. That is a router that never splits a prefix across workers, never
//! queues and never shares a step, with the engines' own rules otherwise: the same leading-run
//! hits, the same reservation of the missing prompt blocks and the output at admission, the same
//! tail-first release, and the same step timing. It is not a bound in the strict sense: a router
//! that starves some workers of new prompts keeps their caches longer than LRU would.

use super::job::{output_blocks, reused_tokens};
use super::{BlockCache, EngineParams};
use crate::replay::trace::WorkloadRequest;

/// What the reference measured.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PooledLru {
    /// The pooled capacity in blocks; `None` = unlimited.
    pub capacity_blocks: Option<u64>,
    /// Prompt blocks found cached, over the requests an engine can hold.
    pub hit_blocks: u64,
    pub prompt_blocks: u64,
    /// Arrival to first token of each request an engine can hold, in arrival order.
    pub ttft_ns: Vec<u64>,
}

/// Run `requests` (in arrival order) through one LRU cache of `engines` x `params.kv_blocks`
/// blocks. Requests larger than one engine's capacity are left out: every engine refuses them.
pub fn pooled_lru(
    requests: &[WorkloadRequest],
    block_size: u32,
    engines: u32,
    params: &EngineParams,
) -> PooledLru {
    let per_engine = params.capacity();
    let capacity = per_engine.map(|c| c.saturating_mul(u64::from(engines.max(1))));
    let mut cache = BlockCache::new();
    let mut out = PooledLru {
        capacity_blocks: capacity,
        ttft_ns: Vec::with_capacity(requests.len()),
        ..PooledLru::default()
    };
    for w in requests {
        let prompt_blocks = w.hash_ids.len() as u64;
        let needed_alone = prompt_blocks + u64::from(output_blocks(w, block_size));
        if per_engine.is_some_and(|c| needed_alone > c) {
            continue;
        }
        let hits = w
            .hash_ids
            .iter()
            .take_while(|&&b| cache.get(b).is_some())
            .count();
        for &b in &w.hash_ids[..hits] {
            if let Some(s) = cache.get(b) {
                cache.acquire(s);
            }
        }
        if let Some(capacity) = capacity {
            let needed = needed_alone - hits as u64;
            while cache.len() + needed > capacity && cache.evict_oldest().is_some() {}
        }
        for &b in &w.hash_ids[hits..] {
            match cache.get(b) {
                Some(s) => cache.acquire(s),
                None => cache.insert(b),
            }
        }
        for &b in w.hash_ids.iter().rev() {
            if let Some(s) = cache.get(b) {
                cache.release(s);
            }
        }
        out.hit_blocks += hits as u64;
        out.prompt_blocks += prompt_blocks;
        let reused = reused_tokens(hits as u32, w.input_length, u64::from(block_size.max(1)));
        out.ttft_ns
            .push(params.alone_prefill_ns(w.input_length - reused));
    }
    out
}
