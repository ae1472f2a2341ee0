//! The host's vocabulary: workers, rows, requests and the per-row signals policies see.

use std::collections::HashMap;

use plugin_api::Columns;

pub use plugin_api::{AffinityTarget, Role, RowId};

/// One engine process and its data-parallel ranks `dp_start .. dp_start + dp_size`.
#[derive(Debug, Clone, PartialEq)]
pub struct Worker {
    pub worker_id: u64,
    pub dp_start: u32,
    pub dp_size: u32,
    /// `false`: not serving (no endpoints).
    pub available: bool,
    /// Overloaded workers are excluded from selection.
    pub overloaded: bool,
    /// Draining: takes no new requests (not even pinned or session-bound ones); requests in
    /// flight finish. Set before a worker is removed.
    pub draining: bool,
    /// Prefill token budget per step, for queue admission; `None` = unknown (never busy).
    pub max_num_batched_tokens: Option<u64>,
    /// KV capacity in blocks, when known.
    pub total_kv_blocks: Option<u64>,
}

impl Worker {
    /// A serving worker with one rank.
    pub fn new(worker_id: u64) -> Self {
        Worker {
            worker_id,
            dp_start: 0,
            dp_size: 1,
            available: true,
            overloaded: false,
            draining: false,
            max_num_batched_tokens: None,
            total_kv_blocks: None,
        }
    }

    pub fn with_ranks(mut self, dp_start: u32, dp_size: u32) -> Self {
        self.dp_start = dp_start;
        self.dp_size = dp_size;
        self
    }

    /// Whether `rank` is one of this worker's ranks.
    pub fn has_rank(&self, rank: u32) -> bool {
        rank >= self.dp_start
            && u64::from(rank) < u64::from(self.dp_start) + u64::from(self.dp_size)
    }

    /// Every row of this worker, in rank order.
    pub fn rows(&self) -> impl Iterator<Item = RowId> + '_ {
        (0..self.dp_size).map(move |i| RowId {
            worker_id: self.worker_id,
            dp_rank: self.dp_start + i,
        })
    }
}

/// Most rows (the sum of every worker's `dp_size`) a cluster may have. Every request materialises
/// its eligible rows, so without a cap a single `dp_size` of billions would ask for gigabytes.
pub const MAX_ROWS: usize = 1 << 20;

/// Why a set of workers is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClusterError {
    #[error("{rows} rows in total (the sum of every dp_size), over the limit of {max}")]
    TooManyRows { rows: u64, max: usize },
    #[error("duplicate worker_id {0}")]
    DuplicateWorker(u64),
    #[error("worker {worker_id}: dp_size must be at least 1")]
    NoRanks { worker_id: u64 },
    #[error("worker {worker_id}: ranks {dp_start}..{dp_start}+{dp_size} overflow u32")]
    RankOverflow {
        worker_id: u64,
        dp_start: u32,
        dp_size: u32,
    },
}

/// The registered workers, sorted by id (so row order is deterministic). Immutable once made:
/// what is derived from the workers is worked out once, in [`Cluster::new`].
#[derive(Debug, Clone, PartialEq)]
pub struct Cluster {
    workers: Vec<Worker>,
    /// Every worker's rows, in order: the eligible rows when every worker is.
    rows: Vec<RowId>,
    /// `rows` as the candidate view's id columns, lent to a decision over every row.
    worker_ids: Vec<u64>,
    dp_ranks: Vec<u32>,
    /// Whether every worker is available, not draining and not overloaded.
    all_routable: bool,
}

/// The id columns of a run of rows (the candidate view's `worker_id` and `dp_rank`), borrowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdColumns<'a> {
    pub worker_id: &'a [u64],
    pub dp_rank: &'a [u32],
}

impl Default for Cluster {
    fn default() -> Self {
        Cluster {
            workers: Vec::new(),
            rows: Vec::new(),
            worker_ids: Vec::new(),
            dp_ranks: Vec::new(),
            all_routable: true,
        }
    }
}

