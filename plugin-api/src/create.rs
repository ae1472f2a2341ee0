//! Creating policy instances: policy types, their parameters and creation errors.

use std::fmt;

use serde::de::DeserializeOwned;

use crate::abi::{CreateFailureKind, RawCreateContext};
use crate::policy::Policy;

/// Documentation of one parameter, shown by `router-host describe` and `check`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamDoc {
    pub name: String,
    /// e.g. `f64`, `u64`, `bool`, `f64 or absent`.
    pub type_name: String,
    /// Rendered default; empty when the parameter is required.
    pub default: String,
    /// What it means and its valid range.
    pub meaning: String,
}

impl ParamDoc {
    /// An optional parameter with a default.
    pub fn optional(name: &str, type_name: &str, default: &str, meaning: &str) -> Self {
        ParamDoc {
            name: name.into(),
            type_name: type_name.into(),
            default: default.into(),
            meaning: meaning.into(),
        }
    }

    /// A required parameter (no default).
    pub fn required(name: &str, type_name: &str, meaning: &str) -> Self {
        Self::optional(name, type_name, "", meaning)
    }
}

/// A policy type: a name operators use in YAML `type:`, its documentation and its constructor.
///
/// One library can export several types (see [`crate::export_plugin!`]).
pub trait PolicyType: 'static {
    /// The policy instance this type builds.
    type Policy: Policy;
    /// The name used in YAML `worker_selection.instances[].type`; unique across loaded plugins.
    const NAME: &'static str;
    /// One line describing the policy.
    const SUMMARY: &'static str;
    /// Every parameter, with type, default and meaning.
    fn parameters() -> Vec<ParamDoc>;
    /// Validate parameters and build an instance. Called once per instance, at host startup.
    fn create(
        params: &Parameters<'_>,
        ctx: &CreateContext<'_>,
    ) -> Result<Self::Policy, CreateError>;
}

/// The instance's `parameters:` mapping, as JSON text.
#[derive(Debug, Clone, Copy)]
pub struct Parameters<'a> {
    json: &'a str,
}

impl<'a> Parameters<'a> {
    pub fn from_json(json: &'a str) -> Self {
        Parameters { json }
    }

    /// The raw JSON text (an object; `{}` when the YAML gave none).
    pub fn json(&self) -> &'a str {
        self.json
    }

    /// Parse into a parameter struct. Use `#[serde(deny_unknown_fields)]` on it: an unknown or
    /// mistyped key becomes an error naming that key.
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T, CreateError> {
        let text = if self.json.trim().is_empty() {
            "{}"
        } else {
            self.json
        };
        let de = &mut serde_json::Deserializer::from_str(text);
        serde_path_to_error::deserialize(de).map_err(|err| {
            let path = err.path().to_string();
            let inner = err.into_inner();
            let message = inner.to_string();
            // Name the key itself: serde reports a missing key at its parent's path.
            let key = match (named_field(&message, "missing field `"), path.as_str()) {
                (Some(field), "." | "") => field.to_string(),
                (Some(field), parent) => format!("{parent}.{field}"),
                (None, ".") => String::new(),
                (None, _) => path,
            };
            CreateError::invalid(key, strip_position(&message))
        })
    }
}

fn named_field<'m>(message: &'m str, prefix: &str) -> Option<&'m str> {
    let rest = message.strip_prefix(prefix)?;
    rest.split('`').next()
}

/// serde_json appends " at line 1 column 57": positions in generated JSON mean nothing to users.
fn strip_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(at) => message[..at].to_string(),
        None => message.to_string(),
    }
}

/// What the host tells a type when creating an instance.
#[derive(Clone, Copy)]
pub struct CreateContext<'a> {
    raw: &'a RawCreateContext<'a>,
}

impl<'a> CreateContext<'a> {
    pub fn from_raw(raw: &'a RawCreateContext<'a>) -> Self {
        CreateContext { raw }
    }

