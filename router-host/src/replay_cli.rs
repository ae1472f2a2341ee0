//! The `replay` subcommand: flags, progress on stderr, table on stdout, `--json`, `--plot`,
//! `--requests`.
//!
//! Output files are written before the table, each through a temporary file renamed into place.

use std::fs::File;
use std::io::{BufWriter, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context as _;

use router_host::loader::LoadError;
use router_host::policy_set::{OnHang, PolicySet, PolicySetOptions, StartupError};
use router_host::replay::engine::EngineSpec;
use router_host::replay::synth::{self, SynthParams};
use router_host::replay::trace::{Workload, DEFAULT_TRACE_BLOCK_SIZE};
use router_host::replay::{
    plot, prepare_file, prepare_text, replay, ReplayError, RunConfig, Setup, EXAMPLE_CONFIGS,
};

/// Replay a trace (or the built-in multi-turn workload) through one or more router configs on
/// simulated engines, and compare cache reuse, latency, load balance and decision cost.
#[derive(Debug, Clone, clap::Args)]
pub struct ReplayArgs {
    /// Router config to compare (repeatable; reported in the order given): a YAML FILE, or
    /// `builtin:NAME` for a config built into the binary (the files of examples/replay/):
    /// default, two-tier, two-tier-sticky, round-robin, random, two-tier-admission. Without
    /// --config: the first four. Engine flags below override each config's `engine:` block.
    #[arg(long = "config", short = 'c', value_name = "FILE|builtin:NAME")]
    pub configs: Vec<PathBuf>,
    /// Also replay the built-in configs that run without --config (builtin:default,
    /// builtin:two-tier, builtin:two-tier-sticky, builtin:round-robin), before the --config ones:
    /// `-c mine.yaml --with-builtin` compares your config with the shipped ones.
    #[arg(long)]
    pub with_builtin: bool,
    /// Mooncake-format JSONL trace. Default: a generated multi-turn workload (flags below).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Tokens per `hash_ids` entry (= per KV block in the simulation).
    #[arg(long, value_name = "TOKENS", default_value_t = DEFAULT_TRACE_BLOCK_SIZE)]
    pub trace_block_size: u32,
    /// Replay only the first N requests.
    #[arg(long, value_name = "N")]
    pub limit: Option<usize>,
    /// Multiply every arrival time by F (0.5 = the same requests twice as fast).
    #[arg(long, value_name = "F")]
    pub time_scale: Option<f64>,
    /// Workers in the simulated cluster.
    #[arg(long, default_value_t = 4)]
    pub workers: u32,
    /// Data-parallel ranks per worker (one simulated engine per rank).
    #[arg(long, default_value_t = 1)]
    pub dp_size: u32,
    #[command(flatten)]
    pub engine: crate::engine_flags::EngineFlags,
    /// Time vLLM's API server spends on a request before its engine sees it: each request
    /// joins its engine's queue this long after the router dispatched it [default: 0].
    #[arg(long, value_name = "MS")]
    pub api_overhead_ms: Option<f64>,
    /// Cache the full blocks a request's generated tokens complete, under the trace's
    /// `output_hash_ids`, as vLLM does [default: true].
    #[arg(long, value_name = "true|false")]
    pub cache_generated: Option<bool>,
    /// A trace line that names the request it follows (`after`) arrives its `gap_ms` after
    /// that one ends in the simulation, as a closed-loop client sends it. Without this flag
    /// every request arrives at its `timestamp`.
    #[arg(long)]
    pub closed_loop: bool,
    /// Write the report as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write an SVG comparing the configs.
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
    /// Write every request's outcome in every config as CSV (worker, hits, engine wait, TTFT,
    /// e2e): the rows behind the percentiles.
    #[arg(long, value_name = "FILE")]
    pub requests: Option<PathBuf>,
    /// Seed of the generated workload (policies such as `random` take their own `seed`).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Directory searched first for plugins given by `name:` (repeatable).
    #[arg(long = "plugin-dir", value_name = "DIR")]
    pub plugin_dirs: Vec<PathBuf>,
    /// Write the replayed workload as Mooncake JSONL (generated, or the trace after
    /// --limit/--time-scale).
    #[arg(long, value_name = "FILE")]
    pub write_workload: Option<PathBuf>,
    /// Sessions [default: 1000].
    #[arg(long, help_heading = "Generated workload (without --trace)")]
    pub sessions: Option<u32>,
    /// Mean turns per session [default: 5].
    #[arg(long, help_heading = "Generated workload (without --trace)")]
    pub turns: Option<u32>,
    /// Shared system prompts [default: 8].
    #[arg(long, help_heading = "Generated workload (without --trace)")]
    pub system_prompts: Option<u32>,
    /// Tokens per system prompt [default: 3072].
    #[arg(long, help_heading = "Generated workload (without --trace)")]
    pub system_prompt_tokens: Option<u64>,
    /// Mean new user tokens per turn [default: 600].
    #[arg(long, help_heading = "Generated workload (without --trace)")]
    pub user_tokens: Option<u64>,
    /// Mean output tokens per turn [default: 300].
    #[arg(long, help_heading = "Generated workload (without --trace)")]
    pub output_tokens: Option<u64>,
    /// Mean requests per second [default: 16].
    #[arg(long, help_heading = "Generated workload (without --trace)")]
    pub rate: Option<f64>,
    /// Mean seconds between a session's turns [default: 10].
    #[arg(
        long,
        value_name = "SECONDS",
        help_heading = "Generated workload (without --trace)"
    )]
    pub think_time: Option<f64>,
}

