//! The CLI against hostile or unusual surroundings: huge trace lines, out-of-range flags, a closed
//! stdout, and output files that must never be seen half-written.

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use common::child::{run_within, Run};
use common::{router_host_bin, run_cli, temp_dir, write};
use router_host::replay::trace::MAX_TRACE_LINE_BYTES;

/// Longest any one child may run; a hang fails the test instead of blocking it.
const DEADLINE: Duration = Duration::from_secs(60);

/// Run `program args` with stdout and stderr sent to files in `dir` (and stdout replaced by
/// `stdout` when given); kill it and fail the test if it outlives [`DEADLINE`].
fn run_bounded(dir: &Path, program: &Path, args: &[&str], stdout: Option<Stdio>) -> Run {
    run_within(dir, program, args, stdout, DEADLINE)
}

/// A stdout whose reader is gone before the child starts: every write gets `EPIPE`.
fn closed_pipe() -> Stdio {
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    Stdio::from(writer)
}

fn round_robin(dir: &Path) -> PathBuf {
    write(
        dir,
        "rr.yaml",
        "worker_selection:\n  aggregated: rr\n  instances:\n    - {name: rr, type: round-robin}\n",
    )
}

const GOOD_LINE: &str =
    "{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [1]}\n";

#[test]
fn a_trace_line_longer_than_the_cap_is_refused_naming_file_line_and_limit() {
    let dir = temp_dir("hardening-long-line");
    // Two good lines, then 2 MiB without a newline.
    let mut text = GOOD_LINE.repeat(2);
    text.push_str(&"x".repeat(2 << 20));
    let trace = write(&dir, "long.jsonl", &text);
    let run = run_bounded(
        &dir,
        &router_host_bin(),
        &["replay", "--trace", trace.to_str().unwrap()],
        None,
    );
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    assert!(
        run.stderr.contains("long.jsonl: line 3: "),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr.contains(&MAX_TRACE_LINE_BYTES.to_string()),
        "{}",
        run.stderr
    );
    assert!(run.stdout.is_empty(), "{}", run.stdout);

    // A line of exactly the limit is read (and then judged as JSON).
    let mut text = GOOD_LINE.to_string();
    text.push_str(&" ".repeat(MAX_TRACE_LINE_BYTES - GOOD_LINE.len() + 1));
    text.push('\n');
    text.push_str(GOOD_LINE);
    let at_limit = write(&dir, "at-limit.jsonl", &text);
    let w = router_host::replay::Workload::from_jsonl_file(&at_limit, 512);
    assert_eq!(w.map(|w| w.requests.len()), Ok(2));
}

#[test]
fn dev_zero_as_a_trace_fails_fast_instead_of_filling_memory() {
    let dir = temp_dir("hardening-dev-zero");
    // The address-space limit turns the old unbounded growth into a quick failure of the test
    // rather than pressure on the machine.
    let bin = router_host_bin();
    let run = run_bounded(
        &dir,
        Path::new("/bin/sh"),
        &[
            "-c",
            "ulimit -v 4194304 && exec \"$0\" replay --trace /dev/zero",
            bin.to_str().unwrap(),
        ],
        None,
    );
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    // A device is not read at all (the line cap keeps a regular file without newlines bounded:
    // a_trace_line_longer_than_the_cap_is_refused_naming_file_line_and_limit).
    assert_eq!(
        run.stderr,
        "error: trace /dev/zero: not a regular file (a character device); give the JSONL file \
         itself\n"
    );
}

