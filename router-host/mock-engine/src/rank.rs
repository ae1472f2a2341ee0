//! One data-parallel rank: the replay's engine model run in real time, its requests, and the
//! KV events it publishes.
//!
//! Simulated time is nanoseconds since the rank started. Every touch of the model first
//! catches it up (each step that ended by now is applied at the time it ended, so late wake-ups
//! change nothing in the model), then does its work; a driver task sleeps until the model's
//! next wake-up or until a request arrives. The model keys blocks by id: a prompt's full blocks
//! get the engine hash of their tokens chained from the parent ([`events::block_digest`]), its
//! partial last block a unique id that is never published (vLLM caches full blocks only; the
//! model still reserves KV for it).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use bytes::Bytes;
use router_core::kv_index::KvEventKind;
use router_sim::replay::engine::{Engine, EngineParams, Job, Outbox};
use router_sim::replay::WorkloadRequest;
use tokio::sync::{mpsc, Notify};

use crate::events::{self, Event, Format};

/// Settings every part of the model reads.
#[derive(Debug)]
pub struct Settings {
    pub block_size: u32,
    pub capacity_blocks: Option<u64>,
}

/// What a request hears from the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// Prefill done: the first token is out. `cached_tokens`: prompt tokens found cached.
    FirstToken { cached_tokens: u64 },
    /// All tokens generated.
    Finished,
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused(pub String);

#[derive(Debug)]
struct BlockInfo {
    digest: [u8; 32],
    parent: Option<[u8; 32]>,
    tokens: Vec<u32>,
    /// The request's `cache_salt`, on its first block.
    salt: Option<String>,
    /// Live requests whose prompt has the block.
    refs: u32,
    /// Published as stored and not removed since.
    published: bool,
}

/// Counters for `/metrics` (vLLM's names in `http.rs`).
#[derive(Debug, Default, Clone, Copy)]
pub struct Counters {
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub requests_finished: u64,
    /// Blocks published as stored and not removed: what a router following the events holds.
    pub published_blocks: u64,
    pub batches: u64,
}

/// A snapshot for `/metrics`.
#[derive(Debug, Clone, Copy)]
pub struct Snapshot {
    pub running: usize,
    pub waiting: usize,
    pub kv_in_use: u64,
    pub counters: Counters,
}

struct State {
    engine: Engine,
    params: EngineParams,
    jobs: Vec<Job>,
    requests: Vec<WorkloadRequest>,
    waiters: Vec<Option<mpsc::UnboundedSender<Progress>>>,
    free: Vec<u32>,
    blocks: HashMap<u64, BlockInfo>,
    out: Outbox,
    next_tail: u64,
    seq: u64,
    counters: Counters,
}

pub struct Rank {
    pub index: u32,
    settings: Arc<Settings>,
    format: Format,
    epoch: Instant,
    state: Mutex<State>,
    wake: Notify,
    publisher: Option<mpsc::UnboundedSender<(u64, Bytes)>>,
}

