//! Every plugin this repository ships or tests with exports type names that pass the catalog's
//! type-name rule (`policies::is_valid_type_name`), so loading each of them still succeeds.

mod common;

use router_host::catalog::{is_valid_type_name, TypeOrigin};
use router_host::config::RouterConfig;
use router_host::loader::SearchPath;
use router_host::policy_set::PolicySet;

#[test]
fn shipped_and_fixture_plugins_export_valid_type_names() {
    // `fixture-duplicate` clashes with `fixture-probe` on purpose: each library loads alone.
    // `fixture-not-a-plugin` exports no policy library at all.
    for name in [
        "two_tier_cost_fn",
        "soft_pin_repin",
        "fixture_probe",
        "fixture_faulty",
        "fixture_duplicate",
    ] {
        let yaml = format!("plugins:\n  - path: {}\n", common::plugin(name).display());
        let config = RouterConfig::from_yaml_str(&yaml, None).unwrap();
        let router = PolicySet::from_config(&config, &SearchPath::default())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let exported: Vec<&str> = router
            .catalog()
            .types()
            .filter(|(_, origin, _)| matches!(origin, TypeOrigin::Plugin(_)))
            .map(|(type_name, _, _)| type_name)
            .collect();
        assert!(!exported.is_empty(), "{name} exports no type");
        for type_name in exported {
            assert!(is_valid_type_name(type_name), "{name}: {type_name:?}");
        }
    }
}
