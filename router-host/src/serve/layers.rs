//! The layering of serve's modules (the module doc in `mod.rs`), checked on the source: a
//! module below the HTTP front end names only other modules below it, never the front end's
//! modules, serve's root, or axum.

use std::path::{Path, PathBuf};

/// The modules below the front end (directories included).
const NEUTRAL: &[&str] = &[
    "app",
    "coalesce",
    "engine_calls",
    "errors",
    "failure",
    "health",
    "kv_events",
    "lifecycle",
    "metrics",
    "decider",
    "pipeline",
    "prompt",
    "request",
    "scrape",
    "segments",
    "state",
    "stop",
    "test_tokenizers",
    "tokenize",
    "upstream",
    "words",
];

/// The `.rs` files under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `source` without its `//` comments (doc comments name other modules freely).
fn code(source: &str) -> String {
    source
        .lines()
        .map(|line| line.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The names that follow each path into serve's root in a file whose module is `depth` levels
/// below serve (`use super::{a, b::C}` gives `a` and `b`; `crate::serve::x` gives `x`).
fn root_names(code: &str, depth: usize) -> Vec<String> {
    let up = "super::".repeat(depth);
    let mut names = Vec::new();
    for prefix in [up.as_str(), "crate::serve::"] {
        let mut from = 0;
        while let Some(at) = code[from..].find(prefix) {
            let before = code[..from + at].chars().last();
            from += at + prefix.len();
            let rest = &code[from..];
            // `super::super::x` seen from one level up is not a root path at this depth.
            if prefix == up && (before == Some(':') || rest.starts_with("super::")) {
                continue;
            }
            let group = match rest.strip_prefix('{') {
                Some(inner) => &inner[..inner.find('}').unwrap_or(inner.len())],
                None => rest,
            };
            for item in group.split(',') {
                let name: String = item
                    .trim_start()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    names.push(name);
                }
                if !rest.starts_with('{') {
                    break;
                }
            }
        }
    }
    names
}

#[test]
fn modules_below_the_front_end_never_import_it() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/serve");
    let mut checked = 0;
    let mut wrong = Vec::new();
    for module in NEUTRAL {
        let mut files = Vec::new();
        let dir = root.join(module);
        if dir.is_dir() {
            sources(&dir, &mut files);
        } else {
            files.push(root.join(format!("{module}.rs")));
        }
        for file in files {
            let source = std::fs::read_to_string(&file)
                .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            let code = code(&source);
            let relative = file.strip_prefix(&root).expect("under serve");
            // serve/x.rs and serve/x/mod.rs are one level below serve, serve/x/y.rs two.
            let depth = relative.components().count()
                - usize::from(relative.file_name().is_some_and(|n| n == "mod.rs"));
            for name in root_names(&code, depth) {
                if !NEUTRAL.contains(&name.as_str()) && name != "self" {
                    wrong.push(format!("{}: serve::{name}", relative.display()));
                }
            }
            if code.contains("axum::") {
                wrong.push(format!("{}: axum", relative.display()));
            }
            checked += 1;
        }
    }
    assert!(checked > NEUTRAL.len(), "only {checked} files read");
    assert!(wrong.is_empty(), "upward imports: {wrong:#?}");
}

#[test]
fn the_scanner_finds_root_paths_in_groups_and_at_depth() {
    let code = "use super::{app::App, proxy};\nuse super::super::errors::ApiError;\n\
                let x = crate::serve::status::ready;";
    assert_eq!(root_names(code, 1), ["app", "proxy", "status"]);
    assert_eq!(root_names(code, 2), ["errors", "status"]);
}
