//! `workers:` and `serve:` through the CLI: `check` reports their errors like any other key's,
//! and `serve` refuses a config without workers.

mod common;

use common::{run_cli, temp_dir, write};

#[test]
fn check_reports_serve_and_workers_errors_with_file_line_and_key() {
    let dir = temp_dir("serve_config_check");
    let ok = write(
        &dir,
        "ok.yaml",
        "workers:\n  - {id: 1, url: http://127.0.0.1:8101}\nserve:\n  listen: 127.0.0.1:0\n",
    );
    let (code, out, err) = run_cli(&["check", "--config", ok.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(": OK"));
    let bad = write(
        &dir,
        "bad.yaml",
        "workers:\n  - id: 1\n    url: http://127.0.0.1:8101\nserve:\n  decision_headers: maybe\n",
    );
    let (code, _, err) = run_cli(&["check", "--config", bad.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        err.contains("bad.yaml: line 5 column 21: serve.decision_headers: invalid type"),
        "{err}"
    );
}

#[test]
fn serve_needs_workers() {
    let dir = temp_dir("serve_config_no_workers");
    let config = write(&dir, "router.yaml", "block_size: 16\n");
    let (code, _, err) = run_cli(&["serve", "--config", config.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        err.contains("router.yaml: workers: `serve` needs at least one engine in `workers:`"),
        "{err}"
    );
}
