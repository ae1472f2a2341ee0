//! Steps 4-5: `dlopen` the file through its descriptor, read abi_stable's header and check the
//! root module's version and layout (accepting older 1.x plugins), and turn the loader's errors
//! into [`LoadError`]s that name the configured path.

use std::path::{Path, PathBuf};

use abi_stable::abi_stability::abi_checking::check_layout_compatibility;
use abi_stable::library::{LibHeader, LibraryError, RootModule};
use abi_stable::sabi_types::VersionNumber;
use abi_stable::std_types::RBoxError;
use abi_stable::StableAbi;
use plugin_api::abi::PolicyLibraryRef;

use super::LoadError;

/// `init_root_module`, accepting older 1.x plugins too.
///
/// abi_stable's layout check takes the host's types as the interface and only accepts a plugin
/// whose prefix types (the root module, the policy-object vtable) have *at least* the host's
/// fields: a plugin built against an older minor, which lacks the fields added since, is
/// reported as "too many fields" (abi_stable issue #118). Reading such a plugin is safe: fields
/// after `last_prefix_field` are read through accessors that see them as absent, and methods
/// added after it fall back to their default bodies. So when the normal check fails, check the
/// other direction (the plugin's layout as the interface, the host's as the implementation);
/// every non-prefix type must still match exactly either way, so a changed layout under the same
/// version is still refused.
pub(super) fn init_root_module(header: &LibHeader) -> Result<PolicyLibraryRef, LibraryError> {
    match header.init_root_module::<PolicyLibraryRef>() {
        Err(LibraryError::AbiInstability(forward)) => {
            let Some(plugin) = header.layout() else {
                return Err(LibraryError::AbiInstability(forward));
            };
            match check_layout_compatibility(plugin, <PolicyLibraryRef as StableAbi>::LAYOUT) {
                // SAFETY: the layouts were just checked (plugin as interface, host as
                // implementation); the version is checked inside.
                Ok(()) => unsafe { header.init_root_module_with_unchecked_layout() },
                // Report the check that fits the plugin's age: for an older plugin the forward
                // check only complains about the fields it cannot have.
                Err(backward) if plugin_is_older(header) => Err(LibraryError::AbiInstability(
                    RBoxError::from_fmt(&format_args!("{PLUGIN_AS_INTERFACE}\n{backward}")),
                )),
                Err(_) => Err(LibraryError::AbiInstability(forward)),
            }
        }
        other => other,
    }
}

/// Marks a layout report whose "Expected" side is the plugin's and "Found" side the host's.
const PLUGIN_AS_INTERFACE: &str = "(layout checked with the plugin's types as the interface)";

/// Whether the plugin was built against an older plugin-api minor than this host's.
fn plugin_is_older(header: &LibHeader) -> bool {
    let host = <PolicyLibraryRef as RootModule>::VERSION_STRINGS;
    match (
        VersionNumber::new(header.version_strings()),
        VersionNumber::new(host),
    ) {
        (Ok(plugin), Ok(host)) => (plugin.major, plugin.minor) < (host.major, host.minor),
        _ => false,
    }
}

/// `/proc/self/fd/N` for an open file, when procfs is there.
pub(super) fn pinned_path(file: &std::fs::File) -> Option<PathBuf> {
    use std::os::fd::AsRawFd;
    let path = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
    path.exists().then_some(path)
}

/// Report errors against the configured path, not the `/proc/self/fd/N` alias the library was
/// opened as: the error's path becomes `path`, and the alias is taken out of the loader's own
/// text (`dlerror`, abi_stable's reports), which names the file it was given.
pub(super) fn with_path(err: LoadError, pinned: &Path, path: &Path) -> LoadError {
    let fix = |text: String| name_the_file(&text, pinned, path);
    match err {
        LoadError::Open { message, .. } => LoadError::Open {
            path: path.to_path_buf(),
            message: fix(message),
        },
        LoadError::RootModule { message, .. } => LoadError::RootModule {
            path: path.to_path_buf(),
            message: fix(message),
        },
        LoadError::LayoutMismatch {
            plugin_api,
            host_api,
            summary,
            detail,
            ..
        } => LoadError::LayoutMismatch {
            path: path.to_path_buf(),
            plugin_api,
            host_api,
            summary: fix(summary),
            detail: fix(detail),
        },
        other => other,
    }
}

/// `text` with the descriptor alias `pinned` (`/proc/self/fd/N`) replaced by `path`; where the
/// alias starts a `dlerror` clause (`/proc/self/fd/3: invalid ELF header`) it is dropped instead,
/// since every message already starts with `plugin file PATH:`. `/proc/self/fd/31` is not an
/// occurrence of `/proc/self/fd/3`.
fn name_the_file(text: &str, pinned: &Path, path: &Path) -> String {
    let alias = pinned.to_string_lossy();
    if pinned == path || alias.is_empty() {
        return text.to_string();
    }
    let real = path.display().to_string();
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(alias.as_ref()) {
        let after = &rest[at + alias.len()..];
        out.push_str(&rest[..at]);
        if after.starts_with(|c: char| c.is_ascii_digit()) {
            // Another descriptor: keep it as it is.
            out.push_str(&alias);
        } else if let Some(clause) = after.strip_prefix(": ") {
            let starts_clause = out.is_empty() || out.ends_with(": ") || out.ends_with('\n');
            if starts_clause {
                rest = clause;
                continue;
            }
            out.push_str(&real);
        } else {
            out.push_str(&real);
        }
        rest = after;
    }
    out.push_str(rest);
    out
}

