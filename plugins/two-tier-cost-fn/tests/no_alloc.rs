//! `pick` allocates nothing: it runs on every request, through the plugin's own allocator, where
//! the host's allocation test cannot see it.

use plugin_api::testing::{count_allocations, CountingAllocator, TestRequest, TestRow, TestRows};
use two_tier_cost_fn::{LoadSignal, TwoTierCostFn, TwoTierParams};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

#[test]
fn pick_allocates_nothing_on_any_branch() {
    for load_signal in [LoadSignal::ActiveRequests, LoadSignal::PrefillBacklog] {
        let params = TwoTierParams {
            respect_soft_affinity: true,
            soft_affinity_load_gate: true,
            load_signal,
            ..TwoTierParams::default()
        };
        pick_allocates_nothing(&TwoTierCostFn::new(&params, 0.75).unwrap());
    }
}

fn pick_allocates_nothing(policy: &TwoTierCostFn) {
    // 128 rows: 16 workers x 8 ranks, with cache and load spread so every tier gets exercised.
    let rows = TestRows::new(
        (0..16u64)
            .flat_map(|w| {
                (0..8u32).map(move |r| {
                    TestRow::new(w, r)
                        .device(((w * 3 + u64::from(r)) % 11) as f64)
                        .host((w % 4) as f64)
                        .active((w * 7 + u64::from(r) * 5) % 50)
                        .prefill_tokens((w * 131 + u64::from(r) * 17) % 900)
                })
            })
            .collect(),
    );
    let requests = [
        TestRequest::new(160, 16),
        TestRequest::new(4096, 16).target(3, None),
        TestRequest::new(4096, 16).target(5, Some(2)),
        TestRequest::new(64, 16).target(999, None).session("s"),
    ];
    let mut reasons = std::collections::BTreeSet::new();
    for request in &requests {
        reasons.insert(rows.explain(policy, request).unwrap().reason);
    }
    let (picked, allocations) = count_allocations(|| {
        let mut picked = 0usize;
        for _ in 0..1_000 {
            for request in &requests {
                picked += rows.pick(policy, request).unwrap();
            }
        }
        picked
    });
    assert_eq!(allocations, 0);
    assert!(picked > 0);
    assert!(reasons.len() >= 2, "branches exercised: {reasons:?}");
}
