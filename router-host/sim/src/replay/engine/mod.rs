//! Simulated engines: one per row `(worker, dp_rank)`, a continuous-batching scheduler with a
//! prefix cache, in simulated nanoseconds.
//!
//! The model (every number is an [`EngineParams`] field; `docs/replay.md` has the long form):
//! - **KV cache**: `kv_blocks` blocks of the workload's block size (`None` = unlimited). A request
//!   admitted to the batch reserves its whole prompt and its output (`ceil(output/block_size)`
//!   blocks) at once and never gets preempted. Prompt blocks it finds cached (the leading run of
//!   its `hash_ids` present in the cache) are shared, not reserved again. Blocks of finished
//!   requests stay cached, unreferenced, until evicted least-recently-used first (a request's
//!   blocks are released last block first, so its prefix outlives its tail).
//! - **Prefix cache**: a prompt block becomes a cache entry (and a `Stored` event) at the end of
//!   the step that computed its last token; eviction emits `Evicted`. With `cache_generated` (the
//!   default), the full blocks a request's generated tokens complete become entries when it ends,
//!   under the ids the trace gives them (`output_hash_ids`), as vLLM hashes every full block of a
//!   request; a trace without them caches prompt blocks only.
//! - **Free blocks**: never-cached room first, then unreferenced cached blocks least recently
//!   released first. vLLM's free queue does the same: `BlockPool.free_blocks` puts blocks without
//!   a hash at its head and cached ones at its tail.
//! - **Steps**: each step gives every decoding request one token, then spends what is left of
//!   the `max_num_batched_tokens` budget on prefill chunks, first-come first-served: running
//!   prefills first, then waiting requests admitted in arrival order while the batch has fewer
//!   than `max_num_seqs` requests and their KV fits (a head that does not fit blocks the queue).
//!   Step time = `step_overhead_ms + decode_ms_per_seq * decoding + prefill_ms_per_token *
//!   prefill_tokens`.
//! - **Prefill**: a request computes `input_length - cached_tokens` tokens, at least 1 (a fully
//!   cached prompt still computes its last token). Its first output token comes at the end of the
//!   step that finishes its prefill (TTFT); each later step adds one token; it finishes when it has
//!   `max(output_length, 1)` tokens.
//!
//! Decode-only stretches (no prefill to do) are simulated in one jump up to the next completion;
//! an arrival cuts the jump at the step in progress, so the result equals stepping one by one.
//!
//! [`pooled_lru`] runs a workload through the same cache and timing rules as one pooled cache,
//! each request alone: the report's yardstick for what the KV capacity allows.

mod cache;
mod job;
mod reference;
mod spec;
#[cfg(test)]
mod tests;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use super::trace::WorkloadRequest;
use router_core::kv_index::{KvEvent, KvEventKind};

use cache::BlockCache;
pub use job::{Job, Outbox};
pub use reference::{pooled_lru, PooledLru};
pub use spec::{
    EngineParams, EngineSpec, KvCapacity, DEFAULT_DECODE_MS_PER_SEQ, DEFAULT_KV_TOKENS,
    DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, DEFAULT_PREFILL_MS_PER_TOKEN,
    DEFAULT_STEP_OVERHEAD_MS, ENGINE_KEYS,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Idle,
    /// One step with prefill work, ending at `end`.
    Mixed {
        end: u64,
    },
    /// `steps` decode-only steps of `dur` each from `start`.
    Jump {
        start: u64,
        dur: u64,
        steps: u64,
    },
}

/// Per-engine counters for the report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub steps: u64,
    pub busy_ns: u64,
    pub prefill_tokens: u64,
    pub evicted_blocks: u64,
}

/// One simulated engine.
#[derive(Debug)]
pub struct Engine {
    row: u32,
    params: EngineParams,
    block_size: u64,
    cache: BlockCache,
    private: u64,
    waiting: VecDeque<u32>,
    prefilling: VecDeque<u32>,
    decoding: BinaryHeap<Reverse<(u64, u32)>>,
    /// Steps completed (each gives every decoding request one token).
    counter: u64,
    chunks: Vec<(u32, u64)>,
    step: Step,
    stats: EngineStats,
}

