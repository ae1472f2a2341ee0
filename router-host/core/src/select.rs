//! What the core needs from a policy call, and what one decision is.
//!
//! The core never calls a policy itself: it hands a [`Selection`] and its signals to a
//! [`Selector`] (router-host's `PolicySet`, which owns the loaded instances) and books the
//! [`Decision`] it returns. The rules a selector follows (eligibility, narrowing, bounds check,
//! fallback) are in `docs/routing-contract.md`.

use abi_stable::std_types::RSlice;
use plugin_api::abi::{
    CompleteEvent, DispatchEvent, PickFailure, PickFailureKind, RawCandidateView,
};
use plugin_api::{
    Columns, Explanation, Inputs, KV_CAPACITY_BLOCKS, KV_INDEXED_DEVICE_BLOCKS,
    KV_INDEXED_DISK_BLOCKS, KV_INDEXED_HOST_BLOCKS, KV_INDEX_STATE, KV_RECENT_DEVICE_BLOCKS,
};

use crate::eligibility::EligibilityError;
use crate::ledger::Charge;
use crate::model::{AffinityTarget, Cluster, Fill, IdColumns, Request, RowId, Signals};

/// Decides one request over a cluster snapshot; shared by every routing thread.
///
/// Implementations must book nothing and return only a row of the eligible set they computed
/// with [`crate::eligibility::eligible`] (after bounds-checking any index a policy returned).
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

    /// What dispatching a request of `isl_tokens` books on its row (docs/routing-contract.md
    /// §7). `cached_blocks` returns the chosen row's device-tier overlap, the same value the
    /// decision read; call it only when the booking depends on it (it may walk the KV index).
    ///
    /// The default books the whole prompt ([`PrefillBooking::Prompt`]).
    fn charge(&self, isl_tokens: u64, cached_blocks: &dyn Fn() -> f64) -> Charge {
        let _ = cached_blocks;
        Charge {
            prefill_tokens: isl_tokens,
            decode_blocks: self.request_blocks(isl_tokens),
        }
    }

    /// Tell `instance` where a request it decided was booked.
    fn notify_dispatch(&self, instance: InstanceId, event: &DispatchEvent<'_>);

    /// Tell `instance` that a request it was told about ended.
    fn notify_complete(&self, instance: InstanceId, event: &CompleteEvent<'_>);

    /// A name for `instance` in logs and errors.
    fn instance_name(&self, instance: InstanceId) -> &str;
}

crate::spelled_enum! {
    /// How a dispatched request's prompt is booked as pending prefill (`active_prefill_tokens`,
    /// docs/routing-contract.md §7).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    pub enum PrefillBooking {
        /// The whole prompt, `isl_tokens`, whatever the row caches (the behaviour of 1.0 hosts).
        #[default]
        Prompt = "prompt",
        /// The prompt tokens the row has to compute: `isl_tokens` minus the row's device-tier
        /// overlap at decision time (`min(isl_tokens, overlap_blocks * block_size)`).
        Uncached = "uncached",
    }
}

impl PrefillBooking {
    /// Prompt tokens booked for a prompt of `isl_tokens` on a row holding `cached_blocks`
    /// leading blocks of it (asked only in [`PrefillBooking::Uncached`] mode). A fractional,
    /// negative or NaN overlap counts whole blocks only, at least 0; a cached partial last block
    /// counts as the prompt's remaining tokens, so a fully cached prompt books 0.
    pub fn prefill_tokens(
        self,
        isl_tokens: u64,
        block_size: u32,
        cached_blocks: &dyn Fn() -> f64,
    ) -> u64 {
        match self {
            PrefillBooking::Prompt => isl_tokens,
            PrefillBooking::Uncached => {
                // `as` saturates: NaN and negatives become 0, +infinity u64::MAX.
                let blocks = cached_blocks().floor() as u64;
                let cached = blocks.saturating_mul(u64::from(block_size.max(1)));
                isl_tokens - cached.min(isl_tokens)
            }
        }
    }
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
    #[error(
        "policy is quarantined after repeated decisions (pick + explain) over its time budget"
    )]
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

/// Index of an instance in the selector's list (router-host's `PolicySet::instances`).
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
    /// The deciding policy's explanation, when asked for. Boxed: it is rare on the request path,
    /// and a decision is moved several times there (unboxed it would double the size of every
    /// `Routed`).
    pub explanation: Option<Box<Explanation>>,
    /// Rows handed to the policy.
    pub candidates: usize,
    /// Wall-clock time of the policy call.
    pub pick_ns: u64,
}

/// What one successful, bounds-checked policy call returned.
#[derive(Debug, Clone, PartialEq)]
pub struct Pick {
    pub row: RowId,
    pub explanation: Option<Box<Explanation>>,
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
    /// The eligible rows, when they are not the whole cluster's (which are lent as they are:
    /// [`crate::eligibility::eligible`]).
    pub rows: Vec<RowId>,
    /// The soft target's rows, when the built-in default narrowed the eligible rows to them
    /// (otherwise the policy is handed the eligible rows themselves).
    pub narrowed: Vec<RowId>,
    /// The columns lent to the policy.
    pub columns: RowColumns,
}

