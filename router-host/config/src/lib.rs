//! # router-config
//!
//! What an operator hands the router: the YAML configuration, parsed into typed, validated
//! settings, and the reading of the files a config or a command names ([`input`]: regular files
//! only, bounded).
//!
//! This is the only crate of the workspace that depends on `serde_yaml`. Everything it returns is
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
//!
//! Layout: this file holds the top-level settings, the entry points and the assembly of the
//! sections. Each section has its own file: `plugins.rs`, `instances.rs` (`worker_selection`),
//! `sessions.rs` (`session_affinity`), `admission.rs` (`policy_classes`), `workers.rs` and
//! `serve.rs` (the engines and settings of `router-host serve`) and `json.rs` (values carried as
//! JSON: instance `parameters` and `engine`). The scalar validators are in
//! `numbers.rs` and `strings.rs`, the limits checked before parsing in `limits.rs`, the error
//! types and messages in `error.rs`, and the re-reading of the text for locations in
//! `locate.rs`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

#[macro_use]
mod macros;

mod admission;
mod epp;
mod error;
pub mod input;
mod instances;
mod json;
mod limits;
mod locate;
mod numbers;
mod plugins;
mod selector;
mod serve;
mod sessions;
mod strings;
#[cfg(test)]
mod tests;
mod workers;

pub use admission::PolicyClassConfig;
pub use epp::EppConfig;
pub use error::{ConfigError, ConfigErrorKind, ValueProblem};
pub use instances::{InstanceConfig, OnError, WorkerSelectionConfig};
pub use limits::de_dp_size;
pub use limits::{MAX_BLOCK_DEPTH, MAX_CONFIG_BYTES, MAX_DP_SIZE, MAX_FLOW_DEPTH, MAX_ROWS};
pub use plugins::{PluginSource, PluginSpec};
pub use serve::{
    HealthConfig, ServeConfig, ServeTimeouts, TokenizerConfig, DEFAULT_MAX_BODY_BYTES,
    DEFAULT_SESSION_BODY_FIELDS, DEFAULT_SESSION_HEADERS,
};
// The modes are the core's own types; `strings.rs` reads their spellings.
pub use router_core::admission::AdmissionMode;
pub use router_core::sessions::BindingMode as AffinityMode;
// One default for the number of session bindings: the session table's own.
pub use router_core::sessions::DEFAULT_MAX_BINDINGS;
pub use sessions::{
    check_redis_url, redact_url, OnStoreUnavailable, RedisStoreConfig, SessionAffinityConfig,
    SessionStoreConfig, DEFAULT_LOAD_PUBLISH,
};
pub use workers::{
    FileVersion, KvEventsConfig, WorkerConfig, WorkersFile, DEFAULT_MAX_LAG_MS,
    DEFAULT_STALE_CLEAR_MS, DEFAULT_WARM_START_MS,
};
// `booking.prefill` and `booking.decode` are the core's own modes.
pub use router_core::ledger::DecodeBooking;
pub use router_core::select::PrefillBooking;
pub use selector::{Room, TieBreak};

use admission::RawPolicyClass;
use epp::RawEpp;
use error::{line_column, yaml_error};
use instances::RawWorkerSelection;
use limits::{nesting_too_deep, read_capped, TooDeep};
use locate::{key, locate, render_path, Seg};
use numbers::{de_block_size, de_images_max, de_weight};
use plugins::RawPlugin;
use serve::RawServe;
use sessions::RawSessionAffinity;
use strings::{de_decode_booking, de_prefill_booking, de_room, de_tie_break};
use workers::RawWorker;

