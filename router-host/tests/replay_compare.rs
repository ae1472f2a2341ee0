//! `router-host replay` comparing an author's own config with the built-in ones in one command,
//! run from a directory outside the checkout with only the binary, the author's `.so` and YAML:
//! `-c mine.yaml --with-builtin`, `-c builtin:NAME`, and the errors for a bad name, a config
//! given twice, a missing file named like a built-in, and a built-in whose plugin is missing.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{plugin, plugin_dir, profile_dir, router_host_bin, temp_dir, write, TempDir};

/// A small generated workload: every config replays it in well under a second.
const SMALL: &[&str] = &["--sessions", "20", "--turns", "3"];

/// The built-in configs in the order `--with-builtin` (and `replay` without `-c`) adds them.
const DEFAULT_BUILTINS: [&str; 4] = ["default", "two-tier", "two-tier-sticky", "round-robin"];

/// Run `bin replay ARGS SMALL` in `dir`; returns (exit code, stdout, stderr).
fn replay_in(dir: &Path, bin: &Path, args: &[&str]) -> (i32, String, String) {
    let args: Vec<&str> = ["replay"]
        .iter()
        .chain(args)
        .chain(SMALL)
        .copied()
        .collect();
    common::run_bin_in(bin, &args, Some(dir))
}

/// A scratch directory outside the checkout holding what an author has: their plugin (the
/// example `soft-pin-repin`, copied out of `target/`) and `mine.yaml`, which names it by `name:`
/// (found next to the YAML).
fn author_dir(test: &str) -> TempDir {
    let dir = temp_dir(test);
    let checkout = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .canonicalize()
        .expect("workspace root");
    let real = dir.canonicalize().expect("temp dir");
    assert!(
        !real.starts_with(&checkout),
        "{} is inside the checkout {}",
        real.display(),
        checkout.display()
    );
    std::fs::copy(plugin("soft_pin_repin"), dir.join("libsoft_pin_repin.so"))
        .expect("copy the author's plugin");
    write(
        &dir,
        "mine.yaml",
        "plugins:\n  - name: soft_pin_repin\nworker_selection:\n  aggregated: repin\n  instances:\n    - name: repin\n      type: soft-pin-repin\n      parameters: {max_active_requests: 4}\nsession_affinity: {mode: soft, ttl_secs: 600}\n",
    );
    dir
}

/// The table's column names: the line above `policy (aggregated)`.
fn columns(table: &str) -> Vec<&str> {
    let lines: Vec<&str> = table.lines().collect();
    let at = lines
        .iter()
        .position(|l| l.starts_with("policy (aggregated)"))
        .unwrap_or_else(|| panic!("no policy row in:\n{table}"));
    assert!(at > 0, "no header above the policy row:\n{table}");
    lines[at - 1].split_whitespace().collect()
}

/// The cells of the row whose label is `label`.
fn row<'a>(table: &'a str, label: &str) -> Vec<&'a str> {
    let line = table
        .lines()
        .find(|l| l.starts_with(label))
        .unwrap_or_else(|| panic!("no `{label}` row in:\n{table}"));
    line[label.len()..].split_whitespace().collect()
}

