//! Finding, opening and validating policy libraries.
//!
//! Order of operations for each configured plugin, each step with its own error:
//! 1. resolve the entry to a file (`path:` as given, `name:` through the search path);
//! 2. identify it by canonical path and (device, inode), so one file listed twice or reached
//!    through a symlink is loaded once;
//! 3. check its permissions and, with a `sha256`, copy it into a sealed memory file and hash the
//!    copy (what is hashed is what gets mapped);
//! 4. `dlopen` it (or the sealed copy) through `/proc/self/fd/N` with `RTLD_NOW | RTLD_LOCAL`,
//!    so a missing symbol fails here, not at the first request (abi_stable's own open is lazy);
//! 5. read the header with `lib_header_from_path(..).init_root_module()` *per file*
//!    (`RootModule::load_from_file` caches the first module of a type and would hand it back for
//!    every path), which checks the abi_stable header, the plugin-api major version and the
//!    root module's layout;
//! 6. refuse `panic = "abort"` builds, whose panics could not be contained.
//!
//! Libraries are never unloaded: a file replaced on disk (renamed over) after startup has no
//! effect, and one loaded from a sealed copy is immune to in-place rewrites too.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use abi_stable::abi_stability::abi_checking::check_layout_compatibility;
use abi_stable::library::{lib_header_from_path, LibHeader, LibraryError, RootModule};
use abi_stable::sabi_types::VersionNumber;
use abi_stable::std_types::RBoxError;
use abi_stable::std_types::RVec;
use abi_stable::StableAbi;
use plugin_api::abi::{PolicyLibraryRef, RawPolicyTypeInfo};
use plugin_api::ParamDoc;

use crate::config::{self, PluginSource, PluginSpec};

/// Why a plugin could not be loaded. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("plugin `{name}` not found; tried: {}{}", list_paths(.tried), not_found_hint(.tried))]
    NotFound { name: String, tried: Vec<PathBuf> },

    #[error("plugin file {}: not a regular file ({kind}); a plugin is a shared object (`.so`)", .path.display())]
    NotAFile { path: PathBuf, kind: &'static str },

    #[error("plugin file {}: {message}", .path.display())]
    Unreadable { path: PathBuf, message: String },

    #[error("plugin file {}: cannot be loaded: {}", .path.display(), printable(.message))]
    Open { path: PathBuf, message: String },

    #[error("plugin file {}: not a policy library (it does not export the router policy root module)", .path.display())]
    NotAPolicyLibrary { path: PathBuf },

    #[error("plugin file {}: built with an incompatible abi_stable ({found}); this host uses {expected}", .path.display())]
    AbiStableMismatch {
        path: PathBuf,
        found: String,
        expected: String,
    },

    #[error("plugin file {}: built for plugin-api {plugin}, host supports {host}", .path.display())]
    IncompatibleApi {
        path: PathBuf,
        plugin: String,
        host: String,
    },

    #[error("plugin file {}: its plugin-api types do not match this host's (plugin built against plugin-api {}, host has {host_api}): {}", .path.display(), printable(.plugin_api), printable(.summary))]
    LayoutMismatch {
        path: PathBuf,
        plugin_api: String,
        host_api: String,
        summary: String,
        /// abi_stable's full layout report (pages long); logged at debug level.
        detail: String,
    },

    #[error("plugin file {}: root module failed to initialise: {}", .path.display(), printable(.message))]
    RootModule { path: PathBuf, message: String },

    #[error("plugin file {}: sha256 mismatch: configured {expected}, file has {actual}; refusing to load it", .path.display())]
    HashMismatch {
        path: PathBuf,
        expected: String,
        actual: String,
    },

    #[error("plugin file {}: refusing to load: {problem}; or {}", .path.display(), .bypass.remedy())]
    InsecurePermissions {
        path: PathBuf,
        problem: String,
        /// How the command that loads the file skips the check (named in the message).
        bypass: PermissionBypass,
    },

    #[error("plugin file {}: plugin `{}` was built with panic = \"abort\"; its panics could not be contained, so it is refused (build it with the default panic = \"unwind\")", .path.display(), printable(.plugin))]
    PanicAbort { path: PathBuf, plugin: String },
}

/// How the user skips the ownership and permission checks, which depends on the command that
/// loads the file; a refusal names the one that fits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PermissionBypass {
    /// `allow_insecure_permissions: true` on the plugin's entry in the router YAML (the host,
    /// `check`, `select`, `replay`).
    #[default]
    ConfigKey,
    /// The `--allow-insecure-permissions` flag of `router-host describe`.
    DescribeFlag,
}

