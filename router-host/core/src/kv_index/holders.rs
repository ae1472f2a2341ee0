//! The rows holding each slot's block on one tier ([`TierSets`]).
//!
//! Up to [`DENSE_MAX_WORDS`] bitset words (256 rows) every slot keeps a bitset of its holders:
//! it is no larger than the small form below, and the walk ANDs a few words in registers.
//! Beyond that a bitset per slot is what made memory grow with the square of the fleet (a block
//! held by one row of 4,096 cost 512 bytes), so each slot keeps a [`Holders`] cell instead: up
//! to [`SMALL`] row ids inline and sorted (the common case, a block held by a few rows), and a
//! bitset in a shared spill pool only while more rows hold it.

/// Widest per-slot bitset (in 64-bit words) kept inline: at 4 words a bitset is the size of a
/// [`Holders`] cell, so the dense layout never costs more memory.
pub(super) const DENSE_MAX_WORDS: usize = 4;

/// Row ids a [`Holders`] cell keeps inline: 7 plus the count fill 32 bytes, half a cache line
/// (so a cell never straddles two lines).
pub(super) const SMALL: usize = 7;

/// A spilled set returns inline once it has at most this many holders: below [`SMALL`], so that a
/// block whose holder count moves around the threshold does not convert on every event.
const UNSPILL: u32 = 4;

/// `len`'s flag: the set is in the spill pool (`rows[0]` is its index there).
const SPILLED: u32 = 1 << 31;

/// The holders of one slot on one tier, in the sparse layout.
#[derive(Debug, Clone, Copy, Default)]
#[repr(C, align(32))]
pub(super) struct Holders {
    /// How many rows hold the block, with [`SPILLED`] set when they are in the spill pool.
    len: u32,
    /// Inline: the first `len` entries, ascending. Spilled: `rows[0]` is the pool index.
    rows: [u32; SMALL],
}

impl Holders {
    fn count(&self) -> u32 {
        self.len & !SPILLED
    }

    fn spilled(&self) -> Option<usize> {
        (self.len & SPILLED != 0).then_some(self.rows[0] as usize)
    }
}

/// A slot's holders on one tier as the walk reads them.
#[derive(Debug, Clone, Copy)]
pub(super) enum View<'a> {
    /// A bitset of `words` words (bit `r` = row `r`).
    Bits(&'a [u64]),
    /// Row ids, ascending.
    Rows(&'a [u32]),
}

impl View<'_> {
    /// OR this set into a bitset of the index's width.
    pub(super) fn or_into(self, bits: &mut [u64]) {
        match self {
            View::Bits(words) => bits.iter_mut().zip(words).for_each(|(b, w)| *b |= w),
            View::Rows(rows) => {
                for &row in rows {
                    bits[row as usize / 64] |= 1 << (row % 64);
                }
            }
        }
    }
}

/// Per slot, the rows holding its block on one tier.
#[derive(Debug, Clone)]
pub(super) enum TierSets {
    /// `words` bitset words per slot.
    Dense { words: usize, bits: Vec<u64> },
    /// A [`Holders`] cell per slot; `spill` holds `words` words per spilled set, `free` the
    /// spill sets not in use.
    Sparse {
        words: usize,
        cells: Vec<Holders>,
        spill: Vec<u64>,
        free: Vec<u32>,
    },
}

impl TierSets {
    /// Empty sets for `slots` slots, for rows in `words` bitset words.
    pub(super) fn new(words: usize, slots: usize) -> Self {
        if words <= DENSE_MAX_WORDS {
            TierSets::Dense {
                words,
                bits: vec![0; slots * words],
            }
        } else {
            TierSets::Sparse {
                words,
                cells: vec![Holders::default(); slots],
                spill: Vec::new(),
                free: Vec::new(),
            }
        }
    }

    /// Room for one more slot, holding nothing.
    pub(super) fn push_slot(&mut self) {
        match self {
            TierSets::Dense { words, bits } => bits.resize(bits.len() + *words, 0),
            TierSets::Sparse { cells, .. } => cells.push(Holders::default()),
        }
    }