#[test]
fn own_config_with_builtin_runs_against_the_shipped_configs_from_outside_the_checkout() {
    plugin_dir();
    let dir = author_dir("compare-with-builtin");
    let (code, out, err) = replay_in(
        &dir,
        &router_host_bin(),
        &["-c", "mine.yaml", "--with-builtin", "--json", "report.json"],
    );
    assert_eq!(code, 0, "stderr: {err}\nstdout: {out}");
    assert_eq!(
        columns(&out),
        [
            "default",
            "two-tier",
            "two-tier-sticky",
            "round-robin",
            "mine"
        ]
    );
    // Each column really ran its own policy: the instance names of the shipped configs, then
    // the author's.
    assert_eq!(
        row(&out, "policy (aggregated)"),
        ["default", "two-tier", "sticky-two-tier", "rr", "repin"]
    );
    assert_eq!(row(&out, "errors"), ["0"; 5]);
    // The author's config has soft session affinity on, the plain built-ins have not.
    let sessions = row(&out, "sessions kept/moved/new");
    assert_eq!(sessions[0], "off");
    assert_ne!(sessions[4], "off", "{out}");

    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).unwrap()).unwrap();
    let labels: Vec<&str> = json["configs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["config"].as_str().unwrap())
        .collect();
    assert_eq!(
        labels,
        [
            "examples/replay/default.yaml",
            "examples/replay/two-tier.yaml",
            "examples/replay/two-tier-sticky.yaml",
            "examples/replay/round-robin.yaml",
            "mine.yaml",
        ]
    );
    let requests = json["workload"]["requests"].as_u64().unwrap();
    assert!(requests > 0);
    for c in json["configs"].as_array().unwrap() {
        assert_eq!(c["requests_routed"].as_u64(), Some(requests), "{c}");
    }
}

/// The "column settings" section under the table: per column, its header line (`NAME: SOURCE`)
/// and its lines.
fn column_settings(table: &str) -> Vec<(String, String, Vec<String>)> {
    let mut columns: Vec<(String, String, Vec<String>)> = Vec::new();
    let mut inside = false;
    for line in table.lines() {
        if line.starts_with("column settings") {
            inside = true;
            continue;
        }
        if !inside {
            continue;
        }
        if let Some(setting) = line.strip_prefix("    ") {
            columns
                .last_mut()
                .expect("a column header first")
                .2
                .push(setting.to_owned());
        } else if let Some(header) = line.strip_prefix("  ") {
            let (name, source) = header.split_once(": ").expect("NAME: SOURCE");
            columns.push((name.to_owned(), source.to_owned(), Vec::new()));
        } else {
            break;
        }
    }
    columns
}

/// What a column measured, without what says where it came from or how long decisions took.
fn outcome(config: &serde_json::Value) -> serde_json::Value {
    let mut config = config.clone();
    let map = config.as_object_mut().expect("a config object");
    // `block_size_replaced` says the source file's own block size differed from the workload's.
    for key in ["config", "decision_ns", "block_size_replaced"] {
        map.remove(key);
    }
    map.get_mut("settings")
        .and_then(|s| s.as_object_mut())
        .expect("settings")
        .remove("source");
    config
}

#[test]
fn every_column_prints_a_config_that_replays_exactly_as_the_column() {
    plugin_dir();
    let dir = author_dir("column-settings");
    let (code, out, err) = replay_in(
        &dir,
        &router_host_bin(),
        &[
            "--with-builtin",
            "-c",
            "mine.yaml",
            "-c",
            "builtin:two-tier-admission",
            "--json",
            "report.json",
        ],
    );
    assert_eq!(code, 0, "stderr: {err}\nstdout: {out}");
    let printed = column_settings(&out);
    let names: Vec<&str> = printed.iter().map(|c| c.0.as_str()).collect();
    assert_eq!(names, columns(&out));
    let sources: Vec<&str> = printed.iter().map(|c| c.1.as_str()).collect();
    assert_eq!(
        sources,
        [
            "builtin:default",
            "builtin:two-tier",
            "builtin:two-tier-sticky",
            "builtin:round-robin",
            "mine.yaml",
            "builtin:two-tier-admission",
        ]
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).unwrap()).unwrap();
    let configs = report["configs"].as_array().unwrap();
    // The default column names the host's defaults, which a bare config gets.
    assert!(
        printed[0]
            .2
            .contains(&"booking: {prefill: uncached, decode: prompt}".to_owned()),
        "{:?}",
        printed[0].2
    );
    assert!(printed[0].2.contains(
        &"default_selector: {prefill_load_scale: 20.0, decode_active_request_weight: 0.0, overlap_credit: 1.5, tie_break: spread, room: free, live_eviction_weight: 0.25}"
            .to_owned()
    ));
    // Each column's lines, as a file of their own, replay to the very same outcome and settings.
    for (i, (name, source, lines)) in printed.iter().enumerate() {
        assert_eq!(configs[i]["settings"]["source"], source.as_str());
        let file = format!("column-{i}.yaml");
        write(&dir, &file, &(lines.join("\n") + "\n"));
        let json = format!("column-{i}.json");
        let (code, again, err) =
            replay_in(&dir, &router_host_bin(), &["-c", &file, "--json", &json]);
        assert_eq!(code, 0, "{name}: {err}\n{again}");
        let rerun: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(&json)).unwrap()).unwrap();
        assert_eq!(rerun["configs"][0]["settings"]["source"], file.as_str());
        assert_eq!(
            outcome(&rerun["configs"][0]),
            outcome(&configs[i]),
            "{name} ({source}) from its printed settings:\n{}",
            lines.join("\n")
        );
    }
}

