//! Policies built into the host: the `default` selector (docs/configuration.md) and the cache-blind
//! baselines `round-robin` and `random`.
//!
//! They implement the same `plugin_api::Policy` trait as plugins and are boxed through the same
//! adapter, so the host calls every policy the same way. The one thing that sets `default` apart
//! (the host narrows its rows to an eligible soft target) is decided by the router, not here.

use std::sync::atomic::{AtomicU64, Ordering};

use plugin_api::{
    check, Context, CreateError, Explanation, Inputs, ParamDoc, Parameters, PickError, Policy,
    RowId, Rows,
};
use serde::Deserialize;

use crate::loader::PolicyTypeDoc;
use crate::rng::{mix, GOLDEN_GAMMA};

/// Host settings a built-in needs at creation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BuiltinSettings {
    pub host_cache_hit_weight: f64,
    pub disk_cache_hit_weight: f64,
    pub prefill_load_scale: f64,
    pub decode_active_request_weight: f64,
}

/// Policy types shipped with the host as plugins, each with the plugin name (`export_plugin!`'s
/// `name`) of the plugin that ships it. Another library exporting one of these names shadows the
/// shipped policy: allowed, but warned about ([`crate::policies::ShadowedType`]). A built-in's
/// name ([`Builtin::type_name`]) cannot be exported by any library.
pub const SHIPPED_PLUGIN_TYPES: &[(&str, &str)] =
    &[("dynamo-two-tier-cost-fn", "two-tier-cost-fn")];

/// The plugin that ships policy type `type_name`, if it is a shipped one.
pub fn shipped_plugin_of(type_name: &str) -> Option<&'static str> {
    SHIPPED_PLUGIN_TYPES
        .iter()
        .find(|(name, _)| *name == type_name)
        .map(|(_, plugin)| *plugin)
}

/// The built-in policy types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Builtin {
    Default,
    RoundRobin,
    Random,
}

impl Builtin {
    pub const ALL: [Builtin; 3] = [Builtin::Default, Builtin::RoundRobin, Builtin::Random];

    pub fn type_name(self) -> &'static str {
        match self {
            Builtin::Default => "default",
            Builtin::RoundRobin => "round-robin",
            Builtin::Random => "random",
        }
    }

    pub fn from_type_name(name: &str) -> Option<Builtin> {
        Self::ALL.into_iter().find(|b| b.type_name() == name)
    }

    pub fn doc(self) -> PolicyTypeDoc {
        let (summary, parameters) = match self {
            Builtin::Default => (
                "Lowest prefill+decode cost after cache credit (design §7); narrows to an eligible soft target",
                vec![
                    ParamDoc::optional("prefill_load_scale", "f64", "host default_selector.prefill_load_scale (1.0)", "weight of the uncached prefill blocks; finite, >= 0"),
                    ParamDoc::optional("decode_active_request_weight", "f64", "host default_selector.decode_active_request_weight (0.0)", "weight of active requests; finite, >= 0"),
                ],
            ),
            Builtin::RoundRobin => (
                "Cache-blind baseline: cycles through the eligible rows",
                vec![],
            ),
            Builtin::Random => (
                "Cache-blind baseline: a seeded pseudo-random eligible row",
                vec![ParamDoc::optional("seed", "u64", "0", "seed of the generator")],
            ),
        };
        PolicyTypeDoc {
            name: self.type_name().to_string(),
            summary: summary.to_string(),
            parameters,
        }
    }

    /// Validate parameters and box an instance.
    pub fn create(
        self,
        parameters_json: &str,
        settings: &BuiltinSettings,
    ) -> Result<plugin_api::abi::PolicyBox, CreateError> {
        let params = Parameters::from_json(parameters_json);
        match self {
            Builtin::Default => {
                #[derive(Deserialize)]
                #[serde(deny_unknown_fields)]
                struct P {
                    prefill_load_scale: Option<f64>,
                    decode_active_request_weight: Option<f64>,
                }
                let p: P = params.parse()?;
                let selector = DefaultSelector {
                    host_weight: settings.host_cache_hit_weight,
                    disk_weight: settings.disk_cache_hit_weight,
                    prefill_load_scale: check::finite_at_least(
                        "prefill_load_scale",
                        p.prefill_load_scale.unwrap_or(settings.prefill_load_scale),
                        0.0,
                    )?,
                    decode_active_request_weight: check::finite_at_least(
                        "decode_active_request_weight",
                        p.decode_active_request_weight
                            .unwrap_or(settings.decode_active_request_weight),
                        0.0,
                    )?,
                };
                plugin_api::export::into_policy_box(selector)
            }
            Builtin::RoundRobin => {
                #[derive(Deserialize)]
                #[serde(deny_unknown_fields)]
                struct P {}
                let _: P = params.parse()?;
                plugin_api::export::into_policy_box(RoundRobin {
                    next: AtomicU64::new(0),
                })
            }
            Builtin::Random => {
                #[derive(Deserialize)]
                #[serde(deny_unknown_fields)]
                struct P {
                    #[serde(default)]
                    seed: u64,
                }
                let p: P = params.parse()?;
                plugin_api::export::into_policy_box(Random {
                    state: AtomicU64::new(p.seed),
                })
            }
        }
    }
}