impl ReplayArgs {
    fn synth_params(&self) -> anyhow::Result<Option<SynthParams>> {
        let given = [
            ("--sessions", self.sessions.is_some()),
            ("--turns", self.turns.is_some()),
            ("--system-prompts", self.system_prompts.is_some()),
            (
                "--system-prompt-tokens",
                self.system_prompt_tokens.is_some(),
            ),
            ("--user-tokens", self.user_tokens.is_some()),
            ("--output-tokens", self.output_tokens.is_some()),
            ("--rate", self.rate.is_some()),
            ("--think-time", self.think_time.is_some()),
        ];
        if self.trace.is_some() {
            if let Some((flag, _)) = given.iter().find(|(_, set)| *set) {
                anyhow::bail!(
                    "{flag} shapes the generated workload and has no effect with --trace"
                );
            }
            return Ok(None);
        }
        let d = SynthParams::default();
        let p = SynthParams {
            sessions: self.sessions.unwrap_or(d.sessions),
            turns: self.turns.unwrap_or(d.turns),
            system_prompts: self.system_prompts.unwrap_or(d.system_prompts),
            system_prompt_tokens: self.system_prompt_tokens.unwrap_or(d.system_prompt_tokens),
            user_tokens: self.user_tokens.unwrap_or(d.user_tokens),
            output_tokens: self.output_tokens.unwrap_or(d.output_tokens),
            rate: self.rate.unwrap_or(d.rate),
            think_time_s: self.think_time.unwrap_or(d.think_time_s),
            block_size: self.trace_block_size,
            seed: self.seed,
        };
        p.validate().map_err(anyhow::Error::msg)?;
        Ok(Some(p))
    }

    fn engine_spec(&self) -> EngineSpec {
        EngineSpec {
            api_overhead_ms: self.api_overhead_ms,
            cache_generated: self.cache_generated,
            ..self.engine.spec(None)
        }
    }
}

