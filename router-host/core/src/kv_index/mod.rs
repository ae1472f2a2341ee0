//! The host's KV-overlap index, maintained only from the engines' cache events.
//!
//! Real engines publish "block stored" and "block removed" events; the router keeps an index of
//! which worker holds which block and, per request, counts the leading run of the prompt's blocks
//! each worker holds. This is that index: one global map `block id -> slot`, and per slot the set
//! of rows holding the block, so one walk over the prompt's blocks answers every row at once (each
//! step intersects the surviving rows with the block's holders; a row drops out at the first block
//! it lacks). Cost per request: one hash lookup per block of the longest overlap.
//!
//! The holder sets (`holders.rs`): up to 256 rows a bitset per slot (one word per 64 rows, so
//! the walk ANDs a word or a few per block); beyond that a small sorted array of row ids per slot,
//! spilled to a bitset only while many rows hold the block. A block is mostly held by a few rows,
//! so the index's memory grows with the (row, block) pairs rather than with blocks x rows, and the
//! walk, once the survivors are a few rows, tests those few rows per block.
//!
//! Each row also keeps the slots it holds (`row_slots`), so clearing a row (its engine restarted,
//! or reported `AllBlocksCleared`) touches the row's own blocks only, not the whole index.
//!
//! On a large index each hash lookup is a cache miss or two, and the walk's lookups were most of
//! a routing decision. Engines store a prompt's blocks in order, so each slot also remembers the
//! block stored after it (`SlotInfo`): along a cached prompt the walk follows those hints
//! through slot data that lies mostly in sequence, and hashes only where a hint does not match.
//! Before the hint it tries the slots next to the current one, whose addresses it knows without
//! waiting for the current slot's data: a prompt's blocks are often in consecutive slots.
//!
//! Engines that offload KV to host memory or disk report those tiers too. Each slot then also
//! has host and disk holder sets (allocated on the first offload event, so a device-only index
//! costs nothing more), and a row's overlap per tier follows what an engine can reuse: the
//! leading run on the device, then the blocks after it that the row holds on the host or the
//! device, then the blocks after those held on any tier ([`KvIndex::overlaps_by_tier`]).
//!
//! Here: the events, tiers and [`KvIndex`]'s layout; `holders.rs` keeps the holder sets,
//! `slots.rs` the slot table and its hints, `update.rs` applies events, `query.rs` answers
//! holdings and overlaps.

mod holders;
mod query;
mod slots;
#[cfg(test)]
mod tests;
pub mod trust;
mod update;

use crate::model::RowId;

use crate::fast_hash::FastMap;

use holders::TierSets;

/// A cache event for one row (its slot, see `crate::topology`; replay numbers rows
/// `worker_id * dp_size + dp_rank`, which is the same numbering for its fixed cluster).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvEvent {
    pub row: u32,
    pub kind: KvEventKind,
    pub block: u64,
    pub tier: Tier,
}

impl KvEvent {
    /// An event on the device tier (what engines without offloading report).
    pub fn on_device(row: u32, kind: KvEventKind, block: u64) -> Self {
        KvEvent {
            row,
            kind,
            block,
            tier: Tier::Device,
        }
    }
}

