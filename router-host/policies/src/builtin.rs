//! Policies built into the host: the `default` selector (docs/configuration.md) and the cache-blind
//! baselines `round-robin` and `random`.
//!
//! They implement the same `plugin_api::Policy` trait as plugins and are boxed through the same
//! adapter, so the host calls every policy the same way. The one thing that sets `default` apart
//! (the host narrows its rows to an eligible soft target) is decided by the router, not here.

use std::sync::atomic::{AtomicU64, Ordering};

use plugin_api::{
    check, ties, Context, CreateError, Explanation, IndexTrust, Inputs, ParamDoc, Parameters,
    PickError, Policy, RowId, Rows,
};
use serde::Deserialize;

use crate::loader::PolicyTypeDoc;
use router_config as config;
pub use router_config::{Room, TieBreak};
use router_core::rng::{mix, GOLDEN_GAMMA};

/// Host settings a built-in needs at creation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BuiltinSettings {
    pub host_cache_hit_weight: f64,
    pub disk_cache_hit_weight: f64,
    pub prefill_load_scale: f64,
    pub decode_active_request_weight: f64,
    /// `default_selector.overlap_credit`: the credit per device-tier cached block.
    pub overlap_credit: f64,
    /// `default_selector.tie_break`.
    pub tie_break: TieBreak,
    /// `default_selector.room`.
    pub room: Room,
    /// The cache gate's weight (`live_eviction_weight`); 0: off.
    pub live_eviction_weight: f64,
}

impl Default for BuiltinSettings {
    /// The host's defaults (docs/configuration.md, `default_selector`).
    fn default() -> Self {
        BuiltinSettings {
            host_cache_hit_weight: config::DEFAULT_HOST_CACHE_HIT_WEIGHT,
            disk_cache_hit_weight: config::DEFAULT_DISK_CACHE_HIT_WEIGHT,
            prefill_load_scale: config::DEFAULT_PREFILL_LOAD_SCALE,
            decode_active_request_weight: config::DEFAULT_DECODE_ACTIVE_REQUEST_WEIGHT,
            overlap_credit: config::DEFAULT_OVERLAP_CREDIT,
            tie_break: config::DEFAULT_TIE_BREAK,
            room: config::DEFAULT_ROOM,
            live_eviction_weight: config::DEFAULT_LIVE_EVICTION_WEIGHT,
        }
    }
}

impl BuiltinSettings {
    /// Dynamo's weights, the host's defaults before the measured-best ones: what
    /// `default_selector: {prefill_load_scale: 1.0, overlap_credit: 1.0, tie_break: lowest_row,
    /// live_eviction_weight: 0}` gives.
    pub fn dynamo() -> Self {
        BuiltinSettings {
            prefill_load_scale: 1.0,
            overlap_credit: 1.0,
            tie_break: TieBreak::LowestRow,
            live_eviction_weight: 0.0,
            ..BuiltinSettings::default()
        }
    }
}

/// Policy types shipped with the host as plugins, each with the plugin name (`export_plugin!`'s
/// `name`) of the plugin that ships it. Another library exporting one of these names shadows the
/// shipped policy: allowed, but warned about ([`crate::catalog::ShadowedType`]). A built-in's
/// name ([`Builtin::as_str`]) cannot be exported by any library.
pub const SHIPPED_PLUGIN_TYPES: &[(&str, &str)] =
    &[("dynamo-two-tier-cost-fn", "two-tier-cost-fn")];

/// The plugin that ships policy type `type_name`, if it is a shipped one.
pub fn shipped_plugin_of(type_name: &str) -> Option<&'static str> {
    SHIPPED_PLUGIN_TYPES
        .iter()
        .find(|(name, _)| *name == type_name)
        .map(|(_, plugin)| *plugin)
}

router_core::spelled_enum! {
    /// The built-in policy types, spelled as their `type` in a config.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Builtin {
        Default = "default",
        RoundRobin = "round-robin",
        Random = "random",
    }
}

