//! Router configuration: parses the router YAML into typed, validated settings.
//!
//! This is the only module of the crate that knows about `serde_yaml`. Everything it returns is
//! plain Rust data ([`RouterConfig`]) or a [`ConfigError`] whose message names the file, the line
//! and column when known, the key path (`worker_selection.instances[0].name`) and what is wrong.
//!
//! Rules, in brief (the configuration reference in `docs/` has the long form):
//! - every mapping rejects unknown keys;
//! - an optional key whose value is null (`block_size:` or `block_size: ~`) takes its default, and an
//!   empty file (or one with only comments) is a valid configuration with every default;
//! - numbers are range-checked while parsing, so the error points at the offending value;
//! - cross-entry rules (duplicate names, roles naming undefined instances, plugin entries with both
//!   or neither of `path`/`name`, policy classes without a threshold) are checked afterwards and the
//!   error still carries the line of the entry, found by re-reading the text;
//! - instance `parameters` and `engine` are carried as JSON, so values JSON cannot represent (NaN,
//!   infinities, non-string mapping keys, YAML tags) are rejected with their key path.

use std::collections::HashMap;
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use plugin_api::Role;
use serde::de::{self, DeserializeSeed, IgnoredAny, Unexpected, VariantAccess, Visitor};
use serde::{Deserialize, Deserializer};

/// The instance name reserved for the built-in selector (design doc §7).
pub const DEFAULT_INSTANCE: &str = "default";
/// Default tokens per KV block.
pub const DEFAULT_BLOCK_SIZE: u32 = 16;
/// Default weight of a host-tier (CPU offload) cache hit in the built-in selector.
pub const DEFAULT_HOST_CACHE_HIT_WEIGHT: f64 = 0.75;
/// Default weight of a disk-tier cache hit in the built-in selector.
pub const DEFAULT_DISK_CACHE_HIT_WEIGHT: f64 = 0.25;
/// Default `default_selector.prefill_load_scale`.
pub const DEFAULT_PREFILL_LOAD_SCALE: f64 = 1.0;
/// Default `default_selector.decode_active_request_weight`.
pub const DEFAULT_DECODE_ACTIVE_REQUEST_WEIGHT: f64 = 0.0;
/// Default per-pick time budget of a policy instance (`pick_budget_us: 1000`).
pub const DEFAULT_PICK_BUDGET: Duration = Duration::from_micros(1000);
/// Default number of consecutive over-budget picks after which an instance is quarantined.
pub const DEFAULT_QUARANTINE_AFTER: u32 = 3;
/// Default idle timeout of a session binding (`ttl_secs: 600`).
pub const DEFAULT_SESSION_TTL: Duration = Duration::from_secs(600);
/// Largest accepted `session_affinity.ttl_secs` (ten years), so that `now + ttl` cannot overflow
/// a clock.
pub const MAX_SESSION_TTL_SECS: u64 = 10 * 365 * 24 * 3600;
/// Default maximum number of session bindings.
pub const DEFAULT_MAX_BINDINGS: usize = 65_536;
/// Maximum length of an instance or policy class name, in bytes.
pub const MAX_NAME_LEN: usize = 128;
/// Largest configuration file [`RouterConfig::from_file`] reads.
pub const MAX_CONFIG_BYTES: u64 = 16 * 1024 * 1024;

/// Re-parsing budget (bytes of YAML) for finding the line of every plugin and instance entry on
/// the success path. Large generated files simply get `line: None`.
const LINE_LOOKUP_BUDGET: usize = 1024 * 1024;

// ---------------------------------------------------------------------------------------------
// Public configuration types
// ---------------------------------------------------------------------------------------------

/// The whole router configuration, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterConfig {
    /// The file this was read from; `None` when parsed from a string.
    pub source: Option<PathBuf>,
    /// Tokens per KV block (> 0).
    pub block_size: u32,
    /// Weight of a host-tier cache hit in the built-in selector (finite, >= 0).
    pub host_cache_hit_weight: f64,
    /// Weight of a disk-tier cache hit in the built-in selector (finite, >= 0).
    pub disk_cache_hit_weight: f64,
    /// Weights of the built-in `default` selector.
    pub default_selector: DefaultSelectorConfig,
    /// Plugins to load, in file order.
    pub plugins: Vec<PluginSpec>,
    /// Which policy instance serves which role, and the instances.
    pub worker_selection: WorkerSelectionConfig,
    /// Session affinity; `None` = off.
    pub session_affinity: Option<SessionAffinityConfig>,
    /// Queue admission classes (design doc §10), in file order.
    pub policy_classes: Vec<PolicyClassConfig>,
    /// Opaque settings for the replay simulator (a JSON object), not validated here.
    pub engine: Option<serde_json::Value>,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            source: None,
            block_size: DEFAULT_BLOCK_SIZE,
            host_cache_hit_weight: DEFAULT_HOST_CACHE_HIT_WEIGHT,
            disk_cache_hit_weight: DEFAULT_DISK_CACHE_HIT_WEIGHT,
            default_selector: DefaultSelectorConfig::default(),
            plugins: Vec::new(),
            worker_selection: WorkerSelectionConfig::default(),
            session_affinity: None,
            policy_classes: Vec::new(),
            engine: None,
        }
    }
}

/// Weights of the built-in `default` selector (design doc §7).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DefaultSelectorConfig {
    /// Multiplier of the prefill term of the cost.
    pub prefill_load_scale: f64,
    /// Weight of `active_requests` in the cost.
    pub decode_active_request_weight: f64,
}

impl Default for DefaultSelectorConfig {
    fn default() -> Self {
        DefaultSelectorConfig {
            prefill_load_scale: DEFAULT_PREFILL_LOAD_SCALE,
            decode_active_request_weight: DEFAULT_DECODE_ACTIVE_REQUEST_WEIGHT,
        }
    }
}

/// Where a plugin comes from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PluginSource {
    /// A file. Relative paths in YAML are already resolved against the YAML file's directory
    /// (or the current directory for configurations parsed from a string).
    Path(PathBuf),
    /// A library name: `lib<name>.so`, resolved by the loader in its search directories.
    Name(String),
}

impl fmt::Display for PluginSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PluginSource::Path(path) => write!(f, "path {}", path.display()),
            PluginSource::Name(name) => write!(f, "name {name}"),
        }
    }
}

/// One entry of `plugins:`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginSpec {
    /// The file or library name.
    pub source: PluginSource,
    /// Expected SHA-256 of the file, 64 lowercase hex digits.
    pub sha256: Option<String>,
    /// Skip the file ownership/permission checks for this plugin.
    pub allow_insecure_permissions: bool,
    /// 1-based line of the entry in the file (best effort).
    pub line: Option<usize>,
}

/// The `worker_selection` block: one instance name per role, and the instances.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerSelectionConfig {
    /// Instance serving the aggregated role (`default` = built-in selector).
    pub aggregated: String,
    /// Instance serving the prefill role.
    pub prefill: String,
    /// Instance serving the decode role.
    pub decode: String,
    /// Configured policy instances, in file order; names are unique and never `default`.
    pub instances: Vec<InstanceConfig>,
}

impl Default for WorkerSelectionConfig {
    fn default() -> Self {
        WorkerSelectionConfig {
            aggregated: DEFAULT_INSTANCE.to_owned(),
            prefill: DEFAULT_INSTANCE.to_owned(),
            decode: DEFAULT_INSTANCE.to_owned(),
            instances: Vec::new(),
        }
    }
}

impl WorkerSelectionConfig {
    /// The instance name serving `role` (`default` for the built-in selector). Roles this host
    /// does not know (`Role::Other`) get the built-in selector.
    pub fn instance_for(&self, role: Role) -> &str {
        match role {
            Role::Aggregated => &self.aggregated,
            Role::Prefill => &self.prefill,
            Role::Decode => &self.decode,
            Role::Other(_) => DEFAULT_INSTANCE,
        }
    }

    /// The configured instance called `name` (never the built-in `default`).
    pub fn instance(&self, name: &str) -> Option<&InstanceConfig> {
        self.instances.iter().find(|instance| instance.name == name)
    }
}

/// One entry of `worker_selection.instances`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceConfig {
    /// Unique instance name, `[A-Za-z0-9_.-]{1,128}`, never `default`.
    pub name: String,
    /// Policy type name as exported by a plugin (`type:` in YAML).
    pub type_name: String,
    /// The `parameters` mapping as compact JSON object text; `{}` when absent.
    pub parameters_json: String,
    /// What the host does when this instance errors or panics.
    pub on_error: OnError,
    /// A pick slower than this counts as a budget breach.
    pub pick_budget: Duration,
    /// Consecutive budget breaches after which the instance is quarantined to its fallback.
    pub quarantine_after: u32,
    /// 1-based line of the entry in the file (best effort).
    pub line: Option<usize>,
}

/// What the host does when a policy instance errors, panics or is quarantined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnError {
    /// Route the request with the built-in `default` selector.
    #[default]
    Fallback,
    /// Fail the request.
    Fail,
}

impl OnError {
    /// The YAML spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            OnError::Fallback => "fallback",
            OnError::Fail => "fail",
        }
    }
}

impl fmt::Display for OnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `session_affinity:` settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionAffinityConfig {
    /// Soft (advisory target, binding follows the dispatch) or hard (binding is a pin).
    pub mode: AffinityMode,
    /// Idle timeout of a binding.
    pub ttl: Duration,
    /// Maximum number of bindings held at once.
    pub max_bindings: usize,
}

