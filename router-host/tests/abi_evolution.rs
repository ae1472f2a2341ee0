//! ABI evolution, proven with real builds: a plugin compiled against the frozen plugin-api 1.0.0
//! loads into this (1.2) host; builds with a changed layout under the same version, with another
//! API major, or with `panic = "abort"` are refused with a one-line reason.
//!
//! Each variant is the same plugin source (`tests/fixtures/versioned-plugin/lib.rs`) built in a
//! generated single-crate workspace under `target/abi-fixtures/`, against a chosen copy of
//! plugin-api. The first run compiles abi_stable once more for that target directory.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use router_host::config::RouterConfig;
use router_host::host::{Host, NoOverlap, Submitted};
use router_host::kv_index::KvEventKind;
use router_host::loader::{open_library, LoadError, SearchPath, Verify};
use router_host::model::{Cluster, Request, RowId, Worker};
use router_host::policy_set::PolicySet;

const MANIFEST_DIR: &str = env!("CARGO_MANIFEST_DIR");

fn fixtures_dir() -> PathBuf {
    Path::new(MANIFEST_DIR).join("tests/fixtures")
}

fn abi_root() -> PathBuf {
    common::profile_dir()
        .parent()
        .expect("target dir")
        .join("abi-fixtures")
}

/// Which plugin-api a variant is compiled against.
enum Api {
    /// `tests/fixtures/plugin-api-1.0.0`, as released.
    Frozen,
    /// The frozen copy with textual edits `(file, from, to)`, each of which must apply.
    Patched(&'static [(&'static str, &'static str, &'static str)]),
    /// This workspace's plugin-api.
    Current,
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// Build the versioned plugin as `libfixture_<variant>.so` and return its path.
fn build(variant: &str, api: Api, panic_abort: bool) -> PathBuf {
    // Builds share one target directory; cargo's own lock would serialise them anyway.
    static BUILDING: Mutex<()> = Mutex::new(());
    let _guard = BUILDING.lock().unwrap_or_else(|e| e.into_inner());
    let root = abi_root();
    let work = root.join("work").join(variant);
    // The frozen 1.0.0 copy is the package `plugin-api`; this workspace's is `kvroute-plugin-api`.
    let package = if matches!(api, Api::Current) {
        "kvroute-plugin-api"
    } else {
        "plugin-api"
    };
    let api_dir = match api {
        Api::Frozen => fixtures_dir().join("plugin-api-1.0.0"),
        Api::Current => Path::new(MANIFEST_DIR).join("../plugin-api"),
        Api::Patched(edits) => {
            let dir = root.join("work").join(format!("plugin-api-{variant}"));
            let _ = std::fs::remove_dir_all(&dir);
            copy_dir(&fixtures_dir().join("plugin-api-1.0.0"), &dir);
            for (file, from, to) in edits {
                let path = dir.join(file);
                let text = std::fs::read_to_string(&path).unwrap();
                assert!(
                    text.contains(from),
                    "patch for {variant}: `{from}` not in {file}"
                );
                std::fs::write(&path, text.replacen(from, to, 1)).unwrap();
            }
            dir
        }
    };
    std::fs::create_dir_all(&work).unwrap();
    let lib = format!("fixture_{variant}");
    std::fs::write(
        work.join("Cargo.toml"),
        format!(
            "[package]\nname = \"fixture-{variant}\"\nversion = \"0.1.0\"\nedition = \"2021\"\npublish = false\n\n\
             [lib]\nname = \"{lib}\"\ncrate-type = [\"cdylib\"]\npath = \"{}\"\n\n\
             [dependencies]\nplugin-api = {{ package = \"{package}\", path = \"{}\" }}\n\n[workspace]\n",
            fixtures_dir().join("versioned-plugin/lib.rs").display(),
            api_dir.display()
        ),
    )
    .unwrap();
    // Same dependency versions as the host: start from the workspace's lock file.
    std::fs::copy(
        Path::new(MANIFEST_DIR).join("../Cargo.lock"),
        work.join("Cargo.lock"),
    )
    .unwrap();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    if panic_abort {
        cmd.args(["rustc", "--lib", "--quiet"]);
    } else {
        cmd.args(["build", "--quiet"]);
    }
    cmd.arg("--manifest-path").arg(work.join("Cargo.toml"));
    if panic_abort {
        cmd.args(["--", "-C", "panic=abort"]);
    }
    let status = cmd
        .env("CARGO_TARGET_DIR", root.join("target"))
        .env_remove("RUSTFLAGS")
        .status()
        .expect("run cargo");
    assert!(
        status.success(),
        "building fixture variant {variant} failed"
    );
    root.join("target/debug").join(format!("lib{lib}.so"))
}

fn load(path: &Path) -> Result<router_host::loader::PolicyLibrary, LoadError> {
    open_library(path, Verify::default())
}

