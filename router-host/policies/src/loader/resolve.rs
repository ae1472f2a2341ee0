//! Step 1: a configured `path:` or `name:` entry to an existing file, and what to say when
//! there is none.

use std::path::{Path, PathBuf};

use super::LoadError;
use router_config::{self as config, PluginSource, PluginSpec};

/// What probably went wrong when no `lib<name>.so` exists: a crate built as `rlib` only leaves a
/// `lib<name>.rlib` beside where the `.so` would be.
pub(super) fn not_found_hint(tried: &[PathBuf]) -> String {
    let rlib = tried
        .iter()
        .map(|p| p.with_extension("rlib"))
        .find(|p| p.is_file());
    match rlib {
        Some(rlib) => format!(
            "; found {}: that crate builds no shared object: add `crate-type = [\"cdylib\"]` \
             under `[lib]` in its Cargo.toml and rebuild",
            rlib.display()
        ),
        None => String::new(),
    }
}

/// `path` is not a regular file: what it is instead, or why it cannot be looked at (a symlink
/// loop, a file where a directory should be, no permission); `None` when nothing is there.
pub(super) fn not_a_file(path: &Path) -> Option<LoadError> {
    let kind = match std::fs::metadata(path) {
        Ok(meta) => router_config::input::kind_of(meta.file_type())?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            return Some(LoadError::Unreadable {
                path: path.to_path_buf(),
                message: e.to_string(),
            })
        }
    };
    Some(LoadError::NotAFile {
        path: path.to_path_buf(),
        kind,
    })
}

pub(super) fn list_paths(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Where `name:` entries are looked up, in order.
#[derive(Debug, Clone, Default)]
pub struct SearchPath {
    /// `--plugin-dir` directories, in the order given.
    pub plugin_dirs: Vec<PathBuf>,
    /// The YAML file's directory.
    pub config_dir: Option<PathBuf>,
    /// The directory of the running `router-host` executable.
    pub exe_dir: Option<PathBuf>,
}

impl SearchPath {
    /// Plugin dirs, then the config's directory, then the executable's directory.
    pub fn new(plugin_dirs: Vec<PathBuf>, config_file: Option<&Path>) -> Self {
        SearchPath {
            plugin_dirs,
            config_dir: config_file
                .and_then(config::config_dir)
                .map(Path::to_path_buf),
            exe_dir: std::env::current_exe()
                .ok()
                .and_then(|exe| exe.parent().map(Path::to_path_buf)),
        }
    }

    fn candidates(&self, library_name: &str) -> Vec<PathBuf> {
        let file = format!("lib{library_name}.so");
        self.plugin_dirs
            .iter()
            .chain(self.config_dir.iter())
            .chain(self.exe_dir.iter())
            .map(|dir| dir.join(&file))
            .collect()
    }
}

/// Resolve a configured plugin entry to an existing file.
pub fn resolve(spec: &PluginSpec, search: &SearchPath) -> Result<PathBuf, LoadError> {
    match &spec.source {
        PluginSource::Path(path) => {
            if path.is_file() {
                Ok(path.clone())
            } else if let Some(err) = not_a_file(path) {
                Err(err)
            } else {
                Err(LoadError::NotFound {
                    name: path.display().to_string(),
                    tried: vec![path.clone()],
                })
            }
        }
        PluginSource::Name(name) => {
            let tried = search.candidates(name);
            tried
                .iter()
                .find(|p| p.is_file())
                .cloned()
                .ok_or_else(|| LoadError::NotFound {
                    name: name.clone(),
                    tried,
                })
        }
    }
}