/// Session affinity mode (design doc §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AffinityMode {
    /// The binding is an advisory target and follows the dispatched row.
    Soft,
    /// The binding behaves like a pin.
    Hard,
}

impl AffinityMode {
    /// The YAML spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            AffinityMode::Soft => "soft",
            AffinityMode::Hard => "hard",
        }
    }
}

impl fmt::Display for AffinityMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One entry of `policy_classes:` (design doc §10). At least one threshold is set.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyClassConfig {
    /// Unique class name, `[A-Za-z0-9_.-]{1,128}`.
    pub name: String,
    /// A row is busy when its active prefill tokens exceed this.
    pub prefill_busy_threshold: Option<u64>,
    /// A row is busy when its active prefill tokens exceed this times the worker's
    /// `max_num_batched_tokens` (finite, > 0).
    pub prefill_busy_threshold_frac: Option<f64>,
    /// How admission consults the busy check.
    pub admission: AdmissionMode,
}

/// Queue admission mode (design doc §10).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdmissionMode {
    /// Queue only while every eligible row is busy (the original contract).
    #[default]
    AnyEligible,
    /// Select first; queue while the chosen row is busy.
    ChosenRow,
}

impl AdmissionMode {
    /// The YAML spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            AdmissionMode::AnyEligible => "any_eligible",
            AdmissionMode::ChosenRow => "chosen_row",
        }
    }
}

impl fmt::Display for AdmissionMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// A configuration that could not be read or is invalid.
///
/// Displays as `config FILE: line L column C: KEY: PROBLEM`, where FILE is `<string>` for text
/// parsed with [`RouterConfig::from_yaml_str`] without a source, and the location and key parts
/// are left out when unknown.
#[derive(Debug)]
pub struct ConfigError(Box<ErrorInner>);

#[derive(Debug)]
struct ErrorInner {
    file: Option<PathBuf>,
    line: Option<usize>,
    column: Option<usize>,
    key: Option<String>,
    kind: ConfigErrorKind,
}

impl ConfigError {
    fn new(file: Option<&Path>, kind: ConfigErrorKind) -> Self {
        ConfigError(Box::new(ErrorInner {
            file: file.map(Path::to_path_buf),
            line: None,
            column: None,
            key: None,
            kind,
        }))
    }

    fn at(mut self, location: Option<(usize, usize)>) -> Self {
        if let Some((line, column)) = location {
            self.0.line = Some(line);
            self.0.column = Some(column);
        }
        self
    }

    fn key(mut self, key: impl Into<String>) -> Self {
        let key = key.into();
        self.0.key = (!key.is_empty()).then_some(key);
        self
    }

    /// The configuration file, `None` for text parsed from a string.
    pub fn file(&self) -> Option<&Path> {
        self.0.file.as_deref()
    }

    /// 1-based line of the problem, when known.
    pub fn line(&self) -> Option<usize> {
        self.0.line
    }

    /// 1-based column of the problem, when known.
    pub fn column(&self) -> Option<usize> {
        self.0.column
    }

    /// Key path of the problem, e.g. `worker_selection.instances[0].name`, when known.
    pub fn key_path(&self) -> Option<&str> {
        self.0.key.as_deref()
    }

    /// What is wrong.
    pub fn kind(&self) -> &ConfigErrorKind {
        &self.0.kind
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = &self.0;
        match &inner.file {
            Some(file) => write!(f, "config {}: ", file.display())?,
            None => f.write_str("config <string>: ")?,
        }
        match (inner.line, inner.column) {
            (Some(line), Some(column)) => write!(f, "line {line} column {column}: ")?,
            (Some(line), None) => write!(f, "line {line}: ")?,
            _ => {}
        }
        if let Some(key) = &inner.key {
            write!(f, "{key}: ")?;
        }
        fmt::Display::fmt(&inner.kind, f)
    }
}

// The underlying I/O and UTF-8 errors are part of the message, so they are not repeated as a
// `source()`; a caller printing the chain would otherwise show them twice.
impl std::error::Error for ConfigError {}

/// What is wrong with a configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigErrorKind {
    /// The file could not be opened or read.
    #[error("cannot read the file: {0}")]
    Read(std::io::Error),
    /// The file is larger than [`MAX_CONFIG_BYTES`].
    #[error("the file is larger than {limit} bytes")]
    TooLarge {
        /// The limit in bytes.
        limit: u64,
    },
    /// The file is not UTF-8.
    #[error("the file is not valid UTF-8: {0}")]
    NotUtf8(std::str::Utf8Error),
    /// YAML syntax error, wrong type, unknown key, out-of-range number or invalid name, as reported
    /// while parsing (the message is the parser's).
    #[error("{message}")]
    Yaml {
        /// The parser's message, without the location and key path (shown separately).
        message: String,
    },
    /// Two instances share a name.
    #[error("duplicate instance name `{name}`{}", first_defined(*first_line))]
    DuplicateInstance {
        /// The repeated name.
        name: String,
        /// Line of the first definition, when known.
        first_line: Option<usize>,
    },
    /// A role names an instance that is not defined.
    #[error(
        "role `{role}` uses instance `{}`, which is not defined; defined instances: {}",
        excerpt(instance),
        list_instances(defined)
    )]
    UnknownInstance {
        /// `aggregated`, `prefill` or `decode`.
        role: String,
        /// The name the role refers to.
        instance: String,
        /// Names of the configured instances (the built-in `default` is always available too).
        defined: Vec<String>,
    },
    /// A plugin entry has both `path` and `name`.
    #[error("plugin entry has both `path` ({path}) and `name` ({name}); give exactly one of them")]
    PluginBothPathAndName {
        /// The `path` value as written.
        path: String,
        /// The `name` value.
        name: String,
    },
    /// A plugin entry has neither `path` nor `name`.
    #[error(
        "plugin entry has neither `path` nor `name`; give exactly one of them \
         (`path: ./libfoo.so` for a file, `name: foo` for lib<name>.so in the plugin directories)"
    )]
    PluginWithoutSource,
    /// Two policy classes share a name.
    #[error("duplicate policy class name `{name}`{}", first_defined(*first_line))]
    DuplicatePolicyClass {
        /// The repeated name.
        name: String,
        /// Line of the first definition, when known.
        first_line: Option<usize>,
    },
    /// A policy class sets no threshold.
    #[error(
        "policy class `{name}` sets neither `prefill_busy_threshold` nor \
         `prefill_busy_threshold_frac`; set at least one"
    )]
    PolicyClassWithoutThreshold {
        /// The class name.
        name: String,
    },
    /// An instance's `parameters` is not a mapping.
    #[error("instance `{instance}`: `parameters` must be a mapping, found {found}")]
    ParametersNotMapping {
        /// The instance name.
        instance: String,
        /// What was found instead, e.g. `a sequence`.
        found: &'static str,
    },
    /// A value inside an instance's `parameters` cannot be passed to the plugin as JSON.
    #[error(
        "instance `{instance}`: {}: {problem} (parameters reach the plugin as JSON)",
        parameter_path(key_path)
    )]
    InvalidParameter {
        /// The instance name.
        instance: String,
        /// Path inside `parameters`, e.g. `cache_threshold` or `tiers[1].weight`; empty for the
        /// `parameters` mapping itself.
        key_path: String,
        /// What is wrong.
        problem: ValueProblem,
    },
    /// `engine` is not a mapping.
    #[error("`engine` must be a mapping, found {found}")]
    EngineNotMapping {
        /// What was found instead.
        found: &'static str,
    },
    /// A value inside `engine` cannot be represented as JSON.
    #[error("engine value{}: {problem}", engine_path(key_path))]
    InvalidEngineValue {
        /// Path inside `engine`; empty for the mapping itself.
        key_path: String,
        /// What is wrong.
        problem: ValueProblem,
    },
}

/// Why a YAML value cannot be carried as JSON.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ValueProblem {
    /// NaN or an infinity (`.nan`, `.inf`, `-.inf`).
    #[error("{0} is not a finite number, and JSON has no NaN or infinity")]
    NotFinite(String),
    /// A mapping key that is not a string.
    #[error("mapping key {0} is not a string; JSON object keys must be strings")]
    NonStringKey(String),
    /// A YAML tag such as `!foo`.
    #[error("YAML tag `{0}` is not supported here; write the plain value")]
    Tagged(String),
}

fn first_defined(line: Option<usize>) -> String {
    match line {
        Some(line) => format!(" (first defined at line {line})"),
        None => String::new(),
    }
}

fn list_instances(defined: &[String]) -> String {
    const SHOWN: usize = 20;
    let mut out = format!("`{DEFAULT_INSTANCE}` (built-in)");
    for name in defined.iter().take(SHOWN) {
        out.push_str(", `");
        out.push_str(&excerpt(name));
        out.push('`');
    }
    if defined.len() > SHOWN {
        out.push_str(&format!(" and {} more", defined.len() - SHOWN));
    }
    out
}

fn parameter_path(key_path: &str) -> String {
    if key_path.is_empty() {
        "parameters".to_owned()
    } else {
        format!("parameter `{key_path}`")
    }
}

fn engine_path(key_path: &str) -> String {
    if key_path.is_empty() {
        String::new()
    } else {
        format!(" `{key_path}`")
    }
}

// ---------------------------------------------------------------------------------------------
// Entry points
// ---------------------------------------------------------------------------------------------

