//! Steady-state selection allocates nothing on the host side, and neither does the rest of the
//! request path (sessions, booking, hooks, completion) once a session is known.
//!
//! A counting global allocator tallies allocations made by this thread while it is inside
//! `Router::select`. Allocations inside a dynamically loaded plugin go through the plugin's own
//! copy of the Rust allocator and are not seen here; the shipped two-tier policy's `pick` is
//! checked for zero allocations separately, in its own crate's tests.

mod common;

use plugin_api::testing::{count_allocations, CountingAllocator};

use router_host::config::RouterConfig;
use router_host::host::{Host, OverlapSource};
use router_host::loader::SearchPath;
use router_host::model::{
    AffinityTarget, Cluster, Request, RowId, RowLoad, Signals, TierOverlap, Worker,
};
use router_host::router::{Router, Scratch, Selection};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Deterministic, varying signals: overlap and load depend on the request number and the row.
struct Varying(u64);

impl OverlapSource for Varying {
    fn overlap(&self, row: RowId) -> TierOverlap {
        let x = (self.0 * 31 + row.worker_id * 7 + u64::from(row.dp_rank)) % 17;
        TierOverlap {
            device: x as f64,
            host: (x % 5) as f64,
            disk: 0.0,
        }
    }
}

impl Signals for Varying {
    fn load(&self, row: RowId) -> RowLoad {
        RowLoad {
            available: true,
            active_requests: (self.0 + row.worker_id) % 9,
            active_prefill_tokens: (self.0 * 13 + row.worker_id) % 4096,
            decode_blocks: row.worker_id % 3,
        }
    }
}

#[test]
fn selection_through_the_two_tier_plugin_allocates_nothing_after_warm_up() {
    let yaml = format!(
        "plugins: [{{path: {}}}]\nworker_selection:\n  aggregated: t\n  instances:\n    - {{name: t, type: dynamo-two-tier-cost-fn, parameters: {{respect_soft_affinity: true}}}}\n",
        common::plugin("two_tier_cost_fn").display()
    );
    let config = RouterConfig::from_yaml_str(&yaml, None).unwrap();
    let router = Router::from_config(&config, &SearchPath::default()).unwrap();
    let cluster = Cluster::new((0..16).map(|w| Worker::new(w).with_ranks(0, 8)).collect()).unwrap();
    let session = String::from("session-42");
    let requests: Vec<Request> = (0..64u64)
        .map(|i| Request {
            isl_tokens: 512 + i * 64,
            session_id: Some(session.clone()),
            affinity_target: (i % 3 == 0).then_some(AffinityTarget {
                worker_id: i % 16,
                dp_rank: (i % 2 == 0).then_some((i % 8) as u32),
            }),
            allowed_worker_ids: (i % 5 == 0).then(|| (0..12).collect()),
            ..Default::default()
        })
        .collect();
    let mut scratch = Scratch::default();
    let decide = |n: u64, scratch: &mut Scratch| {
        let request = &requests[(n % 64) as usize];
        router
            .select(&cluster, Selection::of(request), &Varying(n), scratch)
            .map(|d| d.row)
    };
    for n in 0..1_000 {
        decide(n, &mut scratch).unwrap();
    }
    let mut total = 0;
    let mut rows = Vec::with_capacity(10_000);
    for n in 0..10_000 {
        let (row, allocations) = count_allocations(|| decide(n, &mut scratch));
        rows.push(row.unwrap());
        total += allocations;
    }
    assert_eq!(total, 0, "host allocations across 10,000 selections");
    // The decisions were real: spread over many rows, not one constant answer.
    rows.sort();
    rows.dedup();
    assert!(rows.len() > 16, "only {} distinct rows chosen", rows.len());
}

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

/// The whole request path around selection: session lookup, selection, booking, the binding
/// update, the policy's dispatch and completion hooks, release. With soft session affinity and
/// sessions the table already knows, a steady stream of requests allocates nothing on the host.
#[test]
fn route_and_complete_with_known_sessions_allocate_nothing_after_warm_up() {
    let yaml = format!(
        "plugins: [{{path: {}}}]\nworker_selection:\n  aggregated: t\n  instances:\n    - {{name: t, type: dynamo-two-tier-cost-fn, parameters: {{respect_soft_affinity: true, soft_affinity_load_gate: true}}}}\nsession_affinity: {{mode: soft, ttl_secs: 600}}\n",
        common::plugin("two_tier_cost_fn").display()
    );
    let config = RouterConfig::from_yaml_str(&yaml, None).unwrap();
    let router = Router::from_config(&config, &SearchPath::default()).unwrap();
    let cluster = Cluster::new((0..16).map(|w| Worker::new(w).with_ranks(0, 8)).collect()).unwrap();
    let mut host = Host::new(router, cluster, &config);
    let requests: Vec<Request> = (0..64u64)
        .map(|i| Request {
            isl_tokens: 512 + i * 64,
            session_id: (i % 4 != 0).then(|| format!("session-{}", i % 16)),
            ..Default::default()
        })
        .collect();
    // Some load stays booked so the decisions differ.
    let mut held = Vec::new();
    for n in 0..200u64 {
        let routed = host.route(&requests[(n % 64) as usize], &Overlaps(n), false);
        held.push(routed.unwrap().id);
    }
    let step = |n: u64, host: &mut Host| {
        let routed = host
            .route(&requests[(n % 64) as usize], &Overlaps(n), false)
            .unwrap();
        host.complete(routed.id);
        routed.decision.row
    };
    for n in 0..1_000 {
        step(n, &mut host);
    }
    let mut total = 0;
    let mut rows = Vec::with_capacity(10_000);
    for n in 0..10_000 {
        let (row, allocations) = count_allocations(|| step(n, &mut host));
        rows.push(row);
        total += allocations;
    }
    assert_eq!(total, 0, "host allocations across 10,000 route + complete");
    rows.sort();
    rows.dedup();
    assert!(rows.len() > 16, "only {} distinct rows chosen", rows.len());
    for id in held {
        assert!(host.complete(id));
    }
    assert_eq!(host.in_flight(), 0);
}
