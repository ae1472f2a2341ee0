//! `dynamo-two-tier-cost-fn`: a load tier, then a cache tier, then least-loaded (docs/policies/two-tier-cost-fn.md).
//!
//! 1. Load tier: if active requests are too uneven (absolute gap and ratio, both strict), pick the
//!    least-loaded row.
//! 2. Cache tier: if the best effective overlap (`device + host_cache_weight * host`) covers more
//!    than `cache_threshold` of the prompt, pick the least-loaded row among the best-cached ones.
//! 3. Otherwise pick the least-loaded row.
//!
//! With `kv_capacity_limit`, the row any tier chose gives way to the least-loaded row with room
//! when its KV cache would be over that fraction of its capacity, and a kept soft-affinity target
//! whose row would be over is released.
//!
//! Rows every tier finds equal are told apart by `tie_break`: by default (`spread`) in an order
//! drawn from the request and each row's id, so idle equal rows share the traffic; with
//! `lowest_row`, the lowest `(worker_id, dp_rank)`. Either way the row order the host uses never
//! matters. With `respect_soft_affinity` the same rules run over the soft target's rows first
//! (see [`decision::decide`]).
//!
//! The picker is public so benchmarks can link the rlib and call it without the ABI:
//! build a [`TwoTierCostFn`] with [`TwoTierCostFn::new`] and call [`Policy::pick`].

pub mod decision;
mod memo;
pub mod params;

use plugin_api::{
    Context, CreateContext, CreateError, Explanation, Inputs, ParamDoc, Parameters, PickError,
    Policy, PolicyType, RowId, Rows,
};

pub use decision::{Decision, Prompt, SoftAffinity, Tier, TierDecision};
pub use params::{LoadSignal, ResolvedParams, Room, TieBreak, TwoTierParams, WeightSource};

use decision::Columns;

/// A `dynamo-two-tier-cost-fn` instance.
#[derive(Debug, Clone, PartialEq)]
pub struct TwoTierCostFn {
    params: ResolvedParams,
}

impl TwoTierCostFn {
    /// Validate `params`; `host_cache_hit_weight` is the host's setting, used when the policy
    /// does not set `host_cache_weight`.
    pub fn new(params: &TwoTierParams, host_cache_hit_weight: f64) -> Result<Self, CreateError> {
        params
            .validate(host_cache_hit_weight)
            .map(Self::from_resolved)
    }

    /// An instance with already validated parameters.
    pub fn from_resolved(params: ResolvedParams) -> Self {
        TwoTierCostFn { params }
    }

    /// The parameters in force.
    pub fn params(&self) -> &ResolvedParams {
        &self.params
    }

    /// The decision `pick` returns and `explain` describes.
    pub fn decide(&self, ctx: &Context<'_>, rows: &Rows<'_>) -> Result<Decision, PickError> {
        let mut cols = Columns::from_rows(rows)?;
        if self.params.room == Room::NotRecent {
            cols = cols.with_room_not_recent(rows);
        }
        let prompt = Prompt {
            tokens: ctx.prompt_tokens(),
            block_size: ctx.block_size(),
            spread: match self.params.tie_break {
                TieBreak::LowestRow => None,
                TieBreak::Spread => Some(plugin_api::ties::request_key(ctx)),
            },
        };
        decision::decide(
            &self.params,
            &cols,
            ctx.request_blocks(),
            prompt,
            ctx.affinity_target(),
        )
    }

    fn explanation(&self, decision: &Decision, rows: &Rows<'_>) -> Explanation {
        let p = &self.params;
        let all = &decision.all;
        let mut e = Explanation::new(decision.row, decision.reason())
            .field("cache_threshold", p.cache_threshold)
            .field("balance_abs_threshold", p.balance_abs_threshold as f64)
            .field("balance_rel_threshold", p.balance_rel_threshold)
            .field("host_cache_weight", p.host_cache_weight)
            .field("cache_ratio", all.cache_ratio)
            .field("max_effective_overlap", all.max_effective_overlap)
            .field("min_active_requests", all.min_active as f64)
            .field("max_active_requests", all.max_active as f64)
            .label("tier", decision.deciding().tier.reason())
            .label("max_overlap_row", row_label(rows.row(all.max_overlap_row)))
            .label("soft_affinity", decision.soft_affinity.as_str())
            .label("tie_break", p.tie_break.as_str());
        if p.room != Room::Free {
            e = e.label("room", p.room.as_str());
        }
        e = rows.kv_index_trust().explain(rows, e);
        if p.respect_soft_affinity && p.soft_affinity_load_gate {
            e = e
                .field("soft_affinity_gate_abs", p.soft_affinity_gate_abs as f64)
                .field("soft_affinity_gate_rel", p.soft_affinity_gate_rel);
        }
        if let Some(limit) = p.kv_capacity_limit {
            e = e.field("kv_capacity_limit", limit);
        }
        if let Some(target) = &decision.target {
            e = e
                .field("target_active_requests", target.row_active as f64)
                .label("target_row", row_label(rows.row(target.row)));
        }
        e
    }
}

