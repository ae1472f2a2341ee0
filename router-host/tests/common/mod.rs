//! Shared helpers for integration tests that load real plugin `.so` files.
//!
//! `cargo test` leaves cdylibs only under `target/<profile>/deps/`, so the tests build the plugin
//! crates themselves (once per test process) with the same target directory and profile, and load
//! them from `target/<profile>/`.

#![allow(dead_code)]

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
        let dir = profile_dir();
        let target_dir = dir.parent().expect("target dir").to_path_buf();
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
        let mut cmd = Command::new(cargo);
        cmd.arg("build").arg("--quiet");
        if dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        for package in PLUGIN_PACKAGES {
            cmd.args(["-p", package]);
        }
        cmd.env("CARGO_TARGET_DIR", &target_dir)
            .current_dir(env!("CARGO_MANIFEST_DIR"));
        let status = cmd.status().expect("run cargo build for the plugin crates");
        assert!(status.success(), "building the plugin crates failed");
        dir
    })
}

/// Path of `lib<name>.so` after [`plugin_dir`] built it.
pub fn plugin(name: &str) -> PathBuf {
    plugin_dir().join(format!("lib{name}.so"))
}

/// The `router-host` binary built for this test run.
pub fn router_host_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_router-host"))
}

/// A scratch directory unique to one test.
pub fn temp_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("router-host-test-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

/// Write `text` to `dir/name` and return the path.
pub fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write test file");
    path
}

/// Run `router-host` with `args`; returns (exit code, stdout, stderr).
pub fn run_cli(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(router_host_bin())
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("run router-host");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
