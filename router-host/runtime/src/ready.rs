//! What `/ready` reports, for every front end: whether the router can route now (a
//! configuration loaded, an engine healthy and not draining, not stopping, every role with a policy instance
//! that can serve it), and the engines and policy instances behind that answer, and each KV
//! index row's state (which never changes the answer: a row not current is routed load-only,
//! not refused). At start it also waits for the rows that fill their KV index from their
//! engine's replay buffer (warm start), each at most its `kv_events.warm_start_ms`. Each front
//! end answers it in its own framing (`200` when ready, `503` when not).

use crate::app::App;

/// The status pages every front end serves on its HTTP port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusPage {
    /// `GET /metrics`: every metric, OpenMetrics text.
    Metrics,
    /// `GET /health`: the process is alive.
    Health,
    /// `GET /ready`: [`readiness`], `200` or `503`.
    Ready,
}

/// The content type of `/metrics`.
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// One status page as `(HTTP status, content type, body)`, for a front end to frame: the one
/// definition of what `/metrics`, `/health` and `/ready` answer.
pub fn status_page(app: &App, page: StatusPage) -> (u16, &'static str, String) {
    match page {
        StatusPage::Metrics => (200, METRICS_CONTENT_TYPE, app.metrics.encode()),
        StatusPage::Health => (200, "application/json", r#"{"status":"ok"}"#.to_owned()),
        StatusPage::Ready => {
            let report = readiness(app);
            let status = if report.ready { 200 } else { 503 };
            (status, "application/json", report.body.to_string())
        }
    }
}

/// The `/ready` answer: `ready` and its JSON body.
pub struct Readiness {
    pub ready: bool,
    pub body: serde_json::Value,
}

/// What `/ready` says about the policy instances of one configuration.
struct PolicyStates {
    /// One object per instance: name, type, origin, the roles it serves, its state and why.
    instances: Vec<serde_json::Value>,
    /// Names of the instances out of service (poisoned, quarantined or hung).
    out_of_service: Vec<String>,
    /// Roles whose instance is out of service with nothing to fall back to (`on_error: fail`):
    /// every request of the role fails, so the router is not ready.
    unservable_roles: Vec<&'static str>,
}

fn policy_states(router: &router_policies::policy_set::PolicySet) -> PolicyStates {
    use router_config::OnError;
    use router_core::model::RequestRole;
    use router_policies::instance::InstanceState;
    let mut states = PolicyStates {
        instances: Vec::new(),
        out_of_service: Vec::new(),
        unservable_roles: Vec::new(),
    };
    for (id, instance) in router.instances().iter().enumerate() {
        let roles: Vec<&'static str> = RequestRole::ALL
            .into_iter()
            .filter(|role| router.instance_for(*role) == id)
            .map(RequestRole::as_str)
            .collect();
        let state = instance.state();
        // The built-in default (index 0) is the fallback: it has none of its own.
        let falls_back = instance.on_error == OnError::Fallback && id != 0;
        let serving = match (state, falls_back) {
            (InstanceState::InService, _) => "self",
            (_, true) => "fallback",
            (_, false) => "none",
        };
        if state != InstanceState::InService {
            states.out_of_service.push(instance.name.clone());
            if !falls_back {
                states.unservable_roles.extend(roles.iter().copied());
            }
        }
        // The library the instance runs (after a reload of a replaced file: the new one).
        let plugin = router
            .catalog()
            .libraries()
            .iter()
            .find(|l| l.path.as_os_str() == instance.origin.as_str())
            .map(|l| serde_json::json!({"name": l.plugin_name, "version": l.plugin_version}));
        states.instances.push(serde_json::json!({
            "instance": instance.name,
            "policy": instance.type_name,
            "origin": instance.origin,
            "plugin": plugin,
            "roles": roles,
            "state": state.as_str(),
            "reason": instance.state_reason(),
            "serving": serving,
        }));
    }
    states
}

/// Each row with `kv_events` configured and its KV index state, as decisions read it now
/// (rows without events are not indexed and not listed).
fn kv_index_states(loaded: &crate::state::LoadedConfig) -> Vec<serde_json::Value> {
    let core = loaded.host.core();
    let mut rows = Vec::new();
    for w in loaded
        .config
        .workers
        .iter()
        .filter(|w| w.kv_events.is_some())
    {
        for rank in 0..w.dp_size {
            let row = router_core::model::RowId {
                worker_id: w.id,
                dp_rank: rank,
            };
            let Some(state) = core.kv_index_state(row) else {
                continue;
            };
            rows.push(serde_json::json!({
                "worker": w.id,
                "dp_rank": rank,
                "state": state.as_str(),
            }));
        }
    }
    rows
}

/// The readiness of `app` now.
pub fn readiness(app: &App) -> Readiness {
    let loaded = app.current.load();
    let draining = |id: u64| {
        loaded
            .config
            .workers
            .iter()
            .any(|w| w.id == id && w.draining)
    };
    let mut serving = false;
    let engines: Vec<serde_json::Value> = app
        .health
        .snapshot()
        .into_iter()
        .map(|(id, url, healthy)| {
            let draining = draining(id);
            serving |= healthy && !draining;
            serde_json::json!({
                "worker": id,
                "url": url,
                "healthy": healthy,
                "draining": draining,
                "error": app.health.last_error(id),
            })
        })
        .collect();
    let policies = policy_states(loaded.host.policy_set());
    // An engine that is healthy and not draining: one that can take a new request.
    let warming = app.kv_subscribers.warming();
    let ready = serving
        && !app.stopping.is_cancelled()
        && policies.unservable_roles.is_empty()
        && warming == 0;
    let body = serde_json::json!({
        "ready": ready,
        "degraded": !policies.out_of_service.is_empty(),
        "config_generation": loaded.number,
        "engines": engines,
        "policies": policies.instances,
        "out_of_service": policies.out_of_service,
        "unservable_roles": policies.unservable_roles,
        "kv_index": kv_index_states(&loaded),
        "kv_warm_start": {"rows_warming": warming},
    });
    Readiness { ready, body }
}