impl Cluster {
    pub fn new(mut workers: Vec<Worker>) -> Result<Self, ClusterError> {
        let rows = workers
            .iter()
            .fold(0u64, |sum, w| sum.saturating_add(u64::from(w.dp_size)));
        if rows > MAX_ROWS as u64 {
            return Err(ClusterError::TooManyRows {
                rows,
                max: MAX_ROWS,
            });
        }
        workers.sort_by_key(|w| w.worker_id);
        for pair in workers.windows(2) {
            if pair[0].worker_id == pair[1].worker_id {
                return Err(ClusterError::DuplicateWorker(pair[0].worker_id));
            }
        }
        for w in &workers {
            if w.dp_size == 0 {
                return Err(ClusterError::NoRanks {
                    worker_id: w.worker_id,
                });
            }
            if w.dp_start.checked_add(w.dp_size).is_none() {
                return Err(ClusterError::RankOverflow {
                    worker_id: w.worker_id,
                    dp_start: w.dp_start,
                    dp_size: w.dp_size,
                });
            }
        }
        let rows: Vec<RowId> = workers.iter().flat_map(Worker::rows).collect();
        let worker_ids = rows.iter().map(|r| r.worker_id).collect();
        let dp_ranks = rows.iter().map(|r| r.dp_rank).collect();
        let all_routable = workers
            .iter()
            .all(|w| w.available && !w.draining && !w.overloaded);
        Ok(Cluster {
            workers,
            rows,
            worker_ids,
            dp_ranks,
            all_routable,
        })
    }

    /// The id columns of `rows` when they are this cluster's own [`Cluster::rows`] (the same
    /// slice, as eligibility lends it when every row is eligible): a decision over every row
    /// lends these instead of writing its own. `None` for any other slice.
    pub fn id_columns_of(&self, rows: &[RowId]) -> Option<IdColumns<'_>> {
        std::ptr::eq(rows, self.rows.as_slice()).then_some(IdColumns {
            worker_id: &self.worker_ids,
            dp_rank: &self.dp_ranks,
        })
    }

    /// Every worker's rows, in worker order then rank order.
    pub fn rows(&self) -> &[RowId] {
        &self.rows
    }

    /// Whether every worker is available, not draining and not overloaded (then, without an
    /// allow-list or a pin, every row is eligible).
    pub fn all_routable(&self) -> bool {
        self.all_routable
    }

    pub fn workers(&self) -> &[Worker] {
        &self.workers
    }

    pub fn worker(&self, worker_id: u64) -> Option<&Worker> {
        self.workers
            .binary_search_by_key(&worker_id, |w| w.worker_id)
            .ok()
            .map(|i| &self.workers[i])
    }

    /// Whether `row` names a registered worker and one of its ranks.
    pub fn has_row(&self, row: RowId) -> bool {
        self.worker(row.worker_id)
            .is_some_and(|w| w.has_rank(row.dp_rank))
    }

    /// Total number of rows.
    pub fn row_count(&self) -> usize {
        self.rows.len()
    }
}

/// One request to route.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Request {
    /// The caller's id for the request (unique among requests in flight); `None` = the core
    /// draws one from its own counter (single-process tools only: two processes would draw the
    /// same ids).
    pub id: Option<u64>,
    /// The prompt's block ids (`crate::blocks`), for overlap from the core's KV index.
    pub blocks: Vec<u64>,
    /// Prompt length in tokens.
    pub isl_tokens: u64,
    pub role: RequestRole,
    pub session_id: Option<String>,
    /// Explicit advisory target; when `None`, soft session affinity may supply one.
    pub affinity_target: Option<AffinityTarget>,
    /// Explicit pin: the only acceptable row.
    pub pinned_worker: Option<RowId>,
    /// Allow-list of worker ids; `None` = every worker.
    pub allowed_worker_ids: Option<Vec<u64>>,
    pub expected_output_tokens: Option<u64>,
    pub priority: i32,
    /// Queue-admission class (`policy_classes[].name`); `None` = the class named `default`, if
    /// configured, else no admission control.
    pub policy_class: Option<String>,
    /// A further leg of a request admission already let in (a retry after a leg that failed, a
    /// stream continuing on another row): it queues even past the queues' bound and is never
    /// shed, so work under way is not thrown away for requests not yet started. The bound still
    /// holds for first legs, and such legs are at most one per request in flight.
    pub continues: bool,
}

/// [`Role`] with a `Default` (aggregated), so requests can be built with `..Default::default()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum RequestRole {
    #[default]
    Aggregated,
    Prefill,
    Decode,
}

impl RequestRole {
    pub fn role(self) -> Role {
        match self {
            RequestRole::Aggregated => Role::Aggregated,
            RequestRole::Prefill => Role::Prefill,
            RequestRole::Decode => Role::Decode,
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }

    pub const ALL: [RequestRole; 3] = [
        RequestRole::Aggregated,
        RequestRole::Prefill,
        RequestRole::Decode,
    ];

    pub fn as_str(self) -> &'static str {
        self.role().as_str()
    }

