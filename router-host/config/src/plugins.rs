//! `plugins:`: which plugin files or libraries to load.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::error::{ConfigError, ConfigErrorKind};
use super::locate::{key, Seg};
use super::strings::{de_library_name, de_plugin_path, de_sha256};
use super::{config_dir, Builder};

/// Where a plugin comes from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PluginSource {
    /// A file. Relative paths in YAML are already resolved against the YAML file's directory
    /// (or the current directory for configurations parsed from a string).
    Path(PathBuf),
    /// A library name: `lib<name>.so`, resolved by the loader in its search directories.
    Name(String),
}

impl fmt::Display for PluginSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PluginSource::Path(path) => write!(f, "path {}", path.display()),
            PluginSource::Name(name) => write!(f, "name {name}"),
        }
    }
}

/// One entry of `plugins:`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginSpec {
    /// The file or library name.
    pub source: PluginSource,
    /// Expected SHA-256 of the file, 64 lowercase hex digits.
    pub sha256: Option<String>,
    /// Skip the file ownership/permission checks for this plugin.
    pub allow_insecure_permissions: bool,
    /// 1-based line of the entry in the file (best effort).
    pub line: Option<usize>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a plugin entry mapping with `path` or `name`"
)]
pub(super) struct RawPlugin {
    #[serde(default, deserialize_with = "de_plugin_path")]
    path: Option<String>,
    #[serde(default, deserialize_with = "de_library_name")]
    name: Option<String>,
    #[serde(default, deserialize_with = "de_sha256")]
    sha256: Option<String>,
    #[serde(default)]
    allow_insecure_permissions: Option<bool>,
}

impl Builder<'_> {
    /// Directory relative plugin paths resolve against, made absolute: the configuration's
    /// directory, or the current directory for text parsed without a source.
    fn base_dir(&self) -> PathBuf {
        let dir = self
            .source
            .and_then(config_dir)
            .unwrap_or(Path::new("."))
            .to_path_buf();
        std::path::absolute(&dir).unwrap_or(dir)
    }

    pub(super) fn plugins(&mut self, raw: Vec<RawPlugin>) -> Result<Vec<PluginSpec>, ConfigError> {
        let base = if raw.is_empty() {
            PathBuf::new()
        } else {
            self.base_dir()
        };
        let mut plugins = Vec::with_capacity(raw.len());
        for (index, entry) in raw.into_iter().enumerate() {
            let path = [key("plugins"), Seg::Index(index)];
            let source = match (entry.path, entry.name) {
                (Some(path_value), Some(name)) => {
                    return Err(self.error(
                        &path,
                        ConfigErrorKind::PluginBothPathAndName {
                            path: path_value,
                            name,
                        },
                    ))
                }
                (None, None) => return Err(self.error(&path, ConfigErrorKind::PluginWithoutSource)),
                (Some(file), None) => {
                    let file = PathBuf::from(file);
                    PluginSource::Path(if file.is_absolute() {
                        file
                    } else {
                        base.join(file)
                    })
                }
                (None, Some(name)) => PluginSource::Name(name),
            };
            plugins.push(PluginSpec {
                source,
                sha256: entry.sha256,
                allow_insecure_permissions: entry.allow_insecure_permissions.unwrap_or(false),
                line: self.entry_line(&path),
            });
        }
        Ok(plugins)
    }
}