impl Builtin {
    pub fn doc(self) -> PolicyTypeDoc {
        let (summary, parameters) = match self {
            Builtin::Default => (
                "Lowest prefill+decode cost after cache credit; narrows to an eligible soft target",
                vec![
                    ParamDoc::optional("prefill_load_scale", "f64", &format!("host default_selector.prefill_load_scale ({:?})", config::DEFAULT_PREFILL_LOAD_SCALE), "weight of the uncached prefill blocks; finite, >= 0"),
                    ParamDoc::optional("decode_active_request_weight", "f64", &format!("host default_selector.decode_active_request_weight ({:?})", config::DEFAULT_DECODE_ACTIVE_REQUEST_WEIGHT), "weight of active requests; finite, >= 0"),
                    ParamDoc::optional("overlap_credit", "f64", &format!("host default_selector.overlap_credit ({:?})", config::DEFAULT_OVERLAP_CREDIT), "credit per device-cached prompt block (1.0 = the block's prefill); finite, >= 0"),
                    ParamDoc::optional("tie_break", "string", &format!("host default_selector.tie_break ({})", config::DEFAULT_TIE_BREAK), "exact ties: spread (drawn from the request and the row id), or lowest_row"),
                    ParamDoc::optional("live_eviction_weight", "f64", &format!("host default_selector.live_eviction_weight ({:?})", config::DEFAULT_LIVE_EVICTION_WEIGHT), "the cache gate: cost per prompt block the row must evict from its recently used cache to take the uncached part of the prompt, in prefill blocks (times prefill_load_scale); needs the row's capacity; finite, >= 0"),
                    ParamDoc::optional("room", "string", &format!("host default_selector.room ({})", config::DEFAULT_ROOM), "what spread counts as a row's room first: free (capacity - indexed blocks) or not_recent (capacity - blocks used within kv_recent_window_ms)"),
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
            name: self.as_str().to_string(),
            summary: summary.to_string(),
            parameters,
        }
    }

    /// Validate parameters and box instance `instance`.
    pub fn create(
        self,
        instance: &str,
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
                    overlap_credit: Option<f64>,
                    tie_break: Option<TieBreak>,
                    room: Option<Room>,
                    live_eviction_weight: Option<f64>,
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
                    overlap_credit: check::finite_at_least(
                        "overlap_credit",
                        p.overlap_credit.unwrap_or(settings.overlap_credit),
                        0.0,
                    )?,
                    tie_break: p.tie_break.unwrap_or(settings.tie_break),
                    room: p.room.unwrap_or(settings.room),
                    live_eviction_weight: check::finite_at_least(
                        "live_eviction_weight",
                        p.live_eviction_weight
                            .unwrap_or(settings.live_eviction_weight),
                        0.0,
                    )?,
                };
                selector.log_resolved(instance);
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

/// The built-in `default` selector (docs/configuration.md): the lowest estimated cost of serving
/// the request on a row, in prompt blocks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DefaultSelector {
    pub host_weight: f64,
    pub disk_weight: f64,
    pub prefill_load_scale: f64,
    pub decode_active_request_weight: f64,
    /// Credit per device-tier cached block, in prompt blocks (1.0: a cached block saves the
    /// one block it would cost to prefill).
    pub overlap_credit: f64,
    pub tie_break: TieBreak,
    /// What `spread` ranks rows by first: free blocks, or blocks not used lately.
    pub room: Room,
    /// The cache gate's weight (`live_eviction_weight`: the blocks a row would evict from its
    /// recently used cache, priced in prefill blocks); 0: off.
    pub live_eviction_weight: f64,
}

impl DefaultSelector {
    /// The selector with the host's default settings.
    pub fn new(settings: &BuiltinSettings) -> Self {
        DefaultSelector {
            host_weight: settings.host_cache_hit_weight,
            disk_weight: settings.disk_cache_hit_weight,
            prefill_load_scale: settings.prefill_load_scale,
            decode_active_request_weight: settings.decode_active_request_weight,
            overlap_credit: settings.overlap_credit,
            tie_break: settings.tie_break,
            room: settings.room,
            live_eviction_weight: settings.live_eviction_weight,
        }
    }

    /// Log the values in force (not just what the YAML said), once per instance: the host's
    /// defaults changed, and this line says which ones a running router uses.
    fn log_resolved(&self, instance: &str) {
        tracing::info!(
            instance,
            policy = Builtin::Default.as_str(),
            prefill_load_scale = self.prefill_load_scale,
            decode_active_request_weight = self.decode_active_request_weight,
            overlap_credit = self.overlap_credit,
            tie_break = self.tie_break.as_str(),
            room = self.room.as_str(),
            live_eviction_weight = self.live_eviction_weight,
            host_cache_hit_weight = self.host_weight,
            disk_cache_hit_weight = self.disk_weight,
            "built-in default selector created with resolved settings"
        );
    }

    /// The row of lowest cost and its cost; among equal costs the lowest [`Self::tie_key`].
    ///
    /// One pass; the keys of two rows are computed only when their costs are equal, and not
    /// kept: under `spread` a key is a hash and two column reads, and most rows of a large fleet
    /// never tie the best. The order is the same as keying every row.
    fn best(&self, ctx: &Context<'_>, rows: &Rows<'_>) -> Option<(usize, f64)> {
        if rows.is_empty() {
            return None;
        }
        let (request, room) = match self.tie_break {
            TieBreak::LowestRow => (0, None),
            TieBreak::Spread => (
                ties::request_key(ctx),
                match self.room {
                    Room::Free => ties::RoomColumns::of(rows),
                    Room::NotRecent => ties::RoomColumns::not_recent(rows),
                },
            ),
        };
        // Out of line: the loop stays small, and only rows that equal the best come here.
        #[inline(never)]
        fn key_wins(
            selector: &DefaultSelector,
            (request, room): (u64, Option<&ties::RoomColumns<'_>>),
            rows: &Rows<'_>,
            i: usize,
            best: usize,
        ) -> bool {
            let key = |i: usize| selector.tie_key(request, room, i, rows.row(i));
            key(i) < key(best)
        }
        let pricing = Pricing::of(self, ctx, rows);
        let mut best = (0, pricing.cost(0));
        // A chunk's costs are priced together and its lowest found in vector lanes; only a
        // chunk that reaches the best so far is walked row by row, in the order above (a NaN
        // cost never wins, and `lowest` skips it).
        let mut costs = [0.0; CHUNK];
        let mut start = 1;
        while start < rows.len() {
            let costs = &mut costs[..CHUNK.min(rows.len() - start)];
            pricing.costs(start, costs);
            if lowest(costs) <= best.1 {
                for (i, &cost) in (start..).zip(costs.iter()) {
                    if cost < best.1
                        || (cost == best.1
                            && key_wins(self, (request, room.as_ref()), rows, i, best.0))
                    {
                        best = (i, cost);
                    }
                }
            }
            start += costs.len();
        }
        Some(best)
    }

    /// The cache gate: how many blocks a row would evict from its recently used cache to store
    /// the prompt blocks it does not hold, `max(0, uncached - (capacity - recent))`, with
    /// `recent` the `kv_recent_device_blocks` column (else the indexed device blocks: then
    /// every held block counts as live). 0 for a row of unknown capacity, so the gate changes
    /// nothing where capacity is unknown.
    fn live_eviction(request_blocks: f64, capacity: f64, used: f64, device: f64) -> f64 {
        // `max` would read a NaN capacity as 0 room: unknown capacity means no gate.
        if capacity.is_nan() {
            return 0.0;
        }
        let known = |x: f64| if x.is_nan() { 0.0 } else { x };
        let uncached = (request_blocks - known(device)).max(0.0);
        let evicted = uncached - (capacity - known(used)).max(0.0);
        if evicted > 0.0 {
            evicted
        } else {
            0.0
        }
    }

    /// The columns the cache gate reads, when it is on and the host sent them.
    fn gate_columns<'r>(&self, rows: &Rows<'r>) -> Option<(&'r [f64], &'r [f64])> {
        if self.live_eviction_weight == 0.0 {
            return None;
        }
        let capacity = rows.kv_capacity_blocks()?;
        let used = match rows.kv_recent_device_blocks() {
            Some(recent) => recent,
            None => rows.kv_indexed_blocks()?.device,
        };
        Some((capacity, used))
    }

    /// The order among rows of equal cost: lower wins. Under `spread`, the row with more free
    /// KV blocks first (a prompt nobody caches goes where it evicts least), then the spread rank
    /// of the request (`request`, [`ties::request_key`], computed once per decision);
    /// `lowest_row` is the row id alone.
    #[inline]
    fn tie_key(
        &self,
        request: u64,
        room: Option<&ties::RoomColumns<'_>>,
        i: usize,
        id: RowId,
    ) -> (i64, u64, RowId) {
        match self.tie_break {
            TieBreak::LowestRow => (0, 0, id),
            TieBreak::Spread => (
                room.map_or(0, |room| room.rank(i)),
                ties::spread_rank(request, id),
                id,
            ),
        }
    }
}

/// How many rows [`DefaultSelector::best`] prices at a time: small enough to stay in L1, large
/// enough that the lanes' lowest is found once per many rows.
const CHUNK: usize = 64;

/// The lowest of `costs`, NaN skipped (`+inf` if all are NaN); four lanes, so it vectorises.
fn lowest(costs: &[f64]) -> f64 {
    let mut lanes = [f64::INFINITY; 4];
    let quads = costs.chunks_exact(4);
    let rest = quads.remainder();
    for quad in quads {
        for (lane, &cost) in lanes.iter_mut().zip(quad) {
            *lane = if cost < *lane { cost } else { *lane };
        }
    }
    for &cost in rest {
        lanes[0] = if cost < lanes[0] { cost } else { lanes[0] };
    }
    let [a, b, c, d] = lanes;
    let low = |x: f64, y: f64| if y < x { y } else { x };
    low(low(a, b), low(c, d))
}

/// One decision's [`DefaultSelector`] cost of each row: the columns it reads, checked present
/// and cut to the rows once, and what does not depend on the row worked out once.
struct Pricing<'r> {
    selector: &'r DefaultSelector,
    /// The overlap columns `(device, host, disk)`, when the host sent them.
    overlap: Option<[&'r [f64]; 3]>,
    /// The load columns `(active_prefill_tokens, decode_blocks, active_requests)`, when the
    /// host sent them. Without both, a row's cost is the cache gate's part alone.
    load: Option<[&'r [u64]; 3]>,
    trust: IndexTrust<'r>,
    /// The cache gate's `(capacity, used)` columns, when it is on and they were sent.
    gate: Option<(&'r [f64], &'r [f64])>,
    prompt_tokens: f64,
    block_size: f64,
    /// `1 / block_size` when that is exact (a power of two), so that the division per row is
    /// a multiplication giving the same bits; `None` otherwise.
    per_block: Option<f64>,
    request_blocks: f64,
}

impl<'r> Pricing<'r> {
    fn of(selector: &'r DefaultSelector, ctx: &Context<'_>, rows: &Rows<'r>) -> Self {
        let n = rows.len();
        let block_size = ctx.block_size().max(1);
        Pricing {
            selector,
            overlap: rows
                .overlap()
                .map(|o| [&o.device[..n], &o.host[..n], &o.disk[..n]]),
            load: rows.load().map(|l| {
                [
                    &l.active_prefill_tokens[..n],
                    &l.decode_blocks[..n],
                    &l.active_requests[..n],
                ]
            }),
            trust: rows.kv_index_trust(),
            gate: selector
                .gate_columns(rows)
                .filter(|(capacity, used)| capacity.len() == n && used.len() == n),
            prompt_tokens: ctx.prompt_tokens() as f64,
            block_size: f64::from(block_size),
            per_block: block_size
                .is_power_of_two()
                .then(|| 1.0 / f64::from(block_size)),
            request_blocks: ctx.request_blocks() as f64,
        }
    }

    /// The costs of rows `start..start + out.len()` into `out`, each the same bits as
    /// [`Pricing::cost`]. The common case (overlap and load sent, every row current, a
    /// power-of-two block size) is one branch-free loop over the columns, so that it
    /// vectorises; anything else is priced row by row.
    fn costs(&self, start: usize, out: &mut [f64]) {
        match (self.overlap, self.load, self.per_block) {
            (Some(overlap), Some(load), Some(per_block)) if self.trust.all_current() => {
                let columns = (overlap, load, per_block);
                match self.gate {
                    None => self.costs_current(columns, None, start, out),
                    Some(gate) => self.costs_current(columns, Some(gate), start, out),
                }
            }
            _ => {
                for (i, cost) in (start..).zip(out.iter_mut()) {
                    *cost = self.cost(i);
                }
            }
        }
    }

    /// [`Pricing::cost`] with every row current and `1 / block_size` exact, over a run of
    /// rows. Always inlined into both arms of [`Pricing::costs`], so `gate` is a constant in
    /// each.
    #[inline(always)]
    #[allow(clippy::type_complexity)]
    fn costs_current(
        &self,
        ([device, host, disk], [prefill, decode, active], per_block): (
            [&[f64]; 3],
            [&[u64]; 3],
            f64,
        ),
        gate: Option<(&[f64], &[f64])>,
        start: usize,
        out: &mut [f64],
    ) {
        let n = out.len();
        // Every column cut to exactly the run, so the loop's reads need no bounds checks.
        fn run<T>(column: &[T], start: usize, n: usize) -> &[T] {
            &column[start..][..n]
        }
        let (device, host, disk) = (
            run(device, start, n),
            run(host, start, n),
            run(disk, start, n),
        );
        let (prefill, decode, active) = (
            run(prefill, start, n),
            run(decode, start, n),
            run(active, start, n),
        );
        let gate = gate.map(|(capacity, used)| (run(capacity, start, n), run(used, start, n)));
        for k in 0..n {
            let row = RowInputs {
                device: device[k],
                host: host[k],
                disk: disk[k],
                prefill: prefill[k],
                decode: decode[k],
                active: active[k],
            };
            let load = self.load_cost(row, Some(per_block));
            out[k] = match gate {
                None => load,
                Some((capacity, used)) => load + self.gate_cost(capacity[k], used[k], row.device),
            };
        }
    }

    /// Row `i`'s cost (see [`Pricing::load_cost`] and [`Pricing::gate_cost`]). A row whose KV
    /// index is not current (`trust`) is priced load-only: its overlap reads 0.
    /// Always inlined: as a call per row it re-read every field it needs.
    #[inline(always)]
    fn cost(&self, i: usize) -> f64 {
        let trust = &self.trust;
        let device = self.overlap.map_or(0.0, |[d, _, _]| trust.overlap(i, d[i]));
        let load = match (self.overlap, self.load) {
            (Some([_, host, disk]), Some([prefill, decode, active])) => {
                let row = RowInputs {
                    device,
                    host: trust.overlap(i, host[i]),
                    disk: trust.overlap(i, disk[i]),
                    prefill: prefill[i],
                    decode: decode[i],
                    active: active[i],
                };
                self.load_cost(row, self.per_block)
            }
            _ => 0.0,
        };
        match self.gate {
            None => load,
            Some((capacity, used)) => load + self.gate_cost(capacity[i], used[i], device),
        }
    }

    /// The cost of a row with the load columns (docs/configuration.md, `default`):
    ///
    /// ```text
    /// prefill_load_scale * (max(0, (active_prefill_tokens + isl) / block_size - credit)
    ///                       - (overlap_credit - 1) * device)
    ///   + decode_blocks + decode_active_request_weight * active_requests
    /// ```
    ///
    /// The one place the formula is written: [`Pricing::cost`] and [`Pricing::costs_current`]
    /// both call it, so a run of rows is priced as each row alone. `per_block` is `1 /
    /// block_size` when that is exact (then a multiplication giving the same bits), else `None`.
    #[inline(always)]
    fn load_cost(&self, row: RowInputs, per_block: Option<f64>) -> f64 {
        let s = self.selector;
        let credit = row.device + s.host_weight * row.host + s.disk_weight * row.disk;
        let tokens = row.prefill as f64 + self.prompt_tokens;
        let blocks = match per_block {
            Some(per_block) => tokens * per_block,
            None => tokens / self.block_size,
        };
        let mut prefill = (blocks - credit).max(0.0);
        // Device credit beyond 1.0 is a reuse bonus kept outside the clamp: a row holding the
        // whole prompt still counts its backlog, and more cached blocks still win. (Skipped at
        // exactly 1.0, so the formula, NaN handling included, is the 1.0 one.)
        let bonus = s.overlap_credit - 1.0;
        if bonus != 0.0 {
            prefill -= bonus * if row.device.is_nan() { 0.0 } else { row.device };
        }
        s.prefill_load_scale * prefill
            + row.decode as f64
            + s.decode_active_request_weight * row.active as f64
    }

    /// The cache gate's part of a row's cost: `live_eviction_weight * prefill_load_scale`
    /// times [`DefaultSelector::live_eviction`].
    #[inline(always)]
    fn gate_cost(&self, capacity: f64, used: f64, device: f64) -> f64 {
        let s = self.selector;
        s.live_eviction_weight
            * s.prefill_load_scale
            * DefaultSelector::live_eviction(self.request_blocks, capacity, used, device)
    }
}

/// One row's inputs to [`Pricing::load_cost`], its overlap already read through the trust
/// check (0 for a row whose index is not current).
#[derive(Clone, Copy)]
struct RowInputs {
    device: f64,
    host: f64,
    disk: f64,
    prefill: u64,
    decode: u64,
    active: u64,
}

impl Policy for DefaultSelector {
    fn inputs(&self) -> Inputs {
        Inputs::CACHE | Inputs::LOAD
    }

    fn pick(&self, ctx: &Context<'_>, rows: &Rows<'_>) -> Result<usize, PickError> {
        let best = self.best(ctx, rows);
        last_pick::remember(self, ctx, best);
        best.map(|(i, _)| i)
            .ok_or_else(|| PickError::new("no rows"))
    }

    /// With the `EXPLAIN_TOKEN` of the pick just made (serve sends one on every request), that
    /// pick is described, not made again; otherwise it is made here.
    fn explain(&self, ctx: &Context<'_>, rows: &Rows<'_>) -> Option<Explanation> {
        let (i, cost) = match last_pick::recall(self, ctx) {
            Some(best) => best,
            None => self.best(ctx, rows)?,
        };
        let mut e = Explanation::new(i, "lowest_cost")
            .field("cost", cost)
            .field("rows", rows.len() as f64)
            .field("prefill_load_scale", self.prefill_load_scale)
            .field(
                "decode_active_request_weight",
                self.decode_active_request_weight,
            )
            .field("host_cache_hit_weight", self.host_weight)
            .field("disk_cache_hit_weight", self.disk_weight);
        // Only when set away from their defaults, so an explanation under the default settings
        // reads as it always did.
        if self.overlap_credit != 1.0 {
            e = e.field("overlap_credit", self.overlap_credit);
        }
        if self.tie_break != TieBreak::LowestRow {
            e = e.label("tie_break", self.tie_break.as_str());
        }
        if self.room != Room::Free {
            e = e.label("room", self.room.as_str());
        }
        if self.live_eviction_weight != 0.0 {
            e = e.field("live_eviction_weight", self.live_eviction_weight);
        }
        Some(rows.kv_index_trust().explain(rows, e))
    }
}

/// The default's last pick on this thread, kept under the host's `EXPLAIN_TOKEN` for the
/// `explain` that follows it (`plugin_api::EXPLAIN_TOKEN`; the two-tier plugin keeps its own
/// the same way): the row and its cost.
mod last_pick {
    use std::cell::Cell;

    use plugin_api::abi::ExtensionValue;
    use plugin_api::{Context, EXPLAIN_TOKEN};

    use super::DefaultSelector;

    thread_local! {
        /// (instance, token, row, cost).
        static LAST: Cell<Option<(usize, u64, usize, f64)>> = const { Cell::new(None) };
    }

    fn token(ctx: &Context<'_>) -> Option<u64> {
        match ctx.extension(EXPLAIN_TOKEN)? {
            ExtensionValue::U64(token) => Some(token),
            _ => None,
        }
    }

    fn instance(selector: &DefaultSelector) -> usize {
        selector as *const DefaultSelector as usize
    }

    pub(super) fn remember(
        selector: &DefaultSelector,
        ctx: &Context<'_>,
        best: Option<(usize, f64)>,
    ) {
        let last = token(ctx)
            .zip(best)
            .map(|(token, (row, cost))| (instance(selector), token, row, cost));
        // `try_with`: a pick during thread teardown keeps nothing.
        let _ = LAST.try_with(|cell| cell.set(last));
    }

    /// The pick with this call's token, taken (it answers one `explain`).
    pub(super) fn recall(selector: &DefaultSelector, ctx: &Context<'_>) -> Option<(usize, f64)> {
        let token = token(ctx)?;
        let (of, kept, row, cost) = LAST.try_with(Cell::take).ok()??;
        (of == instance(selector) && kept == token).then_some((row, cost))
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

    /// Dynamo's weights: the cost formula's own tests are written for them.
    fn selector() -> DefaultSelector {
        DefaultSelector::new(&BuiltinSettings::dynamo())
    }

    #[test]
    fn creating_a_default_instance_logs_the_settings_in_force() {
        let (created, events) = plugin_api::testing::capture_logs(|| {
            Builtin::Default.create(
                "d",
                r#"{"overlap_credit": 2.0}"#,
                &BuiltinSettings::default(),
            )
        });
        assert!(created.is_ok());
        let line = events
            .iter()
            .find(|e| e.contains("built-in default selector created"))
            .unwrap_or_else(|| panic!("{events:?}"));
        for part in [
            "instance=d",
            "prefill_load_scale=20",
            "overlap_credit=2",
            "tie_break=spread",
        ] {
            assert!(line.contains(part), "`{part}` not in {line}");
        }
    }

    #[test]
    fn host_defaults_are_the_measured_best_settings() {
        let d = BuiltinSettings::default();
        assert_eq!(
            (d.prefill_load_scale, d.overlap_credit, d.tie_break),
            (20.0, 1.5, TieBreak::Spread)
        );
        assert_eq!(d.decode_active_request_weight, 0.0);
        // And what a bare config gets.
        let config = router_config::RouterConfig::default();
        let ds = config.default_selector;
        assert_eq!(
            (ds.prefill_load_scale, ds.overlap_credit, ds.tie_break),
            (20.0, 1.5, TieBreak::Spread)
        );
        // Dynamo's weights stay one setting away.
        let old = BuiltinSettings::dynamo();
        assert_eq!(
            (old.prefill_load_scale, old.overlap_credit, old.tie_break),
            (1.0, 1.0, TieBreak::LowestRow)
        );
    }

    /// `f` over `rows` with `request`'s context, carrying an `EXPLAIN_TOKEN` when given.
    fn with_token<R>(
        rows: &TestRows,
        token: Option<u64>,
        f: impl FnOnce(&Context<'_>, &Rows<'_>) -> R,
    ) -> R {
        let view = rows.view(Inputs::CACHE | Inputs::LOAD);
        let rows = Rows::from_raw(&view).expect("a consistent view");
        TestRequest::new(160, 16).with_explain_token(token, |ctx| f(ctx, &rows))
    }

    #[test]
    fn explain_with_the_picks_token_describes_that_pick_and_otherwise_decides() {
        let policy = selector();
        // 10 blocks of prompt, cached whole on worker `on`: the lowest cost.
        let cached_on = |on: u64| {
            let row = |w: u64| TestRow::new(w, 0).device(if w == on { 10.0 } else { 0.0 });
            TestRows::new(vec![row(29), row(41)])
        };
        let (on_29, on_41) = (cached_on(29), cached_on(41));
        let pick = |rows: &TestRows, token| with_token(rows, token, |c, r| policy.pick(c, r));
        let explain = |rows: &TestRows, token| {
            with_token(rows, token, |c, r| policy.explain(c, r)).expect("an explanation")
        };
        assert_eq!(pick(&on_29, Some(5)), Ok(0));
        let e = explain(&on_29, Some(5));
        assert_eq!(
            e,
            explain(&on_29, None),
            "the same explanation as deciding again"
        );
        // The kept pick answers (shown by a host breaking the contract: the same token over
        // another input still describes the pick it named)...
        assert_eq!(pick(&on_29, Some(6)), Ok(0));
        assert_eq!(explain(&on_41, Some(6)).row, 0);
        // ...once, for its own token and instance only.
        assert_eq!(explain(&on_41, Some(6)).row, 1);
        assert_eq!(pick(&on_29, Some(7)), Ok(0));
        assert_eq!(explain(&on_41, Some(8)).row, 1);
        assert_eq!(pick(&on_29, Some(9)), Ok(0));
        assert_eq!(explain(&on_41, None).row, 1);
        assert_eq!(pick(&on_29, Some(10)), Ok(0));
        let other = selector();
        assert_eq!(
            with_token(&on_41, Some(10), |c, r| other.explain(c, r))
                .expect("an explanation")
                .row,
            1
        );
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
    fn default_prices_a_row_whose_index_is_not_current_load_only() {
        use plugin_api::KvIndexState;
        let request = TestRequest::new(160, 16);
        // Worker 41 holds 6 of the 10 prompt blocks (cost 4 against 10) but one more request.
        let rows = || {
            TestRows::new(vec![
                TestRow::new(29, 0),
                TestRow::new(41, 0).device(6.0).host(2.0).active(1),
            ])
        };
        for settings in [BuiltinSettings::dynamo(), BuiltinSettings::default()] {
            let policy = DefaultSelector::new(&settings);
            let current = rows().kv_index_states(&[KvIndexState::Current; 2]);
            assert_eq!(
                current.pick_worker(&policy, &request).unwrap().worker_id,
                41
            );
            let e = current.explain(&policy, &request).unwrap();
            assert_eq!(e.reason, "lowest_cost");
            assert_eq!(e.get_label("kv_load_only"), None);
            for state in [
                KvIndexState::Unknown,
                KvIndexState::Stale,
                KvIndexState::Lagging,
            ] {
                let rows = rows().kv_index_states(&[KvIndexState::Current, state]);
                // Without its overlap 41 costs what 29 does and carries more load.
                assert_eq!(
                    rows.pick_worker(&policy, &request).unwrap().worker_id,
                    29,
                    "{state}"
                );
                let e = rows.explain(&policy, &request).unwrap();
                assert_eq!(e.reason, "lowest_cost_kv_load_only");
                assert_eq!(e.get_label("kv_load_only"), Some(&*format!("41:0={state}")));
            }
        }
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
        let settings = BuiltinSettings::default();
        let err = Builtin::Default
            .create("t", r#"{"prefill_load_scale": -1}"#, &settings)
            .err()
            .unwrap();
        assert_eq!(err.key(), "prefill_load_scale");
        let err = Builtin::RoundRobin
            .create("t", r#"{"speed": 1}"#, &settings)
            .err()
            .unwrap();
        assert_eq!(err.key(), "speed");
    }

    fn with(settings: BuiltinSettings) -> DefaultSelector {
        DefaultSelector::new(&settings)
    }

    /// The default's pick by definition: every row keyed in full, `(cost, tie key)`; counts
    /// the decisions in which more than one row had the lowest cost.
    struct ByDefinition(DefaultSelector, AtomicU64);

    impl Policy for ByDefinition {
        fn inputs(&self) -> Inputs {
            Inputs::CACHE | Inputs::LOAD
        }

        fn pick(&self, ctx: &Context<'_>, rows: &Rows<'_>) -> Result<usize, PickError> {
            let d = &self.0;
            let pricing = Pricing::of(d, ctx, rows);
            let room = match d.room {
                Room::Free => ties::RoomColumns::of(rows),
                Room::NotRecent => ties::RoomColumns::not_recent(rows),
            };
            let request = ties::request_key(ctx);
            let key = |i: usize| d.tie_key(request, room.as_ref(), i, rows.row(i));
            let lowest = (0..rows.len())
                .map(|i| pricing.cost(i))
                .fold(f64::INFINITY, f64::min);
            if (0..rows.len())
                .filter(|&i| pricing.cost(i) == lowest)
                .count()
                > 1
            {
                self.1.fetch_add(1, Ordering::Relaxed);
            }
            (0..rows.len())
                .min_by(|&a, &b| {
                    let (ca, cb) = (pricing.cost(a), pricing.cost(b));
                    assert!(!ca.is_nan() && !cb.is_nan());
                    ca.total_cmp(&cb).then(key(a).cmp(&key(b)))
                })
                .ok_or_else(|| PickError::new("no rows"))
        }
    }

    /// Asserts, inside a pick, that pricing a run of rows gives every row the same bits as
    /// pricing it alone, for every run.
    struct RunsPriceAsRows(DefaultSelector);

    impl Policy for RunsPriceAsRows {
        fn inputs(&self) -> Inputs {
            Inputs::CACHE | Inputs::LOAD
        }

        fn pick(&self, ctx: &Context<'_>, rows: &Rows<'_>) -> Result<usize, PickError> {
            let pricing = Pricing::of(&self.0, ctx, rows);
            let mut out = [0.0; CHUNK];
            for start in 0..rows.len() {
                for len in [1, 3, CHUNK.min(rows.len() - start)] {
                    let out = &mut out[..len.min(rows.len() - start)];
                    pricing.costs(start, out);
                    for (i, cost) in (start..).zip(out.iter()) {
                        assert_eq!(cost.to_bits(), pricing.cost(i).to_bits(), "row {i}");
                    }
                }
            }
            Ok(0)
        }
    }

    /// A seeded xorshift generator of values below its argument: reproducible random cases.
    fn xorshift(mut x: u64) -> impl FnMut(u64) -> u64 {
        move |below| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % below
        }
    }

    #[test]
    fn a_run_of_rows_is_priced_as_each_row_alone() {
        let mut rng = xorshift(0x2545_f491_4f6c_dd1d);
        // Overlaps that are NaN, infinite, negative or fractional; loads past 2^53 (where
        // converting to f64 rounds) and at the top of u64.
        let overlaps = [0.0, 1.5, 7.0, -2.0, f64::NAN, f64::INFINITY, 1e300];
        let counts = [0, 3, 17, 1 << 53 | 1, u64::MAX - 1, u64::MAX];
        for case in 0..200u64 {
            let settings = BuiltinSettings {
                live_eviction_weight: [0.0, 0.25][(case % 2) as usize],
                overlap_credit: [1.0, 2.5][(case / 2 % 2) as usize],
                ..BuiltinSettings::default()
            };
            let n = 1 + rng(2 * CHUNK as u64 + 5) as usize;
            let rows: Vec<TestRow> = (0..n)
                .map(|i| {
                    let overlap = [(); 3].map(|_| overlaps[rng(7) as usize]);
                    let load = [(); 3].map(|_| counts[rng(6) as usize]);
                    TestRow::new(i as u64, 0)
                        .device(overlap[0])
                        .host(overlap[1])
                        .disk(overlap[2])
                        .active(load[0])
                        .prefill_tokens(load[1])
                        .decode_blocks(load[2])
                })
                .collect();
            let capacity = (0..n)
                .map(|_| [f64::NAN, 4.0, 1e6][rng(3) as usize])
                .collect();
            let recent = (0..n)
                .map(|_| [0.0, 2.0, f64::NAN][rng(3) as usize])
                .collect();
            let rows = TestRows::new(rows)
                .kv_capacity_blocks(capacity)
                .kv_recent_device_blocks(recent);
            let block_size = [16, 12][(case / 4 % 2) as usize];
            let request = TestRequest::new(rng(5_000), block_size);
            let probe = RunsPriceAsRows(with(settings));
            assert_eq!(rows.pick(&probe, &request), Ok(0), "case {case}");
        }
    }

    #[test]
    fn the_scan_picks_what_keying_every_row_in_full_picks() {
        let mut rng = xorshift(0x9e37_79b9_7f4a_7c15);
        use plugin_api::KvIndexState;
        let states = [
            KvIndexState::Current,
            KvIndexState::Current,
            KvIndexState::Stale,
        ];
        let tied = AtomicU64::new(0);
        for case in 0..4_000u64 {
            let settings = BuiltinSettings {
                tie_break: [TieBreak::Spread, TieBreak::LowestRow][(case % 2) as usize],
                room: [Room::Free, Room::NotRecent][(case / 2 % 2) as usize],
                live_eviction_weight: [0.0, 1.0][(case / 4 % 2) as usize],
                ..BuiltinSettings::default()
            };
            let selector = with(settings);
            // Mostly within one chunk of the scan, every eighth case over several.
            let n = 1 + rng(if case % 8 == 7 { 3 * CHUNK as u64 } else { 20 }) as usize;
            // Few distinct values, so that costs tie often.
            let rows: Vec<TestRow> = (0..n)
                .map(|_| {
                    TestRow::new(1 + rng(4), rng(2) as u32)
                        .device(rng(2) as f64)
                        .host((rng(4) / 3) as f64)
                        .active(rng(2))
                        .prefill_tokens(16 * rng(2))
                        .decode_blocks(rng(2))
                })
                .collect();
            let mut rows = TestRows::new(rows);
            if case % 3 > 0 {
                // Some rows not current, or (every third case) all current.
                let states = &states[..if case % 3 == 1 { 3 } else { 1 }];
                let trust: Vec<_> = (0..n)
                    .map(|_| states[rng(states.len() as u64) as usize])
                    .collect();
                rows = rows
                    .kv_index_states(&trust)
                    .kv_indexed_device_blocks((0..n).map(|_| rng(4) as f64).collect())
                    .kv_capacity_blocks((0..n).map(|_| 2.0 + rng(3) as f64).collect());
            }
            if case % 5 > 2 {
                rows = rows.kv_recent_device_blocks((0..n).map(|_| rng(2) as f64).collect());
            }
            let block_size = [16, 12][(case % 7 / 6) as usize];
            let request =
                TestRequest::new(32 + rng(17), block_size).session(&format!("s{}", rng(9)));
            let picked = rows.pick(&selector, &request);
            let definition = ByDefinition(selector, AtomicU64::new(0));
            let defined = rows.pick(&definition, &request);
            assert_eq!(picked, defined, "case {case}");
            tied.fetch_add(definition.1.into_inner(), Ordering::Relaxed);
        }
        // Rows tied the lowest cost in about a fifth of the cases.
        let tied = tied.into_inner();
        assert!(tied > 500, "{tied} decisions with tied rows");
    }

    #[test]
    fn overlap_credit_beyond_one_is_a_bonus_outside_the_clamp() {
        let request = TestRequest::new(160, 16);
        let credit = |overlap_credit| {
            with(BuiltinSettings {
                overlap_credit,
                ..BuiltinSettings::dynamo()
            })
        };
        // 41 caches the whole prompt (10 blocks) but has 320 tokens (20 blocks) pending; 29 is
        // cold and idle (cost 10). 41 costs 20 at 1.0, 10 at 2.0 (a tie: lowest row), 0 at 3.0.
        let rows = TestRows::new(vec![
            TestRow::new(29, 0),
            TestRow::new(41, 0).device(10.0).prefill_tokens(320),
        ]);
        assert_eq!(
            rows.pick_worker(&credit(1.0), &request).unwrap().worker_id,
            29
        );
        let e = rows.explain(&credit(2.0), &request).unwrap();
        assert_eq!((rows.row(e.row).worker_id, e.get("cost")), (29, Some(10.0)));
        assert_eq!(e.get("overlap_credit"), Some(2.0));
        assert_eq!(
            rows.pick_worker(&credit(3.0), &request).unwrap().worker_id,
            41
        );
        // Both rows cache the whole prompt; 29 has 10 blocks pending, 41 none. A credit clamped
        // with the backlog (Dynamo's `overlap_score_credit`) prices both at 0 from 2.0 up and
        // ties them; here the backlog still counts: 41 wins at every credit.
        let cached = TestRows::new(vec![
            TestRow::new(29, 0).device(10.0).prefill_tokens(160),
            TestRow::new(41, 0).device(10.0),
        ]);
        for c in [1.0, 1.5, 2.0, 3.0, 10.0] {
            assert_eq!(
                cached.pick_worker(&credit(c), &request).unwrap().worker_id,
                41,
                "{c}"
            );
        }
        // Below 1.0 a cached block saves less than its prefill: 0 credit ignores the cache.
        let rows = TestRows::new(vec![
            TestRow::new(29, 0),
            TestRow::new(41, 0).device(6.0).decode_blocks(1),
        ]);
        assert_eq!(
            rows.pick_worker(&credit(0.0), &request).unwrap().worker_id,
            29
        );
        assert_eq!(
            rows.pick_worker(&credit(1.0), &request).unwrap().worker_id,
            41
        );
        // Only device blocks get it: 29's 4 device blocks cost 6 at 1.0 and 4 at 1.5, 41's 6
        // host blocks (credit 4.5) 5.5 at both.
        let rows = TestRows::new(vec![
            TestRow::new(29, 0).device(4.0),
            TestRow::new(41, 0).host(6.0),
        ]);
        assert_eq!(
            rows.pick_worker(&credit(1.0), &request).unwrap().worker_id,
            41
        );
        assert_eq!(
            rows.pick_worker(&credit(1.5), &request).unwrap().worker_id,
            29
        );
    }

    #[test]
    fn overlap_credit_of_one_is_the_original_formula_and_not_explained() {
        let request = TestRequest::new(160, 16);
        let rows = TestRows::new(vec![TestRow::new(29, 0).device(f64::NAN)]);
        let e = rows.explain(&selector(), &request).unwrap();
        // A NaN credit clamps to 0, as it always did.
        assert_eq!(e.get("cost"), Some(0.0));
        assert_eq!(e.get("overlap_credit"), None);
        assert_eq!(e.get_label("tie_break"), None);
    }

    /// Four idle, cold rows: every request ties on all of them.
    fn idle_rows() -> Vec<TestRow> {
        (0..4).map(|w| TestRow::new(10 + w, 0)).collect()
    }

    #[test]
    fn spread_breaks_ties_by_request_and_row_whatever_the_row_order() {
        let spread = with(BuiltinSettings {
            tie_break: TieBreak::Spread,
            ..BuiltinSettings::dynamo()
        });
        let mut counts = [0u32; 4];
        for isl in 1..=400u64 {
            let request = TestRequest::new(isl * 7, 16);
            let mut order = idle_rows();
            let first = TestRows::new(order.clone())
                .pick_worker(&spread, &request)
                .unwrap();
            for shift in 1..4 {
                order.rotate_left(1);
                let rows = TestRows::new(order.clone());
                assert_eq!(
                    rows.pick_worker(&spread, &request).unwrap(),
                    first,
                    "{isl} {shift}"
                );
                // explain describes the row pick chose.
                let e = rows.explain(&spread, &request).unwrap();
                assert_eq!(rows.row(e.row), first);
                assert_eq!(e.get_label("tie_break"), Some("spread"));
            }
            counts[(first.worker_id - 10) as usize] += 1;
        }
        // Spread: every row takes a fair share (100 expected each).
        assert!(
            counts.iter().all(|&c| (60..=140).contains(&c)),
            "{counts:?}"
        );
        // Lowest row: all 400 on worker 10.
        for isl in 1..=400u64 {
            let request = TestRequest::new(isl * 7, 16);
            let rows = TestRows::new(idle_rows());
            assert_eq!(
                rows.pick_worker(&selector(), &request).unwrap().worker_id,
                10
            );
        }
        // The session id takes part: the same prompt length from many sessions spreads too.
        let mut seen = std::collections::BTreeSet::new();
        for s in 0..64 {
            let request = TestRequest::new(160, 16).session(&format!("session-{s:05}"));
            seen.insert(
                TestRows::new(idle_rows())
                    .pick_worker(&spread, &request)
                    .unwrap(),
            );
        }
        assert_eq!(seen.len(), 4, "{seen:?}");
        // Only exact ties: a cheaper row always wins.
        let rows = TestRows::new(vec![
            TestRow::new(10, 0).decode_blocks(1),
            TestRow::new(11, 0),
        ]);
        for isl in 1..50u64 {
            let request = TestRequest::new(isl, 16);
            assert_eq!(rows.pick_worker(&spread, &request).unwrap().worker_id, 11);
        }
    }

    #[test]
    fn the_cache_gate_prices_evicting_live_cache_and_is_off_without_capacity() {
        let gated = DefaultSelector::new(&BuiltinSettings::default());
        assert_eq!(gated.live_eviction_weight, 0.25);
        let off = DefaultSelector {
            live_eviction_weight: 0.0,
            ..gated
        };
        // 20-block prompt. Row 10 caches 2 of its blocks, but its full cache is all in recent
        // use: storing the other 18 evicts 18 live blocks (cost 20 x (18 - 1) + 0.25 x 20 x 18
        // = 430). Row 11 caches nothing and its full cache went cold: the 20 blocks evict
        // nothing live (cost 400).
        let request = TestRequest::new(320, 16);
        let rows = || {
            TestRows::new(vec![TestRow::new(10, 0).device(2.0), TestRow::new(11, 0)])
                .kv_capacity_blocks(vec![80.0; 2])
                .kv_indexed_device_blocks(vec![80.0; 2])
        };
        let recent = rows().kv_recent_device_blocks(vec![80.0, 10.0]);
        assert_eq!(recent.pick_worker(&off, &request).unwrap().worker_id, 10);
        assert_eq!(recent.pick_worker(&gated, &request).unwrap().worker_id, 11);
        let e = recent.explain(&gated, &request).unwrap();
        assert_eq!(e.get("live_eviction_weight"), Some(0.25));
        // Without the recent column every indexed block counts as live: row 10 evicts 18
        // (430), row 11 all 20 (400 + 100): the cache credit decides.
        assert_eq!(rows().pick_worker(&gated, &request).unwrap().worker_id, 10);
        // Capacity unknown (no column, or NaN): the gate adds nothing, whatever else is sent.
        let unknown = TestRows::new(vec![TestRow::new(10, 0).device(2.0), TestRow::new(11, 0)])
            .kv_indexed_device_blocks(vec![80.0; 2])
            .kv_recent_device_blocks(vec![80.0, 10.0]);
        let nan = rows()
            .kv_capacity_blocks(vec![f64::NAN; 2])
            .kv_recent_device_blocks(vec![80.0, 10.0]);
        for rows in [&unknown, &nan] {
            assert_eq!(rows.pick_worker(&gated, &request).unwrap().worker_id, 10);
            assert_eq!(
                rows.explain(&gated, &request).unwrap().get("cost"),
                rows.explain(&off, &request).unwrap().get("cost")
            );
        }
        let err = Builtin::Default
            .create(
                "d",
                r#"{"live_eviction_weight": -1}"#,
                &BuiltinSettings::default(),
            )
            .err()
            .expect("refused");
        assert_eq!(err.key(), "live_eviction_weight");
    }

    #[test]
    fn room_not_recent_sends_a_new_prompt_where_the_cache_is_coldest() {
        // The tie order alone: the cache gate (which also reads the recent column) off.
        let free = DefaultSelector {
            live_eviction_weight: 0.0,
            ..DefaultSelector::new(&BuiltinSettings::default())
        };
        let not_recent = DefaultSelector {
            room: Room::NotRecent,
            ..free
        };
        // Every cache is full; row 12's was not used lately, the others' all was (live sessions).
        let full = |recent: Option<Vec<f64>>| {
            let rows = TestRows::new(idle_rows())
                .kv_capacity_blocks(vec![80.0; 4])
                .kv_indexed_device_blocks(vec![80.0; 4]);
            match recent {
                Some(recent) => rows.kv_recent_device_blocks(recent),
                None => rows,
            }
        };
        let mut free_rows = std::collections::BTreeSet::new();
        for s in 0..50 {
            let request = TestRequest::new(160 + s, 16).session(&format!("s{s}"));
            let rows = full(Some(vec![80.0, 70.0, 5.0, 80.0]));
            assert_eq!(
                rows.pick_worker(&not_recent, &request).unwrap().worker_id,
                12
            );
            let e = rows.explain(&not_recent, &request).unwrap();
            assert_eq!(e.get_label("room"), Some("not_recent"));
            // `free` sees four full caches: a spread over all of them.
            free_rows.insert(rows.pick_worker(&free, &request).unwrap().worker_id);
            // Without the recent column (an older host, or the window off) it is `free`.
            assert_eq!(
                full(None).pick_worker(&not_recent, &request).unwrap(),
                full(None).pick_worker(&free, &request).unwrap()
            );
        }
        assert_eq!(free_rows.len(), 4, "{free_rows:?}");
        // Room only breaks exact ties: a row with less backlog still wins.
        let rows = TestRows::new(vec![
            TestRow::new(10, 0).decode_blocks(1),
            TestRow::new(11, 0),
        ])
        .kv_capacity_blocks(vec![80.0; 2])
        .kv_indexed_device_blocks(vec![80.0; 2])
        .kv_recent_device_blocks(vec![0.0, 80.0]);
        assert_eq!(
            rows.pick_worker(&not_recent, &TestRequest::new(160, 16))
                .unwrap()
                .worker_id,
            11
        );
    }

    #[test]
    fn spread_sends_a_prompt_nobody_caches_where_the_cache_has_most_room() {
        // The tie order alone: the cache gate, which prices the same room, off.
        let spread = DefaultSelector {
            live_eviction_weight: 0.0,
            ..DefaultSelector::new(&BuiltinSettings::default())
        };
        let caches = |indexed: Vec<f64>| {
            TestRows::new(idle_rows())
                .kv_capacity_blocks(vec![80.0; 4])
                .kv_indexed_device_blocks(indexed)
        };
        for s in 0..50 {
            let request = TestRequest::new(160 + s, 16).session(&format!("s{s}"));
            let rows = caches(vec![70.0, 60.0, 15.0, 80.0]);
            assert_eq!(rows.pick_worker(&spread, &request).unwrap().worker_id, 12);
        }
        // Room only breaks exact ties: a row with less backlog still wins.
        let rows = TestRows::new(vec![
            TestRow::new(10, 0).decode_blocks(1),
            TestRow::new(11, 0),
        ])
        .kv_capacity_blocks(vec![80.0; 2])
        .kv_indexed_device_blocks(vec![0.0, 80.0]);
        assert_eq!(
            rows.pick_worker(&spread, &TestRequest::new(160, 16))
                .unwrap()
                .worker_id,
            11
        );
        // `lowest_row` ignores room.
        let rows = caches(vec![70.0, 60.0, 15.0, 80.0]);
        assert_eq!(
            rows.pick_worker(&selector(), &TestRequest::new(160, 16))
                .unwrap()
                .worker_id,
            10
        );
    }

    #[test]
    fn new_parameters_are_validated_by_key() {
        let settings = BuiltinSettings::default();
        let err = Builtin::Default
            .create("t", r#"{"overlap_credit": -0.5}"#, &settings)
            .err()
            .unwrap();
        assert_eq!(err.key(), "overlap_credit");
        assert!(err.message().contains("-0.5"), "{}", err.message());
        let err = Builtin::Default
            .create("t", r#"{"tie_break": "random"}"#, &settings)
            .err()
            .unwrap();
        assert_eq!(err.key(), "tie_break");
        assert!(
            err.message()
                .contains("unknown variant `random`, expected `lowest_row` or `spread`"),
            "{}",
            err.message()
        );
        let err = Builtin::Default
            .create("t", r#"{"tie_break": 1}"#, &settings)
            .err()
            .unwrap();
        assert_eq!(err.key(), "tie_break");
        assert!(Builtin::Default
            .create(
                "t",
                r#"{"tie_break": "spread", "overlap_credit": 1.5}"#,
                &settings
            )
            .is_ok());
        for mode in TieBreak::ALL {
            assert_eq!(TieBreak::from_name(mode.as_str()), Some(mode));
        }
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
