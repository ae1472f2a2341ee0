//! The two-tier decision (docs/policies/two-tier-cost-fn.md), shared by `pick` and `explain`.
//!
//! Allocation-free: a row set is a predicate over row indices, and each tier run is one pass.

use plugin_api::{ties, AffinityTarget, IndexTrust, PickError, RowId, Rows};

use crate::params::{LoadSignal, ResolvedParams};

/// Which rule chose a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// Active requests too uneven: least-loaded row.
    LoadImbalance,
    /// A row caches enough of the prompt: least-loaded row among the best-cached ones.
    Cache,
    /// Neither tier fired: least-loaded row.
    LeastLoaded,
    /// The cache tier fired, but its row would pass `kv_capacity_limit` of its KV capacity: the
    /// least-loaded row that would not.
    OverKvCapacity,
    /// The load tier fired, but its row would pass `kv_capacity_limit`: the least-loaded row
    /// that would not.
    LoadImbalanceOverKvCapacity,
    /// Neither tier fired, and the least-loaded row would pass `kv_capacity_limit`: the
    /// least-loaded row that would not.
    LeastLoadedOverKvCapacity,
}

impl Tier {
    /// The stable reason string of this tier.
    pub fn reason(self) -> &'static str {
        match self {
            Tier::LoadImbalance => "load_imbalance_least_loaded",
            Tier::Cache => "cache_tier_least_loaded_among_max_overlap",
            Tier::LeastLoaded => "least_loaded_no_cache_winner",
            Tier::OverKvCapacity => "cache_row_over_kv_capacity_least_loaded",
            Tier::LoadImbalanceOverKvCapacity => "load_imbalance_row_over_kv_capacity_least_loaded",
            Tier::LeastLoadedOverKvCapacity => "least_loaded_row_over_kv_capacity_least_loaded",
        }
    }

    /// The tier that replaced this one's row for being over `kv_capacity_limit`.
    fn over_kv_capacity(self) -> Tier {
        match self {
            Tier::LoadImbalance => Tier::LoadImbalanceOverKvCapacity,
            Tier::Cache => Tier::OverKvCapacity,
            Tier::LeastLoaded => Tier::LeastLoadedOverKvCapacity,
            replaced => replaced,
        }
    }
}

/// The result of running both tiers over one row set.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TierDecision {
    /// Index of the chosen row.
    pub row: usize,
    /// Active requests of the chosen row: `load(K)` when this is the target's decision.
    pub row_active: u64,
    pub tier: Tier,
    pub min_active: u64,
    pub max_active: u64,
    /// Highest `device + host_cache_weight * host` in the set.
    pub max_effective_overlap: f64,
    /// Least-loaded row among those with the highest effective overlap (the cache tier's pick).
    pub max_overlap_row: usize,
    /// `max_effective_overlap / request_blocks` (0 when the request has no blocks).
    pub cache_ratio: f64,
}

/// What soft affinity did to the decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SoftAffinity {
    /// No target, or `respect_soft_affinity` is off.
    None,
    /// The target's rows decided.
    Kept,
    /// The target was too loaded compared with the least-loaded row; the all-rows decision won.
    ReleasedByGate,
    /// The target's row would pass `kv_capacity_limit` of its KV capacity by more blocks than
    /// moving throws away, and the all-rows decision's row would not pass it; the all-rows
    /// decision won.
    ReleasedByKvCapacity,
    /// The all-rows decision's row caches more of the prompt than the target's row
    /// (`soft_affinity_cache_gate`): staying would prefill what that row holds; it won.
    ReleasedByCache,
    /// No eligible row matches the target; the all-rows decision won.
    NotEligible,
}

impl SoftAffinity {
    pub fn as_str(self) -> &'static str {
        match self {
            SoftAffinity::None => "none",
            SoftAffinity::Kept => "kept",
            SoftAffinity::ReleasedByGate => "released_by_gate",
            SoftAffinity::ReleasedByKvCapacity => "released_by_kv_capacity",
            SoftAffinity::ReleasedByCache => "released_by_cache",
            SoftAffinity::NotEligible => "not_eligible",
        }
    }
}

/// The whole decision for one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    /// Index of the chosen row.
    pub row: usize,
    /// G: the decision over every row.
    pub all: TierDecision,
    /// K: the decision over the target's rows, when soft affinity is respected and a row matches.
    pub target: Option<TierDecision>,
    pub soft_affinity: SoftAffinity,
}

