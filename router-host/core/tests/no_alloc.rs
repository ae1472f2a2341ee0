//! The core's steady-state request path allocates nothing: session lookup, eligibility, the
//! columns lent to the policy, booking, the binding update, the policy's dispatch and completion
//! hooks, release, and (indexed) the walk of the KV index for the prompt's blocks.
//!
//! A counting global allocator tallies allocations made by this thread while it is inside
//! `count_allocations`. The tests' own selector allocates nothing once its scratch has grown, so
//! whatever is counted is the core's.

mod common;

use std::sync::Arc;
use std::time::Duration;

use plugin_api::testing::{count_allocations, CountingAllocator};
use router_core::kv_index::{KvEventKind, Tier};
use router_core::model::{OverlapSource, Request, RowId, RowLoad, TierOverlap, Worker};
use router_core::rng::SplitMix64;
use router_core::routing::{CoreSettings, RoutingCore};
use router_core::sessions::{
    BindingGranularity, BindingMode, ManualClock, SessionStore, SessionTable, DEFAULT_MAX_BINDINGS,
};

use common::{core_of, Cheapest};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Overlap that varies with the request and the row, from a plain function (no allocation).
struct Overlaps(u64);

impl OverlapSource for Overlaps {
    fn overlap(&self, row: RowId) -> TierOverlap {
        TierOverlap {
            device: ((self.0 * 17 + row.worker_id * 5 + u64::from(row.dp_rank)) % 40) as f64,
            host: 0.0,
            disk: 0.0,
        }
    }
}

/// 16 workers of 8 ranks, soft session affinity (the table the core's sessions live in).
fn core() -> (RoutingCore, Arc<Cheapest>) {
    let table = SessionTable::new(
        BindingMode::Soft,
        Duration::from_secs(600),
        DEFAULT_MAX_BINDINGS,
        Arc::new(ManualClock::default()),
    )
    .with_granularity(BindingGranularity::Worker);
    let selector = Arc::new(Cheapest::following_targets());
    let core = core_of(
        selector.clone(),
        (0..16).map(|w| Worker::new(w).with_ranks(0, 8)).collect(),
        CoreSettings {
            sessions: Some(Arc::new(table) as Arc<dyn SessionStore>),
            ..CoreSettings::default()
        },
    );
    (core, selector)
}

/// 64 prompts; three in four belong to one of 16 sessions. Each has 8 blocks of its own
/// prefix (shared by requests with the same `i % 16`).
fn requests() -> Vec<Request> {
    (0..64u64)
        .map(|i| Request {
            isl_tokens: 512 + i * 64,
            blocks: (0..8).map(|b| (i % 16) * 1000 + b).collect(),
            session_id: (i % 4 != 0).then(|| format!("session-{}", i % 16)),
            ..Default::default()
        })
        .collect()
}

/// Run `prepare` then `step` 1,000 times to warm up, then 10,000 times counting the
/// allocations of `step` alone; `step` returns the row it routed to. Returns the allocations
/// and the distinct rows chosen.
fn steady(mut prepare: impl FnMut(u64), mut step: impl FnMut(u64) -> RowId) -> (u64, usize) {
    for n in 0..1_000 {
        prepare(n);
        step(n);
    }
    let mut total = 0;
    let mut rows = Vec::with_capacity(10_000);
    for n in 0..10_000 {
        prepare(n);
        let (row, allocations) = count_allocations(|| step(n));
        rows.push(row);
        total += allocations;
    }
    rows.sort();
    rows.dedup();
    (total, rows.len())
}

/// Some load stays booked so that decisions differ: 200 requests held until the end.
fn hold(core: &RoutingCore, requests: &[Request]) -> Vec<u64> {
    (0..200u64)
        .map(|n| {
            let request = &requests[(n % 64) as usize];
            core.route(request, &Overlaps(n), false).unwrap().id
        })
        .collect()
}

fn release(core: &RoutingCore, held: Vec<u64>) {
    for id in held {
        assert!(core.complete(id));
    }
    assert_eq!(core.in_flight(), 0);
    for (row, _) in core.topology().rows() {
        assert_eq!(core.booked(row), RowLoad::default(), "row {row:?}");
    }
}

