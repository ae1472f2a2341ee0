//! Every type that crosses the host/plugin boundary, and nothing else.
//!
//! This module is the ABI. Its 1.0 layout is frozen: the host checks it field by field (through
//! `abi_stable`'s layout checker) when it loads a plugin, and refuses a library whose layout
//! differs. Later 1.x minors evolve it only in the ways that keep already-built plugins loading:
//!
//! * new root-module fields go after [`PolicyLibrary::create`] (the `last_prefix_field`) and are
//!   read as `Option`s;
//! * new policy-object methods go after [`PolicyObject::explain`] with a default (1.1 added
//!   `on_dispatch` and `on_complete` this way);
//! * new per-request context fields go into [`RawRequestContext::extensions`], new per-row signals
//!   into [`RawCandidateView::extra_columns`], keyed by name: an older plugin never looks at them.
//!
//! Plugin authors never touch these types: the safe layer in the crate root converts them.
//! Enumerations that may grow are plain integer codes (`u8`/`u32` newtypes), never Rust enums,
//! so a value added in a later minor cannot be undefined behaviour in an older plugin.

// `sabi_trait` expands to impls inside a generated module.
#![allow(non_local_definitions)]

use abi_stable::{
    declare_root_module_statics,
    library::RootModule,
    package_version_strings, sabi_trait,
    sabi_types::VersionStrings,
    std_types::{RBox, ROption, RResult, RSlice, RStr, RString, RVec},
    StableAbi,
};

/// Bit flags for the inputs a policy declares; the host materialises only declared columns.
#[repr(transparent)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Inputs(pub u32);

impl Inputs {
    /// No per-row signals beyond the row identities.
    pub const NONE: Inputs = Inputs(0);
    /// Overlap columns: device, host and disk blocks of the prompt already cached.
    pub const CACHE: Inputs = Inputs(1);
    /// Load columns: available, active requests, active prefill tokens, decode blocks.
    pub const LOAD: Inputs = Inputs(1 << 1);
    /// Every flag this API version knows.
    pub const KNOWN: Inputs = Inputs(Self::CACHE.0 | Self::LOAD.0);

    /// Whether every flag of `other` is set in `self`.
    pub const fn contains(self, other: Inputs) -> bool {
        self.0 & other.0 == other.0
    }

    /// Union of two flag sets.
    pub const fn union(self, other: Inputs) -> Inputs {
        Inputs(self.0 | other.0)
    }
}

impl std::ops::BitOr for Inputs {
    type Output = Inputs;
    fn bitor(self, rhs: Inputs) -> Inputs {
        self.union(rhs)
    }
}

impl std::fmt::Display for Inputs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut names = Vec::new();
        if self.contains(Inputs::CACHE) {
            names.push("CACHE".to_string());
        }
        if self.contains(Inputs::LOAD) {
            names.push("LOAD".to_string());
        }
        let unknown = self.0 & !Inputs::KNOWN.0;
        if unknown != 0 {
            names.push(format!("unknown({unknown:#x})"));
        }
        if names.is_empty() {
            f.write_str("NONE")
        } else {
            f.write_str(&names.join("|"))
        }
    }
}

/// Request role (a.k.a. stage), as a code so later minors can add roles.
#[repr(transparent)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RoleCode(pub u8);

impl RoleCode {
    pub const AGGREGATED: RoleCode = RoleCode(0);
    pub const PREFILL: RoleCode = RoleCode(1);
    pub const DECODE: RoleCode = RoleCode(2);
}

/// One candidate row: a worker and one of its data-parallel ranks.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RowId {
    pub worker_id: u64,
    pub dp_rank: u32,
}

/// Advisory session target. `dp_rank: None` matches every rank of the worker.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawAffinityTarget {
    pub worker_id: u64,
    pub dp_rank: ROption<u32>,
}

/// An optional borrowed string as it crosses the boundary.
pub fn opt_str(s: Option<&str>) -> ROption<RStr<'_>> {
    match s {
        Some(s) => ROption::RSome(RStr::from_str(s)),
        None => ROption::RNone,
    }
}

