//! Hostile inputs to the CLI and its parsers: truncated files, wrong types, huge
//! numbers, NaN and infinities, empty and duplicate worker lists, oversized session ids, 100,000
//! rows in one request, deep nesting, forward references and unknown fields. Every one must end
//! in a clear error naming what and where, or in a correct decision; never a panic or a hang.
//!
//! CLI behaviour (exit codes, stderr) goes through the real binary; pure parsing goes through the
//! library, which is faster.

mod common;

use std::path::{Path, PathBuf};

use std::time::Duration;

use router_host::config::{RouterConfig, MAX_DP_SIZE, MAX_ROWS};
use router_host::scenario::{Scenario, MAX_SCENARIO_ROWS, MAX_SCENARIO_ROW_DECISIONS};
use serde_json::Value;

use common::{plugin, run_cli, temp_dir, write};

// --- helpers -------------------------------------------------------------------------------------

/// The error text of config `text`, which must be rejected.
fn config_err(text: &str) -> String {
    match RouterConfig::from_yaml_str(text, None) {
        Ok(config) => panic!("expected {text:?} to be rejected, got {config:#?}"),
        Err(err) => err.to_string(),
    }
}

/// The error text of scenario `text`, which must be rejected.
fn scenario_err(text: &str) -> String {
    match Scenario::from_json_str(text, "s.json") {
        Ok(scenario) => panic!("expected {text:?} to be rejected, got {scenario:#?}"),
        Err(err) => err.to_string(),
    }
}

fn assert_contains(haystack: &str, needles: &[&str]) {
    for needle in needles {
        assert!(
            haystack.contains(needle),
            "expected {needle:?} in:\n{haystack}"
        );
    }
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("UTF-8 temp path")
}

/// `router-host select` on the given config and scenario texts; returns (exit code, one parsed
/// JSON value per stdout line, stderr).
fn select(dir: &Path, config: &str, scenario: &str) -> (i32, Vec<Value>, String) {
    let config = write(dir, "router.yaml", config);
    let scenario = write(dir, "scenario.json", scenario);
    select_files(&config, &scenario)
}

fn select_files(config: &Path, scenario: &Path) -> (i32, Vec<Value>, String) {
    let (code, out, err) = run_cli(&[
        "select",
        "--config",
        path_str(config),
        "--scenario",
        path_str(scenario),
    ]);
    let lines = out
        .lines()
        .map(|line| {
            serde_json::from_str(line).unwrap_or_else(|e| panic!("bad output line {line:?}: {e}"))
        })
        .collect();
    (code, lines, err)
}

fn check(dir: &Path, config: &str) -> (i32, String, String) {
    let config: PathBuf = write(dir, "router.yaml", config);
    run_cli(&["check", "--config", path_str(&config)])
}

/// Dynamo's weights for the built-in `default`: the expected rows and costs below were written for
/// them (idle rows tie and go to the lowest id; a fully cached prompt costs 0).
const DYNAMO_WEIGHTS: &str = "booking: {prefill: prompt}\ndefault_selector: {prefill_load_scale: 1.0, overlap_credit: 1.0, tie_break: lowest_row}\n";

const ONE_REQUEST: &str = r#"{"workers": [{"worker_id": 1}], "requests": [{"isl_tokens": 16}]}"#;

// --- configuration ---------------------------------------------------------------------------

#[test]
fn truncated_yaml_exits_1_from_check_and_2_from_select_naming_the_line() {
    let dir = temp_dir("hostile-truncated-yaml");
    let truncated = "block_size: 16\nworker_selection:\n  instances:\n    - name: \"two";
    let (code, out, err) = check(&dir, truncated);
    assert_eq!(code, 1, "{err}");
    assert!(out.is_empty(), "{out}");
    assert_contains(
        &err,
        &[
            "router.yaml: line 4 column",
            "found unexpected end of stream, while scanning a quoted scalar at line 4 column 13",
        ],
    );
    assert!(!err.contains("panicked"), "{err}");

    let (code, lines, err) = select(&dir, truncated, ONE_REQUEST);
    assert_eq!(code, 2, "{err}");
    assert!(lines.is_empty());
    assert_contains(&err, &["router.yaml: line 4 column", "end of stream"]);

    // Cut in the middle of a flow mapping, and a file that ends inside a key.
    for (text, fragment) in [
        (
            "worker_selection: {instances: [{name: a, type: ",
            "line 2 column 1: did not find expected node content, while parsing a flow node",
        ),
        (
            "session_affinity:\n  mo",
            "line 2 column 3: session_affinity",
        ),
    ] {
        let message = config_err(text);
        assert_contains(&message, &["config <string>: ", fragment]);
    }
}

