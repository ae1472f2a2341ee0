//! With a `sha256` configured, what is hashed is what gets mapped: the loader copies the plugin
//! into a sealed memory file, hashes that copy and `dlopen`s it, so rewriting the file on disk
//! (in place, same inode) after the check cannot change the library that runs.

mod common;

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use router_host::config::RouterConfig;
use router_host::loader::{self, LoadError, Loader, SearchPath, Verify};
use router_host::model::{Cluster, NoSignals, Request, Worker};
use router_host::policy_set::{PolicySet, Scratch, Selection};

/// A private copy (mode 644, directory 755) of the two-tier plugin named `file`, and its hash.
/// Every test uses its own file name, so its memfd mapping is told apart from the others'.
/// A private copy of the two-tier plugin and its hash; the guard removes it when dropped.
fn private_copy(test: &str, file: &str) -> (common::TempDir, PathBuf, String) {
    let guard = common::temp_dir(test);
    let dir = guard.join("plugins");
    std::fs::create_dir_all(&dir).unwrap();
    let copy = dir.join(file);
    std::fs::copy(common::plugin("two_tier_cost_fn"), &copy).unwrap();
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let hash = loader::sha256_hex(&std::fs::File::open(&copy).unwrap()).unwrap();
    (guard, copy, hash)
}

fn with_sha(sha256: &str) -> Verify<'_> {
    Verify {
        sha256: Some(sha256),
        allow_insecure_permissions: false,
    }
}

/// Overwrite `path` in place (same inode: truncate and write, no rename) with `bytes`.
fn rewrite_in_place(path: &Path, bytes: &[u8]) {
    let ino = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(path).unwrap());
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)
        .unwrap();
    f.write_all(bytes).unwrap();
    f.sync_all().unwrap();
    let after = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(path).unwrap());
    assert_eq!(ino, after, "the rewrite must keep the inode");
}

/// The lines of /proc/self/maps whose path contains `needle`.
fn mappings(needle: &str) -> Vec<String> {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains(needle))
        .map(str::to_string)
        .collect()
}

/// The two-tier plugin's name, as loaded from the shared build output.
fn two_tier_name() -> String {
    let path = common::plugin("two_tier_cost_fn");
    let verify = Verify {
        sha256: None,
        allow_insecure_permissions: true,
    };
    loader::open_library(&path, verify).unwrap().plugin_name
}

#[test]
fn a_configured_sha256_maps_the_sealed_copy_not_the_file() {
    let (_dir, path, hash) = private_copy("sealed-maps", "libsealed_maps.so");
    let library = loader::open_library(&path, with_sha(&hash)).unwrap();
    assert_eq!(library.plugin_name, two_tier_name());
    assert_eq!(
        library.path, path,
        "the library is known by its configured path"
    );
    let sealed = mappings("/memfd:libsealed_maps.so");
    assert!(
        sealed.iter().any(|l| l.contains("r-xp")),
        "the plugin's code is mapped from the sealed copy: {sealed:?}"
    );
    let on_disk = mappings(path.to_str().unwrap());
    assert!(
        on_disk.is_empty(),
        "the file itself is not mapped: {on_disk:?}"
    );
}

#[test]
fn rewriting_the_file_between_the_hash_and_the_map_does_not_change_what_is_loaded() {
    let (_dir, path, hash) = private_copy("sealed-race", "libsealed_race.so");
    let prepared = loader::prepare(&path, with_sha(&hash)).unwrap();
    assert!(prepared.is_sealed());

    // The sealed copy refuses writes, even through a fresh writable open of it.
    let fd_path = format!("/proc/self/fd/{}", prepared.mapped_fd());
    let mut copy = std::fs::OpenOptions::new()
        .write(true)
        .open(&fd_path)
        .unwrap();
    let err = copy.write_all(b"\x7fELF-tampered").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
    drop(copy);

    // After the check, the file becomes another plugin (rewritten in place: same inode).
    rewrite_in_place(
        &path,
        &std::fs::read(common::plugin("fixture_probe")).unwrap(),
    );
    let now = loader::sha256_hex(&std::fs::File::open(&path).unwrap()).unwrap();
    assert_ne!(now, hash);

    let library = loader::map_prepared(prepared).unwrap();
    assert_eq!(
        library.plugin_name,
        two_tier_name(),
        "the checked bytes were loaded"
    );
    assert!(
        library
            .types
            .iter()
            .any(|t| t.name == "dynamo-two-tier-cost-fn"),
        "{:?}",
        library.types
    );
    assert!(!mappings("/memfd:libsealed_race.so").is_empty());
}

