//! Booked load per row slot: read by every decision without a lock, written by one thread at a
//! time per slot.
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
//! Several replicas routing onto the same engines each book only their own requests; the load
//! the other replicas booked on a row (shared through their store, docs/replicas.md) is set
//! with [`Ledger::set_shared`] and added to this replica's bookings in every read, before the
//! observation's correction. It is kept apart so that what this replica publishes
//! ([`Ledger::booked`]) never includes what it was told.
//!
//! A ledger never moves: its cells live in fixed-size chunks allocated as workers need them and
//! kept for the core's life, so a booking or release addresses its cell by slot alone, without
//! holding a topology snapshot, and growing never copies a counter (so none can be lost).
//!
//! Writers of one slot never run at once: the core books and releases a slot only under the
//! in-flight shard lock that owns the slot (`crate::routing`), which it holds anyway to record
//! the booking. So an update is a plain load and store of an atomic (a locked read-modify-write
//! costs about 12 ns on the machine in `docs/performance.md`, and a request would pay six),
//! while readers still see every counter whole. That rule is why the writing methods are
//! `pub(crate)`. Counters saturate: prompt sizes come from callers, and a wrapped counter would
//! look idle.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;

use plugin_api::Columns;

use crate::model::{RowId, RowLoad, MAX_ROWS};
use crate::topology::{Slot, Topology};

/// `observed` value meaning "no observation"; `n + 1` means `n` observed, so a new cell is
/// unobserved and reading is branch-free.
const UNOBSERVED: u64 = 0;

/// A slot's own counters: 32 bytes, two slots to a cache line (a decision at thousands of rows
/// reads every row's).
#[derive(Debug, Default)]
struct Cell {
    active: AtomicU64,
    prefill: AtomicU64,
    decode: AtomicU64,
    observed: AtomicU64,
}

/// What other replicas booked on a slot (one writer: whoever feeds the shared load). Kept apart
/// from [`Cell`] so that a decision reads these only once any was set.
#[derive(Debug, Default)]
struct SharedCell {
    active: AtomicU64,
    prefill: AtomicU64,
    decode: AtomicU64,
}

impl SharedCell {
    fn load(&self) -> RowLoad {
        RowLoad {
            available: true,
            active_requests: self.active.load(Ordering::Relaxed),
            active_prefill_tokens: self.prefill.load(Ordering::Relaxed),
            decode_blocks: self.decode.load(Ordering::Relaxed),
        }
    }
}

impl Cell {
    /// Each counter is read on its own (Relaxed): a decision reads a near-current load, never
    /// a torn value, and nothing else is ordered by these reads.
    #[inline]
    fn load(&self, shared: &SharedCell) -> RowLoad {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let booked = get(&self.active).saturating_add(get(&shared.active));
        let observed = get(&self.observed).saturating_sub(1);
        RowLoad {
            available: true,
            active_requests: booked.max(observed),
            active_prefill_tokens: get(&self.prefill).saturating_add(get(&shared.prefill)),
            decode_blocks: get(&self.decode).saturating_add(get(&shared.decode)),
        }
    }

    /// [`Cell::load`] of a cell whose observation and shared counters were never set (then
    /// both are 0 and add nothing): three reads instead of seven.
    #[inline]
    fn load_booked_only(&self) -> RowLoad {
        RowLoad {
            available: true,
            active_requests: self.active.load(Ordering::Relaxed),
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
}

/// What one booking adds to its row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Charge {
    pub prefill_tokens: u64,
    pub decode_blocks: u64,
}

crate::spelled_enum! {
    /// How a dispatched request's prompt is booked as KV blocks (`decode_blocks`,
    /// docs/routing-contract.md §7). The core applies it, under the lock that owns the row's slot.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    pub enum DecodeBooking {
        /// Every request books its whole prompt, `ceil(isl_tokens / block_size)` blocks, whatever
        /// the row's other requests share with it (what every host before the mode did).
        #[default]
        Prompt = "prompt",
        /// A row's `decode_blocks` counts each prompt block id held by its in-flight requests
        /// once (a shared system prompt is one copy, as in the engine's cache), plus, per
        /// request, the blocks its ids do not name (the partial last block; all of them for a
        /// request sent without block ids). Dynamo's router books decode load this way.
        Deduplicated = "deduplicated",
    }
}

