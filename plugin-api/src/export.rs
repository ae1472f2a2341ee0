//! Turning safe policies into ABI objects: the adapter, the exported library, the log bridge.
//!
//! Every author callback runs here under `catch_unwind`. A panic in `pick` or `explain` becomes a
//! [`PickFailure`] of kind `PANICKED` and poisons the instance (later calls get `POISONED`
//! without touching author code); a panic in `create` becomes a [`CreateFailure`] of kind
//! `PANICKED`. Nothing an author writes can unwind into `abi_stable`'s shims, which would abort
//! the host.
//!
//! Two second-order panics are contained too. A caught panic payload is dropped under its own
//! `catch_unwind` (`discard`): a payload whose `Drop` panics would otherwise unwind out of the
//! adapter after all, and that second payload is leaked, never dropped. And author state (the
//! policy) is never owned by a frame an unwind could pass through: until the adapter holds it, it
//! sits in a `ManuallyDrop` and is dropped by hand, under `catch_unwind` (`drop_contained`), so
//! its `Drop` never runs during an unwind (a panicking `Drop` there aborts the process).

use std::any::Any;
use std::mem::ManuallyDrop;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use abi_stable::prefix_type::PrefixTypeTrait;
use abi_stable::sabi_trait::TD_Opaque;
use abi_stable::std_types::{ROption, RResult, RStr, RString, RVec};

use crate::abi::{
    CompleteEvent, CreateFailure, CreateFailureKind, DispatchEvent, ExplainField, ExplainLabel,
    HostLog, Inputs, LogLevel, LogRecord, PickFailure, PickFailureKind, PolicyBox, PolicyLibrary,
    PolicyLibraryRef, PolicyObject, RawCandidateView, RawCreateContext, RawExplanation,
    RawParamDoc, RawPolicyTypeInfo, RawRequestContext, API_VERSION,
};
use crate::create::{CreateContext, CreateError, Parameters, PolicyType};
use crate::policy::{Completion, Context, Dispatch, Outcome, Policy, Rows};

/// Wraps a safe [`Policy`] as an ABI [`PolicyObject`], containing panics.
pub struct Adapter<P> {
    /// Dropped by hand, under `catch_unwind` (see the `Drop` impl).
    policy: ManuallyDrop<P>,
    inputs: Inputs,
    poisoned: AtomicBool,
    /// Why a hook poisoned the instance (hooks return nothing; the next `pick` or `explain`
    /// answers `POISONED` with this message).
    hook_panic: OnceLock<String>,
}

impl<P: Policy> Adapter<P> {
    /// Wrap `policy`. Calls `policy.inputs()` once, under `catch_unwind`.
    pub fn new(policy: P) -> Result<Self, CreateError> {
        // Held so that no unwind can drop it: dropped only by hand, below, or by the adapter.
        let mut policy = ManuallyDrop::new(policy);
        match catch_unwind(AssertUnwindSafe(|| policy.inputs())) {
            Ok(inputs) => Ok(Adapter {
                policy,
                inputs,
                poisoned: AtomicBool::new(false),
                hook_panic: OnceLock::new(),
            }),
            Err(payload) => {
                let mut message = format!("inputs() panicked: {}", take_message(payload));
                if let Err(also) = drop_contained(&mut policy) {
                    message.push_str("; dropping the policy then panicked too: ");
                    message.push_str(&also);
                }
                Err(CreateError::with_kind(CreateFailureKind::PANICKED, message))
            }
        }
    }

