//! Which workers exist, and the one numbering of their rows: slots.
//!
//! A [`Topology`] is an immutable snapshot: the [`Cluster`] (workers sorted by id, with their
//! availability, overload and draining flags) plus the *slot* of every row. A slot is a small
//! integer that names one `(worker, rank)` row for as long as the worker is registered; the load
//! ledger, the KV index and the admission busy checks all address rows by slot, so there is one
//! numbering. Slots of a removed worker are freed and reused (lowest first) by later workers.
//!
//! Readers take the current snapshot without locking (`arc_swap`); writers (worker added,
//! removed, flags changed) build a new snapshot and publish it. Writes are rare (membership and
//! health changes), reads happen on every decision.

use std::collections::BTreeSet;

use crate::model::{Cluster, ClusterError, RowId, Worker, MAX_ROWS};

/// The number of one row in the ledger and the KV index.
pub type Slot = u32;

/// A cluster snapshot and the slot of each of its rows.
#[derive(Debug, Clone, Default)]
pub struct Topology {
    cluster: Cluster,
    /// Index into `slots` of each worker's first row; one more entry than workers.
    offset: Vec<usize>,
    /// The slot of every row, in cluster order (workers by id, then ranks).
    slots: Vec<Slot>,
}

impl Topology {
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// The slot of `row`, if its worker is registered and has that rank.
    #[inline]
    pub fn slot(&self, row: RowId) -> Option<Slot> {
        let w = self
            .cluster
            .workers()
            .binary_search_by_key(&row.worker_id, |w| w.worker_id)
            .ok()?;
        self.slot_in(w, row)
    }

    /// The slot of `row` given its worker's position `w` in the cluster.
    #[inline]
    pub fn slot_in(&self, w: usize, row: RowId) -> Option<Slot> {
        let worker = self.cluster.workers().get(w)?;
        let rank = row.dp_rank.checked_sub(worker.dp_start)? as usize;
        let i = self.offset[w] + rank;
        (i < self.offset[w + 1]).then(|| self.slots[i])
    }

    /// The slots of every row of `rows` into `out` (`None` for rows not registered); one worker
    /// lookup per change of worker, so rows in cluster order cost one lookup per worker.
    #[inline]
    pub fn slots_of(&self, rows: &[RowId], mut each: impl FnMut(usize, Option<Slot>)) {
        let workers = self.cluster.workers();
        let mut w = usize::MAX;
        for (i, &row) in rows.iter().enumerate() {
            if workers.get(w).map(|x| x.worker_id) != Some(row.worker_id) {
                w = workers
                    .binary_search_by_key(&row.worker_id, |x| x.worker_id)
                    .unwrap_or(usize::MAX);
            }
            each(i, (w != usize::MAX).then(|| self.slot_in(w, row)).flatten());
        }
    }

    /// Every registered row with its slot, in cluster order.
    pub fn rows(&self) -> impl Iterator<Item = (RowId, Slot)> + '_ {
        self.cluster
            .workers()
            .iter()
            .flat_map(Worker::rows)
            .zip(self.slots.iter().copied())
    }

    /// One more than the highest slot in use (the size a slot-indexed table needs).
    pub fn slot_bound(&self) -> usize {
        self.slots.iter().max().map_or(0, |&s| s as usize + 1)
    }

    fn from_parts(cluster: Cluster, slot_of: impl Fn(RowId) -> Slot) -> Topology {
        let mut offset = Vec::with_capacity(cluster.workers().len() + 1);
        let mut slots = Vec::with_capacity(cluster.row_count());
        for w in cluster.workers() {
            offset.push(slots.len());
            slots.extend(w.rows().map(&slot_of));
        }
        offset.push(slots.len());
        Topology {
            cluster,
            offset,
            slots,
        }
    }
}

/// Why a membership change was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MembershipError {
    #[error("worker {0} is already registered")]
    Duplicate(u64),
    #[error("worker {0} is not registered")]
    Unknown(u64),
    #[error(transparent)]
    Cluster(#[from] ClusterError),
}

/// Builds topology snapshots and hands out slots; owned by the single writer.
#[derive(Debug, Default)]
pub struct SlotAllocator {
    free: BTreeSet<Slot>,
    next: Slot,
}

impl SlotAllocator {
    /// The first snapshot: slots 0.. in cluster order.
    pub fn initial(&mut self, cluster: Cluster) -> Topology {
        let mut next = 0;
        let mut assigned = Vec::with_capacity(cluster.row_count());
        for _ in 0..cluster.row_count() {
            assigned.push(next);
            next += 1;
        }
        self.next = next;
        let rows: Vec<RowId> = cluster.workers().iter().flat_map(Worker::rows).collect();
        Topology::from_parts(cluster, |row| {
            let i = rows.binary_search(&row).unwrap_or(0);
            assigned[i]
        })
    }

    fn take(&mut self) -> Slot {
        match self.free.pop_first() {
            Some(slot) => slot,
            None => {
                self.next += 1;
                self.next - 1
            }
        }
    }

