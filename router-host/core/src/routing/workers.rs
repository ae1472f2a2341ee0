//! Membership and health: workers joining, draining, leaving; their flags; their KV events.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use plugin_api::abi::CompletionCode;

use super::{
    lock, next_generation, shard_of_slot, write, Booking, RequestId, RoutingCore, DRAWN_ID_BIT,
    SHARDS,
};
use crate::kv_index::{KvEvent, KvEventKind, Tier};
use crate::model::{RowId, Worker};
use crate::topology::{MembershipError, Topology};
use plugin_api::KvIndexState;

/// What removing a worker took with it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RemovedWorker {
    /// Requests that were in flight on it: their bookings are gone, and completing them later
    /// is a no-op. The caller fails them (the engine that held them is gone).
    pub in_flight: Vec<RequestId>,
    /// (row, block) holdings dropped from the KV index.
    pub cached_blocks: u64,
}

impl RoutingCore {
    /// Make `next` the current snapshot: stored first, then its generation announced, so a
    /// thread that sees the new generation finds the new snapshot. Callers hold the writer lock.
    fn publish(&self, next: Topology) {
        let generation = next_generation();
        self.topology.store(Arc::new(next.published_as(generation)));
        self.generation.store(generation, Ordering::Release);
    }

    /// Register a worker; its rows get slots and start idle and cold.
    pub fn add_worker(&self, worker: Worker) -> Result<(), MembershipError> {
        let mut alloc = lock(&self.writer);
        let (next, needed) = alloc.add(&self.topology.load(), worker)?;
        write(&self.kv).ensure_rows(next.slot_bound());
        self.trust.ensure(next.slot_bound());
        // In place: bookings and releases on other rows go on meanwhile.
        self.ledger.ensure(needed);
        self.publish(next);
        Ok(())
    }

    /// Change a worker's flags (`None` = leave as is). Draining takes no new requests, not even
    /// pinned or session-bound ones; requests in flight finish.
    pub fn set_worker_state(
        &self,
        worker_id: u64,
        available: Option<bool>,
        overloaded: Option<bool>,
        draining: Option<bool>,
    ) -> Result<(), MembershipError> {
        let alloc = lock(&self.writer);
        let next = alloc.edit(&self.topology.load(), worker_id, |w| {
            if let Some(available) = available {
                w.available = available;
            }
            if let Some(overloaded) = overloaded {
                w.overloaded = overloaded;
            }
            if let Some(draining) = draining {
                w.draining = draining;
            }
        })?;
        self.publish(next);
        Ok(())
    }

    /// Set (`None`: forget) worker `worker_id`'s KV capacity per rank, in blocks: the
    /// `kv_capacity_blocks` column policies see from the next decision on. An unchanged value
    /// publishes nothing.
    pub fn set_kv_capacity(
        &self,
        worker_id: u64,
        blocks: Option<u64>,
    ) -> Result<(), MembershipError> {
        let alloc = lock(&self.writer);
        let current = self.topology.load();
        let known = current
            .cluster()
            .worker(worker_id)
            .map(|w| w.total_kv_blocks);
        if known == Some(blocks) {
            return Ok(());
        }
        let next = alloc.edit(&current, worker_id, |w| w.total_kv_blocks = blocks)?;
        self.publish(next);
        Ok(())
    }

