//! Unit tests of the configuration parser.

use plugin_api::Role;

use super::limits::{nesting_too_deep, TooDeep};
use super::locate::PROBE_HIT;
use super::*;

fn parse(text: &str) -> RouterConfig {
    parse_from(text, None)
}

/// Parses `text` as if read from the file `source`.
fn parse_from(text: &str, source: Option<&str>) -> RouterConfig {
    match RouterConfig::from_yaml_str(text, source.map(Path::new)) {
        Ok(config) => config,
        Err(err) => panic!("unexpected error: {err}"),
    }
}

fn parse_err(text: &str) -> String {
    match RouterConfig::from_yaml_str(text, None) {
        Ok(config) => panic!("expected an error, got {config:?}"),
        Err(err) => err.to_string(),
    }
}

#[test]
fn empty_text_is_all_defaults() {
    for text in [
        "",
        "\n\n",
        "# only a comment\n# and another\n",
        "---\n",
        "~\n",
        "null",
    ] {
        assert_eq!(parse(text), RouterConfig::default(), "text {text:?}");
    }
}

#[test]
fn defaults_match_the_design() {
    let config = RouterConfig::default();
    assert_eq!(config.block_size, 16);
    assert_eq!(config.host_cache_hit_weight, 0.75);
    assert_eq!(config.disk_cache_hit_weight, 0.25);
    // The settings measured best (docs/replay.md), not Dynamo's weights.
    assert_eq!(config.default_selector.prefill_load_scale, 20.0);
    assert_eq!(config.default_selector.decode_active_request_weight, 0.0);
    assert_eq!(config.default_selector.overlap_credit, 1.5);
    assert_eq!(config.default_selector.tie_break, TieBreak::Spread);
    assert_eq!(config.default_selector.room, Room::Free);
    assert_eq!(config.default_selector.live_eviction_weight, 0.25);
    assert_eq!(
        config.kv_recent_window, None,
        "the recent-use window is off"
    );
    assert_eq!(config.booking.prefill, PrefillBooking::Uncached);
    assert_eq!(config.booking.decode, DecodeBooking::Prompt);
    // A mapping that sets none of them is the same as no mapping.
    assert_eq!(
        parse(
            "default_selector: {}
booking: {}
"
        ),
        config
    );
    assert!(config.plugins.is_empty());
    assert!(config.session_affinity.is_none());
    assert!(config.policy_classes.is_empty());
    assert!(config.engine.is_none());
    for role in [
        Role::Aggregated,
        Role::Prefill,
        Role::Decode,
        Role::Other(9),
    ] {
        assert_eq!(config.worker_selection.instance_for(role), DEFAULT_INSTANCE);
    }
}

#[test]
fn null_values_take_defaults() {
    let config = parse(
        "block_size:\nhost_cache_hit_weight: ~\ndefault_selector:\nplugins:\n\
         worker_selection:\npolicy_classes:\nengine:\nsession_affinity:\n",
    );
    assert_eq!(config, RouterConfig::default());
}

const FULL: &str = r#"# router settings
block_size: 32
host_cache_hit_weight: 0.5
disk_cache_hit_weight: 0
default_selector:
  prefill_load_scale: 2
  decode_active_request_weight: 0.125
plugins:
  - path: ./lib/libfoo.so
  - name: two_tier_cost_fn
    sha256: "ABCDEF0123456789abcdef0123456789ABCDEF0123456789abcdef0123456789"
    allow_insecure_permissions: true
  - path: /opt/plugins/libbar.so
worker_selection:
  aggregated: two-tier
  prefill: default
  decode: repin.v2
  instances:
    - name: two-tier
      type: dynamo-two-tier-cost-fn
      parameters: {cache_threshold: 0.5, tiers: [1, -2, "x"], nested: {ok: true, none: ~}}
      on_error: fail
      pick_budget_us: 250
    - name: repin.v2
      type: soft-pin-repin
session_affinity:
  mode: hard
  ttl_secs: 30
  max_bindings: 10
