//! What the core needs from a policy call, and what one decision is.
//!
//! The core never calls a policy itself: it hands a [`Selection`] and its signals to a
//! [`Selector`] (router-host's `Router`, which owns the loaded instances) and books the
//! [`Decision`] it returns. The rules a selector follows (eligibility, narrowing, bounds check,
//! fallback) are in `docs/routing-contract.md`.

use plugin_api::abi::{CompleteEvent, DispatchEvent, PickFailure, PickFailureKind};
use plugin_api::{Columns, Explanation, Inputs};

use crate::eligibility::EligibilityError;
use crate::model::{AffinityTarget, Cluster, Request, RowId, Signals};

/// Decides one request over a cluster snapshot; shared by every routing thread.
///
/// Implementations must book nothing and return only a row of the eligible set they computed
/// with [`crate::eligibility::eligible_rows`] (after bounds-checking any index a policy returned).
pub trait Selector: Send + Sync {
    fn select(
        &self,
        cluster: &Cluster,
        selection: Selection<'_>,
        signals: &dyn Signals,
        scratch: &mut Scratch,
    ) -> Result<Decision, SelectError>;

    /// Blocks a prompt of `isl_tokens` occupies (`ceil(isl / block_size)`).
    fn request_blocks(&self, isl_tokens: u64) -> u64;

    /// Tell `instance` where a request it decided was booked.
    fn notify_dispatch(&self, instance: InstanceId, event: &DispatchEvent<'_>);

    /// Tell `instance` that a request it was told about ended.
    fn notify_complete(&self, instance: InstanceId, event: &CompleteEvent<'_>);

    /// A name for `instance` in logs and errors.
    fn instance_name(&self, instance: InstanceId) -> &str;
}

/// Why one request got no row.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SelectError {
    #[error(transparent)]
    Eligibility(#[from] EligibilityError),
    #[error("instance `{instance}` ({origin}): {failure}")]
    Policy {
        instance: String,
        origin: String,
        failure: PolicyFailure,
    },
}

/// How a policy call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyFailure {
    #[error("policy returned an error: {0}")]
    Failed(String),
    #[error("policy panicked: {0}; the instance is poisoned")]
    Panicked(String),
    #[error("policy is poisoned after an earlier panic")]
    Poisoned,
    #[error("policy is quarantined after repeated picks over its time budget")]
    Quarantined,
    #[error("policy hung in {call}: it ran for {ran_ms} ms, past the instance's hang_after_ms of {hang_after_ms}; the instance is out of service")]
    Hung {
        call: &'static str,
        ran_ms: u64,
        hang_after_ms: u64,
    },
    #[error("policy returned row index {index}, but only {rows} rows were given")]
    OutOfRange { index: usize, rows: usize },
    #[error("host passed an inconsistent view: {0}")]
    BadView(String),
}

impl PolicyFailure {
    pub fn from_abi(failure: PickFailure) -> Self {
        let message = failure.message.to_string();
        match failure.kind {
            PickFailureKind::PANICKED => PolicyFailure::Panicked(message),
            PickFailureKind::POISONED => PolicyFailure::Poisoned,
            PickFailureKind::BAD_VIEW => PolicyFailure::BadView(message),
            _ => PolicyFailure::Failed(message),
        }
    }
}

/// Index of an instance in the selector's list (router-host's `Router::instances`).
pub type InstanceId = usize;

/// What selection decided for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub row: RowId,
    /// The instance configured for the request's role (told about dispatch and completion).
    pub instance: InstanceId,
    /// The instance whose pick this is: `instance`, or the built-in default on fallback.
    pub decided_by: InstanceId,
    /// Set when the configured instance failed and the built-in default decided instead.
    pub fallback: Option<PolicyFailure>,
    /// The deciding policy's explanation, when asked for.
    pub explanation: Option<Explanation>,
    /// Rows handed to the policy.
    pub candidates: usize,
    /// Wall-clock time of the policy call.
    pub pick_ns: u64,
}

