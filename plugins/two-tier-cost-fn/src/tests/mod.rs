//! Unit tests of the policy, one file per topic; the helpers below are shared.

mod behaviour;
mod conformance;
mod explain_token;
mod index_trust;
mod kv_capacity_limit;
mod prefill_backlog;
mod ranks;
mod tie_break;
mod validation;

use plugin_api::abi::PickFailureKind;
use plugin_api::testing::{create, create_boxed, create_with, TestRequest, TestRow, TestRows};
use plugin_api::{Explanation, RowId};

use super::*;

const A: u64 = 29;
const B: u64 = 41;
const DEFAULTS: &str = "{}";
/// The seed's (Dynamo's) least-loaded signal, the default before `prefill_backlog` was measured
/// better: the conformance table and the lowest-row cases are written against it.
const ACTIVE: &str = r#"{"load_signal": "active_requests"}"#;
/// Soft affinity without the cache gate: the target is kept by the rules the seed had.
const RESPECT: &str = r#"{"respect_soft_affinity": true, "soft_affinity_cache_gate": false}"#;
const LOWEST_ROW: &str = r#"{"tie_break": "lowest_row", "load_signal": "active_requests"}"#;
const RESPECT_LOWEST_ROW: &str = r#"{"respect_soft_affinity": true, "soft_affinity_cache_gate": false, "tie_break": "lowest_row", "load_signal": "active_requests"}"#;
const RESPECT_GATE: &str = r#"{"respect_soft_affinity": true, "soft_affinity_cache_gate": false, "soft_affinity_load_gate": true}"#;

/// isl 160 at block size 16: R = 10.
fn request() -> TestRequest {
    TestRequest::new(160, 16)
}

fn policy(json: &str) -> TwoTierCostFn {
    create::<TwoTierCostFnType>(json).expect("valid parameters")
}

/// A rank-0 row written as in the design table: (worker, device, host, active).
fn row(worker: u64, device: f64, host: f64, active: u64) -> TestRow {
    TestRow::new(worker, 0)
        .device(device)
        .host(host)
        .active(active)
}

fn picked(policy: &TwoTierCostFn, rows: &[TestRow], request: &TestRequest) -> RowId {
    TestRows::new(rows.to_vec())
        .pick_worker(policy, request)
        .expect("a row is picked")
}

fn explained(policy: &TwoTierCostFn, rows: &[TestRow], request: &TestRequest) -> Explanation {
    let rows = TestRows::new(rows.to_vec());
    let explanation = rows.explain(policy, request).expect("an explanation");
    // explain describes exactly the row pick returns.
    assert_eq!(Ok(explanation.row), rows.pick(policy, request));
    explanation
}

fn at(worker_id: u64, dp_rank: u32) -> RowId {
    RowId { worker_id, dp_rank }
}

fn invalid(json: &str) -> CreateError {
    create::<TwoTierCostFnType>(json).expect_err("parameters must be rejected")
}

/// The error names `key`, the valid range and the bad value.
fn assert_names(err: &CreateError, key: &str, range: &str, value: &str) {
    assert_eq!(err.key(), key, "{err}");
    let text = err.to_string();
    for part in [key, range, value] {
        assert!(text.contains(part), "`{text}` should mention `{part}`");
    }
}

/// Every rotation of `rows`, forwards and backwards.
fn orders<T: Clone>(rows: &[T]) -> Vec<Vec<T>> {
    let mut out = Vec::new();
    for shift in 0..rows.len() {
        let mut order = rows.to_vec();
        order.rotate_left(shift);
        out.push(order.clone());
        order.reverse();
        out.push(order);
    }
    out
}

fn creation_log(json: &str, host_cache_hit_weight: f64) -> Vec<String> {
    let (created, events) = plugin_api::testing::capture_logs(|| {
        create_with::<TwoTierCostFnType>(json, host_cache_hit_weight, 16)
    });
    created.expect("valid parameters");
    events
}