/// Run the subcommand.
pub fn run(args: &ReplayArgs) -> anyhow::Result<ExitCode> {
    let started = Instant::now();
    if args.trace_block_size == 0 {
        anyhow::bail!("--trace-block-size must be at least 1");
    }
    if args.workers == 0 || args.dp_size == 0 {
        anyhow::bail!("--workers and --dp-size must be at least 1");
    }
    if u64::from(args.workers) * u64::from(args.dp_size) > 4096 {
        anyhow::bail!("at most 4096 simulated engines (--workers x --dp-size)");
    }
    let mut workload = match (&args.trace, args.synth_params()?) {
        (Some(path), _) => Workload::from_jsonl_file(path, args.trace_block_size)?,
        (None, Some(p)) => synth::generate(&p),
        (None, None) => unreachable!("synth_params returns parameters without --trace"),
    };
    if let Some(n) = args.limit {
        workload.truncate(n);
    }
    if let Some(f) = args.time_scale {
        workload.scale_time(f).context("--time-scale")?;
    }
    if workload.requests.is_empty() {
        anyhow::bail!("the workload has no requests");
    }
    if let Some(path) = &args.write_workload {
        write_file(path, |out| workload.write_jsonl(out))?;
    }
    // Written with its links either way: the file replays the same with the same flag.
    if !args.closed_loop {
        workload.open_loop();
    }
    let setup = Setup {
        shape: router_host::replay::Shape {
            workers: args.workers,
            dp_size: args.dp_size,
        },
        engine: args.engine_spec(),
        plugin_dirs: args.plugin_dirs.clone(),
        // One thread replays everything: a hung policy call ends the process, naming the
        // instance and the call, instead of waiting forever.
        router_options: PolicySetOptions {
            on_hang: OnHang::Exit {
                code: crate::EXIT_HUNG,
            },
        },
    };
    // Load and validate every config before replaying any.
    let chosen = chosen_configs(args)?;
    let configs = chosen
        .iter()
        .map(|choice| match choice {
            Choice::File(path) => {
                prepare_file(path, &setup, workload.block_size).map_err(|err| file_error(path, err))
            }
            Choice::Builtin(b) => prepare_text(b.label, b.text, &setup, workload.block_size)
                .map_err(anyhow::Error::from),
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    // Every plugin loaded and every instance created now, so a config that cannot start fails
    // before the ones given before it have run (the replay builds its own routers again).
    for (choice, config) in chosen.iter().zip(&configs) {
        if let Err(err) = PolicySet::from_config(&config.router, &config.search) {
            return Err(startup_error(choice, config, err));
        }
    }
    let mut bar = Progress::new(
        configs.iter().map(|c| c.label.clone()).collect(),
        workload.requests.len(),
    );
    let report = replay(&workload, setup.shape, &configs, &mut |config, done| {
        bar.update(config, done)
    });
    bar.finish();
    let report = report?;
    // The files first: a closed stdout (`| head`) must not cost them.
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report.to_json())?;
        write_file(path, |out| {
            out.write_all(text.as_bytes())?;
            out.write_all(b"\n")
        })?;
    }
    if let Some(path) = &args.plot {
        let svg = plot::svg(&report);
        write_file(path, |out| out.write_all(svg.as_bytes()))?;
    }
    if let Some(path) = &args.requests {
        write_file(path, |out| {
            report.write_requests_csv(out).map_err(std::io::Error::from)
        })?;
    }
    let mut out = crate::Stdout::lock();
    out.write_all(report.to_table().as_bytes())
        .and_then(|()| out.flush())
        .context("cannot write to stdout")?;
    let wall = started.elapsed().as_secs_f64();
    let simulated: usize = report.configs.len() * report.workload.requests;
    eprintln!(
        "replayed {} requests x {} configs in {wall:.2} s ({:.0} simulated requests/s)",
        report.workload.requests,
        report.configs.len(),
        simulated as f64 / wall.max(1e-9)
    );
    Ok(ExitCode::SUCCESS)
}

/// How `-c` names a config built into the binary.
const BUILTIN_PREFIX: &str = "builtin:";

