//! What each replay column ran: where its config comes from and its resolved settings, printed
//! under the table and carried in the JSON (`configs[].settings`), so an operator can run the
//! same config.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use super::EngineParams;
use router_config::{PolicyClassConfig, RouterConfig};
use router_core::model::RequestRole;
use router_policies::policy_set::PolicySet;

/// The settings one column ran with, after every default was applied.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ColumnSettings {
    /// `builtin:NAME` for a config built into the binary, else the file as given.
    pub source: String,
    /// The workload's block size, which the replay runs every config with.
    pub block_size: u32,
    pub host_cache_hit_weight: f64,
    pub disk_cache_hit_weight: f64,
    pub booking: BookingSettings,
    /// The built-in `default` type's weights: the implicit `default` instance and every
    /// instance's fallback.
    pub default_selector: DefaultSelectorSettings,
    /// The window of the `kv_recent_device_blocks` column in ms; 0: off.
    pub kv_recent_window_ms: u64,
    /// The plugin files loaded, resolved.
    pub plugins: Vec<String>,
    /// The instance serving aggregated requests (every replayed request is aggregated).
    pub aggregated: InstanceSettings,
    /// `None`: off.
    pub session_affinity: Option<SessionAffinitySettings>,
    /// The `policy_classes`, in file order, with their defaults applied.
    pub policy_classes: Vec<serde_json::Value>,
    /// The simulated engines: the config's `engine:` block under the command line's flags.
    pub engine: EngineParams,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BookingSettings {
    pub prefill: String,
    pub decode: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DefaultSelectorSettings {
    pub prefill_load_scale: f64,
    pub decode_active_request_weight: f64,
    pub overlap_credit: f64,
    pub tie_break: String,
    pub room: String,
    pub live_eviction_weight: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct InstanceSettings {
    /// The instance name (`default` for the implicit built-in).
    pub name: String,
    /// Its policy type.
    pub r#type: String,
    /// `built-in`, or the plugin file that exports the type.
    pub origin: String,
    /// The parameters the config gives, as the policy receives them.
    pub parameters: serde_json::Map<String, serde_json::Value>,
    /// The documented default of every parameter the config leaves out (the type's own text,
    /// as `router-host describe` prints it).
    pub defaults: BTreeMap<String, String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SessionAffinitySettings {
    pub mode: String,
    pub ttl_secs: u64,
    pub max_bindings: usize,
}

impl ColumnSettings {
    /// The settings of `config` as `router` (built from it) runs them on `engine`.
    pub fn new(
        source: &str,
        config: &RouterConfig,
        router: &PolicySet,
        engine: EngineParams,
    ) -> ColumnSettings {
        let instance = router.instance(router.instance_for(RequestRole::Aggregated));
        let parameters: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(&instance.parameters_json).unwrap_or_default();
        let defaults = router
            .catalog()
            .types()
            .find(|(name, _, _)| *name == instance.type_name)
            .map(|(_, _, doc)| {
                doc.parameters
                    .iter()
                    .filter(|p| !parameters.contains_key(&p.name))
                    .map(|p| (p.name.clone(), p.default.clone()))
                    .collect()
            })
            .unwrap_or_default();
        let ds = &config.default_selector;
        ColumnSettings {
            source: source.to_owned(),
            block_size: config.block_size,
            host_cache_hit_weight: config.host_cache_hit_weight,
            disk_cache_hit_weight: config.disk_cache_hit_weight,
            booking: BookingSettings {
                prefill: config.booking.prefill.to_string(),
                decode: config.booking.decode.to_string(),
            },
            default_selector: DefaultSelectorSettings {
                prefill_load_scale: ds.prefill_load_scale,
                decode_active_request_weight: ds.decode_active_request_weight,
                overlap_credit: ds.overlap_credit,
                tie_break: ds.tie_break.to_string(),
                room: ds.room.to_string(),
                live_eviction_weight: ds.live_eviction_weight,
            },
            kv_recent_window_ms: config
                .kv_recent_window
                .map_or(0, |w| u64::try_from(w.as_millis()).unwrap_or(u64::MAX)),
            plugins: router
                .catalog()
                .libraries()
                .iter()
                .map(|lib| lib.path.display().to_string())
                .collect(),
            aggregated: InstanceSettings {
                name: instance.name.clone(),
                r#type: instance.type_name.clone(),
                origin: instance.origin.clone(),
                parameters,
                defaults,
            },
            session_affinity: config
                .session_affinity
                .as_ref()
                .map(|s| SessionAffinitySettings {
                    mode: s.mode.to_string(),
                    ttl_secs: s.ttl.as_secs(),
                    max_bindings: s.max_bindings,
                }),
            policy_classes: config.policy_classes.iter().map(class_json).collect(),
            engine,
        }
    }

    /// The lines printed under the table for this column (indented by the caller): YAML a
    /// config can hold as it is, then the instance's defaults in force as a comment.
    pub fn yaml_lines(&self) -> Vec<String> {
        let mut lines = Vec::new();
        lines.push(format!("block_size: {}", self.block_size));
        lines.push(format!(
            "host_cache_hit_weight: {:?}",
            self.host_cache_hit_weight
        ));
        lines.push(format!(
            "disk_cache_hit_weight: {:?}",
            self.disk_cache_hit_weight
        ));
        lines.push(format!(
            "booking: {{prefill: {}, decode: {}}}",
            self.booking.prefill, self.booking.decode
        ));
        let ds = &self.default_selector;
        lines.push(format!(
            "default_selector: {{prefill_load_scale: {:?}, decode_active_request_weight: {:?}, overlap_credit: {:?}, tie_break: {}, room: {}, live_eviction_weight: {:?}}}",
            ds.prefill_load_scale,
            ds.decode_active_request_weight,
            ds.overlap_credit,
            ds.tie_break,
            ds.room,
            ds.live_eviction_weight
        ));
        lines.push(format!("kv_recent_window_ms: {}", self.kv_recent_window_ms));
        if !self.plugins.is_empty() {
            let paths: Vec<String> = self
                .plugins
                .iter()
                .map(|p| {
                    format!(
                        "{{path: {}}}",
                        json_text(&serde_json::Value::from(p.as_str()))
                    )
                })
                .collect();
            lines.push(format!("plugins: [{}]", paths.join(", ")));
        }
        let a = &self.aggregated;
        if a.name == router_config::DEFAULT_INSTANCE {
            lines.push("worker_selection: {aggregated: default}".to_owned());
        } else {
            lines.push(format!(
                "worker_selection: {{aggregated: {name}, instances: [{{name: {name}, type: {ty}, parameters: {params}}}]}}",
                name = json_text(&serde_json::Value::from(a.name.as_str())),
                ty = json_text(&serde_json::Value::from(a.r#type.as_str())),
                params = json_text(&serde_json::Value::Object(a.parameters.clone())),
            ));
        }
        // The implicit `default` instance's values are the `default_selector` line.
        if !a.defaults.is_empty() && a.name != router_config::DEFAULT_INSTANCE {
            let mut text = format!("# {} ({}) defaults in force:", a.name, a.r#type);
            for (i, (name, default)) in a.defaults.iter().enumerate() {
                let sep = if i == 0 { " " } else { ", " };
                let _ = write!(
                    text,
                    "{sep}{name} = {}",
                    router_policies::loader::printable(default)
                );
            }
            lines.push(text);
        }
        if let Some(s) = &self.session_affinity {
            lines.push(format!(
                "session_affinity: {{mode: {}, ttl_secs: {}, max_bindings: {}}}",
                s.mode, s.ttl_secs, s.max_bindings
            ));
        }
        if !self.policy_classes.is_empty() {
            let classes: Vec<String> = self.policy_classes.iter().map(json_text).collect();
            lines.push(format!("policy_classes: [{}]", classes.join(", ")));
        }
        let engine = serde_json::to_value(self.engine).unwrap_or_default();
        lines.push(format!("engine: {}", json_text(&engine)));
        lines
    }
}

/// One policy class as its YAML mapping, every default written out.
fn class_json(class: &PolicyClassConfig) -> serde_json::Value {
    let mut map = serde_json::Map::new();
    map.insert("name".into(), class.name.clone().into());
    if let Some(t) = class.prefill_busy_threshold {
        map.insert("prefill_busy_threshold".into(), t.into());
    }
    if let Some(f) = class.prefill_busy_threshold_frac {
        map.insert("prefill_busy_threshold_frac".into(), f.into());
    }
    map.insert("admission".into(), class.admission.to_string().into());
    if let Some(wait) = class.max_queue_wait {
        let ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        map.insert("max_queue_wait_ms".into(), ms.into());
    }
    serde_json::Value::Object(map)
}

/// A JSON value as flow YAML (JSON is YAML).
fn json_text(value: &serde_json::Value) -> String {
    serde_json::to_string(value).unwrap_or_default()
}