impl Decision {
    /// The stable reason string for the explanation.
    pub fn reason(&self) -> &'static str {
        match self.soft_affinity {
            SoftAffinity::Kept => "soft_affinity_target",
            SoftAffinity::ReleasedByGate => "soft_affinity_released_load_gate",
            SoftAffinity::ReleasedByKvCapacity => "soft_affinity_released_kv_capacity",
            SoftAffinity::ReleasedByCache => "soft_affinity_released_cache",
            SoftAffinity::None | SoftAffinity::NotEligible => self.all.tier.reason(),
        }
    }

    /// The tier run whose row was chosen.
    pub fn deciding(&self) -> &TierDecision {
        match (self.soft_affinity, &self.target) {
            (SoftAffinity::Kept, Some(target)) => target,
            _ => &self.all,
        }
    }
}

/// The columns the decision reads, checked present once per call.
#[derive(Debug, Clone, Copy)]
pub struct Columns<'a> {
    worker_id: &'a [u64],
    dp_rank: &'a [u32],
    device: &'a [f64],
    host: &'a [f64],
    active: &'a [u64],
    prefill: &'a [u64],
    decode: &'a [u64],
    /// The host's `kv_capacity_blocks` column, when it sent one.
    kv_capacity: Option<&'a [f64]>,
    /// What [`ties::room_rank`] reads, when the host sent the indexed blocks.
    room: Option<ties::RoomColumns<'a>>,
    /// Each row's KV-index state: a row not current has no overlap here (load-only).
    trust: IndexTrust<'a>,
}

/// What the request asks of a row, for [`LoadSignal::PrefillBacklog`]: its prompt tokens and
/// tokens per block; and how it breaks ties.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Prompt {
    pub tokens: u64,
    pub block_size: u32,
    /// The request's key under `tie_break: spread` ([`ties::request_key`]); `None` under
    /// `lowest_row`.
    pub spread: Option<u64>,
}

/// The order among rows every tier finds equal: lower wins. Under `spread`, more free KV blocks
/// first, then the request's spread rank ([`plugin_api::ties`]); the row id comes last, so keys
/// are total. Under `lowest_row` the first two parts are always 0.
pub type Tie = (i64, u64, RowId);

impl<'a> Columns<'a> {
    /// The overlap and load columns of `rows`; an error if the host left either out.
    pub fn from_rows(rows: &Rows<'a>) -> Result<Self, PickError> {
        let overlap = rows
            .overlap()
            .ok_or_else(|| PickError::new("overlap columns missing (CACHE was declared)"))?;
        let load = rows
            .load()
            .ok_or_else(|| PickError::new("load columns missing (LOAD was declared)"))?;
        Ok(Columns {
            worker_id: rows.worker_ids(),
            dp_rank: rows.dp_ranks(),
            device: overlap.device,
            host: overlap.host,
            active: load.active_requests,
            prefill: load.active_prefill_tokens,
            decode: load.decode_blocks,
            kv_capacity: rows.kv_capacity_blocks(),
            room: ties::RoomColumns::of(rows),
            trust: rows.kv_index_trust(),
        })
    }

    /// Rank room as capacity minus the recently used blocks (`room: not_recent`), when the
    /// host sends them.
    pub fn with_room_not_recent(mut self, rows: &Rows<'a>) -> Self {
        self.room = ties::RoomColumns::not_recent(rows);
        self
    }

    fn len(&self) -> usize {
        self.worker_id.len()
    }

