//! Policy instances over the life of `serve`: an instance out of service (poisoned,
//! quarantined) is named in `/ready` and in `router_policy_instance_state`, and a reload
//! recreates every instance, clearing poison and quarantine (docs/reliability.md).

mod common;

use std::time::Duration;

use common::engine::{client, eventually, header, post, workers_yaml, Engine, Router};
use serde_json::{json, Value};

/// Tests that load plugins run one at a time.
static IMAGES: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const WAIT: Duration = Duration::from_secs(10);

fn faulty_yaml(instance: &str, extra: &str, engines: &[&Engine]) -> String {
    format!(
        "block_size: 4\nplugins:\n  - path: {}\nworker_selection:\n  aggregated: x\n  instances:\n    - {{name: x, {instance}}}\n{extra}{}",
        common::plugin("fixture_faulty").display(),
        workers_yaml(engines)
    )
}

async fn ready(router: &Router) -> (u16, Value) {
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

fn state_metric(router: &Router, policy: &str, state: &str) -> f64 {
    router.metric(&format!(
        "router_policy_instance_state{{instance=\"x\",policy=\"{policy}\",state=\"{state}\"}}"
    ))
}

async fn complete(router: &Router) -> reqwest::Response {
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
    let router = Router::start(
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
