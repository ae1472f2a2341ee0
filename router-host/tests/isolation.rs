//! Plugin isolation: failing, panicking, slow and hostile plugins never take the host down, and
//! files that fail the supply-chain checks never run. One test per failure mode of
//! `docs/reliability.md`.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use router_host::config::RouterConfig;
use router_host::loader::SearchPath;
use router_host::model::{Cluster, NoSignals, Request, RowId, Worker};
use router_host::policy_set::{PolicyFailure, PolicySet, Scratch, Selection, StartupError};

/// The fallback breaks ties on the lowest row ([`LOWEST`] on the idle rows below), as it did
/// before `spread` became the default.
fn config_with(plugins: &[PathBuf], instances: &str) -> RouterConfig {
    let mut yaml = String::from("default_selector: {tie_break: lowest_row}\nplugins:\n");
    for p in plugins {
        yaml.push_str(&format!("  - path: {}\n", p.display()));
    }
    yaml.push_str("worker_selection:\n  aggregated: x\n  instances:\n");
    yaml.push_str(instances);
    RouterConfig::from_yaml_str(&yaml, None).expect("valid config")
}

fn start(plugins: &[PathBuf], instances: &str) -> Result<PolicySet, StartupError> {
    PolicySet::from_config(&config_with(plugins, instances), &SearchPath::default())
}

fn faulty(instance: &str) -> Result<PolicySet, StartupError> {
    start(&[common::plugin("fixture_faulty")], instance)
}

/// The full error chain, as the CLI prints it.
fn chain(err: &StartupError) -> String {
    let mut text = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn cluster() -> Cluster {
    // Worker 7 is listed first in no particular way; the default selector picks the lowest row.
    Cluster::new(vec![Worker::new(9), Worker::new(7)]).unwrap()
}

fn pick(router: &PolicySet) -> Result<router_host::policy_set::Decision, String> {
    router
        .select(
            &cluster(),
            Selection::of(&Request {
                isl_tokens: 64,
                ..Default::default()
            }),
            &NoSignals,
            &mut Scratch::default(),
        )
        .map_err(|e| e.to_string())
}

const LOWEST: RowId = RowId {
    worker_id: 7,
    dp_rank: 0,
};
const FIRST_ROW: RowId = LOWEST;

#[test]
fn a_failing_constructor_stops_startup_naming_instance_type_and_plugin() {
    let err = faulty("    - {name: x, type: fails-in-create}\n")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("instance `x` (type `fails-in-create`, from "),
        "{err}"
    );
    assert!(
        err.contains("libfixture_faulty.so): constructor failed: backing store unreachable"),
        "{err}"
    );
}

#[test]
fn a_panicking_constructor_stops_startup_without_aborting() {
    let err = faulty("    - {name: x, type: panics-in-create}\n")
        .unwrap_err()
        .to_string();
    assert!(
        err.ends_with(
            "libfixture_faulty.so): constructor panicked: constructor exploded on purpose"
        ),
        "{err}"
    );
}

