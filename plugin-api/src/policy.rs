//! The safe authoring layer: what a policy author implements and reads.

use std::fmt;

use abi_stable::std_types::ROption;

pub use crate::abi::RowId;
use crate::abi::{
    Extension, ExtensionValue, Inputs, RawCandidateView, RawRequestContext, RoleCode,
};

/// Request role (a.k.a. stage).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    Aggregated,
    Prefill,
    Decode,
    /// A role added by a newer host than this plugin was built for.
    Other(u8),
}

impl Role {
    /// The ABI code of this role.
    pub fn code(self) -> RoleCode {
        match self {
            Role::Aggregated => RoleCode::AGGREGATED,
            Role::Prefill => RoleCode::PREFILL,
            Role::Decode => RoleCode::DECODE,
            Role::Other(code) => RoleCode(code),
        }
    }

    /// The role for an ABI code.
    pub fn from_code(code: RoleCode) -> Role {
        match code {
            RoleCode::AGGREGATED => Role::Aggregated,
            RoleCode::PREFILL => Role::Prefill,
            RoleCode::DECODE => Role::Decode,
            RoleCode(other) => Role::Other(other),
        }
    }

    /// The YAML / JSON spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Aggregated => "aggregated",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Other(_) => "other",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Advisory affinity target. `dp_rank: None` is a worker-level target (every rank matches).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AffinityTarget {
    pub worker_id: u64,
    pub dp_rank: Option<u32>,
}

impl AffinityTarget {
    /// The match rule of the design: same worker, and same rank unless the target is worker-level.
    #[inline]
    pub fn matches(&self, row: RowId) -> bool {
        row.worker_id == self.worker_id && self.dp_rank.is_none_or(|rank| rank == row.dp_rank)
    }
}

impl From<AffinityTarget> for crate::abi::RawAffinityTarget {
    fn from(t: AffinityTarget) -> Self {
        crate::abi::RawAffinityTarget {
            worker_id: t.worker_id,
            dp_rank: t.dp_rank.into(),
        }
    }
}

/// The request being routed, as the host describes it. Cheap to copy; borrowed for one call.
#[derive(Clone, Copy)]
pub struct Context<'a> {
    raw: &'a RawRequestContext<'a>,
}

impl<'a> Context<'a> {
    /// Wrap the ABI context (done by the adapter; tests use [`crate::testing`]).
    #[inline]
    pub fn from_raw(raw: &'a RawRequestContext<'a>) -> Self {
        Context { raw }
    }

    /// The ABI context this wraps.
    pub fn raw(&self) -> &'a RawRequestContext<'a> {
        self.raw
    }

    /// Prompt length in tokens (ISL).
    #[inline]
    pub fn prompt_tokens(&self) -> u64 {
        self.raw.prompt_tokens
    }

    /// `ceil(prompt_tokens / block_size)`.
    #[inline]
    pub fn request_blocks(&self) -> u64 {
        self.raw.request_blocks
    }

    /// Tokens per KV block.
    #[inline]
    pub fn block_size(&self) -> u32 {
        self.raw.block_size
    }

    #[inline]
    pub fn role(&self) -> Role {
        Role::from_code(self.raw.role)
    }

    /// The advisory soft-affinity target, if the request has one. It may match no row.
    #[inline]
    pub fn affinity_target(&self) -> Option<AffinityTarget> {
        match self.raw.affinity_target {
            ROption::RSome(t) => Some(AffinityTarget {
                worker_id: t.worker_id,
                dp_rank: t.dp_rank.into_option(),
            }),
            ROption::RNone => None,
        }
    }

    /// The row the caller pinned; when set, the host has already reduced the rows to it.
    #[inline]
    pub fn pinned_worker(&self) -> Option<RowId> {
        self.raw.pinned_worker.into_option()
    }

    #[inline]
    pub fn session_id(&self) -> Option<&'a str> {
        match self.raw.session_id {
            ROption::RSome(s) => Some(s.as_str()),
            ROption::RNone => None,
        }
    }

    #[inline]
    pub fn expected_output_tokens(&self) -> Option<u64> {
        self.raw.expected_output_tokens.into_option()
    }

    #[inline]
    pub fn priority(&self) -> i32 {
        self.raw.priority
    }

    /// A value added to the context by a newer 1.x host, by name.
    pub fn extension(&self, name: &str) -> Option<ExtensionValue<'a>> {
        find_extension(self.raw.extensions.as_slice(), name)
    }
}

