//! Typed events of one `(worker, rank)` → KV-index updates in router block ids.
//!
//! The row keeps a map from the engine's block hash to the router's block id. `BlockStored`
//! hashes its `token_ids` block by block with the core's [`BlockHasher`], chained from the
//! parent's router id (looked up in the map) or from the root when the parent is null; removals
//! go through the same map. `AllBlocksCleared`, and a sequence number that goes backwards (the
//! engine restarted with an empty cache), clear the row and the map. Only the device tier is
//! indexed: the core's index has no host or disk tier yet.

use std::collections::HashMap;

use router_core::blocks::{BlockHasher, Tenant};
use router_core::kv_index::KvEventKind;

use super::decode::{BlockStored, EngineEvent, EngineHash, EventBatch};

/// Where a row's updates go (the routing core in `serve`, a recorder in tests).
pub trait Sink {
    /// Apply events in order.
    fn apply(&mut self, events: &[(KvEventKind, u64)]);
    /// Forget everything the row holds.
    fn clear(&mut self);
}

/// What one batch did, by label (added to the metrics by the caller).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Tally {
    /// By kind: `block_stored`, `block_removed`, `all_blocks_cleared`.
    pub applied: Vec<(&'static str, u64)>,
    /// By reason: `block_size`, `token_count`, `unknown_parent`, `extra_keys`.
    pub refused: Vec<(&'static str, u64)>,
    /// By reason: `medium`, `group`, `unknown_type`, `unknown_block`.
    pub ignored: Vec<(&'static str, u64)>,
    /// Events that did not decode (`event`).
    pub decode_errors: Vec<(&'static str, u64)>,
    /// By cause: `restart`, `all_blocks_cleared`.
    pub clears: Vec<(&'static str, u64)>,
}

fn bump(list: &mut Vec<(&'static str, u64)>, label: &'static str) {
    match list.iter_mut().find(|(l, _)| *l == label) {
        Some((_, n)) => *n += 1,
        None => list.push((label, 1)),
    }
}

impl Tally {
    pub fn count(list: &[(&'static str, u64)], label: &str) -> u64 {
        list.iter()
            .find(|(l, _)| *l == label)
            .map_or(0, |(_, n)| *n)
    }
}

/// How a batch's sequence number relates to the last one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqCheck {
    /// The first batch seen.
    First,
    /// The next one.
    InOrder,
    /// Batches `expected .. got` were lost.
    Gap { expected: u64, got: u64 },
    /// The sequence went backwards (or repeated): the engine restarted.
    Restart { last: u64, got: u64 },
}

/// One row's ingestion state.
#[derive(Debug)]
pub struct RowIngest {
    block_size: u32,
    hasher: BlockHasher,
    map: HashMap<EngineHash, u64>,
    last_seq: Option<u64>,
    pending: Vec<(KvEventKind, u64)>,
}

/// The device tier: vLLM's `"GPU"`, or no medium (engines that predate the field).
pub fn is_device(medium: Option<&str>) -> bool {
    medium.is_none_or(|m| m.eq_ignore_ascii_case("GPU"))
}

impl RowIngest {
    /// Ingestion with blocks of `block_size` tokens (the configured one: must match the
    /// engine's). Fails only on a block size of 0.
    pub fn new(block_size: u32) -> Result<Self, router_core::blocks::BlockHashError> {
        Ok(RowIngest {
            block_size,
            hasher: BlockHasher::new(block_size, Tenant::default())?,
            map: HashMap::new(),
            last_seq: None,
            pending: Vec::new(),
        })
    }

    /// Blocks the row holds (engine hashes mapped).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The router ids the row holds, to seed a fresh index (a reloaded configuration).
    pub fn router_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.map.values().copied()
    }

    /// The router id of an engine hash, if the row holds it.
    pub fn router_id(&self, hash: &EngineHash) -> Option<u64> {
        self.map.get(hash).copied()
    }

    pub fn last_seq(&self) -> Option<u64> {
        self.last_seq
    }

    /// Record `seq` as the latest batch and say how it follows the previous one.
    pub fn check_seq(&mut self, seq: u64) -> SeqCheck {
        let check = match self.last_seq {
            None => SeqCheck::First,
            Some(last) if seq == last.wrapping_add(1) => SeqCheck::InOrder,
            Some(last) if seq > last => SeqCheck::Gap {
                expected: last + 1,
                got: seq,
            },
            Some(last) => SeqCheck::Restart { last, got: seq },
        };
        self.last_seq = Some(seq);
        check
    }

    /// Forget the row (engine restart): the map here, the index through `sink`.
    pub fn clear(&mut self, sink: &mut dyn Sink) {
        self.pending.clear();
        self.map.clear();
        sink.clear();
    }

    /// Apply one decoded batch; updates go to `sink` in one call where possible.
    pub fn apply(&mut self, batch: EventBatch, sink: &mut dyn Sink, tally: &mut Tally) {
        for event in batch.events {
            match event {
                Err(_) => bump(&mut tally.decode_errors, "event"),
                Ok(EngineEvent::BlockStored(stored)) => self.stored(stored, tally),
                Ok(EngineEvent::BlockRemoved {
                    block_hashes,
                    medium,
                    group_idx,
                }) => {
                    if !is_device(medium.as_deref()) {
                        bump(&mut tally.ignored, "medium");
                        continue;
                    }
                    if group_idx.unwrap_or(0) != 0 {
                        bump(&mut tally.ignored, "group");
                        continue;
                    }
                    for hash in block_hashes {
                        match self.map.remove(&hash) {
                            Some(id) => self.pending.push((KvEventKind::Evicted, id)),
                            None => bump(&mut tally.ignored, "unknown_block"),
                        }
                    }
                    bump(&mut tally.applied, "block_removed");
                }
                Ok(EngineEvent::AllBlocksCleared { medium }) => {
                    if !is_device(medium.as_deref()) {
                        bump(&mut tally.ignored, "medium");
                        continue;
                    }
                    self.flush(sink);
                    self.clear(sink);
                    bump(&mut tally.applied, "all_blocks_cleared");
                    bump(&mut tally.clears, "all_blocks_cleared");
                }
                Ok(EngineEvent::Unknown(_)) => bump(&mut tally.ignored, "unknown_type"),
            }
        }
        self.flush(sink);
    }

    fn flush(&mut self, sink: &mut dyn Sink) {
        if !self.pending.is_empty() {
            sink.apply(&self.pending);
            self.pending.clear();
        }
    }

    fn stored(&mut self, stored: BlockStored, tally: &mut Tally) {
        if !is_device(stored.medium.as_deref()) {
            bump(&mut tally.ignored, "medium");
            return;
        }
        if stored.group_idx.unwrap_or(0) != 0 {
            bump(&mut tally.ignored, "group");
            return;
        }
        if stored
            .block_size
            .is_some_and(|b| b != u64::from(self.block_size))
        {
            bump(&mut tally.refused, "block_size");
            return;
        }
        if !stored.plain_keys {
            // Multimodal hashes, a cache salt...: ids from the tokens alone would be wrong.
            bump(&mut tally.refused, "extra_keys");
            return;
        }
        let size = self.block_size as usize;
        if stored.block_hashes.is_empty()
            || stored.token_ids.len() != stored.block_hashes.len().saturating_mul(size)
        {
            bump(&mut tally.refused, "token_count");
            return;
        }
        let mut parent = match &stored.parent_block_hash {
            None => None,
            Some(hash) => match self.map.get(hash) {
                Some(&id) => Some(id),
                None => {
                    bump(&mut tally.refused, "unknown_parent");
                    return;
                }
            },
        };
        let lora_hasher;
        let hasher = match stored.lora_name.as_deref() {
            None => &self.hasher,
            Some(lora) => {
                match BlockHasher::new(
                    self.block_size,
                    Tenant {
                        lora: Some(lora),
                        cache_salt: None,
                    },
                ) {
                    Ok(h) => {
                        lora_hasher = h;
                        &lora_hasher
                    }
                    Err(_) => return,
                }
            }
        };
        for (hash, tokens) in stored
            .block_hashes
            .iter()
            .zip(stored.token_ids.chunks_exact(size))
        {
            let Ok(id) = hasher.chain(parent, tokens) else {
                bump(&mut tally.refused, "token_count");
                return;
            };
            self.map.insert(*hash, id);
            self.pending.push((KvEventKind::Stored, id));
            parent = Some(id);
        }
        bump(&mut tally.applied, "block_stored");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Recorder {
        events: Vec<(KvEventKind, u64)>,
        clears: usize,
    }

    impl Sink for Recorder {
        fn apply(&mut self, events: &[(KvEventKind, u64)]) {
            self.events.extend_from_slice(events);
        }
        fn clear(&mut self) {
            self.clears += 1;
            self.events.clear();
        }
    }

    fn batch(events: Vec<EngineEvent>) -> EventBatch {
        EventBatch {
            ts: None,
            events: events.into_iter().map(Ok).collect(),
            dp_rank: None,
        }
    }

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>) -> EngineEvent {
        EngineEvent::BlockStored(BlockStored {
            block_hashes: hashes.iter().map(|&h| EngineHash::Int(h)).collect(),
            parent_block_hash: parent.map(EngineHash::Int),
            token_ids: tokens,
            block_size: Some(4),
            medium: Some("GPU".into()),
            plain_keys: true,
            ..BlockStored::default()
        })
    }

    #[test]
    fn stored_chains_like_prompts_and_removal_goes_through_the_map() {
        let mut row = RowIngest::new(4).expect("block size");
        let mut sink = Recorder::default();
        let mut tally = Tally::default();
        // Two events: the first block, then the second chained from it.
        row.apply(
            batch(vec![
                stored(&[100], None, vec![1, 2, 3, 4]),
                stored(&[200], Some(100), vec![5, 6, 7, 8]),
            ]),
            &mut sink,
            &mut tally,
        );
        let mut prompt = Vec::new();
        BlockHasher::new(4, Tenant::default())
            .expect("hasher")
            .prompt_blocks(&[1, 2, 3, 4, 5, 6, 7, 8, 9], &mut prompt);
        assert_eq!(prompt, vec![0xe17b6664480b6fea, 0x866dbff43edc58d6]);
        let ids: Vec<u64> = sink.events.iter().map(|(_, id)| *id).collect();
        assert_eq!(ids, prompt);
        assert_eq!(Tally::count(&tally.applied, "block_stored"), 2);

        row.apply(
            batch(vec![
                EngineEvent::BlockRemoved {
                    block_hashes: vec![EngineHash::Int(200), EngineHash::Int(999)],
                    medium: None,
                    group_idx: None,
                },
                stored(&[300], Some(12345), vec![1, 1, 1, 1]),
                stored(&[400], None, vec![1, 1, 1]),
                EngineEvent::BlockStored(BlockStored {
                    block_size: Some(16),
                    ..match stored(&[500], None, vec![1; 16]) {
                        EngineEvent::BlockStored(b) => b,
                        _ => unreachable!(),
                    }
                }),
                EngineEvent::BlockRemoved {
                    block_hashes: vec![EngineHash::Int(100)],
                    medium: Some("CPU".into()),
                    group_idx: None,
                },
            ]),
            &mut sink,
            &mut tally,
        );
        assert_eq!(sink.events.last(), Some(&(KvEventKind::Evicted, prompt[1])));
        assert_eq!(row.len(), 1);
        assert_eq!(Tally::count(&tally.ignored, "unknown_block"), 1);
        assert_eq!(Tally::count(&tally.refused, "unknown_parent"), 1);
        assert_eq!(Tally::count(&tally.refused, "token_count"), 1);
        assert_eq!(Tally::count(&tally.refused, "block_size"), 1);
        assert_eq!(Tally::count(&tally.ignored, "medium"), 1);

        row.apply(
            batch(vec![EngineEvent::AllBlocksCleared { medium: None }]),
            &mut sink,
            &mut tally,
        );
        assert!(row.is_empty());
        assert_eq!(sink.clears, 1);
    }

    #[test]
    fn sequence_numbers() {
        let mut row = RowIngest::new(4).expect("block size");
        assert_eq!(row.check_seq(5), SeqCheck::First);
        assert_eq!(row.check_seq(6), SeqCheck::InOrder);
        assert_eq!(
            row.check_seq(9),
            SeqCheck::Gap {
                expected: 7,
                got: 9
            }
        );
        assert_eq!(row.check_seq(0), SeqCheck::Restart { last: 9, got: 0 });
        assert_eq!(row.check_seq(0), SeqCheck::Restart { last: 0, got: 0 });
    }
}
