//! KV-event messages captured from a real vLLM engine (tests/fixtures/vllm-events/, README there)
//! through router-host's decoder and ingestion, as `serve` applies them.
//!
//! Each `wN-pM/` directory holds the first messages of one engine process, in order from its
//! seq 0, one file per frame (`seqNNNNN.frame0` topic, `.frame1` seq, `.frame2` msgpack payload).

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};

use router_core::blocks::{BlockHasher, Tenant};
use router_core::kv_index::{KvEventKind, Tier};
use router_host::serve::kv_events::decode::{
    decode_payload, decode_seq, EngineEvent, EngineHash, EventBatch,
};
use router_host::serve::kv_events::ingest::{RowIngest, SeqCheck, Sink, Tally, Update};

/// The engines' `--block-size` when these were captured.
const BLOCK_SIZE: u32 = 32;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vllm-events")
}

/// One captured message: its seq (from the file name) and its three frames.
struct Message {
    name: String,
    seq_in_name: u64,
    frames: [Vec<u8>; 3],
}

/// The engine processes captured, by directory name, each with its messages in seq order.
fn processes() -> BTreeMap<String, Vec<Message>> {
    let mut out = BTreeMap::new();
    let dir = fixtures();
    for entry in fs::read_dir(&dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display())) {
        let path = entry.expect("directory entry").path();
        if !path.is_dir() {
            continue;
        }
        let mut seqs: BTreeMap<u64, String> = BTreeMap::new();
        for file in fs::read_dir(&path).expect("read a process directory") {
            let name = file
                .expect("entry")
                .file_name()
                .into_string()
                .expect("utf-8");
            let Some(stem) = name.strip_suffix(".frame0") else {
                continue;
            };
            let seq = stem
                .strip_prefix("seq")
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("{}: bad fixture name {name}", path.display()));
            seqs.insert(seq, stem.to_owned());
        }
        let messages = seqs
            .into_iter()
            .map(|(seq, stem)| {
                let frame = |i: usize| {
                    let file = path.join(format!("{stem}.frame{i}"));
                    fs::read(&file).unwrap_or_else(|e| panic!("read {}: {e}", file.display()))
                };
                Message {
                    name: format!("{}/{stem}", path.file_name().unwrap().to_string_lossy()),
                    seq_in_name: seq,
                    frames: [frame(0), frame(1), frame(2)],
                }
            })
            .collect::<Vec<_>>();
        assert!(!messages.is_empty(), "{}: no messages", path.display());
        out.insert(
            path.file_name().unwrap().to_string_lossy().into_owned(),
            messages,
        );
    }
    assert!(
        out.len() >= 2,
        "expected at least two captured engine processes in {}",
        dir.display()
    );
    out
}

fn decode(m: &Message) -> (u64, EventBatch) {
    let seq = decode_seq(&m.frames[1]).unwrap_or_else(|e| panic!("{}: seq: {e}", m.name));
    let batch = decode_payload(&m.frames[2]).unwrap_or_else(|e| panic!("{}: payload: {e}", m.name));
    (seq, batch)
}

#[derive(Default)]
struct Recorder {
    held: HashSet<u64>,
    clears: usize,
}

impl Sink for Recorder {
    fn apply(&mut self, updates: &[Update]) {
        for (kind, tier, id) in updates {
            assert_eq!(
                *tier,
                Tier::Device,
                "the captured engines ran without offloading"
            );
            match kind {
                KvEventKind::Stored => self.held.insert(*id),
                KvEventKind::Evicted => self.held.remove(id),
            };
        }
    }
    fn clear(&mut self) {
        self.clears += 1;
        self.held.clear();
    }
    fn clear_tier(&mut self, tier: Tier) {
        assert_eq!(tier, Tier::Device);
        self.clears += 1;
        self.held.clear();
    }
}

