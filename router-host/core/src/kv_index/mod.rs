//! The host's KV-overlap index, maintained only from the engines' cache events.
//!
//! Real engines publish "block stored" and "block removed" events; the router keeps an index of
//! which worker holds which block and, per request, counts the leading run of the prompt's blocks
//! each worker holds. This is that index (used today by `replay`, whose simulated engines publish
//! the events): one global map `block id -> bitset of
//! rows holding it`, so one walk over the prompt's blocks answers every row at once (each step
//! ANDs the surviving rows with the block's holders; a row drops out at the first block it lacks).
//! Cost per request: one hash lookup per block of the longest overlap, independent of the number
//! of rows up to 64 (one word per 64 rows beyond that).
//!
//! On a large index each hash lookup is a cache miss or two, and the walk's lookups were most of
//! a routing decision. Engines store a prompt's blocks in order, so each slot also remembers the
//! block stored after it (`SlotInfo`): along a cached prompt the walk follows those hints
//! through slot data that lies mostly in sequence, and hashes only where a hint does not match.
//! Before the hint it tries the slots next to the current one, whose addresses it knows without
//! waiting for the current slot's data: a prompt's blocks are often in consecutive slots.
//!
//! Engines that offload KV to host memory or disk report those tiers too. Each slot then also
//! has a host and a disk bitset (allocated on the first offload event, so a device-only index
//! costs nothing more), and a row's overlap per tier follows what an engine can reuse: the
//! leading run on the device, then the blocks after it that the row holds on the host or the
//! device, then the blocks after those held on any tier ([`KvIndex::overlaps_by_tier`]).

use crate::model::RowId;

use crate::fast_hash::FastMap;

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
    words: usize,
    slots: FastMap<u64, u32>,
    /// `words` bitset words per slot: the rows holding the slot's block on the device.
    masks: Vec<u64>,
    /// `2 * words` per slot (host, then disk) once an offload tier was reported; empty before.
    offload: Vec<u64>,
    /// Whether `offload` is allocated (a row reported a block off the device).
    has_offload: bool,
    /// Per slot: its block and a successor hint (see [`SlotInfo`]).
    info: Vec<SlotInfo>,
    /// Per row: the slot of its last `Stored` event, or [`NO_SLOT`].
    last_stored: Vec<u32>,
    /// Per row: how many blocks it holds on each tier (in [`Tier::ALL`] order), kept with the
    /// bitsets so that a policy can read what a row's cache holds without a scan.
    held: Vec<[u64; 3]>,
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
    next_block: u64,
    next_slot: u32,
}

