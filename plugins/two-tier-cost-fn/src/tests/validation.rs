//! Parameter validation, defaults, and where `host_cache_weight` comes from.

use super::*;

#[test]
fn cache_threshold_out_of_range_is_rejected() {
    assert_names(
        &invalid(r#"{"cache_threshold": -0.1}"#),
        "cache_threshold",
        "0.0..=1.0",
        "-0.1",
    );
    assert_names(
        &invalid(r#"{"cache_threshold": 1.1}"#),
        "cache_threshold",
        "0.0..=1.0",
        "1.1",
    );
}

#[test]
fn nan_thresholds_are_rejected() {
    let nan_cache = TwoTierParams {
        cache_threshold: f64::NAN,
        ..TwoTierParams::default()
    };
    let err = nan_cache.validate(0.75).expect_err("NaN cache_threshold");
    assert_names(&err, "cache_threshold", "0.0..=1.0", "NaN");

    let nan_rel = TwoTierParams {
        balance_rel_threshold: f64::NAN,
        ..TwoTierParams::default()
    };
    let err = TwoTierCostFn::new(&nan_rel, 0.75).expect_err("NaN balance_rel_threshold");
    assert_names(&err, "balance_rel_threshold", ">= 1.0", "NaN");

    let nan_gate = TwoTierParams {
        soft_affinity_gate_rel: Some(f64::NAN),
        ..TwoTierParams::default()
    };
    let err = nan_gate
        .validate(0.75)
        .expect_err("NaN soft_affinity_gate_rel");
    assert_names(&err, "soft_affinity_gate_rel", ">= 1.0", "NaN");
}

#[test]
fn balance_rel_threshold_below_one_is_rejected() {
    assert_names(
        &invalid(r#"{"balance_rel_threshold": 0.9}"#),
        "balance_rel_threshold",
        ">= 1.0",
        "0.9",
    );
}

#[test]
fn negative_host_cache_weight_is_rejected() {
    assert_names(
        &invalid(r#"{"host_cache_weight": -0.1}"#),
        "host_cache_weight",
        ">= 0.0",
        "-0.1",
    );
}

#[test]
fn soft_affinity_gate_rel_below_one_is_rejected() {
    assert_names(
        &invalid(r#"{"soft_affinity_gate_rel": 0.5}"#),
        "soft_affinity_gate_rel",
        ">= 1.0",
        "0.5",
    );
}

#[test]
fn unknown_key_is_rejected_by_name() {
    let err = invalid(r#"{"cache_affinity_threshold": 0.5}"#);
    assert!(
        err.to_string().contains("cache_affinity_threshold"),
        "{err}"
    );
    // plugin-api 1.0.0 doubles the key (`cache_affinity_threshold.cache_affinity_threshold`);
    // accept both that and the fixed spelling.
    assert!(err.key().ends_with("cache_affinity_threshold"), "{err}");
}

#[test]
fn mistyped_value_is_rejected_by_name() {
    let err = invalid(r#"{"balance_abs_threshold": -1}"#);
    assert_eq!(err.key(), "balance_abs_threshold", "{err}");
}

#[test]
fn invalid_host_setting_is_blamed_on_the_host_not_a_policy_key() {
    let err =
        create_with::<TwoTierCostFnType>(DEFAULTS, f64::NAN, 16).expect_err("NaN host weight");
    assert_eq!(err.key(), "");
    assert!(err.message().contains("host_cache_hit_weight"), "{err}");
    // A policy value overrides the broken host setting.
    assert!(
        create_with::<TwoTierCostFnType>(r#"{"host_cache_weight": 0.5}"#, f64::NAN, 16).is_ok()
    );
}

#[test]
fn defaults_are_resolved_per_the_design() {
    let p = *policy(DEFAULTS).params();
    assert_eq!(
        p,
        ResolvedParams {
            cache_threshold: 0.5,
            balance_abs_threshold: 32,
            balance_rel_threshold: 1.1,
            host_cache_weight: 0.75,
            host_cache_weight_source: WeightSource::HostSetting,
            respect_soft_affinity: false,
            soft_affinity_load_gate: false,
            soft_affinity_cache_gate: true,
            soft_affinity_gate_abs: 32,
            soft_affinity_gate_rel: 1.1,
            load_signal: LoadSignal::PrefillBacklog,
            kv_capacity_limit: None,
            tie_break: TieBreak::Spread,
            room: Room::Free,
        }
    );
}

#[test]
fn gate_thresholds_default_to_the_balance_thresholds_in_force() {
    let p = *policy(r#"{"balance_abs_threshold": 5, "balance_rel_threshold": 2.0}"#).params();
    assert_eq!(
        (p.soft_affinity_gate_abs, p.soft_affinity_gate_rel),
        (5, 2.0)
    );
    let p = *policy(r#"{"balance_abs_threshold": 5, "soft_affinity_gate_abs": 7, "soft_affinity_gate_rel": 3.0}"#)
        .params();
    assert_eq!(
        (p.soft_affinity_gate_abs, p.soft_affinity_gate_rel),
        (7, 3.0)
    );
}

// ---- host_cache_weight source -------------------------------------------------------------------

#[test]
fn host_cache_weight_defaults_to_the_host_setting() {
    let rows = [row(A, 0.0, 0.0, 0), row(B, 0.0, 8.0, 4)];
    let ignoring_host_tier = create_with::<TwoTierCostFnType>(DEFAULTS, 0.0, 16).unwrap();
    assert_eq!(ignoring_host_tier.params().host_cache_weight, 0.0);
    assert_eq!(picked(&ignoring_host_tier, &rows, &request()), at(A, 0));

    let crediting_host_tier = create_with::<TwoTierCostFnType>(DEFAULTS, 0.75, 16).unwrap();
    assert_eq!(crediting_host_tier.params().host_cache_weight, 0.75);
    assert_eq!(picked(&crediting_host_tier, &rows, &request()), at(B, 0));
}

#[test]
fn policy_host_cache_weight_overrides_the_host_setting() {
    let policy =
        create_with::<TwoTierCostFnType>(r#"{"host_cache_weight": 0.75}"#, 0.0, 16).unwrap();
    assert_eq!(
        policy.params().host_cache_weight_source,
        WeightSource::Policy
    );
    let rows = [row(A, 0.0, 0.0, 0), row(B, 0.0, 8.0, 4)];
    assert_eq!(picked(&policy, &rows, &request()), at(B, 0));
}