impl PermissionBypass {
    fn remedy(self) -> &'static str {
        match self {
            PermissionBypass::ConfigKey => {
                "set `allow_insecure_permissions: true` on this plugin to skip these checks"
            }
            PermissionBypass::DescribeFlag => {
                "skip these checks with `--allow-insecure-permissions` for `router-host describe`"
            }
        }
    }
}

/// Text a plugin supplied (its name, version, type summaries, parameter docs, error messages),
/// made safe to print on a terminal: control characters (newlines and tabs included, as `\n` and
/// `\t`), terminal escapes (`\u{1b}`) and invisible format characters such as bidirectional
/// overrides are escaped the way [`str::escape_debug`] escapes them; quotes, backslashes and
/// every printable character (non-ASCII letters too) are kept. The one helper every message and
/// every `check`/`describe` line that shows plugin text goes through.
pub fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(needs_escape) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if needs_escape(c) {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// The most bytes of one plugin-supplied text (a log message, an error, a panic message) the
/// host keeps: a plugin cannot make one log line or one error arbitrarily large.
pub const MAX_PLUGIN_TEXT_BYTES: usize = 1024;

/// Text a plugin hands the host at run time, made safe to log and to show: [`printable`]
/// (no control characters, so no forged log lines or terminal escapes), then cut to
/// [`MAX_PLUGIN_TEXT_BYTES`] on a character boundary, saying how much was cut.
pub fn plugin_text(text: &str) -> String {
    let escaped = printable(text);
    if escaped.len() <= MAX_PLUGIN_TEXT_BYTES {
        return escaped.into_owned();
    }
    let mut end = MAX_PLUGIN_TEXT_BYTES;
    while !escaped.is_char_boundary(end) {
        end -= 1;
    }
    format!(
        "{}... ({} more bytes cut)",
        escaped.get(..end).unwrap_or_default(),
        escaped.len() - end
    )
}

/// Whether [`printable`] escapes `c`: an ASCII control character, or a non-ASCII character that
/// `str::escape_debug` escapes when it is not the first character (C1 controls, format
/// characters such as U+202E, unassigned code points; not combining marks, which
/// `char::escape_debug` would escape too).
fn needs_escape(c: char) -> bool {
    if c.is_ascii() {
        return c.is_ascii_control();
    }
    let mut buf = [0u8; 5];
    buf[0] = b'a';
    let len = 1 + c.encode_utf8(&mut buf[1..]).len();
    match std::str::from_utf8(&buf[..len]) {
        Ok(text) => !text.escape_debug().eq(text.chars()),
        Err(_) => true,
    }
}

/// What probably went wrong when no `lib<name>.so` exists: a crate built as `rlib` only leaves a
/// `lib<name>.rlib` beside where the `.so` would be.
fn not_found_hint(tried: &[PathBuf]) -> String {
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
fn not_a_file(path: &Path) -> Option<LoadError> {
    use std::os::unix::fs::FileTypeExt;
    let kind = match std::fs::metadata(path) {
        Ok(meta) => meta.file_type(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            return Some(LoadError::Unreadable {
                path: path.to_path_buf(),
                message: e.to_string(),
            })
        }
    };
    let kind = if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_socket() {
        "a socket"
    } else {
        return None;
    };
    Some(LoadError::NotAFile {
        path: path.to_path_buf(),
        kind,
    })
}

fn list_paths(paths: &[PathBuf]) -> String {
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

/// Documentation of one policy type, as exported by a library or built in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyTypeDoc {
    pub name: String,
    pub summary: String,
    pub parameters: Vec<ParamDoc>,
}

impl From<&RawPolicyTypeInfo> for PolicyTypeDoc {
    fn from(raw: &RawPolicyTypeInfo) -> Self {
        PolicyTypeDoc {
            name: raw.name.to_string(),
            summary: raw.summary.to_string(),
            parameters: raw
                .parameters
                .iter()
                .map(|p| ParamDoc {
                    name: p.name.to_string(),
                    type_name: p.type_name.to_string(),
                    default: p.default.to_string(),
                    meaning: p.meaning.to_string(),
                })
                .collect(),
        }
    }
}

/// Checks made on a plugin file before it is opened.
#[derive(Debug, Clone, Copy, Default)]
pub struct Verify<'a> {
    /// Expected SHA-256 of the file (lowercase hex).
    pub sha256: Option<&'a str>,
    /// Skip the ownership and permission checks.
    pub allow_insecure_permissions: bool,
}

impl<'a> Verify<'a> {
    pub fn from_spec(spec: &'a PluginSpec) -> Self {
        Verify {
            sha256: spec.sha256.as_deref(),
            allow_insecure_permissions: spec.allow_insecure_permissions,
        }
    }
}

/// A loaded, validated policy library.
pub struct PolicyLibrary {
    /// Canonical path of the file.
    pub path: PathBuf,
    pub plugin_name: String,
    pub plugin_version: String,
    /// The plugin-api version the plugin was built against.
    pub api_version: String,
    pub types: Vec<PolicyTypeDoc>,
    pub(crate) module: PolicyLibraryRef,
}

impl std::fmt::Debug for PolicyLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyLibrary")
            .field("path", &self.path)
            .field("plugin_name", &self.plugin_name)
            .field("plugin_version", &self.plugin_version)
            .field("api_version", &self.api_version)
            .field("types", &self.types)
            .finish_non_exhaustive()
    }
}