#[test]
fn invalid_parameters_fail_at_startup_naming_instance_type_and_key() {
    let err = faulty("    - {name: x, type: slow-pick, parameters: {sleep_ms: 1}}\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("instance `x` (type `slow-pick`"), "{err}");
    assert!(
        err.contains("parameter `sleep_ms`: unknown field `sleep_ms`"),
        "{err}"
    );
    let err = faulty("    - {name: x, type: slow-pick}\n")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("parameter `sleep_us`: missing field `sleep_us`"),
        "{err}"
    );
}

#[test]
fn a_panic_in_pick_falls_back_poisons_the_instance_and_is_counted() {
    let router = faulty("    - {name: x, type: panics-in-pick, parameters: {after: 1}}\n").unwrap();
    let instance = router
        .instances()
        .iter()
        .position(|i| i.name == "x")
        .unwrap();
    // First call is fine and the plugin's answer (row 0 of its view) is used.
    let d = pick(&router).unwrap();
    assert_eq!((d.row, d.fallback.clone()), (FIRST_ROW, None));
    // Second call panics inside the plugin: contained, and the default decides.
    let d = pick(&router).unwrap();
    assert_eq!(d.row, LOWEST);
    assert_eq!(
        d.fallback,
        Some(PolicyFailure::Panicked("pick exploded on purpose".into()))
    );
    assert!(router.instance(instance).is_poisoned());
    // Poisoned: the plugin is not called again; requests keep being served by the fallback.
    let d = pick(&router).unwrap();
    assert_eq!(d.fallback, Some(PolicyFailure::Poisoned));
    let stats = router.instance(instance).stats.snapshot();
    assert_eq!(
        (stats.picks, stats.panics, stats.errors, stats.fallbacks),
        (2, 1, 2, 2),
        "{stats:?}"
    );
}

#[test]
fn a_panic_in_pick_with_on_error_fail_is_an_error_not_an_abort() {
    let router = faulty("    - {name: x, type: panics-in-pick, on_error: fail}\n").unwrap();
    let err = pick(&router).unwrap_err();
    assert!(
        err.contains("instance `x` (")
            && err.contains("policy panicked: pick exploded on purpose; the instance is poisoned"),
        "{err}"
    );
    let err = pick(&router).unwrap_err();
    assert!(
        err.contains("policy is poisoned after an earlier panic"),
        "{err}"
    );
}

#[test]
fn an_error_from_pick_gets_the_fallback_and_is_counted() {
    let router = faulty("    - {name: x, type: errors-in-pick}\n").unwrap();
    let d = pick(&router).unwrap();
    assert_eq!(d.row, LOWEST);
    assert_eq!(
        d.fallback,
        Some(PolicyFailure::Failed("no good row today".into()))
    );
    let x = router.instances().iter().find(|i| i.name == "x").unwrap();
    assert!(!x.is_poisoned(), "an error is not a panic");
    let stats = x.stats.snapshot();
    assert_eq!((stats.errors, stats.fallbacks, stats.panics), (1, 1, 0));
}

#[test]
fn repeatedly_slow_picks_quarantine_the_instance_to_its_fallback() {
    let router = faulty(
        "    - {name: x, type: slow-pick, parameters: {sleep_us: 3000}, pick_budget_us: 1000, quarantine_after: 2}\n",
    )
    .unwrap();
    let x = router
        .instances()
        .iter()
        .position(|i| i.name == "x")
        .unwrap();
    // Slow answers are still answers; the streak is counted.
    for _ in 0..2 {
        let d = pick(&router).unwrap();
        assert_eq!(d.fallback, None);
        assert!(d.pick_ns >= 3_000_000, "pick took {} ns", d.pick_ns);
    }
    assert!(router.instance(x).is_quarantined());
    let d = pick(&router).unwrap();
    assert_eq!(d.fallback, Some(PolicyFailure::Quarantined));
    assert_eq!(d.row, LOWEST);
    let stats = router.instance(x).stats.snapshot();
    assert_eq!((stats.picks, stats.slow_picks, stats.fallbacks), (2, 2, 1));
}

/// `serve` asks for an explanation on every request, so `explain` is held to the instance's
/// budget with `pick`: a slow one is counted, quarantines the instance after the streak (logged
/// once), and later decisions go to the fallback without calling the slow code.
#[test]
fn repeatedly_slow_explains_quarantine_the_instance_to_its_fallback() {
    // 50 ms per explain against a 1 ms budget: far apart on any machine.
    let router = faulty(
        "    - {name: x, type: slow-explain, parameters: {sleep_us: 50000}, pick_budget_us: 1000, quarantine_after: 3}\n",
    )
    .unwrap();
    let x = position(&router, "x");
    let explained = |router: &PolicySet| {
        router
            .select(
                &cluster(),
                Selection::of(&Request {
                    isl_tokens: 64,
                    ..Default::default()
                })
                .explained(),
                &NoSignals,
                &mut Scratch::default(),
            )
            .unwrap()
    };
    // Without an explanation asked for, the same instance is fast: no breach.
    let d = pick(&router).unwrap();
    assert_eq!(d.fallback, None);
    assert_eq!(router.instance(x).stats.snapshot().slow_explains, 0);
    let (_, logs) = plugin_api::testing::capture_logs(|| {
        for _ in 0..3 {
            let d = explained(&router);
            // A slow explanation is still used.
            assert_eq!(d.fallback, None);
            assert_eq!(
                d.explanation.as_ref().map(|e| e.reason.as_str()),
                Some("slow")
            );
        }
    });
    assert!(router.instance(x).is_quarantined());
    let stats = router.instance(x).stats.snapshot();
    assert_eq!((stats.slow_picks, stats.slow_explains), (0, 3), "{stats:?}");
    let quarantined: Vec<_> = errors_naming_x(&logs)
        .into_iter()
        .filter(|l| l.contains("quarantined after 3 consecutive decisions (pick + explain)"))
        .collect();
    assert_eq!(quarantined.len(), 1, "{logs:#?}");
    assert!(
        quarantined[0].contains("last_explain_us="),
        "{}",
        quarantined[0]
    );
    let reason = router.instance(x).state_reason().unwrap();
    assert!(
        reason.contains("3 consecutive decisions over pick_budget_us 1000"),
        "{reason}"
    );
    // From now on: the fallback, without entering the slow explain.
    for _ in 0..5 {
        let started = std::time::Instant::now();
        let d = explained(&router);
        assert!(
            started.elapsed() < std::time::Duration::from_millis(25),
            "a quarantined instance's explain is not called: {:?}",
            started.elapsed()
        );
        assert_eq!(d.fallback, Some(PolicyFailure::Quarantined));
        assert_eq!(d.row, LOWEST);
    }
    let stats = router.instance(x).stats.snapshot();
    assert_eq!((stats.slow_explains, stats.fallbacks), (3, 5), "{stats:?}");
}

/// Failures that can repeat on every request are logged once, then at most once per interval
/// with the count not logged (unit-tested with a clock in policies.rs); the counters count them
/// all.
#[test]
fn repeated_pick_errors_and_fallbacks_of_an_instance_out_of_service_do_not_flood_the_log() {
    let router = faulty("    - {name: x, type: errors-in-pick}\n").unwrap();
    let x = position(&router, "x");
    let (_, logs) = plugin_api::testing::capture_logs(|| {
        for _ in 0..200 {
            assert!(pick(&router).unwrap().fallback.is_some());
        }
    });
    let lines: Vec<_> = errors_naming_x(&logs)
        .into_iter()
        .filter(|l| l.contains("no good row today"))
        .collect();
    assert_eq!(lines.len(), 1, "{logs:#?}");
    let stats = router.instance(x).stats.snapshot();
    assert_eq!((stats.errors, stats.fallbacks), (200, 200), "{stats:?}");

    // A poisoned instance: the panic once at error level, then nothing per request.
    let router = faulty("    - {name: x, type: panics-in-pick}\n").unwrap();
    let x = position(&router, "x");
    let (_, logs) = plugin_api::testing::capture_logs(|| {
        for _ in 0..200 {
            assert!(pick(&router).unwrap().fallback.is_some());
        }
    });
    assert_eq!(
        errors_naming_x(&logs)
            .iter()
            .filter(|l| l.contains("exploded") || l.contains("out of service"))
            .count(),
        1,
        "{logs:#?}"
    );
    assert_eq!(router.instance(x).stats.snapshot().fallbacks, 200);
    assert_eq!(
        (
            router.instance(x).state().as_str(),
            router.instance(x).state_reason()
        ),
        (
            "poisoned",
            Some("panicked: pick exploded on purpose".to_owned())
        )
    );
}

#[test]
fn two_libraries_exporting_one_type_name_fail_startup_naming_both_files() {
    let err = start(
        &[
            common::plugin("fixture_probe"),
            common::plugin("fixture_duplicate"),
        ],
        "    - {name: x, type: probe}\n",
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("policy type `probe` is exported by two libraries"),
        "{err}"
    );
    assert!(err.contains("libfixture_probe.so and "), "{err}");
    assert!(err.contains("libfixture_duplicate.so"), "{err}");
}

#[test]
fn a_shared_object_without_our_root_module_is_not_a_policy_library() {
    let err = start(
        &[common::plugin("fixture_not_a_plugin")],
        "    - {name: x, type: default}\n",
    )
    .unwrap_err();
    let text = chain(&err);
    assert!(text.contains("plugins[0]"), "{text}");
    assert!(
        text.contains("libfixture_not_a_plugin.so: not a policy library"),
        "{text}"
    );
}

#[test]
fn plugin_log_events_reach_the_host_log_tagged_with_the_plugin_name() {
    let dir = common::temp_dir("logs");
    let config = common::write(
        &dir,
        "router.yaml",
        &format!(
            "plugins: [{{path: {}}}]\nworker_selection:\n  aggregated: x\n  instances:\n    - {{name: x, type: chatty}}\n",
            common::plugin("fixture_faulty").display()
        ),
    );
    let scenario = common::write(
        &dir,
        "s.json",
        r#"{"workers": [{"worker_id": 1}], "requests": [{"isl_tokens": 10}]}"#,
    );
    let (code, _, err) = common::run_cli(&[
        "-v",
        "select",
        "--config",
        config.to_str().unwrap(),
        "--scenario",
        scenario.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let created = err
        .lines()
        .find(|l| l.contains("chatty policy created"))
        .unwrap_or_else(|| panic!("no creation event in:\n{err}"));
    assert!(
        created.contains("INFO") && created.contains("plugin=\"fixture-faulty\""),
        "{created}"
    );
    assert!(
        created.contains("instance=x") || created.contains("instance=\"x\""),
        "{created}"
    );
    let picked = err.lines().find(|l| l.contains("chatty pick")).unwrap();
    assert!(
        picked.contains("WARN") && picked.contains("rows=1 isl=10"),
        "{picked}"
    );
    // The plugin's newline stays inside its line, escaped, and its 4 KB tail is cut.
    assert!(
        !err.lines().any(|l| l.starts_with("INFO forged")),
        "a plugin forged a log line:\n{err}"
    );
    let tail = err.lines().find(|l| l.contains("chatty tail")).unwrap();
    assert!(tail.contains("chatty tail\\nINFO forged: line"), "{tail}");
    assert!(tail.contains("more bytes cut"), "{tail}");
    assert!(tail.len() < 1500, "{} bytes: {tail}", tail.len());
}

/// A private copy of a plugin in its own directory, with the given modes; the guard removes it.
fn private_copy(
    test: &str,
    name: &str,
    file_mode: u32,
    dir_mode: u32,
) -> (common::TempDir, PathBuf) {
    let scratch = common::temp_dir(test);
    let dir = scratch.join("plugins");
    std::fs::create_dir_all(&dir).unwrap();
    let copy = dir.join(format!("lib{name}.so"));
    std::fs::copy(common::plugin(name), &copy).unwrap();
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(file_mode)).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(dir_mode)).unwrap();
    (scratch, copy)
}

fn load_one(path: &Path, extra: &str) -> Result<PolicySet, String> {
    let yaml = format!("plugins:\n  - path: {}\n{extra}", path.display());
    let config = RouterConfig::from_yaml_str(&yaml, None).map_err(|e| e.to_string())?;
    PolicySet::from_config(&config, &SearchPath::default()).map_err(|e| chain(&e))
}

/// A plugin that logs on every pick cannot flood the host's log: past its budget per window its
/// lines are counted, not written, and the host says so once.
#[test]
fn a_plugin_logging_on_every_pick_is_cut_at_its_budget() {
    let dir = common::temp_dir("log_budget");
    let config = common::write(
        &dir,
        "router.yaml",
        &format!(
            "plugins: [{{path: {}}}]\nworker_selection:\n  aggregated: x\n  instances:\n    - {{name: x, type: chatty}}\n",
            common::plugin("fixture_faulty").display()
        ),
    );
    // 500 picks, two plugin lines each: ten times the budget, in far less than its window.
    let requests = vec![r#"{"isl_tokens": 10}"#; 500].join(",");
    let scenario = common::write(
        &dir,
        "s.json",
        &format!(r#"{{"workers": [{{"worker_id": 1}}], "requests": [{requests}]}}"#),
    );
    let started = std::time::Instant::now();
    let (code, out, err) = common::run_cli(&[
        "select",
        "--config",
        config.to_str().unwrap(),
        "--scenario",
        scenario.to_str().unwrap(),
    ]);
    // The run takes well under one window, but on a starved machine it can span more: each
    // window it touched grants the budget again, and says so once.
    let windows = usize::try_from(started.elapsed().as_secs() / 10 + 1).unwrap_or(usize::MAX);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.lines().count(), 500, "every request is still decided");
    let plugin_lines = err
        .lines()
        .filter(|l| l.contains("chatty pick") || l.contains("chatty tail"))
        .count();
    assert!(
        (90..=100 * windows).contains(&plugin_lines),
        "{plugin_lines} plugin lines in {windows} window(s):\n{err}"
    );
    let said: Vec<_> = err
        .lines()
        .filter(|l| {
            l.contains(
                "log lines in 10 s; its further lines in this window are counted, not logged",
            )
        })
        .collect();
    assert!((1..=windows).contains(&said.len()), "{err}");
    assert!(said[0].contains("plugin=\"fixture-faulty\""), "{}", said[0]);
}

#[test]
fn sha256_is_checked_before_loading_and_a_mismatch_prints_both_hashes() {
    let (_dir, path) = private_copy("sha", "fixture_probe", 0o644, 0o755);
    let actual = router_host::loader::sha256_hex(&std::fs::File::open(&path).unwrap()).unwrap();
    let wrong = "0".repeat(64);
    let err = load_one(&path, &format!("    sha256: \"{wrong}\"\n")).unwrap_err();
    assert!(
        err.contains(&format!(
            "sha256 mismatch: configured {wrong}, file has {actual}"
        )),
        "{err}"
    );
    assert!(load_one(
        &path,
        &format!("    sha256: \"{}\"\n", actual.to_uppercase())
    )
    .is_ok());
}

#[test]
fn group_or_world_writable_files_and_directories_are_refused_unless_allowed() {
    let (_dir, path) = private_copy("perm-file", "fixture_probe", 0o664, 0o755);
    let err = load_one(&path, "").unwrap_err();
    assert!(err.contains("refusing to load: the file"), "{err}");
    assert!(
        err.contains("is writable by group or others (mode 664)"),
        "{err}"
    );
    assert!(load_one(&path, "    allow_insecure_permissions: true\n").is_ok());

    let (_dir, path) = private_copy("perm-dir", "fixture_probe", 0o644, 0o777);
    let err = load_one(&path, "").unwrap_err();
    assert!(err.contains("its directory"), "{err}");
    assert!(err.contains("(mode 777)"), "{err}");
}

#[test]
fn files_owned_by_another_user_are_refused() {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let (_dir, path) = private_copy("owner", "fixture_probe", 0o644, 0o755);
    if !root {
        // Only root can give a file away; as another user the file is ours, and must load.
        assert!(load_one(&path, "").is_ok());
        return;
    }
    std::os::unix::fs::chown(&path, Some(4242), None).unwrap();
    let err = load_one(&path, "").unwrap_err();
    assert!(
        err.contains("is owned by uid 4242, not by the running user (uid 0) or root"),
        "{err}"
    );
    assert!(load_one(&path, "    allow_insecure_permissions: true\n").is_ok());
}

#[test]
fn replacing_the_file_after_startup_changes_nothing() {
    let (_dir, path) = private_copy("replace", "fixture_probe", 0o644, 0o755);
    let router = load_one(
        &path,
        "worker_selection:\n  aggregated: x\n  instances:\n    - {name: x, type: probe, parameters: {return_index: 1}}\n",
    )
    .unwrap();
    // Swap the file on disk for another plugin (write to a new file, rename over the old one).
    let swap = path.with_extension("new");
    std::fs::copy(common::plugin("fixture_duplicate"), &swap).unwrap();
    std::fs::rename(&swap, &path).unwrap();
    let d = pick(&router).unwrap();
    assert_eq!(
        d.row,
        RowId {
            worker_id: 9,
            dp_rank: 0
        },
        "still the probe: index 1"
    );
    assert_eq!(d.fallback, None);
}

#[test]
fn a_file_listed_twice_is_checked_for_each_entry() {
    let (_dir, path) = private_copy("twice", "fixture_probe", 0o644, 0o755);
    let yaml = format!(
        "plugins:\n  - path: {p}\n  - path: {p}\n    sha256: \"{}\"\n",
        "0".repeat(64),
        p = path.display()
    );
    let config = RouterConfig::from_yaml_str(&yaml, None).unwrap();
    let err = PolicySet::from_config(&config, &SearchPath::default()).unwrap_err();
    let text = chain(&err);
    assert!(text.starts_with("plugins[1]"), "{text}");
    assert!(text.contains("sha256 mismatch"), "{text}");
}

fn position(router: &PolicySet, name: &str) -> usize {
    router
        .instances()
        .iter()
        .position(|i| i.name == name)
        .expect("instance exists")
}

/// The host's lines about instance `x` that name its origin (from a capture of `tracing` events;
/// the capture does not render levels, so callers match on the message).
fn errors_naming_x(logs: &[String]) -> Vec<&String> {
    logs.iter()
        .filter(|l| l.contains("instance=x") && l.contains("origin=") && l.contains("fixture"))
        .collect()
}

#[test]
fn a_panic_in_explain_keeps_the_decision_but_poisons_counts_and_logs() {
    let router = faulty("    - {name: x, type: panics-in-explain}\n").unwrap();
    let x = position(&router, "x");
    let explained = |router: &PolicySet| {
        router.select(
            &cluster(),
            Selection::of(&Request {
                isl_tokens: 64,
                ..Default::default()
            })
            .explained(),
            &NoSignals,
            &mut Scratch::default(),
        )
    };
    let (d, logs) = plugin_api::testing::capture_logs(|| explained(&router).unwrap());
    // The pick had already succeeded: its row stands, without an explanation.
    assert_eq!((d.row, d.fallback.clone()), (FIRST_ROW, None));
    assert_eq!(d.decided_by, x);
    assert!(d.explanation.is_none());
    assert!(router.instance(x).is_poisoned());
    let stats = router.instance(x).stats.snapshot();
    assert_eq!(
        (stats.picks, stats.panics, stats.errors, stats.fallbacks),
        (1, 1, 1, 0),
        "{stats:?}"
    );
    let errors = errors_naming_x(&logs);
    assert!(
        errors
            .iter()
            .any(|l| l.contains("explain") && l.contains("explain exploded on purpose")),
        "{logs:#?}"
    );
    // Poisoned by the host's own rule: the next request goes to the fallback, quietly.
    let (d, logs) = plugin_api::testing::capture_logs(|| explained(&router).unwrap());
    assert_eq!(d.fallback, Some(PolicyFailure::Poisoned));
    assert!(!logs.iter().any(|l| l.contains("exploded")), "{logs:#?}");
    let stats = router.instance(x).stats.snapshot();
    assert_eq!((stats.picks, stats.panics), (1, 1), "{stats:?}");
}

fn dispatch_event() -> plugin_api::abi::DispatchEvent<'static> {
    plugin_api::abi::DispatchEvent {
        request_id: 1,
        row: plugin_api::abi::RowId {
            worker_id: 7,
            dp_rank: 0,
        },
        session_id: abi_stable::std_types::ROption::RNone,
        prompt_tokens: 64,
        fallback: false,
        extensions: abi_stable::std_types::RSlice::EMPTY,
    }
}

fn complete_event() -> plugin_api::abi::CompleteEvent<'static> {
    plugin_api::abi::CompleteEvent {
        request_id: 1,
        row: plugin_api::abi::RowId {
            worker_id: 7,
            dp_rank: 0,
        },
        session_id: abi_stable::std_types::ROption::RNone,
        outcome: plugin_api::abi::CompletionCode::COMPLETED,
        extensions: abi_stable::std_types::RSlice::EMPTY,
    }
}

