//! What the core's contract tests share: a selector of their own whose every choice follows from
//! the numbers, hooks that count what the core told the policy, and short builders.
//!
//! Not every test binary uses every item.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use plugin_api::abi::{CompleteEvent, CompletionCode, DispatchEvent};
use plugin_api::Inputs;
use router_core::admission::{AdmissionMode, ClassSpec};
use router_core::eligibility::eligible_rows;
use router_core::model::{Cluster, RowId, Signals, Worker};
use router_core::routing::{CoreSettings, RoutingCore};
use router_core::select::{Decision, InstanceId, Scratch, SelectError, Selection, Selector};

/// Tokens per KV block in [`Cheapest::request_blocks`].
pub const BLOCK_TOKENS: u64 = 16;

/// Prefill tokens that weigh as much as one active request in [`Cheapest`]'s cost.
pub const PREFILL_TOKENS_PER_REQUEST: f64 = 1024.0;

/// Picks the eligible row with the lowest cost, the lowest row on a tie; the cost is
/// `active_requests + active_prefill_tokens / 1024 - cached`, where `cached` is the share of the
/// prompt's blocks the row holds on the device. With `follow_target` it keeps to the advisory
/// target (a soft session binding) when any of its rows is eligible, choosing among them (a
/// worker-level target leaves the rank free). It allocates nothing once its scratch has grown,
/// so it can stand in for a policy in the no-allocation tests.
#[derive(Default)]
pub struct Cheapest {
    pub follow_target: bool,
    pub hooks: Hooks,
}

impl Cheapest {
    /// Hooks that also record every request id (allocates per request: not for the
    /// no-allocation tests).
    pub fn tracking(follow_target: bool) -> Self {
        Cheapest {
            follow_target,
            hooks: Hooks {
                per_id: Some(Mutex::new(HashMap::new())),
                ..Hooks::default()
            },
        }
    }

    pub fn following_targets() -> Self {
        Cheapest {
            follow_target: true,
            ..Cheapest::default()
        }
    }
}

/// What the core told the policy: counts, and per request id (when tracking) how many dispatch
/// and completion hooks it got.
#[derive(Default)]
pub struct Hooks {
    pub dispatched: AtomicU64,
    pub completed: AtomicU64,
    /// Completions with outcome `FAILED` (also counted in `completed`).
    pub failed: AtomicU64,
    per_id: Option<Mutex<HashMap<u64, (u32, u32)>>>,
}

impl Hooks {
    pub fn dispatched(&self) -> u64 {
        self.dispatched.load(Ordering::SeqCst)
    }

    pub fn completed(&self) -> u64 {
        self.completed.load(Ordering::SeqCst)
    }

    pub fn failed(&self) -> u64 {
        self.failed.load(Ordering::SeqCst)
    }

    /// Per request id: (dispatch hooks, completion hooks); empty unless tracking.
    pub fn per_id(&self) -> HashMap<u64, (u32, u32)> {
        self.per_id.as_ref().map_or_else(HashMap::new, |m| {
            m.lock().unwrap_or_else(PoisonError::into_inner).clone()
        })
    }

    fn note(&self, id: u64, f: impl FnOnce(&mut (u32, u32))) {
        if let Some(map) = &self.per_id {
            f(map
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(id)
                .or_default());
        }
    }
}

impl Selector for Cheapest {
    fn select(
        &self,
        cluster: &Cluster,
        selection: Selection<'_>,
        signals: &dyn Signals,
        scratch: &mut Scratch,
    ) -> Result<Decision, SelectError> {
        eligible_rows(cluster, selection.request, selection.pin, &mut scratch.rows)?;
        let candidates = scratch.rows.len();
        let decided = |row| Decision {
            row,
            instance: 0,
            decided_by: 0,
            fallback: None,
            explanation: None,
            candidates,
            pick_ns: 0,
        };
        // Taken out and put back (a move, no allocation): `materialise` borrows the scratch.
        let rows = std::mem::take(&mut scratch.rows);
        scratch.materialise(&rows, None, Inputs::CACHE | Inputs::LOAD, signals);
        let target = selection.target.filter(|_| self.follow_target);
        let on_target = |r: &RowId| {
            target.is_some_and(|t| {
                r.worker_id == t.worker_id && t.dp_rank.is_none_or(|d| d == r.dp_rank)
            })
        };
        let only_target = rows.iter().any(on_target);
        let c = &scratch.columns.view;
        let prompt_blocks = self.request_blocks(selection.request.isl_tokens).max(1) as f64;
        let mut best = (f64::INFINITY, rows[0]);
        for (i, &row) in rows.iter().enumerate() {
            if only_target && !on_target(&row) {
                continue;
            }
            let cost = c.active_requests[i] as f64
                + c.active_prefill_tokens[i] as f64 / PREFILL_TOKENS_PER_REQUEST
                - c.device[i] / prompt_blocks;
            if cost < best.0 {
                best = (cost, row);
            }
        }
        scratch.rows = rows;
        Ok(decided(best.1))
    }

    fn request_blocks(&self, isl_tokens: u64) -> u64 {
        isl_tokens.div_ceil(BLOCK_TOKENS)
    }

    fn notify_dispatch(&self, _: InstanceId, event: &DispatchEvent<'_>) {
        self.hooks.dispatched.fetch_add(1, Ordering::SeqCst);
        self.hooks.note(event.request_id, |n| n.0 += 1);
    }

    fn notify_complete(&self, _: InstanceId, event: &CompleteEvent<'_>) {
        self.hooks.completed.fetch_add(1, Ordering::SeqCst);
        if event.outcome == CompletionCode::FAILED {
            self.hooks.failed.fetch_add(1, Ordering::SeqCst);
        }
        self.hooks.note(event.request_id, |n| n.1 += 1);
    }

    fn instance_name(&self, _: InstanceId) -> &str {
        "cheapest"
    }
}

pub fn row(worker_id: u64, dp_rank: u32) -> RowId {
    RowId { worker_id, dp_rank }
}

/// A worker whose batch size is known (so class thresholds apply to it).
pub fn sized(worker_id: u64) -> Worker {
    let mut w = Worker::new(worker_id);
    w.max_num_batched_tokens = Some(1000);
    w
}

/// The class every request without one falls into.
pub fn default_class(prefill_busy_threshold: u64, max_wait: Option<Duration>) -> ClassSpec {
    ClassSpec {
        name: "default".to_owned(),
        prefill_busy_threshold: Some(prefill_busy_threshold),
        prefill_busy_threshold_frac: None,
        mode: AdmissionMode::AnyEligible,
        max_wait,
        ..ClassSpec::default()
    }
}

/// A core over `workers` deciding with `selector`.
pub fn core_of(
    selector: Arc<Cheapest>,
    workers: Vec<Worker>,
    settings: CoreSettings,
) -> RoutingCore {
    let cluster = Cluster::new(workers).expect("a valid cluster");
    RoutingCore::new(selector, cluster, settings)
}
