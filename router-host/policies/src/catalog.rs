//! The policy registry: which type names exist (built-in or from which library), and the
//! configured instances created from them at startup.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::OnceLock;
use std::time::Instant;

use abi_stable::std_types::{RResult, RSlice, RStr};
use plugin_api::abi::RawCreateContext;
use plugin_api::Inputs;

use crate::builtin::Builtin;
pub use crate::instance::BUILT_IN;
use crate::instance::{HostSettings, InstanceLogs, InstanceStats, PolicyInstance};
use crate::loader::{printable, PolicyLibrary, PolicyTypeDoc};
use crate::plugin_log::host_log;
use crate::watchdog::{Call, Watch, WatchSpec};
use router_config::InstanceConfig;

/// Where a policy type comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TypeOrigin {
    Builtin(Builtin),
    /// Index into [`Catalog::libraries`].
    Plugin(usize),
}

/// Every policy type the host can instantiate.
#[derive(Debug)]
pub struct Catalog {
    libraries: Vec<PolicyLibrary>,
    types: BTreeMap<String, (TypeOrigin, PolicyTypeDoc)>,
    /// Plugin types named like a policy shipped with the host, from another plugin.
    shadowed: Vec<ShadowedType>,
}

/// A policy type that a library exports under the name of a policy shipped with the host
/// ([`crate::builtin::SHIPPED_PLUGIN_TYPES`]) while the library is not the plugin that ships it
/// (its plugin name differs): instances of that type run the library's code, not the shipped
/// policy. Allowed (an operator may mean it), but warned about at load and shown by `check` and
/// `describe`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShadowedType {
    pub type_name: String,
    /// The library's path.
    pub library: PathBuf,
    /// The plugin name the library reports.
    pub plugin_name: String,
    /// The plugin name of the shipped plugin that exports `type_name`.
    pub shipped_plugin: &'static str,
}

impl std::fmt::Display for ShadowedType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = printable(&self.type_name);
        write!(
            f,
            "policy type `{name}` from {} (plugin `{}`) shadows the shipped policy of that name \
             (plugin `{}`): instances of type `{name}` run this library's code, not the shipped \
             policy; rename the type in the plugin unless it is meant to replace the shipped one",
            self.library.display(),
            printable(&self.plugin_name),
            self.shipped_plugin
        )
    }
}

/// The types of `library` that shadow a shipped policy ([`ShadowedType`]).
pub fn shadowed_types(library: &PolicyLibrary) -> Vec<ShadowedType> {
    library
        .types
        .iter()
        .filter_map(|doc| {
            let shipped_plugin = crate::builtin::shipped_plugin_of(&doc.name)?;
            (library.plugin_name != shipped_plugin).then(|| ShadowedType {
                type_name: doc.name.clone(),
                library: library.path.clone(),
                plugin_name: library.plugin_name.clone(),
                shipped_plugin,
            })
        })
        .collect()
}

/// Startup errors about policy types and instances.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("policy type `{type_name}` is exported by two libraries: {first} and {second}")]
    DuplicateType {
        type_name: String,
        first: String,
        second: String,
    },
    #[error("library {library} exports policy type `{type_name}` twice")]
    DuplicateTypeInLibrary { library: String, type_name: String },
    #[error(
        "library {library} exports policy type `{type_name}`, which is the name of a built-in \
         policy type (built-ins: {}); a plugin cannot replace a built-in, so the library is \
         refused: rename the type in the plugin",
        builtin_names()
    )]
    BuiltinTypeName { library: String, type_name: String },
    #[error(
        "library {library} exports a policy type named {}, which is not a valid type name: \
         it must be 1 to {MAX_TYPE_NAME_LEN} characters from A-Z, a-z, 0-9, `_`, `.`, `:` and `-`",
        escaped_name(.type_name)
    )]
    InvalidTypeName { library: String, type_name: String },
    #[error("instance `{instance}`: unknown policy type `{type_name}`; known types: {}", .known.join(", "))]
    UnknownType {
        instance: String,
        type_name: String,
        known: Vec<String>,
    },
    #[error("instance `{instance}` (type `{type_name}`, from {origin}): {}{}", key_prefix(.key), printable(.message))]
    InvalidParameters {
        instance: String,
        type_name: String,
        origin: String,
        key: String,
        message: String,
    },
    #[error("instance `{instance}` (type `{type_name}`, from {origin}): constructor {}: {}", if *.panicked { "panicked" } else { "failed" }, printable(.message))]
    CreateFailed {
        instance: String,
        type_name: String,
        origin: String,
        panicked: bool,
        message: String,
    },
    #[error("instance `{instance}` (type `{type_name}`, from {origin}): declares inputs {inputs} this host does not provide")]
    UnknownInputs {
        instance: String,
        type_name: String,
        origin: String,
        inputs: Inputs,
    },
}