/// (device, inode): the identity of a file whatever path reaches it.
type FileId = (u64, u64);

fn file_id(path: &Path) -> Result<(PathBuf, FileId), LoadError> {
    let unreadable = |e: std::io::Error| LoadError::Unreadable {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let canonical = path.canonicalize().map_err(unreadable)?;
    let meta = std::fs::metadata(&canonical).map_err(unreadable)?;
    Ok((canonical, (meta.dev(), meta.ino())))
}

/// Loads each distinct file once.
#[derive(Debug, Default)]
pub struct Loader {
    libraries: Vec<PolicyLibrary>,
    by_file: HashMap<FileId, usize>,
    /// Per library: the SHA-256 of the sealed copy it was mapped from, if it was.
    mapped_sha256: Vec<Option<String>>,
}

impl Loader {
    pub fn new() -> Self {
        Self::default()
    }

    /// Load `path` (or return the library already loaded from the same file).
    pub fn load(&mut self, path: &Path, verify: Verify<'_>) -> Result<usize, LoadError> {
        let (canonical, id) = file_id(path)?;
        if let Some(&index) = self.by_file.get(&id) {
            // Loaded once, but every entry naming the file gets its own checks. A `sha256` is
            // checked against the bytes that were mapped when they were a sealed copy (the file
            // may have been rewritten since); otherwise against the file.
            match (&self.mapped_sha256[index], verify.sha256) {
                (Some(mapped), Some(expected)) => {
                    if !verify.allow_insecure_permissions {
                        check_permissions(path, &open_file(path)?, PermissionBypass::ConfigKey)?;
                    }
                    if !mapped.eq_ignore_ascii_case(expected) {
                        return Err(LoadError::HashMismatch {
                            path: path.to_path_buf(),
                            expected: expected.to_ascii_lowercase(),
                            actual: mapped.clone(),
                        });
                    }
                }
                _ => check_file(path, path, &open_file(path)?, verify)?,
            }
            tracing::debug!(path = %path.display(), "plugin file already loaded; reusing it");
            return Ok(index);
        }
        let (library, mapped_sha256) = map_checked(prepare_as(
            &canonical,
            path,
            verify,
            PermissionBypass::ConfigKey,
        )?)?;
        tracing::info!(
            path = %library.path.display(),
            plugin = %library.plugin_name,
            version = %library.plugin_version,
            api = %library.api_version,
            types = ?library.types.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(),
            "loaded policy library"
        );
        self.libraries.push(library);
        self.mapped_sha256.push(mapped_sha256);
        let index = self.libraries.len() - 1;
        self.by_file.insert(id, index);
        Ok(index)
    }

    pub fn libraries(&self) -> &[PolicyLibrary] {
        &self.libraries
    }

    pub fn into_libraries(self) -> Vec<PolicyLibrary> {
        self.libraries
    }
}

/// Open and validate one library file (steps 3-6 of the module docs), after the supply-chain
/// checks of `verify`.
///
/// The file is opened once and every later step (permission and hash checks, both `dlopen`s)
/// goes through that descriptor (`/proc/self/fd/N`), so a file swapped on disk between the
/// checks and the load can never be the one that runs. With a `sha256`, the descriptor is that of
/// a sealed in-memory copy of the file (see [`prepare`]): the hash is of exactly the bytes that
/// get mapped, even if the file is rewritten in place meanwhile.
///
/// A refusal by the permission check names `allow_insecure_permissions: true` (the YAML key) as
/// the way to skip it; [`open_library_with`] names another.
pub fn open_library(path: &Path, verify: Verify<'_>) -> Result<PolicyLibrary, LoadError> {
    open_library_with(path, verify, PermissionBypass::ConfigKey)
}

/// [`open_library`], for a command whose way to skip the permission check is `bypass` (the one a
/// refusal names).
pub fn open_library_with(
    path: &Path,
    verify: Verify<'_>,
    bypass: PermissionBypass,
) -> Result<PolicyLibrary, LoadError> {
    map_prepared(prepare_as(path, path, verify, bypass)?)
}

/// A plugin file that passed the supply-chain checks, not yet mapped: the first half of
/// [`open_library`], split from [`map_prepared`] so tests can act between the two.
#[doc(hidden)]
#[derive(Debug)]
pub struct Prepared {
    /// The file as configured, for messages.
    path: PathBuf,
    /// What gets mapped: the sealed copy when a `sha256` was checked, else the opened file.
    file: std::fs::File,
    /// SHA-256 of `file` when it is a sealed copy (which can no longer change).
    sealed_sha256: Option<String>,
}

impl Prepared {
    /// Whether the bytes to be mapped are a sealed copy (a `sha256` was configured).
    pub fn is_sealed(&self) -> bool {
        self.sealed_sha256.is_some()
    }

    /// The descriptor [`map_prepared`] will `dlopen` (as `/proc/self/fd/N`).
    pub fn mapped_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.file.as_raw_fd()
    }
}

