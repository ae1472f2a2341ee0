//! The policy registry: which type names exist (built-in or from which library), and the
//! configured instances created from them at startup.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use abi_stable::std_types::{RResult, RSlice, RStr};
use plugin_api::abi::{
    HostLog, LogLevel, LogRecord, PickFailure, PickFailureKind, PolicyBox, RawCreateContext,
};
use plugin_api::Inputs;
use router_core::select::PolicyFailure;
use router_core::striped::StripedCounter;

use crate::builtin::{Builtin, BuiltinSettings};
use crate::config::{InstanceConfig, OnError};
use crate::loader::{plugin_text, printable, PolicyLibrary, PolicyTypeDoc};
use crate::watchdog::{Call, Hang, OnHang, Watch, WatchSpec};

/// The origin of a built-in instance or type (a plugin's is its file's path).
pub const BUILT_IN: &str = "built-in";

/// Where a policy type comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TypeOrigin {
    Builtin(Builtin),
    /// Index into [`Catalog::libraries`].
    Plugin(usize),
}

/// Every policy type the host can instantiate.
#[derive(Debug)]
pub struct Catalog {
    libraries: Vec<PolicyLibrary>,
    types: BTreeMap<String, (TypeOrigin, PolicyTypeDoc)>,
    /// Plugin types named like a policy shipped with the host, from another plugin.
    shadowed: Vec<ShadowedType>,
}

/// A policy type that a library exports under the name of a policy shipped with the host
/// ([`crate::builtin::SHIPPED_PLUGIN_TYPES`]) while the library is not the plugin that ships it
/// (its plugin name differs): instances of that type run the library's code, not the shipped
/// policy. Allowed (an operator may mean it), but warned about at load and shown by `check` and
/// `describe`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShadowedType {
    pub type_name: String,
    /// The library's path.
    pub library: PathBuf,
    /// The plugin name the library reports.
    pub plugin_name: String,
    /// The plugin name of the shipped plugin that exports `type_name`.
    pub shipped_plugin: &'static str,
}

impl std::fmt::Display for ShadowedType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = printable(&self.type_name);
        write!(
            f,
            "policy type `{name}` from {} (plugin `{}`) shadows the shipped policy of that name \
             (plugin `{}`): instances of type `{name}` run this library's code, not the shipped \
             policy; rename the type in the plugin unless it is meant to replace the shipped one",
            self.library.display(),
            printable(&self.plugin_name),
            self.shipped_plugin
        )
    }
}

/// The types of `library` that shadow a shipped policy ([`ShadowedType`]).
pub fn shadowed_types(library: &PolicyLibrary) -> Vec<ShadowedType> {
    library
        .types
        .iter()
        .filter_map(|doc| {
            let shipped_plugin = crate::builtin::shipped_plugin_of(&doc.name)?;
            (library.plugin_name != shipped_plugin).then(|| ShadowedType {
                type_name: doc.name.clone(),
                library: library.path.clone(),
                plugin_name: library.plugin_name.clone(),
                shipped_plugin,
            })
        })
        .collect()
}

/// Startup errors about policy types and instances.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("policy type `{type_name}` is exported by two libraries: {first} and {second}")]
    DuplicateType {
        type_name: String,
        first: String,
        second: String,
    },
    #[error("library {library} exports policy type `{type_name}` twice")]
    DuplicateTypeInLibrary { library: String, type_name: String },
    #[error(
        "library {library} exports policy type `{type_name}`, which is the name of a built-in \
         policy type (built-ins: {}); a plugin cannot replace a built-in, so the library is \
         refused: rename the type in the plugin",
        builtin_names()
    )]
    BuiltinTypeName { library: String, type_name: String },
    #[error(
        "library {library} exports a policy type named {}, which is not a valid type name: \
         it must be 1 to {MAX_TYPE_NAME_LEN} characters from A-Z, a-z, 0-9, `_`, `.`, `:` and `-`",
        escaped_name(.type_name)
    )]
    InvalidTypeName { library: String, type_name: String },
    #[error("instance `{instance}`: unknown policy type `{type_name}`; known types: {}", .known.join(", "))]
    UnknownType {
        instance: String,
        type_name: String,
        known: Vec<String>,
    },
    #[error("instance `{instance}` (type `{type_name}`, from {origin}): {}{}", key_prefix(.key), printable(.message))]
    InvalidParameters {
        instance: String,
        type_name: String,
        origin: String,
        key: String,
        message: String,
    },
    #[error("instance `{instance}` (type `{type_name}`, from {origin}): constructor {}: {}", if *.panicked { "panicked" } else { "failed" }, printable(.message))]
    CreateFailed {
        instance: String,
        type_name: String,
        origin: String,
        panicked: bool,
        message: String,
    },
    #[error("instance `{instance}` (type `{type_name}`, from {origin}): declares inputs {inputs} this host does not provide")]
    UnknownInputs {
        instance: String,
        type_name: String,
        origin: String,
        inputs: Inputs,
    },
}