/// The files of examples/replay/ built in besides [`EXAMPLE_CONFIGS`] (the ones that run without
/// `--config`): `(label, YAML text)`.
const MORE_BUILTIN_CONFIGS: &[(&str, &str)] = &[
    (
        "examples/replay/random.yaml",
        include_str!("../../examples/replay/random.yaml"),
    ),
    (
        "examples/replay/two-tier-admission.yaml",
        include_str!("../../examples/replay/two-tier-admission.yaml"),
    ),
];

/// A config built into the binary, named by `-c builtin:NAME`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BuiltinConfig {
    /// `NAME`: the file's stem.
    name: &'static str,
    /// Its file in the repository: its label in the report and the JSON, however it was chosen.
    label: &'static str,
    text: &'static str,
}

/// Every built-in config: first the [`EXAMPLE_CONFIGS`] (what runs without `--config`, and what
/// `--with-builtin` adds), then the rest of examples/replay/.
fn builtin_configs() -> Vec<BuiltinConfig> {
    EXAMPLE_CONFIGS
        .iter()
        .chain(MORE_BUILTIN_CONFIGS)
        .map(|&(label, text)| BuiltinConfig {
            name: label
                .strip_prefix("examples/replay/")
                .and_then(|file| file.strip_suffix(".yaml"))
                .unwrap_or(label),
            label,
            text,
        })
        .collect()
}

