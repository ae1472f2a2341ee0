//! `router-host`: load policy plugins named in YAML and route requests with them.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand};

// The binary only: the library leaves the allocator to whoever links it. Plugins keep their own
// (everything that crosses the ABI is freed by the side that allocated it, through abi_stable).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod engine_flags;
mod mock_engine;
mod replay_cli;

use router_host::catalog::{shadowed_types, Catalog};
use router_host::config::RouterConfig;
use router_host::host::Host;
use router_host::loader::{
    open_library_with, printable, PermissionBypass, PolicyTypeDoc, SearchPath, Verify,
};
use router_host::policy_set::{OnHang, PolicySet, PolicySetOptions};
use router_host::scenario::{self, Scenario};

#[derive(Parser)]
#[command(
    name = "router-host",
    version,
    about = "KV-cache-aware LLM request router with worker-selection policies loaded from shared objects"
)]
struct Cli {
    /// More log output on stderr (-v info, -vv debug); RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

/// Options shared by every command that reads a router config.
#[derive(clap::Args)]
struct ConfigArgs {
    /// Router YAML file.
    #[arg(long, short)]
    config: PathBuf,
    /// Directory searched first for plugins given by `name:` (repeatable).
    #[arg(long = "plugin-dir")]
    plugin_dirs: Vec<PathBuf>,
}

/// `check`'s options.
#[derive(clap::Args)]
struct CheckArgs {
    #[command(flatten)]
    config: ConfigArgs,
    /// Also connect to the session store of `session_affinity.store` (Redis) and check that it
    /// answers with these credentials (docs/replicas.md).
    #[arg(long)]
    connect_store: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Load the config and every plugin, create every instance, and print what was loaded.
    Check(CheckArgs),
    /// Print the policy types and parameter documentation of one plugin file.
    Describe {
        /// The plugin shared object (`lib<name>.so`).
        plugin: PathBuf,
        /// Load it even if it or its directory is writable by others or owned by another user.
        #[arg(long)]
        allow_insecure_permissions: bool,
    },
    /// Decide a scripted sequence of requests and print one JSON object per line.
    Select {
        #[command(flatten)]
        config: ConfigArgs,
        /// Scenario JSON file (see docs/select.md).
        #[arg(long, short)]
        scenario: PathBuf,
    },
    /// Replay a trace (or the built-in multi-turn workload) through router configs on simulated
    /// engines and compare cache reuse, latency, load balance and decision cost.
    Replay(Box<replay_cli::ReplayArgs>),
    /// Run the live OpenAI-compatible routing proxy in front of the engines in `workers:`
    /// (docs/serve.md). SIGHUP reloads the config; SIGTERM or SIGINT drains and exits 0.
    Serve {
        #[command(flatten)]
        config: ConfigArgs,
        /// Address to listen on, IP:PORT (overrides `serve.listen`; port 0 picks a free one).
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
    },
    /// Run the router as a Gateway API Inference Extension endpoint picker: an Envoy ext_proc
    /// gRPC server on `epp.listen` that picks the engine for each request, with /metrics,
    /// /health and /ready on `epp.metrics_listen` (docs/gateway.md). SIGHUP reloads the config;
    /// SIGTERM or SIGINT drains and exits 0.
    Epp {
        #[command(flatten)]
        config: ConfigArgs,
    },
    /// Run a simulated vLLM engine (the replay's engine model in real time): the OpenAI subset,
    /// `/tokenize`, `/metrics` with vLLM's names, and KV-cache events over ZMQ
    /// (docs/engines.md). SIGTERM or SIGINT exits 0.
    MockEngine(Box<mock_engine::MockArgs>),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The proxy logs one line per request at info; the one-shot tools only warnings.
    let quiet = if matches!(cli.command, Command::Serve { .. } | Command::Epp { .. }) {
        "info"
    } else if matches!(cli.command, Command::MockEngine(_)) {
        "info,zeromq=warn"
    } else {
        "warn"
    };
    init_logging(cli.verbose, quiet);
    match run(cli.command) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// Command output on stdout. A closed pipe (`router-host select ... | head`, `| true`) is not an
/// error: from the first write that finds the reader gone, output is dropped quietly, and the
/// command finishes with the exit status its outcome gives (a `select` with a failed request
/// still exits 1). Other write errors (a full disk) are errors.
pub(crate) struct Stdout {
    inner: std::io::StdoutLock<'static>,
    closed: bool,
}

impl Stdout {
    pub(crate) fn lock() -> Stdout {
        Stdout {
            inner: std::io::stdout().lock(),
            closed: false,
        }
    }