fn key_prefix(key: &str) -> String {
    if key.is_empty() {
        String::new()
    } else {
        format!("parameter `{}`: ", printable(key))
    }
}

/// "`default`, `round-robin`, `random`".
fn builtin_names() -> String {
    Builtin::ALL
        .iter()
        .map(|b| format!("`{}`", b.as_str()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Longest policy type name a library may export, in bytes.
pub const MAX_TYPE_NAME_LEN: usize = 128;

/// Whether `name` may name a policy type: 1 to [`MAX_TYPE_NAME_LEN`] characters from
/// `[A-Za-z0-9_.:-]`. Type names are printed by `check` and appear in errors, logs and `select`
/// output, so a library must not put control characters or terminal escapes into them.
pub fn is_valid_type_name(name: &str) -> bool {
    (1..=MAX_TYPE_NAME_LEN).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'))
}

/// `name` quoted and escaped (`{:?}`), cut after [`MAX_TYPE_NAME_LEN`] characters.
fn escaped_name(name: &str) -> String {
    match name.char_indices().nth(MAX_TYPE_NAME_LEN) {
        Some((end, _)) => format!("{:?}... ({} bytes)", &name[..end], name.len()),
        None => format!("{name:?}"),
    }
}

/// Add the types of library `index` (at `path`) to `types`, refusing an invalid name, a built-in's
/// name, a name the library exports twice and a name already taken (`origin_name` names the
/// taker).
fn register_library_types(
    types: &mut BTreeMap<String, (TypeOrigin, PolicyTypeDoc)>,
    index: usize,
    path: &Path,
    docs: &[PolicyTypeDoc],
    origin_name: impl Fn(TypeOrigin) -> String,
) -> Result<(), PolicyError> {
    let library = || path.display().to_string();
    for doc in docs {
        if !is_valid_type_name(&doc.name) {
            return Err(PolicyError::InvalidTypeName {
                library: library(),
                type_name: doc.name.clone(),
            });
        }
        if Builtin::from_name(&doc.name).is_some() {
            return Err(PolicyError::BuiltinTypeName {
                library: library(),
                type_name: doc.name.clone(),
            });
        }
        match types.get(&doc.name) {
            Some((TypeOrigin::Plugin(i), _)) if *i == index => {
                return Err(PolicyError::DuplicateTypeInLibrary {
                    library: library(),
                    type_name: doc.name.clone(),
                })
            }
            Some((origin, _)) => {
                return Err(PolicyError::DuplicateType {
                    type_name: doc.name.clone(),
                    first: origin_name(*origin),
                    second: library(),
                })
            }
            None => {}
        }
        types.insert(doc.name.clone(), (TypeOrigin::Plugin(index), doc.clone()));
    }
    Ok(())
}

impl Catalog {
    /// Built-ins plus every type of every library. A name that is not a valid type name
    /// ([`is_valid_type_name`]), one named like a built-in, one exported twice by one library, or
    /// one exported by two libraries is an error naming the library (both, for two). A type that
    /// shadows a shipped policy ([`ShadowedType`]) is logged as a warning and kept in
    /// [`Self::shadowed`].
    pub fn new(libraries: Vec<PolicyLibrary>) -> Result<Self, PolicyError> {
        let mut types = builtin_types();
        let mut catalog = Catalog {
            libraries,
            types: BTreeMap::new(),
            shadowed: Vec::new(),
        };
        for (index, library) in catalog.libraries.iter().enumerate() {
            register_library_types(&mut types, index, &library.path, &library.types, |o| {
                catalog.origin_name(o)
            })?;
        }
        catalog.types = types;
        catalog.shadowed = catalog.libraries.iter().flat_map(shadowed_types).collect();
        for shadow in &catalog.shadowed {
            tracing::warn!(
                path = %shadow.library.display(),
                type_name = %shadow.type_name,
                "{shadow}"
            );
        }
        Ok(catalog)
    }

    /// The check [`Self::new`] makes of one library's type names, for a library that is only
    /// being described: `Err` is the error a host loading it alone would fail with.
    pub fn check_library(library: &PolicyLibrary) -> Result<(), PolicyError> {
        register_library_types(
            &mut builtin_types(),
            0,
            &library.path,
            &library.types,
            |_| BUILT_IN.to_string(),
        )
    }

    /// Plugin types that shadow a policy shipped with the host, in library order.
    pub fn shadowed(&self) -> &[ShadowedType] {
        &self.shadowed
    }

    /// "built-in" or the library's path.
    pub fn origin_name(&self, origin: TypeOrigin) -> String {
        match origin {
            TypeOrigin::Builtin(_) => BUILT_IN.to_string(),
            TypeOrigin::Plugin(i) => self.libraries[i].path.display().to_string(),
        }
    }

    pub fn libraries(&self) -> &[PolicyLibrary] {
        &self.libraries
    }

    /// Every type, sorted by name.
    pub fn types(&self) -> impl Iterator<Item = (&str, TypeOrigin, &PolicyTypeDoc)> {
        self.types
            .iter()
            .map(|(name, (origin, doc))| (name.as_str(), *origin, doc))
    }

    /// Create one configured instance (validating its parameters).
    pub fn instantiate(
        &self,
        config: &InstanceConfig,
        settings: &HostSettings,
    ) -> Result<PolicyInstance, PolicyError> {
        let Some((origin, _)) = self.types.get(&config.type_name) else {
            return Err(PolicyError::UnknownType {
                instance: config.name.clone(),
                type_name: config.type_name.clone(),
                known: self.types.keys().cloned().collect(),
            });
        };
        let origin_name = self.origin_name(*origin);
        // Registered before `create`, so a constructor that never returns is noticed too.
        let stats = crossbeam_utils::CachePadded::new(InstanceStats::default());
        let watch = Watch::register(WatchSpec {
            name: &config.name,
            type_name: &config.type_name,
            origin: &origin_name,
            hang_after: config.hang_after,
            on_hang: settings.on_hang,
            hangs: stats.hangs.clone(),
        });
        let created = match origin {
            TypeOrigin::Builtin(builtin) => builtin
                .create(&config.name, &config.parameters_json, &settings.builtin)
                .map_err(|e| (e.kind(), e.key().to_string(), e.message().to_string())),
            TypeOrigin::Plugin(index) => {
                let library = &self.libraries[*index];
                let ctx = RawCreateContext {
                    instance_name: RStr::from_str(&config.name),
                    host_cache_hit_weight: settings.builtin.host_cache_hit_weight,
                    disk_cache_hit_weight: settings.builtin.disk_cache_hit_weight,
                    block_size: settings.block_size,
                    log: host_log(),
                    extensions: RSlice::EMPTY,
                };
                let _call = watch.begin(Call::Create, Some(Instant::now()), None);
                match (library.module.create())(
                    RStr::from_str(&config.type_name),
                    RStr::from_str(&config.parameters_json),
                    &ctx,
                ) {
                    RResult::ROk(policy) => Ok(policy),
                    RResult::RErr(e) => Err((e.kind, e.key.to_string(), e.message.to_string())),
                }
            }
        };
        let policy = created.map_err(|(kind, key, message)| {
            use plugin_api::abi::CreateFailureKind as K;
            if kind == K::INVALID_PARAMETERS {
                PolicyError::InvalidParameters {
                    instance: config.name.clone(),
                    type_name: config.type_name.clone(),
                    origin: origin_name.clone(),
                    key,
                    message,
                }
            } else {
                PolicyError::CreateFailed {
                    instance: config.name.clone(),
                    type_name: config.type_name.clone(),
                    origin: origin_name.clone(),
                    panicked: kind == K::PANICKED,
                    message,
                }
            }
        })?;
        let inputs = policy.required_inputs();
        if !Inputs::KNOWN.contains(inputs) {
            return Err(PolicyError::UnknownInputs {
                instance: config.name.clone(),
                type_name: config.type_name.clone(),
                origin: origin_name,
                inputs,
            });
        }
        Ok(PolicyInstance {
            name: config.name.clone(),
            type_name: config.type_name.clone(),
            origin: origin_name,
            narrows_soft_target: *origin == TypeOrigin::Builtin(Builtin::Default),
            parameters_json: config.parameters_json.clone(),
            on_error: config.on_error,
            pick_budget: config.pick_budget,
            quarantine_after: config.quarantine_after.max(1),
            hang_after: config.hang_after,
            inputs,
            policy,
            stats,
            poisoned: AtomicBool::new(false),
            poison_reason: OnceLock::new(),
            quarantined: AtomicBool::new(false),
            quarantine_reason: OnceLock::new(),
            consecutive_slow: AtomicU32::new(0),
            watch,
            logs: InstanceLogs::default(),
        })
    }
}

/// The built-in types, the start of every catalog.
fn builtin_types() -> BTreeMap<String, (TypeOrigin, PolicyTypeDoc)> {
    Builtin::ALL
        .into_iter()
        .map(|b| (b.as_str().to_string(), (TypeOrigin::Builtin(b), b.doc())))
        .collect()
}

/// Host settings passed to every instance at creation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HostSettings {
    pub block_size: u32,
    pub builtin: BuiltinSettings,
    /// What the watchdog does after it marked one of the instances hung.
    pub on_hang: OnHang,
}

/// Counters per instance, readable while the host runs.
#[derive(Debug, Default)]
pub struct InstanceStats {
    /// Bumped by every pick from every routing thread: striped, so it does not bounce a line.
    pub picks: StripedCounter,
    pub errors: AtomicU64,
    pub panics: AtomicU64,
    pub out_of_range: AtomicU64,
    pub fallbacks: AtomicU64,
    /// Decisions over the budget because `pick` alone took longer than it.
    pub slow_picks: AtomicU64,
    /// Decisions over the budget because `explain` pushed `pick + explain` past it.
    pub slow_explains: AtomicU64,
    /// Calls found running past `hang_after` (counted by the watchdog, which shares it).
    pub hangs: Arc<AtomicU64>,
}

/// A plain copy of [`InstanceStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct InstanceCounters {
    pub picks: u64,
    pub errors: u64,
    pub panics: u64,
    pub out_of_range: u64,
    pub fallbacks: u64,
    pub slow_picks: u64,
    pub slow_explains: u64,
    pub hangs: u64,
}

impl InstanceStats {
    pub fn snapshot(&self) -> InstanceCounters {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        InstanceCounters {
            picks: self.picks.get(),
            errors: get(&self.errors),
            panics: get(&self.panics),
            out_of_range: get(&self.out_of_range),
            fallbacks: get(&self.fallbacks),
            slow_picks: get(&self.slow_picks),
            slow_explains: get(&self.slow_explains),
            hangs: get(&self.hangs),
        }
    }
}

/// One configured policy instance.
pub struct PolicyInstance {
    pub name: String,
    pub type_name: String,
    /// "built-in" or the plugin file's path.
    pub origin: String,
    /// Only the built-in `default` selector: the host narrows its rows to an eligible soft
    /// target. A one-off compatibility rule, not something a plugin can ask for.
    pub narrows_soft_target: bool,
    pub parameters_json: String,
    pub on_error: OnError,
    /// What one decision (`pick`, plus `explain` when the caller asks for one) may take.
    pub pick_budget: Duration,
    /// Consecutive over-budget decisions that quarantine the instance.
    pub quarantine_after: u32,
    /// A call still running after this long marks the instance hung (see [`crate::watchdog`]).
    pub hang_after: Duration,
    pub inputs: Inputs,
    pub(crate) policy: PolicyBox,
    /// On cache lines of its own: counters written per pick must not evict the fields every
    /// pick reads (the policy box, flags, inputs) from other cores' caches.
    pub stats: crossbeam_utils::CachePadded<InstanceStats>,
    /// Set after the policy panicked: it is no longer called.
    pub(crate) poisoned: AtomicBool,
    /// The panic that poisoned it (the first one seen).
    poison_reason: OnceLock<String>,
    /// Set after `quarantine_after` consecutive slow decisions: it is no longer called.
    pub(crate) quarantined: AtomicBool,
    quarantine_reason: OnceLock<String>,
    pub(crate) consecutive_slow: AtomicU32,
    /// Registered with the watchdog, which marks it hung; every call is marked in this
    /// thread's watchdog slot while it runs.
    pub(crate) watch: Watch,
    /// Log lines that could repeat per request, each rate-limited.
    pub(crate) logs: InstanceLogs,
}

/// Whether an instance is called, and if not, why. The first that applies, in this order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InstanceState {
    InService,
    /// A callback panicked (in the plugin or seen by the host): never called again.
    Poisoned,
    /// `quarantine_after` consecutive decisions over `pick_budget_us`.
    Quarantined,
    /// A call ran past `hang_after_ms` (see [`crate::watchdog`]).
    Hung,
}