/// A per-request value added by a later 1.x minor (see [`RawRequestContext::extensions`]).
#[repr(C, u8)]
#[derive(StableAbi, Debug, Clone, Copy)]
pub enum ExtensionValue<'a> {
    U64(u64),
    I64(i64),
    F64(f64),
    Bool(bool),
    Str(RStr<'a>),
}

/// A named extension value.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy)]
pub struct Extension<'a> {
    pub name: RStr<'a>,
    pub value: ExtensionValue<'a>,
}

/// What the host knows about the request being routed. Borrowed for one call.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy)]
pub struct RawRequestContext<'a> {
    /// Prompt length (input sequence length) in tokens.
    pub prompt_tokens: u64,
    /// `ceil(prompt_tokens / block_size)`.
    pub request_blocks: u64,
    /// Tokens per KV block.
    pub block_size: u32,
    pub role: RoleCode,
    pub affinity_target: ROption<RawAffinityTarget>,
    pub pinned_worker: ROption<RowId>,
    pub session_id: ROption<RStr<'a>>,
    pub expected_output_tokens: ROption<u64>,
    pub priority: i32,
    /// Values added after 1.0, by name. Empty in 1.0 hosts.
    pub extensions: RSlice<'a, Extension<'a>>,
}

/// A per-row signal added by a later 1.x minor (see [`RawCandidateView::extra_columns`]).
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy)]
pub struct ExtraColumn<'a> {
    pub name: RStr<'a>,
    pub values: RSlice<'a, f64>,
}

/// The eligible rows, as index-aligned borrowed columns.
///
/// `worker_id` and `dp_rank` are always present. The overlap columns are present (length equal to
/// the row count) only when `present` contains [`Inputs::CACHE`], the load columns only with
/// [`Inputs::LOAD`]; otherwise they are empty.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy)]
pub struct RawCandidateView<'a> {
    pub present: Inputs,
    pub worker_id: RSlice<'a, u64>,
    pub dp_rank: RSlice<'a, u32>,
    pub device_blocks: RSlice<'a, f64>,
    pub host_blocks: RSlice<'a, f64>,
    pub disk_blocks: RSlice<'a, f64>,
    pub available: RSlice<'a, bool>,
    pub active_requests: RSlice<'a, u64>,
    pub active_prefill_tokens: RSlice<'a, u64>,
    pub decode_blocks: RSlice<'a, u64>,
    /// Signals added after 1.0, by name. Empty in 1.0 hosts.
    pub extra_columns: RSlice<'a, ExtraColumn<'a>>,
}

/// Why a pick (or explain) did not return a row.
#[repr(transparent)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PickFailureKind(pub u8);

impl PickFailureKind {
    /// The policy returned an error.
    pub const FAILED: PickFailureKind = PickFailureKind(0);
    /// The policy panicked; the instance is now poisoned.
    pub const PANICKED: PickFailureKind = PickFailureKind(1);
    /// The instance panicked earlier and refuses further calls.
    pub const POISONED: PickFailureKind = PickFailureKind(2);
    /// The host handed over columns that do not line up (a host bug).
    pub const BAD_VIEW: PickFailureKind = PickFailureKind(3);
}

/// Error returned across the boundary by `pick` and `explain`.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq)]
pub struct PickFailure {
    pub kind: PickFailureKind,
    pub message: RString,
}

/// A named number in an explanation.
#[repr(C)]
#[derive(StableAbi, Debug, Clone)]
pub struct ExplainField {
    pub name: RString,
    pub value: f64,
}

/// A named label in an explanation (for values that are not numbers).
#[repr(C)]
#[derive(StableAbi, Debug, Clone)]
pub struct ExplainLabel {
    pub name: RString,
    pub value: RString,
}

/// Why a policy would pick the row it picks. Off the hot path: asked for by tracing and `select`.
#[repr(C)]
#[derive(StableAbi, Debug, Clone)]
pub struct RawExplanation {
    pub row: usize,
    pub reason: RString,
    pub fields: RVec<ExplainField>,
    pub labels: RVec<ExplainLabel>,
}

