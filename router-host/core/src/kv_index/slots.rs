//! The slot table: a slot per block with its per-tier row bitsets, and the successor hints
//! the walk follows (see [`SlotInfo`]).

use super::{KvIndex, SlotInfo, Tier, NO_SLOT};

impl KvIndex {
    /// A slot for a block the index does not hold, its bitsets all zero (a freed slot's are).
    pub(super) fn new_slot(&mut self, block: u64) -> u32 {
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
    pub(super) fn word_at(&self, slot: u32, tier: Tier, word: usize) -> usize {
        match tier {
            Tier::Device => slot as usize * self.words + word,
            Tier::Host => slot as usize * 2 * self.words + word,
            Tier::Disk => (slot as usize * 2 + 1) * self.words + word,
        }
    }

    pub(super) fn tier_words_mut(&mut self, tier: Tier) -> &mut [u64] {
        match tier {
            Tier::Device => &mut self.masks,
            Tier::Host | Tier::Disk => &mut self.offload,
        }
    }

    pub(super) fn tier_words(&self, tier: Tier) -> &[u64] {
        match tier {
            Tier::Device => &self.masks,
            Tier::Host | Tier::Disk => &self.offload,
        }
    }

    /// No row holds the slot's block on any tier.
    pub(super) fn slot_is_empty(&self, slot: u32) -> bool {
        let words = self.words;
        let device = &self.masks[slot as usize * words..][..words];
        let offload: &[u64] = if self.has_offload {
            &self.offload[slot as usize * 2 * words..][..2 * words]
        } else {
            &[]
        };
        device.iter().chain(offload).all(|&w| w == 0)
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