impl RouterConfig {
    /// Reads and validates the configuration file at `path`.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let bytes = read_capped(path)?;
        let text = std::str::from_utf8(&bytes).map_err(|err| {
            let (line, column) = line_column(&bytes, err.valid_up_to());
            ConfigError::new(Some(path), ConfigErrorKind::NotUtf8(err)).at(Some((line, column)))
        })?;
        Self::from_yaml_str(text, Some(path))
    }

    /// Parses and validates configuration text. `source` names the file in errors and is the base
    /// for relative plugin paths; without it, errors say `<string>` and relative plugin paths
    /// resolve against the current directory.
    pub fn from_yaml_str(text: &str, source: Option<&Path>) -> Result<Self, ConfigError> {
        // libyaml reads a byte-order mark only at the start of a byte stream, not in a `&str`.
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        if let Some(location) = flow_too_deep(text) {
            return Err(ConfigError::new(
                source,
                ConfigErrorKind::Yaml {
                    message: format!(
                        "recursion limit exceeded: `[` and `{{` nested more than \
                         {MAX_FLOW_DEPTH} levels deep"
                    ),
                },
            )
            .at(Some(location)));
        }
        let raw: Option<RawConfig> =
            serde_yaml::from_str(text).map_err(|err| yaml_error(&err, source))?;
        let raw = raw.unwrap_or_default();
        Builder {
            text,
            source,
            budget: LINE_LOOKUP_BUDGET,
        }
        .build(raw)
    }

    /// The policy class called `name`.
    pub fn policy_class(&self, name: &str) -> Option<&PolicyClassConfig> {
        self.policy_classes.iter().find(|class| class.name == name)
    }
}

fn read_capped(path: &Path) -> Result<Vec<u8>, ConfigError> {
    let read_error = |err| ConfigError::new(Some(path), ConfigErrorKind::Read(err));
    let file = std::fs::File::open(path).map_err(read_error)?;
    let mut bytes = Vec::new();
    file.take(MAX_CONFIG_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read_error)?;
    if u64::try_from(bytes.len()).map_or(true, |len| len > MAX_CONFIG_BYTES) {
        return Err(ConfigError::new(
            Some(path),
            ConfigErrorKind::TooLarge {
                limit: MAX_CONFIG_BYTES,
            },
        ));
    }
    Ok(bytes)
}

/// Deepest nesting of flow collections (`[`, `{`) [`RouterConfig::from_yaml_str`] hands to the
/// YAML parser; the parser's own recursion limit (128) refuses deeper documents anyway.
pub const MAX_FLOW_DEPTH: usize = 128;

/// Where the flow collections of `text` first nest deeper than [`MAX_FLOW_DEPTH`], if they do.
///
/// The YAML scanner revisits every open flow level on each token, so its time grows with tokens
/// times depth: 100,000 nested `[` (200 KB) took minutes before the parser's recursion limit
/// could refuse them. This linear pre-scan refuses them first. It skips comments and quoted
/// scalars; a bracket inside a plain or block scalar counts, so a false refusal would need more
/// than 128 unbalanced `[`/`{` in plain text.
fn flow_too_deep(text: &str) -> Option<(usize, usize)> {
    let bytes = text.as_bytes();
    let (mut depth, mut line, mut line_start) = (0usize, 1usize, 0usize);
    // Whether the previous byte lets a comment or a quoted scalar start here.
    let mut at_token_start = true;
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        match b {
            b'\n' => {
                line += 1;
                line_start = i + 1;
            }
            b'#' if at_token_start => {
                while i + 1 < bytes.len() && bytes[i + 1] != b'\n' {
                    i += 1;
                }
            }
            b'"' | b'\'' if at_token_start => {
                i += 1;
                while i < bytes.len() {
                    match bytes[i] {
                        // An escaped character, or `''` in single quotes; an escaped line
                        // break still starts a new line.
                        b'\\' if b == b'"' => {
                            i += 1;
                            if bytes.get(i) == Some(&b'\n') {
                                line += 1;
                                line_start = i + 1;
                            }
                        }
                        b'\'' if b == b'\'' && bytes.get(i + 1) == Some(&b'\'') => i += 1,
                        c if c == b => break,
                        b'\n' => {
                            line += 1;
                            line_start = i + 1;
                        }
                        _ => {}
                    }
                    i += 1;
                }
            }
            b'[' | b'{' => {
                depth += 1;
                if depth > MAX_FLOW_DEPTH {
                    return Some((line, i - line_start + 1));
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        at_token_start = matches!(
            bytes.get(i),
            Some(b' ' | b'\t' | b'\n' | b'\r' | b'[' | b'{' | b',' | b':')
        );
        i += 1;
    }
    None
}

/// 1-based line and (byte) column of `offset` in `bytes`.
fn line_column(bytes: &[u8], offset: usize) -> (usize, usize) {
    let before = bytes.get(..offset).unwrap_or(bytes);
    let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
    let line_start = before
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |pos| pos + 1);
    (line, before.len() - line_start + 1)
}

/// Turns a `serde_yaml` error into a [`ConfigError`], splitting its `path: message at line L
/// column C` text into the key path, the message and the location.
fn yaml_error(err: &serde_yaml::Error, source: Option<&Path>) -> ConfigError {
    let location = err.location().map(|loc| (loc.line(), loc.column()));
    let mut text = err.to_string();
    if let Some((line, column)) = location {
        let suffix = format!(" at line {line} column {column}");
        if let Some(stripped) = text.strip_suffix(&suffix) {
            text = stripped.to_owned();
        } else {
            text = text.replacen(&suffix, "", 1);
        }
    }
    let (key, message) = match text.split_once(": ") {
        Some((prefix, rest)) if looks_like_key_path(prefix) => (prefix.to_owned(), rest.to_owned()),
        _ => (String::new(), text),
    };
    ConfigError::new(source, ConfigErrorKind::Yaml { message })
        .at(location)
        .key(key)
}

/// Whether `prefix` looks like a `serde_yaml` key path (`a.b[0].c`) rather than message text.
fn looks_like_key_path(prefix: &str) -> bool {
    !prefix.is_empty()
        && !prefix
            .chars()
            .any(|c| c.is_whitespace() || matches!(c, '`' | '"' | '\'' | ','))
}

// ---------------------------------------------------------------------------------------------
// Raw (as written) configuration
// ---------------------------------------------------------------------------------------------

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of router settings")]
struct RawConfig {
    #[serde(default, deserialize_with = "de_block_size")]
    block_size: Option<u32>,
    #[serde(default, deserialize_with = "de_weight")]
    host_cache_hit_weight: Option<f64>,
    #[serde(default, deserialize_with = "de_weight")]
    disk_cache_hit_weight: Option<f64>,
    #[serde(default)]
    default_selector: Option<RawDefaultSelector>,
    #[serde(default)]
    plugins: Option<Vec<RawPlugin>>,
    #[serde(default)]
    worker_selection: Option<RawWorkerSelection>,
    #[serde(default)]
    session_affinity: Option<RawSessionAffinity>,
    #[serde(default)]
    policy_classes: Option<Vec<RawPolicyClass>>,
    #[serde(default)]
    engine: Option<serde_yaml::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a `default_selector` mapping")]
struct RawDefaultSelector {
    #[serde(default, deserialize_with = "de_weight")]
    prefill_load_scale: Option<f64>,
    #[serde(default, deserialize_with = "de_weight")]
    decode_active_request_weight: Option<f64>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a plugin entry mapping with `path` or `name`"
)]
struct RawPlugin {
    #[serde(default, deserialize_with = "de_plugin_path")]
    path: Option<String>,
    #[serde(default, deserialize_with = "de_library_name")]
    name: Option<String>,
    #[serde(default, deserialize_with = "de_sha256")]
    sha256: Option<String>,
    #[serde(default)]
    allow_insecure_permissions: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a `worker_selection` mapping")]
struct RawWorkerSelection {
    #[serde(default)]
    aggregated: Option<String>,
    #[serde(default)]
    prefill: Option<String>,
    #[serde(default)]
    decode: Option<String>,
    #[serde(default)]
    instances: Option<Vec<RawInstance>>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "an instance mapping with `name` and `type`"
)]
struct RawInstance {
    #[serde(deserialize_with = "de_instance_name")]
    name: String,
    #[serde(rename = "type", deserialize_with = "de_type_name")]
    type_name: String,
    #[serde(default)]
    parameters: Option<serde_yaml::Value>,
    #[serde(default, deserialize_with = "de_on_error")]
    on_error: Option<OnError>,
    #[serde(default, deserialize_with = "de_pick_budget")]
    pick_budget_us: Option<u64>,
    #[serde(default, deserialize_with = "de_quarantine_after")]
    quarantine_after: Option<u64>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a `session_affinity` mapping with `mode`"
)]
struct RawSessionAffinity {
    #[serde(deserialize_with = "de_affinity_mode")]
    mode: AffinityMode,
    #[serde(default, deserialize_with = "de_ttl_secs")]
    ttl_secs: Option<u64>,
    #[serde(default, deserialize_with = "de_max_bindings")]
    max_bindings: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a policy class mapping with `name`")]
struct RawPolicyClass {
    #[serde(deserialize_with = "de_class_name")]
    name: String,
    #[serde(default, deserialize_with = "de_busy_threshold")]
    prefill_busy_threshold: Option<u64>,
    #[serde(default, deserialize_with = "de_busy_frac")]
    prefill_busy_threshold_frac: Option<f64>,
    #[serde(default, deserialize_with = "de_admission")]
    admission: Option<AdmissionMode>,
}

// ---------------------------------------------------------------------------------------------
// Field validators (run while parsing, so errors carry the value's exact location)
// ---------------------------------------------------------------------------------------------

/// Shortens a user-supplied string for an error message.
fn excerpt(s: &str) -> String {
    const MAX: usize = 80;
    if s.chars().count() <= MAX {
        s.to_owned()
    } else {
        let head: String = s.chars().take(MAX).collect();
        format!("{head}... ({} bytes)", s.len())
    }
}

/// Whether `s` is written like an integer (too large for the parser's integer types).
fn looks_like_integer(s: &str) -> bool {
    let digits = s.strip_prefix(['-', '+']).unwrap_or(s);
    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit() || b == b'_')
}

