//! The decision `pick` just made, kept for the `explain` the host asks for next.
//!
//! A host that wants an explanation sends an [`EXPLAIN_TOKEN`] with the `pick` and the same
//! token with the `explain` that follows it over the same input (router-host's `serve` does on
//! every request, for its decision metric and headers). Deciding again in `explain` would double
//! the cost of every explained decision, which scans every row; so `pick` leaves its decision
//! here under the token, on its thread, and `explain` takes it back if the token (and instance)
//! match. Anything else (no token, another one, another thread) decides again.

use std::cell::Cell;

use plugin_api::abi::ExtensionValue;
use plugin_api::{Context, EXPLAIN_TOKEN};

use crate::decision::Decision;
use crate::TwoTierCostFn;

#[derive(Debug, Clone, Copy)]
struct Memo {
    instance: usize,
    token: u64,
    decision: Decision,
}

thread_local! {
    static LAST_PICK: Cell<Option<Memo>> = const { Cell::new(None) };
}

fn token(ctx: &Context<'_>) -> Option<u64> {
    match ctx.extension(EXPLAIN_TOKEN)? {
        ExtensionValue::U64(token) => Some(token),
        _ => None,
    }
}

fn instance(policy: &TwoTierCostFn) -> usize {
    policy as *const TwoTierCostFn as usize
}

/// Keep `decision` for the `explain` carrying the same token, if the host sent one.
pub(crate) fn remember(policy: &TwoTierCostFn, ctx: &Context<'_>, decision: Option<&Decision>) {
    let memo = token(ctx).zip(decision).map(|(token, &decision)| Memo {
        instance: instance(policy),
        token,
        decision,
    });
    // `try_with`: a pick during thread teardown keeps nothing.
    let _ = LAST_PICK.try_with(|last| last.set(memo));
}

/// The decision the `pick` with this call's token made, taken (it answers one `explain`).
pub(crate) fn recall(policy: &TwoTierCostFn, ctx: &Context<'_>) -> Option<Decision> {
    let token = token(ctx)?;
    let memo = LAST_PICK.try_with(Cell::take).ok()??;
    (memo.token == token && memo.instance == instance(policy)).then_some(memo.decision)
}
