//! Parameters of `dynamo-two-tier-cost-fn`: what the YAML may say, and the values in force.

use plugin_api::{check, CreateError, ParamDoc};
use serde::Deserialize;

pub const DEFAULT_CACHE_THRESHOLD: f64 = 0.5;
pub const DEFAULT_BALANCE_ABS_THRESHOLD: u64 = 32;
pub const DEFAULT_BALANCE_REL_THRESHOLD: f64 = 1.1;

/// The instance's `parameters:` mapping as written. Every key is optional; unknown keys are
/// rejected. `None` means "absent" where absence has its own meaning (see [`Self::validate`]).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TwoTierParams {
    pub cache_threshold: f64,
    pub balance_abs_threshold: u64,
    pub balance_rel_threshold: f64,
    /// Absent: the host's `host_cache_hit_weight`.
    pub host_cache_weight: Option<f64>,
    pub respect_soft_affinity: bool,
    pub soft_affinity_load_gate: bool,
    /// Release a kept target when another row caches more of the prompt.
    pub soft_affinity_cache_gate: bool,
    /// Absent: `balance_abs_threshold`.
    pub soft_affinity_gate_abs: Option<u64>,
    /// Absent: `balance_rel_threshold`.
    pub soft_affinity_gate_rel: Option<f64>,
    pub load_signal: LoadSignal,
    /// Absent: no tier looks at KV capacity.
    pub kv_capacity_limit: Option<f64>,
    pub tie_break: TieBreak,
    pub room: Room,
}

/// What "least-loaded" means in the cache tier and the fallback tier (the load tier and the
/// soft-affinity gate always compare active requests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadSignal {
    /// Fewest active requests (Dynamo's two-tier).
    ActiveRequests,
    /// Fewest prompt tokens to prefill before the request's first token: the row's
    /// `active_prefill_tokens` plus the request's prompt tokens the row does not cache; then
    /// fewest active requests. The default: measured better than `active_requests` on every
    /// replayed workload, most where KV is tight (docs/policies/two-tier-cost-fn.md).
    #[default]
    PrefillBacklog,
}

impl LoadSignal {
    pub fn as_str(self) -> &'static str {
        match self {
            LoadSignal::ActiveRequests => "active_requests",
            LoadSignal::PrefillBacklog => "prefill_backlog",
        }
    }
}

/// How rows that every tier finds equal are told apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TieBreak {
    /// The lowest `(worker_id, dp_rank)` (Dynamo's policy as first ported): with idle rows every
    /// request lands on the lowest ids.
    LowestRow,
    /// The tied row that ranks first in an order drawn from the request (its prompt length,
    /// block count and session id) and each row's id, as the built-in `default` does: the same
    /// request always breaks the same way, and different requests spread over the tied rows.
    #[default]
    Spread,
}

impl TieBreak {
    pub fn as_str(self) -> &'static str {
        match self {
            TieBreak::LowestRow => "lowest_row",
            TieBreak::Spread => "spread",
        }
    }
}

/// What `tie_break: spread` counts as a row's room first, for a prompt no row caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Room {
    /// Capacity minus the indexed device blocks ([`plugin_api::ties::RoomColumns::of`]).
    #[default]
    Free,
    /// Capacity minus the device blocks requests used lately (the host's
    /// `kv_recent_device_blocks` column, plugin-api 1.5;
    /// [`plugin_api::ties::RoomColumns::not_recent`]): where a new prefix evicts the least live
    /// work. `free` from hosts that send no recent column.
    NotRecent,
}

impl Room {
    pub fn as_str(self) -> &'static str {
        match self {
            Room::Free => "free",
            Room::NotRecent => "not_recent",
        }
    }
}