crate::spelled_enum! {
    /// Where a row holds a block: the engine's device memory, or an offload tier behind it.
    /// Spelled as in metrics and logs.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
    pub enum Tier {
        /// GPU (or, on a CPU engine, its main KV cache): vLLM's `"GPU"` medium.
        Device = "device",
        /// Host memory an offload connector copies blocks to: vLLM's `"CPU"`.
        Host = "host",
        /// Local or remote storage behind that: vLLM's `"STORAGE"`.
        Disk = "disk",
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KvEventKind {
    /// The block's KV was computed and registered in the engine's prefix cache (device tier).
    Stored,
    /// The block left the engine's cache.
    Evicted,
}

/// Which rows hold which blocks, from events only.
#[derive(Debug, Clone)]
pub struct KvIndex {
    rows: usize,
    /// Bitset words for `rows` (one per 64 rows, at least one).
    words: usize,
    slots: FastMap<u64, u32>,
    /// Per slot, the rows holding its block on the device.
    device: TierSets,
    /// Per slot, the rows holding its block on the host, then on disk; `None` until a row
    /// reported a block off the device.
    offload: Option<Box<[TierSets; 2]>>,
    /// Per slot: its block and a successor hint (see [`SlotInfo`]).
    info: Vec<SlotInfo>,
    /// Per row: the slot of its last `Stored` event, or [`NO_SLOT`].
    last_stored: Vec<u32>,
    /// Per row: how many blocks it holds on each tier (in [`Tier::ALL`] order), kept with the
    /// holder sets so that a policy can read what a row's cache holds without a scan.
    held: Vec<[u64; 3]>,
    /// The same counts per tier as `f64`, one column per tier indexed by row: what a decision
    /// lends policies as `kv_indexed_*_blocks`, kept with `held` so that a decision copies them
    /// instead of converting every row's count.
    held_columns: [Vec<f64>; 3],
    /// Per row: the slots it holds on some tier, so that clearing a row visits only those. An
    /// entry is added when the row starts holding a slot on a tier and left in place when it
    /// stops (a stale entry is skipped, and dropped by the next compaction), so a list has
    /// entries for every slot the row holds and at most about twice as many in all
    /// (see `update.rs`).
    row_slots: Vec<Vec<u32>>,
    free: Vec<u32>,
    events: u64,
}

/// No slot.
const NO_SLOT: u32 = u32::MAX;

/// What a slot holds, plus a hint for the walk: the block a row stored right after this one
/// (`next_block` in slot `next_slot`). Engines store a prompt's blocks in order, so along a cached
/// prompt the hint names the next block's slot and the walk skips the hash lookup, reading only
/// slot data that lies mostly in sequence. A hint is used only after checking that its slot is in
/// use and holds the very block being looked up, so a stale hint costs a comparison and the
/// lookup, never a different answer.
#[derive(Debug, Clone, Copy)]
struct SlotInfo {
    block: u64,
    /// `false` once the slot is freed (until it is reused).
    live: bool,
    /// Scratch for a row's slot-list compaction (`update.rs`), `false` outside it; in the
    /// struct's padding.
    listed: bool,
    next_block: u64,
    next_slot: u32,
}

// The compaction mark lives in padding: a slot's entry stays 24 bytes.
const _: () = assert!(std::mem::size_of::<SlotInfo>() == 24);

impl KvIndex {
    pub fn new(rows: usize) -> Self {
        let words = rows.div_ceil(64).max(1);
        KvIndex {
            rows,
            words,
            slots: FastMap::default(),
            device: TierSets::new(words, 0),
            offload: None,
            info: Vec::new(),
            last_stored: vec![NO_SLOT; rows],
            held: vec![[0; 3]; rows],
            held_columns: std::array::from_fn(|_| vec![0.0; rows]),
            row_slots: vec![Vec::new(); rows],
            free: Vec::new(),
            events: 0,
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Distinct blocks held by at least one row.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Events applied so far.
    pub fn events(&self) -> u64 {
        self.events
    }
}

/// Maps the replay's rows (`worker_id` 0..workers, `dp_rank` 0..dp_size) to dense indices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowMap {
    pub workers: u32,
    pub dp_size: u32,
}

impl RowMap {
    pub fn rows(&self) -> usize {
        self.workers as usize * self.dp_size as usize
    }

    pub fn index(&self, row: RowId) -> Option<usize> {
        (row.worker_id < u64::from(self.workers) && row.dp_rank < self.dp_size)
            .then(|| row.worker_id as usize * self.dp_size as usize + row.dp_rank as usize)
    }

    pub fn row(&self, index: usize) -> RowId {
        RowId {
            worker_id: (index / self.dp_size as usize) as u64,
            dp_rank: (index % self.dp_size as usize) as u32,
        }
    }
}
