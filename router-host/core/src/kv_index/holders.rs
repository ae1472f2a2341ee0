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

/// A slot's holders on one tier, for changing them ([`TierSets::slot_mut`]).
enum SlotMut<'a> {
    /// A bitset: the dense layout's, or a spilled set with the cell that counts it and the spill
    /// pool's free list (to give the set back when it returns inline).
    Bits {
        bits: &'a mut [u64],
        spilled: Option<(&'a mut Holders, &'a mut Vec<u32>)>,
    },
    /// An inline cell, with the spill pool (sets of `words` words) to spill into.
    Inline {
        cell: &'a mut Holders,
        words: usize,
        spill: &'a mut Vec<u64>,
        free: &'a mut Vec<u32>,
    },
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

    /// `slot`'s holders, for changing them.
    #[inline(always)]
    fn slot_mut(&mut self, slot: u32) -> SlotMut<'_> {
        match self {
            TierSets::Dense { words, bits } => SlotMut::Bits {
                bits: &mut bits[slot as usize * *words..][..*words],
                spilled: None,
            },
            TierSets::Sparse {
                words,
                cells,
                spill,
                free,
            } => {
                let cell = &mut cells[slot as usize];
                match cell.spilled() {
                    Some(at) => SlotMut::Bits {
                        bits: &mut spill[at * *words..][..*words],
                        spilled: Some((cell, free)),
                    },
                    None => SlotMut::Inline {
                        cell,
                        words: *words,
                        spill,
                        free,
                    },
                }
            }
        }
    }

    /// Add `row` to `slot`'s holders; whether it was not there.
    pub(super) fn insert(&mut self, slot: u32, row: u32) -> bool {
        let (word, bit) = (row as usize / 64, 1u64 << (row % 64));
        match self.slot_mut(slot) {
            SlotMut::Bits { bits, spilled } => {
                if bits[word] & bit != 0 {
                    return false;
                }
                bits[word] |= bit;
                if let Some((cell, _)) = spilled {
                    cell.len += 1;
                }
                true
            }
            SlotMut::Inline {
                cell,
                words,
                spill,
                free,
            } => {
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
                        spill.resize(spill.len() + words, 0);
                        spill.len() / words - 1
                    }
                };
                let bits = &mut spill[set * words..][..words];
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
        match self.slot_mut(slot) {
            SlotMut::Bits { bits, spilled } => {
                if bits[word] & bit == 0 {
                    return false;
                }
                bits[word] &= !bit;
                let Some((cell, free)) = spilled else {
                    return true;
                };
                cell.len -= 1;
                if cell.count() <= UNSPILL {
                    // Back inline; the pool's set is left zeroed for its next use.
                    free.push(cell.rows[0]);
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
                }
                true
            }
            SlotMut::Inline { cell, .. } => {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(sets: &TierSets, slot: u32) -> Vec<u32> {
        let mut bits = vec![0u64; 8];
        sets.view(slot).or_into(&mut bits);
        (0..8 * 64)
            .filter(|&r| bits[r / 64] & (1 << (r % 64)) != 0)
            .map(|r| r as u32)
            .collect()
    }

    /// Insert and remove answer whether they changed the set, on every layout: dense, inline,
    /// spilled, and back inline; the other slot is never touched.
    #[test]
    fn insert_and_remove_say_whether_the_set_changed_on_every_layout() {
        for words in [1, DENSE_MAX_WORDS + 1] {
            let mut sets = TierSets::new(words, 2);
            let many: Vec<u32> = (0..SMALL as u32 + 3)
                .map(|i| (i * 37) % (64 * words) as u32)
                .collect();
            for (n, &row) in many.iter().enumerate() {
                assert!(sets.insert(1, row), "words {words}: row {row} is new");
                assert!(!sets.insert(1, row), "words {words}: row {row} again");
                assert_eq!(sets.count(1), n as u64 + 1);
                assert!(sets.contains(1, row));
                let spilled = words > DENSE_MAX_WORDS && n >= SMALL;
                assert_eq!(
                    sets.spill_sets(),
                    usize::from(spilled),
                    "words {words}, {n}"
                );
            }
            let mut sorted = many.clone();
            sorted.sort_unstable();
            assert_eq!(rows(&sets, 1), sorted);
            assert!(sets.is_empty(0));
            let absent = (0..64 * words as u32)
                .find(|r| !many.contains(r))
                .unwrap_or(0);
            assert!(!sets.remove(1, absent), "words {words}: an absent row");
            assert!(
                !sets.remove(0, many[0]),
                "words {words}: another slot's row"
            );
            for (n, &row) in many.iter().enumerate().rev() {
                assert!(sets.remove(1, row), "words {words}: row {row} was there");
                assert!(!sets.remove(1, row), "words {words}: row {row} is gone");
                assert!(!sets.contains(1, row));
                assert_eq!(sets.count(1), n as u64);
                // Spilled until the count falls to UNSPILL.
                let spilled = words > DENSE_MAX_WORDS && n > UNSPILL as usize;
                assert_eq!(
                    sets.spill_sets(),
                    usize::from(spilled),
                    "words {words}, {n}"
                );
                assert_eq!(rows(&sets, 1), {
                    let mut left = many[..n].to_vec();
                    left.sort_unstable();
                    left
                });
            }
            assert!(sets.is_empty(1));
        }
    }

    /// A set that returns inline gives its spill set back, and the next spill reuses it.
    #[test]
    fn a_spill_set_is_reused_after_its_slot_returns_inline() {
        let words = DENSE_MAX_WORDS + 1;
        let mut sets = TierSets::new(words, 2);
        for row in 0..=SMALL as u32 {
            sets.insert(0, row * 40);
        }
        for row in UNSPILL..=SMALL as u32 {
            sets.remove(0, row * 40);
        }
        assert_eq!(sets.spill_sets(), 0);
        for row in 0..=SMALL as u32 {
            sets.insert(1, row * 41);
        }
        assert_eq!(sets.spill_sets(), 1);
        let TierSets::Sparse { spill, .. } = &sets else {
            panic!("sparse at {words} words");
        };
        assert_eq!(spill.len(), words, "one set in the pool, used twice");
        assert_eq!(
            rows(&sets, 0),
            (0..UNSPILL).map(|r| r * 40).collect::<Vec<_>>()
        );
    }
}
