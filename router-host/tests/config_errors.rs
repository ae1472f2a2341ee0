//! Every configuration rule rejects bad input with a message that names the file, the line, the
//! key and the offending value. Fixtures live in `tests/data/config/`; pure parsing, no plugins.

use std::path::{Path, PathBuf};

use router_host::config::{ConfigErrorKind, PluginSource, RouterConfig};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/config")
        .join(name)
}

/// The error message for fixture `name`, which must fail to load.
fn error_of(name: &str) -> String {
    match RouterConfig::from_file(&fixture(name)) {
        Ok(config) => panic!("{name} should be rejected, but parsed as {config:#?}"),
        Err(err) => err.to_string(),
    }
}

/// Asserts that the error for fixture `name` contains the file name and every fragment.
fn assert_rejected(name: &str, fragments: &[&str]) {
    let message = error_of(name);
    let file = format!("config {}: ", fixture(name).display());
    assert!(
        message.starts_with(&file),
        "message does not start with {file:?}:\n{message}"
    );
    for fragment in fragments {
        assert!(
            message.contains(fragment),
            "message lacks {fragment:?}:\n{message}"
        );
    }
}

// --- files that are fine -----------------------------------------------------------------------

#[test]
fn empty_and_comment_only_files_are_all_defaults() {
    for name in ["empty.yaml", "comments_only.yaml"] {
        let config = match RouterConfig::from_file(&fixture(name)) {
            Ok(config) => config,
            Err(err) => panic!("{err}"),
        };
        assert_eq!(config.source.as_deref(), Some(fixture(name).as_path()));
        assert_eq!(
            RouterConfig {
                source: None,
                ..config
            },
            RouterConfig::default()
        );
    }
}

#[test]
fn full_fixture_loads_and_resolves_plugin_paths_against_its_directory() {
    let config = match RouterConfig::from_file(&fixture("valid_full.yaml")) {
        Ok(config) => config,
        Err(err) => panic!("{err}"),
    };
    let dir = fixture("");
    assert_eq!(
        config.plugins[0].source,
        PluginSource::Path(dir.join("lib/libtwo_tier_cost_fn.so"))
    );
    assert_eq!(config.plugins[0].line, Some(9));
    assert_eq!(
        config.plugins[0].sha256.as_deref(),
        Some("0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef")
    );
    assert_eq!(
        config.plugins[1].source,
        PluginSource::Name("soft_pin_repin".to_owned())
    );
    assert_eq!(config.worker_selection.instances[0].line, Some(18));
    assert_eq!(
        config.worker_selection.instances[0].parameters_json,
        r#"{"cache_threshold":0.5}"#
    );
    assert_eq!(config.engine, Some(serde_json::json!({})));
}

// --- reading -----------------------------------------------------------------------------------

#[test]
fn missing_file_names_the_file_and_the_os_error() {
    let path = fixture("does-not-exist.yaml");
    let err = match RouterConfig::from_file(&path) {
        Ok(config) => panic!("parsed {config:?}"),
        Err(err) => err,
    };
    assert!(matches!(err.kind(), ConfigErrorKind::Read(_)));
    let message = err.to_string();
    assert!(
        message.starts_with(&format!("config {}: ", path.display())),
        "{message}"
    );
    assert!(message.contains("No such file or directory"), "{message}");
}

#[test]
fn a_directory_or_a_device_is_named_and_not_read() {
    for (path, kind) in [
        (fixture(""), "a directory"),
        (PathBuf::from("/dev/zero"), "a character device"),
    ] {
        let err = match RouterConfig::from_file(&path) {
            Ok(config) => panic!("parsed {config:?}"),
            Err(err) => err,
        };
        assert!(matches!(err.kind(), ConfigErrorKind::NotAFile { .. }));
        assert_eq!(
            err.to_string(),
            format!(
                "config {}: not a regular file ({kind}); give the YAML file itself",
                path.display()
            )
        );
    }
}

