//! Policy instances and plugin images over the life of `serve`: an instance out of service
//! (poisoned, quarantined) is named in `/ready` and in `router_policy_instance_state`; a reload
//! recreates every instance (clearing poison and quarantine) and loads a plugin file replaced on
//! disk as a new image, counted in `router_plugin_images_mapped` and capped by
//! `plugin_images_max`, while an unchanged file maps nothing new (docs/reliability.md, "Plugin
//! lifecycle on reload").

mod common;

use std::path::Path;
use std::time::Duration;

use common::engine::{client, eventually, header, post, workers_yaml, Engine, TestRouter};
use serde_json::{json, Value};

/// The image count is process-wide: tests that load plugins run one at a time, so one test's
/// first load of a fixture is never counted as another's reload.
static IMAGES: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const WAIT: Duration = Duration::from_secs(10);

fn faulty_yaml(instance: &str, extra: &str, engines: &[&Engine]) -> String {
    format!(
        "block_size: 4\nplugins:\n  - path: {}\nworker_selection:\n  aggregated: x\n  instances:\n    - {{name: x, {instance}}}\n{extra}{}",
        common::plugin("fixture_faulty").display(),
        workers_yaml(engines)
    )
}

async fn ready(router: &TestRouter) -> (u16, Value) {
    let response = client().get(router.url("/ready")).send().await.unwrap();
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap())
}

fn instance<'a>(body: &'a Value, name: &str) -> &'a Value {
    body["policies"]
        .as_array()
        .and_then(|all| all.iter().find(|i| i["instance"] == name))
        .unwrap_or_else(|| panic!("no instance {name} in {body}"))
}

fn state_metric(router: &TestRouter, policy: &str, state: &str) -> f64 {
    router.metric(&format!(
        "router_policy_instance_state{{instance=\"x\",policy=\"{policy}\",state=\"{state}\"}}"
    ))
}

async fn complete(router: &TestRouter) -> reqwest::Response {
    post(
        &client(),
        &router.url("/v1/completions"),
        &json!({"model": "tiny", "prompt": "hello"}),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_out_of_service_is_named_in_ready_and_its_state_metric_and_a_reload_clears_it()
{
    let _images = IMAGES.lock().await;
    let engine = Engine::start(1).await;
    let router = TestRouter::start(
        "lifecycle_ready",
        &faulty_yaml("type: panics-in-pick", "", &[&engine]),
    )
    .await;
    assert!(eventually(WAIT, || router.metric("router_engine_healthy") == 1.0).await);
    let (status, body) = ready(&router).await;
    assert_eq!((status, &body["degraded"]), (200, &json!(false)), "{body}");
    assert_eq!(instance(&body, "x")["state"], "in_service");
    assert_eq!(state_metric(&router, "panics-in-pick", "in_service"), 1.0);

    // Poisoned: still ready (the fallback serves), but degraded, with the instance and why.
    let response = complete(&router).await;
    assert_eq!(response.status(), 200);
    assert!(header(&response, "x-router-fallback").contains("panicked"));
    let (status, body) = ready(&router).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        (&body["ready"], &body["degraded"], &body["out_of_service"]),
        (&json!(true), &json!(true), &json!(["x"])),
        "{body}"
    );
    let x = instance(&body, "x");
    assert_eq!(
        (
            &x["state"],
            &x["serving"],
            &x["roles"],
            &x["plugin"]["name"]
        ),
        (
            &json!("poisoned"),
            &json!("fallback"),
            &json!(["aggregated"]),
            &json!("fixture-faulty")
        ),
        "{x}"
    );
    assert_eq!(x["reason"], "panicked: pick exploded on purpose", "{x}");
    assert_eq!(state_metric(&router, "panics-in-pick", "poisoned"), 1.0);
    assert_eq!(state_metric(&router, "panics-in-pick", "in_service"), 0.0);

    // A reload recreates the instance: in service again.
    assert_eq!(router.handle.reload().await.unwrap(), 2);
    let (status, body) = ready(&router).await;
    assert_eq!((status, &body["degraded"]), (200, &json!(false)), "{body}");
    assert_eq!(state_metric(&router, "panics-in-pick", "in_service"), 1.0);

    // serve explains every decision: a slow explain is counted and quarantines the instance.
    std::fs::write(
        &router.config,
        faulty_yaml(
            "type: slow-explain, parameters: {sleep_us: 50000}, pick_budget_us: 1000, quarantine_after: 3",
            "",
            &[&engine],
        ),
    )
    .unwrap();
    assert_eq!(router.handle.reload().await.unwrap(), 3);
    for _ in 0..3 {
        let response = complete(&router).await;
        assert_eq!(header(&response, "x-router-reason"), "slow");
    }
    let slow = "router_policy_slow_explains_total{instance=\"x\",policy=\"slow-explain\"}";
    assert_eq!(router.metric(slow), 3.0);
    let response = complete(&router).await;
    assert!(
        header(&response, "x-router-fallback").contains("quarantined"),
        "{:?}",
        response.headers()
    );
    let (status, body) = ready(&router).await;
    assert_eq!(status, 200, "{body}");
    let x = instance(&body, "x");
    assert_eq!(x["state"], "quarantined", "{x}");
    assert!(
        x["reason"]
            .as_str()
            .unwrap()
            .starts_with("3 consecutive decisions over pick_budget_us 1000"),
        "{x}"
    );
    assert_eq!(state_metric(&router, "slow-explain", "quarantined"), 1.0);

    // Out of service with nothing to fall back to: every request of the role fails, so the
    // router is not ready, and says which role.
    std::fs::write(
        &router.config,
        faulty_yaml("type: panics-in-pick, on_error: fail", "", &[&engine]),
    )
    .unwrap();
    assert_eq!(router.handle.reload().await.unwrap(), 4);
    assert!(!complete(&router).await.status().is_success());
    let (status, body) = ready(&router).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["unservable_roles"], json!(["aggregated"]), "{body}");
    assert_eq!(instance(&body, "x")["serving"], "none");
    router.stop().await;
}

