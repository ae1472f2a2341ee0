//! [`ConfigError`] and what it says: the kinds of problem, their messages, and turning parser
//! errors and byte offsets into lines, columns and key paths.

use std::fmt;
use std::path::{Path, PathBuf};

use super::DEFAULT_INSTANCE;

/// A configuration that could not be read or is invalid.
///
/// Displays as `config FILE: line L column C: KEY: PROBLEM`, where FILE is `<string>` for text
/// parsed with [`RouterConfig::from_yaml_str`](super::RouterConfig::from_yaml_str) without a
/// source, and the location and key parts are left out when unknown.
#[derive(Debug)]
pub struct ConfigError(Box<ErrorInner>);

#[derive(Debug)]
struct ErrorInner {
    file: Option<PathBuf>,
    line: Option<usize>,
    column: Option<usize>,
    key: Option<String>,
    kind: ConfigErrorKind,
}

impl ConfigError {
    pub(super) fn new(file: Option<&Path>, kind: ConfigErrorKind) -> Self {
        ConfigError(Box::new(ErrorInner {
            file: file.map(Path::to_path_buf),
            line: None,
            column: None,
            key: None,
            kind,
        }))
    }

    pub(super) fn at(mut self, location: Option<(usize, usize)>) -> Self {
        if let Some((line, column)) = location {
            self.0.line = Some(line);
            self.0.column = Some(column);
        }
        self
    }

    pub(super) fn key(mut self, key: impl Into<String>) -> Self {
        let key = key.into();
        self.0.key = (!key.is_empty()).then_some(key);
        self
    }

    /// The configuration file, `None` for text parsed from a string.
    pub fn file(&self) -> Option<&Path> {
        self.0.file.as_deref()
    }

    /// 1-based line of the problem, when known.
    pub fn line(&self) -> Option<usize> {
        self.0.line
    }

    /// 1-based column of the problem, when known.
    pub fn column(&self) -> Option<usize> {
        self.0.column
    }

    /// Key path of the problem, e.g. `worker_selection.instances[0].name`, when known.
    pub fn key_path(&self) -> Option<&str> {
        self.0.key.as_deref()
    }

    /// What is wrong.
    pub fn kind(&self) -> &ConfigErrorKind {
        &self.0.kind
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = &self.0;
        match &inner.file {
            Some(file) => write!(f, "config {}: ", file.display())?,
            None => f.write_str("config <string>: ")?,
        }
        match (inner.line, inner.column) {
            (Some(line), Some(column)) => write!(f, "line {line} column {column}: ")?,
            (Some(line), None) => write!(f, "line {line}: ")?,
            _ => {}
        }
        if let Some(key) = &inner.key {
            write!(f, "{key}: ")?;
        }
        fmt::Display::fmt(&inner.kind, f)
    }
}

// The underlying I/O and UTF-8 errors are part of the message, so they are not repeated as a
// `source()`; a caller printing the chain would otherwise show them twice.
impl std::error::Error for ConfigError {}

/// What is wrong with a configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigErrorKind {
    /// The file could not be opened or read.
    #[error("cannot read the file: {0}")]
    Read(std::io::Error),
    /// The path is not a regular file (a FIFO, a directory, a device); it is not opened or read.
    #[error("not a regular file ({kind}); give the YAML file itself")]
    NotAFile {
        /// What it is, e.g. `a FIFO`.
        kind: &'static str,
    },
    /// The file is larger than [`MAX_CONFIG_BYTES`](super::MAX_CONFIG_BYTES).
    #[error("the file is larger than {limit} bytes")]
    TooLarge {
        /// The limit in bytes.
        limit: u64,
    },
    /// The file is not UTF-8.
    #[error("the file is not valid UTF-8: {0}")]
    NotUtf8(std::str::Utf8Error),
    /// YAML syntax error, wrong type, unknown key, out-of-range number or invalid name, as reported
    /// while parsing (the message is the parser's).
    #[error("{message}")]
    Yaml {
        /// The parser's message, without the location and key path (shown separately).
        message: String,
    },
    /// Two instances share a name.
    #[error("duplicate instance name `{name}`{}", first_defined(*first_line))]
    DuplicateInstance {
        /// The repeated name.
        name: String,
        /// Line of the first definition, when known.
        first_line: Option<usize>,
    },
    /// A role names an instance that is not defined.
    #[error(
        "role `{role}` uses instance `{}`, which is not defined; defined instances: {}",
        excerpt(instance),
        list_instances(defined)
    )]
    UnknownInstance {
        /// `aggregated`, `prefill` or `decode`.
        role: String,
        /// The name the role refers to.
        instance: String,
        /// Names of the configured instances (the built-in `default` is always available too).
        defined: Vec<String>,
    },
    /// A plugin entry has both `path` and `name`.
    #[error("plugin entry has both `path` ({path}) and `name` ({name}); give exactly one of them")]
    PluginBothPathAndName {
        /// The `path` value as written.
        path: String,
        /// The `name` value.
        name: String,
    },
    /// A plugin entry has neither `path` nor `name`.
    #[error(
        "plugin entry has neither `path` nor `name`; give exactly one of them \
         (`path: ./libfoo.so` for a file, `name: foo` for lib<name>.so in the plugin directories)"
    )]
    PluginWithoutSource,
    /// Two policy classes share a name.
    #[error("duplicate policy class name `{name}`{}", first_defined(*first_line))]
    DuplicatePolicyClass {
        /// The repeated name.
        name: String,
        /// Line of the first definition, when known.
        first_line: Option<usize>,
    },
    /// Two `workers:` entries share an id.
    #[error("duplicate worker id {id}{}", first_defined(*first_line))]
    DuplicateWorker {
        /// The repeated id.
        id: u64,
        /// Line of the first entry with it, when known.
        first_line: Option<usize>,
    },
    /// A policy class sets no threshold.
    #[error(
        "policy class `{name}` sets neither `prefill_busy_threshold` nor \
         `prefill_busy_threshold_frac`; set at least one"
    )]
    PolicyClassWithoutThreshold {
        /// The class name.
        name: String,
    },
    /// An instance's `hang_after_ms` is not longer than its pick budget.
    #[error(
        "instance `{instance}`: hang_after_ms {hang_after_ms} must be longer than the pick budget \
         (pick_budget_us {pick_budget_us}): a call counts as hung only far past its budget"
    )]
    HangAfterWithinBudget {
        /// The instance name.
        instance: String,
        /// The `hang_after_ms` given.
        hang_after_ms: u64,
        /// The instance's pick budget in microseconds (given or default).
        pick_budget_us: u64,
    },
    /// An instance's `parameters` is not a mapping.
    #[error("instance `{instance}`: `parameters` must be a mapping, found {found}")]
    ParametersNotMapping {
        /// The instance name.
        instance: String,
        /// What was found instead, e.g. `a sequence`.
        found: &'static str,
    },
    /// A value inside an instance's `parameters` cannot be passed to the plugin as JSON.
    #[error(
        "instance `{instance}`: {}: {problem} (parameters reach the plugin as JSON)",
        parameter_path(key_path)
    )]
    InvalidParameter {
        /// The instance name.
        instance: String,
        /// Path inside `parameters`, e.g. `cache_threshold` or `tiers[1].weight`; empty for the
        /// `parameters` mapping itself.
        key_path: String,
        /// What is wrong.
        problem: ValueProblem,
    },
    /// `engine` is not a mapping.
    #[error("`engine` must be a mapping, found {found}")]
    EngineNotMapping {
        /// What was found instead.
        found: &'static str,
    },
    /// A value inside `engine` cannot be represented as JSON.
    #[error("engine value{}: {problem}", engine_path(key_path))]
    InvalidEngineValue {
        /// Path inside `engine`; empty for the mapping itself.
        key_path: String,
        /// What is wrong.
        problem: ValueProblem,
    },
}