/// The instance name reserved for the built-in selector (docs/configuration.md, `default`).
pub const DEFAULT_INSTANCE: &str = "default";
/// The default of `plugin_images_max`.
pub const DEFAULT_PLUGIN_IMAGES_MAX: usize = 64;
/// Default tokens per KV block.
pub const DEFAULT_BLOCK_SIZE: u32 = 16;
/// Default weight of a host-tier (CPU offload) cache hit in the built-in selector.
pub const DEFAULT_HOST_CACHE_HIT_WEIGHT: f64 = 0.75;
/// Default weight of a disk-tier cache hit in the built-in selector.
pub const DEFAULT_DISK_CACHE_HIT_WEIGHT: f64 = 0.25;
// The `default_selector` and `booking.prefill` defaults are the settings measured best on the
// replays of docs/replay.md ("Side by side with Dynamo"); Dynamo's weights (1.0, 0.0, 1.0,
// lowest_row, prompt) are one explicit config away (docs/configuration.md).
/// Default `default_selector.prefill_load_scale`.
pub const DEFAULT_PREFILL_LOAD_SCALE: f64 = 20.0;
/// Default `default_selector.decode_active_request_weight`.
pub const DEFAULT_DECODE_ACTIVE_REQUEST_WEIGHT: f64 = 0.0;
/// Default `default_selector.overlap_credit`.
pub const DEFAULT_OVERLAP_CREDIT: f64 = 1.5;
/// Default `default_selector.tie_break`.
pub const DEFAULT_TIE_BREAK: TieBreak = TieBreak::Spread;
/// Default `default_selector.live_eviction_weight`: the built-in `default`'s cache gate, measured
/// best on the tight-KV family of docs/replay.md (0 turns it off).
pub const DEFAULT_LIVE_EVICTION_WEIGHT: f64 = 0.25;
/// Default `default_selector.room`.
pub const DEFAULT_ROOM: Room = Room::Free;
/// Default `kv_recent_window_ms`: off (`None`). Nothing shipped reads the
/// `kv_recent_device_blocks` column to advantage at its defaults (the built-in default's cache
/// gate measured the same without it), and keeping it costs a lock per row per decision.
pub const DEFAULT_KV_RECENT_WINDOW: Option<Duration> = None;
/// Largest accepted `kv_recent_window_ms` (one day).
pub const MAX_KV_RECENT_WINDOW_MS: u64 = 24 * 3600 * 1000;
/// Default `booking.prefill`: only the prompt tokens the row has to compute.
pub const DEFAULT_PREFILL_BOOKING: PrefillBooking = PrefillBooking::Uncached;
/// Default `booking.decode`: every request's whole prompt.
pub const DEFAULT_DECODE_BOOKING: DecodeBooking = DecodeBooking::Prompt;
/// Default per-pick time budget of a policy instance (`pick_budget_us: 1000`).
pub const DEFAULT_PICK_BUDGET: Duration = Duration::from_micros(1000);
/// Default number of consecutive over-budget picks after which an instance is quarantined.
pub const DEFAULT_QUARANTINE_AFTER: u32 = 3;
/// The default `hang_after_ms` is this many pick budgets...
pub const HANG_AFTER_BUDGETS: u32 = 100;
/// ...but never less than this.
pub const MIN_DEFAULT_HANG_AFTER: Duration = Duration::from_secs(1);

/// The default `hang_after_ms` of an instance with this pick budget: `max(100 x budget, 1 s)`,
/// 1 s for the default budget (docs/configuration.md explains the choice).
pub fn default_hang_after(pick_budget: Duration) -> Duration {
    pick_budget
        .saturating_mul(HANG_AFTER_BUDGETS)
        .max(MIN_DEFAULT_HANG_AFTER)
}
/// Default idle timeout of a session binding (`ttl_secs: 600`).
pub const DEFAULT_SESSION_TTL: Duration = Duration::from_secs(600);
/// Largest accepted `session_affinity.ttl_secs` (ten years), so that `now + ttl` cannot overflow
/// a clock.
pub const MAX_SESSION_TTL_SECS: u64 = 10 * 365 * 24 * 3600;
/// Maximum length of an instance or policy class name, in bytes.
pub const MAX_NAME_LEN: usize = 128;

/// Re-parsing budget (bytes of YAML) for finding the line of every plugin and instance entry on
/// the success path. Large generated files simply get `line: None`.
const LINE_LOOKUP_BUDGET: usize = 1024 * 1024;

