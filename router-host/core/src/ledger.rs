//! Booked load per row slot, updated from many threads without a lock.
//!
//! Every dispatched request books onto its row: one active request, its prompt tokens still to
//! prefill, and the KV blocks it will occupy while decoding; completion releases exactly that
//! (`docs/routing-contract.md`, "Booking"). This booked load is what policies see in their LOAD
//! columns and what the admission busy checks read.
//!
//! Traffic that bypasses this router is invisible to bookings, so a caller that observes a
//! row's real load (an engine's `num_requests_running + num_requests_waiting`) reports it with
//! [`Ledger::observe`]; a row's `active_requests` is then the larger of booked and observed.
//!
//! Cells live in fixed chunks allocated on first use, so the ledger grows as slots are handed
//! out without moving cells other threads are updating.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use crate::model::{RowLoad, MAX_ROWS};
use crate::topology::Slot;

const CHUNK: usize = 1024;
const CHUNKS: usize = MAX_ROWS.div_ceil(CHUNK);
/// `observed` value meaning "no observation".
const UNOBSERVED: u64 = u64::MAX;

#[derive(Debug)]
struct Cell {
    active: AtomicU64,
    prefill: AtomicU64,
    decode: AtomicU64,
    observed: AtomicU64,
}

impl Default for Cell {
    fn default() -> Self {
        Cell {
            active: AtomicU64::new(0),
            prefill: AtomicU64::new(0),
            decode: AtomicU64::new(0),
            observed: AtomicU64::new(UNOBSERVED),
        }
    }
}

/// What one booking adds to its row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Charge {
    pub prefill_tokens: u64,
    pub decode_blocks: u64,
}

/// Booked (and observed) load per slot.
pub struct Ledger {
    chunks: Box<[OnceLock<Box<[Cell]>>]>,
}

impl Default for Ledger {
    fn default() -> Self {
        Ledger {
            chunks: (0..CHUNKS).map(|_| OnceLock::new()).collect(),
        }
    }
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let chunks = self.chunks.iter().filter(|c| c.get().is_some()).count();
        f.debug_struct("Ledger").field("chunks", &chunks).finish()
    }
}

// Saturating: prompt sizes come from callers, and a wrapped counter would look idle.
fn add(counter: &AtomicU64, n: u64) {
    if n != 0 {
        let _ = counter.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
            Some(v.saturating_add(n))
        });
    }
}

fn sub(counter: &AtomicU64, n: u64) {
    if n != 0 {
        let _ = counter.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
            Some(v.saturating_sub(n))
        });
    }
}

impl Ledger {
    /// The cell of `slot`, allocating its chunk on first use (`None` past [`MAX_ROWS`]).
    fn cell(&self, slot: Slot) -> Option<&Cell> {
        let slot = slot as usize;
        let chunk = self.chunks.get(slot / CHUNK)?;
        let cells = chunk.get_or_init(|| (0..CHUNK).map(|_| Cell::default()).collect());
        cells.get(slot % CHUNK)
    }

    /// The cell of `slot` if its chunk exists (reads never allocate).
    #[inline]
    fn existing(&self, slot: Slot) -> Option<&Cell> {
        let slot = slot as usize;
        self.chunks.get(slot / CHUNK)?.get()?.get(slot % CHUNK)
    }

    pub fn book(&self, slot: Slot, charge: Charge) {
        if let Some(cell) = self.cell(slot) {
            add(&cell.active, 1);
            add(&cell.prefill, charge.prefill_tokens);
            add(&cell.decode, charge.decode_blocks);
        }
    }

    pub fn release(&self, slot: Slot, charge: Charge) {
        if let Some(cell) = self.existing(slot) {
            sub(&cell.active, 1);
            sub(&cell.prefill, charge.prefill_tokens);
            sub(&cell.decode, charge.decode_blocks);
        }
    }

    /// The booking's prefill finished: only its prompt tokens are released.
    pub fn release_prefill(&self, slot: Slot, tokens: u64) {
        if let Some(cell) = self.existing(slot) {
            sub(&cell.prefill, tokens);
        }
    }

    /// Record the row's observed active requests (`None` = forget the observation).
    pub fn observe(&self, slot: Slot, active_requests: Option<u64>) {
        if let Some(cell) = self.cell(slot) {
            let value = active_requests.map_or(UNOBSERVED, |n| n.min(UNOBSERVED - 1));
            cell.observed.store(value, Ordering::Release);
        }
    }

    /// Forget everything about `slot` (its worker was removed).
    pub fn reset(&self, slot: Slot) {
        if let Some(cell) = self.existing(slot) {
            cell.active.store(0, Ordering::Release);
            cell.prefill.store(0, Ordering::Release);
            cell.decode.store(0, Ordering::Release);
            cell.observed.store(UNOBSERVED, Ordering::Release);
        }
    }

    /// The load of `slot` as policies see it.
    #[inline]
    pub fn load(&self, slot: Slot) -> RowLoad {
        let Some(cell) = self.existing(slot) else {
            return RowLoad::default();
        };
        let booked = cell.active.load(Ordering::Acquire);
        let observed = cell.observed.load(Ordering::Acquire);
        RowLoad {
            available: true,
            active_requests: if observed == UNOBSERVED {
                booked
            } else {
                booked.max(observed)
            },
            active_prefill_tokens: cell.prefill.load(Ordering::Acquire),
            decode_blocks: cell.decode.load(Ordering::Acquire),
        }
    }

    /// The booked load alone (no observation), for invariant checks.
    pub fn booked(&self, slot: Slot) -> RowLoad {
        let Some(cell) = self.existing(slot) else {
            return RowLoad::default();
        };
        RowLoad {
            available: true,
            active_requests: cell.active.load(Ordering::Acquire),
            active_prefill_tokens: cell.prefill.load(Ordering::Acquire),
            decode_blocks: cell.decode.load(Ordering::Acquire),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn books_releases_saturates_and_corrects_with_observations() {
        let ledger = Ledger::default();
        let c = |p, d| Charge {
            prefill_tokens: p,
            decode_blocks: d,
        };
        ledger.book(3, c(100, 2));
        ledger.book(3, c(u64::MAX, 1));
        assert_eq!(ledger.load(3).active_requests, 2);
        assert_eq!(ledger.load(3).active_prefill_tokens, u64::MAX);
        ledger.release(3, c(100, 2));
        ledger.release_prefill(3, u64::MAX);
        assert_eq!(ledger.load(3).active_prefill_tokens, 0);
        assert_eq!(ledger.load(3).decode_blocks, 1);
        ledger.observe(3, Some(7));
        assert_eq!(ledger.load(3).active_requests, 7);
        assert_eq!(ledger.booked(3).active_requests, 1);
        ledger.observe(3, Some(0));
        assert_eq!(ledger.load(3).active_requests, 1, "booked wins when larger");
        ledger.observe(3, None);
        ledger.release(3, c(0, 1));
        ledger.release(3, c(0, 1));
        assert_eq!(ledger.load(3), RowLoad::default(), "never below zero");
        // Far slots, and slots past the cap, are idle and never panic.
        ledger.book(200_000, c(1, 1));
        assert_eq!(ledger.load(200_000).active_requests, 1);
        ledger.reset(200_000);
        assert_eq!(ledger.load(200_000), RowLoad::default());
        ledger.book(u32::MAX, c(1, 1));
        assert_eq!(ledger.load(u32::MAX), RowLoad::default());
    }
}