/// The checks of [`open_library`]: open `path`, check its permissions and, with a `sha256`, copy
/// it into a sealed memory file and hash that copy.
#[doc(hidden)]
pub fn prepare(path: &Path, verify: Verify<'_>) -> Result<Prepared, LoadError> {
    prepare_as(path, path, verify, PermissionBypass::ConfigKey)
}

/// [`prepare`] of `path`, the file that `given` (the path as configured, which may go through
/// symlinks) resolves to; the permission check walks `given`.
fn prepare_as(
    path: &Path,
    given: &Path,
    verify: Verify<'_>,
    bypass: PermissionBypass,
) -> Result<Prepared, LoadError> {
    if !path.is_file() {
        return Err(not_a_file(path).unwrap_or_else(|| LoadError::NotFound {
            name: path.display().to_string(),
            tried: vec![path.to_path_buf()],
        }));
    }
    let file = open_file(path)?;
    if !verify.allow_insecure_permissions {
        check_permissions(given, &file, bypass)?;
    }
    let Some(expected) = verify.sha256 else {
        return Ok(Prepared {
            path: path.to_path_buf(),
            file,
            sealed_sha256: None,
        });
    };
    // Hash a copy that nobody can change any more, and map that copy: hashing the file and
    // mapping it later would load whatever it holds by then.
    let sealed = sealed_copy(path, &file)?;
    let actual = check_sha256(path, &sealed, expected)?;
    Ok(Prepared {
        path: path.to_path_buf(),
        file: sealed,
        sealed_sha256: Some(actual),
    })
}

/// The second half of [`open_library`]: `dlopen` what [`prepare`] checked and validate it.
#[doc(hidden)]
pub fn map_prepared(prepared: Prepared) -> Result<PolicyLibrary, LoadError> {
    map_checked(prepared).map(|(library, _)| library)
}