/// Design §7.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DefaultSelector {
    pub host_weight: f64,
    pub disk_weight: f64,
    pub prefill_load_scale: f64,
    pub decode_active_request_weight: f64,
}

impl DefaultSelector {
    fn cost(&self, ctx: &Context<'_>, rows: &Rows<'_>, i: usize) -> f64 {
        let (Some(overlap), Some(load)) = (rows.overlap(), rows.load()) else {
            return 0.0;
        };
        let credit = overlap.device[i]
            + self.host_weight * overlap.host[i]
            + self.disk_weight * overlap.disk[i];
        let block_size = f64::from(ctx.block_size().max(1));
        let prefill = ((load.active_prefill_tokens[i] as f64 + ctx.prompt_tokens() as f64)
            / block_size
            - credit)
            .max(0.0);
        self.prefill_load_scale * prefill
            + load.decode_blocks[i] as f64
            + self.decode_active_request_weight * load.active_requests[i] as f64
    }

    fn best(&self, ctx: &Context<'_>, rows: &Rows<'_>) -> Option<(usize, f64)> {
        let mut best: Option<(usize, f64, RowId)> = None;
        for i in 0..rows.len() {
            let cost = self.cost(ctx, rows, i);
            let id = rows.row(i);
            let better = match best {
                None => true,
                Some((_, c, bid)) => cost < c || (cost == c && id < bid),
            };
            if better {
                best = Some((i, cost, id));
            }
        }
        best.map(|(i, c, _)| (i, c))
    }
}

impl Policy for DefaultSelector {
    fn inputs(&self) -> Inputs {
        Inputs::CACHE | Inputs::LOAD
    }

    fn pick(&self, ctx: &Context<'_>, rows: &Rows<'_>) -> Result<usize, PickError> {
        self.best(ctx, rows)
            .map(|(i, _)| i)
            .ok_or_else(|| PickError::new("no rows"))
    }

    fn explain(&self, ctx: &Context<'_>, rows: &Rows<'_>) -> Option<Explanation> {
        let (i, cost) = self.best(ctx, rows)?;
        Some(
            Explanation::new(i, "lowest_cost")
                .field("cost", cost)
                .field("rows", rows.len() as f64)
                .field("prefill_load_scale", self.prefill_load_scale)
                .field(
                    "decode_active_request_weight",
                    self.decode_active_request_weight,
                )
                .field("host_cache_hit_weight", self.host_weight)
                .field("disk_cache_hit_weight", self.disk_weight),
        )
    }
}

/// Cycles through the rows it is given (shared counter across threads).
#[derive(Debug)]
pub struct RoundRobin {
    next: AtomicU64,
}

impl Policy for RoundRobin {
    fn inputs(&self) -> Inputs {
        Inputs::NONE
    }

    fn pick(&self, _: &Context<'_>, rows: &Rows<'_>) -> Result<usize, PickError> {
        if rows.is_empty() {
            return Err(PickError::new("no rows"));
        }
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        Ok((n % rows.len() as u64) as usize)
    }
}

/// Seeded pseudo-random row (splitmix64 over a shared atomic state).
#[derive(Debug)]
pub struct Random {
    state: AtomicU64,
}

