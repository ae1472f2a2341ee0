//! `pick` allocates nothing: it runs on every request, through the plugin's own allocator, where
//! the host's allocation test cannot see it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use plugin_api::testing::{TestRequest, TestRow, TestRows};
use two_tier_cost_fn::{TwoTierCostFn, TwoTierParams};

struct Counting;

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.try_with(Cell::get).unwrap_or(false) {
            let _ = ALLOCATIONS.try_with(|a| a.set(a.get() + 1));
        }
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn pick_allocates_nothing_on_any_branch() {
    let params = TwoTierParams {
        respect_soft_affinity: true,
        soft_affinity_load_gate: true,
        ..TwoTierParams::default()
    };
    let policy = TwoTierCostFn::new(&params, 0.75).unwrap();
    // 128 rows: 16 workers x 8 ranks, with cache and load spread so every tier gets exercised.
    let rows = TestRows::new(
        (0..16u64)
            .flat_map(|w| {
                (0..8u32).map(move |r| {
                    TestRow::new(w, r)
                        .device(((w * 3 + u64::from(r)) % 11) as f64)
                        .host((w % 4) as f64)
                        .active((w * 7 + u64::from(r) * 5) % 50)
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
        reasons.insert(rows.explain(&policy, request).unwrap().reason);
    }
    ALLOCATIONS.with(|a| a.set(0));
    COUNTING.with(|c| c.set(true));
    let mut picked = 0usize;
    for _ in 0..1_000 {
        for request in &requests {
            picked += rows.pick(&policy, request).unwrap();
        }
    }
    COUNTING.with(|c| c.set(false));
    assert_eq!(ALLOCATIONS.with(Cell::get), 0);
    assert!(picked > 0);
    assert!(reasons.len() >= 2, "branches exercised: {reasons:?}");
}