    /// Whether an earlier callback panicked.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Relaxed)
    }

    /// Run a notification hook under `catch_unwind`; a panic poisons the instance. Hooks return
    /// nothing across the ABI, so the next `pick` or `explain` reports it: `POISONED`, with the
    /// message `poisoned by a panic in <hook>: <panic message>`. (A host that has not poisoned
    /// the instance itself knows from that answer that a hook panicked.)
    fn notify(&self, hook: &str, call: impl FnOnce(&P)) {
        if self.poisoned.load(Ordering::Acquire) {
            return;
        }
        if let Err(payload) = catch_unwind(AssertUnwindSafe(|| call(&self.policy))) {
            let message = format!("poisoned by a panic in {hook}: {}", take_message(payload));
            let _ = self.hook_panic.set(message);
            self.poisoned.store(true, Ordering::Release);
        }
    }

    /// Run one author callback with the view checked, panics contained and poisoning applied.
    #[inline]
    fn guarded<T>(
        &self,
        ctx: &RawRequestContext<'_>,
        view: &RawCandidateView<'_>,
        call: impl FnOnce(&P, &Context<'_>, &Rows<'_>) -> Result<T, PickFailure>,
    ) -> RResult<T, PickFailure> {
        if self.poisoned.load(Ordering::Acquire) {
            let why = self
                .hook_panic
                .get()
                .map_or("instance is poisoned: it panicked earlier", String::as_str);
            return RResult::RErr(failure(PickFailureKind::POISONED, why));
        }
        let rows = match Rows::from_raw(view) {
            Ok(rows) => rows,
            Err(err) => return RResult::RErr(failure(PickFailureKind::BAD_VIEW, &err.0)),
        };
        let ctx = Context::from_raw(ctx);
        match catch_unwind(AssertUnwindSafe(|| call(&self.policy, &ctx, &rows))) {
            Ok(Ok(value)) => RResult::ROk(value),
            Ok(Err(err)) => RResult::RErr(err),
            Err(payload) => {
                self.poisoned.store(true, Ordering::Release);
                RResult::RErr(failure(PickFailureKind::PANICKED, &take_message(payload)))
            }
        }
    }
}

impl<P> Drop for Adapter<P> {
    /// The host drops instances (at shutdown) through an FFI shim: a panicking author `Drop`
    /// must not unwind into it.
    fn drop(&mut self) {
        // The panic (if any) already reached the host log through the plugin's panic hook.
        let _ = drop_contained(&mut self.policy);
    }
}

/// Drop author state by hand, under `catch_unwind`; returns the message of its panic, if any.
///
/// The caller must never use `value` again (it is dropped here whether or not `Drop` panics).
fn drop_contained<T>(value: &mut ManuallyDrop<T>) -> Result<(), String> {
    // SAFETY: every caller drops `value` exactly once, through this function, and never touches
    // it afterwards (`Adapter::drop`, and `Adapter::new` on the path where no adapter is built).
    catch_unwind(AssertUnwindSafe(|| unsafe { ManuallyDrop::drop(value) })).map_err(take_message)
}

/// Render a caught panic payload, then drop it without letting its own `Drop` unwind.
fn take_message(payload: Box<dyn Any + Send>) -> String {
    let message = panic_message(&*payload);
    discard(payload);
    message
}

/// Drop a caught panic payload under `catch_unwind`. A payload whose `Drop` panics would
/// otherwise unwind out of the adapter into an FFI shim, which ends the process. The payload of
/// that second panic is leaked, not dropped: it may be just such a value again.
fn discard(payload: Box<dyn Any + Send>) {
    if let Err(again) = catch_unwind(AssertUnwindSafe(move || drop(payload))) {
        std::mem::forget(again);
    }
}

fn failure(kind: PickFailureKind, message: &str) -> PickFailure {
    PickFailure {
        kind,
        message: RString::from(message),
    }
}

impl<P: Policy> PolicyObject for Adapter<P> {
    fn required_inputs(&self) -> Inputs {
        self.inputs
    }

    #[inline]
    fn pick(
        &self,
        ctx: &RawRequestContext<'_>,
        view: &RawCandidateView<'_>,
    ) -> RResult<usize, PickFailure> {
        self.guarded(ctx, view, |policy, ctx, rows| {
            policy
                .pick(ctx, rows)
                .map_err(|err| failure(PickFailureKind::FAILED, err.message()))
        })
    }

    fn explain(
        &self,
        ctx: &RawRequestContext<'_>,
        view: &RawCandidateView<'_>,
    ) -> RResult<ROption<RawExplanation>, PickFailure> {
        self.guarded(ctx, view, |policy, ctx, rows| {
            Ok(match policy.explain(ctx, rows) {
                Some(e) => ROption::RSome(RawExplanation {
                    row: e.row,
                    reason: e.reason.into(),
                    fields: e
                        .fields
                        .into_iter()
                        .map(|(name, value)| ExplainField {
                            name: name.into(),
                            value,
                        })
                        .collect(),
                    labels: e
                        .labels
                        .into_iter()
                        .map(|(name, value)| ExplainLabel {
                            name: name.into(),
                            value: value.into(),
                        })
                        .collect(),
                }),
                None => ROption::RNone,
            })
        })
    }