/// The whole request path around selection: session lookup, selection, booking, the binding
/// update, the policy's dispatch and completion hooks, release. With sessions the table
/// already knows, a steady stream of requests allocates nothing in the core.
#[test]
fn route_and_complete_with_known_sessions_allocate_nothing_after_warm_up() {
    let (core, selector) = core();
    let requests = requests();
    let held = hold(&core, &requests);
    let (total, distinct) = steady(drop, |n| {
        let routed = core
            .route(&requests[(n % 64) as usize], &Overlaps(n), false)
            .unwrap();
        core.complete(routed.id);
        routed.decision.row
    });
    assert_eq!(total, 0, "core allocations across 10,000 route + complete");
    // The decisions were real: spread over many rows, not one constant answer.
    assert!(distinct > 16, "only {distinct} distinct rows chosen");
    // And the policy was told of each: the hooks ran inside the counted calls.
    assert_eq!(selector.hooks.dispatched(), 200 + 11_000);
    assert_eq!(selector.hooks.completed(), 11_000);
    release(&core, held);
}

/// The same with overlap from the prompt's blocks in the core's own KV index, as engines'
/// events change it between requests: the walk of the index reuses the thread's buffers.
#[test]
fn indexed_route_and_complete_allocate_nothing_after_warm_up() {
    let (core, _) = core();
    let requests = requests();
    let held = hold(&core, &requests);
    let rows: Vec<RowId> = core.topology().rows().map(|(row, _)| row).collect();
    // Between requests (not counted), an engine evicts one prefix from the row that held it
    // and another engine stores it: where prompts are cached keeps moving, and so do the
    // decisions.
    let mut rng = SplitMix64::new(7);
    let mut cached_on = [None::<RowId>; 16];
    let store = |n: u64| {
        let prefix = n % 16;
        let blocks = |kind| (0..8).map(move |b| (kind, Tier::Device, prefix * 1000 + b));
        let slot = &mut cached_on[prefix as usize];
        if let Some(row) = *slot {
            core.apply_kv_events(row, blocks(KvEventKind::Evicted));
        }
        let row = rows[rng.below(rows.len() as u64) as usize];
        core.apply_kv_events(row, blocks(KvEventKind::Stored));
        *slot = Some(row);
    };
    let (total, distinct) = steady(store, |n| {
        let request = &requests[(n % 64) as usize];
        let routed = core.route_indexed(request, false).unwrap();
        core.complete(routed.id);
        routed.decision.row
    });
    assert_eq!(
        total, 0,
        "core allocations across 10,000 indexed route + complete"
    );
    assert!(distinct > 16, "only {distinct} distinct rows chosen");
    assert!(core.kv_index().holdings() > 0);
    release(&core, held);
}

/// The recent-use tracker behind `kv_recent_device_blocks`: once each row has seen its prompt
/// families, recording dispatches and reading the column allocate nothing, also while families
/// expire and come back (the maps and the touch queue keep their capacity).
#[test]
fn recency_records_and_columns_allocate_nothing_after_warm_up() {
    use router_core::model::Cluster;
    use router_core::recency::Recency;
    use router_core::topology::SlotAllocator;

    let topology = SlotAllocator::default()
        .initial(Cluster::new((0..8).map(|w| Worker::new(w).with_ranks(0, 2)).collect()).unwrap());
    let rows: Vec<RowId> = topology.rows().map(|(row, _)| row).collect();
    let requests = requests();
    let recency = Recency::new(Duration::from_secs(10));
    let mut column = Vec::with_capacity(rows.len());
    // Every request's family on every row, then a window's worth of time: all of it expires.
    let at = |n: u64| Duration::from_millis(n * 7);
    let mut n = 0u64;
    for _ in 0..3 {
        for request in &requests {
            for &row in &rows {
                recency.record(&topology, row, request, 3.0, at(n));
                n += 1;
            }
        }
        n += 20_000 / 7;
    }
    let mut total = 0;
    let mut sum = 0.0;
    for i in 0..10_000u64 {
        let request = &requests[(i % 64) as usize];
        let row = rows[(i * 7 % rows.len() as u64) as usize];
        let now = at(n + i * 3);
        let ((), allocations) = count_allocations(|| {
            recency.record(&topology, row, request, (i % 9) as f64, now);
            recency.column(&rows, now, &mut column);
        });
        total += allocations;
        sum += column.iter().sum::<f64>();
    }
    assert_eq!(
        total, 0,
        "allocations across 10,000 records and column reads"
    );
    assert!(sum > 0.0, "the column counted something");
}
