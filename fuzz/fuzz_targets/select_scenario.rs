//! Arbitrary bytes into the `select` scenario parser, and every scenario that parses through a
//! host with only the built-in policies: parsing returns a scenario or a `ScenarioError`, and
//! running it yields one outcome per request, never a panic or a hang.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use router_host::config::RouterConfig;
use router_host::host::Host;
use router_host::loader::SearchPath;
use router_host::policy_set::PolicySet;
use router_host::scenario::{self, Scenario};

fn config() -> &'static RouterConfig {
    static CONFIG: OnceLock<RouterConfig> = OnceLock::new();
    CONFIG.get_or_init(|| RouterConfig::from_yaml_str("{}", None).expect("empty config parses"))
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let scenario = match Scenario::from_json_str(text, "fuzz.json") {
        Ok(scenario) => scenario,
        Err(err) => {
            assert!(err.to_string().starts_with("scenario fuzz.json: "), "{err}");
            return;
        }
    };
    let cfg = config();
    let router = PolicySet::from_config(cfg, &SearchPath::default()).expect("built-in router");
    let mut host = Host::new(router, scenario.cluster.clone(), cfg);
    let outcomes = scenario::run(&mut host, &scenario);
    assert_eq!(outcomes.len(), scenario.requests.len());
    for (index, outcome) in outcomes.iter().enumerate() {
        let line = scenario::outcome_json(&host, index, outcome);
        assert_eq!(line["request"], index);
        if let Some(routed) = outcome.routed() {
            // A decision names a registered row that the request allows.
            let row = routed.decision.row;
            let request = &scenario.requests[index].request;
            assert!(host.topology().cluster().has_row(row), "{row:?}");
            if let Some(pin) = request.pinned_worker {
                assert_eq!(row, pin);
            }
            if let Some(allowed) = &request.allowed_worker_ids {
                assert!(allowed.contains(&row.worker_id), "{row:?}");
            }
        }
    }
});