impl Policy for Random {
    fn inputs(&self) -> Inputs {
        Inputs::NONE
    }

    fn pick(&self, _: &Context<'_>, rows: &Rows<'_>) -> Result<usize, PickError> {
        if rows.is_empty() {
            return Err(PickError::new("no rows"));
        }
        let state = self
            .state
            .fetch_add(GOLDEN_GAMMA, Ordering::Relaxed)
            .wrapping_add(GOLDEN_GAMMA);
        let z = mix(state);
        Ok((z % rows.len() as u64) as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use plugin_api::testing::{TestRequest, TestRow, TestRows};

    fn selector() -> DefaultSelector {
        DefaultSelector {
            host_weight: 0.75,
            disk_weight: 0.25,
            prefill_load_scale: 1.0,
            decode_active_request_weight: 0.0,
        }
    }

    #[test]
    fn default_prefers_cache_credit_then_breaks_ties_on_lowest_row() {
        let request = TestRequest::new(160, 16);
        // 10 blocks of prompt; worker 41 holds 6 on device: cost 4 vs 10.
        let rows = TestRows::new(vec![TestRow::new(29, 0), TestRow::new(41, 0).device(6.0)]);
        assert_eq!(
            rows.pick_worker(&selector(), &request).unwrap().worker_id,
            41
        );
        // Host tier counts at 0.75: 8 host blocks = 6 credit; disk at 0.25.
        let rows = TestRows::new(vec![
            TestRow::new(29, 0).disk(8.0),
            TestRow::new(41, 0).host(8.0),
        ]);
        assert_eq!(
            rows.pick_worker(&selector(), &request).unwrap().worker_id,
            41
        );
        // Equal cost: lowest (worker, rank) whatever the row order.
        let rows = TestRows::new(vec![
            TestRow::new(41, 1),
            TestRow::new(41, 0),
            TestRow::new(50, 0),
        ]);
        assert_eq!(
            rows.pick_worker(&selector(), &request).unwrap(),
            RowId {
                worker_id: 41,
                dp_rank: 0
            }
        );
    }

    #[test]
    fn default_cost_counts_prefill_backlog_and_decode_blocks() {
        let request = TestRequest::new(160, 16);
        // 29: (160+160)/16 = 20 prefill; 41: 10 prefill + 11 decode blocks = 21.
        let rows = TestRows::new(vec![
            TestRow::new(29, 0).prefill_tokens(160),
            TestRow::new(41, 0).decode_blocks(11),
        ]);
        assert_eq!(
            rows.pick_worker(&selector(), &request).unwrap().worker_id,
            29
        );
        let explanation = rows.explain(&selector(), &request).unwrap();
        assert_eq!(explanation.reason, "lowest_cost");
        assert_eq!(explanation.get("cost"), Some(20.0));
    }

    #[test]
    fn default_rejects_bad_parameters_by_key() {
        let settings = BuiltinSettings {
            host_cache_hit_weight: 0.75,
            disk_cache_hit_weight: 0.25,
            prefill_load_scale: 1.0,
            decode_active_request_weight: 0.0,
        };
        let err = Builtin::Default
            .create(r#"{"prefill_load_scale": -1}"#, &settings)
            .err()
            .unwrap();
        assert_eq!(err.key(), "prefill_load_scale");
        let err = Builtin::RoundRobin
            .create(r#"{"speed": 1}"#, &settings)
            .err()
            .unwrap();
        assert_eq!(err.key(), "speed");
    }

    #[test]
    fn round_robin_cycles_and_random_is_seeded() {
        let rows = TestRows::new(vec![
            TestRow::new(1, 0),
            TestRow::new(2, 0),
            TestRow::new(3, 0),
        ]);
        let request = TestRequest::new(16, 16);
        let rr = RoundRobin {
            next: AtomicU64::new(0),
        };
        let picks: Vec<usize> = (0..6).map(|_| rows.pick(&rr, &request).unwrap()).collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        let sequence = |seed| {
            let r = Random {
                state: AtomicU64::new(seed),
            };
            (0..32)
                .map(|_| rows.pick(&r, &request).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(sequence(7), sequence(7));
        assert_ne!(sequence(7), sequence(8));
        assert!((0..3).all(|i| sequence(7).contains(&i)));
    }
}
