//! The permission check before `dlopen` walks the whole path of a plugin file, the way OpenSSH's
//! StrictModes does: every directory from `/` down, for the path as given, each symlink on it and
//! the resolved target, must not be writable by group or others unless sticky, and every entry
//! must belong to the running user or root.
//!
//! Each test works under its own 0755 directory in the system temp directory (`/tmp`, 1777 root,
//! which the sticky rule accepts).

mod common;

use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};

use router_host::config::RouterConfig;
use router_host::loader::SearchPath;
use router_host::policy_set::{PolicySet, StartupError};

fn chain(err: &StartupError) -> String {
    let mut text = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

/// A fresh 0755 directory for `test`, removed when the guard is dropped.
fn base(test: &str) -> common::TempDir {
    let dir = common::temp_dir(&format!("loader-paths-{test}"));
    chmod(&dir, 0o755);
    dir
}

/// `dir/name` (created 0755 unless it exists), with `mode` set.
fn subdir(dir: &Path, name: &str, mode: u32) -> PathBuf {
    let path = dir.join(name);
    std::fs::create_dir_all(&path).expect("mkdir");
    chmod(&path, mode);
    path
}

/// A 0644 copy of the probe plugin in `dir`.
fn plugin_in(dir: &Path) -> PathBuf {
    let copy = dir.join("libfixture_probe.so");
    std::fs::copy(common::plugin("fixture_probe"), &copy).expect("copy plugin");
    chmod(&copy, 0o644);
    copy
}

fn load(path: &Path, allow_insecure: bool) -> Result<PolicySet, String> {
    let mut yaml = format!("plugins:\n  - path: {}\n", path.display());
    if allow_insecure {
        yaml.push_str("    allow_insecure_permissions: true\n");
    }
    let config = RouterConfig::from_yaml_str(&yaml, None).map_err(|e| e.to_string())?;
    PolicySet::from_config(&config, &SearchPath::default()).map_err(|e| chain(&e))
}

fn assert_contains(text: &str, fragments: &[&str]) {
    for fragment in fragments {
        assert!(text.contains(fragment), "lacks {fragment:?}:\n{text}");
    }
}

fn root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn a_symlink_in_a_world_writable_directory_is_refused() {
    let base = base("symlink-dir");
    let target = plugin_in(&subdir(&base, "private", 0o755));
    let shared = subdir(&base, "shared", 0o777);
    let link = shared.join("libprobe.so");
    // Relative, so the walk resolves it against the symlink's own directory.
    symlink("../private/libfixture_probe.so", &link).expect("symlink");
    assert!(load(&target, false).is_ok(), "the target itself is fine");
    let err = load(&link, false).unwrap_err();
    assert_contains(
        &err,
        &[
            &format!("plugin file {}: refusing to load: ", link.display()),
            &format!(
                "the directory ({}) holding the symlink {} is writable by group or others \
                 (mode 777) and owned by uid",
                shared.display(),
                link.display()
            ),
            &format!("fix: `chmod go-w {}`", shared.display()),
            "or set `allow_insecure_permissions: true` on this plugin",
        ],
    );
    assert!(load(&link, true).is_ok());
}

#[test]
fn a_world_writable_ancestor_directory_is_refused() {
    let base = base("ancestor");
    let open = subdir(&base, "open", 0o777);
    let file = plugin_in(&subdir(&open, "plugins", 0o755));
    let err = load(&file, false).unwrap_err();
    assert_contains(
        &err,
        &[
            &format!("plugin file {}: refusing to load: ", file.display()),
            &format!(
                "the directory {} on the way to it is writable by group or others (mode 777)",
                open.display()
            ),
        ],
    );
    assert!(load(&file, true).is_ok());
    // Group-writable is refused the same way.
    chmod(&open, 0o775);
    assert_contains(&load(&file, false).unwrap_err(), &["(mode 775)"]);
    // A sticky shared directory is accepted (like /tmp, which every test here goes through).
    chmod(&open, 0o1777);
    assert!(load(&file, false).is_ok());
}

#[test]
fn the_target_of_a_symlink_is_checked_up_to_the_root() {
    let base = base("target");
    let open = subdir(&base, "open", 0o777);
    let target = plugin_in(&subdir(&open, "deep", 0o755));
    let safe = subdir(&base, "safe", 0o755);
    let link = safe.join("libprobe.so");
    symlink(&target, &link).expect("symlink");
    let err = load(&link, false).unwrap_err();
    assert_contains(
        &err,
        &[
            &format!("plugin file {}: refusing to load: ", link.display()),
            &format!(
                "the directory {} on the way to it is writable by group or others (mode 777)",
                open.display()
            ),
        ],
    );
    // A chain of symlinks, through a world-writable directory half-way.
    let hop = subdir(&base, "hop", 0o777);
    chmod(&open, 0o755);
    symlink(&target, hop.join("next.so")).expect("symlink");
    let first = safe.join("first.so");
    symlink(hop.join("next.so"), &first).expect("symlink");
    assert!(load(&link, false).is_ok());
    assert_contains(
        &load(&first, false).unwrap_err(),
        &[&format!(
            "the directory ({}) holding the symlink",
            hop.display()
        )],
    );
}

#[test]
fn entries_owned_by_another_user_are_refused_even_in_a_sticky_directory() {
    let base = base("owners");
    let sticky = subdir(&base, "sticky", 0o1777);
    let target = plugin_in(&subdir(&base, "private", 0o755));
    let link = sticky.join("libprobe.so");
    symlink(&target, &link).expect("symlink");
    assert!(load(&link, false).is_ok());
    if !root() {
        // Only root can give files away.
        return;
    }
    // In a sticky directory the owner of an entry can still replace it.
    std::os::unix::fs::lchown(&link, Some(4242), None).expect("lchown");
    assert_contains(
        &load(&link, false).unwrap_err(),
        &[&format!(
            "the symlink ({}) is owned by uid 4242, not by the running user (uid 0) or root",
            link.display()
        )],
    );
    assert!(load(&link, true).is_ok());
    // A directory on the way owned by someone else.
    let theirs = subdir(&base, "theirs", 0o755);
    let file = plugin_in(&subdir(&theirs, "plugins", 0o755));
    std::os::unix::fs::chown(&theirs, Some(4242), None).expect("chown");
    assert_contains(
        &load(&file, false).unwrap_err(),
        &[&format!(
            "the directory {} on the way to it is owned by uid 4242, not by the running user \
                 (uid 0) or root (mode 755); fix: `chown 0 {}`",
            theirs.display(),
            theirs.display()
        )],
    );
}

#[test]
fn describe_walks_the_path_too_and_the_flag_skips_it() {
    let base = base("describe");
    let target = plugin_in(&subdir(&base, "private", 0o755));
    let shared = subdir(&base, "shared", 0o777);
    let link = shared.join("libprobe.so");
    symlink(&target, &link).expect("symlink");
    let link_arg = link.to_str().expect("utf-8 temp path");
    let (code, out, err) = common::run_cli(&["describe", link_arg]);
    assert_eq!(code, 1, "{out}{err}");
    assert_contains(
        &err,
        &[
            "refusing to load: the directory",
            "holding the symlink",
            "(mode 777)",
            "`--allow-insecure-permissions` for `router-host describe`",
        ],
    );
    let (code, out, err) = common::run_cli(&["describe", "--allow-insecure-permissions", link_arg]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("probe"), "{out}");
}
