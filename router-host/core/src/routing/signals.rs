//! The one snapshot of per-row signals that admission and selection both read.

use std::cell::{Cell, RefCell};
use std::sync::PoisonError;

use crossbeam_utils::sync::ShardedLock;

use crate::kv_index::trust::RowTrust;
use crate::kv_index::KvIndex;
use crate::ledger::Ledger;
use plugin_api::Columns;

use crate::recency::Recency;
use crate::sessions::Clock;

use crate::model::{
    load_columns_by_row, Fill, OverlapSource, RowId, RowLoad, Signals, TierOverlap,
};
use crate::topology::{run_base, Topology};

/// Load from the ledger (by the snapshot's slots) unless the source overrides it; overlap from
/// the source.
pub(super) struct CoreSignals<'a, O: ?Sized> {
    pub source: &'a O,
    pub topology: &'a Topology,
    pub ledger: &'a Ledger,
    /// The recent-use tracker and the clock it reads, when the core keeps one.
    pub recency: Option<(&'a Recency, &'a dyn Clock)>,
}

impl<O: OverlapSource + ?Sized> OverlapSource for CoreSignals<'_, O> {
    fn overlap(&self, row: RowId) -> TierOverlap {
        self.source.overlap(row)
    }

    fn overlap_columns(&self, rows: &[RowId], out: &mut Columns) -> Fill {
        self.source.overlap_columns(rows, out)
    }

    fn kv_indexed_columns(&self, rows: &[RowId], out: &mut [Vec<f64>; 3]) -> Fill {
        self.source.kv_indexed_columns(rows, out)
    }

    fn kv_index_state_column(&self, rows: &[RowId], out: &mut Vec<f64>) -> Fill {
        self.source.kv_index_state_column(rows, out)
    }

    fn kv_index_state(&self, row: RowId) -> plugin_api::KvIndexState {
        self.source.kv_index_state(row)
    }

    fn columns_begin(&self, rows: &[RowId]) {
        self.source.columns_begin(rows);
    }

    fn columns_end(&self) {
        self.source.columns_end();
    }

    fn slot_run(&self, rows: &[RowId], topology: &Topology) -> Option<u32> {
        self.source.slot_run(rows, topology)
    }
}

impl<O: OverlapSource + ?Sized> Signals for CoreSignals<'_, O> {
    fn load(&self, row: RowId) -> RowLoad {
        self.source.load_override(row).unwrap_or_else(|| {
            self.topology
                .slot(row)
                .map_or_else(RowLoad::default, |s| self.ledger.load(s))
        })
    }

    fn load_columns(&self, rows: &[RowId], out: &mut Columns) {
        if self.source.overrides_load() {
            load_columns_by_row(rows, out, |row| self.load(row));
            return;
        }
        // Rows that are a run of slots (every row eligible, in slot order) read the ledger's
        // cells in order, without a worker lookup per row.
        match self.source.slot_run(rows, self.topology) {
            Some(base) => self.ledger.fill_run(base, rows.len(), out),
            None => self.ledger.fill(self.topology, rows, out),
        }
    }

    fn kv_capacity_column(&self, rows: &[RowId], out: &mut Vec<f64>) {
        out.clear();
        if self.topology.knows_kv_capacity() {
            out.resize(rows.len(), f64::NAN);
            self.topology.kv_capacity_column(rows, out);
        }
    }

    fn kv_recent_column(&self, rows: &[RowId], out: &mut Vec<f64>) {
        match self.recency {
            Some((recency, clock)) => recency.column(rows, clock.now(), out),
            None => out.clear(),
        }
    }
}

/// Reusable buffers for one request's walk of the KV index: per slot, blocks reusable from
/// each tier ([`KvIndex::overlaps_by_tier`]; `host` and `disk` stay empty, read as zeros,
/// while no engine reported an offload tier).
#[derive(Debug, Default)]
pub struct OverlapBuffers {
    pub held: Vec<u32>,
    pub host: Vec<u32>,
    pub disk: Vec<u32>,
    pub alive: Vec<u64>,
    /// The slot of each row handed to the policy ([`NO_SLOT`] for a row not registered),
    /// resolved once per decision for every column filled from a slot-indexed table.
    slots: Vec<u32>,
    /// `Some(base)` when `slots` is exactly `base, base + 1, ...` (every row registered, in slot
    /// order, as when every row is eligible): a column is then a copy of a slice of its table.
    slots_run: Option<u32>,
}

