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
//!   the step that computed its last token; eviction emits `Evicted`. Output blocks are never
//!   cached (the next turn of a conversation names them with new ids).
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

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::fmt;
use std::str::FromStr;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize};

use crate::host::RequestId;

use super::trace::WorkloadRequest;
use crate::fast_hash::FastMap;
use crate::kv_index::{KvEvent, KvEventKind};

/// Default KV capacity in tokens (`kv_blocks = kv_tokens / block_size`).
pub const DEFAULT_KV_TOKENS: u64 = 1 << 20;
pub const DEFAULT_MAX_NUM_BATCHED_TOKENS: u64 = 8192;
pub const DEFAULT_MAX_NUM_SEQS: u64 = 256;
pub const DEFAULT_STEP_OVERHEAD_MS: f64 = 5.0;
pub const DEFAULT_DECODE_MS_PER_SEQ: f64 = 0.1;
pub const DEFAULT_PREFILL_MS_PER_TOKEN: f64 = 0.05;

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
}

/// The keys of the `engine:` block.
pub const ENGINE_KEYS: [&str; 7] = [
    "kv_blocks",
    "kv_tokens",
    "max_num_batched_tokens",
    "max_num_seqs",
    "step_overhead_ms",
    "decode_ms_per_seq",
    "prefill_ms_per_token",
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

/// Resolved engine parameters (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct EngineParams {
    pub kv_blocks: KvCapacity,
    pub max_num_batched_tokens: u64,
    pub max_num_seqs: u64,
    pub step_overhead_ms: f64,
    pub decode_ms_per_seq: f64,
    pub prefill_ms_per_token: f64,
}

impl EngineParams {
    /// Step duration in nanoseconds (at least 1).
    pub fn step_ns(&self, decoding: usize, prefill_tokens: u64) -> u64 {
        let ms = self.step_overhead_ms
            + self.decode_ms_per_seq * decoding as f64
            + self.prefill_ms_per_token * prefill_tokens as f64;
        ((ms * 1e6).round() as u64).max(1)
    }

    pub fn capacity(&self) -> Option<u64> {
        match self.kv_blocks {
            KvCapacity::Blocks(n) => Some(n),
            KvCapacity::Unlimited => None,
        }
    }
}

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
    prompt_blocks: u32,
    output_blocks: u32,
    input_tokens: u64,
    output_tokens: u64,
    computed_tokens: u64,
    /// Leading prompt blocks this job references in the cache.
    stored_blocks: u32,
    /// Reserved blocks that are not cache entries (uncomputed prompt blocks, output blocks).
    private_blocks: u64,
}

impl Job {
    pub fn new(
        request: u32,
        w: &WorkloadRequest,
        block_size: u32,
        arrival_ns: u64,
        dispatched_ns: u64,
    ) -> Job {
        let output_tokens = w.output_length.max(1);
        Job {
            request,
            arrival_ns,
            dispatched_ns,
            prompt_blocks: w.hash_ids.len() as u32,
            output_blocks: output_tokens.div_ceil(u64::from(block_size.max(1))) as u32,
            input_tokens: w.input_length,
            output_tokens,
            ..Job::default()
        }
    }

    pub fn prompt_blocks(&self) -> u32 {
        self.prompt_blocks
    }

    pub fn output_tokens(&self) -> u64 {
        self.output_tokens
    }
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

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Slot {
    block: u64,
    refs: u32,
    prev: u32,
    next: u32,
}

/// Prefix cache: block id -> slot with a reference count; unreferenced slots on an LRU list.
#[derive(Debug, Default)]
struct BlockCache {
    map: FastMap<u64, u32>,
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    /// Oldest unreferenced.
    head: u32,
    tail: u32,
    lru_len: u64,
}

impl BlockCache {
    fn new() -> Self {
        BlockCache {
            head: NIL,
            tail: NIL,
            ..BlockCache::default()
        }
    }

    fn len(&self) -> u64 {
        self.map.len() as u64
    }

    fn get(&self, block: u64) -> Option<u32> {
        self.map.get(&block).copied()
    }