/// The policy object a plugin hands to the host, one per configured instance.
///
/// `Send + Sync`: the host calls one instance from many threads at once; policies that keep state
/// use interior mutability.
#[sabi_trait]
pub trait PolicyObject: Send + Sync {
    /// Which input columns this instance needs. Read once, at creation.
    fn required_inputs(&self) -> Inputs;

    /// Choose one row; returns its index into the view.
    fn pick(
        &self,
        ctx: &RawRequestContext<'_>,
        view: &RawCandidateView<'_>,
    ) -> RResult<usize, PickFailure>;

    /// Explain the decision `pick` would make on the same input. `RNone` = no explanation.
    #[sabi(last_prefix_field)]
    fn explain(
        &self,
        ctx: &RawRequestContext<'_>,
        view: &RawCandidateView<'_>,
    ) -> RResult<ROption<RawExplanation>, PickFailure>;

    // ---- 1.1 ----------------------------------------------------------------------------------
    // Methods below were added after 1.0. A library built against 1.0 has no vtable entry for
    // them, and calls fall back to these default bodies (no-ops).

    /// Since 1.1: the host booked a request this instance was asked to route.
    fn on_dispatch(&self, event: &DispatchEvent<'_>) {
        let _ = event;
    }

    /// Since 1.1: a request this instance was asked to route finished.
    fn on_complete(&self, event: &CompleteEvent<'_>) {
        let _ = event;
    }
}

/// How a dispatched request ended (since 1.1).
#[repr(transparent)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CompletionCode(pub u8);

impl CompletionCode {
    /// The engine finished the request.
    pub const COMPLETED: CompletionCode = CompletionCode(0);
    /// The engine or the client failed it.
    pub const FAILED: CompletionCode = CompletionCode(1);
    /// It was cancelled before finishing.
    pub const CANCELLED: CompletionCode = CompletionCode(2);
}

/// A request the host booked (since 1.1).
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy)]
pub struct DispatchEvent<'a> {
    /// The host's id for the request; the matching [`CompleteEvent`] carries the same id.
    pub request_id: u64,
    /// Where it was booked.
    pub row: RowId,
    pub session_id: ROption<RStr<'a>>,
    pub prompt_tokens: u64,
    /// `true` when this instance failed for the request and the host's fallback chose `row`.
    pub fallback: bool,
    /// Values added after 1.1, by name.
    pub extensions: RSlice<'a, Extension<'a>>,
}

/// A booked request that finished (since 1.1).
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy)]
pub struct CompleteEvent<'a> {
    pub request_id: u64,
    pub row: RowId,
    pub session_id: ROption<RStr<'a>>,
    pub outcome: CompletionCode,
    /// Values added after 1.1, by name.
    pub extensions: RSlice<'a, Extension<'a>>,
}

/// An owned, type-erased policy object.
pub type PolicyBox = PolicyObject_TO<'static, RBox<()>>;

/// Documentation of one parameter of a policy type.
#[repr(C)]
#[derive(StableAbi, Debug, Clone)]
pub struct RawParamDoc {
    pub name: RString,
    pub type_name: RString,
    /// Rendered default, or empty when the parameter is required.
    pub default: RString,
    pub meaning: RString,
}

/// One policy type a library provides.
#[repr(C)]
#[derive(StableAbi, Debug, Clone)]
pub struct RawPolicyTypeInfo {
    pub name: RString,
    pub summary: RString,
    pub parameters: RVec<RawParamDoc>,
}

/// Log severity codes, as in `tracing`.
#[repr(transparent)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LogLevel(pub u8);

impl LogLevel {
    pub const ERROR: LogLevel = LogLevel(1);
    pub const WARN: LogLevel = LogLevel(2);
    pub const INFO: LogLevel = LogLevel(3);
    pub const DEBUG: LogLevel = LogLevel(4);
    pub const TRACE: LogLevel = LogLevel(5);
}