/// Install `from` at `to` the way installers and `cargo` do: a new file renamed over the old.
fn install(from: &Path, to: &Path) {
    let tmp = to.with_extension("tmp");
    std::fs::copy(from, &tmp).unwrap();
    std::fs::rename(&tmp, to).unwrap();
}

fn probe_yaml(plugin: &Path, extra: &str, engines: &[&Engine]) -> String {
    format!(
        "block_size: 4\n{extra}plugins:\n  - path: {}\nworker_selection:\n  aggregated: x\n  instances:\n    - {{name: x, type: probe, parameters: {{return_index: 1}}}}\n{}",
        plugin.display(),
        workers_yaml(engines)
    )
}

/// Images of `file_name` mapped in this process, as the kernel sees them: one executable mapping
/// per image (of the file, of a replaced file `(deleted)`, or of a sealed copy `/memfd:NAME`).
fn executable_mappings(file_name: &str) -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains(file_name) && l.split_whitespace().nth(1) == Some("r-xp"))
        .count()
}

fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_loads_a_replaced_plugin_as_one_new_image_up_to_the_cap() {
    let _images = IMAGES.lock().await;
    let (e1, e2) = (Engine::start(1).await, Engine::start(2).await);
    let dir = common::temp_dir("lifecycle_upgrade");
    let plugin = dir.join("libpolicy.so");
    install(&common::plugin("fixture_probe"), &plugin);
    let router = TestRouter::start(
        "lifecycle_upgrade_router",
        &probe_yaml(&plugin, "", &[&e1, &e2]),
    )
    .await;
    let images = || router.metric("router_plugin_images_mapped");
    let decide = || async {
        let response = complete(&router).await;
        assert_eq!(response.status(), 200);
        (
            header(&response, "x-router-reason"),
            header(&response, "x-router-worker"),
        )
    };
    // The probe explains itself and returns index 1 (worker 2).
    assert_eq!(decide().await, ("probe".to_owned(), "2".to_owned()));
    let before = images();
    assert!(before >= 1.0);
    let mapped = || executable_mappings("libpolicy.so");
    assert_eq!(mapped(), 1);
    assert_eq!(
        router.metric("router_plugin_images_max"),
        router_host::loader::DEFAULT_PLUGIN_IMAGES_MAX as f64
    );

    // An unchanged file: no new image.
    assert_eq!(router.handle.reload().await.unwrap(), 2);
    assert_eq!((images(), mapped()), (before, 1));

    // A new build at the same path: the reload runs it (another plugin exporting `probe`, which
    // does not explain and always returns index 0), as one more image.
    install(&common::plugin("fixture_duplicate"), &plugin);
    assert_eq!(router.handle.reload().await.unwrap(), 3);
    assert_eq!(decide().await, ("none".to_owned(), "1".to_owned()));
    assert_eq!((images(), mapped()), (before + 1.0, 2));
    let (_, body) = ready(&router).await;
    assert_eq!(
        instance(&body, "x")["plugin"]["name"],
        "fixture-duplicate",
        "{body}"
    );
    assert_eq!(router.handle.reload().await.unwrap(), 4);
    assert_eq!(
        (images(), mapped()),
        (before + 1.0, 2),
        "unchanged since: nothing new"
    );

    // With a sha256 the sealed copy is its own image, mapped once for the same contents.
    let sha = {
        let file = std::fs::File::open(&plugin).unwrap();
        router_host::loader::sha256_hex(&file).unwrap()
    };
    let sealed = probe_yaml(&plugin, "", &[&e1, &e2]).replace(
        &format!("  - path: {}\n", plugin.display()),
        &format!("  - path: {}\n    sha256: \"{sha}\"\n", plugin.display()),
    );
    std::fs::write(&router.config, &sealed).unwrap();
    assert_eq!(router.handle.reload().await.unwrap(), 5);
    assert_eq!((images(), mapped()), (before + 2.0, 3));
    assert_eq!(router.handle.reload().await.unwrap(), 6);
    assert_eq!(
        (images(), mapped()),
        (before + 2.0, 3),
        "same contents: the same sealed image"
    );

    // The cap: a reload that would map one more image fails, naming the cap and the fix, and
    // the running configuration keeps serving.
    let cap = (before + 2.0) as usize;
    std::fs::write(
        &router.config,
        probe_yaml(&plugin, &format!("plugin_images_max: {cap}\n"), &[&e1, &e2]),
    )
    .unwrap();
    assert_eq!(
        router.handle.reload().await.unwrap(),
        7,
        "no new image needed"
    );
    install(&common::plugin("fixture_probe"), &plugin);
    let err = router.handle.reload().await.unwrap_err();
    let text = error_chain(&err);
    assert!(
        text.contains(&format!(
            "already has {cap} plugin images mapped, the most plugin_images_max ({cap}) allows"
        )) && text.contains("restart router-host to load it"),
        "{text}"
    );
    assert_eq!((images(), mapped()), (before + 2.0, 3));
    assert_eq!(
        router.metric("router_config_reloads_total{outcome=\"error\"}"),
        1.0
    );
    assert_eq!(decide().await, ("none".to_owned(), "1".to_owned()));
    router.stop().await;
}