pub(crate) fn find_extension<'a>(list: &[Extension<'a>], name: &str) -> Option<ExtensionValue<'a>> {
    list.iter()
        .find(|e| e.name.as_str() == name)
        .map(|e| e.value)
}

impl fmt::Debug for Context<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("prompt_tokens", &self.prompt_tokens())
            .field("request_blocks", &self.request_blocks())
            .field("block_size", &self.block_size())
            .field("role", &self.role())
            .field("affinity_target", &self.affinity_target())
            .field("pinned_worker", &self.pinned_worker())
            .field("session_id", &self.session_id())
            .field("expected_output_tokens", &self.expected_output_tokens())
            .field("priority", &self.priority())
            .finish()
    }
}

/// Overlap columns: leading prompt blocks already cached on each row, per tier.
#[derive(Debug, Clone, Copy)]
pub struct Overlap<'a> {
    pub device: &'a [f64],
    pub host: &'a [f64],
    pub disk: &'a [f64],
}

/// Load columns of each row.
#[derive(Debug, Clone, Copy)]
pub struct Load<'a> {
    /// `false`: the host has no load observation for this row (unknown, not idle).
    pub available: &'a [bool],
    pub active_requests: &'a [u64],
    pub active_prefill_tokens: &'a [u64],
    pub decode_blocks: &'a [u64],
}

/// Name of the extra column (since 1.2) holding each row's KV-cache capacity in blocks (the
/// router-host takes the configured `workers[].total_kv_blocks`, else what the engine reports);
/// `NaN` where unknown. Hosts send it with the LOAD columns when they know any row's capacity.
pub const KV_CAPACITY_BLOCKS: &str = "kv_capacity_blocks";

/// Names of the extra columns (since 1.3) holding how many blocks each row's cache holds on the
/// device, host and disk tiers, as the host's KV index knows them from the engines' KV events
/// (stored minus evicted; blocks in use by running requests included). Hosts send them with the
/// LOAD columns when they keep a KV index; read them with [`Rows::kv_indexed_blocks`].
pub const KV_INDEXED_DEVICE_BLOCKS: &str = "kv_indexed_device_blocks";
/// See [`KV_INDEXED_DEVICE_BLOCKS`].
pub const KV_INDEXED_HOST_BLOCKS: &str = "kv_indexed_host_blocks";
/// See [`KV_INDEXED_DEVICE_BLOCKS`].
pub const KV_INDEXED_DISK_BLOCKS: &str = "kv_indexed_disk_blocks";

/// Name of the extra column (since 1.4) holding how far the host trusts each row's KV index: a
/// [`KvIndexState`] code per row (`0.0` current). Hosts send it with the CACHE columns when the
/// overlap comes from a KV index they keep (serve, replay; not injected `select` scenarios);
/// read it with [`Rows::kv_index_trust`].
pub const KV_INDEX_STATE: &str = "kv_index_state";

/// Name of the extra column (since 1.5) holding, per row, how many of its indexed device blocks
/// ([`KV_INDEXED_DEVICE_BLOCKS`]) requests routed to it used or stored within the host's recent
/// window (router-host: `kv_recent_window_ms`): the part of its cache that is live work. So
/// `capacity - recent` is what a row can take without evicting a cache some request used
/// lately. An estimate, never above the row's indexed device blocks. Hosts send it with the
/// LOAD columns when they keep a KV index and the window is on; read it with
/// [`Rows::kv_recent_device_blocks`].
pub const KV_RECENT_DEVICE_BLOCKS: &str = "kv_recent_device_blocks";

/// Name of the context extension (since 1.5) (a `U64`) a host may send with a `pick` it will ask to
/// explain: the same value on that `pick` and on the `explain` that follows it over the same
/// input, and never again with another input. A policy may keep what its `pick` found under the
/// token and describe that in `explain` instead of deciding again (a large fleet's decision
/// scans every row); without a token, or with another one, `explain` decides again. router-host
/// sends it whenever it asks for an explanation (`serve`: on every request).
pub const EXPLAIN_TOKEN: &str = "explain_token";