/// Whether `s` is a numeral too large for `f64` (`1e400`), as opposed to a spelled-out infinity.
fn overflows_to_infinity(s: &str) -> bool {
    s.parse::<f64>().is_ok_and(f64::is_infinite) && !s.to_ascii_lowercase().contains("inf")
}

/// Accepts an integer in `min..=max`; null means "absent".
struct UintVisitor {
    min: u64,
    max: u64,
}

impl UintVisitor {
    fn out_of_range<E: de::Error>(&self, value: impl fmt::Display) -> E {
        E::custom(format_args!(
            "invalid value: integer `{value}` is out of range, expected {self}"
        ))
    }
}

impl fmt::Display for UintVisitor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.max == u64::MAX {
            write!(f, "an integer >= {}", self.min)
        } else {
            write!(f, "an integer from {} to {}", self.min, self.max)
        }
    }
}

impl<'de> Visitor<'de> for UintVisitor {
    type Value = Option<u64>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        if v < self.min || v > self.max {
            Err(self.out_of_range(v))
        } else {
            Ok(Some(v))
        }
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        match u64::try_from(v) {
            Ok(v) => self.visit_u64(v),
            Err(_) => Err(self.out_of_range(v)),
        }
    }

    fn visit_u128<E: de::Error>(self, v: u128) -> Result<Self::Value, E> {
        match u64::try_from(v) {
            Ok(v) => self.visit_u64(v),
            Err(_) => Err(self.out_of_range(v)),
        }
    }

    fn visit_i128<E: de::Error>(self, v: i128) -> Result<Self::Value, E> {
        match u64::try_from(v) {
            Ok(v) => self.visit_u64(v),
            Err(_) => Err(self.out_of_range(v)),
        }
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        if looks_like_integer(v) && v.parse::<u128>().is_err() {
            Err(self.out_of_range(excerpt(v)))
        } else if overflows_to_infinity(v) {
            // The YAML parser hands over numerals that overflow `f64` (`1e400`) as strings.
            Err(E::custom(format_args!(
                "invalid type: floating point `{}` (overflows to infinity), expected {self}",
                excerpt(v)
            )))
        } else {
            Err(E::invalid_type(Unexpected::Str(&excerpt(v)), &self))
        }
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}

fn de_uint<'de, D: Deserializer<'de>>(d: D, min: u64, max: u64) -> Result<Option<u64>, D::Error> {
    d.deserialize_any(UintVisitor { min, max })
}

fn de_block_size<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    let value = de_uint(d, 1, u64::from(u32::MAX))?;
    value
        .map(|v| u32::try_from(v).map_err(|_| de::Error::custom("block_size out of range")))
        .transpose()
}

fn de_pick_budget<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 1, u64::MAX)
}

fn de_quarantine_after<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 1, u64::from(u32::MAX))
}

fn de_ttl_secs<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 1, MAX_SESSION_TTL_SECS)
}

fn de_max_bindings<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 1, u64::try_from(usize::MAX).unwrap_or(u64::MAX))
}

fn de_busy_threshold<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 0, u64::MAX)
}

/// Accepts a finite number `>= min` (or `> min` when `exclusive`); null means "absent".
struct FloatVisitor {
    min: f64,
    exclusive: bool,
}

impl FloatVisitor {
    fn check<E: de::Error>(&self, v: f64) -> Result<Option<f64>, E> {
        let in_range = if self.exclusive {
            v > self.min
        } else {
            v >= self.min
        };
        if v.is_finite() && in_range {
            Ok(Some(v))
        } else {
            Err(E::custom(format_args!(
                "invalid value: {}, expected {self}",
                yaml_float(v)
            )))
        }
    }
}

impl fmt::Display for FloatVisitor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let op = if self.exclusive { ">" } else { ">=" };
        write!(f, "a finite number {op} {}", self.min)
    }
}

impl<'de> Visitor<'de> for FloatVisitor {
    type Value = Option<f64>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        self.check(v)
    }

    // Integers are accepted as numbers; precision loss above 2^53 is irrelevant for weights.
    #[allow(clippy::cast_precision_loss)]
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        self.check(v as f64)
    }

    #[allow(clippy::cast_precision_loss)]
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        self.check(v as f64)
    }

    #[allow(clippy::cast_precision_loss)]
    fn visit_u128<E: de::Error>(self, v: u128) -> Result<Self::Value, E> {
        self.check(v as f64)
    }

    #[allow(clippy::cast_precision_loss)]
    fn visit_i128<E: de::Error>(self, v: i128) -> Result<Self::Value, E> {
        self.check(v as f64)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        // The YAML parser hands over numerals that overflow `f64` (`1e999`) as strings.
        if overflows_to_infinity(v) {
            Err(E::custom(format_args!(
                "invalid value: {} is too large (overflows to infinity), expected {self}",
                excerpt(v)
            )))
        } else {
            Err(E::invalid_type(Unexpected::Str(&excerpt(v)), &self))
        }
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}

fn de_weight<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    d.deserialize_any(FloatVisitor {
        min: 0.0,
        exclusive: false,
    })
}

fn de_busy_frac<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    d.deserialize_any(FloatVisitor {
        min: 0.0,
        exclusive: true,
    })
}

/// How a float is written in YAML (`.nan`, `.inf`, `-.inf`, or the number).
fn yaml_float(v: f64) -> String {
    if v.is_nan() {
        ".nan".to_owned()
    } else if v == f64::INFINITY {
        ".inf".to_owned()
    } else if v == f64::NEG_INFINITY {
        "-.inf".to_owned()
    } else {
        v.to_string()
    }
}

/// Accepts a unit variant of `T` written as a plain string; null means "absent" unless
/// `required`. Without it, `serde_yaml` reports a sequence or mapping given for an enum as
/// "expected a YAML tag starting with '!'", which names neither the accepted values nor the
/// mistake.
struct VariantVisitor<T> {
    expecting: &'static str,
    required: bool,
    variant: std::marker::PhantomData<T>,
}

impl<'de, T: Deserialize<'de>> Visitor<'de> for VariantVisitor<T> {
    type Value = Option<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.expecting)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        T::deserialize(de::value::StrDeserializer::<E>::new(v)).map(Some)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        if self.required {
            Err(E::invalid_type(Unexpected::Other("null"), &self))
        } else {
            Ok(None)
        }
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        self.visit_unit()
    }
}

fn de_variant<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
    expecting: &'static str,
    required: bool,
) -> Result<Option<T>, D::Error> {
    d.deserialize_any(VariantVisitor {
        expecting,
        required,
        variant: std::marker::PhantomData,
    })
}

fn de_on_error<'de, D: Deserializer<'de>>(d: D) -> Result<Option<OnError>, D::Error> {
    de_variant(d, "`fallback` or `fail`", false)
}

fn de_admission<'de, D: Deserializer<'de>>(d: D) -> Result<Option<AdmissionMode>, D::Error> {
    de_variant(d, "`any_eligible` or `chosen_row`", false)
}

fn de_affinity_mode<'de, D: Deserializer<'de>>(d: D) -> Result<AffinityMode, D::Error> {
    const EXPECTING: &str = "`soft` or `hard`";
    // `required` makes null an error inside the visitor, so the error carries the value's place.
    de_variant(d, EXPECTING, true)?
        .ok_or_else(|| de::Error::invalid_type(Unexpected::Other("null"), &EXPECTING))
}

/// What kind of string a [`StrVisitor`] accepts.
#[derive(Clone, Copy)]
enum StrRule {
    InstanceName,
    ClassName,
    TypeName,
    PluginPath,
    LibraryName,
    Sha256,
}

/// Accepts a string under a [`StrRule`]; null means "absent" for optional fields, and is rejected
/// by the derive for required ones.
struct StrVisitor(StrRule);