policy_classes:
  - name: interactive
    prefill_busy_threshold: 8192
    admission: chosen_row
  - name: batch
    prefill_busy_threshold_frac: 1.5
  - name: default
    prefill_busy_threshold: 0
    prefill_busy_threshold_frac: 0.5
engine:
  workers: [{id: 1}]
  speed: 1.5
"#;

#[test]
fn full_config_parses() {
    let config = parse_from(FULL, Some("/etc/router/r.yaml"));
    assert_eq!(
        config.source.as_deref(),
        Some(Path::new("/etc/router/r.yaml"))
    );
    assert_eq!(config.block_size, 32);
    assert_eq!(config.host_cache_hit_weight, 0.5);
    assert_eq!(config.disk_cache_hit_weight, 0.0);
    assert_eq!(
        config.default_selector,
        DefaultSelectorConfig {
            prefill_load_scale: 2.0,
            decode_active_request_weight: 0.125,
            ..DefaultSelectorConfig::default()
        }
    );

    assert_eq!(
        config.plugins,
        vec![
            PluginSpec {
                source: PluginSource::Path(PathBuf::from("/etc/router/./lib/libfoo.so")),
                sha256: None,
                allow_insecure_permissions: false,
                line: Some(9),
            },
            PluginSpec {
                source: PluginSource::Name("two_tier_cost_fn".to_owned()),
                sha256: Some(
                    "abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789".to_owned()
                ),
                allow_insecure_permissions: true,
                line: Some(10),
            },
            PluginSpec {
                source: PluginSource::Path(PathBuf::from("/opt/plugins/libbar.so")),
                sha256: None,
                allow_insecure_permissions: false,
                line: Some(13),
            },
        ]
    );

    let ws = &config.worker_selection;
    assert_eq!(ws.instance_for(Role::Aggregated), "two-tier");
    assert_eq!(ws.instance_for(Role::Prefill), "default");
    assert_eq!(ws.instance_for(Role::Decode), "repin.v2");
    assert_eq!(ws.instances.len(), 2);
    let two_tier = &ws.instances[0];
    assert_eq!(two_tier.name, "two-tier");
    assert_eq!(two_tier.type_name, "dynamo-two-tier-cost-fn");
    assert_eq!(
        two_tier.parameters_json,
        // Keys keep their YAML order.
        r#"{"cache_threshold":0.5,"tiers":[1,-2,"x"],"nested":{"ok":true,"none":null}}"#
    );
    assert_eq!(two_tier.on_error, OnError::Fail);
    assert_eq!(two_tier.pick_budget, Duration::from_micros(250));
    assert_eq!(two_tier.line, Some(19));
    let repin = match ws.instance("repin.v2") {
        Some(instance) => instance,
        None => panic!("repin.v2 missing"),
    };
    assert_eq!(repin.parameters_json, "{}");
    assert_eq!(repin.on_error, OnError::Fallback);
    assert_eq!(repin.pick_budget, DEFAULT_PICK_BUDGET);
    assert_eq!(repin.line, Some(24));
    assert!(ws.instance("default").is_none());

    assert_eq!(
        config.session_affinity,
        Some(SessionAffinityConfig {
            mode: AffinityMode::Hard,
            ttl: Duration::from_secs(30),
            max_bindings: 10,
        })
    );
    assert_eq!(
        config.policy_classes,
        vec![
            PolicyClassConfig {
                name: "interactive".to_owned(),
                prefill_busy_threshold: Some(8192),
                prefill_busy_threshold_frac: None,
                admission: AdmissionMode::ChosenRow,
                max_queue_wait: None,
                priority: 0,
                max_engine_waiting: None,
                max_kv_usage: None,
            },
            PolicyClassConfig {
                name: "batch".to_owned(),
                prefill_busy_threshold: None,
                prefill_busy_threshold_frac: Some(1.5),
                admission: AdmissionMode::AnyEligible,
                max_queue_wait: None,
                priority: 0,
                max_engine_waiting: None,
                max_kv_usage: None,
            },
            PolicyClassConfig {
                name: "default".to_owned(),
                prefill_busy_threshold: Some(0),
                prefill_busy_threshold_frac: Some(0.5),
                admission: AdmissionMode::AnyEligible,
                max_queue_wait: None,
                priority: 0,
                max_engine_waiting: None,
                max_kv_usage: None,
            },
        ]
    );
    assert_eq!(
        config.policy_class("batch").map(|c| c.admission),
        Some(AdmissionMode::AnyEligible)
    );
    assert_eq!(
        config.engine,
        Some(serde_json::json!({"workers": [{"id": 1}], "speed": 1.5}))
    );
}