#[test]
fn a_panic_in_a_hook_is_counted_poisons_the_instance_and_logs_at_the_next_call() {
    for (hook, message) in [
        ("dispatch", "on_dispatch exploded on purpose"),
        ("complete", "on_complete exploded on purpose"),
    ] {
        let router = faulty(&format!(
            "    - {{name: x, type: panics-in-hook, parameters: {{hook: {hook}}}}}\n"
        ))
        .unwrap();
        let x = position(&router, "x");
        let d = pick(&router).unwrap();
        assert_eq!(d.fallback, None);
        // Hooks return nothing: the panic is contained and poisons the plugin side only.
        router.notify_dispatch(x, &dispatch_event());
        router.notify_complete(x, &complete_event());
        // The next call finds the plugin poisoned: counted as the panic it was, poisoned by the
        // host's rule, logged once at error level naming the instance.
        let (d, logs) = plugin_api::testing::capture_logs(|| pick(&router).unwrap());
        assert_eq!(d.row, LOWEST);
        match &d.fallback {
            Some(PolicyFailure::Panicked(m)) => assert!(m.contains(message), "{m}"),
            other => panic!("{hook}: expected a panic, got {other:?}"),
        }
        assert!(router.instance(x).is_poisoned(), "{hook}");
        let errors = errors_naming_x(&logs);
        assert!(
            errors.iter().any(|l| l.contains(message)),
            "{hook}: {logs:#?}"
        );
        let stats = router.instance(x).stats.snapshot();
        assert_eq!(
            (stats.picks, stats.panics, stats.errors, stats.fallbacks),
            (2, 1, 1, 1),
            "{hook}: {stats:?}"
        );
        // From now on the host's own poison applies: not called, not logged again.
        let (d, logs) = plugin_api::testing::capture_logs(|| pick(&router).unwrap());
        assert_eq!(d.fallback, Some(PolicyFailure::Poisoned));
        assert!(!logs.iter().any(|l| l.contains("exploded")), "{logs:#?}");
        let stats = router.instance(x).stats.snapshot();
        assert_eq!((stats.picks, stats.panics), (2, 1), "{hook}: {stats:?}");
    }
}