    fn absorb_closed<T>(&mut self, result: std::io::Result<T>, ok: T) -> std::io::Result<T> {
        match result {
            Err(err) if err.kind() == std::io::ErrorKind::BrokenPipe => {
                self.closed = true;
                Ok(ok)
            }
            other => other,
        }
    }
}

impl Write for Stdout {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.closed {
            return Ok(buf.len());
        }
        let result = self.inner.write(buf);
        self.absorb_closed(result, buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.closed {
            return Ok(());
        }
        let result = self.inner.flush();
        self.absorb_closed(result, ())
    }
}

/// `select` exits 2 for a config or scenario it cannot use at all.
fn unusable(err: anyhow::Error) -> ExitCode {
    eprintln!("error: {err:#}");
    ExitCode::from(2)
}

fn init_logging(verbose: u8, quiet: &str) {
    let default = match verbose {
        0 => quiet,
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Check(args) => check(&args),
        Command::Describe {
            plugin,
            allow_insecure_permissions,
        } => describe(&plugin, allow_insecure_permissions),
        Command::Select { config, scenario } => select(&config, &scenario),
        Command::Replay(args) => replay_cli::run(&args),
        Command::Serve { config, listen } => serve(&config, listen),
        Command::Epp { config } => epp(&config),
        Command::MockEngine(args) => mock_engine::run(&args),
    }
}

/// `serve`: load everything, listen, and route until SIGTERM/SIGINT; SIGHUP reloads.
fn serve(args: &ConfigArgs, listen: Option<std::net::SocketAddr>) -> anyhow::Result<ExitCode> {
    use router_host::serve::{ServeOptions, Server};
    use tokio::signal::unix::{signal, SignalKind};

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("serve")
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let options = ServeOptions {
            config: args.config.clone(),
            plugin_dirs: args.plugin_dirs.clone(),
            listen,
        };
        let server = Server::bind(options).await?;
        let handle = server.handle();
        let mut hangup = signal(SignalKind::hangup()).context("cannot watch SIGHUP")?;
        let mut terminate = signal(SignalKind::terminate()).context("cannot watch SIGTERM")?;
        let mut interrupt = signal(SignalKind::interrupt()).context("cannot watch SIGINT")?;
        eprintln!(
            "router-host serve: listening on http://{} (config {})",
            server.local_addr(),
            args.config.display()
        );
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = hangup.recv() => {
                        // Logged (and counted) by the reload itself, success or not.
                        let _ = handle.reload().await;
                    }
                    _ = terminate.recv() => break,
                    _ = interrupt.recv() => break,
                }
            }
            handle.shutdown();
        });
        server.run().await?;
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// `epp`: load everything, listen (gRPC and the metrics port), and pick until SIGTERM/SIGINT;
/// SIGHUP reloads.
fn epp(args: &ConfigArgs) -> anyhow::Result<ExitCode> {
    use tokio::signal::unix::{signal, SignalKind};

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("epp")
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let options = router_runtime::ServeOptions {
            config: args.config.clone(),
            plugin_dirs: args.plugin_dirs.clone(),
            listen: None,
        };
        let epp = router_epp::Epp::bind(options).await?;
        let addresses = epp.addresses().context("cannot read the bound addresses")?;
        let app = epp.app.clone();
        let mut hangup = signal(SignalKind::hangup()).context("cannot watch SIGHUP")?;
        let mut terminate = signal(SignalKind::terminate()).context("cannot watch SIGTERM")?;
        let mut interrupt = signal(SignalKind::interrupt()).context("cannot watch SIGINT")?;
        eprintln!(
            "router-host epp: ext_proc gRPC on {}, metrics on http://{} (config {})",
            addresses.grpc,
            addresses.metrics,
            args.config.display()
        );
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = hangup.recv() => {
                        // Logged (and counted) by the reload itself, success or not.
                        let _ = app.reload().await;
                    }
                    _ = terminate.recv() => break,
                    _ = interrupt.recv() => break,
                }
            }
            app.stopping.cancel();
        });
        epp.run().await?;
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(ExitCode::SUCCESS)
}

