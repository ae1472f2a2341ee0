//! The shipped policies as operators run them: real `.so` files, YAML configs, the CLI.

mod common;

use std::path::{Path, PathBuf};

use common::{plugin_dir, run_cli, temp_dir, write};

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

fn json_lines(out: &str) -> Vec<serde_json::Value> {
    out.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// A config using the two-tier plugin with `parameters` (a YAML flow mapping).
fn two_tier(dir: &Path, parameters: &str) -> PathBuf {
    write(
        dir,
        "router.yaml",
        &format!(
            "plugins:\n  - path: {}\nworker_selection:\n  aggregated: t\n  instances:\n    - name: t\n      type: dynamo-two-tier-cost-fn\n      parameters: {parameters}\n",
            common::plugin("two_tier_cost_fn").display()
        ),
    )
}

fn select(config: &Path, scenario: &Path) -> (i32, Vec<serde_json::Value>, String) {
    let (code, out, err) = run_cli(&[
        "select",
        "--config",
        config.to_str().unwrap(),
        "--scenario",
        scenario.to_str().unwrap(),
    ]);
    (code, json_lines(&out), err)
}

#[test]
fn soft_pin_repin_example_walkthrough_goes_a_b_b_as_its_readme_shows() {
    let (code, out, err) = run_cli(&[
        "select",
        "--plugin-dir",
        plugin_dir().to_str().unwrap(),
        "--config",
        repo("examples/soft-pin-repin/router.yaml")
            .to_str()
            .unwrap(),
        "--scenario",
        repo("examples/soft-pin-repin/scenario.json")
            .to_str()
            .unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let readme = std::fs::read_to_string(repo("examples/soft-pin-repin/README.md")).unwrap();
    for line in out.lines() {
        assert!(
            readme.contains(line),
            "README does not show the real output line {line}"
        );
    }
    let lines = json_lines(&out);
    let workers: Vec<u64> = lines
        .iter()
        .map(|l| l["worker_id"].as_u64().unwrap())
        .collect();
    assert_eq!(workers, [29, 41, 41]);
    let sessions: Vec<&str> = lines
        .iter()
        .map(|l| l["session"].as_str().unwrap())
        .collect();
    assert_eq!(sessions, ["created", "moved", "kept"]);
}

/// (parameters, rows of A and B as (device, host, active), target worker, expected worker).
type Case = (&'static str, [(u32, u32, u32); 2], Option<u64>, u64);

#[test]
fn two_tier_decisions_through_the_loaded_plugin_follow_the_conformance_table() {
    let dir = temp_dir("two-tier-table");
    // Rows written (device, host, active) for A = 29 and B = 41; block_size 16, isl 160: R = 10.
    let cases: &[Case] = &[
        ("{}", [(0, 0, 0), (6, 0, 4)], None, 41),
        ("{}", [(0, 0, 0), (5, 0, 4)], None, 29),
        ("{cache_threshold: 0.2}", [(0, 0, 0), (3, 0, 4)], None, 41),
        ("{}", [(0, 0, 0), (10, 0, 40)], None, 29),
        ("{}", [(0, 0, 640), (10, 0, 704)], None, 41),
        ("{}", [(0, 0, 640), (10, 0, 705)], None, 29),
        ("{}", [(0, 0, 0), (0, 8, 4)], None, 41),
        ("{host_cache_weight: 0}", [(0, 0, 0), (0, 8, 4)], None, 29),
        ("{}", [(0, 0, 0), (6, 0, 4)], Some(29), 41),
        (
            "{respect_soft_affinity: true}",
            [(0, 0, 0), (6, 0, 4)],
            Some(29),
            29,
        ),
        (
            "{respect_soft_affinity: true}",
            [(0, 0, 0), (6, 0, 4)],
            Some(999),
            41,
        ),
        (
            "{respect_soft_affinity: true}",
            [(0, 0, 40), (0, 0, 2)],
            Some(29),
            29,
        ),
        (
            "{respect_soft_affinity: true, soft_affinity_load_gate: true}",
            [(0, 0, 40), (0, 0, 2)],
            Some(29),
            41,
        ),
        (
            "{respect_soft_affinity: true, soft_affinity_load_gate: true}",
            [(0, 0, 30), (0, 0, 2)],
            Some(29),
            29,
        ),
    ];
    for (i, (params, rows, target, expected)) in cases.iter().enumerate() {
        // The design's table is the seed's behaviour: Dynamo's `active_requests` signal, no
        // cache gate on a soft target.
        let params = params.replacen(
            '{',
            "{load_signal: active_requests, soft_affinity_cache_gate: false, ",
            1,
        );
        let params = params.replace(", }", "}");
        let config = two_tier(&dir, &params);
        let row = |w: u64, (device, host, active): (u32, u32, u32)| {
            format!(
                r#"{{"worker_id": {w}, "device_blocks": {device}, "host_blocks": {host}, "active_requests": {active}}}"#
            )
        };
        let target = target
            .map(|t| format!(r#", "affinity_target": {{"worker_id": {t}, "dp_rank": null}}"#))
            .unwrap_or_default();
        let scenario = write(
            &dir,
            "scenario.json",
            &format!(
                r#"{{"block_size": 16, "workers": [{{"worker_id": 29}}, {{"worker_id": 41}}],
                    "requests": [{{"isl_tokens": 160{target}, "rows": [{}, {}]}}]}}"#,
                row(29, rows[0]),
                row(41, rows[1])
            ),
        );
        let (code, lines, err) = select(&config, &scenario);
        assert_eq!(code, 0, "case {i}: {err}");
        assert_eq!(
            lines[0]["worker_id"], *expected,
            "case {i} ({params}, {rows:?}, target {target})"
        );
        assert_eq!(lines[0]["policy"], "dynamo-two-tier-cost-fn");
    }
}

/// Idle equal workers, as behind instant engines: each request completes the one before it, so
/// every request sees two idle, cold rows. Returns requests per worker (1, 2).
fn two_tier_idle_split(dir: &Path, parameters: &str) -> [usize; 2] {
    let config = two_tier(dir, parameters);
    let requests: Vec<String> = (0..200)
        .map(|i| {
            let complete = if i == 0 {
                String::new()
            } else {
                format!(r#", "complete": [{}]"#, i - 1)
            };
            format!(r#"{{"isl_tokens": {}{complete}}}"#, 100 + 7 * i)
        })
        .collect();
    let scenario = write(
        dir,
        "idle.json",
        &format!(
            r#"{{"block_size": 16, "workers": [{{"worker_id": 1}}, {{"worker_id": 2}}], "requests": [{}]}}"#,
            requests.join(", ")
        ),
    );
    let (code, lines, err) = select(&config, &scenario);
    assert_eq!(code, 0, "{err}");
    assert_eq!(lines.len(), 200);
    let mut split = [0, 0];
    for line in &lines {
        assert_eq!(line["policy"], "dynamo-two-tier-cost-fn", "{line}");
        assert_eq!(line["reason"], "least_loaded_no_cache_winner", "{line}");
        split[line["worker_id"].as_u64().unwrap() as usize - 1] += 1;
    }
    split
}

#[test]
fn two_tier_spreads_idle_equal_workers_and_lowest_row_restores_the_pile_up() {
    let dir = temp_dir("two-tier-ties");
    // 100 expected on each; outside 70..=130 the draw would be broken, not unlucky.
    let [one, two] = two_tier_idle_split(&dir, "{}");
    assert!((70..=130).contains(&one), "spread: {one} / {two}");
    assert_eq!(two_tier_idle_split(&dir, "{tie_break: spread}"), [one, two]);
    // Reproducible: the same scenario splits the same way.
    assert_eq!(two_tier_idle_split(&dir, "{}"), [one, two]);
    assert_eq!(
        two_tier_idle_split(&dir, "{tie_break: lowest_row}"),
        [200, 0]
    );
}

#[test]
fn two_tier_parameter_errors_name_the_key_and_explain_the_range() {
    let dir = temp_dir("two-tier-params");
    for (params, fragments) in [
        (
            "{cache_affinity_threshold: 0.5}",
            &[
                "instance `t` (type `dynamo-two-tier-cost-fn`",
                "parameter `cache_affinity_threshold`",
                "unknown field",
            ][..],
        ),
        (
            "{cache_threshold: 1.1}",
            &["parameter `cache_threshold`", "0.0..=1.0", "1.1"][..],
        ),
        (
            "{balance_rel_threshold: 0.9}",
            &["parameter `balance_rel_threshold`", ">= 1.0", "0.9"][..],
        ),
        (
            "{host_cache_weight: -0.1}",
            &["parameter `host_cache_weight`", "-0.1"][..],
        ),
        ("{cache_threshold: .nan}", &["cache_threshold", "NaN"][..]),
    ] {
        let config = two_tier(&dir, params);
        let (code, _, err) = run_cli(&["check", "--config", config.to_str().unwrap()]);
        assert_eq!(code, 1, "{params}: {err}");
        for fragment in fragments {
            assert!(
                err.contains(fragment),
                "{params}: `{fragment}` not in {err}"
            );
        }
    }
}

#[test]
fn soft_pin_repin_requires_its_threshold() {
    let dir = temp_dir("repin-params");
    let config = write(
        &dir,
        "router.yaml",
        &format!(
            "plugins: [{{path: {}}}]\nworker_selection:\n  aggregated: r\n  instances:\n    - {{name: r, type: soft-pin-repin}}\n",
            common::plugin("soft_pin_repin").display()
        ),
    );
    let (code, _, err) = run_cli(&["check", "--config", config.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        err.contains("parameter `max_active_requests`: missing field `max_active_requests`"),
        "{err}"
    );
}

#[test]
fn describe_prints_each_shipped_policy_with_parameter_defaults() {
    let (code, out, err) = run_cli(&[
        "describe",
        common::plugin("two_tier_cost_fn").to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("policy type `dynamo-two-tier-cost-fn`"),
        "{out}"
    );
    for param in [
        "cache_threshold (f64, default 0.5)",
        "balance_abs_threshold (u64, default 32)",
        "balance_rel_threshold (f64, default 1.1)",
        "respect_soft_affinity (bool, default false)",
        "tie_break (string, default spread)",
        "host_cache_weight (",
    ] {
        assert!(out.contains(param), "`{param}` not in {out}");
    }
    let (code, out, err) = run_cli(&[
        "describe",
        common::plugin("soft_pin_repin").to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("policy type `soft-pin-repin`"), "{out}");
    assert!(out.contains("max_active_requests (u64, required)"), "{out}");
}

#[test]
fn every_example_config_loads() {
    let examples = repo("examples");
    let mut configs: Vec<PathBuf> = Vec::new();
    for dir in [
        examples.clone(),
        examples.join("soft-pin-repin"),
        examples.join("replay"),
    ] {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "yaml") {
                configs.push(path);
            }
        }
    }
    assert!(configs.len() >= 10, "{configs:?}");
    for config in configs {
        let (code, out, err) = run_cli(&[
            "check",
            "--plugin-dir",
            plugin_dir().to_str().unwrap(),
            "--config",
            config.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{}: {err}", config.display());
        assert!(out.contains(": OK"), "{out}");
        // The multi-turn example's capacity limit counts shared prompt blocks once
        // (docs/policies/two-tier-cost-fn.md).
        if config.ends_with("two-tier-soft-affinity.yaml") {
            assert!(
                out.contains("booking: prefill uncached, decode deduplicated"),
                "{out}"
            );
        }
    }
}
