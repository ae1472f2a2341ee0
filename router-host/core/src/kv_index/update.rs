//! The index updated from events: one event applied, rows added, a row's tier cleared.

use super::holders::TierSets;
use super::{KvEvent, KvEventKind, KvIndex, Tier, NO_SLOT};

/// A row's slot list is compacted once it has this many entries more than twice the blocks the
/// row holds (so a compaction's cost is spread over at least as many events as it visits).
const ROW_SLOTS_SLACK: usize = 32;

impl KvIndex {
    pub fn apply(&mut self, event: &KvEvent) {
        self.events += 1;
        let row = event.row;
        if row as usize >= self.rows {
            return;
        }
        if event.tier != Tier::Device && self.offload.is_none() {
            if event.kind == KvEventKind::Evicted {
                return; // nothing was ever stored off the device
            }
            let slots = self.info.len();
            self.offload = Some(Box::new([
                TierSets::new(self.words, slots),
                TierSets::new(self.words, slots),
            ]));
        }
        match event.kind {
            KvEventKind::Stored => {
                let (slot, created) = match self.slots.get(&event.block) {
                    Some(&slot) => (slot, false),
                    None => (self.new_slot(event.block), true),
                };
                if self
                    .sets_mut(event.tier)
                    .is_some_and(|sets| sets.insert(slot, row))
                {
                    self.count_held(row, event.tier, |n| n + 1);
                    self.note_held(row, slot);
                }
                if event.tier == Tier::Device {
                    let previous = std::mem::replace(&mut self.last_stored[row as usize], slot);
                    self.link(previous, slot, created);
                }
            }
            KvEventKind::Evicted => {
                let Some(&slot) = self.slots.get(&event.block) else {
                    return;
                };
                if self
                    .sets_mut(event.tier)
                    .is_some_and(|sets| sets.remove(slot, row))
                {
                    self.count_held(row, event.tier, |n| n - 1);
                }
                if self.slot_is_empty(slot) {
                    self.free_slot(slot);
                }
            }
        }
    }

    /// Change `row`'s count of blocks on `tier`, and its `f64` copy with it (`row` is known).
    #[inline]
    fn count_held(&mut self, row: u32, tier: Tier, f: impl FnOnce(u64) -> u64) {
        let (row, tier) = (row as usize, tier as usize);
        let n = f(self.held[row][tier]);
        self.held[row][tier] = n;
        self.held_columns[tier][row] = n as f64;
    }

    /// `row` started holding `slot` on a tier: remember it in the row's slot list. Evictions
    /// leave their entries behind; once they could outnumber the live ones the list is
    /// compacted, so it stays under twice the row's holdings plus [`ROW_SLOTS_SLACK`].
    fn note_held(&mut self, row: u32, slot: u32) {
        let held: u64 = self.held[row as usize].iter().sum();
        let list = &mut self.row_slots[row as usize];
        list.push(slot);
        if list.len() >= 2 * held as usize + ROW_SLOTS_SLACK {
            self.compact_row_slots(row);
        }
    }

    /// Keep one entry per slot `row` still holds, in list order. Duplicates (a slot freed and
    /// reused, or a block evicted and stored again) are found by marking each kept slot, then
    /// unmarking: two linear passes, no sort (a churning row compacts often).
    fn compact_row_slots(&mut self, row: u32) {
        let mut list = std::mem::take(&mut self.row_slots[row as usize]);
        list.retain(|&slot| {
            let keep = !self.info[slot as usize].listed && self.row_holds_slot(row, slot);
            if keep {
                self.info[slot as usize].listed = true;
            }
            keep
        });
        for &slot in &list {
            self.info[slot as usize].listed = false;
        }
        self.row_slots[row as usize] = list;
    }

    /// Make room for rows `0..rows` (never shrinks). Re-lays every holder set when the word
    /// count changes: rare (a worker joined past a multiple of 64 rows), linear in the index
    /// size.
    pub fn ensure_rows(&mut self, rows: usize) {
        if rows <= self.rows {
            return;
        }
        let words = rows.div_ceil(64).max(1);
        if words != self.words {
            self.device = self.device.widen(words);
            if let Some(offload) = self.offload.as_deref_mut() {
                *offload = [offload[0].widen(words), offload[1].widen(words)];
            }
            self.words = words;
        }
        self.rows = rows;
        self.last_stored.resize(rows, NO_SLOT);
        self.held.resize(rows, [0; 3]);
        for column in &mut self.held_columns {
            column.resize(rows, 0.0);
        }
        self.row_slots.resize(rows, Vec::new());
    }

    /// Forget every block `row` holds on any tier (its worker left, or its engine restarted);
    /// returns how many (row, block, tier) entries it had. Linear in the number of blocks the
    /// row holds.
    pub fn clear_row(&mut self, row: u32) -> u64 {
        let cleared = Tier::ALL.iter().map(|&t| self.clear_row_tier(row, t)).sum();
        if let Some(last) = self.last_stored.get_mut(row as usize) {
            *last = NO_SLOT;
        }
        cleared
    }

    /// Forget the blocks `row` holds on `tier` (the engine cleared that cache); returns how many
    /// it held there. Visits the row's own slot list only: this runs under the index's write
    /// lock, which every decision waits on.
    pub fn clear_row_tier(&mut self, row: u32, tier: Tier) -> u64 {
        if row as usize >= self.rows || self.sets(tier).is_none() {
            return 0;
        }
        let mut list = std::mem::take(&mut self.row_slots[row as usize]);
        let mut cleared = 0;
        for &slot in &list {
            if self
                .sets_mut(tier)
                .is_some_and(|sets| sets.remove(slot, row))
            {
                cleared += 1;
                if self.slot_is_empty(slot) {
                    self.free_slot(slot);
                }
            }
        }
        debug_assert_eq!(cleared, self.held[row as usize][tier as usize]);
        // What is left: the slots the row still holds on other tiers, once each.
        if self.offload.is_none() {
            list.clear();
        }
        self.row_slots[row as usize] = list;
        self.compact_row_slots(row);
        self.count_held(row, tier, |_| 0);
        if tier == Tier::Device {
            self.last_stored[row as usize] = NO_SLOT;
        }
        cleared
    }
}