// ---------------------------------------------------------------------------------------------
// Top-level configuration types (each section's types are in its own file)
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
    /// What a dispatched request books (docs/routing-contract.md §7).
    pub booking: BookingConfig,
    /// Plugins to load, in file order.
    pub plugins: Vec<PluginSpec>,
    /// The most plugin images the process may have mapped: a (re)load that would map one more
    /// (a changed or replaced plugin file) fails; images are never unmapped.
    pub plugin_images_max: usize,
    /// Which policy instance serves which role, and the instances.
    pub worker_selection: WorkerSelectionConfig,
    /// Session affinity; `None` = off.
    pub session_affinity: Option<SessionAffinityConfig>,
    /// Where session bindings live (`session_affinity.store`; memory when absent).
    pub session_store: SessionStoreConfig,
    /// Queue admission classes (docs/routing-contract.md §8), in file order.
    pub policy_classes: Vec<PolicyClassConfig>,
    /// How many requests the admission queues hold together (`max_queued_requests`); `None` =
    /// the core's default (`router_core::admission::DEFAULT_MAX_QUEUED`).
    pub max_queued_requests: Option<usize>,
    /// The window of the `kv_recent_device_blocks` column (`kv_recent_window_ms`); `None` (0)
    /// = not tracked, and the column is not sent.
    pub kv_recent_window: Option<Duration>,
    /// Opaque settings for the replay simulator (a JSON object), not validated here.
    pub engine: Option<serde_json::Value>,
    /// The engines `router-host serve` routes to, in file order (ids unique); empty when the
    /// file has no `workers:` (fine for `select` and `replay`, refused by `serve`).
    pub workers: Vec<WorkerConfig>,
    /// The file `workers` were read from (`workers_file:`, resolved against the config file's
    /// directory) and the version read; `None` when they are the config's own `workers:`.
    /// Watched by `serve` and `epp`, which reload when it changes.
    pub workers_file: Option<WorkersFile>,
    /// `serve:` settings; `None` when the file has no `serve:` (then `serve` uses the defaults).
    pub serve: Option<ServeConfig>,
    /// `epp:` settings; `None` when the file has no `epp:` (then `epp` uses the defaults).
    pub epp: Option<EppConfig>,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            source: None,
            block_size: DEFAULT_BLOCK_SIZE,
            host_cache_hit_weight: DEFAULT_HOST_CACHE_HIT_WEIGHT,
            disk_cache_hit_weight: DEFAULT_DISK_CACHE_HIT_WEIGHT,
            default_selector: DefaultSelectorConfig::default(),
            booking: BookingConfig::default(),
            plugins: Vec::new(),
            plugin_images_max: DEFAULT_PLUGIN_IMAGES_MAX,
            worker_selection: WorkerSelectionConfig::default(),
            session_affinity: None,
            session_store: SessionStoreConfig::Memory,
            policy_classes: Vec::new(),
            max_queued_requests: None,
            kv_recent_window: DEFAULT_KV_RECENT_WINDOW,
            engine: None,
            workers: Vec::new(),
            workers_file: None,
            serve: None,
            epp: None,
        }
    }
}

/// Weights of the built-in `default` selector (docs/configuration.md, `default`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DefaultSelectorConfig {
    /// Multiplier of the prefill term of the cost.
    pub prefill_load_scale: f64,
    /// Weight of `active_requests` in the cost.
    pub decode_active_request_weight: f64,
    /// Credit per device-tier cached prompt block, in blocks (1.0: its prefill).
    pub overlap_credit: f64,
    /// How rows of equal cost are told apart.
    pub tie_break: TieBreak,
    /// What `spread` counts as a row's room.
    pub room: Room,
    /// The cache gate: cost per prompt block a row would evict from its recently used cache,
    /// in prefill blocks; 0 = off.
    pub live_eviction_weight: f64,
}

impl Default for DefaultSelectorConfig {
    fn default() -> Self {
        DefaultSelectorConfig {
            prefill_load_scale: DEFAULT_PREFILL_LOAD_SCALE,
            decode_active_request_weight: DEFAULT_DECODE_ACTIVE_REQUEST_WEIGHT,
            overlap_credit: DEFAULT_OVERLAP_CREDIT,
            tie_break: DEFAULT_TIE_BREAK,
            room: DEFAULT_ROOM,
            live_eviction_weight: DEFAULT_LIVE_EVICTION_WEIGHT,
        }
    }
}