    /// The same columns, each cut to exactly `len()` values. `Rows` already guarantees one value
    /// per row in every column, so nothing is cut; but a scan over the returned copy indexes all
    /// five with `i < len()` without a bounds check per column.
    #[inline]
    fn exact(&self) -> Columns<'a> {
        let n = self.len();
        Columns {
            worker_id: self.worker_id,
            dp_rank: &self.dp_rank[..n],
            device: &self.device[..n],
            host: &self.host[..n],
            active: &self.active[..n],
            prefill: &self.prefill[..n],
            // Read once per decision at most (not by the scan): not worth a bounds check here.
            decode: self.decode,
            kv_capacity: self.kv_capacity,
            room: self.room,
            trust: self.trust,
        }
    }

    /// Whether row `i`, given `request_blocks` more, would hold more than `limit` of its KV
    /// capacity in booked decode blocks. Never for a row of unknown capacity.
    fn over_kv_capacity(&self, i: usize, request_blocks: u64, limit: f64) -> bool {
        self.kv_overflow(i, request_blocks, limit) > 0.0
    }

    /// How many booked blocks row `i`, given `request_blocks` more, would hold beyond `limit`
    /// of its KV capacity: what its cache must evict (or wait for) to take the request. 0 when
    /// within, and for a row of unknown capacity.
    fn kv_overflow(&self, i: usize, request_blocks: u64, limit: f64) -> f64 {
        let (Some(capacity), Some(&booked)) = (
            self.kv_capacity.and_then(|c| c.get(i).copied()),
            self.decode.get(i),
        ) else {
            return 0.0;
        };
        let over = booked.saturating_add(request_blocks) as f64 - limit * capacity;
        // NaN (unknown capacity) compares false.
        if over > 0.0 {
            over
        } else {
            0.0
        }
    }

    /// Whether moving the request from row `from`, over `limit`, to row `to` costs less cache
    /// than staying: the prompt blocks `from` caches beyond what `to` caches (re-prefilled and
    /// stored again elsewhere if it moves) against `from`'s overflow (evicted from others, or
    /// waited for, if it stays). Strict: a tie stays.
    fn worth_moving(
        &self,
        from: usize,
        to: usize,
        request_blocks: u64,
        limit: f64,
        w: f64,
    ) -> bool {
        let thrown_away = self.effective_overlap(from, w) - self.effective_overlap(to, w);
        thrown_away < self.kv_overflow(from, request_blocks, limit)
    }

    #[inline]
    pub fn row(&self, i: usize) -> RowId {
        RowId {
            worker_id: self.worker_id[i],
            dp_rank: self.dp_rank[i],
        }
    }

    /// Row `i`'s place among equal rows.
    #[inline]
    fn tie(&self, i: usize, prompt: Prompt) -> Tie {
        let row = self.row(i);
        match prompt.spread {
            None => (0, 0, row),
            Some(request) => (
                self.room.as_ref().map_or(0, |room| room.rank(i)),
                ties::spread_rank(request, row),
                row,
            ),
        }
    }

    #[inline]
    pub fn active(&self, i: usize) -> u64 {
        self.active[i]
    }

    /// `device + weight * host`. A NaN (no meaningful overlap) counts as nothing cached, which
    /// also keeps the comparisons below total; so does a row whose KV index is not current
    /// (every tier, the soft-affinity cache gate and `kv_capacity_limit`'s move rule read the
    /// overlap here).
    #[inline]
    fn effective_overlap(&self, i: usize, host_weight: f64) -> f64 {
        self.effective_overlap_in::<false>(i, host_weight)
    }

    /// [`Columns::effective_overlap`]; with `ALL_CURRENT` (the caller checked that every row's
    /// index is current) without the per-row trust check.
    #[inline(always)]
    fn effective_overlap_in<const ALL_CURRENT: bool>(&self, i: usize, host_weight: f64) -> f64 {
        if !ALL_CURRENT && !self.trust.trusted(i) {
            return 0.0;
        }
        effective(self.device[i], self.host[i], host_weight)
    }
}

/// [`Columns::effective_overlap`] of a trusted row from its overlap columns' values.
#[inline(always)]
fn effective(device: f64, host: f64, host_weight: f64) -> f64 {
    let eff = device + host_weight * host;
    if eff.is_nan() {
        0.0
    } else {
        eff
    }
}

/// Both the load tier and the soft-affinity gate: is `load` too far above `min`, by an absolute
/// gap (saturating) and by a ratio, both strict?
pub fn exceeds(load: u64, min: u64, abs: u64, rel: f64) -> bool {
    load.saturating_sub(min) > abs && load as f64 > rel * min as f64
}

/// A load signal's least-loaded order (`params.load_signal`), compiled into the scan: the key
/// is the signal's `Prefix` then the row's [`Tie`]. The tie is computed only when two rows'
/// prefixes are equal (under `tie_break: spread` it is a hash and two column reads, and in a
/// large fleet most rows never tie the leaders), so a row costs one prefix read and a few
/// comparisons; the order is the same as keying every row.
trait LoadOrder {
    /// Smaller is less loaded; equal prefixes are told apart by the [`Tie`].
    type Prefix: Copy + Ord;
    /// What [`LoadOrder::prefix`] needs of the request, worked out once per pass.
    type Request: Copy;
    /// Whether the key orders by something other than active requests first, so the load
    /// tier's fewest-active row must be tracked on its own.
    const SEPARATE_ACTIVE: bool;
    fn request(prompt: Prompt) -> Self::Request;
    /// The prefix of a row with `active` requests, `prefill` tokens to prefill and effective
    /// overlap `eff`.
    fn prefix(active: u64, prefill: u64, eff: f64, request: Self::Request) -> Self::Prefix;
    /// [`LoadOrder::prefix`] of row `i`.
    #[inline]
    fn prefix_of(cols: &Columns<'_>, i: usize, eff: f64, request: Self::Request) -> Self::Prefix {
        Self::prefix(cols.active[i], cols.prefill[i], eff, request)
    }
    /// The active requests in a prefix.
    fn active(prefix: Self::Prefix) -> u64;
}

/// [`LoadSignal::ActiveRequests`]: fewer active requests first, then the [`Tie`].
struct ByActive;