/// [`map_prepared`], also returning the SHA-256 of the sealed copy mapped, if one was.
fn map_checked(prepared: Prepared) -> Result<(PolicyLibrary, Option<String>), LoadError> {
    let Prepared {
        path,
        file,
        sealed_sha256,
    } = prepared;
    let path = path.as_path();
    let pinned = match pinned_path(&file) {
        Some(pinned) => pinned,
        // A sealed copy has no other name; without procfs the load cannot be pinned to it.
        None if sealed_sha256.is_some() => {
            return Err(LoadError::Open {
                path: path.to_path_buf(),
                message: "cannot load the checked copy: /proc/self/fd is not available".into(),
            })
        }
        None => path.to_path_buf(),
    };
    open_now(&pinned).map_err(|e| with_path(e, &pinned, path))?;
    // The loader now knows the library by the name `/proc/self/fd/N`; closing the descriptor
    // would let the next plugin file reuse N and be mistaken for this one. Libraries are never
    // unloaded, so the descriptor is kept for the life of the process too.
    std::mem::forget(file);
    let header = lib_header_from_path(&pinned)
        .map_err(|e| with_path(library_error(path, e), &pinned, path))?;
    let module: PolicyLibraryRef = init_root_module(header).map_err(|e| {
        let err = with_path(library_error(path, e), &pinned, path);
        if let LoadError::LayoutMismatch { detail, .. } = &err {
            tracing::debug!(path = %path.display(), "full abi_stable layout report:\n{detail}");
        }
        // Fill in the plugin's own API version, which only the header knows.
        match err {
            LoadError::LayoutMismatch {
                path,
                host_api,
                summary,
                detail,
                ..
            } => LoadError::LayoutMismatch {
                path,
                plugin_api: header.version_strings().version.to_string(),
                host_api,
                summary,
                detail,
            },
            other => other,
        }
    })?;
    let plugin_name = module.plugin_name().to_string();
    if !module.panic_unwind() {
        return Err(LoadError::PanicAbort {
            path: path.to_path_buf(),
            plugin: plugin_name,
        });
    }
    let types: RVec<RawPolicyTypeInfo> = (module.policy_types())();
    if let Some(broken) = types.iter().find(|t| t.name.is_empty()) {
        return Err(LoadError::RootModule {
            path: path.to_path_buf(),
            message: broken.summary.to_string(),
        });
    }
    let library = PolicyLibrary {
        path: path.to_path_buf(),
        plugin_name,
        plugin_version: module.plugin_version().to_string(),
        api_version: module.api_version().to_string(),
        types: types.iter().map(PolicyTypeDoc::from).collect(),
        module,
    };
    Ok((library, sealed_sha256))
}