impl InstanceState {
    pub const ALL: [InstanceState; 4] = [
        InstanceState::InService,
        InstanceState::Poisoned,
        InstanceState::Quarantined,
        InstanceState::Hung,
    ];

    /// `in_service`, `poisoned`, `quarantined`, `hung`: the `state` label and `/ready`'s word.
    pub fn as_str(self) -> &'static str {
        match self {
            InstanceState::InService => "in_service",
            InstanceState::Poisoned => "poisoned",
            InstanceState::Quarantined => "quarantined",
            InstanceState::Hung => "hung",
        }
    }
}

impl std::fmt::Display for InstanceState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How often a log line that can repeat per request (a policy error, an out-of-range index, a
/// failed `explain`, a request sent to the fallback of an instance out of service) is written
/// for one instance: the first occurrence, then at most one line per interval saying how many
/// were not written. The counters (`router_policy_*`) count every occurrence.
pub const LOG_REPEAT_INTERVAL: Duration = Duration::from_secs(60);

/// `" (N more since the last such line, not logged)"`, or nothing.
pub(crate) fn suppressed_note(suppressed: u64) -> String {
    if suppressed == 0 {
        String::new()
    } else {
        format!(
            " ({suppressed} more like it in the last {} s, not logged)",
            LOG_REPEAT_INTERVAL.as_secs()
        )
    }
}

/// The rate-limited log lines of one instance.
#[derive(Debug, Default)]
pub(crate) struct InstanceLogs {
    /// `pick` returned an error or an out-of-range index.
    pub(crate) pick_failed: crate::log_limit::LogThrottle,
    /// `explain` returned an error.
    pub(crate) explain_failed: crate::log_limit::LogThrottle,
    /// A request of an instance out of service went to its fallback (or failed).
    pub(crate) out_of_service: crate::log_limit::LogThrottle,
}

impl PolicyInstance {
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Relaxed)
    }

    pub fn is_quarantined(&self) -> bool {
        self.quarantined.load(Ordering::Relaxed)
    }

    /// Whether the watchdog found one of its calls running past `hang_after`: it is no longer
    /// called.
    pub fn is_hung(&self) -> bool {
        self.watch.is_hung()
    }

    /// The call that made it hung, how long it had run and its request, once it is hung.
    pub fn hang(&self) -> Option<&Hang> {
        self.watch.hang()
    }

    /// In service, or why not (the first of poisoned, quarantined, hung).
    pub fn state(&self) -> InstanceState {
        if self.is_poisoned() {
            InstanceState::Poisoned
        } else if self.is_quarantined() {
            InstanceState::Quarantined
        } else if self.is_hung() {
            InstanceState::Hung
        } else {
            InstanceState::InService
        }
    }

    /// Why the instance is out of service (`None` while in service): the panic, the slow
    /// decisions, or the call that hung.
    pub fn state_reason(&self) -> Option<String> {
        match self.state() {
            InstanceState::InService => None,
            InstanceState::Poisoned => Some(
                self.poison_reason
                    .get()
                    .cloned()
                    .unwrap_or_else(|| "it panicked".to_owned()),
            ),
            InstanceState::Quarantined => self.quarantine_reason.get().cloned(),
            InstanceState::Hung => Some(self.watch.failure().to_string()),
        }
    }

    /// Built into the host (its calls are ours: they do not hang).
    pub fn is_builtin(&self) -> bool {
        self.origin == BUILT_IN
    }

    /// Not poisoned, quarantined or hung: hooks are called only then.
    pub(crate) fn in_service(&self) -> bool {
        !self.is_poisoned() && !self.is_quarantined() && !self.is_hung()
    }

    /// The policy object itself, as loaded. Calling it directly bypasses poisoning, quarantine,
    /// the pick budget and the row bounds check: for benchmarks and tools, never for routing.
    pub fn policy(&self) -> &PolicyBox {
        &self.policy
    }

    /// Whether the instance may be called: not poisoned (counted as an error, as before), not
    /// quarantined, not hung. The one place an instance's health is decided.
    pub(crate) fn callable(&self) -> Result<(), PolicyFailure> {
        if !self.is_poisoned() && !self.is_quarantined() && !self.is_hung() {
            return Ok(());
        }
        self.not_callable()
    }

    /// Why [`Self::callable`] refused. Cold and out of line, off the request path's hot code
    /// (docs/performance.md, "What the profiles showed").
    #[cold]
    #[inline(never)]
    fn not_callable(&self) -> Result<(), PolicyFailure> {
        if self.is_poisoned() {
            self.stats.errors.fetch_add(1, Ordering::Relaxed);
            return Err(PolicyFailure::Poisoned);
        }
        if self.is_quarantined() {
            return Err(PolicyFailure::Quarantined);
        }
        if self.is_hung() {
            return Err(self.watch.failure());
        }
        Ok(())
    }

    /// Mark this thread as in `call` of this instance until the guard is dropped (the watchdog
    /// reads it). `started`: the caller's clock reading just before the call, if it took one.
    #[inline]
    pub(crate) fn watch_call(
        &self,
        call: Call,
        started: Option<Instant>,
        request: Option<u64>,
    ) -> crate::watchdog::CallGuard {
        self.watch.begin(call, started, request)
    }

    /// Count a failed pick; a panic poisons the instance. Returns the failure.
    #[cold]
    #[inline(never)]
    pub(crate) fn failed(&self, failure: PolicyFailure) -> PolicyFailure {
        match &failure {
            PolicyFailure::OutOfRange { .. } => {
                self.stats.out_of_range.fetch_add(1, Ordering::Relaxed);
            }
            PolicyFailure::Panicked(_) => {
                self.stats.errors.fetch_add(1, Ordering::Relaxed);
                self.stats.panics.fetch_add(1, Ordering::Relaxed);
                if let PolicyFailure::Panicked(message) = &failure {
                    let _ = self.poison_reason.set(format!("panicked: {message}"));
                }
                self.poisoned.store(true, Ordering::Relaxed);
            }
            _ => {
                self.stats.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        failure
    }

    /// Count a failure the plugin returned from `call` (`pick` or `explain`); a panic poisons the
    /// instance. Returns the failure.
    ///
    /// A 1.1 hook (`on_dispatch`, `on_complete`) returns nothing across the ABI, so the host
    /// cannot see a hook panic when it happens. `plugin-api`'s adapter poisons itself and answers
    /// every later `pick` and `explain` with `POISONED` (message: `poisoned by a panic in <hook>:
    /// <panic message>`) without entering author code. A panic in `pick` or `explain` comes back
    /// as `PANICKED` and poisons the host side at once (see [`Self::failed`]), and a poisoned
    /// instance is not called again, so a `POISONED` answer from an instance the host has not
    /// poisoned means a panic the host did not see: in a hook. It is counted and poisoned here
    /// as a panic, at the first call after it, and returned as [`PolicyFailure::Panicked`] so it
    /// is logged like any other panic. Only the call that flips the host's flag counts it.
    #[cold]
    #[inline(never)]
    pub(crate) fn failed_in_plugin(&self, call: &str, failure: PickFailure) -> PolicyFailure {
        if failure.kind == PickFailureKind::POISONED {
            if self.poisoned.swap(true, Ordering::Relaxed) {
                return self.failed(PolicyFailure::Poisoned);
            }
            return self.failed(PolicyFailure::Panicked(format!(
                "{} (outside pick and explain; reported by the plugin at the next {call})",
                plugin_text(&failure.message)
            )));
        }
        let failure = PickFailure {
            message: plugin_text(&failure.message).into(),
            ..failure
        };
        self.failed(PolicyFailure::from_abi(failure))
    }

    /// Count one timed decision: `pick_ns` for `pick`, `explain_ns` for `explain` (0 when none
    /// was asked for). Their sum is held to the instance's `pick_budget`; after
    /// `quarantine_after` consecutive decisions over it the instance is quarantined (and said
    /// so, once).
    #[inline]
    pub(crate) fn record_decision_time(&self, pick_ns: u64, explain_ns: u64) {
        let budget = u64::try_from(self.pick_budget.as_nanos()).unwrap_or(u64::MAX);
        if pick_ns.saturating_add(explain_ns) <= budget {
            // Load first: an unconditional store would bounce this line between routing threads.
            if self.consecutive_slow.load(Ordering::Relaxed) != 0 {
                self.consecutive_slow.store(0, Ordering::Relaxed);
            }
            return;
        }
        self.slow_decision(pick_ns, explain_ns, budget);
    }

    /// A decision over its budget: counted as a slow pick (the pick alone was over) or a slow
    /// explain (the explanation pushed it over), and the instance quarantined (and said so,
    /// once) after `quarantine_after` in a row. Cold and out of line, as [`Self::not_callable`].
    #[cold]
    #[inline(never)]
    fn slow_decision(&self, pick_ns: u64, explain_ns: u64, budget_ns: u64) {
        if pick_ns > budget_ns {
            self.stats.slow_picks.fetch_add(1, Ordering::Relaxed);
        } else {
            self.stats.slow_explains.fetch_add(1, Ordering::Relaxed);
        }
        let streak = self.consecutive_slow.fetch_add(1, Ordering::Relaxed) + 1;
        if streak < self.quarantine_after {
            return;
        }
        let budget_us = self.pick_budget.as_micros() as u64;
        let (pick_us, explain_us) = (pick_ns / 1000, explain_ns / 1000);
        let _ = self.quarantine_reason.set(format!(
            "{} consecutive decisions over pick_budget_us {budget_us} (the last: pick {pick_us} \
             us, explain {explain_us} us)",
            self.quarantine_after
        ));
        if !self.quarantined.swap(true, Ordering::Relaxed) {
            tracing::error!(
                instance = %self.name,
                policy = %self.type_name,
                origin = %self.origin,
                budget_us,
                last_pick_us = pick_us,
                last_explain_us = explain_us,
                "instance quarantined after {} consecutive decisions (pick + explain) over its \
                 time budget; its requests now go to its fallback",
                self.quarantine_after
            );
        }
    }
}

impl std::fmt::Debug for PolicyInstance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyInstance")
            .field("name", &self.name)
            .field("type_name", &self.type_name)
            .field("origin", &self.origin)
            .field("inputs", &self.inputs)
            .finish_non_exhaustive()
    }
}