    fn unlink(&mut self, s: u32) {
        let (prev, next) = (self.slots[s as usize].prev, self.slots[s as usize].next);
        if prev == NIL {
            self.head = next;
        } else {
            self.slots[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.slots[next as usize].prev = prev;
        }
        self.lru_len -= 1;
    }

    fn push_newest(&mut self, s: u32) {
        self.slots[s as usize].prev = self.tail;
        self.slots[s as usize].next = NIL;
        if self.tail == NIL {
            self.head = s;
        } else {
            self.slots[self.tail as usize].next = s;
        }
        self.tail = s;
        self.lru_len += 1;
    }

    fn acquire(&mut self, s: u32) {
        if self.slots[s as usize].refs == 0 {
            self.unlink(s);
        }
        self.slots[s as usize].refs += 1;
    }

    fn release(&mut self, s: u32) {
        let slot = &mut self.slots[s as usize];
        slot.refs -= 1;
        if slot.refs == 0 {
            self.push_newest(s);
        }
    }

    /// A new entry referenced once.
    fn insert(&mut self, block: u64) {
        let slot = Slot {
            block,
            refs: 1,
            prev: NIL,
            next: NIL,
        };
        let s = match self.free_slots.pop() {
            Some(s) => {
                self.slots[s as usize] = slot;
                s
            }
            None => {
                self.slots.push(slot);
                (self.slots.len() - 1) as u32
            }
        };
        self.map.insert(block, s);
    }

    fn evict_oldest(&mut self) -> Option<u64> {
        let s = self.head;
        if s == NIL {
            return None;
        }
        self.unlink(s);
        let block = self.slots[s as usize].block;
        self.map.remove(&block);
        self.free_slots.push(s);
        Some(block)
    }
}

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
                        out.events.push(KvEvent {
                            row: self.row,
                            kind: KvEventKind::Stored,
                            block,
                        });
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
                out.events.push(KvEvent {
                    row: self.row,
                    kind: KvEventKind::Evicted,
                    block,
                });
            }
        }
        self.private += needed;
        j.private_blocks = needed;
        j.hit_blocks = hits;
        j.stored_blocks = hits;
        j.computed_tokens = (u64::from(hits) * self.block_size).min(j.input_tokens);
        if j.computed_tokens >= j.input_tokens {
            // A fully cached prompt still computes its last token.
            j.computed_tokens = j.input_tokens - 1;
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn params(kv: KvCapacity) -> EngineParams {
        EngineParams {
            kv_blocks: kv,
            max_num_batched_tokens: 8,
            max_num_seqs: 4,
            step_overhead_ms: 1.0,
            decode_ms_per_seq: 0.5,
            prefill_ms_per_token: 0.25,
        }
    }

    fn request(input: u64, output: u64, ids: &[u64]) -> WorkloadRequest {
        WorkloadRequest {
            arrival_ns: 0,
            input_length: input,
            output_length: output,
            hash_ids: ids.to_vec(),
            session_id: None,
        }
    }

    /// Run the engine alone until idle; returns the jobs.
    fn run(engine: &mut Engine, requests: &[WorkloadRequest], arrivals: &[u64]) -> Vec<Job> {
        let mut jobs: Vec<Job> = requests
            .iter()
            .enumerate()
            .map(|(i, r)| Job::new(i as u32, r, 4, arrivals[i], arrivals[i]))
            .collect();
        let mut out = Outbox::default();
        let mut next = 0;
        loop {
            let wake = engine.wake();
            let arrival = arrivals.get(next).copied();
            let engine_first = match (wake, arrival) {
                (None, None) => break,
                (Some(w), Some(a)) => w <= a,
                (Some(_), None) => true,
                (None, Some(_)) => false,
            };
            if engine_first {
                let w = engine.wake().unwrap();
                engine.on_wake(w, &mut jobs, requests, &mut out);
            } else {
                let a = arrivals[next];
                engine
                    .enqueue(next as u32, a, &mut jobs, requests, &mut out)
                    .unwrap();
                next += 1;
            }
        }
        jobs
    }

    #[test]
    fn prefill_chunks_decode_and_prefix_reuse() {
        // Block size 4, budget 8 tokens/step. Request 0: 10 tokens (3 blocks), 3 output tokens.
        let requests = vec![request(10, 3, &[1, 2, 3]), request(10, 1, &[1, 2, 3])];
        let mut engine = Engine::new(0, params(KvCapacity::Unlimited), 4);
        let jobs = run(&mut engine, &requests, &[0, 100_000_000]);
        // Step 1: 8 prefill tokens (1 + 2 ms = 3 ms); step 2: 2 tokens (1.5 ms) -> first token
        // at 4.5 ms; two decode steps of 1.5 ms -> done at 7.5 ms.
        assert_eq!(jobs[0].first_token_ns, Some(4_500_000));
        assert_eq!(jobs[0].finish_ns, Some(7_500_000));
        assert_eq!(jobs[0].hit_blocks, 0);
        // Request 1 finds all 3 blocks and computes only its last token: 1.25 ms.
        assert_eq!(jobs[1].hit_blocks, 3);
        assert_eq!(jobs[1].first_token_ns, Some(101_250_000));
        assert_eq!(jobs[1].finish_ns, jobs[1].first_token_ns);
        assert_eq!(engine.stats().prefill_tokens, 11);
    }

    #[test]
    fn lru_evicts_unreferenced_tail_blocks_first_and_emits_events() {
        // Capacity 4 blocks: request 0 holds 2 prompt + 1 output block.
        let requests = vec![
            request(8, 1, &[1, 2]),
            request(8, 1, &[3, 4]),
            request(8, 1, &[1, 5]),
        ];
        let mut engine = Engine::new(0, params(KvCapacity::Blocks(4)), 4);
        let jobs = run(&mut engine, &requests, &[0, 50_000_000, 100_000_000]);
        // Request 1 needs 3 blocks with 2 free: evicts block 2 (tail of request 0) first.
        assert!(engine.holds(1));
        assert!(!engine.holds(2));
        assert_eq!(jobs[2].hit_blocks, 1);
        assert!(engine.stats().evicted_blocks >= 1);
    }

    #[test]
    fn arrival_cuts_a_decode_jump_at_the_step_in_progress() {
        // Request 0 decodes 100 tokens alone (1.5 ms steps from 4.5 ms); request 1 arrives at
        // 10 ms, inside the fourth step of the stretch, and joins when it ends at 10.5 ms.
        let requests = vec![request(10, 101, &[1, 2, 3]), request(4, 1, &[9])];
        let mut engine = Engine::new(0, params(KvCapacity::Unlimited), 4);
        let jobs = run(&mut engine, &requests, &[0, 10_000_000]);
        assert_eq!(jobs[1].admitted_ns, Some(10_500_000));
        // The joined step: overhead 1 + 1 decoder 0.5 + 4 tokens 1.0 = 2.5 ms.
        assert_eq!(jobs[1].first_token_ns, Some(13_000_000));
        // Request 0: 100 decode steps, one of them 2.5 ms instead of 1.5 ms.
        assert_eq!(
            jobs[0].finish_ns,
            Some(4_500_000 + 100 * 1_500_000 + 1_000_000)
        );
    }

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