/// How far the host's KV index of a row can be trusted (the [`KV_INDEX_STATE`] column).
///
/// Only [`KvIndexState::Current`] overlap is what the row's engine caches as far as the host
/// can know; on the other states the built-in policies and two-tier read the row's overlap as
/// zero (load-only there). A code this crate does not know (from a newer host) reads as
/// [`KvIndexState::Unknown`].
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvIndexState {
    /// Events arrive in sequence and on time (also: the index is fed directly, as in replay).
    #[default]
    Current = 0,
    /// Nothing known yet: before the first event after the subscriber (re)connected.
    Unknown = 1,
    /// A gap in the event sequence that replay could not fill: entries may be missing or
    /// evicted already, until the host clears the row or the engine clears its cache.
    Stale = 2,
    /// Events arrive, but older than the host's bound (`kv_events.max_lag_ms`).
    Lagging = 3,
}

impl KvIndexState {
    pub const ALL: [KvIndexState; 4] = [
        KvIndexState::Current,
        KvIndexState::Unknown,
        KvIndexState::Stale,
        KvIndexState::Lagging,
    ];

    /// The state's code as sent in the [`KV_INDEX_STATE`] column.
    #[inline]
    pub fn code(self) -> f64 {
        f64::from(self as u8)
    }

    /// The state of a column value; anything but a known code (NaN, a newer host's code) is
    /// [`KvIndexState::Unknown`].
    #[inline]
    pub fn from_code(code: f64) -> KvIndexState {
        if code == 0.0 {
            KvIndexState::Current
        } else if code == 2.0 {
            KvIndexState::Stale
        } else if code == 3.0 {
            KvIndexState::Lagging
        } else {
            KvIndexState::Unknown
        }
    }

    /// The state of a `u8` code (as kept per row by hosts); unknown codes as in
    /// [`KvIndexState::from_code`].
    #[inline]
    pub fn from_u8(code: u8) -> KvIndexState {
        KvIndexState::from_code(f64::from(code))
    }

    /// Its spelling in metrics, logs and `/ready`.
    pub fn as_str(self) -> &'static str {
        match self {
            KvIndexState::Current => "current",
            KvIndexState::Unknown => "unknown",
            KvIndexState::Stale => "stale",
            KvIndexState::Lagging => "lagging",
        }
    }

    /// Whether a policy should use the row's overlap.
    #[inline]
    pub fn is_current(self) -> bool {
        self == KvIndexState::Current
    }
}

impl fmt::Display for KvIndexState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The reason suffix a policy appends when it read some row's overlap as zero because that
/// row's KV index was not current ([`IndexTrust::discounted`]): `lowest_cost` becomes
/// `lowest_cost_kv_load_only`.
pub const KV_LOAD_ONLY_SUFFIX: &str = "_kv_load_only";

/// Each row's [`KvIndexState`], read once per call ([`Rows::kv_index_trust`]). Without the
/// column (hosts older than 1.4, injected scenarios) every row is current.
#[derive(Debug, Clone, Copy, Default)]
pub struct IndexTrust<'a> {
    codes: Option<&'a [f64]>,
}

/// Whether every code is `current` (0; `-0.0` too, as [`IndexTrust::trusted`] reads it). One
/// pass without an early exit, so that it vectorises.
fn all_current(codes: &[f64]) -> bool {
    !codes.iter().fold(false, |off, &code| off | (code != 0.0))
}

impl<'a> IndexTrust<'a> {
    /// Every row current (what a host without the column means).
    pub const ALL_CURRENT: IndexTrust<'static> = IndexTrust { codes: None };

    /// Whether every row is current (then [`IndexTrust::overlap`] is the value itself, and a
    /// scan can skip the per-row check).
    #[inline]
    pub fn all_current(&self) -> bool {
        self.codes.is_none()
    }

    /// Row `i`'s state.
    #[inline]
    pub fn state(&self, i: usize) -> KvIndexState {
        match self.codes {
            None => KvIndexState::Current,
            Some(codes) => codes
                .get(i)
                .map_or(KvIndexState::Unknown, |&c| KvIndexState::from_code(c)),
        }
    }

    /// Whether row `i`'s overlap may be used (its index is current). Hot path: one compare.
    #[inline]
    pub fn trusted(&self, i: usize) -> bool {
        match self.codes {
            None => true,
            Some(codes) => codes.get(i).is_some_and(|&c| c == 0.0),
        }
    }

    /// `value` where row `i` is trusted, else 0.
    #[inline]
    pub fn overlap(&self, i: usize, value: f64) -> f64 {
        if self.trusted(i) {
            value
        } else {
            0.0
        }
    }