/// One log event from a plugin, already formatted.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy)]
pub struct LogRecord<'a> {
    pub level: LogLevel,
    /// The plugin's name as exported in its root module.
    pub plugin: RStr<'a>,
    /// The module path the event came from inside the plugin.
    pub target: RStr<'a>,
    /// The message with its fields rendered as `key=value`.
    pub message: RStr<'a>,
}

/// The host's log sink: a plugin's own `tracing` globals go nowhere, so events are bridged here.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy)]
pub struct HostLog {
    pub emit: extern "C" fn(record: &LogRecord<'_>),
    /// The most verbose level the host wants; the plugin drops anything more verbose.
    pub max_level: LogLevel,
}

/// What the host tells a policy type when it creates an instance.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy)]
pub struct RawCreateContext<'a> {
    /// The instance name from the YAML `worker_selection.instances[].name`.
    pub instance_name: RStr<'a>,
    /// Host setting `host_cache_hit_weight` (design default 0.75).
    pub host_cache_hit_weight: f64,
    /// Host setting `disk_cache_hit_weight` (design default 0.25).
    pub disk_cache_hit_weight: f64,
    /// Host setting `block_size` (tokens per KV block).
    pub block_size: u32,
    pub log: HostLog,
    /// Values added after 1.0, by name. Empty in 1.0 hosts.
    pub extensions: RSlice<'a, Extension<'a>>,
}

/// Why `create` refused.
#[repr(transparent)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CreateFailureKind(pub u8);

impl CreateFailureKind {
    /// The library exports no policy type of that name.
    pub const UNKNOWN_TYPE: CreateFailureKind = CreateFailureKind(0);
    /// A parameter is unknown, missing, of the wrong type or out of range.
    pub const INVALID_PARAMETERS: CreateFailureKind = CreateFailureKind(1);
    /// The constructor failed for another reason.
    pub const FAILED: CreateFailureKind = CreateFailureKind(2);
    /// The constructor panicked.
    pub const PANICKED: CreateFailureKind = CreateFailureKind(3);
}

/// Error returned across the boundary by `create`.
#[repr(C)]
#[derive(StableAbi, Debug, Clone)]
pub struct CreateFailure {
    pub kind: CreateFailureKind,
    /// The offending parameter (dotted path), or empty.
    pub key: RString,
    pub message: RString,
}

/// Signature of [`PolicyLibrary::create`].
pub type CreateFn = extern "C" fn(
    type_name: RStr<'_>,
    parameters_json: RStr<'_>,
    ctx: &RawCreateContext<'_>,
) -> RResult<PolicyBox, CreateFailure>;

/// The root module every policy library exports (see [`crate::export_plugin!`]).
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = PolicyLibraryRef)))]
#[sabi(missing_field(option))]
pub struct PolicyLibrary {
    /// The plugin's own name, e.g. `two-tier-cost-fn`.
    pub plugin_name: RStr<'static>,
    /// The plugin's own version (its crate version).
    pub plugin_version: RStr<'static>,
    /// The `plugin-api` version the plugin was built against.
    pub api_version: RStr<'static>,
    /// `cfg!(panic = "unwind")` of the plugin build. `false` means panics abort the host.
    pub panic_unwind: bool,
    /// The policy types this library provides. A single entry with an empty name means the list
    /// could not be produced; its summary says why.
    pub policy_types: extern "C" fn() -> RVec<RawPolicyTypeInfo>,
    /// Validate parameters (JSON object text) and build one policy instance.
    #[sabi(last_prefix_field)]
    pub create: extern "C" fn(
        type_name: RStr<'_>,
        parameters_json: RStr<'_>,
        ctx: &RawCreateContext<'_>,
    ) -> RResult<PolicyBox, CreateFailure>,
}

impl RootModule for PolicyLibraryRef {
    declare_root_module_statics! {PolicyLibraryRef}
    const BASE_NAME: &'static str = "router_policy";
    const NAME: &'static str = "router policy library";
    const VERSION_STRINGS: VersionStrings = package_version_strings!();
}

/// The `plugin-api` version this copy of the crate is (the ABI version).
pub const API_VERSION: &str = env!("CARGO_PKG_VERSION");