#[test]
fn every_captured_message_decodes_with_every_field_as_vllm_sent_it() {
    let mut kinds = HashSet::new();
    let mut hashes_over_i64_max = 0;
    for (process, messages) in processes() {
        for m in &messages {
            assert!(m.frames[0].is_empty(), "{}: the topic was \"\"", m.name);
            let (seq, batch) = decode(m);
            assert_eq!(seq, m.seq_in_name, "{}: seq frame", m.name);
            assert!(
                batch.ts.is_some_and(|ts| ts > 1.7e9),
                "{}: ts {:?}",
                m.name,
                batch.ts
            );
            assert_eq!(batch.dp_rank, Some(0), "{}: data_parallel_rank", m.name);
            assert!(!batch.events.is_empty(), "{}: an empty batch", m.name);
            for event in &batch.events {
                let event = event
                    .as_ref()
                    .unwrap_or_else(|e| panic!("{}: an event did not decode: {e}", m.name));
                match event {
                    EngineEvent::BlockStored(b) => {
                        kinds.insert("BlockStored");
                        assert_eq!(b.block_size, Some(u64::from(BLOCK_SIZE)), "{}", m.name);
                        assert_eq!(
                            b.token_ids.len(),
                            b.block_hashes.len() * BLOCK_SIZE as usize,
                            "{}: tokens per block",
                            m.name
                        );
                        assert_eq!(b.medium.as_deref(), Some("GPU"), "{}", m.name);
                        assert_eq!(b.group_idx, Some(0), "{}", m.name);
                        assert!(b.plain_keys(), "{}: extra_keys are all null", m.name);
                        assert_eq!(b.lora_name, None, "{}", m.name);
                        for h in b.block_hashes.iter().chain(&b.parent_block_hash) {
                            match h {
                                EngineHash::Int(v) if *v > i64::MAX as u64 => {
                                    hashes_over_i64_max += 1
                                }
                                EngineHash::Int(_) => {}
                                EngineHash::Bytes(_) => panic!("{}: a 32-byte hash", m.name),
                            }
                        }
                    }
                    EngineEvent::BlockRemoved {
                        block_hashes,
                        medium,
                        group_idx,
                    } => {
                        kinds.insert("BlockRemoved");
                        assert!(!block_hashes.is_empty(), "{}", m.name);
                        assert_eq!(medium.as_deref(), Some("GPU"), "{}", m.name);
                        assert_eq!(*group_idx, Some(0), "{}", m.name);
                    }
                    EngineEvent::AllBlocksCleared { .. } => {
                        kinds.insert("AllBlocksCleared");
                    }
                    EngineEvent::Unknown(kind) => {
                        panic!("{process}: {}: unknown event type {kind}", m.name)
                    }
                }
            }
        }
    }
    for kind in ["BlockStored", "BlockRemoved", "AllBlocksCleared"] {
        assert!(kinds.contains(kind), "no {kind} among the fixtures");
    }
    assert!(
        hashes_over_i64_max > 0,
        "the fixtures have u64 hashes over i64::MAX (vLLM's are unsigned)"
    );
}