fn row_label(row: RowId) -> String {
    format!("{}:{}", row.worker_id, row.dp_rank)
}

impl Policy for TwoTierCostFn {
    fn inputs(&self) -> Inputs {
        Inputs::CACHE | Inputs::LOAD
    }

    fn pick(&self, ctx: &Context<'_>, rows: &Rows<'_>) -> Result<usize, PickError> {
        let decision = self.decide(ctx, rows);
        memo::remember(self, ctx, decision.as_ref().ok());
        decision.map(|d| d.row)
    }

    /// With the [`plugin_api::EXPLAIN_TOKEN`] of the `pick` just made (router-host sends one
    /// whenever it asks for an explanation), that pick's decision is described, not made again;
    /// otherwise it is made here.
    fn explain(&self, ctx: &Context<'_>, rows: &Rows<'_>) -> Option<Explanation> {
        let decision = match memo::recall(self, ctx) {
            Some(decision) => decision,
            None => self.decide(ctx, rows).ok()?,
        };
        Some(self.explanation(&decision, rows))
    }
}

/// The `dynamo-two-tier-cost-fn` policy type.
pub struct TwoTierCostFnType;

impl PolicyType for TwoTierCostFnType {
    type Policy = TwoTierCostFn;
    const NAME: &'static str = "dynamo-two-tier-cost-fn";
    const SUMMARY: &'static str =
        "Dynamo two-tier policy: least-loaded on load imbalance, else best KV-cache overlap, \
         else least-loaded";

    fn parameters() -> Vec<ParamDoc> {
        params::docs()
    }

    fn create(
        params: &Parameters<'_>,
        ctx: &CreateContext<'_>,
    ) -> Result<TwoTierCostFn, CreateError> {
        let policy = TwoTierCostFn::new(&params.parse()?, ctx.host_cache_hit_weight())?;
        log_resolved(ctx.instance_name(), policy.params());
        Ok(policy)
    }
}

/// Log the values in force (not just what the YAML said), once per instance.
fn log_resolved(instance: &str, p: &ResolvedParams) {
    // `off` or the number (as the other f64 fields print), never a missing field: an `Option`
    // field is left out of the line when `None`.
    let kv_capacity_limit = match p.kv_capacity_limit {
        Some(limit) => format!("{limit:?}"),
        None => "off".to_owned(),
    };
    tracing::info!(
        instance,
        policy = TwoTierCostFnType::NAME,
        cache_threshold = p.cache_threshold,
        balance_abs_threshold = p.balance_abs_threshold,
        balance_rel_threshold = p.balance_rel_threshold,
        host_cache_weight = p.host_cache_weight,
        host_cache_weight_source = p.host_cache_weight_source.as_str(),
        respect_soft_affinity = p.respect_soft_affinity,
        soft_affinity_load_gate = p.soft_affinity_load_gate,
        soft_affinity_cache_gate = p.soft_affinity_cache_gate,
        soft_affinity_gate_abs = p.soft_affinity_gate_abs,
        soft_affinity_gate_rel = p.soft_affinity_gate_rel,
        load_signal = p.load_signal.as_str(),
        kv_capacity_limit = kv_capacity_limit.as_str(),
        tie_break = p.tie_break.as_str(),
        room = p.room.as_str(),
        "two-tier policy instance created with resolved parameters"
    );
}

plugin_api::export_plugin! {
    name: "two-tier-cost-fn",
    version: env!("CARGO_PKG_VERSION"),
    policies: [TwoTierCostFnType],
}

#[cfg(test)]
mod tests;
