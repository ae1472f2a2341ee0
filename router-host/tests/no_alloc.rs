//! The router (the loaded policy set) allocates nothing on the host side in steady state: not
//! in selection through the shipped two-tier plugin, not in its dispatch and completion hooks.
//! The core's own request path (sessions, booking, release) is checked in router-core's
//! `tests/no_alloc.rs`.
//!
//! A counting global allocator tallies allocations made by this thread while it is inside
//! `PolicySet::select`. Allocations inside a dynamically loaded plugin go through the plugin's own
//! copy of the Rust allocator and are not seen here; the shipped two-tier policy's `pick` is
//! checked for zero allocations separately, in its own crate's tests.

mod common;

use abi_stable::std_types::RSlice;
use plugin_api::abi::{opt_str, CompleteEvent, CompletionCode, DispatchEvent};
use plugin_api::testing::{count_allocations, CountingAllocator};

use router_host::config::RouterConfig;
use router_host::host::OverlapSource;
use router_host::loader::SearchPath;
use router_host::model::{
    AffinityTarget, Cluster, Request, RowId, RowLoad, Signals, TierOverlap, Worker,
};
use router_host::policy_set::{PolicySet, Scratch, Selection};

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
    let router = PolicySet::from_config(&config, &SearchPath::default()).unwrap();
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

/// The router's side of the dispatch and completion hooks (the watched call into the plugin)
/// allocates nothing either (a 10 s pick budget: slow picks on a busy machine must not
/// quarantine the plugin, which would skip its hooks). The rest of the request path around them (sessions, booking,
/// release) is the core's, checked in router-core's `tests/no_alloc.rs`.
#[test]
fn dispatch_and_completion_hooks_through_the_two_tier_plugin_allocate_nothing() {
    let yaml = format!(
        "plugins: [{{path: {}}}]\nworker_selection:\n  aggregated: t\n  instances:\n    - {{name: t, type: dynamo-two-tier-cost-fn, pick_budget_us: 10000000, parameters: {{respect_soft_affinity: true, soft_affinity_load_gate: true}}}}\n",
        common::plugin("two_tier_cost_fn").display()
    );
    let config = RouterConfig::from_yaml_str(&yaml, None).unwrap();
    let router = PolicySet::from_config(&config, &SearchPath::default()).unwrap();
    let cluster = Cluster::new((0..16).map(|w| Worker::new(w).with_ranks(0, 8)).collect()).unwrap();
    let sessions: Vec<String> = (0..16).map(|i| format!("session-{i}")).collect();
    let requests: Vec<Request> = (0..64u64)
        .map(|i| Request {
            isl_tokens: 512 + i * 64,
            session_id: (i % 4 != 0).then(|| sessions[(i % 16) as usize].clone()),
            ..Default::default()
        })
        .collect();
    let mut scratch = Scratch::default();
    let mut decide = |n: u64| {
        let request = &requests[(n % 64) as usize];
        let decision = router
            .select(&cluster, Selection::of(request), &Varying(n), &mut scratch)
            .unwrap();
        (request, decision.instance, decision.row)
    };
    let hooks = |n: u64, request: &Request, instance, row| {
        let session_id = opt_str(request.session_id.as_deref());
        router.notify_dispatch(
            instance,
            &DispatchEvent {
                request_id: n,
                row,
                session_id,
                prompt_tokens: request.isl_tokens,
                fallback: false,
                extensions: RSlice::EMPTY,
            },
        );
        router.notify_complete(
            instance,
            &CompleteEvent {
                request_id: n,
                row,
                session_id,
                outcome: CompletionCode::COMPLETED,
                extensions: RSlice::EMPTY,
            },
        );
    };
    let t = router
        .instances()
        .iter()
        .position(|i| i.name == "t")
        .expect("the plugin's instance");
    for n in 0..1_000 {
        let (request, instance, row) = decide(n);
        hooks(n, request, instance, row);
    }
    let mut total = 0;
    for n in 0..10_000 {
        let (request, instance, row) = decide(n);
        assert_eq!(instance, t, "the hooks go to the plugin's instance");
        let ((), allocations) = count_allocations(|| hooks(n, request, instance, row));
        total += allocations;
    }
    assert_eq!(
        total, 0,
        "host allocations across 10,000 dispatch + complete hooks"
    );
    // Hooks reach only an instance in service: it stayed in service throughout.
    let instance = &router.instances()[t];
    assert!(
        !instance.is_poisoned() && !instance.is_quarantined() && !instance.is_hung(),
        "the plugin left service, so its hooks were skipped"
    );
}
