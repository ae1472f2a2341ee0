//! YAML values carried as JSON: instance `parameters` and the `engine` mapping. JSON cannot carry
//! NaN, infinities, non-string mapping keys or YAML tags, so those are refused with their path.

use super::error::{ConfigError, ConfigErrorKind, ValueProblem};
use super::locate::{key, render_path, Seg};
use super::numbers::yaml_float;
use super::Builder;

impl Builder<'_> {
    pub(super) fn engine(
        &self,
        value: Option<serde_yaml::Value>,
    ) -> Result<Option<serde_json::Value>, ConfigError> {
        let mut path = vec![key("engine")];
        match value {
            None | Some(serde_yaml::Value::Null) => Ok(None),
            Some(value @ serde_yaml::Value::Mapping(_)) => {
                to_json(&value, &mut path).map(Some).map_err(|problem| {
                    let key_path = render_path(&path[1..]);
                    self.error(
                        &path,
                        ConfigErrorKind::InvalidEngineValue { key_path, problem },
                    )
                })
            }
            Some(other) => Err(self.error(
                &path,
                ConfigErrorKind::EngineNotMapping {
                    found: describe(&other),
                },
            )),
        }
    }
}

/// A short description of a YAML value's kind, for messages.
pub(super) fn describe(value: &serde_yaml::Value) -> &'static str {
    match value {
        serde_yaml::Value::Null => "null",
        serde_yaml::Value::Bool(_) => "a boolean",
        serde_yaml::Value::Number(_) => "a number",
        serde_yaml::Value::String(_) => "a string",
        serde_yaml::Value::Sequence(_) => "a sequence",
        serde_yaml::Value::Mapping(_) => "a mapping",
        serde_yaml::Value::Tagged(_) => "a tagged value",
    }
}

/// How a non-string mapping key reads in a message.
fn describe_key(value: &serde_yaml::Value) -> String {
    match value {
        serde_yaml::Value::Null => "`null`".to_owned(),
        serde_yaml::Value::Bool(b) => format!("`{b}` (a boolean)"),
        serde_yaml::Value::Number(n) => format!("`{n}` (a number)"),
        other => describe(other).to_owned(),
    }
}

/// Converts YAML to JSON, failing on what JSON cannot carry. On error, `path` is left pointing at
/// the offending node (the containing mapping for a bad key).
pub(super) fn to_json(
    value: &serde_yaml::Value,
    path: &mut Vec<Seg>,
) -> Result<serde_json::Value, ValueProblem> {
    use serde_yaml::Value as Y;
    Ok(match value {
        Y::Null => serde_json::Value::Null,
        Y::Bool(b) => serde_json::Value::Bool(*b),
        Y::Number(n) => {
            if let Some(u) = n.as_u64() {
                serde_json::Value::from(u)
            } else if let Some(i) = n.as_i64() {
                serde_json::Value::from(i)
            } else {
                let f = n.as_f64().unwrap_or(f64::NAN);
                match serde_json::Number::from_f64(f) {
                    Some(number) => serde_json::Value::Number(number),
                    None => return Err(ValueProblem::NotFinite(yaml_float(f))),
                }
            }
        }
        Y::String(s) => serde_json::Value::String(s.clone()),
        Y::Sequence(items) => {
            let mut out = Vec::with_capacity(items.len());
            for (index, item) in items.iter().enumerate() {
                path.push(Seg::Index(index));
                out.push(to_json(item, path)?);
                path.pop();
            }
            serde_json::Value::Array(out)
        }
        Y::Mapping(mapping) => {
            let mut out = serde_json::Map::new();
            for (k, v) in mapping {
                let Some(k) = k.as_str() else {
                    return Err(ValueProblem::NonStringKey(describe_key(k)));
                };
                path.push(Seg::Key(k.to_owned()));
                out.insert(k.to_owned(), to_json(v, path)?);
                path.pop();
            }
            serde_json::Value::Object(out)
        }
        Y::Tagged(tagged) => return Err(ValueProblem::Tagged(tagged.tag.to_string())),
    })
}