/// In [`OverlapBuffers`]' slot column: a row the topology does not know.
const NO_SLOT: u32 = u32::MAX;

/// A request's overlap from the core's KV index, walked on first use (a policy that does not
/// read the CACHE columns never pays for it): `held[slot]` leading blocks of the prompt are on
/// the device of the row in `slot`, `host[slot]` and `disk[slot]` more behind them on its
/// offload tiers.
pub struct IndexOverlap<'a> {
    topology: &'a Topology,
    kv: &'a ShardedLock<KvIndex>,
    blocks: &'a [u64],
    buffers: RefCell<&'a mut OverlapBuffers>,
    walked: Cell<bool>,
    /// The rows (address and length) announced by `columns_begin`, until `columns_end`. The
    /// caller keeps those rows borrowed and unchanged in between, so the address and length
    /// name their content; outside that window every fill resolves its own rows.
    announced: Cell<Option<(usize, usize)>>,
    /// Whether `buffers.slots` holds the announced rows' slots (resolved on the first fill that
    /// needs them, so that a policy reading no slot-indexed column never pays for it).
    slots_resolved: Cell<bool>,
    /// Each slot's index state, when the core keeps them (`kv_index_state`).
    trust: Option<&'a RowTrust>,
    /// Whether no slot's state was other than current when the decision started.
    all_current: bool,
}

/// How many slots' index states are not current, kept by every change of one: while none is,
/// the `kv_index_state` column is all zeros and a decision writes it without reading every
/// slot. Signed: two feeders' updates may land in either order, so it can dip below zero for a
/// moment; below or at zero reads as none.
#[derive(Debug, Default)]
pub(super) struct NotCurrent(std::sync::atomic::AtomicI64);

impl NotCurrent {
    /// A slot's state went from `before` to `after`.
    pub(super) fn changed(
        &self,
        before: plugin_api::KvIndexState,
        after: plugin_api::KvIndexState,
    ) {
        use std::sync::atomic::Ordering::Relaxed;
        match (before.is_current(), after.is_current()) {
            (true, false) => self.0.fetch_add(1, Relaxed),
            (false, true) => self.0.fetch_sub(1, Relaxed),
            _ => 0,
        };
    }

    /// Whether every slot is current.
    pub(super) fn none(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed) <= 0
    }
}

impl<'a> IndexOverlap<'a> {
    pub fn new(
        topology: &'a Topology,
        kv: &'a ShardedLock<KvIndex>,
        blocks: &'a [u64],
        buffers: &'a mut OverlapBuffers,
    ) -> Self {
        IndexOverlap {
            topology,
            kv,
            blocks,
            buffers: RefCell::new(buffers),
            walked: Cell::new(false),
            announced: Cell::new(None),
            slots_resolved: Cell::new(false),
            trust: None,
            all_current: false,
        }
    }

    /// Send each row's index state from `trust` with the overlap.
    pub fn with_trust(mut self, trust: &'a RowTrust) -> Self {
        self.trust = Some(trust);
        self
    }

    /// Whether every slot of `trust` is known to be current (the column is then written as
    /// zeros without reading the slots).
    pub fn all_current(mut self, all_current: bool) -> Self {
        self.all_current = all_current;
        self
    }

    /// Run `f` over the walked counts, walking the index first if nobody did yet.
    fn with_walk<R>(&self, f: impl FnOnce(&OverlapBuffers) -> R) -> R {
        let mut buffers = self.buffers.borrow_mut();
        if !self.walked.replace(true) {
            let OverlapBuffers {
                held,
                host,
                disk,
                alive,
                ..
            } = &mut **buffers;
            if self.blocks.is_empty() {
                held.clear();
                host.clear();
                disk.clear();
            } else {
                let kv = self.kv.read().unwrap_or_else(PoisonError::into_inner);
                kv.overlaps_by_tier(self.blocks, held, host, disk, alive);
            }
        }
        f(&buffers)
    }

