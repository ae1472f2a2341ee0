//! Typed events of one `(worker, rank)` → KV-index updates in router block ids.
//!
//! The row keeps a map from the engine's block hash to the router's block id and the tiers the
//! row holds it on. `BlockStored` hashes its `token_ids` block by block with the core's
//! [`BlockHasher`], chained from the parent's router id (looked up in the map) or from the root
//! when the parent is null; removals go through the same map. `medium` names the tier: `"GPU"`
//! (or none) the device, `"CPU"` the host, `"STORAGE"` the disk. An offload store may carry no
//! tokens (vLLM's offloading connector sends a bare hash unless its events are
//! self-describing): it is then mapped through the hash the row stored on the device. Offload
//! tiers may announce one hash several times, so they count references: the tier holds the
//! block until as many removals came. `AllBlocksCleared` clears the device tier (the block
//! pool is what sends it); a sequence number that goes backwards (the engine restarted, its
//! memory gone) clears every tier and the map.

use std::collections::HashMap;

use router_core::blocks::{BlockHasher, Tenant};
use router_core::kv_index::{KvEventKind, Tier};

use super::decode::{BlockKeys, BlockStored, DecodeError, EngineEvent, EngineHash};

/// One index update: what happened to which router block on which tier.
pub type Update = (KvEventKind, Tier, u64);

/// Where a row's updates go (the routing core in `serve`, a recorder in tests).
pub trait Sink {
    /// Apply updates in order.
    fn apply(&mut self, updates: &[Update]);
    /// Forget everything the row holds, on every tier.
    fn clear(&mut self);
    /// Forget what the row holds on `tier`.
    fn clear_tier(&mut self, tier: Tier);
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
    /// By cause: `restart`, `all_blocks_cleared`, `over_capacity`.
    pub clears: Vec<(&'static str, u64)>,
    /// Blocks dropped to keep a tier within its limit: tier, reason (`over_capacity`: the
    /// engine's reported KV capacity; `over_limit`: `max_indexed_blocks`), how many.
    pub evicted: Vec<(Tier, &'static str, u64)>,
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

/// How many blocks a tier may hold when its engine reports `capacity` blocks: the capacity
/// plus a quarter (a store can be published before the removal that made room for it) plus
/// 64, so that an honest engine never reaches it.
pub fn capacity_limit(capacity: u64) -> usize {
    let slack = capacity / 4 + 64;
    usize::try_from(capacity.saturating_add(slack)).unwrap_or(usize::MAX)
}

/// The tier a `medium` names: vLLM's `"GPU"` (or no medium, engines that predate the field)
/// is the device, `"CPU"` the host, `"STORAGE"` (or `"DISK"`) the disk; `None` for others.
pub fn tier_of(medium: Option<&str>) -> Option<Tier> {
    let Some(medium) = medium else {
        return Some(Tier::Device);
    };
    [
        ("GPU", Tier::Device),
        ("CPU", Tier::Host),
        ("STORAGE", Tier::Disk),
        ("DISK", Tier::Disk),
    ]
    .into_iter()
    .find_map(|(name, tier)| medium.eq_ignore_ascii_case(name).then_some(tier))
}

/// The `cache_salt` a store's extra keys carry (`Some(None)`: none), or `None` when they hold
/// something router ids cannot follow. vLLM's keys per block are the LoRA adapter's name (when
/// the event names one), then, on a prompt's first block only (a null parent, first hash), the
/// request's salt; multimodal and prompt-embedding keys are not strings.
fn cache_salt(stored: &BlockStored) -> Option<Option<&str>> {
    let mut salt = None;
    for (i, keys) in stored.extra_keys.iter().enumerate() {
        let strings = match keys {
            BlockKeys::None => continue,
            BlockKeys::Other => return None,
            BlockKeys::Strings(strings) => strings.as_slice(),
        };
        // An event that names an adapter keys every block with it first.
        let rest = match (stored.lora_name.as_deref(), strings.split_first()) {
            (None, _) => strings,
            (Some(lora), Some((first, rest))) if first == lora => rest,
            (Some(_), _) => return None,
        };
        match rest {
            [] => {}
            [s] if i == 0 && stored.parent_block_hash.is_none() => salt = Some(s.as_str()),
            _ => return None,
        }
    }
    Some(salt)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::kv_events::decode::{BlockKeys, EventBatch};

    /// The index a row's updates build: per tier, the router ids held.
    #[derive(Default)]
    struct Recorder {
        events: Vec<Update>,
        held: [std::collections::BTreeSet<u64>; 3],
        clears: usize,
        tier_clears: Vec<Tier>,
    }

    impl Sink for Recorder {
        fn apply(&mut self, updates: &[Update]) {
            self.events.extend_from_slice(updates);
            for &(kind, tier, id) in updates {
                let set = &mut self.held[tier as usize];
                let changed = match kind {
                    KvEventKind::Stored => set.insert(id),
                    KvEventKind::Evicted => set.remove(&id),
                };
                assert!(changed, "{kind:?} of {id:#x} on {tier:?} changes nothing");
            }
        }
        fn clear(&mut self) {
            self.clears += 1;
            self.events.clear();
            self.held = Default::default();
        }
        fn clear_tier(&mut self, tier: Tier) {
            self.tier_clears.push(tier);
            self.held[tier as usize].clear();
        }
    }

    impl Recorder {
        fn on(&self, tier: Tier) -> Vec<u64> {
            self.held[tier as usize].iter().copied().collect()
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
            extra_keys: Vec::new(),
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
        let ids: Vec<u64> = sink.events.iter().map(|(_, _, id)| *id).collect();
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
                    medium: Some("HBM".into()),
                    group_idx: None,
                },
            ]),
            &mut sink,
            &mut tally,
        );
        assert_eq!(
            sink.events.last(),
            Some(&(KvEventKind::Evicted, Tier::Device, prompt[1]))
        );
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
        assert_eq!(sink.tier_clears, vec![Tier::Device]);
        row.clear(&mut sink);
        assert_eq!(sink.clears, 1);
    }