fn open_file(path: &Path) -> Result<std::fs::File, LoadError> {
    std::fs::File::open(path).map_err(|e| LoadError::Unreadable {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// The supply-chain checks of `verify`, on an open file: `path`, reached as `given`.
fn check_file(
    path: &Path,
    given: &Path,
    file: &std::fs::File,
    verify: Verify<'_>,
) -> Result<(), LoadError> {
    if !verify.allow_insecure_permissions {
        check_permissions(given, file, PermissionBypass::ConfigKey)?;
    }
    if let Some(expected) = verify.sha256 {
        check_sha256(path, file, expected)?;
    }
    Ok(())
}

/// Hash `file` from its start and compare with `expected`; returns the hash.
fn check_sha256(path: &Path, file: &std::fs::File, expected: &str) -> Result<String, LoadError> {
    let actual = sha256_hex(file).map_err(|e| LoadError::Unreadable {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    if !actual.eq_ignore_ascii_case(expected) {
        return Err(LoadError::HashMismatch {
            path: path.to_path_buf(),
            expected: expected.to_ascii_lowercase(),
            actual,
        });
    }
    Ok(actual)
}

/// Longest memfd name Linux accepts (249 bytes plus the NUL).
const MEMFD_NAME_MAX: usize = 249;

/// Copy the open plugin `file` (`path`, for messages) into an anonymous memory file and seal it
/// against every change (`F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL`), so what is
/// hashed afterwards is what `dlopen` maps. The copy is positioned at its start.
///
/// At most the file's size when it was opened is copied, so a file that keeps growing cannot keep
/// the loader reading; a file changed during the copy only gives a copy whose hash mismatches.
fn sealed_copy(path: &Path, file: &std::fs::File) -> Result<std::fs::File, LoadError> {
    use std::io::{Read, Seek, SeekFrom};
    use std::os::fd::{AsRawFd, FromRawFd};
    let fail = |what: &str, e: std::io::Error| LoadError::Unreadable {
        path: path.to_path_buf(),
        message: format!(
            "cannot make the sealed in-memory copy checked against `sha256`: {what}: {e}"
        ),
    };
    // Named after the file, so /proc/PID/maps shows `/memfd:libNAME.so (deleted)`.
    let mut name: Vec<u8> = path
        .file_name()
        .map(|n| std::os::unix::ffi::OsStrExt::as_bytes(n).to_vec())
        .unwrap_or_else(|| b"plugin".to_vec());
    name.truncate(MEMFD_NAME_MAX);
    // A file name holds no NUL byte.
    let name = std::ffi::CString::new(name).map_err(|e| fail("memfd name", e.into()))?;
    let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    // Ask for an executable memfd explicitly (`vm.memfd_noexec = 1` makes non-executable the
    // default); kernels before 6.3 do not know MFD_EXEC, refuse it with EINVAL, and make every
    // memfd executable.
    // SAFETY: `name` is a valid NUL-terminated string that outlives the call; the flags are
    // valid memfd_create flags. The return value is checked below.
    let mut fd = unsafe { libc::memfd_create(name.as_ptr(), flags | libc::MFD_EXEC) };
    if fd < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
        // SAFETY: as above.
        fd = unsafe { libc::memfd_create(name.as_ptr(), flags) };
    }
    if fd < 0 {
        return Err(fail("memfd_create", std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just returned by memfd_create (checked non-negative) and nothing else
    // owns it; the `File` closes it.
    let mut copy = unsafe { std::fs::File::from_raw_fd(fd) };
    let len = file
        .metadata()
        .map_err(|e| fail("reading the file's size", e))?
        .len();
    let mut source = file;
    source
        .seek(SeekFrom::Start(0))
        .map_err(|e| fail("rewinding the file", e))?;
    std::io::copy(&mut source.take(len), &mut copy).map_err(|e| fail("copying the file", e))?;
    let seals = libc::F_SEAL_WRITE | libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
    // SAFETY: `copy` owns a valid memfd created with MFD_ALLOW_SEALING; F_ADD_SEALS takes an
    // int argument and does not touch memory. The return value is checked below.
    if unsafe { libc::fcntl(copy.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(fail(
            "sealing it (F_ADD_SEALS)",
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: as above; F_GET_SEALS takes no argument. The return value is checked below.
    let got = unsafe { libc::fcntl(copy.as_raw_fd(), libc::F_GET_SEALS) };
    if got < 0 {
        return Err(fail(
            "reading its seals (F_GET_SEALS)",
            std::io::Error::last_os_error(),
        ));
    }
    if got & seals != seals {
        return Err(fail(
            "sealing it",
            std::io::Error::other(format!("seals {got:#x} lack {:#x}", seals & !got)),
        ));
    }
    copy.seek(SeekFrom::Start(0))
        .map_err(|e| fail("rewinding the copy", e))?;
    Ok(copy)
}

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
fn init_root_module(header: &LibHeader) -> Result<PolicyLibraryRef, LibraryError> {
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
fn pinned_path(file: &std::fs::File) -> Option<PathBuf> {
    use std::os::fd::AsRawFd;
    let path = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
    path.exists().then_some(path)
}

/// Report errors against the configured path, not the `/proc/self/fd/N` alias the library was
/// opened as: the error's path becomes `path`, and the alias is taken out of the loader's own
/// text (`dlerror`, abi_stable's reports), which names the file it was given.
fn with_path(err: LoadError, pinned: &Path, path: &Path) -> LoadError {
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

/// Most symlinks followed while checking one path (Linux's own limit).
const MAX_SYMLINKS: usize = 40;

/// Refuse a file that someone other than us or root could have written, or swapped for another
/// by renaming an entry on the way to it (OpenSSH's StrictModes, with symlinks followed).
///
/// The file (through its open descriptor) must not be writable by group or others. Then `path`
/// is walked from `/` one name at a time, following symlinks the way the kernel does: every
/// directory a name is looked up in (so the directories of the path as given, of each symlink,
/// and of the resolved target, up to `/`) must not be writable by group or others unless it has
/// the sticky bit, and every directory, symlink and the file must be owned by the running user
/// or root. The sticky exception (`/tmp`, mode 1777) is sound because of the ownership rule: in
/// a sticky directory only an entry's owner (or the directory's owner, or root) can rename or
/// remove it, and every entry looked up is owned by us or root, as is the directory itself;
/// the one thing another user could have done there, create the name first as a hard link to a
/// file of ours or root's, is refused by [`check_not_planted`] (docs/reliability.md, "The sticky
/// rule"). The walk must end at the file that was opened (same device and inode). A refusal
/// names `bypass`, the way to skip these checks in the command that is loading the file.
fn check_permissions(
    path: &Path,
    file: &std::fs::File,
    bypass: PermissionBypass,
) -> Result<(), LoadError> {
    let unreadable = |e: std::io::Error| LoadError::Unreadable {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let refuse = |problem: String| LoadError::InsecurePermissions {
        path: path.to_path_buf(),
        problem,
        bypass,
    };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let meta = file.metadata().map_err(unreadable)?;
    let shown = path.display();
    check_entry(&format!("the file ({shown})"), path, &meta, me, false).map_err(refuse)?;
    let reached = walk_checked(path, me).map_err(|e| match e {
        WalkError::Io(e) => unreadable(e),
        WalkError::Refused(problem) => refuse(problem),
    })?;
    if (reached.dev(), reached.ino()) != (meta.dev(), meta.ino()) {
        return Err(refuse(format!(
            "{shown} changed while its path was checked (it no longer names the opened file)"
        )));
    }
    Ok(())
}

enum WalkError {
    Io(std::io::Error),
    Refused(String),
}

impl From<std::io::Error> for WalkError {
    fn from(e: std::io::Error) -> Self {
        WalkError::Io(e)
    }
}

/// Walks `path` from `/` (see [`check_permissions`]), checking each directory before a name is
/// looked up in it and each symlink before it is followed; returns what the path names.
fn walk_checked(path: &Path, me: u32) -> Result<std::fs::Metadata, WalkError> {
    use std::path::Component;
    let absolute = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()?.join(path)
    };
    // Names still to look up, the next one last.
    let mut pending: Vec<std::ffi::OsString> = Vec::new();
    let push = |pending: &mut Vec<std::ffi::OsString>, p: &Path| {
        for component in p.components().rev() {
            match component {
                Component::Normal(name) => pending.push(name.to_os_string()),
                Component::ParentDir => pending.push("..".into()),
                Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
            }
        }
    };
    push(&mut pending, &absolute);
    // Always a real directory path (no symlinks), so `..` is its parent.
    let mut dir = PathBuf::from("/");
    let mut dir_meta = std::fs::symlink_metadata(&dir)?;
    let mut links = 0;
    while let Some(name) = pending.pop() {
        if name == ".." {
            dir.pop();
            dir_meta = std::fs::symlink_metadata(&dir)?;
            continue;
        }
        let next = dir.join(&name);
        let meta = std::fs::symlink_metadata(&next)?;
        let shown = dir.display();
        if meta.file_type().is_symlink() {
            let what = format!(
                "the directory ({shown}) holding the symlink {}",
                next.display()
            );
            check_entry(&what, &dir, &dir_meta, me, true).map_err(WalkError::Refused)?;
            let what = format!("the symlink ({})", next.display());
            check_entry(&what, &next, &meta, me, false).map_err(WalkError::Refused)?;
            check_not_planted(&what, &dir, &dir_meta, &meta).map_err(WalkError::Refused)?;
            links += 1;
            if links > MAX_SYMLINKS {
                return Err(WalkError::Io(std::io::Error::other(format!(
                    "more than {MAX_SYMLINKS} symlinks on the way to {}",
                    path.display()
                ))));
            }
            let target = std::fs::read_link(&next)?;
            if target.is_absolute() {
                dir = PathBuf::from("/");
                dir_meta = std::fs::symlink_metadata(&dir)?;
            }
            push(&mut pending, &target);
            continue;
        }
        let what = if pending.is_empty() {
            format!("its directory ({shown})")
        } else {
            format!("the directory {shown} on the way to it")
        };
        check_entry(&what, &dir, &dir_meta, me, true).map_err(WalkError::Refused)?;
        if pending.is_empty() {
            let what = format!("the file ({})", next.display());
            check_not_planted(&what, &dir, &dir_meta, &meta).map_err(WalkError::Refused)?;
            return Ok(meta);
        }
        dir = next;
        dir_meta = meta;
    }
    // The path ended in `..` or named `/`: not the file that was opened.
    Ok(dir_meta)
}

/// The ownership and mode rules for one entry; `what` describes it, `path` is what to chmod.
fn check_entry(
    what: &str,
    path: &Path,
    meta: &std::fs::Metadata,
    me: u32,
    directory: bool,
) -> Result<(), String> {
    let mode = meta.mode() & 0o7777;
    let uid = meta.uid();
    let shown = path.display();
    let symlink = meta.file_type().is_symlink();
    if uid != me && uid != 0 {
        let fix = if symlink {
            // `chown` without `-h` would change the file the symlink points to.
            format!("`chown -h {me} {shown}`, or configure the file it points to instead")
        } else if directory {
            format!(
                "`chown {me} {shown}`, or move the plugin to a directory only you (and root) \
                 can write"
            )
        } else {
            format!(
                "`chown {me} {shown}`, or copy it (`cp`) to a directory only you (and root) \
                 can write: the copy is yours"
            )
        };
        return Err(format!(
            "{what} is owned by uid {uid}, not by the running user (uid {me}) or root (mode \
             {mode:o}); fix: {fix}"
        ));
    }
    // A symlink's own mode means nothing (and is 777).
    if symlink {
        return Ok(());
    }
    let sticky = mode & 0o1000 != 0;
    if mode & 0o022 != 0 && !(directory && sticky) {
        let fix = if directory {
            format!(
                "`chmod go-w {shown}`, or move the plugin to a directory only you (and root) can \
                 write (a directory others can write is accepted only if it is sticky, mode \
                 1777 like /tmp: see docs/reliability.md, Plugin file checks)"
            )
        } else {
            format!("`chmod go-w {shown}`")
        };
        return Err(format!(
            "{what} is writable by group or others (mode {mode:o}) and owned by uid {uid}; fix: \
             {fix}"
        ));
    }
    Ok(())
}

/// In a sticky directory that others can write (`/tmp`), nobody else can rename or remove our
/// entries, but anyone could have created the name first as a hard link to a file that belongs
/// to us or root (another plugin, an old build, any root-owned library), which passes every
/// ownership and mode check. A file we put there ourselves has one link; refuse a file or
/// symlink with more. `what` describes the entry (`meta`), found in `dir` (`dir_meta`).
fn check_not_planted(
    what: &str,
    dir: &Path,
    dir_meta: &std::fs::Metadata,
    meta: &std::fs::Metadata,
) -> Result<(), String> {
    let shared = dir_meta.mode() & 0o022 != 0;
    if !shared || meta.is_dir() || meta.nlink() <= 1 {
        return Ok(());
    }
    Err(format!(
        "{what} has {} hard links and is in {}, a sticky directory that others can write \
         (mode {:o}): anyone who can write there could have made that name a hard link to a \
         file of yours or root's; fix: move the plugin to a directory only you (and root) can \
         write, or give it a copy of its own there (`cp`, not `ln`)",
        meta.nlink(),
        dir.display(),
        dir_meta.mode() & 0o7777
    ))
}

/// Lowercase hex SHA-256 of a file's contents.
pub fn sha256_hex(mut file: &std::fs::File) -> std::io::Result<String> {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let mut hasher = Sha256::new();
    let mut buf = [0u8; 64 * 1024];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// `dlopen(RTLD_NOW | RTLD_LOCAL)` and keep the handle forever, so unresolved symbols fail at
/// startup and abi_stable's later (lazy) open finds the library already bound.
fn open_now(path: &Path) -> Result<(), LoadError> {
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

fn library_error(path: &Path, err: LibraryError) -> LoadError {
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
    fn plugin_text_escapes_then_caps_on_a_character_boundary() {
        assert_eq!(plugin_text("fine"), "fine");
        assert_eq!(plugin_text("forged\nINFO line"), "forged\\nINFO line");
        let long = "\u{e9}".repeat(MAX_PLUGIN_TEXT_BYTES); // 2 bytes each
        let kept = plugin_text(&long);
        let cut = 2 * MAX_PLUGIN_TEXT_BYTES - MAX_PLUGIN_TEXT_BYTES;
        assert_eq!(
            kept,
            format!(
                "{}... ({cut} more bytes cut)",
                "\u{e9}".repeat(MAX_PLUGIN_TEXT_BYTES / 2)
            )
        );
    }

    #[test]
    fn printable_escapes_controls_and_invisible_format_characters_only() {
        // Plain text, quotes, backslashes, non-ASCII letters and combining marks stay as they are.
        for kept in [
            "plain",
            "caf\u{e9} e\u{301} \u{65e5}\u{672c}",
            "\"q\" 'a' \\ `b`",
            "",
        ] {
            assert!(
                matches!(printable(kept), std::borrow::Cow::Borrowed(_)),
                "{kept:?}"
            );
        }
        assert_eq!(printable("a\u{1b}[2Jb"), "a\\u{1b}[2Jb");
        assert_eq!(printable("one\r\ntwo\tthree"), "one\\r\\ntwo\\tthree");
        assert_eq!(printable("\u{7}\u{0}\u{7f}"), "\\u{7}\\0\\u{7f}");
        // C1 controls (U+009B is CSI on some terminals), bidi overrides, zero-width characters.
        assert_eq!(printable("\u{9b}31m"), "\\u{9b}31m");
        assert_eq!(printable("x\u{202e}y\u{200b}z"), "x\\u{202e}y\\u{200b}z");
        // A combining mark keeps its place even at the start.
        assert_eq!(printable("\u{301}a"), "\u{301}a");
    }

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