#[test]
fn wrong_types_in_the_config_name_the_key_and_the_expected_type() {
    for (text, expected) in [
        ("- block_size: 16", "invalid type: sequence, expected a mapping of router settings"),
        ("block_size: \"16\"", "line 1 column 13: block_size: invalid type: string \"16\", expected an integer from 1 to 4294967295"),
        ("block_size: [16]", "block_size: invalid type: sequence, expected an integer from 1 to 4294967295"),
        ("block_size: true", "block_size: invalid type: boolean `true`"),
        ("plugins: {path: x}", "line 1 column 10: plugins: invalid type: map, expected a sequence"),
        ("plugins: [libfoo.so]", "plugins[0]: invalid type: string \"libfoo.so\", expected a plugin entry mapping with `path` or `name`"),
        ("plugins: [{path: [a]}]", "plugins[0].path: invalid type: sequence, expected a plugin file path"),
        ("plugins: [{name: x, allow_insecure_permissions: yes}]", "plugins[0].allow_insecure_permissions: invalid type: string \"yes\", expected a boolean"),
        ("worker_selection: [a]", "worker_selection: invalid type: sequence, expected a `worker_selection` mapping"),
        ("worker_selection: {instances: {name: a}}", "worker_selection.instances: invalid type: map, expected a sequence"),
        ("worker_selection: {aggregated: [a]}", "worker_selection.aggregated: invalid type: sequence, expected a string"),
        ("worker_selection: {instances: [{name: a, type: 7}]}", "worker_selection.instances[0].type: invalid type: integer `7`, expected a policy type name"),
        ("worker_selection: {instances: [{name: a, type: t, parameters: [1, 2]}]}", "instance `a`: `parameters` must be a mapping, found a sequence"),
        ("session_affinity: {mode: [soft]}", "line 1 column 26: session_affinity.mode: invalid type: sequence, expected `soft` or `hard`"),
        ("session_affinity: {mode: soft, ttl_secs: 1.5}", "session_affinity.ttl_secs: invalid type: floating point `1.5`"),
        ("worker_selection: {instances: [{name: a, type: t, on_error: [fail]}]}", "worker_selection.instances[0].on_error: invalid type: sequence, expected `fallback` or `fail`"),
        ("policy_classes: [{name: c, prefill_busy_threshold: 1, admission: {a: 1}}]", "policy_classes[0].admission: invalid type: map, expected `any_eligible` or `chosen_row`"),
        ("policy_classes: [{name: c, prefill_busy_threshold: true}]", "policy_classes[0].prefill_busy_threshold: invalid type: boolean `true`, expected an integer >= 0"),
        ("default_selector: {prefill_load_scale: \"1\"}", "default_selector.prefill_load_scale: invalid type: string \"1\", expected a finite number >= 0"),
        ("engine: [1]", "`engine` must be a mapping, found a sequence"),
    ] {
        let message = config_err(text);
        assert!(message.starts_with("config <string>: "), "{message}");
        assert!(message.contains(expected), "{text}:\n  expected {expected:?}\n  in {message}");
    }
}

#[test]
fn huge_numbers_in_the_config_are_range_or_type_errors_naming_the_key() {
    for (text, expected) in [
        ("block_size: 1e30", "line 1 column 13: block_size: invalid type: floating point `1000000000000000000000000000000.0`, expected an integer from 1 to 4294967295"),
        ("block_size: 99999999999999999999", "block_size: invalid value: integer `99999999999999999999` is out of range, expected an integer from 1 to 4294967295"),
        ("block_size: 4294967296", "block_size: invalid value: integer `4294967296` is out of range"),
        ("block_size: -1", "block_size: invalid value: integer `-1` is out of range"),
        // Beyond u128 the YAML parser reads the numeral as a float.
        ("block_size: 999999999999999999999999999999999999999999999999", "block_size: invalid type: floating point `1000000000000000000000000000000000000000000000000.0`, expected an integer from 1 to 4294967295"),
        ("session_affinity: {mode: soft, ttl_secs: 18446744073709551615}", "session_affinity.ttl_secs: invalid value: integer `18446744073709551615` is out of range, expected an integer from 1 to 315360000"),
        ("session_affinity: {mode: soft, max_bindings: 1e400}", "session_affinity.max_bindings: invalid type: floating point `1e400` (overflows to infinity)"),
        ("worker_selection: {instances: [{name: a, type: t, pick_budget_us: 18446744073709551616}]}", "worker_selection.instances[0].pick_budget_us: invalid value: integer `18446744073709551616` is out of range, expected an integer >= 1"),
        ("worker_selection: {instances: [{name: a, type: t, pick_budget_us: 1e400}]}", "pick_budget_us: invalid type: floating point `1e400` (overflows to infinity), expected an integer >= 1"),
        ("policy_classes: [{name: c, prefill_busy_threshold: 18446744073709551616}]", "policy_classes[0].prefill_busy_threshold: invalid value: integer `18446744073709551616` is out of range"),
        ("host_cache_hit_weight: 1e400", "host_cache_hit_weight: invalid value: 1e400 is too large (overflows to infinity), expected a finite number >= 0"),
        ("policy_classes: [{name: c, prefill_busy_threshold_frac: 1e999}]", "policy_classes[0].prefill_busy_threshold_frac: invalid value: 1e999 is too large (overflows to infinity), expected a finite number > 0"),
    ] {
        let message = config_err(text);
        assert!(message.contains(expected), "{text}:\n  expected {expected:?}\n  in {message}");
    }
    // Big integers inside parameters are the plugin's to judge: they pass through exactly.
    let config = RouterConfig::from_yaml_str(
        "worker_selection: {instances: [{name: a, type: t, parameters: {n: 18446744073709551615, m: -9223372036854775808}}]}",
        None,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        config.worker_selection.instances[0].parameters_json,
        r#"{"n":18446744073709551615,"m":-9223372036854775808}"#
    );
}