    /// The rows whose overlap a policy read as zero although the index said they cache some of
    /// the prompt: `(index, state)`. Empty when every row is current. For explanations (off
    /// the hot path).
    pub fn discounted(&self, rows: &Rows<'_>) -> Vec<(usize, KvIndexState)> {
        let (Some(overlap), Some(_)) = (rows.overlap(), self.codes) else {
            return Vec::new();
        };
        (0..rows.len())
            .filter(|&i| !self.trusted(i))
            .filter(|&i| overlap.device[i] > 0.0 || overlap.host[i] > 0.0 || overlap.disk[i] > 0.0)
            .map(|i| (i, self.state(i)))
            .collect()
    }

    /// Add to `e` what [`IndexTrust::discounted`] found, if anything: the reason gets
    /// [`KV_LOAD_ONLY_SUFFIX`], and the label `kv_load_only` lists the rows as
    /// `worker:rank=state`. Unchanged when every row with overlap is current.
    pub fn explain(&self, rows: &Rows<'_>, mut e: Explanation) -> Explanation {
        let discounted = self.discounted(rows);
        if discounted.is_empty() {
            return e;
        }
        let list: Vec<String> = discounted
            .iter()
            .map(|&(i, state)| {
                let row = rows.row(i);
                format!("{}:{}={state}", row.worker_id, row.dp_rank)
            })
            .collect();
        e.reason.push_str(KV_LOAD_ONLY_SUFFIX);
        e.labels.push(("kv_load_only".to_owned(), list.join(",")));
        e
    }
}

/// What each row's cache holds, per tier, in blocks ([`Rows::kv_indexed_blocks`]).
#[derive(Debug, Clone, Copy)]
pub struct IndexedBlocks<'a> {
    pub device: &'a [f64],
    pub host: &'a [f64],
    pub disk: &'a [f64],
}

/// The eligible rows, as index-aligned columns. Row order is unspecified: never depend on it.
#[derive(Debug, Clone, Copy)]
pub struct Rows<'a> {
    worker_id: &'a [u64],
    dp_rank: &'a [u32],
    overlap: Option<Overlap<'a>>,
    load: Option<Load<'a>>,
    raw: &'a RawCandidateView<'a>,
}

/// The view's columns do not line up (a host bug, reported instead of trusted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ViewError(pub String);

impl<'a> Rows<'a> {
    /// Check and wrap the ABI view: every present column must have one value per row.
    #[inline]
    pub fn from_raw(raw: &'a RawCandidateView<'a>) -> Result<Self, ViewError> {
        let n = raw.worker_id.len();
        let same = |len: usize, what: &str| {
            if len == n {
                Ok(())
            } else {
                Err(ViewError(format!(
                    "column `{what}` has {len} values for {n} rows"
                )))
            }
        };
        same(raw.dp_rank.len(), "dp_rank")?;
        let overlap = if raw.present.contains(Inputs::CACHE) {
            same(raw.device_blocks.len(), "device_blocks")?;
            same(raw.host_blocks.len(), "host_blocks")?;
            same(raw.disk_blocks.len(), "disk_blocks")?;
            Some(Overlap {
                device: raw.device_blocks.as_slice(),
                host: raw.host_blocks.as_slice(),
                disk: raw.disk_blocks.as_slice(),
            })
        } else {
            None
        };
        let load = if raw.present.contains(Inputs::LOAD) {
            same(raw.available.len(), "available")?;
            same(raw.active_requests.len(), "active_requests")?;
            same(raw.active_prefill_tokens.len(), "active_prefill_tokens")?;
            same(raw.decode_blocks.len(), "decode_blocks")?;
            Some(Load {
                available: raw.available.as_slice(),
                active_requests: raw.active_requests.as_slice(),
                active_prefill_tokens: raw.active_prefill_tokens.as_slice(),
                decode_blocks: raw.decode_blocks.as_slice(),
            })
        } else {
            None
        };
        Ok(Rows {
            worker_id: raw.worker_id.as_slice(),
            dp_rank: raw.dp_rank.as_slice(),
            overlap,
            load,
            raw,
        })
    }

    /// Number of rows.
    #[inline]
    pub fn len(&self) -> usize {
        self.worker_id.len()
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.worker_id.is_empty()
    }

    /// Identity of row `i`. Panics if `i >= len()`, like slice indexing.
    #[inline]
    pub fn row(&self, i: usize) -> RowId {
        RowId {
            worker_id: self.worker_id[i],
            dp_rank: self.dp_rank[i],
        }
    }