/// What one successful, bounds-checked policy call returned.
#[derive(Debug, Clone, PartialEq)]
pub struct Pick {
    pub row: RowId,
    pub explanation: Option<Explanation>,
    /// Rows handed to the policy.
    pub candidates: usize,
    /// Wall-clock time of the policy call.
    pub pick_ns: u64,
}

impl Decision {
    /// The one way a decision is assembled: `decided_by`'s pick for a request configured to
    /// `instance` (they differ only on fallback, which `fallback` then explains).
    pub fn new(
        instance: InstanceId,
        decided_by: InstanceId,
        pick: Pick,
        fallback: Option<PolicyFailure>,
    ) -> Decision {
        Decision {
            row: pick.row,
            instance,
            decided_by,
            fallback,
            explanation: pick.explanation,
            candidates: pick.candidates,
            pick_ns: pick.pick_ns,
        }
    }
}

/// One request's routing inputs after the host applied session bindings.
#[derive(Debug, Clone, Copy)]
pub struct Selection<'a> {
    pub request: &'a Request,
    /// The row the request must go to: its pinned worker, or a hard session binding.
    pub pin: Option<RowId>,
    /// Advisory target: explicit, or from a soft session binding.
    pub target: Option<AffinityTarget>,
    /// Ask the deciding policy to explain itself (allocates; off the hot path).
    pub explain: bool,
}

impl<'a> Selection<'a> {
    /// The request's own pin and target, no session binding applied.
    pub fn of(request: &'a Request) -> Self {
        Selection {
            request,
            pin: request.pinned_worker,
            target: request.affinity_target,
            explain: false,
        }
    }

    pub fn explained(mut self) -> Self {
        self.explain = true;
        self
    }
}

/// Reusable buffers for one selecting thread: steady-state selection allocates nothing.
#[derive(Debug, Default)]
pub struct Scratch {
    /// The eligible rows.
    pub rows: Vec<RowId>,
    /// The rows handed to the policy (after narrowing).
    pub narrowed: Vec<RowId>,
    /// The columns lent to the policy.
    pub columns: Columns,
}

impl Scratch {
    /// The rows handed to the last policy called (after default-selector narrowing).
    pub fn last_candidates(&self) -> &[RowId] {
        &self.narrowed
    }

    /// Fill the columns `inputs` asks for, for `rows`.
    ///
    /// Each column is sized once and then written in place (no per-value capacity check); each
    /// row's load is read once for all of its columns, and the overlap of all rows in one call.
    pub fn materialise<S: Signals + ?Sized>(
        &mut self,
        rows: &[RowId],
        inputs: Inputs,
        signals: &S,
    ) {
        let c = &mut self.columns;
        c.worker_id.clear();
        c.dp_rank.clear();
        c.worker_id.extend(rows.iter().map(|r| r.worker_id));
        c.dp_rank.extend(rows.iter().map(|r| r.dp_rank));
        let cache = if inputs.contains(Inputs::CACHE) {
            rows.len()
        } else {
            0
        };
        fill(&mut c.device, cache);
        fill(&mut c.host, cache);
        fill(&mut c.disk, cache);
        if cache > 0 {
            signals.overlap_columns(rows, &mut c.device, &mut c.host, &mut c.disk);
        }
        let load = if inputs.contains(Inputs::LOAD) {
            rows.len()
        } else {
            0
        };
        fill(&mut c.available, load);
        fill(&mut c.active_requests, load);
        fill(&mut c.active_prefill_tokens, load);
        fill(&mut c.decode_blocks, load);
        if load > 0 {
            signals.load_columns(
                rows,
                &mut c.available,
                &mut c.active_requests,
                &mut c.active_prefill_tokens,
                &mut c.decode_blocks,
            );
        }
    }
}

/// Make `column` exactly `len` values long. The caller overwrites every value, so values left
/// from the previous request are not cleared first.
fn fill<T: Copy + Default>(column: &mut Vec<T>, len: usize) {
    column.truncate(len);
    column.resize(len, T::default());
}
