//! `workers_file:`: the workers listed in a file of their own, watched and reloaded without
//! SIGHUP by `serve` and `epp` (the same runtime reload SIGHUP runs): an added and a removed
//! worker are picked up, and a bad file keeps the running set and counts a failed reload.

mod common;

use std::path::Path;
use std::time::Duration;

use common::engine::{client, eventually, post, workers_yaml, Engine, TestRouter};
use common::epp::Picker;
use serde_json::json;

/// Far above the watch's poll (250 ms) and debounce (one more poll) plus a reload.
const WAIT: Duration = Duration::from_secs(20);

/// Replace `file` whole (write a sibling, then rename), as an operator's tooling should.
fn replace(file: &Path, text: &str) {
    let next = file.with_extension("next");
    std::fs::write(&next, text).expect("write the next workers file");
    std::fs::rename(&next, file).expect("rename it over the workers file");
}

fn ids(loaded: &router_runtime::LoadedConfig) -> Vec<u64> {
    loaded.config.workers.iter().map(|w| w.id).collect()
}

const POLICY: &str =
    "worker_selection:\n  aggregated: rr\n  instances:\n    - {name: rr, type: round-robin}\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_follows_the_workers_file_and_keeps_its_set_when_the_file_is_bad() {
    let (e1, e2) = (Engine::start(1).await, Engine::start(2).await);
    let dir = common::temp_dir("workers_file_serve");
    let file = common::write(&dir, "workers.yaml", &workers_yaml(&[&e1]));
    let yaml = format!("{POLICY}workers_file: {}\n", file.display());
    let router = TestRouter::start("workers_file_serve_config", &yaml).await;
    assert_eq!(ids(&router.handle.loaded()), [1]);
    let http = client();
    let url = router.url("/v1/completions");
    let ok = "router_config_reloads_total{outcome=\"ok\"}";

    // Added: no SIGHUP, the watch reloads and both engines take requests.
    replace(&file, &workers_yaml(&[&e1, &e2]));
    assert!(
        eventually(WAIT, || ids(&router.handle.loaded()) == [1, 2]).await,
        "worker 2 was not picked up from the file: {:?}",
        ids(&router.handle.loaded())
    );
    assert_eq!(router.metric(ok), 1.0);
    let before = e2
        .state
        .seen
        .completions
        .load(std::sync::atomic::Ordering::SeqCst);
    for _ in 0..4 {
        let response = post(&http, &url, &json!({"model": "tiny", "prompt": "hi"})).await;
        assert_eq!(response.status(), 200);
        let _ = response.bytes().await;
    }
    let after = e2
        .state
        .seen
        .completions
        .load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        after >= before + 2,
        "round-robin over two engines sent {} to the new one",
        after - before
    );

    // Removed.
    replace(&file, &workers_yaml(&[&e2]));
    assert!(
        eventually(WAIT, || ids(&router.handle.loaded()) == [2]).await,
        "worker 1 was not removed: {:?}",
        ids(&router.handle.loaded())
    );
    assert_eq!(router.metric(ok), 2.0);

    // Bad (the second entry's URL): the reload fails, is counted, and worker 2 keeps serving.
    let bad = format!("{}  - id: 3\n    url: not-a-url\n", workers_yaml(&[&e2]));
    replace(&file, &bad);
    assert!(
        eventually(WAIT, || router
            .metric("router_config_reloads_total{outcome=\"error\"}")
            == 1.0)
        .await,
        "the bad workers file was not counted as a failed reload"
    );
    assert_eq!(ids(&router.handle.loaded()), [2]);
    assert_eq!(router.metric(ok), 2.0);
    let response = post(&http, &url, &json!({"model": "tiny", "prompt": "hi"})).await;
    assert_eq!(response.status(), 200);
    let _ = response.bytes().await;

    // SIGHUP's reload reports why, naming the file and the entry.
    let err = router
        .handle
        .reload()
        .await
        .expect_err("the file is still bad");
    let text = err.to_string();
    assert!(text.contains("workers.yaml"), "{text}");
    assert!(text.contains("workers[1].url"), "{text}");
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn epp_follows_the_workers_file_given_relative_to_the_config() {
    let (e1, e2) = (Engine::start(1).await, Engine::start(2).await);
    let dir = common::temp_dir("workers_file_epp");
    let file = common::write(&dir, "workers.yaml", &workers_yaml(&[&e1]));
    let picker = Picker::start_in(&dir, &format!("{POLICY}workers_file: workers.yaml\n"), 0).await;
    let ids_now = || ids(&picker.app.current.load());
    assert_eq!(ids_now(), [1]);
    replace(&file, &workers_yaml(&[&e2]));
    assert!(
        eventually(WAIT, || ids_now() == [2]).await,
        "the picker did not follow the file: {:?}",
        ids_now()
    );
    replace(&file, "workers: []\n");
    assert!(
        eventually(WAIT, || picker
            .metric("router_config_reloads_total{outcome=\"error\"}")
            == 1.0)
        .await,
        "an empty workers file was not a failed reload"
    );
    assert_eq!(ids_now(), [2]);
    picker.stop().await;
}