/// `dlopen(RTLD_NOW | RTLD_LOCAL)` and keep the handle forever, so unresolved symbols fail at
/// startup and abi_stable's later (lazy) open finds the library already bound.
pub(super) fn open_now(path: &Path) -> Result<(), LoadError> {
    use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
    // SAFETY: loading a library runs its initialisers; plugins are trusted native code (see
    // docs/reliability.md). The handle is leaked on purpose: libraries are never unloaded.
    let library = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_LOCAL) }.map_err(|e| {
        LoadError::Open {
            path: path.to_path_buf(),
            message: error_chain(&e),
        }
    })?;
    std::mem::forget(library);
    Ok(())
}

/// libloading hides `dlerror`'s text in `source()`: print the whole chain.
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        let next = s.to_string();
        if !text.contains(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = s.source();
    }
    text
}

pub(super) fn library_error(path: &Path, err: LibraryError) -> LoadError {
    let path = path.to_path_buf();
    match err {
        LibraryError::OpenError { err, .. } => LoadError::Open {
            path,
            message: error_chain(&*err),
        },
        LibraryError::GetSymbolError { .. } => LoadError::NotAPolicyLibrary { path },
        LibraryError::InvalidAbiHeader(found) => LoadError::AbiStableMismatch {
            path,
            found: format!("abi_stable ABI {}.{}", found.abi_major, found.abi_minor),
            expected: {
                let host = abi_stable::library::AbiHeader::VALUE;
                format!("abi_stable ABI {}.{}", host.abi_major, host.abi_minor)
            },
        },
        LibraryError::IncompatibleVersionNumber {
            expected_version,
            actual_version,
            ..
        } => LoadError::IncompatibleApi {
            path,
            plugin: actual_version.to_string(),
            host: format!("{}.x", expected_version.major),
        },
        LibraryError::AbiInstability(report) => {
            let detail = report.to_string();
            LoadError::LayoutMismatch {
                path,
                plugin_api: String::new(),
                host_api: plugin_api::API_VERSION.to_string(),
                summary: layout_summary(&detail),
                detail,
            }
        }
        LibraryError::RootModule { err, .. } => LoadError::RootModule {
            path,
            message: err.to_string(),
        },
        other => LoadError::Open {
            path,
            message: other.to_string().trim().to_string(),
        },
    }
}

/// One line out of abi_stable's layout report: what differs, which sits at the end of the report
/// (`Error:<what>` followed by `Expected:` / `Found:` lines).
fn layout_summary(detail: &str) -> String {
    let (host, plugin) = if detail.starts_with(PLUGIN_AS_INTERFACE) {
        ("Found:", "Expected:")
    } else {
        ("Expected:", "Found:")
    };
    let lines: Vec<&str> = detail
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let hint = "run with RUST_LOG=router_host=debug for the full layout report";
    let Some(at) = lines.iter().rposition(|l| l.starts_with("Error:")) else {
        return format!("root module layout differs ({hint})");
    };
    let what = lines[at].trim_start_matches("Error:");
    let value_after = |label: &str| {
        lines[at..]
            .iter()
            .position(|l| *l == label)
            .and_then(|i| lines.get(at + i + 1))
            .copied()
            .unwrap_or("?")
    };
    format!(
        "{what}: host has {}, plugin has {} ({hint})",
        value_after(host),
        value_after(plugin)
    )
}

/// The root-module name the host expects, for messages.
pub fn root_module_name() -> &'static str {
    <PolicyLibraryRef as RootModule>::NAME
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_descriptor_alias_is_replaced_by_the_real_path() {
        let pinned = Path::new("/proc/self/fd/3");
        let path = Path::new("/opt/p/libx.so");
        let fix = |text: &str| name_the_file(text, pinned, path);
        // A clause that starts with the alias: the message already names the file.
        assert_eq!(
            fix("dlopen failed: /proc/self/fd/3: invalid ELF header"),
            "dlopen failed: invalid ELF header"
        );
        assert_eq!(fix("/proc/self/fd/3: file too short"), "file too short");
        // Elsewhere it becomes the path; another descriptor is left alone.
        assert_eq!(
            fix("libdep.so: undefined symbol: f (needed by /proc/self/fd/3)"),
            "libdep.so: undefined symbol: f (needed by /opt/p/libx.so)"
        );
        assert_eq!(
            fix("at /proc/self/fd/31: x, then /proc/self/fd/3"),
            "at /proc/self/fd/31: x, then /opt/p/libx.so"
        );
        assert_eq!(fix("no alias here"), "no alias here");
        // Without procfs the file was opened by its own path: nothing to replace.
        assert_eq!(
            name_the_file("/opt/p/libx.so: bad", path, path),
            "/opt/p/libx.so: bad"
        );
    }
}
