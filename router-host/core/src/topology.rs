//! Which workers exist, and the one numbering of their rows: slots.
//!
//! A [`Topology`] is an immutable snapshot: the [`Cluster`] (workers sorted by id, with their
//! availability, overload and draining flags) and the *slots* of every row. A slot is a small integer that names one `(worker, rank)` row for
//! as long as the worker is registered; the ledger and the KV index address rows by slot, so
//! there is one numbering. A worker's ranks get consecutive slots (a decision then reads a
//! worker's load from consecutive cells); a removed worker's slots are freed and reused, lowest
//! first, by later workers.
//!
//! Readers take the current snapshot without locking (`arc_swap`, in the core); writers (worker
//! added, removed, flags changed) build a new snapshot and publish it. Writes are rare
//! (membership and health changes), reads happen on every decision.

use std::collections::BTreeSet;

use crate::model::{Cluster, ClusterError, RowId, Worker, MAX_ROWS};

/// The number of one row in the ledger and the KV index.
pub type Slot = u32;

/// Where one worker's ranks live: rank `dp_start + i` is slot `base + i`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotRun {
    pub dp_start: u32,
    pub dp_size: u32,
    pub base: Slot,
}

impl SlotRun {
    /// No worker: every rank misses.
    pub const EMPTY: SlotRun = SlotRun {
        dp_start: 0,
        dp_size: 0,
        base: 0,
    };

    /// The slot of `rank`, if the worker has it.
    #[inline]
    pub fn slot(&self, rank: u32) -> Option<Slot> {
        let i = rank.wrapping_sub(self.dp_start);
        (i < self.dp_size).then(|| self.base + i)
    }
}

/// A cluster snapshot and the slots of its rows.
#[derive(Debug, Clone, Default)]
pub struct Topology {
    cluster: Cluster,
    /// Worker ids in cluster order, dense for the per-row lookups of a decision.
    ids: Vec<u64>,
    runs: Vec<SlotRun>,
    /// Per worker (as `ids`), the KV capacity of each of its ranks in blocks; `NaN` = unknown.
    kv_capacity: Vec<f64>,
    /// Whether any worker's capacity is known (otherwise no capacity column is sent).
    knows_kv_capacity: bool,
    /// Which publication this is (`RoutingCore` numbers them), so a holder can tell with one
    /// plain load whether a newer snapshot exists.
    generation: u64,
    fleet: Fleet,
}

/// The slot of every registered row ([`Cluster::rows`], in cluster order), and whether those
/// slots are one run: kept with the snapshot because a decision over the whole fleet (every
/// worker eligible, the common case) would otherwise look up every row's slot again.
#[derive(Debug, Clone, Default)]
struct Fleet {
    slots: Vec<Slot>,
    run: Option<Slot>,
}

/// `Some(base)` when `slots` are `base, base + 1, ...` (and none is `u32::MAX`, no slot).
pub fn run_base(slots: &[Slot]) -> Option<Slot> {
    let &base = slots.first()?;
    let n = u32::try_from(slots.len()).ok()?;
    if base >= u32::MAX - n {
        return None;
    }
    // One pass without an early exit (it vectorises): any slot off the run leaves a bit set.
    let off = slots
        .iter()
        .zip(base..)
        .fold(0, |off, (&slot, expected)| off | (slot ^ expected));
    (off == 0).then_some(base)
}

impl Topology {
    /// The snapshot of `cluster` whose worker `w` starts at slot `base(worker_id)`.
    fn build(cluster: Cluster, base: impl Fn(u64) -> Slot) -> Topology {
        let runs = cluster
            .workers()
            .iter()
            .map(|w| SlotRun {
                dp_start: w.dp_start,
                dp_size: w.dp_size,
                base: base(w.worker_id),
            })
            .collect();
        let kv_capacity: Vec<f64> = cluster
            .workers()
            .iter()
            .map(|w| w.total_kv_blocks.map_or(f64::NAN, |blocks| blocks as f64))
            .collect();
        let mut topology = Topology {
            ids: cluster.workers().iter().map(|w| w.worker_id).collect(),
            runs,
            knows_kv_capacity: kv_capacity.iter().any(|c| !c.is_nan()),
            kv_capacity,
            cluster,
            generation: 0,
            fleet: Fleet::default(),
        };
        let slots: Vec<Slot> = topology.rows().map(|(_, slot)| slot).collect();
        let run = run_base(&slots);
        topology.fleet = Fleet { slots, run };
        topology
    }