fn name_chars_ok(s: &str) -> bool {
    s.bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

fn check_name(what: &str, v: &str) -> Result<(), String> {
    if v.is_empty() {
        return Err(format!("invalid {what}: the name is empty"));
    }
    if v.len() > MAX_NAME_LEN {
        return Err(format!(
            "invalid {what} `{}`: longer than {MAX_NAME_LEN} characters",
            excerpt(v)
        ));
    }
    if !name_chars_ok(v) {
        return Err(format!(
            "invalid {what} `{}`: names may only contain letters, digits, `_`, `.` and `-`",
            excerpt(v)
        ));
    }
    Ok(())
}

impl StrRule {
    fn expecting(self) -> &'static str {
        match self {
            StrRule::InstanceName => {
                "an instance name (a string of letters, digits, `_`, `.`, `-`)"
            }
            StrRule::ClassName => {
                "a policy class name (a string of letters, digits, `_`, `.`, `-`)"
            }
            StrRule::TypeName => "a policy type name (a non-empty string)",
            StrRule::PluginPath => "a plugin file path (a non-empty string)",
            StrRule::LibraryName => "a library name such as `two_tier_cost_fn`",
            StrRule::Sha256 => "a SHA-256 digest (64 hexadecimal digits, as a string)",
        }
    }

    fn check(self, v: &str) -> Result<String, String> {
        match self {
            StrRule::InstanceName => {
                check_name("instance name", v)?;
                if v == DEFAULT_INSTANCE {
                    return Err(format!(
                        "instance name `{DEFAULT_INSTANCE}` is reserved for the built-in selector; \
                         choose another name"
                    ));
                }
                Ok(v.to_owned())
            }
            StrRule::ClassName => {
                check_name("policy class name", v)?;
                Ok(v.to_owned())
            }
            StrRule::TypeName => {
                if v.trim().is_empty() {
                    Err("invalid policy type name: the name is empty".to_owned())
                } else {
                    Ok(v.to_owned())
                }
            }
            StrRule::PluginPath => {
                if v.is_empty() {
                    Err("invalid plugin path: the path is empty".to_owned())
                } else if v.contains('\0') {
                    Err(format!(
                        "invalid plugin path `{}`: contains a NUL character",
                        excerpt(v)
                    ))
                } else {
                    Ok(v.to_owned())
                }
            }
            StrRule::LibraryName => {
                check_name("plugin library name", v)?;
                if v.ends_with(".so") {
                    return Err(format!(
                        "invalid plugin library name `{}`: give the name without `lib` and `.so` \
                         (for `libfoo.so` write `name: foo`), or use `path:` for a file",
                        excerpt(v)
                    ));
                }
                Ok(v.to_owned())
            }
            StrRule::Sha256 => {
                if v.len() == 64 && v.bytes().all(|b| b.is_ascii_hexdigit()) {
                    Ok(v.to_ascii_lowercase())
                } else {
                    Err(format!(
                        "invalid sha256 `{}`: expected 64 hexadecimal digits, found {} characters{}",
                        excerpt(v),
                        v.chars().count(),
                        if v.chars().all(|c| c.is_ascii_hexdigit()) {
                            ""
                        } else {
                            " including non-hexadecimal ones"
                        }
                    ))
                }
            }
        }
    }
}

impl<'de> Visitor<'de> for StrVisitor {
    type Value = Option<String>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hint = match self.0 {
            StrRule::InstanceName | StrRule::ClassName | StrRule::Sha256 => {
                " (quote values that look like numbers)"
            }
            _ => "",
        };
        write!(f, "{}{hint}", self.0.expecting())
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        self.0.check(v).map(Some).map_err(E::custom)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}

fn de_opt_str<'de, D: Deserializer<'de>>(d: D, rule: StrRule) -> Result<Option<String>, D::Error> {
    d.deserialize_any(StrVisitor(rule))
}

fn de_required_str<'de, D: Deserializer<'de>>(d: D, rule: StrRule) -> Result<String, D::Error> {
    de_opt_str(d, rule)?
        .ok_or_else(|| de::Error::invalid_type(Unexpected::Unit, &StrRule::expecting(rule)))
}

fn de_instance_name<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    de_required_str(d, StrRule::InstanceName)
}

fn de_class_name<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    de_required_str(d, StrRule::ClassName)
}

fn de_type_name<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    de_required_str(d, StrRule::TypeName)
}

fn de_plugin_path<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    de_opt_str(d, StrRule::PluginPath)
}

fn de_library_name<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    de_opt_str(d, StrRule::LibraryName)
}

fn de_sha256<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    de_opt_str(d, StrRule::Sha256)
}

// ---------------------------------------------------------------------------------------------
// Locating nodes in the text (for errors found after parsing, and for entry lines)
// ---------------------------------------------------------------------------------------------

/// One step of a key path.
#[derive(Debug, Clone)]
enum Seg {
    Key(String),
    Index(usize),
}

fn key(k: &str) -> Seg {
    Seg::Key(k.to_owned())
}

/// Renders `worker_selection.instances[0].name`.
fn render_path(path: &[Seg]) -> String {
    let mut out = String::new();
    for seg in path {
        match seg {
            Seg::Key(k) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(k);
            }
            Seg::Index(i) => {
                out.push('[');
                out.push_str(&i.to_string());
                out.push(']');
            }
        }
    }
    out
}

/// Marker message of a successful probe; never shown to users.
const PROBE_HIT: &str = "\u{0}config-probe-hit\u{0}";

/// Walks the document to the node at a path and fails there, so that the parser attaches that
/// node's line and column to the error. `serde_yaml` exposes positions only on errors.
struct Probe<'a>(&'a [Seg]);

impl Probe<'_> {
    fn leaf<E: de::Error>(&self) -> Result<(), E> {
        if self.0.is_empty() {
            Err(E::custom(PROBE_HIT))
        } else {
            Ok(())
        }
    }
}