    /// The instance name from YAML.
    pub fn instance_name(&self) -> &'a str {
        self.raw.instance_name.as_str()
    }

    /// The host's `host_cache_hit_weight` (default 0.75).
    pub fn host_cache_hit_weight(&self) -> f64 {
        self.raw.host_cache_hit_weight
    }

    /// The host's `disk_cache_hit_weight` (default 0.25).
    pub fn disk_cache_hit_weight(&self) -> f64 {
        self.raw.disk_cache_hit_weight
    }

    /// Tokens per KV block.
    pub fn block_size(&self) -> u32 {
        self.raw.block_size
    }

    /// A value added by a newer 1.x host, by name.
    pub fn extension(&self, name: &str) -> Option<crate::abi::ExtensionValue<'a>> {
        crate::policy::find_extension(self.raw.extensions.as_slice(), name)
    }
}

impl fmt::Debug for CreateContext<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CreateContext")
            .field("instance_name", &self.instance_name())
            .field("host_cache_hit_weight", &self.host_cache_hit_weight())
            .field("disk_cache_hit_weight", &self.disk_cache_hit_weight())
            .field("block_size", &self.block_size())
            .finish()
    }
}

/// Why a policy type refused to build an instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreateError {
    pub(crate) kind: CreateFailureKind,
    key: String,
    message: String,
}

impl CreateError {
    /// A parameter is unknown, missing, mistyped or out of range. `key` names it.
    pub fn invalid(key: impl Into<String>, message: impl Into<String>) -> Self {
        CreateError {
            kind: CreateFailureKind::INVALID_PARAMETERS,
            key: key.into(),
            message: message.into(),
        }
    }

    /// Construction failed for a reason that is not one parameter.
    pub fn failed(message: impl Into<String>) -> Self {
        CreateError {
            kind: CreateFailureKind::FAILED,
            key: String::new(),
            message: message.into(),
        }
    }

    pub(crate) fn with_kind(kind: CreateFailureKind, message: impl Into<String>) -> Self {
        CreateError {
            kind,
            key: String::new(),
            message: message.into(),
        }
    }

    /// The offending parameter, or `""`.
    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    pub fn kind(&self) -> CreateFailureKind {
        self.kind
    }
}

impl fmt::Display for CreateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.key.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "parameter `{}`: {}", self.key, self.message)
        }
    }
}

impl std::error::Error for CreateError {}

/// Helpers for the range checks every parameter struct needs.
pub mod check {
    use super::CreateError;

    /// `value` must be finite and within `lo..=hi`.
    pub fn finite_in(key: &str, value: f64, lo: f64, hi: f64) -> Result<f64, CreateError> {
        if value.is_finite() && value >= lo && value <= hi {
            Ok(value)
        } else {
            Err(CreateError::invalid(
                key,
                format!("must be a finite number in {lo:?}..={hi:?}, got {value}"),
            ))
        }
    }

    /// `value` must be finite and at least `lo`.
    pub fn finite_at_least(key: &str, value: f64, lo: f64) -> Result<f64, CreateError> {
        if value.is_finite() && value >= lo {
            Ok(value)
        } else {
            Err(CreateError::invalid(
                key,
                format!("must be a finite number >= {lo:?}, got {value}"),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct P {
        limit: u64,
        #[serde(default)]
        nested: Option<Inner>,
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Inner {
        depth: u32,
    }

    fn key_of(json: &str) -> (String, String) {
        let err = Parameters::from_json(json).parse::<P>().unwrap_err();
        (err.key().to_string(), err.message().to_string())
    }

    #[test]
    fn errors_name_the_offending_key_once() {
        assert_eq!(key_of(r#"{"limit": 1, "limt": 2}"#).0, "limt");
        assert_eq!(key_of(r#"{}"#).0, "limit");
        assert_eq!(key_of(r#"{"limit": "x"}"#).0, "limit");
        assert_eq!(
            key_of(r#"{"limit": 1, "nested": {"deep": 1}}"#).0,
            "nested.deep"
        );
        assert_eq!(key_of(r#"{"limit": 1, "nested": {}}"#).0, "nested.depth");
        let (_, message) = key_of(r#"{"limit": -1}"#);
        assert!(!message.contains("at line"), "{message}");
    }

    #[test]
    fn absent_parameters_parse_as_an_empty_object() {
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Empty {}
        assert!(Parameters::from_json("").parse::<Empty>().is_ok());
    }
}
