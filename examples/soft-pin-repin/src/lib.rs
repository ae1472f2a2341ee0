//! `soft-pin-repin`: keep a session on its soft target until the target gets busy (docs/policies/soft-pin-repin.md).
//!
//! With a soft-affinity target that has eligible rows, the policy keeps the request on the
//! target's least-loaded row while that row has at most `max_active_requests` active requests.
//! Above the limit it moves the request to the least-loaded row of another worker (or rank); the
//! host then rebinds the session to where the request was dispatched, so later requests follow.
//! Without a target it is plain least-loaded. Ties go to the lowest `(worker_id, dp_rank)`.

use plugin_api::{
    AffinityTarget, Context, CreateContext, CreateError, Explanation, Inputs, ParamDoc, Parameters,
    PickError, Policy, PolicyType, RowId, Rows,
};
use serde::Deserialize;

/// The instance's `parameters:` mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RepinParams {
    /// The target keeps the request while its active requests are at most this (inclusive).
    pub max_active_requests: u64,
}

/// How the row was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The target's row is within the limit.
    TargetWithinLimit,
    /// The target's row is over the limit; moved to the least-loaded other row.
    TargetOverLimitMoved,
    /// The target's row is over the limit, but every row matches the target.
    TargetOverLimitNoAlternative,
    /// No target, or no row matches it: least-loaded row.
    NoTargetLeastLoaded,
}

impl Outcome {
    /// The stable reason string.
    pub fn reason(self) -> &'static str {
        match self {
            Outcome::TargetWithinLimit => "target_within_limit",
            Outcome::TargetOverLimitMoved => "target_over_limit_moved",
            Outcome::TargetOverLimitNoAlternative => "target_over_limit_no_alternative",
            Outcome::NoTargetLeastLoaded => "no_target_least_loaded",
        }
    }
}

/// The decision `pick` returns and `explain` describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Index of the chosen row.
    pub row: usize,
    pub outcome: Outcome,
    /// The target's least-loaded row (t), when a row matches the target.
    pub target_row: Option<usize>,
}

/// A `soft-pin-repin` instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SoftPinRepin {
    max_active_requests: u64,
}

impl SoftPinRepin {
    pub fn new(params: RepinParams) -> Self {
        SoftPinRepin {
            max_active_requests: params.max_active_requests,
        }
    }

    pub fn max_active_requests(&self) -> u64 {
        self.max_active_requests
    }

    /// Apply the rules of docs/policies/soft-pin-repin.md.
    pub fn decide(&self, ctx: &Context<'_>, rows: &Rows<'_>) -> Result<Decision, PickError> {
        let active = rows
            .load()
            .ok_or_else(|| PickError::new("load columns missing (LOAD was declared)"))?
            .active_requests;
        let (matching, other) = least_loaded_split(rows, active, ctx.affinity_target());
        let decision = |row, outcome| Decision {
            row,
            outcome,
            target_row: matching,
        };
        match (matching, other) {
            (None, None) => Err(PickError::new("no rows to pick from")),
            (None, Some(any)) => Ok(decision(any, Outcome::NoTargetLeastLoaded)),
            (Some(t), _) if active[t] <= self.max_active_requests => {
                Ok(decision(t, Outcome::TargetWithinLimit))
            }
            (Some(_), Some(o)) => Ok(decision(o, Outcome::TargetOverLimitMoved)),
            (Some(t), None) => Ok(decision(t, Outcome::TargetOverLimitNoAlternative)),
        }
    }
}

/// One pass: the least-loaded row matching `target` and the least-loaded row not matching it
/// (every row, when there is no target). Order: `(active_requests, worker_id, dp_rank)`.
fn least_loaded_split(
    rows: &Rows<'_>,
    active: &[u64],
    target: Option<AffinityTarget>,
) -> (Option<usize>, Option<usize>) {
    let key = |i: usize| (active[i], rows.row(i));
    let lower = |best: Option<usize>, i: usize| match best {
        Some(b) if key(b) <= key(i) => Some(b),
        _ => Some(i),
    };
    let (mut matching, mut other) = (None, None);
    for i in 0..rows.len() {
        if target.is_some_and(|t| t.matches(rows.row(i))) {
            matching = lower(matching, i);
        } else {
            other = lower(other, i);
        }
    }
    (matching, other)
}

fn row_label(row: RowId) -> String {
    format!("{}:{}", row.worker_id, row.dp_rank)
}

fn target_label(target: Option<AffinityTarget>) -> String {
    match target {
        Some(AffinityTarget {
            worker_id,
            dp_rank: Some(rank),
        }) => format!("{worker_id}:{rank}"),
        Some(AffinityTarget {
            worker_id,
            dp_rank: None,
        }) => format!("{worker_id}:*"),
        None => "none".to_string(),
    }
}

impl Policy for SoftPinRepin {
    fn inputs(&self) -> Inputs {
        Inputs::LOAD
    }

    fn pick(&self, ctx: &Context<'_>, rows: &Rows<'_>) -> Result<usize, PickError> {
        self.decide(ctx, rows).map(|d| d.row)
    }

    fn explain(&self, ctx: &Context<'_>, rows: &Rows<'_>) -> Option<Explanation> {
        let d = self.decide(ctx, rows).ok()?;
        let active = rows.load()?.active_requests;
        let mut e = Explanation::new(d.row, d.outcome.reason())
            .field("max_active_requests", self.max_active_requests as f64)
            .field("picked_active_requests", active[d.row] as f64)
            .label("target", target_label(ctx.affinity_target()));
        if let Some(t) = d.target_row {
            e = e
                .field("target_active_requests", active[t] as f64)
                .label("target_row", row_label(rows.row(t)));
        }
        Some(e)
    }
}

/// The `soft-pin-repin` policy type.
pub struct SoftPinRepinType;

impl PolicyType for SoftPinRepinType {
    type Policy = SoftPinRepin;
    const NAME: &'static str = "soft-pin-repin";
    const SUMMARY: &'static str =
        "Keep a session on its soft target until the target exceeds max_active_requests, \
         then move it to the least-loaded other row";

    fn parameters() -> Vec<ParamDoc> {
        vec![ParamDoc::required(
            "max_active_requests",
            "u64",
            "the target keeps the request while its least-loaded row has at most this many \
             active requests (inclusive); >= 0",
        )]
    }

    fn create(
        params: &Parameters<'_>,
        ctx: &CreateContext<'_>,
    ) -> Result<SoftPinRepin, CreateError> {
        let params: RepinParams = params.parse()?;
        tracing::info!(
            instance = ctx.instance_name(),
            policy = Self::NAME,
            max_active_requests = params.max_active_requests,
            "soft-pin-repin instance created"
        );
        Ok(SoftPinRepin::new(params))
    }
}

plugin_api::export_plugin! {
    name: "soft-pin-repin",
    version: env!("CARGO_PKG_VERSION"),
    policies: [SoftPinRepinType],
}

#[cfg(test)]
mod tests;