    fn on_dispatch(&self, event: &DispatchEvent<'_>) {
        let dispatch = Dispatch {
            request_id: event.request_id,
            row: event.row,
            session_id: event.session_id.as_ref().map(|s| s.as_str()).into_option(),
            prompt_tokens: event.prompt_tokens,
            fallback: event.fallback,
        };
        self.notify("on_dispatch", |policy| policy.on_dispatch(&dispatch));
    }

    fn on_complete(&self, event: &CompleteEvent<'_>) {
        let completion = Completion {
            request_id: event.request_id,
            row: event.row,
            session_id: event.session_id.as_ref().map(|s| s.as_str()).into_option(),
            outcome: Outcome::from_code(event.outcome),
        };
        self.notify("on_complete", |policy| policy.on_complete(&completion));
    }
}

/// Box a safe policy as an ABI object (what the exported `create` returns; hosts use it for their
/// built-in policies so every policy is called the same way).
pub fn into_policy_box<P: Policy>(policy: P) -> Result<PolicyBox, CreateError> {
    Ok(PolicyBox::from_value(Adapter::new(policy)?, TD_Opaque))
}

/// Render a panic payload.
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_string()
    }
}

/// One exported policy type, as listed by [`crate::export_plugin!`].
pub struct TypeEntry {
    name: &'static str,
    info: fn() -> RawPolicyTypeInfo,
    create: fn(&Parameters<'_>, &CreateContext<'_>) -> Result<PolicyBox, CreateError>,
}

impl TypeEntry {
    /// The entry for policy type `T`.
    pub const fn of<T: PolicyType>() -> TypeEntry {
        TypeEntry {
            name: T::NAME,
            info: type_info::<T>,
            create: create_boxed::<T>,
        }
    }
}

fn type_info<T: PolicyType>() -> RawPolicyTypeInfo {
    RawPolicyTypeInfo {
        name: T::NAME.into(),
        summary: T::SUMMARY.into(),
        parameters: T::parameters()
            .into_iter()
            .map(|p| RawParamDoc {
                name: p.name.into(),
                type_name: p.type_name.into(),
                default: p.default.into(),
                meaning: p.meaning.into(),
            })
            .collect(),
    }
}

fn create_boxed<T: PolicyType>(
    params: &Parameters<'_>,
    ctx: &CreateContext<'_>,
) -> Result<PolicyBox, CreateError> {
    into_policy_box(T::create(params, ctx)?)
}

/// Build the root module (called by the code [`crate::export_plugin!`] generates).
#[doc(hidden)]
pub fn library(
    plugin_name: &'static str,
    plugin_version: &'static str,
    panic_unwind: bool,
    policy_types: extern "C" fn() -> RVec<RawPolicyTypeInfo>,
    create: crate::abi::CreateFn,
) -> PolicyLibraryRef {
    PLUGIN_NAME.get_or_init(|| plugin_name);
    PolicyLibrary {
        plugin_name: RStr::from_str(plugin_name),
        plugin_version: RStr::from_str(plugin_version),
        api_version: RStr::from_str(API_VERSION),
        panic_unwind,
        policy_types,
        create,
    }
    .leak_into_prefix()
}

/// The exported type list (called by the code [`crate::export_plugin!`] generates).
#[doc(hidden)]
pub fn policy_types(entries: &'static [TypeEntry]) -> RVec<RawPolicyTypeInfo> {
    // Author code (parameter docs) runs here: keep a panic from crossing into the host, and
    // report it as the one entry with an empty name, which hosts refuse with its summary.
    catch_unwind(|| entries.iter().map(|e| (e.info)()).collect()).unwrap_or_else(|payload| {
        RVec::from(vec![RawPolicyTypeInfo {
            name: RString::new(),
            summary: format!("policy type list panicked: {}", take_message(payload)).into(),
            parameters: RVec::new(),
        }])
    })
}

