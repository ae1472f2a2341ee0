//! The slot table: a slot per block with its per-tier holder sets, and the successor hints
//! the walk follows (see [`SlotInfo`]).

use super::holders::TierSets;
use super::{KvIndex, SlotInfo, Tier, NO_SLOT};

impl KvIndex {
    /// A slot for a block the index does not hold, its holder sets all empty (a freed slot's
    /// are).
    pub(super) fn new_slot(&mut self, block: u64) -> u32 {
        let fresh = SlotInfo {
            block,
            live: true,
            listed: false,
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
                self.device.push_slot();
                for sets in self.offload.iter_mut().flat_map(|o| o.iter_mut()) {
                    sets.push_slot();
                }
                self.info.push(fresh);
                slot
            }
        };
        self.slots.insert(block, slot);
        slot
    }

    /// No row holds `slot`'s block any more: the slot goes back to the free list.
    pub(super) fn free_slot(&mut self, slot: u32) {
        let block = self.info[slot as usize].block;
        self.slots.remove(&block);
        self.info[slot as usize].live = false;
        self.free.push(slot);
    }

    /// The holder sets of `tier` (`None` for an offload tier before any offload event).
    pub(super) fn sets(&self, tier: Tier) -> Option<&TierSets> {
        match tier {
            Tier::Device => Some(&self.device),
            Tier::Host => self.offload.as_deref().map(|o| &o[0]),
            Tier::Disk => self.offload.as_deref().map(|o| &o[1]),
        }
    }

    pub(super) fn sets_mut(&mut self, tier: Tier) -> Option<&mut TierSets> {
        match tier {
            Tier::Device => Some(&mut self.device),
            Tier::Host => self.offload.as_deref_mut().map(|o| &mut o[0]),
            Tier::Disk => self.offload.as_deref_mut().map(|o| &mut o[1]),
        }
    }

    /// No row holds the slot's block on any tier.
    pub(super) fn slot_is_empty(&self, slot: u32) -> bool {
        self.device.is_empty(slot)
            && self
                .offload
                .iter()
                .flat_map(|o| o.iter())
                .all(|sets| sets.is_empty(slot))
    }

    /// Whether `row` holds `slot`'s block on some tier.
    pub(super) fn row_holds_slot(&self, row: u32, slot: u32) -> bool {
        self.info[slot as usize].live
            && (self.device.contains(slot, row)
                || self
                    .offload
                    .iter()
                    .flat_map(|o| o.iter())
                    .any(|sets| sets.contains(slot, row)))
    }

    /// Row just stored `slot` after `previous`: make that the hint of `previous` unless it already
    /// has a live one and `slot` is a block the index already knew. A block seen for the first time
    /// is the continuation of a prompt (its predecessor is the block stored just before it);
    /// a known block after another is as likely the start of the row's next request, and must not
    /// displace a continuation found earlier.
    pub(super) fn link(&mut self, previous: u32, slot: u32, created: bool) {
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

    /// The slot of `block` in a walk that found `previous` last: its successor when the chain
    /// allows, else the block map's; `None` once the block is not indexed (the walk ends).
    #[inline(always)]
    pub(super) fn walk_step(&self, previous: u32, block: u64) -> Option<u32> {
        self.successor(previous, block)
            .or_else(|| self.slots.get(&block).copied())
    }

    /// The slot of `block` if the hint of slot `previous` names it and still holds it (see
    /// [`SlotInfo`]); `None` means "look it up".
    ///
    /// The slots right after and right before `previous` are tried first: their addresses do
    /// not depend on `previous`'s data, so along a prompt stored in consecutive slots (as a new
    /// index hands them out, and as freed slots are reused when a prompt's blocks were freed
    /// together) the walk's loads overlap instead of waiting one for another.
    #[inline]
    pub(super) fn successor(&self, previous: u32, block: u64) -> Option<u32> {
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
}