#[test]
fn time_scale_out_of_range_is_refused_naming_flag_value_and_range() {
    let dir = temp_dir("hardening-time-scale");
    let rr = round_robin(&dir);
    let rr = rr.to_str().unwrap();
    let (code, out, err) = run_cli(&[
        "replay",
        "-c",
        rr,
        "--sessions",
        "5",
        "--time-scale",
        "1e300",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(out.is_empty(), "{out}");
    assert!(err.contains("--time-scale: 1e300 "), "{err}");
    assert!(err.contains("1e12 ms"), "{err}");
    assert!(err.contains("valid range"), "{err}");

    for bad in ["nan", "inf", "-inf", "0", "-1"] {
        let (code, out, err) = run_cli(&[
            "replay",
            "-c",
            rr,
            "--sessions",
            "5",
            &format!("--time-scale={bad}"),
        ]);
        assert_eq!(code, 1, "{bad}: {err}");
        assert!(out.is_empty(), "{bad}: {out}");
        assert!(err.contains("--time-scale"), "{bad}: {err}");
        assert!(err.contains("finite number > 0"), "{bad}: {err}");
    }

    // A factor in range scales the arrivals.
    let plain = dir.join("plain.jsonl");
    let scaled = dir.join("scaled.jsonl");
    for (path, scale) in [(&plain, "1"), (&scaled, "1000")] {
        let (code, _, err) = run_cli(&[
            "replay",
            "-c",
            rr,
            "--sessions",
            "5",
            "--time-scale",
            scale,
            "--write-workload",
            path.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{err}");
    }
    let duration = |p: &Path| {
        router_host::replay::Workload::from_jsonl_file(p, 512)
            .unwrap()
            .stats()
            .duration_s
    };
    let (a, b) = (duration(&plain), duration(&scaled));
    assert!(a > 0.0 && (b / a - 1000.0).abs() < 1e-3, "{a} {b}");
}

#[test]
fn replay_with_a_closed_stdout_still_writes_every_file_and_exits_0() {
    let dir = temp_dir("hardening-replay-pipe");
    let rr = round_robin(&dir);
    let json = dir.join("r.json");
    let svg = dir.join("r.svg");
    let jsonl = dir.join("w.jsonl");
    let run = run_bounded(
        &dir,
        &router_host_bin(),
        &[
            "replay",
            "-c",
            rr.to_str().unwrap(),
            "--sessions",
            "5",
            "--json",
            json.to_str().unwrap(),
            "--plot",
            svg.to_str().unwrap(),
            "--write-workload",
            jsonl.to_str().unwrap(),
        ],
        Some(closed_pipe()),
    );
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
    assert!(!run.stderr.contains("error"), "{}", run.stderr);
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(report["workload"]["requests"].as_u64().unwrap() > 0);
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.trim_end().ends_with("</svg>"));
    assert!(router_host::replay::Workload::from_jsonl_file(&jsonl, 512).is_ok());
}

#[test]
fn select_with_a_closed_stdout_keeps_its_exit_code() {
    let dir = temp_dir("hardening-select-pipe");
    let rr = round_robin(&dir);
    let failing = write(
        &dir,
        "failing.json",
        r#"{"workers": [{"worker_id": 1}, {"worker_id": 2, "overloaded": true}],
            "requests": [{"isl_tokens": 16},
                         {"isl_tokens": 16, "pinned_worker": {"worker_id": 2}}]}"#,
    );
    let passing = write(
        &dir,
        "passing.json",
        r#"{"workers": [{"worker_id": 1}], "requests": [{"isl_tokens": 16}, {"isl_tokens": 16}]}"#,
    );
    for (scenario, expected) in [(&failing, 1), (&passing, 0)] {
        let args = [
            "select",
            "--config",
            rr.to_str().unwrap(),
            "--scenario",
            scenario.to_str().unwrap(),
        ];
        // The same exit code as with a reader...
        let (code, out, err) = run_cli(&args);
        assert_eq!(code, expected, "{err}");
        assert_eq!(out.lines().count(), 2, "{out}");
        // ...and without one, quietly.
        let run = run_bounded(&dir, &router_host_bin(), &args, Some(closed_pipe()));
        assert_eq!(run.code, Some(expected), "{}", run.stderr);
        assert!(run.stderr.is_empty(), "{}", run.stderr);
    }
    // `check` exits 0, quietly, too.
    let run = run_bounded(
        &dir,
        &router_host_bin(),
        &["check", "--config", rr.to_str().unwrap()],
        Some(closed_pipe()),
    );
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert!(run.stderr.is_empty(), "{}", run.stderr);
}

#[test]
fn output_files_are_replaced_whole_and_leave_no_temporary_file() {
    let dir = temp_dir("hardening-atomic");
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let rr = round_robin(&dir);
    let json = out.join("r.json");
    let svg = out.join("r.svg");
    let jsonl = out.join("w.jsonl");
    // Earlier results, each with a second name: a reader holding the old file must keep seeing
    // the old, complete content, never a truncated or half-written one.
    let kept = dir.join("kept");
    std::fs::create_dir_all(&kept).unwrap();
    for path in [&json, &svg, &jsonl] {
        std::fs::write(path, "old\n").unwrap();
        std::fs::hard_link(path, kept.join(path.file_name().unwrap())).unwrap();
    }
    let (code, _, err) = run_cli(&[
        "replay",
        "-c",
        rr.to_str().unwrap(),
        "--sessions",
        "5",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
        "--write-workload",
        jsonl.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    for path in [&json, &svg, &jsonl] {
        let name = path.file_name().unwrap();
        let kept_text = std::fs::read_to_string(kept.join(name)).unwrap();
        assert!(kept_text == "old\n", "{name:?} was overwritten in place");
    }
    let mut names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["r.json", "r.svg", "w.jsonl"]);
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let requests = report["workload"]["requests"].as_u64().unwrap();
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg") && text.trim_end().ends_with("</svg>"));
    let workload = router_host::replay::Workload::from_jsonl_file(&jsonl, 512).unwrap();
    assert_eq!(workload.requests.len() as u64, requests);

    // A target that is not a regular file is written in place, not replaced.
    let (code, _, err) = run_cli(&[
        "replay",
        "-c",
        rr.to_str().unwrap(),
        "--sessions",
        "5",
        "--json",
        "/dev/null",
    ]);
    assert_eq!(code, 0, "{err}");
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata("/dev/null")
        .unwrap()
        .file_type()
        .is_char_device());
}

#[test]
fn a_directory_as_a_scenario_is_named_as_one_once() {
    let dir = temp_dir("scenario-dir");
    let config = round_robin(&dir);
    let run = run_bounded(
        &dir,
        &router_host_bin(),
        &[
            "select",
            "--config",
            config.to_str().unwrap(),
            "--scenario",
            dir.to_str().unwrap(),
        ],
        None,
    );
    assert_eq!(run.code, Some(2), "unusable input: {}", run.stderr);
    assert_eq!(
        run.stderr,
        format!(
            "error: scenario {}: not a regular file (a directory); give the JSON file itself\n",
            dir.display()
        )
    );
}

#[test]
fn a_misspelled_plugin_stops_serve_with_each_context_said_once() {
    let dir = temp_dir("misspelled-plugin");
    let config = write(
        &dir,
        "router.yaml",
        "block_size: 16\nplugins:\n  - name: two_tier_cost_fm\nworkers:\n  - {id: 1, url: \"http://127.0.0.1:9\"}\n",
    );
    let expected = format!(
        "error: config {}: plugins[0] (line 3): plugin `two_tier_cost_fm` not found; tried: {}, {}\n",
        config.display(),
        dir.join("libtwo_tier_cost_fm.so").display(),
        router_host_bin()
            .parent()
            .unwrap()
            .join("libtwo_tier_cost_fm.so")
            .display()
    );
    let config = config.to_str().unwrap();
    let serve = run_bounded(
        &dir,
        &router_host_bin(),
        &["serve", "--config", config, "--listen", "127.0.0.1:0"],
        None,
    );
    assert_eq!(serve.code, Some(1), "{}", serve.stderr);
    assert_eq!(serve.stderr, expected);
    let check = run_bounded(
        &dir,
        &router_host_bin(),
        &["check", "--config", config],
        None,
    );
    assert_eq!(check.code, Some(1), "{}", check.stderr);
    assert_eq!(check.stderr, expected);
}

/// A FIFO at `dir/name` (nobody writes it: opening it for reading would block forever).
fn fifo(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(name);
    let c_path = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path; mkfifo only creates the node.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
    path
}

/// How long a refusal may take, start-up included, on a busy machine: it reads nothing.
const PROMPT: Duration = Duration::from_secs(20);

#[test]
fn a_fifo_nobody_writes_is_refused_at_once_by_every_command_that_reads_a_file() {
    let dir = temp_dir("fifo-inputs");
    let pipe = fifo(&dir, "input");
    let rr = round_robin(&dir);
    let (pipe, rr) = (pipe.to_str().unwrap(), rr.to_str().unwrap());
    let config =
        format!("error: config {pipe}: not a regular file (a FIFO); give the YAML file itself\n");
    let cases: [(&[&str], i32, String); 6] = [
        (&["check", "--config", pipe], 1, config.clone()),
        (
            &["select", "--config", pipe, "--scenario", pipe],
            2,
            config.clone(),
        ),
        (
            &["select", "--config", rr, "--scenario", pipe],
            2,
            format!(
                "error: scenario {pipe}: not a regular file (a FIFO); give the JSON file itself\n"
            ),
        ),
        (
            &["replay", "--trace", pipe],
            1,
            format!(
                "error: trace {pipe}: not a regular file (a FIFO); give the JSONL file itself\n"
            ),
        ),
        (&["replay", "--config", pipe], 1, config.clone()),
        (
            &["serve", "--config", pipe, "--listen", "127.0.0.1:0"],
            1,
            config.clone(),
        ),
    ];
    for (args, code, stderr) in cases {
        let run = run_within(&dir, &router_host_bin(), args, None, PROMPT);
        assert_eq!(run.code, Some(code), "{args:?}: {}", run.stderr);
        assert_eq!(run.stderr, stderr, "{args:?}");
    }
}

#[test]
fn serve_refuses_tokenizer_files_that_are_fifos_or_over_their_limit_without_reading_them() {
    use router_host::serve::tokenize::MAX_TOKENIZER_FILE_BYTES;
    let dir = temp_dir("tokenizer-inputs");
    let tokenizer = dir.join("tok");
    std::fs::create_dir(&tokenizer).unwrap();
    let config = write(
        &dir,
        "router.yaml",
        &format!(
            "serve:\n  tokenizer: {{path: {}}}\nworkers:\n  - {{id: 1, url: \"http://127.0.0.1:9\"}}\n",
            tokenizer.display()
        ),
    );
    let serve = |dir: &Path| {
        run_within(
            dir,
            &router_host_bin(),
            &[
                "serve",
                "--config",
                config.to_str().unwrap(),
                "--listen",
                "127.0.0.1:0",
            ],
            None,
            PROMPT,
        )
    };
    let file = fifo(&tokenizer, "tokenizer.json");
    let run = serve(&dir);
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    assert_eq!(
        run.stderr,
        format!(
            "error: config {}: serve.tokenizer.path: cannot load {}: not a regular file (a FIFO)\n",
            config.display(),
            file.display()
        )
    );
    // Sparse: its size is over the limit, and nothing of it is read.
    std::fs::remove_file(&file).unwrap();
    std::fs::File::create(&file)
        .unwrap()
        .set_len(MAX_TOKENIZER_FILE_BYTES + 1)
        .unwrap();
    let run = serve(&dir);
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    assert_eq!(
        run.stderr,
        format!(
            "error: config {}: serve.tokenizer.path: cannot load {}: larger than {} bytes\n",
            config.display(),
            file.display(),
            MAX_TOKENIZER_FILE_BYTES
        )
    );
}

#[test]
fn a_trace_over_the_file_limit_is_refused_by_its_size_before_any_line_is_read() {
    use router_host::replay::trace::MAX_TRACE_BYTES;
    let dir = temp_dir("trace-limit");
    // Sparse, and its first line is a good one: only the size is wrong.
    let trace = write(&dir, "big.jsonl", GOOD_LINE);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&trace)
        .unwrap()
        .set_len(MAX_TRACE_BYTES + 1)
        .unwrap();
    let run = run_within(
        &dir,
        &router_host_bin(),
        &["replay", "--trace", trace.to_str().unwrap()],
        None,
        PROMPT,
    );
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    assert_eq!(
        run.stderr,
        format!(
            "error: trace {}: larger than {MAX_TRACE_BYTES} bytes (1 GiB), the limit on a trace \
             file\n",
            trace.display()
        )
    );
}