/// Why an engine refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooLarge {
    pub needed: u64,
    pub capacity: u64,
}

impl Engine {
    pub fn new(row: u32, params: EngineParams, block_size: u32) -> Engine {
        Engine {
            row,
            params,
            block_size: u64::from(block_size.max(1)),
            cache: BlockCache::new(),
            private: 0,
            waiting: VecDeque::new(),
            prefilling: VecDeque::new(),
            decoding: BinaryHeap::new(),
            counter: 0,
            chunks: Vec::new(),
            step: Step::Idle,
            stats: EngineStats::default(),
        }
    }

    /// When the engine next needs attention (`None` = idle).
    pub fn wake(&self) -> Option<u64> {
        match self.step {
            Step::Idle => None,
            Step::Mixed { end } => Some(end),
            Step::Jump { start, dur, steps } => {
                Some(start.saturating_add(dur.saturating_mul(steps)))
            }
        }
    }

    /// Requests on this engine (waiting, prefilling, decoding).
    pub fn active(&self) -> usize {
        self.waiting.len() + self.prefilling.len() + self.decoding.len()
    }

    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    /// The parameters it runs with.
    pub fn params(&self) -> &EngineParams {
        &self.params
    }

    /// Requests waiting for admission to the batch.
    pub fn waiting_len(&self) -> usize {
        self.waiting.len()
    }

    /// Requests in the batch (prefilling or decoding).
    pub fn running_len(&self) -> usize {
        self.prefilling.len() + self.decoding.len()
    }

    /// KV blocks in use: cache entries some request references, plus reserved blocks that are
    /// not cache entries. Unreferenced cached blocks are not counted (they are evictable, as
    /// vLLM's free-block queue counts them free).
    pub fn kv_blocks_in_use(&self) -> u64 {
        (self.cache.len() - self.cache.lru_len) + self.private
    }

    /// Blocks in the prefix cache.
    pub fn cached_blocks(&self) -> u64 {
        self.cache.len()
    }

