//! Hangs: a policy call that never returns. The watchdog marks the instance hung; a
//! library host keeps serving (its requests go to the fallback, its hooks are no longer called),
//! and `router-host select`, whose only thread is the stuck one, exits with status 3 naming the
//! instance and the call.
//!
//! The fixture's `hangs` policy parks its thread for good in the callback it is told to. Those
//! threads are leaked by design and never finish; the test process still exits, because a
//! process ends when the harness's `main` returns, whatever its other threads are doing. Every
//! wait below is bounded by a generous deadline, and no test asserts a duration other than
//! "happened before the deadline" (or the watchdog's own report that a call ran past its
//! threshold).

mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use router_host::config::RouterConfig;
use router_host::host::{Host, NoOverlap, RouteError, Submitted};
use router_host::loader::SearchPath;
use router_host::model::{Cluster, NoSignals, Request, RowId, Worker};
use router_host::policy_set::{Decision, PolicyFailure, PolicySet, Scratch, Selection};
use router_host::watchdog::Call;

/// How long anything here may take before the test gives up: far more than a hang threshold of
/// 100 ms plus a few watchdog ticks needs, even on a loaded machine.
const DEADLINE: Duration = Duration::from_secs(60);

const LOWEST: RowId = RowId {
    worker_id: 7,
    dp_rank: 0,
};

/// A config whose aggregated role uses instance `name`, of the fixture type `hangs` with
/// `parameters` and a hang threshold of 100 ms. Every test names its instance differently, so
/// its log lines are told apart from the other tests' (they share the process's log). The
/// fallback breaks ties on the lowest row, so its choice on idle rows is [`LOWEST`].
fn config(name: &str, parameters: &str) -> RouterConfig {
    let yaml = format!(
        "default_selector: {{tie_break: lowest_row}}\nplugins:\n  - path: {}\nworker_selection:\n  aggregated: {name}\n  instances:\n    \
         - {{name: {name}, type: hangs, parameters: {{{parameters}}}, hang_after_ms: 100}}\n",
        common::plugin("fixture_faulty").display()
    );
    RouterConfig::from_yaml_str(&yaml, None).expect("valid config")
}

fn policy_set(name: &str, parameters: &str) -> PolicySet {
    PolicySet::from_config(&config(name, parameters), &SearchPath::default())
        .expect("router starts")
}

fn cluster() -> Cluster {
    Cluster::new(vec![Worker::new(9), Worker::new(7)]).expect("cluster")
}

fn request(id: u64) -> Request {
    Request {
        id: Some(id),
        isl_tokens: 64,
        ..Default::default()
    }
}

fn select(router: &PolicySet, id: u64, explain: bool) -> Decision {
    let request = request(id);
    let selection = if explain {
        Selection::of(&request).explained()
    } else {
        Selection::of(&request)
    };
    router
        .select(&cluster(), selection, &NoSignals, &mut Scratch::default())
        .expect("a decision")
}

/// The instance serving the aggregated role.
fn configured(router: &PolicySet) -> usize {
    router.instance_for(router_host::model::RequestRole::Aggregated)
}