    /// The slots of `rows` and whether they are one run ([`run_base`]), when `rows` are every
    /// registered row in cluster order (what eligibility yields when every worker is
    /// eligible); `None` otherwise. A comparison of the rows (none for the cluster's own)
    /// instead of a lookup per row.
    pub fn fleet_slots(&self, rows: &[RowId]) -> Option<(&[Slot], Option<Slot>)> {
        let fleet = self.cluster.rows();
        // The cluster's own rows (lent by eligibility) are known without looking at them.
        let same = rows.len() == fleet.len() && (std::ptr::eq(rows, fleet) || rows == fleet);
        same.then(|| (&self.fleet.slots[..], self.fleet.run))
    }

    /// The publication number (see [`Topology::published_as`]).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// This snapshot numbered as publication `generation`.
    pub fn published_as(mut self, generation: u64) -> Topology {
        self.generation = generation;
        self
    }

    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// Where worker `worker_id`'s ranks live ([`SlotRun::EMPTY`] if it is not registered).
    #[inline]
    pub fn run_of(&self, worker_id: u64) -> SlotRun {
        match self.ids.binary_search(&worker_id) {
            Ok(w) => self.runs[w],
            Err(_) => SlotRun::EMPTY,
        }
    }

    /// [`Topology::run_of`] for workers visited in cluster order: `cursor` (start at 0) is
    /// where the next worker is expected, and is tried before a search. A decision's rows come
    /// in cluster order ([`crate::eligibility::eligible`]), so filling its columns finds
    /// each worker with one comparison: a binary search per worker made every fill
    /// `O(rows log workers)`, the largest part of a decision at thousands of workers.
    #[inline]
    pub fn run_near(&self, worker_id: u64, cursor: &mut usize) -> SlotRun {
        self.index_near(worker_id, cursor)
            .map_or(SlotRun::EMPTY, |w| self.runs[w])
    }

    /// The position of `worker_id` in the cluster, trying `cursor` first; on a hit `cursor`
    /// moves past it (see [`Topology::run_near`]).
    #[inline]
    fn index_near(&self, worker_id: u64, cursor: &mut usize) -> Option<usize> {
        let w = match self.ids.get(*cursor) {
            Some(&id) if id == worker_id => *cursor,
            _ => self.ids.binary_search(&worker_id).ok()?,
        };
        *cursor = w + 1;
        Some(w)
    }

    /// Whether any worker's KV capacity is known.
    #[inline]
    pub fn knows_kv_capacity(&self) -> bool {
        self.knows_kv_capacity
    }

    /// The KV capacity in blocks of every row of `rows` into `out` (as long as `rows`): its
    /// worker's `total_kv_blocks`, `NaN` where unknown or not registered.
    pub fn kv_capacity_column(&self, rows: &[RowId], out: &mut [f64]) {
        let mut worker = None;
        let mut capacity = f64::NAN;
        let mut cursor = 0;
        for (row, out) in rows.iter().zip(out) {
            if worker != Some(row.worker_id) {
                worker = Some(row.worker_id);
                capacity = self
                    .index_near(row.worker_id, &mut cursor)
                    .map_or(f64::NAN, |w| self.kv_capacity[w]);
            }
            *out = capacity;
        }
    }

    /// The slot of `row`, if its worker is registered and has that rank.
    #[inline]
    pub fn slot(&self, row: RowId) -> Option<Slot> {
        self.run_of(row.worker_id).slot(row.dp_rank)
    }