#[test]
fn a_plugin_built_against_plugin_api_1_0_loads_and_routes_in_this_host() {
    let path = build("v1_0", Api::Frozen, false);
    let library = load(&path).unwrap_or_else(|e| panic!("1.0 plugin refused: {e}"));
    assert_eq!(library.api_version, "1.0.0");
    assert_eq!(plugin_api::API_VERSION, "1.5.0", "this host is 1.5");

    // Route through the full lifecycle: the 1.1 hooks are simply absent from the 1.0 vtable,
    // and the 1.2 `kv_capacity_blocks` column (worker 1's capacity is known) is an extra column
    // it never looks at.
    let yaml = format!(
        "plugins: [{{path: {}}}]\nworker_selection:\n  aggregated: old\n  instances:\n    - {{name: old, type: versioned-least-loaded}}\n",
        path.display()
    );
    let config = RouterConfig::from_yaml_str(&yaml, None).unwrap();
    let router = PolicySet::from_config(&config, &SearchPath::default()).unwrap();
    let mut sized = Worker::new(1);
    sized.total_kv_blocks = Some(4);
    let cluster = Cluster::new(vec![sized, Worker::new(2)]).unwrap();
    let host = Host::new(router, cluster, &config);
    let request = Request {
        isl_tokens: 32,
        session_id: Some("s".into()),
        ..Default::default()
    };
    let first = host.route(&request, &NoOverlap, true).unwrap();
    let second = host.route(&request, &NoOverlap, true).unwrap();
    assert_eq!(first.decision.row.worker_id, 1);
    assert_eq!(
        second.decision.row.worker_id, 2,
        "least loaded after booking the first"
    );
    assert_eq!(
        second.decision.explanation.unwrap().reason,
        "versioned_least_loaded"
    );
    assert!(host.complete(first.id) && host.complete(second.id));
    assert_eq!(host.in_flight(), 0);

    // Through the core's KV index the 1.3 `kv_indexed_*_blocks` columns come too, the 1.5
    // `kv_recent_device_blocks` (the default recent window is on), and with a row whose index is stale the 1.4 `kv_index_state` column:
    // still extra columns it never looks at.
    host.core().set_kv_index_state(
        RowId {
            worker_id: 2,
            dp_rank: 0,
        },
        plugin_api::KvIndexState::Stale,
    );
    host.core().apply_kv_batch((0..3).map(|b| {
        (
            RowId {
                worker_id: 2,
                dp_rank: 0,
            },
            KvEventKind::Stored,
            b,
        )
    }));
    let indexed = Request {
        isl_tokens: 32,
        blocks: vec![0, 1],
        ..Default::default()
    };
    match host.core().submit_indexed(indexed, true) {
        Ok(Submitted::Dispatched(routed)) => {
            assert_eq!(
                routed.decision.explanation.map(|e| e.reason),
                Some("versioned_least_loaded".to_string())
            );
            assert!(host.complete(routed.id));
        }
        other => panic!("the 1.0 plugin did not route with the 1.3 columns: {other:?}"),
    }
    assert_eq!(host.in_flight(), 0);
}

#[test]
fn same_version_with_a_changed_layout_is_refused() {
    let path = build(
        "layout",
        Api::Patched(&[(
            "src/abi.rs",
            "pub struct LogLevel(pub u8);",
            "pub struct LogLevel(pub u16);",
        )]),
        false,
    );
    let err = load(&path).expect_err("refused");
    let text = err.to_string();
    assert!(matches!(err, LoadError::LayoutMismatch { .. }), "{text}");
    assert!(
        text.contains("its plugin-api types do not match this host's"),
        "{text}"
    );
    assert!(
        text.contains("plugin built against plugin-api 1.0.0, host has 1.5.0"),
        "{text}"
    );
    assert!(
        text.contains("mismatched type: host has u8, plugin has u16"),
        "{text}"
    );
    assert!(!text.contains('\n'), "one line for operators: {text}");
}

#[test]
fn a_plugin_built_for_another_api_major_is_refused_with_both_versions() {
    let path = build(
        "major2",
        Api::Patched(&[("Cargo.toml", "version = \"1.0.0\"", "version = \"2.0.0\"")]),
        false,
    );
    let text = load(&path).expect_err("refused").to_string();
    assert!(
        text.ends_with("built for plugin-api 2.0.0, host supports 1.x"),
        "{text}"
    );
}

#[test]
fn a_panic_abort_build_is_refused_at_load() {
    let path = build("abort", Api::Current, true);
    let text = load(&path).expect_err("refused").to_string();
    assert!(
        text.contains("plugin `versioned-plugin` was built with panic = \"abort\""),
        "{text}"
    );
}

#[test]
fn a_plugin_built_against_1_1_gets_its_dispatch_and_completion_hooks() {
    let yaml = format!(
        "plugins: [{{path: {}}}]\nworker_selection:\n  aggregated: p\n  instances:\n    - {{name: p, type: probe}}\n",
        common::plugin("fixture_probe").display()
    );
    let config = RouterConfig::from_yaml_str(&yaml, None).unwrap();
    let router = PolicySet::from_config(&config, &SearchPath::default()).unwrap();
    let cluster = Cluster::new(vec![Worker::new(1), Worker::new(2)]).unwrap();
    let host = Host::new(router, cluster, &config);
    let request = |session: &str| Request {
        isl_tokens: 32,
        session_id: Some(session.into()),
        ..Default::default()
    };
    let a = host.route(&request("a"), &NoOverlap, false).unwrap();
    let b = host.route(&request("b"), &NoOverlap, false).unwrap();
    host.complete(a.id);
    host.finish(b.id, plugin_api::abi::CompletionCode::CANCELLED);
    let report = host.route(&request("c"), &NoOverlap, true).unwrap();
    let e = report.decision.explanation.unwrap();
    // The probe explains before this request's own dispatch is reported.
    assert_eq!(
        (e.get("dispatched"), e.get("completed")),
        (Some(2.0), Some(2.0))
    );
    assert_eq!(
        e.get_label("last_event"),
        Some(format!("complete {} 1:0 session=b cancelled", b.id).as_str())
    );
}