    #[inline]
    pub fn worker_ids(&self) -> &'a [u64] {
        self.worker_id
    }

    #[inline]
    pub fn dp_ranks(&self) -> &'a [u32] {
        self.dp_rank
    }

    /// Overlap columns; `Some` exactly when the policy declared [`Inputs::CACHE`].
    #[inline]
    pub fn overlap(&self) -> Option<Overlap<'a>> {
        self.overlap
    }

    /// Load columns; `Some` exactly when the policy declared [`Inputs::LOAD`].
    #[inline]
    pub fn load(&self) -> Option<Load<'a>> {
        self.load
    }

    /// Each row's KV-cache capacity in blocks (the [`KV_CAPACITY_BLOCKS`] extra column); `NaN`
    /// for a row whose capacity the host does not know. `None` from hosts older than 1.2, and
    /// when the host knows no row's capacity.
    #[inline]
    pub fn kv_capacity_blocks(&self) -> Option<&'a [f64]> {
        self.extra_column(KV_CAPACITY_BLOCKS)
    }

    /// How many blocks each row's cache holds per tier (the `kv_indexed_*_blocks` extra
    /// columns). Against [`Rows::kv_capacity_blocks`] it says how full each row's cache is, so a
    /// policy can send a new prefix where it evicts least. `None` from hosts older than 1.3 and
    /// from hosts that keep no KV index (injected `select` scenarios).
    pub fn kv_indexed_blocks(&self) -> Option<IndexedBlocks<'a>> {
        Some(IndexedBlocks {
            device: self.extra_column(KV_INDEXED_DEVICE_BLOCKS)?,
            host: self.extra_column(KV_INDEXED_HOST_BLOCKS)?,
            disk: self.extra_column(KV_INDEXED_DISK_BLOCKS)?,
        })
    }

    /// How many of each row's indexed device blocks were used or stored recently (the
    /// [`KV_RECENT_DEVICE_BLOCKS`] extra column). `None` from hosts older than 1.5, from hosts
    /// that keep no KV index, and when the host's recent window is off.
    #[inline]
    pub fn kv_recent_device_blocks(&self) -> Option<&'a [f64]> {
        self.extra_column(KV_RECENT_DEVICE_BLOCKS)
    }

    /// Each row's [`KvIndexState`] (the [`KV_INDEX_STATE`] column): every row current from
    /// hosts older than 1.4 and when the host keeps no KV index (injected scenarios). A column
    /// in which every row is current reads as no column (one pass over it here), so that the
    /// per-row checks of a large fleet's decision cost nothing in the common case.
    #[inline]
    pub fn kv_index_trust(&self) -> IndexTrust<'a> {
        IndexTrust {
            codes: self
                .extra_column(KV_INDEX_STATE)
                .filter(|codes| !all_current(codes)),
        }
    }

    /// A per-row signal added by a newer 1.x host, by name.
    pub fn extra_column(&self, name: &str) -> Option<&'a [f64]> {
        self.raw
            .extra_columns
            .as_slice()
            .iter()
            .find(|c| c.name.as_str() == name)
            .map(|c| c.values.as_slice())
            .filter(|values| values.len() == self.len())
    }

    /// Indices of the rows matching an affinity target.
    pub fn matching(&self, target: AffinityTarget) -> impl Iterator<Item = usize> + 'a {
        let (workers, ranks) = (self.worker_id, self.dp_rank);
        (0..workers.len()).filter(move |&i| {
            target.matches(RowId {
                worker_id: workers[i],
                dp_rank: ranks[i],
            })
        })
    }
}

/// Error a policy returns from `pick`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PickError {
    message: String,
}

impl PickError {
    pub fn new(message: impl Into<String>) -> Self {
        PickError {
            message: message.into(),
        }
    }

    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for PickError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for PickError {}

/// Why a policy picked a row: a stable reason string plus named numbers and labels.
#[derive(Debug, Clone, PartialEq)]
pub struct Explanation {
    pub row: usize,
    pub reason: String,
    pub fields: Vec<(String, f64)>,
    pub labels: Vec<(String, String)>,
}

impl Explanation {
    pub fn new(row: usize, reason: impl Into<String>) -> Self {
        Explanation {
            row,
            reason: reason.into(),
            fields: Vec::new(),
            labels: Vec::new(),
        }
    }