    /// The blocks in the prefix cache, in no particular order.
    pub fn cached(&self) -> impl Iterator<Item = u64> + '_ {
        self.cache.map.keys().copied()
    }

    /// Requests admitted and not finished, plus waiting ones.
    pub fn is_idle(&self) -> bool {
        self.step == Step::Idle && self.active() == 0
    }

    /// Whether the cache holds `block` (for tests).
    pub fn holds(&self, block: u64) -> bool {
        self.cache.get(block).is_some()
    }

    /// Accept a dispatched job at `now`. A job that could never fit in the KV cache is refused.
    pub fn enqueue(
        &mut self,
        job: u32,
        now: u64,
        jobs: &mut [Job],
        requests: &[WorkloadRequest],
        out: &mut Outbox,
    ) -> Result<(), TooLarge> {
        let j = &jobs[job as usize];
        if let Some(capacity) = self.params.capacity() {
            let needed = u64::from(j.prompt_blocks) + u64::from(j.output_blocks);
            if needed > capacity {
                return Err(TooLarge { needed, capacity });
            }
        }
        self.waiting.push_back(job);
        match self.step {
            Step::Idle => self.start_step(now, jobs, requests, out),
            Step::Jump { start, dur, steps } => {
                // Cut the decode-only stretch at the step in progress; the next step sees the job.
                let done = (now - start).div_ceil(dur);
                if done < steps {
                    self.step = Step::Jump {
                        start,
                        dur,
                        steps: done,
                    };
                }
            }
            Step::Mixed { .. } => {}
        }
        Ok(())
    }

    /// The current step (or stretch) ended at `now`: apply it, then start the next.
    pub fn on_wake(
        &mut self,
        now: u64,
        jobs: &mut [Job],
        requests: &[WorkloadRequest],
        out: &mut Outbox,
    ) {
        match self.step {
            Step::Idle => return,
            Step::Jump { dur, steps, .. } => {
                self.counter += steps;
                self.stats.steps += steps;
                self.stats.busy_ns += dur * steps;
                self.finish_decoders(now, jobs, requests, out);
            }
            Step::Mixed { .. } => {
                self.counter += 1;
                self.stats.steps += 1;
                self.finish_decoders(now, jobs, requests, out);
                self.apply_chunks(now, jobs, requests, out);
            }
        }
        self.start_step(now, jobs, requests, out);
    }

    fn finish_decoders(
        &mut self,
        now: u64,
        jobs: &mut [Job],
        requests: &[WorkloadRequest],
        out: &mut Outbox,
    ) {
        while let Some(&Reverse((at, job))) = self.decoding.peek() {
            if at > self.counter {
                break;
            }
            self.decoding.pop();
            self.finish(job, now, jobs, requests, out);
        }
    }

    fn apply_chunks(
        &mut self,
        now: u64,
        jobs: &mut [Job],
        requests: &[WorkloadRequest],
        out: &mut Outbox,
    ) {
        let chunks = std::mem::take(&mut self.chunks);
        for &(job, tokens) in &chunks {
            let j = &mut jobs[job as usize];
            j.computed_tokens += tokens;
            let done = j.computed_tokens >= j.input_tokens;
            let full = if done {
                j.prompt_blocks
            } else {
                (j.computed_tokens / self.block_size) as u32
            };
            let ids = &requests[j.request as usize].hash_ids;
            for b in j.stored_blocks..full {
                let block = ids[b as usize];
                match self.cache.get(block) {
                    // Computed meanwhile by another request: share that entry.
                    Some(s) => self.cache.acquire(s),
                    None => {
                        self.cache.insert(block);
                        out.events
                            .push(KvEvent::on_device(self.row, KvEventKind::Stored, block));
                    }
                }
                j.private_blocks -= 1;
                self.private -= 1;
            }
            j.stored_blocks = j.stored_blocks.max(full);
            if done {
                j.first_token_ns = Some(now);
                out.first_tokens.push(job);
                // Prefills finish in queue order: chunks are handed out first-come first-served.
                if self.prefilling.front() == Some(&job) {
                    self.prefilling.pop_front();
                } else if let Some(p) = self.prefilling.iter().position(|&x| x == job) {
                    self.prefilling.remove(p);
                }
                let remaining = j.output_tokens - 1;
                if remaining == 0 {
                    self.finish(job, now, jobs, requests, out);
                } else {
                    self.decoding.push(Reverse((self.counter + remaining, job)));
                }
            }
        }
        self.chunks = chunks;
        self.chunks.clear();
    }

    fn finish(
        &mut self,
        job: u32,
        now: u64,
        jobs: &mut [Job],
        requests: &[WorkloadRequest],
        out: &mut Outbox,
    ) {
        let j = &mut jobs[job as usize];
        let ids = &requests[j.request as usize].hash_ids;
        if self.params.cache_generated && !j.output_hash_ids.is_empty() {
            // vLLM hashes every full block of a request, so the next turn of a conversation
            // finds the reply's blocks too. Each one takes over a block reserved for the output
            // (the trace never lists more than the output fills); released at once, tail first,
            // ahead of the prompt.
            let mut held = 0;
            for &block in &j.output_hash_ids {
                match self.cache.get(block) {
                    Some(s) => self.cache.acquire(s),
                    None if j.private_blocks > 0 => {
                        self.cache.insert(block);
                        out.events
                            .push(KvEvent::on_device(self.row, KvEventKind::Stored, block));
                        j.private_blocks -= 1;
                        self.private -= 1;
                    }
                    None => break,
                }
                held += 1;
            }
            for &block in j.output_hash_ids[..held].iter().rev() {
                if let Some(s) = self.cache.get(block) {
                    self.cache.release(s);
                }
            }
        }
        // Tail first, so the prefix stays cached longest.
        for b in (0..j.stored_blocks).rev() {
            if let Some(s) = self.cache.get(ids[b as usize]) {
                self.cache.release(s);
            }
        }
        self.private -= j.private_blocks;
        j.private_blocks = 0;
        j.finish_ns = Some(now);
        out.finished.push(job);
    }

    /// Admit `job` from the waiting queue if its KV fits.
    fn try_admit(
        &mut self,
        job: u32,
        now: u64,
        jobs: &mut [Job],
        requests: &[WorkloadRequest],
        out: &mut Outbox,
    ) -> bool {
        let j = &mut jobs[job as usize];
        let ids = &requests[j.request as usize].hash_ids;
        let (mut hits, mut hits_unreferenced) = (0u32, 0u64);
        for &block in ids {
            match self.cache.get(block) {
                Some(s) => {
                    hits += 1;
                    hits_unreferenced += u64::from(self.cache.slots[s as usize].refs == 0);
                }
                None => break,
            }
        }
        let needed = u64::from(j.prompt_blocks - hits) + u64::from(j.output_blocks);
        if let Some(capacity) = self.params.capacity() {
            let free = capacity.saturating_sub(self.cache.len() + self.private);
            let evictable = self.cache.lru_len - hits_unreferenced;
            if free + evictable < needed {
                return false;
            }
        }
        for &block in &ids[..hits as usize] {
            if let Some(s) = self.cache.get(block) {
                self.cache.acquire(s);
            }
        }
        if let Some(capacity) = self.params.capacity() {
            while capacity.saturating_sub(self.cache.len() + self.private) < needed {
                let Some(block) = self.cache.evict_oldest() else {
                    break;
                };
                self.stats.evicted_blocks += 1;
                out.events
                    .push(KvEvent::on_device(self.row, KvEventKind::Evicted, block));
            }
        }
        self.private += needed;
        j.private_blocks = needed;
        j.hit_blocks = hits;
        j.stored_blocks = hits;
        j.computed_tokens = job::reused_tokens(hits, j.input_tokens, self.block_size);
        j.admitted_ns = Some(now);
        true
    }

    fn start_step(
        &mut self,
        now: u64,
        jobs: &mut [Job],
        requests: &[WorkloadRequest],
        out: &mut Outbox,
    ) {
        self.chunks.clear();
        let decoding = self.decoding.len();
        let mut budget = self
            .params
            .max_num_batched_tokens
            .saturating_sub(decoding as u64);
        let mut prefill = 0u64;
        for &job in &self.prefilling {
            if budget == 0 {
                break;
            }
            let j = &jobs[job as usize];
            let chunk = (j.input_tokens - j.computed_tokens).min(budget);
            self.chunks.push((job, chunk));
            budget -= chunk;
            prefill += chunk;
        }
        while budget > 0
            && ((self.prefilling.len() + self.decoding.len()) as u64) < self.params.max_num_seqs
        {
            let Some(&job) = self.waiting.front() else {
                break;
            };
            if !self.try_admit(job, now, jobs, requests, out) {
                break;
            }
            self.waiting.pop_front();
            self.prefilling.push_back(job);
            let j = &jobs[job as usize];
            let chunk = (j.input_tokens - j.computed_tokens).min(budget);
            self.chunks.push((job, chunk));
            budget -= chunk;
            prefill += chunk;
        }
        if prefill > 0 {
            let dur = self.params.step_ns(decoding, prefill);
            self.stats.busy_ns += dur;
            self.stats.prefill_tokens += prefill;
            self.step = Step::Mixed { end: now + dur };
        } else if let Some(&Reverse((at, _))) = self.decoding.peek() {
            // Nothing to prefill until a request finishes (or one arrives): jump.
            let dur = self.params.step_ns(decoding, 0);
            self.step = Step::Jump {
                start: now,
                dur,
                steps: at - self.counter,
            };
        } else {
            self.step = Step::Idle;
        }
    }
}