impl Default for TwoTierParams {
    fn default() -> Self {
        TwoTierParams {
            cache_threshold: DEFAULT_CACHE_THRESHOLD,
            balance_abs_threshold: DEFAULT_BALANCE_ABS_THRESHOLD,
            balance_rel_threshold: DEFAULT_BALANCE_REL_THRESHOLD,
            host_cache_weight: None,
            respect_soft_affinity: false,
            soft_affinity_load_gate: false,
            soft_affinity_cache_gate: true,
            soft_affinity_gate_abs: None,
            soft_affinity_gate_rel: None,
            load_signal: LoadSignal::PrefillBacklog,
            kv_capacity_limit: None,
            tie_break: TieBreak::Spread,
            room: Room::Free,
        }
    }
}

/// Where the host-tier weight in force came from (logged at construction).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightSource {
    /// The policy's own `host_cache_weight` parameter.
    Policy,
    /// The host's `host_cache_hit_weight` setting.
    HostSetting,
}

impl WeightSource {
    pub fn as_str(self) -> &'static str {
        match self {
            WeightSource::Policy => "policy",
            WeightSource::HostSetting => "host setting",
        }
    }
}

/// Validated parameters with every default applied: what the decision actually uses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ResolvedParams {
    pub cache_threshold: f64,
    pub balance_abs_threshold: u64,
    pub balance_rel_threshold: f64,
    pub host_cache_weight: f64,
    pub host_cache_weight_source: WeightSource,
    pub respect_soft_affinity: bool,
    pub soft_affinity_load_gate: bool,
    pub soft_affinity_cache_gate: bool,
    pub soft_affinity_gate_abs: u64,
    pub soft_affinity_gate_rel: f64,
    pub load_signal: LoadSignal,
    /// `None`: off.
    pub kv_capacity_limit: Option<f64>,
    pub tie_break: TieBreak,
    pub room: Room,
}

impl TwoTierParams {
    /// Check every range and apply the defaults that depend on other values.
    /// `host_cache_hit_weight` is the host's setting, used when `host_cache_weight` is absent.
    pub fn validate(&self, host_cache_hit_weight: f64) -> Result<ResolvedParams, CreateError> {
        let cache_threshold = check::finite_in("cache_threshold", self.cache_threshold, 0.0, 1.0)?;
        let balance_rel_threshold =
            check::finite_at_least("balance_rel_threshold", self.balance_rel_threshold, 1.0)?;
        let (host_cache_weight, host_cache_weight_source) = match self.host_cache_weight {
            Some(weight) => (
                check::finite_at_least("host_cache_weight", weight, 0.0)?,
                WeightSource::Policy,
            ),
            None => (
                host_setting_weight(host_cache_hit_weight)?,
                WeightSource::HostSetting,
            ),
        };
        let soft_affinity_gate_rel = match self.soft_affinity_gate_rel {
            Some(rel) => check::finite_at_least("soft_affinity_gate_rel", rel, 1.0)?,
            None => balance_rel_threshold,
        };
        let kv_capacity_limit = self
            .kv_capacity_limit
            .map(|limit| {
                if limit.is_finite() && limit > 0.0 {
                    Ok(limit)
                } else {
                    Err(CreateError::invalid(
                        "kv_capacity_limit",
                        format!("must be a finite number > 0.0, got {limit}"),
                    ))
                }
            })
            .transpose()?;
        Ok(ResolvedParams {
            cache_threshold,
            balance_abs_threshold: self.balance_abs_threshold,
            balance_rel_threshold,
            host_cache_weight,
            host_cache_weight_source,
            respect_soft_affinity: self.respect_soft_affinity,
            soft_affinity_load_gate: self.soft_affinity_load_gate,
            soft_affinity_cache_gate: self.soft_affinity_cache_gate,
            soft_affinity_gate_abs: self
                .soft_affinity_gate_abs
                .unwrap_or(self.balance_abs_threshold),
            soft_affinity_gate_rel,
            load_signal: self.load_signal,
            kv_capacity_limit,
            tie_break: self.tie_break,
            room: self.room,
        })
    }
}

