//! Arbitrary bytes into the router YAML parser: it must return a config or a `ConfigError`,
//! never panic, hang or exhaust memory.
#![no_main]

use libfuzzer_sys::fuzz_target;
use router_host::config::RouterConfig;

fuzz_target!(|data: &[u8]| {
    // `RouterConfig::from_file` refuses non-UTF-8 files before parsing, so only UTF-8 text
    // reaches the parser in production.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match RouterConfig::from_yaml_str(text, None) {
        Ok(config) => {
            // Invariants the rest of the host relies on.
            assert!(config.block_size > 0);
            assert!(
                config.host_cache_hit_weight.is_finite() && config.host_cache_hit_weight >= 0.0
            );
            assert!(
                config.disk_cache_hit_weight.is_finite() && config.disk_cache_hit_weight >= 0.0
            );
            for instance in &config.worker_selection.instances {
                assert_ne!(instance.name, "default");
                assert!(!instance.pick_budget.is_zero());
            }
        }
        Err(err) => {
            let message = err.to_string();
            assert!(message.starts_with("config <string>: "), "{message}");
            // The internal marker used to locate nodes never leaks into a message.
            assert!(!message.contains("config-probe-hit"), "{message}");
        }
    }
});
