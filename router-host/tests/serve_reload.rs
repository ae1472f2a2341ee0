//! `router-host serve`: reloading the configuration without a restart (in process, through the
//! handle SIGHUP uses), and the binary itself under SIGHUP and SIGTERM.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::engine::{client, eventually, header, post, workers_yaml, Engine, TestRouter};
use futures_util::StreamExt;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(10);

fn policy_yaml(instance: &str, policy: &str, engines: &[&Engine]) -> String {
    format!(
        "block_size: 4\nworker_selection:\n  aggregated: {instance}\n  instances:\n    - name: {instance}\n      type: {policy}\n{}",
        workers_yaml(engines)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_swaps_policies_without_dropping_a_request_and_a_broken_one_keeps_serving() {
    let (e1, e2) = (Engine::start(1).await, Engine::start(2).await);
    e1.state.controls.chunks.store(20, Ordering::SeqCst);
    e1.state.controls.chunk_delay_ms.store(20, Ordering::SeqCst);
    let router = TestRouter::start(
        "serve_reload",
        &policy_yaml("spread", "round-robin", &[&e1]),
    )
    .await;
    let http = client();
    let url = router.url("/v1/completions");

    // A stream in flight on the first configuration.
    let response = post(
        &http,
        &url,
        &json!({"model": "tiny", "prompt": "hello", "stream": true}),
    )
    .await;
    assert_eq!(header(&response, "x-router-instance"), "spread");
    assert_eq!(header(&response, "x-router-config"), "1");
    let mut stream = response.bytes_stream();
    let mut received = stream.next().await.unwrap().unwrap().to_vec();

    // New policy, new instance name, a second engine.
    std::fs::write(
        &router.config,
        policy_yaml("cache-first", "default", &[&e1, &e2]),
    )
    .unwrap();
    assert_eq!(router.handle.reload().await.unwrap(), 2);
    let response = post(&http, &url, &json!({"model": "tiny", "prompt": "hello"})).await;
    assert_eq!(response.status(), 200);
    assert_eq!(header(&response, "x-router-instance"), "cache-first");
    assert_eq!(header(&response, "x-router-policy"), "default");
    assert_eq!(header(&response, "x-router-config"), "2");
    let _ = response.bytes().await;

    // The old stream finishes, whole, on the old configuration.
    while let Some(chunk) = stream.next().await {
        received.extend_from_slice(&chunk.unwrap());
    }
    let text = String::from_utf8(received).unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"));
    assert_eq!(text.matches("data: ").count(), 21);
    assert!(eventually(WAIT, || router.handle.in_flight() == 0).await);
    assert_eq!(
        router.metric("router_requests_total{endpoint=\"completions\",outcome=\"completed\"}"),
        2.0
    );

    // A broken file: refused, counted, and the running configuration keeps serving.
    std::fs::write(
        &router.config,
        format!(
            "block_size: 4\nworker_selection:\n  aggregated: nope\n{}",
            workers_yaml(&[&e1])
        ),
    )
    .unwrap();
    let err = router.handle.reload().await.unwrap_err().to_string();
    assert!(
        err.contains("router.yaml")
            && err.contains("line 3")
            && err.contains("worker_selection.aggregated"),
        "{err}"
    );
    assert_eq!(
        router.metric("router_config_reloads_total{outcome=\"error\"}"),
        1.0
    );
    assert_eq!(
        router.metric("router_config_reloads_total{outcome=\"ok\"}"),
        1.0
    );
    let response = post(&http, &url, &json!({"model": "tiny", "prompt": "hello"})).await;
    assert_eq!(response.status(), 200);
    assert_eq!(header(&response, "x-router-config"), "2");
    // A config without workers is refused for serve.
    std::fs::write(&router.config, "block_size: 4\n").unwrap();
    let err = router.handle.reload().await.unwrap_err().to_string();
    assert!(err.contains("needs at least one engine"), "{err}");
    assert_eq!(router.metric("router_config_generation"), 2.0);
    router.stop().await;
}

/// `router-host serve` as a process; its address from the line it prints on stderr.
struct Process {
    child: std::process::Child,
    addr: String,
    stderr: std::sync::mpsc::Receiver<String>,
}

impl Process {
    fn start(config: &std::path::Path) -> Process {
        let mut child = Command::new(common::router_host_bin())
            .args(["serve", "--config"])
            .arg(config)
            .args(["--listen", "127.0.0.1:0"])
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start router-host serve");
        let (lines, stderr) = std::sync::mpsc::channel();
        let pipe = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                if lines.send(line).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        let addr = loop {
            let line = stderr
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .expect("serve prints where it listens within 30 s");
            if let Some(rest) = line.split("listening on http://").nth(1) {
                break rest.split_whitespace().next().unwrap().to_owned();
            }
        };
        Process {
            child,
            addr,
            stderr,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on our own child's pid.
        let rc = unsafe { libc::kill(self.child.id() as i32, signal) };
        assert_eq!(rc, 0);
    }

    /// Wait for a stderr line containing `text`, at most `limit`.
    fn wait_line(&self, text: &str, limit: Duration) -> Option<String> {
        let deadline = Instant::now() + limit;
        while let Ok(line) = self
            .stderr
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            if line.contains(text) {
                return Some(line);
            }
        }
        None
    }

    fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_and_sigterm_drains_then_exits_0() {
    let engine = Engine::start(1).await;
    let dir = common::temp_dir("serve_signals");
    let config = common::write(
        &dir,
        "router.yaml",
        &policy_yaml("one", "round-robin", &[&engine]),
    );
    let process = tokio::task::spawn_blocking(move || Process::start(&config))
        .await
        .unwrap();
    let http = client();
    let url = process.url("/v1/completions");
    let response = post(&http, &url, &json!({"model": "tiny", "prompt": "hello"})).await;
    assert_eq!(response.status(), 200);
    assert_eq!(header(&response, "x-router-instance"), "one");

    // SIGHUP: the new file is served.
    common::write(
        &dir,
        "router.yaml",
        &policy_yaml("two", "random", &[&engine]),
    );
    process.signal(libc::SIGHUP);
    let mut reloaded = false;
    for _ in 0..500 {
        let response = post(&http, &url, &json!({"model": "tiny", "prompt": "hello"})).await;
        if header(&response, "x-router-instance") == "two" {
            reloaded = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(reloaded, "SIGHUP reloaded the configuration");

    // A broken file: logged with file, line and key; still serving.
    common::write(&dir, "router.yaml", "block_size: 0\nworkers: []\n");
    process.signal(libc::SIGHUP);
    let process = tokio::task::spawn_blocking(move || {
        let line = process.wait_line("reload failed", Duration::from_secs(10));
        (process, line)
    })
    .await
    .unwrap();
    let (mut process, line) = process;
    let line = line.expect("the failed reload is logged");
    assert!(
        line.contains("router.yaml")
            && line.contains("line 1 column 13")
            && line.contains("block_size"),
        "{line}"
    );
    let response = post(&http, &url, &json!({"model": "tiny", "prompt": "hello"})).await;
    assert_eq!(header(&response, "x-router-instance"), "two");

    // SIGTERM while a stream is in flight: it finishes, then the process exits 0.
    engine.state.controls.chunks.store(10, Ordering::SeqCst);
    engine
        .state
        .controls
        .chunk_delay_ms
        .store(50, Ordering::SeqCst);
    let response = post(
        &http,
        &url,
        &json!({"model": "tiny", "prompt": "hello", "stream": true}),
    )
    .await;
    let mut stream = response.bytes_stream();
    let mut received = stream.next().await.unwrap().unwrap().to_vec();
    process.signal(libc::SIGTERM);
    while let Some(chunk) = stream.next().await {
        received.extend_from_slice(&chunk.expect("the stream is not cut by the shutdown"));
    }
    let text = String::from_utf8(received).unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    let status = tokio::task::spawn_blocking(move || {
        let status = process.wait_exit(Duration::from_secs(20));
        (process, status)
    })
    .await
    .unwrap()
    .1
    .expect("serve exits after draining");
    assert_eq!(status.code(), Some(0));
    assert!(
        http.get(url.replace("/v1/completions", "/health"))
            .send()
            .await
            .is_err(),
        "nothing listens any more"
    );
}

/// A reload refused for a misspelled plugin logs the whole cause, each context once, in the very
/// words `check` prints for the same file: the log line used to stop at `plugins[0] (line 3)`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_reload_logs_the_whole_cause_as_check_prints_it() {
    let engine = Engine::start(1).await;
    let dir = common::temp_dir("serve_reload_cause");
    let config = common::write(
        &dir,
        "router.yaml",
        &policy_yaml("one", "round-robin", &[&engine]),
    );
    let started = config.clone();
    let process = tokio::task::spawn_blocking(move || Process::start(&started))
        .await
        .unwrap();
    let broken = format!(
        "block_size: 4\nplugins:\n  - name: two_tier_cost_fm\n{}",
        workers_yaml(&[&engine])
    );
    common::write(&dir, "router.yaml", &broken);
    let (code, _, check) = common::run_cli(&["check", "--config", config.to_str().unwrap()]);
    assert_eq!(code, 1, "{check}");
    let cause = check
        .trim_end()
        .strip_prefix("error: ")
        .unwrap_or_else(|| panic!("check prints one error line: {check}"))
        .to_owned();
    assert_eq!(
        cause,
        format!(
            "config {}: plugins[0] (line 3): plugin `two_tier_cost_fm` not found; tried: {}, {}",
            config.display(),
            dir.join("libtwo_tier_cost_fm.so").display(),
            common::router_host_bin()
                .parent()
                .unwrap()
                .join("libtwo_tier_cost_fm.so")
                .display()
        )
    );
    process.signal(libc::SIGHUP);
    let line = tokio::task::spawn_blocking(move || {
        process.wait_line("reload failed", Duration::from_secs(10))
    })
    .await
    .unwrap()
    .expect("the failed reload is logged");
    assert!(
        line.contains(&format!(
            "reload failed; still serving the running configuration error={cause} serving=1"
        )),
        "{line}"
    );
}

/// A reload whose file was replaced by a FIFO nobody writes is refused at once, naming it, and
/// the running configuration keeps serving: the reload used to block in `open` forever, holding
/// `router_config_reloads_loading` at 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_of_a_fifo_is_refused_at_once_and_keeps_serving() {
    let engine = Engine::start(1).await;
    let router = TestRouter::start(
        "serve_reload_fifo",
        &policy_yaml("one", "round-robin", &[&engine]),
    )
    .await;
    std::fs::remove_file(&router.config).unwrap();
    let c_path = std::ffi::CString::new(router.config.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path; mkfifo only creates the node.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
    let reload = tokio::time::timeout(WAIT, router.handle.reload()).await;
    let Ok(result) = reload else {
        // Let the stuck open return (a writer appears), so that the test ends and fails.
        let _unblock = std::fs::OpenOptions::new().write(true).open(&router.config);
        panic!("the reload of a FIFO was still loading after {WAIT:?}");
    };
    assert_eq!(
        result.unwrap_err().to_string(),
        format!(
            "config {}: not a regular file (a FIFO); give the YAML file itself",
            router.config.display()
        )
    );
    assert_eq!(router.metric("router_config_reloads_loading"), 0.0);
    assert_eq!(
        router.metric("router_config_reloads_total{outcome=\"error\"}"),
        1.0
    );
    let response = post(
        &client(),
        &router.url("/v1/completions"),
        &json!({"model": "tiny", "prompt": "hello"}),
    )
    .await;
    assert_eq!(response.status(), 200);
    assert_eq!(header(&response, "x-router-config"), "1");
    router.stop().await;
}

/// A reload keeps the session bindings when the session settings are unchanged (the new
/// configuration shares the table, with the in-flight counts of requests still running on the
/// old one); new settings start a new table. (The KV index's carry-over is the subscribers',
/// `serve_kv_events.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_keeps_session_bindings_unless_the_session_settings_change() {
    let (e1, e2) = (Engine::start(1).await, Engine::start(2).await);
    let yaml = |ttl: u32| {
        format!(
            "block_size: 4\nsession_affinity:\n  mode: hard\n  ttl_secs: {ttl}\nworker_selection:\n  aggregated: rr\n  instances:\n    - name: rr\n      type: round-robin\n{}",
            workers_yaml(&[&e1, &e2])
        )
    };
    let router = TestRouter::start("serve_reload_sessions", &yaml(600)).await;
    let http = client();
    let url = router.url("/v1/completions");
    let turn = |session: &'static str| {
        let http = http.clone();
        let url = url.clone();
        async move {
            let response = http
                .post(&url)
                .header("x-session-id", session)
                .header("content-type", "application/json")
                .body(json!({"model": "tiny", "prompt": "hello"}).to_string())
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 200);
            let worker = header(&response, "x-router-worker");
            let _ = response.bytes().await;
            worker
        }
    };
    let bound = turn("s-1").await;
    let first = router.handle.loaded();

    // Same session settings: the new configuration shares the table and the binding holds.
    assert_eq!(router.handle.reload().await.unwrap(), 2);
    let second = router.handle.loaded();
    assert!(second.host.shares_sessions_with(&first.host));
    for _ in 0..4 {
        // Round-robin alone would alternate; the hard binding pins the session.
        assert_eq!(turn("s-1").await, bound, "the session moved after a reload");
    }

    // New settings: a new, empty table.
    std::fs::write(&router.config, yaml(60)).unwrap();
    assert_eq!(router.handle.reload().await.unwrap(), 3);
    let third = router.handle.loaded();
    assert!(!third.host.shares_sessions_with(&second.host));
    assert!(third.host.sessions().unwrap().binding("s-1").is_none());
    assert!(eventually(WAIT, || router.handle.in_flight() == 0).await);
    drop((first, second, third));
    router.stop().await;
}

/// A reload whose tokenizer files are unchanged keeps the loaded tokenizer, with its word and
/// segment caches (docs/serve.md, "Reload"); other files load afresh, caches empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_an_unchanged_tokenizer_and_its_caches() {
    let bpe = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/bpe-tokenizer");
    let engine = Engine::start(1).await;
    let yaml = |dir: &std::path::Path, loaded: u32| {
        format!(
            "# config {loaded}\nblock_size: 4\nserve:\n  tokenizer:\n    path: {}\n{}",
            dir.display(),
            workers_yaml(&[&engine])
        )
    };
    let router = TestRouter::start("serve_reload_tokenizer", &yaml(&bpe, 1)).await;
    let http = client();
    let url = router.url("/v1/completions");
    let body = json!({"model": "tiny", "prompt": "the router keeps each session on the engine that caches it"});
    let send = || async {
        let response = post(&http, &url, &body).await;
        assert_eq!(response.status(), 200);
        let _ = response.bytes().await;
    };
    let words = |outcome: &str| {
        router.metric(&format!(
            "router_tokenizer_words_total{{outcome=\"{outcome}\"}}"
        ))
    };

    send().await;
    let misses = words("miss");
    assert!(
        misses > 0.0,
        "a new tokenizer's first prompt misses its words"
    );
    assert_eq!(words("hit"), 0.0);

    std::fs::write(&router.config, yaml(&bpe, 2)).unwrap();
    assert_eq!(router.handle.reload().await.unwrap(), 2);
    send().await;
    assert_eq!(words("miss"), misses, "the same files: the cache is kept");
    assert!(
        words("hit") >= misses,
        "every word comes from the kept cache"
    );

    // The same files under another directory: loaded afresh, so the same words miss again.
    let copy = router.config.parent().unwrap().join("tokenizer-copy");
    std::fs::create_dir_all(&copy).unwrap();
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(bpe.join(file), copy.join(file)).unwrap();
    }
    std::fs::write(&router.config, yaml(&copy, 3)).unwrap();
    assert_eq!(router.handle.reload().await.unwrap(), 3);
    assert_eq!(words("miss"), 0.0, "a new tokenizer counts from zero");
    send().await;
    assert_eq!(words("miss"), misses);

    // Changed contents in the same directory: loaded afresh too.
    let config = copy.join("tokenizer_config.json");
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push('\n');
    std::fs::write(&config, text).unwrap();
    std::fs::write(&router.config, yaml(&copy, 4)).unwrap();
    assert_eq!(router.handle.reload().await.unwrap(), 4);
    assert_eq!(words("miss"), 0.0, "changed files: a new tokenizer");
    router.stop().await;
}