impl KvIndex {
    pub fn new(rows: usize) -> Self {
        KvIndex {
            rows,
            words: rows.div_ceil(64).max(1),
            slots: FastMap::default(),
            masks: Vec::new(),
            offload: Vec::new(),
            has_offload: false,
            info: Vec::new(),
            last_stored: vec![NO_SLOT; rows],
            held: vec![[0; 3]; rows],
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

    pub fn apply(&mut self, event: &KvEvent) {
        self.events += 1;
        let row = event.row as usize;
        if row >= self.rows {
            return;
        }
        if event.tier != Tier::Device && !self.has_offload {
            if event.kind == KvEventKind::Evicted {
                return; // nothing was ever stored off the device
            }
            self.offload = vec![0; self.info.len() * 2 * self.words];
            self.has_offload = true;
        }
        let (word, bit) = (row / 64, 1u64 << (row % 64));
        match event.kind {
            KvEventKind::Stored => {
                let (slot, created) = match self.slots.get(&event.block) {
                    Some(&slot) => (slot, false),
                    None => (self.new_slot(event.block), true),
                };
                let at = self.word_at(slot, event.tier, word);
                let words = self.tier_words_mut(event.tier);
                if words[at] & bit == 0 {
                    words[at] |= bit;
                    self.held[row][event.tier as usize] += 1;
                }
                if event.tier == Tier::Device {
                    let previous = std::mem::replace(&mut self.last_stored[row], slot);
                    self.link(previous, slot, created);
                }
            }
            KvEventKind::Evicted => {
                let Some(&slot) = self.slots.get(&event.block) else {
                    return;
                };
                let at = self.word_at(slot, event.tier, word);
                let words = self.tier_words_mut(event.tier);
                if words[at] & bit != 0 {
                    words[at] &= !bit;
                    self.held[row][event.tier as usize] -= 1;
                }
                if self.slot_is_empty(slot) {
                    self.slots.remove(&event.block);
                    self.info[slot as usize].live = false;
                    self.free.push(slot);
                }
            }
        }
    }

    /// A slot for a block the index does not hold, its bitsets all zero (a freed slot's are).
    fn new_slot(&mut self, block: u64) -> u32 {
        let fresh = SlotInfo {
            block,
            live: true,
            next_block: 0,
            next_slot: NO_SLOT,
        };
        let slot = match self.free.pop() {
            Some(slot) => {
                self.info[slot as usize] = fresh;
                slot
            }
            None => {
                let slot = self.info.len() as u32;
                self.masks.resize(self.masks.len() + self.words, 0);
                if self.has_offload {
                    self.offload.resize(self.offload.len() + 2 * self.words, 0);
                }
                self.info.push(fresh);
                slot
            }
        };
        self.slots.insert(block, slot);
        slot
    }

    /// Index of `word` of `slot`'s bitset for `tier` in [`Self::tier_words_mut`]`(tier)`.
    fn word_at(&self, slot: u32, tier: Tier, word: usize) -> usize {
        match tier {
            Tier::Device => slot as usize * self.words + word,
            Tier::Host => slot as usize * 2 * self.words + word,
            Tier::Disk => (slot as usize * 2 + 1) * self.words + word,
        }
    }

    fn tier_words_mut(&mut self, tier: Tier) -> &mut [u64] {
        match tier {
            Tier::Device => &mut self.masks,
            Tier::Host | Tier::Disk => &mut self.offload,
        }
    }

    fn tier_words(&self, tier: Tier) -> &[u64] {
        match tier {
            Tier::Device => &self.masks,
            Tier::Host | Tier::Disk => &self.offload,
        }
    }

    /// No row holds the slot's block on any tier.
    fn slot_is_empty(&self, slot: u32) -> bool {
        let words = self.words;
        let device = &self.masks[slot as usize * words..][..words];
        let offload: &[u64] = if self.has_offload {
            &self.offload[slot as usize * 2 * words..][..2 * words]
        } else {
            &[]
        };
        device.iter().chain(offload).all(|&w| w == 0)
    }

    /// Whether any row ever reported a block off the device.
    pub fn has_offload_tiers(&self) -> bool {
        self.has_offload
    }

    /// Row just stored `slot` after `previous`: make that the hint of `previous` unless it already
    /// has a live one and `slot` is a block the index already knew. A block seen for the first time
    /// is the continuation of a prompt (its predecessor is the block stored just before it);
    /// a known block after another is as likely the start of the row's next request, and must not
    /// displace a continuation found earlier.
    fn link(&mut self, previous: u32, slot: u32, created: bool) {
        if previous == slot || previous == NO_SLOT {
            return;
        }
        let current = self.info[previous as usize];
        let live = self
            .info
            .get(current.next_slot as usize)
            .is_some_and(|next| next.live && next.block == current.next_block);
        if created || !live {
            let block = self.info[slot as usize].block;
            let info = &mut self.info[previous as usize];
            info.next_block = block;
            info.next_slot = slot;
        }
    }

    /// The slot of `block` if the hint of slot `previous` names it and still holds it (see
    /// [`SlotInfo`]); `None` means "look it up".
    ///
    /// The slots right after and right before `previous` are tried first: their addresses do
    /// not depend on `previous`'s data, so along a prompt stored in consecutive slots (as a new
    /// index hands them out, and as freed slots are reused when a prompt's blocks were freed
    /// together) the walk's loads overlap instead of waiting one for another.
    #[inline]
    fn successor(&self, previous: u32, block: u64) -> Option<u32> {
        let holds = |slot: u32| {
            self.info
                .get(slot as usize)
                .is_some_and(|next| next.live && next.block == block)
        };
        for guess in [previous.wrapping_add(1), previous.wrapping_sub(1)] {
            if holds(guess) {
                return Some(guess);
            }
        }
        let hint = self.info.get(previous as usize)?;
        let next = hint.next_slot;
        let target = self.info.get(next as usize)?;
        (hint.next_block == block && target.live && target.block == block).then_some(next)
    }

    /// Make room for rows `0..rows` (never shrinks). Re-lays every mask when the word count
    /// changes: rare (a worker joined past a multiple of 64 rows), linear in the index size.
    pub fn ensure_rows(&mut self, rows: usize) {
        if rows <= self.rows {
            return;
        }
        let words = rows.div_ceil(64).max(1);
        if words != self.words {
            // Each bitset keeps its words at the front of its wider place.
            let relay = |old: &[u64]| {
                let mut new = vec![0u64; old.len() / self.words * words];
                for (from, to) in old
                    .chunks_exact(self.words)
                    .zip(new.chunks_exact_mut(words))
                {
                    to[..self.words].copy_from_slice(from);
                }
                new
            };
            self.masks = relay(&self.masks);
            self.offload = relay(&self.offload);
            self.words = words;
        }
        self.rows = rows;
        self.last_stored.resize(rows, NO_SLOT);
        self.held.resize(rows, [0; 3]);
    }

    /// Forget every block `row` holds on any tier (its worker left, or its engine restarted);
    /// returns how many (row, block, tier) entries it had. Linear in the number of distinct
    /// blocks.
    pub fn clear_row(&mut self, row: u32) -> u64 {
        let cleared = Tier::ALL.iter().map(|&t| self.clear_row_tier(row, t)).sum();
        if let Some(last) = self.last_stored.get_mut(row as usize) {
            *last = NO_SLOT;
        }
        cleared
    }

    /// Forget the blocks `row` holds on `tier` (the engine cleared that cache); returns how many
    /// it held there.
    pub fn clear_row_tier(&mut self, row: u32, tier: Tier) -> u64 {
        let row = row as usize;
        if row >= self.rows || (tier != Tier::Device && !self.has_offload) {
            return 0;
        }
        let (word, bit) = (row / 64, 1u64 << (row % 64));
        let holding: Vec<(u64, u32)> = self
            .slots
            .iter()
            .filter(|&(_, &slot)| self.tier_words(tier)[self.word_at(slot, tier, word)] & bit != 0)
            .map(|(&block, &slot)| (block, slot))
            .collect();
        for &(block, slot) in &holding {
            let at = self.word_at(slot, tier, word);
            self.tier_words_mut(tier)[at] &= !bit;
            if self.slot_is_empty(slot) {
                self.slots.remove(&block);
                self.info[slot as usize].live = false;
                self.free.push(slot);
            }
        }
        let cleared = holding.len() as u64;
        self.held[row][tier as usize] = 0;
        if tier == Tier::Device {
            self.last_stored[row] = NO_SLOT;
        }
        cleared
    }

    /// Blocks `row` holds on `tier` (0 for a row the index does not know). Constant time: the
    /// count is kept as events arrive.
    pub fn held_by(&self, row: u32, tier: Tier) -> u64 {
        self.held_by_tier(row)[tier as usize]
    }

    /// Blocks `row` holds on each tier, in [`Tier::ALL`] order.
    pub fn held_by_tier(&self, row: u32) -> [u64; 3] {
        self.held.get(row as usize).copied().unwrap_or([0; 3])
    }

    /// (row, block) pairs held on the device, over all rows.
    pub fn holdings(&self) -> u64 {
        self.holdings_in(Tier::Device)
    }

    /// (row, block) pairs held on `tier`, over all rows.
    pub fn holdings_in(&self, tier: Tier) -> u64 {
        if tier != Tier::Device && !self.has_offload {
            return 0;
        }
        let words = self.tier_words(tier);
        self.slots
            .values()
            .map(|&slot| {
                words[self.word_at(slot, tier, 0)..][..self.words]
                    .iter()
                    .map(|w| u64::from(w.count_ones()))
                    .sum::<u64>()
            })
            .sum()
    }

    /// Whether `row` holds `block` on the device.
    pub fn holds(&self, row: u32, block: u64) -> bool {
        self.holds_in(row, block, Tier::Device)
    }

    /// Whether `row` holds `block` on `tier`.
    pub fn holds_in(&self, row: u32, block: u64, tier: Tier) -> bool {
        let row = row as usize;
        if row >= self.rows || (tier != Tier::Device && !self.has_offload) {
            return false;
        }
        self.slots.get(&block).is_some_and(|&slot| {
            self.tier_words(tier)[self.word_at(slot, tier, row / 64)] & (1 << (row % 64)) != 0
        })
    }

    /// `out[row]` = how many leading blocks of `blocks` row holds. `alive` is scratch.
    pub fn overlaps(&self, blocks: &[u64], out: &mut Vec<u32>, alive: &mut Vec<u64>) {
        out.clear();
        out.resize(self.rows, 0);
        // Up to 128 rows the surviving-rows bitset lives in registers and the per-block work is
        // unrolled (the same code, with the word count known).
        match self.words {
            1 => self.walk(blocks, out, &mut [!0; 1]),
            2 => self.walk(blocks, out, &mut [!0; 2]),
            words => {
                alive.clear();
                alive.resize(words, !0);
                self.walk(blocks, out, alive);
            }
        }
    }

    /// Per row, the prompt's leading blocks it can reuse, by the tier they come from:
    /// `device[row]` leading blocks on the device; then `host[row]` more held on the host (or
    /// on the device: a block after the device run is reused from where an offload connector
    /// loads it); then `disk[row]` more held on any tier. `device` is what [`Self::overlaps`]
    /// gives. Without offload tiers `host` and `disk` are left empty (read as zeros) and the
    /// walk is the device-only one. `alive` is scratch.
    pub fn overlaps_by_tier(
        &self,
        blocks: &[u64],
        device: &mut Vec<u32>,
        host: &mut Vec<u32>,
        disk: &mut Vec<u32>,
        alive: &mut Vec<u64>,
    ) {
        if !self.has_offload {
            host.clear();
            disk.clear();
            return self.overlaps(blocks, device, alive);
        }
        for out in [&mut *device, &mut *host, &mut *disk] {
            out.clear();
            out.resize(self.rows, 0);
        }
        let words = self.words;
        alive.clear();
        alive.resize(3 * words, !0);
        if !self.rows.is_multiple_of(64) {
            for level in 0..3 {
                alive[level * words + words - 1] = (1u64 << (self.rows % 64)) - 1;
            }
        }
        // Three nested runs: on the device; on the device or host; on any tier. `host` and
        // `disk` hold the second and third run until the differences at the end.
        let mut runs = [&mut device[..], &mut host[..], &mut disk[..]];
        let mut depth = 0u32;
        let mut previous = NO_SLOT;
        for &block in blocks {
            let slot = match self.successor(previous, block) {
                Some(slot) => slot,
                None => match self.slots.get(&block) {
                    Some(&slot) => slot,
                    None => break,
                },
            };
            previous = slot;
            let on_device = &self.masks[slot as usize * words..][..words];
            let offload = &self.offload[slot as usize * 2 * words..][..2 * words];
            let mut any = 0;
            for w in 0..words {
                let near = on_device[w] | offload[w];
                let held = [on_device[w], near, near | offload[words + w]];
                for (level, (run, held)) in runs.iter_mut().zip(held).enumerate() {
                    let alive = &mut alive[level * words + w];
                    let mut dropped = *alive & !held;
                    while dropped != 0 {
                        let bit = dropped.trailing_zeros() as usize;
                        run[w * 64 + bit] = depth;
                        dropped &= dropped - 1;
                    }
                    *alive &= held;
                }
                any |= alive[2 * words + w];
            }
            if any == 0 {
                break;
            }
            depth += 1;
        }
        for (level, run) in runs.iter_mut().enumerate() {
            for w in 0..words {
                let mut bits = alive[level * words + w];
                while bits != 0 {
                    let bit = bits.trailing_zeros() as usize;
                    run[w * 64 + bit] = depth;
                    bits &= bits - 1;
                }
            }
        }
        for ((device, host), disk) in device.iter().zip(host.iter_mut()).zip(disk.iter_mut()) {
            *disk -= *host;
            *host -= *device;
        }
    }

    /// [`KvIndex::overlaps`] with `alive` (one word per 64 rows) set to all ones.
    #[inline(always)]
    fn walk(&self, blocks: &[u64], out: &mut [u32], alive: &mut [u64]) {
        let words = alive.len();
        if !self.rows.is_multiple_of(64) {
            alive[words - 1] = (1u64 << (self.rows % 64)) - 1;
        }
        let mut depth = 0;
        let mut previous = NO_SLOT;
        for &block in blocks {
            let slot = match self.successor(previous, block) {
                Some(slot) => slot,
                None => match self.slots.get(&block) {
                    Some(&slot) => slot,
                    None => break,
                },
            };
            previous = slot;
            let mask = &self.masks[slot as usize * words..][..words];
            // Rows that held every earlier block but not this one stop here. Past the first
            // blocks of a prompt that is rare (the survivors hold the rest too), so one test
            // over every word comes first.
            let dropped = alive
                .iter()
                .zip(mask)
                .fold(0, |dropped, (&alive, &held)| dropped | (alive & !held));
            if dropped != 0 {
                let mut any = 0;
                for (w, (alive, &held)) in alive.iter_mut().zip(mask).enumerate() {
                    let mut dropped = *alive & !held;
                    while dropped != 0 {
                        let bit = dropped.trailing_zeros() as usize;
                        out[w * 64 + bit] = depth as u32;
                        dropped &= dropped - 1;
                    }
                    *alive &= held;
                    any |= *alive;
                }
                if any == 0 {
                    return;
                }
            }
            depth += 1;
        }
        // The survivors hold the first `depth` blocks.
        for (w, &alive) in alive.iter().enumerate() {
            let mut bits = alive;
            while bits != 0 {
                let bit = bits.trailing_zeros() as usize;
                out[w * 64 + bit] = depth as u32;
                bits &= bits - 1;
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(row: u32, block: u64) -> KvEvent {
        KvEvent::on_device(row, KvEventKind::Stored, block)
    }

    fn event(row: u32, kind: KvEventKind, block: u64, tier: Tier) -> KvEvent {
        KvEvent {
            row,
            kind,
            block,
            tier,
        }
    }

    #[test]
    fn leading_runs_per_row_across_word_boundaries() {
        for rows in [3usize, 64, 70, 130] {
            let mut index = KvIndex::new(rows);
            let last = rows as u32 - 1;
            for b in [1, 2, 3] {
                index.apply(&stored(0, b));
                index.apply(&stored(last, b));
            }
            index.apply(&stored(1, 1));
            index.apply(&stored(1, 3)); // not leading: 2 missing
            let (mut out, mut alive) = (Vec::new(), Vec::new());
            index.overlaps(&[1, 2, 3, 4], &mut out, &mut alive);
            assert_eq!(out.len(), rows);
            assert_eq!(
                (out[0], out[1], out[last as usize]),
                (3, 1, 3),
                "rows {rows}"
            );
            if rows > 3 {
                assert_eq!(out[2], 0);
            }
            index.apply(&event(0, KvEventKind::Evicted, 2, Tier::Device));
            index.overlaps(&[1, 2, 3, 4], &mut out, &mut alive);
            assert_eq!((out[0], out[last as usize]), (1, 3));
            assert!(!index.holds(0, 2) && index.holds(last, 2));
        }
    }

    /// The walk (hints, their fallbacks, slot reuse, every word count) against the definition:
    /// per row, the number of leading blocks it holds.
    #[test]
    fn overlaps_match_a_naive_reference_under_random_events() {
        use std::collections::HashSet;
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for rows in [1usize, 5, 64, 70, 128, 130] {
            let mut index = KvIndex::new(rows);
            let mut held: Vec<HashSet<u64>> = vec![HashSet::new(); rows];
            // Prompts over a small block alphabet: shared prefixes, repeats, reuse of freed slots.
            let prompts: Vec<Vec<u64>> = (0..24)
                .map(|p| {
                    let mut blocks: Vec<u64> = (0..next(4)).map(|i| 1000 + i).collect();
                    blocks.extend((0..2 + next(10)).map(|_| next(60)));
                    if p % 5 == 0 {
                        blocks.push(blocks[0]);
                    }
                    blocks
                })
                .collect();
            let (mut out, mut alive) = (Vec::new(), Vec::new());
            for step in 0..3_000 {
                let row = next(rows as u64) as u32;
                let prompt = &prompts[next(prompts.len() as u64) as usize];
                match next(3) {
                    // Store a leading run in order, as an engine does (skipping held blocks).
                    0 | 1 => {
                        for &block in &prompt[..=next(prompt.len() as u64) as usize] {
                            if held[row as usize].insert(block) {
                                index.apply(&stored(row, block));
                            }
                        }
                    }
                    // Evict some blocks of the prompt.
                    _ => {
                        for &block in prompt.iter().filter(|_| next(2) == 0) {
                            if held[row as usize].remove(&block) {
                                index.apply(&event(row, KvEventKind::Evicted, block, Tier::Device));
                            }
                        }
                    }
                }
                let query = &prompts[next(prompts.len() as u64) as usize];
                index.overlaps(query, &mut out, &mut alive);
                for (r, set) in held.iter().enumerate() {
                    let expected = query.iter().take_while(|b| set.contains(b)).count();
                    assert_eq!(
                        out[r] as usize, expected,
                        "rows {rows}, step {step}, row {r}"
                    );
                }
            }
            let pairs: usize = held.iter().map(HashSet::len).sum();
            assert_eq!(index.holdings(), pairs as u64);
        }
    }

    #[test]
    fn evicting_the_last_holder_frees_the_block() {
        let mut index = KvIndex::new(2);
        index.apply(&stored(0, 9));
        index.apply(&stored(1, 9));
        for row in [0, 1] {
            index.apply(&event(row, KvEventKind::Evicted, 9, Tier::Device));
        }
        assert!(index.is_empty());
        index.apply(&stored(1, 10));
        assert_eq!(index.len(), 1);
        assert!(index.holds(1, 10));
    }

    /// The per-tier runs against the definition, under random stores and evictions on every
    /// tier, with rows added past a word boundary midway and rows or single tiers cleared.
    #[test]
    fn overlaps_by_tier_match_a_naive_reference() {
        use std::collections::HashSet;
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for (rows, grown) in [(1usize, 3usize), (5, 70), (64, 130), (70, 70)] {
            let mut index = KvIndex::new(rows);
            let mut rows = rows;
            // held[row][tier]
            let mut held: Vec<[HashSet<u64>; 3]> = vec![Default::default(); grown];
            let prompts: Vec<Vec<u64>> = (0..16)
                .map(|_| (0..3 + next(8)).map(|i| i * 7 + next(3)).collect())
                .collect();
            let (mut device, mut host, mut disk, mut alive) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for step in 0..2_000 {
                if step == 1_000 {
                    index.ensure_rows(grown);
                    rows = grown;
                }
                let row = next(rows as u64) as u32;
                let tier = Tier::ALL[next(3) as usize];
                let t = tier as usize;
                let prompt = &prompts[next(prompts.len() as u64) as usize];
                match next(7) {
                    0..=3 => {
                        for &block in &prompt[..=next(prompt.len() as u64) as usize] {
                            if held[row as usize][t].insert(block) {
                                index.apply(&event(row, KvEventKind::Stored, block, tier));
                            }
                        }
                    }
                    4 | 5 => {
                        for &block in prompt.iter().filter(|_| next(2) == 0) {
                            if held[row as usize][t].remove(&block) {
                                index.apply(&event(row, KvEventKind::Evicted, block, tier));
                            }
                        }
                    }
                    _ if next(4) == 0 => {
                        let n: usize = held[row as usize].iter().map(HashSet::len).sum();
                        assert_eq!(index.clear_row(row), n as u64);
                        held[row as usize].iter_mut().for_each(HashSet::clear);
                    }
                    _ => {
                        let n = held[row as usize][t].len() as u64;
                        assert_eq!(index.clear_row_tier(row, tier), n, "step {step}");
                        held[row as usize][t].clear();
                    }
                }
                let query = &prompts[next(prompts.len() as u64) as usize];
                index.overlaps_by_tier(query, &mut device, &mut host, &mut disk, &mut alive);
                for (r, sets) in held.iter().enumerate().take(rows) {
                    let on = |tiers: &[usize], b: &u64| tiers.iter().any(|&t| sets[t].contains(b));
                    let run = |tiers: &[usize]| query.iter().take_while(|b| on(tiers, b)).count();
                    let (d, dh, all) = (run(&[0]), run(&[0, 1]), run(&[0, 1, 2]));
                    let got = |v: &Vec<u32>| v.get(r).copied().unwrap_or(0) as usize;
                    assert_eq!(
                        (got(&device), got(&host), got(&disk)),
                        (d, dh - d, all - dh),
                        "rows {rows}, step {step}, row {r}"
                    );
                    for (t, tier) in Tier::ALL.into_iter().enumerate() {
                        assert_eq!(
                            index.held_by(r as u32, tier),
                            sets[t].len() as u64,
                            "step {step}"
                        );
                    }
                    for (t, tier) in Tier::ALL.into_iter().enumerate().filter(|_| step % 16 == 0) {
                        for b in query {
                            assert_eq!(index.holds_in(r as u32, *b, tier), sets[t].contains(b));
                        }
                    }
                }
            }
            for (t, tier) in Tier::ALL.into_iter().enumerate() {
                let pairs: usize = held.iter().map(|sets| sets[t].len()).sum();
                assert_eq!(index.holdings_in(tier), pairs as u64, "{tier:?}");
            }
            let distinct: HashSet<u64> = held.iter().flatten().flatten().copied().collect();
            assert_eq!(index.len(), distinct.len());
        }
    }

    #[test]
    fn a_device_only_index_has_no_offload_columns() {
        let mut index = KvIndex::new(2);
        index.apply(&stored(0, 1));
        // An eviction from a tier never stored changes nothing and allocates nothing.
        index.apply(&event(0, KvEventKind::Evicted, 1, Tier::Host));
        assert!(!index.has_offload_tiers());
        let (mut device, mut host, mut disk, mut alive) = (vec![9], vec![9], vec![9], Vec::new());
        index.overlaps_by_tier(&[1, 2], &mut device, &mut host, &mut disk, &mut alive);
        assert_eq!((device, host, disk), (vec![1, 0], vec![], vec![]));
        // A block kept only on the host keeps its slot after the device copy goes.
        index.apply(&event(1, KvEventKind::Stored, 1, Tier::Host));
        index.apply(&event(0, KvEventKind::Evicted, 1, Tier::Device));
        assert_eq!(index.len(), 1);
        assert!(index.holds_in(1, 1, Tier::Host) && !index.holds(0, 1));
        index.apply(&event(1, KvEventKind::Evicted, 1, Tier::Host));
        assert!(index.is_empty());
    }
}