/// The host validates its own setting; re-check it so the decision can rely on a sane weight,
/// and blame the host setting rather than a policy key the operator never wrote.
fn host_setting_weight(weight: f64) -> Result<f64, CreateError> {
    if weight.is_finite() && weight >= 0.0 {
        Ok(weight)
    } else {
        Err(CreateError::failed(format!(
            "the host setting host_cache_hit_weight must be a finite number >= 0.0, got {weight}; \
             set `host_cache_weight` on this policy to override it"
        )))
    }
}

/// Parameter documentation for `router-host describe`.
pub fn docs() -> Vec<ParamDoc> {
    vec![
        ParamDoc::optional(
            "cache_threshold",
            "f64",
            "0.5",
            "cache tier fires when max effective overlap / request blocks is strictly above this; \
             finite, 0.0..=1.0",
        ),
        ParamDoc::optional(
            "balance_abs_threshold",
            "u64",
            "32",
            "load tier needs max - min active requests strictly above this; >= 0",
        ),
        ParamDoc::optional(
            "balance_rel_threshold",
            "f64",
            "1.1",
            "load tier also needs max strictly above this times min active requests; finite, >= 1.0",
        ),
        ParamDoc::optional(
            "host_cache_weight",
            "f64 or absent",
            "absent (the host's host_cache_hit_weight)",
            "weight of host-tier (CPU) overlap in the effective overlap; finite, >= 0.0",
        ),
        ParamDoc::optional(
            "respect_soft_affinity",
            "bool",
            "false",
            "keep a request on its soft-affinity target's rows when it has eligible ones",
        ),
        ParamDoc::optional(
            "soft_affinity_load_gate",
            "bool",
            "false",
            "release a kept target when its load exceeds the least-loaded row by both gates; \
             only meaningful with respect_soft_affinity",
        ),
        ParamDoc::optional(
            "soft_affinity_cache_gate",
            "bool",
            "true",
            "release a kept target when another row caches more of the prompt than the target's \
             row; only meaningful with respect_soft_affinity",
        ),
        ParamDoc::optional(
            "soft_affinity_gate_abs",
            "u64 or absent",
            "absent (balance_abs_threshold)",
            "absolute gap in active requests above which the gate releases; >= 0",
        ),
        ParamDoc::optional(
            "soft_affinity_gate_rel",
            "f64 or absent",
            "absent (balance_rel_threshold)",
            "ratio to the least-loaded row above which the gate releases; finite, >= 1.0",
        ),
        ParamDoc::optional(
            "load_signal",
            "string",
            "prefill_backlog",
            "least-loaded in the cache and fallback tiers: prefill_backlog (pending prefill \
             tokens plus the prompt tokens the row does not cache), or active_requests (Dynamo's)",
        ),
        ParamDoc::optional(
            "kv_capacity_limit",
            "f64 or absent",
            "absent (capacity ignored)",
            "the cache tier gives way to the least-loaded row with room when the best-cached \
             row's booked decode blocks plus this request's would pass this fraction of its KV \
             capacity (the host's kv_capacity_blocks column: workers[].total_kv_blocks, or \
             learned by serve from the engine's num_gpu_blocks), and a kept soft-affinity \
             target whose row would pass it is released; rows of unknown capacity are never \
             full; finite, > 0.0 (above 1.0 allows for prefix blocks that requests share)",
        ),
        ParamDoc::optional(
            "tie_break",
            "string",
            "spread",
            "rows every tier finds equal: spread (an order drawn from the request's prompt \
             length, block count and session id and each row's id, so idle equal rows share the \
             traffic) or lowest_row (the lowest worker id and rank, Dynamo's port as first \
             shipped)",
        ),
        ParamDoc::optional(
            "room",
            "string",
            "free",
            "under spread, rows equal on every tier rank first by room: free (KV capacity minus \
             indexed device blocks) or not_recent (capacity minus the blocks requests used \
             within the host's kv_recent_window_ms, plugin-api 1.5's kv_recent_device_blocks: a \
             new prefix goes where it evicts the least live work; free without that column)",
        ),
    ]
}