    /// `current` with `worker` added (its rows get the lowest free slots).
    pub fn add(&mut self, current: &Topology, worker: Worker) -> Result<Topology, MembershipError> {
        if current.cluster.worker(worker.worker_id).is_some() {
            return Err(MembershipError::Duplicate(worker.worker_id));
        }
        let mut workers = current.cluster.workers().to_vec();
        let id = worker.worker_id;
        workers.push(worker);
        // Validates dp ranges and the total row cap before any slot is taken.
        let cluster = Cluster::new(workers)?;
        if cluster.row_count() > MAX_ROWS {
            return Err(ClusterError::TooManyRows {
                rows: cluster.row_count() as u64,
                max: MAX_ROWS,
            }
            .into());
        }
        let new_rows: Vec<RowId> = cluster
            .worker(id)
            .map(|w| w.rows().collect())
            .unwrap_or_default();
        let new_slots: Vec<Slot> = new_rows.iter().map(|_| self.take()).collect();
        Ok(Topology::from_parts(cluster, |row| {
            if row.worker_id == id {
                let i = new_rows.binary_search(&row).unwrap_or(0);
                new_slots[i]
            } else {
                current.slot(row).unwrap_or(Slot::MAX)
            }
        }))
    }

    /// `current` without `worker_id`, and the slots it freed (to be cleared by the caller
    /// before they are handed out again: the caller holds the writer lock throughout).
    pub fn remove(
        &mut self,
        current: &Topology,
        worker_id: u64,
    ) -> Result<(Topology, Vec<Slot>), MembershipError> {
        let removed = current
            .cluster
            .worker(worker_id)
            .ok_or(MembershipError::Unknown(worker_id))?;
        let freed: Vec<Slot> = removed.rows().filter_map(|r| current.slot(r)).collect();
        let workers = current
            .cluster
            .workers()
            .iter()
            .filter(|w| w.worker_id != worker_id)
            .cloned()
            .collect();
        let cluster = Cluster::new(workers)?;
        let next = Topology::from_parts(cluster, |row| current.slot(row).unwrap_or(Slot::MAX));
        self.free.extend(freed.iter().copied());
        Ok((next, freed))
    }

    /// `current` with one worker's flags changed by `edit`.
    pub fn edit(
        &self,
        current: &Topology,
        worker_id: u64,
        edit: impl FnOnce(&mut Worker),
    ) -> Result<Topology, MembershipError> {
        let mut next = current.clone();
        let worker = next
            .cluster
            .worker_mut(worker_id)
            .ok_or(MembershipError::Unknown(worker_id))?;
        let (start, size) = (worker.dp_start, worker.dp_size);
        edit(worker);
        // Flags only: the rows, and so the slots, stay as they are.
        worker.dp_start = start;
        worker.dp_size = size;
        Ok(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(worker_id: u64, dp_rank: u32) -> RowId {
        RowId { worker_id, dp_rank }
    }

    #[test]
    fn slots_are_stable_across_membership_changes_and_reused_lowest_first() {
        let mut alloc = SlotAllocator::default();
        let cluster = Cluster::new(vec![Worker::new(9).with_ranks(4, 2), Worker::new(3)]).unwrap();
        let t0 = alloc.initial(cluster);
        assert_eq!(t0.slot(row(3, 0)), Some(0));
        assert_eq!(t0.slot(row(9, 4)), Some(1));
        assert_eq!(t0.slot(row(9, 5)), Some(2));
        assert_eq!(t0.slot(row(9, 3)), None);
        assert_eq!(t0.slot(row(7, 0)), None);

        let t1 = alloc.add(&t0, Worker::new(5).with_ranks(0, 2)).unwrap();
        assert_eq!(t1.slot(row(5, 1)), Some(4));
        assert_eq!(
            t1.slot(row(9, 5)),
            Some(2),
            "existing rows keep their slots"
        );

        let (t2, freed) = alloc.remove(&t1, 9).unwrap();
        assert_eq!(freed, vec![1, 2]);
        assert_eq!(t2.slot(row(9, 4)), None);
        assert_eq!(t2.slot(row(5, 0)), Some(3));

        let t3 = alloc.add(&t2, Worker::new(1).with_ranks(0, 3)).unwrap();
        assert_eq!(
            (0..3).map(|r| t3.slot(row(1, r))).collect::<Vec<_>>(),
            vec![Some(1), Some(2), Some(5)]
        );
        assert_eq!(t3.slot_bound(), 6);
        assert_eq!(
            alloc.add(&t3, Worker::new(3)).unwrap_err(),
            MembershipError::Duplicate(3)
        );
        assert_eq!(
            alloc.remove(&t3, 42).unwrap_err(),
            MembershipError::Unknown(42)
        );
        let mut seen = Vec::new();
        t3.slots_of(&[row(3, 0), row(1, 2), row(8, 0), row(1, 0)], |i, s| {
            seen.push((i, s))
        });
        assert_eq!(
            seen,
            vec![(0, Some(0)), (1, Some(5)), (2, None), (3, Some(1))]
        );
    }

    #[test]
    fn edit_changes_flags_but_never_rows() {
        let mut alloc = SlotAllocator::default();
        let t0 = alloc.initial(Cluster::new(vec![Worker::new(1).with_ranks(0, 2)]).unwrap());
        let t1 = alloc
            .edit(&t0, 1, |w| {
                w.draining = true;
                w.dp_size = 99;
            })
            .unwrap();
        let w = t1.cluster().worker(1).unwrap();
        assert!(w.draining);
        assert_eq!(w.dp_size, 2);
        assert!(alloc.edit(&t0, 2, |_| {}).is_err());
    }
}
