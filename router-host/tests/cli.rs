//! The `router-host` binary: check, describe, select, exit codes and error messages.

mod common;

use common::{plugin, run_cli, temp_dir, write};

fn probe_config(dir: &std::path::Path, instance: &str) -> std::path::PathBuf {
    write(
        dir,
        "router.yaml",
        &format!(
            "plugins:\n  - path: {}\nworker_selection:\n  aggregated: p\n  instances:\n{instance}",
            plugin("fixture_probe").display()
        ),
    )
}

#[test]
fn check_prints_plugins_types_instances_and_roles() {
    let dir = temp_dir("check");
    let config = probe_config(
        &dir,
        "    - {name: p, type: probe, parameters: {return_index: 0}}\n",
    );
    let (code, out, err) = run_cli(&["check", "--config", config.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(&format!(
            "fixture-probe 0.1.0 (plugin-api {}) at",
            plugin_api::API_VERSION
        )),
        "{out}"
    );
    assert!(out.contains("libfixture_probe.so"), "{out}");
    assert!(out.contains("probe ["), "{out}");
    assert!(out.contains("default [built-in]"), "{out}");
    assert!(out.contains("p = probe"), "{out}");
    assert!(out.contains("return_index = 0"), "{out}");
    assert!(out.contains("inputs = [cache, load] (default)"), "{out}");
    assert!(out.contains("aggregated -> p (probe)"), "{out}");
    assert!(out.contains("prefill -> default (default)"), "{out}");
    // What dispatch books, defaults included.
    assert!(
        out.contains("\nbooking: prefill uncached, decode prompt\n"),
        "{out}"
    );
}

#[test]
fn check_fails_with_exit_1_naming_instance_type_and_key() {
    let dir = temp_dir("check-bad-param");
    let config = probe_config(
        &dir,
        "    - {name: p, type: probe, parameters: {retrun_index: 0}}\n",
    );
    let (code, _, err) = run_cli(&["check", "--config", config.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("instance `p` (type `probe`"), "{err}");
    assert!(err.contains("parameter `retrun_index`"), "{err}");
    assert!(err.contains("unknown field `retrun_index`"), "{err}");
}

#[test]
fn missing_plugin_lists_every_path_tried() {
    let dir = temp_dir("missing");
    let plugin_dir = dir.join("plugins");
    std::fs::create_dir_all(&plugin_dir).unwrap();
    let config = write(&dir, "router.yaml", "plugins:\n  - name: no_such_policy\n");
    let (code, _, err) = run_cli(&[
        "check",
        "--config",
        config.to_str().unwrap(),
        "--plugin-dir",
        plugin_dir.to_str().unwrap(),
    ]);
    assert_eq!(code, 1);
    assert!(
        err.contains("plugin `no_such_policy` not found; tried:"),
        "{err}"
    );
    assert!(
        err.contains(&format!("{}/libno_such_policy.so", plugin_dir.display())),
        "{err}"
    );
    assert!(
        err.contains(&format!("{}/libno_such_policy.so", dir.display())),
        "{err}"
    );
    assert!(err.contains("plugins[0] (line 2)"), "{err}");
}

#[test]
fn a_file_that_is_not_a_shared_object_or_not_a_policy_library_is_refused() {
    let dir = temp_dir("not-a-plugin");
    let fake = write(&dir, "libfake.so", "this is not ELF");
    let (code, _, err) = run_cli(&["describe", fake.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("libfake.so: cannot be loaded"), "{err}");
    // A real shared object without our root module.
    let libc = [
        "/lib/x86_64-linux-gnu/libz.so.1",
        "/usr/lib/x86_64-linux-gnu/libz.so.1",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists());
    if let Some(lib) = libc {
        let (code, _, err) = run_cli(&["describe", lib]);
        assert_eq!(code, 1);
        assert!(err.contains("not a policy library"), "{err}");
    }
}

#[test]
fn describe_prints_types_and_parameter_docs() {
    let (code, out, err) = run_cli(&["describe", plugin("fixture_probe").to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(&format!(
            "fixture-probe 0.1.0 (plugin-api {})",
            plugin_api::API_VERSION
        )),
        "{out}"
    );
    assert!(out.contains("policy type `probe`"), "{out}");
    assert!(
        out.contains("return_index (usize, default absent)"),
        "{out}"
    );
}

#[test]
fn select_prints_one_json_line_per_request_and_exit_codes_follow_the_contract() {
    let dir = temp_dir("select");
    let config = probe_config(&dir, "    - {name: p, type: probe}\n");
    let scenario = write(
        &dir,
        "scenario.json",
        r#"{"block_size": 16,
            "workers": [{"worker_id": 29}, {"worker_id": 41, "overloaded": true}],
            "requests": [
              {"isl_tokens": 160, "affinity_target": {"worker_id": 29, "dp_rank": null}},
              {"isl_tokens": 160, "pinned_worker": {"worker_id": 41, "dp_rank": 0}}
            ]}"#,
    );
    let (code, out, _) = run_cli(&[
        "select",
        "--config",
        config.to_str().unwrap(),
        "--scenario",
        scenario.to_str().unwrap(),
    ]);
    assert_eq!(code, 1, "one request failed");
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["request"], 0);
    assert_eq!(lines[0]["worker_id"], 29);
    assert_eq!(lines[0]["dp_rank"], 0);
    assert_eq!(lines[0]["instance"], "p");
    assert_eq!(lines[0]["policy"], "probe");
    assert_eq!(lines[0]["reason"], "probe");
    assert_eq!(lines[1]["request"], 1);
    assert_eq!(lines[1]["error"], "pinned worker overloaded: worker 41");

    // An unusable scenario exits 2 and names the file and line.
    let bad = write(
        &dir,
        "bad.json",
        "{\"workers\": [],\n \"requests\": [{\"isl\": 1}]}",
    );
    let (code, out, err) = run_cli(&[
        "select",
        "--config",
        config.to_str().unwrap(),
        "--scenario",
        bad.to_str().unwrap(),
    ]);
    assert_eq!(code, 2);
    assert!(out.is_empty());
    assert!(err.contains("bad.json: line 2"), "{err}");
    assert!(err.contains("unknown field `isl`"), "{err}");
}

#[test]
fn a_crate_built_as_rlib_only_gets_a_cdylib_hint() {
    let dir = temp_dir("rlib-only");
    let plugin_dir = dir.join("plugins");
    std::fs::create_dir_all(&plugin_dir).unwrap();
    write(&plugin_dir, "libmy_policy.rlib", "not a shared object");
    let config = write(&dir, "router.yaml", "plugins:\n  - name: my_policy\n");
    let (code, _, err) = run_cli(&[
        "check",
        "--config",
        config.to_str().unwrap(),
        "--plugin-dir",
        plugin_dir.to_str().unwrap(),
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("plugin `my_policy` not found; tried:"),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "found {}/libmy_policy.rlib: that crate builds no shared object: add `crate-type = [\"cdylib\"]`",
            plugin_dir.display()
        )),
        "{err}"
    );
}

#[test]
fn a_plugin_path_that_is_not_a_regular_file_says_what_it_is() {
    let dir = temp_dir("not-a-file");
    let fifo = dir.join("fifo.so");
    let c_path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path; mkfifo only creates the node.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o644) }, 0);
    for (path, kind) in [
        ("/dev/zero".to_string(), "a character device"),
        (dir.display().to_string(), "a directory"),
        (fifo.display().to_string(), "a FIFO"),
    ] {
        let config = write(
            &dir,
            "router.yaml",
            &format!("plugins:\n  - path: {path}\n"),
        );
        let (code, _, err) = run_cli(&["check", "--config", config.to_str().unwrap()]);
        assert_eq!(code, 1, "{path}: {err}");
        assert!(
            err.contains(&format!("plugin file {path}: not a regular file ({kind})")),
            "{path}: {err}"
        );
        assert!(!err.contains("not found"), "{path}: {err}");
    }
}

