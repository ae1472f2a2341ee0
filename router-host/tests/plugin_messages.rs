//! What `check`, `describe` and the host say about plugin files, checked against the exact text of
//! real runs of the `router-host` binary:
//!
//! 1. an OS error is said once;
//! 2. loader errors name the file the user gave, never the `/proc/self/fd/N` descriptor the
//!    loader opens it through;
//! 3. a permission refusal names the way to skip the check that fits the command (the YAML key
//!    for a config, the flag for `describe`);
//! 4. a sticky shared directory (`/tmp`) is accepted, unless the name in it is a hard link that
//!    someone else could have planted, and a refusal says what to do;
//! 5. a plugin exporting a shipped type name is warned about (log, `check`, `describe`), and one
//!    exporting a built-in's name is refused;
//! 6. text a plugin supplies (name, version, summaries, parameter docs, constructor errors) is
//!    printed escaped.

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use common::{run_cli, temp_dir, write};

/// The fixture crates only these tests load (not in `common::PLUGIN_PACKAGES`).
const FIXTURES: &[&str] = &["fixture-shadow", "fixture-builtin-name"];

/// `lib<name>.so` of one of [`FIXTURES`], built once per test process like `common::plugin_dir`.
fn fixture(name: &str) -> PathBuf {
    static BUILT: OnceLock<()> = OnceLock::new();
    BUILT.get_or_init(|| common::build_packages(FIXTURES));
    common::profile_dir().join(format!("lib{name}.so"))
}

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

/// A fresh 0755 directory for `test`, removed when the guard is dropped.
fn base(test: &str) -> common::TempDir {
    let dir = temp_dir(&format!("plugin-messages-{test}"));
    chmod(&dir, 0o755);
    dir
}

/// `dir/name`, created with `mode`.
fn subdir(dir: &Path, name: &str, mode: u32) -> PathBuf {
    let path = dir.join(name);
    std::fs::create_dir(&path).expect("mkdir");
    chmod(&path, mode);
    path
}

/// A 0644 copy of the probe plugin in `dir`, named `name`.
fn probe_copy(dir: &Path, name: &str) -> PathBuf {
    let copy = dir.join(name);
    std::fs::copy(common::plugin("fixture_probe"), &copy).expect("copy plugin");
    chmod(&copy, 0o644);
    copy
}

fn arg(path: &Path) -> &str {
    path.to_str().expect("UTF-8 test path")
}

/// A config in `dir` listing `plugin` (with `extra` lines for its entry) and `rest` after it.
fn config(dir: &Path, plugin: &Path, extra: &str, rest: &str) -> PathBuf {
    let text = format!("plugins:\n  - path: {}\n{extra}{rest}", plugin.display());
    write(dir, "router.yaml", &text)
}

/// Every line of `text` from the one equal to `from` up to (not including) the one equal to
/// `to`.
fn section<'a>(text: &'a str, from: &str, to: &str) -> Vec<&'a str> {
    text.lines()
        .skip_while(|l| *l != from)
        .take_while(|l| *l != to)
        .collect()
}

/// A log line without its timestamp (`2026-01-01T00:00:00.000000Z  WARN target: ...`).
fn without_timestamp(line: &str) -> &str {
    line.split_once(' ')
        .map_or(line, |(_, rest)| rest.trim_start())
}

/// A built plugin's path as the loader reports it after resolving it (`check` shows that one).
fn canonical(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).expect("canonicalize")
}

/// No control character but the line ends: everything a plugin sent was escaped.
fn assert_no_controls(text: &str) {
    let bad: Vec<char> = text
        .chars()
        .filter(|c| c.is_control() && *c != '\n')
        .collect();
    assert!(bad.is_empty(), "control characters {bad:?} in:\n{text}");
}

// ---- 1. the OS message once ------------------------------------------------------------------

#[test]
fn an_os_error_is_said_once_and_names_the_path() {
    let dir = base("os-error");
    // The config is a directory.
    let (code, out, err) = run_cli(&["check", "--config", arg(&dir)]);
    assert_eq!((code, out.as_str()), (1, ""), "{err}");
    assert_eq!(
        err,
        format!(
            "error: config {}: not a regular file (a directory); give the YAML file itself\n",
            dir.display()
        )
    );
    // A plugin path that is a symlink loop, or goes through a file: the OS says why, once
    // (this used to be `plugin `...` not found; tried: ...`, which hid the reason).
    let looped = dir.join("libloop.so");
    std::os::unix::fs::symlink(&looped, &looped).expect("symlink");
    let (code, _, err) = run_cli(&["describe", arg(&looped)]);
    assert_eq!(code, 1, "{err}");
    assert_eq!(
        err,
        format!(
            "error: plugin file {}: Too many levels of symbolic links (os error 40)\n",
            looped.display()
        )
    );
    let file = write(&dir, "file", "");
    let through_file = file.join("libx.so");
    let cfg = config(&dir, &through_file, "", "");
    let (code, _, err) = run_cli(&["check", "--config", arg(&cfg)]);
    assert_eq!(code, 1, "{err}");
    assert_eq!(
        err,
        format!(
            "error: config {}: plugins[0] (line 2): plugin file {}: Not a directory (os error 20)\n",
            cfg.display(),
            through_file.display()
        )
    );
}