    /// The holders of `slot`.
    #[inline(always)]
    pub(super) fn view(&self, slot: u32) -> View<'_> {
        match self {
            TierSets::Dense { words, bits } => View::Bits(&bits[slot as usize * words..][..*words]),
            TierSets::Sparse {
                words,
                cells,
                spill,
                ..
            } => {
                let cell = &cells[slot as usize];
                match cell.spilled() {
                    Some(at) => View::Bits(&spill[at * words..][..*words]),
                    None => View::Rows(&cell.rows[..cell.count() as usize]),
                }
            }
        }
    }

    pub(super) fn contains(&self, slot: u32, row: u32) -> bool {
        match self.view(slot) {
            View::Bits(bits) => bits[row as usize / 64] & (1 << (row % 64)) != 0,
            View::Rows(rows) => rows.contains(&row),
        }
    }

    pub(super) fn is_empty(&self, slot: u32) -> bool {
        match self {
            TierSets::Dense { words, bits } => bits[slot as usize * words..][..*words]
                .iter()
                .all(|&w| w == 0),
            TierSets::Sparse { cells, .. } => cells[slot as usize].count() == 0,
        }
    }

    /// How many rows hold `slot`'s block.
    pub(super) fn count(&self, slot: u32) -> u64 {
        match self {
            TierSets::Dense { words, bits } => bits[slot as usize * words..][..*words]
                .iter()
                .map(|w| u64::from(w.count_ones()))
                .sum(),
            TierSets::Sparse { cells, .. } => u64::from(cells[slot as usize].count()),
        }
    }

    /// Add `row` to `slot`'s holders; whether it was not there.
    pub(super) fn insert(&mut self, slot: u32, row: u32) -> bool {
        let (word, bit) = (row as usize / 64, 1u64 << (row % 64));
        match self {
            TierSets::Dense { words, bits } => {
                let w = &mut bits[slot as usize * *words + word];
                let new = *w & bit == 0;
                *w |= bit;
                new
            }
            TierSets::Sparse {
                words,
                cells,
                spill,
                free,
            } => {
                let cell = &mut cells[slot as usize];
                if let Some(at) = cell.spilled() {
                    let w = &mut spill[at * *words + word];
                    if *w & bit != 0 {
                        return false;
                    }
                    *w |= bit;
                    cell.len += 1;
                    return true;
                }
                let len = cell.count() as usize;
                let Err(at) = cell.rows[..len].binary_search(&row) else {
                    return false;
                };
                if len < SMALL {
                    cell.rows.copy_within(at..len, at + 1);
                    cell.rows[at] = row;
                    cell.len += 1;
                    return true;
                }
                // Full: move the holders to a bitset in the spill pool.
                let set = match free.pop() {
                    Some(set) => set as usize,
                    None => {
                        spill.resize(spill.len() + *words, 0);
                        spill.len() / *words - 1
                    }
                };
                let bits = &mut spill[set * *words..][..*words];
                for &r in &cell.rows {
                    bits[r as usize / 64] |= 1 << (r % 64);
                }
                bits[word] |= bit;
                cell.rows[0] = set as u32;
                cell.len = (SMALL as u32 + 1) | SPILLED;
                true
            }
        }
    }

    /// Take `row` out of `slot`'s holders; whether it was there.
    pub(super) fn remove(&mut self, slot: u32, row: u32) -> bool {
        let (word, bit) = (row as usize / 64, 1u64 << (row % 64));
        match self {
            TierSets::Dense { words, bits } => {
                let w = &mut bits[slot as usize * *words + word];
                let held = *w & bit != 0;
                *w &= !bit;
                held
            }
            TierSets::Sparse {
                words,
                cells,
                spill,
                free,
            } => {
                let cell = &mut cells[slot as usize];
                if let Some(at) = cell.spilled() {
                    let bits = &mut spill[at * *words..][..*words];
                    if bits[word] & bit == 0 {
                        return false;
                    }
                    bits[word] &= !bit;
                    cell.len -= 1;
                    if cell.count() <= UNSPILL {
                        // Back inline; the pool's set is left zeroed for its next use.
                        let mut n = 0;
                        for (w, bits) in bits.iter_mut().enumerate() {
                            let mut b = std::mem::take(bits);
                            while b != 0 {
                                cell.rows[n] = (w * 64) as u32 + b.trailing_zeros();
                                n += 1;
                                b &= b - 1;
                            }
                        }
                        cell.len = n as u32;
                        free.push(at as u32);
                    }
                    return true;
                }
                let len = cell.count() as usize;
                let Ok(at) = cell.rows[..len].binary_search(&row) else {
                    return false;
                };
                cell.rows.copy_within(at + 1..len, at);
                cell.len -= 1;
                true
            }
        }
    }

    /// The same sets for rows in `new_words` bitset words (more than before): the layout
    /// changes with the width (dense up to [`DENSE_MAX_WORDS`], sparse beyond).
    pub(super) fn widen(&self, new_words: usize) -> TierSets {
        let slots = match self {
            TierSets::Dense { words, bits } => bits.len() / words,
            TierSets::Sparse { cells, .. } => cells.len(),
        };
        let mut wider = TierSets::new(new_words, slots);
        let mut rows = Vec::new();
        for slot in 0..slots as u32 {
            rows.clear();
            match self.view(slot) {
                View::Rows(r) => rows.extend_from_slice(r),
                View::Bits(bits) => {
                    for (w, &bits) in bits.iter().enumerate() {
                        let mut b = bits;
                        while b != 0 {
                            rows.push((w * 64) as u32 + b.trailing_zeros());
                            b &= b - 1;
                        }
                    }
                }
            }
            for &row in &rows {
                wider.insert(slot, row);
            }
        }
        wider
    }

    /// Spilled sets in use (for tests).
    #[cfg(test)]
    pub(super) fn spill_sets(&self) -> usize {
        match self {
            TierSets::Dense { .. } => 0,
            TierSets::Sparse {
                words, spill, free, ..
            } => spill.len() / words - free.len(),
        }
    }
}