    /// Run `f` over the walk's buffers with `rows`' slots resolved (walking the index first if
    /// `walk`). The columns of one decision are all filled for the same rows (announced with
    /// `columns_begin`): their slots are looked up once, not once per column.
    fn with_slots<R>(&self, rows: &[RowId], walk: bool, f: impl FnOnce(&OverlapBuffers) -> R) -> R {
        if walk {
            self.with_walk(|_| ());
        }
        let mut buffers = self.buffers.borrow_mut();
        let announced = self.announced.get() == Some(key(rows));
        if !(announced && self.slots_resolved.get()) {
            resolve_slots(self.topology, rows, &mut buffers);
            self.slots_resolved.set(announced);
        }
        f(&buffers)
    }
}

fn key(rows: &[RowId]) -> (usize, usize) {
    (rows.as_ptr() as usize, rows.len())
}

/// `buffers.slots` (and `slots_run`) for `rows`: the snapshot's own when `rows` are the whole
/// fleet, else looked up row by row.
fn resolve_slots(topology: &Topology, rows: &[RowId], buffers: &mut OverlapBuffers) {
    let slots = &mut buffers.slots;
    slots.clear();
    if let Some((fleet, run)) = topology.fleet_slots(rows) {
        slots.extend_from_slice(fleet);
        buffers.slots_run = run;
        return;
    }
    slots.extend(topology.slots(rows).map(|slot| slot.unwrap_or(NO_SLOT)));
    buffers.slots_run = run_base(slots);
}

/// The slice `run` of a slot-indexed table, when the slots are a run and the table covers it.
fn run_of<T>(table: &[T], run: Option<u32>, len: usize) -> Option<&[T]> {
    let base = run? as usize;
    table.get(base..base.checked_add(len)?)
}

/// `out[i] = counts[slots[i]]` (0 past `counts`, and for a row without a slot).
fn gather(counts: &[u32], b: &OverlapBuffers, out: &mut [f64]) {
    if let Some(counts) = run_of(counts, b.slots_run, out.len()) {
        for (out, &count) in out.iter_mut().zip(counts) {
            *out = f64::from(count);
        }
        return;
    }
    for (out, &slot) in out.iter_mut().zip(&b.slots) {
        *out = f64::from(counts.get(slot as usize).copied().unwrap_or(0));
    }
}

/// `out = column[slots[i]]` for every row, as long as the slots (0 past `column`, and for a
/// row without a slot); a copy when the slots are a run.
fn gather_f64(column: &[f64], b: &OverlapBuffers, out: &mut Vec<f64>) {
    out.clear();
    match run_of(column, b.slots_run, b.slots.len()) {
        Some(run) => out.extend_from_slice(run),
        None => out.extend(
            b.slots
                .iter()
                .map(|&slot| column.get(slot as usize).copied().unwrap_or(0.0)),
        ),
    }
}

fn blocks_in(counts: &[u32], slot: Option<u32>) -> f64 {
    f64::from(
        slot.and_then(|s| counts.get(s as usize))
            .copied()
            .unwrap_or(0),
    )
}

