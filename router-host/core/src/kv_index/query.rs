//! What the index answers: blocks held per row and tier, and the leading overlap of a
//! prompt's blocks on every row at once (the walk).

use super::holders::{TierSets, View, SMALL};
use super::{KvIndex, Tier, NO_SLOT};

impl KvIndex {
    /// Whether any row ever reported a block off the device.
    pub fn has_offload_tiers(&self) -> bool {
        self.offload.is_some()
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

    /// Blocks each row holds on each tier as `f64` columns (in [`Tier::ALL`] order), indexed by
    /// row and [`KvIndex::rows`] long: the same counts as [`KvIndex::held_by_tier`], kept as
    /// events arrive, so that a decision lends them by copying a slice.
    pub fn held_columns(&self) -> [&[f64]; 3] {
        let [device, host, disk] = &self.held_columns;
        [device, host, disk]
    }

    /// Whether any row has reported a block off the device since the index was made; if not,
    /// the host and disk columns of [`KvIndex::held_columns`] are all zero.
    pub fn holds_offload(&self) -> bool {
        self.offload.is_some()
    }

    /// (row, block) pairs held on the device, over all rows.
    pub fn holdings(&self) -> u64 {
        self.holdings_in(Tier::Device)
    }

    /// (row, block) pairs held on `tier`, over all rows.
    pub fn holdings_in(&self, tier: Tier) -> u64 {
        let Some(sets) = self.sets(tier) else {
            return 0;
        };
        self.slots.values().map(|&slot| sets.count(slot)).sum()
    }

    /// Whether `row` holds `block` on the device.
    pub fn holds(&self, row: u32, block: u64) -> bool {
        self.holds_in(row, block, Tier::Device)
    }

    /// Whether `row` holds `block` on `tier`.
    pub fn holds_in(&self, row: u32, block: u64, tier: Tier) -> bool {
        if row as usize >= self.rows {
            return false;
        }
        let Some(sets) = self.sets(tier) else {
            return false;
        };
        self.slots
            .get(&block)
            .is_some_and(|&slot| sets.contains(slot, row))
    }

    /// `out[row]` = how many leading blocks of `blocks` row holds. `alive` is scratch.
    pub fn overlaps(&self, blocks: &[u64], out: &mut Vec<u32>, alive: &mut Vec<u64>) {
        out.clear();
        out.resize(self.rows, 0);
        let masks = match &self.device {
            TierSets::Dense { bits, .. } => bits,
            TierSets::Sparse { .. } => return self.walk_sparse(blocks, out, alive),
        };
        // Up to 128 rows the surviving-rows bitset lives in registers and the per-block work is
        // unrolled (the same code, with the word count known).
        match self.words {
            1 => self.walk(blocks, out, masks, &mut [!0; 1]),
            2 => self.walk(blocks, out, masks, &mut [!0; 2]),
            words => {
                alive.clear();
                alive.resize(words, !0);
                self.walk(blocks, out, masks, alive);
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
        let Some(offload) = self.offload.as_deref() else {
            host.clear();
            disk.clear();
            return self.overlaps(blocks, device, alive);
        };
        for out in [&mut *device, &mut *host, &mut *disk] {
            out.clear();
            out.resize(self.rows, 0);
        }
        let words = self.words;
        // The three runs' survivors, then the block's holders at each level.
        alive.clear();
        alive.resize(6 * words, !0);
        let (alive, levels) = alive.split_at_mut(3 * words);
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
            let Some(slot) = self.walk_step(previous, block) else {
                break;
            };
            previous = slot;
            levels.fill(0);
            let (on_device, rest) = levels.split_at_mut(words);
            let (on_host, on_disk) = rest.split_at_mut(words);
            self.device.view(slot).or_into(on_device);
            offload[0].view(slot).or_into(on_host);
            offload[1].view(slot).or_into(on_disk);
            let mut any = 0;
            for w in 0..words {
                let near = on_device[w] | on_host[w];
                let held = [on_device[w], near, near | on_disk[w]];
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
    fn walk(&self, blocks: &[u64], out: &mut [u32], masks: &[u64], alive: &mut [u64]) {
        let words = alive.len();
        if !self.rows.is_multiple_of(64) {
            alive[words - 1] = (1u64 << (self.rows % 64)) - 1;
        }
        let mut depth = 0;
        let mut previous = NO_SLOT;
        for &block in blocks {
            let Some(slot) = self.walk_step(previous, block) else {
                break;
            };
            previous = slot;
            let mask = &masks[slot as usize * words..][..words];
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

    /// [`KvIndex::overlaps`] over sparse holder sets. The survivors start as the first block's
    /// holders, kept as a bitset (`bits`, scratch) while they are many and as a short list once
    /// a block held by a few rows narrows them: from then on each block costs a test per
    /// surviving row, whatever the fleet's size.
    fn walk_sparse(&self, blocks: &[u64], out: &mut [u32], bits: &mut Vec<u64>) {
        bits.clear();
        bits.resize(self.words, 0);
        let mut list = [0u32; SMALL];
        let mut listed = 0;
        let mut listing = false;
        let mut depth = 0u32;
        let mut previous = NO_SLOT;
        for &block in blocks {
            let Some(slot) = self.walk_step(previous, block) else {
                break;
            };
            previous = slot;
            let holders = self.device.view(slot);
            // Rows that do not hold the first block keep their zero.
            let survivors = match (depth, listing, holders) {
                (0, _, View::Rows(rows)) => {
                    list[..rows.len()].copy_from_slice(rows);
                    listed = rows.len();
                    listing = true;
                    listed
                }
                (0, _, View::Bits(held)) => {
                    bits.copy_from_slice(held);
                    bits.iter().any(|&w| w != 0) as usize
                }
                (_, true, holders) => {
                    let mut kept = 0;
                    for i in 0..listed {
                        let row = list[i];
                        let holds = match holders {
                            View::Rows(rows) => rows.contains(&row),
                            View::Bits(held) => held[row as usize / 64] & (1 << (row % 64)) != 0,
                        };
                        if holds {
                            list[kept] = row;
                            kept += 1;
                        } else {
                            out[row as usize] = depth;
                        }
                    }
                    listed = kept;
                    listed
                }
                (_, false, View::Bits(held)) => {
                    // As the dense walk: most blocks drop nobody, so one test comes first.
                    let dropped = bits
                        .iter()
                        .zip(held)
                        .fold(0, |dropped, (&alive, &held)| dropped | (alive & !held));
                    if dropped == 0 {
                        1
                    } else {
                        let mut left = 0;
                        for (w, (alive, &held)) in bits.iter_mut().zip(held).enumerate() {
                            let mut dropped = *alive & !held;
                            while dropped != 0 {
                                let bit = dropped.trailing_zeros() as usize;
                                out[w * 64 + bit] = depth;
                                dropped &= dropped - 1;
                            }
                            *alive &= held;
                            left += alive.count_ones() as usize;
                        }
                        // Few survivors left: test just them from here on.
                        if left <= SMALL {
                            for (w, &alive) in bits.iter().enumerate() {
                                let mut alive = alive;
                                while alive != 0 {
                                    list[listed] = (w * 64) as u32 + alive.trailing_zeros();
                                    listed += 1;
                                    alive &= alive - 1;
                                }
                            }
                            listing = true;
                        }
                        left
                    }
                }
                (_, false, View::Rows(rows)) => {
                    // Every survivor stops here but the few holding this block (whose entry is
                    // written again when they stop or at the end).
                    for (w, &alive) in bits.iter().enumerate() {
                        let mut alive = alive;
                        while alive != 0 {
                            out[w * 64 + alive.trailing_zeros() as usize] = depth;
                            alive &= alive - 1;
                        }
                    }
                    for &row in rows {
                        if bits[row as usize / 64] & (1 << (row % 64)) != 0 {
                            list[listed] = row;
                            listed += 1;
                        }
                    }
                    listing = true;
                    listed
                }
            };
            if survivors == 0 {
                return;
            }
            depth += 1;
        }
        // The survivors hold the first `depth` blocks.
        if listing {
            for &row in &list[..listed] {
                out[row as usize] = depth;
            }
        } else {
            for (w, &alive) in bits.iter().enumerate() {
                let mut alive = alive;
                while alive != 0 {
                    out[w * 64 + alive.trailing_zeros() as usize] = depth;
                    alive &= alive - 1;
                }
            }
        }
    }
}