// ---- 2. the real path, not the descriptor ------------------------------------------------------

#[test]
fn a_file_that_is_not_a_shared_object_is_named_by_its_path_not_its_descriptor() {
    let dir = base("not-elf");
    let fake = write(
        &dir,
        "libfake.so",
        &"this is not an ELF shared object, only text. ".repeat(4),
    );
    chmod(&fake, 0o644);
    let (code, out, err) = run_cli(&["describe", arg(&fake)]);
    assert_eq!((code, out.as_str()), (1, ""), "{err}");
    assert_eq!(
        err,
        format!(
            "error: plugin file {}: cannot be loaded: dlopen failed: invalid ELF header\n",
            fake.display()
        )
    );
    let short = write(&dir, "libshort.so", "ELF");
    chmod(&short, 0o644);
    let (_, _, err) = run_cli(&["describe", arg(&short)]);
    assert_eq!(
        err,
        format!(
            "error: plugin file {}: cannot be loaded: dlopen failed: file too short\n",
            short.display()
        )
    );
    // With a `sha256`, what is opened is a sealed in-memory copy (another descriptor); the
    // message still names the configured file.
    let hash = router_host::loader::sha256_hex(&std::fs::File::open(&fake).unwrap()).unwrap();
    let cfg = config(&dir, &fake, &format!("    sha256: {hash}\n"), "");
    let (code, _, err) = run_cli(&["check", "--config", arg(&cfg)]);
    assert_eq!(code, 1, "{err}");
    assert_eq!(
        err,
        format!(
            "error: config {}: plugins[0] (line 2): plugin file {}: cannot be loaded: dlopen \
             failed: invalid ELF header\n",
            cfg.display(),
            fake.display()
        )
    );
    assert!(!err.contains("/proc/self/fd"), "{err}");
}

// ---- 3. the remedy that fits the command -----------------------------------------------------

#[test]
fn a_permission_refusal_gives_the_remedy_of_the_command_that_loads_the_file() {
    let dir = base("remedy");
    let shared = subdir(&dir, "shared", 0o775);
    let plugin = probe_copy(&shared, "libprobe.so");
    let uid = std::fs::metadata(&shared).unwrap().uid();
    let problem = format!(
        "plugin file {}: refusing to load: its directory ({}) is writable by group or others \
         (mode 775) and owned by uid {uid}; fix: `chmod go-w {}`, or move the plugin to a \
         directory only you (and root) can write (a directory others can write is accepted only \
         if it is sticky, mode 1777 like /tmp: see docs/reliability.md, Plugin file checks)",
        plugin.display(),
        shared.display(),
        shared.display()
    );

    let (code, out, err) = run_cli(&["describe", arg(&plugin)]);
    assert_eq!((code, out.as_str()), (1, ""), "{err}");
    assert_eq!(
        err,
        format!(
            "error: {problem}; or skip these checks with `--allow-insecure-permissions` for \
             `router-host describe`\n"
        )
    );
    assert!(!err.contains("allow_insecure_permissions"), "{err}");

    let cfg = config(&dir, &plugin, "", "");
    let (code, _, err) = run_cli(&["check", "--config", arg(&cfg)]);
    assert_eq!(code, 1, "{err}");
    assert_eq!(
        err,
        format!(
            "error: config {}: plugins[0] (line 2): {problem}; or set \
             `allow_insecure_permissions: true` on this plugin to skip these checks\n",
            cfg.display()
        )
    );
    assert!(!err.contains("--allow-insecure-permissions"), "{err}");

    // Each remedy works.
    let (code, _, err) = run_cli(&["describe", "--allow-insecure-permissions", arg(&plugin)]);
    assert_eq!(code, 0, "{err}");
    let cfg = config(&dir, &plugin, "    allow_insecure_permissions: true\n", "");
    let (code, _, err) = run_cli(&["check", "--config", arg(&cfg)]);
    assert_eq!(code, 0, "{err}");
}

// ---- 4. sticky directories -------------------------------------------------------------------