#[test]
fn builtin_names_choose_configs_in_the_order_given() {
    plugin_dir();
    let dir = author_dir("compare-builtin-names");
    let (code, out, err) = replay_in(
        &dir,
        &router_host_bin(),
        &[
            "-c",
            "builtin:round-robin",
            "-c",
            "mine.yaml",
            "-c",
            "builtin:random",
            "-c",
            "builtin:two-tier-admission",
        ],
    );
    assert_eq!(code, 0, "stderr: {err}\nstdout: {out}");
    assert_eq!(
        columns(&out),
        ["round-robin", "mine", "random", "two-tier-admission"]
    );
    assert_eq!(
        row(&out, "policy (aggregated)"),
        ["rr", "repin", "random", "two-tier"]
    );
}

#[test]
fn an_unknown_builtin_name_is_refused_with_the_list_of_names() {
    let dir = temp_dir("compare-unknown-builtin");
    let (code, out, err) = replay_in(&dir, &router_host_bin(), &["-c", "builtin:two_tier"]);
    assert_eq!(code, 1, "stdout: {out}");
    assert_eq!(out, "");
    assert_eq!(
        err,
        "error: --config builtin:two_tier: no built-in config named `two_tier`; the built-in \
         configs are default, two-tier, two-tier-sticky, round-robin, random, two-tier-admission \
         (give a file named `builtin:...` as ./builtin:...)\n"
    );
}

#[test]
fn a_builtin_given_twice_is_refused() {
    let dir = temp_dir("compare-builtin-twice");
    let bin = router_host_bin();
    let (code, out, err) = replay_in(&dir, &bin, &["--with-builtin", "-c", "builtin:two-tier"]);
    assert_eq!((code, out.as_str()), (1, ""), "{err}");
    assert_eq!(
        err,
        "error: --config builtin:two-tier: --with-builtin already adds it (it adds default, \
         two-tier, two-tier-sticky, round-robin); give each config once\n"
    );
    let (code, _, err) = replay_in(
        &dir,
        &bin,
        &["-c", "builtin:random", "-c", "builtin:random"],
    );
    assert_eq!(code, 1, "{err}");
    assert_eq!(
        err,
        "error: --config builtin:random is given twice; give each config once\n"
    );
}

#[test]
fn a_missing_file_named_like_a_builtin_points_at_it() {
    let dir = temp_dir("compare-missing-file");
    let (code, out, err) = replay_in(
        &dir,
        &router_host_bin(),
        &["-c", "examples/replay/two-tier.yaml"],
    );
    assert_eq!((code, out.as_str()), (1, ""), "{err}");
    assert_eq!(
        err,
        "error: config examples/replay/two-tier.yaml: cannot read the file: No such file or \
         directory (os error 2); `two-tier` is also a built-in config: `-c builtin:two-tier` runs \
         it from any directory\n"
    );
}

#[test]
fn a_broken_own_config_after_the_builtins_fails_naming_it() {
    let dir = author_dir("compare-broken-own");
    write(
        &dir,
        "typo.yaml",
        "worker_selection:\n  aggregated: mine\n  instances:\n    - {name: mine, type: soft-pin-repinn}\n",
    );
    let (code, out, err) = replay_in(
        &dir,
        &router_host_bin(),
        &["--with-builtin", "-c", "typo.yaml"],
    );
    assert_eq!((code, out.as_str()), (1, ""), "{err}");
    assert!(
        err.starts_with(
            "error: config typo.yaml: instance `mine`: unknown policy type `soft-pin-repinn`; \
             known types: default, random, round-robin"
        ),
        "{err}"
    );
    assert!(!err.contains("replayed"), "{err}");
}