impl<'de> DeserializeSeed<'de> for Probe<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Probe<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML value")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        self.leaf()
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        self.leaf()
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        self.leaf()
    }

    fn visit_i128<E: de::Error>(self, _: i128) -> Result<(), E> {
        self.leaf()
    }

    fn visit_u128<E: de::Error>(self, _: u128) -> Result<(), E> {
        self.leaf()
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        self.leaf()
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        self.leaf()
    }

    fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<(), E> {
        self.leaf()
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.leaf()
    }

    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        self.leaf()
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }

    fn visit_enum<A: de::EnumAccess<'de>>(self, data: A) -> Result<(), A::Error> {
        self.leaf()?;
        let (IgnoredAny, variant) = data.variant::<IgnoredAny>()?;
        variant.newtype_variant_seed(self)
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.leaf()?;
        if let Some((Seg::Index(target), rest)) = self.0.split_first() {
            let mut index = 0;
            loop {
                let more = if index == *target {
                    seq.next_element_seed(Probe(rest))?.is_some()
                } else {
                    seq.next_element::<IgnoredAny>()?.is_some()
                };
                if !more {
                    return Ok(());
                }
                index += 1;
            }
        }
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(())
    }

    fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        self.leaf()?;
        let (wanted, rest) = match self.0.split_first() {
            Some((Seg::Key(wanted), rest)) => (Some(wanted.as_str()), rest),
            _ => (None, &[][..]),
        };
        let mut found = false;
        while let Some(k) = map.next_key::<serde_yaml::Value>()? {
            if !found && wanted.is_some() && k.as_str() == wanted {
                found = true;
                map.next_value_seed(Probe(rest))?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

/// Line and column of the node at `path` in `text`, if the text has one.
fn locate(text: &str, path: &[Seg]) -> Option<(usize, usize)> {
    let deserializer = serde_yaml::Deserializer::from_str(text);
    match Probe(path).deserialize(deserializer) {
        Err(err) if err.to_string().contains(PROBE_HIT) => {
            err.location().map(|loc| (loc.line(), loc.column()))
        }
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------------
// Validation and assembly
// ---------------------------------------------------------------------------------------------

struct Builder<'t> {
    text: &'t str,
    source: Option<&'t Path>,
    /// Remaining bytes of re-parsing allowed for entry lines on the success path.
    budget: usize,
}

impl Builder<'_> {
    /// Line of an entry for the success path, within the re-parsing budget.
    fn entry_line(&mut self, path: &[Seg]) -> Option<usize> {
        let cost = self.text.len().max(1);
        if cost > self.budget {
            return None;
        }
        self.budget -= cost;
        locate(self.text, path).map(|(line, _)| line)
    }

    /// An error about the node at `path`, with its location.
    fn error(&self, path: &[Seg], kind: ConfigErrorKind) -> ConfigError {
        ConfigError::new(self.source, kind)
            .at(locate(self.text, path))
            .key(render_path(path))
    }

    fn build(mut self, raw: RawConfig) -> Result<RouterConfig, ConfigError> {
        let default_selector = raw
            .default_selector
            .map(|ds| DefaultSelectorConfig {
                prefill_load_scale: ds.prefill_load_scale.unwrap_or(DEFAULT_PREFILL_LOAD_SCALE),
                decode_active_request_weight: ds
                    .decode_active_request_weight
                    .unwrap_or(DEFAULT_DECODE_ACTIVE_REQUEST_WEIGHT),
            })
            .unwrap_or_default();
        let plugins = self.plugins(raw.plugins.unwrap_or_default())?;
        let worker_selection = self.worker_selection(raw.worker_selection)?;
        let session_affinity = raw.session_affinity.map(|sa| SessionAffinityConfig {
            mode: sa.mode,
            ttl: sa.ttl_secs.map_or(DEFAULT_SESSION_TTL, Duration::from_secs),
            max_bindings: sa
                .max_bindings
                .and_then(|n| usize::try_from(n).ok())
                .unwrap_or(DEFAULT_MAX_BINDINGS),
        });
        let policy_classes = self.policy_classes(raw.policy_classes.unwrap_or_default())?;
        let engine = self.engine(raw.engine)?;
        Ok(RouterConfig {
            source: self.source.map(Path::to_path_buf),
            block_size: raw.block_size.unwrap_or(DEFAULT_BLOCK_SIZE),
            host_cache_hit_weight: raw
                .host_cache_hit_weight
                .unwrap_or(DEFAULT_HOST_CACHE_HIT_WEIGHT),
            disk_cache_hit_weight: raw
                .disk_cache_hit_weight
                .unwrap_or(DEFAULT_DISK_CACHE_HIT_WEIGHT),
            default_selector,
            plugins,
            worker_selection,
            session_affinity,
            policy_classes,
            engine,
        })
    }

    /// Directory relative plugin paths resolve against.
    fn base_dir(&self) -> PathBuf {
        let dir = match self.source.and_then(Path::parent) {
            Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::path::absolute(&dir).unwrap_or(dir)
    }

    fn plugins(&mut self, raw: Vec<RawPlugin>) -> Result<Vec<PluginSpec>, ConfigError> {
        let base = if raw.is_empty() {
            PathBuf::new()
        } else {
            self.base_dir()
        };
        let mut plugins = Vec::with_capacity(raw.len());
        for (index, entry) in raw.into_iter().enumerate() {
            let path = [key("plugins"), Seg::Index(index)];
            let source = match (entry.path, entry.name) {
                (Some(path_value), Some(name)) => {
                    return Err(self.error(
                        &path,
                        ConfigErrorKind::PluginBothPathAndName {
                            path: path_value,
                            name,
                        },
                    ))
                }
                (None, None) => return Err(self.error(&path, ConfigErrorKind::PluginWithoutSource)),
                (Some(file), None) => {
                    let file = PathBuf::from(file);
                    PluginSource::Path(if file.is_absolute() {
                        file
                    } else {
                        base.join(file)
                    })
                }
                (None, Some(name)) => PluginSource::Name(name),
            };
            plugins.push(PluginSpec {
                source,
                sha256: entry.sha256,
                allow_insecure_permissions: entry.allow_insecure_permissions.unwrap_or(false),
                line: self.entry_line(&path),
            });
        }
        Ok(plugins)
    }

    fn worker_selection(
        &mut self,
        raw: Option<RawWorkerSelection>,
    ) -> Result<WorkerSelectionConfig, ConfigError> {
        let Some(raw) = raw else {
            return Ok(WorkerSelectionConfig::default());
        };
        let raw_instances = raw.instances.unwrap_or_default();

        let mut first_index: HashMap<&str, usize> = HashMap::new();
        for (index, instance) in raw_instances.iter().enumerate() {
            if let Some(&first) = first_index.get(instance.name.as_str()) {
                let first_line = locate(
                    self.text,
                    &[
                        key("worker_selection"),
                        key("instances"),
                        Seg::Index(first),
                        key("name"),
                    ],
                )
                .map(|(line, _)| line);
                return Err(self.error(
                    &[
                        key("worker_selection"),
                        key("instances"),
                        Seg::Index(index),
                        key("name"),
                    ],
                    ConfigErrorKind::DuplicateInstance {
                        name: instance.name.clone(),
                        first_line,
                    },
                ));
            }
            first_index.insert(&instance.name, index);
        }

        let role_target = |role: &str, value: Option<String>| {
            let name = value.unwrap_or_else(|| DEFAULT_INSTANCE.to_owned());
            if name == DEFAULT_INSTANCE || first_index.contains_key(name.as_str()) {
                Ok(name)
            } else {
                Err(self.error(
                    &[key("worker_selection"), key(role)],
                    ConfigErrorKind::UnknownInstance {
                        role: role.to_owned(),
                        instance: name,
                        defined: raw_instances.iter().map(|i| i.name.clone()).collect(),
                    },
                ))
            }
        };
        let aggregated = role_target("aggregated", raw.aggregated)?;
        let prefill = role_target("prefill", raw.prefill)?;
        let decode = role_target("decode", raw.decode)?;
        drop(first_index);

        let mut instances = Vec::with_capacity(raw_instances.len());
        for (index, instance) in raw_instances.into_iter().enumerate() {
            let path = [key("worker_selection"), key("instances"), Seg::Index(index)];
            let parameters_json = self.parameters(&path, &instance.name, instance.parameters)?;
            instances.push(InstanceConfig {
                line: self.entry_line(&path),
                name: instance.name,
                type_name: instance.type_name,
                parameters_json,
                on_error: instance.on_error.unwrap_or_default(),
                pick_budget: instance
                    .pick_budget_us
                    .map_or(DEFAULT_PICK_BUDGET, Duration::from_micros),
                quarantine_after: instance
                    .quarantine_after
                    .and_then(|n| u32::try_from(n).ok())
                    .unwrap_or(DEFAULT_QUARANTINE_AFTER),
            });
        }
        Ok(WorkerSelectionConfig {
            aggregated,
            prefill,
            decode,
            instances,
        })
    }

    /// Converts an instance's `parameters` to compact JSON object text.
    fn parameters(
        &self,
        instance_path: &[Seg],
        instance: &str,
        value: Option<serde_yaml::Value>,
    ) -> Result<String, ConfigError> {
        let mut path = instance_path.to_vec();
        path.push(key("parameters"));
        let value = match value {
            None | Some(serde_yaml::Value::Null) => return Ok("{}".to_owned()),
            Some(value @ serde_yaml::Value::Mapping(_)) => value,
            Some(other) => {
                return Err(self.error(
                    &path,
                    ConfigErrorKind::ParametersNotMapping {
                        instance: instance.to_owned(),
                        found: describe(&other),
                    },
                ))
            }
        };
        let inner_start = path.len();
        let json = to_json(&value, &mut path).map_err(|problem| {
            let key_path = render_path(&path[inner_start..]);
            self.error(
                &path,
                ConfigErrorKind::InvalidParameter {
                    instance: instance.to_owned(),
                    key_path,
                    problem,
                },
            )
        })?;
        Ok(json.to_string())
    }

    fn engine(
        &self,
        value: Option<serde_yaml::Value>,
    ) -> Result<Option<serde_json::Value>, ConfigError> {
        let mut path = vec![key("engine")];
        match value {
            None | Some(serde_yaml::Value::Null) => Ok(None),
            Some(value @ serde_yaml::Value::Mapping(_)) => {
                to_json(&value, &mut path).map(Some).map_err(|problem| {
                    let key_path = render_path(&path[1..]);
                    self.error(
                        &path,
                        ConfigErrorKind::InvalidEngineValue { key_path, problem },
                    )
                })
            }
            Some(other) => Err(self.error(
                &path,
                ConfigErrorKind::EngineNotMapping {
                    found: describe(&other),
                },
            )),
        }
    }

    fn policy_classes(
        &self,
        raw: Vec<RawPolicyClass>,
    ) -> Result<Vec<PolicyClassConfig>, ConfigError> {
        let mut first_index: HashMap<&str, usize> = HashMap::new();
        for (index, class) in raw.iter().enumerate() {
            if let Some(&first) = first_index.get(class.name.as_str()) {
                let first_line = locate(
                    self.text,
                    &[key("policy_classes"), Seg::Index(first), key("name")],
                )
                .map(|(line, _)| line);
                return Err(self.error(
                    &[key("policy_classes"), Seg::Index(index), key("name")],
                    ConfigErrorKind::DuplicatePolicyClass {
                        name: class.name.clone(),
                        first_line,
                    },
                ));
            }
            first_index.insert(&class.name, index);
            if class.prefill_busy_threshold.is_none() && class.prefill_busy_threshold_frac.is_none()
            {
                return Err(self.error(
                    &[key("policy_classes"), Seg::Index(index)],
                    ConfigErrorKind::PolicyClassWithoutThreshold {
                        name: class.name.clone(),
                    },
                ));
            }
        }
        Ok(raw
            .into_iter()
            .map(|class| PolicyClassConfig {
                name: class.name,
                prefill_busy_threshold: class.prefill_busy_threshold,
                prefill_busy_threshold_frac: class.prefill_busy_threshold_frac,
                admission: class.admission.unwrap_or_default(),
            })
            .collect())
    }
}

/// A short description of a YAML value's kind, for messages.
fn describe(value: &serde_yaml::Value) -> &'static str {
    match value {
        serde_yaml::Value::Null => "null",
        serde_yaml::Value::Bool(_) => "a boolean",
        serde_yaml::Value::Number(_) => "a number",
        serde_yaml::Value::String(_) => "a string",
        serde_yaml::Value::Sequence(_) => "a sequence",
        serde_yaml::Value::Mapping(_) => "a mapping",
        serde_yaml::Value::Tagged(_) => "a tagged value",
    }
}

/// How a non-string mapping key reads in a message.
fn describe_key(value: &serde_yaml::Value) -> String {
    match value {
        serde_yaml::Value::Null => "`null`".to_owned(),
        serde_yaml::Value::Bool(b) => format!("`{b}` (a boolean)"),
        serde_yaml::Value::Number(n) => format!("`{n}` (a number)"),
        other => describe(other).to_owned(),
    }
}

/// Converts YAML to JSON, failing on what JSON cannot carry. On error, `path` is left pointing at
/// the offending node (the containing mapping for a bad key).
fn to_json(
    value: &serde_yaml::Value,
    path: &mut Vec<Seg>,
) -> Result<serde_json::Value, ValueProblem> {
    use serde_yaml::Value as Y;
    Ok(match value {
        Y::Null => serde_json::Value::Null,
        Y::Bool(b) => serde_json::Value::Bool(*b),
        Y::Number(n) => {
            if let Some(u) = n.as_u64() {
                serde_json::Value::from(u)
            } else if let Some(i) = n.as_i64() {
                serde_json::Value::from(i)
            } else {
                let f = n.as_f64().unwrap_or(f64::NAN);
                match serde_json::Number::from_f64(f) {
                    Some(number) => serde_json::Value::Number(number),
                    None => return Err(ValueProblem::NotFinite(yaml_float(f))),
                }
            }
        }
        Y::String(s) => serde_json::Value::String(s.clone()),
        Y::Sequence(items) => {
            let mut out = Vec::with_capacity(items.len());
            for (index, item) in items.iter().enumerate() {
                path.push(Seg::Index(index));
                out.push(to_json(item, path)?);
                path.pop();
            }
            serde_json::Value::Array(out)
        }
        Y::Mapping(mapping) => {
            let mut out = serde_json::Map::new();
            for (k, v) in mapping {
                let Some(k) = k.as_str() else {
                    return Err(ValueProblem::NonStringKey(describe_key(k)));
                };
                path.push(Seg::Key(k.to_owned()));
                out.insert(k.to_owned(), to_json(v, path)?);
                path.pop();
            }
            serde_json::Value::Object(out)
        }
        Y::Tagged(tagged) => return Err(ValueProblem::Tagged(tagged.tag.to_string())),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> RouterConfig {
        match RouterConfig::from_yaml_str(text, None) {
            Ok(config) => config,
            Err(err) => panic!("unexpected error: {err}"),
        }
    }

    fn parse_err(text: &str) -> String {
        match RouterConfig::from_yaml_str(text, None) {
            Ok(config) => panic!("expected an error, got {config:?}"),
            Err(err) => err.to_string(),
        }
    }

    #[test]
    fn empty_text_is_all_defaults() {
        for text in [
            "",
            "\n\n",
            "# only a comment\n# and another\n",
            "---\n",
            "~\n",
            "null",
        ] {
            assert_eq!(parse(text), RouterConfig::default(), "text {text:?}");
        }
    }

    #[test]
    fn defaults_match_the_design() {
        let config = RouterConfig::default();
        assert_eq!(config.block_size, 16);
        assert_eq!(config.host_cache_hit_weight, 0.75);
        assert_eq!(config.disk_cache_hit_weight, 0.25);
        assert_eq!(config.default_selector.prefill_load_scale, 1.0);
        assert_eq!(config.default_selector.decode_active_request_weight, 0.0);
        assert!(config.plugins.is_empty());
        assert!(config.session_affinity.is_none());
        assert!(config.policy_classes.is_empty());
        assert!(config.engine.is_none());
        for role in [
            Role::Aggregated,
            Role::Prefill,
            Role::Decode,
            Role::Other(9),
        ] {
            assert_eq!(config.worker_selection.instance_for(role), DEFAULT_INSTANCE);
        }
    }

    #[test]
    fn null_values_take_defaults() {
        let config = parse(
            "block_size:\nhost_cache_hit_weight: ~\ndefault_selector:\nplugins:\n\
             worker_selection:\npolicy_classes:\nengine:\nsession_affinity:\n",
        );
        assert_eq!(config, RouterConfig::default());
    }

    const FULL: &str = r#"# router settings
block_size: 32
host_cache_hit_weight: 0.5
disk_cache_hit_weight: 0
default_selector:
  prefill_load_scale: 2
  decode_active_request_weight: 0.125
plugins:
  - path: ./lib/libfoo.so
  - name: two_tier_cost_fn
    sha256: "ABCDEF0123456789abcdef0123456789ABCDEF0123456789abcdef0123456789"
    allow_insecure_permissions: true
  - path: /opt/plugins/libbar.so
worker_selection:
  aggregated: two-tier
  prefill: default
  decode: repin.v2
  instances:
    - name: two-tier
      type: dynamo-two-tier-cost-fn
      parameters: {cache_threshold: 0.5, tiers: [1, -2, "x"], nested: {ok: true, none: ~}}
      on_error: fail
      pick_budget_us: 250
    - name: repin.v2
      type: soft-pin-repin
session_affinity:
  mode: hard
  ttl_secs: 30
  max_bindings: 10
policy_classes:
  - name: interactive
    prefill_busy_threshold: 8192
    admission: chosen_row
  - name: batch
    prefill_busy_threshold_frac: 1.5
  - name: default
    prefill_busy_threshold: 0
    prefill_busy_threshold_frac: 0.5
engine:
  workers: [{id: 1}]
  speed: 1.5
"#;

    #[test]
    fn full_config_parses() {
        let config = match RouterConfig::from_yaml_str(FULL, Some(Path::new("/etc/router/r.yaml")))
        {
            Ok(config) => config,
            Err(err) => panic!("{err}"),
        };
        assert_eq!(
            config.source.as_deref(),
            Some(Path::new("/etc/router/r.yaml"))
        );
        assert_eq!(config.block_size, 32);
        assert_eq!(config.host_cache_hit_weight, 0.5);
        assert_eq!(config.disk_cache_hit_weight, 0.0);
        assert_eq!(
            config.default_selector,
            DefaultSelectorConfig {
                prefill_load_scale: 2.0,
                decode_active_request_weight: 0.125
            }
        );

        assert_eq!(
            config.plugins,
            vec![
                PluginSpec {
                    source: PluginSource::Path(PathBuf::from("/etc/router/./lib/libfoo.so")),
                    sha256: None,
                    allow_insecure_permissions: false,
                    line: Some(9),
                },
                PluginSpec {
                    source: PluginSource::Name("two_tier_cost_fn".to_owned()),
                    sha256: Some(
                        "abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789"
                            .to_owned()
                    ),
                    allow_insecure_permissions: true,
                    line: Some(10),
                },
                PluginSpec {
                    source: PluginSource::Path(PathBuf::from("/opt/plugins/libbar.so")),
                    sha256: None,
                    allow_insecure_permissions: false,
                    line: Some(13),
                },
            ]
        );

        let ws = &config.worker_selection;
        assert_eq!(ws.instance_for(Role::Aggregated), "two-tier");
        assert_eq!(ws.instance_for(Role::Prefill), "default");
        assert_eq!(ws.instance_for(Role::Decode), "repin.v2");
        assert_eq!(ws.instances.len(), 2);
        let two_tier = &ws.instances[0];
        assert_eq!(two_tier.name, "two-tier");
        assert_eq!(two_tier.type_name, "dynamo-two-tier-cost-fn");
        assert_eq!(
            two_tier.parameters_json,
            // Keys keep their YAML order.
            r#"{"cache_threshold":0.5,"tiers":[1,-2,"x"],"nested":{"ok":true,"none":null}}"#
        );
        assert_eq!(two_tier.on_error, OnError::Fail);
        assert_eq!(two_tier.pick_budget, Duration::from_micros(250));
        assert_eq!(two_tier.line, Some(19));
        let repin = match ws.instance("repin.v2") {
            Some(instance) => instance,
            None => panic!("repin.v2 missing"),
        };
        assert_eq!(repin.parameters_json, "{}");
        assert_eq!(repin.on_error, OnError::Fallback);
        assert_eq!(repin.pick_budget, DEFAULT_PICK_BUDGET);
        assert_eq!(repin.line, Some(24));
        assert!(ws.instance("default").is_none());

        assert_eq!(
            config.session_affinity,
            Some(SessionAffinityConfig {
                mode: AffinityMode::Hard,
                ttl: Duration::from_secs(30),
                max_bindings: 10,
            })
        );
        assert_eq!(
            config.policy_classes,
            vec![
                PolicyClassConfig {
                    name: "interactive".to_owned(),
                    prefill_busy_threshold: Some(8192),
                    prefill_busy_threshold_frac: None,
                    admission: AdmissionMode::ChosenRow,
                },
                PolicyClassConfig {
                    name: "batch".to_owned(),
                    prefill_busy_threshold: None,
                    prefill_busy_threshold_frac: Some(1.5),
                    admission: AdmissionMode::AnyEligible,
                },
                PolicyClassConfig {
                    name: "default".to_owned(),
                    prefill_busy_threshold: Some(0),
                    prefill_busy_threshold_frac: Some(0.5),
                    admission: AdmissionMode::AnyEligible,
                },
            ]
        );
        assert_eq!(
            config.policy_class("batch").map(|c| c.admission),
            Some(AdmissionMode::AnyEligible)
        );
        assert_eq!(
            config.engine,
            Some(serde_json::json!({"workers": [{"id": 1}], "speed": 1.5}))
        );
    }

    #[test]
    fn session_affinity_defaults() {
        let config = parse("session_affinity: {mode: soft}");
        assert_eq!(
            config.session_affinity,
            Some(SessionAffinityConfig {
                mode: AffinityMode::Soft,
                ttl: DEFAULT_SESSION_TTL,
                max_bindings: DEFAULT_MAX_BINDINGS,
            })
        );
    }

    #[test]
    fn worker_selection_without_roles_uses_default_everywhere() {
        let config =
            parse("worker_selection:\n  instances:\n    - {name: a, type: t, parameters: null}\n");
        let ws = &config.worker_selection;
        assert_eq!(ws.aggregated, "default");
        assert_eq!(ws.prefill, "default");
        assert_eq!(ws.decode, "default");
        assert_eq!(ws.instances[0].parameters_json, "{}");
        assert_eq!(ws.instances[0].line, Some(3));
    }

    #[test]
    fn explicit_default_role_is_accepted() {
        let config = parse("worker_selection: {aggregated: default, decode: ~}");
        assert_eq!(config.worker_selection, WorkerSelectionConfig::default());
    }

    #[test]
    fn relative_plugin_paths_resolve_against_the_yaml_directory() {
        let config = match RouterConfig::from_yaml_str(
            "plugins: [{path: libx.so}, {path: ../y/liby.so}]",
            Some(Path::new("/srv/conf/router.yaml")),
        ) {
            Ok(config) => config,
            Err(err) => panic!("{err}"),
        };
        assert_eq!(
            config.plugins[0].source,
            PluginSource::Path(PathBuf::from("/srv/conf/libx.so"))
        );
        assert_eq!(
            config.plugins[1].source,
            PluginSource::Path(PathBuf::from("/srv/conf/../y/liby.so"))
        );
        // Flow style still finds the entry's line.
        assert_eq!(config.plugins[1].line, Some(1));
    }

    #[test]
    fn relative_plugin_paths_without_source_resolve_against_the_current_directory() {
        let cwd = match std::env::current_dir() {
            Ok(cwd) => cwd,
            Err(err) => panic!("{err}"),
        };
        let config = parse("plugins:\n  - path: lib/libx.so\n");
        assert_eq!(
            config.plugins[0].source,
            PluginSource::Path(cwd.join("lib/libx.so"))
        );
        // A source file given by a bare relative name also means the current directory.
        let config = match RouterConfig::from_yaml_str(
            "plugins:\n  - path: libx.so\n",
            Some(Path::new("router.yaml")),
        ) {
            Ok(config) => config,
            Err(err) => panic!("{err}"),
        };
        assert_eq!(
            config.plugins[0].source,
            PluginSource::Path(cwd.join("libx.so"))
        );
    }

    #[test]
    fn parameters_json_handles_anchors_and_big_and_negative_numbers() {
        let config = parse(
            "worker_selection:\n  instances:\n\
             \x20   - {name: a, type: t, parameters: &p {x: 18446744073709551615, y: -3, z: 1e3}}\n\
             \x20   - {name: b, type: t, parameters: *p}\n",
        );
        let ws = &config.worker_selection;
        assert_eq!(
            ws.instances[0].parameters_json,
            r#"{"x":18446744073709551615,"y":-3,"z":1000.0}"#
        );
        assert_eq!(
            ws.instances[1].parameters_json,
            ws.instances[0].parameters_json
        );
    }

    #[test]
    fn crlf_and_bom_are_accepted() {
        let config = parse("\u{feff}block_size: 8\r\nworker_selection:\r\n  instances:\r\n    - name: a\r\n      type: t\r\n");
        assert_eq!(config.block_size, 8);
        assert_eq!(config.worker_selection.instances[0].line, Some(4));
    }

    #[test]
    fn sha256_is_stored_lowercase() {
        let upper = "F".repeat(64);
        let config = parse(&format!("plugins: [{{name: foo, sha256: {upper}}}]"));
        assert_eq!(config.plugins[0].sha256, Some("f".repeat(64)));
    }

    #[test]
    fn error_display_names_string_source_line_and_key() {
        let message = parse_err("block_size: 16\nworker_selection:\n  decode: nope\n");
        assert!(
            message.starts_with("config <string>: line 3 column 11: worker_selection.decode: "),
            "{message}"
        );
        assert!(message.contains("`nope`"), "{message}");
    }

    #[test]
    fn error_accessors() {
        let err = match RouterConfig::from_yaml_str("block_size: 0\n", Some(Path::new("a.yaml"))) {
            Ok(config) => panic!("expected an error, got {config:?}"),
            Err(err) => err,
        };
        assert_eq!(err.file(), Some(Path::new("a.yaml")));
        assert_eq!(err.line(), Some(1));
        assert_eq!(err.column(), Some(13));
        assert_eq!(err.key_path(), Some("block_size"));
        assert!(matches!(err.kind(), ConfigErrorKind::Yaml { .. }));
    }

    #[test]
    fn hostile_inputs_are_errors_not_panics() {
        let deep = format!("engine: {}{}", "[".repeat(1_000), "]".repeat(1_000));
        let laughs = "engine:\n\
                      \x20 a: &a [x, x, x, x, x, x, x, x, x, x]\n\
                      \x20 b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n\
                      \x20 c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\n\
                      \x20 d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n\
                      \x20 e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\n\
                      \x20 f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n\
                      \x20 g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f, *f]\n\
                      \x20 h: [*g, *g, *g, *g, *g, *g, *g, *g, *g, *g, .nan]\n";
        for text in [
            "block_size: 99999999999999999999",
            "block_size: 999999999999999999999999999999999999999999999999",
            "block_size: -1",
            "block_size: 1.5",
            "block_size: \"16\"",
            "block_size: [16]",
            "host_cache_hit_weight: .nan",
            "host_cache_hit_weight: -.inf",
            "host_cache_hit_weight: 1e999",
            "block_size: 1\nblock_size: 2",
            "worker_selection: {instances: [{name: a, type: t, parameters: {k: 1, k: 2}}]}",
            "worker_selection: {instances: [~]}",
            "plugins: [{path: \"a\\0b\"}]",
            "worker_selection: {instances: [{name: a, type: t, parameters: {k: .nan}}]}",
            "worker_selection: {instances: [{name: a, type: t, parameters: {1: x}}]}",
            "worker_selection: {instances: [{name: a, type: t, parameters: !foo {k: 1}}]}",
            "worker_selection:\n  instances:\n    - name: \"two",
            "plugins: [",
            "{",
            "- a\n- b",
            "--- 1\n--- 2\n",
            "a: *missing",
            deep.as_str(),
            laughs,
        ] {
            let message = parse_err(text);
            assert!(message.starts_with("config <string>: "), "{message}");
            assert!(!message.contains(PROBE_HIT), "{message}");
        }
    }

    #[test]
    fn enum_values_of_the_wrong_shape_name_the_accepted_values() {
        // Found by the hostile-input tests (issue 6): a sequence or mapping given for an enum
        // used to read "expected a YAML tag starting with '!'".
        for (text, expected) in [
            (
                "session_affinity: {mode: [soft]}",
                "line 1 column 26: session_affinity.mode: invalid type: sequence, expected `soft` or `hard`",
            ),
            (
                "session_affinity: {mode: ~}",
                "line 1 column 26: session_affinity.mode: invalid type: null, expected `soft` or `hard`",
            ),
            (
                "session_affinity: {mode: sticky}",
                "session_affinity.mode: unknown variant `sticky`, expected `soft` or `hard`",
            ),
            (
                "worker_selection: {instances: [{name: a, type: t, on_error: {fail: 1}}]}",
                "worker_selection.instances[0].on_error: invalid type: map, expected `fallback` or `fail`",
            ),
            (
                "policy_classes: [{name: a, prefill_busy_threshold: 1, admission: [chosen_row]}]",
                "policy_classes[0].admission: invalid type: sequence, expected `any_eligible` or `chosen_row`",
            ),
        ] {
            let message = parse_err(text);
            assert!(message.contains(expected), "{text}: {message}");
        }
        // Null still means "absent" for the optional ones.
        let config = parse(
            "worker_selection: {instances: [{name: a, type: t, on_error: ~}]}\n\
             policy_classes: [{name: c, prefill_busy_threshold: 1, admission: ~}]\n",
        );
        assert_eq!(
            config.worker_selection.instances[0].on_error,
            OnError::Fallback
        );
        assert_eq!(
            config.policy_classes[0].admission,
            AdmissionMode::AnyEligible
        );
    }

    #[test]
    fn integers_written_as_overflowing_floats_say_so() {
        // Found by the hostile-input tests (issue 6): `1e400` used to read as `string "1e400"`.
        let message =
            parse_err("worker_selection: {instances: [{name: a, type: t, pick_budget_us: 1e400}]}");
        assert!(
            message.contains(
                "pick_budget_us: invalid type: floating point `1e400` (overflows to infinity), \
                 expected an integer >= 1"
            ),
            "{message}"
        );
        let message = parse_err("block_size: 1e30");
        assert!(
            message.contains("block_size: invalid type: floating point"),
            "{message}"
        );
        // A spelled-out infinity is still just a wrong type.
        let message = parse_err("block_size: inf");
        assert!(
            message.contains("invalid type: string \"inf\""),
            "{message}"
        );
    }

    #[test]
    fn deep_flow_nesting_is_refused_before_the_yaml_scanner_runs() {
        // Found by the hostile-input tests (issue 6): the scanner's time grows with tokens times
        // flow depth, so 100,000 nested `[` took minutes before the recursion limit refused them.
        let deep = format!(
            "engine:\n  x: {}{}\n",
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        let started = std::time::Instant::now();
        let message = parse_err(&deep);
        assert_eq!(
            message,
            "config <string>: line 2 column 134: recursion limit exceeded: `[` and `{` nested \
             more than 128 levels deep"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        // 128 levels are left to the parser (which refuses them: its limit counts the
        // enclosing block mappings too); brackets in comments and quoted scalars do not count.
        let at_limit = format!("engine: {}{}\n", "[".repeat(128), "]".repeat(128));
        assert!(parse_err(&at_limit).contains("line 1 column"));
        let open = "[".repeat(300);
        let config = parse(&format!(
            "# {open}\nengine: {{a: \"{open}\", b: '{open}''{open}', c: \"\\\"{open}\"}} # {open}\n"
        ));
        assert_eq!(
            config
                .engine
                .as_ref()
                .and_then(|e| e["a"].as_str())
                .map(str::len),
            Some(300)
        );
        assert_eq!(flow_too_deep("a: \"x\\\n[\"\nb: 1"), None);
        assert_eq!(
            flow_too_deep(&format!("a: 1\nb: \"q\\\n\"\nc: {}", "{".repeat(129))),
            Some((4, 132))
        );
    }
}