/// The exported `create` (called by the code [`crate::export_plugin!`] generates).
#[doc(hidden)]
pub fn create(
    entries: &'static [TypeEntry],
    type_name: RStr<'_>,
    parameters_json: RStr<'_>,
    ctx: &RawCreateContext<'_>,
) -> RResult<PolicyBox, CreateFailure> {
    install_log_bridge(ctx.log);
    let result = catch_unwind(AssertUnwindSafe(|| {
        let Some(entry) = entries.iter().find(|e| e.name == type_name.as_str()) else {
            let known: Vec<&str> = entries.iter().map(|e| e.name).collect();
            return Err(CreateError::with_kind(
                CreateFailureKind::UNKNOWN_TYPE,
                format!(
                    "this library has no policy type `{}` (it provides: {})",
                    type_name.as_str(),
                    known.join(", ")
                ),
            ));
        };
        (entry.create)(
            &Parameters::from_json(parameters_json.as_str()),
            &CreateContext::from_raw(ctx),
        )
    }));
    let result = match result {
        Ok(result) => result,
        Err(payload) => Err(CreateError::with_kind(
            CreateFailureKind::PANICKED,
            take_message(payload),
        )),
    };
    match result {
        Ok(policy) => RResult::ROk(policy),
        Err(err) => RResult::RErr(CreateFailure {
            kind: err.kind(),
            key: err.key().into(),
            message: err.message().into(),
        }),
    }
}

// ---- log bridge -------------------------------------------------------------------------------

/// This library's plugin name, for tagging log records.
static PLUGIN_NAME: OnceLock<&'static str> = OnceLock::new();
static HOST_LOG: OnceLock<HostLog> = OnceLock::new();

/// Route this library's `tracing` events and panic messages to the host.
///
/// A dynamically loaded plugin has its own copy of `tracing`'s globals (and of std's panic
/// hook), so without this its events would go nowhere and its panic messages straight to stderr.
/// Installed once per library, on the first `create`.
fn install_log_bridge(log: HostLog) {
    if HOST_LOG.set(log).is_err() {
        return;
    }
    // Fails only if this library already installed a dispatcher of its own; keep that one.
    let _ = tracing::subscriber::set_global_default(Bridge);
    std::panic::set_hook(Box::new(|info| {
        let message = match info.location() {
            Some(at) => format!(
                "panicked at {}:{}: {}",
                at.file(),
                at.line(),
                panic_message(info.payload())
            ),
            None => format!("panicked: {}", panic_message(info.payload())),
        };
        emit(LogLevel::ERROR, "panic", &message);
    }));
}

fn emit(level: LogLevel, target: &str, message: &str) {
    if let Some(log) = HOST_LOG.get() {
        if level <= log.max_level {
            let record = LogRecord {
                level,
                plugin: RStr::from_str(PLUGIN_NAME.get().copied().unwrap_or("unknown-plugin")),
                target: RStr::from_str(target),
                message: RStr::from_str(message),
            };
            (log.emit)(&record);
        }
    }
}

fn level_code(level: &tracing::Level) -> LogLevel {
    match *level {
        tracing::Level::ERROR => LogLevel::ERROR,
        tracing::Level::WARN => LogLevel::WARN,
        tracing::Level::INFO => LogLevel::INFO,
        tracing::Level::DEBUG => LogLevel::DEBUG,
        _ => LogLevel::TRACE,
    }
}

/// A minimal `tracing` subscriber that formats events and hands them to the host. Spans are not
/// tracked (the host's own spans already say which request and instance a call belongs to).
struct Bridge;

/// Renders an event as `message key=value ...` (shared with `testing::capture_logs`).
pub(crate) struct Render(pub(crate) String);

