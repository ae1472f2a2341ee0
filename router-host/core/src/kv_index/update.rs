//! The index updated from events: one event applied, rows added, a row's tier cleared.

use super::{KvEvent, KvEventKind, KvIndex, Tier, NO_SLOT};

impl KvIndex {
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
        // The row's bit of every slot in slot order: a strided pass over the tier's bitsets,
        // with no copy of the holdings. (Walking the block map instead cost a random access
        // per distinct block: about a second at 4,096 rows, under the index's write lock that
        // every decision waits on.)
        let mut cleared = 0;
        for slot in 0..self.info.len() as u32 {
            let at = self.word_at(slot, tier, word);
            if self.tier_words(tier)[at] & bit == 0 || !self.info[slot as usize].live {
                continue;
            }
            self.tier_words_mut(tier)[at] &= !bit;
            cleared += 1;
            if self.slot_is_empty(slot) {
                let block = self.info[slot as usize].block;
                self.slots.remove(&block);
                self.info[slot as usize].live = false;
                self.free.push(slot);
            }
        }
        self.held[row][tier as usize] = 0;
        if tier == Tier::Device {
            self.last_stored[row] = NO_SLOT;
        }
        cleared
    }
}
