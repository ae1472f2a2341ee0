//! The host's KV-overlap index, maintained only from the engines' cache events.
//!
//! Real engines publish "block stored" and "block removed" events; the router keeps an index of
//! which worker holds which block and, per request, counts the leading run of the prompt's blocks
//! each worker holds. This is that index for the replay: one global map `block id -> bitset of
//! rows holding it`, so one walk over the prompt's blocks answers every row at once (each step
//! ANDs the surviving rows with the block's holders; a row drops out at the first block it lacks).
//! Cost per request: one hash lookup per block of the longest overlap, independent of the number
//! of rows up to 64 (one word per 64 rows beyond that).

use std::cell::{Cell, RefCell};

use crate::host::OverlapSource;
use crate::model::{RowId, TierOverlap};

use super::fast_hash::FastMap;

/// A cache event from one engine (row index = `worker_id * dp_size + dp_rank`).
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
    free: Vec<u32>,
    events: u64,
}

impl KvIndex {
    pub fn new(rows: usize) -> Self {
        KvIndex {
            rows,
            words: rows.div_ceil(64).max(1),
            slots: FastMap::default(),
            masks: Vec::new(),
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
                let slot = match self.slots.get(&event.block) {
                    Some(&slot) => slot,
                    None => {
                        let slot = match self.free.pop() {
                            Some(slot) => slot,
                            None => {
                                let slot = (self.masks.len() / self.words) as u32;
                                self.masks.resize(self.masks.len() + self.words, 0);
                                slot
                            }
                        };
                        self.slots.insert(event.block, slot);
                        slot
                    }
                };
                self.masks[slot as usize * self.words + word] |= bit;
            }
            KvEventKind::Evicted => {
                let Some(&slot) = self.slots.get(&event.block) else {
                    return;
                };
                let base = slot as usize * self.words;
                self.masks[base + word] &= !bit;
                if self.masks[base..base + self.words].iter().all(|&w| w == 0) {
                    self.slots.remove(&event.block);
                    self.free.push(slot);
                }
            }
        }
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
        alive.clear();
        alive.resize(self.words, !0);
        if !self.rows.is_multiple_of(64) {
            alive[self.words - 1] = (1u64 << (self.rows % 64)) - 1;
        }
        let mut depth = 0;
        for block in blocks {
            let Some(&slot) = self.slots.get(block) else {
                break;
            };
            let mask = &self.masks[slot as usize * self.words..][..self.words];
            let mut any = false;
            for (w, (alive, &held)) in alive.iter_mut().zip(mask).enumerate() {
                // Rows that held every earlier block but not this one stop here.
                let mut dropped = *alive & !held;
                while dropped != 0 {
                    let bit = dropped.trailing_zeros() as usize;
                    out[w * 64 + bit] = depth as u32;
                    dropped &= dropped - 1;
                }
                *alive &= held;
                any |= *alive != 0;
            }
            if !any {
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

/// Reusable buffers for [`RequestOverlap`].
#[derive(Debug, Default)]
pub struct OverlapScratch {
    out: Vec<u32>,
    alive: Vec<u64>,
}

/// One request's view of the index, computed on the first row the policy asks about (policies
/// that do not read the CACHE columns never pay for it).
pub struct RequestOverlap<'a> {
    index: &'a KvIndex,
    blocks: &'a [u64],
    rows: RowMap,
    scratch: &'a RefCell<OverlapScratch>,
    computed: Cell<bool>,
}

impl<'a> RequestOverlap<'a> {
    pub fn new(
        index: &'a KvIndex,
        blocks: &'a [u64],
        rows: RowMap,
        scratch: &'a RefCell<OverlapScratch>,
    ) -> Self {
        RequestOverlap {
            index,
            blocks,
            rows,
            scratch,
            computed: Cell::new(false),
        }
    }
}

impl OverlapSource for RequestOverlap<'_> {
    fn overlap(&self, row: RowId) -> TierOverlap {
        let Some(i) = self.rows.index(row) else {
            return TierOverlap::default();
        };
        let mut scratch = self.scratch.borrow_mut();
        if !self.computed.get() {
            let OverlapScratch { out, alive } = &mut *scratch;
            self.index.overlaps(self.blocks, out, alive);
            self.computed.set(true);
        }
        TierOverlap {
            device: f64::from(scratch.out.get(i).copied().unwrap_or(0)),
            // Only the device tier is simulated.
            host: 0.0,
            disk: 0.0,
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