    fn on(tier: &str, event: EngineEvent) -> EngineEvent {
        match event {
            EngineEvent::BlockStored(b) => EngineEvent::BlockStored(BlockStored {
                medium: Some(tier.into()),
                ..b
            }),
            other => other,
        }
    }

    fn removed(hashes: &[u64], medium: &str) -> EngineEvent {
        EngineEvent::BlockRemoved {
            block_hashes: hashes.iter().map(|&h| EngineHash::Int(h)).collect(),
            medium: Some(medium.into()),
            group_idx: None,
        }
    }

    /// vLLM's offloading connector without self-describing events: a bare hash, no tokens, no
    /// parent, block size 0.
    fn placeholder(hash: u64, medium: &str) -> EngineEvent {
        EngineEvent::BlockStored(BlockStored {
            block_hashes: vec![EngineHash::Int(hash)],
            block_size: Some(0),
            medium: Some(medium.into()),
            extra_keys: Vec::new(),
            ..BlockStored::default()
        })
    }

    #[test]
    fn offload_tiers_follow_the_device_hashes_and_count_references() {
        let mut row = RowIngest::new(4).expect("block size");
        let (mut sink, mut tally) = (Recorder::default(), Tally::default());
        let mut prompt = Vec::new();
        BlockHasher::new(4, Tenant::default())
            .expect("hasher")
            .prompt_blocks(&[1, 2, 3, 4, 5, 6, 7, 8], &mut prompt);
        row.apply(
            batch(vec![
                stored(&[100], None, vec![1, 2, 3, 4]),
                stored(&[200], Some(100), vec![5, 6, 7, 8]),
                // Offloaded: a bare hash the row knows, one it does not.
                placeholder(100, "CPU"),
                placeholder(777, "CPU"),
                // Self-describing, announced twice (two overlapping chunks), on disk.
                on(
                    "STORAGE",
                    stored(&[100, 200], None, vec![1, 2, 3, 4, 5, 6, 7, 8]),
                ),
                on("STORAGE", stored(&[200], Some(100), vec![5, 6, 7, 8])),
            ]),
            &mut sink,
            &mut tally,
        );
        assert_eq!(sink.on(Tier::Device), sorted(&prompt));
        assert_eq!(sink.on(Tier::Host), vec![prompt[0]]);
        assert_eq!(sink.on(Tier::Disk), sorted(&prompt));
        assert_eq!(Tally::count(&tally.ignored, "unknown_block"), 1);
        assert_eq!(
            (
                row.blocks_on(Tier::Device),
                row.blocks_on(Tier::Host),
                row.blocks_on(Tier::Disk)
            ),
            (2, 1, 2)
        );

        // The device copy goes; the host still maps the hash, and a later bare store of it
        // on disk still resolves.
        row.apply(
            batch(vec![
                removed(&[100, 200], "GPU"),
                removed(&[200], "STORAGE"),
            ]),
            &mut sink,
            &mut tally,
        );
        assert!(sink.on(Tier::Device).is_empty());
        // 200 was announced twice on disk: one removal keeps it.
        assert_eq!(sink.on(Tier::Disk), sorted(&prompt));
        row.apply(
            batch(vec![removed(&[200], "STORAGE"), placeholder(100, "CPU")]),
            &mut sink,
            &mut tally,
        );
        assert_eq!(sink.on(Tier::Disk), vec![prompt[0]]);
        let seeded: Vec<Update> = {
            let mut s: Vec<Update> = row.holdings().collect();
            s.sort();
            s
        };
        assert_eq!(
            seeded,
            vec![
                (KvEventKind::Stored, Tier::Host, prompt[0]),
                (KvEventKind::Stored, Tier::Disk, prompt[0]),
            ]
        );
        // Two host stores of 100 (the second above) need two removals.
        row.apply(batch(vec![removed(&[100], "CPU")]), &mut sink, &mut tally);
        assert_eq!(sink.on(Tier::Host), vec![prompt[0]]);
        row.apply(
            batch(vec![removed(&[100], "CPU"), removed(&[100], "CPU")]),
            &mut sink,
            &mut tally,
        );
        assert!(sink.on(Tier::Host).is_empty());
        assert_eq!(Tally::count(&tally.ignored, "unknown_block"), 2);
        // AllBlocksCleared is the device's; the disk copy stays. A restart clears all.
        row.apply(
            batch(vec![EngineEvent::AllBlocksCleared { medium: None }]),
            &mut sink,
            &mut tally,
        );
        assert_eq!(sink.on(Tier::Disk), vec![prompt[0]]);
        assert_eq!(row.len(), 1);
        row.clear(&mut sink);
        assert!(row.is_empty() && sink.on(Tier::Disk).is_empty());
        assert!(row.has_seen(Tier::Host) && row.has_seen(Tier::Disk));
    }