impl LoadOrder for ByActive {
    type Prefix = u64;
    type Request = ();
    const SEPARATE_ACTIVE: bool = false;
    #[inline]
    fn request(_prompt: Prompt) {}
    #[inline]
    fn prefix(active: u64, _prefill: u64, _eff: f64, _request: ()) -> u64 {
        active
    }
    #[inline]
    fn active(prefix: u64) -> u64 {
        prefix
    }
}

/// [`LoadSignal::PrefillBacklog`]: fewer prompt tokens to prefill before this request's first
/// token (the row's `active_prefill_tokens` plus the prompt tokens it does not cache) first, then
/// fewer active requests, then the [`Tie`].
struct ByBacklog;

/// The prompt as [`ByBacklog`] reads it: its tokens, tokens per block, and the blocks that
/// cover it (capped at 2^53, where every integer is still an `f64`).
#[derive(Clone, Copy)]
struct Backlog {
    tokens: u64,
    block_size: u64,
    full: f64,
}

impl Backlog {
    fn of(prompt: Prompt) -> Self {
        let block_size = u64::from(prompt.block_size.max(1));
        Backlog {
            tokens: prompt.tokens,
            block_size,
            full: prompt.tokens.div_ceil(block_size).min(1 << 53) as f64,
        }
    }

    /// The prompt tokens a row caching `eff` blocks holds: `floor(eff)` blocks' worth, at most
    /// the prompt. Below `full`, `floor(eff)` is fewer blocks than cover the prompt, so their
    /// tokens are fewer than the prompt's: no cap, no overflow, and a plain truncation (no
    /// saturating conversion); the rest takes the general way.
    #[inline(always)]
    fn cached(self, eff: f64) -> u64 {
        // A NaN or negative overlap caches nothing (one compare: `f64::max` also orders NaN).
        let eff = if eff > 0.0 { eff } else { 0.0 };
        if eff < self.full {
            // SAFETY: `0 <= eff < full <= 2^53`: finite and within `i64`, where truncation
            // (toward zero: for `eff >= 0` the floor) is defined. `as` would also check for NaN
            // and saturate, a few instructions on every row of a large fleet.
            let blocks = unsafe { eff.to_int_unchecked::<i64>() } as u64;
            blocks * self.block_size
        } else {
            // Inline, not a call: a call in the scan's loop makes it spill its floating-point
            // registers on every row.
            (eff as u64)
                .saturating_mul(self.block_size)
                .min(self.tokens)
        }
    }
}

impl LoadOrder for ByBacklog {
    /// `(backlog, active)` as one integer, backlog in the high half: ordered as the pair is,
    /// in one comparison instead of two.
    type Prefix = u128;
    type Request = Backlog;
    const SEPARATE_ACTIVE: bool = true;
    #[inline]
    fn request(prompt: Prompt) -> Backlog {
        Backlog::of(prompt)
    }
    #[inline]
    fn prefix(active: u64, prefill: u64, eff: f64, request: Backlog) -> u128 {
        // A NaN `eff` was already made 0.
        let backlog = prefill.saturating_add(request.tokens - request.cached(eff));
        (u128::from(backlog) << 64) | u128::from(active)
    }
    #[inline]
    fn active(prefix: u128) -> u64 {
        prefix as u64
    }
}

/// Where a leader of a scan is: its row, and its [`Tie`] once worked out. Apart from the
/// leaders' keys, which the scan's loop compares on every row and keeps in registers: a row is
/// written here only when the lead changes (a few times a pass), and a tie once per leader.
#[derive(Clone, Copy)]
struct Lead {
    row: usize,
    tie: Option<Tie>,
}

impl Lead {
    fn at(row: usize) -> Self {
        Lead { row, tie: None }
    }
}

/// Row `i` with `key` takes the lead from `(leader, lead)` if its key is less, or equal with a
/// lesser [`Tie`]. One comparison for the common row, which loses (`key > leader`); the ties are
/// computed only for a row that equals the leader: in a large fleet most rows never do, and a
/// leader that a few hundred idle rows tie has its own tie worked out once.
#[inline(always)]
fn challenge<K: Copy + PartialOrd>(
    leader: &mut K,
    lead: &mut Lead,
    cols: &Columns<'_>,
    prompt: Prompt,
    i: usize,
    key: K,
) {
    if key <= *leader {
        if key < *leader {
            *leader = key;
            *lead = Lead::at(i);
        } else {
            tie_wins(cols, prompt, i, lead);
        }
    }
}

/// Row `i`, whose key equals the leader's: it takes the lead in `lead` if its [`Tie`] orders
/// first; `lead` then holds the tie of whichever leads. Inlined though only rows that equal a
/// leader come here: a call anywhere in the scan's loop leaves it the six registers a call
/// preserves, and the loop reloads its columns from the stack on every row.
#[inline(always)]
fn tie_wins(cols: &Columns<'_>, prompt: Prompt, i: usize, lead: &mut Lead) {
    let leader_tie = match lead.tie {
        Some(tie) => tie,
        None => cols.tie(lead.row, prompt),
    };
    let tie = cols.tie(i, prompt);
    *lead = if tie < leader_tie {
        Lead {
            row: i,
            tie: Some(tie),
        }
    } else {
        Lead {
            row: lead.row,
            tie: Some(leader_tie),
        }
    };
}