// ---- plugin log bridge ------------------------------------------------------------------------

/// The log sink handed to plugins: their events re-enter the host's `tracing` here.
pub fn host_log() -> HostLog {
    use tracing::level_filters::LevelFilter;
    let max_level = match LevelFilter::current() {
        LevelFilter::OFF => LogLevel(0),
        LevelFilter::ERROR => LogLevel::ERROR,
        LevelFilter::WARN => LogLevel::WARN,
        LevelFilter::INFO => LogLevel::INFO,
        LevelFilter::DEBUG => LogLevel::DEBUG,
        _ => LogLevel::TRACE,
    };
    HostLog {
        emit: emit_plugin_log,
        max_level,
    }
}

/// Log lines one plugin may write per [`PLUGIN_LOG_WINDOW`]; past that, its lines are counted and
/// not written, so a plugin that logs on every pick cannot flood the host's log.
pub const PLUGIN_LOG_LINES_PER_WINDOW: u64 = 100;
/// The window of [`PLUGIN_LOG_LINES_PER_WINDOW`].
pub const PLUGIN_LOG_WINDOW: Duration = Duration::from_secs(10);
/// Plugin names with a budget of their own; lines of further names share one budget.
const PLUGIN_LOG_NAMES_MAX: usize = 64;

/// One plugin's log budget in the current window.
#[derive(Debug, Default)]
struct PluginLogBudget {
    window_start_ns: u64,
    written: u64,
    dropped: u64,
}

