//! Booked load per row slot, updated from many threads without a lock.
//!
//! Every dispatched request books onto its row: one active request, its prompt tokens still to
//! prefill, and the KV blocks it will occupy while decoding; completion releases exactly that
//! (`docs/routing-contract.md` §7). This booked load is what policies see in their LOAD columns
//! and what the admission busy checks read.
//!
//! Traffic that bypasses this router is invisible to bookings, so a caller that observes a
//! row's real load (an engine's `num_requests_running + num_requests_waiting`) reports it with
//! [`Ledger::observe`]; a row's `active_requests` is then the larger of booked and observed.
//!
//! A ledger is one flat array of cells indexed by slot, shared by the topology snapshots that
//! use it (`crate::topology`). When workers outgrow it, the core builds a larger copy while no
//! booking or release can run (it holds every in-flight shard) and publishes it with the next
//! snapshot; a decision still reading the old one sees load as of that moment.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::model::{RowId, RowLoad};
use crate::topology::{Slot, Topology};

/// `observed` value meaning "no observation"; `n + 1` means `n` observed, so a new cell is
/// unobserved and reading is branch-free.
const UNOBSERVED: u64 = 0;

#[derive(Debug, Default)]
struct Cell {
    active: AtomicU64,
    prefill: AtomicU64,
    decode: AtomicU64,
    observed: AtomicU64,
}

impl Cell {
    /// Each counter is read on its own (Relaxed): a decision reads a near-current load, never
    /// a torn value, and nothing else is ordered by these reads.
    #[inline]
    fn load(&self) -> RowLoad {
        let booked = self.active.load(Ordering::Relaxed);
        let observed = self.observed.load(Ordering::Relaxed).saturating_sub(1);
        RowLoad {
            available: true,
            active_requests: booked.max(observed),
            active_prefill_tokens: self.prefill.load(Ordering::Relaxed),
            decode_blocks: self.decode.load(Ordering::Relaxed),
        }
    }

    fn booked(&self) -> RowLoad {
        RowLoad {
            available: true,
            active_requests: self.active.load(Ordering::Relaxed),
            active_prefill_tokens: self.prefill.load(Ordering::Relaxed),
            decode_blocks: self.decode.load(Ordering::Relaxed),
        }
    }

    fn copy(&self) -> Cell {
        let get = |c: &AtomicU64| AtomicU64::new(c.load(Ordering::Acquire));
        Cell {
            active: get(&self.active),
            prefill: get(&self.prefill),
            decode: get(&self.decode),
            observed: get(&self.observed),
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
#[derive(Debug, Default)]
pub struct Ledger {
    cells: Box<[Cell]>,
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
    /// An idle ledger for slots `0..slots`.
    pub fn with_slots(slots: usize) -> Ledger {
        Ledger {
            cells: (0..slots).map(|_| Cell::default()).collect(),
        }
    }

    /// Slots this ledger has cells for.
    pub fn slots(&self) -> usize {
        self.cells.len()
    }

    /// A copy with room for `slots` slots. The caller makes sure no booking or release runs
    /// meanwhile, or it would be lost from the copy.
    pub fn grown(&self, slots: usize) -> Ledger {
        let mut cells: Vec<Cell> = self.cells.iter().map(Cell::copy).collect();
        cells.resize_with(slots.max(self.cells.len()), Cell::default);
        Ledger {
            cells: cells.into_boxed_slice(),
        }
    }

    pub fn book(&self, slot: Slot, charge: Charge) {
        if let Some(cell) = self.cells.get(slot as usize) {
            add(&cell.active, 1);
            add(&cell.prefill, charge.prefill_tokens);
            add(&cell.decode, charge.decode_blocks);
        }
    }

    pub fn release(&self, slot: Slot, charge: Charge) {
        if let Some(cell) = self.cells.get(slot as usize) {
            sub(&cell.active, 1);
            sub(&cell.prefill, charge.prefill_tokens);
            sub(&cell.decode, charge.decode_blocks);
        }
    }

    /// The booking's prefill finished: only its prompt tokens are released.
    pub fn release_prefill(&self, slot: Slot, tokens: u64) {
        if let Some(cell) = self.cells.get(slot as usize) {
            sub(&cell.prefill, tokens);
        }
    }

    /// Record the row's observed active requests (`None` = forget the observation).
    pub fn observe(&self, slot: Slot, active_requests: Option<u64>) {
        if let Some(cell) = self.cells.get(slot as usize) {
            let value = active_requests.map_or(UNOBSERVED, |n| n.saturating_add(1));
            cell.observed.store(value, Ordering::Release);
        }
    }

    /// Forget everything about `slot` (its worker was removed).
    pub fn reset(&self, slot: Slot) {
        if let Some(cell) = self.cells.get(slot as usize) {
            cell.active.store(0, Ordering::Release);
            cell.prefill.store(0, Ordering::Release);
            cell.decode.store(0, Ordering::Release);
            cell.observed.store(UNOBSERVED, Ordering::Release);
        }
    }

    /// The load of `slot` as policies see it (idle for a slot past the end).
    #[inline]
    pub fn load(&self, slot: Slot) -> RowLoad {
        self.cells
            .get(slot as usize)
            .map_or_else(RowLoad::default, Cell::load)
    }

    /// The booked load alone (no observation), for invariant checks.
    pub fn booked(&self, slot: Slot) -> RowLoad {
        self.cells
            .get(slot as usize)
            .map_or_else(RowLoad::default, Cell::booked)
    }

    /// The load of every row of `rows` into four columns as long as `rows` (as
    /// [`Ledger::load`] row by row; idle for rows `topology` does not have). The hot loop of
    /// every decision: one worker lookup per change of worker, then a worker's ranks are
    /// consecutive slots.
    #[inline]
    pub fn fill(
        &self,
        topology: &Topology,
        rows: &[RowId],
        available: &mut [bool],
        active: &mut [u64],
        prefill: &mut [u64],
        decode: &mut [u64],
    ) {
        let columns = available.iter_mut().zip(active).zip(prefill).zip(decode);
        let mut worker = None;
        let mut run = crate::topology::SlotRun::EMPTY;
        for (row, (((available, active), prefill), decode)) in rows.iter().zip(columns) {
            if worker != Some(row.worker_id) {
                worker = Some(row.worker_id);
                run = topology.run_of(row.worker_id);
            }
            let load = run
                .slot(row.dp_rank)
                .and_then(|slot| self.cells.get(slot as usize))
                .map_or_else(RowLoad::default, Cell::load);
            (*available, *active, *prefill, *decode) = (
                load.available,
                load.active_requests,
                load.active_prefill_tokens,
                load.decode_blocks,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn books_releases_saturates_and_corrects_with_observations() {
        let ledger = Ledger::with_slots(8);
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
        // Growing keeps every value; slots past the end are idle and never panic.
        ledger.book(7, c(5, 1));
        let grown = ledger.grown(2048);
        assert_eq!(grown.slots(), 2048);
        assert_eq!(grown.load(7).active_prefill_tokens, 5);
        grown.book(2000, c(1, 1));
        assert_eq!(grown.load(2000).active_requests, 1);
        grown.reset(2000);
        assert_eq!(grown.load(2000), RowLoad::default());
        grown.book(u32::MAX, c(1, 1));
        assert_eq!(grown.load(u32::MAX), RowLoad::default());
    }
}