/// Running statistics of one pass over a row set: per row a prefix read and a few comparisons.
/// The leaders' keys; their rows are in a `[Lead; 3]` beside it (`least`, `least_active`,
/// `best`).
struct Scan<O: LoadOrder> {
    /// Least-loaded by the load signal: the fallback tier's row.
    least: O::Prefix,
    /// Fewest active requests (then the tie): the load tier's row. The same row as `least`
    /// under [`LoadSignal::ActiveRequests`] (then not tracked).
    least_active: u64,
    max_active: u64,
    /// Highest overlap, then least loaded: the cache tier's row. Its key is the overlap
    /// negated, so that less is better as in the others (overlaps are never NaN here).
    best: (f64, O::Prefix),
}

impl<O: LoadOrder> Scan<O> {
    #[inline]
    fn first(i: usize, eff: f64, prefix: O::Prefix) -> (Self, [Lead; 3]) {
        let scan = Scan {
            least: prefix,
            least_active: O::active(prefix),
            max_active: O::active(prefix),
            best: (-eff, prefix),
        };
        (scan, [Lead::at(i); 3])
    }

    /// Always inlined into the scan: a call per row cost about 20 instructions.
    #[inline(always)]
    fn add(
        &mut self,
        leads: &mut [Lead; 3],
        cols: &Columns<'_>,
        prompt: Prompt,
        (i, eff, prefix): (usize, f64, O::Prefix),
    ) {
        let [least, least_active, best] = leads;
        challenge(&mut self.least, least, cols, prompt, i, prefix);
        let active = O::active(prefix);
        if O::SEPARATE_ACTIVE {
            challenge(
                &mut self.least_active,
                least_active,
                cols,
                prompt,
                i,
                active,
            );
        }
        self.max_active = self.max_active.max(active);
        // Highest overlap wins; among equal overlap, the least-loaded row. The overlap is
        // compared first and on its own: most rows lose there.
        if -eff <= self.best.0 {
            challenge(&mut self.best, best, cols, prompt, i, (-eff, prefix));
        }
    }
}

/// What the tiers read of one pass, whatever the load order.
struct Summary {
    least_loaded: usize,
    least_active: usize,
    min_active: u64,
    max_active: u64,
    best_row: usize,
    best_eff: f64,
}

/// One pass over the rows where `in_set` holds (`None` when there are none), compiled once per
/// load order, and once more for when every row's index is current (no trust check per row).
fn scan<O: LoadOrder>(
    params: &ResolvedParams,
    cols: &Columns<'_>,
    prompt: Prompt,
    in_set: &impl Fn(RowId) -> bool,
) -> Option<Summary> {
    if cols.trust.all_current() {
        scan_in::<O, true>(params, cols, prompt, in_set)
    } else {
        scan_in::<O, false>(params, cols, prompt, in_set)
    }
}

/// [`scan`]. Not inlined: on its own the loop keeps its state in registers.
#[inline(never)]
fn scan_in<O: LoadOrder, const ALL_CURRENT: bool>(
    params: &ResolvedParams,
    cols: &Columns<'_>,
    prompt: Prompt,
    in_set: &impl Fn(RowId) -> bool,
) -> Option<Summary> {
    let n = cols.len();
    let weight = params.host_cache_weight;
    let request = O::request(prompt);
    let first = (0..n).find(|&i| in_set(cols.row(i)))?;
    let first_eff = cols.effective_overlap_in::<ALL_CURRENT>(first, weight);
    let (mut scan, mut leads) = Scan::<O>::first(
        first,
        first_eff,
        O::prefix_of(cols, first, first_eff, request),
    );
    // Every column the loop reads, as a local cut to `n`: then no read has a bounds check (a
    // panic that even a predicate ignoring the row could not remove).
    let (worker_id, dp_rank) = (&cols.worker_id[..n], &cols.dp_rank[..n]);
    let (device, host) = (&cols.device[..n], &cols.host[..n]);
    let (active, prefill) = (&cols.active[..n], &cols.prefill[..n]);
    for i in first + 1..n {
        let row = RowId {
            worker_id: worker_id[i],
            dp_rank: dp_rank[i],
        };
        if in_set(row) {
            let eff = if !ALL_CURRENT && !cols.trust.trusted(i) {
                0.0
            } else {
                effective(device[i], host[i], weight)
            };
            let prefix = O::prefix(active[i], prefill[i], eff, request);
            scan.add(&mut leads, cols, prompt, (i, eff, prefix));
        }
    }
    let [least, least_active, best] = leads;
    let (least_active, min_active) = if O::SEPARATE_ACTIVE {
        (least_active.row, scan.least_active)
    } else {
        (least.row, O::active(scan.least))
    };
    Some(Summary {
        least_loaded: least.row,
        least_active,
        min_active,
        max_active: scan.max_active,
        best_row: best.row,
        best_eff: -scan.best.0,
    })
}