/// What to do with one plugin log line.
#[derive(Debug, PartialEq, Eq)]
enum PluginLogVerdict {
    /// Write it; `dropped_before`: lines of the previous window that were not written.
    Write {
        dropped_before: u64,
    },
    /// Write it, then say that the budget is spent for the rest of the window.
    WriteLast,
    Drop,
}

impl PluginLogBudget {
    fn admit(&mut self, now_ns: u64, window_ns: u64, limit: u64) -> PluginLogVerdict {
        let mut dropped_before = 0;
        if now_ns.saturating_sub(self.window_start_ns) >= window_ns || self.written == 0 {
            dropped_before = std::mem::take(&mut self.dropped);
            self.window_start_ns = now_ns;
            self.written = 0;
        }
        if self.written >= limit {
            self.dropped += 1;
            return PluginLogVerdict::Drop;
        }
        self.written += 1;
        if self.written == limit {
            return PluginLogVerdict::WriteLast;
        }
        PluginLogVerdict::Write { dropped_before }
    }
}

fn plugin_log_verdict(plugin: &str) -> PluginLogVerdict {
    static BUDGETS: OnceLock<std::sync::Mutex<std::collections::HashMap<String, PluginLogBudget>>> =
        OnceLock::new();
    let mut budgets = BUDGETS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let key = if budgets.contains_key(plugin) || budgets.len() < PLUGIN_LOG_NAMES_MAX {
        plugin
    } else {
        ""
    };
    let now = crate::log_limit::now_ns();
    let window = u64::try_from(PLUGIN_LOG_WINDOW.as_nanos()).unwrap_or(u64::MAX);
    budgets
        .entry(key.to_owned())
        .or_default()
        .admit(now, window, PLUGIN_LOG_LINES_PER_WINDOW)
}

