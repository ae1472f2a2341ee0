//! `explain` carrying the `pick`'s [`EXPLAIN_TOKEN`] describes that pick instead of deciding
//! again; without the token, or with another one, it decides over its own input.

use plugin_api::Inputs;

use super::*;

fn pick(policy: &TwoTierCostFn, rows: &TestRows, token: Option<u64>) -> usize {
    let view = rows.view(Inputs::CACHE | Inputs::LOAD);
    let rows = Rows::from_raw(&view).expect("a consistent view");
    request()
        .with_explain_token(token, |ctx| policy.pick(ctx, &rows))
        .expect("a row is picked")
}

fn explain(policy: &TwoTierCostFn, rows: &TestRows, token: Option<u64>) -> Explanation {
    let view = rows.view(Inputs::CACHE | Inputs::LOAD);
    let rows = Rows::from_raw(&view).expect("a consistent view");
    request()
        .with_explain_token(token, |ctx| policy.explain(ctx, &rows))
        .expect("an explanation")
}

/// Rows A then B, of which `worker` caches the whole prompt (the cache tier picks it).
fn cached_on(worker: u64) -> TestRows {
    let device = |w| if w == worker { 10.0 } else { 0.0 };
    TestRows::new(vec![row(A, device(A), 0.0, 0), row(B, device(B), 0.0, 0)])
}

#[test]
fn explain_with_the_picks_token_describes_that_pick_without_deciding_again() {
    let policy = policy(DEFAULTS);
    let (on_a, on_b) = (cached_on(A), cached_on(B));
    let i = pick(&policy, &on_a, Some(7));
    assert_eq!(on_a.row(i).worker_id, A);
    let e = explain(&policy, &on_a, Some(7));
    assert_eq!(e.row, i);
    assert_eq!(
        e,
        explain(&policy, &on_a, None),
        "the same explanation as deciding again"
    );
    // The kept decision is what answers (shown by a host breaking the contract: the same token
    // over another input still describes the pick it named).
    let i = pick(&policy, &on_a, Some(8));
    assert_ne!(i, pick(&policy, &on_b, None));
    let i = pick(&policy, &on_a, Some(8));
    assert_eq!(explain(&policy, &on_b, Some(8)).row, i);
}

#[test]
fn explain_without_the_picks_token_decides_over_its_own_input() {
    let policy = policy(DEFAULTS);
    let (on_a, on_b) = (cached_on(A), cached_on(B));
    let b_row = |e: &Explanation| on_b.row(e.row).worker_id;
    // Another token, no token, a token already answered, another instance: B's own decision.
    pick(&policy, &on_a, Some(20));
    assert_eq!(b_row(&explain(&policy, &on_b, Some(21))), B);
    pick(&policy, &on_a, Some(22));
    assert_eq!(b_row(&explain(&policy, &on_b, None)), B);
    pick(&policy, &on_a, Some(23));
    assert_eq!(explain(&policy, &on_a, Some(23)).row, 0);
    assert_eq!(
        b_row(&explain(&policy, &on_b, Some(23))),
        B,
        "a token answers once"
    );
    let other = super::policy(DEFAULTS);
    pick(&policy, &on_a, Some(24));
    assert_eq!(b_row(&explain(&other, &on_b, Some(24))), B);
    // A pick without a token leaves nothing behind.
    pick(&policy, &on_a, Some(25));
    pick(&policy, &on_a, None);
    assert_eq!(b_row(&explain(&policy, &on_b, Some(25))), B);
}