/// Every per-row input a policy can be lent, by name: the candidate view's columns and the extra
/// columns. Adding a column is a field here, the fill in the source that knows the value
/// ([`Signals`] or [`crate::model::OverlapSource`]), and for an extra column its entry in
/// [`RowColumns::extra`].
///
/// Columns a fill reported all zero ([`Fill::Zeros`]) are not written: they are lent from one
/// shared column of zeros. So the policy's view is [`RowColumns::candidate_view`] and
/// [`RowColumns::extra`], never the fields of an offload tier or the index states directly.
#[derive(Debug, Default)]
pub struct RowColumns {
    /// The columns of the ABI's candidate view: ids, overlap (CACHE) and load (LOAD); `host`
    /// and `disk` are stale when the overlap's offload tiers were [`Fill::Zeros`], the ids
    /// when they were lent ([`Scratch::materialise`]).
    pub view: Columns,
    /// `kv_capacity_blocks`, sent with the LOAD columns; empty when no row's capacity is known
    /// (then it is not sent).
    pub kv_capacity_blocks: Vec<f64>,
    /// `kv_indexed_{device,host,disk}_blocks`, sent with the LOAD columns; empty when the
    /// overlap does not come from a KV index (then they are not sent).
    pub kv_indexed_blocks: [Vec<f64>; 3],
    /// `kv_index_state`, sent with the CACHE columns; empty when the overlap does not come from
    /// a KV index (then it is not sent, and plugins take every row as current).
    pub kv_index_state: Vec<f64>,
    /// `kv_recent_device_blocks`, sent with the LOAD columns, capped at each row's indexed
    /// device blocks; empty (not sent) without the indexed-blocks columns or a recent window.
    pub kv_recent_device_blocks: Vec<f64>,
    /// Rows of this decision.
    rows: usize,
    /// Which columns are lent from `zeros` this decision.
    zero: ZeroColumns,
    /// Zeros, at least as long as the rows of the last decision; never written otherwise.
    zeros: Vec<f64>,
}

/// The columns of one decision that are all zero and lent from [`RowColumns`]' zeros.
#[derive(Debug, Default, Clone, Copy)]
struct ZeroColumns {
    /// The overlap's `host` and `disk`.
    offload_overlap: bool,
    /// `kv_indexed_host_blocks` and `kv_indexed_disk_blocks` (sent beside the device's).
    offload_indexed: bool,
    /// `kv_index_state`: every row current.
    index_state: bool,
}

impl RowColumns {
    /// The ABI's candidate view with only the `inputs` column groups present, zero columns
    /// lent, and the id columns lent from `ids` when [`Scratch::materialise`] was given them
    /// (pass the same); its `extra_columns` are left empty (see [`RowColumns::extra`]).
    pub fn candidate_view<'a>(
        &'a self,
        inputs: Inputs,
        ids: Option<IdColumns<'a>>,
    ) -> RawCandidateView<'a> {
        let mut view = self.view.view(inputs);
        if let Some(ids) = ids {
            debug_assert_eq!(ids.worker_id.len(), self.rows, "ids of another decision");
            view.worker_id = RSlice::from_slice(ids.worker_id);
            view.dp_rank = RSlice::from_slice(ids.dp_rank);
        }
        if self.zero.offload_overlap && inputs.contains(Inputs::CACHE) {
            let zeros = RSlice::from_slice(self.zeros(self.rows));
            (view.host_blocks, view.disk_blocks) = (zeros, zeros);
        }
        view
    }

    /// The extra columns by their ABI names, in the order they are sent; an empty one is not
    /// sent.
    pub fn extra(&self) -> [(&'static str, &[f64]); 6] {
        let [device, mut host, mut disk] = self.kv_indexed_blocks.each_ref().map(Vec::as_slice);
        if self.zero.offload_indexed && !device.is_empty() {
            (host, disk) = (self.zeros(device.len()), self.zeros(device.len()));
        }
        let states = match self.zero.index_state {
            true => self.zeros(self.rows),
            false => &self.kv_index_state,
        };
        [
            (KV_CAPACITY_BLOCKS, &self.kv_capacity_blocks),
            (KV_INDEXED_DEVICE_BLOCKS, device),
            (KV_INDEXED_HOST_BLOCKS, host),
            (KV_INDEXED_DISK_BLOCKS, disk),
            (KV_INDEX_STATE, states),
            (KV_RECENT_DEVICE_BLOCKS, &self.kv_recent_device_blocks),
        ]
    }

    /// `n` zeros (`n` is at most the rows of this decision, which [`Scratch::materialise`]
    /// made room for).
    fn zeros(&self, n: usize) -> &[f64] {
        &self.zeros[..n.min(self.zeros.len())]
    }
}

