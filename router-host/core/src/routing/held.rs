//! The prompt blocks each slot's in-flight requests hold, counted once per slot, for
//! [`DecodeBooking::Deduplicated`](crate::ledger::DecodeBooking::Deduplicated)
//! (docs/routing-contract.md §7).
//!
//! One table per in-flight shard, covering the slots that shard owns: it is only touched under
//! that shard's lock, with the booking or release that changes it, so the ledger's
//! `decode_blocks` for a slot always equals the distinct blocks held here plus the blocks
//! without ids of its requests. Each request's ids are kept here, not in its booking, so that
//! the default mode's bookings stay as small as they were.

use super::RequestId;
use crate::fast_hash::FastMap;
use crate::topology::Slot;

/// Per slot, how many in-flight requests hold each block id; per request, the ids it holds.
#[derive(Debug, Default)]
pub(super) struct HeldBlocks {
    slots: FastMap<Slot, FastMap<u64, u32>>,
    requests: FastMap<RequestId, Box<[u64]>>,
}

impl HeldBlocks {
    /// Request `id` on `slot` holds `blocks`: returns how many of them the slot did not hold
    /// yet. A block listed twice counts once, like a block two requests share.
    pub fn hold(&mut self, id: RequestId, slot: Slot, blocks: &[u64]) -> u64 {
        if blocks.is_empty() {
            return 0;
        }
        let new = self.count_in(slot, blocks);
        self.requests.insert(id, blocks.into());
        new
    }

    /// Request `id` on `slot` ended: returns how many of its blocks no request on the slot
    /// holds any more (0 for a request that held none, or whose slot was forgotten).
    pub fn release(&mut self, id: RequestId, slot: Slot) -> u64 {
        match self.requests.remove(&id) {
            Some(blocks) => self.count_out(slot, &blocks),
            None => 0,
        }
    }

    fn count_in(&mut self, slot: Slot, blocks: &[u64]) -> u64 {
        let held = self.slots.entry(slot).or_default();
        let mut new = 0;
        for &block in blocks {
            let count = held.entry(block).or_insert(0);
            if *count == 0 {
                new += 1;
            }
            *count = count.saturating_add(1);
        }
        new
    }

    fn count_out(&mut self, slot: Slot, blocks: &[u64]) -> u64 {
        let Some(held) = self.slots.get_mut(&slot) else {
            return 0;
        };
        let mut freed = 0;
        for block in blocks {
            if let Some(count) = held.get_mut(block) {
                *count -= 1;
                if *count == 0 {
                    held.remove(block);
                    freed += 1;
                }
            }
        }
        if held.is_empty() {
            self.slots.remove(&slot);
        }
        freed
    }

    /// Forget request `id`'s blocks without counting them out (its slot is being forgotten).
    pub fn forget_request(&mut self, id: RequestId) {
        self.requests.remove(&id);
    }

    /// Forget every block held on `slot` (its worker was removed, with its bookings).
    pub fn forget(&mut self, slot: Slot) {
        self.slots.remove(&slot);
    }

    /// The distinct blocks held on `slot`, into `out` (cleared first).
    pub fn ids_into(&self, slot: Slot, out: &mut Vec<u64>) {
        out.clear();
        if let Some(held) = self.slots.get(&slot) {
            out.extend(held.keys().copied());
        }
    }

    /// Distinct blocks held on `slot`.
    #[cfg(test)]
    pub fn distinct(&self, slot: Slot) -> usize {
        self.slots.get(&slot).map_or(0, FastMap::len)
    }

    /// Distinct blocks held, summed over slots, and requests holding blocks.
    pub fn totals(&self) -> (usize, usize) {
        (
            self.slots.values().map(FastMap::len).sum(),
            self.requests.len(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::HeldBlocks;

    #[test]
    fn shared_blocks_count_once_and_free_with_their_last_holder() {
        let mut held = HeldBlocks::default();
        assert_eq!(held.hold(10, 3, &[1, 2, 3]), 3);
        // Shares the first two blocks: only block 4 is new.
        assert_eq!(held.hold(11, 3, &[1, 2, 4]), 1);
        // Another slot counts on its own.
        assert_eq!(held.hold(12, 4, &[1, 2]), 2);
        assert_eq!(held.distinct(3), 4);
        let mut ids = vec![99];
        held.ids_into(3, &mut ids);
        ids.sort_unstable();
        assert_eq!(ids, [1, 2, 3, 4]);
        held.ids_into(9, &mut ids);
        assert!(ids.is_empty(), "a slot holding nothing lists nothing");
        // Blocks 1 and 2 are still held by request 11; 3 goes.
        assert_eq!(held.release(10, 3), 1);
        assert_eq!(held.release(10, 3), 0, "released once");
        assert_eq!(held.distinct(3), 3);
        assert_eq!(held.release(11, 3), 3);
        assert_eq!(held.distinct(3), 0);
        assert_eq!(held.release(12, 4), 2);
        assert_eq!(held.totals(), (0, 0));
    }

    #[test]
    fn a_block_listed_twice_is_one_block() {
        let mut held = HeldBlocks::default();
        assert_eq!(held.hold(1, 0, &[7, 7, 8]), 2);
        assert_eq!(held.release(1, 0), 2);
        assert_eq!(held.totals(), (0, 0));
    }

    #[test]
    fn a_forgotten_slot_starts_again_from_nothing() {
        let mut held = HeldBlocks::default();
        assert_eq!(held.hold(1, 5, &[1, 2]), 2);
        held.forget(5);
        held.forget_request(1);
        assert_eq!(held.totals(), (0, 0));
        assert_eq!(held.release(1, 5), 0);
        // A new holder of the slot starts from nothing.
        assert_eq!(held.hold(2, 5, &[1]), 1);
    }
}