    fn sorted(ids: &[u64]) -> Vec<u64> {
        let mut ids = ids.to_vec();
        ids.sort_unstable();
        ids
    }

    /// vLLM's untagged keys: the adapter's name on every block, the salt on the first.
    #[test]
    fn lora_and_salt_keys_root_the_chain_in_their_tenant() {
        let strings =
            |keys: &[&str]| BlockKeys::Strings(keys.iter().map(|k| k.to_string()).collect());
        let keyed =
            |hashes: &[u64], parent: Option<u64>, keys: Vec<BlockKeys>, lora: Option<&str>| {
                EngineEvent::BlockStored(BlockStored {
                    block_hashes: hashes.iter().map(|&h| EngineHash::Int(h)).collect(),
                    parent_block_hash: parent.map(EngineHash::Int),
                    token_ids: (1..=4 * hashes.len() as u32).collect(),
                    block_size: Some(4),
                    lora_name: lora.map(str::to_owned),
                    medium: Some("GPU".into()),
                    extra_keys: keys,
                    ..BlockStored::default()
                })
            };
        let ids = |lora, cache_salt| {
            let mut out = Vec::new();
            BlockHasher::new(4, Tenant { lora, cache_salt })
                .expect("hasher")
                .prompt_blocks(&(1..=8).collect::<Vec<u32>>(), &mut out);
            out
        };
        for (keys, lora, expected) in [
            (
                vec![strings(&["ad"]), strings(&["ad"])],
                Some("ad"),
                ids(Some("ad"), None),
            ),
            (
                vec![strings(&["ad", "s1"]), strings(&["ad"])],
                Some("ad"),
                ids(Some("ad"), Some("s1")),
            ),
            (
                vec![strings(&["s1"]), BlockKeys::None],
                None,
                ids(None, Some("s1")),
            ),
        ] {
            let mut row = RowIngest::new(4).expect("block size");
            let (mut sink, mut tally) = (Recorder::default(), Tally::default());
            row.apply(
                batch(vec![keyed(&[1, 2], None, keys.clone(), lora)]),
                &mut sink,
                &mut tally,
            );
            let got: Vec<u64> = sink.events.iter().map(|(_, _, id)| *id).collect();
            assert_eq!(got, expected, "{keys:?}");
        }
        let mut row = RowIngest::new(4).expect("block size");
        let (mut sink, mut tally) = (Recorder::default(), Tally::default());
        row.apply(
            batch(vec![
                keyed(&[1], None, vec![BlockKeys::None], None),
                // A salt-like key past a prompt's first block, a multimodal key, an adapter's
                // key on an event that names another adapter: none can be followed.
                keyed(&[2], Some(1), vec![strings(&["s1"])], None),
                keyed(&[3], None, vec![BlockKeys::Other], None),
                keyed(&[4], None, vec![strings(&["other"])], Some("ad")),
            ]),
            &mut sink,
            &mut tally,
        );
        assert_eq!(sink.events.len(), 1);
        assert_eq!(Tally::count(&tally.refused, "extra_keys"), 3);
    }