#[test]
fn session_affinity_defaults() {
    let config = parse("session_affinity: {mode: soft}");
    assert_eq!(
        config.session_affinity,
        Some(SessionAffinityConfig {
            mode: AffinityMode::Soft,
            ttl: DEFAULT_SESSION_TTL,
            max_bindings: DEFAULT_MAX_BINDINGS,
        })
    );
}

#[test]
fn worker_selection_without_roles_uses_default_everywhere() {
    let config =
        parse("worker_selection:\n  instances:\n    - {name: a, type: t, parameters: null}\n");
    let ws = &config.worker_selection;
    assert_eq!(ws.aggregated, "default");
    assert_eq!(ws.prefill, "default");
    assert_eq!(ws.decode, "default");
    assert_eq!(ws.instances[0].parameters_json, "{}");
    assert_eq!(ws.instances[0].line, Some(3));
}

#[test]
fn explicit_default_role_is_accepted() {
    let config = parse("worker_selection: {aggregated: default, decode: ~}");
    assert_eq!(config.worker_selection, WorkerSelectionConfig::default());
}

#[test]
fn relative_plugin_paths_resolve_against_the_yaml_directory() {
    let config = parse_from(
        "plugins: [{path: libx.so}, {path: ../y/liby.so}]",
        Some("/srv/conf/router.yaml"),
    );
    assert_eq!(
        config.plugins[0].source,
        PluginSource::Path(PathBuf::from("/srv/conf/libx.so"))
    );
    assert_eq!(
        config.plugins[1].source,
        PluginSource::Path(PathBuf::from("/srv/conf/../y/liby.so"))
    );
    // Flow style still finds the entry's line.
    assert_eq!(config.plugins[1].line, Some(1));
}

#[test]
fn relative_plugin_paths_without_source_resolve_against_the_current_directory() {
    let cwd = match std::env::current_dir() {
        Ok(cwd) => cwd,
        Err(err) => panic!("{err}"),
    };
    let config = parse("plugins:\n  - path: lib/libx.so\n");
    assert_eq!(
        config.plugins[0].source,
        PluginSource::Path(cwd.join("lib/libx.so"))
    );
    // A source file given by a bare relative name also means the current directory.
    let config = parse_from("plugins:\n  - path: libx.so\n", Some("router.yaml"));
    assert_eq!(
        config.plugins[0].source,
        PluginSource::Path(cwd.join("libx.so"))
    );
}

#[test]
fn config_dir_is_the_file_directory_or_dot() {
    assert_eq!(
        config_dir(Path::new("/srv/conf/router.yaml")),
        Some(Path::new("/srv/conf"))
    );
    assert_eq!(
        config_dir(Path::new("conf/router.yaml")),
        Some(Path::new("conf"))
    );
    assert_eq!(config_dir(Path::new("router.yaml")), Some(Path::new(".")));
    assert_eq!(config_dir(Path::new("/")), None);
    assert_eq!(config_dir(Path::new("")), None);
}

#[test]
fn parameters_json_handles_anchors_and_big_and_negative_numbers() {
    let config = parse(
        "worker_selection:\n  instances:\n\
         \x20   - {name: a, type: t, parameters: &p {x: 18446744073709551615, y: -3, z: 1e3}}\n\
         \x20   - {name: b, type: t, parameters: *p}\n",
    );
    let ws = &config.worker_selection;
    assert_eq!(
        ws.instances[0].parameters_json,
        r#"{"x":18446744073709551615,"y":-3,"z":1000.0}"#
    );
    assert_eq!(
        ws.instances[1].parameters_json,
        ws.instances[0].parameters_json
    );
}

