//! `policy_classes:`: the queue admission classes (docs/routing-contract.md §8).

use serde::Deserialize;

use super::error::{ConfigError, ConfigErrorKind};
use super::locate::{key, Seg};
use super::numbers::{
    de_busy_frac, de_busy_threshold, de_engine_waiting, de_kv_usage, de_priority, de_queue_wait_ms,
};
use super::strings::{de_admission, de_class_name};
use super::{AdmissionMode, Builder, Names};

/// One entry of `policy_classes:` (docs/routing-contract.md §8). At least one busy limit is set
/// (a prefill threshold or an engine limit).
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyClassConfig {
    /// Unique class name, `[A-Za-z0-9_.-]{1,128}`.
    pub name: String,
    /// A row is busy when its active prefill tokens exceed this.
    pub prefill_busy_threshold: Option<u64>,
    /// A row is busy when its active prefill tokens exceed this times the worker's
    /// `max_num_batched_tokens` (finite, > 0).
    pub prefill_busy_threshold_frac: Option<f64>,
    /// How admission consults the busy check.
    pub admission: AdmissionMode,
    /// A request queued longer than this fails (`max_queue_wait_ms`); `None` = no limit.
    pub max_queue_wait: Option<std::time::Duration>,
    /// Higher = more important; shed last when the queues are full (default 0).
    pub priority: i64,
    /// A row whose engine reports more waiting requests than this is busy (prefill-saturated).
    pub max_engine_waiting: Option<u64>,
    /// A row whose engine reports a KV-cache usage over this (0..1) is busy (decode-saturated).
    pub max_kv_usage: Option<f64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a policy class mapping with `name`")]
pub(super) struct RawPolicyClass {
    #[serde(deserialize_with = "de_class_name")]
    name: String,
    #[serde(default, deserialize_with = "de_busy_threshold")]
    prefill_busy_threshold: Option<u64>,
    #[serde(default, deserialize_with = "de_busy_frac")]
    prefill_busy_threshold_frac: Option<f64>,
    #[serde(default, deserialize_with = "de_admission")]
    admission: Option<AdmissionMode>,
    #[serde(default, deserialize_with = "de_queue_wait_ms")]
    max_queue_wait_ms: Option<u64>,
    #[serde(default, deserialize_with = "de_priority")]
    priority: Option<i64>,
    #[serde(default, deserialize_with = "de_engine_waiting")]
    max_engine_waiting: Option<u64>,
    #[serde(default, deserialize_with = "de_kv_usage")]
    max_kv_usage: Option<f64>,
}

impl Builder<'_> {
    pub(super) fn policy_classes(
        &self,
        raw: Vec<RawPolicyClass>,
    ) -> Result<Vec<PolicyClassConfig>, ConfigError> {
        let mut names = Names::new(vec![key("policy_classes")], |name, first_line| {
            ConfigErrorKind::DuplicatePolicyClass { name, first_line }
        });
        for (index, class) in raw.iter().enumerate() {
            names.add(self, index, &class.name)?;
            if class.prefill_busy_threshold.is_none()
                && class.prefill_busy_threshold_frac.is_none()
                && class.max_engine_waiting.is_none()
                && class.max_kv_usage.is_none()
            {
                return Err(self.error(
                    &[key("policy_classes"), Seg::Index(index)],
                    ConfigErrorKind::PolicyClassWithoutThreshold {
                        name: class.name.clone(),
                    },
                ));
            }
        }
        Ok(raw
            .into_iter()
            .map(|class| PolicyClassConfig {
                name: class.name,
                prefill_busy_threshold: class.prefill_busy_threshold,
                prefill_busy_threshold_frac: class.prefill_busy_threshold_frac,
                admission: class.admission.unwrap_or_default(),
                max_queue_wait: class
                    .max_queue_wait_ms
                    .map(std::time::Duration::from_millis),
                priority: class.priority.unwrap_or(0),
                max_engine_waiting: class.max_engine_waiting,
                max_kv_usage: class.max_kv_usage,
            })
            .collect())
    }
}
