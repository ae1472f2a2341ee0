//! `router-host replay`: compare worker-selection configs on a trace or a built-in workload.
//!
//! The routed side is the production host ([`router_policies::host::Host`]: loaded `.so` policies, the
//! built-in default, session bindings, queue admission, load booking through dispatch and
//! completion) on a simulated clock. The other side is one simulated engine per row
//! ([`engine`]): continuous batching with a prefix cache that publishes block stored / evicted
//! events, from which the host keeps its KV-overlap index ([`router_core::kv_index`]), the way
//! a deployed router follows real engines' KV events.
//!
//! Modules: [`trace`] (Mooncake JSONL in and out, the ideal bound), [`synth`] (the embedded
//! default workload), [`engine`], [`sim`] (the event loop), [`report`] (table and
//! JSON), [`plot`] (SVG). The subcommand itself (flags, progress bar, output files) lives in
//! the binary (`src/replay_cli.rs`). User documentation: `docs/replay.md`.

pub mod engine;
pub mod plot;
pub mod report;
pub mod settings;
pub mod sim;
pub mod synth;
pub mod trace;

use std::path::{Path, PathBuf};

use router_config::{ConfigError, RouterConfig};
use router_core::model::ClusterError;
use router_policies::loader::SearchPath;
use router_policies::policy_set::{PolicySetOptions, StartupError};

pub use engine::{EngineParams, EngineSpec, KvCapacity};
pub use report::{ConfigReport, ReferenceReport, Report};
pub use settings::ColumnSettings;
pub use sim::{RunConfig, Shape};
pub use synth::SynthParams;
pub use trace::{TimeScaleError, TraceError, Workload, WorkloadRequest};

/// The configs replayed when none is given: `(label, YAML text)`, the files of
/// `examples/replay/` built into the binary.
pub const EXAMPLE_CONFIGS: &[(&str, &str)] = &[
    (
        "examples/replay/default.yaml",
        include_str!("../../../../examples/replay/default.yaml"),
    ),
    (
        "examples/replay/two-tier.yaml",
        include_str!("../../../../examples/replay/two-tier.yaml"),
    ),
    (
        "examples/replay/two-tier-sticky.yaml",
        include_str!("../../../../examples/replay/two-tier-sticky.yaml"),
    ),
    (
        "examples/replay/round-robin.yaml",
        include_str!("../../../../examples/replay/round-robin.yaml"),
    ),
];

/// Why a replay could not run.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(transparent)]
    Config(#[from] Box<ConfigError>),
    #[error("config {label}: {message}")]
    Engine { label: String, message: String },
    #[error("config {label}")]
    Startup {
        label: String,
        #[source]
        source: Box<StartupError>,
    },
    // The cause is in the message, not a `source`: printed with its chain it would say it twice.
    #[error("config {label}: simulated workers: {reason}")]
    Cluster { label: String, reason: ClusterError },
}

/// Settings shared by every config of one replay.
#[derive(Debug, Clone)]
pub struct Setup {
    pub shape: Shape,
    /// Engine settings from flags; they override each config's `engine:` block.
    pub engine: EngineSpec,
    /// `--plugin-dir` directories.
    pub plugin_dirs: Vec<PathBuf>,
    /// How each config's `PolicySet` is built (the CLI exits on a hung policy call).
    pub router_options: PolicySetOptions,
}

impl Setup {
    pub fn new(workers: u32, dp_size: u32) -> Setup {
        Setup {
            shape: Shape { workers, dp_size },
            engine: EngineSpec::default(),
            plugin_dirs: Vec::new(),
            router_options: PolicySetOptions::default(),
        }
    }
}

/// Read a config file and prepare it for a workload of `block_size`-token blocks.
pub fn prepare_file(path: &Path, setup: &Setup, block_size: u32) -> Result<RunConfig, ReplayError> {
    let config = RouterConfig::from_file(path).map_err(Box::new)?;
    let search = SearchPath::new(setup.plugin_dirs.clone(), Some(path));
    let label = path.display().to_string();
    prepare(label.clone(), label, config, search, setup, block_size)
}

/// Prepare config text (an embedded example); `label` names it in the report and in errors.
/// Plugins given by `name:` are looked up in `--plugin-dir`s, then next to the executable.
pub fn prepare_text(
    label: &str,
    text: &str,
    setup: &Setup,
    block_size: u32,
) -> Result<RunConfig, ReplayError> {
    // Named after its file in examples/; it has no `path:` plugins to resolve against it.
    let config = RouterConfig::from_yaml_str(text, Some(Path::new(label))).map_err(Box::new)?;
    let search = SearchPath::new(setup.plugin_dirs.clone(), None);
    // `-c builtin:NAME` runs it: NAME is the file's stem.
    let name = Path::new(label)
        .file_stem()
        .map_or_else(|| label.into(), |stem| stem.to_string_lossy());
    let source = format!("builtin:{name}");
    prepare(label.to_string(), source, config, search, setup, block_size)
}

fn prepare(
    label: String,
    source: String,
    mut config: RouterConfig,
    search: SearchPath,
    setup: &Setup,
    block_size: u32,
) -> Result<RunConfig, ReplayError> {
    let engine_error = |message: String| ReplayError::Engine {
        label: label.clone(),
        message,
    };
    let from_yaml = match &config.engine {
        Some(value) => EngineSpec::from_json(value).map_err(engine_error)?,
        None => EngineSpec::default(),
    };
    let engine = from_yaml
        .overlay(&setup.engine)
        .resolve(block_size)
        .map_err(engine_error)?;
    // One `hash_ids` entry is one KV block: the router must count blocks the same way.
    let block_size_replaced = (config.block_size != block_size).then_some(config.block_size);
    config.block_size = block_size;
    Ok(RunConfig {
        label,
        source,
        router: config,
        search,
        engine,
        block_size_replaced,
        router_options: setup.router_options,
    })
}

/// Replay `workload` through every config, in order. `progress(config, requests_done)` is
/// called as arrivals are processed.
pub fn replay(
    workload: &Workload,
    shape: Shape,
    configs: &[RunConfig],
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Report, ReplayError> {
    let stats = workload.stats();
    let mut reports = Vec::with_capacity(configs.len());
    // Configs usually share their engines, and with them the reference.
    let mut references: Vec<(EngineParams, ReferenceReport)> = Vec::new();
    for (i, config) in configs.iter().enumerate() {
        let output = sim::run(workload, shape, config, &mut |done| progress(i, done))?;
        let reference = match references.iter().find(|(e, _)| *e == config.engine) {
            Some((_, r)) => r.clone(),
            None => {
                let engines = shape.workers * shape.dp_size;
                let pooled = engine::pooled_lru(
                    &workload.requests,
                    workload.block_size,
                    engines,
                    &config.engine,
                );
                let r = ReferenceReport::new(&pooled);
                references.push((config.engine, r.clone()));
                r
            }
        };
        reports.push(ConfigReport::new(
            &config.label,
            config.block_size_replaced,
            config.engine,
            shape,
            workload,
            output,
            reference,
        ));
    }
    Ok(Report {
        workload: report::WorkloadReport::new(workload, &stats),
        cluster: report::ClusterReport::new(shape),
        configs: reports,
    })
}