fn load(args: &ConfigArgs) -> anyhow::Result<(RouterConfig, PolicySet)> {
    load_with(args, PolicySetOptions::default())
}

/// `select` and `replay` exit with this status when a policy call hangs (docs/reliability.md): the run has
/// one thread, and it is the one stuck in the plugin.
pub(crate) const EXIT_HUNG: i32 = 3;

fn load_with(
    args: &ConfigArgs,
    options: PolicySetOptions,
) -> anyhow::Result<(RouterConfig, PolicySet)> {
    let config = RouterConfig::from_file(&args.config)?;
    let search = SearchPath::new(args.plugin_dirs.clone(), Some(&args.config));
    let router = PolicySet::from_config_with(&config, &search, options)
        .with_context(|| format!("config {}", args.config.display()))?;
    Ok((config, router))
}

fn check(check: &CheckArgs) -> anyhow::Result<ExitCode> {
    let args = &check.config;
    let (config, router) = load(args)?;
    let store = check_store(&config, check.connect_store)
        .with_context(|| format!("config {}", args.config.display()))?;
    let mut out = Stdout::lock();
    writeln!(out, "config {}: OK", args.config.display())?;
    writeln!(out, "session store: {store}")?;
    writeln!(
        out,
        "booking: prefill {}, decode {}",
        config.booking.prefill, config.booking.decode
    )?;
    writeln!(out, "plugins:")?;
    if router.catalog().libraries().is_empty() {
        writeln!(out, "  (none)")?;
    }
    for lib in router.catalog().libraries() {
        writeln!(
            out,
            "  {} {} (plugin-api {}) at {}",
            printable(&lib.plugin_name),
            printable(&lib.plugin_version),
            printable(&lib.api_version),
            lib.path.display()
        )?;
    }
    writeln!(out, "policy types:")?;
    for (name, origin, doc) in router.catalog().types() {
        let from = router.catalog().origin_name(origin);
        writeln!(out, "  {name} [{from}]: {}", printable(&doc.summary))?;
        for shadow in router.catalog().shadowed() {
            if shadow.type_name == name {
                writeln!(out, "    warning: {shadow}")?;
            }
        }
    }
    writeln!(out, "instances:")?;
    for instance in router.instances() {
        writeln!(
            out,
            "  {} = {} [{}] inputs {}",
            instance.name, instance.type_name, instance.origin, instance.inputs
        )?;
        let doc = router
            .catalog()
            .types()
            .find(|(name, _, _)| *name == instance.type_name)
            .map(|(_, _, doc)| doc);
        for line in resolved_parameters(&instance.parameters_json, doc) {
            writeln!(out, "      {line}")?;
        }
    }
    writeln!(out, "roles:")?;
    for role in router_host::model::RequestRole::ALL {
        let instance = router.instance(router.instance_for(role));
        writeln!(
            out,
            "  {} -> {} ({})",
            role.as_str(),
            instance.name,
            instance.type_name
        )?;
    }
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}

/// What `check` says of the session store; with `connect`, after reaching it.
fn check_store(config: &RouterConfig, connect: bool) -> anyhow::Result<String> {
    use router_host::config::{redact_url, SessionStoreConfig};
    match &config.session_store {
        SessionStoreConfig::Memory => Ok(if connect {
            "memory (in this process; nothing to connect to)".to_owned()
        } else {
            "memory (in this process)".to_owned()
        }),
        SessionStoreConfig::Redis(redis) => {
            let what = format!(
                "redis {} (key prefix {:?}, timeout {} ms, on_unavailable {}, lease {} s, {})",
                redact_url(&redis.url),
                redis.key_prefix,
                redis.timeout.as_millis(),
                redis.on_unavailable,
                redis.lease.as_secs(),
                if redis.share_load {
                    format!(
                        "booked load shared every {} ms",
                        redis.load_publish.as_millis()
                    )
                } else {
                    "booked load not shared".to_owned()
                }
            );
            if !connect {
                return Ok(format!("{what}; not connected (add --connect-store)"));
            }
            let reached = router_host::session_store::connect_check(redis)?;
            Ok(format!(
                "{what}; connected: {}, round trip {} us",
                reached.version,
                reached.round_trip.as_micros()
            ))
        }
    }
}