impl Rank {
    /// Start the rank and its driver task (which runs until aborted).
    pub fn start(
        index: u32,
        params: EngineParams,
        settings: Arc<Settings>,
        format: Format,
        publisher: Option<mpsc::UnboundedSender<(u64, Bytes)>>,
    ) -> (Arc<Rank>, tokio::task::JoinHandle<()>) {
        let rank = Arc::new(Rank {
            index,
            format,
            epoch: Instant::now(),
            state: Mutex::new(State {
                engine: Engine::new(index, params, settings.block_size),
                params,
                jobs: Vec::new(),
                requests: Vec::new(),
                waiters: Vec::new(),
                free: Vec::new(),
                blocks: HashMap::new(),
                out: Outbox::default(),
                next_tail: 0,
                seq: 0,
                counters: Counters::default(),
            }),
            wake: Notify::new(),
            publisher,
            settings,
        });
        let driver = tokio::spawn(drive(rank.clone()));
        (rank, driver)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn now_ns(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Requests on the rank (for picking a rank when the request names none).
    pub fn active(&self) -> usize {
        self.lock().engine.active()
    }

    pub fn snapshot(&self) -> Snapshot {
        let mut state = self.lock();
        self.catch_up(&mut state, self.now_ns());
        Snapshot {
            running: state.engine.running_len(),
            waiting: state.engine.waiting_len(),
            kv_in_use: state.engine.kv_blocks_in_use(),
            counters: state.counters,
        }
    }

    /// The estimated time of one decode step now (for pacing streamed tokens).
    pub fn decode_step(&self) -> std::time::Duration {
        let state = self.lock();
        let ns = state.params.step_ns(state.engine.running_len(), 0);
        std::time::Duration::from_nanos(ns)
    }

    /// Hand a request to the model; its progress comes on the returned channel.
    pub fn submit(
        &self,
        tokens: &[u32],
        output_tokens: u64,
        salt: Option<&str>,
    ) -> Result<mpsc::UnboundedReceiver<Progress>, Refused> {
        if tokens.is_empty() {
            return Err(Refused("the prompt has no tokens".into()));
        }
        let block_size = self.settings.block_size as usize;
        let mut state = self.lock();
        let now = self.now_ns();
        self.catch_up(&mut state, now);
        let state = &mut *state;
        // Block ids: engine hashes of the full blocks, chained; a unique id for the tail.
        let mut hash_ids = Vec::with_capacity(tokens.len().div_ceil(block_size));
        let mut parent: Option<[u8; 32]> = None;
        let mut full = tokens.chunks_exact(block_size);
        for chunk in full.by_ref() {
            let digest = events::block_digest(parent.as_ref(), chunk, salt);
            hash_ids.push(events::model_id(&digest));
            parent = Some(digest);
        }
        if !full.remainder().is_empty() {
            state.next_tail += 1;
            let tail = events::block_digest(
                None,
                &[
                    u32::MAX,
                    (state.next_tail >> 32) as u32,
                    state.next_tail as u32,
                ],
                None,
            );
            hash_ids.push(events::model_id(&tail));
        }
        let request = WorkloadRequest {
            arrival_ns: now,
            input_length: tokens.len() as u64,
            output_length: output_tokens.max(1),
            hash_ids,
            session_id: None,
        };
        let slot = match state.free.pop() {
            Some(slot) => slot,
            None => {
                state.jobs.push(Job::default());
                state.requests.push(request.clone());
                state.waiters.push(None);
                (state.jobs.len() - 1) as u32
            }
        };
        let job = Job::new(slot, &request, self.settings.block_size, now, now);
        state.jobs[slot as usize] = job;
        state.requests[slot as usize] = request;
        if let Err(too_large) =
            state
                .engine
                .enqueue(slot, now, &mut state.jobs, &state.requests, &mut state.out)
        {
            state.free.push(slot);
            return Err(Refused(format!(
                "the request needs {} KV blocks (prompt and output) and the cache has {}",
                too_large.needed, too_large.capacity
            )));
        }
        // Register the full blocks so their events can carry tokens and parents.
        let mut parent: Option<[u8; 32]> = None;
        for chunk in tokens.chunks_exact(block_size) {
            let digest = events::block_digest(parent.as_ref(), chunk, salt);
            let first = parent.is_none();
            let info = state
                .blocks
                .entry(events::model_id(&digest))
                .or_insert_with(|| BlockInfo {
                    digest,
                    parent,
                    tokens: chunk.to_vec(),
                    salt: salt.filter(|_| first).map(str::to_owned),
                    refs: 0,
                    published: false,
                });
            info.refs += 1;
            parent = Some(digest);
        }
        let (sender, receiver) = mpsc::unbounded_channel();
        state.waiters[slot as usize] = Some(sender);
        state.counters.prompt_tokens += tokens.len() as u64;
        self.drain(state);
        self.wake.notify_one();
        Ok(receiver)
    }

    /// Empty the cache and publish `AllBlocksCleared`, as vLLM's `reset_prefix_cache` does;
    /// refused (false) while requests run, as vLLM refuses while blocks are in use.
    pub fn reset_prefix_cache(&self) -> bool {
        let mut state = self.lock();
        self.catch_up(&mut state, self.now_ns());
        if !state.engine.is_idle() {
            return false;
        }
        state.engine = Engine::new(self.index, state.params, self.settings.block_size);
        state.blocks.clear();
        state.counters.published_blocks = 0;
        self.publish(&mut state, vec![Event::AllCleared]);
        true
    }

    /// Apply every step that ended by `now`, at the time it ended.
    fn catch_up(&self, state: &mut State, now: u64) {
        while let Some(at) = state.engine.wake() {
            if at > now {
                break;
            }
            let s = &mut *state;
            s.engine.on_wake(at, &mut s.jobs, &s.requests, &mut s.out);
            self.drain(s);
        }
    }

    fn publish(&self, state: &mut State, events: Vec<Event>) {
        let Some(publisher) = &self.publisher else {
            return;
        };
        if events.is_empty() {
            return;
        }
        let payload = self
            .format
            .payload(events::wall_seconds(), &events, self.index);
        let seq = state.seq;
        state.seq += 1;
        state.counters.batches += 1;
        let _ = publisher.send((seq, Bytes::from(payload)));
    }

    /// What the model reported: events to one batch, progress to the requests.
    fn drain(&self, state: &mut State) {
        let block_size = self.settings.block_size;
        let mut batch: Vec<Event> = Vec::new();
        let mut out = std::mem::take(&mut state.out);
        for ev in &out.events {
            let Some(info) = state.blocks.get_mut(&ev.block) else {
                continue; // a partial last block: never published
            };
            match ev.kind {
                KvEventKind::Stored => {
                    info.published = true;
                    state.counters.published_blocks += 1;
                    // Consecutive blocks of one prompt go in one event, as vLLM sends them.
                    if let Some(Event::Stored { hashes, tokens, .. }) = batch.last_mut() {
                        if hashes.last() == info.parent.as_ref() {
                            hashes.push(info.digest);
                            tokens.extend_from_slice(&info.tokens);
                            continue;
                        }
                    }
                    batch.push(Event::Stored {
                        hashes: vec![info.digest],
                        parent: info.parent,
                        tokens: info.tokens.clone(),
                        block_size,
                        salt: info.salt.clone(),
                    });
                }
                KvEventKind::Evicted => {
                    if info.published {
                        info.published = false;
                        state.counters.published_blocks -= 1;
                        batch.push(Event::Removed { hash: info.digest });
                    }
                    if info.refs == 0 {
                        state.blocks.remove(&ev.block);
                    }
                }
            }
        }
        self.publish(state, batch);
        for &job in &out.first_tokens {
            let j = &state.jobs[job as usize];
            let input = state.requests[job as usize].input_length;
            let cached = (u64::from(j.hit_blocks) * u64::from(block_size)).min(input);
            state.counters.prefix_queries += input;
            state.counters.prefix_hits += cached;
            if let Some(w) = &state.waiters[job as usize] {
                let _ = w.send(Progress::FirstToken {
                    cached_tokens: cached,
                });
            }
        }
        for &job in &out.finished {
            let request = &state.requests[job as usize];
            state.counters.generation_tokens += request.output_length;
            state.counters.requests_finished += 1;
            let full = request.input_length / u64::from(block_size);
            for &id in request.hash_ids.iter().take(full as usize) {
                if let Some(info) = state.blocks.get_mut(&id) {
                    info.refs = info.refs.saturating_sub(1);
                    if info.refs == 0 && !info.published {
                        state.blocks.remove(&id);
                    }
                }
            }
            if let Some(w) = state.waiters[job as usize].take() {
                let _ = w.send(Progress::Finished);
            }
            state.free.push(job);
        }
        out.clear();
        state.out = out;
    }
}

/// Sleep until the model's next wake-up (or a new request), then catch it up; for as long as
/// the process runs.
async fn drive(r: Arc<Rank>) {
    loop {
        let next = {
            let mut state = r.lock();
            r.catch_up(&mut state, r.now_ns());
            state.engine.wake()
        };
        let at = next.map(|ns| r.epoch + std::time::Duration::from_nanos(ns));
        // A request submitted since the lock was released left a permit: this returns at once.
        let notified = r.wake.notified();
        match at {
            Some(at) => {
                tokio::select! {
                    () = tokio::time::sleep_until(tokio::time::Instant::from_std(at)) => {}
                    () = notified => {}
                }
            }
            None => notified.await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use router_runtime::kv_events::decode::{decode_payload, EngineEvent, EngineHash};
    use router_sim::replay::engine::{EngineSpec, KvCapacity};

    fn rank(kv_blocks: u64) -> (Arc<Rank>, mpsc::UnboundedReceiver<(u64, Bytes)>) {
        let spec = EngineSpec {
            kv_blocks: Some(KvCapacity::Blocks(kv_blocks)),
            step_overhead_ms: Some(0.0),
            decode_ms_per_seq: Some(0.0),
            prefill_ms_per_token: Some(0.0),
            ..EngineSpec::default()
        };
        let settings = Arc::new(Settings {
            block_size: 4,
            capacity_blocks: Some(kv_blocks),
        });
        let (sender, receiver) = mpsc::unbounded_channel();
        let params = spec.resolve(4).expect("valid");
        let (r, _driver) = Rank::start(0, params, settings, Format::default(), Some(sender));
        (r, receiver)
    }

    async fn run(r: &Rank, tokens: &[u32], output: u64) -> u64 {
        let mut progress = r.submit(tokens, output, None).expect("accepted");
        let mut cached = None;
        while let Some(p) = progress.recv().await {
            match p {
                Progress::FirstToken { cached_tokens } => cached = Some(cached_tokens),
                Progress::Finished => return cached.expect("first token before the end"),
            }
        }
        panic!("the request never finished");
    }

    fn events(receiver: &mut mpsc::UnboundedReceiver<(u64, Bytes)>) -> Vec<(u64, EngineEvent)> {
        let mut out = Vec::new();
        while let Ok((seq, payload)) = receiver.try_recv() {
            let batch = decode_payload(&payload).expect("decodes");
            out.extend(batch.events.into_iter().map(|e| (seq, e.expect("event"))));
        }
        out
    }

    #[tokio::test]
    async fn full_blocks_are_published_chained_and_the_tail_never() {
        let (r, mut rx) = rank(100);
        // 2 full blocks and 2 tokens.
        let tokens: Vec<u32> = (1..=10).collect();
        assert_eq!(run(&r, &tokens, 3).await, 0);
        let got = events(&mut rx);
        let a = events::block_digest(None, &tokens[..4], None);
        let b = events::block_digest(Some(&a), &tokens[4..8], None);
        let int = |d: &[u8; 32]| EngineHash::Int(events::model_id(d));
        assert_eq!(got.len(), 1, "{got:?}");
        let (seq, EngineEvent::BlockStored(stored)) = &got[0] else {
            panic!("{got:?}")
        };
        assert_eq!(*seq, 0);
        assert_eq!(stored.block_hashes, vec![int(&a), int(&b)]);
        assert_eq!(stored.parent_block_hash, None);
        assert_eq!(stored.token_ids, tokens[..8].to_vec());
        // The same prompt again: both blocks hit, nothing new published.
        assert_eq!(run(&r, &tokens, 3).await, 8);
        assert!(events(&mut rx).is_empty());
        // An extension: only its new block, chained from the old last one.
        let longer: Vec<u32> = (1..=12).collect();
        assert_eq!(run(&r, &longer, 1).await, 8);
        let got = events(&mut rx);
        let c = events::block_digest(Some(&b), &longer[8..12], None);
        let (_, EngineEvent::BlockStored(stored)) = &got[0] else {
            panic!("{got:?}")
        };
        assert_eq!(stored.block_hashes, vec![int(&c)]);
        assert_eq!(stored.parent_block_hash, Some(int(&b)));
        let s = r.snapshot();
        assert_eq!((s.running, s.waiting, s.kv_in_use), (0, 0, 0));
        assert_eq!(s.counters.published_blocks, 3);
        assert_eq!(s.counters.prefix_queries, 10 + 10 + 12);
        assert_eq!(s.counters.prefix_hits, 8 + 8);
    }

    #[tokio::test]
    async fn a_cache_salt_separates_prompts_and_marks_the_first_block() {
        let (r, mut rx) = rank(100);
        let tokens: Vec<u32> = (1..=8).collect();
        let mut progress = r.submit(&tokens, 1, Some("tenant-a")).expect("accepted");
        while progress
            .recv()
            .await
            .is_some_and(|p| p != Progress::Finished)
        {}
        let got = events(&mut rx);
        let (_, EngineEvent::BlockStored(stored)) = &got[0] else {
            panic!("{got:?}")
        };
        assert!(!stored.plain_keys());
        assert_eq!(stored.block_hashes.len(), 2);
        // The same tokens without the salt share nothing with it.
        assert_eq!(run(&r, &tokens, 1).await, 0);
        let got = events(&mut rx);
        let (_, EngineEvent::BlockStored(plain)) = &got[0] else {
            panic!("{got:?}")
        };
        assert!(plain.plain_keys());
        assert_ne!(plain.block_hashes[0], stored.block_hashes[0]);
    }

    #[tokio::test]
    async fn evictions_remove_published_blocks_only_and_reset_clears() {
        // 6 blocks: a prompt of 4 full blocks + 1 output block takes 5.
        let (r, mut rx) = rank(6);
        let first: Vec<u32> = (0..16).collect();
        let second: Vec<u32> = (100..116).collect();
        run(&r, &first, 1).await;
        run(&r, &second, 1).await;
        let got = events(&mut rx);
        let removed: Vec<_> = got
            .iter()
            .filter(|(_, e)| matches!(e, EngineEvent::BlockRemoved { .. }))
            .collect();
        // The second needs 5 of 6 with the first's 4 cached: 3 of them go.
        assert_eq!(removed.len(), 3, "{got:?}");
        assert_eq!(r.snapshot().counters.published_blocks, 4 + 4 - 3);
        assert!(r.submit(&(0..40).collect::<Vec<u32>>(), 1, None).is_err());
        assert!(r.reset_prefix_cache());
        let got = events(&mut rx);
        assert!(matches!(
            got.last(),
            Some((_, EngineEvent::AllBlocksCleared { .. }))
        ));
        assert_eq!(r.snapshot().counters.published_blocks, 0);
        // An empty cache: the first prompt is computed again.
        assert_eq!(run(&r, &first, 1).await, 0);
    }
}