    #[test]
    fn mediums_map_to_tiers() {
        assert_eq!(tier_of(None), Some(Tier::Device));
        assert_eq!(tier_of(Some("gpu")), Some(Tier::Device));
        assert_eq!(tier_of(Some("CPU")), Some(Tier::Host));
        assert_eq!(tier_of(Some("STORAGE")), Some(Tier::Disk));
        assert_eq!(tier_of(Some("NVME")), None);
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

    #[test]
    fn a_tier_over_its_limit_is_cleared_and_counted() {
        let mut row = RowIngest::new(4).expect("block size");
        row.set_limit(Tier::Device, capacity_limit(100), "over_capacity");
        assert_eq!(capacity_limit(100), 189);
        let mut sink = Recorder::default();
        let mut tally = Tally::default();
        // 1,000 unchained blocks, 10 per event, never removed: far over 100 blocks.
        for chunk in 0..100u64 {
            let events: Vec<EngineEvent> = (0..10)
                .map(|i| {
                    let h = chunk * 10 + i + 1;
                    stored(&[h], None, vec![h as u32; 4])
                })
                .collect();
            row.apply(batch(events), &mut sink, &mut tally);
            assert!(
                row.blocks_on(Tier::Device) <= 189,
                "{}",
                row.blocks_on(Tier::Device)
            );
            assert!(sink.held[0].len() <= 189);
            assert!(row.len() <= 189);
        }
        let dropped: u64 = tally.evicted.iter().map(|(_, _, n)| n).sum();
        assert!(tally
            .evicted
            .iter()
            .all(|(t, r, _)| *t == Tier::Device && *r == "over_capacity"));
        assert_eq!(dropped + row.blocks_on(Tier::Device) as u64, 1000);
        assert_eq!(
            Tally::count(&tally.clears, "over_capacity"),
            tally.evicted.len() as u64
        );
        assert!(tally.evicted.len() >= 5);
    }
}
