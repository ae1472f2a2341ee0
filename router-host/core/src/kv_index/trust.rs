//! How far each row's KV index can be trusted ([`KvIndexState`]), per slot, beside the index.
//!
//! The state is written by whoever feeds the row's events (serve's KV-event subscriber, on a
//! connect, a gap, a disconnect; rarely) and read by every decision that lends the CACHE
//! columns. So it lives outside the index's lock, one atomic byte per slot, in fixed chunks
//! that never move (as the ledger's cells): a decision reads it without a lock, and growing
//! never copies (so no write can be lost).
//!
//! A slot nobody feeds, or whose feeder keeps no trust state (replay's simulated engines, whose
//! events are exact), stays [`KvIndexState::Current`]: what the index says of it is all there is
//! to know, and nothing in it can be wrong.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use plugin_api::KvIndexState;

use crate::model::MAX_ROWS;
use crate::topology::Slot;

/// 1,024 slots of one byte per chunk.
const CHUNK_BITS: u32 = 10;
const CHUNK: usize = 1 << CHUNK_BITS;

/// Per slot, its [`KvIndexState`] code.
#[derive(Debug)]
pub struct RowTrust {
    chunks: Box<[OnceLock<Box<[AtomicU8]>>]>,
}

impl Default for RowTrust {
    fn default() -> Self {
        RowTrust::with_slots(0)
    }
}

impl RowTrust {
    /// Every slot of `0..slots` current (and room to grow to [`MAX_ROWS`]).
    pub fn with_slots(slots: usize) -> RowTrust {
        let trust = RowTrust {
            chunks: (0..MAX_ROWS.div_ceil(CHUNK))
                .map(|_| OnceLock::new())
                .collect(),
        };
        trust.ensure(slots.max(1));
        trust
    }

    /// Make sure slots `0..slots` have a state; new ones are current.
    pub fn ensure(&self, slots: usize) {
        for chunk in self.chunks.iter().take(slots.div_ceil(CHUNK)) {
            chunk.get_or_init(|| {
                (0..CHUNK)
                    .map(|_| AtomicU8::new(KvIndexState::Current as u8))
                    .collect()
            });
        }
    }

    #[inline]
    fn cell(&self, slot: Slot) -> Option<&AtomicU8> {
        let slot = slot as usize;
        self.chunks
            .get(slot >> CHUNK_BITS)?
            .get()?
            .get(slot & (CHUNK - 1))
    }

    /// `slot`'s state (current for a slot never allocated: it holds nothing).
    #[inline]
    pub fn get(&self, slot: Slot) -> KvIndexState {
        self.cell(slot).map_or(KvIndexState::Current, |c| {
            KvIndexState::from_u8(c.load(Ordering::Relaxed))
        })
    }

    /// Set `slot`'s state; returns the one it replaces.
    pub fn set(&self, slot: Slot, state: KvIndexState) -> KvIndexState {
        self.cell(slot).map_or(KvIndexState::Current, |c| {
            KvIndexState::from_u8(c.swap(state as u8, Ordering::Relaxed))
        })
    }

    /// Whether any slot of `0..slots` is not current (decides whether the column is worth
    /// sending; a plain scan, for tests and diagnostics).
    pub fn any_not_current(&self, slots: usize) -> bool {
        (0..slots as Slot).any(|s| !self.get(s).is_current())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_start_current_and_keep_what_is_set_across_growth() {
        let trust = RowTrust::with_slots(3);
        assert_eq!(trust.get(2), KvIndexState::Current);
        assert_eq!(trust.set(2, KvIndexState::Stale), KvIndexState::Current);
        assert!(trust.any_not_current(3));
        trust.ensure(5 * CHUNK);
        assert_eq!(trust.get(2), KvIndexState::Stale, "growing moves nothing");
        assert_eq!(trust.get(4 * CHUNK as Slot + 7), KvIndexState::Current);
        assert_eq!(trust.set(2, KvIndexState::Current), KvIndexState::Stale);
        assert!(!trust.any_not_current(5 * CHUNK));
        // Past what was allocated: nothing stored, read as current.
        assert_eq!(
            trust.set(Slot::MAX, KvIndexState::Unknown),
            KvIndexState::Current
        );
        assert_eq!(trust.get(Slot::MAX), KvIndexState::Current);
    }
}
