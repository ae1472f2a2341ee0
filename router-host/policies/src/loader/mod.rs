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
//! Libraries are never unloaded: code of an old image may still run on a thread stuck in it
//! (see `watchdog.rs`), and abi_stable keeps references into every image it loaded, so
//! unmapping one is unsound. A file replaced on disk (renamed over) has no effect on the
//! configuration that loaded it; a later load of the configuration (a reload) maps the new file
//! as a new image, next to the old one. Every image mapped is remembered process-wide by its
//! identity ((device, inode) of the file mapped, or the SHA-256 of a sealed copy), so loading an
//! unchanged file again maps nothing new; the number of images is a gauge and capped
//! ([`Loader::with_image_cap`], `plugin_images_max`).
//!
//! Files: `resolve.rs` (step 1: `path:` and `name:` entries to a file), `permissions.rs` and
//! `sealed.rs` (step 3: who can change the file, and the sealed copy a `sha256` is checked on),
//! `abi.rs` (steps 4-5: `dlopen`, abi_stable's header and layout checks, and their errors in the
//! host's words), `text.rs` (plugin-supplied text made safe to print). This file holds the order
//! itself: [`Loader`], [`prepare`] and [`map_prepared`].

mod abi;
mod permissions;
mod resolve;
mod sealed;
mod text;

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock, PoisonError};

use abi_stable::library::lib_header_from_path;
use abi_stable::std_types::RVec;
use plugin_api::abi::{PolicyLibraryRef, RawPolicyTypeInfo};
use plugin_api::ParamDoc;

use router_config::PluginSpec;

pub use abi::root_module_name;
use abi::{init_root_module, library_error, open_now, pinned_path, with_path};
use permissions::check_permissions;
use resolve::{list_paths, not_a_file, not_found_hint};
pub use resolve::{resolve, SearchPath};
pub use sealed::sha256_hex;
use sealed::{check_sha256, sealed_copy};
pub use text::{plugin_text, printable, MAX_PLUGIN_TEXT_BYTES};

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

    #[error("plugin file {}: it is a new plugin image (a changed or replaced file), and this process already has {mapped} plugin images mapped, the most plugin_images_max ({cap}) allows; images of replaced plugins stay mapped until the process ends, so restart router-host to load it (or raise plugin_images_max)", .path.display())]
    ImageCap {
        path: PathBuf,
        mapped: usize,
        cap: usize,
    },
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
#[derive(Clone)]
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

/// What identifies a mapped image: the file it was mapped from (whose descriptor is kept open,
/// so the inode is never reused), or the contents of a sealed copy.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum ImageKey {
    File(FileId),
    Sealed(String),
}

/// Every plugin image this process has mapped (never unmapped), by identity.
fn images() -> &'static Mutex<HashMap<ImageKey, PolicyLibrary>> {
    static IMAGES: OnceLock<Mutex<HashMap<ImageKey, PolicyLibrary>>> = OnceLock::new();
    IMAGES.get_or_init(Mutex::default)
}

/// How many plugin images this process has mapped through a [`Loader`]: one per distinct file
/// (or sealed contents) ever loaded, old images of replaced files included (`serve`'s
/// `router_plugin_images_mapped`).
pub fn images_mapped() -> usize {
    images()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .len()
}

pub use router_config::DEFAULT_PLUGIN_IMAGES_MAX;

/// Loads each distinct file once.
#[derive(Debug)]
pub struct Loader {
    libraries: Vec<PolicyLibrary>,
    by_file: HashMap<FileId, usize>,
    /// Per library: the SHA-256 of the sealed copy it was mapped from, if it was.
    mapped_sha256: Vec<Option<String>>,
    /// The most images the process may have mapped once this loader mapped a new one.
    image_cap: usize,
}

impl Default for Loader {
    fn default() -> Self {
        Loader::with_image_cap(DEFAULT_PLUGIN_IMAGES_MAX)
    }
}

impl Loader {
    pub fn new() -> Self {
        Self::default()
    }

    /// A loader that refuses to map a new image once the process has `cap` of them
    /// ([`LoadError::ImageCap`]); an image already mapped is reused whatever the count.
    pub fn with_image_cap(cap: usize) -> Self {
        Loader {
            libraries: Vec::new(),
            by_file: HashMap::new(),
            mapped_sha256: Vec::new(),
            image_cap: cap,
        }
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
        let prepared = prepare_as(&canonical, path, verify, PermissionBypass::ConfigKey)?;
        let (library, mapped_sha256) = self.map_once(prepared)?;
        self.libraries.push(library);
        self.mapped_sha256.push(mapped_sha256);
        let index = self.libraries.len() - 1;
        self.by_file.insert(id, index);
        Ok(index)
    }

    /// Map `prepared`, or reuse the image already mapped from the same file or sealed contents.
    /// The registry's lock is held while mapping, so one image is never mapped twice.
    fn map_once(&self, prepared: Prepared) -> Result<(PolicyLibrary, Option<String>), LoadError> {
        let key = match &prepared.sealed_sha256 {
            Some(sha256) => ImageKey::Sealed(sha256.clone()),
            None => {
                let meta = prepared
                    .file
                    .metadata()
                    .map_err(|e| LoadError::Unreadable {
                        path: prepared.path.clone(),
                        message: e.to_string(),
                    })?;
                ImageKey::File((meta.dev(), meta.ino()))
            }
        };
        let mut images = images().lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(mapped) = images.get(&key) {
            // Same image: the descriptor just opened (or the sealed copy) is closed again.
            let library = PolicyLibrary {
                path: prepared.path.clone(),
                ..mapped.clone()
            };
            tracing::debug!(
                path = %library.path.display(),
                plugin = %library.plugin_name,
                version = %library.plugin_version,
                "plugin image already mapped in this process; reusing it"
            );
            return Ok((library, prepared.sealed_sha256));
        }
        if images.len() >= self.image_cap {
            return Err(LoadError::ImageCap {
                path: prepared.path,
                mapped: images.len(),
                cap: self.image_cap,
            });
        }
        let (library, mapped_sha256) = map_checked(prepared)?;
        images.insert(key, library.clone());
        let mapped = images.len();
        drop(images);
        tracing::info!(
            path = %library.path.display(),
            plugin = %library.plugin_name,
            version = %library.plugin_version,
            api = %library.api_version,
            types = ?library.types.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(),
            images_mapped = mapped,
            plugin_images_max = self.image_cap,
            "loaded policy library"
        );
        Ok((library, mapped_sha256))
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