#[test]
fn nan_and_infinities_in_instance_parameters_name_the_instance_and_the_key() {
    let dir = temp_dir("hostile-param-nan");
    for (parameters, instance_key) in [
        ("{x: .nan}", "parameter `x`: .nan is not a finite number"),
        ("{x: .inf}", "parameter `x`: .inf is not a finite number"),
        ("{x: -.Inf}", "parameter `x`: -.inf is not a finite number"),
        (
            "{x: 1, tiers: [1, {w: .NaN}]}",
            "parameter `tiers[1].w`: .nan is not a finite number",
        ),
    ] {
        let text = format!(
            "worker_selection:\n  aggregated: wonky\n  instances:\n    - name: wonky\n      type: default\n      parameters: {parameters}\n"
        );
        let (code, out, err) = check(&dir, &text);
        assert_eq!(code, 1, "{err}");
        assert!(out.is_empty(), "{out}");
        assert_contains(
            &err,
            &[
                "router.yaml: line 6 column",
                "worker_selection.instances[0].parameters",
                "instance `wonky`",
                instance_key,
                "JSON has no NaN or infinity",
            ],
        );
        // `select` refuses the whole config: exit 2, no output.
        let (code, lines, err) = select(&dir, &text, ONE_REQUEST);
        assert_eq!(code, 2, "{err}");
        assert!(lines.is_empty());
        assert_contains(&err, &["instance `wonky`", instance_key]);
    }
    // A numeral beyond f64 (`1e999`) is not a YAML float to the parser but a string; it reaches
    // the policy as the string "1e999", and the policy's own validation names it.
    let (code, _, err) = check(
        &dir,
        "worker_selection:\n  instances:\n    - {name: wonky, type: default, parameters: {prefill_load_scale: 1e999}}\n",
    );
    assert_eq!(code, 1, "{err}");
    assert_contains(
        &err,
        &[
            "instance `wonky` (type `default`, from built-in)",
            "parameter `prefill_load_scale`: invalid type: string \"1e999\", expected f64",
        ],
    );
}

#[test]
fn unknown_keys_are_refused_at_every_level_of_the_config() {
    for (text, expected) in [
        ("bogus: 1", "line 1 column 1: unknown field `bogus`, expected one of `block_size`"),
        ("default_selector: {bogus: 1}", "default_selector: unknown field `bogus`, expected one of `prefill_load_scale`, `decode_active_request_weight`, `overlap_credit`, `tie_break`"),
        ("booking: {bogus: 1}", "booking: unknown field `bogus`, expected `prefill`"),
        ("plugins: [{name: x, bogus: 1}]", "plugins[0]: unknown field `bogus`, expected one of `path`, `name`, `sha256`, `allow_insecure_permissions`"),
        ("worker_selection: {bogus: 1}", "worker_selection: unknown field `bogus`, expected one of `aggregated`, `prefill`, `decode`, `instances`"),
        ("worker_selection: {instances: [{name: a, type: t, bogus: 1}]}", "worker_selection.instances[0]: unknown field `bogus`, expected one of `name`, `type`, `parameters`"),
        ("session_affinity: {mode: soft, bogus: 1}", "session_affinity: unknown field `bogus`, expected one of `mode`, `ttl_secs`, `max_bindings`"),
        ("policy_classes: [{name: c, prefill_busy_threshold: 1, bogus: 1}]", "policy_classes[0]: unknown field `bogus`, expected one of `name`, `prefill_busy_threshold`"),
    ] {
        let message = config_err(text);
        assert!(message.contains(expected), "{text}:\n  expected {expected:?}\n  in {message}");
    }
    // Inside `parameters` the policy type judges: the built-in `default` refuses unknown keys at
    // startup, naming the instance and the key.
    let dir = temp_dir("hostile-unknown-param");
    let (code, _, err) = check(
        &dir,
        "worker_selection:\n  instances:\n    - {name: d, type: default, parameters: {bogus: 1}}\n",
    );
    assert_eq!(code, 1, "{err}");
    assert_contains(
        &err,
        &[
            "instance `d` (type `default`, from built-in)",
            "parameter `bogus`: unknown field `bogus`",
        ],
    );
}

#[test]
fn deeply_nested_yaml_is_a_recursion_limit_error_not_a_stack_overflow() {
    let dir = temp_dir("hostile-deep-yaml");
    // 100,000 levels: far beyond any stack if the parser recursed without a limit.
    for text in [
        format!("engine: {}{}\n", "[".repeat(100_000), "]".repeat(100_000)),
        format!("engine: {}1{}\n", "{a: ".repeat(100_000), "}".repeat(100_000)),
        format!(
            "worker_selection:\n  instances:\n    - name: a\n      type: t\n      parameters: {{x: {}{}}}\n",
            "[".repeat(100_000),
            "]".repeat(100_000)
        ),
    ] {
        let (code, out, err) = check(&dir, &text);
        assert_eq!(code, 1, "{err}");
        assert!(out.is_empty(), "{out}");
        assert_contains(&err, &["router.yaml: line", "recursion limit exceeded"]);
    }
}

// --- scenarios -------------------------------------------------------------------------------

#[test]
fn huge_numbers_in_a_scenario_are_parse_errors_with_the_line() {
    for (text, expected) in [
        (
            "{\"workers\": [{\"worker_id\": 1}],\n \"requests\": [\n  {\"isl_tokens\": 18446744073709551616}]}",
            // serde_json reads an integer beyond u64 as a float; the line and column point at it.
            "scenario s.json: line 3 column 37: requests[0].isl_tokens: invalid type: floating point `1.8446744073709552e+19`, expected u64",
        ),
        (
            "{\"workers\": [{\"worker_id\": 1}],\n \"requests\": [{\"isl_tokens\": 99999999999999999999999999999}]}",
            "scenario s.json: line 2 column",
        ),
        (
            "{\"workers\": [{\"worker_id\": 1}], \"requests\": [{\"isl_tokens\": -1}]}",
            "scenario s.json: line 1 column 62: requests[0].isl_tokens: invalid value: integer `-1`, expected u64",
        ),
        (
            "{\"workers\": [{\"worker_id\": 1e30}], \"requests\": []}",
            "scenario s.json: line 1 column 31: workers[0].worker_id: invalid type: floating point `1e+30`, expected u64",
        ),
        (
            "{\"block_size\": 1e30, \"workers\": [], \"requests\": []}",
            "invalid type: floating point `1e+30`, expected u32",
        ),
        (
            "{\"block_size\": 4294967296, \"workers\": [], \"requests\": []}",
            "invalid value: integer `4294967296`, expected u32",
        ),
        (
            "{\"workers\": [{\"worker_id\": 1, \"dp_start\": 4294967295, \"dp_size\": 2}], \"requests\": []}",
            "scenario s.json: workers: worker 1: ranks 4294967295..4294967295+2 overflow u32",
        ),
        (
            "{\"workers\": [], \"requests\": [{\"isl_tokens\": 1, \"priority\": 2147483648}]}",
            "invalid value: integer `2147483648`, expected i32",
        ),
    ] {
        let message = scenario_err(text);
        assert!(message.contains(expected), "{text}:\n  expected {expected:?}\n  in {message}");
    }
}