/// Slots per chunk: 1,024 cells of 32 bytes and 1,024 shared cells of 24, 56 KiB.
const CHUNK_BITS: u32 = 10;
const CHUNK: usize = 1 << CHUNK_BITS;

/// One chunk's slots: [`CHUNK`] cells and as many shared cells, index for index.
#[derive(Debug)]
struct Chunk {
    cells: Box<[Cell]>,
    shared: Box<[SharedCell]>,
}

impl Chunk {
    fn new() -> Chunk {
        Chunk {
            cells: (0..CHUNK).map(|_| Cell::default()).collect(),
            shared: (0..CHUNK).map(|_| SharedCell::default()).collect(),
        }
    }

    /// Cells `start..start + len` and their shared cells, when inside the chunk.
    #[inline]
    fn run(&self, start: usize, len: usize) -> Option<(&[Cell], &[SharedCell])> {
        Some((
            self.cells.get(start..start + len)?,
            self.shared.get(start..start + len)?,
        ))
    }
}

/// Booked (and observed) load per slot.
#[derive(Debug)]
pub struct Ledger {
    /// Chunk `c` holds slots `c * CHUNK ..`; allocated by [`Ledger::ensure`], never freed or
    /// moved while the ledger lives.
    chunks: Box<[OnceLock<Chunk>]>,
    /// Whether any cell was ever given an observation or a non-zero shared load. Until then
    /// every cell's are 0 and [`Ledger::fill`] reads the booked counters alone. Never cleared:
    /// once set, every read is whole.
    extras: AtomicBool,
}

impl Default for Ledger {
    fn default() -> Self {
        Ledger::with_slots(0)
    }
}

// One writer per slot at a time (module docs): a load and a store, no locked instruction.
fn add(counter: &AtomicU64, n: u64) {
    if n != 0 {
        let v = counter.load(Ordering::Relaxed);
        counter.store(v.saturating_add(n), Ordering::Relaxed);
    }
}

fn sub(counter: &AtomicU64, n: u64) {
    if n != 0 {
        let v = counter.load(Ordering::Relaxed);
        counter.store(v.saturating_sub(n), Ordering::Relaxed);
    }
}

impl Ledger {
    /// An idle ledger with cells for slots `0..slots` (and room to grow to [`MAX_ROWS`]).
    pub fn with_slots(slots: usize) -> Ledger {
        let ledger = Ledger {
            chunks: (0..MAX_ROWS.div_ceil(CHUNK))
                .map(|_| OnceLock::new())
                .collect(),
            extras: AtomicBool::new(false),
        };
        ledger.ensure(slots.max(1));
        ledger
    }

    /// Make sure slots `0..slots` have cells (more than [`MAX_ROWS`] are never allocated).
    /// Concurrent bookings and releases go on meanwhile: existing cells never move.
    pub fn ensure(&self, slots: usize) {
        for chunk in self.chunks.iter().take(slots.div_ceil(CHUNK)) {
            chunk.get_or_init(Chunk::new);
        }
    }

    /// Slots this ledger has cells for.
    pub fn slots(&self) -> usize {
        self.chunks.iter().take_while(|c| c.get().is_some()).count() * CHUNK
    }

    #[inline]
    fn chunk(&self, slot: Slot) -> Option<(&Chunk, usize)> {
        let slot = slot as usize;
        let chunk = self.chunks.get(slot >> CHUNK_BITS)?.get()?;
        Some((chunk, slot & (CHUNK - 1)))
    }

    #[inline]
    fn cell(&self, slot: Slot) -> Option<&Cell> {
        self.chunk(slot).and_then(|(chunk, i)| chunk.cells.get(i))
    }

    #[inline]
    fn shared_cell(&self, slot: Slot) -> Option<&SharedCell> {
        self.chunk(slot).and_then(|(chunk, i)| chunk.shared.get(i))
    }

    pub(crate) fn book(&self, slot: Slot, charge: Charge) {
        if let Some(cell) = self.cell(slot) {
            add(&cell.active, 1);
            add(&cell.prefill, charge.prefill_tokens);
            add(&cell.decode, charge.decode_blocks);
        }
    }