/// `key = value` for every parameter given, then `key = default (default)` for the rest (plugin
/// text escaped with [`printable`]).
fn resolved_parameters(parameters_json: &str, doc: Option<&PolicyTypeDoc>) -> Vec<String> {
    let given: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(parameters_json).unwrap_or_default();
    let mut lines: Vec<String> = given
        .iter()
        .map(|(k, v)| format!("{} = {v}", printable(k)))
        .collect();
    if let Some(doc) = doc {
        for p in &doc.parameters {
            if !given.contains_key(&p.name) {
                let default = if p.default.is_empty() {
                    "(required)".to_string()
                } else {
                    format!("{} (default)", printable(&p.default))
                };
                lines.push(format!("{} = {default}", printable(&p.name)));
            }
        }
    }
    lines
}

fn describe(plugin: &Path, allow_insecure_permissions: bool) -> anyhow::Result<ExitCode> {
    let verify = Verify {
        sha256: None,
        allow_insecure_permissions,
    };
    let library = open_library_with(plugin, verify, PermissionBypass::DescribeFlag)?;
    let mut out = Stdout::lock();
    writeln!(
        out,
        "{} {} (plugin-api {}) at {}",
        printable(&library.plugin_name),
        printable(&library.plugin_version),
        printable(&library.api_version),
        library.path.display()
    )?;
    // What `check` and the host would say about these type names.
    if let Err(refused) = Catalog::check_library(&library) {
        writeln!(
            out,
            "warning: a config that lists this library fails: {refused}"
        )?;
    }
    for shadow in shadowed_types(&library) {
        writeln!(out, "warning: {shadow}")?;
    }
    for doc in &library.types {
        print_type(&mut out, doc)?;
    }
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}

/// One policy type's documentation; every string comes from the plugin and is escaped with
/// [`printable`].
fn print_type(out: &mut impl Write, doc: &PolicyTypeDoc) -> std::io::Result<()> {
    writeln!(
        out,
        "\npolicy type `{}`: {}",
        printable(&doc.name),
        printable(&doc.summary)
    )?;
    if doc.parameters.is_empty() {
        return writeln!(out, "  parameters: none");
    }
    writeln!(out, "  parameters:")?;
    for p in &doc.parameters {
        let default = if p.default.is_empty() {
            "required".to_string()
        } else {
            format!("default {}", printable(&p.default))
        };
        writeln!(
            out,
            "    {} ({}, {}): {}",
            printable(&p.name),
            printable(&p.type_name),
            default,
            printable(&p.meaning)
        )?;
    }
    Ok(())
}

fn select(args: &ConfigArgs, scenario_file: &Path) -> anyhow::Result<ExitCode> {
    // One thread decides every request: if a policy call hangs, the watchdog ends the process
    // (naming the instance and the call) rather than letting it wait forever.
    let options = PolicySetOptions {
        on_hang: OnHang::Exit { code: EXIT_HUNG },
    };
    let (config, router) = match load_with(args, options) {
        Ok(loaded) => loaded,
        Err(err) => return Ok(unusable(err)),
    };
    let scenario = match Scenario::from_file(scenario_file) {
        Ok(scenario) => scenario,
        Err(err) => return Ok(unusable(err.into())),
    };
    if let Some(block_size) = scenario.block_size {
        if block_size != config.block_size {
            return Ok(unusable(anyhow::anyhow!(
                "scenario {} says block_size {block_size}, but config {} has block_size {}",
                scenario_file.display(),
                args.config.display(),
                config.block_size
            )));
        }
    }
    let mut host = Host::new(router, scenario.cluster.clone(), &config);
    let mut out = Stdout::lock();
    let mut all_routed = true;
    // Each line is written and flushed as soon as its request is decided (stdout may be a pipe),
    // so a run that stops (a hung policy) shows how far it got.
    scenario::run_streaming(&mut host, &scenario, |host, index, outcome| {
        all_routed &= outcome.routed().is_some();
        let line = scenario::outcome_json(host, index, &outcome);
        writeln!(out, "{line}")?;
        out.flush()
    })?;
    Ok(if all_routed {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