/// What a dispatched request books on its row (docs/routing-contract.md §7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BookingConfig {
    /// Prompt tokens booked as pending prefill: the whole prompt, or its uncached part (default).
    pub prefill: PrefillBooking,
    /// Prompt blocks booked as KV held while decoding: every request's whole prompt (default), or
    /// each block id once per row.
    pub decode: DecodeBooking,
}

impl Default for BookingConfig {
    fn default() -> Self {
        BookingConfig {
            prefill: DEFAULT_PREFILL_BOOKING,
            decode: DEFAULT_DECODE_BOOKING,
        }
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
        if let Some(too_deep) = nesting_too_deep(text) {
            let (message, line, column) = match too_deep {
                TooDeep::Flow { line, column } => (
                    format!(
                        "recursion limit exceeded: `[` and `{{` nested more than \
                         {MAX_FLOW_DEPTH} levels deep"
                    ),
                    line,
                    column,
                ),
                TooDeep::Block { line, column } => (
                    format!(
                        "recursion limit exceeded: block mappings and sequences nested more \
                         than {MAX_BLOCK_DEPTH} levels deep"
                    ),
                    line,
                    column,
                ),
            };
            return Err(ConfigError::new(source, ConfigErrorKind::Yaml { message })
                .at(Some((line, column))));
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

/// The directory relative paths in the configuration file `file` are written against: the file's
/// own directory, or `.` for a bare file name (`router.yaml`); `None` when `file` has no parent
/// (`/`, or an empty path).
pub fn config_dir(file: &Path) -> Option<&Path> {
    file.parent().map(|dir| {
        if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        }
    })
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
    booking: Option<RawBooking>,
    #[serde(default)]
    plugins: Option<Vec<RawPlugin>>,
    #[serde(default, deserialize_with = "de_images_max")]
    plugin_images_max: Option<u64>,
    #[serde(default)]
    worker_selection: Option<RawWorkerSelection>,
    #[serde(default)]
    session_affinity: Option<RawSessionAffinity>,
    #[serde(default)]
    policy_classes: Option<Vec<RawPolicyClass>>,
    #[serde(default, deserialize_with = "numbers::de_max_queued")]
    max_queued_requests: Option<u64>,
    #[serde(default, deserialize_with = "numbers::de_kv_recent_window_ms")]
    kv_recent_window_ms: Option<u64>,
    #[serde(default)]
    engine: Option<serde_yaml::Value>,
    #[serde(default)]
    workers: Option<Vec<RawWorker>>,
    #[serde(default, deserialize_with = "workers::de_workers_file")]
    workers_file: Option<String>,
    #[serde(default)]
    serve: Option<RawServe>,
    #[serde(default)]
    epp: Option<RawEpp>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a `default_selector` mapping")]
struct RawDefaultSelector {
    #[serde(default, deserialize_with = "de_weight")]
    prefill_load_scale: Option<f64>,
    #[serde(default, deserialize_with = "de_weight")]
    decode_active_request_weight: Option<f64>,
    #[serde(default, deserialize_with = "de_weight")]
    overlap_credit: Option<f64>,
    #[serde(default, deserialize_with = "de_tie_break")]
    tie_break: Option<TieBreak>,
    #[serde(default, deserialize_with = "de_room")]
    room: Option<Room>,
    #[serde(default, deserialize_with = "de_weight")]
    live_eviction_weight: Option<f64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a `booking` mapping")]
struct RawBooking {
    #[serde(default, deserialize_with = "de_prefill_booking")]
    prefill: Option<PrefillBooking>,
    #[serde(default, deserialize_with = "de_decode_booking")]
    decode: Option<DecodeBooking>,
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
                overlap_credit: ds.overlap_credit.unwrap_or(DEFAULT_OVERLAP_CREDIT),
                tie_break: ds.tie_break.unwrap_or(DEFAULT_TIE_BREAK),
                room: ds.room.unwrap_or(DEFAULT_ROOM),
                live_eviction_weight: ds
                    .live_eviction_weight
                    .unwrap_or(DEFAULT_LIVE_EVICTION_WEIGHT),
            })
            .unwrap_or_default();
        let booking = BookingConfig {
            prefill: raw
                .booking
                .as_ref()
                .and_then(|b| b.prefill)
                .unwrap_or(DEFAULT_PREFILL_BOOKING),
            decode: raw
                .booking
                .and_then(|b| b.decode)
                .unwrap_or(DEFAULT_DECODE_BOOKING),
        };
        let plugins = self.plugins(raw.plugins.unwrap_or_default())?;
        let worker_selection = self.worker_selection(raw.worker_selection)?;
        let (session_affinity, session_store) = match raw.session_affinity {
            Some(raw) => {
                let (affinity, store) = raw.into_config().map_err(|message| {
                    self.error(
                        &[key("session_affinity"), key("max_bindings")],
                        ConfigErrorKind::Yaml { message },
                    )
                })?;
                (Some(affinity), store)
            }
            None => (None, SessionStoreConfig::Memory),
        };
        let policy_classes = self.policy_classes(raw.policy_classes.unwrap_or_default())?;
        let engine = self.engine(raw.engine)?;
        let block_size = raw.block_size.unwrap_or(DEFAULT_BLOCK_SIZE);
        let (workers, workers_file) = match (raw.workers, raw.workers_file) {
            (Some(_), Some(_)) => {
                return Err(self.error(
                    &[key("workers_file")],
                    ConfigErrorKind::Yaml {
                        message: "`workers` and `workers_file` are both set: list the workers \
                                  in one place (the file `workers_file` names, or `workers:` \
                                  here)"
                            .to_owned(),
                    },
                ))
            }
            (None, Some(file)) => {
                let file = match self.source.and_then(config_dir) {
                    Some(dir) => dir.join(file),
                    None => PathBuf::from(file),
                };
                // Before the read: a change during it is a new version, reloaded again.
                let version = FileVersion::of(&file).ok();
                let workers = workers::from_file(&file, block_size)?;
                (
                    workers,
                    Some(WorkersFile {
                        path: file,
                        version,
                    }),
                )
            }
            (workers, None) => (self.workers(workers.unwrap_or_default(), block_size)?, None),
        };
        let serve = self.serve(raw.serve);
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
            booking,
            plugins,
            plugin_images_max: raw
                .plugin_images_max
                .and_then(|n| usize::try_from(n).ok())
                .unwrap_or(DEFAULT_PLUGIN_IMAGES_MAX),
            worker_selection,
            session_affinity,
            session_store,
            policy_classes,
            max_queued_requests: raw
                .max_queued_requests
                .and_then(|n| usize::try_from(n).ok()),
            kv_recent_window: match raw.kv_recent_window_ms {
                None => DEFAULT_KV_RECENT_WINDOW,
                Some(0) => None,
                Some(ms) => Some(Duration::from_millis(ms)),
            },
            engine,
            workers,
            workers_file,
            serve,
            epp: raw.epp.map(RawEpp::build),
        })
    }
}