impl Scratch {
    /// Fill the columns `inputs` asks for, for `rows`; the id columns only when `ids` (the
    /// same rows' ids, kept elsewhere: [`Cluster::id_columns_of`]) is `None`.
    ///
    /// Each column is sized once and then written in place (no per-value capacity check); each
    /// row's load is read once for all of its columns, and the overlap of all rows in one call.
    pub fn materialise<S: Signals + ?Sized>(
        &mut self,
        rows: &[RowId],
        ids: Option<IdColumns<'_>>,
        inputs: Inputs,
        signals: &S,
    ) {
        signals.columns_begin(rows);
        let zeros = &mut self.columns.zeros;
        if zeros.len() < rows.len() {
            zeros.resize(rows.len(), 0.0);
        }
        let mut zero = ZeroColumns::default();
        self.columns.rows = rows.len();
        let c = &mut self.columns.view;
        c.worker_id.clear();
        c.dp_rank.clear();
        if ids.is_none() {
            c.worker_id.extend(rows.iter().map(|r| r.worker_id));
            c.dp_rank.extend(rows.iter().map(|r| r.dp_rank));
        }
        let cache = if inputs.contains(Inputs::CACHE) {
            rows.len()
        } else {
            0
        };
        fill(&mut c.device, cache);
        fill(&mut c.host, cache);
        fill(&mut c.disk, cache);
        if cache > 0 {
            zero.offload_overlap = signals.overlap_columns(rows, c) == Fill::Zeros;
            zero.index_state = signals
                .kv_index_state_column(rows, &mut self.columns.kv_index_state)
                == Fill::Zeros;
        } else {
            self.columns.kv_index_state.clear();
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
        let extra = &mut self.columns;
        if load > 0 {
            signals.load_columns(rows, &mut extra.view);
            signals.kv_capacity_column(rows, &mut extra.kv_capacity_blocks);
            zero.offload_indexed =
                signals.kv_indexed_columns(rows, &mut extra.kv_indexed_blocks) == Fill::Zeros;
            recent_column(signals, rows, extra);
        } else {
            extra.kv_capacity_blocks.clear();
            extra.kv_indexed_blocks.iter_mut().for_each(Vec::clear);
            extra.kv_recent_device_blocks.clear();
        }
        self.columns.zero = zero;
        signals.columns_end();
    }
}

/// The `kv_recent_device_blocks` column: only beside the indexed device blocks, and never above
/// them (what the row no longer holds is not live cache, however recently it was used).
fn recent_column<S: Signals + ?Sized>(signals: &S, rows: &[RowId], extra: &mut RowColumns) {
    let recent = &mut extra.kv_recent_device_blocks;
    let indexed = &extra.kv_indexed_blocks[0];
    if indexed.len() != rows.len() {
        recent.clear();
        return;
    }
    signals.kv_recent_column(rows, recent);
    if recent.len() != rows.len() {
        recent.clear();
        return;
    }
    for (r, &held) in recent.iter_mut().zip(indexed) {
        *r = r.min(held);
    }
}

/// Make `column` exactly `len` values long. The caller overwrites every value, so values left
/// from the previous request are not cleared first.
fn fill<T: Copy + Default>(column: &mut Vec<T>, len: usize) {
    column.truncate(len);
    column.resize(len, T::default());
}

#[cfg(test)]
mod tests {
    use super::PrefillBooking;

    #[test]
    fn prompt_booking_books_the_whole_prompt_without_asking_for_overlap() {
        let asked = std::cell::Cell::new(false);
        let overlap = || {
            asked.set(true);
            3.0
        };
        assert_eq!(
            PrefillBooking::Prompt.prefill_tokens(1000, 16, &overlap),
            1000
        );
        assert!(!asked.get(), "prompt booking never walks the KV index");
    }

    #[test]
    fn uncached_booking_subtracts_whole_cached_blocks() {
        let uncached = |isl, block_size, blocks: f64| {
            PrefillBooking::Uncached.prefill_tokens(isl, block_size, &|| blocks)
        };
        // 1000 tokens of 16: 63 blocks, the last one partial (8 tokens).
        assert_eq!(uncached(1000, 16, 0.0), 1000);
        assert_eq!(uncached(1000, 16, 10.0), 840);
        assert_eq!(uncached(1000, 16, 62.0), 8);
        // The cached partial last block: nothing left to book.
        assert_eq!(uncached(1000, 16, 63.0), 0);
        assert_eq!(uncached(1000, 16, 1e9), 0);
        assert_eq!(uncached(1000, 16, f64::INFINITY), 0);
        // Fractions count whole blocks; what no row can hold counts as nothing cached.
        assert_eq!(uncached(1000, 16, 2.9), 968);
        assert_eq!(uncached(1000, 16, -4.0), 1000);
        assert_eq!(uncached(1000, 16, f64::NAN), 1000);
        // A block size of 0 (never configured, but not a division) counts as 1.
        assert_eq!(uncached(1000, 0, 10.0), 990);
        assert_eq!(uncached(u64::MAX, u32::MAX, 1e30), 0);
    }

    #[test]
    fn booking_modes_are_spelled_for_the_config() {
        for mode in PrefillBooking::ALL {
            assert_eq!(PrefillBooking::from_name(mode.as_str()), Some(mode));
            assert_eq!(mode.to_string(), mode.as_str());
        }
        assert_eq!(PrefillBooking::from_name("full"), None);
        assert_eq!(PrefillBooking::default(), PrefillBooking::Prompt);
    }
}