    pub(crate) fn release(&self, slot: Slot, charge: Charge) {
        if let Some(cell) = self.cell(slot) {
            sub(&cell.active, 1);
            sub(&cell.prefill, charge.prefill_tokens);
            sub(&cell.decode, charge.decode_blocks);
        }
    }

    /// The booking's prefill finished: only its prompt tokens are released.
    pub(crate) fn release_prefill(&self, slot: Slot, tokens: u64) {
        if let Some(cell) = self.cell(slot) {
            sub(&cell.prefill, tokens);
        }
    }

    /// Record the row's observed active requests (`None` = forget the observation).
    pub fn observe(&self, slot: Slot, active_requests: Option<u64>) {
        if let Some(cell) = self.cell(slot) {
            let value = active_requests.map_or(UNOBSERVED, |n| n.saturating_add(1));
            if value != UNOBSERVED {
                self.extras.store(true, Ordering::Release);
            }
            cell.observed.store(value, Ordering::Release);
        }
    }

    /// Set the load other replicas booked on `slot` (replacing what was set before; `None`:
    /// none). Read by [`Ledger::load`] on top of this replica's bookings, never by
    /// [`Ledger::booked`].
    pub fn set_shared(&self, slot: Slot, load: Option<RowLoad>) {
        if let Some(cell) = self.shared_cell(slot) {
            let load = load.unwrap_or_default();
            if load.active_requests != 0
                || load.active_prefill_tokens != 0
                || load.decode_blocks != 0
            {
                self.extras.store(true, Ordering::Release);
            }
            cell.active.store(load.active_requests, Ordering::Release);
            cell.prefill
                .store(load.active_prefill_tokens, Ordering::Release);
            cell.decode.store(load.decode_blocks, Ordering::Release);
        }
    }

    /// The load other replicas booked on `slot`, as last set.
    pub fn shared(&self, slot: Slot) -> RowLoad {
        self.shared_cell(slot)
            .map_or_else(RowLoad::default, SharedCell::load)
    }

    /// Forget everything about `slot` (its worker was removed).
    pub(crate) fn reset(&self, slot: Slot) {
        if let Some(cell) = self.cell(slot) {
            cell.active.store(0, Ordering::Release);
            cell.prefill.store(0, Ordering::Release);
            cell.decode.store(0, Ordering::Release);
            cell.observed.store(UNOBSERVED, Ordering::Release);
            self.set_shared(slot, None);
        }
    }

    /// The load of `slot` as policies see it (idle for a slot without a cell).
    #[inline]
    pub fn load(&self, slot: Slot) -> RowLoad {
        self.chunk(slot)
            .and_then(|(chunk, i)| chunk.run(i, 1))
            .map_or_else(RowLoad::default, |(cell, shared)| cell[0].load(&shared[0]))
    }

    /// The booked load alone (no observation), for invariant checks.
    pub fn booked(&self, slot: Slot) -> RowLoad {
        self.cell(slot).map_or_else(RowLoad::default, Cell::booked)
    }

    /// The load of every row of `rows` into `out`'s load columns, each as long as `rows` (as
    /// [`Ledger::load`] row by row; idle for rows `topology` does not have). The hot loop of
    /// every decision: one worker lookup per change of worker (a comparison for rows in cluster
    /// order, [`Topology::run_near`]), then a worker's ranks are consecutive slots.
    #[inline]
    pub fn fill(&self, topology: &Topology, rows: &[RowId], out: &mut Columns) {
        // Read once: an observation or shared load set during this fill is seen by the next
        // decision, as one set just after it would be.
        if self.extras.load(Ordering::Acquire) {
            self.fill_with::<true>(topology, rows, out);
        } else {
            self.fill_with::<false>(topology, rows, out);
        }
    }

