//! One row's ingestion state: the engine-hash map, per-tier reference counts and limits.

use std::collections::HashMap;

use router_core::blocks::{BlockHasher, Tenant};
use router_core::kv_index::{KvEventKind, Tier};

use super::{bump, cache_salt, tier_of, SeqCheck, Sink, Tally, Update};
use crate::kv_events::decode::{BlockStored, DecodeError, EngineEvent, EngineHash};

/// One engine hash the row holds: its router id and, per tier, how many stores are not yet
/// matched by a removal (the device tier announces a block once, so 0 or 1 there).
#[derive(Debug, Clone, Copy)]
struct Held {
    id: u64,
    refs: [u32; 3],
}

impl Held {
    fn is_empty(&self) -> bool {
        self.refs == [0; 3]
    }
}

/// One row's ingestion state.
#[derive(Debug)]
pub struct RowIngest {
    block_size: u32,
    hasher: BlockHasher,
    map: HashMap<EngineHash, Held>,
    /// Blocks held per tier (entries of `map` with a reference there).
    per_tier: [usize; 3],
    /// Tiers the row ever reported a block on.
    seen: [bool; 3],
    last_seq: Option<u64>,
    pending: Vec<Update>,
    /// Most blocks held per tier, and why that many (see [`RowIngest::set_limit`]).
    limits: [(usize, &'static str); 3],
}

impl RowIngest {
    /// Ingestion with blocks of `block_size` tokens (the configured one: must match the
    /// engine's). Fails only on a block size of 0.
    pub fn new(block_size: u32) -> Result<Self, router_core::blocks::BlockHashError> {
        Ok(RowIngest {
            block_size,
            hasher: BlockHasher::new(block_size, Tenant::default())?,
            map: HashMap::new(),
            per_tier: [0; 3],
            seen: [false; 3],
            last_seq: None,
            pending: Vec::new(),
            limits: [(usize::MAX, "over_limit"); 3],
        })
    }

    /// Hold at most `blocks` blocks on `tier`; over that, the tier is cleared and the drop
    /// counted under `reason`.
    pub fn set_limit(&mut self, tier: Tier, blocks: usize, reason: &'static str) {
        self.limits[tier as usize] = (blocks, reason);
    }

    /// Blocks the row holds on `tier`.
    pub fn blocks_on(&self, tier: Tier) -> usize {
        self.per_tier[tier as usize]
    }

    /// Whether the row ever reported a block on `tier`.
    pub fn has_seen(&self, tier: Tier) -> bool {
        self.seen[tier as usize]
    }

    /// Blocks the row holds on any tier (engine hashes mapped).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// What the row holds, as stores to seed a fresh index (a reloaded configuration).
    pub fn holdings(&self) -> impl Iterator<Item = Update> + '_ {
        self.map.values().flat_map(|held| {
            Tier::ALL
                .into_iter()
                .filter(|&tier| held.refs[tier as usize] > 0)
                .map(|tier| (KvEventKind::Stored, tier, held.id))
        })
    }

    /// The router id of an engine hash, if the row holds it on the device.
    pub fn router_id(&self, hash: &EngineHash) -> Option<u64> {
        self.map
            .get(hash)
            .filter(|held| held.refs[Tier::Device as usize] > 0)
            .map(|held| held.id)
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

    /// Forget the row (engine restart): the map here, every tier of the index through `sink`.
    pub fn clear(&mut self, sink: &mut dyn Sink) {
        self.pending.clear();
        self.map.clear();
        self.per_tier = [0; 3];
        sink.clear();
    }

    /// Forget what the row holds on `tier`, here and through `sink`.
    fn clear_tier(&mut self, tier: Tier, sink: &mut dyn Sink) {
        self.map.retain(|_, held| {
            held.refs[tier as usize] = 0;
            !held.is_empty()
        });
        self.per_tier[tier as usize] = 0;
        sink.clear_tier(tier);
    }

    /// Apply one decoded batch's events, in order; updates go to `sink` in one call where
    /// possible. After each event every tier is within its limit.
    pub fn apply(
        &mut self,
        events: impl IntoIterator<Item = Result<EngineEvent, DecodeError>>,
        sink: &mut dyn Sink,
        tally: &mut Tally,
    ) {
        for event in events {
            self.bound(sink, tally);
            match event {
                Err(_) => bump(&mut tally.decode_errors, "event"),
                Ok(EngineEvent::BlockStored(stored)) => self.stored(stored, tally),
                Ok(EngineEvent::BlockRemoved {
                    block_hashes,
                    medium,
                    group_idx,
                }) => {
                    let Some(tier) = tier_of(medium.as_deref()) else {
                        bump(&mut tally.ignored, "medium");
                        continue;
                    };
                    if group_idx.unwrap_or(0) != 0 {
                        bump(&mut tally.ignored, "group");
                        continue;
                    }
                    for hash in block_hashes {
                        if !self.release(&hash, tier) {
                            bump(&mut tally.ignored, "unknown_block");
                        }
                    }
                    bump(&mut tally.applied, "block_removed");
                }
                Ok(EngineEvent::AllBlocksCleared { medium }) => {
                    let Some(tier) = tier_of(medium.as_deref()) else {
                        bump(&mut tally.ignored, "medium");
                        continue;
                    };
                    self.flush(sink);
                    self.clear_tier(tier, sink);
                    bump(&mut tally.applied, "all_blocks_cleared");
                    bump(&mut tally.clears, "all_blocks_cleared");
                }
                Ok(EngineEvent::Unknown(_)) => bump(&mut tally.ignored, "unknown_type"),
            }
        }
        self.bound(sink, tally);
        self.flush(sink);
    }

    /// Keep every tier within its limit. Over it, the engine's events contradict its own
    /// capacity (removals lost, or a publisher that lies): which of the blocks are stale cannot
    /// be told (the map has no order), so the tier is cleared, as after `AllBlocksCleared`,
    /// and rebuilt from the stores that follow. The index only ever under-claims.
    fn bound(&mut self, sink: &mut dyn Sink, tally: &mut Tally) {
        for tier in Tier::ALL {
            let (limit, reason) = self.limits[tier as usize];
            let held = self.per_tier[tier as usize];
            if held > limit {
                self.flush(sink);
                self.clear_tier(tier, sink);
                tally.evicted.push((tier, reason, held as u64));
                bump(&mut tally.clears, "over_capacity");
            }
        }
    }

    fn flush(&mut self, sink: &mut dyn Sink) {
        if !self.pending.is_empty() {
            sink.apply(&self.pending);
            self.pending.clear();
        }
    }

    /// One more store of `hash` (router id `id`) on `tier`; the index hears of the first.
    fn hold(&mut self, hash: EngineHash, id: u64, tier: Tier) {
        let held = self.map.entry(hash).or_insert(Held { id, refs: [0; 3] });
        let refs = &mut held.refs[tier as usize];
        if tier == Tier::Device && *refs > 0 {
            return; // the device announces a block once; a repeat changes nothing
        }
        *refs += 1;
        self.seen[tier as usize] = true;
        if *refs == 1 {
            self.per_tier[tier as usize] += 1;
            self.pending.push((KvEventKind::Stored, tier, held.id));
        }
    }

    /// One removal of `hash` from `tier`; the index hears of the last. `false` when the row
    /// does not hold it there.
    fn release(&mut self, hash: &EngineHash, tier: Tier) -> bool {
        let Some(held) = self.map.get_mut(hash) else {
            return false;
        };
        let refs = &mut held.refs[tier as usize];
        if *refs == 0 {
            return false;
        }
        *refs -= 1;
        if *refs == 0 {
            self.per_tier[tier as usize] -= 1;
            self.pending.push((KvEventKind::Evicted, tier, held.id));
            if held.is_empty() {
                self.map.remove(hash);
            }
        }
        true
    }

    fn stored(&mut self, stored: BlockStored, tally: &mut Tally) {
        let Some(tier) = tier_of(stored.medium.as_deref()) else {
            bump(&mut tally.ignored, "medium");
            return;
        };
        if stored.group_idx.unwrap_or(0) != 0 {
            bump(&mut tally.ignored, "group");
            return;
        }
        // 0: an offload placeholder, which gives no block size.
        if stored
            .block_size
            .is_some_and(|b| b != 0 && b != u64::from(self.block_size))
        {
            bump(&mut tally.refused, "block_size");
            return;
        }
        if tier != Tier::Device && stored.token_ids.is_empty() {
            // A bare offloaded hash: known only if the row stored it with its tokens before.
            for hash in stored.block_hashes {
                match self.map.get(&hash) {
                    Some(held) => {
                        let id = held.id;
                        self.hold(hash, id, tier);
                    }
                    None => bump(&mut tally.ignored, "unknown_block"),
                }
            }
            bump(&mut tally.applied, "block_stored");
            return;
        }
        let Some(salt) = cache_salt(&stored) else {
            // Multimodal inputs, prompt embeddings: ids from the tokens would be wrong.
            bump(&mut tally.refused, "extra_keys");
            return;
        };
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
                Some(held) => Some(held.id),
                None => {
                    bump(&mut tally.refused, "unknown_parent");
                    return;
                }
            },
        };
        // The tenant's root starts a chain (a null parent): the adapter and the salt separate
        // its blocks from everyone else's, as the proxy's ids of the same prompt do.
        let tenant_hasher;
        let hasher = match (stored.lora_name.as_deref(), salt) {
            (None, None) => &self.hasher,
            (lora, cache_salt) => {
                match BlockHasher::new(self.block_size, Tenant { lora, cache_salt }) {
                    Ok(h) => {
                        tenant_hasher = h;
                        &tenant_hasher
                    }
                    Err(_) => return,
                }
            }
        };
        let mut ids = Vec::with_capacity(stored.block_hashes.len());
        for tokens in stored.token_ids.chunks_exact(size) {
            let Ok(id) = hasher.chain(parent, tokens) else {
                bump(&mut tally.refused, "token_count");
                return;
            };
            ids.push(id);
            parent = Some(id);
        }
        for (hash, id) in stored.block_hashes.into_iter().zip(ids) {
            self.hold(hash, id, tier);
        }
        bump(&mut tally.applied, "block_stored");
    }
}