    /// Remove a worker: no new request can pick it from the moment this returns (or from the
    /// snapshot after it, for decisions already under way: they fail with `WorkerRemoved`), its
    /// bookings are released and forgotten, its KV-index entries dropped, its slots freed.
    pub fn remove_worker(&self, worker_id: u64) -> Result<RemovedWorker, MembershipError> {
        let mut alloc = lock(&self.writer);
        let (next, freed) = alloc.remove(&self.topology.load(), worker_id)?;
        let mut gone: Vec<(RequestId, Booking)> = Vec::new();
        let mut cached_blocks = 0;
        {
            // The new snapshot first: bookings after this see the worker gone. Then every
            // directory shard and every in-flight shard at once (in lock order), so no booking
            // or release runs while the freed slots are cleared; the writer lock keeps them from
            // being handed out again until that is done, and the KV write lock from taking
            // events for them.
            self.publish(next);
            let mut directories: Vec<_> = self.callers.iter().map(|s| lock(s)).collect();
            let mut shards: Vec<_> = self.inflight.iter().map(|s| lock(s)).collect();
            for shard in shards.iter_mut() {
                let ids: Vec<RequestId> = shard
                    .bookings
                    .iter()
                    .filter(|(_, b)| b.row.worker_id == worker_id)
                    .map(|(&id, _)| id)
                    .collect();
                for id in ids {
                    if let Some(booking) = shard.bookings.remove(&id) {
                        shard.held.forget_request(id);
                        if id & DRAWN_ID_BIT == 0 {
                            directories[(id % SHARDS as u64) as usize].remove(&id);
                        }
                        gone.push((id, booking));
                    }
                }
            }
            let mut kv = write(&self.kv);
            for &slot in &freed {
                self.ledger.reset(slot);
                shards[shard_of_slot(slot)].held.forget(slot);
                cached_blocks += kv.clear_row(slot);
                self.set_trust(slot, KvIndexState::Current);
            }
            drop(kv);
            drop(shards);
            drop(directories);
        }
        drop(alloc);
        let in_flight: Vec<RequestId> = gone.iter().map(|(id, _)| *id).collect();
        for (id, booking) in gone {
            self.end(id, booking, CompletionCode::FAILED);
        }
        tracing::info!(
            worker_id,
            in_flight = in_flight.len(),
            cached_blocks,
            "worker removed"
        );
        Ok(RemovedWorker {
            in_flight,
            cached_blocks,
        })
    }

    /// Apply cache events reported for `row`: `(kind, tier, block)` (ignored, and `false`, for
    /// a row not registered).
    pub fn apply_kv_events(
        &self,
        row: RowId,
        events: impl IntoIterator<Item = (KvEventKind, Tier, u64)>,
    ) -> bool {
        let mut kv = write(&self.kv);
        let Some(slot) = self.topology.load().slot(row) else {
            return false;
        };
        for (kind, tier, block) in events {
            kv.apply(&KvEvent {
                row: slot,
                kind,
                block,
                tier,
            });
        }
        true
    }

    /// Apply device-tier cache events for many rows under one lock; events for rows not
    /// registered are skipped. Returns how many were applied.
    pub fn apply_kv_batch(
        &self,
        events: impl IntoIterator<Item = (RowId, KvEventKind, u64)>,
    ) -> u64 {
        let mut kv = write(&self.kv);
        let topology = self.topology.load();
        let mut applied = 0;
        for (row, kind, block) in events {
            if let Some(slot) = topology.slot(row) {
                kv.apply(&KvEvent::on_device(slot, kind, block));
                applied += 1;
            }
        }
        applied
    }

    /// Set how far `row`'s KV index can be trusted (docs/serve.md, "KV index states"): what
    /// decisions lend policies as the `kv_index_state` column from the next one on. Returns
    /// the state it replaces, `None` for a row not registered.
    pub fn set_kv_index_state(&self, row: RowId, state: KvIndexState) -> Option<KvIndexState> {
        let slot = self.topology.load().slot(row)?;
        Some(self.set_trust(slot, state))
    }

    /// `row`'s KV index state (`None` for a row not registered).
    pub fn kv_index_state(&self, row: RowId) -> Option<KvIndexState> {
        let slot = self.topology.load().slot(row)?;
        Some(self.trust.get(slot))
    }

    /// Forget every block `row` holds, on every tier (its engine restarted).
    pub fn clear_kv_row(&self, row: RowId) -> u64 {
        let mut kv = write(&self.kv);
        match self.topology.load().slot(row) {
            Some(slot) => kv.clear_row(slot),
            None => 0,
        }
    }

    /// Forget the blocks `row` holds on `tier` (its engine cleared that cache).
    pub fn clear_kv_row_tier(&self, row: RowId, tier: Tier) -> u64 {
        let mut kv = write(&self.kv);
        match self.topology.load().slot(row) {
            Some(slot) => kv.clear_row_tier(slot, tier),
            None => 0,
        }
    }
}