    /// The slot of every row of `rows` (`None` for rows not registered), in order; one worker
    /// lookup per change of worker, a single comparison when the rows are in cluster order.
    #[inline]
    pub fn slots<'a>(&'a self, rows: &'a [RowId]) -> impl Iterator<Item = Option<Slot>> + 'a {
        let mut worker = None;
        let mut run = SlotRun::EMPTY;
        let mut cursor = 0;
        rows.iter().map(move |row| {
            if worker != Some(row.worker_id) {
                worker = Some(row.worker_id);
                run = self.run_near(row.worker_id, &mut cursor);
            }
            run.slot(row.dp_rank)
        })
    }

    /// Every registered row with its slot, in cluster order.
    pub fn rows(&self) -> impl Iterator<Item = (RowId, Slot)> + '_ {
        self.cluster
            .workers()
            .iter()
            .zip(&self.runs)
            .flat_map(|(w, run)| w.rows().zip(run.base..))
    }

    /// One more than the highest slot in use (the size a slot-indexed table needs).
    pub fn slot_bound(&self) -> usize {
        self.runs
            .iter()
            .map(|r| r.base as usize + r.dp_size as usize)
            .max()
            .unwrap_or(0)
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
        let mut bases = Vec::with_capacity(cluster.workers().len());
        for w in cluster.workers() {
            bases.push((w.worker_id, self.next));
            self.next += w.dp_size;
        }
        Topology::build(cluster, |id| {
            bases.iter().find(|(w, _)| *w == id).map_or(0, |(_, b)| *b)
        })
    }

    /// The lowest run of `n` free slots (reused first, then fresh ones).
    fn take_run(&mut self, n: u32) -> Slot {
        let mut start = None;
        let mut len = 0;
        let mut prev = None;
        for &s in &self.free {
            if prev.is_some_and(|p: Slot| p + 1 == s) {
                len += 1;
            } else {
                start = Some(s);
                len = 1;
            }
            prev = Some(s);
            if len == n {
                break;
            }
        }
        match start {
            Some(base) if len == n => {
                for s in base..base + n {
                    self.free.remove(&s);
                }
                base
            }
            _ => {
                self.next += n;
                self.next - n
            }
        }
    }

    /// `current` with `worker` added (its ranks get the lowest free run of slots), and how many
    /// slots slot-indexed tables must have for it (the caller makes sure they do before
    /// publishing).
    pub fn add(
        &mut self,
        current: &Topology,
        worker: Worker,
    ) -> Result<(Topology, usize), MembershipError> {
        if current.cluster.worker(worker.worker_id).is_some() {
            return Err(MembershipError::Duplicate(worker.worker_id));
        }
        let (id, dp_size) = (worker.worker_id, worker.dp_size);
        let mut workers = current.cluster.workers().to_vec();
        workers.push(worker);
        // Validates dp ranges and the total row cap before any slot is taken.
        let cluster = Cluster::new(workers)?;
        let base = self.take_run(dp_size);
        let needed = base as usize + dp_size as usize;
        if needed > MAX_ROWS {
            return Err(ClusterError::TooManyRows {
                rows: needed as u64,
                max: MAX_ROWS,
            }
            .into());
        }
        let next = Topology::build(cluster, |w| {
            if w == id {
                base
            } else {
                current.run_of(w).base
            }
        });
        Ok((next, needed))
    }

    /// `current` without `worker_id`, and the slots it freed (to be cleared by the caller
    /// before they are handed out again: the caller holds the writer lock throughout).
    pub fn remove(
        &mut self,
        current: &Topology,
        worker_id: u64,
    ) -> Result<(Topology, Vec<Slot>), MembershipError> {
        if current.cluster.worker(worker_id).is_none() {
            return Err(MembershipError::Unknown(worker_id));
        }
        let run = current.run_of(worker_id);
        let freed: Vec<Slot> = (run.base..run.base + run.dp_size).collect();
        let workers = current
            .cluster
            .workers()
            .iter()
            .filter(|w| w.worker_id != worker_id)
            .cloned()
            .collect();
        let cluster = Cluster::new(workers)?;
        let next = Topology::build(cluster, |w| current.run_of(w).base);
        self.free.extend(freed.iter().copied());
        Ok((next, freed))
    }

    /// `current` with one worker's flags (or KV capacity) changed by `edit`.
    pub fn edit(
        &self,
        current: &Topology,
        worker_id: u64,
        edit: impl FnOnce(&mut Worker),
    ) -> Result<Topology, MembershipError> {
        let mut workers = current.cluster.workers().to_vec();
        let worker = workers
            .iter_mut()
            .find(|w| w.worker_id == worker_id)
            .ok_or(MembershipError::Unknown(worker_id))?;
        let (start, size) = (worker.dp_start, worker.dp_size);
        edit(worker);
        // Flags only: the rows, and so the slots, stay as they are.
        worker.dp_start = start;
        worker.dp_size = size;
        // Rebuilt rather than cloned, so what is derived from the workers (the eligible rows,
        // the capacity column) follows the edit.
        let cluster = Cluster::new(workers)?;
        Ok(Topology::build(cluster, |w| current.run_of(w).base))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(worker_id: u64, dp_rank: u32) -> RowId {
        RowId { worker_id, dp_rank }
    }

    /// The whole fleet's slots come from the snapshot, equal to looking each row up, through
    /// membership changes that leave holes and reuse them out of cluster order; any other row
    /// set is looked up.
    #[test]
    fn the_fleets_slots_are_its_rows_slots_after_every_change() {
        let mut alloc = SlotAllocator::default();
        let cluster = Cluster::new(vec![Worker::new(9).with_ranks(4, 2), Worker::new(3)]).unwrap();
        let t0 = alloc.initial(cluster);
        let (t1, _) = alloc.add(&t0, Worker::new(5).with_ranks(0, 2)).unwrap();
        let (t2, _) = alloc.remove(&t1, 9).unwrap();
        let (t3, _) = alloc.add(&t2, Worker::new(8)).unwrap();
        // (run base or none) of each snapshot's fleet: [3, 9, 9], [3, 5, 5, 9, 9] (slots 0,
        // 3, 4, 1, 2), [3, 5, 5] (0, 3, 4), [3, 5, 5, 8] (0, 3, 4, 1).
        for (topology, run) in [(&t0, Some(0)), (&t1, None), (&t2, None), (&t3, None)] {
            let fleet: Vec<RowId> = topology.rows().map(|(r, _)| r).collect();
            let looked_up: Vec<Slot> = topology.slots(&fleet).map(Option::unwrap).collect();
            let (slots, fleet_run) = topology.fleet_slots(&fleet).expect("the fleet");
            assert_eq!((slots, fleet_run), (&looked_up[..], run));
            assert_eq!(run_base(&looked_up), run);
            let mut reversed = fleet.clone();
            reversed.reverse();
            assert_eq!(topology.fleet_slots(&reversed).is_some(), fleet.len() < 2);
            assert!(topology.fleet_slots(&fleet[1..]).is_none());
        }
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

        let (t1, needed) = alloc.add(&t0, Worker::new(5).with_ranks(0, 2)).unwrap();
        assert_eq!(needed, 5);
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

        // Three ranks do not fit the freed run of two: fresh slots; one rank does.
        let (t3, _) = alloc.add(&t2, Worker::new(1).with_ranks(0, 3)).unwrap();
        assert_eq!(
            (0..3).map(|r| t3.slot(row(1, r))).collect::<Vec<_>>(),
            vec![Some(5), Some(6), Some(7)]
        );
        let (t4, _) = alloc.add(&t3, Worker::new(2)).unwrap();
        assert_eq!(t4.slot(row(2, 0)), Some(1));
        assert_eq!(t4.slot_bound(), 8);
        assert_eq!(
            alloc.add(&t4, Worker::new(3)).unwrap_err(),
            MembershipError::Duplicate(3)
        );
        assert_eq!(
            alloc.remove(&t4, 42).unwrap_err(),
            MembershipError::Unknown(42)
        );
        let seen: Vec<_> = t4
            .slots(&[row(3, 0), row(1, 2), row(8, 0), row(1, 0)])
            .collect();
        assert_eq!(seen, vec![Some(0), Some(7), None, Some(5)]);
        let listed: Vec<_> = t4.rows().collect();
        assert_eq!(listed[0], (row(1, 0), 5));
        assert_eq!(listed.len(), 7);
    }

    #[test]
    fn the_cursor_lookup_finds_what_the_search_finds_in_any_order() {
        let mut alloc = SlotAllocator::default();
        let workers = [2u64, 5, 6, 9, 40];
        let cluster = Cluster::new(
            workers
                .iter()
                .map(|&id| Worker::new(id).with_ranks(1, 2))
                .collect(),
        )
        .unwrap();
        let t = alloc.initial(cluster);
        // Cluster order, a skip, a step back, repeats, unknown ids before, between and after.
        let visits = [2u64, 5, 6, 9, 40, 41, 2, 9, 6, 6, 0, 40, 7, 5, 1000, 2];
        let mut cursor = 0;
        for &id in &visits {
            assert_eq!(t.run_near(id, &mut cursor), t.run_of(id), "worker {id}");
        }
        let rows: Vec<RowId> = visits
            .iter()
            .flat_map(|&id| [row(id, 1), row(id, 2), row(id, 0)])
            .collect();
        let by_row: Vec<_> = rows.iter().map(|&r| t.slot(r)).collect();
        assert_eq!(t.slots(&rows).collect::<Vec<_>>(), by_row);
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

    fn capacities(t: &Topology, rows: &[RowId]) -> Vec<String> {
        let mut out = vec![0.0; rows.len()];
        t.kv_capacity_column(rows, &mut out);
        out.iter().map(|c| c.to_string()).collect()
    }

    #[test]
    fn the_capacity_column_follows_each_worker_and_its_edits() {
        let mut alloc = SlotAllocator::default();
        let mut sized = Worker::new(2).with_ranks(0, 2);
        sized.total_kv_blocks = Some(256);
        let t0 = alloc.initial(Cluster::new(vec![Worker::new(1), sized]).unwrap());
        assert!(t0.knows_kv_capacity());
        // Any row order, a worker's rows apart, an unregistered worker: aligned with `rows`.
        let rows = [row(2, 1), row(1, 0), row(7, 0), row(2, 0)];
        assert_eq!(capacities(&t0, &rows), ["256", "NaN", "NaN", "256"]);

        let t1 = alloc
            .edit(&t0, 1, |w| w.total_kv_blocks = Some(64))
            .unwrap();
        assert_eq!(capacities(&t1, &rows), ["256", "64", "NaN", "256"]);
        assert_eq!(
            t1.slot(row(2, 1)),
            t0.slot(row(2, 1)),
            "an edit keeps the slots"
        );

        let t2 = alloc.edit(&t1, 1, |w| w.total_kv_blocks = None).unwrap();
        let t3 = alloc.edit(&t2, 2, |w| w.total_kv_blocks = None).unwrap();
        assert!(t2.knows_kv_capacity());
        assert!(!t3.knows_kv_capacity(), "no worker's capacity known");
        assert_eq!(capacities(&t3, &rows), ["NaN", "NaN", "NaN", "NaN"]);

        let (t4, _) = alloc.add(&t3, sized_worker(5, 1000)).unwrap();
        assert!(t4.knows_kv_capacity());
        assert_eq!(capacities(&t4, &[row(5, 0)]), ["1000"]);
        let (t5, _) = alloc.remove(&t4, 5).unwrap();
        assert!(!t5.knows_kv_capacity());
    }

    fn sized_worker(id: u64, blocks: u64) -> Worker {
        let mut w = Worker::new(id);
        w.total_kv_blocks = Some(blocks);
        w
    }
}