    /// The role spelled `name` (`aggregated`, `prefill`, `decode`).
    pub fn from_name(name: &str) -> Option<RequestRole> {
        RequestRole::ALL.into_iter().find(|r| r.as_str() == name)
    }
}

/// Prompt blocks already cached on a row, per tier.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TierOverlap {
    pub device: f64,
    pub host: f64,
    pub disk: f64,
}

/// Load of one row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowLoad {
    /// `false`: no observation for this row (unknown, not idle).
    pub available: bool,
    pub active_requests: u64,
    pub active_prefill_tokens: u64,
    pub decode_blocks: u64,
}

impl Default for RowLoad {
    fn default() -> Self {
        RowLoad {
            available: true,
            active_requests: 0,
            active_prefill_tokens: 0,
            decode_blocks: 0,
        }
    }
}

/// Fill the load columns of `out` one row at a time (the default of [`Signals::load_columns`]).
pub fn load_columns_by_row(rows: &[RowId], out: &mut Columns, load: impl Fn(RowId) -> RowLoad) {
    let columns = (out.available.iter_mut())
        .zip(&mut out.active_requests)
        .zip(&mut out.active_prefill_tokens)
        .zip(&mut out.decode_blocks);
    for (&row, (((available, active), prefill), decode)) in rows.iter().zip(columns) {
        let l = load(row);
        (*available, *active, *prefill, *decode) = (
            l.available,
            l.active_requests,
            l.active_prefill_tokens,
            l.decode_blocks,
        );
    }
}

/// Fill the overlap columns of `out` one row at a time (the default of
/// [`OverlapSource::overlap_columns`]).
pub fn overlap_columns_by_row(
    rows: &[RowId],
    out: &mut Columns,
    overlap: impl Fn(RowId) -> TierOverlap,
) {
    let columns = (out.device.iter_mut())
        .zip(&mut out.host)
        .zip(&mut out.disk);
    for (&row, ((device, host), disk)) in rows.iter().zip(columns) {
        let o = overlap(row);
        (*device, *host, *disk) = (o.device, o.host, o.disk);
    }
}

/// No cache, no load: every row idle and cold.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoSignals;

impl OverlapSource for NoSignals {
    fn overlap(&self, _: RowId) -> TierOverlap {
        TierOverlap::default()
    }
}

impl Signals for NoSignals {
    fn load(&self, _: RowId) -> RowLoad {
        RowLoad::default()
    }
}

/// What a column fill did with columns that are often all zeros (the offload tiers of a
/// deployment without offload, the index states while every row is current): writing them would
/// cost a decision at thousands of rows more than pricing the rows does, so the caller lends one
/// shared column of zeros instead.
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fill {
    /// The columns were written.
    Written,
    /// Every value is 0, and the columns were not written.
    Zeros,
}

/// Per-row signals for the request being routed that the core does not own itself: prompt
/// overlap (from a KV index, or injected) and, for scripted scenarios, injected load. What a
/// caller hands the core; the core adds booked load to make the [`Signals`] selection reads.
pub trait OverlapSource {
    fn overlap(&self, row: RowId) -> TierOverlap;

    /// Load to use for `row` instead of the host's booked load (scenarios); `None` = booked.
    fn load_override(&self, row: RowId) -> Option<RowLoad> {
        let _ = row;
        None
    }

    /// Whether [`OverlapSource::load_override`] may return `Some` for any row (if not, load
    /// columns are read straight from the booked table).
    fn overrides_load(&self) -> bool {
        false
    }

    /// The overlap of every row of `rows` into `out`'s overlap columns (`device`, `host`,
    /// `disk`, each as long as `rows`). [`Fill::Zeros`]: no row holds any of the prompt on host
    /// or disk, and those two columns were left as they were. The default asks
    /// [`OverlapSource::overlap`] row by row; a source that computes all rows at once overrides
    /// it.
    fn overlap_columns(&self, rows: &[RowId], out: &mut Columns) -> Fill {
        overlap_columns_by_row(rows, out, |row| self.overlap(row));
        Fill::Written
    }