/// Poll `done` until it holds; fail the test if it does not before the deadline.
fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !done() {
        assert!(Instant::now() < deadline, "gave up waiting: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The thread's result, failing the test if it has not finished before the deadline (it is then
/// leaked, like the stuck ones).
fn join_within<T>(what: &str, handle: JoinHandle<T>) -> T {
    wait_for(what, || handle.is_finished());
    match handle.join() {
        Ok(value) => value,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

fn assert_hung_fallback(decision: &Decision, call: &str) {
    assert_eq!(decision.decided_by, 0, "the built-in default decided");
    match &decision.fallback {
        Some(
            failure @ PolicyFailure::Hung {
                call: hung_in,
                hang_after_ms,
                ..
            },
        ) => {
            assert_eq!(*hung_in, call, "{failure}");
            assert_eq!(*hang_after_ms, 100, "{failure}");
            let text = failure.to_string();
            assert!(
                text.starts_with(&format!("policy hung in {call}: it ran for ")),
                "{text}"
            );
            assert!(
                text.ends_with(
                    "past the instance's hang_after_ms of 100; the instance is out of service"
                ),
                "{text}"
            );
        }
        other => panic!("expected the hung instance's failure, got {other:?}"),
    }
}

// ---- the watchdog's log line ----------------------------------------------------------------------

use common::logs::{log_lines_with, logs};

/// The one error line the watchdog logs when it marks instance `name` hung in `call`.
fn assert_hang_logged_once(name: &str, call: &str) {
    let needle = format!("instance={name} ");
    let lines: Vec<String> = log_lines_with(&needle)
        .into_iter()
        .filter(|l| l.contains("policy instance hung"))
        .collect();
    assert_eq!(lines.len(), 1, "{lines:#?}");
    let line = &lines[0];
    assert!(line.contains("ERROR"), "{line}");
    assert!(line.contains("libfixture_faulty.so"), "{line}");
    assert!(line.contains(&format!("call=\"{call}\"")), "{line}");
    assert!(
        line.contains(&format!("its {call} has run for ")) && line.contains(" ran_ms="),
        "{line}"
    );
}

// ---- library: mark hung, keep serving ---------------------------------------------------------------

#[test]
fn a_pick_that_never_returns_marks_the_instance_hung_and_later_requests_fall_back() {
    logs();
    let router = Arc::new(policy_set("stuck-pick", "at: pick, after: 1"));
    let x = configured(&router);
    // The first pick returns: the policy decides.
    let d = select(&router, 1, false);
    assert_eq!((d.decided_by, d.fallback.clone()), (x, None));

    // The second never returns.
    let stuck = std::thread::spawn({
        let router = router.clone();
        move || select(&router, 2, false)
    });
    wait_for("the instance is marked hung", || {
        router.instance(x).is_hung()
    });
    assert!(!stuck.is_finished(), "the pick is still stuck");
    let hang = router
        .instance(x)
        .hang()
        .cloned()
        .expect("the hang is recorded");
    assert_eq!((hang.call, hang.request), (Call::Pick, Some(2)));
    assert!(hang.ran > Duration::from_millis(100), "{hang:?}");

    // Another thread is served, by the fallback, and is counted.
    let served = std::thread::spawn({
        let router = router.clone();
        move || select(&router, 3, false)
    });
    let d = join_within("a request after the hang is served", served);
    assert_hung_fallback(&d, "pick");
    assert_eq!(d.row, LOWEST, "the default's choice on idle rows");
    assert_eq!(d.instance, x, "still the configured instance's request");
    let stats = router.instance(x).stats.snapshot();
    assert_eq!(
        (stats.picks, stats.fallbacks, stats.hangs, stats.errors),
        (2, 1, 1, 0)
    );
    assert_hang_logged_once("stuck-pick", "pick");
    // The stuck thread is lost by design: it is left parked.
    drop(stuck);
}

#[test]
fn an_explain_that_never_returns_marks_the_instance_hung() {
    logs();
    let router = Arc::new(policy_set("stuck-explain", "at: explain"));
    let x = configured(&router);
    let stuck = std::thread::spawn({
        let router = router.clone();
        move || select(&router, 11, true)
    });
    wait_for("the instance is marked hung", || {
        router.instance(x).is_hung()
    });
    assert!(!stuck.is_finished());
    let hang = router
        .instance(x)
        .hang()
        .cloned()
        .expect("the hang is recorded");
    assert_eq!((hang.call, hang.request), (Call::Explain, Some(11)));

    let served = std::thread::spawn({
        let router = router.clone();
        move || select(&router, 12, true)
    });
    let d = join_within("a request after the hang is served", served);
    assert_hung_fallback(&d, "explain");
    assert_eq!(d.row, LOWEST);
    let stats = router.instance(x).stats.snapshot();
    assert_eq!((stats.picks, stats.fallbacks, stats.hangs), (1, 1, 1));
    assert_hang_logged_once("stuck-explain", "explain");
    drop(stuck);
}

/// A host whose instance `x` hangs in `hook`, and the thread stuck in it (for request id 7).
fn host_stuck_in(hook: &str) -> (Arc<Host>, usize, JoinHandle<()>) {
    let config = config(&format!("stuck-{hook}"), &format!("at: {hook}"));
    let router = PolicySet::from_config(&config, &SearchPath::default()).expect("router starts");
    let host = Arc::new(Host::new(router, cluster(), &config));
    let x = configured(host.policy_set());
    let stuck = std::thread::spawn({
        let host = host.clone();
        move || {
            let routed = host.route(&request(7), &NoOverlap, false).expect("routed");
            assert_eq!(routed.decision.fallback, None);
            host.complete(routed.id);
        }
    });
    wait_for("the instance is marked hung", || {
        host.policy_set().instance(x).is_hung()
    });
    assert!(!stuck.is_finished());
    (host, x, stuck)
}

#[test]
fn a_hook_that_never_returns_marks_the_instance_hung_and_is_not_called_again() {
    logs();
    for (hook, call) in [
        ("dispatch", Call::OnDispatch),
        ("complete", Call::OnComplete),
    ] {
        let (host, x, stuck) = host_stuck_in(hook);
        let hang = host
            .policy_set()
            .instance(x)
            .hang()
            .cloned()
            .expect("recorded");
        assert_eq!((hang.call, hang.request), (call, Some(7)), "{hook}");
        // The fixture blocks in every call of that hook: a request that gets through both hooks'
        // places proves neither is called any more (and that no lock is held by the stuck one).
        let served = std::thread::spawn({
            let host = host.clone();
            move || {
                let routed = host.route(&request(8), &NoOverlap, false).expect("routed");
                assert!(host.complete(routed.id));
                routed.decision
            }
        });
        let d = join_within("a request after the hang is served", served);
        assert_hung_fallback(&d, call.as_str());
        // Stuck in on_dispatch, request 7 stays booked on 7:0, so the default picks the idle
        // row; stuck in on_complete, its load was already released.
        let idle = if hook == "dispatch" {
            RowId {
                worker_id: 9,
                dp_rank: 0,
            }
        } else {
            LOWEST
        };
        assert_eq!(d.row, idle, "{hook}");
        let stats = host.policy_set().instance(x).stats.snapshot();
        assert_eq!(
            (stats.picks, stats.fallbacks, stats.hangs),
            (1, 1, 1),
            "{hook}"
        );
        assert_hang_logged_once(&format!("stuck-{hook}"), call.as_str());
        drop(stuck);
    }
}

/// A pick that hangs while a drain re-evaluates a queued request: that request is lost, but its
/// lane moves on once the call has run past the longest `hang_after_ms` (the watchdog's own
/// verdict), so the queue behind it, later drains and new arrivals are served.
#[test]
fn a_pick_that_never_returns_in_a_queue_drain_does_not_stop_the_queue() {
    logs();
    let yaml = format!(
        "plugins:\n  - path: {}\nworker_selection:\n  aggregated: stuck-drain\n  instances:\n    \
         - {{name: stuck-drain, type: hangs, parameters: {{at: pick, after: 1}}, hang_after_ms: 100}}\n\
         policy_classes:\n  - {{name: default, prefill_busy_threshold: 100, max_queue_wait_ms: 600000}}\n",
        common::plugin("fixture_faulty").display()
    );
    let config = RouterConfig::from_yaml_str(&yaml, None).expect("valid config");
    let router = PolicySet::from_config(&config, &SearchPath::default()).expect("router starts");
    let mut worker = Worker::new(7);
    worker.max_num_batched_tokens = Some(1000);
    let cluster = Cluster::new(vec![worker]).expect("cluster");
    let host = Arc::new(Host::new(router, cluster, &config));
    let x = configured(host.policy_set());
    let core = host.core();
    let sized = |isl| Request {
        isl_tokens: isl,
        ..Default::default()
    };
    let busy = match core
        .submit(sized(500), &NoOverlap, false)
        .expect("submitted")
    {
        Submitted::Dispatched(routed) => routed,
        other => panic!("expected a dispatch, got {other:?}"),
    };
    let queued = |isl| match core
        .submit(sized(isl), &NoOverlap, false)
        .expect("submitted")
    {
        Submitted::Queued(ticket) => ticket,
        other => panic!("expected to queue, got {other:?}"),
    };
    let (lost, behind) = (queued(10), queued(10));
    assert!(host.complete(busy.id));
    // This drain takes the first queued request out and hangs in its pick.
    let stuck = std::thread::spawn({
        let host = host.clone();
        move || host.core().drain(false)
    });
    wait_for("the instance is marked hung", || {
        host.policy_set().instance(x).is_hung()
    });
    let served = std::thread::spawn({
        let host = host.clone();
        move || host.core().drain(false)
    });
    let drained = join_within("a drain after the hang returns", served);
    assert_eq!(drained.len(), 1, "{drained:?}");
    assert_eq!(
        drained[0].ticket,
        behind.id(),
        "the request behind the lost one"
    );
    let routed = drained[0].result.clone().expect("dispatched");
    assert_hung_fallback(&routed.decision, "pick");
    assert_eq!(behind.try_take(), Some(Ok(routed.clone())));
    let stats = core.admission_stats();
    assert_eq!((stats.queued, stats.waiting, stats.stalled), (2, 0, 1));
    // The lane holds nothing now: an arrival with room goes straight to a row.
    match core
        .submit(sized(10), &NoOverlap, false)
        .expect("submitted")
    {
        Submitted::Dispatched(next) => assert_hung_fallback(&next.decision, "pick"),
        other => panic!("expected a dispatch, got {other:?}"),
    }
    assert!(!stuck.is_finished(), "the hung pick is still stuck");
    // Its caller gives up: after the stall limit, not never.
    let waited = core.wait(&lost, Duration::from_millis(10));
    assert_eq!(waited, Err(RouteError::EvaluationStalled { stall_ms: 100 }));
    drop(stuck);
}

/// A `serve` configuration whose aggregated role is served by `instance`, an instance of `kind`
/// (`type: ...` and its settings: a built-in type, or one of the fixture's).
fn serve_yaml(instance: &str, kind: &str, workers: &str) -> String {
    format!(
        "block_size: 4\nplugins:\n  - path: {}\nworker_selection:\n  aggregated: {instance}\n  instances:\n    \
         - {{name: {instance}, {kind}}}\n{workers}",
        common::plugin("fixture_faulty").display()
    )
}

/// Write `yaml` and start a reload of it in the background; return once a log line holds both
/// `needles` (logged from inside its `create`: the reload has read the file by then).
async fn reload_in_background(
    router: &common::engine::TestRouter,
    yaml: &str,
    needles: [&str; 2],
) -> tokio::task::JoinHandle<Result<u64, router_host::serve::ServeError>> {
    std::fs::write(&router.config, yaml).expect("write the config");
    let reload = tokio::spawn({
        let handle = router.handle.clone();
        async move { handle.reload().await }
    });
    let deadline = Instant::now() + DEADLINE;
    while log_lines_with(needles[0])
        .iter()
        .all(|l| !l.contains(needles[1]))
    {
        assert!(
            Instant::now() < deadline,
            "gave up waiting for the log: {needles:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    reload
}

/// `serve` reloading into a configuration whose plugin `create` never returns: that reload is
/// reported (the watchdog's line, the loading gauge) and never finishes, but it holds nothing
/// up: the configuration serving keeps serving, and the next reload, of a fixed file, is
/// swapped in.
#[test]
fn a_reload_stuck_in_create_does_not_hold_up_the_next_reload() {
    logs();
    // Never dropped: dropping a runtime waits for its blocking threads, one of which is stuck.
    let server = std::mem::ManuallyDrop::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime"),
    );
    server.block_on(async {
        let engine = common::engine::Engine::start(1).await;
        let workers = common::engine::workers_yaml(&[&engine]);
        let first = serve_yaml("first", "type: default", &workers);
        let router = common::engine::TestRouter::start("hangs_reload", &first).await;
        let hangs = "type: hangs, parameters: {at: create}, hang_after_ms: 100";
        let stuck_yaml = serve_yaml("stuck-reload", hangs, &workers);
        let needles = ["instance=stuck-reload ", "policy instance hung"];
        let stuck = reload_in_background(&router, &stuck_yaml, needles).await;
        assert_eq!(router.metric("router_config_reloads_loading"), 1.0);
        assert_eq!(
            router.handle.loaded().number,
            1,
            "still the first configuration"
        );

        let second = serve_yaml("second", "type: default", &workers);
        std::fs::write(&router.config, second).expect("write the config");
        let next = tokio::time::timeout(DEADLINE, router.handle.reload())
            .await
            .expect("the next reload is not held up by the stuck one");
        assert_eq!(next.expect("reloaded"), 2);
        let served = tokio::time::timeout(
            DEADLINE,
            common::engine::post(
                &common::engine::client(),
                &router.url("/v1/completions"),
                &serde_json::json!({"model": "tiny", "prompt": "hello"}),
            ),
        )
        .await
        .expect("answered");
        assert_eq!(
            common::engine::header(&served, "x-router-instance"),
            "second"
        );
        assert!(!stuck.is_finished(), "the stuck reload is still loading");
        assert_eq!(router.metric("router_config_reloads_loading"), 1.0);
        drop((router, engine));
    });
    std::mem::ManuallyDrop::into_inner(server).shutdown_background();
}

/// Two reloads loading side by side: the one started later finishes first and is swapped in;
/// the earlier one (a slow `create`) finishes after it, read an older file, and is discarded.
#[test]
fn a_reload_that_finishes_after_a_later_one_is_discarded() {
    logs();
    let server = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    server.block_on(async {
        let engine = common::engine::Engine::start(1).await;
        let workers = common::engine::workers_yaml(&[&engine]);
        let first = serve_yaml("first", "type: default", &workers);
        let router = common::engine::TestRouter::start("hangs_superseded", &first).await;
        let slow = "type: slow-create, parameters: {sleep_ms: 5000}, hang_after_ms: 600000";
        let slow_yaml = serve_yaml("slow-reload", slow, &workers);
        let needles = ["slow create started", "slow-reload"];
        let slow = reload_in_background(&router, &slow_yaml, needles).await;

        let second = serve_yaml("second", "type: default", &workers);
        std::fs::write(&router.config, second).expect("write the config");
        let next = tokio::time::timeout(DEADLINE, router.handle.reload()).await;
        assert_eq!(next.expect("in time").expect("reloaded"), 2);
        assert!(!slow.is_finished(), "the slow reload finished first: the test proves nothing");
        let late = tokio::time::timeout(DEADLINE, slow)
            .await
            .expect("the slow reload ends")
            .expect("its task");
        let err = late.expect_err("a superseded reload is not swapped in");
        assert_eq!(
            err.to_string(),
            "reload 1 finished after a later one was swapped in (configuration 2 is serving); it was discarded"
        );
        assert_eq!(router.handle.loaded().number, 2);
        assert_eq!(
            router.metric("router_config_reloads_total{outcome=\"superseded\"}"),
            1.0
        );
        assert_eq!(router.metric("router_config_reloads_loading"), 0.0);
        router.stop().await;
    });
}

#[test]
fn a_constructor_that_never_returns_is_reported() {
    logs();
    let config = config("stuck-create", "at: create");
    // Startup itself is what blocks; the host (library default) only reports it.
    let starting = std::thread::spawn(move || {
        let _ = PolicySet::from_config(&config, &SearchPath::default());
    });
    wait_for("the hang in create is logged", || {
        !log_lines_with("instance=stuck-create ").is_empty()
    });
    assert!(!starting.is_finished(), "startup is still stuck");
    assert_hang_logged_once("stuck-create", "create");
    drop(starting);
}

// ---- the CLI: exit 3, naming the instance and the call ------------------------------------------------

/// Run `router-host` and wait for it, killing it and failing if it is still running at the
/// deadline. Returns (exit code, stdout, stderr).
fn run_cli_bounded(args: &[&str]) -> (i32, String, String) {
    let mut child = Command::new(common::router_host_bin())
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start router-host");
    let deadline = Instant::now() + DEADLINE;
    loop {
        match child.try_wait().expect("wait for router-host") {
            Some(_) => break,
            None if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("router-host {args:?} was still running after {DEADLINE:?}: it hung");
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    let out = child.wait_with_output().expect("router-host output");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn select_cli(test: &str, instance: &str) -> (i32, Vec<serde_json::Value>, String) {
    let dir = common::temp_dir(test);
    let config = common::write(
        &dir,
        "router.yaml",
        &format!(
            "plugins:\n  - path: {}\nworker_selection:\n  aggregated: stuck\n  instances:\n{instance}",
            common::plugin("fixture_faulty").display()
        ),
    );
    let scenario = common::write(
        &dir,
        "scenario.json",
        r#"{"workers": [{"worker_id": 29}],
            "requests": [{"isl_tokens": 16}, {"isl_tokens": 16}, {"isl_tokens": 16}]}"#,
    );
    let path = |p: &PathBuf| p.to_str().expect("utf-8 path").to_owned();
    let (code, out, err) = run_cli_bounded(&[
        "select",
        "--config",
        &path(&config),
        "--scenario",
        &path(&scenario),
    ]);
    let lines = out
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    (code, lines, err)
}

fn assert_cli_names(err: &str, call: &str) {
    assert!(
        err.contains("error: policy instance `stuck` (type `hangs`, from "),
        "{err}"
    );
    assert!(
        err.contains(&format!("libfixture_faulty.so) hung in {call}")),
        "{err}"
    );
    assert!(
        err.contains("past its hang_after_ms of 200; exiting with status 3"),
        "{err}"
    );
}

#[test]
fn select_exits_3_naming_the_instance_when_a_pick_hangs_after_printing_what_it_decided() {
    let (code, lines, err) = select_cli(
        "hang-pick",
        "    - {name: stuck, type: hangs, parameters: {at: pick, after: 1}, hang_after_ms: 200}\n",
    );
    assert_eq!(code, 3, "{err}");
    assert_cli_names(&err, "pick");
    // Request 0 was decided before the hang, and its line was flushed as it was decided.
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["request"], 0);
    assert_eq!(lines[0]["instance"], "stuck");
    assert_eq!(lines[0]["policy"], "hangs");
}

#[test]
fn select_exits_3_naming_the_request_when_a_hook_hangs() {
    let (code, lines, err) = select_cli(
        "hang-dispatch",
        "    - {name: stuck, type: hangs, parameters: {at: dispatch, after: 1}, hang_after_ms: 200}\n",
    );
    assert_eq!(code, 3, "{err}");
    assert_cli_names(&err, "on_dispatch (request id ");
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["request"], 0);
}

#[test]
fn select_exits_3_when_a_constructor_hangs() {
    let (code, lines, err) = select_cli(
        "hang-create",
        "    - {name: stuck, type: hangs, parameters: {at: create}, hang_after_ms: 200}\n",
    );
    assert_eq!(code, 3, "{err}");
    assert_cli_names(&err, "create");
    assert!(lines.is_empty(), "{lines:?}");
}

#[test]
fn replay_exits_3_naming_the_instance_when_a_pick_hangs() {
    let dir = common::temp_dir("hang-replay");
    let config = common::write(
        &dir,
        "stuck.yaml",
        &format!(
            "plugins:\n  - path: {}\nworker_selection:\n  aggregated: stuck\n  instances:\n    - {{name: stuck, type: hangs, parameters: {{at: pick, after: 3}}, hang_after_ms: 200}}\n",
            common::plugin("fixture_faulty").display()
        ),
    );
    let config = config.to_str().expect("utf-8 path").to_owned();
    let (code, out, err) = run_cli_bounded(&["replay", "-c", &config]);
    assert_eq!(code, 3, "stdout: {out}\nstderr: {err}");
    assert_cli_names(&err, "pick");
}
