//! How much of each row's cache is live work: the blocks requests routed to the row used or
//! stored within a recent window (the `kv_recent_device_blocks` column, plugin-api 1.5).
//!
//! When every row's device cache is full, the engine evicts its least recently used blocks. A
//! row whose cache no request touched for a while loses little by taking a new prefix; a row
//! whose cache is all in recent use (live multi-turn sessions) loses a session's history. So a
//! policy wants, per row, `capacity - recent`: what it can take without evicting live work.
//!
//! Tracked per row, not per (row, block): per row a bounded map of the prompt families routed
//! to it, each with when it was last used and how many blocks it adds. A family is a session
//! (its id) when the request has one, else the prompt's first block. A session's entry counts
//! the blocks of its latest prompt beyond what the row already cached when the session first
//! came (its `base`: usually a tenant's system prompt); that shared part is counted once, on an
//! entry for the prompt's first block. Recording a dispatch touches at most two entries, and
//! reading a row's sum is one lock and the expiry of what fell out of the window, so the cost
//! is independent of prompt length and of the window. It is an estimate: the selection caps it
//! at the row's indexed device blocks, which is what the engine still holds.

use std::collections::hash_map::RandomState;
use std::collections::VecDeque;
use std::hash::BuildHasher;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use crossbeam_utils::CachePadded;

use crate::fast_hash::FastMap;
use crate::model::{Request, RowId};
use crate::topology::Topology;

/// Families remembered per row; past it the least recently used one is forgotten first. A row
/// of 4,096 families live at once has far more sessions than any engine keeps caches for.
pub const MAX_FAMILIES_PER_ROW: usize = 4096;

const SHARD_BITS: u32 = 4;
const SHARDS: usize = 1 << SHARD_BITS;

/// One prompt family on one row.
#[derive(Debug, Clone, Copy)]
struct Entry {
    /// When it was last used, in nanoseconds of the core's clock.
    last: u64,
    /// Blocks it adds to the row's recent cache.
    blocks: u64,
    /// For a session: the blocks the row already cached when it first came (shared with other
    /// families), not counted in `blocks`.
    base: u64,
}

/// One row's families, the order they were touched in (for expiry, lazily: a touch of a family
/// touched before leaves its earlier place stale) and the sum of their blocks.
#[derive(Debug, Default)]
struct RowRecency {
    entries: FastMap<u64, Entry>,
    order: VecDeque<(u64, u64)>,
    sum: u64,
}

impl RowRecency {
    /// Forget the families last used at or before `cutoff`.
    fn expire(&mut self, cutoff: u64) {
        while let Some(&(at, key)) = self.order.front() {
            if at > cutoff {
                break;
            }
            self.order.pop_front();
            self.forget_if_last(key, at);
        }
    }

    /// Forget `key` if `at` is still its last use (else this place in `order` is stale).
    fn forget_if_last(&mut self, key: u64, at: u64) -> bool {
        match self.entries.get(&key) {
            Some(e) if e.last == at => {
                self.sum = self.sum.saturating_sub(e.blocks);
                self.entries.remove(&key);
                true
            }
            _ => false,
        }
    }

    /// Set `key`'s blocks (`blocks(previous)`) and base, used at `now`.
    fn touch(&mut self, key: u64, now: u64, base: u64, blocks: impl FnOnce(Option<&Entry>) -> u64) {
        let previous = self.entries.get(&key).copied();
        if previous.is_none() && self.entries.len() >= MAX_FAMILIES_PER_ROW {
            self.forget_oldest();
        }
        let blocks = blocks(previous.as_ref());
        self.sum = self
            .sum
            .saturating_sub(previous.map_or(0, |e| e.blocks))
            .saturating_add(blocks);
        self.entries.insert(
            key,
            Entry {
                last: now,
                blocks,
                base,
            },
        );
        self.order.push_back((now, key));
        // Stale places pile up when few families are touched often: drop them once they
        // outnumber the entries, in place (order kept, nothing allocated), so the queue stays
        // within twice the entries and steady routing allocates nothing.
        if self.order.len() > 2 * self.entries.len().max(8) {
            let entries = &self.entries;
            self.order
                .retain(|(at, key)| entries.get(key).is_some_and(|e| e.last == *at));
        }
    }

    /// Forget the least recently used family (every entry has its place in `order`).
    fn forget_oldest(&mut self) {
        while let Some((at, key)) = self.order.pop_front() {
            if self.forget_if_last(key, at) {
                return;
            }
        }
    }
}