#[test]
fn a_worker_declaring_billions_of_ranks_is_refused_before_anything_is_allocated() {
    // Regression: 80 bytes of scenario made the first request allocate 64 GB of eligible rows
    // (abort: "memory allocation of 64000000000 bytes failed").
    let dir = temp_dir("hostile-dp-size");
    let (code, lines, err) = select(
        &dir,
        "{}",
        r#"{"workers": [{"worker_id": 1, "dp_size": 4000000000}], "requests": [{"isl_tokens": 1}]}"#,
    );
    assert_eq!(code, 2, "{err}");
    assert!(lines.is_empty());
    assert_contains(
        &err,
        &[
            "scenario.json: line 1 column 51: workers[0].dp_size: invalid value: integer `4000000000` is out of range, expected an integer from 1 to 65536",
        ],
    );
    assert_eq!(MAX_SCENARIO_ROWS, 1_048_576);
}

/// `router-host select` on files in `dir`, killed (and the test failed) past `deadline`;
/// returns (exit code, stdout, stderr).
fn select_within(
    dir: &Path,
    config: &str,
    scenario: &str,
    deadline: Duration,
) -> (i32, String, String) {
    let config = write(dir, "router.yaml", config);
    let scenario = write(dir, "scenario.json", scenario);
    let run = common::child::run_within(
        dir,
        &common::router_host_bin(),
        &[
            "select",
            "--config",
            path_str(&config),
            "--scenario",
            path_str(&scenario),
        ],
        None,
        deadline,
    );
    (run.code.unwrap_or(-1), run.stdout, run.stderr)
}

#[test]
fn a_small_scenario_asking_for_minutes_of_work_is_refused_at_once() {
    // Regression: 34 KB declaring one worker with 2^20 ranks, then 1,500 requests, ran for 30 s
    // and more (every request looks at every row). A refusal reads nothing but the file, so the
    // deadline is only there to fail instead of hanging.
    const PROMPT: Duration = Duration::from_secs(30);
    let requests = vec![r#"{"isl_tokens": 1}"#; 1500].join(",");
    let dir = temp_dir("hostile-dp-work");
    let scenario = format!(
        r#"{{"workers": [{{"worker_id": 1, "dp_size": 1048576}}], "requests": [{requests}]}}"#
    );
    assert!(scenario.len() < 34 << 10);
    let (code, out, err) = select_within(&dir, "{}", &scenario, PROMPT);
    assert_eq!((code, out.as_str()), (2, ""), "{err}");
    assert_eq!(
        err,
        format!(
            "error: scenario {}: line 1 column 48: workers[0].dp_size: invalid value: integer `1048576` is \
             out of range, expected an integer from 1 to 65536\n",
            dir.join("scenario.json").display()
        )
    );
    // The same rows within the dp_size cap (16 workers of 65,536 ranks): the work is refused.
    let workers: Vec<String> = (0..16)
        .map(|id| format!(r#"{{"worker_id": {id}, "dp_size": 65536}}"#))
        .collect();
    let scenario = format!(
        r#"{{"workers": [{}], "requests": [{requests}]}}"#,
        workers.join(",")
    );
    let (code, out, err) = select_within(&dir, "{}", &scenario, PROMPT);
    assert_eq!((code, out.as_str()), (2, ""), "{err}");
    assert_eq!(
        err,
        format!(
            "error: scenario {}: 1500 requests over 1048576 rows is 1572864000 row decisions, \
             over the limit of {MAX_SCENARIO_ROW_DECISIONS} (requests times rows); use fewer rows \
             or split the scenario\n",
            dir.join("scenario.json").display()
        )
    );
}

#[test]
fn a_config_over_the_row_cap_is_refused_by_check_as_serve_would() {
    let dir = temp_dir("hostile-config-rows");
    let workers: String = (0..17)
        .map(|id| format!("  - {{id: {id}, url: \"http://127.0.0.1:9\", dp_size: 65536}}\n"))
        .collect();
    let (code, out, err) = check(&dir, &format!("workers:\n{workers}"));
    assert_eq!((code, out.as_str()), (1, ""), "{err}");
    assert_eq!(
        err,
        format!(
            "error: config {}: line 2 column 3: workers: 1114112 rows in total (the sum of every \
             dp_size), over the limit of {MAX_ROWS}\n",
            dir.join("router.yaml").display()
        )
    );
    assert_eq!(MAX_ROWS, MAX_SCENARIO_ROWS);
    assert_eq!(MAX_DP_SIZE, 65_536);
}

#[test]
fn nan_infinity_and_overflowing_floats_in_scenario_rows_are_parse_errors_with_the_line() {
    // JSON has no NaN or infinity literals; a numeral beyond f64 is out of range.
    for (value, expected) in [
        ("NaN", "expected value"),
        ("Infinity", "expected value"),
        ("-Infinity", "invalid number"),
        ("1e400", "number out of range"),
        ("-1e400", "number out of range"),
        ("\"NaN\"", "invalid type: string \"NaN\", expected f64"),
    ] {
        for field in ["device_blocks", "host_blocks", "disk_blocks"] {
            let text = format!(
                "{{\"workers\": [{{\"worker_id\": 1}}],\n \"requests\": [{{\"isl_tokens\": 16,\n  \"rows\": [{{\"worker_id\": 1, \"{field}\": {value}}}]}}]}}"
            );
            let message = scenario_err(&text);
            assert!(
                message.starts_with("scenario s.json: line 3 column "),
                "{field}: {value}: {message}"
            );
            assert!(message.contains(expected), "{field}: {value}: {message}");
        }
    }
}

#[test]
fn negative_overlap_in_a_scenario_row_names_the_request_row_and_field() {
    for (field, value, shown) in [
        ("device_blocks", "-1", "-1"),
        ("host_blocks", "-0.5", "-0.5"),
        ("disk_blocks", "-1e300", "-1000000000000000000000000000000"),
    ] {
        let text = format!(
            r#"{{"workers": [{{"worker_id": 1}}, {{"worker_id": 2}}], "requests": [
                {{"isl_tokens": 16}},
                {{"isl_tokens": 16, "rows": [{{"worker_id": 1}}, {{"worker_id": 2, "{field}": {value}}}]}}]}}"#
        );
        let message = scenario_err(&text);
        let expected =
            format!("scenario s.json: requests[1]: rows[1].{field}: must be a finite number >= 0, got {shown}");
        assert!(message.starts_with(&expected), "{message}");
    }
}