    /// [`Ledger::fill`], reading each cell whole (`WHOLE`) or its booked counters alone.
    #[inline(always)]
    fn fill_with<const WHOLE: bool>(&self, topology: &Topology, rows: &[RowId], out: &mut Columns) {
        // The rare row outside its run's cells is served out of line (as a zipped loop with
        // the fallback inline it was about 48 instructions a row, `docs/performance.md`, "What
        // the profiles showed").
        let (available, active, prefill, decode) = load_columns(out, rows.len());
        let n = available.len();
        let rows = &rows[..n];
        let mut worker = None;
        let mut run = crate::topology::SlotRun::EMPTY;
        let (mut cells, mut shared): (&[Cell], &[SharedCell]) = (&[], &[]);
        let mut cursor = 0;
        for i in 0..n {
            let row = rows[i];
            if worker != Some(row.worker_id) {
                worker = Some(row.worker_id);
                run = topology.run_near(row.worker_id, &mut cursor);
                (cells, shared) = self.run_cells(run);
            }
            let rank = row.dp_rank.wrapping_sub(run.dp_start) as usize;
            let load = match (cells.get(rank), shared.get(rank)) {
                (Some(cell), Some(shared)) if WHOLE => cell.load(shared),
                (Some(cell), _) if !WHOLE => cell.load_booked_only(),
                _ => self.load_outside(run, row.dp_rank),
            };
            available[i] = load.available;
            active[i] = load.active_requests;
            prefill[i] = load.active_prefill_tokens;
            decode[i] = load.decode_blocks;
        }
    }

    /// [`Ledger::fill`] for `rows` rows that are the slots `base, base + 1, ...` in order (as
    /// many as the shortest load column allows): the cells are read in sequence, chunk by chunk, with no
    /// worker lookup (a slot without a cell reads idle, as [`Ledger::load`] does).
    pub fn fill_run(&self, base: Slot, rows: usize, out: &mut Columns) {
        if self.extras.load(Ordering::Acquire) {
            self.fill_run_with::<true>(base, rows, out);
        } else {
            self.fill_run_with::<false>(base, rows, out);
        }
    }

    #[inline(always)]
    fn fill_run_with<const WHOLE: bool>(&self, base: Slot, rows: usize, out: &mut Columns) {
        let (available, active, prefill, decode) = load_columns(out, rows);
        let n = available.len();
        let mut done = 0;
        while done < n {
            let slot = base as usize + done;
            let start = slot & (CHUNK - 1);
            let in_chunk = (CHUNK - start).min(n - done);
            let cells = self
                .chunks
                .get(slot >> CHUNK_BITS)
                .and_then(OnceLock::get)
                .and_then(|chunk| chunk.run(start, in_chunk));
            let range = done..done + in_chunk;
            let columns = available[range.clone()]
                .iter_mut()
                .zip(&mut active[range.clone()])
                .zip(&mut prefill[range.clone()])
                .zip(&mut decode[range]);
            match cells {
                // Booked counters alone: the shared cells are not touched.
                Some((cells, _)) if !WHOLE => {
                    for (cell, out) in cells.iter().zip(columns) {
                        put(out, cell.load_booked_only());
                    }
                }
                Some((cells, shared)) => {
                    for ((cell, shared), out) in cells.iter().zip(shared).zip(columns) {
                        put(out, cell.load(shared));
                    }
                }
                None => columns.for_each(|out| put(out, RowLoad::default())),
            }
            done += in_chunk;
        }
    }

    /// [`Ledger::fill`]'s way for a row whose cell is not in its run's slice (a run split
    /// across chunks, a rank the worker does not have): out of line, so that the common loop
    /// keeps its pointers in registers.
    #[cold]
    #[inline(never)]
    fn load_outside(&self, run: crate::topology::SlotRun, rank: u32) -> RowLoad {
        run.slot(rank)
            .map_or_else(RowLoad::default, |slot| self.load(slot))
    }

    /// The cells of a worker's run of slots and their shared cells, as slices, when they lie
    /// in one chunk (empty otherwise: the caller then goes slot by slot).
    #[inline]
    fn run_cells(&self, run: crate::topology::SlotRun) -> (&[Cell], &[SharedCell]) {
        let (first, len) = (run.base as usize, run.dp_size as usize);
        let chunk = first >> CHUNK_BITS;
        let start = first & (CHUNK - 1);
        self.chunks
            .get(chunk)
            .and_then(OnceLock::get)
            .and_then(|chunk| chunk.run(start, len))
            .unwrap_or((&[], &[]))
    }
}