/// The least-loaded row (by `params.load_signal`) of those where `in_set` holds that would not
/// pass `limit` of its KV capacity with `request_blocks` more; `None` if every one would. A
/// second pass, run only when the cache tier's row is over: the common decision never pays for
/// it.
#[cold]
#[inline(never)]
fn least_loaded_with_room(
    params: &ResolvedParams,
    cols: &Columns<'_>,
    prompt: Prompt,
    in_set: &impl Fn(RowId) -> bool,
    request_blocks: u64,
    limit: f64,
) -> Option<usize> {
    // Both orders as one key: `(active, tie)` orders as `(active, 0, tie)`.
    let key = |i: usize| {
        let eff = cols.effective_overlap(i, params.host_cache_weight);
        let tie = cols.tie(i, prompt);
        match params.load_signal {
            LoadSignal::ActiveRequests => (ByActive::prefix_of(cols, i, eff, ()), 0, tie),
            LoadSignal::PrefillBacklog => {
                let prefix = ByBacklog::prefix_of(cols, i, eff, Backlog::of(prompt));
                ((prefix >> 64) as u64, prefix as u64, tie)
            }
        }
    };
    (0..cols.len())
        .filter(|&i| in_set(cols.row(i)) && !cols.over_kv_capacity(i, request_blocks, limit))
        .min_by_key(|&i| key(i))
}

/// Run the load tier, then the cache tier, over the rows where `in_set` holds. The predicate is
/// over rows, so the scan reads each row from its own bounds-checked columns.
/// `None` when the set is empty.
pub fn run_tiers(
    params: &ResolvedParams,
    cols: &Columns<'_>,
    request_blocks: u64,
    prompt: Prompt,
    in_set: impl Fn(RowId) -> bool,
) -> Option<TierDecision> {
    let cols = &cols.exact();
    let scan = match params.load_signal {
        LoadSignal::ActiveRequests => scan::<ByActive>(params, cols, prompt, &in_set)?,
        LoadSignal::PrefillBacklog => scan::<ByBacklog>(params, cols, prompt, &in_set)?,
    };
    let min_active = scan.min_active;
    let cache_ratio = if request_blocks == 0 {
        0.0
    } else {
        scan.best_eff / request_blocks as f64
    };
    let imbalanced = exceeds(
        scan.max_active,
        min_active,
        params.balance_abs_threshold,
        params.balance_rel_threshold,
    );
    let (row, tier) = if imbalanced {
        (scan.least_active, Tier::LoadImbalance)
    } else if cache_ratio > params.cache_threshold {
        (scan.best_row, Tier::Cache)
    } else {
        (scan.least_loaded, Tier::LeastLoaded)
    };
    // Whichever tier chose it, a row the request would overfill gives way to the least-loaded
    // row with room, if there is one and moving throws away less cache than staying evicts.
    let with_room = match params.kv_capacity_limit {
        Some(limit) if cols.over_kv_capacity(row, request_blocks, limit) => {
            least_loaded_with_room(params, cols, prompt, &in_set, request_blocks, limit).filter(
                |&room| {
                    cols.worth_moving(row, room, request_blocks, limit, params.host_cache_weight)
                },
            )
        }
        _ => None,
    };
    let (row, tier) = match with_room {
        Some(room) => (room, tier.over_kv_capacity()),
        None => (row, tier),
    };
    Some(TierDecision {
        row,
        row_active: cols.active(row),
        tier,
        min_active,
        max_active: scan.max_active,
        max_effective_overlap: scan.best_eff,
        max_overlap_row: scan.best_row,
        cache_ratio,
    })
}