#[test]
fn a_plugin_in_a_sticky_directory_loads_unless_its_name_is_a_hard_link() {
    let dir = base("sticky");
    // Like /tmp: mode 1777.
    let sticky = subdir(&dir, "sticky", 0o1777);
    let plugin = probe_copy(&sticky, "libprobe.so");
    let (code, out, err) = run_cli(&["describe", arg(&plugin)]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        out.lines().next(),
        Some(
            format!(
                "fixture-probe 0.1.0 (plugin-api {}) at {}",
                plugin_api::API_VERSION,
                plugin.display()
            )
            .as_str()
        )
    );

    // A second name for the same file: anyone could have made such a link to a file of ours or
    // root's, before we put ours there.
    let linked = sticky.join("liblinked.so");
    std::fs::hard_link(&plugin, &linked).expect("hard link");
    let (code, out, err) = run_cli(&["describe", arg(&linked)]);
    assert_eq!((code, out.as_str()), (1, ""), "{err}");
    assert_eq!(
        err,
        format!(
            "error: plugin file {}: refusing to load: the file ({}) has 2 hard links and is in \
             {}, a sticky directory that others can write (mode 1777): anyone who can write \
             there could have made that name a hard link to a file of yours or root's; fix: \
             move the plugin to a directory only you (and root) can write, or give it a copy of \
             its own there (`cp`, not `ln`); or skip these checks with \
             `--allow-insecure-permissions` for `router-host describe`\n",
            linked.display(),
            linked.display(),
            sticky.display()
        )
    );
    // The same file reached through its other name is just as suspect now.
    let (code, _, err) = run_cli(&["describe", arg(&plugin)]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("has 2 hard links"), "{err}");
    // A link outside the shared directory is fine (cargo's own output is hard-linked).
    let private = subdir(&dir, "private", 0o755);
    std::fs::remove_file(&linked).unwrap();
    std::fs::hard_link(&plugin, private.join("libprobe.so")).expect("hard link");
    let (code, _, err) = run_cli(&["describe", arg(&private.join("libprobe.so"))]);
    assert_eq!(code, 0, "{err}");
}

// ---- 5. shipped and built-in names -------------------------------------------------------------

/// The warning every output gives for the shadow fixture at `path`.
fn shadow_warning(path: &Path) -> String {
    format!(
        "policy type `dynamo-two-tier-cost-fn` from {} (plugin `fixture-shadow`) shadows the \
         shipped policy of that name (plugin `two-tier-cost-fn`): instances of type \
         `dynamo-two-tier-cost-fn` run this library's code, not the shipped policy; rename the \
         type in the plugin unless it is meant to replace the shipped one",
        path.display()
    )
}

/// The shadow fixture's summary, escaped.
const SHADOW_SUMMARY: &str = "Not the shipped one\\u{1b}[2J\\u{1b}[31m red\\r\\nsecond \
    line\\ttab \\u{202e}txt.so caf\u{e9} e\u{301} \"q\" \\";

#[test]
fn check_warns_about_a_plugin_that_shadows_the_shipped_type_and_escapes_its_text() {
    let dir = base("shadow-check");
    let library = fixture("fixture_shadow");
    let cfg = config(
        &dir,
        &library,
        "",
        "worker_selection:\n  aggregated: s\n  instances:\n    - {name: s, type: dynamo-two-tier-cost-fn}\n",
    );
    let (code, out, err) = run_cli(&["check", "--config", arg(&cfg)]);
    assert_eq!(code, 0, "{err}");
    let real = canonical(&library);
    assert_eq!(
        section(&out, "plugins:", "instances:"),
        [
            "plugins:".to_string(),
            format!(
                "  fixture-shadow 0.1.0\\u{{7}} (plugin-api {}) at {}",
                plugin_api::API_VERSION,
                real.display()
            ),
            "policy types:".to_string(),
            "  default [built-in]: Lowest prefill+decode cost after cache credit; \
             narrows to an eligible soft target"
                .to_string(),
            format!(
                "  dynamo-two-tier-cost-fn [{}]: {SHADOW_SUMMARY}",
                real.display()
            ),
            format!("    warning: {}", shadow_warning(&real)),
            "  random [built-in]: Cache-blind baseline: a seeded pseudo-random eligible row"
                .to_string(),
            "  round-robin [built-in]: Cache-blind baseline: cycles through the eligible rows"
                .to_string(),
        ]
    );
    let instance = format!(
        "  s = dynamo-two-tier-cost-fn [{}] inputs NONE",
        real.display()
    );
    assert_eq!(
        section(&out, &instance, "roles:"),
        [
            instance.as_str(),
            "      weight\\u{1b}[0m = 1.0\\u{1b}]0;title\\u{7} (default)",
        ]
    );
    assert_no_controls(&out);
    // The warning at load, in the log (stderr), naming the path and the type.
    let logged: Vec<&str> = err.lines().map(without_timestamp).collect();
    assert_eq!(
        logged,
        [format!(
            "WARN router_policies::catalog: {} path={} type_name=dynamo-two-tier-cost-fn",
            shadow_warning(&real),
            real.display()
        )],
        "{err}"
    );
}