/// Run `router-host <command>` (a child process: an uncontained panic would end it) with one
/// instance `x` of the faulty fixture and a two-request scenario.
fn run_faulty_cli(test: &str, command: &str, instance: &str) -> (i32, String, String) {
    let dir = common::temp_dir(test);
    let config = common::write(
        &dir,
        "router.yaml",
        &format!(
            "plugins: [{{path: {}}}]\nworker_selection:\n  aggregated: x\n  instances:\n    - {instance}\n",
            common::plugin("fixture_faulty").display()
        ),
    );
    let scenario = common::write(
        &dir,
        "s.json",
        r#"{"workers": [{"worker_id": 1}, {"worker_id": 2}], "requests": [{"isl_tokens": 10}, {"isl_tokens": 20}]}"#,
    );
    let config = config.to_str().unwrap().to_string();
    let scenario = scenario.to_str().unwrap().to_string();
    let mut args = vec![command, "--config", &config];
    if command == "select" {
        args.extend(["--scenario", &scenario]);
    }
    common::run_cli(&args)
}

#[test]
fn a_panic_payload_whose_drop_panics_is_contained() {
    let (code, out, err) = run_faulty_cli(
        "bomb-pick",
        "select",
        "{name: x, type: bomb-payload, parameters: {at: pick}}",
    );
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert!(!err.contains("panic across the ffi boundary"), "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert!(
        lines[0].contains("policy panicked: panic with a non-string payload"),
        "{out}"
    );
    assert!(
        lines[1].contains("policy is poisoned after an earlier panic"),
        "{out}"
    );
}

#[test]
fn a_policy_drop_that_panics_during_an_unwind_is_contained() {
    // `inputs()` panics with a payload whose Drop panics, and the policy's own Drop panics:
    // neither may unwind through a frame that still owns the policy.
    let (code, out, err) = run_faulty_cli(
        "bomb-inputs",
        "check",
        "{name: x, type: bomb-payload, parameters: {at: inputs, drop_panics: true}}",
    );
    assert_eq!(code, 1, "stdout:\n{out}\nstderr:\n{err}");
    assert!(
        err.contains(
            "libfixture_faulty.so): constructor panicked: inputs() panicked: panic with a non-string payload"
        ),
        "{err}"
    );
    // A policy whose Drop panics at shutdown (no unwind in progress) is contained too.
    let (code, out, err) =
        run_faulty_cli("drop-shutdown", "select", "{name: x, type: panics-in-drop}");
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(out.lines().count(), 2, "{out}");
}
