//! Unit-test a policy with hand-written rows and no host.
//!
//! ```
//! use plugin_api::testing::{TestRequest, TestRow, TestRows};
//! # use plugin_api::{Context, Inputs, Policy, PickError, Rows};
//! # struct First;
//! # impl Policy for First {
//! #     fn inputs(&self) -> Inputs { Inputs::LOAD }
//! #     fn pick(&self, _: &Context<'_>, _: &Rows<'_>) -> Result<usize, PickError> { Ok(0) }
//! # }
//! let rows = TestRows::new(vec![
//!     TestRow::new(29, 0).active(0),
//!     TestRow::new(41, 0).device(6.0).active(4),
//! ]);
//! let request = TestRequest::new(160, 16).target(29, None);
//! let picked = rows.pick(&First, &request).unwrap();
//! assert_eq!(rows.row(picked).worker_id, 29);
//! ```
//!
//! [`TestRows::pick`] materialises only the columns the policy declares, as the host does, and
//! calls the policy directly. [`TestRows::pick_through_abi`] goes through the same adapter the
//! exported library uses, so panics and poisoning can be tested too.

use abi_stable::std_types::{RResult, RSlice, RStr};

use crate::abi::{
    Extension, ExtensionValue, ExtraColumn, Inputs, PickFailure, PolicyBox, RawAffinityTarget,
    RawCandidateView, RawRequestContext, RoleCode, RowId,
};
use crate::columns::Columns;
use crate::create::{CreateContext, CreateError, Parameters, PolicyType};
use crate::policy::{AffinityTarget, Context, Explanation, PickError, Policy, Role, Rows};

/// One hand-written row; unspecified signals are zero (and `available` is true).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TestRow {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub device: f64,
    pub host: f64,
    pub disk: f64,
    pub available: bool,
    pub active_requests: u64,
    pub active_prefill_tokens: u64,
    pub decode_blocks: u64,
}

impl TestRow {
    pub fn new(worker_id: u64, dp_rank: u32) -> Self {
        TestRow {
            worker_id,
            dp_rank,
            device: 0.0,
            host: 0.0,
            disk: 0.0,
            available: true,
            active_requests: 0,
            active_prefill_tokens: 0,
            decode_blocks: 0,
        }
    }
    pub fn device(mut self, blocks: f64) -> Self {
        self.device = blocks;
        self
    }
    pub fn host(mut self, blocks: f64) -> Self {
        self.host = blocks;
        self
    }
    pub fn disk(mut self, blocks: f64) -> Self {
        self.disk = blocks;
        self
    }
    pub fn active(mut self, requests: u64) -> Self {
        self.active_requests = requests;
        self
    }
    pub fn prefill_tokens(mut self, tokens: u64) -> Self {
        self.active_prefill_tokens = tokens;
        self
    }
    pub fn decode_blocks(mut self, blocks: u64) -> Self {
        self.decode_blocks = blocks;
        self
    }
    pub fn unavailable(mut self) -> Self {
        self.available = false;
        self
    }
}

/// A request for tests.
#[derive(Debug, Clone, PartialEq)]
pub struct TestRequest {
    pub prompt_tokens: u64,
    pub block_size: u32,
    pub role: Role,
    pub target: Option<(u64, Option<u32>)>,
    pub pinned: Option<RowId>,
    pub session_id: Option<String>,
    pub expected_output_tokens: Option<u64>,
    pub priority: i32,
}

impl TestRequest {
    pub fn new(prompt_tokens: u64, block_size: u32) -> Self {
        TestRequest {
            prompt_tokens,
            block_size,
            role: Role::Aggregated,
            target: None,
            pinned: None,
            session_id: None,
            expected_output_tokens: None,
            priority: 0,
        }
    }
    /// Set the advisory affinity target (`dp_rank: None` = worker-level).
    pub fn target(mut self, worker_id: u64, dp_rank: Option<u32>) -> Self {
        self.target = Some((worker_id, dp_rank));
        self
    }
    pub fn pinned(mut self, worker_id: u64, dp_rank: u32) -> Self {
        self.pinned = Some(RowId { worker_id, dp_rank });
        self
    }
    pub fn session(mut self, id: &str) -> Self {
        self.session_id = Some(id.to_string());
        self
    }
    pub fn role(mut self, role: Role) -> Self {
        self.role = role;
        self
    }