#[test]
fn wrong_types_in_a_scenario_name_the_line() {
    for (text, expected) in [
        ("\"text\"", "line 1 column 6: invalid type: string \"text\", expected a scenario object with `workers` and `requests`"),
        ("{\"workers\": [1], \"requests\": []}", "line 1 column 14: workers[0]: invalid type: integer `1`, expected a worker object with `worker_id`"),
        ("{\"workers\": [], \"requests\": [16]}", "invalid type: integer `16`, expected a request object with `isl_tokens`"),
        ("{\"workers\": [], \"requests\": [{\"isl_tokens\": 1, \"rows\": [1]}]}", "invalid type: integer `1`, expected a row object with `worker_id`"),
        ("{\"workers\": [], \"requests\": [{\"isl_tokens\": 1, \"pinned_worker\": 1}]}", "invalid type: integer `1`, expected a pinned worker object with `worker_id`"),
        ("{\"workers\": [], \"requests\": [{\"isl_tokens\": 1, \"affinity_target\": 1}]}", "invalid type: integer `1`, expected an affinity target object with `worker_id`"),
        ("{\"workers\": [], \"requests\": [{\"isl_tokens\": 1, \"worker_updates\": [1]}]}", "invalid type: integer `1`, expected a worker update object with `worker_id`"),
        ("{\"workers\": {}, \"requests\": []}", "line 1 column 12: workers: invalid type: map, expected a sequence"),
        ("{\"workers\": [{\"worker_id\": \"1\"}], \"requests\": []}", "invalid type: string \"1\", expected u64"),
        ("{\"workers\": [{\"worker_id\": 1, \"available\": 1}], \"requests\": []}", "invalid type: integer `1`, expected a boolean"),
        ("{\"workers\": [],\n \"requests\": [{\"isl_tokens\": 1, \"role\": \"both\"}]}", "line 2 column 46: requests[0].role: unknown variant `both`, expected one of `aggregated`, `prefill`, `decode`"),
        ("{\"workers\": [], \"requests\": [{\"isl_tokens\": 1, \"session_id\": 7}]}", "invalid type: integer `7`, expected a string"),
        ("{\"workers\": [], \"requests\": [{\"isl_tokens\": 1, \"allowed_worker_ids\": 7}]}", "invalid type: integer `7`, expected a sequence"),
        ("{\"workers\": [], \"requests\": [{\"isl_tokens\": 1, \"complete\": [-1]}]}", "invalid value: integer `-1`, expected usize"),
        ("{\"workers\": [], \"requests\": []", "line 1 column 30: EOF while parsing an object"),
        ("{\"workers\": [], \"requests\": [{\"isl_tokens\": 1}]} trailing", "line 1 column 50: trailing characters"),
        ("", "line 1 column 0: EOF while parsing a value"),
    ] {
        let message = scenario_err(text);
        assert!(message.starts_with("scenario s.json: "), "{message}");
        assert!(message.contains(expected), "{text}:\n  expected {expected:?}\n  in {message}");
    }
}