impl OverlapSource for IndexOverlap<'_> {
    fn overlap(&self, row: RowId) -> TierOverlap {
        let slot = self.topology.slot(row);
        self.with_walk(|b| TierOverlap {
            device: blocks_in(&b.held, slot),
            host: blocks_in(&b.host, slot),
            disk: blocks_in(&b.disk, slot),
        })
    }

    fn overlap_columns(&self, rows: &[RowId], out: &mut Columns) -> Fill {
        let Columns {
            device, host, disk, ..
        } = out;
        self.with_slots(rows, true, |b| {
            gather(&b.held, b, device);
            if b.host.is_empty() && b.disk.is_empty() {
                return Fill::Zeros;
            }
            gather(&b.host, b, host);
            gather(&b.disk, b, disk);
            Fill::Written
        })
    }

    /// Copies of the index's own `f64` counts ([`KvIndex::held_columns`]), kept as events
    /// arrive: a copy of a slice when the rows are a run of slots, a gather otherwise. A row the
    /// topology does not know holds nothing the index could count.
    fn kv_indexed_columns(&self, rows: &[RowId], out: &mut [Vec<f64>; 3]) -> Fill {
        let kv = self.kv.read().unwrap_or_else(PoisonError::into_inner);
        let tiers = if kv.holds_offload() { 3 } else { 1 };
        self.with_slots(rows, false, |b| {
            for (column, out) in kv
                .held_columns()
                .into_iter()
                .zip(out.iter_mut())
                .take(tiers)
            {
                gather_f64(column, b, out);
            }
        });
        if tiers == 3 {
            Fill::Written
        } else {
            Fill::Zeros
        }
    }

    fn columns_begin(&self, rows: &[RowId]) {
        self.announced.set(Some(key(rows)));
        self.slots_resolved.set(false);
    }

    fn columns_end(&self) {
        self.announced.set(None);
        self.slots_resolved.set(false);
    }

    fn slot_run(&self, rows: &[RowId], topology: &Topology) -> Option<u32> {
        if !std::ptr::eq(self.topology, topology) || self.announced.get() != Some(key(rows)) {
            return None;
        }
        self.with_slots(rows, false, |b| b.slots_run)
    }

    fn kv_index_state_column(&self, rows: &[RowId], out: &mut Vec<f64>) -> Fill {
        let Some(trust) = self.trust else {
            out.clear();
            return Fill::Written;
        };
        if self.all_current {
            return Fill::Zeros;
        }
        out.clear();
        // A row the topology does not know holds nothing: current.
        self.with_slots(rows, false, |b| {
            out.extend(b.slots.iter().map(|&slot| {
                if slot == NO_SLOT {
                    0.0
                } else {
                    trust.get(slot).code()
                }
            }));
        });
        Fill::Written
    }

    fn kv_index_state(&self, row: RowId) -> plugin_api::KvIndexState {
        match (self.trust, self.topology.slot(row)) {
            (Some(trust), Some(slot)) => trust.get(slot),
            _ => plugin_api::KvIndexState::Current,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_index::{KvEvent, KvEventKind, Tier};
    use crate::model::{Cluster, Worker};
    use crate::topology::SlotAllocator;
    use plugin_api::KvIndexState;

    fn row(worker_id: u64, dp_rank: u32) -> RowId {
        RowId { worker_id, dp_rank }
    }

    /// Blocks of the prompt [`staircase`]'s slots cache.
    const STAIRCASE_PROMPT: [u64; 5] = [11, 12, 13, 14, 15];

    /// Workers 3 (ranks 0 and 1), 7 (rank 0) and 9 (ranks 0 and 1), in slots 0 to 4.
    fn five_rows() -> Topology {
        let cluster = Cluster::new(vec![
            Worker::new(3).with_ranks(0, 2),
            Worker::new(7).with_ranks(0, 1),
            Worker::new(9).with_ranks(0, 2),
        ])
        .unwrap();
        SlotAllocator::default().initial(cluster)
    }

    /// [`five_rows`], slot s caching the first
    /// s + 1 blocks of [`STAIRCASE_PROMPT`] on the device (so every row's overlap differs), and
    /// every row's index current.
    fn staircase() -> (Topology, ShardedLock<KvIndex>, RowTrust) {
        let topology = five_rows();
        let mut index = KvIndex::new(topology.slot_bound());
        for slot in 0..topology.slot_bound() as u32 {
            for &block in &STAIRCASE_PROMPT[..=slot as usize] {
                index.apply(&KvEvent::on_device(slot, KvEventKind::Stored, block));
            }
        }
        let trust = RowTrust::with_slots(topology.slot_bound());
        (topology, ShardedLock::new(index), trust)
    }

    /// Columns a fill left unwritten ([`Fill::Zeros`]), written out as the zeros the caller
    /// lends in their place.
    fn lend(fill: Fill, n: usize, columns: &mut [&mut Vec<f64>]) {
        if fill == Fill::Zeros {
            for column in columns {
                column.clear();
                column.resize(n, 0.0);
            }
        }
    }

    /// The columns of one row set from one `IndexOverlap`, against its per-row answers.
    fn check(source: &IndexOverlap<'_>, rows: &[RowId]) {
        let n = rows.len();
        let mut columns = Columns::default();
        columns.device.resize(n, f64::NAN);
        columns.host.resize(n, f64::NAN);
        columns.disk.resize(n, f64::NAN);
        let fill = source.overlap_columns(rows, &mut columns);
        lend(fill, n, &mut [&mut columns.host, &mut columns.disk]);
        let mut states = vec![f64::NAN; n];
        let fill = source.kv_index_state_column(rows, &mut states);
        lend(fill, n, &mut [&mut states]);
        let mut indexed: [Vec<f64>; 3] = Default::default();
        let fill = source.kv_indexed_columns(rows, &mut indexed);
        let [_, host, disk] = &mut indexed;
        lend(fill, n, &mut [host, disk]);
        let kv = source.kv.read().unwrap_or_else(PoisonError::into_inner);
        for (i, &r) in rows.iter().enumerate() {
            let one = source.overlap(r);
            assert_eq!(
                (columns.device[i], columns.host[i], columns.disk[i]),
                (one.device, one.host, one.disk),
                "overlap of {r:?}"
            );
            assert_eq!(states[i], source.kv_index_state(r).code(), "state of {r:?}");
            let held = source
                .topology
                .slot(r)
                .map_or([0; 3], |slot| kv.held_by_tier(slot));
            let held = held.map(|h| h as f64);
            assert_eq!(
                [indexed[0][i], indexed[1][i], indexed[2][i]],
                held,
                "indexed blocks of {r:?}"
            );
        }
    }

    #[test]
    fn the_count_of_slots_not_current_follows_every_change() {
        use KvIndexState::{Current, Lagging, Stale, Unknown};
        let count = NotCurrent::default();
        assert!(count.none());
        count.changed(Current, Stale);
        count.changed(Current, Unknown);
        assert!(!count.none());
        count.changed(Stale, Lagging);
        count.changed(Current, Current);
        count.changed(Lagging, Current);
        assert!(!count.none(), "one slot is still unknown");
        count.changed(Unknown, Current);
        assert!(count.none());
        // Two feeders' updates landing out of order: the dip reads as none, and it settles.
        count.changed(Stale, Current);
        assert!(count.none());
        count.changed(Current, Stale);
        assert!(count.none());
        count.changed(Current, Stale);
        assert!(!count.none());
    }

    #[test]
    fn columns_follow_the_rows_asked_for_whatever_their_order_and_set() {
        let (topology, kv, trust) = staircase();
        let prompt = STAIRCASE_PROMPT;
        let slot = topology.slot(row(9, 0)).unwrap();
        trust.set(slot, KvIndexState::Lagging);
        let mut buffers = OverlapBuffers::default();
        let source = IndexOverlap::new(&topology, &kv, &prompt, &mut buffers).with_trust(&trust);
        let all = [row(3, 0), row(3, 1), row(7, 0), row(9, 0), row(9, 1)];
        check(&source, &all);
        // The same decision asks for other rows: a narrowed set, another order, a row the
        // topology does not know, a set as long as the first.
        check(&source, &all[1..3]);
        check(&source, &[row(9, 1), row(3, 0), row(8, 0), row(3, 1)]);
        check(
            &source,
            &[row(9, 1), row(9, 0), row(7, 0), row(3, 1), row(3, 0)],
        );
        check(&source, &all);
        // Every row's columns really differ, so a stale slot would have shown.
        let mut columns = Columns::default();
        columns.device.resize(all.len(), 0.0);
        columns.host.resize(all.len(), 0.0);
        columns.disk.resize(all.len(), 0.0);
        let _offload_all_zero = source.overlap_columns(&all, &mut columns);
        assert_eq!(columns.device, [1.0, 2.0, 3.0, 4.0, 5.0]);
    }

    /// Two row sets with the same address, length, first and last row: the slots resolved for
    /// the first must not answer for the second, announced or not.
    #[test]
    fn slots_are_never_reused_for_other_rows_in_the_same_buffer() {
        let (topology, kv, trust) = staircase();
        let prompt = STAIRCASE_PROMPT;
        let mut buffers = OverlapBuffers::default();
        let source = IndexOverlap::new(&topology, &kv, &prompt, &mut buffers).with_trust(&trust);
        let mut rows = vec![row(3, 0), row(3, 1), row(7, 0), row(9, 1)];
        let device = |source: &IndexOverlap<'_>, rows: &[RowId]| {
            let mut columns = Columns::default();
            columns.device.resize(rows.len(), f64::NAN);
            columns.host.resize(rows.len(), f64::NAN);
            columns.disk.resize(rows.len(), f64::NAN);
            assert_eq!(source.overlap_columns(rows, &mut columns), Fill::Zeros);
            let mut indexed: [Vec<f64>; 3] = Default::default();
            assert_eq!(source.kv_indexed_columns(rows, &mut indexed), Fill::Zeros);
            assert_eq!(
                columns.device, indexed[0],
                "the walk and the index agree here"
            );
            columns.device
        };
        // Unannounced: every fill resolves its own rows.
        assert_eq!(device(&source, &rows), [1.0, 2.0, 3.0, 5.0]);
        rows[1] = row(9, 0);
        rows[2] = row(3, 1);
        assert_eq!(device(&source, &rows), [1.0, 4.0, 2.0, 5.0]);
        // Announced: one resolution serves the window, and the next window resolves again.
        source.columns_begin(&rows);
        assert_eq!(device(&source, &rows), [1.0, 4.0, 2.0, 5.0]);
        // Another slice inside the window gets its own answer.
        assert_eq!(device(&source, &rows[1..3]), [4.0, 2.0]);
        assert_eq!(device(&source, &rows), [1.0, 4.0, 2.0, 5.0]);
        source.columns_end();
        rows[1] = row(7, 0);
        rows[2] = row(9, 0);
        assert_eq!(device(&source, &rows), [1.0, 3.0, 4.0, 5.0]);
        source.columns_begin(&rows);
        assert_eq!(device(&source, &rows), [1.0, 3.0, 4.0, 5.0]);
        source.columns_end();
        rows[1] = row(3, 1);
        source.columns_begin(&rows);
        assert_eq!(device(&source, &rows), [1.0, 2.0, 4.0, 5.0]);
        source.columns_end();
    }

    /// Announced rows that are a run of slots read the ledger as a run; other rows, and rows
    /// not announced, by worker. Both give every row its own load.
    #[test]
    fn load_columns_read_a_run_of_slots_as_one() {
        let topology = five_rows();
        let kv = ShardedLock::new(KvIndex::new(topology.slot_bound()));
        let ledger = Ledger::with_slots(topology.slot_bound());
        for (r, slot) in topology.rows() {
            for _ in 0..=slot {
                ledger.book(
                    slot,
                    crate::ledger::Charge {
                        prefill_tokens: 100,
                        decode_blocks: u64::from(r.dp_rank),
                    },
                );
            }
        }
        let mut buffers = OverlapBuffers::default();
        let source = IndexOverlap::new(&topology, &kv, &[], &mut buffers);
        let signals = CoreSignals {
            source: &source,
            topology: &topology,
            ledger: &ledger,
            recency: None,
        };
        let load = |rows: &[RowId]| {
            let n = rows.len();
            let mut out = Columns {
                available: vec![false; n],
                active_requests: vec![0; n],
                active_prefill_tokens: vec![0; n],
                decode_blocks: vec![0; n],
                ..Columns::default()
            };
            signals.load_columns(rows, &mut out);
            for (i, &r) in rows.iter().enumerate() {
                assert_eq!(
                    out.active_requests[i],
                    signals.load(r).active_requests,
                    "{r:?}"
                );
                assert_eq!(out.decode_blocks[i], signals.load(r).decode_blocks, "{r:?}");
            }
            out.active_requests
        };
        let all: Vec<RowId> = topology.rows().map(|(r, _)| r).collect();
        assert_eq!(source.slot_run(&all, &topology), None, "not announced");
        assert_eq!(load(&all), [1, 2, 3, 4, 5]);
        source.columns_begin(&all);
        assert_eq!(source.slot_run(&all, &topology), Some(0));
        assert_eq!(source.slot_run(&all[1..], &topology), None, "other rows");
        let other = topology.clone();
        assert_eq!(source.slot_run(&all, &other), None, "another topology");
        assert_eq!(load(&all), [1, 2, 3, 4, 5]);
        source.columns_end();
        let scattered = [row(9, 1), row(3, 0), row(8, 0), row(7, 0)];
        source.columns_begin(&scattered);
        assert_eq!(source.slot_run(&scattered, &topology), None);
        assert_eq!(load(&scattered), [5, 1, 0, 3]);
        source.columns_end();
        let tail = &all[2..];
        source.columns_begin(tail);
        assert_eq!(source.slot_run(tail, &topology), Some(2));
        assert_eq!(load(tail), [3, 4, 5]);
        source.columns_end();
    }

    /// The indexed-blocks columns follow the index: stores, evictions, a cleared row, a row
    /// added, on every tier; read as a run of slots and as a gather.
    #[test]
    fn indexed_columns_follow_the_index() {
        let cluster = Cluster::new(vec![
            Worker::new(1).with_ranks(0, 2),
            Worker::new(2).with_ranks(0, 1),
        ])
        .unwrap();
        let topology = SlotAllocator::default().initial(cluster);
        let kv = ShardedLock::new(KvIndex::new(topology.slot_bound()));
        let all = [row(1, 0), row(1, 1), row(2, 0)];
        let scattered = [row(2, 0), row(5, 0), row(1, 0)];
        let columns = |rows: &[RowId]| {
            let mut buffers = OverlapBuffers::default();
            let source = IndexOverlap::new(&topology, &kv, &[], &mut buffers);
            let mut out: [Vec<f64>; 3] = Default::default();
            source.columns_begin(rows);
            let fill = source.kv_indexed_columns(rows, &mut out);
            source.columns_end();
            let [_, host, disk] = &mut out;
            lend(fill, rows.len(), &mut [host, disk]);
            (fill, out)
        };
        let apply = |slot: u32, kind: KvEventKind, block: u64, tier: Tier| {
            kv.write().unwrap().apply(&KvEvent {
                row: slot,
                kind,
                block,
                tier,
            });
        };
        assert_eq!(
            columns(&all),
            (Fill::Zeros, [vec![0.0; 3], vec![0.0; 3], vec![0.0; 3]])
        );
        let s = |r| topology.slot(r).unwrap();
        for block in 0..4 {
            apply(s(row(1, 1)), KvEventKind::Stored, block, Tier::Device);
        }
        // Nothing off the device yet: the offload columns are lent, not written.
        assert_eq!(columns(&all).0, Fill::Zeros);
        let columns = |rows: &[RowId]| {
            let (fill, out) = columns(rows);
            assert_eq!(fill, Fill::Written, "a row reported a block off the device");
            out
        };
        apply(s(row(2, 0)), KvEventKind::Stored, 9, Tier::Device);
        apply(s(row(2, 0)), KvEventKind::Stored, 9, Tier::Host);
        apply(s(row(1, 0)), KvEventKind::Stored, 7, Tier::Disk);
        apply(s(row(1, 1)), KvEventKind::Evicted, 2, Tier::Device);
        assert_eq!(
            columns(&all),
            [
                vec![0.0, 3.0, 1.0],
                vec![0.0, 0.0, 1.0],
                vec![1.0, 0.0, 0.0]
            ]
        );
        assert_eq!(
            columns(&scattered),
            [
                vec![1.0, 0.0, 0.0],
                vec![1.0, 0.0, 0.0],
                vec![0.0, 0.0, 1.0]
            ]
        );
        kv.write().unwrap().clear_row(s(row(1, 1)));
        kv.write().unwrap().clear_row_tier(s(row(2, 0)), Tier::Host);
        assert_eq!(
            columns(&all),
            [vec![0.0, 0.0, 1.0], vec![0.0; 3], vec![1.0, 0.0, 0.0]]
        );
        // Rows past the index's (a worker added before the index grew) read as holding nothing.
        kv.write().unwrap().ensure_rows(8);
        apply(7, KvEventKind::Stored, 1, Tier::Device);
        assert_eq!(kv.read().unwrap().held_columns()[0][7], 1.0);
        assert_eq!(columns(&all)[0], [0.0, 0.0, 1.0]);
    }
}
