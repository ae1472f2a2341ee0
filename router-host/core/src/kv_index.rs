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

use crate::model::RowId;

use crate::fast_hash::FastMap;

/// A cache event for one row (its slot, see `crate::topology`; replay numbers rows
/// `worker_id * dp_size + dp_rank`, which is the same numbering for its fixed cluster).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvEvent {
    pub row: u32,
    pub kind: KvEventKind,
    pub block: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
    /// `words` bitset words per slot.
    masks: Vec<u64>,
    /// Per slot: its block and a successor hint (see [`SlotInfo`]).
    info: Vec<SlotInfo>,
    /// Per row: the slot of its last `Stored` event, or [`NO_SLOT`].
    last_stored: Vec<u32>,
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
            info: Vec::new(),
            last_stored: vec![NO_SLOT; rows],
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
        let (word, bit) = (row / 64, 1u64 << (row % 64));
        match event.kind {
            KvEventKind::Stored => {
                let (slot, created) = match self.slots.get(&event.block) {
                    Some(&slot) => (slot, false),
                    None => {
                        let fresh = SlotInfo {
                            block: event.block,
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
                                let slot = (self.masks.len() / self.words) as u32;
                                self.masks.resize(self.masks.len() + self.words, 0);
                                self.info.push(fresh);
                                slot
                            }
                        };
                        self.slots.insert(event.block, slot);
                        (slot, true)
                    }
                };
                self.masks[slot as usize * self.words + word] |= bit;
                let previous = std::mem::replace(&mut self.last_stored[row], slot);
                self.link(previous, slot, created);
            }
            KvEventKind::Evicted => {
                let Some(&slot) = self.slots.get(&event.block) else {
                    return;
                };
                let base = slot as usize * self.words;
                self.masks[base + word] &= !bit;
                if self.masks[base..base + self.words].iter().all(|&w| w == 0) {
                    self.slots.remove(&event.block);
                    self.info[slot as usize].live = false;
                    self.free.push(slot);
                }
            }
        }
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
    #[inline]
    fn successor(&self, previous: u32, block: u64) -> Option<u32> {
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
            let slots = self.info.len();
            let mut masks = vec![0u64; slots * words];
            for slot in 0..slots {
                masks[slot * words..][..self.words]
                    .copy_from_slice(&self.masks[slot * self.words..][..self.words]);
            }
            self.masks = masks;
            self.words = words;
        }
        self.rows = rows;
        self.last_stored.resize(rows, NO_SLOT);
    }

    /// Forget every block `row` holds (its worker left, or its engine restarted); returns how
    /// many it held. Linear in the number of distinct blocks.
    pub fn clear_row(&mut self, row: u32) -> u64 {
        let row = row as usize;
        if row >= self.rows {
            return 0;
        }
        let (word, bit) = (row / 64, 1u64 << (row % 64));
        let mut cleared = 0;
        let words = self.words;
        let masks = &mut self.masks;
        let info = &mut self.info;
        let free = &mut self.free;
        self.slots.retain(|_, &mut slot| {
            let base = slot as usize * words;
            if masks[base + word] & bit == 0 {
                return true;
            }
            cleared += 1;
            masks[base + word] &= !bit;
            if masks[base..base + words].iter().all(|&w| w == 0) {
                info[slot as usize].live = false;
                free.push(slot);
                return false;
            }
            true
        });
        self.last_stored[row] = NO_SLOT;
        cleared
    }

    /// (row, block) pairs held, over all rows.
    pub fn holdings(&self) -> u64 {
        self.slots
            .values()
            .map(|&slot| {
                self.masks[slot as usize * self.words..][..self.words]
                    .iter()
                    .map(|w| u64::from(w.count_ones()))
                    .sum::<u64>()
            })
            .sum()
    }

    /// Whether `row` holds `block`.
    pub fn holds(&self, row: u32, block: u64) -> bool {
        let row = row as usize;
        row < self.rows
            && self.slots.get(&block).is_some_and(|&slot| {
                self.masks[slot as usize * self.words + row / 64] & (1 << (row % 64)) != 0
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
            let mut any = 0;
            for (w, (alive, &held)) in alive.iter_mut().zip(mask).enumerate() {
                // Rows that held every earlier block but not this one stop here.
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
        KvEvent {
            row,
            kind: KvEventKind::Stored,
            block,
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
            index.apply(&KvEvent {
                row: 0,
                kind: KvEventKind::Evicted,
                block: 2,
            });
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
                                index.apply(&KvEvent {
                                    row,
                                    kind: KvEventKind::Evicted,
                                    block,
                                });
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
            index.apply(&KvEvent {
                row,
                kind: KvEventKind::Evicted,
                block: 9,
            });
        }
        assert!(index.is_empty());
        index.apply(&stored(1, 10));
        assert_eq!(index.len(), 1);
        assert!(index.holds(1, 10));
    }
}