#[test]
fn crlf_and_bom_are_accepted() {
    let config = parse("\u{feff}block_size: 8\r\nworker_selection:\r\n  instances:\r\n    - name: a\r\n      type: t\r\n");
    assert_eq!(config.block_size, 8);
    assert_eq!(config.worker_selection.instances[0].line, Some(4));
}

#[test]
fn sha256_is_stored_lowercase() {
    let upper = "F".repeat(64);
    let config = parse(&format!("plugins: [{{name: foo, sha256: {upper}}}]"));
    assert_eq!(config.plugins[0].sha256, Some("f".repeat(64)));
}

#[test]
fn error_display_names_string_source_line_and_key() {
    let message = parse_err("block_size: 16\nworker_selection:\n  decode: nope\n");
    assert!(
        message.starts_with("config <string>: line 3 column 11: worker_selection.decode: "),
        "{message}"
    );
    assert!(message.contains("`nope`"), "{message}");
}

#[test]
fn error_accessors() {
    let err = match RouterConfig::from_yaml_str("block_size: 0\n", Some(Path::new("a.yaml"))) {
        Ok(config) => panic!("expected an error, got {config:?}"),
        Err(err) => err,
    };
    assert_eq!(err.file(), Some(Path::new("a.yaml")));
    assert_eq!(err.line(), Some(1));
    assert_eq!(err.column(), Some(13));
    assert_eq!(err.key_path(), Some("block_size"));
    assert!(matches!(err.kind(), ConfigErrorKind::Yaml { .. }));
}

#[test]
fn hostile_inputs_are_errors_not_panics() {
    let deep = format!("engine: {}{}", "[".repeat(1_000), "]".repeat(1_000));
    let laughs = "engine:\n\
                  \x20 a: &a [x, x, x, x, x, x, x, x, x, x]\n\
                  \x20 b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n\
                  \x20 c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\n\
                  \x20 d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n\
                  \x20 e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\n\
                  \x20 f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n\
                  \x20 g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f, *f]\n\
                  \x20 h: [*g, *g, *g, *g, *g, *g, *g, *g, *g, *g, .nan]\n";
    for text in [
        "block_size: 99999999999999999999",
        "block_size: 999999999999999999999999999999999999999999999999",
        "block_size: -1",
        "block_size: 1.5",
        "block_size: \"16\"",
        "block_size: [16]",
        "host_cache_hit_weight: .nan",
        "host_cache_hit_weight: -.inf",
        "host_cache_hit_weight: 1e999",
        "block_size: 1\nblock_size: 2",
        "worker_selection: {instances: [{name: a, type: t, parameters: {k: 1, k: 2}}]}",
        "worker_selection: {instances: [~]}",
        "plugins: [{path: \"a\\0b\"}]",
        "worker_selection: {instances: [{name: a, type: t, parameters: {k: .nan}}]}",
        "worker_selection: {instances: [{name: a, type: t, parameters: {1: x}}]}",
        "worker_selection: {instances: [{name: a, type: t, parameters: !foo {k: 1}}]}",
        "worker_selection:\n  instances:\n    - name: \"two",
        "plugins: [",
        "{",
        "- a\n- b",
        "--- 1\n--- 2\n",
        "a: *missing",
        deep.as_str(),
        laughs,
    ] {
        let message = parse_err(text);
        assert!(message.starts_with("config <string>: "), "{message}");
        assert!(!message.contains(PROBE_HIT), "{message}");
    }
}