impl tracing::field::Visit for Render {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        use std::fmt::Write;
        if field.name() == "message" {
            let _ = write!(self.0, "{value:?}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        use std::fmt::Write;
        if field.name() == "message" {
            self.0.push_str(value);
        } else {
            let _ = write!(self.0, " {}={value}", field.name());
        }
    }
}

impl tracing::Subscriber for Bridge {
    // `sometimes`, never a cached `always`/`never`: a test binary may also run scoped capture
    // subscribers (`testing::capture_logs`), and a cached verdict from one dispatcher would
    // silence or leak the other's events. `enabled` is two loads.
    fn register_callsite(
        &self,
        metadata: &'static tracing::Metadata<'static>,
    ) -> tracing::subscriber::Interest {
        let _ = metadata;
        tracing::subscriber::Interest::sometimes()
    }

    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        HOST_LOG
            .get()
            .is_some_and(|log| level_code(metadata.level()) <= log.max_level)
    }

    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, event: &tracing::Event<'_>) {
        let mut text = Render(String::new());
        event.record(&mut text);
        let metadata = event.metadata();
        emit(
            level_code(metadata.level()),
            metadata.target(),
            text.0.trim_start(),
        );
    }

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}

/// Export a policy library: the one macro a plugin crate calls, once, at its root.
///
/// ```
/// use plugin_api::{
///     Context, CreateContext, CreateError, Inputs, ParamDoc, Parameters, PickError, Policy,
///     PolicyType, Rows,
/// };
///
/// struct First;
///
/// impl Policy for First {
///     fn inputs(&self) -> Inputs {
///         Inputs::NONE
///     }
///     fn pick(&self, _: &Context<'_>, rows: &Rows<'_>) -> Result<usize, PickError> {
///         // Row order is unspecified: a real policy breaks ties on data, not position.
///         (0..rows.len()).min_by_key(|&i| rows.row(i)).ok_or_else(|| PickError::new("no rows"))
///     }
/// }
///
/// struct FirstType;
///
/// impl PolicyType for FirstType {
///     type Policy = First;
///     const NAME: &'static str = "lowest-row";
///     const SUMMARY: &'static str = "Always the lowest (worker, rank)";
///     fn parameters() -> Vec<ParamDoc> {
///         Vec::new()
///     }
///     fn create(_: &Parameters<'_>, _: &CreateContext<'_>) -> Result<First, CreateError> {
///         Ok(First)
///     }
/// }
///
/// plugin_api::export_plugin! {
///     name: "my-policies",
///     version: env!("CARGO_PKG_VERSION"),
///     policies: [FirstType],
/// }
/// # fn main() {}
/// ```
/// Each listed type implements [`crate::PolicyType`]. The crate must be built as a `cdylib`
/// with `panic = "unwind"` (the default); the host refuses `panic = "abort"` builds.
#[macro_export]
macro_rules! export_plugin {
    (
        name: $name:expr,
        version: $version:expr,
        policies: [$($ty:ty),+ $(,)?] $(,)?
    ) => {
        const _: () = {
            use $crate::__private::abi_stable as __abi;

            static ENTRIES: &[$crate::export::TypeEntry] =
                &[$($crate::export::TypeEntry::of::<$ty>()),+];

            extern "C" fn __create(
                type_name: __abi::std_types::RStr<'_>,
                parameters_json: __abi::std_types::RStr<'_>,
                ctx: &$crate::abi::RawCreateContext<'_>,
            ) -> __abi::std_types::RResult<$crate::abi::PolicyBox, $crate::abi::CreateFailure> {
                $crate::export::create(ENTRIES, type_name, parameters_json, ctx)
            }

            extern "C" fn __policy_types(
            ) -> __abi::std_types::RVec<$crate::abi::RawPolicyTypeInfo> {
                $crate::export::policy_types(ENTRIES)
            }

            fn __library() -> $crate::abi::PolicyLibraryRef {
                $crate::export::library(
                    $name,
                    $version,
                    cfg!(panic = "unwind"),
                    __policy_types,
                    __create,
                )
            }

            extern "C" fn __load_root_module() -> __abi::library::RootModuleResult {
                __abi::library::__call_root_module_loader(__library)
            }

            // The symbol `abi_stable`'s `#[export_root_module]` would emit, spelled out so plugin
            // crates need no direct `abi_stable` dependency (a test pins the name).
            #[unsafe(export_name = "_1as_0lib_1header_0root_bmodule_bloader")]
            static __ROUTER_POLICY_LIB_HEADER: __abi::library::LibHeader = unsafe {
                __abi::library::LibHeader::from_constructor::<$crate::abi::PolicyLibraryRef>(
                    __load_root_module,
                    __abi::library::CheckTypeLayout::Yes,
                )
            };
        };
    };
}
