//! Typed events of one `(worker, rank)` → KV-index updates in router block ids.
//!
//! The row keeps a map from the engine's block hash to the router's block id and the tiers the
//! row holds it on. `BlockStored` hashes its `token_ids` block by block with the core's
//! [`BlockHasher`](router_core::blocks::BlockHasher), chained from the parent's router id (looked up in the map) or from the root
//! when the parent is null; removals go through the same map. `medium` names the tier: `"GPU"`
//! (or none) the device, `"CPU"` the host, `"STORAGE"` the disk. An offload store may carry no
//! tokens (vLLM's offloading connector sends a bare hash unless its events are
//! self-describing): it is then mapped through the hash the row stored on the device. Offload
//! tiers may announce one hash several times, so they count references: the tier holds the
//! block until as many removals came. `AllBlocksCleared` clears the device tier (the block
//! pool is what sends it); a sequence number that goes backwards (the engine restarted, its
//! memory gone) clears every tier and the map.
//!
//! Here: what a batch produces ([`Update`], [`Sink`], [`Tally`], [`SeqCheck`]) and the rules
//! that read an event (tiers, salts, limits); `row.rs` holds one row's state, [`RowIngest`].

mod row;
#[cfg(test)]
mod tests;

pub use row::RowIngest;

use router_core::kv_index::{KvEventKind, Tier};

use super::decode::{BlockKeys, BlockStored};

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