/// One row's place in the four load columns, as [`Ledger::fill_run`] zips them.
type LoadOut<'a> = (((&'a mut bool, &'a mut u64), &'a mut u64), &'a mut u64);

#[inline(always)]
fn put((((available, active), prefill), decode): LoadOut<'_>, load: RowLoad) {
    *available = load.available;
    *active = load.active_requests;
    *prefill = load.active_prefill_tokens;
    *decode = load.decode_blocks;
}

/// `out`'s four load columns cut to one length, the shortest of them and `rows`: a fill's loop
/// over them then has no bounds checks.
#[inline(always)]
fn load_columns(
    out: &mut Columns,
    rows: usize,
) -> (&mut [bool], &mut [u64], &mut [u64], &mut [u64]) {
    let Columns {
        available,
        active_requests,
        active_prefill_tokens,
        decode_blocks,
        ..
    } = out;
    let n = rows
        .min(available.len())
        .min(active_requests.len())
        .min(active_prefill_tokens.len())
        .min(decode_blocks.len());
    (
        &mut available[..n],
        &mut active_requests[..n],
        &mut active_prefill_tokens[..n],
        &mut decode_blocks[..n],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Load columns for `n` rows holding what no fill writes (unavailable, 9s), so a row a
    /// fill skipped shows.
    fn unfilled(n: usize) -> Columns {
        Columns {
            available: vec![false; n],
            active_requests: vec![9; n],
            active_prefill_tokens: vec![9; n],
            decode_blocks: vec![9; n],
            ..Columns::default()
        }
    }

    fn c(prefill_tokens: u64, decode_blocks: u64) -> Charge {
        Charge {
            prefill_tokens,
            decode_blocks,
        }
    }

    #[test]
    fn books_releases_saturates_and_corrects_with_observations() {
        let ledger = Ledger::with_slots(8);
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
        ledger.release(3, c(5, 1));
        assert_eq!(ledger.load(3), RowLoad::default(), "never below zero");
        ledger.book(3, c(4, 0));
        assert_eq!(
            ledger.load(3).active_prefill_tokens,
            4,
            "counts on from zero"
        );
    }

    /// `fill` agrees with `load` row by row, on the fast path (a worker's cells in one chunk)
    /// and off it: a run split across two chunks, ranks and workers the topology does not
    /// have, repeated and interleaved rows, and a column shorter than the rows.
    #[test]
    fn fill_matches_load_row_by_row() {
        use crate::model::{Cluster, Worker};
        use crate::topology::SlotAllocator;
        let mut alloc = SlotAllocator::default();
        // Worker 1 takes slots 0..1020, worker 2 slots 1020..1028 (across the chunk edge).
        let cluster = Cluster::new(vec![
            Worker::new(1).with_ranks(0, 1020),
            Worker::new(2).with_ranks(3, 8),
        ])
        .unwrap();
        let topology = alloc.initial(cluster);
        assert_eq!(topology.run_of(2).base, 1020);
        let ledger = Ledger::with_slots(2048);
        for (slot, n) in [
            (0, 1),
            (5, 2),
            (1019, 3),
            (1022, 4),
            (1023, 5),
            (1024, 6),
            (1027, 7),
        ] {
            ledger.book(slot, c(10 * n, n));
        }
        ledger.observe(1024, Some(40));
        let row = |worker_id, dp_rank| RowId { worker_id, dp_rank };
        let rows = [
            row(1, 0),
            row(1, 5),
            row(2, 4),
            row(2, 5),
            row(2, 6),
            row(2, 7),
            row(2, 2),
            row(9, 0),
            row(1, 1019),
            row(2, 10),
            row(2, 11),
            row(1, 1020),
            row(2, 5),
        ];
        let expected: Vec<RowLoad> = rows
            .iter()
            .map(|&r| {
                topology
                    .slot(r)
                    .map_or_else(RowLoad::default, |s| ledger.load(s))
            })
            .collect();
        assert_eq!(expected[5].active_requests, 40, "the observation is read");
        let n = rows.len();
        let mut out = unfilled(n);
        ledger.fill(&topology, &rows, &mut out);
        for (i, load) in expected.iter().enumerate() {
            let got = RowLoad {
                available: out.available[i],
                active_requests: out.active_requests[i],
                active_prefill_tokens: out.active_prefill_tokens[i],
                decode_blocks: out.decode_blocks[i],
            };
            assert_eq!(got, *load, "row {i} ({:?})", rows[i]);
        }
        out.active_prefill_tokens = vec![9; 3];
        ledger.fill(&topology, &rows, &mut out);
        let short = out.active_prefill_tokens;
        let first: Vec<u64> = expected[..3]
            .iter()
            .map(|l| l.active_prefill_tokens)
            .collect();
        assert_eq!(first, vec![10, 20, 0]);
        assert_eq!(short, first, "fills as many rows as the shortest column");
    }

    /// `fill_run` agrees with `load` slot by slot: within a chunk, across a chunk edge, into
    /// slots without cells, with the booked counters alone and whole, and for fewer rows than
    /// the columns hold.
    #[test]
    fn fill_run_matches_load_slot_by_slot() {
        let ledger = Ledger::with_slots(2048);
        for (slot, n) in [(0, 1), (1019, 3), (1023, 5), (1024, 6), (2047, 7)] {
            ledger.book(slot, c(10 * n, n));
        }
        let run = |ledger: &Ledger, base: u32, rows: usize, len: usize| {
            let mut out = Columns {
                available: vec![false; len],
                active_requests: vec![9; len],
                active_prefill_tokens: vec![9; len],
                decode_blocks: vec![9; len],
                ..Columns::default()
            };
            ledger.fill_run(base, rows, &mut out);
            (0..len)
                .map(|i| RowLoad {
                    available: out.available[i],
                    active_requests: out.active_requests[i],
                    active_prefill_tokens: out.active_prefill_tokens[i],
                    decode_blocks: out.decode_blocks[i],
                })
                .collect::<Vec<_>>()
        };
        let check = |ledger: &Ledger, step: &str| {
            for (base, rows) in [(0, 8), (1016, 16), (1019, 1), (2040, 20), (3000, 4)] {
                let got = run(ledger, base, rows, rows);
                for (i, load) in got.iter().enumerate() {
                    assert_eq!(
                        *load,
                        ledger.load(base + i as u32),
                        "{step}: slot {base} + {i}"
                    );
                }
            }
            // Fewer rows than the columns: the rest is left as it was.
            let got = run(ledger, 1022, 3, 5);
            assert_eq!(
                got[..3],
                [1022, 1023, 1024].map(|s| ledger.load(s)),
                "{step}"
            );
            assert_eq!((got[3].active_requests, got[4].decode_blocks), (9, 9));
        };
        check(&ledger, "booked");
        ledger.observe(1023, Some(40));
        ledger.set_shared(
            1024,
            Some(RowLoad {
                available: true,
                active_requests: 2,
                active_prefill_tokens: 5,
                decode_blocks: 1,
            }),
        );
        check(&ledger, "whole");
        assert_eq!(run(&ledger, 1023, 2, 2)[0].active_requests, 40);
        assert_eq!(run(&ledger, 1023, 2, 2)[1].active_requests, 3);
    }

    /// `fill` reads the booked counters alone until a cell gets an observation or a shared
    /// load, and every counter from then on: it agrees with `load` before, after and once they
    /// are withdrawn.
    #[test]
    fn fill_follows_observations_and_shared_load_from_the_first_one() {
        use crate::model::{Cluster, Worker};
        use crate::topology::SlotAllocator;
        let topology = SlotAllocator::default()
            .initial(Cluster::new(vec![Worker::new(1).with_ranks(0, 4), Worker::new(2)]).unwrap());
        let ledger = Ledger::with_slots(8);
        let rows: Vec<RowId> = topology.rows().map(|(r, _)| r).collect();
        let check = |ledger: &Ledger, step: &str| -> Vec<u64> {
            let n = rows.len();
            let mut out = unfilled(n);
            ledger.fill(&topology, &rows, &mut out);
            for (i, &r) in rows.iter().enumerate() {
                let load = ledger.load(topology.slot(r).unwrap());
                let got = RowLoad {
                    available: out.available[i],
                    active_requests: out.active_requests[i],
                    active_prefill_tokens: out.active_prefill_tokens[i],
                    decode_blocks: out.decode_blocks[i],
                };
                assert_eq!(got, load, "{step}: row {r:?}");
            }
            out.active_requests
        };
        ledger.book(1, c(100, 3));
        ledger.book(4, c(10, 1));
        assert_eq!(check(&ledger, "booked"), [0, 1, 0, 0, 1]);
        // An idle shared load changes nothing.
        ledger.set_shared(2, None);
        ledger.set_shared(2, Some(RowLoad::default()));
        ledger.observe(3, None);
        assert!(!ledger.extras.load(Ordering::Relaxed));
        ledger.observe(0, Some(7));
        assert_eq!(check(&ledger, "observed"), [7, 1, 0, 0, 1]);
        let shared = RowLoad {
            available: true,
            active_requests: 2,
            active_prefill_tokens: 50,
            decode_blocks: 4,
        };
        ledger.set_shared(4, Some(shared));
        assert_eq!(check(&ledger, "shared"), [7, 1, 0, 0, 3]);
        ledger.observe(0, None);
        ledger.set_shared(4, None);
        assert_eq!(check(&ledger, "withdrawn"), [0, 1, 0, 0, 1]);
        // The shared load alone turns the whole read on too.
        let ledger = Ledger::with_slots(8);
        ledger.set_shared(1, Some(shared));
        assert_eq!(check(&ledger, "shared first"), [0, 2, 0, 0, 0]);
    }

    /// Other replicas' load adds to this one's bookings in every read (the columns too), the
    /// observation still corrects the sum, and neither `booked` nor a release touches it.
    #[test]
    fn shared_load_adds_to_bookings_and_is_never_published_back() {
        let ledger = Ledger::with_slots(8);
        ledger.book(2, c(100, 3));
        let others = RowLoad {
            available: true,
            active_requests: 4,
            active_prefill_tokens: 1000,
            decode_blocks: 7,
        };
        ledger.set_shared(2, Some(others));
        let load = ledger.load(2);
        assert_eq!(
            (
                load.active_requests,
                load.active_prefill_tokens,
                load.decode_blocks
            ),
            (5, 1100, 10)
        );
        assert_eq!(ledger.booked(2).active_requests, 1, "booked stays local");
        assert_eq!(ledger.shared(2), others);
        ledger.observe(2, Some(9));
        assert_eq!(ledger.load(2).active_requests, 9, "the engine's count wins");
        ledger.observe(2, Some(2));
        assert_eq!(ledger.load(2).active_requests, 5, "booked + shared wins");
        ledger.release(2, c(100, 3));
        assert_eq!(
            ledger.load(2).active_prefill_tokens,
            1000,
            "only ours released"
        );
        ledger.set_shared(
            2,
            Some(RowLoad {
                active_requests: u64::MAX,
                ..others
            }),
        );
        ledger.book(2, c(0, 0));
        assert_eq!(ledger.load(2).active_requests, u64::MAX, "saturates");
        ledger.set_shared(2, None);
        ledger.observe(2, None);
        assert_eq!(ledger.load(2).active_requests, 1);
        ledger.set_shared(2, Some(others));
        ledger.reset(2);
        assert_eq!(ledger.load(2), RowLoad::default());
        assert_eq!(
            ledger.shared(2).decode_blocks,
            0,
            "a removed row forgets it"
        );
    }

    #[test]
    fn grows_in_place_and_ignores_slots_without_cells() {
        let ledger = Ledger::with_slots(8);
        assert_eq!(ledger.slots(), CHUNK);
        ledger.book(7, c(5, 1));
        ledger.book(2000, c(1, 1));
        assert_eq!(ledger.load(2000), RowLoad::default(), "no cell yet: idle");
        ledger.ensure(2048);
        assert_eq!(ledger.slots(), 2048);
        assert_eq!(
            ledger.load(7).active_prefill_tokens,
            5,
            "growth keeps every value"
        );
        ledger.book(2000, c(1, 1));
        assert_eq!(ledger.load(2000).active_requests, 1);
        ledger.reset(2000);
        assert_eq!(ledger.load(2000), RowLoad::default());
        ledger.book(u32::MAX, c(1, 1));
        assert_eq!(ledger.load(u32::MAX), RowLoad::default());
    }
}