/// Each process's messages, applied in order as `serve` does, leave the row holding exactly
/// the blocks the events say are cached, with the router ids the proxy computes for the same
/// tokens; nothing is refused, ignored or lost.
#[test]
fn captured_sequences_ingest_without_a_refusal_and_chain_to_the_prompt_ids() {
    let hasher = BlockHasher::new(BLOCK_SIZE, Tenant::default()).expect("hasher");
    let mut removals_applied = 0;
    let mut chained = 0;
    for (process, messages) in processes() {
        let mut ingest = RowIngest::new(BLOCK_SIZE).expect("row");
        let mut sink = Recorder::default();
        let mut tally = Tally::default();
        // What the events say the engine caches, kept here independently of the ingestion.
        let mut cached: HashSet<EngineHash> = HashSet::new();
        // The router id each engine hash must get: the chain over its tokens from the prompt's root.
        let mut expected_id: std::collections::HashMap<EngineHash, u64> = Default::default();
        for (i, m) in messages.iter().enumerate() {
            let (seq, batch) = decode(m);
            let check = ingest.check_seq(seq);
            let want = if i == 0 {
                SeqCheck::First
            } else {
                SeqCheck::InOrder
            };
            assert_eq!(check, want, "{}: sequence", m.name);
            for event in batch.events.iter().flatten() {
                match event {
                    EngineEvent::BlockStored(b) => {
                        let mut parent = b.parent_block_hash.map(|p| {
                            *expected_id
                                .get(&p)
                                .unwrap_or_else(|| panic!("{}: parent never stored", m.name))
                        });
                        for (h, tokens) in b
                            .block_hashes
                            .iter()
                            .zip(b.token_ids.chunks_exact(BLOCK_SIZE as usize))
                        {
                            let id = hasher.chain(parent, tokens).expect("chain");
                            expected_id.insert(*h, id);
                            cached.insert(*h);
                            parent = Some(id);
                        }
                    }
                    EngineEvent::BlockRemoved { block_hashes, .. } => {
                        for h in block_hashes {
                            assert!(
                                cached.remove(h),
                                "{}: removal of a block never stored",
                                m.name
                            );
                            removals_applied += 1;
                        }
                    }
                    EngineEvent::AllBlocksCleared { .. } => cached.clear(),
                    EngineEvent::Unknown(_) => {}
                }
            }
            ingest.apply(batch, &mut sink, &mut tally);
        }
        assert!(
            tally.refused.is_empty(),
            "{process}: refused {:?}",
            tally.refused
        );
        assert!(
            tally.ignored.is_empty(),
            "{process}: ignored {:?}",
            tally.ignored
        );
        assert!(
            tally.decode_errors.is_empty(),
            "{process}: decode errors {:?}",
            tally.decode_errors
        );
        assert_eq!(ingest.len(), cached.len(), "{process}: blocks held");
        assert!(
            !cached.is_empty(),
            "{process}: the capture ends with blocks cached"
        );
        let want: HashSet<u64> = cached.iter().map(|h| expected_id[h]).collect();
        assert_eq!(sink.held, want, "{process}: the index's router ids");
        for h in &cached {
            assert_eq!(
                ingest.router_id(h),
                Some(expected_id[h]),
                "{process}: {h:?}"
            );
        }
        // A prompt that starts like a cached root block finds that block: the proxy's ids.
        for m in &messages {
            let (_, batch) = decode(m);
            for event in batch.events.iter().flatten() {
                if let EngineEvent::BlockStored(b) = event {
                    if b.parent_block_hash.is_none() {
                        let mut ids = Vec::new();
                        hasher.prompt_blocks(&b.token_ids, &mut ids);
                        assert_eq!(
                            ids.first().copied(),
                            expected_id.get(&b.block_hashes[0]).copied(),
                            "{}: prompt ids",
                            m.name
                        );
                        chained += 1;
                    }
                }
            }
        }
    }
    assert!(
        removals_applied > 0,
        "the fixtures include evictions of stored blocks"
    );
    assert!(
        chained > 0,
        "the fixtures include blocks stored from the root"
    );
}

/// The second process of an engine (restarted) starts its seq over: ingestion sees a restart.
#[test]
fn a_restarted_engine_is_seen_as_a_restart() {
    let all = processes();
    let (first, second) = (all.get("w2-p1"), all.get("w2-p2"));
    let (Some(first), Some(second)) = (first, second) else {
        panic!("expected w2-p1 and w2-p2 (engine 2 before and after its restart)");
    };
    let mut ingest = RowIngest::new(BLOCK_SIZE).expect("row");
    let mut sink = Recorder::default();
    let mut tally = Tally::default();
    for m in first {
        let (seq, batch) = decode(m);
        ingest.check_seq(seq);
        ingest.apply(batch, &mut sink, &mut tally);
    }
    assert!(!ingest.is_empty(), "the first process left blocks");
    let (seq, batch) = decode(&second[0]);
    let last = first.last().map(|m| m.seq_in_name).unwrap_or(0);
    assert_eq!(ingest.check_seq(seq), SeqCheck::Restart { last, got: seq });
    ingest.clear(&mut sink);
    ingest.apply(batch, &mut sink, &mut tally);
    assert_eq!(Tally::count(&tally.refused, "unknown_parent"), 0);
    assert!(tally.refused.is_empty(), "refused {:?}", tally.refused);
}