fn key_prefix(key: &str) -> String {
    if key.is_empty() {
        String::new()
    } else {
        format!("parameter `{}`: ", printable(key))
    }
}

/// "`default`, `round-robin`, `random`".
fn builtin_names() -> String {
    Builtin::ALL
        .iter()
        .map(|b| format!("`{}`", b.as_str()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Longest policy type name a library may export, in bytes.
pub const MAX_TYPE_NAME_LEN: usize = 128;

/// Whether `name` may name a policy type: 1 to [`MAX_TYPE_NAME_LEN`] characters from
/// `[A-Za-z0-9_.:-]`. Type names are printed by `check` and appear in errors, logs and `select`
/// output, so a library must not put control characters or terminal escapes into them.
pub fn is_valid_type_name(name: &str) -> bool {
    (1..=MAX_TYPE_NAME_LEN).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'))
}

/// `name` quoted and escaped (`{:?}`), cut after [`MAX_TYPE_NAME_LEN`] characters.
fn escaped_name(name: &str) -> String {
    match name.char_indices().nth(MAX_TYPE_NAME_LEN) {
        Some((end, _)) => format!("{:?}... ({} bytes)", &name[..end], name.len()),
        None => format!("{name:?}"),
    }
}

/// Add the types of library `index` (at `path`) to `types`, refusing an invalid name, a built-in's
/// name, a name the library exports twice and a name already taken (`origin_name` names the
/// taker).
fn register_library_types(
    types: &mut BTreeMap<String, (TypeOrigin, PolicyTypeDoc)>,
    index: usize,
    path: &Path,
    docs: &[PolicyTypeDoc],
    origin_name: impl Fn(TypeOrigin) -> String,
) -> Result<(), PolicyError> {
    let library = || path.display().to_string();
    for doc in docs {
        if !is_valid_type_name(&doc.name) {
            return Err(PolicyError::InvalidTypeName {
                library: library(),
                type_name: doc.name.clone(),
            });
        }
        if Builtin::from_name(&doc.name).is_some() {
            return Err(PolicyError::BuiltinTypeName {
                library: library(),
                type_name: doc.name.clone(),
            });
        }
        match types.get(&doc.name) {
            Some((TypeOrigin::Plugin(i), _)) if *i == index => {
                return Err(PolicyError::DuplicateTypeInLibrary {
                    library: library(),
                    type_name: doc.name.clone(),
                })
            }
            Some((origin, _)) => {
                return Err(PolicyError::DuplicateType {
                    type_name: doc.name.clone(),
                    first: origin_name(*origin),
                    second: library(),
                })
            }
            None => {}
        }
        types.insert(doc.name.clone(), (TypeOrigin::Plugin(index), doc.clone()));
    }
    Ok(())
}

impl Catalog {
    /// Built-ins plus every type of every library. A name that is not a valid type name
    /// ([`is_valid_type_name`]), one named like a built-in, one exported twice by one library, or
    /// one exported by two libraries is an error naming the library (both, for two). A type that
    /// shadows a shipped policy ([`ShadowedType`]) is logged as a warning and kept in
    /// [`Self::shadowed`].
    pub fn new(libraries: Vec<PolicyLibrary>) -> Result<Self, PolicyError> {
        let mut types = builtin_types();
        let mut catalog = Catalog {
            libraries,
            types: BTreeMap::new(),
            shadowed: Vec::new(),
        };
        for (index, library) in catalog.libraries.iter().enumerate() {
            register_library_types(&mut types, index, &library.path, &library.types, |o| {
                catalog.origin_name(o)
            })?;
        }
        catalog.types = types;
        catalog.shadowed = catalog.libraries.iter().flat_map(shadowed_types).collect();
        for shadow in &catalog.shadowed {
            tracing::warn!(
                path = %shadow.library.display(),
                type_name = %shadow.type_name,
                "{shadow}"
            );
        }
        Ok(catalog)
    }

    /// The check [`Self::new`] makes of one library's type names, for a library that is only
    /// being described: `Err` is the error a host loading it alone would fail with.
    pub fn check_library(library: &PolicyLibrary) -> Result<(), PolicyError> {
        register_library_types(
            &mut builtin_types(),
            0,
            &library.path,
            &library.types,
            |_| BUILT_IN.to_string(),
        )
    }

    /// Plugin types that shadow a policy shipped with the host, in library order.
    pub fn shadowed(&self) -> &[ShadowedType] {
        &self.shadowed
    }

    /// "built-in" or the library's path.
    pub fn origin_name(&self, origin: TypeOrigin) -> String {
        match origin {
            TypeOrigin::Builtin(_) => BUILT_IN.to_string(),
            TypeOrigin::Plugin(i) => self.libraries[i].path.display().to_string(),
        }
    }

    pub fn libraries(&self) -> &[PolicyLibrary] {
        &self.libraries
    }

    /// Every type, sorted by name.
    pub fn types(&self) -> impl Iterator<Item = (&str, TypeOrigin, &PolicyTypeDoc)> {
        self.types
            .iter()
            .map(|(name, (origin, doc))| (name.as_str(), *origin, doc))
    }

    /// Create one configured instance (validating its parameters).
    pub fn instantiate(
        &self,
        config: &InstanceConfig,
        settings: &HostSettings,
    ) -> Result<PolicyInstance, PolicyError> {
        let Some((origin, _)) = self.types.get(&config.type_name) else {
            return Err(PolicyError::UnknownType {
                instance: config.name.clone(),
                type_name: config.type_name.clone(),
                known: self.types.keys().cloned().collect(),
            });
        };
        let origin_name = self.origin_name(*origin);
        // Registered before `create`, so a constructor that never returns is noticed too.
        let stats = crossbeam_utils::CachePadded::new(InstanceStats::default());
        let watch = Watch::register(WatchSpec {
            name: &config.name,
            type_name: &config.type_name,
            origin: &origin_name,
            hang_after: config.hang_after,
            on_hang: settings.on_hang,
            hangs: stats.hangs.clone(),
        });
        let created = match origin {
            TypeOrigin::Builtin(builtin) => builtin
                .create(&config.name, &config.parameters_json, &settings.builtin)
                .map_err(|e| (e.kind(), e.key().to_string(), e.message().to_string())),
            TypeOrigin::Plugin(index) => {
                let library = &self.libraries[*index];
                let ctx = RawCreateContext {
                    instance_name: RStr::from_str(&config.name),
                    host_cache_hit_weight: settings.builtin.host_cache_hit_weight,
                    disk_cache_hit_weight: settings.builtin.disk_cache_hit_weight,
                    block_size: settings.block_size,
                    log: host_log(),
                    extensions: RSlice::EMPTY,
                };
                let _call = watch.begin(Call::Create, Some(Instant::now()), None);
                match (library.module.create())(
                    RStr::from_str(&config.type_name),
                    RStr::from_str(&config.parameters_json),
                    &ctx,
                ) {
                    RResult::ROk(policy) => Ok(policy),
                    RResult::RErr(e) => Err((e.kind, e.key.to_string(), e.message.to_string())),
                }
            }
        };
        let policy = created.map_err(|(kind, key, message)| {
            use plugin_api::abi::CreateFailureKind as K;
            if kind == K::INVALID_PARAMETERS {
                PolicyError::InvalidParameters {
                    instance: config.name.clone(),
                    type_name: config.type_name.clone(),
                    origin: origin_name.clone(),
                    key,
                    message,
                }
            } else {
                PolicyError::CreateFailed {
                    instance: config.name.clone(),
                    type_name: config.type_name.clone(),
                    origin: origin_name.clone(),
                    panicked: kind == K::PANICKED,
                    message,
                }
            }
        })?;
        let inputs = policy.required_inputs();
        if !Inputs::KNOWN.contains(inputs) {
            return Err(PolicyError::UnknownInputs {
                instance: config.name.clone(),
                type_name: config.type_name.clone(),
                origin: origin_name,
                inputs,
            });
        }
        Ok(PolicyInstance {
            name: config.name.clone(),
            type_name: config.type_name.clone(),
            origin: origin_name,
            narrows_soft_target: *origin == TypeOrigin::Builtin(Builtin::Default),
            parameters_json: config.parameters_json.clone(),
            on_error: config.on_error,
            pick_budget: config.pick_budget,
            quarantine_after: config.quarantine_after.max(1),
            hang_after: config.hang_after,
            inputs,
            policy,
            stats,
            poisoned: AtomicBool::new(false),
            poison_reason: OnceLock::new(),
            quarantined: AtomicBool::new(false),
            quarantine_reason: OnceLock::new(),
            consecutive_slow: AtomicU32::new(0),
            watch,
            logs: InstanceLogs::default(),
        })
    }
}

/// The built-in types, the start of every catalog.
fn builtin_types() -> BTreeMap<String, (TypeOrigin, PolicyTypeDoc)> {
    Builtin::ALL
        .into_iter()
        .map(|b| (b.as_str().to_string(), (TypeOrigin::Builtin(b), b.doc())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(name: &str) -> PolicyTypeDoc {
        PolicyTypeDoc {
            name: name.to_string(),
            summary: String::new(),
            parameters: Vec::new(),
        }
    }

    fn register(
        types: &mut BTreeMap<String, (TypeOrigin, PolicyTypeDoc)>,
        index: usize,
        path: &str,
        names: &[&str],
    ) -> Result<(), String> {
        let docs: Vec<PolicyTypeDoc> = names.iter().map(|n| doc(n)).collect();
        register_library_types(types, index, Path::new(path), &docs, |o| match o {
            TypeOrigin::Builtin(_) => BUILT_IN.to_string(),
            TypeOrigin::Plugin(i) => format!("/lib{i}.so"),
        })
        .map_err(|e| e.to_string())
    }

    #[test]
    fn one_library_exporting_a_type_twice_is_named_once_with_the_type() {
        let mut types = BTreeMap::new();
        let err = register(&mut types, 0, "/lib0.so", &["probe", "other", "probe"]).unwrap_err();
        assert_eq!(err, "library /lib0.so exports policy type `probe` twice");
    }

    #[test]
    fn two_libraries_exporting_one_type_still_name_both() {
        let mut types = BTreeMap::new();
        register(&mut types, 0, "/lib0.so", &["probe"]).unwrap();
        let err = register(&mut types, 1, "/lib1.so", &["probe"]).unwrap_err();
        assert_eq!(
            err,
            "policy type `probe` is exported by two libraries: /lib0.so and /lib1.so"
        );
    }

    #[test]
    fn a_type_named_like_a_built_in_is_refused_as_such_not_as_a_second_library() {
        for builtin in Builtin::ALL {
            let mut types = builtin_types();
            let err = register(&mut types, 0, "/lib0.so", &["ok", builtin.as_str()]);
            assert_eq!(
                err.unwrap_err(),
                format!(
                    "library /lib0.so exports policy type `{}`, which is the name of a built-in \
                     policy type (built-ins: `default`, `round-robin`, `random`); a plugin cannot \
                     replace a built-in, so the library is refused: rename the type in the plugin",
                    builtin.as_str()
                )
            );
        }
    }

    #[test]
    fn type_names_are_restricted_to_a_printable_set() {
        for good in [
            "probe",
            "dynamo-two-tier-cost-fn",
            "soft-pin-repin",
            "versioned-least-loaded",
            "a_b.c:d-E9",
            &"x".repeat(MAX_TYPE_NAME_LEN),
        ] {
            assert!(is_valid_type_name(good), "{good}");
        }
        for builtin in Builtin::ALL {
            assert!(is_valid_type_name(builtin.as_str()));
        }
        for bad in [
            "",
            "has space",
            "tab\there",
            "bell\u{7}",
            "\u{1b}[31mred\u{1b}[0m",
            "new\nline",
            "caf\u{e9}",
            "slash/name",
            "quote`",
            &"x".repeat(MAX_TYPE_NAME_LEN + 1),
        ] {
            assert!(!is_valid_type_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn an_unsafe_type_name_is_refused_escaped_naming_the_library() {
        let mut types = BTreeMap::new();
        let err = register(&mut types, 0, "/evil.so", &["ok", "\u{1b}[2Jwipe\r\n"]).unwrap_err();
        assert_eq!(
            err,
            "library /evil.so exports a policy type named \"\\u{1b}[2Jwipe\\r\\n\", which is \
             not a valid type name: it must be 1 to 128 characters from A-Z, a-z, 0-9, `_`, `.`, \
             `:` and `-`"
        );
        assert!(!err.chars().any(|c| c.is_control()), "{err:?}");
        // A huge name is cut, not printed whole.
        let long = format!("\u{7}{}", "y".repeat(1 << 20));
        let err = register(&mut types, 1, "/big.so", &[&long]).unwrap_err();
        assert!(err.len() < 600, "{} bytes", err.len());
        assert!(
            err.contains("\"\\u{7}yyy") && err.contains("... (1048577 bytes)"),
            "{err}"
        );
    }
}
