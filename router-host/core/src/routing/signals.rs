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

use crate::model::{load_columns_by_row, OverlapSource, RowId, RowLoad, Signals, TierOverlap};
use crate::topology::Topology;

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

    fn overlap_columns(&self, rows: &[RowId], out: &mut Columns) {
        self.source.overlap_columns(rows, out);
    }

    fn kv_indexed_columns(&self, rows: &[RowId], out: &mut [Vec<f64>; 3]) {
        self.source.kv_indexed_columns(rows, out);
    }

    fn kv_index_state_column(&self, rows: &[RowId], out: &mut Vec<f64>) {
        self.source.kv_index_state_column(rows, out);
    }

    fn kv_index_state(&self, row: RowId) -> plugin_api::KvIndexState {
        self.source.kv_index_state(row)
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
        self.ledger.fill(self.topology, rows, out);
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
}

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
    /// Each slot's index state, when the core keeps them (`kv_index_state`).
    trust: Option<&'a RowTrust>,
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
            trust: None,
        }
    }

    /// Send each row's index state from `trust` with the overlap.
    pub fn with_trust(mut self, trust: &'a RowTrust) -> Self {
        self.trust = Some(trust);
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

    fn overlap_columns(&self, rows: &[RowId], out: &mut Columns) {
        let Columns {
            device, host, disk, ..
        } = out;
        self.with_walk(|b| {
            for (slot, device) in self.topology.slots(rows).zip(device.iter_mut()) {
                *device = blocks_in(&b.held, slot);
            }
            if b.host.is_empty() && b.disk.is_empty() {
                host.fill(0.0);
                disk.fill(0.0);
                return;
            }
            let columns = host.iter_mut().zip(disk.iter_mut());
            for (slot, (host, disk)) in self.topology.slots(rows).zip(columns) {
                *host = blocks_in(&b.host, slot);
                *disk = blocks_in(&b.disk, slot);
            }
        });
    }

    fn kv_indexed_columns(&self, rows: &[RowId], out: &mut [Vec<f64>; 3]) {
        let kv = self.kv.read().unwrap_or_else(PoisonError::into_inner);
        out.iter_mut().for_each(Vec::clear);
        let [device, host, disk] = out;
        for slot in self.topology.slots(rows) {
            // A row the topology does not know holds nothing the index could count.
            let held = slot.map_or([0; 3], |slot| kv.held_by_tier(slot));
            device.push(held[0] as f64);
            host.push(held[1] as f64);
            disk.push(held[2] as f64);
        }
    }

    fn kv_index_state_column(&self, rows: &[RowId], out: &mut Vec<f64>) {
        out.clear();
        let Some(trust) = self.trust else { return };
        // A row the topology does not know holds nothing: current.
        out.extend(
            self.topology
                .slots(rows)
                .map(|slot| slot.map_or(0.0, |slot| trust.get(slot).code())),
        );
    }

    fn kv_index_state(&self, row: RowId) -> plugin_api::KvIndexState {
        match (self.trust, self.topology.slot(row)) {
            (Some(trust), Some(slot)) => trust.get(slot),
            _ => plugin_api::KvIndexState::Current,
        }
    }
}