#[test]
fn select_sheds_the_lowest_priority_at_a_full_queue_and_refuses_equals() {
    let dir = temp_dir("select_overload");
    let config = write(
        &dir,
        "router.yaml",
        "max_queued_requests: 2\npolicy_classes:\n\
         \x20 - {name: default, priority: 0, prefill_busy_threshold: 100}\n\
         \x20 - {name: high, priority: 10, prefill_busy_threshold: 100}\n",
    );
    let scenario = write(
        &dir,
        "scenario.json",
        r#"{"workers": [{"worker_id": 1}],
            "requests": [
              {"isl_tokens": 500},
              {"isl_tokens": 10},
              {"isl_tokens": 10},
              {"isl_tokens": 10, "policy_class": "high"},
              {"isl_tokens": 10},
              {"isl_tokens": 10, "complete": [0]}
            ]}"#,
    );
    let (code, out, _) = run_cli(&[
        "select",
        "--config",
        config.to_str().unwrap(),
        "--scenario",
        scenario.to_str().unwrap(),
    ]);
    assert_eq!(code, 1, "{out}");
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 6);
    // Request 2 (the newest of the lowest priority) made room for request 3.
    let error = |i: usize| lines[i]["error"].as_str().unwrap_or("").to_owned();
    assert!(error(2).starts_with("shed from the queue of policy class `default` (priority 0) to make room for a request of class `high` (priority 10)"), "{}", error(2));
    assert!(
        error(4).starts_with("the admission queues hold their limit of 2 requests"),
        "{}",
        error(4)
    );
    for i in [1, 3] {
        assert_eq!(lines[i]["admitted_at"], 5, "{}", lines[i]);
    }
}