/// A plugin's log record as one `tracing` event. Every field is [`plugin_text`]: a newline in a
/// plugin's message cannot forge a line of the host's log. At most
/// [`PLUGIN_LOG_LINES_PER_WINDOW`] lines per plugin per [`PLUGIN_LOG_WINDOW`] are written; the
/// host says when it starts dropping a plugin's lines and, in the next window, how many it
/// dropped.
extern "C" fn emit_plugin_log(record: &LogRecord<'_>) {
    let plugin = plugin_text(record.plugin.as_str());
    let plugin = plugin.as_str();
    let verdict = plugin_log_verdict(plugin);
    match verdict {
        PluginLogVerdict::Drop => return,
        PluginLogVerdict::Write { dropped_before } if dropped_before > 0 => tracing::warn!(
            target: "plugin",
            plugin,
            dropped = dropped_before,
            "{dropped_before} log lines of this plugin were not logged in the previous {} s \
             (more than {PLUGIN_LOG_LINES_PER_WINDOW} per window)",
            PLUGIN_LOG_WINDOW.as_secs()
        ),
        _ => {}
    }
    let target = plugin_text(record.target.as_str());
    let target = target.as_str();
    let message = plugin_text(record.message.as_str());
    match record.level {
        LogLevel::ERROR => {
            tracing::error!(target: "plugin", plugin, plugin_target = target, "{message}")
        }
        LogLevel::WARN => {
            tracing::warn!(target: "plugin", plugin, plugin_target = target, "{message}")
        }
        LogLevel::INFO => {
            tracing::info!(target: "plugin", plugin, plugin_target = target, "{message}")
        }
        LogLevel::DEBUG => {
            tracing::debug!(target: "plugin", plugin, plugin_target = target, "{message}")
        }
        _ => tracing::trace!(target: "plugin", plugin, plugin_target = target, "{message}"),
    }
    if verdict == PluginLogVerdict::WriteLast {
        tracing::warn!(
            target: "plugin",
            plugin,
            "this plugin wrote {PLUGIN_LOG_LINES_PER_WINDOW} log lines in {} s; its further lines \
             in this window are counted, not logged",
            PLUGIN_LOG_WINDOW.as_secs()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(name: &str) -> PolicyTypeDoc {
        PolicyTypeDoc {
            name: name.to_string(),
            summary: String::new(),
            parameters: Vec::new(),
        }
    }

    fn register(
        types: &mut BTreeMap<String, (TypeOrigin, PolicyTypeDoc)>,
        index: usize,
        path: &str,
        names: &[&str],
    ) -> Result<(), String> {
        let docs: Vec<PolicyTypeDoc> = names.iter().map(|n| doc(n)).collect();
        register_library_types(types, index, Path::new(path), &docs, |o| match o {
            TypeOrigin::Builtin(_) => BUILT_IN.to_string(),
            TypeOrigin::Plugin(i) => format!("/lib{i}.so"),
        })
        .map_err(|e| e.to_string())
    }

    #[test]
    fn the_note_says_how_many_lines_were_left_out() {
        assert_eq!(suppressed_note(0), "");
        assert_eq!(
            suppressed_note(99),
            " (99 more like it in the last 60 s, not logged)"
        );
    }

    #[test]
    fn a_plugin_writes_at_most_its_budget_per_window_and_hears_what_was_dropped() {
        let mut b = PluginLogBudget::default();
        let s = 1_000_000_000;
        assert_eq!(
            b.admit(5, 10 * s, 3),
            PluginLogVerdict::Write { dropped_before: 0 }
        );
        assert_eq!(
            b.admit(6, 10 * s, 3),
            PluginLogVerdict::Write { dropped_before: 0 }
        );
        assert_eq!(b.admit(7, 10 * s, 3), PluginLogVerdict::WriteLast);
        for i in 0..50 {
            assert_eq!(b.admit(8 + i, 10 * s, 3), PluginLogVerdict::Drop);
        }
        // The next window: written again, with the count of the previous one.
        assert_eq!(
            b.admit(11 * s, 10 * s, 3),
            PluginLogVerdict::Write { dropped_before: 50 }
        );
        assert_eq!(
            b.admit(12 * s, 10 * s, 3),
            PluginLogVerdict::Write { dropped_before: 0 }
        );
    }

    #[test]
    fn one_library_exporting_a_type_twice_is_named_once_with_the_type() {
        let mut types = BTreeMap::new();
        let err = register(&mut types, 0, "/lib0.so", &["probe", "other", "probe"]).unwrap_err();
        assert_eq!(err, "library /lib0.so exports policy type `probe` twice");
    }

    #[test]
    fn two_libraries_exporting_one_type_still_name_both() {
        let mut types = BTreeMap::new();
        register(&mut types, 0, "/lib0.so", &["probe"]).unwrap();
        let err = register(&mut types, 1, "/lib1.so", &["probe"]).unwrap_err();
        assert_eq!(
            err,
            "policy type `probe` is exported by two libraries: /lib0.so and /lib1.so"
        );
    }

    #[test]
    fn a_type_named_like_a_built_in_is_refused_as_such_not_as_a_second_library() {
        for builtin in Builtin::ALL {
            let mut types = builtin_types();
            let err = register(&mut types, 0, "/lib0.so", &["ok", builtin.as_str()]);
            assert_eq!(
                err.unwrap_err(),
                format!(
                    "library /lib0.so exports policy type `{}`, which is the name of a built-in \
                     policy type (built-ins: `default`, `round-robin`, `random`); a plugin cannot \
                     replace a built-in, so the library is refused: rename the type in the plugin",
                    builtin.as_str()
                )
            );
        }
    }

    #[test]
    fn type_names_are_restricted_to_a_printable_set() {
        for good in [
            "probe",
            "dynamo-two-tier-cost-fn",
            "soft-pin-repin",
            "versioned-least-loaded",
            "a_b.c:d-E9",
            &"x".repeat(MAX_TYPE_NAME_LEN),
        ] {
            assert!(is_valid_type_name(good), "{good}");
        }
        for builtin in Builtin::ALL {
            assert!(is_valid_type_name(builtin.as_str()));
        }
        for bad in [
            "",
            "has space",
            "tab\there",
            "bell\u{7}",
            "\u{1b}[31mred\u{1b}[0m",
            "new\nline",
            "caf\u{e9}",
            "slash/name",
            "quote`",
            &"x".repeat(MAX_TYPE_NAME_LEN + 1),
        ] {
            assert!(!is_valid_type_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn an_unsafe_type_name_is_refused_escaped_naming_the_library() {
        let mut types = BTreeMap::new();
        let err = register(&mut types, 0, "/evil.so", &["ok", "\u{1b}[2Jwipe\r\n"]).unwrap_err();
        assert_eq!(
            err,
            "library /evil.so exports a policy type named \"\\u{1b}[2Jwipe\\r\\n\", which is \
             not a valid type name: it must be 1 to 128 characters from A-Z, a-z, 0-9, `_`, `.`, \
             `:` and `-`"
        );
        assert!(!err.chars().any(|c| c.is_control()), "{err:?}");
        // A huge name is cut, not printed whole.
        let long = format!("\u{7}{}", "y".repeat(1 << 20));
        let err = register(&mut types, 1, "/big.so", &[&long]).unwrap_err();
        assert!(err.len() < 600, "{} bytes", err.len());
        assert!(
            err.contains("\"\\u{7}yyy") && err.contains("... (1048577 bytes)"),
            "{err}"
        );
    }
}
