//! `session_affinity:`: whether requests of a session stick to a worker, and for how long.

use std::time::Duration;

use serde::Deserialize;

use super::numbers::{de_max_bindings, de_ttl_secs, narrow_or};
use super::strings::de_affinity_mode;
use super::{AffinityMode, DEFAULT_MAX_BINDINGS, DEFAULT_SESSION_TTL};

/// `session_affinity:` settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionAffinityConfig {
    /// Soft (advisory target, binding follows the dispatch) or hard (binding is a pin).
    pub mode: AffinityMode,
    /// Idle timeout of a binding.
    pub ttl: Duration,
    /// Maximum number of bindings held at once.
    pub max_bindings: usize,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a `session_affinity` mapping with `mode`"
)]
pub(super) struct RawSessionAffinity {
    #[serde(deserialize_with = "de_affinity_mode")]
    mode: AffinityMode,
    #[serde(default, deserialize_with = "de_ttl_secs")]
    ttl_secs: Option<u64>,
    #[serde(default, deserialize_with = "de_max_bindings")]
    max_bindings: Option<u64>,
}

impl RawSessionAffinity {
    /// The settings, with the defaults for what is left out.
    pub(super) fn into_config(self) -> SessionAffinityConfig {
        SessionAffinityConfig {
            mode: self.mode,
            ttl: self
                .ttl_secs
                .map_or(DEFAULT_SESSION_TTL, Duration::from_secs),
            max_bindings: narrow_or(self.max_bindings, DEFAULT_MAX_BINDINGS),
        }
    }
}