fn names(configs: &[BuiltinConfig]) -> String {
    configs
        .iter()
        .map(|b| b.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// One config to replay, as chosen on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Choice {
    File(PathBuf),
    Builtin(BuiltinConfig),
}

/// The configs to replay, in order: the defaults (without `--config`, or with
/// `--with-builtin`), then every `--config`.
fn chosen_configs(args: &ReplayArgs) -> anyhow::Result<Vec<Choice>> {
    let builtins = builtin_configs();
    let defaults = &builtins[..EXAMPLE_CONFIGS.len()];
    let mut chosen = Vec::new();
    if args.with_builtin || args.configs.is_empty() {
        chosen.extend(defaults.iter().copied().map(Choice::Builtin));
    }
    for given in &args.configs {
        let Some(name) = given.to_str().and_then(|s| s.strip_prefix(BUILTIN_PREFIX)) else {
            chosen.push(Choice::File(given.clone()));
            continue;
        };
        let Some(builtin) = builtins.iter().find(|b| b.name == name) else {
            anyhow::bail!(
                "--config {BUILTIN_PREFIX}{name}: no built-in config named `{name}`; the built-in \
                 configs are {} (give a file named `{BUILTIN_PREFIX}...` as ./{BUILTIN_PREFIX}...)",
                names(&builtins)
            );
        };
        let choice = Choice::Builtin(*builtin);
        if chosen.contains(&choice) {
            if args.with_builtin && defaults.contains(builtin) {
                anyhow::bail!(
                    "--config {BUILTIN_PREFIX}{name}: --with-builtin already adds it (it adds {}); \
                     give each config once",
                    names(defaults)
                );
            }
            anyhow::bail!("--config {BUILTIN_PREFIX}{name} is given twice; give each config once");
        }
        chosen.push(choice);
    }
    Ok(chosen)
}

/// A config file that cannot be used. A file that does not exist but is named like a built-in
/// config (`-c examples/replay/two-tier.yaml` outside the checkout) gets a pointer to it.
fn file_error(path: &Path, err: ReplayError) -> anyhow::Error {
    let err = anyhow::Error::from(err);
    let builtins = builtin_configs();
    let named_like = path
        .file_stem()
        .filter(|_| !path.exists())
        .and_then(|stem| builtins.iter().find(|b| stem == b.name));
    match named_like {
        Some(b) => anyhow::anyhow!(
            "{err:#}; `{0}` is also a built-in config: `-c {BUILTIN_PREFIX}{0}` runs it from any \
             directory",
            b.name
        ),
        None => err,
    }
}

/// A config whose plugins or instances cannot be set up. For a built-in config whose plugin is
/// not found (router-host installed or copied without it), say which file it needs and how to
/// point at it.
fn startup_error(choice: &Choice, config: &RunConfig, err: StartupError) -> anyhow::Error {
    let Choice::Builtin(builtin) = choice else {
        return ReplayError::Startup {
            label: config.label.clone(),
            source: Box::new(err),
        }
        .into();
    };
    let missing = match &err {
        StartupError::Plugin { source, .. } => match source.as_ref() {
            LoadError::NotFound { name, .. } => Some(format!("lib{name}.so")),
            _ => None,
        },
        StartupError::Policy(_) => None,
    };
    let name = builtin.name;
    let err = anyhow::Error::from(err);
    let Some(file) = missing else {
        return anyhow::anyhow!("config {BUILTIN_PREFIX}{name}: {err:#}");
    };
    let next_to = match std::env::current_exe() {
        Ok(exe) => format!("next to {}", exe.display()),
        Err(_) => "next to the router-host executable".to_string(),
    };
    let example = match built_in_checkout(&file) {
        Some(dir) => format!(
            "--plugin-dir {} holds one, in the checkout this router-host was built from",
            dir.display()
        ),
        None => "for example --plugin-dir /path/to/router/target/release".to_string(),
    };
    anyhow::anyhow!(
        "config {BUILTIN_PREFIX}{name}: {err:#}; {BUILTIN_PREFIX}{name} needs {file}, the plugin \
         shipped with router-host (`cargo build --release` in the router repository builds it \
         into target/release, next to router-host): pass --plugin-dir with the directory that \
         holds it ({example}), or copy it {next_to}"
    )
}

/// `target/<profile>` of the checkout this binary was built from, if it still holds `file`: this
/// build's profile first.
fn built_in_checkout(file: &str) -> Option<PathBuf> {
    let target = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()?
        .join("target");
    let profiles = if cfg!(debug_assertions) {
        ["debug", "release"]
    } else {
        ["release", "debug"]
    };
    profiles
        .iter()
        .map(|profile| target.join(profile))
        .find(|dir| dir.join(file).is_file())
}

/// Write `path` whole or not at all: into a temporary file in the same directory, renamed over
/// `path` once complete, so an interrupted run (Ctrl-C) never leaves a truncated file under the
/// final name, and a reader of the old file keeps the old content. Through a symlink, the file it
/// points to is replaced. A target that exists and is not a regular file (`/dev/null`, a FIFO)
/// is written in place.
fn write_file(
    path: &Path,
    write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> anyhow::Result<()> {
    let cannot = || format!("cannot write {}", path.display());
    let is_link = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    let target = match is_link.then(|| std::fs::canonicalize(path)) {
        Some(Ok(real)) => real,
        _ => path.to_path_buf(),
    };
    if std::fs::metadata(&target).is_ok_and(|m| !m.is_file()) {
        let mut out = BufWriter::new(File::create(&target).with_context(cannot)?);
        return write(&mut out)
            .and_then(|()| out.flush())
            .with_context(cannot);
    }
    let Some(name) = target.file_name() else {
        anyhow::bail!("cannot write {}: not a file name", path.display());
    };
    let dir = match target.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let temp = dir.join(format!(
        ".{}.{}.tmp",
        name.to_string_lossy(),
        std::process::id()
    ));
    let written = (|| -> std::io::Result<()> {
        let mut out = BufWriter::new(File::create(&temp)?);
        write(&mut out)?;
        out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&temp, &target)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    written.with_context(cannot)
}

/// A one-line progress bar on stderr, drawn only when stderr is a terminal.
struct Progress {
    enabled: bool,
    labels: Vec<String>,
    total: usize,
    last: Option<Instant>,
    drawn: bool,
}

impl Progress {
    fn new(labels: Vec<String>, total: usize) -> Progress {
        Progress {
            enabled: std::io::stderr().is_terminal(),
            labels,
            total,
            last: None,
            drawn: false,
        }
    }

    fn update(&mut self, config: usize, done: usize) {
        if !self.enabled {
            return;
        }
        let now = Instant::now();
        if done != self.total
            && self
                .last
                .is_some_and(|t| now.duration_since(t) < Duration::from_millis(100))
        {
            return;
        }
        self.last = Some(now);
        let width = 30;
        let filled = done * width / self.total.max(1);
        let label = self.labels.get(config).map_or("", String::as_str);
        let mut err = std::io::stderr().lock();
        let _ = write!(
            err,
            "\r\x1b[2K[{}/{}] {label} [{}{}] {done}/{}",
            config + 1,
            self.labels.len(),
            "#".repeat(filled),
            "-".repeat(width - filled),
            self.total
        );
        let _ = err.flush();
        self.drawn = true;
    }

    fn finish(&mut self) {
        if self.drawn {
            let _ = write!(std::io::stderr(), "\r\x1b[2K");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_names_are_the_documented_ones_and_every_config_prepares() {
        let builtins = builtin_configs();
        assert_eq!(
            names(&builtins),
            "default, two-tier, two-tier-sticky, round-robin, random, two-tier-admission"
        );
        let setup = Setup::new(4, 1);
        for b in &builtins {
            prepare_text(b.label, b.text, &setup, 512)
                .unwrap_or_else(|e| panic!("builtin:{}: {e}", b.name));
        }
    }

    #[test]
    fn the_config_help_lists_every_builtin_name() {
        use clap::Args as _;
        let command = ReplayArgs::augment_args(clap::Command::new("replay"));
        let help = command
            .get_arguments()
            .find(|a| a.get_id() == "configs")
            .and_then(|a| a.get_help())
            .map(|h| h.to_string())
            .unwrap_or_default();
        let listed = help.replace([',', '.', ':', '(', ')'], " ");
        for b in builtin_configs() {
            assert!(
                listed.split_whitespace().any(|word| word == b.name),
                "`{}` is missing from the --config help: {help}",
                b.name
            );
        }
    }

    #[test]
    fn builtin_names_parse_in_order_and_bad_ones_are_errors() {
        use clap::Parser as _;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            replay: ReplayArgs,
        }
        let chosen = |args: &[&str]| {
            let cli = Cli::try_parse_from(std::iter::once("replay").chain(args.iter().copied()))
                .map_err(|e| e.to_string())?;
            chosen_configs(&cli.replay).map_err(|e| e.to_string())
        };
        let labels = |args: &[&str]| -> Vec<String> {
            chosen(args)
                .unwrap()
                .iter()
                .map(|c| match c {
                    Choice::File(path) => path.display().to_string(),
                    Choice::Builtin(b) => b.name.to_string(),
                })
                .collect()
        };
        assert_eq!(
            labels(&[]),
            ["default", "two-tier", "two-tier-sticky", "round-robin"]
        );
        assert_eq!(
            labels(&["-c", "mine.yaml", "--with-builtin", "-c", "builtin:random"]),
            [
                "default",
                "two-tier",
                "two-tier-sticky",
                "round-robin",
                "mine.yaml",
                "random"
            ]
        );
        assert_eq!(
            labels(&["-c", "builtin:round-robin", "-c", "./builtin:x.yaml"]),
            ["round-robin", "./builtin:x.yaml"]
        );
        assert_eq!(
            chosen(&["-c", "builtin:random", "-c", "builtin:random"]).unwrap_err(),
            "--config builtin:random is given twice; give each config once"
        );
        assert!(chosen(&["--with-builtin", "-c", "builtin:default"])
            .unwrap_err()
            .starts_with("--config builtin:default: --with-builtin already adds it"));
        assert!(chosen(&["-c", "builtin:"])
            .unwrap_err()
            .starts_with("--config builtin:: no built-in config named ``;"));
    }
}