#[test]
fn zeroing_the_file_after_loading_it_with_a_sha256_leaves_the_running_code_intact() {
    let (_dir, path, hash) = private_copy("sealed-zero", "libsealed_zero.so");
    let yaml = format!(
        "plugins:\n  - path: {}\n    sha256: \"{hash}\"\nworker_selection:\n  aggregated: t\n  instances:\n    - {{name: t, type: dynamo-two-tier-cost-fn}}\n",
        path.display()
    );
    let config = RouterConfig::from_yaml_str(&yaml, None).unwrap();
    let router = PolicySet::from_config(&config, &SearchPath::default()).unwrap();
    // Had the file been mapped, its code pages would now read as zeros (and the pick would crash).
    let len = std::fs::metadata(&path).unwrap().len() as usize;
    rewrite_in_place(&path, &vec![0u8; len]);
    let cluster = Cluster::new(vec![Worker::new(9), Worker::new(7)]).unwrap();
    let request = Request {
        isl_tokens: 64,
        ..Default::default()
    };
    for _ in 0..3 {
        let d = router
            .select(
                &cluster,
                Selection::of(&request),
                &NoSignals,
                &mut Scratch::default(),
            )
            .unwrap();
        assert_eq!(d.fallback, None, "{d:?}");
    }
}

#[test]
fn a_file_listed_again_is_checked_against_the_bytes_that_were_mapped() {
    let (_dir, path, hash) = private_copy("sealed-twice", "libsealed_twice.so");
    let mut loader = Loader::new();
    let first = loader.load(&path, with_sha(&hash)).unwrap();
    rewrite_in_place(
        &path,
        &std::fs::read(common::plugin("fixture_probe")).unwrap(),
    );
    let now = loader::sha256_hex(&std::fs::File::open(&path).unwrap()).unwrap();
    // The hash of what runs still matches; the hash of what the file holds now does not.
    assert_eq!(loader.load(&path, with_sha(&hash)).unwrap(), first);
    let err = loader.load(&path, with_sha(&now)).unwrap_err();
    assert!(matches!(err, LoadError::HashMismatch { .. }), "{err}");
    assert_eq!(
        err.to_string(),
        format!(
            "plugin file {}: sha256 mismatch: configured {now}, file has {hash}; refusing to load it",
            path.display()
        )
    );
}

#[test]
fn a_wrong_sha256_is_refused_with_the_same_message_as_before() {
    let (_dir, path, actual) = private_copy("sealed-wrong", "libsealed_wrong.so");
    let wrong = "0".repeat(64);
    for err in [
        loader::open_library(&path, with_sha(&wrong)).unwrap_err(),
        loader::prepare(&path, with_sha(&wrong)).unwrap_err(),
        Loader::new().load(&path, with_sha(&wrong)).unwrap_err(),
    ] {
        assert!(matches!(err, LoadError::HashMismatch { .. }), "{err}");
        assert_eq!(
            err.to_string(),
            format!(
                "plugin file {}: sha256 mismatch: configured {wrong}, file has {actual}; refusing to load it",
                path.display()
            )
        );
    }
    // Nothing was mapped for a refused file.
    assert!(mappings("/memfd:libsealed_wrong.so").is_empty());
    assert!(mappings("libsealed_wrong.so").is_empty());
}

#[test]
fn without_a_sha256_the_file_itself_is_mapped_as_before() {
    let (_dir, path, _) = private_copy("unsealed", "libunsealed.so");
    let verify = Verify::default();
    let prepared = loader::prepare(&path, verify).unwrap();
    assert!(!prepared.is_sealed());
    loader::map_prepared(prepared).unwrap();
    assert!(mappings("/memfd:libunsealed.so").is_empty());
    assert!(!mappings(path.to_str().unwrap()).is_empty());
}