/// Why a YAML value cannot be carried as JSON.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ValueProblem {
    /// NaN or an infinity (`.nan`, `.inf`, `-.inf`).
    #[error("{0} is not a finite number, and JSON has no NaN or infinity")]
    NotFinite(String),
    /// A mapping key that is not a string.
    #[error("mapping key {0} is not a string; JSON object keys must be strings")]
    NonStringKey(String),
    /// A YAML tag such as `!foo`.
    #[error("YAML tag `{0}` is not supported here; write the plain value")]
    Tagged(String),
}

fn first_defined(line: Option<usize>) -> String {
    match line {
        Some(line) => format!(" (first defined at line {line})"),
        None => String::new(),
    }
}

fn list_instances(defined: &[String]) -> String {
    const SHOWN: usize = 20;
    let mut out = format!("`{DEFAULT_INSTANCE}` (built-in)");
    for name in defined.iter().take(SHOWN) {
        out.push_str(", `");
        out.push_str(&excerpt(name));
        out.push('`');
    }
    if defined.len() > SHOWN {
        out.push_str(&format!(" and {} more", defined.len() - SHOWN));
    }
    out
}

fn parameter_path(key_path: &str) -> String {
    if key_path.is_empty() {
        "parameters".to_owned()
    } else {
        format!("parameter `{key_path}`")
    }
}

fn engine_path(key_path: &str) -> String {
    if key_path.is_empty() {
        String::new()
    } else {
        format!(" `{key_path}`")
    }
}

/// Shortens a user-supplied string for an error message.
pub(super) fn excerpt(s: &str) -> String {
    const MAX: usize = 80;
    if s.chars().count() <= MAX {
        s.to_owned()
    } else {
        let head: String = s.chars().take(MAX).collect();
        format!("{head}... ({} bytes)", s.len())
    }
}

/// 1-based line and (byte) column of `offset` in `bytes`.
pub(super) fn line_column(bytes: &[u8], offset: usize) -> (usize, usize) {
    let before = bytes.get(..offset).unwrap_or(bytes);
    let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
    let line_start = before
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |pos| pos + 1);
    (line, before.len() - line_start + 1)
}

/// Turns a `serde_yaml` error into a [`ConfigError`], splitting its `path: message at line L
/// column C` text into the key path, the message and the location.
pub(super) fn yaml_error(err: &serde_yaml::Error, source: Option<&Path>) -> ConfigError {
    let location = err.location().map(|loc| (loc.line(), loc.column()));
    let mut text = err.to_string();
    if let Some((line, column)) = location {
        let suffix = format!(" at line {line} column {column}");
        if let Some(stripped) = text.strip_suffix(&suffix) {
            text = stripped.to_owned();
        } else {
            text = text.replacen(&suffix, "", 1);
        }
    }
    let (key, message) = match text.split_once(": ") {
        Some((prefix, rest)) if looks_like_key_path(prefix) => (prefix.to_owned(), rest.to_owned()),
        _ => (String::new(), text),
    };
    ConfigError::new(source, ConfigErrorKind::Yaml { message })
        .at(location)
        .key(key)
}

/// Whether `prefix` looks like a `serde_yaml` key path (`a.b[0].c`) rather than message text.
fn looks_like_key_path(prefix: &str) -> bool {
    !prefix.is_empty()
        && !prefix
            .chars()
            .any(|c| c.is_whitespace() || matches!(c, '`' | '"' | '\'' | ','))
}