#[test]
fn describe_warns_about_a_shipped_type_name_and_escapes_every_plugin_string() {
    let library = fixture("fixture_shadow");
    let (code, out, err) = run_cli(&["describe", arg(&library)]);
    assert_eq!((code, err.as_str()), (0, ""), "{out}");
    assert_eq!(
        out,
        format!(
            "fixture-shadow 0.1.0\\u{{7}} (plugin-api {}) at {}\n\
             warning: {}\n\
             \n\
             policy type `dynamo-two-tier-cost-fn`: {SHADOW_SUMMARY}\n  \
             parameters:\n    \
             weight\\u{{1b}}[0m (f64\\u{{7}}, default 1.0\\u{{1b}}]0;title\\u{{7}}): \
             meaning\\nwith \\u{{9b}}31m C1 CSI and \\u{{7f}} DEL\n",
            plugin_api::API_VERSION,
            library.display(),
            shadow_warning(&library)
        )
    );
    assert_no_controls(&out);
}

#[test]
fn the_shipped_plugin_itself_is_not_warned_about() {
    let dir = base("shipped");
    let library = common::plugin("two_tier_cost_fn");
    let cfg = config(&dir, &library, "", "");
    let (code, out, err) = run_cli(&["check", "--config", arg(&cfg)]);
    assert_eq!((code, err.as_str()), (0, ""), "{out}");
    assert!(!out.contains("warning"), "{out}");
    let (code, out, err) = run_cli(&["describe", arg(&library)]);
    assert_eq!((code, err.as_str()), (0, ""), "{out}");
    assert!(!out.contains("warning"), "{out}");
}

#[test]
fn a_plugin_exporting_a_built_in_type_name_is_refused_and_describe_says_so() {
    let dir = base("builtin-name");
    let library = fixture("fixture_builtin_name");
    let cfg = config(&dir, &library, "", "");
    let refusal = |path: &Path| {
        format!(
            "library {} exports policy type `default`, which is the name of a built-in policy \
             type (built-ins: `default`, `round-robin`, `random`); a plugin cannot replace a \
             built-in, so the library is refused: rename the type in the plugin",
            path.display()
        )
    };
    let (code, out, err) = run_cli(&["check", "--config", arg(&cfg)]);
    assert_eq!((code, out.as_str()), (1, ""), "{err}");
    assert_eq!(
        err,
        format!(
            "error: config {}: {}\n",
            cfg.display(),
            refusal(&canonical(&library))
        )
    );
    let (code, out, err) = run_cli(&["describe", arg(&library)]);
    assert_eq!((code, err.as_str()), (0, ""), "{out}");
    assert_eq!(
        out,
        format!(
            "fixture-builtin-name 0.1.0 (plugin-api {}) at {}\n\
             warning: a config that lists this library fails: {}\n\
             \n\
             policy type `default`: Test fixture: always the first row, under the built-in's \
             name\n  \
             parameters: none\n",
            plugin_api::API_VERSION,
            library.display(),
            refusal(&library)
        )
    );
}

// ---- 6. plugin text in errors --------------------------------------------------------------

#[test]
fn a_constructor_error_is_printed_escaped() {
    let dir = base("create-error");
    let library = fixture("fixture_shadow");
    let cfg = config(
        &dir,
        &library,
        "",
        "worker_selection:\n  instances:\n    - {name: s, type: dynamo-two-tier-cost-fn, parameters: {reject: 1}}\n",
    );
    let (code, out, err) = run_cli(&["check", "--config", arg(&cfg)]);
    assert_eq!((code, out.as_str()), (1, ""), "{err}");
    let real = canonical(&library);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 2, "{err}");
    // First the load warning, then the error.
    assert!(
        lines[0].contains("WARN router_policies::catalog: "),
        "{err}"
    );
    assert_eq!(
        lines[1],
        format!(
            "error: config {}: instance `s` (type `dynamo-two-tier-cost-fn`, from {}): \
             parameter `reject\\u{{1b}}[1m`: bad\\u{{1b}}[2J value\\nsecond line",
            cfg.display(),
            real.display()
        )
    );
    assert_no_controls(&err);
}