#[test]
fn a_file_over_the_size_limit_is_refused_by_its_size() {
    let dir = std::env::temp_dir().join(format!("config-errors-size-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("big.yaml");
    // Sparse: nothing of it is read.
    std::fs::File::create(&path)
        .unwrap()
        .set_len(router_host::config::MAX_CONFIG_BYTES + 1)
        .unwrap();
    let err = RouterConfig::from_file(&path).unwrap_err();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(
        err.to_string(),
        format!(
            "config {}: the file is larger than 16777216 bytes",
            path.display()
        )
    );
}

#[test]
fn not_utf8_names_the_file_and_position() {
    assert_rejected(
        "not_utf8.yaml",
        &["line 3 column 18", "not valid UTF-8", "from index 50"],
    );
}

// --- YAML structure ----------------------------------------------------------------------------

#[test]
fn truncated_yaml_is_a_syntax_error_with_location() {
    assert_rejected(
        "truncated.yaml",
        &[
            "line 5 column 1",
            "unexpected end of stream",
            "quoted scalar at line 4 column 13",
        ],
    );
}

#[test]
fn top_level_must_be_a_mapping() {
    assert_rejected(
        "not_a_mapping.yaml",
        &[
            "line 1 column 1",
            "invalid type: sequence, expected a mapping of router settings",
        ],
    );
}

#[test]
fn wrong_section_type_is_rejected() {
    assert_rejected(
        "wrong_type_section.yaml",
        &[
            "line 2 column 10",
            "plugins: ",
            "invalid type: string \"libtwo_tier_cost_fn.so\", expected a sequence",
        ],
    );
}

#[test]
fn unknown_key_in_an_instance_is_rejected_with_its_location() {
    assert_rejected(
        "unknown_key_instance.yaml",
        &[
            "line 7 column 7: worker_selection.instances[0]: ",
            "unknown field `paramters`, expected one of `name`, `type`, `parameters`, `on_error`, `pick_budget_us`, `quarantine_after`",
        ],
    );
}

#[test]
fn unknown_top_level_key_is_rejected() {
    assert_rejected(
        "unknown_key_top.yaml",
        &[
            "line 2 column 1",
            "unknown field `host_cache_weight`",
            "`host_cache_hit_weight`",
        ],
    );
}

// --- worker_selection --------------------------------------------------------------------------

#[test]
fn role_naming_an_undefined_instance_is_rejected() {
    assert_rejected(
        "unknown_role_instance.yaml",
        &[
            "line 4 column 11: worker_selection.decode: ",
            "role `decode` uses instance `two-teir`, which is not defined",
            "defined instances: `default` (built-in), `two-tier`, `repin`",
        ],
    );
}

#[test]
fn duplicate_instance_names_are_rejected() {
    assert_rejected(
        "duplicate_instance.yaml",
        &[
            "line 7 column 13: worker_selection.instances[2].name: ",
            "duplicate instance name `two-tier` (first defined at line 3)",
        ],
    );
}

#[test]
fn default_is_reserved_as_an_instance_name() {
    assert_rejected(
        "reserved_default_instance.yaml",
        &[
            "line 5 column 13: worker_selection.instances[0].name: ",
            "instance name `default` is reserved for the built-in selector",
        ],
    );
}

#[test]
fn instance_name_with_forbidden_characters_is_rejected() {
    assert_rejected(
        "invalid_instance_name.yaml",
        &[
            "line 3 column 13: worker_selection.instances[0].name: ",
            "invalid instance name `two tier`",
            "letters, digits, `_`, `.` and `-`",
        ],
    );
}

#[test]
fn instance_name_longer_than_128_characters_is_rejected() {
    assert_rejected(
        "long_instance_name.yaml",
        &[
            "line 4 column 13: worker_selection.instances[0].name: ",
            "invalid instance name `nnnn",
            "(129 bytes)",
            "longer than 128 characters",
        ],
    );
}

#[test]
fn numeric_instance_name_must_be_quoted() {
    assert_rejected(
        "numeric_instance_name.yaml",
        &[
            "line 3 column 13: worker_selection.instances[0].name: ",
            "invalid type: integer `42`",
            "quote values that look like numbers",
        ],
    );
}

#[test]
fn instance_without_type_is_rejected() {
    assert_rejected(
        "instance_missing_type.yaml",
        &[
            "line 3 column 7: worker_selection.instances[0]: ",
            "missing field `type`",
        ],
    );
}

#[test]
fn unknown_on_error_value_is_rejected() {
    assert_rejected(
        "on_error_unknown.yaml",
        &[
            "line 5 column 17: worker_selection.instances[0].on_error: ",
            "unknown variant `abort`, expected `fallback` or `fail`",
        ],
    );
}

#[test]
fn zero_pick_budget_is_rejected() {
    assert_rejected(
        "pick_budget_zero.yaml",
        &[
            "line 5 column 23: worker_selection.instances[0].pick_budget_us: ",
            "integer `0` is out of range, expected an integer >= 1",
        ],
    );
}

// --- parameters --------------------------------------------------------------------------------

#[test]
fn parameters_that_are_not_a_mapping_are_rejected() {
    assert_rejected(
        "parameters_not_mapping.yaml",
        &[
            "line 5 column 19: worker_selection.instances[0].parameters: ",
            "instance `two-tier`: `parameters` must be a mapping, found a sequence",
        ],
    );
}

#[test]
fn nan_in_parameters_names_instance_and_key() {
    assert_rejected(
        "parameters_nan.yaml",
        &[
            "line 8 column 26: worker_selection.instances[0].parameters.cache_threshold: ",
            "instance `two-tier`: parameter `cache_threshold`: .nan is not a finite number",
            "JSON has no NaN or infinity",
        ],
    );
}

#[test]
fn infinity_nested_in_parameters_names_the_full_key_path() {
    assert_rejected(
        "parameters_inf_nested.yaml",
        &[
            "line 8 column 34: worker_selection.instances[0].parameters.weights[1].weight: ",
            "instance `tiers`: parameter `weights[1].weight`: -.inf is not a finite number",
        ],
    );
}

#[test]
fn non_string_parameter_keys_are_rejected() {
    assert_rejected(
        "parameters_non_string_key.yaml",
        &[
            "line 6 column 9: worker_selection.instances[0].parameters: ",
            "instance `two-tier`: parameters: mapping key `1` (a number) is not a string",
        ],
    );
}

// --- plugins -----------------------------------------------------------------------------------

#[test]
fn plugin_with_both_path_and_name_is_rejected() {
    assert_rejected(
        "plugin_both_path_and_name.yaml",
        &[
            "line 3 column 5: plugins[1]: ",
            "plugin entry has both `path` (./libtwo_tier_cost_fn.so) and `name` (two_tier_cost_fn)",
        ],
    );
}

#[test]
fn plugin_with_neither_path_nor_name_is_rejected() {
    assert_rejected(
        "plugin_without_source.yaml",
        &[
            "line 3 column 5: plugins[1]: ",
            "plugin entry has neither `path` nor `name`",
        ],
    );
}

#[test]
fn plugin_library_name_with_so_suffix_is_rejected() {
    assert_rejected(
        "plugin_name_with_suffix.yaml",
        &[
            "line 2 column 11: plugins[0].name: ",
            "invalid plugin library name `libtwo_tier_cost_fn.so`",
            "write `name: foo`",
        ],
    );
}

#[test]
fn empty_plugin_path_is_rejected() {
    assert_rejected(
        "plugin_empty_path.yaml",
        &["line 2 column 11: plugins[0].path: ", "the path is empty"],
    );
}

#[test]
fn sha256_with_a_non_hex_digit_is_rejected() {
    assert_rejected(
        "bad_sha256.yaml",
        &[
            "line 3 column 13: plugins[0].sha256: ",
            "invalid sha256 `0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdeg`",
            "non-hexadecimal",
        ],
    );
}

#[test]
fn sha256_of_the_wrong_length_is_rejected() {
    assert_rejected(
        "short_sha256.yaml",
        &[
            "line 3 column 13: plugins[0].sha256: ",
            "invalid sha256 `deadbeef`: expected 64 hexadecimal digits, found 8 characters",
        ],
    );
}

// --- numbers -----------------------------------------------------------------------------------

#[test]
fn zero_block_size_is_rejected() {
    assert_rejected(
        "block_size_zero.yaml",
        &[
            "line 2 column 13: block_size: ",
            "integer `0` is out of range, expected an integer from 1 to 4294967295",
        ],
    );
}

#[test]
fn huge_block_size_is_rejected() {
    assert_rejected(
        "block_size_huge.yaml",
        &[
            "line 1 column 13: block_size: ",
            "integer `99999999999999999999` is out of range",
        ],
    );
}

#[test]
fn block_size_of_the_wrong_type_is_rejected() {
    assert_rejected(
        "block_size_wrong_type.yaml",
        &[
            "line 1 column 13: block_size: ",
            "invalid type: string \"sixteen\"",
        ],
    );
}

#[test]
fn negative_cache_weight_is_rejected() {
    assert_rejected(
        "weight_negative.yaml",
        &[
            "line 2 column 24: host_cache_hit_weight: ",
            "invalid value: -0.5, expected a finite number >= 0",
        ],
    );
}

#[test]
fn nan_cache_weight_is_rejected() {
    assert_rejected(
        "weight_nan.yaml",
        &[
            "line 1 column 24: disk_cache_hit_weight: ",
            "invalid value: .nan, expected a finite number >= 0",
        ],
    );
}

#[test]
fn infinite_default_selector_weight_is_rejected() {
    assert_rejected(
        "selector_weight_inf.yaml",
        &[
            "line 3 column 33: default_selector.decode_active_request_weight: ",
            "invalid value: .inf, expected a finite number >= 0",
        ],
    );
}

// --- session_affinity --------------------------------------------------------------------------

#[test]
fn zero_ttl_is_rejected() {
    assert_rejected(
        "ttl_zero.yaml",
        &[
            "line 3 column 13: session_affinity.ttl_secs: ",
            "integer `0` is out of range",
        ],
    );
}

#[test]
fn ttl_beyond_ten_years_is_rejected() {
    assert_rejected(
        "ttl_too_large.yaml",
        &[
            "line 3 column 13: session_affinity.ttl_secs: ",
            "integer `18446744073709551615` is out of range, expected an integer from 1 to 315360000",
        ],
    );
}

#[test]
fn negative_max_bindings_is_rejected() {
    assert_rejected(
        "max_bindings_negative.yaml",
        &[
            "line 3 column 17: session_affinity.max_bindings: ",
            "integer `-5` is out of range",
        ],
    );
}

#[test]
fn affinity_without_mode_is_rejected() {
    assert_rejected(
        "affinity_missing_mode.yaml",
        &[
            "line 2 column 3: session_affinity: ",
            "missing field `mode`",
        ],
    );
}

#[test]
fn unknown_affinity_mode_is_rejected() {
    assert_rejected(
        "affinity_bad_mode.yaml",
        &[
            "line 2 column 9: session_affinity.mode: ",
            "unknown variant `sticky`, expected `soft` or `hard`",
        ],
    );
}

// --- policy_classes ----------------------------------------------------------------------------

#[test]
fn policy_class_without_threshold_is_rejected() {
    assert_rejected(
        "class_without_threshold.yaml",
        &[
            "line 4 column 5: policy_classes[1]: ",
            "policy class `batch` sets neither `prefill_busy_threshold` nor `prefill_busy_threshold_frac`",
        ],
    );
}

#[test]
fn duplicate_policy_class_names_are_rejected() {
    assert_rejected(
        "duplicate_class.yaml",
        &[
            "line 4 column 11: policy_classes[1].name: ",
            "duplicate policy class name `batch` (first defined at line 2)",
        ],
    );
}

#[test]
fn invalid_policy_class_name_is_rejected() {
    assert_rejected(
        "invalid_class_name.yaml",
        &[
            "line 2 column 11: policy_classes[0].name: ",
            "invalid policy class name `inter/active`",
        ],
    );
}

#[test]
fn zero_busy_fraction_is_rejected() {
    assert_rejected(
        "class_frac_zero.yaml",
        &[
            "line 3 column 34: policy_classes[0].prefill_busy_threshold_frac: ",
            "invalid value: 0, expected a finite number > 0",
        ],
    );
}

#[test]
fn unknown_admission_mode_is_rejected() {
    assert_rejected(
        "class_bad_admission.yaml",
        &[
            "line 4 column 16: policy_classes[0].admission: ",
            "unknown variant `chosen`, expected `any_eligible` or `chosen_row`",
        ],
    );
}

// --- engine ------------------------------------------------------------------------------------

#[test]
fn engine_that_is_not_a_mapping_is_rejected() {
    assert_rejected(
        "engine_not_mapping.yaml",
        &[
            "line 1 column 9: engine: ",
            "must be a mapping, found a sequence",
        ],
    );
}

#[test]
fn nan_in_engine_is_rejected() {
    assert_rejected(
        "engine_nan.yaml",
        &[
            "line 2 column 12: engine.speedup: ",
            "engine value `speedup`: .nan is not a finite number",
        ],
    );
}

// --- strings without a file --------------------------------------------------------------------

#[test]
fn errors_from_strings_say_string() {
    let err = match RouterConfig::from_yaml_str("block_size: 0\n", None) {
        Ok(config) => panic!("parsed {config:?}"),
        Err(err) => err,
    };
    assert!(err.file().is_none());
    assert!(
        err.to_string()
            .starts_with("config <string>: line 1 column 13: block_size: "),
        "{err}"
    );
}

// --- nesting limits, checked before the YAML parser runs ---------------------------------------

/// Writes `text` to a fresh file (under a 0755 directory of this test's own) and returns the
/// error message for it.
fn error_of_text(test: &str, text: &str) -> (PathBuf, String) {
    let dir = std::env::temp_dir().join(format!(
        "router-host-config-errors-{}-{test}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create temp dir");
    let path = dir.join("router.yaml");
    std::fs::write(&path, text).expect("write config");
    let message = match RouterConfig::from_file(&path) {
        Ok(config) => panic!("{test} should be rejected, but parsed as {config:#?}"),
        Err(err) => err.to_string(),
    };
    let _ = std::fs::remove_dir_all(&dir);
    (path, message)
}

#[test]
fn an_apostrophe_in_plain_text_does_not_hide_deep_flow_nesting() {
    // Issue: the pre-scan took the apostrophe of `rock 'n roll` for the start of a quoted scalar
    // and skipped the brackets after it; the parser then spent ~31 s on these 200 KB. The input
    // stays this size, so a scan that misses the nesting shows as a test that does not finish.
    for (test, prefix, line, column) in [
        ("apostrophe", "note: rock 'n roll\nengine: ", 2, 137),
        ("quote-mid-word", "note: say \"hi\nengine: ", 2, 137),
        ("continued-plain", "note: rock\n  'n roll\nengine: ", 3, 137),
        ("block-scalar", "note: |\n  'n roll\nengine: ", 3, 137),
        ("flow-plain", "note: [rock\n 'n roll]\nengine: ", 3, 137),
    ] {
        let text = format!("{prefix}{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert!(text.len() < 210_000);
        let (path, message) = error_of_text(test, &text);
        assert_eq!(
            message,
            format!(
                "config {}: line {line} column {column}: recursion limit exceeded: `[` and `{{` \
                 nested more than 128 levels deep",
                path.display()
            ),
            "{test}"
        );
    }
}

#[test]
fn deep_block_nesting_is_refused_with_the_line_and_the_limit() {
    // 100,000 levels of `- ` (200 KB): linear for the parser, but it builds every event first.
    let (path, message) = error_of_text("dashes", &format!("engine:\n{}1\n", "- ".repeat(100_000)));
    assert_eq!(
        message,
        format!(
            "config {}: line 2 column 257: recursion limit exceeded: block mappings and \
             sequences nested more than 128 levels deep",
            path.display()
        )
    );
}