/// The full decision: G over every row, then soft affinity (K over the target's rows, the gate).
pub fn decide(
    params: &ResolvedParams,
    cols: &Columns<'_>,
    request_blocks: u64,
    prompt: Prompt,
    target: Option<AffinityTarget>,
) -> Result<Decision, PickError> {
    let all = run_tiers(params, cols, request_blocks, prompt, |_| true)
        .ok_or_else(|| PickError::new("no rows to pick from"))?;
    let only_all = |soft_affinity| Decision {
        row: all.row,
        all,
        target: None,
        soft_affinity,
    };
    let Some(target) = target.filter(|_| params.respect_soft_affinity) else {
        return Ok(only_all(SoftAffinity::None));
    };
    let Some(kept) = run_tiers(params, cols, request_blocks, prompt, |row| {
        target.matches(row)
    }) else {
        return Ok(only_all(SoftAffinity::NotEligible));
    };
    let released = params.soft_affinity_load_gate
        && exceeds(
            kept.row_active,
            all.min_active,
            params.soft_affinity_gate_abs,
            params.soft_affinity_gate_rel,
        );
    // A kept target gives way to the all-rows decision when staying would overfill its row by
    // more than moving throws away (K's own capacity rule only moves between the target's
    // rows), or, with the cache gate, when the other row caches more of the prompt.
    let w = params.host_cache_weight;
    let over_capacity = params.kv_capacity_limit.is_some_and(|limit| {
        cols.over_kv_capacity(kept.row, request_blocks, limit)
            && !cols.over_kv_capacity(all.row, request_blocks, limit)
            && cols.worth_moving(kept.row, all.row, request_blocks, limit, w)
    });
    // A target row whose KV index is not current has no known overlap, which is no evidence
    // that the other row caches more: the gate needs both rows' overlap to release a session.
    let uncached = params.soft_affinity_cache_gate
        && cols.trust.trusted(kept.row)
        && cols.effective_overlap(all.row, w) > cols.effective_overlap(kept.row, w);
    let (row, soft_affinity) = if released {
        (all.row, SoftAffinity::ReleasedByGate)
    } else if over_capacity {
        (all.row, SoftAffinity::ReleasedByKvCapacity)
    } else if uncached {
        (all.row, SoftAffinity::ReleasedByCache)
    } else {
        (kept.row, SoftAffinity::Kept)
    };
    Ok(Decision {
        row,
        all,
        target: Some(kept),
        soft_affinity,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use plugin_api::testing::{TestRequest, TestRow, TestRows};
    use plugin_api::{Context, Inputs, KvIndexState, Policy};
    use std::sync::Mutex;

    fn xorshift(mut x: u64) -> impl FnMut(u64) -> u64 {
        move |below| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % below
        }
    }

    /// `[least loaded, fewest active, best overlap]`, `None` for an empty row set.
    type Leaders = Option<[usize; 3]>;

    /// Hands the rows it is asked to pick from to [`scan`] (over every row and over worker 1's)
    /// and to the definition of what it finds, keying every row in full; remembers both.
    struct ScanProbe {
        params: ResolvedParams,
        found: Mutex<Vec<(Leaders, Leaders)>>,
    }

    impl ScanProbe {
        fn both<O: LoadOrder>(&self, cols: &Columns<'_>, prompt: Prompt) {
            for target in [None, Some(1)] {
                let in_set = |row: RowId| target.is_none_or(|w| row.worker_id == w);
                let fast = scan::<O>(&self.params, cols, prompt, &in_set).map(|s| {
                    let best_eff =
                        cols.effective_overlap(s.best_row, self.params.host_cache_weight);
                    assert_eq!(s.best_eff.to_bits(), best_eff.to_bits());
                    assert_eq!(s.min_active, cols.active(s.least_active));
                    [s.least_loaded, s.least_active, s.best_row]
                });
                let defined = by_definition::<O>(&self.params, cols, prompt, &in_set);
                self.found.lock().unwrap().push((fast, defined));
            }
        }
    }

    impl Policy for ScanProbe {
        fn inputs(&self) -> Inputs {
            Inputs::CACHE | Inputs::LOAD
        }

        fn pick(&self, ctx: &Context<'_>, rows: &Rows<'_>) -> Result<usize, PickError> {
            let cols = Columns::from_rows(rows)?;
            let prompt = Prompt {
                tokens: ctx.prompt_tokens(),
                block_size: ctx.block_size(),
                spread: Some(ties::request_key(ctx))
                    .filter(|_| ctx.prompt_tokens().is_multiple_of(2)),
            };
            self.both::<ByActive>(&cols, prompt);
            self.both::<ByBacklog>(&cols, prompt);
            Ok(0)
        }
    }

    /// The leaders keyed in full, every row: least loaded by (prefix, tie), fewest active by
    /// (active, tie), highest overlap then (prefix, tie).
    fn by_definition<O: LoadOrder>(
        params: &ResolvedParams,
        cols: &Columns<'_>,
        prompt: Prompt,
        in_set: &impl Fn(RowId) -> bool,
    ) -> Leaders {
        let w = params.host_cache_weight;
        let rows: Vec<usize> = (0..cols.len()).filter(|&i| in_set(cols.row(i))).collect();
        let eff = |i: usize| cols.effective_overlap(i, w);
        let prefix = |i: usize| O::prefix_of(cols, i, eff(i), O::request(prompt));
        let least = *rows
            .iter()
            .min_by_key(|&&i| (prefix(i), cols.tie(i, prompt)))?;
        let least_active = *rows
            .iter()
            .min_by_key(|&&i| (O::active(prefix(i)), cols.tie(i, prompt)))?;
        let best = *rows.iter().min_by(|&&a, &&b| {
            eff(b)
                .partial_cmp(&eff(a))
                .expect("never NaN")
                .then((prefix(a), cols.tie(a, prompt)).cmp(&(prefix(b), cols.tie(b, prompt))))
        })?;
        Some([least, least_active, best])
    }

    #[test]
    fn the_scan_finds_the_rows_keying_every_row_in_full_finds() {
        let mut rng = xorshift(0x2545_f491_4f6c_dd1d);
        let probe = ScanProbe {
            params: crate::params::TwoTierParams::default()
                .validate(0.5)
                .expect("defaults"),
            found: Mutex::new(Vec::new()),
        };
        // Few distinct values, so that rows tie every leader often; NaN and untrusted overlaps.
        let devices = [0.0, 1.0, 2.0, 2.0, 3.0, f64::NAN, -0.0];
        let states = [
            KvIndexState::Current,
            KvIndexState::Current,
            KvIndexState::Unknown,
        ];
        for case in 0..3_000u64 {
            // Every eighth case a larger set, where many rows tie each leader.
            let n = 1 + rng(if case % 8 == 7 { 200 } else { 24 }) as usize;
            let rows: Vec<TestRow> = (0..n)
                .map(|_| {
                    TestRow::new(1 + rng(3), rng(3) as u32)
                        .device(devices[rng(devices.len() as u64) as usize])
                        .host(rng(2) as f64)
                        .active(rng(3))
                        .prefill_tokens(16 * rng(3))
                })
                .collect();
            let mut rows = TestRows::new(rows);
            if case % 3 > 0 {
                let trust: Vec<_> = (0..n).map(|_| states[rng(3) as usize]).collect();
                rows = rows.kv_index_states(&trust);
            }
            if case % 4 > 1 {
                rows = rows
                    .kv_indexed_device_blocks((0..n).map(|_| rng(3) as f64).collect())
                    .kv_capacity_blocks((0..n).map(|_| 2.0 + rng(2) as f64).collect());
            }
            let request = TestRequest::new(32 + rng(3), 16).session(&format!("s{}", rng(5)));
            rows.pick(&probe, &request).expect("probed");
        }
        let found = probe.found.into_inner().unwrap();
        assert_eq!(found.len(), 3_000 * 4);
        let non_empty = found.iter().filter(|(fast, _)| fast.is_some()).count();
        assert!(
            non_empty > 10_000,
            "most row sets are non-empty ({non_empty})"
        );
        for (i, (fast, defined)) in found.iter().enumerate() {
            assert_eq!(fast, defined, "probe {i}");
        }
    }

    /// What the backlog key read before [`Backlog`]: the definition.
    fn cached_by_definition(eff: f64, prompt: Prompt) -> u64 {
        let cached = (eff.max(0.0) as u64).saturating_mul(u64::from(prompt.block_size.max(1)));
        cached.min(prompt.tokens)
    }

    #[test]
    fn backlog_cached_tokens_match_the_definition() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let tokens = [
            0,
            1,
            15,
            16,
            17,
            4_096,
            4_097,
            (1 << 53) - 1,
            1 << 53,
            (1 << 57) + 3,
            u64::MAX - 1,
            u64::MAX,
        ];
        let block_sizes = [0, 1, 2, 16, 17, 512, u32::MAX];
        for &tokens in &tokens {
            for &block_size in &block_sizes {
                let prompt = Prompt {
                    tokens,
                    block_size,
                    spread: None,
                };
                let full = tokens.div_ceil(u64::from(block_size.max(1))) as f64;
                let mut effs = vec![
                    f64::NAN,
                    f64::NEG_INFINITY,
                    -1.5,
                    -0.0,
                    0.0,
                    0.5,
                    1.0,
                    full - 1.0,
                    full - 0.5,
                    full,
                    full + 0.5,
                    full * 2.0,
                    full / 2.0,
                    full * 0.75,
                    f64::from_bits(full.to_bits().saturating_sub(1)),
                    (1u64 << 53) as f64,
                    1e300,
                    f64::INFINITY,
                ];
                effs.extend((0..200).map(|_| (next() % 10_000) as f64 / 7.0));
                effs.extend((0..50).map(|_| f64::from_bits(next() >> 2)));
                for eff in effs {
                    assert_eq!(
                        Backlog::of(prompt).cached(eff),
                        cached_by_definition(eff, prompt),
                        "tokens {tokens}, block size {block_size}, eff {eff}"
                    );
                }
            }
        }
    }
}
