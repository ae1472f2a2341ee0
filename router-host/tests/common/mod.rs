//! Shared helpers for integration tests that load real plugin `.so` files.
//!
//! `cargo test` leaves cdylibs only under `target/<profile>/deps/`, so the tests build the plugin
//! crates themselves (once per test process) with the same target directory and profile, and load
//! them from `target/<profile>/`.

#![allow(dead_code)]

pub mod child;
pub mod engine;
pub mod epp;
pub mod logs;
pub mod mock;
pub mod venv;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// Every plugin crate the integration tests load.
pub const PLUGIN_PACKAGES: &[&str] = &[
    "two-tier-cost-fn",
    "soft-pin-repin",
    "fixture-probe",
    "fixture-faulty",
    "fixture-duplicate",
    "fixture-not-a-plugin",
];

/// `target/<profile>`, derived from this test executable's location (`target/<profile>/deps/`).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent()
        .and_then(Path::parent)
        .expect("test executable lives in target/<profile>/deps")
        .to_path_buf()
}

/// Build the plugin crates (once per process) and return the directory holding `lib*.so`.
pub fn plugin_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        build_packages(PLUGIN_PACKAGES);
        profile_dir()
    })
}

/// `cargo build` `packages` into this test run's target directory and profile.
pub fn build_packages(packages: &[&str]) {
    let dir = profile_dir();
    let target_dir = dir.parent().expect("target dir").to_path_buf();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let mut cmd = Command::new(cargo);
    cmd.arg("build").arg("--quiet");
    if dir.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    for package in packages {
        cmd.args(["-p", package]);
    }
    cmd.env("CARGO_TARGET_DIR", &target_dir)
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    let status = cmd.status().expect("run cargo build");
    assert!(status.success(), "building {packages:?} failed");
}

/// Path of `lib<name>.so` after [`plugin_dir`] built it.
pub fn plugin(name: &str) -> PathBuf {
    plugin_dir().join(format!("lib{name}.so"))
}

/// The `router-host` binary built for this test run.
pub fn router_host_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_router-host"))
}

/// A scratch directory unique to one test, removed (with everything in it) when the guard is
/// dropped: at the end of the test, and also while a failing test unwinds. Derefs to [`Path`], so
/// `dir.join(..)`, `&dir` and `dir.display()` work as on a path; keep the guard alive for as long
/// as the directory is used (`temp_dir(t).join(..)` alone would remove it at once).
#[must_use = "the directory is removed when the guard is dropped"]
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl std::ops::Deref for TempDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for TempDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::fs::remove_dir_all(&self.0).is_ok() || !self.0.exists() {
            return;
        }
        // A test may have left a directory without write or search permission (the loader's
        // permission tests do): give every directory back its owner's bits, then try again.
        restore_dir_modes(&self.0);
        if let Err(e) = std::fs::remove_dir_all(&self.0) {
            // Never panic in drop (it would abort a test that is already unwinding).
            eprintln!("warning: cannot remove {}: {e}", self.0.display());
        }
    }
}

fn restore_dir_modes(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                restore_dir_modes(&entry.path());
            }
        }
    }
}

/// The prefix of every scratch directory of this test process.
fn temp_prefix() -> String {
    format!("router-host-test-{}-", std::process::id())
}

/// A fresh scratch directory unique to one test, removed when the returned guard is dropped.
///
/// As a safety net for a guard dropped too early (`temp_dir(t).join("sub")`, then creating
/// `sub`), every directory of this process still there when the process exits is removed too.
pub fn temp_dir(test: &str) -> TempDir {
    static SWEEP: std::sync::Once = std::sync::Once::new();
    SWEEP.call_once(|| {
        // SAFETY: registers a plain `extern "C"` function without arguments; it runs once, at
        // normal process exit, after the test harness has finished every test.
        unsafe { libc::atexit(sweep_at_exit) };
    });
    let dir = std::env::temp_dir().join(format!("{}{test}", temp_prefix()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create temp dir");
    TempDir(dir)
}

extern "C" fn sweep_at_exit() {
    // Never unwind out of an `extern "C"` function.
    let _ = std::panic::catch_unwind(|| {
        let prefix = temp_prefix();
        let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
            return;
        };
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().starts_with(&prefix) {
                drop(TempDir(entry.path()));
            }
        }
    });
}

/// Write `text` to `dir/name` and return the path.
pub fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write test file");
    path
}

/// Run `router-host` with `args`; returns (exit code, stdout, stderr).
pub fn run_cli(args: &[&str]) -> (i32, String, String) {
    run_bin_in(&router_host_bin(), args, None)
}

/// Run `bin` with `args` (in `dir`, if given); returns (exit code, stdout, stderr).
pub fn run_bin_in(bin: &Path, args: &[&str], dir: Option<&Path>) -> (i32, String, String) {
    let mut cmd = Command::new(bin);
    cmd.args(args).env_remove("RUST_LOG");
    if let Some(dir) = dir {
        cmd.current_dir(dir);
    }
    // A binary a test has just copied can fail to start with ETXTBSY while another test thread's
    // fork (between fork and exec) still holds the copy's write descriptor: retry, bounded.
    let mut attempts = 0;
    let out = loop {
        match cmd.output() {
            Err(err) if err.raw_os_error() == Some(libc::ETXTBSY) && attempts < 100 => {
                attempts += 1;
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            other => break other.expect("run router-host"),
        }
    };
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
