//! `worker_selection:`: which policy instance serves each role, and the instances.

use std::time::Duration;

use plugin_api::Role;
use serde::Deserialize;

use super::error::{ConfigError, ConfigErrorKind};
use super::json::{describe, to_json};
use super::locate::{key, render_path, Seg};
use super::numbers::{de_hang_after, de_pick_budget, de_quarantine_after, narrow_or};
use super::strings::{de_instance_name, de_on_error, de_type_name};
use super::{
    default_hang_after, Builder, Names, DEFAULT_INSTANCE, DEFAULT_PICK_BUDGET,
    DEFAULT_QUARANTINE_AFTER,
};

/// The `worker_selection` block: one instance name per role, and the instances.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerSelectionConfig {
    /// Instance serving the aggregated role (`default` = built-in selector).
    pub aggregated: String,
    /// Instance serving the prefill role.
    pub prefill: String,
    /// Instance serving the decode role.
    pub decode: String,
    /// Configured policy instances, in file order; names are unique and never `default`.
    pub instances: Vec<InstanceConfig>,
}

impl Default for WorkerSelectionConfig {
    fn default() -> Self {
        WorkerSelectionConfig {
            aggregated: DEFAULT_INSTANCE.to_owned(),
            prefill: DEFAULT_INSTANCE.to_owned(),
            decode: DEFAULT_INSTANCE.to_owned(),
            instances: Vec::new(),
        }
    }
}

impl WorkerSelectionConfig {
    /// The instance name serving `role` (`default` for the built-in selector). Roles this host
    /// does not know (`Role::Other`) get the built-in selector.
    pub fn instance_for(&self, role: Role) -> &str {
        match role {
            Role::Aggregated => &self.aggregated,
            Role::Prefill => &self.prefill,
            Role::Decode => &self.decode,
            Role::Other(_) => DEFAULT_INSTANCE,
        }
    }

    /// The configured instance called `name` (never the built-in `default`).
    pub fn instance(&self, name: &str) -> Option<&InstanceConfig> {
        self.instances.iter().find(|instance| instance.name == name)
    }
}

/// One entry of `worker_selection.instances`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceConfig {
    /// Unique instance name, `[A-Za-z0-9_.-]{1,128}`, never `default`.
    pub name: String,
    /// Policy type name as exported by a plugin (`type:` in YAML).
    pub type_name: String,
    /// The `parameters` mapping as compact JSON object text; `{}` when absent.
    pub parameters_json: String,
    /// What the host does when this instance errors or panics.
    pub on_error: OnError,
    /// A pick slower than this counts as a budget breach.
    pub pick_budget: Duration,
    /// Consecutive budget breaches after which the instance is quarantined to its fallback.
    pub quarantine_after: u32,
    /// A call (`create`, `pick`, `explain`, a hook) still running after this long is a hang: the
    /// watchdog takes the instance out of service. `hang_after_ms`, default
    /// [`default_hang_after`]`(pick_budget)`; always longer than `pick_budget`.
    pub hang_after: Duration,
    /// 1-based line of the entry in the file (best effort).
    pub line: Option<usize>,
}

/// What the host does when a policy instance errors, panics or is quarantined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum OnError {
    /// Route the request with the built-in `default` selector.
    #[default]
    Fallback,
    /// Fail the request.
    Fail,
}

spelled!(OnError { Fallback => "fallback", Fail => "fail" });

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a `worker_selection` mapping")]
pub(super) struct RawWorkerSelection {
    #[serde(default)]
    aggregated: Option<String>,
    #[serde(default)]
    prefill: Option<String>,
    #[serde(default)]
    decode: Option<String>,
    #[serde(default)]
    instances: Option<Vec<RawInstance>>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "an instance mapping with `name` and `type`"
)]
struct RawInstance {
    #[serde(deserialize_with = "de_instance_name")]
    name: String,
    #[serde(rename = "type", deserialize_with = "de_type_name")]
    type_name: String,
    #[serde(default)]
    parameters: Option<serde_yaml::Value>,
    #[serde(default, deserialize_with = "de_on_error")]
    on_error: Option<OnError>,
    #[serde(default, deserialize_with = "de_pick_budget")]
    pick_budget_us: Option<u64>,
    #[serde(default, deserialize_with = "de_quarantine_after")]
    quarantine_after: Option<u64>,
    #[serde(default, deserialize_with = "de_hang_after")]
    hang_after_ms: Option<u64>,
}