#[test]
fn unknown_fields_are_refused_at_every_level_of_a_scenario() {
    let base = [
        r#"{"workers": [{"worker_id": 1}],"#,
        r#" "requests": [{"isl_tokens": 1,"#,
        r#"   "affinity_target": {"worker_id": 1},"#,
        r#"   "pinned_worker": {"worker_id": 1},"#,
        r#"   "rows": [{"worker_id": 1}],"#,
        r#"   "worker_updates": [{"worker_id": 1}]}]}"#,
    ];
    // The base scenario is valid.
    Scenario::from_json_str(&base.join("\n"), "s.json").unwrap_or_else(|e| panic!("{e}"));
    for (line, anchor) in [
        (1, r#"{"workers""#),
        (1, r#"{"worker_id": 1}"#),
        (2, r#"{"isl_tokens""#),
        (3, r#"{"worker_id": 1}"#),
        (4, r#"{"worker_id": 1}"#),
        (5, r#"{"worker_id": 1}"#),
        (6, r#"{"worker_id": 1}"#),
    ] {
        let mut lines = base.map(str::to_owned);
        let target = &mut lines[line - 1];
        let at = target.find(anchor).expect("anchor") + 1;
        target.insert_str(at, r#""colour": 2, "#);
        let message = scenario_err(&lines.join("\n"));
        assert!(
            message.starts_with(&format!("scenario s.json: line {line} column ")),
            "{message}"
        );
        assert!(
            message.contains("unknown field `colour`, expected"),
            "{message}"
        );
    }
}

#[test]
fn deeply_nested_json_is_a_clear_error_not_a_stack_overflow() {
    // 100,000 levels. The typed parser stops at the first bracket where a value is expected, an
    // unknown key is refused before its value is read, and serde_json caps recursion at 128
    // anyway: none of them recurses deeply.
    for (text, expected) in [
        (
            format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)),
            "line 1 column 0: invalid type: sequence, expected a scenario object with `workers` and `requests`",
        ),
        (
            format!(
                r#"{{"workers": [], "requests": [{{"isl_tokens": 1, "rows": {}}}]}}"#,
                "[".repeat(100_000)
            ),
            "line 1 column 56: requests[0].rows[0]: invalid type: sequence, expected a row object with `worker_id`",
        ),
        (
            format!(
                r#"{{"workers": [], "requests": [], "extra": {}}}"#,
                "{\"a\": ".repeat(100_000)
            ),
            "line 1 column 39: extra: unknown field `extra`",
        ),
    ] {
        let message = scenario_err(&text);
        assert!(message.starts_with("scenario s.json: "), "{message}");
        assert!(
            message.contains(expected),
            "expected {expected:?} in {message}"
        );
    }
    // Through the binary too (main thread stack, the real file path).
    let dir = temp_dir("hostile-deep-json");
    let (code, lines, err) = select(
        &dir,
        "{}",
        &format!(
            r#"{{"workers": [{{"worker_id": 1}}], "requests": [{{"isl_tokens": 1, "allowed_worker_ids": {}}}]}}"#,
            "[".repeat(100_000)
        ),
    );
    assert_eq!(code, 2, "{err}");
    assert!(lines.is_empty());
    assert_contains(
        &err,
        &["scenario.json: line 1 column 86: requests[0].allowed_worker_ids[0]: invalid type: sequence, expected u64"],
    );
}

#[test]
fn complete_pointing_at_itself_or_forward_is_refused_naming_the_request() {
    for (complete, shown) in [
        ("[1]", "request 1"),
        ("[0, 2]", "request 2"),
        ("[18446744073709551615]", "request 18446744073709551615"),
    ] {
        let text = format!(
            r#"{{"workers": [{{"worker_id": 1}}], "requests": [{{"isl_tokens": 1}}, {{"isl_tokens": 1, "complete": {complete}}}, {{"isl_tokens": 1}}]}}"#
        );
        let message = scenario_err(&text);
        assert_eq!(
            message,
            format!(
                "scenario s.json: requests[1]: complete: {shown} has not been sent yet \
                 (only earlier requests can complete)"
            )
        );
    }
    // Completing the same earlier request twice is harmless.
    let dir = temp_dir("hostile-complete-twice");
    let (code, lines, err) = select(
        &dir,
        "{}",
        r#"{"workers": [{"worker_id": 1}], "requests": [
            {"isl_tokens": 16}, {"isl_tokens": 16, "complete": [0, 0]}, {"isl_tokens": 16, "complete": [0]}]}"#,
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(lines.len(), 3);
    assert!(lines.iter().all(|l| l["worker_id"] == 1), "{lines:?}");
}

// --- workers ---------------------------------------------------------------------------------

#[test]
fn an_empty_worker_list_fails_every_request_with_no_endpoints_and_exits_1() {
    let dir = temp_dir("hostile-no-workers");
    let (code, lines, err) = select(
        &dir,
        "{}",
        r#"{"workers": [], "requests": [{"isl_tokens": 16}, {"isl_tokens": 16, "role": "decode"},
            {"isl_tokens": 16, "pinned_worker": {"worker_id": 3, "dp_rank": 0}}]}"#,
    );
    assert_eq!(code, 1, "{err}");
    assert_eq!(lines.len(), 3);
    for (index, line) in lines.iter().take(2).enumerate() {
        assert_eq!(line["request"], index);
        assert_eq!(
            line["error"],
            "no endpoints: no registered, available worker is allowed for this request"
        );
        assert!(line.get("worker_id").is_none(), "{line}");
    }
    assert_eq!(
        lines[2]["error"],
        "no endpoints: pinned worker 3:0 is unknown, has no such rank, or is unavailable"
    );
}

#[test]
fn duplicate_worker_ids_exit_2_naming_the_id() {
    let dir = temp_dir("hostile-dup-workers");
    let (code, lines, err) = select(
        &dir,
        "{}",
        r#"{"workers": [{"worker_id": 7}, {"worker_id": 3}, {"worker_id": 7, "dp_size": 2}],
            "requests": [{"isl_tokens": 16}]}"#,
    );
    assert_eq!(code, 2, "{err}");
    assert!(lines.is_empty());
    assert_contains(&err, &["scenario.json: workers: duplicate worker_id 7"]);
}

// --- sessions --------------------------------------------------------------------------------

#[test]
fn a_ten_kilobyte_session_id_is_a_request_error_naming_the_limit_without_echoing_the_id() {
    let dir = temp_dir("hostile-session-id");
    // A recognisable id: the tail must never appear in the output.
    let huge: String = (0..10 * 1024)
        .map(|i| char::from(b'a' + u8::try_from(i % 26).unwrap()))
        .collect();
    assert_eq!(huge.len(), 10_240);
    let scenario = serde_json::json!({
        "workers": [{"worker_id": 1}, {"worker_id": 2}],
        "requests": [
            {"isl_tokens": 16, "session_id": huge},
            {"isl_tokens": 16, "session_id": "ok"},
        ]
    });
    for mode in ["soft", "hard"] {
        let (code, lines, err) = select(
            &dir,
            &format!("{DYNAMO_WEIGHTS}session_affinity: {{mode: {mode}}}\n"),
            &scenario.to_string(),
        );
        assert_eq!(code, 1, "{err}");
        assert_eq!(lines.len(), 2);
        let error = lines[0]["error"].as_str().expect("error line");
        assert_eq!(
            error,
            "session: session id is 10240 bytes, over the 256-byte limit \
             (starts with \"abcdefghijklmnopqrstuvwxyzabcdef\"...)"
        );
        assert!(!err.contains(&huge[..64]), "stderr echoes the id");
        // The next request with a sane id is routed normally.
        assert_eq!(lines[1]["worker_id"], 1);
        assert_eq!(lines[1]["session"], "created");
    }
    // Without session affinity configured the id is not looked at: the request is routed.
    let (code, lines, err) = select(&dir, "{}", &scenario.to_string());
    assert_eq!(code, 0, "{err}");
    assert_eq!(lines[0]["worker_id"], 1);
    assert!(lines[0].get("session").is_none());
}

// --- scale -----------------------------------------------------------------------------------

/// 100,000 workers; one request that carries a row for every worker, all of them loaded and cold
/// except `cached`, which holds the whole 1,600-token prompt.
fn hundred_thousand_rows_scenario(cached: u64, extra_requests: &str) -> String {
    const WORKERS: u64 = 100_000;
    let mut text = String::with_capacity(12 << 20);
    text.push_str(r#"{"block_size": 16, "workers": ["#);
    for id in 0..WORKERS {
        if id > 0 {
            text.push(',');
        }
        text.push_str(&format!(r#"{{"worker_id":{id}}}"#));
    }
    text.push_str(r#"], "requests": [{"isl_tokens": 1600, "rows": ["#);
    for id in 0..WORKERS {
        if id > 0 {
            text.push(',');
        }
        let device = if id == cached { 100 } else { 0 };
        text.push_str(&format!(
            r#"{{"worker_id":{id},"device_blocks":{device},"active_requests":1}}"#
        ));
    }
    text.push_str("]}");
    text.push_str(extra_requests);
    text.push_str("]}");
    text
}

#[test]
fn a_hundred_thousand_rows_in_one_request_gives_the_correct_decision() {
    let dir = temp_dir("hostile-100k");
    let cached = 77_777;
    let (code, lines, err) = select(
        &dir,
        DYNAMO_WEIGHTS,
        &hundred_thousand_rows_scenario(cached, r#", {"isl_tokens": 16, "complete": [0]}"#),
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(lines.len(), 2);
    // Every other row would cost 100 prefill blocks; the cached one costs nothing.
    assert_eq!(lines[0]["worker_id"], cached);
    assert_eq!(lines[0]["policy"], "default");
    assert_eq!(lines[0]["reason"], "lowest_cost");
    assert_eq!(lines[0]["explain"]["fields"]["rows"], 100_000.0);
    assert_eq!(lines[0]["explain"]["fields"]["cost"], 0.0);
    // The second request has no injected rows; everything is idle again, so the lowest id wins.
    assert_eq!(lines[1]["worker_id"], 0);
}

#[test]
fn a_plugin_gets_a_hundred_thousand_rows_and_an_out_of_range_answer_falls_back() {
    let dir = temp_dir("hostile-100k-plugin");
    let probe = plugin("fixture_probe");
    let config = format!(
        "plugins:\n  - path: {}\nworker_selection:\n  aggregated: last\n  prefill: wild\n  instances:\n\
         \x20   - {{name: last, type: probe, parameters: {{return_index: 99999}}}}\n\
         \x20   - {{name: wild, type: probe, parameters: {{return_index: 18446744073709551615}}}}\n",
        probe.display()
    );
    let cached = 4_242;
    let (code, lines, err) = select(
        &dir,
        &config,
        &hundred_thousand_rows_scenario(
            cached,
            &format!(
                r#", {{"isl_tokens": 1600, "role": "prefill", "rows": [{{"worker_id": {cached}, "device_blocks": 100}}]}}"#
            ),
        ),
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(lines.len(), 2);
    // Index 99,999 of 100,000 rows in worker order is worker 99,999.
    assert_eq!(lines[0]["worker_id"], 99_999);
    assert_eq!(lines[0]["instance"], "last");
    assert_eq!(lines[0]["policy"], "probe");
    assert!(lines[0].get("fallback").is_none(), "{}", lines[0]);
    // usize::MAX is out of range: the built-in default decides over the same rows instead, and
    // picks the cached row.
    assert_eq!(lines[1]["worker_id"], cached);
    assert_eq!(lines[1]["instance"], "wild");
    assert_eq!(lines[1]["policy"], "default");
    assert_eq!(
        lines[1]["fallback"],
        "policy returned row index 18446744073709551615, but only 100000 rows were given"
    );
}

// --- arithmetic on hostile values ------------------------------------------------------------

#[test]
fn prompts_whose_sizes_overflow_u64_on_one_row_are_routed_not_a_panic() {
    // Regression for the overflow the `select_scenario` analysis found: two prompts of u64::MAX
    // tokens booked on the same row overflowed `active_prefill_tokens` (a panic in debug builds,
    // a silent wrap to a small load in release builds).
    let dir = temp_dir("hostile-isl-overflow");
    let (code, lines, err) = select(
        &dir,
        "{}",
        r#"{"workers": [{"worker_id": 1}], "requests": [
            {"isl_tokens": 18446744073709551615}, {"isl_tokens": 18446744073709551615},
            {"isl_tokens": 18446744073709551615, "complete": [0]}]}"#,
    );
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(code, 0, "{err}");
    assert_eq!(lines.len(), 3);
    assert!(lines.iter().all(|l| l["worker_id"] == 1), "{lines:?}");
}

#[test]
fn a_hundred_thousand_id_allow_list_over_a_hundred_thousand_workers_is_decided() {
    // `allowed_worker_ids` comes with the request. Every worker but the first 50,000 is allowed,
    // listed in reverse; all are idle and cold, so the lowest allowed id wins.
    const WORKERS: u64 = 100_000;
    let workers: Vec<Value> = (0..WORKERS)
        .map(|id| serde_json::json!({"worker_id": id}))
        .collect();
    let allowed: Vec<u64> = (WORKERS / 2..WORKERS).rev().collect();
    let scenario = serde_json::json!({
        "workers": workers,
        "requests": [{"isl_tokens": 16, "allowed_worker_ids": allowed}],
    });
    let dir = temp_dir("hostile-allow-list");
    let (code, lines, err) = select(&dir, DYNAMO_WEIGHTS, &scenario.to_string());
    assert_eq!(code, 0, "{err}");
    assert_eq!(lines[0]["worker_id"], WORKERS / 2);
}

#[test]
fn an_endless_scenario_file_is_refused_unread_and_a_regular_one_at_its_size_limit() {
    let dir = temp_dir("endless-scenario");
    let config = write(&dir, "router.yaml", "{}");
    let select = |scenario: &str| {
        run_cli(&[
            "select",
            "--config",
            config.to_str().unwrap(),
            "--scenario",
            scenario,
        ])
    };
    let (code, out, err) = select("/dev/zero");
    assert_eq!(code, 2, "{err}");
    assert!(out.is_empty());
    assert_eq!(
        err,
        "error: scenario /dev/zero: not a regular file (a character device); give the JSON file \
         itself\n"
    );
    // Sparse: refused by its size, nothing read.
    let big = dir.join("big.json");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(router_host::scenario::MAX_SCENARIO_BYTES + 1)
        .unwrap();
    let (code, out, err) = select(big.to_str().unwrap());
    assert_eq!(code, 2, "{err}");
    assert!(out.is_empty());
    assert_eq!(
        err,
        format!(
            "error: scenario {}: larger than 268435456 bytes\n",
            big.display()
        )
    );
}

// --- objects written as arrays ---------------------------------------------------------------

#[test]
fn a_scenario_or_a_trace_line_written_as_positional_arrays_is_refused_naming_the_place() {
    // serde's derived structs also take an array of their fields in order: this scenario was
    // worker 1 with dp_start 0 and two ranks, and the trace line a request of 512 tokens.
    let dir = temp_dir("hostile-positional");
    let (code, lines, err) = select(
        &dir,
        "{}",
        r#"{"workers": [[1, 0, 2]], "requests": [{"isl_tokens": 1}]}"#,
    );
    assert_eq!(code, 2, "{err}");
    assert!(lines.is_empty());
    assert_eq!(
        err,
        format!(
            "error: scenario {}: line 1 column 13: workers[0]: invalid type: sequence, expected a \
             worker object with `worker_id`\n",
            dir.join("scenario.json").display()
        )
    );
    let trace = write(&dir, "trace.jsonl", "[0, 512, 1, [1]]\n");
    let (code, out, err) = run_cli(&["replay", "--trace", path_str(&trace)]);
    assert_eq!((code, out.as_str()), (1, ""), "{err}");
    assert_eq!(
        err,
        format!(
            "error: trace {}: line 1: expected a JSON object, got an array [0,512,1,[1]]\n",
            trace.display()
        )
    );
}

#[test]
fn every_mapping_of_the_config_refuses_a_sequence() {
    // serde_yaml reads a struct from a mapping only; this keeps it so, section by section.
    for (text, expected) in [
        ("[16]", "line 1 column 1: invalid type: sequence, expected a mapping of router settings"),
        ("default_selector: [1]", "line 1 column 19: default_selector: invalid type: sequence, expected a `default_selector` mapping"),
        ("booking: [prompt]", "line 1 column 10: booking: invalid type: sequence, expected a `booking` mapping"),
        ("plugins: [[x]]", "line 1 column 11: plugins[0]: invalid type: sequence, expected a plugin entry mapping with `path` or `name`"),
        ("worker_selection: [a]", "line 1 column 19: worker_selection: invalid type: sequence, expected a `worker_selection` mapping"),
        ("worker_selection: {instances: [[a, round-robin]]}", "line 1 column 32: worker_selection.instances[0]: invalid type: sequence, expected an instance mapping with `name` and `type`"),
        ("policy_classes: [[a, 1]]", "line 1 column 18: policy_classes[0]: invalid type: sequence, expected a policy class mapping with `name`"),
        ("session_affinity: [soft]", "line 1 column 19: session_affinity: invalid type: sequence, expected a `session_affinity` mapping with `mode`"),
        ("session_affinity: {mode: soft, store: [memory]}", "line 1 column 39: session_affinity.store: invalid type: sequence, expected a `store` mapping with `kind` (`memory` or `redis`)"),
        ("workers: [[1, \"http://a:1\"]]", "line 1 column 11: workers[0]: invalid type: sequence, expected a worker mapping with `id` and `url`"),
        ("workers: [{id: 1, url: \"http://a:1\", kv_events: [\"tcp://a:1\"]}]", "line 1 column 49: workers[0].kv_events: invalid type: sequence, expected a `kv_events` mapping with `endpoint`"),
        ("serve: [a]", "line 1 column 8: serve: invalid type: sequence, expected a `serve` mapping"),
        ("serve: {timeouts: [1]}", "line 1 column 19: serve.timeouts: invalid type: sequence, expected a `serve.timeouts` mapping"),
        ("serve: {health: [1]}", "line 1 column 17: serve.health: invalid type: sequence, expected a `serve.health` mapping"),
        ("serve: {tokenizer: [a]}", "line 1 column 20: serve.tokenizer: invalid type: sequence, expected `remote` or a mapping `{path: DIR}`"),
    ] {
        assert_eq!(config_err(text), format!("config <string>: {expected}"), "{text}");
    }
}