/// The names of a list's entries, each with the index of its first entry: the duplicate check of
/// `worker_selection.instances` and `policy_classes`.
struct Names<'n> {
    /// Key path of the list.
    list: Vec<Seg>,
    /// The error for a repeated name, given the name and the line of its first entry.
    duplicate: fn(String, Option<usize>) -> ConfigErrorKind,
    first_index: HashMap<&'n str, usize>,
}

impl<'n> Names<'n> {
    fn new(list: Vec<Seg>, duplicate: fn(String, Option<usize>) -> ConfigErrorKind) -> Self {
        Names {
            list,
            duplicate,
            first_index: HashMap::new(),
        }
    }

    /// Records `name`, the name of entry `index`; fails when an earlier entry has it (the error
    /// is at the repeated name and names the line of the first one).
    fn add(
        &mut self,
        builder: &Builder<'_>,
        index: usize,
        name: &'n str,
    ) -> Result<(), ConfigError> {
        let name_path = |index| [&self.list[..], &[Seg::Index(index), key("name")]].concat();
        if let Some(&first) = self.first_index.get(name) {
            let first_line = locate(builder.text, &name_path(first)).map(|(line, _)| line);
            return Err(builder.error(
                &name_path(index),
                (self.duplicate)(name.to_owned(), first_line),
            ));
        }
        self.first_index.insert(name, index);
        Ok(())
    }

    /// Whether an entry is called `name`.
    fn contains(&self, name: &str) -> bool {
        self.first_index.contains_key(name)
    }
}