/// The recent-use tracker of one routing core. See the module docs.
pub struct Recency {
    window: Duration,
    /// Keys families by a keyed hash: session ids are chosen by clients, and the per-row maps
    /// use the fast unkeyed hasher on these keys.
    keys: RandomState,
    shards: [CachePadded<Mutex<FastMap<RowId, RowRecency>>>; SHARDS],
}

impl std::fmt::Debug for Recency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recency")
            .field("window", &self.window)
            .finish_non_exhaustive()
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Recency {
    /// A tracker counting what was used within the last `window`.
    pub fn new(window: Duration) -> Self {
        Recency {
            window,
            keys: RandomState::new(),
            shards: std::array::from_fn(|_| CachePadded::new(Mutex::new(FastMap::default()))),
        }
    }

    pub fn window(&self) -> Duration {
        self.window
    }

    fn shard(&self, row: RowId) -> &Mutex<FastMap<RowId, RowRecency>> {
        let mixed = crate::rng::mix(row.worker_id ^ u64::from(row.dp_rank).rotate_left(32));
        &self.shards[(mixed >> (64 - SHARD_BITS)) as usize]
    }

    fn cutoff(&self, now: Duration) -> u64 {
        nanos(now).saturating_sub(nanos(self.window))
    }

    /// `request` was dispatched to `row` at `now`, where `cached` of its leading blocks were
    /// already on the row's device. Rows `topology` no longer has are dropped here, so the
    /// tracker never holds more rows than the topology has slots.
    pub fn record(
        &self,
        topology: &Topology,
        row: RowId,
        request: &Request,
        cached: f64,
        now: Duration,
    ) {
        let Some(&first) = request.blocks.first() else {
            return;
        };
        let len = request.blocks.len() as u64;
        // NaN and negatives read as nothing cached; `as` saturates.
        let cached = (if cached.is_nan() { 0.0 } else { cached } as u64).min(len);
        let root = self.keys.hash_one((0u8, first));
        let session = request
            .session_id
            .as_deref()
            .map(|s| self.keys.hash_one((1u8, s)));
        if topology.slot(row).is_none() {
            return;
        }
        let at = nanos(now);
        let mut rows = self
            .shard(row)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if rows.len() > topology.slot_bound() {
            rows.retain(|row, _| topology.slot(*row).is_some());
        }
        let r = rows.entry(row).or_default();
        r.expire(self.cutoff(now));
        match session {
            Some(key) => {
                let base = r.entries.get(&key).map_or(cached, |e| e.base).min(len);
                r.touch(key, at, base, |_| len - base);
                if base > 0 {
                    r.touch(root, at, 0, |e| e.map_or(base, |e| e.blocks.max(base)));
                }
            }
            None => r.touch(root, at, 0, |e| e.map_or(len, |e| e.blocks.max(len))),
        }
    }

    /// `row`'s recent blocks at `now` (before any cap).
    pub fn recent(&self, row: RowId, now: Duration) -> u64 {
        let mut rows = self
            .shard(row)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match rows.get_mut(&row) {
            Some(r) => {
                r.expire(self.cutoff(now));
                r.sum
            }
            None => 0,
        }
    }

    /// [`Recency::recent`] of every row of `rows` into `out`, made as long as `rows`.
    pub fn column(&self, rows: &[RowId], now: Duration, out: &mut Vec<f64>) {
        out.clear();
        out.extend(rows.iter().map(|&row| self.recent(row, now) as f64));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Cluster, Worker};
    use crate::topology::SlotAllocator;

    fn topology(workers: u64) -> Topology {
        let cluster = Cluster::new((0..workers).map(Worker::new).collect()).unwrap();
        SlotAllocator::default().initial(cluster)
    }

    fn row(w: u64) -> RowId {
        RowId {
            worker_id: w,
            dp_rank: 0,
        }
    }

    fn request(session: Option<&str>, blocks: std::ops::Range<u64>) -> Request {
        Request {
            blocks: blocks.collect(),
            session_id: session.map(str::to_string),
            ..Default::default()
        }
    }

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_session_counts_its_latest_prompt_and_expires_after_the_window() {
        let t = topology(2);
        let r = Recency::new(10 * S);
        r.record(&t, row(0), &request(Some("a"), 0..4), 0.0, S);
        assert_eq!(r.recent(row(0), S), 4);
        // The next turn extends the prompt: the session's entry grows, it is not added twice.
        r.record(&t, row(0), &request(Some("a"), 0..9), 4.0, 5 * S);
        assert_eq!(r.recent(row(0), 5 * S), 9);
        assert_eq!(r.recent(row(1), 5 * S), 0, "another row saw nothing");
        assert_eq!(
            r.recent(row(0), 14 * S),
            9,
            "still within 10 s of the last use"
        );
        assert_eq!(r.recent(row(0), 15 * S), 0, "10 s after the last use: cold");
    }

    #[test]
    fn a_prefix_shared_by_sessions_counts_once() {
        let t = topology(1);
        let r = Recency::new(10 * S);
        // Session a brings the 3-block system prompt (0..3) and 2 blocks of its own.
        r.record(&t, row(0), &request(Some("a"), 0..5), 0.0, S);
        // Session b finds the system prompt cached: only its own 4 blocks count, plus the
        // system prompt's entry (3).
        let b: Request = Request {
            blocks: vec![0, 1, 2, 100, 101, 102, 103],
            session_id: Some("b".into()),
            ..Default::default()
        };
        r.record(&t, row(0), &b, 3.0, 2 * S);
        assert_eq!(r.recent(row(0), 2 * S), 5 + 4 + 3);
        // Session a goes cold: b's own blocks and the shared prefix remain.
        assert_eq!(r.recent(row(0), 11 * S + Duration::from_millis(1)), 4 + 3);
    }

    #[test]
    fn without_sessions_a_root_counts_its_longest_recent_prompt() {
        let t = topology(1);
        let r = Recency::new(10 * S);
        r.record(&t, row(0), &request(None, 0..6), 0.0, S);
        r.record(&t, row(0), &request(None, 0..3), 3.0, 2 * S);
        assert_eq!(r.recent(row(0), 2 * S), 6);
        r.record(&t, row(0), &request(None, 50..52), 0.0, 3 * S);
        assert_eq!(r.recent(row(0), 3 * S), 8);
        let mut out = vec![7.0; 5];
        r.column(&[row(0), row(9)], 3 * S, &mut out);
        assert_eq!(out, [8.0, 0.0]);
    }

    #[test]
    fn families_per_row_stay_bounded_and_the_oldest_go_first() {
        let t = topology(1);
        let r = Recency::new(Duration::from_secs(3600));
        let n = MAX_FAMILIES_PER_ROW as u64 + 100;
        for i in 0..n {
            r.record(
                &t,
                row(0),
                &request(None, i * 10..i * 10 + 1),
                0.0,
                S + Duration::from_millis(i),
            );
            // Touch one family again and again: its stale places must not pile up.
            r.record(
                &t,
                row(0),
                &request(None, 0..1),
                0.0,
                S + Duration::from_millis(i),
            );
        }
        let shard = r.shard(row(0)).lock().unwrap();
        let rr = shard.get(&row(0)).unwrap();
        assert_eq!(rr.entries.len(), MAX_FAMILIES_PER_ROW);
        assert!(
            rr.order.len() <= 2 * MAX_FAMILIES_PER_ROW + 1,
            "{}",
            rr.order.len()
        );
        assert_eq!(
            rr.sum, MAX_FAMILIES_PER_ROW as u64,
            "one block each, sum kept exact"
        );
        drop(shard);
        // A prompt with no blocks records nothing.
        r.record(&t, row(0), &request(None, 0..0), 0.0, 2 * S);
    }

    #[test]
    fn rows_the_topology_no_longer_has_are_dropped() {
        let big = topology(40);
        let r = Recency::new(10 * S);
        for w in 0..40 {
            r.record(&big, row(w), &request(None, 0..1), 0.0, S);
        }
        let held = |r: &Recency| {
            r.shards
                .iter()
                .map(|s| s.lock().unwrap().len())
                .sum::<usize>()
        };
        assert_eq!(held(&r), 40);
        // Worker 0 alone remains: a record in its shard drops the others there, and a row the
        // topology does not have is not recorded.
        let small = topology(1);
        r.record(&small, row(0), &request(None, 0..1), 0.0, S);
        r.record(&small, row(39), &request(None, 5..6), 0.0, S);
        assert_eq!(r.shard(row(0)).lock().unwrap().len(), 1);
        assert_eq!(
            r.recent(row(39), S),
            1,
            "not recorded again under the small topology"
        );
    }
}