impl Builder<'_> {
    pub(super) fn worker_selection(
        &mut self,
        raw: Option<RawWorkerSelection>,
    ) -> Result<WorkerSelectionConfig, ConfigError> {
        let Some(raw) = raw else {
            return Ok(WorkerSelectionConfig::default());
        };
        let raw_instances = raw.instances.unwrap_or_default();

        let mut names = Names::new(
            vec![key("worker_selection"), key("instances")],
            |name, first_line| ConfigErrorKind::DuplicateInstance { name, first_line },
        );
        for (index, instance) in raw_instances.iter().enumerate() {
            names.add(self, index, &instance.name)?;
        }

        let role_target = |role: &str, value: Option<String>| {
            let name = value.unwrap_or_else(|| DEFAULT_INSTANCE.to_owned());
            if name == DEFAULT_INSTANCE || names.contains(&name) {
                Ok(name)
            } else {
                Err(self.error(
                    &[key("worker_selection"), key(role)],
                    ConfigErrorKind::UnknownInstance {
                        role: role.to_owned(),
                        instance: name,
                        defined: raw_instances.iter().map(|i| i.name.clone()).collect(),
                    },
                ))
            }
        };
        let aggregated = role_target("aggregated", raw.aggregated)?;
        let prefill = role_target("prefill", raw.prefill)?;
        let decode = role_target("decode", raw.decode)?;
        drop(names);

        let mut instances = Vec::with_capacity(raw_instances.len());
        for (index, instance) in raw_instances.into_iter().enumerate() {
            let path = [key("worker_selection"), key("instances"), Seg::Index(index)];
            let parameters_json = self.parameters(&path, &instance.name, instance.parameters)?;
            let pick_budget = instance
                .pick_budget_us
                .map_or(DEFAULT_PICK_BUDGET, Duration::from_micros);
            let hang_after = match instance.hang_after_ms {
                None => default_hang_after(pick_budget),
                Some(ms) if Duration::from_millis(ms) > pick_budget => Duration::from_millis(ms),
                Some(ms) => {
                    let mut key_path = path.to_vec();
                    key_path.push(key("hang_after_ms"));
                    return Err(self.error(
                        &key_path,
                        ConfigErrorKind::HangAfterWithinBudget {
                            instance: instance.name,
                            hang_after_ms: ms,
                            pick_budget_us: u64::try_from(pick_budget.as_micros())
                                .unwrap_or(u64::MAX),
                        },
                    ));
                }
            };
            instances.push(InstanceConfig {
                line: self.entry_line(&path),
                name: instance.name,
                type_name: instance.type_name,
                parameters_json,
                on_error: instance.on_error.unwrap_or_default(),
                pick_budget,
                quarantine_after: narrow_or(instance.quarantine_after, DEFAULT_QUARANTINE_AFTER),
                hang_after,
            });
        }
        Ok(WorkerSelectionConfig {
            aggregated,
            prefill,
            decode,
            instances,
        })
    }

    /// Converts an instance's `parameters` to compact JSON object text.
    fn parameters(
        &self,
        instance_path: &[Seg],
        instance: &str,
        value: Option<serde_yaml::Value>,
    ) -> Result<String, ConfigError> {
        let mut path = instance_path.to_vec();
        path.push(key("parameters"));
        let value = match value {
            None | Some(serde_yaml::Value::Null) => return Ok("{}".to_owned()),
            Some(value @ serde_yaml::Value::Mapping(_)) => value,
            Some(other) => {
                return Err(self.error(
                    &path,
                    ConfigErrorKind::ParametersNotMapping {
                        instance: instance.to_owned(),
                        found: describe(&other),
                    },
                ))
            }
        };
        let inner_start = path.len();
        let json = to_json(&value, &mut path).map_err(|problem| {
            let key_path = render_path(&path[inner_start..]);
            self.error(
                &path,
                ConfigErrorKind::InvalidParameter {
                    instance: instance.to_owned(),
                    key_path,
                    problem,
                },
            )
        })?;
        Ok(json.to_string())
    }
}