#[test]
fn a_lone_binary_runs_plugin_free_builtins_and_says_what_to_pass_for_the_shipped_plugin() {
    let plugins = plugin_dir();
    let dir = temp_dir("compare-lone-binary");
    let bin_dir = dir.join("bin");
    std::fs::create_dir_all(&bin_dir).unwrap();
    let lone = bin_dir.join("router-host");
    std::fs::copy(router_host_bin(), &lone).expect("copy router-host");

    // The built-ins without a plugin need nothing but the binary.
    let (code, out, err) = replay_in(
        &dir,
        &lone,
        &["-c", "builtin:default", "-c", "builtin:round-robin"],
    );
    assert_eq!(code, 0, "stderr: {err}\nstdout: {out}");
    assert_eq!(columns(&out), ["default", "round-robin"]);

    // builtin:two-tier needs libtwo_tier_cost_fn.so, which is not next to this copy.
    let (code, out, err) = replay_in(&dir, &lone, &["-c", "builtin:two-tier"]);
    assert_eq!((code, out.as_str()), (1, ""), "{err}");
    let tried = bin_dir.join("libtwo_tier_cost_fn.so");
    let expected = format!(
        "error: config builtin:two-tier: plugins[0] (line 6): plugin `two_tier_cost_fn` not \
         found; tried: {}; builtin:two-tier needs libtwo_tier_cost_fn.so, the plugin shipped with \
         router-host (`cargo build --release` in the router repository builds it into \
         target/release, next to router-host): pass --plugin-dir with the directory that holds it (",
        tried.display()
    );
    assert!(err.starts_with(&expected), "{err}");
    assert!(
        err.ends_with(&format!("), or copy it next to {}\n", lone.display())),
        "{err}"
    );
    // The hint names this checkout's build directory when the plugin is there (the usual case),
    // a placeholder otherwise.
    let checkout_target: PathBuf = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target");
    let built_here = checkout_target.canonicalize().ok() == profile_dir().parent().map(Into::into);
    if built_here {
        let profile = profile_dir().file_name().unwrap().to_owned();
        let suggested = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .unwrap()
            .join("target")
            .join(profile);
        assert!(
            err.contains(&format!(
                "(--plugin-dir {} holds one, in the checkout this router-host was built from)",
                suggested.display()
            )),
            "{err}"
        );
    }

    // Passing what the message asks for works.
    let (code, out, err) = replay_in(
        &dir,
        &lone,
        &[
            "--plugin-dir",
            plugins.to_str().unwrap(),
            "-c",
            "builtin:two-tier",
        ],
    );
    assert_eq!(code, 0, "stderr: {err}\nstdout: {out}");
    assert_eq!(columns(&out), ["two-tier"]);
    assert_eq!(row(&out, "policy (aggregated)"), ["two-tier"]);
}

#[test]
fn help_lists_the_builtin_configs_and_with_builtin() {
    let out = Command::new(router_host_bin())
        .args(["replay", "--help"])
        .output()
        .expect("run router-host");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("--config <FILE|builtin:NAME>"), "{help}");
    assert!(help.contains("--with-builtin"), "{help}");
    let words: Vec<&str> = help
        .split(|c: char| c.is_whitespace() || matches!(c, ',' | '(' | ')' | '.'))
        .collect();
    for name in DEFAULT_BUILTINS
        .iter()
        .chain(&["random", "two-tier-admission"])
    {
        assert!(words.contains(name), "`{name}` not in:\n{help}");
    }
    // --with-builtin says which configs it adds.
    for name in DEFAULT_BUILTINS {
        assert!(help.contains(&format!("builtin:{name}")), "{help}");
    }
}