    /// How many blocks each row of `rows` holds on each tier (`out[t]` for tier `t` in
    /// [`Tier::ALL`](crate::kv_index::Tier::ALL) order, each made as long as `rows`), as the
    /// source's KV index knows them. Left empty when the source keeps no index (injected rows),
    /// and then no indexed-blocks columns are sent. [`Fill::Zeros`]: the index holds nothing
    /// on host or disk, and `out[1]` and `out[2]` were left as they were. The default keeps
    /// none.
    fn kv_indexed_columns(&self, rows: &[RowId], out: &mut [Vec<f64>; 3]) -> Fill {
        let _ = rows;
        out.iter_mut().for_each(Vec::clear);
        Fill::Written
    }

    /// Each row's [`plugin_api::KvIndexState`] code (`kv_index_state`), `out` made as long as
    /// `rows`, when the overlap comes from a KV index whose rows have a trust state. Left empty
    /// otherwise (injected rows), and then no column is sent: every row counts as current.
    /// [`Fill::Zeros`]: every row is current (code 0), and `out` was left as it was.
    fn kv_index_state_column(&self, rows: &[RowId], out: &mut Vec<f64>) -> Fill {
        let _ = rows;
        out.clear();
        Fill::Written
    }

    /// `row`'s KV index state (what [`OverlapSource::kv_index_state_column`] sends for it);
    /// current for sources without states.
    fn kv_index_state(&self, row: RowId) -> plugin_api::KvIndexState {
        let _ = row;
        plugin_api::KvIndexState::Current
    }

    /// The column fills up to [`OverlapSource::columns_end`] are for `rows`, which the caller
    /// keeps borrowed and unchanged until then: a source may look each row up once for all of
    /// them. A fill for any other slice still gets that slice's own answer.
    fn columns_begin(&self, rows: &[RowId]) {
        let _ = rows;
    }

    /// The fills announced by [`OverlapSource::columns_begin`] are done; forget its rows.
    fn columns_end(&self) {}

    /// `Some(base)` when the announced `rows` are, in `topology`, exactly the slots `base,
    /// base + 1, ...` (then a slot-indexed table is read as one slice). `None` when the source
    /// does not know, `rows` are not the announced ones, or they are not such a run.
    fn slot_run(&self, rows: &[RowId], topology: &crate::topology::Topology) -> Option<u32> {
        let _ = (rows, topology);
        None
    }
}

/// Everything selection reads per row: the request's overlap (as an [`OverlapSource`], so the
/// overlap methods are defined once) and each row's load.
pub trait Signals: OverlapSource {
    fn load(&self, row: RowId) -> RowLoad;

    /// The load of every row of `rows` into `out`'s load columns (`available`,
    /// `active_requests`, `active_prefill_tokens`, `decode_blocks`, each as long as `rows`). The
    /// default asks [`Signals::load`] row by row; a source that can walk its table in row order
    /// overrides it.
    fn load_columns(&self, rows: &[RowId], out: &mut Columns) {
        load_columns_by_row(rows, out, |row| self.load(row));
    }

    /// The KV capacity in blocks of every row of `rows` into `out`, made as long as `rows`
    /// (`NaN` for a row whose capacity is unknown); `out` is left empty when no row's capacity
    /// is known, and then no capacity column is sent. The default knows none.
    fn kv_capacity_column(&self, rows: &[RowId], out: &mut Vec<f64>) {
        let _ = rows;
        out.clear();
    }

    /// How many blocks requests routed to each row of `rows` used or stored within the recent
    /// window (`crate::recency`), into `out`, made as long as `rows`; left empty when nothing
    /// tracks it, and then no `kv_recent_device_blocks` column is sent. The default tracks
    /// nothing.
    fn kv_recent_column(&self, rows: &[RowId], out: &mut Vec<f64>) {
        let _ = rows;
        out.clear();
    }
}

/// No cached prefix anywhere.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoOverlap;

impl OverlapSource for NoOverlap {
    fn overlap(&self, _: RowId) -> TierOverlap {
        TierOverlap::default()
    }
}

/// Rows injected by a caller (e.g. a `select` scenario): they override overlap and load.
pub type InjectedRows = HashMap<RowId, (TierOverlap, RowLoad)>;

impl OverlapSource for InjectedRows {
    fn overlap(&self, row: RowId) -> TierOverlap {
        self.get(&row).map(|(o, _)| *o).unwrap_or_default()
    }

    fn load_override(&self, row: RowId) -> Option<RowLoad> {
        self.get(&row).map(|(_, l)| *l)
    }

    fn overrides_load(&self) -> bool {
        !self.is_empty()
    }
}