    /// Add a named number.
    pub fn field(mut self, name: impl Into<String>, value: f64) -> Self {
        self.fields.push((name.into(), value));
        self
    }

    /// Add a named label.
    pub fn label(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.push((name.into(), value.into()));
        self
    }

    /// Look up a named number.
    pub fn get(&self, name: &str) -> Option<f64> {
        self.fields.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
    }

    /// Look up a named label.
    pub fn get_label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// A worker-selection policy instance: the one trait a policy author implements.
///
/// The host calls `pick` once per request with the **full eligible row set** (only the columns
/// declared by [`Policy::inputs`]) and an advisory affinity target in the context. The returned
/// index is bounds-checked by the host; an error or panic books nothing. Instances are shared
/// across threads: keep state behind atomics or locks.
pub trait Policy: Send + Sync + 'static {
    /// Which column groups to materialise. Read once, when the instance is created.
    fn inputs(&self) -> Inputs;

    /// Choose one row; return its index in `rows`.
    fn pick(&self, ctx: &Context<'_>, rows: &Rows<'_>) -> Result<usize, PickError>;

    /// Explain the decision `pick` would make on the same input. Called only when the host wants
    /// a trace (`router-host select`, debug logging); may allocate.
    fn explain(&self, ctx: &Context<'_>, rows: &Rows<'_>) -> Option<Explanation> {
        let _ = (ctx, rows);
        None
    }

    /// Since 1.1: the host booked a request this instance was asked to route (on the row it
    /// picked, or on the fallback's row). Use it to track in-flight work or sessions. Keep it
    /// cheap: it runs on the request path.
    fn on_dispatch(&self, event: &Dispatch<'_>) {
        let _ = event;
    }

    /// Since 1.1: a request reported by [`Policy::on_dispatch`] finished.
    fn on_complete(&self, event: &Completion<'_>) {
        let _ = event;
    }
}

/// A booked request (see [`Policy::on_dispatch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dispatch<'a> {
    /// The host's id for the request; its [`Completion`] carries the same id.
    pub request_id: u64,
    pub row: RowId,
    pub session_id: Option<&'a str>,
    pub prompt_tokens: u64,
    /// `true` when this instance failed for the request and the host's fallback chose `row`.
    pub fallback: bool,
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    Completed,
    Failed,
    Cancelled,
    /// An outcome added by a newer host than this plugin was built for.
    Other(u8),
}

impl Outcome {
    pub fn from_code(code: crate::abi::CompletionCode) -> Outcome {
        use crate::abi::CompletionCode as C;
        match code {
            C::COMPLETED => Outcome::Completed,
            C::FAILED => Outcome::Failed,
            C::CANCELLED => Outcome::Cancelled,
            C(other) => Outcome::Other(other),
        }
    }

    pub fn code(self) -> crate::abi::CompletionCode {
        use crate::abi::CompletionCode as C;
        match self {
            Outcome::Completed => C::COMPLETED,
            Outcome::Failed => C::FAILED,
            Outcome::Cancelled => C::CANCELLED,
            Outcome::Other(code) => C(code),
        }
    }
}

/// A finished request (see [`Policy::on_complete`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion<'a> {
    pub request_id: u64,
    pub row: RowId,
    pub session_id: Option<&'a str>,
    pub outcome: Outcome,
}

#[cfg(test)]
mod tests {
    use super::all_current;

    /// The vectorised pass reads a code as `code == 0.0` does, for every kind of `f64`, in every
    /// lane and in the scalar tail.
    #[test]
    fn all_current_is_every_code_equal_to_zero() {
        let odd = [
            -0.0,
            f64::MIN_POSITIVE,
            -f64::MIN_POSITIVE,
            f64::from_bits(1),
            f64::from_bits(1 | (1 << 63)),
            f64::NAN,
            -f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            1.0,
            2.0,
            3.0,
            -1.0,
        ];
        assert!(all_current(&[]));
        assert!(all_current(&[0.0; 67]));
        for code in odd {
            // Alone, and at each place in a run long enough for the vectorised loop's lanes
            // and its scalar tail.
            assert_eq!(all_current(&[code]), code == 0.0, "{code:e}");
            for at in 0..67 {
                let mut codes = [0.0; 67];
                codes[at] = code;
                assert_eq!(all_current(&codes), code == 0.0, "{code:e} at {at}");
            }
        }
    }
}