#[test]
fn enum_values_of_the_wrong_shape_name_the_accepted_values() {
    // Found by the hostile-input tests: a sequence or mapping given for an enum
    // used to read "expected a YAML tag starting with '!'".
    for (text, expected) in [
        (
            "session_affinity: {mode: [soft]}",
            "line 1 column 26: session_affinity.mode: invalid type: sequence, expected `soft` or `hard`",
        ),
        (
            "session_affinity: {mode: ~}",
            "line 1 column 26: session_affinity.mode: invalid type: null, expected `soft` or `hard`",
        ),
        (
            "session_affinity: {mode: sticky}",
            "session_affinity.mode: unknown variant `sticky`, expected `soft` or `hard`",
        ),
        (
            "worker_selection: {instances: [{name: a, type: t, on_error: {fail: 1}}]}",
            "worker_selection.instances[0].on_error: invalid type: map, expected `fallback` or `fail`",
        ),
        (
            "policy_classes: [{name: a, prefill_busy_threshold: 1, admission: [chosen_row]}]",
            "policy_classes[0].admission: invalid type: sequence, expected `any_eligible` or `chosen_row`",
        ),
    ] {
        let message = parse_err(text);
        assert!(message.contains(expected), "{text}: {message}");
    }
    // Null still means "absent" for the optional ones.
    let config = parse(
        "worker_selection: {instances: [{name: a, type: t, on_error: ~}]}\n\
         policy_classes: [{name: c, prefill_busy_threshold: 1, admission: ~}]\n",
    );
    assert_eq!(
        config.worker_selection.instances[0].on_error,
        OnError::Fallback
    );
    assert_eq!(
        config.policy_classes[0].admission,
        AdmissionMode::AnyEligible
    );
}

#[test]
fn integers_written_as_overflowing_floats_say_so() {
    // Found by the hostile-input tests: `1e400` used to read as `string "1e400"`.
    let message =
        parse_err("worker_selection: {instances: [{name: a, type: t, pick_budget_us: 1e400}]}");
    assert!(
        message.contains(
            "pick_budget_us: invalid type: floating point `1e400` (overflows to infinity), \
             expected an integer >= 1"
        ),
        "{message}"
    );
    let message = parse_err("block_size: 1e30");
    assert!(
        message.contains("block_size: invalid type: floating point"),
        "{message}"
    );
    // A spelled-out infinity is still just a wrong type.
    let message = parse_err("block_size: inf");
    assert!(
        message.contains("invalid type: string \"inf\""),
        "{message}"
    );
}