    /// `ceil(prompt_tokens / block_size)` (0 when block_size is 0).
    pub fn request_blocks(&self) -> u64 {
        if self.block_size == 0 {
            0
        } else {
            self.prompt_tokens.div_ceil(u64::from(self.block_size))
        }
    }

    /// Run `f` with the ABI context for this request.
    pub fn with_raw<R>(&self, f: impl FnOnce(&RawRequestContext<'_>) -> R) -> R {
        self.with_raw_extensions(RSlice::EMPTY, f)
    }

    /// Run `f` with the context for this request carrying `token` as its [`EXPLAIN_TOKEN`]
    /// extension, as a host sends it on a `pick` it will ask to explain and on that `explain`;
    /// with `None`, the context carries no extension (a host that sends no token).
    ///
    /// To test that `explain` describes the `pick` just made: build the rows once
    /// (`Rows::from_raw(&rows.view(inputs))`), then call `pick` and `explain` each inside a
    /// `with_explain_token` with the same token.
    ///
    /// ```
    /// use plugin_api::abi::ExtensionValue;
    /// use plugin_api::testing::TestRequest;
    /// use plugin_api::EXPLAIN_TOKEN;
    ///
    /// let request = TestRequest::new(160, 16);
    /// let token = |token| {
    ///     request.with_explain_token(token, |ctx| match ctx.extension(EXPLAIN_TOKEN) {
    ///         Some(ExtensionValue::U64(token)) => Some(token),
    ///         _ => None,
    ///     })
    /// };
    /// assert_eq!(token(Some(7)), Some(7));
    /// assert_eq!(token(None), None);
    /// ```
    ///
    /// [`EXPLAIN_TOKEN`]: crate::EXPLAIN_TOKEN
    pub fn with_explain_token<R>(
        &self,
        token: Option<u64>,
        f: impl FnOnce(&Context<'_>) -> R,
    ) -> R {
        let extension = token.map(|token| Extension {
            name: RStr::from_str(crate::EXPLAIN_TOKEN),
            value: ExtensionValue::U64(token),
        });
        let extensions = match &extension {
            Some(extension) => RSlice::from_slice(std::slice::from_ref(extension)),
            None => RSlice::EMPTY,
        };
        self.with_raw_extensions(extensions, |raw| f(&Context::from_raw(raw)))
    }

    fn with_raw_extensions<R>(
        &self,
        extensions: RSlice<'_, Extension<'_>>,
        f: impl FnOnce(&RawRequestContext<'_>) -> R,
    ) -> R {
        let raw = RawRequestContext {
            prompt_tokens: self.prompt_tokens,
            request_blocks: self.request_blocks(),
            block_size: self.block_size,
            role: match self.role {
                Role::Other(code) => RoleCode(code),
                role => role.code(),
            },
            affinity_target: self
                .target
                .map(|(worker_id, dp_rank)| {
                    RawAffinityTarget::from(AffinityTarget { worker_id, dp_rank })
                })
                .into(),
            pinned_worker: self.pinned.into(),
            session_id: crate::abi::opt_str(self.session_id.as_deref()),
            expected_output_tokens: self.expected_output_tokens.into(),
            priority: self.priority,
            extensions,
        };
        f(&raw)
    }
}

/// Hand-written rows, stored as the columns the host would pass.
#[derive(Debug, Clone, Default)]
pub struct TestRows {
    columns: Columns,
    /// Extra columns (name, one value per row), passed with the LOAD columns as a host does.
    extra: Vec<(&'static str, Vec<f64>)>,
}

impl TestRows {
    pub fn new(rows: Vec<TestRow>) -> Self {
        let mut c = Columns::default();
        for r in rows {
            c.worker_id.push(r.worker_id);
            c.dp_rank.push(r.dp_rank);
            c.device.push(r.device);
            c.host.push(r.host);
            c.disk.push(r.disk);
            c.available.push(r.available);
            c.active_requests.push(r.active_requests);
            c.active_prefill_tokens.push(r.active_prefill_tokens);
            c.decode_blocks.push(r.decode_blocks);
        }
        TestRows {
            columns: c,
            extra: Vec::new(),
        }
    }

    /// Add an extra column (e.g. [`crate::KV_CAPACITY_BLOCKS`]), one value per row; the policy
    /// sees it when it declares [`Inputs::LOAD`], as hosts send it. A column with a wrong number
    /// of values is passed as it is (a policy sees it as absent, see [`Rows::extra_column`]).
    pub fn extra_column(mut self, name: &'static str, values: Vec<f64>) -> Self {
        self.extra.retain(|(n, _)| *n != name);
        self.extra.push((name, values));
        self
    }

    /// Shorthand for the [`crate::KV_CAPACITY_BLOCKS`] column.
    pub fn kv_capacity_blocks(self, values: Vec<f64>) -> Self {
        self.extra_column(crate::KV_CAPACITY_BLOCKS, values)
    }

    /// The three indexed-blocks columns ([`crate::KV_INDEXED_DEVICE_BLOCKS`] and its host and
    /// disk siblings): `device` as given, nothing on the offload tiers.
    pub fn kv_indexed_device_blocks(self, device: Vec<f64>) -> Self {
        let zeros = vec![0.0; device.len()];
        self.extra_column(crate::KV_INDEXED_DEVICE_BLOCKS, device)
            .extra_column(crate::KV_INDEXED_HOST_BLOCKS, zeros.clone())
            .extra_column(crate::KV_INDEXED_DISK_BLOCKS, zeros)
    }

    /// The [`crate::KV_RECENT_DEVICE_BLOCKS`] column: each row's recently used device blocks.
    pub fn kv_recent_device_blocks(self, recent: Vec<f64>) -> Self {
        self.extra_column(crate::KV_RECENT_DEVICE_BLOCKS, recent)
    }

    /// The [`crate::KV_INDEX_STATE`] column: each row's KV-index state (sent with the CACHE
    /// columns, as hosts do).
    pub fn kv_index_states(self, states: &[crate::KvIndexState]) -> Self {
        let codes = states.iter().map(|s| s.code()).collect();
        self.extra_column(crate::KV_INDEX_STATE, codes)
    }

    pub fn len(&self) -> usize {
        self.columns.len()
    }

    pub fn is_empty(&self) -> bool {
        self.columns.is_empty()
    }

    /// Identity of row `i`.
    pub fn row(&self, i: usize) -> RowId {
        RowId {
            worker_id: self.columns.worker_id[i],
            dp_rank: self.columns.dp_rank[i],
        }
    }

    /// The columns, as the host would hold them.
    pub fn columns(&self) -> &Columns {
        &self.columns
    }

    /// The ABI view with only the `inputs` column groups present, as the host builds it
    /// (without the extra columns, which borrow a list the view cannot own; [`TestRows::pick`]
    /// and the other calls pass them).
    pub fn view(&self, inputs: Inputs) -> RawCandidateView<'_> {
        self.columns.view(inputs)
    }

    /// The view with the extra columns too, handed to `f`.
    fn with_view<R>(&self, inputs: Inputs, f: impl FnOnce(&RawCandidateView<'_>) -> R) -> R {
        // As hosts send them: the index states with the CACHE columns, the others with LOAD.
        let sent = |name: &str| {
            if name == crate::KV_INDEX_STATE {
                inputs.contains(Inputs::CACHE)
            } else {
                inputs.contains(Inputs::LOAD)
            }
        };
        let extra: Vec<ExtraColumn<'_>> = if inputs != Inputs::NONE {
            self.extra
                .iter()
                .filter(|(name, _)| sent(name))
                .map(|(name, values)| ExtraColumn {
                    name: RStr::from_str(name),
                    values: RSlice::from_slice(values),
                })
                .collect()
        } else {
            Vec::new()
        };
        let mut view = self.columns.view(inputs);
        view.extra_columns = RSlice::from_slice(&extra);
        f(&view)
    }

    /// Call `policy.pick` directly with the columns it declares.
    pub fn pick<P: Policy>(&self, policy: &P, request: &TestRequest) -> Result<usize, PickError> {
        self.call(policy, request, |p, ctx, rows| p.pick(ctx, rows))
    }

    /// Call `policy.explain` directly with the columns it declares.
    pub fn explain<P: Policy>(&self, policy: &P, request: &TestRequest) -> Option<Explanation> {
        self.call(policy, request, |p, ctx, rows| Ok(p.explain(ctx, rows)))
            .ok()
            .flatten()
    }

    /// The worker id `policy` picks (convenient for decision tables).
    pub fn pick_worker<P: Policy>(
        &self,
        policy: &P,
        request: &TestRequest,
    ) -> Result<RowId, PickError> {
        self.pick(policy, request).map(|i| self.row(i))
    }

    fn call<P: Policy, R>(
        &self,
        policy: &P,
        request: &TestRequest,
        f: impl FnOnce(&P, &Context<'_>, &Rows<'_>) -> Result<R, PickError>,
    ) -> Result<R, PickError> {
        self.with_view(policy.inputs(), |view| {
            let rows = Rows::from_raw(view).map_err(|e| PickError::new(e.0))?;
            request.with_raw(|raw| f(policy, &Context::from_raw(raw), &rows))
        })
    }

    /// Call an ABI policy object (e.g. from [`create`]) as the host would.
    pub fn pick_through_abi(
        &self,
        policy: &PolicyBox,
        request: &TestRequest,
    ) -> Result<usize, PickFailure> {
        self.with_view(policy.required_inputs(), |view| {
            request.with_raw(|raw| match policy.pick(raw, view) {
                RResult::ROk(i) => Ok(i),
                RResult::RErr(e) => Err(e),
            })
        })
    }
}

/// Parse `parameters_json` and create an instance of `T`, with the host defaults
/// (`host_cache_hit_weight` 0.75, `disk_cache_hit_weight` 0.25, block size 16).
pub fn create<T: PolicyType>(parameters_json: &str) -> Result<T::Policy, CreateError> {
    create_with::<T>(parameters_json, 0.75, 16)
}

/// Like [`create`] with a chosen `host_cache_hit_weight` and block size.
pub fn create_with<T: PolicyType>(
    parameters_json: &str,
    host_cache_hit_weight: f64,
    block_size: u32,
) -> Result<T::Policy, CreateError> {
    extern "C" fn discard(_: &crate::abi::LogRecord<'_>) {}
    let raw = crate::abi::RawCreateContext {
        instance_name: RStr::from_str("test"),
        host_cache_hit_weight,
        disk_cache_hit_weight: 0.25,
        block_size,
        log: crate::abi::HostLog {
            emit: discard,
            max_level: crate::abi::LogLevel::TRACE,
        },
        extensions: RSlice::EMPTY,
    };
    T::create(
        &Parameters::from_json(parameters_json),
        &CreateContext::from_raw(&raw),
    )
}

/// Create `T` and box it through the same adapter the exported library uses.
pub fn create_boxed<T: PolicyType>(parameters_json: &str) -> Result<PolicyBox, CreateError> {
    crate::export::into_policy_box(create_with::<T>(parameters_json, 0.75, 16)?)
}

/// Run `f` and return what it logged through `tracing` on this thread, one rendered event per
/// entry (`message key=value ...`, as the host receives it).
///
/// One process-wide subscriber (installed on first use) serves every capture and records into
/// the buffer of the thread that is capturing. A scoped subscriber per call would lose events:
/// `tracing` caches each callsite's interest across all live dispatchers, so a callsite first hit
/// on another thread while no capture was live could be cached as "never" and stay silent. This
/// subscriber answers `sometimes` for every callsite, so `enabled` is asked on every event. If
/// the process already has a different global subscriber, a scoped one is used instead.
pub fn capture_logs<R>(f: impl FnOnce() -> R) -> (R, Vec<String>) {
    use std::cell::RefCell;
    use std::sync::OnceLock;

    thread_local! {
        static CAPTURED: RefCell<Option<Vec<String>>> = const { RefCell::new(None) };
    }

    struct Capture;

    impl tracing::Subscriber for Capture {
        fn register_callsite(
            &self,
            _: &'static tracing::Metadata<'static>,
        ) -> tracing::subscriber::Interest {
            tracing::subscriber::Interest::sometimes()
        }
        fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
            CAPTURED.with(|c| c.try_borrow().is_ok_and(|c| c.is_some()))
        }
        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, event: &tracing::Event<'_>) {
            let mut text = crate::export::Render(String::new());
            event.record(&mut text);
            CAPTURED.with(|c| {
                if let Ok(mut c) = c.try_borrow_mut() {
                    if let Some(events) = c.as_mut() {
                        events.push(text.0.trim_start().to_string());
                    }
                }
            });
        }
        fn enter(&self, _: &tracing::span::Id) {}
        fn exit(&self, _: &tracing::span::Id) {}
    }

    static GLOBAL: OnceLock<bool> = OnceLock::new();
    let global = *GLOBAL.get_or_init(|| tracing::subscriber::set_global_default(Capture).is_ok());
    let outer = CAPTURED.with(|c| c.replace(Some(Vec::new())));
    let result = if global {
        f()
    } else {
        tracing::subscriber::with_default(Capture, f)
    };
    let events = CAPTURED.with(|c| c.replace(outer)).unwrap_or_default();
    (result, events)
}

/// A global allocator that counts this thread's allocations while [`count_allocations`] runs,
/// to prove a hot path allocation-free. Install it in a test binary:
///
/// ```
/// use plugin_api::testing::{count_allocations, CountingAllocator};
///
/// #[global_allocator]
/// static ALLOCATOR: CountingAllocator = CountingAllocator;
///
/// fn main() {
///     let (buffer, allocations) = count_allocations(|| vec![0u8; 64]);
///     assert_eq!((buffer.len(), allocations), (64, 1));
/// }
/// ```
pub struct CountingAllocator;

thread_local! {
    static COUNTING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static ALLOCATIONS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

fn count_one() {
    // `try_with`: thread-locals may already be gone while a thread shuts down.
    if COUNTING.try_with(std::cell::Cell::get).unwrap_or(false) {
        let _ = ALLOCATIONS.try_with(|a| a.set(a.get() + 1));
    }
}

// SAFETY: every call is forwarded to the system allocator unchanged.
unsafe impl std::alloc::GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        count_one();
        unsafe { std::alloc::System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        count_one();
        unsafe { std::alloc::System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        count_one();
        unsafe { std::alloc::System.realloc(ptr, layout, new_size) }
    }
}

/// Run `f` and return how many allocations this thread made inside it (counted only when
/// [`CountingAllocator`] is the global allocator; otherwise always 0).
pub fn count_allocations<R>(f: impl FnOnce() -> R) -> (R, u64) {
    ALLOCATIONS.with(|a| a.set(0));
    COUNTING.with(|c| c.set(true));
    let result = f();
    COUNTING.with(|c| c.set(false));
    (result, ALLOCATIONS.with(std::cell::Cell::get))
}
