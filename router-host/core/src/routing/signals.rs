//! The one snapshot of per-row signals that admission and selection both read.

use crate::model::{load_columns_by_row, OverlapSource, RowId, RowLoad, Signals, TierOverlap};
use crate::topology::Topology;

/// Load from the snapshot's ledger (by slot) unless the source overrides it; overlap from the
/// source.
pub(super) struct CoreSignals<'a, O: ?Sized> {
    pub source: &'a O,
    pub topology: &'a Topology,
}

impl<O: OverlapSource + ?Sized> Signals for CoreSignals<'_, O> {
    fn overlap(&self, row: RowId) -> TierOverlap {
        self.source.overlap(row)
    }

    fn load(&self, row: RowId) -> RowLoad {
        self.source.load_override(row).unwrap_or_else(|| {
            self.topology
                .slot(row)
                .map_or_else(RowLoad::default, |s| self.topology.ledger().load(s))
        })
    }

    fn overlap_columns(
        &self,
        rows: &[RowId],
        device: &mut [f64],
        host: &mut [f64],
        disk: &mut [f64],
    ) {
        self.source.overlap_columns(rows, device, host, disk);
    }

    fn load_columns(
        &self,
        rows: &[RowId],
        available: &mut [bool],
        active: &mut [u64],
        prefill: &mut [u64],
        decode: &mut [u64],
    ) {
        if self.source.overrides_load() {
            load_columns_by_row(rows, available, active, prefill, decode, |row| {
                self.load(row)
            });
            return;
        }
        self.topology
            .ledger()
            .fill(self.topology, rows, available, active, prefill, decode);
    }
}

/// Reusable buffers for one request's walk of the KV index.
#[derive(Debug, Default)]
pub struct OverlapBuffers {
    pub held: Vec<u32>,
    pub alive: Vec<u64>,
}

/// A request's overlap from the core's KV index: `held[slot]` leading blocks of its prompt are
/// on the row in `slot` (device tier; engines report only what they hold on the device today).
pub struct IndexOverlap<'a> {
    pub topology: &'a Topology,
    pub held: &'a [u32],
}

impl IndexOverlap<'_> {
    fn blocks(&self, slot: Option<u32>) -> f64 {
        f64::from(
            slot.and_then(|s| self.held.get(s as usize))
                .copied()
                .unwrap_or(0),
        )
    }
}

impl OverlapSource for IndexOverlap<'_> {
    fn overlap(&self, row: RowId) -> TierOverlap {
        TierOverlap {
            device: self.blocks(self.topology.slot(row)),
            host: 0.0,
            disk: 0.0,
        }
    }

    fn overlap_columns(
        &self,
        rows: &[RowId],
        device: &mut [f64],
        host: &mut [f64],
        disk: &mut [f64],
    ) {
        for (slot, device) in self.topology.slots(rows).zip(device.iter_mut()) {
            *device = self.blocks(slot);
        }
        host.fill(0.0);
        disk.fill(0.0);
    }
}