#[test]
fn deep_flow_nesting_is_refused_before_the_yaml_scanner_runs() {
    // Found by the hostile-input tests: the scanner's time grows with tokens times
    // flow depth, so 100,000 nested `[` took minutes before the recursion limit refused them.
    let deep = format!(
        "engine:\n  x: {}{}\n",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    let started = std::time::Instant::now();
    let message = parse_err(&deep);
    assert_eq!(
        message,
        "config <string>: line 2 column 134: recursion limit exceeded: `[` and `{` nested \
         more than 128 levels deep"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    // 128 levels are left to the parser (which refuses them: its limit counts the
    // enclosing block mappings too); brackets in comments and quoted scalars do not count.
    let at_limit = format!("engine: {}{}\n", "[".repeat(128), "]".repeat(128));
    assert!(parse_err(&at_limit).contains("line 1 column"));
    let open = "[".repeat(300);
    let config = parse(&format!(
        "# {open}\nengine: {{a: \"{open}\", b: '{open}''{open}', c: \"\\\"{open}\"}} # {open}\n"
    ));
    assert_eq!(
        config
            .engine
            .as_ref()
            .and_then(|e| e["a"].as_str())
            .map(str::len),
        Some(300)
    );
    assert_eq!(nesting_too_deep("a: \"x\\\n[\"\nb: 1"), None);
    assert_eq!(
        nesting_too_deep(&format!("a: 1\nb: \"q\\\n\"\nc: {}", "{".repeat(129))),
        Some(TooDeep::Flow {
            line: 4,
            column: 132
        })
    );
}

/// What the pre-scan says about `text` followed by 129 nested `[`.
fn flow_refused_after(text: &str) -> Option<TooDeep> {
    nesting_too_deep(&format!("{text}{}", "[".repeat(129)))
}

#[test]
fn quotes_in_plain_text_do_not_hide_flow_nesting() {
    let flow = |line, column| Some(TooDeep::Flow { line, column });
    // An apostrophe inside a plain scalar is text, not the start of a quoted scalar.
    assert_eq!(flow_refused_after("note: rock 'n roll\nx: "), flow(2, 132));
    assert_eq!(flow_refused_after("note: it\"s\nx: "), flow(2, 132));
    // ... on a continuation line of a multi-line plain scalar too,
    assert_eq!(flow_refused_after("a: x\n  'y\nb: "), flow(3, 132));
    // ... and on any line of a plain scalar inside a flow collection.
    assert_eq!(flow_refused_after("a: [x\n'y]\nb: "), flow(3, 132));
    assert_eq!(flow_refused_after("a: [x 'y, z\"]\nb: "), flow(2, 132));
    // A block scalar's lines are text, quotes and brackets alike; the line after it is not.
    assert_eq!(flow_refused_after("a: |\n  'x\n  [[\nb: "), flow(4, 132));
    assert_eq!(flow_refused_after("a: >2\n   'x\n\n  y\nb: "), flow(5, 132));
    assert_eq!(flow_refused_after("- a: |\n    'x\n  b: "), flow(3, 134));
    // A tag or anchor may hold an apostrophe; it is still not a quote.
    assert_eq!(flow_refused_after("a: !x'y\nb: "), flow(2, 132));
    assert_eq!(flow_refused_after("a: &x 'q'\nb: "), flow(2, 132));
    // Every YAML line break ends a comment (libyaml: CR, LF, NEL, LS, PS).
    for lb in ["\r", "\r\n", "\u{85}", "\u{2028}", "\u{2029}"] {
        assert_eq!(
            flow_refused_after(&format!("# c{lb}x: ")),
            flow(2, 132),
            "{lb:?}"
        );
    }
    // `#` inside plain text is text; after a blank it starts a comment.
    assert_eq!(flow_refused_after("a: x#'\nb: "), flow(2, 132));
    // Quotes that do start quoted scalars still hide what they hold.
    for text in [
        "a: '[[' \nb: ",
        "- \"]]\"\n- ",
        "{a: '}', b: \"]\"}\nc: ",
        "a:\n  'k ]': 1\nb: ",
        "[x, 'y]', \"z]\"]\nb: ",
    ] {
        assert!(flow_refused_after(text).is_some(), "{text:?}");
    }
    assert_eq!(
        nesting_too_deep(&format!(
            "a: '{}'\nb: \"{}\"\n",
            "[".repeat(300),
            "{".repeat(300)
        )),
        None
    );
    assert_eq!(
        nesting_too_deep(&format!("a: |\n  {}\n  '\nb: 1\n", "[".repeat(300))),
        None
    );
    // Multi-byte characters count as one column, as in libyaml.
    assert_eq!(flow_refused_after("é: "), flow(1, 132));
}

#[test]
fn deep_block_nesting_is_refused_before_the_yaml_parser_runs() {
    let block = |line, column| Some(TooDeep::Block { line, column });
    // `- - - ...`: each `- ` opens a sequence one column further in.
    let dashes = format!("x:\n{}1\n", "- ".repeat(100_000));
    assert_eq!(nesting_too_deep(&dashes), block(2, 257));
    assert_eq!(
        nesting_too_deep(&format!("{}1\n", "? ".repeat(100_000))),
        block(1, 257)
    );
    // Indented mappings: `x:` opens one, each deeper key another.
    let mut indented = String::new();
    for level in 0..200 {
        indented.push_str(&" ".repeat(level));
        indented.push_str("k:\n");
    }
    assert_eq!(nesting_too_deep(&indented), block(129, 129));
    // 128 levels are left to the parser, which refuses them with its own message.
    assert_eq!(nesting_too_deep(&format!("{}1\n", "- ".repeat(128))), None);
    let message = parse_err(&dashes);
    assert!(
        message.starts_with("config <string>: line 2 column 257: recursion limit exceeded:"),
        "{message}"
    );
    assert!(
        message.contains("nested more than 128 levels deep"),
        "{message}"
    );
    // Going back out of a level frees it.
    let wide = "a:\n  b: 1\n".repeat(1000);
    assert_eq!(nesting_too_deep(&wide), None);
}

#[test]
fn hang_after_defaults_to_a_hundred_budgets_but_at_least_a_second() {
    assert_eq!(
        default_hang_after(DEFAULT_PICK_BUDGET),
        Duration::from_secs(1)
    );
    assert_eq!(
        default_hang_after(Duration::from_millis(50)),
        Duration::from_secs(5)
    );
    assert_eq!(
        default_hang_after(Duration::from_secs(u64::MAX)),
        Duration::MAX
    );
    let config = parse(
        "worker_selection:\n  instances:\n\
         \x20   - {name: a, type: t}\n\
         \x20   - {name: b, type: t, pick_budget_us: 20000}\n\
         \x20   - {name: c, type: t, pick_budget_us: 20000, hang_after_ms: 21}\n\
         \x20   - {name: d, type: t, hang_after_ms: ~}\n",
    );
    let hang_after: Vec<Duration> = config
        .worker_selection
        .instances
        .iter()
        .map(|i| i.hang_after)
        .collect();
    assert_eq!(
        hang_after,
        [
            Duration::from_secs(1),
            Duration::from_secs(2),
            Duration::from_millis(21),
            Duration::from_secs(1),
        ]
    );
}

#[test]
fn hang_after_must_be_a_positive_integer_longer_than_the_pick_budget() {
    let message =
        parse_err("worker_selection: {instances: [{name: a, type: t, hang_after_ms: 0}]}");
    assert!(
        message.contains("worker_selection.instances[0].hang_after_ms: invalid value: integer `0`"),
        "{message}"
    );
    let message =
        parse_err("worker_selection: {instances: [{name: a, type: t, hang_after_ms: \"1s\"}]}");
    assert!(message.contains("hang_after_ms: invalid type"), "{message}");
    // Not longer than the budget: the key is named, with the line of the value.
    let message = parse_err(
        "worker_selection:\n  instances:\n\
         \x20   - name: a\n\
         \x20     type: t\n\
         \x20     pick_budget_us: 5000\n\
         \x20     hang_after_ms: 5\n",
    );
    assert_eq!(
        message,
        "config <string>: line 6 column 22: worker_selection.instances[0].hang_after_ms: \
         instance `a`: hang_after_ms 5 must be longer than the pick budget (pick_budget_us 5000): \
         a call counts as hung only far past its budget"
    );
    // The default budget (1 ms) counts too.
    let message =
        parse_err("worker_selection: {instances: [{name: a, type: t, hang_after_ms: 1}]}");
    assert!(message.contains("(pick_budget_us 1000)"), "{message}");
}

#[test]
fn plugin_images_max_has_a_default_and_a_range() {
    assert_eq!(parse("").plugin_images_max, DEFAULT_PLUGIN_IMAGES_MAX);
    assert_eq!(parse("plugin_images_max: 3\n").plugin_images_max, 3);
    for bad in ["0", "65537", "-1", "many"] {
        let message = parse_err(&format!("plugin_images_max: {bad}\n"));
        assert!(
            message.contains("line 1") && message.contains("plugin_images_max"),
            "{bad}: {message}"
        );
    }
}

#[test]
fn epp_section_defaults_values_and_errors() {
    assert_eq!(parse("block_size: 4\n").epp, None);
    assert_eq!(parse("epp: {}\n").epp, Some(EppConfig::default()));
    let epp = parse("epp:\n  listen: 0.0.0.0:9102\n  metrics_listen: '[::1]:9190'\n")
        .epp
        .expect("an epp section");
    assert_eq!(epp.listen.to_string(), "0.0.0.0:9102");
    assert_eq!(epp.metrics_listen.to_string(), "[::1]:9190");
    let defaults = parse("epp:\n  listen: 127.0.0.1:7000\n").epp.expect("epp");
    assert_eq!(defaults.metrics_listen.to_string(), "127.0.0.1:9090");

    let err = parse_err("epp:\n  listen: localhost:9002\n");
    assert!(
        err.contains("epp.listen") && err.contains("invalid listen address `localhost:9002`"),
        "{err}"
    );
    let err = parse_err("epp:\n  metrics: 127.0.0.1:1\n");
    assert!(err.contains("epp") && err.contains("metrics"), "{err}");
}

#[test]
fn a_worker_drains_only_when_it_says_so() {
    let config = parse(
        "workers:\n  - {id: 1, url: 'http://127.0.0.1:8101'}\n  \
         - {id: 2, url: 'http://127.0.0.1:8102', draining: true}\n",
    );
    let draining: Vec<(u64, bool)> = config.workers.iter().map(|w| (w.id, w.draining)).collect();
    assert_eq!(draining, [(1, false), (2, true)]);
    let err = parse_err("workers:\n  - {id: 1, url: 'http://127.0.0.1:8101', draining: yes}\n");
    assert!(err.contains("workers[0].draining"), "{err}");
}

#[test]
fn overload_keys_parse_and_bad_values_name_the_key() {
    let config = parse(
        "max_queued_requests: 64\n\
         policy_classes:\n\
         - {name: batch, prefill_busy_threshold: 1}\n\
         - {name: chat, priority: 10, max_engine_waiting: 4, max_kv_usage: 0.9}\n",
    );
    assert_eq!(config.max_queued_requests, Some(64));
    let (batch, chat) = (&config.policy_classes[0], &config.policy_classes[1]);
    assert_eq!(
        (batch.priority, batch.max_engine_waiting, batch.max_kv_usage),
        (0, None, None)
    );
    // Engine limits alone are a busy rule.
    assert_eq!(
        (chat.priority, chat.max_engine_waiting, chat.max_kv_usage),
        (10, Some(4), Some(0.9))
    );
    assert_eq!(parse("block_size: 16").max_queued_requests, None);
    for (text, expected) in [
        (
            "max_queued_requests: 0",
            "max_queued_requests: invalid value: integer `0` is out of range, expected an integer from 1 to 1048576",
        ),
        (
            "policy_classes: [{name: a, max_kv_usage: 1.5}]",
            "policy_classes[0].max_kv_usage: invalid value: 1.5, expected a finite number from 0 to 1",
        ),
        (
            "policy_classes: [{name: a, max_kv_usage: -0.1}]",
            "policy_classes[0].max_kv_usage: invalid value: -0.1, expected a finite number from 0 to 1",
        ),
        (
            "policy_classes: [{name: a, max_engine_waiting: -1}]",
            "policy_classes[0].max_engine_waiting: invalid value: integer `-1` is out of range",
        ),
        (
            "policy_classes: [{name: a, prefill_busy_threshold: 1, priority: high}]",
            "policy_classes[0].priority: invalid type: string \"high\", expected i64",
        ),
        (
            "policy_classes: [{name: a, priority: 1}]",
            "policy_classes[0]",
        ),
    ] {
        let message = parse_err(text);
        assert!(message.contains(expected), "{text}: {message}");
    }
}

#[test]
fn the_recent_window_and_room_parse_and_bad_values_are_named() {
    let config = parse("kv_recent_window_ms: 2500\ndefault_selector: {room: not_recent}\n");
    assert_eq!(config.kv_recent_window, Some(Duration::from_millis(2500)));
    assert_eq!(config.default_selector.room, Room::NotRecent);
    assert_eq!(
        parse("kv_recent_window_ms: 0\n").kv_recent_window,
        None,
        "0 turns it off"
    );
    assert_eq!(
        parse("kv_recent_window_ms: ~\n").kv_recent_window,
        DEFAULT_KV_RECENT_WINDOW
    );
    assert_eq!(parse("").kv_recent_window, None, "off by default");
    let err = parse_err("kv_recent_window_ms: 86400001\n");
    assert!(err.contains("kv_recent_window_ms"), "{err}");
    let err = parse_err("kv_recent_window_ms: -1\n");
    assert!(err.contains("kv_recent_window_ms"), "{err}");
    let err = parse_err("default_selector: {room: cold}\n");
    assert!(
        err.contains("default_selector.room") && err.contains("`free` or `not_recent`"),
        "{err}"
    );
}
